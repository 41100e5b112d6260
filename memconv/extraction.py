"""Per-sample gradients of a whole model in one backward pass.

The forward pass records, for every module that owns trainable parameters, its
input and attaches a hook to its output (:func:`memconv.grad_sample.capture`); in
the one backward pass the hook receives the output gradient and the per-sample
parameter gradients are computed right there (:func:`memconv.grad_sample.grad_sample`:
convolutions by the strategy, Linear as a product, any other layer through
``torch.func``), after which the output gradient is dropped. The backward pass
asks autograd only for the gradients of the deepest of those outputs, so autograd
itself computes no parameter gradient: nothing is computed twice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from ._geometry import CONV_TRANSPOSE_TYPES, CONV_TYPES, conv_spec
from .context import activate, budgeted, use_block_settings
from .grad_sample import Autocast, capture, check_independent, grad_sample, own_trainable
from .vjp import check_settings


def check_per_sample_model(model: nn.Module, argument: str = "model") -> None:
    """Raise if ``model`` is not a module or a layer of it mixes samples.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
        ValueError: naming the first coupling layer (BatchNorm in training mode).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{argument} must be a torch.nn.Module, got {type(model).__name__}")
    for name, module in model.named_modules():
        check_independent(module, name or type(module).__name__)


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): name}`` for trainable parameters, each under its first name
    (``named_parameters`` lists a parameter shared by two layers once)."""
    return {id(p): n for n, p in model.named_parameters() if p.requires_grad}


def check_batch(inputs, targets) -> int:
    """Raise unless ``inputs`` is a tensor and ``targets`` has its length; returns N.

    Raises:
        TypeError: if ``inputs`` is not a tensor.
        ValueError: if the lengths differ.
    """
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
    if len(inputs) != len(targets):
        raise ValueError(
            f"inputs and targets must have the same length N, got {len(inputs)} and {len(targets)}"
        )
    return len(inputs)


def per_sample_losses(loss_fn, output: Tensor, targets) -> list[Tensor]:
    """``loss_fn(output[n:n+1], targets[n:n+1])`` for every sample n.

    Raises:
        ValueError: if ``loss_fn`` does not return a scalar tensor for one sample.
    """
    losses = []
    for i in range(len(output)):
        loss = loss_fn(output[i : i + 1], targets[i : i + 1])
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                "loss_fn must return a scalar tensor for one sample "
                f"(loss_fn(output[n:n+1], targets[n:n+1])), got {shape}"
            )
        losses.append(loss)
    return losses


def _graph_below(root, captured: set) -> tuple[set, set, set]:
    """Nodes reachable from ``root``; the captured ones with no captured node below
    them (backward direction): asking autograd for those runs every captured node
    reachable from ``root``; and the ids of the leaf tensors (parameters) reached."""
    reachable: set = set()
    leaves: set = set()
    below: dict = {}  # node -> a captured node lies strictly below it
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = [n for n, _ in node.next_functions if n is not None]
        if children_done:
            below[node] = any(c in captured or below[c] for c in children)
            continue
        if node in reachable:
            continue
        reachable.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            leaves.add(id(variable))
        stack.append((node, True))
        stack.extend((c, False) for c in children if c not in reachable)
    deepest = {n for n in captured & reachable if not below[n]}
    return reachable, deepest, leaves


@dataclass
class _Capture:
    """A parametrised layer's output in the graph, and whether its gradient arrived."""

    module: nn.Module
    name: str
    edge: object  # torch.autograd.graph.GradientEdge of the layer's output
    fired: list = field(default_factory=lambda: [False])

    @property
    def node(self):
        return self.edge.node


def per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    *,
    strategy: str | bool | None = None,
    memory_budget: int | None = None,
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
        model: any model whose parametrised layers take one tensor and return one
            (convolutions, transposed convolutions, Linear, normalisation layers,
            and any other layer through ``torch.func``).
        loss_fn: called as ``loss_fn(output[n:n+1], targets[n:n+1])``; must return a
            scalar tensor.
        inputs: ``[N, ...]``.
        targets: ``[N, ...]``.
        strategy: weight-VJP strategy of the convolutions (name or bool, default
            options); ``None`` uses the open :class:`memconv.save_memory` block, or
            ``"auto"`` outside any.
        memory_budget: bytes the whole call's peak memory increase may reach, the
            result included: the batch then runs in micro-batches and each layer's
            weight VJP within a budget, as :func:`memconv.plan` plans them. None:
            one pass over the whole batch. A model holding a
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
            one sample, a parametrised layer whose forward pass does not take one
            tensor.
        RuntimeError: when the gradient of a parameter that influences the loss was
            not reached (naming it).
    """
    from .planning import check_budget, make_plan, profile

    settings = use_block_settings(strategy)
    check_per_sample_model(model)
    n = check_batch(inputs, targets)
    check_budget(memory_budget)
    for module in model.modules():
        if isinstance(module, CONV_TYPES + CONV_TRANSPOSE_TYPES):
            check_settings(settings, conv_spec(module).geometry)
    names = parameter_names(model)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    out = {name: p.new_zeros(n, *p.shape) for name, p in params.items()}
    if n == 0:
        return out
    if streams(model):  # its layers are hidden from the hooks: one sample at a time
        with activate(settings):
            for i, grads in sample_by_sample(model, loss_fn, inputs, targets, params):
                for name, g in grads.items():
                    out[name][i] = g
        return out
    m, layer_budget = n, None
    if memory_budget is not None:
        chosen = make_plan(profile(model, inputs), n, "grads", settings, memory_budget)
        m, layer_budget = chosen.micro_batch, chosen.layer_budget
    settings = budgeted(settings, layer_budget)
    for i0 in range(0, n, m):
        rows = slice(i0, min(n, i0 + m))

        def visit(layer: LayerVisit, rows=rows):
            grads = grad_sample(layer.module, layer.x, layer.g, settings, layer.autocast)
            for k, v in grads.items():
                out[layer.params[k]][rows] += v

        with activate(None, False):  # the user's blocks do not reach the model's own layers
            backward_walk(model, loss_fn, inputs[rows], targets[rows], names, visit)
    return out


def streams(model: nn.Module) -> bool:
    """Whether ``model`` holds a :class:`memconv.streaming.StreamingCNN`, whose layers
    run inside its own autograd Function, out of reach of the per-layer hooks."""
    from .streaming import StreamingCNN

    return any(isinstance(m, StreamingCNN) for m in model.modules())


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
        loss = per_sample_losses(loss_fn, model(inputs[i : i + 1].detach()), targets[i : i + 1])[0]
        grads = torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
        yield (
            i,
            {k: g if g is not None else torch.zeros_like(params[k]) for k, g in zip(names, grads)},
        )


@dataclass(frozen=True)
class LayerVisit:
    """One parametrised layer's output gradient arriving in the backward pass.

    Attributes:
        module: the layer.
        name: its name in the model.
        params: ``{local parameter name: model parameter name}`` of its trainable
            parameters (a shared parameter under its first name).
        x: its input ``[N, ...]`` (detached).
        g: its output gradient.
        autocast: the autocast state its forward pass ran under.
    """

    module: nn.Module
    name: str
    params: dict
    x: Tensor
    g: Tensor
    autocast: Autocast


def backward_walk(
    model: nn.Module,
    loss_fn,
    inputs: Tensor,
    targets,
    names: dict,
    visit: Callable[[LayerVisit], None],
    *,
    caller: str = "memconv.per_sample_grads",
    keep_graph: bool = False,
) -> Tensor:
    """One forward and one backward pass in which every parametrised layer's output
    gradient is handed to ``visit`` (and then dropped); autograd computes no
    parameter gradient.

    Args:
        model: the model.
        loss_fn: per-sample loss, see :func:`per_sample_losses`.
        inputs: ``[N, ...]`` (detached for the pass).
        targets: ``[N, ...]``.
        names: :func:`parameter_names` of the model.
        visit: called once per layer and forward call, during the backward pass.
        caller: the public function's name, for messages.
        keep_graph: keep the graph for a second backward pass of the returned losses.

    Returns:
        The per-sample losses ``[N]`` (with their graph when ``keep_graph``).

    Raises:
        ValueError: a parametrised layer whose forward pass does not take one tensor,
            a ``loss_fn`` that does not return a scalar for one sample.
        RuntimeError: a layer whose output gradient influences the loss but never
            arrived (naming its parameters).
    """
    captures: list[_Capture] = []
    unseen: dict = {}  # parametrised layers that ran with gradients disabled
    module_names = {m: name or type(m).__name__ for name, m in model.named_modules()}
    active = [True]

    def forward_hook(module, args, output):
        name = module_names.get(module, type(module).__name__)
        if not isinstance(output, Tensor) or not output.requires_grad:
            if not torch.is_grad_enabled():  # inside a no-grad region of the model
                unseen[module] = name
            return None
        if len(args) != 1 or not isinstance(args[0], Tensor):
            raise ValueError(
                f"layer {name!r} ({type(module).__name__}) has trainable parameters but its "
                f"forward pass does not take one tensor; {caller} cannot split it by sample"
            )
        kept = [args[0].detach()]  # released once used: the input is freed as in autograd
        own = {k: names[id(p)] for k, p in own_trainable(module).items()}
        state = Autocast.current(output.device.type)
        fired = [False]

        def on_grad(g):
            if not active[0]:  # a second backward pass of a kept graph
                return
            fired[0] = True
            visit(LayerVisit(module, name, own, kept.pop(), g, state))

        output = capture(output, on_grad)
        captures.append(_Capture(module, name, get_gradient_edge(output), fired))
        return output

    owners = [m for m in model.modules() if own_trainable(m)]
    handles = [m.register_forward_hook(forward_hook) for m in owners]
    try:
        # detached: the graph then starts at the parametrised layers, whatever the
        # caller's inputs require
        output = model(inputs.detach())
    finally:
        for h in handles:
            h.remove()
    losses = torch.stack(per_sample_losses(loss_fn, output, targets))
    del output
    if losses.grad_fn is not None and captures:
        reachable, deepest, leaves = _graph_below(losses.grad_fn, {c.node for c in captures})
        edges = {(id(c.node), c.edge.output_nr): c.edge for c in captures if c.node in deepest}
        if edges:
            torch.autograd.grad(
                losses.sum(), list(edges.values()), allow_unused=True, retain_graph=keep_graph
            )
        active[0] = False
        missed = [c for c in captures if c.node in reachable and not c.fired[0]]
        if missed:
            raise RuntimeError(
                f"{caller}: the output gradient of layer {missed[0].name!r} "
                f"({type(missed[0].module).__name__}) influences the loss but never arrived, "
                "so the per-sample quantities of "
                f"{', '.join(names[id(p)] for p in own_trainable(missed[0].module).values())} "
                "are unknown"
            )
        covered = {id(p) for c in captures for p in own_trainable(c.module).values()}
        hidden = [name for i, name in names.items() if i in leaves and i not in covered]
        if hidden:
            raise RuntimeError(
                f"{caller}: the parameter {hidden[0]!r} influences the loss through an "
                "autograd Function that hides its layer's forward pass (as StreamingCNN "
                "does), so its per-sample quantities cannot be split by sample in one pass"
            )
        captured = {c.module for c in captures}
        quiet = [name for module, name in unseen.items() if module not in captured]
        if quiet:
            warnings.warn(
                f"{caller}: layers {quiet} ran their forward pass with gradients disabled "
                "inside the model; if their parameters influence the loss through a "
                "recomputation (reentrant checkpointing), their per-sample quantities are "
                "reported as zeros. Use torch.utils.checkpoint with use_reentrant=False.",
                stacklevel=3,
            )
    return losses if keep_graph else losses.detach()
