"""What a reversible block's backward pass needs to run its block again as the forward
pass ran it, and the one hook point through which memconv's engine sees it.

- :class:`ForwardState`: the random number generators' state (with
  ``preserve_rng_state``), the open :class:`memconv.save_memory` and
  :class:`memconv.per_sample` blocks and the autocast state of the forward pass,
  restored around the inverse and the recomputation (``torch.utils.checkpoint``
  restores the same; the backward pass may run on another thread, where context
  variables are not those of the forward pass);
- :func:`frozen_buffers`: the block's buffers (BatchNorm's running statistics) as the
  forward pass left them, so that the inverse and the recomputation do not update
  them a second and a third time (copies stand in for them meanwhile, so that the
  graph of the recomputation keeps what it saved);
- :func:`observing`: an observer (memconv's walk, :mod:`memconv.engine.walk`) that
  the blocks called inside report to. A block's forward pass calls
  ``observer.enter(block, fn)`` before its autograd Function and
  ``observer.leave(token, outputs)`` after it, and keeps the token; a block made of
  parts (a coupling's two half-steps) calls :func:`mark_part` where its second part
  starts. Its backward pass, if ``token.active``, hands each part's recomputation to
  ``token.recompute(run, inputs, grad_outputs, part)``: ``run(inputs)`` returns the
  part's outputs and the leaves it made whose gradients are wanted too, and the
  observer runs it however it likes and returns the gradients of ``inputs`` and of
  those leaves (:func:`differentiate` is what a block does with no observer).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..conv.settings import (
    Autocast,
    Settings,
    activate,
    block_settings,
    per_sample_enabled,
    record,
)

_OBSERVER: contextvars.ContextVar = contextvars.ContextVar(
    "memconv_reversible_observer", default=None
)


@contextlib.contextmanager
def observing(observer):
    """A block in which reversible blocks report to ``observer`` (None: to nobody)."""
    token = _OBSERVER.set(observer)
    try:
        yield observer
    finally:
        _OBSERVER.reset(token)


def current_observer():
    """The observer of :func:`observing`, or None."""
    return _OBSERVER.get()


def mark_part(fn) -> None:
    """Tell the observer, if any, that ``fn``'s next part starts here (the forward pass
    of a block made of parts, between them)."""
    observer = _OBSERVER.get()
    if observer is not None:
        observer.mark(fn)


def differentiate(run, inputs: tuple, grad_outputs: tuple, params: tuple, part: int = 0):
    """A part of a block differentiated by autograd: ``run(inputs)`` (leaves made of
    ``inputs``) returns ``(outputs, made)``; returns the gradients of ``inputs`` and
    ``made``, and of ``params`` (None where not reached or not required).

    Args:
        part: which part of the block (an observer's business; unused here).
    """
    with torch.enable_grad():
        outputs, made = run(inputs)
    found = vjp(outputs, grad_outputs, (*inputs, *made, *params))
    n = len(inputs) + len(made)
    return found[:n], found[n:]


@dataclass(frozen=True)
class ForwardState:
    """What a block's forward pass ran under, to run its inverse and its recomputation
    alike.

    Attributes:
        rng: ``(CPU generator state, ((CUDA device, its state), ...))`` with
            ``preserve_rng_state``, else None.
        settings: the open :class:`memconv.save_memory` block's settings, or None.
        per_sample: whether a :class:`memconv.per_sample` block was on.
        autocast: the autocast state for the inputs' device.
    """

    rng: tuple | None
    settings: Settings | None
    per_sample: bool
    autocast: Autocast

    @classmethod
    def capture(cls, inputs: tuple, preserve_rng_state: bool, memconv_layers: bool) -> ForwardState:
        """The state now, for a block called on ``inputs``; with ``memconv_layers`` (the
        block holds memconv convolutions, which run their graph only in the
        recomputation) the open blocks are marked used, so that they do not warn that
        no memconv layer ran in them."""
        if memconv_layers:
            record()
        rng = None
        if preserve_rng_state:
            devices = sorted({t.device.index or 0 for t in inputs if t.is_cuda})
            cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
            rng = (torch.get_rng_state(), cuda)
        return cls(rng, block_settings(), per_sample_enabled(), Autocast.of(inputs))

    @contextlib.contextmanager
    def restored(self, module: nn.Module):
        """The forward pass's state, and ``module``'s buffers kept as they are
        (:func:`frozen_buffers`); the random generators are given back afterwards."""
        with contextlib.ExitStack() as stack:
            if self.rng is not None:
                cpu, cuda = self.rng
                stack.enter_context(torch.random.fork_rng(devices=[d for d, _ in cuda]))
                torch.set_rng_state(cpu)
                for d, s in cuda:
                    torch.cuda.set_rng_state(s, d)
            stack.enter_context(activate(self.settings, self.per_sample))
            stack.enter_context(self.autocast.context())
            stack.enter_context(frozen_buffers(module))
            yield


@contextlib.contextmanager
def frozen_buffers(module: nn.Module):
    """``module``'s buffers left as they are: inside the block, each of its submodules
    holds copies of its buffers in their place, and the originals are put back at
    the end (BatchNorm's running statistics and its count of batches: a block run three
    times per step — forward, inverse, recomputation — updates them once).

    The originals are swapped back, not copied into: a graph built inside the block
    keeps the copies it saved (BatchNorm saves its running statistics, in eval mode to
    normalise with them, in training mode after updating them in place), so that
    neither the updates inside the block nor the restoring changes a tensor autograd
    saved. A tensor held by several submodules is copied once (it stays shared).
    """
    copies: dict[int, Tensor] = {}
    swapped = []
    for m in module.modules():
        for name, b in m.named_buffers(recurse=False):
            if id(b) not in copies:
                copies[id(b)] = b.detach().clone()
            swapped.append((m, name, b))
            setattr(m, name, copies[id(b)])
    try:
        yield
    finally:
        for m, name, b in swapped:
            setattr(m, name, b)


def vjp(ys: tuple, grad_outputs: tuple, wanted: tuple) -> tuple:
    """The gradients of ``wanted`` (None for an entry that is None or does not require
    gradients, or that ``ys`` does not reach) for the gradients ``grad_outputs`` of
    ``ys``, by autograd."""
    pairs = [(y, g) for y, g in zip(ys, grad_outputs) if y.requires_grad and g is not None]
    asked = [t for t in wanted if t is not None and t.requires_grad]
    found = iter(())
    if pairs and asked:
        outputs, grads = [y for y, _ in pairs], [g for _, g in pairs]
        found = iter(torch.autograd.grad(outputs, asked, grads, allow_unused=True))
    return tuple(next(found) if t is not None and t.requires_grad else None for t in wanted)
