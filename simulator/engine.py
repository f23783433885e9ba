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

Bookkeeping: ``ctx`` = tokens in a running request's KV cache before the next decode step
= prompt + generated - 1 (the newest token enters the cache in the pass that verifies the next ones).
A mixed chunked step costs its decode part plus its prefill part (an additive approximation: one fixed
per-pass cost too many). Times are seconds of simulated time; tokens are counts.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import simpy

from policies.base import BatchView, Policy, StepOutcome
from policies.step_time import predict_step_seconds
from simulator.acceptance import AcceptanceModel
from simulator.cost_model import CostModel
from simulator.errors import UserError
from simulator.metrics import Recorder
from simulator.workload import Workload

_EMPTY = np.zeros(0, dtype=np.int64)


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
        self.prompt = workload.prompt_tokens
        self.output = workload.output_tokens
        self.generated = np.zeros(n, dtype=np.int64)
        self.waiting: deque[int] = deque()
        self.arrived = 0
        self._wake: simpy.Event | None = None
        self.free_blocks = spec.num_gpu_blocks
        # Requests being prefilled: [request id, tokens already prefilled, tokens to prefill, blocks held].
        self.prefilling: list[list[int]] = []
        # The decode batch, in admission order (newest last), as parallel arrays.
        self.rid = _EMPTY
        self.ctx = _EMPTY
        self.left = _EMPTY
        self.blocks = _EMPTY

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
            if not self.waiting and not self.prefilling and self.rid.size == 0:
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
            else:
                yield from self._decode_step()

    # -- prefill-first --------------------------------------------------------------------------
    def _admit_prefill(self) -> bool:
        """Move waiting requests that fit (seats, token budget, blocks) into ``prefilling``; FCFS, no skipping."""
        s = self.spec
        budget = s.max_num_batched_tokens
        seats = s.max_num_seqs - self.rid.size
        while self.waiting and seats > 0:
            rid = self.waiting[0]
            tokens = int(self.prompt[rid] + self.generated[rid])
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
        decoding = self.rid.size > 0
        if decoding:
            proposed = self._propose()
            self._reserve_decode_blocks(proposed)
            proposed = proposed[: self.rid.size]
        budget = s.max_num_batched_tokens - (int(proposed.sum()) + self.rid.size if decoding else 0)
        chunks = self._plan_chunks(max(budget, 0))
        if self.rid.size == 0 and not chunks:
            raise RuntimeError("scheduler stalled: nothing to run")  # impossible after _check_fits
        # predict_step_seconds includes the step's overhead; a prefill-only step pays its own
        seconds = self._decode_seconds(proposed) if self.rid.size else self.cost.overhead_time(len(chunks))
        if chunks:
            seconds += self._prefill_seconds(chunks)
        start = self.env.now
        yield self.env.timeout(seconds)
        kind = "mixed" if self.rid.size and chunks else ("decode" if self.rid.size else "prefill")
        if self.rid.size:
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
        seats = s.max_num_seqs - self.rid.size - len(self.prefilling)
        while self.waiting and seats > 0 and budget > 0:
            rid = self.waiting[0]
            entry = [rid, 0, int(self.prompt[rid] + self.generated[rid]), 0]
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
        done_rids, done_blocks = [], []
        for entry, chunk in chunks:
            entry[1] += chunk
            if entry[1] == entry[2]:
                self.prefilling.remove(entry)
                rid = entry[0]
                self.rec.first_token(rid, now)
                self.generated[rid] += 1
                if self.generated[rid] >= self.output[rid]:
                    self.free_blocks += entry[3]
                    self.rec.finish(rid, now)
                    continue
                if self.generated[rid] == 1:  # not after a recompute: the request keeps its acceptance state
                    self.acceptance.start(rid)
                done_rids.append(rid)
                done_blocks.append(entry[3])
        if done_rids:
            ids = np.asarray(done_rids, dtype=np.int64)
            self.rid = np.concatenate([self.rid, ids])
            self.ctx = np.concatenate([self.ctx, self.prompt[ids] + self.generated[ids] - 1])
            self.left = np.concatenate([self.left, self.output[ids] - self.generated[ids]])
            self.blocks = np.concatenate([self.blocks, np.asarray(done_blocks, dtype=np.int64)])

    def _propose(self) -> np.ndarray:
        """Ask the policy for k per running request, validate it, and apply the n-gram lookup's misses."""
        view = BatchView(self.env.now, self.rid, self.ctx, self.generated[self.rid],
                         len(self.waiting), self.policy_cost, self.spec.max_k, self.spec.draft_proposer)
        k = self.policy.propose(view)
        if not isinstance(k, np.ndarray) or k.shape != self.rid.shape:
            raise UserError(f"policy {self.policy.name}: propose() must return an int array of length "
                            f"{self.rid.size}, got {type(k).__name__} {getattr(k, 'shape', '')}")
        if k.size and (k.min() < 0 or k.max() > self.spec.max_k):
            raise UserError(f"policy {self.policy.name}: proposed k outside [0, {self.spec.max_k}] "
                            f"(got {int(k.min())}..{int(k.max())})")
        k = k.astype(np.int64, copy=False)
        if not self.spec.draft_proposer and k.any():
            k = np.where(self.ngram_rng.random(k.size) < self.spec.ngram_match_prob, k, 0)
        return k

    def _reserve_decode_blocks(self, proposed: np.ndarray) -> None:
        """Reserve the lookahead slots of this step, preempting newest requests while blocks run out."""
        bs = self.spec.block_size
        while True:
            need = (self.ctx + proposed[: self.rid.size] + (bs)) // bs  # ceil((ctx + k + 1) / bs)
            grow = np.maximum(need - self.blocks, 0)
            total = int(grow.sum())
            if total <= self.free_blocks:
                self.free_blocks -= total
                self.blocks = self.blocks + grow
                return
            self._preempt_newest()

    def _preempt_newest(self) -> None:
        """Preempt by recompute: newest prefill first, else the newest decoding request (vLLM's order)."""
        now = self.env.now
        if self.prefilling:
            rid, _, _, held = self.prefilling.pop()
            self.free_blocks += held
        else:
            rid = int(self.rid[-1])
            self.free_blocks += int(self.blocks[-1])
            self.rid, self.ctx, self.left, self.blocks = (self.rid[:-1], self.ctx[:-1], self.left[:-1],
                                                          self.blocks[:-1])
            self.policy.finish(rid)
        if self.rid.size == 0 and not self.prefilling:
            raise RuntimeError("preempted the only request")  # impossible after _check_fits
        self.waiting.appendleft(rid)
        self.rec.preempt(rid, now)

    def _decode_seconds(self, proposed: np.ndarray) -> float:
        """Draft passes + verification + overhead of the decode batch (the policies' formula)."""
        return predict_step_seconds(self.cost, self.ctx, proposed, self.spec.draft_proposer)

    def _decode_step(self):
        proposed = self._propose()
        self._reserve_decode_blocks(proposed)
        proposed = proposed[: self.rid.size]
        seconds = self._decode_seconds(proposed)
        start = self.env.now
        yield self.env.timeout(seconds)
        self._apply_decode(start, seconds, "decode", proposed, 0)

    def _apply_decode(self, start: float, seconds: float, kind: str, proposed: np.ndarray,
                      prefill_tokens: int) -> None:
        """Verification outcome: draw acceptances, append tokens, report to the policy, retire finished requests."""
        now = self.env.now
        rid = self.rid
        if proposed.any():
            accepted = self.acceptance.draw(rid, proposed)
            self.rec.decode(rid, proposed, accepted)
        else:
            accepted = proposed  # all zeros
        emitted = np.minimum(accepted + 1, self.left)
        self.ctx = self.ctx + emitted
        self.left = self.left - emitted
        self.generated[rid] += emitted
        self.rec.step(start, seconds, kind, rid.size, prefill_tokens, self.spec.num_gpu_blocks - self.free_blocks,
                      len(self.waiting), proposed, accepted, emitted)
        self.policy.observe(StepOutcome(now, rid, proposed, accepted, seconds))
        done = self.left == 0
        if done.any():
            for r in rid[done].tolist():
                self.rec.finish(r, now)
                self.acceptance.finish(r)
                self.policy.finish(r)
            self.free_blocks += int(self.blocks[done].sum())
            keep = ~done
            self.rid, self.ctx, self.left, self.blocks = rid[keep], self.ctx[keep], self.left[keep], self.blocks[keep]
