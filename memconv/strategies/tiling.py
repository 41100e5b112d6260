"""``"streaming"``: tile the output positions and accumulate tile by tile.

The output gradient is cut into tiles of ``tile_size`` output positions per
spatial axis. Each tile needs the input positions its receptive field covers (the
tile plus a halo of ``dilation·(k-1)`` positions, stepped by the stride); that
piece of the input is sliced, zero-padded where it crosses the border, and handed
with the tile of the output gradient to an inner strategy, which adds its share
into the result. Extra memory is bounded by one tile, not by the image.

Without ``tile_size`` the tile is chosen to fit ``memory_budget`` (default
:data:`DEFAULT_TILE_BUDGET`); without ``inner`` every registered batched elementary
strategy (:func:`memconv.strategies.base.candidates`) is tried and the fastest (by its
time model, over all tiles) runs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from .base import (
    NO_OPTIONS,
    Options,
    Problem,
    candidates,
    cost_model,
    get_strategy,
    numel,
    pieces,
    register_strategy,
)
from .costs import operations_time, time_coefficients
from .geometry import ConvGeometry, input_range, span, torch_pad_argument

#: Extra bytes a tile may use when neither ``tile_size`` nor ``memory_budget`` is set.
DEFAULT_TILE_BUDGET = 32 * 2**20


def tile_input_size(geom: ConvGeometry, tile: tuple[int, ...]) -> tuple[int, ...]:
    """Input positions (halo included) that ``tile`` output positions need."""
    return tuple(
        (t - 1) * s + span(k, d)
        for t, s, d, k in zip(tile, geom.stride, geom.dilation, geom.kernel_size)
    )


def _inner_options(inner, options: Options) -> Options:
    """The tile's budget reaches an inner strategy that reads one."""
    if "memory_budget" in inner.options and options.memory_budget is not None:
        return Options(memory_budget=options.memory_budget)
    return NO_OPTIONS


def _tile_problem(problem: Problem, tile: tuple[int, ...]) -> Problem:
    geom0 = problem.geom.with_padding((0,) * problem.geom.dims)
    return replace(problem, geom=geom0, size=tile_input_size(problem.geom, tile), into=True)


def _tile_memory(problem: Problem, tile, inner, options: Options) -> int:
    """Extra bytes of one tile: its zero-padded input piece and the inner strategy's
    temporaries while it adds into the result."""
    sub = _tile_problem(problem, tile)
    # a tile at the border gets a zero-padded copy of its input; others are views
    padded = any(problem.geom.padding)
    x_tile = problem.n * problem.geom.in_channels * numel(sub.size) * problem.itemsize * padded
    return x_tile + inner.memory(sub, _inner_options(inner, options))


def _tile_count(problem: Problem, tile) -> int:
    return numel(math.ceil(t / s) for t, s in zip(problem.output_size, tile))


def choose_tile(problem: Problem, inner, options: Options, budget: int) -> tuple[int, ...]:
    """Largest tile (halving the outer axes first) whose extra memory fits ``budget``.

    Returns:
        Output positions per spatial axis; all ones if nothing smaller fits.
    """
    tile = list(problem.output_size)
    for axis in range(problem.geom.dims):
        while tile[axis] > 1 and _tile_memory(problem, tile, inner, options) > budget:
            tile[axis] = math.ceil(tile[axis] / 2)
    return tuple(tile)


def _time(problem: Problem, tile, inner, options: Options) -> float:
    sub = _tile_problem(problem, tile)
    count = _tile_count(problem, tile)
    copy = problem.n * problem.geom.in_channels * numel(sub.size)
    # seconds of one tile's slicing and dispatch, and per element copied
    tile_cost, copy_cost = time_coefficients("streaming", problem.device)
    per_tile = inner.time(sub, _inner_options(inner, options)) + copy_cost * 2 * copy
    # a tile's slices of the input and output gradient (one per axis) and its padding
    ops = 1 + count * (2 * problem.geom.dims + (1 if any(problem.geom.padding) else 0))
    return count * (per_tile + tile_cost) + operations_time(ops, problem.device)


@cost_model
def plan(problem: Problem, options: Options):
    """``(inner strategy, tile)`` for this VJP.

    ``options.inner`` or, by default, the batched elementary strategy with the smallest
    predicted time over all tiles; ``options.tile_size`` or, by default, the largest
    tile within ``options.memory_budget`` (or :data:`DEFAULT_TILE_BUDGET`).
    """
    t = problem.output_size
    inners = (get_strategy(options.inner),) if options.inner else candidates()
    if options.tile_size is not None:
        ts = options.tile_size
        tile = (ts,) * problem.geom.dims if isinstance(ts, int) else tuple(ts)
        tile = tuple(min(a, b) for a, b in zip(tile, t))
        inner = min(inners, key=lambda s: _time(problem, tile, s, options))
        return inner, tile
    budget = options.memory_budget or DEFAULT_TILE_BUDGET
    best = None
    for inner in inners:
        tile = choose_tile(problem, inner, options, budget)
        fits = _tile_memory(problem, tile, inner, options) <= budget
        key = (not fits, _time(problem, tile, inner, options))
        if best is None or key < best[0]:
            best = (key, inner, tile)
    return best[1], best[2]


def tiles(geom: ConvGeometry, size: tuple[int, ...], tile: tuple[int, ...]):
    """Yield ``(out_slices, in_slices, pad)`` for every tile.

    ``out_slices`` index the output gradient, ``in_slices`` the (unpadded) input, and
    ``pad`` is the :func:`torch.nn.functional.pad` argument that restores the zero
    border the slice misses (None if none). Tiles lying wholly in the padding are
    skipped (they contribute nothing).
    """
    t = geom.output_size(size)
    starts = [range(0, tt, ts) for tt, ts in zip(t, tile)]
    for corner in itertools.product(*starts):
        out_sl, in_sl, pairs = [], [], []
        for a, ts, tt, s, d, k, p, sz in zip(
            corner, tile, t, geom.stride, geom.dilation, geom.kernel_size, geom.padding, size
        ):
            b = min(a + ts, tt)
            (lo, hi), pad = input_range((a, b), s, p, span(k, d), sz)
            if hi <= lo:
                break
            out_sl.append(slice(a, b))
            in_sl.append(slice(lo, hi))
            pairs.append(pad)
        else:
            pad = torch_pad_argument(pairs)
            yield tuple(out_sl), tuple(in_sl), (pad if any(pad) else None)


class Streaming:
    """Weight VJP accumulated over tiles of the output (memory bounded by a tile)."""

    name: ClassVar[str] = "streaming"
    options: ClassVar[frozenset[str]] = frozenset({"tile_size", "memory_budget", "inner"})
    composite: ClassVar[bool] = True

    def vjp(self, x, g, geom, *, per_sample, options, out=None) -> Tensor:
        n, size = x.shape[0], tuple(x.shape[2:])
        problem = Problem(geom, n, size, x.element_size(), per_sample, device=x.device.type)
        inner, tile = plan(problem, options)
        inner_options = _inner_options(inner, options)
        geom0 = geom.with_padding((0,) * geom.dims)
        if out is None:
            out = x.new_zeros((n, *geom.weight_shape) if per_sample else geom.weight_shape)
        every = (slice(None), slice(None))
        for out_sl, in_sl, pad in tiles(geom, size, tile):
            x_tile = x[every + in_sl]
            if pad is not None:
                x_tile = F.pad(x_tile, pad)
            inner.vjp(
                x_tile,
                g[every + out_sl],
                geom0,
                per_sample=per_sample,
                options=inner_options,
                out=out,
            )
        return out

    def memory(self, problem: Problem, options: Options) -> int:
        inner, tile = plan(problem, options)
        return _tile_memory(problem, tile, inner, options)

    def time(self, problem: Problem, options: Options) -> float:
        inner, tile = plan(problem, options)
        return _time(problem, tile, inner, options)

    def pieces(self, problem: Problem, options: Options) -> int:
        """Tiles, times the pieces the inner strategy splits each into."""
        inner, tile = plan(problem, options)
        sub = _tile_problem(problem, tile)
        return _tile_count(problem, tile) * pieces(inner, sub, _inner_options(inner, options))


STREAMING = register_strategy(Streaming())
