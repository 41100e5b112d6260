"""One forward and one backward pass that hand every layer call's output gradient to a
route: the layer's rule, the generic route, or the model route.

How each trainable parameter is covered is **checked, not assumed**. The forward pass
(:meth:`BackwardWalk.forward`) records every call of a module that owns trainable
parameters: its arguments, the batch axis of each argument and output (from a probe
of one and two samples, :mod:`memconv.engine.probes`, checked against it call by call), and
the window of autograd nodes the call created (their sequence numbers), as a
:class:`memconv.engine.calls.LayerCall`; and every call of an operation with a rule on
parameters (:class:`memconv.engine.recorder.OpRecorder`) as a :class:`memconv.engine.calls.OpCall`.
Before the backward pass, every use of a parameter in the graph of the loss is
attributed to the innermost call that can differentiate it, or to the model route
(:mod:`memconv.engine.coverage`). The backward pass then hands each call, once its output
gradients have arrived, to the visitor (:class:`_Visits`), and the final checks
(:meth:`BackwardWalk.check`) raise for an output gradient that never arrived.
Autograd itself computes no parameter gradient in the walk.

A reversible block (:class:`memconv.reversible.InvertibleModuleWrapper`) runs its layers
without gradients in the forward pass and again in its backward pass. The walk is the
blocks' observer (:func:`memconv.reversible.recompute.observing`): the forward pass
records each block's call as a :class:`memconv.engine.calls.BlockCall` (the uses of the
block's parameters are attributed to it), and when the block's backward pass runs, the
walk takes its recomputation over (:meth:`BackwardWalk.recompute_block`): a walk of the
block alone, its output gradients given, whose forward pass records the block's layer
calls (their batch axes those the probe saw in the model's forward pass) and whose
backward pass visits them and returns the gradients of the block's inputs; then the
calls are released, so a chain of blocks holds the calls of one block at a time.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._torch import is_view, new_sequence_nr
from ..conv.settings import Autocast
from ..layers import own_trainable
from ..layers.operations import BoundOp
from ..reversible.recompute import observing, vjp
from . import coverage
from .calls import BlockCall, CallRecord, LayerCall, OpCall, WalkState, op_call
from .losses import PerSampleLoss
from .probes import (
    ArgumentsDropped,
    CallAxes,
    ProbeMismatch,
    check_call_axes,
    flatten_call,
    leaf_shapes,
    owner_names,
    unflatten_call,
)
from .recorder import OpRecorder, paused


class _Sequence:
    """Sequence numbers of autograd nodes created from now on."""

    def now(self) -> int:
        """A number between the sequence numbers of the nodes made before the call and
        those made after it (a window ``(lo, hi)`` holds the nodes with ``lo < s < hi``),
        without a tensor operation (:func:`memconv._torch.new_sequence_nr`)."""
        return new_sequence_nr()


@dataclass
class Walk:
    """What :func:`backward_walk` found: the calls and how parameters are covered.

    Attributes:
        losses: the per-sample losses ``[N]`` (with their graph if kept).
        calls: every recorded layer call.
        model_params: model names of the parameters left to the model route.
        calls_per_param: ``{model name: number of calls whose route computes it}``.
    """

    losses: Tensor
    calls: list
    model_params: list
    calls_per_param: dict


def backward_walk(
    model: nn.Module,
    loss_fn,
    inputs: Tensor,
    targets,
    names: dict,
    axes: list[CallAxes],
    visit: Callable[[LayerCall], None],
    *,
    caller: str,
    keep_graph: bool = False,
    prepare: Callable[[list[LayerCall]], None] | None = None,
    owners: dict | None = None,
    kept=None,
) -> Walk:
    """One forward and one backward pass in which every layer call's output gradient
    reaches ``visit`` (once per call, then dropped); autograd computes no parameter
    gradient. Parameters no call can cover are left to the model route.

    Args:
        model: the model.
        loss_fn: the loss (or a :class:`memconv.engine.losses.PerSampleLoss` of it), see
            :func:`memconv.engine.losses.per_sample_losses`.
        inputs: ``[m, ...]`` (detached for the pass).
        targets: ``[m, ...]``.
        names: ``{id(parameter): model name}`` of the trainable parameters.
        axes: :func:`memconv.engine.probes.call_axes` of the model's probe
            (:meth:`memconv.engine.planning.Profile.axes`).
        visit: called with each :class:`memconv.engine.calls.LayerCall` whose route computes at
            least one parameter, during the backward pass, once the call's output
            gradients have arrived; it may return work to run once the call's
            backward node has run (see :class:`_Visits`).
        caller: the public function's name, for messages.
        keep_graph: keep the graph for a second backward pass of the losses.
        prepare: called with the calls ``visit`` will get, in forward order, before
            the backward pass.
        owners: :func:`memconv.engine.probes.owner_names` of the model, if known.
        kept: what the walks on the same probe learned
            (:class:`memconv.engine.prepared.KeptWalk`), or None.

    Returns:
        The :class:`Walk`.

    Raises:
        ValueError: a ``loss_fn`` that does not return a scalar per sample; a call
            whose output reaches the loss but has no batch axis.
        RuntimeError: an output gradient that should have arrived but did not.
    """
    per_sample = loss_fn if isinstance(loss_fn, PerSampleLoss) else PerSampleLoss(loss_fn)
    if owners is None:
        owners = owner_names(model)
    walk = BackwardWalk(
        model, names, axes, visit, caller=caller, owners=owners, m=len(inputs), kept=kept
    )
    return walk.run(per_sample, inputs, targets, keep_graph=keep_graph, prepare=prepare)


class BackwardWalk:
    """One walk: the forward pass recorded through hooks (:meth:`forward`:
    :meth:`pre_hook`, :meth:`forward_hook`, :meth:`on_op`), then, once the per-sample
    losses exist, :meth:`finish`: the parameters' uses attributed (:meth:`attribute`),
    the backward pass (:meth:`backward`) and the final checks (:meth:`check`).

    :func:`backward_walk` runs both halves on memconv's own forward pass; a pass whose
    forward the user runs (:class:`memconv.engine.passes.UserPass`) calls
    :meth:`forward` from the model's call and :meth:`finish` from the backward pass the
    user's ``loss.backward()`` starts.

    Attributes:
        calls: the calls recorded so far, in forward order.
        seq: sequence numbers of the autograd nodes (a call's window).
        starts: ``{module: [(first sequence number, args, kwargs)]}`` of its open calls.
        ours: ids of memconv's own hooks.
        unseen: ``{module: name}`` of calls made with gradients disabled.
        visits: hands each call to the visitor.
        index: the number of calls counted so far (the next call's place in ``axes``).
        open_modules: the modules whose calls are open, innermost last.
        covering: see :func:`memconv.engine.coverage.covered_by_module`.
        grad_hooks: the handles of the hooks on the captured outputs, removed when
            the walk ends (a hook on an output that a node below the captured ones
            saved would otherwise keep that part of the graph, the visitor and
            its results alive in a cycle through autograd that Python's collector
            cannot see).
        kept: what the walks on the same probe learned
            (:class:`memconv.engine.prepared.KeptWalk`), or None. Where they learned
            that the model's operation calls on parameters all lie in layers whose
            rules serve them, this walk records the layer calls alone, against the
            probe's axes of those (no operation recorder); otherwise it records
            with the recorder and, if it finds the same, says so in ``kept`` once
            it has ended without error.
        layers_only: whether every operation call so far lay in a layer whose rule
            serves it (and no reversible block was called).
    """

    def __init__(self, model, names, axes, visit, *, caller: str, owners: dict, m: int, kept=None):
        self.kept = kept
        self.recording_ops = kept is None or not kept.layers_only
        if not self.recording_ops:
            axes = kept.layer_axes
        self.layers_only = True
        self.model, self.names, self.axes = model, names, axes
        self.caller, self.owners, self.m = caller, owners, m
        self.calls: list[LayerCall] = []
        self.seq = _Sequence()
        self.starts: dict = {}
        self.ours: set = set()
        self.unseen: dict = {}
        self.visits = _Visits(visit)
        self.index = 0
        self.open_modules: list = []
        self.covering: dict = {}
        self.recorder: OpRecorder | None = None
        self.grad_hooks: list = []
        self.handles: list = []  # the recording hooks (see start)
        self.observe = None  # the observing block of reversible blocks (see start)
        self.in_backward = False  # the blocks' backward passes are this walk's
        self.result: Walk | None = None  # the model's walk (a block's walk adds to it)
        self.prepare: Callable | None = None
        self.block_names: dict | None = None
        # {model name: calls computing it} of this walk, and of the walks around a block's
        self.counts: dict = {}
        self.shared_counts: dict = {}
        self.open_blocks: list = []
        self.own_forward = False  # the walk runs the model's forward pass itself (run)
        self.indices: dict = {}  # {layer call: its index in the forward order}

    def run(self, per_sample, inputs, targets, *, keep_graph: bool, prepare) -> Walk:
        """Both halves on memconv's own forward pass of ``inputs``."""
        self.own_forward = True
        try:
            losses = per_sample(self.forward(inputs), targets)
        except BaseException:
            self.close()
            raise
        return self.finish(losses, keep_graph=keep_graph, prepare=prepare)

    def finish(self, losses: Tensor, *, keep_graph: bool, prepare=None) -> Walk:
        """The backward half, from the per-sample losses ``[m]`` of the recorded
        forward pass: every call visited as its output gradients arrive; then the walk
        is closed (:meth:`close`).

        Args:
            losses: the per-sample losses, with their graph.
            keep_graph: keep the graph for a second backward pass of the losses.
            prepare: called with the calls the visitor will get, in forward order,
                before the backward pass.
        """
        try:
            walk = Walk(
                losses=losses if keep_graph else losses.detach(),
                calls=self.calls,
                model_params=[],
                calls_per_param={},
            )
            if losses.grad_fn is None:
                return walk
            self.result, self.prepare = walk, prepare
            reachable, uses = self.attribute([losses.grad_fn], walk)
            if prepare is not None:
                prepare(self.to_visit())
            self.backward([losses.sum()], [None], reachable, keep_graph)
            self.check(uses)
            if self.kept is not None and self.recording_ops and self.layers_only:
                self.kept.layers_only = True
            if self.kept is not None and self.own_forward and not self.kept.keep_arguments:
                idle = {i: c.module for c, i in self.indices.items() if not c.params}
                self.kept.released = (self.recording_ops, idle)
            return walk
        finally:
            self.close()

    def to_visit(self) -> list:
        """The calls the visitor will get (a reversible block's call is not one: its
        layers' calls are, in its own walk)."""
        return [c for c in self.calls if not c.state.done and not isinstance(c, BlockCall)]

    def close(self) -> None:
        """Remove the hooks on the captured outputs and break the walk's cycles (the
        recorder calls back into the walk), so that nothing keeps the visitor and the
        results it holds alive until Python's collector runs."""
        self.stop()
        for handle in self.grad_hooks:
            handle.remove()
        self.grad_hooks, self.recorder, self.visits.visit = [], None, None

    def forward(self, inputs: Tensor):
        """The model's output on ``inputs`` (detached), every call of a parametrised
        module or an operation with a rule recorded."""
        self.start()
        try:
            return self.model(inputs.detach())
        finally:
            self.stop()

    def start(self, outside: nn.Module | None = None) -> None:
        """Record the calls made from now on (until :meth:`stop`): hooks on the modules
        owning trainable parameters, but ``outside`` (a module whose call has begun: its
        caller hands that call to :meth:`pre_hook` and :meth:`forward_hook` itself), and
        the operation recorder."""
        for o in self.owners:  # (dict order: the model's modules)
            if o is outside:
                continue
            pre = o.register_forward_pre_hook(self.pre_hook, with_kwargs=True, prepend=True)
            post = o.register_forward_hook(self.forward_hook, with_kwargs=True)
            self.handles += [pre, post]
            self.ours.update((pre.id, post.id))
        if self.recording_ops:
            self.recorder = OpRecorder(self.model, self.on_op)
            self.recorder.__enter__()
        self.observe = observing(self)  # reversible blocks report their calls here
        self.observe.__enter__()

    def stop(self) -> None:
        """Stop recording (see :meth:`start`)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.observe is not None:
            self.observe.__exit__(None, None, None)
            if self.recorder is not None:
                self.recorder.__exit__(None, None, None)
                self.recorder.pure = {}  # the forward pass's tensors, no longer needed
            self.observe = None

    @contextlib.contextmanager
    def recording(self):
        """:meth:`start` … :meth:`stop` as a block."""
        self.start()
        try:
            yield
        finally:
            self.stop()

    def pre_hook(self, module, args, kwargs):
        # first of the module's pre-hooks: the call's arguments as the caller gave them,
        # which the generic route replays through the whole call, hooks included
        with paused():
            self.starts.setdefault(module, []).append((self.seq.now(), args, kwargs))
        self.open_modules.append(module)

    def on_op(self, func, bound: BoundOp, run):
        index = self.index
        self.index += 1
        inside = self.open_modules[-1] if self.open_modules else None
        # the body of a layer whose rule serves it: checked, but no call of its own
        covered = inside is not None and coverage.covered_by_module(
            inside, bound, self.ours, self.covering
        )
        if not covered:
            self.layers_only = False
        start = None if covered else self.seq.now()
        out = run()
        if not (isinstance(out, Tensor) and out.requires_grad):
            return out
        if index >= len(self.axes):
            raise ProbeMismatch(f"{self.caller}: the model calls more layers than in its probe")

        def name():
            where = self.owners[inside] if inside is not None else type(self.model).__name__
            return f"{where}: {getattr(func, '__name__', func)}"

        data_shape = [tuple(bound.data.shape)]
        check_call_axes(self.axes[index], func, data_shape, leaf_shapes([out]), self.m, name)
        if covered:
            return out
        if bound.before is not None:  # in place: the data as it was, else no call
            data = bound.before(out)
            if data is None or is_view(out):
                return out
            bound = replace(bound, data=data)
        window = (start, self.seq.now())
        call = op_call(bound, out, self.axes[index], name(), window, self.recorder, self.names)
        if call is None:
            return out
        self.calls.append(call)
        if is_view(out):
            out = out.clone()
        self.grad_hooks.append(out.register_hook(self.visits.hook(call, 0)))
        call.state.edges.append((0, get_gradient_edge(out)))
        return out

    def _released(self, index: int, module: nn.Module) -> bool:
        """Whether the layer call at ``index`` (of ``module``) keeps no arguments: the
        walk runs its own forward pass, and the last such walk on the probe, recording
        as this one does, gave the call at that index, of the same module, nothing to
        compute (:attr:`memconv.engine.prepared.KeptWalk.released`). If this walk's
        coverage gives it parameters after all, :meth:`attribute` raises
        :class:`memconv.engine.probes.ArgumentsDropped` (the walks on the probe keep
        every call's arguments from then on, and the call runs again)."""
        kept = self.kept if self.own_forward else None
        released = kept.released if kept is not None and not kept.keep_arguments else None
        if released is None or released[0] != self.recording_ops:
            return False
        return released[1].get(index) is module

    def forward_hook(self, module, args, kwargs, output):
        with paused():
            return self.record_call(module, args, kwargs, output)

    def record_call(self, module, args, kwargs, output):
        start, given_args, given_kwargs = self.starts[module].pop()
        self.open_modules.pop()
        others = coverage.hooked(module, self.ours)
        if others:  # a pre-hook may have replaced the arguments
            args, kwargs = given_args, given_kwargs
        index = self.index
        self.index += 1
        name = self.owners[module]
        out_leaves, out_spec = flatten_call(output)
        if not any(isinstance(t, Tensor) and t.requires_grad for t in out_leaves):
            if not torch.is_grad_enabled():  # inside a no-grad region of the model
                self.unseen[module] = name
            return None
        end = self.seq.now()
        if index >= len(self.axes):
            raise ProbeMismatch(f"{self.caller}: the model calls more layers than in its probe")
        call_axes = self.axes[index]
        in_leaves, in_spec = flatten_call((args, kwargs))
        check_call_axes(
            call_axes, module, leaf_shapes(in_leaves), leaf_shapes(out_leaves), self.m, name
        )
        rule = coverage.rule_for(
            module, args, kwargs, call_axes.inputs, output, call_axes.outputs, self.ours, others
        )
        # the arguments as they are, without an operation per input: a rule runs under
        # no_grad and reads their values only, the generic route detaches them first
        record = CallRecord(
            module=module,
            name=name,
            rule=rule,
            in_axes=call_axes.inputs,
            out_axes=call_axes.outputs,
            window=(start, end),
            autocast=Autocast.of(out_leaves),
            output_elements=sum(t.numel() for t in out_leaves if isinstance(t, Tensor)),
        )
        state = WalkState(grads=[None] * len(out_leaves))
        dropped = self._released(index, module)
        if dropped:  # the last walk gave it nothing to compute: keep nothing for it
            args, kwargs = (), {}
        call = LayerCall(record=record, args=args, kwargs=kwargs, state=state, dropped=dropped)
        self.indices[call] = index
        self.calls.append(call)
        new_leaves = list(out_leaves)
        for j, t in enumerate(out_leaves):
            if not (isinstance(t, Tensor) and t.requires_grad):
                continue
            if is_view(t):  # an in-place op on a view would rebuild its graph
                t = t.clone()
                if self.recorder is not None:
                    self.recorder.alias(t, out_leaves[j])
                new_leaves[j] = t
            self.grad_hooks.append(t.register_hook(self.visits.hook(call, j)))
            call.state.edges.append((j, get_gradient_edge(t)))
        return unflatten_call(new_leaves, out_spec, isinstance(output, Tensor))

    def attribute(self, roots: list, walk: Walk) -> tuple[set, dict]:
        """Attribute every parameter use in the graph below ``roots`` (autograd nodes)
        to the calls or the model route (:mod:`memconv.engine.coverage`), into ``walk``;
        the calls with nothing to compute are released. Returns the graph's nodes and
        the parameters' uses."""
        reachable, uses = coverage.use_graph(*roots)
        key = None if self.kept is None else coverage.assignment_key(self.calls, uses, self.names)
        kept = self.kept.assigned if key is not None else None
        if kept is not None and kept[0] == key:  # the last walk's assignment, as it was
            _, params, model_params, calls_per_param = kept
            for call, own in zip(self.calls, params):
                call.params = dict(own)
            coverage.share(self.calls, calls_per_param)
            walk.model_params, walk.calls_per_param = list(model_params), dict(calls_per_param)
        else:
            claims = coverage.claims(
                [c for c in self.calls if isinstance(c, OpCall)], reachable, self.names
            )
            walk.model_params, walk.calls_per_param = coverage.assign(
                self.calls, uses, self.names, claims
            )
            if key is not None:
                self.kept.assigned = (
                    key,
                    [dict(c.params) for c in self.calls],
                    list(walk.model_params),
                    dict(walk.calls_per_param),
                )
        self.counts = walk.calls_per_param
        for call in self.calls:
            if isinstance(call, BlockCall):  # its backward pass must run: it visits
                call.state.expected = {0} if call.node in reachable else set()
            else:
                call.state.expected = {j for j, e in call.state.edges if e.node in reachable}
            call.shared |= {
                k for k, full in call.params.items() if self.shared_counts.get(full, 0) > 1
            }
            if call.dropped and call.params and call.state.expected:
                self.kept.keep_arguments = True
                raise ArgumentsDropped(
                    f"{self.caller}: {call.what} has parameters to compute in this pass, "
                    "where the last pass on the probe gave it none (its arguments were "
                    "not kept)"
                )
            if not call.params or not call.state.expected:
                call.release()
                call.state.done = True
        return reachable, uses

    def backward(
        self, outputs: list, grad_outputs: list, reachable: set, keep_graph: bool, inputs=()
    ) -> tuple:
        """The backward pass of ``outputs`` down to the deepest captured outputs (and to
        ``inputs``), each call visited as its output gradients arrive; returns the
        gradients of ``inputs``."""
        wanted = {e.node: e for c in self.calls if not c.state.done for _, e in c.state.edges}
        deepest = coverage.deepest(set(wanted), reachable)
        edges = [wanted[n] for n in deepest]
        grads: tuple = (None,) * len(inputs)
        self.in_backward = True
        try:
            if edges or inputs:
                grads = torch.autograd.grad(
                    outputs,
                    [*inputs, *edges],
                    grad_outputs,
                    allow_unused=True,
                    retain_graph=keep_graph,
                )
        finally:
            self.in_backward = False
        self.visits.finish()
        return tuple(grads[: len(inputs)])

    # reversible blocks (memconv.reversible's observer protocol)

    def enter(self, block: nn.Module, fn: nn.Module) -> _Block:
        """A reversible block's forward pass starts (before its autograd Function)."""
        self.layers_only = False
        if not self.recording_ops:  # the walks it learned from called no block
            raise ProbeMismatch(
                f"{self.caller}: the model calls a reversible block not in its probe"
            )
        with paused():
            token = _Block(self, block, fn, self.seq.now(), self.index)
        self.open_blocks.append(token)
        return token

    def mark(self, fn: nn.Module) -> None:
        """The next part of the open block running ``fn`` starts (a coupling's second
        half-step): where its layer calls start in the probe's."""
        if self.open_blocks and self.open_blocks[-1].fn is fn:
            self.open_blocks[-1].parts.append(self.index)

    def leave(self, token: _Block, outputs: tuple) -> None:
        """A reversible block's forward pass ended: its call recorded, with an edge
        below its node (asking autograd for it runs the block's backward pass)."""
        self.open_blocks.remove(token)
        node = next((y.grad_fn for y in outputs if y.grad_fn is not None), None)
        if node is None:
            return
        with paused():
            end = self.seq.now()
        if self.block_names is None:
            self.block_names = {m: n for n, m in self.model.named_modules()}
        block = token.block
        record = CallRecord(
            module=block,
            name=self.block_names.get(block) or type(block).__name__,
            rule=None,
            in_axes=(),
            out_axes=(),
            window=(token.start, end),
            autocast=Autocast.of(outputs),
            output_elements=sum(y.numel() for y in outputs),
        )
        below = next((GradientEdge(n, i) for n, i in node.next_functions if n is not None), None)
        state = WalkState(edges=[(0, below)] if below is not None else [])
        token.call = BlockCall(record=record, args=(), kwargs={}, state=state, node=node)
        self.calls.append(token.call)

    def recompute_block(self, token: _Block, run, inputs: tuple, grad_outputs: tuple, part: int):
        """A part of a reversible block's backward pass: ``run(inputs)`` (the part under
        the forward pass's state; it returns its outputs and the leaves it made)
        recorded and walked as a model of its own, its layer calls visited; returns the
        gradients of ``inputs`` and of the leaves ``run`` made."""
        call = token.call
        if call is None or not call.params or not call.state.expected:  # nothing to visit
            with torch.enable_grad():
                ys, made = run(inputs)
            return vjp(ys, grad_outputs, (*inputs, *made))
        call.state.done = True
        block = call.module
        named = dict(block.named_parameters(remove_duplicate=False))
        names = {id(named[k]): full for k, full in call.params.items()}
        owners = {m: self.owners[m] for m in block.modules() if m in self.owners}
        inner = BackwardWalk(
            block, names, self.axes, self.visits.visit, caller=self.caller, owners=owners, m=self.m
        )
        inner.index = token.parts[part]
        inner.block_names, inner.prepare, inner.result = self.block_names, self.prepare, self.result
        inner.shared_counts = {
            k: max(self.counts.get(k, 0), self.shared_counts.get(k, 0))
            for k in self.counts.keys() | self.shared_counts.keys()
        }
        try:
            with torch.enable_grad():
                with inner.recording():
                    ys, made = run(inputs)
                return inner.walk_block(ys, grad_outputs, (*inputs, *made))
        finally:
            inner.close()

    def walk_block(self, ys: tuple, grad_outputs: tuple, xs: tuple) -> tuple:
        """Coverage, backward pass and checks of a block (or a part of one) recomputed
        inside :meth:`recording`; returns the gradients of the leaves ``xs``. Its
        parameters left to the model route join the model's."""
        pairs = [(y, g) for y, g in zip(ys, grad_outputs) if y.grad_fn is not None]
        walk = Walk(losses=ys[0], calls=self.calls, model_params=[], calls_per_param={})
        reachable, uses = self.attribute([y.grad_fn for y, _ in pairs], walk)
        model = self.result.model_params
        model.extend(k for k in walk.model_params if k not in model)
        if self.prepare is not None:
            self.prepare(self.to_visit())
        wanted = [x for x in xs if x.requires_grad]
        found = iter(
            self.backward([y for y, _ in pairs], [g for _, g in pairs], reachable, False, wanted)
        )
        self.check(uses)
        for c in self.calls:  # the block's graph goes (a visitor may keep a call's tensors)
            c.state.edges = []
            if not c.state.kept:
                c.release()
        return tuple(next(found) if x.requires_grad else None for x in xs)

    def check(self, uses: dict) -> None:
        """Raise for a call whose output gradient never arrived; warn of layers that ran
        with gradients disabled and whose parameters no call covers."""
        missed = [c for c in self.calls if not c.state.done]
        if missed:
            raise RuntimeError(
                f"{self.caller}: the output gradient of {missed[0].what} influences the loss "
                f"but never arrived, so the per-sample quantities of "
                f"{', '.join(missed[0].params.values())} are unknown"
            )
        covered = {c.module for c in self.calls}
        quiet = [
            name
            for module, name in self.unseen.items()
            if module not in covered
            and not any(id(p) in uses for p in own_trainable(module).values())
        ]
        if quiet:
            warnings.warn(
                f"{self.caller}: layers {quiet} ran their forward pass with gradients disabled "
                "inside the model; if their parameters influence the loss through a "
                "recomputation (reentrant checkpointing), their per-sample quantities are "
                "reported as zeros. Use torch.utils.checkpoint with use_reentrant=False.",
                stacklevel=5,
            )


class _Visits:
    """Hands each call to ``visit`` as soon as all its output gradients have arrived,
    before its own backward node runs.

    A visitor that keeps a result it allocates (book-keeping's per-sample gradients)
    returns that work instead of doing it, and the work runs once the node that
    produced the call's output has run (a post hook on it), so that the kept result
    never adds to the node's temporaries (a strided convolution's input gradient
    takes three input-sized buffers). Work whose node does not run (the deepest
    captured outputs, whose nodes autograd is not asked to run) runs in
    :meth:`finish`.
    """

    def __init__(self, visit: Callable[[LayerCall], Callable[[], None] | None]):
        self.visit = visit
        self.active = True
        self.later: list = []  # [call, work or None once done, hook handle]

    def hook(self, call: LayerCall, j: int):
        def on_grad(grad):
            state = call.state
            if not self.active or state.done:  # a second backward pass of a kept graph
                return
            state.grads[j] = grad
            if not all(state.grads[k] is not None for k in state.expected):
                return
            state.done = True
            work = self.visit(call)
            if work is None:
                if not state.kept:  # a visitor that keeps the call releases it itself
                    call.release()
                return
            entry = [call, work, None]
            node = dict(state.edges)[j].node  # the node that produced this output
            entry[2] = node.register_hook(lambda grad_inputs, grad_outputs: self._run(entry))
            self.later.append(entry)

        return on_grad

    def _run(self, entry: list) -> None:
        call, work, _ = entry
        if work is not None:
            entry[1] = None
            work()
            if not call.state.kept:
                call.release()

    def finish(self) -> None:
        """Run the work still waiting, and remove the post hooks."""
        self.active = False
        for entry in self.later:
            self._run(entry)
            entry[2].remove()
        self.later = []


class _Block:
    """A reversible block's call in a walk: the token of memconv.reversible's observer
    protocol (:mod:`memconv.reversible.recompute`).

    Attributes:
        walk: the walk whose forward pass called the block.
        block: the :class:`memconv.reversible.InvertibleModuleWrapper`.
        fn: the module it wraps.
        start: the sequence number before its autograd Function.
        parts: the places of each part's first layer call in the probe's calls (one
            part, or a coupling's two half-steps).
        call: its :class:`memconv.engine.calls.BlockCall` (None until the call ends).
    """

    def __init__(self, walk: BackwardWalk, block: nn.Module, fn: nn.Module, start: int, index: int):
        self.walk, self.block, self.fn, self.start = walk, block, fn, start
        self.parts = [index]
        self.call: BlockCall | None = None

    @property
    def active(self) -> bool:
        """Whether the walk runs its backward pass (the block's pass is the walk's)."""
        return self.walk.in_backward

    def recompute(self, run, inputs: tuple, grad_outputs: tuple, part: int = 0) -> tuple:
        """See :meth:`BackwardWalk.recompute_block`."""
        return self.walk.recompute_block(self, run, inputs, grad_outputs, part)

    def differentiate(self, run, inputs: tuple, grad_outputs: tuple, params: tuple, part: int):
        """:func:`memconv.reversible.recompute.differentiate` done by the walk: the
        part's layer calls visited; no parameter gradient."""
        return self.recompute(run, inputs, grad_outputs, part), (None,) * len(params)
