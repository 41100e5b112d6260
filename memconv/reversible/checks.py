"""Numerical honesty: a reversible block's reconstructed input compared with the real one.

A block's inverse gives its input back up to round-off only, and in a chain each block
reconstructs its input from an output that the next block reconstructed in turn, so
the error of the first blocks grows with depth, much faster in float32 than in float64
(Gomez et al., "The Reversible Residual Network", NeurIPS 2017, section 5;
Behrmann et al., "Understanding and Mitigating Exploding Inverses in Invertible Neural
Networks", AISTATS 2021). :func:`check_reconstruction` measures it on a real training
step: while it is open, every reversible block called keeps its real input (so no
memory is saved in that step) and its backward pass, which still uses the
reconstruction as in training, reports the largest error per block.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._checks import check_optional_module

_REPORT: contextvars.ContextVar = contextvars.ContextVar("memconv_reversible_report", default=None)


class BlockError(NamedTuple):
    """The largest reconstruction error of one block over the backward passes seen.

    Attributes:
        absolute: ``max |x̂ − x|`` over the block's inputs (in the inputs' units).
        relative: ``max |x̂ − x| / max |x|``, per input, the largest over the inputs.
    """

    absolute: float
    relative: float


def errors(reconstructed, originals) -> BlockError:
    """The :class:`BlockError` of tensors ``reconstructed`` against ``originals``."""
    absolute = relative = 0.0
    for r, x in zip(reconstructed, originals):
        if not x.numel():
            continue
        with torch.no_grad():
            diff = (r.double() - x.double()).abs().max().item()
            scale = x.double().abs().max().item()
        absolute = max(absolute, diff)
        relative = max(relative, diff / scale if scale else diff)
    return BlockError(absolute, relative)


class ReconstructionReport:
    """The largest reconstruction error of each reversible block, filled by the backward
    passes of the steps run inside :func:`check_reconstruction`.

    Attributes:
        errors: ``{block name: BlockError}``, in the order the backward passes reached
            the blocks (the last block first).
    """

    def __init__(self, names: dict):
        self._names = names
        self.errors: dict[str, BlockError] = {}

    def name(self, block: nn.Module, fallback: str) -> str:
        """The block's name in the model given to :func:`check_reconstruction`, else
        ``fallback``."""
        return self._names.get(block, fallback)

    def add(self, name: str, error: BlockError) -> None:
        """Record one backward pass's error of the block ``name`` (the largest stays)."""
        old = self.errors.get(name)
        if old is not None:
            error = BlockError(max(old.absolute, error.absolute), max(old.relative, error.relative))
        self.errors[name] = error

    def worst(self) -> float:
        """The largest relative error over all blocks (0.0 when none ran)."""
        return max((e.relative for e in self.errors.values()), default=0.0)

    def __str__(self) -> str:
        width = max((len(n) for n in self.errors), default=5)
        lines = [f"{'block':{width}s}  {'absolute':>9s}  {'relative':>9s}"]
        for name, e in self.errors.items():
            lines.append(f"{name:{width}s}  {e.absolute:9.1e}  {e.relative:9.1e}")
        return "\n".join(lines)


@contextlib.contextmanager
def check_reconstruction(model: nn.Module | None = None):
    """Report how far each reversible block's reconstructed input is from its real one.

    The blocks called (forward pass) inside the ``with`` block keep their real inputs,
    so the step saves no activation memory; their backward passes — wherever they run
    — reconstruct the input as in training, use the reconstruction as in training, and
    record ``max |x̂ − x|``. Nothing else changes: the gradients are those of a step
    outside the block.

    Args:
        model: the model, to name the blocks by their path in it (None: each block is
            named by its path in the outermost module whose forward pass called it).

    Yields:
        The :class:`ReconstructionReport`, filled as the backward passes run.

    Raises:
        TypeError: ``model`` is not a module.

    Example:
        >>> with memconv.reversible.check_reconstruction(model) as report:
        ...     loss_fn(model(x), y).backward()
        >>> print(report)          # block, absolute and relative error
    """
    check_optional_module(model, "model")
    names = {m: n for n, m in model.named_modules()} if model is not None else {}
    report = ReconstructionReport(names)
    token = _REPORT.set(report)
    try:
        yield report
    finally:
        _REPORT.reset(token)


def current_report() -> ReconstructionReport | None:
    """The report of the open :func:`check_reconstruction` block, or None."""
    return _REPORT.get()


def relative_tolerance(dtype: torch.dtype, wrong: bool = False) -> float:
    """The relative error a block's own inverse may show in ``dtype``: ``√ε`` (3.5e-4
    in float32, 1.5e-8 in float64), many times one block's round-off; with ``wrong``,
    the error beyond which it is taken for a wrong inverse, ``ε^¼`` (1.9e-2 in float32,
    1.2e-4 in float64), far below the error of an inverse that is not one (of the order
    of the input). Between the two, the inverse is one but amplifies round-off (an
    affine coupling whose scale comes near zero)."""
    if not dtype.is_floating_point:
        return 0.0
    return torch.finfo(dtype).eps ** (0.25 if wrong else 0.5)


def largest_relative(reconstructed: tuple, originals: tuple) -> tuple[float, torch.dtype]:
    """The relative error of :func:`errors` and the dtype it is judged in (the widest
    epsilon among the inputs)."""
    dtypes = [x.dtype for x in originals if isinstance(x, Tensor) and x.is_floating_point()]
    dtype = max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else torch.float64
    return errors(reconstructed, originals).relative, dtype
