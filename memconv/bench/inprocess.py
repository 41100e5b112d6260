"""In-process step times and allocator peaks: every engine of a row in one process, as
ratios to the row's floor — the GPU targets of docs/benchmarks-cuda.md in minutes.

``memconv bench`` measures each engine in a fresh process (some 10 s each on a GPU
machine); here one process builds each case once and times its engines in turn
(median of ``--repeats`` calls after three warm-up calls, CUDA-synchronised), with the
allocator's peak above the state before the timed calls (CUDA only). TF32 is off on
CUDA (:func:`memconv.bench.options.strict_float32`), as the run record says. Each row
is written to ``--json`` as it completes; ``--time-budget`` skips a row that will not
fit what is left (judged by the rows so far), so a run stopped midway keeps its rows.

Run it as::

    python -m memconv.bench.inprocess --device cuda --json results/inprocess.jsonl

(``--quick``: small shapes, a smoke test of seconds on a CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone

import torch

from .cases import CASES, build_case
from .engines import available, get_engine
from .options import command_line, device_record, machine, strict_float32

CLIP = ("non-private", "opacus-ghost", "torch.func", "memconv:step")
MODELS = ("non-private", "opacus-ghost", "memconv:step")
GRADS = ("autograd", "torch.func", "memconv:step")
#: ``(task, case, batch, engines)``, the floor first, in the order the targets are
#: judged by (ResNet-18-GN at 256 and 1024, the models people train and the seed
#: CNN's per-sample gradients at 256, then at 1024).
ROWS = (
    ("clip", "resnet18-gn", 256, CLIP),
    ("clip", "vit-tiny", 256, MODELS),
    ("clip", "convnext-atto", 256, MODELS),
    ("grads", "seed-112", 256, GRADS),
    ("clip", "resnet18-gn", 1024, CLIP),
    ("clip", "nf-resnet26", 256, MODELS),
    ("clip", "resnet18-tv-gn", 256, MODELS),
    ("clip", "vit-tiny", 1024, MODELS),
)
ROWS += tuple(
    ("clip", case, 1024, MODELS) for case in ("convnext-atto", "nf-resnet26", "resnet18-tv-gn")
)
ROWS += (("grads", "seed-112", 1024, GRADS),)
#: ``--rows lean``: the lean default's GPU check (ConvNeXt-atto and ViT-tiny at 256 against
#: their non-private step, NF-ResNet-26's allocator), PrivateStep and the plain call side
#: by side; about two minutes on one H100.
LEAN = ("non-private", "memconv:step", "memconv:default")
LEAN_ROWS = tuple(
    ("clip", case, 256, LEAN) for case in ("convnext-atto", "vit-tiny", "nf-resnet26")
)
#: The rows of ``--quick``: two small cases at their quick sizes, seconds on a CPU.
QUICK_ROWS = (
    ("clip", "resnet18-gn", 2, CLIP),
    ("grads", "seed-28", 4, GRADS),
)


def _now() -> float:
    """Seconds of a monotonic clock (the time budget's)."""
    return time.monotonic()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run, model, x, y, options: dict, device: torch.device, repeats: int) -> dict:
    """Median seconds of ``repeats`` calls after three warm-up calls, and the allocator's
    peak above the state before them (MiB; CUDA only, else None)."""
    for _ in range(3):
        run(model, x, y, **options)
        model.zero_grad(set_to_none=True)
    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = run(model, x, y, **options)
        _sync(device)
        times.append(time.perf_counter() - start)
        del out
        model.zero_grad(set_to_none=True)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else None
    return {"time_s": statistics.median(times), "alloc_mib": peak}


def run_row(task, case, batch, engines, device, repeats, write, *, quick=False, deadline=None):
    """Measure one row's engines on one model and batch, writing each record; an engine
    that would start past ``deadline`` (a :func:`_now` time) is recorded as skipped."""
    config = {**CASES[case].config(quick=quick, batch=batch), "data": "random"}
    model, x, y = build_case(config, device)
    options = {"max_norm": 1.0} if task == "clip" else {}
    floor = None
    for name in engines:
        engine = get_engine(name, task)
        record = {"record": "row", "task": task, "case": case, "batch": batch, "engine": name}
        why = available(engine)
        if why is None and deadline is not None and _now() > deadline:
            why = "past --time-budget"
        if why:
            write({**record, "skipped": why})
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # peers' warnings, once per call
                got = measure(engine.run, model, x, y, options, device, repeats)
        except Exception as err:  # noqa: BLE001 (a peer's failure is a row, not the end)
            write({**record, "failed": f"{type(err).__name__}: {err}"[:500]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        floor = floor or got
        ratio = {"time_x": got["time_s"] / floor["time_s"]}
        if got["alloc_mib"] is not None and floor["alloc_mib"]:
            ratio["alloc_x"] = got["alloc_mib"] / floor["alloc_mib"]
        write({**record, **got, **ratio})
    del model, x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memconv.bench.inprocess", description=__doc__)
    parser.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    parser.add_argument("--json", required=True, help="JSON Lines file, a record per engine")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls (default 10)")
    parser.add_argument(
        "--time-budget", type=float, help="seconds; rows that will not fit are skipped"
    )
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke test")
    parser.add_argument(
        "--rows",
        choices=("all", "lean"),
        default="all",
        help="all: every target row (default); lean: ConvNeXt-atto, ViT-tiny and "
        "NF-ResNet-26 at 256, the non-private step, PrivateStep and the plain call",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.time_budget is not None and not args.time_budget > 0:
        parser.error("--time-budget must be a positive number of seconds")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    strict_float32(args.device)
    started = _now()
    rows = ROWS if args.rows == "all" else LEAN_ROWS
    if args.quick:  # the rows' first two cases at their quick sizes
        rows = QUICK_ROWS if args.rows == "all" else tuple((t, c, 2, e) for t, c, _, e in rows[:2])
    with open(args.json, "w") as out:

        def write(record):
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(json.dumps(record), flush=True)

        write(
            {
                "record": "run",
                "mode": "inprocess",
                "command": "python -m memconv.bench.inprocess "
                + command_line(argv).removeprefix("memconv "),
                "machine": machine(),
                "device": device_record(args.device),
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
        )
        longest = 0.0
        for task, case, batch, engines in rows:
            left = None if args.time_budget is None else args.time_budget - (_now() - started)
            if left is not None and left < 1.5 * longest:
                write(
                    {
                        "record": "skipped",
                        "task": task,
                        "case": case,
                        "batch": batch,
                        "why": f"about {1.5 * longest:.0f} s needed, {max(left, 0):.0f} s left",
                    }
                )
                continue
            t0 = _now()
            deadline = None if args.time_budget is None else started + args.time_budget
            run_row(
                task,
                case,
                batch,
                engines,
                device,
                args.repeats,
                write,
                quick=args.quick,
                deadline=deadline,
            )
            longest = max(longest, _now() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
