"""The speed shortcuts of the simulator's per-step path give what the plain paths give, bit for bit (issue 16).

Each shortcut is switched in one place or has a plain twin: blocks of random draws against draws of one step's size,
step shapes of lists against arrays, the uniform-step memo against pricing the step, and the goodput policy's plain
Python path (``Goodput.fast``) against its numpy reference, both alone and in whole runs.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from policies import step_time
from policies.base import BatchView, StepOutcome
from policies.goodput import GRID, Goodput
from policies.step_time import predict_step_seconds, shape_seconds, step_shape, uniform_step_seconds
from simulator.config import SimConfig
from simulator.core.engine import _Uniforms
from simulator.core.runner import run_simulation
from simulator.costs.cost_model import load_cost_model
from simulator.inputs.acceptance import ConstantAcceptance

PROFILE = str(Path(__file__).resolve().parents[1] / "profiles" / "data" /
              "a100-80gb-analytical__llama-2-7b__llama-68m.csv")


@pytest.mark.parametrize("uniform_draws", [True, False])
@pytest.mark.parametrize("rate", [0.0, 0.3, 0.5, 0.8, 0.97, 1.0])
def test_constant_acceptance_blocks_are_the_per_step_draws(monkeypatch, rate, uniform_draws):
    """Draws in blocks against draws of one step's size; with acceptance.UNIFORM_DRAWS on and off (one k for everyone
    in every fourth step)."""
    from simulator.inputs import acceptance

    monkeypatch.setattr(acceptance, "UNIFORM_DRAWS", uniform_draws)
    model, rng = ConstantAcceptance(rate, np.random.default_rng(7)), np.random.default_rng(7)
    model.BLOCK = 50  # refills inside a step too
    for i in range(600):
        batch = i % 17 + 1
        ks = np.array([(i + j) % 6 if i % 4 else i % 6 for j in range(batch)], dtype=np.int64)
        steps = 1 if i % 3 else i % 5 + 1
        if i % 3 == 1:
            got = np.array(model.draw_list(list(range(batch)), ks.tolist()))[None]
        elif i % 3 == 2:
            got = model.draw(np.arange(batch), ks)[None]
        else:
            got = model.draw_steps(np.arange(batch), ks, steps)
        want = (np.broadcast_to(ks, (steps, batch)) if rate == 1.0
                else np.minimum(rng.geometric(1.0 - rate, size=(steps, batch)) - 1, ks))
        assert np.array_equal(got, want)


def test_uniform_blocks_are_the_per_step_draws():
    blocks, rng = _Uniforms(np.random.default_rng(3)), np.random.default_rng(3)
    blocks.BLOCK = 40
    for i in range(500):
        assert blocks.take(i % 23) == rng.random(i % 23).tolist()


def test_step_shape_of_lists_is_that_of_arrays():
    rng = np.random.default_rng(1)
    for _ in range(2000):
        batch = int(rng.integers(0, 40))
        ctx = rng.integers(1, 5000, size=batch).tolist()
        ks = (rng.integers(0, 6, size=batch) if rng.random() < 0.7 else np.full(batch, 3)).tolist()
        assert step_shape(ctx, ks) == step_shape(np.array(ctx, dtype=np.int64), np.array(ks, dtype=np.int64))


def test_uniform_step_memo_is_the_priced_step():
    cost = load_cost_model(PROFILE)
    rng = np.random.default_rng(2)
    for _ in range(300):
        batch = int(rng.integers(1, 64))
        ctx = rng.integers(1, 4000, size=batch).tolist()
        uniform_step_seconds(cost, batch, sum(ctx), 5, True)
        for ks in ([int(rng.integers(0, 6))] * batch, rng.integers(0, 6, size=batch).tolist()):
            got = predict_step_seconds(cost, ctx, ks, True)
            assert got == shape_seconds(cost, step_shape(ctx, ks), True)
        assert predict_step_seconds(cost, ctx, ks, False) == shape_seconds(cost, step_shape(ctx, ks), False)
    assert step_time._last_uniform[0] is cost


def _views(cost, seed: int, steps: int):
    """Random batches (views) and outcomes for a policy driven by hand."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        batch = int(rng.integers(1, 48))
        rids = rng.choice(500, size=batch, replace=False).astype(np.int64)
        ctx = rng.integers(10, 6000, size=batch).astype(np.int64)
        view = BatchView(float(step), rids, ctx, np.ones(batch, dtype=np.int64), int(rng.integers(0, 5)), cost, 4,
                         bool(rng.random() < 0.8))
        accept_rate = 0.2 if (step // 200) % 2 else 0.85  # acceptance that changes: decisions move
        yield view, lambda proposed: np.minimum(rng.geometric(1 - accept_rate, size=proposed.size) - 1, proposed)


@pytest.mark.parametrize("params", [{}, {"acceptance": "position"}, {"estimator": "ratio"}, {"every": 3},
                                    {"probe": 0, "bonus": 1.1}, {"mode": "request"},
                                    {"mode": "request", "acceptance": "position"}])
def test_goodput_fast_path_decides_as_the_reference(params):
    cost = load_cost_model(PROFILE)
    fast, plain = Goodput(4, **params), Goodput(4, **params)
    plain.fast = False
    for view, accept in _views(cost, 5, 1200):
        k_fast, k_plain = fast.propose(view), plain.propose(view)
        assert np.array_equal(k_fast, k_plain)
        accepted = accept(k_fast)
        for policy in (fast, plain):
            policy.observe(StepOutcome(view.time, view.request_ids, k_fast, accepted, 0.01))
        assert fast._global == plain._global
        assert fast.position_estimates == plain.position_estimates


@pytest.mark.parametrize("fields", [{}, {"policy_params": (("acceptance", "position"),), "acceptance": "position",
                                         "acceptance_positions": (0.9, 0.6, 0.4)},
                                    {"proposer": "ngram", "acceptance_rate": 0.4},
                                    {"scheduler": "chunked-prefill", "policy_params": (("estimator", "ratio"),)}])
def test_goodput_runs_alike_on_both_paths(monkeypatch, fields):
    config = SimConfig.of(profile=PROFILE, policy="goodput", rate=6.0, num_requests=150, seed=4, save_steps=True,
                          **fields)
    fast = run_simulation(config)
    monkeypatch.setattr(Goodput, "fast", False)
    plain = run_simulation(config)
    for column, values in fast.recorder.columns().items():
        assert np.array_equal(values, plain.recorder.columns()[column], equal_nan=True), column
    assert fast.recorder.steps == plain.recorder.steps


# --- issue 16, second pass: runs of adaptive steps, runs on lists, uniform steps priced in one call -------------------

def _columns_and_summary(result):
    summary = {k: v for k, v in result.summary.items() if "wall" not in k}
    return summary, result.recorder.columns(), result.recorder.num_steps


def _assert_same_runs(a, b):
    (sa, ca, na), (sb, cb, nb) = _columns_and_summary(a), _columns_and_summary(b)
    assert na == nb
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key] == sb[key] or (sa[key] != sa[key] and sb[key] != sb[key]), key
    for column, values in ca.items():
        assert np.array_equal(values, cb[column], equal_nan=True), column


def _counting(monkeypatch, cls, name):
    """Wrap a generator method of ``cls`` so that the test can see it was taken."""
    calls = []
    method = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        calls.append(args)
        return method(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return calls


def _fast_against_plain(monkeypatch, config, flag: str, method: str):
    """Run ``config`` with the shortcut ``runs.<flag>`` on (asserting ``DecodeRuns.<method>`` was taken) and off
    (asserting it was not); both results and the calls the shortcut made."""
    from simulator.core import runs
    from simulator.core.runs import DecodeRuns

    taken = _counting(monkeypatch, DecodeRuns, method)
    fast = run_simulation(config)
    assert taken
    calls = list(taken)
    monkeypatch.setattr(runs, flag, False)
    taken.clear()
    plain = run_simulation(config)
    assert not taken
    _assert_same_runs(fast, plain)
    return fast, plain, calls


def _loaded(which: str):
    data = Path(PROFILE).parent
    return {"bench": lambda: load_cost_model(PROFILE), "json": lambda: load_cost_model(data / "example.json"),
            "linear": lambda: load_cost_model(data / "example_grid.csv", "linear"),
            "interp": lambda: load_cost_model(data / "example_grid.csv", "interp")}[which]()


@pytest.mark.parametrize("which", ["bench", "json", "linear", "interp"])
def test_uniform_step_priced_in_one_call_is_the_scalar_calls(monkeypatch, which):
    """FAST_UNIFORM (CostModel.uniform_decode_times) against the scalar calls: the same seconds and the same warnings
    (contexts far beyond the example grid too), each on its own copy of the model (a model warns once per block)."""
    import warnings

    seen = {}
    for fast in (True, False):
        monkeypatch.setattr(step_time, "FAST_UNIFORM", fast)
        model, rng, out = _loaded(which), np.random.default_rng(11), []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(400):
                batch = int(rng.integers(1, 300))
                context = int(batch * rng.integers(1, 40000))
                k_max, draft = int(rng.integers(0, 7)), bool(rng.random() < 0.7)
                out.append(uniform_step_seconds(model, batch, context, k_max, draft))
                assert step_time.uniform_memo(model, batch, context, k_max, draft) == out[-1][k_max]
                assert step_time.uniform_memo(model, batch + 1, context, k_max, draft) is None
        seen[fast] = (out, [str(w.message) for w in caught])
    assert seen[True] == seen[False]


def test_goodput_plain_stepper_is_propose_and_observe():
    """Goodput.propose_plain / observe_plain (what the engine's plain runs call) against propose / observe."""
    cost = load_cost_model(PROFILE)
    for params in ({}, {"estimator": "ratio"}, {"every": 3}, {"probe": 0, "bonus": 1.1}, {"probe": 2}):
        lists, arrays = Goodput(4, **params), Goodput(4, **params)
        assert lists.steps_plain
        for view, accept in _views(cost, 9, 1500):
            got = lists.propose_plain(view.batch_size, int(view.context_lens.sum()), view.cost_model, view.max_k,
                                      view.draft_cost)
            want = arrays.propose(view)
            assert got == want.tolist()
            accepted = accept(want)
            lists.observe_plain(want.tolist(), accepted.tolist())
            arrays.observe(StepOutcome(view.time, view.request_ids, want, accepted, 0.01))
            state = ("_global", "_steps", "_last_k", "_last_by_request", "_idle", "_probes")
            assert [getattr(lists, a) for a in state] == [getattr(arrays, a) for a in state]
    for params in ({"mode": "request"}, {"acceptance": "position"}, {"acceptance": "request"}):
        assert not Goodput(4, **params).steps_plain


GOODPUT_RUNS = [{}, {"proposer": "ngram", "acceptance_rate": 0.4},
                {"rate": 40.0, "num_gpu_blocks": 600},  # preemptions: runs end before steps that might not fit
                {"policy_params": (("estimator", "ratio"), ("every", 3), ("bonus", 1.1), ("probe", 3))},
                {"acceptance": "beta", "rate": 12.0}, {"k": 0}, {"rate": 0.5, "num_requests": 60},
                {"policy_profile": str(Path(PROFILE).with_name("h100-80gb-analytical__llama-2-7b__llama-68m.csv"))}]


@pytest.mark.parametrize("fields", GOODPUT_RUNS + [{"replay": True, "speculative_num_steps": 5,  # trees, replayed
                                                      "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8,
                                                      "k": 7}])
def test_plain_runs_are_the_per_step_path(monkeypatch, tmp_path, fields):
    """runs.PLAIN_RUNS (several goodput steps per SimPy event) against one event per step, bit for bit."""
    if fields.get("replay"):  # recorded streams: a model with its own tree walk
        path = tmp_path / "trace.csv"
        path.write_text("request_id,proposed,accepted\n" + "".join(f"{i % 5},4,{(i * 7) % 5}\n" for i in range(60)))
        fields = {**{name: value for name, value in fields.items() if name != "replay"}, "acceptance": "replay",
                  "acceptance_trace": str(path)}
    config = SimConfig.of(**{**dict(profile=PROFILE, policy="goodput", rate=8.0, num_requests=300, seed=5), **fields})
    _fast_against_plain(monkeypatch, config, "PLAIN_RUNS", "_plain_run")


STATIONARY = """
import numpy as np
from policies import Policy, register

@register
class Uneven(Policy):
    name = "test-uneven-stationary"
    stationary = True

    def propose(self, view):
        return np.minimum(view.request_ids % 4, view.max_k).astype(np.int64)
"""


@pytest.mark.parametrize("fields", [{"policy": "fixed-k"}, {"policy": "fixed-k", "rate": 40.0, "num_gpu_blocks": 600},
                                    {"policy": "threshold", "policy_params": (("max_batch", 8),)},
                                    {"policy": "fixed-k", "acceptance": "beta", "k": 2}, {"policy": "uneven"}])
def test_list_runs_are_the_numpy_runs(monkeypatch, tmp_path, fields):
    """runs.LIST_RUNS (a stationary policy's runs worked out on lists) against the numpy runs, bit for bit."""
    if fields.get("policy") == "uneven":  # proposals that differ across the batch
        path = tmp_path / "uneven.py"
        path.write_text(STATIONARY)
        fields = {"policy": "test-uneven-stationary", "policy_file": str(path)}
    config = SimConfig.of(**{**dict(profile=PROFILE, rate=8.0, num_requests=300, seed=6), **fields})
    _, _, calls = _fast_against_plain(monkeypatch, config, "LIST_RUNS", "_list_run")
    if fields["policy"] == "test-uneven-stationary":
        assert any(min(ks) != max(ks) for ks, *_ in calls)


# --- issue 16, third pass: stationary policies' runs of per-step steps (n-gram proposals, chunked prefill) -------------

STEP_RUNS = [{"proposer": "ngram", "acceptance_rate": 0.3, "ngram_match_prob": 0.2},
             {"proposer": "ngram", "acceptance_rate": 0.95, "ngram_match_prob": 0.9},
             {"proposer": "ngram", "rate": 40.0, "num_gpu_blocks": 600},  # preemptions
             {"proposer": "ngram", "policy": "threshold", "policy_params": (("max_batch", 8),)},
             {"proposer": "ngram", "ngram_match_prob": 1.0},  # every lookup hits: uniform steps
             {"scheduler": "chunked-prefill", "max_num_batched_tokens": 256},
             {"scheduler": "chunked-prefill", "max_num_batched_tokens": 8192, "rate": 20.0},
             {"scheduler": "chunked-prefill", "rate": 40.0, "num_gpu_blocks": 600},  # preemptions
             {"scheduler": "chunked-prefill", "rate": 30.0, "max_num_seqs": 8},  # full seats, a queue
             {"scheduler": "chunked-prefill", "proposer": "ngram", "acceptance": "beta"},
             {"scheduler": "chunked-prefill", "policy": "no-spec"},
             {"scheduler": "chunked-prefill", "policy": "threshold", "policy_params": (("max_batch", 8),)}]


@pytest.mark.parametrize("fields", STEP_RUNS)
def test_step_runs_are_the_per_step_path(monkeypatch, fields):
    """runs.STEP_RUNS (a stationary policy's per-step steps, several in one SimPy event: n-gram proposals, chunked
    prefill) against one event per step, bit for bit: summaries and request columns."""
    config = SimConfig.of(**{**dict(profile=PROFILE, policy="fixed-k", rate=8.0, num_requests=300, seed=7), **fields})
    fast, _, _ = _fast_against_plain(monkeypatch, config, "STEP_RUNS", "_plain_run")
    if "num_gpu_blocks" in fields:
        assert fast.summary["preemptions"] > 0


# --- issue 16, fourth pass: uniform runs kept lean, proposals by the running count -----------------------------------

UNIFORM_RUNS = [{"scheduler": "chunked-prefill"},
                {"scheduler": "chunked-prefill", "acceptance": "beta", "k": 2},
                {"scheduler": "chunked-prefill", "acceptance_rate": 1.0},  # every proposal accepted
                {"scheduler": "chunked-prefill", "policy": "no-spec"},  # k = 0: one token a step
                {"scheduler": "chunked-prefill", "policy": "threshold", "policy_params": (("max_batch", 8),),
                 "rate": 20.0},  # speculating and not, as the batch grows and shrinks
                {"scheduler": "chunked-prefill", "rate": 40.0, "num_gpu_blocks": 600},  # runs end for want of blocks
                {"scheduler": "chunked-prefill", "rate": 30.0, "max_num_seqs": 8},  # full seats, a queue
                {"scheduler": "chunked-prefill", "num_requests": 60, "rate": 0.5},  # an empty queue: arrivals end runs
                {"proposer": "ngram", "policy": "threshold", "policy_params": (("max_batch", 4),), "rate": 20.0}]


@pytest.mark.parametrize("fields", UNIFORM_RUNS)
def test_uniform_runs_are_the_plain_loop(monkeypatch, fields):
    """runs.UNIFORM_RUNS (a run of one k for everyone kept on tokens left and the context total, contexts, blocks and
    totals worked out at its end) against runs.STEP_RUNS' loop, bit for bit: summaries and request columns."""
    config = SimConfig.of(**{**dict(profile=PROFILE, policy="fixed-k", rate=8.0, num_requests=300, seed=8), **fields})
    fast, _, _ = _fast_against_plain(monkeypatch, config, "UNIFORM_RUNS", "_uniform_run")
    if "num_gpu_blocks" in fields:
        assert fast.summary["preemptions"] > 0


def _by_count_policies():
    from policies.registry import make_policy

    yield make_policy("no-spec", 4, {})
    yield make_policy("fixed-k", 4, {})
    yield make_policy("fixed-k", 6, {})  # more than max_k: capped
    yield make_policy("threshold", 4, {"max_batch": 8})
    yield make_policy("threshold", 4, {"table": "1-4:4,5-16:2,30-40:1"})


def test_proposals_by_count_are_propose():
    """k_by_count (what the engine asks under runs.BY_COUNT) against propose on random views; a threshold counting
    the queue, and a subclass with a propose of its own, are not asked by count."""
    from policies.static import FixedK
    from simulator.core.engine import _by_count

    cost = load_cost_model(PROFILE)
    for policy in _by_count_policies():
        assert _by_count(policy) is not None
        for view, _ in _views(cost, 3, 300):
            want = policy.propose(view).tolist()
            assert [policy.k_by_count(view.batch_size, view.max_k)] * view.batch_size == want

    class Mine(FixedK):
        def propose(self, view):
            return np.zeros(view.batch_size, dtype=np.int64)

    from policies.registry import make_policy
    assert _by_count(Mine(4)) is None
    assert _by_count(make_policy("threshold", 4, {"max_batch": 8, "count": "total"})) is None
    assert _by_count(make_policy("goodput", 4, {})) is None


@pytest.mark.parametrize("fields", [{"policy": "fixed-k"}, {"policy": "threshold", "policy_params": (("max_batch", 8),),
                                                            "rate": 20.0, "save_steps": True},
                                    {"policy": "fixed-k", "scheduler": "chunked-prefill", "proposer": "ngram"}])
def test_runs_asked_by_count_are_runs_asked_by_propose(monkeypatch, fields):
    """runs.BY_COUNT on and off: the same summaries and request columns (and steps, where kept)."""
    from simulator.core import runs

    config = SimConfig.of(**{**dict(profile=PROFILE, rate=8.0, num_requests=300, seed=9), **fields})
    fast = run_simulation(config)
    monkeypatch.setattr(runs, "BY_COUNT", False)
    plain = run_simulation(config)
    _assert_same_runs(fast, plain)
    assert fast.recorder.steps == plain.recorder.steps


def test_uniform_runs_go_on_past_a_finish(monkeypatch):
    """A uniform run whose step ends with a finish, nobody waiting, goes on with the smaller batch in the same event
    (more stretches of steps than runs), and still gives step by step's results."""
    config = SimConfig.of(profile=PROFILE, policy="fixed-k", scheduler="chunked-prefill", rate=2.0, num_requests=200,
                          seed=10)
    _goes_on_past_a_finish(monkeypatch, config, "UNIFORM_RUNS", "_uniform_run", "_uniform_steps")


def _goes_on_past_a_finish(monkeypatch, config, flag: str, run: str, stretch: str):
    """``config`` with the shortcut ``runs.<flag>`` on and off, bit for bit, and with it on more calls of the stretch
    method ``DecodeRuns.<stretch>`` than of the run method ``DecodeRuns.<run>``."""
    from simulator.core.runs import DecodeRuns

    runs_taken = _counting(monkeypatch, DecodeRuns, run)
    stretches = []
    steps = getattr(DecodeRuns, stretch)
    monkeypatch.setattr(DecodeRuns, stretch, lambda self, *a: stretches.append(a) or steps(self, *a))
    _fast_against_plain(monkeypatch, config, flag, run)
    assert len(stretches) > len(runs_taken) > 0


@pytest.mark.parametrize("fields", [{"scheduler": "chunked-prefill", "save_steps": True},
                                    {"policy": "goodput", "scheduler": "chunked-prefill"},  # the memo first
                                    {"proposer": "ngram", "save_steps": True, "ngram_match_prob": 0.9},
                                    {"rate": 40.0, "num_gpu_blocks": 600, "save_steps": True},
                                    {"policy": "test-uneven-stationary", "save_steps": True}])
def test_uniform_steps_priced_without_a_shape_are_predict_step_seconds(monkeypatch, tmp_path, fields):
    """runs.UNIFORM_STEPS (a per-step step of one k priced by the scalar formula, or the memo) on and off: the same
    summaries, request columns and step rows (seconds among them)."""
    from simulator.core import runs

    if fields.get("policy") == "test-uneven-stationary":
        (tmp_path / "uneven.py").write_text(STATIONARY)
        fields = {**fields, "policy_file": str(tmp_path / "uneven.py")}
    config = SimConfig.of(**{**dict(profile=PROFILE, policy="fixed-k", rate=8.0, num_requests=300, seed=12), **fields})
    fast = run_simulation(config)
    monkeypatch.setattr(runs, "UNIFORM_STEPS", False)
    plain = run_simulation(config)
    _assert_same_runs(fast, plain)
    assert fast.recorder.steps == plain.recorder.steps


NGRAM_RUNS = [{"acceptance_rate": 0.3, "ngram_match_prob": 0.2}, {"acceptance_rate": 0.95, "ngram_match_prob": 0.9},
              {"ngram_match_prob": 1.0}, {"ngram_match_prob": 0.0},  # every lookup hits; none does
              {"rate": 40.0, "num_gpu_blocks": 600},  # runs end for want of blocks, preemptions
              {"acceptance": "beta", "scheduler": "chunked-prefill"},
              {"policy": "threshold", "policy_params": (("max_batch", 8),), "rate": 12.0},
              {"rate": 0.5, "num_requests": 60, "k": 2}]


@pytest.mark.parametrize("fields", NGRAM_RUNS)
def test_ngram_runs_are_the_plain_loop(monkeypatch, fields):
    """runs.NGRAM_RUNS (a one-k policy's uniform runs under n-gram proposals: hits and misses drawn per step, totals
    from sums at the end) against runs.STEP_RUNS' loop, bit for bit: summaries and request columns."""
    config = SimConfig.of(**{**dict(profile=PROFILE, policy="fixed-k", proposer="ngram", rate=8.0, num_requests=300,
                                    seed=13), **fields})
    fast, _, _ = _fast_against_plain(monkeypatch, config, "NGRAM_RUNS", "_ngram_steps")
    if "num_gpu_blocks" in fields:
        assert fast.summary["preemptions"] > 0


# --- issue 16, fifth pass: goodput's decisions priced by a pricer per batch size, its token sums by sum ---------------

@pytest.mark.parametrize("which", ["bench", "json", "linear", "interp"])
def test_uniform_pricer_is_uniform_step_seconds(monkeypatch, which):
    """step_time.UNIFORM_PRICER (one pricer per batch size, k_max and draft_cost, its context-free terms worked out
    once) against uniform_step_seconds: the same seconds, the same memo and the same warnings, each flag on its own
    copy of the model (a model warns once per block). One pricer prices many context totals, near the grid and far
    beyond it (the example grid's), as a policy's pricer does over a run."""
    import warnings

    seen = {}
    for fast in (True, False):
        monkeypatch.setattr(step_time, "UNIFORM_PRICER", fast)
        model, rng, out, pricers = _loaded(which), np.random.default_rng(17), [], {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(600):
                batch = int(rng.integers(1, 300)) if rng.random() < 0.2 else int(rng.integers(1, 6))
                k_max, draft = int(rng.integers(0, 7)), bool(rng.random() < 0.7)
                key = (batch, k_max, draft)
                price = pricers.setdefault(key, step_time.uniform_pricer(model, *key))
                context = int(batch * rng.integers(1, 40000 if rng.random() < 0.1 else 2000))
                out.append(price(context))
                assert step_time.uniform_memo(model, batch, context, k_max, draft) == out[-1][k_max]
        seen[fast] = (out, [str(w.message) for w in caught])
    assert seen[True] == seen[False]
    if which in ("linear", "interp"):
        assert seen[True][1]  # far queries warned, on both paths alike


def test_sequential_sum_is_reduce():
    """goodput.SEQUENTIAL_SUM: ``sum(repeat(x, n - 1), x)`` is ``reduce(add, repeat(x, n - 1), x)`` (x added one at a
    time) for the interpreters that take it (before Python 3.12)."""
    from functools import reduce
    from itertools import repeat
    from operator import add

    from policies import goodput

    if not goodput.SEQUENTIAL_SUM:
        pytest.skip("this interpreter's sum compensates: the shortcut is off")
    rng = np.random.default_rng(19)
    for _ in range(20000):
        x = float(1.0 + rng.random() * rng.integers(1, 8))
        n = int(rng.integers(1, 600))
        assert sum(repeat(x, n - 1), x) == reduce(add, repeat(x, n - 1), x)


DECISIONS = [{}, {"save_steps": True}, {"proposer": "ngram", "acceptance_rate": 0.4},
             {"rate": 40.0, "num_gpu_blocks": 600},  # preemptions
             {"acceptance": "position", "acceptance_positions": (0.9, 0.6, 0.4),
              "policy_params": (("acceptance", "position"),)},
             {"scheduler": "chunked-prefill", "save_steps": True},
             {"profile": str(Path(PROFILE).with_name("example_grid.csv")), "rate": 30.0},  # far beyond the grid: warns
             {"profile": str(Path(PROFILE).with_name("example_grid.csv")), "fitter": "interp", "rate": 30.0}]


@pytest.mark.parametrize("flag", ["UNIFORM_PRICER", "SEQUENTIAL_SUM", "UNIFORM_DRAWS"])
@pytest.mark.parametrize("fields", DECISIONS)
def test_goodput_decisions_priced_alike(monkeypatch, flag, fields):
    """step_time.UNIFORM_PRICER, goodput.SEQUENTIAL_SUM and acceptance.UNIFORM_DRAWS on and off in whole goodput runs:
    the same summaries, request columns, step rows (where kept) and warnings."""
    from policies import goodput
    from simulator.inputs import acceptance

    config = SimConfig.of(**{**dict(profile=PROFILE, policy="goodput", rate=8.0, num_requests=300, seed=14), **fields})
    module = {"UNIFORM_PRICER": step_time, "SEQUENTIAL_SUM": goodput, "UNIFORM_DRAWS": acceptance}[flag]
    _runs_alike(monkeypatch, config, module, flag)


def _runs_alike(monkeypatch, config: SimConfig, owner, flag: str) -> None:
    """Run ``config`` (an engine or a fleet) with the shortcut ``owner.flag`` on and off: the same summaries, request
    columns, step rows (where kept) and warnings."""
    import warnings

    from simulator.fleet import run as run_config

    results = []
    for on in (True, False):
        monkeypatch.setattr(owner, flag, on)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append((run_config(config), [str(w.message) for w in caught]))
    (fast, fast_warned), (plain, plain_warned) = results
    _assert_same_runs(fast, plain)
    assert fast.recorder.steps == plain.recorder.steps
    assert fast_warned == plain_warned


ADAPTIVE_RUNS = [{}, {"rate": 40.0, "num_gpu_blocks": 600},  # runs end for want of blocks, preemptions
                 {"policy_params": (("estimator", "ratio"), ("every", 3), ("bonus", 1.1), ("probe", 3))},
                 {"acceptance_rate": 0.0},  # nobody speculates for long: probes every 16 steps
                 {"acceptance_rate": 1.0}, {"acceptance": "beta", "rate": 12.0},
                 {"acceptance": "position", "acceptance_positions": (0.9, 0.6, 0.4)},
                 {"k": 0}, {"k": 7, "rate": 20.0},
                 {"rate": 0.5, "num_requests": 60},  # an empty queue: arrivals end runs
                 {"policy_profile": str(Path(PROFILE).with_name("h100-80gb-analytical__llama-2-7b__llama-68m.csv"))},
                 {"proposer": "ngram", "acceptance_rate": 0.4}, {"proposer": "ngram", "ngram_match_prob": 1.0},
                 {"proposer": "ngram", "acceptance_rate": 0.0, "ngram_match_prob": 0.3},  # probes, most lookups miss
                 {"proposer": "ngram", "rate": 40.0, "num_gpu_blocks": 600},
                 # the estimate is the last step's: k drops by more than the tokens emitted since, so a proposal before
                 # the last reserves the most blocks (the rule that skips the others); small blocks, short of them
                 {"block_size": 4, "k": 7, "rate": 20.0, "num_gpu_blocks": 2400,
                  "policy_params": (("ema_weight", 1.0),)}]


@pytest.mark.parametrize("fields", ADAPTIVE_RUNS)
def test_adaptive_runs_are_the_plain_loop(monkeypatch, fields):
    """runs.ADAPTIVE_RUNS (goodput's runs kept on tokens left and the context total, asked and told every step;
    contexts, blocks and totals worked out at the end) against runs.PLAIN_RUNS' loop, bit for bit: summaries and
    request columns. A policy priced on another profile than the engine's misses the memo."""
    config = SimConfig.of(**{**dict(profile=PROFILE, policy="goodput", rate=8.0, num_requests=300, seed=15), **fields})
    fast, _, _ = _fast_against_plain(monkeypatch, config, "ADAPTIVE_RUNS", "_adaptive_run")
    if "num_gpu_blocks" in fields:
        assert fast.summary["preemptions"] > 0


def test_adaptive_runs_go_on_past_a_finish(monkeypatch):
    """An adaptive run whose step ends with a finish, nobody waiting, goes on with the smaller batch in the same event
    (more stretches of steps than runs), and still gives the plain loop's results."""
    config = SimConfig.of(profile=PROFILE, policy="goodput", rate=2.0, num_requests=200, seed=16)
    _goes_on_past_a_finish(monkeypatch, config, "ADAPTIVE_RUNS", "_adaptive_run", "_adaptive_steps")


# --- issue 30: token trees and adaptive fleets ------------------------------------------------------------------------
SGLANG = dict(speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8, k=7)
VLLM_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"
EXAMPLE = str(Path(PROFILE).with_name("example_grid.csv"))
H100 = str(Path(PROFILE).with_name("h100-80gb-analytical__llama-2-7b__llama-68m.csv"))


def _family():
    from policies.tree import TreeFamily, TreeShape, rank_table

    q = rank_table((0.8,), (0.6, 0.3, 0.1))
    return TreeFamily(TreeShape.sglang(5, 4, 8, q), q)


def _decided(policy: Goodput, batch: int, context: int, cost, max_k: int, draft: bool, tree) -> int:
    """The policy's decision for one batch (its state as it is), as propose_plain makes it."""
    if tree is None:
        policy._decide_uniform(batch, context, cost, max_k, draft)
    else:
        policy._decide_tree_uniform(batch, context, cost, max_k, draft, tree)
    return policy._last_k


@pytest.mark.parametrize("which", ["bench", "json", "h100"])
@pytest.mark.parametrize("trees", [False, True])
def test_a_decision_span_holds_at_every_point_of_it(which, trees):
    """The theory of Goodput.spans: every span a policy keeps (rates low..high, context totals lo..hi, decision k) is
    the decision priced from scratch at its corners, at points inside it and one token inside its ends, for chains
    (any rate between: the estimate is a ratio of averages) and trees (each grid rate of its range)."""
    cost = load_cost_model(H100) if which == "h100" else _loaded(which)
    family = _family() if trees else None
    rng = np.random.default_rng(23)
    spans = 0
    for _ in range(80):
        batch, draft, max_k = int(rng.integers(1, 40)), bool(rng.random() < 0.8), int(rng.integers(1, 8))
        policy = Goodput(7, bonus=float(rng.choice([1.0, 1.1])))
        if trees:
            policy._belief(family)
            policy._tree_pair = [(rng.integers(120, 190) + 0.5) / GRID, 1.0]  # a grid rate's estimate
        else:
            policy._global = [float(rng.random()), 1.0]
        _decided(policy, batch, int(batch * rng.integers(10, 6000)), cost, max_k, draft, family)
        fresh = Goodput(7, bonus=policy.bonus)  # decides from scratch: no span
        fresh.spans = False
        if trees:
            fresh._belief(family)
        for key, kept in policy._spans.items():
            for low, high, lo, hi, k in kept:
                spans += 1
                rates = range(low, high + 1) if trees else (low, high, *rng.uniform(low, high, 3))
                contexts = {lo, hi, min(lo + 1, hi), max(hi - 1, lo), *rng.integers(lo, hi + 1, 3).tolist()}
                for rate in rates:
                    if trees:
                        fresh._tree_pair = [(rate + 0.5) / GRID, 1.0]  # that grid rate
                    else:
                        fresh._global = [float(rate), 1.0]
                    for context in contexts:
                        assert _decided(fresh, key[0], int(context), cost, key[1], key[2], family) == k
    assert spans > 40


@pytest.mark.parametrize("trees", [False, True])
@pytest.mark.parametrize("which", ["bench", "linear", "interp"])
def test_goodput_with_decision_spans_decides_as_pricing_every_step(trees, which):
    """Goodput.spans on and off, driven by hand over batches whose sizes and contexts jump about and acceptance that
    changes: the same proposals every step, the same estimates and the same warnings (the example grid's far
    queries); the interpolating model is not exactly linear, so it keeps no span."""
    import warnings

    family = _family() if trees else None
    seen = {}
    for spans in (True, False):
        cost, rng = _loaded(which), np.random.default_rng(29)
        models = [ConstantAcceptance(rate, np.random.default_rng(seed)) for rate, seed in ((0.85, 30), (0.3, 31))]
        policy = Goodput(7)
        policy.spans = spans
        proposals = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3000):
                batch = int(rng.integers(1, 6)) if step % 500 < 250 else int(rng.integers(1, 60))
                context = batch * int(rng.integers(50, 3000 if rng.random() < 0.95 else 30000))
                proposed = policy.propose_plain(batch, context, cost, 7, bool(step % 7), family)
                model, rids = models[(step // 400) % 2], list(range(batch))  # acceptance that changes
                policy.observe_plain(proposed, model.draw_list(rids, proposed) if family is None else
                                     model.draw_tree(rids, proposed, family))
                proposals.append(proposed)
        seen[spans] = (proposals, [str(w.message) for w in caught], list(policy._global),
                       list(policy._tree_pair))
        if spans:
            assert bool(policy._spans) == (which != "interp")
    assert seen[True] == seen[False]


@pytest.mark.parametrize("trees", [False, True])
@pytest.mark.parametrize("params", [{}, {"estimator": "ratio"}, {"probe": 0}, {"bonus": 1.3}])
def test_a_goodput_stepper_is_observe_then_propose(trees, params):
    """Goodput.plain_stepper (a decision read from the span that held the last one while it holds; a chain's estimate
    updated in the stepper), and its ``hold`` where everyone proposed one k > 0 (runs.HELD_RUNS), against observe_plain
    then propose_plain, driven by hand over stretches of steps of one batch whose contexts grow and whose acceptance
    changes, so that spans are left: the same proposals every step and the same state after; most steps are proposed
    from a held span. Steppers are kept by batch size, as the engine
    keeps them, and before each stretch the policy's lists, dicts and arrays are put back as copies, as a fleet's
    replica puts back its state when it plans a run again."""
    cost = load_cost_model(PROFILE)
    family = _family() if trees else None
    seen, asked = {}, []
    for stepper in ("hold", "step", "plain"):  # told through step.hold where everyone proposed one k > 0; step; neither
        rng = np.random.default_rng(37)
        models = [ConstantAcceptance(rate, np.random.default_rng(seed)) for rate, seed in ((0.9, 38), (0.2, 39))]
        policy = Goodput(7, **params)
        propose = policy.propose_plain
        policy.propose_plain = lambda *args: asked.append(stepper) or propose(*args)  # (counted)
        proposals, steppers = [], {}
        for stretch in range(60):
            batch, context = int(rng.integers(1, 4)), int(rng.integers(100, 4000))
            model, rids = models[(stretch // 12) % 2], list(range(batch))  # acceptance that changes
            vars(policy).update({name: value.copy() for name, value in vars(policy).items()
                                 if isinstance(value, (list, dict, set, np.ndarray))})
            step = (steppers.setdefault(batch, policy.plain_stepper(batch, cost, 7, True, family))
                    if stepper != "plain" else None)
            proposed = accepted = None
            for _ in range(int(rng.integers(1, 150))):
                if stepper == "hold" and proposed is not None and proposed[0] and proposed.count(proposed[0]) == batch:
                    again = step.hold(proposed[0], accepted, context)
                    proposed = proposed if again is None else again
                elif step is not None:
                    proposed = step(proposed, accepted, context)
                else:
                    if proposed is not None:
                        policy.observe_plain(proposed, accepted)
                    proposed = policy.propose_plain(batch, context, cost, 7, True, family)
                accepted = model.draw_list(rids, proposed) if family is None else \
                    model.draw_tree(rids, proposed, family)
                proposals.append(proposed)
                context += sum(accepted) + batch
            policy.observe_plain(proposed, accepted)
        seen[stepper] = (proposals, list(policy._global), policy._steps, policy._last_k, policy._idle,
                         policy._probes, list(policy._tree_pair))
    assert seen["hold"] == seen["step"] == seen["plain"]
    assert 4 * asked.count("step") < 3 * asked.count("plain")  # the stepper asked propose_plain for < 3/4 of its steps
    assert asked.count("hold") == asked.count("step")


def test_a_goodput_stepper_only_where_a_decision_is_held():
    """No stepper (the engine then tells and asks) with the shortcut off, without spans, deciding every few steps, or
    where nobody may propose."""
    cost = load_cost_model(PROFILE)
    assert Goodput(4).plain_stepper(3, cost, 4, True) is not None
    assert Goodput(4, every=2).plain_stepper(3, cost, 4, True) is None
    assert Goodput(4).plain_stepper(3, cost, 0, True) is None
    for flag in ("held", "spans"):
        policy = Goodput(4)
        setattr(policy, flag, False)
        assert policy.plain_stepper(3, cost, 4, True) is None


SPAN_RUNS = [dict(policy="goodput"), dict(policy="goodput", save_steps=True),
             dict(policy="goodput", rate=40.0, num_gpu_blocks=600),  # preemptions
             dict(policy="goodput", policy_params=(("estimator", "ratio"), ("every", 3), ("bonus", 1.1))),
             dict(policy="goodput", acceptance="beta", rate=12.0), dict(policy="goodput", acceptance_rate=0.2),
             dict(policy="goodput", proposer="ngram", acceptance_rate=0.4),
             dict(policy="goodput", profile=EXAMPLE, rate=30.0),  # far beyond the grid: warns
             dict(policy="goodput", policy_profile=H100),
             dict(policy="goodput", scheduler="chunked-prefill", save_steps=True),
             dict(policy="goodput", replicas=3, router="least-outstanding", rate=2.0),
             dict(policy="goodput", **SGLANG), dict(policy="goodput", save_steps=True, **SGLANG),
             dict(policy="goodput", rate=40.0, num_gpu_blocks=600, **SGLANG),
             dict(policy="goodput", k=8, speculative_token_tree=VLLM_TREE, acceptance_rate=0.3, rate=20.0),
             dict(policy="goodput", policy_params=(("mode", "request"),), **SGLANG),
             dict(policy="goodput", replicas=3, router="round-robin", rate=2.0, **SGLANG)]


@pytest.mark.parametrize("flag, fields", [("spans", fields) for fields in SPAN_RUNS] +
                         [("held", fields) for fields in SPAN_RUNS] +
                         [("fast_trees", fields) for fields in SPAN_RUNS if "k" in fields])  # (trees only)
def test_decision_spans_and_kept_tree_numbers_run_alike(monkeypatch, flag, fields):
    """Goodput.spans, Goodput.held and Goodput.fast_trees on and off in whole runs (single engines and fleets, chains
    and trees): the same summaries, request columns, step rows (where kept) and warnings."""
    _runs_alike(monkeypatch, SimConfig.of(**{**dict(profile=PROFILE, rate=8.0, num_requests=300, seed=31), **fields}),
                Goodput, flag)


def test_a_goodput_fleet_at_light_load_runs_alike_with_and_without_spans(monkeypatch):
    """The bench's light-load fleet (Mooncake's conversation trace at 0.1 requests/s per replica, 8 replicas), its first
    400 requests: the same requests and per-replica table with decision spans as without."""
    from simulator.fleet import run as run_config
    from simulator.inputs import MOONCAKE

    config = SimConfig.of(profile=PROFILE, arrival="trace", trace=str(MOONCAKE), rate=0.8, num_requests=400,
                       policy="goodput", replicas=8, router="least-outstanding", seed=0)
    with pytest.warns(UserWarning, match="extrapolating"):  # Mooncake's prompts reach 23k tokens
        fast = run_config(config)
    monkeypatch.setattr(Goodput, "spans", False)
    with pytest.warns(UserWarning, match="extrapolating"):
        plain = run_config(config)
    _assert_same_runs(fast, plain)
    assert fast.replicas.equals(plain.replicas)


@pytest.mark.parametrize("which", ["bench", "json", "linear", "interp"])
def test_tree_and_step_pricers_are_the_scalar_calls(monkeypatch, which):
    """step_time.TREE_PRICER and STEP_PRICER (the linear model's context-free terms worked out once) on and off: the
    same seconds and warnings for the shapes of a tree family and chains, near the grid and far beyond it (the example
    grid's), each pairing of flags on its own copy of the model (a model warns once per block); a step's pricer is
    the family pricer's number of its shape."""
    import warnings

    from policies.tree import TreeShape

    family, seen = _family(), {}
    for fast in (True, False):
        monkeypatch.setattr(step_time, "TREE_PRICER", fast)
        monkeypatch.setattr(step_time, "STEP_PRICER", fast)
        model, rng, out = _loaded(which), np.random.default_rng(37), []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(300):
                batch, draft = int(rng.integers(1, 300)) if rng.random() < 0.2 else int(rng.integers(1, 6)), \
                    bool(rng.random() < 0.7)
                shapes = ([family.shape(k) for k in range(8)] if rng.random() < 0.5 else
                          [TreeShape.chain(k) for k in range(int(rng.integers(1, 7)))])
                prices = step_time.uniform_tree_pricer(model, batch, shapes, draft)
                one = step_time.uniform_step_pricer(model, batch, shapes[-1], draft)
                for _ in range(3):
                    context = int(batch * rng.integers(1, 40000 if rng.random() < 0.1 else 2000))
                    out.append((prices(context), one(context)))
                    assert out[-1][1] == out[-1][0][-1]
        seen[fast] = (out, [str(w.message) for w in caught])
    assert seen[True] == seen[False]


def test_affine_until_is_the_last_context_priced_without_a_warning():
    """LinearCostModel.affine_until: pricing a step at that context total warns nothing, one token more warns; once
    every block asked has warned it is inf; an interpolating model or a negative coefficient gives -inf."""
    import warnings

    data = Path(PROFILE).parent
    family = _family()
    for batch, draft in ((1, True), (7, True), (7, False), (200, True)):
        shapes = [family.shape(k) for k in range(8)]
        model = load_cost_model(data / "example_grid.csv", "linear")
        prices = step_time.uniform_tree_pricer(model, batch, shapes, draft)
        until = prices.affine_until()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if until == -math.inf:  # a batch beyond the grid: every context warns
                assert batch > 128
                prices(batch)
            else:
                prices(until)
                assert not caught
                prices(until + 1)
            assert caught
        for block in ("target", "draft"):
            model._warned.add(block)
        assert prices.affine_until() == math.inf
    interp = load_cost_model(data / "example_grid.csv", "interp")
    assert step_time.uniform_pricer(interp, 4, 4, True).affine_until() == -math.inf
    negative = load_cost_model(data / "example_grid.csv", "linear")
    negative._coef["draft"] = (-1e-4, *negative._coef["draft"][1:])
    assert step_time.uniform_pricer(negative, 4, 4, True).affine_until() == -math.inf
    assert step_time.uniform_pricer(negative, 4, 4, False).affine_until() > 0  # no draft pass: the draft's unasked


@pytest.mark.parametrize("flag", ["TREE_UNIFORMS", "TREE_LENGTHS"])
def test_tree_uniforms_in_blocks_are_the_per_step_draws(monkeypatch, flag):
    """acceptance.TREE_UNIFORMS: a constant model's tree draws in blocks against one draw a step, and
    acceptance.TREE_LENGTHS: a block's accepted lengths by shape worked out at once against one uniform at a time,
    mixed with chain draws (whose geometric blocks first put back the uniforms drawn ahead), refills inside steps too:
    the same draws."""
    from simulator.inputs import acceptance

    family = _family()
    seen = {}
    for blocks in (True, False):
        monkeypatch.setattr(acceptance, flag, blocks)
        model, rng, out = ConstantAcceptance(0.7, np.random.default_rng(41)), np.random.default_rng(43), []
        model.BLOCK = 23
        for i in range(800):
            batch = int(rng.integers(1, 30))
            ks = [int(rng.integers(0, 8))] * batch if rng.random() < 0.7 else rng.integers(0, 8, batch).tolist()
            kind = "tree" if i < 300 or rng.random() < 0.6 else "chain"
            out.append(model.draw_tree(list(range(batch)), ks, family) if kind == "tree" else
                       model.draw_list(list(range(batch)), [min(k, 4) for k in ks]))
        seen[blocks] = out
    assert seen[True] == seen[False]


@pytest.mark.parametrize("fields", [dict(policy="goodput", **SGLANG), dict(policy="fixed-k", **SGLANG),
                                    dict(policy="goodput", acceptance_rate=0.3, rate=20.0, **SGLANG),
                                    dict(policy="goodput", replicas=3, router="least-outstanding", rate=2.0, **SGLANG),
                                    dict(policy="goodput", replicas=3, router="round-robin", rate=2.0, **SGLANG)])
def test_tree_lengths_run_alike(monkeypatch, fields):
    """acceptance.TREE_LENGTHS in whole runs (single engines and fleets, whose replicas put the model's attributes back
    when they plan a run again): the same runs."""
    from simulator.inputs import acceptance

    _runs_alike(monkeypatch, SimConfig.of(**{**dict(profile=PROFILE, rate=8.0, num_requests=300, seed=53), **fields}),
                acceptance, "TREE_LENGTHS")


@pytest.mark.parametrize("fields", SPAN_RUNS + [dict(policy="goodput", acceptance_rate=0.0, **SGLANG),  # probes
                                                dict(policy="goodput", k=0)])
def test_held_runs_are_the_stepper_every_step(monkeypatch, fields):
    """runs.HELD_RUNS (a held proposal kept by the adaptive runs, told through the stepper's hold) on and off in whole
    runs: the same runs; where a decision holds (goodput's defaults, chains and trees) most steps keep their
    proposal."""
    from policies import goodput
    from simulator.core import runs

    kept = []
    stepper = goodput.Goodput.plain_stepper

    def counted(self, *args):
        step = stepper(self, *args)
        if step is not None:
            hold = step.hold
            step.hold = lambda *told: kept.append((again := hold(*told)) is None) or again
        return step

    monkeypatch.setattr(goodput.Goodput, "plain_stepper", counted)
    config = SimConfig.of(**{**dict(profile=PROFILE, rate=8.0, num_requests=300, seed=31), **fields})
    _runs_alike(monkeypatch, config, runs, "HELD_RUNS")
    if fields in (dict(policy="goodput"), dict(policy="goodput", **SGLANG)):
        assert 2 * kept.count(True) > len(kept) > 0


@pytest.mark.parametrize("fields", [dict(policy="fixed-k", **SGLANG), dict(policy="goodput", **SGLANG),
                                    dict(policy="fixed-k", proposer="ngram"), dict(policy="goodput"),
                                    dict(policy="fixed-k", scheduler="chunked-prefill", **SGLANG)])
def test_kept_pricers_run_alike(monkeypatch, fields):
    """runs.KEPT_PRICERS (the engine's pricers of uniform steps kept by batch size and k) on and off: the same runs."""
    from simulator.core import runs

    config = SimConfig.of(**{**dict(profile=PROFILE, rate=8.0, num_requests=300, seed=47), **fields})
    fast = run_simulation(config)
    monkeypatch.setattr(runs, "KEPT_PRICERS", False)
    _assert_same_runs(fast, run_simulation(config))
