"""The bench's cases: a policy name with variants (``+ngram``, ``+chunked``, ``+NAME=VALUE``) and another profile."""
from __future__ import annotations

from simulator.config import SimConfig
from simulator.studies.bench import BENCH_PROFILE, _case_config


def test_a_case_carries_its_variants_and_parameters():
    config = SimConfig.from_dict(_case_config(100, "threshold+max_batch=32+chunked"))
    assert (config.policy, dict(config.policy_params), config.scheduler) == ("threshold", {"max_batch": 32},
                                                                             "chunked-prefill")
    assert dict(SimConfig.from_dict(_case_config(100, "threshold")).policy_params) == {"max_batch": 8}
    assert dict(SimConfig.from_dict(_case_config(100, "threshold+table=1-4:2")).policy_params) == {
        "max_batch": 8, "table": "1-4:2"}
    plain = SimConfig.from_dict(_case_config(100, "fixed-k+ngram"))
    assert (plain.proposer, plain.policy_params, plain.profile) == ("ngram", (), str(BENCH_PROFILE))


def test_a_case_on_another_profile(tmp_path):
    assert _case_config(100, "no-spec", tmp_path / "p.csv")["profile"] == str(tmp_path / "p.csv")
