"""One simulation run: build every part from a :class:`SimConfig`, run SimPy, collect the results.

Random streams: one ``numpy.random.SeedSequence(config.run.seed)`` spawns, in this fixed order, the
generators for arrivals, lengths, acceptance and the n-gram lookup, so adding a stream never shifts
the others and the same config gives the same results bit for bit. A fleet's router (``replicas > 1``) draws from a
fifth child (:func:`simulator.fleet.fleet.router_stream`), which leaves these four unchanged.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from policies import protocol
from policies.base import Policy
from policies.registry import load_policy_file, make_policy
from simulator.inputs.acceptance import make_acceptance, tree_family
from simulator.config import EngineConfig, SimConfig, config_hash, flag
from simulator.costs.cost_model import CostModel, check_draft_method, load_cost_model, probing
from simulator.core.engine import EngineSpec, SimulatedEngine
from policies.errors import UserError, warn_user
from simulator.core.memory import kv_layout, num_gpu_blocks
from simulator.costs.cuda_graphs import with_cuda_graphs
from simulator.core.prefix_cache import CacheStats
from simulator.core.user_policy import Watch, guarded
from simulator.metrics import SUMMARY_KEYS, Recorder, summarize  # noqa: F401 - SUMMARY_KEYS re-exported
from simulator.results import atomic_write, write_csv, write_json
from simulator.inputs.workload import Workload, build_workload

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd


@dataclass(frozen=True)
class SimResult:
    """What one run produced: the summary, and per-request and per-step tables (pandas DataFrames, made on
    first use: a caller that needs only the summary, such as a sweep's cell, never imports pandas)."""

    config: SimConfig
    summary: dict[str, Any]
    recorder: Recorder
    replica_rows: tuple[dict[str, Any], ...] = ()
    """A fleet's per-replica figures (:func:`simulator.fleet.fleet.replica_rows`); empty for one engine."""

    @functools.cached_property
    def replicas(self) -> pd.DataFrame | None:
        """One row per replica of a fleet (``config.fleet.replicas`` > 1), ``None`` for one engine."""
        if not self.replica_rows:
            return None
        import pandas as pd

        return pd.DataFrame(list(self.replica_rows))

    @functools.cached_property
    def requests(self) -> pd.DataFrame:
        """One row per request (:data:`simulator.metrics.REQUEST_COLUMNS` and the derived ones)."""
        return self.recorder.requests_frame()

    @functools.cached_property
    def steps(self) -> pd.DataFrame | None:
        """One row per engine step, ``None`` unless the config's ``save_steps``."""
        return self.recorder.steps_frame() if self.config.run.save_steps else None


def is_speculative(config: SimConfig) -> bool:
    """Whether the policy may ever propose tokens (then the draft model's memory and prefill count)."""
    return protocol.is_speculative(config.speculative.policy, config.speculative.k)


def profile_method(path: str, method: str) -> str:
    """How the profile's seconds were obtained, for summaries and figures: the cost model's method, but
    ``unknown`` for a profile CSV without its metadata file (nothing says it was measured)."""
    p = Path(path)
    if p.suffix.lower() == ".csv" and not p.with_name(p.stem + ".meta.json").is_file():
        return "unknown"
    return method


#: Longest a single step may be predicted to take, seconds (more means broken coefficients, e.g. 1e308).
MAX_STEP_SECONDS = 1e6


def check_costs(config: SimConfig, cost: Any, flag: str, speculative: bool) -> None:
    """Refuse a cost model whose steps cannot be simulated: a decode step of a single request that takes no time
    (all-zero coefficients: the clock would never advance), or a step at the config's largest shape that is not
    finite, negative or longer than :data:`MAX_STEP_SECONDS` (coefficients such as 1e308)."""
    from policies.step_time import predict_step_seconds

    draft = speculative and config.speculative.proposer == "draft" and cost.has("draft", "decode")
    k = config.speculative.k if speculative else 0
    batch = min(config.engine.max_num_seqs, 1024)
    longest = min(config.workload.max_prompt_len + config.workload.max_output_len, 10 ** 7)
    with probing():  # probing past a measured grid is not the run's own extrapolation
        probes = {
            "a decode step of one request": predict_step_seconds(cost, [1], [0], False),
            f"a decode step of {batch} requests of {longest} tokens with k={k}":
                predict_step_seconds(cost, [longest] * batch, [k] * batch, draft),
            f"a prefill of {config.engine.max_num_batched_tokens} tokens":
                cost.prefill_time(1, config.engine.max_num_batched_tokens),
            "a prefill of 1 token": cost.prefill_time(1, 1),
        }
    for what, seconds in probes.items():
        if not (math.isfinite(seconds) and 0 <= seconds <= MAX_STEP_SECONDS):
            raise UserError(f"{flag} {cost.path}: predicts {seconds:g} s for {what}; a step must take a finite time "
                            f"in [0, {MAX_STEP_SECONDS:g}] s (check the coefficients)")
    if not probes["a decode step of one request"] > 0:
        raise UserError(f"{flag} {cost.path}: predicts 0 s for a decode step of one request (all-zero "
                        "coefficients?); simulated time would never advance")


def random_streams(seed: int) -> list[np.random.Generator]:
    """The run's generators of arrivals, lengths, acceptance and the n-gram lookup (module docstring). The real
    engine's timing twin draws from a run's acceptance stream to meet the same draws (common random numbers)."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)]


@dataclass
class RunSetup:
    """What one run needs before its engines exist, shared by one engine (:func:`run_simulation`) and a fleet
    (:func:`simulator.fleet.fleet.run_fleet`): the workload, the cost models (CUDA-graph padded as configured), the
    engine's limits, the random streams of acceptance and the n-gram lookup, and a user policy file's guard."""

    workload: Workload
    cost: CostModel
    policy_cost: CostModel
    spec: EngineSpec
    acceptance_rng: np.random.Generator
    ngram_rng: np.random.Generator
    watch: Watch | None
    """The guard of ``config.speculative.policy_file`` (None without one): its calls are timed and its errors one
    line."""
    user_names: tuple[str, ...]
    """The policies ``config.speculative.policy_file`` registered."""
    wall: float
    """``time.perf_counter()`` when the run began."""

    def make_policy(self, config: SimConfig) -> Policy:
        """A fresh policy object of ``config`` (guarded when a user file defines it)."""
        spec = config.speculative
        if self.watch is not None and spec.policy in self.user_names:
            with self.watch.armed():
                return guarded(spec.policy_file, lambda: make_policy(spec.policy, spec.k, dict(spec.policy_params)),
                               self.watch)
        return make_policy(spec.policy, spec.k, dict(spec.policy_params))

    def run(self, env: simpy.Environment) -> None:
        """Run ``env`` to its end, with a user policy's calls guarded."""
        if self.watch is not None:
            with self.watch.armed():
                env.run()
        else:
            env.run()


def _flagged(cost: CostModel, flag: str) -> CostModel:
    """``cost``, its warnings naming ``flag`` (:attr:`CostModel.flag`)."""
    cost.flag = flag
    return cost


#: The simulator's default token budget of a step (``EngineConfig.max_num_batched_tokens``).
DEFAULT_BUDGET = EngineConfig.max_num_batched_tokens


def check_prefill_budget(config: SimConfig, workload: Workload, built: bool = True) -> None:
    """Refuse prefill-first with a chosen token budget below the workload's longest prompt; at the default budget,
    warn.

    Prefill-first (vLLM v0 without chunked prefill) prefills each prompt whole in one step of at most
    ``max_num_batched_tokens`` tokens; a longer prompt would be admitted alone, over the budget, as no vLLM runs: vLLM
    v0 refuses ``max_num_batched_tokens < max_model_len`` without chunked prefill (``SchedulerConfig._verify_args``,
    vllm/config.py, a ValueError). The workload's longest prompt stands for ``max_model_len`` here: the longest of a
    trace or of the lengths drawn (a lognormal or a length file's, clipped at ``max_prompt_len``), or ``prompt_len``.
    The message names the flag, its value, the longest prompt and where it comes from (``built``: the workload was
    built from ``config``'s workload fields; else it was given, as a calibration's or a replay's).

    A budget of the simulator's default (:data:`DEFAULT_BUDGET`) is not refused: it was likely never chosen, and the
    shipped traces' longest prompts exceed it (Azure's conversation trace holds a 4,107-token prompt in its first
    200 requests), so the run goes on, admitting such a prompt alone as before, and warns in one line
    (:class:`policies.errors.InputWarning`). Any other budget is a choice, a user's or a calibrated profile's
    (``calibration.settings``), and a choice vLLM would refuse is refused."""
    engine, w = config.engine, config.workload
    if engine.scheduler != "prefill-first" or not len(workload):
        return
    longest = int(workload.prompt_tokens.max())
    if longest <= engine.max_num_batched_tokens:
        return
    clip = ""
    if w.arrival == "trace" or not built:
        where = f"of {workload.source}"
    elif w.length_dist == "fixed":
        where = f"--prompt-len {w.prompt_len}"
    else:
        where = f"drawn from the {w.length_dist} lengths, which --max-prompt-len {w.max_prompt_len} clips"
        clip = f", or --max-prompt-len {engine.max_num_batched_tokens}"
    default = engine.max_num_batched_tokens == DEFAULT_BUDGET
    message = (f"{flag('max_num_batched_tokens')} {engine.max_num_batched_tokens}{' (the default)' if default else ''}: "
               f"below the longest prompt, {longest} tokens ({where}); prefill-first (vLLM v0 without chunked "
               f"prefill) {'admits' if default else 'would admit'} it alone over its budget, where vLLM refuses "
               f"max_num_batched_tokens < max_model_len: give --scheduler chunked-prefill, or "
               f"--max-num-batched-tokens {longest} or more{clip}")
    if not default:
        raise UserError(message)
    warn_user(message)


def setup_run(config: SimConfig, workload: Workload | None, step_by_step: bool, cost: CostModel | None, *,
              workload_checked: bool = False) -> RunSetup:
    """The :class:`RunSetup` of ``config`` (:func:`run_simulation`'s arguments), its inputs checked
    (``workload_checked``: the workload against the engine's budget already, by the run this one is a replica of)."""
    wall = time.perf_counter()
    arrival_rng, length_rng, acceptance_rng, ngram_rng = random_streams(config.run.seed)
    built = workload is None
    if built:
        workload = build_workload(config.workload, arrival_rng, length_rng)
    if not workload_checked:
        check_prefill_budget(config, workload, built)
    cost = with_cuda_graphs(load_cost_model(config.cost.profile, config.cost.fitter) if cost is None else cost,
                            config.engine.cuda_graph_sizes)
    policy_cost = cost if config.cost.policy_profile is None else with_cuda_graphs(
        _flagged(load_cost_model(config.cost.policy_profile, config.cost.fitter), "--policy-profile"),
        config.engine.cuda_graph_sizes)
    speculative = is_speculative(config)
    if speculative and config.speculative.proposer == "draft" and not cost.has("draft", "decode"):
        raise UserError(f"--profile {config.cost.profile}: has no draft decode costs; a draft-model proposer needs "
                        "them (use --proposer ngram or a profile with a draft)")
    if speculative:
        check_draft_method(config.speculative.proposer_method, cost, "--profile")
    check_costs(config, cost, "--profile", speculative)
    if config.cost.policy_profile is not None:
        check_costs(config, policy_cost, "--policy-profile", speculative)
    watch, user_names = None, ()
    if config.speculative.policy_file is not None:
        watch = Watch(config.speculative.policy_file)
        with watch.armed():
            user_names = tuple(watch.call("importing it", load_policy_file, config.speculative.policy_file))
    family = tree_family(config.speculative)
    spec = EngineSpec(
        max_num_seqs=config.engine.max_num_seqs,
        max_num_batched_tokens=config.engine.max_num_batched_tokens,
        block_size=config.engine.block_size,
        num_gpu_blocks=num_gpu_blocks(config, cost, speculative),
        kv=kv_layout(config, cost, speculative),
        chunked_prefill=config.engine.scheduler == "chunked-prefill",
        max_k=config.speculative.k,
        draft_proposer=config.speculative.proposer == "draft",
        ngram_match_prob=config.speculative.ngram_match_prob,
        speculative=speculative,
        strict_fit=config.engine.strict_fit,
        scheduler_steps=config.engine.num_scheduler_steps,
        max_concurrency=config.workload.max_concurrency,
        prefix_caching=config.engine.enable_prefix_caching,
        tree=None if family is None or family.is_chain else family,  # a chain tree runs today's chain path
        **({"run_steps": 1} if step_by_step else {}),
    )
    return RunSetup(workload, cost, policy_cost, spec, acceptance_rng, ngram_rng, watch, user_names, wall)


def run_summary(config: SimConfig, setup: RunSetup, recorder: Recorder, columns: dict[str, np.ndarray],
                caches: list) -> dict[str, Any]:
    """The summary of a finished run: :func:`summarize` of its ``columns`` and the run's own keys
    (:data:`SUMMARY_KEYS`), with the prefix caches' statistics summed (``caches``: the engines' caches)."""
    ignored = np.flatnonzero(recorder.ignored)
    if recorder.finished + ignored.size != len(setup.workload):
        raise RuntimeError(f"{len(setup.workload) - recorder.finished - ignored.size} requests never finished")
    summary = summarize(columns, recorder.acceptance_length(), dict(config.run.goodput_slo))
    summary.update({
        "ignored_requests": int(ignored.size),
        "ignored_request_ids": ignored.tolist(),
        "policy": config.speculative.policy,
        "k": config.speculative.k,
        "profile": config.cost.profile,
        "profile_method": profile_method(config.cost.profile, setup.cost.method),
        "num_gpu_blocks": setup.spec.num_gpu_blocks,
        "steps": recorder.num_steps,
        "workload": setup.workload.source,
        "config_hash": config_hash(config),
        "wall_seconds": time.perf_counter() - setup.wall,
    })
    if caches:
        summary.update(CacheStats.total([cache.stats for cache in caches]).as_dict())
    return summary


def run_simulation(config: SimConfig, workload: Workload | None = None, step_by_step: bool = False,
                   cost: CostModel | None = None) -> SimResult:
    """Run one simulation of one engine (a fleet, ``config.fleet.replicas`` > 1, runs through
    :func:`simulator.fleet.run`). ``workload`` overrides the one the config describes (e.g. the real engine's).
    ``step_by_step``: one SimPy event per decode step, no runs of steps (:mod:`simulator.core.runs`): a run draws
    its steps' acceptances before it knows where it ends, so the acceptance stream is consumed as a real engine
    consumes it only step by step (validate's common random numbers need that; the results are equally valid).
    ``cost``: price the steps with this model instead of ``config.cost.profile``'s (the policy too, unless
    ``config.cost.policy_profile`` is set; validate's timing-noise floor, :mod:`profiles.validation.noise_floor`)."""
    if config.fleet.replicas > 1:  # the engine room serves one engine; a fleet is the room beside it
        raise UserError(f"config: replicas={config.fleet.replicas} is a fleet: run it through "
                        "simulator.fleet.run (simulate, sweep, tune, compare and bench do)")
    setup = setup_run(config, workload, step_by_step, cost)
    workload = setup.workload
    recorder = Recorder(workload.arrival_time, workload.prompt_tokens, workload.output_tokens,
                        config.run.save_steps)
    env = simpy.Environment()
    engine = SimulatedEngine(env, setup.spec, workload, setup.cost, setup.make_policy(config), setup.policy_cost,
                             make_acceptance(config.speculative, setup.acceptance_rng, workload), setup.ngram_rng, recorder)
    engine.start()
    setup.run(env)
    summary = run_summary(config, setup, recorder, recorder.columns(), [engine.cache] if engine.cache else [])
    return SimResult(config, summary, recorder)


#: Formats of the per-request and per-step tables (``--format``); ``auto`` is Parquet when pyarrow is importable.
TABLE_FORMATS = ("auto", "csv", "parquet")


def table_format(fmt: str) -> str:
    """Resolve ``--format``: ``auto`` -> ``parquet`` if pyarrow is importable, else ``csv``."""
    if fmt not in TABLE_FORMATS:
        raise UserError(f"--format: expected one of {', '.join(TABLE_FORMATS)} (got {fmt!r})")
    has_pyarrow = importlib.util.find_spec("pyarrow") is not None
    if fmt == "parquet" and not has_pyarrow:
        raise UserError("--format parquet: needs pyarrow (pip install pyarrow), or use --format csv")
    if fmt == "auto":
        return "parquet" if has_pyarrow else "csv"
    return fmt


def _write_parquet(path: Path, frame: pd.DataFrame) -> None:
    # atomic_write hands over a text file; Parquet goes to its binary buffer.
    atomic_write(path, lambda f: frame.to_parquet(f.buffer, engine="pyarrow", index=False))


#: The files one run writes; a new run into the folder removes them all first (summary.json first of all).
RESULT_FILES = ("summary.json", "config.json", "requests.csv", "requests.parquet", "steps.csv", "steps.parquet",
                "vllm_result.json", "timeline.json", "replicas.csv")


def clear_result(out: Path) -> None:
    """Remove an earlier run's files from ``out``, ``summary.json`` (the mark of a complete run) first, so that the
    folder never shows an old summary beside new tables, nor a table of the other format."""
    for name in RESULT_FILES:
        (out / name).unlink(missing_ok=True)


def write_result(result: SimResult, out_dir: str | Path, fmt: str = "auto") -> None:
    """Write ``config.json``, ``requests.<fmt>``, ``steps.<fmt>`` (if recorded) and, last, ``summary.json``.

    ``fmt`` (see :func:`table_format`): ``csv``, ``parquet`` (smaller and faster for large runs; needs
    pyarrow, which specsim does not require) or ``auto``. Both keep every float bit for bit.
    """
    out = Path(out_dir)
    kind = table_format(fmt)
    write_table = write_csv if kind == "csv" else _write_parquet
    clear_result(out)
    write_json(out / "config.json", result.config.to_dict())
    write_table(out / f"requests.{kind}", result.requests)
    if result.steps is not None:
        write_table(out / f"steps.{kind}", result.steps)
    if result.replicas is not None:
        write_csv(out / "replicas.csv", result.replicas)
    write_json(out / "summary.json", result.summary)
