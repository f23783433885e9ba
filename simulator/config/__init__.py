"""The simulation configuration: frozen dataclasses, one per concern, composed into :class:`SimConfig` (as vLLM's
``VllmConfig`` composes its model, cache, scheduler, speculative and parallel configs) and validated on construction.

- :class:`WorkloadConfig` (``config.workload``): arrivals, request lengths, the client's concurrency;
- :class:`EngineConfig` (``config.engine``): scheduling limits and the KV cache;
- :class:`FleetConfig` (``config.fleet``): replicas and routers, disaggregated prefill and decode;
- :class:`SpeculativeConfig` (``config.speculative``): the policy, the proposer, token trees, acceptance;
- :class:`CostConfig` (``config.cost``): the profile that prices steps;
- :class:`RunConfig` (``config.run``): the seed, what is recorded, goodput SLOs.

Each checks its own fields in its ``__post_init__``; :class:`SimConfig` checks what crosses concerns. Field names are
unique across concerns and stay the public vocabulary: every field is a command-line flag (``--max-num-seqs`` for
``max_num_seqs``), a possible sweep axis (``--grid``), and a name :meth:`SimConfig.of` and :meth:`SimConfig.replace`
take (``SimConfig.of(rate=4, num_requests=100, policy="fixed-k")``). Names follow vLLM where it has one
(``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``; ``num_speculative_tokens`` is ``k`` here). Units:
seconds, tokens, requests per second, GiB.

The resolved configuration is saved next to every result (``config.json``, by concern) and hashed
(:func:`config_hash`) to key sweep cells; :meth:`SimConfig.from_dict` reads it, and the flat files written before
configs were composed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from policies.errors import UserError, require
from simulator.config.checks import FLAG_NAMES, MAX_CV, MAX_NUMBER, MAX_SIGMA, flag, flag_value, flags_of, named
from simulator.config.cost import DEFAULT_SIM_PROFILE, FITTERS, CostConfig
from simulator.config.engine import SCHEDULERS, EngineConfig
from simulator.config.fleet import KV_LINK_NAMES, ROUTER_NAMES, FleetConfig
from simulator.config.run import GOODPUT_METRICS, RunConfig
from simulator.config.speculative import (ACCEPTANCE_MODELS, DEFAULT_ACCEPTANCE_RANKS, SpeculativeConfig,
                                          align_proposer)
from simulator.config.workload import ARRIVALS, LENGTH_DISTS, WorkloadConfig

__all__ = ["ACCEPTANCE_MODELS", "ARRIVALS", "CONCERNS", "CONCERN_OF", "DEFAULT_ACCEPTANCE_RANKS", "DEFAULT_SIM_PROFILE",
           "FIELDS", "FITTERS", "FLAG_NAMES", "GOODPUT_METRICS", "HINTS", "KV_LINK_NAMES", "LENGTH_DISTS", "MAX_CV",
           "MAX_NUMBER", "MAX_SIGMA", "ROUTER_NAMES", "SCHEDULERS", "CostConfig", "EngineConfig", "FleetConfig",
           "RunConfig", "SimConfig", "SpeculativeConfig", "WorkloadConfig", "align_proposer", "config_hash",
           "flag", "flag_value", "flags_of", "flat_fields", "named", "rate_from_json", "rate_to_json"]

#: The concerns of a config, in the order of its help and its ``config.json``: name -> its dataclass.
CONCERNS: dict[str, type] = {"workload": WorkloadConfig, "engine": EngineConfig, "fleet": FleetConfig,
                             "speculative": SpeculativeConfig, "cost": CostConfig, "run": RunConfig}
#: Every field by its (flat) name, in that order: name -> its :class:`dataclasses.Field`.
FIELDS: dict[str, dataclasses.Field] = {f.name: f for cls in CONCERNS.values() for f in fields(cls)}
#: Field name -> the concern that holds it.
CONCERN_OF: dict[str, str] = {f.name: concern for concern, cls in CONCERNS.items() for f in fields(cls)}
assert len(CONCERN_OF) == sum(len(fields(cls)) for cls in CONCERNS.values()), "a field name in two concerns"
#: Every field's type, by name (``int | None``, ``tuple[float, ...]``, ...).
HINTS: dict[str, Any] = {name: hint for cls in CONCERNS.values() for name, hint in typing.get_type_hints(cls).items()}


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation run depends on, by concern. Same config and seed: same results, bit for bit.

    Build one from field names with :meth:`of`, change fields with :meth:`replace`, read a ``config.json`` with
    :meth:`from_dict`; read a field as ``config.workload.rate``, ``config.speculative.k``."""

    workload: WorkloadConfig
    engine: EngineConfig = field(default_factory=EngineConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        for concern, cls in CONCERNS.items():
            require(isinstance(getattr(self, concern), cls),
                    f"config: {concern} must be a {cls.__name__}, got {type(getattr(self, concern)).__name__}")
        workload, engine, fleet, spec = self.workload, self.engine, self.fleet, self.speculative
        if engine.num_scheduler_steps > 1:
            require(spec.policy == "no-spec" or spec.k == 0,
                    f"config: {named('num_scheduler_steps')} > 1 (multi-step scheduling) runs without speculation, "
                    f"as in vLLM 0.6; got policy={spec.policy} with k={spec.k} (use --policy no-spec)")
        if fleet.replicas > 1:
            require(workload.max_concurrency is None,
                    f"config: {named('replicas')} > 1 with {named('max_concurrency')} is not modelled (the client's "
                    "closed loop feeds one engine)")
            require(fleet.router != "prefix-aware" or engine.enable_prefix_caching,
                    f"config: {named('router')} prefix-aware needs {flag('enable_prefix_caching')}")
        if fleet.disaggregated:
            require(workload.max_concurrency is None,
                    f"config: {named('max_concurrency')} with disaggregated serving is not modelled")
            require(engine.num_scheduler_steps == 1,
                    f"config: {named('num_scheduler_steps')} > 1 with disaggregated serving is not modelled")
            require(fleet.prefill_router != "prefix-aware" or engine.enable_prefix_caching,
                    f"config: {named('prefill_router')} prefix-aware needs {flag('enable_prefix_caching')}")

    # --------------------------------------------------------------------------------------------
    @classmethod
    def of(cls, **values: Any) -> "SimConfig":
        """A config from field names (``SimConfig.of(rate=4, num_requests=100, policy="fixed-k")``), each routed to
        its concern; the others keep their defaults. ``speculative_method`` alone sets ``proposer``
        (:func:`align_proposer`). An unknown name is a :class:`UserError` naming it."""
        groups = _by_concern(align_proposer(values, {}))
        return cls(**{concern: CONCERNS[concern](**groups.get(concern, {})) for concern in CONCERNS})

    def replace(self, **changes: Any) -> "SimConfig":
        """A copy with the fields ``changes`` names set (and validated; ``proposer`` and ``speculative_method`` kept
        in step by :func:`align_proposer`)."""
        changes = align_proposer(changes, {"speculative_method": self.speculative.speculative_method})
        return dataclasses.replace(self, **{concern: dataclasses.replace(getattr(self, concern), **values)
                                            for concern, values in _by_concern(changes).items()})

    def flat(self) -> dict[str, Any]:
        """Every field by its name, as stored (tuples stay tuples): a field read by name, e.g. a sweep's axis."""
        return {name: getattr(getattr(self, concern), name) for name, concern in CONCERN_OF.items()}

    def to_dict(self, flat: bool = False) -> dict[str, Any]:
        """JSON-ready dict by concern (``{"workload": {...}, "engine": {...}, ...}``), or by field name with
        ``flat``: tuples become lists, an infinite ``rate`` the string ``"inf"`` (:func:`rate_to_json`)."""
        values = {name: _jsonable(name, value) for name, value in self.flat().items()}
        if flat:
            return values
        return {concern: {f.name: values[f.name] for f in fields(cls)} for concern, cls in CONCERNS.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "SimConfig":
        """Inverse of :meth:`to_dict`: a dict by concern, or by field name (every ``config.json`` written before
        configs were composed). An unknown key is a user error naming it and ``source``."""
        values = flat_fields(data, source)
        for name, value in values.items():  # JSON lists as the tuples the fields hold (checked by the concern)
            if isinstance(value, list) and typing.get_origin(HINTS[name]) is tuple:
                values[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        if "rate" in values:
            values["rate"] = rate_from_json(values["rate"])
        try:
            return cls.of(**values)
        except UserError as exc:
            if source in ("config", "flags") or str(exc).startswith(source):
                raise
            raise UserError(f"{source}: {exc}") from None


def flat_fields(data: Any, source: str) -> dict[str, Any]:
    """The fields of a config dict by their names, whether it holds them by concern (``{"workload": {"rate": 4},
    ...}``), by name (``{"rate": 4}``, the files written before configs were composed) or both; a key that is
    neither, or a field given twice, is a user error naming it and ``source``."""
    require(isinstance(data, dict), f"{source}: a config must be a JSON object, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key in sorted(data, key=str):
        if key in CONCERNS:
            group = data[key]
            require(isinstance(group, dict), f"{source}: {key} must be a JSON object of its fields, got {group!r}")
            for name in sorted(group, key=str):
                require(CONCERN_OF.get(name) == key, f"{source}: unknown config field {name!r} in {key}" + (
                    f" (it belongs to {CONCERN_OF[name]})" if name in CONCERN_OF else ""))
        else:
            require(key in CONCERN_OF, f"{source}: unknown config field {key!r}")
            group = {key: data[key]}
        for name, value in group.items():
            require(name not in out, f"{source}: config field {name!r} given twice")
            out[name] = value
    return out


def _by_concern(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``values`` by field name -> by concern; an unknown name is a :class:`UserError` naming it."""
    groups: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        require(name in CONCERN_OF, f"config: unknown config field {name!r}")
        groups.setdefault(CONCERN_OF[name], {})[name] = value
    return groups


def rate_to_json(rate: float | None) -> float | str | None:
    """A request rate as JSON holds it: an infinite rate as the string ``"inf"``, as vLLM's result files write
    ``request_rate`` (JSON has no inf)."""
    return "inf" if rate is not None and math.isinf(rate) else rate


def rate_from_json(value: Any) -> Any:
    """Inverse of :func:`rate_to_json`: the string ``"inf"`` (any case, spaces around) is ``math.inf``; anything
    else is returned as it is, for the config's checks."""
    if isinstance(value, str) and value.strip().lower() == "inf":
        return math.inf
    return value


def _jsonable(name: str, value: Any) -> Any:
    if name == "rate":
        return rate_to_json(value)
    if isinstance(value, tuple):
        return [list(x) if isinstance(x, tuple) else x for x in value]
    return value


def config_hash(config: SimConfig) -> str:
    """Stable short hash of the resolved configuration (16 hex digits)."""
    blob = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
