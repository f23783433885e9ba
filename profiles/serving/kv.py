"""The running batch's KV cache of one model, on either forward path, behind one interface (:class:`KVBatch`).

Rows are the running sequences, in the engine's order. Both implementations answer the same calls:

- :meth:`KVBatch.prefill`: run whole prompts (each in a pass of its own: no padding, the cost is the sum over
  prompts, as a variable-length kernel's) and add them as new rows at the end; the last positions' logits.
- :meth:`KVBatch.extend`: feed ``tokens[i]`` (one or more) after row i's cached tokens; logits ``(B, q, vocab)``
  with row i's tokens at columns ``0 .. len(tokens[i]) - 1`` (``q`` the longest), or of each row's last token.
- :meth:`KVBatch.truncate`: roll each row back to a number of tokens (rejected proposals).
- :meth:`KVBatch.remove`: drop finished rows; returns the old indices of the rows left, in their new order.

:class:`PaddedBatch` is the eager path (:mod:`profiles.models.forward`: Hugging Face's ``DynamicCache``, a padded
rectangle compacted on every merge and removal); :class:`SlotBatch` the optimized one
(:mod:`profiles.models.optimized`: a slot per row in a preallocated cache, in-place writes, CUDA graphs on a GPU;
a removal moves the last rows into the freed slots). :func:`make_kv_batch` picks one from the ``forward`` name.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
from transformers import PreTrainedModel

from profiles.models import forward
from profiles.models.optimized import FORWARDS, GraphedForward, SlotCache, attention_width, last_columns


class KVBatch(Protocol):
    model: PreTrainedModel

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor: ...

    def extend(self, tokens: Sequence[Sequence[int]], all_logits: bool) -> torch.Tensor: ...

    def truncate(self, lengths: Sequence[int]) -> None: ...

    def remove(self, rows: Sequence[int]) -> list[int]: ...

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
        self.batch = forward.merge(self.model, ([self.batch] if self.batch is not None else []) + parts) \
            if len(parts) > 1 or self.batch is not None else parts[0]
        return torch.cat(logits)

    def extend(self, tokens: Sequence[Sequence[int]], all_logits: bool) -> torch.Tensor:
        q = max(len(t) for t in tokens)
        logits = forward.batch_pass(self.model, self.batch, [list(t) for t in tokens], q if all_logits else 1)
        if not all_logits:
            return logits[:, -1]
        # left-padded block -> row i's tokens at columns 0 .. n_i - 1
        shift = torch.tensor([q - len(t) for t in tokens], device=logits.device)
        index = (torch.arange(q, device=logits.device) + shift[:, None]).clamp(max=q - 1)
        return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))

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
            self.cache.lengths[slot] = len(prompt)
            self._lengths.append(len(prompt))
            self.rows += 1
        return torch.cat(logits)

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
