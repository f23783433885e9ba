"""``python run_sim.py validate``: the simulator against the real engine, on the same requests.

    python run_sim.py validate --rates 0.5,1,2 --policies no-spec,fixed-k:3,goodput --out results/validate

For each rate, one workload: ``--num-requests`` Poisson arrivals (the same draws at every rate, only
closer together) of shipped prompts (a seeded shuffle, the same at every rate) with ``--output-len``
tokens each. Each policy serves it twice:

- **real**: the engine (:mod:`profiles.serving.engine`) on the pair's models, greedy, on the wall clock;
- **simulated**: :func:`simulator.core.runner.run_simulation` with ``workload=`` that same workload, the engine's
  cost profile (``--profile``, measured by ``run_sim.py profile --engine``; the ``--fitter`` fit) and the
  measured acceptance replayed (``--acceptance-trace``), no KV-block limit (as the engine), averaged over
  ``--sim-seeds`` seeds of the acceptance replay;
- **simulated, calibrated**: the same with every profile time multiplied by the machine's speed now
  relative to when the profile was measured (:func:`profiles.engine_profile.machine_speed`, re-timing a few
  profile points just before the real run): a shared machine's speed drifts by 5-15% over minutes, which
  is not the simulator's error.

Printed: the mean, p50 and p90 of latency, TTFT and TPOT and the throughput (requests/s), real and
simulated (calibrated), with the relative errors (sim - real) / real and their median absolute value; the
acceptance rates, real and simulated; then where the time goes: every real step's parts (target prefill +
draft prefill, draft passes, verification, the rest: overhead) against the cost model's prediction for that
same step's shape, which tells a cost-model error from a scheduling or acceptance one. Written to ``--out``: ``validate.csv`` (the table), ``parts.csv``,
each real run's ``requests_*.csv`` and ``steps_*.csv``, and ``validate.png`` (real and simulated mean
latency and TTFT against the rate, one colour per policy).

``--pair tiny`` runs random tiny models on random prompts (for tests); it needs ``--profile`` and
``--acceptance-trace`` made for that pair.

**Timing twin** (``--twin RATE``): both engines take their accept/reject decisions from the constant
acceptance model of per-token rate RATE (:class:`simulator.inputs.acceptance.ConstantAcceptance`) instead of the
tokens (the real engine's outputs are then meaningless, and say so), so that the timing can be validated on
random-weight pairs of any size: ``--pair TARGET+DRAFT`` (model configs, e.g. ``llama-2-7b+llama-68m``) in
``--dtype`` on ``--device``, ``--prompt-len`` random tokens per prompt, on either ``--forward`` path, against any
profile of that pair (an operator profile of ``run_sim.py profile`` has no per-step overhead rows: the
simulator then charges none). ``--max-seconds`` starts no new run past that budget (the table says which
ran). Machine speed is re-measured only against an engine profile (``profile --engine``); otherwise 1.
"""
from __future__ import annotations

import argparse
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from profiles.models.pairs import PAIRS, ModelPair
from policies.errors import UserError
from simulator.costs.profile_table import meta_path, read_json

HERE = Path(__file__).resolve().parents[1]  # profiles/
VALIDATION_PROFILE = HERE / "data" / "cpu__smollm2-135m__smollm2-draft.csv"
VALIDATION_TRACE = HERE / "data" / "acceptance__smollm2.csv"
METRICS = ["mean_latency", "p50_latency", "p90_latency", "mean_ttft", "p50_ttft", "p90_ttft",
           "mean_tpot", "p50_tpot", "p90_tpot", "throughput"]
#: More KV blocks than any validation run uses: the engine has no block limit.
UNLIMITED_BLOCKS = 1_000_000


@dataclass(frozen=True)
class ValidateSettings:
    """What a validation run depends on (see the command's flags)."""

    pair: str = "smollm2"
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    policies: tuple[str, ...] = ("no-spec", "fixed-k:3", "goodput")
    num_requests: int = 12
    output_len: int = 32
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    k: int = 4
    profile: str = str(VALIDATION_PROFILE)
    fitter: str = "interp"
    acceptance_trace: str = str(VALIDATION_TRACE)
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

    def __post_init__(self) -> None:
        if self.pair not in PAIRS and "+" not in self.pair:
            raise UserError(f"--pair: must be one of {', '.join(PAIRS)} or TARGET+DRAFT (got {self.pair!r})")
        if "+" in self.pair and self.twin is None:
            raise UserError(f"--pair {self.pair}: random-weight models need --twin RATE (their tokens mean nothing)")
        if self.twin is not None and not 0 <= self.twin <= 1:
            raise UserError(f"--twin: the acceptance rate must be in [0, 1] (got {self.twin})")
        if self.prompt_len is not None and self.prompt_len < 1:
            raise UserError(f"--prompt-len: must be >= 1 (got {self.prompt_len})")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise UserError(f"--max-seconds: must be > 0 (got {self.max_seconds})")
        if not self.rates or any(not r > 0 for r in self.rates):
            raise UserError(f"--rates: need rates > 0 (got {','.join(map(str, self.rates))})")
        for name in ("num_requests", "output_len", "max_num_seqs", "max_num_batched_tokens", "sim_seeds", "threads"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be >= 1 (got {getattr(self, name)})")
        files = [("--profile", self.profile)] + ([("--acceptance-trace", self.acceptance_trace)] if self.twin is None else [])
        for flag, path in files:
            if not Path(path).is_file():
                raise UserError(f"{flag} {path}: no such file")
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

    def median_abs_error(self, calibrated: bool = False) -> float:
        """Median |relative error| over the latency, TTFT, TPOT and throughput figures."""
        column = "rel_error_calibrated" if calibrated else "rel_error"
        return float(self.table.loc[self.table["metric"].isin(METRICS), column].abs().median())


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
    from profiles.serving.engine import EngineConfig, RealEngine
    from simulator.inputs.acceptance import ConstantAcceptance
    from simulator.costs.cost_model import load_cost_model
    from profiles.engine_profile import machine_speed
    from simulator.costs.profile_table import read_profile
    from simulator.core.runner import run_simulation
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

    def engine_config(config: typing.Any) -> EngineConfig:
        """The real engine's settings for what ``config`` simulates (the same serving fields)."""
        return EngineConfig.from_sim_config(config, forward=settings.forward, cuda_graphs=settings.cuda_graphs)

    def twin(seed: int) -> ConstantAcceptance | None:
        return None if settings.twin is None else ConstantAcceptance(settings.twin, np.random.default_rng(seed))
    scratch = tempfile.TemporaryDirectory(prefix="specsim-validate-")
    specs = [parse_policy_spec(s) for s in settings.policies]
    rows, parts, real = [], [], {}
    runs = workloads(settings, prompt_pool(pair, settings.seed, settings.prompt_len))
    # Warm up (first passes pay for lazy initialisation): two requests, speculating, not recorded.
    warm_prompts = next(iter(runs.values()))[1][:2]
    warm_workload = next(iter(runs.values()))[0]
    RealEngine(pair.target, pair.draft, engine_config(simulation_config(
        warm_workload, "fixed-k", settings.k, (), settings.profile, settings.acceptance_trace, settings.fitter,
        settings.max_num_seqs, settings.max_num_batched_tokens, twin=settings.twin)),
        make_policy("fixed-k", settings.k), cost,
                  np.random.default_rng(settings.seed), twin(settings.seed)).run(
        Workload(np.zeros(len(warm_prompts)), [len(p) for p in warm_prompts], np.full(len(warm_prompts), 8), "warm-up"),
        warm_prompts)
    for rate, (workload, prompts) in runs.items():
        for spec, (name, k, params) in zip(settings.policies, specs):
            if settings.max_seconds is not None and time.monotonic() - started > settings.max_seconds:
                log(f"rate {rate:g} {spec}: not run, past --max-seconds {settings.max_seconds:g}")
                continue
            k = settings.k if k is None else k
            speed = machine_speed(pair, table.frame, spread, 0.0, settings.seed) if engine_profile else 1.0
            config = simulation_config(workload, name, k, params, settings.profile, settings.acceptance_trace,
                                       settings.fitter, settings.max_num_seqs, settings.max_num_batched_tokens,
                                       rate=rate, twin=settings.twin)
            engine = RealEngine(pair.target, pair.draft, engine_config(config), make_policy(name, k, dict(params)),
                                cost, np.random.default_rng(settings.seed), twin(settings.seed + 1))
            result = engine.run(workload, prompts)
            real[(rate, spec)] = result
            calibrated = scaled_profile(table, speed, Path(scratch.name) / f"speed{len(rows)}.csv")
            sims, sims_cal = ([run_simulation(c.replace(seed=s), workload=workload).summary
                               for s in range(settings.sim_seeds)]
                              for c in (config, config.replace(profile=calibrated, policy_profile=settings.profile)))
            for metric in METRICS + ["acceptance_rate"]:
                r = float(result.summary[metric])
                s, c = (float(np.mean([x[metric] for x in runs_])) for runs_ in (sims, sims_cal))
                rows.append({"rate": rate, "policy": spec, "metric": metric, "real": r, "sim": s,
                             "rel_error": (s - r) / r if r else np.nan, "sim_calibrated": c,
                             "rel_error_calibrated": (c - r) / r if r else np.nan, "speed": speed})
            parts.append(step_parts(result.steps, cost).assign(rate=rate, policy=spec, speed=speed))
            log(f"rate {rate:g} {spec}: machine speed {speed:.3f} x the profile's; mean latency real "
                f"{result.summary['mean_latency']:.3f} s, simulated {np.mean([x['mean_latency'] for x in sims]):.3f} s, "
                f"calibrated {np.mean([x['mean_latency'] for x in sims_cal]):.3f} s")
    scratch.cleanup()
    return Validation(pd.DataFrame(rows), pd.concat(parts, ignore_index=True), real)


def simulation_config(workload: typing.Any, policy: str, k: int, params: tuple[tuple[str, typing.Any], ...],
                      profile: str | Path, acceptance_trace: str | Path, fitter: str, max_num_seqs: int,
                      max_num_batched_tokens: int = 2048, policy_profile: str | Path | None = None,
                      rate: float = 1.0, twin: float | None = None) -> typing.Any:
    """The simulator's config for a run of the real engine on ``workload`` (module docstring): its cost
    ``profile`` (``fitter``), the measured acceptance replayed, no KV-block limit (as the engine), the engine's
    ``max_num_seqs`` and token budget; ``policy_profile``: what the policy prices its choices with (default the
    profile). Pass ``workload=`` to :func:`simulator.core.runner.run_simulation` with it: the arrivals are the
    workload's (``rate`` only names them in the config). ``twin``: the constant acceptance rate of a timing
    twin instead of the replayed trace."""
    from simulator.config import SimConfig

    acceptance = {"acceptance": "replay", "acceptance_trace": str(acceptance_trace)} if twin is None else \
        {"acceptance": "constant", "acceptance_rate": twin}
    return SimConfig(arrival="poisson", rate=rate, num_requests=len(workload), policy=policy, k=k,
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


def step_parts(steps: pd.DataFrame, cost: typing.Any) -> pd.DataFrame:
    """Measured and predicted seconds of each part of a real run's steps, summed over the run.

    The prediction prices each real step's own shape: a prefill of ``batch_size`` prompts of
    ``prefill_tokens`` tokens (target and draft), a decode step of ``batch_size`` requests over
    ``context_tokens`` verifying ``proposed + batch_size`` tokens after ``k_max`` draft passes over the whole
    batch (the engine's passes); overhead = ``overhead_time(batch_size)`` per step.
    """
    speculative = steps["proposed"].sum() > 0 or (steps["draft_seconds"][steps["kind"] == "prefill"] > 0).any()
    measured = {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "overhead": 0.0}
    predicted = dict(measured)
    for s in steps.itertuples():
        b = int(s.batch_size)
        if s.kind == "prefill":
            measured["prefill"] += s.target_seconds + s.draft_seconds
            predicted["prefill"] += cost.prefill_time(b, int(s.prefill_tokens))
            if speculative:
                predicted["prefill"] += cost.prefill_time(b, int(s.prefill_tokens), role="draft")
        else:
            measured["draft"] += s.draft_seconds
            measured["verify"] += s.target_seconds
            predicted["verify"] += cost.target_time(b, int(s.proposed) + b, int(s.context_tokens))
            predicted["draft"] += sum(cost.draft_time(b, int(s.context_tokens) + b * j) for j in range(int(s.k_max)))
        measured["overhead"] += s.seconds - s.target_seconds - s.draft_seconds
        predicted["overhead"] += cost.overhead_time(b)
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
    parts = parts.assign(calibrated=parts["predicted"] * parts["speed"])
    total = parts.groupby("part", sort=False)[["measured", "predicted", "calibrated"]].sum()
    total["rel_error"] = (total["predicted"] - total["measured"]) / total["measured"]
    total["rel_error_calibrated"] = (total["calibrated"] - total["measured"]) / total["measured"]
    seconds, percent = "{:.2f}".format, "{:+.1%}".format
    return total.to_string(formatters={"measured": seconds, "predicted": seconds, "calibrated": seconds,
                                       "rel_error": percent, "rel_error_calibrated": percent})


def plot(table: pd.DataFrame, path: Path, title: str) -> None:
    """Real (solid), simulated (dashed) and calibrated simulated (dotted) mean latency and TTFT against the
    rate, one colour per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("mean_latency", "mean_ttft")):
        for i, (policy, part) in enumerate(table[table["metric"] == metric].groupby("policy", sort=False)):
            color = f"C{i}"
            ax.plot(part["rate"], part["real"], "o-", color=color, label=f"{policy} real")
            ax.plot(part["rate"], part["sim"], "s--", color=color, label=f"{policy} simulated")
            ax.plot(part["rate"], part["sim_calibrated"], "^:", color=color, label=f"{policy} simulated, calibrated")
        ax.set(xlabel="request rate (req/s)", ylabel=f"{metric.replace('_', ' ')} (s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers (got {text!r})") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UserError(f"{self.prog}: {message}")


def build_parser() -> _Parser:
    d = ValidateSettings
    p = _Parser(prog="run_sim.py validate", description=__doc__.splitlines()[0])
    p.add_argument("--pair", default=d.pair, help=f"models: {', '.join(PAIRS)}")
    p.add_argument("--draft-path", help="folder of the draft (default: the shipped profiles/data/smollm2-draft)")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="request rates, req/s")
    p.add_argument("--policies", default=",".join(d.policies), help="policy specs NAME[:K][/PARAM=VALUE...]")
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
    p.add_argument("--out", default="results/validate", help="output folder")
    return p


def main(argv: list[str]) -> int:
    """Run the ``validate`` command; returns the exit status (user errors raise :class:`UserError`)."""
    args = build_parser().parse_args(argv)
    settings = ValidateSettings(pair=args.pair, rates=_floats("--rates", args.rates),
                                policies=tuple(s for s in args.policies.split(",") if s),
                                num_requests=args.num_requests,
                                output_len=args.output_len, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, k=args.k, profile=args.profile,
                                fitter=args.fitter, acceptance_trace=args.acceptance_trace, sim_seeds=args.sim_seeds,
                                threads=args.threads, seed=args.seed, draft_path=args.draft_path, twin=args.twin,
                                prompt_len=args.prompt_len, device=args.device, dtype=args.dtype, forward=args.forward,
                                cuda_graphs=args.cuda_graphs, max_seconds=args.max_seconds)
    from profiles.models import forward
    from profiles.models.pairs import load_pair
    from simulator.results import write_csv

    device = forward.setup_device(settings.device, settings.threads if settings.device == "cpu" else None)
    pair = load_pair(settings.pair, settings.draft_path, device=device, dtype=settings.dtype)
    result = run_validation(pair, settings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for (rate, policy), run in result.real.items():
        tag = f"rate{rate:g}_{policy.replace(':', '').replace('/', '_')}"
        write_csv(out / f"requests_{tag}.csv", run.requests)
        write_csv(out / f"steps_{tag}.csv", run.steps)
    write_csv(out / "validate.csv", result.table)
    write_csv(out / "parts.csv", result.parts)
    plot(result.table, out / "validate.png",
         f"{settings.pair}: real engine vs simulator ({settings.num_requests} requests, output {settings.output_len})")
    print(f"\nreal and simulated, seconds (throughput: requests/s):\n{format_table(result.table)}")
    figures = int(result.table["metric"].isin(METRICS).sum())
    print(f"\nmedian |relative error| over {figures} latency, TTFT, TPOT and throughput figures: "
          f"{result.median_abs_error():.1%} as profiled, {result.median_abs_error(calibrated=True):.1%} calibrated "
          f"(machine speed {result.parts['speed'].min():.3f}..{result.parts['speed'].max():.3f} x the profile's)")
    print(f"\nwhere the time goes (every real step, measured vs the cost model on its shape), seconds:\n"
          f"{format_parts(result.parts)}")
    print(f"\nresults: {out}/validate.csv, {out}/validate.png")
    return 0
