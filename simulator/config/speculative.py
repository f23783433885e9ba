"""Speculation: the policy that picks k, the proposer (draft model, draft head or n-gram lookup), a token tree, and
the model of the target's acceptance (vLLM's ``--speculative-config``; SGLang's tree flags)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.draft_head import SPECULATIVE_METHODS, method_name, proposer_of
from policies.errors import require
from policies.protocol import PROPOSERS
from policies.tree import TreeShape, tree_nodes
from simulator.config.checks import check_types, choice, flag, named, positive, probability

ACCEPTANCE_MODELS = ("constant", "beta", "position", "replay", "by-rank")
#: Token trees' rank model by default: P(the target's token is the draft's rank r | not its rank 0), r = 1..4. An
#: ASSUMPTION, not a measurement (no public figure found for a draft model's ranks beyond the first); replace it with
#: ``--acceptance-ranks`` or a measured table (``--acceptance-by-rank``, written by ``profile --acceptance``).
DEFAULT_ACCEPTANCE_RANKS = (0.4, 0.2, 0.1, 0.05)


@dataclass(frozen=True)
class SpeculativeConfig:
    """What proposes, how many tokens, and how many of them the target accepts."""

    policy: str = "no-spec"
    """Speculation policy: ``no-spec``, ``fixed-k``, ``threshold`` (vLLM's disable-by-batch-size), ``goodput``
    (SmartSpec), ``vllm-batch-table`` (vLLM's num_speculative_tokens_per_batch_size: ``--policy-param
    table=1:5,8:3,32:1,64:0``), ``sglang-adaptive`` (SGLang's --speculative-adaptive tiers 1,3,7: needs ``--k 7``),
    or a name a ``policy_file`` registers."""
    k: int = 4
    """Proposal length, tokens in [0, 64], for ``fixed-k`` and the upper bound (K_max) for adaptive policies (vLLM's
    ``num_speculative_tokens``; ``--num-speculative-tokens`` is the same flag). With a token tree, k counts tree nodes:
    at most the tree's nodes (on the command line it defaults to them, as vLLM's num_speculative_tokens is the tree's
    size); a policy's k verifies the k-node subtree of highest expected acceptance."""
    policy_params: tuple[tuple[str, Any], ...] = ()
    """Extra policy parameters as (name, value) pairs; given on the command line as ``--policy-param name=value``."""
    policy_file: str | None = None
    """A Python file that registers user policies; loaded before ``policy`` is looked up."""
    proposer: str = "draft"
    """Proposer: ``draft`` (a draft model or draft head, k sequential draft passes) or ``ngram`` (prompt lookup, no
    draft pass)."""
    speculative_method: str | None = None
    """vLLM's speculative method (``--speculative-config`` ``method``): ``draft_model`` (a draft model), ``eagle``,
    ``eagle3`` or ``mtp`` (a draft head on the target's hidden states, its passes priced by the profile's draft rows,
    which must be that head's) or ``ngram``; SGLang's ``--speculative-algorithm`` names (STANDALONE, EAGLE, EAGLE3,
    MTP, NGRAM; the same flag) are taken as vLLM's. ``None``: as ``proposer`` says (draft_model or ngram). Given
    alone it sets ``proposer`` (ngram: ngram, the others: draft); given with a contradicting ``proposer``, an error."""
    ngram_match_prob: float = 0.5
    """n-gram proposer: probability in [0, 1] that the lookup finds a continuation at a step."""
    speculative_token_tree: str | None = None
    """vLLM's token tree (``--speculative-config`` ``speculative_token_tree``): a Python list of paths of child ranks
    from the last verified token, e.g. "[(0,), (1,), (0, 0)]" (rank 0: the draft's most likely token), every prefix of
    a path a node, at most 64 nodes. Every request verifies its tree in one target pass (tree attention) after one draft
    pass per depth. A chain ("[(0,), (0, 0)]") is ordinary speculation. ``None``: no tree."""
    speculative_num_steps: int | None = None
    """SGLang's ``--speculative-num-steps``: draft passes (the tree's depth, >= 1) of an EAGLE tree; with
    ``speculative_eagle_topk`` and ``speculative_num_draft_tokens`` (all three, or none; not with
    ``speculative_token_tree``). SGLang's documented defaults are 5, 4 and 8."""
    speculative_eagle_topk: int | None = None
    """SGLang's ``--speculative-eagle-topk``: branching per draft step (>= 1; 1 is a chain)."""
    speculative_num_draft_tokens: int | None = None
    """SGLang's ``--speculative-num-draft-tokens``: tokens verified per request, the last verified one included (the
    tree keeps the num_draft_tokens - 1 candidates of highest expected acceptance; with top-k 1 it must be num_steps +
    1)."""
    acceptance: str = "constant"
    """Acceptance model: ``constant`` (i.i.d. per token), ``beta`` (per-request probability), ``position`` (per
    position j), ``replay`` (recorded steps of ``acceptance_trace``), ``by-rank`` (a measured table by depth and rank,
    ``acceptance_by_rank``; a chain reads its rank-0 column as ``position``)."""
    acceptance_rate: float = 0.8
    """INPUT: the probability in [0, 1] that the target accepts each proposed token, given the ones before it were
    accepted (Leviathan's alpha; ``constant``), or the Beta mean (``beta``). Flag ``--token-acceptance-prob``
    (``--acceptance-rate`` is its old spelling). Not the measured ``acceptance_rate`` of a summary (accepted /
    proposed tokens), which is lower: a rejection discards the proposed tokens after it (0.8 gives about 0.59 at
    k = 4)."""
    acceptance_concentration: float = 10.0
    """Beta concentration (alpha + beta) of per-request acceptance probabilities (> 0)."""
    acceptance_positions: tuple[float, ...] = ()
    """Acceptance probability in [0, 1] of the j-th proposed token, j = 1.., comma-separated; the last value repeats
    (only with ``acceptance=position``)."""
    acceptance_trace: str | None = None
    """CSV of recorded steps ``request_id,proposed,accepted`` for the replay model (only with ``acceptance=replay``)."""
    acceptance_by_prompt: bool = False
    """``replay`` only: a request whose workload ``prompt_id`` is a ``request_id`` of the trace replays that request's
    own steps from its first, so copies of one prompt accept alike, in lockstep (:mod:`simulator.inputs.acceptance`);
    off: every request replays a stream drawn at random."""
    acceptance_ranks: tuple[float, ...] = DEFAULT_ACCEPTANCE_RANKS
    """Token trees: P(the target's token is the draft's rank r | not its rank 0) for r = 1, 2, ..., comma-separated,
    each in [0, 1], summing to at most 1 (the rest: beyond every candidate); rank r's acceptance at a depth is then
    (1 - top-1 acceptance) x this. The default is an assumption, not a measurement; used only with a token tree."""
    acceptance_by_rank: str | None = None
    """CSV ``depth,rank,probability`` of measured acceptance by depth (1..) and rank (0 = the draft's most likely),
    written by ``profile --acceptance``: the ``by-rank`` acceptance model (giving the file on the command line selects
    it)."""

    def __post_init__(self) -> None:
        check_types(self)
        choice("proposer", self.proposer, PROPOSERS)
        if self.speculative_method is not None:  # stored in vLLM's name (SGLang's mapped)
            object.__setattr__(self, "speculative_method",
                               method_name(self.speculative_method, f"config: {named('speculative_method')}"))
            require(proposer_of(self.speculative_method) == self.proposer,
                    f"config: speculative_method={self.speculative_method} runs proposer "
                    f"{proposer_of(self.speculative_method)}, not proposer={self.proposer}: give one of them "
                    "(--speculative-method or --proposer)")
        choice("acceptance", self.acceptance, ACCEPTANCE_MODELS)
        if self.acceptance != "replay":
            require(self.acceptance_trace is None, f"config: {named('acceptance_trace')} {self.acceptance_trace} is "
                                                   f"replayed only with acceptance=replay (got "
                                                   f"acceptance={self.acceptance}); add --acceptance replay")
        require(not self.acceptance_by_prompt or self.acceptance == "replay",
                f"config: {named('acceptance_by_prompt')} replays a trace's streams by prompt (got "
                f"acceptance={self.acceptance}); add --acceptance replay --acceptance-trace FILE")
        if self.acceptance != "position":
            require(not self.acceptance_positions, f"config: {named('acceptance_positions')} are used only with "
                                                   f"acceptance=position (got acceptance={self.acceptance})")
        require(isinstance(self.k, int) and self.k >= 0, f"config: {named('k')} must be an integer >= 0, got {self.k}")
        require(self.k <= 64, f"config: {named('k')} must be <= 64, got {self.k}")
        probability("ngram_match_prob", self.ngram_match_prob)
        probability("acceptance_rate", self.acceptance_rate)
        positive("acceptance_concentration", self.acceptance_concentration)
        for p in self.acceptance_positions:
            probability("acceptance_positions", p)
        if self.acceptance == "position":
            require(len(self.acceptance_positions) > 0,
                    f"config: acceptance=position needs {flag('acceptance_positions')} a1,a2,...")
        if self.acceptance == "replay":
            require(self.acceptance_trace is not None,
                    f"config: acceptance=replay needs {flag('acceptance_trace')} FILE")
        self._check_tree()

    def _check_tree(self) -> None:
        """A token tree (vLLM's string or SGLang's three numbers, :mod:`policies.tree`) and the acceptance by rank: one
        form of tree, valid, with k at most its nodes and a model proposer; the rank model's probabilities; the
        ``by-rank`` model with its file, and either only where it is used."""
        sglang = (self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        given = [v is not None for v in sglang]
        require(all(given) or not any(given), "config: SGLang's tree needs all of --speculative-num-steps, "
                                              "--speculative-eagle-topk and --speculative-num-draft-tokens")
        require(self.speculative_token_tree is None or not any(given),
                "config: give the tree once: --speculative-token-tree (vLLM) or --speculative-num-steps, "
                "--speculative-eagle-topk and --speculative-num-draft-tokens (SGLang)")
        if all(given):
            TreeShape.sglang(*sglang, ((1.0,),))  # the counts checked (which nodes it keeps does not matter here)
        nodes = tree_nodes(self.speculative_token_tree, self.speculative_num_draft_tokens)
        for g in self.acceptance_ranks:
            probability("acceptance_ranks", g)
        require(sum(self.acceptance_ranks) <= 1.0 + 1e-9,
                f"config: {named('acceptance_ranks')} must sum to at most 1, got {sum(self.acceptance_ranks):g}")
        if self.acceptance == "by-rank":
            require(self.acceptance_by_rank is not None,
                    f"config: acceptance=by-rank needs {flag('acceptance_by_rank')} FILE")
        require(self.acceptance_by_rank is None or self.acceptance == "by-rank",
                f"config: {named('acceptance_by_rank')} {self.acceptance_by_rank} is read only with acceptance=by-rank "
                f"(got acceptance={self.acceptance})")
        if self.acceptance_ranks != DEFAULT_ACCEPTANCE_RANKS:
            require(nodes is not None and self.acceptance != "by-rank",
                    f"config: {named('acceptance_ranks')} are used only with a token tree and not with "
                    "acceptance=by-rank (whose table has its ranks)")
        if nodes is None:
            return
        require(self.k <= nodes, f"config: {named('k')} {self.k} is more than the token tree's {nodes} nodes (with a "
                                 "tree, k counts the nodes verified)")
        require(self.proposer == "draft", "config: a token tree needs a model proposer (proposer=draft): an n-gram "
                                          "lookup proposes one chain")

    @property
    def proposer_method(self) -> str:
        """The speculative method in vLLM's names: ``speculative_method``, else ``proposer``'s (draft_model or
        ngram)."""
        if self.speculative_method is not None:
            return self.speculative_method
        return "draft_model" if self.proposer == "draft" else "ngram"


def align_proposer(changes: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``changes`` (field values to apply over ``before``'s) with ``proposer`` and ``speculative_method`` kept in step:
    one of them given alone carries the other along (a method sets the proposer that runs it; a proposer drops a
    method it does not run); given together they must agree, which :class:`SpeculativeConfig` checks."""
    out = dict(changes)
    method, old = out.get("speculative_method"), before.get("speculative_method")
    if "proposer" not in out and isinstance(method, str):
        out["proposer"] = SPECULATIVE_METHODS[method_name(method, f"config: {named('speculative_method')}")]
    elif "proposer" in out and "speculative_method" not in out and isinstance(old, str) \
            and proposer_of(old) != out["proposer"]:
        out["speculative_method"] = None
    return out
