"""A run's own settings: its seed, what it records and the per-request SLOs its summary measures."""
from __future__ import annotations

from dataclasses import dataclass

from policies.errors import require
from simulator.config.checks import check_types, named

#: vLLM's ``--goodput`` metrics.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RunConfig:
    """Seed, recording and goodput SLOs."""

    goodput_slo: tuple[tuple[str, float], ...] = ()
    """Per-request SLOs for vLLM's goodput, as ``vllm bench serve --goodput ttft:MS tpot:MS e2el:MS`` (milliseconds,
    >= 0; any of ttft, tpot, e2el): the summary's ``request_goodput`` counts requests/s that meet all of them and
    ``slo_attainment`` their fraction. Flag ``--goodput ttft:500 tpot:50``. Empty: no goodput figure."""

    seed: int = 0
    """Root of every random stream, an integer >= 0 (one SeedSequence, one Generator per stream)."""
    save_steps: bool = False
    """Also write ``steps.csv`` (one row per engine step: its start, seconds, kind, batch size, k, tokens)."""

    def __post_init__(self) -> None:
        check_types(self)
        names = [name for name, _ in self.goodput_slo]
        for name, bound in self.goodput_slo:
            require(name in GOODPUT_METRICS, f"config: {named('goodput_slo')}: unknown metric {name!r} "
                                             f"(one of {', '.join(GOODPUT_METRICS)}, bounds in ms)")
            require(bound >= 0, f"config: {named('goodput_slo')}: {name} bound must be >= 0 ms, got {bound!r}")
        require(len(set(names)) == len(names), f"config: {named('goodput_slo')}: a metric given twice ({names})")
        require(isinstance(self.seed, int) and self.seed >= 0,
                f"config: {named('seed')} must be an integer >= 0, got {self.seed}")
