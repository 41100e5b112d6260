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

The recorded blocks (:mod:`memconv.tasks.recorded`), whose forward and backward passes
are the user's two calls, trace their clipping step once the same way and part the
graph where the output gradient is first read, as AOT Autograd parts a compiled model's
training graph (:func:`split_at_targets`): the compiled forward half runs at the model's
call, the compiled backward half at the user's ``loss.backward()`` (:class:`SplitStep`).

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

import contextlib
import functools
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain

import torch
from torch import Tensor, nn

from .._checks import warn_user
from .._torch import (
    NotTraceable,
    buffers_restored,
    check_constants,
    check_hooks,
    check_random,
    compile_graph,
    compile_graph_boxed,
    first_line,
    graph_owned_outputs,
    make_fx_real,
    min_cut_halves,
    pytree_builder,
    step_backend,
    tree_flatten,
    without_grad,
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


class Identity:
    """A part of a key equal only to a part holding the same object (``is``), hashed
    by its id; it holds the object, so that the id is no other object's while the key
    lives (a loss function of any kind, hashable or not)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


#: Values a key takes as they are (by type and ``==``).
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def loss_key(loss_fn, _path: tuple = ()):
    """What a traced step depends on of its loss function besides the tensors it is
    given: what the loss computes, so that a loss made anew at every call
    (``nn.CrossEntropyLoss()`` written in the loop, a ``lambda``) finds its compiled
    step again, and another loss (another class, ``label_smoothing``, ``reduction``, a
    closure over another value) gets its own.

    - a module: its class, its public attributes (plain values as they are, others
      by this key or by identity), its parameters and buffers by identity, and its
      children's keys;
    - a Python function: its code, its defaults and the contents of its closure;
    - ``functools.partial`` and bound methods: the function's key and the bound values;
    - anything else: the object itself (:class:`Identity`).

    What a loss reads from elsewhere (a module-level global) is not part of it, as a
    module's attributes are not part of a model's step. A reference back to an object
    the key is already inside (a module holding itself) is keyed by its place on that
    path.
    """
    if id(loss_fn) in _path:
        return ("back", _path.index(id(loss_fn)))
    seen = (*_path, id(loss_fn))
    if isinstance(loss_fn, nn.Module):
        items = []
        for k, v in vars(loss_fn).items():
            if k in ("_parameters", "_buffers"):
                items.append((k, tuple((n, Identity(t)) for n, t in v.items())))
            elif k == "_modules":
                items.append((k, tuple((n, _value_key(c, seen)) for n, c in v.items())))
            elif not k.startswith("_"):
                items.append((k, _value_key(v, seen)))
        return ("module", type(loss_fn), tuple(items))
    if isinstance(loss_fn, types.FunctionType):
        cells = []
        for cell in loss_fn.__closure__ or ():
            try:
                cells.append(_value_key(cell.cell_contents, seen))
            except ValueError:  # an empty cell
                cells.append(("empty",))
        defaults = _value_key(loss_fn.__defaults__, seen)
        kwdefaults = _value_key(loss_fn.__kwdefaults__, seen)
        return ("function", loss_fn.__code__, defaults, kwdefaults, tuple(cells))
    if isinstance(loss_fn, functools.partial):
        bound = (_value_key(loss_fn.args, seen), _value_key(loss_fn.keywords, seen))
        return ("partial", loss_key(loss_fn.func, seen), *bound)
    if isinstance(loss_fn, types.MethodType):
        return ("method", loss_key(loss_fn.__func__, seen), Identity(loss_fn.__self__))
    return Identity(loss_fn)


class ModuleAttributes:
    """The plain attributes of a model's modules, which a traced step holds as the
    constants they were at the trace: numbers, strings, ``None``, dtypes, devices,
    functions (compared by identity: an activation held as ``self.act = F.gelu``), and
    tuples, lists and dicts of them (a convolution's ``stride``, a normalisation's
    ``eps``, a custom layer's ``scale``, LoRA's ``scaling`` per adapter and its
    ``_disable_adapters`` flag, a counter). Read again at every call of a compiled step
    and part of its key (:meth:`memconv.engine.prepared.Prepared.step_key`), so that a
    changed value traces again, as Dynamo's guards on the attributes a compiled forward
    reads recompile it.

    Which attributes is fixed when the record is made (the model's modules as they are
    then: a record per kept model state); ``nn.Module``'s own tables and other objects
    are not read. A list or dict is read as a tuple of its items (a change in place is
    a change).
    """

    __slots__ = ("pairs", "held")

    def __init__(self, model: nn.Module):
        pairs, held = [], []
        for m in model.modules():
            for k, v in vars(m).items():
                if type(v) in _FLAT or (type(v) is tuple and _flat(v)):
                    pairs.append((m, k))
                elif type(v) in (list, dict) and k not in _MODULE_TABLES and _flat(_items(v)):
                    held.append((m, k))
        self.pairs, self.held = pairs, held

    def _read(self) -> list:
        values = [getattr(m, k, _GONE) for m, k in self.pairs]
        for m, k in self.held:
            v = getattr(m, k, _GONE)
            values.append(tuple(_items(v)) if type(v) in (list, dict) else v)
        return values

    def values(self) -> tuple:
        """The attributes' values now, in the record's order (hashable; an attribute
        deleted or no longer plain: a part equal to no other)."""
        values = self._read()
        if _KEPT.issuperset(map(type, values)) and _FLAT.issuperset(
            map(type, chain.from_iterable(v for v in values if type(v) is tuple))
        ):
            return tuple(values)
        return tuple(  # (an Identity is never equal to a plain value)
            v if type(v) in _FLAT or (type(v) is tuple and _flat(v)) else Identity(v)
            for v in values
        )

    def same(self, values: list) -> bool:
        """Whether the attributes' values now are ``values`` (:meth:`values` of an
        earlier call, as a list), without making a key: a compiled step's check at
        every call."""
        try:
            return self._read() == values
        except Exception:  # (a value that no longer compares as a plain one: changed)
            return False


def _flat(values) -> bool:
    return all(type(v) in _FLAT for v in values)


def _items(v):
    """A list's items, or a dict's keys and values in turn."""
    return v if type(v) is list else chain.from_iterable(v.items())


_FLAT = frozenset(_PLAIN) | {types.FunctionType, types.BuiltinFunctionType}  # (functions: by `is`)
_KEPT = _FLAT | {tuple}
_GONE = object()
#: ``nn.Module``'s own dicts (its parameters, buffers, children, hooks: the model's
#: state record reads them).
_MODULE_TABLES = frozenset(vars(nn.Module()))


def _value_key(v, seen: tuple):
    if isinstance(v, _PLAIN):
        return (type(v), v)  # (the type keeps True and 1 apart)
    if type(v) in (tuple, list):
        return (type(v), *(_value_key(x, seen) for x in v))
    if type(v) is dict:
        return (dict, *((_value_key(k, seen), _value_key(x, seen)) for k, x in v.items()))
    if isinstance(v, (nn.Module, types.FunctionType, functools.partial, types.MethodType)):
        return loss_key(v, seen)
    return Identity(v)


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
        with without_grad():  # the graph holds its backward pass as operations
            outputs = self.compiled(*tensors)
        if self.copy_outputs:
            outputs = [t.clone() for t in outputs]
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - start
        self.calls += 1
        return _result(outputs, self.constants, self.spec, self.build)


def _result(outputs: list, constants: dict, spec, build: Callable):
    """A traced step's result from its graph's outputs: the leaves that are not
    tensors (``constants``, by position) put back, the pytree rebuilt."""
    if constants:
        outputs = iter(outputs)
        outputs = [
            constants[i] if i in constants else next(outputs) for i in range(spec.num_leaves)
        ]
    return build(iter(outputs))


def split_at_targets(
    graph: nn.Module, example_inputs: list | None = None
) -> tuple[nn.Module, nn.Module, int]:
    """A traced step ``graph(inputs, targets, *extra) -> [*leaves, output]`` parted
    where it first reads the targets, into two graphs run one after the other:

    - the forward half, ``(inputs, *extra) -> [output, *saved]``: the model's forward
      pass, which must end before the targets are read (``output`` is the model's
      output);
    - the backward half, ``(*saved, targets) -> leaves``: the rest, reading what it
      needs of the forward half from ``saved`` and the model's parameters and buffers
      as the whole graph does.

    With ``example_inputs`` (the graph's inputs, or tensors of their shapes), the
    halves are AOT Autograd's min-cut partition of the functional graph
    (:func:`memconv._torch.min_cut_halves`), as a compiled model's own training graph
    is parted: the backward half computes cheap values again (the activation's output
    beside its scaled copy, views) rather than keeping them, so ``saved`` holds fewer
    bytes. Where that partition is not made (a step writing in place to an input,
    parameter or buffer), and without ``example_inputs``: every operation before the cut in the
    forward half, every one from it on in the backward half, each in the graph's
    order, so that in-place operations keep their meaning.

    Both ways the halves compute the whole graph's results.

    Returns:
        ``(forward, backward, saved)``: the two ``torch.fx.GraphModule`` and the number
        of saved tensors.

    Raises:
        NotTraceable: the output is computed after an operation reading the targets (a
            batch walked in several micro-batches), or nothing reads the targets.
    """
    nodes = list(graph.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    targets = placeholders[1]
    out_node = nodes[-1]
    *leaves, output = out_node.args[0]
    cut = next((i for i, n in enumerate(nodes) if targets in n.all_input_nodes), None)
    if cut is None or out_node is nodes[cut]:
        raise NotTraceable("the step does not read the output gradient")
    before = set(nodes[:cut]) - {targets}
    if output not in before:
        raise NotTraceable("the model's output is computed after the output gradient is read")
    if example_inputs is not None:
        try:
            return min_cut_halves(graph, example_inputs, tangent=1)
        except Exception as error:  # noqa: BLE001 — the plain cut below, as exact
            logger.info("memconv: the step is cut as traced, not partitioned: %s", error)
    after = [n for n in nodes[cut:] if n.op not in ("placeholder", "output")]
    saved: list = []
    for n in [*after, out_node]:
        reads = n.all_input_nodes if n is not out_node else leaves
        for a in reads:
            if a in before and a.op != "get_attr" and a not in saved:
                saved.append(a)

    forward = torch.fx.Graph()
    env: dict = {}
    for n in nodes[:cut]:
        if n is targets:
            continue
        env[n] = forward.node_copy(n, lambda a: env[a])
    forward.output([env[output], *(env[a] for a in saved)])

    backward = torch.fx.Graph()
    env = {}
    for a in saved:
        env[a] = backward.placeholder(a.name)
        env[a].meta = dict(a.meta)
    env[targets] = backward.placeholder(targets.name)
    env[targets].meta = dict(targets.meta)

    def lookup(a):
        if a not in env:  # a parameter or buffer read by the forward half too
            env[a] = backward.node_copy(a, lambda b: env[b])
        return env[a]

    for n in after:
        env[n] = backward.node_copy(n, lookup)
    backward.output([lookup(a) if isinstance(a, torch.fx.Node) else a for a in leaves])
    halves = (torch.fx.GraphModule(graph, forward), torch.fx.GraphModule(graph, backward))
    return (*halves, len(saved))


@dataclass
class SplitStep:
    """A traced step in two compiled halves (:func:`split_at_targets`): the forward
    half runs at the model's call, the backward half once the output gradient (the
    targets) is known.

    Attributes:
        forward_graph, backward_graph: the two halves (``torch.fx.GraphModule``).
        forward_compiled: ``forward_graph`` compiled by the model's backend.
        backend: that backend (the backward half compiles at its first call, on the
            layout of the tensors the compiled forward half returned).
        spec, constants: the step's result's pytree structure and its leaves that are
            not tensors, by position (as :class:`TracedGraph`).
        copy_outputs: as :class:`TracedGraph`.
        trace_seconds: seconds the trace took.
        forwards: forward calls so far.
        calls: backward calls so far.
        failed: the compiler's error at the backward half's first call, or None: that
            call and the later ones run the backward half uncompiled (its graph of ATen
            operations, the same numbers), and :meth:`TracedSteps.refuse` says so.
    """

    forward_graph: nn.Module
    backward_graph: nn.Module
    forward_compiled: Callable
    backend: object
    spec: object
    constants: dict[int, object]
    copy_outputs: bool = False
    trace_seconds: float = 0.0
    forwards: int = 0
    calls: int = 0
    failed: str | None = None
    backward_compiled: Callable | None = None
    build: Callable = field(init=False, repr=False)

    def __post_init__(self):
        self.build = pytree_builder(self.spec)

    def forward(self, tensors: tuple[Tensor, ...]) -> tuple[Tensor, list[Tensor]]:
        """``(output, saved)`` of the forward half on ``(inputs, *extra)``."""
        with without_grad():
            outputs = self.forward_compiled(*tensors)
        if self.copy_outputs:
            outputs = [t.clone() for t in outputs]
        self.forwards += 1
        return outputs[0], list(outputs[1:])

    def backward(self, saved: list[Tensor], targets: Tensor):
        """The step's result (its pytree) from the forward half's ``saved`` and the
        targets. ``saved`` is emptied: the compiled backward half frees each saved
        tensor after its last use (:func:`memconv._torch.compile_graph_boxed`), as
        autograd frees what a node saved once the node has run."""
        saved.append(targets)
        tensors, saved = saved, None
        if self.backward_compiled is None:
            backend = step_backend(self.backend, self.backward_graph)
            self.backward_compiled = compile_graph_boxed(self.backward_graph, tensors, backend)
        with without_grad():
            if self.failed is not None:
                outputs = self.backward_graph(*tensors)
            else:
                kept = None if self.calls else list(tensors)  # to run uncompiled on failure
                try:
                    outputs = self.backward_compiled.call_boxed(tensors)
                except Exception as error:  # a compiler error at the first call
                    if self.calls:
                        raise
                    self.failed = f"the compiler failed: {first_line(error)}"
                    outputs = self.backward_graph(*kept)
                del kept
        if self.copy_outputs and self.failed is None:
            outputs = [t.clone() for t in outputs]
        self.calls += 1
        return _result(outputs, self.constants, self.spec, self.build)


#: The remedy a refused step's warning names.
REFUSED = (
    "Remove what the message names from the step (a host read such as .item() or "
    "data-dependent control flow in forward, a tensor held outside the model and its "
    "inputs)"
)
#: The remedy the warning of a model that holds :data:`MAX_GRAPHS` graphs names.
FULL = (
    "Keep what a step depends on the same from call to call (batches padded to one "
    "size, one loss function, the modules' attributes)"
)

#: The most graphs one model's :class:`TracedSteps` keeps (as Dynamo's recompile limit):
#: a step of a new key beyond them runs eagerly, with a warning, instead of tracing,
#: compiling and keeping a graph at every call whose key is new.
MAX_GRAPHS = 32


@dataclass
class TracedSteps:
    """The traced steps of one model (a :class:`memconv.engine.prepared.Prepared`'s, or
    :func:`memconv.integrations.backpack.step`'s), by key: at most :data:`MAX_GRAPHS`.

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
        full_reason: what the warning says when :data:`MAX_GRAPHS` are kept.
    """

    graphs: dict = field(default_factory=dict)
    splits: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    traces: int = 0
    what: str = "per-sample step"
    hooks: tuple = ()
    random: bool = False
    full_reason: str = (
        "one for each step asked for: a new step at every call (what its key holds "
        "changed from call to call: the inputs' shapes, the loss, a module's plain "
        "attribute, ...) is traced no more"
    )
    _warned: set = field(default_factory=set)

    def forget(self) -> None:
        """Drop every traced step (a new probe or plan makes new ones)."""
        self.graphs.clear()
        self.splits.clear()
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
                self.refuse(key, model, f"the compiler failed: {first_line(error)}")
                return walk(batch, *extra)
        if len(self.graphs) >= MAX_GRAPHS:  # (nothing recorded: no growth either)
            self.warn(model, f"it holds {MAX_GRAPHS} graphs already, {self.full_reason}", FULL)
            return walk(batch, *extra)
        try:
            entry, result = self._trace(walk, batch, extra, backend, model)
        except NotTraceable as error:
            self.refuse(key, model, str(error))
            return walk(batch, *extra)
        self.graphs[key] = entry
        return result

    def trace_split(self, key, walk: Callable, batch: Batch, extra: tuple, backend, model):
        """Trace ``walk(batch, *extra)`` as :meth:`run` does, cut it into its forward
        and backward halves (:func:`split_at_targets`) and keep them under ``key``
        (:attr:`splits`); where that is refused, keep the reason (:attr:`refused`) and
        warn once. The traced step's result is discarded (the caller has its own).

        ``batch.loss_fn`` is a :class:`memconv.engine.losses.OutputKeepingLoss`: the
        model's output is read from it. Beyond :data:`MAX_GRAPHS` kept halves, nothing
        is traced (warned once).
        """
        if len(self.splits) >= MAX_GRAPHS:
            self.warn(model, f"it holds {MAX_GRAPHS} graphs already, {self.full_reason}", FULL)
            batch.loss_fn.output = None
            return
        try:
            graph, held, seconds = self._make_graph(walk, batch, extra, model, output=True)
            example = [batch.inputs, batch.targets, *extra]
            forward, backward, _ = split_at_targets(graph, example)
        except NotTraceable as error:
            self.refuse(key, model, str(error))
            return
        except ProbeMismatch:  # the model's calls changed: the next call probes again
            return
        except Exception as error:  # noqa: BLE001 — not kept: the calls stay eager, warned
            self.refuse(key, model, f"the trace failed: {first_line(error)}")
            return
        finally:
            batch.loss_fn.output = None  # (held the traced output)
        leaves = held["leaves"]
        constants = {i: v for i, v in enumerate(leaves) if not isinstance(v, Tensor)}
        self.splits[key] = SplitStep(
            forward,
            backward,
            compile_graph(forward, [batch.inputs, *extra], step_backend(backend, forward)),
            backend,
            held["spec"],
            constants,
            copy_outputs=graph_owned_outputs(backend),
            trace_seconds=seconds,
        )
        logger.info(
            "memconv: traced the %s of %s in two halves (%d and %d nodes, %.1f s)",
            self.what,
            type(model).__name__,
            len(forward.graph.nodes),
            len(backward.graph.nodes),
            seconds,
        )

    def _make_graph(self, walk, batch: Batch, extra: tuple, model: nn.Module, output=False):
        """``(graph, held, seconds)``: ``walk`` traced and checked; ``held``: its
        result, the result's leaves and pytree spec. With ``output`` (a recorded block's
        trace, made after its eager pass and its result discarded), the graph's last
        output is the model's output (read from the batch's loss), and the model's
        buffers are put back as they were before the trace."""
        held: dict = {}

        def step(inputs, targets, *more):
            result = walk(replace(batch, inputs=inputs, targets=targets), *more)
            leaves, spec = tree_flatten(result)
            held.update(result=result, spec=spec, leaves=leaves)
            tensors = [v for v in leaves if isinstance(v, Tensor)]
            if output:
                kept = batch.loss_fn.output
                if kept is None:
                    raise NotTraceable("the step gave the loss no output in one call")
                tensors.append(kept)
            return tensors

        check_hooks(model, self.hooks)
        for name, value in (("inputs", batch.inputs), ("targets", batch.targets)):
            if not isinstance(value, Tensor):  # the graph's inputs are tensors
                raise NotTraceable(f"the {name} are a {type(value).__name__}, not a tensor")
        start = time.perf_counter()
        try:
            # a trace whose result is discarded is not the user's pass: buffers back
            with buffers_restored(model) if output else contextlib.nullcontext():
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
        return graph, held, seconds

    def _trace(self, walk, batch: Batch, extra: tuple, backend, model: nn.Module):
        graph, held, seconds = self._make_graph(walk, batch, extra, model)
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

    def refuse(self, key, model: nn.Module, reason: str) -> None:
        """Keep ``key``'s step eager from now on, for ``reason``; warn once per reason."""
        self.refused[key] = reason
        self.warn(model, reason)

    def warn(self, model: nn.Module, reason: str, remedy: str = REFUSED) -> None:
        """Warn, once per reason, that a step runs eagerly for ``reason``."""
        if reason in self._warned:
            return
        self._warned.add(reason)
        warn_user(
            f"memconv: the {self.what} of the torch.compile'd {type(model).__name__} "
            f"runs eagerly, not compiled: {reason}. The numbers are the eager path's. "
            f"{remedy}, or pass the uncompiled model to silence this warning."
        )


__all__ = [
    "Identity",
    "NotTraceable",
    "SplitStep",
    "TracedGraph",
    "TracedSteps",
    "check_constants",
    "check_hooks",
    "check_random",
    "first_line",
    "loss_key",
    "split_at_targets",
    "tensor_key",
]
