"""Curvature quantities of a convolution from a symmetric factorisation of its output's curvature.

Second-order methods (the generalized Gauss-Newton of Schraudolph 2002, its Monte-Carlo
estimate, the Hessian's diagonal of BackPACK, Dangel et al. 2020) pass a factorisation
``S`` of shape ``[V, N, C_out, *T]`` back to each layer: the curvature of the loss with
respect to sample ``n``'s layer output is ``Σ_v S[v, n] S[v, n]ᵀ``. For the weight,
each of the ``V·N`` rows of ``S`` gives one weight VJP ``Jₙᵀ S[v, n]`` (a per-sample
weight gradient with ``S[v, n]`` as the output gradient); the quantities are

- the diagonal: ``Σ_v Σ_n (Jₙᵀ S[v, n])²`` (per sample: without ``Σ_n``),
  :func:`weight_diagonal`;
- the factor itself: ``[V, N, *weight.shape]``, :func:`weight_rows` (BackPACK's
  ``SqrtGGN``).

Both run memconv's weight-VJP strategies (:mod:`memconv.strategies`) on chunks of
rows, never forming the ``V·N·|W|`` numbers of the diagonal nor an unfolded input:
a chunk's size follows ``memory_budget`` (:func:`row_chunks`). The bias quantities
are ``S`` summed over space.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..strategies.geometry import conv_spec
from .grads import weight_grad
from .settings import Settings

#: The bytes one chunk of rows may take when no ``memory_budget`` is set (64 MiB).
DEFAULT_CHUNK_BYTES = 64 * 2**20


def row_chunks(v: int, n: int, row_bytes: int, memory_budget: int | None):
    """Chunks ``(v0, v1, n0, n1)`` of the ``V·N`` rows: whole samples' blocks of ``V``
    first, each chunk's rows costing at most ``memory_budget`` bytes (at least one row).

    Args:
        v: V, the rows per sample.
        n: N, the samples.
        row_bytes: what one row costs (its weight VJP, its operands).
        memory_budget: bytes per chunk; None: :data:`DEFAULT_CHUNK_BYTES`.
    """
    budget = DEFAULT_CHUNK_BYTES if memory_budget is None else memory_budget
    rows = max(1, budget // max(row_bytes, 1))
    if rows >= n:
        step_v = max(1, min(v, rows // n))
        return [(v0, min(v, v0 + step_v), 0, n) for v0 in range(0, v, step_v)]
    return [(v0, v0 + 1, n0, min(n, n0 + rows)) for v0 in range(v) for n0 in range(0, n, rows)]


def _row_bytes(module, input: Tensor, s: Tensor, copies: int) -> int:
    weight = conv_spec(module).geometry.weight_shape
    numel = 1
    for size in weight:
        numel *= size
    per_sample = (input[0].numel() if input.shape[0] else 0) + s[0, 0].numel()
    return (copies * numel + per_sample) * s.element_size()


def _row_vjps(module, input: Tensor, s: Tensor, settings: Settings, chunk) -> Tensor:
    """The weight VJPs of one chunk's rows, ``[n1 - n0, v1 - v0, *weight.shape]``.

    The chunk's ``v1 - v0`` rows of a sample share its input: they are folded into the
    channels of the factor's side (one convolution of ``(v1 - v0)·C`` channels, group
    by group), so one per-sample weight VJP by the strategy gives them all, the input
    read once.
    """
    v0, v1, n0, n1 = chunk
    cv, x, g = v1 - v0, input[n0:n1], s[v0:v1, n0:n1]
    if x.dtype != g.dtype:  # autocast: the forward pass's dtype
        x = x.to(g.dtype)
    spec = conv_spec(module)
    geom = spec.geometry
    groups = geom.groups
    # [cv, n, G·c, *T] -> [n, G·cv·c, *T]: the rows of a group side by side
    folded = g.reshape(cv, n1 - n0, groups, -1, *g.shape[3:]).transpose(0, 1).transpose(1, 2)
    folded = folded.reshape(n1 - n0, -1, *g.shape[3:])
    if spec.transposed:  # the factor plays the normal form's input
        geom = replace(geom, in_channels=cv * geom.in_channels)
    else:
        geom = replace(geom, out_channels=cv * geom.out_channels)
    ops = replace(spec, geometry=geom).operands(x, folded)
    rows = weight_grad(ops, settings, per_sample=True)  # [n, *folded weight shape]
    k = tuple(geom.kernel_size)
    if spec.transposed:  # [n, C_o, cv·c, *k] -> [n, cv, C_o, c, *k]
        rows = rows.reshape(n1 - n0, geom.out_channels, cv, -1, *k).transpose(1, 2)
    else:  # [n, G·cv·o, c, *k] -> [n, cv, G·o, c, *k]
        rows = rows.reshape(n1 - n0, groups, cv, -1, geom.in_per_group, *k).transpose(1, 2)
    return rows.reshape(n1 - n0, cv, *module.weight.shape)


def weight_diagonal(
    module, input: Tensor, s: Tensor, settings: Settings, *, per_sample: bool
) -> Tensor:
    """The diagonal ``Σ_v Σ_n (Jₙᵀ S[v, n])²`` of a convolution's weight curvature.

    Args:
        module: ``Conv*d`` or ``ConvTranspose*d``.
        input: the layer's input ``[N, C_in, *S]``.
        s: the factorisation ``[V, N, C_out, *T]`` of the output's curvature.
        settings: the weight-VJP strategy; its ``memory_budget`` (bytes) bounds a
            chunk of rows (:func:`row_chunks`).
        per_sample: ``[N, *weight.shape]`` (no sum over ``n``) if True, else
            ``weight.shape``.

    Returns:
        The diagonal, in ``s``'s dtype.
    """
    v, n = s.shape[:2]
    shape = module.weight.shape
    out = s.new_zeros((n, *shape) if per_sample else shape)
    row_bytes = _row_bytes(module, input, s, copies=2)
    for chunk in row_chunks(v, n, row_bytes, settings.options.memory_budget):
        squares = _row_vjps(module, input, s, settings, chunk).square().sum(1)
        if per_sample:
            out[chunk[2] : chunk[3]] += squares
        else:
            out += squares.sum(0)
    return out


def weight_rows(module, input: Tensor, s: Tensor, settings: Settings) -> Tensor:
    """Every row's weight VJP ``Jₙᵀ S[v, n]``: ``[V, N, *weight.shape]``.

    Args:
        module, input, s, settings: as :func:`weight_diagonal`; the result itself is
            ``V·N·|W|`` numbers, the budget bounds the work around it.
    """
    v, n = s.shape[:2]
    out = s.new_empty((v, n, *module.weight.shape))
    row_bytes = _row_bytes(module, input, s, copies=1)
    for chunk in row_chunks(v, n, row_bytes, settings.options.memory_budget):
        v0, v1, n0, n1 = chunk
        out[v0:v1, n0:n1] = _row_vjps(module, input, s, settings, chunk).transpose(0, 1)
    return out


def bias_diagonal(s: Tensor, *, per_sample: bool) -> Tensor:
    """The bias diagonal ``Σ_v (Σ_t S[v, n, :, t])²`` (and ``Σ_n`` unless ``per_sample``).

    Args:
        s: ``[V, N, C_out, *T]``.
        per_sample: ``[N, C_out]`` if True, else ``[C_out]``.
    """
    dims = tuple(range(3, s.dim()))
    per_row = s.sum(dims) if dims else s
    squares = torch.square(per_row).sum(0)
    return squares if per_sample else squares.sum(0)
