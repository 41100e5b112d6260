"""Adaptive clipping on the private path (Andrew et al., NeurIPS 2021; Opacus'
``AdaClipDPOptimizer``): the :class:`memconv.AdaptiveClipping` state the private
module clips with and counts into, and the Opacus optimizer that shares it."""

from __future__ import annotations

from ...tasks.adaptive import AdaptiveClipping
from .arguments import ADAPTIVE_ARGS, ClipSettings

_ADACLIP: type | None = None


def adaptive_state(
    settings: ClipSettings, *, noise_multiplier: float, distributed: bool
) -> AdaptiveClipping | None:
    """The adaptive threshold's state for ``clipping="adaptive"`` (else None).

    Args:
        settings: the checked clipping settings (the first threshold, the adaptive
            arguments).
        noise_multiplier: σ, the one the accountant uses.
        distributed: whether the model is a ``DPDDP`` or ``DistributedDataParallel``.

    Raises:
        ValueError: with ``distributed`` (as in Opacus: the count of unclipped samples
            is per process); an adaptive argument out of range (Opacus' checks, by
            :class:`memconv.AdaptiveClipping`).
        TypeError: an adaptive argument not a number.
    """
    if settings.clipping != "adaptive":
        return None
    if distributed:
        raise ValueError(
            "clipping='adaptive' is not supported with DPDDP or DistributedDataParallel "
            "(as in Opacus): the count of unclipped samples is per process"
        )
    return AdaptiveClipping(
        max_norm=settings.max_grad_norm,
        noise_multiplier=noise_multiplier,
        **settings.adaptive_args,
    )


def adaclip_optimizer_class() -> type:
    """:class:`AdaClipDPOptimizerFastGradientClipping`: the steps of
    :class:`_AdaClipSteps` on Opacus' ``DPOptimizerFastGradientClipping``, built on
    first use (Opacus is imported only then)."""
    global _ADACLIP
    if _ADACLIP is None:
        from opacus.optimizers import DPOptimizerFastGradientClipping

        _ADACLIP = type(
            "AdaClipDPOptimizerFastGradientClipping",
            (_AdaClipSteps, DPOptimizerFastGradientClipping),
            {"__doc__": _AdaClipSteps.__doc__, "__module__": __name__},
        )
    return _ADACLIP


class _AdaClipSteps:
    """Opacus' ``AdaClipDPOptimizer`` on a clipped sum computed elsewhere: Opacus'
    fast-gradient-clipping optimizer (its accumulation, step skipping, scaling and
    accountant hook) with the adaptive threshold of a shared
    :class:`memconv.AdaptiveClipping` state, which
    :class:`~memconv.integrations.opacus.PrivateModule` clips with and counts into.

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

    def __init__(
        self,
        optimizer,
        *,
        clipping: AdaptiveClipping,
        expected_batch_size,
        loss_reduction="mean",
        generator=None,
        secure_mode=False,
        **kwargs,
    ):
        self.clipping = clipping
        super().__init__(
            optimizer,
            noise_multiplier=clipping.noise_multiplier,
            max_grad_norm=clipping.max_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=secure_mode,
            **kwargs,
        )

    def add_noise(self):
        from opacus.optimizers.optimizer import (
            _check_processed_flag,
            _generate_noise,
            _mark_as_processed,
        )

        std = self.clipping.gradient_noise_std()
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = _generate_noise(
                std=std,
                reference=p.summed_grad,
                generator=self.generator,
                secure_mode=self.secure_mode,
            )
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


def _state_field(field: str) -> property:
    """An attribute read from and written to the optimizer's ``clipping`` state."""

    def get(self):
        return getattr(self.clipping, field)

    def put(self, value):
        setattr(self.clipping, field, value)

    return property(get, put, doc=f"The state's ``{field}``.")


_AdaClipSteps.max_grad_norm = _state_field("max_norm")
for _field in (*ADAPTIVE_ARGS, "sample_size", "unclipped_num"):
    setattr(_AdaClipSteps, _field, _state_field(_field))
del _field
