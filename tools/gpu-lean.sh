#!/usr/bin/env bash
# The lean default on a GPU, in at most 150 s: ConvNeXt-atto and ViT-tiny at batch 256
# (the non-private step, PrivateStep and the plain clip_and_accumulate call, their time
# and allocator ratios) and NF-ResNet-26's allocator ratio at 256, every engine of a row
# in one process (python -m memconv.bench.inprocess --rows lean; TF32 off). Runs on a
# machine as GPU machines come: its `python3` with a CUDA build of torch, no registry,
# no peers needed (memconv runs from this source tree).
#
#   OUT=/some/folder bash tools/gpu-lean.sh
#   OUT=/tmp/x DEVICE=cpu QUICK=1 bash tools/gpu-lean.sh     # a dry run of seconds
#
# Writes $OUT/env.txt (Python, torch, the card), $OUT/lean.jsonl (a record per engine:
# time_s, alloc_mib, time_x and alloc_x against the row's non-private step) and
# $OUT/log.txt. Environment: OUT (required); PYTHON (python3); GPU_TIME_BUDGET (seconds,
# at most 150, the default); DEVICE (cuda).
set -u
OUT=${OUT:?set OUT to the folder the results go to}
PY=${PYTHON:-python3}
BUDGET=${GPU_TIME_BUDGET:-150}
[ "$BUDGET" -gt 150 ] && BUDGET=150
DEVICE=${DEVICE:-cuda}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
START=$(date +%s)
"$PY" -c "import sys, torch, memconv; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', memconv.__file__)" \
    >"$OUT/env.txt" 2>&1
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick --repeats 2)
left=$((BUDGET - ($(date +%s) - START)))
timeout --kill-after=5 $((left - 5)) "$PY" -m memconv.bench.inprocess --rows lean \
    --device "$DEVICE" --json "$OUT/lean.jsonl" --time-budget $((left - 25)) \
    ${quick[@]+"${quick[@]}"} >"$OUT/log.txt" 2>&1
echo "exit status $? after $(($(date +%s) - START)) s" >>"$OUT/log.txt"
