"""Acceptance models: bounds, Leviathan's expected tokens, the distributions they claim, exact replay,
fitting, bad trace files and determinism."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from simulator.inputs.acceptance import (AcceptanceModel, BetaAcceptance, ConstantAcceptance, PositionAcceptance,
                                  ReplayAcceptance, fit_acceptance, make_acceptance, read_acceptance_trace)
from simulator.config import SimConfig, SpeculativeConfig
from policies.errors import UserError

K_MAX = 8


def write_trace(path: Path, steps: list[tuple[object, int, int]]) -> str:
    """A trace CSV with one ``request_id,proposed,accepted`` row per step."""
    path.write_text("request_id,proposed,accepted\n" + "".join(f"{r},{p},{a}\n" for r, p, a in steps))
    return str(path)


def record(model: AcceptanceModel, num_requests: int, steps: int, k: int) -> list[tuple[int, int, int]]:
    """Run ``model`` one request at a time for ``steps`` steps of ``k`` and record the steps as trace rows."""
    rows = []
    for r in range(num_requests):
        model.start(r)
        rows += [(r, k, int(model.draw(np.array([r]), np.array([k]))[0])) for _ in range(steps)]
        model.finish(r)
    return rows


def run(model: AcceptanceModel, k: int, steps: int, request: int = 0) -> list[int]:
    """Accepted counts of ``steps`` single-request steps proposing ``k``."""
    return [int(model.draw(np.array([request]), np.array([k]))[0]) for _ in range(steps)]


@pytest.fixture(scope="module")
def recorded_trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    steps = [("a", 3, 2), ("b", 4, 4), ("a", 3, 0), ("b", 2, 1), ("a", 3, 3), ("c", 0, 0)]
    return write_trace(tmp_path_factory.mktemp("traces") / "recorded.csv", steps)


def config(**acceptance: object) -> SimConfig:
    """A valid configuration with these acceptance fields (the workload fields do not matter here)."""
    return SimConfig.of(rate=1.0, num_requests=10, k=K_MAX, **acceptance)


def model_configs(trace: str) -> list[SimConfig]:
    return [config(acceptance="constant", acceptance_rate=0.7),
            config(acceptance="beta", acceptance_rate=0.6, acceptance_concentration=2.0),
            config(acceptance="position", acceptance_positions=(0.9, 0.5, 1.0)),
            config(acceptance="replay", acceptance_trace=trace)]


@settings(max_examples=40, deadline=None)
@given(proposed=st.lists(st.integers(0, K_MAX), min_size=0, max_size=20), seed=st.integers(0, 2**32))
def test_accepted_lies_in_zero_to_proposed_and_zero_proposed_gives_zero(recorded_trace: str,
                                                                        proposed: list[int], seed: int) -> None:
    for settings in model_configs(recorded_trace):
        model = make_acceptance(settings.speculative, np.random.default_rng(seed))
        ids = np.arange(len(proposed))
        for r in ids:
            model.start(int(r))
        for _ in range(5):
            accepted = model.draw(ids, np.array(proposed, dtype=np.int64))
            assert accepted.dtype == np.int64 and accepted.shape == (len(proposed),)
            assert np.all((0 <= accepted) & (accepted <= proposed)), settings.speculative.acceptance
            assert np.all(accepted[np.array(proposed) == 0] == 0)


CASES = [(0.3, 1), (0.5, 2), (0.8, 4), (0.9, 8)]


@pytest.mark.parametrize("a,k", CASES)
def test_constant_mean_emitted_tokens_match_leviathan(a: float, k: int) -> None:
    accepted = ConstantAcceptance(a, np.random.default_rng(1)).draw(np.zeros(200_000, np.int64),
                                                                    np.full(200_000, k))
    expected = (1 - a ** (k + 1)) / (1 - a)  # Leviathan et al. 2023, eq. 1
    assert (accepted + 1).mean() == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("a,k", CASES)
def test_constant_accepted_follows_the_truncated_geometric(a: float, k: int) -> None:
    n = 200_000
    accepted = ConstantAcceptance(a, np.random.default_rng(2)).draw(np.zeros(n, np.int64), np.full(n, k))
    pmf = np.array([a ** j * (1 - a) for j in range(k)] + [a ** k])
    observed = np.bincount(accepted, minlength=k + 1)
    assert stats.chisquare(observed, pmf * n).pvalue > 0.001


def test_constant_rates_zero_and_one_are_exact() -> None:
    proposed = np.array([0, 1, 4, 8, 3])
    ids = np.arange(5)
    assert ConstantAcceptance(0.0, np.random.default_rng(0)).draw(ids, proposed).tolist() == [0, 0, 0, 0, 0]
    assert ConstantAcceptance(1.0, np.random.default_rng(0)).draw(ids, proposed).tolist() == [0, 1, 4, 8, 3]


def test_beta_rates_have_the_configured_mean_and_variance() -> None:
    mean, c, n = 0.7, 10.0, 20_000
    model = BetaAcceptance(mean, c, np.random.default_rng(3))
    for r in range(n):
        model.start(r)
    rates = np.array([model.rate(r) for r in range(n)])
    assert rates.mean() == pytest.approx(mean, abs=4 * math.sqrt(mean * (1 - mean) / (c + 1) / n))
    assert rates.var() == pytest.approx(mean * (1 - mean) / (c + 1), rel=0.05)


def test_beta_draws_use_each_requests_own_rate() -> None:
    model = BetaAcceptance(0.5, 0.05, np.random.default_rng(4))  # rates pile up near 0 and 1
    for r in range(400):
        model.start(r)
    ids = np.arange(400)
    accepted = sum(model.draw(ids, np.full(400, 4)) for _ in range(200)) / (200 * 4)
    rates = np.array([model.rate(r) for r in ids])
    assert np.corrcoef(rates, accepted)[0, 1] > 0.95


def test_beta_keeps_a_restarted_requests_rate_until_it_finishes() -> None:
    model = BetaAcceptance(0.5, 2.0, np.random.default_rng(5))
    model.start(7)
    first = model.rate(7)
    model.start(7)
    assert model.rate(7) == first
    model.finish(7)
    model.start(7)
    assert model.rate(7) != first


def test_beta_mean_one_always_accepts_everything() -> None:
    model = BetaAcceptance(1.0, 10.0, np.random.default_rng(0))
    model.start(0)
    model.start(1)
    assert model.draw(np.array([0, 1]), np.array([5, 0])).tolist() == [5, 0]


def test_position_survival_is_the_product_of_position_probabilities() -> None:
    positions, k, n = (0.9, 0.7, 0.5), 5, 200_000
    accepted = PositionAcceptance(positions, k, np.random.default_rng(6)).draw(np.zeros(n, np.int64),
                                                                              np.full(n, k))
    survival = [np.prod((positions + (0.5,) * k)[:j]) for j in range(1, k + 1)]  # last value repeats
    assert survival == pytest.approx([0.9, 0.63, 0.315, 0.1575, 0.07875])
    measured = [(accepted >= j).mean() for j in range(1, k + 1)]
    assert measured == pytest.approx(survival, abs=0.005)


def test_position_with_one_probability_reports_that_rate() -> None:
    assert PositionAcceptance((0.8,), 4, np.random.default_rng(0)).expected_rate() == pytest.approx(0.8)


def test_replay_reproduces_the_recorded_steps_with_the_recorded_k(tmp_path: Path) -> None:
    trace = read_acceptance_trace(write_trace(tmp_path / "t.csv", [(17, 3, 2), (17, 3, 0), (17, 3, 3)]))
    model = ReplayAcceptance(trace, np.random.default_rng(0))
    model.start(0)
    assert run(model, k=3, steps=3) == [2, 0, 3]
    assert run(model, k=3, steps=3) == [2, 0, 3]  # stream ran out: a fresh one (the only one)


def test_replay_with_another_k_reads_the_same_bits(tmp_path: Path) -> None:
    trace = read_acceptance_trace(write_trace(tmp_path / "t.csv", [(1, 3, 2)]))  # bits 1 1 0
    model = ReplayAcceptance(trace, np.random.default_rng(0))
    model.start(0)
    assert run(model, k=1, steps=3) == [1, 1, 0]
    assert run(model, k=0, steps=2) == [0, 0]  # proposing nothing reads nothing
    assert run(model, k=5, steps=2) == [2, 2]


def test_replay_runs_on_into_a_new_stream_within_a_step(tmp_path: Path) -> None:
    # every recorded stream is all ones, so the concatenation never rejects
    trace = read_acceptance_trace(write_trace(tmp_path / "t.csv", [(1, 2, 2), (2, 1, 1), (2, 3, 3)]))
    model = ReplayAcceptance(trace, np.random.default_rng(0))
    model.start(0)
    assert run(model, k=7, steps=4) == [7, 7, 7, 7]
    assert model.expected_rate() == 1.0


def test_replay_batches_requests_independently(tmp_path: Path) -> None:
    trace = read_acceptance_trace(write_trace(tmp_path / "t.csv", [(1, 3, 2), (1, 3, 0), (1, 3, 3)]))
    model = ReplayAcceptance(trace, np.random.default_rng(0))
    model.start(0)
    assert model.draw(np.array([0]), np.array([3])).tolist() == [2]
    model.start(1)
    ids = np.array([0, 1])
    outcomes = [model.draw(ids, np.array([3, 3])).tolist() for _ in range(3)]
    assert outcomes == [[0, 2], [3, 0], [2, 3]]


def test_trace_steps_become_bit_streams_per_request(recorded_trace: str) -> None:
    bits, lengths = read_acceptance_trace(recorded_trace).bit_streams()
    #                    a: (3,2)  (3,0) (3,3)    b: (4,4)     (2,1)   c: (0,0)
    assert bits.astype(int).tolist() == [1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    assert lengths.tolist() == [7, 6, 0]


def test_fit_of_a_hand_written_trace(recorded_trace: str) -> None:
    # bits  a: 1 1 0 | 0 | 1 1 1   b: 1 1 1 1 | 1 0   c: none (proposed nothing)
    fit = fit_acceptance(read_acceptance_trace(recorded_trace))
    assert fit["rate"] == pytest.approx(10 / 13)  # 10 accepted, 3 steps with a rejection
    assert fit["positions"] == pytest.approx([4 / 5, 3 / 4, 2 / 3, 1 / 1])  # accepted / reached
    # a (5/7) and b (5/6) differ less than 7 and 6 tokens of sampling noise explain
    assert fit["beta"] == {"mean": pytest.approx((5 / 7 + 5 / 6) / 2), "concentration": math.inf}


def test_fit_recovers_a_constant_rate(tmp_path: Path) -> None:
    rows = record(ConstantAcceptance(0.7, np.random.default_rng(7)), num_requests=300, steps=50, k=4)
    fit = fit_acceptance(read_acceptance_trace(write_trace(tmp_path / "t.csv", rows)))
    assert fit["rate"] == pytest.approx(0.7, rel=0.02)
    assert fit["positions"] == pytest.approx([0.7] * 4, abs=0.03)
    assert fit["beta"]["mean"] == pytest.approx(0.7, rel=0.02)
    assert fit["beta"]["concentration"] > 100  # one rate for all: no spread beyond sampling noise


def test_fit_recovers_beta_parameters(tmp_path: Path) -> None:
    # ~50 verified tokens per request: sampling noise is a fifth of the spread of the rates; without
    # subtracting it the concentration comes out near 7.4
    rows = record(BetaAcceptance(0.7, 10.0, np.random.default_rng(8)), num_requests=1200, steps=15, k=4)
    fit = fit_acceptance(read_acceptance_trace(write_trace(tmp_path / "t.csv", rows)))
    assert fit["beta"]["mean"] == pytest.approx(0.7, abs=0.02)
    assert fit["beta"]["concentration"] == pytest.approx(10.0, rel=0.15)


def test_fit_recovers_position_probabilities(tmp_path: Path) -> None:
    rows = record(PositionAcceptance((0.9, 0.6, 0.4), 4, np.random.default_rng(9)),
                  num_requests=100, steps=200, k=4)
    fit = fit_acceptance(read_acceptance_trace(write_trace(tmp_path / "t.csv", rows)))
    assert fit["positions"] == pytest.approx([0.9, 0.6, 0.4, 0.4], abs=0.02)


@pytest.mark.parametrize("content,expected", [
    (None, ["file not found"]),
    ("", ["empty file"]),
    ("request_id,proposed,accepted\n", ["no rows"]),
    ("request_id,proposed\n1,3\n", ["missing column 'accepted'"]),
    ("request_id,proposed,accepted\n1,3,2\n1,3,4\n", ["line 3", "accepted must be <= proposed", "accepted 4"]),
    ("request_id,proposed,accepted\n1,-1,0\n", ["line 2", "proposed must be >= 0", "(got -1)"]),
    ("request_id,proposed,accepted\n1,3,2\n1,3,two\n", ["line 3", "accepted must be a finite number", "'two'"]),
    ("request_id,proposed,accepted\n1,3,\n", ["line 2", "accepted", "empty or NaN cell"]),
    ("request_id,proposed,accepted\n1,0,0\n2,0,0\n", ["proposed is 0 on every row"]),
])
def test_bad_trace_files_name_file_line_column_and_value(tmp_path: Path, content: str | None,
                                                         expected: list[str]) -> None:
    path = tmp_path / "acc.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as error:
        make_acceptance(config(acceptance="replay", acceptance_trace=str(path)).speculative, np.random.default_rng(0))
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for part in expected:
        assert part in message


def test_same_seed_same_calls_same_draws(recorded_trace: str) -> None:
    def session(settings: SimConfig, seed: int) -> list[list[int]]:
        model = make_acceptance(settings.speculative, np.random.default_rng(seed))
        out = []
        for r in range(6):
            model.start(r)
        for step in range(30):
            out.append(model.draw(np.arange(6), np.array([0, 1, 2, 3, 4, K_MAX])).tolist())
            if step == 10:
                model.finish(2)
                model.start(2)
        return out

    for settings in model_configs(recorded_trace):
        assert session(settings, 11) == session(settings, 11)
        assert session(settings, 11) != session(settings, 12), settings.speculative.acceptance


# -- acceptance by rank (token trees, issue 23) ----------------------------------------------------------------------
def test_the_rank_model_spreads_a_top1_miss_over_the_other_ranks() -> None:
    from policies.tree import rank_prob, rank_table

    q = rank_table((0.75, 0.5), (0.5, 0.25))
    assert q == ((0.75, 0.125, 0.0625), (0.5, 0.25, 0.125))
    assert rank_prob(q, 7, 1) == 0.25 and rank_prob(q, 1, 5) == 0.0  # the last depth repeats; missing ranks are 0
    position = make_acceptance(SpeculativeConfig(acceptance="position", acceptance_positions=(0.9, 0.6),
                                                 acceptance_ranks=(0.5,), speculative_token_tree="[(0,), (1,)]", k=2),
                               np.random.default_rng(0))
    assert np.allclose(position.rank_table(), ((0.9, 0.05), (0.6, 0.2)), rtol=0, atol=1e-15)


def test_a_measured_rank_table_is_read_by_depth_and_rank(tmp_path: Path) -> None:
    from simulator.inputs.acceptance import read_rank_table

    path = tmp_path / "ranks.csv"
    path.write_text("depth,rank,probability,count\n2,0,0.6,10\n1,2,0.05,3\n1,0,0.7,50\n1,1,0,0\n")
    assert read_rank_table(str(path)) == ((0.7, 0.0, 0.05), (0.6,))


def test_the_by_rank_model_draws_a_chain_as_position_acceptance(tmp_path: Path) -> None:
    path = tmp_path / "ranks.csv"
    path.write_text("depth,rank,probability\n1,0,0.9\n1,1,0.05\n2,0,0.6\n3,0,0.3\n")
    by_rank = make_acceptance(config(acceptance="by-rank", acceptance_by_rank=str(path)).speculative,
                              np.random.default_rng(4))
    position = PositionAcceptance((0.9, 0.6, 0.3), K_MAX, np.random.default_rng(4))
    assert by_rank.rank_table() == ((0.9, 0.05), (0.6,), (0.3,))
    for k in range(K_MAX + 1):
        assert run(by_rank, k, 50) == run(position, k, 50)


@pytest.mark.parametrize("content, expected", [
    ("depth,rank\n1,0\n", ["missing column 'probability'"]),
    ("depth,rank,probability\n0,0,0.5\n", ["line 2", "depth must be >= 1"]),
    ("depth,rank,probability\n1,0,1.5\n", ["line 2", "probability must be in [0, 1]", "(got 1.5)"]),
    ("depth,rank,probability\n1,0,0.5\n1,0,0.4\n", ["line 3", "depth 1 rank 0 is given twice (also line 2)"]),
    ("depth,rank,probability\n1,0,0.7\n1,1,0.4\n", ["the probabilities of depth 1 sum to 1.1, more than 1"]),
    ("depth,rank,probability\n1,0,0.7\n3,0,0.4\n", ["depth 2 has no row (depths must run 1..3)"]),
    ("depth,rank,probability\n1,0,0.7\n1,2,0.1\n", ["depth 1 has no row of rank 1 (ranks of a depth must run 0..2"]),
    ("depth,rank,probability\n1,1,0.7\n", ["depth 1 has no row of rank 0"]),
])
def test_bad_rank_tables_name_file_line_and_value(tmp_path: Path, content: str, expected: list[str]) -> None:
    path = tmp_path / "ranks.csv"
    path.write_text(content)
    with pytest.raises(UserError) as error:
        make_acceptance(config(acceptance="by-rank", acceptance_by_rank=str(path)).speculative,
                        np.random.default_rng(0))
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for part in expected:
        assert part in message
