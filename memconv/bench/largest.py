"""The largest batch an engine fits within a memory limit, found in fresh processes.

A batch *fits* when the allocator-level peak increase of one call (the PyTorch
profiler's allocation events on the CPU, ``torch.cuda.max_memory_allocated`` on a
GPU) stays within the limit; the peak RSS increase is measured in the same call and
reported beside it. The allocator level is the criterion because it is what a
``memory_budget`` bounds and what a GPU's memory limit sees; the RSS adds what glibc's
heap retains (see :mod:`memconv.bench.measure`), which depends on the ``malloc``
settings, and ``resource.setrlimit(RLIMIT_AS)`` was not used because it limits
virtual address space, which torch reserves far beyond what it touches.

The search: each probe runs one call at batch size N in a fresh process (after a
warm-up on two samples); memory grows about linearly with N, so the next N comes
from the line through the last two measured probes (the first one is assumed to
scale from zero), kept strictly inside the bracket of the largest fitting and the
smallest failing N so that the bracket shrinks; the search stops once the bracket is
within ``rel_tol`` (or one sample), or at ``cap``. A probe whose RSS grows past 1.5 ×
the limit is stopped early (it cannot fit).

``container=True`` (``memconv bench --largest-batch --container``) sets the limit the
way a container does instead: each probe runs in a memory cgroup of the limit (root,
Linux), and a batch fits when its call completes; the kernel kills a probe that passes
the limit. That is what a Docker or Kubernetes memory limit does to a training job,
and what ``memory_budget="available"`` reads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from .runner import run_in_subprocess

logger = logging.getLogger("memconv")

#: Relative width of the final bracket.
REL_TOL = 0.03


def probe_config(base: dict, n: int, limit_mib: float, container: bool = False) -> dict:
    """The worker configuration of one probe at batch size ``n`` (in a memory cgroup of
    ``limit_mib`` when ``container``: then the RSS alone is measured, and the kernel
    stops a probe that passes the limit)."""
    if container:
        return {
            **base,
            "batch": n,
            "alloc": False,
            "repeats": 0,
            "out": None,
            "cgroup_limit_mib": limit_mib,
        }
    return {
        **base,
        "batch": n,
        "combined": True,
        "repeats": 0,
        "out": None,
        "abort_rss_mib": 1.5 * limit_mib,
    }


def _fits(r: dict, limit_mib: float, container: bool) -> bool:
    """A probe fits: in a container, when it completed; else when its allocator-level
    peak stays within the limit."""
    if container:
        return "error" not in r and not r.get("aborted") and r.get("peak_rss_mib") is not None
    return r.get("peak_alloc_mib") is not None and r["peak_alloc_mib"] <= limit_mib


def search(
    probe: Callable[[int], dict],
    limit_mib: float,
    start: int,
    cap: int,
    rel_tol: float = REL_TOL,
    container: bool = False,
) -> dict:
    """Largest N with ``probe(N)["peak_alloc_mib"] <= limit_mib`` (in a container: the
    largest N whose probe completes).

    Args:
        probe: runs one call at batch size N; returns the worker's figures (or
            ``{"aborted": True}``, or ``{"error": ...}``).
        limit_mib: the limit.
        start: the first N tried.
        cap: the largest N tried.
        rel_tol: stop once the smallest failing N is within this fraction of the largest
            fitting one.

    Returns:
        ``largest`` (0 if not even one sample fits), ``smallest_failing`` (None if
        capped), ``capped``, ``probes``, and the figures at ``largest``; or ``error``
        if the first probe failed for a reason other than memory.
    """
    seen: dict[int, dict] = {}
    lo, hi = 0, None

    key = "peak_rss_mib" if container else "peak_alloc_mib"

    def fits(n):
        if n not in seen:
            seen[n] = probe(n)
        return _fits(seen[n], limit_mib, container)

    def estimate(points):
        """N where the line through the last two measured points reaches the limit."""
        if len(points) == 1:
            ((n0, p0),) = points
            return n0 * limit_mib / p0 if p0 > 0 else math.inf
        (n0, p0), (n1, p1) = points[-2:]
        slope = (p1 - p0) / (n1 - n0)
        return n1 + (limit_mib - p1) / slope if slope > 0 else math.inf

    n = max(1, min(start, cap))
    while True:
        ok = fits(n)
        if ok:
            lo = n
        else:
            hi = n if hi is None else min(hi, n)
            failed = seen[n].get("error") and not seen[n].get("aborted")
            if failed and lo == 0:  # not a memory failure? one sample tells
                if n == 1 or not fits(1):
                    break
                lo = 1
        measured = sorted((k, v[key]) for k, v in seen.items() if v.get(key))
        if hi is None:
            if lo >= cap:
                break
            guess = estimate([p for p in measured if p[0] <= lo][-2:] or measured[-1:])
            if guess > lo * (1 + rel_tol):  # aim just below the limit, at most 16 × per probe
                aim = int(guess * 0.99) if math.isfinite(guess) else cap  # flat: jump
                n = min(cap, 16 * lo, max(lo + 1, aim))
            else:  # the limit is near: one probe just above closes the bracket
                n = min(cap, max(lo + 1, math.ceil(lo * (1 + rel_tol / 2))))
            continue
        if hi - lo <= max(1, rel_tol * lo):
            break
        inside = [p for p in measured if lo <= p[0] <= hi]
        guess = estimate(inside[-2:]) if len(inside) >= 2 else (lo + hi) / 2
        if not math.isfinite(guess):
            guess = (lo + hi) / 2
        margin = max(1, (hi - lo) // 8)
        n = int(min(max(round(guess), lo + margin), hi - margin))
        if n in seen:  # the bracket cannot shrink further by interpolation
            n = (lo + hi) // 2
            if n in seen:
                break
    first = seen[min(seen)]
    if lo == 0 and first.get("error") and not first.get("aborted"):
        return {"error": first["error"], "probes": len(seen)}
    at = seen.get(lo, {})
    return {
        "largest": lo,
        "smallest_failing": hi,
        "capped": hi is None,
        "probes": len(seen),
        "peak_alloc_mib": at.get("peak_alloc_mib"),
        "peak_rss_mib": at.get("peak_rss_mib"),
    }


def largest_batch(
    base: dict,
    limit_mib: float,
    *,
    cap: int,
    on_probe: Callable[[dict], None] | None = None,
    timeout: float = 3600,
    container: bool = False,
) -> dict:
    """The largest batch of ``base``'s engine and case within ``limit_mib``.

    Args:
        base: worker configuration (case, task, engine, options; ``batch`` is the
            first probe).
        limit_mib: the memory limit (MiB).
        cap: the largest batch tried.
        on_probe: called with each probe's record as it completes.
        timeout: seconds per probe.
        container: run each probe in a memory cgroup of ``limit_mib`` (as a container's
            limit); a batch fits when its call completes.
    """

    def probe(n):
        r = run_in_subprocess(probe_config(base, n, limit_mib, container), timeout)
        fits = _fits(r, limit_mib, container)
        record = {"batch": n, "fits": fits, **r}
        logger.info(
            "  %s, batch %d: %s",
            base["engine"],
            n,
            r.get("killed", "stopped, over the limit")
            if r.get("aborted")
            else r.get("error")
            or f"allocator {_fmt(r.get('peak_alloc_mib'))} MiB, RSS {_fmt(r['peak_rss_mib'])} "
            f"MiB ({'fits' if fits else 'over'})",
        )
        if on_probe is not None:
            on_probe(record)
        return r

    return search(probe, limit_mib, base["batch"], cap, container=container)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:,.0f}"
