"""The bridge into Opacus' registries: memconv's layer rules as Opacus grad samplers and
norm samplers, installed into (and given back to) ``GRAD_SAMPLERS`` and
``NORM_SAMPLERS`` (see :mod:`memconv.integrations.opacus`)."""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor, nn

from ...conv import settings as context
from ...layers import RuleSettings, find_rule, own_trainable, registered, run_rule, using

_ABSENT = object()
_lock = threading.Lock()
#: While installed: ``[(registry, {class: (previous entry or _ABSENT, entry set)})]``.
_saved: list | None = None
_HINT = "memconv.integrations.opacus needs Opacus 1.5 or later: pip install 'memconv[opacus]'"


def classes() -> tuple[type, ...]:
    """The layer classes memconv's samplers are registered for: every type of the
    layer-rule registry (:mod:`memconv.layers`) — torch's and memconv's
    convolutions, Linear, normalisation, Embedding and PReLU layers, and any rule a
    user registered."""
    return tuple(registered())


def require_opacus() -> tuple[list[dict], list[dict]]:
    """Opacus' distinct grad-sampler and norm-sampler registries.

    Raises:
        ImportError: naming the extra, if Opacus (with both registries) is missing.
    """
    try:
        import opacus  # noqa: F401  (first: a cached submodule would bypass a missing package)
        from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
    except ImportError as err:
        raise ImportError(_HINT) from err
    if not hasattr(GradSampleModuleFastGradientClipping, "NORM_SAMPLERS"):
        raise ImportError(_HINT)

    def distinct(*registries):  # the dictionaries Opacus' decorators write to
        return list({id(r): r for r in registries}.values())

    grads = distinct(
        GradSampleModule.GRAD_SAMPLERS, GradSampleModuleFastGradientClipping.GRAD_SAMPLERS
    )
    return grads, distinct(GradSampleModuleFastGradientClipping.NORM_SAMPLERS)


def _call(layer: nn.Module, activations, backprops: Tensor, method: str) -> dict:
    """Run the layer's rule ``method`` on Opacus' activations and output gradient,
    with the open block's settings (``"auto"`` outside any)."""
    rule = find_rule(layer)
    if rule is None:
        raise TypeError(
            f"memconv has no layer rule for {type(layer).__name__}; register one with "
            "memconv.layers.register, or let Opacus treat the layer"
        )
    inputs = tuple(activations) if isinstance(activations, (list, tuple)) else (activations,)
    if not inputs or not all(isinstance(x, Tensor) for x in inputs):
        raise TypeError(
            f"memconv's Opacus sampler for {type(layer).__name__} expects the layer's input "
            f"tensors as activations, got {[type(x).__name__ for x in inputs]}"
        )
    settings = context.use_block_settings(None)
    rule.check_settings(layer, settings)
    # per-sample gradients are kept as Opacus' grad_sample: in the parameter's layout
    kept = method == "grad_sample"
    rs = RuleSettings(settings, None, settings.options.memory_budget, contiguous=kept)
    with using(rs):
        return run_rule(rule, method, layer, inputs, backprops)


def _first_input(activations):
    """The layer's first input among Opacus' activations (a list, or one tensor)."""
    if isinstance(activations, (list, tuple)) and activations:
        return activations[0]
    return activations


def grad_sampler(layer: nn.Module, activations, backprops: Tensor) -> dict:
    """Per-sample gradients of a layer's parameters by its memconv rule, as an Opacus
    grad sampler.

    Args:
        layer: a layer with a rule in :mod:`memconv.layers` (:func:`classes`).
        activations: Opacus' list of the layer's forward inputs (batch axis first).
        backprops: the output gradient ``[N, ...]``, already scaled by Opacus for its
            ``loss_reduction``.

    Returns:
        ``{parameter: [N, *parameter.shape]}`` for the trainable parameters, in the
        output gradient's dtype (an empty batch gives ``[0, *shape]``).

    Raises:
        TypeError: if ``layer`` has no rule or an activation is not a tensor.
        ValueError: if the open block's options cannot apply to the layer (a
            ``tile_size`` tuple of the wrong length).
    """
    params = own_trainable(layer)
    x = _first_input(activations)
    if isinstance(x, Tensor) and x.shape[0] == 0:
        return {p: p.new_zeros(0, *p.shape) for p in params.values()}
    out = _call(layer, activations, backprops, "grad_sample")
    return {params[k]: v for k, v in out.items() if k in params}


def norm_sampler(layer: nn.Module, activations, backprops: Tensor) -> dict:
    """Per-sample gradient norms of a layer's parameters by its memconv rule, as an
    Opacus norm sampler.

    For convolutions these are ghost norms per group (Goodfellow 2015; Li et al.
    2022; Bu et al. 2022) or instantiated chunks, the faster within the open block's
    ``memory_budget`` (32 MiB without one); no per-sample gradient of the whole
    batch is formed.

    Args:
        layer, activations, backprops: as :func:`grad_sampler`.

    Returns:
        ``{parameter: [N]}`` for the trainable parameters: L2 **norms** (not squared;
        Opacus takes the norm over parameters of these), float32 or wider.

    Raises:
        TypeError, ValueError: as :func:`grad_sampler`.
    """
    params = own_trainable(layer)
    x = _first_input(activations)
    if isinstance(x, Tensor) and x.shape[0] == 0:  # an empty batch (Poisson sampling)
        return {p: x.new_zeros(0, dtype=torch.float32) for p in params.values()}
    sq = _call(layer, activations, backprops, "sq_norms")
    return {
        params[k]: v.to(torch.promote_types(v.dtype, torch.float32)).sqrt()
        for k, v in sq.items()
        if k in params
    }


def install() -> None:
    """Register memconv's grad and norm samplers with Opacus (see
    :mod:`memconv.integrations.opacus`).

    Every class of :func:`classes` (the layer-rule registry at this moment) gets
    :func:`grad_sampler` in Opacus' grad-sampler registry and :func:`norm_sampler` in
    its norm-sampler registry. The entries they had are kept for :func:`uninstall`.
    Install before wrapping the model and keep it installed while the wrapped model
    trains: Opacus reads the registries when it wraps a model (layers without a grad
    sampler are prepared for ``torch.func`` then) and in every backward pass.
    Installing twice changes nothing.

    Raises:
        ImportError: if Opacus is not installed (naming the extra to install).
    """
    global _saved
    grad_registries, norm_registries = require_opacus()
    with _lock:
        if _saved is not None:
            return
        saved = []
        for registries, ours in ((grad_registries, grad_sampler), (norm_registries, norm_sampler)):
            for registry in registries:
                previous = {c: (registry.get(c, _ABSENT), ours) for c in classes()}
                saved.append((registry, previous))
        for registry, entries in saved:
            for cls, (_, entry) in entries.items():
                registry[cls] = entry
        _saved = saved


def uninstall() -> None:
    """Give Opacus' registries back exactly the entries they had before :func:`install`.

    Entries memconv added are removed, the ones it replaced put back; an entry that
    was replaced again after :func:`install` (by someone else) is left as it is.
    Does nothing if not installed.
    """
    global _saved
    with _lock:
        if _saved is None:
            return
        for registry, entries in _saved:
            for cls, (previous, entry) in entries.items():
                if registry.get(cls, _ABSENT) is not entry:
                    continue
                if previous is _ABSENT:
                    del registry[cls]
                else:
                    registry[cls] = previous
        _saved = None


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _saved is not None


@contextlib.contextmanager
def installed():
    """:func:`install` for the duration of a ``with`` block, then :func:`uninstall`
    (only if this block installed it: a bridge installed before stays).

    Raises:
        ImportError: as :func:`install`.
    """
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()
