"""``"unfold"``: im2col followed by one batched matrix product, as Opacus does.

The input patches are gathered into the unfolded input ``[N, G, C_in/G·K, T]``
(K = prod(k) kernel offsets, T output positions), and the per-sample gradient is
``g @ unfold(x)^T`` per sample and group (Opacus' ``compute_conv_grad_sample``;
torch's ExpandedWeights do the same). The unfolded input, N·C_in·K·T elements, is
its extra memory.
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
from .costs import operations_time, scale_memory, spilled_time, time_rates
from .geometry import ConvGeometry


def unfold_input(x: Tensor, geom: ConvGeometry, t: tuple[int, ...]) -> Tensor:
    """The unfolded (im2col) input ``[N, G, C_in/G·K, T]`` of a normal-form input.

    Args:
        x: normal-form input ``[N, C_in, *S]``.
        geom: the geometry.
        t: the output spatial size T.

    Returns:
        A new tensor, channel-major then kernel offset, as ``torch.nn.Unfold``.
    """
    xp = pad_input(x, geom.padding)  # [N, C_in, *(S + 2p)]
    n = xp.shape[0]
    s_n, s_c, *s_sp = xp.stride()
    # view [N, G, C_in/G, *k, *T] of the padded input: no copy yet
    shape = (n, geom.groups, geom.in_per_group, *geom.kernel_size, *t)
    strides = (
        s_n,
        geom.in_per_group * s_c,
        s_c,
        *(d * s for d, s in zip(geom.dilation, s_sp)),
        *(st * s for st, s in zip(geom.stride, s_sp)),
    )
    patches = xp.as_strided(shape, strides, xp.storage_offset())
    # the copy: [N, G, C_in/G·K, T]
    return patches.reshape(n, geom.groups, geom.in_per_group * geom.kernel_numel, numel(t))


class Unfold:
    """Weight VJP by im2col and a batched matrix product (Opacus' convention)."""

    name: ClassVar[str] = "unfold"
    options: ClassVar[frozenset[str]] = frozenset()
    composite: ClassVar[bool] = False

    def vjp(self, x, g, geom, *, per_sample, options, out=None) -> Tensor:
        n, t = x.shape[0], tuple(g.shape[2:])
        cols = unfold_input(x, geom, t)  # [N, G, C_in/G·K, T]
        gm = g.reshape(n, geom.groups, geom.out_per_group, numel(t))  # [N, G, C_out/G, T]
        if per_sample:
            # [N, G, C_out/G, C_in/G·K] -> [N, C_out, C_in/G, *k]
            grad = torch.matmul(gm, cols.transpose(-1, -2)).reshape(n, *geom.weight_shape)
        else:
            grad = torch.einsum("ngot,ngkt->gok", gm, cols).reshape(geom.weight_shape)
        if out is None:
            return grad
        return out.add_(grad)

    def memory(self, problem: Problem, options: Options) -> int:
        geom, n = problem.geom, problem.n
        padded = n * geom.in_channels * numel(padded_size(geom, problem.size))
        padded = padded if any(geom.padding) else 0
        cols = n * geom.in_channels * geom.kernel_numel * problem.positions
        if problem.per_sample:
            # the padded copy is gone by the time the result is allocated
            result = n * numel(geom.weight_shape)
            nbytes = (cols + max(padded - result, 0)) * problem.itemsize + problem.held()
            return scale_memory("unfold", problem.device, nbytes)
        # einsum over (n, t) permutes both operands into contiguous copies
        extra = padded + 2 * cols + n * geom.out_channels * problem.positions
        return scale_memory("unfold", problem.device, extra * problem.itemsize + problem.held())

    def time(self, problem: Problem, options: Options) -> float:
        geom, n = problem.geom, problem.n
        cols = n * geom.in_channels * geom.kernel_numel * problem.positions
        # writing the unfolded input costs about twice reading it (fresh pages)
        traffic = 3 * cols + problem.grad_elements()
        if problem.per_sample:  # one small matrix product per sample and group
            traffic += problem.per_sample_elements()
            calls, working = n * geom.groups, cols
        else:  # the einsum's contiguous copies of both operands, one product per group
            traffic += 2 * (cols + problem.grad_elements()) + problem.result_elements
            calls, working = geom.groups, 2 * cols
        rates = time_rates("unfold", problem.device)
        if problem.per_sample:
            flop, element = rates["per_flop"], rates["per_element"]
        else:  # the einsum's product contracts over N·T: a shape with rates of its own
            flop, element = rates["per_flop_summed"], rates["per_element_summed"]
        time = linear_time((flop, element, rates["per_call"]), problem.flops(), traffic, calls)
        # an unfolded input larger than the last-level cache is written to and read
        # back from memory: each element moved costs more (measured on the CPU: a
        # 3x3 layer of 64 channels at 32x32 took 4.3 ms at N = 8, 21 ms at N = 16)
        time += spilled_time("unfold", working * problem.itemsize, traffic, problem.device)
        ops = 6 + (1 if any(geom.padding) else 0)
        return time + operations_time(ops, problem.device)


UNFOLD = register_strategy(Unfold())
