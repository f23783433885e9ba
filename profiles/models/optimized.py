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

**Token trees and heads**: a pass may carry :class:`TreeInputs` (each new token's rotary position, its depth
past the prefix, and the cache positions it attends to: its sequence's prefix and its tree ancestors; tree attention)
instead of consecutive positions under a causal mask, feed input embeddings instead of token ids (an EAGLE head's
fused input), and return hidden states instead of logits (the features a head drafts from); the new tokens are still
written at ``length .. length + q - 1``, and :meth:`profiles.serving.kv.SlotBatch.keep` moves an accepted path's
keys and values next to the prefix.

**CUDA graphs** (:class:`GraphedForward`): on a CUDA device each shape is captured once
(``torch.cuda.CUDAGraph``, all graphs in one memory pool) and replayed with its static inputs refreshed in
place: a decode shape ``(slot range, q, W, K)``, a prefill shape ``(B, P, K)`` (the engine pads a prompt to a
multiple of :data:`WIDTH_ALIGN`; without a graph, a short prefill of a 7B model costs ~6x its work in kernel
launches, as the first H200 profile showed). Capture seconds are counted apart
(:attr:`GraphedForward.capture_seconds`), since a deployed engine captures at start-up. On a CPU the same
function runs eagerly: the tests cover the numerics there.

**Fused work** (:func:`fuse_projections`): q, k and v are one matrix product, gate and up another, rotary runs
on q and k at once, RMSNorm is ``torch.nn.functional.rms_norm``: fewer, larger kernels, as in deployed
engines (a decode pass of a 7B model at batch 1 is otherwise dominated by ~1,400 small kernels).

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


def last_columns(batch_size: int, query_len: int, kept: int, device: torch.device) -> torch.Tensor:
    """The ``keep`` argument of :func:`slot_pass` that keeps the last ``kept`` of ``query_len`` columns of every
    row (``(batch_size, kept)``; ``kept = query_len``: all of them, a verification)."""
    return torch.arange(query_len - kept, query_len, device=device).expand(batch_size, -1).contiguous()


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


@dataclass(frozen=True)
class _Fused:
    """One layer's projections as two matrices: ``qkv`` (rows: q, k, v heads) and ``gate_up`` (rows: gate, up)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor


@torch.inference_mode()
def fuse_projections(model: PreTrainedModel) -> list[_Fused]:
    """Each layer's q, k, v projections as one matrix and gate, up as another (speed: 4 matrix products a
    layer instead of 7, as deployed engines do). The modules' own weights become views into the fused ones, so
    nothing is held twice and the eager path keeps working. Done once per model."""
    fused = getattr(model, "_specsim_fused", None)
    if fused is not None:
        return fused
    if getattr(model.config, "hidden_act", "silu") != "silu":
        raise ValueError(f"optimized forward: SwiGLU with silu only (config says {model.config.hidden_act!r})")
    if hasattr(model.model.layers[0].self_attn, "q_norm"):
        raise ValueError("optimized forward: per-head q/k norms (qwen3) are not run here; use the eager forward")
    fused = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv = torch.cat([m.weight for m in projections])
        bias = torch.cat([m.bias for m in projections]) if attn.q_proj.bias is not None else None
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        at = 0
        for m in projections:
            n = m.weight.shape[0]
            m.weight = torch.nn.Parameter(qkv[at:at + n], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[at:at + n], requires_grad=False)
            at += n
        n = mlp.gate_proj.weight.shape[0]
        mlp.gate_proj.weight = torch.nn.Parameter(gate_up[:n], requires_grad=False)
        mlp.up_proj.weight = torch.nn.Parameter(gate_up[n:], requires_grad=False)
        fused.append(_Fused(qkv, bias, gate_up))
    model._specsim_fused = fused
    return fused


@torch.inference_mode()
def slot_pass(model: PreTrainedModel, cache: SlotCache, lo: int | torch.Tensor, ids: torch.Tensor,
              keep: torch.Tensor, width: int, fresh: bool = False, tree: TreeInputs | None = None,
              embeds: torch.Tensor | None = None, hidden: bool = False) -> torch.Tensor:
    """One forward pass of ``ids`` (``(B, q)``, right-padded) after the cached tokens of slots
    ``lo .. lo + B - 1``, writing their keys and values in place; the logits of columns ``keep`` (``(B, K)``
    column indices per row) as ``(B, K, vocab)``. Lengths are not advanced: the caller does (by each row's real
    token count). Allocates only activations: on CUDA it is what :class:`GraphedForward` captures.

    ``fresh``: a prefill: the slots hold no tokens yet (positions start at 0) and attention runs over the new
    keys alone with a causal flag instead of a mask (the fused kernels' fast case); right-padding is harmless
    there (a causal token never sees a later pad). ``lo`` may then be a device tensor of the ``B`` slot indices,
    so that one captured graph serves every slot.

    ``tree`` (a token tree's pass, not with ``fresh``): the new tokens' rotary positions and which of the ``W``
    positions each attends to (:class:`TreeInputs`) instead of consecutive positions under a causal mask; they are
    still written at ``length .. length + q - 1``. ``embeds`` ``(B, q, hidden)``: input embeddings instead of
    ``ids``' (an EAGLE head's fused input). ``hidden``: return the final-normed hidden states of columns ``keep``
    ``(B, K, hidden)`` instead of their logits.
    """
    inner = model.model
    batch, q = ids.shape
    heads, kv_heads, head_dim = model.config.num_attention_heads, cache.kv_heads, cache.head_dim
    group = heads // kv_heads
    eps = inner.norm.variance_epsilon
    hidden_size = model.config.hidden_size
    fused = fuse_projections(model)
    steps = torch.arange(q, device=ids.device)
    positions = steps.expand(batch, q) if fresh else cache.lengths[lo:lo + batch, None] + steps  # (B, q)
    states = inner.embed_tokens(ids) if embeds is None else embeds            # (B, q, hidden)
    cos, sin = inner.rotary_emb(states, positions if tree is None else tree.positions)  # (B, q, head_dim) each
    cos, sin = cos[:, :, None], sin[:, :, None]                               # (B, q, 1, head_dim)
    mask = None
    if not fresh:
        # mask[b, 0, g * q + i, w]: query i of row b sees cache position w (its own past and itself, or what the
        # tree says), for each of the G query heads stacked on a KV head.
        mask = torch.arange(width, device=ids.device) <= positions[..., None] if tree is None \
            else tree.visible                                                  # (B, q, W)
        mask = mask[:, None].repeat(1, 1, group, 1)                            # (B, 1, G*q, W)
        write_at = positions[:, None, :, None].expand(batch, kv_heads, q, head_dim)
    for layer_index, (layer, weights) in enumerate(zip(inner.layers, fused)):
        attn = layer.self_attn
        x = F.rms_norm(states, (hidden_size,), layer.input_layernorm.weight, eps)
        qkv = F.linear(x, weights.qkv, weights.qkv_bias).view(batch, q, heads + 2 * kv_heads, head_dim)
        qk = qkv[:, :, :heads + kv_heads]                                     # (B, q, H + KVH, D)
        qk = qk * cos + _rotate_half(qk) * sin                                # rotary on q and k at once
        qs = qk[:, :, :heads].transpose(1, 2)                                 # (B, H, q, D)
        ks = qk[:, :, heads:].transpose(1, 2)                                 # (B, KVH, q, D)
        vs = qkv[:, :, heads + kv_heads:].transpose(1, 2)                     # (B, KVH, q, D)
        keys, values = cache.keys[layer_index], cache.values[layer_index]
        if fresh:
            if isinstance(lo, torch.Tensor):
                keys[:, :, :q].index_copy_(0, lo, ks)
                values[:, :, :q].index_copy_(0, lo, vs)
            else:
                keys[lo:lo + batch, :, :q] = ks
                values[lo:lo + batch, :, :q] = vs
            ks, vs = (t.repeat_interleave(group, dim=1) for t in (ks, vs))    # (B, H, q, D)
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=attn.scaling)  # (B, H, q, D)
        else:
            keys, values = keys[lo:lo + batch], values[lo:lo + batch]
            keys.scatter_(2, write_at, ks)
            values.scatter_(2, write_at, vs)
            stacked = qs.reshape(batch, kv_heads, group * q, head_dim)        # (B, KVH, G*q, D)
            out = F.scaled_dot_product_attention(stacked, keys[:, :, :width], values[:, :, :width],
                                                 attn_mask=mask, scale=attn.scaling)  # (B, KVH, G*q, D)
        out = out.reshape(batch, heads, q, head_dim).transpose(1, 2).reshape(batch, q, heads * head_dim)
        states = states + attn.o_proj(out)
        x = F.rms_norm(states, (hidden_size,), layer.post_attention_layernorm.weight, eps)
        gate, up = F.linear(x, weights.gate_up).chunk(2, dim=-1)
        states = states + layer.mlp.down_proj(F.silu(gate) * up)
    states = F.rms_norm(states, (hidden_size,), inner.norm.weight, eps)
    kept = states.gather(1, keep[..., None].expand(-1, -1, states.shape[-1]))  # (B, K, hidden)
    return kept if hidden else model.lm_head(kept)                            # (B, K, hidden or vocab)


@dataclass(frozen=True)
class TreeInputs:
    """What a token tree's pass adds to :func:`slot_pass` (tree attention, as SpecInfer, Miao et al., ASPLOS 2024,
    and vLLM's tree attention backend compute it): a node attends to its sequence's cache and its own ancestors
    only, at the rotary position of its depth."""

    positions: torch.Tensor
    """Rotary position of each new token, int64 ``(B, q)``."""
    visible: torch.Tensor
    """Which cache positions each new token attends to (its own write position included), bool ``(B, q, W)``."""


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    ids: torch.Tensor
    keep: torch.Tensor
    slots: torch.Tensor | None
    tree: TreeInputs | None
    embeds: torch.Tensor | None
    out: torch.Tensor


class GraphedForward:
    """:func:`slot_pass` over one model and cache, replaying a CUDA graph per shape on CUDA (see the module
    docstring); eager on a CPU, or with ``use_graphs=False``.

    Decode shapes are keyed by ``(lo, B, q, W, K)``; a prefill (``fresh``) by ``(B, q, K)`` with its slots a
    graph input, so one graph serves every slot; both also by whether the pass is a tree's, feeds embeddings and
    returns hidden states (a tree's positions and mask, and the embeddings, are graph inputs too). All graphs share
    one memory pool: a graph's output may lie in memory another graph uses as scratch, so read a pass's output
    before running the next pass (of any shape).
    """

    def __init__(self, model: PreTrainedModel, cache: SlotCache, use_graphs: bool | None = None) -> None:
        self.model, self.cache = model, cache
        fuse_projections(model)
        self.use_graphs = model.device.type == "cuda" if use_graphs is None else use_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.capture_seconds = 0.0
        """Wall seconds spent capturing graphs (start-up work in a deployed engine)."""
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def __call__(self, lo: int, ids: torch.Tensor, keep: torch.Tensor, width: int, fresh: bool = False,
                 tree: TreeInputs | None = None, embeds: torch.Tensor | None = None,
                 hidden: bool = False) -> torch.Tensor:
        """As :func:`slot_pass` over slots ``lo .. lo + B - 1``."""
        if not self.use_graphs:
            return slot_pass(self.model, self.cache, lo, ids, keep, width, fresh, tree, embeds, hidden)
        batch, q = ids.shape
        slots = torch.arange(lo, lo + batch, device=ids.device) if fresh else None
        mode = (tree is not None, embeds is not None, hidden)
        key = ("prefill", batch, q, keep.shape[1], mode) if fresh else \
            ("decode", lo, batch, q, width, keep.shape[1], mode)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(lo, ids, keep, width, slots, tree, embeds, hidden)
        entry.ids.copy_(ids)
        entry.keep.copy_(keep)
        if slots is not None:
            entry.slots.copy_(slots)
        if tree is not None:
            entry.tree.positions.copy_(tree.positions)
            entry.tree.visible.copy_(tree.visible)
        if embeds is not None:
            entry.embeds.copy_(embeds)
        entry.graph.replay()
        return entry.out

    def _capture(self, lo: int, ids: torch.Tensor, keep: torch.Tensor, width: int, slots: torch.Tensor | None,
                 tree: TreeInputs | None, embeds: torch.Tensor | None, hidden: bool) -> _Graph:
        """Capture one shape: warm-up passes on a side stream, then the capture. The passes write keys and
        values only at or past each row's length (or into the prefill's own slots), which later passes
        overwrite, and leave the lengths alone."""
        t0 = time.perf_counter()
        static = _Graph(None, ids.clone(), keep.clone(), None if slots is None else slots.clone(),
                        None if tree is None else TreeInputs(tree.positions.clone(), tree.visible.clone()),
                        None if embeds is None else embeds.clone(), None)
        rows = lo if static.slots is None else static.slots
        fresh = static.slots is not None

        def run() -> torch.Tensor:
            return slot_pass(self.model, self.cache, rows, static.ids, static.keep, width, fresh, static.tree,
                             static.embeds, hidden)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        static.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(static.graph, pool=self._pool):
            static.out = run()
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        return static

    def clear(self) -> None:
        """Drop every captured graph (their memory returns to the pool)."""
        self.graphs.clear()
