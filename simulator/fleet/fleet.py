"""A fleet: N replicas of the simulated engine behind a router, in one SimPy environment (issue 24, items 1 and 4).

- **Replicas.** ``config.fleet.replicas`` :class:`simulator.core.engine.SimulatedEngine` s, identical (``profile``) or
  one per entry of ``replica_profiles`` (a mixed fleet: each its own cost model and KV blocks; the list is kept sorted,
  so its order changes nothing), each with its own scheduler, KV cache (its own prefix cache with
  ``enable_prefix_caching``), policy object (an adaptive policy learns from its replica's steps only) and random streams
  of acceptance and n-gram lookups (:func:`replica_streams`; the first replica's are the run's own, so a fleet of one is
  the single engine bit for bit), all serving one workload with global request ids.
- **Dispatcher.** One SimPy process replays the workload's arrivals; at each it asks the router
  (:mod:`simulator.fleet.routers`, a view of the request and each replica's live state: outstanding requests and
  prefix cache, whose keys come from the workload's prompt ids or trace block hashes) and sends the request to that
  replica (:meth:`SimulatedEngine.arrive`: through its front end, a vLLM-calibrated profile's API server, when it has
  one). A request that can never fit in any replica's KV cache is ignored, as one engine ignores it, and routed
  nowhere; in a mixed fleet one that fits only some replicas is routed among those.
- **Runs of steps (speed, item 4).** A replica's runs of decode steps (:mod:`simulator.core.runs`) end at its first
  finish (the router reads finishes as they happen), after ``run_steps`` steps, and, while its queue is empty, at the
  first arrival that may be routed to it, not at every arrival of the fleet:

  - a block-drawn run (``SimulatedEngine.runs``: a stationary policy, whose steps change the batch after the run's
    end) is planned past the fleet's arrivals and, when a request does come, ends with the step during which it
    arrives (:data:`CUT_RUNS`);
  - a run of per-step steps (an adaptive policy's, n-gram's, chunked prefill's) ends with the step during which the
    first request arrives that the router may send here (:data:`BOUNDED_RUNS`: least-outstanding, round-robin and
    power-of-two can tell); where the router cannot tell, it is planned at most :attr:`_Replica.horizon` ahead and,
    when a request comes, rewound to its start (batch, blocks, policy, acceptance and n-gram streams, step count and
    batch-size record) and planned again bounded by that arrival (:data:`CUT_RUNS`).

  Either way the same steps at the same times as step by step (with the plain twins too: every run ends at every
  fleet arrival). Each replica's streams are its own, so what one replica draws never depends on when another plans.
- **Per-replica figures.** Each replica has its own recorder over the shared per-request arrays (it keeps step rows
  only with ``save_steps``) and its engine's :class:`simulator.core.runs.BatchLoad` (its decode steps' seconds by
  batch size, added step by step): the batch-size distribution weighted by step time and the mean k per
  request-step (:func:`replica_rows`).
- **Order of replicas.** Ties in every router go to the lowest index, and the replicas' processes start in index
  order, so a run is reproducible; replicas relabelled (the router seeing them in another order, their processes
  started and their streams and profiles given in that order) give the same fleet figures, and a mixed fleet's list
  of profiles is sorted (tests/test_fleet.py).

Not modelled here: a client's ``max_concurrency`` in front of a fleet; disaggregated prefill and decode is
:mod:`simulator.fleet.disagg`.
"""
from __future__ import annotations

import copy
import math
from bisect import bisect_right
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import simpy

from policies.errors import UserError, warn_user
from simulator.config import DEFAULT_SIM_PROFILE, SimConfig
from simulator.core.engine import EngineSpec, SimulatedEngine
from simulator.core.prefix_cache import prompt_keys
from simulator.core.runner import RunSetup, SimResult, profile_method, run_summary, setup_run
from simulator.core.runs import BatchLoad
from simulator.costs.cost_model import CostModel
from simulator.fleet.routers import ReplicaState, RequestView, Router, make_router
from simulator.inputs.acceptance import BetaAcceptance, ConstantAcceptance, PositionAcceptance, make_acceptance
from simulator.inputs.workload import Workload
from simulator.metrics import STEP_COLUMNS, Recorder

#: Per-replica table columns (``replicas.csv``).
REPLICA_COLUMNS = ["replica", "profile", "num_gpu_blocks", "requests", "finished", "throughput", "output_throughput",
                   "mean_latency", "mean_ttft", "steps", "decode_steps", "mean_batch", "p50_batch", "p90_batch",
                   "mean_k"]

BOUNDED_RUNS = True
"""Speed shortcut, switched here in one place: while a replica's queue is empty, a run of its that is not cut
(:data:`CUT_RUNS`) ends with the step during which the first request arrives that the router may send to it
(:meth:`simulator.fleet.routers.Router.surely_elsewhere`, for the routers that can tell), not at the fleet's next
arrival. Exact: ending a run earlier or later gives the same steps, and no request can come to it before. False: as
where the router cannot tell. ``tests/test_fleet.py`` runs every combination of the two flags, and step by step, bit
for bit."""

CUT_RUNS = True
"""Speed shortcut, switched here in one place: a replica's runs are planned as if no request would come, and cut when
one is routed to it while its queue is empty: a block-drawn run (:meth:`simulator.core.runs.DecodeRuns._decode_run`,
whose steps change the batch after its end) always, ending with the step during which the request arrives
(:meth:`_Replica._cut_in_place`); a run of per-step steps where the router cannot bound it (:data:`BOUNDED_RUNS`),
planned at most :attr:`_Replica.horizon` ahead, rewound to its start and planned again bounded by that arrival
(:meth:`_Replica._cuttable`; where the rewind is exact: chain proposals, no token tree, drawn by an acceptance model
of :data:`REWINDABLE`). The same steps at the same times as step by step; a cut block-drawn run leaves its draws for
the steps cut off unused (with speculation such runs are statistically, not bit for bit, step by step's anyway).
False: runs end at every arrival of the fleet that may come to the replica (:data:`BOUNDED_RUNS`), else at every one
(N replicas at N times the rate then take about N times the events of one)."""

#: Acceptance models a replica rewinds by their attributes and generators alone (:data:`CUT_RUNS`): their draws only
#: advance their generator and reassign attributes (per-request state changes only as requests start and finish,
#: never inside a run). The replay model moves per-request pointers in place as it draws, and is not among them.
REWINDABLE = (ConstantAcceptance, BetaAcceptance, PositionAcceptance)


def router_stream(seed: int) -> np.random.Generator:
    """The router's generator: the fifth child of the run's ``SeedSequence`` (the first four, the run's arrivals,
    lengths, acceptance and n-gram streams, are :func:`simulator.core.runner.random_streams`, unchanged)."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[4])


def replica_streams(seed: int, j: int) -> tuple[np.random.Generator, np.random.Generator]:
    """The acceptance and n-gram generators of the ``j``-th replica, ``j`` >= 1 (the 0th draws from the run's own,
    :func:`simulator.core.runner.random_streams`, so that a fleet of one is the single engine): the two children of the
    run's ``SeedSequence`` node with spawn key ``(5, j)``, apart from the run's five streams, from every other replica's
    and from the fleet's size."""
    acceptance, ngram = np.random.SeedSequence(seed, spawn_key=(5, j)).spawn(2)
    return np.random.default_rng(acceptance), np.random.default_rng(ngram)


def resolve_profile(entry: str) -> str:
    """A replica's profile file: ``entry`` itself when it is a file, else ``profiles/data/<entry>.csv`` (or ``.json``),
    the names ``profiles/data/`` ships (e.g. ``h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b``)."""
    if Path(entry).is_file():
        return entry
    data = Path(DEFAULT_SIM_PROFILE).parent
    for suffix in (".csv", ".json"):
        if (data / f"{entry}{suffix}").is_file():
            return str(data / f"{entry}{suffix}")
    raise UserError(f"--replicas: no profile {entry!r}: give a profile file, or the name of one in {data} without its "
                    "suffix (e.g. h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b)")


def _attributes(obj: Any, deep: bool) -> tuple[dict[str, Any], list]:
    """What :func:`_rewind` puts back (speed shortcut, :data:`CUT_RUNS`): ``obj``'s attributes (``deep``: its lists,
    dicts, sets and arrays copied, for an object that changes them in place) and the states of its generators."""
    attributes = dict(vars(obj))
    if deep:
        for name, value in attributes.items():
            if isinstance(value, (list, dict, set, np.ndarray)):
                attributes[name] = value.copy()
    generators = [(g, g.bit_generator.state) for g in attributes.values() if isinstance(g, np.random.Generator)]
    return attributes, generators


def _rewind(obj: Any, saved: tuple[dict[str, Any], list]) -> None:
    """``obj`` as :func:`_attributes` found it (once per snapshot: its copies are handed back, not copied again)."""
    attributes, generators = saved
    vars(obj).update(attributes)
    for generator, state in generators:
        generator.bit_generator.state = state


class _Replica(SimulatedEngine):
    """An engine of a fleet. Its ``arrived`` is the fleet's count of arrived requests (the fleet hook of
    :meth:`SimulatedEngine.start`), so it ends after the fleet's last arrival, and its finishes update the fleet's live
    state of it. Its runs of steps end at their first finish (:attr:`past_finish` False: the router reads finishes as
    they happen) and, while its queue is empty, with the step during which the next request that may come to it
    arrives (:meth:`_run_bound`); where the router cannot tell which that is, they are planned ahead and cut when a
    request does come (:attr:`cuts`, :data:`CUT_RUNS`), else they end at every arrival of the fleet."""

    fleet: Fleet
    index = 0
    """Its index in the fleet (set by :class:`Fleet`)."""
    past_finish = False
    cuts = False
    """Whether a run the router cannot bound is planned ahead and cut when a request comes (:func:`run_fleet` sets
    it)."""
    horizon = math.inf
    """How far ahead such a run is planned at most (s): it ends with the step during which that much time has passed
    (ending a run earlier gives the same steps), so that a cut wastes at most that much planning. :func:`run_fleet` sets
    a quarter of the mean time between the requests one replica gets."""
    _bound = math.inf
    """When the run being planned ends (the step during which it falls ends it; :meth:`_run_bound`)."""
    _pending = False
    """Whether it is waiting for the end of a run that an arrival would cut."""
    _replan: float | None = None
    """While a cut run is planned again: when it started."""
    _cut_steps: int | None = None
    """The steps a block-drawn run cut in place keeps (:meth:`_cut_in_place`)."""

    _in_frontend = 0
    """Requests routed here still in its front end (a profile's ``frontend`` seconds per request: its API server)."""

    @property
    def arrived(self) -> int:
        """The fleet's arrived requests but those still in its front end (with none left, it may end)."""
        return self.fleet.arrived - self._in_frontend

    @arrived.setter
    def arrived(self, value: int) -> None:  # the engine's own count (its __init__'s 0): the fleet keeps it
        pass

    def arrive(self, rid: int) -> None:
        if self.frontend > 0:
            self._in_frontend += 1
        super().arrive(rid)

    def _enqueue(self, rids: list[int]) -> None:
        if self.frontend > 0:
            self._in_frontend -= len(rids)
        super()._enqueue(rids)

    def _finish(self, rid: int, now: float) -> None:
        super()._finish(rid, now)
        self.fleet.live[self.index].outstanding -= 1

    # -- runs bounded by the arrivals that may come to it (speed shortcuts) ------------------------
    def _run_clock(self) -> float:
        return self.env.now if self._replan is None else self._replan

    def _next_arrival(self) -> float:
        return self._bound

    def _run_bound(self) -> tuple[float, bool]:
        """When a run planned now ends (with the step during which that time falls) and whether an arrival may cut it:
        never while a request waits (a newcomer queues behind it); at the first arrival the router may send here
        (:meth:`simulator.fleet.routers.Router.surely_elsewhere`: exact, no cut); where the router cannot tell, at
        :attr:`horizon` with :attr:`cuts` (then cut by an arrival), else at the fleet's next arrival."""
        fleet, times = self.fleet, self.workload.arrival_time
        if self.waiting:
            return math.inf, False
        skip = fleet.surely_elsewhere(self.index) if BOUNDED_RUNS else None
        if skip is None and self.cuts:
            return self.env.now + self.horizon, True
        m = fleet.arrived + (skip or 0)
        return (float(times[m]) if m < len(times) else math.inf), False

    def _decode_run(self):
        return self._cut_in_place(super()._decode_run)

    def _steps_run(self, n: int) -> int:
        ran, self._cut_steps = self._cut_steps, None
        return n if ran is None else ran

    def _cut_in_place(self, plan):
        """Run the block-drawn run ``plan()`` makes (:meth:`DecodeRuns._decode_run`: its steps change the batch after
        its end) planned past the fleet's arrivals; when one is routed here while its queue is empty (:meth:`receive`),
        end it with the step during which it arrives (:attr:`DecodeRuns.planned_steps`): its first steps are the ones
        it would have planned knowing that arrival, and its draws for the steps cut off are left unused (speed
        shortcut, :data:`CUT_RUNS`; without, bounded as :meth:`_cuttable` bounds)."""
        if not CUT_RUNS:
            yield from self._cuttable(plan)
            return
        self._bound = math.inf
        steps = plan()
        event = next(steps)
        while True:
            self._pending = not self.waiting and event is self.planned_end  # a run of steps, not one step
            try:
                value = yield event
            except simpy.Interrupt as cut:
                clock, n = self.planned_steps
                ran = bisect_right(clock, cut.cause, 1)  # the step during which it arrived is the last
                if ran < n:
                    self._cut_steps = ran
                    event = self._timeout_until(clock[ran])
                continue
            self._pending = False
            try:
                event = steps.send(value)
            except StopIteration:
                return

    def _plain_run(self, stationary: bool = False):
        return self._cuttable(partial(super()._plain_run, stationary))

    def receive(self, *rids: int) -> None:
        cut = self._pending and not self.waiting  # nobody waits: the request would be admitted at the next boundary
        super().receive(*rids)
        if cut:
            self._pending = False
            self.server.interrupt(self.env.now)

    def _cuttable(self, plan):
        """Run the run of steps ``plan()`` makes, bounded by :meth:`_run_bound`; when an arrival interrupts the wait for
        the end of a run that may be cut (:meth:`receive`), rewind what planning it changed and plan it again from its
        start, bounded by that arrival (speed shortcut, :data:`CUT_RUNS`)."""
        start = self.env.now
        self._bound, cuttable = self._run_bound()
        if not cuttable:
            yield from plan()
            return
        saved = self._checkpoint()
        steps = plan()
        event = next(steps)
        while True:
            self._pending = saved is not None and event is self.planned_end  # a run of steps, not one step
            try:
                value = yield event
            except simpy.Interrupt as cut:  # (only while _pending: saved is set)
                self._restore(saved)
                steps.close()
                self._replan, self._bound = start, cut.cause
                try:
                    steps = plan()
                    event = next(steps)
                finally:
                    self._replan = None
                saved = None  # cut once: the newcomer waits now, and later ones queue behind it
                continue
            self._pending = False
            try:
                event = steps.send(value)
            except StopIteration:
                return

    def _checkpoint(self) -> tuple:
        """What planning a run of per-step steps (:meth:`DecodeRuns._plain_run`) changes before its end: the batch's
        lists (replaced, never changed in place, but each request's speculative totals: copied), the free blocks, the
        step count, the batch-size record, and the acceptance stream, the n-gram lookups' stream and an adaptive
        policy's estimates where they are used."""
        speculative, spec = self.spec.speculative, self.spec
        return (self.ctx, self.left, self.blocks, self.free_blocks, [t.copy() for t in self.totals], self.rec.num_steps,
                self.load.copy(), _attributes(self.acceptance, False) if speculative else None,
                _attributes(self._match, False) if speculative and not spec.draft_proposer else None,
                _attributes(self.policy, True) if self.plain_runs else None)

    def _restore(self, saved: tuple) -> None:
        (self.ctx, self.left, self.blocks, self.free_blocks, self.totals, self.rec.num_steps, self.load, acceptance,
         match, policy) = saved
        for obj, state in ((self.acceptance, acceptance), (self._match, match), (self.policy, policy)):
            if state is not None:
                _rewind(obj, state)


class FleetRecorder(Recorder):
    """The fleet's per-request record (global ids) and, through :meth:`replica`, one recorder per replica sharing its
    per-request arrays."""

    def __init__(self, arrival_time, prompt_tokens, output_tokens, save_steps: bool) -> None:
        super().__init__(arrival_time, prompt_tokens, output_tokens, save_steps)
        self.replicas: list[Recorder] = []

    def replica(self, keep_steps: bool = True) -> Recorder:
        """A replica's recorder (in index order): the shared per-request arrays, its own counts and, with
        ``keep_steps``, its own step rows."""
        rec = copy.copy(self)  # a Recorder sharing the per-request arrays
        rec.__class__ = Recorder
        rec.finished, rec.num_steps, rec.steps = 0, 0, [] if keep_steps else None
        del rec.replicas
        self.replicas.append(rec)
        return rec

    def gather(self) -> None:
        """Fleet counts from the replicas' after a run (and their step rows, tagged by replica, when kept)."""
        self.finished = sum(r.finished for r in self.replicas)
        self.num_steps = sum(r.num_steps for r in self.replicas)
        if self.steps is not None:
            rows = [(*row, i) for i, r in enumerate(self.replicas) for row in r.steps]
            rows.sort(key=lambda row: (row[0], row[-1]))
            self.steps = rows

    replica_of: np.ndarray | None = None
    """Replica that served each request (-1: ignored), set by the fleet."""

    def columns(self) -> dict[str, np.ndarray]:
        """:meth:`Recorder.columns` and ``replica`` (the replica that served each request; -1: ignored)."""
        columns = super().columns()
        if self.replica_of is not None:
            columns["replica"] = self.replica_of
        return columns

    def steps_frame(self):
        import pandas as pd

        return pd.DataFrame(self.steps or [], columns=STEP_COLUMNS + ["replica"])


class Fleet:
    """Replicas and a router in one environment: call :meth:`start`, then ``env.run()``."""

    def __init__(self, env: simpy.Environment, engines: Sequence[SimulatedEngine], router: Router,
                 workload: Workload, block_size: int, recorders: Sequence[Recorder]) -> None:
        self.env = env
        self.engines = list(engines)
        self.router = router
        self.workload = workload
        self.block_size = block_size
        self.recorders = list(recorders)
        self.arrived = 0
        """Requests of the workload that have arrived (routed, or ignored)."""
        n = len(workload)
        self.replica_of = np.full(n, -1, dtype=np.int64)
        """Replica that served each request (-1: ignored)."""
        self.routed = [0] * len(self.engines)
        self.live = [ReplicaState(i, 0, engine.cache) for i, engine in enumerate(self.engines)]
        """Each replica's state as routers see it, kept as requests are routed and finish."""
        self.keys = (prompt_keys(workload, block_size) if any(e.cache is not None for e in self.engines)
                     else None)
        """Request id -> its prompt's block keys (with prefix caching: the prefix-aware router reads them)."""
        unfit = [engine.unfit for engine in self.engines]
        self.unfit: set[int] = set.intersection(*unfit) if unfit else set()
        """Requests no replica can hold: ignored, routed nowhere."""
        self.fits: dict[int, list[int]] = {rid: [i for i, u in enumerate(unfit) if rid not in u]
                                           for rid in set().union(*unfit) - self.unfit}
        """Requests only some replicas can hold (a mixed fleet): the replicas that can."""
        for i, engine in enumerate(self.engines):
            if isinstance(engine, _Replica):
                engine.fleet, engine.index = self, i

    def start(self, order: Sequence[int] | None = None) -> None:
        """Start the dispatcher, then the replicas' processes in ``order`` (default: index order)."""
        self.env.process(self._dispatch())
        for i in (range(len(self.engines)) if order is None else order):
            self.engines[i].start(own_arrivals=False)

    def states(self) -> list[ReplicaState]:
        """Every replica's state as the router sees it (live: :attr:`live`)."""
        return self.live

    def surely_elsewhere(self, i: int) -> int | None:
        """How many of the next arrivals the router surely sends elsewhere than replica ``i`` (as long as its
        outstanding count does not fall; :meth:`simulator.fleet.routers.Router.surely_elsewhere`); None when it cannot tell, or
        when some requests fit only some replicas (the router then chooses among fewer)."""
        if self.fits:
            return None
        hint = getattr(self.router, "surely_elsewhere", None)
        return None if hint is None else hint(i, self.states())

    def _dispatch(self):
        env, workload, router, engines, live = self.env, self.workload, self.router, self.engines, self.live
        unfit, fits, keys, none = self.unfit, self.fits, self.keys, range(0)
        ids = workload.prompt_id_list if workload.prompt_id is not None else None
        prompts = workload.prompt_list
        for rid, t in enumerate(workload.arrival_time.tolist()):
            if t > env.now:
                yield env.timeout(t - env.now)
            self.arrived = rid + 1
            if unfit and rid in unfit:
                continue  # ignored by every replica: routed nowhere
            view = RequestView(rid, prompts[rid], None if ids is None else ids[rid],
                               none if keys is None else keys(rid))
            states = self.states()
            if fits and rid in fits:  # only some replicas can hold it: the router chooses among them
                states = [states[i] for i in fits[rid]]
            m = router.choose(view, states)
            if not 0 <= m < len(states):
                raise RuntimeError(f"router {router.name} chose replica {m} of {len(states)}")
            i = states[m].index
            self.replica_of[rid] = i
            self.routed[i] += 1
            live[i].outstanding += 1
            engines[i].arrive(rid)


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose cumulative weight reaches ``q`` of the total (NaN without weight)."""
    total = weights.sum()
    if values.size == 0 or total <= 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, q * total)])


def batch_figures(load: BatchLoad) -> dict[str, float]:
    """A replica's decode steps (:class:`BatchLoad`): their count, the running batch's mean, p50 and p90 weighted by
    step time, and the mean k per request-step (proposed tokens / the batch sizes summed over the steps)."""
    seconds = np.array(load.seconds)
    sizes = np.arange(seconds.size, dtype=float)
    total = seconds.sum()
    return {"decode_steps": load.steps,
            "mean_batch": float((sizes * seconds).sum() / total) if total > 0 else float("nan"),
            "p50_batch": _weighted_quantile(sizes, seconds, 0.5),
            "p90_batch": _weighted_quantile(sizes, seconds, 0.9),
            "mean_k": load.proposed / load.request_steps if load.request_steps else float("nan")}


def replica_rows(fleet: Fleet, columns: dict[str, np.ndarray], profiles: Sequence[str]) -> list[dict]:
    """One row per replica (:data:`REPLICA_COLUMNS`): its profile and KV blocks, requests routed and finished,
    throughput (finished requests per second over its own span, first arrival to last finish), output tokens per
    second, mean latency and TTFT (s), steps, and over its decode steps (decode and mixed) :func:`batch_figures`."""
    rows = []
    for i, (engine, rec) in enumerate(zip(fleet.engines, fleet.recorders)):
        mine = fleet.replica_of == i
        arrival, finish = columns["arrival_time"][mine], columns["finish_time"][mine]
        span = float(finish.max() - arrival.min()) if mine.any() else 0.0
        tokens = int(columns["output_tokens"][mine].sum())
        rows.append({
            "replica": i,
            "profile": Path(profiles[i]).stem,
            "num_gpu_blocks": engine.spec.num_gpu_blocks,
            "requests": fleet.routed[i],
            "finished": rec.finished,
            "throughput": rec.finished / span if span > 0 else float("nan"),
            "output_throughput": tokens / span if span > 0 else float("nan"),
            "mean_latency": float(np.mean(finish - arrival)) if mine.any() else float("nan"),
            "mean_ttft": float(np.mean(columns["first_token_time"][mine] - arrival)) if mine.any() else float("nan"),
            "steps": rec.num_steps,
            **batch_figures(engine.load),
        })
    return rows


def load_balance(counts: Sequence[int]) -> dict[str, float]:
    """``load_balance_max_mean`` (most requests on a replica / the mean; 1 = even) and ``load_balance_cv`` (population
    standard deviation / mean of the requests per replica; 0 = even)."""
    c = np.asarray(counts, dtype=float)
    mean = c.mean() if c.size else 0.0
    return {"load_balance_max_mean": float(c.max() / mean) if mean > 0 else float("nan"),
            "load_balance_cv": float(c.std() / mean) if mean > 0 else float("nan")}


def replica_parts(config: SimConfig, setup: RunSetup, step_by_step: bool,
                  cost: CostModel | None) -> list[tuple[str, CostModel, CostModel, EngineSpec]]:
    """Each replica's (profile, cost model, the policy's cost model, engine limits), in replica order: the run's own for
    identical replicas; for a mixed fleet each entry of ``replica_profiles``'s (:func:`resolve_profile`), set up as a
    run of that profile is (:func:`simulator.core.runner.setup_run`: its KV blocks from its memory)."""
    if not config.fleet.replica_profiles:
        return [(config.cost.profile, setup.cost, setup.policy_cost, setup.spec)] * config.fleet.replicas
    if cost is not None:
        raise ValueError("run_fleet: a cost model given for every replica, and replica_profiles")
    parts: dict[str, tuple[CostModel, CostModel, EngineSpec]] = {}
    out = []
    for entry in config.fleet.replica_profiles:
        path = resolve_profile(entry)
        if path not in parts:  # the policy file, already loaded, is not loaded again
            own = setup_run(config.replace(profile=path, replica_profiles=(), replicas=1, policy_file=None),
                            setup.workload, step_by_step, None, workload_checked=True)
            parts[path] = (own.cost, own.policy_cost, own.spec)
        out.append((path, *parts[path]))
    return out


def run_fleet(config: SimConfig, workload: Workload | None = None, step_by_step: bool = False,
              cost: CostModel | None = None, order: Sequence[int] | None = None,
              router: Router | None = None) -> SimResult:
    """:func:`simulator.core.runner.run_simulation` for ``config.fleet.replicas`` replicas behind
    ``config.fleet.router`` (:func:`simulator.fleet.run` calls this for ``replicas > 1``; with 1 replica it gives the
    single engine's results), over the same set-up (:func:`simulator.core.runner.setup_run`) and summary
    (:func:`~simulator.core.runner.run_summary`).
    ``order`` (tests): replica ``order[j]`` is built as the ``j``-th (its profile, its random streams) and its process
    starts ``j``-th; ``router``: use this router object instead of ``config.fleet.router``'s (tests)."""
    setup = setup_run(config, workload, step_by_step, cost)
    if config.workload.max_concurrency is not None:
        raise UserError("--max-concurrency: a client's closed loop in front of a fleet is not modelled")
    n = config.fleet.replicas
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"run_fleet: order {order} is not a permutation of the {n} replicas")
    parts = replica_parts(config, setup, step_by_step, cost)
    workload = setup.workload
    if config.fleet.router == "session" and router is None and workload.prompt_id is None:
        warn_user("--router session: the workload has no session key (no prompt_id column; Mooncake's trace has "
                  "none): every request is routed round robin")
    recorder = FleetRecorder(workload.arrival_time, workload.prompt_tokens, workload.output_tokens,
                             config.run.save_steps)
    recorders = [recorder.replica(keep_steps=config.run.save_steps) for _ in range(n)]
    env = simpy.Environment()
    times = workload.arrival_time
    horizon = n * float(times[-1] - times[0]) / (len(times) - 1) / 4 if len(times) > 1 else math.inf
    engines: list[_Replica] = [None] * n  # type: ignore[list-item]
    profiles = [""] * n
    for j, i in enumerate(order):
        profiles[i], engine_cost, policy_cost, spec = parts[j]
        accept_rng, ngram_rng = (setup.acceptance_rng, setup.ngram_rng) if j == 0 else \
            replica_streams(config.run.seed, j)
        engine = _Replica(env, spec, workload, engine_cost, setup.make_policy(config), policy_cost,
                          make_acceptance(config.speculative, accept_rng, workload), ngram_rng, recorders[i])
        if j:  # one list for the fleet: a request's tokens are counted by the one replica that serves it
            engine.generated = engines[order[0]].generated
        engine.cuts = CUT_RUNS and type(engine.acceptance) in REWINDABLE and engine.tree is None
        engine.horizon = horizon
        engines[i] = engine
    if router is None:
        router = make_router(config.fleet.router, router_stream(config.run.seed))
    fleet = Fleet(env, engines, router, workload, config.engine.block_size, recorders)
    recorder.ignored[:] = False  # each replica marked what it cannot hold; ignored: what none can
    recorder.ignored[sorted(fleet.unfit)] = True
    recorder.replica_of = fleet.replica_of
    fleet.start(order)
    setup.run(env)
    recorder.gather()
    columns = recorder.columns()
    summary = run_summary(config, setup, recorder, columns, [e.cache for e in engines if e.cache is not None])
    rows = replica_rows(fleet, columns, profiles)
    summary.update({"replicas": n, "router": config.fleet.router, **load_balance([r["requests"] for r in rows])})
    if config.fleet.replica_profiles:  # one entry per profile of the (sorted) list, whatever the replicas' labels
        methods = dict.fromkeys(profile_method(p, c.method) for p, c, _, _ in parts)
        summary.update(profile=",".join(p for p, _, _, _ in parts),
                       num_gpu_blocks=",".join(str(spec.num_gpu_blocks) for _, _, _, spec in parts),
                       profile_method="; ".join(methods))
    return SimResult(config, summary, recorder, tuple(rows))
