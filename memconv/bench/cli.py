"""Command line: ``memconv compare`` (the main job), ``memconv bench`` and ``memconv list``."""

from __future__ import annotations

import argparse
import logging
import sys

DESCRIPTION = (
    "memconv: exact, memory-lean per-sample gradients, DP-SGD clipping and whole-call "
    "memory budgets for CNNs. Commands: compare (every memconv strategy on the seed CNN, "
    "validated against torch.func), bench (engines of memconv and its peers on benchmark "
    "cases: matrix, sweeps, largest batch within a memory limit, reports), suite (every "
    "benchmark table a GPU changes, on one device), calibrate (fit the cost models on a "
    "device, or check them against its allocator), list (the accepted names of tasks, "
    "engines, cases, strategies and data)."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``memconv`` argument parser with its sub-commands."""
    import memconv

    from . import bench, calibrate, compare, suite

    parser = argparse.ArgumentParser(
        prog="memconv",
        description=DESCRIPTION,
        epilog="Run 'memconv COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"memconv {memconv.__version__}")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="progress messages off (warnings only)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (
        ("compare", compare, "every memconv strategy on the seed CNN, validated (the main job)"),
        ("bench", bench, "engines of memconv and its peers on benchmark cases"),
        ("suite", suite, "every benchmark table a GPU changes, on one device"),
        ("calibrate", calibrate, "fit the cost models on a device; --check: against its allocator"),
    )
    for name, module, summary in commands:
        p = sub.add_parser(name, help=summary, description=module.DESCRIPTION)
        module.add_arguments(p)
        p.set_defaults(func=module.main, parser=p)
    p = sub.add_parser(
        "list",
        help="the accepted names of tasks, engines, cases, strategies and data",
        description="Print the tasks, engines (per task), cases, memconv strategies and "
        "data sources that compare and bench accept, with a line on each.",
    )
    p.set_defaults(func=list_names, parser=p)
    return parser


def list_names(args) -> int:
    """``memconv list``: every accepted name, with a line on each."""
    import memconv

    from .cases import CASES, describe
    from .data import SOURCE_SUMMARIES, SOURCES
    from .engines import ENGINES, available

    print("tasks (memconv bench --task):")
    print("  grads       per-sample gradients")
    print("  clip        DP-SGD clipped sums of per-sample gradients")
    print("  clip-layer  per-layer clipping (a threshold per parameter) against flat")
    for task, engines in ENGINES.items():
        print(f"\nengines of task {task} (memconv bench --engines):")
        width = max(len(n) for n in engines)
        for name, engine in engines.items():
            missing = available(engine)
            note = f"  [{missing}]" if missing else ""
            print(f"  {name:{width}s}  {engine.summary}{note}")
    print("\ncases (memconv bench --cases):")
    width = max(len(n) for n in CASES)
    for name, case in CASES.items():
        print(f"  {name:{width}s}  {describe(case.config())}: {case.summary}")
    print("\nstrategies (memconv compare --strategies):")
    names = memconv.available_strategies()
    width = max(len(n) for n in names)
    for name in names:
        doc = (type(memconv.strategies.get_strategy(name)).__doc__ or "").strip()
        print(f"  {name:{width}s}  {doc.splitlines()[0] if doc else ''}")
    print("\ndata (--data):")
    width = max(len(n) for n in SOURCES)
    for name in SOURCES:
        print(f"  {name:{width}s}  {SOURCE_SUMMARIES[name]}")
    return 0


def _configure_logging(quiet: bool) -> None:
    logger = logging.getLogger("memconv")
    if not any(getattr(h, "_memconv_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._memconv_cli = True
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def main(argv=None) -> int:
    """Entry point of the ``memconv`` console script."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    _configure_logging(args.quiet)
    try:
        return args.func(args)
    except (ValueError, ImportError) as err:
        args.parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
