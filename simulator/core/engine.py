"""The simulated serving engine: one SimPy process that schedules steps like vLLM's continuous batching.

Semantics (vLLM terms):

- Requests wait in a FCFS queue; at most ``max_num_seqs`` run at once; one step processes at most
  ``max_num_batched_tokens`` prefill tokens (plus, under chunked prefill, the decode tokens).
- KV cache: ``num_gpu_blocks`` blocks of ``block_size`` token slots. A request holds
  ceil(tokens / block_size) blocks for the tokens in its cache, and a decode step first reserves room
  for the k + 1 tokens it verifies (the lookahead slots). A model with sliding-window layers (``EngineSpec.kv``,
  :class:`simulator.core.memory.KVLayout`) holds in them only the window, as vLLM's hybrid KV-cache manager: the
  general path, step by step, its blocks recounted at every reservation (freed as the window passes); a model
  without keeps the fast path (the same arithmetic, the runs of steps). Blocks are freed when a request finishes or
  is preempted. When a decode step cannot get its blocks, the newest running request is preempted by
  recompute (as vLLM): it loses its cache, keeps its generated tokens, and returns to the head of the
  queue, where a later prefill recomputes prompt + generated tokens.
- ``prefill-first`` (vLLM v0): a step is either a prefill of newly admitted requests or a decode step of
  all running ones; admission wins whenever a waiting request fits.
  ``chunked-prefill`` (vLLM v1): every step decodes all running requests and spends the rest of the token
  budget on prefill chunks, FCFS. A chunk is priced with its attention over its prompt's tokens already in the
  KV cache (earlier chunks, cached prefix blocks; :meth:`CostModel.prefill_context_time`), so the chunks of one
  prompt cost the whole prompt plus one pass's fixed seconds per further chunk.
- The prefill pass emits the first output token. A decode step asks the policy for k_i per request,
  costs draft + verification + overhead (:func:`policies.step_time.predict_step_seconds`), draws accepted
  a_i in [0, k_i] from the acceptance model and appends min(a_i + 1, tokens still needed) tokens. Where the cost
  model measured draft passes of several tokens per sequence (``prices_catchup``), the step's first draft pass
  is priced at what it feeds by the modelled engine's rule (the cost model's ``draft_extend``,
  :func:`policies.protocol.draft_feed`: the tokens each request's draft has not seen, or vLLM V1's accepted tokens and
  bonus, or every verified token; :func:`policies.step_time.catchup_step_seconds`); those feeds are kept step by step
  (no runs of steps then).

Runs of steps (the fast path, fenced in :mod:`simulator.core.runs`): for a stationary policy the engine
simulates several decode steps of an unchanged batch in one event, the same steps at the same times; so does an
adaptive policy with a plain-Python stepper (goodput in batch mode), each step asked and told as step by step.

vLLM's serving around the steps, each switched by its config field (all off by default, where the engine is the
profile's own):

- the front end (the profile's ``frontend`` seconds per request, :meth:`CostModel.frontend_time`): requests reach the
  engine through one server that handles them one at a time (an API server's HTTP parsing and tokenization in one
  event loop) and hands over what it has handled when it runs out of work: a burst sent at once reaches the engine
  together, after the whole burst was handled (what vLLM's public benchmark results show: with 640 prompts sent at
  t = 0 no first token comes back before 1.4 s, and then in prefill-sized groups). Arrivals that keep coming faster
  than one per ``frontend`` seconds keep the front end busy, and nothing reaches the engine until they pause: an
  API server overloaded for good, which a run at that rate should show as the collapse it is;
- the client's ``max_concurrency`` (``vllm bench serve --max-concurrency``): a closed loop, at most that many
  requests in flight; a request waits for a finish before it is sent, and its latency counts from sending;
- multi-step scheduling (``num_scheduler_steps`` n > 1, vLLM v0): the decode batch runs n steps per scheduling
  (:meth:`SimulatedEngine._multi_step`), its tokens streamed at the chunk's end as one chunk, admissions between
  chunks only;
- automatic prefix caching (``enable_prefix_caching``, :mod:`simulator.core.prefix_cache`): an admitted request's
  leading full prompt blocks already cached are held, not computed, and its prefill computes only the rest, priced
  with its attention over the cached tokens;
- CUDA-graph padding (``cuda_graph_sizes``) is the cost model's (:mod:`simulator.costs.cuda_graphs`).

Two hooks for disaggregated prefill and decode (:mod:`simulator.fleet.disagg`; unset, nothing changes): a prefill
instance (:attr:`SimulatedEngine.handoff` set) hands each request whose prefill completed (first token emitted) to a
callback, still holding its KV blocks until :meth:`SimulatedEngine.release_handoff`, instead of decoding it; a decode
instance takes requests already prefilled through :meth:`SimulatedEngine.receive_prefilled` straight into its decode
batch.

Bookkeeping: ``ctx`` = tokens in a running request's KV cache before the next decode step
= prompt + generated - 1 (the newest token enters the cache in the pass that verifies the next ones).
A mixed chunked step costs its decode part plus its prefill part (an additive approximation: one fixed
per-pass cost too many). Times are seconds of simulated time; tokens are counts.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import simpy

from policies.base import BatchView, Policy, StepOutcome
from policies.protocol import admit_fcfs, checked_proposal, draft_feed, lookahead
from policies.step_time import catchup_step_seconds, predict_step_seconds, predict_tree_seconds, uniform_memo
from policies.tree import TreeFamily
from policies.errors import UserError
from simulator.core import runs
from simulator.core.memory import KVLayout
from simulator.core.prefix_cache import PrefixCache, prompt_keys
from simulator.core.runs import BatchLoad, DecodeRuns
from simulator.costs.cost_model import CostModel
from simulator.inputs.acceptance import AcceptanceModel
from simulator.inputs.workload import Workload
from simulator.metrics import Recorder


@dataclass(frozen=True, kw_only=True)
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
    strict_fit: bool = False
    """A request that can never fit in the KV cache stops the run (True) or is ignored (False, vLLM's way)."""
    scheduler_steps: int = 1
    """Decode steps per scheduling (vLLM v0's ``--num-scheduler-steps``; 1: every step scheduled)."""
    prefix_caching: bool = False
    """vLLM's ``--enable-prefix-caching`` (:mod:`simulator.core.prefix_cache`)."""
    max_concurrency: int | None = None
    """The client sends at most this many requests at a time (``vllm bench serve --max-concurrency``; None: no
    limit)."""
    kv: KVLayout | None = None
    """How a request's blocks follow its tokens when some layers slide (:mod:`simulator.core.memory`); None: every
    layer holds every token, ceil(tokens / block_size) blocks (the fast path)."""
    tree: TreeFamily | None = None
    """Token trees (:mod:`policies.tree`; None: chains, also for a tree that is a chain): a proposal of k verifies
    ``tree.shape(k)``, priced by the step formula's tree form and accepted by the acceptance model's
    ``draw_tree``."""


@dataclass(slots=True, eq=False)
class Prefill:
    """A request being prefilled (compared by identity)."""

    rid: int
    done: int
    """Tokens already prefilled."""
    total: int
    """Tokens to prefill: prompt + generated before a preemption."""
    blocks: int
    """KV blocks held."""


class SimulatedEngine(DecodeRuns):
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
        self.kv = spec.kv if spec.kv is not None else KVLayout(spec.block_size)
        """Blocks per request (:class:`simulator.core.memory.KVLayout`)."""
        self.windowed = self.kv.windowed
        """The one switch between the fast path (False: no sliding-window layers) and the general one."""
        self.pages: dict[int, int] = {}
        """The general path's blocks of tokens each decoding request has allocated in every layer (vLLM keeps a
        request's blocks, a step's unused lookahead slots included; only a window's passing frees any)."""
        if self.windowed and spec.prefix_caching:
            raise UserError("--enable-prefix-caching: prefix caching over sliding-window layers (their cached blocks "
                            "freed as the window passes) is not modelled")
        self.unfit: set[int] = set()
        """Requests that can never fit in the KV cache: ignored, never queued."""
        self._check_fits()
        n = len(workload)
        self.prompt: list[int] = workload.prompt_list  # read-only, one list for every engine of the workload
        self.output: list[int] = workload.output_list
        self.generated = [0] * n
        """Output tokens of each request not decoding now (a running one's is output - left)."""
        self.waiting: deque[int] = deque()
        self.arrived = 0
        """Requests that reached the engine's queue (after the front end), or were ignored."""
        self._wake: simpy.Event | None = None
        self.frontend = cost_model.frontend_time()
        """Seconds the front end spends on each request before the engine sees it (module docstring; 0: none)."""
        self._frontend_queue: deque[int] = deque()
        self._frontend_wake: simpy.Event | None = None
        self.in_flight = 0
        """Requests sent and not finished (counted only with ``max_concurrency``)."""
        self._slot: simpy.Event | None = None
        if spec.max_concurrency is not None:  # sending may come later than the workload's time: the record moves
            recorder.arrival_time = np.array(recorder.arrival_time, dtype=np.float64)
        self.free_blocks = spec.num_gpu_blocks
        self.cache = PrefixCache(spec.num_gpu_blocks, spec.block_size) if spec.prefix_caching else None
        """The prefix cache (None: off). ``free_blocks`` stays the engine's count; the cache is synced to it."""
        self.prompt_keys = prompt_keys(workload, spec.block_size) if spec.prefix_caching else None
        """Request id -> its prompt's block keys (:func:`simulator.core.prefix_cache.prompt_keys`; prefix caching)."""
        self.load = BatchLoad(spec.max_num_seqs)
        """The decode steps by batch size (:class:`simulator.core.runs.BatchLoad`)."""
        self.prefilling: list[Prefill] = []
        self.handoff: Callable[[int, int], None] | None = None
        """Prefill-only mode (a disaggregated prefill instance, :mod:`simulator.fleet.disagg`): set, a request whose
        prefill completed (first token emitted) with tokens still to emit leaves through ``handoff(rid, blocks)``,
        holding its ``blocks`` KV blocks (its KV being sent) until :meth:`release_handoff`; None: it joins the decode
        batch."""
        self.handed_blocks = 0
        """KV blocks held by handed-off requests whose KV is still being sent (prefill-only mode)."""
        self.prefilled: deque[int] = deque()
        """Requests received with their KV and first token (:meth:`receive_prefilled`; a disaggregated decode
        instance), waiting for a seat and blocks to join the decode batch, first come first served."""
        # The decode batch, in admission order (newest last), as parallel lists of ints: at serving batch sizes
        # (tens) plain Python beats small numpy calls several times over; the numpy paths convert.
        self.rid: list[int] = []
        self.ctx: list[int] = []
        self.left: list[int] = []
        self.blocks: list[int] = []
        # Speculative outcome of each running request since it joined the batch (proposed, accepted emitted,
        # speculative steps, tokens emitted by them), handed to the recorder when it leaves (speed shortcut: plain
        # Python adds per step instead of the recorder's numpy adds; integer sums, so the same totals).
        self.totals: list[list[int]] = []
        self._observes = type(policy).observe is not Policy.observe
        """Whether the policy learns from outcomes (else no StepOutcome is built; speed shortcut)."""
        self._match = _Uniforms(ngram_rng)
        self._by_count = _by_count(policy) if runs.BY_COUNT else None
        """The policy's ``k_by_count`` when it proposes one k for everyone by the running count alone (speed
        shortcut, see runs.BY_COUNT), else None."""
        self.catchup = spec.speculative and spec.draft_proposer and getattr(cost_model, "prices_catchup", False)
        """Whether each step's first draft pass is priced at the draft's lag (the cost model measured draft passes of
        several tokens per sequence; :func:`policies.step_time.catchup_step_seconds`). The lags are kept per request,
        step by step: no runs of steps then."""
        self.lag: dict[int, int] = {}
        """Tokens the draft's first pass feeds each running request at its next step (:func:`policies.protocol.draft_feed`
        by the cost model's ``draft_extend``; absent: 1, as after its prefill). Kept only when :attr:`catchup`."""
        self.tree = spec.tree if spec.speculative else None
        """The token-tree family (``EngineSpec.tree``), None for chains: today's path."""
        self._step_prices, self._steppers = {}, {}
        # the front end, the client's closed loop and multi-step chunks move arrivals and steps off the workload's
        # clock that the runs of steps read ahead: step by step then (every speed shortcut off)
        stepwise = (spec.run_steps <= 1 or self.catchup or self.frontend > 0 or spec.max_concurrency is not None
                    or spec.scheduler_steps > 1 or self.windowed)
        # n-gram lookups hit or miss step by step, so only a draft model (or no speculation) runs steps together
        self.runs = (not stepwise and getattr(policy, "stationary", False) and not spec.chunked_prefill
                     and (spec.draft_proposer or not spec.speculative) and self.tree is None)
        # an adaptive policy with a plain stepper: runs of per-step steps (speed shortcut, see runs.PLAIN_RUNS)
        self.plain_runs = (runs.PLAIN_RUNS and not self.runs and not stepwise and not spec.chunked_prefill
                           and getattr(policy, "steps_plain", False) and not recorder.keeps_steps
                           and (self.tree is None or getattr(policy, "trees_plain", False)))
        # a stationary policy that learns nothing, with n-gram proposals or under chunked prefill (no block-drawn
        # run for it): runs of per-step steps with its proposal asked once a run (speed shortcut, runs.STEP_RUNS)
        self.step_runs = (runs.STEP_RUNS and not stepwise and getattr(policy, "stationary", False)
                          and not self._observes and not recorder.keeps_steps
                          and (spec.chunked_prefill or not self.runs))

    # -- set-up ---------------------------------------------------------------------------------
    def _check_fits(self) -> None:
        """A request whose whole context cannot fit in the cache would be preempted forever. Like vLLM, ignore
        it (``self.unfit``: never queued, recorded as ignored) and serve the rest; with ``strict_fit``, or when
        no request fits at all, refuse the run naming the count and the first such request."""
        s = self.spec
        need = self.kv.most(self.workload.prompt_tokens + self.workload.output_tokens,
                            lookahead(s.max_k, s.speculative))
        unfit = need > s.num_gpu_blocks
        if not unfit.any():
            return
        ids = np.flatnonzero(unfit)
        first = int(ids[0])
        what = (f"{ids.size} of {len(need)} requests can never fit in the KV cache ({s.num_gpu_blocks} blocks of "
                f"{s.block_size} tokens, --num-gpu-blocks); the first, request {first}, needs {int(need[first])} "
                f"blocks (prompt {int(self.workload.prompt_tokens[first])} + output "
                f"{int(self.workload.output_tokens[first])} tokens)")
        if s.strict_fit:
            raise UserError(f"workload: {what} (--strict-fit refuses them; without it they are ignored)")
        if ids.size == len(need):
            raise UserError(f"workload: {what}: every request, nothing to serve")
        self.unfit = set(ids.tolist())
        self.rec.ignore(ids)

    def start(self, own_arrivals: bool = True) -> None:
        """Start the engine's processes. ``own_arrivals`` False is the fleet hook (:mod:`simulator.fleet`): no arrival
        process of its own; requests come through :meth:`receive`, and whoever feeds them keeps :attr:`arrived` the
        count of the *whole workload's* requests that have arrived (anywhere), which bounds the runs of steps
        (:mod:`simulator.core.runs`) at the next arrival of the workload and ends :meth:`_serve` after the last."""
        if own_arrivals:
            self.env.process(self._arrivals())
        if self.frontend > 0:
            self.env.process(self._frontend())
        self.server = self.env.process(self._serve())
        """The serving process (a fleet's replica interrupts it to cut a run short, :mod:`simulator.fleet.fleet`)."""

    # -- processes ------------------------------------------------------------------------------
    def _arrivals(self):
        env = self.env
        unfit = self.unfit
        limit = self.spec.max_concurrency
        for rid, t in enumerate(self.workload.arrival_time.tolist()):
            if t > env.now:
                yield env.timeout(t - env.now)
            if unfit and rid in unfit:
                self.arrived += 1
                continue  # ignored: never queued (vLLM's FINISHED_IGNORED)
            if limit is not None:
                while self.in_flight >= limit:  # the client's closed loop: wait for a finish
                    self._slot = env.event()
                    yield self._slot
                self.in_flight += 1
                self.rec.arrival_time[rid] = env.now  # sent now: latency counts from here, as vLLM's client
            self.arrive(rid)

    def arrive(self, rid: int) -> None:
        """Request ``rid`` is sent to the engine now: to its front end, if it has one, else to its queue. The fleet's
        dispatcher sends a routed request here too."""
        if self.frontend > 0:
            self._frontend_queue.append(rid)
            if self._frontend_wake is not None and not self._frontend_wake.triggered:
                self._frontend_wake.succeed()
        else:
            self._enqueue([rid])

    def receive(self, *rids: int) -> None:
        """Requests reach the waiting queue now (the engine is woken if idle). The fleet hook too (:meth:`start` with
        ``own_arrivals`` False: handed over by a router; :attr:`arrived` is the feeder's to keep)."""
        self.waiting.extend(rids)
        self._wake_up()

    def _wake_up(self) -> None:
        """Wake the engine if it sleeps (:meth:`_sleep`)."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _sleep(self):
        """Wait until :meth:`_wake_up` (an arrival, or a hand-off's blocks given back)."""
        self._wake = self.env.event()
        yield self._wake
        self._wake = None

    def _enqueue(self, rids: list[int]) -> None:
        """Requests of the engine's own arrivals (through the front end, if any) reach its waiting queue."""
        self.arrived += len(rids)
        self.receive(*rids)

    def _frontend(self):
        """The front end (module docstring): handles its queue one request at a time, :attr:`frontend` seconds each,
        and hands what it handled to the engine when its queue runs dry."""
        env = self.env
        while True:
            if not self._frontend_queue:
                self._frontend_wake = env.event()
                yield self._frontend_wake
                self._frontend_wake = None
            handled = []
            while self._frontend_queue:
                handled.append(self._frontend_queue.popleft())
                yield env.timeout(self.frontend)
            self._enqueue(handled)

    def _finish(self, rid: int, now: float) -> None:
        """Record a request's last token; with ``max_concurrency``, its place in flight goes to the next one."""
        self.rec.finish(rid, now)
        if self.spec.max_concurrency is not None:
            self.in_flight -= 1
            if self._slot is not None and not self._slot.triggered:
                self._slot.succeed()

    def _serve(self):
        n = len(self.workload)
        while True:
            if self.prefilled:
                self._admit_prefilled()
            if not self.waiting and not self.prefilling and not self.rid:
                if self.arrived == n:
                    return
                yield from self._sleep()
                continue
            if self.spec.chunked_prefill:
                # no prefill under way and nobody can be admitted (none waits, or no seat): a chunked step is a
                # decode step, so runs of them (runs.STEP_RUNS) take the per-step steps in one event
                if (self.step_runs and self.rid and not self.prefilling
                        and (not self.waiting or len(self.rid) >= self.spec.max_num_seqs)):
                    yield from self._plain_run(stationary=True)
                else:
                    yield from self._chunked_step()
            elif self._admit_prefill():
                yield from self._prefill_step()
            elif not self.rid and self.handed_blocks:  # prefill-only: the queue waits for blocks still being sent
                yield from self._sleep()
            elif self.spec.scheduler_steps > 1:
                yield from self._multi_step()
            elif self.runs:
                yield from self._decode_run()
            elif self.plain_runs:
                yield from self._plain_run()
            elif self.step_runs:
                yield from self._plain_run(stationary=True)
            else:
                yield from self._decode_step()

    # -- prefill-first --------------------------------------------------------------------------
    def _admit_prefill(self) -> bool:
        """Move waiting requests that fit (seats, token budget, blocks) into ``prefilling``; FCFS, no skipping
        (:func:`policies.protocol.admit_fcfs`, as the real engine admits). A prompt longer than the budget is
        admitted alone (vLLM v0 would need the budget raised)."""
        s = self.spec
        cache = self.cache
        if cache is not None:
            return self._admit_prefill_cached(cache)

        def tokens_of(rid: int) -> int:
            return self.prompt[rid] + self.generated[rid]

        def reserve(rid: int, tokens: int) -> bool:
            blocks = self.kv.blocks(0, tokens)
            if blocks > self.free_blocks:
                return False
            self.free_blocks -= blocks
            self.prefilling.append(Prefill(rid, 0, tokens, blocks))
            return True

        admit_fcfs(self.waiting, s.max_num_seqs - len(self.rid), s.max_num_batched_tokens, tokens_of, reserve)
        return bool(self.prefilling)

    def _admit_prefill_cached(self, cache: PrefixCache) -> bool:
        """:meth:`_admit_prefill` with prefix caching: a request's cached leading blocks skip prefill (its entry
        starts ``done`` at them) and count neither in the token budget nor, when held by another, in free blocks."""
        s = self.spec
        bs = s.block_size
        cache.sync(self.free_blocks)
        hits: dict[int, int] = {}

        def tokens_of(rid: int) -> int:  # tokens to compute: the uncached ones
            tokens = self.prompt[rid] + self.generated[rid]
            hits[rid] = cache.hit_blocks(self._hashes(rid), tokens)
            return tokens - hits[rid] * bs

        def reserve(rid: int, _new_tokens: int) -> bool:
            tokens = self.prompt[rid] + self.generated[rid]
            hashes, hit = self._hashes(rid), hits[rid]
            blocks = -(-tokens // bs)
            if cache.touch_cost(hashes, hit) + blocks - hit > self.free_blocks:
                return False
            cache.acquire(rid, hashes, hit, tokens)
            cache.take(blocks - hit)
            cache.register(rid, tokens)  # scheduled: its full prompt blocks are cached now (vLLM v1)
            self.free_blocks = cache.free_blocks
            self.prefilling.append(Prefill(rid, hit * bs, tokens, blocks))
            return True

        admit_fcfs(self.waiting, s.max_num_seqs - len(self.rid), s.max_num_batched_tokens, tokens_of, reserve)
        return bool(self.prefilling)

    def _hashes(self, rid: int) -> Sequence[int]:
        """Block keys of request ``rid``'s prompt (prefix caching)."""
        return self.prompt_keys(rid)

    def _release(self, rid: int, blocks: int) -> None:
        """Request ``rid`` gives back its ``blocks`` KV blocks (finished or preempted)."""
        self.pages.pop(rid, None)
        cache = self.cache
        if cache is None:
            self.free_blocks += blocks
            return
        cache.sync(self.free_blocks)
        cache.release(rid, blocks)
        self.free_blocks = cache.free_blocks

    def _prefill_step(self):
        chunks = [(entry, entry.total - entry.done) for entry in self.prefilling]
        seconds = self._prefill_seconds(chunks) + self.cost.prefill_overhead_time(len(chunks))
        start = self.env.now
        yield self.env.timeout(seconds)
        self.rec.step(start, seconds, "prefill", len(chunks), sum(c for _, c in chunks),
                      self.spec.num_gpu_blocks - self.free_blocks, len(self.waiting))
        self._finish_prefills(chunks)

    # -- chunked prefill ------------------------------------------------------------------------
    def _chunked_step(self, proposed: list[int] | None = None):
        s = self.spec
        decoding = bool(self.rid)
        if decoding:
            if proposed is None:
                proposed = self._propose()
            self._reserve_decode_blocks(proposed)
            proposed = proposed[: len(self.rid)]
        budget = s.max_num_batched_tokens - (sum(proposed) + len(self.rid) if decoding else 0)
        chunks = self._plan_chunks(max(budget, 0))
        if not self.rid and not chunks:
            if self.handed_blocks:  # prefill-only: the queue waits for blocks still being sent
                yield from self._sleep()
                return
            raise RuntimeError("scheduler stalled: nothing to run")  # impossible after _check_fits
        # predict_step_seconds includes the step's overhead; a prefill-only step pays its own
        seconds = self._decode_seconds(proposed) if self.rid else self.cost.prefill_overhead_time(len(chunks))
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

    def _plan_chunks(self, budget: int) -> list[tuple[Prefill, int]]:
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
        cache = self.cache
        while self.waiting and seats > 0 and budget > 0:
            rid = self.waiting[0]
            total = self.prompt[rid] + self.generated[rid]
            if cache is None:
                entry = Prefill(rid, 0, total, 0)
            else:  # its cached leading blocks: held at once, never computed
                cache.sync(self.free_blocks)
                hashes = self._hashes(rid)
                hit = cache.hit_blocks(hashes, total)
                entry = Prefill(rid, hit * s.block_size, total, hit)
                room = (hit + self.free_blocks - cache.touch_cost(hashes, hit)) * s.block_size - entry.done
                if min(total - entry.done, budget, room) <= 0:
                    break
                cache.acquire(rid, hashes, hit, total)
                self.free_blocks = cache.free_blocks
            chunk = self._grow_chunk(entry, budget)
            if chunk == 0:
                break
            self.waiting.popleft()
            self.prefilling.append(entry)
            chunks.append((entry, chunk))
            budget -= chunk
            seats -= 1
        return chunks

    def _grow_chunk(self, entry: Prefill, budget: int) -> int:
        """Reserve blocks for the next chunk of ``entry`` (at most ``budget`` tokens); return its size (0: no room)."""
        done, total, held = entry.done, entry.total, entry.blocks
        room = self.kv.room(held, self.free_blocks, done)  # tokens that fit in held + free blocks
        chunk = min(total - done, budget, room)
        if chunk <= 0:
            return 0
        need = self.kv.blocks(done, done + chunk) - held
        self.free_blocks -= need
        entry.blocks += need
        if self.cache is not None:  # scheduled: its full prompt blocks in this chunk are cached now (vLLM v1)
            self.cache.sync(self.free_blocks)
            self.cache.register(entry.rid, done + chunk)
        return chunk

    # -- shared pieces --------------------------------------------------------------------------
    def _prefill_seconds(self, chunks) -> float:
        """The prefill passes of ``chunks`` (target, and the draft model's own when it speculates), each chunk priced
        with its attention over what its sequence holds in the KV cache already (``Prefill.done``: its earlier chunks,
        or its cached prefix blocks; :meth:`CostModel.prefill_chunks_time`)."""
        shapes = [(chunk, entry.done) for entry, chunk in chunks]
        seconds = self.cost.prefill_chunks_time(shapes)
        if self.spec.draft_proposer and self.spec.speculative:
            seconds += self.cost.prefill_chunks_time(shapes, role="draft")
        return seconds

    def _finish_prefills(self, chunks) -> None:
        """Advance chunks; requests whose prefill completed emit their first token and join the decode batch."""
        now = self.env.now
        for entry, chunk in chunks:
            entry.done += chunk
            if entry.done == entry.total:
                self.prefilling.remove(entry)
                rid, tokens, blocks = entry.rid, entry.total, entry.blocks  # tokens: prompt + generated before a preemption
                self.rec.first_token(rid, now)
                self.generated[rid] += 1
                left = self.output[rid] - self.generated[rid]
                if left == 0:
                    self._release(rid, blocks)
                    self._finish(rid, now)
                    continue
                if self.handoff is not None:  # prefill-only: it leaves, holding its blocks while its KV is sent
                    self.handed_blocks += blocks
                    self.handoff(rid, blocks)
                    continue
                self._join(rid, tokens, left, blocks)

    def _join(self, rid: int, tokens: int, left: int, blocks: int) -> None:
        """Request ``rid`` joins the decode batch: ``tokens`` in its KV cache (prompt + generated - 1) in ``blocks``
        blocks, ``left`` tokens still to emit."""
        if self.generated[rid] == 1:  # not after a recompute: the request keeps its acceptance state
            self.acceptance.start(rid)
        self.rid.append(rid)
        self.ctx.append(tokens)
        self.left.append(left)
        self.blocks.append(blocks)
        self.totals.append([0, 0, 0, 0])

    # -- disaggregated prefill and decode (simulator.fleet.disagg) ------------------------------
    def release_handoff(self, rid: int, blocks: int) -> None:
        """Prefill-only mode: handed-off request ``rid``'s KV has been sent; its ``blocks`` are free again (vLLM's
        prefill instance frees a request's blocks once the decode instance has read them)."""
        self.handed_blocks -= blocks
        self._release(rid, blocks)
        self._wake_up()

    def receive_prefilled(self, rid: int) -> None:
        """A disaggregated decode instance receives request ``rid`` with its prompt's KV in place and its first token
        emitted (by a prefill instance); it joins the decode batch at the next step boundary (:meth:`_admit_prefilled`).
        Its arrival is not counted in :attr:`arrived`: a decode instance's process never ends by that count, and the
        environment's run ends when no event is left."""
        self.generated[rid] = 1
        self.prefilled.append(rid)
        self._wake_up()

    def _admit_prefilled(self) -> None:
        """Received requests (:attr:`prefilled`) join the decode batch first come first served while a seat
        (``max_num_seqs``) and the blocks of their prompt's KV are free; none joins while a request preempted here waits
        to be recomputed (it came earlier). The rest wait in the queue."""
        seats = self.spec.max_num_seqs - len(self.rid) - len(self.prefilling)
        while self.prefilled and seats > 0 and not self.waiting:
            rid = self.prefilled[0]
            tokens = self.prompt[rid]  # prompt + generated - 1, generated = 1
            blocks = self.kv.blocks(tokens, tokens)
            if blocks > self.free_blocks:
                return
            self.prefilled.popleft()
            self.free_blocks -= blocks
            self._join(rid, tokens, self.output[rid] - 1, blocks)
            seats -= 1

    def _propose(self) -> list[int]:
        """Ask the policy for k per running request, validate it, and apply the n-gram lookup's misses."""
        values = self._asked()
        if not self.spec.draft_proposer and any(values):
            p = self.spec.ngram_match_prob
            values = [k if u < p else 0 for k, u in zip(values, self._match.take(len(values)))]
        return values

    def _asked(self) -> list[int]:
        """The policy's validated k per running request (before the n-gram lookup's misses)."""
        if self._by_count is not None:  # one k by the running count (speed shortcut, runs.BY_COUNT; tested)
            k = self._by_count(len(self.rid), self.spec.max_k)
            if 0 <= k <= self.spec.max_k:  # else propose's answer, refused by checked_proposal as it always is
                return [k] * len(self.rid)
        output = self.output
        generated = [output[r] - t for r, t in zip(self.rid, self.left)]
        view = BatchView(self.env.now, np.array(self.rid, dtype=np.int64), np.array(self.ctx, dtype=np.int64),
                         np.array(generated, dtype=np.int64), len(self.waiting), self.policy_cost, self.spec.max_k,
                         self.spec.draft_proposer, self.tree)
        return checked_proposal(self.policy.name, self.policy.propose(view), len(self.rid), self.spec.max_k)

    def _reserve_decode_blocks(self, proposed: list[int]) -> None:
        """Reserve the lookahead slots of this step, preempting newest requests while blocks run out."""
        if self.windowed:
            return self._reserve_windowed(proposed)
        bs = self.spec.block_size
        while True:
            # ceil((ctx + k + 1) / bs) blocks each (max(g, 0) written out: cheaper than a call per request)
            grow = [g if (g := (c + k + bs) // bs - b) > 0 else 0 for c, k, b in zip(self.ctx, proposed, self.blocks)]
            total = sum(grow)
            if total <= self.free_blocks:
                self.free_blocks -= total
                self.blocks = [b + g for b, g in zip(self.blocks, grow)]
                return
            self._preempt_newest()

    def _reserve_windowed(self, proposed: list[int]) -> None:
        """:meth:`_reserve_decode_blocks`, the general path: each request's blocks over its context and this step's
        k + 1 tokens (or more, allocated before) recounted (:meth:`simulator.core.memory.KVLayout.held`: fewer where
        the window has passed whole blocks)."""
        bs, pages, held_of = self.spec.block_size, self.pages, self.kv.held
        while True:
            allocated = [max(pages.get(r, 0), (c + k + bs) // bs) for r, c, k in zip(self.rid, self.ctx, proposed)]
            held = [held_of(n, c) for n, c in zip(allocated, self.ctx)]
            grow = sum(held) - sum(self.blocks)
            if grow <= self.free_blocks:
                self.free_blocks -= grow
                self.blocks = held
                pages.update(zip(self.rid, allocated))
                return
            self._preempt_newest()

    def _preempt_newest(self) -> None:
        """Preempt by recompute: newest prefill first, else the newest decoding request (vLLM's order)."""
        now = self.env.now
        if self.prefilling:
            entry = self.prefilling.pop()
            rid = entry.rid
            self._release(rid, entry.blocks)
        else:
            rid = self.rid.pop()
            self.ctx.pop()
            self.generated[rid] = self.output[rid] - self.left.pop()
            self._release(rid, self.blocks.pop())
            self._record_spec(rid, self.totals.pop())
            self.policy.finish(rid)
            self.lag.pop(rid, None)  # recomputed from its prompt: the draft's prefill sees everything
        if not self.rid and not self.prefilling:
            raise RuntimeError("preempted the only request")  # impossible after _check_fits
        self.waiting.appendleft(rid)
        self.rec.preempt(rid, now)

    def _decode_seconds(self, proposed: list[int]) -> float:
        """Draft passes + verification + overhead of the decode batch (the policies' formula; with the catch-up
        priced where the cost model can, :attr:`catchup`)."""
        if self.tree is not None:  # every request's tree, by the formula's tree form
            lags = [self.lag.get(r, 1) for r, k in zip(self.rid, proposed) if k] if self.catchup else None
            return predict_tree_seconds(self.cost, self.ctx, [self.tree.shape(k) for k in proposed],
                                        self.spec.draft_proposer, lags)
        if self.catchup:
            return catchup_step_seconds(self.cost, self.ctx, proposed, [self.lag.get(r, 1) for r in self.rid])
        if runs.UNIFORM_STEPS and proposed.count(k := proposed[0]) == len(proposed):  # (speed shortcut, tested)
            batch, context = len(proposed), sum(self.ctx)
            seconds = uniform_memo(self.cost, batch, context, k, self.spec.draft_proposer)
            return self._uniform_pricer(batch, k)(context) if seconds is None else seconds
        return predict_step_seconds(self.cost, self.ctx, proposed, self.spec.draft_proposer)

    def _decode_step(self, proposed: list[int] | None = None):
        if proposed is None:
            proposed = self._propose()
        self._reserve_decode_blocks(proposed)
        proposed = proposed[: len(self.rid)]
        seconds = self._decode_seconds(proposed)
        start = self.env.now
        yield self.env.timeout(seconds)
        self._apply_decode(start, seconds, "decode", proposed, 0)

    def _multi_step(self):
        """One chunk of vLLM v0's multi-step scheduling (``--num-scheduler-steps`` n; vLLM 0.6): the decode batch is
        scheduled once and runs n steps, each priced by the step formula over the whole batch; the KV room of each
        request's next min(n, tokens left) tokens is reserved first (preempting newest as a step would). A request
        that emits its last token inside the chunk rides along to its end (its slot still computed, its tokens
        discarded); every request's tokens of the chunk reach the client together at the chunk's end, as one
        streamed chunk, and finished requests leave then. No speculation (vLLM 0.6 refused it with multi-step)."""
        env, n = self.env, self.spec.scheduler_steps
        self._reserve_decode_blocks([min(n, t) - 1 for t in self.left])  # ceil((c + min(n, t)) / bs) blocks each
        zeros = [0] * len(self.rid)
        delivered = [min(n, t) for t in self.left]
        for _ in range(n):
            start = env.now
            seconds = self._decode_seconds(zeros)
            yield env.timeout(seconds)
            self.load.add(len(zeros), (seconds,), 0)
            emitted = [1 if t else 0 for t in self.left]
            if self.rec.keeps_steps:
                self.rec.step(start, seconds, "decode", len(zeros), 0, self._blocks_used(), len(self.waiting),
                              *(np.array(x, dtype=np.int64) for x in (zeros, zeros, emitted)))
            else:
                self.rec.num_steps += 1
            self.ctx = [c + 1 for c in self.ctx]  # riders too: their discarded tokens are computed
            self.left = [t - e for t, e in zip(self.left, emitted)]
        for rid, tokens in zip(self.rid, delivered):
            self.rec.stream(rid, tokens)
        if 0 in self.left:
            self._retire(env.now)

    def _apply_decode(self, start: float, seconds: float, kind: str, proposed: list[int],
                      prefill_tokens: int) -> None:
        """Verification outcome: draw acceptances, append tokens, report to the policy, retire finished requests.
        Plain Python over the batch (at serving batch sizes, tens, it beats small numpy calls several times over)."""
        now = self.env.now
        rids, ctx, left = self.rid, self.ctx, self.left
        if any(proposed):
            accepted = (self.acceptance.draw_list(rids, proposed) if self.tree is None
                        else self.acceptance.draw_tree(rids, proposed, self.tree))
            emitted = [a + 1 if a < t else t for a, t in zip(accepted, left)]  # min(a + 1, t), t >= 1
            for k, a, e, totals in zip(proposed, accepted, emitted, self.totals):
                if k:
                    totals[0] += k
                    totals[1] += a if a < e else e  # accepted tokens emitted
                    totals[2] += 1
                    totals[3] += e
        else:
            accepted = proposed  # all zeros
            emitted = [1] * len(rids)  # every running request has a token left
        self.ctx = [c + e for c, e in zip(ctx, emitted)]
        self.left = [t - e for t, e in zip(left, emitted)]
        if self.catchup:
            lag = self.lag
            tree = self.tree
            rule = self.cost.draft_extend
            for r, k, a in zip(rids, proposed, accepted):  # a tree's lag by its depth (draft_feed)
                lag[r] = draft_feed(rule, lag.get(r, 1), k if tree is None else tree.shape(k).depth, a)
        if self.rec.keeps_steps:
            self.rec.step(start, seconds, kind, len(rids), prefill_tokens, self._blocks_used(), len(self.waiting),
                          *(np.array(x, dtype=np.int64) for x in (proposed, accepted, emitted)))
        else:
            self.rec.num_steps += 1  # Recorder.step without the step row (inlined: speed shortcut)
        self.load.add(len(rids), (seconds,), sum(proposed))
        if self._observes:
            self.policy.observe(StepOutcome(now, np.array(rids, dtype=np.int64), np.array(proposed, dtype=np.int64),
                                            np.array(accepted, dtype=np.int64), seconds))
        if 0 in self.left:
            self._retire(now)

    def _advance(self, emitted: list[int]) -> None:
        """Each running request emitted ``emitted[i]`` tokens (they enter its context)."""
        self.ctx = [c + e for c, e in zip(self.ctx, emitted)]
        self.left = [t - e for t, e in zip(self.left, emitted)]

    def _blocks_used(self) -> int:
        """KV blocks in use."""
        return self.spec.num_gpu_blocks - self.free_blocks

    def _retire(self, now: float) -> None:
        """Free the requests that have emitted all their tokens."""
        while 0 in self.left:
            i = self.left.index(0)
            rid = self.rid.pop(i)
            del self.ctx[i], self.left[i]
            self.generated[rid] = self.output[rid]
            self._release(rid, self.blocks.pop(i))
            self._record_spec(rid, self.totals.pop(i))
            self._finish(rid, now)
            self.acceptance.finish(rid)
            self.policy.finish(rid)
            self.lag.pop(rid, None)

    def _record_spec(self, rid: int, totals: list[int]) -> None:
        """Hand a leaving request's speculative totals (``self.totals``) to the recorder."""
        if totals[0]:
            self.rec.add_decode(rid, *totals)


def _by_count(policy: Policy):
    """``policy.k_by_count`` if the policy says that its :meth:`Policy.propose` is one k for every running request
    chosen by their count alone (``by_count``) and that ``propose`` is the one written beside ``k_by_count`` (not a
    subclass's), else None."""
    method = getattr(policy, "k_by_count", None)
    if method is None or not getattr(policy, "by_count", False):
        return None
    owner = next(c for c in type(policy).__mro__ if "k_by_count" in c.__dict__)
    return method if type(policy).propose is owner.__dict__.get("propose") else None


class _Uniforms:
    """Uniform [0, 1) draws of one generator handed out in order, drawn :attr:`BLOCK` at a time (speed shortcut:
    ``Generator.random`` fills element by element, so the values are those of draws of any size, bit for bit)."""

    BLOCK = 4096

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._buffer: list[float] = []
        self._used = 0

    def take(self, count: int) -> list[float]:
        end = self._used + count
        if end > len(self._buffer):
            rest = self._buffer[self._used:]
            self._buffer = rest + self._rng.random(max(self.BLOCK, count - len(rest))).tolist()
            self._used, end = 0, count
        out = self._buffer[self._used:end]
        self._used = end
        return out
