"""KV-cache capacity from a memory budget (vLLM's profiling step, done on paper), and how many KV blocks a request
holds (vLLM's KV-cache managers).

num_gpu_blocks = floor((device memory x utilisation - target weights - draft weights - activation reserve)
                       / (block_size x KV bytes per token)),
where a token's KV bytes are the target's plus, with a draft proposer, the draft's (2 x layers x kv_heads x head_dim
x dtype bytes each for grouped-query attention, the latent for MLA). Memory in GiB, KV in bytes per token.

The draft is a draft model or a draft head (EAGLE, EAGLE-3, MTP): the profile's memory figures are then the head's
(:class:`profiles.architectures.Architecture`): its own weights only (fc layer, decoder layer, norms and EAGLE-3's own
LM head; the embedding, and EAGLE's and MTP's LM head, are the target's and counted once, in the target's) and one
layer's KV per token, which vLLM allocates for the head beside the target's as for a draft model.

**Sliding-window layers** (Gemma-2, gpt-oss; the profile's ``*_sliding_kv_bytes_per_token`` and
``*_sliding_window``): vLLM's hybrid KV-cache manager gives every group of layers pages of one pool and frees, in a
sliding group, every page wholly before ``computed - window + 1`` (``SlidingWindowManager.remove_skipped_blocks``;
``profiles/data/moe_speculation/architecture_notes.md`` sec. 1): a request holds pages for all its tokens in
full-attention layers, for the window (plus the step's new tokens and at most one page where the window starts) in
sliding ones. Here a block is ``block_size`` tokens of ``unit`` KV bytes, ``unit`` the greatest common divisor of the
full-attention layers' and each window's bytes per token (vLLM's page of one layer group when the groups are
alike, as Gemma-2's 21 + 21 layers and gpt-oss's are), and a request with ``total`` tokens of which ``computed``
already in the cache holds (:meth:`KVLayout.blocks`)

    full x ceil(total / bs) + sum over windows W of m_W x (ceil(total / bs) - max(0, floor((computed - W + 1) / bs)))

blocks, ``full`` and ``m_W`` the layers' bytes in units. A model without sliding windows has one kind, ``full`` 1 and
``unit`` its whole KV per token: a block of every layer, ceil(tokens / bs) a request, the engine's fast path
(:attr:`KVLayout.windowed` False switches it, :mod:`simulator.core.engine`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simulator.config import SimConfig
from simulator.costs.cost_model import CostModel
from simulator.costs.profile_table import Memory
from policies.errors import UserError

GIB = 1024 ** 3
#: Most KV blocks a derived cache may have (1e12 blocks: far beyond any device; more means bad figures).
MAX_BLOCKS = 1e12


@dataclass(frozen=True)
class KVBytes:
    """KV bytes per token of what a run caches (the target's, and the draft's when it speculates with a draft):
    ``per_token`` over all layers, of which ``sliding`` (window, bytes per token) in sliding-window layers."""

    per_token: float
    sliding: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, mem: Memory, with_draft: bool) -> "KVBytes":
        roles = (("target", mem.target_kv_bytes_per_token, mem.target_sliding_kv_bytes_per_token,
                  mem.target_sliding_window),)
        if with_draft:
            roles += (("draft", mem.draft_kv_bytes_per_token, mem.draft_sliding_kv_bytes_per_token,
                       mem.draft_sliding_window),)
        windows: dict[int, float] = {}
        for _, _, sliding, window in roles:
            if sliding:
                windows[window] = windows.get(window, 0.0) + sliding
        per_token = mem.target_kv_bytes_per_token + (mem.draft_kv_bytes_per_token if with_draft else 0.0)
        return cls(per_token, tuple(sorted(windows.items())))

    def held(self, tokens: int) -> float:
        """Bytes a request of ``tokens`` cached tokens holds: all of them in full-attention layers, the last
        ``window - 1`` in sliding ones (what the next token attends to; disaggregated serving sends these)."""
        if not self.sliding:
            return tokens * self.per_token
        full = self.per_token - sum(size for _, size in self.sliding)
        return tokens * full + sum(size * min(tokens, window - 1) for window, size in self.sliding)


@dataclass(frozen=True)
class KVLayout:
    """How many KV blocks a request holds (module docstring): ``full`` blocks per ``block_size`` tokens of
    full-attention layers, and per window ``(W, m_W)`` its sliding layers' blocks, freed as the window passes."""

    block_size: int
    full: int = 1
    windows: tuple[tuple[int, int], ...] = ()

    @property
    def windowed(self) -> bool:
        """Whether some layers slide (the general path); False: ceil(tokens / block_size) a request (the fast path)."""
        return bool(self.windows)

    @property
    def span(self) -> int:
        """Blocks per ``block_size`` tokens while every layer holds them."""
        return self.full + sum(m for _, m in self.windows)

    def _skipped(self, computed: int) -> int:
        """Blocks freed by the windows once ``computed`` tokens are in the cache."""
        bs = self.block_size
        return sum(m * ((computed - w + 1) // bs) for w, m in self.windows if computed >= w - 1 + bs)

    def held(self, pages: int, computed: int) -> int:
        """Blocks a request holds with ``pages`` blocks of tokens allocated in each layer and ``computed`` cached."""
        return pages if not self.windows else self.span * pages - self._skipped(computed)

    def blocks(self, computed: int, total: int) -> int:
        """Blocks a request holds for ``total`` tokens, ``computed`` of them already cached before this step."""
        return self.held(-(-total // self.block_size), computed)

    def room(self, held: int, free: int, done: int) -> int:
        """Tokens beyond ``done`` a prefill can reach with its ``held`` blocks and ``free`` ones (its chunk's limit)."""
        if not self.windows:
            return (held + free) * self.block_size - done
        return (held + free + self._skipped(done)) // self.span * self.block_size - done

    def most(self, tokens: np.ndarray, lookahead: int) -> np.ndarray:
        """Most blocks a request of ``tokens`` prompt + output tokens may ever need: its context and a step's
        ``lookahead`` slots (a sliding layer's share at most the window, the step's tokens and one block), or its
        whole prompt and output recomputed at once after a preemption."""
        bs = self.block_size
        pages = -(-(tokens + lookahead) // bs)
        if not self.windows:
            return pages
        steps = self.full * pages + sum(m * np.minimum(pages, -(-(w - 1 + lookahead) // bs) + 1)
                                        for w, m in self.windows)
        return np.maximum(steps, self.span * -(-tokens // bs))


def _kv_bytes(config: SimConfig, cost_model: CostModel, speculative: bool) -> KVBytes:
    """The run's KV bytes per token from its profile's memory figures (the target's, the draft's when a draft
    proposer speculates)."""
    mem = cost_model.memory
    if mem is None:
        raise UserError(f"--profile {cost_model.path}: has no memory figures to derive the KV cache from; "
                        "give --num-gpu-blocks")
    kv = KVBytes.of(mem, speculative and config.speculative.proposer == "draft")
    if not (math.isfinite(kv.per_token) and kv.per_token > 0):
        raise UserError(f"--profile {cost_model.path}: memory: KV bytes per token must be > 0 to derive the KV "
                        f"cache (got {kv.per_token:g}); fix the profile's memory figures or give --num-gpu-blocks")
    return kv


def _unit(kv: KVBytes, where: str) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """(bytes per token of one block unit, full-attention units, (window, units) each) of sliding-window KV."""
    parts = [kv.per_token - sum(size for _, size in kv.sliding)] + [size for _, size in kv.sliding]
    if any(p != int(p) for p in parts):
        raise UserError(f"--profile {where}: memory: a sliding-window model's KV bytes per token must be whole "
                        f"numbers (got {', '.join(f'{p:g}' for p in parts)})")
    unit = math.gcd(*(int(p) for p in parts))
    return unit, int(parts[0]) // unit, tuple((w, int(size) // unit) for w, size in kv.sliding)


def kv_layout(config: SimConfig, cost_model: CostModel, speculative: bool) -> KVLayout | None:
    """How a request's blocks follow its tokens (module docstring); None: no sliding-window layers in what the run
    caches (the engine's fast path)."""
    mem = cost_model.memory
    if mem is None or not (mem.target_sliding_kv_bytes_per_token or mem.draft_sliding_kv_bytes_per_token):
        return None
    kv = _kv_bytes(config, cost_model, speculative)
    if not kv.sliding:
        return None
    _, full, windows = _unit(kv, cost_model.path)
    return KVLayout(config.engine.block_size, full, windows)


def num_gpu_blocks(config: SimConfig, cost_model: CostModel, speculative: bool) -> int:
    """KV-cache blocks for ``config``: its ``num_gpu_blocks`` if set, else derived from the memory budget (a block
    of a sliding-window model is ``block_size`` tokens of the unit of :func:`kv_layout`)."""
    if config.engine.num_gpu_blocks is not None:
        return config.engine.num_gpu_blocks
    mem = cost_model.memory
    kv = _kv_bytes(config, cost_model, speculative)
    kv_bytes = _unit(kv, cost_model.path)[0] if kv.sliding else kv.per_token
    device_gb = config.engine.gpu_memory_gb if config.engine.gpu_memory_gb is not None else mem.device_memory_gb
    with_draft = speculative and config.speculative.proposer == "draft"
    weights_gb = mem.target_weight_gb + (mem.draft_weight_gb if with_draft else 0.0)
    free_gb = device_gb * config.engine.gpu_memory_utilization - weights_gb - config.engine.activation_reserve_gb
    blocks = free_gb * GIB // (config.engine.block_size * kv_bytes)
    if not math.isfinite(blocks) or blocks > MAX_BLOCKS:
        raise UserError(f"--profile {cost_model.path}: memory: {device_gb:g} GiB of device memory for "
                        f"{kv_bytes:g} KV bytes per token gives {blocks:g} KV blocks, more than {MAX_BLOCKS:g}; "
                        "check the memory figures or give --num-gpu-blocks")
    blocks = int(blocks)
    if blocks <= 0:
        raise UserError(f"config: no memory left for the KV cache: {device_gb:g} GiB x "
                        f"{config.engine.gpu_memory_utilization:g} - {weights_gb:.2f} GiB weights - "
                        f"{config.engine.activation_reserve_gb:g} GiB reserve = {free_gb:.2f} GiB")
    return blocks
