"""Reversible blocks: activation memory constant in depth, by reconstruction.

A reversible block's input can be computed from its output, so it need not be kept
for the backward pass (Gomez et al., "The Reversible Residual Network", NeurIPS 2017).
:class:`InvertibleModuleWrapper` releases the input's memory once the output exists
and reconstructs it in the backward pass; :class:`AdditiveCoupling` and
:class:`AffineCoupling` are blocks invertible by construction. The names and
arguments are MemCNN's (version 1.5.2), its deprecated names included
(:func:`create_coupling`, :class:`ReversibleBlock`, :class:`AdditiveBlock`,
:class:`AffineBlock`): moving from MemCNN is a change of import.

Unlike MemCNN's, the wrapper works with ``torch.autograd.grad``,
``DistributedDataParallel`` and memconv's per-sample functions
(:func:`memconv.per_sample_grads`, :func:`memconv.per_sample_norms`,
:func:`memconv.clip_and_accumulate`, :class:`memconv.PrivateStep`): DP-SGD through a
deep reversible network at constant activation memory. :func:`check_reconstruction`
reports how far each block's reconstruction is from its real input.
"""

from .checks import BlockError, ReconstructionReport, check_reconstruction
from .couplings import AdditiveCoupling, AffineAdapterNaive, AffineAdapterSigmoid, AffineCoupling
from .deprecated import AdditiveBlock, AffineBlock, ReversibleBlock, create_coupling
from .wrapper import InvertibleModuleWrapper, is_invertible_module

__all__ = [
    "AdditiveBlock",
    "AdditiveCoupling",
    "AffineAdapterNaive",
    "AffineAdapterSigmoid",
    "AffineBlock",
    "AffineCoupling",
    "BlockError",
    "InvertibleModuleWrapper",
    "ReconstructionReport",
    "ReversibleBlock",
    "check_reconstruction",
    "create_coupling",
    "is_invertible_module",
]
