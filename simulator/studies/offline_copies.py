"""SpecDecode-Bench's offline experiment: B identical copies of one prompt run to completion, one prompt after another.

What the published runs did (``profiles/data/specdecode_bench/settings.md``): for each prompt (P prompt tokens, N output
tokens) and batch size B, ``LLM.generate([prompt] * B)`` on an offline engine: the B copies are prefilled together, in
chunks of at most ``max_num_batched_tokens`` tokens (vLLM V1's chunked prefill, 16,384 on an H100), then decoded
together until each has its N tokens; greedy copies of one prompt emit one text, so at every step every copy proposes
and accepts alike (in lockstep). The time is the prefill steps plus the decode steps; the throughput B N / time;
``speedup(B)`` the mean over prompts of the throughput with speculation over the mean of it without.

Here each prompt's decode is a sequence of lockstep steps (:class:`Steps`, one row a step: the context of each copy
before it, the tokens each proposes, what the drafter's first pass feeds each, a weight), and each step is priced by the
simulator's own step formula (:mod:`policies.step_time`) for B requests alike, through the cost model, as the simulated
engine prices it: so the closed form is the simulated engine's time for B requests of one prompt sent at t = 0
(``max_num_seqs`` >= B) whenever the B prompts fit one prefill step (tested; beyond, the engine starts decoding the
copies prefilled first while later chunks prefill, a few steps' overlap the lockstep form leaves out).

Where the steps come from:

- :func:`trace_steps`: a recorded acceptance stream per prompt (``request_id,proposed,accepted``, one row a step), read
  until the prompt's N tokens are out, each step emitting min(accepted + 1, tokens left); a step that proposed nothing
  (an n-gram lookup without a match) verifies the bonus token alone;
- :func:`expected_steps`: the acceptance length AL alone (a curve without a recorded stream, its AL inferred): every
  step emits AL tokens in expectation, (N - 1) / AL steps, the last one a fraction; with an n-gram's match share m,
  each step is m of a proposing step and 1 - m of one that proposes nothing;
- :func:`plain_steps`: without speculation, one token a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from policies.protocol import draft_feed
from policies.step_time import (TreeStep, shape_catchup_seconds, shape_seconds, tree_step_seconds,
                                uniform_step_shape)
from policies.tree import TreeShape
from simulator.costs.cost_model import CostModel

#: vLLM V1's ``max_num_batched_tokens`` for the offline ``LLM`` on a GPU of 70 GiB or more (H100): the prefill chunk.
CHUNK_TOKENS = 16384


@dataclass(frozen=True)
class Prompts:
    """The prompts of one experiment: tokens in each prompt and in its output (the first from the prefill)."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.prompt_tokens)


@dataclass(frozen=True)
class Steps:
    """Lockstep decode steps of every prompt, one row a step, in order within each prompt."""

    prompt: np.ndarray
    """The prompt's index (int)."""
    context: np.ndarray
    """Tokens in each copy's KV cache before the step: P + emitted - 1."""
    proposed: np.ndarray
    """Tokens each copy proposes (0: none; a tree's k counts its nodes)."""
    feed: np.ndarray
    """Tokens the drafter's first pass feeds each copy (:func:`policies.protocol.draft_feed`)."""
    weight: np.ndarray
    """The step's share of the prompt's time: 1, or an expected step's fraction (:func:`expected_steps`)."""


def trace_steps(prompts: Prompts, streams: list[tuple[np.ndarray, np.ndarray]], rule: str,
                depth: Callable[[int], int] = lambda k: k) -> Steps:
    """The lockstep steps of each prompt following its recorded stream ``streams[i]`` = (proposed, accepted per
    step): a step emits min(accepted + 1, tokens left) until the prompt's N - 1 tokens after the prefill are out (a
    stream that runs out first is refused: it does not describe that output). ``rule``: what the drafter's first pass
    feeds (:data:`policies.protocol.DRAFT_EXTENDS`); ``depth``: a proposal's depth (a tree's; a chain's is k)."""
    rows: list[tuple[int, int, int, int]] = []
    for i, (proposed, accepted) in enumerate(streams):
        context, left, feed = int(prompts.prompt_tokens[i]), int(prompts.output_tokens[i]) - 1, 1
        for k, a in zip(proposed.tolist(), accepted.tolist()):
            if left <= 0:
                break
            rows.append((i, context, k, feed))
            emitted = min(a + 1, left)
            context, left = context + emitted, left - emitted
            feed = draft_feed(rule, feed, depth(k), a)
        if left > 0:
            raise ValueError(f"prompt {i}: its stream emits {int(prompts.output_tokens[i]) - 1 - left} of the "
                             f"{int(prompts.output_tokens[i]) - 1} tokens after the prefill")
    table = np.array(rows, dtype=np.int64).reshape(-1, 4).T
    return Steps(table[0], table[1], table[2], table[3], np.ones(table.shape[1]))


def expected_steps(prompts: Prompts, acceptance_length: float, k: int, rule: str, match: float = 1.0,
                   depth: int | None = None) -> Steps:
    """Each prompt's (N - 1) / AL expected steps (module docstring): step j over context P + j AL, the last weighted by
    its fraction; the drafter's first pass feeds AL (``accepted``: the accepted tokens and the bonus, on average),
    ``depth + 1`` (``padded``) or 1 (``unseen``: the draft's own proposals seen). ``match`` < 1: each step is that
    share of a step proposing k and the rest of one proposing nothing (an n-gram lookup's misses)."""
    n = (prompts.output_tokens - 1) / acceptance_length
    count = np.ceil(n).astype(np.int64)
    prompt = np.repeat(np.arange(len(prompts)), count)
    j = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    context = prompts.prompt_tokens[prompt] + j * acceptance_length
    weight = np.minimum(1.0, n[prompt] - j)
    fed = {"accepted": acceptance_length, "padded": (k if depth is None else depth) + 1.0}.get(rule, 1.0)
    ones = np.ones_like(context)
    if match >= 1.0:
        return Steps(prompt, context, np.full(prompt.shape, k), fed * ones, weight)
    return Steps(np.concatenate([prompt, prompt]), np.concatenate([context, context]),
                 np.concatenate([np.full(prompt.shape, k), np.zeros(prompt.shape, np.int64)]),
                 np.concatenate([fed * ones, ones]), np.concatenate([match * weight, (1.0 - match) * weight]))


def plain_steps(prompts: Prompts) -> Steps:
    """Decoding without speculation: N - 1 steps of one token after the prefill, over contexts P .. P + N - 2."""
    count = prompts.output_tokens - 1
    prompt = np.repeat(np.arange(len(prompts)), count)
    j = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    ones = np.ones(prompt.shape, np.int64)
    return Steps(prompt, prompts.prompt_tokens[prompt] + j, 0 * ones, ones, np.ones(prompt.shape))


def prefill_seconds(cost: CostModel, prompt_tokens: int, batch: int, drafts: bool,
                    chunk_tokens: int = CHUNK_TOKENS) -> float:
    """Seconds of the prefill steps of ``batch`` copies of a ``prompt_tokens``-token prompt: chunks of at most
    ``chunk_tokens`` tokens of the copies laid end to end (as the engine's first-come-first-served chunk plan), each
    step its overhead, the target's prefill and (``drafts``) the drafter's, as the simulated engine adds them."""
    total, seconds = batch * prompt_tokens, 0.0
    for start in range(0, total, chunk_tokens):
        tokens = min(chunk_tokens, total - start)
        copies = (start + tokens - 1) // prompt_tokens - start // prompt_tokens + 1
        step = cost.prefill_overhead_time(copies)
        prefill = cost.prefill_time(copies, tokens)
        if drafts:
            prefill += cost.prefill_time(copies, tokens, role="draft")
        seconds += step + prefill
    return seconds


def step_seconds_of(cost: CostModel, batch: int, steps: Steps, drafts: bool,
                    tree: Callable[[int], TreeShape] | None = None) -> np.ndarray:
    """Seconds of each lockstep step of ``batch`` copies, by the simulated engine's step formula
    (:mod:`policies.step_time`): a uniform step of ``batch`` requests over ``batch x context`` tokens each proposing
    ``proposed``, the drafter's first pass fed ``batch x feed`` where the cost model prices it (``prices_catchup``), a
    token tree's form where ``tree`` gives the shape of a proposal."""
    catchup = drafts and getattr(cost, "prices_catchup", False)
    out = np.empty(len(steps.context))
    memo: dict[tuple, float] = {}
    for n, (c, k, f) in enumerate(zip(steps.context.tolist(), steps.proposed.tolist(), steps.feed.tolist())):
        key = (c, k, f if catchup and k else 0)
        seconds = memo.get(key)
        if seconds is None:
            context = batch * c
            if tree is not None and k:
                seconds = tree_step_seconds(cost, uniform_tree_step(batch, context, tree(k)), drafts,
                                            [f] * batch if catchup else None)
            elif catchup and k:
                seconds = shape_catchup_seconds(cost, uniform_step_shape(batch, context, k), batch * f, f)
            else:
                seconds = shape_seconds(cost, uniform_step_shape(batch, context, k), drafts)
            memo[key] = seconds
        out[n] = seconds
    return out


def uniform_tree_step(batch: int, context_tokens: float, shape: TreeShape) -> TreeStep:
    """:func:`policies.step_time.tree_step` of ``batch`` requests alike (``context_tokens`` in all), each verifying
    ``shape``: pass d runs every request, reading the context plus the nodes fed before it, feeding its expanded
    nodes."""
    passes = tuple((batch, context_tokens + batch * before, batch * fed)
                   for fed, before in zip(shape.expanded, shape.fed_before))
    return TreeStep(batch, batch * (shape.num_nodes + 1), context_tokens, passes)


def prompt_seconds(cost: CostModel, prompts: Prompts, steps: Steps, batch: int, drafts: bool,
                   tree: Callable[[int], TreeShape] | None = None, chunk_tokens: int = CHUNK_TOKENS) -> np.ndarray:
    """Each prompt's time (seconds): its prefill steps and its weighted decode steps."""
    decode = np.bincount(steps.prompt, steps.weight * step_seconds_of(cost, batch, steps, drafts, tree),
                         minlength=len(prompts))
    prefill = np.array([prefill_seconds(cost, p, batch, drafts, chunk_tokens) for p in prompts.prompt_tokens.tolist()])
    return prefill + decode


def speedup(with_spec: np.ndarray, spec_outputs: np.ndarray, without: np.ndarray, plain_outputs: np.ndarray,
            batch: int) -> float:
    """SpecDecode-Bench's speedup: the mean over prompts of B N / time with speculation, over the same without (the
    outputs' lengths may differ between the two runs: each its own)."""
    return float(np.mean(batch * spec_outputs / with_spec) / np.mean(batch * plain_outputs / without))

