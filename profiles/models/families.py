"""The model families the torch side builds (random weights, Hugging Face's own model classes: the profiler's forward
passes and the real engine), and reduced variants of large configs for CPU runs (:func:`reduce`).

=============  =====================  ===========================================================================
model_type     transformers class     structure beyond Llama's (RMSNorm, rotary attention with grouped KV heads,
                                      SwiGLU MLP)
=============  =====================  ===========================================================================
``llama``      LlamaForCausalLM       none
``qwen2``      Qwen2ForCausalLM       q/k/v biases
``qwen3``      Qwen3ForCausalLM       an RMSNorm over each head's q and k before rotary (q/k norms); no biases
``gemma2``     Gemma2ForCausalLM      sliding-window (local, layers 0, 2, 4, ...) and global layers alternating;
                                      attention logits and final logits soft-capped, ``c tanh(x / c)``; an RMSNorm
                                      before and after both attention and MLP, scaled by ``1 + weight``; GeGLU MLP
                                      (tanh GELU); embeddings x sqrt(hidden); query scale
                                      ``query_pre_attn_scalar ** -0.5``; head_dim 256 (2B, 9B)
``mixtral``    MixtralForCausalLM     a sparse mixture-of-experts MLP in every layer: a router picks the top
                                      ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts of width
                                      ``intermediate_size`` per token (softmax weights renormalised over them)
``qwen3_moe``  Qwen3MoeForCausalLM    q/k norms, and a sparse MoE MLP of ``num_experts`` experts of width
                                      ``moe_intermediate_size``, top ``num_experts_per_tok`` (renormalised when
                                      ``norm_topk_prob``); ``mlp_only_layers`` / ``decoder_sparse_step`` may
                                      leave layers dense
=============  =====================  ===========================================================================

(Gemma Team, Gemma 2, arXiv 2408.00118, sec. 2; Qwen Team, Qwen3 Technical Report, arXiv 2505.09388, sec. 2;
Jiang et al., Mixtral of Experts, arXiv 2401.04088, sec. 2; transformers' ``modeling_*`` files of each family.)

How transformers runs them, as the eager forward path uses them (transformers 5.x):

- **Attention**: SDPA, except Gemma-2: transformers refuses SDPA for it (SDPA has no logit soft-capping), so it runs
  transformers' eager attention (:attr:`Family.attention`).
- **Caches**: ``DynamicCache(config=...)`` gives Gemma-2's sliding layers a ``DynamicSlidingWindowLayer`` that
  keeps only the last ``sliding_window - 1`` tokens (the "hybrid" cache; every other family's layers keep every
  token): :func:`profiles.models.forward.random_cache` builds that cache as it is, with its sliding layers recording
  their past so that the profiler can crop a pass's tokens off again.
- **Experts**: transformers' default experts implementation, ``grouped_mm``: a pass's (token, expert) pairs sorted
  by expert and one matrix product per expert over its rows (``torch.nn.functional.grouped_mm``; the CPU kernel
  loops over the experts that have rows), so an expert no token chose costs nothing: a pass of T tokens reads the
  weights of the experts its tokens woke, E (1 - (1 - k / E) ^ T) of them under uniform routing
  (``tests/test_families.py`` times it). The same on the optimized path, which calls the MoE block as it is.

:func:`reduce` cuts a config to fewer layers, experts and smaller widths while keeping its family's structure (the
CPU timing twin's models, ``profiles/models/qwen3-30b-a3b-cpu.json`` and ``qwen3-0.6b-cpu.json``, and the tests'
models); ``python -m profiles.models.families SPEC --layers 4 ... --out FILE`` writes one.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.errors import UserError, exit_on_user_error
from profiles.models.config import read_model_config


@dataclass(frozen=True)
class Family:
    """What the torch side needs to know of a model type beyond its config (module docstring)."""

    model_type: str
    attention: str
    """transformers' attention implementation the eager path asks for (``sdpa``, or ``eager`` where SDPA lacks an
    operation the family needs)."""
    experts_key: str | None = None
    """The config key of the number of routed experts (None: a dense family)."""
    expert_width_key: str | None = None
    """The config key of one expert's MLP width."""
    unit_offset_norm: bool = False
    """Its RMSNorms scale by ``1 + weight`` (Gemma), not by ``weight``."""
    head_target: bool = True
    """Whether a draft head (:mod:`profiles.models.draft_head`) may be built on a target of this family: its decoder
    layer is the target family's layer, which must then be a dense one of Llama's shape."""


#: The families the torch side builds, by ``model_type`` (one registry).
FAMILIES = {f.model_type: f for f in (
    Family("llama", "sdpa"),
    Family("qwen2", "sdpa"),
    Family("qwen3", "sdpa"),
    Family("gemma2", "eager", unit_offset_norm=True, head_target=False),
    Family("mixtral", "sdpa", "num_local_experts", "intermediate_size", head_target=False),
    Family("qwen3_moe", "sdpa", "num_experts", "moe_intermediate_size", head_target=False),
)}
MODEL_TYPES = tuple(FAMILIES)


def family(model_type: str) -> Family:
    """The family of ``model_type`` (one :data:`MODEL_TYPES`, as :func:`read_model_config` checked)."""
    return FAMILIES[model_type]


def read_family_config(spec: str, where: str) -> tuple[Path, dict[str, Any]]:
    """A model's config (shipped name or path) whose ``model_type`` is one of :data:`MODEL_TYPES`; anything else is
    a one-line UserError."""
    return read_model_config(spec, where, model_types=MODEL_TYPES)


#: :func:`reduce`'s arguments: the config key each sets (``expert_width``: the family's
#: :attr:`Family.expert_width_key`).
REDUCE_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate": "intermediate_size",
               "experts": None, "top_k": "num_experts_per_tok", "expert_width": None, "vocab": "vocab_size",
               "sliding_window": "sliding_window"}


def reduce(data: dict[str, Any], name: str, **sizes: int) -> dict[str, Any]:
    """A copy of the config ``data`` (named ``name``) with the sizes :data:`REDUCE_KEYS` names changed and its
    family's structure kept: the layer pattern (Gemma-2's alternation and Qwen3-MoE's dense layers follow the layer
    count), q/k norms, soft-capping, the router's top-k and renormalisation. Gemma-2's query scale follows the head
    size (``query_pre_attn_scalar`` x new / old head_dim); token ids beyond a reduced vocabulary are dropped. The
    result records where it came from (``specsim_reduced_from``: the source and the sizes), so that it can be made
    again (``tests/test_families.py`` remakes the shipped ones). A size must be a positive integer; experts need a
    MoE family, at least ``top_k`` of them, and heads a multiple of the KV heads (``--NAME`` in messages)."""
    fam = family(data["model_type"])
    out = {k: v for k, v in data.items() if k != "specsim_reduced_from"}
    for arg, value in sizes.items():
        if arg not in REDUCE_KEYS:
            raise UserError(f"reduce: unknown size {arg!r} (known: {', '.join(REDUCE_KEYS)})")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"--{arg.replace('_', '-')}: must be a positive integer (got {value!r})")
        key = REDUCE_KEYS[arg] or (fam.experts_key if arg == "experts" else fam.expert_width_key)
        if key is None or (arg in ("top_k", "experts", "expert_width") and fam.experts_key is None):
            raise UserError(f"--{arg.replace('_', '-')}: {fam.model_type} is a dense family (no experts)")
        if arg == "sliding_window" and data.get("sliding_window") is None:
            raise UserError(f"--sliding-window: {name} has no sliding-window layers")
        out[key] = value
    if "head_dim" in sizes and data.get("query_pre_attn_scalar") is not None:
        old_dim = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
        out["query_pre_attn_scalar"] = data["query_pre_attn_scalar"] * sizes["head_dim"] // old_dim
    heads, kv_heads = out["num_attention_heads"], out.get("num_key_value_heads") or out["num_attention_heads"]
    if heads % kv_heads:
        raise UserError(f"--heads: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    if fam.experts_key is not None and out["num_experts_per_tok"] > out[fam.experts_key]:
        raise UserError(f"--experts: {out[fam.experts_key]} experts are fewer than the {out['num_experts_per_tok']} "
                        "each token picks (--top-k)")
    layers = out["num_hidden_layers"]
    if out.get("mlp_only_layers"):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    if out.get("max_window_layers") is not None:
        out["max_window_layers"] = min(out["max_window_layers"], layers)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = out.get(key)
        if isinstance(ids, list):
            out[key] = [i for i in ids if i < out["vocab_size"]] or None
        elif isinstance(ids, int) and ids >= out["vocab_size"]:
            out[key] = None
    out["_name_or_path"] = f"specsim: {name} reduced ({', '.join(f'{k} {v}' for k, v in sizes.items())})"
    out["specsim_reduced_from"] = {"config": name, "sizes": dict(sizes)}
    return out


def main(argv: list[str]) -> int:
    """``python -m profiles.models.families SPEC --layers N ... --out FILE``: write a reduced config."""
    parser = argparse.ArgumentParser(prog="python -m profiles.models.families",
                                     description="Write a reduced variant of a model config (module docstring).")
    parser.add_argument("spec", help="a shipped model name (profiles/models) or a config.json path")
    for arg, key in REDUCE_KEYS.items():
        what = key or {"experts": "number of routed experts", "expert_width": "width of one expert's MLP"}[arg]
        parser.add_argument(f"--{arg.replace('_', '-')}", type=int, help=f"new {what}")
    parser.add_argument("--out", required=True, help="the config file to write")
    args = parser.parse_args(argv)
    path, data = read_family_config(args.spec, "spec")
    sizes = {arg: getattr(args, arg) for arg in REDUCE_KEYS if getattr(args, arg) is not None}
    Path(args.out).write_text(json.dumps(reduce(data, path.stem, **sizes), indent=2) + "\n")
    print(f"{args.out}: {path.stem} reduced ({', '.join(f'{k} {v}' for k, v in sizes.items())})")
    return 0


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
