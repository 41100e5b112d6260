"""``"shift"``: one batched matrix product per kernel offset, no im2col.

For every kernel offset κ (K = prod(k) of them) the input positions it touches form
a strided view of the padded input, and ``grad[..., κ] = g @ view^T`` per sample
and group. Summing over the kernel offsets one at a time is what makes the unfold
unnecessary (the "convolution as one matmul per kernel offset" idea).

With stride 1 along every axis the view needs no copy at all: the padded input is
read as one flat row per channel, the output gradient is laid out on the padded
grid (zeros in the positions that do not exist), and each offset is a contiguous
window of that row, which BLAS takes as it is. With other strides, each offset's
view is copied (one input-sized buffer at a time, never K of them).
"""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import (
    Options,
    Problem,
    linear_time,
    numel,
    pad_input,
    padded_size,
    register_strategy,
)
from .costs import operations_time, scale_memory, spilled_time, time_coefficients
from .geometry import ConvGeometry, torch_pad_argument


def _flat_ok(geom: ConvGeometry) -> bool:
    return all(s == 1 for s in geom.stride)


def _per_sample_temporaries(geom: ConvGeometry, size, per_sample: bool, out_given: bool) -> int:
    """Elements of temporaries one sample adds to a chunk."""
    p = padded_size(geom, size)
    t = geom.output_size(size)
    part = geom.out_channels * geom.in_per_group if (out_given or not per_sample) else 0
    if _flat_ok(geom):
        rows = p[0] + _extra_rows(geom, p)
        return (
            geom.in_channels * rows * numel(p[1:]) + geom.out_channels * t[0] * numel(p[1:]) + part
        )
    padded = geom.in_channels * numel(p) if any(geom.padding) else 0
    return padded + geom.in_channels * numel(t) + part


def chunk_size(problem: Problem, options: Options, out_given: bool = False) -> int:
    """Samples processed together, so that the temporaries fit ``options.memory_budget``
    (bytes; the whole batch without one); at least one sample at a time."""
    budget = options.memory_budget
    if budget is None:
        return max(problem.n, 1)
    per = _per_sample_temporaries(problem.geom, problem.size, problem.per_sample, out_given)
    return max(1, min(problem.n, budget // max(per * problem.itemsize, 1)))


class _Offsets:
    """``store``'s offset ``k`` (its last axis) as a view taken when indexed: autograd
    records in-place writes through a view only if it was taken after the store's last
    in-place write (views taken together by ``unbind`` cannot be written to at all)."""

    def __init__(self, store: Tensor):
        self.store = store

    def __getitem__(self, k: int) -> Tensor:
        return self.store.select(-1, k)


class Shift:
    """Weight VJP by one batched matrix product per kernel offset.

    The batch is processed in chunks whose temporaries fit ``options.memory_budget``
    (the whole batch at once without one); per-sample results are written in place,
    kernel offset by kernel offset, so the returned per-sample tensor is a strided
    view (offset-major storage) of the usual shape.
    """

    name: ClassVar[str] = "shift"
    options: ClassVar[frozenset[str]] = frozenset({"memory_budget"})
    composite: ClassVar[bool] = False

    def vjp(self, x, g, geom, *, per_sample, options, out=None) -> Tensor:
        n, kk = x.shape[0], geom.kernel_numel
        grp, cg, og = geom.groups, geom.in_per_group, geom.out_per_group
        differentiable = torch.is_grad_enabled() and (x.requires_grad or g.requires_grad)
        direct = out is None and per_sample and not differentiable
        if direct:  # [K, N, G, C_out/G, C_in/G]: each (offset, chunk) block is contiguous
            store = x.new_empty(kk, n, grp, og, cg)
            blocks = store.unbind(0)
        else:
            if out is None:
                store = x.new_zeros(((n,) if per_sample else ()) + (grp, og, cg, kk))
            else:
                store = out.view(((n,) if per_sample else ()) + (grp, og, cg, kk))
            # each offset's [(N,) G, C_out/G, C_in/G]: one unbind; where autograd records
            # the in-place sums (create_graph), a view taken when it is written
            blocks = store.unbind(-1) if not differentiable else _Offsets(store)
        problem = Problem(
            geom, n, tuple(x.shape[2:]), x.element_size(), per_sample, device=x.device.type
        )
        chunk = chunk_size(problem, options, out is not None)
        for n0 in range(0, n, chunk):
            n1 = min(n, n0 + chunk)
            whole = n0 == 0 and n1 == n
            xs, gs = (x, g) if whole else (x[n0:n1], g[n0:n1])
            gm, views = offset_operands(xs, gs, geom)  # gm [n, G, C_out/G, L]
            for k, view in enumerate(views()):  # view [n, G, L, C_in/G]
                if direct:
                    torch.matmul(gm, view, out=blocks[k] if whole else blocks[k][n0:n1])
                    continue
                part = torch.matmul(gm, view)  # [n, G, C_out/G, C_in/G]
                if not per_sample:
                    blocks[k].add_(part.sum(0))
                else:
                    (blocks[k] if whole else blocks[k][n0:n1]).add_(part)
                del part
            # release this chunk's operands before the next chunk's are built
            gm = views = view = None
        if out is not None:
            return out
        if direct:  # [K, N, G, C_out/G, C_in/G] -> [N, C_out, C_in/G, *k]
            return store.permute(1, 2, 3, 4, 0).reshape(n, *geom.weight_shape)
        return store.reshape(((n,) if per_sample else ()) + geom.weight_shape)

    def memory(self, problem: Problem, options: Options) -> int:
        chunk = chunk_size(problem, options, problem.into)
        per = _per_sample_temporaries(problem.geom, problem.size, problem.per_sample, problem.into)
        # a per-sample result is offset-major: kept in the weight's layout, it is copied
        copied = problem.relayout(dense=False)
        return scale_memory("shift", problem.device, (chunk * per + copied) * problem.itemsize)

    def pieces(self, problem: Problem, options: Options) -> int:
        """Chunks of the batch (:func:`chunk_size`)."""
        return math.ceil(problem.n / chunk_size(problem, options, problem.into))

    def time(self, problem: Problem, options: Options) -> float:
        geom, n = problem.geom, problem.n
        if _flat_ok(geom):
            p = padded_size(geom, problem.size)
            length = problem.output_size[0] * numel(p[1:])  # a window of the flat row
            copies = 0
        else:
            length = problem.positions
            copies = 2 * n * geom.in_channels * length  # each offset's view copied
        operands = n * (geom.in_channels + geom.out_channels) * length + copies
        relayout = problem.relayout(dense=False)  # read and written once more
        traffic = geom.kernel_numel * operands + problem.per_sample_elements() + 2 * relayout
        per_flop, per_element, flop_depthwise, _ = time_coefficients("shift", problem.device)
        time = linear_time((per_flop, per_element, 0.0), problem.flops(), traffic, 0)
        # per chunk: its operands, and a strided view and a product per kernel offset
        chunks = math.ceil(problem.n / chunk_size(problem, options, problem.into))
        # a chunk's operands, read once per kernel offset, larger than the last-level
        # cache: each offset's products read them from memory again
        working = operands / chunks * problem.itemsize
        time += spilled_time("shift", working, traffic, problem.device)
        kk = geom.kernel_numel
        if _flat_ok(geom):  # one window view, an unbind per row of offsets
            k = geom.kernel_size
            per_chunk = 4 + sum(numel(k[:i]) for i in range(geom.dims))
        else:  # a copied view per offset (a slice per axis, a copy, a transpose)
            per_chunk = (1 if any(geom.padding) else 0) + 1 + kk * (geom.dims + 2)
        # a product per offset, which adds into the result unless written in place
        direct = problem.per_sample and not problem.into
        per_chunk += kk * (1 if direct else 2 if problem.per_sample else 3)
        if chunks > 1:  # the chunk's slices of the operands and of each offset's block
            per_chunk += 2 + (kk if problem.per_sample else 0)
        ops = (4 if direct else 2) + chunks * per_chunk + (1 if relayout else 0)
        time += operations_time(ops, problem.device)
        if geom.groups > 1 and geom.in_per_group == 1:
            # depthwise: each offset's product is a batch of N·C dot products, which
            # batched matrix products run far below their rate for larger matrices
            time += flop_depthwise * problem.flops()
        return time


def _offsets(geom: ConvGeometry):
    """All kernel offsets, in the weight's (row-major) order."""
    return itertools.product(*[range(k) for k in geom.kernel_size])


def offset_operands(x: Tensor, g: Tensor, geom: ConvGeometry):
    """The output gradient as ``[n, G, C_out/G, L]`` and, per kernel offset, the input
    positions it meets as ``[n, G, L, C_in/G]``: ``grad[..., κ] = g @ view_κ``.

    Returns:
        ``(gm, views)``; ``views()`` yields the K views, in the weight's offset order,
        each time it is called. With stride 1 they are windows of the padded input,
        read as one flat row per channel (L: T_0 rows of the padded grid, the output
        gradient laid out on that grid with zeros where no output position is; no
        copy per offset); otherwise each is a copy (L = T).
    """
    return (_flat_operands if _flat_ok(geom) else _copied_operands)(x, g, geom)


def _extra_rows(geom: ConvGeometry, padded: tuple[int, ...]) -> int:
    """Rows of zeros added after the padded input's first axis so that every offset's
    window of T_0 rows stays inside its own channel's plane."""
    row = [numel(padded[i + 1 :]) for i in range(geom.dims)]
    spill = sum(
        (k - 1) * d * r for k, d, r in zip(geom.kernel_size[1:], geom.dilation[1:], row[1:])
    )
    return -(-spill // row[0])


def _padded_contiguous(t: Tensor, pairs: list) -> Tensor:
    """``t`` (``[n, C, *spatial]``) zero-padded by ``(before, after)`` per spatial axis
    (first axis first), in a contiguous tensor: ``F.pad`` (one operation), except where
    the channels are ``t``'s innermost axis (channels-last, as ConvNeXt's blocks hand
    their depthwise convolution): ``F.pad`` keeps that layout, and a contiguous copy of
    its result would be a second padded buffer alive beside it, so a zeroed buffer and
    one copy into it instead."""
    if not (t.shape[1] > 1 and t.stride(1) == 1 and numel(t.shape[2:]) > 1):
        out = F.pad(t, torch_pad_argument(pairs))
        return out if out.is_contiguous() else out.contiguous()
    lead, size = t.shape[: t.dim() - len(pairs)], t.shape[t.dim() - len(pairs) :]
    out = t.new_zeros((*lead, *(lo + s + hi for (lo, hi), s in zip(pairs, size))))
    out[(Ellipsis, *(slice(lo, lo + s) for (lo, _), s in zip(pairs, size)))] = t
    return out


def _flat_operands(x: Tensor, g: Tensor, geom: ConvGeometry):
    """Stride-1 case: windows of the padded input (one padded copy), no copy per offset."""
    n, c = x.shape[:2]
    size, t = tuple(x.shape[2:]), tuple(g.shape[2:])
    p = list(padded_size(geom, size))
    extra = _extra_rows(geom, tuple(p))
    pairs = [(pp, pp) for pp in geom.padding]
    pairs[0] = (pairs[0][0], pairs[0][1] + extra)
    xp = _padded_contiguous(x, pairs)  # [n, C_in, p_0 + extra, *p[1:]]
    p[0] += extra
    row = [numel(p[i + 1 :]) for i in range(geom.dims)]  # flat stride of each axis
    length = t[0] * row[0]  # window: T_0 rows of the padded grid
    plane = numel(p)
    # the output gradient on the padded grid's rows (zeros past each row's T positions)
    grid = _padded_contiguous(g, [(0, 0)] + [(0, q - s) for q, s in zip(p[1:], t[1:])])
    gm = grid.reshape(n, geom.groups, geom.out_per_group, length)
    cg = geom.in_per_group
    # every offset's window at once, the kernel axes first: [*k, n, G, L, C_in/G]
    shape = (*geom.kernel_size, n, geom.groups, length, cg)
    strides = (*(d * r for d, r in zip(geom.dilation, row)), c * plane, cg * plane, 1, plane)
    windows = xp.as_strided(shape, strides, xp.storage_offset())

    def views():
        yield from _unbound(windows, geom.dims)

    return gm, views


def _unbound(t: Tensor, axes: int):
    """The sub-tensors of ``t`` along its first ``axes`` axes, in row-major order (one
    ``unbind`` per sub-tensor of the axes before the last)."""
    if axes == 0:
        yield t
        return
    for part in t.unbind(0):
        yield from _unbound(part, axes - 1)


def _copied_operands(x: Tensor, g: Tensor, geom: ConvGeometry):
    """General case: each offset's strided view copied into a matrix."""
    xp = pad_input(x, geom.padding)
    n, t = x.shape[0], tuple(g.shape[2:])
    gm = g.reshape(n, geom.groups, geom.out_per_group, numel(t))

    def views():
        for offset in _offsets(geom):
            index = tuple(
                slice(o * d, o * d + (tt - 1) * s + 1, s)
                for o, d, tt, s in zip(offset, geom.dilation, t, geom.stride)
            )
            view = xp[(slice(None), slice(None), *index)]
            yield view.reshape(n, geom.groups, geom.in_per_group, numel(t)).transpose(-1, -2)

    return gm, views


SHIFT = register_strategy(Shift())
