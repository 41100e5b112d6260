"""``"standard"``: the weight VJP as a grouped convolution of the same order.

BackPACK's default (``backpack.core.derivatives.convnd``): the input is viewed as one
sample with N·C_in channels, the output gradient, repeated C_in/G times, serves as
N·C_in·(C_out/G) kernels, and a convolution with stride and dilation swapped
yields every sample's weight gradient. The repeat of the output gradient,
N·C_in·(C_out/G)·T elements, is what makes it memory-hungry.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from .base import (
    Options,
    Problem,
    crop_kernel,
    finish,
    linear_time,
    numel,
    register_strategy,
)
from .costs import operations_time, scale_memory, time_coefficients
from .geometry import ConvGeometry, conv_function


def raw_kernel(geom: ConvGeometry, size: tuple[int, ...]) -> tuple[int, ...]:
    """Kernel positions the swapped convolution returns before the crop."""
    return tuple(
        (s + 2 * p - (t - 1) * st - 1) // d + 1
        for s, p, t, st, d in zip(
            size, geom.padding, geom.output_size(size), geom.stride, geom.dilation
        )
    )


def operations(problem: Problem, fixed: int) -> int:
    """Tensor operations of a VJP that issues ``fixed`` of them, and one crop per
    kernel axis the swapped convolution overshoots (:func:`memconv.strategies.base.crop_kernel`)."""
    raw = raw_kernel(problem.geom, problem.size)
    return fixed + sum(r != k for r, k in zip(raw, problem.geom.kernel_size))


def depthwise_copies(problem: Problem) -> int:
    """Elements the CPU backend copies when the swapped convolution is depthwise
    (one output channel per group, C_out/G = 1): the input and the output gradient."""
    geom, n = problem.geom, problem.n
    if geom.out_per_group != 1:
        return 0
    return n * geom.in_channels * numel(problem.size) + n * geom.out_channels * problem.positions


def _dense(problem: Problem) -> bool:
    """Whether the result is its own contiguous tensor: no crop of the raw kernel, and
    the transpose of ``C_in/G`` and ``C_out/G`` a copy (with G = 1 the reshape keeps it a
    strided view) or trivial (either of them 1)."""
    geom = problem.geom
    uncropped = raw_kernel(geom, problem.size) == geom.kernel_size
    return uncropped and (geom.groups > 1 or min(geom.in_per_group, geom.out_per_group) == 1)


class Standard:
    """Weight VJP by a grouped convolution of the same order (BackPACK's default)."""

    name: ClassVar[str] = "standard"
    options: ClassVar[frozenset[str]] = frozenset()
    composite: ClassVar[bool] = False

    def vjp(self, x, g, geom, *, per_sample, options, out=None) -> Tensor:
        n, t = x.shape[0], g.shape[2:]
        grp, cg, og = geom.groups, geom.in_per_group, geom.out_per_group
        # kernels [N·C_in·(C_out/G), 1, *T]: g repeated over the C_in/G inputs of a group
        kernels = (
            g.reshape(n, grp, 1, og, *t)
            .expand(n, grp, cg, og, *t)
            .reshape(n * geom.in_channels * og, 1, *t)
        )
        grad = conv_function(geom.dims)(
            x.reshape(1, n * geom.in_channels, *x.shape[2:]),  # [1, N·C_in, *S]
            kernels,
            stride=geom.dilation,
            padding=geom.padding,
            dilation=geom.stride,
            groups=n * geom.in_channels,
        )  # [1, N·C_in·(C_out/G), *raw k]
        grad = crop_kernel(grad.reshape(n, grp, cg, og, *grad.shape[2:]), geom.kernel_size, 4)
        # [N, G, C_in/G, C_out/G, *k] -> [N, C_out, C_in/G, *k]
        grad = grad.transpose(2, 3).reshape(n, *geom.weight_shape)
        return finish(grad, per_sample, out)

    def memory(self, problem: Problem, options: Options) -> int:
        geom, n = problem.geom, problem.n
        # the repeat is a view when C_in/G == 1 (depthwise, or a first layer)
        repeated = n * geom.in_channels * geom.out_per_group * problem.positions
        repeated = repeated if geom.in_per_group > 1 else 0
        raw = n * geom.in_channels * geom.out_per_group * numel(raw_kernel(geom, problem.size))
        # the backend writes the convolution's output twice (a temporary and the
        # returned buffer, of which the result is a crop)
        extra = repeated + 2 * raw - problem.result_elements + problem.relayout(_dense(problem))
        nbytes = (extra + depthwise_copies(problem)) * problem.itemsize + problem.held()
        return scale_memory("standard", problem.device, nbytes)

    def time(self, problem: Problem, options: Options) -> float:
        geom, n = problem.geom, problem.n
        repeated = n * geom.in_channels * geom.out_per_group * problem.positions
        repeated = repeated if geom.in_per_group > 1 else 0
        raw = n * geom.in_channels * geom.out_per_group * numel(raw_kernel(geom, problem.size))
        traffic = (
            problem.input_elements()
            + problem.grad_elements()
            + 2 * repeated
            + 2 * raw
            + problem.per_sample_elements()
            + 2 * problem.relayout(_dense(problem))
        )
        # one convolution group per sample and input channel
        coefficients = time_coefficients("standard", problem.device)
        time = linear_time(coefficients, problem.flops(), traffic, n * geom.in_channels)
        return time + operations_time(operations(problem, 8), problem.device)


STANDARD = register_strategy(Standard())
