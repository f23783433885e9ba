"""Crossovers with their bands (simulator/studies/bands.py): where a policy stops paying, how far the fit's held-out
error and an acceptance 20% off move it."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.studies.bands import (Band, band_words, crossover_band, engine_name, fit_error, scaled_acceptance,
                                     stop_load)

DATA = Path(__file__).resolve().parents[1] / "profiles" / "data"
LOADS = [1.0, 2.0, 3.0]


def test_a_policy_stops_paying_where_its_latency_ratio_crosses_one_linearly_between_loads():
    assert stop_load(LOADS, [0.5, 0.8, 1.2]) == pytest.approx(2.5)  # 2 + (1 - 0.8) / (1.2 - 0.8)
    assert stop_load(LOADS, [1.1, 0.9, 0.8]) == 0.0  # slower already at the lightest load
    assert math.isnan(stop_load(LOADS, [0.5, 0.6, 0.9]))  # pays up to the heaviest


def test_a_level_asks_where_the_speed_up_falls_below_it():
    # speed-up 1 / ratio: 2, 1.25, 0.83; it falls below 1.1 where ratio x 1.1 crosses 1: 2 + 0.12 / 0.44
    assert stop_load(LOADS, [0.5, 0.8, 1.2], 1.1) == pytest.approx(2 + 0.12 / 0.44)
    assert stop_load(LOADS, [0.5, 0.8, 1.2], 0.9) == pytest.approx(2 + 0.28 / 0.36)


def test_the_fit_band_spans_the_speed_up_falling_to_one_plus_and_minus_the_held_out_error():
    band = crossover_band(LOADS, [0.5, 0.8, 1.2], error=0.1, ratios_by_factor={0.8: [0.7, 1.1, 1.5],
                                                                                1.2: [0.4, 0.6, 0.9]})
    assert band.crossover == pytest.approx(2.5)
    assert band.fit == (pytest.approx(2 + 0.12 / 0.44), pytest.approx(2 + 0.28 / 0.36))
    assert band.acceptance[0] == pytest.approx(1 + 0.3 / 0.4) and math.isnan(band.acceptance[1])
    assert crossover_band(LOADS, [0.5, 0.8, 1.2]) == Band(pytest.approx(2.5), None, None)


def test_a_band_in_words_says_each_end_and_where_the_sweep_ends():
    def show(load):
        return f"{load:.2g} req/s"

    band = Band(2.5, (2.25, 2.75), (1.75, math.nan))
    assert band_words(band, show, 1.0, 3.0) == ("stops paying from about 2.5 req/s (fit: 2.2 req/s to 2.8 req/s; "
                                                "acceptance x0.8 to x1.2: 1.8 req/s to beyond 3 req/s)")
    assert band_words(Band(math.nan, (math.nan, math.nan), None), show, 1.0, 3.0) == (
        "pays up to 3 req/s at least (fit: the same)")
    assert band_words(Band(0.0, None, (0.0, 1.5)), show, 1.0, 3.0) == (
        "slower than no-spec already at 1 req/s (acceptance x0.8 to x1.2: below 1 req/s to 1.5 req/s)")


def test_acceptance_is_scaled_per_probability_and_capped_at_one():
    base = SimConfig.of(rate=1.0, num_requests=10, policy="fixed-k", k=3, acceptance_rate=0.9)
    assert scaled_acceptance(base, 0.8).speculative.acceptance_rate == pytest.approx(0.72)
    assert scaled_acceptance(base, 1.2).speculative.acceptance_rate == 1.0
    positions = base.replace(acceptance="position", acceptance_positions=(0.9, 0.5))
    assert scaled_acceptance(positions, 1.2).speculative.acceptance_positions == (1.0, pytest.approx(0.6))
    replay = base.replace(acceptance="by-rank", acceptance_by_rank=str(DATA / "nowhere.csv"))
    with pytest.raises(UserError, match="^acceptance band: --acceptance by-rank is recorded"):
        scaled_acceptance(replay, 0.8)


def test_a_profile_fitted_to_an_engines_runs_names_it_and_its_largest_held_out_error_of_the_kind():
    profile = DATA / "h100-80gb-sglang0.5__qwen3-8b__eagle3-qwen3-8b.csv"
    points = json.loads(profile.with_suffix(".meta.json").read_text())["calibration"]["points"]
    held = [p for p in points if p["status"] == "held out"]
    assert engine_name(profile) == "SGLang 0.5.9"
    assert fit_error(profile) == max(abs(p["error"]) for p in held if not p["tree"])
    assert fit_error(profile, tree=True) == max(abs(p["error"]) for p in held if p["tree"])
    other = DATA / "h200-vllm__llama-2-7b__llama-68m.csv"  # calibrated without speculation: no fit band
    assert engine_name(other) is None and fit_error(other) is None
