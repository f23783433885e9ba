"""An EAGLE head drafting chains and token trees on the target's features (vLLM's ``eagle`` method; SGLang's EAGLE).

The head (:mod:`profiles.models.eagle_head`) keeps a KV cache of its inputs, one per context position t: the pair
(f_t, x_{t+1}) of the target's feature at t and the next token, fused by its fc. ``pending`` are the pairs not yet
fed: after a prefill, the pair of the prompt's last position and the first output token (the others are fed at the
prefill, from the target's prefill features, so the head needs prompts of at least 2 tokens); after a step, the
pairs of the root and of every accepted node with the token after it, from the target's features in the
verification pass. A step's first pass feeds them (their outputs use the target's true features) and the root's
output g gives the depth-1 candidates; pass d feeds each node of depth d - 1 that the shape expands as the pair
(g of its parent, its token), so drafted nodes run on the head's own estimates (:class:`profiles.serving.token_tree.
TreeProposer`). After verification the drafted nodes are dropped from the cache and the accepted ones come back as
pending pairs with the target's features: EAGLE's practice, no draft prefill of its own beyond the head's one layer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from profiles.models.eagle_head import EagleHead
from profiles.serving.kv import KVBatch, TreeBlock
from profiles.serving.token_tree import DraftTree, TreeProposer


class EagleProposer(TreeProposer):
    """Chains and trees from ``head`` on its cache ``kv`` (a :class:`KVBatch` of ``head.model``)."""

    def __init__(self, head: EagleHead, kv: KVBatch, temperature: float, rng: np.random.Generator) -> None:
        super().__init__(kv, temperature, rng)
        self.head = head
        self.tokens: list[list[int]] = []
        """Per row, the tokens of the pending pairs."""
        self.features: list[torch.Tensor] = []
        """Per row, the target's features of the pending pairs ``(n, hidden)``."""
        self.states: list[dict[int, torch.Tensor]] = []
        """Per row, this step's head output g of the root (-1) and of each node fed."""

    def prefill(self, prompts: list[list[int]], first: list[int], features: list[torch.Tensor] | None = None) -> None:
        """New rows from the target's prefill ``features[i]`` ``(len(prompts[i]), hidden)``: pairs 0 .. P - 2 into
        the cache, pair P - 1 (with the first output token) pending."""
        assert features is not None
        embeds = [self.head.fuse(f[:-1], torch.tensor(p[1:], device=f.device)) for p, f in zip(prompts, features)]
        self.kv.prefill_hidden([p[1:] for p in prompts], embeds)
        self.tokens += [[t] for t in first]
        self.features += [f[-1:] for f in features]

    def _catch_up(self) -> tuple[torch.Tensor, int]:
        held = self.kv.lengths()
        width = max(map(len, self.tokens))
        embeds = torch.stack([torch.nn.functional.pad(self.head.fuse(f, torch.tensor(t, device=f.device)),
                                                      (0, 0, 0, width - len(t)))
                              for f, t in zip(self.features, self.tokens)])              # (B, q, hidden)
        states = self.kv.extend_tree(TreeBlock.causal(self.tokens, held, embeds))        # (B, q, hidden)
        self.prefix = [h + len(t) for h, t in zip(held, self.tokens)]
        roots = torch.stack([states[i, len(t) - 1] for i, t in enumerate(self.tokens)])  # (B, hidden)
        self.states = [{-1: g} for g in roots]
        return self.head.lm_head(roots), len(self.tokens) * width

    def _embeds(self, trees: list[DraftTree], nodes: list[list[int]]) -> torch.Tensor:
        width = max(len(row) for row in nodes)
        hidden = self.head.config.hidden_size
        rows = []
        for i, (tree, row) in enumerate(zip(trees, nodes)):
            if not row:
                rows.append(self.states[i][-1].new_zeros(width, hidden))
                continue
            parents = torch.stack([self.states[i][tree.parents[n]] for n in row])        # (n, hidden)
            tokens = torch.tensor([tree.tokens[n] for n in row], device=parents.device)
            rows.append(torch.nn.functional.pad(self.head.fuse(parents, tokens), (0, 0, 0, width - len(row))))
        return torch.stack(rows)                                                           # (B, q, hidden)

    def _expanded(self, trees: list[DraftTree], nodes: list[list[int]], states: torch.Tensor) -> torch.Tensor:
        for i, row in enumerate(nodes):
            for j, n in enumerate(row):
                self.states[i][n] = states[i, j]
        return self.head.lm_head(states)

    def commit(self, trees: list[DraftTree] | None, paths: list[list[int]], tokens: list[int],
               features: list[torch.Tensor] | None = None) -> None:
        assert features is not None
        if trees is None:
            for i, token in enumerate(tokens):
                self.tokens[i].append(token)
                self.features[i] = torch.cat([self.features[i], features[i]])
            return
        assert self.prefix is not None
        self.kv.truncate(self.prefix)
        self.tokens = [[tree.tokens[n] for n in path] + [token] for tree, path, token in zip(trees, paths, tokens)]
        self.features = list(features)
        self.prefix, self.states = None, []

    def remove(self, rows: Sequence[int]) -> list[int]:
        order = self.kv.remove(rows)
        self.tokens = [self.tokens[i] for i in order]
        self.features = [self.features[i] for i in order]
        return order
