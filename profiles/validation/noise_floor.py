"""The timing-noise floor of a validation: how far a simulation whose cost model were exact would still land from
a real run, because the real engine's passes scatter around their expected time.

A real pass of a given shape does not take the same time twice (on a shared 2-core CPU the target's passes
scatter by 10-15% on a log scale around the mean of their shape); the simulator prices every pass at its expected
time. Where the scatter moves a step's end past an arrival, a request joins another prefill or waits one step
more, and a figure made of a few requests (the p90 TTFT of 24 requests: their third slowest) moves by a whole
step's time. :func:`timing_floor` measures that with the simulator itself: a run's calibrated simulation against
copies of it whose every pass is priced at its expected time times an independent draw of the real run's own
scatter (:func:`pass_scatter`, :class:`JitteredCost`); per figure, the median |relative difference| over the draws.

It is a lower bound on what a validation can show, not a tolerance: a real machine's scatter also comes in slow
spells (correlated from pass to pass), which independent draws do not make, and any error in the calibration's
speed comes on top (a 2% speed error alone moves the latencies of a queue near saturation by several percent).
"""
from __future__ import annotations

import typing

import numpy as np
import pandas as pd

from simulator.costs.cost_model import CostModel

#: Fewest passes of one shape for them to count in :func:`pass_scatter` (a shape's mean from fewer is mostly noise).
MIN_PASSES_PER_SHAPE = 5


def step_pass_seconds(step: typing.Any, cost: CostModel, draft_prefill: bool) -> tuple[float, float, float]:
    """A real step's timed target-side passes (``step``: a row of a steps table, from ``itertuples``): their measured
    seconds, the cost model's seconds for the target's pass on the step's shape, and the draft's prefill (0 unless a
    prefill step with ``draft_prefill``). A prefill step: its prefills (measured: target and draft) against
    ``cost.prefill_time``; a decode step: its verification pass (``target_seconds``) against
    ``cost.target_time(b, proposed + b, context)``. :func:`pass_scatter` and validate's parts table
    (:func:`profiles.validation.validate.step_parts`) price steps with it. The real engine (:mod:`profiles.serving`)
    prefills whole prompts with nothing of them cached (prefill-first, no prefix cache, no preemption), so each of
    its prefill passes is the fresh prompts :meth:`CostModel.prefill_time` prices, as the simulated engine prices
    them too (:meth:`CostModel.prefill_chunks_time` with no context)."""
    b = int(step.batch_size)
    if step.kind == "prefill":
        draft = cost.prefill_time(b, int(step.prefill_tokens), role="draft") if draft_prefill else 0.0
        return step.target_seconds + step.draft_seconds, cost.prefill_time(b, int(step.prefill_tokens)), draft
    return step.target_seconds, cost.target_time(b, int(step.proposed) + b, int(step.context_tokens)), 0.0


def pass_scatter(steps: pd.DataFrame, cost: CostModel) -> float:
    """Standard deviation of log(measured / predicted seconds) of a real run's passes around the mean of their
    shape: the target's verification pass of each decode step, the passes of each prefill step (target and draft;
    :func:`step_pass_seconds`). A shape is (kind, batch size, ``k_max``, prompt tokens); dividing by the cost
    model's prediction first removes what the context adds within a shape, subtracting the shape's mean removes the
    cost model's error on it and the machine's speed, so what is left is the passes' own scatter. 0 when no shape
    has :data:`MIN_PASSES_PER_SHAPE` passes."""
    rows = []
    for s in steps.itertuples():
        measured, target, draft = step_pass_seconds(s, cost, s.draft_seconds > 0)
        predicted = target + draft
        if measured > 0 and predicted > 0:
            rows.append((s.kind, int(s.batch_size), int(s.k_max), int(s.prefill_tokens), np.log(measured / predicted)))
    frame = pd.DataFrame(rows, columns=["kind", "batch_size", "k_max", "prefill_tokens", "log_ratio"])
    shape = frame.groupby(["kind", "batch_size", "k_max", "prefill_tokens"])["log_ratio"]
    frame = frame[shape.transform("size") >= MIN_PASSES_PER_SHAPE]
    if frame.empty:
        return 0.0
    shape = frame.groupby(["kind", "batch_size", "k_max", "prefill_tokens"])["log_ratio"]
    residuals = frame["log_ratio"] - shape.transform("mean")
    # degrees of freedom: one mean per shape (each has >= MIN_PASSES_PER_SHAPE passes, so len(frame) > ngroups)
    return float(np.sqrt((residuals ** 2).sum() / (len(frame) - shape.ngroups)))


class JitteredCost(CostModel):
    """``cost`` with every target, draft and prefill pass it prices multiplied by an independent lognormal draw of
    mean 1 and log-scale standard deviation ``sigma`` (``rng``); the per-step overhead and everything else as
    ``cost``. The batch methods make the scalar calls (the base class's defaults), so each pass draws its own; a
    prefill pass over chunks with context (:meth:`CostModel.prefill_chunks_time`) draws once, its chunks' extra
    seconds (:meth:`CostModel.prefill_context_time`, no draw of their own) with it."""

    def __init__(self, cost: CostModel, sigma: float, rng: np.random.Generator) -> None:
        self._cost, self._sigma, self._rng = cost, float(sigma), rng
        for name in ("method", "verification", "batch_layout", "draft_extend", "source", "path", "memory", "fit_error"):
            setattr(self, name, getattr(cost, name))

    def _draw(self) -> float:
        # mean 1: E[exp(N(mu, s^2))] = exp(mu + s^2 / 2)
        return float(self._rng.lognormal(-self._sigma ** 2 / 2, self._sigma)) if self._sigma else 1.0

    def target_time(self, batch_size: int, query_tokens: int, context_tokens: int) -> float:
        return self._cost.target_time(batch_size, query_tokens, context_tokens) * self._draw()

    def draft_time(self, batch_size: int, context_tokens: int, query_tokens: int | None = None) -> float:
        return self._cost.draft_time(batch_size, context_tokens, query_tokens) * self._draw()

    @property
    def prices_catchup(self) -> bool:
        return self._cost.prices_catchup

    def prefill_time(self, batch_size: int, prompt_tokens: int, role: str = "target") -> float:
        return self._cost.prefill_time(batch_size, prompt_tokens, role) * self._draw()

    def prefill_chunks_time(self, chunks: typing.Sequence[tuple[int, int]], role: str = "target") -> float:
        return self._cost.prefill_chunks_time(chunks, role) * self._draw()

    def prefill_context_time(self, query_tokens: int, context_tokens: int, role: str = "target") -> float:
        return self._cost.prefill_context_time(query_tokens, context_tokens, role)  # a part of a pass: no draw

    def overhead_time(self, batch_size: int) -> float:
        return self._cost.overhead_time(batch_size)

    def speculation_time(self, batch_size: int, query_tokens: int) -> float:
        return self._cost.speculation_time(batch_size, query_tokens)

    @property
    def prices_speculation(self) -> bool:
        return self._cost.prices_speculation

    def prefill_overhead_time(self, batch_size: int) -> float:
        return self._cost.prefill_overhead_time(batch_size)

    def has(self, role: str, phase: str) -> bool:
        return self._cost.has(role, phase)


def timing_floor(config: typing.Any, workload: typing.Any, sigma: float, metrics: list[str], draws: int = 5,
                 seed: int = 0, plain: dict | None = None) -> dict[str, float]:
    """Per figure of ``metrics``: the median over ``draws`` of |jittered / plain - 1|, where plain is the
    simulation of ``config`` on ``workload`` (step by step, as validate compares it; ``plain``: its summary, where
    the caller has run it already) and jittered the same with its passes priced by :class:`JitteredCost` (the model
    of ``config.cost.profile``; ``sigma``, the real run's :func:`pass_scatter`). ``config.cost.policy_profile``
    should be set, so that the policy prices its choices without the jitter, as the real engine's policy does."""
    from simulator.core.runner import run_simulation
    from simulator.costs.cost_model import load_cost_model

    cost = load_cost_model(config.cost.profile, config.cost.fitter)
    if plain is None:
        plain = run_simulation(config, workload=workload, step_by_step=True).summary
    differences = {metric: [] for metric in metrics}
    for draw in range(draws):
        jittered = run_simulation(config, workload=workload, step_by_step=True,
                                  cost=JitteredCost(cost, sigma, np.random.default_rng([seed, draw]))).summary
        for metric in metrics:
            differences[metric].append(abs(jittered[metric] / plain[metric] - 1) if plain[metric] else np.nan)
    return {metric: float(np.median(values)) for metric, values in differences.items()}
