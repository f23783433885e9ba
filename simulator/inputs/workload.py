"""Request workloads: when each request arrives and how many tokens it reads and writes.

A :class:`Workload` is three aligned arrays, one entry per request: ``arrival_time`` (seconds from the
start of the simulation, non-decreasing), ``prompt_tokens`` and ``output_tokens`` (both >= 1; the prefill
pass emits the first output token). :func:`build_workload` makes one from a :class:`WorkloadConfig`
(``config.workload``):

* ``arrival=poisson``: exponential inter-arrival times with mean ``1/rate`` seconds.
* ``arrival=gamma``: Gamma inter-arrival times with mean ``1/rate`` and coefficient of variation ``cv``
  (shape ``1/cv**2``, scale ``cv**2/rate``); ``cv=1`` is Poisson, ``cv>1`` bursty.
  Synthetic arrivals start at the first gap (the first arrival is > 0). ``rate`` inf: every request at 0 s
  (``vllm bench serve --request-rate inf``; no draw is taken). ``num_requests`` of them, cut at
  ``duration`` (arrivals ``< duration`` kept) when that is set too, or as many as fall before ``duration``.
  Their lengths follow ``length_dist``: ``fixed`` (``prompt_len``, ``output_len``), ``file`` (rows of
  ``length_file`` drawn with replacement, prompt and output together so their correlation is kept) or
  ``lognormal`` (medians ``prompt_len`` / ``output_len``, log-sigma ``length_sigma``, rounded, >= 1).
  ``file`` and ``lognormal`` lengths are clipped to ``max_prompt_len`` / ``max_output_len``.
* ``arrival=trace``: replay ``trace`` with its own lengths, never clipped (an over-long request is for the
  engine to report, not for the workload to hide). Truncated to the first ``num_requests`` rows; then
  every time is multiplied by one factor: ``1/trace_speedup``, or the factor that makes the mean rate of
  the kept requests, ``(n - 1) / (t_last - t_first)``, exactly ``rate``; then cut at ``duration``
  (arrivals ``< duration`` kept, on the rescaled clock).

Random numbers: arrivals come from ``arrival_rng`` and lengths from ``length_rng``, drawn so that request
``i`` gets the same draws whatever the rate or the number of requests: a sweep over ``rate`` with one
seed replays the same requests, only closer together (common random numbers).

Trace files (detected by their header, or a ``.jsonl`` name):

* Azure LLM inference 2023: ``TIMESTAMP,ContextTokens,GeneratedTokens`` with absolute timestamps such as
  ``2023-11-16 18:15:46.6805900``; times are made relative to the first row (the first arrival is 0).
* plain: ``arrival_time,prompt_tokens,output_tokens``, times in seconds, used as they are.
* Mooncake (Qin et al., FAST 2025; ``conversation_trace.jsonl`` as released), JSON lines
  ``{"timestamp": MS, "input_length": N, "output_length": M, "hash_ids": [...]}``: milliseconds (used from 0, as
  released), and ``hash_ids``, the content ids of the prompt's 512-token blocks (:data:`MOONCAKE_BLOCK_TOKENS`; a
  shared id is a shared prefix block, the last block may be partial): they name the prompt's content for prefix
  caching (:class:`TraceBlocks`, :func:`simulator.core.prefix_cache.trace_block_keys`).

Either may carry a ``prompt_id`` column (whole numbers >= 0): requests with the same id have the same prompt text (the
same token stream, each prompt its first ``prompt_tokens`` tokens), which prefix caching reuses
(:mod:`simulator.core.prefix_cache`). Without it every request has its own prompt. Length files sampled with
``length_dist=file`` give each request the index of its row as its id, so a row drawn twice is the same prompt sent
twice (as ``vllm bench serve`` does when it samples a ShareGPT prompt again); synthetic lengths share nothing.

Length files (:func:`read_lengths`): ShareGPT statistics ``num_prefill_tokens,num_decode_tokens,...``,
or any file with ``prompt_tokens,output_tokens`` or ``ContextTokens,GeneratedTokens`` (a trace will do), or a
ShareGPT JSON dataset (:func:`read_sharegpt`, what ``vllm bench serve --dataset-name sharegpt`` reads).

A bad file stops with a one-line :class:`UserError` naming the file, the line (the header is line 1;
blank lines are skipped and not counted), the column and the value. Token counts must be whole numbers
>= 1 (an output of 0 is refused too: every request emits at least one token); times must be finite and
>= 0. Decision: a trace whose times go backwards is refused at the first such line rather than silently
sorted, since reordering would change which request is which; equal times are fine (Mooncake starts with
many requests at 0.0).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from simulator.config import WorkloadConfig
from simulator.inputs.csv_checks import Column, finite_numbers, read_table, refuse_first, show_cell, whole_numbers
from policies.errors import UserError, require

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

#: Trace formats by name: the columns holding (time, prompt tokens, output tokens).
TRACE_FORMATS: dict[str, tuple[str, str, str]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "plain": ("arrival_time", "prompt_tokens", "output_tokens"),
}
#: Length-file formats by name: the columns holding (prompt tokens, output tokens).
LENGTH_FORMATS: dict[str, tuple[str, str]] = {
    "sharegpt": ("num_prefill_tokens", "num_decode_tokens"),
    "plain": ("prompt_tokens", "output_tokens"),
    "azure": ("ContextTokens", "GeneratedTokens"),
}
#: Most synthetic requests one workload may hold (about 1.2 GB of arrays); more is surely a typo.
MAX_SYNTHETIC_REQUESTS = 50_000_000
#: Tokens per block of the Mooncake trace's ``hash_ids`` (its README: "the hash id of each 512-token block").
MOONCAKE_BLOCK_TOKENS = 512
#: Largest block id of a trace (ids enter packed block keys, :data:`simulator.core.prefix_cache.END_BITS` above them).
MAX_BLOCK_ID = 2 ** 40


@dataclass(frozen=True)
class TraceBlocks:
    """Content ids of each prompt's fixed-size blocks, as a trace gives them (Mooncake's ``hash_ids``): request ``i``'s
    blocks are ``ids[offsets[i]:offsets[i + 1]]``, block ``j`` holding its tokens ``[j tokens, (j + 1) tokens)``, the
    last one possibly partial (a prefix of the block of its id). Ids are chained, as the trace's hashes are: two
    prompts share an id only where they agree on that block and every block before it."""

    ids: np.ndarray
    """int64 block ids, >= 0, every request's in turn."""
    offsets: np.ndarray
    """int64, ``n + 1`` entries: where each request's ids start in :attr:`ids` (and the end)."""
    tokens: int
    """Tokens per block."""

    def of(self, rid: int) -> np.ndarray:
        """Request ``rid``'s block ids."""
        return self.ids[self.offsets[rid]:self.offsets[rid + 1]]

    def head(self, n: int) -> TraceBlocks:
        """The blocks of the first ``n`` requests."""
        return TraceBlocks(self.ids[:self.offsets[n]], self.offsets[:n + 1], self.tokens)


@dataclass(frozen=True)
class Workload:
    """Requests to serve, one array entry per request, in arrival order. The arrays are read-only."""

    arrival_time: np.ndarray
    """float64 seconds from the start of the simulation, non-decreasing."""
    prompt_tokens: np.ndarray
    """int64 prompt length, tokens, >= 1."""
    output_tokens: np.ndarray
    """int64 tokens to generate, >= 1 (the prefill pass emits the first)."""
    source: str
    """Where the requests came from, for humans: ``"poisson rate=4, fixed lengths 512/128"``."""
    prompt_id: np.ndarray | None = None
    """int64 identity of each prompt's content, >= 0: the same id, the same prompt text (a token stream whose first
    ``prompt_tokens`` tokens are the prompt). ``None``: every request its own prompt (:meth:`prompt_ids`)."""
    blocks: TraceBlocks | None = None
    """The content ids of each prompt's blocks (a Mooncake trace's ``hash_ids``); when given, prefix caching keys its
    blocks by them rather than by :attr:`prompt_id`. ``None``: none."""

    def __post_init__(self) -> None:
        for name, dtype in (("arrival_time", np.float64), ("prompt_tokens", np.int64),
                            ("output_tokens", np.int64)):
            array = np.array(getattr(self, name), dtype=dtype)
            array.setflags(write=False)
            object.__setattr__(self, name, array)
        n = len(self.arrival_time)
        if not (self.arrival_time.ndim == 1 and len(self.prompt_tokens) == n and len(self.output_tokens) == n):
            raise ValueError("Workload: arrays must be one-dimensional and of equal length")
        if self.prompt_id is not None:
            ids = np.array(self.prompt_id, dtype=np.int64)
            if ids.shape != (n,) or (n and ids.min() < 0):
                raise ValueError("Workload: prompt_id must be one integer >= 0 per request")
            ids.setflags(write=False)
            object.__setattr__(self, "prompt_id", ids)
        if n and (np.any(np.diff(self.arrival_time) < 0) or not np.all(np.isfinite(self.arrival_time))):
            raise ValueError("Workload: arrival_time must be finite and non-decreasing")
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise ValueError("Workload: prompt_tokens and output_tokens must be >= 1")
        if self.blocks is not None:
            need = -(-self.prompt_tokens // self.blocks.tokens)
            if len(self.blocks.offsets) != n + 1 or not np.array_equal(np.diff(self.blocks.offsets), need):
                raise ValueError("Workload: blocks must hold ceil(prompt_tokens / tokens) ids per request")

    def __len__(self) -> int:
        return len(self.arrival_time)

    # the per-request columns as Python lists, made once and shared by every engine serving the workload (a fleet's
    # replicas read one copy, not one each: 64 replicas of a million requests would hold gigabytes)
    @functools.cached_property
    def prompt_list(self) -> list[int]:
        """:attr:`prompt_tokens` as a list (read-only by convention)."""
        return self.prompt_tokens.tolist()

    @functools.cached_property
    def output_list(self) -> list[int]:
        """:attr:`output_tokens` as a list (read-only by convention)."""
        return self.output_tokens.tolist()

    @functools.cached_property
    def prompt_id_list(self) -> list[int]:
        """:meth:`prompt_ids` as a list (read-only by convention)."""
        return self.prompt_ids().tolist()

    def prompt_ids(self) -> np.ndarray:
        """Each request's prompt id (int64): :attr:`prompt_id`, or ``0..n-1`` (nothing shared) when it is None."""
        return self.prompt_id if self.prompt_id is not None else np.arange(len(self), dtype=np.int64)

    def to_frame(self) -> pd.DataFrame:
        """Columns ``arrival_time,prompt_tokens,output_tokens`` (and ``prompt_id`` when the workload has ids): the
        plain trace format, so that ``to_frame().to_csv(path, index=False)`` writes a file :func:`read_trace` replays
        as is."""
        import pandas as pd

        columns = {"arrival_time": self.arrival_time, "prompt_tokens": self.prompt_tokens,
                   "output_tokens": self.output_tokens}
        if self.prompt_id is not None:
            columns["prompt_id"] = self.prompt_id
        return pd.DataFrame(columns)


# --- building ----------------------------------------------------------------------------------------

def build_workload(config: WorkloadConfig, arrival_rng: np.random.Generator,
                   length_rng: np.random.Generator) -> Workload:
    """The workload ``config`` describes (see the module docstring). Traces use neither generator."""
    if config.arrival == "trace":
        return _replay(config)
    arrivals = _synthetic_arrivals(config, arrival_rng)
    prompt, output, lengths, ids = _synthetic_lengths(config, len(arrivals), length_rng)
    if math.isinf(config.rate):
        process = "rate inf: all sent at 0 s"
    else:
        process = f"poisson rate={config.rate:g}" if config.arrival == "poisson" else \
            f"gamma rate={config.rate:g} cv={config.cv:g}"
    return Workload(arrivals, prompt, output, f"{process}, {lengths}", ids)


def diurnal(workload: Workload, amplitude: float) -> Workload:
    """``workload`` with its arrivals moved so that their rate follows one day's sinusoid compressed into the run:
    over the span [0, T] of its arrivals (T the last), mean rate r = n / T becomes r(t) = r (1 - A cos(2 pi t / T)),
    from (1 - A) r at the start and the end to (1 + A) r at T / 2, ``amplitude`` A in [0, 1). By the time change of a
    point process (a Poisson process of rate r through the inverse of the cumulative rate is one of rate r(t)), each
    arrival u goes to the t with t - (A T / 2 pi) sin(2 pi t / T) = u, found by interpolation on a grid of 4097 points
    (the left side rises monotonically for A < 1). Lengths and prompt ids stay; the source says it."""
    require(0.0 <= amplitude < 1.0, f"diurnal: amplitude must be in [0, 1), got {amplitude!r}")
    u = workload.arrival_time
    span = float(u[-1]) if len(u) else 0.0
    if span <= 0:
        return workload
    grid = np.linspace(0.0, span, 4097)
    warped = grid - amplitude * span / (2 * math.pi) * np.sin(2 * math.pi * grid / span)
    times = np.maximum.accumulate(np.interp(u, warped, grid))
    return Workload(times, workload.prompt_tokens, workload.output_tokens,
                    f"{workload.source}, diurnal: rate x (1 - {amplitude:g} cos(2 pi t / {span:.4g} s))",
                    workload.prompt_id, workload.blocks)


def _synthetic_arrivals(config: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    """Arrival times, seconds: cumulative sums of i.i.d. gaps of mean ``1/rate``, cut at ``duration``; all 0 at rate
    inf."""
    rate, duration = config.rate, config.duration
    assert rate is not None  # WorkloadConfig requires a rate for synthetic arrivals
    expected = min(config.num_requests or np.inf, rate * duration if duration is not None else np.inf)
    require(expected <= MAX_SYNTHETIC_REQUESTS,
            f"config: num_requests/rate x duration ask for {expected:.3g} requests, more than "
            f"{MAX_SYNTHETIC_REQUESTS:,} (got rate={rate:g}, duration={duration}, num_requests={config.num_requests})")
    if math.isinf(rate):
        assert config.num_requests is not None  # WorkloadConfig requires it with rate inf
        return np.zeros(config.num_requests)
    if config.arrival == "poisson":
        def gaps(n: int) -> np.ndarray:
            return rng.standard_exponential(n) / rate
    else:
        variance = config.cv ** 2
        require(variance > 0 and max(1.0, rate) / variance < np.inf,
                f"config: cv={config.cv!r} is too small for Gamma arrivals at rate={rate:g}: their shape 1/cv^2 "
                "overflows (a cv of 1e-6 already gives evenly spaced arrivals)")
        shape = 1.0 / variance

        def gaps(n: int) -> np.ndarray:
            return rng.standard_gamma(shape, n) / (shape * rate)

    if config.num_requests is not None:
        times = np.cumsum(gaps(config.num_requests))
    else:  # until duration: chunks of about the expected count; the stream is the same as one big draw
        assert duration is not None
        chunk = int(expected + 4 * np.sqrt(expected) * max(config.cv, 1.0)) + 16
        drawn = gaps(chunk)
        times = np.cumsum(drawn)
        while times[-1] < duration:
            drawn = np.concatenate([drawn, gaps(chunk)])
            times = np.cumsum(drawn)
    times = _cut_at_duration(times, duration)
    require(bool(times[-1] <= MAX_SECONDS),
            f"config: rate={rate:g} puts the last of {len(times)} arrivals at {times[-1]:.3g} s, later than "
            f"{MAX_SECONDS:g} s (the simulated clock's range); give a higher rate, fewer requests or a shorter duration")
    return times


def _cut_at_duration(times: np.ndarray, duration: float | None) -> np.ndarray:
    """The arrivals before ``duration`` seconds; refuses to return none."""
    if duration is None:
        return times
    kept = times[:np.searchsorted(times, duration, side="left")]
    require(len(kept) > 0, f"config: duration {duration:g} s ends before the first arrival "
                           f"(at {times[0]:.6g} s), no requests left (got duration={duration:g})")
    return kept


def _synthetic_lengths(config: WorkloadConfig, n: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, str, np.ndarray | None]:
    """Prompt and output lengths (tokens) of ``n`` synthetic requests, a description of them, and their prompt ids
    (the sampled row of a length file; None, nothing shared, for generated lengths).

    Request ``i`` uses the ``i``-th draw (one row index, or one pair of normals), whatever ``n`` is.
    """
    rows = None
    if config.length_dist == "fixed":
        return (np.full(n, config.prompt_len, dtype=np.int64), np.full(n, config.output_len, dtype=np.int64),
                f"fixed lengths {config.prompt_len}/{config.output_len}", None)
    if config.length_dist == "lognormal":
        z = rng.standard_normal((n, 2))
        prompt = np.rint(config.prompt_len * np.exp(config.length_sigma * z[:, 0]))
        output = np.rint(config.output_len * np.exp(config.length_sigma * z[:, 1]))
        source = (f"lognormal lengths median {config.prompt_len}/{config.output_len} "
                  f"sigma={config.length_sigma:g}")
    else:
        assert config.length_file is not None  # WorkloadConfig requires it for length_dist=file
        if config.length_file.lower().endswith(".json"):
            file_prompt, file_output, counted = read_sharegpt(config.length_file, config.tokenizer)
            counted = f" ({counted})"
        else:
            file_prompt, file_output = read_lengths(config.length_file)
            counted = ""
        rows = rng.integers(0, len(file_prompt), n)
        prompt, output = file_prompt[rows], file_output[rows]
        source = f"lengths from {Path(config.length_file).name}{counted}"
    prompt = np.clip(prompt, 1, config.max_prompt_len).astype(np.int64)
    output = np.clip(output, 1, config.max_output_len).astype(np.int64)
    return prompt, output, f"{source} max {config.max_prompt_len}/{config.max_output_len}", rows


def _replay(config: WorkloadConfig) -> Workload:
    """The trace, truncated to ``num_requests``, rescaled in time, then cut at ``duration``."""
    assert config.trace is not None  # WorkloadConfig requires it for arrival=trace
    trace = read_trace(config.trace)
    n = len(trace) if config.num_requests is None else min(config.num_requests, len(trace))
    times = trace.arrival_time[:n]
    source = f"trace {Path(config.trace).name}"
    if config.trace_speedup is not None:
        times = times / config.trace_speedup
        source += f" x{config.trace_speedup:g}"
    elif config.rate is not None:
        span = times[-1] - times[0]
        require(span > 0, f"{config.trace}: cannot rescale to a rate: the first {n} arrivals all have "
                          f"the same arrival time (got rate={config.rate:g})")
        times = times * ((n - 1) / (config.rate * span))
        source += f" rate={config.rate:g}"
    require(bool(times[-1] <= MAX_SECONDS),
            f"{config.trace}: rescaled (rate={config.rate}, trace_speedup={config.trace_speedup}), the last arrival "
            f"falls at {times[-1]:.3g} s, later than {MAX_SECONDS:g} s (the simulated clock's range)")
    times = _cut_at_duration(times, config.duration)
    kept = len(times)
    ids = trace.prompt_id[:kept] if trace.prompt_id is not None else None
    blocks = trace.blocks.head(kept) if trace.blocks is not None else None
    return Workload(times, trace.prompt_tokens[:kept], trace.output_tokens[:kept], source, ids, blocks)


# --- reading files -----------------------------------------------------------------------------------

def read_trace(path: str) -> Workload:
    """A trace file (Azure LLM 2023 or plain, told apart by the header; Mooncake JSON lines by a ``.jsonl`` name,
    :func:`read_mooncake`) as a :class:`Workload`, with the prompt ids of its optional ``prompt_id`` column.

    Azure times are made relative to the first row; plain times are kept. Bad input: :class:`UserError`.
    """
    if str(path).lower().endswith(".jsonl"):
        return read_mooncake(path)
    name, columns = read_table(path, TRACE_FORMATS)
    time_column, prompt_column, output_column = (columns[c] for c in TRACE_FORMATS[name])
    times = _timestamps(path, time_column) if name == "azure" else _seconds(path, time_column)
    first_back = np.flatnonzero(np.diff(times) < 0)
    if len(first_back):
        i = first_back[0] + 1
        cells = time_column.cells
        raise UserError(f"{path}: line {i + 2}: {time_column.name} goes backwards, traces must be sorted by time "
                        f"(got {show_cell(cells[i])} after {show_cell(cells[i - 1])})")
    ids = None
    if PROMPT_ID in _header(path):
        _, id_columns = read_table(path, {"prompt_id": (PROMPT_ID,)})
        ids = whole_numbers(path, id_columns[PROMPT_ID], 0, maximum=MAX_PROMPT_ID)
    return Workload(times, _token_counts(path, prompt_column), _token_counts(path, output_column),
                    f"trace {Path(path).name}", ids)


def read_mooncake(path: str) -> Workload:
    """A Mooncake trace (JSON lines ``timestamp`` in milliseconds, ``input_length``, ``output_length``, ``hash_ids``;
    module docstring) as a :class:`Workload` whose :attr:`Workload.blocks` are its ``hash_ids``, blocks of
    :data:`MOONCAKE_BLOCK_TOKENS` tokens. Times are the timestamps in seconds, kept as they are (the released trace
    starts at 0). Bad input (a line that is no JSON object, a missing or mistyped field, a count of ``hash_ids`` that is
    not ceil(input_length / 512), times going backwards): a :class:`UserError` naming the line (1 is the first) and
    the field."""
    import json
    import math

    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read it as text ({exc})") from None
    times, prompts, outputs, ids, offsets = [], [], [], [], [0]
    tokens = MOONCAKE_BLOCK_TOKENS
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not a JSON object ({exc.msg})") from None
        require(isinstance(row, dict), f"{where}: not a JSON object")
        values = []
        for field, low in (("timestamp", 0), ("input_length", 1), ("output_length", 1)):
            value = row.get(field)
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value >= low and (field == "timestamp" or value == int(value)),
                    f"{where}: {field} must be a {'number' if field == 'timestamp' else 'whole number'} >= {low}, "
                    f"got {value!r}")
            values.append(value)
        t, prompt, output = values[0] / 1000.0, int(values[1]), int(values[2])
        require(t <= MAX_SECONDS, f"{where}: timestamp {values[0]!r} ms is later than {MAX_SECONDS:g} s")
        if times and t < times[-1]:
            raise UserError(f"{where}: timestamp goes backwards, traces must be sorted by time (got {values[0]!r} ms "
                            f"after {times[-1] * 1000.0:g} ms)")
        blocks = row.get("hash_ids")
        require(isinstance(blocks, list) and all(isinstance(b, int) and not isinstance(b, bool) and
                                                 0 <= b < MAX_BLOCK_ID for b in blocks),
                f"{where}: hash_ids must be a list of whole numbers in [0, 2**40), got {str(blocks)[:60]}")
        need = -(-prompt // tokens)
        require(len(blocks) == need, f"{where}: hash_ids has {len(blocks)} ids; input_length {prompt} needs "
                                     f"{need} (one per {tokens}-token block)")
        times.append(t)
        prompts.append(prompt)
        outputs.append(output)
        ids.extend(blocks)
        offsets.append(len(ids))
    require(bool(times), f"{path}: no requests (empty file)")
    blocks = TraceBlocks(np.array(ids, dtype=np.int64), np.array(offsets, dtype=np.int64), tokens)
    return Workload(np.array(times), np.array(prompts), np.array(outputs), f"trace {Path(path).name}", None, blocks)


#: The optional trace column naming each request's prompt content (same id, same prompt text).
PROMPT_ID = "prompt_id"
#: Largest prompt id (ids are read as float64 first: whole numbers are exact up to 2**53).
MAX_PROMPT_ID = 2 ** 53


def _header(path: str) -> list[str]:
    """The column names of a CSV file's first non-blank line, stripped (the file has been read once already)."""
    import csv

    with open(path, newline="", encoding="utf-8-sig") as f:
        return next(([name.strip() for name in row] for row in csv.reader(f) if row), [])


def read_lengths(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths (int64 tokens, >= 1), one pair per row of a length file."""
    name, columns = read_table(path, LENGTH_FORMATS)
    prompt_column, output_column = (columns[c] for c in LENGTH_FORMATS[name])
    return _token_counts(path, prompt_column), _token_counts(path, output_column)


#: vLLM's ShareGPT sampler keeps a (prompt, output) pair only when both have at least this many tokens, the prompt at
#: most SHAREGPT_MAX_PROMPT and both together at most SHAREGPT_MAX_TOTAL (``is_valid_sequence``'s defaults).
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
#: Characters per token of the estimate used without a tokenizer (the usual rule of thumb for English BPE text).
CHARS_PER_TOKEN = 4
#: How token counts are made without a tokenizer (named in the workload description and the summary).
APPROX_COUNT = f"tokens ESTIMATED as ceil(characters / {CHARS_PER_TOKEN}); give --tokenizer for exact counts"


def read_sharegpt(path: str, tokenizer: str | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """Prompt and output lengths of a ShareGPT JSON dataset, and how they were counted.

    The file is a list of ``{"conversations": [{"from": "human", "value": TEXT}, {"from": "gpt", "value": TEXT},
    ...]}``; as ``vllm bench serve --dataset-name sharegpt`` does, each entry with at least two turns gives one
    pair: the first turn is the prompt, the second the output; pairs with either side under 4 tokens, a prompt
    over 1024 or both over 2048 tokens are dropped. Token counts: with ``tokenizer`` (a Hugging Face
    ``tokenizer.json``, a folder holding one, or a model name in the local cache; nothing is downloaded) exact; without,
    ``ceil(len(text) / 4)`` characters, an estimate the returned label says is one."""
    import json

    try:
        with open(path, encoding="utf-8-sig") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a JSON file ({exc})") from None
    require(isinstance(data, list), f"{path}: a ShareGPT dataset is a JSON list of {{\"conversations\": [...]}} "
                                    f"entries, got a {type(data).__name__}")
    pairs: list[tuple[str, str]] = []
    for i, entry in enumerate(data):
        require(isinstance(entry, dict), f"{path}: entry {i}: expected an object with \"conversations\", "
                                         f"got {type(entry).__name__}")
        turns = entry.get("conversations")
        require(isinstance(turns, list), f"{path}: entry {i}: \"conversations\" must be a list of turns")
        if len(turns) < 2:
            continue
        texts = []
        for j in (0, 1):
            turn = turns[j]
            require(isinstance(turn, dict) and isinstance(turn.get("value"), str),
                    f"{path}: entry {i}: turn {j} must be an object with a text \"value\"")
            texts.append(turn["value"])
        pairs.append((texts[0], texts[1]))
    require(bool(pairs), f"{path}: no conversation with at least two turns")
    if tokenizer is None:
        count = lambda text: max(1, -(-len(text) // CHARS_PER_TOKEN))  # noqa: E731
        label = APPROX_COUNT
    else:
        encode = _load_tokenizer(tokenizer)
        count = lambda text: len(encode(text))  # noqa: E731
        label = f"tokens counted by {tokenizer}"
    prompt, output = [], []
    for a, b in pairs:
        p, o = count(a), count(b)
        if p < SHAREGPT_MIN_LEN or o < SHAREGPT_MIN_LEN or p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL:
            continue
        prompt.append(p)
        output.append(o)
    require(bool(prompt), f"{path}: every conversation was dropped by vLLM's ShareGPT filter (prompt and output "
                          f">= {SHAREGPT_MIN_LEN} tokens, prompt <= {SHAREGPT_MAX_PROMPT}, both <= {SHAREGPT_MAX_TOTAL})")
    return np.array(prompt, dtype=np.int64), np.array(output, dtype=np.int64), label


def _load_tokenizer(name: str):
    """``encode(text) -> ids`` of a locally available Hugging Face tokenizer (its ``tokenizer.json``: a file, a
    folder holding one, or a model name in the local hub cache); a one-line UserError otherwise. Read with the
    ``tokenizers`` library (no torch, no transformers: the simulator runs without them); nothing is downloaded."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(f"--tokenizer {name}: needs the tokenizers package (pip install tokenizers), or drop "
                        "--tokenizer to estimate tokens from characters") from None
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        path = _cached_tokenizer_file(name)
    if path is None:
        raise UserError(f"--tokenizer {name}: no tokenizer.json there or in the local cache (nothing is downloaded)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure to read is the user's input
        raise UserError(f"--tokenizer {name}: {path} is not a tokenizer file: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return lambda text: tok.encode(text).ids  # as vLLM counts: special tokens included


def _cached_tokenizer_file(name: str) -> Path | None:
    """``tokenizer.json`` of model ``name`` in the local Hugging Face hub cache, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # noqa: BLE001 - a name that is no repo id is simply not cached
        return None
    return Path(found) if isinstance(found, str) else None


def _token_counts(path: str, column: Column) -> np.ndarray:
    """The column as int64 token counts, each a whole number >= 1."""
    return whole_numbers(path, column, 1, "token")


#: Latest arrival time a workload may have, seconds (about 31 years): beyond it float64 seconds lose the
#: microseconds a step is made of (at 1e20 s, adding a 10 ms step leaves the clock where it was).
MAX_SECONDS = 1e9


def _seconds(path: str, column: Column) -> np.ndarray:
    """The column as float64 seconds, each finite and in [0, MAX_SECONDS]."""
    values = finite_numbers(path, column)
    refuse_first(path, column, values < 0, "must be >= 0 seconds")
    refuse_first(path, column, values > MAX_SECONDS,
                 f"must be <= {MAX_SECONDS:g} seconds from the start (times are seconds, not epoch timestamps)")
    return values


def _timestamps(path: str, column: Column) -> np.ndarray:
    """Absolute ISO 8601 timestamps as float64 seconds after the first row (zones, if given, honoured)."""
    import pandas as pd  # only traces with absolute timestamps need its ISO 8601 parser

    stamps = pd.to_datetime(pd.Series(column.cells).str.strip(), format="ISO8601", errors="coerce", utc=True)
    refuse_first(path, column, stamps.isna().to_numpy(), "must be a timestamp like 2023-11-16 18:15:46.6805900")
    return ((stamps - stamps.iloc[0]) / pd.Timedelta(seconds=1)).to_numpy(dtype=np.float64)
