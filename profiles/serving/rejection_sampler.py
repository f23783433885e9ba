"""Verifying a chain of draft tokens, losslessly: the greedy rule and the rejection rule, and the draws they use.

Terms (as vLLM's ``RejectionSampler`` names them): *accepted* tokens are the leading draft tokens the rule keeps;
a *recovered* token is drawn at the first rejected position from the residual norm(max(0, p - q)) (greedy: the
target's argmax there); a *bonus* token is drawn from the target's distribution after a proposal accepted whole.
A step emits its accepted tokens and then one recovered or bonus token: vLLM's acceptance length counts it.

- greedy (temperature 0): :func:`accept_greedy`; the output is the target's greedy output.
- sampling: :func:`accept_sampled`, the rule of Leviathan et al. (ICML 2023, Alg. 1) and Chen et al. (arXiv
  2302.01318); each emitted token is distributed as the target's.

Token trees verify with :mod:`profiles.serving.tree_sampler`, of which a chain is the one-child case.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def probabilities(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """softmax(logits / temperature) over the last axis, float64."""
    return torch.softmax(logits.double() / temperature, dim=-1).cpu().numpy()


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from ``probs`` (need not sum exactly to 1), by inversion of one uniform."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)) unnormalised: what a rejected draft leaves of the target's distribution (Leviathan et
    al. 2023, Alg. 1); ``p`` itself where that rounds to nothing (p(x) < q(x) puts the mass elsewhere)."""
    left = np.maximum(p - q, 0.0)
    return left if left.sum() > 0 else p


def accept_greedy(proposal: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, int]:
    """Greedy verification: ``(a, token)``, a = number of leading proposed tokens equal to the target's
    argmax at their position (``target_argmax[j]`` predicts ``proposal[j]``), token = the argmax after them."""
    a = 0
    while a < len(proposal) and proposal[a] == target_argmax[a]:
        a += 1
    return a, int(target_argmax[a])


def accept_sampled(proposal: Sequence[int], p: np.ndarray, q: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """The rejection rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): ``(a, token)``.

    ``p[j]`` is the target's distribution at the position of ``proposal[j]`` (``len(proposal) + 1`` rows,
    the last one after the whole proposal), ``q[j]`` the draft's that ``proposal[j]`` was drawn from. Token j
    is accepted with probability min(1, p_j(x) / q_j(x)) (one uniform each, in order); at the first rejection
    the recovered token is drawn from norm(max(0, p_j - q_j)), after a full acceptance the bonus token from p at
    the next position.
    """
    for j, x in enumerate(proposal):
        if rng.random() * q[j, x] < p[j, x]:
            continue
        return j, draw(residual(p[j], q[j]), rng)
    return len(proposal), draw(p[len(proposal)], rng)
