"""A draft model drafting token trees (vLLM's ``draft_model`` method with a ``speculative_token_tree``; SGLang's
STANDALONE with ``--speculative-eagle-topk`` > 1).

The draft model keeps its own KV cache of the request's context; ``pending`` are the tokens of the context it has not
fed yet (after a prefill, the first output token; after a step, what the step emitted past the nodes it fed). A
step's first pass feeds them and gives the root's candidates; pass d feeds the nodes of depth d - 1 that the shape
expands (:class:`profiles.serving.token_tree.TreeProposer`). After verification the cache keeps the accepted path's
nodes that were fed (those with children in the shape: a prefix of the path), moved to follow the context
(:meth:`profiles.serving.kv.KVBatch.keep`); the path's other nodes and the emitted token become pending. On a chain
this is the engine's chain drafting (:meth:`profiles.serving.engine.RealEngine._draft_proposals`), which runs chains.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from profiles.models import forward
from profiles.serving.kv import KVBatch
from profiles.serving.token_tree import DraftTree, TreeProposer


class DraftModelTrees(TreeProposer):
    """Token trees from ``model`` (a draft model on the target's vocabulary) on its cache ``kv``."""

    def __init__(self, model: PreTrainedModel, kv: KVBatch, temperature: float, rng: np.random.Generator) -> None:
        super().__init__(kv, temperature, rng)
        self.model = model
        self.pending: list[list[int]] = []
        """Per row, the context tokens not yet in the cache."""

    def prefill(self, prompts: list[list[int]], first: list[int], features: list[torch.Tensor] | None = None) -> None:
        """New rows: the prompts into the cache, their first output tokens pending."""
        self.kv.prefill(prompts)
        self.pending += [[t] for t in first]

    def _catch_up(self) -> tuple[torch.Tensor, int]:
        held = self.kv.lengths()
        self.prefix = [h + len(p) for h, p in zip(held, self.pending)]
        return self.kv.extend(self.pending, all_logits=False), len(self.pending) * max(map(len, self.pending))

    def _expanded(self, trees: list[DraftTree], nodes: list[list[int]], states: torch.Tensor) -> torch.Tensor:
        return forward.logits(self.model, states)

    def commit(self, trees: list[DraftTree] | None, paths: list[list[int]], tokens: list[int],
               features: list[torch.Tensor] | None = None) -> None:
        if trees is None:
            for pending, token in zip(self.pending, tokens):
                pending.append(token)
            return
        assert self.prefix is not None
        kept = [[fed[n] for n in path if n in fed] for fed, path in zip(self.fed, paths)]
        self.kv.keep(self.prefix, kept)
        self.pending = [[tree.tokens[n] for n in path if n not in fed] + [token]
                        for tree, fed, path, token in zip(trees, self.fed, paths, tokens)]
        self.prefix = None

    def remove(self, rows: Sequence[int]) -> list[int]:
        order = self.kv.remove(rows)
        self.pending = [self.pending[i] for i in order]
        return order
