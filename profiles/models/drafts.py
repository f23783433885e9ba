"""Drafts built around a target: a Llama of the target's width, vocabulary and attention that shares its embedding
and output head (the draft model of :mod:`profiles.train_draft`, the one layer of an EAGLE head,
:mod:`profiles.models.eagle_head`), started from the target's own layers, and its own weights apart from the shared
ones."""
from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel


def plain_config(model: PreTrainedModel, **changes: Any) -> LlamaConfig:
    """``model``'s Llama config without loading details (quantization, names, dtype), with ``changes``."""
    fields = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "architectures", "transformers_version", "dtype",
                "torch_dtype"):
        fields.pop(key, None)
    fields.update(changes)
    return LlamaConfig(**fields)


def bare_model(config: LlamaConfig) -> LlamaForCausalLM:
    """A float32 Llama of ``config`` with SDPA attention (weights to be loaded)."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32)


def draft_config(target: PreTrainedModel, num_layers: int, intermediate_size: int) -> LlamaConfig:
    """A Llama config of the target's width, vocabulary and attention with ``num_layers`` layers."""
    return plain_config(target, num_hidden_layers=num_layers, intermediate_size=intermediate_size,
                         tie_word_embeddings=True)


def new_draft(target: PreTrainedModel, config: LlamaConfig) -> LlamaForCausalLM:
    """A draft of ``config`` whose embedding and tied head are the target's (the same, frozen, modules)."""
    draft = bare_model(config).to(device=target.device, dtype=target.dtype)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    return draft


def copy_layer(mine: torch.nn.Module, theirs: torch.nn.Module) -> None:
    """Copy the target's decoder layer ``theirs`` into the draft's layer ``mine`` of the same width, the MLP cut to
    the draft's first ``intermediate_size`` channels."""
    with torch.no_grad():
        for name, param in mine.named_parameters():
            source = theirs.get_parameter(name)
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                source = source[:param.shape[0]]
            elif name.endswith("down_proj.weight"):
                source = source[:, :param.shape[1]]
            param.copy_(source)


def own_state_dict(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The draft's own weights (layers and final norm), without the shared embedding and head."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith(("model.embed_tokens", "lm_head"))}
