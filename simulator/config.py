"""The simulation configuration: one frozen dataclass, validated on construction.

Every field is a command-line flag (``--max-num-seqs`` for ``max_num_seqs``) and a possible sweep axis.
Names follow vLLM where it has one (``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
``num_speculative_tokens`` is ``k`` here). Units: seconds, tokens, requests per second, GiB.

The resolved configuration is saved next to every result (``config.json``) and hashed
(:func:`config_hash`) to key sweep cells.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from policies.draft_head import SPECULATIVE_METHODS, method_name, proposer_of
from policies.errors import UserError, require
from policies.protocol import PROPOSERS
from policies.tree import TreeShape, tree_nodes

#: The simulator's default profile: the example shipped with the package, used when ``--profile`` is not given
#: (the validation has its own default, a measured CPU profile).
DEFAULT_SIM_PROFILE = str(Path(__file__).resolve().parent.parent / "profiles" / "data" / "example.json")

ARRIVALS = ("poisson", "gamma", "trace")
LENGTH_DISTS = ("fixed", "file", "lognormal")
SCHEDULERS = ("prefill-first", "chunked-prefill")
ACCEPTANCE_MODELS = ("constant", "beta", "position", "replay", "by-rank")
#: Token trees' rank model by default: P(the target's token is the draft's rank r | not its rank 0), r = 1..4. An
#: ASSUMPTION, not a measurement (no public figure found for a draft model's ranks beyond the first); replace it with
#: ``--acceptance-ranks`` or a measured table (``--acceptance-by-rank``, written by ``profile --acceptance``).
DEFAULT_ACCEPTANCE_RANKS = (0.4, 0.2, 0.1, 0.05)
FITTERS = ("auto", "linear", "interp")
#: vLLM's ``--goodput`` metrics.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
#: Router policies of a fleet (the registry is :data:`simulator.fleet.routers.ROUTERS`, checked against this on import).
ROUTER_NAMES = ("round-robin", "least-outstanding", "power-of-two", "session", "prefix-aware")
#: Links that carry the KV cache between disaggregated prefill and decode instances (the registry with their figures
#: is :data:`simulator.fleet.disagg.KV_LINKS`, checked against this on import).
KV_LINK_NAMES = ("nvlink", "infiniband", "infiniband-hdr", "ethernet")


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation run depends on. Same config and seed: same results, bit for bit."""

    # --- workload -------------------------------------------------------------------------------
    arrival: str = "poisson"
    """Arrival process: ``poisson``, ``gamma`` (rate and ``cv``; ``--burstiness B`` sets it with cv = 1/sqrt(B), vLLM's
    ``--burstiness``) or ``trace`` (replay ``trace``)."""
    rate: float | None = None
    """Mean arrival rate, requests/s, > 0 (required for synthetic arrivals; vLLM's ``--request-rate``). With a trace:
    rescale its inter-arrival times to this mean rate (``None``: the trace's own times)."""
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

    # --- serving engine (vLLM terms) ------------------------------------------------------------
    max_num_seqs: int = 256
    """At most this many running sequences (> 0; vLLM's ``max_num_seqs``)."""
    max_num_batched_tokens: int = 4096
    """Token budget of one engine step, tokens > 0 (prefill tokens, plus decode tokens under chunked prefill)."""
    block_size: int = 16
    """Tokens per KV-cache block (> 0)."""
    num_gpu_blocks: int | None = None
    """KV-cache blocks (> 0). ``None``: derived from the memory budget below and the profile's model sizes."""
    gpu_memory_gb: float | None = None
    """Device memory, GiB (> 0). ``None``: from the profile's metadata."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use, in (0, 1] (vLLM's ``gpu_memory_utilization``)."""
    activation_reserve_gb: float = 2.0
    """Memory kept for activations and workspace, GiB (>= 0)."""
    scheduler: str = "prefill-first"
    """``prefill-first`` (vLLM v0: a step is all prefill or all decode) or ``chunked-prefill`` (vLLM v1, where it is
    always on)."""
    num_scheduler_steps: int = 1
    """vLLM v0's ``--num-scheduler-steps`` (multi-step scheduling), an integer in [1, 64]: after a prefill step the
    decode batch runs this many steps per scheduling, its tokens streamed at the end of each chunk of steps and new
    requests admitted only between chunks; a request that finishes inside a chunk rides along to its end. vLLM 0.6
    allowed it only without speculation and without chunked prefill, and so does this."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """Decode batch sizes captured as CUDA graphs (vLLM's ``--cuda-graph-sizes``; v0 captured 1, 2, 4, 8, 16, ...,
    256): a decode step of B sequences is priced as the smallest captured size >= B (the padding's sequences hold no
    context), and a batch larger than every size runs eagerly at its own size. Empty: no padding (the profile's own
    engine, e.g. this project's, which captures every shape it meets)."""
    enable_prefix_caching: bool = False
    """vLLM's ``--enable-prefix-caching``: a request's leading full KV blocks whose content is already cached (a
    prompt seen before: the same ``prompt_id`` of a trace, the same leading ``hash_ids`` of a Mooncake trace, or the
    same row of a length file) skip prefill; cached
    blocks of finished requests stay until their room is needed (least recently used first). The summary reports
    the hit rate."""

    max_concurrency: int | None = None
    """The client's ``--max-concurrency`` (``vllm bench serve``): at most this many requests in flight (> 0); a
    request is sent at its arrival time or, when that many are in flight, as soon as one finishes (a closed loop),
    and its latency counts from sending, as vLLM's client measures it. ``None``: no limit (an open loop)."""

    replicas: int = 1
    """Identical engine replicas behind a router (> 0; :mod:`simulator.fleet`), each with its own scheduler, KV cache
    and policy; 1: one engine, today's results bit for bit. The run folder gains ``replicas.csv`` (per replica) and
    the summary ``replicas`` and ``load_balance_*``. On the command line, a comma list of profiles instead of a count
    makes a mixed fleet (``replica_profiles``)."""
    replica_profiles: tuple[str, ...] = ()
    """A mixed fleet: one replica per entry, each with that profile's cost model and KV blocks (a profile file, or the
    name of one in profiles/data/ without its suffix, e.g. h100-80gb-vllm__llama-3.1-8b__llama-3.2-1b). ``--replicas
    A,B`` sets it (and ``replicas`` to its length). Kept sorted, so the order of the list changes nothing; the
    replicas are numbered in that order. Empty: ``replicas`` identical replicas of ``profile``."""
    router: str = "round-robin"
    """Router of a fleet (``replicas`` > 1): ``round-robin``, ``least-outstanding`` (fewest requests routed and not
    finished), ``power-of-two`` (the less loaded of two drawn at random), ``session`` (sticky by prompt id) or
    ``prefix-aware`` (longest cached prefix, balanced against load; needs ``enable_prefix_caching``)."""
    prefill_replicas: int = 0
    """Disaggregated prefill and decode (:mod:`simulator.fleet.disagg`; Splitwise, DistServe): this many prefill
    instances (>= 0), which only prefill, emit the first token and send the request's KV cache to one of the
    ``decode_replicas`` decode instances. Both > 0: disaggregated; both 0: off. The run folder's ``replicas.csv`` has a
    row per instance (role prefill or decode)."""
    decode_replicas: int = 0
    """Decode instances of disaggregated serving (>= 0; > 0 with ``prefill_replicas``): each receives requests with
    their KV cache (the draft's too when a draft model speculates) and decodes them with the configured policy."""
    prefill_router: str = "least-outstanding"
    """Router to the prefill instances (disaggregated serving), one of ``router``'s names."""
    decode_router: str = "least-outstanding"
    """Router to the decode instances, chosen when a prefill completes (disaggregated serving): one of ``router``'s
    names but ``prefix-aware`` (decode instances keep no prefix cache)."""
    kv_link: str = "nvlink"
    """Link that carries the KV cache from a prefill to a decode instance (disaggregated serving), per GPU:
    ``nvlink`` (NVLink 4, 450 GB/s per direction), ``infiniband`` (NDR, 50 GB/s), ``infiniband-hdr`` (HDR, 25 GB/s),
    ``ethernet`` (100 GbE, 12.5 GB/s). A transfer takes latency + bytes / (bandwidth x GPUs per instance); one prefill
    instance sends one transfer at a time."""
    kv_link_bandwidth: float | None = None
    """KV link bandwidth per GPU and direction, GB/s (1e9 bytes/s, > 0); ``None``: ``kv_link``'s datasheet figure."""
    kv_link_latency: float | None = None
    """KV link latency per transfer, seconds (>= 0); ``None``: ``kv_link``'s figure."""

    # --- speculation ----------------------------------------------------------------------------
    policy: str = "no-spec"
    """Speculation policy: ``no-spec``, ``fixed-k``, ``threshold`` (vLLM's disable-by-batch-size), ``goodput``
    (SmartSpec), ``vllm-batch-table`` (vLLM's num_speculative_tokens_per_batch_size: ``--policy-param
    table=1:5,8:3,32:1,64:0``), ``sglang-adaptive`` (SGLang's --speculative-adaptive tiers 1,3,7: needs ``--k 7``),
    or a name a ``policy_file`` registers."""
    k: int = 4
    """Proposal length, tokens in [0, 64], for ``fixed-k`` and the upper bound (K_max) for adaptive policies (vLLM's
    ``num_speculative_tokens``; ``--num-speculative-tokens`` is the same flag). With a token tree, k counts tree nodes:
    at most the tree's nodes (on the command line it defaults to them, as vLLM's num_speculative_tokens is the tree's
    size); a policy's k verifies the k-node subtree of highest expected acceptance."""
    policy_params: tuple[tuple[str, Any], ...] = ()
    """Extra policy parameters as (name, value) pairs; given on the command line as ``--policy-param name=value``."""
    policy_file: str | None = None
    """A Python file that registers user policies; loaded before ``policy`` is looked up."""
    proposer: str = "draft"
    """Proposer: ``draft`` (a draft model or draft head, k sequential draft passes) or ``ngram`` (prompt lookup, no
    draft pass)."""
    speculative_method: str | None = None
    """vLLM's speculative method (``--speculative-config`` ``method``): ``draft_model`` (a draft model), ``eagle``,
    ``eagle3`` or ``mtp`` (a draft head on the target's hidden states, its passes priced by the profile's draft rows,
    which must be that head's) or ``ngram``; SGLang's ``--speculative-algorithm`` names (STANDALONE, EAGLE, EAGLE3,
    MTP, NGRAM; the same flag) are taken as vLLM's. ``None``: as ``proposer`` says (draft_model or ngram). Given
    alone it sets ``proposer`` (ngram: ngram, the others: draft); given with a contradicting ``proposer``, an error."""
    ngram_match_prob: float = 0.5
    """n-gram proposer: probability in [0, 1] that the lookup finds a continuation at a step."""
    speculative_token_tree: str | None = None
    """vLLM's token tree (``--speculative-config`` ``speculative_token_tree``): a Python list of paths of child ranks
    from the last verified token, e.g. "[(0,), (1,), (0, 0)]" (rank 0: the draft's most likely token), every prefix of
    a path a node, at most 64 nodes. Every request verifies its tree in one target pass (tree attention) after one draft
    pass per depth. A chain ("[(0,), (0, 0)]") is ordinary speculation. ``None``: no tree."""
    speculative_num_steps: int | None = None
    """SGLang's ``--speculative-num-steps``: draft passes (the tree's depth, >= 1) of an EAGLE tree; with
    ``speculative_eagle_topk`` and ``speculative_num_draft_tokens`` (all three, or none; not with
    ``speculative_token_tree``). SGLang's documented defaults are 5, 4 and 8."""
    speculative_eagle_topk: int | None = None
    """SGLang's ``--speculative-eagle-topk``: branching per draft step (>= 1; 1 is a chain)."""
    speculative_num_draft_tokens: int | None = None
    """SGLang's ``--speculative-num-draft-tokens``: tokens verified per request, the last verified one included (the
    tree keeps the num_draft_tokens - 1 candidates of highest expected acceptance; with top-k 1 it must be num_steps +
    1)."""
    acceptance: str = "constant"
    """Acceptance model: ``constant`` (i.i.d. per token), ``beta`` (per-request probability), ``position`` (per
    position j), ``replay`` (recorded steps of ``acceptance_trace``), ``by-rank`` (a measured table by depth and rank,
    ``acceptance_by_rank``; a chain reads its rank-0 column as ``position``)."""
    acceptance_rate: float = 0.8
    """INPUT: the probability in [0, 1] that the target accepts each proposed token, given the ones before it were
    accepted (Leviathan's alpha; ``constant``), or the Beta mean (``beta``). Flag ``--token-acceptance-prob``
    (``--acceptance-rate`` is its old spelling). Not the measured ``acceptance_rate`` of a summary (accepted /
    proposed tokens), which is lower: a rejection discards the proposed tokens after it (0.8 gives about 0.59 at
    k = 4)."""
    acceptance_concentration: float = 10.0
    """Beta concentration (alpha + beta) of per-request acceptance probabilities (> 0)."""
    acceptance_positions: tuple[float, ...] = ()
    """Acceptance probability in [0, 1] of the j-th proposed token, j = 1.., comma-separated; the last value repeats
    (only with ``acceptance=position``)."""
    acceptance_trace: str | None = None
    """CSV of recorded steps ``request_id,proposed,accepted`` for the replay model (only with ``acceptance=replay``)."""
    acceptance_by_prompt: bool = False
    """``replay`` only: a request whose workload ``prompt_id`` is a ``request_id`` of the trace replays that request's
    own steps from its first, so copies of one prompt accept alike, in lockstep (:mod:`simulator.inputs.acceptance`);
    off: every request replays a stream drawn at random."""
    acceptance_ranks: tuple[float, ...] = DEFAULT_ACCEPTANCE_RANKS
    """Token trees: P(the target's token is the draft's rank r | not its rank 0) for r = 1, 2, ..., comma-separated,
    each in [0, 1], summing to at most 1 (the rest: beyond every candidate); rank r's acceptance at a depth is then
    (1 - top-1 acceptance) x this. The default is an assumption, not a measurement; used only with a token tree."""
    acceptance_by_rank: str | None = None
    """CSV ``depth,rank,probability`` of measured acceptance by depth (1..) and rank (0 = the draft's most likely),
    written by ``profile --acceptance``: the ``by-rank`` acceptance model (giving the file on the command line selects
    it)."""

    # --- cost model -----------------------------------------------------------------------------
    profile: str = DEFAULT_SIM_PROFILE
    """Cost model: a profile CSV (fitted here; ``profiles/data/*.csv``) or a coefficient JSON (default: the shipped
    hand-written ``profiles/data/example.json``)."""
    fitter: str = "auto"
    """Fitter for a profile CSV: ``linear`` (SmartSpec's form), ``interp`` (over the measured grid) or ``auto``: the
    profile's own (``interp`` for a profile calibrated to vLLM results, whose recorded errors were computed with it;
    ``linear`` otherwise)."""
    policy_profile: str | None = None
    """Cost model the policy believes in; ``None``: the same as ``profile`` (a mis-profiled policy otherwise)."""

    # --- metrics --------------------------------------------------------------------------------
    goodput_slo: tuple[tuple[str, float], ...] = ()
    """Per-request SLOs for vLLM's goodput, as ``vllm bench serve --goodput ttft:MS tpot:MS e2el:MS`` (milliseconds,
    >= 0; any of ttft, tpot, e2el): the summary's ``request_goodput`` counts requests/s that meet all of them and
    ``slo_attainment`` their fraction. Flag ``--goodput ttft:500 tpot:50``. Empty: no goodput figure."""

    # --- run ------------------------------------------------------------------------------------
    seed: int = 0
    """Root of every random stream, an integer >= 0 (one SeedSequence, one Generator per stream)."""
    save_steps: bool = False
    """Also write ``steps.csv`` (one row per engine step: its start, seconds, kind, batch size, k, tokens)."""
    strict_fit: bool = False
    """A request that can never fit in the KV cache (prompt + output + lookahead > the cache) stops the run
    (``--strict-fit``). Default: it is ignored, as vLLM does (v0 marks it FINISHED_IGNORED), the rest are served,
    and the summary and the per-request table report it."""

    def __post_init__(self) -> None:
        _check_types(self)
        _choice("arrival", self.arrival, ARRIVALS)
        _choice("length_dist", self.length_dist, LENGTH_DISTS)
        _choice("scheduler", self.scheduler, SCHEDULERS)
        _choice("proposer", self.proposer, PROPOSERS)
        if self.speculative_method is not None:  # stored in vLLM's name (SGLang's mapped)
            object.__setattr__(self, "speculative_method",
                               method_name(self.speculative_method, "config: speculative_method"))
            require(proposer_of(self.speculative_method) == self.proposer,
                    f"config: speculative_method={self.speculative_method} runs proposer "
                    f"{proposer_of(self.speculative_method)}, not proposer={self.proposer}: give one of them "
                    "(--speculative-method or --proposer)")
        _choice("acceptance", self.acceptance, ACCEPTANCE_MODELS)
        _choice("fitter", self.fitter, FITTERS)
        if self.rate is not None:
            _positive("rate", self.rate)
        if self.arrival != "trace":
            require(self.rate is not None, "config: rate is required for synthetic arrivals (--rate)")
        else:
            require(self.trace is not None, "config: arrival=trace needs --trace FILE")
            require(self.rate is None or self.trace_speedup is None,
                    "config: give either rate or trace_speedup to rescale a trace, not both")
        _positive("cv", self.cv)
        require(self.cv <= MAX_CV, f"config: cv must be <= {MAX_CV:g} (Gamma shape 1/cv^2 degenerates), got {self.cv!r}")
        if self.arrival != "gamma":
            require(self.cv == 1.0, f"config: cv={self.cv:g} is used only by arrival=gamma (got arrival={self.arrival}); "
                                    "add --arrival gamma")
        if self.arrival != "trace":
            require(self.trace is None, f"config: trace {self.trace} is replayed only with arrival=trace "
                                        f"(got arrival={self.arrival}); drop --arrival or --trace")
            require(self.trace_speedup is None, "config: trace_speedup is used only with arrival=trace "
                                                f"(got arrival={self.arrival})")
        if self.length_dist != "file":
            require(self.length_file is None, f"config: length_file {self.length_file} is read only with "
                                              f"length_dist=file (got length_dist={self.length_dist}); "
                                              "add --length-dist file")
        if self.acceptance != "replay":
            require(self.acceptance_trace is None, f"config: acceptance_trace {self.acceptance_trace} is replayed "
                                                   f"only with acceptance=replay (got acceptance={self.acceptance}); "
                                                   "add --acceptance replay")
        require(not self.acceptance_by_prompt or self.acceptance == "replay",
                f"config: acceptance_by_prompt replays a trace's streams by prompt (got acceptance={self.acceptance}); "
                "add --acceptance replay --acceptance-trace FILE")
        if self.acceptance != "position":
            require(not self.acceptance_positions, "config: acceptance_positions are used only with "
                                                   f"acceptance=position (got acceptance={self.acceptance})")
        if self.trace_speedup is not None:
            _positive("trace_speedup", self.trace_speedup)
        if self.num_requests is not None:
            _positive("num_requests", self.num_requests)
        if self.duration is not None:
            _positive("duration", self.duration)
        require(self.num_requests is not None or self.duration is not None or self.arrival == "trace",
                "config: synthetic arrivals need num_requests or duration")
        _positive("prompt_len", self.prompt_len)
        _positive("output_len", self.output_len)
        _positive("length_sigma", self.length_sigma)
        require(self.length_sigma <= MAX_SIGMA, f"config: length_sigma must be <= {MAX_SIGMA:g}, got {self.length_sigma!r}")
        if self.length_dist == "file":
            require(self.length_file is not None, "config: length_dist=file needs --length-file FILE")
        _positive("max_prompt_len", self.max_prompt_len)
        _positive("max_output_len", self.max_output_len)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        require(1 <= self.num_scheduler_steps <= 64,
                f"config: num_scheduler_steps must be in [1, 64], got {self.num_scheduler_steps!r}")
        if self.num_scheduler_steps > 1:
            require(self.scheduler == "prefill-first",
                    "config: num_scheduler_steps > 1 (multi-step scheduling) needs scheduler=prefill-first "
                    "(vLLM 0.6 turned chunked prefill off with it)")
            require(self.policy == "no-spec" or self.k == 0,
                    f"config: num_scheduler_steps > 1 (multi-step scheduling) runs without speculation, as in vLLM 0.6; "
                    f"got policy={self.policy} with k={self.k} (use --policy no-spec)")
        for size in self.cuda_graph_sizes:
            require(isinstance(size, int) and 1 <= size <= 1_000_000,
                    f"config: cuda_graph_sizes must be whole numbers >= 1, got {size!r}")
        require(list(self.cuda_graph_sizes) == sorted(set(self.cuda_graph_sizes)),
                f"config: cuda_graph_sizes must be increasing without repeats, got {list(self.cuda_graph_sizes)}")
        if self.max_concurrency is not None:
            _positive("max_concurrency", self.max_concurrency)
        _positive("replicas", self.replicas)
        _choice("router", self.router, ROUTER_NAMES)
        if self.replica_profiles:  # a mixed fleet: sorted (the list's order changes nothing), one replica an entry
            profiles = tuple(sorted(p.strip() for p in self.replica_profiles))
            require(len(profiles) > 1, f"config: replica_profiles {list(profiles)}: one profile is not a fleet "
                                       "(give --profile, or two profiles or more)")
            require(self.replicas in (1, len(profiles)), f"config: replicas={self.replicas} but {len(profiles)} "
                                                         "replica_profiles (one replica per profile)")
            object.__setattr__(self, "replica_profiles", profiles)
            object.__setattr__(self, "replicas", len(profiles))
        if self.replicas > 1:
            require(self.max_concurrency is None,
                    "config: replicas > 1 with max_concurrency is not modelled (the client's closed loop feeds one engine)")
            require(self.router != "prefix-aware" or self.enable_prefix_caching,
                    "config: router=prefix-aware needs enable_prefix_caching (--enable-prefix-caching)")
        _check_disaggregation(self)
        if self.num_gpu_blocks is not None:
            _positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.gpu_memory_gb is not None:
            _positive("gpu_memory_gb", self.gpu_memory_gb)
        require(0.0 < self.gpu_memory_utilization <= 1.0,
                f"config: gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        require(self.activation_reserve_gb >= 0,
                f"config: activation_reserve_gb must be >= 0, got {self.activation_reserve_gb}")
        require(isinstance(self.k, int) and self.k >= 0, f"config: k must be an integer >= 0, got {self.k}")
        require(self.k <= 64, f"config: k must be <= 64, got {self.k}")
        _probability("ngram_match_prob", self.ngram_match_prob)
        _probability("acceptance_rate", self.acceptance_rate)
        _positive("acceptance_concentration", self.acceptance_concentration)
        for p in self.acceptance_positions:
            _probability("acceptance_positions", p)
        if self.acceptance == "position":
            require(len(self.acceptance_positions) > 0,
                    "config: acceptance=position needs --acceptance-positions a1,a2,...")
        if self.acceptance == "replay":
            require(self.acceptance_trace is not None,
                    "config: acceptance=replay needs --acceptance-trace FILE")
        _check_tree(self)
        names = [name for name, _ in self.goodput_slo]
        for name, bound in self.goodput_slo:
            require(name in GOODPUT_METRICS, f"config: goodput_slo: unknown metric {name!r} "
                                             f"(one of {', '.join(GOODPUT_METRICS)}, bounds in ms)")
            require(bound >= 0, f"config: goodput_slo: {name} bound must be >= 0 ms, got {bound!r}")
        require(len(set(names)) == len(names), f"config: goodput_slo: a metric given twice ({names})")
        if self.tokenizer is not None:
            require(self.length_file is not None and self.length_file.lower().endswith(".json"),
                    f"config: tokenizer {self.tokenizer} counts the tokens of a ShareGPT JSON length_file only; "
                    "add --dataset-path FILE.json")
        require(isinstance(self.seed, int) and self.seed >= 0, f"config: seed must be an integer >= 0, got {self.seed}")

    # --------------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "SimConfig":
        """A copy with ``changes`` applied (and validated; ``proposer`` and ``speculative_method`` kept in step by
        :func:`align_proposer`)."""
        return dataclasses.replace(self, **align_proposer(changes, {"speculative_method": self.speculative_method}))

    @property
    def proposer_method(self) -> str:
        """The speculative method in vLLM's names: ``speculative_method``, else ``proposer``'s (draft_model or
        ngram)."""
        if self.speculative_method is not None:
            return self.speculative_method
        return "draft_model" if self.proposer == "draft" else "ngram"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = [list(x) if isinstance(x, tuple) else x for x in v]
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "SimConfig":
        """Inverse of :meth:`to_dict`; unknown keys are a user error naming ``source``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"{source}: unknown config field {unknown[0]!r}")
        kwargs = dict(data)
        for name in ("acceptance_positions", "acceptance_ranks", "cuda_graph_sizes", "replica_profiles"):
            if name in kwargs:
                values = kwargs[name]
                require(isinstance(values, (list, tuple)), f"{source}: {name} must be a list, got {values!r}")
                kwargs[name] = tuple(values)
        for field, pair in (("goodput_slo", "[metric, milliseconds]"), ("policy_params", "[name, value]")):
            if field in kwargs:
                kwargs[field] = _named_pairs(kwargs[field], f"{source}: {field} must be a list of {pair} pairs")
        kwargs = align_proposer(kwargs, {})
        try:
            return cls(**kwargs)
        except UserError as exc:
            if source in ("config", "flags") or str(exc).startswith(source):
                raise
            raise UserError(f"{source}: {exc}") from None


#: Upper bounds of a few fields whose larger values make a model degenerate rather than extreme.
MAX_CV = 100.0
MAX_SIGMA = 10.0
#: Every number of a config lies within +-MAX_NUMBER (larger is a typo or an overflow waiting to happen).
MAX_NUMBER = 1e12


def _check_types(config: "SimConfig") -> None:
    """Every field has its declared type: no bool for a number, no float for an int, no text for a bool, every
    number finite and within :data:`MAX_NUMBER` (a JSON config is not coerced: ``"save_steps": "no"`` is refused,
    not taken as true)."""
    import typing

    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        if value is None:
            require(optional, f"config: {f.name} must not be null")
            continue
        base = next((a for a in args if a is not type(None)), hint) if optional else hint
        origin = typing.get_origin(base) or base
        shown = f"{value!r} ({type(value).__name__})"
        if origin is bool:
            require(isinstance(value, bool), f"config: {f.name} must be true or false, got {shown}")
        elif origin is int:
            require(isinstance(value, numbers.Integral) and not isinstance(value, bool),
                    f"config: {f.name} must be a whole number, got {shown}")
            require(abs(value) <= MAX_NUMBER, f"config: {f.name} must be at most {MAX_NUMBER:g}, got {value!r}")
        elif origin is float:
            _number(f.name, value)
        elif origin is str:
            require(isinstance(value, str), f"config: {f.name} must be text, got {shown}")
        elif f.name == "cuda_graph_sizes":
            require(isinstance(value, tuple) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                     for v in value),
                    f"config: {f.name} must be a list of whole numbers, got {shown}")
        elif f.name == "replica_profiles":
            require(isinstance(value, tuple) and all(isinstance(v, str) and v.strip() for v in value),
                    f"config: {f.name} must be a list of profile names or files, got {shown}")
        elif f.name in ("acceptance_positions", "acceptance_ranks"):
            require(isinstance(value, tuple), f"config: {f.name} must be a list of numbers, got {shown}")
            for v in value:
                _number(f.name, v)
        elif f.name == "goodput_slo":
            require(isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                     for p in value),
                    f"config: goodput_slo must be (metric, milliseconds) pairs, got {shown}")
            for _, v in value:
                _number("goodput_slo", v)
        elif f.name == "policy_params":
            require(isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                     for p in value),
                    f"config: policy_params must be (name, value) pairs, got {shown}")
            for name, v in value:
                if isinstance(v, float):
                    require(math.isfinite(v), f"config: policy parameter {name} must be finite, got {v!r}")


def _number(name: str, value: Any) -> None:
    require(isinstance(value, numbers.Real) and not isinstance(value, bool),
            f"config: {name} must be a number, got {value!r} ({type(value).__name__})")
    require(math.isfinite(value), f"config: {name} must be a finite number, got {value!r}")
    require(abs(value) <= MAX_NUMBER, f"config: {name} must be at most {MAX_NUMBER:g}, got {value!r}")


def _check_tree(config: SimConfig) -> None:
    """A token tree (vLLM's string or SGLang's three numbers, :mod:`policies.tree`) and the acceptance by rank: one form
    of tree, valid, with k at most its nodes and a model proposer; the rank model's probabilities; the ``by-rank``
    model with its file, and either only where it is used."""
    sglang = (config.speculative_num_steps, config.speculative_eagle_topk, config.speculative_num_draft_tokens)
    given = [v is not None for v in sglang]
    require(all(given) or not any(given), "config: SGLang's tree needs all of speculative_num_steps, "
                                          "speculative_eagle_topk and speculative_num_draft_tokens")
    require(config.speculative_token_tree is None or not any(given),
            "config: give the tree once: speculative_token_tree (vLLM) or speculative_num_steps, "
            "speculative_eagle_topk and speculative_num_draft_tokens (SGLang)")
    if all(given):
        TreeShape.sglang(*sglang, ((1.0,),))  # the counts checked (which nodes it keeps does not matter here)
    nodes = tree_nodes(config.speculative_token_tree, config.speculative_num_draft_tokens)
    for g in config.acceptance_ranks:
        _probability("acceptance_ranks", g)
    require(sum(config.acceptance_ranks) <= 1.0 + 1e-9,
            f"config: acceptance_ranks must sum to at most 1, got {sum(config.acceptance_ranks):g}")
    if config.acceptance == "by-rank":
        require(config.acceptance_by_rank is not None, "config: acceptance=by-rank needs --acceptance-by-rank FILE")
    require(config.acceptance_by_rank is None or config.acceptance == "by-rank",
            f"config: acceptance_by_rank {config.acceptance_by_rank} is read only with acceptance=by-rank (got "
            f"acceptance={config.acceptance})")
    if config.acceptance_ranks != DEFAULT_ACCEPTANCE_RANKS:
        require(nodes is not None and config.acceptance != "by-rank",
                "config: acceptance_ranks are used only with a token tree and not with acceptance=by-rank (whose "
                "table has its ranks)")
    if nodes is None:
        return
    require(config.k <= nodes, f"config: k={config.k} is more than the token tree's {nodes} nodes (with a tree, k "
                               "counts the nodes verified)")
    require(config.proposer == "draft", "config: a token tree needs a model proposer (proposer=draft): an n-gram "
                                        "lookup proposes one chain")


def _check_disaggregation(config: SimConfig) -> None:
    """The fields of disaggregated prefill and decode: both instance counts > 0 (on) or both 0 (off); off, the other
    disaggregation fields keep their defaults; on, no co-located replicas, client loop or multi-step scheduling."""
    for name in ("prefill_replicas", "decode_replicas"):
        value = getattr(config, name)
        require(value >= 0, f"config: {name} must be >= 0, got {value!r}")
    p, d = config.prefill_replicas, config.decode_replicas
    on = p > 0 and d > 0
    require(on or p == d == 0, f"config: disaggregated serving needs both prefill_replicas and decode_replicas > 0 "
                               f"(got {p} and {d}; both 0 turns it off)")
    _choice("prefill_router", config.prefill_router, ROUTER_NAMES)
    _choice("decode_router", config.decode_router, ROUTER_NAMES)
    _choice("kv_link", config.kv_link, KV_LINK_NAMES)
    if config.kv_link_bandwidth is not None:
        _positive("kv_link_bandwidth", config.kv_link_bandwidth)
    if config.kv_link_latency is not None:
        require(config.kv_link_latency >= 0, f"config: kv_link_latency must be >= 0 s, got {config.kv_link_latency!r}")
    if not on:
        defaults = {f.name: f.default for f in fields(SimConfig)}
        for name in ("prefill_router", "decode_router", "kv_link", "kv_link_bandwidth", "kv_link_latency"):
            require(getattr(config, name) == defaults[name], f"config: {name} is used only by disaggregated serving "
                                                             "(add --prefill-replicas P --decode-replicas D)")
        return
    require(config.replicas == 1, f"config: replicas={config.replicas} (co-located) with prefill_replicas and "
                                  "decode_replicas (disaggregated): give one layout")
    require(config.router == "round-robin", f"config: router={config.router} routes co-located replicas; disaggregated "
                                            "serving routes with prefill_router and decode_router")
    require(config.max_concurrency is None, "config: max_concurrency with disaggregated serving is not modelled")
    require(config.num_scheduler_steps == 1, "config: num_scheduler_steps > 1 with disaggregated serving is not "
                                             "modelled")
    require(config.decode_router != "prefix-aware", "config: decode_router=prefix-aware: decode instances keep no "
                                                    "prefix cache")
    require(config.prefill_router != "prefix-aware" or config.enable_prefix_caching,
            "config: prefill_router=prefix-aware needs enable_prefix_caching (--enable-prefix-caching)")


def align_proposer(changes: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``changes`` (field values to apply over ``before``'s) with ``proposer`` and ``speculative_method`` kept in step:
    one of them given alone carries the other along (a method sets the proposer that runs it; a proposer drops a
    method it does not run); given together they must agree, which :class:`SimConfig` checks."""
    out = dict(changes)
    method, old = out.get("speculative_method"), before.get("speculative_method")
    if "proposer" not in out and isinstance(method, str):
        out["proposer"] = SPECULATIVE_METHODS[method_name(method, "config: speculative_method")]
    elif "proposer" in out and "speculative_method" not in out and isinstance(old, str) \
            and proposer_of(old) != out["proposer"]:
        out["speculative_method"] = None
    return out


def config_hash(config: SimConfig) -> str:
    """Stable short hash of the resolved configuration (16 hex digits)."""
    blob = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _named_pairs(value: Any, message: str) -> tuple[tuple[str, Any], ...]:
    """A JSON list of ``[name, value]`` pairs as a tuple of tuples; ``message`` (+ the value) if it is not one."""
    require(isinstance(value, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in value), f"{message}, got {value!r}")
    return tuple((n, v) for n, v in value)


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    require(value in options, f"config: {name} must be one of {', '.join(options)}; got {value!r}")


def _positive(name: str, value: float) -> None:
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
            f"config: {name} must be > 0, got {value!r}")


def _probability(name: str, value: float) -> None:
    require(isinstance(value, (int, float)) and 0.0 <= value <= 1.0,
            f"config: {name} must be in [0, 1], got {value!r}")
