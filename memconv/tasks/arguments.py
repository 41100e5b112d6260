"""A whole-model call's arguments, checked before any work and gathered into the
engine's records (:class:`memconv.engine.request.Request`, :class:`~memconv.engine.request.Batch`).

Every public function of :mod:`memconv.tasks` starts here: the argument checks
(:mod:`memconv._checks`), the model's (:meth:`memconv.engine.prepared.Prepared.check_model`:
each layer's rule says whether it mixes samples), and the strategy of the open
:class:`memconv.save_memory` block or of ``strategy``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .._checks import (
    check_batch,
    check_budget,
    check_clip_route,
    check_route,
    check_sample_mask,
)
from ..conv.settings import use_block_settings
from ..engine.prepared import Prepared
from ..engine.request import Batch, Request


class Checked(NamedTuple):
    """A call's arguments, checked.

    Attributes:
        request: what the call computes.
        batch: on what (the model unwrapped from ``torch.compile`` and, where asked,
            from ``DistributedDataParallel``).
        ddp: the ``DistributedDataParallel`` wrapper that was taken off, or None.
        sample_mask: the bool mask ``[N]`` of the real samples, or None (then
            ``batch`` holds the padded samples' inputs and targets as zeros:
            :func:`zero_padded`).
    """

    request: Request
    batch: Batch
    ddp: nn.Module | None
    sample_mask: Tensor | None = None


def unwrap_ddp(model):
    """``(module, wrapper)``: the module a ``DistributedDataParallel`` wraps (the walk
    runs on it) and the wrapper, or ``(model, None)``.

    Raises:
        ValueError: for Opacus' ``DPDDP``, whose ranks memconv would not sum.
    """
    if type(model).__name__ in ("DPDDP", "DifferentiallyPrivateDistributedDataParallel"):
        raise ValueError(
            "model is Opacus' DPDDP: memconv sums the ranks' clipped sums itself; wrap the "
            "model in torch.nn.parallel.DistributedDataParallel instead"
        )
    return (model.module, model) if isinstance(model, DistributedDataParallel) else (model, None)


def check_call(
    prepared: Prepared,
    given: Batch,
    *,
    task: str,
    caller: str,
    strategy,
    memory_budget,
    norm_route=None,
    clip_route=None,
    unwrap: bool = False,
    sample_mask=None,
) -> Checked:
    """Check a call's arguments (before any work) and gather them into records.

    Args:
        prepared: what the last call kept (the model's checks are run again only when
            the model or the settings changed).
        given: the call's model, loss and samples, as given.
        task: ``"grads"``, ``"norms"`` or ``"clip"``.
        caller: the public function's name, for messages.
        strategy, memory_budget, norm_route, clip_route: the call's.
        unwrap: take a ``DistributedDataParallel`` wrapper off (norms and clipping
            run on the local samples; clipping sums the ranks itself).
        sample_mask: None, or the bool mask ``[N]`` of the real samples of a padded
            batch (checked here; the batch's padded samples zeroed, :func:`zero_padded`).

    Raises:
        TypeError, ValueError, RuntimeError: as the public functions document.
    """
    settings = use_block_settings(strategy)
    model, ddp = unwrap_ddp(given.model) if unwrap else (given.model, None)
    check_clip_route(clip_route)
    model = prepared.check_model(model, settings)
    n = check_batch(given.inputs, given.targets)
    check_sample_mask(sample_mask, n, given.inputs.device)
    check_budget(memory_budget)
    check_route(norm_route)
    routes = dict(norm_route=norm_route, clip_route=clip_route, caller=caller)
    request = Request(task=task, n=n, settings=settings, memory_budget=memory_budget, **routes)
    batch = (
        given if model is given.model else Batch(model, given.loss_fn, given.inputs, given.targets)
    )
    if sample_mask is not None:
        batch = replace(
            batch,
            inputs=zero_padded(batch.inputs, sample_mask),
            targets=zero_padded(batch.targets, sample_mask),
        )
    return Checked(request, batch, ddp, sample_mask)


def zero_padded(values, sample_mask: Tensor):
    """``values`` (``[N, ...]``) with the padded samples' rows (``sample_mask`` False)
    replaced by zeros, by ``torch.where`` (the shape stays, no host synchronisation): a
    NaN or inf in a padded sample's input or target never enters the passes, whose
    results for the padded samples are then finite and multiplied by a zero clip factor
    (``0·NaN`` would be NaN). A ``values`` that is no tensor ``[N, ...]`` on the mask's
    device (targets of another kind) is returned as it is."""
    if not (
        isinstance(values, Tensor)
        and values.dim() >= 1
        and len(values) == len(sample_mask)
        and values.device == sample_mask.device
    ):
        return values
    keep = sample_mask.view(-1, *([1] * (values.dim() - 1)))
    return torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
