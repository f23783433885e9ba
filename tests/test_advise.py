"""``run_sim.py advise`` (issue 33): the acceptance it converts, the profiles it finds, the batch-size table it
derives, the flags it writes and reads back, the search against the exhaustive sweep, and the command end to end, on
small spaces and few requests."""
from __future__ import annotations

import json
import math

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
def test_the_table_takes_the_best_k_at_every_batch_size_interpolated_in_log_batch():
    """k = 1 beats k = 0 at batch 1 (200 against 100 tokens/s), k = 0 wins at 100 (1000 against 800): linear in log b
    they cross at b = 100^(1/3) = 4.6; at b = 4 k = 1 is 2.6% ahead (beyond the 1% tolerance), at b = 5 k = 0 leads."""
    runs = pd.DataFrame({"batch": [1, 100, 1, 100], "k": [0, 0, 1, 1], "output_throughput": [100, 1000, 200, 800]})
    entries, best = advise.table_entries(runs, 128)
    assert entries == [(1, 1), (5, 0)]
    assert best == {1: 1, 100: 0}
    drafter = advise.Drafter("eagle3", P8_EAGLE3, "eagle3-llama-3.1-8b", advise_inputs.assumed_default("eagle3"))
    table = advise.table_candidate(drafter, entries, 128)
    assert dict(table.fields)["policy_params"] == (("table", "1-4:1,5-128:0"),)
    assert advise.table_candidate(drafter, [(1, 0)], 128) is None  # a table that never speculates is no candidate


def test_a_smaller_k_within_the_tolerance_wins():
    runs = pd.DataFrame({"batch": [1, 1, 1], "k": [1, 2, 3], "output_throughput": [100.0, 100.5, 100.9]})
    assert advise.table_entries(runs, 4)[0] == [(1, 1)]


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
