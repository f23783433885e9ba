"""Router policies of a fleet: which replica serves each arriving request (one registry, :data:`ROUTERS`).

Each router is a small synchronous class (no SimPy inside, as the speculation policies): :meth:`Router.choose`
takes a view of the arriving request (:class:`RequestView`) and the states of the replicas it may choose from
(:class:`ReplicaState`, in index order: every replica, or in a mixed fleet those whose KV cache can hold the request)
and returns the position of its choice in that list. Ties go to the first position everywhere, so a run never
depends on anything but its config and seed. The states are live (the fleet updates them as requests are routed and
finish): read them during :meth:`Router.choose` only. Names follow vLLM's production stack and llm-d.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.errors import UserError
from simulator.config import ROUTER_NAMES


@dataclass(frozen=True, slots=True)
class RequestView:
    """The arriving request as a router sees it."""

    request_id: int
    prompt_tokens: int
    prompt_id: int | None
    """The workload's prompt id (the same id: the same prompt text); None when the workload has none."""
    block_hashes: Sequence[int]
    """Keys of the prompt's full KV blocks (:func:`simulator.core.prefix_cache.prompt_keys`; empty without prefix
    caching)."""


@dataclass(slots=True)
class ReplicaState:
    """One replica as the router sees it at an arrival (the fleet's live record of it)."""

    index: int
    outstanding: int
    """Requests routed to it and not finished (vLLM production stack's / llm-d's load signal)."""
    cache: Any = None
    """Its :class:`simulator.core.prefix_cache.PrefixCache`, or None without prefix caching."""


class Router:
    """Base class: :meth:`choose` returns the position in ``replicas`` of the replica that serves ``request``."""

    name = ""

    def __init__(self, rng: np.random.Generator | None = None, **params: Any) -> None:
        if params:
            raise UserError(f"--router {self.name}: unknown parameter {sorted(params)[0]!r}")
        self.rng = rng

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState]) -> int:  # pragma: no cover
        raise NotImplementedError

    def surely_elsewhere(self, position: int, replicas: Sequence[ReplicaState]) -> int | None:
        """How many of the next arrivals this router surely sends to another replica than the one at ``position``, as
        long as that replica's outstanding count does not fall (a speed hint: the fleet plans that replica's steps up to
        the next arrival that may come to it, :mod:`simulator.fleet.fleet`). None (the default): it cannot tell."""
        return None


def _least_loaded(replicas: Sequence[ReplicaState]) -> int:
    """Position of the replica with the fewest outstanding requests; ties to the first."""
    loads = [r.outstanding for r in replicas]
    return loads.index(min(loads))


class RoundRobin(Router):
    """vLLM production stack's ``roundrobin`` routing logic (the default of its router): replica 0, 1, ..., N-1, 0, ...
    in arrival order, whatever their load. With identical replicas a permutation of them only relabels which replica
    gets which turn: the fleet figures do not change, the per-replica rows are permuted with the replicas."""

    name = "round-robin"

    def __init__(self, rng: np.random.Generator | None = None, **params: Any) -> None:
        super().__init__(rng, **params)
        self.next = 0

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState]) -> int:
        index = self.next % len(replicas)
        self.next = index + 1
        return index

    def surely_elsewhere(self, position: int, replicas: Sequence[ReplicaState]) -> int | None:
        """The turns before ``position``'s: (position - next) mod N."""
        return (position - self.next) % len(replicas)


class LeastOutstanding(Router):
    """The least-loaded replica: fewest requests routed to it and not finished (vLLM production stack's
    least-loaded routing, llm-d's queue/load scorer); ties to the lowest index."""

    name = "least-outstanding"

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState]) -> int:
        return _least_loaded(replicas)

    def surely_elsewhere(self, position: int, replicas: Sequence[ReplicaState]) -> int | None:
        """Replica ``i`` (at ``position``, c_i outstanding) is chosen only when every other replica j has c_j > c_i,
        or c_j = c_i and comes after it. An arrival sent elsewhere raises one c_j by one, a finish elsewhere lowers one,
        so at least sum_j max(0, c_i + [j before i] - c_j) arrivals go elsewhere first."""
        loads = [r.outstanding for r in replicas]
        c = loads[position]
        return sum([c - o for o in loads if o < c]) + sum([1 for o in loads[:position] if o <= c])


class PowerOfTwo(Router):
    """The power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing", IEEE TPDS
    2001): two distinct replicas drawn uniformly from the router's own generator (its own stream of the run's
    ``SeedSequence``), the one with fewer outstanding requests wins (a tie: the lower index)."""

    name = "power-of-two"

    def __init__(self, rng: np.random.Generator | None = None, **params: Any) -> None:
        super().__init__(rng, **params)
        self._ahead: deque[tuple[int, int]] = deque()
        """The pairs of the next arrivals, drawn ahead by :meth:`surely_elsewhere` (the same draws, in order)."""

    def _draw(self, n: int) -> tuple[int, int]:
        a, b = (int(x) for x in self.rng.choice(n, size=2, replace=False))
        return a, b

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState]) -> int:
        n = len(replicas)
        if n == 1:
            return 0
        a, b = self._ahead.popleft() if self._ahead else self._draw(n)
        return min((a, b), key=lambda i: (replicas[i].outstanding, i))

    def surely_elsewhere(self, position: int, replicas: Sequence[ReplicaState]) -> int | None:
        """Only an arrival whose pair holds ``position`` may go there: the arrivals before the first such pair, the
        pairs drawn ahead from the router's stream in the order :meth:`choose` takes them (at most 4 N ahead)."""
        n = len(replicas)
        if n == 1:
            return 0
        for m, pair in enumerate(self._ahead):
            if position in pair:
                return m
        while len(self._ahead) < 4 * n:
            self._ahead.append(pair := self._draw(n))
            if position in pair:
                return len(self._ahead) - 1
        return len(self._ahead)


class Session(Router):
    """Session affinity (vLLM production stack's ``session`` routing, sticky by a session key): requests of one
    session go to one replica. The session key is the request's ``prompt_id`` (a conversation's turns share it);
    the replica is ``prompt_id mod N`` (a stable modulo, not consistent hashing: adding a replica moves sessions).
    Without prompt ids, round robin."""

    name = "session"

    def __init__(self, rng: np.random.Generator | None = None, **params: Any) -> None:
        super().__init__(rng, **params)
        self._fallback = RoundRobin()

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState]) -> int:
        if request.prompt_id is None:
            return self._fallback.choose(request, replicas)
        return int(request.prompt_id) % len(replicas)


class PrefixAware(Router):
    """Prefix-cache-aware routing balanced against load, as llm-d's prefix-cache scorer weighed with its load scorer
    (and vLLM production stack's prefix-aware routing): the replica whose prefix cache holds the longest leading run
    of the request's prompt blocks (:meth:`simulator.core.prefix_cache.PrefixCache.lookup`), unless its outstanding
    count exceeds the least-loaded replica's by more than ``load_threshold`` (then the least loaded). No hit anywhere:
    the least loaded. Ties to the lowest index. Needs prefix caching on the replicas (``enable_prefix_caching``)."""

    name = "prefix-aware"

    def __init__(self, rng: np.random.Generator | None = None, load_threshold: int = 8, **params: Any) -> None:
        super().__init__(rng, **params)
        if not (isinstance(load_threshold, int) and load_threshold >= 0):
            raise UserError(f"--router prefix-aware: load_threshold must be a whole number >= 0, got {load_threshold!r}")
        self.load_threshold = load_threshold

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState]) -> int:
        least = _least_loaded(replicas)
        hits = [r.cache.lookup(request.block_hashes) if r.cache is not None else 0 for r in replicas]
        best = min(range(len(replicas)), key=lambda i: (-hits[i], replicas[i].outstanding, i))
        if hits[best] == 0:
            return least
        if replicas[best].outstanding - replicas[least].outstanding > self.load_threshold:
            return least
        return best


#: The router registry: name -> class (the names of :data:`simulator.config.ROUTER_NAMES`, in that order).
ROUTERS: dict[str, type[Router]] = {cls.name: cls for cls in (RoundRobin, LeastOutstanding, PowerOfTwo, Session,
                                                             PrefixAware)}
if tuple(ROUTERS) != ROUTER_NAMES:  # pragma: no cover - a developer's slip, caught on import
    raise ImportError(f"simulator.fleet.routers: registry {tuple(ROUTERS)} != config.ROUTER_NAMES {ROUTER_NAMES}")


def make_router(name: str, rng: np.random.Generator | None = None, **params: Any) -> Router:
    """A router by its registered name."""
    if name not in ROUTERS:
        raise UserError(f"--router: expected one of {', '.join(ROUTERS)} (got {name!r})")
    return ROUTERS[name](rng, **params)
