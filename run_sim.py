#!/usr/bin/env python3
"""specsim command line: simulate, sweep, plot, tune, compare, profile, calibrate, validate, bench; no arguments runs
the demo.

Run ``python run_sim.py COMMAND --help`` for the flags of a command.

The one place that dispatches between the two sides: ``profile``, ``calibrate`` and ``validate`` go to ``profiles/`` (imported
only then: they need the profile extra), everything else to the simulator's command line
(:mod:`simulator.studies.cli`). Library modules never import this file.
"""
from __future__ import annotations

import sys
from typing import Callable


def _profiles_command(command: str) -> Callable[[list[str]], int]:
    """The profiles side's ``main(argv)`` of ``command``; a missing profile extra is a one-line user error."""
    from policies.errors import UserError

    try:
        if command == "profile":
            from profiles.cli import main
        elif command == "calibrate":
            from profiles.calibrate import main
        else:
            from profiles.validation.validate import main
    except ImportError as exc:
        raise UserError(f"{command}: needs the profile extra (pip install -e '.[profile]'): {exc}") from None
    return main


def _calibrate_deployment(*args: object) -> list[str]:
    """The profiles side's calibration of a deployment's vLLM results (``advise --vllm-results``:
    :func:`profiles.calibrate.calibrate_deployment`), given to the simulator's command line, which never imports the
    profiles side."""
    return _profiles_function("calibrate", "calibrate_deployment")(*args)


def _profiles_function(command: str, name: str) -> Callable[..., object]:
    from policies.errors import UserError

    try:
        import profiles.calibrate as module
    except ImportError as exc:
        raise UserError(f"{command}: needs the profile extra (pip install -e '.[profile]'): {exc}") from None
    return getattr(module, name)


#: Commands of the profiles side, which parse their own flags.
PROFILES_COMMANDS = ("profile", "validate", "calibrate")


def main(argv: list[str] | None = None) -> int:
    from simulator.studies.cli import main as simulator_main, run_command

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PROFILES_COMMANDS:
        return run_command(lambda: _profiles_command(argv[0])(argv[1:]))
    return simulator_main(argv, calibrate=_calibrate_deployment)


if __name__ == "__main__":
    sys.exit(main())
