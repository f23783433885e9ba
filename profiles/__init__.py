"""specsim's contact with real models: measuring costs, and the real serving engine the simulator is checked
against (needs the ``profile`` extra: torch and transformers, except where noted).

Layers, each importing only those below it:

- :mod:`profiles.models`: architecture configs (``profiles/models/*.json``, no weights), the forward passes
  (eager Hugging Face, and the optimized in-place-cache path) and the checked draft/target pairs.
- :mod:`profiles.serving`: the real serving engine (continuous batching, speculative decoding, the same
  policies and per-request schema as the simulator).
- measuring, at this level: :mod:`.profiler` and :mod:`.cli` (``run_sim.py profile``; the grid, timing rule
  and reports work without torch), :mod:`.analytical` (roofline profiles), :mod:`.engine_profile` (the real
  engine's own step costs), :mod:`.acceptance` (acceptance traces of a real pair), :mod:`.train_draft`.
- :mod:`profiles.validation`: simulated versus real (``run_sim.py validate``) and the single-request study.
- ``profiles/data/``: shipped profiles, ``<hardware>__<target>__<draft>.csv`` + ``.meta.json``.
- ``profiles/gpu_run.sh``: the prepared GPU run (``TINY=1`` rehearses it on a CPU).
"""
