"""Adaptive clipping: the threshold follows a quantile of the per-sample norms.

Andrew et al., "Differentially Private Learning with Adaptive Clipping" (NeurIPS 2021,
Algorithm 1 with the geometric update): each step counts the samples whose norm the
threshold C did not clip, adds Gaussian noise of standard deviation σ_b to that count,
and moves the threshold geometrically towards the target quantile γ,

    C ← C · exp(−η · (b̃/N − γ)),    b̃ the noisy count of unclipped samples,

kept within ``[min_clipbound, max_clipbound]``. The count costs privacy too: the
gradient noise is drawn with the multiplier σ_eff = (σ⁻² − (2σ_b)⁻²)^(−1/2) (Theorem 1)
so that the pair spends what σ alone would, and the accounting stays the optimizer's,
with σ. This follows Opacus' ``AdaClipDPOptimizer`` line for line (its names, checks
and order of random draws), with memconv's clip factors: a sample is unclipped when
its norm is at most C (Opacus' factor C/(‖g‖+10⁻⁶) calls a norm within 10⁻⁶ below C
clipped).

One step of a DP optimizer with :class:`AdaptiveClipping` ``state``::

    norms = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=state.max_norm)
    state.count(norms)                        # every micro-batch of the logical batch
    std = state.gradient_noise_std()          # σ_eff · C
    for p in params:                          # as Opacus: parameters' noise first,
        p.grad += torch.normal(0, std, p.shape, device=p.device, generator=gen)
    state.add_count_noise(generator=gen)      # then the count's
    ...                                       # scale by the expected batch size, step
    state.update()                            # the new C, once the step is taken
    state.reset()                             # with zero_grad
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._checks import check_finite_number, check_sample_mask, check_threshold


@dataclass
class AdaptiveClipping:
    """The state of adaptive clipping (Andrew et al., NeurIPS 2021; Opacus'
    ``AdaClipDPOptimizer``), with its arguments' names.

    Attributes:
        max_norm: the current threshold C.
        noise_multiplier: σ, the one the accounting uses.
        target_unclipped_quantile: γ, the fraction of samples to leave unclipped.
        clipbound_learning_rate: η of the geometric update.
        max_clipbound: the largest threshold.
        min_clipbound: the smallest threshold.
        unclipped_num_std: σ_b, the noise on the count of unclipped samples.
        sample_size: samples counted since :meth:`reset`.
        unclipped_num: how many of them were unclipped (a float once noised).

    Raises:
        TypeError, ValueError: (at construction) a threshold or bound not positive and
            finite, ``min_clipbound`` not below ``max_clipbound``, γ outside [0, 1],
            η or σ negative, or ``noise_multiplier`` not below ``2 * unclipped_num_std``
            (Theorem 1 of Andrew et al., as Opacus checks).
    """

    max_norm: float
    noise_multiplier: float
    target_unclipped_quantile: float
    clipbound_learning_rate: float
    max_clipbound: float
    min_clipbound: float
    unclipped_num_std: float
    sample_size: int = 0
    unclipped_num: float = 0

    def __post_init__(self):
        self.max_norm = check_threshold(self.max_norm, "max_norm")
        self.max_clipbound = check_threshold(self.max_clipbound, "max_clipbound")
        self.min_clipbound = check_threshold(self.min_clipbound, "min_clipbound")
        for name in ("noise_multiplier", "target_unclipped_quantile"):
            setattr(self, name, check_finite_number(getattr(self, name), name))
        for name in ("clipbound_learning_rate", "unclipped_num_std"):
            setattr(self, name, check_finite_number(getattr(self, name), name))
        if self.max_clipbound <= self.min_clipbound:
            raise ValueError("max_clipbound must be larger than min_clipbound")
        if not 0 <= self.target_unclipped_quantile <= 1:
            raise ValueError(
                "target_unclipped_quantile must lie in [0, 1], got "
                f"{self.target_unclipped_quantile!r}"
            )
        if self.clipbound_learning_rate < 0:
            raise ValueError(
                f"clipbound_learning_rate must be >= 0, got {self.clipbound_learning_rate!r}"
            )
        if self.noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier!r}")
        if self.noise_multiplier >= 2 * self.unclipped_num_std:
            raise ValueError(
                "noise_multiplier must be smaller than 2 * unclipped_num_std (Theorem 1 of "
                "Andrew et al., 2021)"
            )

    def count(self, norms: Tensor, sample_mask: Tensor | None = None) -> None:
        """Count the samples of a (micro-)batch and those the threshold left unclipped.

        Args:
            norms: the per-sample norms ``[N]`` before clipping, as
                :func:`memconv.clip_and_accumulate` returns them with
                ``max_norm=self.max_norm``.
            sample_mask: None, or the ``torch.bool`` mask ``[N]`` the norms were taken
                with (masked DP-SGD, Beltran et al. 2024): only the real samples (True)
                are counted, not the padding.

        Raises:
            TypeError: ``norms`` not a 1-d tensor; a ``sample_mask`` not a bool tensor.
            ValueError: a ``sample_mask`` not ``[N]`` on the norms' device.
        """
        if not isinstance(norms, Tensor) or norms.dim() != 1:
            raise TypeError(f"norms must be a 1-d tensor of per-sample norms, got {norms!r}")
        check_sample_mask(sample_mask, len(norms), norms.device)
        if sample_mask is None:
            self.sample_size += len(norms)
            self.unclipped_num += int((norms <= self.max_norm).sum())
            return
        counts = torch.stack([sample_mask.sum(), (sample_mask & (norms <= self.max_norm)).sum()])
        real, unclipped = counts.tolist()  # one host synchronisation, as without a mask
        self.sample_size += real
        self.unclipped_num += unclipped

    def gradient_noise_multiplier(self) -> float:
        """σ_eff = (σ⁻² − (2σ_b)⁻²)^(−1/2), 0 for σ = 0 (Theorem 1; Opacus'
        ``AdaClipDPOptimizer.add_noise``)."""
        if self.noise_multiplier <= 0:
            return 0.0
        return (self.noise_multiplier ** (-2) - (2 * self.unclipped_num_std) ** (-2)) ** (-1 / 2)

    def gradient_noise_std(self) -> float:
        """The standard deviation of the noise on each clipped sum: σ_eff · C."""
        return self.gradient_noise_multiplier() * self.max_norm

    def add_count_noise(self, generator=None, device=None) -> float:
        """Add N(0, σ_b²) to the unclipped count, drawn as Opacus draws it (one
        ``torch.normal`` of shape ``()`` from ``generator``, after the gradients'
        noise; none for σ_b = 0). Returns the noisy count."""
        count = torch.tensor(float(self.unclipped_num), dtype=torch.float32, device=device)
        if self.unclipped_num_std != 0:
            count = count + torch.normal(
                mean=0, std=self.unclipped_num_std, size=(), device=device, generator=generator
            )
        self.unclipped_num = float(count)
        return self.unclipped_num

    def update(self) -> float:
        """The geometric update of the threshold from the (noisy) unclipped fraction,
        clamped to the bounds (in float32, as Opacus computes it). Returns the new
        threshold.

        Raises:
            RuntimeError: no sample counted since :meth:`reset`.
        """
        if self.sample_size == 0:
            raise RuntimeError("adaptive clipping: no sample counted, the update is undefined")
        frac = torch.tensor(self.unclipped_num, dtype=torch.float32) / self.sample_size
        factor = torch.exp(-self.clipbound_learning_rate * (frac - self.target_unclipped_quantile))
        norm = float(self.max_norm * factor)
        self.max_norm = min(max(norm, self.min_clipbound), self.max_clipbound)
        return self.max_norm

    def reset(self) -> None:
        """Forget the counts (Opacus does so in ``zero_grad``)."""
        self.sample_size = 0
        self.unclipped_num = 0
