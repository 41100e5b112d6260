"""Reversible networks: one training step's memory and time against depth, and the
reconstruction error against depth. Two commands::

    python -m memconv.bench.reversible steps --depths 4,8,16,32,64 \\
        --memcnn-python /path/to/venv-with-memcnn/bin/python \\
        --json docs/bench/reversible.jsonl --markdown docs/benchmarks.md
    python -m memconv.bench.reversible errors --depths 4,8,16,32,64 \\
        --json docs/bench/reversible-errors.jsonl --markdown docs/reversible.md

``steps`` runs one training step of a RevNet-style CNN (:class:`RevNet`) per engine and
depth. Memory: each engine and depth in a fresh process
(:func:`memconv.bench.runner.run_in_subprocess`, the measurements of
:mod:`memconv.bench.measure`: a warm-up step on two samples, then the peak RSS increase
of one step and the allocator's peak of another). Time: all engines of a depth in one process,
taking turns for ``--repeats`` rounds after a warm-up round (the median per engine),
so that a shared machine's drifting load slows them alike. The engines:

- ``conventional``: the same blocks without a wrapper, ``loss.backward()``;
- ``checkpoint``: each block under ``torch.utils.checkpoint.checkpoint``
  (``use_reentrant=False``), which keeps each block's input;
- ``memcnn``: MemCNN's ``InvertibleModuleWrapper`` and ``AdditiveCoupling`` (run by
  ``--memcnn-python``, an interpreter with MemCNN installed; skipped without one);
- ``memconv``: :class:`memconv.reversible.InvertibleModuleWrapper`;
- ``memconv-clip``: one DP-SGD clipping step, :func:`memconv.clip_and_accumulate` on
  the memconv network (the plan's clipping route); ``memconv-clip-two-pass``: the
  same on the two-pass route.

The gradients of each step are compared with the conventional step's (the clipping
steps with the clipped sum of ``conventional-clip``, :func:`memconv.clip_and_accumulate`
on the network without wrappers, when it runs). ``errors`` trains nothing: it runs one
backward pass of chains of coupling blocks under
:func:`memconv.reversible.check_reconstruction` and reports the first block's error
(the largest of the chain) in float32 and float64.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

import memconv
from memconv.reversible import (
    AdditiveCoupling,
    AffineAdapterSigmoid,
    AffineCoupling,
    InvertibleModuleWrapper,
    check_reconstruction,
)

from .measure import median_time, peak_allocated, peak_rss_increase
from .runner import JsonLines, max_rel_deviation, read_records, run_in_subprocess

ENGINES = (
    "conventional",
    "checkpoint",
    "memcnn",
    "memconv",
    "conventional-clip",
    "memconv-clip",
    "memconv-clip-two-pass",
)
#: What each engine's result is compared with.
REFERENCES = {
    "checkpoint": "conventional",
    "memcnn": "conventional",
    "memconv": "conventional",
    "memconv-clip": "conventional-clip",
    "memconv-clip-two-pass": "conventional-clip",
}
MAX_NORM = 1.0
CPU = torch.device("cpu")


def residual(channels: int, groups: int = 4) -> nn.Module:
    """RevNet's residual function on one half (Gomez et al. 2017, section 5: the basic
    block, pre-activation), GroupNorm for BatchNorm as DP-SGD needs."""
    return nn.Sequential(
        nn.GroupNorm(groups, channels),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.GroupNorm(groups, channels),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, bias=False),
    )


class RevNet(nn.Module):
    """A RevNet-style CNN: a stem convolution, two stages of reversible blocks (``C``
    channels at full resolution, ``2C`` at half, ``depth / 2`` blocks each) joined by a
    strided convolution (RevNet's non-reversible downsampling), GroupNorm-ReLU, global
    average pooling and a linear classifier.

    Args:
        depth: reversible blocks in all (even).
        channels: ``C``.
        classes: outputs.
        block: ``block(fn) -> module`` applied to each coupling (identity: no wrapper).
        coupling: the coupling class (``AdditiveCoupling(Fm, Gm)``).
    """

    def __init__(
        self, depth: int, channels: int = 32, classes: int = 10, block=None, coupling=None
    ):
        super().__init__()
        block = block or (lambda fn: fn)
        coupling = coupling or AdditiveCoupling
        half = depth // 2
        c = channels
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.stage1 = nn.Sequential(
            *[block(coupling(residual(c // 2), residual(c // 2))) for _ in range(half)]
        )
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False)
        self.stage2 = nn.Sequential(
            *[block(coupling(residual(c), residual(c))) for _ in range(depth - half)]
        )
        self.head = nn.Sequential(
            nn.GroupNorm(4, 2 * c), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        x = self.stage1(self.stem(x))
        x = self.stage2(self.down(x))
        return self.fc(self.head(x))


class _Checkpointed(nn.Module):
    def __init__(self, fn: nn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.fn, x, use_reentrant=False)


def build(engine: str, depth: int, channels: int, seed: int = 0) -> nn.Module:
    """The network of ``engine`` (one seed: the same weights for every engine)."""
    block = coupling = None
    if engine == "checkpoint":
        block = _Checkpointed
    elif engine == "memcnn":
        import memcnn

        coupling, block = memcnn.AdditiveCoupling, memcnn.InvertibleModuleWrapper
    elif engine.startswith("memconv"):
        block = InvertibleModuleWrapper
    torch.manual_seed(seed)
    return RevNet(depth, channels, block=block, coupling=coupling)


def _data(batch: int, size: int):
    torch.manual_seed(1)
    return torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))


def _stepper(engine: str, model: nn.Module):
    """One training step of ``engine`` on ``model``: ``step(x, y)``."""
    loss = nn.CrossEntropyLoss(reduction="sum")
    route = "two-pass" if engine.endswith("two-pass") else None
    private = engine.endswith("clip") or route is not None

    def step(x, y):
        model.zero_grad(set_to_none=True)
        if private:
            memconv.clip_and_accumulate(model, loss, x, y, max_norm=MAX_NORM, clip_route=route)
        else:
            loss(model(x), y).backward()

    return step


def _case(batch: int = 8, size: int = 128, channels: int = 32, threads: int = 1):
    """``(channels, (x, y))`` of a case: batch, image side, the first stage's channels,
    torch threads (set)."""
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore", FutureWarning)  # MemCNN's deprecated torch.cuda.amp
    return channels, _data(batch, size)


def measure_memory(engine: str, depth: int, out: str | None = None, **case) -> dict:
    """One engine's training step on one depth, in this (fresh) process: after a
    warm-up step on two samples, the peak RSS increase (MiB) of one step, then the
    allocator peak (MiB) of another (the profiler's records would add to the RSS); the
    step's gradients saved to ``out``. ``case``: ``batch``, ``size``, ``channels``,
    ``threads`` (:func:`_case`)."""
    channels, (x, y) = _case(**case)
    model = build(engine, depth, channels)
    step = _stepper(engine, model)
    step(x[:2], y[:2])
    rss, _ = peak_rss_increase(lambda: step(x, y))
    alloc, _ = peak_allocated(lambda: step(x, y), CPU)
    if out:
        torch.save({k: p.grad.detach().clone() for k, p in model.named_parameters()}, out)
    return {
        "peak_rss_mib": rss,
        "peak_alloc_mib": alloc,
        "params": sum(p.numel() for p in model.parameters()),
    }


def measure_times(engines: list, depth: int, repeats: int = 3, **case) -> dict:
    """The median time (s) of one training step of each engine on one depth, the
    engines taking turns in this process (``repeats`` rounds after a warm-up round), so
    that a machine whose load drifts slows them alike. ``case``: as
    :func:`measure_memory`'s."""
    channels, (x, y) = _case(**case)
    steps = {e: _stepper(e, build(e, depth, channels)) for e in engines}
    for step in steps.values():
        step(x, y)
    times: dict = {e: [] for e in engines}
    for _ in range(repeats):
        for engine, step in steps.items():
            times[engine].append(median_time(lambda step=step: step(x, y), 1, CPU, warm_up=False))
    return {
        "times_s": {e: statistics.median(t) for e, t in times.items()},
        "load": os.getloadavg()[0],
    }


def run_steps(args) -> list[dict]:
    """Every engine at every depth: its memory in a fresh process each, then the
    times of all of them, taking turns in one process; rows as they come."""
    log = JsonLines(args.json, {"command": "steps", **_setup(args)})
    rows = []
    sizes = {"batch": args.batch, "size": args.size, "channels": args.channels}
    for depth in args.depths:
        with tempfile.TemporaryDirectory() as tmp:
            results, depth_rows = {}, []
            for engine in args.engines:
                if engine == "memcnn" and not args.memcnn_python:
                    depth_rows.append({"engine": engine, "skipped": "no --memcnn-python"})
                    continue
                path = os.path.join(tmp, f"{engine}.pt")
                kwargs = {"engine": engine, "depth": depth, **sizes, "threads": args.threads}
                config = {
                    "call": "memconv.bench.reversible:measure_memory",
                    "args": {**kwargs, "out": path},
                }
                python = args.memcnn_python if engine == "memcnn" else None
                row = {"engine": engine, **run_in_subprocess(config, python=python)}
                if "error" not in row and os.path.exists(path):
                    results[engine] = torch.load(path)
                    reference = results.get(REFERENCES.get(engine, ""))
                    if reference is not None:
                        row["deviation"] = max_rel_deviation(results[engine], reference)
                depth_rows.append(row)
                print(json.dumps({"depth": depth, **row}), flush=True)
            timed = [r["engine"] for r in depth_rows if "error" not in r and "skipped" not in r]
            config = {
                "call": "memconv.bench.reversible:measure_times",
                "args": {
                    "engines": timed,
                    "depth": depth,
                    **sizes,
                    "repeats": args.repeats,
                    "threads": args.threads,
                },
            }
            python = args.memcnn_python if "memcnn" in timed else None
            times = run_in_subprocess(config, python=python)
            for row in depth_rows:
                if row["engine"] in times.get("times_s", {}):
                    row["time_s"] = times["times_s"][row["engine"]]
                    row["load"] = times["load"]
                elif "error" in times and "skipped" not in row:
                    row["time_error"] = times["error"]
                row = {"depth": depth, **row}
                rows.append(row)
                log.write(row)
            print(json.dumps({"depth": depth, **times}), flush=True)
    return rows


def _setup(args) -> dict:
    return {
        "batch": args.batch,
        "size": args.size,
        "channels": args.channels,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "memconv": memconv.__version__,
    }


def steps_table(rows: list[dict]) -> str:
    """The markdown table of :func:`run_steps`'s rows: per depth and engine, the peak
    RSS increase and allocator peak (MiB), their growth from the smallest depth, the
    time and its ratio to the conventional step (the clipping steps: to memconv's
    non-private step), and the deviation of the gradients."""
    depths = sorted({r["depth"] for r in rows})
    engines = [e for e in ENGINES if any(r["engine"] == e for r in rows)]
    by = {(r["engine"], r["depth"]): r for r in rows}
    lines = [
        "| depth | engine | peak RSS (MiB) | allocator peak (MiB) | × depth "
        f"{depths[0]} | time (s) | × base | deviation |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for depth in depths:
        for engine in engines:
            r = by.get((engine, depth))
            if r is None:
                continue
            if "peak_rss_mib" not in r:
                reason = r.get("skipped") or r.get("error") or "no figures"
                lines.append(f"| {depth} | {engine} | {reason} | | | | | |")
                continue
            base = "memconv" if engine.startswith("memconv-clip") else "conventional"
            first = by.get((engine, depths[0]), {})
            growth = _ratio(r.get("peak_alloc_mib"), first.get("peak_alloc_mib"))
            ratio = _ratio(r.get("time_s"), by.get((base, depth), {}).get("time_s"))
            deviation = r.get("deviation")
            cells = [
                str(depth),
                engine,
                f"{r['peak_rss_mib']:,.0f}",
                f"{r['peak_alloc_mib']:,.0f}",
                growth,
                f"{r['time_s']:.2f}" if r.get("time_s") is not None else "",
                ratio,
                f"{deviation:.0e}" if deviation is not None else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else ""


def reconstruction_errors(depth: int, coupling: str, dtype: torch.dtype, channels: int = 16):
    """The largest reconstruction error (relative) of a chain of ``depth`` coupling
    blocks of ``channels`` channels on 8×``channels``×32×32 inputs, and the error of its
    last block (one inverse)."""
    torch.manual_seed(0)
    half = channels // 2
    blocks = []
    for _ in range(depth):
        if coupling == "additive":
            fn = AdditiveCoupling(residual(half, groups=2))
        else:
            body = nn.Sequential(residual(half, groups=2), nn.Conv2d(half, channels, 1))
            fn = AffineCoupling(body, adapter=AffineAdapterSigmoid)
        blocks.append(InvertibleModuleWrapper(fn))
    model = nn.Sequential(*blocks).to(dtype)
    x = torch.randn(8, channels, 32, 32, dtype=dtype, requires_grad=True)
    with check_reconstruction(model) as report:
        model(x).square().sum().backward()
    return report.worst(), report.errors[str(depth - 1)].relative


def run_errors(args) -> list[dict]:
    log = JsonLines(args.json, {"command": "errors", **_setup(args)})
    rows = []
    for coupling in ("additive", "affine"):
        for dtype in (torch.float32, torch.float64):
            for depth in args.depths:
                worst, one = reconstruction_errors(depth, coupling, dtype)
                row = {
                    "coupling": coupling,
                    "dtype": str(dtype).replace("torch.", ""),
                    "depth": depth,
                    "first_block": worst,
                    "last_block": one,
                }
                rows.append(row)
                log.write(row)
                print(json.dumps(row), flush=True)
    return rows


def errors_table(rows: list[dict]) -> str:
    depths = sorted({r["depth"] for r in rows})
    lines = [
        "| coupling | dtype | " + " | ".join(f"depth {d}" for d in depths) + " |",
        "|---|---|" + "---:|" * len(depths),
    ]
    by = {(r["coupling"], r["dtype"], r["depth"]): r for r in rows}
    for coupling in ("additive", "affine"):
        for dtype in ("float32", "float64"):
            cells = [by.get((coupling, dtype, d), {}).get("first_block") for d in depths]
            if all(c is None for c in cells):
                continue
            shown = (f"{c:.1e}" if c is not None else "" for c in cells)
            lines.append(f"| {coupling} | {dtype} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def fill(page: str, name: str, text: str) -> str:
    """``page`` with the block ``<!-- reversible:NAME -->…<!-- /reversible:NAME -->``
    refilled.

    Raises:
        ValueError: the page has no such block.
    """
    start, end = f"<!-- reversible:{name} -->", f"<!-- /reversible:{name} -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(page):
        raise ValueError(f"the page has no {start} block")
    return pattern.sub(lambda _: f"{start}\n{text}\n{end}", page)


#: The options of the command line: ``{flag: add_argument's keyword arguments}``.
OPTIONS = {
    "--depths": {"default": "4,8,16,32,64", "help": "reversible blocks (even numbers)"},
    "--engines": {"default": ",".join(ENGINES), "help": "steps: the engines"},
    "--batch": {"type": int, "default": 8, "help": "steps: the batch size"},
    "--size": {"type": int, "default": 128, "help": "steps: the image side"},
    "--channels": {"type": int, "default": 32, "help": "steps: the first stage's channels"},
    "--repeats": {"type": int, "default": 3, "help": "steps: timed rounds (the median)"},
    "--threads": {"type": int, "default": 1, "help": "torch threads (default 1)"},
    "--memcnn-python": {"help": "steps: an interpreter with MemCNN installed"},
    "--json": {"help": "write the rows to this JSON Lines file"},
    "--from-json": {"help": "refill the page from this file, measure nothing"},
    "--markdown": {"help": "refill the page's reversible:<command> block"},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memconv.bench.reversible", description=__doc__)
    parser.add_argument("command", choices=("steps", "errors"))
    for flag, options in OPTIONS.items():
        parser.add_argument(flag, **options)
    args = parser.parse_args(argv)
    args.depths = [int(d) for d in args.depths.split(",")]
    args.engines = args.engines.split(",")
    if any(d < 2 or d % 2 for d in args.depths):
        parser.error("--depths must be even numbers of at least 2")
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; accepted: {', '.join(ENGINES)}")
    torch.set_num_threads(args.threads)
    if args.from_json:
        rows = [r for r in read_records([args.from_json]) if "command" not in r]
    elif args.command == "steps":
        rows = run_steps(args)
    else:
        rows = run_errors(args)
    text = steps_table(rows) if args.command == "steps" else errors_table(rows)
    print(text)
    if args.markdown:
        page = Path(args.markdown)
        page.write_text(fill(page.read_text(), args.command, text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
