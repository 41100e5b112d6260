"""The user's own forward and backward pass as the per-sample pass.

:func:`memconv.clipping` and :func:`memconv.recording` are blocks around a training
step written as usual, in BackPACK's idiom (``with backpack(BatchGrad()):
loss.backward()``)::

    with memconv.clipping(model, max_norm=1.0) as clip:
        loss = criterion(model(x), y)     # the user's forward: recorded
        loss.backward()                   # .grad: the clipped sum Σₙ min(1, C/‖gₙ‖)·gₙ
    clip.norms                            # [N], before clipping

While the block is open, each call of ``model`` in training mode with gradients
enabled is recorded (:class:`memconv.engine.passes.UserPass`: hooks on the layers,
the operation recorder), and its output is handed back detached through one autograd
node; the backward pass the user's ``loss.backward()`` starts reaches that node with
``∂L/∂output``, and memconv drives the model's own backward pass from there: per-layer
norms as the output gradients arrive, then the clip factors and the clipped sum
(:func:`memconv.tasks.clipping.clip_part`), which is added to ``.grad``. One forward
and one backward pass; autograd computes no parameter gradient of its own, and
dropout keeps the mask the user's forward pass drew.

Sample n's loss is the one the criterion reduces: its output gradient is
``∂L/∂outputₙ`` times N for ``loss_reduction="mean"`` (as Opacus' ``loss_reduction``),
as is for ``"sum"``. So the criterion must reduce per-sample losses over the batch
axis, each depending on its own sample's output only (``CrossEntropyLoss``,
``MSELoss``, label smoothing, auxiliary terms per sample, ...). A loss that mixes the
samples (a batch statistic of the outputs) cannot be told from its gradient: it is not
detected, and the norms would be those of another loss.

A ``torch.compile``'d model runs compiled: once the probe and plan are kept, one call
runs recorded and then traces the block's whole step (:mod:`memconv.engine.traced`),
cut where the output gradient is first read; later calls run the compiled forward half
at the model's call and the compiled backward half from the node's backward
(:class:`CompiledCall`). What a trace cannot keep runs recorded, eagerly, with a
warning. The blocks on one model share their probe, plan and traced steps
(:func:`memconv.engine.prepared.kept_for_blocks`).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import torch
from torch import Tensor, nn

from .._checks import (
    check_budget,
    check_choice,
    check_clip_route,
    check_max_norm,
    check_module,
    check_route,
    check_sample_mask,
    warn_user,
)
from .._torch import not_traced, own_hook
from ..conv.settings import use_block_settings
from ..engine.losses import OutputKeepingLoss
from ..engine.passes import UserPass
from ..engine.prepared import CallPlan, kept_for_blocks, unwrap_compiled
from ..engine.request import Batch
from ..engine.traced import SplitStep, first_line
from ..layers import own_trainable
from .arguments import check_call, zero_padded
from .clipping import (
    accumulate,
    check_step,
    clip_part,
    clipping_walk,
    ensure_finite_results,
    one_pass,
)
from .grads import RowWriter, walked_grads
from .groups import kept_thresholds, resolve_groups
from .norms import gatherer, joined, squared, total_sq

#: How a criterion reduces the per-sample losses (Opacus' ``loss_reduction``).
LOSS_REDUCTIONS = ("mean", "sum")


class Handoff(torch.autograd.Function):
    """Identity on the model's output (detached from the model's graph): its backward
    hands ``∂L/∂output`` to ``receive``, the pass that recorded the forward.

    ``Handoff.apply(receive, anchor, output)``: ``anchor`` is a tensor requiring grad
    (so that the result does), ``output`` the detached output."""

    @staticmethod
    def forward(ctx, receive, anchor, output):
        ctx.receive = receive
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        receive, ctx.receive = ctx.receive, None
        receive(grad_output)
        return None, None, None


class CompiledCall:
    """One call of a ``torch.compile``'d model run by the forward half of its traced
    step (:class:`memconv.engine.traced.SplitStep`): what the backward half reads of it
    is held until the backward pass (or :meth:`close`).

    Attributes:
        split: the traced step.
        key: its key (:meth:`memconv.engine.prepared.Prepared.step_key`).
        saved: the forward half's tensors the backward half reads.
        cp: the call's plan.
        n: the batch size.
    """

    def __init__(self, split: SplitStep, key, saved: list, cp: CallPlan, n: int):
        self.split, self.key, self.saved, self.cp, self.n = split, key, saved, cp, n

    def close(self) -> None:
        self.saved = None


class RecordedBackward:
    """A block in which the model's calls are recorded and their backward passes
    driven by memconv (see the module docstring); :class:`Clipping` and
    :class:`Recording` say what each backward pass computes.

    The block also works without ``with`` for a model that calls it itself
    (:meth:`forward`: Opacus' private module does).

    Args:
        model: the model (one input tensor ``[N, ...]``, one output tensor ``[N, ...]``).
        caller: the public name, for messages.
        loss_reduction: ``"mean"`` or ``"sum"``: the criterion's reduction.
        strategy: the convolutions' weight-VJP strategy (None: the open
            :class:`memconv.save_memory` block's, or ``"auto"``).
        memory_budget: bytes each layer's route may use for its temporaries (None:
            the rules' defaults). The forward pass is the user's: its activations are
            not bounded here.
        norm_route: ``"ghost"``, ``"instantiate"`` or None (per layer).
        clip_route: ``"book-keeping"``, ``"two-pass"`` or None (book-keeping).

    Raises:
        TypeError, ValueError: bad arguments (before any work), as the whole-model
            functions; a ``DistributedDataParallel`` model (record the module it wraps).
    """

    task = "grads"
    #: Whether a compiled model's calls run a traced step's two halves, compiled
    #: (:meth:`_step_walk`); otherwise eagerly, with a warning naming
    #: :attr:`eager_reason`.
    compiles = False
    eager_reason = "this block has no traced step"

    def __init__(
        self,
        model: nn.Module,
        *,
        caller: str,
        loss_reduction: str = "mean",
        strategy=None,
        memory_budget: int | None = None,
        norm_route=None,
        clip_route=None,
    ):
        check_module(model)
        check_choice(loss_reduction, LOSS_REDUCTIONS, "loss_reduction", none=False)
        # a budget bounds each layer's temporaries here: bytes or None
        check_budget(memory_budget, available=False, where=caller)
        check_route(norm_route)
        check_clip_route(clip_route)
        use_block_settings(strategy)
        if _is_parallel(model):
            raise ValueError(
                f"{caller}: the model is a DistributedDataParallel wrapper, whose reducer "
                "expects autograd to compute .grad; record the module it wraps "
                "(model.module) and call that, or use memconv.clip_and_accumulate on the "
                "wrapper (it sums the ranks' clipped sums)"
            )
        self.model, self.caller = model, caller
        self.loss_reduction = loss_reduction
        self.strategy, self.memory_budget = strategy, memory_budget
        self.norm_route, self.clip_route = norm_route, clip_route
        self._prepared = kept_for_blocks(model)
        self._loss = OutputKeepingLoss()  # the traced step's: the output read from it
        self._anchor = torch.empty(0, requires_grad=True)
        self._handles: list = []
        self._open: list = []  # (pass, its root call) of the calls under way
        self._waiting: set = set()  # passes recorded, their backward not yet run
        self._probing = False
        self._warned_compiled = False
        self._to_trace: dict = {}  # pass -> (key, walk, extra): traced after its backward
        self._ready = None  # the output of a compiled call for the model's swapped forward
        self._forward = None  # a compiled model's own forward, while the block swaps it
        self._model = unwrap_compiled(model)  # the module walked

    # ------------------------------------------------------------ the block
    @not_traced
    def __enter__(self):
        if self._handles:
            raise RuntimeError(f"{self.caller}: this block is already open")
        model = self.model
        self._handles = [
            model.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True),
        ]
        # the model's forward, bound before the hooks run, is swapped for the block: a
        # call the compiled forward half serves returns its output, and a step function
        # compiled around the block runs the model's calls as memconv's, eagerly
        self._forward = (model.forward, "forward" in model.__dict__)
        model.forward = self._swapped_forward
        return self

    @not_traced
    def _swapped_forward(self, *args, **kwargs):
        ready, self._ready = self._ready, None
        if ready is not None:
            return ready
        if self._open and self._model is not self.model:
            # a recorded call of a compiled model: the module it wraps, eagerly
            return self._model(*args, **kwargs)
        return self._forward[0](*args, **kwargs)

    @not_traced
    def __exit__(self, kind, value, traceback):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._forward is not None:
            forward, own = self._forward
            if own:
                self.model.forward = forward
            else:
                del self.model.forward
            self._forward = None
        self._ready = None
        self._to_trace.clear()
        for upass, _ in self._open:
            upass.close()
        self._open = []
        waiting, self._waiting = self._waiting, set()
        for upass in waiting:
            upass.close()
        if waiting and kind is None:
            warnings.warn(
                f"{self.caller}: {len(waiting)} recorded forward pass(es) of the model had "
                "no backward pass inside the block, so nothing was computed for them; call "
                "loss.backward() inside the block (or run the model in eval mode or under "
                "torch.no_grad() for what needs no gradient)",
                stacklevel=2,
            )
        return False

    @own_hook
    @not_traced
    def _pre_hook(self, module, args, kwargs):
        if self._probing or self._open or not (module.training and torch.is_grad_enabled()):
            return None
        x = _one_input(args, kwargs, self.caller)
        cp = self._plan(x)
        traced = self._traced_key(x, cp, None)
        call = self._compiled_call(x, cp, traced)
        if call is not None:
            call, self._ready = call
            self._open.append((call, None))
            return None
        upass = self._pass(x, cp, traced)
        root_call = (args, kwargs) if own_trainable(module) else None
        upass.start(x, root_call)
        self._open.append((upass, root_call))
        return None

    @own_hook
    @not_traced
    def _post_hook(self, module, args, kwargs, output):
        if self._probing or not self._open:
            return None
        upass, root_call = self._open.pop()
        if output is None:  # the forward pass raised
            upass.close()
            self._ready = None
            return None
        if isinstance(upass, CompiledCall):
            return self._hand_off(upass, output)
        out = upass.stop(output, root_call)
        return self._hand_off(upass, out)

    # ------------------------------------------------------------ one pass
    @not_traced
    def forward(self, x: Tensor, sample_mask: Tensor | None = None) -> Tensor:
        """Run the model on ``x`` recorded, its backward pass driven by memconv (the
        wrapper form of the block, for a module that calls the model itself).

        Args:
            x: the batch ``[N, ...]``.
            sample_mask: None, or a ``torch.bool`` tensor ``[N]`` on ``x``'s device:
                False marks a padded sample of a batch padded to a fixed size (masked
                DP-SGD, Beltran et al. 2024). The model runs on ``x`` with the padded
                samples' rows replaced by zeros (``torch.where``: a NaN or inf there
                reaches nothing), their output gradients are dropped in the backward
                pass (their clip factors and norms are 0), so they add nothing.

        Returns:
            The model's output, detached from its graph and attached to the node
            whose backward runs the pass (a padded sample's row: the model's output
            at a zero input).

        Raises:
            TypeError, ValueError: as :func:`memconv.clip_and_accumulate` for a bad
                ``sample_mask``, before any work.
        """
        _one_input((x,), {}, self.caller)
        check_sample_mask(sample_mask, len(x), x.device)
        if sample_mask is not None:
            x = zero_padded(x, sample_mask)
        cp = self._plan(x)
        traced = self._traced_key(x, cp, sample_mask)
        call = self._compiled_call(x, cp, traced)
        if call is not None:
            return self._hand_off(*call, sample_mask)
        upass = self._pass(x, cp, traced, sample_mask)
        return self._hand_off(upass, upass.forward(x), sample_mask)

    def _plan(self, x: Tensor) -> CallPlan:
        """Check the model and plan its pass on ``x`` (the probe, two forward passes of
        one and two samples, kept while the model and the input's shape do not change)."""
        self._probing = True  # the probe's calls of the model are not recorded
        try:
            checked = check_call(
                self._prepared,
                Batch(self.model, self._loss, x, x),
                task=self.task,
                caller=self.caller,
                strategy=self.strategy,
                memory_budget=None,
                norm_route=self.norm_route,
                clip_route=self.clip_route,
            )
            cp = self._prepared.call_plan(checked.batch, checked.request)
        finally:
            self._probing = False
        self._model = checked.batch.model  # (a compiled model's own module)
        if self._prepared.backend is not None and not self._warned_compiled:
            self._warn_eager()
        if self.memory_budget is not None:
            cp = replace(cp, plan=replace(cp.plan, layer_budget=self.memory_budget))
        return cp

    def _warn_eager(self) -> None:
        """Warn once that a compiled model runs eagerly in this block (where it has no
        traced step: :attr:`compiles`, for :attr:`eager_reason`)."""
        if self.compiles:
            return
        self._warned_compiled = True
        warn_user(
            f"{self.caller}: the model is torch.compile'd, but {self.eager_reason}: each "
            "step runs eagerly (the module the compiled model wraps, same parameters, "
            "the same numbers)."
        )

    def _pass(self, x: Tensor, cp: CallPlan, traced, sample_mask=None) -> UserPass:
        """The recorded pass of the call on ``x`` under ``cp``; where ``traced`` (the
        call's :meth:`_traced_key`) is not None, marked to be traced after its backward
        pass."""
        upass = UserPass(cp, self._model, self._visitor(cp, len(x), sample_mask))
        if traced is not None and traced[0] not in self._prepared.traced.refused:
            self._to_trace[upass] = traced
        return upass

    def _traced_key(self, x: Tensor, cp: CallPlan, sample_mask) -> tuple | None:
        """``(key, walk, extra)`` of the call's traced step, or None where it runs
        eagerly: an uncompiled model, the first call of a probe or of a step key
        (:meth:`memconv.engine.prepared.Prepared.seen_step`; called once per call), or
        no traced step of what this block computes."""
        prepared = self._prepared
        if prepared.backend is None or not self.compiles:
            return None
        walk, options = self._step_walk(padded=sample_mask is not None)
        extra = (*self._step_inputs(x.device), *(() if sample_mask is None else (sample_mask,)))
        options = (*options, self.memory_budget, self.loss_reduction)
        key = prepared.step_key(cp.request, options, (x, *extra))
        if not prepared.seen_step(key) or not prepared.reused:
            prepared.eager_call(cp.request, key)
            return None
        prepared.traced_call(cp.request)
        return key, walk, extra

    def _compiled_call(self, x: Tensor, cp: CallPlan, traced):
        """``(call, output)`` of the forward half of the call's traced step
        (:class:`CompiledCall`; ``traced``: the call's :meth:`_traced_key`), or None
        where there is none yet (or none at all)."""
        if traced is None:
            return None
        key, _, extra = traced
        steps = self._prepared.traced
        split = steps.splits.get(key)
        if split is None:
            return None
        try:
            output, saved = split.forward((x, *extra))
        except Exception as error:  # a compiler error at the first call: eagerly
            if split.forwards:
                raise
            del steps.splits[key]
            steps.refuse(key, self._model, f"the compiler failed: {first_line(error)}")
            return None
        return CompiledCall(split, key, saved, cp, len(x)), output

    def _hand_off(self, upass, out, sample_mask: Tensor | None = None) -> Tensor:
        n = upass.n if isinstance(upass, CompiledCall) else len(upass.inputs)
        if not isinstance(out, Tensor) or out.dim() == 0 or len(out) != n:
            upass.close()
            raise TypeError(
                f"{self.caller}: the model must return one tensor [N, ...] (batch axis "
                f"first), got {type(out).__name__}"
            )
        self._waiting.add(upass)
        receive = functools.partial(self._receive, upass, sample_mask=sample_mask)
        return Handoff.apply(receive, self._anchor, out.detach())

    @not_traced  # (called by autograd, in a step function Dynamo compiles too)
    def _receive(self, upass, grad_output: Tensor, sample_mask=None) -> None:
        self._waiting.discard(upass)
        self._backward(upass, grad_output, sample_mask)

    def _backward(self, upass, grad_output: Tensor, sample_mask=None) -> None:
        compiled = isinstance(upass, CompiledCall)
        n = upass.n if compiled else len(upass.inputs)
        scale = n if self.loss_reduction == "mean" else 1
        targets = grad_output.detach() * scale
        if sample_mask is not None:  # the padded samples' output gradients dropped
            targets = zero_padded(targets, sample_mask)
        if compiled:
            saved, upass.saved = upass.saved, None  # the backward half frees them
            try:
                result = upass.split.backward(saved, targets.contiguous())
            finally:
                upass.close()
            if upass.split.failed is not None:  # computed uncompiled; eagerly from now on
                steps = self._prepared.traced
                steps.splits.pop(upass.key, None)
                steps.refuse(upass.key, self._model, upass.split.failed)
            self._finish_traced(upass.cp, result, sample_mask)
            return
        inputs, traced = upass.inputs, self._to_trace.pop(upass, None)
        try:
            with torch.enable_grad():  # a backward node's own backward runs without
                keep = upass.cp.plan.clip_route == "two-pass"
                part = upass.backward(targets, keep_graph=keep)
                self._finish(upass.cp, part, scale)
        finally:
            upass.close()
        if traced is not None:  # the next calls run its two halves, compiled
            key, walk, extra = traced
            cp, model = upass.cp, self._model
            batch = Batch(model, self._loss, inputs, targets.contiguous())
            with torch.enable_grad():
                self._prepared.traced.trace_split(
                    key,
                    lambda b, *more: walk(cp, b, *more),
                    batch,
                    extra,
                    self._prepared.backend,
                    model,
                )

    # what each backward pass computes (subclasses)
    def _visitor(self, cp: CallPlan, n: int, sample_mask=None):
        raise NotImplementedError

    def _finish(self, cp: CallPlan, part, scale: int) -> None:
        raise NotImplementedError

    def _step_walk(self, padded: bool):
        """``(walk, options)`` of the traced step of what each backward pass computes
        (``walk(cp, batch, *extra)``, as :meth:`memconv.engine.prepared.Prepared.run_walk`
        takes it; ``padded``: the batch has a ``sample_mask``, its one extra tensor),
        where :attr:`compiles`."""
        raise NotImplementedError

    def _step_inputs(self, device) -> tuple:
        """The tensors the traced step takes before the ``sample_mask`` (what would
        otherwise be constants of its graph), on ``device``."""
        return ()

    def _finish_traced(self, cp: CallPlan, result, sample_mask) -> None:
        raise NotImplementedError


class Clipping(RecordedBackward):
    """:func:`memconv.clipping`'s block: each recorded backward pass adds the clipped sum
    to ``.grad`` (see :func:`memconv.clipping`).

    Attributes:
        norms: the per-sample norms before clipping of the last backward pass: ``[N]``,
            or ``{group: [N]}`` with ``groups`` other than ``"all"`` (0 for a padded
            sample of a :meth:`forward` with a ``sample_mask``).
        sample_mask: the ``sample_mask`` of the last backward pass's :meth:`forward`,
            or None.
        max_norm: the threshold(s); may be changed between steps.
    """

    task = "clip"
    compiles = True

    def __init__(self, model: nn.Module, *, max_norm, groups="all", caller: str, **options):
        super().__init__(model, caller=caller, **options)
        check_max_norm(max_norm)
        # checked before any work, on the names the walk gives (a torch.compile'd
        # model's own module: its parameters without the wrapper's prefix)
        resolve_groups(unwrap_compiled(model), groups, max_norm)
        self.max_norm, self.groups = max_norm, groups
        self.norms: Tensor | dict | None = None
        self.sample_mask: Tensor | None = None
        self._totals: dict = {}

    def _visitor(self, cp: CallPlan, n: int, sample_mask=None):
        grouping = resolve_groups(unwrap_compiled(self.model), self.groups, self.max_norm)
        total: dict = {}
        visitor = gatherer(cp, n, one_pass(cp, grouping, total, sample_mask))
        self._totals[id(visitor)] = (grouping, total, sample_mask)
        return visitor

    def _finish(self, cp: CallPlan, part, scale: int) -> None:
        grouping, total, mask = self._totals.pop(id(part.visitor))
        params = self._prepared.trainable()
        norms = clip_part(part, cp, grouping, params, total, mask)
        padded = mask is not None
        sums = total if cp.plan.clip_route == "two-pass" or padded else {}
        ensure_finite_results([norms], sums, cp.request.caller, padded=padded)
        self._deliver(total, joined(grouping, [norms]), mask)

    def _step_walk(self, padded: bool):
        grouping = self._grouping()
        params = self._prepared.trainable()
        options = (grouping.kind, tuple(grouping.of.items()), tuple(grouping.max_norm))
        return clipping_walk(grouping, params, padded, thresholds=True), options

    def _step_inputs(self, device) -> tuple:
        return (kept_thresholds(self._prepared, self._grouping(), device),)

    def _finish_traced(self, cp: CallPlan, result, sample_mask) -> None:
        total, parts, flag = result
        device = next(iter(total.values())).device if total else torch.device("cpu")
        check_step(
            flag,
            total,
            parts,
            caller=cp.request.caller,
            route=cp.plan.clip_route,
            padded=sample_mask is not None,
            on_device=device.type != "cpu",
        )
        self._deliver(total, joined(self._grouping(), parts), sample_mask)

    def _grouping(self):
        return resolve_groups(unwrap_compiled(self.model), self.groups, self.max_norm)

    def _deliver(self, total: dict, norms, sample_mask) -> None:
        """The backward pass's clipped sums added to ``.grad``, its norms kept."""
        self.sample_mask = sample_mask
        accumulate(self._prepared.trainable(), total, None)
        self.norms = norms


class Recording(RecordedBackward):
    """:func:`memconv.recording`'s block: each recorded backward pass keeps the
    per-sample gradients and norms and adds the ordinary gradient to ``.grad``.

    Attributes:
        grads: ``{name: [N, *param.shape]}``: each sample's own loss gradient, of the
            last backward pass.
        norms: their norms over all trainable parameters ``[N]``.
    """

    task = "grads"
    compiles = True

    def __init__(self, model: nn.Module, *, caller: str, **options):
        super().__init__(model, caller=caller, **options)
        self.grads: dict | None = None
        self.norms: Tensor | None = None
        self._outs: dict = {}

    def _visitor(self, cp: CallPlan, n: int, sample_mask=None):
        params = self._prepared.trainable()
        out: dict = {}
        visitor = RowWriter(out, slice(0, n), cp.rule_settings, whole=True, like=(params, n))
        self._outs[id(visitor)] = out
        return visitor

    def _finish(self, cp: CallPlan, part, scale: int) -> None:
        part.visitor.zero_rest()
        out = self._outs.pop(id(part.visitor))
        params = self._prepared.trainable()
        self._deliver({name: out[name] for name in params}, len(part.losses))

    def _step_walk(self, padded: bool):
        params = self._prepared.trainable()
        return (lambda cp, b, *mask: walked_grads(cp, b, params)), ()

    def _finish_traced(self, cp: CallPlan, result, sample_mask) -> None:
        self._deliver(result, cp.request.n)

    def _deliver(self, grads: dict, n: int) -> None:
        """The per-sample gradients and norms kept, their sum over the loss's reduction
        added to ``.grad`` (what ``loss.backward()`` adds)."""
        scale = n if self.loss_reduction == "mean" else 1
        sq = {k: squared(v) for k, v in grads.items()}
        self.grads = grads
        self.norms = total_sq(sq, n).sqrt()
        params = self._prepared.trainable()
        accumulate(params, {k: v.sum(0) / scale for k, v in grads.items()}, None)


def _one_input(args: tuple, kwargs: dict, caller: str) -> Tensor:
    """The model call's one input tensor ``[N, ...]``.

    Raises:
        TypeError: another call, or an input that requires grad (the pass computes the
            parameters' per-sample quantities, not an input gradient).
    """
    if kwargs or len(args) != 1 or not isinstance(args[0], Tensor) or args[0].dim() == 0:
        raise TypeError(
            f"{caller}: the model is called with one input tensor [N, ...] (batch axis "
            f"first): got {len(args)} positional and {len(kwargs)} keyword argument(s)"
        )
    if args[0].requires_grad:
        raise TypeError(
            f"{caller}: the model's input requires grad; the recorded pass computes the "
            "parameters' per-sample quantities, not an input gradient: pass x.detach()"
        )
    return args[0]


def _is_parallel(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel) or type(model).__name__ in (
        "DPDDP",
        "DifferentiallyPrivateDistributedDataParallel",
    )


@not_traced
def clipping(
    model: nn.Module,
    *,
    max_norm: float | dict,
    groups: str | dict = "all",
    loss_reduction: str = "mean",
    strategy: str | bool | None = None,
    memory_budget: int | None = None,
    norm_route: str | None = None,
    clip_route: str | None = None,
) -> Clipping:
    """A block in which ``loss.backward()`` adds DP-SGD's clipped sum
    Σₙ min(1, C/‖gₙ‖)·gₙ to ``.grad`` instead of the gradient, from the user's own
    forward and backward pass (one of each; see :mod:`memconv.tasks.recorded`).

    Example::

        with memconv.clipping(model, max_norm=1.0) as clip:
            for x, y in loader:
                optimizer.zero_grad()
                criterion(model(x), y).backward()   # .grad: the clipped sum
                noise_and_step(optimizer)           # DP-SGD's noise stays the user's
        clip.norms                                  # [N] of the last step

    ``gₙ`` is the gradient of sample n's own loss: ``∂L/∂outputₙ`` times N for
    ``loss_reduction="mean"`` (Opacus' convention), as is for ``"sum"``. The numbers
    are :func:`memconv.clip_and_accumulate`'s with the same loss; dropout keeps the
    mask of the user's forward pass.

    Args:
        model: the model, called with one input tensor ``[N, ...]`` and returning one
            tensor ``[N, ...]``; its calls in training mode with gradients enabled are
            recorded (in eval mode or under ``no_grad`` it runs as it is).
        max_norm: the threshold C, or ``{group: C_g}`` (see ``groups``).
        groups: as :func:`memconv.clip_and_accumulate` (``"all"``, ``"layer"``,
            ``"parameter"`` or ``{parameter name: group}``).
        loss_reduction: ``"mean"`` or ``"sum"``: how the criterion reduces the batch.
        strategy: the convolutions' weight-VJP strategy (None: the open block's).
        memory_budget: bytes each layer's route may use for its temporaries (None: the
            rules' defaults); the forward pass's activations are the user's.
        norm_route: ``"ghost"``, ``"instantiate"`` or None.
        clip_route: ``"book-keeping"`` (the default: one backward pass) or
            ``"two-pass"`` (a second backward pass through the kept graph).

    Returns:
        The :class:`Clipping` block (``.norms`` after each backward pass).

    Raises:
        TypeError, ValueError: bad arguments, before any work; at the model's call, a
            layer that mixes samples (BatchNorm in training mode), a call with other
            than one input tensor, an output without a batch axis.
        RuntimeError: at the backward pass, a non-finite per-sample norm (nothing is
            added to ``.grad``), a gradient that should arrive but does not.
    """
    return Clipping(
        model,
        max_norm=max_norm,
        groups=groups,
        caller="memconv.clipping",
        loss_reduction=loss_reduction,
        strategy=strategy,
        memory_budget=memory_budget,
        norm_route=norm_route,
        clip_route=clip_route,
    )


@not_traced
def recording(
    model: nn.Module,
    *,
    loss_reduction: str = "mean",
    strategy: str | bool | None = None,
    memory_budget: int | None = None,
) -> Recording:
    """A block in which ``loss.backward()`` also leaves each sample's gradient and its
    norm, from the user's own forward and backward pass (BackPACK's ``BatchGrad`` and
    ``BatchL2Grad``, Opacus' ``grad_sample``; see :mod:`memconv.tasks.recorded`).

    Example::

        with memconv.recording(model) as rec:
            criterion(model(x), y).backward()   # .grad as usual
        rec.grads["0.weight"]                   # [N, *weight.shape]
        rec.norms                               # [N]

    Args:
        model: as :func:`clipping`.
        loss_reduction: ``"mean"`` or ``"sum"``: how the criterion reduces the batch;
            ``grads[name][n]`` is the gradient of sample n's own loss either way.
        strategy, memory_budget: as :func:`clipping`.

    Returns:
        The :class:`Recording` block (``.grads`` and ``.norms`` after each backward
        pass; ``.grad`` gets the batch's gradient as ``loss.backward()`` gives it).

    Raises:
        As :func:`clipping`.
    """
    return Recording(
        model,
        caller="memconv.recording",
        loss_reduction=loss_reduction,
        strategy=strategy,
        memory_budget=memory_budget,
    )
