"""``"rochette"``: the weight VJP as one convolution of one dimension higher.

Rochette, Manoel & Tramel, "Efficient per-example gradient computations in
convolutional neural networks" (2019, arXiv:1912.06015), Sec. 3: the input channels
become an extra spatial axis with kernel size 1, the batch (and groups) become the
convolution's groups, so the output gradient serves as the kernel without being
repeated. Extra memory: about the size of the result.

Conv3d has no Conv4d. There the first kernel axis is looped over: for each of its
k_0 offsets, the matching slice of the input (strided by the stride) has its
output-position axis folded into the channels of a grouped Conv3d that sums over
it. Each step copies about one input's worth of data, so extra memory stays of the
order of the input, never of the im2col matrix or of a repeated output gradient.
"""

from __future__ import annotations

from torch import Tensor

from .._geometry import ConvGeometry, conv_function
from . import crop_kernel, finish, numel, register_strategy


def _raw_kernel(geom: ConvGeometry, size, axes) -> list[int]:
    t = geom.output_size(size)
    return [
        (size[i] + 2 * geom.padding[i] - (t[i] - 1) * geom.stride[i] - 1) // geom.dilation[i] + 1
        for i in axes
    ]


def _extra_memory(geom: ConvGeometry, n, size, itemsize, per_sample, settings) -> int:
    res = n * numel(geom.weight_shape)
    summed = 0 if per_sample else res
    if geom.dims < 3:
        axes = range(geom.dims)
        # the convolution's output before the crop (the result itself when it fits)
        raw = n * geom.out_channels * geom.in_per_group * numel(_raw_kernel(geom, size, axes))
        return (raw + summed) * itemsize
    t = geom.output_size(size)
    x_slice = n * geom.in_channels * t[0] * numel(size[1:])
    g_slice = n * geom.out_channels * numel(t)
    raw = n * geom.out_channels * geom.in_per_group * numel(_raw_kernel(geom, size, (1, 2)))
    return (x_slice + g_slice + raw + summed) * itemsize


@register_strategy("rochette", extra_memory=_extra_memory)
def rochette_vjp(
    x: Tensor,
    g: Tensor,
    geom: ConvGeometry,
    *,
    per_sample: bool,
    settings=None,
    out: Tensor | None = None,
) -> Tensor:
    """Weight VJP by a convolution of one dimension higher (Rochette et al. 2019).

    Arguments, shapes and return value: the strategy protocol of
    :mod:`memconv.strategies`.
    """
    if geom.dims == 3:
        return _rochette_3d(x, g, geom, per_sample, out)
    n, grp, cg = x.shape[0], geom.groups, geom.in_per_group
    grad = conv_function(geom.dims + 1)(
        x.reshape(1, n * grp, cg, *x.shape[2:]),
        g.reshape(n * geom.out_channels, 1, 1, *g.shape[2:]),
        stride=(1, *geom.dilation),
        padding=(0, *geom.padding),
        dilation=(1, *geom.stride),
        groups=n * grp,
    )
    grad = crop_kernel(grad.reshape(n, geom.out_channels, cg, *grad.shape[3:]), geom.kernel_size, 3)
    return finish(grad, per_sample, out)


def _rochette_3d(x: Tensor, g: Tensor, geom: ConvGeometry, per_sample: bool, out):
    n, grp, cg = x.shape[0], geom.groups, geom.in_per_group
    s0, d0, p0, k0 = geom.stride[0], geom.dilation[0], geom.padding[0], geom.kernel_size[0]
    size0, t0 = x.shape[2], g.shape[2]
    grad = x.new_zeros(n, geom.out_channels, cg, *geom.kernel_size)
    for kk in range(k0):
        # output rows t whose input row t*s0 + kk*d0 - p0 lies inside the input
        lo = max(0, -((kk * d0 - p0) // s0))
        hi = min(t0, (size0 - 1 - kk * d0 + p0) // s0 + 1)
        if hi <= lo:
            continue
        start = lo * s0 + kk * d0 - p0
        xs = x[:, :, start : start + (hi - lo - 1) * s0 + 1 : s0]  # [N, C_in, T0', S1, S2]
        xs = xs.reshape(n, grp, cg, hi - lo, *x.shape[3:]).transpose(2, 3)
        xs = xs.reshape(1, n * grp * (hi - lo), cg, *x.shape[3:])
        gs = g[:, :, lo:hi].reshape(n * geom.out_channels, hi - lo, 1, *g.shape[3:])
        part = conv_function(3)(
            xs,
            gs,
            stride=(1, *geom.dilation[1:]),
            padding=(0, *geom.padding[1:]),
            dilation=(1, *geom.stride[1:]),
            groups=n * grp,
        )
        part = crop_kernel(
            part.reshape(n, geom.out_channels, cg, *part.shape[3:]), geom.kernel_size[1:], 3
        )
        grad[:, :, :, kk] = part
    return finish(grad, per_sample, out)
