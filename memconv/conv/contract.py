"""Contractions of per-sample quantities in which one operand's axes are all the
other's: an elementwise product summed over some axes (``"nck,nck->nc"``), or a
matrix-vector product (``"ngot,ngt->ngo"``, ``"n,n...->..."``).

Eagerly :func:`contract` is ``torch.einsum``: one contraction, no product tensor. While
a compiled step is traced (:func:`memconv._torch.tracing`) it is the broadcast product
and its sum, which the compiler makes one reduction kernel, fused with what produces
its operands and without the product tensor; ``torch.einsum`` would enter the graph as
a batched matrix product (``bmm`` of ``[.., 1, k] × [.., k, 1]``) with the permutes and
views around it. On the benchmark models' traced DP steps those were a fifth to a third
of the nodes, each paid for in compilation time (the compiler split the smallest of
the products into kernels of its own, so the kernels called changed little).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .._torch import tracing

_SPARE = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@functools.lru_cache(maxsize=256)
def _order(equation: str, a_dim: int, b_dim: int) -> tuple[str, str, str, str]:
    """The operands' and the output's letters (``...`` spelled out: einsum's
    broadcasting, the ellipses aligned on their last axes), and the broadcast product's
    (the larger operand's, in its order)."""
    inputs, arrow, out = equation.replace(" ", "").partition("->")
    specs = inputs.split(",")
    repeated = any(len(set(x.replace(".", ""))) != len(x.replace(".", "")) for x in specs)
    if len(specs) != 2 or not arrow or repeated or any(c in _SPARE for c in equation):
        raise ValueError(
            "equation must have two operands and an output ('ab,ab->a'), lower-case "
            f"letters each once per operand, and '...', got {equation!r}"
        )
    spans = [d - (len(x) - 3) if "..." in x else 0 for x, d in zip(specs, (a_dim, b_dim))]
    ell = max(spans)
    sa, sb = (x.replace("...", _SPARE[ell - k : ell]) for x, k in zip(specs, spans))
    if not (set(sa) <= set(sb) or set(sb) <= set(sa)):
        raise ValueError(
            f"equation {equation!r} is a matrix product (each operand has an axis the other "
            "lacks): call torch.einsum"
        )
    out = out.replace("...", _SPARE[:ell])
    return sa, sb, out, sa if len(sa) >= len(sb) else sb


def contract(equation: str, a: Tensor, b: Tensor) -> Tensor:
    """``torch.einsum(equation, a, b)``, where the letters of one operand are all among
    the other's (see the module docstring for how it is computed).

    Args:
        equation: einsum's equation, two operands and an explicit output
            (``"nc...,nc...->nc"``).
        a, b: the operands.

    Returns:
        The contraction, as ``torch.einsum`` gives it (shape and axis order).

    Raises:
        ValueError: an equation of another form, or one whose operands each hold a
            letter the other lacks (a matrix product: ``torch.einsum`` it).
    """
    sa, sb, out, order = _order(equation, a.dim(), b.dim())
    if not tracing():
        return torch.einsum(equation, a, b)
    product = _aligned(a, sa, order) * _aligned(b, sb, order)
    summed = tuple(i for i, c in enumerate(order) if c not in out)
    if summed:
        product = product.sum(summed)
    kept = [c for c in order if c in out]
    return product if kept == list(out) else product.permute([kept.index(c) for c in out])


def _aligned(t: Tensor, spec: str, order: str) -> Tensor:
    """``t`` (axes ``spec``) with its axes in ``order``'s order and a size-1 axis for
    each letter of ``order`` it lacks."""
    present = [c for c in order if c in spec]
    axes = [spec.index(c) for c in present]
    if axes != sorted(axes):
        t = t.permute(axes)
    shape = [t.shape[present.index(c)] if c in spec else 1 for c in order]
    return t if list(t.shape) == shape else t.reshape(shape)
