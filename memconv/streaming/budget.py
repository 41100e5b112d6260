"""The memory of a streamed training step, and the tile size that fits a budget.

A streamed step holds, besides the image and the parameters:

- the output and its gradient (``[N, C_out, *S_out]`` each) and, when asked for, the
  input gradient;
- the halo stores: the forward values later tiles read, kept from the forward pass to
  the backward pass, and the gradients sent to them, about one row of tiles' worth
  (:mod:`memconv.streaming.halo`);
- the parameters' gradient, twice (the sum over tiles and one tile's);
- one tile's autograd graph in the backward pass: what autograd keeps of every node's
  box, the crops the window ops read (their inputs with the halo, copied together), and
  the backward pass's own buffers.

:func:`predict_peak` adds these up from the tile plan (shapes only);
:func:`predict_time` prices the step's time from the same plan with the device's
calibration, and :func:`choose_tile` returns, of the tiles whose peak fits the budget,
the one predicted fastest. The
tile's graph is priced as :data:`GRAPH_FACTOR` times the bytes of its boxes (all its
nodes' positions), a factor measured at allocator level on ResNet-18, ResNet-50 and
ConvNeXt-tiny trunks as torchvision writes them (0.9 to 1.0 once the rest is taken
off; in-place activations share their input's memory, window crops add theirs).
"""

from __future__ import annotations

import math

from ..strategies import costs
from .graph import Bound
from .tiling import TilePlan, tile_plan

#: Peak bytes of one tile's backward pass over the bytes of its boxes (see the module
#: docstring).
GRAPH_FACTOR = 1.0


def _width(bound: Bound, v: int) -> int:
    """Elements per spatial position of node ``v`` (batch × channels)."""
    node = bound.nodes[v]
    return math.prod(node.shape) // math.prod(bound.sizes(v)) if math.prod(bound.sizes(v)) else 0


def tile_bytes(plan: TilePlan, tile, element_size: int) -> int:
    """Bytes of the boxes one tile computes (every node's)."""
    bound = plan.bound
    total = 0
    for v in range(1, len(bound.nodes)):
        if plan.needs(v, tile) is not None:
            total += _width(bound, v) * math.prod(hi - lo for lo, hi in plan.own(v, tile))
    return total * element_size


def _slab_bytes(plan: TilePlan, axis: int, k: int, element_size: int, rows=None) -> int:
    """Bytes of the halo slabs of every node along ``axis`` at tile boundary ``k`` (with
    ``rows``, across that many positions of the first axis' extent of each node, out of
    its whole)."""
    bound = plan.bound
    total = 0
    for v in range(1, len(bound.nodes)):
        depth = plan.axes[axis].depth[v][k]
        if depth:
            sizes = list(bound.sizes(v))
            if rows is not None:
                sizes[0] = -(-sizes[0] * rows // bound.sizes(0)[0])
            others = math.prod(n for b, n in enumerate(sizes) if b != axis)
            total += _width(bound, v) * depth * others
    return total * element_size


def halo_bytes(plan: TilePlan, element_size: int) -> int:
    """Bytes of the forward values' halo store (every slab, kept from the forward pass
    to the backward pass)."""
    return sum(
        _slab_bytes(plan, a, k, element_size)
        for a, axis in enumerate(plan.axes)
        for k in range(axis.count)
    )


def gradient_halo_bytes(plan: TilePlan, element_size: int) -> int:
    """Bytes of the gradients' halo store at its fullest: two boundaries' slabs along the
    first axis, and along the others the slabs of one row of tiles."""
    first = plan.axes[0]
    rows = sorted(_slab_bytes(plan, 0, k, element_size) for k in range(first.count))[-2:]
    tall = max(hi - lo for lo, hi in (first.own(0, k) for k in range(first.count)))
    across = sum(
        _slab_bytes(plan, a, k, element_size, rows=tall)
        for a in range(1, len(plan.axes))
        for k in range(plan.axes[a].count)
    )
    return sum(rows) + across


def _largest_tiles(plan: TilePlan) -> list:
    """The tiles worth pricing: every tile of small plans; else the first two, a middle
    and the last per axis (the first tile reads the receptive field's look-ahead)."""
    if plan.count <= 256:
        return plan.tiles()
    import itertools

    picks = [sorted({0, min(1, a.count - 1), a.count // 2, a.count - 1}) for a in plan.axes]
    return list(itertools.product(*picks))


def predict_peak(
    plan: TilePlan, element_size: int, input_grad: bool = False, param_bytes: int = 0
) -> int:
    """Predicted peak bytes of one streamed training step (forward and backward) beyond
    the image and the parameters (see the module docstring).

    Args:
        plan: the tiles of the input size.
        element_size: bytes per element (4 for float32).
        input_grad: whether the input gradient is computed.
        param_bytes: bytes of the trunk's trainable parameters.

    Returns:
        Bytes.
    """
    bound = plan.bound
    out = math.prod(bound.output_shape()) * element_size
    graph = max(tile_bytes(plan, t, element_size) for t in _largest_tiles(plan))
    gx = math.prod(bound.nodes[0].shape) * element_size if input_grad else 0
    halo = halo_bytes(plan, element_size) + gradient_halo_bytes(plan, element_size)
    return int(2 * out + gx + halo + 2 * param_bytes + GRAPH_FACTOR * graph)


#: Operations a tile issues per node it computes (its forward pass, its recomputation
#: and its backward pass), per node and axis it reads a halo of (the slab written, the
#: crop assembled, its gradient split and sent), and per tile besides (the output's
#: crop, the parameters' gradients summed, the seeds): counted with
#: ``python -m memconv.bench.ops --streaming`` on the ResNet and ConvNeXt trunks.
OPS_PER_NODE, OPS_PER_HALO, OPS_PER_TILE = 3, 5, 10


def _macs(bound: Bound, v: int) -> int:
    """Multiply-adds per output position of node ``v`` (a convolution's weight over its
    groups' outputs, times the batch), else 0."""
    node = bound.nodes[v]
    apply = getattr(node.op, "apply", None)
    weight = getattr(apply, "weight", None)
    if weight is None:
        return 0
    shape = getattr(bound.values.get(weight, weight), "shape", None)
    return math.prod(shape) * node.shape[0] if shape is not None else 0


def predict_time(plan: TilePlan, device_type: str = "cpu") -> float:
    """Predicted seconds of one streamed training step, priced with the device's
    calibration (:mod:`memconv.strategies.costs`): per tile, its convolutions'
    multiply-adds four times over (two forward passes and the backward pass's two
    products, ``"standard"``'s ``per_flop``), the elements of the crops it assembles
    with their halo, in each pass (``per_element``), and its operations (``"operation"``'s
    ``per_op``; :data:`OPS_PER_NODE` and the like). Smaller tiles cost more operations
    and halo crops for the same arithmetic; the arithmetic itself does not depend on the
    tile, since no position is computed twice in a pass."""
    rates = costs.time_rates("standard", device_type)
    per_op = costs.operations_time(1, device_type)
    bound = plan.bound
    macs = [_macs(bound, v) for v in range(len(bound.nodes))]
    widths = [_width(bound, v) for v in range(len(bound.nodes))]
    total = 0.0
    for tile in plan.tiles():
        ops, elements, flops = OPS_PER_TILE, 0, 0
        for v in range(1, len(bound.nodes)):
            if plan.needs(v, tile) is None:
                continue
            ops += OPS_PER_NODE
            box = plan.own(v, tile)
            flops += macs[v] * math.prod(hi - lo for lo, hi in box)
            halo = [a.depth[v][k] for a, k in zip(plan.axes, tile)]
            if any(halo):
                ops += OPS_PER_HALO * sum(1 for d in halo if d)
                elements += widths[v] * math.prod(hi - lo + d for (lo, hi), d in zip(box, halo))
        total += per_op * ops + rates["per_element"] * 2 * elements + rates["per_flop"] * 4 * flops
    return total


def choose_tile(
    bound: Bound,
    budget: int,
    element_size: int,
    smallest: int,
    input_grad: bool = False,
    param_bytes: int = 0,
    device_type: str = "cpu",
) -> tuple[int, int]:
    """``(tile, predicted peak)``: of the tiles (input pixels, the same on every axis)
    whose predicted peak fits ``budget`` bytes, the one :func:`predict_time` predicts
    fastest on ``device_type`` (of those cutting the image into as many tiles, the one of
    least peak).

    The prediction is not monotone in the tile: small tiles keep more halo slabs (one per
    tile boundary), large ones a larger graph. Tiles from ``smallest`` (at least 64
    pixels) to the image's side are priced on a geometric grid (× 1.25), then the gap
    above the largest that fits is bisected; every tile that fits is a candidate.

    Raises:
        ValueError: if no tile is predicted within the budget (naming the least peak).
    """
    largest = max(bound.sizes(0))
    plans: dict = {}

    def peak(t):
        plans[t] = tile_plan(bound, (t,) * bound.dims)
        return predict_peak(plans[t], element_size, input_grad, param_bytes)

    grid, t = [], min(max(smallest, 64), largest)
    while t < largest:
        grid.append(t)
        t = max(t + 1, int(t * 1.25))
    grid.append(largest)
    peaks = [peak(t) for t in grid]
    fitting = [i for i, p in enumerate(peaks) if p <= budget]
    if not fitting:
        least = min(range(len(grid)), key=peaks.__getitem__)
        raise ValueError(
            f"memory_budget {budget / 2**20:,.0f} MiB is below the least predicted peak: "
            f"{peaks[least] / 2**20:,.0f} MiB with {grid[least]}-pixel tiles (the output, its "
            "gradient and the parameters' gradients alone take some); raise the budget"
        )
    fits = {grid[i]: peaks[i] for i in fitting}
    i = fitting[-1]
    lo = grid[i]
    if i + 1 < len(grid):  # bisect the gap to the next tile of the grid, which does not fit
        hi = grid[i + 1]
        while hi - lo > max(8, lo // 32):
            mid = (lo + hi) // 2
            p = peak(mid)
            if p <= budget:
                lo, fits[mid] = mid, p
            else:
                hi = mid
    times = {t: predict_time(plans[t], device_type) for t in fits}
    fastest = min(fits, key=lambda t: (times[t], -t))
    # a tile cutting the image into as many tiles runs as fast: the one of least peak
    same = [t for t in fits if plans[t].count == plans[fastest].count]
    pick = min(same, key=lambda t: (fits[t], -t))
    return pick, fits[pick]


__all__ = [
    "GRAPH_FACTOR",
    "choose_tile",
    "gradient_halo_bytes",
    "halo_bytes",
    "predict_peak",
    "predict_time",
    "tile_bytes",
]
