"""The disaggregation study: goodput per GPU of disaggregated prefill and decode against co-located serving, with and
without speculation (``run_sim.py disagg``; issue 24, items 3 and 5).

The shape of the headline of Splitwise (Patel et al., ISCA 2024) and DistServe (Zhong et al., OSDI 2024): at fixed
per-request TTFT and TPOT SLOs, the highest request rate a deployment serves with at least a target fraction of its
requests meeting both (DistServe's SLO attainment, 90% here as theirs), divided by its GPUs, for a co-located fleet
(``G`` replicas that each prefill and decode) and for disaggregated ones with the same ``G`` GPUs split ``P:D``
between prefill and decode instances (:mod:`simulator.fleet.disagg`). DistServe reports this as "goodput per GPU" and
finds it higher for the disaggregated placement when the TPOT SLO is tight (prefills no longer stall decode steps);
Splitwise reports the same trade as throughput at iso-cost. Here each layout runs with each speculation policy (by
default none, a static k and SmartSpec's goodput policy, on the decode instances of a disaggregated layout), which
asks what neither paper does: whether speculation still pays on decode instances that run large, steady batches.

Default inputs: the Azure LLM inference trace of conversations (2023; Splitwise's own trace; prompts 1,155 and
outputs 211 tokens on average) replayed at each rate (its inter-arrival times rescaled), its first
:data:`DEFAULT_REQUESTS` requests, on the vLLM-calibrated profile of Llama 3.1 8B with a Llama 3.2 1B draft on H100s
(:data:`DEFAULT_PROFILE`), :data:`DEFAULT_GPUS` GPUs split :data:`DEFAULT_SPLITS`, SLOs TTFT <= 250 ms and TPOT <=
15 ms (:data:`DEFAULT_SLO`: about 6x an unloaded 1,000-token prefill, 40 ms, and 2.3x an unloaded decode step, 6.4 ms;
DistServe's gain shows where the TPOT SLO is tight, which is where prefills stalling decode steps hurt). The
profile's API-server time per request (its ``frontend`` phase, 2.7 ms) is left out on both sides
(:func:`without_frontend`): a fleet's front end is not modelled, and it would load both layouts alike.

Each (layout, policy, rate) cell is one run (:func:`study_cells`); :func:`max_goodput` finds where each layout's
attainment crosses the target (linear between the grid's rates), :func:`plot_attainment` and :func:`plot_goodput`
draw them from the tables alone.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.config.fleet import DISAGG_ONLY, FleetConfig
from simulator.inputs import AZURE_CONV
from simulator.studies.specs import Slo, parse_policy_spec

if TYPE_CHECKING:  # pragma: no cover - typing only (the command line reads the defaults without pandas)
    import pandas as pd

    from simulator.costs.cost_model import CostModel

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = str(REPO / "profiles" / "data" / "h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b.csv")
DEFAULT_TRACE = str(AZURE_CONV)
DEFAULT_REQUESTS = 2000
DEFAULT_GPUS = 8
DEFAULT_SPLITS = "3:5,4:4,5:3,6:2"
DEFAULT_POLICIES = "no-spec,fixed-k:3,goodput"
DEFAULT_SLO = "90% ttft:250 tpot:15"
DEFAULT_RATES_PER_GPU = "6,8,10,12,14"

#: Columns of the study's table of cells (``cells.csv``), then the run's figures named in :data:`CELL_FIGURES`.
CELL_LABELS = ["layout", "prefill_replicas", "decode_replicas", "gpus", "policy", "rate_per_gpu", "rate"]
CELL_FIGURES = ["slo_attainment", "request_goodput", "p90_ttft_ms", "p90_tpot_ms", "mean_ttft_ms", "mean_tpot_ms",
                "acceptance_rate", "mean_kv_transfer_s", "saturated", "requests", "wall_seconds"]
#: Columns of :func:`max_goodput`'s table (``goodput.csv``).
GOODPUT_COLUMNS = ["layout", "policy", "gpus", "max_rate_per_gpu", "found", "vs_co_located"]

#: The disaggregation fields a co-located cell resets to their defaults.
_DISAGG_FIELDS = ("prefill_replicas", "decode_replicas", *DISAGG_ONLY)


@dataclass(frozen=True)
class Layout:
    """``gpus`` GPUs as co-located replicas (``prefill`` = ``decode`` = 0) or as ``prefill`` + ``decode`` instances of
    ``tp`` GPUs each."""

    prefill: int
    decode: int
    gpus: int
    tp: int = 1

    @property
    def name(self) -> str:
        return "co-located" if self.prefill == 0 else f"{self.prefill}P:{self.decode}D"

    def config(self, base: SimConfig) -> SimConfig:
        """``base`` (a disaggregated config carrying the link and routers) laid out as this layout. A co-located fleet
        is routed by ``base.fleet.prefill_router`` (the router that meets arrivals), with the disaggregation fields
        reset."""
        if self.prefill:
            return base.replace(replicas=1, router="round-robin", prefill_replicas=self.prefill,
                                decode_replicas=self.decode)
        defaults = {f.name: f.default for f in dataclasses.fields(FleetConfig) if f.name in _DISAGG_FIELDS}
        return base.replace(replicas=self.gpus // self.tp, router=base.fleet.prefill_router, **defaults)


def layouts(gpus: int, splits: Sequence[tuple[int, int]] | None, tp: int = 1) -> list[Layout]:
    """Co-located on ``gpus`` GPUs, then each ``(P, D)`` split of them (default: every split, P = 1 .. G/tp - 1);
    every split must use all ``gpus`` GPUs, ``tp`` per instance."""
    if gpus < 2 * tp or gpus % tp:
        raise UserError(f"--gpus {gpus}: needs at least two instances of {tp} GPUs (the profile's tensor parallel) "
                        "and a whole number of them")
    n = gpus // tp
    splits = [(p, n - p) for p in range(1, n)] if splits is None else list(splits)
    for p, d in splits:
        if p < 1 or d < 1 or p + d != n:
            raise UserError(f"--splits {p}:{d}: a split needs P, D >= 1 with P + D = {n} instances ({gpus} GPUs, "
                            f"{tp} per instance)")
    return [Layout(0, 0, gpus, tp)] + [Layout(p, d, gpus, tp) for p, d in splits]


def parse_splits(text: str | None) -> list[tuple[int, int]] | None:
    """``"1:3,2:2"`` -> [(1, 3), (2, 2)]; None or empty: every split."""
    if not text:
        return None
    out = []
    for item in text.split(","):
        p, sep, d = item.strip().partition(":")
        try:
            out.append((int(p), int(d)))
        except ValueError:
            raise UserError(f"--splits: expected P:D pairs such as 1:3,2:2, got {item.strip()!r}") from None
        if not sep:
            raise UserError(f"--splits: expected P:D pairs such as 1:3,2:2, got {item.strip()!r}")
    if len(set(out)) != len(out):
        raise UserError(f"--splits: a split is given twice in {text!r}")
    return out


def without_frontend(cost: CostModel) -> CostModel:
    """``cost`` without its front end's seconds per request (the ``frontend`` block), every other price the same."""
    from simulator.costs.cost_model import model_from_dict

    data = cost.to_dict()
    data.pop("frontend", None)
    return model_from_dict(data, cost.path)


@functools.cache
def _study_cost(profile: str, fitter: str) -> CostModel:
    """The study's cost model of ``profile`` (front end left out), loaded once per process."""
    from simulator.costs.cost_model import load_cost_model

    return without_frontend(load_cost_model(profile, fitter))


def run_cell(cell: tuple[dict[str, Any], SimConfig]) -> dict[str, Any]:
    """One cell: its labels and the run's :data:`CELL_FIGURES`."""
    from simulator.fleet import run

    labels, config = cell
    summary = run(config, cost=_study_cost(config.cost.profile, config.cost.fitter)).summary
    return {**labels, **{name: summary.get(name, float("nan")) for name in CELL_FIGURES}}


def study_cells(base: SimConfig, layouts_: Sequence[Layout], policies: Sequence[str],
                rates_per_gpu: Sequence[float]) -> list[tuple[dict[str, Any], SimConfig]]:
    """Every (layout, policy, rate) cell as (labels, config), in that order."""
    cells = []
    for layout in layouts_:
        for spec in policies:
            name, k, params = parse_policy_spec(spec)
            for per_gpu in rates_per_gpu:
                rate = per_gpu * layout.gpus
                config = layout.config(base).replace(
                    rate=rate, policy=name, k=base.speculative.k if k is None else k,
                    policy_params=base.speculative.policy_params + params)
                labels = {"layout": layout.name, "prefill_replicas": layout.prefill, "decode_replicas": layout.decode,
                          "gpus": layout.gpus, "policy": spec, "rate_per_gpu": per_gpu, "rate": rate}
                cells.append((labels, config))
    return cells


def run_study(cells: Sequence[tuple[dict[str, Any], SimConfig]], workers: int = 1,
              cluster: str | None = None) -> pd.DataFrame:
    """Run ``cells`` on local workers or a Dask cluster (:mod:`simulator.studies.executors`); the table in the
    cells' order."""
    import pandas as pd

    from simulator.studies.executors import make_executor

    with make_executor(workers, cluster) as executor:
        rows = list(executor.map_unordered(run_cell, list(cells)))
    order = {(r["layout"], r["policy"], r["rate_per_gpu"]): i for i, r in
             enumerate(labels for labels, _ in cells)}
    rows.sort(key=lambda r: order[(r["layout"], r["policy"], r["rate_per_gpu"])])
    return pd.DataFrame(rows, columns=CELL_LABELS + CELL_FIGURES)


def crossing(rates: Sequence[float], attainment: Sequence[float], target: float) -> tuple[float, str]:
    """The highest rate at which ``attainment`` (at increasing ``rates``) still meets ``target``, and how it was found:
    ``interpolated`` (linear between the last rate that meets it, counting up from the lowest, and the next, which
    does not), ``below the grid`` (0: the lowest rate misses it), ``at least`` (the highest rate meets it: its value)."""
    if not attainment or attainment[0] < target:
        return 0.0, "below the grid"
    for i in range(1, len(rates)):
        if attainment[i] < target:
            r0, r1, a0, a1 = rates[i - 1], rates[i], attainment[i - 1], attainment[i]
            return r0 + (a0 - target) / (a0 - a1) * (r1 - r0), "interpolated"
    return float(rates[-1]), "at least"


def max_goodput(cells: pd.DataFrame, target: float) -> pd.DataFrame:
    """Per (layout, policy): the highest rate per GPU meeting the SLO attainment ``target`` (:func:`crossing`), and
    its ratio to the co-located layout's with the same policy (:data:`GOODPUT_COLUMNS`)."""
    import pandas as pd

    rows = []
    for (layout, policy), group in cells.groupby(["layout", "policy"], sort=False):
        group = group.sort_values("rate_per_gpu")
        rate, found = crossing(group["rate_per_gpu"].tolist(), group["slo_attainment"].tolist(), target)
        rows.append({"layout": layout, "policy": policy, "gpus": int(group["gpus"].iloc[0]),
                     "max_rate_per_gpu": rate, "found": found})
    table = pd.DataFrame(rows)
    co = table[table["layout"] == "co-located"].set_index("policy")["max_rate_per_gpu"]
    table["vs_co_located"] = table["max_rate_per_gpu"] / table["policy"].map(co)
    return table[GOODPUT_COLUMNS]


def plot_attainment(cells: pd.DataFrame, slo: Slo, path: str | Path) -> str:
    """SLO attainment versus rate per GPU, one panel per layout, one line per policy (DistServe's figure form)."""
    import matplotlib.pyplot as plt

    from simulator.studies.plots import finish_axis, policy_styles, save_figure

    names = list(dict.fromkeys(cells["layout"]))
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names) + 1.5, 3.8), sharey=True, squeeze=False)
    styles = policy_styles(list(dict.fromkeys(cells["policy"])))
    for ax, name in zip(axes[0], names):
        part = cells[cells["layout"] == name]
        for policy, group in part.groupby("policy", sort=False):
            group = group.sort_values("rate_per_gpu")
            ax.plot(group["rate_per_gpu"], group["slo_attainment"] * 100, ms=4, label=policy, **styles[policy])
        ax.axhline(slo.bound * 100, color="0.4", lw=0.8, ls="--")
        ax.set_title(name)
        finish_axis(ax, "request rate per GPU (req/s)", "SLO attainment (% of requests)" if ax is axes[0][0] else "")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"SLO attainment ({slo}), dashed: the target; lines that coincide hide each other", y=1.04)
    return save_figure(fig, path)


def plot_goodput(table: pd.DataFrame, slo: Slo, path: str | Path) -> str:
    """Goodput per GPU (the highest rate per GPU meeting the SLO attainment) of each layout, one bar per policy."""
    import matplotlib.pyplot as plt
    import numpy as np

    from simulator.studies.plots import finish_axis, policy_style, save_figure

    names = list(dict.fromkeys(table["layout"]))
    policies = list(dict.fromkeys(table["policy"]))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
    x = np.arange(len(names))
    for j, policy in enumerate(policies):
        part = table[table["policy"] == policy].set_index("layout").reindex(names)
        ax.bar(x + (j - (len(policies) - 1) / 2) * width, part["max_rate_per_gpu"], width,
               color=policy_style(policy)["color"], label=policy)
    ax.set_xticks(x, names)
    finish_axis(ax, "layout (P:D = prefill : decode instances)", "goodput per GPU (req/s)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"Highest rate per GPU with {slo}")
    return save_figure(fig, path)


def verdict(table: pd.DataFrame) -> list[str]:
    """What the study shows, a line per policy: co-located goodput per GPU, the best split's and their ratio."""
    lines = []
    for policy, part in table.groupby("policy", sort=False):
        co = part[part["layout"] == "co-located"].iloc[0]
        split = part[part["layout"] != "co-located"].sort_values("max_rate_per_gpu", ascending=False).iloc[0]
        lines.append(f"{policy}: co-located {_rate(co)} req/s per GPU; best split {split['layout']} {_rate(split)} "
                     f"({split['vs_co_located']:.2f}x)")
    return lines


def _rate(row: pd.Series) -> str:
    """A goodput per GPU as read off the grid: ``0`` below it, ``>= r`` at its top."""
    prefix = {"at least": ">= ", "below the grid": "< lowest rate, "}.get(row["found"], "")
    return f"{prefix}{row['max_rate_per_gpu']:.2f}"


def run_disagg_study(base: SimConfig, gpus: int, splits: Sequence[tuple[int, int]] | None, policies: Sequence[str],
                     rates_per_gpu: Sequence[float], slo: Slo, out: str | Path, workers: int = 1,
                     cluster: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """The study into ``out``: ``cells.csv`` (every run), ``goodput.csv`` (:func:`max_goodput`), ``study.json`` (its
    inputs, the base config included) and the two figures; returns the two tables and the figures' paths. ``base``
    carries everything but the layout, policy and rate (its link and routers for the disaggregated layouts)."""
    from simulator.fleet.disagg import gpus_per_instance
    from simulator.results import write_csv, write_json

    if not slo.goodput_slo:
        raise UserError(f"--slo {slo}: the study needs per-request bounds with a percentage, e.g. \"{DEFAULT_SLO}\"")
    base = base.replace(goodput_slo=slo.goodput_slo)
    out = Path(out)
    plan = layouts(gpus, splits, gpus_per_instance(base.cost.profile))
    cells = run_study(study_cells(base, plan, policies, sorted(rates_per_gpu)), workers, cluster)
    table = max_goodput(cells, slo.bound)
    write_csv(out / "cells.csv", cells)
    write_csv(out / "goodput.csv", table)
    write_json(out / "study.json", {"gpus": gpus, "layouts": [layout.name for layout in plan], "policies": list(policies),
                                    "rates_per_gpu": sorted(rates_per_gpu), "slo": str(slo), "target": slo.bound,
                                    "frontend": "left out (without_frontend)", "base": base.to_dict()})
    figures = [plot_attainment(cells, slo, out / "attainment.png"), plot_goodput(table, slo, out / "goodput.png")]
    return cells, table, figures
