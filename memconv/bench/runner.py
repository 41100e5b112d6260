"""The one fresh-process runner of ``memconv compare``, ``memconv bench`` and the examples.

:func:`run_in_subprocess` starts ``python -m memconv.bench.worker`` for one
measurement; :func:`measure_engines` runs a list of engines on one case that way,
the reference first, and cross-validates each result against the reference's as it
arrives, handing every row to a callback at once (so that a run stopped midway keeps
its rows). :class:`JsonLines` writes records one line each, flushed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .engines import FLOOR, REFERENCE, available, get_engine

logger = logging.getLogger("memconv")

#: Seconds one measurement may take before it is reported as failed.
DEFAULT_TIMEOUT = 1800


_probes = itertools.count()
#: Where a container's memory limit is set (cgroup v1's memory controller, or v2).
CGROUP_V1 = "/sys/fs/cgroup/memory"
CGROUP_V2 = "/sys/fs/cgroup"


class memory_cgroup:
    """A memory cgroup of ``limit_mib`` for one process, as a container's limit (Linux;
    needs write access to the cgroup hierarchy, e.g. root): v1's
    ``memory.limit_in_bytes`` (swap off for it), or v2's ``memory.max``.

    Raises:
        RuntimeError: where no cgroup can be made (naming why).
    """

    def __init__(self, limit_mib: float):
        self.limit = int(limit_mib * 2**20)
        name = f"memconv-probe-{os.getpid()}-{next(_probes)}-{time.monotonic_ns()}"
        if os.path.isdir(CGROUP_V1) and os.path.exists(f"{CGROUP_V1}/cgroup.procs"):
            self.path, files = os.path.join(CGROUP_V1, name), ("memory.limit_in_bytes",)
        elif os.path.exists(f"{CGROUP_V2}/cgroup.controllers"):
            self.path, files = os.path.join(CGROUP_V2, name), ("memory.max",)
        else:
            raise RuntimeError("no memory cgroup hierarchy under /sys/fs/cgroup")
        self.files = files

    def __enter__(self):
        try:
            os.mkdir(self.path)
            with open(os.path.join(self.path, self.files[0]), "w") as f:
                f.write(str(self.limit))
            swappiness = os.path.join(self.path, "memory.swappiness")
            if os.path.exists(swappiness):
                with open(swappiness, "w") as f:
                    f.write("0")
        except OSError as err:
            raise RuntimeError(f"cannot make a memory cgroup at {self.path}: {err}") from err
        return self

    def join(self) -> None:
        """Put the calling process in the cgroup (a ``preexec_fn``)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def __exit__(self, *exc):
        for _ in range(50):  # killed processes leave the cgroup a moment later
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.05)
        logger.warning("could not remove the memory cgroup %s", self.path)


def run_in_subprocess(
    config: dict, timeout: float = DEFAULT_TIMEOUT, python: str | None = None
) -> dict:
    """Run one measurement (:mod:`memconv.bench.worker`) in a fresh Python process
    (``python``: another interpreter than this one, e.g. a virtual environment with a
    peer library installed; this checkout of memconv is put on its path).

    Returns:
        The worker's figures; ``{"aborted": True, ...}`` if it stopped past its
        ``abort_rss_mib``; or ``{"error": message}`` if it failed or timed out.
    """
    from .worker import ABORTED

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    python = python or config.get("python") or sys.executable
    command = [python, "-m", "memconv.bench.worker", json.dumps(config)]
    # Files, not pipes, and a session of its own: memory_profiler forks a child that
    # inherits the worker's outputs and outlives a worker that stops itself
    # (os._exit), so pipes would stay open until the timeout; the whole session is
    # killed once the worker is done.
    limit = config.get("cgroup_limit_mib")
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        memory_cgroup(limit) if limit else contextlib.nullcontext() as cgroup,
    ):
        join = (lambda: cgroup.join()) if limit else None
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=join,
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        return {"error": f"timed out after {timeout:.0f} s"}
    if limit and proc.returncode == -signal.SIGKILL:  # the cgroup's OOM killer
        return {"aborted": True, "killed": f"killed for memory within {limit:,.0f} MiB"}
    lines = stdout.strip().splitlines()
    if proc.returncode == ABORTED and lines:
        return json.loads(lines[-1])
    if proc.returncode != 0 or not lines:
        tail = stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        message = tail[0]
        return {"error": message if len(message) <= 160 else message[:157] + "..."}
    return json.loads(lines[-1])


def max_rel_deviation(a: dict, b: dict) -> float:
    """Largest ``max|a-b| / max|b|`` over the entries both results hold (a per-sample
    result is summed over the batch where compared with a summed one)."""
    worst = 0.0
    for name in a.keys() & b.keys():
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            x = x.sum(0) if x.dim() == y.dim() + 1 else x
            y = y.sum(0) if y.dim() == x.dim() + 1 else y
        scale = y.abs().max().item() if y.numel() else 0.0
        worst = max(worst, (x - y).abs().max().item() / (scale or 1.0) if x.numel() else 0.0)
    return worst


def execution_order(names: Iterable[str], task: str, reference: str | None = None) -> list[str]:
    """The reference first (later rows are compared with it as they arrive), then the
    floor, then the others in the given order."""
    names = list(dict.fromkeys(names))
    first = [n for n in dict.fromkeys((reference or REFERENCE[task], FLOOR[task])) if n in names]
    return first + [n for n in names if n not in first]


#: Why a measurement did not start (:func:`past`).
OUT_OF_TIME = "not started: the time budget (--time-budget) ran out"


def past(deadline: float | None) -> str | None:
    """:data:`OUT_OF_TIME` once ``time.monotonic()`` has passed ``deadline``, else None."""
    if deadline is not None and time.monotonic() > deadline:
        return OUT_OF_TIME
    return None


def measure_engines(
    base: dict,
    names: Iterable[str],
    *,
    task: str = "grads",
    on_row: Callable[[dict], None] | None = None,
    validate: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    reference: str | None = None,
    deadline: float | None = None,
) -> list[dict]:
    """Measure engines on one case, each in a fresh process.

    Each row is ``{"engine": name, **figures}`` (or ``"skipped"``/``"error"``) and,
    when ``validate`` and the reference ran, ``deviation``: the largest relative
    deviation of its result from the reference's (:data:`REFERENCE`; not given for the
    clipping task's floor, whose result is not clipped).

    Args:
        base: the worker configuration without ``engine`` (case, task, repeats, ...);
            its ``interpreters`` (``{engine: python}``) run an engine in another
            environment (Lightstream's).
        names: engine names (validated before any work).
        task: ``"grads"`` or ``"clip"``.
        on_row: called with each row as soon as it is complete.
        validate: save each result and compare it with the reference's.
        timeout: seconds per measurement.
        reference: the engine the others are compared with (default
            :data:`REFERENCE` of the task).
        deadline: a ``time.monotonic()`` value past which no measurement starts (the
            rows left are skipped, saying so; None: no deadline).

    Returns:
        The rows, in execution order (:func:`execution_order`).

    Raises:
        ValueError: an unknown engine name.
    """
    reference_name = reference or REFERENCE[task]
    names = execution_order(names, task, reference_name)
    engines = {n: get_engine(n, task) for n in names}
    rows, reference_result = [], None
    with tempfile.TemporaryDirectory() as tmp:
        interpreters = base.get("interpreters") or {}
        for i, name in enumerate(names):
            python = interpreters.get(name)
            reason = available(engines[name], python) or past(deadline)
            if reason:
                row = {"engine": name, "skipped": reason}
            elif engines[name].budget and not base.get("memory_budget"):
                row = {"engine": name, "skipped": "no memory budget for this case"}
            else:
                path = os.path.join(tmp, f"{i}.pt") if validate else None
                config = {**base, "task": task, "engine": name, "out": path, "python": python}
                row = {"engine": name, **run_in_subprocess(config, timeout)}
                if path and "error" not in row:
                    result = torch.load(path)
                    os.remove(path)
                    if name == reference_name:
                        reference_result = result
                    if (
                        reference_result is not None
                        and engines[name].compared
                        and not (task == "clip" and not engines[name].per_sample)
                    ):
                        row["deviation"] = max_rel_deviation(result, reference_result)
                    del result
            if engines[name].budget and base.get("memory_budget"):
                row["memory_budget_mib"] = base["memory_budget"] / 2**20
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


class JsonLines:
    """Records written one JSON line each, flushed at once (a run stopped midway keeps
    every record written so far). ``path=None`` writes nothing.

    Args:
        path: the file (overwritten).
        header: the first record (the command and the machine).
    """

    def __init__(self, path: str | None, header: dict):
        self.path = path
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(json.dumps(header) + "\n")

    def write(self, record: dict) -> None:
        """Append one record."""
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def read_records(paths: Iterable[str]) -> list[dict]:
    """Every record of JSON Lines files, each with ``"file"`` (the path it came from).

    Raises:
        ValueError: a file that is not JSON Lines (naming it and the line).
    """
    records = []
    for path in paths:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{i} is not a JSON line: {err}") from err
                records.append({**record, "file": str(path)})
    return records
