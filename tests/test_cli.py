"""The command line: results on disk, and one clear line with exit status 2 for every user error."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from simulator.studies.cli import main
from tests.conftest import REPO


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_simulate_writes_requests_summary_config_and_steps(capsys, cost_json, tmp_path):
    out = tmp_path / "run1"
    code, stdout, _ = run_cli(capsys, "simulate", "--profile", cost_json(per_batched_token=1e-4), "--policy",
                              "fixed-k", "--k", "4", "--rate", "6", "--num-requests", "200", "--seed", "0",
                              "--num-gpu-blocks", "5000", "--save-steps", "--format", "csv", "--out", str(out))
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == [".specsim-kind", "config.json", "requests.csv", "steps.csv",
                                                       "summary.json"]
    requests = pd.read_csv(out / "requests.csv")
    assert list(requests.columns[:9]) == ["request_id", "arrival_time", "first_token_time", "finish_time",
                                          "prompt_tokens", "output_tokens", "proposed_tokens", "accepted_tokens",
                                          "preemptions"]
    assert len(requests) == 200
    summary = json.loads((out / "summary.json").read_text())
    for key in ("mean_latency", "p50_latency", "p90_latency", "p99_latency", "mean_norm_latency", "p99_ttft",
                "mean_tpot", "throughput", "output_throughput", "acceptance_rate", "mean_acceptance_length", "preemptions",
                "requests", "simulated_seconds", "wall_seconds"):
        assert key in summary
    config = json.loads((out / "config.json").read_text())
    assert list(config) == ["workload", "engine", "fleet", "speculative", "cost", "run"]  # one object per concern
    assert (config["speculative"]["policy"], config["speculative"]["k"], config["workload"]["rate"],
            config["engine"]["num_gpu_blocks"]) == ("fixed-k", 4, 6.0, 5000)
    assert "mean acceptance length" in stdout


def test_a_saved_config_reruns_to_the_same_results(capsys, cost_json, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    run_cli(capsys, "simulate", "--profile", cost_json(), "--policy", "fixed-k", "--rate", "3",
            "--num-requests", "100", "--acceptance", "beta", "--num-gpu-blocks", "5000", "--format", "csv",
            "--out", str(first))
    run_cli(capsys, "simulate", "--config", str(first / "config.json"), "--format", "csv", "--out", str(second))
    assert (first / "requests.csv").read_bytes() == (second / "requests.csv").read_bytes()


def bad_trace(tmp_path, text: str) -> str:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("trace_text,expected", [
    ("arrival_time,prompt_tokens\n0,5\n", "output_tokens"),
    ("arrival_time,prompt_tokens,output_tokens\n0,-5,3\n", "prompt_tokens"),
    ("arrival_time,prompt_tokens,output_tokens\n0,abc,3\n", "prompt_tokens"),
    ("arrival_time,prompt_tokens,output_tokens\n1.0,5,3\n0.5,5,3\n", "arrival_time"),
    ("", "empty"),
])
def test_bad_trace_files_end_with_one_line_naming_file_and_field(capsys, cost_json, tmp_path, trace_text,
                                                                  expected):
    path = bad_trace(tmp_path, trace_text)
    code, _, err = run_cli(capsys, "simulate", "--profile", cost_json(), "--trace", path, "--out",
                           str(tmp_path / "o"))
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert path in err and expected in err


@pytest.mark.parametrize("flags,expected", [
    (["--rate", "0", "--num-requests", "10"], "rate must be > 0"),
    (["--rate", "-1", "--num-requests", "10"], "rate must be > 0"),
    (["--rate", "1", "--num-requests", "10", "--k", "-1"], "k must be an integer >= 0"),
    (["--rate", "1", "--num-requests", "10", "--policy", "warp-speed"], "unknown policy 'warp-speed'"),
    (["--rate", "1", "--num-requests", "10", "--policy", "goodput", "--policy-param", "alpha=2"],
     "policy goodput: unknown parameter 'alpha'"),
    (["--rate", "1", "--num-requests", "10", "--prompt-len", "5000", "--num-gpu-blocks", "100"],
     "can never fit in the KV cache"),
    (["--rate", "abc", "--num-requests", "10"], "--rate: not a valid float"),
    (["--rate", "1", "--num-requests", "10", "--no-such-flag", "1"], "unrecognized arguments"),
])
def test_bad_values_end_with_one_line(capsys, cost_json, tmp_path, flags, expected):
    code, _, err = run_cli(capsys, "simulate", "--profile", cost_json(), "--num-gpu-blocks", "1000", *flags,
                           "--out", str(tmp_path / "o"))
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "o" / "summary.json").exists()


def test_a_profile_without_draft_costs_refuses_a_draft_proposer(capsys, tmp_path):
    profile = tmp_path / "nodraft.json"
    profile.write_text(json.dumps({"target": {"base": 0.01, "per_batched_token": 0, "per_context_token": 0},
                                   "prefill": {"base": 0.0, "per_prompt_token": 0}, "overhead": {"base": 0}}))
    code, _, err = run_cli(capsys, "simulate", "--profile", str(profile), "--policy", "fixed-k", "--rate", "1",
                           "--num-requests", "5", "--num-gpu-blocks", "100", "--out", str(tmp_path / "o"))
    assert code == 2 and "no draft decode costs" in err and str(profile) in err
    code, _, _ = run_cli(capsys, "simulate", "--profile", str(profile), "--policy", "fixed-k", "--proposer",
                         "ngram", "--rate", "1", "--num-requests", "5", "--num-gpu-blocks", "100", "--out",
                         str(tmp_path / "o"))
    assert code == 0


def test_a_profile_missing_its_target_block_is_refused(capsys, tmp_path):
    profile = tmp_path / "broken.json"
    profile.write_text(json.dumps({"prefill": {"base": 0.0, "per_prompt_token": 0}}))
    code, _, err = run_cli(capsys, "simulate", "--profile", str(profile), "--rate", "1", "--num-requests", "5",
                           "--out", str(tmp_path / "o"))
    assert code == 2 and "target" in err and str(profile) in err


def test_a_user_error_from_the_real_process_has_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "run_sim.py"), "simulate", "--rate", "-3",
                           "--num-requests", "5", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: config: --rate must be > 0, got -3.0"


def test_a_warning_from_the_real_process_is_one_line_naming_the_input_not_a_source_file(tmp_path):
    """The session router without session keys, and a profile asked far beyond its grid: each warning one line
    naming the flag (``--router``, ``--profile FILE``), never ``fleet.py:538: UserWarning``."""
    grid = REPO / "profiles" / "data" / "example_grid.csv"
    done = subprocess.run([sys.executable, str(REPO / "run_sim.py"), "simulate", "--rate", "4", "--num-requests", "6",
                           "--replicas", "2", "--router", "session", "--profile", str(grid), "--fitter", "interp",
                           "--prompt-len", "9000", "--max-num-batched-tokens", "9000", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "SPECSIM_CACHE_DIR":
                                                                            str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == ("warning: --router session: the workload has no session key (no prompt_id column; Mooncake's "
                        "trace has none): every request is routed round robin")
    assert lines[1].startswith(f"warning: --profile {grid}: target prefill asked at batch_size=1, prompt_len=9000 ")
    assert all(line.startswith("warning: ") for line in lines) and ".py:" not in done.stderr


def test_policy_file_registers_a_user_policy(capsys, cost_json, tmp_path, every_other_policy):
    policy_file = every_other_policy
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, "simulate", "--profile", cost_json(), "--policy-file", str(policy_file),
                           "--policy", "every-other", "--k", "2", "--rate", "2", "--num-requests", "40",
                           "--num-gpu-blocks", "5000", "--format", "csv", "--out", str(out))
    assert code == 0, err
    requests = pd.read_csv(out / "requests.csv")
    assert (requests.loc[requests.request_id % 2 == 1, "proposed_tokens"] == 0).all()
    assert (requests.loc[requests.request_id % 2 == 0, "proposed_tokens"] > 0).all()


def test_a_policy_file_that_registers_nothing_is_refused(capsys, cost_json, tmp_path):
    empty = tmp_path / "nothing.py"
    empty.write_text("x = 1\n")
    code, _, err = run_cli(capsys, "simulate", "--profile", cost_json(), "--policy-file", str(empty), "--rate",
                           "1", "--num-requests", "5", "--out", str(tmp_path / "o"))
    assert code == 2 and "registers no policy" in err


def test_sweep_writes_a_tidy_summary_and_figures_then_plot_redraws_them(capsys, cost_json, tmp_path):
    out = tmp_path / "sweep"
    code, stdout, err = run_cli(capsys, "sweep", "--profile", cost_json(per_batched_token=1e-4), "--rates", "1,4",
                                "--policies", "no-spec,fixed-k:2,goodput:4", "--seeds", "0,1", "--num-requests",
                                "60", "--num-gpu-blocks", "5000", "--grid", "acceptance_rate=0.5,0.9",
                                "--workers", "2", "--out", str(out))
    assert code == 0, err
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 2 * 3 * 2 * 2
    assert {"policy", "rate", "seed", "acceptance_rate", "config_hash", "mean_latency", "p99_norm_latency"} <= set(
        summary.columns)
    assert summary["config_hash"].is_unique
    for figure in ("latency_vs_rate.png", "speedup.png", "k_over_time.png"):
        assert (out / figure).stat().st_size > 0
        (out / figure).unlink()
    code, stdout, _ = run_cli(capsys, "plot", str(out))
    assert code == 0 and (out / "latency_vs_rate.png").exists() and (out / "k_over_time.png").exists()


def test_tune_reports_the_best_setting_and_the_tradeoff(capsys, cost_json, tmp_path):
    out = tmp_path / "tune"
    code, stdout, err = run_cli(capsys, "tune", "--policy", "goodput", "--slo", "p99_latency<=5", "--profile",
                                cost_json(per_batched_token=1e-4), "--rates", "1,4", "--param", "k=1,4",
                                "--param", "bonus=1.0,1.3", "--num-requests", "60", "--num-gpu-blocks", "5000",
                                "--workers", "1", "--out", str(out))
    assert code == 0, err
    table = pd.read_csv(out / "tune.csv")
    assert len(table) == 4 and table["policy"].iloc[0] in stdout
    assert (out / "tradeoff.png").exists()


@pytest.mark.parametrize("slo", ["p99_latency=20", "latency<=3", "p99_latency<=abc", ""])
def test_an_slo_that_cannot_be_parsed_is_refused(capsys, tmp_path, slo):
    code, _, err = run_cli(capsys, "tune", "--policy", "goodput", "--slo", slo, "--rates", "1", "--out",
                           str(tmp_path / "o"))
    assert code == 2 and err.startswith("error: --slo") and len(err.strip().splitlines()) == 1
