"""The real serving engine on tiny random models, on both forward paths (eager, optimized): lossless speculation,
the rejection rule's distribution, KV rollback, the n-gram proposer, the timing twin, acceptance bookkeeping and
bad input."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from policies.registry import make_policy  # noqa: E402
from profiles.models import forward  # noqa: E402
from profiles.acceptance import greedy_acceptance  # noqa: E402
from profiles.serving.engine import (RealEngine, RealEngineConfig, StepRunner, accept_greedy,  # noqa: E402
                                     accept_sampled, ngram_proposal)
from profiles.models.pairs import load_draft, load_pair, tokenizer_fingerprint  # noqa: E402
from profiles.serving.kv import PaddedBatch, SlotBatch  # noqa: E402
from simulator.inputs.acceptance import ConstantAcceptance  # noqa: E402
from simulator.costs.cost_model import model_from_dict  # noqa: E402
from policies.errors import UserError  # noqa: E402
from simulator.inputs.workload import Workload  # noqa: E402

pytestmark = pytest.mark.torch
COST = model_from_dict({"target": {"base": 0.02, "per_batched_token": 0.0005}, "draft": {"base": 0.0005},
                        "prefill": {"base": 0.01}}, "hand-written test costs")
#: (policy, k, parameters); threshold speculates only while at most 2 requests run.
POLICIES = [("no-spec", 0, {}), ("fixed-k", 1, {}), ("fixed-k", 3, {}), ("threshold", 3, {"max_batch": 2}),
            ("goodput", 4, {})]


@pytest.fixture(scope="module")
def close_draft(pair):
    """The target with noise on its output head: agrees with the target's argmax often, not always."""
    draft = copy.deepcopy(pair.target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=gen) * head.std() * 0.2)
    return draft


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(4, 24, 6)]
    # a prompt that repeats itself, so that the n-gram lookup finds something
    prompts[0] = prompts[0] + prompts[0] + prompts[0]
    workload = Workload(np.linspace(0.0, 0.02, 6), [len(p) for p in prompts], [12, 1, 9, 16, 5, 12], "test")
    return workload, prompts


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target alone, one unpadded sequence, one token per pass (the profiler's forward functions)."""
    logits, cache = forward.prefill_pass(model, torch.tensor([prompt]))
    out = [int(logits[0, -1].argmax())]
    while len(out) < n:
        logits = forward.decode_pass(model, cache, torch.tensor([[out[-1]]]))
        out.append(int(logits[0, -1].argmax()))
    return out


def serve(pair, draft, workload, prompts, policy="fixed-k", k=3, seqs=4, params=None, **config):
    engine = RealEngine(pair.target, draft, RealEngineConfig(max_num_seqs=seqs, max_k=k, **config),
                        make_policy(policy, k, params), COST, np.random.default_rng(0))
    return engine.run(workload, prompts)


# -- lossless greedy speculation ----------------------------------------------------------------------
@pytest.mark.parametrize("forward_path", ["eager", "optimized"])
@pytest.mark.parametrize("seqs", [1, 4])
@pytest.mark.parametrize("policy,k,params", POLICIES)
def test_greedy_output_is_the_targets_whatever_the_policy_and_batch(pair, close_draft, requests, policy, k, params,
                                                                   seqs, forward_path):
    workload, prompts = requests
    result = serve(pair, close_draft, workload, prompts, policy, k, seqs, params, forward=forward_path)
    expected = [reference_greedy(pair.target, p, int(n)) for p, n in zip(prompts, workload.output_tokens)]
    assert result.outputs == expected
    if policy != "no-spec":
        assert 0 < result.summary["acceptance_rate"] < 1  # some proposals accepted, some rolled back


@pytest.mark.parametrize("forward_path", ["eager", "optimized"])
@pytest.mark.parametrize("seqs", [1, 4])
def test_greedy_output_is_the_targets_with_the_ngram_proposer(pair, requests, seqs, forward_path):
    workload, prompts = requests
    result = serve(pair, None, workload, prompts, "fixed-k", 3, seqs, proposer="ngram", forward=forward_path)
    assert result.outputs == [reference_greedy(pair.target, p, int(n)) for p, n in zip(prompts, workload.output_tokens)]
    assert result.summary["proposed_tokens"] > 0


def test_records_have_the_simulators_schema_and_add_up(pair, close_draft, requests):
    from simulator.metrics import DERIVED_COLUMNS, EXTRA_COLUMNS, REQUEST_COLUMNS, STEP_COLUMNS

    workload, prompts = requests
    result = serve(pair, close_draft, workload, prompts)
    req = result.requests
    assert list(req.columns) == REQUEST_COLUMNS + DERIVED_COLUMNS + EXTRA_COLUMNS
    assert req["output_tokens"].tolist() == [len(o) for o in result.outputs] == workload.output_tokens.tolist()
    assert (req["first_token_time"] >= req["arrival_time"]).all()
    assert (req["finish_time"] >= req["first_token_time"]).all()
    steps = result.steps
    assert list(steps.columns[:len(STEP_COLUMNS)]) == STEP_COLUMNS
    assert (steps["seconds"] >= steps["target_seconds"] + steps["draft_seconds"]).all()
    assert (np.diff(steps["start_time"]) > 0).all()
    # every output token was emitted by a prefill or a decode step
    assert steps["emitted"].sum() + (steps["kind"] == "prefill").mul(steps["batch_size"]).sum() == \
        workload.output_tokens.sum()
    acc = result.acceptance.groupby("request_id")[["proposed", "accepted"]].sum()
    assert acc["proposed"].tolist() == req["proposed_tokens"][acc.index].tolist()
    # the trace keeps what the target accepted (the replay's input); the request counts only accepted tokens it
    # emitted, none past its last output token
    assert (req["accepted_tokens"][acc.index] <= acc["accepted"]).all()
    assert (req["accepted_tokens"] <= req["output_tokens"] - 1).all()
    assert (acc["accepted"] - req["accepted_tokens"][acc.index]).sum() <= 3 * len(acc)  # at most k past the end
    assert (result.acceptance["accepted"] <= result.acceptance["proposed"]).all()


@pytest.mark.parametrize("forward_path", ["eager", "optimized"])
def test_the_draft_cache_stays_in_step_with_the_context(pair, close_draft, requests, forward_path):
    """After every step the draft cache plus the pending tokens spell each request's context."""
    workload, prompts = requests
    engine = RealEngine(pair.target, close_draft, RealEngineConfig(max_num_seqs=4, max_k=3, forward=forward_path),
                        make_policy("fixed-k", 3), COST, np.random.default_rng(0))
    checked = []
    step = engine._decode_step

    def checked_step(*args):
        step(*args)
        if engine.rids:
            held = engine.draft_kv.lengths()
            for i, rid in enumerate(engine.rids):
                assert held[i] + len(engine.pending[i]) == len(prompts[rid]) + len(engine.outputs[rid])
            target_held = engine.target_kv.lengths()
            assert target_held == [len(prompts[r]) + len(engine.outputs[r]) - 1 for r in engine.rids]
            checked.append(True)

    engine._decode_step = checked_step
    engine.run(workload, prompts)
    assert len(checked) >= 4


# -- the rejection rule ----------------------------------------------------------------------------
P = np.array([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
Q = np.array([0.3, 0.1, 0.2, 0.1, 0.05, 0.25])


@pytest.mark.parametrize("q", [Q, np.eye(6)[2]], ids=["draft", "one-hot (n-gram)"])
def test_rejection_rule_emits_tokens_distributed_as_the_target(q):
    """Like vLLM's rejection-sampler test: draw x ~ q, verify, and the emitted first token follows p."""
    from scipy.stats import chisquare

    rng = np.random.default_rng(0)
    n = 20_000
    counts = np.zeros(6)
    accepted = 0
    for _ in range(n):
        x = int(rng.choice(6, p=q))
        a, token = accept_sampled([x], np.stack([P, P]), q[None], rng)
        counts[x if a == 1 else token] += 1
        accepted += a
    assert chisquare(counts, n * P).pvalue > 1e-3
    # acceptance probability = sum_x min(p(x), q(x)) (Leviathan et al. 2023, Sec. 3.4)
    assert accepted / n == pytest.approx(np.minimum(P, q).sum(), abs=0.015)


def test_rejection_rule_accepts_everything_when_draft_and_target_agree():
    rng = np.random.default_rng(1)
    assert accept_sampled([1, 3], np.stack([P, P, P]), np.stack([P, P]), rng)[0] == 2
    zero = np.array([0.0, 1.0, 0, 0, 0, 0])  # the target never emits token 0: a drafted 0 is rejected
    assert accept_sampled([0], np.stack([zero, P]), np.eye(6)[[0]], rng) == (0, 1)


def test_greedy_rule_accepts_the_leading_matches():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 4]) == (2, 9)
    assert accept_greedy([5, 6], [5, 6, 4]) == (2, 4)  # all accepted: the bonus token
    assert accept_greedy([], [8]) == (0, 8)


def test_sampled_speculation_with_the_target_as_its_own_draft_accepts_every_token(pair, requests):
    workload, prompts = requests
    result = serve(pair, pair.target, workload, prompts, temperature=1.0)
    assert result.summary["acceptance_rate"] == 1.0
    assert all(len(o) == n for o, n in zip(result.outputs, workload.output_tokens))


# -- KV caches ---------------------------------------------------------------------------------------
def row_kv(batch, row: int, layer: int = 0) -> torch.Tensor:
    """The keys of sequence ``row``'s valid slots, ``(heads, tokens, head_dim)``."""
    return batch.cache.layers[layer].keys[row][:, batch.valid[row]]


def fresh(model, tokens: list[int]) -> forward.BatchCache:
    batch = forward.empty_batch_cache(model, 1)
    forward.batch_pass(model, batch, [tokens], 1)
    return batch


def test_rollback_leaves_each_cache_equal_to_a_fresh_run_of_the_kept_tokens(pair):
    model = pair.target
    runner = StepRunner(model, None, 0.0, np.random.default_rng(0))
    prompts = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23]]
    kv = PaddedBatch(model)
    first = runner.first_tokens(runner.prefill(kv, prompts))
    greedy = [reference_greedy(model, p, 3) for p in prompts]
    # sequence 0 proposes its true next tokens (accepted), sequence 1 wrong ones (rejected at once)
    proposals = [greedy[0][1:3], [(greedy[1][1] + 1) % 1000, 5]]
    accepted, tokens = runner.verify(kv, first, proposals, [None, None])
    assert accepted == [2, 0]
    assert kv.lengths() == [len(prompts[0]) + 3, len(prompts[1]) + 1]
    for row, kept in enumerate([prompts[0] + greedy[0], prompts[1] + greedy[1][:1]]):
        assert torch.allclose(row_kv(kv.batch, row), row_kv(fresh(model, kept), 0), atol=1e-5)
    # one sequence alone: rolled-back slots are cropped, not just masked
    alone = PaddedBatch(model)
    runner.verify(alone, runner.first_tokens(runner.prefill(alone, [prompts[1]])), [[1, 2, 3]], [None])
    assert alone.batch.width == len(prompts[1]) + 1 and bool(alone.batch.valid.all())


def test_the_slot_cache_verifies_and_rolls_back_as_the_padded_one(pair):
    """The optimized path's cache: same acceptances, same next tokens and lengths as the eager one, and a
    removal moves the last row into the freed slot, keeping its tokens."""
    model = pair.target
    runner = StepRunner(model, None, 0.0, np.random.default_rng(0))
    prompts = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34]]
    greedy = [reference_greedy(model, p, 3) for p in prompts]
    proposals = [greedy[0][1:3], [(greedy[1][1] + 1) % 1000, 5], greedy[2][1:2]]
    results = []
    for kv in (PaddedBatch(model), SlotBatch(model, 4, 32)):
        first = runner.first_tokens(runner.prefill(kv, prompts))
        results.append((first, runner.verify(kv, first, proposals, [None] * 3), kv.lengths()))
    assert results[0] == results[1]
    assert results[1][1][0] == [2, 0, 1]
    slots = kv
    assert slots.remove([0]) == [2, 1]  # the last row moved into slot 0
    assert slots.lengths() == [len(prompts[2]) + 2, len(prompts[1]) + 1]
    logits = slots.extend([[greedy[2][2]], [greedy[1][1]]], all_logits=False)
    assert logits.argmax(dim=-1).tolist() == [reference_greedy(model, prompts[2], 4)[3], greedy[1][2]]


def test_the_timing_twin_takes_its_acceptances_from_the_model_and_says_tokens_are_meaningless(pair, requests):
    """A random-weight draft is almost never right; the twin accepts what the acceptance model draws instead
    (here every proposed token: rate 1), so each speculative step emits k + 1 tokens."""
    workload, prompts = requests
    engine = RealEngine(pair.target, pair.draft, RealEngineConfig(max_num_seqs=4, max_k=3, forward="optimized"),
                        make_policy("fixed-k", 3), COST, np.random.default_rng(0),
                        acceptance=ConstantAcceptance(1.0, np.random.default_rng(1)))
    result = engine.run(workload, prompts)
    assert result.summary["tokens"].startswith("meaningless")
    assert (result.acceptance["accepted"] == result.acceptance["proposed"]).all()
    assert result.requests["output_tokens"].tolist() == workload.output_tokens.tolist()
    lossless = serve(pair, pair.draft, workload, prompts, "fixed-k", 3, 4)
    assert lossless.summary["tokens"] == "lossless" and lossless.summary["acceptance_rate"] < 0.5


def test_speed_probes_run_with_the_engines_clock_stopped(pair, requests):
    """A probe taking 0.5 s, called every 50 ms of the engine's clock: it runs several times, yet no request's
    latency holds any of it (the tiny models serve the whole workload in about 0.2 s), and the outputs are those
    of a run without probes."""
    import time

    workload, prompts = requests
    calls = []
    probe = lambda: (calls.append(1), time.sleep(0.5))  # noqa: E731
    engine = RealEngine(pair.target, pair.draft, RealEngineConfig(max_num_seqs=4, max_k=3, probe_every=0.05),
                        make_policy("fixed-k", 3), COST, np.random.default_rng(0), probe=probe)
    result = engine.run(workload, prompts)
    assert result.summary["probes"] == len(calls) >= 2
    assert result.summary["probe_seconds"] >= 0.5 * len(calls)
    assert result.requests["latency"].max() < 0.5
    assert result.outputs == serve(pair, pair.draft, workload, prompts, "fixed-k", 3, 4).outputs


def test_idle_skipping_moves_the_clock_on_instead_of_sleeping(pair, requests):
    """The same requests with the last three arriving a minute later: with ``skip_idle`` the run takes about as
    long as it is busy (well under the minute), yet on its own clock those requests arrive at 60 s and are served
    from then on, and the outputs are those of the plain run."""
    import time

    workload, prompts = requests
    late = np.r_[workload.arrival_time[:3], workload.arrival_time[3:] + 60.0]
    gapped = Workload(late, workload.prompt_tokens, workload.output_tokens, "test, a minute's gap")
    t0 = time.perf_counter()
    result = serve(pair, pair.draft, gapped, prompts, skip_idle=True)
    assert time.perf_counter() - t0 < 30.0
    served = result.requests
    assert (served["first_token_time"] > served["arrival_time"]).all()
    assert served["arrival_time"].iloc[3:].min() == 60.0 + workload.arrival_time[3]
    assert result.summary["idle_skipped_seconds"] > 55.0
    prefills = result.steps[result.steps["kind"] == "prefill"]
    assert prefills["start_time"].iloc[-1] >= 60.0  # the late requests' prefill starts after they arrive
    assert result.outputs == serve(pair, pair.draft, workload, prompts).outputs
    assert serve(pair, pair.draft, workload, prompts).summary["idle_skipped_seconds"] == 0.0


def test_the_draft_lags_as_the_step_protocol_says(pair, requests):
    """After every decode step each request's pending tokens (in its context, not yet in the draft cache) number
    what :func:`policies.protocol.draft_lag` says, the simulator's rule for pricing the catch-up pass: here a
    threshold policy speculates (k = 3) only while at most 2 requests run, so the lag grows over steps without
    speculation and is 2 after a wholly accepted proposal."""
    from policies.protocol import draft_lag

    workload, prompts = requests
    engine = RealEngine(pair.target, pair.draft, RealEngineConfig(max_num_seqs=4, max_k=3),
                        make_policy("threshold", 3, {"max_batch": 2}), COST, np.random.default_rng(0),
                        acceptance=ConstantAcceptance(0.6, np.random.default_rng(1)))
    step, verify, lags = engine._decode_step, engine.runner.verify, []

    def verify_seen(kv, last, proposals, q, decided=None):
        accepted, tokens = verify(kv, last, proposals, q, decided)
        engine.seen = [len(p) for p in proposals], accepted
        return accepted, tokens

    def checked_step(*args):
        before = {rid: len(p) for rid, p in zip(engine.rids, engine.pending)}
        step(*args)
        outcome = dict(zip(before, zip(*engine.seen)))
        for rid, pending in zip(engine.rids, engine.pending):
            assert len(pending) == draft_lag(before[rid], *outcome[rid])
            lags.append(len(pending))

    engine.runner.verify, engine._decode_step = verify_seen, checked_step
    engine.run(workload, prompts)
    assert {1, 2}.issubset(lags) and max(lags) > 2


def test_merge_and_select_keep_every_sequence(pair):
    model = pair.target
    a, b, c = fresh(model, [1, 2, 3, 4, 5]), fresh(model, [6, 7]), fresh(model, [8, 9, 10])
    merged = forward.merge(model, [a, b, c])
    assert merged.batch_size == 3 and merged.width == 5 and merged.lengths().tolist() == [5, 2, 3]
    for row, part in enumerate([a, b, c]):
        assert torch.equal(row_kv(merged, row, layer=2), row_kv(part, 0, layer=2))
    kept = forward.select_rows(model, merged, [2, 0])
    assert kept.lengths().tolist() == [3, 5]
    assert torch.equal(row_kv(kept, 0), row_kv(c, 0)) and torch.equal(row_kv(kept, 1), row_kv(a, 0))


# -- n-gram lookup and greedy acceptance arithmetic ------------------------------------------------------
def test_ngram_proposal_continues_the_latest_earlier_match_of_the_longest_suffix():
    assert ngram_proposal([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [9, 5]  # "1 2 3" before the later "2 3"
    assert ngram_proposal([1, 2, 7, 1, 2, 8, 1, 2], 2, 1, 3) == [8, 1]  # the latest of two earlier "1 2"
    assert ngram_proposal([4, 5, 6, 4, 5], 3, 1, 3) == [6, 4, 5]
    assert ngram_proposal([1, 2, 3], 3, 1, 3) == []
    assert ngram_proposal([1, 2, 1], 0, 1, 3) == []


def test_greedy_acceptance_from_agreement_bits():
    bits = np.array([1, 1, 0, 1, 1, 1, 1, 0], dtype=bool)
    # k=2: accept 2 (bonus), then bit 3: accept 2 (bonus) at 3-4, then bit 6: 1 then reject at 7 -> 3 steps
    assert greedy_acceptance(bits, 2) == (5, 1, 3)
    # k=1: bits 0, 3, 5 accepted, each followed by a bonus token that skips the next bit; 2 and 7 rejected
    assert greedy_acceptance(bits, 1) == (3, 2, 5)


# -- bad input --------------------------------------------------------------------------------------
def test_bad_inputs_are_user_errors(pair, requests, tmp_path):
    workload, prompts = requests
    other_vocab = forward.build_model(forward.load_config("tiny-draft", "t"), "fp32", torch.device("cpu"))
    other_vocab.config.vocab_size = 999
    with pytest.raises(UserError, match="vocabulary"):
        RealEngine(pair.target, other_vocab, RealEngineConfig(), make_policy("fixed-k", 3), COST,
                   np.random.default_rng(0))
    with pytest.raises(UserError, match="needs a draft model"):
        RealEngine(pair.target, None, RealEngineConfig(), make_policy("fixed-k", 3), COST, np.random.default_rng(0))
    long_prompt = [[1] * 8190]
    with pytest.raises(UserError, match="exceed the model's context of 8192 tokens"):
        serve(pair, pair.draft, Workload([0.0], [8190], [4], "t"), long_prompt)
    with pytest.raises(UserError, match="prompt has 3 tokens, the workload says 4"):
        serve(pair, pair.draft, Workload([0.0], [4], [4], "t"), [[1, 2, 3]])
    with pytest.raises(UserError, match="proposer must be one of"):
        RealEngineConfig(proposer="eagle")
    with pytest.raises(UserError, match="no such file"):
        load_draft(pair.target, None, tmp_path)
    with pytest.raises(UserError, match="--pair"):
        load_pair("gpt-5")


def test_a_draft_trained_for_another_tokenizer_is_refused(pair, tmp_path):
    class Tokenizer:
        bos_token, eos_token, pad_token = "<s>", "</s>", "</s>"

        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    ours, theirs = Tokenizer({"a": 0, "b": 1}), Tokenizer({"a": 0, "c": 1})
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(Tokenizer({"b": 1, "a": 0}))
    (tmp_path / "config.json").write_text(
        f'{{"tokenizer_fingerprint": "{tokenizer_fingerprint(theirs)}", "architecture": {{}}}}')
    (tmp_path / "draft.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="tokenizer_fingerprint .* differs from the target's"):
        load_draft(pair.target, ours, tmp_path)
