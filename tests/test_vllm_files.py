"""Real ``vllm bench serve --save-result`` files (and ``benchmark_serving.py``'s) are read in every shape vLLM writes:
empty outputs, failed requests, summary-only files, infinite rates, burstiness, client concurrency and the
speculative-decoding figures; what cannot be used ends with one line naming the file and the key. Also the two
inputs that once ended in a traceback: a Gamma cv too small for its shape, and stdout closed by ``| head``."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from policies.errors import UserError
from simulator.metrics import derived
from simulator.studies import vllm_io
from simulator.studies.cli import main
from tests.conftest import REPO

LAMBDA = REPO.parent / "shared" / "vllm_results" / "lambda"


def result_file(path, **changes):
    """A small result as vllm/benchmarks/serve.py saves it with --save-detailed: 6 requests at 4 req/s, all served;
    ``changes`` replace keys (None removes one)."""
    n = 6
    data = {"date": "20250101-000000", "backend": "vllm", "model_id": "m", "tokenizer_id": "m", "num_prompts": n,
            "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None, "duration": 3.0, "completed": n,
            "failed": 0, "total_input_tokens": 60 * n, "total_output_tokens": 20 * n, "request_throughput": n / 3,
            "request_goodput": None, "output_throughput": 20 * n / 3, "total_token_throughput": 80 * n / 3,
            "input_lens": [60] * n, "output_lens": [20] * n, "ttfts": [0.05] * n, "itls": [[0.02] * 19] * n,
            "latencies": [0.43] * n, "generated_texts": ["x"] * n, "errors": [""] * n,
            "mean_ttft_ms": 50.0, "median_ttft_ms": 50.0, "std_ttft_ms": 0.0, "p99_ttft_ms": 50.0,
            "mean_tpot_ms": 20.0, "median_tpot_ms": 20.0, "std_tpot_ms": 0.0, "p99_tpot_ms": 20.0}
    data.update(changes)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(capsys, *argv) -> str:
    """The one line a refused command prints (exit status 2)."""
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# -- empty outputs ---------------------------------------------------------------------------------------------
def test_an_empty_output_replays_as_one_token_marked_empty(tmp_path):
    path = result_file(tmp_path / "r.json", output_lens=[20, 0, 20, 20, 20, 20],
                       ttfts=[0.05, 0.0, 0.05, 0.05, 0.05, 0.05])
    trace = vllm_io.replay_trace(vllm_io.read_vllm_result(path, replay=True), seed=0)
    assert trace["output_tokens"].tolist() == [20, 1, 20, 20, 20, 20]
    assert trace["empty_output"].tolist() == [False, True, False, False, False, False]


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3"])
def test_an_output_length_that_is_no_whole_number_is_refused_with_its_index(tmp_path, capsys, bad):
    path = result_file(tmp_path / "r.json", output_lens=[20, bad, 20, 20, 20, 20])
    line = refused(capsys, "compare", path, "--out", tmp_path / "c")
    assert str(path) in line and "output_lens[1]" in line


def test_figures_count_an_empty_output_as_vllm_does():
    """vLLM's calculate_metrics: TTFT 0 and output length 0 for a request that streamed no text, no TPOT for it."""
    columns = {"request_id": np.arange(3), "arrival_time": np.zeros(3), "first_token_time": np.array([0.1, 0.2, 0.3]),
               "finish_time": np.array([1.1, 0.2, 0.8]), "prompt_tokens": np.full(3, 10),
               "output_tokens": np.array([11, 1, 6]), "proposed_tokens": np.zeros(3, dtype=int),
               "accepted_tokens": np.zeros(3, dtype=int), "preemptions": np.zeros(3, dtype=int),
               "ignored": np.zeros(3, dtype=bool)}
    frame = pd.DataFrame({**columns, **derived(columns)})
    figures = vllm_io.vllm_style_figures(frame, [False, True, False])
    assert figures["mean_ttft_ms"] == pytest.approx((100 + 0 + 300) / 3)
    assert figures["mean_tpot_ms"] == pytest.approx(100)
    assert figures["mean_e2el_ms"] == pytest.approx((1100 + 200 + 800) / 3)
    assert figures["output_throughput"] == pytest.approx((11 + 0 + 6) / 1.1)
    assert figures["request_throughput"] == pytest.approx(3 / 1.1)


# -- failed requests -----------------------------------------------------------------------------------------------
def test_failed_requests_named_by_errors_are_left_out_and_counted(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", completed=4, failed=2, input_lens=[60, 61, 62, 63, 64, 65],
                       output_lens=[20, 0, 20, 0, 20, 20], ttfts=[0.05, 0.0, 0.05, 0.0, 0.05, 0.05],
                       errors=["", "HTTP 500", "", "timeout", "", ""])
    data = vllm_io.read_vllm_result(path, replay=True)
    assert data["failed"] == 2
    trace = vllm_io.replay_trace(data, seed=0)
    assert trace["prompt_tokens"].tolist() == [60, 62, 64, 65] and not trace["empty_output"].any()
    code, out, err = run(capsys, "compare", path, "--out", tmp_path / "c")
    assert code == 0, err
    assert "failed requests left out: 2" in out
    assert len(pd.read_csv(tmp_path / "c" / "requests.csv")) == 4


def test_lists_of_the_completed_requests_only_beside_a_failed_count_are_all_replayed(tmp_path):
    n = 4
    path = result_file(tmp_path / "r.json", completed=n, failed=2, input_lens=[60] * n, output_lens=[20] * n,
                       ttfts=[0.05] * n, itls=[[0.02] * 19] * n, latencies=[0.43] * n, generated_texts=["x"] * n,
                       errors=None)
    data = vllm_io.read_vllm_result(path, replay=True)
    assert data["failed"] == 2 and len(vllm_io.replay_trace(data, seed=0)) == n


def test_lists_with_failed_requests_but_no_errors_cannot_be_replayed(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", completed=4, failed=2, errors=None)
    line = refused(capsys, "compare", path, "--out", tmp_path / "c")
    assert str(path) in line and "input_lens has 6 entries but completed is 4" in line
    assert vllm_io.read_vllm_result(path)["completed"] == 4  # its figures are still readable


def test_a_run_whose_requests_all_failed_cannot_be_replayed(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", completed=0, failed=6, errors=["refused"] * 6)
    assert "errors: every one of the 6 requests failed" in refused(capsys, "compare", path, "--out", tmp_path / "c")


@pytest.mark.parametrize("errors, key", [([""] * 5, "errors"), ([""] * 5 + [None], "errors[5]"),
                                         ([""] * 5 + [3], "errors[5]")])
def test_a_malformed_errors_list_is_refused(tmp_path, capsys, errors, key):
    path = result_file(tmp_path / "r.json", errors=errors)
    line = refused(capsys, "compare", path, path)
    assert str(path) in line and key in line


# -- summary-only files ---------------------------------------------------------------------------------------------
SUMMARY_ONLY = {key: None for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")}


def test_a_summary_only_file_goes_beside_another_result(tmp_path, capsys):
    a = result_file(tmp_path / "a.json", **SUMMARY_ONLY)
    b = result_file(tmp_path / "b.json", **SUMMARY_ONLY, mean_ttft_ms=60.0)
    code, out, err = run(capsys, "compare", a, b)
    assert code == 0, err
    assert "mean_ttft_ms" in out and "+20.0%" in out


def test_a_summary_only_file_is_not_replayed(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", **SUMMARY_ONLY)
    line = refused(capsys, "compare", path, "--out", tmp_path / "c")
    assert str(path) in line and "input_lens: missing" in line and "--save-detailed" in line


def test_lengths_without_their_partner_are_refused(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", output_lens=None)
    assert "output_lens: missing" in refused(capsys, "compare", path, path)


# -- traffic: request_rate, burstiness, max_concurrency, recorded arrivals --------------------------------------------
@pytest.mark.parametrize("text, rate", [('"inf"', math.inf), ("Infinity", math.inf), ("4", 4.0), ("0.5", 0.5)])
def test_request_rate_is_inf_text_infinity_or_a_number(tmp_path, text, rate):
    path = result_file(tmp_path / "r.json", request_rate="RATE")
    path.write_text(path.read_text().replace('"RATE"', text))
    data = vllm_io.read_vllm_result(path)
    assert data["request_rate"] == rate
    times = vllm_io.replay_trace(data, seed=0)["arrival_time"]
    assert (times == 0).all() if math.isinf(rate) else times.iloc[-1] > 0


@pytest.mark.parametrize("key, value", [("request_rate", "fast"), ("request_rate", 0), ("request_rate", -1),
                                        ("request_rate", True), ("burstiness", 0), ("burstiness", "x"),
                                        ("max_concurrency", 0), ("max_concurrency", 2.5), ("max_concurrency", "4"),
                                        ("completed", -1), ("failed", 1.5)])
def test_a_bad_traffic_figure_is_refused_naming_its_key(tmp_path, capsys, key, value):
    path = result_file(tmp_path / "r.json", **{key: value})
    line = refused(capsys, "compare", path, "--out", tmp_path / "c")
    assert str(path) in line and f"{key}:" in line


def test_burstiness_shapes_the_drawn_gaps_as_vllm_draws_them(tmp_path):
    n = 2000
    def gaps(burstiness):
        data = {"input_lens": [10] * n, "output_lens": [5] * n, "request_rate": 10.0, "burstiness": burstiness}
        return np.diff(vllm_io.replay_trace(data, seed=1)["arrival_time"])
    poisson, bursty, even = gaps(1.0), gaps(0.25), gaps(math.inf)
    assert poisson.mean() == pytest.approx(0.1, rel=0.1) and bursty.mean() == pytest.approx(0.1, rel=0.2)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)  # cv = 1 / sqrt(burstiness)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)
    assert np.allclose(even, 0.1)


def test_infinite_burstiness_reads(tmp_path):
    path = result_file(tmp_path / "r.json", burstiness="B")
    path.write_text(path.read_text().replace('"B"', "Infinity"))
    assert vllm_io.read_vllm_result(path)["burstiness"] == math.inf


def test_the_result_max_concurrency_is_the_replay_config(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", max_concurrency=2)
    code, out, err = run(capsys, "compare", path, "--out", tmp_path / "c")
    assert code == 0, err
    assert json.loads((tmp_path / "c" / "config.json").read_text())["workload"]["max_concurrency"] == 2
    assert "max concurrency 2" in out


def test_recorded_arrivals_are_replayed_as_they_were(tmp_path):
    """start_times are when each request was sent; queue_times how long it waited for a max_concurrency slot."""
    path = result_file(tmp_path / "r.json", start_times=[100.0, 100.5, 101.0, 102.0, 102.5, 103.0],
                       queue_times=[0.0, 0.0, 0.5, 1.0, 1.0, 1.0])
    trace = vllm_io.replay_trace(vllm_io.read_vllm_result(path, replay=True), seed=0)
    assert trace["arrival_time"].tolist() == [0.0, 0.5, 0.5, 1.0, 1.5, 2.0]


def test_a_ramp_up_run_without_recorded_arrivals_is_not_replayed(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", request_rate="inf", ramp_up_strategy="linear", ramp_up_start_rps=1,
                       ramp_up_end_rps=10)
    assert "ramp_up_strategy" in refused(capsys, "compare", path, "--out", tmp_path / "c")


# -- speculative decoding figures --------------------------------------------------------------------------------------
SPEC = {"spec_decode_acceptance_rate": 62.5, "spec_decode_acceptance_length": 3.5, "spec_decode_num_drafts": 400,
        "spec_decode_draft_tokens": 1600, "spec_decode_accepted_tokens": 1000,
        "spec_decode_per_position_acceptance_rates": [0.9, 0.7, 0.5, 0.4]}


def test_speculative_decoding_figures_are_compared(tmp_path, capsys):
    a = result_file(tmp_path / "a.json", **SPEC)
    b = result_file(tmp_path / "b.json", **{**SPEC, "spec_decode_acceptance_length": 2.8,
                                            "spec_decode_per_position_acceptance_rates": [0.9, 0.7, 0.5, 0.2]})
    code, out, err = run(capsys, "compare", a, b)
    assert code == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert rows["spec_decode_acceptance_length"] == ["3.50", "2.80", "-20.0%"]
    assert rows["spec_decode_acceptance_rate"] == ["62.50", "62.50", "+0.0%"]
    assert rows["spec_decode_per_position_acceptance_rate_3"] == ["0.40", "0.20", "-50.0%"]
    assert {"spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens"} <= set(rows)


def test_a_speculating_run_compares_its_acceptance_with_vllm(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", **SPEC)
    code, out, err = run(capsys, "compare", path, "--policy", "fixed-k", "--k", "3", "--out", tmp_path / "c")
    assert code == 0, err
    table = pd.read_csv(tmp_path / "c" / "compare.csv").set_index("figure")
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert table.loc["spec_decode_acceptance_rate", "simulated"] == pytest.approx(summary["acceptance_rate"] * 100)
    assert table.loc["spec_decode_draft_tokens", "simulated"] == summary["proposed_tokens"]


@pytest.mark.parametrize("key, value", [("spec_decode_acceptance_rate", 120), ("spec_decode_acceptance_rate", "62"),
                                        ("spec_decode_acceptance_length", 0.5), ("spec_decode_num_drafts", -1),
                                        ("spec_decode_draft_tokens", 1.5), ("spec_decode_accepted_tokens", 2000),
                                        ("spec_decode_per_position_acceptance_rates", 0.5),
                                        ("spec_decode_per_position_acceptance_rates", [0.5, 1.5])])
def test_a_malformed_speculative_figure_is_refused_naming_its_key(tmp_path, capsys, key, value):
    path = result_file(tmp_path / "r.json", **{**SPEC, key: value})
    line = refused(capsys, "compare", path, path)
    assert str(path) in line and key in line


# -- other shapes ------------------------------------------------------------------------------------------------
def test_old_names_read_as_todays(tmp_path):
    """vLLM 0.6-era files (LambdaLabsML/vllm-benchmark) name E2EL ``latency``; vLLM 0.8 wrote ``request_goodput:``."""
    path = result_file(tmp_path / "r.json", mean_latency_ms=430.0, p99_latency_ms=450.0, **{"request_goodput:": 1.5})
    figures = vllm_io.vllm_figures(vllm_io.read_vllm_result(path))
    assert (figures["mean_e2el_ms"], figures["p99_e2el_ms"], figures["request_goodput"]) == (430.0, 450.0, 1.5)


@pytest.mark.parametrize("key, text", [("std_tpot_ms", "NaN"), ("duration", "NaN"), ("total_output_tokens", "NaN"),
                                       ("mean_itl_ms", "Infinity"), ("total_input_tokens", "-Infinity")])
def test_a_figure_written_as_nan_or_infinite_is_refused_naming_its_key(tmp_path, capsys, key, text):
    """vLLM writes a statistic of no values as 0 (``np.mean(x or 0)``), never NaN: a NaN or infinite figure is a damaged
    file, refused rather than read as missing and replaced by one computed from nothing."""
    path = result_file(tmp_path / "r.json", **{key: "N"})
    path.write_text(path.read_text().replace('"N"', text))
    line = refused(capsys, "compare", path, path)
    assert f"{path}: {key}: " in line


def test_a_result_in_which_no_request_streamed_a_token_is_refused(tmp_path, capsys):
    n = 6  # result_file's requests
    path = result_file(tmp_path / "r.json", output_lens=[0] * n, ttfts=[0.0] * n)
    line = refused(capsys, "compare", path, "--out", tmp_path / "c")
    assert f"{path}: output_lens: none of the {n} successful requests streamed a token" in line
    summary_only = result_file(tmp_path / "s.json", total_output_tokens=0, completed=n, input_lens=None,
                               output_lens=None, ttfts=None, itls=None, latencies=None, errors=None,
                               generated_texts=None)
    assert "total_output_tokens: 0 over" in refused(capsys, "compare", summary_only, summary_only)


@pytest.mark.parametrize("key, value", [("mean_ttft_ms", "50"), ("p99_tpot_ms", -1.0), ("duration", [3.0]),
                                        ("ttfts", [0.05] * 5 + [-1.0]), ("itls", [[0.02]] * 5 + [["a"]]),
                                        ("input_lens", [60] * 5 + [0]), ("latencies", "0.4")])
def test_a_malformed_figure_or_list_is_refused_naming_its_key(tmp_path, capsys, key, value):
    path = result_file(tmp_path / "r.json", **{key: value})
    line = refused(capsys, "compare", path, path)
    assert str(path) in line and key in line


def test_appended_results_are_refused_as_such(tmp_path, capsys):
    path = result_file(tmp_path / "r.json")
    path.write_text(path.read_text() + "\n" + path.read_text())
    line = refused(capsys, "compare", path, path)
    assert str(path) in line and "--append-result" in line


def test_the_replay_refuses_an_unchecked_summary_only_dict():
    with pytest.raises(UserError, match="input_lens: missing"):
        vllm_io.replay_trace({"request_rate": 4.0, "burstiness": 1.0}, seed=0)


# -- the public files ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(not LAMBDA.is_dir(), reason="no shared vLLM results here")
@pytest.mark.parametrize("name", sorted(p.name for p in LAMBDA.glob("*.json")) if LAMBDA.is_dir() else [])
def test_every_public_lambda_result_replays_end_to_end(tmp_path, capsys, name):
    """vLLM 0.6 runs (LambdaLabsML/vllm-benchmark): request rate inf, some completed requests with no text."""
    source = json.loads((LAMBDA / name).read_text())
    code, out, err = run(capsys, "compare", LAMBDA / name, "--out", tmp_path / "c")
    assert code == 0, err
    trace = pd.read_csv(tmp_path / "c" / "replayed_workload.csv")
    assert trace["prompt_tokens"].tolist() == source["input_lens"]
    assert trace["empty_output"].tolist() == [o == 0 for o in source["output_lens"]]
    table = pd.read_csv(tmp_path / "c" / "compare.csv").set_index("figure")
    assert table.loc["mean_e2el_ms", f"measured ({name})"] == source["mean_latency_ms"]
    requests = pd.read_csv(tmp_path / "c" / "requests.csv")
    ttft = np.where(trace["empty_output"], 0.0, requests["ttft"])  # vLLM's count: no text, TTFT 0
    assert table.loc["mean_ttft_ms", "simulated"] == pytest.approx(ttft.mean() * 1e3)


# -- the two tracebacks -----------------------------------------------------------------------------------------------
def run_sim(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "run_sim.py"), *argv], capture_output=True, text=True, **kwargs)


def test_a_gamma_cv_too_small_for_its_shape_is_one_line(tmp_path):
    done = run_sim("simulate", "--arrival", "gamma", "--cv", "1e-300", "--rate", "1", "--num-requests", "10",
                   "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "cv=1e-300" in done.stderr


def test_a_closed_stdout_ends_quietly(tmp_path):
    """``sweep ... | head -1``: the reader goes away before the table is printed."""
    process = subprocess.Popen([sys.executable, str(REPO / "run_sim.py"), "sweep", "--rates", "1,2", "--policies",
                                "no-spec", "--num-requests", "50", "--workers", "1", "--out", str(tmp_path / "s")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err
