"""The cost model: what prices a step (a profile, fitted) and what the policy believes prices it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from simulator.config.checks import check_types, choice

#: The simulator's default profile: the example shipped with the package, used when ``--profile`` is not given
#: (the validation has its own default, a measured CPU profile).
DEFAULT_SIM_PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "data" / "example.json")
FITTERS = ("auto", "linear", "interp")


@dataclass(frozen=True)
class CostConfig:
    """The profile a run is priced with, how it is fitted, and the policy's own."""

    profile: str = DEFAULT_SIM_PROFILE
    """Cost model: a profile CSV (fitted here; ``profiles/data/*.csv``) or a coefficient JSON (default: the shipped
    hand-written ``profiles/data/example.json``)."""
    fitter: str = "auto"
    """Fitter for a profile CSV: ``linear`` (SmartSpec's form), ``interp`` (over the measured grid) or ``auto``: the
    profile's own (``interp`` for a profile calibrated to vLLM results, whose recorded errors were computed with it;
    ``linear`` otherwise)."""
    policy_profile: str | None = None
    """Cost model the policy believes in; ``None``: the same as ``profile`` (a mis-profiled policy otherwise)."""

    def __post_init__(self) -> None:
        check_types(self)
        choice("fitter", self.fitter, FITTERS)
