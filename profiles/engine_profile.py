"""The cost profile of the real serving engine's own passes, so that the simulator can predict that engine.

    python run_sim.py profile --engine --pair smollm2 --out profiles/data/cpu__smollm2-135m__smollm2-draft.csv

The rows (:mod:`simulator.costs.profile_table` format) time the methods of :class:`profiles.serving.engine.StepRunner`,
the code the engine's steps run, on :class:`profiles.serving.kv.PaddedBatch` caches (the engine's eager cache class,
masking and padding):

- target decode ``(b, q, c)``: :meth:`StepRunner.verify`, one target pass over the last token and ``q - 1``
  proposed tokens of each of ``b`` sequences holding ``c`` tokens on average, the acceptance decisions and the
  rollback (the proposals are random tokens; what a pass keeps is rolled back, untimed, before the next).
  As in the engine, where requests with prompts of different lengths share a batch, the sequences of a batch
  have unequal lengths, ``c (1 -+ spread)`` (:func:`random_batch`): padding is attended and the attention
  mask materialised, as in the engine's passes (a batch of equal sequences would take a cheaper path);
- draft decode ``(b, q, c)``: :meth:`StepRunner.draft_pass` feeding ``q`` tokens per sequence: 1 for a proposal pass,
  more for the catch-up pass (the draft's lag, :func:`policies.protocol.draft_lag`; ``Grid.draft_query_lens``);
- target and draft prefill ``(b, P)``: :meth:`StepRunner.prefill` of ``b`` prompts of ``P`` tokens (one
  pass each, merged into one cache), and for the target the first tokens;
- target prefill_overhead ``(b)``: the same for a step that prefills ``b`` prompts (its bookkeeping differs);
- target overhead ``(b)``: the engine's step seconds beyond its timed passes (scheduling, the policy,
  bookkeeping, compacting caches when requests finish), measured in a closed-loop run with ``b`` requests
  at a time (``2 b`` requests of random prompts of the middle prefill length, all arriving at once,
  ``fixed-k`` with k = 3): the mean over the decode steps of ``b`` requests of
  ``seconds - target_seconds - draft_seconds``.

Each point is timed by :func:`profiles.profiler.measure` (warm-up, then the median of repeats, CPU threads
fixed), in several rounds over the whole grid (:func:`profile_engine`). The metadata records the device,
threads, versions, the pair, the grid and timing policy, and the memory figures (float32 weights, KV bytes
per token = 2 x layers x kv_heads x head_dim x 4).
"""
from __future__ import annotations

import datetime
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
import transformers

from policies.registry import make_policy
from profiles.models import forward
from profiles.analytical import GIB
from profiles.serving.engine import RealEngineConfig, RealEngine, StepRunner
from profiles.models.optimized import FORWARDS
from profiles.serving.kv import KVBatch, PaddedBatch, SlotBatch, make_kv_batch
from profiles.models.pairs import ModelPair
from profiles.grid import Grid
from profiles.profiler import COLUMNS, TimingPolicy, measure
from policies.errors import UserError
from simulator.costs.profile_table import write_profile
from simulator.inputs.workload import Workload

#: The grid of the shipped CPU profile: the shapes the validation workloads reach (contexts of 40 to 200
#: tokens, k <= 4, up to 8 requests at a time). Every batch size is measured: on a CPU the matrix kernels'
#: speed changes from one row count to the next (2 rows cost far more than 1), so interpolating between
#: powers of two misses by 10-30%.
CPU_GRID = Grid(batch_sizes=(1, 2, 3, 4, 5, 6, 7, 8), query_lens=(1, 2, 3, 4, 5), context_lens=(32, 96, 192),
                prefill_lens=(32, 64, 128, 192), max_prefill_tokens=768, draft_query_lens=(1, 2, 3))
#: Prefill batches of the shipped profile: a prefill is one pass per prompt, so its time is close to linear
#: in the batch size and a few sizes suffice.
CPU_PREFILL_BATCH_SIZES = (1, 2, 4, 8)
#: Timing per round: one timed pass per point and round, so that consecutive timed passes have different
#: shapes, as in the engine, where draft, verification and prefill passes alternate (timing one shape over and
#: over in a tight loop is 3-5% faster on a CPU); the rounds give each point its repeats (see
#: :func:`profile_engine`).
CPU_TIMING = TimingPolicy(warmup=1, min_repeats=1, max_repeats=1, rel_tol=0.02, point_seconds=1.5)
CPU_ROUNDS = 9
#: Timing of :class:`SpeedProbe`'s points: one pass each, as :data:`CPU_TIMING` times the profile's (the
#: repeats come from calling the probe again).
PROBE_TIMING = TimingPolicy(warmup=0, min_repeats=1, max_repeats=1, rel_tol=0.02, point_seconds=2.0)
OVERHEAD_K = 3
OVERHEAD_OUTPUT_LEN = 16


@dataclass(frozen=True)
class EngineProfileSettings:
    """What an engine profile depends on."""

    out: str
    grid: Grid = CPU_GRID
    prefill_batch_sizes: tuple[int, ...] = CPU_PREFILL_BATCH_SIZES
    timing: TimingPolicy = CPU_TIMING
    rounds: int = CPU_ROUNDS
    spread: float = 0.5
    """Decode batches of b >= 2 hold sequences of unequal lengths, evenly spread over c (1 -+ spread)."""
    temperature: float = 0.0
    threads: int = 1
    seed: int = 0
    forward: str = "eager"
    """The engine's forward path (``eager`` or ``optimized``, :class:`profiles.serving.engine.RealEngineConfig`)."""
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.forward not in FORWARDS:
            raise UserError(f"--forward: must be one of {', '.join(FORWARDS)} (got {self.forward!r})")
        if self.rounds < 1:
            raise UserError(f"--rounds: must be >= 1 (got {self.rounds})")
        if not 0 <= self.spread < 1:
            raise UserError(f"--spread: must be in [0, 1) (got {self.spread})")
        if any(b < 1 for b in self.prefill_batch_sizes) or not self.prefill_batch_sizes:
            raise UserError(f"prefill batch sizes must be >= 1 (got {self.prefill_batch_sizes})")


def random_batch(model: Any, batch_size: int, context_len: int, generator: torch.Generator,
                 spread: float = 0.0, forward_path: str = "eager", max_query: int = 16,
                 cuda_graphs: bool = True) -> KVBatch:
    """A running batch of ``batch_size`` sequences holding ``context_len`` random tokens' KV on average: with
    ``spread`` > 0 (and two or more sequences) their lengths run evenly from ``c (1 - spread)`` to
    ``c (1 + spread)`` (summing to ``batch_size x c``), as the engine holds requests with prompts of different
    lengths; on the eager path left-padded to the longest (a :class:`PaddedBatch`), on the optimized path one
    slot each (a :class:`SlotBatch` with room for ``max_query`` more tokens)."""
    lengths = np.full(batch_size, context_len)
    if batch_size > 1 and spread > 0:
        lengths = np.rint(context_len * (1 + spread * np.linspace(-1, 1, batch_size))).astype(int)
        lengths[-1] += batch_size * context_len - lengths.sum()
    if forward_path == "optimized":
        batch = SlotBatch(model, batch_size, int(lengths.max()) + max_query, None if cuda_graphs else False)
        batch.fill_random(lengths.tolist(), generator)
        return batch
    width = int(lengths.max())
    cache = forward.random_cache(model, batch_size, width, generator, whole=True)
    valid = torch.arange(width, device=model.device) >= torch.as_tensor(width - lengths, device=model.device)[:, None]
    return PaddedBatch(model, forward.BatchCache(cache, valid))


def profile_engine(pair: ModelPair, settings: EngineProfileSettings,
                   log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> pd.DataFrame:
    """Measure every point and the overhead rows; write the profile and its metadata.

    The grid is measured ``settings.rounds`` times over, each round timing every point (warm-up passes in
    the first round only), so that a slow spell of a shared machine spreads over all points instead of
    biasing a few; a row's seconds are the median of its rounds' medians, its p10/p90 those of the rounds'
    medians, its repeats their sum.
    """
    if pair.draft is None:
        raise UserError(f"--engine: the {pair.name} pair has no draft model to profile")
    if pair.target.device.type == "cpu":
        torch.set_num_threads(settings.threads)
        torch.set_flush_denormal(True)
    started, wall = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    rng = np.random.default_rng(settings.seed)
    generator = torch.Generator(device=pair.target.device).manual_seed(settings.seed)
    runner = StepRunner(pair.target, pair.draft, settings.temperature, rng)
    grid = settings.grid
    sync = lambda: forward.synchronize(pair.target.device)  # noqa: E731 - a no-op on the CPU
    timings: dict[tuple, list[Any]] = {}

    keys = [("target", "decode", b, q, c) for b in grid.batch_sizes for c in grid.context_lens for q in grid.query_lens]
    keys += [("draft", "decode", b, q, c) for b in grid.batch_sizes for c in grid.context_lens
             for q in grid.draft_query_lens]
    keys += [(role, "prefill", b, p, 0) for b in settings.prefill_batch_sizes for p in grid.prefill_lens
             if grid.max_prefill_tokens is None or b * p <= grid.max_prefill_tokens for role in ("target", "draft")]
    for round_index in range(settings.rounds):
        log(f"round {round_index + 1}/{settings.rounds}: {len(keys)} points")
        timing = settings.timing if round_index == 0 else replace(settings.timing, warmup=0)
        batches: dict = {}
        for key in keys:
            run, reset = point_pass(pair, runner, key, settings.spread, rng, generator, batches, settings.forward,
                                    settings.cuda_graphs)
            timings.setdefault(key, []).append(measure(run, reset, sync, timing))
    rows = [{"role": key[0], "phase": key[1], "batch_size": key[2], "query_len": key[3], "context_len": key[4],
             "seconds": float(np.median([t.median for t in ts])),
             "seconds_p10": float(np.percentile([t.median for t in ts], 10)),
             "seconds_p90": float(np.percentile([t.median for t in ts], 90)), "repeats": sum(t.repeats for t in ts),
             "num_layers": (pair.target if key[0] == "target" else pair.draft).config.num_hidden_layers}
            for key, ts in timings.items()]
    overhead, details = measure_overhead(pair, settings, rng)
    frame = pd.DataFrame(rows + overhead, columns=list(COLUMNS))
    write_profile(frame, _meta(pair, settings, started, time.monotonic() - wall, details), settings.out)
    return frame


def point_pass(pair: ModelPair, runner: StepRunner, key: tuple, spread: float, rng: np.random.Generator,
               generator: torch.Generator, batches: dict | None = None, forward_path: str = "eager",
               cuda_graphs: bool = True) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The timed pass of profile row ``key`` = (role, phase, batch_size, query_len, context_len) on random
    inputs, and the untimed reset that undoes it (module docstring). ``batches``: decode caches to reuse, by
    (role, batch_size, context_len)."""
    role, phase, b, q, c = key
    model = pair.target if role == "target" else pair.draft
    vocab = model.config.vocab_size
    graphs = None if cuda_graphs else False
    if phase == "prefill":
        prompts = rng.integers(0, vocab, (b, q)).tolist()

        def fresh() -> KVBatch:
            return make_kv_batch(forward_path, model, b, q + 64, graphs)
        if role == "target":
            return lambda: runner.first_tokens(runner.prefill(fresh(), prompts)), lambda: None
        return lambda: runner.prefill(fresh(), prompts)[:, :1].tolist(), lambda: None  # .tolist(): wait for it
    batches = {} if batches is None else batches
    if (role, b, c) not in batches:
        batches[(role, b, c)] = random_batch(model, b, c, generator, spread, forward_path, cuda_graphs=cuda_graphs)
    batch = batches[(role, b, c)]
    lengths = batch.lengths()
    if role == "draft":
        fed, proposing = rng.integers(0, vocab, (b, q)).tolist(), np.ones(b, dtype=bool)
        return lambda: runner.draft_pass(batch, fed, proposing), lambda: batch.truncate(lengths)
    last, proposals = rng.integers(0, vocab, b).tolist(), rng.integers(0, vocab, (b, q - 1)).tolist()
    qs = [np.full((q - 1, vocab), 1.0 / vocab) if runner.temperature > 0 else None] * b
    return lambda: runner.verify(batch, last, proposals, qs), lambda: batch.truncate(lengths)


class SpeedProbe:
    """How much slower the machine runs now than when ``profile`` was measured, timed on a few of the profile's
    own points (target decode at the middle context: the smallest batch with q = 1, the largest with q = 1 and
    with the largest q; the draft at the largest batch; one prompt of the middle prefill length): a shared
    machine's speed drifts by several percent over minutes.

    One call times each point once, in turn and without warm-up, as the profile's rounds time them
    (:data:`CPU_TIMING`: a shape timed over and over in a tight loop runs 3-5% faster on a CPU), and keeps
    seconds now / seconds then per point (:attr:`samples`); :meth:`speed` is the median over the points of each
    point's mean ratio. The mean, not the median, of the passes now: a run's latency adds up its passes, so its
    expected time follows their mean, and on a shared machine a pass's time has a long right tail (the engine's
    decode passes in a CPU validation run: mean 1.04-1.14x their median), which the profile's median omits. The
    caches are built, and each pass run once untimed, when the probe is made. Validate calls it around and during
    every real run (:attr:`profiles.serving.engine.RealEngineConfig.probe_every`)."""

    def __init__(self, pair: ModelPair, profile: pd.DataFrame, spread: float, temperature: float,
                 seed: int = 0, forward_path: str = "eager") -> None:
        rng = np.random.default_rng(seed)
        runner = StepRunner(pair.target, pair.draft, temperature, rng)
        decode = profile[(profile["phase"] == "decode") & (profile["query_len"] == 1)]
        contexts = sorted(decode["context_len"].unique())
        middle = contexts[len(contexts) // 2]
        picks = [("target", decode["batch_size"].min()), ("target", decode["batch_size"].max()),
                 ("draft", decode["batch_size"].max())]
        keys = [(role, "decode", int(b), 1, int(middle)) for role, b in picks]
        verify = profile[(profile["role"] == "target") & (profile["phase"] == "decode")]
        keys.append(("target", "decode", int(decode["batch_size"].max()), int(verify["query_len"].max()), int(middle)))
        prefill = profile[(profile["role"] == "target") & (profile["phase"] == "prefill")]
        if len(prefill):
            ones = prefill[prefill["batch_size"] == prefill["batch_size"].min()].sort_values("query_len")
            row = ones.iloc[len(ones) // 2]
            keys.append(("target", "prefill", int(row["batch_size"]), int(row["query_len"]), 0))
        seconds = profile.set_index(["role", "phase", "batch_size", "query_len", "context_len"])["seconds"]
        generator = torch.Generator(device=pair.target.device).manual_seed(seed)
        self._sync = lambda: forward.synchronize(pair.target.device)  # noqa: E731
        self._points = [(key, *point_pass(pair, runner, key, spread, rng, generator, forward_path=forward_path),
                         float(seconds[key])) for key in keys]
        for _, run, reset, _ in self._points:  # the first pass on a new cache pays for allocations
            run()
            reset()
        self.samples: list[tuple[tuple, float]] = []
        """(point, seconds now / seconds in the profile), one per point and call, in the order taken."""

    def __call__(self) -> None:
        """Time each point once (see the class docstring)."""
        for key, run, reset, then in self._points:
            self.samples.append((key, measure(run, reset, self._sync, PROBE_TIMING).median / then))

    def speed(self, since: int = 0) -> float:
        """The machine's speed relative to the profile's (> 1: slower now) over ``samples[since:]``: the median
        over the points of each point's mean ratio."""
        ratios: dict[tuple, list[float]] = {}
        for key, ratio in self.samples[since:]:
            ratios.setdefault(key, []).append(ratio)
        return float(np.median([np.mean(r) for r in ratios.values()]))


def machine_speed(pair: ModelPair, profile: pd.DataFrame, spread: float, temperature: float,
                  seed: int = 0, forward_path: str = "eager", calls: int = 3) -> float:
    """The machine's speed now relative to ``profile``'s (> 1: slower now): a :class:`SpeedProbe` called ``calls``
    times."""
    probe = SpeedProbe(pair, profile, spread, temperature, seed, forward_path)
    for _ in range(calls):
        probe()
    return probe.speed()


def measure_overhead(pair: ModelPair, settings: EngineProfileSettings,
                     rng: np.random.Generator) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Overhead rows from closed-loop engine runs (module docstring), and per batch size the figures behind
    them (decode steps seen; mean overhead of the decode and of the prefill steps, seconds)."""
    grid = settings.grid
    prompt_len = grid.prefill_lens[len(grid.prefill_lens) // 2] if grid.prefill_lens else 64
    vocab = pair.target.config.vocab_size
    rows, details, prefills = [], {}, []
    for b in grid.batch_sizes:
        n = 2 * b
        workload = Workload(np.zeros(n), np.full(n, prompt_len), np.full(n, OVERHEAD_OUTPUT_LEN), "overhead run")
        prompts = rng.integers(0, vocab, (n, prompt_len)).tolist()
        config = RealEngineConfig(max_num_seqs=b, max_k=OVERHEAD_K, temperature=settings.temperature,
                                  forward=settings.forward, cuda_graphs=settings.cuda_graphs)
        engine = RealEngine(pair.target, pair.draft, config, make_policy("fixed-k", OVERHEAD_K), None, rng)
        steps = engine.run(workload, prompts).steps
        steps["overhead"] = steps["seconds"] - steps["target_seconds"] - steps["draft_seconds"]
        decode = steps[(steps["kind"] == "decode") & (steps["batch_size"] == b)]
        prefill = steps[steps["kind"] == "prefill"]
        rows.append({"role": "target", "phase": "overhead", "batch_size": b, "query_len": 1, "context_len": 0,
                     "seconds": float(decode["overhead"].mean()),
                     "seconds_p10": float(decode["overhead"].quantile(0.1)),
                     "seconds_p90": float(decode["overhead"].quantile(0.9)), "repeats": len(decode),
                     "num_layers": pair.target.config.num_hidden_layers})
        details[str(b)] = {"decode_steps": len(decode), "decode_overhead_mean": float(decode["overhead"].mean()),
                           "prefill_overhead_mean": float(prefill["overhead"].mean())}
        prefills.append(prefill)
    # A prefill-only step's overhead (merging the new sequences' caches, first tokens, bookkeeping) is not a decode
    # step's: its own rows, by the number of prompts the step prefilled.
    for b, part in pd.concat(prefills).groupby("batch_size"):
        rows.append({"role": "target", "phase": "prefill_overhead", "batch_size": int(b), "query_len": 1,
                     "context_len": 0, "seconds": float(part["overhead"].mean()),
                     "seconds_p10": float(part["overhead"].quantile(0.1)),
                     "seconds_p90": float(part["overhead"].quantile(0.9)), "repeats": len(part),
                     "num_layers": pair.target.config.num_hidden_layers})
    return rows, details


def _meta(pair: ModelPair, settings: EngineProfileSettings, started: datetime.datetime, seconds: float,
          overhead: dict[str, Any]) -> dict[str, Any]:
    def params(model: Any, own_only: bool) -> int:
        return sum(p.numel() for n, p in model.named_parameters()
                   if not (own_only and n.startswith(("model.embed_tokens", "lm_head"))))

    width = pair.target.dtype.itemsize

    def kv_bytes(model: Any) -> int:
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * width

    device = pair.target.device
    return {
        "method": "measured",
        "device": forward.device_name(device),
        "dtype": {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[pair.target.dtype],
        "forward": settings.forward,
        "batch_layout": "padded",  # the engine's KV batches pad each pass's new tokens to the longest sequence's
        "cuda_graphs": settings.forward == "optimized" and settings.cuda_graphs and device.type == "cuda",
        "threads": settings.threads if device.type == "cpu" else None,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "date": started.isoformat(timespec="seconds"),
        "wall_seconds": round(seconds, 1),
        "engine": {"pair": pair.name, "temperature": settings.temperature, "cache": "profiles.serving.kv."
                   + ("SlotBatch" if settings.forward == "optimized" else "PaddedBatch"),
                   "decode_length_spread": settings.spread,
                   "passes": "profiles.serving.engine.StepRunner (verify, draft_pass, prefill, first_tokens)",
                   "overhead_runs": overhead, "overhead_k": OVERHEAD_K, "overhead_output_len": OVERHEAD_OUTPUT_LEN},
        "grid": {**settings.grid.as_dict(), "prefill_batch_sizes": list(settings.prefill_batch_sizes)},
        "timing": asdict(settings.timing),
        "rounds": settings.rounds,
        "target": {"num_layers": pair.target.config.num_hidden_layers, "params": params(pair.target, False)},
        "draft": {"num_layers": pair.draft.config.num_hidden_layers, "own_params": params(pair.draft, True)},
        "memory": {"device_memory_gb": forward.total_memory_bytes(device) / GIB,
                   "target_weight_gb": params(pair.target, False) * width / GIB,
                   "target_kv_bytes_per_token": kv_bytes(pair.target),
                   "draft_weight_gb": params(pair.draft, True) * width / GIB,
                   "draft_kv_bytes_per_token": kv_bytes(pair.draft)},
        "complete": True,
    }
