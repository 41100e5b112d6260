"""Per-sample gradients of a whole model in one backward pass.

The forward pass records every call of a module that owns trainable parameters;
in the one backward pass each call's output gradient reaches its route
(:mod:`memconv.engine.walk`, once per micro-batch: :mod:`memconv.engine.passes`): the layer's rule (convolutions by the strategy, Linear as a
product, ...: :mod:`memconv.layers`), the generic route (``torch.func`` on the
call's real arguments) or, for a parameter used outside the modules that own it,
the whole model's per-sample loss by ``torch.func``. Autograd itself computes no
parameter gradient: nothing is computed twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from .._checks import AVAILABLE
from .._torch import not_traced, storage_ptr, tree_flatten
from ..conv.settings import activate
from ..engine.calls import LayerCall
from ..engine.passes import sample_by_sample, walk_micro_batches
from ..engine.prepared import CallPlan, Prepared, kept_for
from ..engine.request import Batch
from ..layers import RuleSettings
from .arguments import check_call


@not_traced
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
            is logged on the ``memconv`` logger). ``"available"`` (the default): lean,
            the routes chosen to keep the call's predicted peak within the non-private
            step's (:func:`memconv.engine.planning.lean_target`), within what the
            process can still use (:func:`memconv.engine.resources.default_budget`);
            a budget in bytes (or None) trades memory for speed, each layer then
            using up to what the pass itself holds;
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
    given = Batch(model, loss_fn, inputs, targets)
    with kept_for(model) as prepared:
        return grads_with(prepared, given, strategy=strategy, memory_budget=memory_budget)


def grads_with(prepared: Prepared, given: Batch, **options):
    """:func:`per_sample_grads` of ``given``, reusing what ``prepared`` kept from the last
    call: the arguments checked, then the result allocated and filled micro-batch by
    micro-batch of the plan (the plan raises before any work if the result cannot fit)."""
    caller = "memconv.per_sample_grads"
    checked = check_call(prepared, given, task="grads", caller=caller, **options)
    request, batch = checked.request, checked.batch
    params = prepared.trainable()
    if request.n == 0 or prepared.streams:
        return _sample_by_sample(batch, params, request)
    return prepared.run_walk(batch, request, lambda cp, b: walked_grads(cp, b, params))


def walked_grads(cp: CallPlan, batch: Batch, params: dict) -> dict[str, Tensor]:
    """The per-sample gradients of every micro-batch of the plan, written into the result."""
    n = batch.n
    out: dict = {}

    def for_rows(rows: slice) -> RowWriter:
        whole = cp.plan.micro_batch >= n
        return RowWriter(out, rows, cp.rule_settings, whole=whole, like=(params, n))

    for part in walk_micro_batches(batch, cp, visitor=for_rows):
        part.visitor.zero_rest()
    return {name: out[name] for name in params}


def _sample_by_sample(batch: Batch, params: dict, request) -> dict[str, Tensor]:
    """A model that streams hides its layers from the hooks: one sample at a time (an
    empty batch: no sample)."""
    out = {name: p.new_zeros(batch.n, *p.shape) for name, p in params.items()}
    with activate(request.settings):
        for i, grads in sample_by_sample(batch, params):
            for name, g in grads.items():
                out[name][i] = g
    return out


class RowWriter:
    """Per-sample gradients of one micro-batch's rows into ``out`` (uninitialised): a
    parameter's first part is copied in (or, when the rows are the whole batch and the
    part is a tensor of its own, becomes the result itself: no copy), the others added
    (out of place to a part taken as it is), and rows no route reached are zeros
    (:meth:`zero_rest`).

    With ``like = ({name: parameter}, N)``, ``out`` starts without a parameter's result
    and each ``[N, *shape]`` result is made when first needed: a whole batch's part taken
    as it is makes none."""

    prepare = None

    def __init__(self, out: dict, rows: slice, rs: RuleSettings, whole: bool, like=None):
        self.out, self.rows, self.whole = out, rows, whole
        # a whole batch's results are taken as they are if in the parameter's layout
        self.rs = replace(rs, contiguous=True) if whole else rs
        self.like = like
        self.written: set = set()
        self.adopted: set = set()  # parts taken as they are: never written in place

    def _result(self, name) -> Tensor:
        """The result of ``name``, made (uninitialised) if there is none yet."""
        if name not in self.out:
            params, n = self.like
            p = params[name]  # (torch.empty: a trace's graph then reads no parameter here)
            self.out[name] = torch.empty((n, *p.shape), dtype=p.dtype, device=p.device)
        return self.out[name]

    def add(self, name, v, taken: set | None = None):
        if name in self.adopted:
            self.out[name] = self.out[name] + v
        elif name in self.written:
            self._rows(name).add_(v)
        elif self.whole and _own_tensor(v, self._like(name), taken):
            self.out[name] = v
            self.adopted.add(name)
            self.written.add(name)
        else:  # 0 + v is v: a copy, without filling with zeros first
            self._rows(name).copy_(v)
            self.written.add(name)

    def _rows(self, name) -> Tensor:
        out = self._result(name)
        return out if self.whole else out[self.rows]

    def _like(self, name):
        """What ``name``'s result is: its tensor, or ``(shape, dtype, device)``."""
        if name in self.out:
            return self.out[name]
        params, n = self.like
        p = params[name]
        return ((n, *p.shape), p.dtype, p.device)

    def visit(self, call: LayerCall):
        taken = _storages(call) if self.whole else None
        for k, v in call.grad_sample(self.rs).items():
            self.add(call.params[k], v, taken)

    def from_model_route(self, name, v):
        self.add(name, v)

    def zero_rest(self):
        names = self.out.keys() if self.like is None else self.like[0].keys()
        for name in names - self.written:  # reached by no route: zeros
            if self.whole and name not in self.out:
                params, n = self.like
                self.out[name] = params[name].new_zeros(n, *params[name].shape)
            else:
                self._rows(name).zero_()


def _storages(call: LayerCall) -> set:
    """The storages of a call's arguments and output gradients (autograd may still
    read them)."""
    leaves = [*call.args, *call.kwargs.values()]
    if not all(isinstance(t, Tensor) or t is None or isinstance(t, (int, float)) for t in leaves):
        leaves = tree_flatten((call.args, call.kwargs))[0]
    leaves += call.grads
    return {storage_ptr(t) for t in leaves if isinstance(t, Tensor)}


def _own_tensor(v: Tensor, like, taken: set | None) -> bool:
    """Whether a route's result ``v`` can be the result itself: of ``like``'s shape,
    dtype and layout (``like``: a tensor, or ``(shape, dtype, device)``), and a tensor
    of its own: contiguous, filling its whole storage (no view of a larger buffer, no
    memory shared with another result; a reshaped view of a strategy's fresh output
    is taken as it is), no storage among ``taken`` (:func:`_storages` of the call that
    made it)."""
    shape, dtype, device = (
        (like.shape, like.dtype, like.device) if isinstance(like, Tensor) else like
    )
    return (
        v.shape == shape
        and v.dtype == dtype
        and v.device == device
        and v.is_contiguous()
        and v.storage_offset() == 0
        and v.untyped_storage().nbytes() == v.numel() * v.element_size()
        and not v.requires_grad
        and (taken is None or storage_ptr(v) not in taken)
    )
