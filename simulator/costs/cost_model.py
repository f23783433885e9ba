"""The cost model: predicted seconds of each part of an engine step (units: seconds, tokens).

Step time = draft time (k sequential draft passes) + verification time (one target pass over
sum_i (k_i + 1) tokens) + overhead, with prefill from the same model (DESIGN.md). A model comes from

- a **coefficient JSON** (hand-written what-ifs, or a saved fit), or
- a **profile CSV** (:mod:`simulator.costs.profile_table`) fitted with one of two fitters:

  * ``linear``, SmartSpec's form (Liu et al., arXiv 2406.14066, §4), per (role, phase):
    decode  ``seconds = base + per_seq*b + per_batched_token*(b*q) + per_context_token*(b*c)
    + per_query_context_token*(b*q*c)``, the last term for an engine that verifies by batch expansion
    (each of the q tokens re-reads the sequence's cache; zero for multi-query verification, where the
    b*c term holds the cache reads),
    prefill ``seconds = base + per_seq*b + per_prompt_token*(b*P) + per_prompt_token_sq*(b*P^2)``
    (attention's quadratic term), for b sequences of q new tokens over c cached tokens each, or b
    prompts of P tokens (a prefill chunk of q tokens over c already cached adds its attention over them,
    ``2*per_prompt_token_sq*c*q``: :meth:`CostModel.prefill_context_time`). Non-negative least squares
    on relative error (rows weighted by 1/seconds), so that small batches count as much as large ones.
  * ``interp``: piecewise-multilinear interpolation over the measured grid in the natural axes
    (batch_size, query_len, context_len per sequence; batch_size, prompt_len for prefill). Grid nodes
    that were not measured (an irregular grid: points that did not fit in memory) are filled once at
    fit time by scipy's LinearNDInterpolator of log seconds on log2 axes (costs grow like powers of
    the axes), or by the linear fit outside the measured points' hull. Outside the grid, the value at
    the clamped point plus the linear model's change from the clamped point to the query, or, below the
    grid, times the linear model's ratio (never negative; both continuous at the boundary, :class:`_Table`).

  Queries in totals are averaged per sequence: q = query_tokens / b, c = context_tokens / b,
  P = prompt_tokens / b. A query more than 2x beyond the grid's largest batch size, context or prompt
  length warns once per (role, phase).

A CSV profile needs rows for target/prefill and target/decode; draft/decode and draft/prefill are
optional. Its per-step overhead comes from rows with role ``target``, phase ``overhead`` (fitted
``base + per_seq * batch_size``), and is 0 without them; a prefill step's from phase ``prefill_overhead`` rows
when the profile has them (an engine's prefill step does other work than its decode step), else the same. Rows of
phase ``frontend`` give the serving front end's seconds per request (:meth:`CostModel.frontend_time`; 0 without);
rows of phase ``spec_overhead`` what a speculative step spends beyond its passes and that overhead
(:meth:`CostModel.speculation_time`; fitted as a decode block over batch size and verified tokens, its context 0; 0
without).
Fitted models are cached (see :func:`load_cost_model`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import warnings
from bisect import bisect_right
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from simulator.costs import profile_table
from simulator.config import FITTERS
from policies.draft_head import DEFAULT_DRAFT_METHOD, HEAD_METHODS
from policies.errors import InputWarning, UserError
from policies.protocol import DRAFT_EXTENDS
from simulator.costs.profile_table import (BATCH_LAYOUTS, VERIFICATIONS, Memory, ProfileTable, meta_path, read_json,
                                           read_profile, write_atomic)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pandas as pd

METHODS = ("measured", "analytical", "hand-written")
#: Coefficient names per kind of pass, in fitting priority (a feature collinear with earlier ones is dropped).
COEFFICIENTS = {
    "decode": ("base", "per_batched_token", "per_context_token", "per_seq", "per_query_context_token"),
    "prefill": ("base", "per_prompt_token", "per_prompt_token_sq", "per_seq"),
    "overhead": ("base", "per_seq"),
}
#: Natural (per-sequence) axes of each kind of pass: the interp grid's axes.
AXES = {
    "decode": ("batch_size", "query_len", "context_len"),
    "prefill": ("batch_size", "prompt_len"),
    "overhead": ("batch_size",),
}
#: Coefficient-JSON block of each (role, phase), and the kind of pass it describes.
BLOCKS = {("target", "decode"): "target", ("draft", "decode"): "draft", ("target", "prefill"): "prefill",
          ("draft", "prefill"): "draft_prefill", ("target", "overhead"): "overhead",
          ("target", "prefill_overhead"): "prefill_overhead", ("target", "frontend"): "frontend",
          ("target", "spec_overhead"): "spec_overhead"}
KIND = {"target": "decode", "draft": "decode", "prefill": "prefill", "draft_prefill": "prefill",
        "overhead": "overhead", "prefill_overhead": "overhead", "frontend": "overhead", "spec_overhead": "decode"}
#: Profile columns holding each natural axis (a prefill row's prompt length is its query_len).
PROFILE_COLUMNS = {kind: ("batch_size", "query_len", "context_len")[:len(axes)] for kind, axes in AXES.items()}
REQUIRED_BLOCKS = ("target", "prefill")
OTHER_KEYS = ("method", "source", "memory", "fit_error", "grid", "interp", "verification", "batch_layout",
              "draft_method", "draft_extend")
#: What a model's draft rows can describe: a draft model, or a draft head (vLLM's method names).
DRAFT_METHODS = (DEFAULT_DRAFT_METHOD, *HEAD_METHODS)
#: A query beyond this multiple of the grid's largest batch size or per-sequence length warns.
FAR = 2.0
REPORT_COLUMNS = ["role", "phase", "n_train", "n_test", "mean_rel_error", "max_rel_error"]

Coefficients = dict[str, tuple[float, ...]]
"""Block name -> coefficients in :data:`COEFFICIENTS` order."""
Grid = dict[str, tuple[tuple[float, ...], ...]]
"""Block name -> sorted measured values of each natural axis (:data:`AXES` order)."""


class CostModel:
    """The interface the engine, the policies and the profiler use. Units: seconds and tokens.

    A model of one's own implements the scalar methods (:meth:`target_time`, :meth:`draft_time`,
    :meth:`prefill_time`, :meth:`overhead_time`, :meth:`has`); the batch methods the engine's runs of steps
    use (:meth:`target_times`, :meth:`draft_times`) default to the scalar calls. It satisfies
    :class:`policies.step_time.StepCosts`, what policies price steps with.

    ``method`` (``analytical``, ``hand-written``, or for a measured profile ``measured, HF eager`` or
    ``measured, optimized``: its forward path) is shown in summaries and figure titles; ``verification``
    (``multi-query`` or ``batch-expansion``) says how the modelled engine verifies, i.e. which pricing the
    numbers carry (:mod:`simulator.costs.profile_table`); ``source`` says where the numbers came from (a profile CSV, or a JSON's own note);
    ``path`` is the file the model was loaded from (named in messages); ``memory`` holds the device and
    model sizes (or ``None``); ``fit_error`` the held-out error of the fit (:func:`fit_report` records)
    or ``None``.
    """

    method: str
    verification: str = VERIFICATIONS[0]
    batch_layout: str = BATCH_LAYOUTS[0]
    """``ragged`` or ``padded``: how the modelled engine lays out a catch-up pass's unequal new tokens
    (:mod:`simulator.costs.profile_table`); :func:`policies.step_time.catchup_step_seconds` reads it."""
    draft_method: str = DEFAULT_DRAFT_METHOD
    """What the draft rows price: ``draft_model`` (a draft model) or a draft head's method (``eagle``, ``eagle3``,
    ``mtp``; a profile's metadata ``draft.speculative_method``); a simulation's speculative method must match it."""
    draft_extend: str = DRAFT_EXTENDS[0]
    """What the drafter's first pass of a step feeds each request (:data:`policies.protocol.DRAFT_EXTENDS`; a profile's
    metadata ``draft_extend``): priced where :attr:`prices_catchup` (:func:`policies.protocol.draft_feed`)."""
    source: str
    path: str
    flag: str = "--profile"
    """The flag that named :attr:`path`, for warnings (the runner sets ``--policy-profile`` on the policy's own)."""
    memory: Memory | None
    fit_error: list[dict] | None

    def target_time(self, batch_size: int, query_tokens: int, context_tokens: int) -> float:
        """Seconds of one target forward that decodes/verifies ``batch_size`` sequences:
        ``query_tokens`` = sum_i (k_i + 1), ``context_tokens`` = sum_i of KV tokens before the step."""
        raise NotImplementedError

    def draft_time(self, batch_size: int, context_tokens: int, query_tokens: int | None = None) -> float:
        """Seconds of one draft decode pass over ``batch_size`` sequences holding ``context_tokens`` KV tokens in
        all: one new token each (``query_tokens`` None), or ``query_tokens`` in all (a catch-up pass that feeds
        the draft tokens it has not seen, :func:`policies.step_time.catchup_step_seconds`)."""
        raise NotImplementedError

    @property
    def prices_catchup(self) -> bool:
        """Whether the draft's passes were profiled at more than one new token per sequence, so that a catch-up
        pass has a measured price (False: the simulator prices every draft pass at one token per sequence)."""
        return False

    def target_times(self, batch_size: int, query_tokens: int, context_tokens: Sequence[int]) -> list[float]:
        """:meth:`target_time` for each of ``context_tokens`` (one per step of a run of the same batch). Each
        entry must equal the scalar call exactly (the engine's runs rely on it). This default makes the scalar
        calls, so a model needs only the scalar methods; a subclass may override it with a faster equal one."""
        return [self.target_time(batch_size, query_tokens, c) for c in context_tokens]

    def draft_times(self, batch_size: int, context_tokens: Sequence[int]) -> list[float]:
        """:meth:`draft_time` for each of ``context_tokens``, exactly as the scalar call (default: the scalar
        calls)."""
        return [self.draft_time(batch_size, c) for c in context_tokens]

    def uniform_decode_times(self, batch_size: int, context_tokens: int, k_max: int,
                             drafts: bool) -> tuple[list[float], list[float]]:
        """The parts of a decode step in which all ``batch_size`` sequences propose the same k (what a batch-wide
        choice of k prices): :meth:`target_time` ``(batch_size, batch_size * (k + 1), context_tokens)`` for
        k = 0..k_max, and (if ``drafts``) :meth:`draft_time` ``(batch_size, context_tokens + batch_size * j)`` for
        the draft passes j = 0..k_max - 1 (else no passes). Each must equal the scalar call exactly; this default
        makes the scalar calls (the draft passes first, as :func:`policies.step_time.uniform_step_seconds` did)."""
        passes = [self.draft_time(batch_size, context_tokens + batch_size * j) for j in range(k_max)] if drafts else []
        targets = [self.target_time(batch_size, batch_size * (k + 1), context_tokens) for k in range(k_max + 1)]
        return targets, passes

    def uniform_decode_pricer(self, batch_size: int, k_max: int, drafts: bool) -> Callable[[int], tuple[list[float],
                                                                                                   list[float]]]:
        """:meth:`uniform_decode_times` of one batch size, k_max and ``drafts`` as a function of the context total
        (what a policy deciding one k for its batch asks every step). Each call must equal :meth:`uniform_decode_times`
        exactly, warnings included; this default calls it."""
        return lambda context_tokens: self.uniform_decode_times(batch_size, context_tokens, k_max, drafts)

    def prefill_time(self, batch_size: int, prompt_tokens: int, role: str = "target") -> float:
        """Seconds of one prefill pass over ``batch_size`` fresh prompts (nothing of them in the KV cache) totalling
        ``prompt_tokens`` tokens (role ``draft``: the draft model's prefill). A pass whose sequences have tokens in
        the cache already: :meth:`prefill_chunks_time`."""
        raise NotImplementedError

    def prefill_context_time(self, query_tokens: int, context_tokens: int, role: str = "target") -> float:
        """Seconds by which a prefill chunk of ``query_tokens`` new tokens of one sequence whose KV cache already
        holds ``context_tokens`` tokens (its earlier chunks under chunked prefill, or its cached prefix blocks)
        costs more than a fresh prompt of ``query_tokens`` tokens: its new tokens' attention over the cached ones.
        Units: tokens in, seconds out.

        With T(P) = ``prefill_time(1, P, role)``, the model's own seconds for one fresh prompt of P tokens, the extra
        of a chunk of q tokens after c is T(c + q) - T(c) - T(q) + T(0) seconds, clamped at 0. Why: write
        T(P) = F + L(P) + A(P), with F = T(0) the fixed seconds of a pass (the weights read once, the launches),
        L the seconds of the work per token (projections, MLP: L(x + y) = L(x) + L(y)) and A attention's, which
        grows with the query-key pairs computed (a causal prompt of P tokens: P^2 / 2 of them, so A(P) = a P^2 with
        a in seconds per token squared, 2a seconds a pair). The chunk pays F + L(q) and the pairs of its q tokens
        with all c + q before them, A(c + q) - A(c); a fresh prompt of q tokens pays F + L(q) + A(q). The
        difference, A(c + q) - A(c) - A(q), is what the formula gives (F and L cancel), and for a quadratic T it is
        2 a c q seconds: the c q cross pairs at 2a seconds each (a = ``per_prompt_token_sq`` of the linear fit,
        :class:`LinearCostModel`). The chunks q_1..q_n of one prompt of P tokens (c_i = q_1 + ... + q_(i-1)) then
        cost, for any T, sum_i [T(c_i + q_i) - T(c_i) + T(0)] = T(P) + (n - 1) T(0): the whole prompt plus one
        pass's fixed seconds per further chunk, each chunk being a pass of its own (a telescoping sum; exact until
        the clamp acts). The clamp is for an ``interp`` table, piecewise linear in P with its measured noise, whose
        second difference can dip below 0. T(0) is the model's extrapolation below its grid (no profile measures a
        0-token prompt): the linear fit's intercept (base + per_seq), the interp table's value at its shortest
        prompt scaled by the fit's ratio (:class:`_Table`). The curve is the model's own rather than attention's
        FLOPs from an architecture: every cost model has it, and it carries the measured kernels' speed. This
        default evaluates the formula through :meth:`prefill_time`, so a model of one's own that writes only the
        scalar methods gets it; 0 s without context."""
        if not context_tokens:
            return 0.0
        curve = self.prefill_time
        extra = (curve(1, context_tokens + query_tokens, role) - curve(1, context_tokens, role)
                 - curve(1, query_tokens, role) + curve(1, 0, role))
        return extra if extra > 0.0 else 0.0

    def prefill_chunks_time(self, chunks: Sequence[tuple[int, int]], role: str = "target") -> float:
        """Seconds of one prefill pass over ``chunks``, one (new tokens, tokens already in its KV cache) per
        sequence (the engine's prefill passes; role ``draft``: the draft model's own): the fresh-prompt price of the
        batch, :meth:`prefill_time` (number of chunks, new tokens in all), plus each chunk's
        :meth:`prefill_context_time` (each sequence attends to its own context only). A chunk with nothing cached
        adds nothing (no call): with none, exactly :meth:`prefill_time`."""
        seconds = self.prefill_time(len(chunks), sum(q for q, _ in chunks), role)
        for query_tokens, context_tokens in chunks:
            if context_tokens:
                seconds += self.prefill_context_time(query_tokens, context_tokens, role)
        return seconds

    def overhead_time(self, batch_size: int) -> float:
        """Per-step scheduler and sampling seconds of a decode step of ``batch_size`` sequences."""
        raise NotImplementedError

    def speculation_time(self, batch_size: int, query_tokens: int) -> float:
        """Seconds a speculative step of ``batch_size`` sequences verifying ``query_tokens`` tokens in all spends beyond
        its passes and :meth:`overhead_time`: the engine's host work for speculation (fixed, and per sequence: e.g.
        vLLM V1's n-gram lookup on the CPU, the draft-token bookkeeping) and the rejection sampler over every verified
        token's logits. :func:`policies.step_time.step_overhead` adds it to a step in which anyone proposes, where
        :attr:`prices_speculation`. 0 here: a model without it prices a speculative step's overhead as a plain one's."""
        return 0.0

    @property
    def prices_speculation(self) -> bool:
        """Whether :meth:`speculation_time` is priced (a profile with ``spec_overhead`` rows)."""
        return False

    def prefill_overhead_time(self, batch_size: int) -> float:
        """Per-step seconds beyond the passes of a prefill-only step of ``batch_size`` prompts (default: as a
        decode step's, :meth:`overhead_time`)."""
        return self.overhead_time(batch_size)

    def frontend_time(self) -> float:
        """Seconds the serving front end spends on one request before handing it to the engine (an API server's
        HTTP handling and tokenization; 0 unless the profile has ``frontend`` rows, :mod:`simulator.core.engine`)."""
        return 0.0

    def has(self, role: str, phase: str) -> bool:
        """Whether the model has costs for ``role`` (target, draft) in ``phase`` (prefill, decode, overhead)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """The coefficient JSON of this model; :func:`model_from_dict` inverts it."""
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` as JSON, atomically; :func:`load_cost_model` gives identical predictions."""
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


class LinearCostModel(CostModel):
    """Linear costs (module docstring), in plain float arithmetic: well under a microsecond a call.

    Without a ``draft`` block :meth:`draft_time` raises :class:`UserError` (no draft-model proposer on
    this model); without a ``draft_prefill`` block the draft's prefill costs nothing; without an
    ``overhead`` block the overhead is 0; without a ``spec_overhead`` block :meth:`speculation_time` is 0.
    """

    def __init__(self, coefficients: Coefficients, *, method: str, source: str, path: str,
                 memory: Memory | None = None, grid: Grid | None = None,
                 fit_error: list[dict] | None = None, verification: str = VERIFICATIONS[0],
                 batch_layout: str = BATCH_LAYOUTS[0], draft_method: str = DEFAULT_DRAFT_METHOD,
                 draft_extend: str = DRAFT_EXTENDS[0]) -> None:
        self.method, self.source, self.path, self.verification = method, source, path, verification
        self.batch_layout, self.draft_method, self.draft_extend = batch_layout, draft_method, draft_extend
        self.memory, self.fit_error = memory, fit_error
        self._coef = dict(coefficients)
        self._grid = dict(grid or {})
        self._overhead = self._coef.get("overhead", (0.0, 0.0))
        self._far = {block: _far_limits(self._grid.get(block)) for block in self._coef}
        self._warned: set[str] = set()

    # -- the interface (hot path: keep it plain Python) ----------------------------------------
    def target_time(self, batch_size: int, query_tokens: int, context_tokens: int) -> float:
        self._check_far("target", batch_size, context_tokens)
        return self._decode("target", batch_size, query_tokens, context_tokens)

    def draft_time(self, batch_size: int, context_tokens: int, query_tokens: int | None = None) -> float:
        self._check_draft()
        self._check_far("draft", batch_size, context_tokens)
        return self._decode("draft", batch_size, batch_size if query_tokens is None else query_tokens, context_tokens)

    @property
    def prices_catchup(self) -> bool:
        nodes = self._grid.get("draft")
        return nodes is not None and len(nodes[1]) > 1  # more than one query length per sequence measured

    def target_times(self, batch_size: int, query_tokens: int, context_tokens: Sequence[int]) -> list[float]:
        self._check_far("target", batch_size, max(context_tokens))
        return self._decodes("target", batch_size, query_tokens, context_tokens)

    def draft_times(self, batch_size: int, context_tokens: Sequence[int]) -> list[float]:
        self._check_draft()
        self._check_far("draft", batch_size, max(context_tokens))
        return self._decodes("draft", batch_size, batch_size, context_tokens)

    def uniform_decode_times(self, batch_size: int, context_tokens: int, k_max: int,
                             drafts: bool) -> tuple[list[float], list[float]]:
        # speed shortcut: the scalar calls' checks and :meth:`_decode`'s arithmetic inlined, in their order (the
        # same numbers and warnings; the base class's scalar calls are the plain twin, tests/test_fast_paths.py)
        if type(self)._decode is not LinearCostModel._decode:  # a subclass that evaluates otherwise
            return CostModel.uniform_decode_times(self, batch_size, context_tokens, k_max, drafts)
        passes = []
        if drafts and k_max:  # the draft passes first, as step_time prices them (the same warnings in order)
            self._check_draft()
            base, per_token, per_context, per_seq, per_qc = self._coef["draft"]
            lim_b, lim_c = self._far["draft"]
            for j in range(k_max):
                tokens = context_tokens + batch_size * j
                if batch_size > lim_b or tokens > lim_c * batch_size:
                    self._warn_far("draft", batch_size, tokens / batch_size)
                passes.append(base + per_token * batch_size + per_context * tokens + per_seq * batch_size
                              + per_qc * batch_size * tokens / batch_size)
        self._check_far("target", batch_size, context_tokens)
        base, per_token, per_context, per_seq, per_qc = self._coef["target"]
        targets = [base + per_token * query_tokens + per_context * context_tokens + per_seq * batch_size
                   + per_qc * query_tokens * context_tokens / batch_size
                   for query_tokens in [batch_size * (k + 1) for k in range(k_max + 1)]]
        return targets, passes

    def uniform_decode_pricer(self, batch_size: int, k_max: int,
                              drafts: bool) -> Callable[[int], tuple[list[float], list[float]]]:
        # speed shortcut (switched by policies.step_time.UNIFORM_PRICER, which asks for it): decode_pricer of the
        # uniform step's verifications (q = b (k + 1)) and draft passes (pass j reads c + b j, one token a sequence),
        # uniform_decode_times (the same warnings, in its order) where a far check fails (tests/test_fast_paths.py)
        b, drafts = batch_size, bool(drafts and k_max)
        return self.decode_pricer(b, [b * (k + 1) for k in range(k_max + 1)],
                                  [(b * j, b) for j in range(k_max)] if drafts else [],
                                  lambda context_tokens: self.uniform_decode_times(b, context_tokens, k_max, drafts))

    def decode_pricer(self, batch_size: int, queries: Sequence[int], passes: Sequence[tuple[int, int]],
                      scalar: Callable[[int], tuple[list[float], list[float]]]
                      ) -> Callable[[int], tuple[list[float], list[float]]]:
        """Decode-step parts of ``batch_size`` sequences over a context total c, as a function of c: ``target_time(b,
        q, c)`` for each q of ``queries`` and ``draft_time(b, c + extra, fed)`` for each ``(extra, fed)`` of ``passes``
        (asked without its query count where fed = b), the numbers ``scalar`` (the caller's plain twin, making those
        calls) gives, bit for bit.

        Speed shortcut (switched by the callers' flags, ``policies.step_time.UNIFORM_PRICER`` and ``TREE_PRICER``): the
        terms of :meth:`_decode` that do not depend on c worked out once, left to right as it adds them, and the far
        checks as two comparisons; where one fails and its block has not warned yet, ``scalar`` prices that c (the same
        warnings, in its order). A subclass that evaluates otherwise (``_decode`` overridden) gets ``scalar``."""
        if type(self)._decode is not LinearCostModel._decode:
            return scalar
        b = batch_size
        fixed, seq, per_context, d_fixed, d_context, d_seq, far_target, far_draft, reach, blocks = self._linear_terms(
            b, queries, passes)

        def price(context_tokens: int) -> tuple[list[float], list[float]]:
            if (context_tokens > far_target or context_tokens + reach > far_draft) and not blocks <= self._warned:
                return scalar(context_tokens)
            drafts = [a + d_context * (t := context_tokens + extra) + d_seq + qc * t / b for a, qc, extra in d_fixed]
            reads = per_context * context_tokens
            return [a + reads + seq + qc * context_tokens / b for a, qc in fixed], drafts

        return price

    def step_pricer(self, batch_size: int, query: int, passes: Sequence[tuple[int, int]], overhead: float,
                    scalar: Callable[[int], float]) -> Callable[[int], float]:
        """The seconds of one decode step of ``batch_size`` sequences over a context total c, as a function of c: the
        verification of ``query`` tokens (:meth:`decode_pricer`'s part), plus ``overhead``, plus each pass of
        ``passes`` in turn (``policies.step_time.step_seconds``' additions), the number ``scalar`` (the caller's plain
        twin) gives, bit for bit.

        Speed shortcut (switched by ``policies.step_time.STEP_PRICER``, which asks for it): :meth:`decode_pricer`'s
        terms added up as they are worked out, without lists; where a far check fails and its block has not warned
        yet, ``scalar`` prices that c (the same warnings). A subclass that evaluates otherwise gets ``scalar``."""
        if type(self)._decode is not LinearCostModel._decode:
            return scalar
        b = batch_size
        ((target, qc),), seq, per_context, d_fixed, d_context, d_seq, far_target, far_draft, reach, blocks = \
            self._linear_terms(b, [query], passes)

        def price(context_tokens: int) -> float:
            if (context_tokens > far_target or context_tokens + reach > far_draft) and not blocks <= self._warned:
                return scalar(context_tokens)
            seconds = target + per_context * context_tokens + seq + qc * context_tokens / b
            seconds += overhead
            for a, d_qc, extra in d_fixed:
                seconds += a + d_context * (t := context_tokens + extra) + d_seq + d_qc * t / b
            return seconds

        return price

    def _linear_terms(self, b: int, queries: Sequence[int], passes: Sequence[tuple[int, int]]) -> tuple:
        """What :meth:`decode_pricer` and :meth:`step_pricer` work out once for ``b`` sequences: the terms of
        :meth:`_decode` that do not depend on the context total c, left to right as it adds them, and what the far
        checks compare (pricing c may warn where c > the target's limit or c + reach > the draft's, unless every block
        asked has warned)."""
        if passes:
            self._check_draft()  # (the scalar draft calls raise it at the first call; so does this, on being built)
        # target: ((base + per_token q) + per_context c) + per_seq b + ((per_qc q) c) / b
        base, per_token, per_context, per_seq, per_qc = self._coef["target"]
        fixed = [(base + per_token * q, per_qc * q) for q in queries]
        lim_b, lim_c = self._far["target"]
        # a block that has warned warns no more, so the shortcut stands once every block asked has warned
        far_target = -math.inf if b > lim_b else lim_c * b
        blocks = {"target", "draft"} if passes else {"target"}
        far_draft, reach, d_context, d_seq, d_fixed = math.inf, max((e for e, _ in passes), default=0), 0.0, 0.0, []
        if passes:
            # a pass reads t = c + extra and feeds f: ((base + per_token f) + per_context t) + per_seq b
            # + ((per_qc f) t) / b
            d_base, d_token, d_context, d_seq, d_qc = self._coef["draft"]
            d_fixed = [(d_base + d_token * fed, d_qc * fed, extra) for extra, fed in passes]
            d_seq = d_seq * b
            lim_b, lim_c = self._far["draft"]
            far_draft = -math.inf if b > lim_b else lim_c * b
        return fixed, per_seq * b, per_context, d_fixed, d_context, d_seq, far_target, far_draft, reach, blocks

    def affine_until(self, batch_size: int, queries: Sequence[int], passes: Sequence[tuple[int, int]]) -> float:
        """The context total up to which the parts :meth:`decode_pricer` prices (the same arguments) are, as functions
        of the context total c >= 0, affine with every term >= 0 (non-negative coefficients) and priced without a
        warning: inf once every block asked has warned; -inf where that cannot be said (a model that evaluates
        otherwise, a negative coefficient, a batch beyond the grid whose block has not warned). What a goodput
        policy's decision spans rely on (``policies.goodput.Goodput.spans``)."""
        if type(self)._decode is not LinearCostModel._decode or batch_size < 1:
            return -math.inf
        until = math.inf
        for block, extra in (("target", 0), ("draft", max((e for e, _ in passes), default=0)))[:2 if passes else 1]:
            if block not in self._coef or min(self._coef[block]) < 0:
                return -math.inf
            if block in self._warned:
                continue
            lim_b, lim_c = self._far[block]
            far = lim_c * batch_size  # c + extra warns beyond it (and every c where the batch is beyond the grid)
            until = min(until, -math.inf if batch_size > lim_b else far - extra if far == math.inf
                        else math.floor(far) - extra)
        return until

    def prefill_time(self, batch_size: int, prompt_tokens: int, role: str = "target") -> float:
        block = BLOCKS[(role, "prefill")]
        if block not in self._coef:
            return 0.0
        lim_b, lim_p = self._far[block]
        if batch_size > lim_b or prompt_tokens > lim_p * batch_size:
            self._warn_far(block, batch_size, prompt_tokens / batch_size)
        return self._prefill(block, batch_size, prompt_tokens)

    def prefill_context_time(self, query_tokens: int, context_tokens: int, role: str = "target") -> float:
        # the base class's T(c + q) - T(c) - T(q) + T(0) worked out for the quadratic prefill (b = 1): the base,
        # per_seq and per_prompt_token terms cancel, per_prompt_token_sq ((c + q)^2 - c^2 - q^2) = 2 per_prompt_token_sq
        # c q is left; written so, it is exact and never below 0 (the coefficients are >= 0)
        block = BLOCKS[(role, "prefill")]
        if not context_tokens or block not in self._coef:
            return 0.0
        whole = context_tokens + query_tokens  # the whole-prompt curve is read at c + q
        if whole > self._far[block][1]:
            self._warn_far(block, 1, whole)
        return 2.0 * self._coef[block][2] * context_tokens * query_tokens

    def overhead_time(self, batch_size: int) -> float:
        base, per_seq = self._overhead
        return base + per_seq * batch_size

    def speculation_time(self, batch_size: int, query_tokens: int) -> float:
        if "spec_overhead" not in self._coef:
            return 0.0
        return self._decode("spec_overhead", batch_size, query_tokens, 0)

    @property
    def prices_speculation(self) -> bool:
        return "spec_overhead" in self._coef

    def prefill_overhead_time(self, batch_size: int) -> float:
        if "prefill_overhead" not in self._coef:
            return self.overhead_time(batch_size)
        base, per_seq = self._coef["prefill_overhead"]
        return base + per_seq * batch_size

    def frontend_time(self) -> float:
        if "frontend" not in self._coef:
            return 0.0
        base, per_seq = self._coef["frontend"]
        return base + per_seq

    def has(self, role: str, phase: str) -> bool:
        return BLOCKS.get((role, phase)) in self._coef

    def _check_draft(self) -> None:
        if "draft" not in self._coef:
            raise UserError(f"{self.path}: no draft decode costs (block 'draft', or rows with role draft, "
                            "phase decode); a draft-model proposer needs them (or use --proposer ngram)")

    def _check_far(self, block: str, batch_size: int, context_tokens: float) -> None:
        lim_b, lim_c = self._far[block]
        if batch_size > lim_b or context_tokens > lim_c * batch_size:
            self._warn_far(block, batch_size, context_tokens / batch_size)

    # -- evaluation, overridden by the interp model ----------------------------------------------
    def _decode(self, block: str, batch_size: int, query_tokens: float, context_tokens: float) -> float:
        base, per_token, per_context, per_seq, per_qc = self._coef[block]
        return base + per_token * query_tokens + per_context * context_tokens + per_seq * batch_size \
            + per_qc * query_tokens * context_tokens / batch_size

    def _decodes(self, block: str, batch_size: int, query_tokens: float, contexts: Sequence[int]) -> list[float]:
        """:meth:`_decode` of each context total, the same arithmetic in the same order."""
        base, per_token, per_context, per_seq, per_qc = self._coef[block]
        fixed, per_batch, qc = base + per_token * query_tokens, per_seq * batch_size, per_qc * query_tokens
        return [fixed + per_context * c + per_batch + qc * c / batch_size for c in contexts]

    def _prefill(self, block: str, batch_size: int, prompt_tokens: float) -> float:
        base, per_token, per_token_sq, per_seq = self._coef[block]
        return base + per_token * prompt_tokens + per_token_sq * prompt_tokens * prompt_tokens / batch_size \
            + per_seq * batch_size

    def _warn_far(self, block: str, batch_size: int, per_seq: float) -> None:
        """Warn once per block about a query far outside the profiled grid (not while :func:`probing`)."""
        if block in self._warned or _PROBES:
            return
        self._warned.add(block)
        role, phase = next(rp for rp, b in BLOCKS.items() if b == block)
        axes = AXES[KIND[block]]
        ranges = ", ".join(f"{axis} {nodes[0]:g}..{nodes[-1]:g}"
                           for axis, nodes in zip(axes, self._grid[block]) if axis != "query_len")
        warnings.warn(f"{self.flag} {self.path}: {role} {phase} asked at batch_size={batch_size:g}, "
                      f"{axes[-1]}={per_seq:g} per sequence, more than {FAR:g}x beyond the profiled grid ({ranges}); "
                      "extrapolating", InputWarning, stacklevel=3)

    # -- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "verification": self.verification,
                               "batch_layout": self.batch_layout, "source": self.source}
        if self.draft_method != DEFAULT_DRAFT_METHOD:
            out["draft_method"] = self.draft_method
        if self.draft_extend != DRAFT_EXTENDS[0]:
            out["draft_extend"] = self.draft_extend
        for block, values in self._coef.items():
            out[block] = dict(zip(COEFFICIENTS[KIND[block]], values))
        if self.memory is not None:
            out["memory"] = self.memory.to_dict()
        if self.fit_error is not None:
            out["fit_error"] = self.fit_error
        if self._grid:
            out["grid"] = {block: dict(zip(AXES[KIND[block]], map(list, nodes)))
                           for block, nodes in self._grid.items()}
        return out


class InterpCostModel(LinearCostModel):
    """Piecewise-multilinear interpolation over the measured grid (module docstring); the linear
    coefficients extrapolate beyond it. A few microseconds a call: the grid's table is filled once,
    and a query blends the 2^d corners of its cell in plain Python."""

    def __init__(self, coefficients: Coefficients, *, tables: dict[str, Sequence[float]], grid: Grid,
                 **kwargs: Any) -> None:
        super().__init__(coefficients, grid=grid, **kwargs)
        self._tables = {block: _Table(KIND[block], grid[block], values, coefficients[block])
                        for block, values in tables.items()}

    uniform_decode_times = CostModel.uniform_decode_times  # the scalar calls: its _decode interpolates
    uniform_decode_pricer = CostModel.uniform_decode_pricer
    prefill_context_time = CostModel.prefill_context_time  # the table's own whole-prompt curve, not the fit's

    def _decode(self, block: str, batch_size: int, query_tokens: float, context_tokens: float) -> float:
        return self._tables[block]((batch_size, query_tokens / batch_size, context_tokens / batch_size))

    def _decodes(self, block: str, batch_size: int, query_tokens: float, contexts: Sequence[int]) -> list[float]:
        table, q = self._tables[block], query_tokens / batch_size
        return [table((batch_size, q, c / batch_size)) for c in contexts]

    def _prefill(self, block: str, batch_size: int, prompt_tokens: float) -> float:
        return self._tables[block]((batch_size, prompt_tokens / batch_size))

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["interp"] = {block: list(table.values) for block, table in self._tables.items()}
        return out


class _Table:
    """Seconds on a rectilinear grid (values in C order over the natural axes), multilinear in
    between: linear in each axis, so monotone data give monotone predictions. Outside the grid, where the linear
    model prices the query above the clamped point: value at the clamped point + linear(query) - linear(clamped
    point); where below it (a query under the grid's smallest nodes): value at the clamped point x linear(query) /
    linear(clamped point), which stays positive where the shift would not (a fit whose slope exceeds the smallest
    measured point's seconds per token: a 1-token prefill of a profile measured at 16 tokens went to -0.3 ms).
    Both are continuous at the grid's edge and monotone, the fit's coefficients being non-negative."""

    __slots__ = ("kind", "values", "coef", "_nodes", "_active", "_fixed", "_corners")

    def __init__(self, kind: str, nodes: Sequence[Sequence[float]], values: Sequence[float],
                 coef: tuple[float, ...]) -> None:
        self.kind, self.coef = kind, coef
        self.values = tuple(float(v) for v in values)
        self._nodes = tuple(tuple(n) for n in nodes)
        strides = [math.prod(len(n) for n in nodes[i + 1:]) for i in range(len(nodes))]
        # An axis with one node contributes nothing between nodes, only to the clamp.
        self._active = tuple((axis, n, strides[axis], len(n) - 2) for axis, n in enumerate(self._nodes) if len(n) > 1)
        self._fixed = tuple((axis, n[0]) for axis, n in enumerate(self._nodes) if len(n) == 1)
        # Offsets of a cell's 2^d corners from its lowest one, the last active axis varying fastest.
        self._corners = tuple(sum(bit * stride for bit, (_, _, stride, _) in zip(bits, self._active))
                              for bits in itertools.product((0, 1), repeat=len(self._active)))

    def __call__(self, x: tuple[float, ...]) -> float:
        outside = False
        offset = 0
        weights = []
        for axis, nodes, stride, last in self._active:
            v = x[axis]
            if v < nodes[0]:
                outside, i, v = True, 0, nodes[0]
            elif v > nodes[-1]:
                outside, i, v = True, last, nodes[-1]
            else:
                i = min(bisect_right(nodes, v) - 1, last)
            lo = nodes[i]
            weights.append((v - lo) / (nodes[i + 1] - lo))
            offset += i * stride
        for axis, value in self._fixed:
            outside = outside or x[axis] != value
        corners = [self.values[offset + c] for c in self._corners]
        for w in reversed(weights):  # blend away the last axis, then the one before, ...
            corners = [a * (1.0 - w) + b * w for a, b in zip(corners[::2], corners[1::2])]
        seconds = corners[0]
        if outside:
            clamped = tuple(min(max(v, n[0]), n[-1]) for v, n in zip(x, self._nodes))
            at_query, at_clamped = _linear(self.kind, self.coef, x), _linear(self.kind, self.coef, clamped)
            if at_query >= at_clamped:
                seconds += at_query - at_clamped
            else:  # below the grid: scaled, not shifted, so that a short extrapolation cannot go below 0 s
                seconds *= at_query / at_clamped
        return seconds


# -- fitting ---------------------------------------------------------------------------------------
def fit_cost_model(table: ProfileTable, fitter: str = "linear",
                   fit_error: list[dict] | None = None) -> CostModel:
    """Fit ``table`` with ``fitter`` (``linear``, ``interp``, or ``auto``: :func:`profile_fitter`); see the module
    docstring."""
    _check_fitter(fitter)
    fitter = profile_fitter(fitter, table.meta)
    frame = table.frame
    coefficients: Coefficients = {}
    grid: Grid = {}
    points: dict[str, pd.DataFrame] = {}
    for (role, phase), block in BLOCKS.items():
        rows = frame[(frame["role"] == role) & (frame["phase"] == phase)]
        if rows.empty:
            if block in REQUIRED_BLOCKS:
                raise UserError(f"{table.path}: no rows with role {role}, phase {phase} (required)")
            continue
        kind = KIND[block]
        x = _natural(kind, rows)
        coefficients[block] = _fit_linear(kind, x, rows["seconds"].to_numpy(float))
        if kind != "overhead":
            grid[block] = tuple(tuple(float(v) for v in np.unique(a)) for a in x)
            points[block] = rows
    common = dict(method=table.method_label, source=table.path, path=table.path, memory=table.memory, grid=grid,
                  fit_error=fit_error, verification=table.verification, batch_layout=table.batch_layout,
                  draft_method=draft_method_of(table), draft_extend=table.draft_extend)
    if fitter == "linear":
        return LinearCostModel(coefficients, **common)
    tables = {block: _fill_table(KIND[block], rows, grid[block], coefficients[block])
              for block, rows in points.items()}
    return InterpCostModel(coefficients, tables=tables, **common)


def check_draft_method(method: str, cost: CostModel, flag: str) -> None:
    """Refuse to price the draft passes of speculative ``method`` (vLLM's name) with ``cost``'s draft rows when they
    describe another proposer: a draft head's passes need that head's rows, a draft model's a draft model's (an
    n-gram proposer runs no draft pass). One line naming the profile, both methods and the way out."""
    priced = cost.draft_method
    if method in ("ngram", priced):
        return
    raise UserError(f"{flag} {cost.path}: its draft rows price {_draft_what(priced)}, not the speculative method "
                    f"{method}; give --speculative-method {priced}, or a profile whose draft is "
                    f"{_draft_what(method)}")


def _draft_what(method: str) -> str:
    return "a draft model (draft_model)" if method == DEFAULT_DRAFT_METHOD else f"a draft head ({method})"


def draft_method_of(table: ProfileTable) -> str:
    """What ``table``'s draft rows price: its metadata's ``draft.speculative_method`` (a head's, written by the
    analytical model and the profiler), else a draft model."""
    draft = table.meta.get("draft")
    method = draft.get("speculative_method", DEFAULT_DRAFT_METHOD) if isinstance(draft, dict) else DEFAULT_DRAFT_METHOD
    if method not in DRAFT_METHODS:
        raise UserError(f"{meta_path(table.path)}: draft.speculative_method must be one of {', '.join(DRAFT_METHODS)} "
                        f"(got {method!r})")
    return method


def _natural(kind: str, rows: pd.DataFrame) -> list[np.ndarray]:
    """The rows' natural per-sequence coordinates, in :data:`AXES` order."""
    return [rows[c].to_numpy(float) for c in PROFILE_COLUMNS[kind]]


def _features(kind: str, x: Sequence[Any]) -> tuple[Any, ...]:
    """The linear model's features at natural coordinates ``x`` (scalars or arrays), in
    :data:`COEFFICIENTS` order: decode (1, b*q, b*c, b, b*q*c), prefill (1, b*P, b*P^2, b), overhead (1, b)."""
    b = x[0]
    if kind == "decode":
        return 1.0, b * x[1], b * x[2], b, b * x[1] * x[2]
    if kind == "prefill":
        return 1.0, b * x[1], b * x[1] * x[1], b
    return 1.0, b


def _linear(kind: str, coef: tuple[float, ...], x: Sequence[Any]) -> Any:
    """The linear model's seconds at natural coordinates ``x``."""
    return sum(c * f for c, f in zip(coef, _features(kind, x)))


def _fit_linear(kind: str, x: list[np.ndarray], seconds: np.ndarray) -> tuple[float, ...]:
    """Non-negative least squares on relative error (rows weighted by 1/seconds).

    A feature collinear with higher-priority ones (e.g. b*q when every row has q = 1, as a draft's)
    cannot be told apart from them and gets coefficient 0.
    """
    features = np.column_stack([np.broadcast_to(np.asarray(f, float), seconds.shape)
                                for f in _features(kind, x)]) / seconds[:, None]
    norms = np.linalg.norm(features, axis=0)
    keep: list[int] = []
    for j in np.flatnonzero(norms > 0):
        trial = keep + [int(j)]
        if np.linalg.matrix_rank(features[:, trial] / norms[trial]) == len(trial):
            keep = trial
    from scipy.optimize import nnls  # imported when fitting only: a cached or JSON model starts faster

    solution, _ = nnls(features[:, keep], np.ones(seconds.size))
    coef = np.zeros(features.shape[1])
    coef[keep] = solution
    return tuple(float(c) for c in coef)


def _fill_table(kind: str, rows: pd.DataFrame, nodes: tuple[tuple[float, ...], ...],
                coef: tuple[float, ...]) -> list[float]:
    """Seconds at every grid node (C order): measured (median of repeats), else interpolated in
    log(seconds) over log2(1 + axis) inside the measured points' hull, else the linear fit."""
    measured = rows.groupby(list(PROFILE_COLUMNS[kind]), as_index=False)["seconds"].median()
    x = _natural(kind, measured)
    shape = tuple(len(n) for n in nodes)
    values = np.full(shape, np.nan)
    values[tuple(np.searchsorted(n, a) for n, a in zip(nodes, x))] = measured["seconds"].to_numpy(float)
    missing = np.isnan(values)
    if missing.any():
        from scipy.interpolate import LinearNDInterpolator
        from scipy.spatial import QhullError

        mesh = np.stack(np.meshgrid(*nodes, indexing="ij"), axis=-1)
        active = [axis for axis, n in enumerate(nodes) if len(n) > 1]
        try:
            interpolator = LinearNDInterpolator(np.log2(1.0 + mesh[~missing][:, active]), np.log(values[~missing]))
            values[missing] = np.exp(interpolator(np.log2(1.0 + mesh[missing][:, active])))
        except (QhullError, ValueError):
            pass  # too few or degenerate measured points: the linear fit fills every hole
        holes = np.isnan(values)
        values[holes] = _linear(kind, coef, mesh[holes].T)
    return [float(v) for v in values.ravel()]


#: Open :func:`probing` blocks (a list, so that they nest).
_PROBES: list[None] = []


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Inside the block, a query far beyond a model's grid neither warns nor counts as warned: a check's probes of
    the largest shapes a config allows (:func:`simulator.core.runner.check_costs`) are not the run's own
    extrapolation, which then still warns when the run asks it."""
    _PROBES.append(None)
    try:
        yield
    finally:
        _PROBES.pop()


def _far_limits(nodes: tuple[tuple[float, ...], ...] | None) -> tuple[float, float]:
    """(batch size, per-sequence context or prompt length) beyond which a query warns."""
    if not nodes:
        return math.inf, math.inf
    return FAR * nodes[0][-1], FAR * nodes[-1][-1]


def fit_report(table: ProfileTable, fitter: str, holdout: float = 0.2, seed: int = 0) -> pd.DataFrame:
    """Held-out error of ``fitter`` on ``table``, one row per (role, phase) present.

    A random ``holdout`` fraction of each (role, phase)'s rows (at least one row stays for training)
    is left out, the model is fitted on the rest and asked for the left-out points. Columns:
    ``role, phase, n_train, n_test, mean_rel_error, max_rel_error`` (relative error
    |predicted - measured| / measured; NaN when nothing was held out).
    """
    _check_fitter(fitter)
    if not 0.0 <= holdout < 1.0:
        raise UserError(f"--holdout: must be in [0, 1) (got {holdout!r})")
    rng = np.random.default_rng(seed)
    frame = table.frame
    held_out: dict[tuple[str, str], np.ndarray] = {}
    for role, phase in BLOCKS:
        index = np.flatnonzero((frame["role"] == role) & (frame["phase"] == phase))
        if index.size:
            n_test = min(index.size - 1, round(holdout * index.size))
            held_out[(role, phase)] = np.sort(rng.permutation(index)[:n_test])
    keep = np.ones(len(frame), dtype=bool)
    for test in held_out.values():
        keep[test] = False
    train = frame[keep]
    model = fit_cost_model(ProfileTable(train, table.meta, table.path), fitter)
    b, q, c, seconds = (frame[col].to_numpy() for col in ("batch_size", "query_len", "context_len", "seconds"))
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # held-out points may lie beyond the training grid on purpose
        for (role, phase), test in held_out.items():
            predicted = np.array([predict_row(model, role, phase, int(b[i]), int(q[i]), int(c[i])) for i in test])
            error = np.abs(predicted - seconds[test]) / seconds[test]
            n = int(((frame["role"] == role) & (frame["phase"] == phase)).sum())
            rows.append({"role": role, "phase": phase, "n_train": n - test.size, "n_test": int(test.size),
                         "mean_rel_error": float(error.mean()) if test.size else math.nan,
                         "max_rel_error": float(error.max()) if test.size else math.nan})
    import pandas as pd

    return pd.DataFrame(rows, columns=REPORT_COLUMNS)


def predict_row(model: CostModel, role: str, phase: str, b: int, q: int, c: int) -> float:
    """The model's seconds for one profile row (natural coordinates -> the interface's totals)."""
    if phase == "decode":
        return model.target_time(b, b * q, b * c) if role == "target" else model.draft_time(b, b * c, b * q)
    if phase == "prefill":
        return model.prefill_time(b, b * q, role)
    if phase == "prefill_overhead":
        return model.prefill_overhead_time(b)
    if phase == "frontend":
        return model.frontend_time()
    if phase == "spec_overhead":
        return model.speculation_time(b, b * q)
    return model.overhead_time(b)


def _check_fitter(fitter: str) -> None:
    if fitter not in FITTERS:
        raise UserError(f"--fitter: must be one of {', '.join(FITTERS)} (got {fitter!r})")


# -- loading ---------------------------------------------------------------------------------------
def profile_fitter(fitter: str, meta: dict) -> str:
    """``fitter``, with ``auto`` resolved for the profile whose metadata is ``meta``: ``interp`` for a profile
    calibrated to vLLM results (its ``calibration`` block; the calibration fitted and reported its errors through
    ``interp``, and the ``linear`` form misprices its target pass by about 10% at both ends of the batch range),
    ``linear`` (SmartSpec's form) for any other."""
    if fitter != "auto":
        return fitter
    return "interp" if isinstance(meta, dict) and "calibration" in meta else "linear"


def load_cost_model(path: str | os.PathLike, fitter: str = "auto") -> CostModel:
    """A cost model from a coefficient ``.json`` (``fitter`` unused) or a profile ``.csv`` fitted with
    ``fitter`` (``auto``: :func:`profile_fitter`).

    Fitted models, with their held-out error (:func:`fit_report`), are cached under
    ``$SPECSIM_CACHE_DIR`` (default ``~/.cache/specsim``), keyed by a hash of the CSV bytes, the
    metadata bytes, the fitter and this code; a corrupt or unreadable entry is ignored and rewritten.
    """
    _check_fitter(fitter)
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such cost model file (a .json coefficient file or a .csv profile)")
    suffix = p.suffix.lower()
    if suffix == ".json":
        return model_from_dict(read_json(p), str(path))
    if suffix != ".csv":
        raise UserError(f"{path}: a cost model is a .json coefficient file or a .csv profile (got {p.suffix!r})")
    meta = meta_path(p)
    if fitter == "auto":
        try:
            fitter = profile_fitter(fitter, json.loads(meta.read_text()))
        except (OSError, ValueError):
            fitter = "linear"  # no or unreadable metadata: read_profile reports it where it matters
    entry = _cache_dir() / f"{_cache_key(p.read_bytes(), meta.read_bytes() if meta.is_file() else b'', fitter)}.json"
    try:
        cached = json.loads(entry.read_text())
        cached["source"] = str(path)
        return model_from_dict(cached, str(path))
    except (OSError, ValueError, TypeError, UserError):
        pass
    table = read_profile(p)
    model = fit_cost_model(table, fitter, fit_error=_records(fit_report(table, fitter)))
    try:
        model.save(entry)
    except OSError:
        pass  # a read-only cache only costs time
    return model


def _records(report: pd.DataFrame) -> list[dict]:
    """A :func:`fit_report` as JSON-ready records (NaN -> None)."""
    return [{key: None if isinstance(value, float) and math.isnan(value) else value for key, value in row.items()}
            for row in report.to_dict("records")]


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECSIM_CACHE_DIR") or Path.home() / ".cache" / "specsim")


@functools.cache
def _code_version() -> bytes:
    """Hash of the code that fits: a change to it misses every cached fit."""
    return hashlib.sha256(Path(__file__).read_bytes() + Path(profile_table.__file__).read_bytes()).digest()


def _cache_key(csv: bytes, meta: bytes, fitter: str) -> str:
    digest = hashlib.sha256()
    for part in (csv, meta, fitter.encode(), _code_version()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def model_from_dict(data: Any, path: str) -> CostModel:
    """Validate a coefficient JSON (as parsed) from file ``path`` and build its model.

    Blocks ``target`` and ``prefill`` are required; ``draft``, ``draft_prefill``, ``overhead`` and ``spec_overhead``
    are optional (see :class:`LinearCostModel`); a missing coefficient is 0. Also optional: ``method``
    (default ``hand-written``; a measured one may name its forward path: ``measured, optimized``),
    ``verification`` (default ``multi-query``), ``batch_layout`` (default ``ragged``), ``draft_method`` (default
    ``draft_model``; a draft head's ``eagle``, ``eagle3`` or ``mtp``), ``draft_extend`` (default ``unseen``;
    ``accepted`` or ``padded``, :data:`policies.protocol.DRAFT_EXTENDS`), ``source`` (default ``path``),
    ``memory``, ``fit_error``, and for fitted models ``grid`` (measured axis values) and ``interp`` (seconds at every
    grid node).
    """
    if not isinstance(data, dict):
        raise UserError(f"{path}: a cost model must be a JSON object (got {type(data).__name__})")
    for key in data:
        if key not in KIND and key not in OTHER_KEYS:
            raise UserError(f"{path}: unknown key {key!r}; known: {', '.join([*KIND, *OTHER_KEYS])}")
    for block in REQUIRED_BLOCKS:
        if block not in data:
            raise UserError(f"{path}: missing block {block!r}")
    coefficients = {block: _coefficients(data[block], path, block) for block in KIND if block in data}
    method = data.get("method", "hand-written")
    if not isinstance(method, str) or method.split(",")[0] not in METHODS:
        raise UserError(f"{path}: method must be one of {', '.join(METHODS)} (got {method!r})")
    verification = data.get("verification", VERIFICATIONS[0])
    if verification not in VERIFICATIONS:
        raise UserError(f"{path}: verification must be one of {', '.join(VERIFICATIONS)} (got {verification!r})")
    batch_layout = data.get("batch_layout", BATCH_LAYOUTS[0])
    if batch_layout not in BATCH_LAYOUTS:
        raise UserError(f"{path}: batch_layout must be one of {', '.join(BATCH_LAYOUTS)} (got {batch_layout!r})")
    draft_method = data.get("draft_method", DEFAULT_DRAFT_METHOD)
    if draft_method not in DRAFT_METHODS:
        raise UserError(f"{path}: draft_method must be one of {', '.join(DRAFT_METHODS)} (got {draft_method!r})")
    draft_extend = data.get("draft_extend", DRAFT_EXTENDS[0])
    if draft_extend not in DRAFT_EXTENDS:
        raise UserError(f"{path}: draft_extend must be one of {', '.join(DRAFT_EXTENDS)} (got {draft_extend!r})")
    source = data.get("source", path)
    if not isinstance(source, str):
        raise UserError(f"{path}: source must be a string (got {source!r})")
    fit_error = data.get("fit_error")
    if fit_error is not None and not isinstance(fit_error, list):
        raise UserError(f"{path}: fit_error must be a list of records (got {type(fit_error).__name__})")
    memory = Memory.from_dict(data["memory"], f"{path}: memory") if "memory" in data else None
    grid = _grid(data.get("grid", {}), coefficients, path)
    common = dict(method=method, source=source, path=path, memory=memory, grid=grid, fit_error=fit_error,
                  verification=verification, batch_layout=batch_layout, draft_method=draft_method,
                  draft_extend=draft_extend)
    if "interp" not in data:
        return LinearCostModel(coefficients, **common)
    return InterpCostModel(coefficients, tables=_tables(data["interp"], grid, path), **common)


def _coefficients(block_data: Any, path: str, block: str) -> tuple[float, ...]:
    names = COEFFICIENTS[KIND[block]]
    if not isinstance(block_data, dict):
        raise UserError(f"{path}: {block} must be an object of coefficients (got {block_data!r})")
    for key, value in block_data.items():
        if key not in names:
            raise UserError(f"{path}: {block}: unknown key {key!r}; known: {', '.join(names)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise UserError(f"{path}: {block}.{key} must be a number >= 0 (got {value!r})")
    return tuple(float(block_data.get(name, 0.0)) for name in names)


def _grid(data: Any, coefficients: Coefficients, path: str) -> Grid:
    if not isinstance(data, dict):
        raise UserError(f"{path}: grid must be an object (got {type(data).__name__})")
    grid: Grid = {}
    for block, axes in data.items():
        if block not in coefficients or KIND[block] == "overhead":
            raise UserError(f"{path}: grid.{block} names no decode or prefill block of this model")
        names = AXES[KIND[block]]
        if not isinstance(axes, dict) or sorted(axes) != sorted(names):
            raise UserError(f"{path}: grid.{block} must have exactly the axes {', '.join(names)}")
        grid[block] = tuple(_numbers(axes[axis], f"{path}: grid.{block}.{axis}", increasing=True) for axis in names)
    return grid


def _tables(data: Any, grid: Grid, path: str) -> dict[str, tuple[float, ...]]:
    blocks = sorted(grid)
    if not isinstance(data, dict) or sorted(data) != blocks:
        raise UserError(f"{path}: interp must have a table for each grid block ({', '.join(blocks)})")
    tables = {}
    for block, values in data.items():
        tables[block] = _numbers(values, f"{path}: interp.{block}", increasing=False)
        size = math.prod(len(nodes) for nodes in grid[block])
        if len(tables[block]) != size:
            raise UserError(f"{path}: interp.{block} must have {size} values, one per grid node "
                            f"(got {len(tables[block])})")
    return tables


def _numbers(values: Any, where: str, increasing: bool) -> tuple[float, ...]:
    """A non-empty list of finite numbers >= 0 (strictly increasing if ``increasing``)."""
    ok = isinstance(values, list) and values and all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v < math.inf for v in values)
    if not ok or (increasing and any(a >= b for a, b in zip(values, values[1:]))):
        order = "increasing " if increasing else ""
        raise UserError(f"{where} must be a non-empty list of {order}numbers >= 0 (got {values!r})")
    return tuple(float(v) for v in values)
