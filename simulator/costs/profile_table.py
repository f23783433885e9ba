"""Profile tables: the seconds of single forward passes, one row per measured (or computed) point.

A profile is a CSV with one row per point and a metadata file beside it, ``<stem>.meta.json``.

Required columns (units: sequences, tokens, seconds):

- ``role``: ``target`` or ``draft``;
- ``phase``: ``prefill``, ``decode``, ``overhead`` or ``prefill_overhead`` (role ``target`` only: the per-step
  scheduler and sampling seconds of a decode step, or of a prefill-only step, over ``batch_size`` sequences;
  ``query_len`` and ``context_len`` are ignored), ``frontend`` (role ``target``, ``batch_size`` 1: the serving
  front end's seconds per request before the engine sees it, e.g. an API server's HTTP handling and tokenization;
  :mod:`simulator.core.engine`), or ``spec_overhead`` (role ``target``: the seconds a speculative step spends beyond
  its passes and a plain step's ``overhead``, over ``batch_size`` sequences verifying ``query_len`` tokens each,
  k + 1: the proposer's host work and the rejection sampler, :meth:`simulator.costs.cost_model.CostModel.
  speculation_time`; ``context_len`` 0; a profile without these rows prices none);
- ``batch_size``: sequences in the pass (>= 1);
- ``query_len``: new tokens per sequence: the prompt length for prefill, k + 1 for a target
  decode/verification pass, 1 for a draft decode pass that proposes (more for the pass that first feeds the draft
  the tokens it has not seen: the catch-up, :func:`policies.step_time.catchup_step_seconds`);
- ``context_len``: tokens already in each sequence's KV cache before the pass (0 for prefill);
- ``seconds``: median wall seconds of one forward pass (> 0).

Optional numeric columns: ``seconds_p10``, ``seconds_p90``, ``repeats``, ``num_layers``; other columns are
kept and ignored. The metadata is free-form JSON (device, dtype, versions, date, grid, ...) except
``method`` (``measured`` or ``analytical``; default ``measured``), ``memory`` (see :class:`Memory`),
``verification`` (how the profiled engine verifies k + 1 tokens of a sequence, :data:`VERIFICATIONS`) and
``forward`` (a measured profile's forward path: ``eager``, Hugging Face as is, or ``optimized``) and
``batch_layout`` (:data:`BATCH_LAYOUTS`: how the profiled engine lays out sequences that feed different numbers of
new tokens in one pass: ``ragged``, packed one after another as vLLM does, the default; or ``padded`` to the
longest, as this project's real engine does; the simulator reads it to price the draft's catch-up pass) and
``draft_extend`` (:data:`policies.protocol.DRAFT_EXTENDS`: what the drafter's first pass of a step feeds each request:
``unseen``, the default, ``accepted`` or ``padded``; priced where the draft rows have more than one query length).

Verification pricing is a property of the modelled engine (DESIGN.md): ``multi-query`` (the sequence's
k + 1 tokens are queries of one attention call that reads its KV cache once; vLLM v1, SGLang, TensorRT-LLM,
and both forward paths of this project's real engine) or ``batch-expansion`` (each token verified as a
sequence of its own that re-reads the cache; vLLM v0's scorer, on which SmartSpec was built). A profile
that does not say is ``multi-query`` (every measured profile here is: the profiler verifies q tokens in
one pass).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from policies.errors import UserError
from policies.protocol import DRAFT_EXTENDS
from simulator.results import atomic_write

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

ROLES = ("target", "draft")
PHASES = ("prefill", "decode", "overhead", "prefill_overhead", "frontend", "spec_overhead")
REQUIRED_COLUMNS = ("role", "phase", "batch_size", "query_len", "context_len", "seconds")
OPTIONAL_COLUMNS = ("seconds_p10", "seconds_p90", "repeats", "num_layers")
TABLE_METHODS = ("measured", "analytical")
#: How an engine verifies the k + 1 tokens of a sequence (module docstring); the first is the default.
VERIFICATIONS = ("multi-query", "batch-expansion")
#: How an engine lays out a pass's unequal numbers of new tokens per sequence (module docstring); the first is the
#: default.
BATCH_LAYOUTS = ("ragged", "padded")
#: Forward paths of a measured profile (``forward`` in the metadata; absent: ``eager``).
FORWARDS = {"eager": "HF eager", "optimized": "optimized"}
#: How the engines a calibration block names (``calibration.engine``) are written.
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def method_label(meta: dict) -> str:
    """What a profile's figures and summaries call its method: ``analytical``, ``measured, optimized`` or
    ``measured, HF eager`` (a measured profile that does not name its forward path timed Hugging Face eager
    passes: every one made before the optimized path existed); a profile with a ``calibration`` block
    (``run_sim.py calibrate``) adds ``calibrated to vLLM`` or ``transferred from vLLM-calibrated`` (or the engine
    the block names: ``calibrated to SGLang``, :mod:`profiles.spec_calibrate`)."""
    method = meta.get("method", "measured")
    if isinstance(meta.get("calibration"), dict):  # profiles/calibrate.py: fitted to (or moved from) vLLM's results
        moved = "transferred_from" in meta["calibration"]
        engine = ENGINE_NAMES.get(meta["calibration"].get("engine"), "vLLM")
        return f"{method}, {f'transferred from {engine}-calibrated' if moved else f'calibrated to {engine}'}"
    if method != "measured":
        return method
    return f"measured, {FORWARDS.get(meta.get('forward', 'eager'), meta.get('forward'))}"


@dataclass(frozen=True)
class Memory:
    """Memory figures of a device and a target/draft pair: sizes in GiB, KV cache in bytes per token.

    A token's KV bytes are those of every layer: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes for
    grouped-query attention, the latent (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes for MLA, summed over
    the devices that hold them (an engine over tensor-parallel devices: MLA's latent is on every one). The draft
    figures default to 0 (a profile without a draft model). A model with sliding-window layers says which share of
    its KV per token is in them (``*_sliding_kv_bytes_per_token``) and their window (``*_sliding_window``, tokens a
    query sees, itself included): those layers hold a request's last window of tokens only
    (:mod:`simulator.core.memory`); 0: none.
    """

    device_memory_gb: float
    target_weight_gb: float
    target_kv_bytes_per_token: float
    draft_weight_gb: float = 0.0
    draft_kv_bytes_per_token: float = 0.0
    target_sliding_kv_bytes_per_token: float = 0.0
    target_sliding_window: int = 0
    draft_sliding_kv_bytes_per_token: float = 0.0
    draft_sliding_window: int = 0

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Memory":
        """Validate a JSON ``memory`` object; errors name ``where`` (e.g. ``"x.meta.json: memory"``)."""
        if not isinstance(data, dict):
            raise UserError(f"{where} must be a JSON object (got {data!r})")
        names = [f.name for f in fields(cls)]
        for key in data:
            if key not in names:
                raise UserError(f"{where}: unknown key {key!r}; known: {', '.join(names)}")
        for key in names[:3]:
            if key not in data:
                raise UserError(f"{where}: missing {key}")
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise UserError(f"{where}: {key} must be a number >= 0 (got {value!r})")
        if data["device_memory_gb"] <= 0:
            raise UserError(f"{where}: device_memory_gb must be > 0 (got {data['device_memory_gb']!r})")
        for role in ("target", "draft"):
            sliding, window = data.get(f"{role}_sliding_kv_bytes_per_token", 0), data.get(f"{role}_sliding_window", 0)
            if sliding > data.get(f"{role}_kv_bytes_per_token", 0):
                raise UserError(f"{where}: {role}_sliding_kv_bytes_per_token {sliding!r} exceeds "
                                f"{role}_kv_bytes_per_token (the sliding layers' share of it)")
            if bool(sliding) != bool(window) or window != int(window):
                raise UserError(f"{where}: {role}_sliding_window must be a whole number of tokens > 0 exactly when "
                                f"{role}_sliding_kv_bytes_per_token is > 0 (got {window!r} and {sliding!r})")
        return cls(**data)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class ProfileTable:
    """A validated profile: ``frame`` has the required columns (``batch_size``, ``query_len``,
    ``context_len`` as int64, ``seconds`` as float64), ``meta`` the metadata (``{}`` if no file),
    ``path`` the CSV it was read from (named in error messages)."""

    frame: pd.DataFrame
    meta: dict = field(default_factory=dict)
    path: str = "profile"

    @property
    def method(self) -> str:
        """``measured`` or ``analytical`` (from the metadata; ``measured`` when it does not say)."""
        return self.meta.get("method", "measured")

    @property
    def method_label(self) -> str:
        """:func:`method_label` of the metadata (``measured, HF eager``, ``measured, optimized``, ``analytical``)."""
        return method_label(self.meta)

    @property
    def verification(self) -> str:
        """``multi-query`` or ``batch-expansion`` (from the metadata; ``multi-query`` when it does not say)."""
        return self.meta.get("verification", VERIFICATIONS[0])

    @property
    def batch_layout(self) -> str:
        """``ragged`` or ``padded`` (from the metadata; ``ragged`` when it does not say)."""
        return self.meta.get("batch_layout", BATCH_LAYOUTS[0])

    @property
    def draft_extend(self) -> str:
        """``unseen``, ``accepted`` or ``padded`` (from the metadata; ``unseen`` when it does not say)."""
        return self.meta.get("draft_extend", DRAFT_EXTENDS[0])

    @property
    def memory(self) -> Memory | None:
        """The metadata's memory figures, or ``None``."""
        if "memory" not in self.meta:
            return None
        return Memory.from_dict(self.meta["memory"], f"{meta_path(self.path)}: memory")


#: The config fields that describe a vLLM deployment: what a profile calibrated to its results records as the settings
#: its results ran with (``calibration.settings`` of its metadata, :mod:`profiles.calibrate`; a transfer keeps its
#: source's), and what ``simulate``, ``sweep``, ``compare`` and ``tune`` take from such a profile as defaults
#: (:func:`calibration_settings`).
DEPLOYMENT_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "gpu_memory_utilization", "scheduler",
                       "num_scheduler_steps", "cuda_graph_sizes", "enable_prefix_caching", "num_gpu_blocks")


def calibration_block(path: str | os.PathLike) -> dict[str, Any]:
    """The ``calibration`` block of the metadata of the profile ``path`` (its CSV, or its ``.meta.json``); empty for
    any other profile (a coefficient JSON, a CSV without metadata or calibration). An unreadable metadata file says
    nothing here: loading the profile reports it."""
    p = Path(path)
    meta_file = p if p.name.lower().endswith(".meta.json") else meta_path(p) if p.suffix.lower() == ".csv" else None
    if meta_file is None or not meta_file.is_file():
        return {}
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return {}
    calibration = meta.get("calibration") if isinstance(meta, dict) else None
    return calibration if isinstance(calibration, dict) else {}


def calibration_settings(path: str | os.PathLike) -> dict[str, Any]:
    """The vLLM settings the profile ``path`` was calibrated with (:data:`DEPLOYMENT_SETTINGS` its
    :func:`calibration_block` records under ``settings``, JSON lists as tuples); empty where it records none."""
    settings = calibration_block(path).get("settings")
    if not isinstance(settings, dict):
        return {}
    return {name: tuple(value) if isinstance(value, list) else value for name, value in settings.items()
            if name in DEPLOYMENT_SETTINGS}


def meta_path(path: str | os.PathLike) -> Path:
    """The metadata file beside a profile CSV: ``dir/x.csv`` -> ``dir/x.meta.json``."""
    p = Path(path)
    return p.with_name(p.stem + ".meta.json")


def read_profile(path: str | os.PathLike) -> ProfileTable:
    """Read and validate a profile CSV and its metadata (if present). Bad input raises :class:`UserError`."""
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such profile file")
    try:
        frame = pd.read_csv(p)
    except pd.errors.EmptyDataError:
        raise UserError(f"{path}: empty file, expected a CSV header with {', '.join(REQUIRED_COLUMNS)}") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a readable CSV ({str(exc).splitlines()[0]})") from None
    mp = meta_path(p)
    meta = read_json(mp) if mp.is_file() else {}
    _check_meta(meta, str(mp))
    return ProfileTable(frame=validate_frame(frame, str(path)), meta=meta, path=str(path))


def write_profile(frame: pd.DataFrame, meta: dict, path: str | os.PathLike) -> None:
    """Validate and write a profile CSV and its ``<stem>.meta.json``, each atomically."""
    frame = validate_frame(frame, str(path))
    _check_meta(meta, str(meta_path(path)))
    write_atomic(path, frame.to_csv(index=False))
    write_atomic(meta_path(path), json.dumps(meta, indent=2) + "\n")


def validate_frame(frame: pd.DataFrame, where: str) -> pd.DataFrame:
    """A copy of ``frame`` with checked, typed columns; the first bad cell raises a one-line UserError
    naming ``where``, the 1-based data row and the value."""
    import pandas as pd

    for column in REQUIRED_COLUMNS:
        if column not in frame.columns:
            raise UserError(f"{where}: missing column {column!r} (columns: {', '.join(map(str, frame.columns))})")
    out = frame.reset_index(drop=True).copy()
    for column, options in (("role", ROLES), ("phase", PHASES)):
        bad = ~out[column].isin(options)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise UserError(f"{where}: row {row + 1} {column} must be one of {', '.join(options)} "
                            f"(got {_cell(out[column].iloc[row])!r})")
    for column, minimum in (("batch_size", 1), ("query_len", 0), ("context_len", 0)):
        out[column] = _numeric(out[column], where, minimum, integer=True).astype(np.int64)
    out["seconds"] = _numeric(out["seconds"], where, 0, strict=True)
    # bounds that keep a fit's sums of squares finite (1e308 seconds crashed the least-squares solver)
    for column, most in (("batch_size", 1e7), ("query_len", 1e9), ("context_len", 1e9), ("seconds", 1e6)):
        _rule(out, out[column] > most, where, column, f"must be <= {most:g}")
    for column in OPTIONAL_COLUMNS:
        if column in out.columns:
            values = _numeric(out[column], where, 0, allow_missing=True)
            if not pd.api.types.is_numeric_dtype(out[column]):
                out[column] = values
    overhead = out["phase"].isin(["overhead", "prefill_overhead", "frontend"])
    _rule(out, (overhead | (out["phase"] == "spec_overhead")) & (out["role"] != "target"), where, "role",
          "must be target for an overhead phase")
    _rule(out, ~overhead & (out["query_len"] < 1), where, "query_len", "must be >= 1")
    _rule(out, (out["phase"] == "prefill") & (out["context_len"] != 0), where, "context_len",
          "must be 0 for prefill (prefill over a cached prefix is not modelled)")
    return out


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; a missing or malformed file raises a one-line UserError."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`simulator.results.atomic_write`): readers see the
    old file or the new one, never a partial write."""
    atomic_write(path, lambda f: f.write(text))


def _check_meta(meta: Any, where: str) -> None:
    if not isinstance(meta, dict):
        raise UserError(f"{where}: metadata must be a JSON object (got {type(meta).__name__})")
    if meta.get("method", "measured") not in TABLE_METHODS:
        raise UserError(f"{where}: method must be one of {', '.join(TABLE_METHODS)} (got {meta['method']!r})")
    if meta.get("verification", VERIFICATIONS[0]) not in VERIFICATIONS:
        raise UserError(f"{where}: verification must be one of {', '.join(VERIFICATIONS)} "
                        f"(got {meta['verification']!r})")
    if meta.get("batch_layout", BATCH_LAYOUTS[0]) not in BATCH_LAYOUTS:
        raise UserError(f"{where}: batch_layout must be one of {', '.join(BATCH_LAYOUTS)} "
                        f"(got {meta['batch_layout']!r})")
    if meta.get("draft_extend", DRAFT_EXTENDS[0]) not in DRAFT_EXTENDS:
        raise UserError(f"{where}: draft_extend must be one of {', '.join(DRAFT_EXTENDS)} "
                        f"(got {meta['draft_extend']!r})")
    if "memory" in meta:
        Memory.from_dict(meta["memory"], f"{where}: memory")


def _numeric(raw: pd.Series, where: str, minimum: float, strict: bool = False, integer: bool = False,
             allow_missing: bool = False) -> pd.Series:
    """``raw`` as float64 numbers, checked to be ``>= minimum`` (``> minimum`` if ``strict``)."""
    import pandas as pd

    values = pd.to_numeric(raw, errors="coerce").astype(float)
    missing = raw.isna()
    bad = (values.isna() & ~missing) | (missing & (not allow_missing))
    bad |= ~missing & ~(np.isfinite(values) & ((values > minimum) if strict else (values >= minimum)))
    if integer:
        bad |= values.notna() & (values != np.round(values))
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        kind = "an integer" if integer else "a number"
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise UserError(f"{where}: row {row + 1} {raw.name} must be {kind} {bound} (got {_cell(raw.iloc[row])!r})")
    return values


def _rule(frame: pd.DataFrame, bad: pd.Series, where: str, column: str, problem: str) -> None:
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise UserError(f"{where}: row {row + 1} {column} {problem} (got {_cell(frame[column].iloc[row])!r})")


def _cell(value: Any) -> Any:
    """A numpy scalar as the plain Python value, for messages."""
    return value.item() if isinstance(value, np.generic) else value
