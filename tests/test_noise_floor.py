"""The timing-noise floor of a validation (:mod:`profiles.validation.noise_floor`): the real passes' scatter read off
a steps table, the jittered cost model, and the floor it gives on the CPU validation's own profile. No torch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from profiles.validation.noise_floor import JitteredCost, pass_scatter, timing_floor
from simulator.config import SimConfig
from simulator.costs.cost_model import load_cost_model
from simulator.inputs.workload import Workload

#: The engine profile measured in run 6 of the shipped CPU validation (the cpu-330m + cpu-22m timing twin).
PROFILE = str(Path(__file__).resolve().parents[1] / "profiles" / "data" / "validate__cpu" / "run6" /
              "engine_profile.csv")
METRICS = ["mean_latency", "p90_latency", "mean_ttft", "p90_ttft", "mean_tpot", "throughput"]


def steps_frame(cost, scatter: float, shape_error: dict[int, float], speed: float = 1.0,
                passes: int = 300) -> pd.DataFrame:
    """Decode steps of batches of 1, 2 and 4 over growing contexts, each verification pass taking the cost model's
    time x the shape's error x the machine's speed x a lognormal draw of log-sd ``scatter``; a prefill step of
    each batch size too."""
    rng = np.random.default_rng(1)
    rows = []
    for i in range(passes):
        b = (1, 2, 4)[i % 3]
        context = b * (32 + i // 3 % 24)
        seconds = cost.target_time(b, b, context) * shape_error[b] * speed * rng.lognormal(0.0, scatter)
        rows.append({"kind": "decode", "batch_size": b, "k_max": 0, "prefill_tokens": 0, "proposed": 0,
                     "context_tokens": context, "target_seconds": seconds, "draft_seconds": 0.0})
    for b in (1, 2, 4):
        rows.append({"kind": "prefill", "batch_size": b, "k_max": 0, "prefill_tokens": 32 * b, "proposed": 0,
                     "context_tokens": 0, "target_seconds": cost.prefill_time(b, 32 * b), "draft_seconds": 0.0})
    return pd.DataFrame(rows)


def test_the_scatter_is_the_passes_own_not_the_cost_models_error_nor_the_machines_speed():
    cost = load_cost_model(PROFILE, "interp")
    errors = {1: 1.0, 2: 1.3, 4: 0.8}  # the cost model 30% low on batches of 2, 20% high on batches of 4
    assert pass_scatter(steps_frame(cost, 0.0, errors, speed=1.17), cost) == pytest.approx(0.0, abs=1e-9)
    assert pass_scatter(steps_frame(cost, 0.1, errors, speed=0.9), cost) == pytest.approx(0.1, rel=0.1)
    # shapes with fewer than MIN_PASSES_PER_SHAPE passes (the single prefill steps here) do not count
    assert pass_scatter(steps_frame(cost, 0.1, errors).iloc[-3:], cost) == 0.0


def test_a_jittered_cost_scatters_each_pass_around_the_same_mean():
    cost = load_cost_model(PROFILE, "interp")
    still = JitteredCost(cost, 0.0, np.random.default_rng(0))
    assert still.target_time(4, 16, 200) == cost.target_time(4, 16, 200)
    assert still.uniform_decode_times(2, 80, 3, True) == cost.uniform_decode_times(2, 80, 3, True)
    jittered = JitteredCost(cost, 0.2, np.random.default_rng(0))
    draws = np.array([jittered.target_time(4, 16, 200) for _ in range(20000)]) / cost.target_time(4, 16, 200)
    assert draws.mean() == pytest.approx(1.0, abs=0.01)  # mean 1: the jitter adds no bias
    assert np.log(draws).std() == pytest.approx(0.2, rel=0.03)
    targets, passes = jittered.uniform_decode_times(2, 80, 3, True)
    assert len(set(targets + passes)) == 4 + 3  # every pass its own draw
    assert jittered.overhead_time(4) == cost.overhead_time(4)  # the overhead is not scattered
    assert jittered.prices_catchup == cost.prices_catchup and jittered.path == cost.path


def test_the_floor_is_zero_without_scatter_and_largest_on_the_few_requests_percentiles():
    """On the CPU validation's profile, 24 requests at 0.8 req/s, fixed k = 3 at acceptance 0.6: without scatter the
    jittered simulations are the plain one; with the 12% a CPU run shows, the mean latency and the throughput
    move by about a percent, the p90 TTFT (between its third and fourth slowest requests) by several."""
    gaps = np.random.default_rng(0).standard_exponential(24)
    workload = Workload(np.cumsum(gaps) / 0.8, [32] * 24, np.full(24, 24), "test")
    config = SimConfig.of(arrival="poisson", rate=0.8, num_requests=24, policy="fixed-k", k=3, profile=PROFILE,
                          policy_profile=PROFILE, fitter="interp", acceptance="constant", acceptance_rate=0.6,
                          num_gpu_blocks=100_000)
    assert timing_floor(config, workload, 0.0, METRICS, draws=3) == {metric: 0.0 for metric in METRICS}
    floor = timing_floor(config, workload, 0.12, METRICS, draws=5)
    assert floor["mean_latency"] < 0.03 and floor["throughput"] < 0.02
    assert floor["p90_ttft"] > 2 * floor["mean_latency"]
    # the same draws give the same floor (a floor is a figure of the validation, reproducible)
    assert timing_floor(config, workload, 0.12, METRICS, draws=5) == floor
