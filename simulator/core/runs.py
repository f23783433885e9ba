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
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from policies.step_time import run_seconds


class DecodeRuns:
    """The run methods of :class:`simulator.core.engine.SimulatedEngine` (a mixin: they read and advance the
    engine's batch, blocks, clock and recorder as its per-step path does)."""

    def _decode_run(self):
        """Up to ``run_steps`` decode steps of the unchanged batch in one event (see the module docstring)."""
        # A policy that can never speculate (spec.speculative False) need not be asked: nobody proposes.
        proposed = self._propose() if self.spec.speculative else None
        now, bs = self.env.now, self.spec.block_size
        # Bound the run before drawing: every step emits >= 1 token per request, and steps only grow longer
        # (contexts grow), so no run outlasts the first finish or the step the next arrival falls into.
        left_min = min(self.left)
        n = min(self.spec.run_steps, left_min)
        arrival = (self.workload.arrival_time[self.arrived] if not self.waiting and self.arrived < len(self.workload)
                   else np.inf)
        if proposed is None or not any(proposed):
            yield from self._quiet_run(n, left_min, arrival)
            return
        rid, ctx0, left, blocks = (np.array(x, dtype=np.int64) for x in (self.rid, self.ctx, self.left, self.blocks))
        ks, proposed = proposed, np.array(proposed, dtype=np.int64)
        n = self._bound_by_arrival(n, arrival, self._run_seconds([sum(self.ctx)], ks, ctx0[None, :])[0])
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
        clock, n = self._clock(seconds, arrival)
        yield self.env.timeout(clock[n] - now)
        batch = rid.size
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

    def _quiet_run(self, n: int, left_min: int, arrival: float):
        """A run of at most ``n`` <= ``left_min`` steps in which nobody proposes (``left_min``: the fewest tokens
        any running request has left to emit): each request emits one token a step, so the steps are known
        before they run. Plain Python over the batch: at serving batch sizes (tens) it beats small numpy calls
        several times over. The same steps, times and blocks as :meth:`_decode_run`."""
        now, batch, bs = self.env.now, len(self.rid), self.spec.block_size
        ctx, blocks = self.ctx, self.blocks

        def held(j: int) -> list[int]:
            """Blocks each request holds during step j (context ctx + j plus the token it verifies)."""
            return [max(b, (c + j + bs) // bs) for c, b in zip(ctx, blocks)]

        def grow(j: int) -> int:
            """Blocks the batch adds to hold step j."""
            return sum(held(j)) - sum(blocks)

        context, ks = sum(ctx), [0] * batch
        n = self._bound_by_arrival(n, arrival, self._run_seconds([context], ks)[0])
        seconds = self._run_seconds(range(context, context + batch * n, batch), ks)
        clock, n = self._clock(seconds, arrival)
        after = held(n - 1)
        added = sum(after) - sum(blocks)
        if added > self.free_blocks:  # grow(j) is non-decreasing: keep the steps whose blocks fit
            n = bisect_right(range(n), self.free_blocks, key=grow)
            if n == 0:
                yield from self._decode_step([0] * batch)  # this step must preempt
                return
            after = held(n - 1)
            added = sum(after) - sum(blocks)
        yield self.env.timeout(clock[n] - now)
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

    def _bound_by_arrival(self, n: int, arrival: float, first: float) -> int:
        """At most ``n`` steps, and none that start after the step during which the next request arrives
        (``arrival``; inf: none is due): steps only grow longer, so the first one's ``first`` seconds bound them."""
        return n if arrival == np.inf else min(n, int((arrival - self.env.now) / first) + 1)

    def _clock(self, seconds: list[float], arrival: float) -> tuple[list[float], int]:
        """The boundaries of steps of ``seconds`` from now (summed in the same order as step by step), and how
        many of them run: up to the one during which the next request arrives (admitted at its end)."""
        clock = list(accumulate(seconds, initial=self.env.now))
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
