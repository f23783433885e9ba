"""Token trees: the shape of a tree of draft tokens verified in one target pass, its acceptance by depth and by rank,
and the family of subtrees a policy chooses among (issue 23).

Conventions (vLLM's ``speculative_token_tree``, ``vllm/config/speculative.py``; SGLang's EAGLE tree):

- A node of the draft tree is the path of child ranks from the root, e.g. ``(0, 1)``: the second most likely draft
  token after the most likely one. The root is the last verified token, not a node. Every prefix of a node's path is a
  node; the canonical order is by length, then lexicographic (vLLM sorts the tree so). Rank r is the draft's
  (r + 1)-th most likely token under the parent.
- Rank acceptance ``q[d][r]`` (a :data:`RankTable`): the probability that the target's token at depth d (1-based) is
  the draft's rank-r candidate under the node the target reached at depth d - 1, given that it reached it; the sum over
  r is at most 1 (the rest: a token the draft ranked beyond every candidate).
- The accepted length of a step is the depth of the deepest tree node on the target's path (0 when its depth-1 token is
  none of the root's children); it emits accepted + 1 tokens (the bonus or correction token: vLLM's acceptance-length
  convention).

Closed form. The target's path reaches a node of depth d with the product of q along the node's path (its *reach*),
and the nodes of one depth are disjoint events, so

    P(accepted >= d) = sum over nodes of depth d of their reach,    E[accepted] = sum over all nodes of their reach.

A chain of k nodes with q[d][0] = a gives Leviathan et al.'s (ICML 2023) a + a^2 + ... + a^k.
"""
from __future__ import annotations

import ast
import functools
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from policies.errors import UserError

RankTable = tuple[tuple[float, ...], ...]
"""``q[d - 1][r]`` for depths d = 1.. and ranks r = 0..; past its last row the last row repeats, past a row's end the
probability is 0."""

MAX_TREE_NODES = 64
"""Most nodes a configured tree may have (vLLM's and SGLang's published trees have up to about 60)."""

TREE_FLAG = "speculative_token_tree"


def rank_prob(q: RankTable, depth: int, rank: int) -> float:
    """``q[depth][rank]`` of a :data:`RankTable` (depth 1-based; the last row repeats, missing ranks are 0)."""
    row = q[min(depth, len(q)) - 1]
    return row[rank] if rank < len(row) else 0.0


def rank_table(top1: Sequence[float], ranks: Sequence[float]) -> RankTable:
    """The rank table of top-1 acceptance ``top1[d - 1]`` at depth d with the rank-0 misses spread over ranks
    1, 2, ... by the conditional probabilities ``ranks`` (``q[d][r] = (1 - a_d) ranks[r - 1]``, r >= 1)."""
    return tuple((a,) + tuple((1.0 - a) * g for g in ranks) for a in top1)


def _canonical(path: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    return len(path), path


@dataclass(frozen=True)
class TreeShape:
    """A draft tree: its nodes as paths of child ranks, in canonical order. Build it with :meth:`chain`,
    :meth:`from_paths`, :meth:`parse` (vLLM's string) or :meth:`sglang`."""

    paths: tuple[tuple[int, ...], ...]

    # -- constructors --------------------------------------------------------------------------------------------
    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        """The chain of ``k`` nodes (each the most likely token after the one before): ordinary speculation."""
        return cls(tuple((0,) * d for d in range(1, k + 1)))

    @classmethod
    def from_paths(cls, paths: Iterable[object], what: str = TREE_FLAG) -> "TreeShape":
        """The tree of ``paths`` (tuples or lists of ranks >= 0, any order), checked: no empty or repeated path, every
        prefix present, at most :data:`MAX_TREE_NODES` nodes. A bad tree is one :class:`UserError` line naming
        ``what``."""
        try:
            items = list(paths)  # type: ignore[arg-type]
        except TypeError:
            raise UserError(f"{what}: expected a list of paths such as [(0,), (1,), (0, 0)], got {paths!r}") from None
        nodes = []
        for item in items:
            if not isinstance(item, (tuple, list)) or not item or not all(
                    isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in item):
                raise UserError(f"{what}: every path must be a non-empty tuple of ranks >= 0 such as (0, 1), "
                                f"got {item!r}")
            nodes.append(tuple(item))
        if not nodes:
            raise UserError(f"{what}: the tree has no node")
        present = set(nodes)
        if len(present) < len(nodes):
            twice = next(p for p in nodes if nodes.count(p) > 1)
            raise UserError(f"{what}: path {twice} is given twice")
        for path in nodes:
            if len(path) > 1 and path[:-1] not in present:
                raise UserError(f"{what}: path {path} has no parent {path[:-1]} (every prefix of a path must be a "
                                "node)")
        if len(nodes) > MAX_TREE_NODES:
            raise UserError(f"{what}: {len(nodes)} nodes, at most {MAX_TREE_NODES}")
        return cls(tuple(sorted(nodes, key=_canonical)))

    @classmethod
    def parse(cls, text: str, what: str = TREE_FLAG) -> "TreeShape":
        """vLLM's ``speculative_token_tree`` string, e.g. ``"[(0,), (1,), (0, 0)]"``: a Python literal read with
        ``ast.literal_eval`` (never executed), then :meth:`from_paths`."""
        if not isinstance(text, str):
            raise UserError(f"{what}: expected a string such as \"[(0,), (1,), (0, 0)]\", got {text!r}")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise UserError(f"{what}: not a Python list of tuples such as \"[(0,), (1,), (0, 0)]\": {text!r}") from None
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{what}: expected a list of paths such as \"[(0,), (1,), (0, 0)]\", got {text!r}")
        return cls.from_paths(value, what)

    @classmethod
    def sglang(cls, num_steps: int, eagle_topk: int, num_draft_tokens: int, q: RankTable) -> "TreeShape":
        """SGLang's EAGLE tree of ``--speculative-num-steps``, ``--speculative-eagle-topk`` and
        ``--speculative-num-draft-tokens`` (which counts the root: the tree has num_draft_tokens - 1 nodes).

        As SGLang's ``EAGLEWorker.draft_forward`` and ``organize_draft_results`` do by the draft's scores: step 1
        proposes the root's ``eagle_topk`` best tokens; each later step expands the ``eagle_topk`` candidates of
        the depth before with the highest score by their ``eagle_topk`` best tokens each; the tree keeps the
        num_draft_tokens - 1 candidates of highest score. Here the score is the reach under ``q`` (the expected
        acceptance, not one step's draft probabilities: a static tree), ties in canonical order; a child never
        scores above its parent, so the kept set is a tree."""
        for name, value, low in (("speculative_num_steps", num_steps, 1), ("speculative_eagle_topk", eagle_topk, 1),
                                 ("speculative_num_draft_tokens", num_draft_tokens, 2)):
            if not isinstance(value, int) or value < low:
                raise UserError(f"{name}: must be a whole number >= {low}, got {value!r}")
        if eagle_topk == 1 and num_draft_tokens != num_steps + 1:
            raise UserError(f"speculative_num_draft_tokens: must be speculative_num_steps + 1 = {num_steps + 1} "
                            f"with speculative_eagle_topk 1 (a chain; SGLang sets it so), got {num_draft_tokens}")
        reach = {(): 1.0}
        frontier: list[tuple[int, ...]] = [()]
        candidates: list[tuple[int, ...]] = []
        for depth in range(1, num_steps + 1):
            children = [p + (r,) for p in frontier for r in range(eagle_topk)]
            for child in children:
                reach[child] = reach[child[:-1]] * rank_prob(q, depth, child[-1])
            candidates += children
            frontier = sorted(children, key=lambda p: (-reach[p], _canonical(p)))[:eagle_topk]
        nodes = num_draft_tokens - 1
        if nodes > len(candidates):
            raise UserError(f"speculative_num_draft_tokens: {num_draft_tokens} asks for {nodes} tree nodes, but "
                            f"{num_steps} steps of top-{eagle_topk} reach only {len(candidates)}")
        if nodes > MAX_TREE_NODES:
            raise UserError(f"speculative_num_draft_tokens: {nodes} nodes, at most {MAX_TREE_NODES}")
        kept = sorted(candidates, key=lambda p: (-reach[p], _canonical(p)))[:nodes]
        return cls(tuple(sorted(kept, key=_canonical)))

    # -- properties ----------------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Draft tokens verified: the k of the step."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        """Length of the longest path (0 for the empty tree): the draft passes of a step."""
        return len(self.paths[-1]) if self.paths else 0

    @functools.cached_property
    def _per_depth(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(nodes of depth d, nodes of depth d - 1 with children (the root for d = 1)) for d = 1..depth."""
        nodes = [0] * self.depth
        parents: list[set[tuple[int, ...]]] = [set() for _ in range(self.depth)]
        for path in self.paths:
            nodes[len(path) - 1] += 1
            parents[len(path) - 1].add(path[:-1])
        return tuple(nodes), tuple(len(p) for p in parents)

    def nodes_at_depth(self, d: int) -> int:
        """Nodes of depth ``d`` (1-based)."""
        return self._per_depth[0][d - 1] if 1 <= d <= self.depth else 0

    def expanded_at_depth(self, d: int) -> int:
        """Nodes of depth d - 1 with children (the root is depth 0): the tokens draft pass ``d`` feeds per sequence."""
        return self._per_depth[1][d - 1] if 1 <= d <= self.depth else 0

    @functools.cached_property
    def expanded(self) -> tuple[int, ...]:
        """:meth:`expanded_at_depth` of d = 1..depth (a chain: all ones)."""
        return self._per_depth[1]

    @functools.cached_property
    def fed_before(self) -> tuple[int, ...]:
        """Tokens the draft passes before pass d fed a sequence, d = 1..depth (a chain: d - 1): what pass d reads
        beyond the sequence's context."""
        out, total = [], 0
        for fed in self.expanded:
            out.append(total)
            total += fed
        return tuple(out)

    @functools.cached_property
    def is_chain(self) -> bool:
        """Whether every node is the most likely token after its parent (ordinary speculation)."""
        return all(not any(path) for path in self.paths)

    @functools.cached_property
    def _nodes(self) -> frozenset[tuple[int, ...]]:
        return frozenset(self.paths)

    def has(self, path: tuple[int, ...]) -> bool:
        """Whether ``path`` is a node of the tree."""
        return path in self._nodes

    def __str__(self) -> str:
        return "[" + ", ".join(str(p) for p in self.paths) + "]"


def reaches(paths: Sequence[tuple[int, ...]], q: RankTable) -> dict[tuple[int, ...], float]:
    """The reach of each node of ``paths`` (in canonical order, so a parent comes before its children): the product of
    ``q`` along its path, the probability that the target's path passes through it."""
    reach = {(): 1.0}
    for path in paths:
        reach[path] = reach[path[:-1]] * rank_prob(q, len(path), path[-1])
    del reach[()]
    return reach


def survival(shape: TreeShape, q: RankTable) -> tuple[float, ...]:
    """P(accepted >= d) for d = 1..depth: the reach summed over the nodes of depth d (module docstring), made
    non-increasing against rounding (a running minimum), so that :func:`accepted_length` inverts it exactly."""
    sums = [0.0] * shape.depth
    for path, value in reaches(shape.paths, q).items():
        sums[len(path) - 1] += value
    out, low = [], 1.0
    for value in sums:
        low = value if value < low else low
        out.append(low)
    return tuple(out)


def expected_accepted(shape: TreeShape, q: RankTable) -> float:
    """E[accepted] of a step verifying ``shape``: the sum over its nodes of the product of ``q`` along the path."""
    return float(sum(survival(shape, q)))


def inversion_table(surv: Sequence[float]) -> tuple[float, ...]:
    """What :func:`accepted_length` searches: -P(accepted >= d), d = 1..depth (increasing, ``surv`` non-increasing)."""
    return tuple(-s for s in surv)


def accepted_length(table: Sequence[float], u: float) -> int:
    """The accepted length drawn by inversion from a uniform ``u`` in [0, 1): the number of depths d with
    P(accepted >= d) > u, by bisection of ``table`` (:func:`inversion_table` of :func:`survival`), so
    P(result >= d) = P(accepted >= d)."""
    return bisect_left(table, -u)


class TreeFamily:
    """The configured tree and its subtrees a policy chooses among: :meth:`shape` (k) is the k-node subtree of highest
    expected acceptance under ``q``, k = 0..num_nodes: the k nodes of highest reach (ties in canonical order). A child
    never reaches more than its parent and comes after it in a tie, so each is a tree, and as E[accepted] is the sum
    of the nodes' reach no other k-node subtree does better. The shapes are nested: shape(k) is shape(k - 1) and the
    k-th node of :attr:`order`. A chain family's shape(k) is ``TreeShape.chain(k)``."""

    def __init__(self, full: TreeShape, q: RankTable) -> None:
        self.full = full
        self.q = q
        reach = reaches(full.paths, q)
        self.order: tuple[tuple[int, ...], ...] = tuple(sorted(full.paths, key=lambda p: (-reach[p], _canonical(p))))
        """The nodes by decreasing reach: shape(k) holds the first k."""
        self._shapes = [TreeShape(tuple(sorted(self.order[:k], key=_canonical))) for k in range(full.num_nodes + 1)]

    @property
    def num_nodes(self) -> int:
        return self.full.num_nodes

    @property
    def is_chain(self) -> bool:
        return self.full.is_chain

    def shape(self, k: int) -> TreeShape:
        """The k-node subtree of highest expected acceptance (k = 0..num_nodes)."""
        return self._shapes[k]

    def __repr__(self) -> str:
        return f"TreeFamily({self.full})"


def tree_nodes(token_tree: str | None, num_draft_tokens: int | None) -> int | None:
    """Nodes of a configured tree without building it (``None``: no tree): vLLM's string parsed and checked, or SGLang's
    num_draft_tokens - 1."""
    if token_tree is not None:
        return TreeShape.parse(token_tree).num_nodes
    return None if num_draft_tokens is None else num_draft_tokens - 1


def configured_tree(token_tree: str | None, num_steps: int | None, eagle_topk: int | None,
                    num_draft_tokens: int | None, q: RankTable) -> TreeShape | None:
    """The configured tree: vLLM's ``speculative_token_tree`` string, or SGLang's three numbers (whose tree depends on
    ``q``, :meth:`TreeShape.sglang`); ``None`` when neither is given."""
    if token_tree is not None:
        return TreeShape.parse(token_tree)
    if num_steps is None:
        return None
    return TreeShape.sglang(num_steps, eagle_topk, num_draft_tokens, q)  # type: ignore[arg-type]
