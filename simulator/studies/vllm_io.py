"""vLLM's benchmark files: write a run as ``vllm bench serve --save-result`` JSON, read such a file back, replay its
workload and compare figures.

The schema follows vLLM's ``vllm/benchmarks/serve.py`` (``benchmark()``'s result dict, and the keys ``main`` adds
before it saves): ``date, backend, model_id, tokenizer_id, num_prompts, request_rate, burstiness, max_concurrency,
duration, completed, failed, total_input_tokens, total_output_tokens, request_throughput, request_goodput,
output_throughput, total_token_throughput, input_lens, output_lens, ttfts, itls, latencies, start_times, queue_times,
generated_texts, errors`` and, per metric of ``ttft, tpot, itl, e2el``, ``mean_<m>_ms, median_<m>_ms, std_<m>_ms,
p99_<m>_ms`` (times in the lists are seconds, the statistics milliseconds, as vLLM writes them). ``request_goodput``
is null without ``--goodput``.

What the simulator cannot know is marked: ``generated_texts`` are empty strings; ``itls`` holds, per request, its
chunk count of its *mean* chunk gap (the simulator keeps each request's decode time and chunk count, not each
chunk's time; :mod:`simulator.metrics`); ``backend`` is ``specsim``, and ``specsim`` holds the config and the summary.

The files read (:func:`read_vllm_result`) are those of every vLLM version seen in its sources
(``benchmarks/benchmark_serving.py`` of vLLM 0.4 to 0.8, then ``vllm/benchmarks/serve.py``):

- per-request lists over *every* request sent, failed ones included (``output_lens`` 0, ``ttfts`` 0.0, ``itls`` [])
  with ``errors`` saying which failed (one string per request, ``""`` for a success); or lists of the successful
  requests only (as many entries as ``completed``) beside a ``failed`` count. Failed requests are left out of the
  replay and of the figures, and counted (``failed``);
- completed requests whose stream carried no text: ``output_lens`` 0 and ``ttfts`` 0.0; vLLM counts them as completed
  and its TTFT statistics include those zeros (:func:`replay_trace`, :func:`vllm_style_figures`). A file in which no
  successful request streamed a token is refused: it measured no TTFT, TPOT or ITL, and figures made from it would
  be made from nothing;
- summary-only files (``vllm bench serve --save-result`` without ``--save-detailed`` drops the per-request lists):
  their figures can be compared, their workload not replayed;
- ``request_rate`` as the string ``"inf"``, a number or ``Infinity``; ``burstiness`` (absent before vLLM 0.6.4:
  Poisson) and ``Infinity`` (evenly spaced); ``max_concurrency`` null or a whole number >= 1; ``start_times`` and
  ``queue_times`` (seconds, newer versions): the recorded arrivals, replayed as they were;
- the speculative-decoding figures newer versions read from the server's metrics (:data:`SPEC_DECODE_FIGURES`,
  ``spec_decode_per_position_acceptance_rates``);
- old names: ``<stat>_latency_ms`` for ``<stat>_e2el_ms`` (files of vLLM 0.6 such as LambdaLabsML/vllm-benchmark's),
  ``request_goodput:`` (vLLM 0.8's misspelt key) for ``request_goodput``.

Every number of the file is finite but ``request_rate`` and ``burstiness`` (whose ``inf`` means something): a NaN or
infinite figure is refused naming its key (vLLM computes a statistic of no values as ``np.mean(x or 0)``, so it writes
0 there, never NaN: a NaN is a damaged file or another tool's, and a figure read as missing would be replaced by one
computed from nothing).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policies.errors import UserError
from simulator.config import rate_from_json, rate_to_json

#: vLLM's per-metric statistics in the result file (milliseconds).
METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p99")
#: The per-request lists a vLLM result must hold to be replayed.
REPLAY_KEYS = ("input_lens", "output_lens")
#: Per-request lists, one entry per request (aligned with each other): what each entry must be.
PER_REQUEST_KEYS = {"input_lens": "a whole number of tokens >= 1", "output_lens": "a whole number of tokens >= 0",
                    "ttfts": "a number of seconds >= 0", "latencies": "a number of seconds >= 0",
                    "start_times": "a number of seconds", "queue_times": "a number of seconds >= 0",
                    "itls": "a list of numbers of seconds >= 0", "errors": "text (\"\" for a success)",
                    "generated_texts": "text"}
#: The speculative-decoding figures of newer vLLM versions (vllm/benchmarks/serve.py, from the server's
#: ``vllm:spec_decode_*`` counters over the run) -> what each must be. The acceptance rate is in percent (accepted /
#: draft tokens x 100); the acceptance length counts the bonus token (1 + accepted tokens / drafts).
SPEC_DECODE_FIGURES = {"spec_decode_acceptance_rate": "a percentage in [0, 100]",
                       "spec_decode_acceptance_length": "a number >= 1 (or 0: no drafts)",
                       "spec_decode_num_drafts": "a whole number >= 0",
                       "spec_decode_draft_tokens": "a whole number >= 0",
                       "spec_decode_accepted_tokens": "a whole number >= 0"}
#: vLLM's list of per-position acceptance rates (fractions: accepted at draft position i / drafts); a figure each,
#: named :data:`PER_POSITION_FIGURE` with the position.
PER_POSITION_KEY = "spec_decode_per_position_acceptance_rates"
PER_POSITION_FIGURE = "spec_decode_per_position_acceptance_rate_{}"
#: Throughputs (per second) and the run's length (seconds) a result may hold.
RATE_FIGURES = ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput", "duration")
#: Old key names -> today's (module docstring).
OLD_NAMES = {"request_goodput:": "request_goodput",
             **{f"{s}_latency_ms": f"{s}_e2el_ms" for s in STATS}}


def _finite(value: Any) -> Any:
    """JSON has no NaN: vLLM writes numbers; a figure the run has not (NaN) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def vllm_result(summary: dict[str, Any], requests: Any, config: Any) -> dict[str, Any]:
    """The ``vllm bench serve --save-result`` dict of a simulated run (``requests``: its per-request DataFrame)."""
    import datetime

    served = requests[~requests["ignored"].astype(bool)] if "ignored" in requests else requests
    chunks = served["chunks"].to_numpy() if "chunks" in served else np.zeros(len(served), dtype=np.int64)
    itl = served["itl"].to_numpy() if "itl" in served else np.full(len(served), np.nan)
    itls = [[float(g)] * int(c) if c > 0 and math.isfinite(g) else [] for g, c in zip(itl, chunks)]
    burstiness = 1.0 / config.workload.cv ** 2 if config.workload.arrival == "gamma" else 1.0
    out: dict[str, Any] = {
        "date": datetime.datetime(2000, 1, 1).strftime("%Y%m%d-%H%M%S"),  # fixed: results are bit-for-bit repeatable
        "backend": "specsim",
        "model_id": str(summary.get("profile", "")),
        "tokenizer_id": config.workload.tokenizer,
        "num_prompts": int(summary["requests"]),
        "request_rate": "inf" if config.workload.rate is None else rate_to_json(config.workload.rate),
        "burstiness": burstiness,
        "max_concurrency": config.workload.max_concurrency,
        "duration": summary["simulated_seconds"],
        "completed": int(len(served)),
        "failed": 0,
        "total_input_tokens": int(served["prompt_tokens"].sum()),
        "total_output_tokens": int(served["output_tokens"].sum()),
        "request_throughput": summary["request_throughput"],
        "request_goodput": summary.get("request_goodput"),
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
        "input_lens": served["prompt_tokens"].astype(int).tolist(),
        "output_lens": served["output_tokens"].astype(int).tolist(),
        "ttfts": served["ttft"].astype(float).tolist(),
        "itls": itls,
        "latencies": served["latency"].astype(float).tolist(),
        "generated_texts": [""] * len(served),
        "errors": [""] * len(served),
    }
    for m in METRICS:
        for s in STATS:
            out[f"{s}_{m}_ms"] = summary.get(f"{s}_{m}_ms")
    if summary.get("proposed_tokens"):
        out.update({"spec_decode_acceptance_rate": summary["acceptance_rate"] * 100,
                    "spec_decode_acceptance_length": summary.get("mean_acceptance_length"),
                    "spec_decode_draft_tokens": int(summary["proposed_tokens"]),
                    "spec_decode_accepted_tokens": int(summary["accepted_tokens"])})
    out["specsim"] = {"note": "simulated by specsim; itls repeat each request's mean chunk gap; no texts",
                      "config": config.to_dict(), "saturated": summary.get("saturated"),
                      "acceptance_rate": summary.get("acceptance_rate")}
    return {k: _finite(v) for k, v in out.items()}


# --- reading --------------------------------------------------------------------------------------------------

def read_vllm_result(path: str | Path, *, replay: bool = False) -> dict[str, Any]:
    """A ``vllm bench serve --save-result`` (or ``benchmark_serving.py --save-result``) JSON file, checked, every shape
    of the module docstring. Returned as read, with old key names renamed and these normalised: ``request_rate`` and
    ``burstiness`` floats (``inf`` allowed), ``max_concurrency`` an int or None, ``failed`` the number of failed
    requests (0 when the file says nothing of failures). A NaN or infinite figure, or a file in which no successful
    request streamed a token, is refused (module docstring).

    ``replay``: the workload must be replayable (:func:`replay_trace`): per-request ``input_lens`` and ``output_lens``
    present, at least one successful request, no ramp-up without recorded ``start_times``.
    Bad input: one UserError line naming the file and the key."""
    path = Path(path)
    data = _load_json(path)
    for old, new in OLD_NAMES.items():
        if old in data and new not in data:
            data[new] = data.pop(old)
    _check_traffic(path, data)
    _check_finite(path, data)
    _check_figures(path, data)
    _check_per_request(path, data)
    _check_streamed(path, data)
    if replay:
        _check_replayable(str(path), data)
    return data


def _load_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a vLLM benchmark result JSON ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            raise UserError(f"{path}: line {exc.lineno}: a second JSON object; vllm bench serve --append-result "
                            "appends one result a line: give one result a file") from None
        raise UserError(f"{path}: not a vLLM benchmark result JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a vLLM benchmark result (a JSON object, as vllm bench serve --save-result "
                        "writes)")
    return data


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_traffic(path: Path, data: dict[str, Any]) -> None:
    """``request_rate`` (req/s), ``burstiness``, ``max_concurrency``, ``completed`` and ``failed``, normalised."""
    rate = rate_from_json(data.get("request_rate", "inf"))
    if isinstance(rate, str):
        raise UserError(f"{path}: request_rate: a number or \"inf\", got {rate!r}")
    if not _is_number(rate) or not rate > 0:
        raise UserError(f"{path}: request_rate: a number > 0 or \"inf\", got {rate!r}")
    burstiness = data.get("burstiness", 1.0)
    if not _is_number(burstiness) or not burstiness > 0:
        raise UserError(f"{path}: burstiness: a number > 0, got {burstiness!r}")
    concurrency = data.get("max_concurrency")
    if concurrency is not None and not _is_whole(concurrency, 1):
        raise UserError(f"{path}: max_concurrency: null or a whole number >= 1, got {concurrency!r}")
    for key in ("completed", "failed"):
        if key in data and not _is_whole(data[key], 0):
            raise UserError(f"{path}: {key}: a whole number of requests >= 0, got {data[key]!r}")
    data["request_rate"], data["burstiness"], data["max_concurrency"] = float(rate), float(burstiness), concurrency


#: Top-level numbers whose ``inf`` means something (:func:`_check_traffic` reads them).
INFINITE_ALLOWED = ("request_rate", "burstiness")


def _check_finite(path: Path, data: dict[str, Any]) -> None:
    """Every top-level number but :data:`INFINITE_ALLOWED` is finite (module docstring)."""
    for key, value in data.items():
        if key in INFINITE_ALLOWED or not _is_number(value) or math.isfinite(value):
            continue
        if math.isnan(value):
            raise UserError(f"{path}: {key}: NaN, a figure of no values (vllm bench serve writes 0 for a statistic "
                            "over no requests): a damaged file or another tool's; nothing to compare")
        raise UserError(f"{path}: {key}: {value!r}, not a finite figure")


def _check_figures(path: Path, data: dict[str, Any]) -> None:
    """The figures this module compares: finite numbers >= 0 or null; the speculative-decoding ones as
    :data:`SPEC_DECODE_FIGURES` says."""
    ms = [key for key in data if re.fullmatch(r"(mean|median|std|p\d+(\.\d+)?)_(ttft|tpot|itl|e2el)_ms", key)]
    for key in [*ms, *RATE_FIGURES]:
        value = data.get(key)
        if value is not None and not (_is_number(value) and 0 <= value < math.inf):
            raise UserError(f"{path}: {key}: a finite number >= 0 or null, got {value!r}")
    for key, what in SPEC_DECODE_FIGURES.items():
        if key not in data:
            continue
        value = data[key]
        if key == "spec_decode_acceptance_rate":
            ok = _is_number(value) and 0 <= value <= 100
        elif key == "spec_decode_acceptance_length":
            ok = _is_number(value) and (value == 0 or 1 <= value < math.inf)
        else:
            ok = _is_whole(value, 0)
        if not ok:
            raise UserError(f"{path}: {key}: {what}, got {value!r}")
    accepted, drafted = data.get("spec_decode_accepted_tokens", 0), data.get("spec_decode_draft_tokens", math.inf)
    if accepted > drafted:
        raise UserError(f"{path}: spec_decode_accepted_tokens: more than spec_decode_draft_tokens "
                        f"({accepted} > {drafted})")
    rates = data.get(PER_POSITION_KEY)
    if rates is not None:
        if not isinstance(rates, list):
            raise UserError(f"{path}: {PER_POSITION_KEY}: a list of fractions in [0, 1], got {rates!r}")
        for i, value in enumerate(rates):
            if not (_is_number(value) and 0 <= value <= 1):
                raise UserError(f"{path}: {PER_POSITION_KEY}[{i}]: a fraction in [0, 1], got {value!r}")


def _per_request_entry_ok(key: str, value: Any) -> bool:
    if key in ("input_lens", "output_lens"):
        return _is_whole(value, 1 if key == "input_lens" else 0)
    if key in ("errors", "generated_texts"):
        return isinstance(value, str)
    if key == "itls":
        return isinstance(value, list) and all(_is_number(g) and 0 <= g < math.inf for g in value)
    if key == "start_times":
        return _is_number(value) and math.isfinite(value)
    return _is_number(value) and 0 <= value < math.inf


def _check_per_request(path: Path, data: dict[str, Any]) -> None:
    """The per-request lists present: lists, aligned, each entry as :data:`PER_REQUEST_KEYS` says; ``failed`` set to
    the number of failed requests (the non-empty ``errors``, else the file's ``failed``, else 0)."""
    present = [key for key in PER_REQUEST_KEYS if data.get(key) is not None]
    if ("input_lens" in present) != ("output_lens" in present):
        missing = "output_lens" if "input_lens" in present else "input_lens"
        raise UserError(f"{path}: {missing}: missing, and the other per-request lengths are there")
    for key in present:
        values, first = data[key], present[0]
        if not isinstance(values, list):
            raise UserError(f"{path}: {key}: a list with one entry per request, got {type(values).__name__}")
        if len(values) != len(data[first]):
            raise UserError(f"{path}: {key} has {len(values)} entries, {first} {len(data[first])}")
        for i, value in enumerate(values):
            if not _per_request_entry_ok(key, value):
                raise UserError(f"{path}: {key}[{i}]: must be {PER_REQUEST_KEYS[key]}, got {value!r}")
    data["failed"] = sum(1 for e in data["errors"] if e) if "errors" in present else data.get("failed", 0)


def _check_streamed(path: Path, data: dict[str, Any]) -> None:
    """Some successful request streamed a token: per request (``output_lens`` of the successful requests), else by
    the file's ``total_output_tokens`` beside ``completed`` requests (module docstring)."""
    lens = data.get("output_lens")
    if lens:
        ok = succeeded(data, len(lens))
        served = [n for n, keep in zip(lens, ok if ok is not None else [True] * len(lens)) if keep]
        if served and not any(served):
            raise UserError(f"{path}: output_lens: none of the {len(served)} successful requests streamed a token "
                            "(every output_lens is 0): the run measured no TTFT, TPOT or ITL to compare")
    elif data.get("total_output_tokens") == 0 and data.get("completed"):
        raise UserError(f"{path}: total_output_tokens: 0 over {data['completed']} completed requests: none streamed a "
                        "token, and the run measured no TTFT, TPOT or ITL to compare")


def _check_replayable(where: str, data: Mapping[str, Any]) -> None:
    """What :func:`replay_trace` needs; else one UserError line (``where``: the file, for the message)."""
    for key in REPLAY_KEYS:
        if not data.get(key):
            raise UserError(f"{where}: {key}: missing or empty; a summary-only result (vllm bench serve --save-result "
                            "without --save-detailed) has no per-request lengths to replay")
    n = len(data["input_lens"])
    ok = succeeded(data, n)
    if ok is None:
        raise UserError(f"{where}: input_lens has {n} entries but completed is {data['completed']}, and no errors "
                        "list says which requests failed")
    if not ok.any():
        raise UserError(f"{where}: errors: every one of the {n} requests failed, nothing to replay")
    if data.get("ramp_up_strategy") is not None and not has_recorded_arrivals(data):
        raise UserError(f"{where}: ramp_up_strategy: {data['ramp_up_strategy']!r}: a ramp-up run's arrivals cannot be "
                        "redrawn from request_rate, and the file has no start_times (vLLM's --save-detailed)")


def succeeded(data: Mapping[str, Any], n: int) -> np.ndarray | None:
    """Which requests of a checked result's per-request lists (``n`` entries each) succeeded, a bool array: those
    whose ``errors`` entry is empty; without ``errors``, every one when the lists hold the ``completed`` requests
    only, and None (the file does not say) when they hold more: failed ones too."""
    errors = data.get("errors")
    if errors is not None:
        return np.array([not e for e in errors], dtype=bool)
    return np.ones(n, dtype=bool) if data.get("completed", n) == n else None


def has_recorded_arrivals(data: Mapping[str, Any]) -> bool:
    """Whether the result recorded when each request arrived (``start_times``, newer vLLM's ``--save-detailed``)."""
    return data.get("start_times") is not None


# --- replay -----------------------------------------------------------------------------------------------------

def replay_trace(data: Mapping[str, Any], seed: int) -> "Any":
    """The workload of a checked vLLM result as a trace frame, one row per *successful* request in arrival order:
    ``arrival_time`` (seconds from the first), ``prompt_tokens``, ``output_tokens`` and ``empty_output`` (bool).

    A request vLLM counted as completed with ``output_lens`` 0 (its stream carried no text) replays as 1 output token
    with ``empty_output`` True: the server ran its prefill and emitted one token that carried no text; count its
    figures as vLLM does with :func:`vllm_style_figures`. Failed requests are left out.

    Arrivals: ``start_times`` minus ``queue_times`` (the client's wait for a ``max_concurrency`` slot) when recorded;
    otherwise drawn as vLLM draws them: Gamma gaps of shape ``burstiness`` and mean 1/request_rate (Poisson at
    burstiness 1, evenly spaced at burstiness inf), all at time 0 for ``request_rate inf``: a fresh draw (``seed``)
    of the same process, for every request sent, failed ones included."""
    import pandas as pd

    _check_replayable("vLLM result", data)
    n = len(data["input_lens"])
    if has_recorded_arrivals(data):
        times = np.asarray(data["start_times"], dtype=float)
        if data.get("queue_times") is not None:
            times = times - np.asarray(data["queue_times"], dtype=float)
    else:
        times = _drawn_arrivals(n, data["request_rate"], data["burstiness"], seed)
    ok = succeeded(data, n)
    output = np.asarray(data["output_lens"], dtype=np.int64)[ok]
    frame = pd.DataFrame({"arrival_time": times[ok] - times[ok].min(),
                          "prompt_tokens": np.asarray(data["input_lens"], dtype=np.int64)[ok],
                          "output_tokens": np.maximum(output, 1), "empty_output": output == 0})
    return frame.sort_values("arrival_time", kind="stable", ignore_index=True)


def _drawn_arrivals(n: int, rate: float, shape: float, seed: int) -> np.ndarray:
    """``n`` arrival times (s) from 0: Gamma gaps of shape ``shape`` and mean 1/``rate`` (vLLM's ``get_request``)."""
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(shape):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def describe_replay(data: Mapping[str, Any], trace: Any) -> str:
    """How a checked result's workload was replayed, for one line: arrivals, concurrency, left-out and empty requests
    (``trace``: :func:`replay_trace`'s frame)."""
    if has_recorded_arrivals(data):
        parts = ["arrivals as recorded (start_times)"]
    elif math.isinf(data["request_rate"]):
        parts = ["request rate inf: all sent at 0 s"]
    else:
        parts = [f"request rate {data['request_rate']:g} req/s, burstiness {data['burstiness']:g}: arrivals drawn, "
                 "vLLM saved none"]
    if data["max_concurrency"] is not None:
        parts.append(f"max concurrency {data['max_concurrency']}")
    if data["failed"]:
        parts.append(f"failed requests left out: {data['failed']}")
    empty = int(trace["empty_output"].sum())
    if empty:
        parts.append(f"empty outputs (replayed as 1 token, counted as vLLM counts them): {empty}")
    return "; ".join(parts)


def vllm_style_figures(requests: Any, empty_output: Any, goodput_slo: Mapping[str, float] | None = None,
                       acceptance_length: float = float("nan")) -> dict[str, float]:
    """The comparable figures (:func:`summary_figures`) of a replayed run's per-request frame, counted as vLLM's
    ``calculate_metrics`` (vllm/benchmarks/serve.py) counts a completed request that streamed no text: TTFT 0 (its
    first-token time is never set) and output length 0 in every statistic and throughput, its latency as measured;
    it has no TPOT either way (replayed as 1 token; vLLM takes TPOT over outputs longer than 1 token only).
    ``empty_output``: per row of the replayed trace (:func:`replay_trace`), indexed by the frame's ``request_id``;
    ``goodput_slo`` (metric -> ms) and ``acceptance_length`` as :func:`simulator.metrics.summarize` takes them."""
    from simulator.metrics import summarize

    columns = {name: requests[name].to_numpy() for name in requests.columns}
    empty = np.asarray(empty_output, dtype=bool)[columns["request_id"].astype(np.int64)]
    columns["ttft"] = np.where(empty, 0.0, columns["ttft"])
    columns["output_tokens"] = np.where(empty, 0, columns["output_tokens"])
    return summary_figures(summarize(columns, acceptance_length, goodput_slo))


# --- figures ----------------------------------------------------------------------------------------------------

def vllm_figures(data: dict[str, Any]) -> dict[str, float]:
    """The figures of a checked vLLM result comparable with a summary: its own statistics where it saved them, else
    computed from its successful requests' lists (ms); the throughputs (per second), ``duration`` (s) and the
    speculative-decoding figures (:data:`SPEC_DECODE_FIGURES`, one per position of ``PER_POSITION_KEY``)."""
    out: dict[str, float] = {}
    for m in METRICS:
        for s in STATS:
            v = data.get(f"{s}_{m}_ms")
            if _is_number(v):
                out[f"{s}_{m}_ms"] = float(v)
    lists = {m: data.get(key) for m, key in (("ttft", "ttfts"), ("e2el", "latencies"), ("itl", "itls"))}
    for m, values in lists.items():
        if not values or f"mean_{m}_ms" in out:
            continue
        ok = succeeded(data, len(values))
        if ok is None:
            continue
        kept = [v for v, keep in zip(values, ok) if keep]
        arr = np.array([g for row in kept for g in row] if m == "itl" else kept, dtype=float)
        if arr.size:
            out.update({f"mean_{m}_ms": float(arr.mean() * 1e3), f"median_{m}_ms": float(np.median(arr) * 1e3),
                        f"std_{m}_ms": float(arr.std() * 1e3), f"p99_{m}_ms": float(np.percentile(arr, 99) * 1e3)})
    for key in (*RATE_FIGURES, *SPEC_DECODE_FIGURES):
        if _is_number(data.get(key)):
            out[key] = float(data[key])
    for i, rate in enumerate(data.get(PER_POSITION_KEY) or []):
        out[PER_POSITION_FIGURE.format(i)] = float(rate)
    return out


#: The figures ``compare`` puts side by side (summary name; the vLLM result's name is the same).
COMPARE_FIGURES = ([f"{s}_{m}_ms" for m in METRICS for s in STATS]
                   + ["request_throughput", "output_throughput", "request_goodput", *SPEC_DECODE_FIGURES])


def summary_figures(summary: dict[str, Any]) -> dict[str, float]:
    """The comparable figures of a specsim summary (``duration`` is its simulated seconds; a run that speculated
    adds vLLM's speculative-decoding figures: acceptance rate in percent, acceptance length, draft and accepted
    tokens)."""
    out = {k: float(summary[k]) for k in COMPARE_FIGURES if _is_number(summary.get(k))}
    if "simulated_seconds" in summary:
        out["duration"] = float(summary["simulated_seconds"])
    if summary.get("proposed_tokens"):
        out.update({"spec_decode_acceptance_rate": float(summary["acceptance_rate"]) * 100,
                    "spec_decode_acceptance_length": float(summary["mean_acceptance_length"]),
                    "spec_decode_draft_tokens": float(summary["proposed_tokens"]),
                    "spec_decode_accepted_tokens": float(summary["accepted_tokens"])})
    return out


def side_by_side(a: dict[str, float], b: dict[str, float], names: tuple[str, str]) -> "Any":
    """One row per figure both have: ``a``, ``b`` and b / a - 1 (relative difference); :data:`COMPARE_FIGURES` and
    ``duration`` first, then the others of ``a`` in its order (per-position acceptance rates)."""
    import pandas as pd

    fixed = [*COMPARE_FIGURES, "duration"]
    rows = []
    for key in [*fixed, *(k for k in a if k not in fixed)]:
        if key in a and key in b and math.isfinite(a[key]) and math.isfinite(b[key]):
            diff = b[key] / a[key] - 1 if a[key] else float("nan")
            rows.append({"figure": key, names[0]: a[key], names[1]: b[key], "relative difference": diff})
    return pd.DataFrame(rows, columns=["figure", *names, "relative difference"])
