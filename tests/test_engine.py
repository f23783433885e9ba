"""The serving engine: invariants on every run, queueing theory, Leviathan's tokens per step."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from simulator.config import SimConfig
from policies.errors import UserError
from simulator.core.runner import run_simulation
from simulator.inputs.workload import Workload


def run(cost: str, workload: Workload | None = None, **fields):
    fields.setdefault("num_gpu_blocks", 100_000)
    fields.setdefault("save_steps", True)
    if workload is None:
        fields.setdefault("rate", 4.0)
        fields.setdefault("num_requests", 300)
    else:
        fields.setdefault("rate", 1.0)
        fields.setdefault("num_requests", len(workload))
    return run_simulation(SimConfig.of(profile=cost, **fields), workload=workload)


def fixed_workload(arrivals, prompts, outputs) -> Workload:
    return Workload(np.asarray(arrivals, dtype=float), np.asarray(prompts, dtype=np.int64),
                    np.asarray(outputs, dtype=np.int64), "hand-made")


def check_invariants(result) -> None:
    """What must hold on any run (the issue's list)."""
    req, steps = result.requests, result.steps
    # every request finished exactly once (the recorder refuses a second finish), after it arrived
    assert req["finish_time"].notna().all()
    assert (req["first_token_time"] >= req["arrival_time"]).all()
    assert (req["finish_time"] >= req["first_token_time"]).all()
    # accepted <= proposed, per request and per step
    assert (req["accepted_tokens"] <= req["proposed_tokens"]).all()
    assert (steps["accepted"] <= steps["proposed"]).all()
    # time never goes backwards: steps follow one another
    ends = steps["start_time"] + steps["seconds"]
    assert (steps["seconds"] >= 0).all()
    assert (steps["start_time"].iloc[1:].to_numpy() >= ends.iloc[:-1].to_numpy() - 1e-12).all()
    # KV blocks never exceed capacity
    assert steps["kv_blocks_used"].max() <= result.summary["num_gpu_blocks"]


@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
@pytest.mark.parametrize("policy,acceptance", [("no-spec", "constant"), ("fixed-k", "beta")])
def test_invariants_hold_under_pressure(cost_json, scheduler, policy, acceptance):
    cost = cost_json(target=0.02, per_batched_token=1e-4, per_context_token=1e-7, prefill=0.01,
                     per_prompt_token=1e-5, overhead=0.001)
    result = run(cost, rate=20.0, num_requests=400, length_dist="lognormal", prompt_len=200, output_len=100,
                 num_gpu_blocks=400, block_size=16, max_num_seqs=64, max_num_batched_tokens=1024,
                 max_prompt_len=1024, scheduler=scheduler, policy=policy, k=4, acceptance=acceptance, seed=3)
    check_invariants(result)
    assert result.summary["preemptions"] > 0, "the small cache should force preemptions"
    assert result.summary["requests"] == 400


def test_every_request_gets_exactly_its_output_tokens(cost_json):
    from simulator.inputs.acceptance import make_acceptance
    from simulator.core.engine import EngineSpec, SimulatedEngine
    from simulator.metrics import Recorder
    from policies import make_policy
    from simulator.costs.cost_model import load_cost_model
    import simpy

    cost = load_cost_model(cost_json(per_batched_token=1e-4), "linear")
    wl = fixed_workload([0.0, 0.0, 0.1, 0.2], [10, 50, 7, 300], [1, 9, 33, 5])
    config = SimConfig.of(rate=1.0, num_requests=4, acceptance_rate=0.6, k=3)
    spec = EngineSpec(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=200, chunked_prefill=True,
                      max_k=3, draft_proposer=True, ngram_match_prob=0.5, speculative=True)
    env = simpy.Environment()
    rec = Recorder(wl.arrival_time, wl.prompt_tokens, wl.output_tokens, save_steps=True)
    engine = SimulatedEngine(env, spec, wl, cost, make_policy("fixed-k", 3), cost,
                             make_acceptance(config.speculative, np.random.default_rng(0)), np.random.default_rng(1),
                             rec)
    engine.start()
    env.run()
    assert engine.generated == [1, 9, 33, 5]
    assert engine.free_blocks == 200, "every block is returned"
    assert rec.finished == 4


def test_same_seed_same_requests_bit_for_bit(cost_json, tmp_path):
    cost = cost_json(per_batched_token=1e-4)
    a = run(cost, policy="fixed-k", acceptance="beta", length_dist="lognormal", seed=7)
    b = run(cost, policy="fixed-k", acceptance="beta", length_dist="lognormal", seed=7)
    c = run(cost, policy="fixed-k", acceptance="beta", length_dist="lognormal", seed=8)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    assert not a.requests.equals(c.requests)


def test_prefill_emits_the_first_token_and_decode_steps_follow(cost_json):
    # one request, prompt 10, 3 output tokens; prefill 0.5 s, decode step 0.1 s, no overhead
    cost = cost_json(target=0.1, prefill=0.5)
    result = run(cost, fixed_workload([1.0], [10], [3]))
    row = result.requests.iloc[0]
    assert (row.first_token_time, row.finish_time) == pytest.approx((1.5, 1.7))
    assert list(result.steps["kind"]) == ["prefill", "decode", "decode"]


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget(cost_json):
    cost = cost_json(target=0.1, prefill=0.0, per_prompt_token=0.001)
    result = run(cost, fixed_workload([0.0], [1000], [2]), scheduler="chunked-prefill",
                 max_num_batched_tokens=256)
    assert list(result.steps["prefill_tokens"]) == [256, 256, 256, 232, 0]
    assert list(result.steps["kind"]) == ["prefill"] * 4 + ["decode"]
    assert result.requests.iloc[0].first_token_time == pytest.approx(1.0)


def test_max_num_seqs_and_fcfs(cost_json):
    # two seats, four simultaneous requests: the last two start only when the first two finish
    cost = cost_json(target=0.1)
    result = run(cost, fixed_workload([0, 0, 0, 0], [4, 4, 4, 4], [3, 3, 3, 3]), max_num_seqs=2)
    assert result.requests["first_token_time"].round(9).tolist() == [0.0, 0.0, 0.2, 0.2]
    assert result.requests["finish_time"].round(9).tolist() == [0.2, 0.2, 0.4, 0.4]


def test_md1_mean_wait_matches_pollaczek_khinchine(cost_json):
    """M/D/1: one seat, no speculation, zero prefill cost, constant step: W = rho*D / (2*(1 - rho))."""
    step, outputs, rate = 0.25, 3, 1.0
    cost = cost_json(target=step)
    result = run(cost, rate=rate, num_requests=40_000, prompt_len=8, output_len=outputs, max_num_seqs=1,
                 save_steps=False, seed=1)
    service = (outputs - 1) * step  # the prefill (free) emits the first token
    rho = rate * service
    expected = rho * service / (2 * (1 - rho))
    assert result.requests["ttft"].mean() == pytest.approx(expected, rel=0.05)


def test_mg1_mean_wait_with_random_lengths(cost_json):
    """M/G/1 (Pollaczek-Khinchine): W = lambda E[S^2] / (2 (1 - rho)) with S = (output - 1) * step."""
    step, rate = 0.1, 2.0
    cost = cost_json(target=step)
    result = run(cost, rate=rate, num_requests=30_000, length_dist="lognormal", prompt_len=8, output_len=3,
                 length_sigma=0.5, max_num_seqs=1, save_steps=False, seed=2)
    service = (result.requests["output_tokens"].to_numpy() - 1) * step
    rho = rate * service.mean()
    expected = rate * (service ** 2).mean() / (2 * (1 - rho))
    assert 0.4 < rho < 0.7
    assert result.requests["ttft"].mean() == pytest.approx(expected, rel=0.06)


def test_infinite_server_has_no_queueing(cost_json):
    """Ciw-style: with free prefill and unlimited seats, no request waits longer than one step."""
    step = 0.02
    cost = cost_json(target=step)
    result = run(cost, rate=50.0, num_requests=2000, output_len=20, max_num_seqs=10_000)
    assert result.requests["ttft"].max() <= step + 1e-9


@pytest.mark.parametrize("a,k", [(0.8, 4), (0.6, 2), (0.9, 7)])
def test_tokens_per_step_at_batch_one_match_leviathan(cost_json, a, k):
    """Leviathan et al. (ICML 2023), eq. 1: E[tokens per step] = (1 - a^(k+1)) / (1 - a)."""
    cost = cost_json(target=0.01, draft=0.001)
    result = run(cost, fixed_workload([0.0], [16], [60_000]), policy="fixed-k", k=k, acceptance_rate=a, seed=4)
    decode = result.steps[result.steps["kind"] == "decode"].iloc[:-1]  # the last step may be cut short
    expected = (1 - a ** (k + 1)) / (1 - a)
    assert decode["emitted"].mean() == pytest.approx(expected, rel=0.01)
    assert result.summary["mean_acceptance_length"] == pytest.approx(expected, rel=0.01)


def test_step_time_counts_k_draft_passes_and_one_verification(cost_json):
    # target 10 ms + 1 ms per batched token; draft 2 ms per pass; k = 3: 3 drafts + verify 4 tokens = 6 + 14 ms
    cost = cost_json(target=0.010, per_batched_token=0.001, draft=0.002)
    result = run(cost, fixed_workload([0.0], [8], [50]), policy="fixed-k", k=3)
    decode = result.steps[result.steps["kind"] == "decode"]
    assert decode["seconds"].iloc[0] == pytest.approx(0.020)


def test_ngram_proposer_has_no_draft_cost_and_misses(cost_json):
    cost = cost_json(target=0.010, per_batched_token=0.001, draft=0.5)
    result = run(cost, fixed_workload([0.0], [8], [2000]), policy="fixed-k", k=3, proposer="ngram",
                 ngram_match_prob=0.25, seed=5)
    decode = result.steps[result.steps["kind"] == "decode"]
    speculated = decode["proposed"] > 0
    assert speculated.mean() == pytest.approx(0.25, abs=0.04)
    assert set(decode["seconds"].round(9)) == {0.011, 0.014}  # no 0.5 s draft passes ever


def test_preempted_request_recomputes_and_keeps_its_tokens(cost_json):
    # 6 blocks of 4 tokens: two requests that each grow to 12 tokens cannot both stay resident
    cost = cost_json(target=0.01)
    result = run(cost, fixed_workload([0.0, 0.0], [4, 4], [8, 8]), num_gpu_blocks=5, block_size=4)
    check_invariants(result)
    assert result.requests["preemptions"].tolist() == [0, 1], "the newest request is preempted"
    assert result.requests["output_tokens"].tolist() == [8, 8]


def test_a_request_that_can_never_fit_is_refused(cost_json):
    """With --strict-fit (by default such a request is ignored: tests/test_trust.py)."""
    cost = cost_json()
    with pytest.raises(UserError, match="request 1"):
        run(cost, fixed_workload([0.0, 1.0], [4, 400], [4, 4]), num_gpu_blocks=10, block_size=16, strict_fit=True)
    result = run(cost, fixed_workload([0.0, 1.0], [4, 400], [4, 4]), num_gpu_blocks=10, block_size=16)
    assert result.summary["ignored_request_ids"] == [1]


def test_memory_budget_derives_the_cache(cost_json):
    memory = {"device_memory_gb": 80.0, "target_weight_gb": 12.6, "draft_weight_gb": 0.13,
              "target_kv_bytes_per_token": 524288, "draft_kv_bytes_per_token": 6144}
    cost = cost_json(memory=memory)
    plain = run(cost, num_gpu_blocks=None, num_requests=5)
    spec = run(cost, num_gpu_blocks=None, num_requests=5, policy="fixed-k", k=4)
    # (80 * 0.9 - 12.6 - 2) GiB / (16 tokens * 512 KiB) = 57.4 GiB / 8 MiB
    assert plain.summary["num_gpu_blocks"] == int((80 * 0.9 - 12.6 - 2.0) * 1024 ** 3 // (16 * 524288))
    assert spec.summary["num_gpu_blocks"] < plain.summary["num_gpu_blocks"], "the draft holds weights and KV too"


def run_engine(cost_path: str, config: SimConfig, run_steps: int):
    """The engine on ``config``'s workload with runs of at most ``run_steps`` steps (1: step by step)."""
    import simpy

    from policies import make_policy
    from simulator.inputs.acceptance import make_acceptance
    from simulator.costs.cost_model import load_cost_model
    from simulator.core.engine import EngineSpec, SimulatedEngine
    from simulator.metrics import Recorder
    from simulator.inputs.workload import build_workload

    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(config.run.seed).spawn(4)]
    wl = build_workload(config.workload, rngs[0], rngs[1])
    cost = load_cost_model(cost_path, "linear")
    engine = config.engine
    spec = EngineSpec(max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                      block_size=engine.block_size, num_gpu_blocks=engine.num_gpu_blocks, chunked_prefill=False,
                      max_k=config.speculative.k, draft_proposer=True, ngram_match_prob=0.5,
                      speculative=config.speculative.policy != "no-spec", run_steps=run_steps)
    env = simpy.Environment()
    rec = Recorder(wl.arrival_time, wl.prompt_tokens, wl.output_tokens, save_steps=True)
    SimulatedEngine(env, spec, wl, cost, make_policy(config.speculative.policy, config.speculative.k), cost,
                    make_acceptance(config.speculative, rngs[2]), rngs[3], rec).start()
    env.run()
    return rec


def test_runs_of_steps_equal_single_steps_without_speculation(cost_json):
    """Without randomness a run of steps is exactly the same steps at the same times."""
    cost = cost_json(target=0.01, per_batched_token=1e-4, per_context_token=1e-7, prefill=0.005,
                     per_prompt_token=1e-5)
    config = SimConfig.of(rate=20.0, num_requests=300, length_dist="lognormal", prompt_len=100, output_len=60,
                          max_prompt_len=800, max_output_len=400, num_gpu_blocks=120, block_size=16, max_num_seqs=32,
                          seed=11)
    single, runs = run_engine(cost, config, 1), run_engine(cost, config, 64)
    assert runs.num_steps == single.num_steps
    assert runs.preemptions.sum() == single.preemptions.sum() > 0
    np.testing.assert_allclose(runs.finish_time, single.finish_time, rtol=0, atol=1e-9)
    np.testing.assert_allclose(runs.first_token_time, single.first_token_time, rtol=0, atol=1e-9)
    step_cols = ["start_time", "seconds", "batch_size", "emitted", "kv_blocks_used"]
    np.testing.assert_allclose(runs.steps_frame()[step_cols].to_numpy(float),
                               single.steps_frame()[step_cols].to_numpy(float), atol=1e-9)


def test_runs_of_steps_match_single_steps_statistically_with_speculation(cost_json):
    cost = cost_json(target=0.01, per_batched_token=1e-4, draft=0.001)
    config = SimConfig.of(rate=20.0, num_requests=3000, prompt_len=32, output_len=40, num_gpu_blocks=100_000,
                          policy="fixed-k", k=4, acceptance_rate=0.7, seed=12)
    single, runs = run_engine(cost, config, 1), run_engine(cost, config, 64)
    latency = [np.mean(r.finish_time - r.arrival_time) for r in (single, runs)]
    assert latency[1] == pytest.approx(latency[0], rel=0.03)
    assert runs.acceptance_length() == pytest.approx(single.acceptance_length(), rel=0.01)


def test_a_simulation_never_imports_pandas(tmp_path):
    """Start-up is part of a run's cost (the bench counts it): the simulation path reads its CSV files, runs
    and summarises without pandas, which takes longer to import than 10,000 requests take to simulate."""
    import subprocess
    import sys

    lengths = tmp_path / "lengths.csv"
    lengths.write_text("prompt_tokens,output_tokens\n100,20\n300,50\n")
    code = (f"import sys; from simulator.config import SimConfig; from simulator.core.runner import run_simulation; "
            f"r = run_simulation(SimConfig.of(rate=2.0, num_requests=50, length_dist='file', "
            f"length_file={str(lengths)!r})); "
            f"assert r.summary['requests'] == 50; print(sorted(m for m in sys.modules if m.split('.')[0] == 'pandas'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def run_engine_with_cost(cost, policy: str, run_steps: int = 64):
    """The engine with cost model object ``cost`` (any :class:`CostModel`) on a small fixed-length workload."""
    import simpy

    from policies import make_policy
    from simulator.core.engine import EngineSpec, SimulatedEngine
    from simulator.inputs.acceptance import make_acceptance
    from simulator.inputs.workload import build_workload
    from simulator.metrics import Recorder

    config = SimConfig.of(rate=20.0, num_requests=40, prompt_len=64, output_len=40, k=3, policy=policy, seed=5)
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(config.run.seed).spawn(4)]
    wl = build_workload(config.workload, rngs[0], rngs[1])
    spec = EngineSpec(max_num_seqs=16, max_num_batched_tokens=2048, block_size=16, num_gpu_blocks=2000,
                      chunked_prefill=False, max_k=3, draft_proposer=True, ngram_match_prob=0.5,
                      speculative=policy != "no-spec", run_steps=run_steps)
    env = simpy.Environment()
    rec = Recorder(wl.arrival_time, wl.prompt_tokens, wl.output_tokens, save_steps=True)
    SimulatedEngine(env, spec, wl, cost, make_policy(policy, 3), cost, make_acceptance(config.speculative, rngs[2]),
                    rngs[3], rec).start()
    env.run()
    assert rec.finished == 40
    return rec


@pytest.mark.parametrize("catch_up_rows", [True, False])
def test_the_drafts_catch_up_pass_is_priced_where_the_profile_measured_it(tmp_path, catch_up_rows):
    """Every proposal accepted (k = 2): after the first speculative step the draft has not seen 2 tokens of each
    request (its last proposal and the bonus), so the next step's first draft pass feeds 2 per sequence. A profile
    that timed draft passes of 2-3 tokens per sequence prices that (seconds = 1 ms per draft token, 10 ms per
    verified token); one that timed only 1 token per sequence prices every draft pass at one, as before."""
    from simulator.costs.profile_table import write_profile

    rows = [("target", "decode", b, q, c, 0.01 * b * q) for b in (1, 2, 4) for q in (1, 2, 3, 4) for c in (16, 256)]
    rows += [("draft", "decode", b, q, c, 0.001 * b * q) for b in (1, 2, 4) for q in ((1, 2, 3) if catch_up_rows
                                                                                      else (1,)) for c in (16, 256)]
    rows += [(role, "prefill", b, p, 0, 0.001 * b * p) for role in ("target", "draft") for b in (1, 2, 4)
             for p in (8, 16, 32)]
    profile = tmp_path / "catch_up.csv"
    write_profile(pd.DataFrame(rows, columns=["role", "phase", "batch_size", "query_len", "context_len", "seconds"]),
                  {"method": "analytical"}, profile)
    result = run(str(profile), fixed_workload([0.0, 0.0], [16, 16], [9, 9]), policy="fixed-k", k=2,
                 acceptance="constant", acceptance_rate=1.0, fitter="interp")
    decode = result.steps[result.steps["kind"] == "decode"]
    verify, drafts = 0.01 * 2 * 3, [0.002, 0.002]  # 2 requests verifying 3 tokens each; 2 draft passes of 1 token
    later = [0.004, 0.002] if catch_up_rows else drafts  # the first pass feeds 2 tokens a request
    assert decode["seconds"].tolist() == pytest.approx([verify + sum(drafts)] + [verify + sum(later)] * 2)


# -- prefill-first's budget against the longest prompt (vLLM v0: max_num_batched_tokens >= max_model_len) ----------
def test_prefill_first_refuses_a_chosen_budget_below_the_longest_prompt_and_chunked_prefill_takes_it(cost_json):
    """A 3,000-token prompt under a 2,048-token budget: prefill-first would prefill it alone over the budget, which vLLM
    v0 refuses as a config; chunked prefill cuts it into chunks of at most 2,048."""
    workload = fixed_workload([0.0, 0.1], [100, 3000], [5, 5])
    with pytest.raises(UserError, match=r"^--max-num-batched-tokens 2048: below the longest prompt, 3000 tokens "
                                        r"\(of hand-made\); prefill-first"):
        run(cost_json(), workload, max_num_batched_tokens=2048)
    chunked = run(cost_json(), workload, max_num_batched_tokens=2048, scheduler="chunked-prefill")
    assert chunked.steps["prefill_tokens"].max() <= 2048 and chunked.requests["finish_time"].notna().all()


def test_at_the_default_budget_a_longer_prompt_is_admitted_alone_and_said(cost_json):
    """The default budget (4,096 tokens) was likely never chosen: the run goes on as before and warns in one line."""
    from policies.errors import InputWarning

    workload = fixed_workload([0.0, 0.0], [5000, 100], [5, 5])
    with pytest.warns(InputWarning, match=r"--max-num-batched-tokens 4096 \(the default\): below the longest prompt, "
                                          r"5000 tokens"):
        result = run(cost_json(), workload)
    first = result.steps[result.steps["kind"] == "prefill"].iloc[0]
    assert (first["batch_size"], first["prefill_tokens"]) == (1, 5000)  # alone, over the budget
