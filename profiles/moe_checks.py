"""The simulator's speculation on mixture-of-experts targets checked against published measurements (issue 31 item 6).

Each :class:`Setup` is a published deployment with speculation: its analytical profile (:mod:`profiles.analytical`:
the target and its MTP head on the GPUs and tensor-parallel degree published), calibrated on that deployment's
**own decode speed without speculation** (``fit`` rows of ``profiles/data/moe_speculation/checks.csv``, each with
its source), then run through the simulator (:func:`simulator.core.runner.run_simulation`: a closed loop of
``batch_size`` requests sent at once, as ``bench_one_batch`` and SpecDecode-Bench's fixed batches) without
speculation and with a chain of ``k`` MTP drafts at the published acceptance. The draft head's per-pass overhead is
fitted to one published speedup, the smallest batch of each speculative series (batch 1: a ``fit`` row with a
speedup); the simulated speedup (output throughput with / without) at every other batch is compared with the
published one (``check`` rows), which no fit has seen.

The calibration: the roofline's efficiencies and per-pass overhead were fitted to a dense 8B engine on one H200
(:data:`profiles.analytical.EFFICIENCY_SOURCE`); a MoE target at tensor parallelism 8 pays more per layer (fused-MoE
kernels' fixed cost, two all-reduces a layer, routing), which the roofline leaves out (docs/profiles.md: DeepSeek-V3
on 8 x H200 decodes in 7 ms a token by the roofline, about 23 ms as published). :func:`fit` refits
``overhead_per_layer_s`` (and, where the series has several batch sizes, ``bandwidth``) by least squares on the log
ratio of the roofline's decode step to the published no-speculation step (``batch / tokens per second``). The draft
head's passes take the same efficiencies and per-layer overhead (its one layer), and a per-pass overhead of their own
(``overhead_fixed_s`` of the draft's :class:`Efficiency`, priced through ``analytical_profile(..., draft_eff=...)``):
each of the ``k`` sequential draft passes of a step is a forward of its own (launch, synchronisation, sampling), as
the speculative calibration's ``head_pass_s`` (:class:`profiles.spec_calibrate.SpecCalibration`). No speed without
speculation can tell it apart from the target's, so :func:`fit_draft` fits it to the series' batch-1 speedup with
speculation; the larger batches stay held out.

Where one source gives both speeds at several batches, :func:`routing_readings` asks the published numbers alone how
the batch routed (bandwidth arithmetic, no fit): SpecDecode-Bench's GLM-4.5-Air batches of B identical greedy copies
decoded without speculation in steps below what independent routing could read at the datasheet's bandwidth (the
copies woke the same experts), and with MTP in steps at that floor (as if independently); no one routing for both
arms gives its batch-4 speedup within :data:`TOLERANCE`. Its n-gram arm's steps grow with the batch as plain decoding's
(:func:`step_growth`): what woke more experts is particular to the MTP path (docs/profiles.md).

    python -m profiles.moe_checks --out results/moe_checks      # prints the tables, writes moe_checks.csv,
                                                                # routing_readings.csv and step_growth.csv there
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import brentq, least_squares

from policies.errors import FlagParser, exit_on_user_error
from policies.goodput import expected_tokens
from profiles.analytical import DATA_DIR, Deployment, Efficiency, GPUS, Placement, analytical_profile, pass_cost
from profiles.architectures import Architecture
from profiles.architectures.moe import MoE, woken_experts
from profiles.architectures.precision import WEIGHT_BYTES
from profiles.grid import Grid

MOE_DATA = DATA_DIR / "moe_speculation"
#: The published numbers used here, one row a (series, batch): ``fit`` rows (tokens/s without speculation) and
#: ``check`` rows (speedup with speculation), each with its source.
MEASUREMENTS = MOE_DATA / "checks.csv"
#: SpecDecode-Bench's Fig. 3 bars read from the vector PDF: every method's tokens/s by batch (source: its README).
FIG3 = DATA_DIR / "specdecode_bench" / "fig3_reasoning_throughput.csv"
#: GLM-4.5-Air's config assembled from quoted values (its ``_source`` and ``_unverified`` keys say which).
GLM_45_AIR = MOE_DATA / "glm-4.5-air.assembled.json"
#: How far a simulated speedup may be from the published one (issue 31 item 6).
TOLERANCE = 0.15
#: The profile grid the checks need: batches up to 32, a verification of up to 4 tokens, contexts to 2k.
GRID = Grid(batch_sizes=(1, 2, 4, 8, 16, 32), query_lens=(1, 2, 3, 4), context_lens=(128, 256, 512, 1024, 2048),
            prefill_lens=(128, 256, 512, 1024), max_prefill_tokens=16384)
#: Bounds of the fitted :class:`Efficiency` fields (the draft's ``overhead_fixed_s``: :func:`fit_draft`).
BOUNDS = {"overhead_per_layer_s": (0.0, 2e-3), "bandwidth": (0.3, 1.0), "overhead_fixed_s": (0.0, 5e-3)}


def constant_rate(acceptance_length: float, k: int) -> float:
    """The per-token acceptance rate a with 1 + a + ... + a^k = ``acceptance_length`` (Leviathan et al., arXiv
    2211.17192, eq. 1, for k drafts): where a source prints only the mean acceptance length."""
    return brentq(lambda a: sum(a ** j for j in range(k + 1)) - acceptance_length, 0.0, 1.0)


def conditional(unconditional: tuple[float, ...]) -> tuple[float, ...]:
    """vLLM's per-position acceptance (the share of steps whose j-th draft was accepted) as the simulator's
    ``position`` model reads it (accepted given all before were): p_j / p_(j-1)."""
    return tuple(p / q for p, q in zip(unconditional, (1.0,) + unconditional[:-1]))


@dataclass(frozen=True)
class Setup:
    """A published deployment with MTP speculation, and the published series it is fitted on and checked against."""

    name: str
    gpu_key: str
    target: str
    tp: int
    k: int
    """Drafts a step (SGLang ``--speculative-num-steps``; vLLM ``num_speculative_tokens``)."""
    positions: tuple[float, ...]
    """Acceptance given all earlier drafts were accepted, per position (the simulator's ``position`` model)."""
    acceptance_source: str
    prompt_len: int
    output_len: int
    speed_series: str
    """The published speeds without speculation (``fit`` rows) the target's :class:`Efficiency` is fitted to."""
    spec_series: str
    """The published speedups with speculation: the ``fit`` row (its smallest batch) sets the draft's per-pass
    overhead, the ``check`` rows are held out."""
    free: tuple[str, ...]
    """The :class:`Efficiency` fields fitted to ``speed_series``."""


#: DeepSeek-V3's MTP chain of 3 drafts (the docs' default, ``--speculative-num-steps 3 --speculative-eagle-topk 1
#: --speculative-num-draft-tokens 4``) at the acceptance length LMSYS measured for that window.
DEEPSEEK_ACCEPTANCE = (constant_rate(2.44, 3),)
DEEPSEEK_ACCEPTANCE_SOURCE = (
    "acceptance length 2.44 with a 4-token MTP window, topk 1, DeepSeek-V3 on H200 (lm-sys/lm-sys.github.io "
    "blog/2025-07-17-mtp.md, 'Accelerating SGLang with Multiple Token Prediction', case study 1); the docs print no "
    "acceptance for their 1.8x / 1.5x; one rate a a position, 1 + a + a^2 + a^3 = 2.44")
GLM_ACCEPTANCE_SOURCE = (
    "per-position acceptance 0.92, 0.68, 0.38 on GPQA-Main printed by SpecDecode-Bench (index.md @9f0752d9; "
    "profiles/data/specdecode_bench/fig3_acceptance_by_position.csv), read as vLLM's unconditional rates")

SETUPS = (
    Setup("deepseek-v3 mtp, fit on PR #3582's no-MTP speed", "h200", "deepseek-v3", 8, 3, DEEPSEEK_ACCEPTANCE,
          DEEPSEEK_ACCEPTANCE_SOURCE, 128, 256, "deepseek-v3/sglang-pr3582", "deepseek-v3/sglang-docs",
          ("overhead_per_layer_s",)),
    Setup("deepseek-v3 mtp, fit on v0.4.1.post2's batch 1/8/32", "h200", "deepseek-v3", 8, 3, DEEPSEEK_ACCEPTANCE,
          DEEPSEEK_ACCEPTANCE_SOURCE, 128, 256, "deepseek-v3/sglang-v0.4.1.post2", "deepseek-v3/sglang-docs",
          ("overhead_per_layer_s", "bandwidth")),
    Setup("glm-4.5-air mtp (vLLM 0.11.1rc1, GPQA-Main)", "h100-80gb", str(GLM_45_AIR), 4, 3,
          conditional((0.92, 0.68, 0.38)), GLM_ACCEPTANCE_SOURCE, 256, 1024, "glm-4.5-air/specdecode-bench",
          "glm-4.5-air/specdecode-bench", ("overhead_per_layer_s", "bandwidth")),
)


def measurements(series: str, use: str, quantity: str) -> pd.DataFrame:
    """The ``use`` rows (``fit`` or ``check``) of one published series that give ``quantity`` (``no_spec_tok_s`` or
    ``speedup``)."""
    table = pd.read_csv(MEASUREMENTS)
    return table[(table["series"] == series) & (table["use"] == use)
                 & table[quantity].notna()].reset_index(drop=True)


def decode_step_s(setup: Setup, batch_size: int, eff: Efficiency) -> float:
    """The roofline's seconds of one decode step without speculation at the run's mean context."""
    place = Placement.of(Deployment(setup.gpu_key, setup.target, "mtp", setup.tp))
    context = setup.prompt_len + setup.output_len // 2
    return pass_cost(place.archs["target"], GPUS[setup.gpu_key], "decode", batch_size, 1, context, 2, setup.tp, eff,
                     weights=place.weights["target"]).seconds


def fit(setup: Setup) -> Efficiency:
    """The default :class:`Efficiency` with ``setup.free`` refitted to the series' published speeds without
    speculation (least squares on log(roofline step / published step))."""
    points = measurements(setup.speed_series, "fit", "no_spec_tok_s")

    def efficiency(x: np.ndarray) -> Efficiency:
        return replace(Efficiency(), **dict(zip(setup.free, (float(v) for v in x))))

    def residuals(x: np.ndarray) -> list[float]:
        eff = efficiency(x)
        return [math.log(decode_step_s(setup, int(b), eff) * tok_s / b)
                for b, tok_s in zip(points["batch_size"], points["no_spec_tok_s"])]

    start = [getattr(Efficiency(), name) for name in setup.free]
    lower, upper = zip(*(BOUNDS[name] for name in setup.free))
    return efficiency(least_squares(residuals, start, bounds=(lower, upper)).x)


def batch_throughput(profile: str | Path, batch_size: int, prompt_len: int, output_len: int, k: int = 0,
                     positions: tuple[float, ...] = (), method: str = "mtp") -> float:
    """Output tokens/s of ``batch_size`` requests of fixed lengths sent at once (a closed loop of one wave, as
    ``bench_one_batch`` runs), through the simulator on ``profile`` (interpolated over its grid): without
    speculation for ``k`` = 0, else a chain of ``k`` drafts of ``method`` accepted per position as ``positions``
    (the simulator's ``position`` model)."""
    from simulator.config import SimConfig
    from simulator.core.runner import run_simulation

    spec = {"policy": "fixed-k", "k": k, "acceptance": "position", "acceptance_positions": positions,
            "speculative_method": method} if k else {"policy": "no-spec"}
    config = SimConfig.of(profile=str(profile), fitter="interp", rate=float("inf"), num_requests=batch_size,
                          max_concurrency=batch_size, prompt_len=prompt_len, output_len=output_len, seed=0, **spec)
    return float(run_simulation(config).summary["output_throughput"])


def simulate(profile: Path, setup: Setup, batch_size: int, speculate: bool) -> float:
    """Output tokens/s of ``setup``'s requests at ``batch_size`` (:func:`batch_throughput`), with its MTP chain or
    without."""
    return batch_throughput(profile, batch_size, setup.prompt_len, setup.output_len, setup.k if speculate else 0,
                            setup.positions)


def speedup(profile: Path, setup: Setup, batch_size: int) -> float:
    """Simulated output throughput with ``setup``'s MTP chain over without, at ``batch_size``."""
    return simulate(profile, setup, batch_size, True) / simulate(profile, setup, batch_size, False)


def write_calibrated(setup: Setup, eff: Efficiency, draft_eff: Efficiency, profile: Path, grid: Grid = GRID) -> Path:
    """``setup``'s analytical profile over ``grid``, its target priced with ``eff`` and its MTP head with
    ``draft_eff``, written to ``profile`` (its metadata naming what was fitted to what)."""
    from simulator.costs.profile_table import write_profile

    frame, meta = analytical_profile(Deployment(setup.gpu_key, setup.target, "mtp", setup.tp), grid, eff=eff,
                                     draft_eff=draft_eff)
    data = MEASUREMENTS.relative_to(DATA_DIR.parents[1])
    meta["efficiency_source"] = (f"profiles/moe_checks.py: {', '.join(setup.free)} fitted to {setup.speed_series} "
                                 f"({data}), the draft's overhead_fixed_s to {setup.spec_series}'s fit row(s); the "
                                 f"rest profiles.analytical.EFFICIENCY_SOURCE")
    write_profile(frame, meta, profile)
    return profile


def fit_draft(setup: Setup, eff: Efficiency, profile: Path) -> Efficiency:
    """The MTP head's :class:`Efficiency`: ``eff`` with its per-pass ``overhead_fixed_s`` refitted (least squares on
    simulated - published speedup) to the ``fit`` speedup(s) of ``setup.spec_series``, simulated on profiles written
    to ``profile`` (:func:`write_calibrated`; the last one written is the last candidate tried, not the fit)."""
    points = measurements(setup.spec_series, "fit", "speedup")

    def draft_eff(x: np.ndarray) -> Efficiency:
        return replace(eff, overhead_fixed_s=float(x[0]))

    def residuals(x: np.ndarray) -> list[float]:
        write_calibrated(setup, eff, draft_eff(x), profile)
        return [speedup(profile, setup, int(b)) - s for b, s in zip(points["batch_size"], points["speedup"])]

    lower, upper = BOUNDS["overhead_fixed_s"]
    return draft_eff(least_squares(residuals, [eff.overhead_fixed_s], bounds=([lower], [upper])).x)


def check(setup: Setup, out_dir: Path) -> pd.DataFrame:
    """One row a published point of ``setup``: the fit points (tokens/s without speculation; the batch-1 speedup the
    draft overhead is fitted to) and the held-out checks (speedup), published against simulated; where one source
    gives both speeds of a batch, a ``derived`` row of tokens/s with MTP (its speedup times its speed without), which
    tells a miss of the speedup in the speed with speculation from one in the speed without."""
    eff = fit(setup)
    slug = "".join(c if c.isalnum() else "-" for c in setup.name.split(",")[0] + "-" + setup.speed_series)
    profile = out_dir / f"{slug}.csv"
    draft_eff = fit_draft(setup, eff, profile)
    write_calibrated(setup, eff, draft_eff, profile)
    fitted = ", ".join([f"{name} {getattr(eff, name):.4g}" for name in setup.free]
                       + [f"draft overhead_fixed_s {draft_eff.overhead_fixed_s:.4g}"])
    rows, plain = [], {}  # plain: by batch size, the (published, simulated) tokens/s without speculation
    for row in measurements(setup.speed_series, "fit", "no_spec_tok_s").itertuples():
        sim = simulate(profile, setup, row.batch_size, False)
        plain[row.batch_size] = (row.no_spec_tok_s, sim)
        rows.append({"setup": setup.name, "use": "fit", "batch_size": row.batch_size, "quantity": "tok/s no-spec",
                     "published": row.no_spec_tok_s, "simulated": sim, "error": sim / row.no_spec_tok_s - 1,
                     "fitted": fitted, "source": row.source})
    for use in ("fit", "check"):
        for row in measurements(setup.spec_series, use, "speedup").itertuples():
            b = row.batch_size
            with_mtp = simulate(profile, setup, b, True)
            without = plain[b][1] if b in plain else simulate(profile, setup, b, False)
            sim = with_mtp / without
            rows.append({"setup": setup.name, "use": use, "batch_size": b, "quantity": "speedup",
                         "published": row.speedup, "simulated": sim, "error": sim - row.speedup, "fitted": fitted,
                         "source": row.source})
            if setup.spec_series == setup.speed_series and b in plain:  # one source's two speeds: the MTP one
                published = row.speedup * plain[b][0]
                rows.append({"setup": setup.name, "use": "derived", "batch_size": b, "quantity": "tok/s MTP",
                             "published": published, "simulated": with_mtp, "error": with_mtp / published - 1,
                             "fitted": fitted, "source": f"published speedup x tok/s no-spec ({row.source})"})
    return pd.DataFrame(rows)


@lru_cache(maxsize=None)
def _architecture(target: str) -> Architecture:
    """The target's architecture, its config read once (:func:`expert_read_s` asks for it per token count)."""
    return Architecture.from_config(target, "--target")


def expert_read_s(setup: Setup, tokens: int) -> float:
    """Seconds one pass of ``tokens`` tokens routed independently (uniform, :func:`woken_experts`) spends reading its
    woken experts' weights on one of ``setup.tp`` devices at the GPU's peak HBM bandwidth, over the target's MoE
    layers: a floor of what those experts add to a pass (nothing else in it counted, the datasheet's bandwidth)."""
    arch = _architecture(setup.target)
    width = WEIGHT_BYTES[arch.precisions()["experts"]]
    read = sum(count * woken_experts(tokens, layer.ffn.experts, layer.ffn.top_k) * layer.ffn.expert_params * width
               for layer, count in arch.layer_counts if isinstance(layer.ffn, MoE))
    return read / setup.tp / GPUS[setup.gpu_key].hbm_bandwidth


def routing_readings(setup: Setup) -> pd.DataFrame:
    """What the published speeds themselves say of how a batch's requests routed, where one source gives both speeds
    at several batches (SpecDecode-Bench's batches of B identical greedy copies): bandwidth arithmetic on the published
    numbers, nothing fitted and no simulation. From the published batch-1 steps (seconds a step: ``batch`` / tokens/s
    without speculation, ``batch`` x L / tokens/s with it, L = 1 + the sum of the unconditional position rates), each
    larger batch's step

    - **if the requests routed independently** is at least the batch-1 step plus the reading of the experts the added
      tokens wake (:func:`expert_read_s` of B tokens without speculation, B (k + 1) verified with it, less batch 1's):
      a floor, as the rest of a pass only grows with the batch;
    - **if the copies routed alike** (the same tokens, the same experts) the expert reads stay those of batch 1: the
      step without speculation is then at least batch 1's, and with speculation about batch 1's plus what the batch
      added without it (the context read and the per-request work, the same requests; an estimate, not a floor).

    The speedup each reading gives when both arms route the same way (L x step without / step with: independent, from
    both floors; alike, from the published step without and the estimate with) is set against the published one.
    ``closer``: the reading whose step is nearer the published one (by log ratio)."""
    speeds = measurements(setup.speed_series, "fit", "no_spec_tok_s").set_index("batch_size")["no_spec_tok_s"]
    gains = pd.concat([measurements(setup.spec_series, use, "speedup") for use in ("fit", "check")]
                      ).set_index("batch_size")["speedup"]
    length = float(expected_tokens(setup.positions)[-1])  # tokens a step emits a request
    without = {b: b / speeds[b] for b in speeds.index if b in gains.index}  # the published steps, seconds
    with_spec = {b: b * length / (gains[b] * speeds[b]) for b in without}
    rows = []
    verified = setup.k + 1  # tokens a request verifies a step with speculation
    for b in sorted(without)[1:]:
        free_without = without[1] + expert_read_s(setup, b) - expert_read_s(setup, 1)
        free_with = with_spec[1] + expert_read_s(setup, b * verified) - expert_read_s(setup, verified)
        alike_with = with_spec[1] + without[b] - without[1]
        for arm, published, independent, alike in (("without MTP", without[b], free_without, without[1]),
                                                   ("with MTP", with_spec[b], free_with, alike_with)):
            nearer = abs(math.log(published / independent)) < abs(math.log(published / alike))
            rows.append({"setup": setup.name, "batch_size": b, "quantity": f"step ms {arm}",
                         "published": 1e3 * published, "if independent": 1e3 * independent, "if alike": 1e3 * alike,
                         "closer": "independent" if nearer else "alike"})
        rows.append({"setup": setup.name, "batch_size": b, "quantity": "speedup, both arms one way",
                     "published": gains[b], "if independent": length * free_without / free_with,
                     "if alike": length * without[b] / alike_with, "closer": ""})
    return pd.DataFrame(rows)


def run_checks(out_dir: str | Path, setups: tuple[Setup, ...] = SETUPS) -> pd.DataFrame:
    """Every setup's fit and check rows, written to ``out_dir/moe_checks.csv`` (the profiles beside it);
    ``within``: a held-out check's speedup within :data:`TOLERANCE` of the published one (empty for fit and derived
    rows, the fitted batch-1 speedups among them)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = pd.concat([check(setup, out) for setup in setups], ignore_index=True)
    table["within"] = np.where(table["use"] == "check", (table["error"].abs() <= TOLERANCE).map(str), "")
    table.to_csv(out / "moe_checks.csv", index=False)
    return table


def step_growth(model: str = "zai-org/GLM-4.5-Air") -> pd.DataFrame:
    """Each method's published step at a batch over its step at batch 1, by dataset (SpecDecode-Bench's Fig. 3 bars,
    :data:`FIG3`): batch x tokens/s at batch 1 / tokens/s at the batch, the growth of the step as long as a step emits
    as many tokens a request as at batch 1 (so for copies of one prompt). Without speculation and with n-gram drafts
    (looked up in the copies' identical contexts) it grows alike; with MTP far more (docs/profiles.md)."""
    bars = pd.read_csv(FIG3)
    bars = bars[bars["model"] == model]
    first = bars[bars["batch_size"] == 1].set_index(["dataset", "method"])["throughput_tok_s"]
    rows = [{"dataset": row.dataset, "method": row.method, "batch_size": row.batch_size,
             "step over batch 1's": row.batch_size * first[row.dataset, row.method] / row.throughput_tok_s}
            for row in bars.itertuples() if row.batch_size > 1]
    return pd.DataFrame(rows).sort_values(["dataset", "method", "batch_size"], ignore_index=True)


def run_readings(out_dir: str | Path, setups: tuple[Setup, ...] = SETUPS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`routing_readings` of every setup whose speeds with and without speculation come from one source, and
    :func:`step_growth` of GLM-4.5-Air's bars, written to ``out_dir/routing_readings.csv`` and ``step_growth.csv``."""
    table = pd.concat([routing_readings(s) for s in setups if s.spec_series == s.speed_series], ignore_index=True)
    table.to_csv(Path(out_dir) / "routing_readings.csv", index=False)
    growth = step_growth()
    growth.to_csv(Path(out_dir) / "step_growth.csv", index=False)
    return table, growth


def main(argv: list[str]) -> int:
    parser = FlagParser(prog="python -m profiles.moe_checks", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/moe_checks", help="folder for the table and the fitted profiles")
    args = parser.parse_args(argv)
    table = run_checks(args.out)
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(table.drop(columns=["source"]).round(3).to_string(index=False))
    readings, growth = run_readings(args.out)
    print("\nWhat the published steps say of routing (bandwidth arithmetic from the published batch-1 steps; "
          "routing_readings):")
    print(readings.round(3).to_string(index=False))
    print("\nGLM-4.5-Air's published step at batch 2 and 4 over batch 1's, by method (step_growth):")
    print(growth.pivot(index=["dataset", "method"], columns="batch_size").round(3).to_string())
    for setup in SETUPS:
        print(f"{setup.name}: k = {setup.k}, acceptance {', '.join(f'{p:.3f}' for p in setup.positions)} "
              f"({setup.acceptance_source})")
    return 0


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
