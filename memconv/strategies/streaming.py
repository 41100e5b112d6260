"""``"streaming"``: tile the output positions and accumulate tile by tile.

The output gradient is cut into tiles of ``tile_size`` output positions per
spatial axis. Each tile needs the input positions its receptive field covers (the
tile plus a halo of ``dilation·(k-1)`` positions, stepped by the stride); that
piece of the input is sliced, zero-padded where it crosses the border, and handed
with the tile of the output gradient to an inner strategy, which adds its share
into the result. Extra memory is bounded by one tile, not by the image.
"""

from __future__ import annotations

import itertools
import math

import torch.nn.functional as F
from torch import Tensor

from .._geometry import ConvGeometry
from . import get_strategy, numel, register_strategy

#: Extra bytes a tile may use when neither ``tile_size`` nor ``memory_budget`` is set.
DEFAULT_TILE_BUDGET = 32 * 2**20
#: Strategy run on each tile when ``inner`` is not set.
DEFAULT_INNER = "shift"


def tile_input_size(geom: ConvGeometry, tile: tuple[int, ...]) -> tuple[int, ...]:
    """Input positions (halo included) that ``tile`` output positions need."""
    return tuple(
        (t - 1) * s + d * (k - 1) + 1
        for t, s, d, k in zip(tile, geom.stride, geom.dilation, geom.kernel_size)
    )


def _tile_cost(geom, n, tile, itemsize, per_sample, inner) -> int:
    """Extra bytes of one tile: its zero-padded input piece and the inner strategy's
    temporaries while it adds into the result (``"shift"`` adds one kernel offset of
    one chunk of samples at a time; the others hold a whole result first)."""
    size = tile_input_size(geom, tile)
    geom0 = geom.with_padding((0,) * geom.dims)
    x_tile = n * geom.in_channels * numel(size) * itemsize
    if inner == "shift":
        from .shift import accumulating_temporaries

        return x_tile + accumulating_temporaries(geom0, n, size, itemsize, per_sample)
    held = numel(geom.weight_shape) * (n if per_sample else 1) * itemsize
    return (
        x_tile + held + get_strategy(inner).extra_memory(geom0, n, size, itemsize, per_sample, None)
    )


def choose_tile(geom, n, size, itemsize, per_sample, budget, inner) -> tuple[int, ...]:
    """Largest tile (halving the outer axes first) whose extra memory fits ``budget``.

    Arguments, shapes and return value: the strategy protocol of
    :mod:`memconv.strategies`.

    Args:
        n: batch size N.
        size: normal-form input spatial size.
        itemsize: bytes per element.
        budget: bytes.
        inner: name of the inner strategy.

    Returns:
        Output positions per spatial axis; all ones if nothing smaller fits.
    """
    tile = list(geom.output_size(size))
    for axis in range(geom.dims):
        while tile[axis] > 1 and _tile_cost(geom, n, tile, itemsize, per_sample, inner) > budget:
            tile[axis] = math.ceil(tile[axis] / 2)
    return tuple(tile)


def _resolve(geom, n, size, itemsize, per_sample, settings):
    inner = (settings.inner if settings is not None else None) or DEFAULT_INNER
    tile_size = settings.tile_size if settings is not None else None
    t = geom.output_size(size)
    if tile_size is None:
        budget = (settings.memory_budget if settings is not None else None) or DEFAULT_TILE_BUDGET
        tile = choose_tile(geom, n, size, itemsize, per_sample, budget, inner)
    elif isinstance(tile_size, int):
        tile = (tile_size,) * geom.dims
    else:
        tile = tuple(tile_size)
    return inner, tuple(min(a, b) for a, b in zip(tile, t))


def _extra_memory(geom: ConvGeometry, n, size, itemsize, per_sample, settings) -> int:
    inner, tile = _resolve(geom, n, size, itemsize, per_sample, settings)
    return _tile_cost(geom, n, tile, itemsize, per_sample, inner)


def tiles(geom: ConvGeometry, size: tuple[int, ...], tile: tuple[int, ...]):
    """Yield ``(out_slices, in_slices, pad)`` for every tile.

    ``out_slices`` index the output gradient, ``in_slices`` the (unpadded) input, and
    ``pad`` is the :func:`torch.nn.functional.pad` argument that restores the zero
    border the slice misses. Tiles lying wholly in the padding are skipped (they
    contribute nothing).
    """
    t = geom.output_size(size)
    starts = [range(0, tt, ts) for tt, ts in zip(t, tile)]
    for corner in itertools.product(*starts):
        out_sl, in_sl, pairs = [], [], []
        for a, ts, tt, s, d, k, p, sz in zip(
            corner, tile, t, geom.stride, geom.dilation, geom.kernel_size, geom.padding, size
        ):
            b = min(a + ts, tt)
            lo, hi = a * s - p, (b - 1) * s + d * (k - 1) + 1 - p
            c_lo, c_hi = max(lo, 0), min(hi, sz)
            if c_hi <= c_lo:
                break
            out_sl.append(slice(a, b))
            in_sl.append(slice(c_lo, c_hi))
            pairs.append((c_lo - lo, hi - c_hi))
        else:
            pad = tuple(v for pair in reversed(pairs) for v in pair)
            yield tuple(out_sl), tuple(in_sl), (pad if any(pad) else None)


@register_strategy("streaming", extra_memory=_extra_memory, tiles=True)
def streaming_vjp(
    x: Tensor,
    g: Tensor,
    geom: ConvGeometry,
    *,
    per_sample: bool,
    settings=None,
    out: Tensor | None = None,
) -> Tensor:
    """Weight VJP accumulated over tiles of the output (memory bounded by a tile).

    Args:
        settings: :class:`memconv.context.Settings`; ``tile_size`` (output positions
            per axis), ``memory_budget`` (bytes, used to choose the tile when
            ``tile_size`` is None; default 32 MiB) and ``inner`` (default
            ``"shift"``) are read.
    """
    n, size = x.shape[0], tuple(x.shape[2:])
    inner, tile = _resolve(geom, n, size, x.element_size(), per_sample, settings)
    vjp = get_strategy(inner).vjp
    geom0 = geom.with_padding((0,) * geom.dims)
    if out is None:
        shape = (n, *geom.weight_shape) if per_sample else geom.weight_shape
        out = x.new_zeros(shape)
    every = (slice(None), slice(None))
    for out_sl, in_sl, pad in tiles(geom, size, tile):
        x_tile = x[every + in_sl]
        if pad is not None:
            x_tile = F.pad(x_tile, pad)
        vjp(x_tile, g[every + out_sl], geom0, per_sample=per_sample, settings=settings, out=out)
    return out
