"""``Linear``, with or without sequence axes (``[N, *, in]``), as a module and as
``F.linear``.

Per-sample gradients ``gᵀa`` summed over the sequence; squared norms ``‖g‖²·‖a‖²``
without a sequence axis, else ghost norms over the sequence (``⟨aaᵀ, ggᵀ⟩``,
Goodfellow 2015; Li et al. 2022) or the instantiated gradients when 2L² > in·out.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ..conv.norm_routes import sq_norms
from .base import LayerRule, register, rule_settings, trainable
from .operations import BoundOp, bind_args, new_layer, register_op, with_params


def _flat(x, g):
    if x.dtype != g.dtype:
        x = x.to(g.dtype)
    n, length = x.shape[0], math.prod(x.shape[1:-1])  # explicit: L or the features may be 0
    return x.reshape(n, length, x.shape[-1]), g.reshape(n, length, g.shape[-1])  # [N, L, in/out]


@register(nn.Linear)
class LinearRule(LayerRule):
    """``y = x Wᵀ + b`` over the last axis."""

    movable_batch_axis = True

    def grad_sample(self, module, inputs, grad_output):
        x2, g2 = _flat(inputs[0], grad_output)
        out = {}
        if trainable(module, "weight"):
            if x2.shape[1] == 1:  # an outer product: a broadcast product beats bmm
                out["weight"] = g2.transpose(1, 2) * x2  # [N, out, in]
            else:
                out["weight"] = g2.transpose(1, 2) @ x2  # [N, out, in]
        if trainable(module, "bias"):
            out["bias"] = g2.sum(1)  # [N, out]
        return out

    def sq_norms(self, module, inputs, grad_output):
        x2, g2 = _flat(inputs[0], grad_output)
        length = x2.shape[1]
        route = rule_settings().norm_route
        out = {}
        if trainable(module, "weight"):
            if length == 1:  # an outer product: ‖g aᵀ‖ = ‖g‖·‖a‖
                out["weight"] = g2.pow(2).sum((1, 2)) * x2.pow(2).sum((1, 2))
            elif route == "ghost" or (route is None and 2 * length**2 < x2.shape[2] * g2.shape[2]):
                ga = x2 @ x2.transpose(1, 2)  # [N, L, L]
                gb = g2 @ g2.transpose(1, 2)
                out["weight"] = (ga * gb).sum((1, 2))
            else:
                out["weight"] = sq_norms(g2.transpose(1, 2) @ x2)
        if trainable(module, "bias"):
            out["bias"] = g2.sum(1).pow(2).sum(1)
        return out

    def summed_grad(self, module, inputs, grad_output):
        x = inputs[0].to(grad_output.dtype)
        x2, g2 = x.flatten(0, -2), grad_output.flatten(0, -2)  # [N·L, in/out]
        out = {}
        if trainable(module, "weight"):
            out["weight"] = g2.transpose(0, 1) @ x2
        if trainable(module, "bias"):
            out["bias"] = g2.sum(0)
        return out

    def memory(self, module, input_shapes, itemsize, task):
        n = input_shapes[0][0]
        params = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        return n * params * itemsize


@register_op(F.linear)
def bind_linear(args, kwargs) -> BoundOp | None:
    """``F.linear``: the shell is the ``nn.Linear`` of the weight's shape."""
    a = bind_args(("input", "weight", "bias"), args, kwargs, {"bias": None}, ("input", "weight"))
    if a is None or a["weight"].dim() != 2:
        return None
    if not (a["bias"] is None or isinstance(a["bias"], Tensor)):
        return None
    w = a["weight"]

    def shell(params):
        layer = new_layer(nn.Linear, w.shape[1], w.shape[0], bias=a["bias"] is not None)
        return with_params(layer, params)

    return BoundOp(a["input"], {"weight": w, "bias": a["bias"]}, shell)
