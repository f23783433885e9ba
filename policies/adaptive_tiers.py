"""SGLang's adaptive speculative decoding (``--speculative-adaptive``): one k for the batch, moved among step tiers
by an EMA of the accepted length.

As SGLang's documentation states it (``docs/advanced_features/adaptive_speculative_decoding.md``) and its
``AdaptiveSpeculativeParams`` does it (``python/sglang/srt/speculative/adaptive_spec_params.py``): after each verify
batch, the batch's mean number of accepted draft tokens per request (the bonus token not counted) enters an EMA,

    ema <- (1 - ema_alpha) * ema + ema_alpha * mean_i accepted_i,

started at ``tier - 1`` for the starting tier. The verify batches are counted; the first ``warmup_batches`` never
move the tier, and after them the tier is recomputed every ``update_interval`` batches (batch count c recomputes
when c > warmup_batches and (c - warmup_batches) % update_interval == 0). A recomputation first steps down while
the EMA is at most ``prev - 0.5 + down_hysteresis`` (``prev`` the next lower tier), and if it did not step down, steps
up while the EMA is above ``tier - 0.5 + up_hysteresis``; both may pass several tiers at once. (The "did not step
down" guard is SGLang's later code; its first lacked it, which differs only when down_hysteresis exceeds
up_hysteresis, never at the defaults.) The new tier applies from the next step. With the defaults (tiers 1, 3, 7):
up from 1 above an EMA of 0.5, from 3 above 2.5; down from 7 at 2.25 or less, from 3 at 0.25 or less. SGLang's tier
is ``speculative_num_steps`` with ``--speculative-eagle-topk 1``: a chain of that many draft tokens, this project's k.

Parameters and defaults, SGLang's config keys (its ``--speculative-adaptive-config`` JSON) and values:
``candidate_steps=1,3,7`` (the tiers; at least two distinct, each >= 1 and at most this policy's k, the bound
every proposal keeps: the defaults need ``--k 7``), ``ema_alpha=0.2``, ``update_interval=5``, ``warmup_batches=10``,
``down_hysteresis=-0.25``, ``up_hysteresis=0.0``. ``initial_steps`` is SGLang's ``--speculative-num-steps``, snapped
to the nearest tier (a tie to the larger, as SGLang's documented version does). SGLang takes it from the user or
picks it per model; the default here, the middle tier (3 of the defaults), is an assumption (the documentation's
example starts at 3; SGLang's later code falls back to the middle tier when the start is no tier).

SGLang runs adaptive steps on chains only (``--speculative-eagle-topk 1``; with a tree it falls back to static
settings): with token trees (``BatchView.tree``) this policy stops with a :class:`UserError` rather than run as a
policy it is not. Where this differs from SGLang otherwise, and why: a step in which nobody proposed (every n-gram lookup missed; SGLang's
adaptive mode runs EAGLE only) is no verify batch and is not counted; requests that proposed nothing in a step are
left out of its mean. SGLang's later per-batch-size slots (candidate tiers by batch size, a zero tier) are not
modelled: this is the documented single set of tiers.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from policies.base import BatchView, Policy, StepOutcome
from policies.errors import UserError
from policies.params import ParamReader


class SglangAdaptive(Policy):
    """One k for everyone, a tier moved by the EMA of accepted draft tokens (SGLang's ``--speculative-adaptive``)."""

    name = "sglang-adaptive"
    steps_plain = True
    """:meth:`propose_plain` and :meth:`observe_plain` stand in for :meth:`propose` and :meth:`observe` (they are
    what those call), so the simulator may run several steps in one event (speed shortcut, ``simulator.core.runs``)."""

    def __init__(self, k: int, **params: Any) -> None:
        reader = ParamReader(self.name, params)
        tiers = reader.integers("candidate_steps", (1, 3, 7), low=1)
        self.ema_alpha = reader.number("ema_alpha", 0.2, low=0.0, high=1.0, low_open=True)
        self.update_interval = reader.integer("update_interval", 5, low=1)
        self.warmup_batches = reader.integer("warmup_batches", 10, low=0)
        self.down_hysteresis = reader.number("down_hysteresis", -0.25)
        self.up_hysteresis = reader.number("up_hysteresis", 0.0)
        initial = reader.integer("initial_steps", None, low=0)
        super().__init__(k, **reader.rest())
        self.tiers: tuple[int, ...] = tuple(sorted(set(tiers)))
        """Candidate tiers (proposal lengths), ascending and distinct."""
        if len(self.tiers) < 2:
            raise reader.error("candidate_steps", "needs at least two distinct tiers", ",".join(map(str, tiers)))
        if self.tiers[-1] > self.k:
            raise UserError(f"policy {self.name}: parameter candidate_steps goes up to {self.tiers[-1]}, above the "
                            f"configured k {self.k} (k bounds every proposal: give --k {self.tiers[-1]} or lower "
                            "tiers)")
        start = self.tiers[len(self.tiers) // 2] if initial is None else initial
        self.tier = min(self.tiers, key=lambda t: (abs(t - start), -t))
        """The tier proposed now."""
        self.ema_accept_len = float(self.tier - 1)
        """EMA of the mean accepted draft tokens per request of a verify batch."""
        self.batches = 0
        """Verify batches observed (steps in which someone proposed)."""

    # --- policy hooks ---------------------------------------------------------------------------
    def propose(self, view: BatchView) -> np.ndarray:
        if view.tree is not None and not view.tree.is_chain:
            raise UserError(f"policy {self.name}: SGLang's adaptive mode runs chains only (--speculative-eagle-topk 1), "
                            "and this run verifies token trees; use a chain, or another policy")
        return np.full(view.batch_size, min(self.tier, view.max_k), dtype=np.int64)

    def observe(self, outcome: StepOutcome) -> None:
        self.observe_plain(outcome.proposed.tolist(), outcome.accepted.tolist())

    def propose_plain(self, batch: int, context_tokens: int, cost_model: Any, max_k: int,
                      draft_cost: bool) -> list[int]:
        """:meth:`propose` of a batch of ``batch`` requests, as a list."""
        return [min(self.tier, max_k)] * batch

    def observe_plain(self, proposed: list[int], accepted: list[int]) -> None:
        """One verify batch: ``accepted[i]`` draft tokens accepted of ``proposed[i]`` (requests proposing 0 left out;
        a step where nobody proposed is no verify batch)."""
        counts = [a for p, a in zip(proposed, accepted) if p > 0]
        if not counts:
            return
        self.ema_accept_len = (1 - self.ema_alpha) * self.ema_accept_len + self.ema_alpha * (sum(counts) / len(counts))
        self.batches += 1
        after_warmup = self.batches - self.warmup_batches
        if after_warmup > 0 and after_warmup % self.update_interval == 0:
            self.tier = self.recomputed_tier()

    def recomputed_tier(self) -> int:
        """The tier SGLang's recomputation picks from the current one and the EMA (module docstring)."""
        tiers, ema = self.tiers, self.ema_accept_len
        i = start = tiers.index(self.tier)
        while i > 0 and ema <= tiers[i - 1] - 0.5 + self.down_hysteresis:
            i -= 1
        if i == start:
            while i < len(tiers) - 1 and ema > tiers[i] - 0.5 + self.up_hysteresis:
                i += 1
        return tiers[i]
