"""Command line: ``memconv compare`` (the main job) and ``memconv bench``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The ``memconv`` argument parser with its sub-commands."""
    from .bench import bench, compare

    parser = argparse.ArgumentParser(prog="memconv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "compare",
        help="per-sample gradients of the seed CNN with every strategy, validated",
        description=compare.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_arguments(p)
    p.set_defaults(func=compare.main)
    p = sub.add_parser(
        "bench",
        help="peak memory and run time of every engine on a matrix of cases",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(p)
    p.set_defaults(func=bench.main)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``memconv`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
