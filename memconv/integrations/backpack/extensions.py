"""BackPACK module extensions for convolutions, built from BackPACK's own classes.

For each covered first-order extension and each convolution class, BackPACK's own
module-extension base class is instantiated with memconv's derivatives
(:mod:`.derivatives`): ``BatchGrad``, ``SumGradSquared`` and ``Variance`` then need no
reduction code of memconv's. ``BatchL2Grad`` has its own weight rule: the squared
per-sample norms by memconv's norm routes (:mod:`memconv.norms`: ghost norms per
group where they are cheaper, no per-sample gradients), which, unlike BackPACK's
convolution shortcut, is correct for ``groups > 1``.

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

from backpack.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from backpack.extensions.firstorder.batch_grad.batch_grad_base import BatchGradBase
from backpack.extensions.firstorder.batch_l2_grad.batch_l2_base import BatchL2Base
from backpack.extensions.firstorder.gradient.base import GradBaseModule
from backpack.extensions.firstorder.sum_grad_squared.sgs_base import SGSBase
from backpack.extensions.firstorder.variance.variance_base import VarianceBaseModule
from torch import nn

from ...norms import conv_weight_sq_norms
from . import derivatives

#: BackPACK extensions whose convolution quantities memconv computes.
COVERED = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)

DERIVATIVES = {
    nn.Conv1d: derivatives.Conv1dDerivatives,
    nn.Conv2d: derivatives.Conv2dDerivatives,
    nn.Conv3d: derivatives.Conv3dDerivatives,
    nn.ConvTranspose1d: derivatives.ConvTranspose1dDerivatives,
    nn.ConvTranspose2d: derivatives.ConvTranspose2dDerivatives,
    nn.ConvTranspose3d: derivatives.ConvTranspose3dDerivatives,
}
PARAMS = ["bias", "weight"]


class BatchL2(BatchL2Base):
    """``BatchL2Grad`` for a convolution: per-sample squared norms by memconv's routes.

    A ``torch.nn`` layer gets the block open at backward time, else ``"standard"``
    (:func:`memconv.integrations.backpack.derivatives.settings_for`).
    """

    def __init__(self, derivatives):
        super().__init__(PARAMS, derivatives=derivatives)

    def weight(self, ext, module, g_inp, g_out, backproped):
        settings = derivatives.settings_for(module)
        return conv_weight_sq_norms(
            module, module.input0, g_out[0], settings, None, settings.options.memory_budget
        )


def module_extension(ext, conv_cls):
    """memconv's module extension of a covered BackPACK extension for ``conv_cls``.

    Args:
        ext: a ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared`` or ``Variance`` object.
        conv_cls: a ``torch.nn`` convolution or transposed-convolution class.
    """
    d = DERIVATIVES[conv_cls]()
    if isinstance(ext, BatchGrad):
        return BatchGradBase(derivatives=d, params=PARAMS)
    if isinstance(ext, SumGradSquared):
        return SGSBase(derivatives=d, params=PARAMS)
    if isinstance(ext, Variance):
        return VarianceBaseModule(
            params=PARAMS,
            grad_extension=GradBaseModule(derivatives=d, params=PARAMS),
            sgs_extension=SGSBase(derivatives=d, params=PARAMS),
        )
    return BatchL2(d)
