"""The serving engine: its scheduler and its KV cache, in vLLM's terms (``max_num_seqs``, ``max_num_batched_tokens``,
``block_size``, ``gpu_memory_utilization``, ...)."""
from __future__ import annotations

from dataclasses import dataclass

from policies.errors import require
from simulator.config.checks import at_least_zero, check_types, choice, named, positive

SCHEDULERS = ("prefill-first", "chunked-prefill")


@dataclass(frozen=True)
class EngineConfig:
    """One engine's scheduling limits and KV cache (every replica of a fleet has these)."""

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
    strict_fit: bool = False
    """A request that can never fit in the KV cache (prompt + output + lookahead > the cache) stops the run
    (``--strict-fit``). Default: it is ignored, as vLLM does (v0 marks it FINISHED_IGNORED), the rest are served,
    and the summary and the per-request table report it."""

    def __post_init__(self) -> None:
        check_types(self)
        choice("scheduler", self.scheduler, SCHEDULERS)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("block_size", self.block_size)
        require(1 <= self.num_scheduler_steps <= 64,
                f"config: {named('num_scheduler_steps')} must be in [1, 64], got {self.num_scheduler_steps!r}")
        if self.num_scheduler_steps > 1:
            require(self.scheduler == "prefill-first",
                    f"config: {named('num_scheduler_steps')} > 1 (multi-step scheduling) needs scheduler=prefill-first "
                    "(vLLM 0.6 turned chunked prefill off with it)")
        for size in self.cuda_graph_sizes:
            require(isinstance(size, int) and 1 <= size <= 1_000_000,
                    f"config: {named('cuda_graph_sizes')} must be whole numbers >= 1, got {size!r}")
        require(list(self.cuda_graph_sizes) == sorted(set(self.cuda_graph_sizes)),
                f"config: {named('cuda_graph_sizes')} must be increasing without repeats, got "
                f"{list(self.cuda_graph_sizes)}")
        if self.num_gpu_blocks is not None:
            positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.gpu_memory_gb is not None:
            positive("gpu_memory_gb", self.gpu_memory_gb)
        require(0.0 < self.gpu_memory_utilization <= 1.0,
                f"config: {named('gpu_memory_utilization')} must be in (0, 1], got {self.gpu_memory_utilization}")
        at_least_zero("activation_reserve_gb", self.activation_reserve_gb)
