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

import torch
from torch import Tensor, nn

from .._checks import AVAILABLE, check_max_norm
from .._torch import not_traced
from ..conv.settings import activate
from ..engine.passes import sample_by_sample
from ..engine.prepared import CallPlan, Prepared, kept_for
from ..engine.request import Batch
from .arguments import check_call
from .groups import (
    Grouping,
    OnePass,
    all_finite,
    assert_flag_on_device,
    clip_factors,
    ensure_finite,
    finite_flag,
    kept_grouping,
    kept_thresholds,
    masked,
)
from .norms import add_into, gather_norms, group_norms, joined, squared


@not_traced
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
    sample_mask: Tensor | None = None,
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

    With ``sample_mask`` (masked DP-SGD: Beltran et al. 2024, "Towards Efficient and
    Scalable Training of Differentially Private Deep Learning"), the batch is a Poisson
    batch padded to a fixed size, and only the samples whose entry is True count: the sum
    added is Σ over them of min(1, C/‖gₙ‖)·gₙ, as if the padded samples were not there
    (the shapes stay fixed, so a compiled graph does not recompile for each batch size).
    The padded samples' inputs and targets are replaced by zeros before the forward pass
    and their clip factors are 0, both by ``torch.where``: a NaN or inf they hold reaches
    neither the sum nor the finiteness check of the norms. No host synchronisation is
    added for the mask.

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
        sample_mask: None (every sample is real), or a ``torch.bool`` tensor ``[N]`` on
            the inputs' device: True for a real sample, False for padding, which adds
            nothing (masked DP-SGD, Beltran et al. 2024). A float mask or per-sample
            weight is refused.

    Returns:
        The per-sample norms ``[N]`` before clipping (of the local samples); with
        ``groups`` other than ``"all"``, ``{group: [N]}``. A padded sample's norm is 0.

    Raises:
        TypeError, ValueError: as :func:`per_sample_norms`; a threshold not a positive
            finite number; bad ``groups`` or a group without a threshold (see
            :func:`memconv.tasks.groups.resolve_groups`); an unknown ``clip_route``; a
            ``sample_mask`` not a bool tensor (TypeError) or not ``[N]`` on the inputs'
            device (ValueError). Before any work, every ``.grad`` unchanged.
        RuntimeError: a real sample's norm not finite, or (with ``sample_mask``) a
            clipped sum not finite because the model or loss is not finite at a padded
            sample's zero input and target. Nothing is added to ``.grad``.
    """
    given = Batch(model, loss_fn, inputs, targets)
    options = dict(strategy=strategy, memory_budget=memory_budget, norm_route=norm_route)
    with kept_for(model) as prepared:
        return clip_with(
            prepared,
            given,
            max_norm=max_norm,
            clip_route=clip_route,
            groups=groups,
            sample_mask=sample_mask,
            **options,
        )


def clip_with(prepared: Prepared, given: Batch, *, max_norm, groups="all", **options):
    """:func:`clip_and_accumulate` of ``given``, reusing what ``prepared`` kept from the
    last call: the arguments checked, then per micro-batch of the plan the norms, the
    clip factors and the clipped sums by the plan's route, then the sums added to
    ``.grad``."""
    check_max_norm(max_norm)
    caller = "memconv.clip_and_accumulate"
    checked = check_call(prepared, given, task="clip", caller=caller, unwrap=True, **options)
    request, batch, ddp, mask = checked
    grouping = kept_grouping(prepared, batch.model, groups, max_norm)
    params = prepared.trainable()
    if request.n == 0:
        accumulate(params, {}, ddp)
        zero = given.inputs.new_zeros(0, dtype=torch.float32)
        return joined(grouping, [{g: zero for g in grouping.members}])
    padded = mask is not None
    if prepared.streams:  # one sample at a time: its norm from its gradient, gathered
        with activate(request.settings):
            total, parts = _clip_sample_by_sample(batch, params, grouping, mask)
        flag = results_flag(parts, _checked_sums(total, None, padded))
    else:
        compiled = prepared.backend is not None
        walk = clipping_walk(grouping, params, padded, thresholds=compiled)
        options = (grouping.kind, tuple(grouping.of.items()), tuple(grouping.max_norm))
        extra = () if mask is None else (mask,)
        if compiled:  # the thresholds an input of the step (adaptive clipping keeps it)
            extra = (kept_thresholds(prepared, grouping, given.inputs.device), *extra)
        total, parts, flag = prepared.run_walk(batch, request, walk, options=options, extra=extra)
    check_step(
        flag,
        total,
        parts,
        caller=request.caller,
        route=None if prepared.streams else prepared.plan.clip_route,
        padded=padded,
        on_device=prepared.backend is not None and given.inputs.device.type != "cpu",
    )
    accumulate(params, total, ddp)
    return joined(grouping, parts)


def clipping_walk(grouping: Grouping, params: dict, padded: bool, thresholds: bool = False):
    """The walk of a clipping step, ``walk(cp, batch, *extra) -> (total, parts, flag)``:
    the clipped sums ``{name: tensor}``, the norms ``[{group: [m]}]`` per micro-batch
    (:func:`_clipped_sums`) and the finiteness flag of what :func:`check_step` checks,
    computed in the step (a compiled step's graph). ``padded``: the batch has a
    ``sample_mask`` (passed as the walk's last extra tensor). ``thresholds``: the groups'
    thresholds come as the first extra tensor (:meth:`Grouping.thresholds`), not as
    numbers: a compiled step's input, so that a threshold changed between steps
    (adaptive clipping) keeps its graph."""

    def walk(cp, b, *more):
        g = grouping
        if thresholds:
            g, more = grouping.with_thresholds(more[0]), more[1:]
        total, parts = _clipped_sums(cp, b, g, params, *more)
        sums = _checked_sums(total, cp.plan.clip_route, padded)
        return total, parts, results_flag(parts, sums)

    return walk


def check_step(flag, total: dict, parts: list, *, caller, route, padded, on_device) -> None:
    """The finiteness check of a clipping step's results, before ``.grad``: with
    ``on_device`` (a compiled step on a GPU) on the flag's device, the host does not
    wait (:func:`memconv.tasks.groups.assert_flag_on_device`); otherwise the flag read
    once, the call's one host synchronisation, and where it is False the samples or
    sums looked for and named (:func:`ensure_finite_results`). ``route``: the plan's
    clipping route (None: sample by sample).

    Raises:
        RuntimeError: as :func:`ensure_finite_results`.
    """
    if on_device:
        assert_flag_on_device(flag, caller)
    elif flag is not None and not bool(flag):
        sums = _checked_sums(total, route, padded)
        ensure_finite_results(parts, sums, caller, padded=padded)


def _clipped_sums(cp: CallPlan, batch: Batch, grouping: Grouping, params: dict, mask=None):
    """``(clipped sums {name: tensor}, [{group: norms [m]} per micro-batch])`` of the
    batch, a micro-batch at a time (clip factors are per sample: the micro-batches'
    clipped sums add up); nothing is checked yet (:func:`ensure_finite_results`).
    ``mask``: the bool mask ``[N]`` of the real samples, or None."""
    total: dict[str, Tensor] = {}
    onepass = one_pass(cp, grouping, total, mask)
    parts = gather_norms(batch, cp, onepass)
    return total, [
        clip_part(part, cp, grouping, params, total, _rows(mask, part.rows)) for part in parts
    ]


def _checked_sums(total: dict, route, padded: bool) -> dict:
    """The clipped sums whose finiteness is checked before ``.grad``: the two-pass
    route's (from torch's own backward), and every route's with a ``sample_mask``."""
    return total if route == "two-pass" or padded else {}


def results_flag(parts: list[dict], sums: dict) -> Tensor | None:
    """:func:`memconv.tasks.groups.finite_flag` of the norms of ``parts`` (``{group: [m]}``
    per micro-batch) and of ``sums``: what :func:`ensure_finite_results` checks, as a
    tensor (no host synchronisation)."""
    return finite_flag([v for part in parts for v in part.values()] + list(sums.values()))


def _rows(mask: Tensor | None, rows: slice) -> Tensor | None:
    """The mask of a micro-batch's rows (a view: no copy, no synchronisation)."""
    return None if mask is None else mask[rows]


def ensure_finite_results(parts: list[dict], sums: dict, caller: str, padded=False) -> None:
    """Raise unless every norm of ``parts`` (``{group: [m]}`` per micro-batch) and every
    clipped sum of ``sums`` (the two-pass route's, from torch's own backward; every
    route's with a ``sample_mask``) is finite, before anything reaches ``.grad``: one
    host synchronisation for all of them, the call's only one. ``padded``: the batch has
    a ``sample_mask`` (the norms are those of the real samples, the padded ones 0).

    Raises:
        RuntimeError: naming the samples whose norm is not finite, or the parameters
            whose sum is not.
    """
    norms = [v for part in parts for v in part.values()]
    if all_finite(norms + list(sums.values())):
        return
    offsets, start = [], 0
    for part in parts:
        length = len(next(iter(part.values()))) if part else 0
        offsets += [start] * len(part)
        start += length
    ensure_finite(norms, caller, offsets)
    ensure_finite_sums(sums, caller, padded)


def one_pass(cp: CallPlan, grouping: Grouping, total: dict, mask: Tensor | None = None):
    """What makes each walk's :class:`memconv.tasks.groups.OnePass` (groups within one
    layer call are clipped during the backward pass, into ``total``), or None for
    ``groups="all"``: called with the walk's rows (None: all of ``mask``), it gives the
    OnePass of those rows' part of ``mask`` (the bool mask ``[N]`` of the real samples,
    or None)."""
    if grouping.kind == "all":
        return None
    caller = cp.request.caller
    return lambda rows=None: OnePass(
        grouping,
        cp.rule_settings,
        total,
        caller,
        sample_mask=mask if rows is None else _rows(mask, rows),
    )


def clip_part(part, cp: CallPlan, grouping: Grouping, params: dict, total: dict, mask=None) -> dict:
    """One walked micro-batch (:class:`memconv.engine.passes.MicroBatch` whose visitor is
    a :class:`memconv.tasks.norms.NormGatherer`): its norms by group → their clip factors
    → the clipped sums by the plan's route, added into ``total``. ``mask``: the bool mask
    ``[m]`` of the micro-batch's real samples, or None: a padded sample's norm and clip
    factor are 0 (set by ``torch.where``).

    Returns:
        ``{group: norms [m]}`` before clipping (not yet checked: the caller checks
        every micro-batch's at once, :func:`ensure_finite_results`, before ``.grad``).
    """
    gathered = part.visitor
    sq = gathered.result(cp.params)
    norms = group_norms(grouping, sq, len(part.losses))
    norms = {g: masked(v, mask) for g, v in norms.items()}
    done = gathered.onepass.groups if gathered.onepass is not None else set()
    factors = {
        g: masked(clip_factors(v, grouping.max_norm[g]), mask)
        for g, v in norms.items()
        if g not in done
    }
    if cp.plan.clip_route == "book-keeping":
        c = {k: factors[g] for k, g in grouping.of.items() if g in factors}
        gathered.add_clipped_sums(c, total)
    else:
        _second_passes(part.losses, factors, grouping, params, total)
    return norms


def _second_passes(losses, factors: dict, grouping: Grouping, params: dict, total: dict):
    """Two-pass: Σₙ cₙ·∇ℓₙ of each group by a second backward pass of the kept graph,
    added into ``total`` (checked finite by the caller)."""
    for i, (g, c) in enumerate(factors.items()):
        group = {k: params[k] for k in grouping.members[g]}
        sums = _second_pass(losses, c, group, retain=i + 1 < len(factors))
        for name, v in sums.items():
            add_into(total, name, v)


def _clip_sample_by_sample(batch: Batch, params: dict, grouping: Grouping, mask=None):
    """Clip and sum for models that stream: each sample's gradient (gathered tile by
    tile), its norms, its clipped share added to a running total (a padded sample's,
    with ``mask``, times 0). Returns ``(total, [{group: norms [1]} per sample])``."""
    total: dict[str, Tensor] = {}
    norms = []
    for i, grads in sample_by_sample(batch, params):
        sq = {k: squared(g.unsqueeze(0)) for k, g in grads.items()}
        one = _rows(mask, slice(i, i + 1))
        norm = {g: masked(v, one) for g, v in group_norms(grouping, sq, 1).items()}
        c = {g: masked(clip_factors(v, grouping.max_norm[g]), one) for g, v in norm.items()}
        for name, g in grads.items():
            add_into(total, name, g * c[grouping.of[name]].to(g.dtype))
        norms.append(norm)
    return total, norms


def ensure_finite_sums(sums: dict[str, Tensor], caller: str, padded: bool = False) -> None:
    """Raise if a clipped sum is not finite although every norm is: the second pass's
    (torch's own backward of a layer is not finite there) or, with a ``sample_mask``
    (``padded``), a padded sample's share (the model or loss not finite at its zero input
    and target, and ``0·NaN`` is NaN).

    Raises:
        RuntimeError: naming the parameters and the remedy.
    """
    bad = [name for name, v in sums.items() if not all_finite([v])]
    if bad and padded:
        raise RuntimeError(
            f"{caller}: the clipped sum of {', '.join(map(repr, bad))} is not finite although "
            "the norm of every real sample (sample_mask True) is: the model or the loss is "
            "not finite on a padded sample, whose input and target memconv replaces by "
            "zeros (a normalisation of the input by its norm, a log of 0); nothing was "
            "added to .grad. Make the model and loss finite at a zero input and target (with "
            'clip_route="two-pass", torch\'s own backward of a layer may be the cause instead: '
            'try "book-keeping").'
        )
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
        (losses * (c if c.dtype == losses.dtype else c.to(losses.dtype))).sum(),
        [params[k] for k in names],
        allow_unused=True,
        retain_graph=retain,
    )
    return {k: g for k, g in zip(names, grads) if g is not None}


def accumulate(params: dict, sums: dict, ddp) -> None:
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
        if s.requires_grad:  # (the sums are computed without a graph)
            s = s.detach()
        # a fresh tensor of the parameter's shape: it becomes .grad as autograd's would
        p.grad = s if p.grad is None else p.grad.add_(s)
