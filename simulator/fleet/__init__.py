"""The fleet: N simulated engines behind a router (issue 24), beside :mod:`simulator.core`, never inside the engine.

:mod:`simulator.fleet.routers` holds the router policies, :mod:`simulator.fleet.fleet` the fleet run,
:mod:`simulator.fleet.disagg` disaggregated prefill and decode instances, and :func:`run` is what the studies call to
run one config, one engine or a fleet. The fleet imports the engine room; the engine room never imports the fleet.
"""
from __future__ import annotations

from typing import Any


def run(config: Any, **options: Any) -> Any:
    """One run of ``config``: :func:`simulator.core.runner.run_simulation` for one engine, the fleet's
    :func:`simulator.fleet.fleet.run_fleet` for ``config.fleet.replicas`` > 1,
    :func:`simulator.fleet.disagg.run_disagg` for ``config.fleet.prefill_replicas`` and ``decode_replicas`` > 0 (the
    same options: ``workload``, ``step_by_step``, ``cost``); a :class:`simulator.core.runner.SimResult` either way."""
    if config.fleet.prefill_replicas > 0:
        from simulator.fleet.disagg import run_disagg

        return run_disagg(config, **options)
    if config.fleet.replicas > 1:
        from simulator.fleet.fleet import run_fleet

        return run_fleet(config, **options)
    from simulator.core.runner import run_simulation

    return run_simulation(config, **options)
