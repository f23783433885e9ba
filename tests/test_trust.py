"""Issue 11's defects, each reproduced: results a researcher can trust after an edit, a crash or a bad input."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from simulator.config import SimConfig
from simulator.core.runner import run_simulation
from simulator.results import FolderLock
from simulator.studies import sweep as sweep_module
from simulator.studies.cli import main
from simulator.studies.executors import LocalExecutor
from simulator.studies.sweep import build_cells, run_sweep
from simulator.inputs import AZURE_CONV, MOONCAKE_PLAIN
from tests.conftest import REPO, write_cost_json


def sweep_argv(profile: str, out: Path, *extra: str) -> list[str]:
    return ["sweep", "--profile", profile, "--rates", "1,2", "--policies", "no-spec,fixed-k:2", "--num-requests",
            "20", "--num-gpu-blocks", "5000", "--workers", "1", "--out", str(out), *extra]


# -- 1. stale cells ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("edited", ["profile", "trace", "policy_file", "length_file", "acceptance_trace"])
def test_a_cell_whose_input_file_changed_in_place_runs_again(tmp_path, capsys, edited):
    profile = write_cost_json(tmp_path / "p.json")
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n0,100,20\n0.5,100,20\n1,100,20\n")
    lengths = tmp_path / "len.csv"
    lengths.write_text("prompt_tokens,output_tokens\n100,20\n")
    acc = tmp_path / "acc.csv"
    acc.write_text("request_id,proposed,accepted\n0,2,1\n0,2,2\n")
    policy = tmp_path / "pol.py"
    policy.write_text("import numpy as np\nfrom policies import Policy, register\n@register\nclass Two(Policy):\n"
                      "    name = 'two'\n    def propose(self, view):\n        return np.full(view.batch_size, 2)\n")
    flags = {"profile": ["--policies", "no-spec"], "trace": ["--trace", str(trace), "--policies", "no-spec"],
             "policy_file": ["--policy-file", str(policy), "--policies", "two"],
             "length_file": ["--length-dist", "file", "--length-file", str(lengths), "--policies", "no-spec"],
             "acceptance_trace": ["--acceptance", "replay", "--acceptance-trace", str(acc), "--policies",
                                  "fixed-k:2"]}[edited]
    argv = ["sweep", "--profile", profile, "--rates", "1,2", "--num-requests", "3", "--num-gpu-blocks", "5000",
            "--workers", "1", "--out", str(tmp_path / "o"), *flags]
    assert main(argv) == 0
    first = pd.read_csv(tmp_path / "o" / "summary.csv")
    assert main(argv) == 0
    assert "2 of 2 cells already done" in capsys.readouterr().err  # same inputs: reused, and said so
    if edited == "profile":
        write_cost_json(tmp_path / "p.json", target=0.1)
    elif edited == "trace":
        trace.write_text("arrival_time,prompt_tokens,output_tokens\n0,100,200\n0.5,100,200\n1,100,200\n")
    elif edited == "length_file":
        lengths.write_text("prompt_tokens,output_tokens\n100,200\n")
    elif edited == "acceptance_trace":
        acc.write_text("request_id,proposed,accepted\n0,2,0\n0,2,0\n")
    else:
        policy.write_text(policy.read_text().replace("view.batch_size, 2", "view.batch_size, 1"))
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "already done" not in err
    second = pd.read_csv(tmp_path / "o" / "summary.csv")
    assert (first["mean_latency"] != second["mean_latency"]).all()


def test_a_code_change_makes_new_cells(tmp_path, capsys, monkeypatch):
    argv = sweep_argv(write_cost_json(tmp_path / "p.json"), tmp_path / "o")
    assert main(argv) == 0
    monkeypatch.setattr(sweep_module, "code_version", lambda: "another-version")
    assert main(argv) == 0
    assert "already done" not in capsys.readouterr().err
    assert len(list((tmp_path / "o" / "runs").glob("*.json"))) == 8


def test_a_profile_csv_key_covers_its_metadata(tmp_path):
    csv = tmp_path / "p.csv"
    csv.write_text("x")
    meta = tmp_path / "p.meta.json"
    config = SimConfig.of(rate=1.0, num_requests=5, profile=str(csv))
    keys = [sweep_module.cell_key(config)]
    meta.write_text("{}")
    keys.append(sweep_module.cell_key(config))
    meta.write_text('{"method": "analytical"}')
    keys.append(sweep_module.cell_key(config))
    assert len(set(keys)) == 3


# -- 2. result folders -------------------------------------------------------------------------------------------
def simulate_argv(profile: str, out: Path, n: int, fmt: str) -> list[str]:
    return ["simulate", "--profile", profile, "--rate", "4", "--num-requests", str(n), "--num-gpu-blocks", "5000",
            "--format", fmt, "--out", str(out)]


def test_a_rerun_leaves_no_file_of_the_old_run(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    profile, out = write_cost_json(tmp_path / "p.json"), tmp_path / "o"
    assert main(simulate_argv(profile, out, 30, "parquet")) == 0
    assert main(simulate_argv(profile, out, 20, "csv")) == 0
    assert sorted(p.name for p in out.iterdir()) == [".specsim-kind", "config.json", "requests.csv", "summary.json"]
    assert json.loads((out / "summary.json").read_text())["requests"] == 20


def test_a_rerun_killed_mid_write_leaves_no_old_summary(tmp_path, capsys, monkeypatch):
    from simulator.core import runner

    profile, out = write_cost_json(tmp_path / "p.json"), tmp_path / "o"
    assert main(simulate_argv(profile, out, 30, "csv")) == 0

    def killed(path, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "write_csv", killed)
    assert main(simulate_argv(profile, out, 20, "csv")) == 130
    assert not (out / "summary.json").exists()  # visibly incomplete, not the old run's summary beside new files
    assert json.loads((out / "config.json").read_text())["workload"]["num_requests"] == 20
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())


@pytest.mark.parametrize("kind", ["file", "under-file", "empty"])
def test_output_folder_problems_are_found_before_simulating(tmp_path, capsys, monkeypatch, kind):
    from simulator.core import runner

    monkeypatch.setattr(runner, "run_simulation", lambda *a, **k: pytest.fail("simulated before checking --out"))
    (tmp_path / "f").write_text("x")
    out = {"file": str(tmp_path / "f"), "under-file": str(tmp_path / "f" / "sub"), "empty": ""}[kind]
    assert main(simulate_argv(write_cost_json(tmp_path / "p.json"), out, 5, "csv")) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_folder_holds_one_kind_of_result(tmp_path, capsys):
    """A run never lands among a sweep's files nor a sweep among a run's, a tune never in a sweep's folder; a rerun of
    the same kind into its own folder is allowed; a folder of an earlier version is told by its files."""
    from simulator.results import folder_kind

    profile = write_cost_json(tmp_path / "p.json")
    sweep = ["sweep", "--profile", profile, "--rates", "1", "--policies", "no-spec", "--num-requests", "4",
             "--num-gpu-blocks", "5000", "--workers", "1", "--quiet", "--out"]
    assert main([*sweep, str(tmp_path / "s")]) == 0 and main([*sweep, str(tmp_path / "s")]) == 0
    assert main(simulate_argv(profile, tmp_path / "r", 4, "csv")) == 0
    assert (folder_kind(tmp_path / "s"), folder_kind(tmp_path / "r")) == (("sweep", ".specsim-kind"),
                                                                          ("run", ".specsim-kind"))
    capsys.readouterr()
    for argv in (simulate_argv(profile, tmp_path / "s", 4, "csv"), [*sweep, str(tmp_path / "r")],
                 ["tune", "--profile", profile, "--policy", "goodput", "--slo", "p99_latency<=20", "--rates", "1",
                  "--num-requests", "4", "--num-gpu-blocks", "5000", "--param", "k=2", "--workers", "1", "--quiet",
                  "--out", str(tmp_path / "s")],
                 ["compare", str(tmp_path / "r"), str(tmp_path / "r"), "--out", str(tmp_path / "s")]):
        assert main(argv) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert "would mix its files with them: choose another folder" in line
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(
        [".specsim-kind", "latency_vs_rate.png", "report.html", "runs", "speedup.png", "summary.csv"])
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "tune.csv").write_text("policy\n")
    (tmp_path / "old" / "summary.csv").write_text("policy\n")
    assert folder_kind(tmp_path / "old") == ("tune", "tune.csv")
    assert folder_kind(tmp_path / "new") is None


# -- 3, 4. axes and columns --------------------------------------------------------------------------------------
def test_an_extra_axis_is_kept_in_table_figures_and_never_overwrites_a_measured_column(tmp_path, capsys):
    from simulator.studies.plots import _with_series, grid_axes

    out = tmp_path / "o"
    argv = sweep_argv(write_cost_json(tmp_path / "p.json"), out, "--grid", "acceptance_rate=0.5,0.9")
    assert main(argv) == 0
    printed = capsys.readouterr().out
    summary = pd.read_csv(out / "summary.csv")
    assert sorted(summary["config_acceptance_rate"].unique()) == [0.5, 0.9]
    assert summary.loc[summary["policy"] == "no-spec", "acceptance_rate"].isna().all()  # measured: none proposed
    spec = summary[summary["policy"] == "fixed-k:2"]
    assert spec.groupby("config_acceptance_rate")["acceptance_rate"].mean().is_monotonic_increasing
    assert "config_acceptance_rate" in printed and len([ln for ln in printed.splitlines() if "0.9" in ln]) >= 2
    assert grid_axes(summary) == ["config_acceptance_rate"]
    assert _with_series(summary, None)["series"].nunique() == 4  # 2 policies x 2 axis values: nothing averaged
    assert main(["plot", str(out)]) == 0


def test_no_config_field_and_measured_figure_share_a_column(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(sweep_argv(write_cost_json(tmp_path / "p.json"), out, "--grid", "cv=1,3", "--arrival", "gamma",
                           "--grid", "num_gpu_blocks=4000,5000")) == 0
    columns = list(pd.read_csv(out / "summary.csv").columns)
    assert len(columns) == len(set(columns))
    assert "cv" in columns and "config_num_gpu_blocks" in columns and "num_gpu_blocks" in columns
    printed = capsys.readouterr().out
    assert "cv" in printed and "config_num_gpu_blocks" in printed


# -- 5. metrics --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fixed-k", "goodput"])
def test_accepted_tokens_never_exceed_the_tokens_emitted(tmp_path, policy):
    config = SimConfig.of(profile=write_cost_json(tmp_path / "p.json"), rate=4.0, num_requests=400, k=8,
                          policy=policy, acceptance_rate=0.95, length_dist="lognormal", output_len=6, length_sigma=1.0,
                          num_gpu_blocks=100_000)
    result = run_simulation(config)
    r = result.requests
    assert (r["accepted_tokens"] <= r["output_tokens"] - 1).all()
    assert (r["accepted_tokens"] <= r["proposed_tokens"]).all()
    assert 1 <= result.summary["mean_acceptance_length"] <= config.speculative.k + 1
    assert result.summary["accepted_tokens"] <= result.summary["output_tokens"] - config.workload.num_requests


def test_acceptance_length_is_emitted_tokens_per_speculative_step(tmp_path):
    config = SimConfig.of(profile=write_cost_json(tmp_path / "p.json"), rate=1.0, num_requests=50, k=4,
                          policy="fixed-k", acceptance_rate=1.0, output_len=3, num_gpu_blocks=100_000, save_steps=True)
    result = run_simulation(config)
    steps = result.steps[result.steps["proposed"] > 0]
    assert result.summary["mean_acceptance_length"] == steps["emitted"].sum() / steps["batch_size"].sum() == 2.0
    assert (result.requests["accepted_tokens"] == 2).all()  # 2 of the 4 accepted were emitted; the rest not counted


def test_on_the_azure_conversation_trace_accepted_tokens_fit_the_outputs(tmp_path):
    trace = AZURE_CONV
    config = SimConfig.of(profile=write_cost_json(tmp_path / "p.json"), arrival="trace", trace=str(trace),
                          num_requests=3000, k=5, policy="fixed-k", acceptance_rate=0.9, num_gpu_blocks=1_000_000)
    r = run_simulation(config).requests
    assert (r["accepted_tokens"] <= r["output_tokens"] - 1).all()


# -- 6. requests that can never fit ------------------------------------------------------------------------------
def test_a_request_that_can_never_fit_is_ignored_and_reported(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n" +
                     "".join(f"{i * 0.1},{5000 if i in (3, 7) else 100},20\n" for i in range(20)))
    out = tmp_path / "o"
    argv = ["simulate", "--profile", write_cost_json(tmp_path / "p.json"), "--trace", str(trace),
            "--num-gpu-blocks", "100", "--format", "csv", "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "2 of 20 requests can never fit" in err and "ids 3, 7" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ignored_requests"] == 2 and summary["ignored_request_ids"] == [3, 7]
    assert summary["requests"] == 20 and summary["throughput"] > 0
    requests = pd.read_csv(out / "requests.csv")
    assert requests.loc[requests["ignored"], "request_id"].tolist() == [3, 7]
    assert requests.loc[requests["ignored"], "finish_time"].isna().all()
    assert requests.loc[~requests["ignored"], "finish_time"].notna().all()
    assert main([*argv[:-2], "--strict-fit", "--out", str(tmp_path / "strict")]) == 2
    err = capsys.readouterr().err
    assert "2 of 20 requests can never fit" in err and "request 3" in err and len(err.strip().splitlines()) == 1


def test_ignoring_nothing_changes_nothing(tmp_path):
    config = SimConfig.of(profile=write_cost_json(tmp_path / "p.json"), rate=4.0, num_requests=100, policy="fixed-k",
                          num_gpu_blocks=5000)
    a, b = run_simulation(config), run_simulation(config.replace(strict_fit=True))
    pd.testing.assert_frame_equal(a.requests, b.requests)


def test_the_mooncake_trace_with_4096_blocks_serves_what_fits(tmp_path):
    config = SimConfig.of(profile=write_cost_json(tmp_path / "p.json"), arrival="trace",
                          trace=str(MOONCAKE_PLAIN), num_requests=1500, num_gpu_blocks=4096,
                          max_num_seqs=64)
    result = run_simulation(config)
    s = result.summary
    assert 0 < s["ignored_requests"] < s["requests"]
    r = result.requests
    need = -(-(r["prompt_tokens"] + r["output_tokens"] + 1) // config.engine.block_size)
    assert (r["ignored"] == (need > 4096)).all()


# -- 8. processes and files --------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", ["", "{", "[]", '{"cell_key": "other"}'])
def test_an_empty_or_corrupt_runs_file_is_run_again(tmp_path, content):
    base = SimConfig.of(profile=write_cost_json(tmp_path / "p.json"), rate=1.0, num_requests=10, num_gpu_blocks=5000)
    cells = build_cells(base, [1.0, 2.0], ["no-spec"], [0])
    first = run_sweep(cells, tmp_path / "o", LocalExecutor(1))
    (tmp_path / "o" / "runs" / f"{cells[0].key}.json").write_text(content)
    again = run_sweep(cells, tmp_path / "o", LocalExecutor(1))
    assert again["mean_latency"].tolist() == first["mean_latency"].tolist()
    assert json.loads((tmp_path / "o" / "runs" / f"{cells[0].key}.json").read_text())["cell_key"] == cells[0].key


def test_a_second_run_into_a_locked_folder_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    with FolderLock(out):
        assert main(sweep_argv(write_cost_json(tmp_path / "p.json"), out)) == 2
        err = capsys.readouterr().err
        assert f"process {os.getpid()}" in err and len(err.strip().splitlines()) == 1
        assert main(simulate_argv(str(tmp_path / "p.json"), out, 5, "csv")) == 2
    assert main(sweep_argv(str(tmp_path / "p.json"), out)) == 0
    assert not (out / ".specsim.lock").exists()


def test_a_killed_runs_temporaries_are_removed_and_results_are_0644(tmp_path, capsys):
    out = tmp_path / "o"
    (out / "runs").mkdir(parents=True)
    for stale in (out / ".summary.csv.abc123.tmp", out / "runs" / ".x.json.def.tmp", out / ".latency_vs_rate.tmp.png"):
        stale.write_text("half")
    old = os.umask(0o022)
    try:
        assert main(sweep_argv(write_cost_json(tmp_path / "p.json"), out)) == 0
    finally:
        os.umask(old)
    assert not [p for p in out.rglob(".*") if p.is_file()]
    for p in [out / "summary.csv", *(out / "runs").glob("*.json")]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG are Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_die_with_the_sweep(tmp_path, sig):
    profile = write_cost_json(tmp_path / "p.json", per_batched_token=1e-4)
    argv = ["sweep", "--profile", profile, "--rates", ",".join(str(r) for r in range(1, 40)), "--policies",
            "no-spec,fixed-k:2", "--num-requests", "3000", "--num-gpu-blocks", "50000", "--workers", "2", "--quiet",
            "--out", str(tmp_path / "o")]
    proc = subprocess.Popen([sys.executable, str(REPO / "run_sim.py"), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            workers = _children(proc.pid)
        assert len(workers) >= 2, "no worker processes seen"
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
