"""Verifying a drafted token tree, losslessly: which path of the tree the target takes, and the token after it.

Terms as vLLM's ``RejectionSampler`` names them (:mod:`profiles.serving.rejection_sampler`): the *accepted* tokens
are the nodes of the path the rule walks down from the root; at the node where it stops, a *recovered* token is drawn
(some child was rejected: from what the rejections left of the target's distribution; greedy: the target's argmax),
or a *bonus* token (the node has no child: from the target's distribution there). The accepted length is the path's
depth, and a step emits accepted + 1 tokens.

- greedy (temperature 0), :func:`walk_greedy`: at each node, move to the child whose token is the target's argmax
  there, if any. The output is the target's greedy output.
- sampling, :func:`walk_sampled`: multi-draft speculative sampling over the siblings, recursive rejection sampling
  without replacement (Jeon et al., "Recursive Speculative Decoding", arXiv 2402.14160, Alg. 2; SpecInfer's
  multi-step speculative sampling, Miao et al., ASPLOS 2024, arXiv 2305.09781, is the same walk with siblings drawn
  with replacement). A node's children x_1, x_2, ... were drawn one after the other from the draft's q without
  replacement (:func:`profiles.serving.token_tree.grow`). With p_1 = p (the target's distribution at the node) and
  q_1 = q, child m is accepted with probability min(1, p_m(x_m) / q_m(x_m)); if it is rejected,
  p_{m+1} = norm(max(0, p_m - q_m)) and q_{m+1} = q_m without x_m, renormalised; if every child is rejected, the
  recovered token is drawn from p_{m+1}. Each test is Leviathan et al.'s rule (ICML 2023) for target p_m against
  draft q_m, which is exactly child m's distribution given the children before it, so given a rejection the token
  emitted at the node follows p_{m+1}; by induction from the last child, it follows p. An accepted child's subtree is
  then verified the same way, so every emitted token is distributed as the target's. With one child per node this is
  the chain rule of :func:`profiles.serving.rejection_sampler.accept_sampled`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from profiles.serving.rejection_sampler import draw, residual
from profiles.serving.token_tree import DraftTree


def walk_greedy(tree: DraftTree, argmax: Sequence[int]) -> tuple[list[int], int]:
    """``(path, token)``: the accepted nodes and the recovered or bonus token, from the target's argmax after the
    root (``argmax[0]``) and after each node n (``argmax[1 + n]``)."""
    path, node = [], -1
    while True:
        target = int(argmax[node + 1])
        child = next((c for c in tree.children(node) if tree.tokens[c] == target), None)
        if child is None:
            return path, target
        path.append(child)
        node = child


def walk_sampled(tree: DraftTree, p: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
    """``(path, token)`` by recursive rejection sampling (module docstring), from the target's distributions after
    the root (``p[0]``) and after each node n (``p[1 + n]``), ``(1 + tree.size, vocab)``, and the draft's
    ``tree.q``. One uniform per sibling tested, one draw for the recovered or bonus token."""
    path, node = [], -1
    while True:
        children = tree.children(node)
        target = p[node + 1]
        if not children:
            return path, draw(target, rng)  # bonus token
        draft = tree.q[node].copy()
        for child in children:
            x = tree.tokens[child]
            if rng.random() * draft[x] < target[x]:
                path.append(child)
                node = child
                break
            left = residual(target, draft)
            target = left / left.sum()
            draft[x] = 0.0
            mass = draft.sum()
            draft = draft / mass if mass > 0 else draft
        else:
            return path, draw(target, rng)  # recovered token
