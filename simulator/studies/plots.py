"""Figures from result DataFrames only, so any figure can be redrawn without rerunning.

Every figure a reader can trust: one colour per policy in every figure (:func:`policy_color`, fixed by the policy
spec, not by its order in a sweep), the spread over seeds drawn as a band (min to max) around the seed mean when a
sweep has several seeds, plain-number ticks on log axes (``60``, not ``6x10^1``), integer ticks on integer axes and a
unit on every axis (:func:`finish_axis`), legends outside the data.

- :func:`plot_latency_vs_rate`: mean and p99 normalised latency (s/token) versus request rate, one line
  per policy spec, with the best static choice (the lowest of no-spec and every fixed k at each rate)
  drawn dashed for reference.
- :func:`plot_speedup`: mean-latency speedup over no-spec versus rate.
- :func:`plot_k_over_time`: the k an adaptive policy chose, step by step, at one rate.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

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


#: Fixed colours of the built-in policy specs; any other spec gets one from :data:`_PALETTE` by a hash of its text.
POLICY_COLORS = {"no-spec": "black", "fixed-k:1": "tab:blue", "fixed-k:2": "tab:cyan", "fixed-k:3": "tab:green",
                 "fixed-k:4": "tab:olive", "fixed-k:5": "tab:purple", "fixed-k:6": "tab:brown",
                 "fixed-k:7": "tab:pink", "goodput": "tab:red", "threshold": "tab:orange", "fixed-k": "tab:olive"}
_PALETTE = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
            "tab:olive", "tab:cyan", "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"]


def policy_color(series: str) -> str:
    """The colour of a policy spec (or a series named ``SPEC axis=value ...``: its spec decides), the same in every
    figure of every sweep: fixed for the built-in specs, else a stable hash of the spec (never Python's salted
    ``hash``)."""
    import hashlib

    spec = str(series).split(" ")[0]
    if spec in POLICY_COLORS:
        return POLICY_COLORS[spec]
    digest = int(hashlib.sha256(spec.encode()).hexdigest()[:8], 16)
    return _PALETTE[digest % len(_PALETTE)]


def finish_axis(ax, xlabel: str, ylabel: str, log_y: bool = False, log_x: bool = False,
                integer_y: bool = False) -> None:
    """Labels (with units), a light grid, and readable ticks: plain numbers on log axes, integers where asked."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    for log, axis, setter in ((log_y, ax.yaxis, ax.set_yscale), (log_x, ax.xaxis, ax.set_xscale)):
        if log:
            setter("log")
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if integer_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="major")


def grid_axes(summary: pd.DataFrame) -> list[str]:
    """The grid-axis columns of a sweep's summary: columns named after a config field (or ``config_<field>``) that
    are neither the fixed labels nor summary figures, in column order."""
    from dataclasses import fields

    from simulator.config import SimConfig
    from simulator.studies.specs import summary_names

    known = {f.name for f in fields(SimConfig)} - _NOT_AXES
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
    for ax, col in zip(axes, cols):
        data = _spread(frame, col)
        for policy, group in data.groupby("series", sort=False):
            color = policy_color(policy)
            ax.plot(group["rate"], group["mean"] * 1e3, marker="o", ms=3, label=policy, color=color)
            if seeds > 1:
                ax.fill_between(group["rate"], group["min"] * 1e3, group["max"] * 1e3, color=color, alpha=0.15, lw=0)
        for key, part in frame.groupby("axes_key", sort=False):
            envelope = best_static(part, col, "series")
            if len(envelope):
                ax.plot(envelope.index, envelope.to_numpy() * 1e3, "k--", lw=1.2,
                        label="best static choice" + (f" ({key})" if key else ""))
        finish_axis(ax, "request rate (req/s)", f"{col.split('_')[0]} normalised latency (ms/token)", log_y=True)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    spread = f"; band: min to max over {seeds} seeds" if seeds > 1 else "; one seed (no spread shown)"
    fig.suptitle("Latency versus request rate" + _title(summary) + spread)
    return save_figure(fig, path)


def plot_speedup(summary: pd.DataFrame, path: str | Path, grid: list[str] | None = None) -> str:
    """Speedup over no-spec at the same rate and the same values of every grid axis (seed means); with several seeds
    the band is the min to max over seeds of the per-seed speedup."""
    frame = _with_series(summary, grid)
    seeds = int(frame["seed"].nunique()) if "seed" in frame else 1
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
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
            color = policy_color(series)
            ax.plot(stats.index, mean, marker="o", ms=3, label=series, color=color)
            if seeds > 1:
                ax.fill_between(stats.index, stats["min"], stats["max"], color=color, alpha=0.15, lw=0)
    ax.axhline(1.0, color="k", lw=0.8)
    finish_axis(ax, "request rate (req/s)", "speedup of mean latency over no-spec (x)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Speedup over no speculation" + _title(summary))
    return save_figure(fig, path)


def plot_k_over_time(steps: pd.DataFrame, path: str | Path, label: str) -> str:
    decode = steps[steps["kind"] != "prefill"]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.plot(decode["start_time"], decode["k_max"], lw=0.6, alpha=0.6, color="tab:red", label="k (largest in batch)")
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
