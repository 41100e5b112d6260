"""BackPACK's second-order module extensions for convolutions, with memconv's weight rules.

What BackPACK propagates between layers (the symmetric factorisation ``S`` of shape
``[V, N, C_out, *T]``, DiagHessian's list of signed factors) stays BackPACK's: these
classes are BackPACK's own base classes (``DiagGGNBaseModule``, ``DiagHBaseModule``,
``SqrtGGNBaseModule``) given memconv's derivatives (:mod:`.derivatives`), whose input
Jacobian is exact for every padding. The weight quantities are memconv's
(:mod:`memconv.conv.curvature`): the diagonals as sums of squared per-row weight VJPs
and SqrtGGN's ``[V, N, *weight.shape]`` rows, by the layer's strategy, in chunks of
rows under the strategy's ``memory_budget``, never forming BackPACK's unfolded input
nor its ``V·N·|W|`` product. The bias quantities are ``S`` summed over space, as
BackPACK's. Each call of a weight rule reads the layer's geometry once
(:func:`memconv.strategies.geometry.conv_spec`) and passes it down as ``spec=``: to
every signed factor of ``{Batch}DiagHessian``, the route's choice and every chunk of
rows; nothing is kept between calls.

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from backpack.extensions import (
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)
from backpack.extensions.secondorder.diag_ggn.diag_ggn_base import DiagGGNBaseModule
from backpack.extensions.secondorder.diag_hessian.diag_h_base import DiagHBaseModule
from backpack.extensions.secondorder.sqrt_ggn.base import SqrtGGNBaseModule
from backpack.utils.subsampling import subsample

from ...conv.curvature import (
    bias_diagonal,
    diagonal_costs,
    diagonal_route,
    gram_bytes,
    gram_diagonal,
    gram_factor,
    weight_diagonal,
    weight_rows,
)
from ...conv.settings import Settings
from ...strategies import NO_OPTIONS
from ...strategies.geometry import conv_spec
from .derivatives import settings_for as _layer_settings

#: The strategy of a ``torch.nn`` layer's rows outside any ``save_memory`` block: the
#: fastest by the cost model (BackPACK's own algorithm, first order's default, is a
#: grouped convolution of ``V·N`` groups here).
AUTO = Settings("auto", NO_OPTIONS)


def settings_for(module) -> Settings:
    """The layer's recorded or open block's settings, else :data:`AUTO`."""
    return _layer_settings(module, AUTO)


#: BackPACK's second-order extensions whose convolution quantities memconv computes.
COVERED = (
    DiagGGNExact,
    DiagGGNMC,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagHessian,
    BatchDiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)
#: Those whose curvature factor ``S`` is exact (``V`` = the model's outputs), not sampled.
EXACT = (DiagGGNExact, BatchDiagGGNExact, DiagHessian, BatchDiagHessian, SqrtGGNExact)
#: Those that keep a quantity per sample.
PER_SAMPLE = (BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian)
PARAMS = ["bias", "weight"]


class _Pending:
    """What a layer whose Gram factor is being summed over chunks of rows leaves as
    its weight quantity until the last chunk (:func:`finish_gram`): not a tensor, so
    that any use of it fails."""

    def __repr__(self):
        return "<memconv: weight diagonal pending over chunks of rows>"


#: The weight quantity of a layer accumulating its Gram factor (:class:`_Pending`).
PENDING = _Pending()
#: While a chunked replay runs: ``{module: A summed so far, or None}`` of the layers
#: whose weight diagonal takes the Gram route over all the chunks' rows.
_ACCUMULATING: contextvars.ContextVar = contextvars.ContextVar("memconv_gram", default=None)


@dataclass(frozen=True)
class GramCandidate:
    """A convolution whose weight diagonal over all ``V`` rows takes the Gram route
    (:func:`memconv.conv.curvature.diagonal_route` with the whole factor's shape):
    what keeping its ``A`` over chunks of rows costs and saves.

    Attributes:
        module: the layer.
        nbytes: bytes of its ``A``, ``N·C_out·T²`` numbers, held from the first chunk
            to the last.
        rows_per_row: multiply-adds of the row route per row of ``V``:
            ``N·T·C_out·C_in/G·K``.
        gram_per_row: multiply-adds of the Gram route per row: ``N·T²·C_out``
            (its ``A``).
        gram_fixed: multiply-adds of the Gram route once per chunk it runs on:
            ``N·T²·(C_out·C_in/G·K + C_in·K)`` (the patches' outer products and the
            products with them), once in all when ``A`` is summed over the chunks.
    """

    module: object
    nbytes: int
    rows_per_row: int
    gram_per_row: int
    gram_fixed: int


def gram_candidate(inner, module, v: int) -> GramCandidate | None:
    """The :class:`GramCandidate` of a recorded call, or None when its module extension
    is not :class:`DiagGGNConv`, its weight needs no quantity, or its diagonal over the
    whole factor's ``v`` rows per sample takes the row route.

    Args:
        inner: the call's module extension.
        module: the layer, its ``input0`` and ``output`` set.
        v: the rows per sample of the whole factor.
    """
    weight = getattr(module, "weight", None)
    if not isinstance(inner, DiagGGNConv) or weight is None or not weight.requires_grad:
        return None
    out = module.output
    s = torch.empty((v, *out.shape), dtype=out.dtype, device="meta")
    spec = conv_spec(module)
    if diagonal_route(module, module.input0, s, settings_for(module), spec=spec) != "gram":
        return None
    one = diagonal_costs(module, module.input0, s[:1], spec=spec)
    two = diagonal_costs(module, module.input0, s[:2], spec=spec)
    per_row = two.gram - one.gram
    return GramCandidate(module, gram_bytes(s), one.rows, per_row, one.gram - per_row)


class accumulating:
    """Inside the block, the weight diagonals of ``modules`` sum their Gram factors
    over the chunks of rows replayed (their quantity is :data:`PENDING` meanwhile);
    :func:`finish_gram` then gives each its diagonal."""

    def __init__(self, modules):
        self.sums = {module: None for module in modules}

    def __enter__(self):
        self.token = _ACCUMULATING.set(self.sums)
        return self.sums

    def __exit__(self, *exc):
        _ACCUMULATING.reset(self.token)


def finish_gram(inner, module, input, a):
    """The weight diagonal of a layer from its Gram factor ``a`` summed over every
    chunk of rows (:func:`memconv.conv.curvature.gram_diagonal`)."""
    settings = settings_for(module)
    return gram_diagonal(
        module,
        input,
        a,
        settings.options.memory_budget,
        inner.per_sample,
        spec=conv_spec(module),
    )


class DiagGGNConv(DiagGGNBaseModule):
    """``{Batch}DiagGGN{Exact,MC}`` for a convolution: memconv's weight diagonal.

    Inside a chunked replay that keeps this layer on the Gram route over all its
    chunks (:class:`accumulating`), each chunk adds its rows' ``A`` and the weight's
    quantity is :data:`PENDING` until the replay computes it once (:func:`finish_gram`).

    Args:
        derivatives: memconv's derivatives of the layer class.
        per_sample: the ``Batch`` variant (``[N, *param.shape]``).
    """

    def __init__(self, derivatives, per_sample: bool):
        self.per_sample = per_sample
        super().__init__(derivatives, params=PARAMS)

    def bias(self, ext, module, g_inp, g_out, backproped):
        return bias_diagonal(backproped, per_sample=self.per_sample)

    def weight(self, ext, module, g_inp, g_out, backproped):
        sums = _ACCUMULATING.get()
        if sums is not None and module in sums:
            a = gram_factor(backproped)
            sums[module] = a if sums[module] is None else sums[module].add_(a)
            return PENDING
        return weight_diagonal(
            module,
            module.input0,
            backproped,
            settings_for(module),
            per_sample=self.per_sample,
            spec=conv_spec(module),
        )


class DiagHessianConv(DiagHBaseModule):
    """``{Batch}DiagHessian`` for a convolution: each signed factor's diagonal (the
    residual terms of the layers after it included, as BackPACK passes them) by
    memconv's weight diagonal, summed with its sign.

    Args:
        derivatives: memconv's derivatives of the layer class.
        per_sample: the ``Batch`` variant.
    """

    def __init__(self, derivatives, per_sample: bool):
        self.per_sample = per_sample
        super().__init__(derivatives, params=PARAMS)

    def _signed_sum(self, diagonal, backproped):
        total = None
        for s, sign in zip(backproped["matrices"], backproped["signs"]):
            term = diagonal(s) * sign
            total = term if total is None else total + term
        return total

    def bias(self, ext, module, g_inp, g_out, backproped):
        return self._signed_sum(lambda s: bias_diagonal(s, per_sample=self.per_sample), backproped)

    def weight(self, ext, module, g_inp, g_out, backproped):
        settings, spec = settings_for(module), conv_spec(module)  # once for every factor
        return self._signed_sum(
            lambda s: weight_diagonal(
                module, module.input0, s, settings, per_sample=self.per_sample, spec=spec
            ),
            backproped,
        )


class SqrtGGNConv(SqrtGGNBaseModule):
    """``SqrtGGN{Exact,MC}`` for a convolution: the weight rows ``[V, N, *weight.shape]``
    by memconv's strategies (BackPACK's subsampling applied to the input); the bias
    rows by BackPACK's derivatives.

    Args:
        derivatives: memconv's derivatives of the layer class.
    """

    def __init__(self, derivatives):
        super().__init__(derivatives, params=PARAMS)

    def weight(self, ext, module, g_inp, g_out, backproped):
        x = subsample(module.input0, subsampling=ext.get_subsampling())
        return weight_rows(module, x, backproped, settings_for(module), spec=conv_spec(module))


def module_extension(ext, derivatives, wrap=lambda cls: cls):
    """memconv's module extension of a covered second-order extension object, for a
    convolution class whose memconv derivatives object is ``derivatives``; ``wrap``
    makes the class used from the class defined here (a mixin added)."""
    if isinstance(ext, (SqrtGGNExact, SqrtGGNMC)):
        return wrap(SqrtGGNConv)(derivatives)
    per_sample = isinstance(ext, PER_SAMPLE)
    if isinstance(ext, (DiagHessian, BatchDiagHessian)):
        return wrap(DiagHessianConv)(derivatives, per_sample)
    return wrap(DiagGGNConv)(derivatives, per_sample)
