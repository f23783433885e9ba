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

**Fused work** (:func:`plan`): q, k and v are one matrix product, gate and up another, rotary runs
on q and k at once, RMSNorm is ``torch.nn.functional.rms_norm``: fewer, larger kernels, as in deployed
engines (a decode pass of a 7B model at batch 1 is otherwise dominated by ~1,400 small kernels).

**Families** (:mod:`profiles.models.families`), run through the Hugging Face modules' own weights: every family
the torch side builds takes this path. Llama and Qwen2 as above; Qwen3's q/k norms (an RMSNorm over each head's q
and k before rotary); Gemma-2's norms after attention and MLP too (weights ``1 + w``), its GeGLU MLP (the module's own
activation), its attention-logit soft-capping (``c tanh(s / c)`` on the scaled scores: attention computed as two
matrix products and a float32 softmax, since SDPA cannot cap; the stacked-query form still reads each KV head once)
and final-logit soft-capping (:func:`profiles.models.forward.logits`); MoE layers (Mixtral, Qwen3-MoE) run their
transformers MoE block as it is (router, top-k, the experts through transformers' ``grouped_mm``: only the woken
experts' weights are read; :mod:`profiles.models.families`), so that both paths time the same expert kernels.

**Sliding-window layers keep only their window** (Gemma-2's local layers): such a layer's cache row is a ring of
``R`` positions, ``R`` = the window plus :data:`WIDTH_ALIGN` rounded up to a multiple of it (or the cache's
``max_len`` if smaller): token position ``p`` sits at ``p mod R``, and attention reads ``min(W, R)`` positions
whatever the context. A slot of the ring holds the latest position written there; the mask shows a query the
positions that are its own or earlier, and later than its position minus the window. ``R - window`` positions of
slack let a pass of up to ``R - window + 1`` tokens write, and be rolled back, without overwriting a position that
a later query of the sequence may still see; a prefill's right padding (under :data:`WIDTH_ALIGN` tokens) likewise.
Rolling back is lowering the length, as for every layer; a token tree's accepted path moves within the ring
(:meth:`SlotCache.move_tokens`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from profiles.models.families import family
from profiles.models.forward import logits as final_logits, sliding_window

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
    docstring). ``lengths`` (int64, ``(num_slots,)``, on the model's device) holds each slot's live tokens; layer
    ``i`` holds ``spans[i]`` positions per slot (``max_len``, or a sliding-window layer's ring of :attr:`ring`)."""

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int) -> None:
        config = model.config
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_slots = num_slots
        self.max_len = math.ceil(max_len / WIDTH_ALIGN) * WIDTH_ALIGN
        self.window = sliding_window(config)
        """Tokens a sliding-window layer's query sees (itself included); None: no such layer."""
        self.ring = self.max_len if self.window is None else \
            min(self.max_len, math.ceil((self.window + WIDTH_ALIGN) / WIDTH_ALIGN) * WIDTH_ALIGN)
        """Positions a sliding-window layer holds per slot (module docstring)."""
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.spans = [self.ring if t == "sliding_attention" else self.max_len for t in types]
        device, dtype = model.device, model.dtype
        # (slots, kv_heads, positions, head_dim) per layer
        self.keys = [torch.zeros(num_slots, self.kv_heads, n, self.head_dim, dtype=dtype, device=device)
                     for n in self.spans]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)

    def nbytes(self) -> int:
        """Bytes the cache holds (keys and values of every layer)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def _tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every layer's keys and values tensor with its span."""
        return [(t, n) for k, v, n in zip(self.keys, self.values, self.spans) for t in (k, v)]

    @torch.inference_mode()
    def fill_random(self, lo: int, hi: int, length: int, generator: torch.Generator) -> None:
        """Slots ``lo .. hi - 1`` hold ``length`` tokens of standard-normal keys and values (the profiler's
        stand-in for a long prefill: attention reads the same bytes either way)."""
        for tensor, span in self._tensors():
            view = tensor[lo:hi, :, :min(length, span)]
            view.copy_(torch.randn(view.shape, generator=generator, dtype=view.dtype, device=view.device))
        self.lengths[lo:hi] = length

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s live tokens into slot ``dst`` (compacting the running batch)."""
        n = int(self.lengths[src])
        for tensor, span in self._tensors():
            tensor[dst, :, :min(n, span)] = tensor[src, :, :min(n, span)]
        self.lengths[dst] = n

    @torch.inference_mode()
    def move_tokens(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Token position ``src[i]`` of slot ``rows[i]`` to its position ``dst[i]``, for every i at once (a token
        tree's accepted path moving next to the prefix; the sources are read before any is overwritten)."""
        for tensor, span in self._tensors():
            tensor[rows, :, dst % span] = tensor[rows, :, src % span]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer as :func:`slot_pass` runs it: q, k, v projections as one matrix (rows: q, k, v heads) and,
    in a dense layer, gate and up as another; the RMSNorm weights as ``F.rms_norm`` takes them."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor | None
    """None: a mixture-of-experts layer, whose transformers block runs as it is."""
    attention_norm: torch.Tensor
    mlp_norm: torch.Tensor
    attention_out_norm: torch.Tensor | None
    """Gemma-2's norm of the attention's output (and :attr:`mlp_out_norm` of the MLP's); None elsewhere."""
    mlp_out_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    """Qwen3's RMSNorm weights over each head's q (and :attr:`k_norm`, k); None elsewhere."""
    k_norm: torch.Tensor | None
    sliding: bool
    """A sliding-window layer (its cache row is a ring)."""


@dataclass(frozen=True)
class _Plan:
    """A model as :func:`slot_pass` runs it."""

    layers: list[_Layer]
    final_norm: torch.Tensor
    eps: float
    scaling: float
    """Attention scores' scale (1 / sqrt(head_dim), or Gemma-2's ``query_pre_attn_scalar ** -0.5``)."""
    softcap: float | None
    """Gemma-2's attention-logit soft-cap; None elsewhere."""
    act: Callable[[torch.Tensor], torch.Tensor]
    """The dense MLP's activation (SiLU; Gemma-2's tanh GELU)."""


def _norm(module: torch.nn.Module | None, offset: float) -> torch.Tensor | None:
    """An RMSNorm's weight as ``F.rms_norm`` scales by it: the module's, plus ``offset`` (Gemma-2 scales by
    ``1 + weight``)."""
    return None if module is None else module.weight + offset if offset else module.weight


@torch.inference_mode()
def plan(model: PreTrainedModel) -> _Plan:
    """``model`` as :func:`slot_pass` runs it, made once per model: each layer's q, k, v projections as one matrix and
    a dense MLP's gate, up as another (speed: 4 matrix products a layer instead of 7, as deployed engines do; the
    modules' own weights become views into the fused ones, so nothing is held twice and the eager path keeps
    working), and the norms' weights (module docstring)."""
    done = getattr(model, "_specsim_plan", None)
    if done is not None:
        return done
    offset = 1.0 if family(model.config.model_type).unit_offset_norm else 0.0
    layers, act = [], None
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv = torch.cat([m.weight for m in projections])
        bias = torch.cat([m.bias for m in projections]) if attn.q_proj.bias is not None else None
        at = 0
        for m in projections:
            n = m.weight.shape[0]
            m.weight = torch.nn.Parameter(qkv[at:at + n], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[at:at + n], requires_grad=False)
            at += n
        gate_up = None
        if hasattr(mlp, "gate_proj"):  # a dense MLP; else a MoE block
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            n = mlp.gate_proj.weight.shape[0]
            mlp.gate_proj.weight = torch.nn.Parameter(gate_up[:n], requires_grad=False)
            mlp.up_proj.weight = torch.nn.Parameter(gate_up[n:], requires_grad=False)
            act = mlp.act_fn
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma-2: norms before and after each block
        layers.append(_Layer(
            qkv, bias, gate_up, _norm(layer.input_layernorm, offset),
            _norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm, offset),
            _norm(layer.post_attention_layernorm, offset) if sandwich else None,
            _norm(layer.post_feedforward_layernorm, offset) if sandwich else None,
            _norm(getattr(attn, "q_norm", None), offset), _norm(getattr(attn, "k_norm", None), offset),
            getattr(attn, "sliding_window", None) is not None))
    attention = model.model.layers[0].self_attn
    done = _Plan(layers, _norm(model.model.norm, offset), model.config.rms_norm_eps, attention.scaling,
                 getattr(attention, "attn_logit_softcapping", None), act or F.silu)
    model._specsim_plan = done
    return done


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            scaling: float, softcap: float | None, causal: bool = False) -> torch.Tensor:
    """Attention of ``queries`` ``(B, heads, rows, D)`` over ``keys``, ``values`` ``(B, heads, W, D)`` where ``mask``
    (bool, broadcast to ``(B, heads, rows, W)``) says, or causal: SDPA; with a soft-cap ``c``, the scaled scores
    capped ``c tanh(s / c)`` before a float32 softmax (transformers' eager attention for Gemma-2)."""
    if softcap is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=causal, scale=scaling)
    scores = torch.tanh(torch.matmul(queries, keys.transpose(-1, -2)) * (scaling / softcap)) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype), values)


def _ring_mask(cache: SlotCache, lengths: torch.Tensor, q: int, width: int, queries: torch.Tensor,
               tree: TreeInputs | None) -> torch.Tensor:
    """Which of the ``min(width, ring)`` ring positions each new token of a pass sees in a sliding-window layer, bool
    ``(B, q, min(width, ring))``: the ring slot's latest position written (this pass's tokens at ``lengths ..
    lengths + q - 1`` included) if it is visible to the token (causal, or the tree's ancestors) and within the window
    of the token's rotary position ``queries`` ``(B, q)``."""
    ring = cache.ring
    read = min(width, ring)
    top = (lengths + q - 1)[:, None]                                          # (B, 1) the last index written
    held = top - (top - torch.arange(read, device=lengths.device)) % ring     # (B, R) index each ring slot holds
    written = held >= 0
    if tree is None:
        seen, key_positions = held[:, None, :] <= queries[..., None], held   # (B, q, R), (B, R)
    else:
        seen = tree.visible.gather(2, held.clamp(min=0)[:, None, :].expand(-1, q, -1))
        fed = (held - lengths[:, None]).clamp(0, q - 1)                      # this pass's tokens: their tree position
        key_positions = torch.where(held < lengths[:, None], held, tree.positions.gather(1, fed))
    near = key_positions[:, None, :] > queries[..., None] - cache.window
    return seen & near & written[:, None, :]


@torch.inference_mode()
def slot_pass(model: PreTrainedModel, cache: SlotCache, lo: int | torch.Tensor, ids: torch.Tensor,
              keep: torch.Tensor, width: int, fresh: bool = False, tree: TreeInputs | None = None,
              embeds: torch.Tensor | None = None, hidden: bool = False) -> torch.Tensor:
    """One forward pass of ``ids`` (``(B, q)``, right-padded) after the cached tokens of slots
    ``lo .. lo + B - 1``, writing their keys and values in place; the logits of columns ``keep`` (``(B, K)``
    column indices per row) as ``(B, K, vocab)``. Lengths are not advanced: the caller does (by each row's real
    token count). Allocates only activations: on CUDA it is what :class:`GraphedForward` captures.

    ``fresh``: a prefill: the slots hold no tokens yet (positions start at 0) and attention runs over the new
    keys alone with a causal flag instead of a mask (the fused kernels' fast case; a mask where the family needs
    one: soft-capping, a window shorter than the prompt); right-padding is harmless there (a causal token never sees
    a later pad). ``lo`` may then be a device tensor of the ``B`` slot indices, so that one captured graph serves
    every slot.

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
    hidden_size = model.config.hidden_size
    steps = plan(model)
    norm = (lambda x, weight, size=hidden_size: F.rms_norm(x, (size,), weight, steps.eps))  # noqa: E731
    wraps = cache.window is not None and cache.ring < cache.max_len
    if wraps and not fresh and q > cache.ring - cache.window + 1:
        raise ValueError(f"optimized forward: a pass of {q} tokens per sequence exceeds the sliding-window ring's "
                         f"slack ({cache.ring - cache.window + 1})")
    index = torch.arange(q, device=ids.device)
    lengths = None if fresh else cache.lengths[lo:lo + batch]
    positions = index.expand(batch, q) if fresh else lengths[:, None] + index  # (B, q) write positions
    rotary = positions if tree is None else tree.positions                    # (B, q)
    states = inner.embed_tokens(ids) if embeds is None else embeds            # (B, q, hidden)
    cos, sin = inner.rotary_emb(states, rotary)                               # (B, q, head_dim) each
    cos, sin = cos[:, :, None], sin[:, :, None]                               # (B, q, 1, head_dim)
    masks = {}
    fast_prefill = fresh and steps.softcap is None  # a causal flag, no mask: but where the window is shorter
    if fresh and not (fast_prefill and (cache.window is None or q <= cache.window)):
        causal = torch.ones(q, q, dtype=torch.bool, device=ids.device).tril()  # (q, q)
        masks[False] = causal
        if cache.window is not None:
            masks[True] = causal & (index[:, None] - index < cache.window)
    elif not fresh:
        # mask[b, i, w]: query i of row b sees cache position w (its own past and itself, or what the tree says)
        masks[False] = torch.arange(width, device=ids.device) <= positions[..., None] if tree is None \
            else tree.visible                                                  # (B, q, W)
        if cache.window is not None:
            masks[True] = _ring_mask(cache, lengths, q, width, rotary, tree)  # (B, q, min(W, ring))
        write_at = positions[:, None, :, None].expand(batch, kv_heads, q, head_dim)
    # every mask as the stacked queries take it: (B or 1, 1, G*q, keys), each query row repeated for the G heads
    masks = {k: m.reshape(-1, q, m.shape[-1])[:, None].repeat(1, 1, group, 1) for k, m in masks.items()}
    for layer_index, (layer, weights) in enumerate(zip(inner.layers, steps.layers)):
        attn = layer.self_attn
        span = cache.spans[layer_index]
        x = norm(states, weights.attention_norm)
        qkv = F.linear(x, weights.qkv, weights.qkv_bias).view(batch, q, heads + 2 * kv_heads, head_dim)
        qk = qkv[:, :, :heads + kv_heads]                                     # (B, q, H + KVH, D)
        if weights.q_norm is not None:                                        # Qwen3: per-head q and k norms
            qk = torch.cat([norm(qk[:, :, :heads], weights.q_norm, head_dim),
                            norm(qk[:, :, heads:], weights.k_norm, head_dim)], dim=2)
        qk = qk * cos + _rotate_half(qk) * sin                                # rotary on q and k at once
        qs = qk[:, :, :heads].transpose(1, 2)                                 # (B, H, q, D)
        ks = qk[:, :, heads:].transpose(1, 2)                                 # (B, KVH, q, D)
        vs = qkv[:, :, heads + kv_heads:].transpose(1, 2)                     # (B, KVH, q, D)
        keys, values = cache.keys[layer_index], cache.values[layer_index]
        if fresh:
            kept = min(q, span)  # a ring keeps a prompt's last positions, each at its position mod the ring
            new_k, new_v = (torch.roll(t[:, :, q - kept:], (q - kept) % span, dims=2) for t in (ks, vs))
            if isinstance(lo, torch.Tensor):
                keys[:, :, :kept].index_copy_(0, lo, new_k)
                values[:, :, :kept].index_copy_(0, lo, new_v)
            else:
                keys[lo:lo + batch, :, :kept] = new_k
                values[lo:lo + batch, :, :kept] = new_v
            if fast_prefill and not (weights.sliding and q > cache.window):
                ks, vs = (t.repeat_interleave(group, dim=1) for t in (ks, vs))  # (B, H, q, D)
                out = _attend(qs, ks, vs, None, steps.scaling, None, causal=True)   # (B, H, q, D)
            else:
                stacked = qs.reshape(batch, kv_heads, group * q, head_dim)    # (B, KVH, G*q, D)
                out = _attend(stacked, ks, vs, masks[weights.sliding], steps.scaling, steps.softcap)
        else:
            keys, values = keys[lo:lo + batch], values[lo:lo + batch]
            at = write_at % span if weights.sliding else write_at
            keys.scatter_(2, at, ks)
            values.scatter_(2, at, vs)
            read = min(width, span)
            stacked = qs.reshape(batch, kv_heads, group * q, head_dim)        # (B, KVH, G*q, D)
            out = _attend(stacked, keys[:, :, :read], values[:, :, :read], masks[weights.sliding], steps.scaling,
                          steps.softcap)                                      # (B, KVH, G*q, D)
        out = out.reshape(batch, heads, q, head_dim).transpose(1, 2).reshape(batch, q, heads * head_dim)
        out = attn.o_proj(out)
        if weights.attention_out_norm is not None:
            out = norm(out, weights.attention_out_norm)
        states = states + out
        x = norm(states, weights.mlp_norm)
        if weights.gate_up is None:
            out = layer.mlp(x)                                                # the MoE block, as it is
        else:
            gate, up = F.linear(x, weights.gate_up).chunk(2, dim=-1)
            out = layer.mlp.down_proj(steps.act(gate) * up)
        if weights.mlp_out_norm is not None:
            out = norm(out, weights.mlp_out_norm)
        states = states + out
    states = norm(states, steps.final_norm)
    kept = states.gather(1, keep[..., None].expand(-1, -1, states.shape[-1]))  # (B, K, hidden)
    return kept if hidden else final_logits(model, kept)                      # (B, K, hidden or vocab)


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
        plan(model)
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
