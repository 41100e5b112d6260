"""One measurement in a fresh process: ``python -m memconv.bench.worker '<json config>'``.

Prints one JSON line with the figures. Two kinds of configuration:

- an engine on a case (see :func:`run`): the engine's result is saved with
  ``torch.save`` to ``config["out"]`` when given, for the parent to cross-validate;
- ``{"call": "module:function" or "path/to/file.py:function", "args": {...}}``: any
  function returning a JSON-serialisable dict (the examples' own measurements).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import threading
import time

import torch

import memconv

from .cases import build_case
from .engines import get_engine
from .measure import MiB, median_time, peak_allocated, peak_both, peak_rss_increase
from .options import strict_float32

#: Exit status of a worker stopped because its RSS went past ``abort_rss_mib``.
ABORTED = 3


def _watchdog(limit_mib: float) -> None:
    """Stop the process (status :data:`ABORTED`) once its RSS grows past ``limit_mib``
    over the current RSS: a probe already past the memory limit need not finish."""
    import psutil

    proc = psutil.Process()
    start = proc.memory_info().rss

    def watch():
        while True:
            grown = (proc.memory_info().rss - start) / MiB
            if grown > limit_mib:
                print(json.dumps({"aborted": True, "rss_at_abort_mib": grown}), flush=True)
                os._exit(ABORTED)
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()


def _cpu_time() -> float:
    """CPU seconds this process has used (user and system): on a shared machine, less
    dependent on the other processes than the wall time."""
    usage = os.times()
    return usage.user + usage.system


def engine_options(engine, config: dict) -> dict:
    """``run`` keyword arguments of an engine under ``config``.

    Raises:
        ValueError: a budget engine without ``memory_budget``.
    """
    options = {}
    if engine.task != "grads":
        options["max_norm"] = float(config.get("max_norm", 1.0))
    if engine.budget:
        if not config.get("memory_budget"):
            raise ValueError(f"engine {engine.name!r} needs a memory budget for this case")
        options["memory_budget"] = int(config["memory_budget"])
    return options


def run(config: dict) -> dict:
    """Measure one engine on one case.

    Keys read, besides the case's (:func:`memconv.bench.cases.build_case`): ``engine``,
    ``task`` (``"grads"``/``"clip"``), ``device``, ``repeats`` (timed calls; 0: no
    timing), ``alloc`` (measure the allocator level; default True), ``combined``
    (RSS and allocator in one call, for probes), ``once`` (one call: RSS, allocator
    and its time, for the huge images), ``warm_side`` (the warm-up's image side),
    ``abort_rss_mib`` (stop past this RSS increase), ``max_norm``, ``memory_budget``
    (bytes), ``out``.

    Returns:
        ``peak_rss_mib``, ``peak_alloc_mib`` (None when not measured), ``time_s`` (None
        when not timed), ``result_mib``, ``params`` (the model's parameter count), and for budget engines ``plan`` (the
        micro-batches :func:`memconv.plan` chose and its predicted peak).
    """
    torch.manual_seed(config.get("seed", 0))
    device = torch.device(config.get("device", "cpu"))
    strict_float32(device)  # TF32 off on CUDA: float32 results comparable at 1e-3
    engine = get_engine(config["engine"], config.get("task", "grads"))
    model, x, y = build_case(config, device)
    options = engine_options(engine, config)
    figures: dict = {}
    if engine.budget:
        chosen = memconv.plan(
            model,
            x,
            task="grads" if engine.task == "grads" else "clip",
            memory_budget=options["memory_budget"],
        )
        figures["plan"] = {
            "micro_batch": chosen.micro_batch,
            "micro_batches": chosen.micro_batches,
            "predicted_peak_mib": chosen.predicted_peak / MiB,
            "clip_route": chosen.clip_route,
        }

    def call(xb=x, yb=y):
        return engine.run(model, xb, yb, **options)

    # warm-up on two samples (on huge images, a crop of ``warm_side`` pixels): thread
    # pools and kernels are initialised before measuring
    side = config.get("warm_side")
    if side and x.dim() > 2 and max(x.shape[2:]) > side:
        index = (slice(0, 2), slice(None)) + (slice(0, side),) * (x.dim() - 2)
        call(x[index].contiguous(), y[:2])
    else:
        call(x[:2], y[:2])
    if config.get("abort_rss_mib"):
        _watchdog(float(config["abort_rss_mib"]))
    alloc = once = cpu = None
    if config.get("once"):  # one call: both peaks and its time (with the profiler's cost)
        start, start_cpu = time.perf_counter(), _cpu_time()
        rss, alloc, result = peak_both(call, device)
        once, cpu = time.perf_counter() - start, _cpu_time() - start_cpu
    elif config.get("combined"):
        rss, alloc, result = peak_both(call, device)
    else:
        rss, result = peak_rss_increase(call)
    result_bytes = sum(t.numel() * t.element_size() for t in result.values())
    if config.get("out"):
        torch.save({k: v.detach().cpu() for k, v in result.items()}, config["out"])
    del result
    if config.get("alloc", True) and not (config.get("combined") or config.get("once")):
        alloc, _ = peak_allocated(call, device)
    repeats = config.get("repeats", 3)
    # the calls above warmed the engine up at full size
    t = median_time(call, repeats, device, warm_up=False) if repeats and once is None else once
    streamed = getattr(model, "_memconv_bench_stream", None)
    if streamed is not None and streamed[0].last_plan is not None:  # the tile used
        plan = streamed[0].last_plan
        figures["stream"] = {"tile": plan.tile[0], "tiles": plan.count}
    return {
        "peak_rss_mib": rss,
        "peak_alloc_mib": alloc,
        "time_s": t,
        "result_mib": result_bytes / MiB,
        "params": sum(p.numel() for p in model.parameters()),
        **({"cpu_s": cpu} if cpu is not None else {}),
        **figures,
        # the machine's load (1-minute average) when the measurement ended: other
        # processes on a shared machine slow the timings down
        "load": os.getloadavg()[0],
    }


def _call(config: dict) -> dict:
    """Run ``config["call"]`` (``"module:function"`` or ``"file.py:function"``)."""
    target, _, function = config["call"].rpartition(":")
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location("memconv_bench_job", target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, function)(**config.get("args", {}))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    config = json.loads(argv[0])
    strict_float32(config.get("device", "cpu"))
    figures = _call(config) if "call" in config else run(config)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
