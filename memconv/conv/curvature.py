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
a chunk's size follows ``memory_budget`` (:func:`row_chunks`). Where the output map
is small the diagonal takes the Gram route instead (``S Sᵀ`` over position pairs
against the patches' outer products, :func:`weight_diagonal`), chosen by
:func:`diagonal_route`. The bias quantities are ``S`` summed over space.

The layer's normal form (:func:`memconv.strategies.geometry.conv_spec`) is read once
per call: each function takes it as ``spec=`` (read from the module when None) and
passes it to everything it calls, the route's choice, the chunks' sizes and every
chunk's weight VJPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._checks import check_choice
from ..strategies.geometry import ConvSpec, spec_of
from .grads import weight_grad
from .kronecker import patches
from .settings import Settings

#: The bytes one chunk of rows may take when no ``memory_budget`` is set (64 MiB).
DEFAULT_CHUNK_BYTES = 64 * 2**20


def even_chunks(total: int, most: int) -> list[tuple[int, int]]:
    """The fewest chunks ``(start, stop)`` of ``range(total)`` of at most ``most``
    items each, their sizes differing by at most one.

    Fewest: the time of a chunk of rows is a fixed part (its operations, each priced
    ``per_op`` by :mod:`memconv.strategies.costs`) plus a part per row, so a split into
    more chunks is predicted slower. Even: of the splits into that many chunks, none
    leaves a last chunk of a few rows, whose operations would each do little work (a
    weight VJP of one row per sample folds ``C_out`` channels, not ``cv·C_out``: the
    strategies' predicted time per row falls with the rows folded).

    Args:
        total: the items (rows, samples), >= 0.
        most: the most items of a chunk, >= 1.
    """
    count = -(-total // max(1, most))
    return [(i * total // count, (i + 1) * total // count) for i in range(count)]


def row_chunks(v: int, n: int, row_bytes: int, memory_budget: int | None):
    """Chunks ``(v0, v1, n0, n1)`` of the ``V·N`` rows: whole samples' blocks of ``V``
    first, each chunk's rows costing at most ``memory_budget`` bytes (at least one row),
    the fewest such chunks, of even sizes (:func:`even_chunks`).

    Args:
        v: V, the rows per sample.
        n: N, the samples.
        row_bytes: what one row costs (its weight VJP, its operands).
        memory_budget: bytes per chunk; None: :data:`DEFAULT_CHUNK_BYTES`.
    """
    budget = DEFAULT_CHUNK_BYTES if memory_budget is None else memory_budget
    rows = max(1, budget // max(row_bytes, 1))
    if rows >= n:
        return [(v0, v1, 0, n) for v0, v1 in even_chunks(v, rows // n)]
    return [(v0, v0 + 1, n0, n1) for v0 in range(v) for n0, n1 in even_chunks(n, rows)]


def _row_bytes(spec: ConvSpec, input: Tensor, s: Tensor, copies: int) -> int:
    weight = spec.geometry.weight_shape
    numel = 1
    for size in weight:
        numel *= size
    per_sample = (input[0].numel() if input.shape[0] else 0) + s[0, 0].numel()
    return (copies * numel + per_sample) * s.element_size()


def _row_vjps(
    module, input: Tensor, s: Tensor, settings: Settings, chunk, *, spec: ConvSpec
) -> Tensor:
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


#: The routes of :func:`weight_diagonal`.
DIAGONAL_ROUTES = ("rows", "gram")


@dataclass(frozen=True)
class DiagonalCosts:
    """The multiply-adds of the two routes of :func:`weight_diagonal` and the bytes
    one sample of the Gram route holds.

    Attributes:
        rows: ``V·N·T·C_out·C_in/G·K`` (one weight VJP per row).
        gram: ``N·T²·(V·C_out + C_out·C_in/G·K + C_in·K)`` (``A``, the products with
            the patches' outer products, and those outer products).
        gram_sample_bytes: ``(V·C_out·T + (C_out + C_in)·T²)`` numbers: one sample's
            rows of ``S``, its ``A`` and one offset's patch products.
    """

    rows: int
    gram: int
    gram_sample_bytes: int


def diagonal_costs(
    module, input: Tensor, s: Tensor, *, spec: ConvSpec | None = None
) -> DiagonalCosts:
    """The costs :func:`diagonal_route` compares, from the shapes (no work).

    Args:
        module, input, s, spec: as :func:`weight_diagonal`.
    """
    geom = spec_of(module, spec).geometry
    v, n, c_out = s.shape[:3]  # c_out: the channels of the layer's output
    t = math.prod(s.shape[3:])
    c_in = input.shape[1]
    k = math.prod(geom.kernel_size)
    per_weight = c_out * (c_in // geom.groups) * k
    return DiagonalCosts(
        rows=v * n * t * per_weight,
        gram=n * t * t * (v * c_out + per_weight + c_in * k),
        gram_sample_bytes=(v * c_out * t + (c_out + c_in) * t * t) * s.element_size(),
    )


def diagonal_route(
    module, input: Tensor, s: Tensor, settings: Settings, *, spec: ConvSpec | None = None
) -> str:
    """Which route :func:`weight_diagonal` takes: the one place it is chosen.

    ``"gram"`` when its multiply-adds are fewer than the row VJPs' (about when the
    output positions T are fewer than the rows per sample V: small output maps, large
    V) and one sample of it fits the chunk budget (``settings.options.memory_budget``,
    else :data:`DEFAULT_CHUNK_BYTES`); ``"rows"`` otherwise, and always when the
    strategy is not ``"auto"`` (a strategy the user chose is kept).

    Args:
        module, input, s, settings, spec: as :func:`weight_diagonal`.

    Returns:
        ``"gram"`` or ``"rows"``.
    """
    if settings.strategy != "auto" or s.shape[0] * s.shape[1] == 0:
        return "rows"
    costs = diagonal_costs(module, input, s, spec=spec)
    budget = settings.options.memory_budget
    budget = DEFAULT_CHUNK_BYTES if budget is None else budget
    return "gram" if costs.gram < costs.rows and costs.gram_sample_bytes <= budget else "rows"


def gram_factor(s: Tensor) -> Tensor:
    """The Gram route's ``Aₙ[o] = Σ_v S[v, n, o] S[v, n, o]ᵀ`` of a factor's rows.

    Linear in the rows: the ``A`` of a factor whose rows come in chunks is the sum of
    the chunks' (how :mod:`memconv.integrations.backpack.chunking` keeps a layer on the
    Gram route whatever its chunks' size), and :func:`gram_diagonal` of it is the
    diagonal of all the rows.

    Args:
        s: the factorisation ``[V, N, C_out, *T]``.

    Returns:
        ``[N, C_out, T, T]`` (T: the output positions, flattened), in ``s``'s dtype.
    """
    v, n, c_out = s.shape[:3]
    t = math.prod(s.shape[3:])
    rows = s.reshape(v, n, c_out, t).permute(1, 2, 0, 3)  # [n, o, v, t]
    return rows.transpose(-1, -2) @ rows


def gram_bytes(s: Tensor) -> int:
    """Bytes of the ``A`` of :func:`gram_factor` for a factor shaped as ``s`` (any
    ``V``; a tensor on the ``"meta"`` device will do): ``N·C_out·T²`` numbers of
    ``s``'s dtype."""
    n, c_out = s.shape[1:3]
    t = math.prod(s.shape[3:])
    return n * c_out * t * t * s.element_size()


def gram_diagonal(
    module, input: Tensor, a: Tensor, memory_budget, per_sample: bool, *, spec=None
) -> Tensor:
    """The weight diagonal from an ``A`` of :func:`gram_factor` (the Gram route's
    products with the patches' outer products), samples in chunks under
    ``memory_budget`` (bytes; None: :data:`DEFAULT_CHUNK_BYTES`).

    Args:
        module: ``Conv*d`` or ``ConvTranspose*d``.
        input: the layer's input ``[N, C_in, *S]``.
        a: ``[N, C_out, T, T]``, from :func:`gram_factor` (summed over chunks of rows).
        memory_budget: bytes of one chunk of samples' patch products.
        per_sample: ``[N, *weight.shape]`` if True, else ``weight.shape``.
        spec: as :func:`weight_diagonal`.

    Returns:
        The diagonal, in ``a``'s dtype.
    """
    spec = spec_of(module, spec)
    p = patches(module, input.to(a.dtype), spec=spec)
    n, c_out, t = a.shape[:3]
    g = p.groups
    c_in = p.source.shape[1]
    o_g, i_g = c_out // g, c_in // g
    shape = module.weight.shape
    out = a.new_zeros((n, *shape) if per_sample else shape)
    budget = DEFAULT_CHUNK_BYTES if memory_budget is None else memory_budget
    sample_bytes = (c_out + c_in) * t * t * a.element_size()
    step = max(1, budget // max(sample_bytes, 1))
    transposed = spec.transposed
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        a_chunk = a[n0:n1].reshape(n1 - n0, g, o_g, t * t)
        diag = a.new_empty(n1 - n0, g, o_g, i_g, len(p.offsets))
        for k, offset in enumerate(p.offsets):
            x = p.view(offset)[n0:n1].reshape(n1 - n0, g, i_g, t)
            b = (x[..., :, None] * x[..., None, :]).reshape(n1 - n0, g, i_g, t * t)
            diag[..., k] = a_chunk @ b.transpose(-1, -2)  # [n, g, o, i]
        if transposed:  # weight [C_in, C_out/G, *k]
            diag = diag.transpose(2, 3)
        diag = diag.reshape(n1 - n0, *shape)
        if per_sample:
            out[n0:n1] = diag
        else:
            out += diag.sum(0)
    return out


def _gram_diagonal(
    module, input: Tensor, s: Tensor, memory_budget, per_sample: bool, *, spec: ConvSpec
) -> Tensor:
    """The diagonal by the Gram route (see :func:`weight_diagonal`), samples in chunks."""
    n = s.shape[1]
    shape = module.weight.shape
    out = s.new_zeros((n, *shape) if per_sample else shape)
    budget = DEFAULT_CHUNK_BYTES if memory_budget is None else memory_budget
    step = max(1, budget // max(diagonal_costs(module, input, s, spec=spec).gram_sample_bytes, 1))
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        diag = gram_diagonal(
            module, input[n0:n1], gram_factor(s[:, n0:n1]), memory_budget, per_sample, spec=spec
        )
        if per_sample:
            out[n0:n1] = diag
        else:
            out += diag
    return out


def weight_diagonal(
    module,
    input: Tensor,
    s: Tensor,
    settings: Settings,
    *,
    per_sample: bool,
    route=None,
    spec: ConvSpec | None = None,
) -> Tensor:
    """The diagonal ``Σ_v Σ_n (Jₙᵀ S[v, n])²`` of a convolution's weight curvature.

    Two routes, chosen by :func:`diagonal_route` (their multiply-adds,
    :func:`diagonal_costs`):

    - ``"rows"``: one weight VJP per row of ``S`` by the layer's strategy, squared
      and summed, rows in chunks (:func:`row_chunks`);
    - ``"gram"``: ``diag[o, i, k] = Σₙ Σ_{t,t'} Aₙ[o, t, t'] xₙ[i, t + k] xₙ[i, t' + k]``
      with ``Aₙ[o] = Σ_v S[v, n, o] S[v, n, o]ᵀ`` (``T × T`` per sample and output
      channel) and the patches of kernel offset ``k`` as strided views of the padded
      input (:func:`memconv.conv.kronecker.patches`, no unfolded input): about
      ``N·T²·C_out·C_in·K`` multiply-adds against the rows' ``V·N·T·C_out·C_in·K``,
      the cheaper when the output map is small (``T < V``), as ghost norms are for
      first order. Samples in chunks under the budget.

    Args:
        module: ``Conv*d`` or ``ConvTranspose*d``.
        input: the layer's input ``[N, C_in, *S]``.
        s: the factorisation ``[V, N, C_out, *T]`` of the output's curvature.
        settings: the weight-VJP strategy; its ``memory_budget`` (bytes) bounds a
            chunk of rows (:func:`row_chunks`) or of samples (the Gram route).
        per_sample: ``[N, *weight.shape]`` (no sum over ``n``) if True, else
            ``weight.shape``.
        route: ``"rows"`` or ``"gram"`` to force one; None: :func:`diagonal_route`.
        spec: the layer's :func:`memconv.strategies.geometry.conv_spec`, read by the
            caller in the same call (a caller that computes several quantities of one
            layer call reads it once); None: read here, once for the whole call.

    Returns:
        The diagonal, in ``s``'s dtype.

    Raises:
        ValueError: for an unknown ``route``.
    """
    check_choice(route, DIAGONAL_ROUTES, "route")
    spec = spec_of(module, spec)
    if route is None:
        route = diagonal_route(module, input, s, settings, spec=spec)
    if route == "gram":
        budget = settings.options.memory_budget
        return _gram_diagonal(module, input, s, budget, per_sample, spec=spec)
    v, n = s.shape[:2]
    shape = module.weight.shape
    out = s.new_zeros((n, *shape) if per_sample else shape)
    row_bytes = _row_bytes(spec, input, s, copies=2)
    for chunk in row_chunks(v, n, row_bytes, settings.options.memory_budget):
        # squared in place: the chunk's rows are a temporary of this loop (no second
        # tensor of V·N·|W| numbers to allocate and fault in)
        squares = _row_vjps(module, input, s, settings, chunk, spec=spec).square_()
        if per_sample:
            out[chunk[2] : chunk[3]] += squares.sum(1)
        else:
            out += squares.sum((0, 1))
    return out


def weight_rows(
    module, input: Tensor, s: Tensor, settings: Settings, *, spec: ConvSpec | None = None
) -> Tensor:
    """Every row's weight VJP ``Jₙᵀ S[v, n]``: ``[V, N, *weight.shape]``.

    Args:
        module, input, s, settings, spec: as :func:`weight_diagonal`; the result itself
            is ``V·N·|W|`` numbers, the budget bounds the work around it.
    """
    spec = spec_of(module, spec)
    v, n = s.shape[:2]
    out = s.new_empty((v, n, *module.weight.shape))
    row_bytes = _row_bytes(spec, input, s, copies=1)
    for chunk in row_chunks(v, n, row_bytes, settings.options.memory_budget):
        v0, v1, n0, n1 = chunk
        rows = _row_vjps(module, input, s, settings, chunk, spec=spec)
        out[v0:v1, n0:n1] = rows.transpose(0, 1)
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
