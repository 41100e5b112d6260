"""Ghost norms of a convolution: ``Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩`` per sample, two ways.

``B`` is the output gradient ``[C_out/G, T]`` of a sample and group, ``A`` the
``[C_in/G·K, T]`` input values each output position reads (see :mod:`memconv.conv.norm_routes`).
``A_γᵀA_γ`` is never formed from ``A`` (an im2col matrix):

- ``"positions"``: the input's Gram matrix over its positions, ``M = XᵀX`` (X the
  ``[C_in/G, S]`` input), once; ``A_γᵀA_γ`` is the sum of K strided windows of M, one
  per kernel offset, since ``(AᵀA)[t, t'] = Σ_κ M[u(t, κ), u(t', κ)]`` with
  ``u(t, κ) = t·stride + κ·dilation − padding`` (positions in the zero padding
  contribute nothing). Its products cost C_in/G·S² multiply-adds instead of
  C_in/G·K·T²: K times fewer at stride 1, K/stride^d fewer otherwise. Along an axis
  with a kernel of one and a stride, only the positions read are kept first.
- ``"offsets"``: one product per kernel offset on the shifted input of
  :func:`memconv.strategies.shift.offset_operands`, C_in/G·K·T² multiply-adds: the
  cheaper one when strides are as long as the kernel (a patch embedding).

Both are tiled (bands of output rows for ``"positions"``, blocks of positions for
``"offsets"``) so that the Gram blocks fit a budget, and only the blocks on and
above the diagonal are formed (the matrices are symmetric). :func:`choose_tiling` prices both
and runs the faster that fits (:func:`memconv.strategies.base.fastest_that_fits`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..strategies import Problem
from ..strategies.base import fastest_that_fits, linear_time, numel, padded_size
from ..strategies.costs import scale_memory, time_coefficients
from ..strategies.geometry import ConvGeometry, Operands
from ..strategies.shift import _flat_ok, offset_operands


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
    """

    method: str
    chunk: int
    block: int
    memory: int
    time: float


@dataclass(frozen=True)
class _Axis:
    """One spatial axis as the positions method sees it: ``size`` input positions
    (the kept ones, where a kernel of one skips positions), ``out`` output positions,
    and the map ``u = t·stride + κ·dilation − padding`` between them."""

    size: int
    out: int
    kernel: int
    stride: int
    dilation: int
    padding: int
    first: int = 0  # first input position kept
    step: int = 1  # every step-th input position kept


def _axes(geom: ConvGeometry, size: tuple[int, ...]) -> list[_Axis]:
    axes = []
    for s, t, k, st, d, p in zip(
        size, geom.output_size(size), geom.kernel_size, geom.stride, geom.dilation, geom.padding
    ):
        if k == 1 and st > 1:  # only every st-th position is read: keep those alone
            first_t = -(-p // st)  # the first output position that reads no padding
            first = first_t * st - p
            kept = max(0, -(-(s - first) // st))
            axes.append(_Axis(kept, t, 1, 1, 1, first_t, first, st))
        else:
            axes.append(_Axis(s, t, k, st, d, p))
    return axes


def _band(axis: _Axis, r0: int, r1: int) -> tuple[int, int]:
    """Input positions ``[lo, hi)`` that output positions ``[r0, r1)`` read."""
    lo = max(0, r0 * axis.stride - axis.padding)
    hi = min(
        axis.size, (r1 - 1) * axis.stride + (axis.kernel - 1) * axis.dilation - axis.padding + 1
    )
    return lo, hi


def _window(axis: _Axis, kappa: int, t0: int, t1: int, u0: int):
    """For kernel offset ``kappa``: the output positions of ``[t0, t1)`` whose input
    position is real, as a slice relative to ``t0``, and their input positions as a
    strided slice relative to ``u0``; None if there are none."""
    shift = kappa * axis.dilation - axis.padding
    lo = max(t0, -(shift // axis.stride) if shift < 0 else 0)  # ceil(-shift / stride)
    hi = min(t1 - 1, (axis.size - 1 - shift) // axis.stride)
    if lo > hi:
        return None
    u_lo, u_hi = lo * axis.stride + shift, hi * axis.stride + shift
    return slice(lo - t0, hi - t0 + 1), slice(u_lo - u0, u_hi - u0 + 1, axis.stride)


def _covers(index: tuple, shape: tuple) -> bool:
    """Whether the slices of ``index`` span every axis of ``shape`` in full."""
    return all(sl.indices(size) == (0, size, 1) for sl, size in zip(index, shape))


def _band_in(axis: _Axis, rows: int) -> int:
    return min(axis.size, (rows - 1) * axis.stride + (axis.kernel - 1) * axis.dilation + 1)


def _positions_tiling(problem: Problem, budget: int) -> GhostTiling:
    geom, n, itemsize = problem.geom, problem.n, problem.itemsize
    axes = _axes(geom, problem.size)
    t0 = axes[0].out
    inner_t = numel(a.out for a in axes[1:])
    inner_s = numel(a.size for a in axes[1:])
    skipped = any(a.step > 1 for a in axes)  # the kept positions are copied
    operands = geom.in_channels * numel(a.size for a in axes) if skipped else 0

    def per_sample(rows):  # M, and the two T×T blocks
        si, bi = _band_in(axes[0], rows) * inner_s, rows * inner_t
        return geom.groups * (si * si + 2 * bi * bi)

    whole = (operands + per_sample(t0)) * itemsize
    if whole <= budget:
        chunk, rows = max(1, min(n, budget // whole)), t0
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
    calls = math.ceil(n / chunk) * pairs * (geom.kernel_numel + 6)
    memory = chunk * (operands + per_sample(rows)) * itemsize
    # seconds per multiply-add, per element moved, per tensor operation, and per
    # element of the input Gram matrix (written, then read through strided windows)
    *coefficients, per_gram = time_coefficients("ghost-positions", problem.device)
    time = linear_time(coefficients, flops, traffic, calls) + per_gram * gram
    memory = scale_memory("ghost-positions", problem.device, memory)
    return GhostTiling(method="positions", chunk=chunk, block=rows, memory=memory, time=time)


def _offsets_length(problem: Problem) -> int:
    """Positions the offsets method's Gram matrices span (the padded grid's rows at
    stride 1, where the operands are windows of one flat buffer)."""
    if _flat_ok(problem.geom):
        p = padded_size(problem.geom, problem.size)
        return problem.output_size[0] * numel(p[1:])
    return problem.positions


def _offsets_tiling(problem: Problem, budget: int) -> GhostTiling:
    geom, n, itemsize = problem.geom, problem.n, problem.itemsize
    length = _offsets_length(problem)
    padded = geom.in_channels * numel(padded_size(geom, problem.size))
    if _flat_ok(geom):  # the flat padded input and the output gradient on its grid
        operands = padded + geom.out_channels * length
    else:  # the padded input and one offset's copied view
        operands = (padded if any(geom.padding) else 0) + geom.in_channels * length
    whole = (operands + 3 * geom.groups * length * length) * itemsize
    if whole <= budget:
        chunk, block = max(1, min(n, budget // whole)), length
    else:
        chunk, block, left = 1, length, budget // itemsize - operands
        while block > 1 and 3 * geom.groups * block * block > left:
            block = (block + 1) // 2
    blocks = math.ceil(length / block)
    pairs = blocks * (blocks + 1) // 2
    flops = n * geom.groups * pairs * block * block * geom.in_per_group * geom.kernel_numel
    flops += n * geom.groups * pairs * block * block * geom.out_per_group
    traffic = n * pairs * geom.kernel_numel * geom.in_channels * block * 2
    traffic += n * geom.groups * pairs * (2 * geom.kernel_numel + 3) * block * block
    calls = math.ceil(n / chunk) * pairs * (3 * geom.kernel_numel + 6)
    memory = chunk * (operands + 3 * geom.groups * block * block) * itemsize
    time = linear_time(time_coefficients("ghost-offsets", problem.device), flops, traffic, calls)
    memory = scale_memory("ghost-offsets", problem.device, memory)
    return GhostTiling(method="offsets", chunk=chunk, block=block, memory=memory, time=time)


def method_tilings(problem: Problem, budget: int) -> dict[str, GhostTiling]:
    """Each method's chunk, tiling and predicted cost within ``budget`` bytes,
    ``{"positions": ..., "offsets": ...}``."""
    return {
        "positions": _positions_tiling(problem, budget),
        "offsets": _offsets_tiling(problem, budget),
    }


def choose_tiling(problem: Problem, budget: int) -> GhostTiling:
    """The method, chunk and tiling of the ghost norms within ``budget`` bytes: the
    faster method whose temporaries fit, else the leaner."""
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
    gram = _positions_gram if chosen.method == "positions" else _offsets_gram
    shape = (x.shape[0], geom.out_channels) if channels else (x.shape[0],)
    out = x.new_zeros(shape)
    for n0 in range(0, x.shape[0], chosen.chunk):
        rows = slice(n0, n0 + chosen.chunk)
        out[rows] = gram(x[rows], g[rows], geom, chosen.block, channels)
    return out


def _contract(ga: Tensor, gb: Tensor | None, gi: Tensor, gj: Tensor) -> Tensor:
    """``⟨A_iᵀA_j, B_iᵀB_j⟩`` summed over groups ``[n]`` (``ga`` ``[n, G, bi, bj]``,
    ``gb = B_iᵀB_j`` of the same shape), or, without ``gb``, per channel ``[n, C_out]``
    from ``gi``/``gj`` ``[n, G, C_out/G, bi/bj]``."""
    if gb is None:
        return ((gi @ ga) * gj).sum(-1).flatten(1)
    return ga.mul_(gb).sum((1, 2, 3))


def _positions_gram(
    x: Tensor, g: Tensor, geom: ConvGeometry, rows: int, channels: bool = False
) -> Tensor:
    """Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩ per sample by strided windows of the input's Gram
    matrix over positions, in bands of ``rows`` output rows."""
    axes = _axes(geom, tuple(x.shape[2:]))
    for a, axis in enumerate(axes):
        if axis.step > 1:
            index = slice(axis.first, axis.first + (axis.size - 1) * axis.step + 1, axis.step)
            x = x[(slice(None),) * (2 + a) + (index,)]
    n, grp = x.shape[0], geom.groups
    sizes, outs = [a.size for a in axes], [a.out for a in axes]
    xg = x.reshape(n, grp, geom.in_per_group, *sizes)
    gg = g.reshape(n, grp, geom.out_per_group, *outs)
    offsets = list(itertools.product(*[range(a.kernel) for a in axes]))
    every = (slice(None), slice(None))
    out = x.new_zeros((n, geom.out_channels) if channels else n)
    t0 = outs[0]
    for r0 in range(0, t0, rows):
        r1 = min(t0, r0 + rows)
        lo_i, hi_i = _band(axes[0], r0, r1)
        for c0 in range(r0, t0, rows):
            c1 = min(t0, c0 + rows)
            lo_j, hi_j = _band(axes[0], c0, c1)
            if lo_i >= hi_i or lo_j >= hi_j:
                continue  # bands that read only padding
            xi = xg.narrow(3, lo_i, hi_i - lo_i).flatten(3)  # [n, G, C_in/G, Si]
            xj = xg.narrow(3, lo_j, hi_j - lo_j).flatten(3)
            m = xi.transpose(-1, -2) @ xj
            m = m.view(n, grp, hi_i - lo_i, *sizes[1:], hi_j - lo_j, *sizes[1:])
            gi = gg.narrow(3, r0, r1 - r0).flatten(3)  # [n, G, C_out/G, bi]
            gj = gg.narrow(3, c0, c1 - c0).flatten(3)
            gb = None if channels else gi.transpose(-1, -2) @ gj  # [n, G, bi, bj]
            shape = (n, grp, r1 - r0, *outs[1:], c1 - c0, *outs[1:])
            windows = []  # (target, source) of every offset whose window is not empty
            for kappa in offsets:
                left = [_window(axes[0], kappa[0], r0, r1, lo_i)]
                right = [_window(axes[0], kappa[0], c0, c1, lo_j)]
                for axis, k in zip(axes[1:], kappa[1:]):
                    left.append(_window(axis, k, 0, axis.out, 0))
                right += left[1:]
                if not any(w is None for w in left + right):
                    target = every + tuple(w[0] for w in left) + tuple(w[0] for w in right)
                    source = every + tuple(w[1] for w in left) + tuple(w[1] for w in right)
                    windows.append((target, source))
            # a window over the whole block (the centre offset of a "same" convolution)
            # starts the sum as a copy, saving a pass of zeros and one addition
            whole = next((w for w in windows if _covers(w[0], shape)), None)
            if whole is None:
                ga = gi.new_zeros(shape)
            else:
                windows.remove(whole)
                ga = m[whole[1]].clone(memory_format=torch.contiguous_format)
            for target, source in windows:
                ga[target] += m[source]
            ga = ga.view(n, grp, gi.shape[-1], gj.shape[-1])
            del m
            weight = 1.0 if r0 == c0 else 2.0  # the band below the diagonal
            out += weight * _contract(ga, gb, gi, gj)
            del ga, gb
    return out


def _offsets_gram(
    x: Tensor, g: Tensor, geom: ConvGeometry, block: int, channels: bool = False
) -> Tensor:
    """Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩ per sample, one product per kernel offset, in blocks of
    ``block`` positions."""
    gm, views = offset_operands(x, g, geom)
    length = gm.shape[-1]  # gm [n, G, C_out/G, L]
    out = x.new_zeros((x.shape[0], geom.out_channels) if channels else x.shape[0])
    for i0 in range(0, length, block):
        rows = slice(i0, i0 + block)
        for j0 in range(i0, length, block):
            cols = slice(j0, j0 + block)
            gb = None
            if not channels:
                gb = gm[..., rows].transpose(-1, -2) @ gm[..., cols]  # [n, G, bi, bj]
            ga = None
            for view in views():  # view [n, G, C_in/G, L]
                part = view[..., rows].transpose(-1, -2) @ view[..., cols]
                ga = part if ga is None else ga.add_(part)
                del part
            weight = 1.0 if i0 == j0 else 2.0  # the block below the diagonal
            out += weight * _contract(ga, gb, gm[..., rows], gm[..., cols])
            del ga, gb
    return out
