"""Reading the user's CSV files (traces, length files, acceptance traces) and checking their columns.

:func:`read_table` reads a file with the standard library's ``csv`` module (no pandas: a simulation that
reads a trace starts in a fraction of pandas' import time) into text :class:`Column` s; the checks convert
a column and raise a one-line :class:`UserError` naming the file, the line (the header is line 1; blank
lines are skipped and not counted), the column and the offending cell, e.g.
``trace.csv: line 3: prompt_tokens must be >= 1 token (got -3)``.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policies.errors import UserError, require


@dataclass(frozen=True)
class Column:
    """One column of a CSV file: its header name and its cells as written (row ``i`` is line ``i + 2``)."""

    name: str
    cells: list[str]


def read_table(path: str, formats: dict[str, tuple[str, ...]]) -> tuple[str, dict[str, Column]]:
    """The first format whose columns the header has (names stripped of spaces), and those columns (at
    least one row). A row with fewer cells than the header has empty cells; one with more is refused."""
    require(Path(path).is_file(), f"{path}: file not found")
    try:  # utf-8-sig: a byte-order mark (spreadsheets write one) is not part of the first column's name
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [row for row in csv.reader(f) if row]
    except (UnicodeDecodeError, csv.Error) as error:
        raise UserError(f"{path}: not a readable CSV file ({str(error).splitlines()[0]})") from None
    except OSError as error:
        raise UserError(f"{path}: cannot read the file ({error.strerror or error})") from None
    require(bool(rows), f"{path}: empty file, no header and no rows")
    header = [name.strip() for name in rows[0]]
    matching = [name for name, columns in formats.items() if set(columns) <= set(header)]
    if not matching:
        closest = max(formats.values(), key=lambda columns: len(set(columns) & set(header)))
        missing = next(c for c in closest if c not in header)
        expected = " or ".join(",".join(columns) for columns in formats.values())
        raise UserError(f"{path}: missing column {missing!r} (got columns {','.join(header)}; expected {expected})")
    body = rows[1:]
    require(len(body) > 0, f"{path}: no rows after the header (got 0 rows)")
    for i, row in enumerate(body):
        if len(row) > len(header):
            raise UserError(f"{path}: line {i + 2}: {len(row)} cells, more than the header's {len(header)} "
                            f"(not a readable CSV file)")
    name = matching[0]
    columns = {}
    for column in formats[name]:
        j = header.index(column)
        columns[column] = Column(column, [row[j] if j < len(row) else "" for row in body])
    return name, columns


def refuse_first(path: str, column: Column, bad: np.ndarray, problem: str) -> None:
    """Raise naming the first row where ``bad`` holds, unless there is none."""
    if bad.any():
        i = int(np.argmax(bad))
        raise UserError(f"{path}: line {i + 2}: {column.name} {problem} (got {show_cell(column.cells[i])})")


def show_cell(cell: str) -> str:
    """A cell as a message shows it: a number bare, other text quoted, an empty or NaN cell said so."""
    text = cell.strip()
    try:
        value = float(text)
    except ValueError:
        return "an empty or NaN cell" if not text else repr(cell)
    return "an empty or NaN cell" if math.isnan(value) else text


def finite_numbers(path: str, column: Column) -> np.ndarray:
    """The column as float64; any cell that is not a finite number is an error."""
    try:
        values = np.array(column.cells, dtype=np.float64)  # parses every cell, spaces allowed, in C
    except ValueError:
        values = np.array([_number(cell) for cell in column.cells], dtype=np.float64)
    refuse_first(path, column, ~np.isfinite(values), "must be a finite number")
    return values


def _number(cell: str) -> float:
    """The cell as a float, NaN when it is not a number."""
    try:
        return float(cell)
    except ValueError:
        return math.nan


#: Largest count a column of whole numbers may hold (a token count above a billion is a typo, and sums of such
#: counts over millions of rows must stay far from int64's limit).
MAX_COUNT = 1_000_000_000


def whole_numbers(path: str, column: Column, minimum: int, unit: str = "", maximum: int = MAX_COUNT) -> np.ndarray:
    """The column as int64, each a whole number in [``minimum``, ``maximum``] (``unit`` names what is counted, for
    messages)."""
    values = finite_numbers(path, column)
    of_unit = f" of {unit}s" if unit else ""
    refuse_first(path, column, values != np.floor(values), f"must be a whole number{of_unit}")
    refuse_first(path, column, values < minimum, f"must be >= {minimum}{f' {unit}' if unit else ''}")
    refuse_first(path, column, values > maximum, f"must be <= {maximum:,}{f' {unit}s' if unit else ''}")
    return values.astype(np.int64)
