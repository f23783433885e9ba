"""A run's timeline as Chrome / Perfetto trace-event JSON (``simulate --save-timeline``): open it in
https://ui.perfetto.dev or chrome://tracing, as one would a profiler's trace or Vidur's schedule.

- process "engine" (a fleet: one process per replica, "replica 0", "replica 1", ..., in index order, each with its
  profile when it has one), thread "batch": one complete event (``ph: X``) per engine step, named by its kind
  (``decode k=4 b=32``), with its batch size, largest k, proposed / accepted / emitted tokens, prefill tokens, KV
  blocks used and waiting requests as ``args``; counter tracks of batch size, k and waiting requests;
- process "requests": one async span per request (``ph: b/e``, id = request id): ``queued + prefill`` from arrival
  to the first token, then ``decode`` to the finish, with its lengths, token counts and (a fleet) the replica that
  served it as ``args``.

Times are microseconds of simulated time (the format's unit). Ignored requests have no span.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

#: Process ids: the engine's (a fleet's replica r: REPLICA_PID + r) and the requests'.
ENGINE_PID, REQUESTS_PID, REPLICA_PID = 1, 2, 3


def _lanes(steps: Any, replicas: Any = None) -> dict[Any, tuple[int, str]]:
    """Each lane's process id and name: the engine's, or one per replica of a fleet (its ``replica`` column), named
    with its profile when the per-replica table (``replicas``) has one."""
    if "replica" not in steps.columns:
        return {None: (ENGINE_PID, "engine")}
    count = len(replicas) if replicas is not None else int(steps["replica"].max()) + 1 if len(steps) else 0
    profiles = list(replicas["profile"]) if replicas is not None and "profile" in replicas else [None] * count
    return {r: (REPLICA_PID + r, f"replica {r}" + (f" ({profiles[r]})" if profiles[r] else "")) for r in range(count)}


def trace_events(requests: Any, steps: Any, replicas: Any = None) -> dict[str, Any]:
    """The trace-event document of a run's per-request and per-step DataFrames (and a fleet's per-replica table,
    whose profiles name its lanes)."""
    lanes = _lanes(steps, replicas)
    events: list[dict[str, Any]] = []
    for pid, name in lanes.values():
        events += [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}},
                   {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}},
                   {"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "batch"}}]
    events.append({"ph": "M", "pid": REQUESTS_PID, "name": "process_name", "args": {"name": "requests"}})
    fleet = None not in lanes
    for row in steps.itertuples(index=False):
        pid = lanes[int(row.replica) if fleet else None][0]
        ts, dur = row.start_time * 1e6, row.seconds * 1e6
        args = {"batch_size": int(row.batch_size), "k_max": int(row.k_max), "proposed": int(row.proposed),
                "accepted": int(row.accepted), "emitted": int(row.emitted), "prefill_tokens": int(row.prefill_tokens),
                "kv_blocks_used": int(row.kv_blocks_used), "num_waiting": int(row.num_waiting)}
        name = f"{row.kind} k={int(row.k_max)} b={int(row.batch_size)}"
        events.append({"ph": "X", "pid": pid, "tid": 1, "name": name, "cat": row.kind, "ts": ts, "dur": dur,
                       "args": args})
        events.append({"ph": "C", "pid": pid, "name": "batch", "ts": ts,
                       "args": {"batch size": int(row.batch_size), "k": int(row.k_max),
                                "waiting": int(row.num_waiting)}})
    for row in requests.itertuples(index=False):
        if getattr(row, "ignored", False) or not math.isfinite(row.finish_time):
            continue
        rid = int(row.request_id)
        args = {"prompt_tokens": int(row.prompt_tokens), "output_tokens": int(row.output_tokens),
                "proposed_tokens": int(row.proposed_tokens), "accepted_tokens": int(row.accepted_tokens),
                "preemptions": int(row.preemptions)}
        if fleet and hasattr(row, "replica"):
            args["replica"] = int(row.replica)
        common = {"pid": REQUESTS_PID, "cat": "request", "id": rid}
        events += [
            {**common, "ph": "b", "name": f"request {rid}", "ts": row.arrival_time * 1e6, "args": args},
            {**common, "ph": "b", "name": "queued + prefill", "ts": row.arrival_time * 1e6},
            {**common, "ph": "e", "name": "queued + prefill", "ts": row.first_token_time * 1e6},
            {**common, "ph": "b", "name": "decode", "ts": row.first_token_time * 1e6},
            {**common, "ph": "e", "name": "decode", "ts": row.finish_time * 1e6},
            {**common, "ph": "e", "name": f"request {rid}", "ts": row.finish_time * 1e6},
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "specsim", "time": "simulated seconds x 1e6"}}


def write_timeline(requests: Any, steps: Any, path: str | Path, replicas: Any = None) -> str:
    """Write the trace-event JSON atomically; return its path."""
    from simulator.results import write_json

    write_json(Path(path), trace_events(requests, steps, replicas))
    return str(path)
