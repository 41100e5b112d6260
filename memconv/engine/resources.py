"""The memory a process can really use, and keeping it within a budget.

:func:`available_memory` reads what a call may still use: on CUDA the device's free
memory (``torch.cuda.mem_get_info``); on the CPU the smaller of the kernel's
``MemAvailable`` and the limit of the process's memory cgroup minus its usage (cgroup
v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/
``memory.usage_in_bytes``: what Docker and Kubernetes set). :func:`default_budget`
keeps headroom off it; it is the budget :func:`memconv.per_sample_grads`,
:func:`memconv.per_sample_norms`, :func:`memconv.clip_and_accumulate` and
:func:`memconv.plan` plan against by default (``memory_budget="available"``).

The budget is a guard against running out of memory, so ``"available"`` is read again
on every planned call, a :class:`memconv.PrivateStep`'s included (a kept plan is kept
only while it fits the new reading). The host's files are kept open and read again
from their start (:class:`KeptFiles`: about 20 µs a reading instead of 100 µs).

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

from .._checks import AVAILABLE

logger = logging.getLogger("memconv")

#: ``memory_budget`` meaning: plan against :func:`default_budget`.
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
    """The text of a small file (``/proc``, ``/sys``), by plain system calls.

    Raises:
        OSError: if it cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


class KeptFiles:
    """Files of the kernel (``/proc``, ``/sys``) kept open, each read again from its
    start by ``pread`` on every read: the kernel makes their text afresh at each read
    from offset 0, so a read gives what opening the file again would, without the
    ``open`` and ``close`` (a budget of ``"available"`` reads three or four such files
    on every planned call). Files are opened on their first read; a process made by
    ``fork`` opens its own (``/proc/self`` names the process that opened it); a file
    that cannot be read is closed and opened again on the next read; a missing file is
    looked for again on every read.
    """

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def read(self, path: str) -> bytes:
        """The file's whole content.

        Raises:
            OSError: if it cannot be opened or read.
        """
        fd = self._fd(path)
        try:
            data = os.pread(fd, 65536, 0)
            if len(data) == 65536:  # longer than any file read here: read it all
                chunks, offset = [data], len(data)
                while chunk := os.pread(fd, 65536, offset):
                    chunks.append(chunk)
                    offset += len(chunk)
                data = b"".join(chunks)
        except OSError:
            self._drop(path, fd)
            raise
        return data

    def _fd(self, path: str) -> int:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's files are not ours
                self._fds, self._pid = {}, os.getpid()
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._fds[path] = fd
            return fd

    def _drop(self, path: str, fd: int) -> None:
        with self._lock:
            if self._fds.get(path) == fd:
                del self._fds[path]
                os.close(fd)

    def close(self) -> None:
        """Close every kept file."""
        with self._lock:
            fds, self._fds = self._fds, {}
            if self._pid == os.getpid():
                for fd in fds.values():
                    os.close(fd)


#: The kept files of the system's own paths (the defaults of :func:`mem_available` and
#: :func:`cgroup_room`).
_kept = KeptFiles()
MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def _read_int(path: str, kept: KeptFiles | None = None) -> int | None:
    try:
        text = (kept.read(path) if kept is not None else _read(path).encode()).strip()
    except OSError:
        return None
    if text == b"max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= NO_LIMIT else value


def mem_available(meminfo: str = MEMINFO) -> int | None:
    """``MemAvailable`` of the kernel (bytes), or None where there is no such file."""
    try:
        text = _kept.read(meminfo) if meminfo == MEMINFO else _read(meminfo).encode()
        start = text.index(b"MemAvailable:") + len(b"MemAvailable:")
        end = text.find(b"\n", start)
        return int(text[start : end if end >= 0 else len(text)].split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None


#: ``{text of the process's cgroup file: [(limit file, usage file)]}``.
_cgroup_files: dict[tuple[bytes, str], list[tuple[str, str]]] = {}


def _memory_files(text: bytes, root: str) -> list[tuple[str, str]]:
    """The (limit, usage) files of the memory cgroups named in a ``/proc/<pid>/cgroup``
    text (v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/
    ``memory.usage_in_bytes``)."""
    files = []
    for line in text.decode().splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":  # cgroup v2
            base = os.path.join(root, path)
            files.append((os.path.join(base, "memory.max"), os.path.join(base, "memory.current")))
        elif "memory" in controllers.split(","):  # cgroup v1
            base = os.path.join(root, "memory", path)
            files.append(
                (
                    os.path.join(base, "memory.limit_in_bytes"),
                    os.path.join(base, "memory.usage_in_bytes"),
                )
            )
    return files


def cgroup_room(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> int | None:
    """Bytes left under the memory limit of the process's cgroup (limit minus usage), or
    None if it has no limit (or no cgroup files can be read).

    The process's cgroup file is read on every call (a process moved to another cgroup
    gets the new one's limit); the files it names are worked out once per content.

    Args:
        proc_cgroup: the process's cgroup membership file.
        root: where the cgroup hierarchies are mounted.
    """
    kept = _kept if (proc_cgroup, root) == (PROC_CGROUP, CGROUP_ROOT) else None
    try:
        text = kept.read(proc_cgroup) if kept is not None else _read(proc_cgroup).encode()
    except OSError:
        return None
    files = _cgroup_files.get((text, root))
    if files is None:
        files = _memory_files(text, root)
        if len(_cgroup_files) > 64:
            _cgroup_files.clear()
        _cgroup_files[(text, root)] = files
    rooms = []
    for limit_file, usage_file in files:
        limit = _read_int(limit_file, kept)
        if limit is not None:
            usage = _read_int(usage_file, kept)
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
    if logger.isEnabledFor(logging.INFO):
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
