"""Run measurements in fresh subprocesses and cross-validate their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def run_in_subprocess(config: dict, timeout: float = 1800) -> dict:
    """Run :func:`memconv.bench.worker.run` in a fresh Python process.

    Returns:
        The worker's figures, or ``{"error": message}`` if it failed.
    """
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "memconv.bench.worker", json.dumps(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        message = tail[0]
        return {"error": message if len(message) <= 160 else message[:157] + "..."}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def max_rel_deviation(a: dict, b: dict) -> float:
    """Largest ``max|a-b| / max|b|`` over the parameters both results hold."""
    worst = 0.0
    for name in a.keys() & b.keys():
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            x = x.sum(0) if x.dim() == y.dim() + 1 else x
            y = y.sum(0) if y.dim() == x.dim() + 1 else y
        scale = y.abs().max().item() or 1.0
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def run_engines(base: dict, engines, progress=None) -> list[dict]:
    """Measure every engine on the case ``base``, each in a fresh process.

    Each row gets ``deviation``: the largest relative deviation of its result from
    any other engine's (per-sample results summed where compared with the summed
    floor).

    Args:
        base: case configuration (see :mod:`memconv.bench.cases`).
        engines: engine names.
        progress: optional tqdm-like wrapper for the iteration.
    """
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        iterator = progress(engines) if progress else engines
        for name in iterator:
            path = os.path.join(tmp, f"{len(paths)}.pt")
            row = {"engine": name, **run_in_subprocess({**base, "engine": name, "out": path})}
            if "error" not in row:
                paths[name] = path
            rows.append(row)
        results = {name: torch.load(p) for name, p in paths.items()}
    for row in rows:
        mine = results.get(row["engine"])
        if mine is None:
            continue
        others = [r for n, r in results.items() if n != row["engine"]]
        row["deviation"] = max((max_rel_deviation(mine, o) for o in others), default=0.0)
    return rows
