"""The speed shortcuts of the simulator's per-step path give what the plain paths give, bit for bit (issue 16).

Each shortcut is switched in one place or has a plain twin: blocks of random draws against draws of one step's size,
step shapes of lists against arrays, the uniform-step memo against pricing the step, and the goodput policy's plain
Python path (``Goodput.fast``) against its numpy reference, both alone and in whole runs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from policies import step_time
from policies.base import BatchView, StepOutcome
from policies.goodput import Goodput
from policies.step_time import predict_step_seconds, shape_seconds, step_shape, uniform_step_seconds
from simulator.config import SimConfig
from simulator.core.engine import _Uniforms
from simulator.core.runner import run_simulation
from simulator.costs.cost_model import load_cost_model
from simulator.inputs.acceptance import ConstantAcceptance

PROFILE = str(Path(__file__).resolve().parents[1] / "profiles" / "data" /
              "a100-80gb-analytical__llama-2-7b__llama-68m.csv")


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.5, 0.8, 0.97, 1.0])
def test_constant_acceptance_blocks_are_the_per_step_draws(rate):
    model, rng = ConstantAcceptance(rate, np.random.default_rng(7)), np.random.default_rng(7)
    model.BLOCK = 50  # refills inside a step too
    for i in range(600):
        batch = i % 17 + 1
        ks = np.array([(i + j) % 6 for j in range(batch)], dtype=np.int64)
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
    config = SimConfig(profile=PROFILE, policy="goodput", rate=6.0, num_requests=150, seed=4, save_steps=True,
                       **fields)
    fast = run_simulation(config)
    monkeypatch.setattr(Goodput, "fast", False)
    plain = run_simulation(config)
    for column, values in fast.recorder.columns().items():
        assert np.array_equal(values, plain.recorder.columns()[column], equal_nan=True), column
    assert fast.recorder.steps == plain.recorder.steps
