"""A training step's per-sample computations, made once per model and called every step.

:class:`PrivateStep` holds a model, its loss and the settings, and runs
:func:`memconv.per_sample_grads`, :func:`memconv.per_sample_norms` and
:func:`memconv.clip_and_accumulate` on each batch. Between calls it keeps what the
public functions work out before their passes — the model's checks, the probe of
its layer calls and the memory plan — and makes them again only when something they
depend on changed (:mod:`memconv.engine.prepared` lists what). The numbers are those of
the plain functions, which keep the same per model (:func:`memconv.engine.prepared.kept_for`)
and make it afresh when anything changed.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .._checks import (
    AVAILABLE,
    check_budget,
    check_callable,
    check_clip_route,
    check_module,
    check_route,
)
from .._torch import not_traced
from ..conv.settings import use_block_settings
from ..engine.planning import Plan
from ..engine.prepared import Prepared
from ..engine.request import Batch
from .clipping import clip_with
from .grads import grads_with
from .norms import norms_with


class PrivateStep:
    """Per-sample gradients, norms and clipped sums of one model, step after step.

    Example:
        >>> step = memconv.PrivateStep(model, nn.CrossEntropyLoss(), memory_budget=None)
        >>> for x, y in loader:
        ...     optimizer.zero_grad()
        ...     norms = step.clip_and_accumulate(x, y, max_norm=1.0)
        ...     optimizer.step()

    Args:
        model: as :func:`memconv.per_sample_grads` (a ``DistributedDataParallel``
            wrapper, for the norms and clipped sums).
        loss_fn: called as ``loss_fn(output[n:n+1], targets[n:n+1])``; must return a
            scalar tensor.
        strategy: as :func:`memconv.per_sample_grads` (None: the
            :class:`memconv.save_memory` block open at each call, or ``"auto"``).
        memory_budget: as :func:`memconv.per_sample_grads`.
        norm_route: as :func:`memconv.per_sample_norms`.
        clip_route: as :func:`memconv.clip_and_accumulate`.

    Attributes:
        model, loss_fn, strategy, memory_budget, norm_route, clip_route: as given;
            assigning one makes the next call plan afresh.

    Raises:
        TypeError: ``model`` not a module, ``loss_fn`` not callable, a bad
            ``memory_budget``.
        ValueError: an unknown ``strategy``, ``norm_route`` or ``clip_route``; a bad
            ``memory_budget``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        *,
        strategy: str | bool | None = None,
        memory_budget: int | str | None = AVAILABLE,
        norm_route: str | None = None,
        clip_route: str | None = None,
    ):
        check_module(model)
        check_callable(loss_fn, "loss_fn")
        use_block_settings(strategy)
        check_budget(memory_budget)
        check_route(norm_route)
        check_clip_route(clip_route)
        self.model = model
        self.loss_fn = loss_fn
        self.strategy = strategy
        self.memory_budget = memory_budget
        self.norm_route = norm_route
        self.clip_route = clip_route
        self._prepared = Prepared()

    @property
    def plan(self) -> Plan | None:
        """The :class:`memconv.Plan` the last call ran by (None before the first call, or
        after one that needed none: an empty batch, a model that streams)."""
        return self._prepared.plan

    @property
    def probes(self) -> int:
        """How many times the model was probed so far (two forward passes each)."""
        return self._prepared.probes

    @property
    def plans(self) -> int:
        """How many plans were made so far."""
        return self._prepared.plans

    @not_traced
    def per_sample_grads(self, inputs: Tensor, targets: Tensor) -> dict[str, Tensor]:
        """:func:`memconv.per_sample_grads` of the step's model and loss.

        Args:
            inputs: ``[N, ...]``.
            targets: ``[N, ...]``.

        Returns:
            ``{name: Tensor [N, *param.shape]}``, as :func:`memconv.per_sample_grads`.

        Raises:
            As :func:`memconv.per_sample_grads`.
        """
        return self._call(grads_with, inputs, targets)

    @not_traced
    def per_sample_norms(
        self,
        inputs: Tensor,
        targets: Tensor,
        *,
        per_parameter: bool = False,
        groups="all",
        sample_mask: Tensor | None = None,
    ):
        """:func:`memconv.per_sample_norms` of the step's model and loss.

        Args:
            inputs: ``[N, ...]``.
            targets: ``[N, ...]``.
            per_parameter: return ``{name: [N]}`` instead of the total norms.
            groups: as :func:`memconv.per_sample_norms` (``"all"``, ``"layer"``,
                ``"parameter"`` or ``{parameter name: group}``).
            sample_mask: None, or a ``torch.bool`` tensor ``[N]`` on the inputs'
                device, False for the padding of a batch padded to a fixed size
                (masked DP-SGD, Beltran et al. 2024), as :func:`memconv.per_sample_norms`.

        Returns:
            ``[N]`` norms, or ``{name: [N]}``, or ``{group: [N]}`` (0 for a padded
            sample).

        Raises:
            As :func:`memconv.per_sample_norms`.
        """
        return self._call(
            norms_with,
            inputs,
            targets,
            per_parameter=per_parameter,
            groups=groups,
            sample_mask=sample_mask,
        )

    @not_traced
    def clip_and_accumulate(
        self,
        inputs: Tensor,
        targets: Tensor,
        *,
        max_norm: float | dict,
        groups="all",
        sample_mask: Tensor | None = None,
    ):
        """:func:`memconv.clip_and_accumulate` of the step's model and loss: adds the
        clipped sum to every trainable parameter's ``.grad``.

        Args:
            inputs: ``[N, ...]``.
            targets: ``[N, ...]``.
            max_norm: the clipping threshold C (positive, finite), or ``{group: C_g}``.
            groups: as :func:`memconv.clip_and_accumulate`.
            sample_mask: None, or a ``torch.bool`` tensor ``[N]`` on the inputs'
                device: the padded samples (False) of a Poisson batch padded to a fixed
                size add nothing (masked DP-SGD, Beltran et al. 2024), as
                :func:`memconv.clip_and_accumulate`.

        Returns:
            The per-sample norms ``[N]`` before clipping, or ``{group: [N]}`` (0 for a
            padded sample).

        Raises:
            As :func:`memconv.clip_and_accumulate`.
        """
        return self._call(
            clip_with,
            inputs,
            targets,
            max_norm=max_norm,
            clip_route=self.clip_route,
            groups=groups,
            sample_mask=sample_mask,
        )

    def _call(self, call_with, inputs, targets, **options):
        """``call_with`` (a public function's ``*_with`` form) on the step's model, loss,
        settings and what was kept from the last call."""
        if call_with is not grads_with:
            options["norm_route"] = self.norm_route
        given = Batch(self.model, self.loss_fn, inputs, targets)
        options.update(strategy=self.strategy, memory_budget=self.memory_budget)
        return call_with(self._prepared, given, **options)
