"""The command line behind ``run_sim.py``.

Every :class:`SimConfig` field is a flag named after it (``max_num_seqs`` -> ``--max-num-seqs``);
``--config FILE`` starts from a saved ``config.json``. A user error prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable

from simulator.config import SimConfig
from simulator.errors import UserError

if typing.TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (and exit 2) instead of usage + error."""

    def error(self, message: str) -> typing.NoReturn:  # noqa: D401 - argparse hook
        raise UserError(f"{self.prog}: {message}")


# -- config flags --------------------------------------------------------------------------------
@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(SimConfig)


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> int; ``tuple[float, ...]`` -> tuple; ``bool`` -> bool."""
    hint = annotation
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    origin = typing.get_origin(hint)
    return origin or hint


def parse_field_value(name: str, text: str) -> Any:
    """Parse ``text`` as a value of config field ``name`` ("none" is None; tuples are comma lists)."""
    kind = _base_type(_hints()[name])
    if text.lower() == "none":
        return None
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is tuple:
            return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--{name.replace('_', '-')}: not a valid {getattr(kind, '__name__', kind)}: {text!r}") from None
    return text


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; unset flags keep the config's defaults."""
    hints = _hints()
    parser.add_argument("--config", help="start from this config.json (flags override it)")
    for f in fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
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
        if value is None or (f.name == "scheduler" and hasattr(args, "cluster") and "://" in value):
            continue  # unset, or the address of a Dask scheduler (see _cluster)
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


def parse_policy_params(items: list[str]) -> tuple[tuple[str, Any], ...]:
    """``["bonus=1.2", "mode=request"]`` -> (("bonus", 1.2), ("mode", "request"))."""
    pairs = []
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise UserError(f"--policy-param: expected NAME=VALUE, got {item!r}")
        pairs.append((name.strip(), _number_or_text(raw.strip())))
    return tuple(pairs)


def _number_or_text(raw: str) -> Any:
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


# -- commands ------------------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.runner import run_simulation, write_result

    config = config_from_args(args)
    result = run_simulation(config)
    write_result(result, args.out, args.format)
    s = result.summary
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


def _floats(flag: str, text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UserError(f"{flag}: no values given")
    return values


def _progress(quiet: bool) -> Callable[[int, int], None] | None:
    """Sweep progress on stderr, as ``progress(done, total)``: one line saying how many cells an earlier,
    interrupted sweep already finished, then a tqdm bar (runs done / total, rate, ETA) when stderr is a
    terminal. ``--quiet``: nothing."""
    if quiet:
        return None
    from tqdm import tqdm

    bar: tqdm | None = None

    def show(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            if done:
                print(f"{done} of {total} cells already done; running the other {total - done}", file=sys.stderr)
            bar = tqdm(total=total, initial=done, unit="run", desc="sweep", file=sys.stderr,
                       disable=not sys.stderr.isatty())
        else:
            bar.update(done - bar.n)
        if done == total:
            bar.close()

    return show


def _sweep_and_plot(args: argparse.Namespace, base: SimConfig, policies: list[str], rates: list[float],
                    seeds: list[int], grid: dict[str, list[Any]]):
    """Run the sweep grid into ``args.out`` and draw its figures; return (summary, figure paths)."""
    from simulator import plots
    from simulator.runner import run_simulation
    from simulator.executors import make_executor
    from simulator.sweep import build_cells, parse_policy_spec, run_sweep

    for rate in rates:
        if rate <= 0:
            raise UserError(f"--rates: every rate must be > 0, got {rate:g}")
    cells = build_cells(base, rates, policies, seeds, grid)
    with make_executor(args.workers, *_cluster(args)) as executor:
        summary = run_sweep(cells, args.out, executor, _progress(args.quiet))
    out = Path(args.out)
    figures = [plots.plot_latency_vs_rate(summary, out / "latency_vs_rate.png")]
    if "no-spec" in set(summary["policy"]):
        figures.append(plots.plot_speedup(summary, out / "speedup.png"))
    # the k-over-time figure follows goodput if the sweep has it, else the first other non-static policy
    adaptive = sorted((p for p in policies if parse_policy_spec(p)[0] not in plots.STATIC),
                      key=lambda p: parse_policy_spec(p)[0] != "goodput")
    if adaptive:
        rate = rates[len(rates) // 2]
        name, k, params = parse_policy_spec(adaptive[0])
        config = base.replace(rate=rate, policy=name, seed=seeds[0], save_steps=True,
                              k=base.k if k is None else k, policy_params=base.policy_params + params)
        steps = run_simulation(config).steps
        from simulator.results import write_csv

        write_csv(out / "steps_adaptive.csv", steps.assign(policy=adaptive[0], rate=rate))
        figures.append(plots.plot_k_over_time(steps, out / "k_over_time.png", f"{adaptive[0]} at {rate:g} req/s"))
    return summary, figures


def print_table(summary: pd.DataFrame, column: str = "mean_latency") -> None:
    """Rates down, policies across: ``column`` averaged over seeds."""
    table = summary.groupby(["rate", "policy"], sort=False)[column].mean().unstack("policy")
    print(f"{column} (s), seeds averaged; rows: request rate (req/s)")
    print(table.to_string(float_format=lambda v: f"{v:9.3f}"))


def cmd_sweep(args: argparse.Namespace) -> int:
    from simulator.sweep import parse_grid

    rates = _floats("--rates", args.rates)
    base = config_from_args(args, rate=rates[0])
    seeds = [int(x) for x in _floats("--seeds", args.seeds)]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    summary, figures = _sweep_and_plot(args, base, policies, rates, seeds, parse_grid(args.grid or []))
    print_table(summary)
    print(f"summary: {Path(args.out) / 'summary.csv'}")
    for f in figures:
        print(f"figure: {f}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    import pandas as pd

    from simulator import plots

    out = Path(args.dir)
    path = out / "summary.csv"
    if not path.is_file():
        raise UserError(f"plot: {path} not found (run a sweep into {out} first)")
    summary = pd.read_csv(path)
    figures = [plots.plot_latency_vs_rate(summary, out / "latency_vs_rate.png")]
    if "no-spec" in set(summary["policy"]):
        figures.append(plots.plot_speedup(summary, out / "speedup.png"))
    steps_path = out / "steps_adaptive.csv"
    if steps_path.is_file():
        steps = pd.read_csv(steps_path)
        label = f"{steps['policy'].iloc[0]} at {steps['rate'].iloc[0]:g} req/s"
        figures.append(plots.plot_k_over_time(steps, out / "k_over_time.png", label))
    for f in figures:
        print(f"figure: {f}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from simulator import tune
    from simulator.results import write_csv

    slo = tune.parse_slo(args.slo)
    if not args.policy:
        raise UserError("tune: --policy is required (e.g. --policy goodput)")
    rates = _floats("--rates", args.rates)
    base = config_from_args(args, rate=rates[0])
    specs = tune.candidate_specs(args.policy, tune.parse_space(args.param, args.policy))
    seeds = [int(x) for x in _floats("--seeds", args.seeds)]
    summary, _ = _sweep_and_plot(args, base, specs, rates, seeds, {})
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
    from simulator.demo import run_demo

    return run_demo(args.out, args.workers, args.quiet)


def cmd_profile(argv: list[str]) -> int:
    try:
        from profiles.cli import main as profile_main
    except ImportError as exc:
        raise UserError(f"profile: needs the profile extra (pip install -e '.[profile]'): {exc}") from None
    return profile_main(argv)


def cmd_validate(argv: list[str]) -> int:
    try:
        from profiles.validation.validate import main as validate_main
    except ImportError as exc:
        raise UserError(f"validate: needs the profile extra (pip install -e '.[profile]'): {exc}") from None
    return validate_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from simulator.bench import main as bench_main

    return bench_main(argv)


def _cluster(args: argparse.Namespace) -> tuple[str | None, str]:
    """The Dask scheduler address the command was given, and the flag that gave it: ``--cluster ADDRESS``, or
    ``--scheduler ADDRESS`` (an address such as ``tcp://HOST:8786``, not one of the engine's scheduling
    policies, which keep their names). The demo has neither."""
    scheduler = getattr(args, "scheduler", None)
    cluster = getattr(args, "cluster", None)
    if scheduler is not None and "://" in scheduler:
        if cluster is not None and cluster != scheduler:
            raise UserError(f"--scheduler {scheduler} and --cluster {cluster}: two different Dask schedulers; give one")
        return scheduler, "--scheduler"
    return cluster, "--cluster"


def _add_run_flags(parser: argparse.ArgumentParser, out_default: str | None = None, cluster: bool = False) -> None:
    """``--out``, ``--workers``, ``--quiet``; and ``--cluster`` when the command can run on a Dask cluster."""
    from simulator.executors import default_workers

    parser.add_argument("--out", required=out_default is None, default=out_default, help="output folder")
    parser.add_argument("--workers", type=int, default=default_workers(), help="local worker processes")
    if cluster:
        parser.add_argument("--cluster", metavar="tcp://HOST:PORT",
                            help="run the cells on this Dask distributed scheduler instead of local workers "
                                 "(the dist extra; workers need specsim and the input files at the same paths); "
                                 "--scheduler tcp://HOST:PORT says the same")
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
PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {"profile": cmd_profile, "bench": cmd_bench,
                                                      "validate": cmd_validate}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in PASSTHROUGH:
            return PASSTHROUGH[argv[0]](argv[1:])
        parser = build_parser()
        if not argv:
            argv = ["demo"]
        args = parser.parse_args(argv)
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
