"""A compiled model's per-sample step, traced once per plan and compiled.

A ``torch.compile``'d model (``OptimizedModule``) given to the public functions runs
compiled: after the first call has probed and planned eagerly, the next call with
the same plan traces the whole walk — the forward pass, the backward pass, every
layer rule's per-sample work (norms, clip factors, clipped sums, per-sample
gradients) — into one graph of ATen operations (``torch.fx``'s ``make_fx``, which runs
autograd, hooks and memconv's Python while it records), and hands that graph to the
model's own compiler backend (the backend, mode and options the model was compiled
with; inductor with :data:`memconv._torch.STEP_INDUCTOR_OPTIONS` beneath them). The
backend takes the graph directly, as Dynamo hands a backend its
graphs (:func:`memconv._torch.compile_graph`): Dynamo does not read the graph's Python
again, so there is no guard, graph break or recompilation, and no Dynamo frame around
each call (on a small model that frame cost as much as the compiled step itself).
Later calls with the same plan, shapes, strides and options run the compiled graph
and none of memconv's Python.

Exactness: the graph records the very operations the eager walk runs; float64 results
equal the eager ones to rounding (the compiler may reorder sums). What a trace cannot
keep is refused, never baked in silently:

- a host read of a value inside the step (``.item()``, ``bool(tensor)``, data-dependent
  control flow in the model): the trace stops there;
- a tensor the step reads from outside its inputs that is not one of the model's
  parameters or buffers (a value of an earlier step would be frozen into the graph);
- inputs or targets that are not tensors (a list of targets): the graph's inputs are
  tensors, and a value held elsewhere would be frozen into it;
- a compiler error.

Each refusal warns once per model and reason, naming it, and that call and the next
ones of the same plan run eagerly (the numbers are the eager path's).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from .._torch import (
    NotTraceable,
    check_constants,
    check_hooks,
    check_random,
    compile_graph,
    first_line,
    graph_owned_outputs,
    make_fx_real,
    pytree_builder,
    step_backend,
    tree_flatten,
)
from .probes import ProbeMismatch
from .request import Batch

logger = logging.getLogger(__name__)


def tensor_key(t) -> tuple:
    """What a traced graph depends on of a tensor besides its values (its compiled
    code is specialised to the shape and the strides)."""
    if not isinstance(t, Tensor):
        return (type(t).__name__,)
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


@dataclass
class TracedGraph:
    """One traced step and its compiled form.

    Attributes:
        graph: the traced ``torch.fx.GraphModule`` (inputs: the step's tensors; outputs:
            the result's tensors).
        compiled: ``graph`` compiled by the model's backend.
        spec: the result's pytree structure.
        constants: the result's leaves that are not tensors, by position.
        trace_seconds: seconds the trace took.
        compile_seconds: seconds the first compiled call took (compilation included;
            None until it ran).
        calls: compiled calls so far.
        copy_outputs: the backend's outputs live in memory its next call overwrites (a
            CUDA graph's, :func:`memconv._torch.graph_owned_outputs`): each is copied
            before it is returned, as it may become a ``.grad`` kept across steps.
        build: rebuilds the result from the leaves in order
            (:func:`memconv._torch.pytree_builder` of ``spec``, made once).
    """

    graph: nn.Module
    compiled: Callable
    spec: object
    constants: dict[int, object]
    trace_seconds: float
    compile_seconds: float | None = None
    calls: int = 0
    copy_outputs: bool = False
    build: Callable = field(init=False, repr=False)

    def __post_init__(self):
        self.build = pytree_builder(self.spec)  # made once, not at every call

    def __call__(self, tensors: tuple[Tensor, ...]):
        if self.compile_seconds is None:
            start = time.perf_counter()
        with torch.no_grad():  # the graph holds its backward pass as operations
            outputs = self.compiled(*tensors)
        if self.copy_outputs:
            outputs = [t.clone() for t in outputs]
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - start
        self.calls += 1
        if self.constants:
            outputs = iter(outputs)
            outputs = [
                self.constants[i] if i in self.constants else next(outputs)
                for i in range(self.spec.num_leaves)
            ]
        return self.build(iter(outputs))


@dataclass
class TracedSteps:
    """The traced steps of one model (a :class:`memconv.engine.prepared.Prepared`'s, or
    :func:`memconv.integrations.backpack.step`'s), by key.

    Attributes:
        graphs: ``{key: TracedGraph}``.
        refused: ``{key: reason}`` of steps that run eagerly.
        traces: how many traces were made.
        what: the step, as the refusal's warning names it.
        hooks: module hook functions the step runs itself, whose effects it returns
            (:func:`memconv._torch.check_hooks`'s ``allowed``).
        random: whether the step may draw random numbers (its forward pass runs once,
            so one draw serves the whole graph); refused otherwise
            (:func:`memconv._torch.check_random`).
    """

    graphs: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    traces: int = 0
    what: str = "per-sample step"
    hooks: tuple = ()
    random: bool = False
    _warned: set = field(default_factory=set)

    def forget(self) -> None:
        """Drop every traced step (a new probe or plan makes new ones)."""
        self.graphs.clear()
        self.refused.clear()

    def run(self, key, walk: Callable, batch: Batch, extra: tuple, backend, model: nn.Module):
        """The result of ``walk(batch, *extra)``: by the compiled graph of ``key``,
        traced now if there is none; eagerly where the step was refused (warned once).

        Args:
            key: what the graph depends on besides the tensors' values (the plan, the
                options, the shapes).
            walk: ``walk(batch, *extra) -> pytree`` of tensors and constants.
            batch: the call's model, loss and samples (inputs, targets: the graph's
                first two inputs).
            extra: further tensors the step reads (the graph's next inputs).
            backend: the compiler backend of the model.
            model: the module walked (its parameters and buffers may be read by the
                graph; nothing else from outside).
        """
        if key in self.refused:
            return walk(batch, *extra)
        entry = self.graphs.get(key)
        tensors = (batch.inputs, batch.targets, *extra)
        if entry is not None:
            try:
                return entry(tensors)
            except Exception as error:  # a compiler error at the first call
                if entry.calls:
                    raise
                self._refuse(key, model, f"the compiler failed: {first_line(error)}")
                return walk(batch, *extra)
        try:
            entry, result = self._trace(walk, batch, extra, backend, model)
        except NotTraceable as error:
            self._refuse(key, model, str(error))
            return walk(batch, *extra)
        self.graphs[key] = entry
        return result

    def _trace(self, walk, batch: Batch, extra: tuple, backend, model: nn.Module):
        held: dict = {}

        def step(inputs, targets, *more):
            result = walk(replace(batch, inputs=inputs, targets=targets), *more)
            leaves, spec = tree_flatten(result)
            held.update(result=result, spec=spec, leaves=leaves)
            return [v for v in leaves if isinstance(v, Tensor)]

        check_hooks(model, self.hooks)
        for name, value in (("inputs", batch.inputs), ("targets", batch.targets)):
            if not isinstance(value, Tensor):  # the graph's inputs are tensors
                raise NotTraceable(f"the {name} are a {type(value).__name__}, not a tensor")
        start = time.perf_counter()
        try:
            graph = make_fx_real(step, (batch.inputs, batch.targets, *extra))
        except ProbeMismatch:  # the model's calls changed: probed again by the caller
            raise
        except Exception as error:
            raise NotTraceable(f"the trace stopped: {first_line(error)}") from error
        seconds = time.perf_counter() - start
        self.traces += 1
        check_constants(graph, model)
        if not self.random:
            check_random(graph)
        leaves = held["leaves"]
        constants = {i: v for i, v in enumerate(leaves) if not isinstance(v, Tensor)}
        backend = step_backend(backend, graph)
        compiled = compile_graph(graph, [batch.inputs, batch.targets, *extra], backend)
        entry = TracedGraph(
            graph,
            compiled,
            held["spec"],
            constants,
            seconds,
            copy_outputs=graph_owned_outputs(backend),
        )
        logger.info(
            "memconv: traced the %s of %s (%d nodes, %.1f s)",
            self.what,
            type(model).__name__,
            len(graph.graph.nodes),
            seconds,
        )
        return entry, held["result"]

    def _refuse(self, key, model: nn.Module, reason: str) -> None:
        self.refused[key] = reason
        if reason in self._warned:
            return
        self._warned.add(reason)
        warnings.warn(
            f"memconv: the {self.what} of the torch.compile'd {type(model).__name__} "
            f"runs eagerly, not compiled: {reason}. The numbers are the eager path's. "
            "Remove what the message names from the step (a host read such as .item() "
            "or data-dependent control flow in forward, a tensor held outside the model "
            "and its inputs), or pass the uncompiled model to silence this warning.",
            RuntimeWarning,
            stacklevel=4,
        )


__all__ = [
    "NotTraceable",
    "TracedGraph",
    "TracedSteps",
    "check_constants",
    "check_hooks",
    "check_random",
    "tensor_key",
]
