"""Opacus integration: private training with memconv's clipped sum, and memconv's
per-sample samplers in Opacus' registries.

Two paths. :func:`make_private` (and :func:`make_private_with_epsilon`) returns what
Opacus' ``PrivacyEngine.make_private`` returns, keeping Opacus' accountant, noise,
Poisson sampling, DP optimizer and ``DPDDP``, with the clipped sum (flat, per-layer or
adaptive clipping) computed by
:func:`memconv.clip_and_accumulate` rather than by module hooks: any model memconv's
functions handle trains (in-place activations and adds, norm + activation layers,
subclasses with their own forward, attention); :func:`fix` turns BatchNorm layers,
subclasses included, into GroupNorm and the same activation. :func:`install` keeps
Opacus' own hooks (and its per-layer and adaptive clipping), with memconv's samplers:

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

- **grad samplers** (:func:`grad_sampler`) for every layer class with a memconv rule
  (:func:`classes`: the registry of :mod:`memconv.layers` — torch's and memconv's
  convolutions and transposed convolutions, Linear, the normalisation layers,
  Embedding, PReLU, and any rule a user registered): the per-sample gradients come
  from the layer's rule, with the strategy of the :class:`memconv.save_memory` block
  open when Opacus calls the sampler (Opacus computes per-sample gradients in a
  backward hook, so: the block around ``loss.backward()``; ``"auto"`` outside any).
  This is the one place where the block around the backward pass applies, because
  Opacus, not memconv, decides when the sampler runs; on a GPU, autograd may run
  backward hooks on its device thread, which sees no block of the calling thread,
  and the sampler then uses ``"auto"``. Exact for every ``padding_mode``: Opacus
  1.6's own convolution sampler unfolds the input with zero padding whatever the
  ``padding_mode``, so its per-sample weight gradients (and, in ghost mode, the
  norms made from them) of ``"reflect"``, ``"replicate"`` and ``"circular"``
  convolutions are silently wrong;
- **norm samplers** (:func:`norm_sampler`) for the same classes: Opacus 1.6's ghost
  clipping has norm samplers for ``Linear`` and ``Embedding`` only, so it
  instantiates a convolution's per-sample gradients to take their norms. With the
  bridge the norms come from the rules' ``sq_norms``: for convolutions Gram matrices
  per group (ghost norms: Goodfellow 2015; Li et al. 2022; Bu et al. 2022), or the
  per-sample gradients of a bounded chunk of samples, whichever the cost models
  find faster within the block's ``memory_budget`` (32 MiB without one). As Opacus'
  own norm samplers, they return norms, not squared norms.

Layers without a rule (``MultiheadAttention``, ``GRU``, ...) keep Opacus' own
treatment (its samplers, or its ``torch.func`` fallback).

Opacus' conventions are kept: the backprops it passes are already scaled for its
``loss_reduction`` (times the batch size for ``"mean"``), so ``p.grad_sample[n]`` is
the gradient of sample n's loss; results are keyed by parameter; per-sample
gradients are in the output gradient's dtype (as Opacus'), norms in float32 or wider.

Not covered: layer classes registered with memconv after :func:`install` (install
again after uninstalling), and ``grad_sample_mode="functorch"``/``"ew"``, which do
not read the registries. As for
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

from ..conv import settings as context
from ..layers import RuleSettings, find_rule, own_trainable, registered, run_rule, using


def classes() -> tuple[type, ...]:
    """The layer classes memconv's samplers are registered for: every type of the
    layer-rule registry (:mod:`memconv.layers`) — torch's and memconv's
    convolutions, Linear, normalisation, Embedding and PReLU layers, and any rule a
    user registered."""
    return tuple(registered())


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
    rs = RuleSettings(settings, None, settings.options.memory_budget)
    with using(rs):
        return run_rule(rule, method, layer, inputs, backprops)


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
    x = activations[0] if isinstance(activations, (list, tuple)) and activations else activations
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
    x = activations[0] if isinstance(activations, (list, tuple)) and activations else activations
    if isinstance(x, Tensor) and x.shape[0] == 0:  # an empty batch (Poisson sampling)
        return {p: x.new_zeros(0, dtype=torch.float32) for p in params.values()}
    sq = _call(layer, activations, backprops, "sq_norms")
    return {
        params[k]: v.to(torch.promote_types(v.dtype, torch.float32)).sqrt()
        for k, v in sq.items()
        if k in params
    }


def install() -> None:
    """Register memconv's grad and norm samplers with Opacus (see the module docstring).

    Every class of :func:`classes` (the layer-rule registry at this moment) gets
    :func:`grad_sampler` in Opacus' grad-sampler registry and :func:`norm_sampler` in
    its norm-sampler registry. The entries they had are kept for :func:`uninstall`. Install before wrapping the model and
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
                entries = dict.fromkeys(classes(), ours)
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


# ---------------------------------------------------------------------------------
# The private-training path: Opacus' engine, memconv's clipped sum
# ---------------------------------------------------------------------------------

#: Clipping modes :func:`make_private` accepts (Opacus' names).
CLIPPINGS = ("flat", "per_layer", "adaptive")
_REDUCTIONS = ("mean", "sum")
#: The arguments of ``clipping="adaptive"`` (Opacus' ``AdaClipDPOptimizer``'s names).
ADAPTIVE_ARGS = (
    "target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound", "min_clipbound",
    "unclipped_num_std",
)  # fmt: skip


def _inner(module: nn.Module) -> nn.Module:
    """The module a ``DPDDP`` or ``DistributedDataParallel`` wraps (else itself)."""
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(module, DistributedDataParallel) or type(module).__name__ in (
        "DPDDP",
        "DifferentiallyPrivateDistributedDataParallel",
    ):
        module = module.module
    return module


def _linear_loss(output: Tensor, target: Tensor) -> Tensor:
    """``⟨output, target⟩``: with ``target`` sample n's output gradient, its gradient
    with respect to the parameters is sample n's loss gradient (exactly)."""
    return (output * target).sum()


class _ClipOnBackward(torch.autograd.Function):
    """Identity on the model's output; its backward hands the output gradient to
    :meth:`PrivateModule.clip`, which adds the clipped sum to ``.grad``."""

    @staticmethod
    def forward(ctx, wrapper, inputs, anchor, output):
        ctx.wrapper, ctx.inputs = wrapper, inputs
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.wrapper.clip(ctx.inputs, grad_output)
        return None, None, None, None


class PrivateModule(nn.Module):
    """The model :func:`make_private` returns: its forward runs the model, its
    backward adds the **clipped sum** Σₙ min(1, C/‖gₙ‖)·gₙ to every trainable
    parameter's ``.grad`` by :func:`memconv.clip_and_accumulate` (no module hook).

    In training mode with gradients enabled, ``forward(x)`` runs the model without
    keeping its graph and returns its output attached to a node whose backward
    receives ``∂L/∂output``; it then runs memconv's own pass on ``x`` with the
    per-sample loss ``⟨outputₙ, s·∂L/∂outputₙ⟩`` (``s`` = the batch size for
    ``loss_reduction="mean"``, 1 for ``"sum"``), whose parameter gradient is sample
    n's loss gradient exactly. Any criterion whose per-sample loss depends on that
    sample's output only works unchanged. In eval mode or without gradients the
    model runs as it is.

    Attributes not found on the wrapper are looked up on the wrapped model (as on
    Opacus' ``GradSampleModule``); ``_module`` is the wrapped model.
    """

    def __init__(self, module: nn.Module, *, max_grad_norm, loss_reduction: str,
                 clip_options: dict, groups="all", adaptive=None):  # fmt: skip
        super().__init__()
        self._module = module
        self.max_grad_norm = (
            dict(max_grad_norm) if isinstance(max_grad_norm, dict) else float(max_grad_norm)
        )
        self.loss_reduction = loss_reduction
        self.batch_first = True
        self.clip_options = dict(clip_options)
        self.groups = groups
        #: the :class:`memconv.AdaptiveClipping` state shared with the optimizer, or None
        self.adaptive = adaptive
        self._anchor = torch.empty(0, requires_grad=True)
        #: per-sample norms before clipping of the last backward pass: ``[N]``, or
        #: ``{parameter name: [N]}`` with per-layer clipping
        self.last_norms: Tensor | dict | None = None

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_modules", {}).get("_module")
            if wrapped is None or name.startswith("__"):
                raise
            return getattr(wrapped, name)

    def forward(self, x, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self._module(x, *args, **kwargs)
        if args or kwargs or not isinstance(x, Tensor):
            raise TypeError(
                "memconv's private path runs the model on one input tensor [N, ...]: "
                f"got {1 + len(args)} positional and {len(kwargs)} keyword arguments"
            )
        with torch.no_grad():
            out = self._module(x)
        if not isinstance(out, Tensor):
            raise TypeError(
                "memconv's private path needs the model to return one tensor [N, ...], "
                f"got {type(out).__name__}"
            )
        return _ClipOnBackward.apply(self, x.detach(), self._anchor, out)

    def clip(self, inputs: Tensor, grad_output: Tensor) -> None:
        """Add the clipped sum of the samples of ``inputs`` to ``.grad``, the
        per-sample loss gradients given by the output gradient ``grad_output``.

        Raises:
            RuntimeError: if a trainable parameter's ``.grad`` holds a previous
                backward pass's gradient (accumulating batches would clip each batch
                on its own: call ``optimizer.zero_grad()`` between steps).
        """
        from ..tasks.clipping import clip_and_accumulate

        model = _inner(self._module)
        params = [p for p in model.parameters() if p.requires_grad]
        held = [p.grad.ne(0).any() for p in params if p.grad is not None]
        if held and bool(torch.stack(held).any()):  # one device synchronisation
            raise RuntimeError(
                "memconv.integrations.opacus: .grad already holds a gradient before this "
                "backward pass; call optimizer.zero_grad() after each optimizer.step() "
                "(gradient accumulation over batches is not supported: each batch would "
                "be clipped on its own)"
            )
        n = len(inputs)
        if n == 0:  # an empty Poisson batch: a zero clipped sum
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            empty = inputs.new_zeros(0)
            self.last_norms = (
                {k: empty for k in self.max_grad_norm}
                if isinstance(self.max_grad_norm, dict)
                else empty
            )
            return
        scale = n if self.loss_reduction == "mean" else 1
        targets = grad_output.detach() * scale
        max_norm = self.adaptive.max_norm if self.adaptive is not None else self.max_grad_norm
        with torch.enable_grad():
            self.last_norms = clip_and_accumulate(
                model, _linear_loss, inputs, targets, max_norm=max_norm, groups=self.groups,
                **self.clip_options,
            )  # fmt: skip
        if self.adaptive is not None:
            self.adaptive.count(self.last_norms)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    # Opacus' GradSampleModule API used around a training loop
    def forbid_grad_accumulation(self):
        """Accumulation is always refused (see :meth:`clip`)."""

    def cleanup(self):
        """Nothing to remove: the path registers no hooks."""


def _check_private_args(privacy_engine, module, optimizer, max_grad_norm, clipping,
                        loss_reduction, batch_first, adaptive_args=None):  # fmt: skip
    """Check :func:`make_private`'s arguments before any work.

    Returns:
        ``(inner, thresholds)``: the model a ``DPDDP`` wraps (or ``module``) and, with
        ``clipping="per_layer"``, ``{parameter name: threshold}`` (else None).
    """
    import math
    import numbers

    from opacus import PrivacyEngine

    from .._checks import check_threshold

    if not isinstance(privacy_engine, PrivacyEngine):
        raise TypeError(
            f"privacy_engine must be an opacus.PrivacyEngine, got {type(privacy_engine).__name__}"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(module, PrivateModule):
        raise ValueError("module is already a memconv PrivateModule; pass the plain model")
    if not isinstance(clipping, str) or clipping not in CLIPPINGS:
        raise ValueError(
            f"unknown clipping={clipping!r}; accepted: {', '.join(map(repr, CLIPPINGS))}"
        )
    adaptive_args = adaptive_args or {}
    given = [k for k, v in adaptive_args.items() if v is not None]
    if clipping != "adaptive" and given:
        raise ValueError(
            f"{given[0]} is an argument of clipping='adaptive', not of clipping={clipping!r}"
        )
    if clipping == "adaptive":
        missing = [k for k in ADAPTIVE_ARGS if adaptive_args.get(k) is None]
        if missing:
            raise ValueError(f"clipping='adaptive' needs {', '.join(missing)}")
    if clipping == "per_layer":
        if isinstance(max_grad_norm, (str, bytes)) or not isinstance(max_grad_norm, (list, tuple)):
            raise TypeError(
                "max_grad_norm must be a list of thresholds, one per trainable parameter of "
                f"optimizer in its order, with clipping='per_layer'; got {max_grad_norm!r}"
            )
        norms = [check_threshold(c, f"max_grad_norm[{i}]") for i, c in enumerate(max_grad_norm)]
    elif (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, numbers.Real)
        or not (math.isfinite(max_grad_norm) and max_grad_norm > 0)
    ):
        raise ValueError(f"max_grad_norm must be a positive finite number, got {max_grad_norm!r}")
    if loss_reduction not in _REDUCTIONS:
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if batch_first is not True:
        raise ValueError("batch_first must be True: memconv takes the batch axis first")
    params = set(module.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in params:
                raise ValueError("optimizer holds parameters that are not module's")
    inner = _inner(module)
    from ..tasks.grads import check_per_sample_model

    check_per_sample_model(inner, argument="module")
    for name, layer in inner.named_modules():
        if isinstance(layer, nn.modules.dropout._DropoutNd) and layer.p > 0:
            raise ValueError(
                f"module's layer {name!r} ({type(layer).__name__}, p={layer.p}) draws random "
                "numbers, and memconv's private path runs the forward pass again for its "
                "clipped sum, so the two draws would differ: set p=0, or use mo.install() "
                "with PrivacyEngine.make_private (Opacus' hooks)"
            )
    if clipping != "per_layer":
        return inner, None
    # Opacus' DPPerLayerOptimizer pairs the thresholds with its trainable parameters
    ordered = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if len(norms) != len(ordered):
        raise ValueError(
            f"max_grad_norm has {len(norms)} thresholds and optimizer {len(ordered)} trainable "
            "parameters; clipping='per_layer' needs one threshold per parameter, in order"
        )
    names = {p: name for name, p in inner.named_parameters() if p.requires_grad}
    thresholds = {names[p]: c for p, c in zip(ordered, norms)}
    left = [name for name in names.values() if name not in thresholds]
    if left:
        raise ValueError(
            f"module's trainable parameter(s) {left[:5]} are not in optimizer, so "
            "clipping='per_layer' has no threshold for them: add them to the optimizer or "
            "freeze them (requires_grad=False)"
        )
    return inner, thresholds


_ADACLIP: type | None = None


def _adaclip_class() -> type:
    """:class:`AdaClipDPOptimizerFastGradientClipping`, built on first use (Opacus is
    imported only then)."""
    global _ADACLIP
    if _ADACLIP is not None:
        return _ADACLIP
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.optimizers.optimizer import (
        _check_processed_flag,
        _generate_noise,
        _mark_as_processed,
    )

    class AdaClipDPOptimizerFastGradientClipping(DPOptimizerFastGradientClipping):
        """Opacus' ``AdaClipDPOptimizer`` on a clipped sum computed elsewhere: Opacus'
        fast-gradient-clipping optimizer (its accumulation, step skipping, scaling and
        accountant hook) with the adaptive threshold of a shared
        :class:`memconv.AdaptiveClipping` state, which :class:`PrivateModule` clips
        with and counts into.

        The step draws as ``AdaClipDPOptimizer`` does: each parameter's noise of
        standard deviation σ_eff·C (σ_eff = (σ⁻² − (2σ_b)⁻²)^(−1/2)) in the optimizer's
        parameter order, then the count's N(0, σ_b²), from the optimizer's generator;
        scales, calls the step hook (the accountant, with σ), updates C and steps. A
        step whose batches held no sample keeps C. Opacus' attribute names
        (``max_grad_norm``, ``target_unclipped_quantile``, ``clipbound_learning_rate``,
        ``max_clipbound``, ``min_clipbound``, ``unclipped_num_std``, ``sample_size``,
        ``unclipped_num``) read and write the state.

        Attributes:
            clipping: the :class:`memconv.AdaptiveClipping` state.
        """

        def __init__(self, optimizer, *, clipping, expected_batch_size, loss_reduction="mean",
                     generator=None, secure_mode=False, **kwargs):  # fmt: skip
            self.clipping = clipping
            super().__init__(
                optimizer, noise_multiplier=clipping.noise_multiplier,
                max_grad_norm=clipping.max_norm, expected_batch_size=expected_batch_size,
                loss_reduction=loss_reduction, generator=generator, secure_mode=secure_mode,
                **kwargs,
            )  # fmt: skip

        def add_noise(self):
            std = self.clipping.gradient_noise_std()
            for p in self.params:
                _check_processed_flag(p.summed_grad)
                noise = _generate_noise(
                    std=std, reference=p.summed_grad, generator=self.generator,
                    secure_mode=self.secure_mode,
                )  # fmt: skip
                p.grad = (p.summed_grad + noise).view_as(p)
                _mark_as_processed(p.summed_grad)
            device = self.params[0].device if self.params else None
            self.clipping.add_count_noise(generator=self.generator, device=device)

        def pre_step(self, closure=None):
            full = super().pre_step(closure)
            if full and self.clipping.sample_size > 0:
                self.clipping.update()
            return full

        def zero_grad(self, set_to_none: bool = False):
            skipped = self._is_last_step_skipped  # the counts stay with the summed grads
            super().zero_grad(set_to_none)
            if not skipped:
                self.clipping.reset()

    def delegate(attribute, field):
        def get(self):
            return getattr(self.clipping, field)

        def put(self, value):
            setattr(self.clipping, field, value)

        setattr(AdaClipDPOptimizerFastGradientClipping, attribute, property(get, put))

    delegate("max_grad_norm", "max_norm")
    for field in (*ADAPTIVE_ARGS, "sample_size", "unclipped_num"):
        delegate(field, field)
    AdaClipDPOptimizerFastGradientClipping.__module__ = __name__
    _ADACLIP = AdaClipDPOptimizerFastGradientClipping
    return _ADACLIP


def make_private(
    privacy_engine,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader,
    noise_multiplier: float,
    max_grad_norm: float | list[float],
    batch_first: bool = True,
    loss_reduction: str = "mean",
    poisson_sampling: bool = True,
    clipping: str = "flat",
    noise_generator=None,
    rand_on_empty: bool = False,
    strategy: str | bool | None = None,
    memory_budget: int | str | None = "available",
    norm_route: str | None = None,
    clip_route: str | None = None,
    criterion=None,
    target_unclipped_quantile: float | None = None,
    clipbound_learning_rate: float | None = None,
    max_clipbound: float | None = None,
    min_clipbound: float | None = None,
    unclipped_num_std: float | None = None,
    **kwargs,
):
    """Opacus' ``PrivacyEngine.make_private`` with memconv's clipped sum in place of
    Opacus' per-sample hooks.

    Everything DP-SGD keeps from Opacus is Opacus': the accountant of
    ``privacy_engine`` (a step hook on the optimizer, sampling rate
    ``1/len(data_loader)``), Poisson sampling (``DPDataLoader``), the noise
    (``noise_multiplier · max_grad_norm``, from ``noise_generator`` or the engine's
    secure RNG) and the scaling (its fast-gradient-clipping optimizer, distributed
    when ``module`` is a ``DPDDP`` or ``DistributedDataParallel``). The clipped sum
    comes from :func:`memconv.clip_and_accumulate` — book-keeping or two passes, no
    module hook — so in-place activations and adds, norm + activation layers,
    subclasses with their own forward and attention train as memconv handles them.
    The loop stays::

        model, optimizer, loader = mo.make_private(
            PrivacyEngine(), module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0)
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()

    The criterion must reduce per-sample losses by ``loss_reduction`` over the
    batch axis, each depending on its sample's output only (``CrossEntropyLoss``,
    ``MSELoss``, ...). Cost: one forward pass without graph (the user's), then
    memconv's forward and backward pass.

    ``clipping`` takes Opacus' modes with its argument names. ``"per_layer"``: a
    threshold per trainable parameter of the optimizer, in its order (as Opacus'
    ``DPPerLayerOptimizer`` pairs them), each parameter's per-sample gradient clipped
    to its own (``groups="parameter"``, during the one backward pass); the noise is σ
    times the thresholds' L2 norm as Opacus computes it (float32). ``"adaptive"``
    (Andrew et al., NeurIPS 2021): the threshold follows the target quantile of the
    norms from a noisy count of unclipped samples, in a
    :class:`memconv.AdaptiveClipping` state shared by the model (which clips with it
    and counts) and the optimizer (which draws each parameter's noise, then the
    count's, as ``AdaClipDPOptimizer`` does, and updates it after the step); the
    accountant uses ``noise_multiplier``. Both equal Opacus' own optimizers step for
    step with the same generator, up to Opacus' clip factor C/(‖g‖ + 10⁻⁶) against
    memconv's C/‖g‖ (about 10⁻⁶/‖g‖ relative on a clipped sample's contribution).

    Args:
        privacy_engine: an ``opacus.PrivacyEngine`` (its accountant is used).
        module: the model; or a ``DPDDP`` / ``DistributedDataParallel`` wrapping it.
            It takes one tensor ``[N, ...]`` and returns one tensor ``[N, ...]``.
        optimizer: an optimizer over ``module``'s parameters.
        data_loader: the training ``DataLoader``.
        noise_multiplier: the noise's standard deviation over ``max_grad_norm`` (over
            the thresholds' L2 norm with ``"per_layer"``).
        max_grad_norm: the clipping threshold C (positive, finite); the first one with
            ``"adaptive"``; with ``"per_layer"`` a list of thresholds, one per trainable
            parameter of ``optimizer`` in its order.
        batch_first: must be True.
        loss_reduction: ``"mean"`` or ``"sum"``, the criterion's reduction.
        poisson_sampling: as Opacus' (True: ``DPDataLoader``).
        clipping: ``"flat"`` (all parameters' norm), ``"per_layer"`` (each
            parameter's norm) or ``"adaptive"`` (all parameters' norm, an adaptive
            threshold).
        noise_generator: ``torch.Generator`` of the noise (not in secure mode).
        rand_on_empty: as Opacus'.
        strategy, memory_budget, norm_route, clip_route: passed to
            :func:`memconv.clip_and_accumulate`.
        criterion: accepted for Opacus' signature and not used (the returned model
            works with the criterion of the loop).
        target_unclipped_quantile: with ``"adaptive"``, the target fraction of
            unclipped samples (required with ``"adaptive"``, refused otherwise, as
            are the four below; each as Opacus' ``AdaClipDPOptimizer`` takes it).
        clipbound_learning_rate: the threshold's geometric learning rate.
        max_clipbound: the threshold's upper bound.
        min_clipbound: the threshold's lower bound.
        unclipped_num_std: the standard deviation of the count's noise.
        **kwargs: passed to Opacus' optimizer.

    Returns:
        ``(model, optimizer, data_loader)`` as ``make_private`` with
        ``grad_sample_mode="hooks"`` returns them: the model is a
        :class:`PrivateModule`, the optimizer Opacus'
        ``DPOptimizerFastGradientClipping`` (or its distributed version; with
        ``"per_layer"`` its ``max_grad_norms`` holds the thresholds), or with
        ``"adaptive"`` ``AdaClipDPOptimizerFastGradientClipping``, its subclass.

    Raises:
        ImportError: if Opacus is missing (naming the extra).
        TypeError: ``privacy_engine``, ``module`` or ``optimizer`` of the wrong type;
            with ``"per_layer"``, ``max_grad_norm`` not a list or a threshold not a
            number; an adaptive argument not a number.
        ValueError: an unknown ``clipping``; ``grad_sample_mode`` or ``wrap_model``
            given; a ``max_grad_norm`` (or, with ``"per_layer"``, a threshold) not
            positive and finite; not as many thresholds as trainable optimizer
            parameters, or a trainable parameter of the model missing from the
            optimizer, with ``"per_layer"``; an adaptive argument missing, given
            without ``"adaptive"`` or out of range (Opacus' checks), or ``"adaptive"``
            with ``DPDDP``; a ``loss_reduction`` other than mean/sum; optimizer
            parameters not the module's; a layer memconv cannot treat per sample
            (named, e.g. BatchNorm in training mode: convert with :func:`fix`); a
            dropout layer with p > 0. All before any work.
    """
    _require()
    if "grad_sample_mode" in kwargs or "wrap_model" in kwargs:
        name = "grad_sample_mode" if "grad_sample_mode" in kwargs else "wrap_model"
        raise ValueError(
            f"{name} is an option of Opacus' hooks; memconv's private path has none. For "
            "Opacus' own modes use mo.install() and PrivacyEngine.make_private"
        )
    if noise_generator is not None and getattr(privacy_engine, "secure_mode", False):
        raise ValueError("noise_generator cannot be passed in secure mode")
    adaptive_args = dict(
        target_unclipped_quantile=target_unclipped_quantile,
        clipbound_learning_rate=clipbound_learning_rate, max_clipbound=max_clipbound,
        min_clipbound=min_clipbound, unclipped_num_std=unclipped_num_std,
    )  # fmt: skip
    _, thresholds = _check_private_args(
        privacy_engine, module, optimizer, max_grad_norm, clipping, loss_reduction, batch_first,
        adaptive_args,
    )  # fmt: skip
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from torch.nn.parallel import DistributedDataParallel

    from .._checks import CLIP_ROUTES, check_budget, check_route
    from ..tasks.adaptive import AdaptiveClipping

    check_budget(memory_budget)
    check_route(norm_route)
    if clip_route is not None and clip_route not in CLIP_ROUTES:
        raise ValueError(f"unknown clip_route {clip_route!r}; accepted: {', '.join(CLIP_ROUTES)}")
    distributed = isinstance(module, (DPDDP, DistributedDataParallel))
    state = None
    if clipping == "adaptive":
        if distributed:
            raise ValueError(
                "clipping='adaptive' is not supported with DPDDP or DistributedDataParallel "
                "(as in Opacus): the count of unclipped samples is per process"
            )
        state = AdaptiveClipping(max_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                                 **adaptive_args)  # fmt: skip
    options = dict(
        strategy=strategy, memory_budget=memory_budget, norm_route=norm_route,
        clip_route=clip_route,
    )  # fmt: skip
    wrapped = PrivateModule(
        module, max_grad_norm=thresholds if thresholds is not None else max_grad_norm,
        loss_reduction=loss_reduction, clip_options=options,
        groups="parameter" if thresholds is not None else "all", adaptive=state,
    )  # fmt: skip
    data_loader = privacy_engine._prepare_data_loader(
        data_loader, distributed=distributed, poisson_sampling=poisson_sampling,
        batch_first=batch_first, rand_on_empty=rand_on_empty,
    )  # fmt: skip
    sample_rate = 1 / len(data_loader)
    expected_batch_size = int(len(data_loader.dataset) * sample_rate)
    if distributed:
        expected_batch_size /= torch.distributed.get_world_size()
    if state is not None:
        from opacus.optimizers import DPOptimizer

        if isinstance(optimizer, DPOptimizer):  # as Opacus' _prepare_optimizer
            optimizer = optimizer.original_optimizer
        dp_optimizer = _adaclip_class()(
            optimizer, clipping=state, expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction, secure_mode=privacy_engine.secure_mode,
            generator=privacy_engine.secure_rng if privacy_engine.secure_mode else noise_generator,
            **kwargs,
        )  # fmt: skip
    else:
        # per-layer: the noise scales with Opacus' DPPerLayerOptimizer's sensitivity, the
        # L2 norm of the thresholds computed as Opacus computes it (float32)
        sensitivity = (
            torch.norm(torch.Tensor(list(max_grad_norm)), p=2).item()
            if thresholds is not None
            else max_grad_norm
        )
        dp_optimizer = privacy_engine._prepare_optimizer(
            optimizer=optimizer, noise_multiplier=noise_multiplier, max_grad_norm=sensitivity,
            expected_batch_size=expected_batch_size, loss_reduction=loss_reduction,
            noise_generator=noise_generator, distributed=distributed, clipping="flat",
            grad_sample_mode="ghost", **kwargs,
        )  # fmt: skip
        if thresholds is not None:
            dp_optimizer.max_grad_norms = list(max_grad_norm)  # as DPPerLayerOptimizer
    dp_optimizer.attach_step_hook(
        privacy_engine.accountant.get_optimizer_hook_fn(sample_rate=sample_rate)
    )
    return wrapped, dp_optimizer, data_loader


def make_private_with_epsilon(
    privacy_engine,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader,
    target_epsilon: float,
    target_delta: float,
    epochs: int,
    max_grad_norm: float,
    **kwargs,
):
    """:func:`make_private` with the noise multiplier Opacus'
    ``make_private_with_epsilon`` picks: the smallest reaching ``(target_epsilon,
    target_delta)`` after ``epochs`` epochs at sampling rate ``1/len(data_loader)``
    for the engine's accountant (``opacus.accountants.utils.get_noise_multiplier``).

    Args:
        privacy_engine, module, optimizer, data_loader, max_grad_norm: as
            :func:`make_private`.
        target_epsilon: ε to reach after ``epochs`` epochs (positive).
        target_delta: δ (in (0, 1)).
        epochs: the number of epochs planned (positive integer).
        **kwargs: the other arguments of :func:`make_private`.

    Returns:
        As :func:`make_private`.

    Raises:
        ValueError: as :func:`make_private`; a non-positive ``target_epsilon`` or
            ``epochs``, a ``target_delta`` outside (0, 1).
    """
    _require()
    import warnings

    from opacus.accountants.utils import get_noise_multiplier

    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon!r}")
    if not (isinstance(target_delta, (int, float)) and 0 < target_delta < 1):
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    if len(privacy_engine.accountant) > 0:
        warnings.warn(
            "make_private_with_epsilon: privacy budget already spent on this engine; the "
            "noise multiplier assumes zero starting point",
            stacklevel=2,
        )
    sigma = get_noise_multiplier(
        target_epsilon=target_epsilon, target_delta=target_delta,
        sample_rate=1 / len(data_loader), epochs=epochs,
        accountant=privacy_engine.accountant.mechanism(),
    )  # fmt: skip
    return make_private(
        privacy_engine, module=module, optimizer=optimizer, data_loader=data_loader,
        noise_multiplier=sigma, max_grad_norm=max_grad_norm, **kwargs,
    )  # fmt: skip


def fix(module: nn.Module, *, num_groups: int = 32) -> nn.Module:
    """A copy of ``module`` with every BatchNorm layer replaced by GroupNorm —
    including BatchNorm subclasses with their own forward (a norm + activation layer
    such as timm's ``BatchNormAct2d``), whose child modules (activation, dropout)
    follow the GroupNorm in their registration order.

    Opacus' ``ModuleValidator.fix`` finds fixers by exact type, so it leaves such
    subclasses in place (and ``make_private`` then refuses the model).

    Args:
        module: the model (not changed).
        num_groups: the GroupNorm's groups: ``gcd(num_groups, channels)`` (as Opacus).

    Returns:
        The converted copy; a layer with ``affine=False`` gets a GroupNorm without
        affine parameters.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
        ValueError: if ``num_groups`` is not a positive integer.
    """
    import copy
    import math

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(f"num_groups must be a positive integer, got {num_groups!r}")

    def convert(bn):
        c = bn.num_features
        gn = nn.GroupNorm(math.gcd(num_groups, c), c, eps=bn.eps, affine=bn.affine)
        gn = gn.to(device=bn.weight.device if bn.affine else None,
                   dtype=bn.weight.dtype if bn.affine else None)  # fmt: skip
        rest = list(bn.children())
        return nn.Sequential(gn, *rest) if rest else gn

    def walk(parent):
        for name, child in parent.named_children():
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                setattr(parent, name, convert(child))
            else:
                walk(child)

    copied = copy.deepcopy(module)
    if isinstance(copied, nn.modules.batchnorm._BatchNorm):
        return convert(copied)
    walk(copied)
    return copied
