"""BackPACK's diagonal GGN extensions on All-CNN-C with and without memconv.

Each configuration in a fresh process (``--one``), float32, CIFAR-100 shapes (batch 8,
3×32×32): a warm-up step of plain autograd, then one step under the extension. On the
CPU (one thread) the peak increase is the largest RSS (sampled every 2 ms) during the
step minus the RSS before it; on CUDA, the allocator's peak during the step minus what
was allocated before it. Prints one JSON line per configuration (also appended to
``--json``), then a table with memconv's figures as multiples of BackPACK's::

    python tools/bench-backpack-diag.py [--v 10 100] [--ext DiagGGNExact BatchDiagGGNExact]
    python tools/bench-backpack-diag.py --device cuda --time-budget 120 --json out.jsonl
    python tools/bench-backpack-diag.py --device cpu --quick       # a dry run, seconds

``--time-only`` samples no RSS (no sampling thread taking CPU time beside the step);
every line has the step's wall time (``seconds``) and its process CPU time
(``cpu_seconds``, ``time.process_time()``). ``--ext KFAC`` (or ``KFLR``) times the
Kronecker-factored extensions too (their checksum sums every factor).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's memconv

ENGINES = {
    "backpack": "BackPACK 1.7.1 alone",
    "memconv": "memconv install() (lean default)",
    "memconv-one-pass": "memconv install(memory_budget=None)",
    "memconv-chunked": "memconv install(memory_budget=64 MiB)",
}
BUDGET = 64 * 2**20


def one(
    engine: str, ext_name: str, v: int, device: str, batch: int, time_only: bool = False
) -> dict:
    import torch
    from backpack import backpack, extend
    from backpack import extensions as E
    from torch import nn

    from memconv.bench.models import all_cnn_c
    from memconv.integrations import backpack as mb

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = extend(all_cnn_c(num_classes=v).to(device))
    lossfn = extend(nn.CrossEntropyLoss())
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, v, (batch,), device=device)
    lossfn(model(x), y).backward()  # warm-up: plain autograd
    model.zero_grad()
    ext = getattr(E, ext_name)()
    if engine == "memconv":
        mb.install(ext)
    elif engine == "memconv-one-pass":
        mb.install(ext, memory_budget=None)
    elif engine == "memconv-chunked":
        mb.install(ext, memory_budget=BUDGET)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    elif not time_only:
        import psutil

        proc = psutil.Process()
        before = proc.memory_info().rss
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
    else:
        before, peak = 0, [0]
    start, cpu_start = time.perf_counter(), time.process_time()
    with backpack(ext):
        lossfn(model(x), y).backward()
    if cuda:
        torch.cuda.synchronize()
        peak = [torch.cuda.max_memory_allocated()]
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    if not cuda and not time_only:
        done.set()
        sampler.join()
    checksum = 0.0
    for p in model.parameters():
        quantity = getattr(p, ext.savefield)
        for part in quantity if isinstance(quantity, list) else [quantity]:
            checksum += float(part.double().sum())
    return {
        "engine": engine,
        "extension": ext_name,
        "V": v,
        "N": batch,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "peak_rss_increase_mib": None if time_only and not cuda else (peak[0] - before) / 2**20,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "checksum": checksum,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--v", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--ext", nargs="+", default=["DiagGGNExact", "BatchDiagGGNExact"])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="V=10 and batch 2 only")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds in all")
    parser.add_argument("--json", default=None, help="append the JSON lines to this file")
    parser.add_argument("--time-only", action="store_true", help="no RSS sampling thread")
    parser.add_argument("--one", nargs=3, metavar=("ENGINE", "EXT", "V"))
    args = parser.parse_args()
    if args.quick:
        args.v, args.batch = [10], 2
    if args.one:
        engine, ext, v = args.one
        row = one(engine, ext, int(v), args.device, args.batch, args.time_only)
        print(json.dumps(row), flush=True)
        return
    start, rows = time.perf_counter(), []
    for ext in args.ext:
        for v in args.v:
            for engine in args.engines:
                left = None
                if args.time_budget is not None:
                    left = args.time_budget - (time.perf_counter() - start)
                    if left < 5:
                        print(f"time budget spent: {engine} {ext} V={v} not run", flush=True)
                        continue
                command = [sys.executable, __file__, "--one", engine, ext, str(v)]
                command += ["--device", args.device, "--batch", str(args.batch)]
                command += ["--time-only"] if args.time_only else []
                try:
                    out = subprocess.run(
                        command, capture_output=True, text=True, check=True, timeout=left
                    )
                except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
                    print(f"{engine} {ext} V={v}: {type(err).__name__}", flush=True)
                    print(getattr(err, "stderr", "") or "", flush=True)
                    continue
                row = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(
        "\n| extension | V | engine | peak RSS increase | time (CPU) | vs BackPACK (memory, time) |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        ref = next(
            (
                r
                for r in rows
                if r["engine"] == "backpack"
                and r["extension"] == row["extension"]
                and r["V"] == row["V"]
            ),
            None,
        )
        mib = row["peak_rss_increase_mib"]
        memory = "–" if mib is None else f"+{mib:.0f} MiB"
        ratio = "–"
        if ref is not None:
            ref_mib = ref["peak_rss_increase_mib"]
            ratio = f"{row['seconds'] / ref['seconds']:.2f}×"
            if mib is not None and ref_mib is not None:
                ratio = f"{mib / max(ref_mib, 1e-9):.2f}×, " + ratio
        print(
            f"| {row['extension']} | {row['V']} | {ENGINES[row['engine']]} | {memory} | "
            f"{row['seconds']:.2f} s ({row['cpu_seconds']:.2f} s) | {ratio} |"
        )


if __name__ == "__main__":
    main()
