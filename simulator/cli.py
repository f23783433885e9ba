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


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Resolve the config: defaults, then ``--config`` file, then flags."""
    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"--config {args.config}: cannot read a JSON config ({exc})") from None
        if not isinstance(data, dict):
            raise UserError(f"--config {args.config}: not a JSON object")
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
    write_result(result, args.out)
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


def cmd_profile(argv: list[str]) -> int:
    try:
        from profiles.cli import main as profile_main
    except ImportError as exc:
        raise UserError(f"profile: needs the profile extra (pip install -e '.[profile]'): {exc}") from None
    return profile_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from simulator.bench import main as bench_main

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="run_sim.py", description="specsim: simulate LLM serving with speculative decoding")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    sim = sub.add_parser("simulate", help="run one simulation")
    add_config_flags(sim)
    sim.add_argument("--out", required=True, help="output folder")
    sim.set_defaults(func=cmd_simulate)
    return parser


#: Commands that parse their own flags: name -> handler(argv).
PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {"profile": cmd_profile, "bench": cmd_bench}


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
