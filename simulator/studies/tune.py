"""Tuning a policy's parameters for a latency SLO over a range of request rates.

A tune is a sweep over candidate policy specs (a grid of parameter values) followed by an analysis:
for each candidate, the SLO metric (seed-averaged) at each rate, and its **sustainable rate** = the
highest rate at which it and every lower rate meet the SLO. The best candidate has the highest
sustainable rate, ties broken by the lowest rate-averaged metric. The trade-off curve is the
sustainable rate versus the metric at the lightest load, one point per candidate. SLOs and search spaces are
parsed by :mod:`simulator.studies.specs`.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pandas as pd

from policies.errors import UserError
from simulator.studies.specs import Slo, parse_space

#: Default search spaces: parameter -> values (``k`` is the config's k / K_max).
DEFAULT_SPACES: dict[str, dict[str, list[Any]]] = {
    "goodput": {"k": [2, 4, 6], "bonus": [1.0, 1.1, 1.3]},
    "threshold": {"k": [2, 4], "max_batch": [4, 16, 64]},
    "fixed-k": {"k": [1, 2, 3, 4, 5, 6]},
}


def search_space(items: list[str] | None, policy: str) -> dict[str, list[Any]]:
    """The ``--param NAME=V1,V2`` items parsed (:func:`simulator.studies.specs.parse_space`), or the policy's
    default space when none are given."""
    if not items:
        if policy not in DEFAULT_SPACES:
            raise UserError(f"tune: no default search space for policy {policy!r}; give --param NAME=V1,V2")
        return DEFAULT_SPACES[policy]
    return parse_space(items)


def candidate_specs(policy: str, space: dict[str, list[Any]]) -> list[str]:
    """Policy specs (``NAME:K/P=V/...``) for every combination in ``space``."""
    names = list(space)
    specs = []
    for values in itertools.product(*(space[n] for n in names)):
        chosen = dict(zip(names, values))
        spec = policy + (f":{chosen.pop('k')}" if "k" in chosen else "")
        spec += "".join(f"/{n}={v}" for n, v in chosen.items())
        specs.append(spec)
    return specs


def analyse(summary: pd.DataFrame, slo: Slo) -> pd.DataFrame:
    """One row per candidate: sustainable rate, metric at the lightest load, rate-averaged metric; best first."""
    if slo.metric not in summary.columns:
        raise UserError(f"--slo: metric {slo.metric!r} is not in the sweep summary")
    by = summary.groupby(["policy", "rate"])[slo.metric].mean().reset_index()
    rows = []
    for spec, group in by.groupby("policy", sort=False):
        group = group.sort_values("rate")
        sustainable = 0.0
        for rate, value in zip(group["rate"], group[slo.metric]):
            if not slo.met(value):
                break
            sustainable = rate
        rows.append({"policy": spec, "sustainable_rate": sustainable,
                     f"{slo.metric}_at_lightest": float(group[slo.metric].iloc[0]),
                     f"mean_{slo.metric}": float(group[slo.metric].mean()),
                     "meets_slo_everywhere": bool(all(slo.met(v) for v in group[slo.metric]))})
    table = pd.DataFrame(rows)
    lower_is_better = slo.op in ("<=", "<")
    table = table.sort_values(["sustainable_rate", f"mean_{slo.metric}"], ascending=[False, lower_is_better])
    return table.reset_index(drop=True)


def plot_tradeoff(table: pd.DataFrame, slo: Slo, path: str | Path, summary: pd.DataFrame | None = None,
                  rates: list[float] | None = None) -> str:
    """The trade-off (sustainable rate against the metric at the lightest load, one point per setting, the SLO bound
    as a line) and, given the sweep's ``summary``, the metric against rate per setting with the SLO line. A title
    says when every setting meets the SLO at every rate tried (raise the rates) or none meets it anywhere. Each
    setting in its policy's colour and marker (:func:`simulator.studies.plots.policy_style`), the best ringed."""
    from simulator.studies.plots import finish_axis, plt, policy_style, save_figure, style_key

    panels = 2 if summary is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.5), squeeze=False)
    ax = axes[0][-1]
    unit = slo.unit
    keys = table["policy"].astype(str).map(style_key)
    labelled = set()
    for spec, key, x, y in zip(table["policy"].astype(str), keys, table["sustainable_rate"],
                               table[f"{slo.metric}_at_lightest"]):
        n = int((keys == key).sum())
        ax.scatter([x], [y], s=30, label=None if key in labelled else f"{key} ({n} setting{'s' * (n > 1)})",
                   **policy_style(spec))
        labelled.add(key)
    best = table.iloc[0]
    ax.scatter([best["sustainable_rate"]], [best[f"{slo.metric}_at_lightest"]], s=160, facecolors="none",
               edgecolors="k", linewidths=1.5, label=f"best: {best['policy']}")
    ax.axhline(slo.bound, color="0.25", lw=1, ls="--", label=f"SLO bound {slo.bound:g} {unit}")
    finish_axis(ax, "sustainable rate under the SLO (req/s)", f"{slo.metric} at the lightest load ({unit})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Tuning trade-off: one point per parameter setting")
    if summary is not None:
        left = axes[0][0]
        by = summary.groupby(["policy", "rate"])[slo.metric].mean().reset_index()
        for spec, group in by.groupby("policy", sort=False):
            chosen = spec == best["policy"]
            left.plot(group["rate"], group[slo.metric], ms=4, lw=2 if chosen else 1, alpha=1.0 if chosen else 0.35,
                      label=spec if chosen else f"_{spec}", **policy_style(spec))  # "_": named, not in the legend
        left.axhline(slo.bound, color="0.25", lw=1, ls="--", label=f"SLO: {slo}")
        finish_axis(left, "request rate (req/s)", f"{slo.metric} ({unit})")
        left.legend(fontsize=8)
        left.set_title("each setting against rate (best highlighted)")
    tried = f" up to {max(rates):g} req/s" if rates else ""
    if bool(table["meets_slo_everywhere"].all()):
        fig.suptitle(f"every setting meets {slo} at every rate tried{tried}: raise --rates", color="tab:red")
    elif float(table["sustainable_rate"].max()) <= 0:
        fig.suptitle(f"no setting meets {slo} at any rate tried: lower --rates", color="tab:red")
    return save_figure(fig, path)
