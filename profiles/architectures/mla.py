"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, sec. 2.1; DeepSeek-V3, arXiv 2412.19437, sec. 2.1).

Per layer (HF ``DeepseekV3Attention``): q = q_b(norm(q_a(x))) (``q_lora_rank``; a plain q projection where it is
null), per head ``qk_nope_head_dim + qk_rope_head_dim``; [c_kv, k_rope] = kv_a(x) (``kv_lora_rank +
qk_rope_head_dim``, one rope key shared by all heads); K_nope and V per head = kv_b(norm(c_kv)) (``qk_nope_head_dim``
and ``v_head_dim``); o over heads x v_head_dim. The KV cache holds only the latent [c_kv, k_rope]: ``kv_lora_rank +
qk_rope_head_dim`` elements per token and layer (576 for DeepSeek-V3), not per head (``num_key_value_heads`` is
nominal): vLLM's ``MLAAttentionSpec`` and SGLang's ``MLATokenToKVPool``
(``profiles/data/moe_speculation/architecture_notes.md``, sec. 2).

Attention as vLLM's MLA backends compute it: a decode or verification pass **absorbs** kv_b into the query and
output (``vllm/attention/backends/mla/common.py``): each query head attends over the latent itself, 2 x (kv_lora_rank
+ qk_rope_head_dim) FLOPs per (query, key) pair for QK^T and 2 x kv_lora_rank for PV, reading the cached latent once
per sequence; kv_b's weights multiply the query tokens (the same count as a projection, priced as one). A prefill
decompresses instead: kv_b over the prompt's tokens (a projection again), then multi-head attention of head size
qk_nope + qk_rope for QK^T and v_head_dim for PV.

Tensor parallelism (vLLM's ``DeepseekV2MLAAttention``): q_b, kv_b and o split ``tp`` ways by heads; q_a and kv_a
(``ReplicatedLinear``) are whole on every device; the latent has one head, so every device caches all of it for its
requests ("KV cache will be duplicated among all TP ranks" without data-parallel attention, SGLang's DeepSeek
document).
"""
from __future__ import annotations

from dataclasses import dataclass

from policies.errors import UserError
from profiles.architectures.base import Attention, Matmul, OpCost


@dataclass(frozen=True)
class MLA(Attention):
    hidden: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent(self) -> int:
        """Elements of the cached latent per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def _replicated(self) -> int:
        """q_a (or nothing) and kv_a with the two latent RMSNorms: whole on every device."""
        q_a = self.hidden * self.q_lora_rank + self.q_lora_rank if self.q_lora_rank else 0
        return q_a + self.hidden * self.latent + self.kv_lora_rank

    @property
    def _sharded(self) -> int:
        """q_b (or q), kv_b and o: split by heads."""
        q_in = self.q_lora_rank or self.hidden
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.heads * (q_in * qk + self.kv_lora_rank * (self.qk_nope_head_dim + self.v_head_dim)
                             + self.v_head_dim * self.hidden)

    @property
    def params(self) -> int:
        return self._replicated + self._sharded

    def device_weights(self, tp: int) -> dict[str, float]:
        return {"attention": self._replicated + self._sharded / tp}

    def matmuls(self, tokens: int, tp: int) -> list[Matmul]:
        weights = self.device_weights(tp)["attention"]
        return [Matmul("attention", weights, 2 * tokens * weights)]

    def kv_elements(self, tp: int = 1) -> int:
        return self.latent  # the whole latent on every device

    def attention(self, phase: str, tokens: int, batch_size: int, mean_keys: float, kv_tokens: float, tp: int,
                  dtype_bytes: int) -> OpCost:
        heads = self.heads / tp
        latent_bytes = batch_size * kv_tokens * self.latent * dtype_bytes
        if phase == "decode":  # absorbed: every head attends over the latent
            return OpCost(2 * tokens * mean_keys * heads * (self.latent + self.kv_lora_rank), latent_bytes)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim  # prefill: decompressed multi-head attention
        per_head = tokens * heads * (2 * qk + self.v_head_dim) * dtype_bytes  # q, k, v of the new tokens read
        return OpCost(2 * tokens * mean_keys * heads * (qk + self.v_head_dim), latent_bytes + per_head)

    def activation_elements(self) -> int:
        """q (per head), the decompressed or absorbed keys and values and the output: heads x (2 (nope + rope) +
        2 v) plus the latent's read and write."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.heads * (2 * qk + 2 * self.v_head_dim) + 2 * self.latent

    def check_tp(self, tp: int, where: str) -> None:
        if self.heads % tp:
            raise UserError(f"{where}: total number of attention heads ({self.heads}) must be divisible by tensor "
                            f"parallel size ({tp}), as vLLM requires")
