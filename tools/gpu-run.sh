#!/usr/bin/env bash
# The one GPU command: every measurement a GPU changes, on a machine as such machines
# come -- its `python3` holds a CUDA build of torch (and numpy), no package registry is
# reachable, the repository is a copy. No venv is built: memconv runs from this source
# tree, its peers' pure-Python wheels are unpacked from $WHEELS (no pip needed).
#
#   OUT=/some/folder bash tools/gpu-run.sh
#
# Fetch the wheels where a registry is (then carry wheels/ with the copy, 2.2 MiB):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels \
#     opacus==1.6.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 \
#     pygments==2.21.0 tabulate==0.10.0 memory-profiler==0.61.0
# Opacus needs scipy, which has no pure-Python wheel: where the machine's Python lacks
# it, the Opacus engines are reported as skipped; `memconv suite` needs psutil (likewise).
#
# Writes into $OUT, each file as its step completes (at most 8 files, none in a folder):
#   log.txt                 everything printed, with each step's start and status
#   env.txt                 Python, torch, CUDA, the card, which peers import
#   inprocess.jsonl         DP step and per-sample gradients, every engine in one process,
#                           ratios to the non-private step / autograd, TF32 off
#                           (python -m memconv.bench.inprocess): the GPU targets
#   tests-cuda.txt          pytest tests/test_cuda.py (CUDA against the CPU in float64,
#                           one host sync per DP step)
#   calibration-cuda.json   `memconv calibrate --device cuda` refitted on this card
#   calibration.jsonl       its measurements
#   suite.tar.gz            `memconv suite --device cuda`'s JSON Lines and refilled page,
#                           in what is left of the budget
#
# STEPS=compiled runs only the compiled DP step against the compiled non-private step
# instead (tools/cpu-compiled-step.py --device cuda: batch 256, mode="reduce-overhead",
# CUDA graphs, a fixed-shape batch with its last quarter masked; BACKEND=cudagraphs
# where the machine's Python lacks triton), one engine per process, into
#   compiled.jsonl          one record per model and engine (first step, step, allocator
#                           peak, launches), and its table in log.txt
# BLOCKS=1 adds the engine "memconv block compiled": the private module's call on the
# compiled model (the traced step's compiled halves, the mask an input of both), as
# Opacus' make_private runs it.
#
# Environment: OUT (required); PYTHON (python3); WHEELS (wheels); GPU_TIME_BUDGET
# (seconds for everything, 450: done within 8 minutes on one H100 or H200); DEVICE
# (cuda; cpu with QUICK=1 is a dry run of seconds per step on any machine); STEPS
# (all, or compiled); BACKEND (STEPS=compiled: inductor, or cudagraphs); BLOCKS
# (STEPS=compiled: 1 adds the compiled private module).
set -u
OUT=${OUT:?set OUT to the folder the results go to}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
BUDGET=${GPU_TIME_BUDGET:-450}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-}
STEPS=${STEPS:-all}
BACKEND=${BACKEND:-}
cd "$(dirname "$0")/.."
ROOT=$PWD
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
log() { echo "[gpu-run $(date -u +%H:%M:%S), $(left) s left] $*" | tee -a "$OUT/log.txt"; }
# run NAME SECONDS COMMAND...: the step within SECONDS (at most what is left), its output
# appended to log.txt
run() {
    local name=$1 limit=$2
    shift 2
    local budget
    budget=$(left)
    [ "$limit" -gt "$budget" ] && limit=$budget
    if [ "$limit" -lt 10 ]; then
        log "$name: skipped, ${budget} s left"
        return 0
    fi
    log "$name: start (at most ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/log.txt" 2>&1
    log "$name: exit status $?"
}

WORK=$(mktemp -d)
DEPS=$WORK/deps
mkdir -p "$DEPS"
for wheel in "$WHEELS"/*.whl; do
    [ -e "$wheel" ] || { log "no wheels in $WHEELS/: the peers that are not installed are skipped"; break; }
    "$PY" -m zipfile -e "$wheel" "$DEPS" || log "could not unpack $wheel"
done
export PYTHONPATH="$ROOT:$DEPS${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u
    "$PY" - <<'EOF'
import importlib, sys
import torch
import memconv
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.mem_get_info())
print("memconv", memconv.__version__, memconv.__file__)
for name in ("numpy", "scipy", "opacus", "pytest", "hypothesis", "tabulate", "memory_profiler", "psutil", "matplotlib"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as err:
        print(name, "does not import:", err)
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi
} >"$OUT/env.txt" 2>&1
log "environment in env.txt"

if [ "$STEPS" = compiled ]; then
    # a dry run: a small batch, no code generation, no CUDA graphs
    compiled=(--batch 256 --mode reduce-overhead --cases convnext-atto vit-tiny nf-resnet26 cifar-resnet18-gn)
    [ -n "$QUICK" ] && compiled=(--batch 8 --backend aot_eager --cases convnext-atto)
    [ -n "$BACKEND" ] && [ -z "$QUICK" ] && compiled+=(--backend "$BACKEND")
    engines=("non-private compiled" "memconv compiled")
    [ -n "${BLOCKS:-}" ] && engines+=("memconv block compiled")
    run compiled "$(left)" "$PY" tools/cpu-compiled-step.py --device "$DEVICE" --mask "${compiled[@]}" \
        --engines "${engines[@]}" --json "$OUT/compiled.jsonl"
    log "done in $(($(date +%s) - START)) s"
    exit 0
fi

quick=()
[ -n "$QUICK" ] && quick=(--quick --repeats 2)
run inprocess 220 "$PY" -m memconv.bench.inprocess --device "$DEVICE" --json "$OUT/inprocess.jsonl" \
    --time-budget $(($(left) < 200 ? $(left) - 10 : 190)) ${quick[@]+"${quick[@]}"}

if "$PY" -c "import pytest" 2>/dev/null; then
    # the tests' own conftest needs hypothesis; test_cuda.py needs only helpers.py
    run tests-cuda 90 env PYTHONPATH="$ROOT/tests:$PYTHONPATH" "$PY" -m pytest -q -p no:cacheprovider \
        --noconftest -o addopts= tests/test_cuda.py -rs
    grep -E "passed|failed|skipped|error" "$OUT/log.txt" | tail -3 >"$OUT/tests-cuda.txt"
else
    log "tests-cuda: skipped, pytest does not import (add its wheels to $WHEELS)"
fi

calibrate=(-m memconv calibrate --device "$DEVICE" --repeats 3)
[ -n "$QUICK" ] && calibrate=(-m memconv calibrate --device "$DEVICE" --quick --repeats 1)
run calibrate 120 "$PY" "${calibrate[@]}" --out "$OUT/calibration-cuda.json" --json "$OUT/calibration.jsonl"

SUITE=$WORK/suite
mkdir -p "$SUITE"
steps=()
[ -n "$QUICK" ] && steps=(--quick --steps clip)
run suite "$(($(left) - 15))" "$PY" -m memconv suite --device "$DEVICE" --time-budget "$(($(left) - 30))" \
    --out "$SUITE" --markdown "$SUITE/benchmarks-cuda.md" ${steps[@]+"${steps[@]}"}
tar -czf "$OUT/suite.tar.gz" -C "$WORK" suite && log "suite: its files in suite.tar.gz"
log "done in $(($(date +%s) - START)) s"
