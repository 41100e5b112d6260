"""Every internal of torch memconv reads, behind one adapter.

memconv reads a few things torch does not promise to keep: autograd nodes' sequence
numbers, a tensor's view and version state and its storage address, the saved inputs
of a node, the module hook dictionaries, pytree, and ``make_fx``'s traces (with the
checks of what a trace cannot keep). Each is read here and only here,
so that a torch release that moves one touches this file alone; every function says
what it stands for in torch's public terms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "NotTraceable",
    "add_each",
    "assert_on_device",
    "buffers_restored",
    "check_constants",
    "check_hooks",
    "check_random",
    "compile_backend",
    "compiled_inner",
    "compile_graph",
    "copy_each",
    "first_line",
    "functorch_active",
    "global_module_hooks",
    "graph_task_id",
    "is_view",
    "tracing",
    "literal_copy",
    "module_hook_items",
    "random_op",
    "make_fx_real",
    "min_cut_halves",
    "max_abs_each",
    "module_hooks",
    "new_sequence_nr",
    "no_torch_function",
    "not_traced",
    "own_hook",
    "saved_self",
    "sequence_nr",
    "storage_key",
    "storage_ptr",
    "storage_weakref",
    "pytree_builder",
    "tree_flatten",
    "tree_unflatten",
    "version",
    "view_base",
]


def sequence_nr(node) -> int:
    """An autograd node's sequence number: nodes made later in a thread have larger ones
    (the order autograd's engine uses to run ready nodes)."""
    return node._sequence_nr()


def new_sequence_nr() -> int:
    """A sequence number of its own, larger than every node's made before in this
    thread and smaller than every node's made after: that of a new autograd node of no
    graph (torch's ``DelayedError`` node, made without a tensor operation; where torch
    has none, the node of a product of a scalar)."""
    make = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)
    if make is not None:
        return make("", 0)._sequence_nr()
    with torch.enable_grad():
        return (_ANCHOR * 1).grad_fn._sequence_nr()


_ANCHOR = torch.zeros((), requires_grad=True)


def max_abs_each(tensors: list[Tensor]) -> list[Tensor]:
    """The largest magnitude of each tensor (a NaN where it holds one), 0-d tensors,
    by one operation for them all (``torch._foreach_norm`` with ``ord=inf``)."""
    return list(torch._foreach_norm(tensors, float("inf")))


def add_each(targets: list[Tensor], values: list[Tensor]) -> None:
    """``t += v`` for every pair, by one operation for them all (``torch._foreach_add_``)."""
    if targets:
        torch._foreach_add_(targets, values)


def copy_each(targets: list[Tensor], values: list[Tensor]) -> None:
    """``t.copy_(v)`` for every pair, by one operation for them all
    (``torch._foreach_copy_``); the targets must not overlap one another."""
    if len(targets) == 1:
        targets[0].copy_(values[0])
    elif targets:
        torch._foreach_copy_(targets, values)


def is_view(t: Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (an in-place operation on it rebuilds
    its graph, so hooks on it are lost)."""
    return t._is_view()


def view_base(t: Tensor) -> Tensor | None:
    """The tensor ``t`` is a view of, or None."""
    return t._base


def version(t: Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change); None for an inference
    tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


@contextlib.contextmanager
def buffers_restored(module: nn.Module):
    """Run the block, then put back the value of each of ``module``'s buffers that the
    block changed in place (its version counter moved): for memconv's own passes of a
    model (the probe's, a trace's), so that a buffer a model updates in ``forward`` (a
    counter, a power iteration's vector) changes only in the user's own passes. The
    buffers are copied before the block (a model's buffers are usually small)."""
    kept = [(b, version(b), b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v, value in kept:
                if v is not None and version(b) != v:
                    b.copy_(value)


def storage_ptr(t: Tensor) -> int:
    """The address of ``t``'s storage (tensors that share memory share it)."""
    return t.untyped_storage().data_ptr()


def storage_weakref(t: Tensor):
    """A weak reference to ``t``'s storage: its ``expired()`` tells whether any tensor
    still holds that memory (torch's ``StorageWeakRef``, which torch's own tensor
    bookkeeping uses; it keeps nothing alive)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def storage_key(t: Tensor) -> tuple:
    """``(storage address, offset, shape, strides)``: equal for two tensors that are the
    same view of the same memory."""
    return (storage_ptr(t), t.storage_offset(), tuple(t.shape), t.stride())


def saved_self(out: Tensor) -> Tensor | None:
    """The first factor of ``x.mul_(w)`` before the call: the copy autograd saved of it
    for ``w``'s gradient (``grad_fn._saved_self``, documented in torch's "Autograd
    mechanics", saved tensors), None where there is none."""
    node = out.grad_fn
    if node is None or type(node).__name__ != "MulBackward0":
        return None
    try:
        saved = node._saved_self
    except RuntimeError:  # freed, or not saved
        return None
    if not isinstance(saved, Tensor) or saved.shape != out.shape or saved.dtype != out.dtype:
        return None
    return saved


def own_parameters(module: nn.Module) -> list:
    """``list(module.named_parameters(recurse=False))`` (each parameter once, under its
    first name), read from the module's parameter table: the engine asks for it on every
    layer call, where ``named_parameters``' generators cost more than the reading."""
    table = module._parameters
    if not table:
        return []
    out = [(k, p) for k, p in table.items() if p is not None]
    if len(out) > 1 and len({id(p) for _, p in out}) < len(out):
        seen: set = set()
        out = [(k, p) for k, p in out if not (id(p) in seen or seen.add(id(p)))]
    return out


def module_hooks(module: nn.Module, backward: bool = False, own: bool = True) -> tuple:
    """The ids of ``module``'s forward hooks and forward pre-hooks (and, with
    ``backward``, its backward hooks), in registration order; without ``own``, leaving
    out memconv's own (:func:`own_hook`)."""
    if not (module._forward_hooks or module._forward_pre_hooks or backward):
        return ()
    dicts = [module._forward_hooks, module._forward_pre_hooks]
    if backward:
        dicts += [module._backward_hooks, module._backward_pre_hooks]
    if own:
        return tuple(k for d in dicts for k in d)
    return tuple(k for d in dicts for k, fn in d.items() if not getattr(fn, _OWN_HOOK, False))


_OWN_HOOK = "_memconv_own_hook"


def own_hook(fn):
    """Mark a module hook function as memconv's own (a recorded block's, which records
    the model's calls and changes none): :func:`module_hooks` with ``own=False`` leaves
    it out."""
    setattr(fn, _OWN_HOOK, True)
    return fn


def global_module_hooks(backward: bool = False) -> tuple:
    """The global module hooks (``nn.modules.module.register_module_forward_hook`` and
    its pre-hook; with ``backward``, the backward ones)."""
    hooks = (*_module._global_forward_hooks.values(), *_module._global_forward_pre_hooks.values())
    if backward:
        hooks += (
            *_module._global_backward_hooks.values(),
            *_module._global_backward_pre_hooks.values(),
        )
    return hooks


def compiled_inner(model) -> nn.Module | None:
    """The eager module a ``torch.compile``'d model (``OptimizedModule``) wraps, or None."""
    if type(model).__name__ != "OptimizedModule":  # (no failing attribute lookup)
        return None
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def compile_backend(model):
    """The compiler backend a ``torch.compile``'d model was compiled with (a callable
    ``torch.compile`` takes as ``backend``: inductor with the model's mode and options,
    or another backend), or None for a model that is not compiled."""
    if compiled_inner(model) is None:
        return None
    backend = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    while getattr(backend, "_torchdynamo_orig_backend", None) is not None:
        backend = backend._torchdynamo_orig_backend
    return backend if callable(backend) else "inductor"


#: Inductor options a traced per-sample step or a streamed tile (one graph of a forward
#: and a backward pass) compiles with where the model's own options leave them unset:
#: inductor's reordering for locality moves kernels next to the ones sharing their
#: inputs, which across such a graph keeps buffers alive far past their last use
#: (torchvision's ResNet-18 with GroupNorm, batch 64, on the CPU: allocator peak 232 MiB
#: with it, 166 MiB without, the step's time the same).
STEP_INDUCTOR_OPTIONS = {"reorder_for_locality": False}


def graph_inductor_options(graph) -> dict:
    """Inductor options for one traced graph (a ``torch.fx.GraphModule`` of ATen
    operations), beneath :data:`STEP_INDUCTOR_OPTIONS` and the model's own options.

    ``layout_optimization`` is off where the graph's convolutions are all dense and on
    the CPU: there inductor turns a graph with convolutions to channels-last, but a
    traced graph's reads and writes (a tile's halos and sent gradients, the activations a step's
    per-sample norms read) keep the layout they were traced with, and the kernels
    between the two layouts transpose element by element, unvectorised. Where a
    convolution is depthwise (one input and one output channel per group, as in
    ConvNeXt's blocks; not the grouped convolutions of memconv's per-sample weight
    gradients, the samples as groups), inductor's channels-last layout is kept: there
    it is the faster one. On other devices inductor's own choice stands (it weighs the layout per graph there,
    and nothing here was measured on them). docs/compiling.md and docs/streaming.md
    give the CPU steps' times either way."""
    convolutions = [
        (node.args[1].meta.get("val"), node.args[8])  # the weight, the groups
        for node in graph.graph.nodes
        if node.op == "call_function" and node.target is torch.ops.aten.convolution.default
    ]
    if not convolutions or any(w is None or w.device.type != "cpu" for w, _ in convolutions):
        return {}
    if any(_depthwise(w, groups) for w, groups in convolutions):
        return {}
    return {"layout_optimization": False}


def _depthwise(weight: Tensor, groups: int) -> bool:
    """Whether a convolution of weight ``[C_out, C_in/G, *k]`` is depthwise: one input
    and one output channel per group. A per-sample weight gradient taken as a grouped
    convolution (the samples as groups, each with ``C_out`` channels) is not: its
    input ``[1, N·C_in, ...]`` has as many channels per group as the layer, and its
    weight more than one channel per group."""
    return groups > 1 and weight.shape[1] == 1 and weight.shape[0] == groups


def step_backend(backend, graph=None):
    """The backend a traced per-sample step or a tile's graph compiles with: inductor
    (``"inductor"`` or a model's inductor with its mode and options) with
    :data:`STEP_INDUCTOR_OPTIONS` and, given the traced ``graph``,
    :func:`graph_inductor_options` beneath the model's own options; any other backend
    as it is."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is None:
        return backend
    if isinstance(backend, str) and backend == "inductor":
        backend = wrapper(None, None, None)
    if not isinstance(backend, wrapper):
        return backend
    from torch._inductor import config

    known = config.get_config_copy()
    graph_options = graph_inductor_options(graph) if graph is not None else {}
    chosen = {**STEP_INDUCTOR_OPTIONS, **graph_options}
    options = {k: v for k, v in chosen.items() if k in known}
    return wrapper(None, {**options, **backend.config}, backend.dynamic)


def graph_owned_outputs(backend) -> bool:
    """Whether ``backend`` runs a graph as a CUDA graph whose outputs live in memory the
    next replay overwrites (inductor with ``mode="reduce-overhead"``, its
    ``triton.cudagraphs`` option, or the ``"cudagraphs"`` backend): a caller keeping
    an output past the next call must copy it."""
    name = backend if isinstance(backend, str) else getattr(backend, "compiler_name", None)
    if name == "cudagraphs":
        return True
    config = getattr(backend, "config", None)
    return bool(isinstance(config, dict) and config.get("triton.cudagraphs"))


def module_hook_items(module: nn.Module):
    """``(kind, hook)`` for each of ``module``'s own forward, forward pre-, backward and
    backward pre-hooks."""
    for kind, hooks in (
        ("forward hook", module._forward_hooks),
        ("forward pre-hook", module._forward_pre_hooks),
        ("backward hook", module._backward_hooks),
        ("backward pre-hook", module._backward_pre_hooks),
    ):
        for hook in hooks.values():
            yield kind, hook


def random_op(target, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether a traced graph's node (``target`` called on ``args``, ``kwargs``) draws
    random numbers: an operation of ATen's ``nondeterministic_seeded`` tag (dropout,
    ``rand``, ``bernoulli``, attention with dropout), unless its dropout probability
    (``dropout_p``, or ``p`` with ``train``) makes it draw none."""
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update({a.name: v for a, v in zip(schema.arguments, args)})
    bound.update(kwargs or {})
    if "dropout_p" in bound:
        return bound["dropout_p"] != 0
    if "p" in bound and "train" in bound:
        return bool(bound["train"]) and bound["p"] != 0
    return True


def literal_copy(target) -> bool:
    """Whether a traced graph's node target is the copy ``make_fx`` reads a literal
    tensor made inside the traced function through (``torch.tensor(2.0)``)."""
    return target is torch.ops.aten.lift_fresh_copy.default


def tracing() -> bool:
    """Whether ``make_fx`` is recording the tensor operations that run now (a compiled
    step's trace, :func:`make_fx_real`)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def pytree_builder(spec) -> Callable:
    """``build(leaves) -> pytree``: ``tree_unflatten`` of ``spec`` (a ``TreeSpec``) from
    an iterator of its leaves, in order, made once: dicts, lists and tuples are built
    directly, other nodes by ``tree_unflatten`` of their part (a traced step's result,
    rebuilt at every call)."""
    if spec.is_leaf():
        return next
    children = spec.children() if callable(getattr(spec, "children", None)) else None
    if children is None:
        children = spec.children_specs  # (torch before 2.6)
    parts = [pytree_builder(c) for c in children]
    if spec.type is dict:
        keys = list(spec.context)
        return lambda leaves: {k: part(leaves) for k, part in zip(keys, parts)}
    if spec.type is list:
        return lambda leaves: [part(leaves) for part in parts]
    if spec.type is tuple:
        return lambda leaves: tuple([part(leaves) for part in parts])
    n = spec.num_leaves
    return lambda leaves: tree_unflatten([next(leaves) for _ in range(n)], spec)


def make_fx_real(fn, args: tuple):
    """``fn(*args)`` traced into a ``torch.fx.GraphModule`` of ATen operations on real
    tensors (``torch.fx.experimental.proxy_tensor.make_fx``): autograd, hooks and Python
    run as they would, their tensor operations recorded; a host read of a traced value
    raises."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="real")(*args)


def min_cut_halves(graph, example_inputs: list, tangent: int) -> tuple:
    """A traced step ``graph(*inputs) -> [*leaves, output]`` (ATen operations, as
    :func:`make_fx_real` makes), one of whose inputs (``tangent``: its position) is the
    output gradient, parted into a forward half ``(*other inputs) -> [output, *saved]``
    and a backward half ``(*saved, gradient) -> leaves`` by AOT Autograd's min-cut
    partitioner, the one every ``torch.compile``'d training graph goes through
    (``torch._functorch.partitioners.min_cut_rematerialization_partition``): it chooses
    the forward values the backward half reads so that their bytes are fewest, the
    backward half computing again what is cheap to (pointwise operations, views) rather
    than keeping it.

    The graph is first made functional (``torch.func.functionalize``, traced on fake
    tensors of ``example_inputs``' shapes: no computation): in-place operations become
    out-of-place ones, so that the two halves may run the operations in any order
    their data allow.

    Returns:
        ``(forward, backward, saved)``: two ``torch.fx.GraphModule`` and the number of
        tensors the first hands the second.

    Raises:
        NotTraceable: the graph writes in place to one of its inputs, parameters or
            buffers (the functional halves would drop the write, and the re-trace would
            make it on the real tensor), keeps a mutation once functional, or the
            halves' hand-over is not in the order above.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.fx.experimental.proxy_tensor import make_fx

    written = _written_inputs(graph)
    if written:  # (and the re-trace below would write to the real parameter or buffer)
        raise NotTraceable(f"the step writes in place to its input or buffer {written[0]}")

    def reordered(*args):
        *leaves, output = graph(*args)
        return [output, *leaves]

    with torch.no_grad():
        joint = make_fx(
            torch.func.functionalize(reordered), tracing_mode="fake", _allow_non_fake_inputs=True
        )(*example_inputs)
    for node in joint.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.is_mutable:
            raise NotTraceable(f"the functional step still mutates a tensor ({node.target})")
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    for i, node in enumerate(placeholders):  # the partitioner's naming of its inputs
        node.target = node.name = "tangents_1" if i == tangent else f"primals_{i + 1}"
    joint.graph._codegen = torch.fx.graph.CodeGen()  # plain arguments, not make_fx's pytree
    joint.recompile()
    forward, backward = min_cut_rematerialization_partition(
        joint, example_inputs, num_fwd_outputs=1
    )
    saved = forward.graph.output_node().args[0][1:]
    names = [n.name for n in backward.graph.find_nodes(op="placeholder")]
    if names != [*(n.name for n in saved), "tangents_1"]:
        raise NotTraceable("the partitioner's halves hand over their tensors in another order")
    return forward, backward, len(saved)


def _written_inputs(graph) -> list[str]:
    """Names of the inputs, parameters and buffers of a graph of ATen operations that
    one of its operations writes to in place (through views and earlier in-place
    results, which alias their first argument)."""

    def root(node):
        while node.op == "call_function":
            schema = getattr(node.target, "_schema", None)
            returns = schema.returns if schema is not None else ()
            if not (returns and returns[0].alias_info is not None and node.args):
                break
            if not isinstance(node.args[0], torch.fx.Node):
                break
            node = node.args[0]
        return node

    written = []
    for node in graph.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node) and root(value).op in ("placeholder", "get_attr"):
                written.append(str(root(value).target))
    return written


def compile_graph(graph, example_inputs: list, backend):
    """``graph`` (a ``torch.fx.GraphModule`` of ATen operations, as :func:`make_fx_real`
    makes) compiled by ``backend`` directly, as Dynamo hands its graphs to a backend
    (``backend(graph, example_inputs)``; a name is looked up in Dynamo's registry),
    without Dynamo re-reading the graph's Python: no guard, graph break or
    recompilation. Returns a callable ``compiled(*tensors) -> list``, which compiles at
    its first call (the trace's own call runs the graph as recorded).

    The compiled code is specialised to the example inputs' shapes, strides, dtypes and
    devices (inductor asserts them at each call): the caller keeps one per such
    signature. The graph's parameters and buffers (``make_fx`` registers the model's
    tensors it reads as such) are lifted to inputs by AOT Autograd, so in-place updates
    of them between calls are read."""
    return _LazyCompiled(graph, example_inputs, backend)


def compile_graph_boxed(graph, example_inputs: list, backend):
    """:func:`compile_graph` called with one list of tensors, ``compiled(tensors)``,
    which the compiled code empties as it starts: each input is freed after its last
    use inside the graph where the caller holds no other reference to it (the boxed
    calling convention Dynamo gives compiled autograd's graphs, through
    ``torch._dynamo.utils.GmWrapper``). For inductor and ``"aot_eager"``, whose AOT
    Autograd takes that wrapper; any other backend is called as :func:`compile_graph`'s,
    the list unpacked (its inputs live until the call returns)."""
    return _LazyCompiled(graph, example_inputs, backend, boxed=_takes_boxed(backend))


def _takes_boxed(backend) -> bool:
    if isinstance(backend, str):
        return backend in ("inductor", "aot_eager")
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    return wrapper is not None and isinstance(backend, wrapper)


class _LazyCompiled:
    def __init__(self, graph, example_inputs: list, backend, boxed: bool = False):
        self.graph, self.backend, self.fn, self.boxed = graph, backend, None, boxed
        self.example = [  # the inputs' layout, not their values (nothing kept alive)
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in example_inputs
        ]

    def _compile(self):
        from torch._dynamo.backends.registry import lookup_backend

        graph = self.graph
        if type(graph.graph._codegen) is not torch.fx.graph.CodeGen:  # make_fx's pytree one
            graph.graph._codegen = torch.fx.graph.CodeGen()
            graph.recompile()
        backend = self.backend
        compiler = lookup_backend(backend) if isinstance(backend, str) else backend
        if self.boxed:
            from torch._dynamo.utils import GmWrapper

            graph = GmWrapper(graph, lambda args: args)
        self.fn = compiler(graph, self.example)
        self.example = None

    def __call__(self, *tensors):
        if self.fn is None:
            self._compile()
        if self.boxed:  # (called unboxed: the caller keeps its references)
            return self.fn(list(tensors))
        return self.fn(*tensors)

    def call_boxed(self, tensors: list):
        """The compiled graph on ``tensors``, which it empties (see
        :func:`compile_graph_boxed`)."""
        if self.fn is None:
            self._compile()
        if self.boxed:
            return self.fn(tensors)
        args = tuple(tensors)
        tensors.clear()
        return self.fn(*args)


def opaque(name: str, schema: str, fake):
    """A decorator making ``fn`` one operation of a traced graph: the ``torch.library``
    custom operator ``memconv::name`` (its ``schema``, e.g. ``"(Tensor x, int n) ->
    Tensor"``; no argument mutated, the result aliasing none) with ``fake`` as its fake
    kernel (the result's shape, dtype and device from the arguments'). A compiler
    calls it as it is, in-place work on its own buffers included, where it would
    otherwise functionalise that work into copies. Where torch has no
    ``torch.library.custom_op`` (before 2.4), ``fn`` itself."""

    def wrap(fn):
        custom_op = getattr(torch.library, "custom_op", None)
        if custom_op is None:
            return fn
        op = custom_op(f"memconv::{name}", fn, mutates_args=(), schema=schema)
        op.register_fake(fake)
        return op

    return wrap


def assert_on_device(flag: Tensor, message: str) -> None:
    """Fail where ``flag`` (a one-element bool tensor) is False, on its device, without
    a host synchronisation (``torch._assert_async``: on CUDA a device-side assertion,
    which the next synchronisation reports; on the CPU at once)."""
    torch._assert_async(flag, message)


def not_traced(fn):
    """``fn`` as a step compiled with ``torch.compile`` calls it: as it is, between two
    graphs (one graph break), instead of Dynamo tracing into memconv's Python, which it
    would break at many places. ``torch.compiler.disable``."""
    return torch.compiler.disable(fn, recursive=True)


class without_grad:  # noqa: N801 — used as a context manager, as torch.no_grad
    """``torch.no_grad()`` around a compiled step's call: the grad mode switched by
    ``torch._C._set_grad_enabled`` (what ``no_grad`` runs) and put back, without
    ``no_grad``'s decorator machinery, which on a step of tens of microseconds costs
    one of them."""

    __slots__ = ("_prev",)

    def __enter__(self):
        self._prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc):
        torch._C._set_grad_enabled(self._prev)


def no_torch_function():
    """A block in which no ``__torch_function__`` mode or override runs."""
    return torch._C.DisableTorchFunction()


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad) is running."""
    return torch._C._are_functorch_transforms_active()


def queue_backward_callback(callback) -> None:
    """Run ``callback()`` once the backward pass running now has finished (autograd's
    final callbacks: still inside ``backward()``, after every hook). Only during a
    backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def graph_task_id() -> int | None:
    """An id of the backward pass running now (None outside one, or where torch has
    no such id)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    task = current() if current is not None else -1
    return None if task == -1 else task


# ------------------------------------------------------------------ trace checks
# What a make_fx trace cannot keep is refused (the compiled per-sample step,
# memconv.engine.traced, and the compiled streamed tiles, memconv.streaming.compiled).


class NotTraceable(RuntimeError):
    """A step that cannot run as one compiled graph (the reason in the message)."""


def first_line(error: BaseException) -> str:
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


def check_hooks(model: nn.Module, allowed: tuple = ()) -> None:
    """Refuse a model whose modules hold hooks that may act outside their tensors'
    computation (store an activation, log, count): a trace runs them once, and the
    compiled step would not run them again. Pruning's and weight normalisation's hooks,
    which only compute a weight, are kept, and so are the hook functions in ``allowed``
    (those whose effects the traced step returns as its outputs).

    Raises:
        NotTraceable: naming the module and the hook.
    """
    if global_module_hooks(backward=True):
        raise NotTraceable("global module hooks are registered (they would run only at the trace)")
    for name, module in model.named_modules():
        for kind, hook in module_hook_items(module):
            if any(c.__name__ in _PURE_HOOKS for c in type(hook).__mro__):
                continue
            if any(hook is a for a in allowed):
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
