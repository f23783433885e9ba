"""Workloads: arrival processes match their theory, traces replay as recorded, bad files stop with one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from simulator.config import SimConfig
from policies.errors import UserError
from simulator.inputs.workload import Workload, build_workload, read_lengths, read_trace
from simulator.inputs import AZURE_CODE, AZURE_CONV, MOONCAKE as MOONCAKE_TRACE, MOONCAKE_PLAIN as MOONCAKE
from simulator.inputs import SHAREGPT_STATS as SHAREGPT


def build(seed: int = 0, **fields) -> Workload:
    fields = {"rate": 4.0, "num_requests": 1000, **fields}
    return build_workload(SimConfig.of(**fields).workload, np.random.default_rng(seed), np.random.default_rng(seed + 1))


def replay(trace: Path | str, **fields) -> Workload:
    fields = {"rate": None, "num_requests": None, **fields}
    return build_workload(SimConfig.of(arrival="trace", trace=str(trace), **fields).workload, None, None)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def cv(x: np.ndarray) -> float:
    return float(np.std(x) / np.mean(x))


# --- synthetic arrivals -----------------------------------------------------------------------------

def test_poisson_has_the_asked_mean_rate_and_exponential_gaps():
    w = build(arrival="poisson", rate=4.0, num_requests=200_000)
    gaps = np.diff(w.arrival_time, prepend=0.0)
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.01)
    assert cv(gaps) == pytest.approx(1.0, rel=0.01)
    assert w.arrival_time[0] > 0
    assert w.source == "poisson rate=4, fixed lengths 512/128"


def test_gamma_gaps_have_the_asked_coefficient_of_variation():
    w = build(arrival="gamma", rate=2.0, cv=3.0, num_requests=200_000)
    gaps = np.diff(w.arrival_time, prepend=0.0)
    assert cv(gaps) == pytest.approx(3.0, rel=0.10)
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.05)


def test_same_seed_same_workload_bit_for_bit_other_seed_differs():
    fields = dict(arrival="gamma", cv=2.0, num_requests=1000, length_dist="lognormal")
    a, b, c = build(7, **fields), build(7, **fields), build(8, **fields)
    for name in ("arrival_time", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
        assert not np.array_equal(getattr(a, name), getattr(c, name))


def test_a_rate_sweep_replays_the_same_requests_closer_together():
    slow = build(rate=4.0, num_requests=500, length_dist="lognormal")
    fast = build(rate=8.0, num_requests=500, length_dist="lognormal")
    assert np.array_equal(fast.arrival_time * 2, slow.arrival_time)
    assert np.array_equal(fast.prompt_tokens, slow.prompt_tokens)
    assert np.array_equal(fast.output_tokens, slow.output_tokens)


def test_duration_alone_keeps_exactly_the_arrivals_before_it():
    until = build(arrival="gamma", cv=4.0, rate=50.0, num_requests=None, duration=60.0)
    longer = build(arrival="gamma", cv=4.0, rate=50.0, num_requests=20_000)
    assert until.arrival_time[-1] < 60.0
    assert np.array_equal(until.arrival_time, longer.arrival_time[longer.arrival_time < 60.0])


def test_count_and_duration_together_truncate_by_both():
    assert len(build(rate=4.0, num_requests=100, duration=1000.0)) == 100
    short = build(rate=4.0, num_requests=100, duration=5.0)
    assert 0 < len(short) < 100 and short.arrival_time[-1] < 5.0


def test_a_duration_before_the_first_arrival_is_a_user_error():
    with pytest.raises(UserError, match=r"^config: duration 1e-06 s ends before the first arrival"):
        build(rate=1.0, duration=1e-6)


def test_too_many_requests_is_refused_before_allocating_them():
    with pytest.raises(UserError, match="ask for 1e\\+12 requests"):
        build(rate=1e6, num_requests=None, duration=1e6)


# --- synthetic lengths ------------------------------------------------------------------------------

def test_fixed_lengths_are_exactly_the_asked_ones():
    w = build(num_requests=3, prompt_len=100, output_len=7)
    assert w.prompt_tokens.tolist() == [100, 100, 100]
    assert w.output_tokens.tolist() == [7, 7, 7]


def test_lognormal_lengths_have_the_asked_medians_and_stay_within_bounds():
    w = build(num_requests=50_000, length_dist="lognormal", prompt_len=500, output_len=100,
              length_sigma=1.0, max_prompt_len=2000, max_output_len=300)
    assert np.median(w.prompt_tokens) == pytest.approx(500, rel=0.03)
    assert np.median(w.output_tokens) == pytest.approx(100, rel=0.03)
    assert w.prompt_tokens.max() == 2000 and w.output_tokens.max() == 300
    assert w.prompt_tokens.min() >= 1 and w.output_tokens.min() >= 1
    assert abs(np.corrcoef(np.log(w.prompt_tokens), np.log(w.output_tokens))[0, 1]) < 0.02


def test_file_lengths_are_whole_rows_of_the_file_clipped_to_the_maximum(tmp_path):
    rows = [(10 * i, i + 1) for i in range(1, 21)]
    path = write(tmp_path / "lengths.csv", "prompt_tokens,output_tokens\n" + "".join(f"{p},{o}\n" for p, o in rows))
    w = build(num_requests=2000, length_dist="file", length_file=path, max_prompt_len=150, max_output_len=1000)
    pairs = set(zip(w.prompt_tokens.tolist(), w.output_tokens.tolist()))
    assert pairs == {(min(p, 150), o) for p, o in rows}
    assert w.source == "poisson rate=4, lengths from lengths.csv max 150/1000"


def test_sharegpt_lengths_keep_each_prompt_with_its_own_output():
    prompt, output = read_lengths(str(SHAREGPT))
    assert len(prompt) == 30_731 and prompt.dtype == output.dtype == np.int64
    w = build(num_requests=5000, length_dist="file", length_file=str(SHAREGPT),
              max_prompt_len=10**6, max_output_len=10**6)
    assert set(zip(w.prompt_tokens.tolist(), w.output_tokens.tolist())) <= set(zip(prompt.tolist(), output.tolist()))


# --- traces -----------------------------------------------------------------------------------------

@pytest.fixture
def small_trace(tmp_path) -> str:
    return write(tmp_path / "small.csv", "arrival_time,prompt_tokens,output_tokens\n"
                                         "0,11,1\n1,12,2\n3,13,3\n6,14,4\n")


def test_plain_trace_replays_as_recorded(small_trace):
    w = replay(small_trace)
    assert w.arrival_time.tolist() == [0.0, 1.0, 3.0, 6.0]
    assert w.prompt_tokens.tolist() == [11, 12, 13, 14]
    assert w.output_tokens.tolist() == [1, 2, 3, 4]
    assert w.source == "trace small.csv"


def test_trace_speedup_divides_the_gaps(small_trace):
    w = replay(small_trace, trace_speedup=2.0)
    assert w.arrival_time.tolist() == [0.0, 0.5, 1.5, 3.0]
    assert w.source == "trace small.csv x2"


def test_trace_rate_makes_the_mean_rate_of_the_kept_requests_exact(small_trace):
    assert replay(small_trace, rate=2.0).arrival_time.tolist() == [0.0, 0.25, 0.75, 1.5]
    first_three = replay(small_trace, rate=1.0, num_requests=3)
    assert first_three.arrival_time.tolist() == pytest.approx([0.0, 2 / 3, 2.0], abs=1e-15)
    assert first_three.prompt_tokens.tolist() == [11, 12, 13]


def test_trace_duration_cuts_on_the_rescaled_clock(small_trace):
    w = replay(small_trace, rate=2.0, duration=0.75)
    assert w.arrival_time.tolist() == [0.0, 0.25]
    assert w.output_tokens.tolist() == [1, 2]


def test_trace_lengths_are_not_clipped(small_trace):
    w = replay(small_trace, max_prompt_len=12, max_output_len=1)
    assert w.prompt_tokens.max() == 14 and w.output_tokens.max() == 4


def test_a_trace_whose_arrivals_all_coincide_cannot_be_rescaled_to_a_rate(tmp_path):
    path = write(tmp_path / "burst.csv", "arrival_time,prompt_tokens,output_tokens\n0,1,1\n0,1,1\n")
    with pytest.raises(UserError, match="burst.csv: cannot rescale to a rate"):
        replay(path, rate=1.0)


def test_a_workload_round_trips_through_the_plain_format(tmp_path):
    w = build(num_requests=100, length_dist="lognormal")
    path = tmp_path / "out.csv"
    w.to_frame().to_csv(path, index=False)
    back = read_trace(str(path))
    assert list(w.to_frame().columns) == ["arrival_time", "prompt_tokens", "output_tokens"]
    assert np.array_equal(back.arrival_time, w.arrival_time)
    assert np.array_equal(back.prompt_tokens, w.prompt_tokens)
    assert np.array_equal(back.output_tokens, w.output_tokens)


def test_workload_arrays_are_typed_and_read_only():
    w = build(num_requests=5)
    assert len(w) == 5
    assert (w.arrival_time.dtype, w.prompt_tokens.dtype, w.output_tokens.dtype) == (np.float64, np.int64, np.int64)
    with pytest.raises(ValueError):
        w.prompt_tokens[0] = 1


def test_azure_conversation_trace_is_near_poisson():
    w = read_trace(str(AZURE_CONV))
    assert len(w) == 19_366
    assert w.arrival_time[0] == 0.0 and w.arrival_time[1] == pytest.approx(4.314579, abs=1e-9)
    assert cv(np.diff(w.arrival_time)) == pytest.approx(1.09, abs=0.01)
    assert (w.prompt_tokens[0], w.output_tokens[0]) == (374, 44)


def test_azure_code_trace_is_very_bursty():
    w = read_trace(str(AZURE_CODE))
    assert len(w) == 8_819 and w.arrival_time[0] == 0.0
    assert cv(np.diff(w.arrival_time)) > 10


def test_mooncake_plain_trace_with_simultaneous_arrivals():
    w = read_trace(str(MOONCAKE))
    assert len(w) == 12_031
    assert w.arrival_time[:2].tolist() == [0.0, 0.0]
    assert (w.prompt_tokens[0], w.output_tokens[0]) == (6758, 500)


# --- bad input --------------------------------------------------------------------------------------

PLAIN = "arrival_time,prompt_tokens,output_tokens\n"
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,5\n"


def bad_trace_message(tmp_path, text: str) -> str:
    path = write(tmp_path / "bad.csv", text)
    with pytest.raises(UserError) as raised:
        read_trace(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message[len(path) + 2:]


@pytest.mark.parametrize("text, expected", [
    ("", "empty file, no header and no rows"),
    (PLAIN, "no rows after the header (got 0 rows)"),
    ("arrival_time,prompt_tokens\n0,5\n",
     "missing column 'output_tokens' (got columns arrival_time,prompt_tokens; expected "
     "TIMESTAMP,ContextTokens,GeneratedTokens or arrival_time,prompt_tokens,output_tokens)"),
    (PLAIN + "0,5,5\n1,abc,5\n", "line 3: prompt_tokens must be a finite number (got 'abc')"),
    (PLAIN + "0,5,5\n1,,5\n", "line 3: prompt_tokens must be a finite number (got an empty or NaN cell)"),
    (PLAIN + "0,NaN,5\n", "line 2: prompt_tokens must be a finite number (got an empty or NaN cell)"),
    (PLAIN + "0,2.5,5\n", "line 2: prompt_tokens must be a whole number of tokens (got 2.5)"),
    (PLAIN + "0,0,5\n", "line 2: prompt_tokens must be >= 1 token (got 0)"),
    (PLAIN + "0,5,5\n0,-3,5\n", "line 3: prompt_tokens must be >= 1 token (got -3)"),
    (PLAIN + "0,5,-1\n", "line 2: output_tokens must be >= 1 token (got -1)"),
    (PLAIN + "0,5,0\n", "line 2: output_tokens must be >= 1 token (got 0)"),
    (PLAIN + "0,5,x\n", "line 2: output_tokens must be a finite number (got 'x')"),
    (PLAIN + "0,5,inf\n", "line 2: output_tokens must be a finite number (got inf)"),
    (PLAIN + "-1,5,5\n", "line 2: arrival_time must be >= 0 seconds (got -1)"),
    (PLAIN + "soon,5,5\n", "line 2: arrival_time must be a finite number (got 'soon')"),
    (PLAIN + "0,5,5\n2,5,5\n2,5,5\n1.5,5,5\n",
     "line 5: arrival_time goes backwards, traces must be sorted by time (got 1.5 after 2)"),
    (AZURE + "yesterday,10,5\n",
     "line 3: TIMESTAMP must be a timestamp like 2023-11-16 18:15:46.6805900 (got 'yesterday')"),
    (AZURE + "2023-11-16 18:15:40.0000000,10,5\n",
     "line 3: TIMESTAMP goes backwards, traces must be sorted by time "
     "(got '2023-11-16 18:15:40.0000000' after '2023-11-16 18:15:46.6805900')"),
    (AZURE + "2023-11-16 18:15:47.0,10,0\n", "line 3: GeneratedTokens must be >= 1 token (got 0)"),
])
def test_bad_trace_stops_with_one_line_naming_file_line_column_and_value(tmp_path, text, expected):
    assert bad_trace_message(tmp_path, text) == expected


def test_missing_trace_file(tmp_path):
    path = str(tmp_path / "nope.csv")
    with pytest.raises(UserError, match=f"^{path}: file not found$"):
        read_trace(path)


def test_bad_length_file_names_its_column(tmp_path):
    zero = write(tmp_path / "zero.csv", "num_prefill_tokens,num_decode_tokens,pd_ratio\n0,5,0.0\n")
    with pytest.raises(UserError, match=r"zero.csv: line 2: num_prefill_tokens must be >= 1 token \(got 0\)$"):
        read_lengths(zero)
    other = write(tmp_path / "other.csv", "num_prefill_tokens,decode\n5,5\n")
    with pytest.raises(UserError, match=r"other.csv: missing column 'num_decode_tokens' \(got columns "
                                        r"num_prefill_tokens,decode; expected"):
        read_lengths(other)
    with pytest.raises(UserError, match="zero.csv: line 2: num_prefill_tokens"):
        build(length_dist="file", length_file=zero)


@pytest.mark.parametrize("text, expected", [
    (PLAIN + "0,5,5\n1,5,5,7\n", "line 3: 4 cells, more than the header's 3 (not a readable CSV file)"),
    (PLAIN + "0,5,5\n1,5\n", "line 3: output_tokens must be a finite number (got an empty or NaN cell)"),
])
def test_a_row_of_the_wrong_width_is_refused(tmp_path, text, expected):
    assert bad_trace_message(tmp_path, text) == expected


def test_blank_lines_header_spaces_quotes_and_extra_columns_are_read_as_a_person_means_them(tmp_path):
    path = write(tmp_path / "t.csv", ' arrival_time , prompt_tokens,output_tokens,"note, free text"\n\n'
                                     '0, 5 ,3,"a, b"\n\n1.5,7,2.0,x\n')
    trace = read_trace(path)
    assert trace.arrival_time.tolist() == [0.0, 1.5]
    assert trace.prompt_tokens.tolist() == [5, 7] and trace.output_tokens.tolist() == [3, 2]


# --- Mooncake's JSON lines with content hashes ------------------------------------------------------



def jsonl(path: Path, *rows: str) -> str:
    return write(path, "\n".join(rows) + "\n")


def test_mooncake_jsonl_is_read_with_its_block_hashes(tmp_path):
    path = jsonl(tmp_path / "t.jsonl",
                 '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}',
                 "",  # a blank line is skipped
                 '{"timestamp": 1500, "input_length": 512, "output_length": 3, "hash_ids": [0]}')
    w = read_trace(path)
    assert w.arrival_time.tolist() == [0.0, 1.5]  # milliseconds -> seconds
    assert (w.prompt_tokens.tolist(), w.output_tokens.tolist()) == ([600, 512], [5, 3])
    assert w.prompt_id is None and w.blocks.tokens == 512
    assert w.blocks.of(0).tolist() == [0, 1] and w.blocks.of(1).tolist() == [0]
    head = replay(path, num_requests=1)  # a truncated trace keeps its requests' blocks
    assert head.blocks.of(0).tolist() == [0, 1] and len(head.blocks.offsets) == 2


@pytest.mark.parametrize("row, expected", [
    ("not json", "line 1: not a JSON object"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]}',
     "line 1: hash_ids has 1 ids; input_length 600 needs 2"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}', "line 1: input_length must be"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [-1]}', "line 1: hash_ids must be"),
    ('{"input_length": 10, "output_length": 5, "hash_ids": [1]}', "line 1: timestamp must be a number"),
])
def test_a_bad_mooncake_line_stops_with_one_line_naming_it(tmp_path, row, expected):
    with pytest.raises(UserError, match=expected) as err:
        read_trace(jsonl(tmp_path / "bad.jsonl", row))
    assert "\n" not in str(err.value)


def test_a_mooncake_trace_going_backwards_is_refused(tmp_path):
    path = jsonl(tmp_path / "back.jsonl", '{"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
                 '{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [1]}')
    with pytest.raises(UserError, match="line 2: timestamp goes backwards"):
        read_trace(path)


def test_the_released_mooncake_trace_has_a_block_id_per_512_tokens():
    w = read_trace(str(MOONCAKE_TRACE))
    assert len(w) == 12_031 and w.blocks.ids.size == 288_500
    assert w.blocks.of(0).tolist() == list(range(14)) and w.prompt_tokens[0] == 6758
    ids = w.blocks.ids.tolist()  # docs/fleets.md's figure: 36.6% of the blocks repeat an earlier request's
    assert round(1 - len(set(ids)) / len(ids), 3) == 0.366
