"""Streaming on a GPU, side by side: one training step of a trunk, conventional (autograd)
against memconv.streaming.StreamingCNN at several tiles, in one process.

Trunks: torchvision's ResNet-18 trunk as torchvision writes it (memconv.bench.trunks,
BatchNorm in eval mode, a global-pool + Linear head) at 4096², and StreamingCNN's example
network (Lightstream's test network: six 3×3 convolutions of 16 channels, padding 0, three
2×2 max-pools; memconv.bench.models.streaming_net) at 4096² and 8192²; float32, one image.
Per row: the median of three synchronised steps after one warm-up (seconds), the allocator
peak above the state before (MiB), the top-level ATen operations of one step and per tile
(torch.profiler, host side), and the largest relative difference of any parameter
gradient from the conventional step's. Lightstream 1.0.7 runs beside them where it
imports (its wheel and lightning's are not needed otherwise).

``--compiled`` adds the compiled rows: ``conventional compiled`` (the trunk
``torch.compile``'d) and ``memconv compiled`` (``StreamingCNN(torch.compile(trunk),
tile)``: each kind of tile's forward and backward work one compiled graph), with
``--backend`` (by default inductor where triton imports, ``cudagraphs`` where it does
not). Their first steps (the eager step that records the tiles, the traces, the
compilations) are the row's ``first_s``; their operations count the compiled kernels too.
On two CPU cores the dry run's compiled rows take about 7 minutes a tile size (tile 64:
16 tiles, 412 s of first steps).

Usage (the lead's GPU run; each row stops being started once the budget is spent):

    python3 tools/gpu-streaming.py --out "$OUT" --budget 150
    python3 tools/gpu-streaming.py --device cpu --quick --out /tmp/dry   # the dry run
    python3 tools/gpu-streaming.py --out "$OUT" --budget 400 --compiled --only resnet18-trunk

Writes ``gpu-streaming.jsonl`` (one JSON record per row, as it goes) and ``log.txt`` into
the output folder.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402


def models(quick: bool):
    """``(name, side, trunk, head)`` rows."""
    from memconv.bench.models import streaming_net
    from memconv.bench.trunks import classifier, resnet_trunk

    resnet = classifier("resnet18")
    if quick:  # a narrow ResNet-18-style trunk: the dry run checks the script, not speed
        # (16 channels wide: at 8, torch 2.13's inductor aborts its compiled backward on
        # the CPU, "double free or corruption", in the downsampling convolution's)
        trunk = resnet_trunk(18, width=16, layers=(1, 1, 1, 1))
        head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 2))
        resnet = (trunk, head)
    net = streaming_net()
    sides = (256, 512) if quick else (4096, 8192)
    rows = [("resnet18-trunk", sides[0], resnet[0], resnet[1])]
    for side in sides:
        rows.append(("streamingcnn-net", side, net[:15], net[15:]))
    return rows


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_fn(kind: str, trunk, head, tile, backend=None):
    """A training step ``f(x, y)`` of ``kind``: conventional, memconv or lightstream;
    ``kind`` ending in `` compiled``: the trunk ``torch.compile``'d with ``backend``."""
    loss = nn.CrossEntropyLoss()
    if kind.endswith(" compiled"):
        trunk = torch.compile(trunk, backend=backend)
        kind = kind.removesuffix(" compiled")
    if kind == "conventional":
        return lambda x, y: loss(head(trunk(x)), y).backward()
    if kind == "memconv":
        from memconv.streaming import StreamingCNN

        stream = StreamingCNN(trunk, tile)

        def run(x, y):
            loss(head(stream(x)), y).backward()

        run.stream = stream
        return run
    from lightstream.core.scnn.scnn import StreamingCNN as LS  # optional peer

    stream = LS(trunk, tile_shape=(1, 3, tile, tile))

    def run(x, y):
        with torch.no_grad():
            out = stream.forward(x)
        out.requires_grad_()
        loss(head(out), y).backward()
        stream.backward(x, out.grad)

    return run


def operations(fn) -> int:
    """Top-level ATen operations of one call (host side), and the compiled kernels
    (inductor's C++ kernels, named where its kernel profiling is on, and its triton
    kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    kernels = [e for e in prof.events() if "cpp_fused" in e.name or e.name.startswith("triton_")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(top) + len(kernels)


def measure(kind, name, side, trunk, head, tile, device, ref, repeats, backend=None):
    from memconv.bench.measure import median_time

    trunk, head = copy.deepcopy(trunk).to(device), copy.deepcopy(head).to(device)
    torch.manual_seed(0)
    x = torch.rand(1, 3, side, side, device=device)
    y = torch.tensor([1], device=device)
    params = list(trunk.parameters()) + list(head.parameters())
    fn = step_fn(kind, trunk, head, tile, backend)

    def once():
        for p in params:
            p.grad = None
        fn(x, y)

    first = time.perf_counter()
    for _ in range(3 if kind == "memconv compiled" else 1):  # record, trace, compile
        once()
    sync(device)
    first = time.perf_counter() - first
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    seconds = median_time(once, repeats, device, warm_up=False)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
    grads = [p.grad.detach().clone() for p in trunk.parameters() if p.grad is not None]
    ops = operations(once)
    tiles = fn.stream.last_plan.count if hasattr(fn, "stream") else 1
    err = None
    if ref is not None and len(ref) == len(grads):
        err = max(
            ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
            for g, r in zip(grads, ref)
        )
    row = {
        "trunk": name,
        "side": side,
        "engine": kind,
        "tile": tile,
        "tiles": tiles,
        "time_s": seconds,
        "alloc_mib": peak,
        "ops": ops,
        "ops_per_tile": ops / tiles,
        "first_s": first,
        "backend": backend if kind.endswith(" compiled") else None,
        "grad_rel_err": err,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    return row, grads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for everything")
    parser.add_argument("--quick", action="store_true", help="small images (a dry run)")
    parser.add_argument("--compiled", action="store_true", help="add the compiled rows")
    parser.add_argument("--backend", help="torch.compile's backend of the compiled rows")
    parser.add_argument("--only", nargs="+", help="these trunks only (resnet18-trunk, ...)")
    args = parser.parse_args(argv)
    start = time.time()
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "log.txt"), "w")  # noqa: SIM115
    records = open(os.path.join(args.out, "gpu-streaming.jsonl"), "w")  # noqa: SIM115

    def say(text):
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    say(f"torch {torch.__version__}, device {device}, budget {args.budget:.0f} s")
    from memconv.bench.options import benchmark_backend

    tiles = (64, 128) if args.quick else (1024, 2048)
    repeats = 1 if args.quick else 3
    backend = args.backend or benchmark_backend(args.device)
    if args.compiled:  # inductor's C++ kernels named in the profile, to be counted
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    for name, side, trunk, head in models(args.quick):
        if args.only and name not in args.only:
            continue
        ref = None
        runs = [("conventional", None)] + [
            (k, t) for t in tiles for k in ("memconv", "lightstream")
        ]
        if args.compiled:
            runs += [("conventional compiled", None)] + [("memconv compiled", t) for t in tiles]
        for kind, tile in runs:
            spent = time.time() - start
            if spent > args.budget * 0.8:
                say(f"budget: {spent:.0f} s spent, {name} {side} {kind} {tile} not started")
                continue
            try:
                row, grads = measure(
                    kind, name, side, trunk, head, tile, device, ref, repeats, backend
                )
                if kind == "conventional":
                    ref = grads
            except ImportError as err:
                row = {
                    "trunk": name,
                    "side": side,
                    "engine": kind,
                    "tile": tile,
                    "skipped": f"{type(err).__name__}: {err}",
                }
            except Exception as err:  # noqa: BLE001 - reported in the row
                row = {
                    "trunk": name,
                    "side": side,
                    "engine": kind,
                    "tile": tile,
                    "error": f"{type(err).__name__}: {str(err)[:300]}",
                }
            records.write(json.dumps(row) + "\n")
            records.flush()
            say(json.dumps(row))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    say(f"done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
