"""Kronecker factors of one convolution's curvature (KFAC, KFLR, KFRA) without unfold.

KFAC-style approximations of a convolution's weight curvature (Grosse & Martens
2016, "A Kronecker-factored approximate Fisher matrix for convolution layers")
are a Kronecker product ``A ⊗ Ω`` of an output factor ``A`` (from the output
gradients, or BackPACK's backpropagated square root) and an input factor ``Ω``,
the second moment of the unfolded input ``⟦x⟧`` (the patches ``[N, C_in·K, T]``
of ``torch.nn.functional.unfold``, K kernel offsets, T output positions).

BackPACK 1.7.1 forms ``⟦x⟧``, K times the layer input at stride 1. Here every patch
is an entry of one strided view of the padded input, ``[N, C_in, *k, *T]`` with entry
``x[n, c, s·t + d·k]`` (the shift-and-matmul form of a convolution; KFAC-JAX's
``patches_moments``). Ω is taken a *slab* at a time: every offset's patches of a chunk
of samples, copied by one strided copy into ``z [G, Cg·K, M]`` within a memory budget,
and Σ z zᵀ in ``c`` products per slab (row blocks of about ``Cg·K/c`` rows, each
times its own and the later rows): the block upper triangle, whose mirror (one
transposing copy per row block) is the rest. ``c`` is chosen by predicted time (:class:`FactorPlan`): more multiply-adds
for fewer products, ``(c+1)/c`` times the symmetric half's. No patch matrix of the
whole batch is formed unless it fits the budget.

Convention (BackPACK's, kept): the weight ``[C_out, C_in, *k]`` flattened row-major
has the curvature ``A ⊗ Ω`` with

- ``Ω = (1/N) Σₙ Σₜ ⟦x⟧ₙₜ ⟦x⟧ₙₜᵀ`` of shape ``[C_in·K, C_in·K]`` (the KFC paper's Ω:
  a sum over the T output positions, an average over the N samples), rows ordered
  ``(channel, offset)`` as the weight's;
- ``A = Σᵥ Σₙ (Σₜ Sᵥₙₜ)(Σₜ Sᵥₙₜ)ᵀ`` of shape ``[C_out, C_out]``: the GGN of the bias
  from BackPACK's backpropagated square root ``S [V, N, C_out, *T]`` (whose batch
  average is already in ``S``). Under the KFC paper's assumption of spatially
  uncorrelated derivatives this is ``T·Γ``: ``A ⊗ Ω`` is ``T`` times the paper's
  ``Ω ⊗ Γ`` (BackPACK's documented ``H·W`` scale).

``kfac_approx="reduce"`` is KFAC-reduce (Eschenhagen et al. 2023, "Kronecker-Factored
Approximate Curvature for Modern Neural Network Architectures"; Dangel 2024,
"Convolutions and More as Einsum"): ``Ω = (1/N) Σₙ x̄ₙ x̄ₙᵀ`` with ``x̄ₙ = (1/T) Σₜ
⟦x⟧ₙₜ`` the patches averaged over positions; with the same ``A`` (already a sum over
positions, the paper's reduce factor) ``A ⊗ Ω`` is their KFAC-reduce. It costs one
reduction of the strided view over the positions (every offset's sums at once) and
one product over the samples.

Grouped convolutions (``groups = G > 1``; BackPACK refuses them): the weight's
block of group ``g``, ``weight[g·C_out/G : (g+1)·C_out/G]`` (``[C_out/G, C_in/G, *k]``),
gets its own Kronecker product ``A[g] ⊗ Ω[g]``, blocks of different groups are zero:
``A`` has shape ``[G, C_out/G, C_out/G]`` (the diagonal blocks of the full output
factor) and ``Ω`` ``[G, C_in/G·K, C_in/G·K]``.

Transposed convolutions (``weight [C_in, C_out/G, *k]``): as BackPACK, the factors
approximate the curvature of ``weight.transpose(0, 1)`` for ``G = 1``; per group of
``weight[g·C_in/G : (g+1)·C_in/G].transpose(0, 1)`` for ``G > 1``. The unfolded
input of ``y = conv_transpose(x)`` is that of the stride-1 convolution equivalent to
it: ``x`` with ``s - 1`` zeros between its positions, padded by ``d·(k-1) - p``
(``+ output_padding`` on the right), the kernel flipped.

Every padding mode and ``padding="same"`` are taken from the layer's normal form
(:func:`memconv.strategies.geometry.conv_spec`): a circular-padded layer's patches
wrap around (BackPACK's unfold pads with zeros).
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import (
    KFAC_APPROXIMATIONS,
    check_budget,
    check_choice,
    check_chunks,
    check_conv_input,
    check_conv_module,
)
from .._torch import opaque, tracing
from ..strategies.costs import fitted_device, operations_time, spilled_time, time_coefficients
from ..strategies.geometry import ConvSpec, conv_spec, span, spec_of, torch_pad_argument


@dataclass(frozen=True)
class Patches:
    """The patches of a convolution as strided views of one padded input.

    Attributes:
        source: the padded input ``[N, C_in, *P]``: the patch of offset ``k`` at
            output position ``t`` is ``source[:, :, stride·t + dilation·k]``.
        kernel_size: k per spatial dimension.
        stride: the step between output positions, per spatial dimension.
        dilation: the step between kernel offsets, per spatial dimension.
        output_size: T per spatial dimension.
        groups: G.
        flipped: the offsets run backwards (a transposed convolution's kernel).
    """

    source: Tensor
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    output_size: tuple[int, ...]
    groups: int
    flipped: bool = False

    @property
    def offsets(self) -> list[tuple[int, ...]]:
        """The kernel offsets in the weight's (row-major) order."""
        return list(itertools.product(*(range(k) for k in self.kernel_size)))

    def view(self, offset: tuple[int, ...]) -> Tensor:
        """The patch entries of one kernel offset, ``[N, C_in, *T]`` (a view)."""
        index = [slice(None), slice(None)]
        for k, kk, d, s, t in zip(
            offset, self.kernel_size, self.dilation, self.stride, self.output_size
        ):
            start = d * (kk - 1 - k if self.flipped else k)
            index.append(slice(start, start + s * (t - 1) + 1, s))
        return self.source[tuple(index)]


def patches(module: nn.Module, input: Tensor, *, spec: ConvSpec | None = None) -> Patches:
    """The patches of a convolution or transposed convolution for its input.

    Args:
        module: a ``torch.nn.Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d`` (or a
            subclass, e.g. memconv's).
        input: the layer's input ``[N, C_in, *S]``.
        spec: the layer's :func:`memconv.strategies.geometry.conv_spec`, read by the
            caller in the same call; None: read here.

    Returns:
        The :class:`Patches` (the padded input is one copy of the input; for a
        transposed convolution with stride s, ``s^dims`` times its size).

    Raises:
        TypeError: if ``module`` is not a convolution.
        ValueError: if ``input`` does not fit the layer.
    """
    check_conv_module(module)
    spec = spec_of(module, spec)
    geom = spec.geometry
    dims = geom.dims
    check_conv_input(spec, input)
    if not spec.transposed:
        x = spec.normalize_input(input)
        if any(geom.padding):
            x = F.pad(x, torch_pad_argument([(p, p) for p in geom.padding]))
        return Patches(
            source=x,
            kernel_size=geom.kernel_size,
            stride=geom.stride,
            dilation=geom.dilation,
            output_size=geom.output_size(spec.padded_size(tuple(input.shape[2:]))),
            groups=geom.groups,
        )
    n, c = input.shape[:2]
    size = input.shape[2:]
    dilated = input.new_zeros(n, c, *((s - 1) * st + 1 for s, st in zip(size, geom.stride)))
    dilated[(slice(None), slice(None), *(slice(None, None, st) for st in geom.stride))] = input
    pairs = []
    for k, d, p, op in zip(geom.kernel_size, geom.dilation, geom.padding, module.output_padding):
        lo = span(k, d) - 1 - p
        pairs.append((lo, lo + op))
    source = F.pad(dilated, torch_pad_argument(pairs))  # negative pads crop
    out = tuple(
        (s - 1) * st - 2 * p + span(k, d) + op
        for s, st, p, k, d, op in zip(
            size, geom.stride, geom.padding, geom.kernel_size, geom.dilation, module.output_padding
        )
    )
    return Patches(
        source=source,
        kernel_size=geom.kernel_size,
        stride=(1,) * dims,
        dilation=geom.dilation,
        output_size=out,
        groups=geom.groups,
        flipped=True,
    )


def input_factor(
    module: nn.Module,
    input: Tensor,
    *,
    kfac_approx: str = "expand",
    memory_budget: int | None = None,
    chunks: int | None = None,
    spec: ConvSpec | None = None,
) -> Tensor:
    """The input factor Ω of a convolution's Kronecker-factored curvature, no unfold.

    ``"expand"`` copies the patches of every kernel offset into one slab ``[G, Cg·K,
    M]`` at a time (one strided copy of the padded input, rows in the weight's order;
    M positions of a chunk of samples) and takes Σ z zᵀ in ``chunks`` products per
    slab: the row block ``[a, b)`` times the rows ``a`` to the last, ``(c+1)/c`` times
    the multiply-adds of Ω's symmetric half (:class:`FactorPlan`, :func:`expand_plan`).
    Besides the slab it holds Ω once (the result, accumulated in place; a transposed
    convolution's is flipped into a second); in a traced step whose row blocks are
    joined, the blocks and Ω: ``1 + (c+1)/(2c)`` times Ω's bytes at the join.

    Args:
        module: a ``torch.nn.Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d`` (or a
            subclass).
        input: the layer's input ``[N, C_in, *S]`` (any float dtype; the factor
            has its dtype).
        kfac_approx: ``"expand"`` (KFAC, BackPACK's KFAC/KFLR/KFRA input factor) or
            ``"reduce"`` (KFAC-reduce); see the module's docstring.
        memory_budget: bytes the slab of patches held at once may take: every kernel
            offset's patches of a chunk of samples (``C_in·K·T`` numbers a sample),
            or, where one sample's exceed it, of a chunk of output rows (the first
            spatial axis of T) of one sample; None: :data:`DEFAULT_BUDGET_INPUTS` (4)
            times the padded input's bytes (at stride 1 about the patches of 4
            offsets of every sample), at least one sample's patches. Below one
            output row's patches of one sample it warns and holds those.
            ``"reduce"`` holds no slab (it sums over the positions of the window
            view) and ignores it.
        chunks: c, the products per slab, 1 to :func:`most_chunks` (K, at least 4
            where the rows allow; ``"expand"`` only); None: the c of least predicted
            time, ``per_flop · multiply-adds + per_op · operations`` priced by the
            input's device type (:mod:`memconv.strategies.costs`, the
            ``"ghost-offsets"`` products' ``per_flop``), where on a launch-bound
            device a form of fewer operations within :data:`NEAR_TIE` of that time
            wins the tie: on a CPU, where arithmetic dominates, the most; on a
            launch-bound GPU a few. While a compiled step
            is traced, c and the form of c > 1 are priced together as the compiled
            graph runs them (:attr:`FactorPlan.joined`): the row blocks joined by
            one gather (per slab a fused copy and c products, one join priced by
            :func:`join_time`) or accumulated in place by one custom operator (its
            operations, each a launch).
        spec: the layer's :func:`memconv.strategies.geometry.conv_spec`, read by the
            caller in the same call (BackPACK's module extension reads it once per
            layer call); None: read here.

    Returns:
        ``[C_in·K, C_in·K]`` for ``groups = 1``; ``[G, C_in/G·K, C_in/G·K]`` for
        ``groups = G > 1`` (one block per group). Symmetric.

    Warns:
        UserWarning: ``memory_budget`` below one output row's patches of one sample
            (before the products).

    Raises:
        TypeError: if ``module`` is not a convolution, ``memory_budget`` or
            ``chunks`` not an int.
        ValueError: for an unknown ``kfac_approx``, a non-positive budget, ``chunks``
            outside 1..:func:`most_chunks` or given with ``"reduce"``, or an input that does not fit
            the layer.
    """
    check_choice(kfac_approx, KFAC_APPROXIMATIONS, "kfac_approx", none=False)
    check_budget(memory_budget, available=False, where="input_factor")
    if chunks is not None and kfac_approx == "reduce":
        raise ValueError("input_factor: chunks applies to kfac_approx='expand' only")
    p = patches(module, input, spec=spec)
    check_chunks(chunks, most_chunks(p.source.shape[1] // p.groups, math.prod(p.kernel_size)))
    if kfac_approx == "reduce":
        factor = _reduce_factor(p)
    elif (plan := _plan(p, memory_budget, chunks, warn=True)).chunks > 1 and (
        tracing() and not plan.joined
    ):  # one operation of the traced graph: its products accumulate in place, as eagerly
        factor = _expand_op(
            p.source,
            p.kernel_size,
            p.stride,
            p.dilation,
            p.output_size,
            p.groups,
            p.flipped,
            [plan.samples, plan.rows, plan.chunks, plan.slabs],
        )
    else:  # eagerly, or the few operations a traced graph takes as they are
        factor = _expand_factor(p, plan)
    return factor[0] if p.groups == 1 else factor


#: How much more predicted time than the least a form of fewer operations (fewer
#: launches) may take and still be chosen (:func:`expand_plan`) where the calibration
#: was fitted on a launch-bound device (not a CPU): 5 %, well within the time models'
#: errors there (the CUDA calibration's median relative error over its rows is 26 %),
#: so that a tie the prices cannot tell apart goes to fewer launches. On a CPU the
#: arithmetic is the cost and the least predicted time stands: there the prices'
#: ordering held when measured (on a CIFAR ResNet-18's KFAC step, c = 9 row blocks ran
#: 7 % faster than a 5 % margin's c = 5 or 6).
NEAR_TIE = 0.05

#: The default ``memory_budget`` of :func:`input_factor`, in multiples of the bytes of
#: the padded input: at stride 1, about the patches of this many kernel offsets.
DEFAULT_BUDGET_INPUTS = 4


@dataclass(frozen=True)
class FactorPlan:
    """How :func:`input_factor` takes KFAC's (expand) input factor of one layer.

    The patches of every kernel offset ``[G, Cg·K, M]`` (rows in the weight's
    ``(channel, offset)`` order, M positions of some samples) are copied into one
    *slab* at a time, by one strided copy; each slab's rows are cut into ``chunks``
    row blocks of about ``Cg·K/c`` rows, and the block of rows ``[a, b)`` is
    multiplied by the rows ``a`` to the last in ONE product: ``c`` products per slab
    compute the block upper triangle of Ω,
    ``(c+1)/c`` times the multiply-adds of its symmetric half (the diagonal blocks
    whole). The slabs are chunks of samples, or of output rows (the first output axis)
    of one sample where one sample's patches exceed the budget.

    Attributes:
        samples: samples per slab.
        rows: output rows (first spatial axis of T) per slab: all of them unless one
            sample's patches exceed the budget (then ``samples = 1``).
        chunks: c, the row blocks (products) per slab.
        slabs: the number of slabs.
        slab_bytes: the bytes of the largest slab.
        multiply_adds: of the products, in all.
        operations: top-level tensor operations predicted for the factor (in a
            traced step, its launches in the compiled graph).
        joined: in a traced step with c > 1, whether the row blocks are tensors of
            their own joined into Ω by one gather (a compiler's one or two kernels),
            rather than one custom operator that accumulates them in place and mirrors
            them (:func:`input_factor`); False otherwise.
    """

    samples: int
    rows: int
    chunks: int
    slabs: int
    slab_bytes: int
    multiply_adds: int
    operations: int
    joined: bool = False

    @property
    def products(self) -> int:
        """Matrix products (each a ``bmm`` over the G groups) in all: slabs × chunks."""
        return self.slabs * self.chunks


def expand_plan(
    module: nn.Module,
    input: Tensor,
    *,
    memory_budget: int | None = None,
    chunks: int | None = None,
    spec: ConvSpec | None = None,
) -> FactorPlan:
    """The slabs and products :func:`input_factor` (``kfac_approx="expand"``) takes.

    Args:
        module: a convolution or transposed convolution (as :func:`input_factor`).
        input: the layer's input ``[N, C_in, *S]`` (its shape, dtype and device).
        memory_budget: as :func:`input_factor`'s.
        chunks: c, the products per slab (1 to :func:`most_chunks`); None: the c of
            least predicted time (see :func:`input_factor`).
        spec: the layer's :func:`memconv.strategies.geometry.conv_spec`; None: read here.

    Returns:
        The :class:`FactorPlan`.

    Raises:
        TypeError, ValueError: as :func:`input_factor`; ``chunks`` not an int in
            1..:func:`most_chunks`.
    """
    check_budget(memory_budget, available=False, where="expand_plan")
    p = patches(module, input, spec=spec)
    return _plan(p, memory_budget, chunks, warn=False)


def _plan(p: Patches, memory_budget: int | None, chunks: int | None, warn: bool) -> FactorPlan:
    n, c = p.source.shape[:2]
    k = math.prod(p.kernel_size)
    g = p.groups
    most = most_chunks(c // g, k)
    check_chunks(chunks, most)
    t1, rest = p.output_size[0], math.prod(p.output_size[1:])
    size = p.source.element_size()
    per_row = c * k * rest * size  # every offset's patches of one output row of one sample
    per_sample = per_row * t1
    if memory_budget is None:
        budget = max(per_sample, DEFAULT_BUDGET_INPUTS * _nbytes(p.source))
    else:
        budget = memory_budget
    if memory_budget is not None and memory_budget < per_row:
        if warn:
            warnings.warn(
                f"input_factor: memory_budget={memory_budget:,} bytes is below every "
                f"kernel offset's patches of one output row of one sample ({per_row:,} "
                "bytes, the least it needs); it holds those; raise the budget to silence "
                "this",
                stacklevel=4,
            )
    if per_sample <= budget:
        samples, rows = min(n, budget // per_sample), t1
        slabs = math.ceil(n / samples)
    else:
        samples, rows = 1, max(1, min(t1, budget // per_row))
        slabs = n * math.ceil(t1 / rows)
    positions = n * t1 * rest  # M summed over the slabs
    width = c // g * k

    def macs(cc: int) -> int:  # Σ_a (b - a)(Cg·K - a) entries, times G and M
        bounds = row_bounds(width, cc)
        entries = sum((b - a) * (width - a) for a, b in zip(bounds, bounds[1:]))
        return entries * g * positions

    traced = tracing()
    device = p.source.device.type

    def operations(cc: int, joined: bool) -> int:  # as _expand_factor and _each_slab issue them
        if traced and (cc == 1 or joined):  # a compiled graph's launches: a copy and c
            return slabs * (cc + 1) + joined + 3 * p.flipped  # products a slab, the join
        # the window views and one copy of each slab
        views = math.ceil(n / samples) * (samples < n) + slabs * (3 + (rows < t1))
        if cc == 1:  # the first slab's product makes the accumulator
            return 2 + views + 2 * slabs + 3 * p.flipped
        # the accumulator's row blocks; each slab's transpose, row blocks and
        # products; the column blocks and the mirroring copies
        return 4 + cc + views + slabs * (2 * cc + 1) + 4 * (cc - 1) + 3 * p.flipped

    def seconds(cc: int, joined: bool) -> float:
        spent = per_mac * macs(cc) + operations_time(operations(cc, joined), device)
        if joined:
            spent += join_time(width, g, cc, size, device)
        return spent

    per_mac = time_coefficients("ghost-offsets", device)[0]
    forms = [
        (cc, joined)
        for cc in (range(1, most + 1) if chunks is None else (chunks,))
        for joined in ((False, True) if traced and cc > 1 else (False,))
    ]
    # the fewest operations among the forms within NEAR_TIE of the least predicted time
    # on a launch-bound device; a CPU's prices are taken as they are
    priced = {form: seconds(*form) for form in forms}
    least = min(priced.values())
    margin = 0.0 if fitted_device(device) == "cpu" else NEAR_TIE
    near = [form for form in forms if priced[form] <= least * (1 + margin)]
    chunks, joined = min(near, key=lambda form: (operations(*form), priced[form]))
    return FactorPlan(
        samples=samples,
        rows=rows,
        chunks=chunks,
        slabs=slabs,
        slab_bytes=samples * rows * per_row,
        multiply_adds=macs(chunks),
        operations=operations(chunks, joined),
        joined=joined,
    )


def join_time(side: int, groups: int, chunks: int, element_size: int, device_type: str) -> float:
    """Seconds a traced step's join of the input factor's row blocks into Ω takes
    (a ``joined`` :class:`FactorPlan`; the ``"kfac-join"`` time model of
    :mod:`memconv.strategies.costs`, fitted by ``memconv calibrate``): ``per_element``
    per entry of Ω, and ``per_element_spilled`` more per entry where the row blocks
    and Ω together outgrow the last-level cache of the calibration's machine
    (:func:`~memconv.strategies.costs.spilled_time`). On a CPU the join's gather reads
    the blocks across their rows for Ω's lower triangle, which costs it more per entry
    than ATen's blocked copies of the in-place form.

    Args:
        side: Ω's side, ``C_in/G·K``.
        groups: G, one Ω per group.
        chunks: c, the row blocks (2 or more).
        element_size: bytes per entry.
        device_type: the device type whose calibration prices it.

    Returns:
        Seconds.
    """
    entries = groups * side * side
    bounds = row_bounds(side, chunks)
    blocks = sum((b - a) * (side - a) for a, b in zip(bounds, bounds[1:]))
    held = groups * element_size * (side * side + blocks)
    per_element = time_coefficients("kfac-join", device_type)[0]
    return per_element * entries + spilled_time("kfac-join", held, entries, device_type)


def most_chunks(channels: int, offsets: int) -> int:
    """The most products per slab :func:`input_factor` takes for ``Cg`` channels per
    group and K kernel offsets: K, at least 4, at most the ``Cg·K`` rows (row blocks
    thinner than a channel's K offsets lose more to the product's efficiency than the
    multiply-adds they save)."""
    return min(channels * offsets, max(offsets, 4))


def row_bounds(rows: int, chunks: int) -> list[int]:
    """The boundaries ``[a_0 = 0, a_1, ..., a_c = rows]`` of ``chunks`` (c) row blocks of
    about ``rows/c`` rows each: ``a_k = ⌊k·rows/c⌋``."""
    return [i * rows // chunks for i in range(chunks + 1)]


def _windows(p: Patches) -> Tensor:
    """Every patch as one strided view of the padded input, ``[N, C, *k, *T]``: entry
    ``[n, c, j, t] = source[n, c, stride·t + dilation·j]`` (offsets unflipped)."""
    src = p.source
    spatial = src.stride()[2:]
    strides = (
        *src.stride()[:2],
        *(d * s for d, s in zip(p.dilation, spatial)),
        *(st * s for st, s in zip(p.stride, spatial)),
    )
    shape = (*src.shape[:2], *p.kernel_size, *p.output_size)
    return src.as_strided(shape, strides, src.storage_offset())


def _expand_fake(source, kernel_size, stride, dilation, output_size, groups, flipped, plan):
    size = source.shape[1] // groups * math.prod(kernel_size)
    return source.new_empty(groups, size, size)


@opaque(
    "expand_input_factor",
    "(Tensor source, int[] kernel_size, int[] stride, int[] dilation, int[] output_size, "
    "int groups, bool flipped, int[] plan) -> Tensor",
    _expand_fake,
)
def _expand_op(source, kernel_size, stride, dilation, output_size, groups, flipped, plan):
    """:func:`_expand_factor` of the patches of ``source`` under the plan ``[samples,
    rows, chunks, slabs]``, accumulated in place, as one operation of a traced graph
    (:func:`memconv._torch.opaque`): its products accumulate into blocks of one buffer
    and mirror it, which a compiler would functionalise into copies of the whole
    factor."""
    p = Patches(
        source=source,
        kernel_size=tuple(kernel_size),
        stride=tuple(stride),
        dilation=tuple(dilation),
        output_size=tuple(output_size),
        groups=groups,
        flipped=flipped,
    )
    samples, rows, chunks, slabs = plan
    fields = {"slab_bytes": 0, "multiply_adds": 0, "operations": 0}
    return _expand_factor(p, FactorPlan(samples, rows, chunks, slabs, **fields))


def _expand_factor(p: Patches, plan: FactorPlan) -> Tensor:
    """Ω = (1/N) Σₙₜ ⟦x⟧ ⟦x⟧ᵀ per group, ``[G, Cg·K, Cg·K]``, in a few large products.

    Each slab (:class:`FactorPlan`) is one strided copy ``z [G, Cg·K, M]`` of the
    window view, rows in the weight's ``(channel, offset)`` order. With one product per
    slab (c = 1) Σ z zᵀ is Ω. Otherwise the row block ``[a, b)`` times the rows ``a``
    to the last is one product per slab, whose results make Ω's block upper triangle
    (the diagonal blocks whole), the rest its mirror: eagerly the products accumulate
    in place into the blocks of Ω itself (``baddbmm_``) and one transposing copy per
    row block mirrors them; in a joined plan (a traced step's,
    :attr:`FactorPlan.joined`) each row block is a tensor of its own, summed over the
    slabs as c = 1's product is, and Ω is gathered from them (:func:`join_row_blocks`):
    operations a compiler fuses, where it would functionalise writes into blocks of
    one buffer into copies of the whole factor.
    """
    n, c = p.source.shape[:2]
    g = p.groups
    cg = c // g
    dims = len(p.kernel_size)
    size = math.prod(p.kernel_size) * cg
    bounds = row_bounds(size, plan.chunks)
    # eagerly the products' alpha takes Ω's mean over the samples (no pass of its own);
    # a traced graph divides once, where the compiler fuses the division with other
    # kernels (an uninitialised input of a first product, the alpha's form, kept the
    # producers of some slab copies from fusing with them: more kernels)
    traced = tracing()
    scale = 1.0 if traced else 1.0 / n
    if plan.chunks == 1:
        (out,) = _summed_blocks(p, plan, bounds, scale)
    elif plan.joined:
        out = join_row_blocks(_summed_blocks(p, plan, bounds, scale))
    else:
        out = p.source.new_empty(g, size, size)  # written by the first slab and the mirror
        targets = [
            block.narrow(2, a, size - a) for a, block in zip(bounds, out.split(_sizes(bounds), 1))
        ]
        fn = functools.partial(_products, bounds=bounds, targets=targets, scale=scale)
        _each_slab(p, plan, fn)
        # the block upper triangle holds Σ z zᵀ: mirror each row block right of its
        # diagonal block into the column block below it
        for a, b, target, column in zip(bounds, bounds[1:], targets, out.split(_sizes(bounds), 2)):
            if b < size:
                column.narrow(1, b, size - b).copy_(target.narrow(2, b - a, size - b).mT)
        del targets
    if p.flipped:
        shape = (g, cg, *p.kernel_size, cg, *p.kernel_size)
        kernel = tuple(range(2, 2 + dims))
        out = out.view(shape).flip((*kernel, *(i + dims + 1 for i in kernel))).view_as(out)
    return out.div_(n) if traced else out


def _summed_blocks(p: Patches, plan: FactorPlan, bounds: list[int], scale: float) -> list[Tensor]:
    """The row blocks ``scale · Σ z[:, a:b] z[:, a:]ᵀ`` over the slabs of the plan, one
    product each per slab: the first slab's makes a block (``bmm``; for a scale other
    than 1 a ``baddbmm`` with ``beta=0``, its uninitialised input never read), the
    others add into it whole (``baddbmm_``, no part of it written), which a compiler
    keeps as products (no zero fill). With one block (c = 1), ``scale · Σ z zᵀ``."""
    blocks: list[Tensor] = []
    size = bounds[-1]

    def add(z: Tensor, _beta: float) -> None:
        zt = z.mT
        parts = z.split(_sizes(bounds), 1) if len(bounds) > 2 else (z,)
        for i, (a, rows) in enumerate(zip(bounds, parts)):
            suffix = zt if a == 0 else zt.narrow(2, a, size - a)
            if i < len(blocks):
                blocks[i].baddbmm_(rows, suffix, alpha=scale)
            elif scale == 1.0:
                blocks.append(torch.bmm(rows, suffix))
            else:
                made = z.new_empty(z.shape[0], rows.shape[1], suffix.shape[2])
                blocks.append(torch.baddbmm(made, rows, suffix, beta=0.0, alpha=scale))

    _each_slab(p, plan, add)
    return blocks


def join_row_blocks(blocks: list[Tensor]) -> Tensor:
    """A symmetric Ω from the upper parts of its row blocks, as a joined plan's traced
    step computes it: the blocks laid end to end, and every entry of Ω read from them
    by its computed position, an entry left of its row's block as its mirror. One
    concatenation and one gather, which a compiler makes one or two kernels, where a
    ``torch.cat`` of each row's pieces would be a copy per piece; the positions' index
    tensors, made from Python lists, are constants of a traced graph.

    Args:
        blocks: block k ``[G, b_k - a_k, size - a_k]`` holds Ω's rows ``[a_k, b_k)``
            from column ``a_k`` on (:func:`row_bounds`: ``a_0 = 0``, ``b_k =
            a_{k+1}``, the last ``b = size``).

    Returns:
        Ω ``[G, size, size]``.
    """
    size = blocks[0].shape[2]
    bounds = [size - block.shape[2] for block in blocks] + [size]
    flat = torch.cat([block.flatten(1) for block in blocks], 1)
    rows, starts, offset = [], [], 0
    for a, b in zip(bounds, bounds[1:]):  # row i's entry j sits at rows[i] + j, j ≥ a
        rows.extend(range(offset - a, offset - a + (b - a) * (size - a), size - a))
        starts.extend([a] * (b - a))
        offset += (b - a) * (size - a)
    row = torch.tensor(rows, device=flat.device)
    start = torch.tensor(starts, device=flat.device)
    column = torch.arange(size, device=flat.device)
    upper = column[None, :] >= start[:, None]
    return flat[:, torch.where(upper, row[:, None] + column, row[None, :] + column[:, None])]


def _slab(p: Patches, part: Tensor) -> Tensor:
    """The copy ``[G, Cg·K, M]`` of a part ``[n, C, *k, *T]`` of the window view, rows
    in the weight's ``(channel, offset)`` order, columns ``(sample, position)``."""
    n, c = part.shape[:2]
    g = p.groups
    dims = len(p.kernel_size)
    order = (1, 2, *range(3, 3 + dims), 0, *range(3 + dims, 3 + 2 * dims))
    size = c // g * math.prod(p.kernel_size)
    return part.unflatten(1, (g, c // g)).permute(order).reshape(g, size, -1)


def _each_slab(p: Patches, plan: FactorPlan, fn) -> None:
    """Call ``fn(z, beta)`` on each slab ``z [G, Cg·K, M]`` of the plan (:func:`_slab`;
    one copy each, freed before the next is made), ``beta`` 0 for the first (whose
    products overwrite the accumulator, which ``baddbmm_`` with ``beta=0`` never reads:
    no zero fill) and 1 for the others."""
    n = p.source.shape[0]
    dims = len(p.kernel_size)
    t1 = p.output_size[0]
    windows = _windows(p)
    for n0 in range(0, n, plan.samples):
        samples = windows if plan.samples == n else windows.narrow(0, n0, min(plan.samples, n - n0))
        for r0 in range(0, t1, plan.rows):
            part = samples
            if plan.rows < t1:
                part = samples.narrow(2 + dims, r0, min(plan.rows, t1 - r0))
            fn(_slab(p, part), 0.0 if n0 == r0 == 0 else 1.0)


def _products(
    z: Tensor, beta: float, bounds: list[int], targets: list[Tensor], scale: float
) -> None:
    """Add one slab's ``z [G, Cg·K, M]`` row blocks times their suffixes of rows,
    ``scale · z[:, a:b] z[:, a:]ᵀ``, into ``targets`` (the accumulator's blocks, times
    ``beta``): one product each."""
    zt = z.mT
    for a, target, rows in zip(bounds, targets, z.split(_sizes(bounds), 1)):
        suffix = zt if a == 0 else zt.narrow(2, a, zt.shape[2] - a)
        target.baddbmm_(rows, suffix, beta=beta, alpha=scale)


def _sizes(bounds: list[int]) -> list[int]:
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _reduce_factor(p: Patches) -> Tensor:
    """KFAC-reduce's Ω = (1/N) Σₙ x̄ₙ x̄ₙᵀ per group, ``[G, Cg·K, Cg·K]``: every
    offset's sum over the positions in one reduction of the window view, one product."""
    n = p.source.shape[0]
    g = p.groups
    dims = len(p.kernel_size)
    t = math.prod(p.output_size)
    sums = _windows(p).sum(tuple(range(2 + dims, 2 + 2 * dims)))  # [N, C, *k]
    if p.flipped:
        sums = sums.flip(tuple(range(2, 2 + dims)))
    sums = sums.reshape(n, g, -1).transpose(0, 1)  # [G, N, Cg·K]
    # the mean on the small left operand [G, Cg·K, N]: no pass over Ω of its own
    return torch.bmm(sums.mT * (1.0 / (n * t * t)), sums)


def output_factor(sqrt_ggn: Tensor, groups: int = 1) -> Tensor:
    """The output factor A from BackPACK's backpropagated GGN square root.

    ``A = Σᵥ Σₙ (Σₜ Sᵥₙₜ)(Σₜ Sᵥₙₜ)ᵀ``: the (MC or exact) GGN of the bias, BackPACK's
    KFAC/KFLR factor.

    Args:
        sqrt_ggn: ``S [V, N, C_out, *T]``.
        groups: G; for ``G > 1`` only the diagonal blocks are returned.

    Returns:
        ``[C_out, C_out]``, or ``[G, C_out/G, C_out/G]`` for ``G > 1``.
    """
    summed = sqrt_ggn.flatten(start_dim=3).sum(3).flatten(end_dim=1)  # [V·N, C_out]
    return block_diagonal(summed.T @ summed, groups)


def block_diagonal(factor: Tensor, groups: int) -> Tensor:
    """The diagonal blocks ``[G, C/G, C/G]`` of a ``[C, C]`` factor (itself for G = 1)."""
    if groups == 1:
        return factor
    c = factor.shape[0] // groups
    blocks = factor.view(groups, c, groups, c)
    return torch.stack([blocks[i, :, i] for i in range(groups)])


def is_transposed(module: nn.Module) -> bool:
    """Whether ``module`` is a transposed convolution (as its convolution spec says)."""
    return conv_spec(module).transposed


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()
