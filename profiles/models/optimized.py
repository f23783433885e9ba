"""The optimized forward path: a preallocated KV cache written in place, attention over the live part of each
sequence's cache only, and (on CUDA) each decode shape captured once as a CUDA graph and replayed.

This is the path that resembles the engines people deploy (vLLM, SGLang, TensorRT-LLM; gpt-fast shows the
idea in a page). :mod:`profiles.models.forward` keeps the eager Hugging Face path beside it; the profiler and
the real engine choose one with ``--forward eager|optimized`` (:data:`FORWARDS`), in one place each.

**The cache** (:class:`SlotCache`): per layer one keys and one values tensor of shape
``(num_slots, kv_heads, max_len, head_dim)``, allocated once; a sequence owns a *slot* (a row) and its tokens
sit at positions ``0 .. length - 1`` of it. A pass over ``q`` new tokens per sequence writes their keys and
values in place at ``length .. length + q - 1`` (``scatter_``, no concatenation, no copy of the cache); rolling
tokens back is lowering the slot's length. A pass always runs over a contiguous range of slots, so the batch
is a view, never a gather.

**Attention** reads ``width`` positions of each slot: the longest live length plus ``q``, rounded up to
:data:`WIDTH_ALIGN` (one captured graph serves a band of lengths), so the bytes read follow the live context,
not the cache's capacity. Positions past a sequence's own length are masked out. Grouped-query attention is
computed without repeating the cache: the ``G = heads / kv_heads`` query heads of a KV head are stacked as
``G x q`` query rows of one KV head (a bool mask repeated ``G`` times), so each KV head is read once.

**Shapes.** ``B`` sequences (slots), ``q`` new tokens each (right-padded: row ``i`` has ``n_i <= q`` real
tokens at columns ``0 .. n_i - 1``; pad columns write past the row's length and are never read, since a row's
length advances by ``n_i`` only), ``W`` cache positions read, ``K`` logit columns kept per row.

**CUDA graphs** (:class:`GraphedForward`): on a CUDA device each decode shape ``(slot range, q, W, K)`` is
captured once (``torch.cuda.CUDAGraph``, all graphs in one memory pool) and replayed with its static inputs
refreshed in place; prefill runs eagerly (as vLLM's does: it is compute-bound, its launch overhead small).
Capture seconds are counted apart (:attr:`GraphedForward.capture_seconds`), since a deployed engine captures
at start-up. On a CPU the same function runs eagerly: the tests cover the numerics there.

Supported architectures: those of :data:`profiles.models.config.SUPPORTED_MODEL_TYPES` (Llama, Qwen2: RMSNorm,
rotary attention with grouped KV heads, SwiGLU MLP), run through the Hugging Face modules' own weights.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

#: The forward paths a profile or the real engine can run.
FORWARDS = ("eager", "optimized")
#: Cache positions an attention pass reads are rounded up to a multiple of this (tokens).
WIDTH_ALIGN = 64


def attention_width(longest: int, query_len: int, capacity: int) -> int:
    """Cache positions a pass reads: ``longest + query_len`` rounded up to :data:`WIDTH_ALIGN`, at most
    ``capacity``."""
    return min(capacity, math.ceil((longest + query_len) / WIDTH_ALIGN) * WIDTH_ALIGN)


class SlotCache:
    """A preallocated KV cache of ``num_slots`` sequences of up to ``max_len`` tokens each (see the module
    docstring). ``lengths`` (int64, ``(num_slots,)``, on the model's device) holds each slot's live tokens."""

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int) -> None:
        config = model.config
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_slots = num_slots
        self.max_len = math.ceil(max_len / WIDTH_ALIGN) * WIDTH_ALIGN
        shape = (num_slots, self.kv_heads, self.max_len, self.head_dim)  # (slots, kv_heads, positions, head_dim)
        device, dtype = model.device, model.dtype
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)

    def nbytes(self) -> int:
        """Bytes the cache holds (keys and values of every layer)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @torch.inference_mode()
    def fill_random(self, lo: int, hi: int, length: int, generator: torch.Generator) -> None:
        """Slots ``lo .. hi - 1`` hold ``length`` tokens of standard-normal keys and values (the profiler's
        stand-in for a long prefill: attention reads the same bytes either way)."""
        for tensor in self.keys + self.values:
            view = tensor[lo:hi, :, :length]
            view.copy_(torch.randn(view.shape, generator=generator, dtype=view.dtype, device=view.device))
        self.lengths[lo:hi] = length

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s live tokens into slot ``dst`` (compacting the running batch)."""
        n = int(self.lengths[src])
        for tensor in self.keys + self.values:
            tensor[dst, :, :n] = tensor[src, :, :n]
        self.lengths[dst] = n


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def slot_pass(model: PreTrainedModel, cache: SlotCache, lo: int, ids: torch.Tensor, keep: torch.Tensor,
              width: int, fresh: bool = False) -> torch.Tensor:
    """One forward pass of ``ids`` (``(B, q)``, right-padded) after the cached tokens of slots
    ``lo .. lo + B - 1``, writing their keys and values in place; the logits of columns ``keep`` (``(B, K)``
    column indices per row) as ``(B, K, vocab)``. Lengths are not advanced: the caller does (by each row's real
    token count). Allocates only activations: on CUDA it is what :class:`GraphedForward` captures.

    ``fresh``: the slots hold no tokens yet and every row's ``q`` tokens are real (a prefill): attention then
    runs over the new keys alone with a causal flag instead of a mask (the fused kernels' fast case)."""
    inner = model.model
    batch, q = ids.shape
    hi = lo + batch
    heads, kv_heads, head_dim = model.config.num_attention_heads, cache.kv_heads, cache.head_dim
    group = heads // kv_heads
    start = cache.lengths[lo:hi]                                              # (B,)
    positions = start[:, None] + torch.arange(q, device=ids.device)          # (B, q)
    hidden = inner.embed_tokens(ids)                                          # (B, q, hidden)
    cos, sin = inner.rotary_emb(hidden, positions)                            # (B, q, head_dim) each
    cos, sin = cos[:, None], sin[:, None]                                     # (B, 1, q, head_dim)
    # mask[b, 0, g * q + i, w]: query i of row b sees cache position w (its own past and itself), for each
    # of the G query heads stacked on a KV head.
    mask = None
    if not fresh:
        mask = torch.arange(width, device=ids.device) <= positions[..., None]  # (B, q, W)
        mask = mask[:, None].repeat(1, 1, group, 1)                            # (B, 1, G*q, W)
    write_at = positions[:, None, :, None].expand(batch, kv_heads, q, head_dim)
    for layer_index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        qs = attn.q_proj(x).view(batch, q, heads, head_dim).transpose(1, 2)   # (B, H, q, D)
        ks = attn.k_proj(x).view(batch, q, kv_heads, head_dim).transpose(1, 2)  # (B, KVH, q, D)
        vs = attn.v_proj(x).view(batch, q, kv_heads, head_dim).transpose(1, 2)
        qs = qs * cos + _rotate_half(qs) * sin
        ks = ks * cos + _rotate_half(ks) * sin
        keys, values = cache.keys[layer_index][lo:hi], cache.values[layer_index][lo:hi]
        keys.scatter_(2, write_at, ks)
        values.scatter_(2, write_at, vs)
        if fresh:
            ks, vs = (t.repeat_interleave(group, dim=1) for t in (ks, vs))    # (B, H, q, D)
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=attn.scaling)  # (B, H, q, D)
        else:
            stacked = qs.reshape(batch, kv_heads, group * q, head_dim)        # (B, KVH, G*q, D)
            out = F.scaled_dot_product_attention(stacked, keys[:, :, :width], values[:, :, :width],
                                                 attn_mask=mask, scale=attn.scaling)  # (B, KVH, G*q, D)
        out = out.reshape(batch, heads, q, head_dim).transpose(1, 2).reshape(batch, q, heads * head_dim)
        hidden = hidden + attn.o_proj(out)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = inner.norm(hidden)
    kept = hidden.gather(1, keep[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, K, hidden)
    return model.lm_head(kept)                                                # (B, K, vocab)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    ids: torch.Tensor
    keep: torch.Tensor
    logits: torch.Tensor


class GraphedForward:
    """:func:`slot_pass` over one model and cache, replaying a CUDA graph per decode shape on CUDA (see the
    module docstring); eager on a CPU, or with ``use_graphs=False``. Passes with ``q > max_graph_query``
    (prefills) always run eagerly."""

    def __init__(self, model: PreTrainedModel, cache: SlotCache, use_graphs: bool | None = None,
                 max_graph_query: int = 16) -> None:
        self.model, self.cache = model, cache
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        self.max_graph_query = max_graph_query
        self.graphs: dict[tuple[int, int, int, int, int], _Graph] = {}
        self.capture_seconds = 0.0
        """Wall seconds spent capturing graphs (start-up work in a deployed engine)."""
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def __call__(self, lo: int, ids: torch.Tensor, keep: torch.Tensor, width: int, fresh: bool = False) -> torch.Tensor:
        """As :func:`slot_pass`. The returned logits of a replayed graph are its static output: read them
        before the next pass of the same shape."""
        batch, q = ids.shape
        if fresh or not self.use_graphs or q > self.max_graph_query:
            return slot_pass(self.model, self.cache, lo, ids, keep, width, fresh)
        key = (lo, batch, q, width, keep.shape[1])
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(lo, ids, keep, width)
        entry.ids.copy_(ids)
        entry.keep.copy_(keep)
        entry.graph.replay()
        return entry.logits

    def _capture(self, lo: int, ids: torch.Tensor, keep: torch.Tensor, width: int) -> _Graph:
        """Capture one shape: warm-up passes on a side stream, then the capture; the cache's lengths are
        restored and the rows' cache contents left as they were read (the passes write only at positions at
        or past each row's length, which later passes overwrite)."""
        t0 = time.perf_counter()
        static_ids, static_keep = ids.clone(), keep.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                slot_pass(self.model, self.cache, lo, static_ids, static_keep, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = slot_pass(self.model, self.cache, lo, static_ids, static_keep, width)
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        return _Graph(graph, static_ids, static_keep, logits)

    def clear(self) -> None:
        """Drop every captured graph (their memory returns to the pool)."""
        self.graphs.clear()
