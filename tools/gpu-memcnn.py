"""MemCNN 1.5.2's ``test_memory_saving`` through memconv.reversible on CUDA, beside
MemCNN itself, then MemCNN's whole suite both ways, within a time budget.

On a machine as the GPU machines come (``python3`` with a CUDA torch and numpy, no
package registry, the repository a copy): MemCNN's wheel and pytest's come in a folder
of wheels (default ``wheels/``), unpacked here without pip. Fetch them where a registry
is, then carry ``wheels/`` with the copy::

    pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels \\
        memcnn==1.5.2 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 \\
        pygments==2.21.0

Run (at most ``--time-budget`` seconds, 120 by default)::

    python3 tools/gpu-memcnn.py --out "$OUT"
    python3 tools/gpu-memcnn.py --device cpu --quick --out /tmp/out   # the dry run

Writes into ``--out``: ``log.txt`` (every step, its output), ``memory-saving.txt``
(pytest on MemCNN's ``test_memory_saving.py`` through memconv), ``memory.jsonl`` (the
test's measurement -- MiB allocated after the forward pass of its depth-5 chain,
``keep_input`` True and False, additive and affine -- for memconv and for MemCNN),
``suite-memconv.json`` and ``suite-memcnn.json`` (each test's outcome).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import memcnn_suite  # noqa: E402

#: The measurement of MemCNN's test_memory_saving, printed as JSON Lines; run with
#: ``memcnn`` resolved to memconv or to MemCNN itself.
MEASURE = r"""
import gc, json, sys, torch
from memcnn.models.tests.test_models import SubModule, SubModuleStack
device, engine = sys.argv[1], sys.argv[2]
for coupling in ("additive", "affine"):
    for keep_input in (True, False):
        for step in range(2):  # memconv checks its inverse in a block's first step
            torch.manual_seed(0)
            dims, depth = [2, 10, 10, 10], 5
            xx = torch.rand(*dims, device=device).requires_grad_()
            ytarget = torch.rand(*dims, device=device)
            network = SubModuleStack(SubModule(in_filters=5, out_filters=5), depth=depth,
                                     keep_input=keep_input, coupling=coupling,
                                     implementation_fwd=-1, implementation_bwd=-1).to(device)
            gc.collect()
            cuda = device == "cuda"
            start = torch.cuda.memory_allocated() / 2**20 if cuda else None
            y = network(xx)
            gc.collect()
            after = torch.cuda.memory_allocated() / 2**20 if cuda else None
            torch.nn.MSELoss()(y, ytarget).backward()
            print(json.dumps({"engine": engine, "device": device, "coupling": coupling,
                              "keep_input": keep_input, "step": step,
                              "forward_mib": None if start is None else after - start,
                              "inputs_mib": 2 * 10 * 10 * 10 * depth * 4 / 2**20}))
            del y, network, xx
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-memcnn")))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="the dry run: memory-saving only")
    parser.add_argument("--time-budget", type=float, default=120.0)
    parser.add_argument("--wheels", type=Path, default=ROOT / "wheels")
    args = parser.parse_args()
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = args.out / "log.txt"

    def left() -> float:
        return args.time_budget - (time.monotonic() - start)

    def log(text: str) -> None:
        line = f"[gpu-memcnn {time.strftime('%H:%M:%S')}, {left():.0f} s left] {text}"
        print(line, flush=True)
        with log_file.open("a") as f:
            f.write(line + "\n")

    work = Path(tempfile.mkdtemp(prefix="gpu-memcnn-"))
    deps = work / "deps"
    for wheel in sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []:
        if not wheel.name.startswith("memcnn-"):
            zipfile.ZipFile(wheel).extractall(deps)
    wheel = memcnn_suite.find_wheel()
    if wheel is None:
        log(f"no memcnn-{memcnn_suite.VERSION} wheel in {memcnn_suite.WHEEL_DIRS}: nothing to run")
        sys.exit(1)
    paths = [str(deps)] if deps.is_dir() else []
    mine = memcnn_suite.build(wheel, work / "memconv", through_memconv=True)
    theirs = memcnn_suite.build(wheel, work / "memcnn", through_memconv=False)
    log(f"MemCNN's tests from {wheel.name} in {work}; device {args.device}")

    def run(name: str, command: list, package: Path, limit: float) -> str:
        limit = min(limit, left() - 5)
        if limit < 5:
            log(f"{name}: skipped, {left():.0f} s left")
            return ""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package), str(ROOT), *paths]))
        env["OMP_NUM_THREADS"] = "1"  # tiny tensors; on the CPU of a dry run, a loaded machine
        log(f"{name}: start (at most {limit:.0f} s)")
        try:
            done = subprocess.run(
                command, env=env, cwd=package, capture_output=True, text=True, timeout=limit
            )
            output, status = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            parts = (e.stdout, e.stderr)
            output = "".join(p.decode() if isinstance(p, bytes) else p or "" for p in parts)
            status = "timeout"
        with log_file.open("a") as f:
            f.write(output)
        log(f"{name}: exit status {status}")
        return output

    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
    saving = run(
        "memory-saving",
        [*pytest, "-k", args.device, "memcnn/models/tests/test_memory_saving.py"],
        mine.parents[2],
        40,
    )
    (args.out / "memory-saving.txt").write_text(saving)
    with (args.out / "memory.jsonl").open("w") as f:
        for engine, folder in (("memconv", mine), ("memcnn", theirs)):
            output = run(
                f"measure-{engine}",
                [sys.executable, "-c", MEASURE, args.device, engine],
                folder.parents[2],
                30,
            )
            f.writelines(line + "\n" for line in output.splitlines() if line.startswith("{"))
    if args.quick:
        log("done (quick: the suites left out)")
        return
    for engine, folder in (("memconv", mine), ("memcnn", theirs)):
        report = work / f"{engine}.xml"
        run(
            f"suite-{engine}", [*pytest, f"--junitxml={report}", str(folder)], folder.parents[2], 45
        )
        found = memcnn_suite.outcomes(report) if report.exists() else {}
        (args.out / f"suite-{engine}.json").write_text(json.dumps(found, indent=1))
        log(f"suite-{engine}: {sorted(found.values()).count('passed')} passed of {len(found)}")
    log(f"done in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
