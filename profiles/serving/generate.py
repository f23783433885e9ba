"""The target answering prompts through the engine's own passes: the training data of drafts and heads, and the
greedy answers that acceptance is measured along."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from profiles.serving.engine import StepRunner
from profiles.serving.kv import PaddedBatch, TreeBlock
from profiles.serving.rejection_sampler import draw


def generate(model: Any, prompts: list[list[int]], gen_len: int, batch_size: int, top: int,
             rng: np.random.Generator | None, features: bool = False) -> tuple[list, ...]:
    """``gen_len`` tokens after each prompt, batched through the engine's passes: drawn at temperature 1 from
    ``rng``, or greedy when it is None. Returns the tokens, and per prompt the ``top`` most likely token ids
    and their probabilities at each generated position; with ``features``, also each sequence's final-normed hidden
    states at every position but its last ``(len(prompt) + gen_len - 1, hidden)`` (what an EAGLE head reads; the
    passes then return hidden states, :meth:`profiles.serving.kv.KVBatch.prefill_hidden`)."""
    runner = StepRunner(model, None, 1.0, rng)
    tokens, top_ids, top_probs, states = [], [], [], []
    for start in range(0, len(prompts), batch_size):
        cache = PaddedBatch(model)
        chunk = prompts[start:start + batch_size]
        if features:
            hidden = cache.prefill_hidden(chunk)
            logits = model.lm_head(torch.stack([h[-1] for h in hidden]))
            seen = [[h] for h in hidden]
        else:
            logits = runner.prefill(cache, chunk)
        answers: list[list[int]] = [[] for _ in range(len(logits))]
        ids, probs = [], []
        for step in range(gen_len):
            p = torch.softmax(logits.double(), dim=-1)
            best = torch.topk(p, top, dim=-1)
            ids.append(best.indices)
            probs.append(best.values.float())
            nxt = p.argmax(dim=-1).tolist() if rng is None else [draw(row, rng) for row in p.numpy()]
            for answer, token in zip(answers, nxt):
                answer.append(token)
            if step == gen_len - 1:
                break
            if features:
                out = cache.extend_tree(TreeBlock.causal([[t] for t in nxt], cache.lengths()))[:, 0]  # (B, hidden)
                logits = model.lm_head(out)
                for row, h in zip(seen, out):
                    row.append(h[None])
            else:
                logits = cache.extend([[t] for t in nxt], all_logits=False)
        tokens += answers
        top_ids += list(torch.stack(ids, dim=1))
        top_probs += list(torch.stack(probs, dim=1))
        if features:
            states += [torch.cat(row) for row in seen]
    return (tokens, top_ids, top_probs, states) if features else (tokens, top_ids, top_probs)
