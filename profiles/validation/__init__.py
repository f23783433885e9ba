"""Checking the simulator against the real engine: ``validate`` (same arrivals, prompts and policies in both
engines) and the single-request study (one request, target alone versus speculative)."""
