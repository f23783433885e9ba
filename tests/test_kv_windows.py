"""KV blocks of sliding-window models (simulator/core/memory.py): a request holds every token in full-attention
layers and only the window in sliding ones, as vLLM's hybrid KV-cache manager frees the blocks the window has
passed; a model without windows keeps the engine's fast path, and the general path gives the same run where both
apply."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import simpy

from policies import make_policy
from policies.errors import UserError
from simulator.config import SimConfig
from simulator.core.engine import EngineSpec, SimulatedEngine
from simulator.core.memory import GIB, KVBytes, KVLayout, kv_layout, num_gpu_blocks
from simulator.core.runner import run_simulation
from simulator.costs.cost_model import load_cost_model
from simulator.costs.profile_table import Memory
from simulator.inputs.acceptance import make_acceptance
from simulator.inputs.workload import Workload
from simulator.metrics import Recorder

DATA = Path(__file__).resolve().parents[1] / "profiles" / "data"
GEMMA = DATA / "h100-80gb-analytical__gemma-2-9b__gemma-2-2b.csv"


def vllm_pages(computed: int, total: int, window: int | None, bs: int) -> int:
    """Pages one layer holds, by vLLM's rule read literally: pages for every token up to ``total``, less (in a
    sliding layer) those wholly before ``computed - window + 1`` (SlidingWindowManager.remove_skipped_blocks)."""
    pages = range(-(-total // bs))
    if window is None:
        return len(pages)
    first_needed = computed - window + 1
    return sum(1 for j in pages if (j + 1) * bs > first_needed)


def test_blocks_are_vllms_pages_of_each_layer_group():
    layout = KVLayout(16, full=3, windows=((128, 2), (4096, 1)))
    for computed, new in itertools.product(range(0, 9000, 37), (1, 4, 513)):
        total = computed + new
        expected = 3 * vllm_pages(computed, total, None, 16) + 2 * vllm_pages(computed, total, 128, 16) \
            + vllm_pages(computed, total, 4096, 16)
        assert layout.blocks(computed, total) == expected, (computed, total)
    # a sliding layer keeps the window - 1 last tokens, the step's, and at most one block where the window starts
    assert max(vllm_pages(c, c + 5, 128, 16) for c in range(200, 2000)) == math.ceil((128 - 1 + 5) / 16) + 1


def test_a_prefill_chunk_takes_the_most_tokens_its_blocks_allow():
    layout = KVLayout(16, full=1, windows=((4096, 1),))
    for held, free, done in itertools.product((0, 100, 500), (0, 7, 300), (0, 3000, 8000)):
        room = layout.room(held, free, done)
        if room > 0:
            assert layout.blocks(done, done + room) - held <= free
        assert layout.blocks(done, done + max(room, 0) + 16) - held > free
    plain = KVLayout(16)
    assert plain.room(10, 5, 100) == 15 * 16 - 100 and not plain.windowed


def profile_memory(**sliding) -> dict:
    return {"device_memory_gb": 4.0, "target_weight_gb": 1.0, "target_kv_bytes_per_token": 262144,
            "draft_weight_gb": 0.1, "draft_kv_bytes_per_token": 16384, **sliding}


#: A policy whose k swings between steps (4, then 0, ...): a step reserves fewer blocks than the step before, whose
#: unused lookahead blocks a request keeps (vLLM frees no block but by a sliding window).
SWINGING = """
import numpy as np
from policies import Policy, register

@register
class Swinging(Policy):
    name = "swinging"
    def propose(self, view):
        self.steps = getattr(self, "steps", 0) + 1
        return np.full(len(view.request_ids), self.k if self.steps % 2 else 0)
"""


@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
@pytest.mark.parametrize("policy, k", [("no-spec", 0), ("fixed-k", 3), ("swinging", 4)])
def test_the_general_path_gives_the_fast_paths_run_where_both_apply(cost_json, tmp_path, scheduler, policy, k):
    """Every layer sliding over a window no request reaches holds every token, as every full layer does: the same
    cache, the same blocks, the same run, request by request and step by step (under preemption; with a k that
    swings, a step's unused lookahead blocks kept)."""
    coefficients = dict(target=0.01, per_batched_token=1e-4, per_context_token=1e-7, prefill=0.005,
                        per_prompt_token=1e-5, draft=0.002)
    plain = cost_json(memory=profile_memory(), **coefficients)
    never = cost_json(memory=profile_memory(target_sliding_kv_bytes_per_token=262144, target_sliding_window=10 ** 7,
                                            draft_sliding_kv_bytes_per_token=16384, draft_sliding_window=10 ** 7),
                      **coefficients)
    policy_file = tmp_path / "swinging.py"
    policy_file.write_text(SWINGING)
    runs = []
    for profile in (plain, never):
        config = SimConfig.of(profile=profile, rate=30.0, num_requests=300, length_dist="lognormal", prompt_len=300,
                           output_len=80, max_num_seqs=48, max_num_batched_tokens=512, max_prompt_len=512,
                           scheduler=scheduler,
                           policy=policy, k=k, acceptance="beta", save_steps=True, seed=5,
                           policy_file=str(policy_file) if policy == "swinging" else None)
        runs.append(run_simulation(config, step_by_step=True))
    fast, general = runs
    assert kv_layout(fast.config, load_cost_model(plain), k > 0) is None
    assert kv_layout(general.config, load_cost_model(never), k > 0).windowed
    assert fast.summary["num_gpu_blocks"] == general.summary["num_gpu_blocks"]
    assert fast.summary["preemptions"] > 0
    pd.testing.assert_frame_equal(fast.requests, general.requests, check_exact=True)
    pd.testing.assert_frame_equal(fast.steps, general.steps, check_exact=True)


def seated(cost, prompt: int, requests: int) -> tuple[int, int]:
    """(KV blocks, requests seated in the first decode step) of a decode instance handed ``requests`` prefilled
    requests of ``prompt`` tokens at once (vLLM's disaggregated decode side): it seats them first come first served
    while their blocks are free."""
    config = SimConfig.of(rate=1.0, num_requests=requests)
    blocks = num_gpu_blocks(config, cost, speculative=False)
    spec = EngineSpec(max_num_seqs=4096, max_num_batched_tokens=8192, block_size=16, num_gpu_blocks=blocks,
                      chunked_prefill=False, max_k=0, draft_proposer=True, ngram_match_prob=0.0, speculative=False,
                      run_steps=1, kv=kv_layout(config, cost, speculative=False))
    wl = Workload(np.zeros(requests), np.full(requests, prompt), np.full(requests, 3), "prefilled elsewhere")
    env = simpy.Environment()
    rec = Recorder(wl.arrival_time, wl.prompt_tokens, wl.output_tokens, save_steps=True)
    engine = SimulatedEngine(env, spec, wl, cost, make_policy("no-spec", 0), cost,
                             make_acceptance(config.speculative, np.random.default_rng(0)), np.random.default_rng(1), rec)
    engine.start(own_arrivals=False)
    for rid in range(requests):
        engine.receive_prefilled(rid)
    env.run()
    return blocks, int(rec.steps_frame().batch_size.iloc[0])


def test_gemma2_holds_more_long_sequences_than_an_all_global_gemma2_by_the_predicted_amount():
    """Gemma-2-9B on an H100 (the shipped analytical profile): 21 of its 42 layers slide over 4,096 tokens. A block is
    16 tokens of one group of 21 layers (vLLM's page), so the cache has twice the blocks of an all-global Gemma-2's
    (whose block spans all 42 layers); a request of 8,001 tokens holds 501 blocks in the global group and 501 - 244
    in the sliding one (the 244 blocks wholly before token 8,001 - 4,096 + 1 freed): 758 against the all-global
    model's 501 double-size blocks, 1.32 times the sequences (the KV share of the sliding layers, 4,096 of 8,001
    tokens, saved)."""
    cost = load_cost_model(GEMMA)
    memory = cost.memory
    assert (memory.target_sliding_kv_bytes_per_token, memory.target_sliding_window) == (21 * 8192, 4096)
    all_global = copy.copy(cost)
    all_global.memory = dataclasses.replace(memory, target_sliding_kv_bytes_per_token=0, target_sliding_window=0)
    prompt = 8001
    free = (memory.device_memory_gb * 0.9 - memory.target_weight_gb - 2.0) * GIB
    pages, skipped = math.ceil(prompt / 16), (prompt - 4096 + 1) // 16
    (sliding_blocks, sliding_seats), (global_blocks, global_seats) = (seated(c, prompt, 400)
                                                                      for c in (cost, all_global))
    assert sliding_blocks == free // (16 * 21 * 8192) and global_blocks == free // (16 * 42 * 8192)
    assert sliding_seats == sliding_blocks // (2 * pages - skipped)
    assert global_seats == global_blocks // pages
    # 27 seats against 20: the predicted 2 x 501 / 758 = 1.32 times, to one seat (the floors)
    assert (sliding_seats, global_seats) == (27, 20)
    assert abs(sliding_seats / global_seats - 2 * pages / (2 * pages - skipped)) < 1 / global_seats


def test_a_draft_with_the_same_window_shares_the_block_unit():
    """Gemma-2-9B with Gemma-2-2B as draft: the two models' full layers form one kind, their sliding layers (both
    4,096) another: a block is 16 tokens of 21 + 13 layers of each kind, as one vLLM page group."""
    cost = load_cost_model(GEMMA)
    config = SimConfig.of(rate=1.0, num_requests=1, policy="fixed-k", k=3)
    layout = kv_layout(config, cost, speculative=True)
    assert layout == KVLayout(16, full=1, windows=((4096, 1),))
    free = (cost.memory.device_memory_gb * 0.9 - cost.memory.target_weight_gb - cost.memory.draft_weight_gb - 2.0)
    assert num_gpu_blocks(config, cost, speculative=True) == free * GIB // (16 * (21 * 8192 + 13 * 4096))


def test_disaggregated_serving_sends_the_window_of_sliding_layers():
    kv = KVBytes.of(load_cost_model(GEMMA).memory, with_draft=False)
    assert kv.held(1000) == 1000 * 344_064
    assert kv.held(32768) == 32768 * 172_032 + 4095 * 172_032
    assert KVBytes(524288).held(1000) == 1000 * 524288


def test_prefix_caching_over_sliding_windows_is_refused_in_one_line():
    config = SimConfig.of(profile=str(GEMMA), rate=1.0, num_requests=5, enable_prefix_caching=True)
    with pytest.raises(UserError, match="--enable-prefix-caching: prefix caching over sliding-window layers"):
        run_simulation(config)


@pytest.mark.parametrize("memory, message", [
    ({"target_sliding_kv_bytes_per_token": 600000}, "target_sliding_kv_bytes_per_token 600000 exceeds"),
    ({"target_sliding_kv_bytes_per_token": 1000}, "target_sliding_window must be a whole number"),
    ({"target_sliding_window": 128}, "target_sliding_window must be a whole number"),
])
def test_sliding_memory_figures_are_checked(memory, message):
    with pytest.raises(UserError, match=message):
        Memory.from_dict({**profile_memory(), **memory}, "p.meta.json: memory")
