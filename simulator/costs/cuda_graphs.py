"""Decode passes padded to CUDA-graph capture sizes (vLLM's ``--cuda-graph-sizes``).

vLLM captures its decode passes as CUDA graphs at a fixed list of sizes and replays the smallest captured graph that
holds a step, padding it with dummy slots (v0: batch sizes 1, 2, 4, 8, 16, 24, ..., 256 of one token each; v1:
sizes in scheduled tokens, 1, 2, 4, 8, 16, ..., 512). A step larger than every captured size runs eagerly, unpadded.
:class:`CudaGraphPadding` prices a decode pass of ``q`` tokens over ``b`` sequences as the inner cost model's pass of
``pad(q)`` tokens over ``b + pad(q) - q`` sequences, the padding being one-token sequences with no context (they
add token work, not KV reads). Prefill passes and the per-step CPU work are not padded. The step formula stays
the one of :mod:`policies.step_time`; only the passes it asks for are priced padded (a speculative step's host and
sampler seconds, :meth:`CostModel.speculation_time`, are not padded either).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from simulator.costs.cost_model import CostModel


class CudaGraphPadding(CostModel):
    """``inner``'s costs with every decode pass padded to the smallest of ``sizes`` (tokens) that holds it."""

    def __init__(self, inner: CostModel, sizes: tuple[int, ...]) -> None:
        self.inner = inner
        self.sizes = tuple(sizes)
        for name in ("method", "verification", "batch_layout", "draft_method", "draft_extend", "source", "path",
                     "memory", "fit_error"):
            setattr(self, name, getattr(inner, name))

    def padding(self, tokens: int) -> int:
        """Dummy tokens added to a decode pass of ``tokens`` tokens (0 beyond the largest captured size)."""
        i = bisect_left(self.sizes, tokens)
        return self.sizes[i] - tokens if i < len(self.sizes) else 0

    def target_time(self, batch_size: int, query_tokens: int, context_tokens: int) -> float:
        pad = self.padding(query_tokens)
        return self.inner.target_time(batch_size + pad, query_tokens + pad, context_tokens)

    def draft_time(self, batch_size: int, context_tokens: int, query_tokens: int | None = None) -> float:
        tokens = batch_size if query_tokens is None else query_tokens
        pad = self.padding(tokens)
        return self.inner.draft_time(batch_size + pad, context_tokens, None if query_tokens is None else tokens + pad)

    @property
    def prices_catchup(self) -> bool:
        return self.inner.prices_catchup

    def prefill_time(self, batch_size: int, prompt_tokens: int, role: str = "target") -> float:
        return self.inner.prefill_time(batch_size, prompt_tokens, role)

    def prefill_context_time(self, query_tokens: int, context_tokens: int, role: str = "target") -> float:
        return self.inner.prefill_context_time(query_tokens, context_tokens, role)

    def prefill_chunks_time(self, chunks: Sequence[tuple[int, int]], role: str = "target") -> float:
        return self.inner.prefill_chunks_time(chunks, role)

    def overhead_time(self, batch_size: int) -> float:
        return self.inner.overhead_time(batch_size)

    def speculation_time(self, batch_size: int, query_tokens: int) -> float:
        return self.inner.speculation_time(batch_size, query_tokens)

    @property
    def prices_speculation(self) -> bool:
        return self.inner.prices_speculation

    def prefill_overhead_time(self, batch_size: int) -> float:
        return self.inner.prefill_overhead_time(batch_size)

    def frontend_time(self) -> float:
        return self.inner.frontend_time()

    def has(self, role: str, phase: str) -> bool:
        return self.inner.has(role, phase)

    def to_dict(self) -> dict[str, Any]:
        return self.inner.to_dict()


def with_cuda_graphs(cost: CostModel, sizes: tuple[int, ...]) -> CostModel:
    """``cost`` priced with CUDA-graph padding at ``sizes`` (``SimConfig.engine.cuda_graph_sizes``); unchanged when
    empty."""
    return CudaGraphPadding(cost, sizes) if sizes else cost
