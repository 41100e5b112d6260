"""The halo: positions a tile reads that earlier tiles computed, kept once.

For every data node ``u`` and spatial axis ``a``, a :class:`HaloStore` keeps the
positions later tiles read before their own ranges (``AxisPlan.halo``): a slab a few
positions deep (a 3×3 convolution's input: 2 rows, 1 with stride 2) across the whole
extent of the other axes, one per tile boundary. The forward pass writes each node's
positions into the slabs that hold them as it computes them; a tile reads its halo
from them instead of recomputing it. So every position of every node is computed once
per pass, and the memory kept is a thin fraction of the activations (the depth over
the tile's extent, per axis).

The backward pass runs the tiles in reverse raster order and keeps a second store of
the same shape for gradients: the gradient a tile's consumers send to halo positions
(owned by earlier tiles) is added there, and the owning tile, later in that order,
adds it to the output gradient of the positions it computes. Every contribution to a
position's gradient comes from its own tile or a later one, so each position's
gradient is complete when its tile runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .tiling import TilePlan


class HaloStore:
    """Halo slabs of every node and axis: forward values, or gradients (see the module
    docstring). Slabs are allocated on first use, with the dtype and device of what is
    written.

    Args:
        plan: the tiles.
    """

    def __init__(self, plan: TilePlan):
        self.plan = plan
        self.slabs: dict[tuple[int, int], Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self.slabs.values())

    def _slab(self, v: int, axis: int, like: Tensor) -> Tensor:
        slab = self.slabs.get((v, axis))
        if slab is None:
            node = self.plan.bound.nodes[v]
            shape = list(node.shape)
            shape[node.dim(axis)] = self.plan.axes[axis].length[v]
            slab = self.slabs[(v, axis)] = like.new_zeros(shape)
        return slab

    def _index(self, v: int, axis: int, k: int, box) -> tuple:
        """Index of the positions ``box`` (absolute; along ``axis`` within tile ``k``'s
        halo) in node ``v``'s slab of ``axis``."""
        node = self.plan.bound.nodes[v]
        plan = self.plan.axes[axis]
        start = plan.halo(v, k)[0]
        index = [slice(None)] * len(node.layout)
        for a, (lo, hi) in enumerate(box):
            if a == axis:
                off = plan.offset[v][k] - start
                index[node.dim(a)] = slice(lo + off, hi + off)
            else:
                index[node.dim(a)] = slice(lo, hi)
        return tuple(index)

    def _overlaps(self, v: int, tile, box):
        """``(axis, k, box ∩ halo)`` for every later tile ``k`` along each axis whose
        halo of ``v`` meets ``box`` (the positions ``tile`` computes)."""
        for axis, plan in enumerate(self.plan.axes):
            if not plan.length[v]:
                continue
            lo, hi = box[axis]
            for k in range(tile[axis] + 1, plan.count):
                h_lo, h_hi = plan.halo(v, k)
                if h_lo >= hi:
                    break
                a, b = max(h_lo, lo), min(h_hi, hi)
                if a < b:
                    part = list(box)
                    part[axis] = (a, b)
                    yield axis, k, tuple(part)

    def write(self, v: int, tile, value: Tensor) -> None:
        """Keep the positions of ``value`` (node ``v``'s box at ``tile``) that later
        tiles read."""
        box = self.plan.own(v, tile)
        for axis, k, part in self._overlaps(v, tile, box):
            slab = self._slab(v, axis, value)
            slab[self._index(v, axis, k, part)] = value[_relative(self.plan, v, part, box)]

    def read(self, v: int, axis: int, k: int, box) -> Tensor:
        """The kept positions ``box`` of node ``v`` (tile ``k``'s halo along ``axis``)."""
        return self.slabs[(v, axis)][self._index(v, axis, k, box)]

    def add(self, v: int, axis: int, k: int, box, grad: Tensor) -> None:
        """Add a gradient to the positions ``box`` of tile ``k``'s halo along ``axis``."""
        self._slab(v, axis, grad)[self._index(v, axis, k, box)] += grad

    def reaches(self, v: int, tile) -> bool:
        """Whether later tiles sent gradients to node ``v``'s box at ``tile``."""
        box = self.plan.own(v, tile)
        return any((v, axis) in self.slabs for axis, _, _ in self._overlaps(v, tile, box))

    def seed(self, v: int, tile, like: Tensor) -> Tensor:
        """The gradient later tiles sent to node ``v``'s box at ``tile``, as a tensor
        like the box's."""
        out = torch.zeros_like(like)
        self.seed_into(v, tile, out)
        return out

    def seed_into(self, v: int, tile, grad: Tensor) -> None:
        """Add the gradient later tiles sent to node ``v``'s box at ``tile`` to ``grad``
        (a gradient of the box), on the slabs they cover."""
        box = self.plan.own(v, tile)
        for axis, k, part in self._overlaps(v, tile, box):
            slab = self.slabs.get((v, axis))
            if slab is not None:
                grad[_relative(self.plan, v, part, box)] += slab[self._index(v, axis, k, part)]


def _relative(plan: TilePlan, v: int, part, box) -> tuple:
    """Index of the absolute positions ``part`` in a tensor holding ``box``."""
    node = plan.bound.nodes[v]
    index = [slice(None)] * len(node.layout)
    for a, ((lo, hi), (start, _)) in enumerate(zip(part, box)):
        index[node.dim(a)] = slice(lo - start, hi - start)
    return tuple(index)


__all__ = ["HaloStore"]
