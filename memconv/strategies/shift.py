"""``"shift"``: one batched matrix product per kernel offset, no im2col.

For every kernel offset κ (K = prod(k) of them) the input positions it touches form
a strided view of the padded input, and ``grad[..., κ] = g @ view^T`` per sample
and group. Summing over the kernel offsets one at a time is what makes the unfold
unnecessary (the "convolution as one matmul per kernel offset" idea).

With stride 1 along every axis the view needs no copy at all: the padded input is
read as one flat row per channel, the output gradient is laid out on the padded
grid (zeros in the positions that do not exist), and each offset is a contiguous
window of that row, which BLAS takes as it is. With other strides, each offset's
view is copied (one input-sized buffer at a time, never K of them).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import (
    Options,
    Problem,
    linear_time,
    numel,
    pad_input,
    padded_size,
    register_strategy,
)
from .costs import scale_memory, time_coefficients
from .geometry import ConvGeometry

#: Bytes of per-chunk temporaries when no ``memory_budget`` is set.
DEFAULT_CHUNK_BUDGET = 16 * 2**20


def _flat_ok(geom: ConvGeometry) -> bool:
    return all(s == 1 for s in geom.stride)


def _per_sample_temporaries(geom: ConvGeometry, size, per_sample: bool, out_given: bool) -> int:
    """Elements of temporaries one sample adds to a chunk."""
    p = padded_size(geom, size)
    t = geom.output_size(size)
    part = geom.out_channels * geom.in_per_group if (out_given or not per_sample) else 0
    if _flat_ok(geom):
        return geom.in_channels * numel(p) + geom.out_channels * t[0] * numel(p[1:]) + part
    padded = geom.in_channels * numel(p) if any(geom.padding) else 0
    return padded + geom.in_channels * numel(t) + part


def chunk_size(problem: Problem, options: Options, out_given: bool = False) -> int:
    """Samples processed together, so that the temporaries fit the budget.

    The budget is ``options.memory_budget`` (bytes) or :data:`DEFAULT_CHUNK_BUDGET`;
    at least one sample is processed at a time.
    """
    budget = options.memory_budget or DEFAULT_CHUNK_BUDGET
    per = _per_sample_temporaries(problem.geom, problem.size, problem.per_sample, out_given)
    return max(1, min(problem.n, budget // max(per * problem.itemsize, 1)))


class Shift:
    """Weight VJP by one batched matrix product per kernel offset.

    The batch is processed in chunks whose temporaries fit ``options.memory_budget``
    (default :data:`DEFAULT_CHUNK_BUDGET`); per-sample results are written in place,
    kernel offset by kernel offset, so the returned per-sample tensor is a strided
    view (offset-major storage) of the usual shape.
    """

    name: ClassVar[str] = "shift"
    options: ClassVar[frozenset[str]] = frozenset({"memory_budget"})
    composite: ClassVar[bool] = False

    def vjp(self, x, g, geom, *, per_sample, options, out=None) -> Tensor:
        n, kk = x.shape[0], geom.kernel_numel
        grp, cg, og = geom.groups, geom.in_per_group, geom.out_per_group
        differentiable = torch.is_grad_enabled() and (x.requires_grad or g.requires_grad)
        direct = out is None and per_sample and not differentiable
        if direct:  # [K, N, G, C_out/G, C_in/G]: each (offset, chunk) block is contiguous
            store = x.new_empty(kk, n, grp, og, cg)
        elif out is None:
            store = x.new_zeros(((n,) if per_sample else ()) + (grp, og, cg, kk))
        else:
            store = out.view(((n,) if per_sample else ()) + (grp, og, cg, kk))
        problem = Problem(
            geom, n, tuple(x.shape[2:]), x.element_size(), per_sample, device=x.device.type
        )
        chunk = chunk_size(problem, options, out is not None)
        for n0 in range(0, n, chunk):
            n1 = min(n, n0 + chunk)
            gm, views = offset_operands(x[n0:n1], g[n0:n1], geom)  # gm [n, G, C_out/G, L]
            for k, view in enumerate(views()):  # view [n, G, C_in/G, L]
                if direct:
                    torch.matmul(gm, view.transpose(-1, -2), out=store[k, n0:n1])
                    continue
                part = torch.matmul(gm, view.transpose(-1, -2))  # [n, G, C_out/G, C_in/G]
                if per_sample:
                    store[n0:n1, ..., k] += part
                else:
                    store[..., k] += part.sum(0)
                del part
            # release this chunk's operands before the next chunk's are built
            gm = views = view = None
        if out is not None:
            return out
        if direct:  # [K, N, G, C_out/G, C_in/G] -> [N, C_out, C_in/G, *k]
            return store.permute(1, 2, 3, 4, 0).reshape(n, *geom.weight_shape)
        return store.reshape(((n,) if per_sample else ()) + geom.weight_shape)

    def memory(self, problem: Problem, options: Options) -> int:
        chunk = chunk_size(problem, options, problem.into)
        per = _per_sample_temporaries(problem.geom, problem.size, problem.per_sample, problem.into)
        return scale_memory("shift", problem.device, chunk * per * problem.itemsize)

    def time(self, problem: Problem, options: Options) -> float:
        geom, n = problem.geom, problem.n
        if _flat_ok(geom):
            p = padded_size(geom, problem.size)
            length = problem.output_size[0] * numel(p[1:])  # a window of the flat row
            copies = 0
        else:
            length = problem.positions
            copies = 2 * n * geom.in_channels * length  # each offset's view copied
        operands = n * (geom.in_channels + geom.out_channels) * length + copies
        traffic = geom.kernel_numel * operands + problem.per_sample_elements()
        *coefficients, flop_depthwise = time_coefficients("shift", problem.device)
        time = linear_time(tuple(coefficients), problem.flops(), traffic, 0)
        if geom.groups > 1 and geom.in_per_group == 1:
            # depthwise: each offset's product is a batch of N·C dot products, which
            # batched matrix products run far below their rate for larger matrices
            time += flop_depthwise * problem.flops()
        return time


def _offsets(geom: ConvGeometry):
    """All kernel offsets, in the weight's (row-major) order."""
    return (
        torch.cartesian_prod(*[torch.arange(k) for k in geom.kernel_size])
        .reshape(-1, geom.dims)
        .tolist()
    )


def offset_operands(x: Tensor, g: Tensor, geom: ConvGeometry):
    """The output gradient as ``[n, G, C_out/G, L]`` and, per kernel offset, the input
    positions it meets as ``[n, G, C_in/G, L]``: ``grad[..., κ] = g @ view_κ^T``.

    Returns:
        ``(gm, views)``; ``views()`` yields the K views, in the weight's offset order,
        each time it is called. With stride 1 they are windows of one flat padded
        buffer (L: T_0 rows of the padded grid, the output gradient laid out on that
        grid with zeros where no output position is); otherwise each is a copy
        (L = T).
    """
    return (_flat_operands if _flat_ok(geom) else _copied_operands)(x, g, geom)


def _flat_operands(x: Tensor, g: Tensor, geom: ConvGeometry):
    """Stride-1 case: views into one flat padded buffer, no copy per offset."""
    n, c = x.shape[:2]
    size, t = tuple(x.shape[2:]), tuple(g.shape[2:])
    p = padded_size(geom, size)
    row = [numel(p[i + 1 :]) for i in range(geom.dims)]  # flat stride of each axis
    length = t[0] * row[0]  # window: T_0 rows of the padded grid
    plane = numel(p)
    spill = sum((k - 1) * d * r for k, d, r in zip(geom.kernel_size, geom.dilation, row))
    buffer = x.new_zeros(n * c * plane + spill)
    padded = buffer[: n * c * plane].view(n, c, *p)
    inner = tuple(slice(pp, pp + s) for pp, s in zip(geom.padding, size))
    padded[(slice(None), slice(None), *inner)] = x
    grid = g.new_zeros(n, geom.out_channels, t[0], *p[1:])
    grid[(slice(None), slice(None), slice(None), *(slice(0, s) for s in t[1:]))] = g
    gm = grid.reshape(n, geom.groups, geom.out_per_group, length)
    cg = geom.in_per_group

    def views():
        for offset in _offsets(geom):
            base = sum(o * d * r for o, d, r in zip(offset, geom.dilation, row))
            yield buffer.as_strided(
                (n, geom.groups, cg, length), (c * plane, cg * plane, plane, 1), base
            )

    return gm, views


def _copied_operands(x: Tensor, g: Tensor, geom: ConvGeometry):
    """General case: each offset's strided view copied into a matrix."""
    xp = pad_input(x, geom.padding)
    n, t = x.shape[0], tuple(g.shape[2:])
    gm = g.reshape(n, geom.groups, geom.out_per_group, numel(t))

    def views():
        for offset in _offsets(geom):
            index = tuple(
                slice(o * d, o * d + (tt - 1) * s + 1, s)
                for o, d, tt, s in zip(offset, geom.dilation, t, geom.stride)
            )
            view = xp[(slice(None), slice(None), *index)]
            yield view.reshape(n, geom.groups, geom.in_per_group, numel(t))

    return gm, views


SHIFT = register_strategy(Shift())
