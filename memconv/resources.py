"""The memory a process can really use, and keeping it within a budget.

:func:`available_memory` reads what a call may still use: on CUDA the device's free
memory (``torch.cuda.mem_get_info``); on the CPU the smaller of the kernel's
``MemAvailable`` and the limit of the process's memory cgroup minus its usage (cgroup
v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/
``memory.usage_in_bytes``: what Docker and Kubernetes set). :func:`default_budget`
keeps headroom off it; it is the budget :func:`memconv.per_sample_grads`,
:func:`memconv.per_sample_norms`, :func:`memconv.clip_and_accumulate` and
:func:`memconv.plan` plan against by default (``memory_budget="available"``).

:func:`process_budget` makes a budget hold for the process, not only for torch's
allocator: glibc's ``malloc`` keeps freed heap memory for reuse, so a process's RSS
(what a container limit and the OOM killer see) runs above the allocator's figure.
Inside the block, blocks of 1 MiB and more are served by ``mmap`` and returned to the
system when freed (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``, as
``MALLOC_MMAP_THRESHOLD_=1048576`` does for a whole process), and the heap is trimmed
at the end (``malloc_trim(0)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading

import torch

logger = logging.getLogger("memconv")

#: ``memory_budget`` meaning: plan against :func:`default_budget`.
AVAILABLE = "available"
#: Headroom kept off the available memory: this fraction of it, at least
#: :data:`MIN_HEADROOM` bytes (torch's allocator caches, the interpreter, other threads).
HEADROOM_FRACTION = 0.15
MIN_HEADROOM = 256 * 2**20
#: A cgroup limit at or above this means no limit (v1 reports ~2⁶³ for "unlimited").
NO_LIMIT = 2**60
#: glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Blocks this large or larger go to mmap inside :func:`process_budget`.
MMAP_THRESHOLD = 2**20
#: The threshold left after the block: glibc's ceiling for its own dynamic threshold on
#: 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX), where a long-running process's threshold
#: ends up anyway, so that code after the call keeps glibc's speed.
MMAP_THRESHOLD_AFTER = 32 * 2**20


def _read(path: str) -> str:
    """The text of a small file (``/proc``, ``/sys``), by plain system calls: read on
    every planned call, where Python's buffered text files cost several times more.

    Raises:
        OSError: if it cannot be read.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def _read_int(path: str) -> int | None:
    try:
        text = _read(path).strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= NO_LIMIT else value


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of the kernel (bytes), or None where there is no such file."""
    try:
        for line in _read(meminfo).splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under the memory limit of the process's cgroup (limit minus usage), or
    None if it has no limit (or no cgroup files can be read).

    Args:
        proc_cgroup: the process's cgroup membership file.
        root: where the cgroup hierarchies are mounted.
    """
    try:
        lines = [line.strip().split(":", 2) for line in _read(proc_cgroup).splitlines()]
    except OSError:
        return None
    lines = [x for x in lines if x != [""]]
    rooms = []
    for _, controllers, path in (x for x in lines if len(x) == 3):
        path = path.lstrip("/")
        if controllers == "":  # cgroup v2
            base = os.path.join(root, path)
            limit = _read_int(os.path.join(base, "memory.max"))
            usage = _read_int(os.path.join(base, "memory.current"))
        elif "memory" in controllers.split(","):  # cgroup v1
            base = os.path.join(root, "memory", path)
            limit = _read_int(os.path.join(base, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(base, "memory.usage_in_bytes"))
        else:
            continue
        if limit is not None:
            rooms.append(max(limit - (usage or 0), 0))
    return min(rooms) if rooms else None


def available_memory(device: torch.device | str | None = None) -> int:
    """Bytes a computation on ``device`` may still use (see the module docstring).

    Args:
        device: a CUDA device for its free memory; anything else (None) for the host.

    Returns:
        Bytes (0 if nothing is left; ``MemAvailable`` alone where no cgroup limit
        applies).

    Raises:
        RuntimeError: if the host's available memory cannot be read (no
            ``/proc/meminfo``): give ``memory_budget`` explicitly there.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    values = [v for v in (mem_available(), cgroup_room()) if v is not None]
    if not values:
        raise RuntimeError(
            "memconv cannot read the memory available on this machine (no /proc/meminfo): "
            "give memory_budget in bytes, or None for no budget"
        )
    return int(min(values))


def default_budget(device: torch.device | str | None = None) -> int:
    """The budget a whole call plans against by default: :func:`available_memory` less
    :data:`HEADROOM_FRACTION` of it (at least :data:`MIN_HEADROOM`), in bytes (≥ 1)."""
    free = available_memory(device)
    headroom = max(int(HEADROOM_FRACTION * free), MIN_HEADROOM)
    return max(free - headroom, 1)


def resolve_budget(memory_budget, device) -> int | None:
    """``memory_budget`` as bytes or None: ``"available"`` becomes
    :func:`default_budget` of ``device`` (logged)."""
    if memory_budget != AVAILABLE:
        return memory_budget
    budget = default_budget(device)
    logger.info(
        "memconv: memory_budget='available': planning against %.1f MiB on %s",
        budget / 2**20,
        torch.device(device).type if device is not None else "cpu",
    )
    return budget


#: The default budget guards the process once a plan's predicted peak passes this
#: fraction of it (the RSS runs up to a third above the allocator's figure).
TIGHT = 0.5


def guards(memory_budget, plan) -> bool:
    """Whether :func:`process_budget` guards a call: for an explicit budget always; for
    ``"available"`` when the plan is tight (it splits the batch, or its predicted peak
    passes :data:`TIGHT` of the budget), since the headroom absorbs the heap's slack
    otherwise and the guard costs time.

    Args:
        memory_budget: the argument the caller was given.
        plan: the :class:`memconv.Plan` made for it (None when there is no budget).
    """
    if memory_budget is None or plan is None:
        return False
    if memory_budget != AVAILABLE:
        return True
    return plan.micro_batch < plan.batch or plan.predicted_peak > TIGHT * plan.memory_budget


def _libc():
    if os.name != "posix":
        return None
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def process_budget(device: torch.device | str | None = None):
    """Keep freed host memory from piling up in the heap for the block (glibc only;
    elsewhere, and for CUDA tensors, nothing changes).

    On entry, ``mallopt(M_MMAP_THRESHOLD, 1 MiB)``: blocks of 1 MiB and more are mapped
    and unmapped, so freeing them lowers the RSS; on exit, ``malloc_trim(0)`` returns
    the heap's free pages. glibc has no way to read the threshold back, so on exit it
    is set to 32 MiB, the ceiling glibc's own dynamic threshold grows to (its default
    starts at 128 KiB): code after the call keeps glibc's speed, and the threshold no
    longer adapts. A process that sets ``MALLOC_MMAP_THRESHOLD_`` itself keeps its
    value. The cost inside the block: large allocations are mapped afresh each time
    (about +40 % time on a budgeted clipping call on the CPU, see the benchmarks).
    """
    global _depth
    libc = _libc() if torch.device(device or "cpu").type == "cpu" else None
    if libc is None:
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1 and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
                    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_AFTER)
                libc.malloc_trim(0)
