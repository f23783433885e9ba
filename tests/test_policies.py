"""Speculation policies on hand-built batches: the step-time formula, threshold rules, SmartSpec's goodput."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import BatchView, StepOutcome
from policies.goodput import MODES, expected_tokens
from policies.registry import load_policy_file, make_policy, names
from policies.step_time import predict_step_seconds, step_shape
from policies.errors import UserError
from tests.conftest import REPO


class LinearCost:
    """SmartSpec-shaped cost model (seconds): target 10 ms + 0.1 ms per batched token + 10 ns per context
    token; each draft pass ``draft_fixed`` + 0.01 ms per sequence; no overhead."""

    def __init__(self, draft_fixed: float = 1e-3, target_per_token: float = 1e-4) -> None:
        self.draft_fixed = draft_fixed
        self.target_per_token = target_per_token

    def target_time(self, batch_size: int, query_tokens: int, context_tokens: int) -> float:
        return 0.010 + self.target_per_token * query_tokens + 1e-8 * context_tokens

    def draft_time(self, batch_size: int, context_tokens: int) -> float:
        return self.draft_fixed + 1e-5 * batch_size

    def overhead_time(self, batch_size: int) -> float:
        return 0.0


class RecordingCost:
    """Logs every call; each call costs 1 s (draft), 10 s (target) or 100 s (overhead)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def target_time(self, batch_size: int, query_tokens: int, context_tokens: int) -> float:
        self.calls.append(("target", batch_size, query_tokens, context_tokens))
        return 10.0

    def draft_time(self, batch_size: int, context_tokens: int) -> float:
        self.calls.append(("draft", batch_size, context_tokens))
        return 1.0

    def overhead_time(self, batch_size: int) -> float:
        self.calls.append(("overhead", batch_size))
        return 100.0


def view(batch: int, ctx: int | list[int] = 512, waiting: int = 0, max_k: int = 8, cost=None,
         first_id: int = 0, draft_cost: bool = True) -> BatchView:
    ids = np.arange(first_id, first_id + batch, dtype=np.int64)
    return BatchView(time=0.0, request_ids=ids, context_lens=np.broadcast_to(np.asarray(ctx, dtype=np.int64), (batch,)),
                     generated=np.ones(batch, dtype=np.int64), num_waiting=waiting,
                     cost_model=cost or LinearCost(), max_k=max_k, draft_cost=draft_cost)


def outcome(request_ids, proposed, accepted) -> StepOutcome:
    return StepOutcome(time=0.0, request_ids=np.asarray(request_ids, dtype=np.int64),
                       proposed=np.asarray(proposed, dtype=np.int64), accepted=np.asarray(accepted, dtype=np.int64),
                       step_seconds=0.01)


def k_of(policy, v: BatchView) -> int:
    ks = policy.propose(v)
    assert (ks == ks[0]).all()
    return int(ks[0])


# --- the step-time formula --------------------------------------------------------------------------
def test_step_time_calls_one_draft_pass_per_position_then_verification():
    cost = RecordingCost()
    # request 0: 100 tokens of context, proposes 2; request 1: 200 tokens, proposes 0
    seconds = predict_step_seconds(cost, np.array([100, 200]), np.array([2, 0]), draft_cost=True)
    assert cost.calls == [
        ("target", 2, 4, 300),   # verify (2 + 1) + (0 + 1) tokens over 300 context tokens
        ("overhead", 2),
        ("draft", 1, 100),       # pass 1: request 0 at its context
        ("draft", 1, 101),       # pass 2: request 0, one drafted token further
    ]
    assert seconds == 10 + 100 + 1 + 1


def test_step_time_draft_passes_shrink_as_short_proposals_drop_out():
    shape = step_shape([10, 20, 30], [3, 1, 2])
    assert shape.draft_passes == ((3, 60), (2, 10 + 30 + 2 * 1), (1, 10 + 2))
    assert (shape.batch_size, shape.query_tokens, shape.context_tokens) == (3, 9, 60)


def test_step_time_ngram_proposer_has_no_draft_passes():
    cost = RecordingCost()
    assert predict_step_seconds(cost, [100, 200], [2, 0], draft_cost=False) == 110
    assert [c[0] for c in cost.calls] == ["target", "overhead"]


def test_step_time_with_linear_costs_by_hand():
    cost = LinearCost()
    # two requests, context 1000 each, k = 2: two draft passes of two sequences, six verified tokens
    expected = 2 * (1e-3 + 2e-5) + (0.010 + 6e-4 + 2000e-8)
    assert predict_step_seconds(cost, [1000, 1000], [2, 2], True) == pytest.approx(expected, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 500), st.integers(0, 5)), min_size=1, max_size=12),
       st.data())
def test_moving_one_request_matches_the_shape_rebuilt_from_scratch(requests, data):
    ctx = [c for c, _ in requests]
    ks = [k for _, k in requests]
    i = data.draw(st.integers(0, len(ks) - 1))
    delta = data.draw(st.sampled_from([d for d in (1, -1) if ks[i] + d >= 0]))
    moved = step_shape(ctx, ks).moved(ks[i], ctx[i], delta)
    ks[i] += delta
    assert moved == step_shape(ctx, ks)


# --- threshold --------------------------------------------------------------------------------------
def test_threshold_speculates_up_to_max_batch_running_requests():
    policy = make_policy("threshold", 4, {"max_batch": "8"})
    assert [k_of(policy, view(b)) for b in (1, 8, 9, 64)] == [4, 4, 0, 0]
    assert k_of(policy, view(8, waiting=100)) == 4  # waiting requests do not count by default


def test_threshold_total_count_includes_the_waiting_queue():
    policy = make_policy("threshold", 4, {"max_batch": 8, "count": "total"})
    assert [k_of(policy, view(4, waiting=w)) for w in (0, 4, 5)] == [4, 4, 0]


def test_threshold_table_picks_k_by_batch_size_and_zero_outside():
    policy = make_policy("threshold", 4, {"table": "1-8:4, 9-32:2, 40-50:1"})
    assert [k_of(policy, view(b)) for b in (1, 8, 9, 32, 33, 40, 50, 51)] == [4, 4, 2, 2, 0, 1, 1, 0]


def test_threshold_table_accepts_vllm_list_form():
    policy = make_policy("threshold", 3, {"table": [[1, 64, 3], [65, 128, 1], [129, 512, 0]]})
    assert [k_of(policy, view(b)) for b in (64, 65, 200)] == [3, 1, 0]


def test_threshold_never_exceeds_the_step_bound():
    policy = make_policy("threshold", 4, {"max_batch": 8})
    assert k_of(policy, view(2, max_k=2)) == 2


@pytest.mark.parametrize("params, message", [
    ({"table": "1-8:4,8-16:2"}, "policy threshold: parameter table ranges overlap, got '1-8:4,8-16:2'"),
    ({"table": "9-1:4"}, "policy threshold: parameter table ranges need 0 <= start <= end, got '9-1:4'"),
    ({"table": "1-8:5"}, "policy threshold: parameter table k must be in [0, 4] (the configured k bounds it), "
                         "got '1-8:5'"),
    ({"table": "1-8"}, "policy threshold: parameter table entries must look like start-end:k, got '1-8'"),
    ({"table": "a-8:1"}, "policy threshold: parameter table entries must be integers start-end:k, got 'a-8:1'"),
    ({"max_batch": "-1"}, "policy threshold: parameter max_batch must be >= 0, got -1"),
    ({"max_batch": "many"}, "policy threshold: parameter max_batch must be an integer, got 'many'"),
    ({"max_batch": 8, "count": "queued"}, "policy threshold: parameter count must be one of running, total, "
                                          "got 'queued'"),
    ({}, "policy threshold: give exactly one of parameters max_batch, table (got neither)"),
    ({"max_batch": 8, "table": "1-8:4"}, "policy threshold: give exactly one of parameters max_batch, table "
                                         "(got both)"),
    ({"max_batch": 8, "batch": 3}, "policy threshold: unknown parameter 'batch'"),
])
def test_threshold_bad_params_name_the_policy_and_parameter(params, message):
    with pytest.raises(UserError) as err:
        make_policy("threshold", 4, params)
    assert str(err.value) == message


# --- goodput: expected tokens and acceptance estimates -------------------------------------------------
@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 0.999999])
def test_expected_tokens_is_smartspec_closed_form(a):
    k = np.arange(6)
    assert expected_tokens(np.full(5, a)) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_expected_tokens_limits_and_per_position_form():
    assert expected_tokens(np.full(4, 1.0)).tolist() == [1, 2, 3, 4, 5]  # a -> 1: k + 1
    assert expected_tokens(np.zeros(4)).tolist() == [1, 1, 1, 1, 1]
    assert expected_tokens(np.array([0.9, 0.5])) == pytest.approx([1, 1.9, 1.9 + 0.9 * 0.5])


def test_acceptance_ema_follows_smartspec_update():
    policy = make_policy("goodput", 4, {"estimator": "ratio", "ema_weight": 0.15})  # SmartSpec's weight
    assert policy.acceptance_estimate == 0.7
    policy.observe(outcome([1, 2], proposed=[4, 4], accepted=[1, 3]))  # 4 of 8 accepted
    assert policy.acceptance_estimate == pytest.approx(0.85 * 0.7 + 0.15 * 0.5)
    before = policy.acceptance_estimate
    policy.observe(outcome([1, 2], proposed=[0, 0], accepted=[0, 0]))  # nothing proposed: skipped
    assert policy.acceptance_estimate == before


def test_token_estimator_is_a_ratio_of_moving_averages():
    policy = make_policy("goodput", 4, {"ema_weight": 0.15})
    # 4 accepted tokens; request 1 ended in a rejection, request 2 accepted all: 4 hits in 5 trials
    policy.observe(outcome([1, 2], proposed=[4, 2], accepted=[2, 2]))
    assert policy.acceptance_estimate == pytest.approx((0.85 * 0.7 + 0.15 * 4) / (0.85 * 1 + 0.15 * 5))


@pytest.mark.parametrize("k", [3, 5])
def test_token_estimator_is_consistent_where_smartspecs_ratio_is_biased(k):
    from simulator.inputs.acceptance import ConstantAcceptance

    draws = ConstantAcceptance(0.8, np.random.default_rng(0))
    tokens, ratio = make_policy("goodput", k, {"ema_weight": 0.01}), make_policy("goodput", k, {
        "estimator": "ratio", "ema_weight": 0.01})
    for _ in range(4000):  # batch size 1, k proposed every step
        accepted = draws.draw(np.array([0]), np.array([k]))
        for policy in (tokens, ratio):
            policy.observe(outcome([0], proposed=[k], accepted=accepted.tolist()))
    assert tokens.acceptance_estimate == pytest.approx(0.8, abs=0.04)
    assert ratio.acceptance_estimate == pytest.approx((0.8 - 0.8 ** (k + 1)) / (k * 0.2), abs=0.04)


def test_request_acceptance_falls_back_to_global_until_observed_and_is_dropped_on_finish():
    policy = make_policy("goodput", 4, {"acceptance": "request", "ema_weight": "0.5", "estimator": "ratio"})
    policy.observe(outcome([1, 2], proposed=[4, 0], accepted=[4, 0]))
    assert policy.acceptance_of(1) == pytest.approx(0.5 * 0.7 + 0.5 * 1.0)  # started from the global 0.7
    assert policy.acceptance_of(2) == policy.acceptance_estimate == pytest.approx(0.85)
    policy.finish(1)
    assert policy.acceptance_of(1) == policy.acceptance_estimate


def test_position_acceptance_counts_positions_reached():
    policy = make_policy("goodput", 3, {"acceptance": "position", "ema_weight": 1})
    # request 1: 3 proposed, first accepted, second rejected, third never reached; request 2: all 2 accepted
    policy.observe(outcome([1, 2], proposed=[3, 2], accepted=[1, 2]))
    assert policy.position_estimates == (1.0, 0.5, 0.7)  # 2/2 at j=1, 1/2 at j=2, j=3 unseen


# --- goodput: decisions -----------------------------------------------------------------------------
def test_goodput_k_falls_as_the_batch_grows():
    policy = make_policy("goodput", 8)
    ks = [k_of(policy, view(b)) for b in (1, 8, 64, 512)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] >= 3 and ks[-1] == 0  # long proposals alone, none when the batch is huge


def trained(policy, rate: float, steps: int = 40):
    """Feed ``steps`` outcomes where ``rate`` of 10 proposed tokens were accepted."""
    for _ in range(steps):
        policy.observe(outcome([0], proposed=[10], accepted=[round(10 * rate)]))
    return policy


def test_goodput_k_rises_with_acceptance():
    for batch in (1, 16):
        high = k_of(trained(make_policy("goodput", 8), 0.9), view(batch))
        low = k_of(trained(make_policy("goodput", 8), 0.3), view(batch))
        assert high > low, batch


def test_goodput_extreme_acceptance_rates():
    assert k_of(make_policy("goodput", 8, {"alpha_init": 1}), view(1)) == 8  # every token accepted
    assert k_of(make_policy("goodput", 8, {"alpha_init": 0}), view(1)) == 0


def test_goodput_with_an_expensive_draft_does_not_speculate():
    assert k_of(make_policy("goodput", 8, {"alpha_init": 0.9}), view(1, cost=LinearCost(draft_fixed=0.020))) == 0


def test_goodput_bonus_sends_a_near_tie_to_no_speculation():
    # B = 1, a = 0.5, target 10 ms flat, one draft pass 30/7 ms: goodput(1) = 1.5 / (100/7 ms) = 1.05 goodput(0)
    cost = LinearCost(draft_fixed=0.030 / 7 - 1e-5, target_per_token=0.0)
    v = view(1, max_k=1, cost=cost)
    assert k_of(make_policy("goodput", 1, {"alpha_init": 0.5, "bonus": 1.0}), v) == 1
    assert k_of(make_policy("goodput", 1, {"alpha_init": 0.5, "bonus": 1.04}), v) == 1
    assert k_of(make_policy("goodput", 1, {"alpha_init": 0.5, "bonus": 1.1}), v) == 0  # SmartSpec's 1.1
    assert k_of(make_policy("goodput", 1, {"alpha_init": 0.5}), v) == 1  # default bonus 1.0


def test_goodput_every_n_steps_keeps_the_last_decision_in_between():
    policy = make_policy("goodput", 4, {"every": 4})
    batches = [1, 512, 512, 512, 512, 1, 1, 1, 1, 512]
    assert [k_of(policy, view(b)) for b in batches] == [4, 4, 4, 4, 0, 0, 0, 0, 4, 4]
    every_step = make_policy("goodput", 4)
    assert [k_of(every_step, view(b)) for b in batches] == [4, 0, 0, 0, 0, 4, 4, 4, 4, 0]


def test_goodput_respects_the_step_bound():
    assert k_of(make_policy("goodput", 8, {"alpha_init": 1}), view(1, max_k=3)) == 3


def test_request_mode_gives_longer_proposals_to_better_accepted_requests():
    policy = make_policy("goodput", 8, {"mode": "request", "acceptance": "request"})
    for _ in range(40):
        policy.observe(outcome([0, 1, 2, 3], proposed=[10] * 4, accepted=[9, 9, 1, 1]))
    ks = policy.propose(view(4))
    assert ks[0] == ks[1] > ks[2] == ks[3]


def goodput_of(policy, v: BatchView, ks: np.ndarray) -> float:
    table = policy.expected_tokens_table(v.request_ids, int(ks.max(initial=0)))
    tokens = table[np.arange(v.batch_size), ks].sum()
    bonus = policy.bonus if not ks.any() else 1.0
    return bonus * tokens / predict_step_seconds(v.cost_model, v.context_lens, ks, v.draft_cost)


def test_request_mode_never_predicts_less_goodput_than_one_k_for_all():
    rng = np.random.default_rng(7)
    for _ in range(20):
        batch = int(rng.integers(1, 48))
        v = view(batch, ctx=rng.integers(10, 4000, batch).tolist(), cost=LinearCost(target_per_token=2e-5))
        rates = rng.uniform(0, 1, batch)
        policies = {mode: make_policy("goodput", 6, {"mode": mode, "acceptance": "request"}) for mode in MODES}
        for _ in range(10):
            accepted = rng.binomial(6, rates)
            for p in policies.values():
                p.observe(outcome(v.request_ids, [6] * batch, accepted))
        value = {mode: goodput_of(p, v, p.propose(v)) for mode, p in policies.items()}
        assert value["request"] >= value["batch"]


@pytest.mark.parametrize("params, message", [
    ({"alpha_init": 1.5}, "policy goodput: parameter alpha_init must be in [0, 1], got 1.5"),
    ({"ema_weight": "0"}, "policy goodput: parameter ema_weight must be in (0, 1], got 0"),
    ({"bonus": "-1"}, "policy goodput: parameter bonus must be in (0, inf), got -1"),
    ({"bonus": "lots"}, "policy goodput: parameter bonus must be a number, got 'lots'"),
    ({"every": "0"}, "policy goodput: parameter every must be >= 1, got 0"),
    ({"every": "2.5"}, "policy goodput: parameter every must be an integer, got '2.5'"),
    ({"mode": "tree"}, "policy goodput: parameter mode must be one of batch, request, got 'tree'"),
    ({"acceptance": "beta"}, "policy goodput: parameter acceptance must be one of global, request, position, "
                             "got 'beta'"),
    ({"alpha": 0.5}, "policy goodput: unknown parameter 'alpha'"),
])
def test_goodput_bad_params_name_the_policy_and_parameter(params, message):
    with pytest.raises(UserError) as err:
        make_policy("goodput", 4, params)
    assert str(err.value) == message


def test_goodput_params_parse_from_strings():
    policy = make_policy("goodput", 4, {"alpha_init": "0.8", "every": "3", "bonus": "1"})
    assert (policy.acceptance_estimate, policy.every, policy.bonus) == (0.8, 3, 1.0)


# --- registry -----------------------------------------------------------------------------------------
def test_builtin_policies_are_registered():
    assert {"no-spec", "fixed-k", "threshold", "goodput", "vllm-batch-table", "sglang-adaptive"} <= set(names())


def test_user_policy_file_registers_a_policy(tmp_path):
    path = tmp_path / "always_two.py"
    path.write_text(
        "import numpy as np\n"
        "from policies import Policy, register\n\n"
        "@register\n"
        "class AlwaysTwo(Policy):\n"
        "    name = 'test-always-two'\n\n"
        "    def propose(self, view):\n"
        "        return np.full(view.batch_size, 2, dtype=np.int64)\n")
    assert load_policy_file(str(path)) == ["test-always-two"]
    assert make_policy("test-always-two", 4).propose(view(3)).tolist() == [2, 2, 2]


def test_user_policy_file_that_registers_nothing_is_a_user_error(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("X = 1\n")
    with pytest.raises(UserError, match="registers no policy"):
        load_policy_file(str(path))


@pytest.mark.parametrize("batch, k", [(0, 0), (1, 0), (3, 1), (7, 5)])
def test_a_uniform_step_shape_is_the_step_shape_of_a_batch_proposing_one_k(batch, k):
    from policies.step_time import uniform_step_shape

    contexts = np.arange(100, 100 + 37 * batch, 37)
    general = step_shape(contexts, np.full(batch, k))  # every k equal: the general formula's fast path
    assert uniform_step_shape(batch, int(contexts.sum()), k) == general
    mixed = step_shape(np.append(contexts, 50), np.append(np.full(batch, k), k + 1))  # one more pass for one
    assert mixed.draft_passes[:k] == tuple((seqs + 1, tokens + 50 + j) for j, (seqs, tokens) in
                                           enumerate(general.draft_passes))
    assert mixed.draft_passes[k] == (1, 50 + k)


@pytest.mark.parametrize("draft_cost", [True, False])
def test_the_candidate_ks_of_a_batch_wide_choice_are_priced_exactly_as_their_shapes(draft_cost):
    from pathlib import Path

    from policies.step_time import shape_seconds, uniform_step_seconds, uniform_step_shape
    from simulator.costs.cost_model import load_cost_model

    model = load_cost_model(Path(__file__).resolve().parents[1] / "profiles" / "data" / "example_grid.csv", "interp")
    seconds = uniform_step_seconds(model, 6, 6 * 700, 5, draft_cost)
    assert seconds == [shape_seconds(model, uniform_step_shape(6, 6 * 700, k), draft_cost) for k in range(6)]
    assert seconds == sorted(seconds) and seconds[5] > seconds[0]  # more tokens verified (and drafted) cost more


@pytest.mark.parametrize("ks", [[3, 3, 3], [0, 0, 0], [1, 3, 2], [0, 2, 4]])
def test_run_seconds_is_the_step_formula_vectorised_bit_for_bit(ks):
    """The simulator's runs price a run of steps in one call; each step equals shape_seconds of its shape."""
    from policies.step_time import run_seconds, shape_seconds
    from simulator.costs.cost_model import load_cost_model

    model = load_cost_model(REPO / "profiles" / "data" / "example_grid.csv", "interp")
    rng = np.random.default_rng(0)
    steps = rng.integers(50, 3000, size=(6, len(ks)))  # each request's context at each step
    k = np.array(ks)
    k_max = max(ks)
    passes = [(int((k >= p + 1).sum()), [int(row[k >= p + 1].sum()) + int((k >= p + 1).sum()) * p for row in steps])
              for p in range(k_max)]
    for draft_cost in (True, False):
        vectorised = run_seconds(model, len(ks), int(k.sum()) + len(ks), steps.sum(axis=1).tolist(), passes, draft_cost)
        assert vectorised == [shape_seconds(model, step_shape(row, k), draft_cost) for row in steps]


def test_the_draft_lag_after_a_step_is_what_the_draft_has_not_seen():
    """After a prefill the draft lags by 1 (the first output token); a step in which the request proposed feeds the
    lag and leaves the token after the accepted ones, plus the last proposal when all were accepted; a step
    without a proposal leaves one more."""
    from policies.protocol import draft_lag

    assert [draft_lag(1, 3, a) for a in range(4)] == [1, 1, 1, 2]
    assert [draft_lag(lag, 0, 0) for lag in (1, 2, 5)] == [2, 3, 6]
    assert draft_lag(4, 2, 2) == 2 and draft_lag(4, 2, 1) == 1


def test_the_catch_up_pass_is_priced_at_the_draft_lag():
    """``catchup_step_seconds``: with every lag 1 it is the plain step formula; a lag of 2 prices the first draft
    pass at its tokens, packed (ragged) or padded to the longest lag (the cost model's batch layout)."""
    from dataclasses import dataclass

    from policies.step_time import catchup_step_seconds, predict_step_seconds

    @dataclass
    class Costs:  # seconds = tokens fed, to read the formula off; a draft pass 1e-3 per token
        batch_layout: str = "ragged"

        def target_time(self, batch_size, query_tokens, context_tokens):
            return 1.0 * query_tokens

        def draft_time(self, batch_size, context_tokens, query_tokens=None):
            return 1e-3 * (batch_size if query_tokens is None else query_tokens)

        def overhead_time(self, batch_size):
            return 0.0

    ctx, ks = [10, 20, 30], [2, 2, 0]
    assert catchup_step_seconds(Costs(), ctx, ks, [1, 1, 1]) == predict_step_seconds(Costs(), ctx, ks, True)
    # verify 3 + 3 + 1 tokens; draft pass 1 feeds the two proposing requests' lags (2 + 1 packed, 2 x 2 padded)
    assert catchup_step_seconds(Costs(), ctx, ks, [2, 1, 7]) == pytest.approx(7 + 3e-3 + 2e-3)
    assert catchup_step_seconds(Costs("padded"), ctx, ks, [2, 1, 7]) == pytest.approx(7 + 4e-3 + 2e-3)
