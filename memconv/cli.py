"""Command line: ``memconv compare`` (the main job) and ``memconv bench``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The ``memconv`` argument parser with its sub-commands."""
    from .bench import bench, compare

    parser = argparse.ArgumentParser(prog="memconv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = (
        ("compare", compare, "per-sample gradients of the seed CNN with every strategy, validated"),
        ("bench", bench, "peak memory and run time of every engine on a matrix of cases"),
    )
    for name, module, summary in commands:
        p = sub.add_parser(
            name,
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(func=module.main)
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
