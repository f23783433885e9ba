"""specsim's contact with real models: forward-pass profiles and the data shipped with them.

- :mod:`profiles.forward`: the forward passes (prefill, decode/verify over a KV cache) that the profiler
  times and the real engine runs; needs torch and transformers (the ``profile`` extra).
- :mod:`profiles.profiler` and :mod:`profiles.cli` (``run_sim.py profile``): measured profiles on a grid;
  the grid, timing rule and reports work without torch.
- :mod:`profiles.analytical`: roofline profiles of A100, H100 and H200 from architecture configs.
- ``profiles/models/*.json``: architecture configs (HF ``config.json`` style; no weights).
- ``profiles/data/``: shipped profiles, ``<hardware>__<target>__<draft>.csv`` + ``.meta.json``.
- ``profiles/h200_profile.sh``: the prepared GPU profiling run (``TINY=1`` rehearses it on a CPU).
"""
