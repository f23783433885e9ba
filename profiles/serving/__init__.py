"""The real serving engine: continuous batching with speculative decoding on real models, driven by the same
policy objects as the simulator and writing the same per-request schema (:mod:`.engine`)."""
