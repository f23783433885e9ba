"""A real serving engine: Hugging Face models served with continuous batching and speculative decoding,
driven by the simulator's policy objects and writing the simulator's per-request schema (DESIGN.md).

Scheduling is the simulator's ``prefill-first`` (vLLM v0) with no KV-block limit (so no preemption):
requests wait in a FCFS queue; a step either prefills newly admitted requests (at most ``max_num_seqs``
running, at most ``max_num_batched_tokens`` prompt tokens in the step, a longer prompt alone) or decodes
every running request. The prefill emits the first output token. Requests arrive on the wall clock: between
steps the engine queues those whose arrival time has passed, and sleeps while it has nothing to do. Times
are seconds since :meth:`RealEngine.run` started; outputs have exactly the workload's lengths (the end of
sequence token does not stop a request, as in vLLM's ``ignore_eos`` benchmarks).

A decode step asks the policy for k_i per request (a :class:`policies.base.BatchView` like the simulator's),
proposes up to k_i tokens per request, with the draft model (max k_i sequential draft passes over the whole
batch) or by n-gram prompt lookup (no model), and verifies all of them in one target pass over
sum_i (p_i + 1) tokens (p_i proposed). Lossless:

- greedy (``temperature`` 0): proposed tokens equal to the target's argmax are accepted up to the first
  mismatch, where the target's argmax is the correction token (after all p_i: the bonus token). The output
  is the target's greedy output.
- sampling: the rejection rule of Leviathan et al. (ICML 2023, Alg. 1) and Chen et al. (arXiv 2302.01318):
  a token x drafted from q is accepted with probability min(1, p(x) / q(x)); at the first rejection the
  next token is drawn from norm(max(0, p - q)); when all are accepted a bonus token is drawn from p at the
  next position. Each output token is then distributed as the target's p. An n-gram proposal is a draft q
  with all its mass on the proposed token. (:mod:`profiles.serving.rejection_sampler`.)

Token trees (``RealEngineConfig.tree``, vLLM's ``speculative_token_tree``) and EAGLE heads (``speculative_method``
eagle): a request's k maps to the family's k-node subtree (a chain of k without a tree); a proposer
(:class:`profiles.serving.draft_model.DraftModelTrees`, :class:`profiles.serving.eagle.EagleProposer`) drafts it one
depth per pass (:mod:`profiles.serving.token_tree`: greedy, the draft's top candidates; sampling, draws without
replacement), and one target pass verifies every request's root and tree with tree attention (each node attends to
its sequence's cache and its own ancestors, at the position of its depth). The greedy walk or recursive rejection
sampling over siblings (:mod:`profiles.serving.tree_sampler`) picks the accepted path, whose keys and values the
target keeps while the rest are dropped. A chain family with the draft model runs the chain code above; an EAGLE head
always runs the tree code (its chains are one-child trees), its drafts on the target's hidden states, which the
target's passes then hand on.

KV caches: one :class:`profiles.serving.kv.KVBatch` per model for the running batch, on the forward path of
``RealEngineConfig.forward``: ``eager`` (Hugging Face's cache, a padded rectangle compacted on every merge and
removal) or ``optimized`` (a preallocated slot per request written in place, CUDA graphs on a GPU; graph
capture is start-up work in a deployed engine, so the engine's clock stops while a graph is captured). A
step's rejected tokens are rolled back (:meth:`KVBatch.truncate`); finishing requests are dropped. Each request's newest token enters the target cache in
the pass that verifies the next ones (so ``context_lens`` = prompt + generated - 1, the simulator's
convention). The draft cache may lag further: a request's ``pending`` tokens are in its context but not yet
in the draft cache (the newest token, plus a fully accepted last draft token, plus every token of steps in
which nobody speculated); the first draft pass of a step feeds them all.

Speed probes (``probe`` given, ``RealEngineConfig.probe_every`` > 0): every ``probe_every`` seconds of the engine's
clock (skipped idle time, below, not counted), between steps, the engine calls ``probe()`` (validate times a few of
the cost profile's own points with it, so that the machine's speed is measured during the run, not only around it)
with its clock stopped: the run's timeline (arrivals, steps, latencies) is as if the probe had not run.

Idle skipping (``RealEngineConfig.skip_idle``; speed shortcut, validation turns it on): with no request waiting or
running, the engine moves its clock on to the next arrival instead of sleeping until it. Nothing runs while an
engine idles, so the run's timeline is the same; what differs is that the next pass follows the last one at once
(a deployed engine's first pass after a pause may find colder caches; the simulator does not model that either).
A CPU validation run at 0.3 requests/s idles about half of its wall time.

Timing twin (``acceptance`` given): the accept/reject decisions are drawn from one of the simulator's
acceptance models (:mod:`simulator.inputs.acceptance`) instead of comparing tokens: a_i accepted of the p_i
proposed, the next token the target's argmax after them. Every pass runs as in lossless mode, so the costs
are real, but the generated tokens are meaningless (the summary says so). This lets the timing be validated on
random-weight pairs of any size with the acceptance under control.

Costs. The step's parts are timed (wall seconds, ``time.perf_counter``): the draft passes (forward and
drawing the proposals), the verification (target forward, acceptance, rollback), the prefills; the rest of
the step is the engine's overhead. :mod:`profiles.engine_profile` times these same functions
(:class:`StepRunner`) to make the cost profile the simulator uses to predict this engine.
Differences from the simulator's cost formula: a draft pass runs the whole batch even when only the
requests with k_i >= j need pass j (the same for a uniform k); the first draft pass after a step without
speculation also feeds the draft the tokens it missed (the simulator prices that catch-up where the profile measured
draft passes of more than one token per sequence, :func:`policies.step_time.catchup_step_seconds`); and a
decode batch is a padded rectangle, so attention reads the longest request's width for every request (the
engine profile measures batches of unequal requests for that reason, :mod:`profiles.engine_profile`).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
from transformers import PreTrainedModel

from policies.base import BatchView, Policy, StepOutcome
from policies.tree import TreeFamily, TreeShape
from policies.protocol import admit_fcfs, checked_proposal, is_speculative, lookahead
from profiles.models import forward
from profiles.models.eagle_head import EagleHead
from profiles.models.optimized import FORWARDS
from profiles.serving.kv import KVBatch, make_kv_batch
from profiles.serving.draft_model import DraftModelTrees
from profiles.serving.eagle import EagleProposer
from profiles.serving.rejection_sampler import accept_greedy, accept_sampled, draw, probabilities
from profiles.serving.token_tree import DraftTree, TreeProposer, kept_tokens, path_of_depth, verification_block
from profiles.serving.tree_sampler import walk_greedy, walk_sampled
from simulator.config import SimConfig
from simulator.costs.cost_model import CostModel
from simulator.inputs.acceptance import AcceptanceModel, tree_family
from policies.errors import UserError
from simulator.metrics import Recorder, summarize
from simulator.inputs.workload import Workload

#: The speculative methods (vLLM's names) the real engine runs.
ENGINE_METHODS = ("draft_model", "eagle", "ngram")
#: Extra per-step columns of the engine: tokens in the running requests' contexts before a decode step (the
#: cost model's ``context_tokens``; 0 for a prefill), the target cache's slots then (batch size x width:
#: what attention reads, padding and rolled-back slots included), the step's timed target and draft work
#: (seconds), and the tokens its first draft pass fed (the catch-up, padded: batch size x the longest lag; 0
#: without draft passes).
PART_COLUMNS = ["context_tokens", "cache_slots", "target_seconds", "draft_seconds", "catchup_tokens"]


@dataclass(frozen=True)
class RealEngineConfig:
    """The engine's settings (vLLM terms; tokens, sequences).

    The serving fields are the simulator's (:class:`simulator.config.SimConfig`: ``max_num_seqs``,
    ``max_num_batched_tokens``, ``k`` as ``max_k``, ``proposer``, ``block_size``) and are checked by it, with its
    messages, so that a field means the same in both engines; :meth:`from_sim_config` builds one from a
    simulation's config. The rest are the real engine's own.
    """

    max_num_seqs: int = 8
    """At most this many running requests (``SimConfig.engine.max_num_seqs``)."""
    max_num_batched_tokens: int = 2048
    """Prompt tokens one prefill step may take, a longer prompt prefilled alone
    (``SimConfig.engine.max_num_batched_tokens``)."""
    max_k: int = 4
    """Bound on any request's proposal length, the policy's k (``SimConfig.speculative.k``)."""
    proposer: str = "draft"
    """``draft`` (a draft model or head) or ``ngram`` (prompt lookup) (``SimConfig.speculative.proposer``)."""
    speculative_method: str | None = None
    """vLLM's method (``SimConfig.speculative.speculative_method``; SGLang's names mapped): ``draft_model`` (the draft
    model), ``eagle`` (an EAGLE head, :mod:`profiles.serving.eagle`) or ``ngram``; None: as ``proposer`` says."""
    tree: TreeFamily | None = None
    """The token tree (:class:`policies.tree.TreeFamily`, as :func:`simulator.inputs.acceptance.tree_family` builds it
    from a simulation's config): a policy's k verifies ``tree.shape(k)``, k at most its nodes. None: chains of k. A
    chain family runs the chain code path."""
    block_size: int = 16
    """Tokens per KV block, only to report ``kv_blocks_used`` as the simulator does
    (``SimConfig.engine.block_size``)."""
    temperature: float = 0.0
    """0: greedy; > 0: sampling from softmax(logits / temperature) with the rejection rule."""
    ngram_min: int = 1
    """Shortest n-gram the prompt lookup matches."""
    ngram_max: int = 3
    """Longest n-gram the prompt lookup matches (tried first)."""
    forward: str = "eager"
    """Forward path: ``eager`` (Hugging Face as is) or ``optimized`` (in-place cache, CUDA graphs on a GPU)."""
    cuda_graphs: bool = True
    """On the optimized path on a GPU: replay captured CUDA graphs."""
    probe_every: float = 0.0
    """Seconds of the engine's clock between calls of the run's ``probe`` (its clock stopped meanwhile; skipped idle
    time not counted); 0: none."""
    skip_idle: bool = False
    """With nothing to serve, move the engine's clock on to the next arrival instead of sleeping until it (a
    validation shortcut: the timeline is the same, the wall time is only the busy time)."""

    def __post_init__(self) -> None:
        self.serving_config()  # the shared fields, checked as the simulator checks them
        if self.ngram_min < 1:
            raise UserError(f"engine: ngram_min must be >= 1 (got {self.ngram_min})")
        if self.forward not in FORWARDS:
            raise UserError(f"engine: forward must be one of {', '.join(FORWARDS)} (got {self.forward!r})")
        if not self.temperature >= 0:
            raise UserError(f"engine: temperature must be >= 0 (got {self.temperature})")
        if self.ngram_max < self.ngram_min:
            raise UserError(f"engine: ngram_max must be >= ngram_min (got {self.ngram_max} < {self.ngram_min})")
        if not self.probe_every >= 0:
            raise UserError(f"engine: probe_every must be >= 0 seconds (got {self.probe_every})")
        if self.method not in ENGINE_METHODS:
            raise UserError(f"engine: speculative_method {self.method} is simulated only; the real engine runs "
                            f"{', '.join(ENGINE_METHODS)}")
        if self.tree is not None:
            if self.proposer != "draft":
                raise UserError("engine: a token tree needs a model proposer (proposer=draft): an n-gram lookup "
                                "proposes one chain")
            if self.max_k > self.tree.num_nodes:
                raise UserError(f"engine: k={self.max_k} is more than the token tree's {self.tree.num_nodes} nodes")

    @property
    def method(self) -> str:
        """vLLM's name of the speculative method: ``speculative_method``, or ``proposer``'s."""
        config = self.serving_config()
        return config.speculative.proposer_method

    def serving_config(self, **fields: Any) -> SimConfig:
        """A simulator config with this engine's serving fields (and ``fields``)."""
        return SimConfig.of(**{"arrival": "poisson", "rate": 1.0, "num_requests": 1, **fields,
                               "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                               "k": self.max_k, "proposer": self.proposer, "block_size": self.block_size,
                               "speculative_method": self.speculative_method})

    @classmethod
    def from_sim_config(cls, config: SimConfig, **engine_only: Any) -> "RealEngineConfig":
        """The engine's settings for what ``config`` simulates (its serving fields, its method and token tree) and
        ``engine_only`` fields."""
        engine, spec = config.engine, config.speculative
        return cls(max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                   max_k=spec.k, proposer=spec.proposer, block_size=engine.block_size,
                   speculative_method=spec.speculative_method, tree=tree_family(spec), **engine_only)


@dataclass(frozen=True)
class EngineResult:
    """What a run produced. Times are seconds since the run started."""

    requests: pd.DataFrame
    """One row per request: :data:`simulator.metrics.REQUEST_COLUMNS` and the derived columns."""
    steps: pd.DataFrame
    """One row per step: :data:`simulator.metrics.STEP_COLUMNS` with measured ``seconds``, and
    :data:`PART_COLUMNS` (the step's timed target and draft work; the rest of ``seconds`` is overhead)."""
    acceptance: pd.DataFrame
    """One row per request and decode step: ``request_id,proposed,accepted`` (the replay format)."""
    outputs: list[list[int]]
    """Generated token ids of each request."""
    summary: dict


# -- proposals (pure functions) ----------------------------------------------------------------
def ngram_proposal(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup (Saxena, 2023; vLLM's ``ngram`` proposer): for n = n_max down to n_min, find the most
    recent earlier occurrence of the last n tokens and propose the (up to) k tokens that followed it;
    ``[]`` when no suffix recurs."""
    if k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


# -- the passes a step runs (timed by the engine profile) ------------------------------------------
class StepRunner:
    """The model work of the engine's steps: prefill, one draft pass, verification, on :class:`KVBatch` caches.
    Sampling draws from ``rng``. :mod:`profiles.engine_profile` times exactly these methods.
    """

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None, temperature: float,
                 rng: np.random.Generator) -> None:
        self.target, self.draft = target, draft
        self.temperature = temperature
        self.rng = rng

    def prefill(self, kv: KVBatch, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill each prompt in a pass of its own into new rows of ``kv``; the last positions' logits
        ``(b, vocab)``."""
        return kv.prefill(prompts)

    def first_tokens(self, logits: torch.Tensor) -> list[int]:
        """The token each prefilled prompt emits (argmax, or drawn from the target's distribution)."""
        if self.temperature == 0:
            return logits.argmax(dim=-1).tolist()
        return [draw(p, self.rng) for p in probabilities(logits, self.temperature)]

    def draft_pass(self, kv: KVBatch, tokens: list[list[int]],
                   proposing: np.ndarray) -> tuple[list[int], list[np.ndarray | None]]:
        """One draft pass: feed ``tokens[i]`` to sequence i and draw its next token (argmax, or from q where
        ``proposing[i]``); returns the tokens and, when sampling, q for the proposing sequences."""
        logits = kv.extend(tokens, all_logits=False)                          # (B, vocab)
        if self.temperature == 0:
            return logits.argmax(dim=-1).tolist(), [None] * len(tokens)
        q = probabilities(logits, self.temperature)
        drawn = [draw(q[i], self.rng) if proposing[i] else int(q[i].argmax()) for i in range(len(tokens))]
        return drawn, [q[i] if proposing[i] else None for i in range(len(tokens))]

    def verify(self, kv: KVBatch, last: list[int], proposals: list[list[int]], q: list[np.ndarray | None],
               decided: np.ndarray | None = None) -> tuple[list[int], list[int]]:
        """One target pass over ``[last[i]] + proposals[i]`` per sequence; the accepted count and the next
        token of each, with the rejected tokens rolled back from ``kv``. ``q[i]`` (sampling): the draft
        distributions of ``proposals[i]``, shape ``(len, vocab)``; ``None`` for an n-gram proposal.
        ``decided`` (timing twin): the accepted counts, drawn elsewhere; the next token is then the target's
        argmax after them."""
        before = kv.lengths()
        logits = kv.extend([[t] + p for t, p in zip(last, proposals)], all_logits=True)  # (B, q, vocab)
        accepted, tokens = [], []
        if decided is not None or self.temperature == 0:
            argmax = logits.argmax(dim=-1).tolist()
            for i, (row, proposal) in enumerate(zip(argmax, proposals)):
                if decided is None:
                    a, token = accept_greedy(proposal, row)
                else:
                    a = int(decided[i])
                    token = int(row[a])
                accepted.append(a)
                tokens.append(token)
        else:
            for i, proposal in enumerate(proposals):
                p = probabilities(logits[i, :len(proposal) + 1], self.temperature)
                qi = q[i]
                if qi is None:  # an n-gram proposal: all of q's mass on the proposed token
                    qi = np.zeros((len(proposal), p.shape[1]))
                    qi[np.arange(len(proposal)), proposal] = 1.0
                a, token = accept_sampled(proposal, p, qi, self.rng)
                accepted.append(a)
                tokens.append(token)
        kv.truncate([n + 1 + a for n, a in zip(before, accepted)])
        return accepted, tokens

    def verify_tree(self, kv: KVBatch, roots: list[int], trees: list[DraftTree], decided: list[int] | None = None,
                    features: bool = False) -> tuple[list[list[int]], list[int], list[torch.Tensor] | None]:
        """One target pass over each row's root (its newest token) and drafted tree, with tree attention
        (:func:`profiles.serving.token_tree.verification_block`); each row's accepted path (node indices) and the
        token after it (:mod:`profiles.serving.tree_sampler`), with every other tree token rolled back from ``kv``.
        ``decided`` (timing twin): accepted lengths drawn elsewhere: the path to the tree's first node of that depth,
        the next token the target's argmax after it. ``features``: also each row's final-normed target hidden states
        at its root and path nodes ``(1 + len(path), hidden)`` (a head's next inputs)."""
        held = kv.lengths()
        states = kv.extend_tree(verification_block(roots, trees, held))      # (B, q, hidden)
        logits = forward.logits(self.target, states)                          # (B, q, vocab)
        paths, tokens = [], []
        if decided is not None or self.temperature == 0:
            argmax = logits.argmax(dim=-1).tolist()
            for i, tree in enumerate(trees):
                if decided is None:
                    path, token = walk_greedy(tree, argmax[i])
                else:
                    path = path_of_depth(tree, int(decided[i]))
                    token = int(argmax[i][1 + path[-1] if path else 0])
                paths.append(path)
                tokens.append(token)
        else:
            for i, tree in enumerate(trees):
                path, token = walk_sampled(tree, probabilities(logits[i, :1 + tree.size], self.temperature), self.rng)
                paths.append(path)
                tokens.append(token)
        kv.keep(held, [kept_tokens(path, h) for path, h in zip(paths, held)])
        return paths, tokens, [states[i, [0] + [1 + n for n in path]] for i, path in enumerate(paths)] \
            if features else None


# -- the engine ----------------------------------------------------------------------------------
class RealEngine:
    """Serves a workload with real models; see the module docstring. One :meth:`run` per instance."""

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | None, config: RealEngineConfig,
                 policy: Policy, cost_model: CostModel | None, rng: np.random.Generator,
                 acceptance: AcceptanceModel | None = None, probe: Callable[[], Any] | None = None) -> None:
        """``cost_model``: what the policy's :class:`BatchView` offers (None for policies that need none, such as
        ``fixed-k``); ``rng``: the draws of sampling; ``acceptance``: the timing twin's accept/reject decisions
        (None: lossless, decided by the tokens); ``probe``: called every ``config.probe_every`` seconds of the
        engine's clock, the clock stopped (module docstring)."""
        self.config = config
        self.acceptance = acceptance
        self.probe = probe if config.probe_every > 0 else None
        self.policy = policy
        self.cost_model = cost_model
        self.speculative = is_speculative(policy.name, config.max_k)
        self.use_draft = self.speculative and config.proposer == "draft"
        self.method = config.method
        if self.use_draft and draft is None:
            raise UserError("engine: the draft proposer needs a draft model (or use proposer ngram)")
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise UserError(f"engine: the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                            f"target's ({target.config.vocab_size}); a draft must share the target's tokenizer")
        if self.use_draft and isinstance(draft, EagleHead) != (self.method == "eagle"):
            raise UserError(f"engine: speculative_method {self.method} needs "
                            f"{'an EAGLE head' if self.method == 'eagle' else 'a draft model, not an EAGLE head'}")
        self.family = config.tree
        # Trees, and every head's chain, go through the tree code; a draft model's chains through the chain code.
        self.tree_mode = self.use_draft and (self.method == "eagle" or (self.family is not None and
                                                                         not self.family.is_chain))
        self.features = self.tree_mode and self.method == "eagle"
        """Whether the target's passes hand their hidden states on (an EAGLE head's inputs)."""
        self.runner = StepRunner(target, draft if self.use_draft else None, config.temperature, rng)

    # -- checks --------------------------------------------------------------------------------
    def _check(self, workload: Workload, prompts: Sequence[Sequence[int]]) -> None:
        if len(prompts) != len(workload):
            raise UserError(f"engine: {len(prompts)} prompts for {len(workload)} requests")
        models = [self.runner.target] + ([self.runner.draft] if self.runner.draft is not None else [])
        limit = min(m.config.max_position_embeddings for m in models)
        vocab = self.runner.target.config.vocab_size
        extra = lookahead(self.config.max_k, self.speculative)
        for i, prompt in enumerate(prompts):
            if self.features and len(prompt) < 2:
                raise UserError(f"engine: request {i}: the EAGLE head needs prompts of at least 2 tokens (got "
                                f"{len(prompt)}): it reads the target's feature of each prompt position with the token "
                                "after it")
            if len(prompt) != workload.prompt_tokens[i]:
                raise UserError(f"engine: request {i}: prompt has {len(prompt)} tokens, the workload says "
                                f"{int(workload.prompt_tokens[i])}")
            need = len(prompt) + int(workload.output_tokens[i]) + extra
            if need > limit:
                raise UserError(f"engine: request {i}: prompt {len(prompt)} + output {int(workload.output_tokens[i])} "
                                f"+ lookahead {extra} tokens exceed the model's context of {limit} tokens")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise UserError(f"engine: request {i}: token ids must be in [0, {vocab}) "
                                f"(got {min(prompt)}..{max(prompt)})")

    # -- the loop ------------------------------------------------------------------------------
    def run(self, workload: Workload, prompts: Sequence[Sequence[int]]) -> EngineResult:
        """Serve ``workload`` (arrival times, lengths) with ``prompts[i]`` the token ids of request i."""
        self._check(workload, prompts)
        cfg = self.config
        n = len(workload)
        self.prompts = [list(map(int, p)) for p in prompts]
        self.output_len = workload.output_tokens
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.rec = Recorder(workload.arrival_time, workload.prompt_tokens, workload.output_tokens, save_steps=True)
        self.parts: list[tuple[int, int, float, float]] = []
        self.accept_rows: list[tuple[int, int, int]] = []
        self.waiting: deque[int] = deque()
        self.rids: list[int] = []
        self.pending: list[list[int]] = []
        longest = int((workload.prompt_tokens + workload.output_tokens).max()) if n else 0
        max_len = longest + 2 * lookahead(cfg.max_k, self.speculative)
        graphs = None if cfg.cuda_graphs else False  # None: graphs wherever the device has them
        self.target_kv = make_kv_batch(cfg.forward, self.runner.target, cfg.max_num_seqs, max_len, graphs)
        draft_model = self.runner.draft.model if self.method == "eagle" and self.use_draft else self.runner.draft
        self.draft_kv = make_kv_batch(cfg.forward, draft_model, cfg.max_num_seqs, max_len,
                                      graphs) if self.use_draft else None
        self.proposer: TreeProposer | None = None
        if self.tree_mode:
            self.proposer = EagleProposer(self.runner.draft, self.draft_kv, cfg.temperature, self.runner.rng) \
                if self.method == "eagle" else \
                DraftModelTrees(self.runner.draft, self.draft_kv, cfg.temperature, self.runner.rng)
        arrivals = workload.arrival_time.tolist()
        arrived = 0
        self._captured_before = self._captured()
        self._paused, self._skipped, probes, next_probe = 0.0, 0.0, 0, 0.0
        self._start = time.perf_counter()
        while self.rec.finished < n:
            step_start = self._now()
            busy = step_start - self._skipped  # the probes' clock: skipped idle time not counted
            if self.probe is not None and busy >= next_probe:
                paused = time.perf_counter()
                self.probe()
                self._paused += time.perf_counter() - paused
                probes, next_probe = probes + 1, busy + cfg.probe_every
                continue
            while arrived < n and arrivals[arrived] <= step_start:
                self.waiting.append(arrived)
                arrived += 1
            if not self.waiting and not self.rids:
                idle = max(arrivals[arrived] - step_start, 0.0)
                if cfg.skip_idle:  # speed shortcut (module docstring): the clock moves on, nothing sleeps
                    self._skipped += idle
                else:
                    time.sleep(idle)
                continue
            admitted = self._admit()
            if admitted:
                self._prefill_step(admitted, step_start)
            else:
                self._decode_step(step_start)
        requests = self.rec.requests_frame()
        steps = self.rec.steps_frame()
        steps[PART_COLUMNS] = pd.DataFrame(self.parts, columns=PART_COLUMNS)
        acceptance = pd.DataFrame(self.accept_rows, columns=["request_id", "proposed", "accepted"])
        summary = summarize(requests, self.rec.acceptance_length())
        summary.update({"policy": self.policy.name, "k": cfg.max_k, "steps": self.rec.num_steps,
                        "workload": workload.source, "temperature": cfg.temperature, "proposer": cfg.proposer,
                        "speculative_method": self.method,
                        "speculative_token_tree": None if self.family is None else str(self.family.full),
                        "forward": cfg.forward,
                        "graph_capture_seconds": round(self._captured() - self._captured_before, 3),
                        "probes": probes, "probe_seconds": round(self._paused, 3),
                        "idle_skipped_seconds": round(self._skipped, 3),
                        "tokens": ("meaningless: accept/reject drawn from the "
                                   f"{self.acceptance.name} acceptance model (timing twin)")
                        if self.acceptance is not None else "lossless"})
        return EngineResult(requests, steps, acceptance, self.outputs, summary)

    def _admit(self) -> list[int]:
        """Waiting requests to prefill now (:func:`policies.protocol.admit_fcfs`, as the simulator admits; no KV
        block limit here)."""
        cfg = self.config
        return admit_fcfs(self.waiting, cfg.max_num_seqs - len(self.rids), cfg.max_num_batched_tokens,
                          lambda rid: len(self.prompts[rid]), lambda rid, tokens: True)

    def _captured(self) -> float:
        """Seconds spent capturing CUDA graphs so far (start-up work; excluded from the engine's clock)."""
        return sum(kv.capture_seconds for kv in (self.target_kv, self.draft_kv) if kv is not None)

    def _now(self) -> float:
        """Seconds since the run started, graph capture and speed probes excluded, skipped idle time included (the
        steps' parts are timed on this clock too, so a pass that captured a graph counts only its replay)."""
        return time.perf_counter() - self._start - self._paused + self._skipped \
            - (self._captured() - self._captured_before)

    def _prefill_step(self, admitted: list[int], step_start: float) -> None:
        runner = self.runner
        prompts = [self.prompts[r] for r in admitted]
        t0 = self._now()
        features = None
        if self.features:
            features = self.target_kv.prefill_hidden(prompts)
            first = runner.first_tokens(runner.target.lm_head(torch.stack([f[-1] for f in features])))
        else:
            first = runner.first_tokens(runner.prefill(self.target_kv, prompts))
        t1 = self._now()
        if self.proposer is not None:
            self.proposer.prefill(prompts, first, features)
        elif self.use_draft:
            runner.prefill(self.draft_kv, prompts)
        t2 = self._now()
        for rid, token in zip(admitted, first):
            self.outputs[rid].append(token)
            if self.acceptance is not None:
                self.acceptance.start(rid)
        self.rids += admitted
        self.pending += [[self.outputs[r][-1]] for r in admitted]
        done = [len(self.rids) - len(admitted) + j for j, r in enumerate(admitted) if self.output_len[r] == 1]
        if done:
            self._retire(done)
        now = self._now()
        for rid in admitted:
            self.rec.first_token(rid, now)
            if self.output_len[rid] == 1:
                self.rec.finish(rid, now)
        self.rec.step(step_start, now - step_start, "prefill", len(admitted), sum(map(len, prompts)),
                      self._kv_blocks(), len(self.waiting))
        self.parts.append((0, 0, t1 - t0, t2 - t1, 0))

    def _propose_k(self, now: float, context: np.ndarray) -> np.ndarray:
        """The policy's k per running request (``context``: tokens in each one's KV cache), checked as the
        simulator checks it."""
        rids = np.asarray(self.rids, dtype=np.int64)
        generated = np.array([len(self.outputs[r]) for r in self.rids], dtype=np.int64)
        view = BatchView(now, rids, context, generated, len(self.waiting), self.cost_model, self.config.max_k,
                         self.config.proposer == "draft")
        return np.array(checked_proposal(self.policy.name, self.policy.propose(view), len(rids),
                                         self.config.max_k), dtype=np.int64)

    def _draft_proposals(self, k: np.ndarray) -> tuple[list[list[int]], list[np.ndarray | None], int]:
        """max k draft passes over the batch: proposals (``k[i]`` tokens each), their q (sampling), passes run."""
        passes = int(k.max())
        proposals: list[list[int]] = [[] for _ in self.rids]
        qs: list[list[np.ndarray]] = [[] for _ in self.rids]
        tokens = self.pending
        for j in range(1, passes + 1):
            drawn, q = self.runner.draft_pass(self.draft_kv, tokens, k >= j)
            for i, (token, qi) in enumerate(zip(drawn, q)):
                if k[i] >= j:
                    proposals[i].append(token)
                    if qi is not None:
                        qs[i].append(qi)
            tokens = [[t] for t in drawn]
        stacked = [np.stack(q) if q else None for q in qs]
        return proposals, stacked, passes

    def _decode_step(self, step_start: float) -> None:
        context = np.array([len(self.prompts[r]) + len(self.outputs[r]) - 1 for r in self.rids], dtype=np.int64)
        slots = self.target_kv.slots()
        k = self._propose_k(step_start, context) if self.speculative else np.zeros(len(self.rids), dtype=np.int64)
        t0 = self._now()
        speculate = self._tree_speculate if self.tree_mode else self._chain_speculate
        proposed, accepted, tokens, catchup, t1, t2 = speculate(k)
        acc = np.array([len(a) for a in accepted], dtype=np.int64)
        emitted = np.zeros(len(self.rids), dtype=np.int64)
        for i, rid in enumerate(self.rids):
            new = (accepted[i] + [tokens[i]])[:int(self.output_len[rid]) - len(self.outputs[rid])]
            self.outputs[rid] += new
            emitted[i] = len(new)
            if self.speculative:
                self.accept_rows.append((rid, int(proposed[i]), int(acc[i])))
        rids = np.asarray(self.rids, dtype=np.int64)
        if proposed.any():
            self.rec.decode(rids, proposed, np.minimum(acc, emitted), emitted)  # accepted tokens emitted
        done = [i for i, r in enumerate(self.rids) if len(self.outputs[r]) == self.output_len[r]]
        if done:
            self._retire(done)
        now = self._now()
        for i in done:
            self.rec.finish(int(rids[i]), now)
        self.rec.step(step_start, now - step_start, "decode", len(rids), 0, self._kv_blocks(), len(self.waiting),
                      proposed, acc, emitted)
        self.parts.append((int(context.sum()), slots, t2 - t1, t1 - t0, catchup))
        self.policy.observe(StepOutcome(now, rids, proposed, acc, now - step_start))
        for i in done:
            self.policy.finish(int(rids[i]))

    def _twin_draws(self, proposed: list[int], trees: bool) -> list[int] | None:
        """The timing twin's accepted counts (None: lossless), drawn only when someone proposed, as the simulated
        engine draws: on the same batches both take the same draws of one stream (validate's common random numbers);
        a tree's from the acceptance model's tree rule for the family's shapes (a chain family's as a chain's)."""
        if self.acceptance is None:
            return None
        if not any(proposed):
            return [0] * len(proposed)
        rids = np.asarray(self.rids, dtype=np.int64)
        if trees and self.family is not None and not self.family.is_chain:  # a chain draws as the simulator's
            return self.acceptance.draw_tree(rids.tolist(), proposed, self.family)
        return self.acceptance.draw(rids, np.asarray(proposed, dtype=np.int64)).tolist()

    def _chain_speculate(self, k: np.ndarray) -> tuple[np.ndarray, list[list[int]], list[int], int, float, float]:
        """A chain step (a draft model's k passes, or the n-gram lookup, then one verification): the tokens proposed,
        the accepted ones and the token after them per row, the catch-up tokens, and the times the drafting and the
        verification ended."""
        cfg = self.config
        passes = 0
        q: list[np.ndarray | None] = [None] * len(self.rids)
        catchup = 0
        if self.use_draft and k.any():
            draft_before = self.draft_kv.lengths()
            catchup = len(self.pending) * max(map(len, self.pending))
            proposals, q, passes = self._draft_proposals(k)
        elif cfg.proposer == "ngram" and k.any():
            proposals = [ngram_proposal(self.prompts[r] + self.outputs[r], int(ki), cfg.ngram_min, cfg.ngram_max)
                         for r, ki in zip(self.rids, k)]
        else:
            proposals = [[] for _ in self.rids]
        t1 = self._now()
        last = [self.outputs[r][-1] for r in self.rids]
        decided = self._twin_draws([len(p) for p in proposals], trees=False)
        accepted, tokens = self.runner.verify(self.target_kv, last, proposals, q, decided)
        t2 = self._now()
        if passes:
            # draft tokens 1..passes-1 were fed to the draft; keep the accepted ones, the rest are rolled back
            draft_keep = []
            for i in range(len(self.rids)):
                fed = min(accepted[i], passes - 1)
                draft_keep.append(draft_before[i] + len(self.pending[i]) + fed)
                self.pending[i] = proposals[i][fed:accepted[i]] + [tokens[i]]
            self.draft_kv.truncate(draft_keep)
        elif self.use_draft:
            for pending, token in zip(self.pending, tokens):
                pending.append(token)
        proposed = np.array([len(p) for p in proposals], dtype=np.int64)
        return proposed, [p[:a] for p, a in zip(proposals, accepted)], tokens, catchup, t1, t2

    def _tree_speculate(self, k: np.ndarray) -> tuple[np.ndarray, list[list[int]], list[int], int, float, float]:
        """A tree step (:attr:`proposer` drafts each request's ``tree.shape(k)``, a chain of k without a tree; one
        verification with tree attention); returns as :meth:`_chain_speculate`."""
        assert self.proposer is not None
        trees, catchup = None, 0
        if k.any():
            shapes = [None if not ki else self.family.shape(int(ki)) if self.family is not None
                      else TreeShape.chain(int(ki)) for ki in k.tolist()]
            trees, _, catchup = self.proposer.draft(shapes)
        t1 = self._now()
        drafted = trees if trees is not None else [DraftTree() for _ in self.rids]
        proposed = [tree.size for tree in drafted]
        last = [self.outputs[r][-1] for r in self.rids]
        paths, tokens, features = self.runner.verify_tree(self.target_kv, last, drafted,
                                                          self._twin_draws(k.tolist(), trees=True), self.features)
        t2 = self._now()
        self.proposer.commit(trees, paths, tokens, features)
        accepted = [[tree.tokens[n] for n in path] for tree, path in zip(drafted, paths)]
        return np.array(proposed, dtype=np.int64), accepted, tokens, catchup, t1, t2

    def _retire(self, done: list[int]) -> None:
        """Drop finished requests (rows ``done``) from the batch and its caches."""
        order = self.target_kv.remove(done)
        if self.proposer is not None:
            assert self.proposer.remove(done) == order  # both caches keep their rows in the same order
        elif self.use_draft:
            assert self.draft_kv.remove(done) == order
        for rid in (self.rids[i] for i in done):
            if self.acceptance is not None:
                self.acceptance.finish(rid)
        self.rids = [self.rids[i] for i in order]
        self.pending = [self.pending[i] for i in order]

    def _kv_blocks(self) -> int:
        """KV blocks the running requests' target tokens would hold in a paged cache."""
        bs = self.config.block_size
        return sum((n + bs - 1) // bs for n in self.target_kv.lengths())
