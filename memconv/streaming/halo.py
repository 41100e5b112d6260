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

Each slab (node, axis, tile boundary, and the row of tiles along the axes before) is a
tensor of its own, so that the backward pass frees what no tile will read again
(:meth:`HaloStore.release`): a gradient slab once the tiles owning its positions ran, a
forward slab once the tiles reading it ran. The gradients alive at once are then about
one row of tiles' worth.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._torch import add_each, copy_each
from .tiling import TilePlan


class HaloStore:
    """Halo slabs of every node and axis: forward values, or gradients (see the module
    docstring). Slabs are allocated on first use, with the dtype and device of what is
    written.

    A slab along axis ``a`` spans, along the axes before ``a``, the positions the tiles
    of one index along them own (one row of tiles, in two dimensions), and along the
    axes after ``a`` the whole extent: exactly what the tiles of that row read of it, so
    that reading, writing and adding along the axes before ``a`` takes the whole slab,
    without a slice.

    Args:
        plan: the tiles.
        gradients: a store of gradients (slabs start at zero, gradients are added), not
            of forward values (slabs start empty, every position written once).
    """

    def __init__(self, plan: TilePlan, *, gradients: bool = False):
        self.plan = plan
        self.gradients = gradients
        #: ``{(node, axis, k, tile indices along the axes before): slab}``
        self.slabs: dict[tuple[int, int, int, tuple], Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in self.slabs.values())

    def _slab(self, key: tuple, like: Tensor) -> Tensor:
        slab = self.slabs.get(key)
        if slab is None:
            v, axis, k, prefix = key
            node = self.plan.bound.nodes[v]
            shape = list(node.shape)
            shape[node.dim(axis)] = self.plan.axes[axis].depth[v][k]
            for a, i in enumerate(prefix):
                lo, hi = self.plan.axes[a].own(v, i)
                shape[node.dim(a)] = hi - lo
            # forward values: every position is written before a tile reads it; gradients
            # are summed into the slab
            make = like.new_zeros if self.gradients else like.new_empty
            slab = self.slabs[key] = make(shape)
        return slab

    def _at(self, key: tuple, box, like: Tensor | None = None) -> Tensor:
        """The positions ``box`` of the slab ``key`` (made like ``like`` if it is not yet):
        the slab itself when they are all of it, else a view."""
        slab = self.slabs[key] if like is None else self._slab(key, like)
        index = self._index(key, box)
        return slab if _whole(slab, index) else slab[index]

    def _index(self, key: tuple, box) -> tuple:
        """Index of the positions ``box`` (absolute; along the key's axis within tile
        ``k``'s halo, along the axes before within the prefix's tiles' own positions) in
        the slab ``key``."""
        v, axis, k, prefix = key
        node = self.plan.bound.nodes[v]
        index = [slice(None)] * len(node.layout)
        for a, (lo, hi) in enumerate(box):
            if a < axis:
                off = self.plan.axes[a].own(v, prefix[a])[0]
            else:
                off = self.plan.axes[axis].halo(v, k)[0] if a == axis else 0
            index[node.dim(a)] = slice(lo - off, hi - off)
        return tuple(index)

    def release(self, tile) -> None:
        """Free the slabs no tile after ``tile`` (in reverse raster order) needs.

        Gradients: a slab along axis ``a`` whose positions belong to tiles after this one
        along ``a`` (they ran), or one of other tile indices along the axes before ``a``
        (their tiles ran). Forward values: a slab read by tiles after this one (they
        ran)."""
        axes = self.plan.axes
        for key in list(self.slabs):
            v, a, k, prefix = key
            if self.gradients:
                done = axes[a].halo(v, k)[0] >= axes[a].own(v, tile[a])[1]
                if done or prefix != tuple(tile[:a]):
                    del self.slabs[key]
            elif tuple(tile[: a + 1]) < (*prefix, k):
                del self.slabs[key]

    def _overlaps(self, v: int, tile, box):
        """``(slab key, box ∩ halo)`` for every later tile ``k`` along each axis whose
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
                    yield (v, axis, k, tuple(tile[:axis])), tuple(part)

    def write(self, v: int, tile, value: Tensor) -> None:
        """Keep the positions of ``value`` (node ``v``'s box at ``tile``) that later
        tiles read."""
        parts = self.parts(v, tile)
        self.put(parts, [value[index] for _, _, index in parts])

    def parts(self, v: int, tile) -> list[tuple[tuple, tuple, tuple]]:
        """``(slab key, positions, index in the box)`` of every slab that keeps (or
        gathers the gradient of) positions of node ``v``'s box at ``tile``: what
        :meth:`write` copies, and where :meth:`seed_into` reads, split so that a
        compiled tile computes the pieces and the caller stores them."""
        box = self.plan.own(v, tile)
        return [
            (key, part, _relative(self.plan, v, part, box))
            for key, part in self._overlaps(v, tile, box)
        ]

    def put(self, parts: list, pieces: list[Tensor]) -> None:
        """Copy ``pieces`` (one per entry of :meth:`parts`) into their slabs, by one
        operation for all the slabs (distinct tensors; views, as indexed assignment
        would add an alias and a dispatch per piece)."""
        targets = [self._at(key, part, piece) for (key, part, _), piece in zip(parts, pieces)]
        copy_each(targets, pieces)

    def read(self, v: int, axis: int, tile, box, *, view: bool = False) -> Tensor:
        """The kept positions ``box`` of node ``v`` that ``tile`` reads before its own
        along ``axis`` (its halo there); with ``view``, always a view of the slab (a
        tensor of its own, to take a gradient as a leaf)."""
        key = (v, axis, tile[axis], tuple(tile[:axis]))
        return self.slabs[key][self._index(key, box)] if view else self._at(key, box)

    def add(self, sent: list, tile) -> None:
        """Add the gradients ``tile`` sent to the halo of earlier tiles, ``sent``:
        ``(node, axis, box, gradient)``, each to the positions ``box`` of the tile's halo
        of the node along ``axis``, by one operation for all the slabs (one more for each
        further gradient sent to one slab, as two may overlap)."""
        rounds: list[tuple[dict, list]] = []  # per round: {slab key: target}, gradients
        for v, axis, box, grad in sent:
            key = (v, axis, tile[axis], tuple(tile[:axis]))
            target = self._at(key, box, grad)
            free = next((r for r in rounds if key not in r[0]), None)
            if free is None:
                free = ({}, [])
                rounds.append(free)
            free[0][key] = target
            free[1].append(grad)
        for targets, grads in rounds:
            add_each(list(targets.values()), grads)

    def reaches(self, v: int, tile) -> bool:
        """Whether later tiles sent gradients to node ``v``'s box at ``tile``."""
        box = self.plan.own(v, tile)
        return any(key in self.slabs for key, _ in self._overlaps(v, tile, box))

    def seed(self, v: int, tile, like: Tensor) -> Tensor:
        """The gradient later tiles sent to node ``v``'s box at ``tile``, as a tensor
        like the box's."""
        out = torch.zeros_like(like)
        self.seed_into(v, tile, out)
        return out

    def seed_into(self, v: int, tile, grad: Tensor) -> None:
        """Add the gradient later tiles sent to node ``v``'s box at ``tile`` to ``grad``
        (a gradient of the box), on the slabs they cover."""
        for index, piece in self.sent(v, tile):
            grad[index].add_(piece)

    def pieces(self, parts) -> list[Tensor]:
        """The positions of each of ``parts`` (``(slab key, positions, index)``, as
        :meth:`parts` gives them, of slabs kept), views of their slabs."""
        return [self._at(key, part) for key, part, _ in parts]

    def sent(self, v: int, tile) -> list[tuple[tuple, Tensor]]:
        """``(index in the box, gradient)`` of what later tiles sent to node ``v``'s
        box at ``tile``, on the slabs they cover."""
        return [
            (index, self._at(key, part))
            for key, part, index in self.parts(v, tile)
            if key in self.slabs
        ]


def _whole(t: Tensor, index: tuple) -> bool:
    """Whether the slices ``index`` take all of ``t``."""
    return all(
        (i.start or 0) == 0 and (i.stop is None or i.stop >= n) for i, n in zip(index, t.shape)
    )


def _relative(plan: TilePlan, v: int, part, box) -> tuple:
    """Index of the absolute positions ``part`` in a tensor holding ``box``."""
    node = plan.bound.nodes[v]
    index = [slice(None)] * len(node.layout)
    for a, ((lo, hi), (start, _)) in enumerate(zip(part, box)):
        index[node.dim(a)] = slice(lo - start, hi - start)
    return tuple(index)


__all__ = ["HaloStore"]
