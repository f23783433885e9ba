"""Figures from result DataFrames only, so any figure can be redrawn without rerunning.

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


def plot_latency_vs_rate(summary: pd.DataFrame, path: str | Path, grid: list[str] | None = None) -> str:
    """``grid``: the grid-axis columns (None: found in the summary); one line per policy and axis values."""
    cols = ["mean_norm_latency", "p99_norm_latency"]
    frame = _with_series(summary, grid)
    data = mean_over_seeds(frame, cols, "series")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, col in zip(axes, cols):
        for policy, group in data.groupby("series", sort=False):
            ax.plot(group["rate"], group[col] * 1e3, marker="o", ms=3, label=policy)
        for key, part in frame.groupby("axes_key", sort=False):
            envelope = best_static(part, col, "series")
            if len(envelope):
                ax.plot(envelope.index, envelope.to_numpy() * 1e3, "k--", lw=1.2,
                        label="best static choice" + (f" ({key})" if key else ""))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{col.split('_')[0]} normalised latency (ms/token)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Latency versus request rate" + _title(summary))
    return save_figure(fig, path)


def plot_speedup(summary: pd.DataFrame, path: str | Path, grid: list[str] | None = None) -> str:
    """Speedup over no-spec at the same rate and the same values of every grid axis."""
    frame = _with_series(summary, grid)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for _, part in frame.groupby("axes_key", sort=False):
        data = mean_over_seeds(part, ["mean_latency"], "series")
        names = part.drop_duplicates("series").set_index("series")["policy"]
        data["policy"] = data["series"].map(names)
        base = data[data["policy"] == "no-spec"].set_index("rate")["mean_latency"]
        if base.empty:
            continue
        for policy, group in data.groupby("series", sort=False):
            g = group.set_index("rate")
            ax.plot(g.index, base.reindex(g.index) / g["mean_latency"], marker="o", ms=3, label=policy)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("speedup of mean latency over no-spec")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Speedup over no speculation" + _title(summary))
    return save_figure(fig, path)


def plot_k_over_time(steps: pd.DataFrame, path: str | Path, label: str) -> str:
    decode = steps[steps["kind"] != "prefill"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(decode["start_time"], decode["k_max"], lw=0.6, alpha=0.5, label="k (largest in batch)")
    ax2 = ax.twinx()
    ax2.plot(decode["start_time"], decode["batch_size"], color="tab:orange", lw=0.6, alpha=0.7, label="batch size")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("k chosen")
    ax2.set_ylabel("running requests")
    ax.set_title(f"k chosen over time: {label}")
    fig.legend(loc="lower right", fontsize=8, bbox_to_anchor=(0.9, 0.12))
    return save_figure(fig, path)
