"""The one runner of every measurement: each engine in a fresh Python process.

``memconv compare``, ``memconv bench`` and the examples all call :func:`run_engines`:
every job runs :func:`memconv.bench.worker.run` in a new interpreter (so that one
engine's memory never shows in another's peak), its per-sample result comes back
through a temporary file, and the results are cross-validated as they arrive.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engines import ENGINES, available

logger = logging.getLogger("memconv")

#: Seconds one job may run before it is reported as failed.
DEFAULT_TIMEOUT = 1800.0


@dataclass(frozen=True)
class Job:
    """One row of a measurement.

    Attributes:
        label: the row's name in tables and JSON (e.g. ``"memconv:auto (budget)"``).
        engine: the engine that runs (a key of :data:`memconv.bench.engines.ENGINES`).
        settings: extra worker settings, e.g. ``{"memory_budget": bytes}``.
    """

    label: str
    engine: str
    settings: dict = field(default_factory=dict)

    @classmethod
    def of(cls, job: str | Job) -> Job:
        """A :class:`Job` from an engine name (label = engine) or a job."""
        return job if isinstance(job, Job) else cls(job, job)


def run_in_subprocess(config: dict, timeout: float | None = DEFAULT_TIMEOUT) -> dict:
    """Run :func:`memconv.bench.worker.run` on ``config`` in a fresh Python process.

    Returns:
        The worker's figures, or ``{"error": message}`` if it failed or timed out.
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "memconv.bench.worker", json.dumps(config)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        logger.debug("worker failed on %s:\n%s", config.get("engine"), proc.stderr)
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        message = tail[0]
        return {"error": message if len(message) <= 160 else message[:157] + "..."}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def max_rel_deviation(a: dict, b: dict) -> float:
    """Largest ``max|a-b| / max|b|`` over the parameters both results hold.

    A per-sample result ``[N, *shape]`` compared with a summed one ``[*shape]`` is
    summed over the samples first.
    """
    worst = 0.0
    for name in a.keys() & b.keys():
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            x = x.sum(0) if x.dim() == y.dim() + 1 else x
            y = y.sum(0) if y.dim() == x.dim() + 1 else y
        scale = y.abs().max().item() or 1.0
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def run_engines(
    base: dict,
    jobs: Iterable[str | Job],
    *,
    then: Callable[[list[dict]], Iterable[str | Job]] | None = None,
    on_start: Callable[[str], None] | None = None,
    on_row: Callable[[dict], None] | None = None,
    results: dict | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> list[dict]:
    """Measure every job on the case ``base``, each in a fresh process, and cross-validate.

    Each row is ``{"engine": label, "peak_rss_mib", "peak_alloc_mib", "time_s",
    "result_mib", "deviation"}`` (see :func:`memconv.bench.worker.run`), or
    ``{"engine": label, "skipped": why}`` for an engine whose optional dependency is
    missing, or ``{"engine": label, "error": message}``. ``deviation`` is the largest
    relative deviation (:func:`max_rel_deviation`) of the row's result from any other
    row's; it is updated in place as later rows arrive.

    Args:
        base: the case (see :func:`memconv.bench.cases.build_case`) and worker settings
            (``device``, ``repeats``, ``seed``, ``alloc``).
        jobs: engine names or :class:`Job` objects, run in order.
        then: called once with the rows of ``jobs``; the jobs it returns run after them
            (e.g. ``"auto"`` with a budget derived from a measured peak).
        on_start: called with each job's label before it runs.
        on_row: called with each row as soon as it is measured (e.g. to write it out).
        results: if given, filled with ``{label: {parameter name: Tensor}}``.
        timeout: seconds one job may run.

    Returns:
        The rows, in the order the jobs ran.
    """
    rows: list[dict] = []
    kept: dict[str, dict] = {}

    def run(pending: Iterable[str | Job]) -> None:
        for job in map(Job.of, pending):
            if on_start is not None:
                on_start(job.label)
            reason = available(ENGINES[job.engine]) if job.engine in ENGINES else None
            if reason:
                row = {"engine": job.label, "skipped": reason}
            else:
                path = os.path.join(tmp, f"{len(rows)}.pt")
                config = {**base, **job.settings, "engine": job.engine, "out": path}
                row = {"engine": job.label, **job.settings, **run_in_subprocess(config, timeout)}
                if "error" not in row:
                    _cross_validate(row, torch.load(path), rows, kept)
                    os.remove(path)
            if "error" in row:
                logger.warning("%s failed: %s", job.label, row["error"])
            rows.append(row)
            if on_row is not None:
                on_row(row)

    with tempfile.TemporaryDirectory(prefix="memconv-") as tmp:
        run(jobs)
        if then is not None:
            run(then(list(rows)))
    if results is not None:
        results.update(kept)
    return rows


def _cross_validate(row: dict, result: dict, rows: list[dict], kept: dict) -> None:
    """Set ``row["deviation"]`` against every earlier result, and raise theirs."""
    by_label = {r["engine"]: r for r in rows}
    row["deviation"] = 0.0
    for label, other in kept.items():
        row["deviation"] = max(row["deviation"], max_rel_deviation(result, other))
        earlier = by_label[label]
        earlier["deviation"] = max(earlier["deviation"], max_rel_deviation(other, result))
    kept[row["engine"]] = result
