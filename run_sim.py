#!/usr/bin/env python3
"""specsim command line: simulate, sweep, plot, tune, profile, validate, bench; no arguments runs the demo.

Run ``python run_sim.py COMMAND --help`` for the flags of a command.
"""
import sys

from simulator.cli import main

if __name__ == "__main__":
    sys.exit(main())
