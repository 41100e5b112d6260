"""The compiled streamed step on the CPU against the compiled conventional step, one
engine per fresh process.

Run as ``python tools/cpu-compiled-streaming.py [--cases resnet18 convnext-tiny]
[--side 2048] [--tile 512] [--threads 2] [--json FILE]``: for each trunk (one image,
float32, 2 threads by default; BatchNorm's statistics drawn at random as a trained
network's) four engines, each in a fresh process:

- ``conventional``: ``out = trunk(x); out.backward(g)``;
- ``conventional compiled``: the same with ``torch.compile(trunk)`` (inductor);
- ``streamed``: ``StreamingCNN(trunk, tile)(x).backward(g)``;
- ``streamed compiled``: ``StreamingCNN(torch.compile(trunk), tile)(x).backward(g)``.

Each process times its first calls until the steady state (a compiled conventional
step: its first call; a compiled streamed step: its first three, the eager pass that
records the tiles, the traces and the compilations) as "first seconds", then the
median of ``--repeats`` calls (wall time), the allocator-level peak of one call
(:func:`memconv.bench.measure.peak_allocated`), the host operations of one call (the
profiler's top-level ATen operations plus the compiled kernels, inductor's kernel
profiling on) and the process's peak RSS. Each process compiles with an empty inductor
cache. Prints one JSON line per process and a Markdown table of ratios against the
conventional step of the same kind (eager against eager, compiled against compiled).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

from fresh_processes import run_each

CASES = ("resnet18", "convnext-tiny")
ENGINES = ("conventional", "conventional compiled", "streamed", "streamed compiled")


def _launches(fn) -> int:
    """Top-level ATen operations and compiled kernels of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for e in prof.events():
        parent = e.cpu_parent
        if e.name.startswith("aten::"):
            count += parent is None or not parent.name.startswith("aten::")
        elif "cpp_fused" in e.name or e.name.startswith("triton_"):
            count += 1
    return count


def worker(tree: str, case: str, engine: str, args) -> dict:
    sys.path.insert(0, tree)
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    import torch
    import torch._inductor.config as inductor_config

    from memconv.bench import trunks
    from memconv.bench.measure import peak_allocated
    from memconv.streaming import StreamingCNN

    inductor_config.cpp.enable_kernel_profile = True  # the kernels, named, for the count
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    trunk = trunks.resnet_trunk(18) if case == "resnet18" else trunks.convnext_trunk()
    trunks.randomise_norms(trunk)
    x = torch.randn(1, 3, args.side, args.side)
    g = None  # the output gradient, drawn at the first call
    run = torch.compile(trunk) if engine.endswith("compiled") else trunk
    if engine.startswith("streamed"):
        run = StreamingCNN(run, args.tile)
    out_shape = None

    def call():
        nonlocal g, out_shape
        trunk.zero_grad(set_to_none=True)
        out = run(x)
        if out_shape is None:
            out_shape = tuple(out.shape)
            g = torch.randn(out_shape, generator=torch.Generator().manual_seed(1))
        out.backward(g)

    warm = 3 if engine == "streamed compiled" else 1
    start = time.perf_counter()
    for _ in range(warm):
        call()
    first = time.perf_counter() - start
    wall = []
    for _ in range(args.repeats):
        w = time.perf_counter()
        call()
        wall.append(time.perf_counter() - w)
    peak, _ = peak_allocated(call, torch.device("cpu"))
    launches = _launches(call)
    record = {
        "case": case,
        "engine": engine,
        "side": args.side,
        "tile": args.tile,
        "threads": args.threads,
        "first_s": first,
        "wall_s": statistics.median(wall),
        "peak_mib": peak,
        "launches": launches,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "checksum": float(sum(p.grad.double().sum() for p in trunk.parameters())),
    }
    if engine == "streamed compiled":
        tiles = run.tiles_by
        record["tiles"] = run.last_plan.count
        record["kinds"] = {"forward": tiles.kinds("forward"), "backward": tiles.kinds("backward")}
        record["refused"] = sorted(set(tiles.refused.values()))
        record["trace_s"] = sum(e.trace_seconds for e in tiles.graphs.values())
        record["compile_s"] = sum(e.compile_seconds or 0 for e in tiles.graphs.values())
    elif engine == "streamed":
        record["tiles"] = run.last_plan.count
    return record


def table(records: list[dict]) -> str:
    rows = [
        "| trunk | side | tile | engine | first steps (s) | step (s) | × conventional | "
        "allocator (MiB) | × | host operations | × | peak RSS (MiB) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in dict.fromkeys(r["case"] for r in records):
        of = {r["engine"]: r for r in records if r["case"] == case}
        for engine in ENGINES:
            r = of.get(engine)
            if r is None:
                continue
            base = of.get("conventional compiled" if "compiled" in engine else "conventional")

            def ratio(key, r=r, base=base):
                return f"{r[key] / base[key]:.2f}" if base and base[key] else "–"

            tile = r["tile"] if engine.startswith("streamed") else "–"
            rows.append(
                f"| {case} | {r['side']}² | {tile} | {engine} | {r['first_s']:.1f} | "
                f"{r['wall_s']:.2f} | {ratio('wall_s')} | {r['peak_mib']:.0f} | "
                f"{ratio('peak_mib')} | {r['launches']:,} | {ratio('launches')} | "
                f"{r['rss_mib']:.0f} |"
            )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--side", type=int, default=2048)
    parser.add_argument("--tile", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(__file__)) or ".")
    parser.add_argument("--json", help="append the records to this JSON Lines file")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = os.path.abspath(args.tree)
    if args.worker:
        print(json.dumps(worker(tree, *args.worker, args)))
        return 0
    options = ["--side", str(args.side), "--tile", str(args.tile)]
    options += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
    records, failed = run_each(__file__, args.cases, args.engines, tree, options, args.json)
    print(table(records))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
