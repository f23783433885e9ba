"""Families of bad input, as a hostile tester would give them: each case builds its files in a folder and returns
the command line; it must end with exit status 2 and one line naming the input and the problem (``error``), or
is a documented acceptance (``ok``: exit 0, checked by the tests).

Used by ``tests/test_bad_inputs.py`` (in process, fast) and as a script that runs every case as a real process
against a checkout and prints how each one ends (the before/after table of issue 11)::

    python -m tests.bad_inputs [REPO_ROOT] > table.md
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

COST = {
    "target": {"base": 0.01, "per_batched_token": 1e-5, "per_context_token": 1e-8},
    "draft": {"base": 0.001, "per_batched_token": 0.0, "per_context_token": 0.0},
    "prefill": {"base": 0.005, "per_prompt_token": 1e-5},
    "overhead": {"base": 0.001},
    "method": "hand-written",
    "memory": {"device_memory_gb": 80.0, "target_weight_gb": 12.6, "draft_weight_gb": 0.13,
               "target_kv_bytes_per_token": 524288, "draft_kv_bytes_per_token": 6144},
}
SMALL = ["--rate", "4", "--num-requests", "20", "--num-gpu-blocks", "2000"]


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    build: Callable[[Path], list[str]]
    """Writes the case's files under the folder and returns argv (after ``run_sim.py``)."""
    expect: str = "error"
    """``error``: exit 2 and one line containing ``needle``; ``ok``: exit 0."""
    needle: str = ""
    env: dict[str, str] = field(default_factory=dict)


def profile(d: Path, **changes) -> str:
    data = json.loads(json.dumps(COST))
    for key, value in changes.items():
        block, _, name = key.partition("__")
        if name:
            data[block][name] = value
        else:
            data[block] = value
    path = d / "cost.json"
    path.write_text(json.dumps(data))
    return str(path)


def write(d: Path, name: str, text: str | bytes) -> str:
    path = d / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


def simulate(d: Path, *flags: str, prof: str | None = None) -> list[str]:
    return ["simulate", "--profile", prof or profile(d), *flags, "--format", "csv", "--out", str(d / "out")]


def trace_case(text: str | bytes, *extra: str) -> Callable[[Path], list[str]]:
    return lambda d: simulate(d, "--trace", write(d, "trace.csv", text), "--num-gpu-blocks", "100000", *extra)


def config_case(data: dict | str) -> Callable[[Path], list[str]]:
    def build(d: Path) -> list[str]:
        base = {"rate": 4.0, "num_requests": 20, "num_gpu_blocks": 2000, "profile": profile(d)}
        text = data if isinstance(data, str) else json.dumps({**base, **data})
        return ["simulate", "--config", write(d, "config.json", text), "--format", "csv", "--out", str(d / "out")]
    return build


def policy_case(body: str, *extra: str, name: str = "mine") -> Callable[[Path], list[str]]:
    source = textwrap.dedent('''\
        import sys, time
        import numpy as np
        from policies import Policy, register


        @register
        class Mine(Policy):
            name = "{name}"
        ''').format(name=name) + textwrap.indent(textwrap.dedent(body), "    ")

    def build(d: Path) -> list[str]:
        path = write(d, "my_policy.py", source)
        return simulate(d, "--policy-file", path, "--policy", name, *SMALL, *extra)
    return build


def nested_config_case(extra: dict) -> Callable[[Path], list[str]]:
    """A ``config.json`` by concern, as runs write it, with ``extra`` concerns' fields merged in."""
    def build(d: Path) -> list[str]:
        data = {"workload": {"rate": 4.0, "num_requests": 20}, "engine": {"num_gpu_blocks": 2000},
                "cost": {"profile": profile(d)}}
        for concern, fields in extra.items():
            data[concern] = {**data.get(concern, {}), **fields}
        return ["simulate", "--config", write(d, "config.json", json.dumps(data)), "--format", "csv", "--out",
                str(d / "out")]
    return build


def earlier(d: Path, name: str | None = None, text: str = "") -> str:
    """A folder ``d/earlier`` holding an earlier result: the file ``name``, or else a simulate run's (run here)."""
    folder = d / "earlier"
    if name is None:
        from simulator.studies.cli import main

        assert main(["simulate", "--rate", "2", "--num-requests", "4", "--out", str(folder)]) == 0
    else:
        folder.mkdir()
        write(folder, name, text)
    return str(folder)


def sweep(d: Path, *flags: str) -> list[str]:
    return ["sweep", "--profile", profile(d), "--num-requests", "10", "--num-gpu-blocks", "2000", "--workers", "1",
            "--quiet", *flags, "--out", str(d / "sweep")]


def plot_case(summary: str | bytes | None) -> Callable[[Path], list[str]]:
    def build(d: Path) -> list[str]:
        (d / "sweep").mkdir()
        if summary is not None:
            write(d / "sweep", "summary.csv", summary)
        return ["plot", str(d / "sweep")]
    return build


OK_SUMMARY = "policy,policy_name,rate,seed,mean_norm_latency,p99_norm_latency,mean_latency,profile_method\n" \
             "no-spec,no-spec,1,0,0.01,0.02,1.0,hand-written\nfixed-k:2,fixed-k,1,0,0.009,0.02,0.9,hand-written\n"

PLAIN = "arrival_time,prompt_tokens,output_tokens\n"
#: A small ``vllm bench serve --save-result --save-detailed`` file: three requests, the second streamed no text.
VLLM_RESULT = {"request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None, "completed": 3, "failed": 0,
               "input_lens": [60, 61, 62], "output_lens": [20, 0, 20], "ttfts": [0.05, 0.0, 0.05],
               "errors": ["", "", ""], "mean_ttft_ms": 33.3}


def vllm_case(changes: dict | None = None, text: str | None = None) -> Callable[[Path], list[str]]:
    """``compare RESULT.json --out``: replay :data:`VLLM_RESULT` with ``changes`` (None removes a key), or ``text``."""
    def build(d: Path) -> list[str]:
        data = {k: v for k, v in {**VLLM_RESULT, **(changes or {})}.items() if v is not None}
        path = write(d, "result.json", json.dumps(data) if text is None else text)
        return ["compare", path, "--profile", profile(d), "--out", str(d / "out")]
    return build


def calibrate_case(changes: dict | None = None) -> Callable[[Path], list[str]]:
    """``calibrate RESULT.json``: fit :data:`VLLM_RESULT` with ``changes``."""
    def build(d: Path) -> list[str]:
        path = write(d, "result.json", json.dumps({**VLLM_RESULT, **(changes or {})}))
        return ["calibrate", path, "--gpu", "h100-80gb", "--target", "llama-3.1-8b", "--max-evals", "1", "--out",
                str(d / "p.csv")]
    return build


PROFILE_HEADER = "role,phase,batch_size,query_len,context_len,seconds\n"

CASES: list[Case] = [
    # -- trace files ----------------------------------------------------------------------------------------
    Case("trace CSV", "token count 1e30", trace_case(PLAIN + "0,1e30,5\n1,10,5\n"), needle="prompt_tokens"),
    Case("trace CSV", "token count past int64", trace_case(PLAIN + "0,99999999999999999999,5\n"),
         needle="prompt_tokens"),
    Case("trace CSV", "counts whose sum overflows int64",
         trace_case(PLAIN + "".join(f"{i},4000000000000000000,4000000000000000000\n" for i in range(4))),
         needle="must be <="),
    Case("trace CSV", "arrival time 1e20", trace_case(PLAIN + "0,10,5\n1e20,10,5\n"), needle="arrival_time"),
    Case("trace CSV", "arrival time inf", trace_case(PLAIN + "0,10,5\ninf,10,5\n"), needle="arrival_time"),
    Case("trace CSV", "NaN output", trace_case(PLAIN + "0,10,nan\n"), needle="output_tokens"),
    Case("trace CSV", "UTF-8 BOM before the header (accepted)", trace_case("\ufeff" + PLAIN + "0,10,5\n1,10,5\n"),
         expect="ok"),
    Case("trace CSV", "Azure header with a BOM (accepted)",
         trace_case("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,5\n"
                    "2023-11-16 18:15:47.1,10,5\n"), expect="ok"),
    Case("trace CSV", "binary garbage", trace_case(b"\x00\xff\xfe\x89PNG\r\n\x1a\n" * 10), needle="trace.csv"),
    Case("trace CSV", "only a header", trace_case(PLAIN), needle="no rows"),
    Case("trace CSV", "fractional tokens", trace_case(PLAIN + "0,10.5,5\n"), needle="whole number"),
    Case("trace CSV", "times going backwards", trace_case(PLAIN + "5,10,5\n1,10,5\n"), needle="goes backwards"),
    Case("trace CSV", "a folder as the trace", lambda d: simulate(d, "--trace", str(d)), needle=str("file not found")),
    Case("trace CSV", "epoch timestamps", trace_case(PLAIN + "1700000000,10,5\n1700000001,10,5\n"),
         needle="epoch"),
    Case("trace CSV", "rescaled far past the clock", trace_case(PLAIN + "0,10,5\n1,10,5\n", "--trace-speedup",
                                                                "1e-12"), needle="later than"),
    # -- length files ---------------------------------------------------------------------------------------
    Case("length file", "huge lengths",
         lambda d: simulate(d, *SMALL, "--length-dist", "file", "--length-file",
                            write(d, "len.csv", "prompt_tokens,output_tokens\n1e300,5\n"), ), needle="prompt_tokens"),
    Case("length file", "given without --length-dist file",
         lambda d: simulate(d, *SMALL, "--length-file", write(d, "len.csv", "prompt_tokens,output_tokens\n10,5\n")),
         needle="length_file"),
    Case("length file", "missing file", lambda d: simulate(d, *SMALL, "--length-dist", "file", "--length-file",
                                                           str(d / "nope.csv")), needle="nope.csv"),
    # -- flags ----------------------------------------------------------------------------------------------
    Case("flags", "--cv inf", lambda d: simulate(d, *SMALL, "--arrival", "gamma", "--cv", "inf"), needle="cv"),
    Case("flags", "--cv nan", lambda d: simulate(d, *SMALL, "--arrival", "gamma", "--cv", "nan"), needle="cv"),
    Case("flags", "--cv 1e308", lambda d: simulate(d, *SMALL, "--arrival", "gamma", "--cv", "1e308"), needle="cv"),
    Case("flags", "--cv 1e-300 (Gamma shape 1/cv^2 overflows)",
         lambda d: simulate(d, *SMALL, "--arrival", "gamma", "--cv", "1e-300"), needle="cv=1e-300"),
    Case("flags", "--cv 3 under poisson arrivals", lambda d: simulate(d, *SMALL, "--cv", "3"), needle="cv"),
    Case("flags", "--rate inf (accepted: vLLM's closed loop, every request at 0 s)",
         lambda d: simulate(d, "--rate", "inf", "--num-requests", "20"), expect="ok"),
    Case("flags", "--rate inf without --num-requests", lambda d: simulate(d, "--rate", "inf", "--duration", "5"),
         needle="--rate inf sends every request at t = 0: it needs --num-requests"),
    Case("flags", "--rate inf with a trace", trace_case(PLAIN + "0,10,5\n1,10,5\n", "--rate", "inf"),
         needle="--rate inf with a trace"),
    Case("flags", "--rate -1", lambda d: simulate(d, "--rate", "-1", "--num-requests", "20"),
         needle="--rate must be > 0"),
    Case("flags", "--num-request (an abbreviation)", lambda d: simulate(d, "--rate", "4", "--num-request", "5"),
         needle="unrecognized arguments: --num-request 5"),
    Case("flags", "--token-acceptance-prob 1.5", lambda d: simulate(d, *SMALL, "--token-acceptance-prob", "1.5"),
         needle="--token-acceptance-prob (acceptance_rate) must be in [0, 1], got 1.5"),
    Case("flags", "--rate nan", lambda d: simulate(d, "--rate", "nan", "--num-requests", "20"), needle="rate"),
    Case("flags", "--rate 1e-300", lambda d: simulate(d, "--rate", "1e-300", "--num-requests", "20"),
         needle="rate"),
    Case("flags", "--gpu-memory-gb 1e308", lambda d: simulate(d, "--rate", "4", "--num-requests", "20",
                                                              "--gpu-memory-gb", "1e308"), needle="gpu_memory_gb"),
    Case("flags", "--acceptance-rate nan", lambda d: simulate(d, *SMALL, "--acceptance-rate", "nan"),
         needle="acceptance_rate"),
    Case("flags", "--duration inf", lambda d: simulate(d, "--rate", "4", "--duration", "inf"), needle="duration"),
    Case("flags", "--max-num-seqs 1e30", lambda d: simulate(d, *SMALL, "--max-num-seqs", str(10 ** 30)),
         needle="max_num_seqs"),
    Case("flags", "--policy-param bonus=nan",
         lambda d: simulate(d, *SMALL, "--policy", "goodput", "--policy-param", "bonus=nan"), needle="bonus"),
    Case("flags", "vllm-batch-table not starting at batch size 1",
         lambda d: simulate(d, *SMALL, "--policy", "vllm-batch-table", "--policy-param", "table=2:3,8:1"),
         needle="must start at batch size 1"),
    Case("flags", "vllm-batch-table without its table", lambda d: simulate(d, *SMALL, "--policy", "vllm-batch-table"),
         needle="table is required"),
    Case("flags", "sglang-adaptive tiers above --k", lambda d: simulate(d, *SMALL, "--policy", "sglang-adaptive"),
         needle="above the configured k 4"),
    Case("flags", "sglang-adaptive ema_alpha 0",
         lambda d: simulate(d, *SMALL, "--policy", "sglang-adaptive", "--k", "7", "--policy-param", "ema_alpha=0"),
         needle="ema_alpha must be in (0, 1]"),
    Case("flags", "--trace under --arrival poisson",
         lambda d: simulate(d, *SMALL, "--arrival", "poisson", "--trace", write(d, "t.csv", PLAIN + "0,10,5\n")),
         needle="trace"),
    Case("flags", "--acceptance-trace without --acceptance replay",
         lambda d: simulate(d, *SMALL, "--acceptance-trace", write(d, "a.csv", "request_id,proposed,accepted\n")),
         needle="acceptance_trace"),
    Case("flags", "--out ''", lambda d: simulate(d, *SMALL)[:-1] + [""], needle="--out"),
    Case("flags", "--out is a file", lambda d: simulate(d, *SMALL)[:-1] + [write(d, "afile", "x")],
         needle="not a folder"),
    Case("flags", "--out under a file", lambda d: simulate(d, *SMALL)[:-1] + [write(d, "afile", "x") + "/sub"],
         needle="cannot create"),
    Case("flags", "--replicas with an empty entry", lambda d: simulate(d, *SMALL, "--replicas", "a,,b"),
         needle="--replicas a,,b: an empty entry"),
    Case("flags", "--replicas with a trailing comma", lambda d: simulate(d, *SMALL, "--replicas", "a,b,"),
         needle="--replicas a,b,: an empty entry"),
    Case("flags", "--acceptance-by-rank with a gap in its ranks",
         lambda d: simulate(d, *SMALL, "--policy", "fixed-k", "--acceptance-by-rank",
                            write(d, "ranks.csv", "depth,rank,probability\n1,0,0.5\n1,2,0.1\n2,0,0.6\n")),
         needle="ranks.csv: depth 1 has no row of rank 1"),
    Case("flags", "--acceptance-by-rank with a gap in its depths",
         lambda d: simulate(d, *SMALL, "--policy", "fixed-k", "--acceptance-by-rank",
                            write(d, "ranks.csv", "depth,rank,probability\n1,0,0.5\n3,0,0.6\n")),
         needle="ranks.csv: depth 2 has no row"),
    Case("flags", "bench --fleet -1", lambda d: ["bench", "--fleet", "-1"], needle="--fleet: a whole number >= 0"),
    Case("flags", "bench --sizes with an empty item", lambda d: ["bench", "--sizes", "10,,20"],
         needle="--sizes: an empty item"),
    Case("flags", "bench: an abbreviated flag (one line, no usage)", lambda d: ["bench", "--fleet-rat", "3"],
         needle="unrecognized arguments: --fleet-rat 3"),
    Case("flags", "bench: an unknown policy", lambda d: ["bench", "--policies", "no-spec,warp"],
         needle="--policies warp"),
    Case("flags", "simulate --out into a sweep's folder (written before folders recorded their kind)",
         lambda d: simulate(d, *SMALL)[:-1] + [earlier(d, "summary.csv", OK_SUMMARY)],
         needle="holds a sweep's results (its summary.csv); a simulate run would mix its files with them"),
    Case("flags", "sweep --out into a run's folder",
         lambda d: sweep(d, "--rates", "1", "--policies", "no-spec")[:-1] + [earlier(d)],
         needle="holds a simulate run's results (recorded in .specsim-kind); a sweep would mix its files"),
    Case("flags", "prefill-first with --max-num-batched-tokens below --prompt-len",
         lambda d: simulate(d, *SMALL, "--prompt-len", "5000", "--max-num-batched-tokens", "4000"),
         needle="--max-num-batched-tokens 4000: below the longest prompt, 5000 tokens (--prompt-len 5000); "
                "prefill-first"),
    Case("flags", "prefill-first with --max-num-batched-tokens below a trace's prompt",
         trace_case(PLAIN + "0,100,5\n1,3000,5\n", "--max-num-batched-tokens", "2048"),
         needle="--max-num-batched-tokens 2048: below the longest prompt, 3000 tokens (of trace trace.csv)"),
    Case("flags", "prefill-first with --max-num-batched-tokens below lognormal lengths",
         lambda d: simulate(d, *SMALL, "--length-dist", "lognormal", "--max-num-batched-tokens", "1024"),
         needle="which --max-prompt-len 8192 clips); prefill-first"),
    Case("flags", "chunked prefill with --max-num-batched-tokens below --prompt-len (accepted: chunks)",
         lambda d: simulate(d, *SMALL, "--prompt-len", "5000", "--max-num-batched-tokens", "4000", "--scheduler",
                            "chunked-prefill"), expect="ok"),
    Case("flags", "--seeds nan", lambda d: sweep(d, "--rates", "1", "--policies", "no-spec", "--seeds", "nan"),
         needle="--seeds"),
    Case("flags", "--seeds 0.5", lambda d: sweep(d, "--rates", "1", "--policies", "no-spec", "--seeds", "0.5"),
         needle="--seeds"),
    Case("flags", "--seeds -1", lambda d: sweep(d, "--rates", "1", "--policies", "no-spec", "--seeds", "-1"),
         needle="--seeds"),
    Case("flags", "--rates inf", lambda d: sweep(d, "--rates", "1,inf", "--policies", "no-spec"),
         needle="--rates: inf is not a point of a rate axis: for vLLM's --request-rate inf"),
    Case("flags", "tune --rates inf",
         lambda d: ["tune", "--policy", "goodput", "--slo", "p99_latency<=20", "--rates", "inf", "--out", str(d / "t")],
         needle="run simulate --request-rate inf --max-concurrency N"),
    Case("flags", "--rates nan", lambda d: sweep(d, "--rates", "nan", "--policies", "no-spec"), needle="--rates"),
    # -- --config JSON ----------------------------------------------------------------------------------------
    Case("--config JSON", '"save_steps": "no"', config_case({"save_steps": "no"}), needle="save_steps"),
    Case("--config JSON", '"k": true', config_case({"k": True}), needle="k must"),
    Case("--config JSON", '"output_len": 2.5', config_case({"output_len": 2.5}), needle="output_len"),
    Case("--config JSON", '"num_gpu_blocks": Infinity',
         config_case('{"rate": 4, "num_requests": 20, "num_gpu_blocks": Infinity}'), needle="num_gpu_blocks"),
    Case("--config JSON", '"rate": NaN', config_case('{"rate": NaN, "num_requests": 20}'), needle="rate"),
    Case("--config JSON", '"rate": "4"', config_case({"rate": "4"}), needle="rate"),
    Case("--config JSON", '"policy_params": 7', config_case({"policy_params": 7}), needle="policy_params"),
    Case("--config JSON", '"acceptance_positions": ["a"]',
         config_case({"acceptance": "position", "acceptance_positions": ["a"]}), needle="acceptance_positions"),
    Case("--config JSON", "top-level list", config_case("[1, 2]"), needle="JSON object"),
    Case("--config JSON", "by concern, as runs write it (accepted)", nested_config_case({}), expect="ok"),
    Case("--config JSON", "an unknown field in a concern", nested_config_case({"workload": {"bogus": 1}}),
         needle="config.json: unknown config field 'bogus' in workload"),
    Case("--config JSON", "a field in the wrong concern", nested_config_case({"workload": {"k": 3}}),
         needle="unknown config field 'k' in workload (it belongs to speculative)"),
    Case("--config JSON", "an unknown flat field", config_case({"bogus": 1}),
         needle="config.json: unknown config field 'bogus'"),
    Case("--config JSON", "truncated", config_case('{"rate": 4, "num_'), needle="config"),
    # -- profiles ------------------------------------------------------------------------------------------
    Case("profile", "zero KV bytes per token",
         lambda d: simulate(d, "--rate", "4", "--num-requests", "20",
                            prof=profile(d, memory={**COST["memory"], "target_kv_bytes_per_token": 0})),
         needle="KV bytes"),
    Case("profile", "all-zero coefficients",
         lambda d: simulate(d, *SMALL, prof=profile(
             d, target={"base": 0, "per_batched_token": 0, "per_context_token": 0},
             draft={"base": 0, "per_batched_token": 0, "per_context_token": 0},
             prefill={"base": 0, "per_prompt_token": 0}, overhead={"base": 0})), needle="0 s"),
    Case("profile", "1e308 coefficients",
         lambda d: simulate(d, *SMALL, prof=profile(d, target__base=1e308, target__per_batched_token=1e308)),
         needle="cost.json"),
    Case("profile", "a folder as the profile", lambda d: simulate(d, *SMALL, prof=str(d)), needle=str("cost model")),
    Case("profile", "CSV profile without metadata (labelled unknown)",
         lambda d: simulate(d, *SMALL, "--policy", "fixed-k", prof=_csv_profile(d)), expect="ok"),
    # -- user policy files ----------------------------------------------------------------------------------
    Case("policy file", "raises in propose", policy_case("def propose(self, view):\n    raise ValueError('boom')\n"),
         needle="my_policy.py: line"),
    Case("policy file", "raises in observe", policy_case(
        "def propose(self, view):\n    return np.full(view.batch_size, 2)\n"
        "def observe(self, outcome):\n    raise KeyError('x')\n"), needle="observe"),
    Case("policy file", "returns NaN k",
         policy_case("def propose(self, view):\n    return np.full(view.batch_size, np.nan)\n"), needle="integers"),
    Case("policy file", "returns text k",
         policy_case("def propose(self, view):\n    return np.full(view.batch_size, 'two')\n"), needle="integers"),
    Case("policy file", "returns float k",
         policy_case("def propose(self, view):\n    return np.full(view.batch_size, 1.5)\n"), needle="integers"),
    Case("policy file", "returns bool k",
         policy_case("def propose(self, view):\n    return np.ones(view.batch_size, dtype=bool)\n"), needle="integers"),
    Case("policy file", "returns a list",
         policy_case("def propose(self, view):\n    return [1] * view.batch_size\n"), needle="numpy"),
    Case("policy file", "calls sys.exit in propose",
         policy_case("def propose(self, view):\n    sys.exit(0)\n"), needle="sys.exit"),
    Case("policy file", "loops forever in propose",
         policy_case("def propose(self, view):\n    while True:\n        pass\n"), needle="did not return",
         env={"SPECSIM_POLICY_TIMEOUT": "1"}),
    Case("policy file", "replaces a built-in name",
         policy_case("def propose(self, view):\n    return np.zeros(view.batch_size, dtype=int)\n", name="fixed-k"),
         needle="built-in"),
    Case("policy file", "calls sys.exit at import",
         lambda d: simulate(d, *SMALL, "--policy-file", write(d, "p.py", "import sys\nsys.exit(3)\n"), "--policy",
                            "x"), needle="p.py"),
    # -- vLLM result JSON (compare RESULT.json: replay) --------------------------------------------------------
    Case("vLLM result", "an empty output (accepted: replayed as 1 token)", vllm_case(), expect="ok"),
    Case("vLLM result", "output length -1", vllm_case({"output_lens": [20, -1, 20]}), needle="output_lens[1]"),
    Case("vLLM result", "summary only (no --save-detailed)",
         vllm_case({"input_lens": None, "output_lens": None, "ttfts": None, "errors": None}),
         needle="input_lens: missing"),
    Case("vLLM result", "every request failed", vllm_case({"errors": ["HTTP 500"] * 3}), needle="every one"),
    Case("vLLM result", "request_rate 'fast'", vllm_case({"request_rate": "fast"}), needle="request_rate"),
    Case("vLLM result", "max_concurrency 0", vllm_case({"max_concurrency": 0}), needle="max_concurrency"),
    Case("vLLM result", "spec_decode_acceptance_rate 120", vllm_case({"spec_decode_acceptance_rate": 120}),
         needle="spec_decode_acceptance_rate"),
    Case("vLLM result", "a NaN figure", vllm_case({"mean_ttft_ms": float("nan")}), needle="mean_ttft_ms: NaN"),
    Case("vLLM result", "an infinite figure", vllm_case({"total_input_tokens": float("inf")}),
         needle="total_input_tokens: inf, not a finite figure"),
    Case("vLLM result", "no request streamed a token", vllm_case({"output_lens": [0, 0, 0], "ttfts": [0.0] * 3}),
         needle="output_lens: none of the 3 successful requests streamed a token"),
    Case("vLLM result", "calibrate: a NaN figure", calibrate_case({"median_tpot_ms": float("nan")}),
         needle="median_tpot_ms: NaN"),
    Case("vLLM result", "calibrate: no request streamed a token",
         calibrate_case({"output_lens": [0, 0, 0], "ttfts": [0.0] * 3}), needle="streamed a token"),
    Case("vLLM result", "calibrate: an unknown flag (one line, no usage)",
         lambda d: calibrate_case()(d) + ["--max-eval", "3"], needle="unrecognized arguments: --max-eval 3"),
    Case("vLLM result", "calibrate: a draft of another vocabulary than the target's",
         lambda d: calibrate_case()(d) + ["--draft", "llama-68m"],
         needle="--draft llama-68m: its vocabulary of 32000 tokens is not the target llama-3.1-8b's 128256"),
    Case("vLLM result", "two results appended (--append-result)",
         vllm_case(text=json.dumps(VLLM_RESULT) + "\n" + json.dumps(VLLM_RESULT)), needle="--append-result"),
    # -- sweep, tune, plot ----------------------------------------------------------------------------------
    Case("sweep/tune/plot", "--policies ','", lambda d: sweep(d, "--rates", "1", "--policies", ","),
         needle="--policies"),
    Case("sweep/tune/plot", "unknown policy in --policies",
         lambda d: sweep(d, "--rates", "1", "--policies", "no-spec,warp"), needle="warp"),
    Case("sweep/tune/plot", "--grid of an unknown field", lambda d: sweep(d, "--rates", "1", "--policies",
                                                                         "no-spec", "--grid", "speed=1,2"),
         needle="--grid"),
    Case("sweep/tune/plot", "--grid cv under poisson", lambda d: sweep(d, "--rates", "1", "--policies", "no-spec",
                                                                      "--grid", "cv=1,3"), needle="cv"),
    Case("sweep/tune/plot", "tune --slo bound inf",
         lambda d: ["tune", "--policy", "fixed-k", "--slo", "p99_latency<=1e999", "--rates", "1", "--out",
                    str(d / "t")], needle="--slo"),
    Case("sweep/tune/plot", "tune --param bonus=nan",
         lambda d: ["tune", "--profile", profile(d), "--num-requests", "10", "--num-gpu-blocks", "2000",
                    "--policy", "goodput", "--slo", "p99_latency<=20", "--rates", "1", "--param", "bonus=nan",
                    "--workers", "1", "--quiet", "--out", str(d / "t")], needle="bonus"),
    Case("sweep/tune/plot", "plot: empty summary.csv", plot_case(""), needle="summary.csv"),
    Case("sweep/tune/plot", "plot: 1-byte summary.csv", plot_case("\n"), needle="summary.csv"),
    Case("sweep/tune/plot", "plot: garbage summary.csv", plot_case(b"\x00\x01\x02garbage\xff"), needle="summary.csv"),
    Case("sweep/tune/plot", "plot: columns missing", plot_case("a,b\n1,2\n"), needle="missing column"),
    Case("sweep/tune/plot", "plot: text in a number column",
         plot_case(OK_SUMMARY.replace("0.01,0.02,1.0", "fast,0.02,1.0")), needle="mean_norm_latency"),
    Case("sweep/tune/plot", "plot: a valid summary (accepted)", plot_case(OK_SUMMARY), expect="ok"),
    # -- profile --report and validate (the profiles side; checked before any model is loaded) ----------------
    Case("profile --report / validate", "report: missing file", lambda d: ["profile", "--report", str(d / "no.csv")],
         needle="no.csv"),
    Case("profile --report / validate", "report: a JSON file", lambda d: ["profile", "--report", profile(d)],
         needle="cost.json"),
    Case("profile --report / validate", "report: binary garbage",
         lambda d: ["profile", "--report", write(d, "p.csv", b"role,phase\n\xff\x00")], needle="p.csv"),
    Case("profile --report / validate", "report: NaN seconds",
         lambda d: ["profile", "--report", write(d, "p.csv", PROFILE_HEADER + "target,decode,1,1,128,nan\n")],
         needle="seconds"),
    Case("profile --report / validate", "report: 1e308 seconds",
         lambda d: ["profile", "--report", write(d, "p.csv", PROFILE_HEADER + "target,decode,1,1,128,1e308\n"
                                                 "target,decode,2,1,128,1e308\n")], needle="seconds"),
    Case("profile --report / validate", "validate --policies ','",
         lambda d: ["validate", "--policies", ",", "--out", str(d / "v")], needle="--policies"),
    Case("profile --report / validate", "validate --rates nan",
         lambda d: ["validate", "--rates", "nan", "--out", str(d / "v")], needle="--rates"),
    Case("profile --report / validate", "validate --out ''", lambda d: ["validate", "--out", ""], needle="--out"),
    Case("profile --report / validate", "validate --out is a file",
         lambda d: ["validate", "--out", write(d, "afile", "x")], needle="not a folder"),
]


def _csv_profile(d: Path) -> str:
    rows = ["role,phase,batch_size,query_len,context_len,seconds"]
    for role, base in (("target", 0.01), ("draft", 0.001)):
        for b in (1, 2, 4, 8):
            for q in ((1, 2, 3, 4, 5) if role == "target" else (1,)):
                for c in (128, 512, 1024):
                    rows.append(f"{role},decode,{b},{q},{c},{base + 1e-4 * b * q + 1e-8 * b * c:.9f}")
        for b in (1, 2):
            for p in (128, 512):
                rows.append(f"{role},prefill,{b},{p},0,{base + 1e-5 * b * p:.9f}")
    return write(d, "noprofile_meta.csv", "\n".join(rows) + "\n")


# -- the report ------------------------------------------------------------------------------------------------
def run_case(case: Case, root: Path, timeout: float = 60.0) -> str:
    """How ``case`` ends as a real process of the checkout at ``root``."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        argv = case.build(d)
        env = {**os.environ, **case.env, "PYTHONPATH": str(root), "SPECSIM_CACHE_DIR": str(d / "cache")}
        try:
            done = subprocess.run([sys.executable, str(root / "run_sim.py"), *argv], capture_output=True, text=True,
                                  cwd=d, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"hang (killed after {timeout:g} s)"
        err = done.stderr.strip().splitlines()
        if "Traceback" in done.stderr:
            return f"traceback, exit {done.returncode} ({err[-1][:70] if err else ''})"
        if done.returncode == 0:
            return "exit 0" + (" (accepted, as documented)" if case.expect == "ok" else " - silently accepted")
        line = err[-1] if err else ""
        return f"exit {done.returncode}, {len(err)} line(s): {line[:110]}"


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1]).resolve()
    print("| family | case | ends |\n|---|---|---|")
    for case in CASES:
        timeout = 20.0 if "forever" in case.name else 60.0
        print(f"| {case.family} | {case.name} | {run_case(case, root, timeout).replace('|', '/')} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
