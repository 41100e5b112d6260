"""memconv's weight Jacobian for BackPACK: subclasses of BackPACK's conv derivatives.

BackPACK chooses the weight-Jacobian algorithm of a convolution in
``ConvNDDerivatives._weight_jac_t_mat_prod`` (and ``ConvTransposeNDDerivatives``'s);
these subclasses compute it with the memconv strategy that the layer's forward pass
recorded (the rule of :class:`memconv.save_memory`). A layer whose forward pass did
not run through memconv (a ``torch.nn`` convolution) keeps BackPACK's own
algorithm, with a warning naming it.

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import warnings

import torch
from backpack.core.derivatives.conv1d import Conv1DDerivatives
from backpack.core.derivatives.conv2d import Conv2DDerivatives
from backpack.core.derivatives.conv3d import Conv3DDerivatives
from backpack.core.derivatives.conv_transpose1d import ConvTranspose1DDerivatives
from backpack.core.derivatives.conv_transpose2d import ConvTranspose2DDerivatives
from backpack.core.derivatives.conv_transpose3d import ConvTranspose3DDerivatives
from backpack.utils.subsampling import subsample

from ...context import warn_if_block_missed
from ...grad_sample import conv_weight_grad
from ...modules import _ConvFunction, _describe


def recorded_settings(module):
    """What the layer's last forward pass with gradients recorded, or None when it did
    not run through memconv (BackPACK stores that output as ``module.output``)."""
    grad_fn = getattr(getattr(module, "output", None), "grad_fn", None)
    if type(grad_fn) is _ConvFunction._backward_cls:
        return grad_fn.recorded
    return None


class _MemconvWeightJacobian:
    """``_weight_jac_t_mat_prod`` by memconv's strategies."""

    def _weight_jac_t_mat_prod(self, module, g_inp, g_out, mat, sum_batch=True, subsampling=None):
        recorded = recorded_settings(module)
        if recorded is None:
            warnings.warn(
                f"memconv: {_describe(module)} ran its forward pass as a torch.nn layer, so "
                "BackPACK's own algorithm computes its weight Jacobian. Convert the model "
                "with memconv.convert(model) before backpack.extend(model).",
                stacklevel=2,
            )
            return super()._weight_jac_t_mat_prod(
                module, g_inp, g_out, mat, sum_batch=sum_batch, subsampling=subsampling
            )
        warn_if_block_missed(recorded, _describe(module))
        x = subsample(module.input0, subsampling=subsampling)
        # mat [V, N, C_out, *T]: one weight VJP per vector v
        return torch.stack(
            [
                conv_weight_grad(module, x, m, recorded.strategy_settings, per_sample=not sum_batch)
                for m in mat
            ]
        )


class Conv1dDerivatives(_MemconvWeightJacobian, Conv1DDerivatives):
    """BackPACK's ``Conv1DDerivatives`` with memconv's weight Jacobian."""


class Conv2dDerivatives(_MemconvWeightJacobian, Conv2DDerivatives):
    """BackPACK's ``Conv2DDerivatives`` with memconv's weight Jacobian."""


class Conv3dDerivatives(_MemconvWeightJacobian, Conv3DDerivatives):
    """BackPACK's ``Conv3DDerivatives`` with memconv's weight Jacobian."""


class ConvTranspose1dDerivatives(_MemconvWeightJacobian, ConvTranspose1DDerivatives):
    """BackPACK's ``ConvTranspose1DDerivatives`` with memconv's weight Jacobian."""


class ConvTranspose2dDerivatives(_MemconvWeightJacobian, ConvTranspose2DDerivatives):
    """BackPACK's ``ConvTranspose2DDerivatives`` with memconv's weight Jacobian."""


class ConvTranspose3dDerivatives(_MemconvWeightJacobian, ConvTranspose3DDerivatives):
    """BackPACK's ``ConvTranspose3DDerivatives`` with memconv's weight Jacobian."""
