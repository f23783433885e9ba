#!/usr/bin/env bash
# The one prepared profiling run for a lent H200 (python3 with torch, transformers, pandas, numpy, scipy,
# tqdm; no SimPy, no network; run from the repository root, not installed).
#
#   OUT=/some/folder bash profiles/h200_profile.sh            # GPU: bf16, random weights, <= ~7 min wall
#   TINY=1 OUT=/tmp/h200test bash profiles/h200_profile.sh    # CPU rehearsal: tiny configs, tiny grid, fp32
#
# Parts (each a `python3 -m profiles.cli` run with its own --max-seconds slice of one global deadline;
# time a part leaves unused goes to the later ones; the grid runs coarse to fine, so a cut part still
# spans its grid):
#   1. Llama-2-7B target + llama-68m draft                      -> h200__llama-2-7b__llama-68m.csv
#   2. Llama-3.1-8B target + Llama-3.2-1B draft, measured whole AND with the target cut to 2 and 6
#      layers: the layer-scaling check (relative error of the extrapolation to 32 layers, in the meta
#      and the summary)                                         -> h200__llama-3.1-8b__llama-3.2-1b.csv
#   3. Llama-3.1-70B target (80 layers, 141 GB: does not fit) by layer scaling from 4 and 12 layers
#      (extrapolating ~6.7x beyond the deeper cut, as part 2 checks ~5.3x) + Llama-3.2-1B draft
#                                                               -> h200__llama-3.1-70b__llama-3.2-1b.csv
# Grid: batch 1..256 (powers of two), k+1 = 1..9, contexts 128..4096, prompts 128..4096 with
# batch x prompt <= 16384 tokens; points whose KV cache does not fit are skipped with a line in the log.
# Output in $OUT (7 files, flat): three profiles with their .meta.json, and h200_profile.log; a summary
# table is printed last.
#
# GPU time estimate. HF eager: a pass costs at least its Python/launch floor, ~2.5 ms + ~0.5 ms per layer
# (a 7-8B pass at small batch ~15-25 ms), else its roofline plus the copy of the whole KV cache that
# DynamicCache's concatenation makes each pass; ~4.5 passes a point (1 warm-up + 3-4 timed) + 3 ms of
# sync and bookkeeping; a (batch, context) cache filled at ~1.5 TB/s. Summed over the grid:
#   start-up per part (python + torch/transformers import, CUDA init, random weights on the GPU): ~15-20 s
#   part 1: 552 points measured, 54 skipped (KV > memory)            -> ~65 s of measuring
#   part 2: 579 points (27 skipped), every target point on 3 models  -> ~95 s
#   part 3: 606 points on 4- and 12-layer cuts (~1.3x an 8B pass)    -> ~90 s
#   If the launch floor is 1.5x the guess, ~1.4x these. The slices (weights 100/145/115 of the 420 s
#   budget, TOTAL_SECONDS, less 15 s start-up per part: ~105/150/120 s) cover them with some room; what a
#   part does not use goes to the next, `timeout` hard-caps each part, and the grid runs coarse to fine.
set -uo pipefail

: "${OUT:?set OUT to the output folder}"
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/h200_profile.log"
: > "$LOG"
START=$(date +%s)

if [ "${TINY:-0}" = 1 ]; then
  TOTAL_SECONDS=${TOTAL_SECONDS:-150}
  STARTUP=10  # seconds per part outside the profiler's own clock (interpreter and imports)
  PARTS=(
    "tiny1__tiny-target__tiny-draft|tiny-target|tiny-draft||0|1"
    "tiny2__tiny-target__tiny-draft|tiny-target|tiny-draft|1,2|1|1"
    "tiny3__tiny-target__tiny-draft|tiny-target|tiny-draft|1,3|0|1"
  )
  COMMON=(--device cpu --dtype fp32 --threads 1 --batch-sizes 1,2,4,8 --query-lens 1,2,3,4,5
          --context-lens 16,32,64,128 --prefill-lens 16,32,64 --max-prefill-tokens 256)
else
  TOTAL_SECONDS=${TOTAL_SECONDS:-420}
  STARTUP=15
  PARTS=(
    "h200__llama-2-7b__llama-68m|llama-2-7b|llama-68m||0|100"
    "h200__llama-3.1-8b__llama-3.2-1b|llama-3.1-8b|llama-3.2-1b|2,6|1|145"
    "h200__llama-3.1-70b__llama-3.2-1b|llama-3.1-70b|llama-3.2-1b|4,12|0|115"
  )
  COMMON=(--device cuda --dtype bf16 --batch-sizes 1,2,4,8,16,32,64,128,256 --query-lens 1,2,3,4,5,6,7,8,9
          --context-lens 128,256,512,1024,2048,4096 --prefill-lens 128,256,512,1024,2048,4096
          --max-prefill-tokens 16384)
fi
# Fewer, larger CUDA segments: less fragmentation when caches of very different sizes come and go.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
TIMING=(--warmup 1 --min-repeats 3 --max-repeats 10 --rel-tol 0.02 --point-seconds 1.0 --quiet)

log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$LOG"; }

log "h200_profile: TINY=${TINY:-0}, budget ${TOTAL_SECONDS} s, output $OUT"

FILES=()
for i in "${!PARTS[@]}"; do
  IFS='|' read -r NAME TARGET DRAFT SCALE CHECK WEIGHT <<< "${PARTS[$i]}"
  # This part's share of what is left, in proportion to the weights of the parts still to run.
  WEIGHTS_LEFT=0
  for rest in "${PARTS[@]:$i}"; do WEIGHTS_LEFT=$((WEIGHTS_LEFT + ${rest##*|})); done
  LEFT=$((START + TOTAL_SECONDS - $(date +%s) - STARTUP * (${#PARTS[@]} - i)))
  SLICE=$((LEFT * WEIGHT / WEIGHTS_LEFT))
  if [ "$SLICE" -lt 10 ]; then
    log "$NAME: skipped, only ${SLICE} s left"
    continue
  fi
  ARGS=(--target "$TARGET" --draft "$DRAFT" --out "$OUT/$NAME.csv" --max-seconds "$SLICE")
  [ -n "$SCALE" ] && ARGS+=(--scale-layers "$SCALE")
  [ "$CHECK" = 1 ] && ARGS+=(--check-scaling)
  log "$NAME: ${SLICE} s slice: ${ARGS[*]}"
  timeout --signal=INT --kill-after=20 $((SLICE + STARTUP + 30)) \
    "$PY" -m profiles.cli "${ARGS[@]}" "${COMMON[@]}" "${TIMING[@]}" >> "$LOG" 2>&1
  log "$NAME: exit status $?"
  FILES+=("$OUT/$NAME.csv")
done

log "all parts done in $(($(date +%s) - START)) s; summary:"
"$PY" - "${FILES[@]}" <<'EOF' 2>&1 | tee -a "$LOG"
"""Summary of the profiles written: rows, skips, time used, a few reference points; the scaling check."""
import json
import sys
from pathlib import Path

import pandas as pd

pd.set_option("display.width", 250)
lines, checks = [], []
for csv in map(Path, sys.argv[1:]):
    meta_file = csv.with_name(csv.stem + ".meta.json")
    if not csv.is_file() or not meta_file.is_file():
        print(f"{csv.name}: missing")
        continue
    frame, meta = pd.read_csv(csv), json.loads(meta_file.read_text())

    def ms(role, phase, **where):
        rows = frame[(frame.role == role) & (frame.phase == phase)]
        for column, value in where.items():
            rows = rows[rows[column] == value]
        return f"{rows.seconds.iloc[0] * 1e3:.1f}" if len(rows) else "-"

    b, q, c, p = (meta["grid"][k] for k in ("batch_sizes", "query_lens", "context_lens", "prefill_lens"))
    lines.append({
        "profile": csv.stem, "rows": meta["points"]["rows"], "skipped": meta["points"]["skipped"],
        "grid": meta["points"]["grid"], "complete": meta["complete"], "wall_s": meta["wall_seconds"],
        f"verify b={b[0]} q={q[-1]} L={c[0]} ms": ms("target", "decode", batch_size=b[0], query_len=q[-1], context_len=c[0]),
        f"verify b={b[-1]} q={q[0]} L={c[0]} ms": ms("target", "decode", batch_size=b[-1], query_len=q[0], context_len=c[0]),
        f"draft b={b[0]} L={c[0]} ms": ms("draft", "decode", batch_size=b[0], context_len=c[0]),
        f"prefill b={b[0]} P={p[-1]} ms": ms("target", "prefill", batch_size=b[0], query_len=p[-1]),
    })
    scaling = meta.get("layer_scaling", {})
    for part, err in scaling.get("check", {}).items():
        checks.append({"profile": csv.stem, "layers": "{}+{} -> {}".format(*scaling["layers"], scaling["full_layers"]),
                       "rows": part, "points": err["points"], "mean_rel_error": f"{err['mean_rel_error']:.1%}",
                       "max_rel_error": f"{err['max_rel_error']:.1%}"})
print(pd.DataFrame(lines).to_string(index=False))
if checks:
    print("layer-scaling check: extrapolated vs measured full depth")
    print(pd.DataFrame(checks).to_string(index=False))
EOF
