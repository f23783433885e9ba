"""The serving engine: one SimPy process that schedules steps like vLLM's continuous batching.

Semantics (vLLM terms):

- Requests wait in a FCFS queue; at most ``max_num_seqs`` run at once; one step processes at most
  ``max_num_batched_tokens`` prefill tokens (plus, under chunked prefill, the decode tokens).
- KV cache: ``num_gpu_blocks`` blocks of ``block_size`` token slots. A request holds
  ceil(tokens / block_size) blocks for the tokens in its cache, and a decode step first reserves room
  for the k + 1 tokens it verifies (the lookahead slots). Blocks are freed when a request finishes or
  is preempted. When a decode step cannot get its blocks, the newest running request is preempted by
  recompute (as vLLM): it loses its cache, keeps its generated tokens, and returns to the head of the
  queue, where a later prefill recomputes prompt + generated tokens.
- ``prefill-first`` (vLLM v0): a step is either a prefill of newly admitted requests or a decode step of
  all running ones; admission wins whenever a waiting request fits.
  ``chunked-prefill`` (vLLM v1): every step decodes all running requests and spends the rest of the token
  budget on prefill chunks, FCFS.
- The prefill pass emits the first output token. A decode step asks the policy for k_i per request,
  costs draft + verification + overhead (:func:`policies.step_time.predict_step_seconds`), draws accepted
  a_i in [0, k_i] from the acceptance model and appends min(a_i + 1, tokens still needed) tokens.

Runs of steps: when the policy is *stationary* (its proposals depend only on which requests run:
no-spec, fixed-k, threshold on the running count) and a draft model or nobody proposes, the engine asks
the policy once and simulates up to ``run_steps`` decode steps of the unchanged batch in one SimPy event:
the acceptance draws of the run come in one call, and the run ends at the step in which a request
finishes, before a step whose KV blocks would not fit (that step goes through the per-step path, which
preempts), or with the step during which the next request arrives when the queue is empty (so the
arrival is admitted at the same step boundary as step by step). Each step keeps its own time from the
cost model, so a run is the same steps at the same times; only the random stream is consumed in
blocks, so runs and single steps give statistically equal, not identical, results with speculation
(and identical ones without).

Bookkeeping: ``ctx`` = tokens in a running request's KV cache before the next decode step
= prompt + generated - 1 (the newest token enters the cache in the pass that verifies the next ones).
A mixed chunked step costs its decode part plus its prefill part (an additive approximation: one fixed
per-pass cost too many). Times are seconds of simulated time; tokens are counts.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from itertools import accumulate
from dataclasses import dataclass

import numpy as np
import simpy

from policies.base import BatchView, Policy, StepOutcome
from policies.step_time import predict_step_seconds
from simulator.inputs.acceptance import AcceptanceModel
from simulator.costs.cost_model import CostModel
from policies.errors import UserError
from simulator.metrics import Recorder
from simulator.inputs.workload import Workload

@dataclass(frozen=True)
class EngineSpec:
    """The scheduler's limits (resolved from :class:`simulator.config.SimConfig`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_gpu_blocks: int
    chunked_prefill: bool
    max_k: int
    draft_proposer: bool
    """True: a draft model proposes (k draft passes, draft prefill). False: n-gram prompt lookup."""
    ngram_match_prob: float
    speculative: bool
    """False when the policy can never speculate (k bound 0): the draft model then costs nothing."""
    run_steps: int = 64
    """Most decode steps simulated in one event for a stationary policy (1: always step by step)."""


class ServingEngine:
    """Serves ``workload`` in a SimPy environment; call :meth:`start`, then ``env.run()``."""

    def __init__(self, env: simpy.Environment, spec: EngineSpec, workload: Workload, cost_model: CostModel,
                 policy: Policy, policy_cost_model: CostModel, acceptance: AcceptanceModel,
                 ngram_rng: np.random.Generator, recorder: Recorder) -> None:
        self.env = env
        self.spec = spec
        self.workload = workload
        self.cost = cost_model
        self.policy = policy
        self.policy_cost = policy_cost_model
        self.acceptance = acceptance
        self.ngram_rng = ngram_rng
        self.rec = recorder
        self._check_fits()
        n = len(workload)
        self.prompt: list[int] = workload.prompt_tokens.tolist()
        self.output: list[int] = workload.output_tokens.tolist()
        self.generated = [0] * n
        """Output tokens of each request not decoding now (a running one's is output - left)."""
        self.waiting: deque[int] = deque()
        self.arrived = 0
        self._wake: simpy.Event | None = None
        self.free_blocks = spec.num_gpu_blocks
        # Requests being prefilled: [request id, tokens already prefilled, tokens to prefill, blocks held].
        self.prefilling: list[list[int]] = []
        # The decode batch, in admission order (newest last), as parallel lists of ints: at serving batch sizes
        # (tens) plain Python beats small numpy calls several times over; the numpy paths convert.
        self.rid: list[int] = []
        self.ctx: list[int] = []
        self.left: list[int] = []
        self.blocks: list[int] = []
        # n-gram lookups hit or miss step by step, so only a draft model (or no speculation) runs steps together
        self.runs = (spec.run_steps > 1 and getattr(policy, "stationary", False) and not spec.chunked_prefill
                     and (spec.draft_proposer or not spec.speculative))

    # -- set-up ---------------------------------------------------------------------------------
    def _check_fits(self) -> None:
        """A request whose whole context cannot fit in the cache would be preempted forever: refuse it."""
        s = self.spec
        lookahead = s.max_k + 1 if s.speculative else 1
        need = -(-(self.workload.prompt_tokens + self.workload.output_tokens + lookahead) // s.block_size)
        worst = int(np.argmax(need))
        if need[worst] > s.num_gpu_blocks:
            raise UserError(
                f"workload: request {worst} can never fit in the KV cache: it needs {int(need[worst])} blocks "
                f"(prompt {int(self.workload.prompt_tokens[worst])} + output {int(self.workload.output_tokens[worst])} "
                f"tokens) but the cache holds {s.num_gpu_blocks} blocks of {s.block_size} tokens (--num-gpu-blocks)")

    def start(self) -> None:
        self.env.process(self._arrivals())
        self.env.process(self._serve())

    # -- processes ------------------------------------------------------------------------------
    def _arrivals(self):
        env = self.env
        for rid, t in enumerate(self.workload.arrival_time.tolist()):
            if t > env.now:
                yield env.timeout(t - env.now)
            self.waiting.append(rid)
            self.arrived += 1
            if self._wake is not None and not self._wake.triggered:
                self._wake.succeed()

    def _serve(self):
        env = self.env
        n = len(self.workload)
        while True:
            if not self.waiting and not self.prefilling and not self.rid:
                if self.arrived == n:
                    return
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            if self.spec.chunked_prefill:
                yield from self._chunked_step()
            elif self._admit_prefill():
                yield from self._prefill_step()
            elif self.runs:
                yield from self._decode_run()
            else:
                yield from self._decode_step()

    # -- prefill-first --------------------------------------------------------------------------
    def _admit_prefill(self) -> bool:
        """Move waiting requests that fit (seats, token budget, blocks) into ``prefilling``; FCFS, no skipping."""
        s = self.spec
        budget = s.max_num_batched_tokens
        seats = s.max_num_seqs - len(self.rid)
        while self.waiting and seats > 0:
            rid = self.waiting[0]
            tokens = self.prompt[rid] + self.generated[rid]
            blocks = -(-tokens // s.block_size)
            # A prompt longer than the budget is admitted alone (vLLM v0 would need the budget raised).
            if (tokens > budget and self.prefilling) or blocks > self.free_blocks:
                break
            self.waiting.popleft()
            self.free_blocks -= blocks
            self.prefilling.append([rid, 0, tokens, blocks])
            budget -= tokens
            seats -= 1
        return bool(self.prefilling)

    def _prefill_step(self):
        chunks = [(entry, entry[2]) for entry in self.prefilling]
        seconds = self._prefill_seconds(chunks) + self.cost.overhead_time(len(chunks))
        start = self.env.now
        yield self.env.timeout(seconds)
        self.rec.step(start, seconds, "prefill", len(chunks), sum(c for _, c in chunks),
                      self.spec.num_gpu_blocks - self.free_blocks, len(self.waiting))
        self._finish_prefills(chunks)

    # -- chunked prefill ------------------------------------------------------------------------
    def _chunked_step(self):
        s = self.spec
        decoding = bool(self.rid)
        if decoding:
            proposed = self._propose()
            self._reserve_decode_blocks(proposed)
            proposed = proposed[: len(self.rid)]
        budget = s.max_num_batched_tokens - (int(proposed.sum()) + len(self.rid) if decoding else 0)
        chunks = self._plan_chunks(max(budget, 0))
        if not self.rid and not chunks:
            raise RuntimeError("scheduler stalled: nothing to run")  # impossible after _check_fits
        # predict_step_seconds includes the step's overhead; a prefill-only step pays its own
        seconds = self._decode_seconds(proposed) if self.rid else self.cost.overhead_time(len(chunks))
        if chunks:
            seconds += self._prefill_seconds(chunks)
        start = self.env.now
        yield self.env.timeout(seconds)
        kind = "mixed" if self.rid and chunks else ("decode" if self.rid else "prefill")
        if self.rid:
            self._apply_decode(start, seconds, kind, proposed, sum(c for _, c in chunks))
        else:
            self.rec.step(start, seconds, kind, len(chunks), sum(c for _, c in chunks),
                          s.num_gpu_blocks - self.free_blocks, len(self.waiting))
        self._finish_prefills(chunks)

    def _plan_chunks(self, budget: int) -> list[tuple[list[int], int]]:
        """Prefill chunks for this step under ``budget`` tokens: running prefills first, then new admissions."""
        s = self.spec
        chunks = []
        for entry in self.prefilling:
            if budget <= 0:
                break
            chunk = self._grow_chunk(entry, budget)
            if chunk == 0:
                break
            chunks.append((entry, chunk))
            budget -= chunk
        seats = s.max_num_seqs - len(self.rid) - len(self.prefilling)
        while self.waiting and seats > 0 and budget > 0:
            rid = self.waiting[0]
            entry = [rid, 0, self.prompt[rid] + self.generated[rid], 0]
            chunk = self._grow_chunk(entry, budget)
            if chunk == 0:
                break
            self.waiting.popleft()
            self.prefilling.append(entry)
            chunks.append((entry, chunk))
            budget -= chunk
            seats -= 1
        return chunks

    def _grow_chunk(self, entry: list[int], budget: int) -> int:
        """Reserve blocks for the next chunk of ``entry`` (at most ``budget`` tokens); return its size (0: no room)."""
        bs = self.spec.block_size
        _, done, total, held = entry
        room = (held + self.free_blocks) * bs - done  # tokens that fit in held + free blocks
        chunk = min(total - done, budget, room)
        if chunk <= 0:
            return 0
        need = -(-(done + chunk) // bs) - held
        self.free_blocks -= need
        entry[3] += need
        return chunk

    # -- shared pieces --------------------------------------------------------------------------
    def _prefill_seconds(self, chunks) -> float:
        tokens = sum(c for _, c in chunks)
        seconds = self.cost.prefill_time(len(chunks), tokens)
        if self.spec.draft_proposer and self.spec.speculative:
            seconds += self.cost.prefill_time(len(chunks), tokens, role="draft")
        return seconds

    def _finish_prefills(self, chunks) -> None:
        """Advance chunks; requests whose prefill completed emit their first token and join the decode batch."""
        now = self.env.now
        for entry, chunk in chunks:
            entry[1] += chunk
            if entry[1] == entry[2]:
                self.prefilling.remove(entry)
                rid, tokens, blocks = entry[0], entry[2], entry[3]  # tokens: prompt + generated before a preemption
                self.rec.first_token(rid, now)
                self.generated[rid] += 1
                left = self.output[rid] - self.generated[rid]
                if left == 0:
                    self.free_blocks += blocks
                    self.rec.finish(rid, now)
                    continue
                if self.generated[rid] == 1:  # not after a recompute: the request keeps its acceptance state
                    self.acceptance.start(rid)
                self.rid.append(rid)
                self.ctx.append(tokens)  # prompt + generated - 1
                self.left.append(left)
                self.blocks.append(blocks)

    def _propose(self) -> np.ndarray:
        """Ask the policy for k per running request, validate it, and apply the n-gram lookup's misses."""
        generated = [self.output[r] - t for r, t in zip(self.rid, self.left)]
        view = BatchView(self.env.now, np.array(self.rid, dtype=np.int64), np.array(self.ctx, dtype=np.int64),
                         np.array(generated, dtype=np.int64), len(self.waiting), self.policy_cost, self.spec.max_k,
                         self.spec.draft_proposer)
        k = self.policy.propose(view)
        if not isinstance(k, np.ndarray) or k.shape != (len(self.rid),):
            raise UserError(f"policy {self.policy.name}: propose() must return an int array of length "
                            f"{len(self.rid)}, got {type(k).__name__} {getattr(k, 'shape', '')}")
        values = k.tolist()  # plain Python: at batch sizes of tens, faster than numpy's reductions
        if values and (min(values) < 0 or max(values) > self.spec.max_k):
            raise UserError(f"policy {self.policy.name}: proposed k outside [0, {self.spec.max_k}] "
                            f"(got {min(values)}..{max(values)})")
        k = k.astype(np.int64, copy=False)
        if not self.spec.draft_proposer and any(values):
            k = np.where(self.ngram_rng.random(k.size) < self.spec.ngram_match_prob, k, 0)
        return k

    def _reserve_decode_blocks(self, proposed: np.ndarray) -> None:
        """Reserve the lookahead slots of this step, preempting newest requests while blocks run out."""
        bs = self.spec.block_size
        while True:
            # ceil((ctx + k + 1) / bs) blocks each
            grow = [max((c + k + bs) // bs - b, 0) for c, k, b in zip(self.ctx, proposed.tolist(), self.blocks)]
            total = sum(grow)
            if total <= self.free_blocks:
                self.free_blocks -= total
                self.blocks = [b + g for b, g in zip(self.blocks, grow)]
                return
            self._preempt_newest()

    def _preempt_newest(self) -> None:
        """Preempt by recompute: newest prefill first, else the newest decoding request (vLLM's order)."""
        now = self.env.now
        if self.prefilling:
            rid, _, _, held = self.prefilling.pop()
            self.free_blocks += held
        else:
            rid = self.rid.pop()
            self.ctx.pop()
            self.generated[rid] = self.output[rid] - self.left.pop()
            self.free_blocks += self.blocks.pop()
            self.policy.finish(rid)
        if not self.rid and not self.prefilling:
            raise RuntimeError("preempted the only request")  # impossible after _check_fits
        self.waiting.appendleft(rid)
        self.rec.preempt(rid, now)

    def _decode_seconds(self, proposed: np.ndarray) -> float:
        """Draft passes + verification + overhead of the decode batch (the policies' formula)."""
        return predict_step_seconds(self.cost, self.ctx, proposed, self.spec.draft_proposer)

    def _decode_step(self, proposed: np.ndarray | None = None):
        if proposed is None:
            proposed = self._propose()
        self._reserve_decode_blocks(proposed)
        proposed = proposed[: len(self.rid)]
        seconds = self._decode_seconds(proposed)
        start = self.env.now
        yield self.env.timeout(seconds)
        self._apply_decode(start, seconds, "decode", proposed, 0)

    def _apply_decode(self, start: float, seconds: float, kind: str, proposed: np.ndarray,
                      prefill_tokens: int) -> None:
        """Verification outcome: draw acceptances, append tokens, report to the policy, retire finished requests."""
        now = self.env.now
        rid = np.array(self.rid, dtype=np.int64)
        if proposed.any():
            accepted = self.acceptance.draw(rid, proposed)
            self.rec.decode(rid, proposed, accepted)
        else:
            accepted = proposed  # all zeros
        emitted = np.minimum(accepted + 1, self.left)
        self._advance(emitted.tolist())
        self.rec.step(start, seconds, kind, rid.size, prefill_tokens, self.spec.num_gpu_blocks - self.free_blocks,
                      len(self.waiting), proposed, accepted, emitted)
        self.policy.observe(StepOutcome(now, rid, proposed, accepted, seconds))
        self._retire(now)

    def _advance(self, emitted: list[int]) -> None:
        """Each running request emitted ``emitted[i]`` tokens (they enter its context)."""
        self.ctx = [c + e for c, e in zip(self.ctx, emitted)]
        self.left = [t - e for t, e in zip(self.left, emitted)]

    def _retire(self, now: float) -> None:
        """Free the requests that have emitted all their tokens."""
        while 0 in self.left:
            i = self.left.index(0)
            rid = self.rid.pop(i)
            del self.ctx[i], self.left[i]
            self.generated[rid] = self.output[rid]
            self.free_blocks += self.blocks.pop(i)
            self.rec.finish(rid, now)
            self.acceptance.finish(rid)
            self.policy.finish(rid)

    # -- runs of decode steps (stationary policies) ----------------------------------------------
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
        if proposed is None or not any(proposed.tolist()):
            yield from self._quiet_run(n, left_min, arrival)
            return
        rid, ctx0, left, blocks = (np.array(x, dtype=np.int64) for x in (self.rid, self.ctx, self.left, self.blocks))
        ks = proposed.tolist()
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
            yield from self._decode_step(proposed)  # this step must preempt
            return
        seconds = self._run_seconds(ctx[:n].sum(axis=1).tolist(), ks, ctx[:n])
        clock, n = self._clock(seconds, arrival)
        yield self.env.timeout(clock[n] - now)
        batch = rid.size
        used_before = self.spec.num_gpu_blocks - self.free_blocks
        self.free_blocks -= int(grow[n - 1])
        self.blocks = np.maximum(blocks, need[n - 1]).tolist()
        self._advance(np.minimum(emitted[n - 1], left).tolist())
        self.rec.decode(rid, proposed * n, accepted[:n].sum(axis=0), steps=n)
        if self.rec.steps is not None:
            per_step = np.diff(np.minimum(emitted[:n], left), axis=0, prepend=0)
            for j in range(n):
                self.rec.step(clock[j], seconds[j], "decode", batch, 0, used_before + int(grow[j]),
                              len(self.waiting), proposed, accepted[j], per_step[j])
        else:
            self.rec.num_steps += n
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
                yield from self._decode_step(np.zeros(batch, dtype=np.int64))  # this step must preempt
                return
            after = held(n - 1)
            added = sum(after) - sum(blocks)
        yield self.env.timeout(clock[n] - now)
        used_before = self.spec.num_gpu_blocks - self.free_blocks
        self.free_blocks -= added
        self.blocks = after
        self.ctx = [c + n for c in ctx]
        self.left = [t - n for t in self.left]
        if self.rec.steps is not None:
            zeros, ones = np.zeros(batch, dtype=np.int64), np.ones(batch, dtype=np.int64)
            for j in range(n):
                self.rec.step(clock[j], seconds[j], "decode", batch, 0, used_before + grow(j), len(self.waiting),
                              zeros, zeros, ones)
        else:
            self.rec.num_steps += n
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
        ``contexts``: :func:`policies.step_time.shape_seconds` of each, bit for bit (the same additions in the
        same order). ``ctx`` (steps, batch), each request's context, is needed only when the ks differ."""
        batch, k_max = len(ks), max(ks)
        overhead = self.cost.overhead_time(batch)
        seconds = [t + overhead for t in self.cost.target_times(batch, sum(ks) + batch, contexts)]
        if k_max and self.spec.draft_proposer:
            if min(ks) == k_max:  # everyone drafts in every pass: pass p reads sum_i (c_i + p)
                passes = [(batch, [c + batch * p for c in contexts]) for p in range(k_max)]
            else:
                proposed = np.array(ks, dtype=np.int64)
                reach = proposed[:, None] >= np.arange(1, k_max + 1)  # (batch, pass): request i drafts in pass p
                seqs = reach.sum(axis=0)
                passes = zip(seqs.tolist(), (ctx @ reach + seqs * np.arange(k_max)).T.tolist())
            for sequences, pass_contexts in passes:
                seconds = [t + d for t, d in zip(seconds, self.cost.draft_times(sequences, pass_contexts))]
        return seconds
