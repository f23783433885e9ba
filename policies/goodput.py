"""SmartSpec's goodput policy (Liu et al., "Optimizing Speculative Decoding for Serving Large Language
Models Using Goodput", arXiv 2406.14066).

Each decision picks proposal lengths maximising

    goodput = sum_i E[tokens_i(k_i)] / predicted step seconds,

with the step time from :func:`policies.step_time.shape_seconds` on the policy's own cost model and
E[tokens] from an acceptance estimate learned online (SmartSpec Sec. 4):

    E[tokens](k) = 1 + sum_{j<=k} prod_{m<=j} a_m,

the expected emitted tokens (accepted + the bonus/correction token) when position m is accepted
with probability a_m given that it was reached. For a constant rate a this is SmartSpec's
(1 - a^(k+1)) / (1 - a), which is k + 1 at a = 1 and 1 at a = 0; the sum form has no division.

Acceptance estimates are exponential moving averages with weight w (``ema_weight``), started at 0.7 as in
SmartSpec's implementation (steps that propose nothing are skipped). SmartSpec uses w = 0.15; the default
here is 0.05: at light load a step verifies only a few tokens, and with w = 0.15 the estimate of acceptance
0.3 wandered far enough (about +-0.13) to switch speculation off half the time, 6% slower than fixed k = 1
(the outcome tests); 0.05 still follows a change of acceptance within a few dozen speculative steps. Two estimators:

- ``estimator=ratio`` is SmartSpec's code: a <- (1 - w) a + w a_obs with a_obs = accepted / proposed
  over the step. That ratio is *not* the per-token rate the closed form above needs: with proposals
  truncated at k, E[accepted] / k = (a - a^(k+1)) / (k (1 - a)), e.g. 0.54 for a = 0.8 and k = 5, so the
  policy under-speculates.
- ``estimator=tokens`` (default) estimates the per-token rate consistently: the ratio of moving
  averages of accepted tokens A and of Bernoulli trials A + R (R = requests whose run ended in a
  rejection), a <- EMA(A) / EMA(A + R), the maximum-likelihood estimate of a truncated geometric. Both
  averages start from the pseudo-observation (alpha_init, 1).

``acceptance=global`` keeps one rate, ``request`` one per request (a request not yet observed uses the global rate;
its first update starts from it), ``position`` one per draft position (P(accept j | reached j)).

Exploration (``probe``, default 16). Acceptance is observed only on steps that propose, so a policy that
chose k = 0 everywhere would never see acceptance again: one run of rejections that pulled the estimate
low enough would stop speculation for good, whatever the acceptance later is (the failure of SmartSpec's
rule as written). After ``probe`` consecutive steps without a proposal the next step probes: one request of
the batch (in turn) proposes k = 1. A probe costs one draft pass over one sequence and one more verified
token (well under 1% of the ``probe`` steps it follows at any batch size) and gives one Bernoulli trial of
acceptance, so the estimate follows acceptance as it changes and speculation resumes when it pays again.
``probe=0`` is SmartSpec's rule without exploration.

``bonus`` multiplies the goodput of k = 0 (speculation must win by that factor). SmartSpec's implementation
uses 1.1; the default here is 1.0, chosen by the outcome tests (``tests/test_goodput_outcomes.py``): past
saturation the 10% handicap kept speculating where no-spec was better and cost up to ~5% of throughput,
while at light load the estimate is good enough without it.

``mode=batch`` proposes one k for the whole batch. ``mode=request`` starts from that batch choice and
then hill-climbs on single-request moves (raise or lower one k_i by one; take the move with the
best goodput; stop when none improves). Starting from the batch choice rather than from all zeros
matters: the first token proposed at a new position opens a whole draft pass, so from all zeros no
single raise pays for itself at moderate batch sizes even when a uniform k would.

Token trees (issue 23; SmartSpec names tree decoding as the framework's next step). With a tree family in the view
(``view.tree``, :mod:`policies.tree`), k is the number of tree nodes and the candidates are the family's shapes:
request i verifying ``shape(k)`` is worth E[accepted_i | shape(k)] + 1 tokens, the sum over the shape's nodes of their
reach (the closed form of :func:`policies.tree.expected_accepted`), and the step is priced by the step formula's tree
form (:func:`policies.step_time.uniform_tree_pricer`, :class:`policies.step_time.TreeStep`): goodput =
sum_i (E[accepted_i] + 1) / predicted step seconds, maximised over one shape for the batch (``mode=batch``) or by a
hill climb per request from it (``mode=request``) whose moves raise (lower) by one the 1, 2, 4, ... requests at one k
whose next node is worth most (last node least): a lone request rarely pays for the draft pass its deeper shape
opens, a group can. The rank acceptance the policy
believes in is the family's rank model with its own top-1 rate a: q[d][0] = a and q[d][r] = (1 - a) g_d(r), g_d the
family's P(rank r | not rank 0) at depth d. It learns a from accepted lengths alone, by online EM (Cappé and
Moulines, "On-line expectation-maximization algorithm for latent data models", JRSS B 71(3), 2009): were the target's
path observed, its ranks 0 (Z) and its trials (Z and the other ranks, M) would give the maximum-likelihood estimate
Z / (Z + M) (the likelihood is a^Z (1 - a)^M times factors free of a); only its depth is observed, so each request
adds the expected Z and Z + M given its accepted length l under shape(k) at the rate believed in (the E-step,
:class:`_TreeBelief`), and the estimate is the ratio of their moving averages with weight ``ema_weight`` = w (per
request with ``acceptance=request``) from the pseudo-observation (alpha_init, 1):

    Z <- (1 - w) Z + w sum_i E[Z_i | l_i, shape(k_i), a],
    T <- (1 - w) T + w sum_i E[Z_i + M_i | l_i, shape(k_i), a],

the sums over the step's requests that verified a tree, in batch order; a = Z / T. Its fixed points are those of the
likelihood of the lengths (EM's). The rate believed in is the midpoint of the cell of :data:`GRID` equal cells of
[0, 1] that holds Z / T (the E-step is kept by cell, and so are the decisions). For a chain the E-step is exact, l and
l + [l < k] at every rate: this is the ``tokens`` estimator above, bit for bit, so the tree estimate is that
estimator's generalisation; ``acceptance=position`` and ``estimator`` do not apply to trees. A tree family that is a
chain never reaches the policy (the engine runs it as chains).
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from functools import reduce
from itertools import repeat
from operator import add, lt
from typing import Any

import numpy as np

from policies.base import BatchView, Policy, StepOutcome
from policies.errors import UserError
from policies.params import ParamReader
from policies.step_time import (TreeStep, UniformPricer, UniformTreePricer, shape_seconds, step_shape, tree_step,
                                tree_step_seconds, uniform_pricer, uniform_step_seconds, uniform_tree_pricer)
from policies.tree import RankTable, TreeFamily, rank_prob

SEQUENTIAL_SUM = sys.version_info < (3, 12)
"""Speed shortcut, switched here in one place: the expected tokens of a batch-wide k (one row's value added batch - 1
times, one at a time) summed by ``sum``, whose loop over floats adds C doubles in order before Python 3.12 (3.12
compensates), rather than by ``reduce(add, ...)``: the same sums (``tests/test_fast_paths.py``). False (and from 3.12):
``reduce``."""

MODES = ("batch", "request")
GRID = 200
"""Cells of [0, 1] the tree estimate is read in: the rate believed in is its cell's midpoint, within 1 / (2 GRID) of
the estimate (module docstring)."""
ACCEPTANCE = ("global", "request", "position")
SPAN_MARGIN = 1e-9
"""The relative lead a decision must have over every other k at the corners of a span (``Goodput.spans``): four orders
of magnitude above the rounding of the priced seconds and expected tokens."""
SPAN_PROBE = 1 << 24
"""Farthest a span reaches beyond the context total it was found at (tokens; also the point its slopes are read at)."""
SPAN_RATES = (0.1, 0.02)
"""Half-widths of the ranges of acceptance rates a chain's decision span is looked for over, widest first."""
SPANS_KEPT = 4
"""Spans a goodput policy keeps by key (its decisions over different context totals)."""
TREE_SPAN_RATES = (8, 2, 0)
"""Half-widths (grid steps) of the ranges of grid rates a tree's decision span is looked for over, widest first."""
ESTIMATORS = ("tokens", "ratio")
Stepper = Callable[[list[int] | None, list[int] | None, int], list[int]]
"""``step(proposed, accepted, context_tokens)`` of :meth:`Goodput.plain_stepper`: the next step's proposals."""


def expected_tokens(accept: np.ndarray) -> np.ndarray:
    """E[tokens emitted] for k = 0..K from acceptance probabilities ``accept[..., j-1]`` of position j = 1..K.

    Returns shape ``accept.shape[:-1] + (K + 1,)``: ``1 + cumsum(cumprod(accept))`` with a leading 1
    (SmartSpec's (1 - a^(k+1)) / (1 - a) for a constant rate).
    """
    accept = np.asarray(accept, dtype=float)
    reach = np.cumsum(np.cumprod(accept, axis=-1), axis=-1)
    return 1.0 + np.concatenate([np.zeros(accept.shape[:-1] + (1,)), reach], axis=-1)


class Goodput(Policy):
    """Choose k each step to maximise expected tokens per predicted second (SmartSpec)."""

    name = "goodput"
    fast = True
    """Speed shortcut, switched here in one place: when every request shares one acceptance estimate
    (``acceptance`` global or position) decide, propose and observe in plain Python over the batch instead of
    numpy calls: the same arithmetic in the same order, so the same decisions bit for bit
    (``tests/test_fast_paths.py`` runs both). False: the numpy reference path, as written first."""

    fast_trees = True
    """Speed shortcut, switched here in one place: over token trees with one global estimate, the batch's expected
    tokens by shape are kept by (rate, batch size, k_max), and a step in which everyone verified one shape reads the
    E-step's row of that shape by each request's length (:meth:`_observe_tree_uniform`); the same numbers from the same
    arithmetic, so the same decisions bit for bit (``tests/test_fast_paths.py`` runs both). False: the expected tokens
    worked out every decision, each request's E-step looked up by its own shape."""

    spans = True
    """Speed shortcut, switched here in one place: with one global estimate and one k (a tree: one shape) for the batch,
    a decision found to stand over a span of acceptance rates and context totals (:meth:`_span`: exactly, where the
    costs are linear and the decision leads by a margin at the span's corners) is kept by (batch size, k_max, proposer,
    family and, for a tree, its grid rate) and taken again without pricing while the estimate and the batch's context
    total stay in the span; the same decisions bit for bit (``tests/test_fast_paths.py`` runs both). False: every
    decision priced."""

    def __init__(self, k: int, **params: Any) -> None:
        reader = ParamReader(self.name, params)
        self.alpha_init = reader.number("alpha_init", 0.7, low=0.0, high=1.0)
        self.ema_weight = reader.number("ema_weight", 0.05, low=0.0, high=1.0, low_open=True)
        self.bonus = reader.number("bonus", 1.0, low=0.0, low_open=True)
        """Factor on the k = 0 goodput: speculation must win by this much (SmartSpec's 1.1: by 10%)."""
        self.probe = reader.integer("probe", 16, low=0)
        """After this many steps without a proposal, one request proposes k = 1 (0: never; module docstring)."""
        self.every = reader.integer("every", 1, low=1)
        """Re-decide every this many steps; reuse the last decision in between."""
        self.mode = reader.choice("mode", "batch", MODES)
        self.acceptance = reader.choice("acceptance", "global", ACCEPTANCE)
        self.estimator = reader.choice("estimator", "tokens", ESTIMATORS)
        super().__init__(k, **reader.rest())
        self._global = [self.alpha_init, 1.0]
        """Moving averages (accepted, trials); the estimate is their ratio (see the module docstring)."""
        self._by_request: dict[int, list[float]] = {}
        self._by_position = np.full(self.k, self.alpha_init)
        self._steps = 0
        self._last_k = 0
        self._last_by_request: dict[int, int] = {}
        self._idle = 0
        """Consecutive steps without a proposal (for ``probe``)."""
        self._probes = 0
        self._pricers: dict[tuple, Any] = {}
        """:func:`policies.step_time.uniform_pricer` by (batch size, k_max, draft_cost), on ``_priced_on``; with token
        trees :func:`policies.step_time.uniform_tree_pricer` of the shapes 0..k_max, by the same and the family."""
        self._priced_on: Any = None
        self._spans: dict[tuple, list[tuple[float, float, int, int, int]]] = {}
        """Decision spans (``spans``): the latest (lowest rate, highest rate, lowest context total, highest, k) by
        (batch size, k_max, draft_cost, family or None, and a tree's grid rate as its index), on ``_priced_on``; a
        tree's rates are indices of the grid, its span kept under the key of each."""
        self._held: tuple[tuple, tuple[float, float, int, int, int]] | None = None
        """The latest decision read from a kept span: (its key's batch size, k_max, draft_cost and family or None; the
        span) (:meth:`plain_stepper`, which clears it before asking)."""
        self._span_wait: dict[tuple, tuple[int, int]] = {}
        """Decision spans: by key, after searches that found none, (decisions still to wait before the next search,
        the wait last set) (:meth:`_new_span`)."""
        self._tree: _TreeBelief | None = None
        """Token trees: the family's shapes and the likelihoods of the top-1 rate (module docstring); None: chains."""
        self._tree_pair = [self.alpha_init, 1.0]
        """Token trees: moving averages (expected ranks 0, expected trials) of the target's paths; the estimate is their
        ratio (module docstring)."""
        self._tree_by_request: dict[int, list[float]] = {}
        """Token trees, ``acceptance=request``: each observed request's own pair."""
        self._tree_totals: dict[tuple, list[float]] = {}
        """Token trees (``fast_trees``): the batch's expected tokens by shape, by (rate, batch size, k_max)."""

    # --- estimates ------------------------------------------------------------------------------
    @property
    def acceptance_estimate(self) -> float:
        """Global acceptance-rate estimate (kept in every ``acceptance`` mode)."""
        return self._global[0] / self._global[1]

    @property
    def position_estimates(self) -> tuple[float, ...]:
        """P(accept position j | reached j) for j = 1..k (learned only with ``acceptance=position``)."""
        return tuple(self._by_position.tolist())

    def acceptance_of(self, request_id: int) -> float:
        """Acceptance rate used for ``request_id`` (its own with ``acceptance=request``, else the global one)."""
        pair = self._by_request.get(request_id)
        return self.acceptance_estimate if pair is None else pair[0] / pair[1]

    def expected_tokens_table(self, request_ids: np.ndarray, k_max: int) -> np.ndarray:
        """E[tokens] per request (rows) for k = 0..k_max (columns), under the current estimates."""
        if self.acceptance == "position":
            accept = np.broadcast_to(self._by_position[:k_max], (request_ids.size, k_max))
        else:
            rates = [self.acceptance_of(r) for r in request_ids.tolist()]
            accept = np.repeat(np.asarray(rates, dtype=float)[:, None], k_max, axis=1)
        return expected_tokens(accept)

    # --- policy hooks ---------------------------------------------------------------------------
    def propose(self, view: BatchView) -> np.ndarray:
        if view.batch_size == 0:
            return np.zeros(0, dtype=np.int64)
        shared = self.fast and self.acceptance != "request"
        if self._steps % self.every == 0:
            if view.tree is not None and not view.tree.is_chain:
                self._decide_tree(view)
            elif shared and self.mode == "batch":
                self._decide_shared(view)
            else:
                self._decide(view)
        self._steps += 1
        if shared and not self._last_by_request:  # one k for everyone (speed shortcut, see ``fast``)
            out = np.full(view.batch_size, min(self._last_k, self.k, view.max_k), dtype=np.int64)
        else:
            ks = [self._last_by_request.get(r, self._last_k) for r in view.request_ids.tolist()]
            out = np.minimum(np.asarray(ks, dtype=np.int64), min(self.k, view.max_k))
        if self.probe and min(self.k, view.max_k) > 0:
            if out.any():
                self._idle = 0
            elif self._idle >= self.probe:
                out[self._probes % out.size] = 1
                self._idle, self._probes = 0, self._probes + 1
            else:
                self._idle += 1
        return out

    @property
    def steps_plain(self) -> bool:
        """Whether :meth:`propose_plain` and :meth:`observe_plain` may stand in for :meth:`propose` and
        :meth:`observe` (speed shortcut: the engine then runs several steps in one event on plain lists, see
        ``simulator.core.runs``): on the ``fast`` path, one k for the whole batch (``mode=batch``) from one
        global estimate (``acceptance=global``), so a proposal reads only the batch size and its context total."""
        return self.fast and self.mode == "batch" and self.acceptance == "global"

    @property
    def trees_plain(self) -> bool:
        """Whether :meth:`propose_plain` (given the tree family) and :meth:`observe_plain` may stand in for
        :meth:`propose` and :meth:`observe` over token trees too (speed shortcut, as :attr:`steps_plain`)."""
        return self.steps_plain

    def propose_plain(self, batch: int, context_tokens: int, cost_model: Any, max_k: int,
                      draft_cost: bool, tree: TreeFamily | None = None) -> list[int]:
        """:meth:`propose` of a batch of ``batch`` requests with ``context_tokens`` tokens of context in all, as a
        list (only while :attr:`steps_plain`; ``tree``: the view's tree family): the same decisions and state changes
        (tested)."""
        if batch == 0:
            return []
        if self._steps % self.every == 0:
            if tree is not None and not tree.is_chain:
                self._decide_tree_uniform(batch, context_tokens, cost_model, max_k, draft_cost, tree)
            else:
                self._decide_uniform(batch, context_tokens, cost_model, max_k, draft_cost)
        self._steps += 1
        k_max = self.k if self.k < max_k else max_k
        k = self._last_k if self._last_k < k_max else k_max
        out = [k] * batch
        if self.probe and k_max > 0:
            if k:
                self._idle = 0
            elif self._idle >= self.probe:
                out[self._probes % batch] = 1
                self._idle, self._probes = 0, self._probes + 1
            else:
                self._idle += 1
        return out

    def plain_stepper(self, batch: int, cost_model: Any, max_k: int, draft_cost: bool,
                      tree: TreeFamily | None = None) -> Stepper | None:
        """``step(proposed, accepted, context_tokens)``: :meth:`observe_plain` of a step of ``batch`` requests (none
        when ``proposed`` is None), then :meth:`propose_plain` of the next over ``context_tokens`` tokens of context,
        the other arguments these (only while :attr:`steps_plain`; what a run of steps of one batch asks); None where
        it would be no more than that (the caller then tells and asks).

        Speed shortcut (switched by :attr:`held`): while the kept span (``spans``) the last decision was read from
        holds the estimate (a tree's grid rate) and the context total, the decision is its k again, as every span that
        holds them gives the decision pricing would (:meth:`_span`), and the proposal is made without looking it up; a
        chain's estimate (``estimator=tokens``) is updated here, :meth:`observe_plain`'s arithmetic in its order. The
        same proposals and state changes, bit for bit (``tests/test_fast_paths.py``). Its attribute ``hold(k,
        accepted, context_tokens)`` is ``step`` after its proposal of everyone k > 0, answering None where it proposes
        the same again (for ``simulator.core.runs.HELD_RUNS``)."""
        k_max = self.k if self.k < max_k else max_k
        if not (self.held and self.spans and self.every == 1 and k_max > 0):  # a decision every step, k > 0 possible
            return None
        observe, propose = self.observe_plain, self.propose_plain
        args = (cost_model, max_k, draft_cost) if tree is None else (cost_model, max_k, draft_cost, tree)
        trees = tree is not None and not tree.is_chain
        mine = (batch, k_max, draft_cost, tree if trees else None)  # the key of the spans its decisions read

        def holding() -> tuple[float, float, int, int, int] | None:
            """The span of the latest decision read from a kept span, if it is of these steps' key (on this cost
            model) and its k > 0 (a decision of k = 0 leaves probes to propose_plain)."""
            found = self._held
            return found[1] if (found is not None and found[0] == mine and found[1][4] and cost_model is self._priced_on
                                ) else None

        held = holding()  # (one read by an earlier stretch of steps of this batch serves)
        w = self.ema_weight
        keep, inline = 1 - w, not trees and self._tree is None and self.estimator == "tokens"
        tree_uniform = self._observe_tree_uniform if trees and self.fast_trees else None  # observe_plain's path
        # over trees where everyone proposed k

        def tell(proposed: list[int], accepted: list[int]) -> None:
            """:meth:`observe_plain` of a step in which someone proposed."""
            if not inline:
                observe(proposed, accepted)
            else:  # observe_plain's update of a chain's estimate (tokens), written out
                pair = self._global  # (read each step: a fleet's replica may put back a copy of the policy's state)
                hits = float(sum(accepted))
                trials = hits + float(sum(map(lt, accepted, proposed)))
                pair[0] = keep * pair[0] + w * hits
                pair[1] = keep * pair[1] + w * trials

        def ask(context_tokens: int) -> list[int] | None:
            """:meth:`propose_plain` of the next step; None where the held span holds (k > 0): the proposal is then
            everyone proposing its k (capped by k_max), its bookkeeping done."""
            nonlocal held
            if held is not None:
                low, high, lo, hi, k = held
                rate = grid_index(self._tree_pair) if trees else self._global[0] / self._global[1]  # as decided
                if low <= rate <= high and lo <= context_tokens <= hi:
                    self._last_k = k
                    self._steps += 1
                    if self.probe:
                        self._idle = 0
                    return None
            self._held = None
            out = propose(batch, context_tokens, *args)
            held = holding()
            return out

        def step(proposed: list[int] | None, accepted: list[int] | None, context_tokens: int) -> list[int]:
            if proposed is not None and any(proposed):
                tell(proposed, accepted)
            out = ask(context_tokens)
            return [k if (k := held[4]) < k_max else k_max] * batch if out is None else out

        def hold(k: int, accepted: list[int], context_tokens: int) -> list[int] | None:
            """``step([k] * batch, accepted, context_tokens)`` after a step of this stepper's proposal of everyone k >
            0, but None where that proposal stands for the next step too (speed shortcut, see
            ``simulator.core.runs.HELD_RUNS``)."""
            if tree_uniform is not None and self._tree is not None:
                tree_uniform(k, accepted)
            else:
                tell([k] * batch, accepted)
            return ask(context_tokens)

        step.hold = hold  # type: ignore[attr-defined]
        return step

    held = True
    """Speed shortcut, switched here in one place: :meth:`plain_stepper` proposes from the span the last decision was
    read from while it holds (see there); the same proposals bit for bit (``tests/test_fast_paths.py`` runs both).
    False: no stepper (:meth:`observe_plain` then :meth:`propose_plain`)."""

    def observe(self, outcome: StepOutcome) -> None:
        if self._tree is not None:
            self._observe_tree(outcome.proposed.tolist(), outcome.accepted.tolist(), outcome.request_ids.tolist())
            return
        if self.fast and self.acceptance == "global":
            self._observe_global(outcome)
            return
        proposed = np.asarray(outcome.proposed, dtype=np.int64)
        accepted = np.asarray(outcome.accepted, dtype=np.int64)
        if not proposed.any():
            return
        prior = self.acceptance_estimate
        self._update(self._global, proposed, accepted)
        if self.acceptance == "request":
            for rid, p, a in zip(outcome.request_ids.tolist(), proposed.tolist(), accepted.tolist()):
                if p > 0:
                    self._update(self._by_request.setdefault(rid, [prior, 1.0]), np.array([p]), np.array([a]))
        elif self.acceptance == "position":
            w = self.ema_weight
            for j in range(1, min(int(proposed.max()), self.k) + 1):
                reached = int(np.count_nonzero((proposed >= j) & (accepted >= j - 1)))
                hit = int(np.count_nonzero(accepted >= j))
                if reached:
                    self._by_position[j - 1] = (1 - w) * self._by_position[j - 1] + w * hit / reached

    def _observe_global(self, outcome: StepOutcome) -> None:
        """:meth:`observe` with one global estimate, in plain Python (speed shortcut, see ``fast``): integer counts,
        then the EMA arithmetic of :meth:`_update` in its order."""
        self.observe_plain(outcome.proposed.tolist(), outcome.accepted.tolist())

    def observe_plain(self, proposed: list[int], accepted: list[int]) -> None:
        """:meth:`observe` of a step's proposals and acceptances as lists (only while :attr:`steps_plain`)."""
        if self._tree is not None:
            self._observe_tree(proposed, accepted, None)
            return
        if not any(proposed):
            return
        pair, w = self._global, self.ema_weight
        hits = float(sum(accepted))
        if self.estimator == "ratio":
            pair[0] = (1 - w) * pair[0] / pair[1] + w * hits / float(sum(proposed))
            pair[1] = 1.0
        else:
            average_in(pair, w, hits, hits + float(sum(map(lt, accepted, proposed))))  # + requests cut short

    def _update(self, pair: list[float], proposed: np.ndarray, accepted: np.ndarray) -> None:
        """One EMA step of an (accepted, trials) pair with this step's outcome (``estimator`` decides the trials)."""
        w = self.ema_weight
        hits = float(accepted.sum())
        if self.estimator == "ratio":  # SmartSpec: a <- (1 - w) a + w * accepted / proposed
            pair[0] = (1 - w) * pair[0] / pair[1] + w * hits / float(proposed.sum())
            pair[1] = 1.0
        else:
            average_in(pair, w, hits, hits + float(np.count_nonzero(accepted < proposed)))

    def finish(self, request_id: int) -> None:
        self._by_request.pop(request_id, None)
        self._last_by_request.pop(request_id, None)
        self._tree_by_request.pop(request_id, None)

    # --- decisions ------------------------------------------------------------------------------
    def _decide(self, view: BatchView) -> None:
        """Set ``_last_k`` (the best uniform k) and, in request mode, ``_last_by_request``."""
        k_max = min(self.k, view.max_k)
        table = self.expected_tokens_table(view.request_ids, k_max)
        totals = table.sum(axis=0).tolist()
        seconds = uniform_step_seconds(view.cost_model, view.batch_size, int(view.context_lens.sum()), k_max,
                                       view.draft_cost)
        best_k, best = 0, -1.0
        for k in range(k_max + 1):
            value = self._goodput(totals[k], seconds[k], k > 0)
            if value > best:
                best_k, best = k, value
        self._last_k = best_k
        if self.mode == "request":
            ks = self._hill_climb(view, table, best_k, best)
            self._last_by_request = dict(zip(view.request_ids.tolist(), ks.tolist()))

    def _decide_shared(self, view: BatchView) -> None:
        """:meth:`_decide` in batch mode when every request shares one acceptance estimate, in plain Python (speed
        shortcut, see ``fast``): E[tokens] of one row as :func:`expected_tokens` computes it (running product, then
        running sum), summed over the batch's identical rows one row at a time as numpy's column sums add them."""
        self._decide_uniform(view.batch_size, int(view.context_lens.sum()), view.cost_model, view.max_k,
                             view.draft_cost)

    def _decide_uniform(self, batch: int, context_tokens: int, cost_model: Any, max_k: int, draft_cost: bool) -> None:
        """:meth:`_decide_shared` from what it reads of the view: the batch size and its context total."""
        k_max = self.k if self.k < max_k else max_k
        if self.acceptance == "position":
            key, accept = None, self._by_position[:k_max].tolist()
        else:
            rate = self._global[0] / self._global[1]
            key = (batch, k_max, draft_cost, None) if self.spans else None  # (speed shortcut, see spans)
            if key is not None and cost_model is self._priced_on:  # a kept span that holds the rate and context
                for span in self._spans.get(key, ()):
                    low, high, lo, hi, k = span
                    if low <= rate <= high and lo <= context_tokens <= hi:
                        self._last_k, self._held = k, (key, span)
                        return
            accept = [rate] * k_max
        price = self._pricer(cost_model, batch, k_max, draft_cost)
        seconds = price(context_tokens)
        self._best_k(self._uniform_tokens(accept, batch), seconds)
        if key is not None:
            ranges = [(low, high) for d in SPAN_RATES for low, high in [(max(0.0, rate - d), min(1.0, rate + d))]]
            self._new_span(key, price, context_tokens, seconds,
                           [(low, high, [self._uniform_tokens([a] * k_max, batch) for a in (low, high)], [key])
                            for low, high in ranges])

    def _uniform_tokens(self, accept: list[float], batch: int) -> list[float]:
        """The batch's expected tokens for k = 0..len(accept), everyone proposing k with acceptance ``accept[j - 1]`` at
        position j: E[tokens] of one row as :func:`expected_tokens` computes it (running product, then running sum),
        summed over the batch's identical rows one row at a time as numpy's column sums add them."""
        row, product, reach = [1.0], 1.0, 0.0
        for j, a in enumerate(accept):
            product = a if j == 0 else product * a
            reach = product if j == 0 else reach + product
            row.append(1.0 + reach)
        # x added batch - 1 times, one at a time (as numpy's rows): sum's own loop does that before Python 3.12
        return [sum(repeat(x, batch - 1), x) if SEQUENTIAL_SUM else reduce(add, repeat(x, batch - 1), x) for x in row]

    def _pricer(self, cost_model: Any, batch: int, k_max: int, draft_cost: bool,
                tree: TreeFamily | None = None) -> UniformPricer | UniformTreePricer:
        """The pricer of the batch's steps with one k = 0..k_max (with ``tree``: one of its shapes 0..k_max) for
        everyone, kept (the steps priced as :func:`uniform_step_seconds` prices them; a run has one cost model, a
        test may switch)."""
        if cost_model is not self._priced_on:
            self._pricers, self._spans, self._span_wait, self._priced_on = {}, {}, {}, cost_model
        key = (batch, k_max, draft_cost, tree)
        price = self._pricers.get(key)
        if price is None:
            price = self._pricers[key] = (uniform_pricer(cost_model, batch, k_max, draft_cost) if tree is None else
                                          uniform_tree_pricer(cost_model, batch, [tree.shape(k) for k in
                                                                                  range(k_max + 1)], draft_cost))
        return price

    def _best_k(self, totals: list[float], seconds: list[float]) -> float:
        """Set ``_last_k`` to the k of best goodput for everyone, ``totals[k]`` the batch's expected tokens with k (a
        tree: shape(k)) and ``seconds[k]`` its step's predicted seconds; return that goodput."""
        best_k, best, bonus = 0, -1.0, self.bonus
        for k, x in enumerate(seconds):
            value = totals[k] / x  # _goodput, written out
            if k == 0:
                value = value * bonus
            if value > best:
                best_k, best = k, value
        self._last_k = best_k
        return best

    # --- decision spans (speed shortcut, see ``spans``) ------------------------------------------------------------
    def _new_span(self, key: tuple, price: UniformPricer | UniformTreePricer, context: int, seconds: list[float],
                  ranges: list[tuple[float, float, list[list[float]], list[tuple]]]) -> None:
        """Look for a span around the decision just made (``_last_k``, over ``context`` tokens of context, ``seconds``
        by k) and keep the first found: over each range (lowest rate, highest rate, the expected tokens by k at the
        rates it is checked at, the keys it is kept under) in turn, a span of context totals (:meth:`_span`). After
        searches that find none, the next search of ``key`` waits 1, 2, 4, ... up to 64 decisions."""
        remaining, wait = self._span_wait.get(key, (0, 0))
        if remaining:
            self._span_wait[key] = (remaining - 1, wait)
            return
        probe = min(price.affine_until(), context + SPAN_PROBE)
        if probe > context:
            slopes = [(f - s) / (probe - context) for f, s in zip(price.quiet(probe), seconds)]
            for low, high, ends, keys in ranges:
                found = self._span(price, ends, context, seconds, probe, slopes)
                if found is not None:  # kept beside the key's others (the latest SPANS_KEPT)
                    for each in keys:
                        self._spans[each] = [(low, high, *found, self._last_k), *self._spans.get(each, ())][:SPANS_KEPT]
                    self._span_wait.pop(key, None)
                    return
        wait = min(2 * wait, 64) if wait else 1
        self._span_wait[key] = (wait, wait)

    def _span(self, price: UniformPricer | UniformTreePricer, ends: list[list[float]], context: int,
              seconds: list[float], probe: int, slopes: list[float]) -> tuple[int, int] | None:
        """(lo, hi): a span of context totals around ``context`` over which the decision k just made is
        :meth:`_best_k`'s for every expected tokens ``totals`` between each two of ``ends`` (index by index), or None;
        ``slopes``: the seconds' by k between ``context`` and ``probe``, the farthest the span may reach.

        Why it holds: where the pricer is exactly affine in the context total c (``affine_until``: linear costs with
        non-negative terms, no warning due), k's goodput over j's is (T_k / T_j) (alpha_j + beta_j c) / (alpha_k +
        beta_k c) (T_0 with the bonus): monotone in c over any span where the seconds stay positive. A chain's T_k / T_j
        = (1 + a + ... + a^k) / (1 + a + ... + a^j) is monotone in the acceptance rate a too, so over a rectangle of
        rates and context totals k's lead is least at a corner (a tree's is checked at each grid rate of its range).
        The span's ends are priced as every step is, and k must lead at each corner by the relative
        :data:`SPAN_MARGIN`, far more than the rounding of the priced numbers and expected tokens (sums and products of
        non-negative terms, ~1e-13 relative): so k leads at every point between, as worked out there, and the decision
        is k there bit for bit. The ends are where the leads, estimated from the slopes, fall to twice the margin."""
        k, bonus, lead = self._last_k, self.bonus, 1.0 + 2.0 * SPAN_MARGIN
        alphas = [s - beta * context for s, beta in zip(seconds, slopes)]
        lo, hi = 0, probe
        for totals in ends:
            weight = [t * bonus if j == 0 else t for j, t in enumerate(totals)]
            for j, (alpha, beta, w) in enumerate(zip(alphas, slopes, weight)):
                if j == k:
                    continue
                # k leads j by ``lead`` where weight_k (alpha_j + beta_j c) >= lead w_j (alpha_k + beta_k c), i.e.
                # a + b c >= 0
                a = weight[k] * alpha - lead * w * alphas[k]
                b = weight[k] * beta - lead * w * slopes[k]
                if b > 0:
                    if (x := -a / b) > context:
                        return None
                    if x > lo:
                        lo = math.ceil(x)
                elif b < 0:
                    if (x := -a / b) < context:
                        return None
                    if x < hi:
                        hi = math.floor(x)
                elif a < 0:
                    return None
        for end in (lo, hi):
            priced = price.quiet(end)
            if not all(self._leads(priced, totals, k) for totals in ends):
                return None
        return lo, hi

    def _leads(self, seconds: list[float], totals: list[float], k: int) -> bool:
        """Whether k's goodput (as :meth:`_best_k` works it out) beats every other's by the relative
        :data:`SPAN_MARGIN` at these ``seconds``, all positive."""
        if min(seconds) <= 0.0:
            return False
        values = [t / x for t, x in zip(totals, seconds)]
        values[0] = values[0] * self.bonus
        bar = values[k]
        return all(bar > v * (1.0 + SPAN_MARGIN) for j, v in enumerate(values) if j != k)

    def _goodput(self, tokens: float, seconds: float, speculates: bool) -> float:
        """Expected tokens per predicted second; times ``bonus`` when nobody speculates."""
        value = tokens / seconds
        return value if speculates else value * self.bonus

    def _hill_climb(self, view: BatchView, table: np.ndarray, k_start: int, start: float) -> np.ndarray:
        """Per-request k from the uniform ``k_start``: best single +-1 move while it raises goodput.

        Among requests at the same k, the best raise is the one with the highest acceptance (then the
        shortest context: cheapest draft pass) and the best lowering the opposite end, so each round
        prices at most two candidates per occupied k. Rows are visited in that rank order. Exact when
        acceptance is shared (global, position); with per-request rates a better-accepted request with a
        much longer context can win a raise its draft-context cost would have denied it.
        """
        k_max = table.shape[1] - 1
        order = np.lexsort((view.context_lens, -table[:, k_max]))
        table, ctx = table[order], view.context_lens[order]
        ks = np.full(view.batch_size, k_start, dtype=np.int64)
        shape = step_shape(ctx, ks)
        tokens, best = float(table[:, k_start].sum()), start
        while True:
            move = None
            for level in np.unique(ks).tolist():
                at = np.flatnonzero(ks == level)
                for i, delta in ((at[0], 1), (at[-1], -1)):
                    if not 0 <= level + delta <= k_max:
                        continue
                    cand_shape = shape.moved(level, int(ctx[i]), delta)
                    cand_tokens = tokens + table[i, level + delta] - table[i, level]
                    value = self._goodput(cand_tokens, shape_seconds(view.cost_model, cand_shape, view.draft_cost),
                                          cand_shape.query_tokens > cand_shape.batch_size)
                    if value > best:
                        move, best = (i, delta, cand_shape, cand_tokens), value
            if move is None:
                break
            i, delta, shape, tokens = move
            ks[i] += delta
        out = np.empty_like(ks)
        out[order] = ks
        return out

    # --- token trees (module docstring) ---------------------------------------------------------------
    def tree_rate(self, request_id: int | None = None) -> float:
        """The top-1 rate the policy believes in (its own request's with ``acceptance=request``, else the global)."""
        pair = self._tree_pair if request_id is None else self._tree_by_request.get(request_id, self._tree_pair)
        return float(self._tree.grid[grid_index(pair)])

    def _belief(self, family: TreeFamily) -> "_TreeBelief":
        """The belief over ``family``'s shapes, started from the prior at a new family."""
        if self._tree is None or self._tree.family is not family:
            if self.acceptance == "position":
                raise UserError(f"policy {self.name}: acceptance=position is not modelled over token trees (use "
                                "global or request)")
            self._tree = _TreeBelief(family)
            self._tree_pair = [self.alpha_init, 1.0]
            self._tree_by_request, self._tree_totals = {}, {}
        return self._tree

    def _decide_tree(self, view: BatchView) -> None:
        """Set ``_last_k`` (the best shape for everyone) and, in request mode, ``_last_by_request``."""
        if self.mode == "batch" and self.acceptance != "request":
            self._decide_tree_uniform(view.batch_size, int(view.context_lens.sum()), view.cost_model, view.max_k,
                                      view.draft_cost, view.tree)
            return
        belief = self._belief(view.tree)
        k_max = min(self.k, view.max_k)
        ids = view.request_ids.tolist()
        if self.acceptance == "request":
            rates = np.array([self.tree_rate(r) for r in ids])
            table = belief.expected(rates)[:, :k_max + 1] + 1.0  # (batch, k): expected tokens emitted
        else:
            table = np.broadcast_to(np.asarray(belief.expected_at(self.tree_rate())[:k_max + 1]) + 1.0,
                                    (view.batch_size, k_max + 1))
        best = self._best_k(table.sum(axis=0).tolist(), self._pricer(view.cost_model, view.batch_size, k_max,
                                                                      view.draft_cost, view.tree)(
                                                                          int(view.context_lens.sum())))
        if self.mode == "request":
            ks = self._tree_hill_climb(view, table, self._last_k, best)
            self._last_by_request = dict(zip(ids, ks))

    def _decide_tree_uniform(self, batch: int, context_tokens: int, cost_model: Any, max_k: int, draft_cost: bool,
                             tree: TreeFamily) -> None:
        """:meth:`_decide_tree` of one shape for the batch from the global estimate, from what it reads of the view."""
        if self._tree is None or self._tree.family is not tree:
            self._belief(tree)
        k_max = self.k if self.k < max_k else max_k
        at = grid_index(self._tree_pair)  # tree_rate's rate
        key = (batch, k_max, draft_cost, tree, at)
        if self.spans and cost_model is self._priced_on:  # (speed shortcut, see spans) a kept span holding them
            for span in self._spans.get(key, ()):
                low, high, lo, hi, k = span
                if low <= at <= high and lo <= context_tokens <= hi:
                    self._last_k, self._held = k, (key[:-1], span)
                    return
        totals = self._tree_tokens(at, batch, k_max)
        price = self._pricer(cost_model, batch, k_max, draft_cost, tree)
        seconds = price(context_tokens)
        self._best_k(totals, seconds)
        if self.spans:  # over ranges of grid rates, each rate's lead checked (a tree's need not be monotone in it),
            # kept under each rate's key
            ranges = dict.fromkeys((max(0, at - d), min(GRID - 1, at + d)) for d in TREE_SPAN_RATES)
            self._new_span(key, price, context_tokens, seconds,
                           [(low, high, [self._tree_tokens(i, batch, k_max) for i in range(low, high + 1)],
                             [key[:-1] + (i,) for i in range(low, high + 1)]) for low, high in ranges])

    def _tree_tokens(self, at: int, batch: int, k_max: int) -> list[float]:
        """The batch's expected tokens by shape 0..k_max at the grid rate of index ``at`` (kept with ``fast_trees``)."""
        rate = float(self._tree.grid[at])
        totals = self._tree_totals.get((rate, batch, k_max)) if self.fast_trees else None
        if totals is None:
            totals = [(e + 1.0) * batch for e in self._tree.expected_at(rate)[:k_max + 1]]
            if self.fast_trees:  # (speed shortcut, see fast_trees)
                self._tree_totals[rate, batch, k_max] = totals
        return totals

    def _tree_hill_climb(self, view: BatchView, table: np.ndarray, k_start: int, start: float) -> list[int]:
        """Per-request shapes from the uniform ``k_start``: the best move while it raises goodput, each priced by
        :meth:`TreeStep.moved`. A move raises (lowers) by one the m requests at one k whose next (last) node is worth
        most (least), m = 1, 2, 4, ... up to all of them: a lone request rarely pays for the draft pass its deeper
        shape opens, a group can (the module docstring's hill climb, in groups)."""
        family, k_max = view.tree, table.shape[1] - 1
        ctx = view.context_lens.tolist()
        ks = [k_start] * view.batch_size
        step: TreeStep = tree_step(ctx, [family.shape(k_start)] * view.batch_size)
        tokens, best = float(table[:, k_start].sum()), start
        while True:
            move = None
            for level in sorted(set(ks)):
                at = [i for i, k in enumerate(ks) if k == level]
                for delta in (1, -1):
                    if not 0 <= level + delta <= k_max:
                        continue
                    # the raise worth most first (then the shortest context); the lowering that loses least first
                    ranked = sorted(at, key=lambda i: (table[i, level] - table[i, level + delta], delta * ctx[i]))
                    cand, cand_tokens, m = step, tokens, 0
                    for size in _group_sizes(len(ranked)):
                        for i in ranked[m:size]:
                            cand = cand.moved(family.shape(level), family.shape(level + delta), ctx[i])
                            cand_tokens += table[i, level + delta] - table[i, level]
                        m = size
                        value = self._goodput(cand_tokens, tree_step_seconds(view.cost_model, cand, view.draft_cost),
                                              cand.query_tokens > cand.batch_size)
                        if value > best:
                            move, best = (ranked[:size], delta, cand, cand_tokens), value
            if move is None:
                return ks
            group, delta, step, tokens = move
            for i in group:
                ks[i] += delta

    def _observe_tree(self, proposed: list[int], accepted: list[int], request_ids: list[int] | None) -> None:
        """One step of the online EM (module docstring) from the accepted lengths of the requests that verified a tree
        (global, and per request with ``acceptance=request``: ``request_ids`` given): the step's expected ranks 0 and
        trials, summed over its requests in batch order at the estimate's grid rate, averaged in with weight w."""
        if not any(proposed):
            return
        by_request = self.acceptance == "request" and request_ids is not None
        if self.fast_trees and not by_request and proposed.count(proposed[0]) == len(proposed):  # (speed shortcut)
            self._observe_tree_uniform(proposed[0], accepted)
            return
        pair, w = self._tree_pair, self.ema_weight
        hits, trials = self._tree.counts_at(grid_index(pair))
        step_hits = sum(hits[k][a] for k, a in zip(proposed, accepted) if k)
        step_trials = sum(trials[k][a] for k, a in zip(proposed, accepted) if k)
        if by_request:  # a request's first update starts from one pseudo-trial at the global rate
            prior = pair[0] / pair[1]
            for rid, k, a in zip(request_ids, proposed, accepted):
                if k:
                    own = self._tree_by_request.setdefault(rid, [prior, 1.0])
                    own_hits, own_trials = self._tree.counts_at(grid_index(own))
                    average_in(own, w, own_hits[k][a], own_trials[k][a])
        average_in(pair, w, step_hits, step_trials)

    def _observe_tree_uniform(self, k: int, accepted: list[int]) -> None:
        """:meth:`_observe_tree` of the global estimate from a step in which everyone verified shape(k), k > 0 (speed
        shortcut, see ``fast_trees``): shape(k)'s rows read by length, the same sums in the same order."""
        pair = self._tree_pair
        hits, trials = self._tree.counts_at(grid_index(pair))
        average_in(pair, self.ema_weight, sum(map(hits[k].__getitem__, accepted)),
                   sum(map(trials[k].__getitem__, accepted)))


def average_in(pair: list[float], w: float, hits: float, trials: float) -> None:
    """One step of the moving averages (accepted, trials) ``pair`` with weight ``w`` (``estimator=tokens`` and the tree
    estimate's: module docstring), in place."""
    pair[0] = (1 - w) * pair[0] + w * hits
    pair[1] = (1 - w) * pair[1] + w * trials


def _group_sizes(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``, then ``n``: the sizes of the group moves of :meth:`Goodput._tree_hill_climb`."""
    sizes, m = [], 1
    while m < n:
        sizes.append(m)
        m *= 2
    return sizes + [n]


# -- token trees (module docstring) ------------------------------------------------------------------------------------
class _TreeBelief:
    """What the policy believes of a tree family's shapes as a function of its top-1 rate a: each node's reach
    a^z (1 - a)^m G (z ranks 0 on its path, m others, G the product of their conditional rank probabilities), and, for
    each accepted length of each shape at every rate of the grid, the expected ranks 0 and trials of the target's path
    given that length (the E-step of the online EM of the module docstring).

    The target's path given accepted length l under shape(k) ends at a node v of depth l (the root for l = 0) with the
    probability reach(v) stop(v) / P(l), where stop(v) = 1 - [v has its rank-0 child] a - (1 - a) G_c(v) is the chance
    that its next token is none of v's children in the shape (G_c: their conditional rank probabilities, ranks >= 1;
    1 at a leaf, whose next token the shape does not test). The path holds z(v) ranks 0 and m(v) others, and the
    token after v, where v has children, is one more trial: a rank 0 only where the rank-0 child is not in the shape,
    with probability a / stop(v); otherwise a rank the shape lacks. So E[ranks 0 | l] = sum_v reach (z stop + a
    [children, no rank-0 child]) / P(l) and E[trials | l] = that + sum_v reach (m stop + (1 - a)(1 - G_c) [children])
    / P(l). On a chain they are l and l + [l < k]: the ``tokens`` estimator's counts, at every rate."""

    def __init__(self, family: TreeFamily) -> None:
        self.family = family
        q = family.q
        zeros, others, weight = [], [], []
        for path in family.order:  # shape(k) holds the first k
            g = 1.0
            for d, r in enumerate(path, 1):
                g *= _conditional_rank(q, d, r) if r else 1.0
            zeros.append(path.count(0))
            others.append(len(path) - path.count(0))
            weight.append(g)
        self.zeros, self.others, self.weight = (np.array(x, dtype=float) for x in (zeros, others, weight))
        self.grid = a = (np.arange(GRID) + 0.5) / GRID
        nodes = a ** self.zeros[:, None] * (1.0 - a) ** self.others[:, None] * self.weight[:, None]
        reach = {(): np.ones(GRID)} | dict(zip(family.order, nodes))  # by node (the root's: 1)
        state = {(): [False, 0.0, 0]}  # by node: (its rank-0 child in the shape, G_c, its children in the shape)
        shape = (family.num_nodes + 1, family.full.depth + 1, GRID)
        ends, hits, trials = np.zeros(shape), np.zeros(shape), np.zeros(shape)

        def part(path: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """The node's terms of P(l), of E[ranks 0 | l] P(l) and of E[trials | l] P(l) (class docstring)."""
            has0, g, children = state[path]
            stop = 1.0 - (a if has0 else 0.0) - (1.0 - a) * g
            zero = path.count(0) * stop + (a if children and not has0 else 0.0)
            other = (len(path) - path.count(0)) * stop + ((1.0 - a) * (1.0 - g) if children else 0.0)
            return reach[path] * stop, reach[path] * zero, reach[path] * (zero + other)

        parts = {(): part(())}
        ends[0, 0], hits[0, 0], trials[0, 0] = parts[()]
        for k, path in enumerate(family.order, 1):  # shape(k): shape(k - 1) and the node path, a leaf under its parent
            parent, state[path] = state[path[:-1]], [False, 0.0, 0]
            parent[2] += 1
            if path[-1]:
                parent[1] += _conditional_rank(q, len(path), path[-1])
            else:
                parent[0] = True
            parts[path[:-1]], parts[path] = part(path[:-1]), part(path)
            ends[k], hits[k], trials[k] = ends[k - 1], hits[k - 1], trials[k - 1]
            for d in {len(path) - 1, len(path)}:  # the depths whose sums changed, summed afresh in canonical order
                at_d = [parts[node] for node in sorted(parts) if len(node) == d]
                for out, i in ((ends, 0), (hits, 1), (trials, 2)):
                    out[k, d] = reduce(add, (p[i] for p in at_d))
        with np.errstate(divide="ignore", invalid="ignore"):  # a length the model gives no chance: no evidence
            self.hits = np.where(ends > 0.0, hits / ends, 0.0)
            """E[ranks 0 on the target's path | accepted l, shape(k)] at each grid rate, shape (k, l, GRID)."""
            self.trials = np.where(ends > 0.0, trials / ends, 0.0)
            """E[trials (ranks 0 and others) | accepted l, shape(k)] at each grid rate, shape (k, l, GRID)."""
        self._counts: dict[int, tuple[list[list[float]], list[list[float]]]] = {}
        self._expected: dict[float, list[float]] = {}

    def counts_at(self, at: int) -> tuple[list[list[float]], list[list[float]]]:
        """:attr:`hits` and :attr:`trials` at the grid rate of index ``at``, as lists by [k][l] (kept once worked
        out)."""
        found = self._counts.get(at)
        if found is None:
            found = self._counts[at] = (self.hits[:, :, at].tolist(), self.trials[:, :, at].tolist())
        return found

    def expected(self, rates: np.ndarray) -> np.ndarray:
        """E[accepted | shape(k)] for k = 0..num_nodes (columns) at each rate of ``rates`` (rows): the running sum of
        the nodes' reach, shape (rates, num_nodes + 1)."""
        a = np.asarray(rates, dtype=float)[:, None]
        reach = a ** self.zeros * (1.0 - a) ** self.others * self.weight
        return np.concatenate([np.zeros((a.shape[0], 1)), np.cumsum(reach, axis=1)], axis=1)

    def expected_at(self, rate: float) -> list[float]:
        """:meth:`expected` of one rate (a grid rate: kept once worked out)."""
        found = self._expected.get(rate)
        if found is None:
            found = self._expected[rate] = self.expected(np.array([rate]))[0].tolist()
        return found


def _conditional_rank(q: RankTable, depth: int, rank: int) -> float:
    """P(rank ``rank`` >= 1 | not rank 0) at ``depth`` under the rank table ``q`` (0 where rank 0 is certain)."""
    top1 = rank_prob(q, depth, 0)
    return rank_prob(q, depth, rank) / (1.0 - top1) if top1 < 1.0 else 0.0


def grid_index(pair: list[float]) -> int:
    """The index of the grid cell holding the estimate pair[0] / pair[1] (a rate in [0, 1]): the tree estimate's grid
    rate, :data:`GRID` equal cells' midpoints."""
    at = int(pair[0] / pair[1] * GRID)
    return at if at < GRID else GRID - 1
