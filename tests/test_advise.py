"""``run_sim.py advise`` (issue 33): the acceptance it converts, the profiles it finds, the batch-size table it
derives, the flags it writes and reads back, the search against the exhaustive sweep, and the command end to end, on
small spaces and few requests."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import run_sim
from simulator.config import SimConfig
from simulator.fleet import run
from simulator.inputs.workload import Workload, diurnal
from simulator.studies import advise, advise_inputs, engine_flags
from simulator.studies.specs import parse_slo
from tests.conftest import REPO

DATA = REPO / "profiles" / "data"
P8 = str(DATA / "h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b.csv")
P8_EAGLE3 = str(DATA / "h100-80gb-vllm__llama-3.1-8b__eagle3-llama-3.1-8b.csv")
P70 = str(DATA / "h100-80gbx4-vllm__llama-3.1-70b__llama-3.2-1b.csv")
#: A small deployment: few slots, short requests (tables and full-load runs stay small).
SMALL_ENGINE = ["--max-num-seqs", "16", "--prompt-len", "64", "--output-len", "32"]


# -- acceptance ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("a", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_an_acceptance_length_at_k_gives_back_leviathans_per_token_rate(a, k):
    length = (1 - a ** (k + 1)) / (1 - a)
    assert advise_inputs.leviathan_rate(length, k, "test") == pytest.approx(a, abs=1e-9)


def test_an_acceptance_length_outside_one_to_k_plus_one_is_one_line_naming_the_flag():
    with pytest.raises(Exception, match=r"--acceptance-length eagle3=5@3: an acceptance length at k=3 is in \[1, 4\]"):
        advise_inputs.parse_acceptance_flags(["eagle3=5@3"], None, None, "sharegpt", None)


def test_published_lengths_by_k_become_per_position_rates_that_give_them_back():
    """vLLM #20780's EAGLE-3 lengths at k = 2, 3: one rate over the first two positions (Leviathan at k = 2), then
    P(accepted >= 3) = AL(3) - AL(2) (the notebook trees_and_heads derived the same 0.7689, 0.7274)."""
    positions = advise_inputs.positions_from_lengths([2, 3], [2.36, 2.79])
    assert positions == (0.7689, 0.7689, 0.7274)
    acceptance = advise_inputs.Acceptance("eagle3", "published default", "test", positions=positions)
    assert acceptance.length(2) == pytest.approx(2.36, abs=1e-3)
    assert acceptance.length(3) == pytest.approx(2.79, abs=1e-3)


def test_every_acceptance_says_where_it_came_from():
    inputs = advise_inputs.parse_acceptance_flags(["draft_model=2.5"], None, None, "sharegpt", None)
    found = advise_inputs.resolve(["draft_model", "eagle3", "eagle", "ngram", "mtp"], "llama-3.1-8b", inputs)
    assert {m: a.kind for m, a in found.items()} == {
        "draft_model": "given", "eagle3": "published default", "eagle": "published default",
        "ngram": "published default", "mtp": "assumed default"}
    assert found["draft_model"].length(3) == pytest.approx(2.5, abs=1e-6)  # given at the default k = 3
    assert "vLLM issue #20780" in found["eagle3"].label and "SpecDecode-Bench" in found["ngram"].label
    # an n-gram lookup proposes at some steps only: r_1 = m a_1 with a_1 = a_2 (SpecDecode-Bench's ShareGPT walk)
    assert found["ngram"].match_prob == pytest.approx(0.1041 / 0.7246, abs=1e-4)
    none = advise_inputs.AcceptanceInputs()
    assert "not llama-3.1-70b" in advise_inputs.resolve(["eagle3"], "llama-3.1-70b", none)["eagle3"].source
    with pytest.raises(Exception, match=r"^--acceptance-length draft_model: no profile here prices draft_model"):
        advise_inputs.resolve(["eagle3"], "llama-3.1-8b", inputs)


def test_a_vllm_results_spec_counters_give_per_position_rates(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"duration": 10.0, "completed": 1, "spec_decode_num_drafts": 100,
                                "spec_decode_draft_tokens": 300, "spec_decode_accepted_tokens": 120,
                                "spec_decode_per_position_acceptance_rates": [0.6, 0.36, 0.24]}))
    acceptance = advise_inputs.from_results("eagle3", str(path), None)
    assert acceptance.kind == "vLLM counters"
    assert acceptance.positions == (0.6, 0.6, pytest.approx(0.6667, abs=1e-4))
    assert acceptance.length(3) == pytest.approx(1 + 0.6 + 0.36 + 0.24)


def test_scaling_the_acceptance_scales_every_rate_the_config_gets():
    acceptance = advise_inputs.Acceptance("eagle", "given", "test", positions=(0.5, 1.0))
    assert acceptance.scaled(0.8).fields() == {"acceptance": "position", "acceptance_positions": (0.4, 0.8)}


# -- profiles --------------------------------------------------------------------------------------------------
def test_profiles_are_known_by_their_metadata_and_the_other_drafters_of_a_deployment_are_found():
    given = advise_inputs.deployment_of([P8])
    found, notes = advise_inputs.discover(given, [DATA])
    assert sorted((i.method, i.draft) for i in found) == [
        ("draft_model", "llama-3.2-1b"), ("eagle", "eagle-llama-3.1-8b"), ("eagle3", "eagle3-llama-3.1-8b")]
    assert {i.deployment for i in found} == {("llama-3.1-8b", "NVIDIA H100 80GB HBM3 (SXM5)", 1, "vllm", None)}
    assert any("analytical__llama-3.1-8b__eagle3" in n and "not used" in n for n in notes)  # another engine


def test_a_profile_naming_its_engine_and_version_is_another_deployment(tmp_path):
    meta = json.loads((DATA / "h100-80gb-vllm__llama-3.1-8b__eagle3-llama-3.1-8b.meta.json").read_text())
    meta["engine"] = {"name": "vllm", "version": "0.10"}
    (tmp_path / "h100-80gb-vllm0.10__llama-3.1-8b__eagle3-llama-3.1-8b.meta.json").write_text(json.dumps(meta))
    (tmp_path / "h100-80gb-vllm0.10__llama-3.1-8b__eagle3-llama-3.1-8b.csv").write_text(
        (DATA / "h100-80gb-vllm__llama-3.1-8b__eagle3-llama-3.1-8b.csv").read_text())
    other = advise_inputs.identity(str(tmp_path / "h100-80gb-vllm0.10__llama-3.1-8b__eagle3-llama-3.1-8b.csv"))
    assert (other.engine, other.engine_version) == ("vllm", "0.10")
    assert other.engine_text.startswith("vllm (0.10;")
    found, _ = advise_inputs.discover(advise_inputs.deployment_of([P8]), [tmp_path])
    assert other.path not in [i.path for i in found]


def test_profiles_fitted_to_an_engines_own_runs_are_that_release_and_a_profile_without_a_draft_prices_ngram():
    """The 8B's vLLM 0.10 profiles (calibrate --published: calibration.engine vllm, engine_versions 0.10.1.1 and a
    V1 of 2025-07 that names no release) are one deployment with its own n-gram profile, which n-gram runs on."""
    given = advise_inputs.deployment_of([str(DATA / "h100-80gb-vllm0.10__llama-3.1-8b__eagle3-llama-3.1-8b.csv")])
    found, _ = advise_inputs.discover(given, [DATA])
    assert sorted((i.method, i.draft or "", Path(i.path).name) for i in found) == [
        ("eagle", "eagle-llama-3.1-8b", "h100-80gb-vllm0.10__llama-3.1-8b__eagle-llama-3.1-8b.csv"),
        ("eagle3", "eagle3-llama-3.1-8b", "h100-80gb-vllm0.10__llama-3.1-8b__eagle3-llama-3.1-8b.csv"),
        ("ngram", "", "h100-80gb-vllm0.10__llama-3.1-8b__ngram.csv")]
    assert {(i.engine, i.engine_version) for i in found} == {("vllm", "0.10")}
    request = advise.Request([given[0].path], parse_slo("99% ttft:500"), None, None, None,
                             advise_inputs.AcceptanceInputs())
    drafters = {d.method: Path(d.profile).name for d in advise.drafters_of(request, given[0], found)}
    assert drafters["ngram"] == "h100-80gb-vllm0.10__llama-3.1-8b__ngram.csv"


def test_profiles_of_two_targets_are_refused_with_one_line(tmp_path, capsys):
    code = run_sim.main(["advise", "--profile", f"{P8},{P70}", "--slo", "99% ttft:500", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "give profiles of one target, GPU, tensor parallel and engine" in err[0]


def test_a_flag_advise_chooses_is_refused_naming_what_to_give(tmp_path, capsys):
    code = run_sim.main(["advise", "--profile", P8, "--k", "3", "--slo", "99% ttft:500", "--out", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err.strip() == "error: advise: --k: advise chooses it (use --ks)"


# -- the generated table ---------------------------------------------------------------------------------------
def closed_loops(throughputs: dict[tuple[int, int], list[float]]) -> pd.DataFrame:
    """Table measurements: {(batch, k): [steady tokens/s of seed 0, seed 1, ...]}."""
    return pd.DataFrame([{"batch": b, "k": k, "seed": seed, "steady_throughput": value}
                         for (b, k), values in throughputs.items() for seed, value in enumerate(values)])


EAGLE3 = advise.Drafter("eagle3", P8_EAGLE3, "eagle3-llama-3.1-8b", advise_inputs.assumed_default("eagle3"))


def test_the_table_changes_k_where_the_new_k_overtakes_interpolated_in_log_batch():
    """k = 2 leads at batch 1 (200 against 100 tokens/s), k = 1 at 100 (1000 against 800): linear in log b the
    difference is -100 + 300 log(b) / log(100), 0 at b = 100^(1/3) = 4.6, so k = 1 from 5 on."""
    runs = closed_loops({(1, 0): [50] * 3, (1, 1): [100] * 3, (1, 2): [200] * 3,
                         (100, 0): [500] * 3, (100, 1): [1000] * 3, (100, 2): [800] * 3})
    table, entries = advise.table_entries(runs, 128)
    assert entries == [(1, 2), (5, 1)]
    assert table.loc[table["best"], ["batch", "k"]].values.tolist() == [[1, 2], [100, 1]]
    assert table.loc[table["batch"] == 100, "deficit"].tolist() == pytest.approx([0.5, 0.0, 0.2])
    table_candidate = advise.table_candidate(EAGLE3, entries, 128)
    assert dict(table_candidate.fields)["policy_params"] == (("table", "1-4:2,5-128:1"),)
    assert advise.table_candidate(EAGLE3, [(1, 0)], 128) is None  # a table that never speculates is no candidate


def test_a_k_better_only_within_the_noise_makes_no_range_and_a_table_of_one_k_is_that_fixed_k():
    """At batch 1 k = 2 leads k = 1 by 1% on average, but seed by seed by +3%, -1%, +1% (two standard errors: 2.3%);
    at 100 k = 1 leads by 10%: one k, 1, at every batch size, which is fixed k = 1."""
    runs = closed_loops({(1, 1): [100, 100, 100], (1, 2): [103, 99, 101],
                         (100, 1): [1000, 1000, 1000], (100, 2): [900, 900, 900]})
    table, entries = advise.table_entries(runs, 128)
    assert entries == [(1, 1)]
    assert table.loc[table["batch"] == 1, "as_good"].tolist() == [True, True]
    one = advise.table_candidate(EAGLE3, entries, 128)
    assert one == advise.fixed_k(EAGLE3, 1) and one.name == "fixed-k:1 [eagle3]"
    assert advise.table_words(one, 128) == "1-128:1 (one k at every batch size: fixed-k:1)"


def test_a_gain_within_the_tolerance_makes_no_range():
    """Noise-free seeds: k = 3 leads k = 2 by 0.4% at batch 1, within the 0.5% tolerance; k = 2 leads from 8 on."""
    runs = closed_loops({(1, 2): [100.0] * 3, (1, 3): [100.4] * 3, (8, 2): [800.0] * 3, (8, 3): [700.0] * 3})
    assert advise.table_entries(runs, 8)[1] == [(1, 2)]


def test_a_blip_within_the_noise_makes_no_range_but_a_k_that_rises_beyond_it_does():
    """Noise-free seeds. k = 3 leads by 5% at batches 1 and 4; at 2, k = 2 by 0.3%, within the tolerance: one k, 3,
    no blip. Where k = 2 leads by 5% at 1 and 2 and k = 3 by 5% from 4 on (a mixture of experts' small batches pay
    for the experts a large one loads anyway), k rises with the batch."""
    blip = closed_loops({(1, 2): [100.0] * 3, (1, 3): [105.0] * 3, (2, 2): [200.6] * 3, (2, 3): [200.0] * 3,
                         (4, 2): [400.0] * 3, (4, 3): [420.0] * 3})
    assert advise.table_entries(blip, 8)[1] == [(1, 3)]
    rise = closed_loops({(1, 2): [105.0] * 3, (1, 3): [100.0] * 3, (2, 2): [210.0] * 3, (2, 3): [200.0] * 3,
                         (4, 2): [400.0] * 3, (4, 3): [420.0] * 3})
    assert advise.table_entries(rise, 8)[1] == [(1, 2), (3, 3)]


def test_a_k_better_than_both_neighbours_between_two_concurrencies_takes_the_range_between():
    """Noise-free seeds. k = 3 leads at 32 (by 2%), k = 2 at 64 (by 0.2%, so k = 3 is as good there), k = 1 at 128
    (by 2.4%). Linear in log b, k = 3 and k = 1 cross at b = 86.5, both 3% below k = 2: jumping from 3 to 1 there
    would lose 3%, so k = 2 takes the middle, from where it overtakes k = 3 (58) to where k = 1 overtakes it (107)."""
    runs = closed_loops({(32, 1): [540.0] * 3, (32, 2): [588.0] * 3, (32, 3): [600.0] * 3,
                         (64, 1): [920.0] * 3, (64, 2): [1002.0] * 3, (64, 3): [1000.0] * 3,
                         (128, 1): [1300.0] * 3, (128, 2): [1270.0] * 3, (128, 3): [1196.0] * 3})
    table, entries = advise.table_entries(runs, 128)
    assert entries == [(1, 3), (58, 2), (107, 1)]
    assert table.loc[table["best"], ["batch", "k"]].values.tolist() == [[32, 3], [64, 2], [128, 1]]


def test_fixed_lengths_are_drawn_lognormal_for_the_tables_closed_loops_with_their_means_kept():
    base = SimConfig.of(profile=P8_EAGLE3, rate=1.0, num_requests=10, prompt_len=210, output_len=200)
    loops = advise.table_base(base).workload
    assert (loops.length_dist, loops.length_sigma) == ("lognormal", advise.TABLE_LENGTH_SIGMA)
    mean = math.exp(advise.TABLE_LENGTH_SIGMA ** 2 / 2)  # a lognormal's mean over its median
    assert (loops.prompt_len * mean, loops.output_len * mean) == (pytest.approx(210, abs=1), pytest.approx(200, abs=1))
    drawn = base.replace(length_dist="lognormal", length_sigma=1.0)
    assert advise.table_base(drawn) == drawn  # lengths already drawn stay the workload's


def test_the_steady_throughput_counts_the_steps_between_the_first_finish_and_the_last_sending():
    """Ten steps of 1 s emitting 10, 20, ..., 100 tokens; the first request finishes at 2 s, the last is sent at 7 s:
    the steps starting at 2..6 s emit 30 + ... + 70 = 250 tokens in 5 s."""
    from types import SimpleNamespace

    steps = pd.DataFrame({"start_time": np.arange(10.0), "seconds": 1.0, "emitted": np.arange(10, 101, 10)})
    requests = pd.DataFrame({"arrival_time": [0.0, 0.0, 7.0], "finish_time": [2.0, 9.0, 10.0]})
    result = SimpleNamespace(steps=steps, requests=requests, summary={"output_throughput": 55.0})
    assert advise.steady_throughput(result) == 50.0
    drained = SimpleNamespace(steps=steps, requests=requests.assign(arrival_time=0.0), summary=result.summary)
    assert advise.steady_throughput(drained) == 55.0  # no step between: the whole run's


def test_a_tables_k_0_keeps_the_draft_model_and_costs_more_than_no_speculation():
    """A table's k = 0 range still runs the draft model's prefill of every prompt: at the same batch it emits fewer
    tokens/s than no speculation, so the table's closed loops price k = 0 as the drafter never proposing."""
    acceptance = advise_inputs.assumed_default("draft_model")
    drafter = advise.Drafter("draft_model", P8, "llama-3.2-1b", acceptance)
    never = advise.fixed_k(drafter, 0)
    base = SimConfig.of(profile=P8, rate=math.inf, max_concurrency=8, num_requests=24, prompt_len=512, output_len=32,
                        save_steps=True)
    config = never.config(base, P8)
    assert (config.speculative.policy, config.speculative.policy_params) == ("vllm-batch-table", (("table", "1:0"),))
    _, figures = advise._run_item(("k0", config))
    _, plain = advise._run_item(("no-spec", advise.Candidate("no-spec", "no-spec").config(base, P8)))
    assert figures["acceptance_rate"] != figures["acceptance_rate"] or figures["acceptance_rate"] == 0  # no proposal
    assert figures["steady_throughput"] < plain["steady_throughput"]


@pytest.mark.parametrize("method, draft", [("eagle3", "eagle3-llama-3.1-8b"), ("eagle", "eagle-llama-3.1-8b")])
def test_the_generated_table_is_never_worse_than_the_best_fixed_k_on_a_diurnal_ramp(tmp_path, method, draft):
    """A 128-slot deployment of the docs' traffic (210 prompt, 200 output tokens): the table derived from the closed
    loops (k up to 4, which holds the best k at every batch size here) against no speculation and every fixed k over
    a ramp of 300 requests, the same seed for every candidate."""
    profile = str(DATA / f"h100-80gb-vllm__llama-3.1-8b__{draft}.csv")
    base = SimConfig.of(profile=profile, rate=1.0, num_requests=100, max_num_seqs=128, prompt_len=210, output_len=200,
                        scheduler="chunked-prefill", max_num_batched_tokens=8192)
    acceptance = advise_inputs.resolve([method], "llama-3.1-8b", advise_inputs.AcceptanceInputs())[method]
    drafter = advise.Drafter(method, profile, draft, acceptance, method)
    study = advise.Study(base, profile, advise.Load("rate", (1.0,)), parse_slo("99% ttft:500"), 100, advise.Runner(1))
    capacity = advise.full_load(study, [advise.Candidate("no-spec", "no-spec")])["no-spec"]
    _, entries = advise.batch_table(study, drafter, ks=range(5))
    table = advise.table_candidate(drafter, entries, 128)
    assert table.family == "vllm-batch-table" and len(entries) >= 2  # a table of ranges, the ramp crosses them
    runs, verdict = advise.ramp_check(study, table, capacity, 300, tmp_path)
    latency = dict(zip(runs["candidate"], runs["mean_latency"]))
    fixed = {name: v for name, v in latency.items() if name != table.name}
    assert sorted(fixed) == sorted(["no-spec"] + [f"fixed-k:{k} [{method}]" for k in range(1, 8)])
    assert latency[table.name] <= min(fixed.values())
    assert "beats every fixed k" in verdict or "ties" in verdict


def test_the_verdict_of_a_table_of_one_k_is_a_tie_when_that_k_is_the_best_fixed_one(tmp_path):
    base = SimConfig.of(profile=P8_EAGLE3, rate=1.0, num_requests=60, max_num_seqs=16, prompt_len=64, output_len=32)
    study = advise.Study(base, P8_EAGLE3, advise.Load("rate", (1.0,)), parse_slo("99% ttft:500"), 60,
                         advise.Runner(1))
    for k in (1, 3):
        runs, verdict = advise.ramp_check(study, advise.fixed_k(EAGLE3, k), 100.0, 60, tmp_path)
        assert runs.groupby("candidate")["seed"].count().to_dict() == {  # the table is one of the fixed k
            "no-spec": 3, **{f"fixed-k:{j} [eagle3]": 3 for j in range(1, 8)}}
        latency = runs[runs["candidate"] != "no-spec"].groupby("candidate")["mean_latency"].mean()
        tie = latency.idxmin() == f"fixed-k:{k} [eagle3]"
        assert ("it ties the best fixed k" in verdict) == tie and ("does NOT beat" in verdict) == (not tie)
        assert f"the generated table is fixed-k:{k}" in verdict


def test_diurnal_arrivals_follow_the_sinusoid_of_their_cumulative_rate():
    """Λ(t) / Λ(T) = t/T - (A / 2 pi) sin(2 pi t / T): a quarter of the run holds 1/4 - A / 2 pi of the requests."""
    n = 20000
    u = np.linspace(0.0, 100.0, n)
    wl = diurnal(Workload(u, np.ones(n, np.int64), np.ones(n, np.int64), "even"), 0.8)
    t = wl.arrival_time
    assert np.all(np.diff(t) >= 0) and t[0] == 0 and t[-1] == pytest.approx(100.0)
    assert np.mean(t < 25.0) == pytest.approx(0.25 - 0.8 / (2 * math.pi), abs=1e-3)
    assert np.mean((t >= 25.0) & (t < 75.0)) == pytest.approx(0.5 + 0.8 / math.pi, abs=1e-3)
    assert "diurnal" in wl.source


# -- the flags -------------------------------------------------------------------------------------------------
CONFIGS = [
    {"policy": "fixed-k", "k": 3, "policy_params": (), "speculative_method": "eagle3", "speculative_token_tree": None},
    {"policy": "vllm-batch-table", "k": 4, "policy_params": (("table", "1-8:4,9-64:2,65-256:0"),),
     "speculative_method": "eagle3", "speculative_token_tree": None},
    {"policy": "fixed-k", "k": 5, "policy_params": (), "speculative_method": "ngram", "speculative_token_tree": None},
    {"policy": "fixed-k", "k": 3, "policy_params": (), "speculative_method": "eagle3",
     "speculative_token_tree": "[(0,), (1,), (0, 0)]"},
]


@pytest.mark.parametrize("fields", CONFIGS, ids=["chain", "table", "ngram", "tree"])
def test_the_speculative_config_written_reads_back_as_the_same_fields(fields):
    written = engine_flags.vllm_speculative_config(fields, "eagle3-llama-3.1-8b", 256)
    text = json.dumps(written)
    assert engine_flags.parse_speculative_config(text, "eagle3-llama-3.1-8b", "eagle3") == fields


def test_the_written_configs_use_vllms_keys():
    table = engine_flags.vllm_speculative_config(CONFIGS[1], "eagle3-llama-3.1-8b", 256)
    assert table == {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 4,
                     "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 2], [65, 256, 0]]}
    ngram = engine_flags.vllm_speculative_config(CONFIGS[2], None, 256)
    assert ngram == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert engine_flags.vllm_speculative_config({**CONFIGS[0], "policy": "goodput"}, None, 256) is None


def test_sglang_flags_of_a_chain_a_tree_and_adaptive_tiers():
    chain = engine_flags.sglang_flags(CONFIGS[0], "eagle3-llama-3.1-8b")
    assert chain == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                     "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "--speculative-num-steps", "3", "--speculative-eagle-topk",
                     "1", "--speculative-num-draft-tokens", "4"]
    tree = engine_flags.sglang_flags({**CONFIGS[0], "speculative_num_steps": 5, "speculative_eagle_topk": 4,
                                      "speculative_num_draft_tokens": 8}, "eagle3-llama-3.1-8b")
    assert tree[-6:] == ["--speculative-num-steps", "5", "--speculative-eagle-topk", "4",
                         "--speculative-num-draft-tokens", "8"]
    adaptive = engine_flags.sglang_flags({**CONFIGS[0], "policy": "sglang-adaptive", "k": 7}, "eagle3-llama-3.1-8b")
    assert adaptive[-1] == "--speculative-adaptive"
    assert engine_flags.sglang_flags(CONFIGS[1], "eagle3-llama-3.1-8b") is None  # no per-batch-size table in SGLang


def test_simulate_with_vllms_speculative_config_runs_as_the_same_flags_given_one_by_one(tmp_path):
    table = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3, ' \
            '"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 256, 1]]}'
    common = ["simulate", "--profile", P8_EAGLE3, "--rate", "8", "--num-requests", "30"]
    assert run_sim.main([*common, "--speculative-config", table, "--out", str(tmp_path / "a")]) == 0
    assert run_sim.main([*common, "--speculative-method", "eagle3", "--policy", "vllm-batch-table", "--k", "3",
                         "--policy-param", "table=1-2:3,3-256:1", "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / x / "summary.json").read_text()) for x in "ab")
    assert {k: v for k, v in a.items() if k != "wall_seconds"} == {k: v for k, v in b.items() if k != "wall_seconds"}


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle3", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}',
     "--speculative-config: unknown key 'draft_tensor_parallel_size'"),
    ('{"method": "eagle3", "model": "meta-llama/Llama-3.2-1B", "num_speculative_tokens": 3}',
     "--speculative-config: model 'meta-llama/Llama-3.2-1B' is not the profile's draft"),
    ('{"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[2, 8, 3]]}',
     "--speculative-config: num_speculative_tokens_per_batch_size: must start at batch size 1"),
])
def test_a_bad_speculative_config_is_one_line_naming_the_key(tmp_path, capsys, config, message):
    code = run_sim.main(["sweep", "--profile", P8_EAGLE3, "--speculative-config", config, "--rates", "1",
                         "--policies", "fixed-k", "--num-requests", "10", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {message}")


# -- the search ------------------------------------------------------------------------------------------------
def test_successive_halving_chooses_what_the_exhaustive_sweep_chooses():
    base = SimConfig.of(profile=P8_EAGLE3, rate=1.0, num_requests=120, max_num_seqs=32, prompt_len=128,
                        output_len=64, goodput_slo=(("ttft", 300.0), ("tpot", 12.0)))
    acceptance = advise_inputs.resolve(["eagle3"], "llama-3.1-8b", advise_inputs.AcceptanceInputs())["eagle3"]
    drafter = advise.Drafter("eagle3", P8_EAGLE3, "eagle3-llama-3.1-8b", acceptance, "eagle3")
    cands = advise.candidates([drafter], ("no-spec", "fixed-k"), range(1, 8), ())
    slo = parse_slo("95% ttft:300 tpot:12")
    study = advise.Study(base, P8_EAGLE3, advise.Load("rate", (20.0, 40.0, 60.0, 80.0)), slo, 120,
                         advise.Runner(1))
    halving, halving_runs, _ = advise.search(study, cands)
    exhaustive, exhaustive_runs, _ = advise.search(study, cands, exhaustive=True)
    assert halving["candidate"].iloc[0] == exhaustive["candidate"].iloc[0]
    assert halving["sustainable_load"].iloc[0] == exhaustive["sustainable_load"].iloc[0]
    assert len(halving_runs[halving_runs["rung"] == 1]["candidate"].unique()) == 8  # every candidate, short
    assert len(halving_runs[halving_runs["rung"] == 2]["candidate"].unique()) < 8  # the survivors, whole
    assert halving_runs["requests_asked"].sum() < exhaustive_runs["requests_asked"].sum()


def test_the_sustainable_load_is_where_the_slo_figure_crosses_its_bound_and_at_most_the_full_load_throughput():
    runs = pd.DataFrame({"candidate": "a", "family": "fixed-k", "method": "eagle3", "load": [1.0, 2.0, 3.0],
                         "slo_attainment": [1.0, 0.995, 0.9], "saturated": False, "mean_latency": 1.0,
                         "mean_tpot_ms": 5.0, "output_throughput": 10.0})
    slo = parse_slo("99% ttft:500")
    table = advise.score(runs, slo)
    assert table["sustainable_load"].iloc[0] == pytest.approx(2.0 + (0.995 - 0.99) / (0.995 - 0.9))
    assert table["found"].iloc[0] == "interpolated"
    capped = advise.score(runs, slo, {"a": 1.5})
    assert (capped["sustainable_load"].iloc[0], capped["found"].iloc[0]) == (1.5, "full-load throughput")
    saturated = advise.score(runs.assign(saturated=[False, True, True]), slo)
    assert saturated["sustainable_load"].iloc[0] == 1.0  # nothing interpolates into a saturated run


# -- the command -----------------------------------------------------------------------------------------------
def test_advise_answers_first_with_a_number_and_a_configuration_then_writes_every_output(tmp_path, capsys):
    out = tmp_path / "advice"
    code = run_sim.main(["advise", "--profile", P8_EAGLE3, "--no-discover", "--slo", "99% ttft:500 tpot:50",
                         *SMALL_ENGINE, "--ks", "1,3", "--families", "no-spec,fixed-k,vllm-batch-table",
                         "--rates", "20,60,100", "--num-requests", "60", "--ramp-requests", "40",
                         "--workers", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    first = captured.out.splitlines()[0]
    assert " req/s within 99% of requests with ttft<=500ms tpot<=50ms on llama-3.1-8b" in first
    assert "published default" in first and "0.8x acceptance" in first
    assert captured.out.splitlines()[2].startswith("vLLM: vllm serve meta-llama/Llama-3.1-8B --tensor-parallel-size 1")
    advice = json.loads((out / "advice.json").read_text())
    assert advice["chosen"] == advice["by_engine"]["vllm"]["candidate"]
    assert set(advice["acceptance"]) == {"eagle3", "ngram"}
    assert any("EAGLE head" in line for line in advice["unpriced"])
    assert len(advice["ramp"]) == 2 and all("diurnal ramp" in line for line in advice["ramp"])
    for name in ("ranking.csv", "runs.csv", "batch_tables.csv", "ramp.csv", "pareto.png", "report.html",
                 "diurnal_trace.csv"):
        assert (out / name).is_file(), name
    report = (out / "report.html").read_text()
    assert "Paste-ready configuration" in report and "published default" in report
    written = advice["settings"]["vllm_speculative_config"]
    chosen = advice["chosen"]
    if written is not None:  # the flags written read back as the chosen candidate's policy and method
        fields = engine_flags.parse_speculative_config(json.dumps(written), "eagle3-llama-3.1-8b", "eagle3")
        assert (fields["policy"], fields["speculative_method"]) == (chosen.split()[0].split(":")[0], "eagle3") or \
            fields["policy"] == chosen.split()[0]


def test_advise_with_a_target_rate_answers_the_fewest_gpus(tmp_path, capsys):
    code = run_sim.main(["advise", "--profile", P8_EAGLE3, "--no-discover", "--methods", "eagle3",
                         "--slo", "99% ttft:500 tpot:50", *SMALL_ENGINE, "--ks", "2", "--families", "no-spec,fixed-k",
                         "--rates", "30,60", "--num-requests", "40", "--target-rate", "150", "--workers", "1",
                         "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    advice = json.loads((tmp_path / "advice.json").read_text())
    fleet = advice["fleet"]
    assert fleet["found"] and captured.out.startswith(f"{fleet['gpus']} GPUs serve 150 req/s within")
    tried = pd.read_csv(tmp_path / "fleet.csv")
    assert tried.loc[tried["meets_slo"], "gpus"].min() == fleet["gpus"]


def test_advise_calibrates_vllm_results_first(tmp_path, capsys):
    lambda_files = sorted(str(p) for p in (DATA / "vllm_lambda").glob("4xH100*70B*.json"))
    code = run_sim.main(["advise", "--vllm-results", *lambda_files, "--gpu", "h100-80gb", "--target",
                         "llama-3.1-70b", "--tp", "4", "--calibrate-max-evals", "2", "--slo", "99% ttft:2000",
                         "--max-num-seqs", "16", "--ks", "1", "--families", "no-spec,fixed-k", "--methods",
                         "draft_model", "--rates", "1,2", "--num-requests", "40", "--workers", "1",
                         "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    profile = tmp_path / "calibrated" / "h100-80gbx4-vllm__llama-3.1-70b__llama-3.2-1b.csv"
    assert profile.is_file()
    assert json.loads((tmp_path / "advice.json").read_text())["deployment"]["profiles"] == [str(profile)]


def test_a_vllm_result_with_speculation_is_not_calibrated(tmp_path, capsys):
    data = json.loads((DATA / "vllm_lambda" / "4xH100-80GB-SXM__Meta-Llama-3-70B-Instruct__N80.json").read_text())
    data.update(spec_decode_num_drafts=10, spec_decode_draft_tokens=30, spec_decode_accepted_tokens=12)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(data))
    code = run_sim.main(["advise", "--vllm-results", str(path), "--gpu", "h100-80gb", "--target", "llama-3.1-70b",
                         "--tp", "4", "--slo", "99% ttft:2000", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "ran with speculation on" in err[0] and "--acceptance-results" in err[0]


def test_the_runs_of_a_study_are_the_simulators_own(tmp_path):
    """A candidate's run in the study is simulate's run of its config: the same figures."""
    base = SimConfig.of(profile=P8_EAGLE3, rate=10.0, num_requests=30, max_num_seqs=16)
    acceptance = advise_inputs.assumed_default("eagle3")
    drafter = advise.Drafter("eagle3", P8_EAGLE3, "eagle3-llama-3.1-8b", acceptance)
    cand = advise.candidates([drafter], ("fixed-k",), (2,), ())[1]
    config = cand.config(base, P8_EAGLE3)
    _, figures = advise._run_item(("x", config))
    assert figures["mean_latency"] == run(config).summary["mean_latency"]
    assert (config.speculative.policy, config.speculative.k, config.speculative.acceptance_rate) == \
        ("fixed-k", 2, 0.8)
