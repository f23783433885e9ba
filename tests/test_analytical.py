"""The roofline profiles: hand-computed points, monotonicity, memory fit, and the shipped files."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from profiles.analytical import (DATA_DIR, DEPLOYMENTS, GPUS, Architecture, Deployment, Efficiency,
                                 analytical_profile, fit_efficiency, kv_fits, pass_cost, read_model_config, write_all)
from profiles.grid import GPU_GRID
from simulator.costs.cost_model import load_cost_model
from policies.errors import UserError
from simulator.costs.profile_table import read_profile

LLAMA_7B = Architecture.from_config("llama-2-7b")
LLAMA_70B = Architecture.from_config("llama-3.1-70b")
H100 = GPUS["h100-80gb"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSIM_CACHE_DIR", str(tmp_path / "cache"))


def test_parameter_counts_match_the_published_model_sizes():
    # Llama-2-7B: 6.74 B parameters, 32 layers x 32 KV heads x 128 dims -> 512 KiB of bf16 KV per token.
    assert LLAMA_7B.params == 6_738_415_616
    assert LLAMA_7B.kv_bytes_per_token(2) == 2 * 32 * 32 * 128 * 2 == 524_288
    # Llama-3.1-70B: 70.6 B parameters, grouped-query attention with 8 KV heads.
    assert LLAMA_70B.params == 70_553_706_496
    assert LLAMA_70B.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2
    assert Architecture.from_config("llama-3.2-1b").params == 1_235_814_400  # tied embeddings counted once
    assert Architecture.from_config("qwen2.5-7b").params == 7_615_616_512  # with q/k/v biases


#: Round efficiencies for hand computations (the formula, not the fitted factors, is under test here).
ROUND = Efficiency(compute=0.8, bandwidth=0.9, overhead_fixed_s=3e-4, overhead_per_layer_s=1e-5)


def test_7b_decode_at_batch_1_is_bandwidth_bound_at_weights_over_bandwidth():
    cost = pass_cost(LLAMA_7B, H100, "decode", batch_size=1, query_len=1, context_len=128, eff=ROUND)
    # Hand computation: 32 layers x 202,383,360 projection weights x 2 bytes, read once at 0.9 x 3.35 TB/s.
    weights_s = 32 * 202_375_168 * 2 / (0.9 * 3.35e12)
    assert weights_s == pytest.approx(4.295e-3, rel=1e-3)
    assert cost.linear_s == pytest.approx(weights_s, rel=0.01)  # + a few KB of activations
    assert cost.overhead_s == pytest.approx(3e-4 + 32 * 1e-5)
    assert cost.comm_s == 0.0
    assert cost.seconds == pytest.approx(5.03e-3, rel=0.01)


def test_7b_prefill_of_16k_tokens_is_compute_bound_at_2_flops_per_weight_and_token():
    cost = pass_cost(LLAMA_7B, H100, "prefill", batch_size=4, query_len=4096, context_len=0, eff=ROUND)
    assert cost.linear_s == pytest.approx(2 * 16384 * 32 * 202_375_168 / (0.8 * 989e12), rel=1e-9)
    # causal attention: 4 x heads x head_dim x P (P + 1) / 2 FLOPs per sequence and layer
    attention_flops = 32 * 4 * 4 * 4096 * (4096 + 1) / 2 * 32 * 128
    assert cost.attention_s == pytest.approx(attention_flops / (0.8 * 989e12), rel=1e-9)


def test_tensor_parallel_adds_two_all_reduces_per_layer_and_splits_the_weights():
    one, four = (pass_cost(LLAMA_70B, H100, "decode", 8, 1, 1024, tp=tp) for tp in (1, 4))
    assert four.linear_s == pytest.approx(one.linear_s / 4, rel=0.01)
    link = 450e9 * 0.75
    all_reduce = 10e-6 + 2 * 3 / 4 * 8 * 8192 * 2 / link
    gather = 10e-6 + 3 / 4 * 8 * 128_256 * 2 / link
    assert four.comm_s == pytest.approx(2 * 80 * all_reduce + gather)
    assert one.comm_s == 0.0


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("arch", [LLAMA_7B, LLAMA_70B], ids=["7b", "70b"])
def test_seconds_grow_with_batch_context_and_query_length(gpu, arch):
    def t(b, q, c, phase="decode"):
        return pass_cost(arch, GPUS[gpu], phase, b, q, c, tp=4 if arch is LLAMA_70B else 1).seconds

    batches, contexts = GPU_GRID.batch_sizes, GPU_GRID.context_lens
    for c in contexts:
        for q in GPU_GRID.query_lens:
            times = [t(b, q, c) for b in batches]
            assert times == sorted(times)
    for b in batches:
        times = [t(b, 5, c) for c in contexts]
        assert times == sorted(times)
        times = [t(b, q, 1024) for q in GPU_GRID.query_lens]
        assert times == sorted(times)
        times = [t(b, p, 0, "prefill") for p in GPU_GRID.prefill_lens]
        assert times == sorted(times)


def test_kv_fit_leaves_out_what_exceeds_the_memory():
    draft = Architecture.from_config("llama-68m")
    a100 = GPUS["a100-80gb"]
    assert kv_fits(LLAMA_7B, draft, a100, tp=1, tokens=128 * 128)
    # 256 x 4096 tokens x 518 KiB = 530 GB of KV: no 80 GB GPU holds that
    assert not kv_fits(LLAMA_7B, draft, a100, tp=1, tokens=256 * 4096)
    # 141 GB of 70B weights fit neither one 80 GB GPU nor one H200; they fit 4 x 80 GB and 2 x 141 GB
    big_draft = Architecture.from_config("llama-3.2-1b")
    assert not kv_fits(LLAMA_70B, big_draft, a100, tp=1, tokens=1)
    assert not kv_fits(LLAMA_70B, big_draft, GPUS["h200"], tp=1, tokens=1)
    assert kv_fits(LLAMA_70B, big_draft, a100, tp=4, tokens=1)
    assert kv_fits(LLAMA_70B, big_draft, GPUS["h200"], tp=2, tokens=1)


def test_profile_rows_are_the_grid_points_that_fit():
    dep = next(d for d in DEPLOYMENTS if d.gpu_key == "a100-80gb" and d.target == "llama-2-7b")
    frame, meta = analytical_profile(dep, GPU_GRID)
    points = GPU_GRID.points()
    assert len(frame) + meta["points_left_out"] == len(points)
    left_out = {p.key for p in points} - set(frame[["role", "phase", "batch_size", "query_len", "context_len"]]
                                              .itertuples(index=False, name=None))
    assert ("target", "decode", 256, 1, 4096) in left_out
    assert ("target", "decode", 1, 9, 4096) not in left_out
    assert meta["method"] == "analytical" and meta["efficiency"] == Efficiency().record()
    assert meta["target"]["weights"] == meta["draft"]["weights"] == "bf16"


def test_weight_only_precision_shrinks_weight_reads_and_memory_not_compute():
    """int4 projection weights: a quarter of bf16's bytes, so a memory-bound decode pass reads about a quarter
    of the weights, a compute-bound prefill costs the same, and the KV cache gets the memory freed."""
    bf16, int4 = (pass_cost(LLAMA_7B, H100, "decode", 1, 1, 128, eff=ROUND, weight_bytes=w) for w in (2.0, 0.5))
    assert int4.linear_s == pytest.approx(bf16.linear_s / 4, rel=0.01)
    assert int4.lm_head_s == bf16.lm_head_s  # the LM head stays bf16
    big = [pass_cost(LLAMA_7B, H100, "prefill", 4, 4096, 0, eff=ROUND, weight_bytes=w).linear_s for w in (2.0, 0.5)]
    assert big[0] == big[1]
    linear = LLAMA_7B.num_layers * LLAMA_7B.layer_linear_params
    assert LLAMA_7B.weight_bytes(2, 0.5) == LLAMA_7B.weight_bytes(2) - 1.5 * linear
    dep = Deployment("h100-80gb", "llama-2-7b", "llama-68m", 1, weights="int4")
    assert dep.stem == "h100-80gb-analytical-int4__llama-2-7b__llama-68m"
    frame4, meta4 = analytical_profile(dep, GPU_GRID)
    frame16, meta16 = analytical_profile(Deployment("h100-80gb", "llama-2-7b", "llama-68m", 1), GPU_GRID)
    assert meta4["memory"]["target_weight_gb"] < meta16["memory"]["target_weight_gb"] / 3
    assert meta4["points_left_out"] <= meta16["points_left_out"]
    with pytest.raises(UserError, match="--weights: must be one of bf16, fp8, int8, int4"):
        Deployment("h100-80gb", "llama-2-7b", "llama-68m", 1, weights="int3")


def test_the_efficiency_fit_recovers_the_factors_that_made_the_passes():
    """Passes priced with known factors are fitted back to them (the fit that calibrates the shipped defaults
    to the measured H200 profiles)."""
    truth = Efficiency(compute=0.55, bandwidth=0.7, overhead_fixed_s=1.2e-4, overhead_per_layer_s=5e-5)
    rows = [{"role": role, "phase": phase, "batch_size": b, "query_len": q, "context_len": c,
             "seconds": pass_cost(Architecture.from_config(name), GPUS["h200"], phase, b, q, c, eff=truth).seconds}
            for role, name in (("target", "llama-2-7b"), ("draft", "llama-68m"))
            for phase, b, q, c in (("decode", 1, 1, 128), ("decode", 64, 4, 1024), ("decode", 8, 1, 4096),
                                   ("prefill", 1, 512, 0), ("prefill", 4, 2048, 0))]
    fitted = fit_efficiency([("llama-2-7b", "llama-68m", pd.DataFrame(rows))])
    for name in ("compute", "bandwidth", "overhead_fixed_s", "overhead_per_layer_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name


def test_shipped_files_are_what_the_generator_writes(tmp_path):
    written = write_all(tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{d.stem}.csv" for d in DEPLOYMENTS)
    for path in written:
        shipped = DATA_DIR / path.name
        assert shipped.read_text() == path.read_text(), f"{shipped} is stale: python -m profiles.analytical"
        meta = shipped.with_name(path.stem + ".meta.json")
        assert meta.read_text() == path.with_name(path.stem + ".meta.json").read_text()


@pytest.mark.parametrize("dep", DEPLOYMENTS, ids=lambda d: d.stem)
def test_shipped_files_load_with_the_cost_model(dep):
    path = DATA_DIR / f"{dep.stem}.csv"
    table = read_profile(path)
    assert table.method == "analytical"
    assert table.memory.device_memory_gb == pytest.approx(GPUS[dep.gpu_key].memory_gib * dep.tp)
    for fitter in ("linear", "interp"):
        model = load_cost_model(path, fitter)
        assert model.target_time(4, 4 * 5, 4 * 1000) > model.target_time(1, 1, 1000) > 0
        assert model.draft_time(4, 4 * 1000) > 0
        assert model.prefill_time(2, 2 * 1000) > 0


def test_model_config_errors_are_one_line(tmp_path):
    not_json = tmp_path / "weights.bin"
    not_json.write_bytes(b"\x00\x01 binary")
    random_json = tmp_path / "random.json"
    random_json.write_text(json.dumps({"colour": "blue"}))
    encoder = tmp_path / "bert.json"
    encoder.write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    no_layers = tmp_path / "no_layers.json"
    no_layers.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    cases = {
        str(tmp_path / "missing.json"): "--target: no model config file or shipped model named",
        str(not_json): f"{not_json}: not a JSON model config",
        str(random_json): f"{random_json}: not a model config: model_type missing",
        str(encoder): f"{encoder}: model_type is an unknown architecture (got 'bert'); supported: llama, qwen2",
        str(no_layers): f"{no_layers}: num_hidden_layers missing",
    }
    for spec, message in cases.items():
        with pytest.raises(UserError) as err:
            Architecture.from_config(spec, "--target")
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert read_model_config("llama-68m", "--draft")[1]["hidden_size"] == 768
    assert Path(read_model_config("llama-68m", "--draft")[0]).name == "llama-68m.json"


def test_a_draft_catch_up_pass_computes_only_each_sequences_last_logits():
    """A draft pass feeding 2 tokens per sequence (the catch-up) reads the same weights and computes the LM head for
    each sequence's last token only, unlike a verification of 2 tokens; with 1 token per sequence they are one pass."""
    arch, gpu = Architecture.from_config("llama-68m"), GPUS["h200"]
    one = pass_cost(arch, gpu, "decode", 8, 1, 512)
    assert pass_cost(arch, gpu, "decode", 8, 1, 512, all_logits=False).seconds == one.seconds
    catch_up = pass_cost(arch, gpu, "decode", 8, 2, 512, all_logits=False)
    verify = pass_cost(arch, gpu, "decode", 8, 2, 512)
    assert catch_up.lm_head_s == pytest.approx(one.lm_head_s, rel=0.01)  # only the inputs' read is larger
    assert catch_up.lm_head_s < verify.lm_head_s and catch_up.linear_s == verify.linear_s
