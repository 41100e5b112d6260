"""What a call of the public functions works out before its passes, and reuses on the
next call while nothing it depends on has changed.

Before its forward and backward passes a call checks the model, probes it (forward
passes of one and two samples: the batch axis of every layer call and the sizes the
memory plan needs, :func:`memconv.engine.planning.profile`), and plans micro-batches and
per-layer budgets (:func:`memconv.engine.planning.make_plan`). A :class:`Prepared` keeps
these and hands them to the next call while everything they depend on is the same:

- the model: its modules (the same objects, under the same names), each one's
  training mode and hooks (but a recorded block's own, which a block opened at every
  step registers anew and which change no call), its parameters (the same objects,
  their ``requires_grad``, shape, strides, dtype and device), and the global module
  hooks;
- the inputs' shape, dtype and device, and the autocast state;
- the task, the strategy's settings (the open :class:`memconv.save_memory` block's
  included), ``clip_route``, ``norm_route``, and the budget (a ``"available"``
  budget is read again: the plan is kept while its one pass over the whole batch
  still fits, and made again otherwise; the last reading serves the calls of the
  next :data:`REREAD_SECONDS` while the kept plan's predicted peak is within
  :data:`FAR_WITHIN` of it, so that a step of a millisecond does not read the
  kernel's files each time);
- the loss function (the same object) for the per-sample loss evaluation (a new loss
  object makes that afresh; the probe and the plan do not depend on the loss).

Any change makes a new probe or plan. The values of the parameters and inputs do not
enter any of them. The walk checks every recorded layer call of every pass against
the probe (the same module, the shapes the probe predicts for the batch); a call that
differs from a reused probe probes the model again and runs again from the start, so
a reused probe never gives a number a fresh one would not.

What the walks on a kept probe learn is kept with it (:class:`KeptWalk`): the coverage of
the parameters (:mod:`memconv.engine.coverage`), reused by a walk whose layer calls and
parameter uses are the last one's (the same modules and rules, the calls' windows and
the parameters' uses at the same autograd sequence numbers counted from the first call:
:func:`memconv.engine.coverage.assignment_key`); and, where every
call of an operation on parameters lay in a layer whose rule serves it (a model of
standard layers), the next walks record the layers' calls without the operation
recorder (:class:`memconv.engine.recorder.OpRecorder`), which would find nothing for
the routes; an operation call outside such a layer in a later pass (data-dependent
control flow) then goes to the generic or the model route, exact as well, and a
reversible block such a walk meets probes the model again. And a call to which the last
walk gave nothing to compute (a module whose own parameter an operation inside it
computes, as a layer scale or an NF-ResNet block's gain) keeps no arguments in the next
walks, which would hold them until the backward pass; should a later pass give it a
parameter after all, the call runs again from the start, and the walks on the probe
keep every call's arguments from then on.

The plain functions (:func:`memconv.per_sample_grads`, :func:`memconv.per_sample_norms`,
:func:`memconv.clip_and_accumulate`) keep one :class:`Prepared` per model
(:func:`kept_for`), as :class:`memconv.PrivateStep` keeps its own: a call with the same
model, shapes, dtype, device and options reuses the last call's checks, probe and plan.
The entry lives with the model and goes with it (a ``weakref`` to it dies with the model;
nothing global holds the model), is left out of copies and pickles of the model, and
serves one call at a time: a call made while another thread's call holds it works with
a fresh one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import Tensor, nn

from .._checks import AVAILABLE, check_grad_mode, warn_user
from .._torch import (
    buffers_restored,
    compile_backend,
    compiled_inner,
    global_module_hooks,
    module_hooks,
)
from ..conv.settings import Autocast
from ..layers import RuleSettings, check_layer, find_rule
from ..reversible.couplings import PASSES_ATTRIBUTE
from ..streaming import StreamingCNN
from .losses import PerSampleLoss
from .planning import Plan, Profile, make_plan, profile
from .probes import ArgumentsDropped, CallAxes, ProbeMismatch, owner_names
from .request import Batch, Request
from .resources import guards, resolve_budget
from .traced import ModuleAttributes, TracedSteps, loss_key, tensor_key


def unwrap_compiled(model):
    """The eager module a ``torch.compile``'d model (``OptimizedModule``) wraps: memconv
    runs its own forward and backward passes eagerly, with the same parameters."""
    inner = compiled_inner(model)
    return model if inner is None else inner


def check_per_sample_model(model: nn.Module, argument: str = "model", settings=None) -> nn.Module:
    """Check a model for per-sample quantities; returns the module to run (a
    ``torch.compile``'d model's eager module).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
        ValueError: naming the first layer that mixes samples (BatchNorm in training
            mode, or in eval mode without running statistics), or whose settings do
            not fit it.
        RuntimeError: under ``torch.no_grad()`` or ``torch.inference_mode()``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{argument} must be a torch.nn.Module, got {type(model).__name__}")
    check_grad_mode()
    model = unwrap_compiled(model)
    for name, module in model.named_modules():
        check_layer(module, name or type(module).__name__)
        rule = find_rule(module)
        if settings is not None and rule is not None:
            rule.check_settings(module, settings)
    return model


def model_streams(model: nn.Module) -> bool:
    """Whether ``model`` holds a :class:`memconv.streaming.StreamingCNN`."""
    return any(isinstance(m, StreamingCNN) for m in model.modules())


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): name}`` for trainable parameters, each under its first name
    (``named_parameters`` lists a parameter shared by two layers once)."""
    return {id(p): n for n, p in model.named_parameters() if p.requires_grad}


class _ModelState:
    """What of a model the probe and the plan depend on (see the module docstring),
    read at every call: two states are equal when their modules and parameters are the
    same objects with the same attributes.

    The record is one flat list (:attr:`key`), read from the modules' own tables in
    one pass and compared element by element: for each module (once, in
    ``named_modules``' order) its id, its training mode, how many attributes it holds
    but memconv's own (its kept records, a coupling's wrapper of its passes: one set on
    the module where its class held a default makes a new record, and so a new
    :class:`memconv.engine.traced.ModuleAttributes`), its hooks
    (:func:`memconv._torch.module_hooks`, memconv's own left out), its parameters'
    count, then each one's name, id, ``requires_grad``, shape, strides, dtype and device
    (a compiled step is specialised to the strides of the parameters it reads), and its
    children's names and ids; then the global module hooks. Objects are compared by id,
    never by ``==`` (a tensor's is elementwise); :attr:`objects` holds them, so that no
    id in a kept record can be another object's while the record lives. A compiled
    model's step is checked so at every call, where the step itself may take tens of
    microseconds.
    """

    __slots__ = ("model", "key", "objects", "_attributes")

    def __init__(self, model: nn.Module):
        self.model = model
        self._attributes = None
        key: list = []
        objects: list = []
        add = key.append
        seen: set = set()
        stack = [model]
        while stack:
            m = stack.pop()
            if m is None or id(m) in seen:
                continue
            seen.add(id(m))
            objects.append(m)
            add(id(m))
            add(m.training)
            d = m.__dict__  # how many attributes (one set on it: its record reads it too)
            add(len(d) - (KEPT_ATTRIBUTE in d) - (BLOCK_ATTRIBUTE in d) - (PASSES_ATTRIBUTE in d))
            add(module_hooks(m, own=False))
            table = m._parameters
            add(len(table))
            for k, p in table.items():
                add(k)
                add(id(p))
                if p is not None:
                    objects.append(p)
                    add(p.requires_grad)
                    add(p.shape)
                    add(p.stride())
                    add(p.dtype)
                    add(p.device)
            children = m._modules
            add(tuple(children))
            if children:
                add(tuple(map(id, children.values())))
                stack.extend(reversed(children.values()))
        add(global_module_hooks())
        self.key, self.objects = key, objects

    @property
    def attributes(self) -> ModuleAttributes:
        """The record of the modules' plain attributes
        (:class:`memconv.engine.traced.ModuleAttributes`), made at its first use."""
        if self._attributes is None:
            self._attributes = ModuleAttributes(self.model)
        return self._attributes

    def trainable(self) -> dict:
        """``{name: parameter}`` of the trainable parameters, in ``named_parameters``
        order (a parameter shared by two layers once, under its first name)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def __eq__(self, other) -> bool:
        return isinstance(other, _ModelState) and self.key == other.key


#: Seconds a reading of an ``"available"`` budget serves the calls that follow (see
#: the module docstring).
REREAD_SECONDS = 0.1
#: The fraction of the last reading a kept plan's predicted peak must be within for
#: that reading to serve the next calls.
FAR_WITHIN = 0.25
_clock = time.monotonic


@dataclass(eq=False)
class KeptWalk:
    """What the walks on one probe learned, for the next walks on it.

    Attributes:
        layers_only: whether a whole walk on the probe saw every call of an operation
            on parameters inside a layer whose rule serves it, and no reversible
            block: the next walks record without the operation recorder.
        layer_axes: the probe's :class:`memconv.engine.probes.CallAxes` of the layer
            calls alone (those of the operation calls left out), in forward order.
        assigned: ``(key, [each call's params], model route's parameters, calls per
            parameter)`` of the last walk's coverage
            (:func:`memconv.engine.coverage.assignment_key`, :func:`memconv.engine.coverage.assign`),
            reused by a walk whose key is equal; None before.
        released: ``(whether the walk recorded operations, {index in the forward
            order: module})`` of the layer calls to which the last walk that ran its
            own forward pass gave nothing to compute (a module whose parameters the
            calls inside it compute): the next such walk, recording alike, keeps no
            arguments for those calls, which would otherwise hold them until the
            backward pass; None before.
        keep_arguments: a walk's coverage gave such a call parameters after all
            (data-dependent uses of a parameter): every walk on the probe keeps every
            call's arguments.
    """

    layers_only: bool = False
    layer_axes: list = field(default_factory=list)
    assigned: tuple | None = None
    released: tuple | None = None
    keep_arguments: bool = False

    @classmethod
    def of(cls, axes: list[CallAxes]) -> KeptWalk:
        """A record for the probe whose calls' axes are ``axes``."""
        return cls(layer_axes=[a for a in axes if isinstance(a.module, nn.Module)])


@dataclass(frozen=True)
class CallPlan:
    """How one call runs.

    Attributes:
        request: what the call asks for.
        plan: the :class:`memconv.Plan` (micro-batch, per-layer budget, clip route).
        guard: whether :func:`memconv.engine.resources.process_budget` guards the call.
        axes: the batch axes of the parametrised calls (:func:`memconv.engine.probes.call_axes`).
        names: ``{id(parameter): name}`` of the trainable parameters.
        loss: the per-sample loss evaluation.
        owners: :func:`memconv.engine.probes.owner_names` of the model.
        params: ``{name: parameter}`` of the trainable parameters.
        kept: what the walks on the probe learned (:class:`KeptWalk`; None: nothing
            is kept).
    """

    request: Request
    plan: Plan
    guard: bool
    axes: list
    names: dict
    loss: PerSampleLoss
    owners: dict
    params: dict
    kept: KeptWalk | None = None

    @property
    def rule_settings(self) -> RuleSettings:
        """What the call's rules read (:func:`memconv.layers.rule_settings`): the
        strategy, the norm route, the plan's per-layer budget and its reference batch."""
        r = self.request
        plan = self.plan
        return RuleSettings(
            r.settings, r.norm_route, plan.layer_budget, reference=plan.reference_batch
        )


@dataclass(eq=False)
class Replay:
    """A task's last compiled step, run again by the next call of that task that asks
    for the same step (:meth:`Prepared.run_walk`): what the call's plan and step key
    were worked out from, and what they were.

    Attributes:
        request: the call's request (compared by ``==``).
        state: the model's kept state record (compared by identity: a change to the
            model makes a new record, :meth:`Prepared.check_model`).
        loss_fn: the call's loss function; a call's is the same object, or one of
            the same :attr:`loss`.
        loss: :func:`memconv.engine.traced.loss_key` of ``loss_fn``.
        options: the walk's options (by ``==``).
        attributes: the values of the model's modules' plain attributes, as a list
            (:meth:`memconv.engine.traced.ModuleAttributes.same`).
        tensors: :func:`memconv.engine.traced.tensor_key` of the step's tensors.
        autocast: the autocast state of the inputs' device.
        budget: the budget the plan was kept for (an ``"available"`` one is read again,
            as a call that plans does, and compared).
        call: the call's plan (:class:`CallPlan`).
        key: the step's key (:meth:`Prepared.step_key`).
        entry: the compiled step (:class:`memconv.engine.traced.TracedGraph`).
    """

    request: Request
    state: object
    loss_fn: object
    loss: object
    options: object
    attributes: list
    tensors: tuple
    autocast: object
    budget: object
    call: CallPlan
    key: tuple
    entry: object


class Prepared:
    """The checks, probe and plan of the last call, reused while their inputs are the
    same (see the module docstring).

    Attributes:
        probes: probes run so far (each two forward passes).
        plans: plans made so far.
        reused: whether the last call reused a probe.
        replays: calls that ran a task's last compiled step again without planning
            (:meth:`run_walk`, :class:`Replay`).
    """

    def __init__(self):
        self.probes = 0
        self.plans = 0
        self.reused = False
        self.replays = 0
        self._checked = None  # (model state, settings)
        self._model_key = None
        self._derived: dict = {}  # name -> (key, value), for the model last checked
        self._probe_key = None
        self._profile: Profile | None = None
        self._axes: list | None = None
        self._names: dict = {}
        self._owners: dict = {}
        self._params: dict = {}
        self._plans: dict = {}  # task -> (key, plan)
        self._plan: Plan | None = None
        self._loss: PerSampleLoss | None = None
        self._trainable: dict = {}
        self._streams = False
        self._walks: KeptWalk | None = None
        self._reading = None  # (time, device, bytes) of the last "available" budget
        self.backend = None  # the compiler backend of a torch.compile'd model
        self.traced = TracedSteps()
        self._seen: dict = {}  # the step keys of recent calls, oldest first
        self._warned: set = set()  # what the warnings of an eager compiled call named
        self._eager: dict = {}  # task -> EagerStreak of its calls run eagerly in a row
        self._budgeted = None  # (plan, budget, the plan with that budget)
        self._call: CallPlan | None = None  # the last call's
        self._budget_read = None  # the budget of the last call's plan
        self._replays: dict = {}  # task -> Replay of its last compiled step

    def forget(self) -> None:
        """Drop the probe and plan: the next call makes new ones."""
        self._checked = self._probe_key = self._profile = self._axes = self._plan = None
        self._plans = {}
        self._derived = {}
        self._walks = None
        self._replays = {}
        self.traced.forget()

    def run(self, call):
        """``call()``, run again from the start with a new probe if a reused probe no
        longer describes the model's layer calls (:class:`memconv.engine.probes.ProbeMismatch`)."""
        try:
            return call()
        except ArgumentsDropped:  # the walks now keep every call's arguments: once more
            return self.run(call)
        except ProbeMismatch:
            if not self.reused:
                raise
            self.forget()
            return call()

    def run_walk(self, batch: Batch, request: Request, walk, *, options=(), extra=()):
        """``walk(cp, batch, *extra)`` under the call's plan ``cp`` (:meth:`call_plan`),
        run again from the start where a reused probe no longer fits (:meth:`run`).

        For a ``torch.compile``'d model, a call on a kept probe and plan runs the walk as
        one compiled graph (:mod:`memconv.engine.traced`): traced at the first such call,
        then reused while the plan, ``options`` (what else the walk depends on besides
        tensor values: hashable) and the tensors' shapes, dtypes and devices are the
        same. ``walk`` must return a pytree of tensors and constants and leave no side
        effect but on what it returns.

        Args:
            batch: the call's model (unwrapped), loss and samples.
            request: what the call computes.
            walk: ``walk(cp, batch, *extra)``.
            options: the walk's further settings (part of the graph's key).
            extra: further tensors the walk reads (inputs of the graph).

        Once a task's step has run compiled, the next call of the task that asks for
        the same step runs it again without working out its plan and step key anew
        (:class:`Replay`): where the request, the model's state record, the loss, the
        options, the tensors' layouts, the autocast state and the budget (an
        ``"available"`` one read again as :meth:`call_plan` reads it) are the last
        call's, so are the plan and the key, and the compiled graph is called at once.
        Any other call of the task plans as above and drops the record. Calls of a task
        that each ask for a step not met before run eagerly, each of them; the
        :data:`EAGER_CALLS`-th in a row warns once per cause, naming what changed.
        """
        tensors = (batch.inputs, batch.targets, *extra)
        if self.backend is not None:
            replay = self._replays.pop(request.task, None)
            if replay is not None and self._replayable(replay, batch, request, options, tensors):
                self._replays[request.task] = replay
                self.replays += 1
                return replay.entry(tensors)

        def call():
            cp = self.call_plan(batch, request)
            if self.backend is None:
                return walk(cp, batch, *extra)
            loss = loss_key(batch.loss_fn)
            key = self.step_key(request, options, tensors, loss)
            if not self.seen_step(key) or not self.reused:
                self.eager_call(request, key)
                return walk(cp, batch, *extra)
            self.traced_call(request)
            result = self.traced.run(
                key,
                lambda b, *more: walk(cp, b, *more),
                batch,
                tuple(extra),
                self.backend,
                batch.model,
            )
            entry = self.traced.graphs.get(key)
            if entry is not None and entry.calls and key not in self.traced.refused:
                self._replays[request.task] = Replay(
                    request=request,
                    state=self._model_key,
                    loss_fn=batch.loss_fn,
                    loss=loss,
                    options=options,
                    attributes=list(key[5]),
                    tensors=tuple(map(tensor_key, tensors)),
                    autocast=self._probe_key[-1],
                    budget=self._budget_read,
                    call=cp,
                    key=key,
                    entry=entry,
                )
            return result

        return self.run(call)

    def _replayable(self, r: Replay, batch: Batch, request: Request, options, tensors) -> bool:
        """Whether the call is ``r``'s again (see :meth:`run_walk`); if so, the state
        :meth:`call_plan` and :meth:`seen_step` would leave is set as they would set it."""
        inputs = batch.inputs
        if not (
            r.state is self._model_key
            and (r.loss_fn is batch.loss_fn or r.loss == loss_key(batch.loss_fn))
            and r.request == request
            and r.options == options
            and r.tensors == tuple(map(tensor_key, tensors))
            and self._model_key.attributes.same(r.attributes)
            and r.autocast == Autocast.current(inputs.device.type)
        ):
            return False
        kept = self._plans.get(request.task)
        if kept is None or kept[1] is None:
            return False
        self._plan = kept[1]  # (what an "available" budget's reading compares)
        if self._budget(request, inputs.device, kept=True) != r.budget:
            return False
        self._call, self._budget_read, self.reused = r.call, r.budget, True
        if next(reversed(self._seen), None) is not r.key:
            self.seen_step(r.key)  # the key the most recent again
        return True

    def traced_call(self, request: Request) -> None:
        """Record that a call of a compiled model runs its task's traced step (the
        count of :meth:`eager_call` starts again)."""
        self._eager.pop(request.task, None)

    def eager_call(self, request: Request, key: tuple) -> None:
        """Count a call of a compiled model that runs eagerly for a step key met for
        the first time (or a new probe); at the :data:`EAGER_CALLS`-th such call of a
        task in a row, warn once per cause, naming what changed from the last call
        (where each call's step is new, none is ever compiled)."""
        last = self._eager.get(request.task)
        calls = 1 if last is None else last.calls + 1
        self._eager[request.task] = streak = EagerStreak(calls, key, self._probe_key)
        if last is None or calls < EAGER_CALLS:
            return
        causes = [c for c in _changed(last, streak) if c not in self._warned]
        if not causes:
            return
        self._warned.update(causes)
        what = "; ".join(f"{CHANGES[c][0]} ({CHANGES[c][1]})" for c in causes)
        warn_user(
            f"{request.caller}: the torch.compile'd model's last {calls} calls ran "
            "eagerly: each asked for a step not met before, and a step is traced at its "
            "second call and compiled from its third. What changed from call to call: "
            f"{what}."
        )

    def step_key(self, request: Request, options, tensors, loss=None) -> tuple:
        """What a traced step of ``request`` depends on besides its tensors' values:
        the task and its plan's choices (:meth:`memconv.engine.planning.Plan.walk_key`:
        a batch size that comes back finds its step again), ``options`` (hashable), the
        tensors' shapes, strides, dtypes and devices
        (:func:`memconv.engine.traced.tensor_key`), ``loss``, what the loss
        function the step calls computes (:func:`memconv.engine.traced.loss_key`: its
        operations are in the graph; None for a step the loss is not part of), and the
        values of the modules' plain attributes
        (:class:`memconv.engine.traced.ModuleAttributes`: the graph holds them as
        constants). The steps of an earlier probe are dropped with it."""
        plan = self._plans.get(request.task, (None, None))[1]
        return (
            request.task,
            None if plan is None else plan.walk_key(),
            request.key(),
            options,
            loss,
            self._attributes(),
            *(tensor_key(t) for t in tensors),
        )

    def _attributes(self) -> tuple:
        """The values of the plain attributes of the modules of the model last checked
        (:class:`memconv.engine.traced.ModuleAttributes`, its record kept while the model's
        state is)."""
        return self._model_key.attributes.values()

    def seen_step(self, key) -> bool:
        """Whether a call with the step key ``key`` came before (among the last
        :data:`KEPT_STEPS` keys), recording this call's. A compiled model's step is
        traced at the second call of its key, compiled at the third: a key met once
        (a batch of a size that does not come back) runs eagerly, traced for nothing."""
        seen = key in self._seen
        self._seen.pop(key, None)
        self._seen[key] = None
        while len(self._seen) > KEPT_STEPS:
            del self._seen[next(iter(self._seen))]
        return seen

    @property
    def plan(self) -> Plan | None:
        """The plan of the last call (None before the first)."""
        return self._plan

    def check_model(self, model: nn.Module, settings) -> nn.Module:
        """:func:`check_per_sample_model`, its layer checks run again only when the
        model or the settings changed; returns the module to run."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_grad_mode()
        self.backend = compile_backend(model)
        model = unwrap_compiled(model)
        state = _ModelState(model)
        if self._checked is not None and self._checked == (state, settings):
            state = self._checked[0]  # the kept record: later comparisons are by identity
        else:
            check_per_sample_model(model, settings=settings)
            self._checked = (state, settings)
            self._derived = {}
            self._trainable = state.trainable()
            self._streams = model_streams(model)
            if self.backend is not None and self._streams:
                warn_user(
                    "memconv: the torch.compile'd model holds a StreamingCNN, whose per-sample "
                    "quantities memconv computes one sample at a time, eagerly: the step is "
                    "not compiled. Pass the uncompiled model to silence this warning."
                )
        self._model_key = state
        return model

    def derived(self, name: str, key, make: Callable):
        """``make()``, a value derived from the model last checked (:meth:`check_model`)
        and from ``key`` (compared by ``==``: immutable values only), kept under
        ``name`` while the model, its settings and ``key`` stay the same (a grouping of
        the parameters, for instance: worked out again only when the model changed)."""
        kept = self._derived.get(name)
        if kept is not None and kept[0] == key:
            return kept[1]
        value = make()
        self._derived[name] = (key, value)
        return value

    def trainable(self) -> dict:
        """``{name: parameter}`` of the trainable parameters of the model last checked
        (:meth:`check_model`), in ``named_parameters`` order."""
        return dict(self._trainable)

    @property
    def streams(self) -> bool:
        """Whether the model last checked holds a :class:`memconv.streaming.StreamingCNN`
        (:func:`model_streams`)."""
        return self._streams

    def call_plan(self, batch: Batch, request: Request) -> CallPlan:
        """The plan of ``request`` on ``batch`` (after :meth:`check_model` of its model):
        the probe and the plan kept from the last call where nothing they depend on
        changed, new ones otherwise."""
        inputs = batch.inputs
        device = inputs.device
        autocast = Autocast.current(device.type)
        probe_key = (self._model_key, tuple(inputs.shape[1:]), inputs.dtype, device, autocast)
        self.reused = probe_key == self._probe_key
        if not self.reused:
            self._probe(batch.model, inputs)
            self._probe_key = probe_key
        if self._loss is None or self._loss.loss_fn is not batch.loss_fn:
            self._loss = PerSampleLoss(batch.loss_fn)
        plan_key = request.key()  # (the plan does not read the caller's name)
        kept_key, self._plan = self._plans.get(request.task, (None, None))
        budget = self._budget(request, device, kept=plan_key == kept_key)
        if plan_key != kept_key or not self._still_fits(budget, request):
            # a new plan of a task already planned (another task's first one is not)
            changed = kept_key is not None and self.backend is not None
            if changed and self.traced.traces and "plan" not in self._warned:
                self._warned.add("plan")
                warn_user(
                    f"{request.caller}: the torch.compile'd model's call needs a new plan "
                    f"(a batch of {request.n} samples, or another budget or setting than "
                    "its traced step's): a step of a new plan runs eagerly at its first "
                    "call and is traced and compiled at its next ones, so batches whose "
                    "size changes from call to call (Poisson sampling) never run "
                    "compiled. Pad them to one size and pass sample_mask= "
                    "(memconv.integrations.opacus.FixedSizePoissonLoader)."
                )
            self._plan = make_plan(self._profile, request, budget=budget)
            self._plans[request.task] = (plan_key, self._plan)
            self.plans += 1
        plan = self._plan
        self._budget_read = budget
        if budget is not None and plan.memory_budget != budget:
            budgeted = self._budgeted  # (plan, budget, the plan with that budget)
            if budgeted is None or budgeted[0] is not plan or budgeted[1] != budget:
                self._budgeted = budgeted = (plan, budget, replace(plan, memory_budget=budget))
            plan = budgeted[2]
        last = self._call
        if (  # the last call's record where all it holds is the same (most steps)
            last is not None
            and last.plan is plan
            and last.loss is self._loss
            and last.axes is self._axes
            and last.kept is self._walks
            and last.request == request
        ):
            return last
        self._call = CallPlan(
            request=request,
            plan=plan,
            guard=guards(request.memory_budget, plan if budget is not None else None),
            axes=self._axes,
            names=self._names,
            loss=self._loss,
            owners=self._owners,
            params=self._params,
            kept=self._walks,
        )
        return self._call

    def _budget(self, request: Request, device, kept: bool):
        """The call's budget in bytes (None: none): an ``"available"`` budget read again
        (:func:`memconv.engine.resources.resolve_budget`), or the last reading where it
        is younger than :data:`REREAD_SECONDS` and the kept plan (``kept``: the
        request's) predicts a peak within :data:`FAR_WITHIN` of it."""
        if request.memory_budget != AVAILABLE:
            return request.memory_budget
        now = _clock()
        last, p = self._reading, self._plan
        if (
            kept
            and last is not None
            and p is not None
            and last[1] == device
            and now - last[0] < REREAD_SECONDS
            and p.predicted_peak <= FAR_WITHIN * last[2]
        ):
            return last[2]
        budget = resolve_budget(request.memory_budget, device)
        self._reading = (now, device, budget)
        return budget

    def _probe(self, model: nn.Module, inputs: Tensor) -> None:
        """Probe ``model`` on ``inputs`` (:func:`memconv.engine.planning.profile`), and
        forget the plans made on the last probe."""
        with buffers_restored(model):  # (the probe's passes are not the user's)
            self._profile = profile(model, inputs)
        self._axes = self._profile.axes()
        self._names = parameter_names(model)
        self._params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._owners = owner_names(model)
        self.probes += 1
        self._plans = {}
        self._walks = KeptWalk.of(self._axes)
        self._replays = {}
        self.traced.forget()

    def _still_fits(self, budget, request: Request) -> bool:
        """Whether the plan a fresh one would be is the kept one (an ``"available"``
        budget, read again: the kept plan, the lean one pass
        (:attr:`memconv.Plan.lean_target`), fits)."""
        if request.memory_budget != AVAILABLE:
            return True
        p = self._plan
        return (
            p is not None
            and p.micro_batch == p.batch
            and p.lean_target is not None
            and p.predicted_peak <= budget
            and (
                p.task != "clip" or request.clip_route is not None or p.clip_route == "book-keeping"
            )
        )


@dataclass(frozen=True)
class EagerStreak:
    """A task's calls in a row that a compiled model ran eagerly, each for a step key
    met for the first time (:meth:`Prepared.run_walk`).

    Attributes:
        calls: how many.
        key: the last one's step key (:meth:`Prepared.step_key`).
        probe: the last one's probe key (the model's state record, the samples' shape,
            the inputs' dtype and device, the autocast state).
    """

    calls: int
    key: tuple
    probe: tuple


#: Calls of a task in a row that a compiled model runs eagerly, each for a new step,
#: before :meth:`Prepared.run_walk` warns (a step met at every call from the first is
#: compiled at the third).
EAGER_CALLS = 3

#: ``{cause: (what changed, the remedy)}`` of the warning of :data:`EAGER_CALLS`.
CHANGES = {
    "model": (
        "the model: its modules, their training mode or hooks, or its parameters (the "
        "objects, requires_grad, shapes, strides, dtypes or devices)",
        "change the parameters' values in place, as an optimizer does",
    ),
    "inputs": (
        "the inputs' shape, dtype or device, or the autocast state",
        "give every step inputs of one shape",
    ),
    "plan": (
        "the batch size, the budget or a setting",
        "pad batches to one size and pass sample_mask= "
        "(memconv.integrations.opacus.FixedSizePoissonLoader)",
    ),
    "options": ("the groups", "keep the groups= argument the same"),
    "loss": (
        "what the loss function computes: its class, attributes, parameters, or its "
        "closure's or defaults' values",
        "pass one loss function (a closure over a value changed at every step makes a "
        "new step at every step)",
    ),
    "attributes": (
        "a plain attribute of a module of the model (a number, string or tuple: a "
        "layer's scale, a counter), which a compiled step holds as a constant",
        "keep it the same from step to step, or make a value that changes a buffer",
    ),
    "tensors": (
        "the tensors' shapes, strides, dtypes or devices",
        "give every step tensors of one shape and layout",
    ),
}


def _changed(last: EagerStreak, now: EagerStreak) -> list[str]:
    """The causes (:data:`CHANGES`) that differ between two calls' step and probe keys."""
    a, b = last.probe, now.probe  # (the model's state record, shape, dtype, device, autocast)
    causes = ["model"] if a[0] is not b[0] else []
    if a[1:] != b[1:]:
        causes.append("inputs")
    k, j = last.key, now.key  # (task, plan, request, options, loss, attributes, *tensors)
    parts = {"plan": slice(0, 3), "options": slice(3, 4), "loss": slice(4, 5)}
    parts.update(attributes=slice(5, 6), tensors=slice(6, None))
    causes += [c for c, s in parts.items() if k[s] != j[s]]
    return causes


#: How many recent step keys :meth:`Prepared.seen_step` remembers.
KEPT_STEPS = 16

#: The attribute of a model under which the plain functions keep its :class:`Prepared`.
KEPT_ATTRIBUTE = "_memconv_prepared"
_kept_lock = threading.Lock()


#: The attribute of a model under which the recorded blocks keep its :class:`Prepared`.
BLOCK_ATTRIBUTE = "_memconv_block_prepared"


def kept_for_blocks(model: nn.Module) -> Prepared:
    """The :class:`Prepared` the recorded blocks on ``model`` (:mod:`memconv.tasks.recorded`)
    share from one block to the next, kept on the model as :func:`kept_for`'s (so that a
    block opened at every step reuses the probe, the plan and a compiled model's traced
    step); a fresh one where the model takes no attributes."""
    kept = getattr(model, "__dict__", {}).get(BLOCK_ATTRIBUTE)
    if isinstance(kept, _Kept):
        return kept.prepared
    kept = _Kept()
    try:
        model.__dict__[BLOCK_ATTRIBUTE] = kept
    except (AttributeError, TypeError):
        pass
    return kept.prepared


class _Kept:
    """A model's kept :class:`Prepared` and the lock of the call using it. Left out of
    the model's copies and pickles (a copy, or a model loaded elsewhere, makes its own;
    loading needs no memconv)."""

    def __init__(self):
        self.prepared = Prepared()
        self.lock = threading.Lock()

    def __reduce__(self):
        return (dict, ())

    def __deepcopy__(self, memo):
        return _Kept()

    def __copy__(self):
        return _Kept()


@contextlib.contextmanager
def kept_for(model):
    """The :class:`Prepared` the plain functions keep for ``model`` (see the module
    docstring), held for the block; a fresh one where it cannot be kept (another
    thread's call holds it, or the object takes no attributes).

    The entry is an attribute of the model itself, not a global table: a global
    ``WeakKeyDictionary`` cannot free an entry whose value refers to its key (the probe
    refers to the model's modules, the loss may), so it would keep every model alive;
    on the model, the entry goes with it."""
    kept = (
        getattr(model, "__dict__", {}).get(KEPT_ATTRIBUTE) if isinstance(model, nn.Module) else None
    )
    if not isinstance(kept, _Kept) and isinstance(model, nn.Module):
        with _kept_lock:
            kept = model.__dict__.get(KEPT_ATTRIBUTE)
            if not isinstance(kept, _Kept):
                kept = _Kept()
                try:
                    model.__dict__[KEPT_ATTRIBUTE] = kept
                except (AttributeError, TypeError):
                    kept = None
    if kept is None or not kept.lock.acquire(blocking=False):
        yield Prepared()
        return
    try:
        yield kept.prepared
    finally:
        kept.lock.release()
