"""Measure the seconds of single forward passes of a target/draft pair over a grid of shapes.

Measured points (rows of a profile, :mod:`simulator.costs.profile_table`):

- target ``prefill``: ``batch_size`` prompts of ``query_len`` tokens (``context_len`` 0);
- target ``decode``: verification of ``query_len = k + 1`` tokens per sequence over ``context_len`` cached;
- draft ``decode``: one token per sequence over ``context_len`` cached; draft ``prefill`` as the target's.

Method. Each pass runs through the real engine's code path, eager (:mod:`profiles.models.forward`, Hugging Face
as is) or optimized (:mod:`profiles.models.optimized`: in-place cache, CUDA graphs; ``forward`` setting, saved
in the metadata and, by the prepared GPU run, in the file name). Per point: warm-up
passes, then timed passes (``time.perf_counter`` with ``torch.cuda.synchronize`` before and after each on
CUDA; on CPU a fixed ``torch.set_num_threads``) until at least ``min_repeats`` and the running median moves
by less than ``rel_tol``, or ``max_repeats`` or ``point_seconds`` is reached; the median and the 10th/90th
percentiles are stored. A ``(batch, context)`` KV cache is built once and every ``query_len`` runs over it,
cropped back after each pass.

The grid runs coarse to fine (every 4th value of each axis first, then every 2nd, then the rest), so a run
cut by ``max_seconds`` still spans the grid. A point whose estimated KV cache and activations exceed the
free memory, or that runs out of memory anyway, is reported in one line and skipped. Rows are appended to
the output CSV as they are measured, so an interrupted run resumes where it stopped; at the end the CSV
and its metadata are rewritten atomically.

Model families: every family :mod:`profiles.models.families` lists (Llama, Qwen2, Qwen3, Gemma-2, Mixtral, Qwen3-MoE),
built by transformers with random weights, on both forward paths; a large config is measured cut to fewer layers
(``scale_layers``, below) or reduced to fewer experts and smaller widths first
(:func:`profiles.models.families.reduce`, ``python -m profiles.models.families``).

Draft heads: with ``draft`` a head's config (EAGLE, EAGLE-3, MTP; :mod:`profiles.models.config`), the draft rows are
the head's passes over the target's hidden states (:mod:`profiles.models.draft_head`, random weights, eager forward
only): decode, its layer over ``context_len`` cached tokens of its own (one layer's KV); prefill, its layer over the
prompt (what an engine runs after the target's prefill). The metadata's ``draft`` says which head it is. A head is
built on a target of a family with a Llama-shaped layer only (:attr:`profiles.models.families.Family.head_target`).

Layer scaling (a target too large for the device): with ``scale_layers = (n1, n2)`` the target is
measured cut to ``n1`` and ``n2`` layers and each point extrapolated linearly in the layer count,
``t(N) = t(n1) + (N - n1) (t(n2) - t(n1)) / (n2 - n1)`` (fixed cost + per-layer cost). ``check_scaling``
also measures the full depth and reports the relative error of the extrapolation.

This module imports torch only inside :func:`run_profile`; the grid and the arithmetic work without it.
"""
from __future__ import annotations

import csv
import datetime
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd

from profiles.analytical import DTYPE_BYTES, GIB, Architecture
from profiles.grid import Grid, Group, Point
from profiles.models.config import read_model_config, resolve_model_config
from profiles.models.families import MODEL_TYPES, family
from policies.errors import UserError
from simulator.costs.profile_table import meta_path, read_json, write_atomic, write_profile

KEY = ("role", "phase", "batch_size", "query_len", "context_len")
COLUMNS = KEY + ("seconds", "seconds_p10", "seconds_p90", "repeats", "num_layers")
#: Extra columns of a layer-scaled profile: the two cut models' medians, and the extrapolation when the
#: full depth is measured too (``check_scaling``).
SCALING_COLUMNS = ("seconds_n1", "seconds_n2")
CHECK_COLUMNS = ("seconds_scaled",)


# -- timing --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimingPolicy:
    """When to stop repeating a pass: after ``min_repeats`` once the median moves less than ``rel_tol``
    (relative), or at ``max_repeats``, or once ``point_seconds`` of timed passes have run."""

    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 20
    rel_tol: float = 0.02
    point_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise UserError(f"timing: need warmup >= 0 and 1 <= min_repeats <= max_repeats (got {self})")
        if not self.rel_tol > 0 or not self.point_seconds > 0:
            raise UserError(f"timing: rel_tol and point_seconds must be > 0 (got {self})")


@dataclass(frozen=True)
class Timing:
    """Seconds of one pass: median and 10th/90th percentiles over ``repeats`` timed passes."""

    median: float
    p10: float
    p90: float
    repeats: int

    @classmethod
    def of(cls, seconds: list[float]) -> "Timing":
        p10, p50, p90 = np.percentile(seconds, [10, 50, 90])
        return cls(float(p50), float(p10), float(p90), len(seconds))


def measure(run: Callable[[], Any], reset: Callable[[], Any], sync: Callable[[], Any], policy: TimingPolicy,
            clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Time ``run`` (one pass) under ``policy`` on ``clock`` (seconds); ``reset`` restores the state after
    each pass (untimed), ``sync`` waits for the device before and after each timed pass."""
    for _ in range(policy.warmup):
        run()
        reset()
    seconds: list[float] = []
    while True:
        sync()
        t0 = clock()
        run()
        sync()
        seconds.append(clock() - t0)
        reset()
        n = len(seconds)
        if n < policy.min_repeats:
            continue
        median = float(np.median(seconds))
        stable = n >= 2 and abs(median - float(np.median(seconds[:-1]))) < policy.rel_tol * median
        if stable or n >= policy.max_repeats or sum(seconds) >= policy.point_seconds:
            return Timing.of(seconds)


def extrapolate_layers(t1: float, t2: float, n1: int, n2: int, n_full: int) -> float:
    """Seconds at ``n_full`` layers from ``t1`` at ``n1`` and ``t2`` at ``n2`` layers (fixed + per-layer
    cost, linear in the layer count); never below ``t2`` (a deeper model is not faster)."""
    return max(t2, t1 + (n_full - n1) * (t2 - t1) / (n2 - n1))


def scaling_errors(frame: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Relative error |scaled - measured| / measured of the rows with ``seconds_scaled``, per
    ``role/phase`` and ``all``: mean, max and the number of points."""
    rows = frame.dropna(subset=["seconds_scaled"]) if "seconds_scaled" in frame else frame.iloc[:0]
    err = (rows["seconds_scaled"] - rows["seconds"]).abs() / rows["seconds"]
    out = {}
    for name, part in [(f"{r}/{p}", err[(rows.role == r) & (rows.phase == p)])
                       for r, p in sorted(set(zip(rows.role, rows.phase)))] + [("all", err)]:
        if len(part):
            out[name] = {"mean_rel_error": float(part.mean()), "max_rel_error": float(part.max()), "points": len(part)}
    return out


# -- memory --------------------------------------------------------------------------------------
def pass_memory_bytes(arch: Architecture, dtype_bytes: int, point: Point) -> float:
    """Bytes a pass allocates beyond the weights (an upper estimate): the KV cache after the pass plus one
    layer's copy (``DynamicCache`` concatenates), one layer's activations, attention scores as if
    materialised, and the logits; 20% and 64 MiB of slack."""
    b, q, ctx = point.batch_size, point.query_len, point.context_len
    tokens = b * (ctx + q)
    kv = tokens * arch.kv_bytes_per_token(dtype_bytes) * (1 + 1 / arch.num_layers)
    ffn = arch.layers[0].ffn  # a dense layer's width, or the experts a token is routed to and the shared ones
    intermediate = getattr(ffn, "intermediate", None) or ffn.top_k * ffn.expert_intermediate + ffn.shared_intermediate
    width = 4 * arch.hidden + 3 * intermediate + (arch.heads + 2 * arch.kv_heads) * arch.head_dim
    activations = b * q * width * dtype_bytes + b * arch.heads * q * (ctx + q) * dtype_bytes
    logits = b * (1 if point.phase == "prefill" else q) * arch.lm_vocab * dtype_bytes
    return 1.2 * (kv + activations + logits) + 64 * 2 ** 20


# -- settings and the run ------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileSettings:
    """Everything a profiling run depends on (see ``python run_sim.py profile --help``)."""

    target: str
    out: str
    grid: Grid
    draft: str | None = None
    dtype: str = "bf16"
    forward: str = "eager"
    cuda_graphs: bool = True
    device: str = "cuda"
    threads: int | None = None
    max_seconds: float | None = None
    num_layers: int | None = None
    scale_layers: tuple[int, int] | None = None
    check_scaling: bool = False
    weights: str | None = None
    max_memory_gb: float | None = None
    timing: TimingPolicy = field(default_factory=TimingPolicy)
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise UserError(f"--dtype: must be one of {', '.join(DTYPE_BYTES)} (got {self.dtype!r})")
        if self.forward not in ("eager", "optimized"):
            raise UserError(f"--forward: must be eager or optimized (got {self.forward!r})")
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device: must be cpu or cuda (got {self.device!r})")
        for name in ("threads", "num_layers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be >= 1 (got {value})")
        for name in ("max_seconds", "max_memory_gb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"--{name.replace('_', '-')}: must be > 0 (got {value})")
        if self.scale_layers is not None:
            n1, n2 = self.scale_layers
            if not 1 <= n1 < n2:
                raise UserError(f"--scale-layers: need two layer counts 1 <= N1 < N2 (got {n1},{n2})")
            if self.num_layers is not None:
                raise UserError("--scale-layers: not together with --num-layers")
        if self.check_scaling and self.scale_layers is None:
            raise UserError("--check-scaling: needs --scale-layers N1,N2")
        if self.weights is not None and not Path(self.weights).is_dir():
            raise UserError(f"--weights: no such folder (got {self.weights!r})")

    def roles(self) -> tuple[str, ...]:
        return ("target", "draft") if self.draft else ("target",)

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the run that wrote the partial output."""
        return {"target": self.target, "draft": self.draft, "dtype": self.dtype, "forward": self.forward,
                "device_type": self.device,
                "num_layers": self.num_layers, "scale_layers": list(self.scale_layers or []) or None,
                "check_scaling": self.check_scaling, "weights": self.weights}


@dataclass(frozen=True)
class Variant:
    """One model a role is measured with: the full model, or the target cut to ``num_layers`` for scaling."""

    name: str
    arch: Architecture
    model: Any


@dataclass(frozen=True)
class ProfileResult:
    frame: pd.DataFrame
    meta: dict[str, Any]
    path: str


def _columns(settings: ProfileSettings) -> tuple[str, ...]:
    if settings.scale_layers is None:
        return COLUMNS
    return COLUMNS + SCALING_COLUMNS + (CHECK_COLUMNS if settings.check_scaling else ())


def read_partial(path: Path, settings: ProfileSettings) -> pd.DataFrame:
    """Rows an earlier run of the same settings left in ``path`` (a cut last line is dropped); empty if none.
    Output of a different run is a UserError."""
    mp = meta_path(path)
    if mp.is_file():
        before, now = read_json(mp).get("settings") or {}, settings.identity()
        for key, value in now.items():
            if before.get(key) != value:
                raise UserError(f"{path}: holds a profile of other settings ({key} {before.get(key)!r}, not "
                                f"{value!r}); give another --out or remove it")
    if not path.is_file() or path.stat().st_size == 0:
        return pd.DataFrame(columns=_columns(settings))
    try:
        frame = pd.read_csv(path, on_bad_lines="skip")
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as exc:
        raise UserError(f"{path}: cannot resume from it, not a profile CSV ({str(exc).splitlines()[0]})") from None
    if list(frame.columns) != list(_columns(settings)):
        raise UserError(f"{path}: cannot resume from it: columns {list(frame.columns)} "
                        f"(expected {list(_columns(settings))}); give another --out or remove it")
    numeric = frame.columns.drop(["role", "phase"])
    frame[numeric] = frame[numeric].apply(pd.to_numeric, errors="coerce")
    return frame.dropna(subset=list(KEY) + ["seconds"]).astype({k: "int64" for k in KEY[2:]})


class _RowWriter:
    """Appends rows to the output CSV, flushed one by one (the resume log of an interrupted run)."""

    def __init__(self, path: Path, columns: tuple[str, ...], existing: pd.DataFrame):
        write_atomic(path, existing.to_csv(index=False, columns=list(columns)))
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=list(columns))

    def write(self, row: dict[str, Any]) -> None:
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def run_profile(settings: ProfileSettings, log: Callable[[str], None] | None = None,
                clock: Callable[[], float] = time.monotonic) -> ProfileResult:
    """Measure ``settings.grid`` and write the profile (CSV + ``.meta.json``) to ``settings.out``.

    Resumes from rows already in ``settings.out``; stops early at ``max_seconds`` on ``clock`` (the metadata
    then says ``complete: false``), or on Ctrl-C, keeping what was measured. ``log`` gets the one-line
    messages (default: stderr, above the progress bar)."""
    import torch
    import transformers
    from tqdm import tqdm

    from profiles.models import forward

    start_wall, start = datetime.datetime.now(datetime.timezone.utc), clock()
    deadline = start + settings.max_seconds if settings.max_seconds else math.inf
    say = log or (lambda msg: tqdm.write(msg, file=sys.stderr))
    out = Path(settings.out)
    dtype_bytes = DTYPE_BYTES[settings.dtype]
    roles = settings.roles()
    full = _architectures(settings)
    existing = read_partial(out, settings)
    done = set(existing[list(KEY)].itertuples(index=False, name=None))

    device = forward.setup_device(settings.device, settings.threads)
    variants = _variants(settings, full, forward, device)
    loaded_weights = sum(v.arch.weight_bytes(dtype_bytes) if v.arch.head else
                         dtype_bytes * sum(p.numel() for p in v.model.parameters())
                         for vs in variants.values() for v in vs)
    params = {role: arch.params if arch.head else
              forward.parameter_count(forward.load_config(getattr(settings, role), f"--{role}", arch.num_layers))
              for role, arch in full.items()}
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    meta = {
        "method": "measured",
        "device": forward.device_name(device),
        "dtype": settings.dtype,
        "forward": settings.forward,
        "cuda_graphs": settings.forward == "optimized" and settings.cuda_graphs and device.type == "cuda",
        "optimized_forward": {"fused_projections": True, "prefill_graphs": True} if settings.forward == "optimized"
        else None,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "settings": settings.identity(),
        **_model_meta(settings, full, params, forward.total_memory_bytes(device)),
    }
    write_atomic(meta_path(out), json.dumps({**meta, "complete": False}, indent=2) + "\n")

    groups = [g for g in settings.grid.groups(roles) if any(p.key not in done for p in g.points)]
    writer = _RowWriter(out, _columns(settings), existing)
    rows: list[dict[str, Any]] = existing.to_dict("records")
    skipped: dict[tuple, str] = {}
    measured, stopped = 0, None
    bar = tqdm(total=sum(p.key not in done for g in groups for p in g.points), unit="pt", file=sys.stderr,
               disable=settings.quiet or not sys.stderr.isatty())

    def skip(points: list[Point], why: str) -> None:
        for p in points:
            skipped[p.key] = f"{p}: {why}"
            say(f"skip {skipped[p.key]}")
        bar.update(len(points))

    try:
        for group in groups:
            if clock() >= deadline:
                break
            points = [p for p in group.points if p.key not in done]
            need = sum(pass_memory_bytes(v.arch, dtype_bytes, points[-1]) for v in variants[group.role])
            free = forward.free_memory_bytes(device)
            if settings.max_memory_gb is not None:
                free = min(free, settings.max_memory_gb * GIB - loaded_weights)
            if need > 0.9 * free:
                skip(points, f"needs ~{need / GIB:.2f} GiB, {max(free, 0) / GIB:.2f} GiB free")
                continue
            in_group, out_of_memory = 0, False
            try:
                for row in _measure_group(group, points, variants[group.role], settings, forward, device,
                                          generator, lambda: clock() >= deadline, full[group.role].num_layers):
                    writer.write(row)
                    rows.append(row)
                    in_group += 1
                    measured += 1
                    bar.update(1)
            except Exception as exc:
                if not forward.is_out_of_memory(exc):
                    raise
                out_of_memory = True
            if out_of_memory:  # here, not in the handler: the traceback there still holds the caches
                forward.release_memory(device)
                skip(points[in_group:], f"out of memory (estimated ~{need / GIB:.2f} GiB)")
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        bar.close()
        writer.close()

    frame = pd.DataFrame(rows, columns=list(_columns(settings))).sort_values(list(KEY)).reset_index(drop=True)
    frame = frame.astype({k: "int64" for k in KEY[2:]})
    grid_keys = {p.key for p in settings.grid.points(roles)}
    complete = grid_keys <= set(frame[list(KEY)].itertuples(index=False, name=None)) | set(skipped)
    meta.update({
        "date": start_wall.isoformat(timespec="seconds"),
        "wall_seconds": round(clock() - start, 1),
        "complete": complete,
        "stopped": None if complete else stopped or "max_seconds",
        "points": {"grid": len(grid_keys), "rows": len(frame), "measured_now": measured, "skipped": len(skipped)},
        "skipped": list(skipped.values()),
    })
    if settings.check_scaling:
        meta["layer_scaling"]["check"] = scaling_errors(frame)
    write_profile(frame, meta, out)
    return ProfileResult(frame, meta, str(out))


def _architecture(spec: str, where: str, target: Architecture | None = None) -> tuple[Architecture, str | None]:
    """The architecture of a model of a family the torch side builds (:mod:`profiles.models.families`; another model
    type is one line naming them) or of a draft head, and its ``model_type`` (None for a head)."""
    _, data = read_model_config(spec, where, head_ok=True, model_types=MODEL_TYPES)
    return Architecture.from_config(spec, where, target), data.get("model_type")


def _architectures(settings: ProfileSettings) -> dict[str, Architecture]:
    """Each role's architecture at the depth its rows describe (``num_layers`` if given, else the config's; a draft
    head keeps its own)."""
    target, model_type = _architecture(settings.target, "--target")
    full = {"target": target}
    if settings.draft:
        full["draft"] = _architecture(settings.draft, "--draft", target)[0]
        if full["draft"].head is not None and settings.forward != "eager":
            raise UserError(f"--forward {settings.forward}: a draft head ({full['draft'].head}) is timed on the eager "
                            "forward only; give --forward eager")
        if full["draft"].head is not None and not family(model_type).head_target:
            raise UserError(f"--draft: a draft head's layer is its target's family's layer; {model_type} targets "
                            "(a MoE or Gemma-2 layer) take no head here")
    if settings.num_layers is not None:
        full = {r: a if a.head else a.with_layers(settings.num_layers) for r, a in full.items()}
    if settings.scale_layers is not None and settings.scale_layers[1] > full["target"].num_layers:
        raise UserError(f"--scale-layers: N2 must be <= the target's {full['target'].num_layers} layers "
                        f"(got {settings.scale_layers[1]})")
    return full


def _variants(settings: ProfileSettings, full: dict[str, Architecture], forward: Any,
              device: Any) -> dict[str, list[Variant]]:
    """The models each role is measured with: the model itself, or the target cut to N1 and N2 layers
    (and whole, for the scaling check)."""
    out = {}
    for role, arch in full.items():
        if arch.head is not None:  # random weights always: a head's real weights are not loaded here
            from profiles.models.draft_head import build_head

            config = forward.load_config(settings.target, "--target", arch.num_layers)
            out[role] = [Variant(f"{role}@{arch.num_layers}", arch,
                                 build_head(arch, config, settings.dtype, device, settings.seed))]
            continue
        depths = [arch.num_layers]
        if role == "target" and settings.scale_layers is not None:
            depths = list(settings.scale_layers) + ([arch.num_layers] if settings.check_scaling else [])
        spec = getattr(settings, role)
        out[role] = [Variant(f"{role}@{n}", arch.with_layers(n),
                             forward.build_model(forward.load_config(spec, f"--{role}", n), settings.dtype, device,
                                                 settings.seed, _weights_dir(settings, role)))
                     for n in depths]
    return out


def _model_meta(settings: ProfileSettings, full: dict[str, Architecture], params: dict[str, int],
                device_bytes: int) -> dict[str, Any]:
    """Metadata on the models: per role, the grid and timing policy, layer scaling and the memory figures
    (``params``: a head's own, :attr:`Architecture.params`; a model's as transformers builds it; weights = parameters
    x dtype bytes, KV bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes: Gemma-2's sliding layers
    hold at most their window, so less)."""
    dtype_bytes = DTYPE_BYTES[settings.dtype]
    meta: dict[str, Any] = {"grid": settings.grid.as_dict(), "timing": asdict(settings.timing)}
    memory = {"device_memory_gb": device_bytes / GIB}
    for role, arch in full.items():
        spec = getattr(settings, role)
        meta[role] = {"config": spec, "config_file": str(resolve_model_config(spec, f"--{role}")),
                      "num_layers": arch.num_layers, "params": params[role],
                      "weights": "random" if arch.head else str(_weights_dir(settings, role) or "random"),
                      **arch.draft_meta()}
        memory[f"{role}_weight_gb"] = (arch.weight_bytes(dtype_bytes) if arch.head else params[role] * dtype_bytes) / GIB
        memory[f"{role}_kv_bytes_per_token"] = arch.kv_bytes_per_token(dtype_bytes)
    meta["memory"] = memory
    if settings.scale_layers is not None:
        n1, n2 = settings.scale_layers
        meta["layer_scaling"] = {"role": "target", "layers": [n1, n2], "full_layers": full["target"].num_layers,
                                 "formula": "t(N) = t(n1) + (N - n1) (t(n2) - t(n1)) / (n2 - n1), at least t(n2)",
                                 "columns": {"seconds_n1": n1, "seconds_n2": n2},
                                 "full_model_fits_device": params["target"] * dtype_bytes < device_bytes,
                                 "note": "every point is measured on the cut models; where the full model does not "
                                         "fit the device, its seconds are those of a device that could hold it"}
    return meta


def _weights_dir(settings: ProfileSettings, role: str) -> Path | None:
    """``<--weights>/<config name>`` if that folder exists (real weights for the role), else None."""
    if settings.weights is None:
        return None
    spec = getattr(settings, role)
    folder = Path(settings.weights) / resolve_model_config(spec, f"--{role}").stem
    return folder if folder.is_dir() else None


def _measure_group(group: Group, points: list[Point], variants: list[Variant], settings: ProfileSettings,
                   forward: Any, device: Any, generator: Any, out_of_time: Callable[[], bool],
                   full_layers: int) -> Iterator[dict[str, Any]]:
    """Measure ``points`` of ``group`` with every variant (caches built once per variant), one row per point,
    until ``out_of_time()``."""
    sync = lambda: forward.synchronize(device)  # noqa: E731
    if settings.forward == "optimized":
        yield from _measure_group_optimized(group, points, variants, settings, forward, device, generator,
                                            out_of_time, full_layers)
        return
    caches = {}
    if group.phase == "decode":
        caches = {v.name: forward.random_cache(v.model, group.batch_size, group.context_len, generator)
                  for v in variants}
    for point in points:
        if out_of_time():
            return
        timings = []
        for v in variants:
            ids = forward.random_tokens(v.model, point.batch_size, point.query_len, generator)
            if group.phase == "decode":
                cache = caches[v.name]
                timing = measure(lambda: forward.decode_pass(v.model, cache, ids),
                                 lambda: forward.crop(cache, point.query_len), sync, settings.timing)
            else:
                timing = measure(lambda: forward.prefill_pass(v.model, ids), lambda: None, sync, settings.timing)
            timings.append(timing)
        yield _row(point, timings, settings, full_layers)


def _measure_group_optimized(group: Group, points: list[Point], variants: list[Variant], settings: ProfileSettings,
                             forward: Any, device: Any, generator: Any, out_of_time: Callable[[], bool],
                             full_layers: int) -> Iterator[dict[str, Any]]:
    """:func:`_measure_group` on the optimized path (:mod:`profiles.models.optimized`): one preallocated
    cache per variant, filled with ``context_len`` random tokens per sequence; a decode pass writes its
    ``q`` tokens in place without advancing the lengths (nothing to undo); on CUDA each decode point is
    one captured graph, replayed (capture is not timed; the graphs are dropped with the group), and so is a
    prefill over an empty cache. A verification keeps the logits of all ``q`` positions, a draft pass and a
    prefill their last."""
    from profiles.models.optimized import GraphedForward, SlotCache, attention_width, last_columns

    sync = lambda: forward.synchronize(device)  # noqa: E731
    b, ctx = group.batch_size, group.context_len
    longest_q = max(p.query_len for p in points)
    runners = {}
    for v in variants:
        cache = SlotCache(v.model, b, ctx + longest_q)
        if group.phase == "decode":
            cache.fill_random(0, b, ctx, generator)
        runners[v.name] = GraphedForward(v.model, cache, use_graphs=settings.cuda_graphs and device.type == "cuda")
    try:
        for point in points:
            if out_of_time():
                return
            timings = []
            for v in variants:
                run = runners[v.name]
                q = point.query_len
                ids = forward.random_tokens(v.model, b, q, generator)
                kept = q if group.phase == "decode" and group.role == "target" else 1
                keep = last_columns(b, q, kept, ids.device)
                width = attention_width(ctx, q, run.cache.max_len)
                fresh = group.phase == "prefill"
                timings.append(measure(lambda: run(0, ids, keep, width, fresh), lambda: None, sync, settings.timing))
            yield _row(point, timings, settings, full_layers)
    finally:
        for run in runners.values():
            run.clear()


def _row(point: Point, timings: list[Timing], settings: ProfileSettings, full_layers: int) -> dict[str, Any]:
    """A profile row from the timings of a point's variants (one, or the two cut models [+ the full one])."""
    row = {**point.as_dict(), "num_layers": full_layers}
    if len(timings) == 1:
        t = timings[0]
        return {**row, "seconds": t.median, "seconds_p10": t.p10, "seconds_p90": t.p90, "repeats": t.repeats}
    (n1, n2), (t1, t2) = settings.scale_layers, timings[:2]
    scaled = {name: extrapolate_layers(getattr(t1, name), getattr(t2, name), n1, n2, full_layers)
              for name in ("median", "p10", "p90")}
    row.update(seconds_n1=t1.median, seconds_n2=t2.median)
    if settings.check_scaling:
        t = timings[2]
        return {**row, "seconds": t.median, "seconds_p10": t.p10, "seconds_p90": t.p90, "repeats": t.repeats,
                "seconds_scaled": scaled["median"]}
    return {**row, "seconds": scaled["median"], "seconds_p10": scaled["p10"], "seconds_p90": scaled["p90"],
            "repeats": min(t1.repeats, t2.repeats)}
