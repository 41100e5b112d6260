"""BackPACK's KFAC, KFLR and KFRA on convolutions through memconv: no unfold, groups.

BackPACK 1.7.1's module extensions of its Kronecker-factored extensions
(``HBPConvNd``, ``HBPConvTransposeNd``) unfold the layer input for the input factor
(K times the input at stride 1), pad it with zeros whatever the padding mode, and
refuse ``groups ≠ 1``. The subclasses here keep everything else of BackPACK's (the
backpropagated quantities, the output factor, the bias, the savefields ``kfac``,
``kflr``, ``kfra``) and take the input factor from
:func:`memconv.conv.kronecker.input_factor`: a few large products per slab of
patches (every offset's patches of a chunk of samples, one strided copy), every
padding mode, and block-diagonal factors per group (the convention is in
:mod:`memconv.conv.kronecker`: ``[A, Ω]`` with ``A [G, C_out/G, C_out/G]`` and
``Ω [G, C_in/G·K, C_in/G·K]`` for ``groups = G > 1``; BackPACK's 2-d shapes for
``G = 1``).

Two layers of every torchvision ResNet that BackPACK's Kronecker-factored extensions
lack get module extensions too: ``AdaptiveAvgPool1d/2d/3d`` (BackPACK's own
adaptive-pooling derivatives: an input size that is a multiple of the output size,
BackPACK raises otherwise) and, for KFAC and KFLR, ``BatchNorm1d/2d/3d`` in eval mode
(:class:`HBPBatchNormNd`). For torchvision's ConvNeXt, KFAC and KFLR get module
extensions for ``nn.Linear`` on ``[N, *, C_in]`` (:class:`HBPLinearShared`: the
factors of the equivalent 1×1 convolution; BackPACK's raise for inputs that are not
2-d) and for the ``Permute`` modules of BackPACK's converter (:class:`HBPPermute`).

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import copy
import math

from backpack.core.derivatives.adaptive_avg_pool_nd import AdaptiveAvgPoolNDDerivatives
from backpack.core.derivatives.avgpoolnd import AvgPoolNDDerivatives
from backpack.core.derivatives.batchnorm_nd import BatchNormNdDerivatives
from backpack.core.derivatives.permute import PermuteDerivatives
from backpack.custom_module.permute import Permute
from backpack.extensions.secondorder.hbp import KFAC, KFLR, KFRA
from backpack.extensions.secondorder.hbp.conv_transposend import HBPConvTransposeNd
from backpack.extensions.secondorder.hbp.convnd import HBPConvNd
from backpack.extensions.secondorder.hbp.hbp_options import (
    BackpropStrategy,
    ExpectationApproximation,
)
from backpack.extensions.secondorder.hbp.hbpbase import HBPBaseModule
from backpack.extensions.secondorder.hbp.linear import HBPLinear
from backpack.utils.errors import batch_norm_raise_error_if_train
from torch import Tensor, nn

from ..._checks import KFAC_APPROXIMATIONS, KRON_GROUPS, check_budget, check_choice
from ...conv.kronecker import block_diagonal, input_factor, output_factor
from ...strategies.geometry import conv_function, conv_spec, conv_transpose_function
from .extensions import DERIVATIVES, _tied
from .naming import describe

#: BackPACK extensions whose convolution factors memconv computes.
KRONECKER = (KFAC, KFLR, KFRA)

#: Each convolution class: BackPACK's HBP base module and its number of spatial axes
#: (the derivatives are memconv's, ``DERIVATIVES`` of the extensions module).
_CONVS = {
    nn.Conv1d: (HBPConvNd, 1),
    nn.Conv2d: (HBPConvNd, 2),
    nn.Conv3d: (HBPConvNd, 3),
    nn.ConvTranspose1d: (HBPConvTransposeNd, 1),
    nn.ConvTranspose2d: (HBPConvTransposeNd, 2),
    nn.ConvTranspose3d: (HBPConvTransposeNd, 3),
}
_POOLS = {nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3}
_AVG_POOLS = {nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3}
#: The layers besides convolutions (and ``nn.Linear``, a class memconv converts) that
#: memconv gives module extensions for.
OTHER_LAYERS = (*_POOLS, *_AVG_POOLS, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, Permute)


class _KroneckerWeight:
    """The weight factors ``[A, Ω]`` of BackPACK's HBP module extension, by memconv."""

    def __init__(self, dims, derivatives_cls, kfac_approx, memory_budget, kron_groups="blocks"):
        super().__init__(dims)
        self.derivatives = derivatives_cls()  # BackPACK's, memconv's weight Jacobian
        self.kfac_approx = kfac_approx
        self.memory_budget = memory_budget
        self.kron_groups = kron_groups

    def weight(self, ext, module, g_inp, g_out, backproped):
        """``[A, Ω]``: BackPACK's output factor (block diagonal per group) and
        :func:`memconv.conv.kronecker.input_factor` (the layer's geometry read once,
        passed down as ``spec=``)."""
        if ExpectationApproximation.should_average_param_jac(ext.get_ea_strategy()):
            raise NotImplementedError(
                f"{type(ext).__name__} on {describe(module)}: an expectation "
                "approximation that averages the parameter Jacobian is undefined for "
                "convolutions (as in BackPACK); use the default ea_strategy "
                "(ExpectationApproximation.BOTEV_MARTENS)"
            )
        blocks = module.groups if self.kron_groups == "blocks" else 1
        if BackpropStrategy.is_batch_average(ext.get_backprop_strategy()):  # KFRA
            a = block_diagonal(self._factor_from_batch_average(module, backproped), blocks)
        else:  # KFAC, KFLR
            a = output_factor(backproped, blocks)
        layer, x = module, module.input0
        if module.groups > 1 and self.kron_groups == "average":
            layer, x = _group_average(module, x)
        spec = conv_spec(layer)
        if spec.transposed:
            self._warn_approximation_transpose_weight()
        omega = input_factor(
            layer,
            x,
            kfac_approx=self.kfac_approx,
            memory_budget=self.memory_budget,
            spec=spec,
        )
        return [a, omega]


def _group_average(module: nn.Module, x: Tensor) -> tuple[nn.Module, Tensor]:
    """A grouped convolution's input averaged over its ``G`` groups, ``[N, C_in/G, *S]``,
    and a shallow copy of the layer with ``groups = 1`` and ``C_in/G`` input channels
    (its geometry; the parameters are the layer's, not used): the input factor of
    ``kron_groups="average"``.

    Raises:
        NotImplementedError: for a transposed convolution, naming it.
    """
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        raise NotImplementedError(
            f"kron_groups='average' on {describe(module)}: a grouped transposed "
            "convolution has no averaged input factor in memconv; use kron_groups='blocks'"
        )
    g = module.groups
    layer = copy.copy(module)  # the attributes' dict copied, the parameters shared
    layer.groups, layer.in_channels = 1, module.in_channels // g
    return layer, x.unflatten(1, (g, -1)).mean(1)


class AdaptiveAvgPoolDerivatives(AdaptiveAvgPoolNDDerivatives):
    """BackPACK's ``AdaptiveAvgPoolNDDerivatives`` with its transposed Jacobian in the
    input's dtype: each output entry spread evenly over its window (BackPACK's runs
    a float32 transposed convolution, which fails on float64 inputs)."""

    def _spread(self, module, mat: Tensor, start: int) -> Tensor:
        """Jᵀ on the trailing spatial axes of ``mat`` (from axis ``start``)."""
        self.check_parameters(module)
        stride, kernel, _ = self.get_avg_pool_parameters(module)  # stride == kernel here
        for i, k in enumerate(kernel):
            mat = mat.repeat_interleave(k, dim=start + i)
        return mat / math.prod(kernel)

    def _jac_t_mat_prod(self, module, g_inp, g_out, mat, subsampling=None):
        return self._spread(module, mat, 3)

    def ea_jac_t_mat_jac_prod(self, module, g_inp, g_out, mat):
        out_shape, in_shape = module.output.shape[1:], module.input0.shape[1:]
        rows = self._spread(module, mat.reshape(-1, *out_shape), 2).reshape(mat.shape[0], -1)
        both = self._spread(module, rows.T.reshape(-1, *out_shape), 2)
        return both.reshape(math.prod(in_shape), math.prod(in_shape))


def _per_axis(value, dims: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims


class AvgPoolDerivatives(AvgPoolNDDerivatives):
    """BackPACK's ``AvgPoolNDDerivatives`` with its constant kernel a tensor in the
    input's dtype: BackPACK builds a float32 ``ConvNd`` module and sets its weight's
    ``.data``, which fails on float64 inputs and which a traced step cannot see (the
    module's random initial weight would be read instead; :func:`memconv.integrations.
    backpack.step`). The Jacobian is BackPACK's: a convolution of each channel with
    the constant ``1/K`` kernel (``count_include_pad=True``, which BackPACK asserts)."""

    def _geometry(self, module, like: Tensor) -> tuple:
        stride, kernel, padding = (
            _per_axis(v, self.N) for v in self.get_avg_pool_parameters(module)
        )
        weight = like.new_full((1, 1, *kernel), 1.0 / math.prod(kernel))
        return weight, stride, kernel, padding

    # BackPACK's private helpers (name-mangled), the only place its kernel is made
    def _AvgPoolNDDerivatives__apply_jacobian_of(self, module, mat: Tensor) -> Tensor:
        weight, stride, _, padding = self._geometry(module, mat)
        return conv_function(self.N)(mat, weight, stride=stride, padding=padding)

    def _AvgPoolNDDerivatives__apply_jacobian_t_of(self, module, mat: Tensor) -> Tensor:
        weight, stride, kernel, padding = self._geometry(module, mat)
        sizes = zip(module.input0.shape[2:], mat.shape[2:], stride, padding, kernel)
        extra = [i - ((o - 1) * s - 2 * p + k) for i, o, s, p, k in sizes]
        return conv_transpose_function(self.N)(
            mat, weight, stride=stride, padding=padding, output_padding=extra
        )


def pool_derivatives(module_class) -> AdaptiveAvgPoolDerivatives | AvgPoolDerivatives | None:
    """memconv's derivatives of an (adaptive) average-pooling class, None for others."""
    kinds = ((_POOLS, AdaptiveAvgPoolDerivatives), (_AVG_POOLS, AvgPoolDerivatives))
    for pools, derivatives in kinds:
        for pool, dims in pools.items():
            if issubclass(module_class, pool):
                return derivatives(N=dims)
    return None


class HBPBatchNormNd(HBPBaseModule):
    """KFAC and KFLR on ``BatchNorm1d/2d/3d`` in eval mode (BackPACK's Kronecker
    extensions have none): the backpropagated square root through BackPACK's own
    ``BatchNormNdDerivatives``, and for ``weight`` (γ) and ``bias`` (β) one factor
    each, their (MC or exact) GGN ``[C, C]``: ``Σᵥₙ (Jᵀ Sᵥₙ)(Jᵀ Sᵥₙ)ᵀ``, as BackPACK's
    factor of a Linear layer's bias. In training mode BackPACK's error (samples are
    mixed) is raised before the layer's quantities."""

    def __init__(self):
        super().__init__(derivatives=BatchNormNdDerivatives(), params=["weight", "bias"])

    def check_hyperparameters_module_extension(self, ext, module, g_inp, g_out):
        batch_norm_raise_error_if_train(module)

    def weight(self, ext, module, g_inp, g_out, backproped):
        """``[G_γ]``, ``[C, C]``."""
        vjps = self.derivatives.param_mjp(
            "weight", module, g_inp, g_out, backproped, sum_batch=False
        )
        return [_gram(vjps)]

    def bias(self, ext, module, g_inp, g_out, backproped):
        """``[G_β]``, ``[C, C]``."""
        vjps = self.derivatives.param_mjp("bias", module, g_inp, g_out, backproped, sum_batch=False)
        return [_gram(vjps)]


def _gram(vjps: Tensor) -> Tensor:
    """``Σᵥₙ jᵥₙ jᵥₙᵀ`` of per-row VJPs ``[V, N, *P]`` (``P``: the parameter's shape,
    flattened)."""
    rows = vjps.flatten(end_dim=1).flatten(start_dim=1)
    return rows.T @ rows


class HBPLinearShared(HBPLinear):
    """KFAC and KFLR on ``nn.Linear`` applied to ``[N, *, C_in]`` (BackPACK's
    ``HBPLinear`` raises for inputs that are not 2-d; torchvision's ``CNBlock`` applies
    its Linear layers to the channels-last ``[N, H, W, C]``).

    The factors are those of the equivalent 1×1 convolution (the axes ``*`` are its
    positions ``T``; :mod:`memconv.conv.kronecker`'s convention): ``A = Σᵥₙ (Σₜ Sᵥₙₜ)
    (Σₜ Sᵥₙₜ)ᵀ`` (the GGN of the bias, which is also the bias's factor) and ``Ω =
    (1/N) Σₙₜ xₙₜ xₙₜᵀ`` (``"expand"``) or ``(1/N) Σₙ x̄ₙ x̄ₙᵀ`` with ``x̄ₙ`` the mean
    over the positions (``"reduce"``). A 2-d input keeps BackPACK's own computation.
    """

    def __init__(self, kfac_approx: str = "expand"):
        super().__init__()
        self.kfac_approx = kfac_approx

    def check_parameters(self, ext, module) -> None:
        if module.input0.dim() == 2:
            super().check_parameters(ext, module)
        elif BackpropStrategy.is_batch_average(ext.get_backprop_strategy()) or (
            ExpectationApproximation.should_average_param_jac(ext.get_ea_strategy())
        ):
            raise NotImplementedError(
                f"{type(ext).__name__} on {describe(module)} with an input of shape "
                f"{tuple(module.input0.shape)}: memconv's factors of a Linear layer on "
                "[N, *, C_in] need the backpropagated square root (KFAC, KFLR) and the "
                "default ea_strategy"
            )

    def weight(self, ext, module, g_inp, g_out, backproped):
        """``[A, Ω]``: ``[C_out, C_out]`` and ``[C_in, C_in]``."""
        if module.input0.dim() == 2:
            return super().weight(ext, module, g_inp, g_out, backproped)
        self.check_parameters(ext, module)
        x = module.input0
        if self.kfac_approx == "reduce":
            x = x.flatten(1, -2).mean(1)
        rows = x.reshape(-1, x.shape[-1])
        return [self._output_factor(backproped), rows.T @ rows / x.shape[0]]

    def bias(self, ext, module, g_inp, g_out, backproped):
        """``[A]``, ``[C_out, C_out]``."""
        if module.input0.dim() == 2:
            return super().bias(ext, module, g_inp, g_out, backproped)
        self.check_parameters(ext, module)
        return [self._output_factor(backproped)]

    @staticmethod
    def _output_factor(backproped: Tensor) -> Tensor:
        """``Σᵥₙ (Σₜ Sᵥₙₜ)(Σₜ Sᵥₙₜ)ᵀ`` from ``S [V, N, *, C_out]``."""
        return _gram(backproped.flatten(2, -2).sum(2))


class HBPPermute(HBPBaseModule):
    """KFAC and KFLR through BackPACK's converter's ``Permute`` module (which its
    Kronecker extensions lack): BackPACK's own ``PermuteDerivatives``."""

    def __init__(self):
        super().__init__(derivatives=PermuteDerivatives())


class HBPAvgPoolNd(HBPBaseModule):
    """BackPACK's Kronecker-factored extensions on ``AdaptiveAvgPool1d/2d/3d`` (an
    input size that is a multiple of the output's; BackPACK raises otherwise) and
    ``AvgPool1d/2d/3d``, with :func:`pool_derivatives`."""

    def __init__(self, derivatives):
        super().__init__(derivatives=derivatives)


def module_extension(
    ext, module_class, *, kfac_approx: str = "expand", memory_budget=None, kron_groups="blocks"
):
    """memconv's module extension of a BackPACK KFAC/KFLR/KFRA object for a layer class.

    Args:
        ext: a BackPACK extension object.
        module_class: a layer class: ``torch.nn.Conv1d/2d/3d``,
            ``ConvTranspose1d/2d/3d`` or a subclass (memconv's),
            ``AdaptiveAvgPool1d/2d/3d``, ``AvgPool1d/2d/3d``, or ``BatchNorm1d/2d/3d`` (KFAC and KFLR; in
            eval mode), ``nn.Linear`` (KFAC and KFLR; on ``[N, *, C_in]`` as well as
            ``[N, C_in]``) or BackPACK's converter's ``Permute`` (KFAC and KFLR).
            :data:`OTHER_LAYERS` lists the classes besides convolutions and Linear.
        kfac_approx: the input factor, ``"expand"`` (BackPACK's) or ``"reduce"``
            (KFAC-reduce); see :mod:`memconv.conv.kronecker`.
        memory_budget: bytes the input factor's slab of patches may take (None: 4
            times the padded layer input's); see
            :func:`memconv.conv.kronecker.input_factor`.
        kron_groups: a grouped convolution's weight factors (``groups = G > 1``):
            ``"blocks"`` (memconv's convention, one product per group: ``A [G,
            C_out/G, C_out/G]``, ``Ω [G, C_in/G·K, C_in/G·K]``) or ``"average"`` (one
            product, BackPACK's 2-d shapes: ``A [C_out, C_out]`` the full output
            factor and ``Ω [C_in/G·K, C_in/G·K]`` the input factor of the input
            averaged over the groups, curvlinops' ``KFACLinearOperator`` convention;
            what laplace-torch's ``Kron`` holds). Convolutions only (a grouped
            transposed convolution raises with ``"average"``).

    Returns:
        The module extension, or None when ``ext`` is not a ``KFAC``, ``KFLR`` or
        ``KFRA`` object or ``module_class`` is not one of these layers.

    Raises:
        ValueError: for an unknown ``kfac_approx`` or a non-positive budget.
        TypeError: for a budget that is not an int.
    """
    check_choice(kfac_approx, KFAC_APPROXIMATIONS, "kfac_approx", none=False)
    check_choice(kron_groups, KRON_GROUPS, "kron_groups", none=False)
    check_budget(memory_budget, available=False, where="module_extension")
    if not isinstance(ext, KRONECKER) or not isinstance(module_class, type):
        return None
    pool = pool_derivatives(module_class)
    if pool is not None:
        return HBPAvgPoolNd(pool)
    if issubclass(module_class, Permute):
        # KFRA backpropagates a batch average, which Permute's derivatives lack
        return None if isinstance(ext, KFRA) else HBPPermute()
    if issubclass(module_class, nn.Linear):
        # KFRA: BackPACK's own (2-d inputs only)
        return None if isinstance(ext, KFRA) else _tied(HBPLinearShared)(kfac_approx)
    if issubclass(module_class, nn.modules.batchnorm._BatchNorm):
        # KFRA backpropagates a batch average, which BatchNorm's derivatives lack
        return None if isinstance(ext, KFRA) else _tied(HBPBatchNormNd)()
    for conv, (base, dims) in _CONVS.items():
        if issubclass(module_class, conv):
            cls = _tied(type(base.__name__, (_KroneckerWeight, base), {"__module__": __name__}))
            return cls(dims, DERIVATIVES[conv], kfac_approx, memory_budget, kron_groups)
    return None
