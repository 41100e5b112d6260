"""Where a tile's computation meets the rest of its pass: the reads and the writes.

A tile reads the image (its crop), the halo earlier tiles kept, and in the backward
pass its part of the output gradient and the gradients later tiles sent back; it
writes the halo later tiles will read. Everything else it computes from those. The
passes (:mod:`memconv.streaming.passes`) make every such access through a
:class:`TileIO`:

- :class:`DirectIO` reads and writes the stores: the eager path;
- :class:`RecordIO` does the same and records each access (which node, which
  positions, what shape) and the tile's structure (each node's crop and padding), so
  that the tile's computation can run again as a graph whose inputs are those reads
  (:mod:`memconv.streaming.compiled`);
- :class:`ReplayIO` serves a recorded tile's reads from given tensors (a graph's
  inputs while it is traced) and returns the pieces it writes as outputs, for the
  caller to store.

Two tiles whose records have the same :meth:`TileRecord.key` (same structure, same
shapes of every read and write, relative to the tile) compute their outputs from
their reads by the same operations: one graph serves both.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from torch import Tensor

#: Read kinds: the image's crop, a forward halo slab, the output gradient's crop, the
#: gradients later tiles sent to a node's box.
IMAGE, HALO, GRAD, SENT = "image", "halo", "grad", "sent"


def crop(x: Tensor, box, dims: list[int] | None = None) -> Tensor:
    """View of the positions ``box`` (``(lo, hi)`` per spatial axis) of ``x``, whose
    spatial axes are ``dims`` (default: ``2, 3, ...``); ``x`` itself when the box is
    all of it (no view: its gradient needs no zero-padded copy)."""
    dims = dims or list(range(2, 2 + len(box)))
    if all(lo == 0 and hi == x.shape[d] for d, (lo, hi) in zip(dims, box)):
        return x
    index = [slice(None)] * x.dim()
    for d, (lo, hi) in zip(dims, box):
        index[d] = slice(lo, hi)
    return x[tuple(index)]


@dataclass(frozen=True)
class Read:
    """One access a tile made to what lies outside it.

    Attributes:
        slot: the kind and the node (and axis) it read: reads of one slot are served
            in the order they were made.
        where: the absolute positions (``(lo, hi)`` per axis), or for :data:`SENT`
            the ``(slab key, positions, index)`` parts, to read them again.
        shapes: the shape, strides, dtype and device of each tensor read.
    """

    slot: tuple
    where: tuple
    shapes: tuple


@dataclass
class TileRecord:
    """What one tile read and wrote, and its structure (see the module docstring).

    Attributes:
        structure: each node's crop, padding and box size (relative to the tile),
            and the pass's choices for the tile.
        reads: the accesses, in order.
        writes: ``(node, parts)`` per halo write: the parts of
            :meth:`memconv.streaming.halo.HaloStore.parts`.
        meta: what the pass keeps of the tile besides tensors (absolute positions).
    """

    structure: list = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    writes: list[tuple[int, list]] = field(default_factory=list)
    meta: object = None

    def key(self) -> tuple:
        """What the tile's graph depends on: equal for tiles computed alike."""
        return (
            tuple(self.structure),
            tuple((r.slot, r.shapes) for r in self.reads),
            tuple((v, tuple(_plain(i) for _, _, i in parts)) for v, parts in self.writes),
        )

    def signature(self) -> tuple:
        """The shape, strides, dtype and device of every tensor read, in order."""
        return tuple(shape for read in self.reads for shape in read.shapes)

    def matches(self, tensors: list[Tensor]) -> bool:
        """Whether ``tensors`` (a :meth:`gather`) are laid out as the recorded reads
        (an output gradient of other strides is not)."""
        return shapes(tensors) == self.signature()

    def gather(self, runner, grad: Tensor | None = None) -> list[Tensor]:
        """The tensors this tile reads now, in the order of :attr:`reads` (views of the
        stores, the image and the output gradient)."""
        out: list[Tensor] = []
        for read in self.reads:
            kind = read.slot[0]
            if kind == IMAGE:
                out.append(DIRECT.image(runner, read.where))
            elif kind == HALO:
                _, u, axis, view = read.slot
                tile, part = read.where
                out.append(DIRECT.halo(runner, u, axis, tile, part, view))
            elif kind == GRAD:
                out.append(DIRECT.grad(runner, grad, read.where))
            else:
                out.extend(runner.grads.pieces(read.where))
        return out

    def put(self, runner, pieces: list[Tensor]) -> None:
        """Store the pieces a graph returned for :attr:`writes`, in their order."""
        at = 0
        for _, parts in self.writes:
            runner.halo.put(parts, pieces[at : at + len(parts)])
            at += len(parts)


def _plain(index: tuple) -> tuple:
    """An index of slices as a hashable tuple (slices hash from Python 3.12 on)."""
    return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)


def shapes(tensors) -> tuple:
    """Shape, strides, dtype and device of each tensor: what compiled code is
    specialised to."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


class DirectIO:
    """Reads and writes the stores (the eager path)."""

    def structure(self, *item) -> None:
        """Note part of the tile's structure (ignored here)."""

    def image(self, runner, box) -> Tensor:
        """The image's positions ``box`` on the tiles' device."""
        return runner.to_tile(crop(runner.x, box))

    def halo(self, runner, u: int, axis: int, tile, part, view: bool) -> Tensor:
        """Node ``u``'s kept positions ``part`` that ``tile`` reads along ``axis``."""
        return runner.halo.read(u, axis, tile, part, view=view)

    def write(self, runner, v: int, tile, y: Tensor) -> None:
        """Keep node ``v``'s positions of ``y`` that later tiles read."""
        runner.halo.write(v, tile, y)

    def grad(self, runner, grad: Tensor, box) -> Tensor:
        """The output gradient's positions ``box`` on the tiles' device."""
        return runner.to_tile(crop(grad, box))

    def sent(self, runner, v: int, tile) -> list[tuple[tuple, Tensor]]:
        """``(index in the box, gradient)`` later tiles sent to node ``v``'s box."""
        return runner.grads.sent(v, tile)


DIRECT = DirectIO()


class RecordIO(DirectIO):
    """Reads and writes the stores, and records every access (:class:`TileRecord`)."""

    def __init__(self):
        self.record = TileRecord()

    def structure(self, *item) -> None:
        self.record.structure.append(item)

    def _read(self, slot: tuple, where, tensors: list[Tensor]) -> None:
        self.record.reads.append(Read(slot, where, shapes(tensors)))

    def image(self, runner, box) -> Tensor:
        t = super().image(runner, box)
        self._read((IMAGE,), tuple(box), [t])
        return t

    def halo(self, runner, u, axis, tile, part, view):
        t = super().halo(runner, u, axis, tile, part, view)
        self._read((HALO, u, axis, view), (tuple(tile), tuple(part)), [t])
        return t

    def write(self, runner, v, tile, y):
        parts = runner.halo.parts(v, tile)
        self.record.writes.append((v, parts))
        runner.halo.put(parts, [y[index] for _, _, index in parts])

    def grad(self, runner, grad, box):
        t = super().grad(runner, grad, box)
        self._read((GRAD,), tuple(box), [t])
        return t

    def sent(self, runner, v, tile):
        store = runner.grads
        parts = [p for p in store.parts(v, tile) if p[0] in store.slabs]
        pieces = store.pieces(parts)
        slot = (SENT, v, tuple(_plain(index) for _, _, index in parts))
        self._read(slot, tuple(parts), pieces)
        return [(index, t) for (_, _, index), t in zip(parts, pieces)]


class ReplayIO(DirectIO):
    """Serves a recorded tile's reads from ``tensors`` (in the record's order) and
    collects the pieces it writes (:attr:`pieces`, in the record's order of writes)."""

    def __init__(self, record: TileRecord, tensors):
        self.queues: dict[tuple, deque] = defaultdict(deque)
        it = iter(tensors)
        for read in record.reads:
            self.queues[read.slot].append([next(it) for _ in read.shapes])
        self.writes = {}
        for v, parts in record.writes:
            self.writes.setdefault(v, deque()).append([index for _, _, index in parts])
        self.pieces: list[Tensor] = []

    def _next(self, slot: tuple) -> list[Tensor]:
        queue = self.queues.get(slot)
        if not queue:
            raise RuntimeError(f"a replayed tile made a read its record lacks: {slot}")
        return queue.popleft()

    def image(self, runner, box):
        return self._next((IMAGE,))[0]

    def halo(self, runner, u, axis, tile, part, view):
        t = self._next((HALO, u, axis, view))[0]
        return t.detach() if view else t  # a leaf of the tile's graph, as the view is

    def write(self, runner, v, tile, y):
        self.pieces.extend(y[index] for index in self.writes[v].popleft())

    def grad(self, runner, grad, box):
        return self._next((GRAD,))[0]

    def sent(self, runner, v, tile):
        for slot in self.queues:
            if slot[0] == SENT and slot[1] == v and self.queues[slot]:
                indices = [tuple(slice(*i) for i in index) for index in slot[2]]
                return list(zip(indices, self._next(slot)))
        raise RuntimeError(f"a replayed tile read gradients sent to node {v} its record lacks")


__all__ = [
    "DIRECT",
    "DirectIO",
    "Read",
    "RecordIO",
    "ReplayIO",
    "TileRecord",
    "crop",
]
