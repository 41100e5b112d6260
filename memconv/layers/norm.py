"""Normalisation layers: GroupNorm, LayerNorm, RMSNorm, InstanceNorm, BatchNorm (eval), as
modules and as operations (``F.group_norm``, ``F.layer_norm``, ...).

Their output is ``x̂·weight + bias``, so the per-sample gradients are ``Σ g·x̂`` and
``Σ g`` over the axes the affine parameters are shared along, with the normalised
input ``x̂`` recomputed (elementwise; no per-sample Jacobian). BatchNorm mixes the
samples of a batch in training mode, and also in eval mode without running
statistics: both are rejected.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..conv.contract import contract
from ..conv.norm_routes import kept_chunk
from .base import LayerRule, RuleSettings, register, rule_settings, trainable
from .operations import BoundOp, bind_args, new_layer, register_op, with_params


class AffineNormRule(LayerRule):
    """Shared by the normalisation rules: subclasses give :meth:`normalized` and
    :meth:`shared_axes`."""

    def normalized(self, module, x):
        """The layer's output before its affine part."""
        raise NotImplementedError

    def shared_axes(self, module, g) -> tuple[int, ...]:
        """The axes of ``g`` (batch axis excluded) the parameters are shared along."""
        return tuple(range(2, g.dim()))  # per channel (axis 1)

    def grad_sample(self, module, inputs, grad_output):
        g, x = grad_output, inputs[0]
        axes = self.shared_axes(module, g)
        out = {}
        if trainable(module, "weight"):
            n = len(x)
            step = _chunk(x, rule_settings())
            parts = []
            with rule_settings().autocast_context():
                for i in range(0, n, step):
                    xs, gs = (x, g) if step >= n else (x[i : i + step], g[i : i + step])
                    xhat = self.normalized(module, xs)
                    if xhat.dtype != g.dtype:
                        xhat = xhat.to(g.dtype)
                    parts.append(_product_sum(gs, xhat, axes))
                    del xhat
            out["weight"] = parts[0] if len(parts) == 1 else torch.cat(parts)
        if trainable(module, "bias"):
            out["bias"] = g.sum(axes) if axes else g
        return out

    def memory(self, module, input_shapes, itemsize, task):
        shape = input_shapes[0]
        n, one = shape[0], math.prod(shape[1:])
        chunk = min(n, _samples_per_chunk(one * itemsize, n, rule_settings())) * one
        params = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        return (chunk + 2 * n * params) * itemsize  # x̂ of a chunk; the gradients


def _product_sum(g: Tensor, xhat: Tensor, axes: tuple[int, ...]) -> Tensor:
    """``Σ g·x̂`` over ``axes`` per sample (one contraction: no product tensor)."""
    if not axes:
        return g * xhat
    letters = "abcdefghijklmnopqrstuvwxyz"[: g.dim()]
    kept = "".join(c for i, c in enumerate(letters) if i not in axes)
    return contract(f"{letters},{letters}->{kept}", g, xhat)


def _samples_per_chunk(sample_bytes: int, n: int, rs: RuleSettings) -> int:
    """Samples of ``n`` whose x̂ fits the budget of ``rs`` (every sample without one);
    with a reference batch larger than ``n``, as many chunks as that batch's, at most
    ``n`` (:func:`memconv.conv.norm_routes.at_reference`)."""
    budget, reference = rs.budget, rs.reference
    if budget is None:
        return 2**62
    if reference is None or n >= reference:
        return max(1, budget // max(sample_bytes, 1))
    chunk = max(1, budget * reference // n // max(sample_bytes, 1))
    return kept_chunk(chunk, reference, n)


def _chunk(x, rs: RuleSettings) -> int:
    return _samples_per_chunk(math.prod(x.shape[1:]) * x.element_size(), len(x), rs)


@register(nn.GroupNorm)
class GroupNormRule(AffineNormRule):
    def normalized(self, module, x):
        return F.group_norm(x, module.num_groups, eps=module.eps)


@register(nn.LayerNorm)
class LayerNormRule(AffineNormRule):
    movable_batch_axis = True

    def normalized(self, module, x):
        return F.layer_norm(x, module.normalized_shape, eps=module.eps)

    def shared_axes(self, module, g):  # parameters over the trailing normalized dims
        return tuple(range(1, g.dim() - len(module.normalized_shape)))


if hasattr(nn, "RMSNorm"):

    @register(nn.RMSNorm)
    class RMSNormRule(LayerNormRule):
        def normalized(self, module, x):
            return F.rms_norm(x, module.normalized_shape, eps=module.eps)


@register(
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
class InstanceNormRule(AffineNormRule):
    def normalized(self, module, x):
        use_input_stats = module.training or not module.track_running_stats
        return F.instance_norm(
            x,
            module.running_mean,
            module.running_var,
            use_input_stats=use_input_stats,
            eps=module.eps,
        )


@register(
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
)
class BatchNormRule(AffineNormRule):
    def check(self, module, name):
        if module.training:
            why = "in training mode"
        elif module.running_mean is None:
            why = "in eval mode without running statistics (track_running_stats=False)"
        else:
            return
        raise ValueError(
            f"layer {name!r} ({type(module).__name__} {why}) normalises with the statistics "
            "of the whole batch, so it mixes the samples and per-sample gradients are "
            "undefined; call .eval() on it with running statistics, or replace it by "
            "GroupNorm/LayerNorm"
        )

    def normalized(self, module, x):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        mean = module.running_mean.reshape(shape)
        return (x - mean) / torch.sqrt(module.running_var.reshape(shape) + module.eps)


# ------------------------------------------------------------------ operations
_AFFINE_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5}
_STATS_ARGS = ("running_mean", "running_var")
_INSTANCE_ARGS = (
    "input",
    "running_mean",
    "running_var",
    "weight",
    "bias",
    "use_input_stats",
    "momentum",
    "eps",
)
_INSTANCE_DEFAULTS = {
    "running_mean": None,
    "running_var": None,
    "weight": None,
    "bias": None,
    "use_input_stats": True,
    "momentum": 0.1,
    "eps": 1e-5,
}
#: ``F.batch_norm``'s signature (the running statistics may be None).
BATCH_NORM_ARGS = (
    "input",
    "running_mean",
    "running_var",
    "weight",
    "bias",
    "training",
    "momentum",
    "eps",
)
BATCH_NORM_DEFAULTS = {
    "running_mean": None,
    "running_var": None,
    "weight": None,
    "bias": None,
    "training": False,
    "momentum": 0.1,
    "eps": 1e-5,
}
_INSTANCE_TYPES = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}


def _shape(shape):
    """A ``normalized_shape`` as a tuple (an int, a list or a ``torch.Size``)."""
    return (shape,) if isinstance(shape, int) else tuple(shape)


def _affine(a: dict | None, *names: str) -> bool:
    """Whether ``a`` holds the call's arguments with tensors or None in ``names``."""
    return a is not None and all(a[n] is None or isinstance(a[n], Tensor) for n in names)


def _bound(a: dict, shell) -> BoundOp:
    return BoundOp(a["input"], {"weight": a["weight"], "bias": a["bias"]}, shell)


@register_op(F.layer_norm)
def bind_layer_norm(args, kwargs) -> BoundOp | None:
    """``F.layer_norm``: the shell is the ``nn.LayerNorm`` of ``normalized_shape``."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    a = bind_args(names, args, kwargs, _AFFINE_DEFAULTS)
    if not _affine(a, "weight", "bias"):
        return None

    def shell(params):
        layer = new_layer(nn.LayerNorm, _shape(a["normalized_shape"]), eps=a["eps"])
        return with_params(layer, params)

    return _bound(a, shell)


@register_op(F.group_norm)
def bind_group_norm(args, kwargs) -> BoundOp | None:
    """``F.group_norm``: the shell is the ``nn.GroupNorm`` of the call."""
    names = ("input", "num_groups", "weight", "bias", "eps")
    a = bind_args(names, args, kwargs, _AFFINE_DEFAULTS)
    if not _affine(a, "weight", "bias") or a["input"].dim() < 2:
        return None

    def shell(params):
        layer = new_layer(nn.GroupNorm, a["num_groups"], a["input"].shape[1], eps=a["eps"])
        return with_params(layer, params)

    return _bound(a, shell)


if hasattr(F, "rms_norm") and hasattr(nn, "RMSNorm"):  # torch >= 2.4

    @register_op(F.rms_norm)
    def bind_rms_norm(args, kwargs) -> BoundOp | None:
        """``F.rms_norm``: the shell is the ``nn.RMSNorm`` of ``normalized_shape``."""
        names = ("input", "normalized_shape", "weight", "eps")
        a = bind_args(names, args, kwargs, {"weight": None, "eps": None})
        if not _affine(a, "weight"):
            return None

        def shell(params):
            layer = new_layer(nn.RMSNorm, _shape(a["normalized_shape"]), eps=a["eps"])
            return with_params(layer, params)

        return BoundOp(a["input"], {"weight": a["weight"]}, shell)


@register_op(F.instance_norm)
def bind_instance_norm(args, kwargs) -> BoundOp | None:
    """``F.instance_norm``, with each sample's statistics or the running ones."""
    a = bind_args(_INSTANCE_ARGS, args, kwargs, _INSTANCE_DEFAULTS)
    if not _affine(a, "weight", "bias", *_STATS_ARGS) or a["input"].dim() not in _INSTANCE_TYPES:
        return None
    stats = not a["use_input_stats"]
    if stats and (a["running_mean"] is None or a["running_var"] is None):
        return None
    kind = _INSTANCE_TYPES[a["input"].dim()]

    def shell(params):
        # the statistics of each sample, or the running ones (the shell never updates them)
        layer = new_layer(
            kind, a["input"].shape[1], eps=a["eps"], affine=True, track_running_stats=stats
        )
        if stats:
            layer.running_mean = a["running_mean"].detach()
            layer.running_var = a["running_var"].detach()
        return with_params(layer.train(not stats), params)

    return _bound(a, shell)


@register_op(F.batch_norm)
def bind_batch_norm(args, kwargs) -> BoundOp | None:
    """``F.batch_norm`` with running statistics, not in training mode (otherwise it
    mixes the samples)."""
    a = bind_args(BATCH_NORM_ARGS, args, kwargs, BATCH_NORM_DEFAULTS)
    if not _affine(a, "weight", "bias", *_STATS_ARGS) or a["training"]:
        return None
    if a["running_mean"] is None or a["running_var"] is None or a["input"].dim() < 2:
        return None

    def shell(params):
        layer = new_layer(nn.BatchNorm2d, a["input"].shape[1], eps=a["eps"]).eval()
        layer.running_mean = a["running_mean"].detach()
        layer.running_var = a["running_var"].detach()
        return with_params(layer, params)

    return _bound(a, shell)
