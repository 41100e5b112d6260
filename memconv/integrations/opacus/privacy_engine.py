"""The private-training entry points: :func:`make_private` and
:func:`make_private_with_epsilon`, Opacus' ``PrivacyEngine`` methods with memconv's
clipped sum — each a short recipe of the steps of the other files (arguments, private
module, adaptive clipping) and of Opacus' own data loader, optimizer and accountant."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ...tasks.adaptive import AdaptiveClipping
from .adaptive import adaclip_optimizer_class, adaptive_state
from .arguments import ADAPTIVE_ARGS, ClipSettings, check_arguments, check_epsilon_arguments
from .private_module import PrivateModule
from .samplers import require_opacus


@dataclass(frozen=True)
class NoiseSettings:
    """What Opacus' DP optimizer takes besides the clipping: its noise and scaling.

    Attributes:
        noise_multiplier: σ, the noise's standard deviation over the sensitivity.
        generator: the ``torch.Generator`` of the noise, or None.
        expected_batch_size: the samples a step expects (per process when
            distributed): the data set's size times the sampling rate.
        distributed: whether the model is a ``DPDDP`` or ``DistributedDataParallel``.
    """

    noise_multiplier: float
    generator: torch.Generator | None
    expected_batch_size: float
    distributed: bool


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
    grad_sample_mode: str = "hooks",
    wrap_model: bool = True,
    target_unclipped_quantile: float | None = None,
    clipbound_learning_rate: float | None = None,
    max_clipbound: float | None = None,
    min_clipbound: float | None = None,
    unclipped_num_std: float | None = None,
    **kwargs,
):
    """Opacus' ``PrivacyEngine.make_private`` with memconv's clipped sum in place of
    Opacus' per-sample hooks.

    The recipe: :func:`~memconv.integrations.opacus.arguments.check_arguments` (check
    the arguments and translate them into
    :class:`~memconv.integrations.opacus.arguments.ClipSettings`) →
    :func:`~memconv.integrations.opacus.adaptive.adaptive_state` → ``_wrap_model``
    (:class:`~memconv.integrations.opacus.PrivateModule`) → Opacus' data loader →
    ``_build_optimizer`` (flat, per-layer or adaptive) → ``_attach_accountant`` → what
    Opacus returns.

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

    Fixed shapes (masked DP-SGD, Beltran et al. 2024): wrap the returned loader in
    :class:`~memconv.integrations.opacus.FixedSizePoissonLoader` to get each Poisson
    batch padded to a fixed size with the mask of its real samples, and call the
    model as ``model(x, sample_mask=mask)``: the padding adds nothing to ``.grad``
    (:class:`~memconv.integrations.opacus.PrivateModule`); the accounting, the noise
    and the division by the expected batch size do not change.

    The criterion must reduce per-sample losses by ``loss_reduction`` over the
    batch axis, each depending on its sample's output only (``CrossEntropyLoss``,
    ``MSELoss``, ...). Cost: the user's forward pass, recorded, and one backward pass
    that memconv drives from ``∂L/∂output`` (dropout keeps the mask the forward pass
    drew).

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
        criterion: returned as it is with a ghost ``grad_sample_mode`` (Opacus returns
            its criterion there; memconv's backward pass needs no wrapper around it).
        grad_sample_mode: any of Opacus' (``"hooks"``, the default, ``"functorch"``,
            ``"ew"``, ``"ghost"``, ``"ghost_fsdp"``, ``"no_op"``): memconv's pass
            replaces all of them; a ghost mode returns four values, as Opacus does.
        wrap_model: must be True (the returned model is the private module).
        target_unclipped_quantile: with ``"adaptive"``, the target fraction of
            unclipped samples (required with ``"adaptive"``, refused otherwise, as
            are the four below; each as Opacus' ``AdaClipDPOptimizer`` takes it).
        clipbound_learning_rate: the threshold's geometric learning rate.
        max_clipbound: the threshold's upper bound.
        min_clipbound: the threshold's lower bound.
        unclipped_num_std: the standard deviation of the count's noise.
        **kwargs: passed to Opacus' optimizer.

    Returns:
        ``(model, optimizer, data_loader)`` as ``make_private`` returns them (with a
        ghost ``grad_sample_mode``: ``(model, optimizer, criterion, data_loader)``): the model is a
        :class:`~memconv.integrations.opacus.PrivateModule`, the optimizer Opacus'
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
            (named, e.g. BatchNorm in training mode: convert with
            :func:`~memconv.integrations.opacus.fix`); a dropout layer with p > 0; an
            unknown ``norm_route`` or ``clip_route``, a ``memory_budget`` other than a
            positive int, ``"available"`` or None (a TypeError for a non-integer);
            ``batch_first`` not True; ``noise_generator`` in secure mode. All before
            any work.
    """
    given = locals()
    require_opacus()
    requested = ClipSettings(
        **{name: given[name] for name in ClipSettings.GIVEN},
        adaptive_args={name: given[name] for name in ADAPTIVE_ARGS},
    )
    clip = check_arguments(
        privacy_engine,
        module=module,
        optimizer=optimizer,
        settings=requested,
        batch_first=batch_first,
        noise_generator=noise_generator,
        options=dict(kwargs, grad_sample_mode=grad_sample_mode, wrap_model=wrap_model),
    )
    distributed = _is_distributed(module)
    state = adaptive_state(clip, noise_multiplier=noise_multiplier, distributed=distributed)
    model = _wrap_model(module, clip=clip, state=state)
    data_loader = privacy_engine._prepare_data_loader(
        data_loader,
        distributed=distributed,
        poisson_sampling=poisson_sampling,
        batch_first=batch_first,
        rand_on_empty=rand_on_empty,
    )
    noise = NoiseSettings(
        noise_multiplier=noise_multiplier,
        generator=noise_generator,
        expected_batch_size=_expected_batch_size(data_loader, distributed),
        distributed=distributed,
    )
    dp_optimizer = _build_optimizer(
        privacy_engine, optimizer, clip=clip, noise=noise, state=state, options=kwargs
    )
    _attach_accountant(privacy_engine, dp_optimizer, data_loader)
    if "ghost" in grad_sample_mode:  # Opacus returns its criterion there too
        return model, dp_optimizer, _criterion(criterion), data_loader
    return model, dp_optimizer, data_loader


def _criterion(criterion):
    """The criterion returned with a ghost ``grad_sample_mode``: the user's (memconv's
    backward pass clips whatever reduces the batch), or Opacus' default."""
    return nn.CrossEntropyLoss() if criterion is None else criterion


def _is_distributed(module: nn.Module) -> bool:
    """Whether ``module`` is a ``DPDDP`` or ``DistributedDataParallel`` (each process
    then clips its own samples, and Opacus' distributed optimizer sums them)."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, (DPDDP, DistributedDataParallel))


def _wrap_model(
    module: nn.Module, *, clip: ClipSettings, state: AdaptiveClipping | None
) -> PrivateModule:
    """The :class:`~memconv.integrations.opacus.PrivateModule` clipping as ``clip``
    says, with the adaptive ``state`` (or None)."""
    return PrivateModule(
        module,
        max_grad_norm=clip.max_norm,
        loss_reduction=clip.loss_reduction,
        clip_options=clip.clip_options,
        groups=clip.groups,
        adaptive=state,
    )


def _expected_batch_size(data_loader, distributed: bool) -> float:
    """The data set's size times the sampling rate ``1/len(data_loader)`` (over the
    world size when distributed), as Opacus' ``make_private`` computes it."""
    expected = int(len(data_loader.dataset) * (1 / len(data_loader)))
    if distributed:
        expected /= torch.distributed.get_world_size()
    return expected


def _build_optimizer(
    privacy_engine,
    optimizer,
    *,
    clip: ClipSettings,
    noise: NoiseSettings,
    state: AdaptiveClipping | None,
    options: dict,
):
    """Opacus' DP optimizer around ``optimizer``: adaptive (with ``state``), per-layer
    or flat clipping, each taking the clipped sum the private module added to ``.grad``.

    Args:
        privacy_engine: the ``opacus.PrivacyEngine`` (its secure mode and RNG).
        optimizer: the user's optimizer.
        clip: the checked clipping settings.
        noise: the noise and scaling.
        state: the :class:`memconv.AdaptiveClipping` state, or None.
        options: the other keyword arguments of Opacus' optimizer.
    """
    if state is not None:
        return _adaptive_optimizer(
            privacy_engine, optimizer, clip=clip, noise=noise, state=state, options=options
        )
    if clip.thresholds is not None:
        return _per_layer_optimizer(
            privacy_engine, optimizer, clip=clip, noise=noise, options=options
        )
    return _flat_optimizer(privacy_engine, optimizer, clip=clip, noise=noise, options=options)


def _per_layer_optimizer(
    privacy_engine, optimizer, *, clip: ClipSettings, noise: NoiseSettings, options: dict
):
    """The flat optimizer, its noise scaled with the thresholds' L2 norm, and its
    ``max_grad_norms`` the thresholds (as Opacus' ``DPPerLayerOptimizer``)."""
    dp_optimizer = _flat_optimizer(
        privacy_engine, optimizer, clip=clip, noise=noise, options=options
    )
    dp_optimizer.max_grad_norms = list(clip.max_grad_norm)
    return dp_optimizer


def _flat_optimizer(
    privacy_engine, optimizer, *, clip: ClipSettings, noise: NoiseSettings, options: dict
):
    """Opacus' ``DPOptimizerFastGradientClipping`` (or its distributed version), its
    noise scaled with the sensitivity (with per-layer clipping the thresholds' L2 norm
    as Opacus' ``DPPerLayerOptimizer`` computes it)."""
    return privacy_engine._prepare_optimizer(
        optimizer=optimizer,
        noise_multiplier=noise.noise_multiplier,
        max_grad_norm=clip.sensitivity(),
        expected_batch_size=noise.expected_batch_size,
        loss_reduction=clip.loss_reduction,
        noise_generator=noise.generator,
        distributed=noise.distributed,
        clipping="flat",
        grad_sample_mode="ghost",
        **options,
    )


def _adaptive_optimizer(
    privacy_engine,
    optimizer,
    *,
    clip: ClipSettings,
    noise: NoiseSettings,
    state: AdaptiveClipping | None,
    options: dict,
):
    """``AdaClipDPOptimizerFastGradientClipping`` sharing ``state`` with the private
    module; its generator the engine's secure RNG in secure mode."""
    from opacus.optimizers import DPOptimizer

    if isinstance(optimizer, DPOptimizer):  # as Opacus' _prepare_optimizer
        optimizer = optimizer.original_optimizer
    secure = privacy_engine.secure_mode
    return adaclip_optimizer_class()(
        optimizer,
        clipping=state,
        expected_batch_size=noise.expected_batch_size,
        loss_reduction=clip.loss_reduction,
        secure_mode=secure,
        generator=privacy_engine.secure_rng if secure else noise.generator,
        **options,
    )


def _attach_accountant(privacy_engine, dp_optimizer, data_loader) -> None:
    """The engine's accountant as a step hook of the optimizer, at sampling rate
    ``1/len(data_loader)``."""
    dp_optimizer.attach_step_hook(
        privacy_engine.accountant.get_optimizer_hook_fn(sample_rate=1 / len(data_loader))
    )


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
    require_opacus()
    from opacus.accountants.utils import get_noise_multiplier

    check_epsilon_arguments(target_epsilon, target_delta, epochs)
    if len(privacy_engine.accountant) > 0:
        warnings.warn(
            "make_private_with_epsilon: privacy budget already spent on this engine; the "
            "noise multiplier assumes zero starting point",
            stacklevel=2,
        )
    sigma = get_noise_multiplier(
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sample_rate=1 / len(data_loader),
        epochs=epochs,
        accountant=privacy_engine.accountant.mechanism(),
    )
    return make_private(
        privacy_engine,
        module=module,
        optimizer=optimizer,
        data_loader=data_loader,
        noise_multiplier=sigma,
        max_grad_norm=max_grad_norm,
        **kwargs,
    )
