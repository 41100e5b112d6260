"""Where a trunk's step spends its time on the CPU, and the floor recomputation sets
under any streamed step.

Run as ``python tools/cpu-streaming-floor.py [--cases resnet18 convnext-tiny]
[--engines "conventional compiled"] [--side 2048] [--tile 512] [--threads 2]``: for
each trunk and engine (those of ``tools/cpu-compiled-streaming.py``, one image,
float32, each in a fresh process with an empty inductor cache), the median of
``--repeats`` steps (wall time), then one step under the PyTorch profiler, its
top-level time split into convolutions (``aten::convolution``: forward passes),
their backward passes (``aten::convolution_backward``), inductor's compiled kernels,
and the rest.

A streamed step recomputes each tile's forward pass in the backward pass, so it runs
the forward pass twice and the backward pass once. At the conventional step's own
speed, and with nothing else added (no halo, no copies), it would take the
conventional step's time plus its forward pass's: the ``floor`` column, as a multiple
of the conventional step, is ``1 + forward / step`` (the medians of the timed steps'
forward calls and of the whole steps), a lower bound for a streamed step against that
conventional step.
"""

import argparse
import json
import os
import statistics
import sys
import time

from fresh_processes import run_each

CASES = ("resnet18", "convnext-tiny")
ENGINES = ("conventional", "conventional compiled", "streamed", "streamed compiled")


def _split(fn) -> dict:
    """Seconds of one call of ``fn`` by kind of top-level operation."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        total = time.perf_counter() - start
    split = {"convolution_s": 0.0, "convolution_backward_s": 0.0, "kernels_s": 0.0}
    split["kernels"] = 0
    for e in prof.events():
        parent = e.cpu_parent
        seconds = e.cpu_time_total / 1e6
        top = parent is None or not parent.name.startswith("aten::")
        if e.name == "aten::convolution" and top:
            split["convolution_s"] += seconds
        elif e.name == "aten::convolution_backward" and top:
            split["convolution_backward_s"] += seconds
        elif "cpp_fused" in e.name or e.name.startswith("triton_"):
            split["kernels_s"] += seconds
            split["kernels"] += 1
    split["profiled_s"] = total
    split["other_s"] = total - sum(
        v for k, v in split.items() if k.endswith("_s") and k != "profiled_s"
    )
    return split


def worker(tree: str, case: str, engine: str, args) -> dict:
    sys.path.insert(0, tree)
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    import torch
    import torch._inductor.config as inductor_config

    from memconv.bench import trunks
    from memconv.streaming import StreamingCNN

    inductor_config.cpp.enable_kernel_profile = True  # the kernels, named
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    trunk = trunks.resnet_trunk(18) if case == "resnet18" else trunks.convnext_trunk()
    trunks.randomise_norms(trunk)
    x = torch.randn(1, 3, args.side, args.side)
    g = None
    run = torch.compile(trunk) if engine.endswith("compiled") else trunk
    if engine.startswith("streamed"):
        run = StreamingCNN(run, args.tile)

    forward = []

    def call():
        nonlocal g
        trunk.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = run(x)
        forward.append(time.perf_counter() - start)
        if g is None:
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        out.backward(g)

    for _ in range(3 if engine == "streamed compiled" else 1):
        call()
    wall = []
    forward.clear()
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        wall.append(time.perf_counter() - start)
    record = {"case": case, "engine": engine, "side": args.side, "threads": args.threads}
    record["tile"] = args.tile if engine.startswith("streamed") else None
    record["wall_s"] = statistics.median(wall)
    record["forward_s"] = statistics.median(forward)
    record.update(_split(call))
    record["floor"] = 1 + record["forward_s"] / record["wall_s"]
    return record


def table(records: list[dict]) -> str:
    rows = [
        "| trunk | engine | step (s) | forward (s) | profiled (s) | convolutions (s) "
        "| their backward (s) | compiled kernels (s, count) | other (s) | floor × |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        floor = f"{r['floor']:.2f}" if r["engine"].startswith("conventional") else "–"
        rows.append(
            f"| {r['case']} | {r['engine']} | {r['wall_s']:.2f} | {r['forward_s']:.2f} | "
            f"{r['profiled_s']:.2f} | "
            f"{r['convolution_s']:.2f} | {r['convolution_backward_s']:.2f} | "
            f"{r['kernels_s']:.2f} ({r['kernels']:,}) | {r['other_s']:.2f} | {floor} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--engines", nargs="+", default=["conventional compiled"], choices=ENGINES)
    parser.add_argument("--side", type=int, default=2048)
    parser.add_argument("--tile", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(__file__)) or ".")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = os.path.abspath(args.tree)
    if args.worker:
        print(json.dumps(worker(tree, *args.worker, args)))
        return 0
    options = ["--side", str(args.side), "--tile", str(args.tile)]
    options += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
    records, failed = run_each(__file__, args.cases, args.engines, tree, options)
    print(table(records))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
