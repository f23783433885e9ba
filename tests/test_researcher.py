"""Issue 15, for the researcher at the keyboard: help, vLLM's names, metrics and files, saturation, timeline,
figures. Small runs only."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

import run_sim
from policies.errors import UserError
from simulator.config import SimConfig
from simulator.core.runner import run_simulation


def run(capsys, *argv):
    code = run_sim.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- help ------------------------------------------------------------------------------------------
def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        run_sim.main(["--help"])
    text = capsys.readouterr().out
    for name in ("simulate", "sweep", "plot", "tune", "compare", "demo", "bench", "profile", "validate"):
        assert f"    {name}" in text, name


@pytest.mark.parametrize("command", ["simulate", "sweep", "tune"])
def test_every_flag_says_more_than_its_default(command):
    from simulator.studies.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest == "help":
            continue
        text = action.help or ""
        assert len(text.replace("(default", "").strip()) > 25, (action.option_strings, text)


def test_vllm_spellings_are_aliases(capsys, tmp_path):
    code, out, err = run(capsys, "simulate", "--request-rate", "2", "--num-prompts", "30", "--policy", "fixed-k",
                         "--num-speculative-tokens", "3", "--token-acceptance-prob", "0.7", "--out", str(tmp_path / "a"))
    assert code == 0, err
    code, _, err = run(capsys, "simulate", "--rate", "2", "--num-requests", "30", "--policy", "fixed-k", "--k", "3",
                       "--acceptance-rate", "0.7", "--out", str(tmp_path / "b"))
    assert code == 0, err
    a = json.loads((tmp_path / "a" / "summary.json").read_text())
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert a["mean_latency"] == b["mean_latency"]
    assert "measured draft acceptance rate" in out and "input token acceptance probability 0.7 (constant)" in out


def test_the_printed_input_acceptance_is_what_the_model_read(capsys, tmp_path):
    """A position model reads its positions, not the (unused) token probability."""
    code, out, err = run(capsys, "simulate", "--rate", "2", "--num-requests", "30", "--policy", "fixed-k", "--k", "3",
                         "--acceptance", "position", "--acceptance-positions", "0.8,0.7,0.6", "--out", str(tmp_path))
    assert code == 0, err
    assert "input acceptance by position 0.8,0.7,0.6 (position)" in out and "probability 0.8" not in out


def test_burstiness_is_gamma_shape(capsys, tmp_path):
    code, _, err = run(capsys, "simulate", "--request-rate", "2", "--num-prompts", "20", "--burstiness", "0.25",
                       "--out", str(tmp_path / "r"))
    assert code == 0, err
    config = json.loads((tmp_path / "r" / "config.json").read_text())["workload"]
    assert config["arrival"] == "gamma" and config["cv"] == pytest.approx(2.0)
    code, _, err = run(capsys, "simulate", "--rate", "2", "--num-requests", "20", "--burstiness", "0",
                       "--out", str(tmp_path / "s"))
    assert code == 2 and err.count("\n") == 1 and "--burstiness" in err


@pytest.mark.parametrize("bad", ["ttft", "foo:3", "ttft:x", "ttft:-1"])
def test_bad_goodput_is_one_line(capsys, tmp_path, bad):
    code, _, err = run(capsys, "simulate", "--rate", "2", "--num-requests", "10", "--goodput", bad,
                       "--out", str(tmp_path / "r"))
    assert code == 2 and err.count("\n") == 1 and "--goodput" in err


# -- metrics ---------------------------------------------------------------------------------------
def _result(**changes):
    return run_simulation(SimConfig.of(**{"rate": 2.0, "num_requests": 60, **changes}))


def test_itl_counts_a_speculative_burst_as_one_gap():
    spec = _result(policy="fixed-k", k=4, acceptance_rate=0.8)
    s, req = spec.summary, spec.requests
    # mean ITL x chunks = decode time, exactly
    decode = (req["finish_time"] - req["first_token_time"]).sum()
    assert s["mean_itl_ms"] == pytest.approx(decode / req["chunks"].sum() * 1e3)
    assert s["mean_itl_ms"] > 1.5 * s["mean_tpot_ms"]  # bursts of ~3 tokens per gap
    plain = _result().summary
    assert plain["mean_itl_ms"] == pytest.approx(plain["mean_tpot_ms"], rel=0.05)  # one token per chunk
    assert s["median_ttft_ms"] == pytest.approx(s["p50_ttft"] * 1e3)
    assert s["std_e2el_ms"] == pytest.approx(np.std(req["latency"]) * 1e3)


def test_goodput_counts_requests_meeting_every_slo():
    r = _result(policy="fixed-k", k=3, goodput_slo=(("ttft", 1e6), ("tpot", 1e6)))
    assert r.summary["slo_attainment"] == 1.0
    assert r.summary["request_goodput"] == pytest.approx(r.summary["request_throughput"])
    bound = float(np.median(r.requests["ttft"])) * 1e3
    r2 = _result(policy="fixed-k", k=3, goodput_slo=(("ttft", bound),))
    assert r2.summary["slo_attainment"] == pytest.approx((r2.requests["ttft"] * 1e3 <= bound).mean())
    assert "request_goodput" not in _result().summary


def test_saturated_only_when_the_queue_grows(capsys, tmp_path):
    light = _result(rate=0.5).summary
    assert light["saturated"] is False
    code, _, err = run(capsys, "simulate", "--rate", "40", "--num-requests", "300", "--out", str(tmp_path / "r"))
    assert code == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["saturated"] is True and summary["served_rate"] < 0.9 * summary["offered_rate"]
    assert "saturated" in err and "req/s offered" in err


# -- files -----------------------------------------------------------------------------------------
def _sharegpt(path, convs):
    path.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(convs)]))
    return path


def test_sharegpt_json_lengths_estimated_and_labelled(tmp_path, capsys):
    from simulator.inputs.workload import read_sharegpt

    data = _sharegpt(tmp_path / "sg.json", [
        [{"from": "human", "value": "a" * 40}, {"from": "gpt", "value": "b" * 400}],
        [{"from": "human", "value": "c" * 81}, {"from": "gpt", "value": "d" * 20}, {"from": "human", "value": "x"}],
        [{"from": "human", "value": "only one turn"}],
        [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "short"}],  # < 4 tokens: dropped, as vLLM
    ])
    prompt, output, label = read_sharegpt(str(data))
    assert prompt.tolist() == [10, 21] and output.tolist() == [100, 5]
    assert "ESTIMATED" in label
    code, out, err = run(capsys, "simulate", "--rate", "2", "--num-requests", "20", "--dataset-name", "sharegpt",
                         "--dataset-path", str(data), "--format", "csv", "--out", str(tmp_path / "r"))
    assert code == 0, err
    assert "ESTIMATED" in out
    req = pd.read_csv(tmp_path / "r" / "requests.csv")
    assert set(req["prompt_tokens"]) <= {10, 21}


def test_sharegpt_json_lengths_counted_by_a_local_tokenizer_file(tmp_path):
    """--tokenizer: a tokenizer.json (or a folder holding one) counts the tokens exactly, without torch."""
    tokenizers = pytest.importorskip("tokenizers")
    from simulator.inputs.workload import read_sharegpt

    words = ["a", "b", "c", "d", "e", "[UNK]"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    data = _sharegpt(tmp_path / "sg.json", [[{"from": "human", "value": "a b c d e"},
                                             {"from": "gpt", "value": "e d c b a a"}]])
    for name in (str(folder), str(folder / "tokenizer.json")):
        prompt, output, label = read_sharegpt(str(data), name)
        assert prompt.tolist() == [5] and output.tolist() == [6] and label == f"tokens counted by {name}"
    with pytest.raises(UserError, match="no tokenizer.json there or in the local cache"):
        read_sharegpt(str(data), str(tmp_path / "missing"))


@pytest.mark.parametrize("content, what", [("{", "not a JSON"), ("{}", "JSON list"), ("[1]", "entry 0"),
                                           ('[{"conversations": [{"from": "human"}, {}]}]', "turn 0"),
                                           ('[{"conversations": []}]', "at least two turns")])
def test_bad_sharegpt_is_one_line(tmp_path, capsys, content, what):
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, _, err = run(capsys, "simulate", "--rate", "2", "--num-requests", "5", "--dataset-path", str(path),
                       "--out", str(tmp_path / "r"))
    assert code == 2 and err.count("\n") == 1 and what in err and str(path) in err


def _vllm_fixture(path, n=30, rate=4.0):
    """A result file as vllm bench serve --save-result writes it (vllm/benchmarks/serve.py's keys)."""
    rng = np.random.default_rng(1)
    out_lens = rng.integers(20, 80, n).tolist()
    itls = [[0.02] * (o - 1) for o in out_lens]
    ttfts = rng.uniform(0.05, 0.1, n).tolist()
    data = {"date": "20250101-000000", "backend": "vllm", "model_id": "m", "tokenizer_id": "m", "num_prompts": n,
            "request_rate": rate, "burstiness": 1.0, "max_concurrency": None, "duration": 10.0, "completed": n,
            "total_input_tokens": 100 * n, "total_output_tokens": sum(out_lens), "request_throughput": n / 10,
            "request_goodput": None, "output_throughput": sum(out_lens) / 10, "total_token_throughput": 1.0,
            "input_lens": [100] * n, "output_lens": out_lens, "ttfts": ttfts, "itls": itls,
            "generated_texts": [""] * n, "errors": [""] * n, "mean_ttft_ms": float(np.mean(ttfts) * 1e3),
            "median_ttft_ms": float(np.median(ttfts) * 1e3), "std_ttft_ms": 1.0, "p99_ttft_ms": 99.0,
            "mean_itl_ms": 20.0, "median_itl_ms": 20.0, "std_itl_ms": 0.0, "p99_itl_ms": 20.0}
    path.write_text(json.dumps(data))
    return path


def test_compare_replays_a_vllm_result(tmp_path, capsys):
    src = _vllm_fixture(tmp_path / "vllm.json")
    code, out, err = run(capsys, "compare", str(src), "--policy", "fixed-k", "--k", "2", "--out", str(tmp_path / "c"))
    assert code == 0, err
    table = pd.read_csv(tmp_path / "c" / "compare.csv")
    assert {"mean_ttft_ms", "mean_itl_ms", "request_throughput"} <= set(table["figure"])
    req = pd.read_csv(tmp_path / "c" / "requests.csv")
    assert req["output_tokens"].tolist() == json.loads(src.read_text())["output_lens"]
    assert (tmp_path / "c" / "compare.png").is_file()


@pytest.mark.parametrize("change, what", [({"input_lens": []}, "input_lens"), ({"output_lens": [1, 2]}, "output_lens"),
                                          ({"request_rate": "fast"}, "request_rate"), ({"burstiness": 0}, "burstiness")])
def test_bad_vllm_result_is_one_line(tmp_path, capsys, change, what):
    src = _vllm_fixture(tmp_path / "vllm.json")
    data = json.loads(src.read_text())
    data.update(change)
    src.write_text(json.dumps(data))
    code, _, err = run(capsys, "compare", str(src), "--out", str(tmp_path / "c"))
    assert code == 2 and err.count("\n") == 1 and what in err


def test_save_result_follows_vllm_schema_and_reads_back(tmp_path, capsys):
    from simulator.studies.vllm_io import read_vllm_result

    code, _, err = run(capsys, "simulate", "--rate", "3", "--num-requests", "25", "--policy", "fixed-k", "--goodput",
                       "ttft:300", "--save-result", "--save-timeline", "--format", "csv", "--out", str(tmp_path / "r"))
    assert code == 0, err
    data = read_vllm_result(tmp_path / "r" / "vllm_result.json")
    for key in ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "generated_texts", "errors", "mean_ttft_ms", "median_tpot_ms", "p99_itl_ms",
                "std_e2el_ms", "request_rate", "burstiness"):
        assert key in data, key
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert data["request_goodput"] == summary["request_goodput"]
    assert sum(map(len, data["itls"])) == int(pd.read_csv(tmp_path / "r" / "requests.csv")["chunks"].sum())
    # the same run, compared with itself through the vLLM file: no difference
    code, out, _ = run(capsys, "compare", str(tmp_path / "r"), str(tmp_path / "r" / "vllm_result.json"))
    assert code == 0 and "+0.0%" in out
    timeline = json.loads((tmp_path / "r" / "timeline.json").read_text())
    events = timeline["traceEvents"]
    steps = [e for e in events if e["ph"] == "X"]
    assert steps and all({"k_max", "batch_size", "emitted"} <= set(e["args"]) for e in steps)
    assert sum(e["ph"] == "b" and e["name"].startswith("request") for e in events) == 25


# -- figures ---------------------------------------------------------------------------------------
def test_policy_colours_are_fixed():
    from simulator.studies.plots import policy_color

    assert policy_color("goodput") == policy_color("goodput acceptance_rate=0.5") == "tab:red"
    assert policy_color("my-policy:3") == policy_color("my-policy:3")


def test_tune_attainment_slo_and_warning(tmp_path, capsys):
    code, out, err = run(capsys, "tune", "--policy", "fixed-k", "--slo", "99% ttft:100000 tpot:100000", "--rates",
                         "1,2", "--num-requests", "30", "--param", "k=1,2", "--workers", "1", "--quiet",
                         "--out", str(tmp_path / "t"))
    assert code == 0, err
    assert "every setting meets the SLO at every rate tried" in err
    table = pd.read_csv(tmp_path / "t" / "tune.csv")
    assert math.isclose(table["sustainable_rate"].max(), 2.0)
