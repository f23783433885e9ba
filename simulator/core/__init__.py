"""The core: the simulated engine (SimPy; continuous batching, KV blocks, preemption), its fenced fast path of
decode runs, the KV-cache budget, and the runner that builds a run from a :class:`simulator.config.SimConfig`."""
