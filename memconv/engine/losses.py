"""Per-sample losses: ``loss_fn(output[n:n+1], targets[n:n+1])`` for every sample n.

For the common losses, one batched call with ``reduction="none"`` where that gives
the per-sample losses exactly (:func:`batched`). Otherwise one vectorised evaluation (``torch.func.vmap`` over the samples) where the loss
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
import torch.nn.functional as F
from torch import Tensor, nn

from .._torch import global_module_hooks, module_hooks
from .generic import quiet_fallbacks

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


#: The losses :func:`batched` takes: module type -> name of its function in
#: ``torch.nn.functional`` (looked up at each call, as the module's ``forward`` does).
_CLASS_LOSSES = {nn.CrossEntropyLoss: "cross_entropy", nn.NLLLoss: "nll_loss"}
_ELEMENT_LOSSES = {nn.MSELoss: "mse_loss", nn.L1Loss: "l1_loss"}


def _plain_module(loss_fn) -> bool:
    """Whether calling the loss module is calling its function: no hooks of its own or
    global ones, no ``forward`` set on the instance."""
    return not (
        module_hooks(loss_fn, backward=True)
        or global_module_hooks(backward=True)
        or "forward" in loss_fn.__dict__
    )


def _settings(loss_fn):
    """``(function, reduction, weight, ignore_index)`` of a loss :func:`batched` may
    take (from its current attributes; ``ignore_index`` None for the element-wise
    losses), or None."""
    kind = type(loss_fn)
    if kind in _CLASS_LOSSES:
        if not _plain_module(loss_fn) or getattr(loss_fn, "label_smoothing", 0.0) != 0.0:
            return None
        function = getattr(F, _CLASS_LOSSES[kind])
        return function, loss_fn.reduction, loss_fn.weight, loss_fn.ignore_index
    if kind in _ELEMENT_LOSSES:
        if not _plain_module(loss_fn):
            return None
        return getattr(F, _ELEMENT_LOSSES[kind]), loss_fn.reduction, None, None
    if loss_fn is F.cross_entropy or loss_fn is F.nll_loss:  # their defaults
        return loss_fn, "mean", None, -100
    if loss_fn is F.mse_loss or loss_fn is F.l1_loss:
        return loss_fn, "mean", None, None
    return None


def batched(loss_fn, output, targets) -> Tensor | None:
    """The per-sample losses ``[N]`` in one call with ``reduction="none"``, where that
    gives exactly ``loss_fn(output[n:n+1], targets[n:n+1])`` (the same numbers and the
    same gradients), else None.

    The losses taken, as modules of exactly these types (no hooks) or as the functions
    with their defaults: ``nn.CrossEntropyLoss``/``F.cross_entropy`` and
    ``nn.NLLLoss``/``F.nll_loss`` on an output ``[N, C]`` with class indices ``[N]``
    (no label smoothing; a class weight with ``reduction="sum"`` only), and
    ``nn.MSELoss``/``F.mse_loss``, ``nn.L1Loss``/``F.l1_loss`` on an output and targets
    of one shape, ``[N]`` or ``[N, 1]``; ``reduction`` ``"mean"`` or ``"sum"``. There
    each sample's loss is one element: its sum is that element, its mean that element
    divided by 1 (the cross-entropy's mean divides by the sample's weight, 1, or 0 for a
    target equal to ``ignore_index``, whose mean is NaN: the batched losses are divided
    by the same 1 or 0), and the rows of the batched kernels (log-softmax over a row,
    the element-wise difference) do not depend on the batch. Label smoothing sums over
    the classes, and a weight divides in the mean, by kernels whose rounding does depend
    on the shape; such losses, and every other, take :func:`vectorised` or the loop.
    The loss's attributes are read on every call.
    """
    if isinstance(loss_fn, OutputKeepingLoss):
        if type(output) is not Tensor or type(targets) is not Tensor:
            return None
        if output.shape != targets.shape or not output.is_floating_point():
            return None
        loss_fn.output = output
        return linear_losses(output, targets)
    settings = _settings(loss_fn)
    if settings is None or type(output) is not Tensor or type(targets) is not Tensor:
        return None
    function, reduction, weight, ignore_index = settings
    n = len(output)
    if reduction not in ("mean", "sum") or not output.is_floating_point() or n == 0:
        return None
    if ignore_index is not None:  # class indices
        if output.dim() != 2 or targets.shape != (n,) or targets.dtype != torch.long:
            return None
        if weight is not None and reduction == "mean":
            return None
        kwargs = {"ignore_index": ignore_index}
        if weight is not None:
            kwargs["weight"] = weight
        losses = function(output, targets, reduction="none", **kwargs)
        if reduction == "mean":  # divided by the sample's weight: 1, or 0 if ignored
            losses = losses / (targets != ignore_index)
        return losses
    if output.shape != targets.shape or output.shape[1:] not in ((), (1,)):
        return None
    if targets.dtype != output.dtype:
        return None
    return function(output, targets, reduction="none").reshape(n)


def _worth_it(output) -> bool:
    return not isinstance(output, Tensor) or len(output) >= VECTORISE_FROM


class PerSampleLoss:
    """A loss function evaluated per sample: in one batched call where :func:`batched`
    takes it (decided on every call), else by ``vmap`` until that fails once, then
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
        losses = batched(self.loss_fn, output, targets)
        if losses is not None:
            return losses
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
        vectorise: try one batched call (:func:`batched`), then one
            ``torch.func.vmap`` evaluation for
            :data:`VECTORISE_FROM` samples or more (else, or where it fails, one
            call per sample).

    Raises:
        ValueError: if ``loss_fn`` does not return a scalar tensor for one sample.
    """
    if vectorise:
        losses = batched(loss_fn, output, targets)
        if losses is not None:
            return losses
    if vectorise and _worth_it(output):
        losses = vectorised(loss_fn, output, targets)
        if losses is not None:
            return losses
    return _looped(loss_fn, output, targets)


def linear_loss(output: Tensor, target: Tensor) -> Tensor:
    """``⟨output, target⟩``: with ``target`` sample n's output gradient of its own loss,
    its gradient with respect to the parameters is sample n's loss gradient, exactly.
    The per-sample loss of a pass whose backward the user's ``loss.backward()`` starts
    (:class:`memconv.engine.passes.UserPass`)."""
    return (output * target).sum()


class OutputKeepingLoss:
    """:func:`linear_loss`, keeping the model output it was last given in one batched
    call (:func:`batched` takes it as :func:`linear_losses`): a recorded pass's traced
    step returns the model's output from it (:mod:`memconv.tasks.recorded`).

    Attributes:
        output: the output ``[N, ...]`` of the last batched call, or None.
    """

    def __init__(self):
        self.output: Tensor | None = None

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        return linear_loss(output, target)


def linear_losses(output: Tensor, targets: Tensor) -> Tensor:
    """:func:`linear_loss` of every sample: ``[N]`` (batch axis first)."""
    n = output.shape[0]
    return (output * targets.to(output.dtype)).reshape(n, -1).sum(1)
