"""Rules for operations: the functional calls a parameter reaches, whatever module makes them.

A module rule is found by the layer's type; an **operation rule** by the function a
forward pass calls (``F.conv2d``, ``F.linear``, ``F.layer_norm``, ``F.group_norm``,
``F.batch_norm`` with running statistics, ``F.instance_norm``, ``F.rms_norm``,
``F.embedding``, and the broadcast ``add``
and ``mul`` of a parameter: a position embedding, layer scale, a bias added in a
parent; ``mul_`` in place, its data the value autograd saved). It binds the call's arguments into the *data* argument (the one carrying
the batch) and the *parameter slots* (weight, bias), and builds a **shell**: a layer
of the type whose module rule computes exactly what the call computes, holding the
slots' tensors as its parameters. The module rule then serves the call (every
convolution strategy, ghost norms, book-keeping), so an operation and its module
share one implementation.

The tensors in the slots may be parameters or functions of parameters alone (a
standardised weight, ``weight_norm``); :mod:`memconv.engine.coverage` proves that on the
autograd graph, and :class:`memconv.engine.calls.OpCall` chains the per-sample gradients through
that function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import LayerRule, find_rule


@dataclass(frozen=True)
class BoundOp:
    """One call of an operation with a rule, its arguments sorted.

    Attributes:
        data: the argument carrying the batch.
        slots: ``{shell parameter name: tensor or None}`` of the parameter arguments.
        shell: builds the shell layer from ``{name: parameter or None}`` (the slots'
            tensors wrapped as parameters, trainable where they depend on trainable
            parameters).
        via: ``{slot: tensor}`` where the call receives not the slot's tensor but a
            tensor computed from it (a class token expanded to the batch).
        before: for an in-place call, ``before(out)``: the data argument's value
            before the call (None if it cannot be told); the rule needs that value.
    """

    data: Tensor
    slots: dict
    shell: Callable[[dict], nn.Module]
    via: dict | None = None
    before: Callable[[Tensor], Tensor | None] | None = None


def _fill(names: tuple, args: tuple, kwargs: dict, defaults: dict) -> dict | None:
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    out = dict(defaults)
    out.update(zip(names, args))
    out.update(kwargs)
    return out if all(n in out for n in names) else None


def _set(shell: nn.Module, params: dict) -> nn.Module:
    for k, p in params.items():
        setattr(shell, k, p)
    return shell


_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
_CONV_T_DEFAULTS = {**_CONV_DEFAULTS, "output_padding": 0}
_CONV_TYPES = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T_TYPES = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _bind_conv(args, kwargs):
    a = _fill(_CONV, args, kwargs, _CONV_DEFAULTS)
    if a is None or not isinstance(a["weight"], Tensor) or a["input"].dim() != a["weight"].dim():
        return None
    w, groups = a["weight"], a["groups"]
    kind = _CONV_TYPES.get(w.dim() - 2)
    if kind is None:
        return None

    def shell(params):
        layer = kind(
            w.shape[1] * groups, w.shape[0], tuple(w.shape[2:]), stride=a["stride"],
            padding=a["padding"], dilation=a["dilation"], groups=groups,
            bias=a["bias"] is not None, device="meta",
        )  # fmt: skip
        return _set(layer, params)

    return BoundOp(a["input"], {"weight": w, "bias": a["bias"]}, shell)


def _bind_conv_t(args, kwargs):
    a = _fill(_CONV_T, args, kwargs, _CONV_T_DEFAULTS)
    if a is None or not isinstance(a["weight"], Tensor) or a["input"].dim() != a["weight"].dim():
        return None
    w, groups = a["weight"], a["groups"]
    kind = _CONV_T_TYPES.get(w.dim() - 2)
    if kind is None:
        return None

    def shell(params):
        layer = kind(
            w.shape[0], w.shape[1] * groups, tuple(w.shape[2:]), stride=a["stride"],
            padding=a["padding"], output_padding=a["output_padding"], groups=groups,
            bias=a["bias"] is not None, dilation=a["dilation"], device="meta",
        )  # fmt: skip
        return _set(layer, params)

    return BoundOp(a["input"], {"weight": w, "bias": a["bias"]}, shell)


def _bind_linear(args, kwargs):
    a = _fill(("input", "weight", "bias"), args, kwargs, {"bias": None})
    if a is None or not isinstance(a["weight"], Tensor) or a["weight"].dim() != 2:
        return None
    w = a["weight"]

    def shell(params):
        layer = nn.Linear(w.shape[1], w.shape[0], bias=a["bias"] is not None, device="meta")
        return _set(layer, params)

    return BoundOp(a["input"], {"weight": w, "bias": a["bias"]}, shell)


def _bind_layer_norm(args, kwargs):
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    a = _fill(names, args, kwargs, {"weight": None, "bias": None, "eps": 1e-5})
    if a is None:
        return None

    def shell(params):
        layer = nn.LayerNorm(a["normalized_shape"], eps=a["eps"], device="meta")
        return _set(layer, params)

    return BoundOp(a["input"], {"weight": a["weight"], "bias": a["bias"]}, shell)


def _bind_group_norm(args, kwargs):
    names = ("input", "num_groups", "weight", "bias", "eps")
    a = _fill(names, args, kwargs, {"weight": None, "bias": None, "eps": 1e-5})
    if a is None or a["input"].dim() < 2:
        return None

    def shell(params):
        layer = nn.GroupNorm(a["num_groups"], a["input"].shape[1], eps=a["eps"], device="meta")
        return _set(layer, params)

    return BoundOp(a["input"], {"weight": a["weight"], "bias": a["bias"]}, shell)


def _bind_rms_norm(args, kwargs):
    names = ("input", "normalized_shape", "weight", "eps")
    a = _fill(names, args, kwargs, {"weight": None, "eps": None})
    if a is None or not hasattr(nn, "RMSNorm"):
        return None

    def shell(params):
        layer = nn.RMSNorm(a["normalized_shape"], eps=a["eps"], device="meta")
        return _set(layer, params)

    return BoundOp(a["input"], {"weight": a["weight"]}, shell)


def _bind_instance_norm(args, kwargs):
    names = (
        "input", "running_mean", "running_var", "weight", "bias", "use_input_stats",
        "momentum", "eps",
    )  # fmt: skip
    defaults = {
        "running_mean": None, "running_var": None, "weight": None, "bias": None,
        "use_input_stats": True, "momentum": 0.1, "eps": 1e-5,
    }  # fmt: skip
    a = _fill(names, args, kwargs, defaults)
    if a is None or a["input"].dim() < 3 or a["input"].dim() > 5:
        return None
    stats = not a["use_input_stats"]
    if stats and (a["running_mean"] is None or a["running_var"] is None):
        return None
    kind = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}[a["input"].dim()]

    def shell(params):
        # the statistics of each sample, or the running ones (the shell never updates them)
        layer = kind(
            a["input"].shape[1], eps=a["eps"], affine=True, track_running_stats=stats,
            device="meta",
        )  # fmt: skip
        if stats:
            layer.running_mean = a["running_mean"].detach()
            layer.running_var = a["running_var"].detach()
        return _set(layer.train(not stats), params)

    return BoundOp(a["input"], {"weight": a["weight"], "bias": a["bias"]}, shell)


def _bind_batch_norm(args, kwargs):
    names = (
        "input",
        "running_mean",
        "running_var",
        "weight",
        "bias",
        "training",
        "momentum",
        "eps",
    )
    defaults = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
    a = _fill(names, args, kwargs, defaults)
    # in training mode, or without running statistics, batch norm mixes the samples
    if a is None or a["training"] or a["running_mean"] is None or a["running_var"] is None:
        return None
    if a["input"].dim() < 2:
        return None

    def shell(params):
        layer = nn.BatchNorm2d(a["input"].shape[1], eps=a["eps"], device="meta").eval()
        layer.running_mean = a["running_mean"].detach()
        layer.running_var = a["running_var"].detach()
        return _set(layer, params)

    return BoundOp(a["input"], {"weight": a["weight"], "bias": a["bias"]}, shell)


def _bind_embedding(args, kwargs):
    names = (
        "input",
        "weight",
        "padding_idx",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "sparse",
    )
    defaults = {
        "padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False,
        "sparse": False,
    }  # fmt: skip
    a = _fill(names, args, kwargs, defaults)
    # max_norm renormalises the weight in place; scale_grad_by_freq mixes the samples
    if a is None or a["max_norm"] is not None or a["scale_grad_by_freq"]:
        return None
    w = a["weight"]
    if not isinstance(w, Tensor) or w.dim() != 2:
        return None

    def shell(params):
        layer = nn.Embedding(w.shape[0], w.shape[1], padding_idx=a["padding_idx"], device="meta")
        return _set(layer, params)

    return BoundOp(a["input"], {"weight": w}, shell)


class Broadcast(nn.Module):
    """The shell of a broadcast elementwise use of a parameter: ``x + weight``
    (:class:`BroadcastRule`, ``scale=False``) or ``x * weight`` (``scale=True``)."""

    def __init__(self, scale: bool):
        super().__init__()
        self.scale = scale
        self.weight = None


def _bind_elementwise(scale: bool):
    def bind(args, kwargs):
        if kwargs or len(args) != 2 or not all(isinstance(t, Tensor) for t in args):
            return None
        x, w = args
        # which of the two is the parameter is told by the recorder: both orders bound
        return BoundOp(x, {"weight": w}, lambda params: _set(Broadcast(scale), params))

    return bind


def _saved_self(out: Tensor) -> Tensor | None:
    """The first factor of ``x.mul_(w)`` before the call: the copy autograd saved of it
    for ``w``'s gradient (``grad_fn._saved_self``, documented in torch's "Autograd
    mechanics", saved tensors), None where there is none."""
    node = out.grad_fn
    if node is None or type(node).__name__ != "MulBackward0":
        return None
    try:
        saved = node._saved_self
    except RuntimeError:  # freed, or not saved
        return None
    if not isinstance(saved, Tensor) or saved.shape != out.shape or saved.dtype != out.dtype:
        return None
    return saved


def _bind_mul_in_place(args, kwargs):
    """``x.mul_(w)`` (timm's NF blocks: ``x.mul_(self.skipinit_gain)``): the broadcast
    product, its data the value of ``x`` before the call."""
    bound = _bind_elementwise(True)(args, kwargs)
    if bound is None or args[0].shape != torch.broadcast_shapes(*(a.shape for a in args)):
        return None
    return BoundOp(bound.data, bound.slots, bound.shell, before=_saved_self)


def _reduce(g: Tensor, shape: tuple) -> Tensor | None:
    """``g [N, ...]`` summed to ``[N, *shape]`` over the axes ``shape`` is broadcast
    along (None if ``shape`` is not broadcast along the batch axis)."""
    padded = (1,) * (g.dim() - len(shape)) + tuple(shape)
    if len(padded) != g.dim() or padded[0] != 1:
        return None
    axes = tuple(i for i in range(1, g.dim()) if padded[i] == 1 and g.shape[i] != 1)
    out = g.sum(axes, keepdim=True) if axes else g
    return out.reshape(g.shape[0], *shape)


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

    def summed_grad(self, module, inputs, grad_output):
        return {k: v.sum(0) for k, v in self.grad_sample(module, inputs, grad_output).items()}


def broadcast_ok(data: Tensor, weight: Tensor, out: Tensor) -> bool:
    """Whether ``weight`` is broadcast along ``out``'s first axis and ``data`` is not
    (the call a :class:`BroadcastRule` describes, batch axis first)."""
    if weight.dim() > out.dim() or data.dim() != out.dim():
        return False
    padded = (1,) * (out.dim() - weight.dim()) + tuple(weight.shape)
    return out.dim() > 0 and padded[0] == 1 and data.shape[0] == out.shape[0]


class Concat(nn.Module):
    """The shell of a parameter expanded along the batch axis and concatenated with
    the batch (a class token): ``weight`` fills ``length`` positions from ``start``
    along axis ``dim`` of the output (:class:`ConcatRule`)."""

    def __init__(self, dim: int, start: int, length: int):
        super().__init__()
        self.dim, self.start, self.length = dim, start, length
        self.weight = None


class ConcatRule(LayerRule):
    """Per-sample gradients: the output gradient's slice of the parameter, summed over
    the axes the parameter is broadcast along."""

    def grad_sample(self, module, inputs, grad_output):
        w = module.weight
        if w is None or not w.requires_grad:
            return {}
        g = grad_output.narrow(module.dim, module.start, module.length)
        return {"weight": _reduce(g, tuple(w.shape))}

    def summed_grad(self, module, inputs, grad_output):
        return {k: v.sum(0) for k, v in self.grad_sample(module, inputs, grad_output).items()}


def bind_cat(args: tuple, kwargs: dict, expanded: Callable) -> BoundOp | None:
    """The :class:`BoundOp` of ``torch.cat(tensors, dim)`` where one tensor is a
    parameter-only tensor expanded along the first axis (``expanded(t)``: the tensor
    ``t`` was expanded from, or None) and another carries the batch."""
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
    ndim = tensors[0].dim()
    dim = dim + ndim if dim < 0 else dim
    if dim <= 0 or any(t.dim() != ndim for t in tensors):
        return None
    found = [(i, expanded(t)) for i, t in enumerate(tensors) if expanded(t) is not None]
    if len(found) != 1:
        return None
    i, source = found[0]
    data = next(t for j, t in enumerate(tensors) if j != i)
    start = sum(t.shape[dim] for t in tensors[:i])
    length = tensors[i].shape[dim]
    return BoundOp(
        data, {"weight": source}, lambda params: _set(Concat(dim, start, length), params),
        via={"weight": tensors[i]},
    )  # fmt: skip


#: ``{function: binder}`` of the operations with a rule: a binder returns the
#: :class:`BoundOp` of a call, or None for a call the rule does not describe.
OPS: dict = {
    torch.conv1d: _bind_conv,
    torch.conv2d: _bind_conv,
    torch.conv3d: _bind_conv,
    torch.conv_transpose1d: _bind_conv_t,
    torch.conv_transpose2d: _bind_conv_t,
    torch.conv_transpose3d: _bind_conv_t,
    F.linear: _bind_linear,
    F.layer_norm: _bind_layer_norm,
    F.group_norm: _bind_group_norm,
    F.batch_norm: _bind_batch_norm,
    F.instance_norm: _bind_instance_norm,
    F.rms_norm: _bind_rms_norm,
    F.embedding: _bind_embedding,
    torch.add: _bind_elementwise(False),
    Tensor.add: _bind_elementwise(False),
    torch.mul: _bind_elementwise(True),
    Tensor.mul: _bind_elementwise(True),
    Tensor.mul_: _bind_mul_in_place,
}

#: The rules of the shells that are no layer of torch's (kept out of the registry of
#: layer types, :func:`memconv.layers.registered`).
_SHELL_RULES: dict = {Broadcast: BroadcastRule(), Concat: ConcatRule()}


def shell_rule(shell: nn.Module) -> LayerRule | None:
    """The rule serving an operation call through its shell layer."""
    return _SHELL_RULES.get(type(shell)) or find_rule(shell)


#: The operations whose parameter may be either argument.
SYMMETRIC = frozenset({torch.add, Tensor.add, torch.mul, Tensor.mul})


def bind_op(func, args: tuple, kwargs: dict, expanded: Callable) -> BoundOp | None:
    """The :class:`BoundOp` of a call of ``func``, or None if no rule describes it
    (``expanded``: see :func:`bind_cat`)."""
    if func is torch.cat:
        return bind_cat(args, kwargs or {}, expanded)
    binder = OPS.get(func)
    if binder is None:
        return None
    try:
        return binder(args, kwargs or {})
    except (TypeError, ValueError, AttributeError):
        return None
