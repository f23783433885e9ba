"""Token trees and the EAGLE head in the real engine, on tiny random models: greedy output identical to the target
alone for trees of several shapes and batches, on both forward paths; the tree sampler's output distributed as the
target's (exact enumeration against many draws); the caches after an accepted path equal fresh runs of the kept
tokens; acceptance by depth and rank as the engine's own steps count it; a few steps of head training; bad input."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from policies.errors import UserError  # noqa: E402
from policies.registry import make_policy  # noqa: E402
from policies.tree import TreeFamily, TreeShape  # noqa: E402
from profiles.acceptance import (RANK_COLUMNS, draft_ranks, head_ranks, rank_table_frame,  # noqa: E402
                                 walk_ranks, write_rank_table)
from profiles.models import forward  # noqa: E402
from profiles.models.eagle_head import EagleHead  # noqa: E402
from profiles.serving.engine import RealEngineConfig, RealEngine, StepRunner  # noqa: E402
from profiles.serving.generate import generate  # noqa: E402
from profiles.serving.kv import PaddedBatch, SlotBatch  # noqa: E402
from profiles.serving.token_tree import DraftTree, grow  # noqa: E402
from profiles.serving.tree_sampler import walk_greedy, walk_sampled  # noqa: E402
from simulator.inputs.acceptance import read_rank_table  # noqa: E402
from simulator.inputs.workload import Workload  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_thread")]
#: Trees verified below: 7 nodes three ranks wide, a binary tree of depth 2, SGLang-like 5 nodes of depth 3.
SHAPES = {"wide": TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
          "binary": TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]),
          "deep": TreeShape.from_paths([(0,), (1,), (0, 0), (0, 0, 0), (1, 0)])}
RANKS = ((0.6, 0.2, 0.1), (0.5, 0.2, 0.1))  # orders each family's nodes (the families verify every node here)


def family(shape: TreeShape) -> TreeFamily:
    return TreeFamily(shape, RANKS)


@pytest.fixture(scope="module")
def close_draft(pair):
    """The target with noise on its output head: its argmax is often the target's, its second choice often too."""
    draft = copy.deepcopy(pair.target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=gen) * head.std() * 0.3)
    return draft


@pytest.fixture(scope="module")
def head_pair():
    """A one-layer target and an EAGLE head that is that layer, fc passing the token's embedding on: the head then
    computes the target's own pass over the context shifted by one token, so it agrees with the target often, not
    always (the head never sees the prompt's first token)."""
    target = forward.build_model(forward.load_config("tiny-target", "test", num_layers=1), "fp32",
                                 torch.device("cpu"), seed=0)
    head = EagleHead(target)
    head.init_from_target(target)
    with torch.no_grad():
        hidden = target.config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
    return target, head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(4, 24, 5)]
    return Workload(np.linspace(0.0, 0.02, 5), [len(p) for p in prompts], [12, 2, 9, 16, 7], "test"), prompts


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target alone, one unpadded sequence, one token per pass."""
    logits, cache = forward.prefill_pass(model, torch.tensor([prompt]))
    out = [int(logits[0, -1].argmax())]
    while len(out) < n:
        logits = forward.decode_pass(model, cache, torch.tensor([[out[-1]]]))
        out.append(int(logits[0, -1].argmax()))
    return out


def serve(target, drafter, workload, prompts, shape, method, seqs=3, temperature=0.0, forward_path="eager",
          seed=0):
    config = RealEngineConfig(max_num_seqs=seqs, max_k=shape.num_nodes, tree=family(shape),
                              speculative_method=method, temperature=temperature, forward=forward_path)
    engine = RealEngine(target, drafter, config, make_policy("fixed-k", shape.num_nodes), None,
                        np.random.default_rng(seed))
    paths = []
    verify = engine.runner.verify_tree

    def recorded(kv, roots, trees, decided=None, features=False):
        out = verify(kv, roots, trees, decided, features)
        paths.extend((tree, path) for tree, path in zip(trees, out[0]))
        return out

    engine.runner.verify_tree = recorded
    return engine.run(workload, prompts), paths


def off_rank_zero(paths) -> int:
    """Accepted nodes that were not their parent's first child."""
    return sum(tree.children(tree.parents[n]).index(n) > 0 for tree, path in paths for n in path)


# -- greedy: the target's output --------------------------------------------------------------------------
@pytest.mark.parametrize("forward_path", ["eager", "optimized"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_greedy_tree_output_is_the_targets(pair, close_draft, head_pair, requests, method, shape, forward_path):
    workload, prompts = requests
    target, drafter = (pair.target, close_draft) if method == "draft_model" else head_pair
    result, paths = serve(target, drafter, workload, prompts, SHAPES[shape], method, forward_path=forward_path)
    assert result.outputs == [reference_greedy(target, p, int(n)) for p, n in zip(prompts, workload.output_tokens)]
    assert 0 < result.summary["acceptance_rate"] < 1
    assert off_rank_zero(paths) > 0  # the target's path left the draft's first choice: the tree mattered
    steps = result.acceptance
    assert (steps["proposed"] == SHAPES[shape].num_nodes).all() and (steps["accepted"] <= SHAPES[shape].depth).all()


def test_greedy_head_chain_alone_in_a_batch_of_one(head_pair, requests):
    """A head without a tree drafts chains (through the tree code) and still gives the target's output."""
    target, head = head_pair
    workload, prompts = requests
    engine = RealEngine(target, head, RealEngineConfig(max_num_seqs=1, max_k=3, speculative_method="eagle"),
                        make_policy("fixed-k", 3), None, np.random.default_rng(0))
    result = engine.run(workload, prompts)
    assert result.outputs == [reference_greedy(target, p, int(n)) for p, n in zip(prompts, workload.output_tokens)]
    assert result.summary["mean_acceptance_length"] > 1.5


# -- the sampler: the target's distribution ---------------------------------------------------------------
def test_greedy_walk_follows_the_targets_argmax_down_the_tree():
    tree = DraftTree()
    a, b = tree.add(5, -1), tree.add(6, -1)      # root's children: 5 (rank 0), 6 (rank 1)
    c, d = tree.add(7, b), tree.add(8, b)        # 6's children
    #            root  a  b  c  d
    argmax = [6, 1, 8, 2, 3]
    assert walk_greedy(tree, argmax) == ([b, d], 3)   # 6 then 8 accepted, the bonus token after 8
    assert walk_greedy(tree, [9, 0, 0, 0, 0]) == ([], 9)  # no child: the recovered token
    assert walk_greedy(tree, [5, 4, 0, 0, 0]) == ([a], 4)
    assert walk_greedy(tree, [6, 0, 7, 4, 0]) == ([b, c], 4)


def drafted(shape, p_root, p_next, q_root, q_next, rng) -> tuple[DraftTree, np.ndarray]:
    """A tree of ``shape`` drafted from q (without replacement, :func:`grow`) over a two-token horizon, and the
    target's distributions after its root and after each node (after a depth-2 node: any, the walk only draws its
    bonus token from it)."""
    def expand(trees, nodes):
        return torch.log(torch.tensor(np.stack([q_next[trees[0].tokens[n]] for n in nodes[0]])))[None]

    (tree,), _ = grow([shape], torch.log(torch.tensor(q_root))[None], expand, 1.0, rng)
    return tree, np.stack([p_root] + [p_next[tree.tokens[n]] if tree.depths[n] == 1 else p_root
                                      for n in range(tree.size)])


def test_tree_sampling_emits_the_targets_distribution_and_more_than_a_chain_accepts():
    """Recursive rejection sampling over siblings drawn without replacement: the first two tokens of a step follow
    the target's joint distribution p(x) p(y | x) (chi-square over every pair; a step that emitted one token gets its
    second from the target, as the next step would draw it losslessly), whatever the draft; the test can fail (the
    draft's own joint is rejected); and three candidates at the root are accepted more often than one would be
    (a chain accepts with probability sum_x min(p(x), q(x)), Leviathan et al. 2023)."""
    from scipy.stats import chisquare

    rng = np.random.default_rng(0)
    vocab = 5
    p_root, q_root = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    p_next, q_next = rng.dirichlet(np.ones(vocab), vocab), rng.dirichlet(np.ones(vocab), vocab)
    shape = TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    n = 4000
    counts = np.zeros((vocab, vocab))
    root_accepted = 0
    for _ in range(n):
        tree, p = drafted(shape, p_root, p_next, q_root, q_next, rng)
        path, token = walk_sampled(tree, p, rng)
        tokens = [tree.tokens[m] for m in path] + [token]
        if len(tokens) == 1:
            tokens.append(int(rng.choice(vocab, p=p_next[tokens[0]])))
        counts[tokens[0], tokens[1]] += 1
        root_accepted += len(path) > 0
    assert chisquare(counts.ravel(), (p_root[:, None] * p_next).ravel() * n).pvalue > 1e-3
    assert chisquare(counts.ravel(), (q_root[:, None] * q_next).ravel() * n).pvalue < 1e-9
    assert root_accepted / n > np.minimum(p_root, q_root).sum() + 0.1


def small_vocab_model(seed: int, scale: float):
    """A one-layer tiny Llama over 6 tokens, its output head scaled by ``scale`` (peaked distributions)."""
    config = forward.load_config("tiny-target", "test", num_layers=1)
    config.vocab_size = 6
    model = forward.build_model(config, "fp32", torch.device("cpu"), seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@torch.inference_mode()
def target_joint(model, prompt: list[int]) -> np.ndarray:
    """P(first three output tokens) under ``model`` at temperature 1, by enumeration ``(V, V, V)``."""
    vocab = model.config.vocab_size
    def dist(prefixes):
        logits = model(input_ids=torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -1]
        return torch.softmax(logits.double(), dim=-1).numpy()
    first = dist([()])[0]
    second = dist([(a,) for a in range(vocab)])
    third = dist([(a, b) for a in range(vocab) for b in range(vocab)]).reshape(vocab, vocab, vocab)
    return first[:, None, None] * second[:, :, None] * third


def test_sampled_tree_serving_emits_the_targets_distribution():
    """1,000 requests of one prompt served with sampled tree speculation (a 6-token vocabulary, so that the draft's
    support runs out under the three-wide root): the joints of their (first, second) and (second, third) output
    tokens match the target's, enumerated exactly (chi-square), and not the draft's."""
    from scipy.stats import chisquare

    target, draft = small_vocab_model(0, 8.0), small_vocab_model(1, 8.0)
    prompt, n = [1, 4, 2], 1000
    workload = Workload(np.zeros(n), [3] * n, [3] * n, "one prompt")
    shape = TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    result, _ = serve(target, draft, workload, [prompt] * n, shape, "draft_model", seqs=128, temperature=1.0)
    outputs = np.array(result.outputs)
    joint, drafts = target_joint(target, prompt), target_joint(draft, prompt)
    for axes, pair in (((2,), (0, 1)), ((0,), (1, 2))):
        counts = np.zeros((6, 6))
        np.add.at(counts, (outputs[:, pair[0]], outputs[:, pair[1]]), 1)
        assert chisquare(counts.ravel(), joint.sum(axis=axes).ravel() * n).pvalue > 1e-3
        assert chisquare(counts.ravel(), drafts.sum(axis=axes).ravel() * n).pvalue < 1e-9
    assert 0 < result.summary["acceptance_rate"] < 1


def test_sampled_tree_with_the_target_as_its_own_draft_accepts_the_first_path(pair, requests):
    """p = q at every node: the first child is always accepted, so every step accepts the tree's full depth along
    rank 0 (the target's and the draft's distributions are aligned node by node)."""
    workload, prompts = requests
    shape = SHAPES["deep"]
    result, paths = serve(pair.target, pair.target, workload, prompts, shape, "draft_model", temperature=1.0)
    assert (result.acceptance["accepted"] == shape.depth).all()
    assert off_rank_zero(paths) == 0


@pytest.mark.parametrize("forward_path", ["eager", "optimized"])
def test_sampled_trees_of_the_head_serve_every_request(head_pair, requests, forward_path):
    """The head's trees sampled (children drawn without replacement from its distributions, walked by recursive
    rejection sampling): every request gets its tokens, some drafted tokens accepted, not all."""
    target, head = head_pair
    workload, prompts = requests
    result, paths = serve(target, head, workload, prompts, SHAPES["wide"], "eagle", temperature=1.0,
                          forward_path=forward_path)
    assert [len(o) for o in result.outputs] == workload.output_tokens.tolist()
    assert 0 < result.summary["acceptance_rate"] < 1
    assert all(len(path) <= tree.size for tree, path in paths)


# -- caches after an accepted path -------------------------------------------------------------------------
def held_keys(kv, row: int, layer: int = 0) -> torch.Tensor:
    """The keys of row ``row``'s tokens, in order, ``(kv_heads, tokens, head_dim)``, on either path."""
    if isinstance(kv, PaddedBatch):
        return kv.batch.cache.layers[layer].keys[row][:, kv.batch.valid[row]]
    return kv.cache.keys[layer][row, :, :kv.lengths()[row]]


@pytest.mark.parametrize("kind", [PaddedBatch, SlotBatch])
def test_tree_verification_keeps_exactly_the_accepted_path(pair, kind):
    """A tree holding the target's greedy continuation at rank 1 then rank 0: the path and the bonus token are the
    target's, and the target's cache then equals a fresh run of the prompt and the emitted tokens (the rejected
    branches' keys are gone, the path's moved next to the context)."""
    model = pair.target
    runner = StepRunner(model, None, 0.0, np.random.default_rng(0))
    prompts = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23]]
    kv = kind(model) if kind is PaddedBatch else kind(model, 4, 64)
    first = runner.first_tokens(runner.prefill(kv, prompts))
    greedy = [reference_greedy(model, p, 4) for p in prompts]
    trees = []
    for g in greedy:
        tree = DraftTree()                              # in canonical order: by depth, then by path
        wrong = tree.add((g[1] + 1) % 1000, -1)         # node 0, path (0,)
        right = tree.add(g[1], -1)                      # node 1, path (1,): rank 1 holds the target's token
        tree.add(g[2], wrong)                           # node 2, path (0, 0): the right token, the wrong parent
        tree.add(g[2], right)                           # node 3, path (1, 0)
        tree.add((g[2] + 7) % 1000, right)              # node 4, path (1, 1)
        trees.append(tree)
    paths, tokens, _ = runner.verify_tree(kv, first, trees)
    assert paths == [[1, 3], [1, 3]] and tokens == [g[3] for g in greedy]
    assert kv.lengths() == [len(p) + 3 for p in prompts]
    for row, (prompt, g) in enumerate(zip(prompts, greedy)):
        fresh = PaddedBatch(model)
        fresh.prefill([prompt + g[:3]])
        for layer in (0, 3):
            assert torch.allclose(held_keys(kv, row, layer), held_keys(fresh, 0, layer), atol=1e-5)


@pytest.mark.parametrize("forward_path", ["eager", "optimized"])
def test_draft_and_head_caches_hold_the_context_after_every_step(pair, close_draft, head_pair, requests,
                                                                 forward_path):
    """After every tree step: the draft model's cache plus its pending tokens spell the context, and its cache equals a
    fresh run of those tokens; the head's cache plus its pending pairs cover every context position but the last, and
    its cache equals a fresh head run over the target's true features (drafted nodes never stay in it)."""
    workload, prompts = requests
    checked = []
    for method, (target, drafter) in (("draft_model", (pair.target, close_draft)), ("eagle", head_pair)):
        engine = RealEngine(target, drafter, RealEngineConfig(max_num_seqs=3, max_k=7, tree=family(SHAPES["wide"]),
                                                              speculative_method=method, forward=forward_path),
                            make_policy("fixed-k", 7), None, np.random.default_rng(0))
        step = engine._decode_step

        def checked_step(*args, engine=engine, method=method, target=target, drafter=drafter):
            step(*args)
            proposer = engine.proposer
            for i, rid in enumerate(engine.rids):
                context = prompts[rid] + engine.outputs[rid]
                held = proposer.kv.lengths()[i]
                if method == "draft_model":
                    assert held + len(proposer.pending[i]) == len(context)
                    fresh = PaddedBatch(drafter)
                    fresh.prefill([context[:held]])
                else:
                    assert held + len(proposer.tokens[i]) == len(context) - 1
                    features = target.model(input_ids=torch.tensor([context])).last_hidden_state[0]
                    fresh = PaddedBatch(drafter.model)
                    fresh.prefill_hidden([context[1:held + 1]],
                                         [drafter.fuse(features[:held], torch.tensor(context[1:held + 1]))])
                assert torch.allclose(held_keys(proposer.kv, i), held_keys(fresh, 0), atol=1e-4)
            checked.append(method)

        engine._decode_step = checked_step
        engine.run(workload, prompts)
    assert checked.count("draft_model") >= 4 and checked.count("eagle") >= 4


# -- acceptance by depth and rank ----------------------------------------------------------------------------
def test_walking_ranks_counts_steps_as_a_top_k_tree_accepts():
    #                 depth 1  2  3
    ranks = np.array([[0, 1, 5],     # root 0: depths 1, 2 accepted (ranks 0, 1), 3 rejected (rank 5)
                      [9, 9, 9],
                      [9, 9, 9],
                      [2, 0, -1],    # root 3: depth 1 rank 2 rejected with topk 2
                      [0, -1, -1],   # root 4: depth 1 accepted, nothing further measurable
                      [-1, -1, -1]])
    reached, hits = walk_ranks(ranks, topk=2)
    # steps start at roots 0 (accepts 2), 3 (accepts 0), 4 (accepts 1); root 5 is the answer's last token
    assert reached.tolist() == [3, 1, 1]
    assert hits.tolist() == [[2, 0], [0, 1], [0, 0]]


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_rank_acceptance_agrees_with_the_engines_steps(pair, close_draft, head_pair, method, tmp_path):
    """The table of acceptance by depth and rank, measured along the target's greedy answers: a CSV of depth, rank,
    probability that the simulator reads, with sums <= 1; and at depth 1 it counts exactly what the engine's steps
    verifying a one-depth tree of the first two candidates accept (rank 0 and rank 1 hits)."""
    target, drafter = (pair.target, close_draft) if method == "draft_model" else head_pair
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in (6, 11, 17)]
    n = 20
    answers, _, _, features = generate(target, prompts, n, 4, 1, rng=None, features=True)
    ranks = [draft_ranks(drafter, p, a, 3) for p, a in zip(prompts, answers)] if method == "draft_model" else \
        head_ranks(drafter, features, prompts, answers, 3)
    table, reached = rank_table_frame(ranks, topk=2)
    write_rank_table(table, str(tmp_path / "by_rank.csv"))
    assert list(table.columns) == RANK_COLUMNS and len(table) == 6
    q = read_rank_table(str(tmp_path / "by_rank.csv"))
    assert len(q) == 3 and all(len(row) == 2 and 0 < sum(row) <= 1 for row in q)
    shallow, _ = rank_table_frame([r[:, :1] for r in ranks], topk=2)
    workload = Workload(np.zeros(3), [len(p) for p in prompts], [n] * 3, "test")
    result, paths = serve(target, drafter, workload, prompts, TreeShape.from_paths([(0,), (1,)]), method)
    assert result.outputs == answers
    steps = result.acceptance
    assert len(steps) == reached_at_depth_one(shallow, ranks)
    assert shallow["probability"].tolist() == pytest.approx(
        [sum(tree.children(-1).index(p[0]) == r for tree, p in paths if p) / len(steps) for r in (0, 1)])


def reached_at_depth_one(shallow, ranks) -> int:
    """Steps a depth-1, top-2 walk takes over ``ranks``."""
    return int(sum(walk_ranks(r[:, :1], 2)[0][0] for r in ranks))


# -- the head ----------------------------------------------------------------------------------------------
def test_head_training_moves_only_the_heads_own_weights(head_pair):
    """A few optimizer steps of the EAGLE loss on the tiny target's features: the loss is finite and falls, the head's
    own weights move, the target's shared embedding and LM head do not."""
    from profiles.train_draft import train_loop
    from profiles.train_head import head_loss

    target, _ = head_pair
    head = EagleHead(target, seed=2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 1000, 8).tolist() for _ in range(4)]
    answers, _, _, features = generate(target, prompts, 6, 4, 1, rng=None, features=True)
    sequences = [p + a for p, a in zip(prompts, answers)]
    assert [len(f) for f in features] == [len(s) - 1 for s in sequences]
    with torch.inference_mode():  # the generating passes' hidden states are the target's features
        alone = target.model(input_ids=torch.tensor([sequences[0][:-1]])).last_hidden_state[0]
        assert torch.allclose(features[0], alone, atol=1e-4)
    before = {k: v.clone() for k, v in head.own_state_dict().items()}
    shared = target.lm_head.weight.clone()
    losses = []
    noise = torch.Generator().manual_seed(0)
    for p in head.own_parameters():
        p.requires_grad_(True)
    figures = train_loop(head.own_parameters(), 4, lambda b: losses.append(head_loss(
        head, [features[i] for i in b], [sequences[i] for i in b], [6] * len(b), 0.1, 1.0, 0.5, noise))
        or losses[-1], 4, 2, 3e-3, 60.0, 0, log=lambda msg: None)
    assert figures["steps"] == 8 and all(np.isfinite(float(x.detach())) for x in losses)
    assert figures["loss_per_epoch"][-1] < figures["loss_per_epoch"][0]
    assert all(not torch.equal(before[k], v) for k, v in head.own_state_dict().items() if k.startswith("fc."))
    assert torch.equal(target.lm_head.weight, shared)


# -- bad input ----------------------------------------------------------------------------------------------
def test_bad_tree_and_head_settings_are_user_errors(pair, head_pair):
    target, head = head_pair
    with pytest.raises(UserError, match="speculative_method mtp is simulated only"):
        RealEngineConfig(speculative_method="mtp")
    with pytest.raises(UserError, match="a token tree needs a model proposer"):
        RealEngineConfig(proposer="ngram", max_k=2, tree=family(SHAPES["deep"]))
    with pytest.raises(UserError, match="k=6 is more than the token tree's 5 nodes"):
        RealEngineConfig(max_k=6, tree=family(SHAPES["deep"]))
    with pytest.raises(UserError, match="speculative_method eagle needs an EAGLE head"):
        RealEngine(pair.target, pair.draft, RealEngineConfig(speculative_method="eagle"), make_policy("fixed-k", 3),
                   None, np.random.default_rng(0))
    with pytest.raises(UserError, match="needs a draft model, not an EAGLE head"):
        RealEngine(target, head, RealEngineConfig(), make_policy("fixed-k", 3), None, np.random.default_rng(0))
    engine = RealEngine(target, head, RealEngineConfig(speculative_method="eagle"), make_policy("fixed-k", 3), None,
                        np.random.default_rng(0))
    with pytest.raises(UserError, match="the EAGLE head needs prompts of at least 2 tokens"):
        engine.run(Workload([0.0], [1], [4], "t"), [[5]])
