"""The tiles of one input size: which positions of every node each tile computes.

Along each spatial axis on its own (every op's ranges are per axis), the *output* is
cut into disjoint tiles ``[e_k, e_{k+1})``; the boundaries are chosen so that each
tile computes about ``tile_size`` new input positions (the first tile also reads the
receptive field's look-ahead).

For a tile ``k`` and a node ``v``, ``hi_v(k)`` is the end of what the tiles up to
``k`` need of ``v``: the output's ``e_{k+1}``, else the largest end any consumer's
input range reaches (a node read by two consumers takes the union, once). Tile ``k``
*owns* ``[hi_v(k-1), hi_v(k))`` of every node: it computes exactly those positions,
each position of each node once per pass (raster order over the axes' tiles; the
product of the owned ranges is a box). A consumer's input range starts a little
before its producer's owned range (a 3×3 convolution reads one row of the tile
above): those positions, the *halo*, belong to earlier tiles, which keep them
(:mod:`memconv.streaming.halo`). ``depth[u][k]`` is how many positions before its
owned range tile ``k`` reads of ``u``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .errors import NotStreamableError
from .graph import Bound
from .ops import Local, Need


@dataclass
class AxisPlan:
    """The tiles along one spatial axis.

    Attributes:
        bounds: output tile boundaries ``e_0 = 0 < ... < e_K``.
        hi: ``hi[v][k]``: end of node ``v``'s positions the tiles up to ``k`` compute.
        needs: ``needs[v][k]``: the :class:`Need` of node ``v``'s owned range at tile
            ``k`` in its inputs (None where it owns nothing).
        depth: ``depth[u][k]``: positions of ``u`` before its owned range that tile
            ``k`` reads.
        offset: ``offset[u][k]``: where tile ``k``'s halo of ``u`` starts in ``u``'s
            halo store along this axis; ``length[u]`` its total.
    """

    bounds: list[int]
    hi: list[list[int]]
    needs: list[list]
    depth: list[list[int]]
    offset: list[list[int]]
    length: list[int]

    @property
    def count(self) -> int:
        """Tiles along the axis."""
        return len(self.bounds) - 1

    def own(self, v: int, k: int) -> tuple[int, int]:
        """The positions of node ``v`` tile ``k`` computes."""
        return (self.hi[v][k - 1] if k else 0), self.hi[v][k]

    def halo(self, u: int, k: int) -> tuple[int, int]:
        """The positions of ``u`` before its owned range that tile ``k`` reads."""
        start = self.own(u, k)[0]
        return start - self.depth[u][k], start


def _ends(bound: Bound, axis: int, end: int) -> list[int]:
    """``hi_v`` of every node for output positions ``[0, end)`` along ``axis``."""
    hi = [0] * len(bound.nodes)
    hi[bound.output] = end
    for v in range(len(bound.nodes) - 1, 0, -1):
        if not hi[v]:
            continue
        node = bound.nodes[v]
        for s in node.slots:
            reach = node.op.need(axis, 0, hi[v], bound.sizes(s)[axis]).hi
            hi[s] = max(hi[s], reach)
    return hi


def output_bounds(bound: Bound, axis: int, tile: int) -> list[int]:
    """Output tile boundaries along ``axis`` such that each tile reads about ``tile``
    new input positions (at least one output position per tile)."""
    total = bound.sizes(bound.output)[axis]
    bounds = [0]
    while bounds[-1] < total:
        target = _ends(bound, axis, bounds[-1])[0] + tile
        lo, hi = bounds[-1] + 1, total
        if _ends(bound, axis, lo)[0] <= target:  # the largest end within the target
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _ends(bound, axis, mid)[0] <= target:
                    lo = mid
                else:
                    hi = mid - 1
        bounds.append(lo)
    return bounds


def axis_plan(bound: Bound, axis: int, bounds: list[int]) -> AxisPlan:
    """The owned ranges, needs and halo depths of every node along ``axis``.

    Raises:
        NotStreamableError: if an op's ranges are not monotone (a modelling error,
            reported rather than streamed wrongly).
    """
    nodes = bound.nodes
    count = len(bounds) - 1
    hi = [[0] * count for _ in nodes]
    for k in range(count):
        for v, h in enumerate(_ends(bound, axis, bounds[k + 1])):
            hi[v][k] = h
    needs = [[None] * count for _ in nodes]
    depth = [[0] * count for _ in nodes]
    for v, node in enumerate(nodes):
        if node.op is None:
            continue
        for k in range(count):
            lo, end = (hi[v][k - 1] if k else 0), hi[v][k]
            if end < lo:
                raise NotStreamableError(
                    f"{node.label}: its ranges are not monotone along axis {axis}"
                )
            if end == lo:
                continue
            size = bound.sizes(node.slots[0])[axis]
            need = node.op.need(axis, lo, end, size)
            needs[v][k] = need
            for s in node.slots:
                start = hi[s][k - 1] if k else 0
                if need.hi > hi[s][k]:
                    raise NotStreamableError(
                        f"{node.label}: reads past what its input computes along axis {axis}"
                    )
                depth[s][k] = max(depth[s][k], start - need.lo)
    offset, length = [], []
    for v in range(len(nodes)):
        offs = list(itertools.accumulate([0, *depth[v]]))
        offset.append(offs[:-1])
        length.append(offs[-1])
    return AxisPlan(bounds, hi, needs, depth, offset, length)


@dataclass
class TilePlan:
    """The tiles of one input size (one :class:`AxisPlan` per spatial axis).

    Attributes:
        in_place: the nodes whose in-place form runs in place: their input is a new
            tensor that nothing else reads and no tile keeps in its halo.
        tile: the tile size it was made for (input pixels per axis).
    """

    bound: Bound
    axes: list[AxisPlan]
    in_place: frozenset = frozenset()
    tile: tuple = ()

    def tiles(self) -> list[tuple[int, ...]]:
        """Tile indices in raster order (the last axis fastest)."""
        return list(itertools.product(*(range(a.count) for a in self.axes)))

    def own(self, v: int, tile: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The box of node ``v`` that ``tile`` computes."""
        return tuple(a.own(v, k) for a, k in zip(self.axes, tile))

    def needs(self, v: int, tile: tuple[int, ...]) -> tuple[Need, ...] | None:
        """Per axis, what node ``v``'s box at ``tile`` reads of its inputs (None: an
        empty box)."""
        out = tuple(a.needs[v][k] for a, k in zip(self.axes, tile))
        return None if any(n is None for n in out) else out

    def output_range(self, tile: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The output positions of ``tile``."""
        return tuple((a.bounds[k], a.bounds[k + 1]) for a, k in zip(self.axes, tile))

    @property
    def count(self) -> int:
        """Number of tiles."""
        n = 1
        for a in self.axes:
            n *= a.count
        return n


def tile_plan(bound: Bound, tile: tuple[int, ...]) -> TilePlan:
    """The tiles of ``bound``'s input size with about ``tile`` new input positions per
    tile and axis."""
    axes = [axis_plan(bound, a, output_bounds(bound, a, t)) for a, t in enumerate(tile)]
    return TilePlan(bound, axes, _in_place(bound, axes), tuple(tile))


def _in_place(bound: Bound, axes: list[AxisPlan]) -> frozenset:
    """Nodes whose in-place form may run in place (see :class:`TilePlan`)."""
    out = set()
    for v, node in enumerate(bound.nodes):
        if not isinstance(node.op, Local) or node.op.inplace is None or not node.slots:
            continue
        u = node.slots[0]
        producer = bound.nodes[u]
        if (
            u != 0
            and producer.consumers == [v]
            and not any(a.length[u] for a in axes)
            and (not isinstance(producer.op, Local) or producer.op.fresh)
        ):
            out.add(v)
    return frozenset(out)


__all__ = ["AxisPlan", "TilePlan", "axis_plan", "output_bounds", "tile_plan"]
