"""The passes the public calls share: one walk per micro-batch of a plan, the model route
for the parameters a walk leaves to it, and sample by sample for models that stream.

:func:`walk_micro_batches` is the one micro-batch driver of :func:`memconv.per_sample_grads`,
:func:`memconv.per_sample_norms` and :func:`memconv.clip_and_accumulate`: for each
micro-batch of the plan, a visitor made for its rows, one walk
(:func:`memconv.engine.walk.backward_walk`) handing it every call, and the model route's
per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch import Tensor

from ..conv.settings import activate
from ..layers import RuleSettings
from .generic import chunk_size, model_grad_sample
from .losses import linear_loss, linear_losses, per_sample_losses
from .prepared import CallPlan
from .request import Batch
from .resources import process_budget
from .walk import BackwardWalk, backward_walk


class MicroBatch(NamedTuple):
    """One micro-batch, walked.

    Attributes:
        rows: its rows of the batch.
        visitor: what visited its calls and took the model route's per-sample
            gradients (made for these rows).
        losses: its per-sample losses ``[m]`` (with their graph if kept).
    """

    rows: slice
    visitor: object
    losses: Tensor


def walk_micro_batches(
    batch: Batch, cp: CallPlan, *, visitor: Callable[[slice], object], keep_graph: bool = False
):
    """Yield a :class:`MicroBatch` for each micro-batch of the plan ``cp`` in turn (the
    next one is walked once the last is consumed; nothing of it is kept here), under
    the process budget when the plan guards the call
    (:func:`memconv.engine.resources.process_budget`).

    Args:
        batch: the call's model, loss and samples.
        cp: the plan of the call (:class:`memconv.engine.prepared.CallPlan`).
        visitor: called with a micro-batch's rows before its walk; returns what
            visits its calls: an object with ``visit`` and ``prepare`` (None: nothing
            to prepare), as :func:`memconv.engine.walk.backward_walk` takes them, and
            ``from_model_route(name, grads)``, called with the per-sample gradients
            ``[m, ...]`` of each parameter the walk left to the model route.
        keep_graph: keep each walk's graph for a second backward pass of its losses.
    """
    n, m = batch.n, cp.plan.micro_batch
    # a budget holds for the process too (glibc's heap), see memconv.engine.resources
    with process_budget(batch.inputs.device) if cp.guard else nullcontext():
        for i0 in range(0, n, m):
            rows = slice(i0, min(n, i0 + m))
            yield _walk(batch.rows(rows), cp, rows=rows, visitor=visitor(rows), keep=keep_graph)


def _walk(part: Batch, cp: CallPlan, *, rows: slice, visitor, keep: bool) -> MicroBatch:
    with activate(None, False):  # the user's blocks do not reach the model's own layers
        walk = backward_walk(
            part.model,
            cp.loss,
            part.inputs,
            part.targets,
            cp.names,
            cp.axes,
            visitor.visit,
            caller=cp.request.caller,
            keep_graph=keep,
            prepare=visitor.prepare,
            owners=cp.owners,
            kept=cp.kept,
        )
    for name, grads in model_route(part, walk, cp.rule_settings).items():
        visitor.from_model_route(name, grads)
    return MicroBatch(rows=rows, visitor=visitor, losses=walk.losses)


def model_route(part: Batch, walk, rs: RuleSettings) -> dict[str, Tensor]:
    """Per-sample gradients ``{model name: [m, ...]}`` of the parameters the walk left
    to the model route (none: ``{}``)."""
    if not walk.model_params:
        return {}
    named = dict(part.model.named_parameters())
    per = sum(named[k].numel() * named[k].element_size() for k in walk.model_params)
    inputs = part.inputs
    per += inputs[:1].numel() * inputs.element_size() * 8  # a sample's activations, roughly
    with activate(None, False):
        return model_grad_sample(
            part.model,
            part.loss_fn,
            inputs,
            part.targets,
            walk.model_params,
            chunk=chunk_size(len(inputs), per, rs.budget),
        )


def sample_by_sample(batch: Batch, params: dict):
    """Yield ``(n, {name: gradient})`` for one sample at a time, by autograd.

    The route for models that stream (:func:`memconv.engine.prepared.model_streams`):
    one sample's forward and backward pass at a time, its gradient gathered tile by tile
    by :class:`memconv.streaming.StreamingCNN`, so memory is that of one streamed sample
    whatever the image size. The strategy of the open block applies to the streamed
    convolutions (the caller opens it).
    """
    names = list(params)
    for i in range(batch.n):
        one = batch.rows(slice(i, i + 1))
        output = batch.model(one.inputs.detach())
        loss = per_sample_losses(batch.loss_fn, output, one.targets, vectorise=False)[0]
        grads = torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
        yield (
            i,
            {k: g if g is not None else torch.zeros_like(params[k]) for k, g in zip(names, grads)},
        )


class UserPass:
    """One pass whose forward is the user's call of the model and whose backward the
    user's ``loss.backward()`` starts: the walk records the forward pass
    (:meth:`forward`, or :meth:`start`/:meth:`stop` around a call the user makes), and
    :meth:`backward`, given ``∂L/∂output`` scaled to each sample's own loss, walks it
    from the per-sample losses ``⟨outputₙ, targetsₙ⟩`` (:func:`memconv.engine.losses.linear_loss`,
    whose parameter gradient is sample n's loss gradient), then takes the model route.

    The whole batch is one micro-batch: the forward pass's activations are the user's;
    the plan's per-layer budget bounds the routes' temporaries.

    Args:
        cp: the plan of the call (:class:`memconv.engine.prepared.CallPlan`, made on
            this model and an input of the batch's shape).
        model: the model whose call is recorded.
        visitor: what visits its calls, as :func:`walk_micro_batches` takes it.
    """

    def __init__(self, cp: CallPlan, model, visitor):
        self.cp, self.model, self.visitor = cp, model, visitor
        self.walk: BackwardWalk | None = None
        self.inputs: Tensor | None = None
        self.output: Tensor | None = None

    def _walk(self, inputs: Tensor) -> BackwardWalk:
        self.inputs = inputs.detach()
        cp = self.cp
        self.walk = BackwardWalk(
            self.model,
            cp.names,
            cp.axes,
            self.visitor.visit,
            caller=cp.request.caller,
            owners=cp.owners,
            m=len(inputs),
        )
        return self.walk

    def forward(self, inputs: Tensor) -> Tensor:
        """The model's output on ``inputs``, its calls recorded."""
        walk = self._walk(inputs)
        try:
            self.output = walk.forward(inputs)
        except BaseException:
            walk.close()
            raise
        return self.output

    def start(self, inputs: Tensor, root_call: tuple | None = None) -> None:
        """Record the calls of the model's call that begins now (its input ``inputs``);
        ``root_call``: ``(args, kwargs)`` of that call if the model owns trainable
        parameters itself (its call is then recorded by hand, see :meth:`stop`)."""
        walk = self._walk(inputs)
        walk.start(outside=self.model if root_call is not None else None)
        if root_call is not None:
            walk.pre_hook(self.model, *root_call)

    def stop(self, output: Tensor, root_call: tuple | None = None) -> Tensor:
        """The end of the call :meth:`start` began: its output (or the copy the walk
        hooks)."""
        walk = self.walk
        try:
            if root_call is not None:
                new = walk.forward_hook(self.model, *root_call, output)
                output = output if new is None else new
        finally:
            walk.stop()
        self.output = output
        return output

    def backward(self, targets: Tensor, *, keep_graph: bool = False) -> MicroBatch:
        """The backward half from the per-sample losses ``⟨outputₙ, targetsₙ⟩``, then the
        model route.

        Args:
            targets: ``[N, ...]``, each sample's output gradient of its own loss.
            keep_graph: keep the graph for a second backward pass of the losses.
        """
        with torch.enable_grad():
            losses = linear_losses(self.output, targets)
            walk = self.walk.finish(losses, keep_graph=keep_graph, prepare=self.visitor.prepare)
        self.output = None
        part = Batch(self.model, linear_loss, self.inputs, targets)
        for name, grads in model_route(part, walk, self.cp.rule_settings).items():
            self.visitor.from_model_route(name, grads)
        return MicroBatch(rows=slice(0, len(targets)), visitor=self.visitor, losses=walk.losses)

    def close(self) -> None:
        """Drop what the recorded forward pass holds (a pass whose backward never ran)."""
        if self.walk is not None:
            self.walk.close()
        self.walk = self.output = self.inputs = None
