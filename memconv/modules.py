"""Extended convolution modules whose backward runs memconv's strategies.

``memconv.Conv1d``/``Conv2d``/``Conv3d`` subclass the torch classes (same
constructor, same ``state_dict`` keys). Their forward is torch's; their backward
computes the input gradient with the transposed convolution and the weight
gradient once, with the active strategy:

- inside :class:`memconv.per_sample`, the strategy computes per-sample gradients,
  which are stored as ``param.grad_batch`` ``[N, *param.shape]``; their sum is what
  the pass adds to ``param.grad`` (no second weight-gradient computation);
- otherwise, inside a :class:`memconv.save_memory` block, the strategy computes the
  summed gradient; outside any block torch's own kernel does, as in ``torch.nn``.

``grad_batch`` accumulates exactly when ``.grad`` does (two backward passes without
zeroing the gradients add up, as in torch), so ``grad_batch.sum(0) == grad`` always;
it starts afresh when ``.grad`` is None or zero.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

from ._geometry import ConvGeometry, check_input, conv_function, conv_spec, input_vjp
from .context import (
    batch_consumers,
    current_settings,
    explicit_block,
    notify,
    per_sample_enabled,
    share_batch,
    shared_batch,
)
from .vjp import bias_grad, check_settings, weight_grad


class _ConvFunction(torch.autograd.Function):
    """Convolution whose backward computes the weight gradient with a strategy."""

    @staticmethod
    def forward(ctx, x, weight, bias, geom: ConvGeometry, owner):
        ctx.geom = geom
        ctx.owner = owner
        ctx.weight_param = weight
        ctx.bias_param = bias
        # Settings as seen now, for backward passes run on another thread (CUDA's
        # autograd device threads do not see this thread's context variables).
        ctx.thread = threading.get_ident()
        ctx.forward_settings = (current_settings(), per_sample_enabled(), explicit_block())
        ctx.save_for_backward(x, weight)
        return conv_function(geom.dims)(
            x, weight, bias, geom.stride, geom.padding, geom.dilation, geom.groups
        )

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        geom = ctx.geom
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.thread == threading.get_ident():
            settings, per_sample, explicit = (
                current_settings(),
                per_sample_enabled(),
                explicit_block(),
            )
        else:
            settings, per_sample, explicit = ctx.forward_settings
        consumers, offered = 0, {}
        if explicit:
            notify("conv_backward")
            # per-sample gradients an integration already computed for this layer
            # (BackPACK runs a first layer's hooks before its backward)
            for name, need in (("weight", need_w), ("bias", need_b)):
                found = shared_batch(ctx.owner, name, g) if need else None
                if found is not None:
                    offered[name] = found
            consumers = batch_consumers(ctx.owner)
        grad_x = input_vjp(x, weight, g, geom) if need_x else None
        grad_w = grad_b = None
        if (per_sample or consumers or offered) and (need_w or need_b):
            # one weight VJP gives the per-sample gradients; their sum is .grad, and
            # an integration (BackPACK's extensions) may reuse them
            shared, computed = {}, {}
            if need_w:
                batch = offered.get("weight")
                if batch is None:
                    batch = computed["weight"] = weight_grad(
                        x, g, geom, per_sample=True, settings=settings
                    )
                shared["weight"] = batch
                grad_w = batch.sum(0)
            if need_b:
                batch = offered.get("bias")
                if batch is None:
                    batch = computed["bias"] = bias_grad(g, per_sample=True)
                shared["bias"] = batch
                grad_b = batch.sum(0)
            if per_sample:
                for name, batch in shared.items():
                    _store_grad_batch(getattr(ctx, f"{name}_param"), batch)
            if consumers and computed:
                share_batch(ctx.owner, g, computed, consumers)
        else:
            if need_w:
                if explicit:
                    grad_w = weight_grad(x, g, geom, per_sample=False, settings=settings)
                else:
                    grad_w = _torch_weight_grad(x, weight, g, geom)
            if need_b:
                grad_b = bias_grad(g, per_sample=False)
        return grad_x, grad_w, grad_b, None, None


def _torch_weight_grad(x: Tensor, weight: Tensor, g: Tensor, geom: ConvGeometry) -> Tensor:
    _, grad_w, _ = torch.ops.aten.convolution_backward(
        g,
        x,
        weight,
        None,
        list(geom.stride),
        list(geom.padding),
        list(geom.dilation),
        False,
        [0] * geom.dims,
        geom.groups,
        [False, True, False],
    )
    return grad_w


def _clear_fresh(param: Tensor) -> None:
    param._memconv_fresh = False


def _store_grad_batch(param: Tensor, batch: Tensor) -> None:
    """Set or accumulate ``param.grad_batch`` so that it always sums to ``param.grad``."""
    if not getattr(param, "_memconv_hooked", False):
        param.register_post_accumulate_grad_hook(_clear_fresh)
        param._memconv_hooked = True
    old = getattr(param, "grad_batch", None)
    fresh = getattr(param, "_memconv_fresh", False)  # written earlier in this pass
    carries = param.grad is not None and bool(param.grad.detach().any())
    if old is not None and old.shape == batch.shape and (fresh or carries):
        param.grad_batch = old + batch.detach()
    else:
        param.grad_batch = batch.detach()
    param._memconv_fresh = True


class _MemconvConvMixin:
    """Routes ``_conv_forward`` through :class:`_ConvFunction`."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None):
        spec = conv_spec(self)
        check_input(spec, input)
        if (not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active()) or not (
            input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return super()._conv_forward(input, weight, bias)
        check_settings(current_settings(), spec.geometry)
        x = spec.normalize_input(input)
        return _ConvFunction.apply(x, weight, bias, spec.geometry, self)


class Conv1d(_MemconvConvMixin, nn.Conv1d):
    """``torch.nn.Conv1d`` whose backward runs memconv's weight-VJP strategies.

    Input ``[N, C_in, L]``, output ``[N, C_out, L_out]``; see :mod:`memconv.modules`.
    """


class Conv2d(_MemconvConvMixin, nn.Conv2d):
    """``torch.nn.Conv2d`` whose backward runs memconv's weight-VJP strategies.

    Input ``[N, C_in, H, W]``, output ``[N, C_out, H_out, W_out]``; see
    :mod:`memconv.modules`.
    """


class Conv3d(_MemconvConvMixin, nn.Conv3d):
    """``torch.nn.Conv3d`` whose backward runs memconv's weight-VJP strategies.

    Input ``[N, C_in, D, H, W]``, output ``[N, C_out, D_out, H_out, W_out]``; see
    :mod:`memconv.modules`.
    """


def convert(model: nn.Module) -> nn.Module:
    """Replace every ``torch.nn.Conv1d/2d/3d`` in ``model`` by memconv's, in place.

    Parameters, buffers and hooks stay the same objects, so optimisers and
    ``state_dict`` keys are unaffected.

    Args:
        model: any module (a bare convolution is converted itself).

    Returns:
        ``model`` (or the converted bare convolution).
    """
    mapping = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d}
    for module in model.modules():
        new = mapping.get(type(module))
        if new is not None:
            module.__class__ = new
    return model
