"""Column checks shared by the readers of user CSV files (traces, length files, acceptance traces).

Each check raises a one-line :class:`UserError` naming the file, the line (the header is line 1), the
column and the offending cell, e.g. ``trace.csv: line 3: prompt_tokens must be >= 1 token (got -3)``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.errors import UserError


def refuse_first(path: str, raw: pd.Series, bad: np.ndarray, problem: str) -> None:
    """Raise naming the first row where ``bad`` holds, unless there is none."""
    if bad.any():
        i = int(np.argmax(bad))
        raise UserError(f"{path}: line {i + 2}: {raw.name} {problem} (got {show_cell(raw.iloc[i])})")


def show_cell(cell: object) -> str:
    """A cell as a message shows it: text quoted, numbers bare."""
    if pd.isna(cell):
        return "an empty or NaN cell"
    return repr(cell) if isinstance(cell, str) else str(cell)


def finite_numbers(path: str, raw: pd.Series) -> np.ndarray:
    """The column as float64; any cell that is not a finite number is an error."""
    cells = raw if pd.api.types.is_numeric_dtype(raw) else raw.str.strip()
    values = pd.to_numeric(cells, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    refuse_first(path, raw, ~np.isfinite(values), "must be a finite number")
    return values


def whole_numbers(path: str, raw: pd.Series, minimum: int, unit: str = "") -> np.ndarray:
    """The column as int64, each a whole number >= ``minimum`` (``unit`` names what is counted, for messages)."""
    values = finite_numbers(path, raw)
    of_unit = f" of {unit}s" if unit else ""
    refuse_first(path, raw, values != np.floor(values), f"must be a whole number{of_unit}")
    refuse_first(path, raw, values < minimum, f"must be >= {minimum}{f' {unit}' if unit else ''}")
    return values.astype(np.int64)
