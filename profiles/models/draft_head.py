"""A draft head (EAGLE, EAGLE-3, MTP) as a torch module with random weights, so that the profiler times its passes
as it times a model's (:mod:`profiles.profiler`, eager forward).

The head's :class:`profiles.analytical.Architecture` (from its config and its target's, shapes per token, H = the
target's hidden size, V its vocabulary):

    EAGLE, MTP:  x = fc([embed(token) | h])            (2H -> H), h: the target's last hidden state
    EAGLE-3:     x = fc([h_low | h_mid | h_high])       (3H -> H), three of the target's hidden states
    then         x = decoder layer(x)                   EAGLE-3: its q/k/v read [norm(embed(token)) | norm(x)] (2H)
                 logits = lm_head(norm(x))              (H -> V; EAGLE-3: its own draft vocabulary)

(Li et al., EAGLE, arXiv 2401.15077; EAGLE-3, arXiv 2503.01840; DeepSeek-V3's MTP module, arXiv 2412.19437.) The
embedding table, decoder layer, its KV cache, rotary embedding and causal mask are Hugging Face's modules of the
target's model type cut to the head's layers, so :func:`profiles.models.forward.decode_pass`, ``prefill_pass`` and
``random_cache`` run a head as they run a model. The target's hidden states a pass reads stand ready in memory in an
engine (the verification pass wrote them): here a random tensor per shape, made at the shape's first pass.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import AutoModel, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from profiles.models import forward
from profiles.models.config import HEAD_SHAPES

if TYPE_CHECKING:  # pragma: no cover - typing only (profiles.models imports nothing else of profiles)
    from profiles.analytical import Architecture


class _WideAttentionLayer(torch.nn.Module):
    """EAGLE-3's decoder layer: the model's layer whose q/k/v read [norm(embedding) | norm(x)] (2H wide) and whose
    residual stream is x; the MLP half as the model's."""

    def __init__(self, layer: torch.nn.Module, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer = layer
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            narrow = getattr(attention, name)
            setattr(attention, name, torch.nn.Linear(2 * config.hidden_size, narrow.out_features,
                                                     bias=narrow.bias is not None))
        self.hidden_norm = type(layer.input_layernorm)(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, head_embeddings: torch.Tensor, **kwargs) -> torch.Tensor:
        layer = self.layer
        wide = torch.cat([layer.input_layernorm(head_embeddings), self.hidden_norm(hidden_states)], dim=-1)
        attended, _ = layer.self_attn(hidden_states=wide, **kwargs)  # (b, q, 2H) in, (b, q, H) out
        x = hidden_states + attended
        return x + layer.mlp(layer.post_attention_layernorm(x))


class DraftHead(torch.nn.Module):
    """A draft head over a ``(b, q)`` batch of tokens and the target's hidden states at them (module docstring);
    called like a Hugging Face causal LM (``input_ids``, ``position_ids``, ``attention_mask``, ``use_cache``,
    ``logits_to_keep``, ``cache``), returning the logits of the last ``logits_to_keep`` positions."""

    def __init__(self, arch: Architecture, config: PretrainedConfig) -> None:
        super().__init__()
        shape = HEAD_SHAPES[arch.head]
        self.config = config
        self.embedding_at = shape.embedding_at
        self.target_states = shape.target_states
        self.model = AutoModel.from_config(config, attn_implementation="sdpa")  # embedding, layer(s), norm, rotary
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(arch.fc_inputs * hidden, hidden, bias=False)
        self.lm_head = torch.nn.Linear(hidden, arch.lm_vocab, bias=False)
        if arch.attention_inputs > 1:
            self.model.layers[0] = _WideAttentionLayer(self.model.layers[0], config)
        self._states: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def target_hidden_states(self, batch_size: int, query_len: int) -> torch.Tensor:
        """The target's hidden states the head reads at ``(batch_size, query_len)`` tokens:
        ``(b, q, target_states x H)``, random (standard normal), one tensor per shape."""
        key = (batch_size, query_len)
        if key not in self._states:
            width = self.target_states * self.config.hidden_size
            self._states[key] = torch.randn(batch_size, query_len, width, dtype=self.dtype, device=self.device)
        return self._states[key]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, use_cache: bool = True, logits_to_keep: int = 1,
                cache=None) -> CausalLMOutputWithPast:
        embedded = self.model.embed_tokens(input_ids)                                 # (b, q, H)
        states = self.target_hidden_states(*input_ids.shape)                          # (b, q, F x H)
        extra = {}
        if self.embedding_at == "fc":
            x = self.fc(torch.cat([embedded, states], dim=-1))                        # (b, q, 2H) -> (b, q, H)
        else:
            x = self.fc(states)                                                       # (b, q, 3H) -> (b, q, H)
            extra["head_embeddings"] = embedded
        out = self.model(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=use_cache, **{forward._cache_kwarg(self.model): cache}, **extra)
        return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state[:, -logits_to_keep:]))


def build_head(arch: Architecture, target_config: PretrainedConfig, dtype: str, device: torch.device,
               seed: int = 0) -> DraftHead:
    """A :class:`DraftHead` of ``arch`` (a head's architecture) on the target of ``target_config`` (its model type,
    rotary and norm settings; cut to the head's layers and widths), random weights (seeded), in ``dtype`` on
    ``device``, in eval mode. Its decoder layer is a layer of the target's family (the profiler takes heads only on
    targets whose family allows it, :attr:`profiles.models.families.Family.head_target`)."""
    config = target_config.__class__.from_dict({
        **target_config.to_dict(), "num_hidden_layers": arch.num_layers, "intermediate_size": arch.intermediate,
        "num_attention_heads": arch.heads, "num_key_value_heads": arch.kv_heads, "head_dim": arch.head_dim})
    torch.manual_seed(seed)
    with torch.device(device):
        head = DraftHead(arch, config)
    return head.to(forward.DTYPES[dtype]).eval().requires_grad_(False)
