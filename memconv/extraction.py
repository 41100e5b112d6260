"""Per-sample gradients of a whole model in one backward pass.

The forward pass records every call of a module that owns trainable parameters;
in the one backward pass each call's output gradient reaches its route
(:mod:`memconv.walk`): the layer's rule (convolutions by the strategy, Linear as a
product, ...: :mod:`memconv.layers`), the generic route (``torch.func`` on the
call's real arguments) or, for a parameter used outside the modules that own it,
the whole model's per-sample loss by ``torch.func``. Autograd itself computes no
parameter gradient: nothing is computed twice.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from .context import activate, use_block_settings
from .layers import RuleSettings
from .layers.generic import chunk_size, model_grad_sample
from .losses import per_sample_losses
from .planning import check_budget
from .prepared import (  # noqa: F401 (check_per_sample_model, unwrap_compiled: re-exported)
    Prepared,
    check_batch,
    check_per_sample_model,
    model_streams,
    parameter_names,
    unwrap_compiled,
)
from .resources import AVAILABLE, process_budget
from .walk import LayerCall, backward_walk


def per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    *,
    strategy: str | bool | None = None,
    memory_budget: int | str | None = AVAILABLE,
) -> dict[str, Tensor]:
    """Per-sample gradients of every trainable parameter, in one backward pass.

    ``out[name][n]`` is the gradient of ``loss_fn(model(inputs[n:n+1]),
    targets[n:n+1])`` with respect to the parameter ``name``, whatever the
    reduction of ``loss_fn`` (the samples must be independent: BatchNorm in eval
    mode only).

    A parameter shared by several layers gets the sum over its uses (as ``.grad``)
    under its first name, as ``model.named_parameters()`` lists it. A parameter
    whose output does not reach the loss gets zeros (as ``torch.autograd.grad``
    with ``allow_unused`` semantics); one that should have been reached but was not
    raises. An empty batch (N = 0) gives ``[0, *shape]`` tensors.

    Args:
        model: any model whose samples are independent (layers with a rule in
            :mod:`memconv.layers` take their lean route; every other parametrised
            layer, and parameters used outside their modules, the exact generic
            route by ``torch.func``). A ``torch.compile``'d model runs eagerly.
        loss_fn: called as ``loss_fn(output[n:n+1], targets[n:n+1])``; must return a
            scalar tensor.
        inputs: ``[N, ...]``.
        targets: ``[N, ...]``.
        strategy: weight-VJP strategy of the convolutions (name or bool, default
            options); ``None`` uses the open :class:`memconv.save_memory` block, or
            ``"auto"`` outside any.
        memory_budget: bytes the whole call's peak memory increase may reach, the
            result included: the batch then runs in micro-batches and each layer's
            weight VJP within a budget, as :func:`memconv.plan` plans them (the plan
            is logged on the ``memconv`` logger). ``"available"`` (the default): what
            the process can still use (:func:`memconv.resources.default_budget`);
            None: one pass over the whole batch. A model holding a
            :class:`memconv.streaming.StreamingCNN` runs one sample at a time (its
            layers are hidden from the per-layer hooks), whatever the budget.

    Returns:
        ``{name: Tensor [N, *param.shape]}`` for every parameter with
        ``requires_grad``, in ``named_parameters`` order, in the parameters' dtypes.

    Raises:
        TypeError: if ``model`` is not a module or ``inputs`` not a tensor.
        ValueError: unknown strategy, a layer that mixes samples (BatchNorm in
            training mode), ``inputs`` and ``targets`` of different lengths, a
            non-positive or non-integer ``memory_budget`` or one below the smallest
            feasible budget (named), a ``loss_fn`` that does not return a scalar for
            one sample, a layer whose forward pass draws random numbers (dropout in
            training mode) where the generic route must replay it.
        RuntimeError: under ``torch.no_grad()``/``torch.inference_mode()``; when the
            gradient of a parameter that influences the loss was not reached
            (naming it).
    """
    return grads_with(
        Prepared(), model, loss_fn, inputs, targets, strategy=strategy, memory_budget=memory_budget
    )


def grads_with(prepared: Prepared, model, loss_fn, inputs, targets, *, strategy, memory_budget):
    """:func:`per_sample_grads`, reusing what ``prepared`` kept from the last call."""
    settings = use_block_settings(strategy)
    model = prepared.check_model(model, settings)
    n = check_batch(inputs, targets)
    check_budget(memory_budget)
    params = prepared.trainable()
    if n == 0 or prepared.streams:
        out = {name: p.new_zeros(n, *p.shape) for name, p in params.items()}
        # a model that streams hides its layers from the hooks: one sample at a time
        with activate(settings):
            for i, grads in sample_by_sample(model, loss_fn, inputs, targets, params):
                for name, g in grads.items():
                    out[name][i] = g
        return out

    def run():  # raises before any work if the result cannot fit
        cp = prepared.call_plan(model, loss_fn, inputs, "grads", settings, memory_budget)
        out = {name: p.new_empty(n, *p.shape) for name, p in params.items()}
        rs = RuleSettings(settings, None, cp.plan.layer_budget)
        with process_budget(inputs.device) if cp.guard else nullcontext():
            _grads_walks(model, loss_fn, inputs, targets, cp, rs, out)
        return out

    return prepared.run(run)


def _grads_walks(model, loss_fn, inputs, targets, cp, rs, out) -> None:
    """Per-sample gradients into ``out`` (uninitialised), micro-batch by micro-batch
    (``cp``: the :class:`memconv.prepared.CallPlan`): a parameter's first part in a
    micro-batch is copied in, the others added, and rows no route reached are zeros."""
    n, m = len(inputs), cp.plan.micro_batch
    for i0 in range(0, n, m):
        rows = slice(i0, min(n, i0 + m))
        written: set = set()
        adopted: set = set()  # results taken as they are: never written in place

        def add(name, v, rows=rows, written=written, adopted=adopted, call=None):
            if name in adopted:
                out[name] = out[name] + v
            elif name in written:
                out[name][rows] += v
            elif m >= n and _own_tensor(v, out[name], call):  # no copy at all
                out[name] = v
                adopted.add(name)
                written.add(name)
            else:  # 0 + v is v: a copy, without filling with zeros first
                out[name][rows].copy_(v)
                written.add(name)

        def visit(call: LayerCall):
            for k, v in call.grad_sample(rs).items():
                add(call.params[k], v, call=call)

        with activate(None, False):  # the user's blocks do not reach the model's own layers
            walk = backward_walk(
                model, cp.loss, inputs[rows], targets[rows], cp.names, cp.axes, visit,
                caller="memconv.per_sample_grads", owners=cp.owners,
            )  # fmt: skip
        for k, v in model_route(model, loss_fn, inputs[rows], targets[rows], walk, rs).items():
            add(k, v)
        for name in out.keys() - written:  # reached by no route: zeros
            out[name][rows].zero_()


def _own_tensor(v: Tensor, like: Tensor, call: LayerCall | None) -> bool:
    """Whether a route's result ``v`` can be the result itself: of ``like``'s shape,
    dtype and layout, and a tensor of its own (no view, no storage shared with the
    call's arguments or output gradients, which autograd may still read)."""
    if not (
        v.shape == like.shape
        and v.dtype == like.dtype
        and v.device == like.device
        and v._base is None
        and v.is_contiguous()
        and not v.requires_grad
    ):
        return False
    if call is None:
        return True
    storage = v.untyped_storage().data_ptr()
    others = [*tree_flatten((call.args, call.kwargs))[0], *call.grads]
    return all(
        not isinstance(t, Tensor) or t.untyped_storage().data_ptr() != storage for t in others
    )


def model_route(model, loss_fn, inputs, targets, walk, rs: RuleSettings) -> dict[str, Tensor]:
    """Per-sample gradients ``{model name: [m, ...]}`` of the parameters the walk left
    to the model route (none: ``{}``)."""
    if not walk.model_params:
        return {}
    named = dict(model.named_parameters())
    per = sum(named[k].numel() * named[k].element_size() for k in walk.model_params)
    per += inputs[:1].numel() * inputs.element_size() * 8  # a sample's activations, roughly
    with activate(None, False):
        return model_grad_sample(
            model, loss_fn, inputs, targets, walk.model_params,
            chunk=chunk_size(len(inputs), per, rs.budget),
        )  # fmt: skip


def streams(model: nn.Module) -> bool:
    """Whether ``model`` holds a :class:`memconv.streaming.StreamingCNN`, whose layers
    run inside its own autograd Function, out of reach of the per-layer hooks."""
    return model_streams(model)


def sample_by_sample(model, loss_fn, inputs, targets, params: dict):
    """Yield ``(n, {name: gradient})`` for one sample at a time, by autograd.

    The route for models that stream (:func:`streams`): one sample's forward and
    backward pass at a time, its gradient gathered tile by tile by
    :class:`memconv.streaming.StreamingCNN`, so memory is that of one streamed sample
    whatever the image size. The strategy of the open block applies to the streamed
    convolutions (the caller opens it).
    """
    names = list(params)
    for i in range(len(inputs)):
        loss = per_sample_losses(
            loss_fn, model(inputs[i : i + 1].detach()), targets[i : i + 1], vectorise=False
        )[0]
        grads = torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
        yield (
            i,
            {k: g if g is not None else torch.zeros_like(params[k]) for k, g in zip(names, grads)},
        )
