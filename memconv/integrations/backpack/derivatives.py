"""memconv's weight Jacobian for BackPACK: subclasses of BackPACK's conv derivatives.

BackPACK chooses the weight-Jacobian algorithm of a convolution in
``ConvNDDerivatives._weight_jac_t_mat_prod`` (and ``ConvTransposeNDDerivatives``'s);
these subclasses compute it with the memconv strategy that the layer's forward pass
recorded (the rule of :class:`memconv.save_memory`). A ``torch.nn`` convolution,
whose forward pass recorded nothing, gets memconv's exact weight Jacobian too, with
the strategy of the :class:`memconv.save_memory` block open at backward time, else
``"standard"`` (BackPACK's own algorithm, in memconv's exact form: every padding mode,
``padding="same"``, transposed convolutions with groups and ``output_padding``).

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import torch
from backpack.core.derivatives.conv1d import Conv1DDerivatives
from backpack.core.derivatives.conv2d import Conv2DDerivatives
from backpack.core.derivatives.conv3d import Conv3DDerivatives
from backpack.core.derivatives.conv_transpose1d import ConvTranspose1DDerivatives
from backpack.core.derivatives.conv_transpose2d import ConvTranspose2DDerivatives
from backpack.core.derivatives.conv_transpose3d import ConvTranspose3DDerivatives
from backpack.utils.subsampling import subsample

from ..._checks import CONV_TYPES
from ...conv.grads import conv_weight_grad
from ...conv.settings import Settings, block_settings, use_block_settings, warn_if_block_missed
from ...modules import _ConvFunction, _describe
from ...strategies import NO_OPTIONS

#: BackPACK's own algorithm (a grouped convolution of the same order), memconv's form.
STANDARD = Settings("standard", NO_OPTIONS)


def recorded_settings(module):
    """What the layer's last forward pass with gradients recorded, or None when it did
    not run through memconv (BackPACK stores that output as ``module.output``)."""
    grad_fn = getattr(getattr(module, "output", None), "grad_fn", None)
    if type(grad_fn) is _ConvFunction._backward_cls:
        return grad_fn.recorded
    return None


def settings_for(module, default: Settings = STANDARD) -> Settings:
    """The strategy settings of a layer's weight Jacobian: what its memconv forward pass
    recorded; for a ``torch.nn`` layer, the :class:`memconv.save_memory` block open now
    (at backward time), else ``default`` (``"standard"``)."""
    recorded = recorded_settings(module)
    if recorded is not None:
        warn_if_block_missed(recorded, _describe(module))
        return recorded.strategy_settings
    if block_settings() is None:
        return default
    return use_block_settings(None)  # the open block (marked as used)


class _MemconvWeightJacobian:
    """``_weight_jac_t_mat_prod`` by memconv's strategies."""

    def _weight_jac_t_mat_prod(self, module, g_inp, g_out, mat, sum_batch=True, subsampling=None):
        settings = settings_for(module)
        x = subsample(module.input0, subsampling=subsampling)
        # mat [V, N, C_out, *T]: one weight VJP per vector v
        return torch.stack(
            [conv_weight_grad(module, x, m, settings, per_sample=not sum_batch) for m in mat]
        )


class _ExactInputJacobian:
    """``_jac_t_mat_prod`` of a convolution whose padding BackPACK's transposed
    convolution ignores (``padding_mode != "zeros"``, ``padding="same"``): the input
    VJP of the layer's own forward function (linear, so taken at a zero input) by
    autograd; BackPACK's own otherwise."""

    def _jac_t_mat_prod(self, module, g_inp, g_out, mat, subsampling=None):
        if module.padding_mode == "zeros" and not isinstance(module.padding, str):
            return super()._jac_t_mat_prod(module, g_inp, g_out, mat, subsampling=subsampling)
        base = next(cls for cls in CONV_TYPES if isinstance(module, cls))
        rows = mat.reshape(-1, *mat.shape[2:])
        z = rows.new_zeros((rows.shape[0], *module.input0.shape[1:]), requires_grad=True)
        with torch.enable_grad():
            out = base._conv_forward(module, z, module.weight.detach(), None)
            (jac_t,) = torch.autograd.grad(out, z, rows)
        return jac_t.reshape(*mat.shape[:2], *jac_t.shape[1:])


class Conv1dDerivatives(_ExactInputJacobian, _MemconvWeightJacobian, Conv1DDerivatives):
    """BackPACK's ``Conv1DDerivatives`` with memconv's weight Jacobian."""


class Conv2dDerivatives(_ExactInputJacobian, _MemconvWeightJacobian, Conv2DDerivatives):
    """BackPACK's ``Conv2DDerivatives`` with memconv's weight Jacobian."""


class Conv3dDerivatives(_ExactInputJacobian, _MemconvWeightJacobian, Conv3DDerivatives):
    """BackPACK's ``Conv3DDerivatives`` with memconv's weight Jacobian."""


class ConvTranspose1dDerivatives(_MemconvWeightJacobian, ConvTranspose1DDerivatives):
    """BackPACK's ``ConvTranspose1DDerivatives`` with memconv's weight Jacobian."""


class ConvTranspose2dDerivatives(_MemconvWeightJacobian, ConvTranspose2DDerivatives):
    """BackPACK's ``ConvTranspose2DDerivatives`` with memconv's weight Jacobian."""


class ConvTranspose3dDerivatives(_MemconvWeightJacobian, ConvTranspose3DDerivatives):
    """BackPACK's ``ConvTranspose3DDerivatives`` with memconv's weight Jacobian."""
