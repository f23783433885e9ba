"""What every concern of the configuration checks its fields with: their flags (a message names the flag the user
types), their declared types, and the common range checks.

A config error is one :class:`policies.errors.UserError` line naming the field by its primary flag
(:data:`FLAG_NAMES`) and, where that spells it otherwise, by its name in a ``config.json`` (:func:`named`):
``config: --token-acceptance-prob (acceptance_rate) must be in [0, 1], got 1.5``.
"""
from __future__ import annotations

import math
import numbers
import typing
from dataclasses import fields
from typing import Any

from policies.errors import require

#: Other spellings of a config field's flag: vLLM's names (``vllm bench serve`` / engine args) first, then the old
#: spelling kept as an alias. The first name is the field's primary flag: the one help shows first and messages name.
#: A field not listed has one flag, its name with dashes (``max_num_seqs`` -> ``--max-num-seqs``).
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "rate": ("--rate", "--request-rate"),
    "num_requests": ("--num-requests", "--num-prompts"),
    "k": ("--k", "--num-speculative-tokens"),
    "acceptance_rate": ("--token-acceptance-prob", "--acceptance-rate"),
    "goodput_slo": ("--goodput", "--goodput-slo"),
    "speculative_method": ("--speculative-method", "--speculative-algorithm"),
    "policy_params": ("--policy-param",),
}

#: Upper bounds of a few fields whose larger values make a model degenerate rather than extreme.
MAX_CV = 100.0
MAX_SIGMA = 10.0
#: Every number of a config lies within +-MAX_NUMBER (larger is a typo or an overflow waiting to happen).
MAX_NUMBER = 1e12


def flags_of(name: str) -> tuple[str, ...]:
    """Every flag of config field ``name``, its primary one first."""
    return FLAG_NAMES.get(name, ("--" + name.replace("_", "-"),))


def flag(name: str) -> str:
    """The primary flag of config field ``name``: what a message tells the user to give (``add --arrival gamma``)."""
    return flags_of(name)[0]


def flag_value(name: str, value: Any) -> str:
    """Config field ``name`` at ``value`` as the command line gives it: ``--max-num-seqs 1024``, a long list shortened
    (``--cuda-graph-sizes 1,2,4,8,...,256 (35 sizes)``), ``none``, ``true``."""
    if isinstance(value, tuple):
        shown = ",".join(map(str, value)) if len(value) <= 6 else \
            ",".join(map(str, value[:4])) + f",...,{value[-1]} ({len(value)} sizes)"
    else:
        shown = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"{flag(name)} {shown}"


def named(name: str) -> str:
    """Config field ``name`` as a message names it: its primary flag, for the command line, and its name in a
    ``config.json`` where that is spelled otherwise (``--max-num-seqs (max_num_seqs)``,
    ``--token-acceptance-prob (acceptance_rate)``, ``--k``)."""
    primary = flag(name)
    return primary if primary == "--" + name else f"{primary} ({name})"


def check_types(config: Any, infinite: tuple[str, ...] = ()) -> None:
    """Every field of the dataclass ``config`` has its declared type: no bool for a number, no float for an int, no
    text for a bool, every number finite (but +inf for the fields named in ``infinite``) and within
    :data:`MAX_NUMBER` (a JSON config is not coerced: ``"save_steps": "no"`` is refused, not taken as true)."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        if value is None:
            require(optional, f"config: {named(f.name)} must not be null")
            continue
        base = next((a for a in args if a is not type(None)), hint) if optional else hint
        origin = typing.get_origin(base) or base
        shown = f"{value!r} ({type(value).__name__})"
        if origin is bool:
            require(isinstance(value, bool), f"config: {named(f.name)} must be true or false, got {shown}")
        elif origin is int:
            require(isinstance(value, numbers.Integral) and not isinstance(value, bool),
                    f"config: {named(f.name)} must be a whole number, got {shown}")
            require(abs(value) <= MAX_NUMBER, f"config: {named(f.name)} must be at most {MAX_NUMBER:g}, got {value!r}")
        elif origin is float:
            if not (f.name in infinite and value == math.inf):
                number(f.name, value)
        elif origin is str:
            require(isinstance(value, str), f"config: {named(f.name)} must be text, got {shown}")
        elif origin is tuple:
            check_tuple(f.name, typing.get_args(base), value, shown)
        else:  # a field of another type needs its check here
            raise TypeError(f"config field {f.name}: no type check for {hint}")


def check_tuple(name: str, items: tuple[Any, ...], value: Any, shown: str) -> None:
    """A tuple field of type ``tuple[X, ...]``: X is int, float, str, or a (name, value) pair ``tuple[str, V]``."""
    item = items[0]
    if typing.get_origin(item) is tuple:
        kind = typing.get_args(item)[1]
        pair = "[metric, milliseconds]" if kind is float else "[name, value]"
        require(isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                 for p in value),
                f"config: {named(name)} must be a list of {pair} pairs, got {shown}")
        for pair_name, v in value:
            if kind is float:
                number(name, v)
            elif isinstance(v, float):
                require(math.isfinite(v), f"config: {named(name)}: {pair_name} must be finite, got {v!r}")
    elif item is int:
        require(isinstance(value, tuple) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                 for v in value),
                f"config: {named(name)} must be a list of whole numbers, got {shown}")
    elif item is str:
        require(isinstance(value, tuple) and all(isinstance(v, str) and v.strip() for v in value),
                f"config: {named(name)} must be a list of names or files, got {shown}")
    else:
        require(isinstance(value, tuple), f"config: {named(name)} must be a list of numbers, got {shown}")
        for v in value:
            number(name, v)


def number(name: str, value: Any) -> None:
    """``value`` of field ``name`` is a finite real number within :data:`MAX_NUMBER` (not a bool)."""
    require(isinstance(value, numbers.Real) and not isinstance(value, bool),
            f"config: {named(name)} must be a number, got {value!r} ({type(value).__name__})")
    require(math.isfinite(value), f"config: {named(name)} must be a finite number, got {value!r}")
    require(abs(value) <= MAX_NUMBER, f"config: {named(name)} must be at most {MAX_NUMBER:g}, got {value!r}")


def choice(name: str, value: str, options: tuple[str, ...]) -> None:
    require(value in options, f"config: {named(name)} must be one of {', '.join(options)}; got {value!r}")


def positive(name: str, value: float) -> None:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
            f"config: {named(name)} must be > 0, got {value!r}")


def at_least_zero(name: str, value: float, unit: str = "") -> None:
    require(value >= 0, f"config: {named(name)} must be >= 0{unit}, got {value!r}")


def probability(name: str, value: float) -> None:
    require(isinstance(value, (int, float)) and 0.0 <= value <= 1.0,
            f"config: {named(name)} must be in [0, 1], got {value!r}")


def defaults_of(cls: type) -> dict[str, Any]:
    """Each field of dataclass ``cls`` with its default value."""
    return {f.name: f.default for f in fields(cls)}
