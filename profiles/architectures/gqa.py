"""Grouped-query attention (Ainslie et al., GQA, arXiv 2305.13245): ``heads`` query heads sharing ``kv_heads`` K and V
heads of ``head_dim`` each (multi-head attention when they are equal). Llama, Qwen2/3, Gemma-2, Mixtral, GLM-4.5 and
gpt-oss attend this way; Gemma-2's and gpt-oss's sliding-window layers too (the window is the layer's,
:mod:`.sliding`).

Per layer and token: the q, k, v projections (over ``inputs`` hidden sizes: EAGLE-3's head reads [embedding, fc
output], 2), o, their biases where the config has them (Qwen2's q/k/v, gpt-oss's q/k/v/o), Qwen3's and GLM's per-head
RMSNorm of q and k (``qk_norm``: 2 x head_dim) and gpt-oss's per-head attention sinks (learned logits, ``heads``
parameters, no cached tokens). The KV cache holds 2 x kv_heads x head_dim elements per token and layer.

Tensor parallelism as vLLM's ``QKVParallelLinear`` (``vllm/model_executor/layers/linear.py``): query heads split
``tp`` ways (``num_attention_heads % tp == 0``, else vLLM refuses: "Total number of attention heads (N) must be
divisible by tensor parallel size (M)"); K/V heads split too when ``tp <= kv_heads`` (``kv_heads % tp == 0``), else
each device holds one K/V head, replicated ``tp / kv_heads`` times (``tp % kv_heads == 0``) -- its projection and its
cache too.
"""
from __future__ import annotations

from dataclasses import dataclass

from policies.errors import UserError
from profiles.architectures.base import Attention, Matmul, OpCost


@dataclass(frozen=True)
class GQA(Attention):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False
    inputs: int = 1
    """Input width of q, k, v in hidden sizes (EAGLE-3's head: 2)."""

    @property
    def _kv_projection(self) -> int:
        """Weights (and biases) of the k and v projections."""
        kv_out = self.kv_heads * self.head_dim
        return self.inputs * self.hidden * 2 * kv_out + (2 * kv_out if self.qkv_bias else 0)

    @property
    def params(self) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q_out + 2 * kv_out if self.qkv_bias else 0) + (self.hidden if self.o_bias else 0)
        return self.inputs * self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden + bias \
            + (2 * self.head_dim if self.qk_norm else 0) + (self.heads if self.sinks else 0)

    def device_params(self, tp: int) -> float:
        """Weights on one of ``tp`` devices: a ``tp``-th, plus the K/V heads' replicas where ``tp > kv_heads``."""
        replicas = tp // self.kv_heads if tp > self.kv_heads else 1
        return self.params / tp + self._kv_projection * (replicas - 1) / tp

    def device_weights(self, tp: int) -> dict[str, float]:
        return {"attention": self.device_params(tp)}

    def matmuls(self, tokens: int, tp: int) -> list[Matmul]:
        weights = self.device_params(tp)
        return [Matmul("attention", weights, 2 * tokens * weights)]

    def kv_elements(self, tp: int = 1) -> int:
        return 2 * self.kv_heads * self.head_dim // tp if tp <= self.kv_heads else 2 * self.head_dim

    def attention(self, phase: str, tokens: int, batch_size: int, mean_keys: float, kv_tokens: float, tp: int,
                  dtype_bytes: int) -> OpCost:
        """QK^T and PV: 4 x heads x head_dim FLOPs per (query, key) pair; the sequence's K and V read (the same in
        prefill and decode)."""
        return OpCost(4 * tokens * mean_keys * self.heads * self.head_dim / tp,
                      batch_size * kv_tokens * self.kv_elements(tp) * dtype_bytes)

    def activation_elements(self) -> int:
        """q, k, v, rotary and the attention output: (5 heads + 4 kv_heads) x head_dim."""
        return (5 * self.heads + 4 * self.kv_heads) * self.head_dim

    def check_tp(self, tp: int, where: str) -> None:
        if self.heads % tp:
            raise UserError(f"{where}: total number of attention heads ({self.heads}) must be divisible by tensor "
                            f"parallel size ({tp}), as vLLM requires")
        if (tp % self.kv_heads if tp > self.kv_heads else self.kv_heads % tp):
            raise UserError(f"{where}: tensor parallel size {tp} and the {self.kv_heads} KV heads: one must divide "
                            "the other (vLLM splits the KV heads, or replicates them when tp is larger)")
