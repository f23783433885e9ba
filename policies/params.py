"""Reading ``--policy-param name=value`` pairs: convert, validate, and name the policy and parameter on error.

Values arrive as strings (command line) or numbers (a saved ``config.json``). A policy pops the
parameters it knows with a :class:`ParamReader` and hands :meth:`ParamReader.rest` to
:meth:`policies.base.Policy.__init__`, which rejects whatever is left as unknown.
"""
from __future__ import annotations

import math
from typing import Any

from policies.errors import UserError


class ParamReader:
    """Pops and validates the parameters of policy ``policy`` from ``params`` (the dict is copied)."""

    def __init__(self, policy: str, params: dict[str, Any]) -> None:
        self.policy = policy
        self._params = dict(params)

    def error(self, name: str, problem: str, value: Any) -> UserError:
        """``policy NAME: parameter NAME PROBLEM, got VALUE`` (numbers bare, whole floats as integers, else quoted)."""
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        shown = value if _is_number(value) else repr(value)
        return UserError(f"policy {self.policy}: parameter {name} {problem}, got {shown}")

    def number(self, name: str, default: float, low: float = -math.inf, high: float = math.inf,
               low_open: bool = False, high_open: bool = False) -> float:
        """A finite float within the interval from ``low`` to ``high`` (open ends when ``*_open``)."""
        if name not in self._params:
            return default
        raw = self._params.pop(name)
        value = _to_float(raw)
        if value is None or not math.isfinite(value):
            raise self.error(name, "must be a number", raw)
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if below or above:
            raise self.error(name, f"must be in {_interval(low, high, low_open, high_open)}", value)
        return value

    def integer(self, name: str, default: int | None, low: int) -> int | None:
        """An integer >= ``low`` (``"4"``, ``4`` and ``4.0`` are all 4)."""
        if name not in self._params:
            return default
        raw = self._params.pop(name)
        value = _to_float(raw)
        if value is None or not value.is_integer():
            raise self.error(name, "must be an integer", raw)
        if value < low:
            raise self.error(name, f"must be >= {low}", int(value))
        return int(value)

    def integers(self, name: str, default: tuple[int, ...], low: int) -> tuple[int, ...]:
        """Integers >= ``low``, in the order given: ``"1,3,7"`` (or ``"1;3;7"``, which a sweep's ``--policies`` list
        leaves whole), ``[1, 3, 7]`` (a saved config), or one number."""
        if name not in self._params:
            return default
        raw = self._params.pop(name)
        items = raw.replace(";", ",").split(",") if isinstance(raw, str) else raw
        items = items if isinstance(items, (list, tuple)) else [items]
        values = [_to_float(x) for x in items]
        if not values or any(v is None or not v.is_integer() for v in values):
            raise self.error(name, "must be integers separated by commas", raw)
        if min(values) < low:
            raise self.error(name, f"must all be >= {low}", raw)
        return tuple(int(v) for v in values)

    def choice(self, name: str, default: str, options: tuple[str, ...]) -> str:
        """One of ``options``."""
        if name not in self._params:
            return default
        value = self._params.pop(name)
        if value not in options:
            raise self.error(name, f"must be one of {', '.join(options)}", value)
        return str(value)

    def pop(self, name: str) -> Any:
        """The raw value of ``name``, or ``None`` when not given (for parameters with their own syntax)."""
        return self._params.pop(name, None)

    def rest(self) -> dict[str, Any]:
        """Parameters not read: unknown to the policy."""
        return dict(self._params)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _to_float(value: Any) -> float | None:
    if _is_number(value):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """Interval notation: ``(0, 1]``, ``[1, inf)``."""
    return f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"
