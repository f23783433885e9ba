"""Long prompts priced as attention pays (issue 30, item 2): a prefill chunk of q tokens whose sequence holds c
tokens in the KV cache already (its earlier chunks, or cached prefix blocks) costs a fresh prompt of q tokens plus its
attention over the c, T(c + q) - T(c) - T(q) + T(0) on the model's whole-prompt curve T
(:meth:`CostModel.prefill_context_time`): for a quadratic T the 2 c q cross term, and the chunks of one prompt sum to
the whole prompt plus one pass's fixed seconds per further chunk. Every kind of cost model, both roles, the engine's
two schedulers and a disaggregated prefill instance; without context, the prices of before bit for bit."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from profiles.validation.noise_floor import JitteredCost
from simulator.config import SimConfig
from simulator.core.runner import run_simulation
from simulator.costs.cost_model import CostModel, load_cost_model
from simulator.costs.cuda_graphs import CudaGraphPadding
from simulator.inputs.workload import Workload

DATA = Path(__file__).resolve().parents[1] / "profiles" / "data"
H200 = str(DATA / "h200-vllm__llama-3.1-8b__llama-3.2-1b.csv")
"""vLLM-calibrated Llama-3.1-8B + Llama-3.2-1B on an H200: prefill measured up to 4,096-token prompts."""
H100 = str(DATA / "h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b.csv")

#: A hand-written prefill (seconds): 10 ms a pass, 10 us a token, 1e-8 s per token squared (attention).
BASE, PER_TOKEN, PER_TOKEN_SQ = 0.01, 1e-5, 1e-8


def chunks_of(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(new tokens, tokens cached before them) of each chunk of a ``prompt``-token prompt cut every ``chunk`` tokens."""
    return [(min(chunk, prompt - done), done) for done in range(0, prompt, chunk)]


def priced_in_chunks(model: CostModel, chunks: list[tuple[int, int]], role: str = "target") -> float:
    """Each chunk a pass of its own, as the engine runs them."""
    return sum(model.prefill_chunks_time([chunk], role) for chunk in chunks)


def hand_written_json(tmp_path: Path) -> str:
    """The hand-written prefill above (target and draft: the draft's at a tenth), constant decode passes."""
    path = tmp_path / "cost.json"
    prefill = {"base": BASE, "per_prompt_token": PER_TOKEN, "per_prompt_token_sq": PER_TOKEN_SQ}
    path.write_text(json.dumps({"target": {"base": 0.02}, "draft": {"base": 0.002}, "overhead": {"base": 0.0},
                                "prefill": prefill, "draft_prefill": {k: v / 10 for k, v in prefill.items()}}))
    return str(path)


def hand_written(tmp_path: Path) -> CostModel:
    return load_cost_model(hand_written_json(tmp_path))


def every_kind(tmp_path: Path) -> dict[str, CostModel]:
    """One model of each kind the engine may be handed: a coefficient JSON, the H200 profile's linear and interp
    fits, the CUDA-graph wrapper, the validation's jittered wrapper (no scatter: its draws are all 1)."""
    interp = load_cost_model(H200, "interp")
    return {"json": hand_written(tmp_path), "linear": load_cost_model(H200, "linear"), "interp": interp,
            "cuda-graphs": CudaGraphPadding(interp, (1, 2, 4, 8)),
            "jittered": JitteredCost(interp, 0.0, np.random.default_rng(0))}


# -- the price of a chunk ----------------------------------------------------------------------------------------------
def test_a_hand_worked_chunk_costs_a_fresh_prompt_plus_its_cross_term(tmp_path):
    """q = 256 new tokens after c = 512 cached, on the hand-written prefill: fresh 0.01 + 256e-5 + 1e-8 x 256^2
    = 0.01321536 s, cross term 2 x 1e-8 x 512 x 256 = 0.00262144 s; the draft's a tenth of each."""
    model = hand_written(tmp_path)
    assert model.prefill_time(1, 256) == pytest.approx(0.01321536, rel=1e-12)
    assert model.prefill_context_time(256, 512) == pytest.approx(0.00262144, rel=1e-12)
    assert model.prefill_chunks_time([(256, 512)]) == pytest.approx(0.01321536 + 0.00262144, rel=1e-12)
    assert model.prefill_chunks_time([(256, 512)], "draft") == pytest.approx(0.001321536 + 0.000262144, rel=1e-12)
    # two chunks in one pass: the batch's fresh price (2 prompts, 384 tokens: 0.01 + 384e-5 + 1e-8 x 384^2 / 2)
    # plus the one with context's cross term (2 x 1e-8 x 512 x 128)
    assert model.prefill_chunks_time([(256, 0), (128, 512)]) == pytest.approx(0.01457728 + 0.00131072, rel=1e-12)


def test_without_a_draft_prefill_block_the_drafts_chunks_cost_nothing(cost_json):
    model = load_cost_model(cost_json(prefill=0.01, per_prompt_token_sq=1e-8))
    assert model.prefill_context_time(256, 512, "draft") == 0.0
    assert model.prefill_chunks_time([(256, 512)], "draft") == 0.0


@pytest.mark.parametrize("kind", ["json", "linear", "interp", "cuda-graphs", "jittered"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_chunks_price_grows_with_its_context(tmp_path, kind, role):
    model = every_kind(tmp_path)[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # contexts beyond the profile's grid, on purpose
        prices = [model.prefill_chunks_time([(2048, c)], role) for c in (0, 2048, 8192, 32768, 131072)]
    assert prices == sorted(prices) and prices[-1] > 2 * prices[0]
    assert prices[0] == model.prefill_time(1, 2048, role)


@pytest.mark.parametrize("kind", ["json", "linear", "interp", "cuda-graphs", "jittered"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_without_context_a_pass_is_priced_as_fresh_prompts_bit_for_bit(tmp_path, kind, role):
    model = every_kind(tmp_path)[kind]
    assert model.prefill_context_time(300, 0, role) == 0.0
    assert model.prefill_chunks_time([(300, 0)], role) == model.prefill_time(1, 300, role)
    assert model.prefill_chunks_time([(300, 0), (17, 0), (2000, 0)], role) == model.prefill_time(3, 2317, role)


def test_a_jittered_pass_over_chunks_draws_once():
    cost = load_cost_model(H200, "interp")
    one, two = (JitteredCost(cost, 0.2, np.random.default_rng(7)) for _ in range(2))
    draw = one.prefill_chunks_time([(512, 0)]) / cost.prefill_time(1, 512)
    assert two.prefill_chunks_time([(512, 1024)]) == pytest.approx(draw * cost.prefill_chunks_time([(512, 1024)]),
                                                                   rel=1e-12)


# -- the chunks of one prompt ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fitter", ["linear", "interp"])
def test_a_100k_prompt_in_8192_token_chunks_costs_the_whole_prompt_plus_a_pass_per_chunk(fitter):
    """The H200 profile's fit prices a 100,000-token prompt whole at 10.24 s (linear: 0.0039 s + 2.512e-5 s x 1e5
    + 7.728e-10 s x 1e10; interp the same to 0.02%, beyond its grid it moves as the fit does). In 8,192-token chunks
    (12 of 8,192 and one of 1,696) it cost 3.2 s when each chunk was priced as a fresh prompt; now it costs the whole
    plus 12 passes' fixed seconds (T(0): linear 3.9 ms, interp 5.2 ms), 10.29 and 10.30 s."""
    model = load_cost_model(H200, fitter)
    chunks = chunks_of(100_000, 8192)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 100,000 tokens: beyond the 4,096 measured, the fit extrapolates
        whole, fixed = model.prefill_time(1, 100_000), model.prefill_time(1, 0)
        chunked = priced_in_chunks(model, chunks)
        fresh = sum(model.prefill_time(1, q) for q, _ in chunks)
    print(f"{fitter}: whole {whole:.3f} s, in {len(chunks)} chunks {chunked:.3f} s (as fresh prompts {fresh:.3f} s), "
          f"a pass's fixed seconds {1000 * fixed:.2f} ms")
    assert len(chunks) == 13 and whole == pytest.approx(10.24, rel=0.001)
    assert chunked == pytest.approx(10.30, rel=0.01)
    assert chunked == pytest.approx(whole + 12 * fixed, rel=1e-12)  # telescoping: exact, no clamp acts here
    assert fresh == pytest.approx(3.2, rel=0.02)


def test_chunks_of_one_prompt_telescope_to_the_whole_under_the_linear_fit():
    model = load_cost_model(H200, "linear")
    sizes = [3000, 5000, 4096, 7904, 16]
    chunks = [(q, sum(sizes[:i])) for i, q in enumerate(sizes)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for role in ("target", "draft"):
            expected = model.prefill_time(1, 20016, role) + 4 * model.prefill_time(1, 0, role)
            assert priced_in_chunks(model, chunks, role) == pytest.approx(expected, rel=1e-12)


# -- the engine --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["no-spec", "fixed-k"])
def test_the_engine_prices_each_chunk_of_a_long_prompt_over_the_chunks_before_it(tmp_path, policy):
    """A 1,000-token prompt under chunked prefill with 256 tokens a step: chunks of 256, 256, 256 and 232 tokens after
    0, 256, 512 and 768 cached. Step i costs 0.01 + 1e-5 q + 1e-8 (q^2 + 2 c q) (and a tenth of it for the draft
    with speculation): 0.01321536, 0.01452608, 0.0158368, 0.01642176 s, which sum to the whole prompt,
    0.01 + 0.01 + 0.01, plus 3 passes' fixed 0.01 s: 0.06 s (as fresh prompts they summed to 0.0525 s)."""
    config = SimConfig.of(profile=hand_written_json(tmp_path), rate=1.0, num_requests=1, num_gpu_blocks=100_000,
                       scheduler="chunked-prefill", max_num_batched_tokens=256, policy=policy, save_steps=True)
    result = run_simulation(config, workload=Workload(np.zeros(1), [1000], [2], "hand-made"))
    steps = result.steps[result.steps["kind"] == "prefill"]
    scale = 1.1 if policy == "fixed-k" else 1.0
    assert list(steps["prefill_tokens"]) == [256, 256, 256, 232]
    assert list(steps["seconds"]) == pytest.approx([scale * s for s in (0.01321536, 0.01452608, 0.0158368, 0.01642176)],
                                                   rel=1e-12)
    assert result.requests["ttft"].iloc[0] == pytest.approx(scale * 0.06, rel=1e-12)


@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
def test_after_a_prefix_cache_hit_the_rest_of_the_prompt_attends_to_the_cached_tokens(tmp_path, scheduler):
    """Two requests with the same 1,000-token prompt, the second after the first has finished: its first 62 blocks of
    16 (992 tokens; the last token is always computed) are cached, so it prefills q = 8 tokens over c = 992:
    0.01 + 8e-5 + 1e-8 x 64 fresh (0.01008064 s) + 2 x 1e-8 x 992 x 8 = 0.00015872 s of cross term."""
    workload = Workload(np.array([0.0, 1.0]), [1000, 1000], [2, 2], "hand-made", prompt_id=[5, 5])
    config = SimConfig.of(profile=hand_written_json(tmp_path), rate=1.0, num_requests=2, num_gpu_blocks=100_000,
                       block_size=16, enable_prefix_caching=True, scheduler=scheduler, save_steps=True)
    result = run_simulation(config, workload=workload)
    assert result.summary["prefix_cache_hit_tokens"] == 992
    assert list(result.requests["ttft"]) == pytest.approx([0.03, 0.01008064 + 0.00015872], rel=1e-12)


def fresh_prompts(cost: CostModel) -> CostModel:
    """``cost`` with every prefill chunk priced as a fresh prompt of its own length (the pricing before issue 30):
    what a run in which no chunk has context must equal bit for bit."""
    cost.prefill_context_time = lambda query_tokens, context_tokens, role="target": 0.0
    return cost


@pytest.mark.parametrize("caching", [False, True])
def test_runs_in_which_no_chunk_has_context_are_priced_as_before_bit_for_bit(caching):
    """Prefill-first, prompts whole, distinct (no prefix hit), with a draft model: every prefill pass is of fresh
    prompts, and the run equals the one priced without context to the last bit; under chunked prefill with prompts
    longer than a step's budget it does not, and the first tokens come later."""
    cost, before = load_cost_model(H100, "interp"), fresh_prompts(load_cost_model(H100, "interp"))
    fields = dict(profile=H100, rate=12.0, num_requests=120, prompt_len=1500, output_len=64, length_dist="lognormal",
                  policy="fixed-k", k=3, seed=2, save_steps=True, enable_prefix_caching=caching)
    ours, theirs = (run_simulation(SimConfig.of(**fields), cost=model) for model in (cost, before))
    assert ours.summary["preemptions"] == 0 and ours.summary.get("prefix_cache_hit_tokens", 0) == 0
    assert ours.requests.equals(theirs.requests) and ours.steps.equals(theirs.steps)
    chunked = dict(fields, scheduler="chunked-prefill", max_num_batched_tokens=512)
    ours, theirs = (run_simulation(SimConfig.of(**chunked), cost=model) for model in (cost, before))
    assert ours.requests["ttft"].mean() > theirs.requests["ttft"].mean()


def test_a_disaggregated_prefill_instance_prices_its_chunks_over_their_context():
    """A 5,000-token prompt on a prefill instance cutting 2,048 tokens a step (chunked prefill): the first token
    comes after the chunk steps priced over the chunks before them, each with its prefill step's overhead."""
    from simulator.fleet.disagg import run_disagg

    config = SimConfig.of(rate=1.0, num_requests=1, prefill_replicas=1, decode_replicas=1, scheduler="chunked-prefill",
                       max_num_batched_tokens=2048)
    result = run_disagg(config, workload=Workload(np.zeros(1), [5000], [4], "hand-made"))
    cost = load_cost_model(config.cost.profile)
    t = 0.0
    for chunk in chunks_of(5000, 2048):
        t += cost.prefill_chunks_time([chunk]) + cost.prefill_overhead_time(1)
    assert result.requests["prefill_end_time"].iloc[0] == pytest.approx(t, rel=1e-12)
    assert t > sum(cost.prefill_time(1, q) + cost.prefill_overhead_time(1) for q, _ in chunks_of(5000, 2048))
