"""KFAC on a GPU: BackPACK alone, with memconv's module extensions, and curvlinops.

The GPU rows of the curvature benchmark (docs/curvature.md): All-CNN-C (CIFAR-100
shapes), one step per engine -- the plain backward, BackPACK 1.7.1's KFAC, the same
extension with memconv's Kronecker module extensions, curvlinops' KFACLinearOperator
(fisher_type="mc", kfac_approx="expand") -- at batch 8 and 128: the median time of
three steps after a warm-up step, and the allocator's peak increase over the step
(torch.cuda.max_memory_allocated), engines taking turns in one process.

``--compiled`` adds the compiled rows: the plain step of ``torch.compile(model)``
(``plain-compiled``) and memconv's KFAC step on the compiled extended model,
``memconv.integrations.backpack.step(torch.compile(model), ...)`` (``memconv-compiled``),
each after two warm-up steps (the trace, then the compilation; their seconds are the
row's ``first_s``). The backend: ``--backend``, by default inductor where triton
imports and ``cudagraphs`` where it does not (on the CPU: inductor).

    OUT=/some/folder python3 tools/gpu-curvature.py --budget 140 --wheels wheels
    OUT=/tmp/x python3 tools/gpu-curvature.py --device cpu --quick     # dry run
    OUT=/some/folder python3 tools/gpu-curvature.py --compiled --budget 400 --wheels wheels

The machine's python3 needs torch (CUDA); the peers' pure-Python wheels are unpacked
from --wheels (fetch them where a registry is):

    pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels \\
      backpack-for-pytorch==1.7.1 einops==0.8.2 unfoldNd==0.2.3 \\
      curvlinops-for-pytorch==3.0.1 einconv==0.1.0 linear_operator==0.6.1 \\
      opt_einsum==3.4.0 jaxtyping==0.3.11 wadler_lindig==0.1.8

curvlinops also needs scipy (no pure-Python wheel): without it its rows say so.
Writes $OUT/curvature-cuda.jsonl (one line per engine and batch) and
$OUT/curvature-cuda.txt (the table); stops starting new steps past --budget seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _unpack(wheels: str | None) -> None:
    if not wheels or not Path(wheels).is_dir():
        return
    target = tempfile.mkdtemp(prefix="wheels-")
    for wheel in sorted(Path(wheels).glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    sys.path.insert(0, target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", type=float, default=140.0, help="seconds in all")
    parser.add_argument("--wheels", default="wheels")
    parser.add_argument("--quick", action="store_true", help="batch 2, V=10, one timed step")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--compiled", action="store_true", help="add the compiled rows")
    parser.add_argument("--backend", help="torch.compile's backend of the compiled rows")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("set OUT (or --out) to the folder the results go to")
    start = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    _unpack(args.wheels)
    import torch

    from memconv.bench.kfac import _step as compiled_stepper
    from memconv.bench.options import benchmark_backend
    from memconv.bench.second_order import _stepper, all_cnn_c

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # a dry run on a shared CPU: no thread contention
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    classes, batches, repeats = (10, (2,), 1) if args.quick else (100, (8, 128), 3)
    engines = ("plain", "backpack", "memconv", "curvlinops")
    if args.compiled:
        engines += ("plain-compiled", "memconv-compiled")
    backend = args.backend or benchmark_backend(args.device)
    rows = []
    log = open(out / "curvature-cuda.jsonl", "w")

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    for batch in batches:
        torch.manual_seed(0)
        x = torch.randn(batch, 3, 32, 32, device=device)
        y = torch.randint(0, classes, (batch,), device=device)
        for engine in engines:
            row = {"model": "allcnnc", "classes": classes, "batch": batch, "engine": engine}
            row["extension"] = "plain" if engine.startswith("plain") else "KFAC"
            if time.perf_counter() - start > args.budget:
                row["skipped"] = "past the time budget"
            else:
                try:
                    torch.manual_seed(0)
                    model = all_cnn_c(classes).to(device)
                    if engine.endswith("compiled"):
                        row["backend"] = backend
                        name = engine.replace("memconv", "kfac")
                        step = compiled_stepper(name, "allcnnc", model, backend)
                    else:
                        step = _stepper(engine, row["extension"], "allcnnc", model)
                    first = time.perf_counter()
                    for _ in range(2 if engine.endswith("compiled") else 1):  # warm-up
                        step(x, y)
                    sync()
                    row["first_s"] = time.perf_counter() - first
                    base = torch.cuda.memory_allocated(device) if cuda else 0
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    times = []
                    for _ in range(repeats):
                        sync()
                        t0 = time.perf_counter()
                        step(x, y)
                        sync()
                        times.append(time.perf_counter() - t0)
                    row["time_s"] = statistics.median(times)
                    if cuda:
                        row["peak_alloc_mib"] = (
                            torch.cuda.max_memory_allocated(device) - base
                        ) / 2**20
                    del model, step
                except Exception as err:  # a peer that cannot run here: its row says why
                    row["error"] = f"{type(err).__name__}: {err}"[:200]
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
    lines = [
        f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}"
    ]
    for batch in batches:
        case = [r for r in rows if r["batch"] == batch]
        timed = {r["engine"]: r for r in case if "time_s" in r}
        for r in case:
            if "time_s" not in r:
                lines.append(f"N={batch} {r['engine']}: {r.get('error') or r.get('skipped')}")
                continue
            base = "plain-compiled" if r["engine"].endswith("compiled") else "plain"
            plain = timed.get(base)
            ratio = f" ({r['time_s'] / plain['time_s']:.2f}x {base})" if plain else ""
            memory = f", +{r['peak_alloc_mib']:.0f} MiB" if "peak_alloc_mib" in r else ""
            lines.append(f"N={batch} {r['engine']}: {r['time_s'] * 1e3:.1f} ms{ratio}{memory}")
    (out / "curvature-cuda.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
