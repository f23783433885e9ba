"""An EAGLE draft head for a Llama-architecture target (Li et al., EAGLE, ICML 2024, arXiv 2401.15077).

The head drafts from the target's *features* (its final-normed hidden states, what its LM head reads), not from
tokens alone. With f_t the target's feature at position t (it predicts token t + 1) and e(x) the target's token
embedding:

    g_{t+1} = Norm(Layer(fc([f_t ; e(x_{t+1})])))        the head's estimate of f_{t+1}
    draft logits for token t + 2 = LMHead(g_{t+1})

``fc`` is a linear map of the concatenation (2 x hidden -> hidden, with bias, as EAGLE's), ``Layer`` one Llama
decoder layer of the target's width (attention over the head's own earlier inputs, with its own KV cache), ``Norm``
an RMSNorm (EAGLE-1 reads the target's features before its final norm and has none; here the features are the
normed ones the LM head reads, so the head ends with a norm as EAGLE-3's does), and ``LMHead`` and ``e`` are the
target's own, frozen and shared (not stored with the head). At the next draft depth the head's own estimate g takes
the target's feature's place: ``fc([g_{t+1} ; e(x_{t+2})])``. Every input the head's cache keeps for accepted tokens
is rebuilt from the target's true features after verification (EAGLE's practice), so only the tokens drafted within
one step run on estimated features.

Built by :class:`EagleHead` around a target; trained by :mod:`profiles.train_head`; loaded by
:func:`profiles.models.pairs.load_head`; drafting in the engine by :mod:`profiles.serving.eagle`.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from profiles.models.drafts import copy_layer, draft_config, new_draft, own_state_dict

#: The file of a head folder that holds its own weights (``config.json`` beside it).
HEAD_WEIGHTS = "head.safetensors"


class EagleHead(torch.nn.Module):
    """The head of the module docstring around ``target``: ``model`` is a one-layer Llama of the target's width
    sharing the target's embedding and LM head (so that the KV caches and forward paths of a draft model serve it),
    ``fc`` the input fusion (seeded with ``seed``). ``intermediate_size``: its MLP width (default the target's)."""

    def __init__(self, target: PreTrainedModel, intermediate_size: int | None = None, seed: int = 0) -> None:
        super().__init__()
        hidden = target.config.hidden_size
        self.model = new_draft(target, draft_config(target, 1, intermediate_size or target.config.intermediate_size))
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=True, device=target.device, dtype=target.dtype)

    @property
    def config(self):  # noqa: ANN201 - the one-layer model's LlamaConfig (vocabulary, width, context)
        return self.model.config

    @property
    def lm_head(self) -> torch.nn.Module:
        """The target's LM head (shared)."""
        return self.model.lm_head

    def fuse(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``fc([features ; e(tokens)])``, the head's input embeddings: ``features`` ``(..., hidden)``, ``tokens`` int64
        ``(...)`` -> ``(..., hidden)``."""
        return self.fc(torch.cat([features, self.model.model.embed_tokens(tokens)], dim=-1))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced estimates over whole sequences (training): pair t is ``(features[:, t], tokens[:, t])``
        (the target's feature at t and the token at t + 1), causal attention; ``(B, T, hidden)``."""
        embeds = self.fuse(features, tokens)
        return self.model.model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state

    def own_parameters(self) -> list[torch.nn.Parameter]:
        """The head's own parameters (what training moves; the target's embedding and LM head stay frozen)."""
        return list(self.fc.parameters()) + list(self.model.model.layers.parameters()) + \
            list(self.model.model.norm.parameters())

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own weights (fc, the layer, the norm), without the target's embedding and LM head."""
        state = {f"model.{k}": v for k, v in own_state_dict(self.model).items()}
        return state | {f"fc.{k}": v for k, v in self.fc.state_dict().items()}

    def init_from_target(self, target: PreTrainedModel) -> None:
        """Make the layer and the norm the target's last layer and final norm (MLP cut to the head's width), and fc
        [I ; I] (the feature plus the token's embedding). Training starts from random weights instead (which trained
        to a better head here, :mod:`profiles.train_head`); with fc passing only the embedding on, the head of a
        one-layer target is that target's own pass shifted by one token (the tests' head that agrees often)."""
        copy_layer(self.model.model.layers[0], target.model.layers[-1])
        with torch.no_grad():
            self.model.model.norm.weight.copy_(target.model.norm.weight)
            eye = torch.eye(self.fc.out_features, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
            self.fc.weight.copy_(torch.cat([eye, eye], dim=1))
            self.fc.bias.zero_()
