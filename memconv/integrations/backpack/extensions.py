"""BackPACK module extensions computing conv quantities with memconv's strategies.

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import copy
import importlib

import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
from torch import Tensor, nn

from ... import context
from ..._geometry import conv_spec
from ...vjp import bias_grad, weight_grad
from . import consumers_after_extension, offer, take_shared

# BackPACK's own module extension classes, to give back on restore:
# kind -> (module path pattern, class name pattern), formatted with the dimension.
_BACKPACK_CLASSES = {
    "BatchGrad": ("batch_grad.conv{d}d", "BatchGradConv{d}d"),
    "BatchL2Grad": ("batch_l2_grad.convnd", "BatchL2Conv{d}d"),
    "SumGradSquared": ("sum_grad_squared.conv{d}d", "SGSConv{d}d"),
    "Variance": ("variance.conv{d}d", "VarianceConv{d}d"),
}


def backpack_extension(kind: str, module_cls):
    """A fresh instance of BackPACK's own module extension for ``module_cls``."""
    dims = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[
        next(c for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d) if issubclass(module_cls, c))
    ]
    path, name = (s.format(d=dims) for s in _BACKPACK_CLASSES[kind])
    module = importlib.import_module(f"backpack.extensions.firstorder.{path}")
    return getattr(module, name)()


def _reduce(kind: str, batch: Tensor, n: int) -> Tensor:
    """BackPACK's quantity from per-sample gradients ``[N, *shape]`` (one VJP)."""
    if kind == "BatchGrad":
        return batch
    if kind == "BatchL2Grad":
        return batch.pow(2).flatten(1).sum(1)
    sgs = batch.pow(2).sum(0)
    if kind == "SumGradSquared":
        return sgs
    # Variance, as BackPACK defines it: mean of squares minus square of the mean
    return sgs / n - (batch.sum(0) / n) ** 2


class MemconvConv(FirstOrderModuleExtension):
    """First-order module extension for Conv1d/2d/3d computed with memconv.

    Every quantity comes from the per-sample gradients of one VJP by the active
    strategy, reduced right away (so one layer's per-sample gradients exist at a
    time): ``BatchGrad`` keeps them, ``BatchL2Grad`` takes their squared norms
    (correct for ``groups > 1``), ``SumGradSquared`` sums their squares and
    ``Variance`` needs no second VJP for the summed gradient.

    Args:
        kind: one of :data:`memconv.integrations.backpack.COVERED`.
    """

    def __init__(self, kind: str):
        self._kind = kind
        super().__init__(params=["bias", "weight"])

    @staticmethod
    def _operands(ext, module, g_out):
        sub = ext.get_subsampling()
        x, g = module.input0, g_out[0]
        if sub is not None:
            x, g = x[sub], g[sub]
        return x, g

    def weight(self, ext, module, g_inp, g_out, bpQuantities):
        batch = take_shared(module, "weight", g_out[0])  # memconv.Conv*d computed it
        if batch is None:
            x, g = self._operands(ext, module, g_out)
            spec = conv_spec(module)
            settings = context.current_settings()
            batch = weight_grad(
                spec.normalize_input(x), g, spec.geometry, per_sample=True, settings=settings
            )
            if g is g_out[0]:
                offer(module, "weight", g, batch, consumers_after_extension(module, "weight"))
        return _reduce(self._kind, batch, g_out[0].shape[0])

    def bias(self, ext, module, g_inp, g_out, bpQuantities):
        batch = take_shared(module, "bias", g_out[0])
        if batch is None:
            _, g = self._operands(ext, module, g_out)
            batch = bias_grad(g, per_sample=True)
            if g is g_out[0]:
                offer(module, "bias", g, batch, consumers_after_extension(module, "bias"))
        return _reduce(self._kind, batch, g_out[0].shape[0])


def memconv_extension(kind: str) -> MemconvConv:
    """memconv's module extension for a covered BackPACK extension."""
    return MemconvConv(kind)


#: Trainable layers BackPACK's BatchGrad supports (checked before any work).
_SUPPORTED = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.modules.batchnorm._BatchNorm,
    nn.Embedding,
)


def per_sample_grads(model, loss_fn, inputs, targets, settings):
    """Per-sample gradients by BackPACK's ``BatchGrad`` with memconv's strategies."""
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and not isinstance(module, _SUPPORTED):
            raise ValueError(
                f"engine='backpack': layer {name!r} ({type(module).__name__}) has "
                "trainable parameters BackPACK's BatchGrad does not support; use "
                "engine='memconv'"
            )
    work = extend(copy.deepcopy(model))
    with context.save_memory.from_settings(settings), backpack(BatchGrad()):
        output = work(inputs)
        loss = sum(loss_fn(output[i : i + 1], targets[i : i + 1]) for i in range(len(inputs)))
        loss.backward()
    out = {}
    for name, p in work.named_parameters():
        if p.requires_grad:
            out[name] = (
                p.grad_batch.detach()
                if hasattr(p, "grad_batch")
                else torch.zeros(len(inputs), *p.shape, dtype=p.dtype, device=p.device)
            )
    return out
