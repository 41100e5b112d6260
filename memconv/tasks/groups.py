"""Groups of parameters clipped together, their thresholds, and per-layer clipping in
one backward pass.

DP-SGD clips each sample's gradient ``gₙ`` to a threshold C (Abadi et al., CCS 2016).
Group-wise clipping splits the trainable parameters into groups ``g`` with a threshold
``C_g`` each and adds

    Σ_g Σₙ min(1, C_g/‖gₙ,g‖)·gₙ,g

(McMahan et al., ICLR 2018, "per-layer clipping"; He et al., ICLR 2023, "Exploring the
limits of differentially private deep learning with group-wise clipping"). One sample
then moves the sum by at most ``√(Σ_g C_g²)`` in L2 (:meth:`Grouping.sensitivity`),
the threshold the noise scales with — as Opacus' ``DPPerLayerOptimizer`` takes the L2
norm of its per-parameter thresholds.

When each group lies within one layer call, the group's clip factors are known as soon
as that call's output gradient has arrived: :class:`OnePass` takes the call's norms
(the rule's ghost norms where it has them) and adds the call's clipped sum at once —
one weight VJP with the output gradient scaled by the factors — so nothing is kept for
after the backward pass and no second pass runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from .._checks import check_groups, check_thresholds
from .._torch import assert_on_device, max_abs_each
from ..conv.contract import contract
from ..conv.norm_routes import at_least_float32, sq_norms

#: The named groupings ``groups=`` takes (besides a mapping).
#: The group's name with ``groups="all"``.
ALL = "all"


def clip_factors(norms: Tensor, max_norm: float | Tensor) -> Tensor:
    """``min(1, max_norm / ‖gₙ‖)`` per sample (1 for a zero gradient: ``C/0`` is inf,
    clamped to 1; a non-finite norm gives a non-finite factor, which the call's one
    check, :func:`ensure_finite`, refuses before anything reaches ``.grad``). Three
    tensor operations, ``1/‖gₙ‖`` times ``max_norm`` (what ``max_norm / norms`` computes
    for a number), so that a threshold given as a 0-d tensor (a compiled step's input,
    :meth:`Grouping.with_thresholds`) gives the same factors as the number."""
    return (norms.reciprocal() * max_norm).clamp_(max=1.0)


def masked(values: Tensor, sample_mask: Tensor | None) -> Tensor:
    """``values`` ``[n]`` with the padded samples' entries (``sample_mask`` False) set to
    0 by ``torch.where`` (a NaN or inf there is replaced, not multiplied: ``0·NaN`` is
    NaN); ``values`` itself without a mask. Fixed shapes, no host synchronisation."""
    if sample_mask is None:
        return values
    return torch.where(
        sample_mask, values, torch.zeros((), dtype=values.dtype, device=values.device)
    )


def finite_flag(tensors: list[Tensor]) -> Tensor | None:
    """Whether every element of every tensor is finite, as a one-element bool tensor on
    their device (no host synchronisation: a compiled step computes it in its graph), or
    None where no tensor has an element (their largest magnitudes, one operation for all
    of them, then one check)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return None
    if len(tensors) == 1:
        return torch.isfinite(tensors[0]).all()
    return torch.isfinite(torch.stack(max_abs_each(tensors))).all()


def all_finite(tensors: list[Tensor]) -> bool:
    """Whether every element of every tensor is finite: one host synchronisation
    whatever the number of tensors (:func:`finite_flag`, then one read)."""
    flag = finite_flag(tensors)
    return flag is None or bool(flag)


def assert_flag_on_device(flag: Tensor | None, caller: str) -> None:
    """:func:`ensure_finite` without a host synchronisation, of a :func:`finite_flag`
    (computed in a compiled step's graph; None, no values, passes): the check runs on
    the flag's device (:func:`memconv._torch.assert_on_device`), for a compiled step on
    a GPU, whose host must not wait for the step. A non-finite value fails the device's
    next synchronisation (a CUDA device-side assertion, which ends the process's CUDA
    context: never a silent NaN in ``.grad``); the samples are not named."""
    if flag is None:
        return
    assert_on_device(
        flag,
        f"{caller}: a per-sample gradient norm or clipped sum is not finite (NaN or inf); "
        "run the step on the CPU or uncompiled to name the samples",
    )


def ensure_finite(norms: Tensor | list[Tensor], caller: str, offsets=None) -> None:
    """Raise if a per-sample norm is NaN or infinite, naming the samples: the call's one
    host synchronisation (a list of norms, of groups or micro-batches, is checked at
    once; the samples are looked for only once one is found).

    Args:
        norms: ``[n]``, or a list of them.
        caller: the public function's name, for the message.
        offsets: the index of the first sample of each part of a list (default: 0).

    Raises:
        RuntimeError: naming the first samples (their indices in the batch).
    """
    parts = list(norms) if isinstance(norms, (list, tuple)) else [norms]
    if all_finite(parts):
        return
    offsets = offsets or [0] * len(parts)
    found = (o + i for v, o in zip(parts, offsets) for i in _not_finite(v))
    bad = sorted(set(found))
    shown = ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else "")
    raise RuntimeError(
        f"{caller}: the per-sample gradient norm of sample(s) {shown} is not finite "
        "(NaN or inf), so their clip factors are undefined; nothing was added to .grad. "
        "Check those inputs and the loss (overflow in float16/bfloat16, log of 0)."
    )


def _not_finite(v: Tensor) -> list[int]:
    return (~torch.isfinite(v)).nonzero().flatten().tolist()


@dataclass(frozen=True)
class Grouping:
    """Trainable parameters split into groups, each with its clipping threshold.

    Attributes:
        kind: ``"all"``, ``"layer"``, ``"parameter"`` or ``"mapping"``.
        of: ``{parameter name: group name}`` for every trainable parameter.
        members: ``{group name: parameter names}``, in ``named_parameters`` order.
        max_norm: ``{group name: threshold}`` (None for norms only).
    """

    kind: str
    of: dict
    members: dict
    max_norm: dict | None = None

    def thresholds(self, device) -> Tensor:
        """The thresholds ``[G]`` (float64, on ``device``), in :attr:`max_norm`'s order:
        what a compiled step takes as an input (:meth:`with_thresholds`), so that
        thresholds changed between steps (adaptive clipping) keep its graph."""
        values = torch.tensor(list(self.max_norm.values()), dtype=torch.float64)
        return values.to(device, non_blocking=True)  # (the host does not wait)

    def with_thresholds(self, thresholds: Tensor) -> Grouping:
        """This grouping with the thresholds of :meth:`thresholds`' tensor ``[G]``, each
        a 0-d tensor (the clip factors' operations read them as numbers)."""
        names = tuple(self.max_norm)
        return replace(self, max_norm={g: thresholds[i] for i, g in enumerate(names)})

    def sensitivity(self) -> float:
        """``√(Σ_g C_g²)``: how far one sample moves the clipped sum, in L2."""
        return math.sqrt(sum(c * c for c in self.max_norm.values()))

    def norm(self, group: str, sq: dict, n: int) -> Tensor:
        """The group's per-sample norms ``[n]`` from squared norms per parameter (a
        parameter missing from ``sq`` adds nothing)."""
        parts = [sq[name] for name in self.members[group] if name in sq]
        return torch.stack(parts).sum(0).sqrt() if parts else torch.zeros(n)

    def norms(self, sq: dict, n: int) -> dict[str, Tensor]:
        """``{group: [n]}`` from ``{parameter name: squared norms [n]}``."""
        return {g: self.norm(g, sq, n) for g in self.members}


def resolve_groups(model: nn.Module, groups, max_norm=None) -> Grouping:
    """Check ``groups=`` (and ``max_norm=``) against the model's trainable parameters.

    Args:
        model: the (unwrapped) model.
        groups: ``"all"``, ``"layer"`` (the parameters a module owns directly, named
            by the module; ``""`` for the model's own), ``"parameter"`` (named by the
            parameter) or a mapping ``{parameter name: group name}`` covering every
            trainable parameter (names as ``model.named_parameters()`` gives them).
        max_norm: None (norms only), one threshold for every group, or a mapping
            ``{group name: threshold}`` with exactly the groups' names.

    Returns:
        The :class:`Grouping`.

    Raises:
        TypeError: ``groups`` neither a known name nor a mapping of strings;
            ``max_norm`` neither a number nor a mapping; a threshold not a number.
        ValueError: an unknown grouping; a mapping naming no trainable parameter or
            leaving one out; a threshold ≤ 0 or not finite; a group without a
            threshold or a threshold for no group.
    """
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    check_groups(groups, names)
    if groups == "all":
        of = {n: ALL for n in names}
    elif groups == "layer":
        of = {n: n.rpartition(".")[0] for n in names}
    elif groups == "parameter":
        of = {n: n for n in names}
    else:
        of = {n: groups[n] for n in names}
    kind = groups if isinstance(groups, str) else "mapping"
    members: dict = {}
    for n in names:
        members.setdefault(of[n], []).append(n)
    members = {g: tuple(v) for g, v in members.items()}
    if kind == "all" and not members:
        members = {ALL: ()}
    if max_norm is None:
        return Grouping(kind, of, members)
    return Grouping(kind, of, members, check_thresholds(max_norm, members))


def kept_thresholds(prepared, grouping: Grouping, device) -> Tensor:
    """:meth:`Grouping.thresholds` of ``grouping`` on ``device``, kept by ``prepared``
    (a :class:`memconv.engine.prepared.Prepared`) while they are the same: a compiled
    step's input, made anew only when a threshold changed."""
    key = (tuple(grouping.max_norm.items()), device)
    return prepared.derived("thresholds", key, lambda: grouping.thresholds(device))


def kept_grouping(prepared, model: nn.Module, groups, max_norm=None) -> Grouping:
    """:func:`resolve_groups`, kept by ``prepared`` (a
    :class:`memconv.engine.prepared.Prepared` that has just checked ``model``) while the
    model is unchanged and ``groups`` is a named grouping and ``max_norm`` None or one
    number (a mapping, which its owner may change between calls, is checked every
    call)."""
    if not (isinstance(groups, str) and (max_norm is None or type(max_norm) in (int, float))):
        return resolve_groups(model, groups, max_norm)
    key = (groups, max_norm)  # (a bool is no number here: True would equal 1)
    return prepared.derived("grouping", key, lambda: resolve_groups(model, groups, max_norm))


def _small_grads(call) -> bool:
    """Whether the call's per-sample gradients hold fewer elements than its inputs and
    output gradient (early convolutions): then they give its norms and its clipped sum
    (one weight VJP fewer), as book-keeping keeps them (Bu et al., ICML 2023)."""
    named = call._named()
    grads = call.n() * sum(named[k].numel() for k in call.params)
    return grads < sum(a.numel() for a in call.args) + call.output_elements


def _weighted(c: Tensor, grads: Tensor) -> Tensor:
    """``Σₙ cₙ·gradsₙ`` (one contraction)."""
    return contract("n,n...->...", c if c.dtype == grads.dtype else c.to(grads.dtype), grads)


class OnePass:
    """Clips, during the backward pass, every layer call whose groups lie within it.

    A group lies within a call when the call's route computes all the group's
    parameters and no other call computes any of them (a shared parameter's
    per-sample gradients must be summed over its calls first). For such a call, once
    its output gradient has arrived: its squared norms per parameter (the rule's
    ``sq_norms``, ghost where cheaper; its per-sample gradients where they are smaller
    than its input and output gradient, or a generic call's), the
    groups' clip factors, and the clipped sum — a rule's summed weight VJP with the
    output gradient scaled by the factors (Bu et al., ICML 2023, book-keeping without
    the keeping), or the weighted per-sample gradients — added into
    ``total``. The other calls are left to the clipping route.

    Attributes:
        grouping: the groups and thresholds.
        sample_mask: the bool mask ``[n]`` of the walk's real samples, or None: the
            padded samples' clip factors are 0 (:func:`masked`).
        calls: the calls clipped in the pass (set by :meth:`prepare`).
        groups: their groups.
    """

    def __init__(self, grouping: Grouping, rs, total: dict, caller: str, sample_mask=None):
        self.grouping, self.rs, self.total, self.caller = grouping, rs, total, caller
        self.sample_mask = sample_mask
        self.calls: set = set()
        self.groups: set = set()

    def prepare(self, calls: list) -> None:
        """Pick the calls whose groups all lie within them (before the pass; again
        for each reversible block's calls, before the block's own backward pass: the
        picks add up)."""
        of = self.grouping.of
        owners: dict = {}
        for call in calls:
            for full in call.params.values():
                owners.setdefault(of[full], set()).add(call)
        within = set()
        for g, owner in owners.items():
            if len(owner) != 1:
                continue
            (call,) = owner
            if not call.shared and set(self.grouping.members[g]) <= set(call.params.values()):
                within.add(g)
        picked = {c for c in calls if c.params and all(of[f] in within for f in c.params.values())}
        self.calls |= picked
        self.groups |= {of[f] for c in picked for f in c.params.values()}

    def visit(self, call) -> dict[str, Tensor]:
        """Clip the call: its clipped sums added into ``total``; returns its squared
        norms ``{model name: [N]}``. A non-finite norm is not checked here (that would
        synchronise the host at every call): the caller checks every group's norms at
        once before the sums reach ``.grad``."""
        if call.rule is not None and not _small_grads(call):
            grads = None
            sq = call.sq_norms(self.rs)
        else:
            grads = call.grad_sample(self.rs)
            sq = {k: at_least_float32(sq_norms(v)) for k, v in grads.items()}
        full = {call.params[k]: v for k, v in sq.items()}
        local: dict = {}
        for k, name in call.params.items():
            local.setdefault(self.grouping.of[name], []).append(k)
        n = next(iter(sq.values())).shape[0] if sq else 0
        for g, keys in local.items():
            norm = self.grouping.norm(g, full, n).detach()
            c = masked(clip_factors(norm, self.grouping.max_norm[g]), self.sample_mask)
            if grads is None:
                sums = call.summed_grad(self.rs, c)
            else:
                sums = {k: _weighted(c, grads[k]) for k in keys}
            for k in keys:
                if k in sums:
                    name = call.params[k]
                    value = sums[k]
                    self.total[name] = (
                        value if name not in self.total else self.total[name].add_(value)
                    )
        return full
