"""BackPACK module extensions for convolutions, built from BackPACK's own classes.

For each covered first-order extension and each convolution class, BackPACK's own
module-extension base class is instantiated with memconv's derivatives
(:mod:`.derivatives`): ``BatchGrad``, ``SumGradSquared`` and ``Variance`` then need no
reduction code of memconv's. ``BatchL2Grad`` has its own weight rule: the squared
per-sample norms by memconv's norm routes (:mod:`memconv.conv.norm_routes`: ghost norms per
group where they are cheaper, no per-sample gradients), which, unlike BackPACK's
convolution shortcut, is correct for ``groups > 1``.

A weight shared by several convolutions (tied) gets the sum over its uses for
``BatchGrad`` (BackPACK itself keeps the last use's only); for the other extensions,
whose quantities of a sum are not sums, the backward pass raises naming the parameter.

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

from ..._torch import graph_task_id
from ...conv.norm_routes import conv_weight_sq_norms
from .derivatives import (
    Conv1dDerivatives,
    Conv2dDerivatives,
    Conv3dDerivatives,
    ConvTranspose1dDerivatives,
    ConvTranspose2dDerivatives,
    ConvTranspose3dDerivatives,
    settings_for,
)
from .naming import describe
from .secondorder import COVERED as SECOND_ORDER
from .secondorder import module_extension as second_order_module_extension

#: BackPACK's first-order extensions whose convolution quantities memconv computes.
FIRST_ORDER = (BatchGrad, BatchL2Grad, SumGradSquared, Variance)
#: Every BackPACK extension whose convolution quantities memconv computes.
COVERED = FIRST_ORDER + SECOND_ORDER

DERIVATIVES = {
    nn.Conv1d: Conv1dDerivatives,
    nn.Conv2d: Conv2dDerivatives,
    nn.Conv3d: Conv3dDerivatives,
    nn.ConvTranspose1d: ConvTranspose1dDerivatives,
    nn.ConvTranspose2d: ConvTranspose2dDerivatives,
    nn.ConvTranspose3d: ConvTranspose3dDerivatives,
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
        settings = settings_for(module)
        return conv_weight_sq_norms(
            module, module.input0, g_out[0], settings, None, settings.options.memory_budget
        )


class _Tied:
    """Mixin of the module extensions: the quantity of a parameter that several
    modules use in one backward pass is summed over the uses (``BatchGrad``) or
    refused.

    Each parameter records the backward pass (autograd's graph task) and the module
    that wrote its quantity last; another write in the same pass is another use.
    """

    def __call__(self, extension, module, g_inp, g_out):
        field = extension.savefield
        task = _graph_task()
        earlier = {}
        for name in PARAMS:
            p = getattr(module, name, None)
            if p is None or not p.requires_grad:
                continue
            mark = getattr(p, "_memconv_backpack_use", None)
            if mark is None or mark[:2] != (field, task) or task is None:
                continue  # left by an earlier pass
            if not isinstance(extension, BatchGrad):
                remedy = (
                    "memconv.per_sample_grads / memconv.per_sample_norms, which sum "
                    "per-sample gradients over the uses"
                    if isinstance(extension, FIRST_ORDER)
                    else "a curvature method that keeps the cross terms between the uses"
                )
                raise ValueError(
                    f"BackPACK's {type(extension).__name__} with memconv: the parameter "
                    f"{name!r} of {describe(module)} is used by several calls in one "
                    "forward pass (tied, or a layer called twice), and its quantity of the "
                    f"sum of the uses is not the sum of theirs: untie it, or use {remedy}"
                )
            earlier[name] = getattr(p, field)
        super().__call__(extension, module, g_inp, g_out)
        for name in PARAMS:
            p = getattr(module, name, None)
            if p is None or not p.requires_grad:
                continue
            if name in earlier:
                setattr(p, field, earlier[name] + getattr(p, field))
            p._memconv_backpack_use = (field, task)


def _graph_task():
    """The id of the backward pass running (autograd's graph task), or None."""
    return graph_task_id()


def _tied(cls):
    return type(cls.__name__, (_Tied, cls), {"__module__": __name__})


def module_extension(ext, conv_cls):
    """memconv's module extension of a covered BackPACK extension for ``conv_cls``.

    Args:
        ext: a first-order (``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared``,
            ``Variance``) or second-order (:data:`.secondorder.COVERED`) extension object.
        conv_cls: a ``torch.nn`` convolution or transposed-convolution class.
    """
    d = DERIVATIVES[conv_cls]()
    if isinstance(ext, SECOND_ORDER):
        return second_order_module_extension(ext, d, wrap=_tied)
    if isinstance(ext, BatchGrad):
        return _tied(BatchGradBase)(derivatives=d, params=PARAMS)
    if isinstance(ext, SumGradSquared):
        return _tied(SGSBase)(derivatives=d, params=PARAMS)
    if isinstance(ext, Variance):
        return _tied(VarianceBaseModule)(
            params=PARAMS,
            grad_extension=GradBaseModule(derivatives=d, params=PARAMS),
            sgs_extension=SGSBase(derivatives=d, params=PARAMS),
        )
    return _tied(BatchL2)(d)
