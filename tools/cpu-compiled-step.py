"""The compiled DP step on the CPU against the compiled non-private step, one engine
per fresh process.

Run as ``python tools/cpu-compiled-step.py [--cases ...] [--batch 64] [--threads 2]
[--json FILE]``: for each model (batch 64, float32, 2 threads by default) four engines,
each in a fresh process, alternating within the round:

- ``non-private``: ``loss_fn(model(x), y).backward()``;
- ``non-private compiled``: the same with ``torch.compile(model)`` (inductor);
- ``memconv``: ``PrivateStep(model, loss_fn).clip_and_accumulate(x, y, max_norm=1.0)``;
- ``memconv compiled``: the same with ``PrivateStep(torch.compile(model), loss_fn)``;
- ``memconv block`` and ``memconv block compiled``: the user's own step in the
  clipping block, ``with memconv.clipping(model, max_norm=1.0):
  loss_fn(model(x), y).backward()`` (a new block each step, as a training loop opens
  it), on the model and on ``torch.compile(model)``; with ``--mask``, the block's
  wrapper form ``clip.forward(x, sample_mask=mask)``, as Opacus' ``make_private`` calls
  it.

Each process times its first calls until the steady state (a compiled non-private
step: its first call; memconv compiled and memconv block compiled: their first three,
the eager plan, the trace and the compilation) as "first seconds", then the median of three calls (wall time
and the process's CPU time), the allocator-level peak of one call, the host launches
of one call (the profiler's top-level ATen operations plus the compiled kernels,
inductor's kernel profiling on), and the process's peak RSS; for ``memconv block
compiled``, also the traced step's nodes and the bytes its forward half hands its
backward half (``handed_mib``). Each process compiles
with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` of its own unless set), so
the first step's time includes a first compilation. Prints one JSON line per
process and a Markdown table of ratios against the compiled non-private step.

``--options JSON`` compiles with those inductor options (``torch.compile(model,
options=...)``, which memconv's traced step keeps above its own); ``--mode`` with
that mode (``reduce-overhead``: CUDA graphs) and ``--backend`` with another backend
(``cudagraphs`` where a GPU's Python lacks triton, ``aot_eager`` for a dry run).
``--device cuda`` runs on a GPU (times CUDA-synchronised, the allocator's peak from
``torch.cuda.max_memory_allocated``, launches the kernel and graph launches the
profiler sees). ``--mask`` gives every step the same physical batch with its last
quarter masked out, as a padded Poisson batch is (``sample_mask=``; the non-private
step sums the masked per-sample losses). A GPU runs it as ``python
tools/cpu-compiled-step.py --device cuda --batch 256 --mode reduce-overhead --mask
--cases convnext-atto vit-tiny nf-resnet26 cifar-resnet18-gn --engines "non-private
compiled" "memconv compiled"`` (``tools/gpu-run.sh``'s ``compiled`` step).

``--run STEPS`` measures what a user's ``/usr/bin/time -v`` shows of a short training
run instead: each process runs ``STEPS`` steps and nothing else (no profiler, no
allocator replay), and reports the median step's time and the process's peak RSS
(``ru_maxrss``, the import of torch included), in a table of ratios against the
eager non-private run.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

from fresh_processes import run_each

CASES = {
    "cifar-resnet18-gn": 32,
    "tv-resnet18-gn": 64,
    "convnext-atto": 64,
    "vit-tiny": 32,
    "nf-resnet26": 64,
}
ENGINES = (
    "non-private",
    "non-private compiled",
    "memconv",
    "memconv compiled",
    "memconv block",
    "memconv block compiled",
)


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
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch"):
            count += 1
    return count


def worker(tree: str, case: str, engine: str, args) -> dict:
    batch, threads, run_steps = args.batch, args.threads, args.run
    sys.path.insert(0, tree)
    import tempfile

    # a cold compiler cache: the first step's time is a first compilation's
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    import torch
    import torch._inductor.config as inductor_config
    from torch import nn

    import memconv
    from memconv.bench import models
    from memconv.bench.measure import peak_allocated

    inductor_config.cpp.enable_kernel_profile = True  # the kernels, named, for the count
    torch.set_num_threads(threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    build = {
        "cifar-resnet18-gn": models.resnet18_gn,
        "tv-resnet18-gn": models.tv_resnet18_gn,
        "convnext-atto": models.convnext_atto,
        "vit-tiny": models.vit_tiny,
        "nf-resnet26": models.nf_resnet26,
    }[case]
    model = build().to(device)
    side = CASES[case]
    x = torch.randn(batch, 3, side, side, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    mask = torch.arange(batch, device=device) < batch - batch // 4 if args.mask else None
    # a masked batch: summed losses, the padded ones out (the unmasked runs: the mean)
    loss = nn.CrossEntropyLoss(reduction="sum" if args.mask else "mean")
    compile_options = json.loads(os.environ.get("CPU_COMPILED_STEP_OPTIONS") or "null")
    compiled = engine.endswith("compiled")
    kwargs = {"backend": args.backend} if args.backend else {}
    if args.mode:
        kwargs["mode"] = args.mode
    elif compile_options:
        kwargs["options"] = compile_options
    run = torch.compile(model, **kwargs) if compiled else model
    block = engine.startswith("memconv block")
    route = {"clip_route": args.clip_route} if args.clip_route else {}
    step = memconv.PrivateStep(run, loss, **route) if engine.startswith("memconv") else None
    reduction = "sum" if args.mask else "mean"
    wrapper = (
        memconv.clipping(run, max_norm=1.0, loss_reduction=reduction, **route) if block else None
    )

    def call():
        model.zero_grad(set_to_none=True)
        if block and mask is None:
            with memconv.clipping(run, max_norm=1.0, **route):
                loss(run(x), y).backward()
        elif block:  # the wrapper form, a padded batch (Opacus' private module)
            loss(wrapper.forward(x, sample_mask=mask), y).backward()
        elif step is None and mask is None:
            loss(run(x), y).backward()
        elif step is None:  # the padded samples' losses masked out
            losses = nn.functional.cross_entropy(run(x), y, reduction="none")
            (losses * mask).sum().backward()
        else:
            step.clip_and_accumulate(x, y, max_norm=1.0, sample_mask=mask)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if run_steps:  # a short run, as a user's process runs it
        times = []
        for _ in range(run_steps):
            w = time.perf_counter()
            call()
            times.append(time.perf_counter() - w)
        return {
            "case": case,
            "engine": engine,
            "batch": batch,
            "threads": threads,
            "steps": run_steps,
            "device": device.type,
            "step_s": statistics.median(times),
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    warm = 3 if engine in ("memconv compiled", "memconv block compiled") else 1
    start = time.perf_counter()
    for _ in range(warm):
        call()
    first = time.perf_counter() - start
    wall, cpu = [], []
    for _ in range(3):
        w, c = time.perf_counter(), time.process_time()
        call()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    peak, _ = peak_allocated(call, device)
    launches = _launches(call)
    record = {
        "case": case,
        "engine": engine,
        "batch": batch,
        "threads": threads,
        "device": device.type,
        "mode": args.mode,
        "backend": args.backend,
        "mask": args.mask,
        "clip_route": args.clip_route,
        "first_s": first,
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "peak_mib": peak,
        "launches": launches,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if block and compiled:
        from memconv.engine.prepared import kept_for_blocks

        traced = kept_for_blocks(run).traced
        record["traces"] = traced.traces
        record["refused"] = list(traced.refused.values())
        split = next(iter(traced.splits.values()), None)
        if split is not None:
            record["nodes"] = len(split.forward_graph.graph.nodes) + len(
                split.backward_graph.graph.nodes
            )
            record["trace_s"] = split.trace_seconds
            inputs = split.forward_graph.graph.find_nodes(op="placeholder")
            if len(inputs) == 1:  # the samples alone (no mask): the bytes the forward
                _, handed = split.forward((x,))  # half hands the backward half
                held = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in handed}
                record["handed_mib"] = sum(h.nbytes() for h in held.values()) / 2**20
    elif step is not None and engine.endswith("compiled"):
        traced = step._prepared.traced
        record["traces"] = traced.traces
        record["refused"] = list(traced.refused.values())
        graph = next(iter(traced.graphs.values()), None)
        record["nodes"] = len(graph.graph.graph.nodes) if graph is not None else None
        record["trace_s"] = graph.trace_seconds if graph is not None else None
        record["compile_s"] = graph.compile_seconds if graph is not None else None
    return record


def _by_case(records: list[dict], base_engine: str):
    """``(case, engine, record, the case's record of base_engine or None)`` in the
    order of the cases met and of :data:`ENGINES`."""
    for case in dict.fromkeys(r["case"] for r in records):
        of = {r["engine"]: r for r in records if r["case"] == case}
        for engine in ENGINES:
            if engine in of:
                yield case, engine, of[engine], of.get(base_engine)


def _ratio(r: dict, base: dict | None, key: str) -> str:
    return f"{r[key] / base[key]:.2f}" if base and base[key] else "–"


def table(records: list[dict]) -> str:
    rows = [
        "| model | engine | first step (s) | step (s) | × compiled non-private | allocator "
        "(MiB) | × | launches | × | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, engine, r, base in _by_case(records, "non-private compiled"):
        rows.append(
            f"| {case} | {engine} | {r['first_s']:.1f} | {r['wall_s']:.3f} | "
            f"{_ratio(r, base, 'wall_s')} | {r['peak_mib']:.0f} | "
            f"{_ratio(r, base, 'peak_mib')} | {r['launches']} | "
            f"{_ratio(r, base, 'launches')} | {r['rss_mib']:.0f} |"
        )
    return "\n".join(rows)


def run_table(records: list[dict]) -> str:
    rows = [
        "| model | engine | steps | median step (s) | peak RSS (MiB) | × non-private |",
        "|---|---|---|---|---|---|",
    ]
    for case, engine, r, base in _by_case(records, "non-private"):
        rows.append(
            f"| {case} | {engine} | {r['steps']} | {r['step_s']:.3f} | "
            f"{r['rss_mib']:.0f} | {_ratio(r, base, 'rss_mib')} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(__file__)) or ".")
    parser.add_argument("--json", help="append the records to this JSON Lines file")
    parser.add_argument(
        "--run", type=int, default=0, metavar="STEPS", help="a short run's peak RSS instead"
    )
    parser.add_argument(
        "--options", metavar="JSON", help="inductor options of torch.compile, e.g. '{\"a\": 1}'"
    )
    parser.add_argument("--mode", help="torch.compile's mode, e.g. reduce-overhead")
    parser.add_argument("--backend", help="torch.compile's backend (default: inductor)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--mask", action="store_true", help="mask the batch's last quarter")
    parser.add_argument(
        "--clip-route", choices=("book-keeping", "two-pass"), help="memconv's (default: its plan's)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "ENGINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = os.path.abspath(args.tree)
    if args.worker:
        record = worker(tree, *args.worker, args)
        print(json.dumps(record))
        return 0
    if args.options:
        os.environ["CPU_COMPILED_STEP_OPTIONS"] = args.options
    options = ["--batch", str(args.batch), "--threads", str(args.threads)]
    options += ["--run", str(args.run), "--device", args.device]
    options += ["--mode", args.mode] if args.mode else []
    options += ["--backend", args.backend] if args.backend else []
    options += ["--mask"] if args.mask else []
    options += ["--clip-route", args.clip_route] if args.clip_route else []
    records, failed = run_each(__file__, args.cases, args.engines, tree, options, args.json)
    print(run_table(records) if args.run else table(records))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
