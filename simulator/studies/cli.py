"""The simulator's command line behind ``run_sim.py``: simulate, sweep, plot, tune, demo, bench (``run_sim.py``
itself adds the profiles side's ``profile`` and ``validate``). Nothing in the library imports this module; the
parsing of values, specs, grids and SLOs lives in :mod:`simulator.studies.specs`.

Every :class:`SimConfig` field is a flag named after it (``max_num_seqs`` -> ``--max-num-seqs``);
``--config FILE`` starts from a saved ``config.json``. A user error prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.studies.specs import (field_kind, parse_field_value, parse_grid, parse_policy_list,
                                     parse_policy_params, parse_rates, parse_seeds, parse_slo)

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (and exit 2) instead of usage + error."""

    def error(self, message: str) -> typing.NoReturn:  # noqa: D401 - argparse hook
        raise UserError(f"{self.prog}: {message}")


# -- config flags --------------------------------------------------------------------------------
def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; unset flags keep the config's defaults."""
    parser.add_argument("--config", help="start from this config.json (flags override it)")
    for f in fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = field_kind(f.name)
        doc = f"(default {f.default!r})" if f.default is not MISSING else ""
        if f.name == "policy_params":
            parser.add_argument("--policy-param", dest="policy_params", action="append", metavar="NAME=VALUE",
                                help="a policy parameter; repeat for several")
        elif kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=doc)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=doc)


def config_from_args(args: argparse.Namespace, **defaults: Any) -> SimConfig:
    """Resolve the config: field defaults, then ``defaults``, then a ``--config`` file, then flags."""
    data: dict[str, Any] = dict(defaults)
    if getattr(args, "config", None):
        path = Path(args.config)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"--config {args.config}: cannot read a JSON config ({exc})") from None
        if not isinstance(data, dict):
            raise UserError(f"--config {args.config}: not a JSON object")
        data = {**defaults, **data}
    for f in fields(SimConfig):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if f.name == "policy_params":
            value = parse_policy_params(value)
        elif not isinstance(value, bool):
            value = parse_field_value(f.name, value)
        data[f.name] = value
    if data.get("arrival") == "trace" and "rate" not in data:
        data["rate"] = None
    if data.get("trace") and "arrival" not in data:
        data["arrival"] = "trace"
    return SimConfig.from_dict(data, source=args.config or "flags")


# -- commands ------------------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.core.runner import run_simulation, write_result

    from simulator.core.runner import table_format
    from simulator.results import prepare_out_dir

    config = config_from_args(args)
    table_format(args.format)
    _, lock = prepare_out_dir(args.out)  # before simulating: a bad folder is found now, not after a long run
    with lock:
        result = run_simulation(config)
        write_result(result, args.out, args.format)
    s = result.summary
    warn_ignored(s, config)
    print(f"{s['requests']} requests, {s['steps']} steps, {s['simulated_seconds']:.1f} s simulated in "
          f"{s['wall_seconds']:.2f} s wall")
    print(f"mean latency {s['mean_latency']:.3f} s  p99 {s['p99_latency']:.3f} s  "
          f"mean norm latency {s['mean_norm_latency'] * 1e3:.2f} ms/token  ttft {s['mean_ttft']:.3f} s  "
          f"tpot {s['mean_tpot'] * 1e3:.2f} ms  throughput {s['throughput']:.2f} req/s")
    if s["proposed_tokens"]:
        print(f"acceptance rate {s['acceptance_rate']:.3f}  mean acceptance length "
              f"{s['mean_acceptance_length']:.2f} tokens (bonus included)")
    print(f"results in {args.out}/ (profile: {s['profile_method']})")
    return 0


def warn_ignored(summary: dict[str, Any], config: SimConfig) -> None:
    """One warning line on stderr when requests were ignored because they can never fit in the KV cache."""
    n = summary.get("ignored_requests", 0)
    if n:
        ids = summary.get("ignored_request_ids", [])
        shown = ", ".join(map(str, ids[:10])) + (", ..." if len(ids) > 10 else "")
        print(f"warning: {n} of {summary['requests']} requests can never fit in the KV cache "
              f"({summary['num_gpu_blocks']} blocks of {config.block_size} tokens) and were ignored, as vLLM does "
              f"(ids {shown}; all in summary.json and the 'ignored' column; --strict-fit refuses them)",
              file=sys.stderr)


def cmd_sweep(args: argparse.Namespace) -> int:
    from simulator.studies.sweep import print_table, sweep_and_plot

    rates = parse_rates("--rates", args.rates)
    base = config_from_args(args, rate=rates[0])
    seeds = parse_seeds("--seeds", args.seeds)
    policies = parse_policy_list("--policies", args.policies)
    grid = parse_grid(args.grid or [])
    summary, figures = sweep_and_plot(base, policies, rates, seeds, grid, args.out,
                                      args.workers, args.cluster, args.cluster_flag, args.quiet)
    print_table(summary, axes=list(grid))
    print(f"summary: {Path(args.out) / 'summary.csv'}")
    for f in figures:
        print(f"figure: {f}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    import pandas as pd

    from simulator.studies import plots

    out = Path(args.dir)
    path = out / "summary.csv"
    if not path.is_file():
        raise UserError(f"plot: {path} not found (run a sweep into {out} first)")
    summary = _read_result_csv(path, plots.SUMMARY_COLUMNS)
    steps_path = out / "steps_adaptive.csv"
    steps = _read_result_csv(steps_path, plots.STEPS_COLUMNS) if steps_path.is_file() else None
    _writable_dir(out)
    figures = [plots.plot_latency_vs_rate(summary, out / "latency_vs_rate.png")]
    if "no-spec" in set(summary["policy"]):
        figures.append(plots.plot_speedup(summary, out / "speedup.png"))
    if steps is not None:
        label = f"{steps['policy'].iloc[0]} at {steps['rate'].iloc[0]:g} req/s"
        figures.append(plots.plot_k_over_time(steps, out / "k_over_time.png", label))
    for f in figures:
        print(f"figure: {f}")
    return 0


def _read_result_csv(path: Path, required: dict[str, str]) -> Any:
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


def _writable_dir(out: Path) -> Path:
    from simulator.results import check_out_dir

    return check_out_dir(out, "plot")


def cmd_tune(args: argparse.Namespace) -> int:
    from simulator.results import write_csv
    from simulator.studies import tune
    from simulator.studies.sweep import sweep_and_plot

    slo = parse_slo(args.slo)
    if not args.policy:
        raise UserError("tune: --policy is required (e.g. --policy goodput)")
    rates = parse_rates("--rates", args.rates)
    base = config_from_args(args, rate=rates[0])
    specs = tune.candidate_specs(args.policy, tune.search_space(args.param, args.policy))
    seeds = parse_seeds("--seeds", args.seeds)
    summary, _ = sweep_and_plot(base, specs, rates, seeds, {}, args.out, args.workers, args.cluster, args.cluster_flag,
                                args.quiet)
    table = tune.analyse(summary, slo)
    write_csv(Path(args.out) / "tune.csv", table)
    figure = tune.plot_tradeoff(table, slo, Path(args.out) / "tradeoff.png")
    print(f"SLO {slo}: {len(specs)} settings x {len(rates)} rates x {len(seeds)} seeds")
    print(table.head(10).to_string(index=False))
    best = table.iloc[0]
    if best["sustainable_rate"] <= 0:
        print(f"no setting meets the SLO even at {min(rates):g} req/s")
    else:
        print(f"best: {best['policy']} meets {slo} up to {best['sustainable_rate']:g} req/s")
    print(f"table: {Path(args.out) / 'tune.csv'}\nfigure: {figure}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from simulator.studies.demo import run_demo

    return run_demo(args.out, args.workers, args.quiet)


def cmd_bench(argv: list[str]) -> int:
    from simulator.studies.bench import main as bench_main

    return bench_main(argv)


def resolve_cluster(args: argparse.Namespace) -> None:
    """Give the Dask scheduler's address one meaning: ``--cluster ADDRESS``. ``--scheduler ADDRESS`` (an address
    such as ``tcp://HOST:8786``, never one of the engine's scheduling modes, which keep their names) is the old
    spelling of it, kept as an alias: it moves to ``args.cluster`` and ``args.scheduler`` keeps only scheduling
    modes. ``args.cluster_flag`` names the flag that gave the address, for messages."""
    if not hasattr(args, "cluster"):
        return
    args.cluster_flag = "--cluster"
    scheduler = getattr(args, "scheduler", None)
    if scheduler is not None and "://" in scheduler:
        if args.cluster is not None and args.cluster != scheduler:
            raise UserError(f"--scheduler {scheduler} and --cluster {args.cluster}: two different Dask schedulers; "
                            "give one")
        args.cluster, args.cluster_flag, args.scheduler = scheduler, "--scheduler", None


def _add_run_flags(parser: argparse.ArgumentParser, out_default: str | None = None, cluster: bool = False) -> None:
    """``--out``, ``--workers``, ``--quiet``; and ``--cluster`` when the command can run on a Dask cluster."""
    from simulator.studies.executors import default_workers

    parser.add_argument("--out", required=out_default is None, default=out_default, help="output folder")
    parser.add_argument("--workers", type=int, default=default_workers(), help="local worker processes")
    if cluster:
        parser.add_argument("--cluster", metavar="tcp://HOST:PORT",
                            help="run the cells on this Dask distributed scheduler instead of local workers "
                                 "(the dist extra; workers need specsim and the input files at the same paths); "
                                 "--scheduler tcp://HOST:PORT is an old alias of it")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="run_sim.py", description="specsim: simulate LLM serving with speculative decoding")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    sim = sub.add_parser("simulate", help="run one simulation")
    add_config_flags(sim)
    sim.add_argument("--out", required=True, help="output folder")
    sim.add_argument("--format", choices=("auto", "csv", "parquet"), default="auto",
                     help="per-request (and per-step) tables: parquet, csv, or auto = parquet when pyarrow is "
                          "importable (default auto)")
    sim.set_defaults(func=cmd_simulate)

    sweep = sub.add_parser("sweep", help="latency versus rate for several policies, in parallel")
    add_config_flags(sweep)
    sweep.add_argument("--rates", required=True, help="request rates, comma-separated (req/s)")
    sweep.add_argument("--policies", default="no-spec,fixed-k:1,fixed-k:3,fixed-k:5,goodput",
                       help="policy specs NAME[:K][/PARAM=VALUE...], comma-separated")
    sweep.add_argument("--seeds", default="0", help="seeds, comma-separated")
    sweep.add_argument("--grid", action="append", metavar="FIELD=V1,V2", help="another sweep axis; repeatable")
    _add_run_flags(sweep, cluster=True)
    sweep.set_defaults(func=cmd_sweep)

    plot = sub.add_parser("plot", help="redraw a sweep's figures from its summary.csv")
    plot.add_argument("dir", help="the sweep's output folder")
    plot.set_defaults(func=cmd_plot)

    tune = sub.add_parser("tune", help="search a policy's parameters for an SLO over a load range")
    add_config_flags(tune)
    tune.add_argument("--slo", required=True, help='e.g. "p99_latency<=20" (seconds)')
    tune.add_argument("--rates", required=True, help="request rates, comma-separated (req/s)")
    tune.add_argument("--seeds", default="0", help="seeds, comma-separated")
    tune.add_argument("--param", action="append", metavar="NAME=V1,V2",
                      help="a parameter's candidate values (k is the bound K_max); repeatable")
    _add_run_flags(tune, cluster=True)
    tune.set_defaults(func=cmd_tune)

    demo = sub.add_parser("demo", help="the default demo (what no arguments runs)")
    _add_run_flags(demo, out_default="results/demo")
    demo.set_defaults(func=cmd_demo)
    return parser


#: Commands that parse their own flags: name -> handler(argv).
PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {"bench": cmd_bench}


def run_command(command: Callable[[], int]) -> int:
    """Run ``command`` as the command line does: a :class:`UserError` prints one line and gives exit status 2,
    Ctrl-C gives 130."""
    try:
        return command()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:  # a file the user named that cannot be read or written: one line, not a traceback
        if exc.filename is None:
            raise
        print(f"error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    """The simulator's commands (``run_sim.py`` adds ``profile`` and ``validate`` from the profiles side)."""
    argv = sys.argv[1:] if argv is None else argv
    return run_command(lambda: _dispatch(argv))


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]](argv[1:])
    args = build_parser().parse_args(argv or ["demo"])
    resolve_cluster(args)
    return args.func(args)
