"""The grid of shapes a profile measures (tokens, sequences): its points, their measurement groups and order.

Works without torch; both the profiler (:mod:`profiles.profiler`) and the analytical profiles
(:mod:`profiles.analytical`) use it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from policies.errors import UserError


@dataclass(frozen=True)
class Point:
    """One profile row's shape: ``query_len`` tokens per sequence over ``context_len`` cached ones."""

    role: str
    phase: str
    batch_size: int
    query_len: int
    context_len: int

    @property
    def key(self) -> tuple:
        return (self.role, self.phase, self.batch_size, self.query_len, self.context_len)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.phase == "prefill":
            return f"{self.role} prefill b={self.batch_size} P={self.query_len}"
        return f"{self.role} decode b={self.batch_size} q={self.query_len} L={self.context_len}"


@dataclass(frozen=True)
class Group:
    """Points measured over one KV cache: a ``(role, batch, context)`` decode group of several
    ``query_len``, or a single prefill point."""

    role: str
    phase: str
    batch_size: int
    context_len: int
    points: tuple[Point, ...]


def coarse_levels(n: int) -> list[int]:
    """Refinement level of each of ``n`` axis values: 0 for every 4th and the last, 1 for every 2nd, else 2."""
    return [0 if i % 4 == 0 or i == n - 1 else 1 if i % 2 == 0 else 2 for i in range(n)]


@dataclass(frozen=True)
class Grid:
    """Axis values of a profile (tokens, sequences). Prefill points with ``batch x P`` above
    ``max_prefill_tokens`` are left out (None: no limit)."""

    batch_sizes: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    max_prefill_tokens: int | None = None
    draft_query_lens: tuple[int, ...] = (1,)
    """New tokens per sequence of the draft's decode points: 1 (a proposal pass) and, for the catch-up pass that
    feeds the draft the tokens it has not seen (:func:`policies.protocol.draft_lag`), more."""

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "query_lens", "context_lens", "prefill_lens", "draft_query_lens"):
            values = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise UserError(f"{flag}: values must be positive integers (got {','.join(map(str, values))})")
            if list(values) != sorted(set(values)):
                raise UserError(f"{flag}: values must be increasing without repeats (got {','.join(map(str, values))})")
        if not (self.batch_sizes and self.query_lens and self.context_lens):
            raise UserError("grid: --batch-sizes, --query-lens and --context-lens need at least one value each")
        if self.draft_query_lens[:1] != (1,):
            raise UserError(f"--draft-query-lens: must start with 1, a proposal pass (got "
                            f"{','.join(map(str, self.draft_query_lens))})")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise UserError(f"--max-prefill-tokens: must be >= 1 (got {self.max_prefill_tokens})")

    def groups(self, roles: tuple[str, ...] = ("target", "draft")) -> list[Group]:
        """Every measurement group, coarse to fine: level by level (see :func:`coarse_levels`), each level's
        decode groups by (batch, context) with the roles interleaved, then its prefill points."""
        lb, lq, lc, lp = (dict(zip(v, coarse_levels(len(v)))) for v in
                          (self.batch_sizes, self.query_lens, self.context_lens, self.prefill_lens))
        out = []
        for level in range(3):
            for b in self.batch_sizes:
                for ctx in self.context_lens:
                    for role in roles:
                        qs = self.query_lens if role == "target" else self.draft_query_lens
                        levels = {q: max(lb[b], lc[ctx], lq.get(q, 0) if role == "target" else 0) for q in qs}
                        pts = tuple(Point(role, "decode", b, q, ctx) for q in qs if levels[q] == level)
                        if pts:
                            out.append(Group(role, "decode", b, ctx, pts))
            for b in self.batch_sizes:
                for p in self.prefill_lens:
                    if max(lb[b], lp[p]) != level:
                        continue
                    if self.max_prefill_tokens is not None and b * p > self.max_prefill_tokens:
                        continue
                    out.extend(Group(role, "prefill", b, 0, (Point(role, "prefill", b, p, 0),)) for role in roles)
        return out

    def points(self, roles: tuple[str, ...] = ("target", "draft")) -> list[Point]:
        """Every point, in measurement order."""
        return [p for g in self.groups(roles) for p in g.points]

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(int(math.log2(lo)), int(math.log2(hi)) + 1))


#: The grid of the GPU runs and the shipped analytical profiles: batch 1..256, k + 1 in 1..9,
#: contexts and prompts 128..4096 tokens, prefill batches up to 16384 tokens.
GPU_GRID = Grid(batch_sizes=powers_of_two(1, 256), query_lens=tuple(range(1, 10)),
                context_lens=powers_of_two(128, 4096), prefill_lens=powers_of_two(128, 4096),
                max_prefill_tokens=16384)
