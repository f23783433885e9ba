"""``report.html`` of ``sweep``, ``compare`` (two runs; a vLLM result replayed), ``tune`` and ``validate``: one
self-contained page each (every figure embedded as a base64 PNG, the summary tables, the config, the profile's
method and calibration, the code version, every warning), the same bytes for the same run, no absolute path but the
user's, no timestamp, none left by a killed run; and each kind opened in a real browser (headless Chromium from
Debian's packages): a screenshot that is not blank and no console message. Without Chromium the browser tests skip
here and fail in CI (``CI`` set), so that CI cannot pass without the browser."""
from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from run_sim import main
from simulator.studies import report
from simulator.studies.sweep import code_version
from tests.conftest import REPO

VLLM_RESULT = REPO / "profiles/data/vllm_lambda/1xH100-80GB-SXM__Meta-Llama-3-8B-Instruct__N10.json"
CALIBRATED = REPO / "profiles/data/h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b.csv"
CHROMIUM = shutil.which("chromium")
DATA_URI = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=]+)")
#: An absolute path: a "/" that starts a word (not "req/s", "profiles/data", "https://"), then two parts or more.
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/-])/[\w.-]+(?:/[\w.-]+)+")
TIMESTAMP = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b|\b\d\d:\d\d:\d\d\b|\b(19|20)\d\d[01]\d[0-3]\d-\d{6}\b")


def run(*argv: str) -> None:
    assert main(list(argv)) == 0, argv


def sweep_argv(out: Path, *extra: str) -> list[str]:
    """2 rates x 2 policies x 30 requests; at 20 req/s two sequences at a time cannot keep up (saturated)."""
    return ["sweep", "--rates", "1,20", "--policies", "no-spec,fixed-k:3", "--num-requests", "30",
            "--max-num-seqs", "2", "--workers", "2", "--quiet", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    """One report of each kind the simulator writes, on small settings: kind -> its report.html."""
    root = tmp_path_factory.mktemp("reports")
    run(*sweep_argv(root / "sweep"))
    for name, policy in (("run1", "no-spec"), ("run2", "fixed-k")):
        run("simulate", "--request-rate", "2", "--num-prompts", "30", "--policy", policy, "--k", "3",
            "--format", "csv", "--out", str(root / name))
    run("compare", str(root / "run1"), str(root / "run2"), "--out", str(root / "compare"))
    run("compare", str(VLLM_RESULT), "--profile", str(CALIBRATED), "--out", str(root / "replay"))
    run("tune", "--policy", "fixed-k", "--param", "k=1,3", "--slo", "p99_latency<=5", "--rates", "1,4",
        "--num-requests", "30", "--workers", "2", "--quiet", "--out", str(root / "tune"))
    return {kind: root / kind / "report.html" for kind in ("sweep", "compare", "replay", "tune")}


@pytest.fixture(scope="module")
def validate_report(tmp_path_factory) -> Path:
    """validate's report, written by its own hook (:func:`profiles.validation.validate.write_report`, the same
    writer) on a small fake validation: two rates x two policies, its figure drawn by validate's ``plot``."""
    pytest.importorskip("torch")
    from profiles.validation import validate

    out = tmp_path_factory.mktemp("validate")
    rows = []
    for rate in (0.5, 2.0):
        for policy, base in (("no-spec", 1.0), ("fixed-k:3", 0.6 * rate)):
            for metric in validate.METRICS:
                real = base * (1.1 if metric.endswith("latency") else 0.2)
                sim = real * 1.05
                rows.append({"rate": rate, "policy": policy, "metric": metric, "real": real, "sim": sim,
                             "rel_error": 0.05, "sim_calibrated": sim * 0.98, "rel_error_calibrated": 0.03,
                             "real_noise": 0.02, "error_noise": 0.01, "timing_floor": 0.01, "pass_scatter": 0.05,
                             "speed": 1.02, "step_speed": 1.01, "rel_error_step_speed": 0.02})
    table = pd.DataFrame(rows)
    parts = pd.DataFrame([{"rate": r, "policy": p, "part": part, "measured": 1.0, "predicted": 0.9, "speed": 1.02}
                          for r in (0.5, 2.0) for p in ("no-spec", "fixed-k:3")
                          for part in ("prefill", "draft", "verify", "overhead", "all steps")])
    decisions = pd.DataFrame([{"rate": r, "policy": p, "real_acceptance_rate": 0.6, "sim_acceptance_rate": 0.61,
                               "real_mean_k": 3.0, "sim_mean_k": 3.0} for r in (0.5, 2.0)
                              for p in ("no-spec", "fixed-k:3")])
    result = validate.Validation(table, parts, {}, decisions, {"before_s": 0.01, "after_s": 0.0101,
                                                              "after_over_before": 1.01}, pd.DataFrame())
    settings = validate.ValidateSettings(rates=(0.5, 2.0), policies=("no-spec", "fixed-k:3"))
    figure = validate.plot(table, out / "validate.png", "fake: real engine vs simulator")
    path = validate.write_report(out, settings, result, result.choices(), validate.policy_payoffs(table),
                                 ["median |relative error| 5.0% as profiled"],
                                 ["rate 2 fixed-k:3: not run, past --max-seconds 60"], figure)
    return Path(path)


def page(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def outside_images(text: str) -> str:
    return DATA_URI.sub("data:image/png;base64,...", text)


# -- the pages, without a browser -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sweep", "compare", "replay", "tune", "validate"])
def test_each_report_is_one_self_contained_page_with_every_figure_of_its_run(kind, reports, request):
    path = request.getfixturevalue("validate_report") if kind == "validate" else reports[kind]
    text = page(path)
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    images = DATA_URI.findall(text)
    figures = sorted(path.parent.glob("*.png"))
    assert figures and len(images) == len(figures), (kind, figures)
    embedded = {base64.b64decode(data) for data in images}
    assert embedded == {f.read_bytes() for f in figures}  # each figure of the folder, byte for byte
    rest = outside_images(text)
    # nothing to fetch, nothing to run: no script, stylesheet link, frame, remote font or URL
    for needle in ("<script", "<link", "<iframe", "<object", "@import", "url(", "http://", "https://", "@font-face"):
        assert needle not in rest.lower(), (kind, needle)
    assert re.findall(r'(?:src|href)="([^"]*)"', rest) == ["data:image/png;base64,..."] * len(images)
    assert "<table>" in rest and 'id="config"' in rest and 'id="warnings"' in rest
    assert code_version() in rest


def test_no_absolute_path_but_the_users_and_no_timestamp(reports, validate_report):
    for path in [*reports.values(), validate_report]:
        text = outside_images(page(path))
        user_root = str(path.parent.parent)  # every folder these reports name was given by the user (tmp_path)
        foreign = [p for p in ABSOLUTE_PATH.findall(text) if not p.startswith(user_root)]
        assert not foreign, (path, foreign[:5])
        assert str(REPO) not in text
        assert not TIMESTAMP.search(text), (path, TIMESTAMP.search(text))


def test_the_sweep_report_holds_the_tables_the_config_and_the_saturation_warning(reports):
    text = page(reports["sweep"])
    assert "sweep: 2 policies x 2 rates x 1 seed" in text
    assert "Mean normalised latency (ms per output token), seeds averaged" in text
    assert "<th>no-spec</th>" in text and "<th>fixed-k:3</th>" in text
    assert "Where each policy pays against no-spec, by mean normalised latency" in text
    summary = pd.read_csv(reports["sweep"].parent / "summary.csv")
    for value in summary.groupby(["rate", "policy"])["mean_latency"].mean():
        assert f"{value:.6g}" in text  # every cell's figure in the tables
    for value in summary.groupby(["rate", "policy"])["mean_norm_latency"].mean():
        assert f"{value * 1e3:.6g}" in text
    assert summary["saturated"].any()
    warnings = text[text.index('id="warnings"'):text.index("</section>", text.index('id="warnings"'))]
    assert "2 of 4 runs saturated" in warnings and "20 req/s" in warnings
    config = text[text.index('id="config"'):]
    assert "<th>rates</th>" in config and "[1.0, 20.0]" in config and "<th>max_num_seqs</th>" in config
    # the default profile, shown relative to the repository, with its method
    assert "profiles/data/example.json" in text and "hand-written" in text
    assert "wall_seconds" not in text  # the machine's speed differs between runs; the report holds none of it


def test_the_replay_report_shows_the_calibration_of_a_vllm_calibrated_profile(reports):
    text = page(reports["replay"])
    assert "analytical, calibrated to vLLM" in text
    assert "<h3>Calibration</h3>" in text and "calibrated to vLLM results" in text  # the calibration's note
    assert "LambdaLabsML/vllm-benchmark" in text and "1xH100-80GB-SXM__Meta-Llama-3-8B-Instruct__N640.json" in text
    for parameter in ("compute", "bandwidth", "pass_overhead_s", "frontend_s"):
        assert f"<th>{parameter}</th>" in text
    assert "leave-one-file-out" in text and "<th>median_abs_error</th>" in text
    assert "replayed 10 requests of" in text and "mean_ttft_ms" in text


def test_the_compare_and_tune_reports_hold_their_tables(reports):
    text = page(reports["compare"])
    assert "compare: run1 against run2" in text and "median_tpot_ms" in text and "relative difference" in text
    assert "<th>run2: config.json</th>" in text  # each run's own config
    text = page(reports["tune"])
    assert "Settings, best first (tune.csv)" in text and "sustainable_rate" in text and "tradeoff.png" in text
    assert "best: fixed-k:3 meets p99_latency&lt;=5" in text  # escaped
    assert "every setting meets the SLO at every rate tried" in text  # tune's warning, in the warnings list


def test_the_validate_report_holds_its_tables_profile_and_warnings(validate_report):
    text = page(validate_report)
    for heading in ("Real and simulated, per rate, policy and metric", "The decision per rate",
                    "Each speculative policy against no-spec", "Where the time goes", "The machine&#x27;s drift"):
        assert heading in text
    assert "profiles/data/cpu__smollm2-135m__smollm2-draft.csv" in text and "measured" in text
    assert "not run, past --max-seconds" in text


def test_the_same_run_gives_the_same_report_bytes(reports, tmp_path):
    before = reports["sweep"].read_bytes()
    run(*sweep_argv(reports["sweep"].parent))  # every cell reused
    assert reports["sweep"].read_bytes() == before
    shutil.rmtree(reports["sweep"].parent / "runs")  # every cell run again
    run(*sweep_argv(reports["sweep"].parent, "--workers", "1"))
    assert reports["sweep"].read_bytes() == before
    before = reports["replay"].read_bytes()
    run("compare", str(VLLM_RESULT), "--profile", str(CALIBRATED), "--out", str(reports["replay"].parent))
    assert reports["replay"].read_bytes() == before


def test_a_killed_sweep_leaves_no_report(tmp_path, monkeypatch):
    from simulator.studies import sweep

    out = tmp_path / "sweep"
    run(*sweep_argv(out))
    assert (out / "report.html").is_file()

    class Killed:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def map_unordered(self, fn, items):
            for i, item in enumerate(items):
                if i == 1:
                    raise KeyboardInterrupt
                yield fn(item)

    monkeypatch.setattr(sweep, "make_executor", lambda *args: Killed())
    assert main(sweep_argv(out, "--num-requests", "31")) == 130  # another grid: its cells run, then the kill
    assert not (out / "report.html").exists() and not (out / "summary.csv").exists()
    assert not list(out.glob(".report.html.*"))


def test_a_warning_a_cell_printed_is_in_the_report_with_its_cells(tmp_path, capsys):
    policy = tmp_path / "careful.py"
    policy.write_text("import warnings\nimport numpy as np\nfrom policies import Policy, register\n\n"
                      "@register\nclass Careful(Policy):\n    name = 'careful'\n"
                      "    def propose(self, view):\n"
                      "        warnings.warn('careful: <b>k</b> & more')\n"
                      "        return np.full(len(view.request_ids), self.k)\n")
    with pytest.warns(UserWarning, match="careful"):  # the sweep's own k-over-time run prints it as Python does
        run("sweep", "--rates", "1,2", "--policies", "careful:2", "--policy-file", str(policy), "--num-requests",
            "10", "--workers", "1", "--quiet", "--out", str(tmp_path / "o"))
    err = capsys.readouterr().err
    line = "careful: <b>k</b> & more (in 2 of 2 runs: careful:2 at 1 req/s, careful:2 at 2 req/s)"
    assert f"warning: {line}" in err  # said once, on stderr, with the runs it came from
    text = page(tmp_path / "o" / "report.html")
    assert text.count("careful: &lt;b&gt;k&lt;/b&gt; &amp; more") == 1 and "&amp; more (in 2 of 2 runs" in text


def test_sweep_warnings_name_saturated_runs_and_ignored_requests():
    summary = pd.DataFrame({"policy": ["a", "a", "b"], "rate": [1.0, 2.0, 2.0], "saturated": [False, True, False],
                            "ignored_requests": [0, 3, 2]})
    summary.attrs["warnings"] = [[], ["far beyond the grid"], ["far beyond the grid"]]
    lines = report.sweep_warnings(summary)
    assert lines[0].startswith("1 of 3 runs saturated") and "a at 2 req/s" in lines[0]
    assert lines[1].startswith("2 of 3 runs ignored requests") and "5 requests in all" in lines[1]
    assert lines[2] == "far beyond the grid (in 2 of 3 runs: a at 2 req/s, b at 2 req/s)"
    assert report.sweep_warnings(summary.iloc[:1].assign(ignored_requests=0)) == []


def test_the_writer_escapes_every_text(tmp_path):
    figure = tmp_path / "f.png"
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2])
    fig.savefig(figure)
    plt.close(fig)
    texts = [f"<z{i}> & \"q\"" for i in range(9)]  # markup-like text, each once
    path = report.write_report(tmp_path / "report.html", texts[0], [
        (texts[1], texts[2]), ("table", pd.DataFrame({texts[3]: [texts[4]], "x": [1.5]})), ("fig", figure),
        ("markup", report.Html("<em>kept</em>"))], [texts[5]], {texts[6]: texts[7]}, [{"profile": texts[8]}])
    text = page(Path(path))
    for i, raw in enumerate(texts):
        assert f"<z{i}>" not in text and f"&lt;z{i}&gt; &amp; &quot;q&quot;" in text
    assert "<em>kept</em>" in text and "<td>1.5</td>" in text


# -- in a real browser --------------------------------------------------------------------------------------------
def chromium() -> str:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: CI must open the reports in a real browser (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium); CI fails here")
    return CHROMIUM


def screenshot(url: str, tmp: Path) -> tuple[np.ndarray, list[str], float]:
    """Chromium's screenshot of ``url`` (RGB floats in [0, 1]), its console lines, and the seconds it took."""
    from matplotlib import image

    shot = tmp / "shot.png"
    started = time.monotonic()
    done = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={tmp / 'profile'}", f"--screenshot={shot}",
                           "--window-size=1200,1600", "--enable-logging=stderr", "--v=0",
                           "--virtual-time-budget=2000", url], capture_output=True, text=True, timeout=180)
    seconds = time.monotonic() - started
    assert done.returncode == 0 and shot.is_file(), done.stderr[-3000:]
    # a page without script logs nothing to the console: any console line (Chromium logs them as INFO:CONSOLE,
    # whatever their level: an error, a resource that failed to load) or an uncaught exception is a fault
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    return image.imread(shot)[..., :3], console, seconds


def blank(pixels: np.ndarray) -> bool:
    """A screenshot with (almost) one colour: no text, no table, no figure drawn."""
    colours = len(np.unique((pixels.reshape(-1, 3) * 255).round().astype(np.uint8), axis=0))
    ink = float((pixels.min(axis=2) < 0.9).mean())  # share of pixels that are not white-ish
    return pixels.std() < 0.05 or colours < 16 or ink < 0.01


def test_the_browser_check_sees_a_blank_page_and_a_console_error(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    pixels, console, _ = screenshot(bad.as_uri(), tmp_path)
    assert blank(pixels)
    assert any("Uncaught" in line for line in console), console


@pytest.mark.parametrize("kind", ["sweep", "compare", "replay", "tune", "validate"])
def test_each_report_opens_in_chromium_not_blank_and_without_console_errors(kind, reports, request, tmp_path):
    path = request.getfixturevalue("validate_report") if kind == "validate" else reports[kind]
    pixels, console, seconds = screenshot(path.as_uri(), tmp_path)
    assert not console, console
    assert not blank(pixels), kind
    assert seconds < 60


# -- a real validate run ----------------------------------------------------------------------------------------
@pytest.mark.torch
def test_a_real_validate_run_on_the_tiny_pair_writes_its_report_last(tmp_path):
    """The tiny random pair (its own engine profile and acceptance trace, as tests/test_validate.py measures them):
    ``validate`` writes report.html beside its tables, with its figure and no path of the machine."""
    pytest.importorskip("transformers")
    from policies.registry import make_policy
    from profiles.acceptance import write_trace
    from profiles.engine_profile import EngineProfileSettings, profile_engine
    from profiles.grid import Grid
    from profiles.models.pairs import load_pair
    from profiles.profiler import TimingPolicy
    from profiles.serving.engine import RealEngineConfig, RealEngine
    from simulator.inputs.workload import Workload

    pair = load_pair("tiny")
    profile = tmp_path / "cpu__tiny.csv"
    grid = Grid(batch_sizes=(1, 2, 4), query_lens=(1, 2, 3), context_lens=(8, 32, 64), prefill_lens=(8, 24, 40),
                max_prefill_tokens=160)
    profile_engine(pair, EngineProfileSettings(out=str(profile), grid=grid, prefill_batch_sizes=(1, 2, 4),
                                               timing=TimingPolicy(warmup=1, min_repeats=1, max_repeats=1), rounds=3),
                   log=lambda msg: None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, 16).tolist() for _ in range(4)]
    engine = RealEngine(pair.target, pair.draft, RealEngineConfig(max_k=2), make_policy("fixed-k", 2), None, rng)
    trace = tmp_path / "acceptance.csv"
    write_trace(engine.run(Workload(np.zeros(4), [16] * 4, [12] * 4, "t"), prompts), str(trace))
    out = tmp_path / "v"
    out.mkdir()
    (out / "report.html").write_text("an older run's")
    pytest.importorskip("torch")
    # validate flushes subnormal floats to zero on the CPU (process-wide): conftest's fixture restores it
    run("validate", "--pair", "tiny", "--profile", str(profile), "--acceptance-trace", str(trace), "--rates",
        "40,150", "--policies", "no-spec,fixed-k:2", "--num-requests", "8", "--output-len", "8", "--max-num-seqs",
        "4", "--sim-seeds", "1", "--floor-draws", "1", "--probe-every", "0", "--out", str(out))
    text = page(out / "report.html")
    assert len(DATA_URI.findall(text)) == 1 and "validate.png" in text
    assert "validate: tiny, real engine against the simulator" in text and "mean_latency" in text
    assert "The decision per rate" in text and "measured" in text
    foreign = [p for p in ABSOLUTE_PATH.findall(outside_images(text)) if not p.startswith(str(tmp_path))]
    assert not foreign and not TIMESTAMP.search(outside_images(text))
    assert (out / "report.html").stat().st_mtime >= (out / "payoffs.csv").stat().st_mtime  # after every table
