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
the same layout for gradients: the gradient a tile's consumers send to halo positions
(owned by earlier tiles) is added there, and the owning tile, later in that order,
adds it to the output gradient of the positions it computes. Every contribution to a
position's gradient comes from its own tile or a later one, so each position's
gradient is complete when its tile runs.

Each slab (node, axis, tile boundary) is a tensor of its own, so that the backward pass
frees what no tile will read again (:meth:`HaloStore.release`): a gradient slab once
the tiles owning its positions ran, a forward slab once the tiles reading it ran. The
gradients alive at once are then about one row of tiles' worth.
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
        gradients: a store of gradients (slabs start at zero, gradients are added), not
            of forward values (slabs start empty, every position written once).
    """

    def __init__(self, plan: TilePlan, *, gradients: bool = False):
        self.plan = plan
        self.gradients = gradients
        self.slabs: dict[tuple[int, int, int], Tensor] = {}
        self._made: dict[tuple[int, int, int], tuple] = {}  # a gradient slab's first sender

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self.slabs.values())

    def _slab(self, v: int, axis: int, k: int, like: Tensor) -> Tensor:
        slab = self.slabs.get((v, axis, k))
        if slab is None:
            node = self.plan.bound.nodes[v]
            shape = list(node.shape)
            shape[node.dim(axis)] = self.plan.axes[axis].depth[v][k]
            # forward values: every position is written before a tile reads it; gradients
            # are summed into the slab
            make = like.new_zeros if self.gradients else like.new_empty
            slab = self.slabs[(v, axis, k)] = make(shape)
        return slab

    def _index(self, v: int, axis: int, k: int, box) -> tuple:
        """Index of the positions ``box`` (absolute; along ``axis`` within tile ``k``'s
        halo) in the slab of node ``v``, ``axis`` and tile ``k``."""
        node = self.plan.bound.nodes[v]
        start = self.plan.axes[axis].halo(v, k)[0]
        index = [slice(None)] * len(node.layout)
        for a, (lo, hi) in enumerate(box):
            off = start if a == axis else 0
            index[node.dim(a)] = slice(lo - off, hi - off)
        return tuple(index)

    def release(self, tile, *, gradients: bool) -> None:
        """Free the slabs no tile after ``tile`` (in reverse raster order) needs.

        Gradients: a slab along axis ``a`` whose positions belong to tiles after this one
        along ``a`` (they ran), or one made under other tile indices along the axes before
        ``a`` (its positions belong to those tiles). Forward values: a slab along the
        first axis read by a later row of tiles (it ran)."""
        axes = self.plan.axes
        for v, a, k in list(self.slabs):
            if gradients:
                lo = axes[a].halo(v, k)[0]
                done = lo >= axes[a].own(v, tile[a])[1]
                if done or (a > 0 and self._made.get((v, a, k)) != tuple(tile[:a])):
                    del self.slabs[(v, a, k)]
            elif a == 0 and k > tile[0]:
                del self.slabs[(v, a, k)]

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
            slab = self._slab(v, axis, k, value)
            # views and one copy (indexed assignment would add an alias and a dispatch)
            slab[self._index(v, axis, k, part)].copy_(value[_relative(self.plan, v, part, box)])

    def read(self, v: int, axis: int, k: int, box) -> Tensor:
        """The kept positions ``box`` of node ``v`` (tile ``k``'s halo along ``axis``)."""
        return self.slabs[(v, axis, k)][self._index(v, axis, k, box)]

    def add(self, v: int, axis: int, k: int, box, grad: Tensor, tile) -> None:
        """Add a gradient, sent by ``tile``, to the positions ``box`` of tile ``k``'s halo
        along ``axis``."""
        key, prefix = (v, axis, k), tuple(tile[:axis])
        if self._made.get(key) != prefix:  # a slab of other tiles along the axes before
            self.slabs.pop(key, None)  # `axis` holds positions those tiles consumed
            self._made[key] = prefix
        self._slab(v, axis, k, grad)[self._index(v, axis, k, box)].add_(grad)  # one add

    def reaches(self, v: int, tile) -> bool:
        """Whether later tiles sent gradients to node ``v``'s box at ``tile``."""
        box = self.plan.own(v, tile)
        return any((v, axis, k) in self.slabs for axis, k, _ in self._overlaps(v, tile, box))

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
            slab = self.slabs.get((v, axis, k))
            if slab is not None:
                grad[_relative(self.plan, v, part, box)].add_(slab[self._index(v, axis, k, part)])


def _relative(plan: TilePlan, v: int, part, box) -> tuple:
    """Index of the absolute positions ``part`` in a tensor holding ``box``."""
    node = plan.bound.nodes[v]
    index = [slice(None)] * len(node.layout)
    for a, ((lo, hi), (start, _)) in enumerate(zip(part, box)):
        index[node.dim(a)] = slice(lo - start, hi - start)
    return tuple(index)


__all__ = ["HaloStore"]
