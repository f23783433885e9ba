"""Writing results atomically: a file appears complete or not at all.

Each file is written to a temporary name in the same folder, flushed and fsynced, then renamed over the
final name (``os.replace`` is atomic on POSIX). A run directory is complete when ``summary.json`` exists:
it is written last.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd


def atomic_write(path: str | Path, write: Callable[[IO[str]], None]) -> None:
    """Call ``write(f)`` on a temporary text file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, data: Any) -> None:
    """Atomic JSON (NaN written as null, keys in insertion order)."""
    atomic_write(path, lambda f: json.dump(_clean(data), f, indent=2))


def write_csv(path: str | Path, frame: pd.DataFrame) -> None:
    """Atomic CSV without the index; floats written with full precision (round-trips bit for bit)."""
    atomic_write(path, lambda f: frame.to_csv(f, index=False, float_format="%.17g"))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value
