"""``"loop"``: torch's own weight-gradient kernel, one sample at a time.

The per-sample gradient of sample n is the summed weight gradient of a batch of one,
so ATen's ``convolution_backward`` (oneDNN's or ATen's native kernel on the CPU, cuDNN
on a GPU), asked for the weight gradient only, is called on ``x[n:n+1]`` and
``g[n:n+1]`` for each n and its result written into the per-sample tensor (or added
into the summed one): the "naive" per-example loop that Rochette et al. (2019,
arXiv:1912.06015) compare against, here without a forward pass or a graph. Its
temporaries are one sample's; on the CPU the kernel is the fastest of the registered
strategies where positions are many and channels few (early layers, large images),
and its cost is one kernel call per sample, which dominates for small layers, and its
number of tensor operations grows with N: it is not ``batched``. ``"auto"`` takes it
where the device's calibration prices it, the per-operation cost of its 2 + 5N
operations included, below the best batched strategy by more than
:data:`memconv.strategies.base.UNBATCHED_MARGIN` (on a CPU: large maps, few channels;
on a GPU each of those operations is a kernel launch, and the batched strategies
win); ``"streaming"`` does not run it on its tiles.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .._torch import tracing
from .base import Options, Problem, numel, register_strategy
from .costs import operations_time, scale_memory, time_rates
from .geometry import ConvGeometry, convolution_backward


def native_path(geom: ConvGeometry, size: tuple[int, ...], itemsize: int) -> bool:
    """Whether ATen computes one sample's weight gradient on the CPU with its native
    im2col kernel rather than oneDNN's (``ConvParams::use_mkldnn`` in ATen's
    ``Convolution.cpp``, torch 2.x: oneDNN takes every half-precision batch on CPUs
    that support it, taken for granted here, and a float32 batch of one only if
    grouped, with kernels over 3×3, or with more than 20480 input elements in its first
    four dimensions; float64 never). A single-threaded process runs unstrided 1×1
    convolutions natively too, which this ignores.

    Args:
        geom: the normal-form geometry.
        size: the normal-form input's spatial size.
        itemsize: bytes per element (2: half precision, 4: float32, 8: float64).
    """
    if itemsize != 4:
        return itemsize > 4
    if geom.groups > 1:
        return False
    k = geom.kernel_size
    if geom.dims >= 2 and k[-1] > 3 and k[-2] > 3:
        return False
    # the input as ATen sees it: [1, C, *S], a 1-d one viewed as [1, C, 1, L]
    first = geom.in_channels * numel(size[:1] if geom.dims == 1 else size[:2])
    return first <= 20480


class Loop:
    """Weight VJP by one call of torch's convolution backward kernel per sample; a
    summed result adds the samples' gradients up as they come."""

    name: ClassVar[str] = "loop"
    options: ClassVar[frozenset[str]] = frozenset()
    composite: ClassVar[bool] = False
    batched: ClassVar[bool] = False

    def vjp(self, x, g, geom, *, per_sample, options, out=None) -> Tensor:
        # the kernel reads only the weight's shape and dtype for a weight gradient
        weight = x.new_zeros(geom.weight_shape)
        n = x.shape[0]
        if out is not None:
            result = out
        elif per_sample:
            result = x.new_empty((n, *geom.weight_shape))
        else:
            result = x.new_zeros(geom.weight_shape)
        if per_sample and out is None and tracing():
            # a traced step: the samples' gradients stacked, not written one by one into
            # a buffer, which the compiler would copy whole at every write
            return torch.stack(
                [
                    convolution_backward(
                        x[i : i + 1], weight, g[i : i + 1], geom, weight_grad=True
                    )[1]
                    for i in range(n)
                ]
            )
        for i in range(n):
            _, grad, _ = convolution_backward(
                x[i : i + 1], weight, g[i : i + 1], geom, weight_grad=True
            )
            if per_sample and out is None:
                result[i].copy_(grad)
            else:  # a summed result, or adding into `out`
                (result[i] if per_sample else result).add_(grad)
            del grad
        return result

    def memory(self, problem: Problem, options: Options) -> int:
        geom, itemsize = problem.geom, problem.itemsize
        # the zero weight and one sample's gradient, and the kernel's workspace for one
        # sample: its im2col matrix on ATen's native path, else oneDNN's reorders
        if native_path(geom, problem.size, itemsize):
            workspace = geom.in_per_group * geom.kernel_numel * problem.positions
        else:
            workspace = (
                geom.in_channels * numel(problem.size) + geom.out_channels * problem.positions
            )
        nbytes = (2 * numel(geom.weight_shape) + workspace) * itemsize  # adds into `out` in place
        return scale_memory("loop", problem.device, nbytes)

    def time(self, problem: Problem, options: Options) -> float:
        # seconds per multiply-add (on ATen's native path, 2-d or 3-d, or oneDNN's), per
        # element of the operands, per element of the per-sample gradients (written,
        # then copied or added) and per kernel call; a depthwise layer's weight
        # gradient (one input channel per group) runs a kernel of its own, priced by
        # its own rate per multiply-add and per call (on CPU about 1 ns and 50 µs: two
        # orders of magnitude above a dense layer's)
        rate = time_rates("loop", problem.device)
        geom = problem.geom
        native = native_path(geom, problem.size, problem.itemsize)
        call = rate["per_call"]
        if geom.groups > 1 and geom.in_per_group == 1:
            per_flop, call = rate["per_flop_depthwise"], call + rate["per_call_depthwise"]
        elif native:
            per_flop = rate["per_flop_native_3d" if geom.dims == 3 else "per_flop_native"]
        else:
            per_flop = rate["per_flop_onednn"]
        per_result = rate["per_result_native" if native else "per_result_onednn"]
        operands = problem.input_elements() + problem.grad_elements()
        return (
            per_flop * problem.flops()
            + rate["per_operand"] * operands
            + per_result * problem.per_sample_elements()
            + call * problem.n
            + operations_time(2 + 5 * problem.n, problem.device)
        )


LOOP = register_strategy(Loop())
