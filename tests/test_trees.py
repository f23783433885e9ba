"""Token trees (issue 23): the shape (vLLM's paths, SGLang's steps/top-k/draft tokens), the closed form of the expected
accepted length against exhaustive enumeration of the target's choices and against Monte Carlo of the draws, the
subtree family, the step formula's tree form, and the engine: a chain given as a tree is today's chain bit for bit,
and a tree's runs of steps are its steps one by one."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from scipy import stats

from policies.errors import UserError
from policies.step_time import (predict_step_seconds, predict_tree_seconds, tree_step, uniform_tree_pricer)
from policies.tree import (TreeFamily, TreeShape, accepted_length, expected_accepted, inversion_table, rank_prob,
                           rank_table, survival)
from simulator.config import SimConfig
from simulator.core.runner import run_simulation
from simulator.costs.cost_model import load_cost_model
from simulator.inputs.acceptance import BetaAcceptance, ConstantAcceptance, ReplayAcceptance, read_acceptance_trace
from simulator.studies.cli import main
from tests.conftest import REPO

PROFILE = str(REPO / "profiles" / "data" / "a100-80gb-analytical__llama-2-7b__llama-68m.csv")
VLLM_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]"
SGLANG = dict(speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
Q = ((0.6, 0.2, 0.1), (0.5, 0.3), (0.7,))  # q[d][r]: depth 1, 2, then 3 and deeper


# -- the shape -----------------------------------------------------------------------------------------------------
def test_vllm_paths_are_sorted_and_counted_by_depth():
    tree = TreeShape.parse("[(1,), (0, 0), (0,), (1, 0), (0, 1)]")
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert (tree.num_nodes, tree.depth, tree.is_chain) == (5, 2, False)
    assert [tree.nodes_at_depth(d) for d in (1, 2, 3)] == [2, 3, 0]
    # pass 1 feeds the root; pass 2 the depth-1 nodes with children: (0,) and (1,)
    assert [tree.expanded_at_depth(d) for d in (1, 2)] == [1, 2] and tree.fed_before == (0, 1)
    chain = TreeShape.chain(3)
    assert chain.paths == ((0,), (0, 0), (0, 0, 0)) and chain.is_chain
    assert chain.expanded == (1, 1, 1) and chain.fed_before == (0, 1, 2)
    assert TreeShape.parse("[[0], [0, 0]]") == TreeShape.chain(2)


@pytest.mark.parametrize("text, problem", [
    ("[(0,), (1, 1)]", "path (1, 1) has no parent (1,)"),
    ("[(0,), (0,)]", "path (0,) is given twice"),
    ("[(0,), (-1,)]", "non-empty tuple of ranks >= 0"),
    ("[(0,), ()]", "non-empty tuple of ranks >= 0"),
    ("[]", "the tree has no node"),
    ("[(0,), (0, 0.5)]", "non-empty tuple of ranks >= 0"),
    ("(0, 1", "not a Python list of tuples"),
    ("__import__('os')", "not a Python list of tuples"),
    ("3", "expected a list of paths"),
    (str([(0,) * d for d in range(1, 66)]), "65 nodes, at most 64"),
])
def test_a_bad_tree_is_one_line_naming_speculative_token_tree(text, problem):
    with pytest.raises(UserError) as error:
        TreeShape.parse(text)
    message = str(error.value)
    assert message.startswith("speculative_token_tree: ") and problem in message and "\n" not in message


def test_sglang_tree_keeps_the_best_reachable_candidates():
    q = ((0.6, 0.3),)  # every depth: rank 0 with 0.6, rank 1 with 0.3
    # depth 1: (0,) .6, (1,) .3; depth 2: (0,0) .36, (0,1) .18, (1,0) .18, (1,1) .09; three kept: .6, .36, .3
    assert TreeShape.sglang(2, 2, 4, q).paths == ((0,), (1,), (0, 0))
    # 3 steps of top-2 expand only the 2 best of depth 2, (0,0) and (0,1) (before (1,0) in a tie): (1,0,x) unreachable
    everything = TreeShape.sglang(3, 2, 11, q)
    assert everything.num_nodes == 10 and everything.has((1, 0)) and everything.has((0, 1, 1))
    assert not everything.has((1, 0, 0))
    assert TreeShape.sglang(4, 1, 5, q) == TreeShape.chain(4)


@pytest.mark.parametrize("args, problem", [
    ((3, 1, 8), "must be speculative_num_steps + 1 = 4 with speculative_eagle_topk 1"),
    ((2, 2, 8), "asks for 7 tree nodes, but 2 steps of top-2 reach only 6"),
    ((0, 2, 3), "speculative_num_steps: must be a whole number >= 1"),
    ((2, 2, 1), "speculative_num_draft_tokens: must be a whole number >= 2"),
])
def test_sglang_numbers_that_make_no_tree_are_refused(args, problem):
    with pytest.raises(UserError, match=problem.replace("+", r"\+")):
        TreeShape.sglang(*args, Q)


# -- the closed form, exhaustively and by Monte Carlo ------------------------------------------------------------
def walk(tree: TreeShape, ranks: tuple) -> int:
    """The accepted length when the target's token at depth d is the draft's candidate ``ranks[d - 1]`` (None: none of
    them) under the node reached before: the deepest tree node on its path."""
    path: tuple[int, ...] = ()
    for rank in ranks:
        if rank is None or not tree.has(path + (rank,)):
            break
        path += (rank,)
    return len(path)


def enumerated(tree: TreeShape, q) -> np.ndarray:
    """P(accepted = l), l = 0..depth, summed over every sequence of target choices by depth (each rank the tree uses,
    and one outcome for all the others), each with the product of its probabilities."""
    dist = np.zeros(tree.depth + 1)
    width = max(max(p) for p in tree.paths) + 1
    for ranks in itertools.product(list(range(width)) + [None], repeat=tree.depth):
        prob = 1.0
        for d, r in enumerate(ranks, 1):
            prob *= (1.0 - sum(rank_prob(q, d, j) for j in range(width))) if r is None else rank_prob(q, d, r)
        dist[walk(tree, ranks)] += prob
    return dist


TREES = [TreeShape.parse(VLLM_TREE), TreeShape.chain(4), TreeShape.sglang(3, 3, 9, Q),
         TreeShape.parse("[(0,), (1,), (2,), (3,), (1, 0), (1, 1), (1, 0, 0), (1, 0, 1), (3, 0)]")]


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_expected_accepted_is_the_enumeration_of_the_targets_choices(tree):
    dist = enumerated(tree, Q)
    assert dist.sum() == pytest.approx(1.0)
    surv = survival(tree, Q)  # P(accepted >= d), d = 1..depth
    assert np.allclose(surv, dist[::-1].cumsum()[::-1][1:], rtol=0, atol=1e-12)
    assert expected_accepted(tree, Q) == pytest.approx(float(np.arange(tree.depth + 1) @ dist), abs=1e-12)


@pytest.mark.parametrize("a, k", [(0.0, 3), (0.3, 1), (0.6, 4), (0.8, 7), (0.95, 12), (1.0, 5)])
def test_a_chain_is_leviathans_closed_form(a, k):
    leviathan = k if a == 1.0 else a * (1 - a ** k) / (1 - a)  # a + a^2 + ... + a^k
    assert expected_accepted(TreeShape.chain(k), rank_table((a,), (0.5, 0.3))) == pytest.approx(leviathan)


def test_accepted_length_inverts_the_survival():
    surv = (0.8, 0.5, 0.2)
    assert [accepted_length(inversion_table(surv), u) for u in (0.0, 0.19, 0.2, 0.49, 0.5, 0.79, 0.8, 0.99)] == [3, 3, 2, 2, 1, 1, 0, 0]


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0
    return float(stats.chisquare(counts[keep], probs[keep] * counts.sum()).pvalue)


@pytest.mark.parametrize("tree", TREES[:3], ids=str)
def test_the_models_draws_follow_the_enumerated_distribution(tree):
    """Monte Carlo of the acceptance model's draw (by inversion) and of the target's choices drawn depth by depth (the
    walk), both against the enumeration."""
    ranks = (0.4, 0.2, 0.1)
    q = rank_table((0.7,), ranks)
    family = TreeFamily(tree, q)
    k = tree.num_nodes
    assert family.shape(k) == tree
    model = ConstantAcceptance(0.7, np.random.default_rng(1))
    model.ranks = ranks
    n = 40_000
    drawn = np.bincount(model.draw_tree(list(range(n)), [k] * n, family), minlength=tree.depth + 1)
    exact = enumerated(tree, q)
    assert chi_square_p(drawn, exact) > 1e-3
    rng = np.random.default_rng(2)
    probs = [0.7, 0.3 * 0.4, 0.3 * 0.2, 0.3 * 0.1]
    choices = rng.choice(len(probs) + 1, size=(n, tree.depth), p=probs + [1 - sum(probs)])
    walked = np.bincount([walk(tree, tuple(r if r < len(probs) else None for r in row)) for row in choices.tolist()],
                         minlength=tree.depth + 1)
    assert chi_square_p(walked, exact) > 1e-3


def test_beta_requests_draw_trees_with_their_own_rate():
    family = TreeFamily(TreeShape.parse(VLLM_TREE), rank_table((0.5,), (0.4, 0.2)))
    model = BetaAcceptance(0.5, 0.2, np.random.default_rng(3))
    model.ranks = (0.4, 0.2)
    for r in range(2):
        model.start(r)
    n, k = 20_000, family.num_nodes
    drawn = np.array([model.draw_tree([0, 1], [k, k], family) for _ in range(n)])
    for r in range(2):
        q = rank_table((model.rate(r),), (0.4, 0.2))
        exact = np.diff(-np.array((1.0,) + survival(family.shape(k), q) + (0.0,)))
        assert chi_square_p(np.bincount(drawn[:, r], minlength=exact.size), exact) > 1e-3


def test_replay_walks_a_chain_as_it_replays_chains(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("request_id,proposed,accepted\n" + "".join(f"{i % 3},4,{(i * 7) % 5}\n" for i in range(40)))
    trace = read_acceptance_trace(str(path))
    chains, walks = ReplayAcceptance(trace, np.random.default_rng(5)), ReplayAcceptance(trace, np.random.default_rng(5))
    walks.ranks = (0.5, 0.3)
    family = TreeFamily(TreeShape.chain(6), ((0.8, 0.1),))
    for r in range(3):
        chains.start(r)
        walks.start(r)
    for step in range(200):
        ks = [step % 7, (step + 3) % 7, 6]
        assert walks.draw_tree([0, 1, 2], ks, family) == chains.draw(np.arange(3), np.array(ks)).tolist()


# -- the family ------------------------------------------------------------------------------------------------------
def subtrees(tree: TreeShape, k: int):
    """Every k-node subset of the tree's nodes that holds every prefix of its paths."""
    for nodes in itertools.combinations(tree.paths, k):
        chosen = set(nodes)
        if all(len(p) == 1 or p[:-1] in chosen for p in nodes):
            yield TreeShape(tuple(nodes))


@pytest.mark.parametrize("tree", TREES, ids=str)
def test_the_family_holds_the_best_subtree_of_every_size(tree):
    family = TreeFamily(tree, Q)
    for k in range(tree.num_nodes + 1):
        shape = family.shape(k)
        assert shape.num_nodes == k and TreeShape.from_paths(shape.paths or [(0,)]) is not None
        assert set(family.shape(k - 1).paths) <= set(shape.paths) if k else shape.paths == ()
        best = max(expected_accepted(s, Q) for s in subtrees(tree, k)) if k else 0.0
        assert expected_accepted(shape, Q) == pytest.approx(best, abs=1e-12)
    chain = TreeFamily(TreeShape.chain(5), Q)
    assert [chain.shape(k) for k in range(6)] == [TreeShape.chain(k) for k in range(6)]


# -- the step formula's tree form ------------------------------------------------------------------------------------
class Recording:
    """A cost model that records its calls and prices each by its arguments."""

    def __init__(self):
        self.calls = []

    def target_time(self, batch_size, query_tokens, context_tokens):
        self.calls.append(("target", batch_size, query_tokens, context_tokens))
        return 1.0

    def draft_time(self, batch_size, context_tokens, query_tokens=None):
        self.calls.append(("draft", batch_size, context_tokens, query_tokens))
        return 0.1

    def overhead_time(self, batch_size):
        return 0.01


def test_a_tree_step_is_one_verification_and_a_draft_pass_per_depth():
    cost = Recording()
    tree = TreeShape.parse("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")  # expanded by depth 1, 2, 1
    seconds = predict_tree_seconds(cost, [100, 50, 70], [tree, TreeShape.chain(1), TreeShape.chain(0)], True)
    assert cost.calls == [
        ("target", 3, (6 + 1) + (1 + 1) + 1, 220),  # every node and the bonus of every sequence, caches read once
        ("draft", 2, 100 + 50, None),  # pass 1: the root of the two trees, one token each
        ("draft", 1, 100 + 1, 2),  # pass 2: (0,) and (1,) of the first tree, its cache one token longer
        ("draft", 1, 100 + 3, None),  # pass 3: (0, 0)
    ]
    assert seconds == pytest.approx(1.0 + 0.01 + 3 * 0.1)


def test_chains_priced_by_the_tree_form_are_the_chain_form_bit_for_bit():
    cost = load_cost_model(PROFILE)
    rng = np.random.default_rng(0)
    for _ in range(200):
        batch = int(rng.integers(1, 40))
        ctx = rng.integers(1, 4000, batch).tolist()
        ks = rng.integers(0, 8, batch).tolist() if rng.random() < 0.7 else [int(rng.integers(0, 8))] * batch
        assert predict_tree_seconds(cost, ctx, [TreeShape.chain(k) for k in ks], True) == \
            predict_step_seconds(cost, ctx, ks, True)


def test_a_uniform_tree_step_priced_without_a_step_is_the_step_and_moves_are_exact():
    cost = load_cost_model(PROFILE)
    family = TreeFamily(TreeShape.sglang(5, 4, 16, Q), Q)
    rng = np.random.default_rng(1)
    for _ in range(100):
        batch = int(rng.integers(1, 30))
        ctx = rng.integers(1, 3000, batch).tolist()
        price = uniform_tree_pricer(cost, batch, [family.shape(j) for j in range(16)], True)
        assert price(sum(ctx)) == [predict_tree_seconds(cost, ctx, [family.shape(j)] * batch, True) for j in range(16)]
        ks = rng.integers(0, 16, batch).tolist()
        i, new = int(rng.integers(batch)), int(rng.integers(0, 16))
        moved = tree_step(ctx, [family.shape(k) for k in ks]).moved(family.shape(ks[i]), family.shape(new), ctx[i])
        ks[i] = new
        assert moved == tree_step(ctx, [family.shape(k) for k in ks])


# -- the engine --------------------------------------------------------------------------------------------------------
BASE = dict(profile=PROFILE, rate=6.0, num_requests=150, seed=3, length_dist="lognormal", prompt_len=300,
            output_len=100)


def same_results(a, b) -> None:
    summary = {k: v for k, v in a.summary.items() if k not in ("wall_seconds", "config_hash")}
    other = {k: v for k, v in b.summary.items() if k not in ("wall_seconds", "config_hash")}
    assert summary == other
    for column, values in a.recorder.columns().items():
        assert np.array_equal(values, b.recorder.columns()[column], equal_nan=True), column


@pytest.mark.parametrize("fields", [dict(policy="fixed-k"), dict(policy="goodput"),
                                    dict(policy="fixed-k", scheduler="chunked-prefill", acceptance="beta"),
                                    dict(policy="goodput", policy_params=(("mode", "request"),), save_steps=True)])
def test_a_chain_given_as_a_tree_is_todays_chain_bit_for_bit(fields):
    chain = run_simulation(SimConfig.of(k=4, **BASE, **fields))
    for tree in (dict(speculative_token_tree="[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]"),
                 dict(speculative_num_steps=4, speculative_eagle_topk=1, speculative_num_draft_tokens=5)):
        same_results(chain, run_simulation(SimConfig.of(k=4, **BASE, **fields, **tree)))


@pytest.mark.parametrize("fields, method", [
    (dict(policy="fixed-k", k=7, **SGLANG), "_uniform_run"),
    (dict(policy="fixed-k", k=5, speculative_token_tree=VLLM_TREE, acceptance="beta", num_gpu_blocks=300),
     "_uniform_run"),
    (dict(policy="fixed-k", k=8, speculative_token_tree=VLLM_TREE, scheduler="chunked-prefill"), "_uniform_run"),
    (dict(policy="goodput", k=7, **SGLANG), "_adaptive_run"),
    (dict(policy="goodput", k=8, speculative_token_tree=VLLM_TREE, acceptance_rate=0.2, num_gpu_blocks=300),
     "_adaptive_run"),
])
def test_a_trees_runs_of_steps_are_its_steps_one_by_one(monkeypatch, fields, method):
    """Speed shortcuts: a stationary policy's uniform runs and goodput's plain-Python runs of tree steps are the
    per-step path's steps, and so are they with every shortcut of issue 30 off (goodput's decision spans and kept
    tree numbers, the pricers' linear forms, the engine's kept pricers, the uniforms drawn in blocks)."""
    from policies import step_time
    from policies.goodput import Goodput
    from simulator.core import runs as runs_module
    from simulator.core.runs import DecodeRuns
    from simulator.inputs import acceptance

    taken = []
    original = getattr(DecodeRuns, method)
    monkeypatch.setattr(DecodeRuns, method, lambda self, *args: taken.append(1) or original(self, *args))
    runs = run_simulation(SimConfig.of(**BASE, **fields))
    assert taken
    same_results(runs, run_simulation(SimConfig.of(**BASE, **fields), step_by_step=True))
    for owner, flag in ((Goodput, "spans"), (Goodput, "fast_trees"), (step_time, "TREE_PRICER"),
                        (step_time, "STEP_PRICER"), (runs_module, "KEPT_PRICERS"), (acceptance, "TREE_UNIFORMS")):
        monkeypatch.setattr(owner, flag, False)
    same_results(runs, run_simulation(SimConfig.of(**BASE, **fields)))


def test_a_tree_run_verifies_nodes_and_accepts_at_most_its_depth():
    config = SimConfig.of(**{**BASE, "length_dist": "fixed"}, policy="fixed-k", k=8, speculative_token_tree=VLLM_TREE,
                          save_steps=True, num_gpu_blocks=400)
    result = run_simulation(config)
    steps = result.steps[result.steps["kind"] == "decode"]
    requests = result.requests
    assert (requests["output_tokens"] == 100).all()
    assert (requests["proposed_tokens"] > 0).all()
    # every decode step verifies the 8 nodes of each request; the tree is 4 deep, so at most 4 accepted a step
    assert (steps["proposed"] == 8 * steps["batch_size"]).all()
    per_step = result.summary["mean_acceptance_length"]
    assert 1.0 < per_step <= 5.0
    tree = TreeShape.parse(VLLM_TREE)
    want = expected_accepted(tree, rank_table((0.8,), config.speculative.acceptance_ranks)) + 1
    assert per_step == pytest.approx(want, rel=0.05)


# -- configuration and the command line ------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, problem", [
    (dict(speculative_token_tree="[(0,), (1,)]", k=3), "--k 3 is more than the token tree's 2 nodes"),
    (dict(speculative_token_tree="[(0,), (1,)]", k=2, **SGLANG), "give the tree once"),
    (dict(speculative_num_steps=3, k=2), "needs all of --speculative-num-steps, --speculative-eagle-topk"),
    (dict(speculative_token_tree="[(0,), (1,)]", k=2, proposer="ngram"), "a token tree needs a model proposer"),
    (dict(acceptance_ranks=(0.7, 0.4), speculative_token_tree="[(0,), (1,)]", k=2), "must sum to at most 1"),
    (dict(acceptance_ranks=(0.5,)), "acceptance_ranks\\) are used only with a token tree"),
    (dict(acceptance="by-rank"), "acceptance=by-rank needs --acceptance-by-rank FILE"),
    (dict(acceptance_by_rank="x.csv"), "is read only with acceptance=by-rank"),
])
def test_a_tree_config_that_cannot_run_is_one_line(fields, problem):
    with pytest.raises(UserError, match=problem):
        SimConfig.of(rate=1.0, num_requests=5, **fields)


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_line_takes_vllms_and_sglangs_tree_flags(capsys, tmp_path):
    common = ["simulate", "--profile", PROFILE, "--rate", "4", "--num-requests", "20", "--policy", "fixed-k"]
    code, _, err = run_cli(capsys, *common, "--speculative-token-tree", "[(0,), (1,), (0, 0)]", "--out",
                           str(tmp_path / "vllm"))
    assert code == 0, err
    saved = json.loads((tmp_path / "vllm" / "config.json").read_text())["speculative"]
    assert saved["k"] == 3 and saved["speculative_token_tree"] == "[(0,), (1,), (0, 0)]"  # k: the tree's size
    code, _, err = run_cli(capsys, *common, "--speculative-num-steps", "5", "--speculative-eagle-topk", "4",
                           "--speculative-num-draft-tokens", "8", "--k", "5", "--out", str(tmp_path / "sglang"))
    assert code == 0, err
    assert json.loads((tmp_path / "sglang" / "config.json").read_text())["speculative"]["k"] == 5
    code, _, err = run_cli(capsys, *common, "--speculative-token-tree", "[(0,), (2, 0)]", "--out", str(tmp_path / "x"))
    assert code == 2 and err.strip().count("\n") == 0 and "path (2, 0) has no parent (2,)" in err


def test_a_measured_rank_table_selects_the_by_rank_model(capsys, tmp_path):
    table = tmp_path / "ranks.csv"
    table.write_text("depth,rank,probability\n1,0,0.7\n1,1,0.1\n2,0,0.6\n2,1,0\n2,2,0.05\n")
    code, _, err = run_cli(capsys, "simulate", "--profile", PROFILE, "--rate", "4", "--num-requests", "20",
                           "--policy", "fixed-k", "--speculative-token-tree", VLLM_TREE, "--acceptance-by-rank",
                           str(table), "--out", str(tmp_path / "o"))
    assert code == 0, err
    saved = json.loads((tmp_path / "o" / "config.json").read_text())["speculative"]
    assert saved["acceptance"] == "by-rank" and saved["k"] == 8


# -- the goodput policy's belief over trees ----------------------------------------------------------------------------
def test_the_tree_estimate_of_a_chain_is_the_tokens_estimator():
    """Online EM from accepted lengths: on a chain a length l of k is l ranks 0 and l + [l < k] trials whatever the
    rate, so the estimate is the chain's ratio of moving averages of accepted tokens and trials, bit for bit, and the
    rate believed in is the grid cell that holds it."""
    from policies.base import StepOutcome
    from policies.goodput import GRID, Goodput

    tree, chain = Goodput(6), Goodput(6)
    tree._belief(TreeFamily(TreeShape.chain(6), Q))  # the tree path, fed chain outcomes
    rng = np.random.default_rng(0)
    for step in range(300):
        proposed = rng.integers(0, 7, 5)
        accepted = np.minimum(rng.geometric(0.35, 5) - 1, proposed)
        for policy in (tree, chain):
            policy.observe(StepOutcome(0.0, np.arange(5), proposed, accepted, 0.01))
        assert tree._tree_pair == chain._global
        assert abs(tree.tree_rate() - chain.acceptance_estimate) <= 0.5 / GRID + 1e-12


def _enumerated_counts(family, a):
    """E[ranks 0 | l] and E[trials | l] of each shape k and accepted length l at top-1 rate ``a``, by walking every
    sequence of the target's ranks (0, each candidate rank, or beyond them all) under the family's rank model: the
    path passes each node in the shape; where it stops at a node with children in the shape, the rank it stopped on
    is one more trial (a rank 0 where that child is missing)."""
    from policies.goodput import _conditional_rank

    ranks = max(len(row) for row in family.q)
    out = {}
    for k in range(1, family.num_nodes + 1):
        shape = family.shape(k)
        sums = {}

        def walk(node, p, zeros, trials):
            depth = len(node) + 1
            g = [_conditional_rank(family.q, depth, r) for r in range(1, ranks)]
            options = [(0, a)] + [(r, (1 - a) * gr) for r, gr in enumerate(g, 1)] + [(None, (1 - a) * (1 - sum(g)))]
            children = any(shape.has(node + (r,)) for r in range(ranks))
            for r, pr in options:
                if pr == 0:
                    continue
                if r is not None and shape.has(node + (r,)):
                    walk(node + (r,), p * pr, zeros + (r == 0), trials + 1)
                else:
                    extra = (r == 0, 1) if children else (0, 0)
                    s = sums.setdefault(len(node), [0.0, 0.0, 0.0])
                    s[0] += p * pr
                    s[1] += p * pr * (zeros + extra[0])
                    s[2] += p * pr * (trials + extra[1])

        walk((), 1.0, 0, 0)
        out[k] = {length: (z / p, t / p) for length, (p, z, t) in sums.items()}
    return out


@pytest.mark.parametrize("tree", [VLLM_TREE, "[(1,), (2,), (1, 0), (1, 1), (2, 0)]", "sglang"])
def test_the_expected_ranks_and_trials_of_a_length_are_those_of_every_path_of_the_target(tree):
    """The E-step of the tree estimate (``_TreeBelief``'s closed form) against exhaustive enumeration of the target's
    ranks, on vLLM's tree, one without rank-0 children (the draft's first choice left out) and SGLang's default tree,
    at several grid rates."""
    from policies.goodput import _TreeBelief

    q = rank_table((0.5,), (0.4, 0.2, 0.1, 0.05))
    shape = TreeShape.sglang(5, 4, 8, q) if tree == "sglang" else TreeShape.parse(tree)
    belief = _TreeBelief(TreeFamily(shape, q))
    for at in (7, 60, 100, 151, 190):
        want = _enumerated_counts(belief.family, float(belief.grid[at]))
        hits, trials = belief.counts_at(at)
        for k, by_length in want.items():
            for length, (z, t) in by_length.items():
                assert (hits[k][length], trials[k][length]) == pytest.approx((z, t), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("rate", [0.2, 0.55, 0.9])
@pytest.mark.parametrize("tree", [VLLM_TREE, "sglang"])
def test_the_tree_estimate_finds_the_rate_the_lengths_were_drawn_at(rate, tree):
    """Distribution-level: accepted lengths drawn by the simulator's acceptance model over the family's shapes (a mix of
    shapes, as goodput's decisions make them) at a known top-1 rate; the estimate settles on it."""
    from policies.base import StepOutcome
    from policies.goodput import Goodput

    ranks = (0.4, 0.2, 0.1, 0.05)
    q = rank_table((0.5,), ranks)
    shape = TreeShape.sglang(5, 4, 8, q) if tree == "sglang" else TreeShape.parse(tree)
    family = TreeFamily(shape, q)
    model = ConstantAcceptance(rate, np.random.default_rng(7))
    model.ranks = ranks
    policy = Goodput(family.num_nodes, ema_weight=0.01)
    policy._belief(family)
    rng, estimates = np.random.default_rng(8), []
    for step in range(4000):
        ks = rng.integers(0, family.num_nodes + 1, 8).tolist()
        policy.observe(StepOutcome(0.0, np.arange(8), np.array(ks), np.array(model.draw_tree(list(range(8)), ks,
                                                                                            family)), 0.01))
        if step >= 1000:
            estimates.append(policy._tree_pair[0] / policy._tree_pair[1])
    assert np.mean(estimates) == pytest.approx(rate, abs=0.015)


class FlatTreeCost:
    """Target 10 ms a pass and 0.2 ms a verified token, a draft pass 1 ms."""

    def target_time(self, batch_size, query_tokens, context_tokens):
        return 0.010 + 0.0002 * query_tokens

    def draft_time(self, batch_size, context_tokens, query_tokens=None):
        return 0.001

    def overhead_time(self, batch_size):
        return 0.0


def test_goodput_learns_each_requests_rate_and_gives_it_its_shape():
    from policies.base import BatchView, StepOutcome
    from policies.registry import make_policy

    ranks = (0.6, 0.3)
    family = TreeFamily(TreeShape.parse(VLLM_TREE), rank_table((0.5,), ranks))
    policy = make_policy("goodput", 8, {"mode": "request", "acceptance": "request"})
    rates = [0.05, 0.5, 0.97]
    models = []
    for i, rate in enumerate(rates):
        model = ConstantAcceptance(rate, np.random.default_rng(i))
        model.ranks = ranks
        models.append(model)
    ids = np.arange(3)
    view = BatchView(time=0.0, request_ids=ids, context_lens=np.full(3, 500), generated=np.ones(3, dtype=np.int64),
                     num_waiting=0, cost_model=FlatTreeCost(), max_k=8, tree=family)
    for _ in range(400):
        ks = policy.propose(view)
        accepted = np.array([m.draw_tree([i], [int(k)], family)[0] for i, (m, k) in enumerate(zip(models, ks))])
        policy.observe(StepOutcome(0.0, ids, ks, accepted, 0.01))
    assert [policy.tree_rate(i) for i in range(3)] == pytest.approx(rates, abs=0.12)
    # the nearly-always-accepting request verifies the whole tree (its 4-deep chain); the nearly-never-accepting one
    # the draft's second and third choices (1,) and (2,) with the fewest nodes that hold them
    ks = policy.propose(view).tolist()
    assert ks[0] < ks[1] <= ks[2] == 8
    assert family.shape(ks[0]).paths == ((0,), (1,), (2,), (0, 0))


def test_a_trees_first_pass_is_priced_at_the_drafts_catch_up_as_a_chains():
    """Where the cost model prices a draft pass of several tokens per sequence, a tree's first pass feeds each request
    the tokens its draft has not seen, as a chain's does: chains priced by the tree form with lags are
    ``catchup_step_seconds`` bit for bit, and a tree run with catch-up pricing keeps the lags step by step."""
    from policies.step_time import catchup_step_seconds

    base = load_cost_model(PROFILE)

    class CatchUp(type(base)):
        prices_catchup = True

    cost = CatchUp(base._coef, method=base.method, source=base.source, path=base.path, memory=base.memory,
                   grid=base._grid)
    rng = np.random.default_rng(2)
    for _ in range(100):
        batch = int(rng.integers(1, 30))
        ctx, ks, lags = (rng.integers(1, 3000, batch).tolist(), rng.integers(0, 6, batch).tolist(),
                         rng.integers(1, 5, batch).tolist())
        assert predict_tree_seconds(cost, ctx, [TreeShape.chain(k) for k in ks], True,
                                    [g for g, k in zip(lags, ks) if k]) == catchup_step_seconds(cost, ctx, ks, lags)
    config = SimConfig.of(**BASE, policy="fixed-k", k=8, speculative_token_tree=VLLM_TREE)
    caught_up, plain = run_simulation(config, cost=cost), run_simulation(config, cost=base)
    assert caught_up.summary["mean_latency"] != plain.summary["mean_latency"]
    assert caught_up.recorder.finished == plain.recorder.finished == 150


def test_one_table_for_a_batch_of_one_shape_draws_as_request_by_request():
    """Speed shortcut of ``AcceptanceModel.draw_tree``: a batch all verifying one shape under one rank table inverts
    that table for everyone; the plain path (``shared_ranks`` False) fetches it request by request: the same draws."""
    family = TreeFamily(TreeShape.parse(VLLM_TREE), rank_table((0.6,), (0.4, 0.2)))
    fast, plain = (ConstantAcceptance(0.6, np.random.default_rng(9)) for _ in range(2))
    plain.shared_ranks = False
    for model in (fast, plain):
        model.ranks = (0.4, 0.2)
    for step in range(300):
        ks = [step % 9] * (step % 13 + 1) if step % 3 else [(step + j) % 9 for j in range(step % 13 + 1)]
        ids = list(range(len(ks)))
        assert fast.draw_tree(ids, ks, family) == plain.draw_tree(ids, ks, family)
