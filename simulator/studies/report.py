"""``report.html``: one self-contained page per study (``sweep``, ``tune``, ``compare``, ``validate``) that a
researcher can attach to a message.

:func:`write_report` is the one writer: a title, sections of (heading, content), the warnings of the run, the
resolved config and the profiles used. A content is a table (a DataFrame), a figure (a :class:`~pathlib.Path` to a
PNG, embedded as ``data:image/png;base64``), text (a ``str``, escaped; several lines keep their layout), trusted
markup (:class:`Html`) or a list of these. The page needs nothing else: no external file, font or script; every
text is escaped. It holds no timestamp and no wall-clock figure, so the same run gives the same bytes; paths under
the repository are shown relative to it (no absolute path of the machine but those the user gave). It is written
atomically (:func:`simulator.results.atomic_write`) after the tables; a command removes an older ``report.html``
before it starts writing (:func:`remove_report`), so a killed run leaves none.
The code version is :func:`simulator.studies.sweep.code_version`, the one that keys a sweep's cells.

Beside the writer: :func:`profile_info` (a profile's method and, for a vLLM-calibrated one, its calibration),
:func:`recorded_warnings` (the Python warnings a run printed; defined beside the sweep's cells, which record
theirs), the warning lines the commands print (:func:`saturation_message`, :func:`ignored_message`,
:func:`summary_warnings`, :func:`sweep_warnings`), and :func:`sweep_sections` (the summary tables of a sweep, which
``tune`` shares).
"""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulator.results import atomic_write
from simulator.studies.sweep import (cell_messages, cell_warnings, code_version, describe_cells, payoff_lines,
                                     recorded_warnings)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

__all__ = ["Html", "REPORT_NAME", "ignored_message", "profile_info", "recorded_warnings", "remove_report",
           "render_report", "saturation_message", "summary_warnings", "sweep_sections", "sweep_warnings",
           "write_report"]

REPORT_NAME = "report.html"
#: The repository's root: paths under it are shown relative to it.
ROOT = Path(__file__).resolve().parents[2]
#: Summary columns that measure the machine running the simulation, not the simulated engine (they differ between
#: two runs of the same config): never shown.
WALL_COLUMNS = ("wall_seconds",)


class Html(str):
    """Markup the caller built (already escaped): put in the page as is."""


# -- the writer ------------------------------------------------------------------------------------------------
def write_report(path: str | Path, title: str, sections: list[tuple[str, Any]], warnings: list[str] = (),
                 config: dict[str, Any] | None = None, profiles: list[dict[str, Any]] = ()) -> str:
    """Write ``report.html`` at ``path`` atomically (:func:`render_report`); returns the path."""
    page = render_report(title, sections, warnings, config, profiles)
    atomic_write(path, lambda f: f.write(page))
    return str(path)


def render_report(title: str, sections: list[tuple[str, Any]], warnings: list[str] = (),
                  config: dict[str, Any] | None = None, profiles: list[dict[str, Any]] = ()) -> str:
    """The page: title, code version, warnings (or that there were none), each section, the profiles (method and
    calibration) and the resolved config."""
    body = [f"<h1>{_esc(title)}</h1>",
            f'<p class="meta">specsim code version <code>{_esc(code_version())}</code> (hash of the simulator\'s and '
            "the policies' source, as sweep cells are keyed)</p>"]
    body.append('<section id="warnings"><h2>Warnings</h2>')
    if warnings:
        body.append('<ul class="warnings">' + "".join(f"<li>{_esc(w)}</li>" for w in warnings) + "</ul>")
    else:
        body.append("<p>none: no run saturated, no request was ignored, no warning was printed</p>")
    body.append("</section>")
    for heading, content in sections:
        body.append(f"<section><h2>{_esc(heading)}</h2>{_content(content)}</section>")
    if profiles:
        body.append("<section id=\"profile\"><h2>Profile</h2>" + "".join(_profile(p) for p in profiles) + "</section>")
    if config is not None:
        body.append('<section id="config"><h2>Configuration</h2>' + _mapping(config) + "</section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{_esc(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:1400px;color:#111;background:#fff}"
         "h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;margin-top:1.5em}"
         "table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0}"
         "th,td{border:1px solid #bbb;padding:2px 6px;text-align:right;vertical-align:top}"
         "th{background:#eee}td.text{text-align:left}td.wrap{text-align:left;word-break:break-word;max-width:70em}"
         "div.table{overflow-x:auto}td,th{white-space:nowrap}td.wrap{white-space:normal}"
         "img{max-width:100%;height:auto}figure{margin:0.5em 0}figcaption{font-size:0.8em;color:#555}"
         "ul.warnings li{color:#a00000}.meta{color:#555}pre{white-space:pre-wrap;font-size:0.85em}")


def _shown(text: str) -> str:
    """``text`` with the repository's root dropped from every path under it."""
    return text.replace(str(ROOT) + "/", "")


def _esc(value: Any) -> str:
    return html.escape(_shown(str(value)))


def _content(content: Any) -> str:
    import pandas as pd

    if isinstance(content, Html):
        return str(content)
    if isinstance(content, (list, tuple)):
        return "".join(_content(c) for c in content)
    if isinstance(content, pd.DataFrame):
        return _table(content)
    if isinstance(content, Path):
        return _figure(content)
    if isinstance(content, dict):
        return _mapping(content)
    text = str(content)
    return f"<pre>{_esc(text)}</pre>" if "\n" in text else f"<p>{_esc(text)}</p>"


def _figure(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_esc(path.name)}">'
            f"<figcaption>{_esc(path.name)}</figcaption></figure>")


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return _esc("" if value is None else value)
    if isinstance(value, float):
        return "" if math.isnan(value) else _esc(f"{value:.6g}")
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):  # numpy scalars
        return _cell(value.item())
    if isinstance(value, (dict, list, tuple)):
        return _esc(json.dumps(value, default=str))
    return _esc(value)


def _table(frame: pd.DataFrame) -> str:
    import pandas as pd

    if not isinstance(frame.index, pd.RangeIndex):
        frame = frame.reset_index()
    frame = frame.drop(columns=[c for c in frame.columns if c in WALL_COLUMNS])
    names = [" ".join(map(str, c)) if isinstance(c, tuple) else str(c) for c in frame.columns]
    head = "".join(f"<th>{_esc(n)}</th>" for n in names)
    rows = []
    for values in frame.itertuples(index=False, name=None):
        rows.append("<tr>" + "".join(
            f'<td class="text">{_cell(v)}</td>' if isinstance(v, str) else f"<td>{_cell(v)}</td>"
            for v in values) + "</tr>")
    return f'<div class="table"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


def _mapping(data: dict[str, Any]) -> str:
    rows = "".join(f'<tr><th>{_esc(k)}</th><td class="wrap">{"none" if v is None else _cell(v)}</td></tr>'
                   for k, v in data.items())
    return f"<table><tbody>{rows}</tbody></table>"


def _profile(info: dict[str, Any]) -> str:
    shown = {k: v for k, v in info.items() if k != "calibration" and v is not None}
    out = [_mapping(shown)]
    calibration = info.get("calibration")
    if calibration:
        out.append("<h3>Calibration</h3>")
        summary = {k: v for k, v in calibration.items() if k not in ("files", "parameters", "held_out_summary")}
        out.append(_mapping(summary))
        if calibration.get("files"):
            out.append("<p>fitted to these vLLM results:</p><ul>" +
                       "".join(f"<li>{_esc(f)}</li>" for f in calibration["files"]) + "</ul>")
        if calibration.get("parameters"):
            out.append("<p>fitted parameters:</p>" + _mapping(calibration["parameters"]))
        if calibration.get("held_out_summary"):
            out.append("<p>held-out error:</p>" + _mapping(calibration["held_out_summary"]))
    return "".join(out)


def remove_report(folder: str | Path) -> None:
    """Remove an older run's ``report.html`` from ``folder`` (before a command writes its results there)."""
    (Path(folder) / REPORT_NAME).unlink(missing_ok=True)


# -- what a report says about a profile -------------------------------------------------------------------------
def profile_info(path: str | None, label: str = "profile") -> dict[str, Any]:
    """A profile's path, method (as summaries name it) and source; for a profile calibrated to vLLM results (or
    transferred from one) its calibration: note, the result files it was fitted to, the fitted parameters with their
    units, and the held-out error."""
    from simulator.costs.profile_table import meta_path, method_label

    info: dict[str, Any] = {label: path}
    if path is None or path == "-":
        return info
    p = Path(path)
    meta: dict[str, Any] | None = None
    try:
        if p.suffix.lower() == ".csv":
            meta = json.loads(meta_path(p).read_text()) if meta_path(p).is_file() else None
        elif p.is_file():
            meta = json.loads(p.read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict):
        info["method"] = "unknown (no metadata file)"
        return info
    info["method"] = method_label(meta) if p.suffix.lower() == ".csv" else meta.get("method", "unknown")
    for key in ("device", "dtype", "verification"):
        if isinstance(meta.get(key), str):
            info[key] = meta[key]
    source = meta.get("efficiency_source") or meta.get("source")
    if isinstance(source, str):
        info["source"] = source
    calibration = meta.get("calibration")
    if isinstance(calibration, dict):
        units = calibration.get("parameter_units") or {}
        shown: dict[str, Any] = {"note": calibration.get("note")}
        for key in ("transferred_from", "transfer"):
            if key in calibration:
                shown[key] = calibration[key]
        shown["files"] = [_calibration_file(f) for f in calibration.get("files") or []]
        shown["parameters"] = {name: f"{value:.6g} {units.get(name, '')}".strip() if isinstance(value, float)
                               else value for name, value in (calibration.get("parameters") or {}).items()}
        held_out = calibration.get("held_out_summary") or calibration.get("source_held_out_summary") or {}
        shown["held_out_summary"] = {k: f"{v:.1%}" if isinstance(v, float) else v for k, v in held_out.items()}
        info["calibration"] = shown
    return info


def _calibration_file(entry: Any) -> str:
    if not isinstance(entry, dict):
        return str(entry)
    text = str(entry.get("path", "?"))
    source = entry.get("source")
    if isinstance(source, dict):
        text += f" (from {source.get('repo', '?')}: {source.get('path', '?')} at {source.get('commit', '?')})"
    return text


# -- warnings ------------------------------------------------------------------------------------------------
def saturation_message(s: dict[str, Any], label: str = "") -> str | None:
    """The warning of a run whose engine could not keep up (``saturated`` in its summary), or None."""
    if not s.get("saturated"):
        return None
    return (f"{label}saturated: {s['offered_rate']:.2f} req/s offered, {s['served_rate']:.2f} req/s served "
            "(completions/s) and the queue grew through the run: the engine cannot keep up, latency figures grow "
            "with the run's length; lower --rate or add capacity")


def ignored_message(summary: dict[str, Any], block_size: int, label: str = "") -> str | None:
    """The warning of a run that ignored requests that can never fit in the KV cache (``ignored_requests``)."""
    n = summary.get("ignored_requests", 0)
    if not n:
        return None
    ids = list(summary.get("ignored_request_ids") or [])
    shown = ", ".join(map(str, ids[:10])) + (", ..." if len(ids) > 10 else "")
    return (f"{label}{n} of {summary['requests']} requests can never fit in the KV cache "
            f"({summary['num_gpu_blocks']} blocks of {block_size} tokens) and were ignored, as vLLM does "
            f"(ids {shown}; all in summary.json and the 'ignored' column; --strict-fit refuses them)")


def summary_warnings(summary: pd.DataFrame, label: str = "") -> list[str]:
    """The warnings a sweep's summary records: the runs that saturated, those that ignored requests."""
    out = []
    if "saturated" in summary and summary["saturated"].astype(bool).any():
        cells = summary[summary["saturated"].astype(bool)]
        out.append(f"{label}{len(cells)} of {len(summary)} runs saturated (served below offered rate, queue growing): "
                   f"{describe_cells(cells)}; their latencies depend on the run's length (the 'saturated' column of "
                   "summary.csv)")
    if "ignored_requests" in summary and (summary["ignored_requests"].fillna(0) > 0).any():
        cells = summary[summary["ignored_requests"].fillna(0) > 0]
        out.append(f"{label}{len(cells)} of {len(summary)} runs ignored requests that can never fit in the KV cache "
                   f"({int(cells['ignored_requests'].sum())} requests in all, as vLLM does): {describe_cells(cells)} "
                   "(the 'ignored_requests' column of summary.csv; --strict-fit refuses them)")
    return out


def sweep_warnings(summary: pd.DataFrame, label: str = "", printed: list[str] = ()) -> list[str]:
    """Every warning of a sweep: :func:`summary_warnings`, each Python warning its cells printed with the cells it
    came from (:func:`simulator.studies.sweep.cell_warnings`), then the ``printed`` warnings of the sweep's own
    process (its figures' runs) that no cell gave."""
    from_cells = {m for row in cell_messages(summary) for m in row}
    return (summary_warnings(summary, label) + cell_warnings(summary, label)
            + [f"{label}{message}" for message in printed if message not in from_cells])


# -- a sweep's tables -----------------------------------------------------------------------------------------
#: Summary figures a report shows per rate and policy (seed-averaged), when present.
KEY_FIGURES = ("mean_latency", "p99_latency", "median_ttft_ms", "median_tpot_ms", "request_throughput",
               "output_throughput", "acceptance_rate", "mean_acceptance_length")


def sweep_sections(summary: pd.DataFrame, axes: list[str], figures: list[str | Path]) -> list[tuple[str, Any]]:
    """A sweep's sections: the metric the sweep prints and plots first (mean normalised latency, ms per output token)
    with rates (and grid axes) down and policies across, the key figures per rate x policy (seeds averaged; how many
    seeds saturated or ignored requests), and every figure."""
    keys = ["rate", *axes, "policy"]
    pivot = summary.groupby(keys, sort=False, dropna=False)["mean_norm_latency"].mean().unstack("policy") * 1e3
    figures_present = [c for c in KEY_FIGURES if c in summary]
    grouped = summary.groupby(keys, sort=False, dropna=False)
    table = grouped[figures_present].mean()
    table.insert(0, "seeds", grouped.size())
    if "saturated" in summary:
        table["saturated_seeds"] = grouped["saturated"].apply(lambda s: int(s.astype(bool).sum()))
    if "ignored_requests" in summary:
        table["ignored_requests"] = grouped["ignored_requests"].sum()
    payoffs = payoff_lines(summary, axes=axes)
    return [("Mean normalised latency (ms per output token), seeds averaged", pivot),
            *([("Where each policy pays against no-spec, by mean normalised latency", "\n".join(payoffs))]
              if payoffs else []),
            ("Key figures per rate and policy (seeds averaged; every figure of every run is in summary.csv)", table),
            ("Figures", [Path(f) for f in figures])]
