"""Per-sample gradients of one layer's parameters from its input and output gradient.

One rule per kind of layer, looked up by :func:`grad_sample` (in the manner of
Opacus' grad samplers):

- convolutions and transposed convolutions: the weight VJP of a memconv strategy
  (:mod:`memconv.strategies`), the bias as the output gradient summed over space;
- ``Linear``: ``g^T a`` per sample, summed over any sequence/spatial axes;
- normalisation layers (GroupNorm, LayerNorm, InstanceNorm, BatchNorm in eval mode):
  ``Σ g·x̂`` and ``Σ g`` per sample, with the normalised input x̂ recomputed;
- any other layer (embedding, PReLU, ...): the VJP of
  ``torch.func.functional_call`` on one sample at a time, vectorised with
  ``torch.func.vmap``. :data:`GENERIC_LAYERS` lists those :func:`memconv.convert`
  gives a class of their own.

Also here: :func:`capture`, which makes a layer's output gradient reach a callback
during the backward pass, and :func:`check_independent`, which rejects layers that
mix the samples of a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._geometry import CONV_TRANSPOSE_TYPES, CONV_TYPES, Operands, conv_spec
from .context import Settings
from .strategies import Options, get_strategy

#: Layers whose per-sample gradients come from ``torch.func`` (one tensor in, one out).
GENERIC_LAYERS = tuple(
    cls
    for cls in (
        nn.GroupNorm,
        nn.LayerNorm,
        getattr(nn, "RMSNorm", None),
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.Embedding,
        nn.PReLU,
    )
    if cls is not None
)
#: Layers that couple the samples of a batch in training mode.
COUPLING = (nn.modules.batchnorm._BatchNorm,)


@dataclass(frozen=True)
class Autocast:
    """The autocast state a layer's forward pass ran under (to re-run it alike).

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ...
        dtype: the autocast dtype, or ``None`` when autocast was off.
    """

    device_type: str
    dtype: torch.dtype | None

    @classmethod
    def current(cls, device_type: str) -> Autocast:
        """The state of ``torch.autocast`` for ``device_type`` right now."""
        if torch.is_autocast_enabled(device_type):
            return cls(device_type, torch.get_autocast_dtype(device_type))
        return cls(device_type, None)

    def context(self):
        """A ``torch.autocast`` block restoring this state."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)


def own_trainable(module: nn.Module) -> dict[str, Tensor]:
    """``{local name: parameter}`` of the module's own parameters that require grad."""
    return {k: p for k, p in module.named_parameters(recurse=False) if p.requires_grad}


def check_independent(module: nn.Module, name: str) -> None:
    """Raise if ``module`` mixes the samples of a batch (BatchNorm in training mode).

    Raises:
        ValueError: naming the layer and the remedy.
    """
    if isinstance(module, COUPLING) and module.training:
        raise ValueError(
            f"layer {name!r} ({type(module).__name__} in training mode) mixes the samples of "
            "a batch, so per-sample gradients are undefined; call .eval() on it or replace "
            "it by GroupNorm/LayerNorm"
        )


def weight_grad(ops: Operands, settings: Settings, per_sample: bool) -> Tensor:
    """Run the strategy of ``settings`` on a layer's operands.

    A ``memory_budget`` covers the copy that brought the input to normal form (if
    any): the strategy gets what is left of it.

    Args:
        ops: the operands (:meth:`memconv._geometry.ConvSpec.operands`).
        settings: strategy and options.
        per_sample: ``[N, *weight.shape]`` if True, else the sum over N.
    """
    geom = ops.geometry
    if ops.x.shape[0] == 0:  # an empty batch has a zero gradient
        return ops.x.new_zeros((0, *geom.weight_shape) if per_sample else geom.weight_shape)
    options = spend(settings.options, ops.copied * ops.x.element_size())
    strategy = get_strategy(settings.strategy)
    return strategy.vjp(ops.x, ops.g, geom, per_sample=per_sample, options=options)


def summed_weight_grad(ops: Operands, weight: Tensor) -> Tensor:
    """The summed weight gradient by torch's own kernel (ATen's
    ``convolution_backward`` with only the weight mask set), from strategy operands."""
    geom = ops.geometry
    _, grad_w, _ = torch.ops.aten.convolution_backward(
        ops.g,
        ops.x,
        weight.to(ops.x.dtype),
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


def spend(options: Options, spent: int) -> Options:
    """``options`` with ``spent`` bytes taken off its ``memory_budget`` (at least 1 left)."""
    if not spent or options.memory_budget is None:
        return options
    return replace(options, memory_budget=max(options.memory_budget - spent, 1))


def conv_weight_grad(module, input: Tensor, grad_output: Tensor, settings: Settings, per_sample):
    """Weight gradient of a convolution or transposed convolution by a strategy.

    Args:
        module: ``Conv*d`` or ``ConvTranspose*d``.
        input: the layer's input ``[N, C, *S]``.
        grad_output: its output gradient ``[N, C', *T]``; when the dtypes differ
            (autocast), the input is cast to the output gradient's dtype, the one
            the forward pass computed in.
        settings: strategy and options.
        per_sample: ``[N, *weight.shape]`` if True, else the sum over N.

    Returns:
        The gradient, in the output gradient's dtype.
    """
    if input.dtype != grad_output.dtype:
        input = input.to(grad_output.dtype)
    return weight_grad(conv_spec(module).operands(input, grad_output), settings, per_sample)


def bias_grad(g: Tensor, *, per_sample: bool) -> Tensor:
    """Bias gradient of a convolution: the output gradient summed over space (and N).

    Args:
        g: output gradient ``[N, C_out, *T]``.
        per_sample: ``[N, C_out]`` if True, else ``[C_out]``.
    """
    dims = tuple(range(2, g.dim()))
    out = g.sum(dims) if dims else g
    return out if per_sample else out.sum(0)


def _conv(module, x: Tensor, g: Tensor, settings: Settings, autocast) -> dict[str, Tensor]:
    out = {}
    if module.weight.requires_grad:
        out["weight"] = conv_weight_grad(module, x, g, settings, per_sample=True)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = bias_grad(g, per_sample=True)
    return out


def _linear(module: nn.Linear, x: Tensor, g: Tensor, settings, autocast) -> dict[str, Tensor]:
    if x.dtype != g.dtype:
        x = x.to(g.dtype)
    n = x.shape[0]
    x2 = x.reshape(n, -1, x.shape[-1])  # [N, L, in]
    g2 = g.reshape(n, -1, g.shape[-1])  # [N, L, out]
    out = {}
    if module.weight.requires_grad:
        out["weight"] = torch.matmul(g2.transpose(1, 2), x2)  # [N, out, in]
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = g2.sum(1)  # [N, out]
    return out


#: Normalisation layers whose output is ``x̂·weight + bias``.
AFFINE_NORMS = (
    nn.GroupNorm,
    nn.LayerNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.batchnorm._BatchNorm,
)


def _normalized(module: nn.Module, x: Tensor) -> Tensor:
    """The layer's normalised input x̂ (its output before the affine part)."""
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(x, module.num_groups, eps=module.eps)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, eps=module.eps)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        use_input_stats = module.training or not module.track_running_stats
        return F.instance_norm(
            x, module.running_mean, module.running_var, use_input_stats=use_input_stats,
            eps=module.eps,
        )  # fmt: skip
    # BatchNorm in eval mode (training mode is rejected before any work)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mean = module.running_mean.reshape(shape)
    return (x - mean) / torch.sqrt(module.running_var.reshape(shape) + module.eps)


def _affine_norm(module: nn.Module, x: Tensor, g: Tensor, settings, autocast) -> dict[str, Tensor]:
    """Normalisation layers: ``∂/∂weight = Σ g·x̂`` and ``∂/∂bias = Σ g`` per sample, summed
    over the axes the affine parameters are shared along (x̂ recomputed, elementwise)."""
    with autocast.context():
        xhat = _normalized(module, x)
    xhat = xhat.to(g.dtype)
    if isinstance(module, nn.LayerNorm):  # parameters over the trailing normalized dims
        axes = tuple(range(1, g.dim() - len(module.normalized_shape)))
    else:  # parameters per channel (axis 1)
        axes = tuple(range(2, g.dim()))
    out = {}
    if module.weight is not None and module.weight.requires_grad:
        out["weight"] = (g * xhat).sum(axes) if axes else g * xhat
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = g.sum(axes) if axes else g
    return out


def _generic(module: nn.Module, x: Tensor, g: Tensor, settings, autocast) -> dict[str, Tensor]:
    params = {k: p.detach() for k, p in own_trainable(module).items()}

    def single(xi, gi):
        def f(p):
            with autocast.context():
                return torch.func.functional_call(module, p, (xi.unsqueeze(0),)).squeeze(0)

        _, pullback = torch.func.vjp(f, params)
        return pullback(gi)[0]

    return torch.func.vmap(single)(x, g)


def grad_sample(
    module: nn.Module, x: Tensor, g: Tensor, settings: Settings, autocast: Autocast
) -> dict[str, Tensor]:
    """Per-sample gradients ``{local name: [N, *shape]}`` of the layer's trainable
    parameters, in the parameters' dtypes.

    Args:
        module: the layer; any layer that takes one tensor and returns one (those
            without a rule of their own go through ``torch.func``).
        x: its input ``[N, ...]`` (detached).
        g: its output gradient ``[N, ...]``.
        settings: strategy and options for convolutions.
        autocast: the autocast state of the forward pass (generic layers re-run it).
    """
    if x.shape[0] == 0:  # an empty batch: empty per-sample gradients on every path
        return {k: p.new_zeros(0, *p.shape) for k, p in own_trainable(module).items()}
    if isinstance(module, CONV_TYPES + CONV_TRANSPOSE_TYPES):
        rule = _conv
    elif isinstance(module, nn.Linear):
        rule = _linear
    elif isinstance(module, AFFINE_NORMS):  # BatchNorm in training mode never gets here
        rule = _affine_norm
    else:
        rule = _generic
    with torch.no_grad():
        out = rule(module, x, g, settings, autocast)
    params = dict(module.named_parameters(recurse=False))
    return {k: v.to(params[k].dtype) for k, v in out.items()}


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
    if output._is_view():
        output = output.clone()

    def hook(grad):
        on_grad(grad)  # the gradient itself passes on unchanged

    output.register_hook(hook)
    return output
