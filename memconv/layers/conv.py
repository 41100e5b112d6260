"""Convolutions and transposed convolutions (1d/2d/3d, torch's and memconv's classes),
as modules and as operations (``F.conv*d``, ``F.conv_transpose*d``).

Per-sample weight gradients by the weight-VJP strategy of the calling computation
(:mod:`memconv.strategies`), squared norms by ghost norms or instantiated chunks
(:mod:`memconv.conv.norm_routes`), summed gradients by torch's own kernel; bias gradients as the
output gradient summed over space.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..conv.grads import bias_grad, conv_weight_grad, summed_weight_grad
from ..conv.memory import predict_memory
from ..conv.norm_routes import (
    conv_channel_stats,
    conv_route_problem,
    conv_weight_sq_norms,
    decide_route,
)
from ..conv.norm_routes import sq_norms as _sq
from ..conv.settings import budgeted
from ..conv.vjp import check_settings
from ..strategies import get_strategy
from ..strategies.geometry import conv_spec, layer_output_size
from .base import LayerRule, register, rule_settings, trainable
from .operations import BoundOp, bind_args, new_layer, register_op, with_params

TYPES = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


@register(*TYPES)
class ConvRule(LayerRule):
    """``Conv*d`` and ``ConvTranspose*d``: every padding mode, stride, dilation, groups."""

    def grad_sample(self, module, inputs, grad_output):
        (x,) = inputs
        rs = rule_settings()
        settings = budgeted(rs.settings, rs.budget)
        out = {}
        if trainable(module, "weight"):
            out["weight"] = conv_weight_grad(
                module, x, grad_output, settings, per_sample=True, contiguous=rs.contiguous
            )
        if trainable(module, "bias"):
            out["bias"] = bias_grad(grad_output, per_sample=True)
        return out

    def input_axes(self, module):
        return len(module.kernel_size) + 2  # [N, C, *spatial]

    def sq_norms(self, module, inputs, grad_output):
        (x,) = inputs
        rs = rule_settings()
        out = {}
        if trainable(module, "weight"):
            out["weight"] = conv_weight_sq_norms(
                module, x, grad_output, rs.settings, rs.norm_route, rs.budget, rs.reference
            )
        if trainable(module, "bias"):
            out["bias"] = _sq(bias_grad(grad_output, per_sample=True))
        return out

    def channel_stats(self, module, inputs, grad_output, name, w_hat):
        spec = conv_spec(module)
        if name != "weight" or spec.transposed or module.padding_mode != "zeros":
            return super().channel_stats(module, inputs, grad_output, name, w_hat)
        rs = rule_settings()
        return conv_channel_stats(
            module,
            inputs[0],
            grad_output,
            w_hat,
            rs.settings,
            rs.norm_route,
            rs.budget,
            rs.reference,
        )

    def summed_grad(self, module, inputs, grad_output):
        (x,) = inputs
        out = {}
        weight, bias = trainable(module, "weight"), trainable(module, "bias")
        if weight:  # torch's own kernel: the fastest summed VJP, the bias's with it
            if x.dtype != grad_output.dtype:
                x = x.to(grad_output.dtype)
            spec = conv_spec(module)
            ops = spec.operands(x, grad_output)
            if bias and not spec.transposed:
                out["weight"], out["bias"] = summed_weight_grad(ops, module.weight, bias=True)
                return out
            out["weight"] = summed_weight_grad(ops, module.weight)
        if bias:
            out["bias"] = bias_grad(grad_output, per_sample=False)
        return out

    def memory(self, module, input_shapes, itemsize, task):
        shape = input_shapes[0]
        m = shape[0]
        rs = rule_settings()
        params = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        per_sample = m * params * itemsize  # its per-sample gradients, before stored
        if task == "grads":
            settings = budgeted(rs.settings, rs.budget)
            options = {}
            strategy = get_strategy(settings.strategy)
            for key in ("memory_budget", "tile_size", "inner"):
                value = getattr(settings.options, key)
                if value is not None and key in strategy.options:
                    options[key] = value
            return predict_memory(module, shape, settings.strategy, **options) + per_sample
        spec = conv_spec(module)
        channels = spec.geometry.in_channels if spec.transposed else spec.geometry.out_channels
        out_shape = (m, channels, *layer_output_size(spec, module, shape[2:]))
        problem, copied = conv_route_problem(
            module,
            torch.empty(shape, device="meta"),
            torch.empty(out_shape, device="meta"),
            itemsize,
        )
        room = None if rs.budget is None else max(rs.budget - copied, 1)
        decision = decide_route(problem, room, rs.settings, rs.norm_route, rs.reference)
        return copied + decision.memory

    def check_settings(self, module, settings):
        check_settings(settings, conv_spec(module).geometry)


# ------------------------------------------------------------------ operations
#: The arguments of torch's functional (transposed) convolutions, in order, and their
#: defaults.
CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV_T_ARGS = (
    "input",
    "weight",
    "bias",
    "stride",
    "padding",
    "output_padding",
    "groups",
    "dilation",
)
CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
CONV_T_DEFAULTS = {**CONV_DEFAULTS, "output_padding": 0}
_CONV_TYPES = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T_TYPES = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _conv_args(names: tuple, args, kwargs, defaults) -> dict | None:
    """The arguments of a (transposed) convolution call its shell describes."""
    a = bind_args(names, args, kwargs, defaults, tensors=("input", "weight"))
    if a is None or a["input"].dim() != a["weight"].dim() or a["weight"].dim() not in (3, 4, 5):
        return None
    if not (a["bias"] is None or isinstance(a["bias"], Tensor)):
        return None
    return a if isinstance(a["groups"], int) else None


def _bind(args, kwargs, transposed: bool) -> BoundOp | None:
    """A (transposed) convolution call: the shell is the ``nn.Conv*d`` (or
    ``nn.ConvTranspose*d``) of the call's geometry, its options the call's."""
    names, defaults, kinds = (
        (CONV_T_ARGS, CONV_T_DEFAULTS, _CONV_T_TYPES)
        if transposed
        else (CONV_ARGS, CONV_DEFAULTS, _CONV_TYPES)
    )
    a = _conv_args(names, args, kwargs, defaults)
    if a is None:
        return None
    w, groups = a["weight"], a["groups"]
    # a convolution's weight is [C_out, C_in/G, *k], a transposed one's [C_in, C_out/G, *k]
    first, second = w.shape[0], w.shape[1] * groups
    channels = (first, second) if transposed else (second, first)
    options = {k: a[k] for k in names if k not in ("input", "weight", "bias")}

    def shell(params):
        layer = new_layer(
            kinds[w.dim() - 2], *channels, tuple(w.shape[2:]), bias=a["bias"] is not None, **options
        )
        return with_params(layer, params)

    return BoundOp(a["input"], {"weight": w, "bias": a["bias"]}, shell)


@register_op(torch.conv1d, torch.conv2d, torch.conv3d)
def bind_conv(args, kwargs) -> BoundOp | None:
    """``F.conv*d``: the shell is the ``nn.Conv*d`` of the call's geometry."""
    return _bind(args, kwargs, transposed=False)


@register_op(torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d)
def bind_conv_transpose(args, kwargs) -> BoundOp | None:
    """``F.conv_transpose*d``: the shell is the ``nn.ConvTranspose*d`` of the call."""
    return _bind(args, kwargs, transposed=True)
