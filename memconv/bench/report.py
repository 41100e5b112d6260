"""What the measurements leave behind: the machine, JSON written as rows arrive, a plot,
and a check of the optional dependencies before a long run starts."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import platform

import torch

from .._version import __version__

logger = logging.getLogger("memconv")

#: Optional modules the measurements use, and the extra of memconv that installs each.
EXTRAS = {
    "numpy": "bench",
    "memory_profiler": "bench",
    "sklearn": "bench",
    "skimage": "bench",
    "matplotlib": "bench",
    "backpack": "backpack",
    "opacus": "opacus",
}


class MissingDependencyError(ImportError):
    """An optional dependency a command needs is not installed (the message names the
    ``pip install 'memconv[EXTRA]'`` line)."""


def missing(modules) -> list[str]:
    """The modules of ``modules`` that cannot be imported here."""
    return [m for m in dict.fromkeys(modules) if importlib.util.find_spec(m) is None]


def require(needs: dict[str, str]) -> None:
    """Check, before any work, that every module a run needs is installed.

    Args:
        needs: ``{module: what needs it}``, e.g. ``{"matplotlib": "--plot"}``.

    Raises:
        MissingDependencyError: naming each missing module, what needs it, and the
            extra to install.
    """
    absent = missing(needs)
    if not absent:
        return
    extras = sorted({EXTRAS.get(m, "bench") for m in absent})
    lines = [f"  {m} (needed by {needs[m]})" for m in absent]
    raise MissingDependencyError(
        "missing optional dependencies:\n"
        + "\n".join(lines)
        + f"\ninstall them with: pip install 'memconv[{','.join(extras)}]'"
    )


def machine() -> dict:
    """CPU model, threads and versions, for the JSON record."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "memconv": __version__,
        "python": platform.python_version(),
    }


class JsonRecord:
    """A JSON document rewritten whole after every change, so that an interrupted run
    leaves every row measured so far (``"complete": false`` until :meth:`finish`).

    Args:
        path: the file, or ``None`` to record nothing.
        document: the initial document (a dict; it is kept and mutated by callers).
    """

    def __init__(self, path: str | None, document: dict):
        self.path = path
        self.document = {**document, "complete": False}
        self.write()

    def write(self) -> None:
        """Write the document now (atomically: a temporary file, then a rename)."""
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.document, f, indent=2)
        os.replace(tmp, self.path)

    def finish(self, **items) -> None:
        """Add ``items``, mark the document complete and write it."""
        self.document.update(items)
        self.document["complete"] = True
        self.write()
        if self.path:
            logger.info("wrote %s", self.path)


def plot(cases: list[dict], path: str, describe) -> None:
    """Peak memory against time per engine, log–log, one panel per case.

    Args:
        cases: ``[{"case": config, "rows": rows}]``.
        path: the image file to write.
        describe: ``describe(config) -> str``, the panel titles.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(cases))
    rows_n = -(-len(cases) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 5.5 * rows_n), squeeze=False)
    for ax in axes.flat[len(cases) :]:
        ax.set_visible(False)
    for ax, case in zip(axes.flat, cases):
        rows = [r for r in case["rows"] if "peak_rss_mib" in r]
        for r in rows:
            color = "tab:red" if r["engine"].startswith("memconv") else "tab:blue"
            ax.scatter(r["time_s"], max(r["peak_rss_mib"], 1), color=color)
            ax.annotate(r["engine"], (r["time_s"], max(r["peak_rss_mib"], 1)), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("peak RSS increase (MiB)")
        ax.set_title(describe(case["case"]), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)
