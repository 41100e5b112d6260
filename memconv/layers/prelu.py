"""``PReLU``: ``∂y/∂a = min(x, 0)``, summed per sample over the positions the slope
is shared along (all of them for one slope, else all but the channel axis 1)."""

from __future__ import annotations

from torch import nn

from .base import LayerRule, register


@register(nn.PReLU)
class PReLURule(LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        if not module.weight.requires_grad:
            return {}
        g = grad_output
        part = g * inputs[0].to(g.dtype).clamp(max=0)
        if module.num_parameters == 1:
            return {"weight": part.flatten(1).sum(1, keepdim=True)}
        axes = tuple(range(2, part.dim()))
        return {"weight": part.sum(axes) if axes else part}
