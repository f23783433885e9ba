#!/usr/bin/env bash
# The one prepared GPU run (an H200 lent for ~15 minutes, start-up included): python3 with torch, transformers,
# pandas, numpy, scipy, tqdm; no network; run from the repository root, not installed. SimPy (the simulator,
# for the validation stages) travels as a wheel in .whl/ when the machine lacks it.
#
#   OUT=/some/folder bash profiles/gpu_run.sh                       # GPU: every stage, <= ~8 min wall
#   OUT=/f STAGES=check,profile bash profiles/gpu_run.sh            # some stages only
#   TINY=1 OUT=/tmp/gpurun bash profiles/gpu_run.sh                 # CPU rehearsal: tiny pair, tiny grid, fp32
#
# Stages (STAGES, comma-separated, default all, in this order; each under `timeout` and its own --max-seconds
# slice of one global deadline, TOTAL_SECONDS; time a stage leaves unused goes to the later ones):
#   check     python -m profiles.forward_check: the optimized path's numerics on the device (tiny pair, against
#             Hugging Face's forward; a replayed CUDA graph against the same pass run eagerly) and one 7B
#             batch-1 decode pass timed eager / optimized / optimized + graphs        -> forward_check.json
#             If the check fails, later stages run the optimized path without CUDA graphs (and say so).
#   profile   the optimized forward (bf16, random weights) on the grid of the earlier H200 profiles: batch
#             1..256, k + 1 in 1..9, context 128..4096, prefill 128..4096 (batch x prompt <= 16384):
#               Llama-2-7B + llama-68m          -> h200-optimized__llama-2-7b__llama-68m.csv (+ .meta.json)
#               Llama-3.1-8B + Llama-3.2-1B     -> h200-optimized__llama-3.1-8b__llama-3.2-1b.csv (+ .meta.json)
#             The grid runs coarse to fine, so a part cut by its slice still spans the grid. ONLY_TARGET=NAME
#             profiles that target's pair alone.
#   engine    the real engine's own step costs at 7B (run_sim.py profile --engine --forward optimized on the random
#             Llama-2-7B + 68M pair): its passes as the engine runs them (unequal lengths in slots, the draft's and the
#             verification's bookkeeping) and its per-step overhead, decode and prefill apart
#                                                              -> h200-optimized-engine__llama-2-7b__llama-68m.csv
#             The validate stage prices with it when present (else with the profile stage's pass profile).
#   validate  the timing twin at 7B (run_sim.py validate --twin $TWIN): the real engine (optimized forward) on the
#             random-weight Llama-2-7B + 68M pair, accept/reject drawn from a constant acceptance model, against
#             the simulator on the profile measured in the profile stage (or the shipped one)
#                                                                                  -> validate_7b.tgz
#   single    the single-request study on the GPU (python -m profiles.validation.single_request) with the timing
#             twin on the 7B pair (the SmolLM2 GGUF, 98 MB, does not fit a 64 MiB transfer: left out)
#                                                                                  -> single_request_7b.csv
# Output in $OUT, flat (at most 8 files come back): the pass profiles, gpu_run.log, and bundle.tgz holding the rest
# (forward_check.json, the engine profile, validate_7b.tgz, single_request_7b.csv).
#
# GPU time, measured (2026-11-30, profiles/data/gpu_runs/): check 17 s; profile 128 s (7B pair) and 138 s (8B
# pair) of measuring plus ~15 s start-up each; validate 48 s; single 16 s; a machine's start ~30 s. Slices: check
# 40, profile 150 + 160, engine 60, validate 100, single 40 (shares of TOTAL_SECONDS, default 480, less start-up).
set -uo pipefail

: "${OUT:?set OUT to the output folder}"
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
: > "$LOG"
START=$(date +%s)
STAGES=",${STAGES:-check,profile,engine,validate,single},"

if [ "${TINY:-0}" = 1 ]; then
  TOTAL_SECONDS=${TOTAL_SECONDS:-240}
  STARTUP=8
  DEVICE=cpu; DTYPE=fp32; HW=tiny; CHECK_MODEL=tiny-target
  PAIRS=("tiny-target|tiny-draft|150" "tiny-target|tiny-draft|160")
  COMMON=(--device cpu --dtype fp32 --threads 1 --batch-sizes 1,2,4,8 --query-lens 1,2,3,4,5
          --context-lens 16,32,64,128 --prefill-lens 16,32,64 --max-prefill-tokens 256)
  PAIR=tiny; VALIDATE=(--rates 4,32 --num-requests 12 --policies no-spec,fixed-k:3 --max-num-seqs 8)
  ENGINE=(--batch-sizes 1,2,4,8 --query-lens 1,2,3,4 --context-lens 16,32 --prefill-lens 16 --prefill-batch-sizes 1,2
          --rounds 2)
  LENGTHS=(--prompt-len 16 --output-len 12)
else
  TOTAL_SECONDS=${TOTAL_SECONDS:-480}
  STARTUP=15
  DEVICE=cuda; DTYPE=bf16; HW=h200; CHECK_MODEL=llama-2-7b
  PAIRS=("llama-2-7b|llama-68m|150" "llama-3.1-8b|llama-3.2-1b|160")
  COMMON=(--device cuda --dtype bf16 --batch-sizes 1,2,4,8,16,32,64,128,256 --query-lens 1,2,3,4,5,6,7,8,9
          --context-lens 128,256,512,1024,2048,4096 --prefill-lens 128,256,512,1024,2048,4096
          --max-prefill-tokens 16384)
  PAIR=llama-2-7b+llama-68m; VALIDATE=(--rates 8,32,128 --num-requests 32 --policies no-spec,fixed-k:3,goodput
                                        --max-num-seqs 16 --max-num-batched-tokens 4096)
  LENGTHS=(--prompt-len 256 --output-len 64)
  ENGINE=(--batch-sizes 1,2,4,8,12,16 --query-lens 1,2,3,4,5 --context-lens 256,288,320 --prefill-lens 256
          --prefill-batch-sizes 1,2,4 --rounds 3)
fi
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
TWIN=${TWIN:-0.7}  # the timing twin's constant per-token acceptance rate
TIMING=(--warmup 1 --min-repeats 4 --max-repeats 10 --rel-tol 0.02 --point-seconds 1.0 --quiet)
GRAPHS=()

log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$LOG"; }
has() { [[ "$STAGES" == *",$1,"* ]]; }
# seconds of the global budget left for this stage: its weight's share of what the stages still to run weigh
slice() { local weight=$1 rest=$2; echo $(( (START + TOTAL_SECONDS - $(date +%s) - STARTUP) * weight / rest )); }
run() {  # run LIMIT CMD...: a stage's command under a hard timeout, its output in the log
  local limit=$1; shift
  timeout --signal=INT --kill-after=20 "$limit" "$@" >> "$LOG" 2>&1
  local status=$?
  log "exit status $status: $*"
  return $status
}

log "gpu_run: TINY=${TINY:-0}, stages ${STAGES//,/ }, budget ${TOTAL_SECONDS} s, output $OUT"
selected() { [ -z "${ONLY_TARGET:-}" ] || [ "${1%%|*}" = "$ONLY_TARGET" ]; }
PROFILE_WEIGHT=0
for pair in "${PAIRS[@]}"; do selected "$pair" && PROFILE_WEIGHT=$((PROFILE_WEIGHT + ${pair##*|})); done
WEIGHTS=$(( $(has check && echo 40 || echo 0) + $(has profile && echo $PROFILE_WEIGHT || echo 0)
            + $(has engine && echo 60 || echo 0) + $(has validate && echo 100 || echo 0)
            + $(has single && echo 40 || echo 0) ))

if has check; then
  S=$(slice 40 "$WEIGHTS"); WEIGHTS=$((WEIGHTS - 40))
  if ! run $((S + STARTUP)) "$PY" -m profiles.forward_check --device "$DEVICE" --model "$CHECK_MODEL" \
        --out "$OUT/forward_check.json"; then
    GRAPHS=(--no-cuda-graphs)
    log "forward check failed: the later stages run the optimized path without CUDA graphs"
  fi
fi

if has profile; then
  for i in "${!PAIRS[@]}"; do
    IFS='|' read -r TARGET DRAFT WEIGHT <<< "${PAIRS[$i]}"
    if ! selected "${PAIRS[$i]}"; then log "$TARGET: skipped (ONLY_TARGET=$ONLY_TARGET)"; continue; fi
    S=$(slice "$WEIGHT" "$WEIGHTS"); WEIGHTS=$((WEIGHTS - WEIGHT))
    NAME="${HW}-optimized__${TARGET}__${DRAFT}"
    [ "${TINY:-0}" = 1 ] && NAME="${HW}${i}-optimized__${TARGET}__${DRAFT}"
    if [ "$S" -lt 10 ]; then log "$NAME: skipped, only ${S} s left"; continue; fi
    log "$NAME: ${S} s slice"
    run $((S + STARTUP + 30)) "$PY" -m profiles.cli --target "$TARGET" --draft "$DRAFT" --forward optimized \
      "${GRAPHS[@]}" --out "$OUT/$NAME.csv" --max-seconds "$S" "${COMMON[@]}" "${TIMING[@]}"
  done
fi

PROFILE_7B="$OUT/${HW}-optimized__${PAIRS[0]%%|*}__$(cut -d'|' -f2 <<< "${PAIRS[0]}").csv"
[ "${TINY:-0}" = 1 ] && PROFILE_7B="$OUT/${HW}0-optimized__tiny-target__tiny-draft.csv"
[ -f "$PROFILE_7B" ] || PROFILE_7B="profiles/data/$(basename "$PROFILE_7B")"

ENGINE_7B="$OUT/${HW}-optimized-engine__${PAIR//+/__}.csv"
if has engine; then
  S=$(slice 60 "$WEIGHTS"); WEIGHTS=$((WEIGHTS - 60))
  log "engine: ${S} s slice"
  run $((S + STARTUP + 30)) "$PY" run_sim.py profile --engine --pair "$PAIR" --device "$DEVICE" --dtype "$DTYPE" \
    --forward optimized "${GRAPHS[@]}" "${ENGINE[@]}" --out "$ENGINE_7B"
fi
[ -f "$ENGINE_7B" ] && PROFILE_7B="$ENGINE_7B"

if has validate; then
  S=$(slice 100 "$WEIGHTS"); WEIGHTS=$((WEIGHTS - 100))
  log "validate: ${S} s slice, profile $PROFILE_7B"
  DIR=$(mktemp -d)
  run $((S + STARTUP + 30)) "$PY" run_sim.py validate --pair "$PAIR" --twin "$TWIN" --device "$DEVICE" \
    --dtype "$DTYPE" --forward optimized "${GRAPHS[@]}" --profile "$PROFILE_7B" "${VALIDATE[@]}" "${LENGTHS[@]}" \
    --max-seconds "$S" --out "$DIR"
  tar czf "$OUT/validate_7b.tgz" -C "$DIR" . && log "validate: $(ls "$DIR" | wc -l) files in validate_7b.tgz"
fi

if has single; then
  S=$(slice 40 "$WEIGHTS")
  log "single: ${S} s slice"
  run $((S + STARTUP + 30)) "$PY" -m profiles.validation.single_request --pair "$PAIR" --twin "$TWIN" \
    --device "$DEVICE" --dtype "$DTYPE" --forward optimized "${GRAPHS[@]}" --profile "$PROFILE_7B" "${LENGTHS[@]}" \
    --max-seconds "$S" --out "$OUT/single_request_7b.csv"
fi

# At most 8 files come back from the machine: the pass profiles and the log stay as they are, the rest is packed.
EXTRA=$(cd "$OUT" && ls | grep -v -e '^gpu_run.log$' -e '^bundle.tgz$' | grep -v -E '^[a-z0-9]+-optimized__' || true)
if [ -n "$EXTRA" ]; then
  (cd "$OUT" && tar czf bundle.tgz $EXTRA && rm -f $EXTRA) && log "packed into bundle.tgz: $(echo $EXTRA)"
fi
log "all stages done in $(($(date +%s) - START)) s; summary:"
"$PY" - "$OUT"/*optimized__*.csv <<'EOF' 2>&1 | tee -a "$LOG"
"""Summary of the profiles written: rows, skips, time used, a few reference points."""
import json
import sys
from pathlib import Path

import pandas as pd

pd.set_option("display.width", 250)
lines = []
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
        return f"{rows.seconds.iloc[0] * 1e3:.2f}" if len(rows) else "-"

    b, q, c, p = (meta["grid"][k] for k in ("batch_sizes", "query_lens", "context_lens", "prefill_lens"))
    lines.append({
        "profile": csv.stem, "rows": meta["points"]["rows"], "skipped": meta["points"]["skipped"],
        "grid": meta["points"]["grid"], "complete": meta["complete"], "graphs": meta.get("cuda_graphs"),
        "wall_s": meta["wall_seconds"],
        f"verify b={b[0]} q=1 L={c[0]} ms": ms("target", "decode", batch_size=b[0], query_len=1, context_len=c[0]),
        f"verify b={b[0]} q=1 L={c[-1]} ms": ms("target", "decode", batch_size=b[0], query_len=1, context_len=c[-1]),
        f"verify b={b[-1]} q={q[0]} L={c[0]} ms": ms("target", "decode", batch_size=b[-1], query_len=q[0], context_len=c[0]),
        f"draft b={b[0]} L={c[0]} ms": ms("draft", "decode", batch_size=b[0], context_len=c[0]),
        f"prefill b={b[0]} P={p[-1]} ms": ms("target", "prefill", batch_size=b[0], query_len=p[-1]),
    })
print(pd.DataFrame(lines).to_string(index=False))
EOF
