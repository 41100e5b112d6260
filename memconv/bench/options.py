"""Command-line options shared by ``memconv compare`` and ``memconv bench``: the same
names, the same values, and every accepted value listed in the help."""

from __future__ import annotations

import argparse
import textwrap

import memconv

from .data import SOURCES
from .engines import ENGINES


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; option help wrapped without breaking names at hyphens."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def listed(names) -> str:
    """``"a, b, c"``: accepted values for a help text."""
    return ", ".join(names)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_common_arguments(
    parser: argparse.ArgumentParser, *, engines_help: str, data_help: str = ""
) -> None:
    """The options both commands take.

    Args:
        parser: the sub-command's parser.
        engines_help: what ``--engines`` means for this command (the accepted names
            are appended).
        data_help: appended to the help of ``--data``.
    """
    strategies = memconv.strategies()
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=strategies,
        default=list(strategies),
        metavar="STRATEGY",
        help=f"memconv strategies to measure (default: all): {listed(strategies)}",
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=[*ENGINES, "all"],
        metavar="ENGINE",
        help=f"{engines_help}. Accepted: all, {listed(ENGINES)}",
    )
    parser.add_argument(
        "--data",
        choices=SOURCES,
        default="digits",
        help="real handwritten digits (scikit-learn's, resized), real photo crops "
        f"(scikit-image's) or random noise (default: digits){data_help}",
    )
    parser.add_argument(
        "--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs per engine; the median is reported (default: 3)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=1800.0,
        metavar="SECONDS",
        help="time one engine may take before it is reported as failed (default: 1800)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write every figure to PATH as JSON, rewritten after each measurement",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="save a plot of peak memory against time to PATH (needs matplotlib)",
    )


def engine_needs(engines) -> dict[str, str]:
    """``{module: engine}`` for the optional peers of ``engines``."""
    return {ENGINES[e].requires: e for e in engines if ENGINES[e].requires}


def data_needs(data: str) -> dict[str, str]:
    """``{module: why}`` for loading the real data of ``--data``."""
    if data == "digits":
        return {"numpy": "--data digits", "sklearn": "--data digits"}
    if data == "photos":
        return {"numpy": "--data photos", "skimage": "--data photos"}
    return {}
