"""Where speculation stops paying, with its uncertainty: a crossover and two bands around it.

A policy's **crossover** is the rate (or batch size, or concurrency: any load axis swept in ascending order) from
which its mean latency first rises above no speculation's, linear between the swept points
(:func:`simulator.studies.sweep.crossings`); 0 when it is slower already at the lightest load, NaN when never up to the
heaviest. Two bands say how far to trust it:

- **fit**: a profile fitted to an engine's own speculative runs (:mod:`profiles.spec_calibrate`) records its
  simulated and the published speed-up at every point, fitted or held out (``calibration.points``); e is the largest
  |simulated - published| of its held-out points of the same kind, chains or trees (:func:`fit_error`). A simulated speed-up s = no-spec latency / policy latency is then known to +-e, so the
  policy stops paying somewhere between the load where s falls to 1 + e and the load where it falls to 1 - e
  (:func:`simulator.studies.sweep.stop_load` at levels 1 + e and 1 - e). A profile not fitted to speculative runs has no such number, and no
  fit band (say so rather than invent one).
- **acceptance**: the crossovers of the same sweep with every acceptance probability scaled by 0.8 and by 1.2 (capped
  at 1; :func:`scaled_acceptance`): acceptance is what a deployment knows least before it runs (SpecDecode-Bench,
  arXiv 2601.11580, finds it varies widely across prompts and datasets).

:func:`band_words` writes "stops paying from about R (fit: R1 to R2; acceptance x0.8 to x1.2: R3 to R4)".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.costs.profile_table import ENGINE_NAMES, calibration_block
from simulator.studies.sweep import stop_load

#: Acceptance factors of the acceptance band (each acceptance probability times these, capped at 1).
ACCEPTANCE_FACTORS = (0.8, 1.2)


def calibration_of(profile: str | Path) -> dict[str, Any] | None:
    """The ``calibration`` block of a profile fitted to an engine's speculative runs (one that names its ``engine``),
    else None."""
    block = calibration_block(profile)
    return block if isinstance(block.get("engine"), str) else None


def engine_name(profile: str | Path) -> str | None:
    """The engine and version a profile was fitted to (``vLLM 0.10.1.1``, ``SGLang 0.5.9``), else None."""
    block = calibration_of(profile)
    if block is None:
        return None
    name = ENGINE_NAMES.get(block["engine"].lower(), block["engine"])
    versions = "/".join(str(v) for v in block.get("engine_versions") or [])
    return f"{name} {versions}".strip()


def fit_error(profile: str | Path, tree: bool = False) -> float | None:
    """The largest held-out speed-up error of the profile's fit (module docstring) over its chains' points (``tree``:
    its token trees'), or over all its held-out points where it records none of that kind; None for a profile not
    fitted to speculative runs."""
    block = calibration_of(profile)
    if block is None:
        return None
    held = [p for p in block.get("points") or [] if p.get("status") == "held out"]
    kind = [abs(float(p["error"])) for p in held if bool(p.get("tree")) == tree]
    if kind:
        return max(kind)
    error = (block.get("held_out_summary") or {}).get("max_abs_error")
    return None if error is None else float(error)


def scaled_acceptance(config: SimConfig, factor: float) -> SimConfig:
    """``config`` with every acceptance probability times ``factor`` (capped at 1): the per-token probability of
    ``constant`` and ``beta`` acceptance, each position's of ``position``. A recorded or measured acceptance (``replay``,
    ``by-rank``) is not a probability to scale: one :class:`UserError` line."""
    spec = config.speculative
    if spec.acceptance in ("constant", "beta"):
        return config.replace(acceptance_rate=min(1.0, spec.acceptance_rate * factor))
    if spec.acceptance == "position":
        return config.replace(acceptance_positions=tuple(min(1.0, p * factor) for p in spec.acceptance_positions))
    raise UserError(f"acceptance band: --acceptance {spec.acceptance} is recorded, not a probability to scale by "
                    f"{factor:g}; give constant, beta or position acceptance")


@dataclass(frozen=True)
class Band:
    """A crossover and its bands (loads, in the sweep's unit; NaN: not within the loads swept; None: no such band)."""

    crossover: float
    fit: tuple[float, float] | None
    acceptance: tuple[float, float] | None


def crossover_band(loads: Sequence[float], ratio: Sequence[float], error: float | None = None,
                   ratios_by_factor: dict[float, Sequence[float]] | None = None) -> Band:
    """The :class:`Band` of a policy whose latency over the baseline's is ``ratio`` at ``loads``: the fit band from
    the profile's held-out speed-up ``error`` (None: none), the acceptance band from the ratios of the same sweep at
    scaled acceptance (``ratios_by_factor``: factor -> ratios at the same loads)."""
    fit = None if error is None else (stop_load(loads, ratio, 1.0 + error), stop_load(loads, ratio, 1.0 - error))
    acceptance = None
    if ratios_by_factor:
        ends = [stop_load(loads, ratios_by_factor[f]) for f in sorted(ratios_by_factor)]
        acceptance = (ends[0], ends[-1])
    return Band(stop_load(loads, ratio), fit, acceptance)


def band_words(band: Band, show: Callable[[float], str], lightest: float, heaviest: float) -> str:
    """``band`` in words: "stops paying from about R (fit: R1-R2; acceptance x0.8-x1.2: R3-R4)", each end written by
    ``show``, "below L" for 0 (already slower at the lightest load ``lightest``) and "beyond H" for NaN (not up to
    ``heaviest``)."""
    def end(value: float) -> str:
        if math.isnan(value):
            return f"beyond {show(heaviest)}"
        return f"below {show(lightest)}" if value == 0.0 else show(value)

    if band.crossover == 0.0:
        head = f"slower than no-spec already at {show(lightest)}"
    elif math.isnan(band.crossover):
        head = f"pays up to {show(heaviest)} at least"
    else:
        head = f"stops paying from about {show(band.crossover)}"
    def span(ends: tuple[float, float]) -> str:  # "the same" where both ends are the crossover's own "beyond"
        same = all(math.isnan(e) for e in (*ends, band.crossover))
        return "the same" if same else f"{end(ends[0])} to {end(ends[1])}"

    parts = []
    if band.fit is not None:
        parts.append(f"fit: {span(band.fit)}")
    if band.acceptance is not None:
        low, high = ACCEPTANCE_FACTORS[0], ACCEPTANCE_FACTORS[-1]
        parts.append(f"acceptance x{low:g} to x{high:g}: {span(band.acceptance)}")
    return head + (f" ({'; '.join(parts)})" if parts else "")
