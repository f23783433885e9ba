"""Parsing what a study is given as text: config field values, policy parameters and specs, sweep grids,
number lists, SLOs and tuning search spaces. The one place that reads them, used by the command line
(:mod:`simulator.studies.cli`), the studies (sweep, tune) and the validation on the profiles side.

Every parser stops bad input with one :class:`policies.errors.UserError` line naming the flag and the value.

- field value: ``"none"`` is None, booleans ``true/false/1/0``, tuples comma lists (:func:`parse_field_value`);
- policy parameters: ``NAME=VALUE`` (numbers become int or float, anything else stays text);
- policy spec: ``NAME[:K][/PARAM=VALUE...]`` (``fixed-k:3``, ``threshold:3/max_batch=16``);
- grid: ``FIELD=V1,V2,...`` per axis, typed like the config field;
- SLO: ``METRIC<=VALUE`` (``p99_latency<=20``, seconds for latency metrics; ``p99_ttft_ms<=500``), or per-request
  attainment ``P% METRIC:MS ...`` (``99% ttft:500 tpot:50``: at least 99% of requests meet every bound);
- goodput SLOs: vLLM's ``--goodput ttft:MS tpot:MS e2el:MS``;
- search space: ``NAME=V1,V2,...`` per parameter (``k`` is the bound K_max).
"""
from __future__ import annotations

import functools
import math
import operator
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable

from policies.errors import UserError
from simulator.config import FIELDS, HINTS, flags_of
from simulator.metrics import DERIVED_COLUMNS

__all__ = ["Slo", "SLO_METRICS", "number_or_text", "parse_field_value", "parse_floats", "parse_grid",
           "parse_goodput", "parse_policy_list", "parse_rates", "parse_seeds", "parse_policy_params", "parse_policy_spec", "parse_slo", "parse_space", "field_kind"]


# -- config field values ---------------------------------------------------------------------------
def field_kind(name: str) -> Any:
    """The base type of config field ``name``: ``int | None`` -> int; ``tuple[float, ...]`` -> tuple; ``bool``."""
    hint = HINTS[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    origin = typing.get_origin(hint)
    return origin or hint


def parse_field_value(name: str, text: str) -> Any:
    """Parse ``text`` as a value of config field ``name`` ("none" is None; tuples are comma lists)."""
    kind = field_kind(name)
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
        if name == "goodput_slo":
            return parse_goodput(text, flags_of(name)[0])
        if kind is tuple:
            cast = int if name == "cuda_graph_sizes" else float
            return tuple(cast(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{flags_of(name)[0]}: not a valid {getattr(kind, '__name__', kind)}: {text!r}") from None
    return text


def number_or_text(raw: str) -> Any:
    """``"3"`` -> 3, ``"1.2"`` -> 1.2, anything else unchanged (``nan`` and ``inf`` are numbers, refused by the
    config's checks as not finite)."""
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def parse_floats(flag: str, text: str) -> list[float]:
    """``"0.5,1,2"`` -> [0.5, 1.0, 2.0]; at least one value, each a finite number."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise UserError(f"{flag}: no values given")
    for v in values:
        if not math.isfinite(v) or abs(v) > 1e12:
            raise UserError(f"{flag}: every value must be a finite number (at most 1e12), got {v!r} in {text!r}")
    return values


def parse_rates(flag: str, text: str) -> list[float]:
    """Request rates: finite numbers > 0, no repeats. ``inf`` (``simulate --request-rate inf``, vLLM's: every request
    at t = 0) is refused with what to run instead: it is one run's setting, not a point on a rate axis (a sweep's figures
    plot latency against the rate); its concurrency is what varies (``--max-concurrency``)."""
    for item in (text or "").split(","):
        if item.strip().lower() in ("inf", "+inf", "infinity"):
            raise UserError(f"{flag}: inf is not a point of a rate axis: for vLLM's --request-rate inf (every request "
                            "at t = 0, a closed loop with --max-concurrency N) run simulate --request-rate inf "
                            "--max-concurrency N, or sweep the concurrency at one finite rate (--grid "
                            "max_concurrency=N1,N2)")
    rates = parse_floats(flag, text)
    for rate in rates:
        if rate <= 0:
            raise UserError(f"{flag}: every rate must be > 0, got {rate:g}")
    if len(set(rates)) != len(rates):
        raise UserError(f"{flag}: a rate is given twice in {text!r}")
    return rates


def parse_seeds(flag: str, text: str) -> list[int]:
    """``"0,1,2"`` -> [0, 1, 2]: whole numbers >= 0, no repeats (``0.5`` or ``nan`` is refused, not rounded)."""
    items = [x.strip() for x in (text or "").split(",") if x.strip()]
    if not items:
        raise UserError(f"{flag}: no values given")
    seeds = []
    for item in items:
        try:
            seed = int(item)
        except ValueError:
            raise UserError(f"{flag}: every seed must be a whole number >= 0, got {item!r}") from None
        if seed < 0 or seed >= 2 ** 63:
            raise UserError(f"{flag}: every seed must be a whole number in [0, 2^63), got {item!r}")
        seeds.append(seed)
    if len(set(seeds)) != len(seeds):
        raise UserError(f"{flag}: a seed is given twice in {text!r}")
    return seeds


def parse_policy_list(flag: str, text: str) -> list[str]:
    """``"no-spec,fixed-k:3"`` -> the specs, each checked (:func:`parse_policy_spec`); at least one, no repeats."""
    specs = [p.strip() for p in (text or "").split(",") if p.strip()]
    if not specs:
        raise UserError(f"{flag}: no policy given (got {text!r}); e.g. no-spec,fixed-k:3,goodput")
    for spec in specs:
        parse_policy_spec(spec)
    if len(set(specs)) != len(specs):
        raise UserError(f"{flag}: a policy is given twice in {text!r}")
    return specs


# -- policies --------------------------------------------------------------------------------------
def parse_policy_params(items: Iterable[str]) -> tuple[tuple[str, Any], ...]:
    """``["bonus=1.2", "mode=request"]`` -> (("bonus", 1.2), ("mode", "request"))."""
    pairs = []
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise UserError(f"--policy-param: expected NAME=VALUE, got {item!r}")
        pairs.append((name.strip(), number_or_text(raw.strip())))
    return tuple(pairs)


def parse_policy_spec(spec: str) -> tuple[str, int | None, tuple[tuple[str, Any], ...]]:
    """``NAME[:K][/PARAM=VALUE...]`` -> (name, k or None, params).

    ``"fixed-k:3"`` -> ("fixed-k", 3, ()); ``"threshold:3/max_batch=16"`` -> ("threshold", 3, (("max_batch", 16),)).
    """
    head, *raw_params = spec.split("/")
    name, sep, k = head.partition(":")
    if not name:
        raise UserError(f"--policies: bad policy spec {spec!r} (expected NAME[:K][/PARAM=VALUE...])")
    try:
        k_value = int(k) if sep else None
    except ValueError:
        raise UserError(f"--policies: bad policy spec {spec!r} (K must be an integer)") from None
    return name, k_value, parse_policy_params(raw_params)


# -- sweep grids -----------------------------------------------------------------------------------
@functools.cache
def summary_names() -> frozenset[str]:
    """Every name a run's summary may hold (to keep config columns apart from them)."""
    import numpy as np

    from simulator.metrics import REQUEST_COLUMNS, SUMMARY_KEYS, summarize

    dummy = {c: np.ones(1) for c in REQUEST_COLUMNS + DERIVED_COLUMNS}
    return frozenset(summarize(dummy)) | frozenset(SUMMARY_KEYS)


def axis_column(field: str) -> str:
    """The summary column of grid axis ``field``: its name, or ``config_<field>`` when a summary figure has it (a
    config value and a measured figure never share a column)."""
    return f"config_{field}" if field in summary_names() else field


def parse_grid(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["acceptance_rate=0.5,0.7"]`` -> {"acceptance_rate": [0.5, 0.7]} (values typed like the field)."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not values:
            raise UserError(f"--grid: expected FIELD=V1,V2,..., got {item!r}")
        if name not in FIELDS:
            raise UserError(f"--grid: unknown config field {name!r}")
        if name in ("rate", "policy", "seed", "k"):
            raise UserError(f"--grid: {name} has its own flag (--rates, --policies, --seeds)")
        if name in grid:
            raise UserError(f"--grid: {name} is given twice")
        grid[name] = [parse_field_value(name, v.strip()) for v in values.split(",")]
        if len({repr(v) for v in grid[name]}) != len(grid[name]):
            raise UserError(f"--grid: {name} lists a value twice ({values!r})")
    return grid


# -- SLOs and search spaces ------------------------------------------------------------------------
_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}
SLO_METRICS = ([f"{s}_{c}" for c in DERIVED_COLUMNS for s in ("mean", "p50", "p90", "p99")]
               + [f"{s}_{c}_ms" for c in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p90", "p99")]
               + ["throughput", "request_throughput", "output_throughput", "request_goodput", "slo_attainment"])
#: Old SLO metric names: ``goodput`` was the summary's output tokens/s (now ``output_throughput``; vLLM's goodput is
#: ``request_goodput``, requests/s meeting per-request SLOs).
SLO_ALIASES = {"goodput": "output_throughput"}


@dataclass(frozen=True)
class Slo:
    """``metric op bound``, e.g. p99 latency <= 20 s (seconds for the latency metrics without ``_ms``). With
    ``goodput_slo`` (per-request bounds, ms) the SLO is per-request attainment: ``slo_attainment >= fraction``."""

    metric: str
    op: str
    bound: float
    goodput_slo: tuple[tuple[str, float], ...] = ()

    def met(self, value: float) -> bool:
        return bool(_OPS[self.op](value, self.bound))

    def __str__(self) -> str:
        if self.goodput_slo:
            bounds = " ".join(f"{n}<={v:g}ms" for n, v in self.goodput_slo)
            return f"{self.bound * 100:g}% of requests with {bounds}"
        return f"{self.metric}{self.op}{self.bound:g}"

    @property
    def unit(self) -> str:
        """The unit of the metric, for labels."""
        m = self.metric
        if m.endswith("_ms"):
            return "ms"
        if m == "slo_attainment":
            return "fraction of requests"
        if m in ("throughput", "request_throughput", "request_goodput"):
            return "req/s"
        if m == "output_throughput":
            return "tokens/s"
        if m.endswith("norm_latency") or m.endswith("tpot"):
            return "s/token"
        return "s"


def parse_goodput(items: Iterable[str] | str, flag: str = "--goodput") -> tuple[tuple[str, float], ...]:
    """vLLM's ``--goodput`` pairs ``ttft:500 tpot:50 e2el:20000`` (metric:milliseconds; spaces or commas between
    pairs) -> (("ttft", 500.0), ...); anything else is a one-line UserError."""
    from simulator.config import GOODPUT_METRICS

    text = items if isinstance(items, str) else " ".join(items)
    out: list[tuple[str, float]] = []
    for pair in text.replace(",", " ").split():
        name, sep, raw = pair.partition(":")
        if not sep:
            raise UserError(f"{flag}: {pair!r} is not METRIC:MS (e.g. ttft:500 tpot:50 e2el:20000)")
        name = name.strip().lower()
        if name not in GOODPUT_METRICS:
            raise UserError(f"{flag}: unknown metric {name!r} (one of {', '.join(GOODPUT_METRICS)}, as vLLM)")
        raw = raw.strip().removesuffix("ms")
        try:
            value = float(raw)
        except ValueError:
            raise UserError(f"{flag}: {name}: not a number of milliseconds: {raw!r}") from None
        if not (math.isfinite(value) and value >= 0):
            raise UserError(f"{flag}: {name}: must be a finite number of milliseconds >= 0, got {raw!r}")
        if name in dict(out):
            raise UserError(f"{flag}: {name} given twice")
        out.append((name, value))
    if not out:
        raise UserError(f"{flag}: no METRIC:MS pair given (e.g. ttft:500 tpot:50)")
    return tuple(out)


def parse_slo(text: str) -> Slo:
    """``"p99_latency<=20"`` -> Slo("p99_latency", "<=", 20.0); ``"99% ttft:500 tpot:50"`` -> at least 99% of the
    requests meet every bound (ms; vLLM's ``--goodput`` pairs): Slo("slo_attainment", ">=", 0.99, bounds). Anything
    else is a one-line UserError."""
    text = text or ""
    attain = re.fullmatch(r"\s*([0-9.eE+-]+)\s*%\s*(?:of\s+requests\s*)?(?:with\s*)?:?\s*(.+)", text)
    if attain:
        raw, pairs = attain.groups()
        try:
            percent = float(raw)
        except ValueError:
            raise UserError(f"--slo: not a percentage: {raw!r}") from None
        if not (math.isfinite(percent) and 0 < percent <= 100):
            raise UserError(f"--slo: the percentage must be in (0, 100], got {raw!r}")
        return Slo("slo_attainment", ">=", percent / 100, parse_goodput(pairs, "--slo"))
    m = re.fullmatch(r"\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([0-9.eE+-]+)\s*", text)
    if not m:
        raise UserError(f"--slo: cannot parse {text!r} (expected METRIC<=VALUE, e.g. p99_latency<=20, or per-request "
                        "attainment, e.g. \"99% ttft:500 tpot:50\")")
    metric, op, raw = m.groups()
    metric = SLO_ALIASES.get(metric, metric)
    if metric not in SLO_METRICS:
        raise UserError(f"--slo: unknown metric {metric!r}; known: {', '.join(SLO_METRICS)}")
    try:
        bound = float(raw)
    except ValueError:
        raise UserError(f"--slo: bound is not a number: {raw!r}") from None
    if not math.isfinite(bound):
        raise UserError(f"--slo: bound must be a finite number, got {raw!r}")
    return Slo(metric, op, bound)


def parse_space(items: Iterable[str]) -> dict[str, list[Any]]:
    """``["bonus=1.0,1.1", "k=2,4"]`` -> {"bonus": [1.0, 1.1], "k": [2, 4]}."""
    space = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not name.strip() or not values:
            raise UserError(f"--param: expected NAME=V1,V2,..., got {item!r}")
        space[name.strip()] = [number_or_text(v.strip()) for v in values.split(",")]
    return space
