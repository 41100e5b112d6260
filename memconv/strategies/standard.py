"""``"standard"``: the weight VJP as a grouped convolution of the same order.

BackPACK's default (``backpack.core.derivatives.convnd``): the input is viewed as one
sample with N·C_in channels, the output gradient, repeated C_in/G times, serves as
N·C_in·(C_out/G) kernels, and a convolution with stride and dilation swapped
yields every sample's weight gradient. The repeat of the output gradient,
N·C_in·(C_out/G)·T elements, is what makes it memory-hungry.
"""

from __future__ import annotations

from torch import Tensor

from .._geometry import ConvGeometry, conv_function
from . import crop_kernel, finish, numel, register_strategy


def _extra_memory(geom: ConvGeometry, n, size, itemsize, per_sample, settings) -> int:
    t = numel(geom.output_size(size))
    # the repeat is a view when C_in/G == 1 (depthwise, or a first layer)
    repeated = n * geom.in_channels * geom.out_per_group * t if geom.in_per_group > 1 else 0
    # the convolution's output before the crop to the kernel size
    full = [
        (s + 2 * p - (t_ - 1) * st - 1) // d + 1
        for s, p, t_, st, d in zip(
            size, geom.padding, geom.output_size(size), geom.stride, geom.dilation
        )
    ]
    raw = n * geom.in_channels * geom.out_per_group * numel(full)
    summed = 0 if per_sample else n * numel(geom.weight_shape)
    return (repeated + raw + summed) * itemsize


@register_strategy("standard", extra_memory=_extra_memory)
def standard_vjp(
    x: Tensor,
    g: Tensor,
    geom: ConvGeometry,
    *,
    per_sample: bool,
    settings=None,
    out: Tensor | None = None,
) -> Tensor:
    """Weight VJP by a grouped convolution of the same order (BackPACK's default).

    Arguments, shapes and return value: the strategy protocol of
    :mod:`memconv.strategies`.
    """
    n, t = x.shape[0], g.shape[2:]
    grp, cg, og = geom.groups, geom.in_per_group, geom.out_per_group
    kernels = (
        g.reshape(n, grp, 1, og, *t)
        .expand(n, grp, cg, og, *t)
        .reshape(n * geom.in_channels * og, 1, *t)
    )
    grad = conv_function(geom.dims)(
        x.reshape(1, n * geom.in_channels, *x.shape[2:]),
        kernels,
        stride=geom.dilation,
        padding=geom.padding,
        dilation=geom.stride,
        groups=n * geom.in_channels,
    )
    grad = crop_kernel(grad.reshape(n, grp, cg, og, *grad.shape[2:]), geom.kernel_size, 4)
    grad = grad.transpose(2, 3).reshape(n, *geom.weight_shape)
    return finish(grad, per_sample, out)
