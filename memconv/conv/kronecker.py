"""Kronecker factors of one convolution's curvature (KFAC, KFLR, KFRA) without unfold.

KFAC-style approximations of a convolution's weight curvature (Grosse & Martens
2016, "A Kronecker-factored approximate Fisher matrix for convolution layers")
are a Kronecker product ``A ⊗ Ω`` of an output factor ``A`` (from the output
gradients, or BackPACK's backpropagated square root) and an input factor ``Ω``,
the second moment of the unfolded input ``⟦x⟧`` (the patches ``[N, C_in·K, T]``
of ``torch.nn.functional.unfold``, K kernel offsets, T output positions).

BackPACK 1.7.1 forms ``⟦x⟧``, K times the layer input at stride 1. Here the input
factor is taken one block per pair of kernel offsets: the block ``(k, k')`` is the
product of two strided views of the padded input, ``Σₙₜ x[n, :, s·t + d·k]
x[n, :, s·t + d·k']ᵀ`` (KFAC-JAX's ``patches_moments``, the shift-and-matmul form of
a convolution), offsets in chunks under a memory budget, and the blocks below the
diagonal are the transposes of those above it. No patch matrix is formed.

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
pass over the input per offset and no matrix product over positions.

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
    check_conv_input,
    check_conv_module,
)
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
    spec: ConvSpec | None = None,
) -> Tensor:
    """The input factor Ω of a convolution's Kronecker-factored curvature, no unfold.

    Args:
        module: a ``torch.nn.Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d`` (or a
            subclass).
        input: the layer's input ``[N, C_in, *S]`` (any float dtype; the factor
            has its dtype).
        kfac_approx: ``"expand"`` (KFAC, BackPACK's KFAC/KFLR/KFRA input factor) or
            ``"reduce"`` (KFAC-reduce); see the module's docstring.
        memory_budget: bytes the two chunks of patches held at once may take (``m``
            offsets of every sample, ``N·C_in·m·T`` numbers each, where two offsets
            fit; else one offset of a chunk of samples); None: the size of the padded
            input. Below two offsets' patches of one sample it warns and holds those.
        spec: the layer's :func:`memconv.strategies.geometry.conv_spec`, read by the
            caller in the same call (BackPACK's module extension reads it once per
            layer call); None: read here.

    Returns:
        ``[C_in·K, C_in·K]`` for ``groups = 1``; ``[G, C_in/G·K, C_in/G·K]`` for
        ``groups = G > 1`` (one block per group). Symmetric.

    Warns:
        UserWarning: ``memory_budget`` below two kernel offsets' patches (before the
            products).

    Raises:
        TypeError: if ``module`` is not a convolution or ``memory_budget`` is not an int.
        ValueError: for an unknown ``kfac_approx``, a non-positive budget or an
            input that does not fit the layer.
    """
    check_choice(kfac_approx, KFAC_APPROXIMATIONS, "kfac_approx", none=False)
    check_budget(memory_budget, available=False, where="input_factor")
    p = patches(module, input, spec=spec)
    factor = _reduce_factor(p) if kfac_approx == "reduce" else _expand_factor(p, memory_budget)
    return factor[0] if p.groups == 1 else factor


def _expand_factor(p: Patches, memory_budget: int | None) -> Tensor:
    """Ω = (1/N) Σₙₜ ⟦x⟧ ⟦x⟧ᵀ per group, ``[G, Cg·K, Cg·K]``, by offset-chunk products.

    Two chunks of offsets' patches are held at a time, within the budget: several
    offsets of every sample where two offsets fit, else one offset of a chunk of
    samples (the products summed over the sample chunks).
    """
    n, c = p.source.shape[:2]
    g = p.groups
    cg = c // g
    offsets = p.offsets
    k = len(offsets)
    t = math.prod(p.output_size)
    per_sample = c * t * p.source.element_size()  # one offset's patches of one sample
    per_offset = n * per_sample
    budget = memory_budget if memory_budget is not None else max(per_offset, _nbytes(p.source))
    if memory_budget is not None and memory_budget < 2 * per_sample:
        warnings.warn(
            f"input_factor: memory_budget={memory_budget:,} bytes is below two kernel "
            f"offsets' patches of one sample ({2 * per_sample:,} bytes, the least it "
            "needs); it runs one offset of one sample at a time and holds those; raise "
            "the budget to silence this",
            stacklevel=3,
        )
    m = max(1, min(k, budget // (2 * per_offset)))
    step = n if 2 * per_offset <= budget else max(1, budget // (2 * per_sample))
    chunks = [range(i, min(i + m, k)) for i in range(0, k, m)]
    out = p.source.new_zeros(g, cg, k, cg, k)
    for n0 in range(0, n, step):
        samples = range(n0, min(n, n0 + step))
        for a, rows in enumerate(chunks):
            za = _slab(p, [offsets[i] for i in rows], g, samples)
            for cols in chunks[a:]:
                zb = za if cols is rows else _slab(p, [offsets[i] for i in cols], g, samples)
                block = torch.bmm(za, zb.transpose(1, 2)).view(g, cg, len(rows), cg, len(cols))
                out[:, :, rows.start : rows.stop, :, cols.start : cols.stop] += block
                if cols is not rows:
                    out[:, :, cols.start : cols.stop, :, rows.start : rows.stop] += block.permute(
                        0, 3, 4, 1, 2
                    )
                del zb, block
    return out.view(g, cg * k, cg * k).div_(n)


def _slab(p: Patches, offsets: list[tuple[int, ...]], groups: int, samples: range) -> Tensor:
    """The patch entries of some offsets for some samples, ``[G, Cg·m, n·T]`` (one copy)."""
    c = p.source.shape[1]
    cg = c // groups
    t = math.prod(p.output_size)
    size = p.output_size
    z = p.source.new_empty(groups, cg, len(offsets), len(samples), *size)
    for j, offset in enumerate(offsets):
        entries = p.view(offset)[samples.start : samples.stop].unflatten(1, (groups, cg))
        z[:, :, j].copy_(entries.movedim(0, 2))  # one copy of a view [n, G, Cg, *T]
    return z.view(groups, cg * len(offsets), len(samples) * t)


def _reduce_factor(p: Patches) -> Tensor:
    """KFAC-reduce's Ω = (1/N) Σₙ x̄ₙ x̄ₙᵀ per group, ``[G, Cg·K, Cg·K]``."""
    n, c = p.source.shape[:2]
    g = p.groups
    spatial = tuple(range(2, 2 + len(p.kernel_size)))
    t = math.prod(p.output_size)
    means = torch.stack([p.view(o).sum(spatial) for o in p.offsets], dim=2).div_(t)  # [N, C, K]
    means = means.reshape(n, g, -1).transpose(0, 1)  # [G, N, Cg·K]
    return torch.bmm(means.transpose(1, 2), means).div_(n)


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
