#!/usr/bin/env bash
# BackPACK's DiagGGNExact and BatchDiagGGNExact on All-CNN-C (CIFAR-100 shapes, batch 8,
# V=10 and 100) alone and through memconv, on a GPU machine as such machines come: its
# `python3` holds a CUDA build of torch, no registry; BackPACK and its two pure-Python
# dependencies are unpacked from $WHEELS (no pip):
#   pip download --no-deps --only-binary=:all: -d wheels \
#     backpack-for-pytorch==1.7.1 einops==0.8.2 unfoldNd==0.2.3
#
#   OUT=/some/folder bash tools/gpu-backpack-diag.sh          # at most $GPU_TIME_BUDGET s
#   OUT=/tmp/x DEVICE=cpu QUICK=1 bash tools/gpu-backpack-diag.sh   # a dry run anywhere
#
# Writes $OUT/backpack-diag.jsonl (one line per configuration: allocator peak increase
# over the warm-up, seconds) and $OUT/backpack-diag.txt (everything printed, the table).
set -u
OUT=${OUT:?set OUT to the folder the results go to}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
BUDGET=${GPU_TIME_BUDGET:-140}
DEVICE=${DEVICE:-cuda}
cd "$(dirname "$0")/.."
ROOT=$PWD
mkdir -p "$OUT"
DEPS=$(mktemp -d)
for wheel in "$WHEELS"/*.whl; do
    [ -e "$wheel" ] || break
    "$PY" -m zipfile -e "$wheel" "$DEPS" || echo "could not unpack $wheel"
done
export PYTHONPATH="$ROOT:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
timeout --kill-after=5 "$BUDGET" "$PY" -W ignore tools/bench-backpack-diag.py --device "$DEVICE" \
    --time-budget $((BUDGET - 10)) --json "$OUT/backpack-diag.jsonl" ${quick[@]+"${quick[@]}"} \
    2>&1 | tee "$OUT/backpack-diag.txt"
