"""Per-sample gradient norms without per-sample gradients, gathered call by call.

:func:`per_sample_norms` runs one forward and one backward pass per micro-batch
(:func:`memconv.engine.passes.walk_micro_batches`) in which each parametrised layer
turns its input and output gradient into the squared norms of its per-sample gradients
(its rule's ``sq_norms``: ghost norms or instantiated chunks for convolutions, per
layer), so that no layer's per-sample gradients need to exist at once. The
:class:`NormGatherer` that collects them is also the first step of
:func:`memconv.clip_and_accumulate`, which with book-keeping has it keep what the
clipped sum needs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._checks import AVAILABLE
from .._torch import not_traced, storage_key
from ..conv.contract import contract
from ..conv.norm_routes import at_least_float32, float32_or_wider, sq_norms
from ..conv.settings import activate
from ..engine.calls import LayerCall, Scales
from ..engine.passes import sample_by_sample, walk_micro_batches
from ..engine.prepared import CallPlan, Prepared, kept_for
from ..engine.request import Batch
from ..layers import RuleSettings
from .arguments import check_call
from .groups import ALL, Grouping, OnePass, ensure_finite, finite_flag, kept_grouping, masked


class NormGatherer:
    """Squared per-sample norms per parameter, gathered call by call; with
    book-keeping, also what the clipped sum needs of each call.

    A parameter that several calls' routes compute (shared between layers, or a layer
    called twice) has its per-sample gradients summed over them first, since the norm
    of a sum is not the sum of norms. With book-keeping a rule call keeps its
    per-sample gradients where they are smaller than its input and output gradient
    (:meth:`prepare`), else the latter (and its norms come from the rule's lean route);
    a generic call keeps its per-sample gradients.
    """

    def __init__(self, n: int, rs: RuleSettings, keep: bool, onepass: OnePass | None = None):
        self.n, self.rs, self.keep, self.onepass = n, rs, keep, onepass
        self.sq: dict[str, Tensor] = {}
        self.grads: dict[str, Tensor] = {}  # per-sample gradients kept (or shared)
        self.io: list[LayerCall] = []  # calls kept as inputs and output gradient
        self.keep_grads: set = set()  # rule calls that keep per-sample gradients

    def prepare(self, calls: list[LayerCall]) -> None:
        """Book-keeping: decide, before the backward pass, which rule calls keep their
        per-sample gradients rather than their input and output gradient — whichever
        is smaller, an input that several calls read (a residual block's convolution
        and its projection shortcut) counted once. Calls clipped in the pass
        (:class:`memconv.tasks.groups.OnePass`) keep nothing."""
        if self.onepass is not None:
            self.onepass.prepare(calls)
            calls = [c for c in calls if c not in self.onepass.calls]
        if not self.keep:
            return
        readers: dict = {}  # one input tensor (its storage view) -> the calls reading it
        for call in calls:
            if call.rule is None or call.shared:
                continue
            named = call._named()
            grads = self.n * sum(named[k].numel() for k in call.params)
            if len(call.args) != 1:  # each call on its own
                if grads < sum(a.numel() for a in call.args) + call.output_elements:
                    self.keep_grads.add(call)
                continue
            x = call.args[0]
            key = storage_key(x)
            readers.setdefault(key, []).append((call, grads, x.numel()))
        for group in readers.values():
            # per-sample gradients for all, or the input once and, for each call, the
            # smaller of its output gradient and its per-sample gradients (the input
            # only pays off if some call prefers its output gradient)
            size = group[0][2]
            all_grads = sum(grads for _, grads, _ in group)
            with_io = size + sum(min(c.output_elements, grads) for c, grads, _ in group)
            self.keep_grads.update(
                c for c, grads, _ in group if all_grads <= with_io or grads <= c.output_elements
            )

    def visit(self, call: LayerCall):
        """Take the call's norms; per-sample gradients to keep are returned as work
        for after the call's backward node (see :func:`memconv.engine.walk.backward_walk`)."""
        if self.onepass is not None and call in self.onepass.calls:
            self.sq.update(self.onepass.visit(call))
            return None
        instantiate = bool(call.shared) or call.rule is None or call in self.keep_grads
        if instantiate:  # the route's temporaries within the layer's budget

            def work():
                grads = call.grad_sample(self.rs)
                for k, v in grads.items():
                    self.add_grads(call.params[k], v, keep=k in call.shared or self.keep)

            if self.keep or call.shared:
                return work
            work()
            return None
        for k, v in call.sq_norms(self.rs).items():
            self.sq[call.params[k]] = v
        if self.keep:
            call.keep()
            self.io.append(call)
        return None

    def from_model_route(self, name: str, grads: Tensor) -> None:
        """Per-sample gradients of a parameter the walk left to the model route."""
        self.add_grads(name, grads, keep=self.keep)

    def add_grads(self, name: str, grads: Tensor, keep: bool) -> None:
        """Per-sample gradients of a parameter: kept (summed over routes) or squared."""
        if keep:
            self.grads[name] = grads if name not in self.grads else self.grads[name] + grads
        else:
            self.sq[name] = squared(grads)

    def result(self, params: dict) -> dict[str, Tensor]:
        out = {}
        for name, p in params.items():
            if name in self.grads:
                out[name] = squared(self.grads[name])
            elif name in self.sq:
                out[name] = self.sq[name]
            else:  # does not influence the loss
                out[name] = p.new_zeros(self.n, dtype=float32_or_wider(p.dtype))
        return out

    def add_clipped_sums(self, c: dict, total: dict) -> None:
        """Add Σₙ cₙ·gₙ per parameter into ``total`` (``c``: the clip factors ``[n]``
        of each parameter's group, by model name; the same tensor for the parameters
        of one group): kept per-sample gradients weighted, and one summed VJP per call
        and factor kept as inputs and output gradient (each call's share added, and
        released, as it goes). Each group's factors are cast and shaped once
        (:class:`memconv.engine.calls.Scales`)."""
        scales = {id(v): Scales(v) for v in c.values()}
        for full in list(self.grads):
            grads = self.grads.pop(full)
            factor = scales[id(c[full])].cast(grads.dtype)
            add_into(total, full, contract("n,n...->...", factor, grads))
        while self.io:
            call = self.io.pop(0)
            factors = {id(c[full]): c[full] for full in call.params.values()}
            for key, factor in factors.items():  # one VJP per group of the call
                for k, v in call.summed_grad(self.rs, scales[key]).items():
                    if c[call.params[k]] is factor:
                        add_into(total, call.params[k], v)
            call.release()


def add_into(total: dict, name: str, value: Tensor) -> None:
    total[name] = value if name not in total else total[name].add_(value)


def squared(grads: Tensor) -> Tensor:
    return at_least_float32(sq_norms(grads))


@not_traced
def per_sample_norms(
    model: nn.Module,
    loss_fn,
    inputs: Tensor,
    targets: Tensor,
    *,
    strategy: str | bool | None = None,
    memory_budget: int | str | None = AVAILABLE,
    per_parameter: bool = False,
    norm_route: str | None = None,
    groups: str | dict = "all",
    sample_mask: Tensor | None = None,
):
    """L2 norms of each sample's gradient, without holding per-sample gradients.

    The per-sample loss is the one of :func:`memconv.per_sample_grads`:
    ``loss_fn(model(inputs[n:n+1]), targets[n:n+1])``.

    Args:
        model: as :func:`memconv.per_sample_grads` (a ``DistributedDataParallel``
            wrapper is unwrapped: the norms are of the local samples).
        loss_fn: returns a scalar for one sample.
        inputs: ``[N, ...]``.
        targets: ``[N, ...]``.
        strategy: weight-VJP strategy of the instantiating route (name or bool);
            ``None``: the open :class:`memconv.save_memory` block's, or ``"auto"``.
        memory_budget: bytes the whole call's peak memory increase may reach: the
            batch runs in micro-batches and each layer's norm computation within a
            budget, as :func:`memconv.plan` plans them; ``"available"`` (the default):
            lean, the routes chosen to keep the call's predicted peak within the
            non-private step's (:func:`memconv.engine.planning.lean_target`), within
            what the process can still use (:func:`memconv.engine.resources.default_budget`);
            None: one pass, and 32 MiB per layer's norm temporaries. A budget given
            in bytes (or None) trades memory for speed: each layer may then use as
            much as the pass itself holds.
        per_parameter: return ``{name: [N]}`` (each parameter's own norms) instead of
            the norm over all trainable parameters.
        norm_route: ``"ghost"`` or ``"instantiate"`` for every convolution and Linear
            layer, or None to choose per layer by the cost models.
        groups: ``"all"`` (the norm over all trainable parameters), ``"layer"`` (over
            the parameters each module owns directly, keyed by the module's name, ``""``
            for the model's own), ``"parameter"``, or a mapping ``{parameter name: group
            name}`` covering every trainable parameter: the norms of each group, as
            :func:`clip_and_accumulate` clips them (:mod:`memconv.tasks.groups`).
        sample_mask: None, or a ``torch.bool`` tensor ``[N]`` on the inputs' device:
            False marks a padded sample of a batch padded to a fixed size (masked
            DP-SGD, Beltran et al. 2024), whose input and target are replaced by zeros
            (``torch.where``) and whose norm is 0, NaN or inf inputs included.

    Returns:
        ``[N]`` norms (float32 or wider); ``{name: [N]}`` with ``per_parameter``;
        ``{group: [N]}`` with ``groups`` other than ``"all"``. A padded sample's
        entries are 0.

    Raises:
        TypeError, ValueError: as :func:`memconv.per_sample_grads`; an unknown
            ``norm_route``; a non-positive or non-integer ``memory_budget``, or one below
            the smallest feasible budget (named); bad ``groups`` (see
            :func:`memconv.tasks.groups.resolve_groups`), or ``groups`` with
            ``per_parameter``; a ``sample_mask`` not a bool tensor (TypeError) or not
            ``[N]`` on the inputs' device (ValueError). Before any work.
        RuntimeError: a real sample's norm not finite.
    """
    given = Batch(model, loss_fn, inputs, targets)
    options = dict(strategy=strategy, memory_budget=memory_budget, norm_route=norm_route)
    with kept_for(model) as prepared:
        return norms_with(
            prepared,
            given,
            per_parameter=per_parameter,
            groups=groups,
            sample_mask=sample_mask,
            **options,
        )


def norms_with(prepared: Prepared, given: Batch, *, per_parameter=False, groups="all", **options):
    """:func:`per_sample_norms` of ``given``, reusing what ``prepared`` kept from the last
    call."""
    caller = "memconv.per_sample_norms"
    checked = check_call(prepared, given, task="norms", caller=caller, unwrap=True, **options)
    request, batch, mask = checked.request, checked.batch, checked.sample_mask
    grouping = kept_grouping(prepared, batch.model, groups)
    if per_parameter and grouping.kind != "all":
        raise ValueError("per_parameter=True is groups='parameter'; pass one of them")
    params = prepared.trainable()
    if request.n == 0:
        return _empty(grouping, params, per_parameter, given.inputs)
    if prepared.streams:  # one sample at a time, by autograd (its layers are hidden)
        with activate(request.settings):
            parts = [
                ({name: squared(g.unsqueeze(0)) for name, g in grads.items()}, slice(i, i + 1))
                for i, grads in sample_by_sample(batch, params)
            ]
        out, checked, flag = _finished(parts, grouping, params, per_parameter, mask)
    else:

        def walk(cp, b, *more):  # ``more``: the mask, where there is one
            parts = [(part.visitor.result(cp.params), part.rows) for part in gather_norms(b, cp)]
            return _finished(parts, grouping, params, per_parameter, *more)

        options = (grouping.kind, tuple(grouping.of.items()), per_parameter)
        extra = () if mask is None else (mask,)
        out, checked, flag = prepared.run_walk(batch, request, walk, options=options, extra=extra)
    if flag is not None and not bool(flag):  # the call's one host synchronisation
        ensure_finite(checked, request.caller)  # raises, naming the samples
    return out


def _finished(parts: list, grouping: Grouping, params: dict, per_parameter: bool, mask=None):
    """``(result, the norms checked, their finiteness flag)`` from the micro-batches'
    ``(squared norms {name: [m]}, rows)``: the result as :func:`per_sample_norms` returns
    it, a padded sample's entries 0 (``mask``: the bool mask ``[N]`` of the real samples,
    or None); the flag a one-element tensor (:func:`memconv.tasks.groups.finite_flag`,
    computed in the step: in a compiled step's graph)."""
    if grouping.kind != "all":
        out = {
            g: masked(_cat([grouping.norm(g, sq, _len(rows)) for sq, rows in parts]), mask)
            for g in grouping.members
        }
        checked = list(out.values())
        return out, checked, finite_flag(checked)
    total = masked(_cat([total_sq(sq, _len(rows)) for sq, rows in parts]).sqrt(), mask)
    out = total
    if per_parameter:
        out = {name: masked(_cat([sq[name] for sq, _ in parts]).sqrt(), mask) for name in params}
    return out, [total], finite_flag([total])


def _cat(parts: list[Tensor]) -> Tensor:
    """The micro-batches' parts joined (the one part as it is)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _len(rows: slice) -> int:
    return rows.stop - rows.start


def _empty(grouping: Grouping, params: dict, per_parameter: bool, inputs: Tensor):
    """The norms of an empty batch, as :func:`per_sample_norms` returns them."""
    if grouping.kind != "all":
        return {g: inputs.new_zeros(0, dtype=torch.float32) for g in grouping.members}
    if per_parameter:
        return {
            name: p.new_zeros(0, dtype=torch.promote_types(p.dtype, torch.float32))
            for name, p in params.items()
        }
    return inputs.new_zeros(0, dtype=torch.float32)


def gather_norms(batch: Batch, cp: CallPlan, onepass=None):
    """The walks of the micro-batches of the plan ``cp``, one at a time
    (:func:`memconv.engine.passes.walk_micro_batches`), each gathering norms in a
    :class:`NormGatherer` (:func:`gatherer`)."""
    route = cp.plan.clip_route
    return walk_micro_batches(
        batch,
        cp,
        visitor=lambda rows: gatherer(cp, _len(rows), onepass and (lambda: onepass(rows))),
        keep_graph=route == "two-pass",
    )


def gatherer(cp: CallPlan, n: int, onepass=None) -> NormGatherer:
    """The :class:`NormGatherer` of a walk of ``n`` samples under the plan ``cp``: for
    book-keeping it keeps what the clipped sum needs; with ``onepass``, which makes
    the walk's :class:`memconv.tasks.groups.OnePass`, the calls it clips add their
    clipped sums during the backward pass."""
    keep = cp.plan.clip_route == "book-keeping"
    return NormGatherer(n, cp.rule_settings, keep=keep, onepass=onepass and onepass())


def group_norms(grouping: Grouping, sq: dict, n: int) -> dict[str, Tensor]:
    """``{group: norms [n]}`` (without a graph; not checked: see
    :func:`memconv.tasks.groups.ensure_finite`) from squared norms per parameter."""
    if grouping.kind == "all":
        norms = {ALL: total_sq(sq, n).sqrt()}
    else:
        norms = grouping.norms(sq, n)
    return {g: v.detach() if v.requires_grad else v for g, v in norms.items()}


def joined(grouping: Grouping, parts: list[dict]):
    """The norms of the micro-batches joined: ``[N]`` for ``"all"``, else by group."""
    out = {g: _cat([p[g] for p in parts]) for g in parts[0]}
    if grouping.kind != "all":
        return out
    return out[ALL]


def total_sq(sq: dict, n: int) -> Tensor:
    """Squared norms over all parameters ``[n]`` (all of them reduced at once)."""
    if not sq:
        return torch.zeros(n)
    if len(sq) == 1:
        return next(iter(sq.values()))
    return torch.stack(list(sq.values())).sum(0)
