"""``run_sim.py calibrate``: a cost model of the engine people deploy, fitted to vLLM's own benchmark results.

Input: one or more ``vllm bench serve --save-result`` files (``benchmark_serving.py`` before vLLM 0.7) of one
deployment (a GPU, a target model, a tensor-parallel degree) and the vLLM settings they ran with, given as this
simulator's serving flags under vLLM's names (``--num-scheduler-steps``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--scheduler``, ``--cuda-graph-sizes``, ...). Output: a profile (CSV +
``.meta.json``) the simulator reads like any other, whose metadata says ``calibrated to vLLM results`` and records
the files, the settings, the fitted parameters and the held-out error of each file's figures.

What is fitted (:data:`PARAMETERS`), and why: the analytical roofline (:mod:`profiles.analytical`) prices each pass
of the deployment from the GPU's datasheet and the model's architecture, with five numbers left free:

- ``compute`` and ``bandwidth``: the fractions of the datasheet's FLOP/s and HBM bytes/s the engine's kernels
  reach. A burst's TTFTs follow its prefill steps (compute-bound), and its TPOTs and ITLs its decode steps
  (weight and KV reads, bandwidth-bound), so each run's TTFTs and ITLs identify one of them;
- ``pass_overhead_s``: seconds per forward pass beyond its kernels' work (launch or graph replay, input
  preparation, logits read back), which decides the decode step at small batch (10 prompts: the TPOT);
- ``step_per_seq_s``: the engine's CPU work per step and sequence (scheduling, sampling, detokenizing, output
  processing; the profile's ``overhead`` rows), which grows a large batch's step (640 prompts: the TPOT);
- ``frontend_s``: seconds the API server spends on each request before the engine sees it
  (:mod:`simulator.core.engine`): what delays the first token of a burst sent at t = 0 by ~2 ms per request.

Each candidate is written as an analytical profile over :data:`CALIBRATION_GRID`, fitted by the simulator's
``interp`` fitter as the shipped profile is, and every file is replayed in the simulator (its lengths in order;
arrivals at t = 0 for ``request_rate`` inf, else drawn at its rate and burstiness; its ``max_concurrency``);
the loss is the sum of squared log ratios, simulated over measured, of :data:`LOSS_FIGURES` over the files
(Nelder-Mead over the logs of the parameters, so they stay positive). The figures follow vLLM's own conventions
(:func:`simulator.studies.vllm_io.vllm_style_figures`): a request whose stream carried no text counts with TTFT 0
and no output tokens; TPOT only over outputs longer than one token.

Runs with speculation (``vllm bench serve`` of a server started with ``--speculative-config``; the simulation's
``--speculative-method`` and ``--k`` say which): each file is replayed under fixed-k speculation with the acceptance the
file recorded (newer vLLM saves ``spec_decode_per_position_acceptance_rates``, read as acceptance by position, and
``spec_decode_acceptance_length``, read as a per-token rate with that mean; a file without either needs
``--acceptance-length``), and two more parameters may be fitted (:data:`SPEC_PARAMETERS`): the drafter's per-pass
overhead and the seconds a speculative step adds beyond its passes (``spec_overhead`` rows), best with ``--start`` at the
same deployment's calibration without speculation and ``--fit draft_pass_overhead_s,spec_overhead_s``.

Held-out error: each file is predicted by the parameters fitted to the other files alone (leave-one-file-out,
every fit started from the same defaults), and the metadata records each file's simulated and measured
:data:`TARGET_FIGURES` and their relative errors; the shipped profile is the fit to all files. One file holds nothing
out: no held-out error is printed, and the metadata says so. With
``--start META.json`` the parameters not named by ``--fit`` are taken from an earlier calibration (e.g. a 70B
deployment's two files refit what differs from the 8B deployment calibrated on the same GPU and vLLM).

What the files must hold to identify the parameters fitted (:func:`identification_gaps`; a calibration that misses
one still runs, and warns in one line, since its fit and held-out error are then not to be trusted): at least as many
files as parameters fitted, and for each parameter a file whose workload exercises it:

- ``compute``: a file that measured TTFT (prefill steps);
- ``bandwidth``: a file that measured TPOT or ITL (decode steps);
- ``pass_overhead_s`` and ``step_per_seq_s`` fitted together: a file at a small batch (at most
  :data:`SMALL_BATCH` requests in flight) and one at a large batch (at least :data:`LARGE_BATCH`): the one is paid
  per step, the other per step and sequence, and only the batch size tells them apart;
- ``frontend_s``: a burst, at least :data:`BURST_REQUESTS` requests sent at t = 0 (``request_rate`` inf, no
  ``max_concurrency`` below that): the API server's seconds per request add up across a burst's first tokens and
  nowhere else.

Requests in flight: a burst's requests (capped by ``max_concurrency``); at a finite rate, Little's law on the file's own
figures, request rate x mean E2E latency (capped likewise). The thresholds are rules of thumb from the shipped runs
(``profiles/data/vllm_lambda/``: 10 prompts pin the small-batch TPOT, 640 the large-batch one and the API server).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from policies.errors import FlagParser, UserError, warn_user
from policies.step_time import predict_step_seconds
from profiles.analytical import GPUS, Deployment, Efficiency, analytical_profile, draft_for
from profiles.grid import Grid, powers_of_two
from simulator.config import FIELDS, SimConfig, flag_value, rate_to_json
from simulator.costs.cost_model import CostModel, fit_cost_model
from simulator.costs.profile_table import DEPLOYMENT_SETTINGS, ProfileTable, calibration_settings, write_profile
from simulator.inputs.workload import Workload
from simulator.studies import vllm_io

#: The fitted parameters (module docstring), their defaults (the start of every fit) and units.
PARAMETERS = ("compute", "bandwidth", "pass_overhead_s", "step_per_seq_s", "frontend_s")
#: What runs with speculation can fit besides (module docstring), and where such a fit starts when the start has none.
SPEC_PARAMETERS = {"draft_pass_overhead_s": 3e-4, "spec_overhead_s": 1e-4}


@dataclass(frozen=True)
class Calibration:
    """The fitted numbers of a vLLM deployment (module docstring). Fractions, and seconds."""

    compute: float = 0.47
    """Fraction of the datasheet's dense bf16 FLOP/s the engine's kernels reach."""
    bandwidth: float = 0.64
    """Fraction of the datasheet's HBM bytes/s the engine's kernels reach."""
    pass_overhead_s: float = 1e-3
    """Seconds per forward pass beyond its kernels (every pass: target decode and prefill, draft)."""
    step_per_seq_s: float = 2e-5
    """CPU seconds per engine step and running sequence (scheduling, sampling, detokenizing)."""
    frontend_s: float = 2e-3
    """API-server seconds per request before the engine sees it."""
    draft_pass_overhead_s: float | None = None
    """Seconds per *draft* pass beyond its kernels, where the engine drafts otherwise than it runs the target (vLLM
    V1's EAGLE proposer: on the device, inside the engine step; fitted by :func:`fit_draft_overhead`, or to serving
    results with speculation); None: the same ``pass_overhead_s`` as every pass."""
    spec_overhead_s: float | None = None
    """Seconds a speculative step spends beyond its passes (the rejection sampler, the proposer's host work: the
    profile's ``spec_overhead`` rows); fitted to serving results with speculation; None: none."""

    def efficiency(self) -> Efficiency:
        """The analytical model's efficiencies and per-pass overhead (its per-layer term folded into the fixed one)."""
        return replace(Efficiency(), compute=self.compute, bandwidth=self.bandwidth,
                       overhead_fixed_s=self.pass_overhead_s, overhead_per_layer_s=0.0)

    def vector(self, names: Sequence[str]) -> np.ndarray:
        return np.log([getattr(self, n) for n in names])

    def with_vector(self, names: Sequence[str], x: np.ndarray) -> "Calibration":
        return replace(self, **{n: float(math.exp(v)) for n, v in zip(names, x)})


#: The figures each file's simulation is compared on in the loss (vLLM's names; ttft_p90 from its per-request TTFTs,
#: when the file has them).
LOSS_FIGURES = ("duration", "median_tpot_ms", "mean_ttft_ms", "mean_e2el_ms", "median_itl_ms", "ttft_p90_ms")
#: The figures the held-out error is reported on.
TARGET_FIGURES = ("duration", "median_tpot_ms", "mean_ttft_ms", "mean_e2el_ms")

#: The grid calibrated profiles are written over: the GPU profiles' grid with short prompts and contexts added
#: (ShareGPT's prompts are often tens of tokens) and query lengths up to 9 for speculation.
CALIBRATION_GRID = Grid(batch_sizes=powers_of_two(1, 512), query_lens=tuple(range(1, 10)),
                        context_lens=powers_of_two(16, 4096), prefill_lens=powers_of_two(16, 4096),
                        max_prefill_tokens=16384)
#: The grid the loss is evaluated on: the same, target decode at one token a sequence only (no-spec results).
FIT_GRID = replace(CALIBRATION_GRID, query_lens=(1,))


@dataclass(frozen=True)
class Result:
    """One vLLM result file, read and checked, with the workload it replays (made once: every loss evaluation
    replays the same requests)."""

    path: str
    data: dict
    measured: dict[str, float]
    workload: Workload
    """Its successful requests (:func:`simulator.studies.vllm_io.replay_trace`), an empty output as 1 token."""
    empty: np.ndarray
    """Per request of :attr:`workload`: its stream carried no text (vLLM counts it with TTFT 0 and no tokens)."""
    acceptance: dict[str, Any]
    """The acceptance settings its replay runs with (:func:`run_acceptance`; empty without speculation)."""


def read_results(paths: Sequence[str], seed: int = 0, k: int = 0,
                 acceptance_length: float | None = None) -> list[Result]:
    """The files, each read by :func:`simulator.studies.vllm_io.read_vllm_result` (per-request lists required), their
    workloads replayed with ``seed`` (it draws the arrivals of a finite ``request_rate``); ``k`` > 0: runs with
    speculation of k tokens, each with its recorded acceptance (:func:`run_acceptance`)."""
    if not paths:
        raise UserError("calibrate: give one or more vllm bench serve --save-result JSON files")
    out = []
    for path in paths:
        data = vllm_io.read_vllm_result(path, replay=True)
        trace = vllm_io.replay_trace(data, seed)
        workload = Workload(arrival_time=trace["arrival_time"].to_numpy(float),
                            prompt_tokens=trace["prompt_tokens"].to_numpy(np.int64),
                            output_tokens=trace["output_tokens"].to_numpy(np.int64), source=str(path))
        acceptance = run_acceptance(str(path), data, k, acceptance_length) if k else {}
        out.append(Result(str(path), data, measured_figures(data), workload, trace["empty_output"].to_numpy(bool),
                          acceptance))
    return out


def run_acceptance(path: str, data: dict, k: int, acceptance_length: float | None) -> dict[str, Any]:
    """The simulation's acceptance settings for a run with speculation of ``k`` tokens: the file's per-position rates
    (vLLM's ``spec_decode_per_position_acceptance_rates``: accepted at position j / drafts) as the ``position`` model's
    conditional rates r_j / r_(j-1); else an acceptance length (``acceptance_length`` given, else the file's
    ``spec_decode_acceptance_length``) as the per-token rate a with (1 - a^(k+1)) / (1 - a) = that length (Leviathan et
    al., ICML 2023); a file with neither and no ``--acceptance-length`` is refused."""
    from scipy.optimize import brentq

    rates = data.get(vllm_io.PER_POSITION_KEY)
    if acceptance_length is None and rates and len(rates) >= k and all(r > 0 for r in rates[:k]):
        conditional = [rates[0]] + [min(1.0, b / a) for a, b in zip(rates[:k - 1], rates[1:k])]
        return {"acceptance": "position", "acceptance_positions": tuple(float(r) for r in conditional)}
    length = acceptance_length if acceptance_length is not None else data.get("spec_decode_acceptance_length")
    if not length:
        raise UserError(f"{path}: no spec_decode_acceptance_length or per-position rates (vLLM before they were "
                        "saved): give --acceptance-length, the acceptance length the server logged")
    if not 1.0 <= length <= k + 1:
        raise UserError(f"{path}: acceptance length {length} outside [1, k + 1 = {k + 1}] (--k, --acceptance-length)")
    if length >= k + 1:
        return {"acceptance": "constant", "acceptance_rate": 1.0}
    rate = brentq(lambda a: sum(a ** j for j in range(k + 1)) - length, 0.0, 1.0)
    return {"acceptance": "constant", "acceptance_rate": float(rate)}


def measured_figures(data: dict) -> dict[str, float]:
    """:data:`LOSS_FIGURES` of a vLLM result as it saved them (the TTFT's 90th percentile from its per-request TTFTs,
    over requests whose stream carried text)."""
    figures = vllm_io.vllm_figures(data)
    out = {k: figures[k] for k in LOSS_FIGURES if k in figures}
    ttfts = data.get("ttfts")
    if ttfts:
        ok = vllm_io.succeeded(data, len(ttfts))  # known for a replayable file (read_vllm_result refuses the rest)
        seen = np.array([t for t, n, keep in zip(ttfts, data["output_lens"], ok) if n > 0 and keep], dtype=float)
        if seen.size:
            out["ttft_p90_ms"] = float(np.percentile(seen, 90)) * 1e3
    return out


def simulated_figures(result: Result, base: SimConfig, cost: CostModel) -> dict[str, float]:
    """Replay ``result``'s workload under ``base`` (the vLLM settings) priced by ``cost``; its figures as vLLM
    computes them."""
    from simulator.core.runner import run_simulation

    concurrency = result.data["max_concurrency"]  # an int or None (read_vllm_result)
    config = base.replace(arrival="trace", trace=result.path, rate=None, trace_speedup=None, cv=1.0,
                          max_concurrency=base.workload.max_concurrency if concurrency is None else concurrency,
                          **result.acceptance)
    run = run_simulation(config, workload=result.workload, cost=cost)
    requests, empty = run.requests, result.empty
    figures = vllm_io.vllm_style_figures(requests, empty)
    figures["duration"] = float(run.summary["simulated_seconds"])
    seen = requests["ttft"].to_numpy()[~empty[requests["request_id"].to_numpy()]]
    figures["ttft_p90_ms"] = float(np.percentile(seen, 90)) * 1e3 if seen.size else math.nan
    return figures


def relative_errors(simulated: dict[str, float], measured: dict[str, float],
                    names: Sequence[str]) -> dict[str, float]:
    """simulated / measured - 1 of each figure both have."""
    return {k: simulated[k] / measured[k] - 1 for k in names
            if k in simulated and k in measured and measured[k] > 0 and math.isfinite(simulated[k])}


class Fitter:
    """The loss over a set of files and its minimisation (module docstring)."""

    def __init__(self, dep: Deployment, base: SimConfig, results: Sequence[Result]) -> None:
        self.dep, self.base, self.results = dep, base, list(results)

    def cost(self, cal: Calibration, grid: Grid | None = None) -> CostModel:
        """The candidate's cost model: over :data:`FIT_GRID` for runs without speculation (one token a sequence), over
        :data:`CALIBRATION_GRID` (query lengths to 9, the draft's rows) for runs with it."""
        if grid is None:
            grid = CALIBRATION_GRID if self.base.speculative.policy != "no-spec" else FIT_GRID
        frame, meta = calibrated_profile(self.dep, cal, grid)
        return fit_cost_model(ProfileTable(frame=frame, meta=meta, path="calibration candidate"), "interp")

    def loss(self, cal: Calibration, results: Sequence[Result]) -> float:
        if cal.compute > 1 or cal.bandwidth > 1:
            return math.inf  # beyond the datasheet's peak: not a physical engine
        cost = self.cost(cal)
        total = 0.0
        for result in results:
            simulated = simulated_figures(result, self.base, cost)
            for k, v in result.measured.items():
                s = simulated.get(k, math.nan)
                total += math.log(s / v) ** 2 if s > 0 and v > 0 else 100.0
        return total

    def fit(self, start: Calibration, names: Sequence[str], results: Sequence[Result], max_evals: int) -> Calibration:
        """Nelder-Mead over the logs of ``names`` from ``start`` (the others held), on ``results``."""
        from scipy.optimize import minimize

        if not names:
            return start
        x0 = start.vector(names)
        # a simplex of +-30% steps: the parameters are fractions and seconds known to within a few times
        simplex = np.vstack([x0] + [x0 + 0.3 * np.eye(len(names))[i] for i in range(len(names))])
        best = minimize(lambda x: self.loss(start.with_vector(names, x), results), x0, method="Nelder-Mead",
                        options={"maxfev": max_evals, "initial_simplex": simplex, "xatol": 1e-3, "fatol": 1e-5})
        return start.with_vector(names, best.x)


def calibrated_profile(dep: Deployment, cal: Calibration, grid: Grid) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The analytical profile of ``dep`` at ``cal``'s efficiencies over ``grid``, with the per-step CPU work as
    ``overhead`` rows (``step_per_seq_s`` x batch size) and the front end as a ``frontend`` row."""
    frame, meta = analytical_profile(dep, grid, eff=cal.efficiency())
    if cal.draft_pass_overhead_s is not None:  # the overhead is one additive term of a pass (profiles.analytical)
        draft = frame["role"] == "draft"
        frame.loc[draft, "seconds"] = frame.loc[draft, "seconds"] + (cal.draft_pass_overhead_s - cal.pass_overhead_s)
    overhead = pd.DataFrame({"role": "target", "phase": "overhead", "batch_size": list(grid.batch_sizes),
                             "query_len": 0, "context_len": 0,
                             "seconds": [cal.step_per_seq_s * b for b in grid.batch_sizes]})
    frontend = pd.DataFrame({"role": ["target"], "phase": ["frontend"], "batch_size": [1], "query_len": [0],
                             "context_len": [0], "seconds": [cal.frontend_s]})
    parts = [frame, overhead, frontend]
    if cal.spec_overhead_s:  # what a speculative step adds beyond its passes, at any batch and query length
        parts.append(pd.DataFrame({"role": "target", "phase": "spec_overhead", "batch_size": list(grid.batch_sizes),
                                   "query_len": 2, "context_len": 0, "seconds": cal.spec_overhead_s}))
    return pd.concat(parts, ignore_index=True), meta


def figure_rows(result: Result, simulated: dict[str, float]) -> list[dict[str, Any]]:
    """One row per :data:`TARGET_FIGURES` figure of ``result``: file, figure, measured, simulated, relative error."""
    return [{"file": Path(result.path).name, "figure": k, "measured": result.measured[k], "simulated": simulated[k],
             "relative_error": e} for k, e in relative_errors(simulated, result.measured, TARGET_FIGURES).items()]


#: Requests in flight at most for a file to pin the small-batch step (module docstring).
SMALL_BATCH = 16
#: Requests in flight at least for a file to pin the large-batch step (module docstring).
LARGE_BATCH = 256
#: Requests sent at t = 0 at least for a file to pin the API server's seconds per request (module docstring).
BURST_REQUESTS = 100


def in_flight(result: Result) -> float:
    """Requests ``result``'s run held in flight (module docstring): a burst's, else request rate x mean E2E latency
    (Little's law), capped by its requests and its ``max_concurrency``."""
    n = len(result.workload.prompt_tokens)
    cap = min(n, result.data["max_concurrency"] or n)
    rate = result.data["request_rate"]
    if math.isinf(rate):
        return float(cap)
    e2el = result.measured.get("mean_e2el_ms") or vllm_io.vllm_figures(result.data).get("mean_e2el_ms")
    return min(float(cap), rate * e2el / 1e3) if e2el else float(cap)


def identification_gaps(results: Sequence[Result], names: Sequence[str]) -> list[str]:
    """What ``results`` lack to identify the parameters ``names`` (module docstring), one phrase each; empty: nothing."""
    gaps = []
    if len(results) < len(names):
        gaps.append(f"fewer files ({len(results)}) than parameters fitted ({len(names)})")
    measured = [vllm_io.vllm_figures(r.data) | r.measured for r in results]
    if "compute" in names and not any("mean_ttft_ms" in m for m in measured):
        gaps.append("no file measured TTFT, which compute is fitted to")
    if "bandwidth" in names and not any("median_tpot_ms" in m or "median_itl_ms" in m for m in measured):
        gaps.append("no file measured TPOT or ITL, which bandwidth is fitted to")
    flights = [in_flight(r) for r in results]
    if "pass_overhead_s" in names and "step_per_seq_s" in names:
        if not any(f <= SMALL_BATCH for f in flights):
            gaps.append(f"no file at a small batch (at most {SMALL_BATCH} requests in flight) to pin pass_overhead_s")
        if not any(f >= LARGE_BATCH for f in flights):
            gaps.append(f"no file at a large batch (at least {LARGE_BATCH} requests in flight) to pin step_per_seq_s")
    bursts = [r for r, f in zip(results, flights) if math.isinf(r.data["request_rate"]) and f >= BURST_REQUESTS]
    if "frontend_s" in names and not bursts:
        gaps.append(f"no burst of at least {BURST_REQUESTS} requests sent at t = 0 (request_rate inf) to pin "
                    "frontend_s")
    return gaps


def held_out(fitter: Fitter, names: Sequence[str], start: Calibration, max_evals: int,
             log: Any = None) -> list[dict[str, Any]]:
    """Leave-one-file-out: each file's :data:`TARGET_FIGURES` predicted by the fit to the others
    (:func:`figure_rows`); none with one file (nothing to hold out)."""
    rows: list[dict[str, Any]] = []
    if len(fitter.results) < 2:
        return rows
    for i, result in enumerate(fitter.results):
        others = fitter.results[:i] + fitter.results[i + 1:]
        cal = fitter.fit(start, names, others, max_evals)
        predicted = figure_rows(result, simulated_figures(result, fitter.base, fitter.cost(cal, CALIBRATION_GRID)))
        rows += predicted
        if log:
            log(f"held out {Path(result.path).name}: "
                + ", ".join(f"{r['figure']} {r['relative_error']:+.1%}" for r in predicted))
    return rows


def calibrate(paths: Sequence[str], dep: Deployment, base: SimConfig, out: Path, names: Sequence[str],
              start: Calibration, max_evals: int, log: Any = print,
              acceptance_length: float | None = None) -> dict[str, Any]:
    """Fit, measure the held-out error, write the profile; returns its metadata's ``calibration`` block. Files that
    cannot identify what is fitted (:func:`identification_gaps`) give one :class:`policies.errors.InputWarning`.
    ``base`` with a speculative policy: the files are runs with speculation (module docstring)."""
    spec = base.speculative
    results = read_results(paths, base.run.seed, spec.k if spec.policy != "no-spec" else 0, acceptance_length)
    fitter = Fitter(dep, base, results)
    gaps = identification_gaps(results, names)
    if gaps:
        warn_user(f"calibrate: these {len(results)} file(s) cannot identify the {len(names)} parameter(s) fitted: "
                  + "; ".join(gaps) + ": the fit and its held-out error are not to be trusted (add such runs, or fit "
                  "fewer parameters with --start and --fit)")
    log(f"calibrating {', '.join(names) or 'nothing'} on {len(results)} file(s) of {dep.target} on "
        f"{dep.tp} x {dep.gpu_key}")
    rows = held_out(fitter, names, start, max_evals, log)
    if len(results) < 2:
        log("nothing held out: with one file there is no other to fit and predict it from (give two or more files "
            "for a held-out error)")
    cal = fitter.fit(start, names, results, max_evals)
    cost = fitter.cost(cal, CALIBRATION_GRID)
    fitted = [row for result in results for row in figure_rows(result, simulated_figures(result, base, cost))]
    errors = [abs(r["relative_error"]) for r in rows]
    block = {
        "note": "calibrated to vLLM results",
        "files": [{"path": r.path, "source": r.data.get("source"), "num_prompts": len(r.data["input_lens"]),
                   "request_rate": rate_to_json(r.data["request_rate"]),
                   "max_concurrency": r.data.get("max_concurrency")}  # "inf" as vLLM writes it: JSON has no inf
                  for r in results],
        "settings": {k: v for k, v in base.to_dict(flat=True).items() if k in SETTINGS},
        "fitted": list(names),
        "parameters": parameters(cal),
        "parameter_units": {"compute": "fraction of peak FLOP/s", "bandwidth": "fraction of peak HBM bytes/s",
                            "pass_overhead_s": "s per pass", "step_per_seq_s": "s per step and sequence",
                            "frontend_s": "s per request", "draft_pass_overhead_s": "s per draft pass",
                            "spec_overhead_s": "s per speculative step"},
        **({"speculation": {"speculative_method": base.speculative.proposer_method, "k": base.speculative.k,
                            "acceptance": {Path(r.path).name: r.acceptance for r in results}}}
           if base.speculative.policy != "no-spec" else {}),
        "held_out": rows,
        "held_out_summary": {"median_abs_error": float(np.median(errors)) if errors else None,
                             "max_abs_error": float(max(errors)) if errors else None,
                             "method": "leave-one-file-out: each file predicted by the fit to the others"
                             if len(results) > 1 else "nothing held out: one file"},
        "identification_gaps": gaps,
        "in_sample": fitted,
        "loss_figures": list(LOSS_FIGURES),
    }
    frame, meta = calibrated_profile(dep, cal, CALIBRATION_GRID)
    meta["calibration"] = block
    meta["efficiency_source"] = ("calibrated to vLLM results (profiles/calibrate.py): " +
                                 ", ".join(Path(r.path).name for r in results))
    write_profile(frame, meta, out)
    return block


#: The config fields that describe the vLLM deployment, recorded in the profile's metadata (``calibration.settings``)
#: and taken from it as defaults by the simulator's commands.
SETTINGS = DEPLOYMENT_SETTINGS


def parameters(cal: Calibration) -> dict[str, float]:
    """``cal``'s numbers as the metadata records them (``draft_pass_overhead_s`` only where set)."""
    return {k: v for k, v in asdict(cal).items() if v is not None}


def transfer(source: str, dep: Deployment, out: Path, draft: dict[str, Any] | None = None) -> Calibration:
    """Write ``dep``'s profile with the parameters of the calibrated profile ``source`` (another GPU or model): the
    efficiencies are fractions of a datasheet and the overheads host-side seconds, so they carry over while the
    roofline moves with the datasheet and the architecture. A transfer, not a fit: the metadata says so and keeps
    the source's calibration block. ``draft``: the fit of the draft's per-pass overhead
    (:func:`fit_draft_overhead`'s block, its ``draft_pass_overhead_s`` applied and the block
    recorded as ``draft_calibration``)."""
    cal = read_start(source, "--transfer-from")
    if draft is not None:
        cal = replace(cal, draft_pass_overhead_s=draft["draft_pass_overhead_s"])
    frame, meta = calibrated_profile(dep, cal, CALIBRATION_GRID)
    origin = json.loads(_meta_of(source).read_text())["calibration"]
    fitted_on = len(origin.get("files", []))
    kept = {k: origin[k] for k in ("files", "settings", "fitted", "parameters", "parameter_units") if k in origin}
    meta["calibration"] = {**kept, "note": "transferred from a profile calibrated to vLLM results",
                           "source_held_out_summary": origin.get("held_out_summary"),
                           "transferred_from": str(source),
                           "transfer": f"the parameters of {Path(source).name} (fitted on {fitted_on} "
                                       f"vLLM result files) moved to {dep.tp} x {dep.gpu_key}, {dep.target} + "
                                       f"{dep.draft} by the datasheet and the architecture; no result of this "
                                       "deployment was fitted"}
    if draft is not None:
        meta["calibration"]["parameters"] = parameters(cal)
        meta["calibration"]["draft_calibration"] = draft
    meta["efficiency_source"] = f"transferred from {Path(source).name} (profiles/calibrate.py transfer)"
    write_profile(frame, meta, out)
    return cal


def _meta_of(path: str) -> Path:
    p = Path(path)
    return p.with_name(p.stem + ".meta.json") if p.suffix.lower() == ".csv" else p


# -- a draft head's per-pass overhead, fitted to published single-sequence runs ------------------------------
#: Tokens in the KV cache at every step (MT-Bench: a prompt of about 170 tokens with its chat template, answers of
#: up to 256).
CONTEXT_LEN = 300


def read_table(path: str) -> pd.DataFrame:
    """The single-request TPOT rows of a published table (:mod:`profiles.published`; ``batch_kind`` batch1, ``figure``
    tpot_ms) as ``draft`` (the drafter's shipped config, ``none`` without speculation), ``num_speculative_tokens``,
    ``acceptance_length`` (bonus included; 1 without speculation) and ``tpot_ms``; a speculative row needs its
    acceptance length."""
    from profiles.published import config_name, read_published

    if not Path(path).is_file():
        raise UserError(f"--fit-draft-to {path}: file not found")
    rows = []
    for row in read_published(path):
        if row["batch_kind"] != "batch1" or row["figure"] != "tpot_ms":
            continue
        speculative = row["method"] != "none"
        if speculative and row["acceptance_length"] is None:
            raise UserError(f"--fit-draft-to {path}: line {row['line']}: acceptance_length is needed for a speculative "
                            "TPOT (step seconds = TPOT x acceptance length)")
        rows.append({"draft": config_name(row["drafter"], f"{path}: line {row['line']}: drafter") if speculative
                     else "none", "num_speculative_tokens": row["num_speculative_tokens"],
                     "acceptance_length": row["acceptance_length"] if speculative else 1.0, "tpot_ms": row["value"]})
    if not rows:
        raise UserError(f"--fit-draft-to {path}: no single-request TPOT row (batch_kind batch1, figure tpot_ms)")
    return pd.DataFrame(rows)


def head_cost_model(dep: Deployment, cal: Calibration) -> CostModel:
    """The simulator's cost model of ``dep`` at ``cal`` (the calibrated profile as written, ``interp`` fitter)."""
    frame, meta = calibrated_profile(dep, cal, CALIBRATION_GRID)
    return fit_cost_model(ProfileTable(frame=frame, meta=meta, path=f"{dep.target} + {dep.draft}"), "interp")


def simulated_tpot_ms(cost: CostModel, k: int, acceptance_length: float) -> float:
    """TPOT (ms) of one request served alone: step(k) / AL (module docstring)."""
    return predict_step_seconds(cost, [CONTEXT_LEN], [int(k)], True) / acceptance_length * 1e3


def fit_draft_overhead(source: str, dep: Deployment, path: str) -> dict[str, Any]:
    """Fit ``h`` for ``dep``'s head to ``path``'s rows of ``dep.draft``, starting from the calibrated profile
    ``source``; return the metadata block: the fitted ``draft_pass_overhead_s``, the source table, and the fitted and
    held-out rows (published and simulated TPOT, relative error).

    The per-pass overhead of a draft head's passes, fitted to published single-sequence speculative runs of vLLM.

    Why: a target's calibration (:mod:`profiles.calibrate`) fits vLLM serving results without speculation, and its
    ``pass_overhead_s`` (2.6 ms for Llama-3.1-8B on an H100) is what vLLM v0 paid around every forward pass. vLLM V1
    drafts an EAGLE head on the device, its k passes inside one engine step, so a head pass pays far less than a target
    step; priced at 2.6 ms a pass, EAGLE would never pay, against vLLM's own measurements.

    What: at batch size 1 a speculative step of k draft passes and one verification pass lasts (DESIGN.md's step)

        step(k) = sum_{j=1..k} draft(1, c + j - 1) + target(1, k + 1, c) + overhead(1)

    and vLLM's TPOT of a request served alone is step(k) / AL(k), AL the mean acceptance length (bonus token included),
    which the published runs report beside the TPOT. Every draft pass carries the same overhead ``h``
    (``Calibration.draft_pass_overhead_s``), so step(k) = step_0(k) + k h, step_0 its kernels by the roofline; ``h``
    minimises the squared log ratios of simulated over published TPOT over the rows of the profile's head (a bounded
    scalar search between 0 and the target's ``pass_overhead_s``). The rows of other heads (their own architecture, the
    same ``h``) and the row without speculation (k = 0: the target's calibration alone) are held out and predicted.

    Approximations: every step at one context length (:data:`CONTEXT_LEN`, an MT-Bench prompt and half an answer); TPOT as
    the mean step over AL (vLLM divides the time after the first token by the tokens after it: the same at batch 1 but
    for the last step's unused tokens).
    """
    from scipy.optimize import minimize_scalar

    table = read_table(path)
    cal = read_start(source, "--transfer-from")
    mine = table[(table["draft"] == dep.draft) & (table["num_speculative_tokens"] > 0)]
    if mine.empty:
        raise UserError(f"--fit-draft-to {path}: no row with draft {dep.draft!r} and k > 0 to fit (--draft)")
    # step(k) = step_0(k) + k h exactly (h one additive term of every draft pass): the search prices step_0 once
    base = head_cost_model(dep, replace(cal, draft_pass_overhead_s=0.0))
    step0 = [simulated_tpot_ms(base, k, 1.0) / 1e3 for k in mine["num_speculative_tokens"]]

    def loss(h: float) -> float:
        return sum(math.log((s + k * h) / al / (t / 1e3)) ** 2 for s, k, al, t in
                   zip(step0, mine["num_speculative_tokens"], mine["acceptance_length"], mine["tpot_ms"]))

    h = float(minimize_scalar(loss, bounds=(0.0, cal.pass_overhead_s), method="bounded",
                              options={"xatol": 1e-7}).x)
    fitted = replace(cal, draft_pass_overhead_s=h)
    rows = []
    for draft, group in table.groupby("draft", sort=False):
        head = dep if draft in ("none", dep.draft) else replace(dep, draft=str(draft))
        cost = head_cost_model(head, fitted)
        for _, row in group.iterrows():
            simulated = simulated_tpot_ms(cost, row["num_speculative_tokens"], row["acceptance_length"])
            rows.append({"draft": str(draft), "k": int(row["num_speculative_tokens"]),
                         "acceptance_length": float(row["acceptance_length"]), "tpot_ms": float(row["tpot_ms"]),
                         "simulated_tpot_ms": simulated, "relative_error": simulated / row["tpot_ms"] - 1,
                         "held_out": not (draft == dep.draft and row["num_speculative_tokens"] > 0)})
    return {"draft_pass_overhead_s": h, "table": Path(path).name, "context_len": CONTEXT_LEN,
            "method": "bounded least squares of log TPOT over the head's rows (profiles/calibrate.py, fit_draft_overhead)",
            "rows": rows}

#: The flag help of the settings vLLM spells otherwise.
SETTING_HELP = {
    "scheduler": "prefill-first (vLLM v0 without --enable-chunked-prefill) or chunked-prefill (the V1 scheduler, or "
                 "v0 with --enable-chunked-prefill)",
    "num_gpu_blocks": "KV-cache blocks (vLLM's --num-gpu-blocks-override; default: from the memory budget)",
    "cuda_graph_sizes": "vLLM's --cuda-graph-sizes, comma-separated (v0 captured 1,2,4,8,16,...,256)",
}


def calibrate_deployment(paths: Sequence[str], gpu: str, target: str, tp: int, drafts: Sequence[str],
                         base: SimConfig, out: Path, max_evals: int, log: Any = print) -> list[str]:
    """``advise --vllm-results``: one profile per draft of a deployment known by its vLLM results, written into
    ``out``: the first draft's by :func:`calibrate` (every parameter fitted, from the defaults, ``base`` carrying the
    vLLM settings the files ran with), the others moved from it by :func:`transfer` (the same parameters; a head's
    passes pay the same per-pass overhead as every pass, no published head runs being fitted here). A file of a run
    with speculation on is refused: the fit prices runs without it (its counters are ``--acceptance-results``)."""
    if not drafts:
        raise UserError("--drafts: give at least one draft model or head config")
    for path in paths:
        data = vllm_io.read_vllm_result(path, replay=False)
        if data.get("spec_decode_num_drafts"):
            raise UserError(f"--vllm-results {path}: ran with speculation on (spec_decode_num_drafts "
                            f"{data['spec_decode_num_drafts']}); the calibration fits runs without it: give it as "
                            "--acceptance-results METHOD=FILE")
    out.mkdir(parents=True, exist_ok=True)
    profiles = []
    first = Deployment(gpu, target, drafts[0], tp)
    path = out / f"{gpu}{'x' + str(tp) if tp > 1 else ''}-vllm__{target}__{drafts[0]}.csv"
    calibrate(paths, first, base.replace(arrival="trace", trace="-", rate=None), path, PARAMETERS, Calibration(),
              max_evals, log)
    profiles.append(str(path))
    for draft in drafts[1:]:
        other = out / f"{gpu}{'x' + str(tp) if tp > 1 else ''}-vllm__{target}__{draft}.csv"
        transfer(str(path), Deployment(gpu, target, draft, tp), other)
        profiles.append(str(other))
    return profiles


def read_start(path: str, flag: str = "--start") -> Calibration:
    """The parameters of an earlier calibration's ``.meta.json`` (or its profile CSV); ``flag`` names the input."""
    try:
        params = json.loads(_meta_of(path).read_text())["calibration"]["parameters"]
        return Calibration(**{k: float(params[k]) for k in PARAMETERS},
                           **{k: None if params.get(k) is None else float(params[k]) for k in SPEC_PARAMETERS})
    except FileNotFoundError:
        raise UserError(f"{flag} {path}: file not found (a calibrated profile .csv with its .meta.json)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{flag} {path}: not a calibrated profile's metadata (calibration.parameters: {exc})") from None


def main(argv: list[str]) -> int:
    from simulator.studies.specs import parse_field_value

    if "--published" in argv:  # speculative runs of an engine (published tables): profiles/spec_calibrate.py
        from profiles.spec_calibrate import main as spec_main

        return spec_main(argv)
    parser = FlagParser(prog="run_sim.py calibrate", description=__doc__.splitlines()[0],
                        epilog="calibrate --published TABLE ... fits speculative costs to an engine's own speculative "
                               "runs instead (run_sim.py calibrate --published X --help)")
    parser.add_argument("results", nargs="*", help="vllm bench serve --save-result JSON files of one deployment")
    parser.add_argument("--transfer-from", metavar="PROFILE", help="fit nothing: write the deployment's profile with "
                                                                   "this calibrated profile's parameters (another GPU "
                                                                   "or model; the roofline moves by the datasheet)")
    parser.add_argument("--fit-draft-to", metavar="TABLE", help="with --transfer-from: fit the draft's per-pass "
                        "overhead to published single-sequence runs of --draft (a published table, profiles/data/"
                        "README.md: its batch1 tpot_ms rows; profiles/data/vllm_eagle/); the other drafts' rows held out")
    parser.add_argument("--gpu", required=True, help=f"the deployment's GPU: {', '.join(GPUS)}")
    parser.add_argument("--target", required=True, help="the served model's config (a shipped name such as "
                                                        "llama-3.1-8b, or a config.json path)")
    parser.add_argument("--draft", help="a draft model of the target's tokenizer (or a draft head) priced by the same "
                                        "calibrated model, for speculation what-ifs (default: the target's, as "
                                        "python -m profiles.analytical pairs it: llama-3.2-1b for Llama 3, llama-68m "
                                        "for llama-2-7b)")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-parallel degree of the deployment (vLLM's --tensor-parallel-size; default 1)")
    parser.add_argument("--fit", default=",".join(PARAMETERS),
                        help=f"parameters to fit, comma-separated, of {', '.join(PARAMETERS)} (default: all) and, for "
                             f"runs with speculation, {', '.join(SPEC_PARAMETERS)}")
    parser.add_argument("--start", help="take the parameters not fitted (and the fit's start) from this earlier "
                                        "calibrated profile (.csv or .meta.json), and the vLLM settings it records "
                                        "as defaults of the settings flags below")
    parser.add_argument("--max-evals", type=int, default=300, help="simulations of the file set per fit (default 300)")
    parser.add_argument("--k", type=int, help="the runs speculated k tokens a step (vLLM's num_speculative_tokens; "
                                              "leave out for runs without speculation)")
    parser.add_argument("--speculative-method", help="the runs' speculative method (vLLM's names: eagle, eagle3, "
                                                     "draft_model, ngram; default: as --draft is a head or a model)")
    parser.add_argument("--acceptance-length", type=float, help="the runs' mean acceptance length (bonus included), "
                        "for files that do not record it (vLLM before spec_decode_acceptance_length was saved)")
    parser.add_argument("--out", required=True, help="the profile CSV to write (its .meta.json beside it)")
    settings = parser.add_argument_group("the vLLM settings the results ran with (simulate's flags of the same names; "
                                         "default: the simulator's)")
    for name in SETTINGS:
        flag = "--" + name.replace("_", "-")
        text = SETTING_HELP.get(name, f"vLLM's {flag}")
        if name == "enable_prefix_caching":
            settings.add_argument(flag, dest=name, action="store_true", default=None, help=text)
        else:
            settings.add_argument(flag, dest=name, metavar=name.upper(), default=None, help=text)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.fit.split(",") if n.strip()]
    for n in names:
        if n not in PARAMETERS and n not in SPEC_PARAMETERS:
            raise UserError(f"--fit: unknown parameter {n!r} (one of {', '.join([*PARAMETERS, *SPEC_PARAMETERS])})")
    if args.k is not None and args.k < 1:
        raise UserError(f"--k: runs with speculation have k >= 1 (got {args.k}; leave --k out for runs without)")
    if (args.acceptance_length is not None or args.speculative_method is not None) and args.k is None:
        raise UserError("--acceptance-length, --speculative-method: for runs with speculation: give --k too")
    if any(n in SPEC_PARAMETERS for n in names) and args.k is None:
        raise UserError(f"--fit {args.fit}: {', '.join(SPEC_PARAMETERS)} are fitted to runs with speculation (--k)")
    if args.max_evals < 1:
        raise UserError(f"--max-evals: must be >= 1 (got {args.max_evals})")
    dep = Deployment(args.gpu, args.target, draft_for(args.target, args.draft), args.tp)
    out = Path(args.out)
    if out.suffix.lower() != ".csv":
        raise UserError(f"--out {out}: the profile is a .csv (its .meta.json is written beside it)")
    if args.fit_draft_to and not args.transfer_from:
        raise UserError("--fit-draft-to: needs --transfer-from (the target's calibrated profile)")
    if args.transfer_from:
        if args.results:
            raise UserError("calibrate --transfer-from fits nothing: give no result files with it")
        draft = None
        if args.fit_draft_to:
            draft = fit_draft_overhead(args.transfer_from, dep, args.fit_draft_to)
            for row in draft["rows"]:
                print(f"{row['draft']:>22} k={row['k']}: TPOT {row['tpot_ms']:.2f} ms published, "
                      f"{row['simulated_tpot_ms']:.2f} simulated ({row['relative_error']:+.1%}"
                      f"{', held out' if row['held_out'] else ''})")
        cal = transfer(args.transfer_from, dep, out, draft)
        print("parameters (transferred): " + ", ".join(f"{k} {v:.4g}" for k, v in parameters(cal).items()))
        print(f"profile: {out}")
        return 0
    if not args.results:
        raise UserError("calibrate: give one or more vllm bench serve --save-result JSON files (or --transfer-from)")
    given = {name: value if isinstance(value, bool) else parse_field_value(name, value)
             for name in SETTINGS if (value := getattr(args, name)) is not None}
    if args.start:  # the earlier calibration's vLLM settings, as the simulator's commands take a profile's
        inherited = {k: v for k, v in calibration_settings(args.start).items() if k not in given}
        shown = [flag_value(k, v) for k, v in inherited.items() if v != FIELDS[k].default]
        if shown:
            print(f"--start {args.start}: vLLM settings of its calibration, taken as defaults (a flag overrides "
                  "them): " + ", ".join(shown))
        given = {**inherited, **given}
    speculation = {} if args.k is None else {"policy": "fixed-k", "k": args.k, **(
        {"speculative_method": args.speculative_method} if args.speculative_method else {})}
    base = SimConfig.of(arrival="trace", trace="-", rate=None, **speculation, **given)
    start = read_start(args.start) if args.start else Calibration()
    start = replace(start, **{n: default for n, default in SPEC_PARAMETERS.items()
                              if n in names and getattr(start, n) is None})
    block = calibrate(args.results, dep, base, out, names, start, args.max_evals,
                      acceptance_length=args.acceptance_length)
    summary = block["held_out_summary"]
    print("parameters: " + ", ".join(f"{k} {v:.4g}" for k, v in block["parameters"].items()))
    if summary["median_abs_error"] is not None:
        print(f"held-out error over {len(block['held_out'])} figures: median {summary['median_abs_error']:.1%}, "
              f"worst {summary['max_abs_error']:.1%}")
    else:
        print(f"held-out error: none ({summary['method']})")
    print(f"profile: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
