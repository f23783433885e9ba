"""The fast path, fenced: runs of decode steps of an unchanged batch in one SimPy event.

When the policy is *stationary* (its proposals depend only on which requests run:
no-spec, fixed-k, threshold on the running count) and a draft model or nobody proposes, the engine asks
the policy once and simulates up to ``run_steps`` decode steps of the unchanged batch in one SimPy event:
the acceptance draws of the run come in one call, and the run ends at the step in which a request
finishes, before a step whose KV blocks would not fit (that step goes through the per-step path, which
preempts), or with the step during which the next request arrives when the queue is empty (so the
arrival is admitted at the same step boundary as step by step). Each step keeps its own time from the
cost model, so a run is the same steps at the same times; only the random stream is consumed in
blocks, so runs and single steps give statistically equal, not identical, results with speculation
(and identical ones without).

The engine enters it only through :meth:`DecodeRuns._decode_run` (for a stationary policy, see
``SimulatedEngine.runs``); everything it prices goes through :func:`policies.step_time.run_seconds`, the
vectorised form of the one step formula, so a run's steps cost what the per-step path would charge, bit for bit.
It relies on three batch interfaces, each with a default built from its per-step twin: ``CostModel.target_times``
and ``draft_times`` (from the scalar calls), ``AcceptanceModel.draw_steps`` (from ``draw``), and on
``Policy.stationary`` (default False: no runs).

Two more shortcuts live here, each switched in one place with its plain twin kept (``tests/test_fast_paths.py``
runs both, bit for bit): :data:`LIST_RUNS` works a stationary run out on plain lists step by step (the same draws,
cut-offs and sums as the numpy form), and :data:`PLAIN_RUNS` runs an adaptive policy that offers a plain-Python
stepper (``steps_plain``: goodput deciding one k for the batch from one global estimate) several steps per event,
each step exactly the per-step path's (asked, priced, drawn and told every step), so its results are step by step's;
within it :data:`ADAPTIVE_RUNS` keeps such a run lean (per step only tokens left and the context total).
:data:`STEP_RUNS` does the same for a stationary policy that learns nothing (n-gram proposals, chunked prefill), and
within it :data:`UNIFORM_RUNS` (and :data:`NGRAM_RUNS` under n-gram proposals) keep a one-k run lean; outside runs,
:data:`UNIFORM_STEPS` prices a one-k step without a step shape and :data:`BY_COUNT` asks a one-k policy by the running
count. Each flag's docstring says what it changes and that ``tests/test_fast_paths.py`` runs it against its twin.

Hooks for a fleet's replica (:mod:`simulator.fleet.fleet`), each a plain method or attribute here: a run starts at
:meth:`DecodeRuns._run_clock` (now) and is bounded by :meth:`DecodeRuns._next_arrival` (the workload's next arrival
while the queue is empty; a replica's: the first arrival its router may send it); it goes on past a finish only while
:attr:`DecodeRuns.past_finish`; it ends with :meth:`DecodeRuns._run_end`'s timeout, kept as
:attr:`DecodeRuns.planned_end`, and a block-drawn run (whose steps change the batch after its end) also keeps its step
boundaries (:meth:`DecodeRuns._block_run_end`), so that a replica may end it at an earlier one and the run applies
only the steps before (:meth:`DecodeRuns._steps_run`). Every step, run or not, adds its batch size, seconds and
proposed tokens to the engine's :class:`BatchLoad` (a replica's batch-size distribution without step rows), in step
order, so runs and step by step add the same floats in the same order.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from operator import add, sub
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import accumulate, repeat
from typing import Any

import numpy as np

from policies.step_time import overhead_pricer, run_seconds, uniform_memo, uniform_step_pricer, uniform_step_seconds
from policies.tree import TreeShape

LIST_RUNS = True
"""Speed shortcut, switched here in one place: a speculative run of a stationary policy works out its steps on plain
lists (:meth:`DecodeRuns._list_run`) rather than numpy arrays when steps are not kept; the same run bit for bit
(``tests/test_fast_paths.py`` runs both). False: the numpy path as written first."""

STEP_RUNS = True
"""Speed shortcut, switched here in one place: a stationary policy that learns nothing and has no block-drawn run
(n-gram proposals, whose lookups hit or miss step by step; or chunked prefill while no prefill is under way and nobody
can be admitted, when a chunked step is a decode step) runs several steps in one SimPy event through
:meth:`DecodeRuns._plain_run` with its proposal asked once a run (the batch does not change within one), each step the
per-step path's (the n-gram misses drawn, priced, drawn and added every step), so bit for bit the per-step path's
results (``tests/test_fast_paths.py`` runs both). False: one event per step."""

UNIFORM_RUNS = True
"""Speed shortcut, switched here in one place: a :data:`STEP_RUNS` run in which every request proposes the same k and
no n-gram lookup can miss (a draft model proposes, or k is 0) keeps per step only what the next step needs (each
request's tokens left and the batch's context total), and works out contexts, blocks and the speculative totals once
at the end (:meth:`DecodeRuns._uniform_run`), for as many steps as surely fit in the free blocks. The same steps,
prices, draws and stopping points as step by step, bit for bit (``tests/test_fast_paths.py``). False: the loop of
:meth:`DecodeRuns._plain_run`."""

NGRAM_RUNS = True
"""Speed shortcut, switched here in one place: a :data:`UNIFORM_RUNS` run also takes a stationary one-k policy under
n-gram proposals (:meth:`DecodeRuns._ngram_steps`): each step's lookups hit or miss as drawn, per step only the tokens
left, the blocks held and each request's proposed count are kept, and the speculative totals follow at the end from
integer sums; the same steps, prices, draws and stopping points as step by step (``tests/test_fast_paths.py``). False:
the loop of :meth:`DecodeRuns._plain_run`."""

UNIFORM_STEPS = True
"""Speed shortcut, switched here in one place: a step of the per-step path in which every request proposes the same k
(``SimulatedEngine._decode_seconds``; and of an adaptive run, :meth:`DecodeRuns._adaptive_steps`) is priced by
:meth:`DecodeRuns._uniform_pricer` (the step formula without a step shape), in the per-step path unless an adaptive
policy has just priced it (``step_time.uniform_memo``); the same seconds and warnings (``tests/test_fast_paths.py``).
False: :func:`policies.step_time.predict_step_seconds`."""

BY_COUNT = True
"""Speed shortcut, switched here in one place: a built-in policy whose proposal is one k for everyone chosen by the
running count alone (``k_by_count``: no-spec, fixed-k, threshold counting running requests) is asked through that
method, without building its :class:`policies.base.BatchView` (see ``SimulatedEngine._asked``); the same list as
``propose`` gives (``tests/test_fast_paths.py``). False: every proposal through ``propose``."""

PLAIN_RUNS = True
"""Speed shortcut, switched here in one place: an adaptive policy with a plain-Python stepper (``steps_plain``, e.g.
goodput in batch mode with a global estimate) runs several steps in one SimPy event (:meth:`DecodeRuns._plain_run`),
the per-step path's steps bit for bit (``tests/test_fast_paths.py`` runs both). False: one event per step."""

ADAPTIVE_RUNS = True
"""Speed shortcut, switched here in one place: a :data:`PLAIN_RUNS` run keeps per step only what the next step needs
(each request's tokens left and the batch's context total), as :data:`UNIFORM_RUNS` does, while the policy is still
asked and told every step (:meth:`DecodeRuns._adaptive_run`); contexts, blocks and the
speculative totals follow at the end, for as many steps as surely fit in the free blocks. The same steps, prices,
draws, decisions and stopping points as the loop of :meth:`DecodeRuns._plain_run`, bit for bit
(``tests/test_fast_paths.py``). False: that loop."""

HELD_RUNS = True
"""Speed shortcut, switched here in one place: in an :data:`ADAPTIVE_RUNS` run whose policy's stepper can hold its
proposal (goodput's ``step.hold``: a decision read from a kept span that still holds), a step in which everyone drafted
one k > 0 is told through ``hold``, which answers None where the next step proposes the same again; the loop then keeps
the proposal's list, k and pricer (:meth:`DecodeRuns._adaptive_steps`) instead of building and reading a new one. The
same proposals, prices, draws and decisions as the stepper's every step (``tests/test_fast_paths.py``). False: the
stepper asked every step."""

KEPT_PRICERS = True
"""Speed shortcut, switched here in one place: the engine keeps the pricer of a uniform step by (batch size, k)
(:meth:`DecodeRuns._uniform_pricer`; its cost model, tree family and proposer are the engine's, fixed for its life)
rather than building one for every stretch of steps; the same function, so the same seconds and warnings; and the
policy's stepper by batch size (:meth:`DecodeRuns._stepper`), whose proposals are those of a new one
(``tests/test_fast_paths.py`` runs both). False: built each time."""


class BatchLoad:
    """An engine's decode steps (decode and mixed: those with a decode batch) by batch size, kept instead of step rows:
    ``seconds[b]`` sums the seconds of the steps of ``b`` running requests, one step after the other in step order;
    ``steps`` counts them, ``request_steps`` sums their batch sizes and ``proposed`` their proposed draft tokens. A
    fleet's per-replica batch-size distribution weighted by step time and mean k per request-step
    (:func:`simulator.fleet.fleet.replica_rows`) read it."""

    __slots__ = ("seconds", "steps", "request_steps", "proposed")

    def __init__(self, max_num_seqs: int) -> None:
        self.seconds = [0.0] * (max_num_seqs + 1)
        self.steps = self.request_steps = self.proposed = 0

    def add(self, batch: int, seconds: Sequence[float], proposed: int) -> None:
        """Steps of ``batch`` running requests that took ``seconds`` (one entry a step, in order) and proposed
        ``proposed`` draft tokens in all."""
        total = self.seconds[batch]
        for s in seconds:
            total += s
        self.seconds[batch] = total
        self.steps += len(seconds)
        self.request_steps += batch * len(seconds)
        self.proposed += proposed

    def carried(self, batch: int, total: float, steps: int, proposed: int) -> None:
        """:meth:`add` of ``steps`` steps whose seconds the caller added one by one onto ``seconds[batch]`` itself, in
        step order (a run's loop), giving ``total``."""
        self.seconds[batch] = total
        self.steps += steps
        self.request_steps += batch * steps
        self.proposed += proposed

    def copy(self) -> "BatchLoad":
        other = BatchLoad.__new__(BatchLoad)
        other.seconds, other.steps, other.request_steps, other.proposed = (self.seconds.copy(), self.steps,
                                                                           self.request_steps, self.proposed)
        return other


class DecodeRuns:
    """The run methods of :class:`simulator.core.engine.SimulatedEngine` (a mixin: they read and advance the
    engine's batch, blocks, clock and recorder as its per-step path does)."""

    past_finish = True
    """Whether a run goes on past a step in which requests finish (they retire at that step's end, inside the run:
    :meth:`_uniform_run`, :meth:`_adaptive_run`). A fleet's replica sets it False: the router reads its finishes (its
    outstanding requests) at the time they happen."""

    planned_end: Any = None
    """The timeout that ends the latest run of steps (:meth:`_run_end`)."""

    _step_prices: dict[tuple[int, int], Any]
    """The pricers of uniform steps by (batch size, k) (:data:`KEPT_PRICERS`; set by the engine)."""

    _steppers: dict[int, Any]
    """The policy's steppers by batch size (:data:`KEPT_PRICERS`; set by the engine)."""

    def _run_clock(self) -> float:
        """The clock a run of steps starts from: now (a fleet's replica planning a run again returns its start)."""
        return self.env.now

    def _next_arrival(self) -> float:
        """When the next request reaches the queue while it is empty (s): a run ends with the step during which it
        arrives, so that it is admitted at the same step boundary as step by step. inf when a request waits already (a
        newcomer could not be admitted before it) or none is due."""
        if self.waiting or self.arrived >= len(self.workload):
            return math.inf
        return float(self.workload.arrival_time[self.arrived])

    def _run_end(self, start: float, end: float, nudge: bool = True):
        """The one timeout of a run of steps planned from ``start`` (when its first step starts) to ``end``, kept as
        :attr:`planned_end`: until ``end`` exactly (:meth:`_timeout_until`); with ``nudge`` False ``end - start``
        seconds, as the block-drawn runs have always waited, unless the run is planned later than it starts (a fleet's
        replica planning it again)."""
        self.planned_end = (self._timeout_until(end) if nudge or self.env.now != start
                            else self.env.timeout(end - start))
        return self.planned_end

    planned_steps: Any = None
    """The step boundaries and step count of the latest block-drawn run (:meth:`_block_run_end`)."""

    def _block_run_end(self, start: float, clock: list[float], n: int):
        """:meth:`_run_end` of a block-drawn run (:meth:`_decode_run`, whose steps change the batch after its end) of
        ``n`` steps ending at ``clock[1..n]``, kept as :attr:`planned_steps`: a fleet's replica may end it at an earlier
        boundary, and the run then applies the steps before it (:meth:`_steps_run`)."""
        self.planned_steps = (clock, n)
        return self._run_end(start, clock[n], nudge=False)

    def _steps_run(self, n: int) -> int:
        """How many of a block-drawn run's ``n`` planned steps ran, read after its end: all of them (a fleet's
        replica may have ended it earlier)."""
        return n

    def _decode_run(self):
        """Up to ``run_steps`` decode steps of the unchanged batch in one event (see the module docstring)."""
        # A policy that can never speculate (spec.speculative False) need not be asked: nobody proposes.
        proposed = self._propose() if self.spec.speculative else None
        start, bs = self._run_clock(), self.spec.block_size
        # Bound the run before drawing: every step emits >= 1 token per request, and steps only grow longer
        # (contexts grow), so no run outlasts the first finish or the step the next arrival falls into.
        left_min = min(self.left)
        n = min(self.spec.run_steps, left_min)
        arrival = self._next_arrival()
        if proposed is None or not any(proposed):
            yield from self._quiet_run(n, left_min, arrival)
            return
        if LIST_RUNS and not self.rec.keeps_steps:
            yield from self._list_run(proposed, n, arrival)
            return
        rid, ctx0, left, blocks = (np.array(x, dtype=np.int64) for x in (self.rid, self.ctx, self.left, self.blocks))
        ks, proposed = proposed, np.array(proposed, dtype=np.int64)
        n = self._bound_by_arrival(n, arrival, self._run_seconds([sum(self.ctx)], ks, ctx0[None, :])[0], start)
        accepted = self.acceptance.draw_steps(rid, proposed, n)
        emitted = np.cumsum(accepted + 1, axis=0)  # tokens after steps 0..j, before the per-request cap
        ctx = ctx0 + (emitted - accepted - 1)  # (steps, batch): context before each step
        need = (ctx + proposed + bs) // bs  # blocks during each step: ceil((ctx + k + 1) / bs)
        grow = np.maximum(need - blocks, 0).sum(axis=1)  # non-decreasing in the step
        n = min(n, int(np.searchsorted(grow, self.free_blocks, side="right")))  # steps whose blocks fit
        finishing = (emitted[:n] >= left).any(axis=1)
        if finishing.any():
            n = int(np.argmax(finishing)) + 1
        if n == 0:
            yield from self._decode_step(ks)  # this step must preempt
            return
        seconds = self._run_seconds(ctx[:n].sum(axis=1).tolist(), ks, ctx[:n])
        clock, n = self._clock(seconds, arrival, start)
        yield self._block_run_end(start, clock, n)
        n = self._steps_run(n)
        batch = rid.size
        self.load.add(batch, seconds[:n], sum(ks) * n)
        used_before = self.spec.num_gpu_blocks - self.free_blocks
        self.free_blocks -= int(grow[n - 1])
        self.blocks = np.maximum(blocks, need[n - 1]).tolist()
        self._advance(np.minimum(emitted[n - 1], left).tolist())
        per_step = np.diff(np.minimum(emitted[:n], left), axis=0, prepend=0)  # tokens each step emitted
        self.rec.decode(rid, proposed * n, np.minimum(accepted[:n], per_step).sum(axis=0), per_step.sum(axis=0),
                        steps=n)
        if self.rec.keeps_steps:
            for j in range(n):
                self.rec.step(clock[j], seconds[j], "decode", batch, 0, used_before + int(grow[j]),
                              len(self.waiting), proposed, accepted[j], per_step[j])
        else:
            self.rec.count_steps(n)
        self._retire(self.env.now)

    def _list_run(self, ks: list[int], n: int, arrival: float):
        """:meth:`_decode_run` after its proposal, on plain lists step by step (speed shortcut, switched by
        :data:`LIST_RUNS`; taken when steps are not kept): the same ``n`` steps' draws taken in one call, then each step's
        contexts, blocks and tokens in plain Python up to the same cut-offs (the first step whose blocks do not fit,
        the first finish, the arrival), so the same steps, times, blocks and random stream. The speculative totals go
        to each request's ``totals`` (handed to the recorder when it leaves) instead of the recorder's numpy adds:
        integer sums, the same columns (``tests/test_fast_paths.py`` runs both)."""
        ctx0, left, blocks, bs = self.ctx, self.left, self.blocks, self.spec.block_size
        start, uniform = sum(ctx0), min(ks) == max(ks)
        # the first step's seconds: one k for everyone, by the step formula's scalar calls (the vectorised form's
        # number, bit for bit, as every priced step); else the vectorised form of one step
        first = (self._uniform_pricer(len(ks), ks[0])(start) if uniform else
                 self._run_seconds([start], ks, np.array([ctx0], dtype=np.int64))[0])
        clock0 = self._run_clock()
        n = self._bound_by_arrival(n, arrival, first, clock0)
        drawn = self.acceptance.draw_steps(np.array(self.rid, dtype=np.int64), np.array(ks, dtype=np.int64),
                                           n).tolist()
        free, emitted = self.free_blocks, [0] * len(ks)  # tokens emitted before step j (uncapped)
        # a request holds at least ceil(c / bs) blocks, so a step adds at most (k + bs) // bs to it: the first
        # ``sure`` steps fit without counting (an exact bound; the blocks are counted once, after the run)
        sure = free // ((max(ks) + bs) // bs * len(ks))
        reach = [c + k + bs for c, k in zip(ctx0, ks)]  # a request holds (reach + emitted) // bs blocks in a step
        contexts, before, rows = [], [], []  # per step: context total, emitted before it, accepted
        for j in range(n):
            if j >= sure and sum([m - b for r, e, b in zip(reach, emitted, blocks) if (m := (r + e) // bs) > b]) > free:
                break  # this step's blocks do not fit: the run ends before it
            contexts.append(start + sum(emitted))  # sum_i (c_i + e_i): integers
            before.append(emitted)
            accepted = drawn[j]
            rows.append(accepted)
            emitted = [e + a + 1 for e, a in zip(emitted, accepted)]
            if min(map(sub, left, emitted)) <= 0:  # someone finishes in this step
                break
        if not contexts:
            yield from self._decode_step(ks)  # this step must preempt
            return
        seconds = self._run_seconds(contexts, ks, None if uniform else
                                    np.array(ctx0, dtype=np.int64) + np.array(before, dtype=np.int64))
        clock, n = self._clock(seconds, arrival, clock0)
        yield self._block_run_end(clock0, clock, n)
        n = self._steps_run(n)
        self.load.add(len(ks), seconds[:n], sum(ks) * n)
        before_last, last = before[n - 1], rows[n - 1]
        self.blocks = [m if (m := (r + e) // bs) > b else b for r, e, b in zip(reach, before_last, blocks)]
        self.free_blocks -= sum(self.blocks) - sum(blocks)  # the blocks the run's last step added
        done = [min(e + a + 1, t) for e, a, t in zip(before_last, last, left)]  # tokens emitted by the run (capped)
        earlier = n - 1  # steps before the last emitted a + 1 tokens each, a accepted: sum a = before_last - earlier
        for k, e, a, d, totals in zip(ks, before_last, last, done, self.totals):
            if k:  # the last step emitted what was left of a + 1, of them min(a, that) accepted
                per_last = d - e
                totals[0] += k * n
                totals[1] += e - earlier + (a if a < per_last else per_last)
                totals[2] += n
                totals[3] += d
        self._advance(done)
        self.rec.count_steps(n)
        self._retire(self.env.now)

    def _plain_run(self, stationary: bool = False):
        """Decode steps of an adaptive policy with a plain-Python stepper (``steps_plain``: goodput deciding one k
        for the batch from one global estimate) in one SimPy event (speed shortcut, switched by :data:`PLAIN_RUNS`).

        Unlike :meth:`_decode_run`, each step is the per-step path's step: the policy is asked and told every step
        (``propose_plain``, ``observe_plain``: its :meth:`propose` and :meth:`observe` on lists), acceptance and
        n-gram hits are drawn every step in the same order, and each step's seconds are added to the clock as SimPy
        adds them, so the results are those of step by step, bit for bit (``tests/test_fast_paths.py``). The run
        ends after the step in which a request finishes, after the step that ends at or after the next arrival when
        the queue is empty, after ``run_steps`` steps, or before a step whose blocks might not fit with the largest
        k (the per-step path takes that step: it preempts if it must). Nothing could be admitted between the steps
        of a run (no seat or block frees, and nobody new reaches the head of the queue), which is why ending a run
        anywhere gives the same steps.

        ``stationary`` (:data:`STEP_RUNS`): the policy is stationary and learns nothing, so it is asked once for the
        run (its proposal depends only on which requests run, and they do not change within a run) and told nothing;
        the n-gram misses are still drawn every step. Under chunked prefill the engine takes such a run only while no
        prefill is under way and nobody can be admitted, and the step that must preempt is a chunked step."""
        spec, policy, cost = self.spec, self.policy, self.policy_cost
        bs, max_k, draft, run_steps = spec.block_size, spec.max_k, spec.draft_proposer, spec.run_steps
        asked = self._asked() if stationary else None  # a stationary policy's proposal for the whole run
        if stationary and UNIFORM_RUNS and self._uniform(asked):  # (speed shortcut, tested)
            yield from self._uniform_run(asked)
            return
        worst = (max_k if spec.speculative else 0) + bs  # (c + worst) // bs: blocks of a step proposing max_k

        # A running request holds at least ceil(c / bs) blocks for its context c, so a step adds at most worst // bs
        # blocks to it: with that much free for everyone the step fits without counting (an exact shortcut).
        most = worst // bs

        def fits() -> bool:
            if self.free_blocks >= most * len(self.ctx):
                return True
            return sum([n - b for c, b in zip(self.ctx, self.blocks) if (n := (c + worst) // bs) > b]) <= self.free_blocks

        if not fits():
            yield from (self._chunked_step() if spec.chunked_prefill else self._decode_step())
            return
        if not stationary and ADAPTIVE_RUNS and self.free_blocks >= most * len(self.rid):  # (speed shortcut, tested)
            yield from self._adaptive_run(most)
            return
        if self.tree is not None:  # token trees take only uniform and adaptive runs (their pricers and draws): a step
            yield from (self._chunked_step(asked) if spec.chunked_prefill else self._decode_step(asked))
            return
        start = clock = self._run_clock()
        arrival = self._next_arrival()
        match_prob, acceptance, rec = spec.ngram_match_prob, self.acceptance, self.rec
        steps = spec_steps = spec_proposed = offered = 0
        spec_accepted = spec_emitted = [0] * len(self.rid)
        batch0 = len(self.rid)  # the batch of every step of the run (it ends with the first finish)
        spent = self.load.seconds[batch0]
        while True:
            rids, ctx, left = self.rid, self.ctx, self.left
            batch, context = len(rids), sum(ctx)
            proposed = asked if stationary else policy.propose_plain(batch, context, cost, max_k, draft)
            if not draft and any(proposed):  # the n-gram lookup's misses, as _propose applies them
                proposed = [k if u < match_prob else 0 for k, u in zip(proposed, self._match.take(batch))]
            blocks = self.blocks  # each request now holds max(b, ceil((c + k + 1) / bs)): integers, as reserved
            self.blocks = [n if (n := (c + k + bs) // bs) > b else b for c, k, b in zip(ctx, proposed, blocks)]
            self.free_blocks -= sum(self.blocks) - sum(blocks)  # fits: checked with the largest k
            k = proposed[0]
            uniform = proposed.count(k) == batch
            seconds = uniform_memo(self.cost, batch, context, k, draft) if uniform else None
            if seconds is None and uniform and stationary:  # nobody priced it: the uniform step in one call (tested)
                seconds = uniform_step_seconds(self.cost, batch, context, k, draft)[k]
            if seconds is None:
                seconds = self._decode_seconds(proposed)
            clock += seconds  # as SimPy adds a step's timeout
            spent += seconds
            offered += sum(proposed)
            # the step's outcome, as _apply_decode (no step rows: runs are taken only when steps are not kept)
            if any(proposed):
                accepted = acceptance.draw_list(rids, proposed)
                emitted = [a + 1 if a < t else t for a, t in zip(accepted, left)]  # min(a + 1, t), t >= 1
                if uniform:  # everyone proposed k > 0: the run's sums, added to the totals after the run
                    spec_steps, spec_proposed = spec_steps + 1, spec_proposed + k
                    # accepted tokens emitted: min(a, e) = min(a, t)
                    spec_accepted = list(map(add, spec_accepted, [a if a < t else t for a, t in zip(accepted, left)]))
                    spec_emitted = list(map(add, spec_emitted, emitted))
                for k, a, e, totals in () if uniform else zip(proposed, accepted, emitted, self.totals):
                    if k:
                        totals[0] += k
                        totals[1] += a if a < e else e  # accepted tokens emitted
                        totals[2] += 1
                        totals[3] += e
                self.ctx = [c + e for c, e in zip(ctx, emitted)]
                self.left = [t - e for t, e in zip(left, emitted)]
            else:
                accepted = proposed  # all zeros: every running request emits one token
                self.ctx = [c + 1 for c in ctx]
                self.left = [t - 1 for t in left]
            rec.num_steps += 1
            if not stationary:
                policy.observe_plain(proposed, accepted)
            steps += 1
            if 0 in self.left or clock >= arrival or steps >= run_steps or not fits():
                break
        if spec_steps:  # the sums of the steps in which everyone proposed (integers: the per-step adds' totals)
            for totals, a, e in zip(self.totals, spec_accepted, spec_emitted):
                totals[0] += spec_proposed
                totals[1] += a
                totals[2] += spec_steps
                totals[3] += e
        self.load.carried(batch0, spent, steps, offered)
        yield self._run_end(start, clock)
        if 0 in self.left:
            self._retire(self.env.now)

    def _adaptive_run(self, most: int):
        """:meth:`_plain_run` of an adaptive policy, kept lean (speed shortcut, switched by :data:`ADAPTIVE_RUNS`):
        :meth:`_adaptive_steps` from now; when they end with a finish while nobody waits and before the next arrival,
        the finished requests leave at that step's end (as step by step: nothing else happens then) and the run goes
        on with the smaller batch while its steps surely fit, as :meth:`_uniform_run` does. At most ``run_steps``
        steps in all; ending a run anywhere gives the same steps (see :meth:`_plain_run`)."""
        arrival = self._next_arrival()
        start = clock = self._run_clock()
        steps, run_steps = 0, self.spec.run_steps
        while True:
            clock, taken = self._adaptive_steps(most, clock, arrival, run_steps - steps)
            steps += taken
            if (0 not in self.left or not self.past_finish or self.waiting or clock >= arrival
                    or steps >= run_steps):
                break
            self._retire(clock)
            if not self.rid or self.free_blocks < most * len(self.rid):
                break
        yield self._run_end(start, clock)
        if 0 in self.left:
            self._retire(self.env.now)

    def _adaptive_steps(self, most: int, clock: float, arrival: float, budget: int) -> tuple[float, int]:
        """Up to ``budget`` steps of :meth:`_adaptive_run` from ``clock``; the clock after them and their count.

        The policy is asked (``propose_plain``) and told (``observe_plain``) every step as in :meth:`_plain_run`, the
        n-gram lookups, prices and acceptances drawn as there, but per step only each request's tokens left and the
        batch's context total are kept (and, in steps of unequal proposals, each request's proposed tokens and
        speculative steps), for at most ``free_blocks // (most x batch)`` steps (a step adds at most ``most`` blocks
        to a request: those steps surely fit, as :meth:`_plain_run`'s check finds). At the end, from integer sums:

        - contexts: each request's context plus the tokens it emitted; blocks: the most any step reserved,
          max over steps of ceil((c + k + 1) / bs), of which only the last ``max_k`` steps can hold the most (every
          step emits at least one token per request, so a step j steps before the last reads at least j tokens less,
          and reserves no more than the last when it proposes at most j more: such steps are skipped), and of steps
          of one proposal in a row (a held proposal's list) only the last (the others read less);
        - the speculative totals of each request that proposed: its proposed tokens and speculative steps n (those
          of steps where everyone proposed the same k, summed once, plus its own in the others); as a step without a
          proposal emits one token, the speculative steps emitted (tokens emitted) - (steps - n); and a step's
          accepted-and-emitted min(a, t) is e - 1 but in its last step where a >= t, so their sum is
          (tokens emitted) - steps + [a >= t in the last step] (a step without a proposal accepts 0 = e - 1).
        """
        spec, policy = self.spec, self.policy
        engine_cost, max_k, bs = self.cost, spec.max_k, spec.block_size
        draft = spec.draft_proposer
        rids, ctx0, left0, blocks0 = self.rid, self.ctx, self.left, self.blocks
        batch = len(rids)
        horizon = min(budget, self.free_blocks // (most * batch))  # steps that surely fit
        observe, draw, tree = policy.observe_plain, self.acceptance.draw_list, self.tree
        draw_tree = self.acceptance.draw_tree  # token trees: the policy told the family, drawn as _apply_decode draws
        draw_uniform, shared_ranks = self.acceptance.draw_tree_uniform, self.acceptance.shared_ranks
        step = self._stepper(batch)  # told a step, asked the next
        match, take = spec.ngram_match_prob, self._match.take
        target, overhead_of = engine_cost.target_time, None if draft else overhead_pricer(engine_cost, batch)
        steps, context, left, remaining = 0, sum(ctx0), left0, sum(left0)
        ends = []  # (tokens left before the step, proposals, its number) of each step whose next proposes otherwise
        spec_steps = spec_proposed = 0  # steps in which everyone proposed one k > 0, and their ks summed
        own_proposed = own_steps = None  # per request, over the steps of unequal proposals
        pricers: dict[int, Any] = {}
        spent = self.load.seconds[batch]
        hold = getattr(step, "hold", None) if HELD_RUNS and draft else None  # (speed shortcut, tested)
        asked, proposed = step(None, None, context), None
        while True:
            if asked is not proposed:  # a new proposal (a held one is the same list: the same k and pricer)
                if proposed is not None:
                    ends.append((before, proposed, steps))
                proposed = asked
                if not draft and any(proposed):  # the n-gram lookups' misses, as _plain_run draws them
                    proposed = [k if u < match else 0 for k, u in zip(proposed, take(batch))]
                k = proposed[0]
                uniform = proposed.count(k) == batch
                price = None
                if draft and uniform and UNIFORM_STEPS:  # as _decode_seconds prices a uniform step: its scalar formula
                    if (price := pricers.get(k)) is None:
                        price = pricers[k] = self._uniform_pricer(batch, k)
                # one shape for everyone under one rank table: drawn as draw_tree draws it, without asking
                drawn = tree is not None and uniform and k and shared_ranks
            if price is not None:
                seconds = price(context)
            elif not draft:  # shape_seconds without draft passes (the memo's number too, where it has one)
                query = sum(proposed) + batch
                seconds = target(batch, query, context)
                seconds += overhead_of(query)
            else:  # a probe: _decode_seconds over the step's contexts
                self.ctx = [c + t0 - t for c, t0, t in zip(ctx0, left0, left)]
                seconds = self._decode_seconds(proposed)
            clock += seconds  # as SimPy adds the step's timeout
            spent += seconds
            if k or not uniform:  # someone proposes
                accepted = (draw_uniform(tree, k, batch) if drawn else draw(rids, proposed) if tree is None else
                            draw_tree(rids, proposed, tree))
                before, left = left, [t - a - 1 if a < t else 0 for a, t in zip(accepted, left)]  # t - min(a + 1, t)
                if uniform:
                    spec_steps, spec_proposed = spec_steps + 1, spec_proposed + k
                elif own_proposed is None:
                    own_proposed, own_steps = proposed, [1 if q else 0 for q in proposed]
                else:
                    own_proposed = list(map(add, own_proposed, proposed))
                    own_steps = [n + 1 if q else n for n, q in zip(own_steps, proposed)]
            else:  # nobody proposes: every request emits one token
                accepted, before, left = proposed, left, [t - 1 for t in left]
            steps += 1
            if 0 in left or clock >= arrival or steps >= horizon:
                observe(proposed, accepted)
                break
            context, remaining = context + remaining - (now := sum(left)), now
            if hold is not None and uniform and k:  # told; None: the same proposal again
                if (again := hold(k, accepted, context)) is not None:
                    asked = again
            else:
                asked = step(proposed, accepted, context)
        emitted = self._settle(ctx0, left0, left)
        ends.append((before, proposed, steps))
        blocks, low = blocks0, min(proposed)
        for before_j, proposed_j, i in ends[-max_k - 1:]:  # each step reserved max(b, ceil((c + k + 1) / bs)) over
            j = steps - i  # its context c; steps after this one: it reads at least j tokens less than the last, so it
            if j and (j >= max_k or max(proposed_j) <= low + j):  # reserves no more when it proposes at most j more
                continue  # (then skipped: the same max)
            blocks = [n if (n := (c + t0 - t + q + bs) // bs) > b else b
                      for c, t0, t, q, b in zip(ctx0, left0, before_j, proposed_j, blocks)]
        self.blocks = blocks
        self.free_blocks -= sum(blocks) - sum(blocks0)
        if own_proposed is not None:
            self._add_totals(emitted, accepted, before, steps, [spec_proposed + p for p in own_proposed],
                             [spec_steps + n for n in own_steps])
        elif spec_steps:
            self._add_totals(emitted, accepted, before, steps, repeat(spec_proposed), repeat(spec_steps))
        self.load.carried(batch, spent, steps, spec_proposed * batch + (sum(own_proposed) if own_proposed else 0))
        self.rec.num_steps += steps
        return clock, steps

    def _stepper(self, batch: int):
        """``step(proposed, accepted, context_tokens)`` of :meth:`_adaptive_steps` over ``batch`` requests: the policy
        told a step's proposals and acceptances (none when ``proposed`` is None), then asked the next step's proposals
        over ``context_tokens`` tokens of context; the policy's own (``plain_stepper``) where it gives one, kept by batch
        size (:data:`KEPT_PRICERS`: its other arguments are the engine's, fixed for its life)."""
        if KEPT_PRICERS and (kept := self._steppers.get(batch)) is not None:  # (speed shortcut, tested)
            return kept
        policy, spec = self.policy, self.spec
        args = (self.policy_cost, spec.max_k, spec.draft_proposer) + (() if self.tree is None else (self.tree,))
        stepper = getattr(policy, "plain_stepper", None)
        if stepper is not None and (step := stepper(batch, *args)) is not None:
            if KEPT_PRICERS:
                self._steppers[batch] = step
            return step
        observe, propose = policy.observe_plain, policy.propose_plain

        def step(proposed: list[int] | None, accepted: list[int] | None, context_tokens: int) -> list[int]:
            if proposed is not None:
                observe(proposed, accepted)
            return propose(batch, context_tokens, *args)

        return step

    def _uniform(self, asked: list[int]) -> bool:
        """Whether :meth:`_uniform_run` may take a stationary policy's proposal ``asked``: one k for everyone, no n-gram
        lookup that can miss (a draft model proposes, or k is 0), and room for at least one step without counting."""
        k = asked[0]
        return ((self.spec.draft_proposer or not k or NGRAM_RUNS) and asked.count(k) == len(asked)
                and self.free_blocks >= (k + self.spec.block_size) // self.spec.block_size * len(asked))

    def _uniform_run(self, asked: list[int]):
        """:meth:`_plain_run` of a stationary policy whose proposal ``asked`` is one k for every request, when no
        n-gram lookup can miss (a draft model proposes, or k is 0): speed shortcut, switched by :data:`UNIFORM_RUNS`.

        Runs :meth:`_uniform_steps` from now; when they end with a finish while nobody waits and before the next
        arrival, the finished requests leave at that step's end (as step by step: nothing else happens then) and the
        run goes on with the smaller batch, asked again by its count (a policy asked through a view starts a new
        run: its view would carry the clock), while its proposal still qualifies (:meth:`_uniform`). At most
        ``run_steps`` steps in all; ending a run anywhere gives the same steps (see :meth:`_plain_run`)."""
        arrival = self._next_arrival()
        start = clock = self._run_clock()
        steps, most = 0, self.spec.run_steps
        while True:
            stretch = self._uniform_steps if self.spec.draft_proposer or not asked[0] else self._ngram_steps
            clock, taken = stretch(asked, clock, arrival, most - steps)
            steps += taken
            if 0 not in self.left or not self.past_finish or self.waiting or clock >= arrival or steps >= most:
                break
            self._retire(clock)
            if not self.rid or self._by_count is None:  # a policy asked through its view sees the clock: a new run
                break
            asked = self._asked()
            if not self._uniform(asked):
                break
        yield self._run_end(start, clock)
        if 0 in self.left:
            self._retire(self.env.now)

    def _uniform_steps(self, asked: list[int], clock: float, arrival: float, most: int) -> tuple[float, int]:
        """Up to ``most`` steps of the batch all proposing ``asked[0]`` from ``clock``; the clock after them and their
        count. Each step is priced as the per-step path prices it (the step formula over the batch's context total)
        and its acceptances drawn in the same order; per step only the tokens each request has left and the context
        total are kept. The contexts, the blocks (the last step's reservation, the largest of them) and the
        speculative totals follow once at the end, from integer sums. The steps end with a finish, with the step
        that ends at or after ``arrival``, or within the steps that surely fit: a request holds at least
        ceil(c / bs) blocks, so a step adds at most (k + bs) // bs blocks to it, and ``free_blocks // (that x
        batch)`` steps fit without counting (:meth:`_uniform` checks that it is at least 1)."""
        bs, k, batch = self.spec.block_size, asked[0], len(asked)
        rids, ctx0, left0, blocks0 = self.rid, self.ctx, self.left, self.blocks
        horizon = min(most, self.free_blocks // ((k + bs) // bs * batch))  # steps that surely fit
        context, steps, price = sum(ctx0), 0, self._uniform_pricer(batch, k)
        spent = self.load.seconds[batch]
        if k:
            draw, left, remaining = self.acceptance.draw_list, left0, sum(left0)
            if self.tree is not None:  # token trees: drawn as _apply_decode draws them
                draw = partial(self.acceptance.draw_tree, family=self.tree)
            while True:
                seconds = price(context)
                clock += seconds  # as SimPy adds the step's timeout
                spent += seconds
                accepted = draw(rids, asked)
                before, left = left, [t - a - 1 if a < t else 0 for a, t in zip(accepted, left)]  # t - min(a + 1, t)
                steps += 1
                if 0 in left or clock >= arrival or steps >= horizon:
                    break
                context, remaining = context + remaining - (now := sum(left)), now
        else:  # nobody proposes: every request emits one token a step
            horizon = min(horizon, min(left0))
            while True:
                seconds = price(context)
                clock += seconds
                spent += seconds
                steps += 1
                if steps >= horizon or clock >= arrival:
                    break
                context += batch
            before, left = [t - steps + 1 for t in left0], [t - steps for t in left0]
        emitted = self._settle(ctx0, left0, left)
        # the last step reserved ceil((c + k + 1) / bs) over its context c (the most of any step of the run)
        self.blocks = [n if (n := (c + t0 - t + k + bs) // bs) > b else b
                       for c, t0, t, b in zip(ctx0, left0, before, blocks0)]
        self.free_blocks -= sum(self.blocks) - sum(blocks0)
        if k:  # accepted tokens emitted: a step's min(a, t) is e - 1 unless a >= t (then the request's last step)
            for totals, e, a, t in zip(self.totals, emitted, accepted, before):
                totals[0] += k * steps
                totals[1] += e - steps + (1 if a >= t else 0)
                totals[2] += steps
                totals[3] += e
        self.load.carried(batch, spent, steps, k * batch * steps)
        self.rec.num_steps += steps
        return clock, steps

    def _ngram_steps(self, asked: list[int], clock: float, arrival: float, most: int) -> tuple[float, int]:
        """:meth:`_uniform_steps` under n-gram proposals (speed shortcut, switched by :data:`NGRAM_RUNS`): everyone is
        asked k > 0 and each lookup hits (proposes k) or misses (0) as drawn, in the per-step path's order. Per step the
        blocks held are the running max of ceil((c + k_i + 1) / bs) (a miss reserves less than the step before), the
        price is the verification over sum_i (k_i + 1) tokens plus the overhead (no draft passes), and each request's
        proposed tokens are summed. At the end, with K the asked k: speculative steps = proposed / K; a step without a
        proposal emits one token, so the speculative steps emitted (tokens emitted) - (steps - speculative steps); and
        a step's accepted-and-emitted min(a, t) is e - 1 but in a request's last step where a >= t, so their sum is
        (tokens emitted) - steps + [a >= t in the last step] (a miss accepts 0 = e - 1). Stops as
        :meth:`_uniform_steps`."""
        bs, k, batch = self.spec.block_size, asked[0], len(asked)
        rids, ctx0, left0, blocks0 = self.rid, self.ctx, self.left, self.blocks
        horizon = min(most, self.free_blocks // ((k + bs) // bs * batch))  # steps that surely fit (with every hit)
        match, take, draw = self.spec.ngram_match_prob, self._match.take, self.acceptance.draw_list
        target, overhead_of = self.cost.target_time, overhead_pricer(self.cost, batch)
        context, steps, left, remaining, held, proposed_sum = sum(ctx0), 0, left0, sum(left0), blocks0, [0] * batch
        spent = self.load.seconds[batch]
        while True:
            proposed = [k if u < match else 0 for u in take(batch)]  # the lookups' hits, as _propose draws them
            held = [n if (n := (c + t0 - t + q + bs) // bs) > h else h
                    for c, t0, t, q, h in zip(ctx0, left0, left, proposed, held)]
            query = sum(proposed) + batch
            seconds = target(batch, query, context)  # shape_seconds without draft passes
            seconds += overhead_of(query)
            clock += seconds  # as SimPy adds the step's timeout
            spent += seconds
            if query > batch:  # someone proposes
                accepted = draw(rids, proposed)
                proposed_sum = list(map(add, proposed_sum, proposed))
                before, left = left, [t - a - 1 if a < t else 0 for a, t in zip(accepted, left)]  # t - min(a + 1, t)
            else:
                accepted, before, left = proposed, left, [t - 1 for t in left]
            steps += 1
            if 0 in left or clock >= arrival or steps >= horizon:
                break
            context, remaining = context + remaining - (now := sum(left)), now
        emitted = self._settle(ctx0, left0, left)
        self.blocks = held
        self.free_blocks -= sum(held) - sum(blocks0)
        self._add_totals(emitted, accepted, before, steps, proposed_sum, [p // k for p in proposed_sum])
        self.load.carried(batch, spent, steps, sum(proposed_sum))
        self.rec.num_steps += steps
        return clock, steps

    def _add_totals(self, emitted: list[int], accepted: list[int], before: list[int], steps: int,
                    proposed: Iterable[int], spec_steps: Iterable[int]) -> None:
        """Add a stretch of ``steps`` steps to each request's speculative totals: it proposed ``proposed[i]`` tokens in
        ``spec_steps[i]`` steps and emitted ``emitted[i]`` tokens, one a step plus its accepted ones, all accepted
        ones emitted but in the last step, whose ``accepted[i]`` were capped by the ``before[i]`` tokens it had left
        (integers: the per-step adds' totals)."""
        for totals, e, a, t, p, n in zip(self.totals, emitted, accepted, before, proposed, spec_steps):
            if p:
                totals[0] += p
                totals[1] += e - steps + (a >= t)  # (a bool: 1 or 0)
                totals[2] += n
                totals[3] += e - steps + n

    def _settle(self, ctx0: list[int], left0: list[int], left: list[int]) -> list[int]:
        """After a stretch of steps from contexts ``ctx0`` and tokens left ``left0`` to ``left``: the batch's contexts
        and tokens left set, and the tokens each request emitted returned."""
        emitted = [t0 - t for t0, t in zip(left0, left)]
        self.ctx = [c + e for c, e in zip(ctx0, emitted)]
        self.left = left
        return emitted

    def _uniform_pricer(self, batch: int, k: int):
        """The seconds of a step of ``batch`` requests all proposing ``k``, as a function of their context total:
        :func:`policies.step_time.shape_seconds` of the uniform step's shape (what the per-step path charges) without
        building the shape, the same cost-model calls in the same order and the additions of
        :func:`policies.step_time.step_seconds` (verification, overhead, draft passes), so bit for bit its number and
        its warnings: the step of a chain of k nodes priced by :func:`policies.step_time.uniform_step_pricer`, whose
        chain steps are the chain form's (with token trees, the tree form's: bit for bit :meth:`_decode_seconds`'
        number); kept by (batch, k) (:data:`KEPT_PRICERS`)."""
        if KEPT_PRICERS and (kept := self._step_prices.get((batch, k))) is not None:  # (speed shortcut, tested)
            return kept
        price = uniform_step_pricer(self.cost, batch, TreeShape.chain(k) if self.tree is None else self.tree.shape(k),
                                    self.spec.draft_proposer)
        if KEPT_PRICERS:
            self._step_prices[batch, k] = price
        return price

    def _timeout_until(self, clock: float):
        """A SimPy timeout that ends at ``clock`` exactly (now + (clock - now) can round off clock; the delay is
        nudged by ulps until it does not), so a run's end is the time step by step reaches."""
        now = self.env.now
        delay = clock - now
        while now + delay < clock:
            delay = math.nextafter(delay, math.inf)
        while now + delay > clock:
            delay = math.nextafter(delay, -math.inf)
        return self.env.timeout(delay)

    def _quiet_run(self, n: int, left_min: int, arrival: float):
        """A run of at most ``n`` <= ``left_min`` steps in which nobody proposes (``left_min``: the fewest tokens
        any running request has left to emit): each request emits one token a step, so the steps are known
        before they run. Plain Python over the batch: at serving batch sizes (tens) it beats small numpy calls
        several times over. The same steps, times and blocks as :meth:`_decode_run`."""
        start, batch, bs = self._run_clock(), len(self.rid), self.spec.block_size
        ctx, blocks = self.ctx, self.blocks
        holding = sum(blocks)

        def held(j: int) -> list[int]:
            """Blocks each request holds during step j (context ctx + j plus the token it verifies); max(b, n) written
            out (a call of max per request costs more than the comparison)."""
            return [n if (n := (c + j + bs) // bs) > b else b for c, b in zip(ctx, blocks)]

        def grow(j: int) -> int:
            """Blocks the batch adds to hold step j (probed by the search below when they may not fit)."""
            return sum(held(j)) - holding

        context, ks = sum(ctx), [0] * batch
        n = self._bound_by_arrival(n, arrival, self._run_seconds([context], ks)[0], start)
        seconds = self._run_seconds(range(context, context + batch * n, batch), ks)
        clock, n = self._clock(seconds, arrival, start)
        after = held(n - 1)
        added = sum(after) - holding
        if added > self.free_blocks:  # grow(j) is non-decreasing: keep the steps whose blocks fit
            n = bisect_right(range(n), self.free_blocks, key=grow)
            if n == 0:
                yield from self._decode_step([0] * batch)  # this step must preempt
                return
            after = held(n - 1)
            added = sum(after) - holding
        yield self._block_run_end(start, clock, n)
        if (ran := self._steps_run(n)) < n:  # ended earlier: the blocks its last step held
            n = ran
            after = held(n - 1)
            added = sum(after) - holding
        self.load.add(batch, seconds[:n], 0)
        used_before = self.spec.num_gpu_blocks - self.free_blocks
        self.free_blocks -= added
        self.blocks = after
        self.ctx = [c + n for c in ctx]
        self.left = [t - n for t in self.left]
        if self.rec.keeps_steps:
            zeros, ones = np.zeros(batch, dtype=np.int64), np.ones(batch, dtype=np.int64)
            for j in range(n):
                self.rec.step(clock[j], seconds[j], "decode", batch, 0, used_before + grow(j), len(self.waiting),
                              zeros, zeros, ones)
        else:
            self.rec.count_steps(n)
        if n == left_min:  # someone emitted its last token
            self._retire(self.env.now)

    def _bound_by_arrival(self, n: int, arrival: float, first: float, start: float) -> int:
        """At most ``n`` steps from ``start``, and none that start after the step during which the next request arrives
        (``arrival``; inf: none is due): steps only grow longer, so the first one's ``first`` seconds bound them."""
        return n if arrival == np.inf else min(n, int((arrival - start) / first) + 1)

    def _clock(self, seconds: list[float], arrival: float, start: float) -> tuple[list[float], int]:
        """The boundaries of steps of ``seconds`` from ``start`` (summed in the same order as step by step), and how
        many of them run: up to the one during which the next request arrives (admitted at its end)."""
        clock = list(accumulate(seconds, initial=start))
        return clock, min(len(seconds), bisect_right(clock, arrival, 1))

    def _run_seconds(self, contexts: Sequence[int], ks: list[int], ctx: np.ndarray | None = None) -> list[float]:
        """Seconds of steps of the batch proposing ``ks``, whose context totals before each step are
        ``contexts``: :func:`policies.step_time.run_seconds`, bit for bit the per-step formula. ``ctx``
        (steps, batch), each request's context, is needed only when the ks differ."""
        batch, k_max = len(ks), max(ks)
        passes = ()
        if k_max and self.spec.draft_proposer:
            if min(ks) == k_max:  # everyone drafts in every pass: pass p reads sum_i (c_i + p)
                passes = [(batch, [c + batch * p for c in contexts]) for p in range(k_max)]
            else:
                proposed = np.array(ks, dtype=np.int64)
                reach = proposed[:, None] >= np.arange(1, k_max + 1)  # (batch, pass): request i drafts in pass p
                seqs = reach.sum(axis=0)
                passes = zip(seqs.tolist(), (ctx @ reach + seqs * np.arange(k_max)).T.tolist())
        return run_seconds(self.cost, batch, sum(ks) + batch, contexts, passes, self.spec.draft_proposer)
