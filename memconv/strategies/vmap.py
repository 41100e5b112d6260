"""``"vmap"``: torch's own weight-gradient kernel on the whole batch, the samples as groups.

The per-sample gradients of a convolution with G groups are the summed weight
gradient of one convolution with N·G groups: the batch folded into the channels
(``x`` as ``[1, N·C_in, *S]``, ``g`` as ``[1, N·C_out, *T]``), ATen's
``convolution_backward`` asked for the weight gradient only returns
``[N·C_out, C_in/G, *k]``, which is the per-sample tensor ``[N, C_out, C_in/G, *k]``
as it lies. This is what ``torch.func.vmap(torch.func.grad(...))`` runs for a
convolution (functorch's batching rule of ``convolution_backward``), and what
``"loop"`` runs sample by sample, in one call: oneDNN's grouped weight-gradient kernel
on the CPU (float32), cuDNN's on a GPU. Its extra memory is the kernel's own (oneDNN
reorders its operands); the weight it reads only the shape of is a one-element
stand-in. The kernel is called through :func:`memconv.strategies.geometry.convolution_backward`
with the batch's geometry.

On the CPU it is the fastest route where each sample's work is long in positions and
short in channels (the 64-channel layers of a CIFAR ResNet, 1-d and 3-d convolutions,
depthwise 3×3 layers): 0.25-0.65× the time of the faster of ``"unfold"`` and
``"shift"`` there. It is slow where a sample's work is short (a strided layer over a
small map, the last stages of a ResNet: the kernel's cost per result element
dominates), on oneDNN's im2col kernel (fewer than 8 input channels per group, dilated
2-d and 3-d layers: :func:`blocked_path`) and on depthwise layers with large kernels.
Its time model prices the multiply-adds (per kernel), the operands, the results
written (past half the last-level cache at a second rate) and the groups; ``"auto"``
takes it where that price is the lowest. A device whose calibration has no ``"vmap"``
model does not price it, nor does float64 (which ATen runs with its native kernel,
group by group: 1.1-8x the fastest strategy's time on the CPU), and ``"auto"`` does not
take it there (it still runs when named).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar

from torch import Tensor

from .base import Options, Problem, finish, register_strategy
from .costs import cache_bytes, operations_time, priced, scale_memory, time_rates
from .geometry import ConvGeometry, convolution_backward

#: Tensor operations of one VJP (the stand-in, its expansion, the two reshapes, the
#: kernel and the result's view), and those a summed result or an ``out`` adds.
OPERATIONS = 6


def grouped_weight_grad(x: Tensor, g: Tensor, geom: ConvGeometry) -> Tensor:
    """The per-sample weight gradients ``[N, C_out, C_in/G, *k]`` by one call of
    ``convolution_backward`` with the samples as groups.

    Args:
        x: normal-form input ``[N, C_in, *S]``.
        g: output gradient ``[N, C_out, *T]``, same dtype as ``x``.
        geom: the geometry.
    """
    n = x.shape[0]
    # the samples as groups: one convolution of N·C_in channels in N·G groups
    channels = dict(in_channels=n * geom.in_channels, out_channels=n * geom.out_channels)
    batched = replace(geom, groups=n * geom.groups, **channels)
    # the kernel reads only the weight's shape and dtype for a weight gradient
    shape = batched.weight_shape
    weight = x.new_empty((1,) * len(shape)).expand(shape)
    _, grad, _ = convolution_backward(
        x.reshape(1, n * geom.in_channels, *x.shape[2:]),
        weight,
        g.reshape(1, n * geom.out_channels, *g.shape[2:]),
        batched,
        weight_grad=True,
    )
    return grad.view(n, *geom.weight_shape)


def _depthwise(geom: ConvGeometry) -> bool:
    """One input and one output channel per group."""
    return geom.in_per_group == 1 and geom.out_per_group == 1


def blocked_path(geom: ConvGeometry, size: tuple[int, ...]) -> bool:
    """Whether oneDNN computes the grouped weight gradient with its blocked kernel
    (which reorders both operands) rather than its im2col one: a depthwise layer of at
    most 3×3 offsets, or at least 8 input channels per group, no dilation in 2-d and
    3-d, and a 3-d input at least as deep as the kernel (measured on oneDNN 3.x, the
    allocator's events of one call; the memory and time models follow it).

    Args:
        geom: the normal-form geometry.
        size: the normal-form input's spatial size S.
    """
    if _depthwise(geom):
        return geom.kernel_numel <= 9
    if geom.in_per_group < 8:
        return False
    if geom.dims >= 2 and any(d > 1 for d in geom.dilation):
        return False
    return not (geom.dims == 3 and size[0] < geom.kernel_size[0])


def im2col_buffers(geom: ConvGeometry, n: int) -> tuple[int, int]:
    """``(column buffers, partial sums)`` of oneDNN's im2col kernel: the copies of one
    group's columns and of the per-sample result it keeps besides the result
    (measured: one buffer and up to 4 partial sums for an unstrided 2-d layer that is
    not depthwise, two and up to 8 otherwise; two partial sums per group, none for a
    single group)."""
    unstrided = all(s == 1 for s in geom.stride)
    split = 1 if geom.dims == 2 and unstrided and not _depthwise(geom) else 2
    groups = n * geom.groups
    return split, 0 if groups == 1 else min(2 * groups, 4 * split)


class Vmap:
    """Weight VJP by one call of torch's weight-gradient kernel, the samples as groups
    (torch.func's batching rule)."""

    name: ClassVar[str] = "vmap"
    options: ClassVar[frozenset[str]] = frozenset()
    composite: ClassVar[bool] = False

    def vjp(self, x, g, geom, *, per_sample, options, out=None) -> Tensor:
        return finish(grouped_weight_grad(x, g, geom), per_sample, out)

    def memory(self, problem: Problem, options: Options) -> int:
        geom, r = problem.geom, problem.per_sample_elements()
        operands = problem.input_elements() + problem.grad_elements()
        if blocked_path(geom, problem.size):
            # oneDNN's blocked kernel: its reordered copies of the two operands and the
            # gradients in its own layout, or the latter twice (then reordered into the
            # result), whichever is more
            extra = max(operands + r, 2 * r)
        else:
            # its im2col kernel: its buffers of one group's columns (in 3-d, of one
            # output plane), its threads' partial sums and the gradients in its own
            # layout
            positions = problem.positions
            if geom.dims == 3:
                positions //= problem.output_size[0]
            buffers, partial = im2col_buffers(geom, problem.n)
            columns = buffers * geom.in_per_group * geom.kernel_numel * positions
            extra = columns + (partial + 1) * r
        if not problem.per_sample:
            extra += r  # the per-sample gradients the summed result adds up
        nbytes = extra * problem.itemsize + problem.held()
        return scale_memory("vmap", problem.device, nbytes)

    def time(self, problem: Problem, options: Options) -> float:
        if not priced("vmap", problem.device) or problem.itemsize > 4:
            # not fitted on this device type; or float64, which ATen runs with its
            # native kernel group by group, not oneDNN's (measured 1.1-8x the fastest
            # strategy's time where float32 is 0.25-0.65x): "auto" does not take it
            return math.inf
        rate = time_rates("vmap", problem.device)
        geom = problem.geom
        # seconds per multiply-add on oneDNN's blocked kernel (strided or not) or its
        # im2col one, per element of the operands (and of a summed result's
        # per-sample gradients, read again), per gradient written and per group
        if _depthwise(geom) and geom.kernel_numel > 9:
            per_flop = rate["per_flop_depthwise_large"]
        elif not blocked_path(geom, problem.size):
            per_flop = rate["per_flop_im2col"]
        elif any(s > 1 for s in geom.stride):
            per_flop = rate["per_flop_strided"]
        else:
            per_flop = rate["per_flop"]
        operands = problem.input_elements() + problem.grad_elements()
        summed = 0 if problem.per_sample else problem.per_sample_elements()
        operations = OPERATIONS + (0 if problem.per_sample and not problem.into else 1)
        results = problem.per_sample_elements()
        # the gradients past half the last-level cache: written from memory
        cache = cache_bytes(problem.device)
        spilled = cache is not None and 2 * results * problem.itemsize > cache
        spilled = rate["per_result_spilled"] * results if spilled else 0.0
        return (
            per_flop * problem.flops()
            + rate["per_element"] * (operands + summed)
            + rate["per_result"] * results
            + spilled
            + rate["per_group"] * problem.n * geom.groups
            + operations_time(operations, problem.device)
        )


VMAP = register_strategy(Vmap())
