"""Check the optimized forward path on a device before profiling with it (the prepared GPU run's first stage).

1. Numerics: the tiny pair's logits from :func:`profiles.models.optimized.slot_pass` (a prefill, then decode
   passes of 1 and 3 tokens over unequal lengths) against the Hugging Face forward over the whole sequence,
   and a replayed CUDA graph against the same pass run eagerly.
2. Speed (``--model``): one decode pass at batch 1 over ``--context`` tokens, median seconds, on the eager
   Hugging Face path, the optimized path without graphs and with graphs.

Prints one JSON object (also written to ``--out``). Exit status 1 if a check fails, so the caller can fall back
to ``--no-cuda-graphs``.

    python -m profiles.forward_check --device cuda --model llama-2-7b --out check.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from profiles.models import forward
from profiles.models.optimized import (GraphedForward, SlotCache, attention_width, last_columns,
                                      slot_pass)
from profiles.profiler import TimingPolicy, measure

TOLERANCE = {"fp32": 1e-3, "bf16": 0.15, "fp16": 0.05}


def numerics(device: torch.device, dtype: str) -> dict:
    """Max |logit difference| of the optimized path against Hugging Face's, per model of the tiny pair."""
    out = {}
    generator = torch.Generator(device=device).manual_seed(0)
    for name in ("tiny-target", "tiny-draft"):
        model = forward.build_model(forward.load_config(name, name), dtype, device)
        ids = forward.random_tokens(model, 2, 24, generator)
        reference = model(input_ids=ids).logits.float()
        cache = SlotCache(model, 2, 64)
        run = GraphedForward(model, cache)
        prefill = run(0, ids[:, :20], last_columns(2, 20, 20, device), attention_width(0, 20, cache.max_len),
                      fresh=True)
        parts = [prefill.float()]
        cache.lengths[:2] += 20
        for lo, hi in ((20, 21), (21, 24)):
            q = hi - lo
            logits = run(0, ids[:, lo:hi].contiguous(), last_columns(2, q, q, device),
                         attention_width(lo, q, cache.max_len))
            parts.append(logits.float().clone())
            cache.lengths[:2] += q
        diff = (torch.cat(parts, dim=1) - reference).abs().max().item()
        # a replayed graph against the same pass run eagerly (same cache state)
        cache.lengths[:2] -= 3
        eager = slot_pass(model, cache, 0, ids[:, 21:24].contiguous(), last_columns(2, 3, 3, device),
                          attention_width(21, 3, cache.max_len)).float()
        replay_diff = (eager - parts[-1]).abs().max().item()
        out[name] = {"max_abs_diff_vs_hf": diff, "max_abs_logit": reference.abs().max().item(),
                     "graph_vs_eager_diff": replay_diff, "graphs": run.use_graphs, "captured": len(run.graphs),
                     "ok": diff <= TOLERANCE[dtype] * max(1.0, reference.abs().max().item()) and replay_diff <= 1e-3}
    return out


def speed(device: torch.device, dtype: str, spec: str, context: int) -> dict:
    """Median seconds of one batch-1 decode pass over ``context`` tokens on the three paths."""
    model = forward.build_model(forward.load_config(spec, "--model"), dtype, device)
    generator = torch.Generator(device=device).manual_seed(0)
    sync = lambda: forward.synchronize(device)  # noqa: E731
    policy = TimingPolicy(warmup=2, min_repeats=5, max_repeats=20, rel_tol=0.01, point_seconds=2.0)
    ids = forward.random_tokens(model, 1, 1, generator)
    hf_cache = forward.random_cache(model, 1, context, generator)
    eager = measure(lambda: forward.decode_pass(model, hf_cache, ids), lambda: forward.crop(hf_cache, 1), sync, policy)
    hf_cache = None
    cache = SlotCache(model, 1, context + 1)
    cache.fill_random(0, 1, context, generator)
    width, keep = attention_width(context, 1, cache.max_len), last_columns(1, 1, 1, device)
    plain = measure(lambda: slot_pass(model, cache, 0, ids, keep, width), lambda: None, sync, policy)
    graphed = GraphedForward(model, cache)
    timed = measure(lambda: graphed(0, ids, keep, width), lambda: None, sync, policy)
    return {"model": spec, "context": context, "eager_hf_s": eager.median, "optimized_no_graphs_s": plain.median,
            "optimized_s": timed.median, "graphs": graphed.use_graphs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiles.forward_check", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to check (default cpu)")
    parser.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--model", help="also time a batch-1 decode pass of this model (shipped name or config)")
    parser.add_argument("--context", type=int, default=1024, help="context tokens of the timed pass (default 1024)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    device = forward.setup_device(args.device, 1 if args.device == "cpu" else None)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    t0 = time.perf_counter()
    report = {"device": forward.device_name(device), "dtype": dtype, "torch_version": torch.__version__,
              "numerics": numerics(device, dtype)}
    if args.model:
        report["speed"] = speed(device, dtype, args.model, args.context)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(r["ok"] for r in report["numerics"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
