"""The ``memconv`` command: ``compare`` (the main job), ``bench`` and ``list``."""

from __future__ import annotations

import argparse
import logging
import sys

from ._version import __version__

DESCRIPTION = """\
Measure memconv's memory-lean convolution backward passes against autograd,
torch.func, BackPACK and Opacus. Every measurement runs in a fresh Python
process; the results of all engines are checked against each other.
"""

EPILOG = """\
compare and bench need the 'bench' extra (pip install 'memconv[bench]'); the
BackPACK and Opacus engines need the 'backpack' and 'opacus' extras.
Run 'memconv COMMAND --help' for the options of a command.
"""


def _list(args) -> int:
    """Print the accepted strategy, engine, model and data names."""
    import memconv

    from .bench.cases import MODELS
    from .bench.data import SOURCES
    from .bench.engines import ENGINES, available

    print("strategies (--strategies):")
    for name in memconv.strategies():
        print(f"  {name}")
    print("engines (--engines):")
    for name, engine in ENGINES.items():
        why = available(engine)
        print(f"  {name}" + (f"  [unavailable: {why}]" if why else ""))
    print("models (memconv bench --models):")
    for name in MODELS:
        print(f"  {name}")
    print("data (--data):")
    for name in SOURCES:
        print(f"  {name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``memconv`` argument parser with its sub-commands."""
    from .bench import bench, compare
    from .bench.options import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="memconv", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"memconv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (
        ("compare", compare, "every strategy on the seed CNN, measured and cross-checked"),
        ("bench", bench, "every engine on a matrix of cases: memory, time, cost model"),
    )
    for name, module, summary in commands:
        p = sub.add_parser(
            name, help=summary, description=module.DESCRIPTION, formatter_class=HelpFormatter
        )
        module.add_arguments(p)
        _add_verbosity(p)
        p.set_defaults(func=module.main)
    p = sub.add_parser(
        "list",
        help="the accepted strategy, engine, model and data names",
        description="Print the names --strategies, --engines, --models and --data accept, "
        "and which engines cannot run here for want of an optional dependency.",
        formatter_class=HelpFormatter,
    )
    _add_verbosity(p)
    p.set_defaults(func=_list)
    return parser


def _add_verbosity(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "-v", "--verbose", action="store_true", help="log what memconv does (DEBUG level)"
    )
    group.add_argument("-q", "--quiet", action="store_true", help="log errors only")


def _configure_logging(args) -> None:
    level = logging.DEBUG if args.verbose else logging.ERROR if args.quiet else logging.INFO
    logger = logging.getLogger("memconv")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("memconv: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)


def main(argv=None) -> int:
    """Entry point of the ``memconv`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args)
    from .bench.report import MissingDependencyError

    try:
        return args.func(args)
    except MissingDependencyError as err:
        print(f"memconv {args.command}: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
