"""What one drafting pass costs: the EAGLE head against the draft model, on the real engine's own proposers.

    python -m profiles.drafter_costs --batch-sizes 1,4,8

For each batch size, the shipped prompts' first requests are prefilled into the target's, the draft model's and the
head's caches (:class:`profiles.serving.draft_model.DraftModelTrees`, :class:`profiles.serving.eagle.EagleProposer`,
eager path, float32, CPU), then each proposer drafts a chain of 2 over and over (two passes: the catch-up of one
pending token, then one drafted token per sequence), every draft rolled back; printed per batch size: the median
seconds of one pass of each (the draft model's 2 layers of MLP width 768 vs the head's fc and 1 layer of width 1536,
both followed by the target's 49,152-token LM head), their ratio, and a target decode pass of one token per sequence
for scale. Timing a shared machine: the medians of ``--repeats`` interleaved rounds.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import pandas as pd
import torch

from policies.errors import UserError, exit_on_user_error
from policies.tree import TreeShape
from profiles.models.pairs import encode_prompts, load_draft, load_head, load_target, read_prompts
from profiles.serving.draft_model import DraftModelTrees
from profiles.serving.eagle import EagleProposer
from profiles.serving.kv import PaddedBatch


def pass_seconds(batch_size: int, repeats: int) -> dict[str, float]:
    """Median seconds of one draft-model pass, one head pass and one target decode pass at ``batch_size``."""
    target, tokenizer = load_target()
    prompts = encode_prompts(tokenizer, read_prompts())[:batch_size]
    target_kv = PaddedBatch(target)
    features = target_kv.prefill_hidden(prompts)
    first = target.lm_head(torch.stack([f[-1] for f in features])).argmax(dim=-1).tolist()
    rng = np.random.default_rng(0)
    draft, head = load_draft(target, tokenizer), load_head(target, tokenizer)
    proposers = {"draft_model": DraftModelTrees(draft, PaddedBatch(draft), 0.0, rng),
                 "eagle": EagleProposer(head, PaddedBatch(head.model), 0.0, rng)}
    for proposer in proposers.values():
        proposer.prefill(prompts, first, features)
    shapes = [TreeShape.chain(2)] * batch_size
    seconds: dict[str, list[float]] = {name: [] for name in (*proposers, "target")}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, proposer in proposers.items():
                t0 = time.perf_counter()
                trees, passes, _ = proposer.draft(shapes)
                seconds[name].append((time.perf_counter() - t0) / passes)
                proposer.commit(trees, [[] for _ in trees], first, [f[-1:] for f in features])
            held = target_kv.lengths()
            t0 = time.perf_counter()
            target_kv.extend([[t] for t in first], all_logits=False)
            seconds["target"].append(time.perf_counter() - t0)
            target_kv.truncate(held)
    return {name: float(np.median(s)) for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiles.drafter_costs", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--batch-sizes", default="1,4,8", help="sequences per pass, comma-separated")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds per batch size (medians)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
    except ValueError:
        raise UserError(f"--batch-sizes: expected comma-separated integers (got {args.batch_sizes!r})") from None
    if not sizes or min(sizes) < 1 or args.repeats < 1:
        raise UserError("--batch-sizes and --repeats: need values >= 1")
    torch.set_num_threads(args.threads)
    rows = []
    for b in sizes:
        s = pass_seconds(b, args.repeats)
        rows.append({"batch_size": b, "draft_model_ms": 1e3 * s["draft_model"], "eagle_head_ms": 1e3 * s["eagle"],
                     "head_over_draft": s["eagle"] / s["draft_model"], "target_decode_ms": 1e3 * s["target"]})
    print(pd.DataFrame(rows).to_string(index=False, float_format="{:.2f}".format))
    return 0


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
