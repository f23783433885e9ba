"""Every family of bad input ends with exit status 2 and one line naming the input and the problem, leaving no
result that looks complete; documented acceptances end with exit 0 (cases in :mod:`tests.bad_inputs`). Plus
property tests (hypothesis) of the parsers and checks the cases rely on."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.errors import UserError
from simulator.config import SimConfig, flags_of
from simulator.studies.cli import main
from simulator.studies.specs import parse_floats, parse_rates, parse_seeds
from tests.bad_inputs import CASES, Case


@pytest.mark.parametrize("case", CASES, ids=[f"{c.family}: {c.name}" for c in CASES])
def test_each_bad_input_ends_with_one_line_and_exit_2(case: Case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECSIM_CACHE_DIR", str(tmp_path / "cache"))
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    work = tmp_path / "case"
    work.mkdir()
    argv = case.build(work)
    if argv[0] in ("profile", "validate", "calibrate"):  # the profiles side (calibrate needs no torch)
        if argv[0] != "calibrate":
            pytest.importorskip("torch")
        import run_sim

        code = run_sim.main(argv)
    else:
        code = main(argv)
    err = capsys.readouterr().err.strip()
    if case.expect == "ok":
        assert code == 0, err
        return
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.needle in lines[0], err
    for folder in ("out", "sweep", "t") if case.family != "sweep/tune/plot" or "plot:" not in case.name else ():
        assert not (work / folder / "summary.json").exists() and not (work / folder / "summary.csv").exists()


def test_a_csv_profile_without_metadata_is_labelled_unknown(tmp_path, capsys):
    from tests.bad_inputs import SMALL, _csv_profile, simulate

    assert main(simulate(tmp_path, *SMALL, prof=_csv_profile(tmp_path))) == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["profile_method"] == "unknown"
    assert "profile: unknown" in capsys.readouterr().out


def test_a_bom_trace_reads_like_the_plain_one(tmp_path, capsys):
    from simulator.inputs.workload import read_trace

    text = "arrival_time,prompt_tokens,output_tokens\n0,10,5\n1.5,20,3\n"
    (tmp_path / "a.csv").write_text(text)
    (tmp_path / "b.csv").write_text("\ufeff" + text)
    a, b = read_trace(str(tmp_path / "a.csv")), read_trace(str(tmp_path / "b.csv"))
    assert a.arrival_time.tolist() == b.arrival_time.tolist() and a.prompt_tokens.tolist() == b.prompt_tokens.tolist()


# -- properties ---------------------------------------------------------------------------------------------------
texts = st.text(alphabet="0123456789.,-+eEnaifINF x", max_size=20)


@given(texts)
@settings(max_examples=300, deadline=None)
def test_seeds_are_whole_numbers_or_a_one_line_error(text):
    try:
        seeds = parse_seeds("--seeds", text)
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("--seeds")
        return
    assert seeds and all(isinstance(s, int) and s >= 0 for s in seeds) and len(set(seeds)) == len(seeds)
    assert [int(x) for x in text.split(",") if x.strip()] == seeds  # never rounded


@given(texts)
@settings(max_examples=300, deadline=None)
def test_number_lists_are_finite_or_a_one_line_error(text):
    for parse in (parse_floats, parse_rates):
        try:
            values = parse("--rates", text)
        except UserError as exc:
            assert "\n" not in str(exc) and str(exc).startswith("--rates")
            continue
        assert values and all(math.isfinite(v) for v in values)
        if parse is parse_rates:
            assert all(v > 0 for v in values)


FLOAT_FIELDS = ["rate", "cv", "duration", "trace_speedup", "length_sigma", "gpu_memory_gb", "gpu_memory_utilization",
                "activation_reserve_gb", "ngram_match_prob", "acceptance_rate", "acceptance_concentration"]
INT_FIELDS = ["num_requests", "prompt_len", "output_len", "max_prompt_len", "max_output_len", "max_num_seqs",
              "max_num_batched_tokens", "block_size", "num_gpu_blocks", "k", "seed"]
BOOL_FIELDS = ["save_steps", "strict_fit"]
values = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.lists(st.integers(),
                                                                                                  max_size=2))


@given(st.sampled_from(FLOAT_FIELDS + INT_FIELDS + BOOL_FIELDS), values)
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_config_value_is_taken_as_given_or_refused_never_coerced(name, value):
    """A JSON config's value is accepted only with its field's type, finite (but a rate, vLLM's request rate inf) and
    in range; else one line naming the field by its flag (``"save_steps": "no"`` is never true, ``"k": true`` never
    1, ``2.5`` never 2, Infinity never null)."""
    data = {"rate": 1.0, "num_requests": 10, name: value}
    if name in ("cv",):
        data["arrival"] = "gamma"
    if name == "trace_speedup":
        return  # needs a trace
    try:
        config = SimConfig.from_dict(data, source="c.json")
    except UserError as exc:
        assert "\n" not in str(exc) and flags_of(name)[0] in str(exc)
        return
    got = config.flat()[name]
    assert got == value and type(got) is type(value)
    if value is None:
        return
    if name in BOOL_FIELDS:
        assert isinstance(value, bool)
    elif name in INT_FIELDS:
        assert isinstance(value, int) and not isinstance(value, bool)
    else:
        assert not isinstance(value, bool) and (math.isfinite(value) or (name, value) == ("rate", math.inf))
    json.dumps(config.to_dict(), allow_nan=False)  # what config.json saves is what was given


@given(st.lists(st.tuples(st.floats(0, 1e9), st.integers(1, 10 ** 9), st.integers(1, 10 ** 9)), min_size=1,
                max_size=30),
       st.sampled_from(["", "\ufeff"]))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_trace_of_valid_rows_is_read_exactly(tmp_path, rows, bom):
    from simulator.inputs.workload import read_trace

    rows = sorted(rows)
    path = tmp_path / "t.csv"
    path.write_text(bom + "arrival_time,prompt_tokens,output_tokens\n" + "".join(
        f"{t!r},{p},{o}\n" for t, p, o in rows))
    w = read_trace(str(path))
    assert w.arrival_time.tolist() == [t for t, _, _ in rows]
    assert w.prompt_tokens.tolist() == [p for _, p, _ in rows] and w.output_tokens.tolist() == [o for _, _, o in rows]
    assert int(np.sum(w.prompt_tokens)) == sum(p for _, p, _ in rows)  # no overflow


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10 ** 30),
                st.text(st.characters(blacklist_characters=',"\r\n', blacklist_categories=("Cs",)), max_size=6)))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_trace_cell_is_read_or_refused_naming_file_line_and_column(tmp_path, cell):
    from simulator.inputs.workload import read_trace

    path = tmp_path / "t.csv"
    path.write_text(f"arrival_time,prompt_tokens,output_tokens\n0,{cell},5\n")
    try:
        w = read_trace(str(path))
    except UserError as exc:
        text = str(exc)
        assert "\n" not in text and str(path) in text
        assert "line 2" in text or "no rows" in text or "cells" in text
        return
    assert 1 <= int(w.prompt_tokens[0]) <= 10 ** 9 and float(str(cell).strip()) == w.prompt_tokens[0]
