"""The roofline profiles: hand-computed points, monotonicity, memory fit, and the shipped files."""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pandas as pd
import pytest

from profiles.analytical import (DATA_DIR, DEPLOYMENTS, GPUS, Architecture, Deployment, Efficiency, Placement,
                                 analytical_profile, fit_efficiency, kv_fits, pass_cost, write_all)
from profiles.grid import GPU_GRID
from profiles.models.config import read_model_config
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
    a100 = GPUS["a100-80gb"]
    pair = Placement.of(Deployment("a100-80gb", "llama-2-7b", "llama-68m", 1))
    assert kv_fits(pair, a100, batch_size=128, seq_tokens=128)
    # 256 x 4096 tokens x 518 KiB = 530 GB of KV: no 80 GB GPU holds that
    assert not kv_fits(pair, a100, batch_size=256, seq_tokens=4096)
    # 141 GB of 70B weights fit neither one 80 GB GPU nor one H200; they fit 4 x 80 GB and 2 x 141 GB
    big = {tp: Placement.of(Deployment("a100-80gb", "llama-3.1-70b", "llama-3.2-1b", tp)) for tp in (1, 2, 4)}
    assert not kv_fits(big[1], a100, 1, 1)
    assert not kv_fits(big[1], GPUS["h200"], 1, 1)
    assert kv_fits(big[4], a100, 1, 1)
    assert kv_fits(big[2], GPUS["h200"], 1, 1)


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
    bf16, int4 = (pass_cost(LLAMA_7B, H100, "decode", 1, 1, 128, eff=ROUND, weights=w) for w in ("bf16", "int4"))
    assert int4.linear_s == pytest.approx(bf16.linear_s / 4, rel=0.01)
    assert int4.lm_head_s == bf16.lm_head_s  # the LM head stays bf16
    big = [pass_cost(LLAMA_7B, H100, "prefill", 4, 4096, 0, eff=ROUND, weights=w).linear_s for w in ("bf16", "int4")]
    assert big[0] == big[1]
    linear = 32 * 202_375_168  # the projections' weights
    assert LLAMA_7B.weight_bytes(2, "int4") == LLAMA_7B.weight_bytes(2) - 1.5 * linear
    dep = Deployment("h100-80gb", "llama-2-7b", "llama-68m", 1, weights="int4")
    assert dep.stem == "h100-80gb-analytical-int4__llama-2-7b__llama-68m"
    frame4, meta4 = analytical_profile(dep, GPU_GRID)
    frame16, meta16 = analytical_profile(Deployment("h100-80gb", "llama-2-7b", "llama-68m", 1), GPU_GRID)
    assert meta4["memory"]["target_weight_gb"] < meta16["memory"]["target_weight_gb"] / 3
    assert meta4["points_left_out"] <= meta16["points_left_out"]
    with pytest.raises(UserError, match="--weights: must be one of auto, bf16, fp8, int8, int4, mxfp4, nvfp4"):
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
        str(encoder): f"{encoder}: model_type is an unknown architecture (got 'bert'); supported: llama, qwen2, "
                      "qwen3, gemma2, mixtral, qwen3_moe, deepseek_v3, glm4_moe, gpt_oss",
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


# -- GPUs, weight precision and the command line (issue 31) ----------------------------------------------------------
def test_the_gpus_are_gpus_csv_rows_with_their_sources():
    import csv

    from profiles.analytical import FITTED_BF16_FLOPS, GPUS_CSV

    rows = {row["key"]: row for row in csv.DictReader(GPUS_CSV.open())}
    assert sorted(GPUS) == sorted(rows) and {"b200", "gb200", "mi300x", "mi325x", "l40s", "h20"} <= set(GPUS)
    for key, gpu in GPUS.items():
        row = rows[key]
        assert gpu.peak_flops == FITTED_BF16_FLOPS.get(key, float(row["bf16_dense_flops"]))
        assert gpu.memory_gib == float(row["memory_gib_driver"] or row["memory_gib"])  # the driver's where known
        assert row["source"] in gpu.source
    assert GPUS["b200"].formats == {"fp8", "fp4"} and GPUS["mi300x"].formats == {"fp8"}
    assert not GPUS["a100-80gb"].formats
    # the rates the shipped profiles were made with: 989 TFLOPS, 81559 and 143771 MiB
    assert (GPUS["h100-80gb"].memory_gib, GPUS["h200"].memory_gib) == (81559 / 1024, 143771 / 1024)
    with pytest.raises(UserError, match="--gpu: must be one of a100-80gb, h100-80gb, h200, b200, gb200, mi300x, "
                                        "mi325x, l40s, h20"):
        Deployment("tpu-v5", "llama-2-7b", "llama-68m", 1)


def test_each_precision_is_read_at_its_bytes_and_computed_where_the_gpu_can():
    from profiles.architectures.precision import WEIGHT_BYTES, compute_format

    assert WEIGHT_BYTES["mxfp4"] == (32 * 4 + 8) / 32 / 8  # 32 E2M1 values and one E8M0 scale
    assert WEIGHT_BYTES["nvfp4"] == (16 * 4 + 8) / 16 / 8  # 16 E2M1 values and one E4M3 scale
    table = {(p, g): compute_format(p, GPUS[g].formats) for p in ("fp8", "nvfp4", "mxfp4", "int4")
             for g in ("a100-80gb", "h200", "b200", "mi300x")}
    assert table == {("fp8", "a100-80gb"): "bf16", ("fp8", "h200"): "fp8", ("fp8", "b200"): "fp8",
                     ("fp8", "mi300x"): "fp8", ("nvfp4", "a100-80gb"): "bf16", ("nvfp4", "h200"): "bf16",
                     ("nvfp4", "b200"): "fp4", ("nvfp4", "mi300x"): "bf16", ("mxfp4", "a100-80gb"): "bf16",
                     ("mxfp4", "h200"): "bf16", ("mxfp4", "b200"): "fp8", ("mxfp4", "mi300x"): "bf16",
                     ("int4", "a100-80gb"): "bf16", ("int4", "h200"): "bf16", ("int4", "b200"): "bf16",
                     ("int4", "mi300x"): "bf16"}
    # a compute-bound 7B prefill at nvfp4: a quarter of the bf16 time on a B200's FP4 tensor cores, the same on an H200
    b200, h200 = GPUS["b200"], GPUS["h200"]
    for gpu, ratio in ((b200, 4.0), (h200, 1.0)):
        dense, fp4 = (pass_cost(LLAMA_7B, gpu, "prefill", 4, 4096, 0, eff=ROUND, weights=w).linear_s
                      for w in ("bf16", "nvfp4"))
        assert dense / fp4 == pytest.approx(ratio, rel=1e-9)


def test_a_checkpoints_own_precision_is_its_quantization_config():
    gpt = Architecture.from_config("gpt-oss-120b")
    assert gpt.precisions()["experts"] == "mxfp4" and gpt.precisions()["attention"] == "bf16"
    # 3 x 2,880^2 x 128 x 36 = 114.7 G expert weights at 4.25 bits: 60.9 GB (architecture_notes.md sec. 4)
    experts = sum(layer.ffn.experts * layer.ffn.expert_params for layer in gpt.layers)
    assert experts * 0.53125 / 1e9 == pytest.approx(60.9, abs=0.05)
    assert gpt.weight_bytes(2) == pytest.approx(experts * 0.53125 + (gpt.params - experts) * 2)
    assert gpt.weights_label() == "experts mxfp4" and gpt.weights_label("bf16") == "bf16"
    assert Deployment("b200", "gpt-oss-120b", "gpt-oss-20b", 1).stem == \
        "b200-analytical-mxfp4-draft-mxfp4__gpt-oss-120b__gpt-oss-20b"


def test_the_command_line_speaks_vllms_parallel_flag_names(tmp_path):
    from profiles.analytical import main

    out = tmp_path / "ds.csv"
    assert main(["--gpu", "h200", "--tensor-parallel-size", "8", "--enable-expert-parallel", "--target", "deepseek-v3",
                 "--draft", "mtp", "--routing-gini", "0.2", "--out", str(out)]) == 0
    meta = json.loads(out.with_name("ds.meta.json").read_text())
    assert (meta["target"]["tensor_parallel"], meta["target"]["expert_parallel"]) == (8, 8)
    assert meta["draft"]["expert_parallel"] == 8  # the MTP head's experts too: it runs in the target's group
    assert meta["routing"]["routing_gini"] == 0.2 and "arXiv 2605.20982" in meta["routing"]["source"]
    assert meta["target"]["weights"] == "fp8" and "gpus.csv" in meta["gpu"]["source"]
    assert Deployment("h200", "deepseek-v3", "mtp", 8, ep=8, routing_gini=0.2).stem == \
        "h200x8-analytical-fp8-draft-fp8-ep8-gini0.2__deepseek-v3__mtp"
    with pytest.raises(UserError, match="--enable-expert-parallel: spreads the experts over the --tp 8 GPUs"):
        main(["--gpu", "h200", "--tp", "8", "--ep", "4", "--enable-expert-parallel", "--target", "deepseek-v3",
              "--draft", "mtp", "--out", str(out)])


def test_a_sliding_window_profile_writes_the_windowed_share_of_its_kv():
    frame, meta = analytical_profile(Deployment("h100-80gb", "gemma-2-9b", "gemma-2-2b", 1), GPU_GRID)
    memory = meta["memory"]
    assert (memory["target_kv_bytes_per_token"], memory["target_sliding_kv_bytes_per_token"]) == (344_064, 172_032)
    assert (memory["draft_sliding_kv_bytes_per_token"], memory["draft_sliding_window"]) == (53_248, 4096)
    assert meta["target"]["sliding_windows"] == [4096]
    # decode attention reads each layer's cache (context + 2 tokens a sequence): at 16k tokens the global half of the
    # layers reads 16,386, the sliding half its window's 4,095 + 2; at 2k both read 2,050
    gemma = Architecture.from_config("gemma-2-9b")
    short, long = (pass_cost(gemma, H100, "decode", 8, 1, c).attention_s for c in (2048, 16384))
    assert long / short == pytest.approx((16386 + 4097) / (2 * 2050), rel=1e-12)


def test_an_mla_models_cache_is_on_every_tensor_parallel_device():
    _, meta = analytical_profile(Deployment("h200", "deepseek-v3", "mtp", 8), replace(GPU_GRID, batch_sizes=(1,)))
    assert meta["memory"]["target_kv_bytes_per_token"] == 8 * 61 * 576 * 2  # one latent per device, 8 devices
    assert meta["memory"]["draft_kv_bytes_per_token"] == 8 * 576 * 2
# -- the draft a target is paired with ---------------------------------------------------------------------------
def test_a_draft_model_must_share_the_targets_vocabulary_and_each_target_has_its_default():
    from profiles.analytical import DEFAULT_DRAFTS, draft_for

    assert draft_for("llama-3.1-8b", None) == "llama-3.2-1b" and draft_for("llama-2-7b", None) == "llama-68m"
    assert all(draft_for(target, draft) == draft for target, draft in DEFAULT_DRAFTS.items())
    assert draft_for("llama-3.1-8b", "eagle3-llama-3.1-8b") == "eagle3-llama-3.1-8b"  # a head: checked where priced
    with pytest.raises(UserError, match=r"^--draft llama-68m: its vocabulary of 32000 tokens is not the target "
                                        r"llama-3.1-8b's 128256: .* \(the default for llama-3.1-8b: llama-3.2-1b\)$"):
        draft_for("llama-3.1-8b", "llama-68m")
    with pytest.raises(UserError, match=r"^--draft: --target qwen2.5-7b has no default draft"):
        draft_for("qwen2.5-7b", None)
    with pytest.raises(UserError, match="152064"):  # Qwen2.5-0.5B's 151,936 tokens: vLLM refuses the pair
        draft_for("qwen2.5-7b", "qwen2.5-0.5b")


def test_every_shipped_profile_is_a_pair_the_rule_allows():
    """Every shipped profile's target and draft (as its metadata records them) pass the vocabulary rule, so each
    stays regenerable as it is."""
    from profiles.analytical import draft_for

    for meta_file in sorted(DATA_DIR.glob("*.meta.json")):
        meta = json.loads(meta_file.read_text())
        target, draft = meta.get("target"), meta.get("draft")
        if isinstance(target, dict) and isinstance(draft, dict) and draft.get("config"):  # None: no drafter
            assert draft_for(target["config"], draft["config"]) == draft["config"], meta_file.name


def test_the_command_line_pairs_a_target_with_its_default_draft(tmp_path, capsys):
    from profiles.analytical import main

    out = tmp_path / "p.csv"
    assert main(["--gpu", "h200", "--target", "llama-3.1-8b", "--out", str(out)]) == 0
    assert json.loads(out.with_name("p.meta.json").read_text())["draft"]["config"] == "llama-3.2-1b"
    with pytest.raises(UserError, match="unrecognized arguments: --draf"):  # no abbreviations
        main(["--gpu", "h200", "--draf", "llama-68m"])
