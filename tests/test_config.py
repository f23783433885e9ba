"""The configuration by concern (:mod:`simulator.config`): each concern checks itself, :class:`SimConfig` checks what
crosses them, the field names stay the vocabulary (builder, replace, flags, files), ``config.json`` is written by
concern and the flat files written before are still read; and the command line's mends: no abbreviated flags, errors
that name the flag, ``--request-rate inf``."""
from __future__ import annotations

import dataclasses
import json
import math

import pandas as pd
import pytest

from policies.errors import UserError
from simulator.config import (CONCERN_OF, CONCERNS, FIELDS, CostConfig, EngineConfig, FleetConfig, RunConfig,
                              SimConfig, SpeculativeConfig, WorkloadConfig, config_hash, flags_of)
from simulator.studies.cli import build_parser, main

SMALL = dict(rate=4.0, num_requests=10)


# -- each concern alone --------------------------------------------------------------------------------------------
def test_every_concern_but_the_workload_is_valid_at_its_defaults():
    assert [cls.__name__ for cls in CONCERNS.values()] == ["WorkloadConfig", "EngineConfig", "FleetConfig",
                                                          "SpeculativeConfig", "CostConfig", "RunConfig"]
    for cls in (EngineConfig, FleetConfig, SpeculativeConfig, CostConfig, RunConfig):
        cls()
    with pytest.raises(UserError, match=r"^config: --rate is required for synthetic arrivals$"):
        WorkloadConfig()  # synthetic arrivals need a rate, as SimConfig always did


@pytest.mark.parametrize("concern, fields, message", [
    (WorkloadConfig, dict(rate=0.0, num_requests=1), "config: --rate must be > 0, got 0.0"),
    (WorkloadConfig, dict(rate=4.0, num_requests=1, cv=2.0), "config: --cv 2 is used only by arrival=gamma"),
    (WorkloadConfig, dict(rate="4", num_requests=1), "config: --rate must be a number, got '4' (str)"),
    (EngineConfig, dict(max_num_seqs=0), "config: --max-num-seqs (max_num_seqs) must be > 0, got 0"),
    (EngineConfig, dict(num_scheduler_steps=4, scheduler="chunked-prefill"), "needs scheduler=prefill-first"),
    (EngineConfig, dict(enable_prefix_caching="yes"),
     "config: --enable-prefix-caching (enable_prefix_caching) must be true or false, got 'yes' (str)"),
    (FleetConfig, dict(prefill_replicas=1), "disaggregated serving needs both --prefill-replicas (prefill_replicas)"),
    (FleetConfig, dict(kv_link="ethernet"), "--kv-link (kv_link) is used only by disaggregated serving"),
    (SpeculativeConfig, dict(acceptance_rate=1.5),
     "config: --token-acceptance-prob (acceptance_rate) must be in [0, 1], got 1.5"),
    (SpeculativeConfig, dict(k=True), "config: --k must be a whole number, got True (bool)"),
    (CostConfig, dict(fitter="spline"), "config: --fitter must be one of auto, linear, interp; got 'spline'"),
    (RunConfig, dict(seed=-1), "config: --seed must be an integer >= 0, got -1"),
    (RunConfig, dict(goodput_slo=(("ttft", 500.0), ("ttft", 400.0))), "--goodput (goodput_slo): a metric given twice"),
])
def test_each_concern_checks_its_own_fields_and_names_the_flag(concern, fields, message):
    with pytest.raises(UserError) as error:
        concern(**fields)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_concern_normalises_what_it_holds():
    assert SpeculativeConfig(speculative_method="EAGLE3").speculative_method == "eagle3"  # SGLang's name, vLLM's kept
    mixed = FleetConfig(replica_profiles=("b", "a"))
    assert (mixed.replica_profiles, mixed.replicas) == (("a", "b"), 2)


# -- what crosses concerns -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    (dict(num_scheduler_steps=4, policy="fixed-k", k=3), "multi-step scheduling) runs without speculation"),
    (dict(replicas=2, max_concurrency=4), "config: --replicas > 1 with --max-concurrency (max_concurrency) is not "
                                          "modelled"),
    (dict(replicas=2, router="prefix-aware"), "config: --router prefix-aware needs --enable-prefix-caching"),
    (dict(prefill_replicas=1, decode_replicas=1, max_concurrency=4), "with disaggregated serving is not modelled"),
    (dict(prefill_replicas=1, decode_replicas=1, num_scheduler_steps=2), "> 1 with disaggregated serving"),
    (dict(prefill_replicas=1, decode_replicas=1, prefill_router="prefix-aware"),
     "--prefill-router (prefill_router) prefix-aware needs --enable-prefix-caching"),
])
def test_what_crosses_concerns_is_checked_by_the_whole(fields, message):
    groups = {}
    for name, value in fields.items():
        groups.setdefault(CONCERN_OF[name], {})[name] = value
    groups["workload"] = {**SMALL, **groups.get("workload", {})}
    parts = {concern: CONCERNS[concern](**values) for concern, values in groups.items()}  # each valid alone
    for build in (lambda: SimConfig(**parts), lambda: SimConfig.of(**SMALL, **fields)):
        with pytest.raises(UserError) as error:
            build()
        assert message in str(error.value)


def test_speculation_with_one_scheduler_step_is_accepted():
    assert SimConfig.of(**SMALL, num_scheduler_steps=1, policy="fixed-k").speculative.policy == "fixed-k"
    assert SimConfig.of(**SMALL, num_scheduler_steps=8, policy="fixed-k", k=0).engine.num_scheduler_steps == 8


# -- the flat names ------------------------------------------------------------------------------------------------
def test_every_field_name_belongs_to_one_concern_in_its_order():
    assert list(FIELDS) == [f.name for cls in CONCERNS.values() for f in dataclasses.fields(cls)]
    assert set(CONCERN_OF) == set(FIELDS) and len(FIELDS) == 63
    assert {CONCERN_OF[n] for n in ("rate", "max_concurrency", "tokenizer")} == {"workload"}
    assert {CONCERN_OF[n] for n in ("block_size", "strict_fit", "cuda_graph_sizes")} == {"engine"}
    assert {CONCERN_OF[n] for n in ("k", "proposer", "acceptance_rate", "speculative_token_tree")} == {"speculative"}
    assert {CONCERN_OF[n] for n in ("replicas", "kv_link")} == {"fleet"}
    assert {CONCERN_OF[n] for n in ("profile", "fitter", "policy_profile")} == {"cost"}
    assert {CONCERN_OF[n] for n in ("seed", "save_steps", "goodput_slo")} == {"run"}


def test_the_builder_routes_each_name_to_its_concern():
    config = SimConfig.of(rate=4.0, num_requests=100, policy="fixed-k", k=3, block_size=32, replicas=2,
                          fitter="linear", seed=5)
    assert (config.workload.rate, config.workload.num_requests) == (4.0, 100)
    assert (config.speculative.policy, config.speculative.k) == ("fixed-k", 3)
    assert (config.engine.block_size, config.fleet.replicas, config.cost.fitter, config.run.seed) == (
        32, 2, "linear", 5)
    assert config.flat() == {**{name: f.default for name, f in FIELDS.items()}, "rate": 4.0, "num_requests": 100,
                             "policy": "fixed-k", "k": 3, "block_size": 32, "replicas": 2, "fitter": "linear",
                             "seed": 5}


def test_replace_routes_each_name_and_leaves_the_other_concerns_as_they_were():
    config = SimConfig.of(**SMALL, policy="fixed-k")
    changed = config.replace(rate=2.0, k=1)
    assert (changed.workload.rate, changed.speculative.k) == (2.0, 1)
    assert changed.workload.num_requests == 10 and changed.speculative.policy == "fixed-k"
    assert all(getattr(changed, c) is getattr(config, c) for c in ("engine", "fleet", "cost", "run"))
    assert config.replace() == config and config.workload.rate == 4.0  # frozen: the original is unchanged
    with pytest.raises(UserError, match=r"--rate must be > 0"):
        config.replace(rate=-1.0)  # validated


def test_a_method_and_its_proposer_stay_in_step_through_replace():
    ngram = SimConfig.of(**SMALL, speculative_method="ngram")
    assert (ngram.speculative.proposer, ngram.speculative.proposer_method) == ("ngram", "ngram")
    draft = ngram.replace(proposer="draft")  # a proposer drops the method it does not run
    assert (draft.speculative.speculative_method, draft.speculative.proposer_method) == (None, "draft_model")
    assert draft.replace(speculative_method="EAGLE3").speculative.proposer_method == "eagle3"
    with pytest.raises(UserError, match="runs proposer draft, not proposer=ngram"):
        SimConfig.of(**SMALL, speculative_method="eagle", proposer="ngram")


@pytest.mark.parametrize("build", [lambda: SimConfig.of(**SMALL, bogus=1),
                                   lambda: SimConfig.of(**SMALL).replace(bogus=1)])
def test_an_unknown_name_is_one_line_naming_it(build):
    with pytest.raises(UserError, match=r"^config: unknown config field 'bogus'$"):
        build()


# -- config.json -------------------------------------------------------------------------------------------------
def config_with_every_kind_of_value() -> SimConfig:
    return SimConfig.of(rate=math.inf, num_requests=20, max_concurrency=4, cuda_graph_sizes=(1, 2, 4),
                        policy="goodput", policy_params=(("bonus", 1.2),), acceptance="position",
                        acceptance_positions=(0.9, 0.5), goodput_slo=(("ttft", 500.0),), seed=3)


def test_config_json_holds_one_object_per_concern_and_reads_back_equal():
    config = config_with_every_kind_of_value()
    saved = json.loads(json.dumps(config.to_dict(), allow_nan=False))  # what config.json holds: JSON has no inf
    assert list(saved) == list(CONCERNS)
    assert saved["workload"]["rate"] == "inf" and saved["speculative"]["policy_params"] == [["bonus", 1.2]]
    assert saved["engine"]["cuda_graph_sizes"] == [1, 2, 4] and saved["run"]["goodput_slo"] == [["ttft", 500.0]]
    assert SimConfig.from_dict(saved) == config


def test_a_flat_config_json_written_before_concerns_reads_as_the_same_config():
    config = config_with_every_kind_of_value()
    old = json.loads(json.dumps(config.to_dict(flat=True), allow_nan=False))  # the old file: every field at the top
    assert list(old) == list(FIELDS) and old["rate"] == "inf" and old["acceptance_positions"] == [0.9, 0.5]
    assert SimConfig.from_dict(old) == config
    assert SimConfig.from_dict({"rate": 2, "num_requests": 5, "engine": {"block_size": 32}}) == SimConfig.of(
        rate=2, num_requests=5, block_size=32)  # a file may mix both


@pytest.mark.parametrize("data, message", [
    ({"workload": {"rate": 1, "num_requests": 1, "bogus": 1}}, "run.json: unknown config field 'bogus' in workload"),
    ({"workload": {"rate": 1, "num_requests": 1, "k": 2}},
     "run.json: unknown config field 'k' in workload (it belongs to speculative)"),
    ({"rate": 1, "num_requests": 1, "bogus": 1}, "run.json: unknown config field 'bogus'"),
    ({"rate": 1, "workload": {"rate": 2, "num_requests": 1}}, "run.json: config field 'rate' given twice"),
    ({"engine": 7, "rate": 1, "num_requests": 1}, "run.json: engine must be a JSON object of its fields, got 7"),
    ({"rate": "fast", "num_requests": 1}, "run.json: config: --rate must be a number, got 'fast' (str)"),
])
def test_a_bad_config_file_is_one_line_naming_the_file_and_the_key(data, message):
    with pytest.raises(UserError) as error:
        SimConfig.from_dict(data, source="run.json")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_hash_keys_the_resolved_config():
    config = SimConfig.of(**SMALL)
    assert config_hash(config) == config_hash(SimConfig.from_dict(config.to_dict(flat=True)))
    assert config_hash(config) != config_hash(config.replace(seed=1))
    assert len(config_hash(config)) == 16


# -- the command line ----------------------------------------------------------------------------------------------
def help_text(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # argparse keeps no public lookup
    return sub.format_help()


@pytest.mark.parametrize("command", ["simulate", "sweep", "tune", "compare", "disagg"])
def test_help_shows_every_field_flag_in_one_group_per_concern(command):
    text = help_text(command)
    flags = [f for name in FIELDS for f in flags_of(name)]
    vllm = ["--burstiness", "--dataset-path", "--enable-chunked-prefill", "--dataset-name", "--config"]
    missing = [f for f in flags + vllm if f"  {f}" not in text and f", {f}" not in text]
    assert not missing, missing
    headings = [line.split(" (")[0] for line in text.splitlines() if line.endswith(":") and line[0] != " "]
    assert [h for h in headings if h in ("workload", "engine", "fleet", "speculative decoding", "cost model",
                                         "run")] == ["workload", "engine", "fleet", "speculative decoding",
                                                     "cost model", "run"]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_an_abbreviated_flag_is_refused_not_completed(capsys, tmp_path):
    code, err = run_cli(capsys, "simulate", "--rate", "4", "--num-request", "5", "--out", str(tmp_path / "o"))
    assert (code, err) == (2, "error: run_sim.py: unrecognized arguments: --num-request 5\n")
    code, err = run_cli(capsys, "sweep", "--rates", "1", "--polic", "no-spec", "--out", str(tmp_path / "s"))
    assert (code, err) == (2, "error: run_sim.py: unrecognized arguments: --polic no-spec\n")
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()


@pytest.mark.parametrize("argv", [
    ["tune", "--slo", "p99_latency<=1", "--rates", "1", "--out", "o", "--polic=goodput"], ["disagg", "--gpu=2"],
    ["compare", "a", "b", "--ou=c"], ["validate", "--num-request=2"], ["profile", "--targ=tiny"],
    ["calibrate", "--gpu", "h100", "--target", "t", "--out", "o", "--transfer=x"], ["bench", "--size=10"]])
def test_no_command_takes_an_abbreviated_flag(capsys, argv):
    import run_sim

    if argv[0] in ("validate", "profile"):
        pytest.importorskip("torch")
    try:
        code = run_sim.main(argv)
    except SystemExit as exc:  # calibrate and bench: argparse's own report (usage, then the error)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and f"unrecognized arguments: {argv[-1]}" in err, err


@pytest.mark.parametrize("flags, line", [
    (["--token-acceptance-prob", "1.5"], "error: config: --token-acceptance-prob (acceptance_rate) must be in [0, 1], "
                                         "got 1.5\n"),
    (["--acceptance-rate", "1.5"], "error: config: --token-acceptance-prob (acceptance_rate) must be in [0, 1], "
                                   "got 1.5\n"),  # the old spelling: the same field, its primary flag named
    (["--num-speculative-tokens", "65"], "error: config: --k must be <= 64, got 65\n"),
    (["--max-num-seqs", "0"], "error: config: --max-num-seqs (max_num_seqs) must be > 0, got 0\n"),
    (["--token-acceptance-prob", "high"], "error: --token-acceptance-prob: not a valid float: 'high'\n"),
])
def test_an_error_about_a_value_names_its_flag(capsys, tmp_path, flags, line):
    code, err = run_cli(capsys, "simulate", "--request-rate", "4", "--num-prompts", "5", *flags,
                        "--out", str(tmp_path / "o"))
    assert (code, err) == (2, line)


def test_request_rate_inf_sends_every_request_at_once_through_the_client_loop(capsys, tmp_path):
    """vLLM's ``vllm bench serve --request-rate inf``: every request at t = 0, ``--max-concurrency`` of them in flight
    (the next sent as one finishes)."""
    out = tmp_path / "o"
    code, err = run_cli(capsys, "simulate", "--request-rate", "inf", "--num-prompts", "6", "--max-concurrency", "2",
                        "--format", "csv", "--save-result", "--out", str(out))
    assert code == 0, err
    requests = pd.read_csv(out / "requests.csv")
    sent = requests["arrival_time"].tolist()  # with a client loop, a request's time is its sending
    assert sent[:2] == [0.0, 0.0] and sent[2:4] == [requests["finish_time"][0]] * 2
    assert json.loads((out / "config.json").read_text())["workload"]["rate"] == "inf"
    assert json.loads((out / "vllm_result.json").read_text())["request_rate"] == "inf"  # as vLLM writes it
    rerun = tmp_path / "again"
    assert run_cli(capsys, "simulate", "--config", str(out / "config.json"), "--format", "csv", "--out",
                   str(rerun))[0] == 0
    assert (rerun / "requests.csv").read_bytes() == (out / "requests.csv").read_bytes()


def test_an_infinite_rate_arrives_at_zero_without_a_draw():
    from simulator.inputs.workload import build_workload

    workload = build_workload(WorkloadConfig(rate=math.inf, num_requests=4, arrival="gamma", cv=3.0), None, None)
    assert workload.arrival_time.tolist() == [0.0] * 4 and workload.source.startswith("rate inf: all sent at 0 s")


@pytest.mark.parametrize("flags, message", [
    (["--rate", "inf", "--duration", "10"], "--rate inf sends every request at t = 0: it needs --num-requests"),
    (["--rate", "nan", "--num-requests", "5"], "--rate must be a finite number, got nan"),
    (["--rate=-inf", "--num-requests", "5"], "--rate must be a finite number, got -inf"),
    (["--rate", "-1", "--num-requests", "5"], "--rate must be > 0, got -1.0"),
])
def test_a_rate_is_a_number_above_zero_or_inf(capsys, tmp_path, flags, message):
    code, err = run_cli(capsys, "simulate", *flags, "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_trace_refuses_an_infinite_rate(capsys, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_time,prompt_tokens,output_tokens\n0,10,5\n1,10,5\n")
    code, err = run_cli(capsys, "simulate", "--trace", str(trace), "--request-rate", "inf", "--out",
                        str(tmp_path / "o"))
    assert code == 2 and err.startswith("error: config: --rate inf with a trace: a trace's arrivals cannot be "
                                        "rescaled to an infinite rate") and err.count("\n") == 1


def test_compare_reads_a_runs_config_json_by_concern_and_as_written_before(capsys, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):  # prompts beyond 100 blocks of 32 tokens are ignored, and the warnings say so
        assert run_cli(capsys, "simulate", "--rate", "4", "--num-requests", "20", "--length-dist", "lognormal",
                       "--prompt-len", "1500", "--num-gpu-blocks", "100", "--block-size", "32", "--format", "csv",
                       "--out", str(out))[0] == 0
    saved = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(SimConfig.from_dict(saved).to_dict(flat=True)))  # b: the old file
    assert run_cli(capsys, "compare", str(a), str(b), "--out", str(tmp_path / "c"))[0] == 0
    report = (tmp_path / "c" / "report.html").read_text()
    assert report.count("(100 blocks of 32 tokens)") == 2
