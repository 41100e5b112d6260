"""Per-sample gradient norms and clipped sums (DP-SGD) without per-sample gradients.

:func:`per_sample_norms` and :func:`clip_and_accumulate` run one forward and one
backward pass (:func:`memconv.extraction.backward_walk`) in which each parametrised
layer turns its input and output gradient into the squared norms of its per-sample
gradients (:mod:`memconv.norms`: ghost norms or instantiated chunks, per layer), so
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

import math
import numbers

import torch
from torch import Tensor, nn

from ._geometry import CONV_TRANSPOSE_TYPES, CONV_TYPES, conv_spec
from .context import Settings, activate, budgeted, use_block_settings
from .extraction import (
    LayerVisit,
    backward_walk,
    check_batch,
    check_per_sample_model,
    parameter_names,
    sample_by_sample,
    streams,
)
from .grad_sample import bias_grad, grad_sample, own_trainable, summed_weight_grad
from .norms import DEFAULT_NORM_BUDGET, check_route, layer_sq_norms, sq_norms

CLIP_ROUTES = ("book-keeping", "two-pass")


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


def _check_common(model, inputs, targets, memory_budget, norm_route) -> int:
    from .planning import check_budget

    check_per_sample_model(model)
    n = check_batch(inputs, targets)
    check_budget(memory_budget)
    check_route(norm_route)
    return n


class _Norms:
    """Squared per-sample norms per parameter, gathered layer by layer; with
    book-keeping, also what the clipped sum needs of each layer.

    Parameters used more than once (shared between layers, or a layer called
    twice) have per-sample gradients summed over their uses first, since the norm of
    a sum is not the sum of norms. With book-keeping a layer keeps its per-sample
    gradients where they are smaller than its input and output gradient, else the
    latter (and its norms come from the ghost or instantiating route).
    """

    def __init__(self, n: int, settings: Settings, route, budget, keep: bool):
        self.n, self.settings, self.route, self.budget, self.keep = n, settings, route, budget, keep
        self.sq: dict[str, Tensor] = {}
        self.grads: dict[str, Tensor] = {}  # per-sample gradients kept (or shared)
        self.io: list[LayerVisit] = []  # layers kept as input and output gradient
        self.uses: dict[str, int] = {}

    def visit(self, layer: LayerVisit) -> None:
        shared = {k for k, full in layer.params.items() if self.uses.get(full, 0) > 1}
        own = dict(layer.module.named_parameters(recurse=False))
        per_sample = self.n * sum(own[k].numel() for k in layer.params)
        # book-keeping keeps the smaller of per-sample gradients and (input, output grad)
        instantiate = bool(shared) or (self.keep and per_sample < layer.x.numel() + layer.g.numel())
        if instantiate:  # the strategy's temporaries within the layer's budget
            settings = budgeted(self.settings, self.budget or DEFAULT_NORM_BUDGET)
            grads = grad_sample(layer.module, layer.x, layer.g, settings, layer.autocast)
            for k, v in grads.items():
                full = layer.params[k]
                if k in shared or self.keep:
                    self.grads[full] = v if full not in self.grads else self.grads[full] + v
                else:
                    self.sq[full] = _squared(v)
            return
        sq = layer_sq_norms(
            layer.module, layer.x, layer.g, self.settings, layer.autocast, self.route, self.budget
        )
        for k, v in sq.items():
            self.sq[layer.params[k]] = v
        if self.keep:
            self.io.append(layer)

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

    def add_clipped_sums(self, c: Tensor, total: dict) -> None:
        """Add Σₙ cₙ·gₙ per parameter into ``total``: kept per-sample gradients weighted,
        and one summed VJP per layer kept as input and output gradient (each layer's
        share added, and released, as it goes)."""
        for full in list(self.grads):
            grads = self.grads.pop(full)
            _add(total, full, torch.einsum("n,n...->...", c.to(grads.dtype), grads))
        while self.io:
            layer = self.io.pop(0)
            shape = (-1,) + (1,) * (layer.g.dim() - 1)
            g = layer.g * c.to(layer.g.dtype).reshape(shape)  # each sample's output gradient scaled
            for k, v in _summed_grads(layer, g, self.settings).items():
                _add(total, layer.params[k], v)
            del layer, g


def _add(total: dict, name: str, value: Tensor) -> None:
    total[name] = value if name not in total else total[name].add_(value)


def _squared(grads: Tensor) -> Tensor:
    return sq_norms(grads).to(torch.promote_types(grads.dtype, torch.float32))


def _count_uses(model: nn.Module, names: dict) -> dict[str, int]:
    """How many layers own each trainable parameter (a module called twice counts
    once here; :func:`_forward_counts` adds the calls)."""
    uses: dict[str, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in names:
                uses[names[id(p)]] = uses.get(names[id(p)], 0) + 1
    return uses


def _with_call_counts(model, names, uses):
    """Forward hooks adding, to ``uses``, each further call of a parametrised layer."""
    calls: dict[nn.Module, int] = {}

    def hook(module, args, output):
        calls[module] = calls.get(module, 0) + 1
        if calls[module] > 1:  # called again: its parameters are used once more
            for p in module.parameters(recurse=False):
                if id(p) in names:
                    uses[names[id(p)]] = uses.get(names[id(p)], 0) + 1

    return [m.register_forward_hook(hook) for m in model.modules() if own_trainable(m)]


def _walk_norms(model, loss_fn, inputs, targets, settings, route, budget, *, clip_route, caller):
    """The backward walk gathering norms (and, for book-keeping, what the clipped sum
    needs); returns ``(squared norms per parameter, losses, the gatherer)``."""
    names = parameter_names(model)
    norms = _Norms(len(inputs), settings, route, budget, keep=clip_route == "book-keeping")
    norms.uses = _count_uses(model, names)
    handles = _with_call_counts(model, names, norms.uses)
    try:
        with activate(None, False):  # the user's blocks do not reach the model's own layers
            losses = backward_walk(
                model, loss_fn, inputs, targets, names, norms.visit, caller=caller,
                keep_graph=clip_route == "two-pass",
            )  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return norms.result(params), losses, norms


def per_sample_norms(
    model: nn.Module,
    loss_fn,
    inputs: Tensor,
    targets: Tensor,
    *,
    strategy: str | bool | None = None,
    memory_budget: int | None = None,
    per_parameter: bool = False,
    norm_route: str | None = None,
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
            budget, as :func:`memconv.plan` plans them (None: one pass, and 32 MiB
            per layer's norm temporaries).
        per_parameter: return ``{name: [N]}`` (each parameter's own norms) instead of
            the norm over all trainable parameters.
        norm_route: ``"ghost"`` or ``"instantiate"`` for every convolution and Linear
            layer, or None to choose per layer by the cost models.

    Returns:
        ``[N]`` norms (float32 or wider), or ``{name: [N]}``.

    Raises:
        TypeError, ValueError: as :func:`memconv.per_sample_grads`; an unknown
            ``norm_route``; a non-positive or non-integer ``memory_budget``, or one below
            the smallest feasible budget (named). Before any work.
    """
    settings = use_block_settings(strategy)
    model, _ = _unwrap(model)
    n = _check_common(model, inputs, targets, memory_budget, norm_route)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if n == 0:
        empty = {
            name: p.new_zeros(0, dtype=torch.promote_types(p.dtype, torch.float32))
            for name, p in params.items()
        }
        return empty if per_parameter else inputs.new_zeros(0, dtype=torch.float32)
    if streams(model):  # one sample at a time, by autograd (its layers are hidden)
        with activate(settings):
            sq = [
                {name: _squared(g.unsqueeze(0)) for name, g in grads.items()}
                for _, grads in sample_by_sample(model, loss_fn, inputs, targets, params)
            ]
        if per_parameter:
            return {name: torch.cat([s[name] for s in sq]).sqrt() for name in params}
        return torch.cat([_total(s, 1) for s in sq]).sqrt()
    m, layer_budget, _ = _plan(model, inputs, "norms", settings, memory_budget, None)
    walks = _walks(
        model, loss_fn, inputs, targets, settings, norm_route, layer_budget, m, None,
        "memconv.per_sample_norms",
    )  # fmt: skip
    parts = [sq for sq, _, _ in walks]
    if per_parameter:
        return {name: torch.cat([part[name] for part in parts]).sqrt() for name in params}
    return torch.cat(
        [_total(part, len(inputs[rows])) for part, rows in zip(parts, _micro_batches(n, m))]
    ).sqrt()


def _total(sq: dict, n: int) -> Tensor:
    """Squared norms over all parameters ``[n]``."""
    return torch.stack(list(sq.values())).sum(0) if sq else torch.zeros(n)


def _micro_batches(n: int, m: int):
    return [slice(i0, min(n, i0 + m)) for i0 in range(0, n, m)]


def _walks(model, loss_fn, inputs, targets, settings, route, budget, m, clip_route, caller):
    """:func:`_walk_norms` over the micro-batches of ``m`` samples, one at a time."""
    for rows in _micro_batches(len(inputs), m):
        yield _walk_norms(
            model, loss_fn, inputs[rows], targets[rows], settings, route, budget,
            clip_route=clip_route, caller=caller,
        )  # fmt: skip


def _plan(model, inputs, task, settings, memory_budget, clip_route):
    """``(micro-batch, per-layer budget, clip route)`` for a whole call."""
    from .planning import make_plan, profile

    n = len(inputs)
    if memory_budget is None:
        return n, None, clip_route or "book-keeping"
    chosen = make_plan(profile(model, inputs), n, task, settings, memory_budget, clip_route)
    return chosen.micro_batch, chosen.layer_budget, chosen.clip_route


def clip_factors(norms: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / ‖gₙ‖)`` per sample (1 for a zero gradient)."""
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    return torch.where(norms > max_norm, max_norm / safe, torch.ones_like(norms))


def _summed_grads(layer: LayerVisit, g: Tensor, settings: Settings) -> dict[str, Tensor]:
    """The layer's summed parameter gradients for output gradient ``g``."""
    m, x = layer.module, layer.x
    out = {}
    if isinstance(m, CONV_TYPES + CONV_TRANSPOSE_TYPES):
        if "weight" in layer.params:  # torch's own kernel: the fastest summed VJP
            ops = conv_spec(m).operands(x.to(g.dtype), g)
            out["weight"] = summed_weight_grad(ops, m.weight)
        if "bias" in layer.params:
            out["bias"] = bias_grad(g, per_sample=False)
    elif isinstance(m, nn.Linear):
        x2 = x.to(g.dtype).reshape(-1, x.shape[-1])
        g2 = g.reshape(-1, g.shape[-1])
        if "weight" in layer.params:
            out["weight"] = g2.transpose(0, 1) @ x2
        if "bias" in layer.params:
            out["bias"] = g2.sum(0)
    else:
        grads = grad_sample(m, x, g, settings, layer.autocast)
        out = {k: v.sum(0) for k, v in grads.items() if k in layer.params}
    params = dict(m.named_parameters(recurse=False))
    return {k: v.to(params[k].dtype) for k, v in out.items()}


def clip_and_accumulate(
    model: nn.Module,
    loss_fn,
    inputs: Tensor,
    targets: Tensor,
    *,
    max_norm: float,
    strategy: str | bool | None = None,
    memory_budget: int | None = None,
    norm_route: str | None = None,
    clip_route: str | None = None,
) -> Tensor:
    """Add Σₙ min(1, max_norm/‖gₙ‖)·gₙ to every trainable parameter's ``.grad``.

    ``gₙ`` is the gradient of sample n's loss (as :func:`memconv.per_sample_grads`
    defines it) over all trainable parameters; the sum is added to ``.grad`` as
    ``backward`` adds (``.grad`` is created where it is None). No per-sample gradients
    of more than one layer exist at once. DP-SGD's noise, the division by the
    expected batch size and the privacy accounting stay with the optimizer.

    With a ``DistributedDataParallel`` model, each rank clips its own samples and
    every rank gets the clipped **sum** over the whole (global) batch: the ranks'
    sums are all-reduced (summed, not averaged as DDP's gradients are).

    Args:
        model: as :func:`memconv.per_sample_grads`.
        loss_fn: returns a scalar for one sample.
        inputs: ``[N, ...]``.
        targets: ``[N, ...]``.
        max_norm: the clipping threshold C (positive, finite).
        strategy: weight-VJP strategy (name or bool); None: the open block's or
            ``"auto"``.
        memory_budget: bytes the whole call's peak memory increase may reach (see
            :func:`per_sample_norms`); the plan also picks the clipping route when
            ``clip_route`` is None.
        norm_route: ``"ghost"``, ``"instantiate"`` or None (per layer).
        clip_route: ``"book-keeping"``, ``"two-pass"`` or None (book-keeping, or the
            one that fits the budget with the larger micro-batch).

    Returns:
        The per-sample norms ``[N]`` before clipping (of the local samples).

    Raises:
        TypeError, ValueError: as :func:`per_sample_norms`; ``max_norm`` not a positive
            finite number; an unknown ``clip_route``. Before any work, every ``.grad``
            unchanged.
    """
    settings = use_block_settings(strategy)
    model, ddp = _unwrap(model)
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"max_norm must be a positive finite number, got {max_norm!r}")
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm!r}")
    if clip_route is not None and clip_route not in CLIP_ROUTES:
        raise ValueError(
            f"unknown clip_route {clip_route!r}; accepted: {', '.join(CLIP_ROUTES)} or None"
        )
    n = _check_common(model, inputs, targets, memory_budget, norm_route)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if n == 0:
        _accumulate(params, {}, ddp)
        return inputs.new_zeros(0, dtype=torch.float32)
    if streams(model):  # one sample at a time: its norm from its gradient, gathered
        return _clip_sample_by_sample(
            model, loss_fn, inputs, targets, params, settings, max_norm, ddp
        )
    m, layer_budget, route = _plan(model, inputs, "clip", settings, memory_budget, clip_route)
    total: dict[str, Tensor] = {}
    all_norms = []
    walks = _walks(
        model, loss_fn, inputs, targets, settings, norm_route, layer_budget, m, route,
        "memconv.clip_and_accumulate",
    )  # fmt: skip
    for sq, losses, gathered in walks:
        norms = _total(sq, len(losses)).sqrt()
        c = clip_factors(norms, float(max_norm))
        # clip factors are per sample: the micro-batches' clipped sums add up
        if route == "book-keeping":
            gathered.add_clipped_sums(c, total)
        else:
            del gathered
            for name, v in _second_pass(losses, c, params).items():
                _add(total, name, v)
        del losses
        all_norms.append(norms)
    _accumulate(params, total, ddp)
    return torch.cat(all_norms)


def _clip_sample_by_sample(model, loss_fn, inputs, targets, params, settings, max_norm, ddp):
    """Clip and sum for models that stream: each sample's gradient (gathered tile by
    tile), its norm, its clipped share added to a running total."""
    total: dict[str, Tensor] = {}
    norms = []
    with activate(settings):
        for _, grads in sample_by_sample(model, loss_fn, inputs, targets, params):
            norm = _total({k: _squared(g.unsqueeze(0)) for k, g in grads.items()}, 1).sqrt()
            c = clip_factors(norm, float(max_norm))
            for name, g in grads.items():
                _add(total, name, g * c.to(g.dtype))
            norms.append(norm)
    _accumulate(params, total, ddp)
    return torch.cat(norms)


def _second_pass(losses: Tensor, c: Tensor, params: dict) -> dict[str, Tensor]:
    """Σₙ cₙ·∇ℓₙ by a second backward pass of the kept graph."""
    names = list(params)
    grads = torch.autograd.grad(
        (losses * c.to(losses.dtype)).sum(), [params[k] for k in names], allow_unused=True
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
