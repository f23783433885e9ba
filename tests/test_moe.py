"""Mixture-of-experts pricing (profiles/architectures/moe.py; MoESD, arXiv 2505.19645): the experts a pass wakes, by
exact enumeration of routings; the pass time that follows them, then the tokens; expert parallelism."""
from __future__ import annotations

import itertools
from math import comb

import numpy as np
import pytest

from profiles.analytical import GPUS, Efficiency, pass_cost
from profiles.architectures import Architecture
from profiles.architectures.moe import busiest_device_woken, gini, inclusion_probabilities, woken_experts

QWEN3_30B = Architecture.from_config("qwen3-30b-a3b")
DEEPSEEK = Architecture.from_config("deepseek-v3")
H200 = GPUS["h200"]


@pytest.mark.parametrize("experts, top_k, tokens", [(4, 1, 3), (5, 2, 2), (6, 2, 3), (6, 3, 2), (7, 4, 2)])
def test_uniform_woken_count_is_exact_for_top_k_without_replacement(experts, top_k, tokens):
    """Every token picks a k-subset of the E experts, all subsets alike and tokens independent: averaging the distinct
    experts over every one of the C(E, k)^T routings gives exactly E (1 - (1 - k/E)^T) (an expert is in a token's
    subset with probability C(E-1, k-1) / C(E, k) = k/E)."""
    subsets = list(itertools.combinations(range(experts), top_k))
    routings = list(itertools.product(subsets, repeat=tokens))
    assert len(routings) == comb(experts, top_k) ** tokens
    exact = sum(len(set().union(*routing)) for routing in routings) / len(routings)
    assert woken_experts(tokens, experts, top_k) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_skewed_woken_count_is_exact_for_independent_tokens(tokens):
    """Top-1 routing with the skewed popularity: enumerating every routing of T tokens with its probability gives
    sum_i 1 - (1 - p_i)^T."""
    p = inclusion_probabilities(5, 1, 0.3)
    exact = sum(np.prod([p[e] for e in routing]) * len(set(routing))
                for routing in itertools.product(range(5), repeat=tokens))
    assert woken_experts(tokens, 5, 1, 0.3) == pytest.approx(exact, rel=1e-12)


def test_the_skew_is_a_zipf_law_with_the_asked_load_gini():
    for gini_asked in (0.105, 0.15, 0.25):  # the measured bands (moe.ROUTING_GINI_SOURCE)
        pi = inclusion_probabilities(128, 8, gini_asked)
        assert pi.sum() == pytest.approx(8) and pi.max() <= 1 and list(pi) == sorted(pi, reverse=True)
        assert gini(pi) == pytest.approx(gini_asked, abs=1e-9)
    assert list(inclusion_probabilities(128, 8, 0.0)) == [8 / 128] * 128
    # skew wakes fewer experts for the same tokens; many tokens wake them all either way
    assert woken_experts(16, 128, 8, 0.25) < woken_experts(16, 128, 8, 0.0)
    assert woken_experts(4096, 128, 8, 0.25) == pytest.approx(128, rel=1e-3)


def test_woken_experts_grow_with_tokens_up_to_all_of_them():
    counts = [woken_experts(t, 128, 8) for t in (1, 2, 4, 8, 16, 64, 256)]
    assert counts == sorted(counts) and counts[0] == pytest.approx(8) and counts[-1] == pytest.approx(128, rel=1e-6)
    for t, count in zip((1, 2, 4, 8, 16, 64, 256), counts):
        assert count <= min(128, 8 * t)


def test_the_busiest_device_under_expert_parallelism_matches_sampled_routings():
    """E = 16 experts over 4 devices, top-2 of 3 tokens: the expected largest per-device count of woken experts
    (independent devices assumed) against 40,000 sampled uniform routings."""
    rng = np.random.default_rng(0)
    most = []
    for _ in range(40_000):
        woken = set()
        for _ in range(3):
            woken.update(rng.choice(16, 2, replace=False).tolist())
        per_device = np.bincount([e % 4 for e in woken], minlength=4)  # round robin placement
        most.append(per_device.max())
    assert busiest_device_woken(3, 16, 2, 0.0, 4) == pytest.approx(np.mean(most), rel=0.03)
    assert busiest_device_woken(3, 16, 2, 0.0, 1) == woken_experts(3, 16, 2)
    assert busiest_device_woken(3, 16, 2, 0.0, 4) > woken_experts(3, 16, 2) / 4


def test_an_moe_pass_follows_the_woken_experts_then_the_tokens_times_k():
    """Qwen3-30B-A3B (128 experts, top-8), decode over a short context on an H200: while memory-bound, the linear
    term's growth from one token is the woken experts' weights over the bandwidth; compute-bound (a long prefill), it
    doubles with the tokens, 2 x T x k x an expert's weights."""
    eff = Efficiency()
    bw = H200.hbm_bandwidth * eff.bandwidth
    expert_bytes = QWEN3_30B.layers[0].ffn.expert_params * 2
    one = pass_cost(QWEN3_30B, H200, "decode", 1, 1, 16, eff=eff)
    for batch in (2, 4, 8):
        cost = pass_cost(QWEN3_30B, H200, "decode", batch, 1, 16, eff=eff)
        woken = woken_experts(batch, 128, 8) - woken_experts(1, 128, 8)
        # (the added tokens' activations are 1% of it)
        assert cost.linear_s - one.linear_s == pytest.approx(48 * woken * expert_bytes / bw, rel=0.02)
    times = [pass_cost(QWEN3_30B, H200, "decode", b, 1, 16, eff=eff).linear_s for b in (1, 2, 4, 8, 16, 32)]
    assert times == sorted(times)
    long, longer = (pass_cost(QWEN3_30B, H200, "prefill", 1, n, 0, eff=eff).linear_s for n in (8192, 16384))
    assert longer / long == pytest.approx(2, rel=1e-9)
    experts = 48 * 2 * 16384 * 8 * QWEN3_30B.layers[0].ffn.expert_params
    assert experts / (H200.peak_flops * eff.compute) < longer  # the experts' FLOPs are most of it
    # speculation's price (MoESD): verifying k + 1 = 4 tokens of each of 8 sequences routes 32 tokens, which wake
    # about 112 experts a layer where decoding one token each wakes 52
    verify, decode = (pass_cost(QWEN3_30B, H200, "decode", 8, q, 16, eff=eff).linear_s for q in (4, 1))
    more = woken_experts(32, 128, 8) - woken_experts(8, 128, 8)
    assert verify - decode == pytest.approx(48 * more * expert_bytes / bw, rel=0.02)


def test_expert_parallel_dispatch_and_combine_are_deepeps_volumes():
    """DeepSeek-V3 (hidden 7,168, top-8): FP8 dispatch 8 x (16 + 7,168 + 224) = 59,264 B and BF16 combine 8 x 14,336 =
    114,688 B per token and MoE layer (architecture_notes.md sec. 3), 7/8 of it off the device at EP 8."""
    moe = DEEPSEEK.layers[-1].ffn
    assert moe.all_to_all_bytes(8, 8, fp8_dispatch=True) == pytest.approx((59_264 + 114_688) * 7 / 8)
    assert moe.all_to_all_bytes(8, 1, fp8_dispatch=True) is None  # tensor parallel: an all-reduce instead
    tp8, ep8 = (pass_cost(DEEPSEEK, H200, "decode", 64, 1, 1024, tp=8, ep=ep) for ep in (1, 8))
    assert ep8.comm_s != tp8.comm_s
    # at batch 1 a device of the 8 holds the busiest share of the 8 woken experts: more than one on average
    assert busiest_device_woken(1, 256, 8, 0.0, 8) > 1.5


def test_fp8_experts_compute_at_the_fp8_rate_where_the_gpu_has_it():
    """DeepSeek-V3 as published (FP8): a compute-bound prefill on an H200 (FP8 tensor cores) takes about half the
    linear time it takes with bf16 weights; on an A100 (no FP8) FP8 weights compute at bf16 (weight-only)."""
    fp8, bf16 = (pass_cost(DEEPSEEK, H200, "prefill", 2, 8192, 0, tp=8, weights=w).linear_s for w in ("auto", "bf16"))
    assert fp8 / bf16 == pytest.approx(0.5, rel=0.05)
    a100 = GPUS["a100-80gb"]
    fp8, bf16 = (pass_cost(DEEPSEEK, a100, "prefill", 2, 8192, 0, tp=8, weights=w).linear_s for w in ("auto", "bf16"))
    assert fp8 == pytest.approx(bf16, rel=0.01)
