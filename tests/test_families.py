"""The model families the torch side builds beyond Llama (Gemma-2, Qwen3, Mixtral, Qwen3-MoE;
``profiles/models/families.py``), on random-weight models reduced to a few small layers: transformers' own classes
and caches, the optimized path against the eager one, lossless speculation in the real engine (the reduced MoE pair
too), the profiler on both paths, the reduced configs, what is refused, and the MoE layer's time against the
experts its tokens wake."""
from __future__ import annotations

import json
import random
import time

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from policies.errors import UserError  # noqa: E402
from policies.registry import make_policy  # noqa: E402
from policies.tree import TreeFamily, TreeShape  # noqa: E402
from profiles.grid import Grid  # noqa: E402
from profiles.models import forward  # noqa: E402
from profiles.models.config import MODELS_DIR  # noqa: E402
from profiles.models.families import MODEL_TYPES, read_family_config, reduce  # noqa: E402
from profiles.models.optimized import SlotCache, attention_width, last_columns, slot_pass  # noqa: E402
from profiles.models.pairs import load_pair  # noqa: E402
from profiles.profiler import ProfileSettings, TimingPolicy, run_profile  # noqa: E402
from profiles.serving.engine import RealEngineConfig, RealEngine  # noqa: E402
from simulator.inputs.workload import Workload  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_thread")]
CPU = torch.device("cpu")
#: Every test model: 3 layers of width 64, 4 heads over 2 KV heads of 16, a 500-token vocabulary.
SMALL = dict(layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=500)
#: Per family, the published config reduced, and what more (Gemma-2: a window of 8 tokens, so that contexts pass it;
#: the MoE families: a few experts).
FAMILIES = {"gemma2": ("gemma-2-2b", dict(sliding_window=8)), "qwen3": ("qwen3-0.6b", {}),
            "mixtral": ("mixtral-8x7b", dict(experts=4, top_k=2)),
            "qwen3_moe": ("qwen3-30b-a3b", dict(experts=8, top_k=2, expert_width=32))}
#: Gemma-2's caps made small enough to bite on a random model's small scores and logits.
CAPS = {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 0.5}
TREE = TreeFamily(TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
                  ((0.6, 0.2, 0.1), (0.5, 0.2, 0.1)))


def small_config(model_type: str, **more) -> dict:
    """The family's published config reduced to :data:`SMALL` (Gemma-2 with :data:`CAPS`)."""
    spec, extra = FAMILIES[model_type]
    path, data = read_family_config(spec, "test")
    out = reduce(data, path.stem, **SMALL, **extra, **more)
    return {**out, **CAPS} if model_type == "gemma2" else out


def small_model(model_type: str, seed: int = 0, **more):
    return forward.build_model(forward.hf_config(small_config(model_type, **more), model_type), "fp32", CPU, seed)


@pytest.fixture(scope="module")
def models():
    return {t: small_model(t) for t in FAMILIES}


# -- configs ------------------------------------------------------------------------------------------
def test_reduce_keeps_the_familys_structure_and_records_where_it_came_from():
    path, data = read_family_config("qwen3-30b-a3b", "test")
    out = reduce(data, path.stem, layers=2, experts=8, top_k=2, expert_width=32, vocab=1000)
    assert (out["num_hidden_layers"], out["num_experts"], out["num_experts_per_tok"], out["moe_intermediate_size"],
            out["vocab_size"]) == (2, 8, 2, 32, 1000)
    assert out["norm_topk_prob"] and out["decoder_sparse_step"] == 1 and out["max_window_layers"] == 2
    assert (out["bos_token_id"], out["eos_token_id"]) == (None, None)  # 151643, 151645: past the new vocabulary
    assert out["specsim_reduced_from"] == {"config": "qwen3-30b-a3b", "sizes": dict(layers=2, experts=8, top_k=2,
                                                                                    expert_width=32, vocab=1000)}
    gemma = reduce(read_family_config("gemma-2-2b", "t")[1], "gemma-2-2b", head_dim=64, vocab=500)
    assert gemma["query_pre_attn_scalar"] == 64 and gemma["eos_token_id"] == [1, 107]  # 256 x 64 / 256
    mixtral = reduce(read_family_config("mixtral-8x7b", "t")[1], "mixtral-8x7b", expert_width=128)
    assert mixtral["intermediate_size"] == 128  # Mixtral's experts are intermediate_size wide
    for spec, sizes, message in [
            ("qwen3-0.6b", dict(experts=4), "--experts: qwen3 is a dense family (no experts)"),
            ("mixtral-8x7b", dict(experts=1), "--experts: 1 experts are fewer than the 2 each token picks (--top-k)"),
            ("llama-2-7b", dict(heads=6), "--heads: 6 attention heads are not a multiple of 32 KV heads"),
            ("qwen3-0.6b", dict(sliding_window=8), "--sliding-window: qwen3-0.6b has no sliding-window layers"),
            ("qwen3-0.6b", dict(layers=0), "--layers: must be a positive integer (got 0)")]:
        with pytest.raises(UserError) as err:
            reduce(read_family_config(spec, "t")[1], spec, **sizes)
        assert str(err.value) == message


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-cpu", "qwen3-0.6b-cpu"])
def test_the_shipped_reduced_configs_are_their_sources_reduced(name):
    shipped = json.loads((MODELS_DIR / f"{name}.json").read_text())
    source = shipped["specsim_reduced_from"]
    assert shipped == reduce(read_family_config(source["config"], "t")[1], source["config"], **source["sizes"])


def test_other_model_types_are_refused_in_one_line():
    for spec, model_type in [("deepseek-v3", "deepseek_v3"), ("gpt-oss-20b", "gpt_oss")]:
        with pytest.raises(UserError) as err:
            forward.load_config(spec, "--target")
        assert str(err.value) == (f"--target: {MODELS_DIR / spec}.json: model_type {model_type!r} is priced by the "
                                  f"roofline (python -m profiles.analytical) but not built here; built here: "
                                  f"{', '.join(MODEL_TYPES)}")
    with pytest.raises(UserError, match=r"^mixtral: sliding_window 4096 without sliding layer_types \(a window on "
                                        r"every layer of a mixtral model\) is not supported$"):
        forward.hf_config({**small_config("mixtral"), "sliding_window": 4096}, "mixtral")


# -- models and caches (eager: transformers as it is) --------------------------------------------------
def test_each_family_is_transformers_own_class_with_its_own_cache(models):
    assert {t: type(m).__name__ for t, m in models.items()} == {
        "gemma2": "Gemma2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM"}
    assert {t: m.config._attn_implementation for t, m in models.items()} == {
        "gemma2": "eager", "qwen3": "sdpa", "mixtral": "sdpa", "qwen3_moe": "sdpa"}  # SDPA cannot soft-cap
    assert {t: m.config._experts_implementation for t, m in models.items() if "moe" in t or t == "mixtral"} == {
        "mixtral": "grouped_mm", "qwen3_moe": "grouped_mm"}
    layers = [type(layer).__name__ for layer in forward.new_cache(models["gemma2"]).layers]
    assert layers == ["DynamicSlidingWindowLayer", "DynamicLayer", "DynamicSlidingWindowLayer"]  # local, global, ...
    assert {type(layer).__name__ for layer in forward.new_cache(models["gemma2"], whole=True).layers} == {"DynamicLayer"}
    for model_type, model in models.items():
        config = forward.hf_config(small_config(model_type), model_type)
        assert sum(p.numel() for p in model.parameters()) == forward.parameter_count(config)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_greedy_decode_over_the_cache_is_the_models_full_recompute(models, model_type):
    """Prefill, then one token a pass over transformers' cache (Gemma-2's sliding layers keep 7 of the 30 tokens)
    picks, and scores, what the whole sequence recomputed at once does; cropping a pass off restores the cache."""
    model = models[model_type]
    generator = torch.Generator().manual_seed(1)
    prompt = forward.random_tokens(model, 2, 12, generator)
    logits, cache = forward.prefill_pass(model, prompt)
    tokens, steps = prompt, [logits[:, -1]]
    for _ in range(18):
        tokens = torch.cat([tokens, steps[-1].argmax(dim=-1, keepdim=True)], dim=1)
        steps.append(forward.decode_pass(model, cache, tokens[:, -1:])[:, -1])
    with torch.inference_mode():
        whole = model(input_ids=tokens).logits                                 # (2, 30, vocab)
    torch.testing.assert_close(torch.stack(steps, dim=1), whole[:, 11:], rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == 30 and whole.shape == (2, 30, 500)
    if model_type == "gemma2":
        assert float(whole.abs().max()) < 0.5  # the final soft-cap bites
    again = forward.decode_pass(model, cache, tokens[:, -3:])
    forward.crop(cache, 3)
    torch.testing.assert_close(forward.decode_pass(model, cache, tokens[:, -3:]), again)


def test_the_engine_profiles_batches_of_a_sliding_window_family_keep_every_token(models):
    """The engine profile's random running batch (its eager cache: a padded rectangle) of Gemma-2 holds each row's
    tokens in every layer, past the 8-token window: the engine's rollback and compaction work by slot."""
    from profiles.engine_profile import random_batch

    batch = random_batch(models["gemma2"], 3, 40, torch.Generator().manual_seed(0), spread=0.5)
    assert batch.lengths() == [20, 40, 60]
    assert batch.extend([[1], [2], [3]], all_logits=False).shape == (3, 500) and batch.lengths() == [21, 41, 61]
    assert {layer.keys.shape[2] for layer in batch.batch.cache.layers} == {61}


# -- the optimized path --------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_optimized_path_computes_the_eager_logits(models, model_type):
    """A prefill of 150 tokens, then passes of 1, 4 and 9 x 5 tokens, give the logits of the whole sequence at once;
    Gemma-2's sliding layers hold a ring of 128 positions (the window of 8 plus 64, rounded up to a multiple of 64),
    which the prompt and the later passes wrap around."""
    model = models[model_type]
    generator = torch.Generator().manual_seed(2)
    ids = forward.random_tokens(model, 2, 200, generator)
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
    cache = SlotCache(model, 2, 256)
    assert cache.spans == ([128, 256, 128] if model_type == "gemma2" else [256] * 3)
    parts = [slot_pass(model, cache, 0, ids[:, :150], last_columns(2, 150, 150, CPU), attention_width(0, 150, 256),
                       fresh=True)]
    cache.lengths[:2] = 150
    for lo, hi in [(150, 151), (151, 155)] + [(155 + 5 * i, 160 + 5 * i) for i in range(9)]:
        q = hi - lo
        parts.append(slot_pass(model, cache, 0, ids[:, lo:hi], last_columns(2, q, q, CPU),
                               attention_width(lo, q, cache.max_len)))
        cache.lengths[:2] += q
    torch.testing.assert_close(torch.cat(parts, dim=1), reference, rtol=1e-4, atol=1e-5)


# -- the real engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 500, int(n)).tolist() for n in (150, 20, 9, 60)]
    return Workload(np.linspace(0.0, 0.02, 4), [len(p) for p in prompts], [40, 90, 8, 70], "test"), prompts


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target alone: one sequence, one token a pass over transformers' cache."""
    logits, cache = forward.prefill_pass(model, torch.tensor([prompt]))
    out = [int(logits[0, -1].argmax())]
    while len(out) < n:
        out.append(int(forward.decode_pass(model, cache, torch.tensor([[out[-1]]]))[0, -1].argmax()))
    return out


def serve(target, draft, requests, forward_path, tree=None):
    k = tree.num_nodes if tree else 3
    engine = RealEngine(target, draft, RealEngineConfig(max_num_seqs=3, max_k=k, forward=forward_path, tree=tree),
                        make_policy("fixed-k", k), None, np.random.default_rng(0))
    return engine.run(*requests)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_speculation_emits_the_targets_greedy_output_in_every_family(models, requests, model_type):
    """A draft of the target's family (the target with noise on its LM head: it agrees often, not always) drafts
    chains and trees over a batch of unequal requests (Gemma-2's past its window and, optimized, around its ring),
    on both forward paths: the output is the target's alone."""
    target = models[model_type]
    draft = small_model(model_type)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * head.std() * 0.2)
    workload, prompts = requests
    expected = [reference_greedy(target, p, int(n)) for p, n in zip(prompts, workload.output_tokens)]
    for forward_path in ("eager", "optimized"):
        for tree in (None, TREE):
            result = serve(target, draft, requests, forward_path, tree)
            assert result.outputs == expected, (forward_path, tree)
            assert 0 < result.summary["acceptance_rate"] < 1


def test_the_reduced_moe_pair_speculates_losslessly(models, requests, tmp_path):
    """A reduced Qwen3-MoE target with a reduced dense Qwen3 draft of its vocabulary (the CPU twin's shape, small):
    speculative decoding on both paths emits what the target alone does."""
    for name, model_type in (("target", "qwen3_moe"), ("draft", "qwen3")):
        (tmp_path / f"{name}.json").write_text(json.dumps(small_config(model_type)))
    pair = load_pair(f"{tmp_path / 'target.json'}+{tmp_path / 'draft.json'}")
    assert (type(pair.target).__name__, type(pair.draft).__name__) == ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")
    workload, prompts = requests
    expected = [reference_greedy(pair.target, p, int(n)) for p, n in zip(prompts, workload.output_tokens)]
    for forward_path in ("eager", "optimized"):
        result = serve(pair.target, pair.draft, requests, forward_path)
        assert result.outputs == expected and result.summary["proposed_tokens"] > 0


def test_heads_on_families_without_a_llama_shaped_layer_are_refused(tmp_path):
    (tmp_path / "gemma.json").write_text(json.dumps(small_config("gemma2")))
    with pytest.raises(UserError, match=r"^--speculative-method eagle: the EAGLE head is one Llama layer on a "
                                        r"Llama-shaped target; gemma2 \(.*gemma.json\) is not one$"):
        load_pair(f"{tmp_path / 'gemma.json'}+qwen3-0.6b", method="eagle")
    settings = ProfileSettings(target="qwen3-30b-a3b", draft="eagle3-qwen3-30b-a3b", out=str(tmp_path / "p.csv"),
                               grid=Grid(batch_sizes=(1,), query_lens=(1,), context_lens=(8,), prefill_lens=()),
                               dtype="fp32", device="cpu", threads=1, quiet=True)
    with pytest.raises(UserError, match=r"^--draft: a draft head's layer is its target's family's layer; qwen3_moe "
                                        r"targets \(a MoE or Gemma-2 layer\) take no head here$"):
        run_profile(settings)


# -- the profiler --------------------------------------------------------------------------------------
@pytest.mark.parametrize("forward_path", ["eager", "optimized"])
def test_the_profiler_times_the_new_families_on_both_paths(tmp_path, forward_path):
    """Gemma-2 (past its window) with a Qwen3-MoE draft: every point measured, the parameters counted as transformers
    builds the models, the KV bytes per token of every layer."""
    for name, model_type in (("gemma", "gemma2"), ("moe", "qwen3_moe")):
        (tmp_path / f"{name}.json").write_text(json.dumps(small_config(model_type)))
    grid = Grid(batch_sizes=(1, 2), query_lens=(1, 3), context_lens=(4, 40), prefill_lens=(16,))
    result = run_profile(ProfileSettings(
        target=str(tmp_path / "gemma.json"), draft=str(tmp_path / "moe.json"), out=str(tmp_path / "p.csv"),
        grid=grid, dtype="fp32", forward=forward_path, device="cpu", threads=1, quiet=True,
        timing=TimingPolicy(warmup=0, min_repeats=1, max_repeats=1)))
    assert len(result.frame) == len(grid.points(("target", "draft"))) and (result.frame.seconds > 0).all()
    meta = result.meta
    assert meta["complete"] and meta["forward"] == forward_path
    for role, model_type in (("target", "gemma2"), ("draft", "qwen3_moe")):
        assert meta[role]["params"] == forward.parameter_count(forward.hf_config(small_config(model_type), "t"))
    assert meta["memory"]["target_kv_bytes_per_token"] == 2 * 3 * 2 * 16 * 4


# -- the MoE layer's time against the experts its tokens wake -------------------------------------------
def woken_experts(experts: int, top_k: int, tokens: np.ndarray) -> np.ndarray:
    """Expected experts that ``tokens`` tokens wake when each picks ``top_k`` of ``experts`` uniformly: an expert
    stays asleep with probability (1 - k / E) per token, so E (1 - (1 - k / E) ^ T)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def relative_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """y ~ a + b x by least squares on relative errors: the coefficients, the relative residuals (y - fit) / fit and
    R^2 of the relative errors."""
    design = np.c_[np.ones(len(x)), x]
    coef, *_ = np.linalg.lstsq(design / y[:, None], np.ones(len(y)), rcond=None)
    fit = design @ coef
    relative = (y - fit) / y
    return coef, (y - fit) / fit, 1 - float((relative ** 2).sum() / (((y - y.mean()) / y) ** 2).sum())


@pytest.mark.slow
def test_a_moe_layers_time_follows_the_experts_its_tokens_wake(capsys):
    """One random-weight Qwen3-MoE layer, 128 experts of 3 MiB (fp32; 400 MiB in all, far past the CPU's caches),
    top 2 per token: a pass of T tokens wakes E (1 - (1 - k / E) ^ T) experts under uniform routing, and
    transformers' ``grouped_mm`` reads only their weights, so in the memory-bound region (here every T <= 64: a woken
    expert multiplies at most 1.6 tokens' rows on average) the time is a + b x woken(T), not a + b x T.

    The random router is close to uniform (checked: the mean count of woken experts over the passes is the formula's
    within sampling error). Timing on a shared machine: the MoE block's thread CPU time (the time other processes
    hold the core is left out), one pass of each T per round in a shuffled order, medians of 24 rounds; the
    tolerance on the fit is 3 x the largest standard error of a median plus 5%."""
    path, data = read_family_config("qwen3-30b-a3b", "test")
    experts, top_k, hidden = 128, 2, 1024
    config = forward.hf_config(reduce(data, path.stem, layers=1, hidden=hidden, heads=8, kv_heads=1, head_dim=64,
                                      experts=experts, top_k=top_k, expert_width=256, vocab=256), "test")
    block = forward.build_model(config, "fp32", CPU).model.layers[0].mlp
    tokens = np.array([1, 2, 4, 8, 16, 32, 64])
    rounds, generator, order = 24, torch.Generator().manual_seed(0), random.Random(0)
    seconds = {t: [] for t in tokens}
    woken = {t: [] for t in tokens}
    with torch.inference_mode():
        for _ in range(rounds + 1):
            for t in order.sample(list(tokens), len(tokens)):
                x = torch.randn(1, int(t), hidden, generator=generator)  # unit-RMS inputs, as the RMSNorm hands on
                woken[t].append(len(torch.unique(block.gate(x.view(-1, hidden))[2])))
                start = time.thread_time()
                block(x)
                seconds[t].append(time.thread_time() - start)
    expected = woken_experts(experts, top_k, tokens)
    counts = np.array([np.mean(woken[t]) for t in tokens])
    spread = np.array([np.std(woken[t]) / np.sqrt(len(woken[t])) for t in tokens])
    assert (np.abs(counts - expected) <= 4 * spread + 0.02 * expected).all()  # uniform routing
    median = np.array([np.median(seconds[t][1:]) for t in tokens])  # the first round warms up
    mad = np.array([np.median(np.abs(np.array(seconds[t][1:]) - m)) for t, m in zip(tokens, median)])
    standard_error = 1.25 * 1.4826 * mad / np.sqrt(rounds) / median  # of a median, relative
    by_woken, residual_woken, r2_woken = relative_fit(expected, median)
    by_tokens, residual_tokens, r2_tokens = relative_fit(tokens.astype(float), median)
    with capsys.disabled():
        print(f"\nMoE layer time (E={experts}, k={top_k}, {3 * hidden * 256 * 4 / 2 ** 20:.0f} MiB an expert, "
              f"1 thread, CPU time):")
        print(pd.DataFrame({"T": tokens, "woken (mean)": counts.round(2), "E(1-(1-k/E)^T)": expected.round(2),
                            "median ms": (median * 1e3).round(3), "se": standard_error.round(3),
                            "resid a+b woken": residual_woken.round(3),
                            "resid a+b T": residual_tokens.round(3)}).to_string(index=False))
        print(f"a + b woken(T): a = {by_woken[0] * 1e3:.3f} ms, b = {by_woken[1] * 1e3:.4f} ms per expert "
              f"({3 * hidden * 256 * 4 / by_woken[1] / 1e9:.1f} GB/s of weights), R^2 {r2_woken:.4f}, "
              f"max |residual| {np.abs(residual_woken).max():.1%}")
        print(f"a + b T:        a = {by_tokens[0] * 1e3:.3f} ms, b = {by_tokens[1] * 1e3:.4f} ms per token, "
              f"R^2 {r2_tokens:.4f}, max |residual| {np.abs(residual_tokens).max():.1%}")
    tolerance = 3 * standard_error.max() + 0.05
    assert np.abs(residual_woken).max() <= tolerance
    assert r2_woken > r2_tokens and np.sqrt(np.mean(residual_woken ** 2)) < np.sqrt(np.mean(residual_tokens ** 2))

