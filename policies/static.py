"""Static policies: no speculation, and a fixed proposal length for every request."""
from __future__ import annotations

import numpy as np

from policies.base import BatchView, Policy


class NoSpec(Policy):
    """Never speculate: every step verifies (decodes) one token per request."""

    name = "no-spec"
    stationary = True

    def propose(self, view: BatchView) -> np.ndarray:
        return np.zeros(view.batch_size, dtype=np.int64)


class FixedK(Policy):
    """Propose ``k`` tokens for every running request (vLLM's ``num_speculative_tokens``)."""

    name = "fixed-k"
    stationary = True

    def propose(self, view: BatchView) -> np.ndarray:
        return np.full(view.batch_size, min(self.k, view.max_k), dtype=np.int64)
