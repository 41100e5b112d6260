"""MemCNN's deprecated names (version 1.5.2), kept so that MemCNN code runs unchanged:
:func:`create_coupling`, :class:`ReversibleBlock`, :class:`AdditiveBlock` and
:class:`AffineBlock`, with MemCNN's arguments, defaults and ``DeprecationWarning``.
New code wraps a coupling in :class:`memconv.reversible.InvertibleModuleWrapper`.
"""

from __future__ import annotations

import warnings

from torch import nn

from .couplings import AdditiveCoupling, AffineCoupling
from .wrapper import InvertibleModuleWrapper


def create_coupling(
    Fm: nn.Module,
    Gm: nn.Module | None = None,
    coupling: str = "additive",
    implementation_fwd: int = -1,
    implementation_bwd: int = -1,
    adapter=None,
) -> AdditiveCoupling | AffineCoupling:
    """A coupling by name (MemCNN's ``create_coupling``).

    Args:
        Fm: the first half-step's module.
        Gm: the second's; None: a deep copy of ``Fm``.
        coupling: ``"additive"`` (:class:`memconv.reversible.AdditiveCoupling`) or
            ``"affine"`` (:class:`memconv.reversible.AffineCoupling`).
        implementation_fwd: -1, 0 or 1 (see :class:`memconv.reversible.AdditiveCoupling`).
        implementation_bwd: the same for the inverse.
        adapter: the affine coupling's adapter (ignored by the additive one, as in
            MemCNN).

    Returns:
        The coupling, split along the channels (``split_dim=1``, as MemCNN's).

    Raises:
        NotImplementedError: another ``coupling`` (MemCNN's exception), or an
            implementation other than -1, 0 or 1.
    """
    if coupling == "additive":
        return AdditiveCoupling(Fm, Gm, implementation_fwd, implementation_bwd)
    if coupling == "affine":
        return AffineCoupling(Fm, Gm, adapter, implementation_fwd, implementation_bwd)
    raise NotImplementedError(
        f"create_coupling: unknown coupling method {coupling!r}; 'additive' or 'affine' are "
        "accepted"
    )


class ReversibleBlock(InvertibleModuleWrapper):
    """A coupling made by :func:`create_coupling` in an
    :class:`memconv.reversible.InvertibleModuleWrapper` (MemCNN's deprecated
    ``ReversibleBlock``: same arguments, same order, its ``DeprecationWarning``).

    Args:
        Fm: the first half-step's module.
        Gm: the second's; None: a deep copy of ``Fm``.
        coupling: ``"additive"`` or ``"affine"``.
        keep_input: keep the input in the forward direction.
        keep_input_inverse: the same for the inverse.
        implementation_fwd: the coupling's (-1, 0 or 1).
        implementation_bwd: the same for the inverse.
        adapter: the affine coupling's adapter.

    Raises:
        NotImplementedError: an unknown ``coupling`` or implementation.
    """

    def __init__(
        self,
        Fm: nn.Module,
        Gm: nn.Module | None = None,
        coupling: str = "additive",
        keep_input: bool = False,
        keep_input_inverse: bool = False,
        implementation_fwd: int = -1,
        implementation_bwd: int = -1,
        adapter=None,
    ):
        warnings.warn(
            "ReversibleBlock is deprecated (as in MemCNN): wrap a coupling in "
            "memconv.reversible.InvertibleModuleWrapper",
            DeprecationWarning,
            stacklevel=2,
        )
        fn = create_coupling(Fm, Gm, coupling, implementation_fwd, implementation_bwd, adapter)
        super().__init__(fn, keep_input=keep_input, keep_input_inverse=keep_input_inverse)


class _Block:
    """MemCNN's deprecated ``AdditiveBlock``/``AffineBlock``: its coupling (the class
    after this one), implementations defaulting to 1."""

    replacement = ""

    def __init__(
        self,
        Fm: nn.Module,
        Gm: nn.Module | None = None,
        implementation_fwd: int = 1,
        implementation_bwd: int = 1,
    ):
        warnings.warn(
            f"{type(self).__name__} is deprecated (as in MemCNN): use {self.replacement}",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(
            Fm, Gm, implementation_fwd=implementation_fwd, implementation_bwd=implementation_bwd
        )


class AdditiveBlock(_Block, AdditiveCoupling):
    """MemCNN's deprecated ``AdditiveBlock``: an
    :class:`memconv.reversible.AdditiveCoupling` whose implementations default to 1.

    Args:
        Fm: the first half-step's module.
        Gm: the second's; None: a deep copy of ``Fm``.
        implementation_fwd: -1, 0 or 1.
        implementation_bwd: the same for the inverse.
    """

    replacement = "AdditiveCoupling"


class AffineBlock(_Block, AffineCoupling):
    """MemCNN's deprecated ``AffineBlock``: an
    :class:`memconv.reversible.AffineCoupling` (no adapter) whose implementations
    default to 1.

    Args:
        Fm: the first half-step's module, returning ``(scale, shift)``.
        Gm: the second's; None: a deep copy of ``Fm``.
        implementation_fwd: -1, 0 or 1.
        implementation_bwd: the same for the inverse.
    """

    replacement = "AffineCoupling"
