"""Sweeps: a grid of independent runs (rate x policy x seed x any config field) run in parallel.

Each cell is one resolved :class:`SimConfig`, keyed by :func:`config_hash`. The cells run on an executor
(:mod:`simulator.executors`: local worker processes or a Dask cluster). A finished cell is written at
once and atomically to ``DIR/runs/<hash>.json`` (its summary row), so a sweep killed half-way and started
again runs only the missing cells. ``DIR/summary.csv`` (one row per cell, tidy) is rebuilt from those
files and written atomically when the grid is done; a sweep that has cells left to run deletes an older
``summary.csv`` before it starts, so the file exists only when it describes a finished grid: a sweep
killed half-way leaves ``runs/`` and no summary.

Policy specs: ``name`` or ``name:k`` (``fixed-k:3`` is fixed-k with k = 3; ``goodput`` uses the base k as
K_max). The ``policy`` column holds the spec as given, so each line of a figure is one spec.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from simulator.config import SimConfig, config_hash
from simulator.errors import UserError
from simulator.executors import Executor
from simulator.results import write_csv, write_json

__all__ = ["Cell", "build_cells", "parse_grid", "parse_policy_spec", "run_cell", "run_sweep"]


@dataclass(frozen=True)
class Cell:
    """One run of a sweep: its labels (policy spec, rate, seed, grid values) and its resolved config."""

    labels: tuple[tuple[str, Any], ...]
    config: SimConfig

    @property
    def key(self) -> str:
        return config_hash(self.config)


def parse_policy_spec(spec: str) -> tuple[str, int | None, tuple[tuple[str, Any], ...]]:
    """``NAME[:K][/PARAM=VALUE...]`` -> (name, k or None, params).

    ``"fixed-k:3"`` -> ("fixed-k", 3, ()); ``"threshold:3/max_batch=16"`` -> ("threshold", 3, (("max_batch", 16),)).
    """
    from simulator.cli import parse_policy_params

    head, *raw_params = spec.split("/")
    name, sep, k = head.partition(":")
    if not name:
        raise UserError(f"--policies: bad policy spec {spec!r} (expected NAME[:K][/PARAM=VALUE...])")
    try:
        k_value = int(k) if sep else None
    except ValueError:
        raise UserError(f"--policies: bad policy spec {spec!r} (K must be an integer)") from None
    return name, k_value, parse_policy_params(raw_params)


def parse_grid(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["acceptance_rate=0.5,0.7"]`` -> {"acceptance_rate": [0.5, 0.7]} (values typed like the field)."""
    from simulator.cli import parse_field_value

    known = {f.name for f in fields(SimConfig)}
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not values:
            raise UserError(f"--grid: expected FIELD=V1,V2,..., got {item!r}")
        if name not in known:
            raise UserError(f"--grid: unknown config field {name!r}")
        if name in ("rate", "policy", "seed", "k"):
            raise UserError(f"--grid: {name} has its own flag (--rates, --policies, --seeds)")
        grid[name] = [parse_field_value(name, v) for v in values.split(",")]
    return grid


def build_cells(base: SimConfig, rates: list[float], policies: list[str], seeds: list[int],
                grid: dict[str, list[Any]] | None = None) -> list[Cell]:
    """The full grid, in a fixed order (rate, policy, seed, then the grid axes)."""
    grid = grid or {}
    axes = list(grid)
    cells = []
    for rate, spec, seed, *values in itertools.product(rates, policies, seeds, *(grid[a] for a in axes)):
        name, k, params = parse_policy_spec(spec)
        changes = dict(zip(axes, values))
        changes.update(rate=rate, policy=name, seed=seed, save_steps=False)
        if k is not None:
            changes["k"] = k
        if params:
            changes["policy_params"] = base.policy_params + params
        labels = (("policy", spec), ("rate", rate), ("seed", seed), *zip(axes, values))
        cells.append(Cell(labels, base.replace(**changes)))
    return cells


def run_cell(cell: Cell) -> dict[str, Any]:
    """Run one cell and return its summary row (labels first, then the summary figures)."""
    from simulator.runner import run_simulation

    summary = run_simulation(cell.config).summary
    row = dict(cell.labels)
    row.update({k: v for k, v in summary.items() if k not in row and k != "policy"})
    row["policy_name"] = cell.config.policy
    row["config_hash"] = cell.key
    return row


def run_sweep(cells: list[Cell], out_dir: str | Path, executor: Executor,
              progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Run the cells not already done in ``out_dir`` on ``executor``; write ``summary.csv``; return it.

    Each finished cell is written at once to ``runs/<hash>.json``. When cells are left to run, a
    ``summary.csv`` from an earlier sweep into the same folder is removed first, so the file exists only
    while it describes a finished grid. ``progress(done, total)`` is called before the first run (with
    the cells already done) and after each one.
    """
    out = Path(out_dir)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    done = {p.stem for p in runs.glob("*.json")}
    todo = [c for c in cells if c.key not in done]
    finished = len(cells) - len(todo)
    if todo:
        (out / "summary.csv").unlink(missing_ok=True)
    if progress:
        progress(finished, len(cells))
    for row in executor.map_unordered(run_cell, todo):
        write_json(runs / f"{row['config_hash']}.json", row)
        finished += 1
        if progress:
            progress(finished, len(cells))
    frame = pd.DataFrame([json.loads((runs / f"{cell.key}.json").read_text()) for cell in cells])
    write_csv(out / "summary.csv", frame)
    return frame
