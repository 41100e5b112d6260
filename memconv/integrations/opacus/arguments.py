"""``make_private``'s arguments, with Opacus' names: checked before any work, and
translated into memconv's clipping settings (:class:`ClipSettings`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from ..._checks import (
    check_budget,
    check_choice,
    check_clip_route,
    check_route,
    check_threshold,
)
from ...engine.prepared import check_per_sample_model
from .private_module import PrivateModule, unwrap_parallel

#: Clipping modes :func:`~memconv.integrations.opacus.make_private` accepts (Opacus' names).
CLIPPINGS = ("flat", "per_layer", "adaptive")
_REDUCTIONS = ("mean", "sum")
#: The arguments of ``clipping="adaptive"`` (Opacus' ``AdaClipDPOptimizer``'s names).
ADAPTIVE_ARGS = (
    "target_unclipped_quantile",
    "clipbound_learning_rate",
    "max_clipbound",
    "min_clipbound",
    "unclipped_num_std",
)


@dataclass(frozen=True)
class ClipSettings:
    """How the private module clips: ``make_private``'s clipping arguments, checked and
    translated (:func:`check_arguments`).

    Attributes:
        clipping: one of :data:`CLIPPINGS`.
        max_grad_norm: the threshold C as given; with ``"per_layer"`` the list of
            thresholds, one per trainable parameter of the optimizer in its order;
            with ``"adaptive"`` the first threshold.
        loss_reduction: ``"mean"`` or ``"sum"``, the criterion's reduction.
        strategy, memory_budget, norm_route, clip_route: for
            :func:`memconv.clip_and_accumulate`.
        adaptive_args: ``{name: value}`` for the names of :data:`ADAPTIVE_ARGS`
            (None where not given).
        thresholds: with ``"per_layer"``, ``{parameter name: threshold}`` once
            translated; else None.
    """

    clipping: str
    max_grad_norm: float | list[float]
    loss_reduction: str
    strategy: str | bool | None
    memory_budget: int | str | None
    norm_route: str | None
    clip_route: str | None
    adaptive_args: Mapping[str, float | None]
    thresholds: dict[str, float] | None = None

    #: The fields that are ``make_private``'s arguments of the same names.
    GIVEN: ClassVar[tuple[str, ...]] = (
        "clipping",
        "max_grad_norm",
        "loss_reduction",
        "strategy",
        "memory_budget",
        "norm_route",
        "clip_route",
    )

    @property
    def groups(self) -> str:
        """``groups`` of :func:`memconv.clip_and_accumulate`: each parameter its own
        with ``"per_layer"``, else all together."""
        return "parameter" if self.thresholds is not None else "all"

    @property
    def max_norm(self) -> float | dict[str, float]:
        """``max_norm`` of :func:`memconv.clip_and_accumulate`: the thresholds by
        parameter name with ``"per_layer"``, else C."""
        return self.thresholds if self.thresholds is not None else self.max_grad_norm

    @property
    def clip_options(self) -> dict:
        """The other options of :func:`memconv.clip_and_accumulate`."""
        return dict(
            strategy=self.strategy,
            memory_budget=self.memory_budget,
            norm_route=self.norm_route,
            clip_route=self.clip_route,
        )

    def sensitivity(self) -> float:
        """How far one sample moves the clipped sum, which the noise scales with: C,
        or with ``"per_layer"`` the thresholds' L2 norm as Opacus'
        ``DPPerLayerOptimizer`` computes it (in float32)."""
        if self.thresholds is None:
            return self.max_grad_norm
        return torch.norm(torch.Tensor(list(self.max_grad_norm)), p=2).item()


def check_arguments(
    privacy_engine,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: ClipSettings,
    batch_first: bool,
    noise_generator,
    options: Mapping,
) -> ClipSettings:
    """Check ``make_private``'s arguments before any work, and translate them.

    Args:
        privacy_engine, module, optimizer, batch_first, noise_generator: as
            :func:`~memconv.integrations.opacus.make_private`.
        settings: the clipping arguments as given.
        options: the keyword arguments left for Opacus' optimizer.

    Returns:
        ``settings`` with, under ``"per_layer"``, the thresholds keyed by parameter name.

    Raises:
        TypeError, ValueError: as :func:`~memconv.integrations.opacus.make_private`.
    """
    _refuse_hook_options(options)
    if noise_generator is not None and getattr(privacy_engine, "secure_mode", False):
        raise ValueError("noise_generator cannot be passed in secure mode")
    _check_types(privacy_engine, module, optimizer)
    norms = _check_clipping(settings)
    if batch_first is not True:
        raise ValueError("batch_first must be True: memconv takes the batch axis first")
    inner = _check_model(module, optimizer)
    if settings.clipping != "per_layer":
        return settings
    return replace(settings, thresholds=_per_layer_thresholds(inner, optimizer, norms))


#: Opacus' ``grad_sample_mode`` values; memconv's pass replaces each of them.
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost", "ghost_fsdp", "no_op")


def _refuse_hook_options(options: dict) -> None:
    """Check Opacus' hook options: any ``grad_sample_mode`` of Opacus' is accepted (and
    taken out of ``options``); ``wrap_model`` must be True.

    Raises:
        ValueError: an unknown mode, or ``wrap_model=False``.
    """
    mode = options.pop("grad_sample_mode", "hooks")
    check_choice(mode, GRAD_SAMPLE_MODES, "grad_sample_mode", none=False)
    if options.pop("wrap_model", True) is not True:
        raise ValueError(
            "wrap_model=False is Opacus' hooks-only mode; memconv's private path returns "
            "the wrapped model (its backward adds the clipped sum)"
        )


def _check_types(privacy_engine, module, optimizer) -> None:
    """Raise unless the engine, model and optimizer are of the types accepted."""
    from opacus import PrivacyEngine

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


def _check_clipping(settings: ClipSettings) -> list[float] | None:
    """Raise unless the clipping mode, its arguments, the thresholds, the reduction and
    the clip options are accepted.

    Returns:
        With ``"per_layer"`` the thresholds as floats, in the optimizer's order; else None.
    """
    clipping = settings.clipping
    if not isinstance(clipping, str) or clipping not in CLIPPINGS:
        raise ValueError(
            f"unknown clipping={clipping!r}; accepted: {', '.join(map(repr, CLIPPINGS))}"
        )
    given = [k for k, v in settings.adaptive_args.items() if v is not None]
    if clipping != "adaptive" and given:
        raise ValueError(
            f"{given[0]} is an argument of clipping='adaptive', not of clipping={clipping!r}"
        )
    missing = [k for k in ADAPTIVE_ARGS if settings.adaptive_args.get(k) is None]
    if clipping == "adaptive" and missing:
        raise ValueError(f"clipping='adaptive' needs {', '.join(missing)}")
    norms = _check_max_grad_norm(settings.max_grad_norm, clipping)
    if settings.loss_reduction not in _REDUCTIONS:
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {settings.loss_reduction!r}")
    check_budget(settings.memory_budget)
    check_route(settings.norm_route)
    check_clip_route(settings.clip_route)
    return norms


def _check_max_grad_norm(max_grad_norm, clipping: str) -> list[float] | None:
    """Raise unless ``max_grad_norm`` is a threshold (a list of them with
    ``"per_layer"``), each positive and finite.

    Returns:
        With ``"per_layer"`` the thresholds as floats; else None.
    """
    if clipping == "per_layer":
        if not isinstance(max_grad_norm, (list, tuple)):
            raise TypeError(
                "max_grad_norm must be a list of thresholds, one per trainable parameter of "
                f"optimizer in its order, with clipping='per_layer'; got {max_grad_norm!r}"
            )
        return [check_threshold(c, f"max_grad_norm[{i}]") for i, c in enumerate(max_grad_norm)]
    try:
        check_threshold(max_grad_norm, "max_grad_norm")
    except TypeError as err:  # make_private raises ValueError for any value but a threshold
        raise ValueError(str(err)) from None  # (a list included: only "per_layer" takes one)
    return None


def _check_model(module: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
    """Raise unless the optimizer's parameters are the model's and memconv can treat
    every layer per sample (a BatchNorm in training mode: the message names :func:`fix`).

    Returns:
        The model a ``DPDDP`` wraps (or ``module``).
    """
    params = set(module.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in params:
                raise ValueError("optimizer holds parameters that are not module's")
    inner = unwrap_parallel(module)
    try:
        check_per_sample_model(inner, argument="module")
    except ValueError as err:
        batch_norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
        if any(isinstance(m, batch_norms) for m in inner.modules()):
            raise ValueError(
                f"{err}; memconv.integrations.opacus.fix(module) replaces every BatchNorm "
                "by a GroupNorm (as Opacus' ModuleValidator.fix)"
            ) from None
        raise
    return inner


def _per_layer_thresholds(
    inner: nn.Module, optimizer: torch.optim.Optimizer, norms: list[float]
) -> dict[str, float]:
    """``{parameter name: threshold}``, pairing the thresholds with the optimizer's
    trainable parameters in its order, as Opacus' ``DPPerLayerOptimizer`` does.

    Raises:
        ValueError: not one threshold per trainable optimizer parameter, or a trainable
            parameter of the model missing from the optimizer.
    """
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
    return thresholds


def check_epsilon_arguments(target_epsilon, target_delta, epochs) -> None:
    """Raise unless ``make_private_with_epsilon``'s privacy target is accepted.

    Raises:
        ValueError: a non-positive ``target_epsilon`` or ``epochs`` (or ``epochs`` not an
            integer), a ``target_delta`` outside (0, 1).
    """
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon!r}")
    if not (isinstance(target_delta, (int, float)) and 0 < target_delta < 1):
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
