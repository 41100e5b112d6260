"""One forward and one backward pass that hand every layer call's output gradient to a
route: the layer's rule, the generic route, or the model route.

How each trainable parameter is covered is **checked, not assumed**. The forward pass
records every call of a module that owns trainable parameters: its arguments, the
batch axis of each argument and output (from a probe of one and two samples,
:func:`memconv.planning.profile`), and the window of autograd nodes the call created (their
sequence numbers). Before the backward pass, every use of a parameter in the graph
of the loss (an edge into its ``AccumulateGrad`` node) is attributed to the innermost
call that can differentiate it:

- a **rule call**: a layer with a rule (:func:`memconv.layers.find_rule`), called
  with positional tensors only, no hooks, batch axis first (or movable), for the
  layer's own parameters;
- an **operation call**: a call of an operation with a rule
  (:mod:`memconv.layers.ops`, found by :class:`memconv.optrace.OpRecorder`) on
  parameters or on functions of parameters alone (:class:`OpCall`), for the uses
  inside its window and, for a computed weight, the uses in that weight's graph
  (:func:`_claims`);
- a **generic call**: any other call of a parametrised module, for the parameters of
  its subtree (``torch.func`` on the call's real arguments,
  :func:`memconv.layers.generic.call_grad_sample`);
- otherwise the **model route**: the whole model's per-sample loss by ``torch.func``
  (:func:`memconv.layers.generic.model_grad_sample`) — a parameter used outside the
  modules that own it, in the loss function, or in a parent's ``forward``.

A parameter whose uses all lie in rule calls is summed over them; a generic call
covers every use inside it (nested calls included), so no use is counted twice and
none is missed. Autograd itself computes no parameter gradient in the walk.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.modules import module as module_mod
from torch.utils._pytree import tree_flatten, tree_unflatten

from .grad_sample import own_trainable
from .layers import LayerRule, RuleSettings, find_rule, run_rule, using
from .layers.generic import call_grad_sample, chunk_size
from .layers.ops import BoundOp, Broadcast, broadcast_ok, shell_rule
from .layers.standardise import weight_grads, weight_sq_norms
from .losses import PerSampleLoss
from .norms import grad_channel_stats, sq_norms
from .optrace import OpRecorder, paused

#: Marks a tensor whose batch axis cannot be told (it grew other than 1 → 2).
UNSPLIT = -1


def keep_rng():
    """A block after which the random number generators are as before it (a probe
    forward pass must not change the dropout masks of the pass that follows)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


def _axis(s1, s2) -> int | None:
    if s1 == s2:
        return None
    if len(s1) != len(s2):
        return UNSPLIT
    diff = [a for a, (u, v) in enumerate(zip(s1, s2)) if u != v]
    if len(diff) == 1 and s1[diff[0]] == 1 and s2[diff[0]] == 2:
        return diff[0]
    return UNSPLIT


def _shapes(tree) -> list:
    return _leaf_shapes(_flatten(tree)[0])


def _flatten(tree) -> tuple[list, object]:
    """``tree_flatten``, without its cost for the common calls: a tensor, or positional
    tensors and no keyword arguments (``(leaves, None)`` then)."""
    if isinstance(tree, Tensor):
        return [tree], None
    if (
        type(tree) is tuple
        and len(tree) == 2
        and type(tree[0]) is tuple
        and tree[1] == {}
        and all(isinstance(a, Tensor) for a in tree[0])
    ):
        return list(tree[0]), None
    return tree_flatten(tree)


def _unflatten(leaves: list, spec, tensor: bool):
    """The inverse of :func:`_flatten` (``tensor``: the tree was a tensor)."""
    if spec is not None:
        return tree_unflatten(leaves, spec)
    return leaves[0] if tensor else (tuple(leaves), {})


def _leaf_shapes(leaves) -> list:
    return [tuple(t.shape) if isinstance(t, Tensor) else None for t in leaves]


def owner_names(model: nn.Module) -> dict:
    """``{module: name}`` of the modules owning trainable parameters, in ``modules()``
    order (the model itself under its type's name)."""
    return {m: name or type(m).__name__ for name, m in model.named_modules() if own_trainable(m)}


@dataclass(frozen=True)
class CallAxes:
    """The batch axes of one layer call, found by :func:`call_axes`.

    Attributes:
        module: the layer.
        inputs: the batch axis of each leaf of ``(args, kwargs)`` (None: shared by
            all samples; :data:`UNSPLIT`: cannot be told).
        outputs: the same for each leaf of the output.
        shapes: the shapes of the leaves of ``(args, kwargs)`` and of the output in
            the probe of one sample (None for a leaf that is not a tensor).
    """

    module: nn.Module
    inputs: tuple
    outputs: tuple
    shapes: tuple = ((), ())

    def expected(self, m: int) -> tuple[list, list]:
        """The shapes of the call's leaves for ``m`` samples (None: not predicted)."""
        return [_grown(s, ax, m) for s, ax in zip(self.shapes[0], self.inputs)], [
            _grown(s, ax, m) for s, ax in zip(self.shapes[1], self.outputs)
        ]


def _grown(shape, ax, m: int):
    if shape is None or ax is None:
        return shape
    if ax == UNSPLIT:
        return None
    return (*shape[:ax], m, *shape[ax + 1 :])


class ProbeMismatch(RuntimeError):
    """A layer call differs from the probe's (data-dependent control flow, or a model
    changed since a probe was made)."""


@contextlib.contextmanager
def recording_calls(model: nn.Module):
    """Record ``(module, argument shapes, output shapes)`` of every call of a module
    owning trainable parameters during the forward passes run inside the block (the
    arguments as the caller gave them, before the module's forward pre-hooks), and
    ``(function, [data argument's shape], output shapes, ids of the trainable
    parameters reaching it)`` of every call of an operation with a rule on parameters
    (:class:`memconv.optrace.OpRecorder`).

    Yields:
        The list the calls are appended to, in forward order.
    """
    calls: list = []
    given: dict = {}  # module -> the arguments of its open calls, before any pre-hook

    def pre_hook(module, args, kwargs):
        with paused():
            given.setdefault(module, []).append(_shapes((args, kwargs)))

    def hook(module, args, kwargs, output):
        with paused():
            calls.append((module, given[module].pop(), _shapes(output)))

    def on_op(func, bound: BoundOp, run):
        out = run()
        reached = frozenset().union(*(recorder.depends(t) for t in bound.slots.values()))
        calls.append((func, [tuple(bound.data.shape)], _shapes(out), reached))
        return out

    handles = []
    for o in model.modules():
        if own_trainable(o):
            handles.append(o.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
            handles.append(o.register_forward_hook(hook, with_kwargs=True))
    try:
        recorder = OpRecorder(model, on_op)
        with recorder:
            yield calls
    finally:
        for h in handles:
            h.remove()


def call_axes(one: list, two: list) -> list[CallAxes]:
    """The batch axes of every recorded call, from :func:`recording_calls` of forward
    passes of one and of two samples.

    Raises:
        RuntimeError: if the two passes call different layers (data-dependent
            control flow).
    """
    if len(one) != len(two) or any(a[0] is not b[0] for a, b in zip(one, two)):
        raise RuntimeError(
            "the model calls its layers differently for one sample than for two (data-"
            "dependent control flow), so memconv cannot tell their batch axes"
        )
    return [
        CallAxes(
            module,
            tuple(_axis(u, v) if u is not None else None for u, v in zip(in1, in2)),
            tuple(_axis(u, v) if u is not None else None for u, v in zip(out1, out2)),
            (tuple(in1), tuple(out1)),
        )
        for (module, in1, out1, *_), (_, in2, out2, *_) in zip(one, two)
    ]


@dataclass(eq=False)
class LayerCall:
    """One forward call of a parametrised module, and what its route needs.

    Attributes:
        module: the layer.
        name: its name in the model.
        rule: its rule if the call is a rule call, else None (generic route).
        params: ``{name in module: name in model}`` of the parameters this call's
            route computes (filled before the backward pass).
        args, kwargs: the call's arguments (tensors detached).
        in_axes, out_axes: batch axes of their leaves and of the output's leaves.
        grads: the gradient of each output leaf as it arrives (None: not yet).
        output_elements: elements of the call's output (its tensor leaves).
        expected: the output leaves whose gradient will arrive.
        window: ``(first, last)`` autograd sequence numbers of the call's nodes.
        autocast: ``(device type, dtype or None)`` of the forward pass.
        edges: ``(output leaf index, gradient edge)`` of the captured outputs.
        shared: local names of parameters that other calls' routes also compute
            (their per-sample gradients must be summed before taking norms).
        done: whether the route ran (or had nothing to do).
        kept: set by a visitor that keeps the call's tensors for later.
    """

    module: nn.Module
    name: str
    rule: LayerRule | None
    args: tuple
    kwargs: dict
    in_axes: tuple
    out_axes: tuple
    window: tuple[int, int]
    autocast: tuple
    params: dict = field(default_factory=dict)
    grads: list = field(default_factory=list)
    output_elements: int = 0
    expected: set = field(default_factory=set)
    edges: list = field(default_factory=list)
    shared: set = field(default_factory=set)
    done: bool = False
    kept: bool = False
    named: dict | None = None

    @property
    def what(self) -> str:
        return f"layer {self.name!r} ({type(self.module).__name__})"

    def rule_inputs(self) -> tuple[tuple[Tensor, ...], Tensor]:
        """``(inputs, grad_output)`` with the batch axis first, for the rule."""
        inputs = tuple(a.movedim(ax, 0) if ax else a for a, ax in zip(self.args, self.in_axes))
        g = self.grads[0]
        ax = self.out_axes[0]
        return inputs, (g.movedim(ax, 0) if ax else g)

    def n(self) -> int:
        for leaf, ax in zip(tree_flatten((self.args, self.kwargs))[0], self.in_axes):
            if isinstance(leaf, Tensor) and ax is not None:
                return leaf.shape[ax]
        for g, ax in zip(self.grads, self.out_axes):
            if g is not None:
                return g.shape[ax]
        return 0

    def settings(self, rs: RuleSettings) -> RuleSettings:
        return RuleSettings(rs.settings, rs.norm_route, rs.budget, self.autocast)

    def grad_sample(self, rs: RuleSettings) -> dict[str, Tensor]:
        """Per-sample gradients ``{name in module: [N, ...]}`` of :attr:`params`."""
        if self.rule is not None:
            inputs, g = self.rule_inputs()
            with using(self.settings(rs)):
                out = run_rule(self.rule, "grad_sample", self.module, inputs, g)
            return self._typed({k: v for k, v in out.items() if k in self.params})
        leaves = tree_flatten((self.args, self.kwargs))[0]
        per = sum(p.numel() for k, p in self._named().items() if k in self.params)
        per += sum(t[:1].numel() for t in leaves if isinstance(t, Tensor))
        per += sum(g[:1].numel() for g in self.grads if g is not None)
        n = self.n()
        itemsize = next((g.element_size() for g in self.grads if g is not None), 4)
        out = call_grad_sample(
            self.module, self.args, self.kwargs, self.in_axes, self.grads, self.out_axes,
            list(self.params), what=self.what, chunk=chunk_size(n, 4 * per * itemsize, rs.budget),
        )  # fmt: skip
        return self._typed(out)

    def sq_norms(self, rs: RuleSettings) -> dict[str, Tensor]:
        """Squared per-sample norms ``{name in module: [N]}`` of :attr:`params`."""
        if self.rule is not None:
            inputs, g = self.rule_inputs()
            with using(self.settings(rs)):
                out = run_rule(self.rule, "sq_norms", self.module, inputs, g)
            out = {k: v for k, v in out.items() if k in self.params}
        else:
            out = {k: sq_norms(v) for k, v in self.grad_sample(rs).items()}
        return {k: v.to(torch.promote_types(v.dtype, torch.float32)) for k, v in out.items()}

    def summed_grad(self, rs: RuleSettings, scale: Tensor) -> dict[str, Tensor]:
        """Σₙ scaleₙ·(per-sample gradient)ₙ of :attr:`params` (a rule call)."""
        inputs, g = self.rule_inputs()
        shape = (-1,) + (1,) * (g.dim() - 1)
        g = g * scale.to(g.dtype).reshape(shape)
        with using(self.settings(rs)):
            out = run_rule(self.rule, "summed_grad", self.module, inputs, g)
        return self._typed({k: v for k, v in out.items() if k in self.params})

    def _named(self) -> dict[str, Tensor]:
        """``{name in module: parameter}`` over the module's subtree (duplicates kept)."""
        if self.named is None:
            self.named = dict(self.module.named_parameters(remove_duplicate=False))
        return self.named

    def _typed(self, out: dict) -> dict:
        named = self._named()
        return {k: v.to(named[k].dtype) for k, v in out.items()}

    def release(self) -> None:
        """Drop the tensors kept for the route."""
        self.args, self.kwargs, self.grads = (), {}, []


@dataclass(eq=False)
class OpCall(LayerCall):
    """One call of an operation with a rule (:mod:`memconv.layers.ops`) on parameters,
    or on functions of parameters alone (``w' = f(w)``), whatever module makes it.

    :attr:`module` is the operation's shell layer, whose rule serves the call; its
    parameters are the slots' tensors. The per-sample gradients of a parameter reached
    through ``f`` are the vjps of ``f`` of the slot's per-sample gradients (one
    batched vjp per chunk of samples, on ``f``'s autograd graph); its summed gradient
    one vjp of the slot's summed gradient (``Σ cₙ J_fᵀ g'ₙ = J_fᵀ Σ cₙ g'ₙ``). Where ``f``
    is a weight standardisation the recorder recognised
    (:mod:`memconv.layers.standardise`), the per-sample gradients and norms follow
    from the slot's per-sample gradients in closed form instead, without autograd.

    Attributes:
        sources: ``{slot: (slot tensor with its graph, {id(parameter): parameter})}``
            of the trainable slots: the parameter itself, or the parameters ``f``
            reaches (filled by :func:`_claims`).
        direct: ``{id(parameter): model name}`` of the parameters in a slot as they are.
        roots: ``{slot: grad_fn}`` of the slots computed from parameters.
        maps: ``{slot: (Standardised recipe, ids of the trainable parameters its gain
            depends on)}`` of the slots computed by a recognised standardisation.
        partial: the shell with the slots of :attr:`maps` frozen (None without
            maps): the rule's norms of the other slots alone.
    """

    sources: dict = field(default_factory=dict)
    direct: dict = field(default_factory=dict)
    roots: dict = field(default_factory=dict)
    model_names: dict = field(default_factory=dict)
    maps: dict = field(default_factory=dict)
    partial: nn.Module | None = None

    @property
    def what(self) -> str:
        return f"operation {self.name!r}"

    def _named(self) -> dict[str, Tensor]:
        if self.named is None:
            self.named = {}
            for _, (_, leaves) in self.sources.items():
                for pid, p in leaves.items():
                    self.named[self.model_names[pid]] = p
        return self.named

    def _slot_out(self, rs: RuleSettings, method: str, g=None) -> dict[str, Tensor]:
        inputs, grad = self.rule_inputs()
        if g is not None:
            grad = g
        with using(self.settings(rs)):
            return run_rule(self.rule, method, self.module, inputs, grad)

    def _chain(self, slot: str, grads: Tensor, batched: bool) -> dict[str, Tensor]:
        """``{model name: vjp}`` of the slot's gradients to the parameters under it."""
        tensor, leaves = self.sources[slot]
        return self._vjp(tensor, leaves, grads, batched)

    def _vjp(self, tensor: Tensor, leaves: dict, grads: Tensor, batched: bool) -> dict:
        """``{model name: vjp}`` of ``grads`` (``[n, *tensor.shape]`` if ``batched``)
        through ``tensor``'s graph to ``leaves`` ``{id(parameter): parameter}``."""
        names = [self.model_names[pid] for pid in leaves]
        if tensor.grad_fn is None:  # the parameter itself
            return {names[0]: grads}
        params = list(leaves.values())
        grads = grads.to(tensor.dtype)
        with torch.enable_grad():
            if not batched:
                out = torch.autograd.grad(
                    tensor, params, grads, retain_graph=True, allow_unused=True
                )
                return {k: _zero(v, p) for k, v, p in zip(names, out, params)}
            n = grads.shape[0]
            step = max(1, _CHAIN_BYTES // max(1, 4 * tensor.numel() * tensor.element_size()))
            parts: list = [[] for _ in params]
            for i in range(0, n, step):
                chunk = grads[i : i + step]
                try:
                    out = torch.autograd.grad(
                        tensor, params, chunk, retain_graph=True, allow_unused=True,
                        is_grads_batched=True,
                    )  # fmt: skip
                except RuntimeError:  # no batching rule for some backward formula
                    rows = [
                        torch.autograd.grad(tensor, params, c, retain_graph=True, allow_unused=True)
                        for c in chunk
                    ]
                    out = [
                        torch.stack([_zero(r[j], p) for r in rows]) for j, p in enumerate(params)
                    ]
                for j, (v, p) in enumerate(zip(out, params)):
                    parts[j].append(v if v is not None else p.new_zeros(len(chunk), *p.shape))
        return {k: torch.cat(v) for k, v in zip(names, parts)}

    def _closed(self, norms: bool) -> dict:
        """``{slot: (recipe, ids of the gain's parameters)}`` of the slots whose
        per-sample quantities take the closed form of the standardisation: the
        recipe's tensors untouched, the slot's parameters (as :func:`_claims` found
        them on the graph) exactly the weight and the gain's; for ``norms``, none of
        them reached through another slot too."""
        out = {}
        for slot, (recipe, gain) in self.maps.items():
            if slot not in self.sources or not recipe.intact():
                continue
            leaves = set(self.sources[slot][1])
            if leaves != {id(recipe.weight)} | set(gain):
                continue
            others = set()
            for other, (_, more) in self.sources.items():
                if other != slot:
                    others.update(more)
            if norms and leaves & others:
                continue
            out[slot] = (recipe, gain)
        return out

    def _gain_grads(self, slot: str, gain: frozenset, hat: Tensor) -> dict[str, Tensor]:
        """Per-sample gradients of the gain's parameters from those of the gain
        ``hat`` ``[n, C]`` (⟨gₙ,c, ŵ_c⟩), by the gain's own vjp."""
        recipe = self.maps[slot][0]
        leaves = self.sources[slot][1]
        if not gain:
            return {}
        return self._vjp(recipe.gain, {pid: leaves[pid] for pid in gain}, hat, True)

    def _collect(self, per_slot: dict, batched: bool, closed: dict | None = None) -> dict:
        out: dict = {}
        closed = closed or {}
        for slot, v in per_slot.items():
            if slot not in self.sources:
                continue
            if slot in closed:
                recipe, gain = closed[slot]
                gw, hat = weight_grads(v, recipe.form())
                chained = {self.model_names[id(recipe.weight)]: gw}
                chained.update(self._gain_grads(slot, gain, hat))
            else:
                chained = self._chain(slot, v, batched)
            for k, g in chained.items():
                if k in self.params:
                    out[k] = g if k not in out else out[k] + g
        return self._typed(out)

    def grad_sample(self, rs: RuleSettings) -> dict[str, Tensor]:
        return self._collect(self._slot_out(rs, "grad_sample"), True, self._closed(False))

    def sq_norms(self, rs: RuleSettings) -> dict[str, Tensor]:
        plain = all(t.grad_fn is None for t, _ in self.sources.values())
        if plain and len(self.sources) == len(self.params):
            out = self._slot_out(rs, "sq_norms")
            out = {self.params_of(slot): v for slot, v in out.items() if slot in self.sources}
            return {k: v.to(torch.promote_types(v.dtype, torch.float32)) for k, v in out.items()}
        closed = self._closed(True)
        if self._stats_only(closed):
            return self._closed_sq_norms(rs, closed)
        # per-sample gradients of the slots, a chunk of samples at a time: through f by
        # its closed form where known (norms from three numbers per channel), else by
        # batched vjps
        forms = {slot: recipe.form() for slot, (recipe, _) in closed.items()}
        inputs, g = self.rule_inputs()
        n = g.shape[0]
        per = sum(t.numel() * t.element_size() for t, _ in self.sources.values())
        if len(closed) < len(self.sources):
            per += sum(p.numel() * p.element_size() for p in self._named().values())
            per *= 3
        else:  # a chunk's gradients and their squares
            per *= 2
        step = max(1, (rs.budget or _CHAIN_BYTES) // max(1, per))
        parts: dict = {}
        for i in range(0, n, step):
            rows = slice(i, i + step)
            with using(self.settings(rs)):
                slots = run_rule(
                    self.rule, "grad_sample", self.module, tuple(a[rows] for a in inputs), g[rows]
                )
            for slot, (recipe, gain) in closed.items():
                form = forms[slot]
                stats = grad_channel_stats(slots.pop(slot), form.w_hat)
                k = self.model_names[id(recipe.weight)]
                if k in self.params:
                    parts.setdefault(k, []).append(weight_sq_norms(stats, form))
                for k, v in self._gain_grads(slot, gain, stats[2]).items():
                    if k in self.params:
                        parts.setdefault(k, []).append(sq_norms(v.to(self._named()[k].dtype)))
                del stats
            for k, v in self._collect(slots, True).items():
                parts.setdefault(k, []).append(sq_norms(v))
            del slots
        out = {k: torch.cat(v) for k, v in parts.items()}
        return {k: v.to(torch.promote_types(v.dtype, torch.float32)) for k, v in out.items()}

    def _stats_only(self, closed: dict) -> bool:
        """Whether every slot computed from parameters takes the closed form (the
        others being parameters themselves), so that the rule's per-channel numbers
        (:meth:`memconv.layers.LayerRule.channel_stats`) and its norms of the other
        slots give all norms."""
        if not closed or self.partial is None or set(closed) != set(self.maps):
            return False
        rest = [t for slot, (t, _) in self.sources.items() if slot not in closed]
        return all(t.grad_fn is None for t in rest) and self.grads[0].numel() > 0

    def _closed_sq_norms(self, rs: RuleSettings, closed: dict) -> dict[str, Tensor]:
        inputs, g = self.rule_inputs()
        out: dict = {}
        with using(self.settings(rs)):
            for slot, (recipe, gain) in closed.items():
                form = recipe.form()
                with torch.no_grad():
                    stats = self.rule.channel_stats(self.module, inputs, g, slot, form.w_hat)
                out[self.model_names[id(recipe.weight)]] = weight_sq_norms(stats, form)
                for k, v in self._gain_grads(slot, gain, stats[2]).items():
                    out[k] = sq_norms(v.to(self._named()[k].dtype))
            if len(closed) < len(self.sources):
                rest = run_rule(self.rule, "sq_norms", self.partial, inputs, g)
                for slot, v in rest.items():
                    if slot in self.sources and slot not in closed:
                        out[self.params_of(slot)] = v
        out = {k: v for k, v in out.items() if k in self.params}
        return {k: v.to(torch.promote_types(v.dtype, torch.float32)) for k, v in out.items()}

    def params_of(self, slot: str) -> str:
        _, leaves = self.sources[slot]
        return self.model_names[next(iter(leaves))]

    def summed_grad(self, rs: RuleSettings, scale: Tensor) -> dict[str, Tensor]:
        inputs, g = self.rule_inputs()
        shape = (-1,) + (1,) * (g.dim() - 1)
        g = g * scale.to(g.dtype).reshape(shape)
        return self._collect(self._slot_out(rs, "summed_grad", g), False)

    def release(self) -> None:
        self._named()  # (read from the sources, which go)
        super().release()
        self.sources = {}
        self.maps = {}
        self.partial = None


#: Bytes of per-sample gradients a chain through a parameter-only map holds at once.
_CHAIN_BYTES = 64 * 2**20


def _zero(v, p: Tensor) -> Tensor:
    return torch.zeros_like(p) if v is None else v


def _hooked(module: nn.Module, ours) -> bool:
    """Whether hooks other than memconv's own may change the module's call."""
    others = [k for k in module._forward_hooks if k not in ours]
    others += [k for k in module._forward_pre_hooks if k not in ours]
    return bool(others or module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks)


def _rule_for(module, args, kwargs, in_axes, output, out_axes, ours) -> LayerRule | None:
    """The rule of a call if the call is one the rule describes exactly, else None."""
    rule = find_rule(module)
    if rule is None or kwargs or _hooked(module, ours):
        return None
    if not args or not all(isinstance(a, Tensor) for a in args) or not isinstance(output, Tensor):
        return None
    axes = (*in_axes, *out_axes)
    if all(a == 0 for a in axes):
        return rule
    if rule.movable_batch_axis and all(a is not None and a != UNSPLIT for a in axes):
        return rule
    return None


class _Sequence:
    """Sequence numbers of autograd nodes created from now on."""

    def __init__(self):
        self.anchor = torch.zeros((), requires_grad=True)

    def now(self) -> int:
        with torch.enable_grad():
            return (self.anchor * 1).grad_fn._sequence_nr()


def _graph(root) -> tuple[set, dict, dict]:
    """Nodes reachable from ``root``; for each, whether a captured node lies below;
    and the uses of leaves: ``{id(parameter): [sequence numbers of the using nodes]}``."""
    reachable: set = set()
    uses: dict[int, list[int]] = {}
    order: list = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node in reachable:
            continue
        reachable.add(node)
        order.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:
                uses.setdefault(id(variable), []).append(node._sequence_nr())
            if child not in reachable:
                stack.append(child)
    return reachable, uses, {}


def _deepest(captured: set, reachable: set) -> set:
    """The captured nodes with no captured node below them (backward direction):
    asking autograd for those runs every captured node reachable."""
    below: dict = {}
    stack = [(n, False) for n in captured & reachable]
    seen: set = set()
    while stack:
        node, children_done = stack.pop()
        children = [c for c, _ in node.next_functions if c is not None]
        if children_done:
            below[node] = any(c in captured or below.get(c, False) for c in children)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((c, False) for c in children if c not in seen)
    return {n for n in captured & reachable if not below[n]}


@dataclass
class Walk:
    """What :func:`backward_walk` found: the calls and how parameters are covered.

    Attributes:
        losses: the per-sample losses ``[N]`` (with their graph if kept).
        calls: every recorded layer call.
        model_params: model names of the parameters left to the model route.
        routes: ``{model name: number of calls whose route computes it}``.
    """

    losses: Tensor
    calls: list
    model_params: list
    routes: dict


def _check_axes(call_axes: CallAxes, module, args_shapes, out_shapes, m: int, name):
    """Raise unless the call is the probe's: the same module, its leaves of the shapes
    the probe predicts for ``m`` samples (``name``: the call's name, or a function
    making it, for the message)."""
    ok = call_axes.module is module
    if ok:
        want_in, want_out = call_axes.expected(m)
        for got, want in ((args_shapes, want_in), (out_shapes, want_out)):
            ok = ok and len(got) == len(want)
            ok = ok and all(w is None or g == w for g, w in zip(got, want))
    if not ok:
        name = name() if callable(name) else name
        raise ProbeMismatch(
            f"layer {name!r} ({type(module).__name__}) was called differently in the probe of "
            "one and two samples than for the batch (data-dependent control flow); memconv "
            "cannot tell its batch axes"
        )


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
) -> Walk:
    """One forward and one backward pass in which every layer call's output gradient
    reaches ``visit`` (once per call, then dropped); autograd computes no parameter
    gradient. Parameters no call can cover are left to the model route.

    Args:
        model: the model.
        loss_fn: the loss (or a :class:`memconv.losses.PerSampleLoss` of it), see
            :func:`memconv.losses.per_sample_losses`.
        inputs: ``[m, ...]`` (detached for the pass).
        targets: ``[m, ...]``.
        names: ``{id(parameter): model name}`` of the trainable parameters.
        axes: :func:`call_axes` of the model's probe (:meth:`memconv.planning.Profile.axes`).
        visit: called with each :class:`LayerCall` whose route computes at least
            one parameter, during the backward pass, once the call's output
            gradients have arrived; it may return work to run once the call's
            backward node has run (see :class:`_Visits`).
        caller: the public function's name, for messages.
        keep_graph: keep the graph for a second backward pass of the losses.
        prepare: called with the calls ``visit`` will get, in forward order, before
            the backward pass.
        owners: :func:`owner_names` of the model, if known.

    Returns:
        The :class:`Walk`.

    Raises:
        ValueError: a ``loss_fn`` that does not return a scalar per sample; a call
            whose output reaches the loss but has no batch axis.
        RuntimeError: an output gradient that should have arrived but did not.
    """
    per_sample = loss_fn if isinstance(loss_fn, PerSampleLoss) else PerSampleLoss(loss_fn)
    calls: list[LayerCall] = []
    if owners is None:
        owners = owner_names(model)
    seq = _Sequence()
    starts: dict = {}
    ours: set = set()
    unseen: dict = {}
    m = len(inputs)
    visits = _Visits(visit)
    counter = [0]

    open_modules: list = []  # the modules whose calls are open, innermost last
    covering: dict = {}  # see _covered_by_module

    def pre_hook(module, args, kwargs):
        # first of the module's pre-hooks: the call's arguments as the caller gave them,
        # which the generic route replays through the whole call, hooks included
        with paused():
            starts.setdefault(module, []).append((seq.now(), args, kwargs))
        open_modules.append(module)

    def on_op(func, bound: BoundOp, run):
        index = counter[0]
        counter[0] += 1
        inside = open_modules[-1] if open_modules else None
        # the body of a layer whose rule serves it: checked, but no call of its own
        covered = inside is not None and _covered_by_module(inside, bound, ours, covering)
        start = None if covered else seq.now()
        out = run()
        if not (isinstance(out, Tensor) and out.requires_grad):
            return out
        if index >= len(axes):
            raise ProbeMismatch(f"{caller}: the model calls more layers than in its probe")

        def name():
            where = owners[inside] if inside is not None else type(model).__name__
            return f"{where}: {getattr(func, '__name__', func)}"

        data_shape = [tuple(bound.data.shape)]
        _check_axes(axes[index], func, data_shape, _leaf_shapes([out]), m, name)
        if covered:
            return out
        if bound.before is not None:  # in place: the data as it was, else no call
            data = bound.before(out)
            if data is None or out._is_view():
                return out
            bound = replace(bound, data=data)
        call = _op_call(bound, out, axes[index], name(), (start, seq.now()), recorder, names)
        if call is None:
            return out
        calls.append(call)
        if out._is_view():
            out = out.clone()
        out.register_hook(visits.hook(call, 0))
        call.edges.append((0, get_gradient_edge(out)))
        return out

    def forward_hook(module, args, kwargs, output):
        with paused():
            return record_call(module, args, kwargs, output)

    def record_call(module, args, kwargs, output):
        start, given_args, given_kwargs = starts[module].pop()
        open_modules.pop()
        if _hooked(module, ours):  # a pre-hook may have replaced the arguments
            args, kwargs = given_args, given_kwargs
        index = counter[0]
        counter[0] += 1
        name = owners[module]
        out_leaves, out_spec = _flatten(output)
        if not any(isinstance(t, Tensor) and t.requires_grad for t in out_leaves):
            if not torch.is_grad_enabled():  # inside a no-grad region of the model
                unseen[module] = name
            return None
        end = seq.now()
        if index >= len(axes):
            raise ProbeMismatch(f"{caller}: the model calls more layers than in its probe")
        call_axes = axes[index]
        in_leaves, in_spec = _flatten((args, kwargs))
        _check_axes(call_axes, module, _leaf_shapes(in_leaves), _leaf_shapes(out_leaves), m, name)
        detached_args, detached_kwargs = _unflatten(
            [t.detach() if isinstance(t, Tensor) else t for t in in_leaves], in_spec, False
        )
        rule = _rule_for(module, args, kwargs, call_axes.inputs, output, call_axes.outputs, ours)
        call = LayerCall(
            module, name, rule, detached_args, detached_kwargs, call_axes.inputs,
            call_axes.outputs, (start, end), _autocast_state(out_leaves),
        )  # fmt: skip
        call.grads = [None] * len(out_leaves)
        call.output_elements = sum(t.numel() for t in out_leaves if isinstance(t, Tensor))
        calls.append(call)
        new_leaves = list(out_leaves)
        for j, t in enumerate(out_leaves):
            if not (isinstance(t, Tensor) and t.requires_grad):
                continue
            if t._is_view():  # an in-place op on a view would rebuild its graph
                t = t.clone()
                recorder.alias(t, out_leaves[j])
                new_leaves[j] = t
            t.register_hook(visits.hook(call, j))
            call.edges.append((j, get_gradient_edge(t)))
        return _unflatten(new_leaves, out_spec, isinstance(output, Tensor))

    handles = []
    for o in owners:  # (dict order: the model's modules)
        handles.append(o.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
        handles.append(o.register_forward_hook(forward_hook, with_kwargs=True))
    ours.update(h.id for h in handles)
    recorder = OpRecorder(model, on_op)
    try:
        with recorder:
            output = model(inputs.detach())
    finally:
        for h in handles:
            h.remove()
        recorder.pure = {}
    losses = per_sample(output, targets)
    del output
    walk = Walk(losses if keep_graph else losses.detach(), calls, [], {})
    if losses.grad_fn is None:
        walk.model_params = []
        return walk
    reachable, uses, _ = _graph(losses.grad_fn)
    claims = _claims([c for c in calls if isinstance(c, OpCall)], reachable, names)
    _assign(calls, uses, names, model, walk, claims)
    for call in calls:
        call.expected = {j for j, e in call.edges if e.node in reachable}
        if not call.params or not call.expected:
            call.release()
            call.done = True
    if prepare is not None:
        prepare([c for c in calls if not c.done])
    wanted = {e.node: e for c in calls if not c.done for _, e in c.edges}
    deepest = _deepest(set(wanted), reachable)
    edges = [wanted[n] for n in deepest]
    if edges:
        torch.autograd.grad(losses.sum(), edges, allow_unused=True, retain_graph=keep_graph)
    visits.finish()
    missed = [c for c in calls if not c.done]
    if missed:
        raise RuntimeError(
            f"{caller}: the output gradient of {missed[0].what} influences the loss but never "
            f"arrived, so the per-sample quantities of {', '.join(missed[0].params.values())} "
            "are unknown"
        )
    covered = {c.module for c in calls}
    quiet = [
        name
        for module, name in unseen.items()
        if module not in covered and not any(id(p) in uses for p in own_trainable(module).values())
    ]
    if quiet:
        warnings.warn(
            f"{caller}: layers {quiet} ran their forward pass with gradients disabled "
            "inside the model; if their parameters influence the loss through a "
            "recomputation (reentrant checkpointing), their per-sample quantities are "
            "reported as zeros. Use torch.utils.checkpoint with use_reentrant=False.",
            stacklevel=3,
        )
    return walk


def _autocast_state(leaves) -> tuple:
    device = next((t.device.type for t in leaves if isinstance(t, Tensor)), "cpu")
    if torch.is_autocast_enabled(device):
        return (device, torch.get_autocast_dtype(device))
    return (device, None)


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
            if not self.active or call.done:  # a second backward pass of a kept graph
                return
            call.grads[j] = grad
            if not all(call.grads[k] is not None for k in call.expected):
                return
            call.done = True
            work = self.visit(call)
            if work is None:
                if not call.kept:  # a visitor that keeps the call releases it itself
                    call.release()
                return
            entry = [call, work, None]
            node = dict(call.edges)[j].node  # the node that produced this output
            entry[2] = node.register_hook(lambda grad_inputs, grad_outputs: self._run(entry))
            self.later.append(entry)

        return on_grad

    def _run(self, entry: list) -> None:
        call, work, _ = entry
        if work is not None:
            entry[1] = None
            work()
            if not call.kept:
                call.release()

    def finish(self) -> None:
        """Run the work still waiting, and remove the post hooks."""
        self.active = False
        for entry in self.later:
            self._run(entry)
            entry[2].remove()
        self.later = []


def _covered_by_module(module: nn.Module, bound: BoundOp, ours, known: dict) -> bool:
    """Whether the operation call is the body of a layer whose rule serves it: the
    layer has a rule, no other hooks, and the call's parameters are its own
    (``known``: ``{module: ids of its own trainable parameters, or None}``, filled
    during one walk, in which neither the rules nor the hooks change)."""
    if module not in known:
        covers = find_rule(module) is not None and not _hooked(module, ours)
        known[module] = {id(p) for p in own_trainable(module).values()} if covers else None
    own = known[module]
    return own is not None and all(t is None or id(t) in own for t in bound.slots.values())


def _op_call(bound: BoundOp, out: Tensor, axes: CallAxes, name: str, window, recorder, names):
    """The :class:`OpCall` of a recorded operation call, or None if its rule cannot
    describe it (batch axes, a slot tensor that is neither a parameter nor computed)."""
    ax_in = axes.inputs[0] if axes.inputs else None
    ax_out = axes.outputs[0] if axes.outputs else None
    params: dict = {}
    sources: dict = {}
    direct: dict = {}
    roots: dict = {}
    maps: dict = {}
    for slot, t in bound.slots.items():
        if t is None:
            params[slot] = None
            continue
        trainable = recorder.trainable(t)
        params[slot] = nn.Parameter(t.detach(), requires_grad=trainable)
        if not trainable:
            continue
        via = (bound.via or {}).get(slot)
        if via is not None:  # the call receives ``via``, computed from the slot's tensor
            if via.grad_fn is None:
                return None
            sources[slot] = (t, {})
            roots[slot] = via.grad_fn
        elif t.grad_fn is None and id(t) in names:  # the parameter itself
            sources[slot] = (t, {id(t): t})
            direct[id(t)] = names[id(t)]
        elif t.grad_fn is not None:  # a function of parameters (checked by _claims)
            sources[slot] = (t, {})
            roots[slot] = t.grad_fn
            recipe = recorder.standardised(t)
            if recipe is not None:  # a weight standardisation: its closed form
                gain = recorder.depends(recipe.gain) if recipe.gain is not None else frozenset()
                maps[slot] = (recipe, gain)
        else:
            return None
    shell = bound.shell(params)
    partial = None
    if maps:  # the same shell with the standardised slots frozen
        frozen = {k: nn.Parameter(params[k].detach(), requires_grad=False) for k in maps}
        partial = bound.shell({**params, **frozen})
    if isinstance(shell, Broadcast) and not broadcast_ok(bound.data, params["weight"], out):
        return None
    rule = shell_rule(shell)
    if rule is None:
        return None
    if not (ax_in == 0 and ax_out == 0):
        if not rule.movable_batch_axis or any(a is None or a == UNSPLIT for a in (ax_in, ax_out)):
            return None
    call = OpCall(
        shell, name, rule, (bound.data.detach(),), {}, (ax_in,), (ax_out,), window,
        _autocast_state([out]), sources=sources, direct=direct, roots=roots, model_names=names,
        maps=maps, partial=partial,
    )  # fmt: skip
    call.grads = [None]
    call.output_elements = out.numel()
    return call


def _claims(ops: list, reachable: set, names: dict) -> dict:
    """``{op call: {id(parameter): sequence numbers of its uses}}`` the calls' computed
    slots account for: the nodes of each slot's graph, which must reach trainable
    parameters only, and into which every edge from the rest of the graph must come
    from the call itself (else some gradient would bypass the calls). A slot that
    fails is dropped from its call (its parameters' uses go to other routes)."""
    graphs: dict = {}  # (call, slot) -> (nodes, {pid: parameter}, {pid: seqs})
    for call in ops:
        for slot, root in call.roots.items():
            nodes: set = set()
            leaves: dict = {}
            seqs: dict = {}
            stack, ok = [root], True
            while stack and ok:
                node = stack.pop()
                if node in nodes:
                    continue
                nodes.add(node)
                for child, _ in node.next_functions:
                    if child is None:
                        continue
                    if hasattr(child, "variable"):
                        v = child.variable
                        if id(v) not in names:
                            ok = False
                            break
                        leaves[id(v)] = v
                        seqs.setdefault(id(v), set()).add(node._sequence_nr())
                    elif child not in nodes:
                        stack.append(child)
            if ok:
                graphs[(call, slot)] = (nodes, leaves, seqs)
    while True:
        inside: set = set().union(*(g[0] for g in graphs.values())) if graphs else set()
        entries: dict = {}
        for (call, slot), _ in graphs.items():
            entries.setdefault(call.roots[slot], []).append(call.window)
        bad = set()
        for node in reachable:
            if node in inside:
                continue
            for child, _ in node.next_functions:
                if child is None or child not in inside:
                    continue
                s = node._sequence_nr()
                if not any(lo < s < hi for lo, hi in entries.get(child, ())):
                    bad.add(child)
        if not bad:
            break
        graphs = {k: g for k, g in graphs.items() if not (g[0] & bad)}
    out: dict = {}
    for call in ops:
        for slot in list(call.roots):
            if (call, slot) not in graphs:
                del call.roots[slot]
                call.sources.pop(slot, None)
                continue
            _, leaves, seqs = graphs[(call, slot)]
            call.sources[slot] = (call.sources[slot][0], leaves)
            mine = out.setdefault(call, {})
            for pid, ss in seqs.items():
                mine.setdefault(pid, set()).update(ss)
    return out


def _assign(
    calls: list[LayerCall], uses: dict, names: dict, model: nn.Module, walk: Walk, claims: dict
):
    """Give each parameter's uses to routes (see the module docstring): the innermost
    rule call of a module owning the parameter, else the operation calls that account
    for the use, else the innermost generic call, else the model route."""
    ops = [c for c in calls if isinstance(c, OpCall)]
    windows = sorted((c for c in calls if not isinstance(c, OpCall)), key=lambda c: c.window[0])
    # {id(p): name in module} of the parameters each call's route can compute (a
    # parameter under two names: the first)
    routable: dict = {}
    for call in windows:
        if call.rule is not None:
            own = own_trainable(call.module).items()
        else:
            own = call.module.named_parameters(remove_duplicate=False)
        local: dict = {}
        for k, p in own:
            local.setdefault(id(p), k)
        routable[call] = local
    for call in ops:
        routable[call] = dict(call.direct)
        for pid in claims.get(call, {}):
            routable[call][pid] = names[pid]

    for pid, model_name in names.items():
        seqs = uses.get(pid, [])
        if not seqs:
            continue
        chosen: list[LayerCall] = []
        model_route = False
        for s in seqs:
            inner = None
            for call in windows:
                lo, hi = call.window
                if lo < s < hi and pid in routable[call]:
                    if inner is None or call.window[0] >= inner.window[0]:
                        inner = call
            picks = [inner] if inner is not None and inner.rule is not None else []
            if not picks:
                picks = [
                    c
                    for c in ops
                    if (pid in c.direct and c.window[0] < s < c.window[1])
                    or s in claims.get(c, {}).get(pid, ())
                ]
            if not picks and inner is not None:
                picks = [inner]
            if not picks:
                model_route = True
                break
            chosen.extend(c for c in picks if c not in chosen)
        if model_route:
            walk.model_params.append(model_name)
            continue
        outer = []
        for c in chosen:
            around = [
                o
                for o in chosen
                if o is not c
                and o.rule is None
                and o.window[0] < c.window[0]
                and c.window[1] < o.window[1]
            ]
            if not around:
                outer.append(c)
                continue
            # a generic call covers the uses inside its window only
            lo, hi = around[0].window
            if any(not lo < s < hi for s in claims.get(c, {}).get(pid, ())):
                model_route = True
        if model_route:
            walk.model_params.append(model_name)
            continue
        for call in outer:
            call.params[routable[call][pid]] = model_name
        walk.routes[model_name] = len(outer)
    for call in calls:
        call.shared = {k for k, full in call.params.items() if walk.routes.get(full, 0) > 1}
