"""The profiler: grid order, timing rule, layer scaling, the shared forward path, and whole runs on the
tiny pair on CPU (resume, memory skips, bad input)."""
from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pandas as pd
import pytest

from profiles.grid import GPU_GRID, Grid, coarse_levels
from profiles.profiler import ProfileSettings, TimingPolicy, extrapolate_layers, measure, run_profile
from policies.errors import UserError

KEY = ["role", "phase", "batch_size", "query_len", "context_len"]
TINY_GRID = Grid(batch_sizes=(1, 2, 4), query_lens=(1, 2, 3), context_lens=(8, 32), prefill_lens=(8, 16),
                 max_prefill_tokens=32)
FAST = TimingPolicy(warmup=0, min_repeats=1, max_repeats=2, point_seconds=0.05)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSIM_CACHE_DIR", str(tmp_path / "cache"))


def tiny(tmp_path, **changes) -> ProfileSettings:
    base = ProfileSettings(target="tiny-target", draft="tiny-draft", out=str(tmp_path / "tiny.csv"), grid=TINY_GRID,
                           dtype="fp32", device="cpu", threads=1, timing=FAST, quiet=True)
    return replace(base, **changes)


# -- grid, timing rule, scaling arithmetic (no torch) ----------------------------------------------
def test_coarse_levels_take_every_fourth_then_every_second_value():
    assert coarse_levels(9) == [0, 2, 1, 2, 0, 2, 1, 2, 0]
    assert coarse_levels(6) == [0, 2, 1, 2, 0, 0]  # the last value belongs to the first pass


def test_grid_runs_coarse_to_fine_and_covers_every_point_once():
    points = GPU_GRID.points()
    assert len(points) == len(set(p.key for p in points))
    decode = [p for p in points if p.role == "target" and p.phase == "decode"]
    assert len(decode) == 9 * 9 * 6
    # the first pass spans the whole grid: smallest and largest batch, context and k + 1
    first = decode[:3 * 3 * 3]
    assert {p.batch_size for p in first} == {1, 16, 256}
    assert {p.query_len for p in first} == {1, 5, 9}
    assert {p.context_len for p in first} == {128, 2048, 4096}
    # prefill stops at batch x prompt <= 16384 tokens
    prefill = [p for p in points if p.role == "target" and p.phase == "prefill"]
    assert max(p.batch_size * p.query_len for p in prefill) == 16384 and len(prefill) == 33
    assert all(p.query_len == 1 for p in points if p.role == "draft" and p.phase == "decode")


def test_grid_groups_share_one_cache_per_batch_and_context():
    groups = TINY_GRID.groups(("target",))
    decode = [g for g in groups if g.phase == "decode"]
    assert all({(p.batch_size, p.context_len) for p in g.points} == {(g.batch_size, g.context_len)} for g in decode)
    assert [p.query_len for p in decode[0].points] == [1, 3]  # level 0; q = 2 comes later


@pytest.mark.parametrize("values", [(0, 1), (2, 1), (1, 1), (1.5,)])
def test_bad_grid_values_are_user_errors(values):
    with pytest.raises(UserError, match="--batch-sizes: values must be"):
        Grid(batch_sizes=values, query_lens=(1,), context_lens=(8,), prefill_lens=())


def fake_clock(durations):
    """A clock, and a pass that takes the next of ``durations`` seconds on it."""
    now = [0.0]
    passes = iter(durations)

    def run():
        now[0] += next(passes)

    return (lambda: now[0]), run


def test_measure_stops_once_the_running_median_is_stable():
    clock, run = fake_clock([5.0, 1.0, 2.0, 1.0, 1.0, 9.0])
    timing = measure(run, lambda: None, lambda: None, TimingPolicy(warmup=1, min_repeats=3, point_seconds=100), clock)
    # the warm-up's 5 s are not timed; medians: 1.5 -> 1.0 (moved) -> 1.0 (stable): stop after 4 passes
    assert (timing.median, timing.repeats) == (1.0, 4)
    clock, run = fake_clock(itertools.cycle([1.0, 3.0]))
    timing = measure(run, lambda: None, lambda: None, TimingPolicy(warmup=0, max_repeats=7, point_seconds=100), clock)
    assert (timing.median, timing.repeats, timing.p10, timing.p90) == (1.0, 7, 1.0, 3.0)  # never stable: cap
    clock, run = fake_clock(itertools.cycle([1.0, 3.0]))
    timing = measure(run, lambda: None, lambda: None, TimingPolicy(warmup=0, point_seconds=5.0), clock)
    assert timing.repeats == 3  # 1 + 3 + 1 seconds reach the per-point time cap


def test_layer_extrapolation_is_exact_for_fixed_plus_per_layer_costs():
    def seconds(n):
        return 0.004 + 0.0005 * n

    assert extrapolate_layers(seconds(2), seconds(6), 2, 6, 32) == pytest.approx(seconds(32))
    assert extrapolate_layers(0.010, 0.009, 2, 6, 32) == 0.009  # noise making deeper look faster: floor at t(n2)


def test_settings_errors_are_user_errors(tmp_path):
    cases = {
        "--dtype: must be one of bf16, fp16, fp32 (got 'int8')": dict(dtype="int8"),
        "--scale-layers: need two layer counts 1 <= N1 < N2 (got 3,2)": dict(scale_layers=(3, 2)),
        "--check-scaling: needs --scale-layers N1,N2": dict(check_scaling=True),
        "--max-seconds: must be > 0 (got 0)": dict(max_seconds=0),
    }
    for message, change in cases.items():
        with pytest.raises(UserError) as err:
            tiny(tmp_path, **change)
        assert str(err.value) == message


# -- with torch ------------------------------------------------------------------------------------
torch_only = pytest.mark.torch


@torch_only
def test_decode_over_a_prefilled_cache_matches_one_long_forward():
    pytest.importorskip("torch")
    import torch

    from profiles.models import forward

    device = forward.setup_device("cpu", 1)
    model = forward.build_model(forward.load_config("tiny-target", "--target"), "fp32", device)
    gen = torch.Generator().manual_seed(0)
    ids = forward.random_tokens(model, 2, 11, gen)
    whole, _ = forward.prefill_pass(model, ids[:, :8])
    _, cache = forward.prefill_pass(model, ids[:, :8])
    step = forward.decode_pass(model, cache, ids[:, 8:])
    assert cache.get_seq_length() == 11
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
    torch.testing.assert_close(step, reference[:, 8:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(whole[:, -1], reference[:, 7], rtol=1e-4, atol=1e-4)
    forward.crop(cache, 3)
    assert cache.get_seq_length() == 8
    again = forward.decode_pass(model, cache, ids[:, 8:])
    torch.testing.assert_close(again, step)  # cropping restored the cache exactly

    random = forward.random_cache(model, batch_size=3, context_len=40, generator=gen)
    assert random.get_seq_length() == 40 and len(random.layers) == 4
    keys = random.layers[0].keys
    assert keys.shape == (3, 2, 40, 32) and 0.9 < float(keys.std()) < 1.1
    assert forward.decode_pass(model, random, forward.random_tokens(model, 3, 2, gen)).shape == (3, 2, 1000)


@torch_only
def test_tiny_pair_profile_loads_and_fits(tmp_path):
    pytest.importorskip("torch")
    from simulator.costs.cost_model import load_cost_model
    from simulator.costs.profile_table import read_profile

    result = run_profile(tiny(tmp_path))
    table = read_profile(result.path)
    expected = sorted(p.key for p in TINY_GRID.points())
    assert sorted(table.frame[KEY].itertuples(index=False, name=None)) == expected
    assert (table.frame.seconds > 0).all() and (table.frame.seconds_p90 >= table.frame.seconds_p10).all()
    meta = table.meta
    assert (meta["method"], meta["dtype"], meta["threads"], meta["complete"]) == ("measured", "fp32", 1, True)
    assert meta["memory"]["target_kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4
    assert meta["target"]["params"] == 846_976 and meta["draft"]["num_layers"] == 2
    for fitter in ("linear", "interp"):
        model = load_cost_model(result.path, fitter)
        assert model.target_time(2, 2 * 3, 2 * 32) > 0 and model.draft_time(2, 2 * 32) > 0


@torch_only
def test_an_interrupted_run_resumes_where_it_stopped(tmp_path):
    pytest.importorskip("torch")
    first = run_profile(tiny(tmp_path))
    path = tmp_path / "tiny.csv"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:11]) + "\n" + lines[11][:9])  # 10 rows, then a row cut mid-write
    again = run_profile(tiny(tmp_path))
    assert again.meta["points"]["measured_now"] == len(first.frame) - 10
    kept = pd.read_csv(path).merge(pd.DataFrame([l.split(",") for l in lines[1:11]], columns=lines[0].split(","))
                                   .astype({"batch_size": int, "query_len": int, "context_len": int,
                                            "seconds": float}), on=KEY + ["seconds"])
    assert len(kept) == 10  # the rows measured before the interruption are kept as they were
    assert run_profile(tiny(tmp_path)).meta["points"]["measured_now"] == 0  # a finished profile: nothing to do
    with pytest.raises(UserError, match=r"tiny.csv: holds a profile of other settings \(dtype 'fp32', not 'bf16'\)"):
        run_profile(tiny(tmp_path, dtype="bf16"))


@torch_only
def test_points_that_do_not_fit_are_skipped_with_one_line_each(tmp_path):
    pytest.importorskip("torch")
    grid = Grid(batch_sizes=(1,), query_lens=(1,), context_lens=(8, 2_000_000), prefill_lens=())
    messages = []
    result = run_profile(tiny(tmp_path, grid=grid, draft=None, max_memory_gb=0.1), log=messages.append)
    assert len(messages) == 1
    # 2,000,001 tokens x 2 KiB of fp32 KV x (1 + 1/4 layers) + 32 MB of scores, x 1.2 + 64 MiB = 5.82 GiB
    assert messages[0] == "skip target decode b=1 q=1 L=2000000: needs ~5.82 GiB, 0.10 GiB free"
    assert list(result.frame.context_len) == [8]
    assert result.meta["complete"] and result.meta["skipped"] == [messages[0][len("skip "):]]


@torch_only
def test_a_pass_that_runs_out_of_memory_skips_the_rest_of_its_group(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from profiles.models import forward

    real = forward.decode_pass

    def decode_pass(model, cache, input_ids):
        if input_ids.shape == (4, 1):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, cache, input_ids)

    monkeypatch.setattr(forward, "decode_pass", decode_pass)
    grid = Grid(batch_sizes=(1, 4), query_lens=(1, 2, 3), context_lens=(8,), prefill_lens=())
    messages = []
    result = run_profile(tiny(tmp_path, grid=grid, draft=None), log=messages.append)
    # b=4 is measured over one cache for q = 1, 3 (the coarse pass) and later for q = 2
    assert [m.split(" (")[0] for m in messages] == ["skip target decode b=4 q=1 L=8: out of memory",
                                                    "skip target decode b=4 q=3 L=8: out of memory"]
    assert sorted(zip(result.frame.batch_size, result.frame.query_len)) == [(1, 1), (1, 2), (1, 3), (4, 2)]
    assert result.meta["complete"] and result.meta["stopped"] is None


@torch_only
def test_a_run_cut_by_max_seconds_keeps_the_coarse_points(tmp_path):
    pytest.importorskip("torch")
    clock = itertools.count()  # every look at the clock: one second later
    result = run_profile(tiny(tmp_path, max_seconds=40), clock=lambda: float(next(clock)))
    meta = result.meta
    assert (meta["complete"], meta["stopped"]) == (False, "max_seconds")
    coarse = {p.key for p in TINY_GRID.points() if p.batch_size != 2 and p.query_len != 2}
    have = set(result.frame[KEY].itertuples(index=False, name=None))
    assert coarse < have and len(have) < len(TINY_GRID.points())


@torch_only
def test_layer_scaling_extrapolates_each_point_and_the_check_reports_its_error(tmp_path):
    pytest.importorskip("torch")
    grid = Grid(batch_sizes=(1, 2), query_lens=(1, 2), context_lens=(8,), prefill_lens=(8,))
    result = run_profile(tiny(tmp_path, grid=grid, scale_layers=(1, 2), check_scaling=True))
    target = result.frame[result.frame.role == "target"]
    assert len(target) == 6 and target.num_layers.eq(4).all()
    assert target.seconds_scaled.tolist() == [extrapolate_layers(r.seconds_n1, r.seconds_n2, 1, 2, 4)
                                              for r in target.itertuples()]
    check = result.meta["layer_scaling"]["check"]
    assert set(check) == {"target/decode", "target/prefill", "all"} and check["all"]["points"] == 6
    assert result.frame[result.frame.role == "draft"].seconds_n1.isna().all()


@torch_only
def test_cli_bad_input_raises_one_line_user_errors(tmp_path):
    pytest.importorskip("torch")
    from profiles.cli import main

    unknown = tmp_path / "mamba.json"
    unknown.write_text(json.dumps({"model_type": "mamba", "hidden_size": 64}))
    base = ["--device", "cpu", "--dtype", "fp32", "--out", str(tmp_path / "x.csv"), "--quiet"]
    cases = {
        "--target": ("--target", str(unknown)),
        "--batch-sizes: expected comma-separated integers (got '1,two')": ("--target", "tiny-target",
                                                                           "--batch-sizes", "1,two"),
        "--context-lens: values must be positive integers (got 0,8)": ("--target", "tiny-target",
                                                                      "--context-lens", "0,8"),
        "--scale-layers: N2 must be <= the target's 4 layers (got 8)": ("--target", "tiny-target",
                                                                        "--scale-layers", "2,8"),
        "run_sim.py profile: unrecognized arguments: --bogus": ("--target", "tiny-target", "--bogus"),
        "model_type 'deepseek_v3' is priced by the roofline": ("--target", "deepseek-v3"),
    }
    for message, args in cases.items():
        with pytest.raises(UserError) as err:
            main([*args, *base])
        if message.startswith("model_type"):  # a family the roofline prices but the torch side does not build
            assert str(err.value).startswith("--target: ") and message in str(err.value)
        else:
            assert str(err.value).startswith(message if message != "--target" else f"{unknown}: model_type is an "
                                                                                    "unknown architecture (got 'mamba')")
        assert "\n" not in str(err.value)


def test_a_grid_can_time_the_drafts_catch_up_pass():
    """``draft_query_lens``: the draft's decode points at several new tokens per sequence (the catch-up pass feeds
    the tokens the draft has not seen), beside its proposal passes of one; a grid must keep the proposal pass."""
    grid = Grid(batch_sizes=(1, 4), query_lens=(1, 3), context_lens=(64,), prefill_lens=(), draft_query_lens=(1, 2, 3))
    draft = [(p.batch_size, p.query_len) for p in grid.points() if p.role == "draft"]
    assert sorted(draft) == [(1, 1), (1, 2), (1, 3), (4, 1), (4, 2), (4, 3)]
    with pytest.raises(UserError, match="--draft-query-lens: must start with 1"):
        Grid(batch_sizes=(1,), query_lens=(1,), context_lens=(64,), prefill_lens=(), draft_query_lens=(2, 3))
