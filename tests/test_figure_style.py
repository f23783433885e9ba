"""Figures agree: one policy, one colour and one marker in every figure the project draws (the demo, the sweep's,
compare's, tune's and validate's figures), from one place (:func:`simulator.studies.plots.policy_style`);
plain-number ticks on every log axis; multi-panel figures in grids a page holds, titled by the caller."""
from __future__ import annotations

import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.markers import MarkerStyle  # noqa: E402

from simulator.studies import compare, demo, plots, specs, tune  # noqa: E402
from simulator.studies.plots import POLICY_STYLES, plain_log_ticks, policy_style, policy_styles, style_key  # noqa: E402
from tests.conftest import REPO  # noqa: E402

POLICIES = ["no-spec", "fixed-k:1", "fixed-k:3", "fixed-k:5", "goodput:5", "threshold:3/max_batch=16"]
RATES = [1.0, 2.0, 4.0, 8.0]


@pytest.fixture
def figures(monkeypatch):
    """Every figure a plot function closes (save_figure closes what it saved), kept open for inspection; files are
    still written. Closed for real at the end."""
    kept: list = []
    real_close = plt.close

    def keep(fig=None):
        kept.append(fig if fig is not None else plt.gcf())

    monkeypatch.setattr(plt, "close", keep)
    yield kept
    for fig in kept:
        real_close(fig)


def sweep_summary(policies=POLICIES, seeds=(0, 1), scale: float = 1.0) -> pd.DataFrame:
    """A sweep's summary as sweep writes it, small: latency grows with rate, each policy a little apart, latencies
    between about 1.5 and 4 s (a narrow log axis: matplotlib's default would print 2x10^0 there)."""
    rows = []
    for i, policy in enumerate(policies):
        for rate in RATES:
            for seed in seeds:
                latency = scale * (1.5 + 0.3 * rate * (1 + 0.1 * i) + 0.01 * seed)
                rows.append({"policy": policy, "policy_name": policy.split(":")[0].split("/")[0], "rate": rate,
                             "seed": seed, "mean_latency": latency, "p99_latency": 1.6 * latency,
                             "mean_norm_latency": latency / 400, "p99_norm_latency": 1.6 * latency / 400,
                             "mean_ttft": latency / 10, "profile_method": "measured"})
    return pd.DataFrame(rows)


def drawn(fig) -> list[tuple[str, tuple, str]]:
    """(spec, RGBA colour, marker) of every line and scatter of ``fig`` named after a policy (its label's first word,
    a leading "_" and a trailing "(...)" aside)."""
    keys = {style_key(p) for p in POLICIES}
    out = []
    for ax in fig.axes:
        for artist in [*ax.get_lines(), *ax.collections]:
            label = str(artist.get_label()).lstrip("_")
            word = label.split(" ")[0] if label else ""
            if not word or style_key(word) not in keys:
                continue
            if isinstance(artist, Line2D):
                out.append((word, to_rgba(artist.get_color()), artist.get_marker()))
            elif isinstance(artist, PathCollection):
                out.append((word, tuple(artist.get_facecolor()[0]), _scatter_marker(artist)))
    return out


def _scatter_marker(collection: PathCollection) -> str:
    """The marker whose path a scatter draws (compared by vertices)."""
    path = collection.get_paths()[0]
    for marker in MarkerStyle.filled_markers + ("*",):
        style = MarkerStyle(marker)
        expected = style.get_path().transformed(style.get_transform())
        if expected.vertices.shape == path.vertices.shape and np.allclose(expected.vertices, path.vertices):
            return marker
    return "?"


def expected(spec: str) -> tuple[tuple, str]:
    style = policy_style(spec)
    return to_rgba(style["color"]), style["marker"]


def all_figures(tmp_path, figures) -> dict[str, list]:
    """Every figure function of the project on tiny frames: name -> the figures it drew."""
    summary = sweep_summary()
    drawn_by: dict[str, list] = {}

    def run(name, call):
        before = len(figures)
        call()
        drawn_by[name] = figures[before:]

    run("sweep latency_vs_rate", lambda: plots.plot_latency_vs_rate(summary, tmp_path / "l.png"))
    run("sweep speedup", lambda: plots.plot_speedup(summary, tmp_path / "s.png"))
    table = demo.mean_table(summary)
    run("demo crossover", lambda: demo.plot_panels([("engine", "pricing", 8.0, table)], tmp_path / "c.png"))
    run("compare sweeps", lambda: compare.plot_sweeps(summary, sweep_summary(scale=1.1), ("A", "B"),
                                                      tmp_path / "cmp.png"))
    slo = specs.parse_slo("mean_latency<=3")
    analysis = tune.analyse(summary, slo)
    run("tune", lambda: tune.plot_tradeoff(analysis, slo, tmp_path / "t.png", summary, RATES))
    return drawn_by


def test_policy_style_is_the_base_policy_s_and_fixed_k_keeps_its_k():
    assert policy_style("goodput:5") == policy_style("goodput") == policy_style("goodput:2/bonus=1.3") \
        == policy_style("goodput:5 acceptance_rate=0.5") == {"color": "tab:red", "marker": "o"}
    assert policy_style("fixed-k:3/max_batch=16") == policy_style("fixed-k:3") != policy_style("fixed-k:1")
    assert policy_style("threshold:3") == policy_style("threshold:5/max_batch=4") == policy_style("threshold")
    assert policy_style("no-spec")["color"] == "black"
    # every built-in policy apart from every other in colour and in marker
    colors = [c for c, _ in POLICY_STYLES.values()]
    markers = [m for _, m in POLICY_STYLES.values()]
    assert len(set(colors)) == len(colors) and len(set(markers)) == len(markers)


def test_an_unknown_policy_s_style_is_stable_and_not_from_plotting_order():
    names = ["my-policy:3", "lookahead", "eagle:4/depth=2", "fixed-k:9"]
    first = [policy_style(n) for n in names]
    assert [policy_style(n) for n in reversed(names)] == first[::-1]
    assert policy_style("my-policy:7/x=1") == policy_style("my-policy:3")
    builtin = {c for c, _ in POLICY_STYLES.values()}
    assert all(style["color"] not in builtin for style in first)
    assert len({(s["color"], s["marker"]) for s in first}) > 1
    # not Python's salted hash: another interpreter with another hash seed gives the same styles
    code = f"from simulator.studies.plots import policy_style; print([policy_style(n) for n in {names!r}])"
    for seed in ("1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert out.strip() == repr(first)


def test_series_of_one_policy_are_told_apart_by_line_style_only():
    styles = policy_styles(["goodput:5", "no-spec", "goodput:3", "goodput:10"])
    assert {s["color"] for n, s in styles.items() if n.startswith("goodput")} == {"tab:red"}
    assert [styles[n]["linestyle"] for n in ("goodput:3", "goodput:5", "goodput:10")] == ["-", "--", ":"]
    assert styles["no-spec"]["linestyle"] == "-"
    assert policy_styles(["goodput:10", "goodput:3", "goodput:5"]) == {n: styles[n] for n in
                                                                        ("goodput:10", "goodput:3", "goodput:5")}


def test_every_figure_draws_a_policy_in_the_same_colour_and_marker(tmp_path, figures):
    drawn_by = all_figures(tmp_path, figures)
    seen: dict[str, set] = {}
    for name, figs in drawn_by.items():
        assert figs, f"{name} drew no figure"
        styles = [s for fig in figs for s in drawn(fig)]
        keys_drawn = {style_key(spec) for spec, _, _ in styles}
        assert {style_key(p) for p in POLICIES} <= keys_drawn, f"{name}: drew only {sorted(keys_drawn)}"
        for spec, color, marker in styles:
            assert (color, marker) == expected(spec), f"{name}: {spec} drawn {color} {marker!r}"
            seen.setdefault(style_key(spec), set()).add((color, marker))
    assert all(len(v) == 1 for v in seen.values()), seen
    # the case: no-spec black and fixed k = 1 blue in the demo as in the sweep
    demo_styles = {spec: (c, m) for spec, c, m in drawn(drawn_by["demo crossover"][0])}
    assert demo_styles["no-spec"] == (to_rgba("black"), "s")
    assert demo_styles["fixed-k:1"] == (to_rgba("tab:blue"), "v")


def test_validate_draws_a_policy_in_the_same_colour_and_marker(tmp_path, figures):
    pytest.importorskip("torch")
    from profiles.validation import validate

    rows = [{"metric": metric, "policy": policy, "rate": rate, "real": rate, "sim": 1.1 * rate,
             "sim_calibrated": 1.05 * rate}
            for metric in ("mean_latency", "mean_ttft") for policy in POLICIES for rate in RATES]
    validate.plot(pd.DataFrame(rows), tmp_path / "validate.png", "validate")
    assert (tmp_path / "validate.png").is_file()
    styles = drawn(figures[-1])
    assert {style_key(s) for s, _, _ in styles} == {style_key(p) for p in POLICIES}
    for spec, color, marker in styles:
        assert (color, marker) == expected(spec), f"validate: {spec} drawn {color} {marker!r}"


def tick_texts(fig) -> list[str]:
    """Rendered tick labels (major and minor) of every log axis of ``fig``."""
    fig.canvas.draw()
    texts = []
    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                lo, hi = sorted(axis.get_view_interval())
                texts += [t.get_text() for t in axis.get_ticklabels(which="both") if lo <= t.get_position()[
                    0 if axis is ax.xaxis else 1] <= hi]
    return texts


def assert_plain(texts: list[str], where: str) -> None:
    shown = [t for t in texts if t]
    assert len(shown) >= 2, f"{where}: fewer than two tick labels on its log axes: {texts}"
    for text in shown:
        assert not any(s in text for s in ("\\times", "^", "$", "e+", "e-")), f"{where}: tick label {text!r}"
        float(text)  # a plain number


def test_every_log_axis_has_plain_number_ticks(tmp_path, figures):
    drawn_by = all_figures(tmp_path, figures)
    rows = compare.vllm_io.side_by_side({"median_ttft_ms": 120.0, "p99_ttft_ms": 900.0, "median_tpot_ms": 11.0,
                                         "p99_tpot_ms": 30.0}, {"median_ttft_ms": 150.0, "p99_ttft_ms": 700.0,
                                                                "median_tpot_ms": 12.0, "p99_tpot_ms": 25.0},
                                        ("A", "B"))
    compare.plot_figures(rows, ("A", "B"), tmp_path / "bars.png")
    drawn_by["compare bars"] = [figures[-1]]
    logged = 0
    for name, figs in drawn_by.items():
        for fig in figs:
            if any("log" in (ax.get_xscale(), ax.get_yscale()) for ax in fig.axes):
                logged += 1
                assert_plain(tick_texts(fig), name)
    assert logged >= 4  # the sweep's latency, the demo's, compare's two


@pytest.mark.parametrize("lo, hi", [(1.1, 1.8), (1.5, 4.0), (0.8, 30.0), (2e-5, 3e-4), (100.0, 3e7)])
def test_plain_log_ticks_on_narrow_and_wide_axes(lo, hi):
    fig, ax = plt.subplots()
    ax.plot([lo, hi], [lo, hi])
    plain_log_ticks(ax, "both")
    assert ax.get_xscale() == ax.get_yscale() == "log"
    texts = tick_texts(fig)
    assert_plain(texts, f"{lo}..{hi}")
    assert sum(bool(t) for t in texts) <= 2 * 10, f"{lo}..{hi}: labels that run into each other: {texts}"
    plt.close(fig)


def test_the_profile_fit_figure_has_plain_log_ticks(tmp_path, figures):
    from profiles.cli import plot_fit
    from simulator.costs.profile_table import read_profile

    plot_fit(read_profile(REPO / "profiles" / "data" / "cpu__smollm2-135m__smollm2-draft.csv"), str(tmp_path / "f.png"))
    assert_plain(tick_texts(figures[-1]), "profile fit")


def panel(i: int) -> tuple[str, str, float, pd.DataFrame]:
    return (f"panel {i}", "", 8.0, demo.mean_table(sweep_summary(seeds=(0,), scale=1 + i / 10)))


@pytest.mark.parametrize("n, shape", [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (7, (3, 3)), (9, (3, 3)),
                                      (12, (4, 3))])
def test_panels_are_laid_out_in_a_grid_a_page_holds(tmp_path, figures, n, shape):
    demo.plot_panels([panel(i) for i in range(n)], tmp_path / "grid.png", title=f"{n} panels")
    fig = figures[-1]
    assert len(fig.axes) == n
    fig.canvas.draw()
    rows = {round(ax.get_position().y0, 3) for ax in fig.axes}
    columns = {round(ax.get_position().x0, 3) for ax in fig.axes}
    assert (len(rows), len(columns)) == shape
    assert fig.get_figwidth() <= 15.0
    assert [ax.get_title() for ax in fig.axes] == [f"panel {i}" for i in range(n)]
    assert fig.get_suptitle() == f"{n} panels"
    assert (tmp_path / "grid.png").is_file()


def test_the_demo_keeps_its_title_and_the_smartspec_notebook_says_what_its_panels_show(tmp_path, figures):
    import json

    demo.plot_panels([panel(0)], tmp_path / "one.png")
    assert figures[-1].get_suptitle() == demo.DEMO_TITLE and "acceptance 0.7" in demo.DEMO_TITLE
    notebook = json.loads((REPO / "notebooks" / "smartspec_reproduction.ipynb").read_text())
    [cell] = [c for c in notebook["cells"] if "plot_panels(panels" in "".join(c["source"])]
    source = "".join(cell["source"])
    assert "title=" in source and "ACCEPTANCE" in source.split("title =")[1]


def test_the_sweep_figure_says_the_metric_its_table_prints(tmp_path, figures):
    """Its title, axes and the sweep's printed table (simulator.studies.sweep.SWEEP_METRIC) say one metric."""
    from simulator.studies.sweep import SWEEP_METRIC, TABLE_METRICS

    [fig] = all_figures(tmp_path, figures)["sweep latency_vs_rate"]
    assert fig.get_suptitle().startswith("Normalised latency (per output token) versus request rate")
    assert fig.axes[0].get_ylabel() == "mean normalised latency (ms/token)"
    assert (SWEEP_METRIC, TABLE_METRICS[SWEEP_METRIC][:2]) == ("mean_norm_latency",
                                                              ("mean normalised latency", "ms per output token"))
