"""The default demo (``python run_sim.py`` with no arguments): where does speculation stop paying, and does
goodput-adaptive speculation follow the best choice at every load? (SmartSpec, Liu et al., arXiv 2406.14066.)

Llama-2-7B with a 68M draft on one H200, in three engines: two that differ in how they verify the k + 1 tokens of
a sequence (:mod:`simulator.costs.profile_table`), and the engine people deploy:

1. ``multi-query``: the measured profile of this project's optimized engine (in-place KV cache, CUDA graphs;
   ``profiles/data/h200-optimized__llama-2-7b__llama-68m.csv``), which reads each sequence's KV cache once for
   its k + 1 query tokens, as vLLM v1, SGLang and TensorRT-LLM do;
2. ``batch-expansion``: the analytical (roofline) profile of the same pair and GPU whose verification re-reads
   the cache for every query token, as vLLM v0's scorer and SmartSpec's fork did
   (``profiles/data/h200-analytical-batch-expansion__llama-2-7b__llama-68m.csv``). Nothing measured here
   verifies by batch expansion, so this panel is a model, and the demo says so;
3. ``vLLM-calibrated``: the roofline with the efficiencies and overheads that ``run_sim.py calibrate`` fitted to
   vLLM's own benchmark results of Llama-3-8B on an H100 (``profiles/data/vllm_lambda/``), moved to this pair and
   GPU by their datasheet and architecture (``profiles/data/h200-vllm__llama-2-7b__llama-68m.csv``; a transfer,
   not a fit; vLLM's per-pass host overhead, fitted on its target passes, is assumed for the draft's too, which
   makes a 68M draft pass cost about half a 7B target pass at small batch).

Each panel sweeps Poisson arrivals with ShareGPT-like lengths (lognormal, medians 512 prompt and 415 output
tokens), acceptance 0.7, at fractions of no-spec's saturation rate (measured first by one burst run on that
profile, so a re-measured profile needs no new numbers here), for no-spec, fixed k = 1, 3, 5 and goodput. It
prints mean latency, where each fixed k crosses above no-spec, the best-static envelope and how close goodput
keeps to it, and writes the figures. The workload is synthetic: every machine gets the same numbers.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from simulator.config import SimConfig
from simulator.studies.sweep import crossovers, payoff_words

__all__ = ["DEMO_POLICIES", "DEMO_PROFILES", "crossovers", "demo_config", "envelope", "fraction_rates", "mean_table",
           "plot_panels", "run_demo", "saturation_rate"]

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

DATA = Path(__file__).resolve().parents[2] / "profiles" / "data"
#: (panel name, profile) of the demo: one engine per verification pricing.
DEMO_PROFILES = [
    ("multi-query", str(DATA / "h200-optimized__llama-2-7b__llama-68m.csv")),
    ("batch-expansion", str(DATA / "h200-analytical-batch-expansion__llama-2-7b__llama-68m.csv")),
    ("vLLM-calibrated", str(DATA / "h200-vllm__llama-2-7b__llama-68m.csv")),
]
DEMO_PROFILE = DEMO_PROFILES[0][1]
#: Request rates as fractions of no-spec's saturation rate on each profile.
DEMO_FRACTIONS = [0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.6]
STATIC_POLICIES = ["no-spec", "fixed-k:1", "fixed-k:3", "fixed-k:5"]
DEMO_POLICIES = STATIC_POLICIES + ["goodput:5"]


def demo_config(profile: str = DEMO_PROFILE) -> SimConfig:
    return SimConfig.of(profile=profile, arrival="poisson", rate=1.0, num_requests=250, length_dist="lognormal",
                        prompt_len=512, output_len=415, length_sigma=0.6, max_prompt_len=4096, max_output_len=2048,
                        acceptance="constant", acceptance_rate=0.7, max_num_seqs=256, seed=0)


def saturation_rate(base: SimConfig, num_requests: int = 500) -> float:
    """No-spec's saturation rate (requests/s) on ``base``'s profile and lengths: the throughput of one burst of
    ``num_requests`` arriving at once (every step runs as full a batch as memory and ``max_num_seqs`` allow)."""
    from simulator.core.runner import run_simulation

    burst = base.replace(policy="no-spec", rate=1e6, num_requests=num_requests, duration=None)
    return float(run_simulation(burst).summary["throughput"])


def fraction_rates(saturation: float, fractions: list[float] = DEMO_FRACTIONS) -> list[float]:
    """Rates at ``fractions`` of ``saturation``, rounded to 3 significant digits (readable, still distinct)."""
    return [float(f"{f * saturation:.3g}") for f in fractions]


def mean_table(summary: pd.DataFrame, column: str = "mean_latency") -> pd.DataFrame:
    """Rates down, policies across: ``column`` averaged over seeds."""
    return summary.groupby(["rate", "policy"])[column].mean().unstack("policy").sort_index()


def envelope(table: pd.DataFrame, static: list[str] = STATIC_POLICIES) -> pd.DataFrame:
    """Per rate: the best static policy, its latency, and each adaptive policy's latency over it."""
    import pandas as pd

    present = [p for p in static if p in table.columns]
    best = table[present].min(axis=1)
    out = pd.DataFrame({"best_static": table[present].idxmin(axis=1), "best_latency": best})
    for policy in table.columns:
        if policy not in present:
            out[f"{policy} / best"] = table[policy] / best
    return out


def crossover_finding(cross: dict[str, float]) -> str:
    """The fixed k's :func:`crossovers` (fractions of saturation) in words: those slower than no-spec already at the
    lightest load swept, those that become slower as load grows (from the earliest crossing), those never slower up to
    the heaviest; "every fixed k" where one phrase holds them all."""
    groups = {"at once": [p for p, v in cross.items() if v == 0], "later": [p for p, v in cross.items() if v > 0],
              "never": [p for p, v in cross.items() if math.isnan(v)]}
    said = {"at once": "slower than no-spec already at the lightest load swept",
            "later": "slower than no-spec as load grows (from "
                     f"{min((cross[p] for p in groups['later']), default=0):.2f}x no-spec's saturation)",
            "never": f"never slower than no-spec up to {DEMO_FRACTIONS[-1]:g}x no-spec's saturation"}
    return "; ".join(f"{'every fixed k' if len(names) == len(cross) else ', '.join(names)} {said[key]}"
                     for key, names in groups.items() if names)


#: The demo's figure title: true of its panels (one engine each, acceptance 0.7); other panels want their own.
DEMO_TITLE = "Where speculation stops paying: Llama-2-7B + 68M draft, H200, acceptance 0.7"
#: Panels per row of :func:`plot_panels` at most, and the figure's width (inches) at most: a grid a page holds.
MAX_COLUMNS, MAX_WIDTH = 3, 15.0


def panel_grid(n: int) -> tuple[int, int]:
    """(rows, columns) of ``n`` panels: one row up to :data:`MAX_COLUMNS`, else rows of :data:`MAX_COLUMNS` (four
    panels: two by two)."""
    columns = n if n <= MAX_COLUMNS else 2 if n == 4 else MAX_COLUMNS
    return -(-n // columns), columns


def plot_panels(panels: list[tuple[str, str, float, pd.DataFrame]], path: str | Path, title: str = DEMO_TITLE) -> str:
    """Mean latency versus rate (as a fraction of no-spec's saturation), one panel per (title, subtitle,
    saturation, :func:`mean_table`), the best-static envelope drawn broad and grey; panels in a grid of at most
    :data:`MAX_COLUMNS` columns (:func:`panel_grid`), one legend under them, ``title`` above: say what the panels
    show (the default is the demo's). Each policy in its colour and marker
    (:func:`simulator.studies.plots.policy_styles`), plain-number ticks on the log latency axis."""
    from simulator.studies.plots import ENVELOPE_STYLE, plain_log_ticks, plt, policy_styles, save_figure

    if not panels:
        raise ValueError("plot_panels: no panels")
    rows, columns = panel_grid(len(panels))
    width = min(MAX_WIDTH, 5.0 * columns + 0.5)
    fig, axes = plt.subplots(rows, columns, figsize=(width, 3.9 * rows + 0.9), squeeze=False, layout="constrained")
    styles = policy_styles(list(dict.fromkeys(p for *_, table in panels for p in table.columns)))
    for ax, (name, subtitle, saturation, table) in zip(axes.flat, panels):
        x = table.index.to_numpy(float) / saturation
        for policy in table.columns:
            lw = 2.2 if policy.split(":")[0] not in ("no-spec", "fixed-k") else 1.2
            ax.plot(x, table[policy], ms=4, lw=lw, label=policy, **styles[policy])
        best = table[[p for p in STATIC_POLICIES if p in table.columns]].min(axis=1)
        ax.plot(x, best, label="best static (envelope)", **ENVELOPE_STYLE)
        ax.set_xlabel(f"request rate / no-spec saturation ({saturation:.3g} req/s)")
        ax.set_ylabel("mean latency (s)")
        plain_log_ticks(ax, "y")
        ax.set_title(f"{name}\n{subtitle}" if subtitle else name, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.remove()
    legend = {}
    for ax in axes.flat[:len(panels)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncol=min(len(legend), 8), fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)


def run_demo(out: str, workers: int, quiet: bool) -> int:
    from simulator.costs.cost_model import load_cost_model
    from simulator.results import check_out_dir
    from simulator.studies.sweep import sweep_and_plot

    check_out_dir(out, kind="demo")  # its panels are sweeps in folders of their own
    panels, findings = [], []
    print(f"specsim demo: where speculation stops paying (SmartSpec, arXiv 2406.14066), {len(DEMO_POLICIES)} policies "
          f"x {len(DEMO_FRACTIONS)} rates x {len(DEMO_PROFILES)} engines, "
          f"{demo_config().workload.num_requests} requests per run, acceptance "
          f"{demo_config().speculative.acceptance_rate}")
    for name, profile in DEMO_PROFILES:
        base = demo_config(profile)
        cost = load_cost_model(profile, base.cost.fitter)
        label = f"{Path(profile).name} ({cost.method}; {cost.verification} verification)"
        saturation = saturation_rate(base)
        rates = fraction_rates(saturation)
        print(f"\n== {name}: {label}\n   no-spec saturates near {saturation:.3g} req/s; rates "
              f"{', '.join(f'{r:g}' for r in rates)} req/s")
        summary, figures = sweep_and_plot(base, DEMO_POLICIES, rates, [0], {}, Path(out) / name, workers, quiet=quiet)
        table = mean_table(summary)
        print("mean latency (s); rows: request rate (req/s)")
        print(table[DEMO_POLICIES].to_string(float_format=lambda v: f"{v:9.3f}"))
        cross = crossovers(table[STATIC_POLICIES], saturation)
        print("where each fixed k pays against no-spec (mean latency; rates as fractions of no-spec's saturation):")
        fractions = table.index.to_numpy(float) / saturation
        for policy in STATIC_POLICIES[1:]:
            ratio = (table[policy] / table["no-spec"]).to_numpy(float)
            print(f"  {policy}: {payoff_words(fractions, ratio, lambda f: f'{f:.2g}x saturation')}")
        env = envelope(table[DEMO_POLICIES])
        light = table["no-spec"].iloc[0] / env["best_latency"].iloc[0]
        print(f"light load: the best static choice ({env['best_static'].iloc[0]}) is {light:.2f}x faster than no-spec; "
              f"best static per rate: {', '.join(env['best_static'])}")
        ratio = env["goodput:5 / best"]
        print(f"goodput / best static: {ratio.min():.3f} to {ratio.max():.3f} across the rates")
        title = name if name.startswith("vLLM") else f"{name} verification"
        panels.append((title, label.replace(" (", "\n("), saturation, table[DEMO_POLICIES]))
        findings.append(f"- {name} ({cost.method}): " + crossover_finding(cross)
                        + f"; goodput within {100 * (ratio.max() - 1):.1f}% of the best static choice at every rate"
                        + (" (or better)" if ratio.min() < 1 else ""))
        for f in figures:
            print(f"figure: {f}")
    print(f"\nfigure: {plot_panels(panels, Path(out) / 'crossover.png')}")
    print("\nWhat this shows:")
    print("\n".join(findings))
    print("Why: a step pays k draft passes and verifies k + 1 tokens per sequence for an expected "
          "(1 - a^(k+1)) / (1 - a) of them. Batch expansion re-reads each sequence's KV cache for every verified "
          "token, so as the batch and its contexts grow, verification cost grows k + 1 times as fast as plain "
          "decoding and the rejected tokens' share of it outweighs the accepted ones; multi-query verification "
          "reads the cache once per sequence, so the extra tokens cost little more than their weight-bound matmul "
          "rows. The batch-expansion panel is an analytical (roofline) model: no engine measured here verifies "
          "that way. The vLLM-calibrated panel prices vLLM's own step costs (fitted to its public benchmark results, "
          "moved to this GPU and pair): its per-pass host overhead makes a 68M draft pass cost about half a "
          "7B target pass at small batch, so at light load a long proposal loses to no speculation, while at high load, "
          "where that overhead is shared by the batch, speculation still raises capacity: SmartSpec's finding "
          "turned around.")
    return 0
