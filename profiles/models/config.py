"""Architecture configs: a shipped name (``profiles/models/<name>.json``) or a path to an HF ``config.json``; a draft
head's config is one with ``speculative_method`` (:data:`HEAD_SHAPES`).

A draft head's config is an HF-style ``config.json`` of its decoder layer(s) (``num_hidden_layers``, default 1) plus
``speculative_method`` (``eagle``, ``eagle3`` or ``mtp``) and, for EAGLE-3, ``draft_vocab_size``: the shape of the
published head (e.g. ``eagle3-llama-3.1-8b.json``, as ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``). Sizes it leaves out
are its target's, and ``model_type`` may be left out too: ``mtp.json`` holds only the method and so describes one
MTP layer of whatever target it is paired with. A head reads its target's hidden states and shares its embedding,
so its ``hidden_size`` and ``vocab_size`` must be the target's (:class:`profiles.analytical.Architecture` checks).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.draft_head import HEAD_METHODS
from policies.errors import UserError

MODELS_DIR = Path(__file__).resolve().parent

#: Architectures whose structure (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP, full
#: attention in every layer) the roofline, the memory estimate and the KV-cache builder know. ``qwen3`` is Llama's
#: shape with an explicit ``head_dim`` and per-head RMSNorms on q and k (their few FLOPs per head and token are not
#: priced; this project's optimized forward does not run them, :func:`profiles.models.optimized.fuse_projections`).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class HeadShape:
    """What a draft head of one method is made of besides its decoder layer(s) of the target's width (widths in
    hidden sizes H). Costs and weights follow from it (:class:`profiles.analytical.Architecture`)."""

    target_states: int
    """Hidden states of the target the head reads per token: EAGLE and MTP the last layer's (1); EAGLE-3 a low, a
    middle and a high layer's, fused (3)."""
    embedding_at: str
    """Where the token's embedding (the target's, shared) joins: ``fc`` (concatenated with the target's state before
    the fc layer: EAGLE, MTP) or ``attention`` (concatenated with the fc's output at the first layer's q/k/v input:
    EAGLE-3)."""
    own_lm_head: bool
    """EAGLE-3 has its own LM head over a reduced vocabulary (``draft_vocab_size``); EAGLE and MTP compute their
    logits with the target's (shared) LM head."""
    source: str

    @property
    def fc_inputs(self) -> int:
        """Width of the fc layer's input in H (its output is H): the target's states, and the embedding if it
        joins there."""
        return self.target_states + (self.embedding_at == "fc")

    @property
    def attention_inputs(self) -> int:
        """Width of the first layer's q/k/v input in H: 1, or 2 where the embedding joins there."""
        return 1 + (self.embedding_at == "attention")


#: The draft heads (:data:`policies.draft_head.HEAD_METHODS`) and what each is made of.
HEAD_SHAPES = {
    "eagle": HeadShape(1, "fc", False, "Li et al., EAGLE (arXiv 2401.15077, sec. 4): an fc layer over [token "
                                       "embedding, feature] and one decoder layer; vLLM's EagleLlamaForCausalLM "
                                       "shares the target's embedding and LM head"),
    "eagle3": HeadShape(3, "attention", True, "Li et al., EAGLE-3 (arXiv 2503.01840, sec. 3): an fc layer over the "
                                              "fused low, middle and high hidden states, one decoder layer whose "
                                              "attention reads [embedding, fc output], its own LM head over "
                                              "draft_vocab_size; vLLM's Eagle3LlamaForCausalLM shares the embedding"),
    "mtp": HeadShape(1, "fc", False, "DeepSeek-V3 (arXiv 2412.19437, sec. 2.2): an MTP module is the shared "
                                     "embedding, a projection of [hidden state, embedding] (2H -> H), one "
                                     "transformer block and the shared output head; Qwen3-Next's MTP alike"),
}
assert tuple(HEAD_SHAPES) == HEAD_METHODS, "one head shape per draft-head method"


def resolve_model_config(spec: str, where: str) -> Path:
    """The config file ``spec`` names: an existing path, or ``profiles/models/<spec>.json``."""
    path = Path(spec)
    if path.is_file():
        return path
    shipped = MODELS_DIR / f"{spec}.json"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in MODELS_DIR.glob("*.json")))
    raise UserError(f"{where}: no model config file or shipped model named {spec!r} (shipped: {known})")


def read_model_config(spec: str, where: str, head_ok: bool = False) -> tuple[Path, dict[str, Any]]:
    """Resolve and parse an HF ``config.json``-style file; anything else is a one-line UserError. A draft head's config
    (``speculative_method`` set; ``model_type`` may be left out) only where ``head_ok``: elsewhere a whole model is
    built from it."""
    path = resolve_model_config(spec, where)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a JSON model config ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a model config: model_type missing")
    method = data.get("speculative_method")
    if method is not None:
        if not isinstance(method, str) or method not in HEAD_SHAPES:
            raise UserError(f"{path}: speculative_method must be a draft head's: {', '.join(HEAD_SHAPES)} "
                            f"(got {method!r})")
        if not head_ok:
            raise UserError(f"{where}: {path} is an {method} draft head, not a model: it runs on a target's hidden "
                            "states (give it as the draft of a target: profile --draft, python -m profiles.analytical "
                            "--draft)")
        if "model_type" not in data:
            return path, data  # a head of its target's architecture
    if "model_type" not in data:
        raise UserError(f"{path}: not a model config: model_type missing")
    if data["model_type"] not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{path}: model_type is an unknown architecture (got {data['model_type']!r}); "
                        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return path, data
