"""Opacus integration: memconv's per-sample gradients and norms for convolutions.

memconv plugs in where Opacus itself looks up how to treat a layer: its registries of
*grad samplers* (``GRAD_SAMPLERS``, the dictionary Opacus' ``register_grad_sampler``
fills; used by ``GradSampleModule``, ``grad_sample_mode="hooks"``, and by
``"ghost"`` for layers without a norm sampler) and of *norm samplers*
(``NORM_SAMPLERS``, filled by ``register_norm_sampler``; used by
``GradSampleModuleFastGradientClipping``, ``grad_sample_mode="ghost"``). Installing
and restoring are explicit::

    import memconv
    from opacus import PrivacyEngine
    from memconv.integrations import opacus as mo

    mo.install()                              # before make_private wraps the model
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="hooks",
    )
    for x, y in loader:
        optimizer.zero_grad()
        with memconv.save_memory("shift"):    # the block around backward() applies
            criterion(model(x), y).backward() # p.grad_sample by memconv's strategy
        optimizer.step()
    mo.uninstall()                            # Opacus' own registries, exactly

or ``with mo.installed(): ...``. What :func:`install` registers:

- **grad samplers** (:func:`grad_sampler`) for ``torch.nn.Conv1d/2d/3d``,
  ``torch.nn.ConvTranspose1d/2d/3d`` and memconv's classes of the same names
  (:data:`CLASSES`): the per-sample weight gradient comes from
  :func:`memconv.grad_sample.conv_weight_grad`, the bias's from
  :func:`memconv.grad_sample.bias_grad`, with the strategy of the
  :class:`memconv.save_memory` block open when Opacus calls the sampler (Opacus
  computes per-sample gradients in a backward hook, so: the block around
  ``loss.backward()``; ``"auto"`` outside any). This is the one place where the
  block around the backward pass applies, because Opacus, not memconv, decides when
  the sampler runs; on a GPU, autograd may run backward hooks on its device thread,
  which sees no block of the calling thread, and the sampler then uses ``"auto"``. Exact for every ``padding_mode``:
  Opacus 1.6's own convolution sampler unfolds the input with zero padding whatever
  the ``padding_mode``, so its per-sample weight gradients (and, in ghost mode, the
  norms made from them) of ``"reflect"``, ``"replicate"`` and ``"circular"``
  convolutions are silently wrong. Opacus' own results are right for zero padding
  with any stride, dilation, groups and ``"same"``, and for transposed convolutions
  (which it has no sampler for: it vectorises them with ``torch.func``); there
  the bridge gives the same numbers by memconv's strategies;
- **norm samplers** (:func:`norm_sampler`) for the same classes: Opacus 1.6's ghost
  clipping has norm samplers for ``Linear`` and ``Embedding`` only, so it
  instantiates a convolution's per-sample gradients to take their norms. With the
  bridge the norms come from :func:`memconv.norms.conv_sq_norms`: Gram matrices per
  group (ghost norms: Goodfellow 2015; Li et al. 2022; Bu et al. 2022), or the
  per-sample gradients of a bounded chunk of samples, whichever the cost models
  find faster within the block's ``memory_budget`` (32 MiB without one). As Opacus'
  own norm samplers, they return norms, not squared norms;
- memconv's other layer classes (``memconv.Linear``, ``memconv.GroupNorm``, ... of
  :func:`memconv.convert`; :data:`ALIASES`) get Opacus' own grad and norm samplers of
  the ``torch.nn`` class they subclass, so converted models need no ``torch.func``
  fallback.

Opacus' conventions are kept: the backprops it passes are already scaled for its
``loss_reduction`` (times the batch size for ``"mean"``), so ``p.grad_sample[n]`` is
the gradient of sample n's loss; results are keyed by parameter; per-sample
gradients are in the output gradient's dtype (as Opacus'), norms in float32 or wider.

Not covered: subclasses of the convolution classes other than memconv's (Opacus
looks layers up by their exact class; register :func:`grad_sampler` and
:func:`norm_sampler` for them with Opacus' own decorators), and
``grad_sample_mode="functorch"``/``"ew"``, which do not read the registries. As for
Opacus' ``Linear``, ghost clipping then rejects a convolution called twice in one
forward pass (tied weights); ``"hooks"`` handles it. On CUDA, autograd runs
backward hooks on its own threads, where a ``save_memory`` block of the calling
thread is not visible: the samplers then use ``"auto"`` (the results are the same;
only time and memory differ).

This module does not import Opacus until a function is called; without it,
:func:`install` raises an ``ImportError`` naming the extra to install.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor, nn

from .. import context
from .._geometry import CONV_TRANSPOSE_TYPES, CONV_TYPES, conv_spec
from ..grad_sample import bias_grad, conv_weight_grad, own_trainable
from ..modules import CONVERSIONS
from ..norms import conv_sq_norms
from ..vjp import check_settings

#: The layer classes memconv's samplers are registered for: torch's and memconv's
#: convolutions and transposed convolutions.
CLASSES: tuple[type, ...] = tuple(
    cls
    for torch_cls in CONV_TYPES + CONV_TRANSPOSE_TYPES
    for cls in (torch_cls, CONVERSIONS[torch_cls])
)
#: memconv's other layer classes and the ``torch.nn`` class whose Opacus samplers
#: they get (where Opacus has one).
ALIASES: dict[type, type] = {
    memconv_cls: torch_cls
    for torch_cls, memconv_cls in CONVERSIONS.items()
    if torch_cls not in CONV_TYPES + CONV_TRANSPOSE_TYPES
}

_ABSENT = object()
_lock = threading.Lock()
#: While installed: ``[(registry, {class: (previous entry or _ABSENT, entry set)})]``.
_saved: list | None = None


def _require() -> tuple[list[dict], list[dict]]:
    """Opacus' distinct grad-sampler and norm-sampler registries.

    Raises:
        ImportError: naming the extra, if Opacus (with both registries) is missing.
    """
    hint = "memconv.integrations.opacus needs Opacus 1.5 or later: pip install 'memconv[opacus]'"
    try:
        import opacus  # noqa: F401  (first: a cached submodule would bypass a missing package)
        from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
    except ImportError as err:
        raise ImportError(hint) from err
    if not hasattr(GradSampleModuleFastGradientClipping, "NORM_SAMPLERS"):
        raise ImportError(hint)

    def distinct(*registries):  # the dictionaries Opacus' decorators write to
        return list({id(r): r for r in registries}.values())

    grads = distinct(
        GradSampleModule.GRAD_SAMPLERS, GradSampleModuleFastGradientClipping.GRAD_SAMPLERS
    )
    return grads, distinct(GradSampleModuleFastGradientClipping.NORM_SAMPLERS)


def _input(layer: nn.Module, activations) -> Tensor:
    """The layer's input from Opacus' ``activations`` (the list of its forward inputs)."""
    x = activations[0] if isinstance(activations, (list, tuple)) and activations else activations
    if not isinstance(x, Tensor):
        raise TypeError(
            f"memconv's Opacus sampler for {type(layer).__name__} expects the layer's input "
            f"tensor as the first activation, got {type(x).__name__}"
        )
    return x


def _settings(layer: nn.Module) -> context.Settings:
    """The open block's settings (``"auto"`` outside any), checked against the layer."""
    settings = context.use_block_settings(None)
    check_settings(settings, conv_spec(layer).geometry)
    return settings


def grad_sampler(layer: nn.Module, activations, backprops: Tensor) -> dict:
    """Per-sample gradients of a convolution's parameters, as an Opacus grad sampler.

    Args:
        layer: ``Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d`` (torch's or memconv's).
        activations: Opacus' list of the layer's forward inputs; the first is the
            input ``[N, C_in, *S]`` (before any padding).
        backprops: the output gradient ``[N, C_out, *T]``, already scaled by Opacus
            for its ``loss_reduction``.

    Returns:
        ``{parameter: [N, *parameter.shape]}`` for the trainable weight and bias, in
        the output gradient's dtype (an empty batch gives ``[0, *shape]``).

    Raises:
        TypeError: if ``layer`` is not a convolution or the first activation is not
            a tensor.
        ValueError: if the open block's options cannot apply to the layer (a
            ``tile_size`` tuple of the wrong length).
    """
    settings = _settings(layer)
    x = _input(layer, activations)
    out = {}
    with torch.no_grad():
        if layer.weight.requires_grad:
            out[layer.weight] = conv_weight_grad(layer, x, backprops, settings, per_sample=True)
        if layer.bias is not None and layer.bias.requires_grad:
            out[layer.bias] = bias_grad(backprops, per_sample=True)
    return out


def norm_sampler(layer: nn.Module, activations, backprops: Tensor) -> dict:
    """Per-sample gradient norms of a convolution's parameters, as an Opacus norm sampler.

    The weight's come from :func:`memconv.norms.conv_sq_norms` (ghost norms per group,
    or instantiated chunks: the faster within the open block's ``memory_budget``,
    32 MiB without one); no per-sample gradient of the whole batch is formed.

    Args:
        layer, activations, backprops: as :func:`grad_sampler`.

    Returns:
        ``{parameter: [N]}`` for the trainable weight and bias: L2 **norms** (not
        squared; Opacus takes the norm over parameters of these), float32 or wider.

    Raises:
        TypeError, ValueError: as :func:`grad_sampler`.
    """
    settings = _settings(layer)
    x = _input(layer, activations)
    if x.shape[0] == 0:  # an empty batch (Poisson sampling): no norms
        return {p: x.new_zeros(0, dtype=torch.float32) for p in own_trainable(layer).values()}
    with torch.no_grad():
        sq = conv_sq_norms(layer, x, backprops, settings, None, settings.options.memory_budget)
    params = dict(layer.named_parameters(recurse=False))
    return {
        params[k]: v.to(torch.promote_types(v.dtype, torch.float32)).sqrt() for k, v in sq.items()
    }


def install() -> None:
    """Register memconv's grad and norm samplers with Opacus (see the module docstring).

    Every class of :data:`CLASSES` gets :func:`grad_sampler` in Opacus' grad-sampler
    registry and :func:`norm_sampler` in its norm-sampler registry; every class of
    :data:`ALIASES` gets the entries its ``torch.nn`` class has there. The entries
    they had are kept for :func:`uninstall`. Install before wrapping the model and
    keep it installed while the wrapped model trains: Opacus reads the registries
    when it wraps a model (layers without a grad sampler are prepared for
    ``torch.func`` then) and in every backward pass. Installing twice changes nothing.

    Raises:
        ImportError: if Opacus is not installed (naming the extra to install).
    """
    global _saved
    grad_registries, norm_registries = _require()
    with _lock:
        if _saved is not None:
            return
        saved = []
        for registries, ours in ((grad_registries, grad_sampler), (norm_registries, norm_sampler)):
            for registry in registries:
                entries = dict.fromkeys(CLASSES, ours)
                entries.update(
                    (memconv_cls, registry[torch_cls])
                    for memconv_cls, torch_cls in ALIASES.items()
                    if torch_cls in registry
                )
                saved.append(
                    (registry, {c: (registry.get(c, _ABSENT), e) for c, e in entries.items()})
                )
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
