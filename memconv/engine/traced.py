"""A compiled model's per-sample step, traced once per plan and compiled.

A ``torch.compile``'d model (``OptimizedModule``) given to the public functions runs
compiled: after the first call has probed and planned eagerly, the next call with
the same plan traces the whole walk — the forward pass, the backward pass, every
layer rule's per-sample work (norms, clip factors, clipped sums, per-sample
gradients) — into one graph of ATen operations (``torch.fx``'s ``make_fx``, which runs
autograd, hooks and memconv's Python while it records), and hands that graph to the
model's own compiler backend (``torch.compile`` with the backend, mode and options the
model was compiled with; Dynamo sees one graph without a break). Later calls with the
same plan, shapes and options run the compiled graph and none of memconv's Python.

Exactness: the graph records the very operations the eager walk runs; float64 results
equal the eager ones to rounding (the compiler may reorder sums). What a trace cannot
keep is refused, never baked in silently:

- a host read of a value inside the step (``.item()``, ``bool(tensor)``, data-dependent
  control flow in the model): the trace stops there;
- a tensor the step reads from outside its inputs that is not one of the model's
  parameters or buffers (a value of an earlier step would be frozen into the graph);
- a compiler error or graph break.

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
    global_module_hooks,
    literal_copy,
    make_fx_real,
    module_hook_items,
    random_op,
    tree_flatten,
    tree_unflatten,
)
from .probes import ProbeMismatch
from .request import Batch

logger = logging.getLogger(__name__)


class NotTraceable(RuntimeError):
    """A step that cannot run as one compiled graph (the reason in the message)."""


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
    """

    graph: nn.Module
    compiled: Callable
    spec: object
    constants: dict[int, object]
    trace_seconds: float
    compile_seconds: float | None = None
    calls: int = 0

    def __call__(self, tensors: tuple[Tensor, ...]):
        start = time.perf_counter()
        with torch.no_grad():  # the graph holds its backward pass as operations
            outputs = iter(self.compiled(*tensors))
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - start
        self.calls += 1
        leaves = [
            self.constants[i] if i in self.constants else next(outputs)
            for i in range(self.spec.num_leaves)
        ]
        return tree_unflatten(leaves, self.spec)


@dataclass
class TracedSteps:
    """The traced steps of one :class:`memconv.engine.prepared.Prepared`, by key.

    Attributes:
        graphs: ``{key: TracedGraph}``.
        refused: ``{key: reason}`` of steps that run eagerly.
        traces: how many traces were made.
    """

    graphs: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    traces: int = 0
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
                self._refuse(key, model, f"the compiler failed: {_first_line(error)}")
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

        check_hooks(model)
        start = time.perf_counter()
        try:
            graph = make_fx_real(step, (batch.inputs, batch.targets, *extra))
        except ProbeMismatch:  # the model's calls changed: probed again by the caller
            raise
        except Exception as error:
            raise NotTraceable(f"the trace stopped: {_first_line(error)}") from error
        seconds = time.perf_counter() - start
        self.traces += 1
        check_constants(graph, model)
        check_random(graph)
        leaves = held["leaves"]
        constants = {i: v for i, v in enumerate(leaves) if not isinstance(v, Tensor)}
        compiled = torch.compile(graph, backend=backend, fullgraph=True, dynamic=False)
        entry = TracedGraph(graph, compiled, held["spec"], constants, seconds)
        logger.info(
            "memconv: traced the per-sample step of %s (%d nodes, %.1f s)",
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
            f"memconv: the per-sample step of the torch.compile'd {type(model).__name__} "
            f"runs eagerly, not compiled: {reason}. The numbers are the eager path's. "
            "Remove what the message names from the step (a host read such as .item() "
            "or data-dependent control flow in forward, a tensor held outside the model "
            "and its inputs), or pass the uncompiled model to silence this warning.",
            RuntimeWarning,
            stacklevel=4,
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def check_constants(graph: nn.Module, model: nn.Module) -> None:
    """Refuse a traced graph that reads a tensor from outside its inputs which is
    not one of ``model``'s parameters or buffers (its value at the trace would be
    frozen into every later step). Literals made inside the step (``torch.tensor(2.0)``,
    read through ``lift_fresh_copy``) are kept.

    Raises:
        NotTraceable: naming the operation that reads such a tensor.
    """
    own = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(graph, node.target)
        if not isinstance(value, Tensor) or id(value) in own:
            continue
        users = list(node.users)
        if users and all(literal_copy(u.target) for u in users):
            continue
        names = ", ".join(str(u.target) for u in users[:3])
        raise NotTraceable(
            f"the step reads a tensor {tuple(value.shape)} of dtype {value.dtype} that is "
            f"neither an input nor a parameter or buffer of the model (used by {names})"
        )


#: Hooks whose only effect is a computation the trace records (a pruned or
#: weight-normalised weight made from its parameters before each call).
_PURE_HOOKS = ("BasePruningMethod", "WeightNorm")


def check_hooks(model: nn.Module) -> None:
    """Refuse a model whose modules hold hooks that may act outside their tensors'
    computation (store an activation, log, count): a trace runs them once, and the
    compiled step would not run them again. Pruning's and weight normalisation's hooks,
    which only compute a weight, are kept.

    Raises:
        NotTraceable: naming the module and the hook.
    """
    if global_module_hooks(backward=True):
        raise NotTraceable("global module hooks are registered (they would run only at the trace)")
    for name, module in model.named_modules():
        for kind, hook in module_hook_items(module):
            if any(c.__name__ in _PURE_HOOKS for c in type(hook).__mro__):
                continue
            what = getattr(hook, "__qualname__", type(hook).__name__)
            raise NotTraceable(
                f"module {name or type(model).__name__!r} ({type(module).__name__}) has a "
                f"{kind} {what}, which would run at the trace only, not at each "
                "compiled step"
            )


def check_random(graph: nn.Module) -> None:
    """Refuse a traced step that draws random numbers (dropout in training mode): the
    eager walk replays the forward pass's random numbers where it recomputes, which the
    graph cannot promise.

    Raises:
        NotTraceable: naming the random operation.
    """
    for node in graph.graph.nodes:
        if node.op == "call_function" and random_op(node.target, node.args, node.kwargs):
            raise NotTraceable(
                f"the step draws random numbers ({node.target}: dropout in training "
                "mode?), whose replay the compiled graph cannot promise"
            )
