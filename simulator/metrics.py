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

The simulator's table adds ``itl`` (:data:`ITL_COLUMN`): the request's mean inter-token latency, counted the way
``vllm bench serve`` counts it: one gap per *streamed chunk* after the first token, and a speculative step emits its
accepted tokens and the bonus token as one chunk (a burst), so a burst of 4 tokens is one gap, not four; with
speculation ITL is longer than TPOT. ``itl`` = (finish_time - first_token_time) / chunks after the first.

Summary figures in vLLM's names and units (:func:`summarize`): ``mean_/median_/std_/p99_`` of ``ttft``, ``tpot``, ``itl``
and ``e2el`` (= latency) in milliseconds (``std`` the population standard deviation, as numpy's default);
``request_throughput`` (= ``throughput``, requests/s), ``output_throughput`` (output tokens/s; the column was once called
``goodput``, a name now kept for the policy and for vLLM's SLO goodput), ``total_token_throughput``. ITL statistics pool
every chunk gap of every request: the mean is exact; the simulator keeps each request's decode time and chunk count,
not each chunk's time, so ``median_itl_ms``, ``std_itl_ms`` and ``p99_itl_ms`` are over the requests' mean gaps weighted
by their chunks (spread within a request is not counted: the p99 is a lower bound of the per-chunk p99).
With an SLO (``--goodput ttft:MS tpot:MS e2el:MS``, vLLM's syntax and definition), ``request_goodput`` = requests/s
that meet every given bound (a one-token request's TPOT counts as 0), and ``slo_attainment`` = their fraction.
``offered_rate`` (arrivals/s over the arrival span), ``served_rate`` (completions/s over the completion span) and
``saturated``: the engine could not keep up (:func:`saturation`).

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
#: The simulator's extra per-request column: mean inter-token latency per streamed chunk (module docstring).
ITL_COLUMN = "itl"
#: Columns a Recorder adds after :data:`DERIVED_COLUMNS`: ``itl`` and ``chunks`` (streamed chunks after the first token).
EXTRA_COLUMNS = [ITL_COLUMN, "chunks"]
#: vLLM's ``--goodput`` metrics (bounds in milliseconds) and the per-request column each reads.
SLO_COLUMNS = {"ttft": "ttft", "tpot": "tpot", "e2el": "latency"}
#: A run is ``saturated`` when its completions per second fall below this fraction of its arrivals per second and the
#: last quarter's mean TTFT exceeds the first quarter's by :data:`SATURATION_TTFT_GROWTH` (a queue that grows).
SATURATION_RATIO = 0.9
SATURATION_TTFT_GROWTH = 2.0
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
        self.merged = np.zeros(n, dtype=np.int64)
        """Tokens that reached the client inside a chunk of several beyond its first (multi-step chunks)."""
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

    def stream(self, rid: int, tokens: int) -> None:
        """``tokens`` decoded tokens of a request reached the client as one streamed chunk (vLLM's multi-step
        scheduling streams a chunk of steps at once); one ITL gap, not ``tokens``."""
        if tokens > 1:
            self.merged[rid] += tokens - 1

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
        # chunks after the first token: every emission event is one chunk; a speculative step's burst is one
        chunks = self.output_tokens - 1 - self.spec_emitted + self.spec_steps - self.merged
        with np.errstate(invalid="ignore", divide="ignore"):
            itl = np.where(chunks > 0, (self.finish_time - self.first_token_time) / np.maximum(chunks, 1), np.nan)
        return {**columns, **derived(columns), ITL_COLUMN: itl, "chunks": chunks}

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


def summarize(requests: Mapping[str, np.ndarray], acceptance_length: float = float("nan"),
              goodput_slo: Mapping[str, float] | None = None) -> dict[str, float]:
    """The figures of ``summary.json``: mean/p50/p90/p99 of latency, norm_latency, ttft, tpot (seconds),
    vLLM's ``mean_/median_/std_/p99_`` of ttft, tpot, itl, e2el (milliseconds), throughput (requests/s, also
    ``request_throughput``), ``output_throughput`` (generated tokens/s), acceptance rate and length, preemptions,
    offered and served rates and ``saturated``; ``request_goodput`` and ``slo_attainment`` when ``goodput_slo``
    (metric -> bound in ms, vLLM's ``--goodput``) is given (module docstring).
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
    out["request_throughput"] = out["throughput"]
    out["output_throughput"] = tokens / span if span > 0 else float("nan")
    prompt_tokens = int(np.sum(requests["prompt_tokens"])) if "prompt_tokens" in requests else 0
    out["total_token_throughput"] = (tokens + prompt_tokens) / span if span > 0 else float("nan")
    out["output_tokens"] = tokens
    proposed = int(np.sum(requests["proposed_tokens"]))
    accepted = int(np.sum(requests["accepted_tokens"]))
    out["proposed_tokens"] = proposed
    out["accepted_tokens"] = accepted
    out["acceptance_rate"] = accepted / proposed if proposed else float("nan")
    out["mean_acceptance_length"] = acceptance_length
    out["preemptions"] = int(np.sum(requests["preemptions"]))
    out.update(_ms_figures(requests))
    out.update(saturation(requests))
    if goodput_slo:
        good = good_requests(requests, goodput_slo)
        out["request_goodput"] = int(good.sum()) / span if span > 0 else float("nan")
        out["slo_attainment"] = float(good.mean()) if n else float("nan")
    return out


def _stats_ms(name: str, values: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    """vLLM's ``mean_/median_/std_/p99_<name>_ms`` (and p90, p50) of ``values`` in seconds, optionally weighted."""
    ok = ~np.isnan(values)
    values = values[ok]
    if weights is not None:
        weights = weights[ok].astype(float)
        ok = weights > 0
        values, weights = values[ok], weights[ok]
    if not values.size:
        return {f"{s}_{name}_ms": float("nan") for s in ("mean", "median", "std", "p50", "p90", "p99")}
    if weights is None:
        mean, std = float(values.mean()), float(values.std())
        pct = {q: float(np.percentile(values, q)) for q in (50, 90, 99)}
    else:
        mean = float(np.sum(values * weights) / weights.sum())
        std = float(np.sqrt(np.sum(weights * (values - mean) ** 2) / weights.sum()))
        order = np.argsort(values, kind="stable")
        v, cw = values[order], np.cumsum(weights[order])
        pct = {q: float(v[min(int(np.searchsorted(cw, q / 100 * cw[-1], side="left")), v.size - 1)])
               for q in (50, 90, 99)}
    out = {f"mean_{name}_ms": mean * 1e3, f"median_{name}_ms": pct[50] * 1e3, f"std_{name}_ms": std * 1e3}
    out.update({f"p{q}_{name}_ms": pct[q] * 1e3 for q in (50, 90, 99)})
    return out


def _ms_figures(requests: Mapping[str, np.ndarray]) -> dict[str, float]:
    """TTFT, TPOT, ITL and E2EL statistics in milliseconds, as ``vllm bench serve`` reports them."""
    out: dict[str, float] = {}
    out.update(_stats_ms("ttft", np.asarray(requests["ttft"], dtype=float)))
    out.update(_stats_ms("tpot", np.asarray(requests["tpot"], dtype=float)))
    if ITL_COLUMN in requests and "chunks" in requests:
        out.update(_stats_ms("itl", np.asarray(requests[ITL_COLUMN], dtype=float),
                             np.asarray(requests["chunks"], dtype=float)))
    else:
        out.update(_stats_ms("itl", np.array([])))
    out.update(_stats_ms("e2el", np.asarray(requests["latency"], dtype=float)))
    return out


def good_requests(requests: Mapping[str, np.ndarray], goodput_slo: Mapping[str, float]) -> np.ndarray:
    """Which requests meet every bound of ``goodput_slo`` (``ttft``, ``tpot``, ``e2el`` -> milliseconds), as vLLM's
    ``--goodput`` decides: value <= bound; a one-token request's TPOT is 0."""
    n = len(requests["request_id"])
    good = np.ones(n, dtype=bool)
    for name, bound in goodput_slo.items():
        values = np.asarray(requests[SLO_COLUMNS[name]], dtype=float)
        if name == "tpot":
            values = np.where(np.isnan(values), 0.0, values)
        good &= values <= bound / 1e3
    return good


def saturation(requests: Mapping[str, np.ndarray]) -> dict[str, float | bool]:
    """``offered_rate`` = (n - 1) / arrival span, ``served_rate`` = (n - 1) / completion span (requests/s), and
    ``saturated``: served below :data:`SATURATION_RATIO` x offered *and* a queue that grew (the last quarter of
    arrivals waited :data:`SATURATION_TTFT_GROWTH` x longer for their first token than the first quarter). Both
    are needed: a short run's completion span also stretches by the spread of latencies."""
    n = len(requests["request_id"])
    nan = float("nan")
    if n < 4:
        return {"offered_rate": nan, "served_rate": nan, "saturated": False}
    arrival = np.asarray(requests["arrival_time"], dtype=float)
    finish = np.asarray(requests["finish_time"], dtype=float)
    a_span, f_span = float(arrival.max() - arrival.min()), float(np.nanmax(finish) - np.nanmin(finish))
    offered = (n - 1) / a_span if a_span > 0 else nan
    served = (n - 1) / f_span if f_span > 0 else nan
    order = np.argsort(arrival, kind="stable")
    ttft = np.asarray(requests["ttft"], dtype=float)[order]
    q = n // 4
    early, late = float(np.nanmean(ttft[:q])), float(np.nanmean(ttft[-q:]))
    saturated = bool(served < SATURATION_RATIO * offered and late > SATURATION_TTFT_GROWTH * early)
    return {"offered_rate": offered, "served_rate": served, "saturated": saturated}
