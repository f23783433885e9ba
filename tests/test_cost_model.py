"""The cost model: profile tables, the linear and interp fitters, the coefficient JSON, the fit cache."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from simulator.costs.cost_model import InterpCostModel, fit_cost_model, fit_report, load_cost_model, predict_row
from policies.errors import InputWarning, UserError
from tests.conftest import REPO
from simulator.costs.profile_table import ProfileTable, read_profile, write_profile

DATA = Path(__file__).resolve().parent.parent / "profiles" / "data"
EXAMPLE_JSON = DATA / "example.json"
EXAMPLE_GRID = DATA / "example_grid.csv"

#: Known linear coefficients (seconds) of a synthetic profile, in the JSON's block layout.
TRUTH = {
    "target": {"base": 0.012, "per_batched_token": 8e-5, "per_context_token": 3e-7, "per_seq": 2e-4},
    "draft": {"base": 0.0015, "per_batched_token": 2e-5, "per_context_token": 4e-8},
    "prefill": {"base": 0.01, "per_prompt_token": 1e-4, "per_prompt_token_sq": 2e-8, "per_seq": 2e-3},
    "overhead": {"base": 0.001, "per_seq": 1e-5},
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty fit cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECSIM_CACHE_DIR", str(path))
    return path


def truth_seconds(role: str, phase: str, b: float, q: float, c: float) -> float:
    """Seconds of one profile row under :data:`TRUTH` (natural per-sequence coordinates)."""
    if phase == "overhead":
        t = TRUTH["overhead"]
        return t["base"] + t["per_seq"] * b
    if phase == "prefill":
        t = TRUTH["prefill"]
        return t["base"] + t["per_seq"] * b + t["per_prompt_token"] * b * q + t["per_prompt_token_sq"] * b * q * q
    t = TRUTH[role]
    return t["base"] + t.get("per_seq", 0.0) * b + t["per_batched_token"] * b * q + t["per_context_token"] * b * c


def synthetic_frame(seconds_of=truth_seconds) -> pd.DataFrame:
    """Rows on a grid like a profiler's; ``seconds_of(role, phase, b, q, c)`` gives each row's seconds."""
    rows = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for c in (128, 512, 2048):
            rows += [("target", "decode", b, q, c) for q in range(1, 6)] + [("draft", "decode", b, 1, c)]
        rows += [("target", "prefill", b, p, 0) for p in (32, 128, 512, 2048)] + [("target", "overhead", b, 0, 0)]
    frame = pd.DataFrame(rows, columns=["role", "phase", "batch_size", "query_len", "context_len"])
    frame["seconds"] = [seconds_of(*row) for row in rows]
    return frame


def table_of(frame: pd.DataFrame, path: str = "synthetic.csv") -> ProfileTable:
    return ProfileTable(frame=frame, meta={"method": "analytical"}, path=path)


def roofline_seconds(role: str, phase: str, b: int, q: int, c: int) -> float:
    """The formula that generated profiles/data/example_grid.csv (stated in its meta's ``source``)."""
    bandwidth, flops = 1.5e12, 150e12  # bytes/s, FLOP/s
    if phase == "overhead":
        return 0.001 + 1e-5 * b
    weights, params, kv, layers, hidden, launch = {
        "target": (13.5e9, 6.74e9, 524288, 32, 4096, 0.004),
        "draft": (0.136e9, 68e6, 6144, 2, 768, 0.0015)}[role]
    if phase == "decode":
        return launch + max((weights + kv * b * c) / bandwidth, 2 * params * b * q / flops)
    return launch + max(weights / bandwidth, (2 * params * b * q + 2 * layers * hidden * b * q * q) / flops)


def roofline_rows() -> list[tuple[str, str, int, int, int]]:
    """The example grid: decode contexts 128/512/2048 without KV over 60 GiB, prefill up to 32768 tokens."""
    rows = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for c in (128, 512, 2048):
            if b * c * 524288 <= 60 * 2 ** 30:
                rows += [("target", "decode", b, q, c) for q in range(1, 6)]
            rows.append(("draft", "decode", b, 1, c))
        for role in ("target", "draft"):
            rows += [(role, "prefill", b, p, 0) for p in (128, 512, 2048) if b * p <= 32768]
        rows.append(("target", "overhead", b, 0, 0))
    return rows


# -- the linear fitter ---------------------------------------------------------------------------
def test_linear_fit_recovers_known_coefficients_from_noise_free_rows():
    model = fit_cost_model(table_of(synthetic_frame()), "linear")
    fitted = model.to_dict()
    for block, coefficients in TRUTH.items():
        for name, value in coefficients.items():
            assert fitted[block][name] == pytest.approx(value, rel=1e-9), (block, name)
    # Every draft row has q = 1, so per_seq and per_batched_token are one feature: the fit keeps the latter.
    assert fitted["draft"]["per_seq"] == 0.0
    assert model.method == "analytical" and model.source == "synthetic.csv"


def test_linear_fit_is_within_five_percent_with_noisy_rows():
    rng = np.random.default_rng(7)
    frame = pd.concat([synthetic_frame()] * 4, ignore_index=True)  # four repeats of each point
    frame["seconds"] *= rng.lognormal(0.0, 0.01, len(frame))  # 1% measurement noise
    fitted = fit_cost_model(table_of(frame), "linear").to_dict()
    for block, coefficients in TRUTH.items():
        for name, value in coefficients.items():
            assert fitted[block][name] == pytest.approx(value, rel=0.05), (block, name)


def test_linear_model_answers_in_totals_as_sums_over_sequences():
    model = fit_cost_model(table_of(synthetic_frame()), "linear")
    # Two sequences: k = 3 and k = 1 (4 + 2 query tokens) over 1000 + 200 cached tokens.
    t = TRUTH["target"]
    expected = t["base"] + t["per_seq"] * 2 + t["per_batched_token"] * 6 + t["per_context_token"] * 1200
    assert model.target_time(2, 6, 1200) == pytest.approx(expected, rel=1e-9)
    # Prefill of 4 prompts totalling 2048 tokens is priced at P = 512 each.
    assert model.prefill_time(4, 2048) == pytest.approx(truth_seconds("target", "prefill", 4, 512, 0), rel=1e-9)
    assert model.overhead_time(10) == pytest.approx(0.001 + 1e-4)


@pytest.mark.filterwarnings("ignore:.*beyond the profiled grid")
@pytest.mark.parametrize("fitter", ["linear", "interp"])
def test_a_run_of_steps_is_priced_exactly_as_step_by_step(fitter):
    """The engine prices a run's steps in one call; each must be the scalar call's float, bit for bit."""
    model = load_cost_model(EXAMPLE_GRID, fitter)
    contexts = list(range(300, 300 + 7 * 40, 7)) + [7 * 9000]  # the last one beyond the grid
    assert model.target_times(7, 21, contexts) == [model.target_time(7, 21, c) for c in contexts]
    assert model.draft_times(3, contexts) == [model.draft_time(3, c) for c in contexts]


# -- the interp fitter ---------------------------------------------------------------------------
def test_interp_reproduces_every_grid_point_exactly():
    table = read_profile(EXAMPLE_GRID)
    model = load_cost_model(EXAMPLE_GRID, "interp")
    assert isinstance(model, InterpCostModel)
    f = table.frame
    predicted = [predict_row(model, *row) for row in f[["role", "phase", "batch_size", "query_len",
                                                      "context_len"]].itertuples(index=False)]
    assert predicted == pytest.approx(f["seconds"].to_list(), rel=1e-12)


def test_interp_is_monotone_between_grid_points():
    model = load_cost_model(EXAMPLE_GRID, "interp")
    batch = np.linspace(1, 64, 200)
    context = np.linspace(128, 2048, 200)
    for c in (128, 300, 2048):
        assert nondecreasing([model.target_time(b, 3 * b, c * b) for b in batch])
    for b in (1, 3, 32):
        assert nondecreasing([model.target_time(b, 2 * b, c * b) for c in context])
        assert nondecreasing([model.target_time(b, q * b, 512 * b) for q in np.linspace(1, 5, 50)])
    prompt = np.linspace(128, 2048, 200)
    assert nondecreasing([model.prefill_time(4, p * 4) for p in prompt])


def nondecreasing(seconds: list[float]) -> bool:
    """Monotone up to float rounding (blending equal corner values can wobble in the last bit)."""
    return bool(np.all(np.diff(seconds) >= -1e-12 * np.max(seconds)))


def test_interp_of_a_linear_profile_is_that_linear_model_everywhere():
    """Multilinear interpolation is exact for functions linear in each axis, as the decode form is."""
    table = table_of(synthetic_frame())
    interp, linear = fit_cost_model(table, "interp"), fit_cost_model(table, "linear")
    for b, q, c in [(3, 2.5, 300), (1, 1, 128), (50, 4.2, 2000), (7, 1, 1000)]:
        assert interp.target_time(b, q * b, c * b) == pytest.approx(linear.target_time(b, q * b, c * b), rel=1e-9)
        assert interp.draft_time(b, c * b) == pytest.approx(linear.draft_time(b, c * b), rel=1e-9)


def test_interp_fills_unmeasured_grid_nodes_and_extrapolates_with_the_linear_slope():
    # Drop the largest batch at the largest context (as if it did not fit in memory): an irregular grid.
    frame = synthetic_frame()
    oom = (frame["batch_size"] == 64) & (frame["context_len"] == 2048)
    lost = (frame["batch_size"] == 8) & (frame["query_len"] == 3) & (frame["context_len"] == 512)
    model = fit_cost_model(table_of(frame[~oom & ~lost]), "interp")
    # The OOM corner lies outside the measured points' hull, so the (exact) linear fit fills it.
    assert model.target_time(64, 64 * 3, 64 * 2048) == pytest.approx(truth_seconds("target", "decode", 64, 3, 2048))
    # The lost point lies inside: interpolated from its neighbours.
    assert model.target_time(8, 8 * 3, 8 * 512) == pytest.approx(truth_seconds("target", "decode", 8, 3, 512), rel=0.02)
    # Beyond the grid: the clamped value plus the linear model's change, continuous at the edge.
    edge = model.target_time(64, 64, 64 * 512)
    beyond = model.target_time(80, 80, 80 * 512)
    t = TRUTH["target"]
    slope = t["per_seq"] + t["per_batched_token"] + t["per_context_token"] * 512
    assert beyond - edge == pytest.approx(16 * slope, rel=1e-9)


def test_interp_below_the_grid_scales_the_smallest_point_and_never_goes_negative():
    """Prefill measured at 16-token prompts only, 2 prompts taking 3x one (CPU noise: CI's tiny engine profile).
    The fit's slope exceeds 1 ms / 15 tokens, so shifting the 16-token point down the slope would price a 1-token
    prefill below 0 s; below the grid the point is scaled by the fit's ratio instead."""
    frame = synthetic_frame()
    frame = frame[(frame["phase"] != "prefill") | (frame["batch_size"].isin([1, 2]) & (frame["query_len"] == 32))]
    frame = frame.copy()
    prefill = frame["phase"] == "prefill"
    frame.loc[prefill, "query_len"] = 16
    frame.loc[prefill, "seconds"] = frame.loc[prefill, "batch_size"].map({1: 0.001, 2: 0.003})
    model = fit_cost_model(table_of(frame), "interp")
    fit = model.to_dict()["prefill"]
    base, per_token = fit["base"], fit["per_prompt_token"]
    assert 0.001 - 15 * per_token < 0  # what the shift would predict for 1 token
    assert model.prefill_time(1, 16) == pytest.approx(0.001)
    assert model.prefill_time(1, 1) == pytest.approx(0.001 * (base + per_token) / (base + 16 * per_token))
    assert nondecreasing([model.prefill_time(1, p) for p in range(1, 33)])
    assert model.prefill_time(1, 17) - model.prefill_time(1, 16) == pytest.approx(per_token)  # above: shifted


def test_between_grid_points_interp_follows_the_roofline_that_linear_cannot():
    """The example grid is a roofline, memory- then compute-bound: a kink no linear form follows."""
    linear, interp = load_cost_model(EXAMPLE_GRID, "linear"), load_cost_model(EXAMPLE_GRID, "interp")
    rng = np.random.default_rng(0)
    points = [(int(rng.integers(1, 33)), rng.uniform(1, 5), rng.uniform(128, 2048)) for _ in range(300)]

    def mean_error(model) -> float:
        return float(np.mean([abs(model.target_time(b, q * b, c * b) / roofline_seconds("target", "decode", b, q, c)
                                  - 1) for b, q, c in points]))

    assert mean_error(interp) < 0.01
    assert mean_error(interp) < mean_error(linear) / 5


# -- held-out report -----------------------------------------------------------------------------
def test_fit_report_has_one_row_per_role_and_phase_with_held_out_errors():
    table = table_of(synthetic_frame())
    report = fit_report(table, "linear", holdout=0.2, seed=0)
    assert list(report.columns) == ["role", "phase", "n_train", "n_test", "mean_rel_error", "max_rel_error"]
    assert list(zip(report["role"], report["phase"])) == [
        ("target", "decode"), ("draft", "decode"), ("target", "prefill"), ("target", "overhead")]
    assert report["n_train"].to_list() == [84, 17, 22, 6]
    assert report["n_test"].to_list() == [21, 4, 6, 1]
    assert report["max_rel_error"].max() < 1e-9  # noise-free linear rows: the linear fit is exact
    assert fit_report(table, "interp", seed=3).equals(fit_report(table, "interp", seed=3))


# -- the coefficient JSON ------------------------------------------------------------------------
def test_example_json_is_a_plausible_llama2_7b_on_an_a100():
    model = load_cost_model(EXAMPLE_JSON)
    assert model.method == "hand-written" and "Llama-2-7B" in model.source
    assert 0.010 < model.target_time(1, 1, 512) < 0.020  # weight reads dominate batch-1 decode
    assert 0.001 < model.draft_time(1, 512) < 0.002
    assert model.target_time(64, 64, 64 * 2048) > 3 * model.target_time(1, 1, 2048)
    assert 0.05 < model.prefill_time(1, 512) < 0.1
    assert model.memory.device_memory_gb == 80
    assert model.memory.target_kv_bytes_per_token == 2 * 32 * 4096 * 2
    assert model.memory.draft_kv_bytes_per_token == 2 * 2 * 768 * 2
    assert [model.has("target", p) for p in ("decode", "prefill", "overhead")] == [True, True, True]
    assert model.has("draft", "decode") and model.has("draft", "prefill")


@pytest.mark.parametrize("fitter", ["linear", "interp"])
def test_save_then_load_gives_identical_predictions(tmp_path, fitter):
    model = load_cost_model(EXAMPLE_GRID, fitter)
    model.save(tmp_path / "model.json")
    again = load_cost_model(tmp_path / "model.json")
    assert type(again) is type(model)
    assert again.to_dict() == model.to_dict()
    queries = [(1, 1, 128), (5, 13, 5000), (64, 320, 64 * 1000), (100, 100, 100 * 3000)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [again.target_time(*q) for q in queries] == [model.target_time(*q) for q in queries]
        assert [again.draft_time(b, c) for b, _, c in queries] == [model.draft_time(b, c) for b, _, c in queries]
        assert [again.prefill_time(b, c, "draft") for b, _, c in queries] == \
               [model.prefill_time(b, c, "draft") for b, _, c in queries]
    assert [row["role"] + "/" + row["phase"] for row in again.fit_error] == [
        "target/decode", "draft/decode", "target/prefill", "draft/prefill", "target/overhead"]


def test_a_model_without_draft_blocks_refuses_draft_decode_and_prices_draft_prefill_at_zero(tmp_path):
    path = tmp_path / "nodraft.json"
    path.write_text(json.dumps({"target": {"base": 0.02}, "prefill": {"per_prompt_token": 1e-4}}))
    model = load_cost_model(path)
    assert not model.has("draft", "decode") and not model.has("draft", "prefill")
    assert not model.has("target", "overhead") and model.overhead_time(8) == 0.0
    assert model.prefill_time(2, 1000, role="draft") == 0.0
    assert model.target_time(4, 20, 4000) == 0.02
    assert model.method == "hand-written" and model.source == str(path)
    with pytest.raises(UserError, match="nodraft.json: no draft decode costs"):
        model.draft_time(1, 100)


# -- the fit cache -------------------------------------------------------------------------------
def test_cache_hit_returns_equal_predictions_and_a_changed_csv_misses(tmp_path, cache_dir, monkeypatch):
    import simulator.costs.cost_model as cm

    csv = tmp_path / "p.csv"
    write_profile(synthetic_frame(), {"method": "analytical"}, csv)
    fits = []
    real_fit = cm.fit_cost_model
    monkeypatch.setattr(cm, "fit_cost_model", lambda *a, **k: fits.append(a[1]) or real_fit(*a, **k))

    first = load_cost_model(csv, "interp")
    fits_after_first = len(fits)
    second = load_cost_model(csv, "interp")
    assert len(fits) == fits_after_first  # hit: nothing refitted
    assert second.to_dict() == first.to_dict()
    assert second.target_time(3, 7, 999) == first.target_time(3, 7, 999)

    load_cost_model(csv, "linear")
    assert len(fits) > fits_after_first  # another fitter: a miss
    fits_before_change = len(fits)
    frame = synthetic_frame()
    frame.loc[0, "seconds"] *= 1.5
    write_profile(frame, {"method": "analytical"}, csv)
    changed = load_cost_model(csv, "interp")
    assert len(fits) > fits_before_change  # changed CSV: a miss
    assert changed.target_time(1, 1, 128) != first.target_time(1, 1, 128)
    assert len(list(cache_dir.glob("*.json"))) == 3


def test_a_corrupt_cache_entry_is_ignored_and_rewritten(tmp_path, cache_dir):
    csv = tmp_path / "p.csv"
    write_profile(synthetic_frame(), {}, csv)
    model = load_cost_model(csv)
    (entry,) = cache_dir.glob("*.json")
    entry.write_text('{"target": ')
    assert load_cost_model(csv).to_dict() == model.to_dict()
    assert json.loads(entry.read_text()) == model.to_dict()


# -- out-of-grid queries -------------------------------------------------------------------------
def test_probing_far_outside_the_grid_neither_warns_nor_silences_the_runs_own_warning():
    """A config's check probes the largest shapes it allows (simulator.core.runner.check_costs): quiet, and the run's
    own query far beyond the grid still warns afterwards."""
    from simulator.costs.cost_model import probing

    model = load_cost_model(EXAMPLE_GRID)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probing():
            model.target_time(300, 300, 300 * 128)
        assert caught == []
        model.target_time(200, 200, 200 * 128)
    assert [str(w.message).split(" asked")[0] for w in caught] == [f"--profile {EXAMPLE_GRID}: target decode"]


def test_a_query_far_outside_the_grid_warns_once_per_role_and_phase():
    model = load_cost_model(EXAMPLE_GRID)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.target_time(64, 64, 64 * 4096)  # 2x the largest context: still quiet
        model.prefill_time(64, 64 * 2048)
        assert caught == []
        for b in (200, 300):
            model.target_time(b, b, b * 128)
        model.target_time(4, 4, 4 * 10_000)
        model.draft_time(1, 50_000)
        model.prefill_time(1, 8192)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3 and {w.category for w in caught} == {InputWarning}  # one line at the command line
    assert messages[0].startswith(f"--profile {EXAMPLE_GRID}: target decode asked at batch_size=200, context_len=128 ")
    assert "(batch_size 1..64, context_len 128..2048)" in messages[0]
    assert "draft decode asked at batch_size=1, context_len=50000" in messages[1]
    assert "target prefill asked at batch_size=1, prompt_len=8192" in messages[2]


# -- profile tables ------------------------------------------------------------------------------
def test_write_then_read_profile_round_trips_with_metadata(tmp_path):
    frame = synthetic_frame()
    frame["repeats"] = 5
    meta = {"method": "measured", "device": "test", "memory": {"device_memory_gb": 80, "target_weight_gb": 12.6,
                                                               "target_kv_bytes_per_token": 524288}}
    write_profile(frame, meta, tmp_path / "p.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.csv", "p.meta.json"]  # no temporary files left
    table = read_profile(tmp_path / "p.csv")
    pd.testing.assert_frame_equal(table.frame, frame)
    assert table.meta == meta and table.method == "measured"
    assert table.memory.draft_weight_gb == 0.0
    assert load_cost_model(tmp_path / "p.csv").memory == table.memory


def test_example_grid_follows_the_formula_its_meta_states():
    table = read_profile(EXAMPLE_GRID)
    assert table.method == "analytical" and "roofline" in table.meta["source"]
    rows = roofline_rows()
    f = table.frame
    assert list(f[["role", "phase", "batch_size", "query_len", "context_len"]].itertuples(index=False,
                                                                                          name=None)) == rows
    assert f["seconds"].to_list() == pytest.approx([roofline_seconds(*row) for row in rows], rel=1e-12)


CSV_HEADER = "role,phase,batch_size,query_len,context_len,seconds\n"
GOOD_ROWS = "target,decode,1,1,128,0.013\ntarget,prefill,1,128,0,0.02\n"


@pytest.mark.parametrize("text, message", [
    ("role,phase,batch_size,query_len,context_len\ntarget,decode,1,1,128\n", "missing column 'seconds'"),
    (CSV_HEADER + GOOD_ROWS + "target,decode,2,1,128,fast\n", "row 3 seconds must be a number > 0 (got 'fast')"),
    (CSV_HEADER + GOOD_ROWS + "target,decode,2,1,128,-0.01\n", "row 3 seconds must be a number > 0 (got -0.01)"),
    (CSV_HEADER + GOOD_ROWS + "target,decode,2,1,128,0\n", "row 3 seconds must be a number > 0 (got 0.0)"),
    (CSV_HEADER + GOOD_ROWS + "target,decode,2,1,128,\n", "row 3 seconds must be a number > 0 (got nan)"),
    (CSV_HEADER + "oracle,decode,1,1,128,0.01\n", "row 1 role must be one of target, draft (got 'oracle')"),
    (CSV_HEADER + GOOD_ROWS + "target,verify,1,1,128,0.01\n", "row 3 phase must be one of prefill, decode"),
    (CSV_HEADER + GOOD_ROWS + "target,decode,1.5,1,128,0.01\n", "row 3 batch_size must be an integer >= 1"),
    (CSV_HEADER + GOOD_ROWS + "target,decode,0,1,128,0.01\n", "row 3 batch_size must be an integer >= 1 (got 0)"),
    (CSV_HEADER + GOOD_ROWS + "draft,overhead,1,0,0,0.01\n", "row 3 role must be target for an overhead phase"),
    (CSV_HEADER + GOOD_ROWS + "target,prefill,1,64,64,0.01\n", "row 3 context_len must be 0 for prefill"),
    (CSV_HEADER + "target,decode,1,1,128,0.013\n", "no rows with role target, phase prefill (required)"),
    ("", "empty file"),
])
def test_bad_profile_csv_raises_a_user_error_naming_file_field_and_value(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(UserError) as error:
        load_cost_model(path)
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("meta, message", [
    ({"method": "guessed"}, "bad.meta.json: method must be one of measured, analytical (got 'guessed')"),
    ({"memory": {"device_memory_gb": 80}}, "bad.meta.json: memory: missing target_weight_gb"),
    ({"memory": {"device_memory_gb": 80, "target_weight_gb": 1, "target_kv_bytes_per_token": 1, "hbm": 3}},
     "bad.meta.json: memory: unknown key 'hbm'"),
    ({"memory": {"device_memory_gb": -80, "target_weight_gb": 1, "target_kv_bytes_per_token": 1}},
     "bad.meta.json: memory: device_memory_gb must be a number >= 0 (got -80)"),
])
def test_bad_profile_metadata_raises_a_user_error(tmp_path, meta, message):
    path = tmp_path / "bad.csv"
    path.write_text(CSV_HEADER + GOOD_ROWS)
    (tmp_path / "bad.meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_cost_model(path)


@pytest.mark.parametrize("data, message", [
    ({"prefill": {}}, "missing block 'target'"),
    ({"target": {}}, "missing block 'prefill'"),
    ({"target": {}, "prefill": {}, "verify": {}}, "unknown key 'verify'"),
    ({"target": {"base": 0.01, "per_token": 1e-5}, "prefill": {}}, "target: unknown key 'per_token'"),
    ({"target": {"base": -0.01}, "prefill": {}}, "target.base must be a number >= 0 (got -0.01)"),
    ({"target": {}, "prefill": {"base": "fast"}}, "prefill.base must be a number >= 0 (got 'fast')"),
    ({"target": {}, "prefill": {}, "overhead": {"per_seq": -1}}, "overhead.per_seq must be a number >= 0"),
    ({"target": {}, "prefill": {}, "method": "guessed"}, "method must be one of measured, analytical, hand-written"),
    ({"target": {}, "prefill": {}, "memory": {"device_memory_gb": 80}}, "memory: missing target_weight_gb"),
    ([1, 2], "a cost model must be a JSON object (got list)"),
])
def test_bad_coefficient_json_raises_a_user_error_naming_file_and_key(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as error:
        load_cost_model(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


def test_unreadable_inputs_raise_user_errors(tmp_path):
    (tmp_path / "broken.json").write_text("{'target': 1}")
    with pytest.raises(UserError, match="broken.json: not valid JSON"):
        load_cost_model(tmp_path / "broken.json")
    with pytest.raises(UserError, match="missing.csv: no such cost model file"):
        load_cost_model(tmp_path / "missing.csv")
    with pytest.raises(UserError, match="--fitter: must be one of auto, linear, interp"):
        load_cost_model(EXAMPLE_GRID, "spline")
    with pytest.raises(UserError, match="a cost model is a .json coefficient file or a .csv profile"):
        (tmp_path / "costs.txt").write_text("x")
        load_cost_model(tmp_path / "costs.txt")


# -- speed ---------------------------------------------------------------------------------------
def test_the_per_call_speed_is_a_bench_case(capsys):
    """``run_sim.py bench --calls N`` prints microseconds per cost-model call (the figures are not asserted)."""
    from simulator.studies.bench import main as bench_main

    assert bench_main(["--sizes", "", "--calls", "200"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.endswith("us/call")]
    assert len(lines) == 9 and {line.split()[0] for line in lines} == {"json", "linear", "interp"}


# -- a cost model of one's own -------------------------------------------------------------------
def test_a_cost_model_with_only_scalar_methods_gets_the_batch_methods_and_runs_in_the_engine(cost_json):
    """The engine's runs price steps with target_times/draft_times; a user model writes only the scalar calls."""
    from simulator.costs.cost_model import CostModel

    base = load_cost_model(cost_json(), "linear")

    class Mine(CostModel):
        method, source, path, memory, fit_error = "hand-written", "test", "mine", None, None

        def target_time(self, batch_size, query_tokens, context_tokens):
            return base.target_time(batch_size, query_tokens, context_tokens)

        def draft_time(self, batch_size, context_tokens):
            return base.draft_time(batch_size, context_tokens)

        def prefill_time(self, batch_size, prompt_tokens, role="target"):
            return base.prefill_time(batch_size, prompt_tokens, role)

        def overhead_time(self, batch_size):
            return base.overhead_time(batch_size)

        def has(self, role, phase):
            return base.has(role, phase)

    mine = Mine()
    contexts = [100, 250, 4000]
    assert mine.target_times(4, 12, contexts) == base.target_times(4, 12, contexts)
    assert mine.draft_times(3, contexts) == base.draft_times(3, contexts)
    from tests.test_engine import run_engine_with_cost

    for policy in ("no-spec", "fixed-k"):
        ours, shipped = run_engine_with_cost(mine, policy), run_engine_with_cost(base, policy)
        assert ours.steps == shipped.steps and ours.num_steps == shipped.num_steps


@pytest.mark.parametrize("fitter", ["linear", "interp"])
def test_a_prefill_step_has_its_own_overhead_when_the_profile_measured_it(tmp_path, cache_dir, fitter):
    """Rows of phase prefill_overhead give prefill-only steps their own per-step seconds; without them a prefill
    step's overhead is a decode step's."""
    import pandas as pd

    frame = synthetic_frame()
    assert "prefill_overhead" not in set(frame["phase"]) and "overhead" in set(frame["phase"])
    prefill_overhead = pd.DataFrame([{"role": "target", "phase": "prefill_overhead", "batch_size": b, "query_len": 1,
                                      "context_len": 0, "seconds": 0.0005 + 0.001 * b} for b in (1, 2, 4)])
    plain, both = tmp_path / "plain.csv", tmp_path / "both.csv"
    write_profile(frame, {"method": "analytical"}, plain)
    write_profile(pd.concat([frame, prefill_overhead]), {"method": "analytical"}, both)
    without, with_ = load_cost_model(plain, fitter), load_cost_model(both, fitter)
    assert without.prefill_overhead_time(2) == without.overhead_time(2) > 0
    assert with_.overhead_time(2) == without.overhead_time(2)
    assert with_.prefill_overhead_time(2) == pytest.approx(0.0025)
    assert load_cost_model(with_.to_dict() and _saved(with_, tmp_path)).prefill_overhead_time(4) == \
        pytest.approx(0.0045)


def _saved(model, folder):
    path = folder / "saved.json"
    model.save(path)
    return path


@pytest.mark.parametrize("fitter", ["linear", "interp"])
def test_draft_rows_of_several_tokens_per_sequence_price_the_catch_up_pass(tmp_path, fitter):
    """A profile whose draft passes were timed feeding 1, 2 and 3 tokens per sequence prices a pass of any of
    them (``draft_time(b, context, query_tokens)``) and says so (``prices_catchup``); one timed at 1 token only
    does not, and a pass of one token per sequence costs the same either way. The batch layout (ragged, padded)
    is the metadata's, kept through a save."""
    frame = synthetic_frame()
    catchup = pd.DataFrame([("draft", "decode", b, q, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (128, 512, 2048)
                            for q in (2, 3)], columns=["role", "phase", "batch_size", "query_len", "context_len"])
    catchup["seconds"] = [truth_seconds(*row) for row in catchup.itertuples(index=False)]
    plain, both = tmp_path / "plain.csv", tmp_path / "both.csv"
    write_profile(frame, {"method": "analytical"}, plain)
    write_profile(pd.concat([frame, catchup]), {"method": "analytical", "batch_layout": "padded"}, both)
    without, with_ = load_cost_model(plain, fitter), load_cost_model(both, fitter)
    assert (without.prices_catchup, with_.prices_catchup) == (False, True)
    assert (without.batch_layout, with_.batch_layout) == ("ragged", "padded")
    assert with_.draft_time(4, 4 * 512, 4 * 2) == pytest.approx(truth_seconds("draft", "decode", 4, 2, 512))
    assert with_.draft_time(4, 4 * 512) == with_.draft_time(4, 4 * 512, 4) == \
        pytest.approx(truth_seconds("draft", "decode", 4, 1, 512))
    again = load_cost_model(_saved(with_, tmp_path))
    assert (again.prices_catchup, again.batch_layout) == (True, "padded")


def test_uniform_decode_pricer_is_uniform_decode_times(cost_json):
    """uniform_decode_pricer (what a policy deciding one k for its batch prices every step) equals uniform_decode_times
    at every context total: the shipped linear model's own (its context-free terms worked out once), an interpolating
    model's and a model of one's own (the default: it calls uniform_decode_times)."""
    from simulator.costs.cost_model import CostModel

    base = load_cost_model(cost_json(), "linear")

    class Mine(CostModel):
        def target_time(self, batch_size, query_tokens, context_tokens):
            return base.target_time(batch_size, query_tokens, context_tokens)

        def draft_time(self, batch_size, context_tokens, query_tokens=None):
            return base.draft_time(batch_size, context_tokens, query_tokens)

    models = [base, Mine(), load_cost_model(EXAMPLE_GRID, "interp")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # far queries on the example grid: warnings are test_fast_paths' business
        for model in models:
            for batch, k_max, drafts in ((1, 0, True), (4, 3, True), (32, 5, False), (200, 4, True)):
                price = model.uniform_decode_pricer(batch, k_max, drafts)
                for context in (batch, batch * 700, batch * 30000):
                    assert price(context) == model.uniform_decode_times(batch, context, k_max, drafts)


def test_auto_reads_a_calibrated_profile_with_interp_and_any_other_with_linear():
    """A vLLM-calibrated profile's errors were computed through ``interp``: ``auto`` (the default) takes it there, and
    SmartSpec's linear form elsewhere."""
    from simulator.costs.cost_model import profile_fitter

    data = REPO / "profiles" / "data"
    calibrated = data / "h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b.csv"
    measured = data / "h200__llama-2-7b__llama-68m.csv"
    for path, fitter in ((calibrated, "interp"), (measured, "linear")):
        assert load_cost_model(path).target_time(1, 1, 300) == load_cost_model(path, fitter).target_time(1, 1, 300)
    assert load_cost_model(calibrated, "linear").target_time(1, 1, 300) < 0.95 * load_cost_model(calibrated).target_time(1, 1, 300)
    assert [profile_fitter("auto", {"calibration": {}}), profile_fitter("auto", {}),
            profile_fitter("linear", {"calibration": {}})] == ["interp", "linear", "linear"]
