"""Run one (case, engine) measurement; meant to be started in a fresh process.

``python -m memconv.bench.worker '<json config>'`` prints one JSON line with the
figures and saves the engine's result with ``torch.save`` to ``config["out"]``.
"""

from __future__ import annotations

import json
import sys

import torch

import memconv

from .cases import build_case
from .engines import get_engine
from .measure import median_time, peak_allocated, peak_rss_increase


def run(config: dict) -> dict:
    """Measure one engine on one case (see :func:`memconv.bench.cases.build_case`).

    Returns:
        ``peak_rss_mib``, ``peak_alloc_mib`` (None when ``config["alloc"]`` is false),
        ``time_s``, ``result_mib``.
    """
    torch.manual_seed(config.get("seed", 0))
    device = torch.device(config.get("device", "cpu"))
    engine = get_engine(config["engine"])
    model, x, y = build_case(config, device)
    run_engine = engine.run
    if config.get("memory_budget"):
        settings = memconv.save_memory("auto", memory_budget=int(config["memory_budget"]))

        def run_engine(m, xb, yb):
            with settings:
                return engine.run(m, xb, yb)

    # warm-up on two samples: thread pools and kernels are initialised before measuring
    run_engine(model, x[:2], y[:2])
    rss, result = peak_rss_increase(lambda: run_engine(model, x, y))
    result_bytes = sum(t.numel() * t.element_size() for t in result.values())
    if config.get("out"):
        torch.save({k: v.detach().cpu() for k, v in result.items()}, config["out"])
    del result
    alloc = None
    if config.get("alloc", True):
        alloc, _ = peak_allocated(lambda: run_engine(model, x, y), device)
    t = median_time(lambda: run_engine(model, x, y), config.get("repeats", 3), device)
    return {
        "peak_rss_mib": rss,
        "peak_alloc_mib": alloc,
        "time_s": t,
        "result_mib": result_bytes / 2**20,
    }


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    print(json.dumps(run(json.loads(argv[0]))), flush=True)


if __name__ == "__main__":
    main()
