"""The one registry of speculation policies.

``@register`` adds a class under its ``name``; :func:`make_policy` builds one from the config;
:func:`load_policy_file` imports a user's file so that its ``@register`` calls run.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from policies.base import Policy
from policies.errors import UserError

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available as ``--policy cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__qualname__} needs a non-empty class attribute 'name'")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """Registered policy names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def make_policy(name: str, k: int, params: dict[str, Any] | None = None) -> Policy:
    """Instantiate policy ``name`` with bound ``k`` and extra ``params``."""
    _load_builtins()
    if name not in _REGISTRY:
        raise UserError(f"--policy: unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](k, **(params or {}))


def load_policy_file(path: str) -> list[str]:
    """Import a user's policy file; return the names it registered. A file that registers none is an error."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--policy-file {path}: no such file")
    _load_builtins()
    before = dict(_REGISTRY)
    module_name = f"specsim_user_policy_{abs(hash(p.resolve()))}"
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise UserError(f"--policy-file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a user's file: report, do not trace back
        _REGISTRY.clear()
        _REGISTRY.update(before)
        what = "called sys.exit" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
        raise UserError(f"--policy-file {path}: failed to import: {what}".splitlines()[0]) from None
    added = sorted(n for n, c in _REGISTRY.items() if before.get(n) is not c)  # a reload re-registers
    replaced = [n for n in added if n in BUILTIN_NAMES]
    if replaced:
        _REGISTRY.clear()
        _REGISTRY.update(before)
        raise UserError(f"--policy-file {path}: registers {replaced[0]!r}, the name of a built-in policy; give "
                        "your policy its own name")
    if not added:
        raise UserError(f"--policy-file {path}: registers no policy (decorate a Policy subclass with @register)")
    return added


_builtins_loaded = False
#: Names of the built-in policies, which a user's file may not replace.
BUILTIN_NAMES = ("goodput", "no-spec", "fixed-k", "threshold", "vllm-batch-table", "sglang-adaptive")


def _load_builtins() -> None:
    """Register the built-in policies, once (imported on first use: they are the registry's clients' business,
    and they import nothing from here, so the registry and its policies form no circle)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    from policies.adaptive_tiers import SglangAdaptive
    from policies.batch_table import VllmBatchTable
    from policies.goodput import Goodput
    from policies.static import FixedK, NoSpec
    from policies.threshold import Threshold

    for cls in (Goodput, NoSpec, FixedK, Threshold, VllmBatchTable, SglangAdaptive):
        register(cls)
    _builtins_loaded = True
