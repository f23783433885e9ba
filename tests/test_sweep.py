"""Sweeps that outgrow one process: Dask clusters, resuming after a kill, progress, Parquet results."""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from simulator.studies.cli import main
from simulator.studies.sweep import progress_bar as _progress
from simulator.config import SimConfig
from simulator.studies.executors import LocalExecutor
from simulator.studies.sweep import build_cells, run_sweep
from tests.conftest import REPO


def summary_without_wall_time(folder: Path) -> pd.DataFrame:
    """summary.csv as text (floats are written with 17 digits, so equal text is equal bits), minus wall time."""
    return pd.read_csv(folder / "summary.csv", dtype=str).drop(columns="wall_seconds")


def sweep_argv(profile: str, out: Path, *extra: str) -> list[str]:
    return ["sweep", "--profile", profile, "--rates", "1,2,3,4", "--policies", "no-spec,fixed-k:2,goodput:3",
            "--seeds", "0,1", "--num-requests", "20", "--num-gpu-blocks", "5000", "--out", str(out), *extra]


# -- a Dask cluster ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dask_cluster():
    """A two-process Dask cluster on loopback; yields the scheduler address."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster:
        yield cluster.scheduler_address


def test_a_sweep_on_a_dask_cluster_equals_the_local_sweep_bit_for_bit(dask_cluster, cost_json, tmp_path, capsys):
    profile = cost_json(per_batched_token=1e-4)
    assert main(sweep_argv(profile, tmp_path / "local", "--workers", "1", "--quiet")) == 0
    assert main(sweep_argv(profile, tmp_path / "dask", "--cluster", dask_cluster, "--quiet")) == 0
    local, distributed = summary_without_wall_time(tmp_path / "local"), summary_without_wall_time(tmp_path / "dask")
    assert len(local) == 4 * 3 * 2
    pd.testing.assert_frame_equal(local, distributed)


def test_a_policy_file_works_on_dask_workers(dask_cluster, cost_json, tmp_path, capsys, every_other_policy):
    policy_file = every_other_policy
    code = main(["sweep", "--profile", cost_json(), "--policy-file", str(policy_file), "--policies",
                 "every-other:2", "--rates", "1,2,3", "--num-requests", "10", "--num-gpu-blocks", "5000",
                 "--cluster", dask_cluster, "--quiet", "--out", str(tmp_path / "o")])
    assert code == 0, capsys.readouterr().err
    assert (pd.read_csv(tmp_path / "o" / "summary.csv")["proposed_tokens"] > 0).all()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--cluster", "--scheduler"])
def test_an_unreachable_scheduler_ends_with_one_line_and_exit_2_within_seconds(cost_json, tmp_path, flag):
    pytest.importorskip("distributed")
    address = f"tcp://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(REPO / "run_sim.py"), *sweep_argv(cost_json(), tmp_path / "o"),
                           flag, address], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 15
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {flag}: cannot reach a Dask scheduler at {address}")
    assert len(done.stderr.strip().splitlines()) == 1


def test_scheduler_names_the_dask_scheduler_when_it_is_an_address(dask_cluster, cost_json, tmp_path, capsys):
    """The issue's spelling, --scheduler tcp://HOST:PORT; the engine's scheduling policies keep their names."""
    profile = cost_json(per_batched_token=1e-4)
    assert main(sweep_argv(profile, tmp_path / "a", "--scheduler", dask_cluster, "--quiet")) == 0
    assert main(sweep_argv(profile, tmp_path / "b", "--scheduler", "chunked-prefill", "--cluster", dask_cluster,
                           "--quiet")) == 0
    assert main(sweep_argv(profile, tmp_path / "chunked", "--scheduler", "chunked-prefill", "--workers", "1",
                           "--quiet")) == 0
    hashes = {name: set(pd.read_csv(tmp_path / name / "summary.csv")["config_hash"]) for name in ("a", "b", "chunked")}
    assert hashes["b"] == hashes["chunked"] != hashes["a"]
    assert main(sweep_argv(profile, tmp_path / "c", "--scheduler", dask_cluster, "--cluster", "tcp://other:8786")) == 2
    assert "two different Dask schedulers" in capsys.readouterr().err


@pytest.mark.parametrize("address,problem", [("nope", "not a scheduler address"),
                                             ("http://host:8786", "not a scheduler address"),
                                             ("inproc://x", "not a network address")])
def test_a_malformed_scheduler_address_is_refused_at_once(capsys, cost_json, tmp_path, address, problem):
    pytest.importorskip("distributed")
    code = main([*sweep_argv(cost_json(), tmp_path / "o"), "--cluster", address])
    err = capsys.readouterr().err
    assert code == 2 and problem in err and len(err.strip().splitlines()) == 1


# -- resuming ------------------------------------------------------------------------------------
def test_a_sweep_killed_half_way_reruns_only_the_missing_cells(capsys, cost_json, tmp_path):
    profile = cost_json(per_batched_token=1e-4)
    out, runs = tmp_path / "resumed", tmp_path / "resumed" / "runs"
    sweep = subprocess.Popen([sys.executable, str(REPO / "run_sim.py"), *sweep_argv(profile, out, "--workers", "1")],
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(list(runs.glob("*.json"))) < 3 and sweep.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        os.killpg(sweep.pid, signal.SIGKILL)
        sweep.wait()
    assert sweep.returncode == -signal.SIGKILL, "the sweep ended before it was killed; give it more cells"
    before = {p.name: p.read_bytes() for p in runs.glob("*.json")}
    assert 3 <= len(before) < 24
    assert not (out / "summary.csv").exists()

    assert main(sweep_argv(profile, out, "--workers", "1")) == 0
    err = capsys.readouterr().err
    assert f"{len(before)} of 24 cells already done; running the other {24 - len(before)}" in err
    after = {p.name: p.read_bytes() for p in runs.glob("*.json")}
    assert len(after) == 24
    assert {name: after[name] for name in before} == before  # not run again: wall_seconds would differ

    assert main(sweep_argv(profile, tmp_path / "uninterrupted", "--workers", "1", "--quiet")) == 0
    pd.testing.assert_frame_equal(summary_without_wall_time(out), summary_without_wall_time(tmp_path / "uninterrupted"))


class InterruptedAfter:
    """An executor that runs ``n`` cells in this process, then is interrupted (as by Ctrl-C)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def map_unordered(self, fn, items):
        for i, item in enumerate(items):
            if i == self.n:
                raise KeyboardInterrupt
            yield fn(item)


def test_an_interrupted_sweep_leaves_no_summary_that_looks_complete(cost_json, tmp_path):
    base = SimConfig.of(profile=cost_json(), rate=1.0, num_requests=10, num_gpu_blocks=5000)
    first = build_cells(base, [1.0, 2.0], ["no-spec"], [0])
    assert len(run_sweep(first, tmp_path, LocalExecutor(1))) == 2
    extended = build_cells(base, [1.0, 2.0, 3.0, 4.0], ["no-spec"], [0])
    with pytest.raises(KeyboardInterrupt):
        run_sweep(extended, tmp_path, InterruptedAfter(1))
    assert not (tmp_path / "summary.csv").exists()
    assert len(list((tmp_path / "runs").glob("*.json"))) == 3
    assert list(run_sweep(extended, tmp_path, LocalExecutor(1))["rate"]) == [1.0, 2.0, 3.0, 4.0]


# -- progress ------------------------------------------------------------------------------------
class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_runs_done_of_total_on_a_terminal_and_nothing_when_quiet(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    show = _progress(quiet=False)
    for done in (1, 2, 3, 4):
        show(done, 4)
    text = terminal.getvalue()
    assert text.startswith("1 of 4 cells already done; running the other 3\n")
    assert "4/4" in text and "run/s" in text
    assert _progress(quiet=True) is None


def test_progress_draws_no_bar_when_stderr_is_not_a_terminal(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    show = _progress(quiet=False)
    for done in (0, 1, 2):
        show(done, 2)
    assert log.getvalue() == ""


# -- per-request tables: Parquet or CSV ----------------------------------------------------------
def simulate_argv(profile: str, out: Path, *extra: str) -> list[str]:
    return ["simulate", "--profile", profile, "--policy", "fixed-k", "--rate", "4", "--num-requests", "50",
            "--num-gpu-blocks", "5000", "--save-steps", "--out", str(out), *extra]


def test_without_pyarrow_results_are_csv_and_parquet_is_refused(monkeypatch, capsys, cost_json, tmp_path):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed: find_spec("pyarrow") is None
    assert main(simulate_argv(cost_json(), tmp_path / "auto")) == 0
    assert sorted(p.name for p in (tmp_path / "auto").iterdir()) == [".specsim-kind", "config.json", "requests.csv",
                                                                     "steps.csv", "summary.json"]
    assert main(simulate_argv(cost_json(), tmp_path / "p", "--format", "parquet")) == 2
    assert capsys.readouterr().err == "error: --format parquet: needs pyarrow (pip install pyarrow), or use --format csv\n"


def test_parquet_results_hold_the_same_values_as_csv(capsys, cost_json, tmp_path):
    pytest.importorskip("pyarrow")
    profile = cost_json(per_batched_token=1e-4)
    assert main(simulate_argv(profile, tmp_path / "auto")) == 0
    assert main(simulate_argv(profile, tmp_path / "csv", "--format", "csv")) == 0
    assert sorted(p.name for p in (tmp_path / "auto").iterdir()) == [".specsim-kind", "config.json",
                                                                     "requests.parquet", "steps.parquet",
                                                                     "summary.json"]
    for table in ("requests", "steps"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "auto" / f"{table}.parquet"),
                                      pd.read_csv(tmp_path / "csv" / f"{table}.csv"), check_exact=True)


# -- where each policy stops paying --------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio, words", [
    ([0.5, 0.8, 0.9], "pays at every rate swept, up to 4 req/s"),
    ([1.2, 1.5, 2.0], "pays at no rate swept: slower than no-spec already at 1 req/s, the lightest load swept"),
    ([0.6, 0.8, 1.2], "pays up to about 3 req/s, slower than no-spec from there"),
    ([1.5, 0.5, 0.5], "slower than no-spec up to about 1.5 req/s, pays from there"),
    ([0.5, 1.5, 0.5], "pays up to about 1.5 req/s, slower than no-spec from about 1.5 req/s to about 3 req/s, pays "
                      "from about 3 req/s"),
])
def test_where_a_policy_pays_is_said_in_words_for_every_shape(ratio, words):
    """Rates 1, 2, 4 req/s; the crossing linear in the ratio between the swept rates around it (0.8 to 1.2 between 2
    and 4: at 3)."""
    from simulator.studies.sweep import payoff_words

    assert payoff_words([1.0, 2.0, 4.0], ratio, lambda r: f"{r:g} req/s") == words


def test_the_demos_crossovers_are_the_first_rise_above_no_spec():
    from simulator.studies.demo import crossover_finding, crossovers

    table = pd.DataFrame({"no-spec": [1.0, 1.0, 1.0], "fixed-k:1": [0.5, 0.8, 0.9], "fixed-k:3": [0.6, 0.8, 1.2],
                          "fixed-k:5": [1.2, 0.5, 0.5]}, index=[1.0, 2.0, 4.0])
    cross = crossovers(table, saturation=4.0)
    assert cross["fixed-k:1"] != cross["fixed-k:1"] and (cross["fixed-k:3"], cross["fixed-k:5"]) == (0.75, 0.0)
    assert crossover_finding(cross) == ("fixed-k:5 slower than no-spec already at the lightest load swept; fixed-k:3 "
                                        "slower than no-spec as load grows (from 0.75x no-spec's saturation); fixed-k:1 "
                                        "never slower than no-spec up to 1.6x no-spec's saturation")


def test_a_sweep_prints_its_figures_metric_and_where_each_policy_pays(capsys, cost_json, tmp_path):
    """The table, the figure's first panel and the words say one metric: mean normalised latency."""
    from simulator.studies.cli import main

    assert main(["sweep", "--profile", cost_json(per_batched_token=2e-4), "--rates", "1,8", "--policies",
                 "no-spec,fixed-k:1", "--num-requests", "30", "--num-gpu-blocks", "5000", "--workers", "1", "--quiet",
                 "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "mean normalised latency (ms per output token), seeds averaged; rows: request rate (req/s)"
    summary = pd.read_csv(tmp_path / "s" / "summary.csv")
    assert f"{summary['mean_norm_latency'].iloc[0] * 1e3:9.3f}".strip() in out[3]
    i = out.index("where each policy pays against no-spec, by mean normalised latency:")
    assert out[i + 1].startswith("  fixed-k:1: pays")
