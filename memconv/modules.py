"""Extended modules: one backward pass that also leaves per-sample gradients.

:func:`convert` swaps the class of every supported layer of a model for memconv's
subclass (same constructor, parameters and ``state_dict`` keys):

- ``memconv.Conv1d/2d/3d`` and ``memconv.ConvTranspose1d/2d/3d``: torch's forward;
  a backward that computes the input gradient with the transposed operation and
  the weight gradient once, by the strategy recorded at the forward pass (the rule
  of :class:`memconv.save_memory`). Inside :class:`memconv.per_sample` that one VJP
  is per sample: it is stored as ``param.grad_batch`` and its sum is the gradient
  added to ``param.grad``. Outside any block the summed gradient comes from torch's
  own kernel, as in ``torch.nn``;
- ``memconv.Linear`` and the normalisation, embedding and PReLU layers: torch's
  forward and backward; inside :class:`memconv.per_sample` their output gradient
  also yields ``grad_batch`` by the layer's rule (:mod:`memconv.layers`).

``grad_batch`` accumulates exactly when ``.grad`` does: a backward pass that adds to
a ``.grad`` left by an earlier one appends its N per-sample gradients (as Opacus'
``grad_sample`` does), a layer reached twice in one pass (shared weights) adds to
its samples, and after ``.grad`` is set to None, zeroed or replaced it starts
afresh; so ``grad_batch.sum(0)`` is always ``.grad``.

Under ``torch.autocast`` the convolutions cast their operands as autocast does for
torch's, so the backward pass computes in the same dtype as the forward pass.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor, nn

from ._checks import check_conv_input as check_input
from ._torch import functorch_active, version
from .conv.grads import bias_grad, capture, weight_grad
from .conv.settings import DEFAULT_SETTINGS, Autocast, Recorded, record, warn_if_block_missed
from .conv.vjp import check_settings
from .layers import (
    RuleSettings,
    check_layer,
    find_rule,
    own_trainable,
    register_like,
    run_rule,
    using,
)
from .strategies.geometry import (
    ConvSpec,
    conv_function,
    conv_spec,
    conv_transpose_function,
    convolution_backward,
    input_vjp,
)


# ----------------------------------------------------------------- grad_batch
class _GradBatchState:
    """Whether a parameter's ``grad_batch`` continues its ``.grad``."""

    __slots__ = ("pending", "base", "current", "grad", "version")

    def __init__(self):
        self.pending = False  # written in the backward pass now running
        self.base = self.current = None
        self.grad = None  # weak reference to .grad after the last accumulation
        self.version = -1

    def follows(self, grad) -> bool:
        """Whether ``grad`` is the ``.grad`` the last accumulation left, unchanged."""
        return (
            grad is not None
            and self.grad is not None
            and self.grad() is grad
            and version(grad) == self.version
        )


def _accumulated(param: Tensor) -> None:
    state = param._memconv_grad_batch_state
    state.pending = False
    state.base = state.current = None
    state.grad = weakref.ref(param.grad) if param.grad is not None else None
    state.version = version(param.grad) if param.grad is not None else -1


def store_grad_batch(param: Tensor, batch: Tensor) -> None:
    """Set ``param.grad_batch`` from this backward pass's per-sample gradients ``batch``.

    Called before autograd adds ``batch.sum(0)`` to ``param.grad``; keeps
    ``grad_batch.sum(0) == grad`` (see the module docstring).
    """
    batch = batch.detach().to(param.dtype)
    state = getattr(param, "_memconv_grad_batch_state", None)
    if state is None:
        state = param._memconv_grad_batch_state = _GradBatchState()
        param.register_post_accumulate_grad_hook(_accumulated)
    if state.pending:  # reached again in this pass: the same samples
        state.current = state.current + batch
    else:
        old = getattr(param, "grad_batch", None)
        state.base = old if old is not None and state.follows(param.grad) else None
        state.current = batch
        state.pending = True
    if state.base is None:
        param.grad_batch = state.current
    else:
        param.grad_batch = torch.cat([state.base, state.current])


# ----------------------------------------------------------------- convolutions
def _describe(layer: nn.Module) -> str:
    return f"{type(layer).__module__.split('.')[0]}.{type(layer).__name__}({layer.extra_repr()})"


class _ConvFunction(torch.autograd.Function):
    """Convolution or transposed convolution whose weight VJP runs a strategy."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, spec: ConvSpec, recorded: Recorded, output_padding):
        ctx.layer, ctx.spec, ctx.recorded = layer, spec, recorded
        ctx.output_padding = output_padding
        ctx.save_for_backward(x, weight)
        geom = spec.geometry
        if spec.transposed:
            return conv_transpose_function(geom.dims)(
                x,
                weight,
                bias,
                stride=geom.stride,
                padding=geom.padding,
                output_padding=output_padding,
                groups=geom.groups,
                dilation=geom.dilation,
            )
        return conv_function(geom.dims)(
            x, weight, bias, geom.stride, geom.padding, geom.dilation, geom.groups
        )

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        layer, spec, recorded = ctx.layer, ctx.spec, ctx.recorded
        warn_if_block_missed(recorded, _describe(layer))
        geom = spec.geometry
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = input_vjp(x, weight, g, geom, ctx.output_padding) if need_x else None
        grad_w = grad_b = None
        if need_w:
            if recorded.per_sample or recorded.settings is not None:
                # the one weight VJP: per sample (stored; its sum is .grad) or summed
                if x.numel() == 0 or g.numel() == 0:  # no samples, or no positions
                    grad_w = weight.new_zeros(len(x), *weight.shape)
                    grad_w = grad_w if recorded.per_sample else grad_w.sum(0)
                else:
                    ops = spec.operands(x, g, normalized=True)
                    grad_w = weight_grad(ops, recorded.strategy_settings, recorded.per_sample)
                if recorded.per_sample:
                    store_grad_batch(layer.weight, grad_w)
                    grad_w = grad_w.sum(0)
            else:
                grad_w = _torch_weight_grad(x, weight, g, geom, ctx.output_padding)
        if need_b:
            grad_b = bias_grad(g, per_sample=recorded.per_sample)
            if recorded.per_sample:
                store_grad_batch(layer.bias, grad_b)
                grad_b = grad_b.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None


def _torch_weight_grad(x, weight, g, geom, output_padding) -> Tensor:
    return convolution_backward(x, weight, g, geom, output_padding, weight_grad=True)[1]


def _autocast_operands(input: Tensor, weight: Tensor, bias):
    """Cast the operands as ``torch.autocast`` casts a convolution's (differentiably)."""
    state = Autocast.current(input.device.type)
    if state.dtype is None:
        return input, weight, bias, state
    cast = [
        t if t is None or not t.is_floating_point() else t.to(state.dtype)
        for t in (input, weight, bias)
    ]
    return (*cast, state)


def _run_conv(layer, input: Tensor, weight: Tensor, bias, output_padding) -> Tensor | None:
    """The memconv path of a convolution's forward pass, or None for torch's own.

    torch's own runs when no graph is built (no grad mode, nothing requires grad,
    inside ``torch.func`` transforms).
    """
    spec = conv_spec(layer)
    check_input(spec, input)
    if (
        not torch.is_grad_enabled()
        or functorch_active()
        or not (
            input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        )
    ):
        return None
    recorded = record()
    if recorded.settings is not None:
        check_settings(recorded.settings, spec.geometry)
    x = input if spec.transposed else spec.normalize_input(input)
    return apply_conv(layer, x, weight, bias, spec, recorded, output_padding)


def apply_conv(layer, x, weight, bias, spec: ConvSpec, recorded: Recorded, output_padding=None):
    """Run :class:`_ConvFunction` on a normal-form input, casting the operands as
    ``torch.autocast`` would when it is on.

    Args:
        layer: the module (its parameters receive ``grad_batch``).
        x: normal-form input (a transposed convolution's own input).
        weight, bias: the parameters (or their replacements).
        spec: the layer's spec (possibly with another padding, as streaming uses).
        recorded: what the forward pass records for the backward pass.
        output_padding: a transposed convolution's, else None.
    """
    x, weight, bias, state = _autocast_operands(x, weight, bias)
    with torch.autocast(state.device_type, enabled=False):
        return _ConvFunction.apply(x, weight, bias, layer, spec, recorded, output_padding)


class _ConvMixin:
    """Routes ``_conv_forward`` through :class:`_ConvFunction`."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None):
        out = _run_conv(self, input, weight, bias, None)
        return super()._conv_forward(input, weight, bias) if out is None else out


class _ConvTransposeMixin:
    """Routes the forward pass through :class:`_ConvFunction`."""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__name__}")
        dims = len(self.kernel_size)
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, dims, self.dilation
        )
        out = _run_conv(self, input, self.weight, self.bias, tuple(output_padding))
        return super().forward(input, output_size) if out is None else out


class Conv1d(_ConvMixin, nn.Conv1d):
    """``torch.nn.Conv1d`` whose backward runs memconv's weight-VJP strategies.

    Input ``[N, C_in, L]``, output ``[N, C_out, L_out]``; see :mod:`memconv.modules`.
    """


class Conv2d(_ConvMixin, nn.Conv2d):
    """``torch.nn.Conv2d`` whose backward runs memconv's weight-VJP strategies.

    Input ``[N, C_in, H, W]``, output ``[N, C_out, H_out, W_out]``; see
    :mod:`memconv.modules`.
    """


class Conv3d(_ConvMixin, nn.Conv3d):
    """``torch.nn.Conv3d`` whose backward runs memconv's weight-VJP strategies.

    Input ``[N, C_in, D, H, W]``, output ``[N, C_out, D_out, H_out, W_out]``; see
    :mod:`memconv.modules`.
    """


class ConvTranspose1d(_ConvTransposeMixin, nn.ConvTranspose1d):
    """``torch.nn.ConvTranspose1d`` whose backward runs memconv's weight-VJP strategies.

    Its weight gradient is the weight gradient of the convolution whose input
    gradient it computes, with input and output gradient exchanged; see
    :class:`memconv.strategies.geometry.ConvSpec` and :mod:`memconv.modules`.
    """


class ConvTranspose2d(_ConvTransposeMixin, nn.ConvTranspose2d):
    """``torch.nn.ConvTranspose2d`` whose backward runs memconv's weight-VJP strategies.

    See :class:`ConvTranspose1d`.
    """


class ConvTranspose3d(_ConvTransposeMixin, nn.ConvTranspose3d):
    """``torch.nn.ConvTranspose3d`` whose backward runs memconv's weight-VJP strategies.

    See :class:`ConvTranspose1d`.
    """


# ----------------------------------------------------------------- other layers
class _PerSampleMixin:
    """torch's forward and backward; inside ``per_sample()`` the output gradient also
    yields ``grad_batch`` by the layer's rule (:mod:`memconv.layers`)."""

    def forward(self, input, *args, **kwargs):
        out = super().forward(input, *args, **kwargs)
        if (
            not torch.is_grad_enabled()
            or functorch_active()
            or not isinstance(out, Tensor)
            or not out.requires_grad
            or not own_trainable(self)
        ):
            return out
        if not record(per_sample_only=True).per_sample:
            return out
        check_layer(self, _describe(self))
        rule = find_rule(self)
        x = input.detach()
        state = Autocast.current(out.device.type)
        settings = RuleSettings(DEFAULT_SETTINGS, autocast=state, contiguous=True)

        def on_grad(g):
            with using(settings):
                grads = run_rule(rule, "grad_sample", self, (x,), g, where=_describe(self))
            for name, batch in grads.items():
                param = getattr(self, name)
                store_grad_batch(param, batch.to(param.dtype))

        return capture(out, on_grad)


class Linear(_PerSampleMixin, nn.Linear):
    """``torch.nn.Linear`` that leaves ``grad_batch`` inside :class:`memconv.per_sample`."""


class GroupNorm(_PerSampleMixin, nn.GroupNorm):
    """``torch.nn.GroupNorm`` that leaves ``grad_batch`` inside :class:`memconv.per_sample`."""


class LayerNorm(_PerSampleMixin, nn.LayerNorm):
    """``torch.nn.LayerNorm`` that leaves ``grad_batch`` inside :class:`memconv.per_sample`."""


class InstanceNorm1d(_PerSampleMixin, nn.InstanceNorm1d):
    """``torch.nn.InstanceNorm1d`` that leaves ``grad_batch`` inside
    :class:`memconv.per_sample`."""


class InstanceNorm2d(_PerSampleMixin, nn.InstanceNorm2d):
    """``torch.nn.InstanceNorm2d`` that leaves ``grad_batch`` inside
    :class:`memconv.per_sample`."""


class InstanceNorm3d(_PerSampleMixin, nn.InstanceNorm3d):
    """``torch.nn.InstanceNorm3d`` that leaves ``grad_batch`` inside
    :class:`memconv.per_sample`."""


class BatchNorm1d(_PerSampleMixin, nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` that leaves ``grad_batch`` inside :class:`memconv.per_sample`
    (in eval mode only: in training mode it mixes the samples, and raises there)."""


class BatchNorm2d(_PerSampleMixin, nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d``; see :class:`BatchNorm1d`."""


class BatchNorm3d(_PerSampleMixin, nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d``; see :class:`BatchNorm1d`."""


class Embedding(_PerSampleMixin, nn.Embedding):
    """``torch.nn.Embedding`` that leaves ``grad_batch`` inside :class:`memconv.per_sample`."""


class PReLU(_PerSampleMixin, nn.PReLU):
    """``torch.nn.PReLU`` that leaves ``grad_batch`` inside :class:`memconv.per_sample`."""


CONVERSIONS: dict[type, type] = {
    nn.Conv1d: Conv1d,
    nn.Conv2d: Conv2d,
    nn.Conv3d: Conv3d,
    nn.ConvTranspose1d: ConvTranspose1d,
    nn.ConvTranspose2d: ConvTranspose2d,
    nn.ConvTranspose3d: ConvTranspose3d,
    nn.Linear: Linear,
    nn.GroupNorm: GroupNorm,
    nn.LayerNorm: LayerNorm,
    nn.InstanceNorm1d: InstanceNorm1d,
    nn.InstanceNorm2d: InstanceNorm2d,
    nn.InstanceNorm3d: InstanceNorm3d,
    nn.BatchNorm1d: BatchNorm1d,
    nn.BatchNorm2d: BatchNorm2d,
    nn.BatchNorm3d: BatchNorm3d,
    nn.Embedding: Embedding,
    nn.PReLU: PReLU,
}
if hasattr(nn, "RMSNorm"):

    class RMSNorm(_PerSampleMixin, nn.RMSNorm):
        """``torch.nn.RMSNorm`` that leaves ``grad_batch`` inside :class:`memconv.per_sample`."""

    CONVERSIONS[nn.RMSNorm] = RMSNorm

# memconv's modules compute what torch's do: they take the rules of torch's types.
for _torch_type, _own_type in CONVERSIONS.items():
    register_like(_own_type, _torch_type)
del _torch_type, _own_type

MEMCONV_CONV_TYPES = (Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d)


def convert(model: nn.Module) -> nn.Module:
    """Replace every supported ``torch.nn`` layer in ``model`` by memconv's, in place.

    Converted: ``Conv1d/2d/3d``, ``ConvTranspose1d/2d/3d``, ``Linear``, ``GroupNorm``,
    ``LayerNorm``, ``RMSNorm``, ``InstanceNorm1d/2d/3d``, ``BatchNorm1d/2d/3d``,
    ``Embedding`` and ``PReLU`` (exact classes, as BackPACK's ``extend`` matches
    them). Parameters, buffers and hooks stay the same objects, so optimisers and
    ``state_dict`` keys are unaffected. Any other layer with trainable parameters of
    its own keeps torch's behaviour and gets no ``grad_batch`` inside
    :class:`memconv.per_sample`; a warning names them (use
    :func:`memconv.per_sample_grads` for such models).

    Args:
        model: any module (a bare layer is converted itself).

    Returns:
        ``model``.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    converted = set(CONVERSIONS.values())
    left = []
    for name, module in model.named_modules():
        new = CONVERSIONS.get(type(module))
        if new is not None:
            module.__class__ = new
        elif type(module) not in converted and own_trainable(module):
            left.append(f"{name or '(model)'!r} ({type(module).__name__})")
    if left:
        warnings.warn(
            "memconv.convert: per_sample() cannot compute grad_batch for these layers, which "
            f"keep torch's behaviour: {', '.join(left)}. memconv.per_sample_grads, "
            "per_sample_norms and clip_and_accumulate cover every layer (those without a "
            "rule in memconv.layers through torch.func).",
            stacklevel=2,
        )
    return model
