"""BackPACK integration: first-order extensions on convolutions through memconv.

Under ``with memconv.save_memory(STRATEGY), backpack(EXT):`` the convolution weight
VJPs of BackPACK's ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared`` and
``Variance`` run through memconv's strategies, on ``torch.nn.Conv1d/2d/3d`` and on
``memconv.Conv1d/2d/3d``. memconv hooks in through BackPACK's public API only:
``BackpropExtension.set_module_extension(module_cls, extension, overwrite=True)``
on the active extension objects, with module extensions that subclass BackPACK's
``FirstOrderModuleExtension``.

When this happens:

- ``memconv.Conv*d``: at the start of their backward pass (always);
- ``torch.nn.Conv*d``: when the forward pass ran inside a ``save_memory`` block (a
  global forward hook, registered while a block is open, puts a hook on each
  layer's output that fires before BackPACK's hooks of that layer and of the
  layers below it), or when the extension was already active when the block was
  entered. For a forward pass outside the block, convert the model with
  :func:`memconv.convert` or call :func:`install` on the extension object;
- explicitly: :func:`install`.

When the last block closes, the global hook is removed and every extension object
memconv touched gets BackPACK's own module extensions back. A BackPACK extension
memconv does not cover (second-order ones) keeps BackPACK's behaviour; a warning
naming it is issued once.

This module does not import BackPACK; :mod:`.extensions` does, when first needed.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref

import torch

from ... import context
from ..._geometry import CONV_TYPES

#: BackPACK extensions whose convolution quantities memconv computes.
COVERED = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")

_lock = threading.RLock()
_depth = 0
_hook = None
_installed: weakref.WeakSet = weakref.WeakSet()
_warned: set[str] = set()


def _loaded() -> bool:
    return "backpack" in sys.modules


def _kind(ext) -> str | None:
    from backpack import extensions

    for name in COVERED:
        if isinstance(ext, getattr(extensions, name)):
            return name
    return None


def install(ext) -> None:
    """Route the convolution module extensions of a BackPACK extension through memconv.

    Args:
        ext: a BackPACK extension object (e.g. ``backpack.extensions.BatchGrad()``).
            For an extension memconv does not cover, nothing changes and a warning
            naming it is issued (once per extension class).

    The strategy is the one active when the backward pass runs
    (``"standard"``, BackPACK's own algorithm, outside any block).
    """
    kind = _kind(ext)
    if kind is None:
        name = type(ext).__name__
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"memconv does not cover the BackPACK extension {name}; its convolution "
                "quantities keep BackPACK's own computation",
                stacklevel=2,
            )
        return
    from .extensions import memconv_extension

    with _lock:
        if ext in _installed:
            return
        for cls in _conv_classes():
            ext.set_module_extension(cls, memconv_extension(kind), overwrite=True)
        _installed.add(ext)


def restore(ext) -> None:
    """Give a BackPACK extension object BackPACK's own convolution module extensions back.

    ``memconv.Conv*d`` get the extension of the torch class they subclass.
    """
    from .extensions import backpack_extension

    kind = _kind(ext)
    if kind is None:
        return
    with _lock:
        for cls in _conv_classes():
            ext.set_module_extension(cls, backpack_extension(kind, cls), overwrite=True)
        _installed.discard(ext)


def _conv_classes():
    from ...modules import Conv1d, Conv2d, Conv3d

    return (*CONV_TYPES, Conv1d, Conv2d, Conv3d)


def install_active() -> None:
    """:func:`install` on every BackPACK extension active right now."""
    if not _loaded():
        return
    from backpack.context import CTX

    for ext in CTX.get_active_exts():
        install(ext)


def _on_grad(_grad):
    install_active()


def _forward_hook(module, args, output):
    # Every layer's output: BackPACK runs a layer's hook at its *output* when no
    # input requires a gradient (a first layer), so the hook of a later layer's
    # output is what fires before it.
    if context.explicit_block() and isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(_on_grad)


class _Listener:
    """Follows memconv's blocks (see :func:`memconv.context.add_listener`)."""

    def block_entered(self, settings):
        global _depth, _hook
        with _lock:
            _depth += 1
            if _loaded() and _hook is None:
                _hook = torch.nn.modules.module.register_module_forward_hook(_forward_hook)
        install_active()

    def block_exited(self):
        global _depth, _hook
        with _lock:
            _depth -= 1
            if _depth > 0:
                return
            if _hook is not None:
                _hook.remove()
                _hook = None
            for ext in list(_installed):
                restore(ext)

    def conv_backward(self):
        install_active()

    def batch_consumers(self, module) -> int:
        """Covered extensions about to run on ``module`` (0 where they subsample)."""
        exts = _covered_active(module)
        return len(exts) if exts is not None else 0

    def share_batch(self, module, grad_output, batch, consumers):
        for name, t in batch.items():
            offer(module, name, grad_output, t, consumers)

    def shared_batch(self, module, name, grad_output):
        return take_shared(module, name, grad_output)


def _covered_active(module):
    """The covered BackPACK extensions active for ``module``, or None."""
    if not _loaded() or not hasattr(module, "input0"):
        return None
    from backpack.context import CTX

    exts = [e for e in CTX.get_active_exts() if _kind(e) is not None]
    if not exts or any(e.get_subsampling() is not None for e in exts):
        return None
    return exts


def offer(module, name: str, grad_output, batch, consumers: int) -> None:
    """Keep per-sample gradients on ``module`` for ``consumers`` later takers.

    Shared between an extended convolution's backward and the covered extensions
    of one backward pass (matched by the output gradient), so that the layer's
    weight VJP runs once; the last taker drops them.
    """
    if consumers <= 0:
        return
    shared = getattr(module, "_memconv_shared", None)
    key = (grad_output.data_ptr(), tuple(grad_output.shape))
    if shared is None or shared["key"] != key:
        shared = module._memconv_shared = {"key": key}
    shared[name] = [batch.detach(), consumers]


def take_shared(module, name: str, grad_output):
    """Per-sample gradients offered for this layer and output gradient, or None."""
    shared = getattr(module, "_memconv_shared", None)
    if shared is None or name not in shared:
        return None
    if shared["key"] != (grad_output.data_ptr(), tuple(grad_output.shape)):
        del module._memconv_shared
        return None
    entry = shared[name]
    entry[1] -= 1
    if entry[1] <= 0:
        del shared[name]
        if set(shared) == {"key"}:
            del module._memconv_shared
    return entry[0]


def consumers_after_extension(module, name: str) -> int:
    """Takers left after one covered extension computed a layer's per-sample grads:
    the other covered extensions, and memconv's own backward when it runs later
    (BackPACK runs a first layer's hook before the layer's backward)."""
    from ...modules import Conv1d, Conv2d, Conv3d

    exts = _covered_active(module) or []
    later = (
        isinstance(module, (Conv1d, Conv2d, Conv3d))
        and not module.input0.requires_grad
        and getattr(module, name).requires_grad
    )
    return len(exts) - 1 + int(later)


context.add_listener(_Listener())


def per_sample_grads_backpack(model, loss_fn, inputs, targets, settings):
    """:func:`memconv.per_sample_grads` with BackPACK's ``BatchGrad`` as the engine.

    A deep copy of ``model`` is extended (the user's model gets no BackPACK hooks).

    Raises:
        ImportError: if ``backpack-for-pytorch`` is not installed.
        ValueError: for a trainable layer BackPACK's ``BatchGrad`` does not support.
    """
    from .extensions import per_sample_grads

    return per_sample_grads(model, loss_fn, inputs, targets, settings)
