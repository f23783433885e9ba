"""A request's drafted token tree in the real engine: how a proposer grows it to a :class:`policies.tree.TreeShape`,
and the target pass that verifies it (tree attention).

Shapes follow vLLM's ``speculative_token_tree`` (:mod:`policies.tree`): a node is the path of child ranks from the
root, the request's newest token (not a node). :func:`grow` drafts one depth per pass, as EAGLE-2 (Li et al., arXiv
2406.16858) and vLLM's tree proposer do: pass 1 gives the root's candidates, pass d feeds the nodes of depth d - 1
that the shape expands and gives their candidates. A node of rank r is

- greedy (temperature 0): the draft's (r + 1)-th most likely token under its parent (``torch.topk`` order);
- sampling: the (m + 1)-th token drawn *without replacement* from the draft's distribution q under its parent, m
  the node's place among its siblings (so a shape's ranks 0, 1, 2 are the first three draws; a shape that skips a
  rank takes the draws in order). Drawing without replacement is what lets :mod:`profiles.serving.tree_sampler`
  verify siblings one after the other losslessly; where q's support is used up, the node and its subtree are not
  drafted (the tree verified is then a subtree of the shape).

Nodes are kept in the shape's canonical order (by depth, then lexicographic: parents before children, siblings by
rank), which is also the order of the verification block (:func:`verification_block`): the root at the row's
``held`` tokens (position ``held``), node n at column ``1 + n`` and position ``held + depth(n)``, attending to the
row's cached tokens, the root and its own ancestors. Keeping the root and an accepted path (:func:`kept_tokens`)
then leaves the cache as if the path had been fed as a chain.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from policies.tree import TreeShape
from profiles.serving.kv import KVBatch, TreeBlock
from profiles.serving.rejection_sampler import draw, probabilities

#: ``expand(trees, nodes)``: feed ``nodes[i]`` (node indices of ``trees[i]``, all of one depth) to the proposer;
#: their logits ``(B, q, vocab)``, row i's at columns ``0 .. len(nodes[i]) - 1``.
Expand = Callable[[list["DraftTree"], list[list[int]]], torch.Tensor]


@dataclass
class DraftTree:
    """One request's drafted tree: node n has token ``tokens[n]``, parent ``parents[n]`` (-1: the root) and depth
    ``depths[n]`` (1: a child of the root); nodes in canonical order (module docstring)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    q: dict[int, np.ndarray] = field(default_factory=dict)
    """Sampling: the draft's distribution under each expanded node (-1: the root), which its children were drawn
    from without replacement; empty when greedy."""

    @property
    def size(self) -> int:
        """Nodes: the draft tokens verified."""
        return len(self.tokens)

    def add(self, token: int, parent: int) -> int:
        """Append a node under ``parent`` (-1: the root); its index."""
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (-1: the root) by rank."""
        return [n for n, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def grow(shapes: Sequence[TreeShape | None], root_logits: torch.Tensor, expand: Expand, temperature: float,
         rng: np.random.Generator) -> tuple[list[DraftTree], int]:
    """Draft each row's tree to ``shapes[i]`` (None: no tree) from the root's logits ``(B, vocab)`` and ``expand``
    (module docstring); the trees and the number of ``expand`` passes run."""
    trees = [DraftTree() for _ in shapes]
    node_of: list[dict[tuple[int, ...], int]] = [{(): -1} for _ in shapes]
    _children(trees, shapes, node_of, [[()] if s is not None and s.num_nodes else [] for s in shapes],
              root_logits[:, None], temperature, rng)
    passes = 0
    depth = max((s.depth for s in shapes if s is not None), default=0)
    for d in range(2, depth + 1):
        # the drafted nodes of depth d - 1 that the shape expands, in canonical order (the order they were added)
        parents = [[p for p in node_of[i] if len(p) == d - 1 and _ranks(p, shapes[i])] if shapes[i] is not None
                   else [] for i in range(len(shapes))]
        if not any(parents):
            break
        logits = expand(trees, [[node_of[i][p] for p in row] for i, row in enumerate(parents)])
        passes += 1
        _children(trees, shapes, node_of, parents, logits, temperature, rng)
    return trees, passes


def _ranks(parent: tuple[int, ...], shape: TreeShape) -> list[int]:
    """Ranks of ``parent``'s children in ``shape``, increasing."""
    return sorted(p[-1] for p in shape.paths if len(p) == len(parent) + 1 and p[:-1] == parent)


def _children(trees: list[DraftTree], shapes: Sequence[TreeShape | None], node_of: list[dict[tuple[int, ...], int]],
              parents: list[list[tuple[int, ...]]], logits: torch.Tensor, temperature: float,
              rng: np.random.Generator) -> None:
    """Add the children the shapes give ``parents[i]`` (paths, drafted nodes of row i) from ``logits[i, m]``
    ``(B, q, vocab)``, the draft's logits under the m-th of them."""
    ranks = [[_ranks(parent, shapes[i]) for parent in row] for i, row in enumerate(parents)]
    if temperature == 0:
        width = min(max((r[-1] for row in ranks for r in row if r), default=0) + 1, logits.shape[-1])
        best = torch.topk(logits, width, dim=-1).indices.tolist()               # (B, q, width)
    else:
        q = probabilities(logits, temperature)                                   # (B, q, vocab)
    for i, row in enumerate(parents):
        tree = trees[i]
        for m, parent in enumerate(row):
            if not ranks[i][m]:
                continue
            node = node_of[i][parent]
            if temperature == 0:
                tokens = [best[i][m][r] for r in ranks[i][m]]
            else:
                tree.q[node] = q[i, m]
                tokens = _without_replacement(q[i, m], len(ranks[i][m]), rng)
            for r, token in zip(ranks[i][m], tokens):
                node_of[i][parent + (r,)] = tree.add(token, node)


def _without_replacement(q: np.ndarray, n: int, rng: np.random.Generator) -> list[int]:
    """Up to ``n`` tokens drawn one after the other from ``q``, each from q without the ones before (renormalised);
    fewer where q's support is used up."""
    left = q.copy()
    out: list[int] = []
    while len(out) < n and left.sum() > 0:
        token = draw(left, rng)
        out.append(token)
        left[token] = 0.0
    return out


def verification_block(roots: Sequence[int], trees: Sequence[DraftTree], held: Sequence[int]) -> TreeBlock:
    """The target's pass over each row's root (its newest token) and tree, after the row's ``held`` cached tokens
    (module docstring)."""
    tokens, positions, prefix, sees = [], [], [], []
    for root, tree, h in zip(roots, trees, held):
        tokens.append([int(root)] + tree.tokens)
        positions.append([h] + [h + d for d in tree.depths])
        prefix.append([h] * (1 + tree.size))
        sees.append([(h,)] + [(h,) + tuple(h + 1 + a for a in tree.path(n)) for n in range(tree.size)])
    return TreeBlock(tokens, positions, prefix, sees)


def path_of_depth(tree: DraftTree, depth: int) -> list[int]:
    """The path to the tree's first node (canonical order) of ``depth``, or of its deepest depth if shallower (0:
    the empty path): the path a timing twin's drawn accepted length takes."""
    depth = min(depth, max(tree.depths, default=0))
    return tree.path(tree.depths.index(depth)) if depth else []


def kept_tokens(path: Sequence[int], held: int) -> list[int]:
    """The target tokens to keep after verifying a row (after its ``held`` cached ones): the root and the accepted
    ``path``'s nodes (column 1 + n of the block)."""
    return [held] + [held + 1 + n for n in path]


class TreeProposer:
    """What drafts token trees for the engine's running batch (rows in the engine's order): a proposer's KV cache
    and the inputs it has not fed yet. A step's first pass feeds every row's pending inputs (the catch-up) and gives
    the root's logits; each later pass feeds the nodes one depth expands, each attending to the row's prefix and its
    own ancestors (:func:`grow`). Subclasses say what a pass feeds (:meth:`_catch_up`, :meth:`_embeds`), what it
    returns (:meth:`_expanded`) and what the cache keeps after verification (:meth:`commit`)."""

    def __init__(self, kv: KVBatch, temperature: float, rng: np.random.Generator) -> None:
        self.kv = kv
        self.temperature = temperature
        self.rng = rng
        self.prefix: list[int] | None = None
        """Per row, the tokens the cache held after this step's first pass (None: no draft this step)."""
        self.fed: list[dict[int, int]] = []
        """Per row, the node -> token index in the cache of each node fed this step."""

    def draft(self, shapes: Sequence[TreeShape | None]) -> tuple[list[DraftTree], int, int]:
        """Each row's tree (``shapes[i]`` None: none, its pending inputs are fed all the same); the passes run and the
        tokens the first pass fed (padded: rows x the longest pending)."""
        root, catchup = self._catch_up()
        self.fed = [{} for _ in shapes]
        trees, passes = grow(shapes, root, self._expand, self.temperature, self.rng)
        return trees, 1 + passes, catchup

    def _expand(self, trees: list[DraftTree], nodes: list[list[int]]) -> torch.Tensor:
        """:data:`Expand`: node n of row i at position prefix + depth(n) - 1, attending to the row's prefix and to
        its ancestors and itself (fed this step)."""
        assert self.prefix is not None
        held = self.kv.lengths()
        tokens, positions, prefix, sees = [], [], [], []
        for i, (tree, row) in enumerate(zip(trees, nodes)):
            for j, n in enumerate(row):
                self.fed[i][n] = held[i] + j
            tokens.append([tree.tokens[n] for n in row])
            positions.append([self.prefix[i] + tree.depths[n] - 1 for n in row])
            prefix.append([self.prefix[i]] * len(row))
            sees.append([tuple(self.fed[i][a] for a in tree.path(n)) for n in row])
        states = self.kv.extend_tree(TreeBlock(tokens, positions, prefix, sees, self._embeds(trees, nodes)))
        return self._expanded(trees, nodes, states)

    def _catch_up(self) -> tuple[torch.Tensor, int]:
        """Feed every row's pending inputs, set :attr:`prefix`; the root's logits ``(B, vocab)`` and the tokens fed
        (padded)."""
        raise NotImplementedError

    def _embeds(self, trees: list[DraftTree], nodes: list[list[int]]) -> torch.Tensor | None:
        """Input embeddings of the nodes a pass feeds ``(B, q, hidden)``, or None (their tokens' own)."""
        return None

    def _expanded(self, trees: list[DraftTree], nodes: list[list[int]], states: torch.Tensor) -> torch.Tensor:
        """The logits of the nodes a pass fed from its hidden states ``(B, q, hidden)``."""
        raise NotImplementedError

    def commit(self, trees: list[DraftTree] | None, paths: list[list[int]], tokens: list[int],
               features: list[torch.Tensor] | None) -> None:
        """After verification: row i accepted ``paths[i]`` of ``trees[i]`` (None: nothing was drafted this step)
        and emitted ``tokens[i]`` after it; ``features[i]``: the target's final-normed hidden states at the root and
        the path's nodes ``(1 + len(path), hidden)`` (heads only)."""
        raise NotImplementedError

    def remove(self, rows: Sequence[int]) -> list[int]:
        """Drop finished rows (:meth:`KVBatch.remove`); the old indices of the rows left, in order."""
        raise NotImplementedError
