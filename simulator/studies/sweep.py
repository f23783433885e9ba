"""Sweeps: a grid of independent runs (rate x policy x seed x any config field) run in parallel.

Each cell is one resolved :class:`SimConfig`, keyed (:attr:`Cell.key`) by the config, the *content* of every input
file it names (profile and its metadata, policy profile, trace, length file, acceptance trace, policy file) and the
code version (a hash of the simulator's and the policies' source files): editing a profile in place, or the code,
makes new cells, never a stale answer. The cells run on an executor (:mod:`simulator.studies.executors`: local
worker processes, which die with the sweep, or a Dask cluster). A finished cell is written at once and atomically
to ``DIR/runs/<key>.json`` (its summary row), so a sweep killed half-way and started again runs only the missing
cells, and says how many it reused; a runs file that is empty, corrupt or of another cell is run again.
``DIR/summary.csv`` (one row per cell, tidy) is rebuilt from those files and written atomically when the grid is
done; a sweep that has cells left to run deletes an older ``summary.csv`` before it starts, so the file exists only
when it describes a finished grid. The folder is locked while a sweep writes into it (a second sweep into it is
refused), and temporary files a killed sweep left are removed. The Python warnings a run prints (a cost model asked
far beyond its grid, a user policy's own) are recorded in its row (:func:`run_cell`; not in ``summary.csv``) and said
once by :func:`sweep_and_plot`, each with the runs it came from, whatever process ran them (:func:`cell_warnings`).

Columns: the labels (``policy`` as given, ``rate``, ``seed``, then one column per ``--grid`` axis named after its
field), then the summary figures. A grid axis whose field shares its name with a summary figure (``acceptance_rate``,
the measured one) is named ``config_<field>`` (``config_acceptance_rate``): a config value and a measured figure
never share a column. Tables and figures keep every axis (:func:`print_table`, :mod:`simulator.studies.plots`).

Policy specs: ``name`` or ``name:k`` (``fixed-k:3`` is fixed-k with k = 3; ``goodput`` uses the base k as
K_max; parsed by :mod:`simulator.studies.specs`). The ``policy`` column holds the spec as given, so each line of
a figure is one spec (and one combination of the grid axes).

:func:`sweep_and_plot` is the study the ``sweep``, ``tune`` and ``demo`` commands share: the grid, its summary and
its figures.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pandas as pd

from simulator.config import SimConfig, config_hash
from policies.errors import UserError
from simulator.results import write_csv, write_json
from simulator.studies.executors import Executor, make_executor
from simulator.studies.specs import axis_column, parse_policy_spec, summary_names  # noqa: F401

__all__ = ["Cell", "build_cells", "crossings", "crossovers", "payoff_lines", "payoff_words", "print_table", "progress_bar",
           "run_cell", "run_sweep", "sweep_and_plot"]


#: Config fields naming input files, and the flag of each (for messages).
INPUT_FILES = {"profile": "--profile", "policy_profile": "--policy-profile", "trace": "--trace",
               "length_file": "--length-file", "acceptance_trace": "--acceptance-trace", "policy_file": "--policy-file"}


@functools.cache
def code_version() -> str:
    """A hash of the simulator's and the policies' source files (what a cell's result depends on)."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in ("simulator", "policies"):
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _file_digest(path: str, flag: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except IsADirectoryError:
        raise UserError(f"{flag} {path}: is a folder, not a file") from None
    except FileNotFoundError:
        raise UserError(f"{flag} {path}: file not found") from None
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot read the file ({exc.strerror or exc})") from None


def input_digests(config: SimConfig) -> dict[str, str]:
    """The content hash of every input file ``config`` names (a profile CSV with its ``.meta.json``)."""
    from simulator.fleet.fleet import resolve_profile

    out = {}
    values = config.flat()
    named = [(name, values[name], flag) for name, flag in INPUT_FILES.items()]
    named += [(f"replica_profile_{j}", resolve_profile(entry), "--replicas")  # a mixed fleet's profiles
              for j, entry in enumerate(config.fleet.replica_profiles)]
    for name, path, flag in named:
        if path is None:
            continue
        out[name] = _file_digest(path, flag)
        if (name in ("profile", "policy_profile") or name.startswith("replica_profile_")) and \
                Path(path).suffix.lower() == ".csv":
            meta = Path(path).with_name(Path(path).stem + ".meta.json")
            out[name + "_meta"] = _file_digest(str(meta), flag) if meta.is_file() else ""
    return out


def cell_key(config: SimConfig, digests: dict[str, str] | None = None) -> str:
    """The key of a cell: config, input file contents and code version (16 hex digits)."""
    blob = json.dumps({"config": config.to_dict(), "inputs": input_digests(config) if digests is None else digests,
                       "code": code_version()}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Cell:
    """One run of a sweep: its labels (policy spec, rate, seed, grid values), its resolved config and its key
    (:func:`cell_key`; computed once, when the cell is built)."""

    labels: tuple[tuple[str, Any], ...]
    config: SimConfig
    key: str = ""


def build_cells(base: SimConfig, rates: list[float], policies: list[str], seeds: list[int],
                grid: dict[str, list[Any]] | None = None) -> list[Cell]:
    """The full grid, in a fixed order (rate, policy, seed, then the grid axes)."""
    grid = grid or {}
    axes = list(grid)
    cells = []
    digests: dict[tuple, dict[str, str]] = {}
    for rate, spec, seed, *values in itertools.product(rates, policies, seeds, *(grid[a] for a in axes)):
        name, k, params = parse_policy_spec(spec)
        changes = dict(zip(axes, values))
        changes.update(rate=rate, policy=name, seed=seed, save_steps=False)
        if k is not None:
            changes["k"] = k
        if params:
            changes["policy_params"] = base.speculative.policy_params + params
        labels = (("policy", spec), ("rate", rate), ("seed", seed), *zip(map(axis_column, axes), values))
        config = base.replace(**changes)
        values = config.flat()
        files = (*(values[name] for name in INPUT_FILES), config.fleet.replica_profiles)
        if files not in digests:
            digests[files] = input_digests(config)
        cells.append(Cell(labels, config, cell_key(config, digests[files])))
    return cells


def run_cell(cell: Cell) -> dict[str, Any]:
    """Run one cell and return its summary row (labels first, then the summary figures)."""
    from simulator.fleet import run as run_config

    with recorded_warnings(show=False) as caught:  # sweep_and_plot says them once, with the runs they came from
        summary = run_config(cell.config).summary
    row = dict(cell.labels)
    row.update({k: v for k, v in summary.items() if k not in row and k not in ("policy", "ignored_request_ids")})
    row["policy_name"] = cell.config.speculative.policy
    row["config_hash"] = config_hash(cell.config)
    row["cell_key"] = cell.key
    row["warnings"] = caught
    return row


@contextlib.contextmanager
def recorded_warnings(show: bool = True) -> Iterator[list[str]]:
    """Record the Python warnings raised inside the block, each distinct message once, in order (every one, however
    often the same code warned before in this process: the same run records the same list); ``show``: print each
    on stderr as Python does, the first time."""
    seen: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' hook
            text = str(message)
            if text in seen:
                return
            seen.append(text)
            if show:
                original(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        yield seen


def cell_messages(summary: pd.DataFrame) -> list[list[str]]:
    """Per row of a sweep's summary, the Python warnings its run printed (:func:`run_cell`; kept in
    ``summary.attrs['warnings']`` by :func:`run_sweep`, not in ``summary.csv``); none for a frame cut from it."""
    rows = summary.attrs.get("warnings") or []
    return rows if len(rows) == len(summary) else [[] for _ in range(len(summary))]


def describe_cells(frame: pd.DataFrame) -> str:
    """The cells of ``frame`` as ``POLICY at RATE req/s``, sorted, at most eight named."""
    shown = sorted({f"{p} at {r:g} req/s" for p, r in zip(frame["policy"], frame["rate"])})
    return ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else "")


def cell_warnings(summary: pd.DataFrame, label: str = "") -> list[str]:
    """Each distinct Python warning the sweep's runs printed, once, with how many runs and which gave it."""
    messages: dict[str, list[int]] = {}
    for i, row in enumerate(cell_messages(summary)):
        for message in row:
            messages.setdefault(message, []).append(i)
    return [f"{label}{message} (in {len(rows)} of {len(summary)} runs: {describe_cells(summary.iloc[rows])})"
            for message, rows in messages.items()]


def read_done(path: Path, cell: Cell) -> dict[str, Any] | None:
    """The row of ``cell`` saved at ``path``, or None when the file is missing, empty, corrupt or another cell's
    (such a file is removed, and the cell runs again)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"{path}: cannot read a finished cell ({exc.strerror or exc})") from None
    try:
        row = json.loads(text)
    except ValueError:
        row = None
    if isinstance(row, dict) and row.get("cell_key") == cell.key and "mean_latency" in row:
        return row
    path.unlink(missing_ok=True)
    return None


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
    rows: dict[str, dict[str, Any]] = {}
    for cell in cells:
        row = read_done(runs / f"{cell.key}.json", cell)
        if row is not None:
            rows[cell.key] = row
    todo = [c for c in cells if c.key not in rows]
    finished = len(cells) - len(todo)
    if todo:
        (out / "summary.csv").unlink(missing_ok=True)
    if progress:
        progress(finished, len(cells))
    for row in executor.map_unordered(run_cell, todo):
        write_json(runs / f"{row['cell_key']}.json", row)
        rows[row["cell_key"]] = row
        finished += 1
        if progress:
            progress(finished, len(cells))
    frame = pd.DataFrame([{k: v for k, v in rows[cell.key].items() if k != "warnings"} for cell in cells])
    write_csv(out / "summary.csv", frame)
    frame.attrs["warnings"] = [list(rows[cell.key].get("warnings") or []) for cell in cells]
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
                print(f"{done} of {total} cells already done; running the other {total - done}\n"
                      f"reused {done} cells from runs/: same config, input file contents and code version",
                      file=sys.stderr)
            bar = tqdm(total=total, initial=done, unit="run", desc="sweep", file=sys.stderr,
                       disable=not sys.stderr.isatty())
        else:
            bar.update(done - bar.n)
        if done == total:
            bar.close()

    return show


def sweep_and_plot(base: SimConfig, policies: list[str], rates: list[float], seeds: list[int],
                   grid: dict[str, list[Any]], out_dir: str | Path, workers: int, cluster: str | None = None,
                   cluster_flag: str = "--cluster", quiet: bool = False,
                   finish: Callable[[pd.DataFrame, list[str]], None] | None = None,
                   kind: str = "sweep") -> tuple[pd.DataFrame, list[str]]:
    """Run the sweep grid into ``out_dir`` (on ``workers`` local processes, or the Dask scheduler at ``cluster``,
    which ``cluster_flag`` named) and draw its figures; return (summary, figure paths). ``finish(summary,
    figures)`` runs last, the folder still locked (the command's own tables and its ``report.html``); an older
    ``report.html`` is removed first, so a killed sweep leaves none. ``kind``: the result the folder holds
    (:data:`simulator.results.RESULT_KINDS`: a ``sweep``, or a ``tune`` with its own tables)."""
    from simulator.results import prepare_out_dir

    for rate in rates:
        if not rate > 0:
            raise UserError(f"--rates: every rate must be > 0, got {rate:g}")
    if not policies:
        raise UserError("--policies: no policy given")
    cells = build_cells(base, rates, policies, seeds, grid)
    check_policies(cells)
    out, lock = prepare_out_dir(out_dir, kind)
    with lock:
        (out / "report.html").unlink(missing_ok=True)  # an older run's (simulator.studies.report.remove_report)
        with make_executor(workers, cluster, cluster_flag) as executor:
            summary = run_sweep(cells, out, executor, progress_bar(quiet))
        for message in cell_warnings(summary):  # the runs recorded them quietly: said here once, with their cells
            print(f"warning: {message}", file=sys.stderr)
        figures = _figures(base, policies, rates, seeds, summary, out, [axis_column(a) for a in grid])
        if finish is not None:
            finish(summary, figures)
    return summary, figures


def check_policies(cells: list[Cell]) -> None:
    """Every policy spec of the grid names a known policy with valid parameters (a user's policy file loaded
    first): a bad spec stops the sweep before any cell runs, not in a worker half-way."""
    from policies.registry import load_policy_file, make_policy
    from simulator.core.user_policy import Watch

    seen, loaded = set(), set()
    for cell in cells:
        c = cell.config.speculative
        key = (c.policy, c.k, c.policy_params, c.policy_file)
        if key in seen:
            continue
        seen.add(key)
        if c.policy_file is None:
            make_policy(c.policy, c.k, dict(c.policy_params))
            continue
        watch = Watch(c.policy_file)
        with watch.armed():
            if c.policy_file not in loaded:
                loaded.add(c.policy_file)
                watch.call("importing it", load_policy_file, c.policy_file)
            watch.call(f"policy {c.policy}: the constructor", make_policy, c.policy, c.k, dict(c.policy_params))


def _figures(base: SimConfig, policies: list[str], rates: list[float], seeds: list[int], summary: pd.DataFrame,
             out: Path, axes: list[str]) -> list[str]:
    from simulator.fleet import run as run_config
    from simulator.studies import plots

    figures = [plots.plot_latency_vs_rate(summary, out / "latency_vs_rate.png", axes)]
    if "no-spec" in set(summary["policy"]):
        figures.append(plots.plot_speedup(summary, out / "speedup.png", axes))
    # the k-over-time figure follows goodput if the sweep has it, else the first other non-static policy
    adaptive = sorted((p for p in policies if parse_policy_spec(p)[0] not in plots.STATIC),
                      key=lambda p: parse_policy_spec(p)[0] != "goodput")
    if adaptive:
        rate = rates[len(rates) // 2]
        name, k, params = parse_policy_spec(adaptive[0])
        config = base.replace(rate=rate, policy=name, seed=seeds[0], save_steps=True,
                              k=base.speculative.k if k is None else k,
                              policy_params=base.speculative.policy_params + params)
        steps = run_config(config).steps
        write_csv(out / "steps_adaptive.csv", steps.assign(policy=adaptive[0], rate=rate))
        figures.append(plots.plot_k_over_time(steps, out / "k_over_time.png", f"{adaptive[0]} at {rate:g} req/s"))
    return figures


#: The metrics a sweep's table may show: summary column -> (what it is, its unit, the factor from the column's).
TABLE_METRICS = {"mean_latency": ("mean latency", "s", 1.0),
                 "mean_norm_latency": ("mean normalised latency", "ms per output token", 1e3)}
#: What a sweep prints and where each policy stops paying is read from: the metric of its figure's first panel
#: (:func:`simulator.studies.plots.plot_latency_vs_rate`).
SWEEP_METRIC = "mean_norm_latency"


def print_table(summary: pd.DataFrame, column: str = SWEEP_METRIC, axes: list[str] | None = None) -> None:
    """Rates (and every grid axis) down, policies across: ``column`` (:data:`TABLE_METRICS`) averaged over seeds only,
    in its unit. ``axes``: the grid fields; None: found in the summary's columns (:func:`plots.grid_axes`)."""
    from simulator.studies.plots import grid_axes

    axes = grid_axes(summary) if axes is None else [axis_column(a) for a in axes]
    what, unit, scale = TABLE_METRICS[column]
    table = summary.groupby(["rate", *axes, "policy"], sort=False, dropna=False)[column].mean().unstack("policy")
    rows = ", ".join(["request rate (req/s)", *axes])
    print(f"{what} ({unit}), seeds averaged; rows: {rows}")
    print((table * scale).to_string(float_format=lambda v: f"{v:9.3f}"))


# -- where speculation stops paying ------------------------------------------------------------------------------
def crossings(rates: Sequence[float], ratio: Sequence[float]) -> list[tuple[float, bool]]:
    """Where a policy's latency over the baseline's, ``ratio`` at each of ``rates`` (ascending), crosses 1: each
    crossing's rate, linear in the ratio between the two swept rates around it, and whether the policy pays from there
    on (True: from slower, ratio > 1, to no slower)."""
    out = []
    for i in range(1, len(rates)):
        r0, r1 = ratio[i - 1], ratio[i]
        if (r0 > 1.0) != (r1 > 1.0):
            out.append((rates[i - 1] + (1.0 - r0) / (r1 - r0) * (rates[i] - rates[i - 1]), r0 > 1.0))
    return out


def crossovers(table: pd.DataFrame, saturation: float = 1.0, baseline: str = "no-spec") -> dict[str, float]:
    """For each other policy of ``table`` (rates down, policies across: :func:`simulator.studies.demo.mean_table`),
    the rate, over ``saturation`` (1: in req/s), at which its latency first rises above ``baseline``'s
    (:func:`crossings`). NaN when it never does up to the highest rate; 0 when it is already above at the lowest."""
    rates = table.index.to_numpy(float)
    return {policy: stop_load(rates, (table[policy] / table[baseline]).to_numpy(float)) / saturation
            for policy in table.columns if policy != baseline}


def stop_load(loads: Sequence[float], ratio: Sequence[float], level: float = 1.0) -> float:
    """The load from which a policy's speed-up over the baseline, 1 / ``ratio`` (``ratio``: its latency over the
    baseline's at each of ``loads``, ascending), first falls below ``level``: 0.0 when it is below already at the
    lightest load, NaN when it never falls below up to the heaviest (:func:`crossings` of ``ratio`` x ``level``)."""
    scaled = [r * level for r in ratio]  # speed-up < level <=> ratio x level > 1
    if scaled[0] > 1.0:
        return 0.0
    falls = [load for load, pays in crossings(loads, scaled) if not pays]
    return falls[0] if falls else math.nan


def payoff_words(rates: Sequence[float], ratio: Sequence[float], show: Callable[[float], str],
                 baseline: str = "no-spec") -> str:
    """Where a policy pays against ``baseline`` over the swept ``rates``, in words (``ratio``: its latency over the
    baseline's at each rate; ``show`` writes a rate): "pays at every rate swept, up to R", "pays at no rate swept:
    slower than no-spec already at R, the lightest load swept", or the stretches between its :func:`crossings` ("pays
    up to about R, slower than no-spec from there")."""
    slower = f"slower than {baseline}"
    cross = crossings(rates, ratio)
    pays = not ratio[0] > 1.0
    if not cross:
        return (f"pays at every rate swept, up to {show(rates[-1])}" if pays else
                f"pays at no rate swept: {slower} already at {show(rates[0])}, the lightest load swept")
    verb = {True: "pays", False: slower}
    parts = [f"{verb[pays]} up to about {show(cross[0][0])}"]
    for (start, state), (end, _) in zip(cross, cross[1:]):
        parts.append(f"{verb[state]} from about {show(start)} to about {show(end)}")
    parts.append(f"{verb[cross[-1][1]]} from there" if len(cross) == 1 else
                 f"{verb[cross[-1][1]]} from about {show(cross[-1][0])}")
    return ", ".join(parts)


def payoff_lines(summary: pd.DataFrame, column: str = SWEEP_METRIC, axes: list[str] | None = None,
                 baseline: str = "no-spec") -> list[str]:
    """Where each policy of a sweep stops paying against ``baseline`` (:func:`payoff_words`, on ``column`` averaged
    over seeds), one line per policy and combination of the grid ``axes``; none without the baseline."""
    from simulator.studies.plots import grid_axes

    axes = grid_axes(summary) if axes is None else [axis_column(a) for a in axes]
    lines = []
    groups = summary.groupby(axes, sort=False, dropna=False) if axes else [((), summary)]
    for values, part in groups:
        table = part.groupby(["rate", "policy"])[column].mean().unstack("policy").sort_index()
        if baseline not in table.columns:
            continue
        where = " ".join(f"{a}={v}" for a, v in zip(axes, values if isinstance(values, tuple) else (values,)))
        for policy in (p for p in table.columns if p != baseline):
            ratio = (table[policy] / table[baseline]).dropna()
            if len(ratio):
                words = payoff_words(ratio.index.to_numpy(float), ratio.to_numpy(float), lambda r: f"{r:.3g} req/s",
                                     baseline)
                lines.append(f"{policy}{' at ' + where if where else ''}: {words}")
    return lines
