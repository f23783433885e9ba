"""A fleet of replicas behind a router (simulator/fleet, issue 24 item 1): what each router does, that one replica is
the single engine bit for bit, that a fleet serves every request once and conserves tokens, and that nothing depends
on the order of the replicas."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from policies.errors import UserError
from simulator.config import ROUTER_NAMES, SimConfig
from simulator.core.runner import run_simulation
from simulator.fleet import run as run_config
from simulator.fleet.fleet import REPLICA_COLUMNS, load_balance, router_stream, run_fleet
from simulator.fleet.routers import (ROUTERS, LeastOutstanding, PowerOfTwo, PrefixAware, ReplicaState, RequestView,
                                     make_router)
from simulator.inputs.workload import Workload
from simulator.studies.cli import main


def workload(arrivals, prompts=None, outputs=None, prompt_id=None) -> Workload:
    n = len(arrivals)
    return Workload(np.array(arrivals, dtype=float), prompts or [64] * n, outputs or [8] * n, "test",
                    prompt_id=prompt_id)


def replicas_of(result) -> list[int]:
    return result.requests["replica"].tolist()


def request(rid=0, prompt_id=None) -> RequestView:
    return RequestView(rid, 64, prompt_id, range(0))


def loads(*outstanding) -> list[ReplicaState]:
    return [ReplicaState(i, n) for i, n in enumerate(outstanding)]


def same_summary(a: dict, b: dict, skip=("wall_seconds",)) -> bool:
    keys = [k for k in a if k not in skip]
    return all(k in b and (a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])))
               for k in keys)


# -- the routers, one by one ---------------------------------------------------------------------------------------
def test_one_registry_holds_every_router_the_config_accepts_each_citing_what_it_follows():
    assert tuple(ROUTERS) == ROUTER_NAMES
    cited = {"round-robin": "production stack", "least-outstanding": "llm-d", "power-of-two": "Mitzenmacher",
             "session": "production stack", "prefix-aware": "llm-d"}
    for name, cls in ROUTERS.items():
        assert cited[name] in " ".join(cls.__doc__.split())
    with pytest.raises(UserError, match="router"):
        SimConfig(rate=1.0, num_requests=1, router="random")


def test_round_robin_deals_four_requests_at_once_over_two_replicas_in_turn():
    result = run_fleet(SimConfig(rate=1.0, num_requests=1, replicas=2, router="round-robin"), workload=workload([0, 0, 0, 0]))
    assert replicas_of(result) == [0, 1, 0, 1]
    assert result.replicas["requests"].tolist() == [2, 2]


def test_least_outstanding_sends_to_the_idle_replica_ties_to_the_lowest_index():
    router = LeastOutstanding()
    assert router.choose(request(), loads(3, 0, 2)) == 1
    assert router.choose(request(), loads(1, 1, 1)) == 0
    # a long request keeps replica 0 busy; the next goes to the idle replica 1, the third to 0 (a tie: 1 and 1)
    wl = workload([0.0, 0.001, 0.002], outputs=[500, 500, 500])
    result = run_fleet(SimConfig(rate=1.0, num_requests=1, replicas=2, router="least-outstanding"), workload=wl)
    assert replicas_of(result) == [0, 1, 0]


def test_power_of_two_draws_from_its_own_seeded_stream_and_picks_the_less_loaded_of_the_two():
    picks = [[PowerOfTwo(router_stream(seed)).choose(request(), loads(0, 0, 0, 0, 0, 0, 0, 0)) for _ in range(50)]
             for seed in (1, 1, 2)]
    assert picks[0] == picks[1] and picks[0] != picks[2]
    # with one replica idle among loaded ones, it wins whenever it is drawn
    router = PowerOfTwo(np.random.default_rng(0))
    assert router.choose(request(), loads(5, 0)) == 1
    config = SimConfig(rate=20.0, num_requests=200, replicas=4, router="power-of-two", seed=3)
    assert replicas_of(run_config(config)) == replicas_of(run_config(config))
    assert replicas_of(run_config(config)) != replicas_of(run_config(config.replace(seed=4)))


def test_power_of_two_leaves_the_runs_own_streams_untouched():
    """The router's stream is a fifth child of the seed: the arrivals, lengths and acceptance draws are those of one
    engine, so a fleet and a single engine with the same seed serve the same workload."""
    config = SimConfig(rate=20.0, num_requests=100, seed=5, length_dist="lognormal")
    one, fleet = run_config(config), run_config(config.replace(replicas=3, router="power-of-two"))
    for column in ("arrival_time", "prompt_tokens", "output_tokens"):
        assert one.requests[column].equals(fleet.requests[column])


def test_session_keeps_each_prompt_id_on_one_replica_and_falls_back_to_round_robin_without_ids():
    wl = workload([0, 0.1, 0.2, 0.3, 0.4, 0.5], prompt_id=[7, 4, 7, 4, 7, 9])
    result = run_fleet(SimConfig(rate=1.0, num_requests=1, replicas=2, router="session"), workload=wl)
    assert replicas_of(result) == [1, 0, 1, 0, 1, 1]  # prompt_id mod 2
    result = run_fleet(SimConfig(rate=1.0, num_requests=1, replicas=2, router="session"), workload=workload([0, 0, 0]))
    assert replicas_of(result) == [0, 1, 0]


def prefix_case(threshold: int):
    """Replica 0 serves prompt 1 (then holds its blocks, cached) and then a long request of prompt 2; prompt 1 comes
    back while replica 0 has one request outstanding and replica 1 none."""
    wl = workload([0.0, 0.5, 1.0], prompts=[1024, 64, 1024], outputs=[4, 2000, 4], prompt_id=[1, 2, 1])
    config = SimConfig(rate=1.0, num_requests=1, replicas=2, router="prefix-aware", enable_prefix_caching=True)
    return run_fleet(config, workload=wl, router=PrefixAware(load_threshold=threshold))


def test_prefix_aware_sends_a_repeated_prompt_to_the_replica_that_cached_it_unless_it_is_overloaded():
    cached = prefix_case(threshold=8)
    assert replicas_of(cached) == [0, 0, 0]
    assert cached.summary["prefix_cache_hit_tokens"] > 0
    overloaded = prefix_case(threshold=0)  # one outstanding more than the idle replica is too many
    assert replicas_of(overloaded) == [0, 0, 1]
    assert overloaded.summary["prefix_cache_hit_tokens"] == 0
    with pytest.raises(UserError, match="enable_prefix_caching"):
        SimConfig(rate=1.0, num_requests=1, replicas=2, router="prefix-aware")
    with pytest.raises(UserError, match="unknown parameter"):
        make_router("round-robin", bogus=1)


# -- one replica is the single engine --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["no-spec", "goodput"])
@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
def test_a_fleet_of_one_replica_gives_the_single_engines_results_bit_for_bit(policy, scheduler):
    config = SimConfig(rate=8.0, num_requests=300, seed=3, policy=policy, scheduler=scheduler)
    single, fleet = run_simulation(config), run_fleet(config)
    assert same_summary(single.summary, fleet.summary)
    pd.testing.assert_frame_equal(single.requests, fleet.requests.drop(columns="replica"), check_exact=True)
    assert set(fleet.requests["replica"]) == {0}
    # and the config's defaults are the single engine's: replicas=1 goes through the engine room as before
    assert single.replicas is None and "replicas" not in single.summary
    with pytest.raises(UserError, match="replicas=2 is a fleet"):  # the engine room serves one engine
        run_simulation(config.replace(replicas=2))


# -- a fleet's bookkeeping -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("router", ROUTER_NAMES[:4])
def test_four_replicas_serve_every_request_once_and_conserve_tokens(router):
    config = SimConfig(rate=40.0, num_requests=600, seed=2, policy="goodput", length_dist="lognormal",
                       replicas=4, router=router, save_steps=True, num_gpu_blocks=100_000)
    result = run_config(config)
    requests, table = result.requests, result.replicas
    assert requests["finish_time"].notna().all() and set(requests["replica"]) <= {0, 1, 2, 3}
    assert (requests["finish_time"] >= requests["first_token_time"]).all()
    assert (requests["first_token_time"] >= requests["arrival_time"]).all()
    assert list(table.columns) == REPLICA_COLUMNS
    assert table["requests"].sum() == table["finished"].sum() == len(requests) == 600
    assert table["requests"].tolist() == requests["replica"].value_counts().sort_index().tolist()
    steps = result.steps
    assert len(steps) == result.summary["steps"] == table["steps"].sum()
    # tokens: each request's first token comes from its prefill, the rest from decode steps (no preemption here)
    assert requests["preemptions"].sum() == 0
    assert steps["emitted"].sum() + len(requests) == requests["output_tokens"].sum()
    assert (requests["accepted_tokens"] <= requests["proposed_tokens"]).all()
    assert (requests["accepted_tokens"] <= requests["output_tokens"] - 1).all()
    assert result.summary["output_tokens"] == requests["output_tokens"].sum()
    assert result.summary["replicas"] == 4 and result.summary["router"] == router
    assert result.summary["load_balance_max_mean"] >= 1.0 and result.summary["load_balance_cv"] >= 0.0
    assert (table["p50_batch"] <= table["p90_batch"]).all() and (table["mean_batch"] >= 1).all()
    assert (table["mean_k"] >= 0).all() and (table["mean_k"] <= config.k).all()
    for _, step in steps.groupby("replica"):
        assert (np.diff(step["start_time"].to_numpy()) >= 0).all()  # each replica's time never goes backwards


def test_load_balance_figures():
    assert load_balance([5, 5, 5, 5]) == {"load_balance_max_mean": 1.0, "load_balance_cv": 0.0}
    figures = load_balance([6, 2])
    assert figures["load_balance_max_mean"] == 1.5 and figures["load_balance_cv"] == 0.5


class Permuted:
    """A router that sees the replicas in the order ``perm`` (its index m is replica perm[m])."""

    def __init__(self, router, perm):
        self.router, self.perm, self.name = router, perm, router.name

    def choose(self, view, replicas):
        return self.perm[self.router.choose(view, [replicas[p] for p in self.perm])]


@pytest.mark.parametrize("name", ["least-outstanding", "round-robin"])
def test_identical_replicas_permuted_give_the_same_fleet_figures(name):
    """Replicas are identical: relabelling them (the router seeing them in another order, ties still broken to the
    lowest index it sees, and their processes started in that order) permutes the per-replica rows and changes no
    fleet figure. For round-robin this means the turns follow the router's order of the replicas."""
    config = SimConfig(rate=30.0, num_requests=400, seed=1, policy="goodput", replicas=4, router=name)
    perm = [2, 0, 3, 1]
    plain = run_fleet(config)
    permuted = run_fleet(config, order=perm, router=Permuted(make_router(name), perm))
    assert same_summary(plain.summary, permuted.summary)
    pd.testing.assert_frame_equal(plain.requests.drop(columns="replica"), permuted.requests.drop(columns="replica"))
    assert permuted.requests["replica"].tolist() == [perm[r] for r in plain.requests["replica"]]
    rows = permuted.replicas.set_index("replica").loc[perm].reset_index(drop=True)
    pd.testing.assert_frame_equal(plain.replicas.drop(columns="replica"), rows)


# -- the command line ------------------------------------------------------------------------------------------------
def test_simulate_with_replicas_writes_the_per_replica_table(capsys, tmp_path):
    out = tmp_path / "fleet"
    code = main(["simulate", "--rate", "20", "--num-requests", "200", "--replicas", "3", "--router",
                 "least-outstanding", "--format", "csv", "--out", str(out)])
    capsys.readouterr()
    assert code == 0
    table = pd.read_csv(out / "replicas.csv")
    assert table["replica"].tolist() == [0, 1, 2] and table["requests"].sum() == 200
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replicas"] == 3 and "load_balance_cv" in summary
    assert json.loads((out / "config.json").read_text())["router"] == "least-outstanding"
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    helptext = capsys.readouterr().out
    assert "--replicas" in helptext and "--router" in helptext
