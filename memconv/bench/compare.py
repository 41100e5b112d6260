"""``memconv compare``: every strategy on the seed CNN, validated against torch.func.

For each strategy (and the plain-autograd floor and torch.func as the independent
reference) the per-sample gradient pass runs in a fresh process
(:func:`memconv.bench.runner.measure_engines`); the table reports the peak memory
increase (process RSS and allocator level), the median run time, and the largest
relative deviation from torch.func's result.
"""

from __future__ import annotations

import argparse
import logging
import time
from datetime import datetime, timezone

import memconv

from . import options
from .cases import MIN_SIDE
from .engines import get_engine
from .options import (
    add_common,
    check_dependencies,
    check_device,
    command_line,
    machine,
    parse_names,
    positive_int,
)

logger = logging.getLogger("memconv")

DESCRIPTION = (
    "Per-sample gradients of the seed CNN (the CNN of BackPACK's 'Saving memory in "
    "convolutions' example) with every memconv strategy, plus plain autograd (the floor: "
    "summed gradient only) and torch.func (the reference), each in a fresh process. "
    "Prints the peak memory increase (process RSS and allocator level), the median run "
    "time and each result's largest relative deviation from torch.func's. Exit status 1 "
    "if a row fails or deviates by more than 1e-4."
)
TOLERANCE = 1e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memconv compare``."""
    parser.add_argument(
        "--batch-size", type=positive_int, default=64, metavar="N", help="batch size (default: 64)"
    )
    parser.add_argument(
        "--side",
        type=positive_int,
        default=28,
        metavar="S",
        help="image side in pixels, at least 27 (default: 28)",
    )
    strategies = ", ".join(memconv.available_strategies())
    parser.add_argument(
        "--strategies",
        default="all",
        metavar="NAMES",
        help=f"comma-separated memconv strategies, or all (default: all); accepted: {strategies}",
    )
    add_common(parser, data_default="digits")


def check_arguments(args) -> list[str]:
    """Validate the options before any work; returns the engine names.

    Raises:
        ValueError: a side too small for the seed CNN, an unknown strategy or device.
        ImportError: a missing optional dependency.
    """
    if args.side < MIN_SIDE["seed"]:
        raise ValueError(f"--side must be at least {MIN_SIDE['seed']} for the seed CNN")
    check_device(args.device)
    names = parse_names(args.strategies, memconv.available_strategies(), "--strategies")
    engines = ["autograd", "torch.func"] + [f"memconv:{s}" for s in names]
    check_dependencies([get_engine(e) for e in engines], plot=bool(args.plot), data=args.data)
    options.prepare_outputs(args.plot, args.json)
    return engines


def main(args) -> int:
    """Run the comparison and print the table; returns the exit status."""
    from .report import format_case, terminal
    from .runner import JsonLines, measure_engines

    engines = check_arguments(args)
    started = time.time()
    base = {
        "case": "compare",
        "model": "seed",
        "batch": args.batch_size,
        "side": args.side,
        "data": args.data,
        "device": args.device,
        "repeats": args.repeats,
    }
    out = JsonLines(
        args.json,
        {
            "record": "run",
            "mode": "compare",
            "command": command_line(getattr(args, "argv", None)),
            "machine": machine(),
            "device": options.device_record(args.device),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "plot": args.plot,
        },
    )
    config = {k: base[k] for k in ("model", "batch", "side", "data")}

    done = [0]

    def on_row(row):
        done[0] += 1
        logger.info("[%d/%d] %s: %s", done[0], len(engines), row["engine"], _summary(row))
        out.write({"record": "row", "task": "grads", "case": "compare", "config": config, **row})

    rows = measure_engines(base, engines, task="grads", on_row=on_row)
    rows.sort(key=lambda r: engines.index(r["engine"]))
    print(
        f"\nseed CNN of BackPACK's save-memory example, batch {args.batch_size} × 1×"
        f"{args.side}×{args.side} ({args.data}), {args.device}, float32\n"
    )
    print(terminal(format_case("grads", config, rows)))
    worst = max((r.get("deviation", 0.0) for r in rows), default=0.0)
    failed = [r["engine"] for r in rows if "error" in r]
    print(f"\nlargest relative deviation from torch.func: {worst:.1e}")
    if args.plot:
        from .plots import plot_cases

        plot_cases([("grads", config, rows)], args.plot)
    out.write({"record": "done", "elapsed_s": time.time() - started})
    return 1 if failed or worst > TOLERANCE else 0


def _summary(row: dict) -> str:
    if "skipped" in row:
        return f"skipped ({row['skipped']})"
    if "error" in row:
        return f"failed ({row['error']})"
    if row.get("aborted"):
        return "stopped: over the memory limit"
    parts = [f"peak RSS +{row['peak_rss_mib']:,.0f} MiB"]
    if row.get("peak_alloc_mib") is not None:
        parts.append(f"allocator {row['peak_alloc_mib']:,.0f} MiB")
    if row.get("time_s") is not None:
        parts.append(f"{row['time_s']:.3f} s")
    if row.get("deviation") is not None:
        parts.append(f"deviation {row['deviation']:.1e}")
    return ", ".join(parts)
