"""The workload: what the client sends and when (arrivals, request lengths, its concurrency), as ``vllm bench serve``'s
flags describe it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from policies.errors import require
from simulator.config.checks import MAX_CV, MAX_SIGMA, check_types, choice, flag, named, positive

ARRIVALS = ("poisson", "gamma", "trace")
LENGTH_DISTS = ("fixed", "file", "lognormal")


@dataclass(frozen=True)
class WorkloadConfig:
    """The requests of a run and the client's loop that sends them."""

    arrival: str = "poisson"
    """Arrival process: ``poisson``, ``gamma`` (rate and ``cv``; ``--burstiness B`` sets it with cv = 1/sqrt(B), vLLM's
    ``--burstiness``) or ``trace`` (replay ``trace``)."""
    rate: float | None = None
    """Mean arrival rate, requests/s, > 0 (required for synthetic arrivals; vLLM's ``--request-rate``), or ``inf``:
    every request sent at t = 0, as ``vllm bench serve --request-rate inf`` (with ``max_concurrency``, a closed loop;
    needs ``num_requests``). With a trace: rescale its inter-arrival times to this mean rate (finite; ``None``: the
    trace's own times)."""
    cv: float = 1.0
    """Coefficient of variation of Gamma inter-arrival times, in (0, 100] (1 = Poisson; > 1 bursty; only with
    ``arrival=gamma``). vLLM's burstiness B is 1/cv^2."""
    num_requests: int | None = None
    """Number of requests, > 0 (truncates a trace; vLLM's ``--num-prompts``). ``None``: all of the trace, or until
    ``duration``; synthetic arrivals need this or ``duration``."""
    duration: float | None = None
    """Stop generating arrivals after this many seconds of simulated time (> 0; ``None``: no limit)."""
    trace: str | None = None
    """Trace file (only with ``arrival=trace``): Azure LLM 2023 CSV or plain ``arrival_time,prompt_tokens,output_tokens``
    (seconds, tokens), or Mooncake's JSON lines (a ``.jsonl`` file: ``timestamp`` ms, ``input_length``,
    ``output_length`` and ``hash_ids``, the content ids of the prompt's 512-token blocks, which prefix caching keys
    blocks by)."""
    trace_speedup: float | None = None
    """Divide a trace's inter-arrival times by this factor, > 0 (exclusive with ``rate`` for traces)."""
    length_dist: str = "fixed"
    """Lengths of synthetic requests: ``fixed``, ``file`` (sample rows of ``length_file``: a CSV or a ShareGPT JSON
    dataset), ``lognormal``."""
    prompt_len: int = 512
    """Prompt tokens (fixed), or the median prompt length (lognormal); tokens, > 0."""
    output_len: int = 128
    """Output tokens (fixed), or the median output length (lognormal); tokens, > 0."""
    length_sigma: float = 1.0
    """Sigma of log-length for the lognormal length distribution, in (0, 10]."""
    length_file: str | None = None
    """Lengths to sample (only with ``length_dist=file``; ``--dataset-path`` sets both): a CSV with
    ``num_prefill_tokens,num_decode_tokens`` (ShareGPT statistics) or ``prompt_tokens,output_tokens``, or a ShareGPT
    JSON dataset (``[{"conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}]``, as ``vllm bench serve
    --dataset-name sharegpt``: first human turn the prompt, the next turn the output; token counts from ``tokenizer``,
    else estimated as ceil(characters / 4))."""
    max_prompt_len: int = 8192
    """Lognormal and file lengths are clipped to this many prompt tokens (> 0)."""
    max_output_len: int = 4096
    """Lognormal and file lengths are clipped to this many output tokens (> 0)."""

    tokenizer: str | None = None
    """Hugging Face tokenizer (a ``tokenizer.json``, a folder holding one, or a model name in the local cache) that
    counts the tokens of a ShareGPT JSON ``length_file``, read with the ``tokenizers`` package; nothing is
    downloaded. ``None``: counts estimated as ceil(characters / 4), and the summary's ``workload`` says so."""

    max_concurrency: int | None = None
    """The client's ``--max-concurrency`` (``vllm bench serve``): at most this many requests in flight (> 0); a
    request is sent at its arrival time or, when that many are in flight, as soon as one finishes (a closed loop),
    and its latency counts from sending, as vLLM's client measures it. ``None``: no limit (an open loop)."""

    def __post_init__(self) -> None:
        check_types(self, infinite=("rate",))
        choice("arrival", self.arrival, ARRIVALS)
        choice("length_dist", self.length_dist, LENGTH_DISTS)
        if self.rate is not None:
            positive("rate", self.rate)
        if self.arrival != "trace":
            require(self.rate is not None, f"config: {named('rate')} is required for synthetic arrivals")
            require(math.isfinite(self.rate) or self.num_requests is not None,
                    f"config: {named('rate')} inf sends every request at t = 0: it needs {flag('num_requests')}")
        else:
            require(self.trace is not None, f"config: {named('arrival')} trace needs {flag('trace')} FILE")
            require(self.rate is None or self.trace_speedup is None,
                    f"config: give either {named('rate')} or {named('trace_speedup')} to rescale a trace, not both")
            require(self.rate is None or math.isfinite(self.rate),
                    f"config: {named('rate')} inf with a trace: a trace's arrivals cannot be rescaled to an infinite "
                    "rate (drop it to replay the trace's own times)")
        positive("cv", self.cv)
        require(self.cv <= MAX_CV, f"config: {named('cv')} must be <= {MAX_CV:g} (Gamma shape 1/cv^2 degenerates), "
                                   f"got {self.cv!r}")
        if self.arrival != "gamma":
            require(self.cv == 1.0, f"config: {named('cv')} {self.cv:g} is used only by arrival=gamma (got "
                                    f"arrival={self.arrival}); add --arrival gamma")
        if self.arrival != "trace":
            require(self.trace is None, f"config: {named('trace')} {self.trace} is replayed only with arrival=trace "
                                        f"(got arrival={self.arrival}); drop --arrival or --trace")
            require(self.trace_speedup is None, f"config: {named('trace_speedup')} is used only with arrival=trace "
                                                f"(got arrival={self.arrival})")
        if self.length_dist != "file":
            require(self.length_file is None, f"config: {named('length_file')} {self.length_file} is read only with "
                                              f"length_dist=file (got length_dist={self.length_dist}); "
                                              "add --length-dist file")
        if self.trace_speedup is not None:
            positive("trace_speedup", self.trace_speedup)
        if self.num_requests is not None:
            positive("num_requests", self.num_requests)
        if self.duration is not None:
            positive("duration", self.duration)
        require(self.num_requests is not None or self.duration is not None or self.arrival == "trace",
                f"config: synthetic arrivals need {named('num_requests')} or {named('duration')}")
        positive("prompt_len", self.prompt_len)
        positive("output_len", self.output_len)
        positive("length_sigma", self.length_sigma)
        require(self.length_sigma <= MAX_SIGMA,
                f"config: {named('length_sigma')} must be <= {MAX_SIGMA:g}, got {self.length_sigma!r}")
        if self.length_dist == "file":
            require(self.length_file is not None, f"config: length_dist=file needs {flag('length_file')} FILE")
        positive("max_prompt_len", self.max_prompt_len)
        positive("max_output_len", self.max_output_len)
        if self.tokenizer is not None:
            require(self.length_file is not None and self.length_file.lower().endswith(".json"),
                    f"config: {named('tokenizer')} {self.tokenizer} counts the tokens of a ShareGPT JSON length_file "
                    "only; add --dataset-path FILE.json")
        if self.max_concurrency is not None:
            positive("max_concurrency", self.max_concurrency)
