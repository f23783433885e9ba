"""``python run_sim.py validate``: the simulator against the real engine, on the same requests.

    python run_sim.py validate --rates 0.5,1,2 --policies no-spec,fixed-k:3,goodput --out results/validate

For each rate, one workload: ``--num-requests`` Poisson arrivals (the same draws at every rate, only
closer together) of shipped prompts (a seeded shuffle, the same at every rate) with ``--output-len``
tokens each. Each policy serves it twice:

- **real**: the engine (:mod:`profiles.serving.engine`) on the pair's models, greedy, on the wall clock, moved on
  over the gaps in which it has nothing to serve (``--real-idle``: slept through, as a deployed engine would);
- **simulated**: :func:`simulator.core.runner.run_simulation` with ``workload=`` that same workload, the engine's
  cost profile (``--profile``, measured by ``run_sim.py profile --engine``; the ``--fitter`` fit) and the
  measured acceptance replayed (``--acceptance-trace``), no KV-block limit (as the engine), averaged over
  ``--sim-seeds`` seeds of the acceptance replay;
- **simulated, calibrated**: the same with every profile time multiplied by the machine's speed during the real
  run relative to when the profile was measured (:class:`profiles.engine_profile.SpeedProbe`, re-timing a few
  profile points twice just before the real run, every ``--probe-every`` seconds during it with the engine's
  clock stopped, and twice just after): a shared machine's speed drifts by 5-25% over minutes, within a run too,
  which is not the simulator's error. ``speed_before``, ``speed_during`` and ``speed_after`` say how it moved.

Printed: the mean, p50 and p90 of latency, TTFT and TPOT and the throughput (requests/s), real and
simulated (calibrated), with the relative errors (sim - real) / real and their median absolute value, the sampling
noise of each real figure and of each error (bootstrap), and each figure's timing floor (``timing_floor``: how far
the calibrated simulation moves when each of its passes scatters as the real run's passes did, ``pass_scatter``;
what an exact cost model would still err by, :mod:`profiles.validation.noise_floor`), and a diagnostic fitted to
each run: the simulation at the speed read off the run's own passes (``step_speed``, ``sim_step_speed``,
``rel_error_step_speed``: the error left where the machine's speed is known exactly); per rate the best policy on
each side and whether each speculative policy beats no-spec on each side (``payoffs.csv``: the crossovers); the
acceptance rates, real and simulated; then where the time goes: every real step's parts (target prefill +
draft prefill, draft passes, verification, the rest: overhead) against the cost model's prediction for that
same step's shape, which tells a cost-model error from a scheduling or acceptance one. Written to ``--out``: ``validate.csv`` (the table), ``parts.csv``,
each real run's ``requests_*.csv`` and ``steps_*.csv``, and ``validate.png`` (real and simulated mean
latency and TTFT against the rate, one colour per policy).

**Token trees**: a policy spec ending in ``@tree`` (``fixed-k:4@tree``) runs with the token tree
``--speculative-token-tree`` (vLLM's list of paths) in both engines, beside the chain policies: the real engine drafts
each request's tree with its draft model and verifies it in one target pass with tree attention
(:mod:`profiles.serving.token_tree`), the simulator prices the tree step (:mod:`policies.step_time`) and draws its
accepted length from the measured acceptance by depth and rank (``--acceptance-by-rank``, written by ``run_sim.py
profile --acceptance --acceptance-by-rank``); a timing twin draws it from the constant model's rank model in both
engines. K defaults to the tree's nodes (the k-node subtree of highest expected acceptance otherwise).

``--pair tiny`` runs random tiny models on random prompts (for tests); it needs ``--profile`` and
``--acceptance-trace`` made for that pair. ``--profile-now`` measures the engine profile first, in the same run
(:func:`profile_now`); ``--preset cpu`` is the CPU validation of the shipped results, ``--preset moe-cpu`` the
mixture-of-experts twin's against its shipped profile (:data:`PRESETS`).

**Timing twin** (``--twin RATE``): both engines take their accept/reject decisions from the constant
acceptance model of per-token rate RATE (:class:`simulator.inputs.acceptance.ConstantAcceptance`) instead of the
tokens (the real engine's outputs are then meaningless, and say so), so that the timing can be validated on
random-weight pairs of any size: ``--pair TARGET+DRAFT`` (model configs, e.g. ``llama-2-7b+llama-68m``) in
``--dtype`` on ``--device``, ``--prompt-len`` random tokens per prompt, on either ``--forward`` path, against any
profile of that pair (an operator profile of ``run_sim.py profile`` has no per-step overhead rows: the
simulator then charges none). ``--max-seconds`` starts no new run past that budget (the table says which
ran). Machine speed is re-measured only against an engine profile (``profile --engine``); otherwise 1.
The twin's draws are common random numbers: the real run draws from the acceptance stream of the simulation of
``--seed`` (:func:`simulator.core.runner.random_streams`), and the simulations run step by step as the engine does,
so on the same batches both engines accept the same tokens and the compared simulated figure is that paired run
(``--sim-seeds`` more give ``sim_seed_spread``, how much the figure moves with the draws).
"""
from __future__ import annotations

import argparse
import tempfile
import typing
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from profiles.models.pairs import PAIRS, ModelPair
from profiles.validation.noise_floor import pass_scatter, step_pass_seconds, timing_floor
from policies.errors import FlagParser, UserError
from policies.tree import TreeShape
from simulator.costs.profile_table import meta_path, read_json

HERE = Path(__file__).resolve().parents[1]  # profiles/
VALIDATION_PROFILE = HERE / "data" / "cpu__smollm2-135m__smollm2-draft.csv"
VALIDATION_TRACE = HERE / "data" / "acceptance__smollm2.csv"
VALIDATION_BY_RANK = HERE / "data" / "acceptance_by_rank__smollm2.csv"
#: The engine profile of the mixture-of-experts CPU twin (``--pair moe-cpu``; ``--preset moe-cpu``).
MOE_PROFILE = HERE / "data" / "cpu__qwen3-30b-a3b-cpu__qwen3-0.6b-cpu.csv"
#: The token tree of ``@tree`` policies by default: 4 nodes (the CPU engine profile's verification covers k + 1 <= 5
#: tokens per sequence): the draft's best two tokens, the best continuation of the first, and of that.
DEFAULT_TREE = "[(0,), (1,), (0, 0), (0, 0, 0)]"
#: The suffix of a policy spec that runs it with the token tree.
TREE_SUFFIX = "@tree"
METRICS = ["mean_latency", "p50_latency", "p90_latency", "mean_ttft", "p50_ttft", "p90_ttft",
           "mean_tpot", "p50_tpot", "p90_tpot", "throughput"]
#: Columns of ``speed_probes.csv`` (:attr:`Validation.probes`).
PROBE_COLUMNS = ["rate", "policy", "sample", "role", "phase", "batch_size", "query_len", "context_len", "ratio"]
#: More KV blocks than any validation run uses: the engine has no block limit.
UNLIMITED_BLOCKS = 1_000_000


@dataclass(frozen=True)
class ValidateSettings:
    """What a validation run depends on (see the command's flags)."""

    pair: str = "smollm2"
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    policies: tuple[str, ...] = ("no-spec", "fixed-k:3", "goodput", "fixed-k:4@tree")
    num_requests: int = 12
    output_len: int = 32
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    k: int = 4
    profile: str = str(VALIDATION_PROFILE)
    fitter: str = "interp"
    acceptance_trace: str = str(VALIDATION_TRACE)
    speculative_token_tree: str = DEFAULT_TREE
    """The token tree of the ``@tree`` policies (vLLM's ``speculative_token_tree``)."""
    acceptance_by_rank: str = str(VALIDATION_BY_RANK)
    """Measured acceptance by depth and rank: the simulated ``@tree`` runs' acceptance model (not with a twin)."""
    sim_seeds: int = 5
    threads: int = 1
    seed: int = 0
    draft_path: str | None = None
    twin: float | None = None
    prompt_len: int | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    forward: str = "eager"
    cuda_graphs: bool = True
    max_seconds: float | None = None
    profile_now: bool = False
    """Measure the engine's profile first, in this run (:func:`profile_now`), and validate against it."""
    probe_every: float = 3.0
    """Seconds of a real run between speed probes (engine profiles only; 0: probe only before and after it)."""
    floor_draws: int = 5
    """Simulations per run with every pass jittered by the real run's own scatter, for the timing floor (0: none)."""
    skip_idle: bool = True
    """The real engine moves its clock on over idle gaps instead of sleeping through them
    (:attr:`profiles.serving.engine.RealEngineConfig.skip_idle`): the same timeline in the busy time only."""

    def __post_init__(self) -> None:
        if self.pair not in PAIRS and "+" not in self.pair:
            raise UserError(f"--pair: must be one of {', '.join(PAIRS)} or TARGET+DRAFT (got {self.pair!r})")
        if self.pair not in ("smollm2", "tiny") and self.twin is None:  # tiny replays a trace made for it (tests)
            raise UserError(f"--pair {self.pair}: random-weight models need --twin RATE (their tokens mean nothing)")
        if self.twin is not None and not 0 <= self.twin <= 1:
            raise UserError(f"--twin: the acceptance rate must be in [0, 1] (got {self.twin})")
        if self.prompt_len is not None and self.prompt_len < 1:
            raise UserError(f"--prompt-len: must be >= 1 (got {self.prompt_len})")
        if self.floor_draws < 0:
            raise UserError(f"--floor-draws: must be >= 0 (got {self.floor_draws})")
        if not self.probe_every >= 0:
            raise UserError(f"--probe-every: must be >= 0 seconds (got {self.probe_every})")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise UserError(f"--max-seconds: must be > 0 (got {self.max_seconds})")
        if not self.rates or any(not r > 0 for r in self.rates):
            raise UserError(f"--rates: need rates > 0 (got {','.join(map(str, self.rates))})")
        for name in ("num_requests", "output_len", "max_num_seqs", "max_num_batched_tokens", "sim_seeds", "threads"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be >= 1 (got {getattr(self, name)})")
        trees = any(tree_spec(spec)[1] for spec in self.policies)
        if trees:
            TreeShape.parse(self.speculative_token_tree, "--speculative-token-tree")
        files = ([] if self.profile_now else [("--profile", self.profile)]) + \
            ([("--acceptance-trace", self.acceptance_trace)] if self.twin is None else []) + \
            ([("--acceptance-by-rank", self.acceptance_by_rank)] if self.twin is None and trees else [])
        for flag, path in files:
            if not Path(path).is_file():
                raise UserError(f"{flag} {path}: no such file")
        if self.profile_now:
            return
        meta = meta_path(self.profile)
        measured_for = (read_json(meta).get("engine") or {}).get("pair") if meta.is_file() else None
        if measured_for not in (None, self.pair):
            raise UserError(f"--profile {self.profile}: measured the {measured_for} pair's engine, not the "
                            f"{self.pair} pair's (got --pair {self.pair})")


@dataclass(frozen=True)
class Validation:
    """The comparison (one row per rate x policy x metric), the parts table and the real runs' frames."""

    table: pd.DataFrame
    parts: pd.DataFrame
    real: dict[tuple[float, str], typing.Any]
    decisions: pd.DataFrame
    """Per rate x policy, real and simulated: proposed and accepted tokens, acceptance rate, mean k per
    request-step, decode steps, and the share of decode steps at each batch-wide k (``k_max``)."""
    drift: dict[str, float]
    """The reference pass's median seconds before and after the runs, and their ratio (the machine's drift
    measured in the same run, :func:`reference_seconds`)."""
    probes: pd.DataFrame
    """Every speed probe's ratio (seconds now / seconds in the profile) per rate x policy, in the order taken:
    ``sample`` counts from the first probe before the run (engine profiles only; else empty)."""
    skipped: tuple[str, ...] = ()
    """One line per (rate, policy) not run, past ``--max-seconds`` (the report says so)."""

    def decision_columns(self) -> list[str]:
        """``rate``, ``policy`` and the columns of :attr:`decisions` a reader compares: acceptance rate, mean k,
        proposed tokens and decode steps, real and simulated."""
        return ["rate", "policy"] + [c for c in self.decisions.columns if c.split("_", 1)[-1] in
                                     ("acceptance_rate", "mean_k", "proposed_tokens", "decode_steps")]

    def choices(self) -> pd.DataFrame:
        """What a user decides with, per rate: the policy with the lowest mean latency really and simulated
        (and whether they agree), and whether speculation pays (the best speculative policy beats no-spec)."""
        return policy_choices(self.table)

    def median_abs_error(self, calibrated: bool = False) -> float:
        """Median |relative error| over the latency, TTFT, TPOT and throughput figures."""
        column = "rel_error_calibrated" if calibrated else "rel_error"
        return float(self.table.loc[self.table["metric"].isin(METRICS), column].abs().median())


def tree_spec(spec: str) -> tuple[str, bool]:
    """A policy spec without its ``@tree`` suffix, and whether it had one (module docstring)."""
    return (spec[:-len(TREE_SUFFIX)], True) if spec.endswith(TREE_SUFFIX) else (spec, False)


def parse_policies(text: str) -> tuple[str, ...]:
    """``--policies``: comma-separated policy specs, each checked as the simulator's studies check them
    (:func:`simulator.studies.specs.parse_policy_list`) once its ``@tree`` suffix is off; none given twice."""
    from simulator.studies.specs import parse_policy_list

    specs = [p.strip() for p in (text or "").split(",") if p.strip()]
    parse_policy_list("--policies", ",".join(dict.fromkeys(tree_spec(p)[0] for p in specs)))
    if len(set(specs)) != len(specs):
        raise UserError(f"--policies: a policy is given twice in {text!r}")
    return tuple(specs)


#: ``--preset cpu``: the CPU validation (issue targets: median |error| <= 3%, worst <= 10%, the real engine's best
#: policy picked at every rate, a crossover among the rates; under 20 minutes on 2 cores). A timing twin of a
#: Llama-architecture pair sized for a CPU (``profiles/models/cpu-330m.json``: 4 wide layers, 333M parameters;
#: ``cpu-22m.json`` its 2-layer draft), profiled in the same run. On a CPU a pass's cost grows with its tokens less
#: than in proportion (a one-token pass is weight-read-bound, a batch of 8 x 4 tokens uses the cores better):
#: speculation at acceptance 0.6 loses to no speculation for lone requests and pays once batches fill; the rates
#: cover both. ``moe-cpu``: the mixture-of-experts twin (:data:`profiles.models.pairs.RANDOM_PAIRS`) against its shipped
#: engine profile (:data:`MOE_PROFILE`), about 4 minutes on 2 cores.
PRESETS = {"cpu": dict(pair="cpu-330m+cpu-22m", twin=0.6, prompt_len=32, output_len=24, num_requests=24,
                       rates=(0.3, 0.8, 2.0), policies=("no-spec", "fixed-k:3", "goodput"), k=4, max_num_seqs=8,
                       sim_seeds=5, profile_now=True),
           "moe-cpu": dict(pair="moe-cpu", twin=0.7, prompt_len=32, output_len=24, num_requests=16,
                           rates=(0.5, 2.0), policies=("no-spec", "fixed-k:3", "goodput"), k=4, max_num_seqs=8,
                           sim_seeds=5, profile=str(MOE_PROFILE))}


def profile_now(pair: ModelPair, settings: ValidateSettings, out: Path) -> str:
    """Measure the engine profile of ``pair`` on this machine now, into ``out/engine_profile.csv``, over the shapes
    the validation reaches: every batch size up to ``max_num_seqs``, k + 1 up to ``k + 1``, draft catch-ups of 1-3
    tokens, contexts from the prompt to prompt + output (+ lookahead), prefills of the prompt length and a quarter
    of it (random prompts of ``--prompt-len``; else the shipped CPU grid). Returns its path."""
    from profiles.engine_profile import CPU_GRID, EngineProfileSettings, profile_engine
    from profiles.grid import Grid

    grid = CPU_GRID
    prefill_batches = (1, 2, 4, 8)
    if settings.prompt_len is not None:
        p = settings.prompt_len
        grid = Grid(batch_sizes=tuple(range(1, settings.max_num_seqs + 1)), query_lens=tuple(range(1, settings.k + 2)),
                    context_lens=(p, p + settings.output_len + settings.k + 1),
                    prefill_lens=tuple(sorted({max(1, p // 4), p})),
                    max_prefill_tokens=None, draft_query_lens=(1, 2, 3))
        prefill_batches = tuple(sorted({1, 2, 4, settings.max_num_seqs} & set(range(1, settings.max_num_seqs + 1))))
    path = out / "engine_profile.csv"
    profile_engine(pair, EngineProfileSettings(out=str(path), grid=grid, prefill_batch_sizes=prefill_batches,
                                               rounds=5, threads=settings.threads, seed=settings.seed,
                                               forward=settings.forward, cuda_graphs=settings.cuda_graphs))
    return str(path)


def workloads(settings: ValidateSettings,
              prompt_pool: list[list[int]]) -> dict[float, tuple[typing.Any, list[list[int]]]]:
    """Per rate, the workload and its prompts' token ids (module docstring: common random numbers)."""
    from simulator.inputs.workload import Workload

    rng = np.random.default_rng(settings.seed)
    gaps = rng.standard_exponential(settings.num_requests)
    chosen = [prompt_pool[i % len(prompt_pool)] for i in rng.permutation(max(settings.num_requests, len(prompt_pool)))]
    prompts = chosen[:settings.num_requests]
    out = {}
    for rate in settings.rates:
        out[rate] = (Workload(np.cumsum(gaps) / rate, [len(p) for p in prompts],
                              np.full(settings.num_requests, settings.output_len),
                              f"validate poisson rate={rate:g}, {len(prompts)} shipped prompts, "
                              f"output {settings.output_len}"), prompts)
    return out


def prompt_pool(pair: ModelPair, seed: int, prompt_len: int | None = None) -> list[list[int]]:
    """The shipped prompts' token ids (chat template), or random prompts for random-weight pairs: of
    ``prompt_len`` tokens each, else of 8..40 tokens."""
    if pair.tokenizer is None or prompt_len is not None:
        rng = np.random.default_rng(seed + 1)
        lengths = [prompt_len] * 16 if prompt_len is not None else rng.integers(8, 41, 16)
        return [rng.integers(0, pair.target.config.vocab_size, int(n)).tolist() for n in lengths]
    from profiles.models.pairs import encode_prompts, read_prompts

    return encode_prompts(pair.tokenizer, read_prompts())


def run_validation(pair: ModelPair, settings: ValidateSettings,
                   log: typing.Callable[[str], None] = print) -> Validation:
    """Serve every (rate, policy) for real and simulated; compare (module docstring)."""
    import time

    import torch

    from policies.registry import make_policy
    from profiles.serving.engine import RealEngineConfig, RealEngine
    from simulator.inputs.acceptance import AcceptanceModel, make_acceptance
    from simulator.costs.cost_model import load_cost_model
    from profiles.engine_profile import SpeedProbe
    from simulator.costs.profile_table import read_profile
    from simulator.core.runner import random_streams, run_simulation
    from simulator.studies.specs import parse_policy_spec
    from simulator.inputs.workload import Workload

    started = time.monotonic()
    if settings.device == "cpu":
        torch.set_num_threads(settings.threads)
        torch.set_flush_denormal(True)
    cost = load_cost_model(settings.profile, settings.fitter)
    table = read_profile(settings.profile)
    engine_profile = table.meta.get("engine") is not None
    spread = (table.meta.get("engine") or {}).get("decode_length_spread", 0.0)

    def engine_config(config: typing.Any) -> RealEngineConfig:
        """The real engine's settings for what ``config`` simulates (the same serving fields; the engine probes only
        where it is given a probe)."""
        return RealEngineConfig.from_sim_config(config, forward=settings.forward, cuda_graphs=settings.cuda_graphs,
                                                probe_every=settings.probe_every, skip_idle=settings.skip_idle)

    def twin(config: typing.Any, seed: int) -> AcceptanceModel | None:
        """The twin's acceptance model (the simulation's own, of ``config``: constant, with its rank model for trees)
        on the acceptance stream of the simulation of ``seed``: the real run and the simulation of ``settings.seed``
        draw the same accept/reject decisions on the same batches (common random numbers), so that their difference
        is the timing's, not sampling's."""
        return None if settings.twin is None else make_acceptance(config.speculative, random_streams(seed)[2])
    scratch = tempfile.TemporaryDirectory(prefix="specsim-validate-")
    specs = [parse_policy_spec(tree_spec(s)[0]) for s in settings.policies]
    rows, parts, real, decisions, probes = [], [], {}, [], []
    runs = workloads(settings, prompt_pool(pair, settings.seed, settings.prompt_len))
    # Warm up (first passes pay for lazy initialisation): two requests, speculating, not recorded.
    warm_prompts = next(iter(runs.values()))[1][:2]
    warm_workload = next(iter(runs.values()))[0]
    warm_config = simulation_config(warm_workload, "fixed-k", settings.k, (), settings.profile,
                                    settings.acceptance_trace, settings.fitter, settings.max_num_seqs,
                                    settings.max_num_batched_tokens, twin=settings.twin)
    RealEngine(pair.target, pair.draft, engine_config(warm_config), make_policy("fixed-k", settings.k), cost,
               np.random.default_rng(settings.seed), twin(warm_config, settings.seed)).run(
        Workload(np.zeros(len(warm_prompts)), [len(p) for p in warm_prompts], np.full(len(warm_prompts), 8), "warm-up"),
        warm_prompts)
    before = reference_seconds(pair, settings)
    # the machine's speed relative to the profile's, re-timed around and during each run (1 unless an engine profile)
    probe = SpeedProbe(pair, table.frame, spread, 0.0, settings.seed, table.meta.get("forward") or "eager") \
        if engine_profile else None

    def speed_now(calls: int = 2) -> float:
        """The machine's speed now: ``calls`` probes."""
        if probe is None:
            return 1.0
        since = len(probe.samples)
        for _ in range(calls):
            probe()
        return probe.speed(since)
    skipped = []
    for rate, (workload, prompts) in runs.items():
        for spec, (name, k, params) in zip(settings.policies, specs):
            if settings.max_seconds is not None and time.monotonic() - started > settings.max_seconds:
                skipped.append(f"rate {rate:g} {spec}: not run, past --max-seconds {settings.max_seconds:g}")
                log(skipped[-1])
                continue
            tree = settings.speculative_token_tree if tree_spec(spec)[1] else None
            if k is None:
                k = TreeShape.parse(tree).num_nodes if tree is not None else settings.k
            first_sample = len(probe.samples) if probe is not None else 0
            speed_before = speed_now()
            config = simulation_config(workload, name, k, params, settings.profile, settings.acceptance_trace,
                                       settings.fitter, settings.max_num_seqs, settings.max_num_batched_tokens,
                                       rate=rate, twin=settings.twin, token_tree=tree,
                                       acceptance_by_rank=settings.acceptance_by_rank)
            during = len(probe.samples) if probe is not None else 0
            engine_settings = engine_config(config)
            engine = RealEngine(pair.target, pair.draft, engine_settings, make_policy(name, k, dict(params)),
                                cost, np.random.default_rng(settings.seed), twin(config, settings.seed), probe)
            result = engine.run(workload, prompts)
            real[(rate, spec)] = result
            speed_during = probe.speed(during) if probe is not None and len(probe.samples) > during else np.nan
            speed_after = speed_now()
            # the machine's speed over the run: every probe taken just before, during and just after it
            speed = probe.speed(first_sample) if probe is not None else 1.0
            if probe is not None:
                probes.extend({"rate": rate, "policy": spec, "sample": i, "role": key[0], "phase": key[1],
                               "batch_size": key[2], "query_len": key[3], "context_len": key[4], "ratio": ratio}
                              for i, (key, ratio) in enumerate(probe.samples[first_sample:]))
            calibrated = scaled_profile(table, speed, Path(scratch.name) / f"speed{len(rows)}.csv")
            seeds = [settings.seed + s for s in range(settings.sim_seeds)]
            # step by step: draws consumed as the real engine consumes them (common random numbers, twin())
            sim_runs = [run_simulation(config.replace(seed=s, save_steps=True), workload=workload, step_by_step=True)
                        for s in seeds]
            cal_runs = [run_simulation(config.replace(seed=s, profile=calibrated, policy_profile=settings.profile),
                                       workload=workload, step_by_step=True) for s in seeds]
            sims_cal = [r.summary for r in cal_runs]
            seed_spread = {metric: (max(x[metric] for x in sims_cal) - min(x[metric] for x in sims_cal)) / 2
                           for metric in METRICS}
            sims = [r.summary for r in sim_runs]
            if settings.twin is not None:  # compared: the simulation that met the real run's draws (twin())
                sim_runs, sims, sims_cal = sim_runs[:1], sims[:1], sims_cal[:1]
            # a diagnostic, fitted to the run (no prediction): the simulation at the speed read off the real run's own
            # passes (all its steps' measured seconds over the cost model's for their shapes), the error that is left
            # where the machine's speed is known exactly
            own_parts = step_parts(result.steps, cost, engine_settings.tree)
            own = own_parts.set_index("part").loc["all steps"]
            step_speed = float(own["measured"] / own["predicted"])
            at_step_speed = scaled_profile(table, step_speed, Path(scratch.name) / f"steps{len(rows)}.csv")
            sims_step = [run_simulation(config.replace(seed=s, profile=at_step_speed, policy_profile=settings.profile),
                                        workload=workload, step_by_step=True).summary for s in seeds[:len(sims_cal)]]
            # the timing floor: the calibrated simulation against itself with each pass scattered as the real ones
            scatter = pass_scatter(result.steps, cost)
            at_speed = config.replace(seed=settings.seed, profile=calibrated, policy_profile=settings.profile)
            floor = timing_floor(at_speed, workload, scatter, METRICS, settings.floor_draws, settings.seed,
                                 plain=cal_runs[0].summary) if settings.floor_draws else {}  # cal_runs[0]: at_speed
            noise = bootstrap_noise(result.requests, settings.seed)
            error_noise = bootstrap_noise(result.requests, settings.seed, paired=cal_runs[0].requests)
            for metric in METRICS + ["acceptance_rate"]:
                r = float(result.summary[metric])
                s, c, o = (float(np.mean([x[metric] for x in runs_])) for runs_ in (sims, sims_cal, sims_step))
                rows.append({"rate": rate, "policy": spec, "metric": metric, "real": r, "sim": s,
                             "rel_error": (s - r) / r if r else np.nan, "sim_calibrated": c,
                             "rel_error_calibrated": (c - r) / r if r else np.nan, "speed": speed,
                             "real_noise": noise.get(metric, np.nan), "error_noise": error_noise.get(metric, np.nan),
                             "speed_before": speed_before, "speed_during": speed_during, "speed_after": speed_after,
                             "sim_seed_spread": seed_spread[metric] / r if r and metric in seed_spread else np.nan,
                             "pass_scatter": scatter, "timing_floor": floor.get(metric, np.nan),
                             "step_speed": step_speed, "sim_step_speed": o,
                             "rel_error_step_speed": (o - r) / r if r else np.nan})
            decisions.append({"rate": rate, "policy": spec,
                              **{f"real_{key}": value for key, value in decision_figures(result.steps).items()},
                              **{f"sim_{key}": value for key, value in pd.DataFrame(
                                  [decision_figures(r.steps) for r in sim_runs]).mean().items()}})
            parts.append(own_parts.assign(rate=rate, policy=spec, speed=speed))
            log(f"rate {rate:g} {spec}: machine speed {speed:.3f} x the profile's (before {speed_before:.3f}, during "
                f"{speed_during:.3f}, after {speed_after:.3f}); mean latency real "
                f"{result.summary['mean_latency']:.3f} s, simulated {np.mean([x['mean_latency'] for x in sims]):.3f} s, "
                f"calibrated {np.mean([x['mean_latency'] for x in sims_cal]):.3f} s; passes' scatter {scatter:.3f}, "
                f"idle skipped {result.summary['idle_skipped_seconds']:.1f} s")
    scratch.cleanup()
    drift = {"reference_seconds_before": before, "reference_seconds_after": reference_seconds(pair, settings)}
    drift["after_over_before"] = drift["reference_seconds_after"] / before
    return Validation(pd.DataFrame(rows), pd.concat(parts, ignore_index=True), real,
                      pd.DataFrame(decisions).fillna(0.0), drift, pd.DataFrame(probes, columns=PROBE_COLUMNS),
                      tuple(skipped))


def reference_seconds(pair: ModelPair, settings: ValidateSettings, repeats: int = 21) -> float:
    """Median seconds of a fixed reference pass (the target verifying 3 tokens for 4 sequences over 32 cached
    ones, on the validated forward path): timed before and after the runs, its ratio is the machine's drift."""
    import time

    from profiles.serving.kv import make_kv_batch

    kv = make_kv_batch(settings.forward, pair.target, 4, 64, None if settings.cuda_graphs else False)
    rng = np.random.default_rng(12345)
    vocab = pair.target.config.vocab_size
    kv.prefill(rng.integers(0, vocab, (4, 32)).tolist())
    block = rng.integers(0, vocab, (4, 3)).tolist()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kv.extend(block, all_logits=True).float().sum().item()  # .item(): wait for the device
        seconds.append(time.perf_counter() - t0)
        kv.truncate([32] * 4)
    return float(np.median(seconds[1:]))


def bootstrap_noise(requests: pd.DataFrame, seed: int, draws: int = 400,
                    paired: pd.DataFrame | None = None) -> dict[str, float]:
    """Sampling noise of a real run's per-request figures: half the width of the 95% bootstrap interval of the
    mean, p50 and p90 of latency, TTFT and TPOT (requests resampled with replacement), relative to the figure.

    ``paired`` (the simulated run's per-request frame, the same requests in the same order): the noise of the relative
    error (sim - real) / real instead, each draw resampling the same requests on both sides: how precisely the
    requests served pin the error down (with common random numbers far tighter than the figures' own noise)."""
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(requests), (draws, len(requests)))
    out = {}
    for column in ("latency", "ttft", "tpot"):
        values = requests[column].to_numpy(dtype=float)
        other = None if paired is None else paired[column].to_numpy(dtype=float)
        for name, stat in (("mean", lambda a: a.mean(axis=1)), ("p50", lambda a: np.percentile(a, 50, axis=1)),
                           ("p90", lambda a: np.percentile(a, 90, axis=1))):
            figure = float(stat(values[None, :])[0])
            if not figure:
                out[f"{name}_{column}"] = float("nan")
                continue
            if other is None:
                lo, hi = np.percentile(stat(values[index]), [2.5, 97.5])
                out[f"{name}_{column}"] = float((hi - lo) / 2 / figure)
            else:
                lo, hi = np.percentile(stat(other[index]) / stat(values[index]) - 1, [2.5, 97.5])
                out[f"{name}_{column}"] = float((hi - lo) / 2)
    return out


def decision_figures(steps: pd.DataFrame) -> dict[str, float]:
    """How a policy decided over a run (module docstring of :class:`Validation`): from the per-step table."""
    decode = steps[steps["kind"] != "prefill"]
    proposed, accepted = float(decode["proposed"].sum()), float(decode["accepted"].sum())
    request_steps = float(decode["batch_size"].sum())
    out = {"proposed_tokens": proposed, "accepted_tokens": accepted,
           "acceptance_rate": accepted / proposed if proposed else float("nan"),
           "mean_k": proposed / request_steps if request_steps else 0.0, "decode_steps": float(len(decode))}
    shares = decode["k_max"].value_counts(normalize=True)
    out.update({f"steps_k{int(k)}": float(share) for k, share in sorted(shares.items())})
    return out


def normalized_real(latency: pd.DataFrame) -> pd.DataFrame:
    """``latency`` (rows of one metric) with ``normalized``: each real figure divided by its run's machine speed
    (``speed``, relative to the profile's). The runs of a rate's policies follow one another, minutes apart, and a
    shared machine's speed moves by more than the margins between policies (5-10% within one validation run),
    so the raw real figures compare policies on different machines; divided by the speed, they compare them on
    the profile's machine, as the uncalibrated simulation does (to first order: a queue's latency is not exactly
    proportional to its passes' times)."""
    return latency.assign(normalized=latency["real"] / latency["speed"])


def policy_choices(table: pd.DataFrame) -> pd.DataFrame:
    """Per rate: the policy of lowest mean latency, real and simulated, whether they agree, and whether
    speculation pays (a speculative policy beats no-spec; needs no-spec among the policies); ``real_margin``: how
    much slower the real runner-up was than the real best (relative); ``sim_pick_real_cost``: how much slower the
    simulator's pick really was than the real best (0 when they agree). ``best_normalized`` and
    ``same_choice_normalized``: the same on the real latencies divided by each run's machine speed
    (:func:`normalized_real`)."""
    latency = normalized_real(table[table["metric"] == "mean_latency"])
    rows = []
    for rate, part in latency.groupby("rate"):
        row = {"rate": rate}
        for side in ("real", "sim", "normalized"):
            best = part.loc[part[side].idxmin()]
            row[f"best_{side}"] = best["policy"]
            plain = part[part["policy"] == "no-spec"]
            spec = part[part["policy"] != "no-spec"]
            # undefined (None) unless both no-spec and a speculative policy were validated
            row[f"speculation_pays_{side}"] = bool(spec[side].min() < plain[side].iloc[0]) \
                if len(plain) and len(spec) else None
        row["same_choice"] = row["best_real"] == row["best_sim"]
        row["same_choice_normalized"] = row["best_normalized"] == row["best_sim"]
        real = part.set_index("policy")["real"].sort_values()
        # how clear the real engine's choice was, and what the simulator's pick costs really
        row["real_margin"] = float(real.iloc[1] / real.iloc[0] - 1) if len(real) > 1 else float("nan")
        row["sim_pick_real_cost"] = float(real[row["best_sim"]] / real.iloc[0] - 1)
        rows.append(row)
    return pd.DataFrame(rows)


def policy_payoffs(table: pd.DataFrame) -> pd.DataFrame:
    """Per rate and speculative policy: its mean latency over no-spec's, real and simulated (below 1: speculating
    that way pays), and whether the two sides agree on it paying. Where a policy's payoff changes sign between rates
    is its crossover (needs no-spec among the policies; empty otherwise). ``normalized_vs_no_spec`` and
    ``same_call_normalized``: on the real latencies divided by each run's machine speed (:func:`normalized_real`)."""
    latency = normalized_real(table[table["metric"] == "mean_latency"])
    rows = []
    for rate, part in latency.groupby("rate"):
        plain = part[part["policy"] == "no-spec"]
        for row in part[part["policy"] != "no-spec"].itertuples():
            if len(plain):
                real, sim = row.real / plain["real"].iloc[0], row.sim / plain["sim"].iloc[0]
                normalized = row.normalized / plain["normalized"].iloc[0]
                rows.append({"rate": rate, "policy": row.policy, "real_vs_no_spec": real, "sim_vs_no_spec": sim,
                             "pays_real": bool(real < 1), "pays_sim": bool(sim < 1),
                             "same_call": bool((real < 1) == (sim < 1)), "normalized_vs_no_spec": normalized,
                             "same_call_normalized": bool((normalized < 1) == (sim < 1))})
    return pd.DataFrame(rows, columns=["rate", "policy", "real_vs_no_spec", "sim_vs_no_spec", "pays_real", "pays_sim",
                                       "same_call", "normalized_vs_no_spec", "same_call_normalized"])


def crossover(choices: pd.DataFrame, side: str) -> float:
    """The lowest validated rate at which speculation stops paying (``side``: real or sim); NaN if it pays at
    every validated rate, or if no-spec was not validated."""
    stops = choices.loc[choices[f"speculation_pays_{side}"].eq(False), "rate"]
    return float(stops.min()) if len(stops) else float("nan")


def simulation_config(workload: typing.Any, policy: str, k: int, params: tuple[tuple[str, typing.Any], ...],
                      profile: str | Path, acceptance_trace: str | Path, fitter: str, max_num_seqs: int,
                      max_num_batched_tokens: int = 2048, policy_profile: str | Path | None = None,
                      rate: float = 1.0, twin: float | None = None, token_tree: str | None = None,
                      acceptance_by_rank: str | Path | None = None) -> typing.Any:
    """The simulator's config for a run of the real engine on ``workload`` (module docstring): its cost
    ``profile`` (``fitter``), the measured acceptance replayed, no KV-block limit (as the engine), the engine's
    ``max_num_seqs`` and token budget; ``policy_profile``: what the policy prices its choices with (default the
    profile). Pass ``workload=`` to :func:`simulator.core.runner.run_simulation` with it: the arrivals are the
    workload's (``rate`` only names them in the config). ``twin``: the constant acceptance rate of a timing
    twin instead of the replayed trace. ``token_tree``: every request verifies that tree's k-node subtree, its
    acceptance drawn from the measured ``acceptance_by_rank`` table (a twin: from the constant rate's rank model)."""
    from simulator.config import SimConfig

    acceptance = {"acceptance": "replay", "acceptance_trace": str(acceptance_trace)} if twin is None else \
        {"acceptance": "constant", "acceptance_rate": twin}
    if token_tree is not None:
        acceptance["speculative_token_tree"] = token_tree
        if twin is None:
            acceptance = {"acceptance": "by-rank", "acceptance_by_rank": str(acceptance_by_rank),
                          "speculative_token_tree": token_tree}
    return SimConfig.of(arrival="poisson", rate=rate, num_requests=len(workload), policy=policy, k=k,
                        policy_params=tuple(params), profile=str(profile),
                        policy_profile=None if policy_profile is None else str(policy_profile), fitter=fitter,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        num_gpu_blocks=UNLIMITED_BLOCKS, **acceptance)


def scaled_profile(table: typing.Any, factor: float, path: Path) -> str:
    """A copy of profile ``table`` with every time multiplied by ``factor``, written to ``path``."""
    from simulator.costs.profile_table import write_profile

    frame = table.frame.copy()
    for column in ("seconds", "seconds_p10", "seconds_p90"):
        if column in frame:
            frame[column] = frame[column] * factor
    write_profile(frame, {**table.meta, "calibrated": {"source": table.path, "factor": factor}}, path)
    return str(path)


def step_parts(steps: pd.DataFrame, cost: typing.Any, tree: typing.Any = None) -> pd.DataFrame:
    """Measured and predicted seconds of each part of a real run's steps, summed over the run.

    The prediction prices each real step's own shape: a prefill of ``batch_size`` prompts of
    ``prefill_tokens`` tokens (target and draft), a decode step of ``batch_size`` requests over
    ``context_tokens`` verifying ``proposed + batch_size`` tokens after the draft passes of a chain of ``k_max``
    (or, with a token ``tree`` family, of ``tree.shape(k_max)``: :func:`policies.step_time.tree_step`) over the
    whole batch (the engine's passes), the first feeding ``catchup_tokens`` where the cost model prices a catch-up;
    overhead = :func:`policies.step_time.step_overhead` per step (a prefill's ``prefill_overhead_time``).
    """
    from policies.step_time import step_overhead, tree_step

    speculative = steps["proposed"].sum() > 0 or (steps["draft_seconds"][steps["kind"] == "prefill"] > 0).any()
    measured = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "overhead": 0.0}
    predicted = dict(measured)
    for s in steps.itertuples():
        b = int(s.batch_size)
        seconds, target, draft = step_pass_seconds(s, cost, speculative)
        if s.kind == "prefill":
            measured["prefill"] += seconds
            predicted["prefill"] += target + draft
        else:
            measured["draft"] += s.draft_seconds
            measured["verify"] += seconds
            predicted["verify"] += target
            shape = tree.shape(int(s.k_max)) if tree is not None else TreeShape.chain(int(s.k_max))
            # every sequence drafts the shape; only the batch's total context counts
            shaped = tree_step([int(s.context_tokens)] + [0] * (b - 1), [shape] * b).draft_passes
            passes = [cost.draft_time(seqs, tokens) if fed == seqs else cost.draft_time(seqs, tokens, fed)
                      for seqs, tokens, fed in shaped]
            if passes and cost.prices_catchup and s.catchup_tokens > b:  # the first pass fed the draft's lag
                passes[0] = cost.draft_time(b, int(s.context_tokens), int(s.catchup_tokens))
            predicted["draft"] += sum(passes)
        measured["overhead"] += s.seconds - s.target_seconds - s.draft_seconds
        predicted["overhead"] += (cost.prefill_overhead_time(b) if s.kind == "prefill"
                                  else step_overhead(cost, b, int(s.proposed) + b))
    rows = [{"part": p, "measured": measured[p], "predicted": predicted[p]} for p in measured]
    rows.append({"part": "all steps", "measured": sum(measured.values()), "predicted": sum(predicted.values())})
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame) -> str:
    """The comparison, one line per rate x policy x metric: real, simulated and calibrated, with errors."""
    shown = table.set_index(["rate", "policy", "metric"])[["real", "sim", "rel_error", "sim_calibrated",
                                                             "rel_error_calibrated"]]
    return shown.to_string(formatters={"real": "{:.3f}".format, "sim": "{:.3f}".format,
                                       "sim_calibrated": "{:.3f}".format, "rel_error": "{:+.1%}".format,
                                       "rel_error_calibrated": "{:+.1%}".format})


def format_parts(parts: pd.DataFrame) -> str:
    """Measured vs predicted seconds per part, summed over every real run (predicted as profiled, and scaled
    by each run's machine speed)."""
    seconds, percent = "{:.2f}".format, "{:+.1%}".format
    return parts_totals(parts).to_string(formatters={"measured": seconds, "predicted": seconds, "calibrated": seconds,
                                                     "rel_error": percent, "rel_error_calibrated": percent})


def parts_totals(parts: pd.DataFrame) -> pd.DataFrame:
    """Per part, the measured, predicted and calibrated (predicted x machine speed) seconds over every real run, and
    the relative errors of both (:func:`format_parts`' table)."""
    parts = parts.assign(calibrated=parts["predicted"] * parts["speed"])
    total = parts.groupby("part", sort=False)[["measured", "predicted", "calibrated"]].sum()
    total["rel_error"] = (total["predicted"] - total["measured"]) / total["measured"]
    total["rel_error_calibrated"] = (total["calibrated"] - total["measured"]) / total["measured"]
    return total


#: Columns of ``validate.csv`` a report shows (the file has them all).
REPORT_COLUMNS = ["rate", "policy", "metric", "real", "sim", "rel_error", "sim_calibrated", "rel_error_calibrated",
                  "real_noise", "timing_floor", "speed"]


def write_report(out: Path, settings: ValidateSettings, result: Validation, choices: pd.DataFrame,
                 payoffs: pd.DataFrame, headline: list[str], warned: list[str], figure: str | None) -> str:
    """``OUT/report.html`` (:func:`simulator.studies.report.write_report`): the headline figures, the comparison
    table, the figure, the decision per rate, the payoffs, how each policy decided, where the time goes and the
    machine's drift; the settings, the engine profile (its method) and every warning the run printed."""
    from simulator.studies import report

    sections: list[tuple[str, typing.Any]] = [
        ("Summary", "\n".join(headline)),
        ("Real and simulated, per rate, policy and metric (seconds; throughput: requests/s; validate.csv)",
         result.table[[c for c in REPORT_COLUMNS if c in result.table.columns]]),
        ("Figure", [Path(figure)] if figure else "no figure"),
        ("The decision per rate: lowest mean latency (choices.csv)", choices)]
    if len(payoffs):
        sections.append(("Each speculative policy against no-spec: mean latency ratio, below 1 it pays (payoffs.csv)",
                         payoffs))
    sections += [("How each policy decided, real and simulated (decisions.csv)",
                  result.decisions[result.decision_columns()]),
                 ("Where the time goes: every real step, measured against the cost model on its shape, seconds "
                  "(parts.csv)", parts_totals(result.parts)),
                 ("The machine's drift over the run (drift.json)", dict(result.drift))]
    title = f"validate: {settings.pair}, real engine against the simulator"
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(settings).items()}
    return report.write_report(out / report.REPORT_NAME, title, sections, warned, config,
                               [report.profile_info(settings.profile)])


def plot(table: pd.DataFrame, path: Path, title: str) -> str:
    """Real (solid, filled markers), simulated (dashed, hollow) and calibrated simulated (dotted, hollow) mean latency
    and TTFT against the rate, each policy in its colour and marker in every figure
    (:func:`simulator.studies.plots.policy_style`)."""
    from simulator.studies.plots import plt, policy_style, save_figure

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for ax, metric in zip(axes, ("mean_latency", "mean_ttft")):
        for policy, part in table[table["metric"] == metric].groupby("policy", sort=False):
            style = policy_style(policy)
            ax.plot(part["rate"], part["real"], ls="-", label=f"{policy} real", **style)
            ax.plot(part["rate"], part["sim"], ls="--", mfc="none", label=f"{policy} simulated", **style)
            ax.plot(part["rate"], part["sim_calibrated"], ls=":", mfc="none", label=f"{policy} simulated, calibrated",
                    **style)
        ax.set(xlabel="request rate (req/s)", ylabel=f"{metric.replace('_', ' ')} (s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers (got {text!r})") from None


def build_parser() -> FlagParser:
    d = ValidateSettings
    p = FlagParser(prog="run_sim.py validate", description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=d.pair, help=f"models: {', '.join(PAIRS)}")
    p.add_argument("--draft-path", help="folder of the draft (default: the shipped profiles/data/smollm2-draft)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="request rates, req/s")
    p.add_argument("--policies", default=",".join(d.policies),
                   help="policy specs NAME[:K][/PARAM=VALUE...][@tree] (@tree: with --speculative-token-tree)")
    p.add_argument("--k", type=int, default=d.k, help="k of policies whose spec gives none (K_max)")
    p.add_argument("--num-requests", type=int, default=d.num_requests, help="requests per run")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running requests at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="prompt tokens per prefill step")
    p.add_argument("--profile", default=d.profile, help="the engine's cost profile (run_sim.py profile --engine)")
    p.add_argument("--fitter", default=d.fitter, help="linear or interp")
    p.add_argument("--acceptance-trace", default=d.acceptance_trace,
                   help="measured acceptance (run_sim.py profile --acceptance)")
    p.add_argument("--speculative-token-tree", default=d.speculative_token_tree,
                   help="the token tree of the policies whose spec ends in @tree (vLLM's list of paths of child "
                        f"ranks; default {d.speculative_token_tree})")
    p.add_argument("--acceptance-by-rank", default=d.acceptance_by_rank,
                   help="measured acceptance by depth and rank for the @tree policies' simulations (run_sim.py "
                        "profile --acceptance --acceptance-by-rank)")
    p.add_argument("--sim-seeds", type=int, default=d.sim_seeds, help="simulations per run, averaged")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of arrivals, prompt order and sampling")
    p.add_argument("--twin", type=float, metavar="RATE",
                   help="timing twin: accept/reject drawn at this constant per-token rate in both engines, not from "
                        "the tokens (outputs meaningless); needed for --pair TARGET+DRAFT")
    p.add_argument("--prompt-len", type=int, help="random prompts of this many tokens (random-weight pairs)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the real engine runs (default cpu)")
    p.add_argument("--dtype", default="fp32", help="weights' dtype of a TARGET+DRAFT pair: bf16, fp16, fp32")
    p.add_argument("--forward", default="eager", choices=("eager", "optimized"),
                   help="the real engine's forward path (default eager)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="optimized forward without CUDA graphs")
    p.add_argument("--max-seconds", type=float, help="start no new run after this many seconds")
    p.add_argument("--probe-every", type=float, default=d.probe_every,
                   help="seconds of a real run between speed probes, the engine's clock stopped meanwhile (engine "
                        "profiles; 0: probes only just before and after each run)")
    p.add_argument("--floor-draws", type=int, default=d.floor_draws,
                   help="simulations per run with each pass scattered as the real run's, for the timing floor "
                        "(the error an exact cost model would still show; 0: none)")
    p.add_argument("--real-idle", dest="skip_idle", action="store_false",
                   help="the real engine sleeps through idle gaps (default: its clock moves on to the next arrival; "
                        "the same timeline, only the busy time on the wall clock)")
    p.add_argument("--profile-now", action="store_true",
                   help="measure the engine's profile first, in this run, into OUT/engine_profile.csv, and validate "
                        "against it (--profile is then unused)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="named defaults for every flag not given; cpu: the CPU timing-twin validation "
                        f"({', '.join(f'{k}={v}' for k, v in PRESETS['cpu'].items())}); moe-cpu: the mixture-of-experts "
                        "CPU twin against its shipped engine profile")
    p.add_argument("--out", default="results/validate", help="output folder")
    return p


def main(argv: list[str]) -> int:
    """Run the ``validate`` command; returns the exit status (user errors raise :class:`UserError`)."""
    from simulator.results import check_out_dir

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset is not None:  # the preset's values for every flag not given
        preset = {key: ",".join(map(str, value)) if isinstance(value, tuple) else value
                  for key, value in PRESETS[args.preset].items()}
        parser.set_defaults(**preset)
        args = parser.parse_args(argv)
    check_out_dir(args.out, kind="validate")  # before the long runs: --out "" or a file is found now
    settings = ValidateSettings(pair=args.pair, rates=_floats("--rates", args.rates),
                                policies=parse_policies(args.policies),
                                num_requests=args.num_requests,
                                output_len=args.output_len, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, k=args.k, profile=args.profile,
                                fitter=args.fitter, acceptance_trace=args.acceptance_trace, sim_seeds=args.sim_seeds,
                                speculative_token_tree=args.speculative_token_tree,
                                acceptance_by_rank=args.acceptance_by_rank,
                                threads=args.threads, seed=args.seed, draft_path=args.draft_path, twin=args.twin,
                                prompt_len=args.prompt_len, device=args.device, dtype=args.dtype, forward=args.forward,
                                cuda_graphs=args.cuda_graphs, max_seconds=args.max_seconds,
                                profile_now=args.profile_now, probe_every=args.probe_every, skip_idle=args.skip_idle,
                                floor_draws=args.floor_draws)
    from simulator.studies.report import recorded_warnings, remove_report

    remove_report(args.out)  # an older run's: the report is written last, after every table
    with recorded_warnings() as printed:
        return _run_and_write(Path(args.out), settings, printed)


def _run_and_write(out: Path, settings: ValidateSettings, printed: list[str]) -> int:
    """The validation proper (:func:`main`, once the flags are read): run, write every table, print, and last
    ``report.html``."""
    from profiles.models import forward
    from profiles.models.pairs import load_pair
    from simulator.results import write_csv, write_json

    device = forward.setup_device(settings.device, settings.threads if settings.device == "cpu" else None)
    pair = load_pair(settings.pair, settings.draft_path, device=device, dtype=settings.dtype)
    out.mkdir(parents=True, exist_ok=True)
    if settings.profile_now:
        print(f"profiling the {settings.pair} engine on this machine first: {out}/engine_profile.csv")
        settings = replace(settings, profile=profile_now(pair, settings, out))
    result = run_validation(pair, settings)
    for (rate, policy), run in result.real.items():
        tag = f"rate{rate:g}_{policy.replace(':', '').replace('/', '_')}"
        write_csv(out / f"requests_{tag}.csv", run.requests)
        write_csv(out / f"steps_{tag}.csv", run.steps)
    write_csv(out / "validate.csv", result.table)
    write_csv(out / "parts.csv", result.parts)
    write_csv(out / "decisions.csv", result.decisions)
    write_csv(out / "speed_probes.csv", result.probes)
    choices = result.choices()
    write_csv(out / "choices.csv", choices)
    write_json(out / "drift.json", result.drift)
    figure = plot(result.table, out / "validate.png",
                  f"{settings.pair}: real engine vs simulator ({settings.num_requests} requests, output "
                  f"{settings.output_len})")
    print(f"\nreal and simulated, seconds (throughput: requests/s):\n{format_table(result.table)}")
    count = int(result.table["metric"].isin(METRICS).sum())
    worst = result.table.loc[result.table["metric"].isin(METRICS), "rel_error_calibrated"].abs().max()
    figures = result.table[result.table["metric"].isin(METRICS)]
    headline = [
        f"median |relative error| over {count} latency, TTFT, TPOT and throughput figures: "
        f"{result.median_abs_error():.1%} as profiled, {result.median_abs_error(calibrated=True):.1%} calibrated "
        f"(machine speed {result.parts['speed'].min():.3f}..{result.parts['speed'].max():.3f} x the profile's)",
        f"worst |relative error| {worst:.1%} calibrated; sampling noise (95% bootstrap half-width, median over "
        f"figures): of the real figures {figures['real_noise'].median():.1%}, of the errors (requests resampled "
        f"alike on both sides) {figures['error_noise'].median():.1%}; machine drift over the run "
        f"{result.drift['after_over_before']:.3f}x (reference pass before/after)",
        f"diagnostic, fitted to each run (no prediction): at the speed read off the run's own passes "
        f"({result.table['step_speed'].min():.3f}..{result.table['step_speed'].max():.3f} x the profile's) the "
        f"median |error| is {figures['rel_error_step_speed'].abs().median():.1%}, worst "
        f"{figures['rel_error_step_speed'].abs().max():.1%}: what is left where the machine's speed is known exactly"]
    if settings.floor_draws:
        floor = figures["timing_floor"]
        worst_floor = figures.loc[floor.idxmax()]
        headline.append(
            f"timing floor (an exact cost model against this engine's own per-pass scatter, log-sd "
            f"{figures['pass_scatter'].min():.3f}..{figures['pass_scatter'].max():.3f}; median over "
            f"{settings.floor_draws} draws): median {floor.median():.1%}, largest {floor.max():.1%} "
            f"({worst_floor['metric']} at {worst_floor['rate']:g} req/s, {worst_floor['policy']}); "
            f"{int((figures['rel_error_calibrated'].abs() <= figures['timing_floor']).sum())} of {len(figures)} "
            f"figures err by no more than their floor")
    print("\n" + "\n".join(headline))
    decision = [
        f"the simulator picks the real engine's best policy at {choices['same_choice'].sum()} of {len(choices)} "
        f"rates; at {choices['same_choice_normalized'].sum()} of {len(choices)} with each real run divided by its "
        f"machine speed (the policies' runs met machines {result.table['speed'].min():.3f}.."
        f"{result.table['speed'].max():.3f}x the profile's)",
        f"speculation stops paying at: real {crossover(choices, 'real'):g} req/s, simulated "
        f"{crossover(choices, 'sim'):g} req/s (nan: pays at every validated rate)"]
    print(f"\nthe decision, per rate (lowest mean latency):\n{choices.to_string(index=False)}")
    print("\n".join(decision))
    payoffs = policy_payoffs(result.table)
    write_csv(out / "payoffs.csv", payoffs)
    if len(payoffs):
        print(f"\neach speculative policy against no-spec (mean latency ratio; below 1 it pays):\n"
              f"{payoffs.to_string(index=False, float_format='{:.3f}'.format)}")
    print(f"\nhow each policy decided, real and simulated:\n"
          f"{result.decisions[result.decision_columns()].to_string(index=False, float_format='{:.3f}'.format)}")
    print(f"\nwhere the time goes (every real step, measured vs the cost model on its shape), seconds:\n"
          f"{format_parts(result.parts)}")
    report = write_report(out, settings, result, choices, payoffs, headline + decision, [*result.skipped, *printed],
                          figure)
    print(f"\nresults: {out}/validate.csv, {out}/validate.png\nreport: {report}")
    return 0
