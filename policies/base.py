"""The policy contract shared by the simulator and the real engine (see DESIGN.md).

A policy is a small synchronous object: each decode step the engine hands it a frozen
:class:`BatchView` and asks :meth:`Policy.propose` for the number of tokens to speculate for each
running request (0 = no speculation for that request); after verification it reports the outcome
through :meth:`Policy.observe`. No SimPy inside, so policies unit-test on hand-built views.

Conventions (as vLLM's spec-decode metrics):
- ``proposed[i]`` is the number of draft tokens proposed for request i in the step (k_i, or 0 when an
  n-gram lookup found nothing);
- ``accepted[i]`` in [0, proposed[i]] counts proposed tokens the target accepted;
- the step emits ``accepted[i] + 1`` tokens for request i (the bonus or correction token), so the
  *acceptance length* of a step, ``accepted + 1``, includes the bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from policies.errors import UserError
from policies.step_time import StepCosts
from policies.tree import TreeFamily


@dataclass(frozen=True)
class BatchView:
    """What a policy sees of one decode step, before it runs.

    Arrays are indexed by position in the running batch and have length ``batch_size``.
    """

    time: float
    """Engine clock, seconds."""
    request_ids: np.ndarray
    """Request ids of the running batch (int64)."""
    context_lens: np.ndarray
    """Tokens already in each request's KV cache (prompt + generated so far), int64."""
    generated: np.ndarray
    """Output tokens each request has produced so far (>= 1 after prefill), int64."""
    num_waiting: int
    """Requests waiting in the queue (not yet running)."""
    cost_model: StepCosts
    """The cost model the policy believes in (may differ from the simulator's)."""
    max_k: int
    """Upper bound on k for any request this step (configured k / K_max)."""
    draft_cost: bool = True
    """False for an n-gram proposer: proposing costs no draft passes."""
    tree: TreeFamily | None = None
    """Token trees (:mod:`policies.tree`): a proposal of k verifies ``tree.shape(k)`` (k counts tree nodes, at most
    ``max_k``); None: chains of k tokens."""

    @property
    def batch_size(self) -> int:
        return int(self.request_ids.shape[0])


@dataclass(frozen=True)
class StepOutcome:
    """What happened in one verification step (arrays aligned with the step's :class:`BatchView`)."""

    time: float
    """Engine clock at the end of the step, seconds."""
    request_ids: np.ndarray
    proposed: np.ndarray
    """Draft tokens proposed per request (int64)."""
    accepted: np.ndarray
    """Draft tokens accepted per request, 0 <= accepted <= proposed (int64)."""
    step_seconds: float
    """Duration of the step, seconds."""


class Policy:
    """Base class of speculation-length policies.

    Subclasses set ``name`` and implement :meth:`propose`; :meth:`observe` and :meth:`finish` are
    optional hooks. Construct through :func:`policies.registry.make_policy`.
    """

    name: ClassVar[str] = ""
    stationary: bool = False
    """True when :meth:`propose` depends only on which requests are running (not on their contexts,
    the clock, the queue or past outcomes), and :meth:`observe` learns nothing. The simulator may then
    ask once and simulate several steps of an unchanged batch in one event (see ``simulator.core.runs``)."""

    def __init__(self, k: int, **params: Any) -> None:
        if params:
            raise UserError(f"policy {self.name}: unknown parameter {sorted(params)[0]!r}")
        self.k = int(k)

    def propose(self, view: BatchView) -> np.ndarray:
        """Proposal length per running request, int64 array of length ``view.batch_size``."""
        raise NotImplementedError

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from a finished step (default: nothing)."""

    def finish(self, request_id: int) -> None:
        """A request left the batch (finished or preempted); drop any per-request state."""
