"""The engines' own adaptive policies: vLLM's k-by-batch-size table (``vllm-batch-table``) and SGLang's adaptive
step tiers (``sglang-adaptive``): the lookup and the tier moves on scripted outcomes, exactly; both end to end in
``simulate``, a sweep and the real engine; and what they do to latency across load."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from policies.adaptive_tiers import SglangAdaptive
from policies.errors import UserError
from policies.registry import make_policy
from simulator.config import SimConfig
from simulator.core.runner import run_simulation
from simulator.costs.cost_model import model_from_dict
from simulator.inputs.workload import Workload
from simulator.studies.cli import main
from simulator.studies.executors import LocalExecutor
from simulator.studies.sweep import build_cells, run_sweep
from tests.test_fast_paths import PROFILE, _assert_same_runs, _fast_against_plain
from tests.test_policies import outcome, view

TABLE = "1:5,8:3,32:1,64:0"
REAL_COST = model_from_dict({"target": {"base": 0.02, "per_batched_token": 0.0005}, "draft": {"base": 0.0005},
                             "prefill": {"base": 0.01}}, "hand-written test costs")
"""What the real engine's policies believe in (tests/test_engine_real.py's costs)."""


# --- vLLM's num_speculative_tokens_per_batch_size ----------------------------------------------------------------
def test_table_gives_each_entrys_k_from_its_start_until_the_next():
    policy = make_policy("vllm-batch-table", 5, {"table": TABLE})
    sizes = [1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 1000]
    assert [policy.k_for(b) for b in sizes] == [5, 5, 5, 3, 3, 3, 1, 1, 1, 0, 0, 0]
    assert policy.propose(view(8)).tolist() == [3] * 8
    assert policy.propose(view(8, max_k=2)).tolist() == [2] * 8  # the step's bound still holds


def test_vllm_ranges_carry_their_k_through_gaps_and_past_the_end():
    """vLLM's example (``build_dynamic_sd_schedule_lookup``): [(1, 16, 3), (32, 128, 2)] maps 17-31 to 3, and batch
    sizes past 128 keep 2; a k above num_speculative_tokens is clamped to it (here the policy's k = 2)."""
    policy = make_policy("vllm-batch-table", 3, {"table": [[1, 16, 3], [32, 128, 2]]})
    assert [policy.k_for(b) for b in (1, 16, 17, 31, 32, 128, 129, 4096)] == [3, 3, 3, 3, 2, 2, 2, 2]
    clamped = make_policy("vllm-batch-table", 2, {"table": "1-16:3;32-128:2"})
    assert [clamped.k_for(b) for b in (1, 17, 32, 500)] == [2, 2, 2, 2]


@pytest.mark.parametrize("table,ranges", [
    ("1-4:4,9-12:2,13-13:0,40-50:1", [(1, 4, 4), (9, 12, 2), (13, 13, 0), (40, 50, 1)]),
    ("1:3", [(1, 1, 3)]),
    ([[7, 9, 1], [1, 1, 2], [2, 2, 0]], [(1, 1, 2), (2, 2, 0), (7, 9, 1)]),
    ("1-100:2;101:1", [(1, 100, 2), (101, 101, 1)])])
def test_table_lookup_is_vllms_range_rule_at_every_batch_size(table, ranges):
    """Exhaustively, batch sizes 1..300: the k of the range holding the batch size, else of the last range that ends
    before it (vLLM's carry-forward, written here from the ranges rather than the entries' starts)."""
    policy = make_policy("vllm-batch-table", 4, {"table": table})
    for b in range(1, 301):
        holding = [k for start, end, k in ranges if start <= b <= end]
        before = [k for start, end, k in ranges if end < b]
        assert policy.k_for(b) == (holding[0] if holding else before[-1]), b


@pytest.mark.parametrize("params,message", [
    ({}, "policy vllm-batch-table: parameter table is required, e.g. table=1:5,8:3,32:1,64:0 (vLLM's "
         "num_speculative_tokens_per_batch_size)"),
    ({"table": "2:3,8:1"}, "policy vllm-batch-table: parameter table must start at batch size 1 (vLLM requires it, "
                           "so every batch size has a k), got '2:3'"),
    ({"table": "1-8:4,8:2"}, "policy vllm-batch-table: parameter table ranges overlap, got '8:2'"),
    ({"table": "1:4,1:2"}, "policy vllm-batch-table: parameter table ranges overlap, got '1:2'"),
    ({"table": "0:3"}, "policy vllm-batch-table: parameter table ranges need 1 <= start <= end, got '0:3'"),
    ({"table": "1-8:3,20-9:1"}, "policy vllm-batch-table: parameter table ranges need 1 <= start <= end, "
                                "got '20-9:1'"),
    ({"table": "1:a"}, "policy vllm-batch-table: parameter table entries must look like start:k or start-end:k "
                       "(integers), got '1:a'"),
    ({"table": [[1, 8, -1]]}, "policy vllm-batch-table: parameter table k must be >= 0, got '[1, 8, -1]'"),
    ({"table": [[1, 8, 2.5]]}, "policy vllm-batch-table: parameter table entries [start, end, k] must be integers, "
                               "got '[1, 8, 2.5]'"),
    ({"table": 5}, "policy vllm-batch-table: parameter table must be 'start:k,...' (or 'start-end:k,...') or "
                   "vLLM's list of [start, end, k], got 5"),
    ({"table": ""}, "policy vllm-batch-table: parameter table needs at least one entry, got ''"),
    ({"table": "1:3", "max_batch": 4}, "policy vllm-batch-table: unknown parameter 'max_batch'"),
])
def test_table_bad_params_name_the_policy_and_the_entry(params, message):
    with pytest.raises(UserError) as err:
        make_policy("vllm-batch-table", 4, params)
    assert str(err.value) == message


# --- SGLang's --speculative-adaptive -------------------------------------------------------------------------------
def tier_log(policy: SglangAdaptive, accepted, batch: int = 4) -> list[tuple[int, int]]:
    """Feed verify batches of ``batch`` requests, each accepting ``accepted(step, k)`` draft tokens; the log of
    (verify batch, tier) at the start and at every change."""
    log = [(0, policy.tier)]
    for step, accept in enumerate(accepted, start=1):
        k = policy.propose(view(batch, max_k=8))
        policy.observe(outcome(range(batch), k, [accept(k[0])] * batch))
        if policy.tier != log[-1][1]:
            log.append((step, policy.tier))
    return log


ALL = lambda k: k  # every draft token accepted
NONE = lambda k: 0  # every draft token rejected


def test_defaults_are_sglangs():
    policy = make_policy("sglang-adaptive", 7)
    assert (policy.tiers, policy.ema_alpha, policy.update_interval, policy.warmup_batches, policy.down_hysteresis,
            policy.up_hysteresis, policy.tier, policy.ema_accept_len) == ((1, 3, 7), 0.2, 5, 10, -0.25, 0.0, 3, 2.0)


def test_tiers_move_after_warmup_every_interval_and_down_with_hysteresis():
    """From tier 3 (EMA 2.0), everything accepted: EMA = 3 - 0.8^n, above 2.5 from the 4th batch, but the first
    recomputation is at batch 15 (10 warm-up + 5). Then everything rejected: at batch 20 the EMA is 0.97 (<= 2.25:
    down to 3), at 25 it is 0.32, below 0.5 but not below 0.25 (hysteresis -0.25: stays), at 30 it is 0.10: tier 1."""
    policy = make_policy("sglang-adaptive", 7)
    assert tier_log(policy, [ALL] * 15 + [NONE] * 20) == [(0, 3), (15, 7), (20, 3), (30, 1)]
    without = make_policy("sglang-adaptive", 7, {"down_hysteresis": 0})
    assert tier_log(without, [ALL] * 15 + [NONE] * 20) == [(0, 3), (15, 7), (20, 3), (25, 1)]


def test_warmup_and_interval_hold_the_tier_while_the_ema_has_crossed():
    assert tier_log(make_policy("sglang-adaptive", 7, {"warmup_batches": 0, "update_interval": 1}),
                    [ALL] * 20) == [(0, 3), (4, 7)]
    assert tier_log(make_policy("sglang-adaptive", 7, {"warmup_batches": 6, "update_interval": 1}),
                    [ALL] * 20) == [(0, 3), (7, 7)]
    assert tier_log(make_policy("sglang-adaptive", 7, {"warmup_batches": 0, "update_interval": 3}),
                    [ALL] * 20) == [(0, 3), (6, 7)]
    # up hysteresis 0.4: up from 3 only above 2.9, i.e. 0.8^n < 0.1, from the 11th batch
    assert tier_log(make_policy("sglang-adaptive", 7, {"warmup_batches": 0, "update_interval": 1,
                                                       "up_hysteresis": 0.4}), [ALL] * 20) == [(0, 3), (11, 7)]


def test_one_recomputation_may_pass_several_tiers():
    policy = make_policy("sglang-adaptive", 7, {"warmup_batches": 0, "update_interval": 1, "ema_alpha": 1,
                                                "initial_steps": 7})
    assert tier_log(policy, [NONE]) == [(0, 7), (1, 1)]  # EMA 0: <= 2.25, then <= 0.25


def test_a_step_down_is_not_undone_by_the_same_recomputation():
    """With down_hysteresis 1 and up_hysteresis -1, an EMA of 0.9 at tier 3 steps down (0.9 <= 1 - 0.5 + 1) and
    would at once qualify to step up again from 1 (0.9 > 1 - 0.5 - 1); as in SGLang, a recomputation that stepped down
    does not step up."""
    policy = make_policy("sglang-adaptive", 7, {"warmup_batches": 0, "update_interval": 1, "ema_alpha": 1,
                                                "down_hysteresis": 1, "up_hysteresis": -1})
    policy.observe(outcome(range(10), [3] * 10, [1] * 9 + [0]))
    assert (policy.ema_accept_len, policy.tier) == (0.9, 1)


def test_the_mean_is_over_requests_that_proposed_and_idle_steps_are_not_batches():
    policy = make_policy("sglang-adaptive", 7)
    policy.observe(outcome([0, 1, 2], [3, 0, 3], [3, 0, 0]))  # the mean of 3 and 0 (request 1 proposed nothing)
    assert (policy.batches, policy.ema_accept_len) == (1, 0.8 * 2.0 + 0.2 * 1.5)
    policy.observe(outcome([0, 1], [0, 0], [0, 0]))  # nobody proposed (n-gram misses): no verify batch
    assert (policy.batches, policy.ema_accept_len) == (1, 0.8 * 2.0 + 0.2 * 1.5)


@pytest.mark.parametrize("params,tier", [({}, 3), ({"initial_steps": 4}, 3), ({"initial_steps": 5}, 7),
                                         ({"initial_steps": 0}, 1), ({"candidate_steps": "1;2;4;6"}, 4),
                                         ({"candidate_steps": [7, 1, 1]}, 7), ({"candidate_steps": "2,4"}, 4)])
def test_the_start_is_the_nearest_tier_a_tie_to_the_larger(params, tier):
    policy = make_policy("sglang-adaptive", 7, params)
    assert (policy.tier, policy.ema_accept_len) == (tier, tier - 1.0)


def test_proposals_are_the_tier_within_the_steps_bound():
    policy = make_policy("sglang-adaptive", 7)
    assert policy.propose(view(5)).tolist() == [3] * 5
    assert policy.propose(view(2, max_k=2)).tolist() == [2, 2]
    assert policy.propose_plain(5, 100, None, 8, True) == [3] * 5


def test_token_trees_are_refused_as_sglang_runs_adaptive_steps_on_chains_only():
    from policies.tree import TreeFamily, TreeShape, rank_table

    tree = TreeFamily(TreeShape.from_paths([(0,), (1,), (0, 0)]), rank_table([0.8, 0.8], [0.5]))
    with pytest.raises(UserError, match="SGLang's adaptive mode runs chains only"):
        make_policy("sglang-adaptive", 7).propose(dataclasses.replace(view(2), tree=tree))


@pytest.mark.parametrize("k,params,message", [
    (4, {}, "policy sglang-adaptive: parameter candidate_steps goes up to 7, above the configured k 4 (k bounds every "
            "proposal: give --k 7 or lower tiers)"),
    (7, {"candidate_steps": 3}, "policy sglang-adaptive: parameter candidate_steps needs at least two distinct tiers, "
                                "got '3'"),
    (7, {"candidate_steps": "3;3"}, "policy sglang-adaptive: parameter candidate_steps needs at least two distinct "
                                    "tiers, got '3,3'"),
    (7, {"candidate_steps": "0,3"}, "policy sglang-adaptive: parameter candidate_steps must all be >= 1, got '0,3'"),
    (7, {"candidate_steps": "1,x"}, "policy sglang-adaptive: parameter candidate_steps must be integers separated by "
                                    "commas, got '1,x'"),
    (7, {"ema_alpha": 0}, "policy sglang-adaptive: parameter ema_alpha must be in (0, 1], got 0"),
    (7, {"update_interval": 0}, "policy sglang-adaptive: parameter update_interval must be >= 1, got 0"),
    (7, {"warmup_batches": -1}, "policy sglang-adaptive: parameter warmup_batches must be >= 0, got -1"),
    (7, {"up_hysteresis": "high"}, "policy sglang-adaptive: parameter up_hysteresis must be a number, got 'high'"),
    (7, {"steps": 3}, "policy sglang-adaptive: unknown parameter 'steps'"),
])
def test_adaptive_bad_params_name_the_policy_and_parameter(k, params, message):
    with pytest.raises(UserError) as err:
        make_policy("sglang-adaptive", k, params)
    assert str(err.value) == message


# --- end to end: the simulator --------------------------------------------------------------------------------------
def replay(steps: pd.DataFrame, policy) -> None:
    """Each decode step's largest proposal is what ``policy`` proposes when told the steps before it (the batch's
    accepted total stands for its mean: everyone proposed the same k)."""
    decode = steps[(steps["kind"] == "decode")]
    for batch, k_max, accepted in zip(decode["batch_size"], decode["k_max"], decode["accepted"]):
        assert k_max == policy.propose(view(int(batch), max_k=8))[0]
        if k_max:
            policy.observe(outcome(range(batch), [k_max] * batch, [accepted] + [0] * (batch - 1)))


@pytest.mark.parametrize("policy,k,params", [("vllm-batch-table", 5, ("table=1:5,3:2,6:0",)),
                                             ("sglang-adaptive", 7, ("warmup_batches=3", "update_interval=2"))])
def test_simulate_runs_each_policy_and_its_steps_replay(capsys, tmp_path, policy, k, params):
    flags = [f for p in params for f in ("--policy-param", p)]
    code = main(["simulate", "--profile", PROFILE, "--policy", policy, "--k", str(k), *flags, "--rate", "8",
                 "--num-requests", "150", "--seed", "3", "--save-steps", "--format", "csv", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] == 150 and summary["acceptance_rate"] > 0
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert steps["k_max"].nunique() >= 2  # the policy moved k during the run
    replay(steps, make_policy(policy, k, dict(p.split("=") for p in params)))


def test_a_sweep_runs_both_policies(tmp_path):
    base = SimConfig.of(profile=PROFILE, rate=1.0, num_requests=60)
    specs = [f"vllm-batch-table:5/table={TABLE.replace(',', ';')}", "sglang-adaptive:7"]
    summary = run_sweep(build_cells(base, [2.0, 16.0], specs, [0]), tmp_path / "sweep", LocalExecutor(1))
    assert sorted(zip(summary["policy"], summary["rate"])) == [(s, r) for s in sorted(specs) for r in (2.0, 16.0)]
    assert (summary["requests"] == 60).all()


@pytest.mark.parametrize("flag", ["PLAIN_RUNS", "ADAPTIVE_RUNS"])
def test_adaptive_runs_are_the_per_step_path(monkeypatch, flag):
    """sglang-adaptive takes the simulator's runs of steps (propose_plain, observe_plain): bit for bit step by step."""
    config = SimConfig.of(profile=PROFILE, policy="sglang-adaptive", k=7, rate=8.0, num_requests=300, seed=5,
                          policy_params=(("warmup_batches", 2), ("update_interval", 2)))
    _fast_against_plain(monkeypatch, config, flag, "_plain_run" if flag == "PLAIN_RUNS" else "_adaptive_run")


def test_table_runs_asked_by_count_are_runs_asked_by_propose(monkeypatch):
    from simulator.core import runs

    config = SimConfig.of(profile=PROFILE, policy="vllm-batch-table", k=5, policy_params=(("table", TABLE),), rate=20.0,
                          num_requests=300, seed=9, save_steps=True)
    fast = run_simulation(config)
    monkeypatch.setattr(runs, "BY_COUNT", False)
    plain = run_simulation(config)
    _assert_same_runs(fast, plain)
    assert fast.recorder.steps == plain.recorder.steps


# --- end to end: the real engine ------------------------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize("policy,k,params", [("vllm-batch-table", 3, {"table": "1:3,3:1"}),
                                             ("sglang-adaptive", 7, {"warmup_batches": 0, "update_interval": 1,
                                                                     "ema_alpha": 1})])
def test_the_real_engine_runs_each_policy_losslessly_and_its_steps_replay(pair, policy, k, params):
    """The same policy objects in profiles/serving/engine.py: greedy output is the target's alone (no-spec's), and
    the recorded steps replay through a fresh policy."""
    pytest.importorskip("transformers")
    import copy

    import torch

    from profiles.serving.engine import RealEngineConfig, RealEngine

    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(4, 24, 6)]
    workload = Workload(np.zeros(6), [len(p) for p in prompts], [12, 1, 9, 16, 5, 12], "test")
    draft = copy.deepcopy(pair.target)
    with torch.no_grad():  # a draft that agrees with the target often, not always
        head = draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * head.std() * 0.2)

    def serve(name, k_, params_):
        engine = RealEngine(pair.target, draft, RealEngineConfig(max_num_seqs=4, max_k=k_),
                            make_policy(name, k_, params_), REAL_COST, np.random.default_rng(0))
        return engine.run(workload, prompts)

    result = serve(policy, k, params)
    assert result.outputs == serve("no-spec", 0, {}).outputs
    assert 0 < result.summary["acceptance_rate"] < 1
    assert result.steps[result.steps["kind"] == "decode"]["k_max"].nunique() >= 2
    replay(result.steps, make_policy(policy, k, params))


# --- outcomes: latency across load ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """tests/test_policy_outcomes.py's engine (cheap drafts, verification 10 ms + 0.2 ms a batched token; no-spec
    saturates near 70 req/s): acceptance 0.8 at light load and near saturation, and 0.95 at light load."""
    folder = tmp_path_factory.mktemp("engine_policies")
    profile = folder / "cheap_draft.json"
    profile.write_text(json.dumps({
        "target": {"base": 0.010, "per_batched_token": 0.0002, "per_context_token": 0.0},
        "draft": {"base": 0.001, "per_batched_token": 0.0, "per_context_token": 0.0},
        "prefill": {"base": 0.0, "per_prompt_token": 0.00002}, "overhead": {"base": 0.0}}))
    base = SimConfig.of(profile=str(profile), rate=1.0, num_requests=1000, prompt_len=64, output_len=64,
                        acceptance_rate=0.8, num_gpu_blocks=100_000)
    policies = ["no-spec", "fixed-k:3", "fixed-k:5", "fixed-k:7", f"vllm-batch-table:5/table={TABLE.replace(',', ';')}",
                "sglang-adaptive:7"]
    sweeps = {0.8: build_cells(base, [0.5, 55.0], policies, [0]),
              0.95: build_cells(base.replace(acceptance_rate=0.95), [0.5],
                                ["fixed-k:3", "fixed-k:7", "sglang-adaptive:7"], [0])}
    found = {}
    for acceptance, cells in sweeps.items():
        summary = run_sweep(cells, folder / f"sweep{acceptance}", LocalExecutor(1))
        found.update({(p, r, acceptance): m for p, r, m in zip(summary["policy"], summary["rate"],
                                                               summary["mean_latency"])})
    return found


def latency(outcomes, policy: str, rate: float, acceptance: float = 0.8) -> float:
    return outcomes[(policy.replace(",", ";"), rate, acceptance)]


@pytest.mark.parametrize("rate", [0.5, 55.0])
def test_the_batch_table_keeps_up_with_the_better_of_its_static_ends(outcomes, rate):
    """The table's ends are fixed k = 5 (one request) and no speculation (64 and more): within 5% of the better of the
    two at light load and near saturation, where the other end is 2.2x (no-spec) and 2.3x (fixed k = 5) slower."""
    ends = [latency(outcomes, "fixed-k:5", rate), latency(outcomes, "no-spec", rate)]
    assert latency(outcomes, f"vllm-batch-table:5/table={TABLE}", rate) <= 1.05 * min(ends)
    assert max(ends) >= 2.0 * min(ends)


def test_sglang_tiers_follow_acceptance_not_load(outcomes):
    """At light load the tiers keep up with the best static tier for the acceptance (3 at 0.8: from tier 3 the EMA
    settles at 0.8 + 0.64 + 0.51 = 1.95, under the 2.5 that moves up; 7 at 0.95); near saturation it stays at 3 and is
    slower than no speculation, as fixed k = 3 is, where the batch table is not."""
    for acceptance in (0.8, 0.95):
        best = min(latency(outcomes, p, 0.5, acceptance) for p in ("fixed-k:3", "fixed-k:7"))
        assert latency(outcomes, "sglang-adaptive:7", 0.5, acceptance) <= 1.05 * best
    assert latency(outcomes, "sglang-adaptive:7", 55.0) > 1.3 * latency(outcomes, "no-spec", 55.0)
    assert latency(outcomes, f"vllm-batch-table:5/table={TABLE}", 55.0) < latency(outcomes, "no-spec", 55.0)
