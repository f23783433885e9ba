"""Per-request and per-step records, and the summary figures.

Per-request columns (the same from the simulator and the real engine, DESIGN.md):
``request_id, arrival_time, first_token_time, finish_time, prompt_tokens, output_tokens,
proposed_tokens, accepted_tokens, preemptions`` and derived ``ttft`` (first_token_time - arrival_time, s),
``tpot`` ((finish_time - first_token_time) / (output_tokens - 1), s per token; NaN for one-token outputs),
``latency`` (finish_time - arrival_time, s) and ``norm_latency`` (latency / output_tokens, s per token).

Conventions: ``accepted_tokens`` counts the accepted draft tokens the request actually emitted (a step that
accepts more than the request still needs emits only what it needs: the rest is not counted), so
accepted_tokens <= output_tokens - 1. Acceptance rate = accepted / proposed draft tokens; mean acceptance
length = emitted tokens per request-step that proposed at least one token, *including the bonus token*
(vLLM's convention).

Ignored requests (``ignored`` column True): requests that can never fit in the KV cache, not served (vLLM's
FINISHED_IGNORED); their times are NaN, they count in ``requests`` and ``ignored_requests`` but in no latency,
throughput or token figure.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

REQUEST_COLUMNS = ["request_id", "arrival_time", "first_token_time", "finish_time", "prompt_tokens",
                   "output_tokens", "proposed_tokens", "accepted_tokens", "preemptions", "ignored"]
DERIVED_COLUMNS = ["ttft", "tpot", "latency", "norm_latency"]
#: What a run (:func:`simulator.core.runner.run_simulation`) adds to :func:`summarize`'s figures in its summary.
SUMMARY_KEYS = ("ignored_requests", "ignored_request_ids", "policy", "k", "profile", "profile_method",
                "num_gpu_blocks", "steps", "workload", "config_hash", "wall_seconds")
STEP_COLUMNS = ["start_time", "seconds", "kind", "batch_size", "prefill_tokens", "k_max", "proposed",
                "accepted", "emitted", "kv_blocks_used", "num_waiting"]


class Recorder:
    """Collects what the engine reports; cheap enough to call every step."""

    def __init__(self, arrival_time: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
                 save_steps: bool) -> None:
        n = len(arrival_time)
        self.arrival_time = arrival_time
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.first_token_time = np.full(n, np.nan)
        self.finish_time = np.full(n, np.nan)
        self.proposed = np.zeros(n, dtype=np.int64)
        self.accepted = np.zeros(n, dtype=np.int64)
        self.spec_steps = np.zeros(n, dtype=np.int64)
        self.spec_emitted = np.zeros(n, dtype=np.int64)
        self.ignored = np.zeros(n, dtype=bool)
        self.preemptions = np.zeros(n, dtype=np.int64)
        self.finished = 0
        self.num_steps = 0
        self.steps: list[tuple] | None = [] if save_steps else None

    def first_token(self, rid: int, t: float) -> None:
        if math.isnan(self.first_token_time[rid]):
            self.first_token_time[rid] = t

    def finish(self, rid: int, t: float) -> None:
        if not math.isnan(self.finish_time[rid]):
            raise RuntimeError(f"request {rid} finished twice")
        self.finish_time[rid] = t
        self.finished += 1

    def preempt(self, rid: int, t: float) -> None:
        self.preemptions[rid] += 1

    def ignore(self, rids: np.ndarray) -> None:
        """Requests that can never fit in the KV cache and are not served."""
        self.ignored[rids] = True

    def decode(self, rid: np.ndarray, proposed: np.ndarray, accepted: np.ndarray, emitted: np.ndarray,
               steps: int = 1) -> None:
        """Speculative outcome of ``steps`` steps of one batch, per request over them (request ids are unique
        within a batch): tokens proposed (per step), accepted draft tokens *emitted* and tokens emitted."""
        self.proposed[rid] += proposed
        self.accepted[rid] += accepted
        self.spec_steps[rid] += steps * (proposed > 0)
        self.spec_emitted[rid] += np.where(proposed > 0, emitted, 0)

    def add_decode(self, rid: int, proposed: int, accepted: int, steps: int, emitted: int) -> None:
        """:meth:`decode` of one request's totals over steps that proposed (the simulator hands them over when the
        request leaves the batch): tokens proposed, accepted draft tokens emitted, steps, tokens emitted."""
        self.proposed[rid] += proposed
        self.accepted[rid] += accepted
        self.spec_steps[rid] += steps
        self.spec_emitted[rid] += emitted

    @property
    def keeps_steps(self) -> bool:
        """Whether each step is recorded (``save_steps``); else only counted."""
        return self.steps is not None

    def count_steps(self, n: int) -> None:
        """``n`` steps ran that are not recorded one by one (only when steps are not kept)."""
        if self.steps is not None:
            raise RuntimeError("steps are kept: record each with step()")
        self.num_steps += n

    def step(self, start: float, seconds: float, kind: str, batch_size: int, prefill_tokens: int,
             kv_blocks_used: int, num_waiting: int, proposed: np.ndarray | None = None,
             accepted: np.ndarray | None = None, emitted: np.ndarray | None = None) -> None:
        """One engine step; the decode arrays (per request of the batch) are reduced only when steps are kept."""
        self.num_steps += 1
        if self.steps is None:
            return
        if proposed is None:
            row = (0, 0, 0, 0)
        else:
            row = (int(proposed.max()), int(proposed.sum()), int(accepted.sum()), int(emitted.sum()))
        self.steps.append((start, seconds, kind, batch_size, prefill_tokens, *row, kv_blocks_used, num_waiting))

    # -- tables ---------------------------------------------------------------------------------
    def columns(self) -> dict[str, np.ndarray]:
        """The per-request table as arrays, :data:`REQUEST_COLUMNS` then :data:`DERIVED_COLUMNS`."""
        columns = {
            "request_id": np.arange(len(self.arrival_time), dtype=np.int64),
            "arrival_time": self.arrival_time,
            "first_token_time": self.first_token_time,
            "finish_time": self.finish_time,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "preemptions": self.preemptions,
            "ignored": self.ignored,
        }
        return {**columns, **derived(columns)}

    def requests_frame(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.columns())

    def steps_frame(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.steps or [], columns=STEP_COLUMNS)

    def acceptance_length(self) -> float:
        """Mean tokens emitted per speculative request-step, bonus token included (NaN without speculation)."""
        steps = int(self.spec_steps.sum())
        return int(self.spec_emitted.sum()) / steps if steps else float("nan")


def derived(columns: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ttft, tpot, latency and norm_latency (seconds; module docstring) of per-request columns (arrays, or a
    DataFrame's columns)."""
    arrival, first, finish = (np.asarray(columns[c], dtype=np.float64)
                              for c in ("arrival_time", "first_token_time", "finish_time"))
    output = np.asarray(columns["output_tokens"], dtype=np.float64)
    latency = finish - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output > 1, (finish - first) / (output - 1), np.nan)
    return {"ttft": first - arrival, "tpot": tpot, "latency": latency, "norm_latency": latency / output}


def summarize(requests: Mapping[str, np.ndarray], acceptance_length: float = float("nan")) -> dict[str, float]:
    """The figures of ``summary.json``: mean/p50/p90/p99 of latency, norm_latency, ttft, tpot (seconds),
    throughput (requests/s), goodput (generated tokens/s), acceptance rate and length, preemptions.
    ``requests``: the per-request columns (:meth:`Recorder.columns`, or a DataFrame of them)."""
    n = len(requests["request_id"])
    out: dict[str, float] = {"requests": n}
    if "ignored" in requests:
        ignored = np.asarray(requests["ignored"], dtype=bool)
        if ignored.any():
            requests = {c: np.asarray(v)[~ignored] for c, v in requests.items()}
            n = len(requests["request_id"])
    for col in DERIVED_COLUMNS:
        values = np.asarray(requests[col], dtype=float)
        values = values[~np.isnan(values)]
        out[f"mean_{col}"] = float(values.mean()) if values.size else float("nan")
        for q in (50, 90, 99):
            out[f"p{q}_{col}"] = float(np.percentile(values, q)) if values.size else float("nan")
    start = float(np.min(requests["arrival_time"])) if n else 0.0
    end = float(np.max(requests["finish_time"])) if n else 0.0
    span = end - start
    tokens = int(np.sum(requests["output_tokens"]))
    out["simulated_seconds"] = span
    out["throughput"] = n / span if span > 0 else float("nan")
    out["goodput"] = tokens / span if span > 0 else float("nan")
    out["output_tokens"] = tokens
    proposed = int(np.sum(requests["proposed_tokens"]))
    accepted = int(np.sum(requests["accepted_tokens"]))
    out["proposed_tokens"] = proposed
    out["accepted_tokens"] = accepted
    out["acceptance_rate"] = accepted / proposed if proposed else float("nan")
    out["mean_acceptance_length"] = acceptance_length
    out["preemptions"] = int(np.sum(requests["preemptions"]))
    return out
