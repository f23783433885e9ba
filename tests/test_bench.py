"""The bench's cases: a policy name with variants (``+ngram``, ``+chunked``, ``+NAME=VALUE``) and another profile."""
from __future__ import annotations

import pytest

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.inputs import MOONCAKE
from simulator.studies.bench import BENCH_PROFILE, _case_config, _fleet_case, fleet_trace_table, main


def test_a_case_carries_its_variants_and_parameters():
    config = SimConfig.from_dict(_case_config(100, "threshold+max_batch=32+chunked"))
    assert (config.speculative.policy, dict(config.speculative.policy_params), config.engine.scheduler) == (
        "threshold", {"max_batch": 32}, "chunked-prefill")
    assert dict(SimConfig.from_dict(_case_config(100, "threshold")).speculative.policy_params) == {"max_batch": 8}
    assert dict(SimConfig.from_dict(_case_config(100, "threshold+table=1-4:2")).speculative.policy_params) == {
        "max_batch": 8, "table": "1-4:2"}
    plain = SimConfig.from_dict(_case_config(100, "fixed-k+ngram"))
    assert (plain.speculative.proposer, plain.speculative.policy_params, plain.cost.profile) == (
        "ngram", (), str(BENCH_PROFILE))


def test_a_case_on_another_profile(tmp_path):
    assert _case_config(100, "no-spec", tmp_path / "p.csv")["profile"] == str(tmp_path / "p.csv")


def test_a_fleet_case_is_the_case_at_n_times_the_rate_behind_least_outstanding():
    config = SimConfig.from_dict(_fleet_case(1000, "goodput", 64, 3.0))
    assert (config.fleet.replicas, config.fleet.router, config.workload.rate, config.workload.num_requests) == (
        64, "least-outstanding", 192.0, 1000)
    assert SimConfig.from_dict(_fleet_case(100, "no-spec", 1, 3.0)).fleet.replicas == 1


def test_the_fleet_table_gives_one_replica_then_the_fleet_for_each_policy():
    from simulator.studies.bench import fleet_table

    header, single, fleet = fleet_table(2, 40, 3.0, ["no-spec"], BENCH_PROFILE)
    assert header.split()[:3] == ["policy", "replicas", "requests"] and "ratio" in header
    assert single.split()[:3] == ["no-spec", "1", "40"]
    assert single.split()[-4] == single.split()[-2] == "1.00x"  # one replica: the unit of both ratios
    assert fleet.split()[:3] == ["no-spec", "2", "40"] and fleet.split()[-2].endswith("x")


def test_a_fleet_trace_case_replays_the_trace_at_n_times_the_rate():
    config = SimConfig.from_dict(_fleet_case(None, "goodput", 8, 0.1, trace=MOONCAKE))
    workload = config.workload
    assert (workload.arrival, workload.trace, workload.rate, config.fleet.replicas, workload.num_requests) == (
        "trace", str(MOONCAKE), 0.8, 8, None)
    assert workload.length_dist == "fixed"  # the trace's lengths


def test_the_fleet_trace_table_sets_each_policys_fleet_against_the_first():
    header, first, second = fleet_trace_table(2, 30, 0.1, ["no-spec", "goodput"], BENCH_PROFILE, MOONCAKE)
    assert header.split()[:4] == ["policy", "replicas", "requests", "steps"] and header.count("ratio") == 3
    assert first.split()[:3] == ["no-spec", "2", "30"] and first.split().count("1.00x") == 3  # the unit of the ratios
    assert second.split()[:3] == ["goodput", "2", "30"] and second.split()[5].endswith("x")


def test_a_fleet_trace_that_is_neither_a_name_nor_a_file_is_one_line():
    with pytest.raises(UserError, match=r"^--fleet-trace: 'nothing' is neither a trace name \(mooncake\) nor a file$"):
        main(["--fleet-trace", "nothing", "--calls", "0"])


def test_the_plain_table_gives_each_speed_against_the_first_policys_in_the_same_round():
    from simulator.studies.bench import single_table

    header, first, second = single_table([30], ["no-spec", "goodput"], BENCH_PROFILE)
    assert header.split()[:5] == ["requests", "policy", "steps", "process", "s"] and header.count("ratio") == 2
    assert first.split()[:2] == ["30", "no-spec"] and first.split().count("1.00x") == 2  # the unit of the ratios
    assert second.split()[:2] == ["30", "goodput"]
    assert second.split()[5].endswith("x") and second.split()[7].endswith("x")  # the whole process's, the simulation's


def test_rounds_give_medians_and_the_range_of_the_ratios():
    from simulator.studies.bench import single_table

    header, first, second = single_table([20], ["no-spec", "fixed-k"], BENCH_PROFILE, repeat=3)
    assert header.split()[-1] == "range" and first.split()[-1] == "1.00-1.00x"
    low, high = (float(x) for x in second.split()[-1].rstrip("x").split("-"))
    assert low <= float(second.split()[5].rstrip("x")) <= high  # the median ratio within the range


def test_repeat_below_one_is_one_line():
    with pytest.raises(UserError, match=r"^--repeat: a whole number >= 1, got 0$"):
        main(["--sizes", "10", "--repeat", "0", "--calls", "0"])
