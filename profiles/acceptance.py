"""Measured acceptance of a real draft/target pair: the simulator's replay trace, and quick greedy figures.

``python run_sim.py profile --acceptance --out profiles/data/acceptance__smollm2.csv`` serves every shipped
prompt (:func:`profiles.models.pairs.read_prompts`) with the real engine (:mod:`profiles.serving.engine`), all
arriving at once, under ``fixed-k`` speculation with the draft, and writes each request's verification steps
as ``request_id,proposed,accepted`` rows in step order: the format :class:`simulator.inputs.acceptance.ReplayAcceptance`
replays. It then prints :func:`simulator.inputs.acceptance.fit_acceptance`'s figures (pooled rate, Beta, per
position). With ``k`` as large as the simulation will ask for, the replayed streams hold every token's
accept/reject bit (the replay reads a stream recorded with k = 5 at any k <= 5).

Without running the engine, :func:`agreement_bits` and :func:`greedy_acceptance` give greedy acceptance
from one teacher-forced draft pass over the target's greedy answer: under greedy verification the draft's
token at position t is accepted iff the draft's argmax there equals the target's token, so the bits decide
every step whatever k is (:mod:`profiles.train_draft` reports them).

**By depth and rank** (token trees): ``--acceptance-by-rank FILE`` also writes ``depth,rank,probability``, the
probability that the target's token at depth d is the drafter's rank-r candidate given the path above was accepted
(:func:`measure_rank_acceptance`; the simulator's ``--acceptance-by-rank`` reads it). Along the target's greedy answers
to the shipped prompts, the drafter's rank of the target's token at each depth from each root (:func:`draft_ranks`
for a draft model, one teacher-forced pass; :func:`head_ranks` for an EAGLE head, which drafts deeper tokens from its
own estimates, one pass per depth) is walked as greedy steps through a tree holding the drafter's top ``--topk`` at
every node (:func:`walk_ranks`): q[d][r] = steps whose target token had rank r at depth d / steps that reached depth
d. Greedy only; ``--speculative-method eagle`` measures the pair's head (the trace too, its chains run by the engine).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from policies.registry import make_policy
from profiles.serving.engine import RealEngineConfig, EngineResult, RealEngine
from profiles.models.pairs import ModelPair, encode_prompts, read_prompts
from simulator.inputs.acceptance import fit_acceptance, read_acceptance_trace
from policies.errors import UserError
from simulator.costs.profile_table import write_atomic
from simulator.inputs.workload import Workload

TRACE_COLUMNS = ["request_id", "proposed", "accepted"]


@torch.inference_mode()
def agreement_bits(draft: torch.nn.Module, prompt: list[int], answer: list[int]) -> np.ndarray:
    """Bit j: whether the draft's argmax after ``prompt + answer[:j + 1]`` is ``answer[j + 1]`` (teacher forced)."""
    n = len(answer) - 1
    ids = torch.tensor([prompt + answer[:-1]])
    logits = draft(input_ids=ids, logits_to_keep=n).logits[0]
    return (logits.argmax(dim=-1) == torch.tensor(answer[1:])).numpy()


def greedy_acceptance(bits: np.ndarray, k: int) -> tuple[int, int, int]:
    """Steps of greedy speculation with ``k`` proposed tokens over agreement ``bits``: (accepted tokens, steps
    that ended in a rejection, steps). A step at bit s accepts the leading ones of ``bits[s:s + k]`` and emits
    one more token (the correction or bonus), so the next step starts ``accepted + 1`` bits later."""
    accepted = rejections = steps = s = 0
    while s < len(bits):
        window = bits[s:s + k]
        a = int(np.argmin(window)) if not window.all() else len(window)
        accepted += a
        rejections += a < len(window)
        steps += 1
        s += a + 1
    return accepted, rejections, steps


def shipped_workload(tokenizer: object, output_len: int) -> tuple[Workload, list[list[int]]]:
    """Every shipped prompt once, all arriving at time 0, ``output_len`` tokens each; and their token ids."""
    prompts = encode_prompts(tokenizer, read_prompts())
    n = len(prompts)
    return Workload(np.zeros(n), [len(p) for p in prompts], np.full(n, output_len), "shipped prompts"), prompts


def measure_acceptance(pair: ModelPair, k: int, output_len: int, max_num_seqs: int, temperature: float,
                       seed: int, method: str = "draft_model") -> EngineResult:
    """Serve the shipped prompts with ``fixed-k`` speculation (the engine's draft model, or its EAGLE head with
    ``method`` eagle) and return the run."""
    if pair.draft is None or pair.tokenizer is None:
        raise UserError(f"--acceptance: the {pair.name} pair has no draft model or no tokenizer")
    if k < 1:
        raise UserError(f"--k: must be >= 1 to measure acceptance (got {k})")
    workload, prompts = shipped_workload(pair.tokenizer, output_len)
    config = RealEngineConfig(max_num_seqs=max_num_seqs, max_k=k, temperature=temperature, speculative_method=method)
    engine = RealEngine(pair.target, pair.draft, config, make_policy("fixed-k", k), None, np.random.default_rng(seed))
    return engine.run(workload, prompts)


def write_trace(result: EngineResult, path: str) -> None:
    """The run's verification steps as a replay trace CSV (steps that proposed nothing left out)."""
    steps = result.acceptance[result.acceptance["proposed"] > 0]
    write_atomic(path, steps[TRACE_COLUMNS].to_csv(index=False))


def fit_report(path: str) -> str:
    """:func:`simulator.inputs.acceptance.fit_acceptance` of the trace at ``path``, as a few lines."""
    trace = read_acceptance_trace(path)
    fit = fit_acceptance(trace)
    beta = fit["beta"]
    steps = pd.DataFrame({"p": trace.proposed, "a": trace.accepted})
    length = (steps["a"].sum() + len(steps)) / len(steps)
    lines = [f"{path}: {trace.num_requests} requests, {len(steps)} steps, proposed {int(steps['p'].sum())}, "
             f"accepted {int(steps['a'].sum())}",
             f"  rate (pooled, per token): {fit['rate']:.3f}; mean acceptance length {length:.2f} tokens/step",
             "  beta: " + (f"mean {beta['mean']:.3f}, concentration {beta['concentration']:.1f}" if beta else "n/a"),
             "  per position: " + ", ".join(f"{p:.3f}" for p in fit["positions"])]
    return "\n".join(lines)


# -- acceptance by depth and rank (token trees) -----------------------------------------------------
#: Columns of a table of acceptance by depth and rank (:data:`simulator.inputs.acceptance.RANK_COLUMNS` reads them).
RANK_COLUMNS = ["depth", "rank", "probability"]


@torch.inference_mode()
def draft_ranks(draft: torch.nn.Module, prompt: list[int], answer: list[int], depth: int) -> np.ndarray:
    """``ranks[a, d - 1]``: the draft model's rank (0 = its most likely token) of the target's token ``answer[a + d]``
    drafted at depth d from the root ``answer[a]``, given the path above it accepted; -1 past the answer. A draft
    model reads only tokens, so on an accepted path it sees the target's tokens: one teacher-forced pass gives every
    rank (as :func:`agreement_bits`)."""
    n = len(answer)
    logits = draft(input_ids=torch.tensor([prompt + answer[:-1]]), logits_to_keep=n - 1).logits[0]  # (n - 1, vocab)
    truth = torch.tensor(answer[1:])
    teacher = (logits > logits.gather(1, truth[:, None])).sum(dim=1).numpy()  # rank of answer[j + 1]
    ranks = np.full((n, depth), -1, dtype=np.int64)
    for d in range(1, depth + 1):
        ranks[:max(n - d, 0), d - 1] = teacher[d - 1:]
    return ranks


@torch.inference_mode()
def head_ranks(head: torch.nn.Module, features: list[torch.Tensor], prompts: list[list[int]],
               answers: list[list[int]], depth: int) -> list[np.ndarray]:
    """:func:`draft_ranks` of an EAGLE head (:mod:`profiles.models.eagle_head`) for every prompt at once, from the
    target's features ``features[i]`` at every position of prompt + answer but the last (``(n - 1, hidden)``, as
    :func:`profiles.serving.generate.generate` returns them). At depth 1 the head reads the target's features
    (teacher forced); at depth d >= 2 its own estimate from depth d - 1 with the target's token there, attending to
    the teacher-forced inputs before the root and to its own rollout: what the engine's head drafts along an accepted
    path (:mod:`profiles.serving.eagle`). One pass per depth, every root of every prompt in it (tree attention)."""
    from profiles.serving.kv import PaddedBatch, TreeBlock

    sequences = [p + a for p, a in zip(prompts, answers)]
    kv = PaddedBatch(head.model)
    # pair t = (f_t, x_{t+1}); its output estimates f_{t+1}
    outs = kv.prefill_hidden([s[1:] for s in sequences],
                             [head.fuse(f[:len(s) - 1], torch.tensor(s[1:])) for f, s in zip(features, sequences)])
    ranks = [np.full((len(a), depth), -1, dtype=np.int64) for a in answers]
    # the roots of prompt i: answer tokens a = 0 .. n_i - 2 at sequence position r = P_i + a; depth 1 reads pair r - 1
    roots = [list(range(len(a) - 1)) for a in answers]
    state = [out[len(p) - 1 + np.array(r, dtype=np.int64)] for out, p, r in zip(outs, prompts, roots)]
    rollout: list[list[list[int]]] = [[[] for _ in r] for r in roots]  # token indices of each root's rollout
    for d in range(1, depth + 1):
        logits = [head.lm_head(s) for s in state]
        for i, (a_list, answer) in enumerate(zip(roots, answers)):
            truth = torch.tensor([answer[a + d] for a in a_list], dtype=torch.long)
            if len(a_list):
                ranks[i][a_list, d - 1] = (logits[i] > logits[i].gather(1, truth[:, None])).sum(dim=1).numpy()
        # next depth: roots whose depth d + 1 token exists feed their depth-d node (the target's token there)
        roots_next = [[a for a in a_list if a + d + 1 < len(answer)] for a_list, answer in zip(roots, answers)]
        if d == depth or not any(roots_next):
            break
        held = kv.lengths()
        tokens, positions, prefix, sees, embeds = [], [], [], [], []
        for i, (a_list, keep) in enumerate(zip(roots, roots_next)):
            where = [a_list.index(a) for a in keep]
            r0 = len(prompts[i])
            tokens.append([answers[i][a + d] for a in keep])
            positions.append([r0 + a + d - 1 for a in keep])
            prefix.append([r0 + a for a in keep])
            sees.append([tuple(rollout[i][w]) + (held[i] + j,) for j, w in enumerate(where)])
            rollout[i] = [rollout[i][w] + [held[i] + j] for j, w in enumerate(where)]
            embeds.append(head.fuse(state[i][where], torch.tensor(tokens[-1], dtype=torch.long)))
        width = max(len(t) for t in tokens)
        block = TreeBlock(tokens, positions, prefix, sees,
                          torch.stack([torch.nn.functional.pad(e, (0, 0, 0, width - len(e))) for e in embeds]))
        out = kv.extend_tree(block)
        state = [out[i, :len(t)] for i, t in enumerate(tokens)]
        roots = roots_next
    return ranks


def walk_ranks(ranks: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy steps along one answer with a tree holding the draft's ``topk`` best candidates at every node of every
    depth (the target's token is accepted at depth d iff its rank there is below ``topk``): from root 0, a step
    accepts the leading depths whose rank is below ``topk`` and the next starts after its recovered or bonus token
    (as :func:`greedy_acceptance`). Returns per depth the steps that reached it (the path above accepted) and per
    depth and rank the steps whose target token had that rank there."""
    depth = ranks.shape[1]
    reached = np.zeros(depth, dtype=np.int64)
    hits = np.zeros((depth, topk), dtype=np.int64)
    a = 0
    while a < len(ranks) - 1:
        accepted = 0
        for d in range(depth):
            rank = int(ranks[a, d])
            if rank < 0:
                break
            reached[d] += 1
            if rank >= topk:
                break
            hits[d, rank] += 1
            accepted = d + 1
        a += accepted + 1
    return reached, hits


def rank_table_frame(ranks: list[np.ndarray], topk: int) -> tuple[pd.DataFrame, np.ndarray]:
    """The acceptance by depth and rank of ``ranks`` (one array per answer, :func:`draft_ranks`) walked with
    :func:`walk_ranks`: ``depth,rank,probability`` (q[d][r] = steps whose target token had rank r at depth d / steps
    that reached depth d; depths no step reached left out) and the steps that reached each depth."""
    reached = np.zeros(ranks[0].shape[1], dtype=np.int64)
    hits = np.zeros((ranks[0].shape[1], topk), dtype=np.int64)
    for r in ranks:
        got, hit = walk_ranks(r, topk)
        reached += got
        hits += hit
    rows = [(d + 1, r, hits[d, r] / reached[d]) for d in range(len(reached)) if reached[d] for r in range(topk)]
    return pd.DataFrame(rows, columns=RANK_COLUMNS), reached


def measure_rank_acceptance(pair: ModelPair, method: str, depth: int, topk: int,
                            output_len: int) -> tuple[pd.DataFrame, np.ndarray]:
    """Acceptance by depth and rank of the pair's draft model or EAGLE head (``method``) along the target's greedy
    answers of ``output_len`` tokens to the shipped prompts (:func:`rank_table_frame`): the table and the steps
    that reached each depth."""
    from profiles.serving.generate import generate

    if pair.draft is None or pair.tokenizer is None:
        raise UserError(f"--acceptance: the {pair.name} pair has no draft or no tokenizer")
    if depth < 1 or topk < 1 or output_len < 2:
        raise UserError(f"--acceptance-by-rank: needs --k >= 1, --topk >= 1 and --output-len >= 2 (got {depth}, "
                        f"{topk}, {output_len})")
    prompts = encode_prompts(pair.tokenizer, read_prompts())
    answers, _, _, features = generate(pair.target, prompts, output_len, len(prompts), 1, rng=None, features=True)
    ranks = head_ranks(pair.draft, features, prompts, answers, depth) if method == "eagle" else \
        [draft_ranks(pair.draft, p, a, depth) for p, a in zip(prompts, answers)]
    return rank_table_frame(ranks, topk)


def write_rank_table(frame: pd.DataFrame, path: str) -> None:
    """The table of acceptance by depth and rank as the CSV ``--acceptance-by-rank`` reads."""
    write_atomic(path, frame[RANK_COLUMNS].to_csv(index=False))


def rank_report(frame: pd.DataFrame, reached: np.ndarray, path: str) -> str:
    """The table as a few lines: q[d][r] per depth, the steps that reached each depth, and the expected accepted
    length of the top-1 chain of each length (sum over d <= k of the product of q[j][0], j <= d)."""
    q = frame.pivot(index="depth", columns="rank", values="probability")
    chain = np.cumsum(np.cumprod(q[0].to_numpy()))
    lines = [f"{path}: acceptance by depth and rank (rows: depth, columns: rank; steps reaching each depth)"]
    for d, row in q.iterrows():
        lines.append(f"  depth {d}: " + " ".join(f"{x:.3f}" for x in row) + f"   sum {row.sum():.3f}, "
                     f"{reached[d - 1]} steps")
    lines.append("  top-1 chain, expected accepted tokens: " +
                 ", ".join(f"k={k} {x:.2f}" for k, x in enumerate(chain, 1)))
    return "\n".join(lines)
