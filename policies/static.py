"""Static policies: no speculation, and a fixed proposal length for every request."""
from __future__ import annotations

import numpy as np

from policies.base import BatchView, Policy


class NoSpec(Policy):
    """Never speculate: every step verifies (decodes) one token per request."""

    name = "no-spec"
    stationary = True
    by_count = True
    """:meth:`propose` is :meth:`k_by_count` for everyone (the simulator may ask that instead: a speed shortcut)."""

    def k_by_count(self, batch_size: int, max_k: int) -> int:
        return 0

    def propose(self, view: BatchView) -> np.ndarray:
        return np.zeros(view.batch_size, dtype=np.int64)


class FixedK(Policy):
    """Propose ``k`` tokens for every running request (vLLM's ``num_speculative_tokens``)."""

    name = "fixed-k"
    stationary = True
    by_count = True
    """:meth:`propose` is :meth:`k_by_count` for everyone (the simulator may ask that instead: a speed shortcut)."""

    def k_by_count(self, batch_size: int, max_k: int) -> int:
        """The k every request proposes when ``batch_size`` run and at most ``max_k`` may be proposed."""
        return min(self.k, max_k)

    def propose(self, view: BatchView) -> np.ndarray:
        return np.full(view.batch_size, min(self.k, view.max_k), dtype=np.int64)
