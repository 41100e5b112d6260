"""``"unfold"``: im2col followed by one batched matrix product, as Opacus does.

The input patches are gathered into the unfolded input ``[N, G, C_in/G·K, T]``
(K = prod(k) kernel offsets, T output positions), and the per-sample gradient is
``g @ unfold(x)^T`` per sample and group (Opacus' ``compute_conv_grad_sample``;
torch's ExpandedWeights do the same). The unfolded input, N·C_in·K·T elements, is
its extra memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._geometry import ConvGeometry
from . import numel, pad_input, padded_size, register_strategy


def _extra_memory(geom: ConvGeometry, n, size, itemsize, per_sample, settings) -> int:
    padded = n * geom.in_channels * numel(padded_size(geom, size)) if any(geom.padding) else 0
    t = numel(geom.output_size(size))
    cols = n * geom.in_channels * geom.kernel_numel * t
    if per_sample:
        # the padded copy is gone by the time the result is allocated
        result = n * numel(geom.weight_shape)
        return (cols + max(padded - result, 0)) * itemsize
    # einsum over (n, t) permutes both operands into contiguous copies
    return (padded + 2 * cols + n * geom.out_channels * t) * itemsize


def unfold_input(x: Tensor, geom: ConvGeometry, t: tuple[int, ...]) -> Tensor:
    """The unfolded (im2col) input ``[N, G, C_in/G·K, T]`` of a normal-form input.

    Arguments, shapes and return value: the strategy protocol of
    :mod:`memconv.strategies`.

    Args:
        t: the output spatial size.

    Returns:
        A new tensor, channel-major then kernel offset, as ``torch.nn.Unfold``.
    """
    xp = pad_input(x, geom.padding)
    n = xp.shape[0]
    s_n, s_c, *s_sp = xp.stride()
    shape = (n, geom.groups, geom.in_per_group, *geom.kernel_size, *t)
    strides = (
        s_n,
        geom.in_per_group * s_c,
        s_c,
        *(d * s for d, s in zip(geom.dilation, s_sp)),
        *(st * s for st, s in zip(geom.stride, s_sp)),
    )
    patches = xp.as_strided(shape, strides, xp.storage_offset())
    return patches.reshape(n, geom.groups, geom.in_per_group * geom.kernel_numel, numel(t))


@register_strategy("unfold", extra_memory=_extra_memory)
def unfold_vjp(
    x: Tensor,
    g: Tensor,
    geom: ConvGeometry,
    *,
    per_sample: bool,
    settings=None,
    out: Tensor | None = None,
) -> Tensor:
    """Weight VJP by im2col and a batched matrix product (Opacus' convention).

    Args:
    """
    n, t = x.shape[0], tuple(g.shape[2:])
    cols = unfold_input(x, geom, t)
    gm = g.reshape(n, geom.groups, geom.out_per_group, numel(t))
    if per_sample:
        grad = torch.matmul(gm, cols.transpose(-1, -2)).reshape(n, *geom.weight_shape)
    else:
        grad = torch.einsum("ngot,ngkt->gok", gm, cols).reshape(geom.weight_shape)
    if out is None:
        return grad
    return out.add_(grad)
