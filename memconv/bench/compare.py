"""``memconv compare``: every strategy on the seed CNN, validated against each other.

For each strategy (and the plain-autograd floor and torch.func as the independent
reference) the per-sample gradient pass runs in a fresh subprocess; the table
reports the peak memory increase (MiB, ``memory_profiler``; and the allocator-level
figure), the median run time, and the largest relative deviation from the other
rows' results.
"""

from __future__ import annotations

import argparse
import logging

import torch

from .options import add_common_arguments, data_needs, engine_needs, positive_int
from .report import JsonRecord, machine, plot, require
from .runner import run_engines

logger = logging.getLogger("memconv")

#: The engines besides memconv's strategies, unless ``--engines`` says otherwise.
DEFAULT_ENGINES = ("autograd", "torch.func")
#: Largest relative deviation between two rows that still counts as agreement.
TOLERANCE = 1e-4

DESCRIPTION = """\
Compute the per-sample gradients of the CNN from BackPACK's "Saving memory in
convolutions" example on a batch of real images with every memconv strategy, plus
plain autograd (the summed gradient only: the memory floor) and torch.func (an
independent reference). Each row runs in a fresh Python process. The table gives
the peak memory increase (process RSS sampled by memory_profiler, and the PyTorch
allocator's peak), the median run time after a warm-up, the size of the result and
the largest relative deviation from any other row. Exits with status 1 if two rows
disagree by more than 1e-4 or a row fails.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memconv compare``."""
    parser.add_argument(
        "--batch-size", type=positive_int, default=64, help="samples in the batch, N (default: 64)"
    )
    parser.add_argument(
        "--side",
        type=positive_int,
        default=28,
        help="image side in pixels, at least 27 (default: 28)",
    )
    add_common_arguments(
        parser,
        engines_help="other engines to run beside memconv's strategies "
        f"(default: {' '.join(DEFAULT_ENGINES)}; 'all': every engine that is not memconv's)",
    )


def engines_of(args) -> list[str]:
    """The engine names a ``compare`` run measures, in order.

    Raises:
        ValueError: on a side too small for the seed CNN, or an unusable device.
    """
    if args.side < 27:
        raise ValueError("--side must be at least 27 for the seed CNN")
    torch.device(args.device)
    from .engines import ENGINES

    others = list(DEFAULT_ENGINES) if args.engines is None else list(args.engines)
    if "all" in others:
        others = [e for e in ENGINES if not e.startswith("memconv")]
    ours = [f"memconv:{s}" for s in args.strategies]
    return list(dict.fromkeys(others + ours))


def format_table(rows: list[dict]) -> str:
    """Markdown table of the rows."""
    lines = [
        "| engine | peak RSS increase (MiB) | allocator peak (MiB) | time (s) | result (MiB) "
        "| max rel. deviation |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = f"failed: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"| {r['engine']} | {why} | | | | |")
            continue
        alloc = "-" if r.get("peak_alloc_mib") is None else f"{r['peak_alloc_mib']:,.0f}"
        lines.append(
            f"| {r['engine']} | {r['peak_rss_mib']:,.0f} | {alloc} | {r['time_s']:.3f} | "
            f"{r['result_mib']:,.1f} | {r.get('deviation', float('nan')):.1e} |"
        )
    return "\n".join(lines)


def title(base: dict) -> str:
    """The heading of the table."""
    return (
        f"seed CNN of BackPACK's save-memory example, batch {base['batch']} × 1×"
        f"{base['side']}×{base['side']} ({base['data']}), {base['device']}, float32"
    )


def main(args) -> int:
    """Run the comparison and print the table; returns the exit status."""
    engines = engines_of(args)
    needs = {"memory_profiler": "memory measurement", **data_needs(args.data)}
    needs.update(engine_needs(engines))
    if args.plot:
        needs["matplotlib"] = "--plot"
    require(needs)
    from tqdm import tqdm

    base = {
        "model": "seed",
        "batch": args.batch_size,
        "side": args.side,
        "data": args.data,
        "device": args.device,
        "repeats": args.repeats,
    }
    record = JsonRecord(args.json, {"case": base, "machine": machine(), "rows": []})
    with tqdm(total=len(engines), desc="engines", unit="engine") as bar:

        def on_row(row):
            record.document["rows"].append(row)
            record.write()
            bar.update()

        rows = run_engines(
            base, engines, on_start=bar.set_postfix_str, on_row=on_row, timeout=args.timeout
        )
    print(f"\n{title(base)}\n")
    print(format_table(rows))
    worst = max((r.get("deviation", 0.0) for r in rows), default=0.0)
    failed = [r["engine"] for r in rows if "error" in r]
    print(f"\nlargest relative deviation between any two rows: {worst:.1e}")
    record.finish(largest_deviation=worst)  # earlier rows' deviations grew as rows arrived
    if args.plot:
        plot([{"case": base, "rows": rows}], args.plot, title)
    if failed:
        logger.error("failed: %s", ", ".join(failed))
    if worst > TOLERANCE:
        logger.error("rows disagree by %.1e (more than %.0e)", worst, TOLERANCE)
    return 1 if failed or worst > TOLERANCE else 0
