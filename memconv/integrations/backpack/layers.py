"""BackPACK module extensions for the layers of ConvNeXt that BackPACK 1.7.1 lacks.

timm's ConvNeXt (Liu et al. 2022, "A ConvNet for the 2020s") has three layers that
no BackPACK extension can see:

- ``LayerNorm2d``: a LayerNorm over the channels of ``[N, C, H, W]``, written as a
  permute to channels-last, ``F.layer_norm`` and a permute back (a module whose
  ``forward`` BackPACK's converter traces into, leaving a function call);
- the layer scale ``gamma``: a parameter of the block itself, multiplied in its
  ``forward`` (``x.mul(self.gamma.reshape(1, -1, 1, 1))``; timm's ``LayerScale2d``);
- ``nn.GELU``, which BackPACK has no derivatives for.

:func:`memconv.integrations.backpack.extend` replaces the first two by the modules
:class:`LayerNorm2d` and :class:`LayerScale2d` here (sharing the model's
parameters); :func:`module_extension` gives them and ``nn.GELU`` BackPACK module
extensions built from BackPACK's own base classes with the derivatives here, for
every extension memconv covers:

- the diagonal and square-root extensions (``{Batch}DiagGGN{Exact,MC}``,
  ``SqrtGGN{Exact,MC}``): the factor ``S`` is backpropagated by the exact input
  Jacobian, the parameters' quantities are BackPACK's from their per-row VJPs;
- ``{Batch}DiagHessian``: GELU (its second derivative is elementwise) and the layer
  scale (linear in its input); the layer norm raises, naming the layer: its output's
  Hessian with respect to its input is not diagonal, which BackPACK's residual terms
  require;
- ``KFAC`` and ``KFLR``: GELU backpropagates the square root; the layer norm's
  ``weight`` and ``bias`` and the layer scale's ``gamma`` get one factor each, their
  GGN ``[C, C]`` (``Σᵥₙ (Jᵀ Sᵥₙ)(Jᵀ Sᵥₙ)ᵀ``), the convention of BatchNorm's γ and β
  (:mod:`memconv.integrations.backpack.kronecker`). ``KFRA`` (a batch-averaged
  backpropagation, which these derivatives lack) raises, naming the layer;
- the first-order ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared`` and ``Variance``
  from the same derivatives.

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import torch
from backpack.core.derivatives.basederivatives import BaseParameterDerivatives
from backpack.core.derivatives.elementwise import ElementwiseDerivatives
from backpack.core.derivatives.scale_module import ScaleModuleDerivatives
from backpack.extensions import (
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from backpack.extensions.firstorder.batch_grad.batch_grad_base import BatchGradBase
from backpack.extensions.firstorder.batch_l2_grad.batch_l2_base import BatchL2Base
from backpack.extensions.firstorder.gradient.base import GradBaseModule
from backpack.extensions.firstorder.sum_grad_squared.sgs_base import SGSBase
from backpack.extensions.firstorder.variance.variance_base import VarianceBaseModule
from backpack.extensions.module_extension import ModuleExtension
from backpack.extensions.secondorder.diag_ggn.diag_ggn_base import DiagGGNBaseModule
from backpack.extensions.secondorder.diag_hessian.diag_h_base import DiagHBaseModule
from backpack.extensions.secondorder.hbp.hbpbase import HBPBaseModule
from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule
from backpack.utils.subsampling import subsample
from torch import Tensor, nn

from .kronecker import _AVG_POOLS, _POOLS, _gram, pool_derivatives
from .naming import describe


class LayerNorm2d(nn.LayerNorm):
    """timm's ``LayerNorm2d`` as a module BackPACK's extensions see: a LayerNorm over
    the channels of ``[N, C, *S]`` (``F.layer_norm`` on the channels-last view).

    Args:
        num_channels: C.
        eps: added to the variance.
        affine: a ``weight`` and ``bias`` of shape ``[C]``.
    """

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True):
        super().__init__(num_channels, eps=eps, elementwise_affine=affine)

    def forward(self, x: Tensor) -> Tensor:
        x = x.movedim(1, -1)
        x = nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.movedim(-1, 1)


class LayerScale2d(nn.Module):
    """timm's ``LayerScale2d``: ``x · gamma`` per channel of ``[N, C, *S]``.

    Args:
        gamma: the scale, the model's own parameter (shared): ``[C]`` (timm's
            ``gamma``, reshaped to ``[1, C, 1, …]`` in its block's ``forward``) or
            ``[C, 1, …, 1]`` with one 1 per spatial axis (torchvision's ``CNBlock``
            multiplies its ``layer_scale [C, 1, 1]`` by ``[N, C, H, W]`` directly).

    Raises:
        ValueError: in ``forward``, for a ``[C, 1, …, 1]`` scale whose rank is not the
            input's less one (its broadcast would not be per channel).
    """

    def __init__(self, gamma: nn.Parameter):
        super().__init__()
        self.gamma = gamma

    def forward(self, x: Tensor) -> Tensor:
        if self.gamma.dim() > 1 and self.gamma.dim() != x.dim() - 1:
            raise ValueError(
                f"LayerScale2d: a scale of shape {tuple(self.gamma.shape)} on an input of "
                f"shape {tuple(x.shape)} is not a per-channel scale"
            )
        return x * self.gamma.reshape(1, -1, *([1] * (x.dim() - 2)))


def _spatial_sum(t: Tensor, sum_batch: bool) -> Tensor:
    """``[V, N, C, *S]`` summed over ``S`` (and ``N`` if ``sum_batch``)."""
    dims = tuple(range(3, t.dim()))
    t = t.sum(dims) if dims else t
    return t.sum(1) if sum_batch else t


class LayerNorm2dDerivatives(BaseParameterDerivatives):
    """Derivatives of :class:`LayerNorm2d` (Ba et al. 2016), normalising over axis 1.

    With ``x̂ = (x − μ)/σ`` over the channels at each position and ``ĝ = g · weight``,
    the input VJP is ``(ĝ − mean_C ĝ − x̂ · mean_C(ĝ x̂)) / σ``; the weight VJP is
    ``Σ_S g x̂`` and the bias VJP ``Σ_S g`` per sample.
    """

    def hessian_is_zero(self, module) -> bool:
        return False

    def hessian_is_diagonal(self, module) -> bool:
        return False

    @staticmethod
    def _axes(module, x: Tensor) -> tuple[int, ...]:
        """The axes of the input ``x`` normalised over: the channels."""
        return (1,)

    @staticmethod
    def _scaled(module, mat: Tensor) -> Tensor:
        """``mat [V, N, ...]`` times the affine weight, broadcast over it."""
        return mat * _channels(module.weight, mat.dim() - 1)

    @staticmethod
    def _summed(module, t: Tensor, sum_batch: bool) -> Tensor:
        """``t [V, N, ...]`` summed over the axes the affine parameters are shared by
        (and ``N`` if ``sum_batch``)."""
        return _spatial_sum(t, sum_batch)

    def _normalised(self, module, subsampling=None):
        x = subsample(module.input0, subsampling=subsampling)
        axes = self._axes(module, x)
        mean = x.mean(axes, keepdim=True)
        var = x.var(axes, unbiased=False, keepdim=True)
        sigma = (var + module.eps).sqrt()
        return (x - mean) / sigma, sigma

    def _jac_t_mat_prod(self, module, g_inp, g_out, mat, subsampling=None):
        xhat, sigma = self._normalised(module, subsampling)
        axes = tuple(a + 1 for a in self._axes(module, xhat))  # mat has V in front
        g = mat if module.weight is None else self._scaled(module, mat)
        inner = g.mean(axes, keepdim=True) + xhat * (g * xhat).mean(axes, keepdim=True)
        return (g - inner) / sigma

    def _weight_jac_t_mat_prod(self, module, g_inp, g_out, mat, sum_batch=True, subsampling=None):
        xhat, _ = self._normalised(module, subsampling)
        return self._summed(module, mat * xhat, sum_batch)

    def _bias_jac_t_mat_prod(self, module, g_inp, g_out, mat, sum_batch=True, subsampling=None):
        return self._summed(module, mat, sum_batch)


class LayerScale2dDerivatives(BaseParameterDerivatives):
    """Derivatives of :class:`LayerScale2d`: ``Jᵀ g = g · gamma``; ``gamma``'s VJP is
    ``Σ_S g x`` per sample."""

    def hessian_is_zero(self, module) -> bool:
        return True

    def _jac_t_mat_prod(self, module, g_inp, g_out, mat, subsampling=None):
        return mat * _channels(module.gamma, mat.dim() - 1)

    def _gamma_jac_t_mat_prod(self, module, g_inp, g_out, mat, sum_batch=True, subsampling=None):
        x = subsample(module.input0, subsampling=subsampling)
        vjp = _spatial_sum(mat * x, sum_batch)  # [V, (N,) C]
        return vjp.reshape(*vjp.shape[:-1], *module.gamma.shape)


class LayerNormDerivatives(LayerNorm2dDerivatives):
    """Derivatives of ``nn.LayerNorm`` (Ba et al. 2016) on ``[N, *, *D]``, normalising
    over its ``normalized_shape`` ``D`` (the trailing axes; torchvision's ``CNBlock``
    applies it to the channels-last ``[N, H, W, C]``).

    With ``x̂ = (x − μ)/σ`` over ``D`` and ``ĝ = g · weight``, the input VJP is
    ``(ĝ − mean_D ĝ − x̂ · mean_D(ĝ x̂)) / σ``; the weight VJP is ``Σ_* g x̂`` and the
    bias VJP ``Σ_* g`` per sample (``*``: the axes between N and D).
    """

    @staticmethod
    def _axes(module, x: Tensor) -> tuple[int, ...]:
        """The trailing axes of ``normalized_shape``."""
        return tuple(range(x.dim() - len(module.normalized_shape), x.dim()))

    @staticmethod
    def _scaled(module, mat: Tensor) -> Tensor:
        return mat * module.weight

    @staticmethod
    def _summed(module, t: Tensor, sum_batch: bool) -> Tensor:
        """``[V, N, *, *D]`` summed over ``*`` (and ``N`` if ``sum_batch``)."""
        dims = tuple(range(1 if sum_batch else 2, t.dim() - len(module.normalized_shape)))
        return t.sum(dims) if dims else t


def _channels(p: Tensor, dims: int) -> Tensor:
    """``[C]`` shaped to broadcast over ``[V, N, C, *S]`` (``dims`` = the rank less V)."""
    return p.reshape(p.shape[0], *([1] * (dims - 2)))


class IdentityDerivatives(ScaleModuleDerivatives):
    """BackPACK's derivatives of ``nn.Identity``, whose Hessian is zero."""

    def hessian_is_zero(self, module) -> bool:
        return True


class GELUDerivatives(ElementwiseDerivatives):
    """Derivatives of ``nn.GELU`` (Hendrycks & Gimpel 2016; ``approximate="none"`` or
    ``"tanh"``): the first and second derivative of the layer's own function,
    elementwise, by autograd."""

    def hessian_is_zero(self, module) -> bool:
        return False

    @staticmethod
    def _derivatives(module, x: Tensor, order: int) -> Tensor:
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            y = nn.functional.gelu(x, approximate=module.approximate)  # not module(x):
            # that would run BackPACK's forward hooks again, replacing its stored output
            (d,) = torch.autograd.grad(y.sum(), x, create_graph=order > 1)
            if order > 1:
                (d,) = torch.autograd.grad(d.sum(), x)
        return d.detach()

    def df(self, module, g_inp, g_out, subsampling=None):
        return self._derivatives(module, subsample(module.input0, subsampling=subsampling), 1)

    def d2f(self, module, g_inp, g_out):
        return self._derivatives(module, module.input0, 2)


#: The parameters of each layer class here (``LayerNorm2d`` before ``nn.LayerNorm``,
#: its base class: :func:`module_extension` takes the first class that matches).
PARAMS = {
    LayerNorm2d: ["bias", "weight"],
    LayerScale2d: ["gamma"],
    nn.GELU: [],
    nn.LayerNorm: ["bias", "weight"],
}
DERIVATIVES = {
    LayerNorm2d: LayerNorm2dDerivatives,
    LayerScale2d: LayerScale2dDerivatives,
    nn.GELU: GELUDerivatives,
    nn.LayerNorm: LayerNormDerivatives,
}
#: The layer classes :func:`module_extension` covers (``nn.Identity``: for
#: ``{Batch}DiagHessian`` only, which BackPACK's lack).
LAYERS = (*DERIVATIVES, *_POOLS, *_AVG_POOLS, nn.Identity)
_DIAG_GGN = (DiagGGNExact, DiagGGNMC, BatchDiagGGNExact, BatchDiagGGNMC)
_PER_SAMPLE = (BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian)


class _Refused(ModuleExtension):
    """A module extension that raises, naming the layer, the extension and the remedy."""

    def __init__(self, why: str, remedy: str):
        super().__init__()
        self.why, self.remedy = why, remedy

    def __call__(self, ext, module, g_inp, g_out):
        raise NotImplementedError(
            f"BackPACK's {type(ext).__name__} on layer {describe(module)}: "
            f"{self.why}; {self.remedy}"
        )


class _DiagHessianParams(DiagHBaseModule):
    """``{Batch}DiagHessian`` of a layer linear in its input: each parameter's
    diagonal ``Σ sign · (Jᵀ S)²`` over BackPACK's signed factors."""

    def __init__(self, derivatives, params, per_sample: bool):
        for name in params:
            setattr(self, name, self._param(name, per_sample))
        super().__init__(derivatives=derivatives, params=params)

    def _param(self, name, per_sample):
        def diagonal(ext, module, g_inp, g_out, backproped):
            total = 0
            for s, sign in zip(backproped["matrices"], backproped["signs"]):
                vjps = self.derivatives.param_mjp(name, module, g_inp, g_out, s, sum_batch=False)
                total = total + sign * vjps.square().sum(0 if per_sample else (0, 1))
            return total

        return diagonal


class _HBPParams(HBPBaseModule):
    """KFAC and KFLR of an elementwise-affine layer: one factor per parameter, its GGN
    ``[C, C]`` from the per-row VJPs (the convention of :class:`.kronecker.HBPBatchNormNd`)."""

    def __init__(self, derivatives, params):
        for name in params:
            setattr(self, name, self._param(name))
        super().__init__(derivatives=derivatives, params=params)

    def _param(self, name):
        def factor(ext, module, g_inp, g_out, backproped):
            vjps = self.derivatives.param_mjp(
                name, module, g_inp, g_out, backproped, sum_batch=False
            )
            return [_gram(vjps)]

        return factor


def module_extension(ext, module_class):
    """memconv's module extension of a BackPACK extension object for ``nn.GELU``,
    :class:`LayerNorm2d` or :class:`LayerScale2d` (or a subclass).

    Returns:
        The module extension, or None for another class or an extension memconv does
        not cover.
    """
    cls = next((c for c in LAYERS if issubclass(module_class, c)), None)
    if cls is None:
        return None
    if cls is nn.Identity:
        hessian = isinstance(ext, (DiagHessian, BatchDiagHessian))
        return DiagHBaseModule(derivatives=IdentityDerivatives()) if hessian else None
    if cls in _POOLS or cls in _AVG_POOLS:  # BackPACK's pooling, in the input's dtype
        if isinstance(ext, (KFAC, KFLR, KFRA)):
            return None  # :mod:`.kronecker`'s
        d, params = pool_derivatives(cls), []
    else:
        d, params = DERIVATIVES[cls](), PARAMS[cls]
    if isinstance(ext, _DIAG_GGN):
        per_sample = isinstance(ext, _PER_SAMPLE)
        return DiagGGNBaseModule(d, params=params, sum_batch=not per_sample)
    if isinstance(ext, (SqrtGGNExact, SqrtGGNMC)):
        return SqrtGGNBaseModule(d, params=params)
    if isinstance(ext, (DiagHessian, BatchDiagHessian)):
        if cls in (LayerNorm2d, nn.LayerNorm):  # nonlinear, its Hessian not diagonal
            return _Refused(
                "the Hessian of a layer norm's output with respect to its input is not "
                "diagonal, which BackPACK's Hessian backpropagation requires",
                "use DiagGGNExact (the GGN diagonal) or an autograd Hessian",
            )
        return _DiagHessianParams(d, params, isinstance(ext, _PER_SAMPLE))
    if isinstance(ext, KFRA):
        return _Refused(
            "KFRA backpropagates a batch-averaged Hessian, which memconv's derivatives "
            "of this layer do not provide",
            "use KFAC or KFLR",
        )
    if isinstance(ext, (KFAC, KFLR)):
        return _HBPParams(d, params)
    if isinstance(ext, BatchGrad):
        return BatchGradBase(derivatives=d, params=params)
    if isinstance(ext, BatchL2Grad):
        return BatchL2Base(params, derivatives=d)
    if isinstance(ext, SumGradSquared):
        return SGSBase(derivatives=d, params=params)
    if isinstance(ext, Variance):
        return VarianceBaseModule(
            params=params,
            grad_extension=GradBaseModule(derivatives=d, params=params),
            sgs_extension=SGSBase(derivatives=d, params=params),
        )
    return None
