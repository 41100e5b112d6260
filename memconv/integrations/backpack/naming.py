"""Module paths in memconv's refusals under BackPACK, and the checks made before any work.

BackPACK's module extensions see a module, not the model it belongs to. When the model
is given to :func:`memconv.integrations.backpack.install` (``model=``, also
``installed`` and ``routed``), its module paths (``features.3.conv1``, as
``model.named_modules()`` writes them) are remembered for the refusals raised during the
backward pass, and :func:`check_model` refuses, before the forward pass, what the
backward pass would refuse: a layer with trainable parameters that an extension has no
module extension for (BackPACK raises ``NotImplementedError`` once the backward pass
reaches it) and a parameter shared by several layers for the quantities that are not
sums over its uses.

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import weakref

from backpack.extensions import BatchGrad
from backpack.extensions.backprop_extension import FAIL_ERROR
from torch import nn

#: Each module of a model given to ``install(model=...)``: its path in that model.
_paths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember(model: nn.Module) -> None:
    """Remember the module paths of ``model`` (the latest model given wins)."""
    for name, module in model.named_modules():
        _paths[module] = name or "(model)"


def describe(module: nn.Module) -> str:
    """``'features.3.conv1' (Conv2d)`` where the model was given, else the class and
    how to get the path."""
    path = _paths.get(module)
    if path is not None:
        return f"{path!r} ({type(module).__name__})"
    return f"{type(module).__name__} (pass model= to install() or routed() to name its path)"


def check_model(model: nn.Module, ext, mapping: dict, *, tied: bool = True) -> None:
    """Refuse, before the forward pass, what ``ext`` would refuse in the backward pass.

    Args:
        model: the extended model.
        ext: a BackPACK extension object, installed (``mapping`` is its module
            extensions by class).
        mapping: ``{module class: module extension}``.
        tied: whether to refuse shared parameters (memconv's module extensions do;
            for an extension memconv does not cover, BackPACK's own decide).

    Raises:
        NotImplementedError: a leaf layer with trainable parameters whose class has no
            module extension, for an extension that fails on a missing one (every
            second-order extension), as BackPACK does once its backward pass reaches it.
        ValueError: a parameter shared by several layers, for an extension other than
            ``BatchGrad`` (whose per-sample gradients memconv sums over the uses).
    """
    name = type(ext).__name__
    owners: dict = {}
    for path, module in model.named_modules(remove_duplicate=False):
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        leaf = next(module.children(), None) is None
        if own and leaf and type(module) not in mapping and ext._fail_mode == FAIL_ERROR:
            raise NotImplementedError(
                f"BackPACK's {name} has no module extension for the layer {path!r} "
                f"({type(module).__name__}) with trainable parameters: BackPACK would raise "
                "when the backward pass reaches it. Give it one with "
                f"ext.set_module_extension({type(module).__name__}, ...), replace the layer "
                "by one BackPACK supports, or set its parameters' requires_grad=False"
            )
        for p in own:
            owners.setdefault(id(p), []).append(path or "(model)")
    if isinstance(ext, BatchGrad) or not tied:
        return
    for paths in owners.values():
        if len(paths) > 1:
            raise ValueError(
                f"BackPACK's {name} with memconv: a parameter is shared by the layers "
                f"{', '.join(repr(p) for p in paths)} (tied), and its {name} quantity of "
                "the sum of the uses is not the sum of theirs: untie it, or use a curvature "
                "method that keeps the cross terms between the uses"
            )
