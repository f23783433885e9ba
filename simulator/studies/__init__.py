"""Studies built on many runs: the parsing of specs, grids and SLOs, sweeps and their executors, tuning, plots,
the demo, the benchmark, and the simulator's command line (the top of the simulator side: nothing imports it)."""
