"""Load-based switch: speculate at small batch sizes only (vLLM's static rules).

Two forms, chosen by parameter:

- ``max_batch=B``: propose ``k`` while the request count is at most B, else 0. vLLM's
  ``speculative_disable_by_batch_size`` (v0 ``SpecDecodeWorker``) disables speculation once
  ``running_queue_size >= B``, so vLLM's setting B is ``max_batch = B - 1`` here.
- ``table="1-64:3,65-128:1"``: k by request count, 0 outside every range; vLLM's
  ``num_speculative_tokens_per_batch_size`` (a list of ``[start_bs, end_bs, k]``, both ends inclusive),
  given as a string or as that list.

``count=running`` (default) counts running requests; ``count=total`` adds the waiting queue.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from policies.base import BatchView, Policy
from policies.params import ParamReader
from policies.errors import UserError

COUNTS = ("running", "total")


class Threshold(Policy):
    """``k`` (or the table's k) while the batch is small enough, 0 beyond."""

    name = "threshold"

    def __init__(self, k: int, **params: Any) -> None:
        reader = ParamReader(self.name, params)
        self.count = reader.choice("count", "running", COUNTS)
        max_batch = reader.integer("max_batch", None, low=0)
        table = reader.pop("table")
        super().__init__(k, **reader.rest())
        if (max_batch is None) == (table is None):
            given = "both" if table is not None else "neither"
            raise UserError(f"policy {self.name}: give exactly one of parameters max_batch, table (got {given})")
        self.table: tuple[tuple[int, int, int], ...] = (
            ((0, max_batch, self.k),) if max_batch is not None else parse_table(reader, table, self.k))
        """Inclusive request-count ranges and their k, sorted and disjoint."""
        self.stationary = self.count == "running"  # the queue length changes k only with count=total
        self.by_count = self.stationary
        """:meth:`propose` is :meth:`k_by_count` for everyone (the simulator may ask that instead: a speed
        shortcut); not with count=total, which adds the queue."""

    def k_for(self, count: int) -> int:
        """Proposal length when ``count`` requests are counted (0 outside every range)."""
        for start, end, k in self.table:
            if start <= count <= end:
                return k
        return 0

    def k_by_count(self, batch_size: int, max_k: int) -> int:
        """The k every request proposes when ``batch_size`` run (with count=running) and at most ``max_k`` may be."""
        return min(self.k_for(batch_size), max_k)

    def propose(self, view: BatchView) -> np.ndarray:
        count = view.batch_size + (view.num_waiting if self.count == "total" else 0)
        return np.full(view.batch_size, min(self.k_for(count), view.max_k), dtype=np.int64)


def parse_table(reader: ParamReader, value: Any, k_max: int) -> tuple[tuple[int, int, int], ...]:
    """``"start-end:k,..."`` or ``[[start, end, k], ...]`` -> sorted disjoint ranges; k must not exceed ``k_max``."""
    if isinstance(value, str):
        rows = []
        for entry in value.split(","):
            span, sep, k = entry.partition(":")
            start, dash, end = span.partition("-")
            if not sep or not dash:
                raise reader.error("table", "entries must look like start-end:k", entry.strip())
            rows.append((entry.strip(), (start, end, k)))
    elif isinstance(value, (list, tuple)) and all(isinstance(r, (list, tuple)) and len(r) == 3 for r in value):
        rows = [(str(list(r)), tuple(r)) for r in value]
    else:
        raise reader.error("table", "must be 'start-end:k,...' or a list of [start, end, k]", value)
    table = []
    for shown, fields in rows:
        try:
            start, end, k = (int(str(x).strip()) for x in fields)
        except ValueError:
            raise reader.error("table", "entries must be integers start-end:k", shown) from None
        if not 0 <= start <= end:
            raise reader.error("table", "ranges need 0 <= start <= end", shown)
        if not 0 <= k <= k_max:
            raise reader.error("table", f"k must be in [0, {k_max}] (the configured k bounds it)", shown)
        table.append((start, end, k))
    table.sort()
    for (_, end, _), (start, _, _) in zip(table, table[1:]):
        if start <= end:
            raise reader.error("table", "ranges overlap", value)
    return tuple(table)
