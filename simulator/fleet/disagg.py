"""Disaggregated prefill and decode (issue 24, item 3): prefill instances, decode instances and the KV link between.

What it follows: Splitwise (Patel et al., "Splitwise: Efficient Generative LLM Inference Using Phase Splitting",
ISCA 2024: prompt and token machines, the KV cache sent between them over InfiniBand) and DistServe (Zhong et al.,
"DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language Model Serving", OSDI 2024:
separate prefill and decoding instances sized for TTFT and TPOT SLOs, goodput per GPU as the figure of merit); vLLM's
disaggregated prefill (a prefill instance runs a request to its first token, its KV connector sends the cache, the
decode instance continues) gives the names and the block handling.

- **Prefill instances** (``prefill_replicas``): :class:`simulator.core.engine.SimulatedEngine` s in prefill-only mode
  (the engine's ``handoff`` hook), with the configured scheduler (``prefill-first`` or ``chunked-prefill`` over
  prompts). A prefill prices the draft's prefill too when a draft model speculates (its KV is sent as well). A
  request whose prefill completed has emitted its first token there; if it has more to emit it leaves, still
  holding its KV blocks until its transfer ends (vLLM's prefill instance frees a request's blocks once the decode
  instance has read them). A one-token request finishes on its prefill instance.
- **Routing.** Arrivals go to a prefill instance by ``prefill_router`` (the fleet's routers,
  :mod:`simulator.fleet.routers`; outstanding = routed there and not yet handed off or finished); at the hand-off the
  ``decode_router`` picks a decode instance (outstanding = routed there and not finished, those in transfer
  included), as DistServe's controller dispatches a prefilled request to the least-loaded decoding instance.
- **The KV link** (:class:`KVLink`, ``kv_link``): a transfer takes ``latency + bytes / (bandwidth x G)`` seconds, G
  the GPUs of an instance (tensor parallel: each GPU sends its shard on its own link), bytes = prompt tokens x the KV
  bytes per token of the target plus, when a draft model speculates, of the draft (:func:`kv_transfer`, from the
  profile's memory figures; a sliding-window layer's only for the window). Transfers are **serialised per prefill
  instance** (its outgoing NIC or NVLink port sends one request's KV at a time, first come first served, at the
  link's full bandwidth); a decode instance's receiving side is taken to keep up (many prefill instances sending to
  one decode instance at once is not a bottleneck here). The transfer starts when the prefill completes: Splitwise
  overlaps it layer by layer with the prefill of large prompts, so the gap here is an upper bound of theirs. Bytes
  are counted per token, not per block (a request's last, partial block is sent only as far as it is filled).
- **Decode instances** (``decode_replicas``): engines that receive requests with their KV in place and their first
  token emitted (the engine's ``receive_prefilled`` hook): a request joins the decode batch at the next step
  boundary when a seat and its blocks are free, else waits in the instance's queue (first come first served); it
  speculates with the configured policy, one policy object and one acceptance and n-gram stream per instance (the
  fleet's :func:`~simulator.fleet.fleet.replica_streams`; the first decode instance draws from the run's own, so one
  prefill and one decode instance over a free link serve requests that never overlap as one engine does). A request preempted on a decode instance is
  recomputed there (its prefill rerun locally, as vLLM's decode instance would). Decode instances run step by step
  (the plain path: the runs of steps, :mod:`simulator.core.runs`, bound a run by the next *workload* arrival, which
  says nothing about when a KV transfer lands) and keep no prefix cache.
- **Times.** TTFT counts to the first token *at the client*, after the KV transfer (issue 24: "TTFT including the
  transfer"): the prefill instance computes the first token, but a disaggregated deployment streams the response from
  the decode instance (vLLM's disaggregated-prefill proxy sends the request to the prefill instance for one token, then
  to the decode instance whose stream the client reads), so the token reaches the client when the KV has landed.
  ``prefill_end_time`` per request keeps the prefill instance's time (Splitwise's and DistServe's TTFT, which end at the
  prompt phase); the wait for a decode seat after the transfer counts before the second token (TPOT and E2EL).

The summary adds the fleet's figures (``gpus``, ``goodput_per_gpu`` with an SLO, each side's load balance), the KV
transfers' statistics (``mean_kv_transfer_s``, ``p99_kv_transfer_s`` from the end of the prefill to the KV's arrival,
queueing on the link included; ``mean_kv_link_wait_s``; ``mean_kv_bytes``, ``kv_bytes``) and one row per instance
(:data:`INSTANCE_COLUMNS`, role prefill or decode). Not modelled: a front end per instance, a client's closed loop,
multi-step scheduling, prefix caching on decode instances.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import simpy

from policies.errors import UserError
from simulator.config import KV_LINK_NAMES, SimConfig
from simulator.core.engine import SimulatedEngine
from simulator.core.memory import KVBytes
from simulator.core.runner import SimResult, is_speculative, run_summary, setup_run
from simulator.costs.cost_model import CostModel
from simulator.costs.profile_table import meta_path
from simulator.fleet.fleet import (Fleet, FleetRecorder, _Replica, _weighted_quantile, batch_figures, load_balance,
                                   replica_streams, router_stream)
from simulator.fleet.routers import ReplicaState, RequestView, Router, make_router
from simulator.inputs.acceptance import make_acceptance
from simulator.inputs.workload import Workload

GB = 1e9
"""Bytes in a GB (link bandwidths are quoted in decimal GB/s)."""


@dataclass(frozen=True)
class KVLink:
    """A link that carries KV caches: ``bandwidth`` bytes/s per GPU and direction, ``latency`` seconds per transfer."""

    name: str
    bandwidth: float
    latency: float
    source: str = ""

    def seconds(self, nbytes: float, gpus: int = 1) -> float:
        """Seconds to send ``nbytes`` bytes from an instance of ``gpus`` GPUs: latency + bytes / (bandwidth x gpus)."""
        return self.latency + nbytes / (self.bandwidth * gpus)


#: The KV links by name (:data:`simulator.config.KV_LINK_NAMES`). Bandwidths per GPU and direction from the
#: datasheets; the latencies are assumptions (a KV connector's transfer: set-up, RDMA and completion notice, tens of
#: microseconds; against milliseconds of bytes for a prompt of a thousand tokens they hardly matter).
KV_LINKS: dict[str, KVLink] = {link.name: link for link in (
    KVLink("nvlink", 450 * GB, 10e-6,
           "NVIDIA H100 SXM5 datasheet: NVLink 4, 900 GB/s per GPU counting both directions, 450 GB/s each way "
           "(a transfer goes one way); latency 10 us assumed (the analytical profiles' collective latency)"),
    KVLink("infiniband", 50 * GB, 20e-6,
           "InfiniBand NDR: 400 Gb/s per port = 50 GB/s; a DGX H100 has one ConnectX-7 NDR port per GPU (8 x 400 "
           "Gb/s), so one port per GPU; latency 20 us assumed"),
    KVLink("infiniband-hdr", 25 * GB, 20e-6,
           "InfiniBand HDR: 200 Gb/s per port = 25 GB/s, one port per GPU (DGX A100: 8 x 200 Gb/s); latency 20 us "
           "assumed"),
    KVLink("ethernet", 12.5 * GB, 50e-6,
           "100 Gb Ethernet: 12.5 GB/s per GPU; latency 50 us assumed"),
)}
if tuple(KV_LINKS) != KV_LINK_NAMES:  # pragma: no cover - a developer's slip, caught on import
    raise ImportError(f"simulator.fleet.disagg: registry {tuple(KV_LINKS)} != config.KV_LINK_NAMES {KV_LINK_NAMES}")

#: Per-instance table columns (``replicas.csv`` of a disaggregated run): index (prefill instances first), role,
#: requests routed there and finished there, steps, the fraction of the run it computed (``busy``: its prefill steps,
#: or its decode steps), the batch (prompts of a prefill step, requests of a decode step) mean, p50 and p90 weighted by
#: step time, mean k per request-step (decode), prompt tokens prefilled (prefill), mean TTFT of the requests it
#: prefilled / mean TPOT of those it decoded (s), KV bytes sent or received, and their mean transfer time (s, first
#: token to arrival).
INSTANCE_COLUMNS = ["replica", "role", "requests", "finished", "steps", "busy", "mean_batch", "p50_batch", "p90_batch",
                    "mean_k", "prefill_tokens", "mean_ttft", "mean_tpot", "kv_bytes", "mean_kv_transfer_s"]


def kv_link(config: SimConfig) -> KVLink:
    """``config.fleet.kv_link``'s link with the ``kv_link_bandwidth`` (GB/s) and ``kv_link_latency`` (s) overrides."""
    fleet = config.fleet
    link = KV_LINKS[fleet.kv_link]
    return dataclasses.replace(
        link, bandwidth=link.bandwidth if fleet.kv_link_bandwidth is None else fleet.kv_link_bandwidth * GB,
        latency=link.latency if fleet.kv_link_latency is None else fleet.kv_link_latency)


def kv_transfer(config: SimConfig, cost: CostModel) -> KVBytes:
    """KV bytes sent from a prefill to a decode instance: the target's, plus the draft's when a draft model speculates
    (the profile's memory figures, :class:`simulator.core.memory.KVBytes`: every token's in full-attention layers, the
    window's in sliding ones)."""
    mem = cost.memory
    if mem is None:
        raise UserError(f"--profile {cost.path}: has no memory figures (KV bytes per token) to size the KV transfers "
                        "of disaggregated serving")
    return KVBytes.of(mem, is_speculative(config) and config.speculative.proposer == "draft")


def gpus_per_instance(profile: str) -> int:
    """GPUs of one instance: the tensor-parallel size of the target in the profile's metadata (``target`` ->
    ``tensor_parallel``); 1 for a profile without it (a coefficient JSON, or metadata that does not say)."""
    path = meta_path(profile) if Path(profile).suffix.lower() == ".csv" else None
    if path is None or not path.is_file():
        return 1
    target = json.loads(path.read_text()).get("target")
    tp = target.get("tensor_parallel", 1) if isinstance(target, dict) else 1
    if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1):
        raise UserError(f"{path}: target.tensor_parallel must be a whole number >= 1 (got {tp!r})")
    return tp


class DisaggRecorder(FleetRecorder):
    """The per-request record of a disaggregated run: :class:`FleetRecorder`'s (one recorder per instance, prefill
    instances first) with, per request, ``prefill_replica`` and ``decode_replica`` (instance indices; -1: none, an
    ignored request or one that finished on its prefill instance), ``kv_bytes`` sent, ``prefill_end_time`` (s: when
    its prefill instance emitted the first token) and ``kv_transfer_start`` / ``kv_transfer_end`` (s; NaN without a
    transfer; the first token reaches the client at ``kv_transfer_end``, its ``first_token_time``)."""

    def __init__(self, arrival_time, prompt_tokens, output_tokens, save_steps: bool) -> None:
        super().__init__(arrival_time, prompt_tokens, output_tokens, save_steps)
        n = len(arrival_time)
        self.decode_of = np.full(n, -1, dtype=np.int64)
        self.kv_bytes = np.zeros(n, dtype=np.float64)
        self.prefill_end = np.full(n, np.nan)
        self.transfer_start = np.full(n, np.nan)
        self.transfer_end = np.full(n, np.nan)

    prefill_of: np.ndarray | None = None
    """Prefill instance of each request (-1: ignored), the prefill side's :attr:`Fleet.replica_of`."""

    def columns(self) -> dict[str, np.ndarray]:
        columns = super().columns()
        columns.update(prefill_replica=self.prefill_of, decode_replica=self.decode_of, kv_bytes=self.kv_bytes,
                       prefill_end_time=self.prefill_end, kv_transfer_start=self.transfer_start, kv_transfer_end=self.transfer_end)
        return columns


class Disaggregated:
    """Prefill instances, decode instances and the KV link in one environment: call :meth:`start`, then
    ``env.run()``."""

    def __init__(self, env: simpy.Environment, prefill: Sequence[SimulatedEngine], decode: Sequence[SimulatedEngine],
                 prefill_router: Router, decode_router: Router, link: KVLink, kv_sent: KVBytes, tp: int,
                 workload: Workload, block_size: int, recorder: DisaggRecorder) -> None:
        self.env = env
        p = len(prefill)
        self.side = Fleet(env, prefill, prefill_router, workload, block_size, recorder.replicas[:p])
        """The prefill instances behind their router: a fleet's dispatcher; an instance's outstanding requests are
        those routed to it and neither handed off nor finished there."""
        self.decode = list(decode)
        self.decode_recorders = recorder.replicas[p:]
        self.decode_router = decode_router
        self.link = link
        self.kv_sent = kv_sent
        """KV bytes of a request by its prompt tokens."""
        self.tp = tp
        """GPUs of an instance (each sends its shard of the KV on its own link)."""
        self.rec = recorder
        self.prompt = workload.prompt_list
        self.prompt_id = workload.prompt_id_list if workload.prompt_id is not None else None
        self.routed = [0] * len(decode)
        """Requests routed to each decode instance."""
        self.link_free = [0.0] * p
        """When each prefill instance's link is free to start the next transfer (s)."""
        recorder.prefill_of = self.side.replica_of
        for i, engine in enumerate(prefill):
            engine.handoff = lambda rid, blocks, i=i: self._handoff(i, rid, blocks)

    def start(self) -> None:
        """Start the dispatcher and the prefill instances' processes, then the decode instances', in index order."""
        self.side.start()
        for engine in self.decode:
            engine.start(own_arrivals=False)

    def _decode_states(self) -> list[ReplicaState]:
        return [ReplicaState(j, self.routed[j] - rec.finished) for j, rec in enumerate(self.decode_recorders)]

    def _handoff(self, p: int, rid: int, blocks: int) -> None:
        """Prefill instance ``p`` completed request ``rid``'s prefill (now): pick its decode instance and queue its KV
        on ``p``'s link; when it has arrived, ``p`` frees the ``blocks`` and the decode instance receives it."""
        env, rec = self.env, self.rec
        self.side.live[p].outstanding -= 1
        prompt = self.prompt[rid]
        view = RequestView(rid, prompt, None if self.prompt_id is None else self.prompt_id[rid], range(0))
        d = self.decode_router.choose(view, self._decode_states())
        if not 0 <= d < len(self.decode):
            raise RuntimeError(f"router {self.decode_router.name} chose decode instance {d} of {len(self.decode)}")
        self.routed[d] += 1
        rec.decode_of[rid] = len(self.side.engines) + d
        nbytes = self.kv_sent.held(prompt)
        wait = max(self.link_free[p] - env.now, 0.0)  # the link sends the transfers queued before this one first
        delay = wait + self.link.seconds(nbytes, self.tp)
        self.link_free[p] = env.now + delay  # SimPy's time of the arrival, the same float
        rec.kv_bytes[rid], rec.prefill_end[rid], rec.transfer_start[rid] = nbytes, env.now, env.now + wait
        arrived = env.timeout(delay)
        arrived.callbacks.append(lambda _event: self._arrive(p, d, rid, blocks))

    def _arrive(self, p: int, d: int, rid: int, blocks: int) -> None:
        """Request ``rid``'s KV reached decode instance ``d``: prefill instance ``p`` frees its blocks, and the first
        token reaches the client (module docstring, Times)."""
        self.rec.transfer_end[rid] = self.rec.first_token_time[rid] = self.env.now
        self.side.engines[p].release_handoff(rid, blocks)
        self.decode[d].receive_prefilled(rid)


def instance_rows(system: Disaggregated, columns: dict[str, np.ndarray]) -> list[dict]:
    """One row per instance (:data:`INSTANCE_COLUMNS`), prefill instances first. A prefill instance's batch figures
    are over its prefill steps (prompts per step, from its step rows, which it always keeps: a few per request); a
    decode instance's over its decode steps (:func:`simulator.fleet.fleet.batch_figures` of its engine's
    :class:`~simulator.core.runs.BatchLoad`; a recompute's prefill step on it is in neither)."""
    nan = float("nan")
    span = float(np.nanmax(columns["finish_time"]) - np.nanmin(columns["arrival_time"]))
    p = len(system.side.engines)
    engines = system.side.engines + system.decode
    recorders = system.side.recorders + system.decode_recorders
    routed = system.side.routed + system.routed
    rows = []
    for i, (engine, rec) in enumerate(zip(engines, recorders)):
        prefill = i < p
        mine = (columns["prefill_replica"] if prefill else columns["decode_replica"]) == i
        moved = mine & ~np.isnan(columns["kv_transfer_end"])
        transfer = columns["kv_transfer_end"][moved] - columns["prefill_end_time"][moved]
        if prefill:
            seconds = np.array([row[1] for row in rec.steps], dtype=float)
            prompts = np.array([row[3] for row in rec.steps], dtype=float)
            busy = float(seconds.sum())
            batch = {"mean_batch": float((prompts * seconds).sum() / busy) if busy > 0 else nan,
                     "p50_batch": _weighted_quantile(prompts, seconds, 0.5),
                     "p90_batch": _weighted_quantile(prompts, seconds, 0.9), "mean_k": nan}
        else:
            figures = batch_figures(engine.load)
            busy = float(sum(engine.load.seconds))
            batch = {key: figures[key] for key in ("mean_batch", "p50_batch", "p90_batch", "mean_k")}
        rows.append({
            "replica": i,
            "role": "prefill" if prefill else "decode",
            "requests": routed[i],
            "finished": rec.finished,
            "steps": rec.num_steps,
            "busy": busy / span if span > 0 else nan,
            **batch,
            "prefill_tokens": int(sum(row[4] for row in rec.steps)) if prefill else nan,
            "mean_ttft": float(np.mean(columns["ttft"][mine])) if prefill and mine.any() else nan,
            "mean_tpot": float(np.mean(columns["tpot"][mine])) if not prefill and mine.any() else nan,
            "kv_bytes": float(columns["kv_bytes"][moved].sum()),
            "mean_kv_transfer_s": float(transfer.mean()) if transfer.size else nan,
        })
    return rows


def transfer_summary(columns: dict[str, np.ndarray]) -> dict[str, float]:
    """The KV transfers' figures: count, mean and p99 of the time from the end of the prefill to the KV's arrival at the
    decode instance (queueing on the link included) and of the wait for the link (s), mean and total bytes."""
    moved = ~np.isnan(columns["kv_transfer_end"])
    first = columns["prefill_end_time"][moved]
    transfer = columns["kv_transfer_end"][moved] - first
    wait = columns["kv_transfer_start"][moved] - first
    nbytes = columns["kv_bytes"][moved]
    some = bool(moved.any())
    nan = float("nan")
    return {"kv_transfers": int(moved.sum()),
            "mean_kv_transfer_s": float(transfer.mean()) if some else nan,
            "p99_kv_transfer_s": float(np.percentile(transfer, 99)) if some else nan,
            "mean_kv_link_wait_s": float(wait.mean()) if some else nan,
            "mean_kv_bytes": float(nbytes.mean()) if some else nan,
            "kv_bytes": float(nbytes.sum())}


def run_disagg(config: SimConfig, workload: Workload | None = None, step_by_step: bool = False,
               cost: CostModel | None = None, link: KVLink | None = None) -> SimResult:
    """:func:`simulator.core.runner.run_simulation` for ``config.fleet.prefill_replicas`` prefill and
    ``config.fleet.decode_replicas`` decode instances (:func:`simulator.fleet.run` calls this when both are > 0), over
    the same set-up (:func:`~simulator.core.runner.setup_run`) and summary (:func:`~simulator.core.runner.run_summary`).
    ``link``: this link instead of the config's (tests: a free, infinitely fast one)."""
    setup = setup_run(config, workload, step_by_step, cost)
    if setup.cost.frontend_time() > 0:
        raise UserError(f"--profile {config.cost.profile}: a front end (frontend seconds per request) in front of "
                        "disaggregated instances is not modelled")
    link = kv_link(config) if link is None else link
    sent = kv_transfer(config, setup.cost)
    tp = gpus_per_instance(config.cost.profile)
    workload = setup.workload
    recorder = DisaggRecorder(workload.arrival_time, workload.prompt_tokens, workload.output_tokens,
                              config.run.save_steps)
    prefill_recs = [recorder.replica() for _ in range(config.fleet.prefill_replicas)]  # their rows: the prefill figures
    decode_recs = [recorder.replica(keep_steps=config.run.save_steps) for _ in range(config.fleet.decode_replicas)]
    env = simpy.Environment()
    decode_spec = dataclasses.replace(setup.spec, run_steps=1, prefix_caching=False)  # step by step: module docstring
    decode = []
    for j, rec in enumerate(decode_recs):  # each its own acceptance and n-gram streams, the first the run's own
        accept_rng, ngram_rng = (setup.acceptance_rng, setup.ngram_rng) if j == 0 else \
            replica_streams(config.run.seed, j)
        decode.append(SimulatedEngine(env, decode_spec, workload, setup.cost, setup.make_policy(config),
                                      setup.policy_cost, make_acceptance(config.speculative, accept_rng, workload),
                                      ngram_rng, rec))
    # prefill instances never decode: they are handed the first decode instance's models, and never draw from them
    prefill = [_Replica(env, setup.spec, workload, setup.cost, setup.make_policy(config), setup.policy_cost,
                        decode[0].acceptance, decode[0].ngram_rng, rec) for rec in prefill_recs]
    for engine in prefill + decode[1:]:  # one list: a request's count is kept by the instance that holds it
        engine.generated = decode[0].generated
    rng = router_stream(config.run.seed)
    system = Disaggregated(env, prefill, decode, make_router(config.fleet.prefill_router, rng),
                           make_router(config.fleet.decode_router, rng), link, sent, tp, workload,
                           config.engine.block_size, recorder)
    system.start()
    setup.run(env)
    recorder.gather()
    columns = recorder.columns()
    summary = run_summary(config, setup, recorder, columns, [e.cache for e in prefill if e.cache is not None])
    gpus = tp * (config.fleet.prefill_replicas + config.fleet.decode_replicas)
    goodput = summary.get("request_goodput")
    summary.update({
        "prefill_replicas": config.fleet.prefill_replicas, "decode_replicas": config.fleet.decode_replicas,
        "prefill_router": config.fleet.prefill_router, "decode_router": config.fleet.decode_router,
        "gpus": gpus, "goodput_per_gpu": goodput / gpus if goodput is not None else float("nan"),
        "kv_link": link.name, "kv_link_bandwidth_gbps": link.bandwidth / GB, "kv_link_latency_s": link.latency,
        "kv_bytes_per_token": sent.per_token,
        **{f"prefill_{k}": v for k, v in load_balance(system.side.routed).items()},
        **{f"decode_{k}": v for k, v in load_balance(system.routed).items()},
        **transfer_summary(columns),
    })
    return SimResult(config, summary, recorder, tuple(instance_rows(system, columns)))
