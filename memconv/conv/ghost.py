"""Ghost norms of a convolution: ``Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩`` per sample, two ways.

``B`` is the output gradient ``[C_out/G, T]`` of a sample and group, ``A`` the
``[C_in/G·K, T]`` input values each output position reads (see :mod:`memconv.conv.norm_routes`).

- ``"positions"``: ``A_γᵀA_γ`` is never formed from ``A`` (an im2col matrix). The
  input, padded (and, along an axis with a kernel of one and a stride, cut to the
  positions read), has a Gram matrix over its positions, ``M = XᵀX`` (X the
  ``[C_in/G, S]`` input); ``A_γᵀA_γ`` is the sum of K strided windows of M, one per
  kernel offset, since ``(AᵀA)[t, t'] = Σ_κ M[u(t, κ), u(t', κ)]`` with
  ``u(t, κ) = t·stride + κ·dilation`` in the padded input's positions (positions in
  the padding are zeros and contribute nothing). The K windows are one strided view
  of M whose kernel offsets are axes of their own (``u`` is linear in ``t``, ``t'``
  and ``κ``), summed over them by one reduction (``windows="reduction"``), or the K
  windows, each a strided view of M, added one after another (``"accumulated"``: 2K − 3
  operations more; a CPU's reduction kernel reads a view whose reduced axes are short
  and strided many times slower than it adds contiguous results, a GPU pays for every
  operation). Its products cost C_in/G·S² multiply-adds instead of C_in/G·K·T²: K
  times fewer at stride 1, K/stride^d fewer otherwise.
- ``"offsets"``: the unfolded input (im2col, :func:`memconv.strategies.unfold.unfold_input`)
  and ``A_γᵀA_γ`` as one product, C_in/G·K·T² multiply-adds and N·C_in·K·T elements
  of im2col: the cheaper one when strides are as long as the kernel (a patch
  embedding, whose im2col is a permutation of its input). Its products are batched
  per sample, group and pair of blocks: a grouped layer on small maps (a depthwise
  one) runs many small ones, which a CPU pays for one by one (``"ghost-offsets"``:
  ``per_product``).

Either runs a chunk of samples in a number of tensor operations that does not depend
on the chunk's size (nor on K, but for ``"accumulated"`` windows). Both are tiled
(bands of output rows for ``"positions"``, blocks of positions for ``"offsets"``) and
split into chunks of samples only when their temporaries would not fit the budget;
without a budget they run the whole batch in one piece. Only the blocks on and above
the diagonal are formed (the matrices are symmetric). :func:`choose_tiling` prices both (the positions method with the cheaper
way of summing its windows, as the device's calibration prices them) and runs the
faster that fits (:func:`memconv.strategies.base.fastest_that_fits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..strategies import Problem
from ..strategies.base import fastest_that_fits, linear_time, numel
from ..strategies.costs import operations_time, scale_memory, time_coefficients
from ..strategies.geometry import ConvGeometry, Operands, torch_pad_argument
from ..strategies.unfold import unfold_input


@dataclass(frozen=True)
class GhostTiling:
    """How the ghost norms of one layer run.

    Attributes:
        method: ``"positions"`` or ``"offsets"``.
        chunk: samples per chunk.
        block: output rows per band (``"positions"``) or positions per block
            (``"offsets"``).
        memory: predicted extra bytes.
        time: predicted seconds.
        windows: how ``"positions"`` sums the K windows of the input's Gram matrix:
            ``"reduction"`` (one strided reduction) or ``"accumulated"`` (the windows
            added one after another); ``"reduction"`` for ``"offsets"``, which has none.
    """

    method: str
    chunk: int
    block: int
    memory: int
    time: float
    windows: str = "reduction"


@dataclass(frozen=True)
class _Axis:
    """One spatial axis as the positions method sees it: ``out`` output positions,
    output position ``t`` and kernel offset ``κ`` reading input position
    ``t·stride + κ·dilation`` of the input padded by ``lo`` before and ``hi`` after
    (a negative amount drops positions no output reads), ``size`` positions in all;
    along an axis with a kernel of one and a stride only every ``step``-th input
    position from ``first`` is kept (before the padding), as a kernel of one at
    stride one."""

    size: int
    out: int
    kernel: int
    stride: int
    dilation: int
    lo: int
    hi: int
    first: int = 0
    step: int = 1


def _axes(geom: ConvGeometry, size: tuple[int, ...]) -> list[_Axis]:
    axes = []
    for s, t, k, st, d, p in zip(
        size, geom.output_size(size), geom.kernel_size, geom.stride, geom.dilation, geom.padding
    ):
        if k == 1 and st > 1:  # only every st-th position is read: keep those alone
            first_t = -(-p // st)  # the first output position that reads no padding
            first = first_t * st - p
            kept = max(0, -(-(s - first) // st))
            axes.append(_Axis(t, t, 1, 1, 1, first_t, t - first_t - kept, first, st))
        else:
            read = (t - 1) * st + (k - 1) * d + 1  # padded positions the outputs read
            axes.append(_Axis(read, t, k, st, d, p, read - p - s))
    return axes


def _band_in(axis: _Axis, rows: int) -> int:
    """Padded input positions a band of ``rows`` output positions reads."""
    return (rows - 1) * axis.stride + (axis.kernel - 1) * axis.dilation + 1


def _padded_input(x: Tensor, axes: list[_Axis]) -> Tensor:
    """The input the positions method reads: cut to the kept positions, then padded
    (one copy at most; ``x`` itself when there is nothing to do)."""
    cut = [slice(None)] * 2
    for axis in axes:
        cut.append(slice(axis.first, None, axis.step) if axis.step > 1 else slice(None))
    if any(axis.step > 1 for axis in axes):
        x = x[tuple(cut)]
    pads = [(axis.lo, axis.hi) for axis in axes]
    if any(v for pair in pads for v in pair):
        x = F.pad(x, torch_pad_argument(pads))
    return x


#: The ways the positions method sums the K windows of the input's Gram matrix.
WINDOWS = ("reduction", "accumulated")
#: The batch on which the positions method chooses how to sum its windows (its
#: per-layer budget scaled with it, as the plan's grows with the batch): the same way at
#: every batch size, so that the number of operations does not change with the batch.
WINDOWS_REFERENCE_BATCH = 256


def _positions_ops(bands: int, cut: int, padded: bool, extra: int = 0) -> int:
    """Tensor operations of the positions method on one chunk of samples: its input
    cut (``cut`` axes with a kernel of one and a stride) and padded, then per band of
    output rows its slices, per pair of bands on and above the diagonal the other
    band's slices, the Gram matrix, its windows summed (``extra`` operations more per
    pair when they are accumulated), the contraction and the sum."""
    per_chunk = cut + (1 if padded else 0) + 1
    if bands == 1:
        return per_chunk + 9 + extra
    pairs = bands * (bands + 1) // 2
    return per_chunk + 4 * bands + (8 + extra) * pairs + 4 * (pairs - bands) - 1


def _accumulated_extra(kernel: int) -> int:
    """Operations the accumulated windows issue beyond the one strided reduction's two
    (a view and its sum): K views and K − 1 additions (one view and a copy for K = 1)."""
    return 0 if kernel == 1 else 2 * kernel - 3


def _positions_tiling(
    problem: Problem, budget: int | None, windows: str | None = None
) -> GhostTiling:
    """The positions method's chunk, bands and cost within ``budget``, its windows
    summed the ``windows`` way (None: the one priced faster on a batch of
    :data:`WINDOWS_REFERENCE_BATCH` samples, or ``n`` if more, with the budget scaled
    alike; the reduction on a tie)."""
    if windows is None:
        ref = max(problem.n, WINDOWS_REFERENCE_BATCH)
        at = replace(problem, n=ref)
        scaled = None if budget is None else budget * ref // max(problem.n, 1)
        windows = min(WINDOWS, key=lambda w: _positions_tiling(at, scaled, w).time)
    geom, n, itemsize = problem.geom, problem.n, problem.itemsize
    axes = _axes(geom, problem.size)
    t0 = axes[0].out
    inner_t = numel(a.out for a in axes[1:])
    inner_s = numel(a.size for a in axes[1:])
    padded = geom.in_channels * numel(a.size for a in axes)
    copied = any(a.step > 1 or a.lo or a.hi for a in axes)
    operands = padded if copied else 0  # the padded (or cut) input, copied

    def per_sample(rows):  # M and its windows' sum, then that sum and B_iᵀB_j
        si, bi = _band_in(axes[0], rows) * inner_s, rows * inner_t
        return geom.groups * max(si * si + bi * bi, 2 * bi * bi)

    whole = (operands + per_sample(t0)) * itemsize
    if budget is None or whole <= budget:
        chunk, rows = n if budget is None else max(1, min(n, budget // whole)), t0
    else:
        chunk, rows, left = 1, t0, budget // itemsize - operands
        while rows > 1 and per_sample(rows) > left:
            rows = (rows + 1) // 2
    bands = math.ceil(t0 / rows)
    pairs = bands * (bands + 1) // 2
    si, bi = _band_in(axes[0], rows) * inner_s, rows * inner_t
    flops = n * geom.groups * pairs * (geom.in_per_group * si * si + geom.out_per_group * bi * bi)
    gram = n * geom.groups * pairs * si * si  # M, written and read by strided windows
    traffic = n * geom.groups * pairs * (geom.kernel_numel + 3) * bi * bi + n * operands
    # the windows' elements, read by the one strided reduction
    read = n * geom.groups * pairs * geom.kernel_numel * bi * bi if windows == "reduction" else 0
    chunks = math.ceil(n / chunk)
    cut = sum(a.step > 1 for a in axes)
    extra = _accumulated_extra(geom.kernel_numel) if windows == "accumulated" else 0
    ops = chunks * _positions_ops(bands, cut, any(a.lo or a.hi for a in axes), extra)
    if chunks > 1:  # each chunk's slices, and the join
        ops += 2 * chunks + 1
    memory = chunk * (operands + per_sample(rows)) * itemsize
    # seconds per multiply-add, per element moved, per element of the input Gram
    # matrix (written, then read through strided windows), per element the strided
    # reduction reads beyond that, and per tensor operation
    rates = time_coefficients("ghost-positions", problem.device)
    per_flop, per_element, per_gram, per_window = rates
    time = linear_time((per_flop, per_element, 0.0), flops, traffic, 0) + per_gram * gram
    time += per_window * read + operations_time(ops, problem.device)
    memory = scale_memory("ghost-positions", problem.device, memory)
    return GhostTiling(
        method="positions", chunk=chunk, block=rows, memory=memory, time=time, windows=windows
    )


def _offsets_length(problem: Problem) -> int:
    """Positions the offsets method's Gram matrices span (the output positions)."""
    return problem.positions


def _offsets_ops(blocks: int, padded: bool) -> int:
    """Tensor operations of the offsets method on one chunk of samples: the unfolded
    input, then per block its slices, per pair of blocks the other block's slices, the
    two Gram blocks, the contraction and the sum."""
    per_chunk = (3 if padded else 2) + 1
    if blocks == 1:
        return per_chunk + 4
    pairs = blocks * (blocks + 1) // 2
    return per_chunk + 2 * blocks + 5 * pairs + 2 * (pairs - blocks) - 1


def _offsets_tiling(problem: Problem, budget: int | None) -> GhostTiling:
    geom, n, itemsize = problem.geom, problem.n, problem.itemsize
    length = _offsets_length(problem)
    # the padded input and the unfolded one
    padded = geom.in_channels * numel(s + 2 * p for s, p in zip(problem.size, geom.padding))
    padded = padded if any(geom.padding) else 0
    cols = geom.in_channels * geom.kernel_numel * length

    def per_sample(block):  # the padded input while it is unfolded, then two Gram blocks
        return cols + max(padded, 2 * geom.groups * block * block)

    whole = per_sample(length) * itemsize
    if budget is None or whole <= budget:
        chunk, block = n if budget is None else max(1, min(n, budget // whole)), length
    else:
        chunk, block, left = 1, length, budget // itemsize
        while block > 1 and per_sample(block) > left:
            block = (block + 1) // 2
    blocks = math.ceil(length / block)
    pairs = blocks * (blocks + 1) // 2
    flops = n * geom.groups * pairs * block * block * geom.in_per_group * geom.kernel_numel
    flops += n * geom.groups * pairs * block * block * geom.out_per_group
    traffic = 3 * n * cols + n * geom.groups * pairs * 3 * block * block
    # the matrix products of the batched products (A_iᵀA_j and B_iᵀB_j per sample,
    # group and pair of blocks): what a CPU pays per small product of a grouped layer
    products = 2 * n * geom.groups * pairs
    chunks = math.ceil(n / chunk)
    ops = chunks * _offsets_ops(blocks, any(geom.padding))
    if chunks > 1:  # each chunk's slices, and the join
        ops += 2 * chunks + 1
    memory = chunk * per_sample(block) * itemsize
    per_flop, per_element, per_product = time_coefficients("ghost-offsets", problem.device)
    time = linear_time((per_flop, per_element, 0.0), flops, traffic, 0)
    time += per_product * products + operations_time(ops, problem.device)
    memory = scale_memory("ghost-offsets", problem.device, memory)
    return GhostTiling(method="offsets", chunk=chunk, block=block, memory=memory, time=time)


def method_tilings(
    problem: Problem, budget: int | None, windows: str | None = None
) -> dict[str, GhostTiling]:
    """Each method's chunk, tiling and predicted cost within ``budget`` bytes (None:
    the whole batch in one piece), ``{"positions": ..., "offsets": ...}``; the
    positions method's windows summed the ``windows`` way (:data:`WINDOWS`; None: the
    one priced faster)."""
    return {
        "positions": _positions_tiling(problem, budget, windows),
        "offsets": _offsets_tiling(problem, budget),
    }


def choose_tiling(problem: Problem, budget: int | None) -> GhostTiling:
    """The method, chunk and tiling of the ghost norms within ``budget`` bytes (None:
    no limit): the faster method whose temporaries fit, else the leaner."""
    return fastest_that_fits(list(method_tilings(problem, budget).values()), budget)[0]


def sq_norms(ops: Operands, chosen: GhostTiling, channels: bool = False) -> Tensor:
    """Squared per-sample norms ``[N]`` of a convolution's weight gradient.

    Args:
        ops: the layer's strategy operands (normal form).
        chosen: the :func:`choose_tiling` to run.
        channels: per output channel ``[N, C_out]`` instead: ``Σ_{t,t'} b_c[t]
            (A_γᵀA_γ)[t,t'] b_c[t']`` for channel ``c`` of group ``γ`` (the diagonal
            of ``B_γ A_γᵀA_γ B_γᵀ``; the same Gram blocks, one product more per block).
    """
    x, g, geom = ops.x, ops.g, ops.geometry
    n = x.shape[0]
    if chosen.method == "positions":
        accumulate = chosen.windows == "accumulated"

        def gram(xs, gs):
            return _positions_gram(xs, gs, geom, chosen.block, channels, accumulate)
    else:

        def gram(xs, gs):
            return _offsets_gram(xs, gs, geom, chosen.block, channels)

    if chosen.chunk >= n:
        return gram(x, g)
    parts = [
        gram(x[n0 : n0 + chosen.chunk], g[n0 : n0 + chosen.chunk])
        for n0 in range(0, n, chosen.chunk)
    ]
    return torch.cat(parts)


def _contract(ga: Tensor, gi: Tensor, gj: Tensor, channels: bool) -> Tensor:
    """``Σ_γ ⟨A_iᵀA_j, B_iᵀB_j⟩`` per sample ``[n]`` (``ga`` ``[n, G, bi, bj]``, ``gi``/``gj``
    the output gradient's blocks ``[n, G, C_out/G, bi/bj]``), or per channel ``[n, C_out]``."""
    if channels:
        return torch.einsum("ngot,ngtu,ngou->ngo", gi, ga, gj).flatten(1)
    gb = torch.einsum("ngot,ngou->ngtu", gi, gj)  # B_iᵀB_j
    return ga.mul_(gb).sum((1, 2, 3))  # pairwise summation: float32 round-off


def _add_block(out: Tensor | None, part: Tensor, diagonal: bool) -> Tensor:
    """The running sum of the blocks, a block below the diagonal counted twice."""
    if out is None:
        return part if diagonal else part.mul_(2.0)
    return out.add_(part, alpha=1.0 if diagonal else 2.0)


def _positions_gram(
    x: Tensor,
    g: Tensor,
    geom: ConvGeometry,
    rows: int,
    channels: bool = False,
    accumulate: bool = False,
) -> Tensor:
    """Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩ per sample by strided windows of the input's Gram
    matrix over positions, in bands of ``rows`` output rows (the windows added one
    after another with ``accumulate``, else summed by one reduction)."""
    axes = _axes(geom, tuple(x.shape[2:]))
    xp = _padded_input(x, axes)  # [n, C_in, *S'] with S' the positions read
    n, grp = x.shape[0], geom.groups
    outs = [a.out for a in axes]
    inner = [a.size for a in axes[1:]]
    gg = g.reshape(n, grp, geom.out_per_group, *outs)
    t0, first = outs[0], axes[0]
    out = None
    cg = geom.in_per_group
    for r0 in range(0, t0, rows):
        r1 = min(t0, r0 + rows)
        xi, gi = _band(xp, gg, first, r0, r1, grp, cg, t0)
        for c0 in range(r0, t0, rows):
            c1 = min(t0, c0 + rows)
            xj, gj = (xi, gi) if c0 == r0 else _band(xp, gg, first, c0, c1, grp, cg, t0)
            m = torch.einsum("ngcs,ngcu->ngsu", xi, xj)  # [n, G, Si, Sj]
            ga = _windows_summed(m, axes, (r1 - r0, c1 - c0), inner, accumulate)
            ga = ga.reshape(n, grp, gi.shape[-1], gj.shape[-1])
            del m
            out = _add_block(out, _contract(ga, gi, gj, channels), r0 == c0)
            del ga
    return out


def _band(xp: Tensor, gg: Tensor, axis: _Axis, r0: int, r1: int, grp: int, cg: int, t0: int):
    """The padded input rows a band of output rows ``[r0, r1)`` reads, ``[n, G, C_in/G,
    Si]``, and its output gradient ``[n, G, C_out/G, bi]`` (the tensors themselves for
    the whole)."""
    n = xp.shape[0]
    if r1 - r0 < t0:
        xp = xp.narrow(2, r0 * axis.stride, _band_in(axis, r1 - r0))
        gg = gg.narrow(3, r0, r1 - r0)
    return xp.reshape(n, grp, cg, -1), gg.flatten(3)


def _windows_summed(
    m: Tensor, axes: list[_Axis], rows: tuple[int, int], inner: list, accumulate: bool = False
) -> Tensor:
    """``(AᵀA)[t, t'] = Σ_κ M[u(t, κ), u(t', κ)]`` for two bands of ``rows`` output rows
    (the other axes whole): one strided view of ``m`` ``[n, G, Si, Sj]`` with the kernel
    offsets as axes of their own, summed over them; with ``accumulate``, one strided
    view per kernel offset, added one after another. Returns ``[n, G, *Ti, *Tj]``."""
    first, d = axes[0], len(axes)
    outer = [a.out for a in axes[1:]]
    views = []  # (output sizes, element strides of the positions) of each band
    for band, stride in zip(rows, (m.stride(2), m.stride(3))):
        sizes = [_band_in(first, band), *inner]
        views.append(([band, *outer], [stride * numel(sizes[i + 1 :]) for i in range(d)]))
    (ti, left), (tj, right) = views
    shape = (*m.shape[:2], *ti, *tj, *(a.kernel for a in axes))
    strides = (
        *m.stride()[:2],
        *(a.stride * s for a, s in zip(axes, left)),
        *(a.stride * s for a, s in zip(axes, right)),
        *(a.dilation * (s + r) for a, s, r in zip(axes, left, right)),
    )
    if accumulate:
        offsets = [0]  # each kernel offset's first element in m
        for a, s, r in zip(axes, left, right):
            offsets = [o + k * a.dilation * (s + r) for o in offsets for k in range(a.kernel)]
        shape, strides = shape[: 2 + 2 * d], strides[: 2 + 2 * d]
        windows = [m.as_strided(shape, strides, m.storage_offset() + o) for o in offsets]
        if len(windows) == 1:
            return windows[0].clone()
        out = windows[0] + windows[1]
        for window in windows[2:]:
            out.add_(window)
        return out
    view = m.as_strided(shape, strides, m.storage_offset())
    return view.sum(tuple(range(2 + 2 * d, 2 + 3 * d)))


def _offsets_gram(
    x: Tensor, g: Tensor, geom: ConvGeometry, block: int, channels: bool = False
) -> Tensor:
    """Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩ per sample from the unfolded input, one product per
    block pair of ``block`` positions."""
    n, t = x.shape[0], tuple(g.shape[2:])
    cols = unfold_input(x, geom, t)  # [n, G, C_in/G·K, T]
    gm = g.reshape(n, geom.groups, geom.out_per_group, -1)  # [n, G, C_out/G, T]
    length = gm.shape[-1]
    out = None
    for i0 in range(0, length, block):
        ci, gi = _block(cols, gm, i0, block, length)
        for j0 in range(i0, length, block):
            cj, gj = (ci, gi) if j0 == i0 else _block(cols, gm, j0, block, length)
            ga = torch.einsum("ngkt,ngku->ngtu", ci, cj)  # A_iᵀA_j [n, G, bi, bj]
            out = _add_block(out, _contract(ga, gi, gj, channels), i0 == j0)
            del ga
    return out


def _block(cols: Tensor, gm: Tensor, i0: int, block: int, length: int):
    """Positions ``[i0, i0 + block)`` of the unfolded input and of the output gradient
    (the tensors themselves for the whole)."""
    if block >= length:
        return cols, gm
    width = min(block, length - i0)
    return cols.narrow(-1, i0, width), gm.narrow(-1, i0, width)
