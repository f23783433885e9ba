"""The running batch's KV cache of one model, on either forward path, behind one interface (:class:`KVBatch`).

Rows are the running sequences, in the engine's order. Both implementations answer the same calls:

- :meth:`KVBatch.prefill`: run whole prompts (each in a pass of its own: no padding, the cost is the sum over
  prompts, as a variable-length kernel's) and add them as new rows at the end; the last positions' logits.
- :meth:`KVBatch.extend`: feed ``tokens[i]`` (one or more) after row i's cached tokens; logits ``(B, q, vocab)``
  with row i's tokens at columns ``0 .. len(tokens[i]) - 1`` (``q`` the longest), or of each row's last token.
- :meth:`KVBatch.truncate`: roll each row back to a number of tokens (rejected proposals).
- :meth:`KVBatch.remove`: drop finished rows; returns the old indices of the rows left, in their new order.

Token trees and draft heads (:mod:`profiles.serving.token_tree`, :mod:`profiles.serving.eagle`) use three more:

- :meth:`KVBatch.prefill_hidden`: as :meth:`~KVBatch.prefill`, from token ids or input embeddings (an EAGLE head's
  fused input), returning every prompt position's final-normed hidden state (the features a head drafts from).
- :meth:`KVBatch.extend_tree`: feed a :class:`TreeBlock`: each new token attends to what the block says (a tree
  node: its sequence's prefix and its own ancestors, at the rotary position of its depth: tree attention); the
  block's final-normed hidden states (the caller applies the LM head where it needs logits).
- :meth:`KVBatch.keep`: keep each row's prefix and the listed tokens after it (the accepted path of a tree), in
  order, dropping the other tokens fed after the prefix.

:class:`PaddedBatch` is the eager path (:mod:`profiles.models.forward`: Hugging Face's ``DynamicCache``, a padded
rectangle compacted on every merge and removal); :class:`SlotBatch` the optimized one
(:mod:`profiles.models.optimized`: a slot per row in a preallocated cache, in-place writes, CUDA graphs on a GPU;
a removal moves the last rows into the freed slots). :func:`make_kv_batch` picks one from the ``forward`` name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from profiles.models import forward
from profiles.models.optimized import (FORWARDS, GraphedForward, SlotCache, TreeInputs, attention_width,
                                       last_columns)


@dataclass(frozen=True)
class TreeBlock:
    """New tokens for each row with what each attends to: a row's token t (0-based, over the tokens the row holds,
    the new ones counted after the held ones) attends to the row's tokens ``0 .. prefix - 1`` and to the tokens
    ``sees`` lists (its tree ancestors fed after the prefix, itself included). A causal block is the case where
    every token's prefix is everything before it (:meth:`causal`)."""

    tokens: list[list[int]]
    """Row i's new token ids (``n_i >= 0`` of them)."""
    positions: list[list[int]]
    """Their rotary positions (a tree node's: its root's position plus its depth, so that the path kept by
    :meth:`KVBatch.keep` reads as consecutive positions)."""
    prefix: list[list[int]]
    """Per new token: how many of the row's first tokens it attends to."""
    sees: list[list[tuple[int, ...]]]
    """Per new token: the further tokens it attends to (indices >= its prefix), itself included."""
    embeds: torch.Tensor | None = None
    """Input embeddings ``(B, q, hidden)`` replacing the tokens' own (row i's at columns ``0 .. n_i - 1``; q the
    longest row), or None."""

    @classmethod
    def causal(cls, tokens: Sequence[Sequence[int]], held: Sequence[int],
               embeds: torch.Tensor | None = None) -> "TreeBlock":
        """``tokens[i]`` after row i's ``held[i]`` tokens, each attending to everything before it."""
        return cls([list(t) for t in tokens], [[h + j for j in range(len(t))] for t, h in zip(tokens, held)],
                   [[h + j for j in range(len(t))] for t, h in zip(tokens, held)],
                   [[(h + j,) for j in range(len(t))] for t, h in zip(tokens, held)], embeds)


class KVBatch(Protocol):
    model: PreTrainedModel

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor: ...

    def extend(self, tokens: Sequence[Sequence[int]], all_logits: bool) -> torch.Tensor: ...

    def truncate(self, lengths: Sequence[int]) -> None: ...

    def remove(self, rows: Sequence[int]) -> list[int]: ...

    def prefill_hidden(self, prompts: list[list[int]], embeds: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Prefill each prompt (or ``embeds[i]``, ``(len(prompts[i]), hidden)``) into a new row; each prompt's
        final-normed hidden states ``(len(prompts[i]), hidden)``."""
        ...

    def extend_tree(self, block: TreeBlock) -> torch.Tensor:
        """Feed ``block``; its final-normed hidden states ``(B, q, hidden)``, row i's new tokens at columns
        ``0 .. n_i - 1``."""
        ...

    def keep(self, prefix: Sequence[int], kept: Sequence[Sequence[int]]) -> None:
        """Keep row i's first ``prefix[i]`` tokens and then its tokens ``kept[i]`` (increasing indices), dropping
        the rest."""
        ...

    def lengths(self) -> list[int]: ...

    def slots(self) -> int:
        """Cache positions the next pass's attention reads, summed over rows (padding included)."""
        ...

    @property
    def capture_seconds(self) -> float:
        """Wall seconds spent capturing CUDA graphs (0 on the eager path)."""
        ...


class PaddedBatch:
    """The eager path: a :class:`profiles.models.forward.BatchCache` (new tokens appended as a left-padded block)."""

    capture_seconds = 0.0
    """No graphs on this path."""

    def __init__(self, model: PreTrainedModel, batch: forward.BatchCache | None = None) -> None:
        self.model = model
        self.batch = batch

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        parts, logits = [], []
        for prompt in prompts:
            part = forward.empty_batch_cache(self.model, 1)
            logits.append(forward.batch_pass(self.model, part, [prompt], 1)[:, -1])
            parts.append(part)
        self._add(parts)
        return torch.cat(logits)

    def prefill_hidden(self, prompts: list[list[int]], embeds: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        device = self.model.device
        parts, states = [], []
        for i, prompt in enumerate(prompts):
            n = len(prompt)
            part = forward.empty_batch_cache(self.model, 1)
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None]       # (1, n, n)
            states.append(forward.tree_pass(
                self.model, part, torch.tensor([prompt], device=device), None if embeds is None else embeds[i][None],
                torch.arange(n, device=device)[None], causal, torch.ones(1, n, dtype=torch.bool, device=device))[0])
            parts.append(part)
        self._add(parts)
        return states

    def _add(self, parts: list[forward.BatchCache]) -> None:
        """Append the rows of ``parts`` (new prefills) to the batch."""
        self.batch = forward.merge(self.model, ([self.batch] if self.batch is not None else []) + parts) \
            if len(parts) > 1 or self.batch is not None else parts[0]

    def extend(self, tokens: Sequence[Sequence[int]], all_logits: bool) -> torch.Tensor:
        q = max(len(t) for t in tokens)
        logits = forward.batch_pass(self.model, self.batch, [list(t) for t in tokens], q if all_logits else 1)
        if not all_logits:
            return logits[:, -1]
        # left-padded block -> row i's tokens at columns 0 .. n_i - 1
        shift = torch.tensor([q - len(t) for t in tokens], device=logits.device)
        index = (torch.arange(q, device=logits.device) + shift[:, None]).clamp(max=q - 1)
        return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))

    def extend_tree(self, block: TreeBlock) -> torch.Tensor:
        device = self.model.device
        counts = np.array([len(t) for t in block.tokens])
        q = max(int(counts.max()), 1)
        rows, width = self.batch.batch_size, self.batch.width
        valid = self.batch.valid.cpu().numpy()
        # the new tokens form a left-padded block of q slots after the cache's width slots
        ids = np.zeros((rows, q), dtype=np.int64)                                 # (B, q)
        positions = np.zeros((rows, q), dtype=np.int64)                           # (B, q)
        visible = np.zeros((rows, q, width + q), dtype=bool)                      # (B, q, width + q)
        for i, n in enumerate(counts):
            pad = q - n
            slot_of = np.concatenate([np.flatnonzero(valid[i]), width + pad + np.arange(n)])  # token index -> slot
            ids[i, pad:] = block.tokens[i]
            positions[i, pad:] = block.positions[i]
            for j in range(n):
                visible[i, pad + j, slot_of[:block.prefix[i][j]]] = True
                visible[i, pad + j, slot_of[list(block.sees[i][j])]] = True
            visible[i, np.arange(pad), width + np.arange(pad)] = True  # padding attends to itself (no empty row)
        embeds = None
        if block.embeds is not None:  # right-padded rows -> left-padded
            embeds = torch.zeros(rows, q, block.embeds.shape[-1], dtype=block.embeds.dtype, device=device)
            for i, n in enumerate(counts):
                embeds[i, q - n:] = block.embeds[i, :n]
        states = forward.tree_pass(self.model, self.batch, torch.as_tensor(ids, device=device), embeds,
                                   torch.as_tensor(positions, device=device), torch.as_tensor(visible, device=device),
                                   torch.as_tensor(np.arange(q) >= (q - counts)[:, None], device=device))
        index = (torch.arange(q, device=device) + torch.as_tensor(q - counts, device=device)[:, None]).clamp(max=q - 1)
        return states.gather(1, index[..., None].expand(-1, -1, states.shape[-1]))

    def keep(self, prefix: Sequence[int], kept: Sequence[Sequence[int]]) -> None:
        held = self.lengths()
        mask = torch.zeros(len(held), max(held), dtype=torch.bool)                 # (B, most tokens held)
        for i, (p, tokens) in enumerate(zip(prefix, kept)):
            mask[i, :p] = True
            mask[i, list(tokens)] = True
        forward.keep_tokens(self.batch, mask.to(self.batch.valid.device))

    def truncate(self, lengths: Sequence[int]) -> None:
        forward.truncate(self.batch, torch.as_tensor(list(lengths), device=self.batch.valid.device))

    def remove(self, rows: Sequence[int]) -> list[int]:
        drop = set(rows)
        keep = [i for i in range(self.batch.batch_size) if i not in drop]
        self.batch = forward.select_rows(self.model, self.batch, keep) if keep else None
        return keep

    def lengths(self) -> list[int]:
        return [] if self.batch is None else self.batch.lengths().tolist()

    def slots(self) -> int:
        return 0 if self.batch is None else self.batch.batch_size * self.batch.width


class SlotBatch:
    """The optimized path: rows are slots ``0 .. n - 1`` of a :class:`SlotCache` of ``num_slots`` x ``max_len``."""

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int, use_graphs: bool | None = None) -> None:
        self.model = model
        # One cache and its captured graphs per model and size, reused by later runs (validate serves many):
        # a deployed engine captures once at start-up. Speed shortcut: a new batch only resets the lengths.
        runners = model.__dict__.setdefault("_specsim_slot_runners", {})
        key = (num_slots, max_len, use_graphs)
        if key not in runners:
            runners[key] = GraphedForward(model, SlotCache(model, num_slots, max_len), use_graphs)
        self.run = runners[key]
        self.cache = self.run.cache
        self.cache.lengths.zero_()
        self.rows = 0
        self._lengths: list[int] = []  # host copy of cache.lengths[:rows]

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        device = self.model.device
        logits = []
        for prompt in prompts:
            slot = self.rows
            padded = attention_width(0, len(prompt), self.cache.max_len)  # one captured graph per band of lengths
            ids = torch.tensor([list(prompt) + [0] * (padded - len(prompt))], dtype=torch.long,
                               device=device)                                     # (1, P padded)
            keep = torch.tensor([[len(prompt) - 1]], device=device)                 # (1, 1)
            logits.append(self.run(slot, ids, keep, padded, fresh=True)[:, -1].clone())
            self._added(len(prompt))
        return torch.cat(logits)

    def prefill_hidden(self, prompts: list[list[int]], embeds: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        device = self.model.device
        states = []
        for i, prompt in enumerate(prompts):
            n = len(prompt)
            padded = attention_width(0, n, self.cache.max_len)  # one captured graph per band of lengths
            ids = torch.tensor([list(prompt) + [0] * (padded - n)], dtype=torch.long, device=device)  # (1, P padded)
            inputs = None if embeds is None else F.pad(embeds[i], (0, 0, 0, padded - n))[None]    # (1, P padded, H)
            keep = torch.arange(padded, device=device)[None]                                         # (1, P padded)
            states.append(self.run(self.rows, ids, keep, padded, fresh=True, embeds=inputs, hidden=True)[0, :n].clone())
            self._added(n)
        return states

    def _added(self, length: int) -> None:
        """Count a prefilled row of ``length`` tokens in the next free slot."""
        self.cache.lengths[self.rows] = length
        self._lengths.append(length)
        self.rows += 1

    def extend(self, tokens: Sequence[Sequence[int]], all_logits: bool) -> torch.Tensor:
        device = self.model.device
        counts = [len(t) for t in tokens]
        q = max(counts)
        # one host-to-device copy for the whole block (a copy per row costs ~10 us each on a GPU)
        ids = torch.tensor([list(t) + [0] * (q - len(t)) for t in tokens], dtype=torch.long,
                           device=device)                                         # (B, q), right-padded
        if all_logits:
            keep = last_columns(self.rows, q, q, device)                             # (B, q)
        else:
            keep = torch.tensor(counts, device=device)[:, None] - 1                # (B, 1)
        width = attention_width(max(self._lengths), q, self.cache.max_len)
        logits = self.run(0, ids, keep, width)
        self._lengths = [n + c for n, c in zip(self._lengths, counts)]
        self.cache.lengths[:self.rows] = torch.as_tensor(self._lengths, device=device)
        return logits if all_logits else logits[:, 0]

    def extend_tree(self, block: TreeBlock) -> torch.Tensor:
        device = self.model.device
        counts = [len(t) for t in block.tokens]
        q = max(max(counts), 1)
        width = attention_width(max(self._lengths), q, self.cache.max_len)
        ids = torch.tensor([list(t) + [0] * (q - len(t)) for t in block.tokens], dtype=torch.long,
                           device=device)                                         # (B, q), right-padded
        positions = np.zeros((self.rows, q), dtype=np.int64)                      # (B, q)
        visible = np.zeros((self.rows, q, width), dtype=bool)                     # (B, q, W)
        for i, (n, length) in enumerate(zip(counts, self._lengths)):
            positions[i, :n] = block.positions[i]
            for j in range(n):
                visible[i, j, :block.prefix[i][j]] = True
                visible[i, j, list(block.sees[i][j])] = True
            positions[i, n:] = length + np.arange(n, q)   # padding: written past the row's length, never read
            visible[i, np.arange(n, q), length + np.arange(n, q)] = True  # and attends to itself (no empty row)
        tree = TreeInputs(torch.as_tensor(positions, device=device), torch.as_tensor(visible, device=device))
        states = self.run(0, ids, last_columns(self.rows, q, q, device), width, tree=tree, embeds=block.embeds,
                          hidden=True)
        self._lengths = [n + c for n, c in zip(self._lengths, counts)]
        self.cache.lengths[:self.rows] = torch.as_tensor(self._lengths, device=device)
        return states.clone()  # a graph's output buffer is reused by its next replay; hidden states outlive it

    def keep(self, prefix: Sequence[int], kept: Sequence[Sequence[int]]) -> None:
        moves = [(i, t, p + m) for i, (p, tokens) in enumerate(zip(prefix, kept)) for m, t in enumerate(tokens)
                 if t != p + m]
        if moves:
            self.cache.move_tokens(*(torch.tensor(c, device=self.model.device) for c in zip(*moves)))
        self.truncate([p + len(tokens) for p, tokens in zip(prefix, kept)])

    def truncate(self, lengths: Sequence[int]) -> None:
        self._lengths = list(map(int, lengths))
        self.cache.lengths[:self.rows] = torch.as_tensor(self._lengths, device=self.model.device)

    def remove(self, rows: Sequence[int]) -> list[int]:
        order = list(range(self.rows))
        for row in sorted(rows, reverse=True):
            last = len(order) - 1
            if row != last:  # the last row moves into the freed slot
                self.cache.move(last, row)
                order[row] = order[last]
                self._lengths[row] = self._lengths[last]
            order.pop()
            self._lengths.pop()
        self.rows = len(order)
        return order

    def lengths(self) -> list[int]:
        return list(self._lengths)

    def fill_random(self, lengths: Sequence[int], generator: torch.Generator) -> None:
        """Make the batch ``len(lengths)`` rows holding that many random keys and values each (the engine
        profile's stand-in for prefilled requests)."""
        for slot, n in enumerate(lengths):
            self.cache.fill_random(slot, slot + 1, int(n), generator)
        self.rows, self._lengths = len(lengths), [int(n) for n in lengths]

    def slots(self) -> int:
        if not self.rows:
            return 0
        return self.rows * attention_width(max(self._lengths), 1, self.cache.max_len)

    @property
    def capture_seconds(self) -> float:
        return self.run.capture_seconds


def make_kv_batch(forward_path: str, model: PreTrainedModel, num_slots: int, max_len: int,
                  use_graphs: bool | None = None) -> PaddedBatch | SlotBatch:
    """The running batch's cache of ``model`` on ``forward_path`` (:data:`FORWARDS`): at most ``num_slots`` rows
    of at most ``max_len`` tokens (the optimized path allocates them now; the eager one grows)."""
    if forward_path not in FORWARDS:
        raise ValueError(f"forward path must be one of {FORWARDS} (got {forward_path!r})")
    if forward_path == "eager":
        return PaddedBatch(model)
    return SlotBatch(model, num_slots, max_len, use_graphs)
