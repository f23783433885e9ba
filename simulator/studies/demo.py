"""The default demo (``python run_sim.py`` with no arguments): where does speculation stop paying, and does
goodput-adaptive speculation follow the best choice at every load? (SmartSpec, Liu et al., arXiv 2406.14066.)

Four engines, one panel each:

1. ``multi-query``: Llama-2-7B with a 68M draft on one H200, the measured profile of this project's optimized engine
   (in-place KV cache, CUDA graphs; ``profiles/data/h200-optimized__llama-2-7b__llama-68m.csv``), which reads each
   sequence's KV cache once for its k + 1 query tokens, as vLLM v1, SGLang and TensorRT-LLM do;
2. ``batch-expansion``: the analytical (roofline) profile of the same pair and GPU whose verification re-reads
   the cache for every query token, as vLLM v0's scorer and SmartSpec's fork did
   (``profiles/data/h200-analytical-batch-expansion__llama-2-7b__llama-68m.csv``). Nothing measured here
   verifies by batch expansion, so this panel is a model, and the demo says so;
3. ``vLLM 0.11`` and 4. ``SGLang 0.5``: Qwen3-8B with its EAGLE-3 head on one H100, priced by the speculative costs
   fitted to each engine's own published speculative runs (SpecDecode-Bench, arXiv 2601.11580: Fig. 1's vLLM and
   Fig. 2's SGLang sweeps; :mod:`profiles.spec_calibrate`), chunked prefill with an 8,192-token budget as both run it.

Each panel sweeps Poisson arrivals with ShareGPT-like lengths (lognormal, medians 512 prompt and 415 output
tokens), acceptance 0.7, at fractions of no-spec's saturation rate (measured first by one burst run on that
profile, so a re-measured profile needs no new numbers here), for no-spec, fixed k = 1, 3, 5 and goodput. It
prints mean latency, where each fixed k stops paying with its bands (:mod:`simulator.studies.bands`: acceptance x0.8
and x1.2 by two more sweeps of the fixed k; and, for a profile fitted to an engine's speculative runs, the band its
held-out speed-up error spans), the best-static envelope and how close goodput keeps to it, and writes the figures.
The workload is synthetic: every machine gets the same numbers.
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
#: Chunked prefill with vLLM V1's and SGLang's budget: how the engines the fitted panels describe run.
CHUNKED = {"scheduler": "chunked-prefill", "max_num_batched_tokens": 8192}
#: What a panel's fit could not identify, said beside its engine.
SPEEDUPS_ONLY = {"SGLang 0.5": "\n   SGLang's published runs are speed-ups only: its absolute step times, and so its "
                               "saturation rate, are not identified (its per-sequence host time fitted several times "
                               "vLLM's); "
                               "read its rates as fractions of its own saturation"}
#: (panel name, profile, the fields it runs with) of the demo: one engine per panel (module docstring).
DEMO_PROFILES = [
    ("multi-query", str(DATA / "h200-optimized__llama-2-7b__llama-68m.csv"), {}),
    ("batch-expansion", str(DATA / "h200-analytical-batch-expansion__llama-2-7b__llama-68m.csv"), {}),
    ("vLLM 0.11", str(DATA / "h100-80gb-vllm0.11__qwen3-8b__eagle3-qwen3-8b.csv"),
     {"speculative_method": "eagle3", **CHUNKED}),
    ("SGLang 0.5", str(DATA / "h100-80gb-sglang0.5__qwen3-8b__eagle3-qwen3-8b.csv"),
     {"speculative_method": "eagle3", **CHUNKED}),
]
DEMO_PROFILE = DEMO_PROFILES[0][1]
#: Request rates as fractions of no-spec's saturation rate on each profile.
DEMO_FRACTIONS = [0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.6]
STATIC_POLICIES = ["no-spec", "fixed-k:1", "fixed-k:3", "fixed-k:5"]
DEMO_POLICIES = STATIC_POLICIES + ["goodput:5"]


def demo_config(profile: str = DEMO_PROFILE, **fields: object) -> SimConfig:
    """The demo's run on ``profile`` (``fields``: what the profile's engine runs with, :data:`DEMO_PROFILES`)."""
    return SimConfig.of(profile=profile, arrival="poisson", rate=1.0, num_requests=250, length_dist="lognormal",
                        prompt_len=512, output_len=415, length_sigma=0.6, max_prompt_len=4096, max_output_len=2048,
                        acceptance="constant", acceptance_rate=0.7, max_num_seqs=256, seed=0, **fields)


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
DEMO_TITLE = "Where speculation stops paying: four engines, acceptance 0.7"
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


def acceptance_ratios(base: SimConfig, rates: list[float], baseline: pd.Series, out: Path,
                      workers: int) -> dict[float, pd.DataFrame]:
    """The acceptance band's sweeps (:mod:`simulator.studies.bands`): each fixed k at ``rates`` with the acceptance
    scaled by each of :data:`~simulator.studies.bands.ACCEPTANCE_FACTORS`, into ``out``-x<factor> folders; per factor,
    their mean latency over ``baseline`` (no-spec's, which acceptance does not change) at each rate."""
    from simulator.studies.bands import ACCEPTANCE_FACTORS, scaled_acceptance
    from simulator.studies.executors import LocalExecutor
    from simulator.studies.sweep import build_cells, run_sweep

    out_of = {}
    with LocalExecutor(workers) as executor:
        for factor in ACCEPTANCE_FACTORS:
            cells = build_cells(scaled_acceptance(base, factor), rates, STATIC_POLICIES[1:], [0])
            table = mean_table(run_sweep(cells, out.with_name(f"{out.name}-acceptance-x{factor:g}"), executor))
            out_of[factor] = table.div(baseline, axis=0)
    return out_of


def band_lines(table: pd.DataFrame, saturation: float, error: float | None,
               by_factor: dict[float, pd.DataFrame]) -> list[str]:
    """Each fixed k's crossover against no-spec with its bands, in words (rates as fractions of ``saturation`` and in
    req/s)."""
    from simulator.studies.bands import band_words, crossover_band

    rates = table.index.to_numpy(float)
    fractions = rates / saturation

    def show(fraction: float) -> str:
        return f"{fraction:.2g}x saturation ({fraction * saturation:.3g} req/s)"

    lines = []
    for policy in STATIC_POLICIES[1:]:
        ratio = (table[policy] / table["no-spec"]).to_numpy(float)
        band = crossover_band(fractions, ratio, error, {f: t[policy].to_numpy(float) for f, t in by_factor.items()})
        lines.append(f"  {policy}: {band_words(band, show, fractions[0], fractions[-1])}")
    return lines


def run_demo(out: str, workers: int, quiet: bool) -> int:
    from simulator.costs.cost_model import load_cost_model
    from simulator.results import check_out_dir
    from simulator.studies.bands import engine_name, fit_error
    from simulator.studies.sweep import sweep_and_plot

    check_out_dir(out, kind="demo")  # its panels are sweeps in folders of their own
    panels, findings = [], []
    print(f"specsim demo: where speculation stops paying (SmartSpec, arXiv 2406.14066), {len(DEMO_POLICIES)} policies "
          f"x {len(DEMO_FRACTIONS)} rates x {len(DEMO_PROFILES)} engines, "
          f"{demo_config().workload.num_requests} requests per run, acceptance "
          f"{demo_config().speculative.acceptance_rate} (and x0.8, x1.2 for the fixed k's bands)")
    for name, profile, fields in DEMO_PROFILES:
        base = demo_config(profile, **fields)
        cost = load_cost_model(profile, base.cost.fitter)
        engine, error = engine_name(profile), fit_error(profile)
        label = f"{Path(profile).name} ({cost.method}; {cost.verification} verification)"
        saturation = saturation_rate(base)
        rates = fraction_rates(saturation)
        folder = Path(out) / name.replace(" ", "-")
        print(f"\n== {name}: {label}" + (f"\n   engine: {engine}, speculative costs fitted to its own runs; held-out "
                                        f"speed-up error up to {error:.3f}" + SPEEDUPS_ONLY.get(name, "") if engine
                                        else "")
              + f"\n   no-spec saturates near {saturation:.3g} req/s; rates {', '.join(f'{r:g}' for r in rates)} req/s")
        summary, figures = sweep_and_plot(base, DEMO_POLICIES, rates, [0], {}, folder, workers, quiet=quiet)
        table = mean_table(summary)
        print("mean latency (s); rows: request rate (req/s)")
        print(table[DEMO_POLICIES].to_string(float_format=lambda v: f"{v:9.3f}"))
        cross = crossovers(table[STATIC_POLICIES], saturation)
        by_factor = acceptance_ratios(base, rates, table["no-spec"], folder, workers)
        print("where each fixed k stops paying against no-spec (mean latency), with its bands: "
              + ("the fit's (its held-out speed-up error) and " if error is not None else "no fit band (a profile not "
                 "fitted to speculative runs) and ") + "acceptance x0.8 to x1.2:")
        print("\n".join(band_lines(table, saturation, error, by_factor)))
        env = envelope(table[DEMO_POLICIES])
        light = table["no-spec"].iloc[0] / env["best_latency"].iloc[0]
        print(f"light load: the best static choice ({env['best_static'].iloc[0]}) is {light:.2f}x faster than no-spec; "
              f"best static per rate: {', '.join(env['best_static'])}")
        ratio = env["goodput:5 / best"]
        print(f"goodput / best static: {ratio.min():.3f} to {ratio.max():.3f} across the rates")
        title = f"{name}: {engine}" if engine else f"{name} verification"
        panels.append((title, label.replace(" (", "\n("), saturation, table[DEMO_POLICIES]))
        heavy = table[STATIC_POLICIES].iloc[-1]
        fastest = heavy[STATIC_POLICIES[1:]].idxmin()
        findings.append(f"- {name} ({engine or cost.method}): " + crossover_finding(cross)
                        + f"; at the heaviest load the best fixed k ({fastest}) is "
                          f"{heavy['no-spec'] / heavy[fastest]:.2f}x as fast as no-spec"
                        + (f"; goodput within {100 * (ratio.max() - 1):.1f}% of the best static choice at every rate"
                           + (" (or better)" if ratio.min() < 1 else "") if ratio.max() > 1 else
                           "; goodput as fast as the best static choice or faster at every rate"))
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
          "that way. The vLLM and SGLang panels price one model and head with each engine's own speculative costs, "
          "fitted to its published runs: how much speculation pays, and where it stops, is the engine's as much as "
          "the model's; the bands above say how far the fit's held-out error and an acceptance 20% off move each "
          "crossover.")
    return 0
