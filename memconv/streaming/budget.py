"""The memory of a streamed training step, and the tile size that fits a budget.

A streamed step holds, besides the image and the parameters:

- the output and its gradient (``[N, C_out, *S_out]`` each) and, when asked for, the
  input gradient;
- the halo stores: the forward values later tiles read, kept from the forward pass to
  the backward pass, and the gradients sent to them (:mod:`memconv.streaming.halo`);
- one tile's autograd graph in the backward pass: every node's box, the crops the
  window ops read (their inputs with the halo, copied together), and the backward
  pass's own buffers.

:func:`predict_peak` adds these up from the tile plan (shapes only);
:func:`choose_tile` returns the largest tile whose prediction fits the budget. The
factor on the tile's graph (:data:`GRAPH_FACTOR`) is measured: the allocator's peak
of ResNet-18, ResNet-50 and ConvNeXt-tiny trunks over the predicted graph bytes
(``docs/benchmarks.md``, "Streaming the models people stream").
"""

from __future__ import annotations

import math

from .graph import Bound
from .ops import Local
from .tiling import TilePlan, tile_plan

#: Peak bytes of one tile's backward pass over the bytes of its boxes and crops: autograd
#: keeps most boxes (saved inputs of the next op), and the backward pass holds a few
#: gradient buffers of the largest boxes at once.
GRAPH_FACTOR = 1.5


def _width(bound: Bound, v: int) -> int:
    """Elements per spatial position of node ``v`` (batch × channels)."""
    node = bound.nodes[v]
    return math.prod(node.shape) // math.prod(bound.sizes(v)) if math.prod(bound.sizes(v)) else 0


def tile_bytes(plan: TilePlan, tile, element_size: int) -> int:
    """Bytes of the boxes and window crops one tile computes."""
    bound = plan.bound
    total = 0
    for v in range(1, len(bound.nodes)):
        node = bound.nodes[v]
        needs = plan.needs(v, tile)
        if needs is None:
            continue
        total += _width(bound, v) * math.prod(hi - lo for lo, hi in plan.own(v, tile))
        if not isinstance(node.op, Local):
            total += _width(bound, node.slots[0]) * math.prod(
                n.hi - n.lo + n.pad_lo + n.pad_hi for n in needs
            )
    return total * element_size


def halo_bytes(plan: TilePlan, element_size: int) -> int:
    """Bytes of one halo store (forward values; the gradient store is as large)."""
    bound = plan.bound
    total = 0
    for v in range(1, len(bound.nodes)):
        sizes = bound.sizes(v)
        for a, axis in enumerate(plan.axes):
            if axis.length[v]:
                others = math.prod(s for b, s in enumerate(sizes) if b != a)
                total += _width(bound, v) * axis.length[v] * others
    return total * element_size


def _largest_tiles(plan: TilePlan) -> list:
    """The tiles worth pricing: every tile of small plans; else the first two, a middle
    and the last per axis (the first tile reads the receptive field's look-ahead)."""
    if plan.count <= 256:
        return plan.tiles()
    import itertools

    picks = [sorted({0, min(1, a.count - 1), a.count // 2, a.count - 1}) for a in plan.axes]
    return list(itertools.product(*picks))


def predict_peak(plan: TilePlan, element_size: int, input_grad: bool = False) -> int:
    """Predicted peak bytes of one streamed training step (forward and backward) beyond
    the image and the parameters (see the module docstring).

    Args:
        plan: the tiles of the input size.
        element_size: bytes per element (4 for float32).
        input_grad: whether the input gradient is computed.

    Returns:
        Bytes.
    """
    bound = plan.bound
    out = math.prod(bound.output_shape()) * element_size
    graph = max(tile_bytes(plan, t, element_size) for t in _largest_tiles(plan))
    gx = math.prod(bound.nodes[0].shape) * element_size if input_grad else 0
    return int(2 * out + gx + 2 * halo_bytes(plan, element_size) + GRAPH_FACTOR * graph)


def choose_tile(
    bound: Bound, budget: int, element_size: int, smallest: int, input_grad: bool = False
) -> tuple[int, int]:
    """``(tile, predicted peak)``: the largest tile (input pixels, the same on every
    axis) whose predicted peak fits ``budget`` bytes.

    Raises:
        ValueError: if even the smallest tile (``smallest``: the receptive field)
            is predicted above the budget.
    """
    largest = max(bound.sizes(0))

    def peak(t):
        plan = tile_plan(bound, (t,) * bound.dims)
        return predict_peak(plan, element_size, input_grad)

    low = peak(smallest)
    if low > budget:
        raise ValueError(
            f"memory_budget {budget / 2**20:,.0f} MiB is below the predicted peak of the "
            f"smallest tile ({smallest} pixels, the receptive field): {low / 2**20:,.0f} MiB; "
            "raise the budget"
        )
    if peak(largest) <= budget:
        return largest, peak(largest)
    lo, hi = smallest, largest  # peak(lo) fits, peak(hi) does not
    while hi - lo > max(8, lo // 16):
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo, peak(lo)


__all__ = ["GRAPH_FACTOR", "choose_tile", "halo_bytes", "predict_peak", "tile_bytes"]
