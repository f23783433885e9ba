"""Disaggregated prefill and decode (simulator/fleet/disagg, issue 24 item 3): one request's log worked out by hand from
the cost model (prefill on a prefill instance, its KV over the link, decode on a decode instance), the transfer's
formula and bytes, the waits for blocks and for the link, every request accounted for, reproducibility, a free link
against the co-located engine, and a refusal per bad flag."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from policies.errors import UserError
from policies.step_time import predict_step_seconds
from simulator.config import KV_LINK_NAMES, SimConfig
from simulator.core.runner import run_simulation
from simulator.costs.cost_model import load_cost_model
from simulator.fleet import run as run_config
from simulator.fleet.disagg import (GB, INSTANCE_COLUMNS, KV_LINKS, KVLink, gpus_per_instance, kv_transfer,
                                    kv_link, run_disagg)
from simulator.inputs.workload import Workload
from simulator.studies.cli import main
from tests.conftest import REPO

VLLM_8B = str(REPO / "profiles" / "data" / "h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b.csv")
TP4_70B = str(REPO / "profiles" / "data" / "h100-80gbx4-vllm__llama-3.1-70b__llama-3.2-1b.csv")
FREE = KVLink("free", math.inf, 0.0)
"""A link that costs nothing: no latency, infinite bandwidth."""


def workload(arrivals, prompts=None, outputs=None) -> Workload:
    n = len(arrivals)
    return Workload(np.array(arrivals, dtype=float), prompts or [64] * n, outputs or [8] * n, "test")


def disagg(p=1, d=1, **fields) -> SimConfig:
    return SimConfig.of(**{"rate": 1.0, "num_requests": 1, **fields}, prefill_replicas=p, decode_replicas=d)


# -- one request by hand -----------------------------------------------------------------------------------------------
def test_one_request_prefills_on_p_moves_its_kv_and_decodes_on_d_at_the_times_the_cost_model_gives():
    """64-token prompt, 8 output tokens, no speculation, NVLink: the prefill step (0 to its seconds) emits the first
    token on instance 0; the KV (64 tokens x the target's KV bytes) crosses the link in latency + bytes / bandwidth;
    instance 1 then runs 7 decode steps at contexts 64..70, one token each."""
    config = disagg(save_steps=True)
    result = run_disagg(config, workload=workload([0.0]))
    cost = load_cost_model(config.cost.profile)
    ttft = cost.prefill_time(1, 64) + cost.prefill_overhead_time(1)
    nbytes = 64 * cost.memory.target_kv_bytes_per_token
    transfer = 10e-6 + nbytes / 450e9
    t = ttft + transfer
    arrival_at_decode = t
    for ctx in range(64, 71):
        t += predict_step_seconds(cost, [ctx], [0], True)
    row = result.requests.iloc[0]
    assert row["prefill_end_time"] == ttft  # the prefill instance computed the first token ...
    assert row["first_token_time"] == row["ttft"] == arrival_at_decode  # ... which reaches the client with the KV
    assert row["kv_bytes"] == nbytes == 64 * 524288
    assert row["kv_transfer_start"] == ttft and row["kv_transfer_end"] == arrival_at_decode
    assert row["finish_time"] == t
    assert (row["prefill_replica"], row["decode_replica"]) == (0, 1)
    steps = result.steps
    assert steps["replica"].tolist() == [0] + [1] * 7 and steps["kind"].tolist() == ["prefill"] + ["decode"] * 7
    assert steps["start_time"].iloc[1] == arrival_at_decode  # the decode instance starts the moment the KV lands
    assert result.summary["mean_kv_transfer_s"] == arrival_at_decode - ttft == pytest.approx(transfer, rel=1e-12)
    assert result.summary["mean_kv_link_wait_s"] == 0.0
    assert result.summary["gpus"] == 2 and result.summary["kv_transfers"] == 1
    table = result.replicas
    assert list(table.columns) == INSTANCE_COLUMNS
    assert table["role"].tolist() == ["prefill", "decode"] and table["prefill_tokens"].iloc[0] == 64
    assert table["finished"].tolist() == [0, 1] and table["steps"].tolist() == [1, 7]
    assert table["mean_batch"].tolist() == [1.0, 1.0] and table["mean_k"].iloc[1] == 0.0
    span = t - 0.0
    assert table["busy"].tolist() == pytest.approx([ttft / span, (t - arrival_at_decode) / span], rel=1e-12)


def test_with_a_draft_model_the_prefill_instance_prefills_the_draft_and_sends_its_kv_too():
    """fixed-k 3 with every proposal accepted: the prefill step prices the target's and the draft's prefill; the
    transfer carries both caches; the decode instance emits 4 tokens, then the last 3."""
    config = disagg(policy="fixed-k", k=3, acceptance_rate=1.0, kv_link="infiniband")
    result = run_disagg(config, workload=workload([0.0]))
    cost = load_cost_model(config.cost.profile)
    ttft = cost.prefill_time(1, 64) + cost.prefill_time(1, 64, role="draft") + cost.prefill_overhead_time(1)
    nbytes = 64 * (524288 + 6144)  # the example profile's target and draft KV bytes per token
    t = ttft + (20e-6 + nbytes / 50e9)
    landed = t
    t += predict_step_seconds(cost, [64], [3], True)
    t += predict_step_seconds(cost, [68], [3], True)
    row = result.requests.iloc[0]
    assert row["prefill_end_time"] == ttft and row["ttft"] == landed
    assert row["kv_bytes"] == nbytes and row["finish_time"] == t
    assert (row["proposed_tokens"], row["accepted_tokens"]) == (6, 6)  # the last step emits 3 drafted, no bonus


def test_a_one_token_request_finishes_on_its_prefill_instance_without_a_transfer():
    result = run_disagg(disagg(), workload=workload([0.0, 0.0], outputs=[1, 4]))
    requests = result.requests
    assert requests["decode_replica"].tolist() == [-1, 1]
    assert math.isnan(requests["kv_transfer_end"].iloc[0]) and requests["kv_bytes"].iloc[0] == 0
    assert requests["finish_time"].iloc[0] == requests["first_token_time"].iloc[0]
    assert result.replicas["finished"].tolist() == [1, 1] and result.summary["kv_transfers"] == 1


def test_a_prefill_instance_is_free_again_once_it_hands_a_request_off_and_a_decode_instance_once_it_finishes():
    """Least-outstanding on both sides, two instances each: the first request leaves prefill instance 0 at its first
    token, so the second (arriving while the first still decodes) finds both prefill instances idle and takes 0
    again; decode instance 2 (the first decode instance) still holds the first, so the second decodes on 3."""
    result = run_disagg(disagg(p=2, d=2), workload=workload([0.0, 0.5], outputs=[2000, 8]))
    assert result.requests["prefill_replica"].tolist() == [0, 0]
    assert result.requests["decode_replica"].tolist() == [2, 3]
    assert result.requests["finish_time"].iloc[0] > 0.5


# -- the link ------------------------------------------------------------------------------------------------------------
def test_a_transfer_takes_latency_plus_bytes_over_bandwidth_times_the_instances_gpus():
    link = KVLink("x", 50 * GB, 20e-6)
    assert link.seconds(1e9) == 20e-6 + 1 / 50
    assert link.seconds(1e9, gpus=4) == 20e-6 + 1 / 200  # tensor parallel: each GPU sends its shard on its own link
    assert tuple(KV_LINKS) == KV_LINK_NAMES
    assert {name: link.bandwidth / GB for name, link in KV_LINKS.items()} == {
        "nvlink": 450.0, "infiniband": 50.0, "infiniband-hdr": 25.0, "ethernet": 12.5}
    assert "900 GB/s" in KV_LINKS["nvlink"].source and "400 Gb/s" in KV_LINKS["infiniband"].source
    assert kv_link(disagg(kv_link="ethernet", kv_link_bandwidth=3.0, kv_link_latency=0.001)) == KVLink(
        "ethernet", 3e9, 0.001, KV_LINKS["ethernet"].source)
    assert gpus_per_instance(TP4_70B) == 4 and gpus_per_instance(VLLM_8B) == 1
    assert gpus_per_instance(SimConfig.of(rate=1.0, num_requests=1).cost.profile) == 1  # a coefficient JSON: one GPU


def test_kv_bytes_per_token_add_the_drafts_only_when_a_draft_model_speculates():
    cost = load_cost_model(VLLM_8B)
    target, draft = 131072, 32768  # Llama 3.1 8B: 2 x 32 layers x 8 KV heads x 128 x 2 bytes; Llama 3.2 1B: 16 layers
    assert (cost.memory.target_kv_bytes_per_token, cost.memory.draft_kv_bytes_per_token) == (target, draft)
    assert kv_transfer(disagg(profile=VLLM_8B), cost).per_token == target  # no-spec: the draft never runs
    assert kv_transfer(disagg(profile=VLLM_8B, policy="fixed-k", k=3), cost).per_token == target + draft
    assert kv_transfer(disagg(profile=VLLM_8B, policy="goodput"), cost).per_token == target + draft
    assert kv_transfer(disagg(profile=VLLM_8B, policy="fixed-k", proposer="ngram"), cost).per_token == target
    assert kv_transfer(disagg(profile=VLLM_8B, policy="fixed-k", k=0), cost).per_token == target


def test_transfers_from_one_prefill_instance_go_one_at_a_time():
    """Two prompts prefilled in one step on one instance, a 1 GB/s link: the second KV starts when the first has
    arrived, each taking latency + bytes / bandwidth."""
    config = disagg(d=2, kv_link="ethernet", kv_link_bandwidth=1.0, kv_link_latency=0.0)
    result = run_disagg(config, workload=workload([0.0, 0.0]))
    r = result.requests
    seconds = 64 * 524288 / 1e9
    assert r["prefill_end_time"].iloc[0] == r["prefill_end_time"].iloc[1] == r["kv_transfer_start"].iloc[0]
    assert r["kv_transfer_end"].iloc[0] == r["kv_transfer_start"].iloc[0] + seconds
    assert r["kv_transfer_start"].iloc[1] == r["kv_transfer_end"].iloc[0]
    assert r["kv_transfer_end"].iloc[1] == r["prefill_end_time"].iloc[1] + (seconds + seconds)
    assert r["first_token_time"].tolist() == r["kv_transfer_end"].tolist()  # TTFT includes the transfer (and its wait)
    assert r["decode_replica"].tolist() == [1, 2]  # least-outstanding: the second goes to the idle decode instance
    assert result.summary["mean_kv_link_wait_s"] == seconds / 2


# -- waiting for blocks --------------------------------------------------------------------------------------------------
def test_a_prefill_instance_waits_for_blocks_still_being_sent_and_a_decode_instance_for_room():
    """10 blocks of 16 tokens on every instance, two 100-token prompts with 40 tokens to emit (9 blocks each at the
    end): the prefill instance holds the first prompt's 7 blocks until its KV has arrived, so the second prefill starts
    then; the decode instance has no room for the second's 7 blocks until the first finishes."""
    config = disagg(num_gpu_blocks=10, kv_link="ethernet", kv_link_bandwidth=1.0, save_steps=True)
    result = run_disagg(config, workload=workload([0.0, 0.0], prompts=[100, 100], outputs=[40, 40]))
    r, steps = result.requests, result.steps
    prefills = steps[steps["replica"] == 0]
    assert prefills["start_time"].tolist() == [0.0, r["kv_transfer_end"].iloc[0]]
    decodes = steps[steps["replica"] == 1]
    first_of_second = decodes[decodes["start_time"] >= r["finish_time"].iloc[0]]
    assert first_of_second["start_time"].iloc[0] == r["finish_time"].iloc[0]  # joins when the first leaves
    assert (decodes["batch_size"] == 1).all() and r["preemptions"].sum() == 0


# -- bookkeeping -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
def test_every_request_is_served_once_tokens_are_conserved_and_times_are_in_order(scheduler):
    config = disagg(p=2, d=3, rate=30.0, num_requests=500, seed=4, policy="goodput", length_dist="lognormal",
                    scheduler=scheduler, save_steps=True, goodput_slo=(("ttft", 500.0), ("tpot", 50.0)))
    result = run_config(config)
    r, table, s = result.requests, result.replicas, result.summary
    assert r["finish_time"].notna().all() and not r["ignored"].any()
    assert set(r["prefill_replica"]) <= {0, 1} and set(r["decode_replica"]) <= {-1, 2, 3, 4}
    assert ((r["decode_replica"] == -1) == (r["output_tokens"] == 1)).all()
    moved = r[r["decode_replica"] >= 0]
    assert (moved["prefill_end_time"] <= moved["kv_transfer_start"]).all()
    assert (moved["kv_transfer_start"] < moved["kv_transfer_end"]).all()
    assert (moved["first_token_time"] == moved["kv_transfer_end"]).all()
    assert (moved["kv_transfer_end"] < moved["finish_time"]).all()
    assert (r["first_token_time"] >= r["arrival_time"]).all()
    for role, side in (("prefill", "prefill_replica"), ("decode", "decode_replica")):
        rows = table[table["role"] == role]
        assert rows["requests"].tolist() == [int((r[side] == i).sum()) for i in rows["replica"]]
    assert table["finished"].sum() == 500 and table[table["role"] == "prefill"]["requests"].sum() == 500
    steps = result.steps
    assert len(steps) == s["steps"] == table["steps"].sum()
    assert set(steps[steps["replica"] <= 1]["kind"]) == {"prefill"}  # prefill instances never decode
    # tokens: the first from a prefill, the rest from decode steps (a decode instance's recomputes emit a token too)
    assert steps["emitted"].sum() + 500 + r["preemptions"].sum() == r["output_tokens"].sum()
    assert (r["accepted_tokens"] <= r["proposed_tokens"]).all() and (r["accepted_tokens"] <= r["output_tokens"] - 1).all()
    assert moved["kv_bytes"].tolist() == (moved["prompt_tokens"] * (524288 + 6144)).tolist()
    assert s["kv_bytes"] == moved["kv_bytes"].sum() and s["kv_transfers"] == len(moved)
    assert s["gpus"] == 5 and s["goodput_per_gpu"] == s["request_goodput"] / 5
    assert s["prefill_load_balance_max_mean"] >= 1.0 and s["decode_load_balance_cv"] >= 0.0
    for _, own in steps.groupby("replica"):
        assert (np.diff(own["start_time"].to_numpy()) >= 0).all()  # each instance's time never goes backwards


def test_the_same_config_gives_the_same_results_bit_for_bit():
    config = disagg(p=2, d=2, rate=25.0, num_requests=300, seed=7, policy="goodput", length_dist="lognormal",
                    prefill_router="power-of-two", decode_router="power-of-two")
    a, b = run_config(config), run_config(config)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.replicas, b.replicas, check_exact=True)
    assert set(a.summary) == set(b.summary)
    for key, value in a.summary.items():
        if key != "wall_seconds":
            assert value == b.summary[key] or (value != value and b.summary[key] != b.summary[key]), key  # NaN: NaN
    other = run_config(config.replace(seed=8))
    assert not a.requests["decode_replica"].equals(other.requests["decode_replica"])


# -- a free link against the co-located engine --------------------------------------------------------------------------
@pytest.mark.parametrize("policy,k", [("no-spec", 4), ("fixed-k", 3), ("goodput", 4)])
@pytest.mark.parametrize("scheduler", ["prefill-first", "chunked-prefill"])
def test_over_a_free_link_requests_served_alone_finish_as_on_one_co_located_engine(policy, k, scheduler):
    """With no transfer cost and requests that never overlap, each request sees what one engine does: its prefill,
    then its decode steps at the same contexts. So first-token and finish times equal the co-located engine's bit for
    bit (step by step there, as the decode instance runs; the acceptance draws are the same per request)."""
    config = SimConfig.of(rate=1.0, num_requests=1, policy=policy, k=k, scheduler=scheduler, acceptance_rate=0.7)
    wl = workload([0.0, 5.0, 10.0], prompts=[64, 300, 20], outputs=[8, 30, 50])
    one = run_simulation(config, workload=wl, step_by_step=True)
    split = run_disagg(config.replace(prefill_replicas=1, decode_replicas=1), workload=wl, link=FREE)
    for column in ("first_token_time", "finish_time", "proposed_tokens", "accepted_tokens"):
        assert one.requests[column].equals(split.requests[column]), column
    assert (split.requests["kv_transfer_end"] == split.requests["first_token_time"]).all()


# -- refusals ------------------------------------------------------------------------------------------------------------
BAD_FLAGS = [
    (["--prefill-replicas", "2"], "needs both --prefill-replicas (prefill_replicas) and --decode-replicas"),
    (["--decode-replicas", "2"], "needs both --prefill-replicas (prefill_replicas) and --decode-replicas"),
    (["--prefill-replicas", "-1", "--decode-replicas", "1"], "--prefill-replicas (prefill_replicas) must be >= 0"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2"], "give one layout"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--router", "session"], "prefill_router and decode_router"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--decode-router", "prefix-aware"], "no prefix cache"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-router", "prefix-aware"],
     "needs --enable-prefix-caching"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-router", "random"],
     "--prefill-router (prefill_router) must be one"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-link", "pigeon"],
     "--kv-link (kv_link) must be one of"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-link-bandwidth", "0"],
     "--kv-link-bandwidth (kv_link_bandwidth) must be > 0"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-link-latency", "-1"],
     "--kv-link-latency (kv_link_latency) must be >= 0"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--max-concurrency", "4"], "max_concurrency"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--num-scheduler-steps", "4"], "num_scheduler_steps"),
    (["--kv-link", "infiniband"], "used only by disaggregated serving"),
    (["--kv-link-latency", "0.001"], "used only by disaggregated serving"),
    (["--decode-router", "session"], "used only by disaggregated serving"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--profile", VLLM_8B], "front end"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_each_bad_combination_is_refused_in_one_line_with_exit_2(flags, message, capsys, tmp_path):
    code = main(["simulate", "--rate", "2", "--num-requests", "5", "--out", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_profile_without_memory_figures_cannot_size_the_transfers(cost_json):
    with pytest.raises(UserError, match="no memory figures"):
        run_disagg(disagg(profile=cost_json(), num_gpu_blocks=1000), workload=workload([0.0]))


# -- the command line ----------------------------------------------------------------------------------------------------
def test_simulate_disaggregated_writes_a_row_per_instance_and_the_transfer_figures(capsys, tmp_path):
    out = tmp_path / "split"
    code = main(["simulate", "--rate", "10", "--num-requests", "100", "--prefill-replicas", "1", "--decode-replicas",
                 "2", "--kv-link", "infiniband", "--format", "csv", "--out", str(out)])
    capsys.readouterr()
    assert code == 0
    table = pd.read_csv(out / "replicas.csv")
    assert table["role"].tolist() == ["prefill", "decode", "decode"] and table["requests"].tolist()[0] == 100
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kv_link"] == "infiniband" and summary["kv_link_bandwidth_gbps"] == 50.0
    assert summary["kv_transfers"] == 100 and summary["p99_kv_transfer_s"] >= summary["mean_kv_transfer_s"] > 0
    requests = pd.read_csv(out / "requests.csv")
    assert {"prefill_replica", "decode_replica", "kv_transfer_end"} <= set(requests.columns)
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    helptext = capsys.readouterr().out
    for flag in ("--prefill-replicas", "--decode-replicas", "--kv-link", "--kv-link-bandwidth", "--kv-link-latency"):
        assert flag in helptext


# -- the study (simulator/studies/disagg.py) ---------------------------------------------------------------------------
def test_the_rate_where_attainment_crosses_the_target_is_read_off_the_grid_linearly():
    from simulator.studies.disagg import crossing

    assert crossing([2, 4, 6], [1.0, 0.95, 0.75], 0.9) == (4 + (0.95 - 0.9) / (0.95 - 0.75) * 2, "interpolated")
    assert crossing([2, 4, 6], [0.99, 0.5, 0.95], 0.9)[0] == 2 + (0.99 - 0.9) / (0.99 - 0.5) * 2  # the first miss
    assert crossing([2, 4, 6], [0.8, 0.7, 0.6], 0.9) == (0.0, "below the grid")
    assert crossing([2, 4, 6], [1.0, 1.0, 0.9], 0.9) == (6.0, "at least")


def test_max_goodput_per_layout_and_policy_against_co_located():
    from simulator.studies.disagg import GOODPUT_COLUMNS, max_goodput

    cells = pd.DataFrame({"layout": ["co-located"] * 2 + ["1P:1D"] * 2, "gpus": 2, "policy": "no-spec",
                          "rate_per_gpu": [4.0, 8.0] * 2, "slo_attainment": [1.0, 0.5, 1.0, 0.9]})
    table = max_goodput(cells, 0.9)
    assert list(table.columns) == GOODPUT_COLUMNS
    assert table["max_rate_per_gpu"].tolist() == [4 + 0.1 / 0.5 * 4, 8.0]
    assert table["found"].tolist() == ["interpolated", "at least"]
    assert table["vs_co_located"].tolist() == [1.0, 8.0 / (4 + 0.1 / 0.5 * 4)]


def test_layouts_use_every_gpu_and_refuse_splits_that_do_not():
    from simulator.studies.disagg import Layout, layouts, parse_splits

    assert [layout.name for layout in layouts(4, None)] == ["co-located", "1P:3D", "2P:2D", "3P:1D"]
    assert [layout.name for layout in layouts(8, [(1, 1)], tp=4)] == ["co-located", "1P:1D"]
    assert parse_splits("3:5, 4:4") == [(3, 5), (4, 4)] and parse_splits("") is None
    for bad in ("3-5", "a:b", "1:1,1:1"):
        with pytest.raises(UserError, match="--splits"):
            parse_splits(bad)
    with pytest.raises(UserError, match="P \\+ D = 4"):
        layouts(4, [(1, 2)])
    with pytest.raises(UserError, match="--gpus 6"):
        layouts(6, None, tp=4)
    base = disagg(kv_link="infiniband", prefill_router="power-of-two")
    co = Layout(0, 0, 4).config(base)
    assert (co.fleet.replicas, co.fleet.router, co.fleet.prefill_replicas, co.fleet.kv_link) == (
        4, "power-of-two", 0, "nvlink")
    split = Layout(3, 1, 4).config(base)
    assert (split.fleet.prefill_replicas, split.fleet.decode_replicas, split.fleet.kv_link) == (3, 1, "infiniband")


def test_the_disagg_command_writes_its_tables_and_figures(capsys, tmp_path):
    from simulator.studies.disagg import CELL_LABELS

    out = tmp_path / "study"
    code = main(["disagg", "--gpus", "2", "--rates-per-gpu", "4,40", "--policies", "no-spec,goodput", "--num-requests",
                 "60", "--slo", "90% ttft:300 tpot:20", "--workers", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "no-spec: co-located" in printed and "best split 1P:1D" in printed
    cells = pd.read_csv(out / "cells.csv")
    assert cells[CELL_LABELS[:2]].drop_duplicates().values.tolist() == [["co-located", 0], ["1P:1D", 1]]
    assert len(cells) == 2 * 2 * 2 and (cells["requests"] == 60).all()
    assert (cells.loc[cells["rate_per_gpu"] == 4, "slo_attainment"] >= 0.9).all()  # light load meets the SLO
    assert len(pd.read_csv(out / "goodput.csv")) == 4
    assert (out / "attainment.png").stat().st_size > 0 and (out / "goodput.png").stat().st_size > 0
    assert json.loads((out / "study.json").read_text())["layouts"] == ["co-located", "1P:1D"]
    code = main(["disagg", "--gpus", "2", "--slo", "p99_latency<=20", "--out", str(tmp_path / "bad")])
    assert code == 2 and "needs per-request bounds" in capsys.readouterr().err
