"""Convolution gradients from operands, and the capture of a layer's output gradient.

:func:`weight_grad` runs a weight-VJP strategy (:mod:`memconv.strategies`) on a
convolution's operands in normal form; :func:`summed_weight_grad` is torch's own
kernel (ATen's ``convolution_backward``, wrapped once here); :func:`bias_grad` sums
the output gradient over space. How each kind of layer turns these into per-sample
gradients is its rule's business (:mod:`memconv.layers`).

Also here: :func:`capture`, which makes a layer's output gradient reach a callback
during the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from torch import Tensor

from .._torch import is_view
from ..strategies import Options, get_strategy
from ..strategies.auto import AUTO
from ..strategies.geometry import Operands, conv_spec, convolution_backward
from .settings import Settings


def weight_grad(
    ops: Operands, settings: Settings, per_sample: bool, *, contiguous: bool = False
) -> Tensor:
    """Run the strategy of ``settings`` on a layer's operands.

    A ``memory_budget`` covers the copy that brought the input to normal form (if
    any): the strategy gets what is left of it.

    Args:
        ops: the operands (:meth:`memconv.strategies.geometry.ConvSpec.operands`).
        settings: strategy and options.
        per_sample: ``[N, *weight.shape]`` if True, else the sum over N.
        contiguous: the caller keeps the per-sample result in the weight's layout
            (``"auto"`` then prices a strategy returning another layout with the copy
            that makes it: :attr:`memconv.strategies.Problem.contiguous`).
    """
    geom = ops.geometry
    if ops.x.shape[0] == 0:  # an empty batch has a zero gradient
        return ops.x.new_zeros((0, *geom.weight_shape) if per_sample else geom.weight_shape)
    options = spend(settings.options, ops.copied * ops.x.element_size())
    strategy = get_strategy(settings.strategy)
    if contiguous and strategy is AUTO:
        return AUTO.vjp(ops.x, ops.g, geom, per_sample=per_sample, options=options, contiguous=True)
    return strategy.vjp(ops.x, ops.g, geom, per_sample=per_sample, options=options)


def summed_weight_grad(ops: Operands, weight: Tensor, bias: bool = False):
    """The summed weight gradient by torch's own kernel
    (:func:`memconv.strategies.geometry.convolution_backward`), from strategy operands;
    with ``bias``, ``(weight gradient, bias gradient)`` by the same one call (``ops.g``
    the layer's output gradient: not for a transposed convolution)."""
    _, w, b = convolution_backward(
        ops.x, weight, ops.g, ops.geometry, weight_grad=True, bias_grad=bias
    )
    return (w, b) if bias else w


def spend(options: Options, spent: int) -> Options:
    """``options`` with ``spent`` bytes taken off its ``memory_budget`` (at least 1 left)."""
    if not spent or options.memory_budget is None:
        return options
    return replace(options, memory_budget=max(options.memory_budget - spent, 1))


def conv_weight_grad(
    module, input: Tensor, grad_output: Tensor, settings: Settings, per_sample, *, contiguous=False
):
    """Weight gradient of a convolution or transposed convolution by a strategy.

    Args:
        module: ``Conv*d`` or ``ConvTranspose*d``.
        input: the layer's input ``[N, C, *S]``.
        grad_output: its output gradient ``[N, C', *T]``; when the dtypes differ
            (autocast), the input is cast to the output gradient's dtype, the one
            the forward pass computed in.
        settings: strategy and options.
        per_sample: ``[N, *weight.shape]`` if True, else the sum over N.
        contiguous: the per-sample result is kept in the weight's layout
            (:func:`weight_grad`).

    Returns:
        The gradient, in the output gradient's dtype.
    """
    if input.dtype != grad_output.dtype:
        input = input.to(grad_output.dtype)
    ops = conv_spec(module).operands(input, grad_output)
    return weight_grad(ops, settings, per_sample, contiguous=contiguous)


def bias_grad(g: Tensor, *, per_sample: bool) -> Tensor:
    """Bias gradient of a convolution: the output gradient summed over space (and N).

    Args:
        g: output gradient ``[N, C_out, *T]``.
        per_sample: ``[N, C_out]`` if True, else ``[C_out]``.
    """
    dims = tuple(range(2, g.dim()))
    out = g.sum(dims) if dims else g
    return out if per_sample else out.sum(0)


def capture(output: Tensor, on_grad: Callable[[Tensor], None]) -> Tensor:
    """Call ``on_grad(grad)`` with the gradient of ``output`` during the backward pass.

    A tensor hook, which autograd runs also when ``output`` is one of the inputs of
    ``torch.autograd.grad`` and also after ``output`` is modified in place (an
    in-place activation): the gradient is then the one of the value before the
    modification. An output that is a view (``InstanceNorm``'s is) is first replaced
    by a copy, since an in-place operation on a view rebuilds its graph and its
    hooks would never run.

    Returns:
        The tensor the layer should return: ``output``, or its copy.
    """
    if is_view(output):
        output = output.clone()

    def hook(grad):
        on_grad(grad)  # the gradient itself passes on unchanged

    output.register_hook(hook)
    return output
