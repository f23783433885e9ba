"""A fleet: N replicas of the simulated engine behind a router, in one SimPy environment (issue 24, item 1).

- **Replicas.** ``config.replicas`` identical :class:`simulator.core.engine.SimulatedEngine` s, each with its own
  scheduler, KV cache (its own prefix cache with ``enable_prefix_caching``) and its own policy object (an adaptive
  policy learns from its replica's steps only), all serving one workload with global request ids. They share the
  run's acceptance model (its per-request state is keyed by request id) and its n-gram stream.
- **Dispatcher.** One SimPy process replays the workload's arrivals; at each it asks the router
  (:mod:`simulator.fleet.routers`, a view of the request and each replica's outstanding count and prefix cache) and
  hands the request to that replica (:meth:`SimulatedEngine.receive`, the engine's fleet hook). Requests that can
  never fit in a replica's KV cache are ignored, as one engine ignores them, and routed nowhere.
- **Runs of steps (speed).** A replica's runs of decode steps (:mod:`simulator.core.runs`) are bounded by the next
  arrival of the *whole fleet* (any arrival may be routed to it): each replica reads the fleet's arrival count as its
  own ``arrived``. Exact (a run cut early gives the same steps), but with many replicas every replica's runs are cut
  at every fleet arrival, so the runs get shorter as replicas are added: N replicas at N times the rate take about
  N times the events of one. Not optimised (issue 24, item 4).
- **Per-replica figures.** Each replica has its own recorder over the shared per-request arrays and keeps its own
  steps (for its batch-size distribution, weighted by step time, and its mean k): the runs that only count steps
  (goodput's plain runs, n-gram's step runs) are off in a fleet, and the steps take memory.
- **Order of replicas.** Ties in every router go to the lowest index, and the replicas' processes start in index
  order, so a run is reproducible; identical replicas permuted (the router seeing them in another order, the
  processes started in that order) give the same fleet figures (tests/test_fleet.py).

Not modelled here: a mixed fleet (a list of profiles), a front end or a client's ``max_concurrency`` in front of a
fleet, disaggregated prefill and decode.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import simpy

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.core.engine import SimulatedEngine
from simulator.core.prefix_cache import block_hashes
from simulator.core.runner import SimResult, run_summary, setup_run
from simulator.costs.cost_model import CostModel
from simulator.fleet.routers import ReplicaState, RequestView, Router, make_router
from simulator.inputs.acceptance import make_acceptance
from simulator.inputs.workload import Workload
from simulator.metrics import STEP_COLUMNS, Recorder

#: Per-replica table columns (``replicas.csv``).
REPLICA_COLUMNS = ["replica", "requests", "finished", "throughput", "output_throughput", "mean_latency", "mean_ttft",
                   "steps", "decode_steps", "mean_batch", "p50_batch", "p90_batch", "mean_k"]


def router_stream(seed: int) -> np.random.Generator:
    """The router's generator: the fifth child of the run's ``SeedSequence`` (the first four, the run's arrivals,
    lengths, acceptance and n-gram streams, are :func:`simulator.core.runner.random_streams`, unchanged)."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(5)[4])


class _Replica(SimulatedEngine):
    """An engine of a fleet: its ``arrived`` is the fleet's count of arrived requests (the fleet hook of
    :meth:`SimulatedEngine.start`), so its runs stop at the next fleet arrival and it ends after the fleet's last."""

    fleet: Fleet

    @property
    def arrived(self) -> int:
        return self.fleet.arrived

    @arrived.setter
    def arrived(self, value: int) -> None:  # the engine's own count (its __init__'s 0): the fleet keeps it
        pass


class FleetRecorder(Recorder):
    """The fleet's per-request record (global ids) and, through :meth:`replica`, one recorder per replica sharing its
    per-request arrays and keeping that replica's steps."""

    def __init__(self, arrival_time, prompt_tokens, output_tokens, save_steps: bool) -> None:
        super().__init__(arrival_time, prompt_tokens, output_tokens, save_steps)
        self.replicas: list[Recorder] = []

    def replica(self) -> Recorder:
        rec = copy.copy(self)  # a Recorder sharing the per-request arrays
        rec.__class__ = Recorder
        rec.finished, rec.num_steps, rec.steps = 0, 0, []
        del rec.replicas
        self.replicas.append(rec)
        return rec

    def gather(self) -> None:
        """Fleet counts from the replicas' after a run."""
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
        for engine in self.engines:
            if isinstance(engine, _Replica):
                engine.fleet = self

    def start(self, order: Sequence[int] | None = None) -> None:
        """Start the dispatcher, then the replicas' processes in ``order`` (default: index order)."""
        self.env.process(self._dispatch())
        for i in (range(len(self.engines)) if order is None else order):
            self.engines[i].start(own_arrivals=False)

    def states(self) -> list[ReplicaState]:
        return [ReplicaState(i, self.routed[i] - rec.finished, engine.cache)
                for i, (engine, rec) in enumerate(zip(self.engines, self.recorders))]

    def _dispatch(self):
        env, workload = self.env, self.workload
        unfit = self.engines[0].unfit
        has_ids = workload.prompt_id is not None
        ids = workload.prompt_ids().tolist()
        prompts = workload.prompt_tokens.tolist()
        for rid, t in enumerate(workload.arrival_time.tolist()):
            if t > env.now:
                yield env.timeout(t - env.now)
            self.arrived = rid + 1
            if unfit and rid in unfit:
                continue  # ignored by every replica (identical KV caches): routed nowhere
            view = RequestView(rid, prompts[rid], ids[rid] if has_ids else None,
                               block_hashes(ids[rid], prompts[rid], self.block_size))
            i = self.router.choose(view, self.states())
            if not 0 <= i < len(self.engines):
                raise RuntimeError(f"router {self.router.name} chose replica {i} of {len(self.engines)}")
            self.replica_of[rid] = i
            self.routed[i] += 1
            self.engines[i].receive(rid)


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose cumulative weight reaches ``q`` of the total (NaN without weight)."""
    total = weights.sum()
    if values.size == 0 or total <= 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, q * total)])


def replica_rows(fleet: Fleet, columns: dict[str, np.ndarray]) -> list[dict]:
    """One row per replica (:data:`REPLICA_COLUMNS`): requests routed and finished, throughput (finished requests per
    second over its own span, first arrival to last finish), output tokens per second, mean latency and TTFT (s),
    steps, and over its decode steps (decode and mixed) the running batch's mean, p50 and p90 weighted by step time,
    and the mean k per request-step."""
    rows = []
    for i, rec in enumerate(fleet.recorders):
        mine = fleet.replica_of == i
        arrival, finish = columns["arrival_time"][mine], columns["finish_time"][mine]
        span = float(finish.max() - arrival.min()) if mine.any() else 0.0
        tokens = int(columns["output_tokens"][mine].sum())
        decode = [s for s in rec.steps if s[2] != "prefill"]
        seconds = np.array([s[1] for s in decode], dtype=float)
        batch = np.array([s[3] for s in decode], dtype=float)
        proposed = np.array([s[6] for s in decode], dtype=float)
        rows.append({
            "replica": i,
            "requests": fleet.routed[i],
            "finished": rec.finished,
            "throughput": rec.finished / span if span > 0 else float("nan"),
            "output_throughput": tokens / span if span > 0 else float("nan"),
            "mean_latency": float(np.mean(finish - arrival)) if mine.any() else float("nan"),
            "mean_ttft": float(np.mean(columns["first_token_time"][mine] - arrival)) if mine.any() else float("nan"),
            "steps": rec.num_steps,
            "decode_steps": len(decode),
            "mean_batch": float((batch * seconds).sum() / seconds.sum()) if seconds.sum() > 0 else float("nan"),
            "p50_batch": _weighted_quantile(batch, seconds, 0.5),
            "p90_batch": _weighted_quantile(batch, seconds, 0.9),
            "mean_k": float(proposed.sum() / batch.sum()) if batch.sum() > 0 else float("nan"),
        })
    return rows


def load_balance(counts: Sequence[int]) -> dict[str, float]:
    """``load_balance_max_mean`` (most requests on a replica / the mean; 1 = even) and ``load_balance_cv`` (population
    standard deviation / mean of the requests per replica; 0 = even)."""
    c = np.asarray(counts, dtype=float)
    mean = c.mean() if c.size else 0.0
    return {"load_balance_max_mean": float(c.max() / mean) if mean > 0 else float("nan"),
            "load_balance_cv": float(c.std() / mean) if mean > 0 else float("nan")}


def run_fleet(config: SimConfig, workload: Workload | None = None, step_by_step: bool = False,
              cost: CostModel | None = None, order: Sequence[int] | None = None,
              router: Router | None = None) -> SimResult:
    """:func:`simulator.core.runner.run_simulation` for ``config.replicas`` replicas behind ``config.router``
    (:func:`simulator.fleet.run` calls this for ``replicas > 1``; with 1 replica it gives the single engine's results),
    over the same set-up (:func:`simulator.core.runner.setup_run`) and summary (:func:`~simulator.core.runner.run_summary`).
    ``order``: the replicas' processes start in this order; ``router``: use this router object instead of
    ``config.router``'s (both for tests)."""
    setup = setup_run(config, workload, step_by_step, cost)
    if config.max_concurrency is not None:
        raise UserError("--max-concurrency: a client's closed loop in front of a fleet is not modelled")
    if setup.cost.frontend_time() > 0:
        raise UserError(f"--profile {config.profile}: a front end (frontend seconds per request) in front of a fleet "
                        "is not modelled (--replicas > 1)")
    workload = setup.workload
    recorder = FleetRecorder(workload.arrival_time, workload.prompt_tokens, workload.output_tokens, config.save_steps)
    env = simpy.Environment()
    acceptance = make_acceptance(config, setup.acceptance_rng)
    engines = [_Replica(env, setup.spec, workload, setup.cost, setup.make_policy(config), setup.policy_cost,
                        acceptance, setup.ngram_rng, recorder.replica()) for _ in range(config.replicas)]
    if router is None:
        router = make_router(config.router, router_stream(config.seed))
    fleet = Fleet(env, engines, router, workload, config.block_size, recorder.replicas)
    recorder.replica_of = fleet.replica_of
    fleet.start(order)
    setup.run(env)
    recorder.gather()
    columns = recorder.columns()
    summary = run_summary(config, setup, recorder, columns, [e.cache for e in engines if e.cache is not None])
    rows = replica_rows(fleet, columns)
    summary.update({"replicas": config.replicas, "router": config.router,
                    **load_balance([r["requests"] for r in rows])})
    return SimResult(config, summary, recorder, tuple(rows))
