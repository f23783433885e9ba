"""``compare``: two results side by side, or a vLLM benchmark replayed in the simulator.

- ``compare A B``: each of A and B is a ``simulate`` folder (``summary.json``), a sweep folder (``summary.csv``) or a
  ``vllm bench serve --save-result`` JSON file. Two sweeps: latency versus rate of both, per policy (A solid, B
  dashed) and a table of mean latency per rate and policy with B / A - 1. Otherwise: a table of every figure both
  have (TTFT, TPOT, ITL, E2EL in ms, throughputs) with B / A - 1, and a bar figure of the medians and p99s.
- ``compare RESULT.json --out DIR [config flags]``: the vLLM result's workload (:func:`vllm_io.replay_trace`: its
  successful requests' input and output lengths in order, arrivals as recorded or drawn at its ``request_rate`` and
  ``burstiness``, its ``max_concurrency``) is simulated with the given config (profile, policy, k, ...) into ``DIR``,
  then simulated is printed against measured per metric (and ``DIR/compare.csv``, ``DIR/compare.png``).

Given ``--out DIR``, both write ``DIR/report.html`` last (:func:`simulator.studies.report.write_report`): the table, the
figure, the inputs' configs and profiles (a replay: its config and its profile's method and calibration) and their
warnings (saturation, ignored requests, anything printed).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from policies.errors import UserError
from simulator.studies import vllm_io


def _load(path_text: str) -> tuple[str, Any]:
    """("run", summary dict) | ("sweep", summary frame) | ("vllm", result dict) of a compare input."""
    path = Path(path_text)
    if path.is_dir():
        if (path / "summary.csv").is_file():
            from simulator.studies.plots import SUMMARY_COLUMNS

            return "sweep", read_result_csv(path / "summary.csv", SUMMARY_COLUMNS)
        if (path / "summary.json").is_file():
            try:
                return "run", json.loads((path / "summary.json").read_text())
            except (OSError, ValueError) as exc:
                raise UserError(f"compare: {path / 'summary.json'}: not a readable summary ({exc})") from None
        raise UserError(f"compare: {path}: no summary.json (a simulate folder) nor summary.csv (a sweep folder)")
    if path.is_file():
        return "vllm", vllm_io.read_vllm_result(path)
    raise UserError(f"compare: {path}: not found")


def _figures(kind: str, data: Any) -> dict[str, float]:
    return vllm_io.vllm_figures(data) if kind == "vllm" else vllm_io.summary_figures(data)


def _names(a: str, b: str) -> tuple[str, str]:
    na, nb = Path(a).name or a, Path(b).name or b
    return (na, nb) if na != nb else (f"A: {a}", f"B: {b}")


def side_by_side(a: str, b: str, out: str | None) -> int:
    from simulator.results import check_out_dir
    from simulator.studies import report

    (ka, da), (kb, db) = _load(a), _load(b)
    names = _names(a, b)
    out_dir = check_out_dir(Path(out), "compare", "compare") if out else None
    if out_dir:
        report.remove_report(out_dir)
    if ka == "sweep" and kb == "sweep":
        table = _sweeps_table(da, db, names)
        heading = "mean latency (s), seeds averaged; rows: request rate (req/s), policy"
        print(heading)
        print(table.to_string(index=False, float_format=lambda v: f"{v:9.3f}"))
        if out_dir:
            _side_by_side_outputs(out_dir, (a, b), ((ka, da), (kb, db)), names, heading, table,
                                  lambda path: plot_sweeps(da, db, names, path))
        return 0
    if "sweep" in (ka, kb):
        raise UserError("compare: a sweep goes beside another sweep; a run beside a run or a vLLM result")
    table = vllm_io.side_by_side(_figures(ka, da), _figures(kb, db), names)
    if table.empty:
        raise UserError(f"compare: {a} and {b} have no figure in common")
    _print_table(table)
    if out_dir:
        _side_by_side_outputs(out_dir, (a, b), ((ka, da), (kb, db)), names, "every figure both have, with B / A - 1",
                              table, lambda path: plot_figures(table, names, path))
    return 0


def _side_by_side_outputs(out_dir: Path, paths: tuple[str, str], inputs: tuple[tuple[str, Any], tuple[str, Any]],
                          names: tuple[str, str], heading: str, table: pd.DataFrame,
                          draw: Callable[[Path], str]) -> None:
    """What ``compare A B --out DIR`` writes: ``compare.csv`` (``table``), ``compare.png`` (``draw(path)``) and last
    ``report.html``: the table and figure; each input's kind, its config (a run's ``config.json``) and profile; the
    warnings each input's summary records (saturation, ignored requests) and any printed meanwhile."""
    from simulator.results import write_csv
    from simulator.studies import report

    with report.recorded_warnings() as printed:
        write_csv(out_dir / "compare.csv", table)
        print(f"table: {out_dir / 'compare.csv'}")
        figure = draw(out_dir / "compare.png")
        print(f"figure: {figure}")
    warned, config, profiles = [], {}, []
    for path, name, (kind, data) in zip(paths, names, inputs):
        config[name] = f"{path} ({KINDS[kind]})"
        if kind == "sweep":
            warned += report.sweep_warnings(data, f"{name}: ")
            for profile in dict.fromkeys(data["profile"]) if "profile" in data else ():
                profiles.append(report.profile_info(profile, f"{name}: profile"))
        elif kind == "run":
            saved = _run_config(Path(path))
            if saved:
                config[f"{name}: config.json"] = saved
            warned += [m for m in (report.saturation_message(data, f"{name}: "),
                                   report.ignored_message(data, saved.get("block_size", "?"), f"{name}: ")) if m]
            if data.get("profile"):
                profiles.append(report.profile_info(data["profile"], f"{name}: profile"))
    report.write_report(out_dir / report.REPORT_NAME, f"compare: {names[0]} against {names[1]}",
                        [(heading, table), ("Figure", Path(figure))], warned + printed, config, profiles)
    print(f"report: {out_dir / report.REPORT_NAME}")


#: What each kind of compare input is, in a report.
KINDS = {"run": "a simulate folder", "sweep": "a sweep folder", "vllm": "a vllm bench serve result"}


def _run_config(folder: Path) -> dict[str, Any]:
    """A simulate folder's ``config.json`` by field name, whether written by concern or flat as before (empty when
    missing or unreadable: the report says less)."""
    from simulator.config import flat_fields

    path = folder / "config.json"
    try:
        return flat_fields(json.loads(path.read_text()), str(path))
    except (OSError, ValueError, UserError):
        return {}


def _print_table(table: pd.DataFrame) -> None:
    shown = table.copy()
    shown["relative difference"] = shown["relative difference"].map(
        lambda v: "" if not math.isfinite(v) else f"{v:+.1%}")
    print(shown.to_string(index=False, float_format=lambda v: f"{v:10.2f}"))


def _sweeps_table(a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str]) -> pd.DataFrame:
    ma = a.groupby(["rate", "policy"])["mean_latency"].mean().rename(names[0])
    mb = b.groupby(["rate", "policy"])["mean_latency"].mean().rename(names[1])
    table = pd.concat([ma, mb], axis=1).reset_index()
    table["relative difference"] = table[names[1]] / table[names[0]] - 1
    return table


def plot_sweeps(a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str], path: Path) -> str:
    """Mean latency against rate of two sweeps, each policy in its colour and marker
    (:func:`simulator.studies.plots.policy_style`), A solid and B dashed."""
    from simulator.studies.plots import finish_axis, plt, policy_style, save_figure

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for frame, name, style in ((a, names[0], "-"), (b, names[1], "--")):
        data = frame.groupby(["policy", "rate"])["mean_latency"].mean().reset_index()
        for policy, group in data.groupby("policy", sort=False):
            ax.plot(group["rate"], group["mean_latency"], ls=style, ms=4, label=f"{policy} ({name})",
                    **policy_style(policy))
    finish_axis(ax, "request rate (req/s)", "mean latency (s)", log_y=True)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{names[0]} (solid) against {names[1]} (dashed)")
    return save_figure(fig, path)


def plot_figures(table: pd.DataFrame, names: tuple[str, str], path: Path) -> str:
    """Median and p99 per metric of two results, side by side: two runs, not two policies, so in greys (B hatched),
    never in a colour that means a policy elsewhere; plain-number ticks on the log axis."""
    from simulator.studies.plots import finish_axis, plt, save_figure

    rows = table[table["figure"].str.match(r"(median|p99)_(ttft|tpot|itl|e2el)_ms")]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], rows[names[0]], width=0.4, label=names[0], color="0.35", edgecolor="0.2")
    ax.bar([i + 0.2 for i in x], rows[names[1]], width=0.4, label=names[1], color="0.8", edgecolor="0.2",
           hatch="//")
    ax.set_xticks(list(x), [f.removesuffix("_ms") for f in rows["figure"]], rotation=30, ha="right")
    finish_axis(ax, "", "milliseconds", log_y=True)
    ax.legend(fontsize=8)
    ax.set_title("median and p99 per metric")
    return save_figure(fig, path)


def replay(source: Path, base: Any, out: str) -> int:
    """Simulate the workload of vLLM result ``source`` under ``base`` (a config with the trace to be filled in) into
    ``out``, with the result's ``max_concurrency`` when it has one, and print simulated against measured (the
    simulated figures counted as vLLM counts them: :func:`vllm_io.vllm_style_figures`)."""
    from simulator.core.runner import write_result
    from simulator.fleet import run as run_config
    from simulator.results import prepare_out_dir, write_csv

    from simulator.studies import report

    data = vllm_io.read_vllm_result(source, replay=True)
    out_dir, lock = prepare_out_dir(out, "replay")
    with lock, report.recorded_warnings() as printed:
        report.remove_report(out_dir)
        trace = vllm_io.replay_trace(data, base.run.seed)
        trace_path = Path(out_dir) / "replayed_workload.csv"
        write_csv(trace_path, trace)
        concurrency = data["max_concurrency"]
        if concurrency is None:
            concurrency = base.workload.max_concurrency
        config = base.replace(arrival="trace", trace=str(trace_path), rate=None, trace_speedup=None,
                              max_concurrency=concurrency)
        result = run_config(config)
        write_result(result, out_dir, "csv")
        names = (f"measured ({source.name})", "simulated")
        simulated = vllm_io.vllm_style_figures(result.requests, trace["empty_output"], dict(config.run.goodput_slo),
                                               result.summary["mean_acceptance_length"])
        table = vllm_io.side_by_side(vllm_io.vllm_figures(data), simulated, names)
        write_csv(Path(out_dir) / "compare.csv", table)
        figure = plot_figures(table, names, Path(out_dir) / "compare.png") if len(table) else None
        replayed = (f"replayed {len(trace)} requests of {source} ({vllm_io.describe_replay(data, trace)}) with policy "
                    f"{config.speculative.policy}, profile {result.summary['profile_method']}")
        warned = [m for m in (report.saturation_message(result.summary, "the simulation is "),
                              report.ignored_message(result.summary, config.engine.block_size,
                                                     "the simulation: ")) if m]
        report.write_report(Path(out_dir) / report.REPORT_NAME, f"compare: {source.name} replayed in the simulator",
                            [("Replay", replayed), ("Simulated against measured, per metric (compare.csv)", table),
                             ("Figure", [Path(figure)] if figure else "no figure in common")],
                            warned + printed, {"vLLM result": str(source), **config.to_dict(flat=True)},
                            [report.profile_info(config.cost.profile)])
    print(replayed)
    _print_table(table)
    for message in warned:
        print(f"warning: {message}", file=sys.stderr)
    print(f"table: {Path(out_dir) / 'compare.csv'}")
    if figure:
        print(f"figure: {figure}")
    print(f"report: {Path(out_dir) / report.REPORT_NAME}")
    return 0


def read_result_csv(path: Path, required: dict[str, str]) -> Any:
    """A results CSV written by a sweep, checked: readable, at least one row, the ``required`` columns (name ->
    ``number`` or ``text``) present, numbers finite where they must be; else one line naming the file."""
    import pandas as pd

    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise UserError(f"plot: {path}: empty file (an interrupted or foreign file; rerun the sweep)") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"plot: {path}: not a readable CSV file ({str(exc).splitlines()[0]})") from None
    except OSError as exc:
        raise UserError(f"plot: {path}: cannot read the file ({exc.strerror or exc})") from None
    if frame.empty:
        raise UserError(f"plot: {path}: no rows (rerun the sweep)")
    for column, kind in required.items():
        if column not in frame.columns:
            raise UserError(f"plot: {path}: missing column {column!r} (not a specsim sweep's file?)")
        if kind == "number":
            values = pd.to_numeric(frame[column], errors="coerce")
            bad = values.isna() & frame[column].notna() | ~values.abs().lt(float("inf")) & values.notna()
            if bad.any():
                i = int(bad.to_numpy().argmax())
                raise UserError(f"plot: {path}: line {i + 2}: {column} must be a finite number "
                                f"(got {frame[column].iloc[i]!r})")
            frame[column] = values
    return frame


def warn_saturated(s: dict[str, Any], label: str = "") -> None:
    """One clear line on stderr when the served rate falls short of the offered rate."""
    from simulator.studies.report import saturation_message

    message = saturation_message(s, label)
    if message:
        print(f"warning: {message}", file=sys.stderr)
