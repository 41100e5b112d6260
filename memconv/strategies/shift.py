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

import torch
from torch import Tensor

from .._geometry import ConvGeometry
from . import numel, pad_input, padded_size, register_strategy


def _flat_ok(geom: ConvGeometry) -> bool:
    return all(s == 1 for s in geom.stride)


def _extra_memory(geom: ConvGeometry, n, size, itemsize, per_sample, settings) -> int:
    p = padded_size(geom, size)
    t = geom.output_size(size)
    step = n * geom.out_channels * geom.in_per_group  # one offset's result
    summed = 0 if per_sample else n * numel(geom.weight_shape)
    if _flat_ok(geom):
        buffer = n * geom.in_channels * numel(p)
        g_grid = n * geom.out_channels * t[0] * numel(p[1:])
        return (buffer + g_grid + step + summed) * itemsize
    padded = n * geom.in_channels * numel(p) if any(geom.padding) else 0
    view = n * geom.in_channels * numel(t)
    return (padded + view + step + summed) * itemsize


@register_strategy("shift", extra_memory=_extra_memory)
def shift_vjp(
    x: Tensor,
    g: Tensor,
    geom: ConvGeometry,
    *,
    per_sample: bool,
    settings=None,
    out: Tensor | None = None,
) -> Tensor:
    """Weight VJP by one batched matrix product per kernel offset.

    Args:
        x: normal-form input ``[N, C_in, *S]``.
        g: output gradient ``[N, C_out, *T]``.
        geom: the convolution's geometry.
        per_sample: return ``[N, C_out, C_in/G, *k]`` if True, else the sum over N.
        settings: unused.
        out: optional tensor of the result's shape to accumulate into.

    Returns:
        The weight gradient.
    """
    n = x.shape[0]
    grp, cg, og = geom.groups, geom.in_per_group, geom.out_per_group
    shape = (n, grp, og, cg, geom.kernel_numel)
    if out is None:
        grad = x.new_zeros(shape) if per_sample else x.new_zeros(shape[1:])
    else:
        grad = out.reshape((n,) * per_sample + (grp, og, cg, geom.kernel_numel))
    gm, views = (_flat_operands if _flat_ok(geom) else _copied_operands)(x, g, geom)
    for k, view in enumerate(views):
        part = torch.matmul(gm, view.transpose(-1, -2))  # [N, G, C_out/G, C_in/G]
        if per_sample:
            grad[..., k] += part
        else:
            grad[..., k] += part.sum(0)
    result = grad.reshape((n,) * per_sample + geom.weight_shape)
    return result if out is None else out


def _offsets(geom: ConvGeometry):
    """All kernel offsets, in the weight's (row-major) order."""
    return (
        torch.cartesian_prod(*[torch.arange(k) for k in geom.kernel_size])
        .reshape(-1, geom.dims)
        .tolist()
    )


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

    return gm, views()


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

    return gm, views()
