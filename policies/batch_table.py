"""vLLM's dynamic speculative decoding: k looked up by batch size in a user's table.

vLLM's ``speculative_config`` key ``num_speculative_tokens_per_batch_size`` (V1, vLLM pull request #32374
"[V1][Spec Decode] Add Dynamic SD"; ``vllm/v1/spec_decode/dynamic/utils.py``, functions
``validate_and_normalize_dynamic_sd_schedule`` and ``build_dynamic_sd_schedule_lookup``) is a list of inclusive
batch-size ranges ``[[range_start, range_end, k], ...]``. Its rules, mirrored here:

- ranges are positive (start >= 1), start <= end, sorted and non-overlapping, and the first starts at 1 (so every
  batch size has a k); k >= 0 (0: no speculation at that batch size);
- a batch size in a gap between two ranges takes the k of the range before it, and batch sizes past the last range
  take the last k ("carry forward"), so a range's end never changes the lookup: ``[[1, 16, 3], [32, 128, 2]]``
  gives k = 3 up to 31 and k = 2 from 32 on, as ``"1:3,32:2"`` does here;
- the k looked up is clamped to ``num_speculative_tokens`` (this policy's ``k``): min(k, table's k), as vLLM does
  (not an error: vLLM accepts such a table).

vLLM's scheduler looks the table up by the number of requests scheduled in the step; here, by the number of running
requests in the decode step (``BatchView.batch_size``). Unlike ``threshold``'s ``table`` form (0 outside its
ranges), nothing here falls back to 0 but what the table says.

Parameter ``table`` (required), either form:

- a string of entries ``start:k`` (k from batch size ``start`` on, until the next entry) or ``start-end:k`` (vLLM's
  range), separated by commas, or by semicolons (which a sweep's ``--policies`` list leaves whole):
  ``"1:5,8:3,32:1,64:0"``;
- vLLM's own list ``[[start, end, k], ...]`` (e.g. from a ``config.json``).
"""
from __future__ import annotations

import re
from bisect import bisect_right
from typing import Any

import numpy as np

from policies.base import BatchView, Policy
from policies.errors import UserError
from policies.params import ParamReader

ENTRY = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?:\s*(\d+)\s*$")
"""One string entry: ``start:k`` or ``start-end:k`` (non-negative integers)."""


class VllmBatchTable(Policy):
    """k by the running batch size from vLLM's ``num_speculative_tokens_per_batch_size`` table (carry-forward)."""

    name = "vllm-batch-table"
    stationary = True
    by_count = True
    """:meth:`propose` is :meth:`k_by_count` for everyone (the simulator may ask that instead: a speed shortcut)."""

    def __init__(self, k: int, **params: Any) -> None:
        reader = ParamReader(self.name, params)
        table = reader.pop("table")
        super().__init__(k, **reader.rest())
        if table is None:
            raise UserError(f"policy {self.name}: parameter table is required, e.g. table=1:5,8:3,32:1,64:0 "
                            "(vLLM's num_speculative_tokens_per_batch_size)")
        entries = parse_table(reader, table)
        self.starts: tuple[int, ...] = tuple(start for start, _ in entries)
        """First batch size of each entry, ascending (the first is 1)."""
        self.ks: tuple[int, ...] = tuple(min(k_entry, self.k) for _, k_entry in entries)
        """k of each entry, clamped to the policy's k (vLLM's num_speculative_tokens)."""

    def k_for(self, batch_size: int) -> int:
        """k at ``batch_size`` running requests: the entry with the largest start <= ``batch_size`` (0 for none)."""
        i = bisect_right(self.starts, batch_size)
        return self.ks[i - 1] if i else 0

    def k_by_count(self, batch_size: int, max_k: int) -> int:
        """The k every request proposes when ``batch_size`` run and at most ``max_k`` may be proposed."""
        return min(self.k_for(batch_size), max_k)

    def propose(self, view: BatchView) -> np.ndarray:
        return np.full(view.batch_size, self.k_by_count(view.batch_size, view.max_k), dtype=np.int64)


def parse_table(reader: ParamReader, value: Any) -> list[tuple[int, int]]:
    """The table as ``(start, k)`` entries by ascending start, checked by vLLM's rules (a range's end only has to
    keep the ranges disjoint); a :class:`UserError` naming the table and the entry otherwise."""
    if isinstance(value, str):
        raw = [e for e in re.split(r"[,;]", value) if e.strip()]
        rows = []
        for entry in raw:
            match = ENTRY.match(entry)
            if match is None:
                raise reader.error("table", "entries must look like start:k or start-end:k (integers)", entry.strip())
            start, end, k = match.groups()
            rows.append((entry.strip(), int(start), None if end is None else int(end), int(k)))
    elif isinstance(value, (list, tuple)) and all(isinstance(r, (list, tuple)) and len(r) == 3 for r in value):
        rows = []
        for r in value:
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in r):
                raise reader.error("table", "entries [start, end, k] must be integers", str(list(r)))
            rows.append((str(list(r)), *r))
    else:
        raise reader.error("table", "must be 'start:k,...' (or 'start-end:k,...') or vLLM's list of "
                                    "[start, end, k]", value)
    if not rows:
        raise reader.error("table", "needs at least one entry", value)
    for shown, start, end, k in rows:
        if start < 1 or (end is not None and end < start):
            raise reader.error("table", "ranges need 1 <= start <= end", shown)
        if k < 0:
            raise reader.error("table", "k must be >= 0", shown)
    rows.sort(key=lambda row: row[1])
    for (_, start, end, _), (shown, following, _, _) in zip(rows, rows[1:]):
        if following <= (start if end is None else end):
            raise reader.error("table", "ranges overlap", shown)
    if rows[0][1] != 1:
        raise reader.error("table", "must start at batch size 1 (vLLM requires it, so every batch size has a k)",
                           rows[0][0])
    return [(start, k) for _, start, _, k in rows]
