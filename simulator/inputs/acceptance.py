"""Acceptance models: how many of the k proposed draft tokens the target accepts at each step.

Convention (vLLM's spec-decode metrics): ``accepted`` lies in [0, proposed]; the step emits
``accepted + 1`` tokens (the bonus or correction token), so the *acceptance length* includes the bonus
token. With i.i.d. per-token acceptance probability a and k proposed tokens, the expected number of
emitted tokens per step is (1 - a^(k+1)) / (1 - a) (Leviathan et al., ICML 2023, eq. 1).

The engine calls, once per decode step and for the whole batch, :meth:`AcceptanceModel.draw`; it calls
:meth:`AcceptanceModel.start` when a request enters decoding and :meth:`AcceptanceModel.finish` when it
leaves. Request ids are dense ints 0..N-1, so per-request state lives in arrays indexed by id.

Models (``SpeculativeConfig.acceptance``):

* ``constant``: every token accepted with probability ``acceptance_rate``, independently.
* ``beta``: each request draws its own rate r ~ Beta(m c, (1 - m) c) at :meth:`start` (mean m =
  ``acceptance_rate``, concentration c = ``acceptance_concentration``, so Var r = m (1 - m) / (c + 1)),
  then i.i.d. with r.
* ``position``: the j-th proposed token is accepted with probability ``acceptance_positions[j-1]`` (the
  last value repeats) given that all before it were; as vLLM's per-position acceptance counters.
* ``by-rank``: a measured table of acceptance by depth and rank (:func:`read_rank_table`, ``profile --acceptance``);
  for a chain it is ``position`` with the table's rank-0 probabilities.
* ``replay``: recorded accept/reject sequences of a real draft/target pair (:func:`read_acceptance_trace`).
  Each recorded request becomes a bit stream: a step that accepted a of p proposed tokens contributes a
  ones, then one zero if a < p (a step with p = 0 contributes nothing). At :meth:`start` a simulated
  request is given a recorded stream, drawn uniformly with replacement, and a pointer at its first bit.
  A step proposing k reads the leading ones at the pointer, at most k: ``accepted`` is their count; the
  pointer moves past them and, if a zero ended the run within k, past that zero too (so it moves by
  accepted + 1 after a rejection, by k otherwise). When the stream runs out the request continues on a
  freshly drawn stream, even in the middle of a step: it reads an endless concatenation of recorded
  streams. Replayed with the k it was recorded with, a stream reproduces its recorded steps exactly.
  With ``acceptance_by_prompt`` (``--acceptance-by-prompt``), a request whose workload ``prompt_id`` names a recorded
  request (its ``request_id`` in the trace) starts on that request's own stream, from its first bit, instead of a
  drawn one: copies of one prompt (a workload of B rows with one ``prompt_id``, sent together) then accept alike at
  every step and stay in lockstep, as SpecDecode-Bench's batches of B identical prompts decode (greedy outputs of one
  prompt are one text; ``profiles/data/specdecode_bench``); a request whose id is not in the trace draws as without
  it. A recorded step that proposed nothing (an n-gram lookup without a match) adds no bit: the stream holds the
  steps that proposed, and the engine's misses come from ``ngram_match_prob``.

:func:`fit_acceptance` estimates the parameters of the other models from a trace.

Token trees (:mod:`policies.tree`, issue 23) need acceptance by rank: ``q[d][r]``, the probability that the target's
token at depth d is the draft's rank-r candidate. Every model above gives the top-1 acceptance a of a request at a
depth (its rate, its Beta draw, the position's probability); the *rank model* spreads the rest over the other ranks:
``q[d][r] = (1 - a) g(r)`` for r >= 1, with g the conditional probabilities of ranks 1, 2, ... given a miss of rank
0 (``acceptance_ranks``; their sum <= 1, the rest falls beyond every candidate). The default g is an assumption, not a
measurement (see ``SpeculativeConfig.acceptance_ranks``); a measured table replaces it (``by-rank``).
:meth:`AcceptanceModel.draw_tree` draws the accepted length of a tree by inversion of its survival P(accepted >= d)
(:func:`policies.tree.survival`), one uniform per request; ``replay`` walks the tree with its recorded bits instead (a
one: the target's token is the draft's rank 0; after a zero, its rank is drawn from g), which on a chain is the
chain's reading rule.

A request that is started again while it still holds state (a preempted request resuming) keeps that
state: its Beta rate or its place in the replayed stream. :meth:`AcceptanceModel.finish` frees it.
Every random draw comes from the ``numpy.random.Generator`` given to the model.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from simulator.config import SpeculativeConfig
from simulator.inputs.csv_checks import finite_numbers, read_table, refuse_first, whole_numbers
from policies.errors import UserError, require
from policies.tree import (RankTable, TreeFamily, accepted_length, configured_tree, inversion_table, rank_table,
                          survival)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from simulator.inputs.workload import Workload

#: Columns an acceptance trace must have (others are ignored).
TRACE_COLUMNS = ("request_id", "proposed", "accepted")
#: Columns of a table of acceptance by depth and rank (``--acceptance-by-rank``; ``profile --acceptance`` writes it).
RANK_COLUMNS = ("depth", "rank", "probability")
#: A request enters the Beta fit of :func:`fit_acceptance` with at least this many verified tokens.
MIN_FIT_TOKENS = 5

UNIFORM_DRAWS = True
"""Speed shortcut, switched here in one place: :meth:`ConstantAcceptance.draw_list` of proposals that are one k for
everyone caps the draws by that k without pairing each with its proposal (the same min(G, k) per request;
``tests/test_fast_paths.py`` runs both). False: each draw capped by its own proposal."""


TREE_UNIFORMS = True
"""Speed shortcut, switched here in one place: :class:`ConstantAcceptance` draws the uniforms of token trees
(:meth:`AcceptanceModel.draw_tree`) in blocks, the same values in the same order as draws of each step's size
(``tests/test_fast_paths.py`` runs both). False: one draw a step."""

TREE_LENGTHS = True
"""Speed shortcut, switched here in one place: :class:`ConstantAcceptance` works out the accepted lengths of a block of
tree uniforms under one shape's table at once (:meth:`ConstantAcceptance._tree_lengths`), the same lengths in the same
order as inverting each uniform when drawn (``tests/test_fast_paths.py`` runs both). False: one uniform at a time."""


class AcceptanceModel:
    """Base class: per-request hooks that do nothing, and the per-step :meth:`draw` to implement."""

    name: ClassVar[str] = ""
    ranks: tuple[float, ...] = ()
    """The rank model's g: P(rank r | not rank 0) for r = 1, 2, ... (module docstring; :func:`make_acceptance` sets
    it)."""
    _rng: np.random.Generator
    _tree_memo: dict | None = None
    """:meth:`_inversion` of the shapes of one family under the shared rank table, by k (with the family under key
    None)."""

    def start(self, request_id: int) -> None:
        """Request ``request_id`` enters decoding."""

    def draw(self, request_ids: np.ndarray, proposed: np.ndarray) -> np.ndarray:
        """Accepted draft tokens per request (int64), 0 <= accepted <= proposed; proposed 0 gives 0."""
        raise NotImplementedError

    def draw_steps(self, request_ids: np.ndarray, proposed: np.ndarray, steps: int) -> np.ndarray:
        """Accepted tokens for ``steps`` consecutive steps of the same batch and proposals, shape
        ``(steps, batch)``: row j is step j. The same draws as ``steps`` calls of :meth:`draw`."""
        return np.stack([self.draw(request_ids, proposed) for _ in range(steps)])

    def draw_list(self, request_ids: list[int], proposed: list[int]) -> list[int]:
        """:meth:`draw` on plain lists (the simulator's per-step path): the same draws, as a list."""
        return self.draw(np.array(request_ids, dtype=np.int64), np.array(proposed, dtype=np.int64)).tolist()

    def finish(self, request_id: int) -> None:
        """Request ``request_id`` left decoding: free its state."""

    def expected_rate(self) -> float:
        """Mean per-token acceptance probability, for reports."""
        raise NotImplementedError

    # -- token trees -------------------------------------------------------------------------------------------
    def rank_table(self) -> RankTable:
        """The mean ``q[d][r]`` (the top-1 rate by depth with the rank model): what orders a tree family's nodes."""
        return rank_table((self.expected_rate(),), self.ranks)

    def draw_tree(self, request_ids: list[int], ks: list[int], family: TreeFamily) -> list[int]:
        """Accepted length of each request verifying ``family.shape(ks[i])`` (0 for k = 0): one uniform per request
        from the model's generator, inverted through the shape's survival under the request's rank table."""
        if self.shared_ranks and ks and ks.count(k := ks[0]) == len(ks):
            return self.draw_tree_uniform(family, k, len(ks))
        uniforms = self._tree_uniforms(len(ks))
        inversion = self._inversion
        return [accepted_length(inversion(r, family, k), u) if k else 0 for r, k, u in zip(request_ids, ks, uniforms)]

    def draw_tree_uniform(self, family: TreeFamily, k: int, count: int) -> list[int]:
        """:meth:`draw_tree` of ``count`` requests all verifying ``family.shape(k)`` where every request draws from the
        same rank table (:attr:`shared_ranks`): one k, one table (speed shortcut), the table each request would fetch
        read once (:meth:`_tree_lengths`)."""
        if not k:
            self._tree_uniforms(count)  # drawn all the same
            return [0] * count
        return self._tree_lengths(family, k, count)

    def _tree_lengths(self, family: TreeFamily, k: int, count: int) -> list[int]:
        """:meth:`draw_tree_uniform` of k > 0: the accepted length of each of the next ``count`` uniforms
        (:func:`policies.tree.accepted_length`, inlined)."""
        table = self._inversion(0, family, k)
        return [bisect_left(table, -u) for u in self._tree_uniforms(count)]

    def _tree_uniforms(self, count: int) -> list[float]:
        """The next ``count`` uniforms of the model's generator, for :meth:`draw_tree`."""
        return self._rng.random(count).tolist()

    shared_ranks: bool = True
    """Whether every request draws from the same rank table (:meth:`_inversion` then reads no request; False: the
    plain path of :meth:`draw_tree`, request by request, or a model's own :meth:`draw_tree`); where it is, a caller
    may draw proposals of one k for everyone through :meth:`draw_tree_uniform`."""

    def _inversion(self, request_id: int, family: TreeFamily, k: int) -> tuple[float, ...]:
        """:func:`policies.tree.inversion_table` of ``family.shape(k)``'s survival for the request; here one table for
        every request, so kept by k."""
        memo = self._tree_memo
        if memo is None or memo[None] is not family:
            memo = self._tree_memo = {None: family}
        found = memo.get(k)
        if found is None:
            found = memo[k] = inversion_table(survival(family.shape(k), self.rank_table()))
        return found


class ConstantAcceptance(AcceptanceModel):
    """I.i.d. acceptance with one rate for every token of every request (Leviathan et al., 2023).

    ``accepted = min(proposed, G)`` with G the number of successes before the first failure,
    G ~ Geometric(1 - rate) on {0, 1, ...}, so P(accepted = j) = rate^j (1 - rate) for j < k and
    P(accepted = k) = rate^k. A rate of 0 or 1 gives 0 or k exactly.
    """

    name = "constant"

    BLOCK = 4096
    """Geometric draws taken from the generator at a time (speed shortcut, see :meth:`_successes`)."""

    def __init__(self, rate: float, rng: np.random.Generator) -> None:
        self.rate = float(rate)
        self._rng = rng
        self._buffer: list[int] = []
        self._used = 0
        self._uniforms: list[float] = []
        """Uniforms drawn for token trees and not all handed out yet (:meth:`_tree_uniforms`)."""
        self._uniforms_used = 0
        self._uniforms_state: dict | None = None
        """The generator's state before it drew ``_uniforms``."""
        self._negated = np.zeros(0)
        """``_uniforms`` negated, as an array (:data:`TREE_LENGTHS`)."""
        self._lengths: dict[tuple[TreeFamily, int], tuple[int, list[int]]] = {}
        """:data:`TREE_LENGTHS`: by (family, k), the accepted lengths of ``_uniforms`` from an index on (that index, the
        lengths), worked out for the block drawn last."""

    def _successes(self, count: int) -> list[int]:
        """The next ``count`` values of G (successes before the first failure) of the stream.

        Speed shortcut (drawn in blocks): the generator draws :attr:`BLOCK` values at a time and they are handed out
        in order. numpy's ``Generator.geometric`` draws element by element from the bit generator, so the values
        are those that draws of ``count`` at a time would give, bit for bit (``tests/test_fast_paths.py``); this
        model is the only user of its generator."""
        end = self._used + count
        if end > len(self._buffer):
            if self._uniforms:
                self._put_back()
            rest = self._buffer[self._used:]
            more = max(self.BLOCK, count - len(rest))
            self._buffer = rest + (self._rng.geometric(1.0 - self.rate, size=more) - 1).tolist()
            self._used, end = 0, count
        out = self._buffer[self._used:end]
        self._used = end
        return out

    def _tree_uniforms(self, count: int) -> list[float]:
        """:meth:`AcceptanceModel._tree_uniforms`, drawn :attr:`BLOCK` at a time (speed shortcut, switched by
        :data:`TREE_UNIFORMS`) while the generator has drawn no geometric block (a model draws either chains or trees
        in a run): ``Generator.random`` draws element by element, so they are the values of draws of ``count`` at a
        time, bit for bit; a geometric block drawn afterwards first puts back the uniforms not handed out
        (:meth:`_put_back`), so the stream is that of draws of each size in any order (``tests/test_fast_paths.py``)."""
        if not TREE_UNIFORMS or self._buffer:
            return self._rng.random(count).tolist()
        end = self._uniforms_used + count
        if end <= len(self._uniforms):
            out = self._uniforms[self._uniforms_used:end]
            self._uniforms_used = end
            return out
        rest = self._uniforms[self._uniforms_used:]
        self._uniforms_state = self._rng.bit_generator.state
        block = self._rng.random(max(self.BLOCK, count - len(rest)))
        self._uniforms, self._negated, self._lengths = block.tolist(), -block, {}
        self._uniforms_used = count - len(rest)
        return rest + self._uniforms[:self._uniforms_used]

    def _tree_lengths(self, family: TreeFamily, k: int, count: int) -> list[int]:
        """:meth:`AcceptanceModel._tree_lengths`; speed shortcut (switched by :data:`TREE_LENGTHS`): while the uniforms
        are drawn in blocks (:data:`TREE_UNIFORMS`), the accepted lengths under ``family.shape(k)``'s table of the rest
        of the block are worked out at once (``np.searchsorted`` of the negated uniforms: the comparisons
        ``bisect_left`` makes, so the same lengths) and handed out in order, as the uniforms are."""
        used = self._uniforms_used
        end = used + count
        if not (TREE_LENGTHS and TREE_UNIFORMS and not self._buffer and end <= len(self._uniforms)):
            return super()._tree_lengths(family, k, count)
        found = self._lengths.get((family, k))
        if found is None:  # (the block's uniforms are handed out in order: those from here on serve this table)
            table = np.array(self._inversion(0, family, k))
            found = (used, np.searchsorted(table, self._negated[used:]).tolist())
            self._lengths = {**self._lengths, (family, k): found}  # replaced, not changed: a fleet's replica rewinds
        start, lengths = found
        self._uniforms_used = end
        return lengths[used - start:end - start]

    def _put_back(self) -> None:
        """Drop the uniforms drawn ahead and not handed out, the generator set where drawing only those handed out
        would have left it (its state before their block, then as many draws as were handed out of it)."""
        if self._uniforms_used < len(self._uniforms):
            self._rng.bit_generator.state = self._uniforms_state
            self._rng.random(self._uniforms_used)
        self._uniforms, self._uniforms_used, self._lengths = [], 0, {}

    def draw(self, request_ids: np.ndarray, proposed: np.ndarray) -> np.ndarray:
        return self.draw_steps(request_ids, proposed, 1)[0]

    def draw_list(self, request_ids: list[int], proposed: list[int]) -> list[int]:
        if self.rate == 1.0:
            return list(proposed)
        used, end = self._used, self._used + len(proposed)
        if end <= len(self._buffer):  # _successes, written out where the block has enough left
            drawn, self._used = self._buffer[used:end], end
        else:
            drawn = self._successes(len(proposed))
        if UNIFORM_DRAWS and proposed and proposed.count(k := proposed[0]) == len(proposed):  # (speed shortcut)
            return [g if g < k else k for g in drawn]
        return [g if g < k else k for g, k in zip(drawn, proposed)]

    def draw_steps(self, request_ids: np.ndarray, proposed: np.ndarray, steps: int) -> np.ndarray:
        shape = (steps, len(proposed))
        if self.rate == 1.0:
            return np.broadcast_to(np.asarray(proposed, dtype=np.int64), shape).copy()
        drawn = np.array(self._successes(steps * len(proposed)), dtype=np.int64).reshape(shape)
        return np.minimum(drawn, proposed)

    def expected_rate(self) -> float:
        return self.rate


class BetaAcceptance(AcceptanceModel):
    """Per-request rates r ~ Beta(mean c, (1 - mean) c), drawn at :meth:`start`; i.i.d. with r after.

    The rates have mean ``mean`` and variance mean (1 - mean) / (c + 1). A mean of 0 or 1 gives every
    request that rate.
    """

    name = "beta"

    def __init__(self, mean: float, concentration: float, rng: np.random.Generator) -> None:
        self.mean = float(mean)
        self.concentration = float(concentration)
        self._rng = rng
        self._rates = np.full(0, np.nan)
        """Acceptance rate by request id; NaN: no state."""
        self._by_request: dict[tuple[int, int], tuple[float, ...]] = {}
        """Token trees: survival of the shape of each (request, k) met, under the request's rate."""

    def start(self, request_id: int) -> None:
        self._rates = _grown(self._rates, request_id, np.nan)
        if np.isnan(self._rates[request_id]):
            self._rates[request_id] = (self._rng.beta(self.mean * self.concentration,
                                                      (1.0 - self.mean) * self.concentration)
                                       if 0.0 < self.mean < 1.0 else self.mean)

    def rate(self, request_id: int) -> float:
        """The acceptance rate drawn for a started request."""
        return float(self._rates[request_id])

    shared_ranks = False

    def _inversion(self, request_id: int, family: TreeFamily, k: int) -> tuple[float, ...]:
        """The inversion table of ``family.shape(k)``'s survival under the request's own rate, kept per (request, k)
        until it finishes."""
        key = (request_id, k)
        found = self._by_request.get(key)
        if found is None:
            table = rank_table((float(self._rates[request_id]),), self.ranks)
            found = self._by_request[key] = inversion_table(survival(family.shape(k), table))
        return found

    def draw(self, request_ids: np.ndarray, proposed: np.ndarray) -> np.ndarray:
        p_fail = 1.0 - self._rates[request_ids]
        certain = p_fail == 0.0  # a rate of exactly 1 (Beta draws can round to it)
        successes = self._rng.geometric(np.where(certain, 1.0, p_fail)) - 1
        return np.where(certain, proposed, np.minimum(successes, proposed))

    def finish(self, request_id: int) -> None:
        self._rates[request_id] = np.nan
        if self._by_request:
            for key in [key for key in self._by_request if key[0] == request_id]:
                del self._by_request[key]

    def expected_rate(self) -> float:
        return self.mean


class PositionAcceptance(AcceptanceModel):
    """Acceptance by draft position: token j is accepted with probability ``positions[j-1]`` given all
    tokens before it were (the last value repeats), so P(accepted >= j) = positions[0] ... positions[j-1].

    Drawn by inversion, one uniform per request: accepted = #{j <= proposed : P(accepted >= j) > u}.
    ``max_k`` bounds ``proposed`` (the configured k).
    """

    name = "position"

    def __init__(self, positions: tuple[float, ...], max_k: int, rng: np.random.Generator) -> None:
        require(len(positions) > 0, "config: acceptance_positions needs at least one probability")
        self.positions = tuple(float(p) for p in positions)
        length = max(max_k, len(positions))
        per_position = np.array(self.positions + self.positions[-1:] * (length - len(positions)))
        self.survival = np.cumprod(per_position)
        """P(accepted >= j) for j = 1..max(max_k, len(positions))."""
        self._descending = -self.survival  # ascending, for searchsorted
        self._rng = rng

    def draw(self, request_ids: np.ndarray, proposed: np.ndarray) -> np.ndarray:
        u = self._rng.random(len(proposed))
        return np.minimum(np.searchsorted(self._descending, -u, side="left"), proposed)

    def expected_rate(self) -> float:
        """The pooled rate accepted / (accepted + rejections) at the longest proposal, as
        :func:`fit_acceptance` measures it: sum_j P(accepted >= j) / (that sum + P(a rejection))."""
        expected_accepted = float(self.survival.sum())
        return expected_accepted / (expected_accepted + 1.0 - float(self.survival[-1]))

    def rank_table(self) -> RankTable:
        """Top-1 acceptance ``positions[d - 1]`` at depth d (the last repeats) with the rank model."""
        return rank_table(self.positions, self.ranks)


class ByRankAcceptance(PositionAcceptance):
    """A measured table ``q[d][r]`` (:func:`read_rank_table`): token trees draw from it as it is; a chain proposal is
    :class:`PositionAcceptance` of its rank-0 probabilities (the draws of that model)."""

    name = "by-rank"

    def __init__(self, table: RankTable, max_k: int, rng: np.random.Generator) -> None:
        super().__init__(tuple(row[0] for row in table), max_k, rng)
        self.table = table

    def rank_table(self) -> RankTable:
        return self.table


@dataclass(frozen=True, eq=False)
class AcceptanceTrace:
    """Recorded verification steps, one entry per step, in step order within each request."""

    path: str
    """File the steps were read from (for messages)."""
    request_index: np.ndarray
    """Request of each step: 0, 1, ... in order of first appearance in the file (int64)."""
    proposed: np.ndarray
    """Draft tokens proposed in the step (int64)."""
    accepted: np.ndarray
    """Draft tokens accepted in the step, 0 <= accepted <= proposed (int64)."""
    names: tuple[str, ...] = ()
    """The file's ``request_id`` of each request, by :attr:`request_index`."""

    @property
    def num_requests(self) -> int:
        return int(self.request_index.max()) + 1

    def bit_streams(self) -> tuple[np.ndarray, np.ndarray]:
        """Each request's steps as one bit stream (a ones, then a zero if a < p, per step), concatenated
        in request order: the bits (bool) and each request's stream length, in tokens (int64)."""
        rejected = self.accepted < self.proposed
        step_bits = self.accepted + rejected
        lengths = np.bincount(self.request_index, weights=step_bits, minlength=self.num_requests)
        order = np.argsort(self.request_index, kind="stable")
        step_start = np.cumsum(step_bits[order]) - step_bits[order]
        bits = np.ones(int(step_bits.sum()), dtype=bool)
        bits[(step_start + self.accepted[order])[rejected[order]]] = False
        return bits, lengths.astype(np.int64)


class ReplayAcceptance(AcceptanceModel):
    """Replays recorded accept/reject bit streams (see the module docstring for the reading rule)."""

    name = "replay"
    shared_ranks = False  # (each request walks its own stream: :meth:`draw_tree`)

    def __init__(self, trace: AcceptanceTrace, rng: np.random.Generator, prompt_ids: np.ndarray | None = None) -> None:
        bits, lengths = trace.bit_streams()
        proposing = lengths > 0
        self._own_stream: dict[int, int] = {}
        """Request id -> the stream it starts on (``acceptance_by_prompt``: its prompt's recorded one)."""
        if prompt_ids is not None:
            stream_of = dict(zip(np.array(trace.names)[proposing].tolist(), range(int(proposing.sum()))))
            for rid, prompt in enumerate(prompt_ids.tolist()):
                if (stream := stream_of.get(str(prompt))) is not None:
                    self._own_stream[rid] = stream
        lengths = lengths[proposing]  # a request that never proposed has no stream
        self._stream_end = np.cumsum(lengths)
        self._stream_start = self._stream_end - lengths
        position = np.arange(bits.size)
        end_of = np.repeat(self._stream_end, lengths)
        zeros = np.append(np.flatnonzero(~bits), bits.size)
        next_zero = zeros[np.searchsorted(zeros, position)]
        self._run = np.minimum(next_zero, end_of) - position
        """Ones from each bit on, up to the next zero or the end of its stream."""
        self._zero_stop = next_zero < end_of
        """Whether that run of ones ends at a zero (not at the end of the stream)."""
        self._rate = float(bits.mean())
        self._bits = bits.tolist()
        """The recorded bits (token trees walk them one depth at a time)."""
        self._rng = rng
        self._pos = np.zeros(0, dtype=np.int64)
        """Index of each request's next bit."""
        self._end = np.zeros(0, dtype=np.int64)
        """End of each request's current stream; 0: no state."""

    def start(self, request_id: int) -> None:
        self._pos = _grown(self._pos, request_id, 0)
        self._end = _grown(self._end, request_id, 0)
        if self._end[request_id] == 0:
            own = self._own_stream.get(request_id)
            if own is None:
                self._assign(np.array([request_id]))
            else:  # its prompt's own recorded stream, from the start (acceptance_by_prompt)
                self._pos[request_id] = self._stream_start[own]
                self._end[request_id] = self._stream_end[own]

    def draw(self, request_ids: np.ndarray, proposed: np.ndarray) -> np.ndarray:
        accepted = np.zeros(len(request_ids), dtype=np.int64)
        need = np.array(proposed, dtype=np.int64)
        rows = np.arange(len(request_ids))
        while rows.size:  # a second round only for requests whose stream ran out inside a run of ones
            ids, k = request_ids[rows], need[rows]
            at = self._pos[ids]
            run, zero_stop = self._run[at], self._zero_stop[at]
            taken = np.minimum(run, k)
            accepted[rows] += taken
            short = run < k
            self._pos[ids] = at + taken + (short & zero_stop)
            ran_out = self._pos[ids] == self._end[ids]
            if ran_out.any():
                self._assign(ids[ran_out])
            need[rows] = k - taken
            rows = rows[short & ~zero_stop]
        return accepted

    def finish(self, request_id: int) -> None:
        self._end[request_id] = 0

    def expected_rate(self) -> float:
        """Fraction of ones among all recorded bits (the pooled rate of :func:`fit_acceptance`)."""
        return self._rate

    def draw_tree(self, request_ids: list[int], ks: list[int], family: TreeFamily) -> list[int]:
        """Walk each request's tree along its stream (module docstring): at each depth a one means the target's token
        is the draft's rank 0, read and passed if that child is in the tree (else left unread, as a chain leaves the
        ones beyond k); a zero is read and, where the tree has another candidate, the rank drawn from the rank model
        (r >= 1; beyond every rank: none), passed if that child is in the tree. On a chain this is :meth:`draw`'s rule,
        the same draws."""
        cumulative = np.cumsum(self.ranks).tolist()
        out = []
        for rid, k in zip(request_ids, ks):
            shape, path = family.shape(k), ()
            for _ in range(shape.depth):
                if self._bits[int(self._pos[rid])]:
                    child = path + (0,)
                    if not shape.has(child):
                        break
                    self._advance(rid)
                else:
                    self._advance(rid)
                    if not any(shape.has(path + (r,)) for r in range(1, len(cumulative) + 1)):
                        break  # no other candidate here (a chain's node): no rank drawn
                    u = self._rng.random()
                    rank = next((r for r, c in enumerate(cumulative, 1) if u < c), None)
                    child = path + (rank,) if rank is not None else ()
                    if not child or not shape.has(child):
                        break
                path = child
            out.append(len(path))
        return out

    def _advance(self, request_id: int) -> None:
        """Move the request's pointer past one bit, onto a fresh stream where this one ends."""
        self._pos[request_id] += 1
        if self._pos[request_id] == self._end[request_id]:
            self._assign(np.array([request_id]))

    def _assign(self, request_ids: np.ndarray) -> None:
        """Give each request a fresh stream, drawn uniformly with replacement."""
        stream = self._rng.integers(self._stream_end.size, size=request_ids.size)
        self._pos[request_ids] = self._stream_start[stream]
        self._end[request_ids] = self._stream_end[stream]


def make_acceptance(config: SpeculativeConfig, rng: np.random.Generator,
                    workload: Workload | None = None) -> AcceptanceModel:
    """The acceptance model ``config.acceptance`` with its parameters, drawing from ``rng``; ``workload``: the requests
    it serves (their prompt ids pick the replayed streams under ``acceptance_by_prompt``)."""
    model: AcceptanceModel
    if config.acceptance == "constant":
        model = ConstantAcceptance(config.acceptance_rate, rng)
    elif config.acceptance == "beta":
        model = BetaAcceptance(config.acceptance_rate, config.acceptance_concentration, rng)
    elif config.acceptance == "position":
        model = PositionAcceptance(config.acceptance_positions, config.k, rng)
    elif config.acceptance == "by-rank":
        assert config.acceptance_by_rank is not None  # SpeculativeConfig validates
        model = ByRankAcceptance(read_rank_table(config.acceptance_by_rank), config.k, rng)
    else:
        assert config.acceptance == "replay" and config.acceptance_trace is not None  # SpeculativeConfig validates
        prompt_ids = workload.prompt_ids() if config.acceptance_by_prompt and workload is not None else None
        model = ReplayAcceptance(read_acceptance_trace(config.acceptance_trace), rng, prompt_ids)
    model.ranks = config.acceptance_ranks
    return model


def tree_family(config: SpeculativeConfig) -> TreeFamily | None:
    """The token tree configured (vLLM's ``speculative_token_tree`` or SGLang's steps, top-k and draft tokens) as a
    :class:`policies.tree.TreeFamily` ordered by the acceptance model's mean rank table; ``None`` without a tree."""
    if config.speculative_token_tree is None and config.speculative_num_steps is None:
        return None
    q = make_acceptance(config, np.random.default_rng(0)).rank_table()  # reads files only: no draw is taken
    full = configured_tree(config.speculative_token_tree, config.speculative_num_steps,
                           config.speculative_eagle_topk, config.speculative_num_draft_tokens, q)
    assert full is not None
    return TreeFamily(full, q)


def read_rank_table(path: str) -> RankTable:
    """Read a CSV of acceptance by depth and rank ``depth,rank,probability`` (extra columns ignored; ``profile
    --acceptance`` writes it): ``probability`` is q[depth][rank], the probability that the target's token at that depth
    (1, 2, ...) is the draft's candidate of that rank (0 = its most likely), given the path above was accepted. Depths
    past the last repeat it. Bad input stops with one line naming the file, the line and the value: depths not 1..D
    without gaps, ranks of a depth not 0..R without gaps (a rank never accepted is a row of probability 0, not a
    missing row: a gap is more likely a lost line than a measured 0), ranks not whole numbers >= 0, a (depth, rank)
    given twice, probabilities outside [0, 1] or summing to more than 1 at a depth."""
    _, columns = read_table(path, {"ranks": RANK_COLUMNS})
    depth = whole_numbers(path, columns["depth"], 1)
    rank = whole_numbers(path, columns["rank"], 0)
    prob = finite_numbers(path, columns["probability"])
    refuse_first(path, columns["probability"], (prob < 0) | (prob > 1), "must be in [0, 1]")
    seen: dict[tuple[int, int], int] = {}
    for line, key in enumerate(zip(depth.tolist(), rank.tolist()), 2):
        if key in seen:
            raise UserError(f"{path}: line {line}: depth {key[0]} rank {key[1]} is given twice (also line {seen[key]})")
        seen[key] = line
    depths = int(depth.max())
    missing = sorted(set(range(1, depths + 1)) - set(depth.tolist()))
    require(not missing, f"{path}: depth {missing[0] if missing else 0} has no row (depths must run 1..{depths})")
    rows = []
    for d in range(1, depths + 1):
        ranks = set(rank[depth == d].tolist())
        gap = min(set(range(max(ranks) + 1)) - ranks, default=None)
        require(gap is None, f"{path}: depth {d} has no row of rank {gap} (ranks of a depth must run 0..{max(ranks)}; "
                             "give a rank never accepted probability 0)")
        row = [0.0] * (max(ranks) + 1)
        for r, p in zip(rank[depth == d].tolist(), prob[depth == d].tolist()):
            row[r] = p
        require(sum(row) <= 1.0 + 1e-9, f"{path}: the probabilities of depth {d} sum to {sum(row):g}, more than 1")
        rows.append(tuple(row))
    return tuple(rows)


def read_acceptance_trace(path: str) -> AcceptanceTrace:
    """Read a CSV of verification steps ``request_id,proposed,accepted`` (extra columns ignored).

    Rows are steps, in step order within each request; requests may interleave. Bad input stops with a
    :class:`UserError` naming the file, the line (the header is line 1; blank lines are skipped and not
    counted), the column and the value:
    missing file or column, no rows, counts that are not whole numbers >= 0, accepted > proposed, a
    trace with no proposed token at all.
    """
    _, columns = read_table(path, {"steps": TRACE_COLUMNS})
    ids = [cell.strip() for cell in columns["request_id"].cells]
    refuse_first(path, columns["request_id"], np.array([not i for i in ids]), "must not be empty")
    proposed = whole_numbers(path, columns["proposed"], 0)
    accepted = whole_numbers(path, columns["accepted"], 0)
    over = accepted > proposed
    if over.any():
        i = int(np.argmax(over))
        raise UserError(f"{path}: line {i + 2}: accepted must be <= proposed "
                        f"(got accepted {accepted[i]}, proposed {proposed[i]})")
    require(proposed.sum() > 0, f"{path}: proposed is 0 on every row, nothing to learn acceptance from")
    index: dict[str, int] = {}  # request ids numbered in order of first appearance
    codes = np.array([index.setdefault(i, len(index)) for i in ids], dtype=np.int64)
    return AcceptanceTrace(path=path, request_index=codes, proposed=proposed, accepted=accepted, names=tuple(index))


def fit_acceptance(trace: AcceptanceTrace) -> dict[str, Any]:
    """Parameters of the ``constant``, ``beta`` and ``position`` models estimated from a trace.

    * ``rate``: the pooled per-token rate, the maximum-likelihood estimate for i.i.d. acceptance with
      truncation at k: sum accepted / (sum accepted + number of steps with a rejection).
    * ``beta``: ``{"mean", "concentration"}`` by the method of moments over per-request rates (each the
      same estimate within one request, from requests with at least :data:`MIN_FIT_TOKENS` verified
      tokens), with the per-request sampling variance r (1 - r) / (n - 1) subtracted from the spread
      (binomial noise, n the request's verified tokens); concentration = m (1 - m) / var - 1, ``inf``
      when the rates vary no more than that noise explains. ``None`` with fewer than two such requests.
      A request's rate estimated from a few steps is biased low, so this wants tens of steps per request
      (with 15 steps of k = 4 and Beta(7, 3) rates it finds a mean of 0.695 and concentration 9-10).
    * ``positions``: for j = 1, 2, ...: steps accepting token j / steps reaching it (proposed >= j and
      accepted >= j - 1), up to the last position any step reached.
    """
    accepted, proposed = trace.accepted, trace.proposed
    ones = float(accepted.sum())
    rate = ones / (ones + float((accepted < proposed).sum()))

    _, lengths = trace.bit_streams()
    request_ones = np.bincount(trace.request_index, weights=accepted, minlength=trace.num_requests)
    enough = lengths >= MIN_FIT_TOKENS
    beta: dict[str, float] | None = None
    if enough.sum() >= 2:
        n = lengths[enough]
        rates = request_ones[enough] / n
        mean = float(rates.mean())
        spread = float(rates.var(ddof=1)) - float(np.mean(rates * (1.0 - rates) / (n - 1)))
        beta = {"mean": mean, "concentration": mean * (1.0 - mean) / spread - 1.0 if spread > 0 else math.inf}

    positions = []
    for j in range(1, int(proposed.max()) + 1):
        reached = int(((proposed >= j) & (accepted >= j - 1)).sum())
        if reached == 0:
            break
        positions.append(int((accepted >= j).sum()) / reached)
    return {"rate": rate, "beta": beta, "positions": positions}


def _grown(values: np.ndarray, index: int, fill: float) -> np.ndarray:
    """``values``, enlarged (doubling, new entries ``fill``) so that ``index`` is inside it."""
    if index < values.size:
        return values
    grown = np.full(max(2 * values.size, index + 1, 64), fill, dtype=values.dtype)
    grown[:values.size] = values
    return grown
