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


A100, H100 = "a100-80gb-vllm__llama-3.1-8b__llama-3.2-1b", "h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b"


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
        SimConfig.of(rate=1.0, num_requests=1, router="random")


def test_round_robin_deals_four_requests_at_once_over_two_replicas_in_turn():
    result = run_fleet(SimConfig.of(rate=1.0, num_requests=1, replicas=2, router="round-robin"),
                       workload=workload([0, 0, 0, 0]))
    assert replicas_of(result) == [0, 1, 0, 1]
    assert result.replicas["requests"].tolist() == [2, 2]


def test_least_outstanding_sends_to_the_idle_replica_ties_to_the_lowest_index():
    router = LeastOutstanding()
    assert router.choose(request(), loads(3, 0, 2)) == 1
    assert router.choose(request(), loads(1, 1, 1)) == 0
    # a long request keeps replica 0 busy; the next goes to the idle replica 1, the third to 0 (a tie: 1 and 1)
    wl = workload([0.0, 0.001, 0.002], outputs=[500, 500, 500])
    result = run_fleet(SimConfig.of(rate=1.0, num_requests=1, replicas=2, router="least-outstanding"), workload=wl)
    assert replicas_of(result) == [0, 1, 0]


def test_power_of_two_draws_from_its_own_seeded_stream_and_picks_the_less_loaded_of_the_two():
    picks = [[PowerOfTwo(router_stream(seed)).choose(request(), loads(0, 0, 0, 0, 0, 0, 0, 0)) for _ in range(50)]
             for seed in (1, 1, 2)]
    assert picks[0] == picks[1] and picks[0] != picks[2]
    # with one replica idle among loaded ones, it wins whenever it is drawn
    router = PowerOfTwo(np.random.default_rng(0))
    assert router.choose(request(), loads(5, 0)) == 1
    config = SimConfig.of(rate=20.0, num_requests=200, replicas=4, router="power-of-two", seed=3)
    assert replicas_of(run_config(config)) == replicas_of(run_config(config))
    assert replicas_of(run_config(config)) != replicas_of(run_config(config.replace(seed=4)))


def test_power_of_two_leaves_the_runs_own_streams_untouched():
    """The router's stream is a fifth child of the seed: the arrivals, lengths and acceptance draws are those of one
    engine, so a fleet and a single engine with the same seed serve the same workload."""
    config = SimConfig.of(rate=20.0, num_requests=100, seed=5, length_dist="lognormal")
    one, fleet = run_config(config), run_config(config.replace(replicas=3, router="power-of-two"))
    for column in ("arrival_time", "prompt_tokens", "output_tokens"):
        assert one.requests[column].equals(fleet.requests[column])


def test_session_keeps_each_prompt_id_on_one_replica_and_falls_back_to_round_robin_without_ids():
    wl = workload([0, 0.1, 0.2, 0.3, 0.4, 0.5], prompt_id=[7, 4, 7, 4, 7, 9])
    result = run_fleet(SimConfig.of(rate=1.0, num_requests=1, replicas=2, router="session"), workload=wl)
    assert replicas_of(result) == [1, 0, 1, 0, 1, 1]  # prompt_id mod 2
    with pytest.warns(UserWarning, match="--router session: the workload has no session key"):  # said, not silent
        result = run_fleet(SimConfig.of(rate=1.0, num_requests=1, replicas=2, router="session"),
                           workload=workload([0, 0, 0]))
    assert replicas_of(result) == [0, 1, 0]


def prefix_case(threshold: int):
    """Replica 0 serves prompt 1 (then holds its blocks, cached) and then a long request of prompt 2; prompt 1 comes
    back while replica 0 has one request outstanding and replica 1 none."""
    wl = workload([0.0, 0.5, 1.0], prompts=[1024, 64, 1024], outputs=[4, 2000, 4], prompt_id=[1, 2, 1])
    config = SimConfig.of(rate=1.0, num_requests=1, replicas=2, router="prefix-aware", enable_prefix_caching=True)
    return run_fleet(config, workload=wl, router=PrefixAware(load_threshold=threshold))


def test_prefix_aware_sends_a_repeated_prompt_to_the_replica_that_cached_it_unless_it_is_overloaded():
    cached = prefix_case(threshold=8)
    assert replicas_of(cached) == [0, 0, 0]
    assert cached.summary["prefix_cache_hit_tokens"] > 0
    overloaded = prefix_case(threshold=0)  # one outstanding more than the idle replica is too many
    assert replicas_of(overloaded) == [0, 0, 1]
    assert overloaded.summary["prefix_cache_hit_tokens"] == 0
    with pytest.raises(UserError, match="prefix-aware needs --enable-prefix-caching"):
        SimConfig.of(rate=1.0, num_requests=1, replicas=2, router="prefix-aware")
    with pytest.raises(UserError, match="unknown parameter"):
        make_router("round-robin", bogus=1)


# -- one replica is the single engine --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["no-spec", "goodput"])
@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
def test_a_fleet_of_one_replica_gives_the_single_engines_results_bit_for_bit(policy, scheduler):
    config = SimConfig.of(rate=8.0, num_requests=300, seed=3, policy=policy, scheduler=scheduler)
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
    config = SimConfig.of(rate=40.0, num_requests=600, seed=2, policy="goodput", length_dist="lognormal",
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
    assert (table["mean_k"] >= 0).all() and (table["mean_k"] <= config.speculative.k).all()
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

    def surely_elsewhere(self, index, replicas):
        return self.router.surely_elsewhere(self.perm.index(index), [replicas[p] for p in self.perm])


@pytest.mark.parametrize("name, profiles", [("least-outstanding", ()), ("round-robin", ()), ("power-of-two", ()),
                                            ("least-outstanding", (A100, H100, A100, H100))])
def test_replicas_relabelled_give_the_same_fleet_figures(name, profiles):
    """Relabelling the replicas (the router seeing them in another order, ties still broken to the lowest index it sees,
    their processes started, their random streams and, in a mixed fleet, their profiles given in that order) permutes
    the per-replica rows and changes no fleet figure. For round-robin this means the turns follow the router's order of
    the replicas."""
    config = SimConfig.of(rate=30.0, num_requests=400, seed=1, policy="goodput", replicas=4, router=name,
                          replica_profiles=profiles)
    perm = [2, 0, 3, 1]
    plain = run_fleet(config)
    permuted = run_fleet(config, order=perm, router=Permuted(make_router(name, router_stream(1)), perm))
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
    assert json.loads((out / "config.json").read_text())["fleet"]["router"] == "least-outstanding"
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    helptext = capsys.readouterr().out
    assert "--replicas" in helptext and "--router" in helptext


# -- speed at fleet scale: runs of steps that no fleet arrival cuts, exact (issue 24, item 4) -------------------------
EXACT = [dict(policy="no-spec"), dict(policy="goodput"), dict(policy="goodput", proposer="ngram"),
         dict(policy="goodput", acceptance="beta", num_gpu_blocks=600),  # preemptions
         dict(policy="fixed-k", proposer="ngram", scheduler="chunked-prefill"),
         dict(policy="goodput", enable_prefix_caching=True)]


@pytest.mark.parametrize("fields, router", [(f, r) for f in EXACT for r in ROUTER_NAMES
                                             if r != "prefix-aware" or f.get("enable_prefix_caching")])
def test_runs_cut_only_by_arrivals_routed_there_are_step_by_step_bit_for_bit(monkeypatch, fields, router):
    """Every combination of the fleet's two speed shortcuts (runs bounded by the first arrival the router may send to a
    replica; runs planned ahead and cut when a request comes) gives step by step's requests, per-replica table
    (batch-size distribution and mean k included) and step count."""
    from simulator.fleet import fleet

    config = SimConfig.of(rate=40.0, num_requests=300, seed=2, length_dist="lognormal", replicas=3, router=router,
                          **fields)
    reference = run_fleet(config, step_by_step=True)
    for bounded, cut in [(True, True), (True, False), (False, True), (False, False)]:
        monkeypatch.setattr(fleet, "BOUNDED_RUNS", bounded)
        monkeypatch.setattr(fleet, "CUT_RUNS", cut)
        fast = run_fleet(config)
        pd.testing.assert_frame_equal(fast.requests, reference.requests, check_exact=True)
        pd.testing.assert_frame_equal(fast.replicas, reference.replicas, check_exact=True)
        assert fast.summary["steps"] == reference.summary["steps"]
    if fields.get("num_gpu_blocks"):
        assert reference.summary["preemptions"] > 0


def test_a_run_is_cut_when_a_request_comes_and_only_then(monkeypatch):
    """The power-of-two router's lookahead off: a replica's runs are planned past the fleet's arrivals; the runs cut
    short are those during which a request was routed to that replica while its queue was empty."""
    from simulator.fleet import fleet

    monkeypatch.setattr(fleet, "BOUNDED_RUNS", False)
    cuts = []
    restore = fleet._Replica._restore
    monkeypatch.setattr(fleet._Replica, "_restore", lambda self, saved: cuts.append(self.env.now) or
                        restore(self, saved))
    config = SimConfig.of(rate=40.0, num_requests=300, seed=2, policy="goodput", replicas=4, router="power-of-two")
    result = run_fleet(config)
    arrivals = set(result.requests["arrival_time"])
    assert 0 < len(cuts) < 300 and set(cuts) <= arrivals  # each cut happens at an arrival, not at every one


def test_least_outstanding_knows_how_many_arrivals_go_elsewhere_first():
    """Without finishes the next arrivals go to the least loaded one by one: the router's count of arrivals that surely
    go elsewhere before replica i may get one is exactly what replaying them gives, for every small load vector."""
    import itertools

    router = LeastOutstanding()
    for counts in itertools.product(range(4), repeat=4):
        for i in range(4):
            states = loads(*counts)
            expected = 0
            while router.choose(request(), states) != i:
                states[router.choose(request(), states)].outstanding += 1
                expected += 1
            assert router.surely_elsewhere(i, loads(*counts)) == expected, (counts, i)


def test_round_robin_and_power_of_two_tell_when_a_replica_may_next_be_chosen():
    rr = make_router("round-robin")
    for _ in range(3):
        rr.choose(request(), loads(0, 0, 0, 0))
    assert [rr.surely_elsewhere(i, loads(0, 0, 0, 0)) for i in range(4)] == [1, 2, 3, 0]
    # power-of-two draws its pairs ahead to tell: the same pairs, so the same choices, as drawing them one by one
    ahead, plain = PowerOfTwo(router_stream(7)), PowerOfTwo(router_stream(7))
    skip = ahead.surely_elsewhere(5, loads(*[0] * 8))
    picks = [ahead.choose(request(), loads(*[0] * 8)) for _ in range(40)]
    assert picks == [plain.choose(request(), loads(*[0] * 8)) for _ in range(40)]
    assert 5 not in picks[:skip] and skip < 40


def test_each_replica_keeps_its_batch_sizes_by_step_time_without_step_rows():
    """The per-replica batch-size figures come from the engines' step-time record (BatchLoad), equal to the figures
    the step rows give (weighted by step time), with or without step rows kept."""
    config = SimConfig.of(rate=40.0, num_requests=300, seed=3, policy="goodput", replicas=2, router="least-outstanding",
                          length_dist="lognormal")
    kept, lean = run_fleet(config.replace(save_steps=True)), run_fleet(config)
    assert lean.recorder.replicas[0].steps is None
    pd.testing.assert_frame_equal(kept.requests, lean.requests)
    for r, row in lean.replicas.iterrows():
        steps = kept.steps[(kept.steps["replica"] == r) & (kept.steps["kind"] != "prefill")]
        seconds, batch = steps["seconds"].to_numpy(), steps["batch_size"].to_numpy()
        assert row["decode_steps"] == len(steps)
        assert row["mean_batch"] == pytest.approx((batch * seconds).sum() / seconds.sum(), rel=1e-12)
        assert row["mean_k"] == steps["proposed"].sum() / batch.sum()
    pd.testing.assert_frame_equal(kept.replicas, lean.replicas)


@pytest.mark.parametrize("model", ["constant", "beta", "position"])
def test_a_replica_rewinds_its_acceptance_stream_exactly(model):
    from simulator.fleet.fleet import REWINDABLE, _attributes, _rewind
    from simulator.inputs.acceptance import make_acceptance

    config = SimConfig.of(rate=1.0, num_requests=1, acceptance=model, acceptance_positions=(0.9, 0.5) if model ==
                          "position" else ())
    acc = make_acceptance(config.speculative, np.random.default_rng(1))
    assert isinstance(acc, REWINDABLE)
    acc.BLOCK = 7  # refills inside the rewound draws too
    for rid in range(6):
        acc.start(rid)
    acc.draw_list([0, 1, 2], [4, 4, 4])
    saved = _attributes(acc, False)
    first = [acc.draw_list([0, 1, 2, 3, 4, 5], [4, 3, 4, 2, 4, 4]) for _ in range(5)]
    _rewind(acc, saved)
    assert [acc.draw_list([0, 1, 2, 3, 4, 5], [4, 3, 4, 2, 4, 4]) for _ in range(5)] == first


# -- mixed fleets (a list of profiles) --------------------------------------------------------------------------------
def test_a_mixed_fleet_gives_each_replica_its_profile_and_the_order_of_the_list_changes_nothing():
    from simulator.fleet.fleet import resolve_profile

    config = SimConfig.of(rate=20.0, num_requests=300, seed=1, policy="goodput", router="least-outstanding",
                          length_dist="lognormal", replica_profiles=(H100, A100))
    assert config.fleet.replicas == 2 and config.fleet.replica_profiles == (A100, H100)  # sorted: replica 0 is the A100
    mixed = run_config(config)
    assert mixed.replicas["profile"].tolist() == [A100, H100]
    assert mixed.replicas["num_gpu_blocks"].tolist() == [21602, 21472]  # each from its own profile's memory
    assert mixed.replicas.loc[1, "requests"] > mixed.replicas.loc[0, "requests"]  # the faster H100 finishes sooner
    assert run_config(config.replace(replica_profiles=(A100, H100))).requests.equals(mixed.requests)
    # a list of one profile twice is that profile's identical fleet, bit for bit
    twice = run_config(config.replace(replica_profiles=(A100, A100)))
    same = run_config(config.replace(replica_profiles=(), replicas=2, profile=resolve_profile(A100)))
    pd.testing.assert_frame_equal(twice.requests, same.requests, check_exact=True)
    with pytest.raises(UserError, match="one profile is not a fleet"):
        SimConfig.of(rate=1.0, num_requests=1, replica_profiles=(A100,))
    with pytest.raises(UserError, match="no profile 'nosuch'"):
        run_config(config.replace(replica_profiles=("nosuch", A100)))


def test_a_request_that_fits_only_the_larger_replica_goes_there():
    """An H200 replica holds 56,014 KV blocks, an A100 21,602: a 500,000-token prompt (31,250 blocks of 16) fits only
    the H200, whatever the router would have chosen; a 2,000,000-token one fits neither and is ignored."""
    h200 = "h200-vllm__llama-3.1-8b__llama-3.2-1b"
    wl = workload([0.0, 0.1, 0.2, 0.3], prompts=[64, 500_000, 64, 2_000_000], outputs=[8, 2, 8, 2])
    config = SimConfig.of(rate=1.0, num_requests=1, replica_profiles=(A100, h200), router="round-robin")
    with pytest.warns(UserWarning, match="extrapolating"):
        result = run_fleet(config, workload=wl)
    assert result.replicas["profile"].tolist() == [A100, h200]
    assert replicas_of(result) == [0, 1, 1, -1]  # the second goes to the H200, out of its turn
    assert result.requests["ignored"].tolist() == [False, False, False, True]


def test_replicas_with_a_front_end_each_have_their_own():
    """A vLLM-calibrated profile's front end (its API server) stands before each replica: a fleet of one is the single
    engine with its front end, bit for bit, and two replicas serve every request."""
    from simulator.fleet.fleet import resolve_profile

    config = SimConfig.of(rate=10.0, num_requests=200, seed=4, policy="goodput", profile=resolve_profile(H100))
    pd.testing.assert_frame_equal(run_simulation(config).requests, run_fleet(config).requests.drop(columns="replica"),
                                  check_exact=True)
    two = run_config(config.replace(replicas=2, router="least-outstanding"))
    assert two.requests["finish_time"].notna().all() and two.replicas["requests"].sum() == 200


# -- the timeline shows the replicas ----------------------------------------------------------------------------------
def test_the_timeline_has_one_lane_per_replica_named_by_its_profile(capsys, tmp_path):
    out = tmp_path / "t"
    code = main(["simulate", "--rate", "20", "--num-requests", "60", "--replicas", f"{A100},{H100}", "--router",
                 "least-outstanding", "--save-timeline", "--format", "csv", "--out", str(out)])
    capsys.readouterr()
    assert code == 0
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {3: f"replica 0 ({A100})", 4: f"replica 1 ({H100})", 2: "requests"}
    requests = pd.read_csv(out / "requests.csv")
    steps = pd.read_csv(out / "steps.csv")
    for pid, replica in ((3, 0), (4, 1)):  # each lane holds its replica's steps, each request span names its replica
        assert sum(e["ph"] == "X" and e["pid"] == pid for e in events) == (steps["replica"] == replica).sum()
    spans = {e["id"]: e["args"]["replica"] for e in events if e["ph"] == "b" and e["name"].startswith("request")}
    assert spans == dict(zip(requests["request_id"], requests["replica"]))


# -- sweeps of fleets on Dask -----------------------------------------------------------------------------------------
from tests.test_sweep import dask_cluster, summary_without_wall_time  # noqa: E402,F401 - the module's Dask fixture


def test_a_sweep_of_fleets_on_dask_equals_the_local_sweep(dask_cluster, capsys, tmp_path):  # noqa: F811
    argv = ["sweep", "--rates", "20,40", "--policies", "no-spec,goodput", "--num-requests", "60", "--replicas",
            f"{A100},{H100}", "--router", "least-outstanding", "--quiet"]
    assert main([*argv, "--workers", "1", "--out", str(tmp_path / "local")]) == 0
    assert main([*argv, "--cluster", dask_cluster, "--out", str(tmp_path / "dask")]) == 0
    capsys.readouterr()
    local = summary_without_wall_time(tmp_path / "local")
    pd.testing.assert_frame_equal(local, summary_without_wall_time(tmp_path / "dask"))
    assert set(local["replicas"]) == {"2"} and set(local["router"]) == {"least-outstanding"}
