"""Sweeps: a grid of independent runs (rate x policy x seed x any config field) run in parallel.

Each cell is one resolved :class:`SimConfig`, keyed by :func:`config_hash`. The cells run on an executor
(:mod:`simulator.studies.executors`: local worker processes or a Dask cluster). A finished cell is written at
once and atomically to ``DIR/runs/<hash>.json`` (its summary row), so a sweep killed half-way and started
again runs only the missing cells. ``DIR/summary.csv`` (one row per cell, tidy) is rebuilt from those
files and written atomically when the grid is done; a sweep that has cells left to run deletes an older
``summary.csv`` before it starts, so the file exists only when it describes a finished grid: a sweep
killed half-way leaves ``runs/`` and no summary.

Policy specs: ``name`` or ``name:k`` (``fixed-k:3`` is fixed-k with k = 3; ``goodput`` uses the base k as
K_max; parsed by :mod:`simulator.studies.specs`). The ``policy`` column holds the spec as given, so each line of
a figure is one spec.

:func:`sweep_and_plot` is the study the ``sweep``, ``tune`` and ``demo`` commands share: the grid, its summary and
its figures.
"""
from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from simulator.config import SimConfig, config_hash
from policies.errors import UserError
from simulator.results import write_csv, write_json
from simulator.studies.executors import Executor, make_executor
from simulator.studies.specs import parse_policy_spec

__all__ = ["Cell", "build_cells", "print_table", "progress_bar", "run_cell", "run_sweep", "sweep_and_plot"]


@dataclass(frozen=True)
class Cell:
    """One run of a sweep: its labels (policy spec, rate, seed, grid values) and its resolved config."""

    labels: tuple[tuple[str, Any], ...]
    config: SimConfig

    @property
    def key(self) -> str:
        return config_hash(self.config)


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
    from simulator.core.runner import run_simulation

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


def progress_bar(quiet: bool) -> Callable[[int, int], None] | None:
    """Sweep progress on stderr, as ``progress(done, total)``: one line saying how many cells an earlier,
    interrupted sweep already finished, then a tqdm bar (runs done / total, rate, ETA) when stderr is a
    terminal. ``quiet``: nothing."""
    if quiet:
        return None
    from tqdm import tqdm

    bar: tqdm | None = None

    def show(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            if done:
                print(f"{done} of {total} cells already done; running the other {total - done}", file=sys.stderr)
            bar = tqdm(total=total, initial=done, unit="run", desc="sweep", file=sys.stderr,
                       disable=not sys.stderr.isatty())
        else:
            bar.update(done - bar.n)
        if done == total:
            bar.close()

    return show


def sweep_and_plot(base: SimConfig, policies: list[str], rates: list[float], seeds: list[int],
                   grid: dict[str, list[Any]], out_dir: str | Path, workers: int, cluster: str | None = None,
                   cluster_flag: str = "--cluster", quiet: bool = False) -> tuple[pd.DataFrame, list[str]]:
    """Run the sweep grid into ``out_dir`` (on ``workers`` local processes, or the Dask scheduler at ``cluster``,
    which ``cluster_flag`` named) and draw its figures; return (summary, figure paths)."""
    from simulator.core.runner import run_simulation
    from simulator.studies import plots

    for rate in rates:
        if rate <= 0:
            raise UserError(f"--rates: every rate must be > 0, got {rate:g}")
    cells = build_cells(base, rates, policies, seeds, grid)
    with make_executor(workers, cluster, cluster_flag) as executor:
        summary = run_sweep(cells, out_dir, executor, progress_bar(quiet))
    out = Path(out_dir)
    figures = [plots.plot_latency_vs_rate(summary, out / "latency_vs_rate.png")]
    if "no-spec" in set(summary["policy"]):
        figures.append(plots.plot_speedup(summary, out / "speedup.png"))
    # the k-over-time figure follows goodput if the sweep has it, else the first other non-static policy
    adaptive = sorted((p for p in policies if parse_policy_spec(p)[0] not in plots.STATIC),
                      key=lambda p: parse_policy_spec(p)[0] != "goodput")
    if adaptive:
        rate = rates[len(rates) // 2]
        name, k, params = parse_policy_spec(adaptive[0])
        config = base.replace(rate=rate, policy=name, seed=seeds[0], save_steps=True,
                              k=base.k if k is None else k, policy_params=base.policy_params + params)
        steps = run_simulation(config).steps
        write_csv(out / "steps_adaptive.csv", steps.assign(policy=adaptive[0], rate=rate))
        figures.append(plots.plot_k_over_time(steps, out / "k_over_time.png", f"{adaptive[0]} at {rate:g} req/s"))
    return summary, figures


def print_table(summary: pd.DataFrame, column: str = "mean_latency") -> None:
    """Rates down, policies across: ``column`` averaged over seeds."""
    table = summary.groupby(["rate", "policy"], sort=False)[column].mean().unstack("policy")
    print(f"{column} (s), seeds averaged; rows: request rate (req/s)")
    print(table.to_string(float_format=lambda v: f"{v:9.3f}"))
