"""KV-cache capacity from a memory budget (vLLM's profiling step, done on paper).

num_gpu_blocks = floor((device memory x utilisation - target weights - draft weights - activation reserve)
                       / (block_size x KV bytes per token)),
where a token's KV bytes are the target's plus, with a draft proposer, the draft's (2 x layers x kv_heads x head_dim
x dtype bytes each). Memory in GiB, KV in bytes per token.

The draft is a draft model or a draft head (EAGLE, EAGLE-3, MTP): the profile's memory figures are then the head's
(:class:`profiles.analytical.Architecture`): its own weights only (fc layer, decoder layer, norms and EAGLE-3's own LM
head; the embedding, and EAGLE's and MTP's LM head, are the target's and counted once, in the target's) and one
layer's KV per token, which vLLM allocates for the head beside the target's as for a draft model.
"""
from __future__ import annotations

import math

from simulator.config import SimConfig
from simulator.costs.cost_model import CostModel
from policies.errors import UserError

GIB = 1024 ** 3
#: Most KV blocks a derived cache may have (1e12 blocks: far beyond any device; more means bad figures).
MAX_BLOCKS = 1e12


def num_gpu_blocks(config: SimConfig, cost_model: CostModel, speculative: bool) -> int:
    """KV-cache blocks for ``config``: its ``num_gpu_blocks`` if set, else derived from the memory budget."""
    if config.engine.num_gpu_blocks is not None:
        return config.engine.num_gpu_blocks
    mem = cost_model.memory
    if mem is None:
        raise UserError(f"--profile {cost_model.path}: has no memory figures to derive the KV cache from; "
                        "give --num-gpu-blocks")
    device_gb = config.engine.gpu_memory_gb if config.engine.gpu_memory_gb is not None else mem.device_memory_gb
    with_draft = speculative and config.speculative.proposer == "draft"
    weights_gb = mem.target_weight_gb + (mem.draft_weight_gb if with_draft else 0.0)
    kv_bytes = mem.target_kv_bytes_per_token + (mem.draft_kv_bytes_per_token if with_draft else 0.0)
    if not (math.isfinite(kv_bytes) and kv_bytes > 0):
        raise UserError(f"--profile {cost_model.path}: memory: KV bytes per token must be > 0 to derive the KV "
                        f"cache (got {kv_bytes:g}); fix the profile's memory figures or give --num-gpu-blocks")
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
