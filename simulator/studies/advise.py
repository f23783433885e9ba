"""``run_sim.py advise``: from a deployment and its traffic to the speculative configuration that meets an SLO, written
as the engines' flags (issue 33).

Given the deployment (profiles of one target on one GPU, one per drafter, :mod:`simulator.studies.advise_inputs`;
or ``vllm bench serve`` result files, calibrated first by the profiles side), the traffic (the workload flags of
``simulate``, a load axis of request rates or client concurrencies) and the SLO (``tune``'s syntax), it answers one
of two questions:

- the highest load that meets the SLO and the configuration that reaches it (:func:`advise`);
- with ``--target-rate R``, the fewest GPUs, as co-located replicas or a prefill:decode split
  (:mod:`simulator.studies.disagg`'s layouts), that serve R within the SLO, and the configuration (:func:`size_fleet`).

**Candidates** (:func:`candidates`): no speculation; for each drafter the deployment prices (and n-gram lookup, which
runs no draft pass): a fixed k = 1..7, token trees for draft heads (SGLang's default 5/4/8 and two others; each is
also a vLLM ``speculative_token_tree`` of the same nodes), vLLM's per-batch-size table generated here, SGLang's
adaptive tiers 1/3/7 and SmartSpec's goodput policy (in no engine: ranked, never recommended).

**The generated table** (:func:`batch_table`): for each concurrency B of :data:`TABLE_BATCHES` (at most
``max_num_seqs``) and each k of 0..7, a closed loop of B requests in flight (``vllm bench serve --request-rate inf
--max-concurrency B``, 3B requests, at least 48), at :data:`TABLE_SEEDS` seeds (the same for every k, so that the k
compare seed by seed), gives the output tokens/s in steady state (:func:`steady_throughput`: from the first request's
finish to the last one's sending, without the filling and the draining of the loop). k = 0 is the drafter configured
and never proposing, as in a table's k = 0 range (its prefill and memory still paid). Where the workload's lengths are
fixed, the closed loops draw them lognormal with sigma :data:`TABLE_LENGTH_SIGMA` around the same means
(:func:`table_base`): B requests of one length started together finish together and the loop runs in synchronized
waves of prefills and decodes, a batch no open loop of the same traffic holds. At each B, each k's deficit against the
k with the most tokens/s is taken seed by seed; a k is as good as the best where its mean deficit is within
:data:`TABLE_Z` standard errors of those paired deficits (and at least :data:`TABLE_TOLERANCE`): these short runs'
acceptance draws move a k's tokens/s by about as much as a neighbouring k differs. The k by concurrency then loses
least beyond the noise, with the fewest changes of k, then the least deficit (:func:`fewest_changes`), each change
placed at the first batch size where the new k's tokens/s, interpolated linearly in log b between the concurrencies
run, is at least the old k's (:func:`table_entries`); runs of equal k make the ranges of
``num_speculative_tokens_per_batch_size``, with ``num_speculative_tokens`` its largest k, and a table of one k is that
fixed k. In a closed loop the running batch is about B, which is what vLLM's scheduler looks the table up by. It then
runs against every fixed k (and none) over a **diurnal ramp** (:func:`ramp_check`: the workload's requests with
arrivals time-changed so that the rate follows one day's sinusoid compressed into the run,
:func:`simulator.inputs.workload.diurnal`, from 0.1 to 0.9 of no speculation's throughput at full load,
:func:`full_load`), every candidate on the same arrivals at the same :data:`RAMP_SEEDS` seeds, and the verdict says
whether its mean latency over the seeds beat every fixed k, tied (a table of one k), or not. The table is derived from
the closed loops alone; the ramp only judges it.

**Search** (:func:`search`): successive halving (Jamieson and Talwalkar, AISTATS 2016; Li et al., Hyperband, JMLR
2018) over the candidates: every candidate at every load on a short workload (1/8 of ``--num-requests``, at least 40),
the best third (at least :data:`MIN_KEEP`, and no speculation always) on 1/3 of it, those on all of it. A candidate's
score is its sustainable load (the highest load, counting up from the lowest, at which it meets the SLO without
saturating, linearly interpolated to where its SLO figure crosses the bound, :func:`simulator.studies.disagg.crossing`),
at most its throughput at full load (:func:`full_load`: a closed loop of ``max_num_seqs`` requests in flight, run once
per candidate: a run too short for its queue to build hides an overload, and short runs never fill the batch, so
without it the short rungs would favour what is best at light load), ties broken by its SLO figure averaged over the
loads, then by its mean latency averaged over them. While the leader meets the SLO at the highest rate, the last
rung adds higher ones. ``--search exhaustive`` runs every candidate on the whole workload (the test checks both choose
alike on a small space). The runs go to local worker processes or a Dask cluster (``--cluster``;
:mod:`simulator.studies.executors`).

**Robustness** (:func:`robustness`): the finalists (the best three deployable and the recommendation) run again with
every per-token acceptance x 0.8, and the answer says whether the recommendation still ranks first among them.

**Recommendation** (:func:`choose`): among the candidates the engine asked for deploys (``--engine``, default the
profiles'), those whose sustainable load is within :data:`CHOICE_TOLERANCE` of the highest, the one with the lowest
mean latency over the loads; printed first as one paragraph (with the lowest-latency choice at the lightest and the
heaviest load that meets the SLO), then the ranked table, the per-load choices, the generated tables, the ramp verdict,
the robustness, what could not be priced and why, and the paste-ready flags (``vllm serve ... --speculative-config
'{...}'``, SGLang's ``--speculative-*``; :mod:`simulator.studies.engine_flags`). Everything is also in
``advice.json``, the tables as CSV, the figures (AIConfigurator's Pareto: output tokens/s per GPU against tokens/s per
user, one colour and marker per policy) and ``report.html``.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.studies.advise_inputs import DEFAULT_KS, DEFAULT_TREES, FAMILIES, Acceptance, Identity
from simulator.studies.engine_flags import (published_name, sglang_command, sglang_flags, table_text,
                                            vllm_command, vllm_speculative_config)
from simulator.studies.specs import Slo

#: How each method is named in outputs.
METHOD_TEXT = {"draft_model": "draft model", "eagle": "EAGLE", "eagle3": "EAGLE-3", "mtp": "MTP", "ngram": "n-gram"}
#: What a profile's draft is, for each method (messages: "no profile with an eagle3 head").
DRAFT_WHAT = {"draft_model": "a draft model", "eagle": "an EAGLE head", "eagle3": "an EAGLE-3 head",
              "mtp": "an MTP head"}
#: Methods whose drafts the engines verify as trees: SGLang's EAGLE worker (EAGLE, EAGLE-3, MTP); vLLM's tree
#: attention (EAGLE, EAGLE-3).
TREE_METHODS = ("eagle", "eagle3", "mtp")
VLLM_TREE_METHODS = ("eagle", "eagle3")
#: SGLang's adaptive mode runs EAGLE-family drafts only (:mod:`policies.adaptive_tiers`).
ADAPTIVE_METHODS = ("eagle", "eagle3", "mtp")
#: K_max of the adaptive candidates: SGLang's tiers 1, 3, 7 need k = 7; SmartSpec's goodput chooses in 0..7.
ADAPTIVE_K = 7
#: Request rates tried by default, as fractions of no speculation's throughput at full load (:func:`full_load`).
LOAD_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2)
#: Concurrencies and k of the generated batch-size table.
TABLE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TABLE_KS = (0, 1, 2, 3, 4, 5, 6, 7)
#: Seeds of each closed loop of the table (the study's and the next ones; the same for every k, so that the k compare
#: seed by seed).
TABLE_SEEDS = 3
#: Sigma of the log-lengths the table's closed loops draw where the workload's lengths are fixed (module docstring).
TABLE_LENGTH_SIGMA = 0.5
#: A k is as good as the best at a concurrency when its mean deficit is within this many standard errors of the
#: seed-by-seed deficits, and never less than :data:`TABLE_TOLERANCE` (a share of the best's tokens/s).
TABLE_Z = 2.0
TABLE_TOLERANCE = 0.005
#: The fewest requests of a closed loop of the table (else three per slot, :meth:`Load.fields`).
TABLE_REQUESTS = 48
#: Successive halving: each rung's share of the requests, the share of candidates kept, the fewest kept.
RUNG_SHARES = (8, 3, 1)
MIN_RUNG_REQUESTS = 40
KEEP_SHARE = 3
MIN_KEEP = 4
#: While the leader meets the SLO at the highest request rate, the last rung adds one this much higher, at most this
#: many times (speculation can sustain more than no speculation's full-load throughput the default loads scale to).
EXTRA_LOAD_STEP = 1.25
MAX_EXTRA_LOADS = 4
#: Sustainable loads this close to the highest count as equal in the recommendation (a crossing read off runs of a
#: few hundred requests moves by about this much from seed to seed); the lowest mean latency decides among them.
CHOICE_TOLERANCE = 0.02
ROBUSTNESS = 0.8
#: A fleet's run sends each instance at least this many times ``max_num_seqs`` requests (its queue must have time to
#: build for an overload to show).
FLEET_SLOTS = 2
RAMP_AMPLITUDE = 0.8
#: Seeds every candidate of the ramp runs at (the study's and the next ones; the same day of arrivals): a single
#: run's acceptance draws move a mean latency by about 1% (measured: n-gram on Gemma-2-9B, fixed k = 6 and 7 swap
#: places from seed to seed), more than a good table gains.
RAMP_SEEDS = 3
#: The ramp's peak as a fraction of no speculation's throughput at full load (its mean is peak / (1 + amplitude)).
RAMP_PEAK = 0.9
#: The figures kept from every run.
FIGURES = ("slo_attainment", "request_goodput", "mean_latency", "p99_latency", "mean_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput", "request_throughput",
           "acceptance_rate", "saturated", "requests")


# -- drafters and candidates -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Drafter:
    """A way to propose, priced by a profile: its method, the profile, its draft's config name and its acceptance."""

    method: str
    profile: str
    draft: str | None
    acceptance: Acceptance
    tag: str = ""
    """How candidate names tell it apart: its method, or method:draft when two drafters share a method."""

    @property
    def name(self) -> str:
        return METHOD_TEXT[self.method] + (f" ({self.draft})" if self.draft else "")


@dataclass(frozen=True)
class Candidate:
    """One speculation configuration: its family, drafter (None: no speculation) and config fields."""

    spec: str
    """A policy spec naming it (``fixed-k:3``, ``tree:5-4-8``, ``vllm-batch-table``, ...): its style in figures."""
    family: str
    drafter: Drafter | None = None
    fields: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.spec if self.drafter is None else f"{self.spec} [{self.drafter.tag or self.drafter.method}]"

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines that can deploy it (``vllm``, ``sglang``; none for SmartSpec's goodput)."""
        method = self.drafter.method if self.drafter else None
        if self.family in ("no-spec", "fixed-k"):
            return ("vllm", "sglang")
        if self.family == "tree":
            return ("vllm", "sglang") if method in VLLM_TREE_METHODS else ("sglang",)
        return {"vllm-batch-table": ("vllm",), "sglang-adaptive": ("sglang",)}.get(self.family, ())

    def config(self, base: SimConfig, plain_profile: str, scale: float = 1.0) -> SimConfig:
        """``base`` running this candidate (its drafter's acceptance times ``scale``); no speculation runs on
        ``plain_profile``."""
        values: dict[str, Any] = dict(self.fields)
        if self.drafter is None:
            values.update(policy="no-spec", profile=plain_profile, speculative_method=None, proposer="draft")
        else:
            values.update(profile=self.drafter.profile, speculative_method=self.drafter.method,
                          **self.drafter.acceptance.scaled(scale).fields())
        return base.replace(**values)


def candidates(drafters: list[Drafter], families: Iterable[str], ks: Iterable[int],
               trees: Iterable[tuple[int, int, int]]) -> list[Candidate]:
    """The search space (module docstring), the generated tables left out (:func:`table_candidate` adds them)."""
    families = set(families)
    out = [Candidate("no-spec", "no-spec")]
    for d in drafters:
        if "fixed-k" in families:
            out += [fixed_k(d, k) for k in ks]
        if "tree" in families and d.method in TREE_METHODS:
            out += [Candidate(f"tree:{s}-{t}-{n}", "tree", d, (
                ("policy", "fixed-k"), ("k", n - 1), ("speculative_num_steps", s), ("speculative_eagle_topk", t),
                ("speculative_num_draft_tokens", n))) for s, t, n in trees]
        if "sglang-adaptive" in families and d.method in ADAPTIVE_METHODS:
            out.append(Candidate("sglang-adaptive", "sglang-adaptive", d,
                                 (("policy", "sglang-adaptive"), ("k", ADAPTIVE_K))))
        if "goodput" in families:
            out.append(Candidate("goodput", "goodput", d, (("policy", "goodput"), ("k", ADAPTIVE_K))))
    return out


# -- loads and runs --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """The load axis: request rates (req/s, open loop) or client concurrencies (a closed loop at rate inf)."""

    kind: str
    values: tuple[float, ...]

    @property
    def unit(self) -> str:
        return "req/s" if self.kind == "rate" else "requests in flight"

    def fields(self, value: float, requests: int) -> dict[str, Any]:
        """The workload fields of one load with ``requests`` requests (a closed loop: at least 3 per slot)."""
        if self.kind == "rate":
            return {"rate": value, "num_requests": requests, "max_concurrency": None}
        return {"rate": math.inf, "max_concurrency": int(value), "num_requests": max(requests, 3 * int(value))}


def _run_item(item: tuple[Any, SimConfig]) -> tuple[Any, dict[str, Any]]:
    """One run (a worker's job): its key and :data:`FIGURES` (and, where it keeps its steps, its
    :func:`steady_throughput`), and the warnings it printed."""
    from simulator.fleet import run
    from simulator.studies.sweep import recorded_warnings

    key, config = item
    start = time.process_time()
    with recorded_warnings(show=False) as caught:
        result = run(config)
        figures = {name: result.summary.get(name, float("nan")) for name in FIGURES}
        if config.run.save_steps:  # the table's closed loops (batch_table)
            figures["steady_throughput"] = steady_throughput(result)
    return key, {**figures, "warnings": list(caught), "cpu_seconds": time.process_time() - start}


@dataclass
class Runner:
    """Runs configs on the executor of ``workers`` / ``cluster`` (one for the whole study inside ``with``: its workers
    start once); keeps the warnings the runs printed and counts the runs."""

    workers: int
    cluster: str | None = None
    cluster_flag: str = "--cluster"
    runs: int = 0

    def __post_init__(self) -> None:
        self.warnings: dict[str, int] = {}
        self.cpu = 0.0
        """CPU seconds the runs took, wherever they ran."""
        self._executor: Any = None

    @property
    def remote(self) -> bool:
        """Whether the runs go to other processes (whose CPU this process's clock does not count)."""
        return self.cluster is not None or self.workers > 1

    def __enter__(self) -> "Runner":
        from simulator.studies.executors import make_executor

        self._executor = make_executor(self.workers, self.cluster, self.cluster_flag).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._executor.__exit__(*exc)
        self._executor = None

    def __call__(self, items: list[tuple[Any, SimConfig]]) -> dict[Any, dict[str, Any]]:
        if self._executor is None:
            with self:
                return self(items)
        done = dict(self._executor.map_unordered(_run_item, items))
        self.runs += len(items)
        for figures in done.values():
            self.cpu += figures.pop("cpu_seconds")
            for message in figures.pop("warnings"):
                self.warnings[message] = self.warnings.get(message, 0) + 1
        return done


@dataclass(frozen=True)
class Study:
    """What every stage shares: the base config (workload, engine, SLO bounds), the profile no speculation runs on,
    the load axis, the SLO and the runner."""

    base: SimConfig
    plain_profile: str
    load: Load
    slo: Slo
    requests: int
    run: Runner

    def evaluate(self, cands: list[Candidate], requests: int, scale: float = 1.0,
                 values: Iterable[float] | None = None) -> pd.DataFrame:
        """Every candidate at every load (or ``values``) with ``requests`` requests: one row per run."""
        values = list(self.load.values if values is None else values)
        items = [((c.name, v), replace_load(c.config(self.base, self.plain_profile, scale), self.load, v, requests))
                 for c in cands for v in values]
        done = self.run(items)
        by_name = {c.name: c for c in cands}
        return pd.DataFrame([{"candidate": name, "load": v, "family": by_name[name].family,
                              "method": by_name[name].drafter.method if by_name[name].drafter else "none",
                              "style": by_name[name].spec, **done[(name, v)]} for name, v in (k for k, _ in items)])


def replace_load(config: SimConfig, load: Load, value: float, requests: int) -> SimConfig:
    return config.replace(**load.fields(value, requests))


# -- scoring ---------------------------------------------------------------------------------------------------
def _oriented(slo: Slo, values: Iterable[float], saturated: Iterable[bool]) -> list[float]:
    """The SLO figure made "higher is better" (a ``<=`` bound negated); a saturated or missing figure as a miss that
    nothing interpolates into."""
    sign = -1.0 if slo.op in ("<=", "<") else 1.0
    return [-1e300 if (sat or not math.isfinite(v)) else sign * v for v, sat in zip(values, saturated)]


def score(runs: pd.DataFrame, slo: Slo, caps: dict[str, float] | None = None) -> pd.DataFrame:
    """Per candidate: its sustainable load (module docstring), at most its ``caps`` entry (its throughput at full
    load, :func:`full_load`), and how it was found, its SLO figure averaged over the loads, its mean TPOT at the
    lightest load and its output tokens/s at the sustainable load; best first (ties in name order)."""
    from simulator.studies.disagg import crossing

    sign = -1.0 if slo.op in ("<=", "<") else 1.0
    rows = []
    for name, group in runs.groupby("candidate", sort=True):
        group = group.sort_values("load")
        values, sat = group[slo.metric].tolist(), group["saturated"].astype(bool).tolist()
        met = [slo.met(v) and not s for v, s in zip(values, sat)]
        sustained, found = crossing(group["load"].tolist(), _oriented(slo, values, sat), sign * slo.bound)
        if caps is not None and sustained > caps[name]:
            sustained, found = caps[name], "full-load throughput"
        meeting = group.loc[met]
        rows.append({"candidate": name, "family": group["family"].iloc[0], "method": group["method"].iloc[0],
                     "sustainable_load": sustained, "found": found,
                     f"mean_{slo.metric}": float(pd.Series(values).mean()),
                     "mean_latency": float(group["mean_latency"].mean()),
                     "tpot_ms_lightest": float(group["mean_tpot_ms"].iloc[0]),
                     "output_throughput_at_sustained": float(meeting["output_throughput"].max()) if len(meeting)
                     else float("nan")})
    table = pd.DataFrame(rows)
    tie = f"mean_{slo.metric}"
    return table.sort_values(["sustainable_load", tie, "mean_latency", "candidate"],
                             ascending=[False, slo.op in ("<=", "<"), True, True]).reset_index(drop=True)


def rung_sizes(requests: int) -> list[int]:
    """The workload of each rung of successive halving: 1/8, 1/3 and all of ``requests`` (at least
    :data:`MIN_RUNG_REQUESTS`), increasing."""
    sizes = sorted({min(requests, max(MIN_RUNG_REQUESTS, requests // share)) for share in RUNG_SHARES})
    return sizes


def search(study: Study, cands: list[Candidate], exhaustive: bool = False,
           log: Callable[[str], None] = lambda _: None) -> tuple[pd.DataFrame, pd.DataFrame, tuple[float, ...]]:
    """Successive halving (or every candidate on the whole workload): (the ranking, best first, with the rung each
    candidate reached; every run, with its rung; the loads, raised by up to :data:`MAX_EXTRA_LOADS` steps of
    :data:`EXTRA_LOAD_STEP` while the leader meets the SLO at the top one)."""
    sizes = [study.requests] if exhaustive else rung_sizes(study.requests)
    alive, frames = list(cands), []
    caps = full_load(study, cands) if study.load.kind == "rate" else None
    by_name = {c.name: c for c in cands}
    ranks: list[pd.DataFrame] = []
    for rung, size in enumerate(sizes):
        last = rung == len(sizes) - 1
        log(f"rung {rung + 1}/{len(sizes)}: {len(alive)} candidates x {len(study.load.values)} loads, {size} requests")
        runs = study.evaluate(alive, size).assign(rung=rung + 1, requests_asked=size)
        frames.append(runs)
        ranked = score(runs, study.slo, caps).assign(rung=rung + 1)
        ranks.append(ranked)
        if last:
            break
        keep = max(MIN_KEEP, math.ceil(len(alive) / KEEP_SHARE))
        kept = set(ranked["candidate"].head(keep)) | {"no-spec"}
        alive = [c for c in alive if c.name in kept]
    values = list(study.load.values)
    while study.load.kind == "rate" and ranks[-1]["found"].iloc[0] == "at least" and len(values) < \
            len(study.load.values) + MAX_EXTRA_LOADS:  # the leader meets the SLO everywhere: raise the top load
        values.append(float(f"{values[-1] * EXTRA_LOAD_STEP:.3g}"))
        log(f"the leader meets the SLO at every load: adding {values[-1]:g} {study.load.unit}")
        more = study.evaluate(alive, sizes[-1], values=values[-1:]).assign(rung=len(sizes), requests_asked=sizes[-1])
        frames.append(more)
        runs = pd.concat([runs, more], ignore_index=True)
        ranks[-1] = score(runs, study.slo, caps).assign(rung=len(sizes))
    final = ranks[-1]
    earlier = [r[~r["candidate"].isin(final["candidate"])] for r in reversed(ranks[:-1])]
    table = pd.concat([final, *earlier]).drop_duplicates("candidate", keep="first").reset_index(drop=True)
    table.insert(1, "engines", table["candidate"].map(lambda n: ",".join(by_name[n].engines) or "none"))
    return table, pd.concat(frames, ignore_index=True), tuple(values)


# -- the generated batch-size table ----------------------------------------------------------------------------
def fixed_k(drafter: Drafter, k: int) -> Candidate:
    """The drafter at one k for every request and step: ``fixed-k:k``, or for k = 0 vLLM's table at 0 everywhere (the
    drafter configured and never proposing, as in a table's k = 0 range: its prefill and memory are paid, which no
    speculation does not pay)."""
    if k:
        return Candidate(f"fixed-k:{k}", "fixed-k", drafter, (("policy", "fixed-k"), ("k", k)))
    return Candidate("vllm-batch-table", "vllm-batch-table", drafter, (
        ("policy", "vllm-batch-table"), ("k", 1), ("policy_params", (("table", "1:0"),))))


def table_base(base: SimConfig) -> SimConfig:
    """``base`` with the lengths of the table's closed loops: the workload's, but fixed lengths drawn lognormal with
    sigma :data:`TABLE_LENGTH_SIGMA` around medians that keep their means (a closed loop of fixed lengths runs in
    synchronized waves, module docstring)."""
    workload = base.workload
    if workload.arrival == "trace" or workload.length_dist != "fixed":
        return base
    shrink = math.exp(-TABLE_LENGTH_SIGMA ** 2 / 2)  # a lognormal's mean is its median times exp(sigma^2 / 2)
    return base.replace(length_dist="lognormal", length_sigma=TABLE_LENGTH_SIGMA,
                        prompt_len=max(1, round(workload.prompt_len * shrink)),
                        output_len=max(1, round(workload.output_len * shrink)))


def steady_throughput(result: Any) -> float:
    """A closed loop's output tokens/s in steady state: the tokens its decode steps emitted over the seconds of all its
    steps from the first request's finish (every slot filled once) to the last request's sending (then the loop
    drains and the batch shrinks); the whole run's output tokens/s where that window holds no step."""
    steps, requests = result.steps, result.requests
    start, end = requests["finish_time"].min(), requests["arrival_time"].max()
    inside = steps[(steps["start_time"] >= start) & (steps["start_time"] < end)]
    seconds = float(inside["seconds"].sum())
    return float(inside["emitted"].sum()) / seconds if seconds > 0 else float(result.summary["output_throughput"])


def batch_table(study: Study, drafter: Drafter, ks: Iterable[int] = TABLE_KS,
                batches: Iterable[int] = TABLE_BATCHES) -> tuple[pd.DataFrame, list[tuple[int, int]]]:
    """Every k at every concurrency, :data:`TABLE_SEEDS` seeds each (module docstring): the measurements
    (:func:`table_entries`' frame, one row per concurrency and k) and the table's entries (start, k)."""
    limit = study.base.engine.max_num_seqs
    batches = [b for b in batches if b <= limit] or [limit]
    concurrency = Load("concurrency", tuple(float(b) for b in batches))
    base = table_base(study.base)
    seeds = [study.base.run.seed + i for i in range(TABLE_SEEDS)]
    items = [((k, b, seed), replace_load(fixed_k(drafter, k).config(base, drafter.profile), concurrency, b,
                                         TABLE_REQUESTS).replace(seed=seed, save_steps=True))
             for k in ks for b in batches for seed in seeds]
    done = study.run(items)
    runs = pd.DataFrame([{"batch": b, "k": k, "seed": seed, **done[(k, b, seed)]} for (k, b, seed), _ in items])
    table, entries = table_entries(runs, limit)
    table.insert(0, "method", drafter.method)
    return table, entries


def table_entries(runs: pd.DataFrame, max_batch: int) -> tuple[pd.DataFrame, list[tuple[int, int]]]:
    """vLLM's table from closed-loop runs (``batch``, ``k``, ``seed``, ``steady_throughput``; every k run with the
    same seeds), by the rule of the module docstring: at each concurrency, each k's deficit against the best k (the
    highest mean), seed by seed, and its noise (:data:`TABLE_Z` standard errors of those paired deficits, at least
    :data:`TABLE_TOLERANCE`); at every batch size b from 1 to the largest concurrency run, each k's mean tokens/s and
    noise interpolated linearly in log b between the concurrencies run, its deficit against the best there and its
    excess (the deficit beyond the noise); the k of each b that, over all of them, loses least beyond the noise, with
    the fewest changes of k, then the least deficit (:func:`fewest_changes`). Between two concurrencies where two k
    are each as good as the best, a third that is better than both in between (their curves crossing below it) takes
    the range between. Returns one row per concurrency run and k (``steady_throughput`` the mean over the seeds,
    ``deficit`` and ``noise`` as shares, ``as_good``, ``best``: the k chosen there) and the entries (start, k) up to
    ``max_batch``, equal k merged (the last extends to ``max_batch``)."""
    import numpy as np

    grid = runs.pivot_table(index=["batch", "seed"], columns="k", values="steady_throughput")
    mean = grid.groupby(level="batch").mean()
    batches, ks = [int(b) for b in mean.index], [int(k) for k in mean.columns]
    noise = pd.DataFrame(index=mean.index, columns=mean.columns, dtype=float)
    for b in batches:
        per_seed = grid.loc[b]
        shares = 1.0 - per_seed.div(per_seed[per_seed.mean().idxmax()], axis=0)  # paired: each seed against the best
        stderr = shares.std(ddof=1) / math.sqrt(len(shares)) if len(shares) > 1 else shares.iloc[0] * 0.0
        noise.loc[b] = (TABLE_Z * stderr).clip(lower=TABLE_TOLERANCE)
    logs = np.log(np.array(batches, dtype=float))
    sizes = np.arange(1, batches[-1] + 1)
    curves = np.array([np.interp(np.log(sizes), logs, mean[k].to_numpy(float)) for k in ks])  # k x b
    noises = np.array([np.interp(np.log(sizes), logs, noise[k].to_numpy(float)) for k in ks])
    shortfall = 1.0 - curves / curves.max(axis=0)
    deficit = {(int(b), k): float(shortfall[i, j]) for i, k in enumerate(ks) for j, b in enumerate(sizes)}
    excess = {(int(b), k): max(0.0, float(shortfall[i, j] - noises[i, j])) for i, k in enumerate(ks)
              for j, b in enumerate(sizes)}
    path = dict(zip((int(b) for b in sizes), fewest_changes([int(b) for b in sizes], ks, excess, deficit)))
    rows = [{"batch": b, "k": k, "seeds": int(grid.loc[b].shape[0]), "steady_throughput": float(mean.loc[b, k]),
             "deficit": deficit[b, k], "noise": float(noise.loc[b, k]), "as_good": excess[b, k] == 0.0,
             "best": path[b] == k} for b in batches for k in ks]
    entries = [(b, k) for b, k in path.items() if b == 1 or path[b - 1] != k]
    return pd.DataFrame(rows), [(start, k) for start, k in entries if start <= max_batch]


def fewest_changes(batches: list[int], ks: list[int], excess: dict[tuple[int, int], float],
                   deficit: dict[tuple[int, int], float]) -> list[int]:
    """The k of each of ``batches`` (ascending) that minimises, in order, the summed ``excess`` (each k's deficit
    beyond the noise), the number of changes of k from one batch to the next and the summed ``deficit``: dynamic
    programming over the batches. Nothing forces k to fall with the batch: it does for dense targets, whose
    verification costs more at a larger batch, not necessarily for a mixture of experts, whose small batches pay for
    experts a large batch loads anyway."""
    best = {k: ((excess[batches[0], k], 0, deficit[batches[0], k]), [k]) for k in ks}
    for b in batches[1:]:
        best = {k: min(((cost[0] + excess[b, k], cost[1] + (before != k), cost[2] + deficit[b, k]), path + [k])
                       for before, (cost, path) in best.items()) for k in ks}
    return min(best.values())[1]


def table_candidate(drafter: Drafter, entries: list[tuple[int, int]], max_batch: int) -> Candidate | None:
    """vLLM's table of ``entries`` (start, k) as a candidate: the fixed k itself when the table has one k (it is that
    fixed k), None when it never speculates."""
    if max(k for _, k in entries) == 0:
        return None
    if len(entries) == 1:
        return fixed_k(drafter, entries[0][1])
    ranges = [(start, (entries[i + 1][0] - 1) if i + 1 < len(entries) else max(max_batch, start), k)
              for i, (start, k) in enumerate(entries)]
    return Candidate("vllm-batch-table", "vllm-batch-table", drafter, (
        ("policy", "vllm-batch-table"), ("k", max(k for _, k in entries)), ("policy_params", (("table", table_text(
            ranges)),))))


def table_words(table: Candidate, max_batch: int) -> str:
    """A generated table as the answer writes it: its ranges (batch-size range: k), and, for one k, that it is that
    fixed k."""
    fields = dict(table.fields)
    if table.family == "fixed-k":
        return f"1-{max_batch}:{fields['k']} (one k at every batch size: {table.spec})"
    return str(dict(fields["policy_params"])["table"])


def ramp_check(study: Study, table: Candidate, capacity: float, requests: int, out: Path) -> tuple[pd.DataFrame, str]:
    """The generated ``table`` against every fixed k of its drafter and no speculation over the diurnal ramp (module
    docstring) of ``requests`` requests, each at :data:`RAMP_SEEDS` seeds (the same for every candidate); the runs
    and the verdict on the mean latencies over the seeds: the table beats every fixed k (a lower mean latency than
    the best of them), ties (as low: a table of one k is that fixed k), or does not; and whether no speculation is
    faster still (a table cannot be no speculation: its k = 0 keeps the drafter)."""
    drafter = table.drafter
    assert drafter is not None
    trace = out / "diurnal_trace.csv"
    write_ramp(study.base, capacity, requests, trace)
    fixed = [fixed_k(drafter, k) for k in DEFAULT_KS]
    cands = ([] if table in fixed else [table]) + fixed + [Candidate("no-spec", "no-spec")]
    ramp = {"arrival": "trace", "trace": str(trace), "rate": None, "num_requests": None, "max_concurrency": None,
            "trace_speedup": None}
    seeds = [study.base.run.seed + i for i in range(RAMP_SEEDS)]
    items = [((c.name, seed), c.config(study.base, drafter.profile).replace(seed=seed, **ramp))
             for c in cands for seed in seeds]
    done = study.run(items)
    runs = pd.DataFrame([{"candidate": name, "seed": seed, "method": drafter.method, **done[name, seed]}
                         for (name, seed), _ in items])
    latency = runs.groupby("candidate")["mean_latency"].mean().to_dict()
    mine = latency[table.name]
    best = min((c.name for c in fixed if c != table), key=lambda name: (latency[name], name))
    against = (f"mean latency {mine:.3f} s (over {len(seeds)} seeds), the best other fixed k {best} "
               f"{latency[best]:.3f} s")
    if table in fixed:
        what = f"the generated table is {table.spec} (one k is within the noise of the best at every batch size)"
        verdict = (f"{what}: it ties the best fixed k on the diurnal ramp, being it" if mine <= latency[best] else
                   f"{what}: it does NOT beat every fixed k on the diurnal ramp")
    elif mine < latency[best]:
        verdict = "the generated table beats every fixed k on the diurnal ramp"
    elif mine == latency[best]:
        verdict = "the generated table ties the best fixed k on the diurnal ramp"
    else:
        verdict = "the generated table does NOT beat every fixed k on the diurnal ramp"
    plain = latency["no-spec"]
    versus = (f"no speculation {plain:.3f} s" if plain >= mine else f"but no speculation is faster still, {plain:.3f} "
              "s (a table's k = 0 keeps the drafter and its prefill)")
    return runs, f"{drafter.name}: {verdict}: {against}; {versus}"


def write_ramp(base: SimConfig, capacity: float, requests: int, path: Path) -> None:
    """The diurnal ramp's requests (module docstring) as a plain trace at ``path``."""
    from simulator.core.runner import random_streams
    from simulator.inputs.workload import build_workload, diurnal
    from simulator.results import atomic_write

    mean = RAMP_PEAK * capacity / (1 + RAMP_AMPLITUDE)
    workload = base.workload
    rescale = {"rate": mean, "num_requests": requests, "max_concurrency": None}
    if workload.arrival != "trace":
        rescale["arrival"] = "poisson"
    config = base.replace(**rescale).workload
    streams = random_streams(base.run.seed)
    frame = diurnal(build_workload(config, streams[0], streams[1]), RAMP_AMPLITUDE).to_frame()
    atomic_write(path, lambda f: frame.to_csv(f, index=False))


def full_load(study: Study, cands: list[Candidate], scale: float = 1.0) -> dict[str, float]:
    """Each candidate's throughput at full load (req/s): a closed loop of ``max_num_seqs`` requests in flight, three
    times as many requests sent at once (a trace rescaled to 1e6 req/s). No open loop sustains more, however well a
    run too short for its queue to build meets the SLO, so it caps the sustainable rate (:func:`score`); no
    speculation's scales the default loads."""
    slots = study.base.engine.max_num_seqs
    burst = {"rate": 1e6 if study.base.workload.arrival == "trace" else math.inf, "max_concurrency": slots,
             "num_requests": max(study.requests, 3 * slots)}
    done = study.run([(c.name, c.config(study.base, study.plain_profile, scale).replace(**burst)) for c in cands])
    return {name: float(figures["request_throughput"]) for name, figures in done.items()}


# -- the answer ------------------------------------------------------------------------------------------------
def robustness(study: Study, table: pd.DataFrame, cands: dict[str, Candidate], chosen: str,
               engine: str) -> tuple[pd.DataFrame, str]:
    """The finalists (best three deployable on ``engine`` and ``chosen``) with acceptance x 0.8, against no
    speculation: their ranking and whether :func:`choose` still picks ``chosen`` among them."""
    best = [n for n in finalists(table)["candidate"] if engine in cands[n].engines and n != "no-spec"][:3]
    names = list(dict.fromkeys([chosen, *best, "no-spec"]))
    picked = [cands[n] for n in names]
    runs = study.evaluate(picked, study.requests, scale=ROBUSTNESS)
    caps = full_load(study, picked, ROBUSTNESS) if study.load.kind == "rate" else None
    ranked = score(runs, study.slo, caps).assign(rung=1)
    now = choose(ranked, cands, engine)
    mine, top = (ranked.loc[ranked["candidate"] == n].iloc[0] for n in (chosen, now))
    if now == chosen:
        verdict = (f"at {ROBUSTNESS:g}x acceptance the recommendation holds: {chosen} is still the choice among the "
                   f"finalists, sustaining {mine['sustainable_load']:.3g} {study.load.unit}")
    else:
        verdict = (f"at {ROBUSTNESS:g}x acceptance the recommendation changes to {now} ({top['sustainable_load']:.3g} "
                   f"{study.load.unit}); {chosen} sustains {mine['sustainable_load']:.3g}")
    return ranked, verdict


def per_load(runs: pd.DataFrame, slo: Slo) -> pd.DataFrame:
    """At each load of the last rung, among the candidates run there that meet the SLO (all of them where none does):
    the one with the lowest mean latency, and the static one (no speculation or a fixed k) with the lowest."""
    last = runs[runs["rung"] == runs["rung"].max()]
    rows = []
    for load, group in last.groupby("load"):
        ok = group[[slo.met(v) and not s for v, s in zip(group[slo.metric], group["saturated"].astype(bool))]]
        pool = ok if len(ok) else group
        static = pool[pool["family"].isin(("no-spec", "fixed-k"))]
        best = pool.sort_values(["mean_latency", "candidate"]).iloc[0]
        plain = group[group["family"] == "no-spec"]
        row = {"load": load, "meets_slo": bool(len(ok)), "best": best["candidate"],
               "best_mean_latency": best["mean_latency"]}
        if len(static):
            s = static.sort_values(["mean_latency", "candidate"]).iloc[0]
            row.update(best_static=s["candidate"], static_mean_latency=s["mean_latency"])
        if len(plain):
            row["no_spec_mean_latency"] = float(plain["mean_latency"].iloc[0])
        rows.append(row)
    return pd.DataFrame(rows)


def settings(c: Candidate, study: Study, target: Identity) -> dict[str, Any]:
    """The paste-ready flags of ``c``: vLLM's ``--speculative-config`` and command, SGLang's flags and command (None
    where the engine has no such setting)."""
    from simulator.inputs.acceptance import tree_family

    config = c.config(study.base, study.plain_profile)
    fields = config.flat()
    draft = c.drafter.draft if c.drafter else None
    if c.family == "tree":
        fields["speculative_token_tree"] = str(tree_family(config.speculative).full)
    vllm = vllm_speculative_config(fields, draft, study.base.engine.max_num_seqs) if c.drafter else None
    if c.family == "tree" and "vllm" not in c.engines:
        vllm = None
    sglang = sglang_flags(fields, draft) if c.drafter else []
    served = published_name(target.target) or target.target
    return {"vllm_speculative_config": vllm,
            "vllm_command": vllm_command(served, target.tp, vllm) if (vllm or not c.drafter) else None,
            "sglang_flags": sglang,
            "sglang_command": sglang_command(served, target.tp, sglang, c.drafter is not None)}


def unpriced(drafters: list[Drafter], target: Identity, notes: list[str]) -> list[str]:
    """What could not be priced, and why."""
    have = {d.method for d in drafters}
    out = [f"{METHOD_TEXT[m]}: no profile with {DRAFT_WHAT[m]} for {target.describe()} ({target.engine_text}) in the "
           "given profiles' folders or profiles/data" for m in DRAFT_WHAT if m not in have]
    if any(d.method in ("draft_model", "ngram") for d in drafters):
        out.append("token trees: not tried for a draft model or n-gram lookup (the engines verify trees of "
                   "EAGLE-family heads)")
    return out + notes


# -- fewest GPUs for a target rate -----------------------------------------------------------------------------
def _fleet_runs(study: Study, c: Candidate, layouts: list[Any], rate: float, scale: float = 1.0) -> dict[str, dict]:
    """Each layout (:class:`simulator.studies.disagg.Layout`) serving ``rate`` with candidate ``c`` (on the decode
    instances of a split), its requests the workload's times its instances."""
    items = []
    per_instance = max(study.requests, FLEET_SLOTS * study.base.engine.max_num_seqs)
    for layout in layouts:
        instances = layout.gpus // layout.tp
        config = layout.config(c.config(study.base, study.plain_profile, scale))
        items.append((layout.name, config.replace(rate=rate, num_requests=per_instance * instances,
                                                  max_concurrency=None)))
    return study.run(items)


def _meets(slo: Slo, figures: dict[str, Any]) -> bool:
    return slo.met(figures[slo.metric]) and not figures["saturated"]


def size_fleet(study: Study, ranked: pd.DataFrame, cands: dict[str, Candidate], engine: str, rate: float,
               tp: int, log: Callable[[str], None] = lambda _: None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The fewest GPUs serving ``rate`` within the SLO (module docstring): for no speculation and the best three
    candidates deployable on ``engine``, co-located replicas from rate / sustainable rate up or down until the fewest
    that meet it; then, for the best of them, every prefill:decode split of fewer instances, as long as one meets it.
    Every layout tried (a row each) and the answer."""
    from simulator.studies.disagg import Layout

    final = finalists(ranked)
    sustained = dict(zip(final["candidate"], final["sustainable_load"]))
    tried_names = ["no-spec"] + [n for n in final["candidate"] if engine in cands[n].engines and n != "no-spec"][:3]
    rows, best = [], {}
    for name in tried_names:
        per = sustained.get(name, 0.0)
        if not per > 0:
            continue
        n = max(1, math.ceil(rate / per))
        tried: dict[int, bool] = {}
        while n not in tried and 1 <= n <= 4 * max(1, math.ceil(rate / per)) + 4:
            layout = Layout(0, 0, n * tp, tp)
            figures = _fleet_runs(study, cands[name], [layout], rate)[layout.name]
            tried[n] = _meets(study.slo, figures)
            rows.append({"candidate": name, "layout": f"{n} co-located", "gpus": n * tp, "meets_slo": tried[n],
                         **figures})
            n = n - 1 if tried[n] else n + 1
        met = [m for m, ok in tried.items() if ok]
        if met:
            best[name] = min(met)
        log(f"{name}: {min(met) * tp if met else 'no'} GPUs co-located")
    if not best:
        return pd.DataFrame(rows), {"found": False}
    order = {n: i for i, n in enumerate(tried_names)}
    chosen = min((n for n in best if n != "no-spec"), key=lambda n: (best[n], order[n]), default="no-spec")
    if best.get("no-spec", math.inf) < best.get(chosen, math.inf):
        chosen = "no-spec"
    answer = {"found": True, "candidate": chosen, "layout": f"{best[chosen]} co-located replicas",
              "gpus": best[chosen] * tp, "no_spec_gpus": best["no-spec"] * tp if "no-spec" in best else None}
    instances = best[chosen] - 1
    while instances >= 2:
        splits = [Layout(p, instances - p, instances * tp, tp) for p in range(1, instances)]
        done = _fleet_runs(study, cands[chosen], splits, rate)
        ok = [layout for layout in splits if _meets(study.slo, done[layout.name])]
        rows += [{"candidate": chosen, "layout": layout.name, "gpus": layout.gpus, "meets_slo": layout in ok,
                  **done[layout.name]} for layout in splits]
        if not ok:
            break
        answer.update(layout=f"{ok[0].name} (prefill:decode instances)", gpus=ok[0].gpus)
        instances -= 1
    return pd.DataFrame(rows), answer


# -- the command -----------------------------------------------------------------------------------------------
@dataclass
class Request:
    """What the command line asked (:func:`command` builds it)."""

    profiles: list[str]
    slo: Slo
    load: Load | None
    """None: request rates scaled to no speculation's throughput at full load (:data:`LOAD_FRACTIONS`)."""
    target_rate: float | None
    engine: str | None
    acceptance: Any
    families: tuple[str, ...] = FAMILIES
    methods: tuple[str, ...] | None = None
    ks: tuple[int, ...] = DEFAULT_KS
    trees: tuple[tuple[int, int, int], ...] = DEFAULT_TREES
    exhaustive: bool = False
    discover: bool = True
    ramp_requests: int = 600
    workers: int = 1
    cluster: str | None = None
    cluster_flag: str = "--cluster"
    quiet: bool = False


def drafters_of(request: Request, target: Identity, found: list[Identity]) -> list[Drafter]:
    """One drafter per profile found, and n-gram lookup on the first where none prices it (a profile without a
    drafter); ``--methods`` keeps those it names."""
    from simulator.studies import advise_inputs

    pairs = [(i.method, i.path, i.draft) for i in found]
    if not any(m == "ngram" for m, _, _ in pairs):
        pairs.append(("ngram", request.profiles[0], None))
    if request.methods is not None:
        unknown = set(request.methods) - {m for m, _, _ in pairs}
        if unknown:
            raise UserError(f"--methods: no profile prices {', '.join(sorted(unknown))} for {target.describe()} "
                            f"(priced: {', '.join(dict.fromkeys(m for m, _, _ in pairs))})")
        pairs = [p for p in pairs if p[0] in request.methods]
    acceptance = advise_inputs.resolve(dict.fromkeys(m for m, _, _ in pairs), target.target, request.acceptance)
    shared = {m for m, _, _ in pairs if sum(1 for p in pairs if p[0] == m) > 1}
    return [Drafter(m, path, draft, acceptance[m], f"{m}:{draft}" if m in shared else m) for m, path, draft in pairs]


#: What a study writes into its folder (an older study's are removed before it starts: the folder holds one study's
#: files, or visibly none of ``advice.json``).
OUTPUTS = ("advice.json", "report.html", "ranking.csv", "runs.csv", "per_load.csv", "batch_tables.csv", "ramp.csv",
           "robustness.csv", "fleet.csv", "diurnal_trace.csv", "pareto.png", "batch_tables.png", "slo_vs_load.png")


def advise(base: SimConfig, request: Request, out: Path,
           log: Callable[[str], None] = print) -> tuple[dict[str, Any], pd.DataFrame]:
    """The whole study into ``out`` (its older outputs removed first); returns the advice (what ``advice.json``
    holds) and the ranking."""
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    from simulator.studies import advise_inputs

    with Runner(request.workers, request.cluster, request.cluster_flag) as runner:
        return _advise(base, request, out, runner, log)


def _advise(base: SimConfig, request: Request, out: Path, runner: Runner,
            log: Callable[[str], None]) -> tuple[dict[str, Any], pd.DataFrame]:
    from simulator.studies import advise_inputs

    wall, cpu = time.perf_counter(), time.process_time()
    given = advise_inputs.deployment_of(request.profiles)
    found, notes = advise_inputs.discover(given, [advise_inputs.DATA]) if request.discover else (given, [])
    target = given[0]
    drafters = drafters_of(request, target, found)
    engine = request.engine or (target.engine if target.engine in ("vllm", "sglang") else "vllm")
    if request.slo.goodput_slo:
        base = base.replace(goodput_slo=request.slo.goodput_slo)
    load = request.load or Load("rate", (1.0,))
    study = Study(base, request.profiles[0], load, request.slo, base.workload.num_requests or 400, runner)
    burst = full_load(study, [Candidate("no-spec", "no-spec")])["no-spec"]
    if request.load is None:
        study = replace(study, load=Load("rate", tuple(float(f"{f * burst:.3g}") for f in LOAD_FRACTIONS)))
    log(f"advise: {target.describe()}, engine {target.engine_text}; drafters: "
        f"{', '.join(d.name for d in drafters)}; no speculation's throughput at full load {burst:.3g} req/s")
    tables, table_runs = {}, []
    limit = base.engine.max_num_seqs
    if "vllm-batch-table" in request.families:
        for d in drafters:
            runs, entries = batch_table(study, d)
            table_runs.append(runs)
            c = table_candidate(d, entries, limit)
            if c is not None:
                tables[d.tag] = c
            log(f"{d.name}: generated table {table_words(c, limit) if c else 'never speculates'}")
    cands = candidates(drafters, request.families, request.ks, request.trees)
    cands += [c for c in dict.fromkeys(tables.values()) if c not in cands]  # a table of one k is a fixed k already
    by_name = {c.name: c for c in cands}
    ranked, runs, values = search(study, cands, request.exhaustive, log)
    study = replace(study, load=Load(study.load.kind, values))
    chosen = choose(ranked, by_name, engine)
    robust_table, robust = robustness(study, ranked, by_name, chosen, engine)
    ramps, ramp_verdicts = [], []
    for c in tables.values():
        frame, verdict = ramp_check(study, c, burst, request.ramp_requests, out)
        ramps.append(frame)
        ramp_verdicts.append(verdict)
    fleet = fleet_answer = None
    if request.target_rate is not None:
        fleet, fleet_answer = size_fleet(study, ranked, by_name, engine, request.target_rate, target.tp, log)
    advice = {
        "question": "fewest GPUs" if request.target_rate is not None else "highest load",
        "deployment": {"target": target.target, "gpu": target.gpu, "tensor_parallel": target.tp,
                       "engine": target.engine, "engine_version": target.engine_version,
                       "engine_text": target.engine_text, "profiles": [i.path for i in found]},
        "engine": engine, "slo": str(request.slo), "load_unit": study.load.unit,
        "loads": list(study.load.values), "no_spec_full_load_throughput": burst,
        "acceptance": {d.tag: d.acceptance.label for d in drafters},
        "chosen": chosen, "chosen_row": _record(ranked[ranked["candidate"] == chosen].iloc[0]),
        "no_spec_row": _record(ranked[ranked["candidate"] == "no-spec"].iloc[0]),
        "settings": settings(by_name[chosen], study, target),
        "robustness": robust, "ramp": ramp_verdicts,
        "tables": {tag: table_words(c, limit) for tag, c in tables.items()},
        "unpriced": unpriced(drafters, target, notes),
        "target_rate": request.target_rate, "fleet": fleet_answer,
    }
    advice["by_engine"] = {}
    for other in ("vllm", "sglang"):
        name = choose(ranked, by_name, other)
        advice["by_engine"][other] = {"candidate": name, "settings": settings(by_name[name], study, target)}
    if fleet_answer and fleet_answer.get("found"):
        advice["fleet_settings"] = settings(by_name[fleet_answer["candidate"]], study, target)
    loads = per_load(runs, request.slo)
    advice["per_load"] = [_record(row) for _, row in loads.iterrows()]
    advice["search"] = {"candidates": len(cands), "runs": runner.runs, "rungs": rung_sizes(study.requests)
                        if not request.exhaustive else [study.requests], "workers": request.workers,
                        "cluster": request.cluster, "wall_seconds": time.perf_counter() - wall,
                        "cpu_seconds": time.process_time() - cpu + (runner.cpu if runner.remote else 0.0),
                        "cpu_note": "this process and the runs, wherever they ran (not the workers' start-up)"}
    advice["warnings"] = [f"{m} (in {n} runs)" for m, n in runner.warnings.items()]
    advice["paragraph"] = paragraph(advice, by_name)
    write_outputs(out, advice, ranked, runs, loads, pd.concat(table_runs) if table_runs else None,
                  pd.concat(ramps) if ramps else None, robust_table, fleet, drafters, study, by_name)
    return advice, ranked


def finalists(ranked: pd.DataFrame) -> pd.DataFrame:
    """The candidates run on the whole workload (the last rung), best first; the others were scored on shorter ones."""
    return ranked[ranked["rung"] == ranked["rung"].max()]


def choose(ranked: pd.DataFrame, cands: dict[str, Candidate], engine: str) -> str:
    """The recommendation on ``engine``: of the finalists it deploys whose sustainable load is within
    :data:`CHOICE_TOLERANCE` of the highest among them, the one with the lowest mean latency over the loads."""
    final = finalists(ranked)
    deployable = final[[engine in cands[n].engines for n in final["candidate"]]]
    top = float(deployable["sustainable_load"].max())
    near = deployable[deployable["sustainable_load"] >= (1 - CHOICE_TOLERANCE) * top]
    return str(near.sort_values(["mean_latency", "candidate"])["candidate"].iloc[0])


def _record(row: pd.Series) -> dict[str, Any]:
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}


def paragraph(advice: dict[str, Any], cands: dict[str, Candidate]) -> str:
    """The recommendation: one paragraph, a number and a configuration first."""
    c = cands[advice["chosen"]]
    row, plain = advice["chosen_row"], advice["no_spec_row"]
    unit = advice["load_unit"]
    what = "no speculation" if c.drafter is None else f"{c.drafter.name}, {describe(c)}"
    if advice["question"] == "fewest GPUs":
        fleet = advice["fleet"] or {}
        if not fleet.get("found"):
            return (f"No configuration tried serves {advice['target_rate']:g} req/s within {advice['slo']} on "
                    f"{advice['deployment']['target']} ({advice['engine']}): none sustains any load of the grid.")
        fc = cands[fleet["candidate"]]
        fwhat = "no speculation" if fc.drafter is None else f"{fc.drafter.name}, {describe(fc)}"
        head = (f"{fleet['gpus']} GPUs serve {advice['target_rate']:g} req/s within {advice['slo']}: "
                f"{fleet['layout']} of {advice['deployment']['target']} on {advice['deployment']['gpu']} with "
                f"{fwhat}")
        plain_gpus = fleet.get("no_spec_gpus")
        head += (f"; no speculation needs {plain_gpus}." if plain_gpus else "; no speculation meets it with none of "
                 "the fleets tried.")
    else:
        sustained = row["sustainable_load"]
        if sustained <= 0:
            return (f"Nothing tried meets {advice['slo']} at the lightest load ({advice['loads'][0]:g} {unit}) on "
                    f"{advice['deployment']['target']}: loosen the SLO or lower the loads.")
        ratio = sustained / plain["sustainable_load"] if plain["sustainable_load"] > 0 else math.inf
        top = " (at least: it meets the SLO at every load tried)" if row["found"] == "at least" else ""
        head = (f"{sustained:.3g} {unit}{top} within {advice['slo']} on {advice['deployment']['target']} "
                f"({advice['deployment']['tensor_parallel']} x {advice['deployment']['gpu']}, {advice['engine']}): "
                f"{what}; no speculation sustains {plain['sustainable_load']:.3g} ({ratio:.2f}x).")
    loads = advice.get("per_load") or []
    if advice["question"] != "fewest GPUs" and loads:
        light, heavy = loads[0], [r for r in loads if r["meets_slo"]][-1:] or loads[-1:]
        head += (f" Lowest mean latency by load: at {light['load']:g} {unit} {light['best']} "
                 f"({light['best_mean_latency']:.3g} s; no speculation {light['no_spec_mean_latency']:.3g} s), at "
                 f"{heavy[0]['load']:g} {unit} {heavy[0]['best']} ({heavy[0]['best_mean_latency']:.3g} s; no "
                 f"speculation {heavy[0]['no_spec_mean_latency']:.3g} s).")
    acc = "" if c.drafter is None else f" Acceptance: {c.drafter.acceptance.label}."
    return f"{head}{acc} {advice['robustness'][0].upper()}{advice['robustness'][1:]}. Priced with profiles of " \
           f"{advice['deployment']['engine_text']}."


def describe(c: Candidate) -> str:
    """A candidate's configuration in words."""
    fields = dict(c.fields)
    if c.family == "fixed-k":
        return f"k = {fields['k']}"
    if c.family == "tree":
        return (f"tree of {fields['k']} nodes (SGLang {fields['speculative_num_steps']} steps, top-"
                f"{fields['speculative_eagle_topk']}, {fields['speculative_num_draft_tokens']} draft tokens)")
    if c.family == "vllm-batch-table":
        return f"vLLM's per-batch-size table {fields['policy_params'][0][1]} (batch-size range: k)"
    if c.family == "sglang-adaptive":
        return "SGLang's adaptive tiers 1/3/7"
    return f"SmartSpec's goodput policy up to k = {fields.get('k')} (in no engine)"


# -- outputs ---------------------------------------------------------------------------------------------------
def write_outputs(out: Path, advice: dict[str, Any], ranked: pd.DataFrame, runs: pd.DataFrame, loads: pd.DataFrame,
                  table_runs: pd.DataFrame | None, ramps: pd.DataFrame | None, robust: pd.DataFrame,
                  fleet: pd.DataFrame | None, drafters: list[Drafter], study: Study,
                  cands: dict[str, Candidate]) -> None:
    """The tables (CSV), the figures, ``advice.json`` and ``report.html`` into ``out``."""
    from simulator.results import write_csv, write_json
    from simulator.studies import plots, report, tune

    tables = {"ranking.csv": ranked, "runs.csv": runs, "per_load.csv": loads, "batch_tables.csv": table_runs,
              "ramp.csv": ramps, "robustness.csv": robust, "fleet.csv": fleet}
    for name, frame in tables.items():
        if frame is not None:
            write_csv(out / name, frame)
    tp = advice["deployment"]["tensor_parallel"]
    last = runs[runs["rung"] == runs["rung"].max()]
    deepest = runs[runs["rung"] == runs.groupby("candidate")["rung"].transform("max")]
    points = []
    for d in drafters:
        part = deepest[deepest["candidate"].map(lambda n: cands[n].drafter is None or cands[n].drafter == d)]
        points.append(part.assign(panel=d.name))
    frame = pd.concat(points, ignore_index=True)
    frame = frame.assign(series=frame["candidate"], per_user=1e3 / frame["mean_tpot_ms"],
                         per_gpu=frame["output_throughput"] / tp)
    figures = [plots.plot_pareto(frame, out / "pareto.png", f"{advice['deployment']['target']} on {tp} x "
                                 f"{advice['deployment']['gpu']}: every candidate at every load (on the longest "
                                 "workload it reached)")]
    if table_runs is not None:
        figures.append(plots.plot_batch_tables(table_runs, out / "batch_tables.png"))
    slo = study.slo
    tradeoff = ranked.rename(columns={"candidate": "policy", "sustainable_load": "sustainable_rate"}).assign(
        meets_slo_everywhere=lambda t: t["found"] == "at least")
    lightest = last[last["load"] == last["load"].min()].set_index("candidate")[slo.metric]
    tradeoff[f"{slo.metric}_at_lightest"] = tradeoff["policy"].map(lightest)
    tradeoff = tradeoff.dropna(subset=[f"{slo.metric}_at_lightest"])
    first = tradeoff["policy"] == advice["chosen"]  # the figure rings its first row: the recommendation
    tradeoff = pd.concat([tradeoff[first], tradeoff[~first]], ignore_index=True)
    figures.append(tune.plot_tradeoff(tradeoff, slo, out / "slo_vs_load.png",
                                      last.rename(columns={"candidate": "policy", "load": "rate"}),
                                      list(study.load.values)))
    advice["files"] = {"tables": [str(out / n) for n, f in tables.items() if f is not None],
                       "figures": figures, "report": str(out / report.REPORT_NAME), "advice": str(out / "advice.json")}
    sections: list[tuple[str, Any]] = [
        ("Recommendation", advice["paragraph"]),
        ("Paste-ready configuration", "\n".join(command_lines(advice))),
        ("Candidates, best first (ranking.csv)", ranked),
        ("The best choice at each load (per_load.csv)", loads),
        ("Acceptance used", pd.DataFrame([{"drafter": t, "acceptance": a} for t, a in advice["acceptance"].items()])),
        (f"Robustness: acceptance x {ROBUSTNESS:g} (robustness.csv)", [advice["robustness"], robust]),
    ]
    if advice["tables"]:
        sections.append(("Generated per-batch-size tables and the diurnal ramp (batch_tables.csv, ramp.csv)",
                         ["\n".join(f"{t}: {v}" for t, v in advice["tables"].items()), "\n".join(advice["ramp"]),
                          ramps]))
    if fleet is not None:
        sections.append(("Fewest GPUs (fleet.csv)", [str(advice["fleet"]), fleet]))
    sections += [("Could not price", "\n".join(advice["unpriced"]) or "everything asked was priced"),
                 ("Search", advice["search"]), ("Figures", [Path(f) for f in figures])]
    report.write_report(out / report.REPORT_NAME, f"advise: {advice['slo']} on {advice['deployment']['target']}",
                        sections, advice["warnings"], study.base.to_dict(flat=True),
                        [report.profile_info(p) for p in advice["deployment"]["profiles"]])
    write_json(out / "advice.json", advice)  # last: a folder with advice.json holds a whole study


def command_lines(advice: dict[str, Any]) -> list[str]:
    """The recommendation's command for each engine, or, where the engine has no such setting, its own best's."""
    flags, out = advice["settings"], []
    for engine, key, label in (("vllm", "vllm_command", "vLLM"), ("sglang", "sglang_command", "SGLang")):
        if flags[key]:
            out.append(f"{label}: {flags[key]}")
        else:
            other = advice["by_engine"][engine]
            out.append(f"{label}: has no such setting; its best here is {other['candidate']}: "
                       f"{other['settings'][key]}")
    return out


def print_advice(advice: dict[str, Any], ranked: pd.DataFrame | None = None) -> None:
    """The answer on stdout: the recommendation first, then the rest (module docstring)."""
    print(advice["paragraph"])
    print()
    for line in command_lines(advice):
        print(line)
    if advice.get("fleet_settings"):
        print(f"fleet configuration (vLLM): {advice['fleet_settings']['vllm_command']}")
    if ranked is not None:
        last = ranked["rung"].max()
        final = ranked[ranked["rung"] == last]
        print()
        print(f"candidates on the whole workload, best first (sustainable load in {advice['load_unit']}; mean TPOT at "
              "the lightest load in ms):")
        shown = final[["candidate", "engines", "sustainable_load", "found", "tpot_ms_lightest"]]
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        for rung in range(last - 1, 0, -1):
            out = ranked.loc[ranked["rung"] == rung, "candidate"]
            if len(out):
                print(f"left at rung {rung} (short workload): {', '.join(out)}")
    print()
    for line in [*advice["ramp"], *(f"generated table {t}: {v}" for t, v in advice["tables"].items())]:
        print(line)
    print("acceptance:")
    for tag, label in advice["acceptance"].items():
        print(f"  {tag}: {label}")
    if advice["unpriced"]:
        print("not priced:")
        for line in advice["unpriced"]:
            print(f"  {line}")
    s = advice["search"]
    print(f"search: {s['candidates']} candidates, {s['runs']} runs (rungs of {', '.join(map(str, s['rungs']))} "
          f"requests) in {s['wall_seconds']:.1f} s wall, {s['cpu_seconds']:.1f} CPU s ({s['cpu_note']}) on "
          f"{s['cluster'] or str(s['workers']) + ' local workers'}")
    for message in advice["warnings"]:
        print(f"warning: {message}", file=sys.stderr)
    files = advice["files"]
    print(f"advice: {files['advice']}\nreport: {files['report']}")
