"""Per-sample gradient norms and clipped sums (DP-SGD) without per-sample gradients.

:func:`per_sample_norms` and :func:`clip_and_accumulate` run one forward and one
backward pass (:func:`memconv.engine.walk.backward_walk`) in which each parametrised
layer turns its input and output gradient into the squared norms of its per-sample
gradients (:mod:`memconv.conv.norm_routes`: ghost norms or instantiated chunks, per layer), so
that no layer's per-sample gradients need to exist at once. The clipped sum
Σₙ min(1, C/‖gₙ‖)·gₙ then comes by one of two exact routes:

- ``"book-keeping"`` (Bu et al., ICML 2023): the backward pass keeps each layer's
  input and output gradient (or its per-sample gradients, where those are smaller);
  once the norms are known, one summed weight VJP per layer with the output
  gradient scaled by the clip factors. One backward pass; memory: what it keeps;
- ``"two-pass"`` (as Opacus' ghost clipping): the backward pass computes the norms
  only, keeping the graph; a second backward pass of Σₙ cₙ·ℓₙ then adds the clipped
  sum. Memory: the graph of one pass; time: two backward passes.

Noise and privacy accounting stay with the DP optimizer (Opacus').
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn

from .._torch import storage_key
from ..conv.norm_routes import DEFAULT_NORM_BUDGET, check_route, sq_norms
from ..conv.settings import activate, use_block_settings
from ..engine.calls import LayerCall
from ..engine.passes import sample_by_sample, walk_micro_batches
from ..engine.planning import CLIP_ROUTES, check_budget, check_clip_route  # noqa: F401 (CLIP_ROUTES: re-exported)
from ..engine.prepared import Prepared, check_batch
from ..engine.resources import AVAILABLE
from ..layers import RuleSettings
from .groups import (
    ALL,
    Grouping,
    OnePass,
    check_finite,
    check_threshold,
    clip_factors,
    resolve_groups,
)


def _unwrap(model):
    """The module a ``DistributedDataParallel`` wraps (the walk runs on it).

    Raises:
        ValueError: for Opacus' ``DPDDP``, whose ranks memconv would not sum.
    """
    from torch.nn.parallel import DistributedDataParallel

    if type(model).__name__ in ("DPDDP", "DifferentiallyPrivateDistributedDataParallel"):
        raise ValueError(
            "model is Opacus' DPDDP: memconv sums the ranks' clipped sums itself; wrap the "
            "model in torch.nn.parallel.DistributedDataParallel instead"
        )
    return (model.module, model) if isinstance(model, DistributedDataParallel) else (model, None)


def _check_common(prepared, model, inputs, targets, memory_budget, norm_route, settings):
    model = prepared.check_model(model, settings)
    n = check_batch(inputs, targets)
    check_budget(memory_budget)
    check_route(norm_route)
    return model, n


class _Norms:
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
                budget = self.rs.budget or DEFAULT_NORM_BUDGET
                grads = call.grad_sample(replace(self.rs, budget=budget))
                for k, v in grads.items():
                    self.add_grads(call.params[k], v, keep=k in call.shared or self.keep)

            if self.keep or call.shared:
                return work
            work()
            return None
        for k, v in call.sq_norms(self.rs).items():
            self.sq[call.params[k]] = v
        if self.keep:
            call.kept = True
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
            self.sq[name] = _squared(grads)

    def result(self, params: dict) -> dict[str, Tensor]:
        out = {}
        for name, p in params.items():
            if name in self.grads:
                out[name] = _squared(self.grads[name])
            elif name in self.sq:
                out[name] = self.sq[name]
            else:  # does not influence the loss
                out[name] = p.new_zeros(self.n, dtype=torch.promote_types(p.dtype, torch.float32))
        return out

    def add_clipped_sums(self, c: dict, total: dict) -> None:
        """Add Σₙ cₙ·gₙ per parameter into ``total`` (``c``: the clip factors ``[n]``
        of each parameter's group, by model name): kept per-sample gradients weighted,
        and one summed VJP per call and factor kept as inputs and output gradient
        (each call's share added, and released, as it goes)."""
        for full in list(self.grads):
            grads = self.grads.pop(full)
            _add(total, full, torch.einsum("n,n...->...", c[full].to(grads.dtype), grads))
        while self.io:
            call = self.io.pop(0)
            factors = {id(c[full]): c[full] for full in call.params.values()}
            for factor in factors.values():  # one VJP per group of the call
                for k, v in call.summed_grad(self.rs, factor).items():
                    if c[call.params[k]] is factor:
                        _add(total, call.params[k], v)
            call.release()


def _add(total: dict, name: str, value: Tensor) -> None:
    total[name] = value if name not in total else total[name].add_(value)


def _squared(grads: Tensor) -> Tensor:
    return sq_norms(grads).to(torch.promote_types(grads.dtype, torch.float32))


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
            what the process can still use (:func:`memconv.engine.resources.default_budget`);
            None: one pass, and 32 MiB per layer's norm temporaries.
        per_parameter: return ``{name: [N]}`` (each parameter's own norms) instead of
            the norm over all trainable parameters.
        norm_route: ``"ghost"`` or ``"instantiate"`` for every convolution and Linear
            layer, or None to choose per layer by the cost models.
        groups: ``"all"`` (the norm over all trainable parameters), ``"layer"`` (over
            the parameters each module owns directly, keyed by the module's name, ``""``
            for the model's own), ``"parameter"``, or a mapping ``{parameter name: group
            name}`` covering every trainable parameter: the norms of each group, as
            :func:`clip_and_accumulate` clips them (:mod:`memconv.tasks.groups`).

    Returns:
        ``[N]`` norms (float32 or wider); ``{name: [N]}`` with ``per_parameter``;
        ``{group: [N]}`` with ``groups`` other than ``"all"``.

    Raises:
        TypeError, ValueError: as :func:`memconv.per_sample_grads`; an unknown
            ``norm_route``; a non-positive or non-integer ``memory_budget``, or one below
            the smallest feasible budget (named); bad ``groups`` (see
            :func:`memconv.tasks.groups.resolve_groups`), or ``groups`` with
            ``per_parameter``. Before any work.
    """
    return norms_with(
        Prepared(), model, loss_fn, inputs, targets, strategy=strategy,
        memory_budget=memory_budget, per_parameter=per_parameter, norm_route=norm_route,
        groups=groups,
    )  # fmt: skip


def norms_with(
    prepared: Prepared, model, loss_fn, inputs, targets, *, strategy, memory_budget,
    per_parameter, norm_route, groups="all",
):  # fmt: skip
    """:func:`per_sample_norms`, reusing what ``prepared`` kept from the last call."""
    settings = use_block_settings(strategy)
    model, _ = _unwrap(model)
    model, n = _check_common(prepared, model, inputs, targets, memory_budget, norm_route, settings)
    grouping = resolve_groups(model, groups)
    if per_parameter and grouping.kind != "all":
        raise ValueError("per_parameter=True is groups='parameter'; pass one of them")
    params = prepared.trainable()
    if n == 0:
        if grouping.kind != "all":
            return {g: inputs.new_zeros(0, dtype=torch.float32) for g in grouping.members}
        empty = {
            name: p.new_zeros(0, dtype=torch.promote_types(p.dtype, torch.float32))
            for name, p in params.items()
        }
        return empty if per_parameter else inputs.new_zeros(0, dtype=torch.float32)
    if prepared.streams:  # one sample at a time, by autograd (its layers are hidden)
        with activate(settings):
            sq = [
                {name: _squared(g.unsqueeze(0)) for name, g in grads.items()}
                for _, grads in sample_by_sample(model, loss_fn, inputs, targets, params)
            ]
        parts = [(s, slice(i, i + 1)) for i, s in enumerate(sq)]
    else:

        def run():
            cp = prepared.call_plan(
                model, loss_fn, inputs, "norms", settings, memory_budget, None, norm_route
            )
            rs = RuleSettings(settings=settings, norm_route=norm_route, budget=cp.plan.layer_budget)
            walks = _walks(
                model, loss_fn, inputs, targets, rs, cp, None, "memconv.per_sample_norms"
            )
            return [(norms.result(cp.params), rows) for rows, norms, _ in walks]

        parts = prepared.run(run)
    if grouping.kind != "all":
        out = {
            g: torch.cat([grouping.norm(g, part, rows.stop - rows.start) for part, rows in parts])
            for g in grouping.members
        }
        for norms in out.values():
            check_finite(norms, "memconv.per_sample_norms")
        return out
    total = torch.cat([_total(part, rows.stop - rows.start) for part, rows in parts]).sqrt()
    check_finite(total, "memconv.per_sample_norms")
    if per_parameter:
        return {name: torch.cat([part[name] for part, _ in parts]).sqrt() for name in params}
    return total


def _total(sq: dict, n: int) -> Tensor:
    """Squared norms over all parameters ``[n]``."""
    return torch.stack(list(sq.values())).sum(0) if sq else torch.zeros(n)


def _walks(model, loss_fn, inputs, targets, rs, cp, clip_route, caller, onepass=None):
    """The walks of the micro-batches of the plan ``cp`` (:class:`memconv.engine.prepared.CallPlan`),
    one at a time (:func:`memconv.engine.passes.walk_micro_batches`), each gathering norms in a
    :class:`_Norms` (and, for book-keeping, what the clipped sum needs; with
    ``onepass``, which makes each walk's :class:`memconv.tasks.groups.OnePass`, the clipped
    sums of the calls it clips, added into its total)."""
    keep = clip_route == "book-keeping"

    def gatherer(rows: slice) -> _Norms:
        n = rows.stop - rows.start
        return _Norms(n, rs, keep=keep, onepass=onepass and onepass())

    keep_graph = clip_route == "two-pass"
    return walk_micro_batches(
        model, loss_fn, inputs, targets, cp, rs, gatherer, caller=caller, keep_graph=keep_graph
    )


def clip_and_accumulate(
    model: nn.Module,
    loss_fn,
    inputs: Tensor,
    targets: Tensor,
    *,
    max_norm: float | dict,
    strategy: str | bool | None = None,
    memory_budget: int | str | None = AVAILABLE,
    norm_route: str | None = None,
    clip_route: str | None = None,
    groups: str | dict = "all",
) -> Tensor | dict[str, Tensor]:
    """Add Σₙ min(1, max_norm/‖gₙ‖)·gₙ to every trainable parameter's ``.grad``.

    ``gₙ`` is the gradient of sample n's loss (as :func:`memconv.per_sample_grads`
    defines it) over all trainable parameters; the sum is added to ``.grad`` as
    ``backward`` adds (``.grad`` is created where it is None). No per-sample gradients
    of more than one layer exist at once. DP-SGD's noise, the division by the
    expected batch size and the privacy accounting stay with the optimizer.

    With ``groups``, each group g of parameters is clipped on its own to its
    threshold C_g: the sum added is Σ_g Σₙ min(1, C_g/‖gₙ,g‖)·gₙ,g (McMahan et al.,
    ICLR 2018; He et al., ICLR 2023), and one sample moves it by at most
    ``√(Σ_g C_g²)`` (:meth:`memconv.tasks.groups.Grouping.sensitivity`): the noise must
    scale with that, as Opacus' ``DPPerLayerOptimizer`` takes the L2 norm of its
    per-parameter thresholds. Where every parameter of a group lies in one layer call
    (``"layer"``, ``"parameter"``, no shared parameter), the call's clipped sum is
    added during the backward pass, as soon as its norms are known — one weight VJP
    with the output gradient scaled by the factors, nothing kept for later, no second
    pass (:class:`memconv.tasks.groups.OnePass`); the other groups take ``clip_route``
    (``"two-pass"``: one more backward pass per such group).

    With a ``DistributedDataParallel`` model, each rank clips its own samples and
    every rank gets the clipped **sum** over the whole (global) batch: the ranks'
    sums are all-reduced (summed, not averaged as DDP's gradients are).

    Args:
        model: as :func:`memconv.per_sample_grads`.
        loss_fn: returns a scalar for one sample.
        inputs: ``[N, ...]``.
        targets: ``[N, ...]``.
        max_norm: the clipping threshold C (positive, finite) of every group, or a
            mapping ``{group: C_g}`` naming every group.
        strategy: weight-VJP strategy (name or bool); None: the open block's or
            ``"auto"``.
        memory_budget: bytes the whole call's peak memory increase may reach (see
            :func:`per_sample_norms`); the plan also picks the clipping route when
            ``clip_route`` is None.
        norm_route: ``"ghost"``, ``"instantiate"`` or None (per layer).
        clip_route: ``"book-keeping"``, ``"two-pass"`` or None (book-keeping, or the
            one that fits the budget with the larger micro-batch).
        groups: ``"all"`` (one group: the default), ``"layer"`` (the parameters each
            module owns directly, named by the module, ``""`` for the model's own),
            ``"parameter"``, or a mapping ``{parameter name: group name}`` covering
            every trainable parameter.

    Returns:
        The per-sample norms ``[N]`` before clipping (of the local samples); with
        ``groups`` other than ``"all"``, ``{group: [N]}``.

    Raises:
        TypeError, ValueError: as :func:`per_sample_norms`; a threshold not a positive
            finite number; bad ``groups`` or a group without a threshold (see
            :func:`memconv.tasks.groups.resolve_groups`); an unknown ``clip_route``. Before
            any work, every ``.grad`` unchanged.
    """
    return clip_with(
        Prepared(), model, loss_fn, inputs, targets, max_norm=max_norm, strategy=strategy,
        memory_budget=memory_budget, norm_route=norm_route, clip_route=clip_route,
        groups=groups,
    )  # fmt: skip


def clip_with(
    prepared: Prepared, model, loss_fn, inputs, targets, *, max_norm, strategy, memory_budget,
    norm_route, clip_route, groups="all",
) -> Tensor | dict[str, Tensor]:  # fmt: skip
    """:func:`clip_and_accumulate`, reusing what ``prepared`` kept from the last call."""
    settings = use_block_settings(strategy)
    model, ddp = _unwrap(model)
    check_max_norm(max_norm)
    check_clip_route(clip_route)
    model, n = _check_common(prepared, model, inputs, targets, memory_budget, norm_route, settings)
    grouping = resolve_groups(model, groups, max_norm)
    params = prepared.trainable()
    if n == 0:
        _accumulate(params, {}, ddp)
        zero = inputs.new_zeros(0, dtype=torch.float32)
        return _returned(grouping, [{g: zero for g in grouping.members}])
    if prepared.streams:  # one sample at a time: its norm from its gradient, gathered
        return _clip_sample_by_sample(
            model, loss_fn, inputs, targets, params, settings, grouping, ddp
        )

    def run():
        cp = prepared.call_plan(
            model, loss_fn, inputs, "clip", settings, memory_budget, clip_route, norm_route
        )
        route = cp.plan.clip_route
        total: dict[str, Tensor] = {}
        all_norms = []
        rs = RuleSettings(settings=settings, norm_route=norm_route, budget=cp.plan.layer_budget)
        caller = "memconv.clip_and_accumulate"
        onepass = None
        if grouping.kind != "all":  # groups within one layer call: clipped in the pass

            def onepass():
                return OnePass(grouping, rs, total, caller)

        walks = _walks(model, loss_fn, inputs, targets, rs, cp, route, caller, onepass)
        for _, gathered, losses in walks:
            norms = _group_norms(grouping, gathered.result(cp.params), len(losses))
            done = gathered.onepass.groups if gathered.onepass is not None else set()
            factors = {
                g: clip_factors(v, grouping.max_norm[g]) for g, v in norms.items() if g not in done
            }
            # clip factors are per sample: the micro-batches' clipped sums add up
            if route == "book-keeping":
                c = {k: factors[g] for k, g in grouping.of.items() if g in factors}
                gathered.add_clipped_sums(c, total)
            else:
                del gathered
                for i, (g, c) in enumerate(factors.items()):
                    group = {k: params[k] for k in grouping.members[g]}
                    retain = i + 1 < len(factors)
                    sums = _second_pass(losses, c, group, retain)
                    check_second_pass(sums, caller)
                    for name, v in sums.items():
                        _add(total, name, v)
            del losses
            all_norms.append(norms)
        return total, _returned(grouping, all_norms)

    total, norms = prepared.run(run)
    _accumulate(params, total, ddp)
    return norms


def _group_norms(grouping: Grouping, sq: dict, n: int) -> dict[str, Tensor]:
    """``{group: norms [n]}`` (detached, checked finite) from squared norms per
    parameter."""
    if grouping.kind == "all":
        norms = {ALL: _total(sq, n).sqrt().detach()}
    else:
        norms = {g: v.detach() for g, v in grouping.norms(sq, n).items()}
    for v in norms.values():
        check_finite(v, "memconv.clip_and_accumulate")
    return norms


def _returned(grouping: Grouping, parts: list[dict]):
    """The norms of the micro-batches joined: ``[N]`` for ``"all"``, else by group."""
    out = {g: torch.cat([p[g] for p in parts]) for g in parts[0]}
    if grouping.kind != "all":
        return out
    return out[ALL]


def check_max_norm(max_norm) -> None:
    """Raise unless ``max_norm`` is a positive finite number or a mapping (whose
    thresholds :func:`memconv.tasks.groups.resolve_groups` checks against the groups).

    Raises:
        TypeError: not a real number or a mapping.
        ValueError: not positive and finite.
    """
    if not isinstance(max_norm, Mapping):
        check_threshold(max_norm, "max_norm")


def _clip_sample_by_sample(model, loss_fn, inputs, targets, params, settings, grouping, ddp):
    """Clip and sum for models that stream: each sample's gradient (gathered tile by
    tile), its norms, its clipped share added to a running total."""
    total: dict[str, Tensor] = {}
    norms = []
    with activate(settings):
        for _, grads in sample_by_sample(model, loss_fn, inputs, targets, params):
            norm = _group_norms(
                grouping, {k: _squared(g.unsqueeze(0)) for k, g in grads.items()}, 1
            )
            c = {g: clip_factors(v, grouping.max_norm[g]) for g, v in norm.items()}
            for name, g in grads.items():
                _add(total, name, g * c[grouping.of[name]].to(g.dtype))
            norms.append(norm)
    _accumulate(params, total, ddp)
    return _returned(grouping, norms)


def check_second_pass(sums: dict[str, Tensor], caller: str) -> None:
    """Raise if the second pass gave a non-finite clipped sum (the norms being finite,
    torch's own backward of a layer is not finite there).

    Raises:
        RuntimeError: naming the parameters and the remedy.
    """
    bad = [name for name, v in sums.items() if not torch.isfinite(v).all()]
    if bad:
        raise RuntimeError(
            f"{caller}: the two-pass route's second backward pass (torch's autograd) gave a "
            f"non-finite clipped sum for {', '.join(map(repr, bad))} although every "
            "per-sample norm is finite: torch's backward of that layer is not finite on "
            "this input (GroupNorm over zero positions gives NaN for its weight); nothing "
            'was added to .grad. Use clip_route="book-keeping", whose layer rules are exact '
            "there."
        )


def _second_pass(losses: Tensor, c: Tensor, params: dict, retain: bool = False) -> dict:
    """Σₙ cₙ·∇ℓₙ of ``params`` by a second backward pass of the kept graph."""
    names = list(params)
    grads = torch.autograd.grad(
        (losses * c.to(losses.dtype)).sum(),
        [params[k] for k in names],
        allow_unused=True,
        retain_graph=retain,
    )
    return {k: g for k, g in zip(names, grads) if g is not None}


def _accumulate(params: dict, sums: dict, ddp) -> None:
    """Add the clipped sums to ``.grad`` (after summing them over the ranks)."""
    if ddp is not None:
        import torch.distributed as dist

        for name, p in params.items():
            s = sums.get(name)
            if s is None:
                s = torch.zeros_like(p)
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=ddp.process_group)
            sums[name] = s
    for name, p in params.items():
        s = sums.get(name)
        if s is None:
            continue
        # a fresh tensor of the parameter's shape: it becomes .grad as autograd's would
        p.grad = s.detach() if p.grad is None else p.grad.add_(s.detach())
