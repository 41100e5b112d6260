"""A parameter used elementwise by the batch: ``x + w``, ``x * w``, ``x.mul_(w)``, and a
parameter expanded along the batch and concatenated with it (a class token).

No layer of torch's computes these, so their shells are types of their own with their
own rules: :class:`Broadcast` (a position embedding, layer scale, a bias added in a
parent, timm's ``skipinit_gain``) and :class:`Concat` (ViT's class token). Per-sample
gradients are the output gradient (times ``x`` for a product), summed over the axes
the parameter is broadcast along.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .._torch import saved_self
from .base import LayerRule
from .operations import BoundOp, register_op, register_shell, with_params


def _reduce(g: Tensor, shape: tuple) -> Tensor | None:
    """``g [N, ...]`` summed to ``[N, *shape]`` over the axes ``shape`` is broadcast
    along (None if ``shape`` is not broadcast along the batch axis)."""
    padded = (1,) * (g.dim() - len(shape)) + tuple(shape)
    if len(padded) != g.dim() or padded[0] != 1:
        return None
    axes = tuple(i for i in range(1, g.dim()) if padded[i] == 1 and g.shape[i] != 1)
    out = g.sum(axes, keepdim=True) if axes else g
    return out.reshape(g.shape[0], *shape)


class Broadcast(nn.Module):
    """The shell of a broadcast elementwise use of a parameter: ``x + weight``
    (:class:`BroadcastRule`, ``scale=False``) or ``x * weight`` (``scale=True``)."""

    def __init__(self, scale: bool):
        super().__init__()
        self.scale = scale
        self.weight = None


@register_shell(Broadcast)
class BroadcastRule(LayerRule):
    """``x + w`` and ``x * w`` with ``w`` broadcast along the batch axis: per-sample
    gradients ``g`` (or ``g·x``) summed over the axes ``w`` is broadcast along."""

    def grad_sample(self, module, inputs, grad_output):
        w = module.weight
        if w is None or not w.requires_grad:
            return {}
        g = grad_output
        if module.scale:
            g = g * inputs[0].to(g.dtype)
        return {"weight": _reduce(g, tuple(w.shape))}

    def describes(self, module, data, output):
        return broadcast_ok(data, module.weight, output)


def broadcast_ok(data: Tensor, weight: Tensor, out: Tensor) -> bool:
    """Whether ``weight`` is broadcast along ``out``'s first axis and ``data`` is not
    (the call a :class:`BroadcastRule` describes, batch axis first)."""
    if weight.dim() > out.dim() or data.dim() != out.dim():
        return False
    padded = (1,) * (out.dim() - weight.dim()) + tuple(weight.shape)
    return out.dim() > 0 and padded[0] == 1 and data.shape[0] == out.shape[0]


def _bind_elementwise(args, kwargs, scale: bool) -> BoundOp | None:
    if kwargs or len(args) != 2 or not all(isinstance(t, Tensor) for t in args):
        return None
    x, w = args
    # which of the two is the parameter is told by the recorder: both orders bound
    return BoundOp(x, {"weight": w}, lambda params: with_params(Broadcast(scale), params))


@register_op(torch.add, Tensor.add, symmetric=True)
def bind_add(args, kwargs) -> BoundOp | None:
    """``x + w``: the data first (the recorder orders the two)."""
    return _bind_elementwise(args, kwargs, scale=False)


@register_op(torch.mul, Tensor.mul, symmetric=True)
def bind_mul(args, kwargs) -> BoundOp | None:
    """``x * w``: the data first (the recorder orders the two)."""
    return _bind_elementwise(args, kwargs, scale=True)


@register_op(Tensor.mul_)
def bind_mul_in_place(args, kwargs) -> BoundOp | None:
    """``x.mul_(w)`` (timm's NF blocks: ``x.mul_(self.skipinit_gain)``): the broadcast
    product, its data the value of ``x`` before the call, the copy autograd saved of it
    for ``w``'s gradient."""
    bound = _bind_elementwise(args, kwargs, scale=True)
    if bound is None or args[0].shape != torch.broadcast_shapes(*(a.shape for a in args)):
        return None
    return BoundOp(bound.data, bound.slots, bound.shell, before=saved_self)


class Concat(nn.Module):
    """The shell of a parameter expanded along the batch axis and concatenated with
    the batch (a class token): ``weight`` fills ``length`` positions from ``start``
    along axis ``dim`` of the output (:class:`ConcatRule`)."""

    def __init__(self, dim: int, start: int, length: int):
        super().__init__()
        self.dim, self.start, self.length = dim, start, length
        self.weight = None


@register_shell(Concat)
class ConcatRule(LayerRule):
    """Per-sample gradients: the output gradient's slice of the parameter, summed over
    the axes the parameter is broadcast along."""

    def grad_sample(self, module, inputs, grad_output):
        w = module.weight
        if w is None or not w.requires_grad:
            return {}
        g = grad_output.narrow(module.dim, module.start, module.length)
        return {"weight": _reduce(g, tuple(w.shape))}


def _cat_args(args: tuple, kwargs: dict) -> tuple[list, int] | None:
    """``(tensors, dim)`` of a ``torch.cat`` call, None for another signature."""
    if len(args) == 1 and set(kwargs) <= {"dim"}:
        tensors, dim = args[0], kwargs.get("dim", 0)
    elif len(args) == 2 and not kwargs:
        tensors, dim = args
    else:
        return None
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int) or len(tensors) < 2:
        return None
    if not all(isinstance(t, Tensor) for t in tensors):
        return None
    return list(tensors), dim


@register_op(torch.cat, expansion=True)
def bind_cat(args: tuple, kwargs: dict, expanded: Callable) -> BoundOp | None:
    """The :class:`BoundOp` of ``torch.cat(tensors, dim)`` where one tensor is a
    parameter-only tensor expanded along the first axis (``expanded(t)``: the tensor
    ``t`` was expanded from, or None) and another carries the batch."""
    found = _cat_args(args, kwargs)
    if found is None:
        return None
    tensors, dim = found
    ndim = tensors[0].dim()
    dim = dim + ndim if dim < 0 else dim
    if dim <= 0 or any(t.dim() != ndim for t in tensors):
        return None
    sources = [(i, expanded(t)) for i, t in enumerate(tensors) if expanded(t) is not None]
    if len(sources) != 1:
        return None
    i, source = sources[0]
    data = next(t for j, t in enumerate(tensors) if j != i)
    start = sum(t.shape[dim] for t in tensors[:i])
    length = tensors[i].shape[dim]

    def shell(params):
        return with_params(Concat(dim, start, length), params)

    return BoundOp(data, {"weight": source}, shell, via={"weight": tensors[i]})
