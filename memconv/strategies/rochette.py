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
from .standard import depthwise_copies, operations, raw_kernel


class Rochette:
    """Weight VJP by a convolution of one dimension higher (Rochette et al. 2019)."""

    name: ClassVar[str] = "rochette"
    options: ClassVar[frozenset[str]] = frozenset()
    composite: ClassVar[bool] = False

    def vjp(self, x, g, geom, *, per_sample, options, out=None) -> Tensor:
        if geom.dims == 3:
            return _rochette_3d(x, g, geom, per_sample, out)
        n, grp, cg = x.shape[0], geom.groups, geom.in_per_group
        grad = conv_function(
            geom.dims + 1
        )(
            x.reshape(1, n * grp, cg, *x.shape[2:]),  # [1, N·G, C_in/G, *S]
            g.reshape(n * geom.out_channels, 1, 1, *g.shape[2:]),  # [N·C_out, 1, 1, *T]
            stride=(1, *geom.dilation),
            padding=(0, *geom.padding),
            dilation=(1, *geom.stride),
            groups=n * grp,
        )  # [1, N·C_out, C_in/G, *raw k]
        grad = crop_kernel(
            grad.reshape(n, geom.out_channels, cg, *grad.shape[3:]), geom.kernel_size, 3
        )
        return finish(grad, per_sample, out)

    def memory(self, problem: Problem, options: Options) -> int:
        geom, n, size = problem.geom, problem.n, problem.size
        raw = n * geom.out_channels * geom.in_per_group
        if geom.dims < 3:
            # the backend writes the convolution's output twice (a temporary and the
            # returned buffer, of which the result is a crop: copied when kept)
            extra = 2 * raw * numel(raw_kernel(geom, size)) - problem.result_elements
            extra += problem.relayout(dense=_dense(problem))
            nbytes = (extra + depthwise_copies(problem)) * problem.itemsize + problem.held()
            return scale_memory("rochette", problem.device, nbytes)
        t = problem.output_size
        # per first-kernel offset: the input slice, copied twice (re-laid out, then by
        # the backend), the output-gradient slice and the uncropped part
        x_slice = n * geom.in_channels * t[0] * numel(size[1:])
        g_slice = n * geom.out_channels * numel(t)
        part = raw * numel(raw_kernel(geom, size)[1:])
        summed = 0 if problem.per_sample else n * numel(geom.weight_shape)
        extra = 2 * x_slice + g_slice + part + summed
        return scale_memory("rochette", problem.device, extra * problem.itemsize + problem.held())

    def time(self, problem: Problem, options: Options) -> float:
        geom, n = problem.geom, problem.n
        raw = n * geom.out_channels * geom.in_per_group * numel(raw_kernel(geom, problem.size))
        traffic = problem.input_elements() + problem.grad_elements() + 2 * raw
        traffic += 2 * problem.relayout(dense=_dense(problem))
        if geom.dims == 3:  # slices of input and output gradient copied per k_0
            traffic += geom.kernel_size[0] * (
                2 * problem.input_elements() + problem.grad_elements()
            )
        # one convolution group per sample and group
        coefficients = time_coefficients("rochette", problem.device)
        time = linear_time(coefficients, problem.flops(), traffic, n * geom.groups)
        if geom.dims == 3:  # a dozen per offset of the first kernel axis
            ops = 1 + geom.kernel_size[0] * operations(problem, 11)
        else:
            ops = operations(problem, 4)
        return time + operations_time(ops, problem.device)


def _dense(problem: Problem) -> bool:
    """Whether the result is its own contiguous tensor (no crop of the raw kernel)."""
    geom = problem.geom
    return geom.dims == 3 or raw_kernel(geom, problem.size) == geom.kernel_size


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
        # [N, G, C_in/G, T0', S1, S2] -> [1, N·G·T0', C_in/G, S1, S2]
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
        )  # [1, N·C_out, C_in/G, *raw k_1, k_2]
        part = crop_kernel(
            part.reshape(n, geom.out_channels, cg, *part.shape[3:]), geom.kernel_size[1:], 3
        )
        grad[:, :, :, kk] = part
    return finish(grad, per_sample, out)


ROCHETTE = register_strategy(Rochette())
