"""The registry of model types: one reader per Hugging Face ``model_type`` turning its ``config.json`` into the layers
of the one description (:class:`profiles.architectures.base.Decoder`), from the families (:mod:`.gqa`, :mod:`.mla`,
:mod:`.mlp`, :mod:`.moe`, :mod:`.sliding`). A new model type is a new reader here, not a branch in the roofline.

Every reader names the keys it reads among those that change the cost (:data:`COST_KEYS`); a config that sets one
it does not read (``num_local_experts`` under ``llama``, a ``sliding_window`` under a type without sliding layers) is
refused with one line naming the key, never priced silently as something else. ``quantization_config`` is read for
every type (:mod:`.precision`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from policies.errors import UserError
from profiles.architectures.base import Config, Decoder, FeedForward, Layer
from profiles.architectures.gqa import GQA
from profiles.architectures.mla import MLA
from profiles.architectures.mlp import GatedMLP
from profiles.architectures.moe import MoE
from profiles.architectures.precision import read_quantization
from profiles.architectures.sliding import layer_windows
from profiles.models.config import SUPPORTED_MODEL_TYPES

#: Config keys that change what a pass costs or a model holds: each must be read by the model type's reader when it
#: is set (not null, false, 0 or empty).
COST_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok",
             "experts_per_token", "n_shared_experts", "shared_expert_intermediate_size", "first_k_dense_replace",
             "moe_layer_freq", "decoder_sparse_step", "mlp_only_layers", "sliding_window", "use_sliding_window",
             "layer_types", "kv_lora_rank", "q_lora_rank", "num_nextn_predict_layers", "use_qk_norm",
             "attention_bias", "mlp_bias", "attention_chunk_size", "interleave_moe_layer_step",
             "sliding_window_pattern")


def _gqa(c: Config, qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False,
         sinks: bool = False) -> GQA:
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    head_dim = c.size("head_dim", hidden // heads or None)
    return GQA(hidden=hidden, heads=heads, kv_heads=c.size("num_key_value_heads", heads), head_dim=head_dim,
               qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, sinks=sinks)


def _qwen_windows(c: Config) -> Callable[[int], bool] | None:
    """Qwen2/3: with ``use_sliding_window``, layers from ``max_window_layers`` on slide (transformers' Qwen2Config)."""
    if not c.flag("use_sliding_window"):
        return None
    first = c.count("max_window_layers", c.size("num_hidden_layers"))
    return lambda i: i >= first


def _decoder(c: Config, attention: Any, ffns: list[FeedForward], windows: list[int | None], norms: int = 2,
             tied: bool = False, mtp_layers: int = 0) -> Decoder:
    layers = tuple(Layer(attention, ffn, window, norms) for ffn, window in zip(ffns, windows))
    return Decoder(hidden=c.size("hidden_size"), vocab=c.size("vocab_size"), layers=layers,
                   tied_embeddings=c.flag("tie_word_embeddings", tied), quantization=read_quantization(c),
                   mtp_layers=mtp_layers)


def _dense(c: Config, bias: bool = False) -> list[FeedForward]:
    return [GatedMLP(c.size("hidden_size"), c.size("intermediate_size"), bias)] * c.size("num_hidden_layers")


def read_llama(c: Config) -> Decoder:
    bias = c.flag("attention_bias")
    layers = c.size("num_hidden_layers")
    return _decoder(c, _gqa(c, bias, bias), _dense(c, c.flag("mlp_bias")), [None] * layers)


def read_qwen2(c: Config) -> Decoder:
    layers = c.size("num_hidden_layers")
    return _decoder(c, _gqa(c, qkv_bias=True), _dense(c), layer_windows(c, layers, _qwen_windows(c)))


def read_qwen3(c: Config) -> Decoder:
    bias, layers = c.flag("attention_bias"), c.size("num_hidden_layers")
    return _decoder(c, _gqa(c, bias, bias, qk_norm=True), _dense(c), layer_windows(c, layers, _qwen_windows(c)))


def read_gemma2(c: Config) -> Decoder:
    """Gemma-2: GeGLU MLP, four RMSNorms a layer (around attention and MLP), even layers sliding, tied embeddings."""
    bias, layers = c.flag("attention_bias"), c.size("num_hidden_layers")
    return _decoder(c, _gqa(c, bias, bias), _dense(c), layer_windows(c, layers, lambda i: i % 2 == 0), norms=4,
                    tied=True)


def read_mixtral(c: Config) -> Decoder:
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    moe = MoE(hidden, c.size("num_local_experts"), c.size("num_experts_per_tok"), c.size("intermediate_size"))
    slides = (lambda i: True) if c.get("sliding_window") is not None else None
    return _decoder(c, _gqa(c), [moe] * layers, layer_windows(c, layers, slides))


def read_qwen3_moe(c: Config) -> Decoder:
    hidden, layers, bias = c.size("hidden_size"), c.size("num_hidden_layers"), c.flag("attention_bias")
    moe = MoE(hidden, c.size("num_experts"), c.size("num_experts_per_tok"), c.size("moe_intermediate_size"))
    dense = GatedMLP(hidden, c.size("intermediate_size"))
    only, step = c.get("mlp_only_layers", []), c.size("decoder_sparse_step", 1)
    ffns = [moe if i not in only and (i + 1) % step == 0 else dense for i in range(layers)]
    return _decoder(c, _gqa(c, bias, bias, qk_norm=True), ffns, layer_windows(c, layers, _qwen_windows(c)))


def _shared_moe(c: Config, hidden: int, router_bias: bool) -> MoE:
    """DeepSeek's and GLM's routed experts with ``n_shared_experts`` shared ones of the same width."""
    width = c.size("moe_intermediate_size")
    return MoE(hidden, c.size("n_routed_experts"), c.size("num_experts_per_tok"), width,
               shared_intermediate=c.count("n_shared_experts") * width, router_bias=router_bias)


def read_deepseek_v3(c: Config) -> Decoder:
    """DeepSeek-V3: MLA, ``first_k_dense_replace`` dense layers then MoE every ``moe_layer_freq``-th layer, sigmoid
    router with a per-expert correction bias, ``num_nextn_predict_layers`` MTP layers shipped beside."""
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    q_lora = None if c.get("q_lora_rank") is None else c.size("q_lora_rank")  # null: a plain q projection
    mla = MLA(hidden=hidden, heads=c.size("num_attention_heads"), q_lora_rank=q_lora,
              kv_lora_rank=c.size("kv_lora_rank"), qk_nope_head_dim=c.size("qk_nope_head_dim"),
              qk_rope_head_dim=c.size("qk_rope_head_dim"), v_head_dim=c.size("v_head_dim"))
    if c.flag("attention_bias"):
        raise c.refuse("attention_bias", "biases on MLA's projections are not modelled")
    moe, dense = _shared_moe(c, hidden, router_bias=True), GatedMLP(hidden, c.size("intermediate_size"))
    first, freq = c.count("first_k_dense_replace"), c.size("moe_layer_freq", 1)
    ffns = [moe if i >= first and i % freq == 0 else dense for i in range(layers)]
    return _decoder(c, mla, ffns, [None] * layers, mtp_layers=c.count("num_nextn_predict_layers"))


def read_glm4_moe(c: Config) -> Decoder:
    """GLM-4.5: GQA with q/k/v biases (``attention_bias``; o has none) and optional q/k norms (``use_qk_norm``),
    ``first_k_dense_replace`` dense layers, then routed + shared experts (sigmoid router with correction bias)."""
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    moe, dense = _shared_moe(c, hidden, router_bias=True), GatedMLP(hidden, c.size("intermediate_size"))
    first = c.count("first_k_dense_replace")
    ffns = [moe if i >= first else dense for i in range(layers)]
    attention = _gqa(c, qkv_bias=c.flag("attention_bias"), qk_norm=c.flag("use_qk_norm"))
    return _decoder(c, attention, ffns, [None] * layers, mtp_layers=c.count("num_nextn_predict_layers"))


def read_gpt_oss(c: Config) -> Decoder:
    """gpt-oss: GQA with biases and per-head attention sinks, sliding layers per ``layer_types`` (window 128),
    experts with biases and a router with a bias, MXFP4 experts (``quantization_config``)."""
    hidden, layers = c.size("hidden_size"), c.size("num_hidden_layers")
    top_k = c.size("experts_per_token", c.get("num_experts_per_tok"))
    if c.get("num_experts_per_tok") not in (None, top_k):
        raise c.refuse("num_experts_per_tok", f"differs from experts_per_token {top_k}")
    moe = MoE(hidden, c.size("num_local_experts"), top_k, c.size("intermediate_size"), expert_bias=True,
              router_bias=True)
    bias = c.flag("attention_bias")
    return _decoder(c, _gqa(c, bias, bias, sinks=True), [moe] * layers,
                    layer_windows(c, layers, lambda i: i % 2 == 0))


#: Model type -> (reader, the :data:`COST_KEYS` it reads).
READERS: dict[str, tuple[Callable[[Config], Decoder], frozenset[str]]] = {
    "llama": (read_llama, frozenset({"attention_bias", "mlp_bias"})),
    "qwen2": (read_qwen2, frozenset({"sliding_window", "use_sliding_window", "layer_types"})),
    "qwen3": (read_qwen3, frozenset({"sliding_window", "use_sliding_window", "layer_types", "attention_bias"})),
    "gemma2": (read_gemma2, frozenset({"sliding_window", "layer_types", "attention_bias"})),
    "mixtral": (read_mixtral, frozenset({"num_local_experts", "num_experts_per_tok", "sliding_window",
                                         "layer_types"})),
    "qwen3_moe": (read_qwen3_moe, frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                             "decoder_sparse_step", "mlp_only_layers", "sliding_window",
                                             "use_sliding_window", "layer_types", "attention_bias"})),
    "deepseek_v3": (read_deepseek_v3, frozenset({"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                 "n_shared_experts", "first_k_dense_replace", "moe_layer_freq",
                                                 "kv_lora_rank", "q_lora_rank", "num_nextn_predict_layers",
                                                 "attention_bias"})),
    "glm4_moe": (read_glm4_moe, frozenset({"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                           "n_shared_experts", "first_k_dense_replace", "use_qk_norm",
                                           "attention_bias", "num_nextn_predict_layers"})),
    "gpt_oss": (read_gpt_oss, frozenset({"num_local_experts", "experts_per_token", "num_experts_per_tok",
                                         "layer_types", "sliding_window", "attention_bias"})),
}
assert tuple(READERS) == SUPPORTED_MODEL_TYPES, "one reader per supported model type"


def _is_set(key: str, value: Any) -> bool:
    """Whether a cost key says something (``layer_types``: a layer other than full attention)."""
    if key == "layer_types" and isinstance(value, list):
        return any(t != "full_attention" for t in value)
    return value is not None and value is not False and value != 0 and value != [] and value != {}


def read_decoder(data: dict[str, Any], where: str) -> Decoder:
    """The layers of a parsed ``config.json`` of a supported ``model_type`` (:func:`profiles.models.config.
    read_model_config` checked the type); a set cost key its reader does not read is refused (module docstring)."""
    reader, reads = READERS[data["model_type"]]
    for key in COST_KEYS:
        if key not in reads and _is_set(key, data.get(key)):
            raise UserError(f"{where}: {key} {data[key]!r} is not read for model_type {data['model_type']!r}, and it "
                            "changes the cost: not priced as if absent (fix the config or its model_type)")
    return reader(Config(data, where))
