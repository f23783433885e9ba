"""vLLM's benchmark files: write a run as ``vllm bench serve --save-result`` JSON, read such a file back, replay its
workload and compare figures.

The schema follows vLLM's ``vllm/benchmarks/serve.py`` (``benchmark()``'s result dict, and the keys ``main`` adds
before it saves): ``date, backend, model_id, tokenizer_id, num_prompts, request_rate, burstiness, max_concurrency,
duration, completed, total_input_tokens, total_output_tokens, request_throughput, request_goodput,
output_throughput, total_token_throughput, input_lens, output_lens, ttfts, itls, generated_texts, errors`` and, per
metric of ``ttft, tpot, itl, e2el``, ``mean_<m>_ms, median_<m>_ms, std_<m>_ms, p99_<m>_ms`` (times in the lists are
seconds, the statistics milliseconds, as vLLM writes them). ``request_goodput`` is null without ``--goodput``.

What the simulator cannot know is marked: ``generated_texts`` are empty strings; ``itls`` holds, per request, its
chunk count of its *mean* chunk gap (the simulator keeps each request's decode time and chunk count, not each
chunk's time; :mod:`simulator.metrics`); ``backend`` is ``specsim``, and ``specsim`` holds the config and the summary.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from policies.errors import UserError

#: vLLM's per-metric statistics in the result file (milliseconds).
METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p99")
#: The per-request lists a vLLM result must hold to be replayed.
REPLAY_KEYS = ("input_lens", "output_lens")


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
    burstiness = 1.0 / config.cv ** 2 if config.arrival == "gamma" else 1.0
    out: dict[str, Any] = {
        "date": datetime.datetime(2000, 1, 1).strftime("%Y%m%d-%H%M%S"),  # fixed: results are bit-for-bit repeatable
        "backend": "specsim",
        "model_id": str(summary.get("profile", "")),
        "tokenizer_id": config.tokenizer,
        "num_prompts": int(summary["requests"]),
        "request_rate": config.rate if config.rate is not None else "inf",
        "burstiness": burstiness,
        "max_concurrency": config.max_num_seqs,
        "duration": summary["simulated_seconds"],
        "completed": int(len(served)),
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
    out["specsim"] = {"note": "simulated by specsim; itls repeat each request's mean chunk gap; no texts",
                      "config": config.to_dict(), "saturated": summary.get("saturated"),
                      "acceptance_rate": summary.get("acceptance_rate")}
    return {k: _finite(v) for k, v in out.items()}


def read_vllm_result(path: str | Path) -> dict[str, Any]:
    """A ``vllm bench serve --save-result`` JSON file, checked: a JSON object with the per-request ``input_lens`` and
    ``output_lens`` (whole numbers >= 1, as many of each) and, when present, ``ttfts`` and ``itls`` aligned with them.
    Bad input: one UserError line naming the file and the key."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a vLLM benchmark result JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a vLLM benchmark result (a JSON object, as vllm bench serve --save-result writes)")
    for key in REPLAY_KEYS:
        values = data.get(key)
        if not isinstance(values, list) or not values:
            raise UserError(f"{path}: {key}: missing or empty (vllm bench serve --save-result writes it)")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"{path}: {key}[{i}]: must be a whole number of tokens >= 1, got {v!r}")
    n = len(data["input_lens"])
    if len(data["output_lens"]) != n:
        raise UserError(f"{path}: output_lens has {len(data['output_lens'])} entries, input_lens {n}")
    for key in ("ttfts", "itls"):
        if key in data and data[key] is not None and len(data[key]) != n:
            raise UserError(f"{path}: {key} has {len(data[key])} entries, input_lens {n}")
    rate = data.get("request_rate", "inf")
    if isinstance(rate, str):
        if rate.strip().lower() != "inf":
            raise UserError(f"{path}: request_rate: a number or \"inf\", got {rate!r}")
        rate = math.inf
    elif isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise UserError(f"{path}: request_rate: a number > 0 or \"inf\", got {rate!r}")
    burstiness = data.get("burstiness", 1.0)
    if isinstance(burstiness, bool) or not isinstance(burstiness, (int, float)) or not burstiness > 0:
        raise UserError(f"{path}: burstiness: a number > 0, got {burstiness!r}")
    data["request_rate"], data["burstiness"] = float(rate), float(burstiness)
    return data


def replay_trace(data: dict[str, Any], seed: int) -> "Any":
    """The workload of a vLLM result as a plain trace frame (``arrival_time,prompt_tokens,output_tokens``): the
    recorded lengths in order, arrivals drawn as vLLM draws them: Gamma gaps of shape ``burstiness`` and mean
    1/request_rate (Poisson at burstiness 1); all at time 0 for ``request_rate inf``. vLLM does not save the
    arrival times, so they are a fresh draw of the same process (``seed``)."""
    import pandas as pd

    n = len(data["input_lens"])
    rate, shape = data["request_rate"], data["burstiness"]
    if math.isinf(rate):
        times = np.zeros(n)
    else:
        gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), n)
        times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return pd.DataFrame({"arrival_time": times, "prompt_tokens": data["input_lens"],
                         "output_tokens": data["output_lens"]})


def vllm_figures(data: dict[str, Any]) -> dict[str, float]:
    """The figures of a vLLM result comparable with a summary: its own statistics where it saved them, else computed
    from its per-request lists (ms), and the throughputs."""
    out: dict[str, float] = {}
    for m in METRICS:
        for s in STATS:
            v = data.get(f"{s}_{m}_ms")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{s}_{m}_ms"] = float(v)
    lists = {"ttft": data.get("ttfts"), "e2el": data.get("latencies")}
    if isinstance(data.get("itls"), list):
        lists["itl"] = [g for row in data["itls"] if isinstance(row, list) for g in row]
    for m, values in lists.items():
        if not values or f"mean_{m}_ms" in out:
            continue
        arr = np.array([v for v in values if isinstance(v, (int, float))], dtype=float)
        if arr.size:
            out.update({f"mean_{m}_ms": float(arr.mean() * 1e3), f"median_{m}_ms": float(np.median(arr) * 1e3),
                        f"std_{m}_ms": float(arr.std() * 1e3), f"p99_{m}_ms": float(np.percentile(arr, 99) * 1e3)})
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput", "duration"):
        v = data.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


#: The figures ``compare`` puts side by side (summary name; the vLLM result's name is the same).
COMPARE_FIGURES = ([f"{s}_{m}_ms" for m in METRICS for s in STATS]
                   + ["request_throughput", "output_throughput", "request_goodput"])


def summary_figures(summary: dict[str, Any]) -> dict[str, float]:
    """The comparable figures of a specsim summary (``duration`` is its simulated seconds)."""
    out = {k: float(summary[k]) for k in COMPARE_FIGURES if isinstance(summary.get(k), (int, float))
           and not isinstance(summary.get(k), bool)}
    if "simulated_seconds" in summary:
        out["duration"] = float(summary["simulated_seconds"])
    return out


def side_by_side(a: dict[str, float], b: dict[str, float], names: tuple[str, str]) -> "Any":
    """One row per figure both have: ``a``, ``b`` and b / a - 1 (relative difference)."""
    import pandas as pd

    rows = []
    for key in [*COMPARE_FIGURES, "duration"]:
        if key in a and key in b and math.isfinite(a[key]) and math.isfinite(b[key]):
            diff = b[key] / a[key] - 1 if a[key] else float("nan")
            rows.append({"figure": key, names[0]: a[key], names[1]: b[key], "relative difference": diff})
    return pd.DataFrame(rows, columns=["figure", *names, "relative difference"])
