"""vLLM's automatic prefix caching (``--enable-prefix-caching``) over a KV cache of blocks, modelled by content.

Semantics follow vLLM's design document "Automatic Prefix Caching" (docs/design/prefix_caching.md, vLLM v1:
``KVCacheManager.get_computed_blocks`` / ``allocate_slots`` / ``free`` and ``BlockPool``):

- **Identity.** Only full blocks are cached. A block is known by a hash of its tokens *and of every token before it*
  (vLLM chains each block's hash on its parent's), so a block is reusable only when its whole prefix matches. Here a
  prompt's content is named in one of two ways (:func:`prompt_keys` picks, per workload):

  - by an integer ``prompt_id`` (the same id: the same token stream, a request's prompt being its first
    ``prompt_tokens`` tokens): :func:`block_hashes` gives block ``j`` the key ``(prompt_id, j)`` packed in one
    integer; it names blocks ``0..j`` of that stream, a chained identity by construction;
  - by a trace's content hashes of fixed-size blocks (Mooncake's ``hash_ids``, one per 512-token block, chained: an
    id names its block and every block before it, and a prompt's last, partial block is a prefix of its id's block):
    :func:`trace_block_keys` names engine block ``j`` (tokens ``[j bs, (j + 1) bs)``) by the trace block holding its
    last token and where in it the engine block ends, ``(id, end)`` packed in one integer, which names the tokens
    ``0 .. (j + 1) bs - 1`` exactly whatever ``bs`` is (it need not divide the trace's block size).

  Both are exact (no collisions, and no ``hash()`` randomisation, so runs repeat bit for bit). The last, partial
  engine block of a prompt has no key: it is never shared.
- **Lookup.** :meth:`PrefixCache.lookup` counts the leading blocks whose keys are cached (held by a running request or
  free but cached) and stops at the first miss, as ``find_longest_cache_hit`` does. A request reuses at most
  ``(tokens - 1) // block_size`` of them (:meth:`PrefixCache.hit_blocks`): vLLM sets ``max_cache_hit_length =
  num_tokens - 1`` so that at least the last token is computed and gives logits (a fully cached, block-aligned prompt
  recomputes its whole last block, as vLLM does). Reused blocks skip prefill: the request's prefill starts at
  ``hit_blocks * block_size`` computed tokens.
- **Reference counting.** Holding a cached block (vLLM's ``touch``) adds a reference and takes it out of the free
  queue; several running requests share one block, counted once in memory.
- **Free queue and LRU eviction.** Blocks held by no running request form a queue in eviction order: never-used blocks
  first, then freed blocks in the order they were freed. New blocks are taken from its head; a cached block taken
  there is evicted (its key forgotten). A finishing or preempted request frees its blocks to the tail *in reverse
  order* (its last blocks, hashing the most tokens, are evicted first), uncached ones (the partial block, decode
  blocks) before its cached ones. Blocks still shared stay held.
- **When blocks become cached.** As in vLLM v1's ``allocate_slots``, a prompt block is cached as soon as the step
  that computes it is scheduled (:meth:`PrefixCache.register`), so a request admitted later in the same step can reuse
  it. A block whose key is already cached (computed twice because both requests missed at admission) stays an
  uncached duplicate, as vLLM keeps duplicates out of its lookups.
- **Statistics** (:class:`CacheStats`), counted once per admission (:meth:`PrefixCache.acquire`), as vLLM's
  ``prefix_cache_queries`` / ``prefix_cache_hits``: queried and hit tokens (the hit rate vLLM logs) and blocks.

Not modelled: blocks filled by generated tokens are never cached (vLLM caches them too, so there a preempted request
also reuses the full blocks of its own output when it is recomputed; here only its prompt blocks), and hashes are
exact, so there are no collisions.

The engine keeps its own count of free blocks and takes blocks for decode lookahead without telling the cache; it
calls :meth:`PrefixCache.sync` with that count before each use of the cache, which takes the same blocks from the
head of the free queue (exact: nothing else touches the queue in between). Plain Python, no SimPy; every call is
O(1) or O(blocks it touches).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

#: Block index bits of a block key: key = prompt_id << BLOCK_BITS | block index (a prompt holds < 2**32 blocks: token
#: counts are at most a billion).
BLOCK_BITS = 32
#: End-offset bits of a trace-keyed block key: key = trace block id << END_BITS | end of the engine block in it (tokens,
#: 1 .. the trace's block size < 2**20).
END_BITS = 20


def block_hashes(prompt_id: int, prompt_tokens: int, block_size: int) -> range:
    """Keys of the full blocks of a prompt: ``prompt_tokens // block_size`` integers, block ``j``'s naming blocks
    ``0..j`` of prompt stream ``prompt_id`` (>= 0). Two prompts with the same id share their common leading full
    blocks; the last, partial block has no key. A ``range``: O(1) to make and to keep."""
    if prompt_id < 0 or prompt_tokens < 0 or block_size < 1:
        raise ValueError(f"block_hashes: need prompt_id >= 0, prompt_tokens >= 0 and block_size >= 1, got "
                         f"{prompt_id}, {prompt_tokens}, {block_size}")
    base = int(prompt_id) << BLOCK_BITS
    return range(base, base + int(prompt_tokens) // int(block_size))


def trace_block_keys(ids: np.ndarray, prompt_tokens: int, block_size: int, trace_block: int) -> list[int]:
    """Keys of the full engine blocks of a prompt of ``prompt_tokens`` tokens whose trace blocks of ``trace_block``
    tokens have the content ids ``ids`` (int64, one per trace block, chained: see the module docstring): engine block
    ``j`` ends at token ``e = (j + 1) block_size``, the last of its tokens lies in trace block ``t = (e - 1) //
    trace_block``, and its key is ``ids[t] << END_BITS | (e - t trace_block)``. Two prompts share an engine block's key
    exactly when their trace blocks up to ``t`` agree and the block ends at the same place in block ``t``: when their
    first ``e`` tokens agree."""
    ends = np.arange(1, prompt_tokens // block_size + 1, dtype=np.int64) * block_size
    held = (ends - 1) // trace_block
    return ((ids[held] << END_BITS) | (ends - held * trace_block)).tolist()


def prompt_keys(workload: Any, block_size: int) -> Callable[[int], Sequence[int]]:
    """Request id -> the keys of its prompt's full blocks of ``block_size`` tokens (the engine's and the prefix-aware
    router's): from the workload's trace block hashes (``workload.blocks``, :func:`trace_block_keys`) when it has them,
    else from its prompt ids (:func:`block_hashes`; every request its own prompt without ids)."""
    prompts = workload.prompt_list
    blocks = workload.blocks
    if blocks is None:
        ids = workload.prompt_id_list
        return lambda rid: block_hashes(ids[rid], prompts[rid], block_size)
    if blocks.tokens >= 1 << END_BITS:
        raise ValueError(f"prompt_keys: trace blocks of {blocks.tokens} tokens; at most {(1 << END_BITS) - 1}")
    return lambda rid: trace_block_keys(blocks.of(rid), prompts[rid], block_size, blocks.tokens)


@dataclass
class CacheStats:
    """Prefix-cache statistics, one count per admission (a request readmitted after preemption counts again)."""

    requests: int = 0
    """Admissions that queried the cache."""
    query_tokens: int = 0
    """Tokens to prefill before the cache was asked (prompt, plus generated tokens after a preemption)."""
    hit_tokens: int = 0
    """Tokens that skipped prefill (reused blocks x block size)."""
    query_blocks: int = 0
    """Full prompt blocks asked about."""
    hit_blocks: int = 0
    """Blocks reused."""
    evicted_blocks: int = 0
    """Cached blocks dropped to make room."""

    @property
    def hit_rate(self) -> float:
        """Hit tokens / queried tokens, the figure vLLM logs as its prefix cache hit rate (0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @classmethod
    def total(cls, stats: "list[CacheStats]") -> "CacheStats":
        """The counts of several caches added up (a fleet's replicas)."""
        return cls(*(sum(getattr(s, f.name) for s in stats) for f in fields(cls)))

    def as_dict(self) -> dict[str, float]:
        """The counts and the hit rate, named for a summary (``prefix_cache_*``)."""
        return {"prefix_cache_hit_rate": self.hit_rate, "prefix_cache_hit_tokens": self.hit_tokens,
                "prefix_cache_query_tokens": self.query_tokens, "prefix_cache_hit_blocks": self.hit_blocks,
                "prefix_cache_query_blocks": self.query_blocks, "prefix_cache_evicted_blocks": self.evicted_blocks}


class _Request:
    """What the cache knows of a running request: its block keys and the cached blocks it holds, in block order."""

    __slots__ = ("hashes", "next", "held")

    def __init__(self, hashes: Sequence[int], hit: int) -> None:
        self.hashes = hashes
        self.next = hit
        """Index of its next block to register."""
        self.held: list[int] = list(hashes[:hit])
        """Keys of the cached blocks it holds (a reference each)."""


class PrefixCache:
    """vLLM's block-level prefix cache over ``num_blocks`` KV blocks of ``block_size`` tokens (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"PrefixCache: need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.stats = CacheStats()
        self._refs: dict[int, int] = {}
        """Cached blocks held by running requests: key -> number of requests holding it (>= 1)."""
        self._queue: OrderedDict[int, None] = OrderedDict()
        """Freed blocks held by nobody, least recently freed first: keys >= 0 of cached blocks, negative markers of
        uncached ones."""
        self._fresh = num_blocks
        """Never-used blocks, ahead of the queue (vLLM's free queue starts with every block)."""
        self._marker = 0
        self._requests: dict[int, _Request] = {}

    # -- counts -----------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks held by no running request, cached or not: what the engine may still allocate."""
        return self._fresh + len(self._queue)

    @property
    def evictable_blocks(self) -> int:
        """Free blocks that still hold cached content (free but cached)."""
        return sum(1 for key in self._queue if key >= 0)

    @property
    def cached_blocks(self) -> int:
        """Blocks whose content can be reused now: held by running requests or free but cached."""
        return len(self._refs) + self.evictable_blocks

    # -- queries (no change of state) -------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` that are cached (held by a running request, or free but cached)."""
        refs, queue = self._refs, self._queue
        for j, key in enumerate(hashes):
            if key not in refs and key not in queue:
                return j
        return len(hashes)

    def hit_blocks(self, hashes: Sequence[int], tokens: int) -> int:
        """Blocks a request of ``tokens`` tokens to prefill reuses: the leading cached ones, at most
        ``(tokens - 1) // block_size`` (vLLM's ``max_cache_hit_length = num_tokens - 1``: the last token is always
        computed). Its prefill starts at ``hit_blocks * block_size`` computed tokens."""
        limit = (tokens - 1) // self.block_size
        return self.lookup(hashes[:limit] if limit < len(hashes) else hashes)

    def touch_cost(self, hashes: Sequence[int], hit: int) -> int:
        """Free blocks that holding ``hashes[:hit]`` takes: those free but cached (held ones are shared for free).
        A request fits when ``touch_cost + new blocks <= free_blocks`` (vLLM's ``num_evictable_computed_blocks``)."""
        refs = self._refs
        return sum(1 for key in hashes[:hit] if key not in refs)

    # -- changes ----------------------------------------------------------------------------------
    def sync(self, free_blocks: int) -> None:
        """The engine's free-block count is now ``free_blocks``: take the blocks it allocated without the cache
        (decode lookahead, runs of steps) from the head of the free queue (:meth:`take`)."""
        self.take(self.free_blocks - free_blocks)

    def take(self, n: int) -> None:
        """Allocate ``n`` new blocks from the head of the free queue: never-used blocks first, then the least recently
        freed, evicting those that were cached."""
        if n < 0 or n > self.free_blocks:
            raise ValueError(f"PrefixCache.take: asked for {n} blocks with {self.free_blocks} free")
        fresh = min(n, self._fresh)
        self._fresh -= fresh
        queue = self._queue
        evicted = 0
        for _ in range(n - fresh):
            key, _ = queue.popitem(last=False)
            evicted += key >= 0
        self.stats.evicted_blocks += evicted

    def acquire(self, rid: int, hashes: Sequence[int], hit: int, tokens: int) -> int:
        """Admission of request ``rid`` with block keys ``hashes`` (its prompt's, :func:`block_hashes`) and ``tokens``
        tokens to prefill: hold its first ``hit`` blocks (cached: :meth:`hit_blocks`) and count the query. Returns
        the free blocks this took (:meth:`touch_cost`). Its new blocks come from :meth:`take`; :meth:`register` caches
        them as they are scheduled."""
        if rid in self._requests:
            raise ValueError(f"PrefixCache.acquire: request {rid} already holds blocks")
        refs, queue = self._refs, self._queue
        taken = 0
        for key in hashes[:hit]:
            if key in refs:
                refs[key] += 1
            elif key in queue:
                del queue[key]
                refs[key] = 1
                taken += 1
            else:
                raise ValueError(f"PrefixCache.acquire: request {rid}: block key {key} is not cached")
        self._requests[rid] = _Request(hashes, hit)
        stats = self.stats
        stats.requests += 1
        stats.query_tokens += tokens
        stats.hit_tokens += hit * self.block_size
        stats.query_blocks += len(hashes)
        stats.hit_blocks += hit
        return taken

    def register(self, rid: int, computed_tokens: int) -> None:
        """Request ``rid`` has blocks (from :meth:`take`) for its first ``computed_tokens`` tokens and the step that
        computes them is scheduled: its full prompt blocks among them become cached. A block whose key is already
        cached stays an uncached duplicate."""
        request = self._requests[rid]
        hashes, refs, queue, held = request.hashes, self._refs, self._queue, request.held
        end = min(computed_tokens // self.block_size, len(hashes))
        for j in range(request.next, end):
            key = hashes[j]
            if key not in refs and key not in queue:
                refs[key] = 1
                held.append(key)
        request.next = max(request.next, end)

    def release(self, rid: int, blocks: int) -> int:
        """Request ``rid`` (finished or preempted) gives back all ``blocks`` blocks it holds (the engine's count,
        shared ones included): to the tail of the free queue in reverse block order, uncached ones first; shared
        blocks stay with their other holders. Returns the blocks that became free."""
        request = self._requests.pop(rid, None)
        held = request.held if request is not None else []
        uncached = blocks - len(held)
        if uncached < 0:
            raise ValueError(f"PrefixCache.release: request {rid} holds {len(held)} cached blocks, more than {blocks}")
        queue, refs = self._queue, self._refs
        marker = self._marker
        for _ in range(uncached):
            marker -= 1
            queue[marker] = None
        self._marker = marker
        freed = uncached
        for key in reversed(held):
            count = refs[key] - 1
            if count:
                refs[key] = count
            else:
                del refs[key]
                queue[key] = None
                freed += 1
        return freed
