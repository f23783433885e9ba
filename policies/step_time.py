"""Predicted duration of one speculative decode step: the one formula shared by policies and the simulator.

For proposal lengths k_i over a batch of B requests with context lengths c_i (tokens), DESIGN.md's step is

    draft:   sum over passes j = 1..max k of  draft_time(n_j, sum_{i: k_i >= j} (c_i + j - 1)),
             n_j = #{i: k_i >= j}   (one token per active sequence per pass; none for an n-gram proposer)
    verify:  target_time(B, sum_i (k_i + 1), sum_i c_i)
    + overhead_time(B) [+ speculation_time(B, sum_i (k_i + 1)) when anyone proposes]

with two refinements where the cost model prices them. ``speculation_time`` (``prices_speculation``, a profile's
``spec_overhead`` rows; :func:`step_overhead`): what a speculative step spends beyond its passes and a plain step's
overhead, the proposer's host work (fixed and per sequence: vLLM V1's n-gram lookup runs on the CPU) and the rejection
sampler over every verified token. And the catch-up (``prices_catchup``, :func:`catchup_step_seconds`): the draft's
first pass feeds each request ``lag_i`` tokens, by the engine's rule (:func:`policies.protocol.draft_feed`: the tokens
its draft has not seen, :func:`policies.protocol.draft_lag`, 1 normally and 2 after a wholly accepted proposal; or, in
vLLM 0.10 V1, the accepted tokens and the bonus the target just emitted, over which its EAGLE proposer recomputes the
head's KV; or every verified token, padded), so pass 1 is ``draft_time(n_1, sum (c_i + 1 - lag_i), sum lag_i)`` over
the proposing requests. A profile without them prices neither: the same seconds as before them, bit for bit.

SmartSpec (Liu et al., arXiv 2406.14066, Sec. 4) costs a batch the same way: sequential draft passes
plus one verification pass over every proposed and bonus token. All times are seconds.

The tree form (:class:`TreeStep`, issue 23): request i verifies a token tree S_i of n_i nodes (:mod:`policies.tree`)
in the same one target pass, each sequence's cache read once (tree attention, as vLLM's ``TREE_ATTN`` backend and
SGLang's EAGLE verification), and the draft runs depth(S_i) passes, pass d feeding the e_i(d) =
``S_i.expanded_at_depth(d)`` nodes of depth d - 1 that have children (SGLang: top-k per step)::

    draft:   sum over passes d = 1..max depth of  draft_time(n_d, sum_{i: depth_i >= d} (c_i + f_i(d)),
                                                              sum_{i: depth_i >= d} e_i(d)),
             f_i(d) = e_i(1) + ... + e_i(d - 1)   (the tokens earlier passes fed: the draft's cache grows by them)
    verify:  target_time(B, sum_i (n_i + 1), sum_i c_i)
    + overhead_time(B) [+ speculation_time(B, sum_i (n_i + 1)) when anyone proposes]

A chain has e_i(d) = 1 and f_i(d) = d - 1: the formula above, the same cost-model calls (a pass feeding one token per
sequence is asked without its query count), so the same seconds bit for bit (tested).

A step is summarised by its :class:`StepShape` (token counts per pass), so an adaptive policy can
price "one request one token longer or shorter" in O(max k) with :meth:`StepShape.moved` instead of
re-reading the batch.

The formula is written once, in :func:`step_seconds` (over the priced parts); :func:`shape_seconds` prices a
:class:`StepShape` with it, :func:`uniform_step_seconds` every uniform k of one batch (each draft pass priced
once), and :func:`run_seconds` is its vectorised form for a run of
steps of one unchanged batch (the simulator's fast path): the same additions in the same order, so each step's
seconds equal :func:`shape_seconds` bit for bit (tested). Cost models are anything with the methods of
:class:`StepCosts` (the simulator's ``CostModel`` is one).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import reduce
from operator import add
from typing import Protocol

import numpy as np

from policies.tree import TreeShape


class StepCosts(Protocol):
    """What the step formula asks of a cost model (seconds; tokens are totals over the batch). The batch methods
    price several steps at once and must equal the scalar calls exactly; the simulator's ``CostModel`` builds
    them from the scalar ones unless a model has faster ones."""

    def target_time(self, batch_size: int, query_tokens: int, context_tokens: int) -> float: ...

    def draft_time(self, batch_size: int, context_tokens: int, query_tokens: int | None = None) -> float: ...
    """A draft pass over ``batch_size`` sequences: one new token each, or ``query_tokens`` in all (a catch-up pass, a
    tree's pass feeding several nodes per sequence). Asked with two arguments wherever each sequence feeds one."""

    def overhead_time(self, batch_size: int) -> float: ...

    def speculation_time(self, batch_size: int, query_tokens: int) -> float: ...
    """Seconds a speculative step spends beyond its passes and :meth:`overhead_time` (asked only where the model's
    ``prices_speculation`` is true; a model may lack both: :func:`step_overhead`)."""

    def target_times(self, batch_size: int, query_tokens: int, context_tokens: Sequence[int]) -> list[float]: ...

    def draft_times(self, batch_size: int, context_tokens: Sequence[int]) -> list[float]: ...


@dataclass(frozen=True)
class StepShape:
    """Token counts of one decode step: what the cost model needs, nothing per request."""

    batch_size: int
    """Sequences in the verification pass."""
    query_tokens: int
    """Tokens verified by the target: sum_i (k_i + 1)."""
    context_tokens: int
    """KV-cache tokens attended by the target: sum_i c_i."""
    draft_passes: tuple[tuple[int, int], ...]
    """(sequences, context tokens) of draft pass j = 1..max k; empty when nobody speculates."""

    def moved(self, k: int, context_len: int, delta: int) -> "StepShape":
        """The shape after one request (context ``context_len``) goes from ``k`` to ``k + delta`` (delta = +1 or -1)."""
        passes = list(self.draft_passes)
        j = k + 1 if delta > 0 else k  # the draft pass the request joins or leaves
        seqs, tokens = passes[j - 1] if j <= len(passes) else (0, 0)
        seqs, tokens = seqs + delta, tokens + delta * (context_len + j - 1)
        if j > len(passes):
            passes.append((seqs, tokens))
        elif seqs == 0:
            passes.pop()  # only the last pass can empty: k_i >= j+1 implies k_i >= j
        else:
            passes[j - 1] = (seqs, tokens)
        return StepShape(self.batch_size, self.query_tokens + delta, self.context_tokens, tuple(passes))


def step_shape(context_lens: Sequence[int] | np.ndarray, ks: Sequence[int] | np.ndarray) -> StepShape:
    """Shape of a step with proposal ``ks[i]`` for the request with ``context_lens[i]`` tokens of context.

    Vectorised (a fixed handful of numpy calls whatever the batch size) for arrays; plain Python for lists (the
    simulator's per-step path, where the batch is a list of tens: faster than numpy's calls; integer counts, so the
    same shape, tested).
    """
    if isinstance(context_lens, list) and isinstance(ks, list):
        return _step_shape_lists(context_lens, ks)
    ctx = np.asarray(context_lens, dtype=np.int64)
    kk = np.asarray(ks, dtype=np.int64)
    batch = int(kk.size)
    context_tokens = int(ctx.sum())
    k_max = int(kk.max()) if batch else 0
    if batch == 0 or int(kk.min()) == k_max:  # one k for everyone: no-spec, fixed k, a batch-wide decision
        return uniform_step_shape(batch, context_tokens, k_max)
    # requests proposing exactly k, and their context tokens; pass j runs every request with k_i >= j
    seqs = np.cumsum(np.bincount(kk, minlength=k_max + 1)[::-1])[::-1][1:]
    tokens = np.cumsum(np.bincount(kk, weights=ctx, minlength=k_max + 1)[::-1])[::-1][1:]
    tokens = tokens.astype(np.int64) + seqs * np.arange(k_max, dtype=np.int64)
    return StepShape(batch, int(kk.sum()) + batch, context_tokens, tuple(zip(seqs.tolist(), tokens.tolist())))


def _step_shape_lists(context_lens: list[int], ks: list[int]) -> StepShape:
    """:func:`step_shape` of plain lists of ints, in plain Python."""
    batch = len(ks)
    context_tokens = sum(context_lens)
    k_max = max(ks) if batch else 0
    if batch == 0 or min(ks) == k_max:
        return uniform_step_shape(batch, context_tokens, k_max)
    passes = []
    for j in range(k_max):  # pass j + 1 runs every request with k_i > j, each reading c_i + j tokens
        reading = [c for c, k in zip(context_lens, ks) if k > j]
        passes.append((len(reading), sum(reading) + len(reading) * j))
    return StepShape(batch, sum(ks) + batch, context_tokens, tuple(passes))


def uniform_step_shape(batch_size: int, context_tokens: int, k: int) -> StepShape:
    """:func:`step_shape` of a batch in which every request proposes ``k`` (``context_tokens`` = sum_i c_i),
    in O(k) plain arithmetic: every draft pass runs the whole batch, pass j reading sum_i (c_i + j - 1)."""
    passes = tuple((batch_size, context_tokens + batch_size * j) for j in range(k)) if batch_size else ()
    return StepShape(batch_size, batch_size * (k + 1), context_tokens, passes)


def step_overhead(cost_model: StepCosts, batch_size: int, query_tokens: int) -> float:
    """The step's seconds beyond its passes: ``overhead_time(B)``, plus ``speculation_time(B, query_tokens)`` when
    anyone proposes (``query_tokens > B``) and the cost model prices it (``prices_speculation``; else exactly the
    plain overhead, as every step was priced before it)."""
    overhead = cost_model.overhead_time(batch_size)
    if query_tokens > batch_size and getattr(cost_model, "prices_speculation", False):
        overhead += cost_model.speculation_time(batch_size, query_tokens)
    return overhead


def overhead_pricer(cost_model: StepCosts, batch_size: int) -> Callable[[int], float]:
    """:func:`step_overhead` of ``batch_size`` sequences as a function of the step's verified tokens (a run of steps
    of one batch; the plain overhead priced once where the model does not price speculation)."""
    if not getattr(cost_model, "prices_speculation", False):
        overhead = cost_model.overhead_time(batch_size)
        return lambda query_tokens: overhead
    return lambda query_tokens: step_overhead(cost_model, batch_size, query_tokens)


def uniform_overheads(cost_model: StepCosts, batch_size: int, k_max: int) -> list[float]:
    """:func:`step_overhead` of a step in which all ``batch_size`` sequences propose k, for k = 0..k_max."""
    price = overhead_pricer(cost_model, batch_size)
    return [price(batch_size * (k + 1)) for k in range(k_max + 1)]


def step_seconds(target: float, overhead: float, drafts: Iterable[float]) -> float:
    """The step-time formula over its priced parts: verification + overhead + the draft passes, added in that
    order. Every pricing of a step goes through it (:func:`shape_seconds`, :func:`uniform_step_seconds`) or is
    its vectorised form (:func:`run_seconds`), so all agree bit for bit."""
    seconds = target
    seconds += overhead
    for draft in drafts:
        seconds += draft
    return float(seconds)


def shape_seconds(cost_model: StepCosts, shape: StepShape, draft_cost: bool) -> float:
    """Seconds of a step of this shape: verification + overhead + draft passes (if ``draft_cost``)."""
    return step_seconds(cost_model.target_time(shape.batch_size, shape.query_tokens, shape.context_tokens),
                        step_overhead(cost_model, shape.batch_size, shape.query_tokens),
                        [cost_model.draft_time(seqs, tokens) for seqs, tokens in shape.draft_passes] if draft_cost
                        else ())


def uniform_step_seconds(cost_model: StepCosts, batch_size: int, context_tokens: int, k_max: int,
                         draft_cost: bool) -> list[float]:
    """:func:`shape_seconds` of :func:`uniform_step_shape` for k = 0..k_max: what a batch-wide choice of k
    compares. Step k runs the first k draft passes of step k_max, so each pass is priced once."""
    global _last_uniform
    uniform = getattr(cost_model, "uniform_decode_times", None) if FAST_UNIFORM else None
    if uniform is not None and batch_size:
        # speed shortcut: the cost model prices the k_max + 1 verifications and the k_max draft passes in one call
        # (the scalar calls' numbers, bit for bit); the formula's additions below in step_seconds' order
        targets, drafts = uniform(batch_size, context_tokens, k_max, draft_cost)
        overheads = uniform_overheads(cost_model, batch_size, k_max)
        seconds = [float(reduce(add, drafts[:k], target + overheads[k])) for k, target in enumerate(targets)]
    else:  # the plain twin: the step formula per k over the shape's priced passes
        shape = uniform_step_shape(batch_size, context_tokens, k_max)
        overheads = uniform_overheads(cost_model, batch_size, k_max)
        drafts = [cost_model.draft_time(seqs, tokens) for seqs, tokens in shape.draft_passes] if draft_cost else []
        seconds = [step_seconds(cost_model.target_time(batch_size, batch_size * (k + 1), context_tokens),
                                overheads[k], drafts[:k]) for k in range(k_max + 1)]
    _last_uniform = (cost_model, batch_size, context_tokens, draft_cost, seconds)
    return seconds


def uniform_pricer(cost_model: StepCosts, batch_size: int, k_max: int, draft_cost: bool) -> "UniformPricer":
    """:func:`uniform_step_seconds` of one batch size, ``k_max`` and ``draft_cost`` as a function of the batch's
    context total (a :class:`UniformPricer`): what a policy that decides one k for its batch prices every step
    (``Goodput``), memo included."""
    return UniformPricer(cost_model, batch_size, k_max, draft_cost)


def _affine_until(cost_model: StepCosts, batch_size: int, queries: list[int], reads: list[tuple[int, int]]) -> float:
    """The context total up to which a uniform pricer's seconds (verifications of ``queries`` tokens, draft passes
    ``(extra, fed)`` of ``reads``) are, as functions of the context total c >= 0, affine with every term >= 0 and priced
    without a warning: the cost model's ``affine_until`` of those parts (inf once every block asked has warned), or
    -inf where that cannot be said (a cost model without it, a negative overhead, an empty batch). Where it holds, each
    priced number is that affine value within a few hundred units in the last place (sums and products of
    non-negative numbers): what a goodput policy's decision spans rely on (``policies.goodput.Goodput.spans``)."""
    until = getattr(cost_model, "affine_until", None)
    if until is None or not batch_size or cost_model.overhead_time(batch_size) < 0:
        return -math.inf
    return until(batch_size, queries, reads)


class UniformPricer:
    """The seconds of a batch all proposing k, for k = 0..k_max, as a function of the batch's context total
    (:func:`uniform_pricer`), kept for :func:`uniform_memo` when called; :meth:`quiet` prices without keeping it,
    :meth:`affine_until` says how far the prices are exactly affine in the context total.

    Speed shortcut (switched by :data:`UNIFORM_PRICER`): a cost model that has one (``uniform_decode_pricer``) works
    out once what does not depend on the context total and checks its far limits by comparison, and the formula's
    additions follow in :func:`step_seconds`' order; the same seconds and warnings as :func:`uniform_step_seconds`
    (``tests/test_fast_paths.py``). Otherwise (the plain twin) each call is :func:`uniform_step_seconds`."""

    def __init__(self, cost_model: StepCosts, batch_size: int, k_max: int, draft_cost: bool) -> None:
        self.cost_model, self.batch_size, self.k_max, self.draft_cost = cost_model, batch_size, k_max, draft_cost
        parts = getattr(cost_model, "uniform_decode_pricer", None) if UNIFORM_PRICER and batch_size else None
        self._priced = None if parts is None else parts(batch_size, k_max, draft_cost)
        self._overheads = None if parts is None else uniform_overheads(cost_model, batch_size, k_max)

    def __call__(self, context_tokens: int) -> list[float]:
        global _last_uniform
        if self._priced is None:
            return uniform_step_seconds(self.cost_model, self.batch_size, context_tokens, self.k_max, self.draft_cost)
        targets, drafts = self._priced(context_tokens)
        out, overheads = [], self._overheads
        for k, target in enumerate(targets):  # step_seconds' additions: verification, overhead, draft passes
            seconds = target + overheads[k]
            for draft in drafts[:k]:
                seconds += draft
            out.append(float(seconds))
        _last_uniform = (self.cost_model, self.batch_size, context_tokens, self.draft_cost, out)
        return out

    def quiet(self, context_tokens: int) -> list[float]:
        """The seconds by k over ``context_tokens`` tokens of context in all, :func:`uniform_memo` left as it was."""
        global _last_uniform
        kept = _last_uniform
        out = self(context_tokens)
        _last_uniform = kept
        return out

    def affine_until(self) -> float:
        """:func:`_affine_until` of these steps' parts."""
        b, k_max = self.batch_size, self.k_max
        return _affine_until(self.cost_model, b, [b * (k + 1) for k in range(k_max + 1)],
                             [(b * j, b) for j in range(k_max)] if self.draft_cost else [])


FAST_UNIFORM = True
"""Speed shortcut, switched here in one place: :func:`uniform_step_seconds` asks a cost model that has one for all
of a uniform step's parts in one call (``CostModel.uniform_decode_times``) and adds them as :func:`step_seconds`
does; equal bit for bit (``tests/test_fast_paths.py``). False: the scalar calls through the step's shape."""


UNIFORM_PRICER = True
"""Speed shortcut, switched here in one place: :func:`uniform_pricer` prices through the cost model's
``uniform_decode_pricer`` (the context-free terms once a batch size, the far checks as comparisons); the same seconds
and warnings as :func:`uniform_step_seconds` (``tests/test_fast_paths.py``). False: :func:`uniform_step_seconds` per
call."""


_last_uniform: tuple = (None, 0, 0, False, [])
"""The latest :func:`uniform_step_seconds`: (cost model, batch size, context tokens, draft_cost, seconds by k).
Speed shortcut: :func:`predict_step_seconds` of a uniform step of that batch returns its entry instead of pricing
the step again (an adaptive policy has just priced it on the same cost model); equal bit for bit, as above. The
key is the whole input (the model by identity, held here so that it stays the same object)."""


def uniform_memo(cost_model: StepCosts, batch_size: int, context_tokens: int, k: int, draft_cost: bool) -> float | None:
    """:func:`predict_step_seconds` of a step of ``batch_size`` requests all proposing ``k`` over ``context_tokens``
    tokens of context, if :func:`uniform_step_seconds` has just priced it on ``cost_model`` (else ``None``): its entry,
    the step formula's number bit for bit (speed shortcut: no step shape built; tested)."""
    model, batch, context, draft, seconds = _last_uniform
    if model is cost_model and batch == batch_size and context == context_tokens and draft == draft_cost \
            and k < len(seconds) and batch:
        return seconds[k]
    return None


def catchup_step_seconds(cost_model: StepCosts, context_lens: list[int], ks: list[int], lags: list[int]) -> float:
    """:func:`predict_step_seconds` with the draft's first pass priced at its real query length (module docstring):
    request i (``ks[i]`` > 0) feeds its ``lags[i]`` tokens over the ``c_i + 1 - lags[i]`` the draft holds; in all
    ``sum lags[i]`` tokens, or ``n_1 max lags[i]`` where the cost model's ``batch_layout`` is ``padded``. For a
    cost model whose ``prices_catchup`` is true; with every lag 1 it is the plain formula's step."""
    lag = [g for g, k in zip(lags, ks) if k]
    return shape_catchup_seconds(cost_model, step_shape(context_lens, ks), sum(lag), max(lag, default=0))


def shape_catchup_seconds(cost_model: StepCosts, shape: StepShape, fed: float, longest: float) -> float:
    """:func:`catchup_step_seconds` of a step of this shape whose proposing requests feed ``fed`` tokens in all to the
    draft's first pass, ``longest`` at most each (requests alike, each feeding ``lag``: ``n_1 lag`` and ``lag``;
    :mod:`simulator.studies.offline_copies`)."""
    drafts = []
    if shape.draft_passes:
        (seqs, tokens), *rest = shape.draft_passes
        drafts = [_fed_pass(cost_model, seqs, tokens, fed, longest)]
        drafts += [cost_model.draft_time(s, t) for s, t in rest]
    return step_seconds(cost_model.target_time(shape.batch_size, shape.query_tokens, shape.context_tokens),
                        step_overhead(cost_model, shape.batch_size, shape.query_tokens), drafts)


def _catchup_pass(cost_model: StepCosts, seqs: int, tokens: int, lag: list[int]) -> float:
    """The draft's first pass over ``seqs`` sequences reading ``tokens`` (one new token each) priced at what it feeds:
    each sequence's ``lag`` tokens (:func:`catchup_step_seconds`)."""
    return _fed_pass(cost_model, seqs, tokens, sum(lag), max(lag))


def _fed_pass(cost_model: StepCosts, seqs: int, tokens: float, fed: float, longest: float) -> float:
    """The draft's first pass over ``seqs`` sequences reading ``tokens`` (one new token each) priced at what it feeds:
    ``fed`` tokens in all, ``longest`` at most each."""
    # ragged (vLLM): the lags packed; padded (this project's real engine): every sequence fed the longest lag
    return cost_model.draft_time(seqs, tokens + seqs - fed,
                                 seqs * longest if getattr(cost_model, "batch_layout", "ragged") == "padded" else fed)


def run_seconds(cost_model: StepCosts, batch_size: int, query_tokens: int, context_tokens: Sequence[int],
                draft_passes: Iterable[tuple[int, Sequence[int]]], draft_cost: bool) -> list[float]:
    """:func:`step_seconds` of each step of a run of one batch, vectorised: step j verifies ``query_tokens`` over
    ``context_tokens[j]`` and runs draft passes ``(sequences, contexts)``, pass p reading ``contexts[j]`` tokens
    at step j. The same additions in the same order as :func:`step_seconds`, bit for bit (tested)."""
    overhead = step_overhead(cost_model, batch_size, query_tokens)
    seconds = [t + overhead for t in cost_model.target_times(batch_size, query_tokens, context_tokens)]
    if draft_cost:
        for sequences, pass_contexts in draft_passes:
            seconds = [t + d for t, d in zip(seconds, cost_model.draft_times(sequences, pass_contexts))]
    return seconds


def predict_step_seconds(cost_model: StepCosts, context_lens: Sequence[int] | np.ndarray,
                         ks: Sequence[int] | np.ndarray, draft_cost: bool) -> float:
    """Seconds of one decode step with proposals ``ks`` (see the module docstring for the formula).

    ``draft_cost`` is False for an n-gram proposer (no draft passes).
    """
    if not draft_cost and isinstance(ks, list) and isinstance(context_lens, list):
        # no draft passes to price: the shape without them (speed shortcut; shape_seconds reads none of them)
        return shape_seconds(cost_model, StepShape(len(ks), sum(ks) + len(ks), sum(context_lens), ()), False)
    shape = step_shape(context_lens, ks)
    model, batch, context, draft, seconds = _last_uniform
    if (model is cost_model and batch and batch == shape.batch_size and context == shape.context_tokens
            and draft == draft_cost):
        k = shape.query_tokens // batch - 1
        if k < len(seconds) and shape.query_tokens == batch * (k + 1) and len(shape.draft_passes) == k \
                and all(seqs == batch for seqs, _ in shape.draft_passes):  # uniform: priced just now (speed shortcut)
            return seconds[k]
    return shape_seconds(cost_model, shape, draft_cost)


# -- the tree form (module docstring) ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeStep:
    """Token counts of one decode step in which request i verifies the token tree ``shapes[i]`` (module docstring)."""

    batch_size: int
    query_tokens: int
    """Tokens verified by the target: sum_i (n_i + 1)."""
    context_tokens: int
    """KV-cache tokens attended by the target: sum_i c_i."""
    draft_passes: tuple[tuple[int, int, int], ...]
    """(sequences, context tokens, tokens fed) of draft pass d = 1..max depth; empty when nobody speculates."""

    def moved(self, old: TreeShape, new: TreeShape, context_len: int) -> "TreeStep":
        """The step after one request (context ``context_len``) verifies ``new`` instead of ``old``: its parts of
        each pass taken out and put in (integers, so the same counts as :func:`tree_step` of the moved batch)."""
        passes = [list(p) for p in self.draft_passes]
        for shape, sign in ((old, -1), (new, 1)):
            for d, (fed, before) in enumerate(zip(shape.expanded, shape.fed_before)):
                if d == len(passes):
                    passes.append([0, 0, 0])
                part = passes[d]
                part[0] += sign
                part[1] += sign * (context_len + before)
                part[2] += sign * fed
        while passes and passes[-1][0] == 0:
            passes.pop()
        return TreeStep(self.batch_size, self.query_tokens + new.num_nodes - old.num_nodes, self.context_tokens,
                        tuple((s, t, f) for s, t, f in passes))


def tree_step(context_lens: Sequence[int], shapes: Sequence[TreeShape]) -> TreeStep:
    """The :class:`TreeStep` of requests with ``context_lens[i]`` tokens of context verifying ``shapes[i]``: integer
    sums over the requests grouped by shape (a family's shapes are shared objects, a few per batch)."""
    groups: dict[int, list] = {}
    for c, shape in zip(context_lens, shapes):
        group = groups.get(id(shape))
        if group is None:
            groups[id(shape)] = [shape, 1, c]
        else:
            group[1] += 1
            group[2] += c
    passes = []
    for d in range(max((g[0].depth for g in groups.values()), default=0)):
        seqs = tokens = fed = 0
        for shape, count, context in groups.values():
            if shape.depth > d:
                seqs += count
                tokens += context + count * shape.fed_before[d]
                fed += count * shape.expanded[d]
        passes.append((seqs, tokens, fed))
    return TreeStep(len(shapes), sum(s.num_nodes for s in shapes) + len(shapes), sum(context_lens), tuple(passes))


def _tree_pass(cost_model: StepCosts, seqs: int, tokens: int, fed: int) -> float:
    """One draft pass of a tree step: asked without its query count when it feeds one token per sequence (a chain's
    pass, priced by the same call as the chain form)."""
    return cost_model.draft_time(seqs, tokens) if fed == seqs else cost_model.draft_time(seqs, tokens, fed)


def tree_step_seconds(cost_model: StepCosts, step: TreeStep, draft_cost: bool, lags: list[int] | None = None) -> float:
    """Seconds of a tree step: verification + overhead + draft passes (if ``draft_cost``), by :func:`step_seconds`.
    ``lags`` (those of the requests with a tree, in batch order): the first pass priced at what it feeds, as
    :func:`catchup_step_seconds` (a cost model that ``prices_catchup``)."""
    target = cost_model.target_time(step.batch_size, step.query_tokens, step.context_tokens)  # asked first, as
    drafts = []  # shape_seconds asks
    if draft_cost and step.draft_passes:
        (seqs, tokens, fed), *rest = step.draft_passes
        drafts = [_tree_pass(cost_model, seqs, tokens, fed) if lags is None
                  else _catchup_pass(cost_model, seqs, tokens, lags)]
        drafts += [_tree_pass(cost_model, s, t, f) for s, t, f in rest]
    return step_seconds(target, step_overhead(cost_model, step.batch_size, step.query_tokens), drafts)


def predict_tree_seconds(cost_model: StepCosts, context_lens: Sequence[int], shapes: Sequence[TreeShape],
                         draft_cost: bool, lags: list[int] | None = None) -> float:
    """Seconds of one decode step in which request i verifies ``shapes[i]`` (the tree form, module docstring)."""
    return tree_step_seconds(cost_model, tree_step(context_lens, shapes), draft_cost, lags)


def uniform_tree_pricer(cost_model: StepCosts, batch_size: int, shapes: Sequence[TreeShape],
                        draft_cost: bool) -> "UniformTreePricer":
    """:func:`predict_tree_seconds` of ``batch_size`` requests all verifying ``shapes[j]``, for each j, as a function of
    their context total (a :class:`UniformTreePricer`): the same cost-model calls with the same integer arguments
    (pass d reads the total plus batch x f(d) and feeds batch x e(d)) and :func:`step_seconds`' additions, without
    building the steps (bit for bit, tested). A draft pass that several shapes share (a family's nested shapes share
    most) is priced once."""
    return UniformTreePricer(cost_model, batch_size, shapes, draft_cost)


class UniformTreePricer:
    """The seconds of a batch all verifying one shape, for each shape of a list, as a function of the batch's context
    total (:func:`uniform_tree_pricer`); :meth:`affine_until` says how far they are exactly affine in the context
    total.

    Speed shortcut (switched by :data:`TREE_PRICER`): a cost model that has one (``decode_pricer``) works out once what
    does not depend on the context total and checks its far limits by comparison; the same seconds and warnings as
    the scalar calls (``tests/test_fast_paths.py``)."""

    def __init__(self, cost_model: StepCosts, batch_size: int, shapes: Sequence[TreeShape], draft_cost: bool) -> None:
        self.cost_model, self.batch_size, self.shapes, self.draft_cost = cost_model, batch_size, shapes, draft_cost
        target, draft = cost_model.target_time, cost_model.draft_time
        b, passes, self._plans = batch_size, {}, []
        for shape in shapes:
            self._plans.append([passes.setdefault((b * before, b * fed), len(passes)) for fed, before in
                                zip(shape.expanded, shape.fed_before)] if draft_cost and b else [])
        self.queries, self.reads = [b * (shape.num_nodes + 1) for shape in shapes], list(passes)
        queries, reads = self.queries, self.reads
        overhead_of = overhead_pricer(cost_model, batch_size)
        self.overheads = [overhead_of(query) for query in queries]

        def scalar(context_tokens: int) -> tuple[list[float], list[float]]:  # the plain twin: one call a part
            return ([target(b, query, context_tokens) for query in queries],
                    [draft(b, context_tokens + extra) if fed == b else draft(b, context_tokens + extra, fed)
                     for extra, fed in reads])

        fast = getattr(cost_model, "decode_pricer", None) if TREE_PRICER and b else None
        self._parts = scalar if fast is None else fast(b, queries, reads, scalar)

    def __call__(self, context_tokens: int) -> list[float]:
        """The seconds by shape over ``context_tokens`` tokens of context in all."""
        targets, drafts = self._parts(context_tokens)
        out = []
        for total, keys, overhead in zip(targets, self._plans, self.overheads):  # step_seconds' additions:
            total += overhead  # verification, overhead, passes
            for key in keys:
                total += drafts[key]
            out.append(float(total))
        return out

    quiet = __call__
    """The same (it keeps no memo)."""

    def affine_until(self) -> float:
        """:func:`_affine_until` of these steps' parts."""
        return _affine_until(self.cost_model, self.batch_size, self.queries, self.reads)


def uniform_step_pricer(cost_model: StepCosts, batch_size: int, shape: TreeShape,
                        draft_cost: bool) -> Callable[[int], float]:
    """The seconds of ``batch_size`` requests all verifying ``shape`` (a chain of k nodes: all proposing k) as a
    function of their context total: :func:`uniform_tree_pricer`'s number of that one shape, bit for bit.

    Speed shortcut (switched by :data:`STEP_PRICER`): a cost model that has one (``step_pricer``) adds the step's parts
    up as it works them out; the same seconds and warnings (``tests/test_fast_paths.py``)."""
    plain = UniformTreePricer(cost_model, batch_size, [shape], draft_cost)

    def one(context_tokens: int) -> float:  # the plain twin
        return plain(context_tokens)[0]

    fused = getattr(cost_model, "step_pricer", None) if STEP_PRICER and batch_size else None
    return one if fused is None else fused(batch_size, plain.queries[0], plain.reads, plain.overheads[0], one)


STEP_PRICER = True
"""Speed shortcut, switched here in one place: :func:`uniform_step_pricer` prices through the cost model's
``step_pricer`` (the context-free terms once, the parts added as worked out); the same seconds and warnings as
:func:`uniform_tree_pricer` (``tests/test_fast_paths.py``). False: that pricer's number."""


TREE_PRICER = True
"""Speed shortcut, switched here in one place: :func:`uniform_tree_pricer` prices through the cost model's
``decode_pricer`` (the context-free terms once a batch size, the far checks as comparisons); the same seconds and
warnings as the scalar calls (``tests/test_fast_paths.py``). False: the scalar calls every pricing."""
