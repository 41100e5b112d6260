"""Per-sample losses: ``loss_fn(output[n:n+1], targets[n:n+1])`` for every sample n.

One vectorised evaluation (``torch.func.vmap`` over the samples) where the loss
allows it; the loop over the samples, with the same numbers, for batches of fewer than
:data:`VECTORISE_FROM` samples (where ``vmap``'s fixed cost, about 0.2 ms on a
CPU, exceeds the loop's) and where ``vmap`` cannot take the loss (a
loss that calls ``.item()``, branches on values, draws random numbers, or gets a
model output or targets that are not tensors). The fallback is reported once per
loss function and message by a ``UserWarning``.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .layers.generic import quiet_fallbacks

#: The smallest batch whose per-sample losses are vectorised.
VECTORISE_FROM = 16


def _one_sample(loss_fn):
    def loss(o: Tensor, t: Tensor) -> Tensor:
        return loss_fn(o.unsqueeze(0), t.unsqueeze(0))

    return loss


def _looped(loss_fn, output, targets) -> Tensor:
    losses = []
    for i in range(len(output)):
        loss = loss_fn(output[i : i + 1], targets[i : i + 1])
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                "loss_fn must return a scalar tensor for one sample "
                f"(loss_fn(output[n:n+1], targets[n:n+1])), got {shape}"
            )
        losses.append(loss)
    return torch.stack(losses) if losses else output.new_zeros(0)


def vectorised(loss_fn, output, targets) -> Tensor | None:
    """The per-sample losses ``[N]`` by one ``vmap`` evaluation, or None where the
    loss (or the output or targets) does not allow it."""
    if not (isinstance(output, Tensor) and isinstance(targets, Tensor)) or not len(output):
        return None
    try:
        with quiet_fallbacks():  # an operator vmap loops over gives the same numbers
            losses = torch.func.vmap(_one_sample(loss_fn))(output, targets)
    except Exception as error:  # noqa: BLE001 — any failure means: loop instead
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        warnings.warn(
            f"memconv: the loss {name} cannot be vectorised over the samples by "
            f"torch.func.vmap ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
            "its per-sample losses are computed one sample at a time (same numbers, slower)",
            stacklevel=3,
        )
        return None
    if not isinstance(losses, Tensor) or losses.shape != (len(output),):
        return None  # not one scalar per sample: the loop says so
    return losses


def _worth_it(output) -> bool:
    return not isinstance(output, Tensor) or len(output) >= VECTORISE_FROM


class PerSampleLoss:
    """A loss function evaluated per sample: by ``vmap`` until that fails once, then
    by the loop (the failure is not retried).

    Attributes:
        loss_fn: the loss, ``loss_fn(output[n:n+1], targets[n:n+1])``.
        vmaps: whether the next evaluation tries ``vmap``.
    """

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.vmaps = True

    def __call__(self, output, targets) -> Tensor:
        """The per-sample losses ``[N]`` (see :func:`per_sample_losses`)."""
        if self.vmaps and _worth_it(output):
            losses = vectorised(self.loss_fn, output, targets)
            if losses is not None:
                return losses
            self.vmaps = False
        return _looped(self.loss_fn, output, targets)


def per_sample_losses(loss_fn, output, targets, *, vectorise: bool = True) -> Tensor:
    """``loss_fn(output[n:n+1], targets[n:n+1])`` for every sample n, as a ``[N]`` tensor.

    Args:
        loss_fn: returns a scalar tensor for one sample.
        output: the model's output ``[N, ...]``.
        targets: ``[N, ...]``.
        vectorise: try one ``torch.func.vmap`` evaluation first for
            :data:`VECTORISE_FROM` samples or more (else, or where it fails, one
            call per sample).

    Raises:
        ValueError: if ``loss_fn`` does not return a scalar tensor for one sample.
    """
    if vectorise and _worth_it(output):
        losses = vectorised(loss_fn, output, targets)
        if losses is not None:
            return losses
    return _looped(loss_fn, output, targets)
