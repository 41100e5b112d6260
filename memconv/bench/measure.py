"""Peak memory and run time of one callable, measured the same way for every engine.

- process level: peak resident set size (RSS) increase sampled by
  ``memory_profiler.memory_usage`` (as BackPACK's "Saving memory in convolutions"
  example does), in MiB;
- allocator level: on CUDA ``torch.cuda.max_memory_allocated``; on the CPU the
  PyTorch profiler's allocation events (every allocation and free of the c10 CPU
  allocator, kernels' own temporaries included), replayed in time order; in MiB;
- time: median of repeated calls after a warm-up, in seconds.

With glibc's default ``malloc``, freed heap memory is not always given back to the
system at once, so the RSS figure can exceed the allocator-level one by what the
heap retains (``MALLOC_MMAP_THRESHOLD_=1048576`` makes large blocks bypass the heap
and the two figures match); the benchmarks report the default-``malloc`` figures.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time

import torch

MiB = 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_increase(fn, interval: float = 0.002) -> tuple[float, object]:
    """Peak RSS increase (MiB) while ``fn()`` runs, and its return value.

    Raises:
        ImportError: if ``memory_profiler`` is not installed.
    """
    from memory_profiler import memory_usage

    gc.collect()
    baseline = memory_usage(-1, interval=interval, timeout=interval * 5, max_usage=True)
    peak, value = memory_usage((fn, (), {}), interval=interval, max_usage=True, retval=True)
    return float(peak) - float(baseline), value


@contextlib.contextmanager
def _quiet_stderr():
    """Send the process's file descriptor 2 to /dev/null for the block (C++ prints that
    Python's ``sys.stderr`` does not see)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_allocated(fn, device: torch.device) -> tuple[float, object]:
    """Allocator-level peak increase (MiB) while ``fn()`` runs, and its return value."""
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        value = fn()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - start) / MiB, value
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's C++ side prints a "USDT" line at start and stop
        prof.__enter__()
    try:
        value = fn()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak / MiB, value


def peak_both(fn, device: torch.device, interval: float = 0.002) -> tuple[float, float, object]:
    """Peak RSS increase and allocator-level peak (MiB) of one call of ``fn()``, and its
    return value: the allocator is followed during the same call the RSS is sampled
    in (the profiler's event records add a little to the RSS figure).

    Raises:
        ImportError: if ``memory_profiler`` is not installed.
    """
    box = {}

    def inner():
        box["alloc"], value = peak_allocated(fn, device)
        return value

    rss, value = peak_rss_increase(inner, interval)
    return rss, box["alloc"], value


def median_time(fn, repeats: int, device: torch.device, warm_up: bool = True) -> float:
    """Median wall time (s) of ``repeats`` calls of ``fn()`` (after one warm-up call
    unless ``warm_up`` is False: the caller has just run it)."""
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
