"""Coupling blocks: invertible by construction, whatever their inner modules.

The input ``x`` is split into two halves along ``split_dim``; each half is changed by
a function of the other, so the inverse only runs the same functions again:

- :class:`AdditiveCoupling`, the residual block of the reversible residual network
  (Gomez et al., "The Reversible Residual Network", NeurIPS 2017, section 3, eq. 1–2);
- :class:`AffineCoupling`, the affine coupling of RealNVP (Dinh et al., ICLR 2017,
  section 3.2) and Glow (Kingma and Dhariwal, NeurIPS 2018, section 3.3), the scale
  and shift given by ``Fm``/``Gm`` through an adapter
  (:class:`AffineAdapterNaive`, :class:`AffineAdapterSigmoid`).

Names, arguments (in MemCNN's order) and conventions are MemCNN's
(``memcnn.AdditiveCoupling`` &c., version 1.5.2): a missing ``Gm`` is a deep copy of
``Fm`` (its own parameters), the adapter wraps ``Fm`` and ``Gm``, and MemCNN's
deprecated ``implementation_fwd``/``implementation_bwd`` (0: the coupling's graph
recomputed from its kept input; 1: its input reconstructed from its output) run as a
:class:`memconv.reversible.InvertibleModuleWrapper` of the coupling keeping
(0) or not keeping (1) its input. Wrap a coupling in
:class:`memconv.reversible.InvertibleModuleWrapper` to release its input's memory.
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
from torch import Tensor, nn

from .._checks import (
    check_callable,
    check_implementation,
    check_module,
    check_optional_module,
    check_split,
    check_split_dim,
)
from .recompute import differentiate as _autograd
from .recompute import mark_part
from .wrapper import InvertibleModuleWrapper

#: The attribute under which a coupling keeps the wrapper of its passes (made at its
#: first call; not a submodule, so not in its ``state_dict``).
PASSES_ATTRIBUTE = "_memcnn_passes"


def _halves(x: Tensor, split_dim: int, where: str) -> tuple[Tensor, Tensor]:
    check_split(x, split_dim, where)
    a, b = torch.chunk(x, 2, dim=split_dim)
    return a, b


def _pair(Fm: nn.Module, Gm: nn.Module | None) -> tuple[nn.Module, nn.Module]:
    check_module(Fm, "Fm")
    check_optional_module(Gm, "Gm")
    return Fm, (copy.deepcopy(Fm) if Gm is None else Gm)


class _Coupling(nn.Module):
    """Two half-steps, ``y₁ = x₁ ⊕ Fm(x₂)`` then ``y₂ = x₂ ⊕ Gm(y₁)``, for a combination
    ``⊕`` (:meth:`combine`) whose inverse (:meth:`uncombine`) needs only ``Fm``'s or
    ``Gm``'s output; :meth:`inverse_vjp` reconstructs the input and differentiates the
    block in one pass (Gomez et al. 2017, algorithm 1)."""

    def __init__(
        self,
        Fm: nn.Module,
        Gm: nn.Module | None,
        implementation_fwd: int,
        implementation_bwd: int,
        split_dim: int,
    ):
        super().__init__()
        check_implementation(implementation_fwd, "implementation_fwd")
        check_implementation(implementation_bwd, "implementation_bwd")
        check_split_dim(split_dim)
        self.Fm, self.Gm = _pair(Fm, Gm)
        self.implementation_fwd = implementation_fwd
        self.implementation_bwd = implementation_bwd
        self.split_dim = split_dim
        if implementation_fwd != -1 or implementation_bwd != -1:
            warnings.warn(
                f"{type(self).__name__}: implementation_fwd={implementation_fwd}, "
                f"implementation_bwd={implementation_bwd} are deprecated (as in MemCNN); keep "
                "-1 and wrap the coupling in memconv.reversible.InvertibleModuleWrapper "
                "(keep_input=True for 0)",
                DeprecationWarning,
                stacklevel=3,
            )

    def _passes(self, forward: bool) -> InvertibleModuleWrapper | None:
        """The wrapper running a direction's MemCNN implementation 0 or 1, or None for
        -1 (the coupling's own graph). Not a submodule (it holds the coupling). It
        serves as many backward passes as its graph is retained for, as MemCNN's
        implementations (autograd Functions saving their tensors) do."""
        implementation = self.implementation_fwd if forward else self.implementation_bwd
        if implementation == -1:
            return None
        wrapper = self.__dict__.get(PASSES_ATTRIBUTE)
        if wrapper is None:
            wrapper = InvertibleModuleWrapper(
                _Passes(self),
                keep_input=self.implementation_fwd == 0,
                keep_input_inverse=self.implementation_bwd == 0,
                num_bwd_passes=sys.maxsize,
            )
            wrapper._where = f"{type(self).__name__}(implementations)"
            self.__dict__[PASSES_ATTRIBUTE] = wrapper
        return wrapper

    def combine(self, a: Tensor, c) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def uncombine(self, b: Tensor, c) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """``x [*, 2C, *]`` → ``y`` of its shape."""
        passes = self._passes(forward=True)
        return self._forward(x) if passes is None else passes(x)

    def inverse(self, y: Tensor) -> Tensor:
        """``y`` → the ``x`` with ``forward(x) == y`` (up to round-off)."""
        passes = self._passes(forward=False)
        return self._inverse(y) if passes is None else passes.inverse(y)

    def _forward(self, x: Tensor, block: nn.Module | None = None) -> Tensor:
        """The forward pass by autograd; ``block``: its :class:`_Passes` when run by
        them (the innermost open block is the coupling's wrapper, or a wrapper of
        those passes: the observer takes the mark of the one it knows)."""
        x1, x2 = _halves(x, self.split_dim, type(self).__name__)
        y1 = self.combine(x1, self.Fm(x2))
        mark_part(self)
        if block is not None:
            mark_part(block)
        y2 = self.combine(x2, self.Gm(y1))
        return torch.cat([y1, y2], dim=self.split_dim)

    def _inverse(self, y: Tensor) -> Tensor:
        """The inverse by autograd."""
        y1, y2 = _halves(y, self.split_dim, f"{type(self).__name__}.inverse")
        x2 = self.uncombine(y2, self.Gm(y1))
        x1 = self.uncombine(y1, self.Fm(x2))
        return torch.cat([x1, x2], dim=self.split_dim)

    def inverse_vjp(self, y: Tensor, grad_y: Tensor, params: tuple, differentiate=None) -> tuple:
        """The input reconstructed from the output ``y``, with the gradients of the
        input and of ``params`` for the output gradient ``grad_y``, in one pass: each
        half-step's module runs once, with its graph, both to reconstruct its half and
        to be differentiated (Gomez et al. 2017, algorithm 1), where an inverse then a
        recomputation run it twice.

        Args:
            y: the output.
            grad_y: its gradient.
            params: the parameters whose gradients are wanted.
            differentiate: ``differentiate(run, inputs, grad_outputs, params, part)``
                for each half-step (``part`` 1, then 0), as
                :func:`memconv.reversible.recompute.differentiate` (the default) does it.

        Returns:
            ``(x, grad_x, grads of params)`` (None for a parameter not reached).
        """
        differentiate = differentiate or _autograd
        y1, y2 = _halves(y, self.split_dim, f"{type(self).__name__}.inverse")
        g1, g2 = _halves(grad_y, self.split_dim, f"{type(self).__name__}.inverse")
        # y₂ = x₂ ⊕ Gm(y₁): x₂, then the gradients of y₁, x₂ and Gm's parameters
        x2, (d_y1, d_x2), grads = self._half(y2, y1, g2, self.Gm, params, differentiate, 1)
        # y₁ = x₁ ⊕ Fm(x₂), its output gradient y₁'s own plus what y₂ sent through Gm
        x1, (d_x2_f, d_x1), more = self._half(y1, x2, g1 + d_y1, self.Fm, params, differentiate, 0)
        grads = [a if b is None else (b if a is None else a + b) for a, b in zip(grads, more)]
        x = torch.cat([x1, x2], dim=self.split_dim)
        return x, torch.cat([d_x1, d_x2 + d_x2_f], dim=self.split_dim), tuple(grads)

    def _half(self, b: Tensor, other: Tensor, grad_b: Tensor, module, params, differentiate, part):
        """For ``b = a ⊕ module(other)``: ``a``, the gradients ``(of other, of a)`` and
        of ``params`` for ``grad_b``."""
        made = []

        def run(inputs):
            c = module(inputs[0])
            a = self.uncombine(b, _detached(c)).requires_grad_()
            made.append(a)
            return (self.combine(a, c),), (a,)

        leaf = other.detach().requires_grad_()
        (d_other, d_a), found = differentiate(run, (leaf,), (grad_b,), params, part)
        a = made[-1].detach()
        d_other = torch.zeros_like(other) if d_other is None else d_other
        d_a = torch.zeros_like(b) if d_a is None else d_a
        return a, (d_other, d_a), found


class _Passes(nn.Module):
    """A coupling's passes by autograd, as the module wrapped by its MemCNN
    implementations 0 and 1 (:meth:`_Coupling._passes`)."""

    def __init__(self, coupling: _Coupling):
        super().__init__()
        self.coupling = coupling

    def forward(self, x: Tensor) -> Tensor:
        return self.coupling._forward(x, self)

    def inverse(self, y: Tensor) -> Tensor:
        return self.coupling._inverse(y)

    def inverse_vjp(self, y: Tensor, grad_y: Tensor, params: tuple, differentiate=None) -> tuple:
        return self.coupling.inverse_vjp(y, grad_y, params, differentiate)


def _detached(c):
    return tuple(t.detach() for t in c) if isinstance(c, tuple) else c.detach()


class AdditiveCoupling(_Coupling):
    """``y = (y₁, y₂)`` with ``y₁ = x₁ + Fm(x₂)`` and ``y₂ = x₂ + Gm(y₁)`` (RevNet's
    reversible block, Gomez et al. 2017, eq. 1); its inverse is
    ``x₂ = y₂ − Gm(y₁)``, ``x₁ = y₁ − Fm(x₂)`` (eq. 2).

    Args:
        Fm: any module mapping a half to a tensor of the half's shape (RevNet:
            BN-ReLU-Conv-BN-ReLU-Conv; GroupNorm for DP-SGD).
        Gm: the same for the second half; None: a deep copy of ``Fm`` (its own
            parameters, MemCNN's convention).
        implementation_fwd: MemCNN's implementation of the forward pass: -1 (the
            default) autograd through the coupling; 0 the coupling's graph recomputed
            from its kept input in the backward pass; 1 its input reconstructed from
            its output (0 and 1 are deprecated in MemCNN and here: wrap the coupling in
            :class:`memconv.reversible.InvertibleModuleWrapper` instead).
        implementation_bwd: the same for :meth:`inverse`.
        split_dim: the axis split into two halves (1: channels).

    Raises:
        TypeError: ``Fm`` or ``Gm`` not a module, ``split_dim`` or an implementation
            not an int.
        NotImplementedError: an implementation other than -1, 0 or 1 (as MemCNN).
        ValueError: (forward, inverse) an input whose ``split_dim`` does not exist or
            has an odd size.
    """

    def __init__(
        self,
        Fm: nn.Module,
        Gm: nn.Module | None = None,
        implementation_fwd: int = -1,
        implementation_bwd: int = -1,
        split_dim: int = 1,
    ):
        super().__init__(Fm, Gm, implementation_fwd, implementation_bwd, split_dim)

    def combine(self, a: Tensor, c: Tensor) -> Tensor:
        return a + c

    def uncombine(self, b: Tensor, c: Tensor) -> Tensor:
        return b - c


class AffineCoupling(_Coupling):
    """``y₁ = s₁ ⊙ x₁ + t₁`` with ``(s₁, t₁) = Fm(x₂)``, then ``y₂ = s₂ ⊙ x₂ + t₂`` with
    ``(s₂, t₂) = Gm(y₁)`` (the affine coupling of RealNVP and Glow, as MemCNN writes
    it: both halves changed); its inverse divides by the scales.

    Args:
        Fm: a module returning ``(scale, shift)``, each of the half's shape, or, with
            ``adapter``, one tensor the adapter turns into them.
        Gm: the same for the second half; None: a deep copy of ``Fm``.
        adapter: a class (or any callable) wrapping ``Fm`` and ``Gm``:
            ``adapter(Fm)(x) -> (scale, shift)``, e.g. :class:`AffineAdapterNaive`
            (``exp(h), h``) or :class:`AffineAdapterSigmoid`; None: ``Fm`` and ``Gm``
            return the pair themselves. The scale must not vanish.
        implementation_fwd: MemCNN's implementation of the forward pass (-1, 0 or 1,
            as :class:`AdditiveCoupling`'s).
        implementation_bwd: the same for :meth:`inverse`.
        split_dim: the axis split into two halves (1: channels).

    Raises:
        TypeError: ``Fm``/``Gm`` not modules, ``adapter`` not callable, ``split_dim``
            or an implementation not an int.
        NotImplementedError: an implementation other than -1, 0 or 1 (as MemCNN).
        ValueError: (forward, inverse) an input whose ``split_dim`` does not exist or
            has an odd size.
    """

    def __init__(
        self,
        Fm: nn.Module,
        Gm: nn.Module | None = None,
        adapter=None,
        implementation_fwd: int = -1,
        implementation_bwd: int = -1,
        split_dim: int = 1,
    ):
        super().__init__(Fm, Gm, implementation_fwd, implementation_bwd, split_dim)
        if adapter is not None:
            check_callable(adapter, "adapter")
            self.Fm, self.Gm = adapter(self.Fm), adapter(self.Gm)

    def combine(self, a: Tensor, c: tuple) -> Tensor:
        scale, shift = c
        return a * scale + shift

    def uncombine(self, b: Tensor, c: tuple) -> Tensor:
        scale, shift = c
        return (b - shift) / scale


class _Adapter(nn.Module):
    """``module``'s output turned into ``(scale, shift)`` by :meth:`split`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        check_module(module, "module")
        self.f = module

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.split(self.f(x))

    def split(self, h: Tensor) -> tuple[Tensor, Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError


class AffineAdapterNaive(_Adapter):
    """``h = module(x)`` → ``(exp(h), h)``: scale and shift from one output (MemCNN's
    ``AffineAdapterNaive``).

    Args:
        module: maps a half to a tensor of its shape.
    """

    def split(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return torch.exp(h), h


class AffineAdapterSigmoid(_Adapter):
    """``h = module(x)`` with twice the half's channels → ``(sigmoid(h[:, 1::2] + 2),
    h[:, 0::2])`` (MemCNN's ``AffineAdapterSigmoid``; Glow's scale, Kingma and
    Dhariwal 2018, whose code adds 2 so that the scale starts near 1).

    Args:
        module: maps a half ``[N, C, ...]`` to ``[N, 2C, ...]``.

    Raises:
        ValueError: (forward) an output with an odd number of channels.
    """

    def split(self, h: Tensor) -> tuple[Tensor, Tensor]:
        check_split(h, 1, "AffineAdapterSigmoid (the output of its module)")
        return torch.sigmoid(h[:, 1::2] + 2.0), h[:, 0::2]
