"""The one description of a model that the roofline (:mod:`profiles.analytical`), the memory model and the KV-block
count read: :class:`Architecture`, its decoder layers (each an attention and a feed-forward family, :mod:`.base`) and
the parts around them, from any supported ``config.json`` (:mod:`.hf`), or a draft head on its target
(:data:`profiles.models.config.HEAD_SHAPES`: an fc layer, decoder layer(s) and an LM head on the target's hidden
states).

Counts, not seconds: parameters held (:attr:`Architecture.params`) and those one token computes with
(:attr:`~Architecture.active_params`), weight bytes on a device (:meth:`~Architecture.weight_bytes`, by weight kind
and precision, :mod:`.precision`), KV bytes a token holds on a device split by sliding window
(:meth:`~Architecture.kv_groups`), and per layer kind what a pass reads and computes (the families' ``matmuls`` and
``attention``, priced by :func:`profiles.analytical.pass_cost`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from policies.errors import UserError
from profiles.architectures.base import Layer
from profiles.architectures.gqa import GQA
from profiles.architectures.hf import read_decoder
from profiles.architectures.mlp import GatedMLP
from profiles.architectures.precision import WEIGHT_BYTES, kind_precisions, label
from profiles.models.config import HEAD_SHAPES, read_model_config


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer (or a draft head): its layers and the parts around them. Sizes in counts."""

    name: str
    hidden: int
    vocab: int
    layers: tuple[Layer, ...]
    tied_embeddings: bool
    model_type: str = "llama"
    quantization: tuple[tuple[str, str], ...] = ()
    """The checkpoint's precision by weight kind (:func:`profiles.architectures.precision.read_quantization`)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers shipped with the checkpoint (the ``mtp`` draft head of this target)."""
    head: str | None = None
    """A draft head's method (``eagle``, ``eagle3``, ``mtp``); None: a whole model."""
    fc_inputs: int = 0
    """Input width of the head's fc layer in hidden sizes (output: one); 0: no fc layer."""
    logit_vocab: int | None = None
    """Rows of the LM head when not ``vocab`` (EAGLE-3's reduced draft vocabulary)."""
    shares_embedding: bool = False
    """The embedding is the target's: read, not held (a head)."""
    shares_lm_head: bool = False
    """The LM head is the target's: computed with, not held (EAGLE, MTP)."""

    # -- reading ------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, spec: str, where: str = "model", target: "Architecture | None" = None) -> "Architecture":
        """From a shipped model name or a config file path (``where`` names the flag in errors); a draft head's
        config needs the ``target`` whose hidden states it reads (:meth:`head_on`)."""
        path, data = read_model_config(spec, where, head_ok=True)
        if "speculative_method" not in data:
            return cls.from_dict(data, path.stem, str(path))
        if target is None:
            raise UserError(f"{where}: {path} is an {data['speculative_method']} draft head: it runs on a target's "
                            "hidden states, so it is priced as the draft of a target (give --target too)")
        return cls.head_on(target, data, path.stem, str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str, where: str) -> "Architecture":
        """From a parsed ``config.json`` of a supported ``model_type`` (HF defaults where a key is absent)."""
        decoder = read_decoder(data, where)
        return cls(name=name, hidden=decoder.hidden, vocab=decoder.vocab, layers=decoder.layers,
                   tied_embeddings=decoder.tied_embeddings, model_type=data["model_type"],
                   quantization=decoder.quantization, mtp_layers=decoder.mtp_layers)

    @classmethod
    def head_on(cls, target: "Architecture", data: dict[str, Any], name: str, where: str) -> "Architecture":
        """A draft head's architecture (``data``: its config, :mod:`profiles.models.config`) on ``target``.

        A config with a ``model_type`` is the head's own (EAGLE's, EAGLE-3's), the sizes it leaves out the target's;
        one without (``mtp.json``) is ``num_hidden_layers`` copies of the target's last layer with the target's
        precision: DeepSeek-V3's MTP module is one more MLA + MoE block, behind its projection of [hidden state,
        embedding] (arXiv 2412.19437, sec. 2.2). Its hidden size and vocabulary must be the target's (it reads the
        target's hidden states and shares its embedding)."""
        method = data["speculative_method"]
        shape = HEAD_SHAPES[method]
        last = target.layers[-1]
        if "model_type" in data:
            inherited: dict[str, Any] = {"hidden_size": target.hidden, "vocab_size": target.vocab,
                                         "num_hidden_layers": 1}
            if isinstance(last.attention, GQA):
                inherited.update(num_attention_heads=last.attention.heads, num_key_value_heads=last.attention.kv_heads,
                                 head_dim=last.attention.head_dim)
            if isinstance(last.ffn, GatedMLP):
                inherited["intermediate_size"] = last.ffn.intermediate
            arch = cls.from_dict({**inherited, **data}, name, where)
        else:
            count = data.get("num_hidden_layers", 1)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise UserError(f"{where}: num_hidden_layers must be a positive integer (got {count!r})")
            arch = replace(target, name=name, layers=(last,) * count, mtp_layers=0)
        for key, mine, theirs, why in (("hidden_size", arch.hidden, target.hidden, "reads the target's hidden states"),
                                       ("vocab_size", arch.vocab, target.vocab, "shares the target's embedding")):
            if mine != theirs:
                raise UserError(f"{where}: {key} {mine} is not the target {target.name}'s {theirs}: an {method} head "
                                f"{why}")
        if shape.attention_inputs > 1:
            if arch.num_layers != 1:
                raise UserError(f"{where}: num_hidden_layers must be 1 for an {method} head (its one layer's attention "
                                f"reads [embedding, fc output]; got {arch.num_layers})")
            layer = arch.layers[0]
            if not isinstance(layer.attention, GQA):
                raise UserError(f"{where}: an {method} head's layer must have grouped-query attention")
            arch = replace(arch, layers=(replace(layer, attention=replace(layer.attention,
                                                                        inputs=shape.attention_inputs)),))
        draft_vocab = data.get("draft_vocab_size")
        if draft_vocab is not None and not shape.own_lm_head:
            raise UserError(f"{where}: draft_vocab_size: an {method} head computes its logits with the target's LM "
                            "head (only an eagle3 head has a vocabulary of its own)")
        if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int)
                                        or not 0 < draft_vocab <= arch.vocab):
            raise UserError(f"{where}: draft_vocab_size must be an integer in [1, vocab_size {arch.vocab}] "
                            f"(got {draft_vocab!r})")
        return replace(arch, head=method, fc_inputs=shape.fc_inputs,
                       logit_vocab=draft_vocab if shape.own_lm_head else None, tied_embeddings=False,
                       shares_embedding=True, shares_lm_head=not shape.own_lm_head)

    def with_layers(self, num_layers: int) -> "Architecture":
        """The same model cut (or grown, by its last layer) to ``num_layers`` decoder layers."""
        layers = self.layers[:num_layers] + (self.layers[-1],) * max(0, num_layers - len(self.layers))
        return replace(self, layers=layers)

    # -- shape ---------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def layer_counts(self) -> tuple[tuple[Layer, int], ...]:
        """Each distinct layer and how many the model has, in order of first appearance (the roofline prices a layer
        kind once)."""
        return tuple(Counter(self.layers).items())

    @property
    def attention_inputs(self) -> int:
        """Input width of the first layer's q/k/v in hidden sizes (EAGLE-3's head: 2, [embedding, fc output])."""
        return getattr(self.layers[0].attention, "inputs", 1)

    # the first layer's sizes, for the torch side (profiles.profiler, profiles.models.draft_head: dense models only)
    @property
    def heads(self) -> int:
        return self.layers[0].attention.heads

    @property
    def kv_heads(self) -> int:
        return self.layers[0].attention.kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].attention.head_dim

    @property
    def intermediate(self) -> int:
        return self.layers[0].ffn.intermediate

    @property
    def lm_vocab(self) -> int:
        """Rows of the LM head (the logits a pass computes per token): ``vocab``, or a head's draft vocabulary."""
        return self.vocab if self.logit_vocab is None else self.logit_vocab

    @property
    def windows(self) -> tuple[int, ...]:
        """The sliding windows of its layers (none: full attention everywhere)."""
        return tuple(sorted({layer.window for layer in self.layers if layer.window is not None}))

    # -- parameters ----------------------------------------------------------------------------
    @property
    def fc_params(self) -> int:
        """Weights of a head's fc layer: ``fc_inputs`` hidden sizes in, one out (no bias, as vLLM's); 0 for a model."""
        return self.fc_inputs * self.hidden * self.hidden

    @property
    def _embedding(self) -> int:
        return 0 if self.shares_embedding else self.vocab * self.hidden

    @property
    def _lm_head(self) -> int:
        return 0 if self.shares_lm_head or self.tied_embeddings else self.lm_vocab * self.hidden

    @property
    def _final_norms(self) -> int:
        """The final RMSNorm, and EAGLE-3's norm of the fc output before its wide attention."""
        return self.attention_inputs * self.hidden

    @property
    def params(self) -> int:
        """Parameters held in memory: layers, final norm, embedding and LM head (once when tied); a head holds its
        fc layer, layer(s), norms and its own LM head only (EAGLE-3's), the embedding (and EAGLE's and MTP's LM head)
        being the target's. MTP layers shipped beside a model are not its (they are its ``mtp`` head's)."""
        layers = sum(count * layer.params(self.hidden) for layer, count in self.layer_counts)
        return layers + self.fc_params + self._final_norms + self._embedding + self._lm_head

    @property
    def active_params(self) -> float:
        """Parameters one token computes with: :attr:`params` less the experts its router does not choose (the
        embedding counted; vendors differ on whether their "activated" figure does)."""
        layers = sum(count * layer.active_params(self.hidden) for layer, count in self.layer_counts)
        return layers + self.fc_params + self._final_norms + self._embedding + self._lm_head

    def precisions(self, weights: str = "auto") -> dict[str, str]:
        """Each weight kind's precision under ``--weights`` (:func:`~profiles.architectures.precision.
        kind_precisions`: ``auto`` is the checkpoint's)."""
        return kind_precisions(self.quantization, weights)

    @property
    def projection_kinds(self) -> tuple[str, ...]:
        """The projection weight kinds its layers have (router aside), in :data:`~.base.WEIGHT_KINDS` order."""
        kinds = {kind for layer, _ in self.layer_counts
                 for kind in (*layer.attention.device_weights(1), *layer.ffn.device_weights(1))}
        return tuple(k for k in ("attention", "mlp", "experts", "shared_experts") if k in kinds)

    def weights_label(self, weights: str = "auto") -> str:
        """The precision of its projections in words (``bf16``, ``fp8``, ``experts mxfp4``)."""
        return label(self.precisions(weights), self.projection_kinds)

    def weight_bytes(self, dtype_bytes: float, weights: str = "auto", tp: int = 1) -> float:
        """Bytes of the weights on one of ``tp`` devices (the whole model at 1): the projections (a head's fc layer
        with the MLP's) at their precision (:meth:`precisions`), embeddings, norms, router and LM head at
        ``dtype_bytes``; split by the families' tensor-parallel rules (replicated parts whole), the rest ``tp``
        ways."""
        width = {kind: WEIGHT_BYTES[p] if kind != "router" else dtype_bytes
                 for kind, p in self.precisions(weights).items()}
        projections = sum(count * params * width[kind] for layer, count in self.layer_counts
                          for kind, params in (*layer.attention.device_weights(tp).items(),
                                               *layer.ffn.device_weights(tp).items()))
        norms = sum(count * layer.norms for layer, count in self.layer_counts) * self.hidden + self._final_norms
        other = (self._embedding + self._lm_head + norms) / tp
        return projections + self.fc_params / tp * width["mlp"] + other * dtype_bytes

    # -- KV cache ------------------------------------------------------------------------------
    def kv_groups(self, dtype_bytes: int, tp: int = 1) -> dict[int | None, int]:
        """KV-cache bytes one token holds on one of ``tp`` devices, by layer window (None: full-attention layers)."""
        groups: dict[int | None, int] = {}
        for layer, count in self.layer_counts:
            groups[layer.window] = groups.get(layer.window, 0) + count * layer.attention.kv_elements(tp) * dtype_bytes
        return groups

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV-cache bytes of one token in every layer on one of ``tp`` devices (a sliding layer's only while the token
        is inside its window): GQA 2 x kv_heads x head_dim x dtype bytes a layer, MLA its latent."""
        return sum(self.kv_groups(dtype_bytes, tp).values())

    # -- parallelism -----------------------------------------------------------------------------
    def check_parallel(self, tp: int, ep: int, where: str) -> None:
        """Refuse a tensor-/expert-parallel layout vLLM refuses (one line naming ``where``)."""
        if ep > 1 and "experts" not in self.projection_kinds:
            raise UserError(f"--ep {ep}: {self.name} has no experts to spread")
        for layer, _ in self.layer_counts:
            layer.attention.check_tp(tp, where)
            layer.ffn.check_parallel(tp, ep, where)

    def draft_meta(self) -> dict[str, Any]:
        """What a profile's metadata says of this model as a draft: for a head its method (vLLM's name, which a
        simulation's ``speculative_method`` must match), what it shares with the target and its LM head's rows."""
        if self.head is None:
            return {}
        shared = ["embedding"] + (["lm_head"] if self.shares_lm_head else [])
        return {"speculative_method": self.head, "shares_with_target": shared, "fc_inputs": self.fc_inputs,
                "attention_inputs": self.attention_inputs, "lm_head_rows": self.lm_vocab,
                "structure": HEAD_SHAPES[self.head].source}
