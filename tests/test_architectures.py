"""The one description every family reads into (profiles/architectures): each family's shipped config gives the
parameter counts its publisher states, and the KV bytes per token its cache holds; what the roofline cannot price is
refused in one line.

Published figures (the sources, beside each):
- Qwen3 model cards (huggingface.co/Qwen/Qwen3-*, "Number of Parameters"): 8B "8.2B, non-embedding 6.95B"; 0.6B
  "0.6B, non-embedding 0.44B"; 30B-A3B "30.5B in total and 3.3B activated"; 235B-A22B "235B in total and 22B
  activated". Gemma-2-9B: 9,241,705,984 (the Hugging Face model page's safetensors count). Mixtral-8x7B: "46.7B total
  parameters but only uses 12.9B parameters per token" (Mistral AI, "Mixtral of experts", 2023-12-11). DeepSeek-V3:
  "671B total parameters with 37B activated for each token" (arXiv 2412.19437, abstract); 685B on its Hugging Face
  page = 671B + the 14B MTP module (README_WEIGHTS.md), whose safetensors also count the FP8 scales. gpt-oss (model
  card, arXiv 2508.10925, table 1): 120b 116.83B total, 5.13B active; 20b 20.91B, 3.61B (active counts the
  unembedding, not the embedding). GLM-4.5-Air: "106 billion total parameters and 12 billion active parameters"
  (zai-org/GLM-4.5 README).
"""
from __future__ import annotations

import json

import pytest

from policies.errors import UserError, exit_on_user_error
from profiles.analytical import Deployment, Placement, main
from profiles.architectures import Architecture
from profiles.architectures.gqa import GQA
from profiles.architectures.mla import MLA
from profiles.architectures.moe import MoE
from profiles.architectures.sliding import held_tokens

B = 1e9


def arch(name: str) -> Architecture:
    return Architecture.from_config(name)


def embedding(a: Architecture) -> int:
    return a.vocab * a.hidden


# -- dense grouped-query attention: Qwen3 ---------------------------------------------------------------------------
def test_qwen3_dense_counts_its_per_head_qk_norms_and_untied_or_tied_embeddings():
    q8 = arch("qwen3-8b")
    assert q8.params == 8_190_735_360 and round(q8.params / B, 1) == 8.2
    assert round((q8.params - 2 * embedding(q8)) / B, 2) == 6.95  # non-embedding: less the embedding and LM head
    q06 = arch("qwen3-0.6b")  # tied: the embedding is the LM head
    assert round(q06.params / B, 1) == 0.6 and round((q06.params - embedding(q06)) / B, 2) == 0.44
    # head_dim 128 is not hidden / heads (1024 / 16): the q and o projections are wider than the hidden size
    assert q06.layers[0].attention == GQA(1024, 16, 8, 128, qk_norm=True)
    assert q8.kv_bytes_per_token(2) == 2 * 36 * 8 * 128 * 2


# -- sliding windows: Gemma-2 -------------------------------------------------------------------------------------
def test_gemma2_slides_its_even_layers_and_holds_four_norms_a_layer():
    g9 = arch("gemma-2-9b")
    assert g9.params == 9_241_705_984
    assert [layer.window for layer in g9.layers[:4]] == [4096, None, 4096, None]
    assert {layer.norms for layer in g9.layers} == {4} and g9.tied_embeddings
    # 21 sliding and 21 global layers of 2 x 8 KV heads x 256 x 2 bytes (architecture_notes.md sec. 1)
    assert g9.kv_groups(2) == {4096: 21 * 8192, None: 21 * 8192}
    assert g9.kv_bytes_per_token(2) == 344_064
    # a sequence of 32k tokens holds all of them in the global layers, its last 4095 (+ the new one) in the others
    held = sum(held_tokens(32768, 1, window) * size for window, size in g9.kv_groups(2).items())
    assert held == 21 * 8192 * (32768 + 4096)


def test_gpt_oss_slides_per_layer_types_over_128_tokens():
    g = arch("gpt-oss-120b")
    assert g.windows == (128,) and g.layers[0].window == 128 and g.layers[1].window is None
    assert g.kv_groups(2) == {128: 18 * 2048, None: 18 * 2048}  # 2 x 8 x 64 x 2 bytes a layer


# -- mixtures of experts --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.7, 12.9),      # active: with the embedding and LM head
    ("qwen3-30b-a3b", 30.5, 3.35),
    ("qwen3-235b-a22b", 235.1, 22.2),
    ("deepseek-v3", 671.0, 37.6),
])
def test_moe_models_hold_every_expert_and_compute_with_top_k(name, total, active):
    a = arch(name)
    assert a.params / B == pytest.approx(total, abs=0.05)
    assert a.active_params / B == pytest.approx(active, abs=0.05)


def test_gpt_oss_counts_match_its_model_card():
    for name, total, active in (("gpt-oss-120b", 116.83, 5.13), ("gpt-oss-20b", 20.91, 3.61)):
        a = arch(name)
        assert round(a.params / B, 2) == total
        assert round((a.active_params - embedding(a)) / B, 2) == active  # the card leaves out the embedding
    moe = arch("gpt-oss-120b").layers[0].ffn
    assert (moe.experts, moe.top_k, moe.expert_bias, moe.router_bias) == (128, 4, True, True)


def test_deepseek_v3_is_mla_three_dense_layers_then_moe_with_a_shared_expert():
    d = arch("deepseek-v3")
    assert [type(layer.ffn).__name__ for layer in d.layers[:4]] == ["GatedMLP", "GatedMLP", "GatedMLP", "MoE"]
    attention, moe = d.layers[3].attention, d.layers[3].ffn
    assert isinstance(attention, MLA) and attention.latent == 576
    assert moe == MoE(7168, 256, 8, 2048, shared_intermediate=2048, router_bias=True)
    assert d.mtp_layers == 1 and d.weights_label() == "fp8"  # its quantization_config: block FP8
    # the cache: one 576-wide latent per token and layer, not per head (architecture_notes.md sec. 2), on every
    # tensor-parallel device
    assert d.kv_bytes_per_token(2) == 61 * 576 * 2 == 70_272
    assert d.kv_bytes_per_token(2, tp=8) == 70_272


def test_deepseek_v3s_mtp_head_is_one_more_mla_moe_block_behind_its_projection():
    d = arch("deepseek-v3")
    mtp = Architecture.from_config("mtp", "--draft", d)
    assert mtp.layers == (d.layers[-1],) and mtp.weights_label() == "fp8"
    projection = 2 * 7168 * 7168
    assert mtp.params == d.layers[-1].params(7168) + projection + 7168
    # the checkpoint: 671B + the MTP module with its own copies of the embedding and output head = 685B (HF page)
    assert round((d.params + mtp.params + 2 * embedding(d)) / B) == 684  # 684.5B; the page's 685B counts FP8 scales
    assert mtp.kv_bytes_per_token(2) == 576 * 2


def test_glm4_moe_reads_qkv_biases_shared_experts_and_its_mtp_layer():
    """GLM-4.5-Air's published config is not shipped (profiles/models/SOURCES.md): its values as quoted there."""
    config = {"model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944,
              "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
              "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_attention_heads": 96,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151552, "attention_bias": True,
              "tie_word_embeddings": False, "num_nextn_predict_layers": 1}
    air = Architecture.from_dict(config, "glm-4.5-air", "test")
    assert round(air.params / B) == 107  # 106.85B; "106 billion"
    assert round((air.active_params - 2 * embedding(air)) / B) == 12  # "12 billion active", less embedding and head
    assert air.layers[0].attention.qkv_bias and not air.layers[0].attention.o_bias
    assert air.mtp_layers == 1 and air.kv_bytes_per_token(2) == 2 * 46 * 8 * 128 * 2


# -- refusals -------------------------------------------------------------------------------------------------------
def write(tmp_path, name: str, config: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000}


@pytest.mark.parametrize("extra, key", [
    ({"num_local_experts": 8}, "num_local_experts 8 is not read for model_type 'llama'"),
    ({"num_experts": 8}, "num_experts 8 is not read"),
    ({"sliding_window": 4096}, "sliding_window 4096 is not read"),
    ({"kv_lora_rank": 512}, "kv_lora_rank 512 is not read"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config.quant_method 'awq' is not "
                                                                  "modelled"),
])
def test_a_key_that_changes_the_cost_but_is_not_read_is_refused_in_one_line(tmp_path, extra, key):
    with pytest.raises(UserError) as err:
        Architecture.from_config(write(tmp_path, "odd", {**LLAMA, **extra}), "--target")
    assert key in str(err.value) and "\n" not in str(err.value)


def test_keys_set_to_nothing_are_no_cost():
    """null, false and empty values say "none" (Qwen3's sliding_window null, EAGLE-3 heads' use_sliding_window), and
    so do layer_types of full attention only."""
    plain = Architecture.from_dict(LLAMA, "a", "t")
    assert Architecture.from_dict({**LLAMA, "sliding_window": None, "use_sliding_window": False, "mlp_only_layers": [],
                                   "layer_types": ["full_attention"] * 2}, "a", "t").params == plain.params
    with pytest.raises(UserError, match="layer_types .* is not read for model_type 'llama'"):
        Architecture.from_dict({**LLAMA, "layer_types": ["sliding_attention", "full_attention"]}, "a", "t")


def test_an_unknown_model_type_is_one_line_naming_the_supported_ones_exit_2(tmp_path, capsys):
    path = write(tmp_path, "falcon", {**LLAMA, "model_type": "falcon"})
    with pytest.raises(SystemExit) as stop:
        exit_on_user_error(main, ["--gpu", "h200", "--target", path, "--out", str(tmp_path / "p.csv")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("supported: llama, qwen2, qwen3, gemma2, mixtral, qwen3_moe, deepseek_v3, glm4_moe, gpt_oss")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("target, tp, message", [
    ("qwen3-8b", 3, "total number of attention heads (32) must be divisible by tensor parallel size (3)"),
    ("llama-3.1-70b", 16, None),  # 64 heads split 16 ways; 8 KV heads replicated twice
    ("gemma-2-2b", 8, None),      # 8 heads, 4 KV heads replicated
    ("mixtral-8x7b", 8, None),
])
def test_tensor_parallel_degrees_are_those_vllm_accepts(target, tp, message):
    dep = Deployment("h200", target, "llama-68m" if "llama" in target else target, tp)
    if message is None:
        Placement.of(dep)
    else:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Placement.of(dep)


def test_replicated_kv_heads_hold_their_cache_on_every_device():
    """Qwen3-30B-A3B has 4 KV heads: at tp 8 each device holds one, replicated twice (vLLM's QKVParallelLinear)."""
    q = arch("qwen3-30b-a3b")
    assert q.kv_bytes_per_token(2, tp=4) == q.kv_bytes_per_token(2) // 4
    assert q.kv_bytes_per_token(2, tp=8) == q.kv_bytes_per_token(2) // 4  # not // 8
    att = q.layers[0].attention
    kv_projection = 2 * 2048 * 4 * 128
    assert att.device_params(8) == att.params / 8 + kv_projection / 8  # its K/V projection twice over


def test_expert_parallelism_needs_experts_and_spans_the_tensor_parallel_devices():
    with pytest.raises(UserError, match="--ep: must be 1 or the tensor-parallel degree 8"):
        Deployment("h200", "deepseek-v3", "mtp", 8, ep=4)
    with pytest.raises(UserError, match="--ep 8: llama-3.1-70b has no experts to spread"):
        Placement.of(Deployment("h200", "llama-3.1-70b", "llama-3.2-1b", 8, ep=8))
    Placement.of(Deployment("h200", "deepseek-v3", "mtp", 8, ep=8))
