"""Figures from result DataFrames only, so any figure can be redrawn without rerunning.

Every figure a reader can trust: one colour and one marker per policy in every figure the project draws (demo, sweep,
compare, tune, validate, notebooks: :func:`policy_style`, fixed by the policy, not by its order in a sweep; series of
one policy told apart by line style, :func:`policy_styles`), the spread over seeds drawn as a band (min to max) around
the seed mean when a sweep has several seeds, plain-number ticks on every log axis (``60``, not ``6x10^1``:
:func:`plain_log_ticks`), integer ticks on integer axes and a unit on every axis (:func:`finish_axis`), legends
outside the data.

- :func:`plot_latency_vs_rate`: mean and p99 normalised latency (s/token) versus request rate, one line
  per policy spec, with the best static choice (the lowest of no-spec and every fixed k at each rate)
  drawn as a broad grey line for reference (:data:`ENVELOPE_STYLE`).
- :func:`plot_speedup`: mean-latency speedup over no-spec versus rate.
- :func:`plot_k_over_time`: the k an adaptive policy chose, step by step, at one rate.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (whose inline backend draws a notebook's own figures)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


if not _in_notebook():  # files only, no display needed; a notebook keeps its inline backend (figures saved here close)
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

STATIC = ("no-spec", "fixed-k")
#: Columns ``plot DIR`` needs in a sweep's summary.csv and steps_adaptive.csv (name -> number or text).
SUMMARY_COLUMNS = {"policy": "text", "policy_name": "text", "rate": "number", "mean_norm_latency": "number",
                   "p99_norm_latency": "number", "mean_latency": "number"}
STEPS_COLUMNS = {"policy": "text", "rate": "number", "start_time": "number", "k_max": "number",
                 "batch_size": "number", "kind": "text"}
#: Label columns that are not grid axes.
_NOT_AXES = {"policy", "rate", "seed", "k", "policy_name"}


#: The built-in policies' colour and marker, by style key (:func:`style_key`): no-spec, each fixed k from 1 to 7,
#: fixed k without a k (the config's), goodput and threshold. Any other key gets both from a stable hash of its text.
POLICY_STYLES = {"no-spec": ("black", "s"), "fixed-k:1": ("tab:blue", "v"), "fixed-k:2": ("tab:cyan", "<"),
                 "fixed-k:3": ("tab:green", "^"), "fixed-k:4": ("tab:olive", ">"), "fixed-k:5": ("tab:purple", "D"),
                 "fixed-k:6": ("tab:brown", "p"), "fixed-k:7": ("tab:pink", "h"), "fixed-k": ("tab:gray", "d"),
                 "goodput": ("tab:red", "o"), "threshold": ("tab:orange", "P")}
POLICY_COLORS = {key: color for key, (color, _) in POLICY_STYLES.items()}
#: Colours and markers of any other policy (a user's, or fixed k above 7), none of them a built-in's colour.
_PALETTE = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#1f78b4", "#b15928",
            "#6a3d9a", "#01665e", "#8c510a"]
_MARKERS = ["*", "X", "8", "H", "o", "s", "^", "D"]
#: Line styles of the series that share a policy's colour and marker in one figure (goodput:3 and goodput:5, one policy
#: at two values of a grid axis), in :func:`policy_styles`' order.
_LINESTYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 3))]
#: The best-static envelope, the same in every figure that draws one: a broad grey line under the policies'.
ENVELOPE_STYLE = {"color": "0.5", "lw": 4.0, "alpha": 0.35, "ls": "-", "zorder": 1}


def style_key(series: str) -> str:
    """What decides a series' colour and marker: its policy spec (a series named ``SPEC axis=value ...``: the first
    word), reduced to the policy's name, except fixed k, whose k is what tells its policies apart:
    ``"goodput:5"``, ``"goodput:2/bonus=1.3 acceptance_rate=0.5"`` -> ``"goodput"``; ``"fixed-k:3/max_batch=16"``
    -> ``"fixed-k:3"``; ``"threshold:3"`` -> ``"threshold"``."""
    words = str(series).split()
    head = (words[0] if words else "").split("/")[0]
    name, sep, k = head.partition(":")
    if name == "fixed-k" and sep:
        return f"fixed-k:{int(k)}" if k.strip().isdigit() else head
    return name


def policy_style(series: str) -> dict:
    """``{"color": ..., "marker": ...}`` of a policy spec or a series named after one (:func:`style_key` decides),
    the same in every figure the project draws: fixed for the built-in policies (:data:`POLICY_STYLES`), else from a
    stable hash of the key (never Python's salted ``hash``, never the order of plotting). Pass it to ``ax.plot`` as
    ``**policy_style(spec)``; a bar takes its ``["color"]``."""
    import hashlib

    key = style_key(series)
    if key in POLICY_STYLES:
        color, marker = POLICY_STYLES[key]
    else:
        digest = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
        color, marker = _PALETTE[digest % len(_PALETTE)], _MARKERS[(digest // len(_PALETTE)) % len(_MARKERS)]
    return {"color": color, "marker": marker}


def policy_color(series: str) -> str:
    """The colour of :func:`policy_style`."""
    return policy_style(series)["color"]


def _natural(text: str) -> tuple:
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def policy_styles(series: list[str]) -> dict[str, dict]:
    """For each of one figure's ``series``: :func:`policy_style` and a ``linestyle`` that tells apart the series sharing
    a colour and marker (the first of them, in natural order of their names, solid; then dashed, dotted, ...)."""
    out: dict[str, dict] = {}
    groups: dict[str, list[str]] = {}
    for name in dict.fromkeys(map(str, series)):
        groups.setdefault(style_key(name), []).append(name)
    for names in groups.values():
        for i, name in enumerate(sorted(names, key=_natural)):
            out[name] = {**policy_style(name), "linestyle": _LINESTYLES[i % len(_LINESTYLES)]}
    return {str(name): out[str(name)] for name in series}


def plain_number(value: float) -> str:
    """A tick label as a plain number: ``60``, ``0.002``, ``2.5``, ``1000000`` (never ``6x10^1`` nor ``1e+06``)."""
    import numpy as np

    if value == 0 or not np.isfinite(value):
        return f"{value:g}"
    return np.format_float_positional(float(f"{value:.4g}"), trim="-")


def _log_majors():
    """Major ticks of a log axis: 1, 2 and 5 times each power of ten over up to two decades, powers of ten over more
    (labels that do not run into each other)."""
    import math

    from matplotlib.ticker import LogLocator

    class PlainLogLocator(LogLocator):
        def tick_values(self, vmin, vmax):
            lo, hi = sorted((vmin, vmax))
            span = math.log10(hi / lo) if lo > 0 and math.isfinite(hi / lo) else math.inf
            self.set_params(subs=(1.0, 2.0, 5.0) if span <= 2.0 else (1.0,))
            return super().tick_values(vmin, vmax)

    return PlainLogLocator(base=10, subs=(1.0, 2.0, 5.0))


def plain_log_ticks(ax, axis: str = "y") -> None:
    """Make ``axis`` (``"x"``, ``"y"`` or ``"both"``) of ``ax`` logarithmic with plain-number tick labels: major ticks
    at 1, 2 and 5 times each power of ten (powers of ten alone on an axis spanning more than two decades), labelled
    (:func:`plain_number`); minor ticks labelled too, plainly, when fewer than three major ones fall in the view (a
    narrow axis), else left bare. Call it after anything that sets the axis' scale (which resets its ticks)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    for name in ("x", "y") if axis == "both" else (axis,):
        (ax.set_xscale if name == "x" else ax.set_yscale)("log")
        target = ax.xaxis if name == "x" else ax.yaxis

        def minor(value, _pos, target=target):
            lo, hi = sorted(target.get_view_interval())
            majors = [m for m in target.get_majorticklocs() if lo <= m <= hi]
            return plain_number(value) if len(majors) < 3 else ""

        target.set_major_locator(_log_majors())
        target.set_major_formatter(FuncFormatter(lambda value, _pos: plain_number(value)))
        target.set_minor_locator(LogLocator(base=10, subs="auto"))
        target.set_minor_formatter(FuncFormatter(minor))


def finish_axis(ax, xlabel: str, ylabel: str, log_y: bool = False, log_x: bool = False,
                integer_y: bool = False) -> None:
    """Labels (with units), a light grid, and readable ticks: plain numbers on log axes, integers where asked."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        plain_log_ticks(ax, "y")
    if log_x:
        plain_log_ticks(ax, "x")
    if integer_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="major")


def grid_axes(summary: pd.DataFrame) -> list[str]:
    """The grid-axis columns of a sweep's summary: columns named after a config field (or ``config_<field>``) that
    are neither the fixed labels nor summary figures, in column order."""
    from simulator.config import FIELDS
    from simulator.studies.specs import summary_names

    known = set(FIELDS) - _NOT_AXES
    return [c for c in summary.columns
            if (c.startswith("config_") and c[len("config_"):] in known) or (c in known and c not in summary_names())]


def _with_series(summary: pd.DataFrame, axes: list[str] | None) -> pd.DataFrame:
    """``summary`` with a ``series`` column: the policy spec, and the grid axes' values when there are any, so that
    each line of a figure is one policy at one point of every other axis (nothing averaged away but seeds)."""
    axes = grid_axes(summary) if axes is None else axes
    frame = summary.copy()
    series = frame["policy"].astype(str)
    for axis in axes:
        name = axis[len("config_"):] if axis.startswith("config_") else axis
        series = series + f" {name}=" + frame[axis].astype(str)
    frame["series"] = series
    frame["axes_key"] = frame[axes].astype(str).agg(" ".join, axis=1) if axes else ""
    return frame


def mean_over_seeds(summary: pd.DataFrame, columns: list[str], by: str = "policy") -> pd.DataFrame:
    """One row per (``by``, rate): the mean over seeds of ``columns``."""
    return summary.groupby([by, "rate"], sort=True, dropna=False)[columns].mean().reset_index()


def best_static(summary: pd.DataFrame, column: str, by: str = "policy") -> pd.Series:
    """Per rate, the lowest ``column`` among static policies (no-spec and fixed k), seeds averaged."""
    static = summary[summary["policy_name"].isin(STATIC)]
    return mean_over_seeds(static, [column], by).groupby("rate")[column].min()


def _title(summary: pd.DataFrame) -> str:
    methods = sorted(set(summary.get("profile_method", pd.Series(["?"])).astype(str)))
    note = " (ANALYTICAL profile)" if "analytical" in methods else f" ({', '.join(methods)} profile)"
    return note


def save_figure(fig, path: str | Path) -> str:
    """Write ``fig`` to ``path`` atomically (parent folders made), close it, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return str(path)


def _spread(frame: pd.DataFrame, column: str, by: str = "series") -> pd.DataFrame:
    """Per (``by``, rate): mean, min and max over seeds of ``column``, and the number of seeds."""
    return (frame.groupby([by, "rate"], sort=True, dropna=False)[column]
            .agg(["mean", "min", "max", "count"]).reset_index())


def plot_latency_vs_rate(summary: pd.DataFrame, path: str | Path, grid: list[str] | None = None) -> str:
    """``grid``: the grid-axis columns (None: found in the summary); one line per policy and axis values, the band
    around it the spread over seeds (min to max) when there are several."""
    cols = ["mean_norm_latency", "p99_norm_latency"]
    frame = _with_series(summary, grid)
    seeds = int(frame["seed"].nunique()) if "seed" in frame else 1
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    styles = policy_styles(list(dict.fromkeys(frame["series"])))
    for ax, col in zip(axes, cols):
        data = _spread(frame, col)
        for policy, group in data.groupby("series", sort=False):
            style = styles[policy]
            ax.plot(group["rate"], group["mean"] * 1e3, ms=4, label=policy, **style)
            if seeds > 1:
                ax.fill_between(group["rate"], group["min"] * 1e3, group["max"] * 1e3, color=style["color"],
                                alpha=0.15, lw=0)
        keys = list(dict.fromkeys(frame["axes_key"]))
        for key, part in frame.groupby("axes_key", sort=False):
            envelope = best_static(part, col, "series")
            if len(envelope):
                ls = _LINESTYLES[keys.index(key) % len(_LINESTYLES)]
                ax.plot(envelope.index, envelope.to_numpy() * 1e3, **{**ENVELOPE_STYLE, "ls": ls},
                        label="best static choice" + (f" ({key})" if key else ""))
        finish_axis(ax, "request rate (req/s)", f"{col.split('_')[0]} normalised latency (ms/token)", log_y=True)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    spread = f"; band: min to max over {seeds} seeds" if seeds > 1 else "; one seed (no spread shown)"
    fig.suptitle("Normalised latency (per output token) versus request rate" + _title(summary) + spread)
    return save_figure(fig, path)


def plot_speedup(summary: pd.DataFrame, path: str | Path, grid: list[str] | None = None) -> str:
    """Speedup over no-spec at the same rate and the same values of every grid axis (seed means); with several seeds
    the band is the min to max over seeds of the per-seed speedup."""
    frame = _with_series(summary, grid)
    seeds = int(frame["seed"].nunique()) if "seed" in frame else 1
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = policy_styles(list(dict.fromkeys(frame["series"])))
    for _, part in frame.groupby("axes_key", sort=False):
        base_rows = part[part["policy"] == "no-spec"]
        if base_rows.empty:
            continue
        keys = ["rate", "seed"] if "seed" in part else ["rate"]
        base = base_rows.set_index(keys)["mean_latency"]
        for series, group in part.groupby("series", sort=False):
            g = group.set_index(keys)
            per_seed = (base.reindex(g.index) / g["mean_latency"]).rename("speedup").reset_index()
            stats = per_seed.groupby("rate")["speedup"].agg(["min", "max"])
            mean = base_rows.groupby("rate")["mean_latency"].mean().reindex(stats.index) / \
                group.groupby("rate")["mean_latency"].mean().reindex(stats.index)
            style = styles[series]
            ax.plot(stats.index, mean, ms=4, label=series, **style)
            if seeds > 1:
                ax.fill_between(stats.index, stats["min"], stats["max"], color=style["color"], alpha=0.15, lw=0)
    ax.axhline(1.0, color="k", lw=0.8)
    finish_axis(ax, "request rate (req/s)", "speedup of mean latency over no-spec (x)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Speedup over no speculation" + _title(summary))
    return save_figure(fig, path)


def plot_k_over_time(steps: pd.DataFrame, path: str | Path, label: str) -> str:
    """``label``: ``SPEC at RATE req/s``; the k line takes the policy's colour (:func:`policy_style`; no markers on a
    line of thousands of steps)."""
    decode = steps[steps["kind"] != "prefill"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.plot(decode["start_time"], decode["k_max"], lw=0.6, alpha=0.6, color=policy_color(label),
            label="k (largest in batch)")
    ax2 = ax.twinx()
    ax2.plot(decode["start_time"], decode["batch_size"], color="tab:gray", lw=0.6, alpha=0.7, label="batch size")
    finish_axis(ax, "simulated time (s)", "k chosen (tokens)", integer_y=True)
    ax2.set_ylabel("running requests (batch size)")
    from matplotlib.ticker import MaxNLocator

    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=-0.2)
    ax.set_title(f"k chosen over time: {label}")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    fig.legend(handles, [h.get_label() for h in handles], loc="upper center", ncol=2, fontsize=8,
               bbox_to_anchor=(0.5, 0.0))
    return save_figure(fig, path)


def pareto_front(x: pd.Series, y: pd.Series) -> list[int]:
    """Positions (in ``x`` order, increasing) of the points no other point beats on both: the most ``y`` at any
    ``x`` or more (higher is better on both)."""
    order = sorted(range(len(x)), key=lambda i: (-float(x.iloc[i]), -float(y.iloc[i])))
    front, best = [], -float("inf")
    for i in order:
        if float(y.iloc[i]) > best:
            front.append(i)
            best = float(y.iloc[i])
    return sorted(front, key=lambda i: float(x.iloc[i]))


def plot_pareto(points: pd.DataFrame, path: str | Path, title: str) -> str:
    """AIConfigurator's Pareto figure: output tokens/s per GPU (``per_gpu``) against tokens/s per user (``per_user``),
    one panel per ``panel`` (a drafter), each ``series`` (a candidate at every load) in its policy's colour and marker
    (:func:`policy_styles`), the panel's Pareto front as the broad grey line (:data:`ENVELOPE_STYLE`)."""
    import math

    points = points[points["per_user"].notna() & points["per_gpu"].notna()]
    panels = list(dict.fromkeys(points["panel"]))
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols + 2.5, 4.2 * rows), squeeze=False)
    styles = policy_styles(list(dict.fromkeys(points["series"])))
    for ax, panel in zip(axes.flat, panels):
        part = points[points["panel"] == panel].reset_index(drop=True)
        for series, group in part.groupby("series", sort=False):
            group = group.sort_values("per_user")
            ax.plot(group["per_user"], group["per_gpu"], ms=4, lw=0.8, label=series, **styles[series])
        front = pareto_front(part["per_user"], part["per_gpu"])
        ax.plot(part["per_user"].iloc[front], part["per_gpu"].iloc[front], **ENVELOPE_STYLE, label="Pareto front")
        finish_axis(ax, "tokens/s per user (1000 / mean TPOT ms)", "output tokens/s per GPU")
        ax.set_title(panel, fontsize=10)
        ax.legend(fontsize=6, loc="upper right")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_batch_tables(runs: pd.DataFrame, path: str | Path) -> str:
    """The generated batch-size tables' measurements (:func:`simulator.studies.advise.table_entries`' rows): steady
    output tokens/s against concurrency, one line per k (k = 0: the drafter configured and never proposing, drawn in
    no speculation's style), one panel per drafter (``method``), the k the table takes at each concurrency ringed."""
    methods = list(dict.fromkeys(runs["method"]))
    fig, axes = plt.subplots(1, len(methods), figsize=(5.2 * len(methods) + 2, 4.2), squeeze=False)
    for ax, method in zip(axes[0], methods):
        part = runs[runs["method"] == method]
        for k, group in part.groupby("k"):
            spec = "no-spec" if k == 0 else f"fixed-k:{k}"
            group = group.sort_values("batch")
            ax.plot(group["batch"], group["steady_throughput"], ms=4, lw=1, label=f"k={k}", **policy_style(spec))
        best = part[part["best"]]
        ax.scatter(best["batch"], best["steady_throughput"], s=140, facecolors="none", edgecolors="k",
                   label="the table's k at that concurrency")
        finish_axis(ax, "requests in flight (closed loop)", "steady output tokens/s", log_x=True, log_y=True)
        ax.set_title(f"{method}: k by batch size", fontsize=10)
        ax.legend(fontsize=6)
    return save_figure(fig, path)
