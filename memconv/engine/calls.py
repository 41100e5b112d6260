"""The layer calls a walk hands to its visitor, and what each one's route computes.

A :class:`LayerCall` is one forward call of a parametrised module, kept with its
arguments and, as they arrive in the backward pass, its output gradients; its route
is the layer's rule (:mod:`memconv.layers`) or, without one, the generic route
(``torch.func`` on the call's real arguments, :func:`memconv.engine.generic.call_grad_sample`).
An :class:`OpCall` is one call of an operation with a rule (:mod:`memconv.layers.operations`)
on parameters or on functions of parameters alone, whatever module makes it
(:func:`op_call` builds it from the call the operation recorder saw).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._torch import tree_flatten, tree_unflatten
from ..conv.norm_routes import at_least_float32, grad_channel_stats, sq_norms
from ..conv.settings import Autocast
from ..layers import LayerRule, RuleSettings, run_rule, using
from ..layers.dispatch import rule_channel_stats
from ..layers.operations import BoundOp, as_parameter, shell_rule
from ..layers.standardise import weight_grads, weight_sq_norms
from .generic import call_grad_sample, chunk_size
from .probes import UNSPLIT, CallAxes


@dataclass(frozen=True)
class CallRecord:
    """What the forward pass saw of one call (it never changes afterwards).

    Attributes:
        module: the layer (for an operation: its shell layer).
        name: its name in the model (for an operation: where it was called, and the
            function).
        rule: its rule if the call is a rule call, else None (generic route).
        in_axes, out_axes: batch axes of the leaves of its arguments and output.
        window: ``(first, last)`` autograd sequence numbers of the call's nodes.
        autocast: the :class:`memconv.conv.settings.Autocast` state of the forward pass.
        output_elements: elements of the call's output (its tensor leaves).
    """

    module: nn.Module
    name: str
    rule: LayerRule | None
    in_axes: tuple
    out_axes: tuple
    window: tuple[int, int]
    autocast: Autocast
    output_elements: int


@dataclass(eq=False)
class WalkState:
    """What the walk (:mod:`memconv.engine.walk`) learns of a call as the backward pass
    goes; the walk writes it, and nothing else does.

    Attributes:
        grads: the gradient of each output leaf as it arrives (None: not yet).
        expected: the output leaves whose gradient will arrive.
        edges: ``(output leaf index, gradient edge)`` of the captured outputs.
        done: whether the route ran (or had nothing to do).
        kept: whether the visitor keeps the call's tensors for later
            (:meth:`LayerCall.keep`), so the walk does not release them.
    """

    grads: list = field(default_factory=list)
    expected: set = field(default_factory=set)
    edges: list = field(default_factory=list)
    done: bool = False
    kept: bool = False


@dataclass(eq=False)
class LayerCall:
    """One forward call of a parametrised module, and what its route needs.

    Attributes:
        record: what the forward pass saw (:class:`CallRecord`; its fields are also
            read as the call's own: ``call.module``, ``call.rule``, ...).
        args, kwargs: the call's arguments (as the call had them: a rule reads their
            values under no_grad, the generic route detaches them; dropped by
            :meth:`release`).
        params: ``{name in module: name in model}`` of the parameters this call's
            route computes (the coverage's assignment, before the backward pass).
        shared: local names of parameters that other calls' routes also compute
            (their per-sample gradients must be summed before taking norms).
        state: the walk's (:class:`WalkState`).
        dropped: whether the call's arguments were not kept, the last walk on the
            probe having given it nothing to compute (a module whose parameters the
            calls inside it compute: its arguments would otherwise live until the
            backward pass begins).
    """

    record: CallRecord
    args: tuple
    kwargs: dict
    params: dict = field(default_factory=dict)
    shared: set = field(default_factory=set)
    state: WalkState = field(default_factory=WalkState)
    named: dict | None = None
    dropped: bool = False

    module = property(lambda self: self.record.module)
    name = property(lambda self: self.record.name)
    rule = property(lambda self: self.record.rule)
    in_axes = property(lambda self: self.record.in_axes)
    out_axes = property(lambda self: self.record.out_axes)
    window = property(lambda self: self.record.window)
    autocast = property(lambda self: self.record.autocast)
    output_elements = property(lambda self: self.record.output_elements)

    @property
    def grads(self) -> list:
        """The output gradients that arrived (:attr:`WalkState.grads`)."""
        return self.state.grads

    def keep(self) -> None:
        """Keep the call's tensors after its visit (the visitor releases them)."""
        self.state.kept = True

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
        if rs.autocast == self.autocast:  # (the same state: no new record)
            return rs
        # (the record's own constructor: ``dataclasses.replace`` costs five times more)
        return type(rs)(**{**rs.__dict__, "autocast": self.autocast})

    def grad_sample(self, rs: RuleSettings) -> dict[str, Tensor]:
        """Per-sample gradients ``{name in module: [N, ...]}`` of :attr:`params`."""
        if self.rule is not None:
            inputs, g = self.rule_inputs()
            with using(self.settings(rs)):
                out = self._run("grad_sample", inputs, g)
            return self._typed({k: v for k, v in out.items() if k in self.params})
        leaves, spec = tree_flatten((self.args, self.kwargs))
        per = sum(p.numel() for k, p in self._named().items() if k in self.params)
        per += sum(_per_first(t) for t in leaves if isinstance(t, Tensor))
        per += sum(_per_first(g) for g in self.grads if g is not None)
        n = self.n()
        itemsize = next((g.element_size() for g in self.grads if g is not None), 4)
        args, kwargs = tree_unflatten(
            [t.detach() if isinstance(t, Tensor) else t for t in leaves], spec
        )
        out = call_grad_sample(
            self.module,
            args,
            kwargs,
            self.in_axes,
            self.grads,
            self.out_axes,
            list(self.params),
            what=self.what,
            chunk=chunk_size(n, 4 * per * itemsize, rs.budget),
        )
        return self._typed(out)

    def sq_norms(self, rs: RuleSettings) -> dict[str, Tensor]:
        """Squared per-sample norms ``{name in module: [N]}`` of :attr:`params`."""
        if self.rule is not None:
            inputs, g = self.rule_inputs()
            with using(self.settings(rs)):
                out = self._run("sq_norms", inputs, g)
            out = {k: v for k, v in out.items() if k in self.params}
        else:
            out = {k: sq_norms(v) for k, v in self.grad_sample(rs).items()}
        return {k: at_least_float32(v) for k, v in out.items()}

    def summed_grad(self, rs: RuleSettings, scale) -> dict[str, Tensor]:
        """Σₙ scaleₙ·(per-sample gradient)ₙ of :attr:`params` (a rule call); ``scale``:
        ``[N]``, or a :class:`Scales` of it."""
        inputs, g = self.rule_inputs()
        g = g * _scales(scale).like(g)
        with using(self.settings(rs)):
            out = self._run("summed_grad", inputs, g)
        return self._typed({k: v for k, v in out.items() if k in self.params})

    def _run(self, method: str, inputs: tuple, g: Tensor, module: nn.Module | None = None):
        """The rule's ``method`` on this call (or on ``module``, a variant of its
        shell), its result checked (:func:`memconv.layers.dispatch.run_rule`): every
        parameter the call's route computes."""
        module = self.module if module is None else module
        expected = self._expected()
        return run_rule(self.rule, method, module, inputs, g, expected=expected, where=self.what)

    def _expected(self):
        return self.params

    def _named(self) -> dict[str, Tensor]:
        """``{name in module: parameter}`` over the module's subtree (duplicates kept)."""
        if self.named is None:
            self.named = dict(self.module.named_parameters(remove_duplicate=False))
        return self.named

    def _typed(self, out: dict) -> dict:
        named = self._named()
        return {k: v if v.dtype == named[k].dtype else v.to(named[k].dtype) for k, v in out.items()}

    def release(self) -> None:
        """Drop the tensors kept for the route."""
        self.args, self.kwargs, self.state.grads = (), {}, []


@dataclass(eq=False)
class BlockCall(LayerCall):
    """One forward call of a reversible block
    (:class:`memconv.reversible.InvertibleModuleWrapper`): its layers ran without
    gradients, so the walk saw none of their calls; the block's backward pass runs them
    again, and a walk of its own records and visits their calls then
    (:meth:`memconv.engine.walk._BackwardWalk.recompute_block`). Coverage treats the
    call as a generic call of the block (:attr:`params`: the block's parameters whose
    uses lie in it); it has no arguments, no output gradients and no route of its own.

    Attributes:
        node: the block's autograd node.
    """

    node: object = None

    @property
    def what(self) -> str:
        return f"reversible block {self.name!r}"


@dataclass(eq=False)
class OpCall(LayerCall):
    """One call of an operation with a rule (:mod:`memconv.layers.operations`) on parameters,
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
            reaches (filled by :func:`claims`).
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
            return self._run(method, inputs, grad)

    def _expected(self):
        return None  # the shell's trainable slots

    def _chain(self, slot: str, grads: Tensor, batched: bool) -> dict[str, Tensor]:
        """``{model name: vjp}`` of the slot's gradients to the parameters under it."""
        tensor, leaves = self.sources[slot]
        return self._vjp(tensor, leaves, grads, batched)

    def _vjp(self, tensor: Tensor, leaves: dict, grads: Tensor, batched: bool, budget=None) -> dict:
        """``{model name: vjp}`` of ``grads`` (``[n, *tensor.shape]`` if ``batched``)
        through ``tensor``'s graph to ``leaves`` ``{id(parameter): parameter}``; a batch
        in chunks whose vjps fit ``budget`` bytes (None: all at once)."""
        names = [self.model_names[pid] for pid in leaves]
        if tensor.grad_fn is None:  # the parameter itself
            return {names[0]: grads}
        params = list(leaves.values())
        if grads.dtype != tensor.dtype:
            grads = grads.to(tensor.dtype)
        with torch.enable_grad():
            if not batched:
                out = torch.autograd.grad(
                    tensor, params, grads, retain_graph=True, allow_unused=True
                )
                return {k: _zero(v, p) for k, v, p in zip(names, out, params)}
            n = grads.shape[0]
            step = _chunk(n, 4 * tensor.numel() * tensor.element_size(), budget)
            parts: list = [[] for _ in params]
            for i in range(0, n, step):
                chunk = grads if step >= n else grads[i : i + step]
                try:
                    out = torch.autograd.grad(
                        tensor,
                        params,
                        chunk,
                        retain_graph=True,
                        allow_unused=True,
                        is_grads_batched=True,
                    )
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
        return {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in zip(names, parts)}

    def _closed(self, norms: bool) -> dict:
        """``{slot: (recipe, ids of the gain's parameters)}`` of the slots whose
        per-sample quantities take the closed form of the standardisation: the
        recipe's tensors untouched, the slot's parameters (as :func:`claims` found
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
            return {k: at_least_float32(v) for k, v in out.items()}
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
        step = _chunk(n, per, rs.budget)
        parts: dict = {}
        for i in range(0, n, step):
            rows = slice(i, i + step)
            part = (inputs, g) if step >= n else (tuple(a[rows] for a in inputs), g[rows])
            with using(self.settings(rs)):
                slots = self._run("grad_sample", *part)
            for slot, (recipe, gain) in closed.items():
                form = forms[slot]
                stats = grad_channel_stats(slots.pop(slot), form.w_hat)
                k = self.model_names[id(recipe.weight)]
                if k in self.params:
                    parts.setdefault(k, []).append(weight_sq_norms(stats, form))
                for k, v in self._gain_grads(slot, gain, stats[2]).items():
                    if k in self.params:
                        parts.setdefault(k, []).append(sq_norms(self._cast(k, v)))
                del stats
            for k, v in self._collect(slots, True).items():
                parts.setdefault(k, []).append(sq_norms(v))
            del slots
        out = {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in parts.items()}
        return {k: at_least_float32(v) for k, v in out.items()}

    def _cast(self, name: str, v: Tensor) -> Tensor:
        """``v`` in the dtype of the parameter ``name``."""
        dtype = self._named()[name].dtype
        return v if v.dtype == dtype else v.to(dtype)

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
                    stats = rule_channel_stats(
                        self.rule, self.module, inputs, g, slot, form.w_hat, where=self.what
                    )
                out[self.model_names[id(recipe.weight)]] = weight_sq_norms(stats, form)
                for k, v in self._gain_grads(slot, gain, stats[2]).items():
                    out[k] = sq_norms(self._cast(k, v))
            if len(closed) < len(self.sources):
                rest = self._run("sq_norms", inputs, g, self.partial)
                for slot, v in rest.items():
                    if slot in self.sources and slot not in closed:
                        out[self.params_of(slot)] = v
        out = {k: v for k, v in out.items() if k in self.params}
        return {k: at_least_float32(v) for k, v in out.items()}

    def params_of(self, slot: str) -> str:
        _, leaves = self.sources[slot]
        return self.model_names[next(iter(leaves))]

    def summed_grad(self, rs: RuleSettings, scale) -> dict[str, Tensor]:
        inputs, g = self.rule_inputs()
        g = g * _scales(scale).like(g)
        return self._collect(self._slot_out(rs, "summed_grad", g), False)

    def release(self) -> None:
        self._named()  # (read from the sources, which go)
        super().release()
        self.sources = {}
        self.maps = {}
        self.partial = None


def _per_first(t: Tensor) -> int:
    """Elements of ``t`` per index of its first axis (``t[:1].numel()``, without an
    operation)."""
    return t.numel() // t.shape[0] if t.dim() and t.shape[0] else t.numel()


def _chunk(n: int, per: int, budget: int | None) -> int:
    """Samples per chunk of ``per`` bytes each within ``budget`` (all without one)."""
    if budget is None:
        return max(n, 1)
    return max(1, min(n, budget // max(1, per)))


class Scales:
    """Per-sample factors ``[N]`` (clip factors), cast and shaped once for each kind of
    tensor they scale: the walk scales every call's output gradient by the same
    factors, and one cast and one reshape per dtype and rank serve them all.

    Args:
        factors: ``[N]``.
    """

    def __init__(self, factors: Tensor):
        self.factors = factors
        self._made: dict = {}

    def like(self, t: Tensor) -> Tensor:
        """The factors in ``t``'s dtype, shaped ``[N, 1, ...]`` to broadcast over ``t``."""
        key = (t.dtype, t.dim())
        made = self._made.get(key)
        if made is None:
            made = self.cast(t.dtype)
            if t.dim() > 1:
                made = made.reshape((-1,) + (1,) * (t.dim() - 1))
            self._made[key] = made
        return made

    def cast(self, dtype) -> Tensor:
        """The factors ``[N]`` in ``dtype``."""
        made = self._made.get(dtype)
        if made is None:
            made = self.factors if self.factors.dtype == dtype else self.factors.to(dtype)
            self._made[dtype] = made
        return made


def _scales(scale) -> Scales:
    return scale if isinstance(scale, Scales) else Scales(scale)


def _zero(v, p: Tensor) -> Tensor:
    return torch.zeros_like(p) if v is None else v


def op_call(bound: BoundOp, out: Tensor, axes: CallAxes, name: str, window, recorder, names):
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
        params[slot] = as_parameter(t, trainable)
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
        elif t.grad_fn is not None:  # a function of parameters (checked by claims)
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
        frozen = {k: params[k].detach() for k in maps}
        partial = bound.shell({**params, **frozen})
    rule = shell_rule(shell)
    if rule is None or not rule.describes(shell, bound.data, out):
        return None
    if not (ax_in == 0 and ax_out == 0):
        if not rule.movable_batch_axis or any(a is None or a == UNSPLIT for a in (ax_in, ax_out)):
            return None
    record = CallRecord(
        module=shell,
        name=name,
        rule=rule,
        in_axes=(ax_in,),
        out_axes=(ax_out,),
        window=window,
        autocast=Autocast.current(out.device.type),
        output_elements=out.numel(),
    )
    call = OpCall(
        record=record,
        args=(bound.data,),  # (a rule reads its values only, under no_grad)
        kwargs={},
        state=WalkState(grads=[None]),
        sources=sources,
        direct=direct,
        roots=roots,
        model_names=names,
        maps=maps,
        partial=partial,
    )
    return call
