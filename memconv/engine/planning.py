"""Whole-call memory plans: micro-batch and per-layer budget from the cost models.

Per-sample quantities are independent across samples, so a call can run the batch
in micro-batches of ``m`` samples and be exact whatever ``m``. :func:`plan` predicts
the peak memory increase of a whole call of :func:`memconv.per_sample_grads`,
:func:`memconv.per_sample_norms` or :func:`memconv.clip_and_accumulate` as a
function of ``m`` and of the bytes each layer's weight VJP or norm computation may
use, and picks the largest ``m`` (then the largest per-layer budget) whose
prediction fits ``memory_budget``.

The model (bytes; :class:`Profile` holds the per-sample sizes, read off one probe
forward pass of one and two samples):

- activations: what the forward pass saves for the backward pass (autograd's
  saved tensors, counted once per storage), ``a₀ + a₁·m``;
- backward pass, at each parametrised layer ℓ (in reverse order): the activations
  saved up to ℓ, ℓ's output gradient and input gradient, and ℓ's temporaries (its
  strategy's or norm route's, within the per-layer budget, and its per-sample
  gradients before they are stored);
- the result (``N·P`` elements of per-sample gradients; ``N`` norms); for
  book-keeping, what each layer keeps; for the clipped sum, the parameters'
  gradients;
- a reversible block's recomputation (:mod:`memconv.reversible`): what the block saves
  for its backward pass when run with a graph, the largest block's, ``r₀ + r₁·m``,
  alive at every layer of the backward pass (a block's layers save nothing in the
  forward pass; its backward pass runs them again, a half-step at a time for a
  coupling: the whole block's is an upper bound).

By default (``memory_budget="available"``) a call is lean: the per-layer budget is
the pass's own halved until the predicted peak is within the non-private step's
predicted peak times :data:`LEAN_FACTOR` (:func:`lean_layer_budget`), so each layer
takes the fastest route the device's calibration prices within it — priced on a batch
of :data:`LEAN_REFERENCE_BATCH` samples, the budget scaled with it, and kept, with its
pieces, at smaller batches (:attr:`Plan.reference_batch`), so that the call's number of
operations does not change with the batch; a budget given in bytes, or None, lets each
layer use what the pass itself holds (faster, more memory), choosing on its own batch.

A budget below the smallest feasible one (one sample, the leanest strategies)
raises a ``ValueError`` naming it. Activation recomputation for single samples too
large to keep (huge images) is :class:`memconv.streaming.StreamingCNN`'s job.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._checks import (
    AVAILABLE,
    check_budget,
    check_clip_route,
    check_layer_input,
    check_route,
    check_task,
    check_tensor,
)
from .._torch import storage_ptr, tree_flatten
from ..conv.settings import activate, use_block_settings
from ..layers import RuleSettings, find_rule, own_trainable, using
from ..layers.dispatch import rule_memory
from ..reversible import InvertibleModuleWrapper
from ..reversible.recompute import frozen_buffers
from .probes import call_axes, keep_rng, recording_calls
from .recorder import paused
from .request import Request
from .resources import resolve_budget

logger = logging.getLogger("memconv")

#: The smallest per-layer budget a plan gives a layer's temporaries (bytes).
MIN_LAYER_BUDGET = 64 * 1024


def pass_layer_budget(prof: Profile, m: int) -> int:
    """The per-layer budget of a pass of ``m`` samples that its memory does not limit:
    the largest output and input gradient of a parametrised layer (bytes), which the
    backward pass holds anyway. A layer's route then holds no more than the pass
    itself does at some point (the call's peak stays near the non-private pass's), and
    the budget grows with the micro-batch, so the number of chunks a route splits a
    layer into does not depend on the batch size."""
    largest = max((layer.grad_bytes(m) for layer in prof.layers if layer.params), default=0)
    return max(int(2 * largest), MIN_LAYER_BUDGET)


#: The lean target of a call planned against ``memory_budget="available"`` (the
#: default): its predicted peak within this factor of the non-private step's
#: (:func:`non_private_peak`).
LEAN_FACTOR = 1.05
#: The per-layer budgets the lean plan tries: the pass's own halved at most this many
#: times (a per-layer budget that shrinks with the pass's, so that the number of pieces
#: a route splits a layer into does not grow with the batch).
LEAN_HALVINGS = 6
#: The batch on which the lean plan chooses how many times to halve the per-layer
#: budget (:func:`lean_layer_budget`), and each layer its route and pieces, kept at
#: smaller batches (:attr:`Plan.reference_batch`).
LEAN_REFERENCE_BATCH = 256
#: Where no halving reaches the lean target, the fewest halvings whose predicted peak is
#: within this factor of the least.
LEAN_TOLERANCE = 1.01


def non_private_peak(prof: Profile, m: int) -> int:
    """Predicted peak bytes of the non-private step on ``m`` samples: one forward and one
    backward pass of autograd, the parameters' gradients included (the terms of
    :func:`predict` without a route's temporaries, what is kept, or a result)."""
    a0, a1 = prof.activations
    activations = a0 + a1 * m
    r0, r1 = prof.recompute
    backward = max(
        (
            c0 + c1 * m + r0 + r1 * m + layer.grad_bytes(m) + layer.params * layer.itemsize
            for layer in prof.layers
            for c0, c1 in (layer.saved,)
        ),
        default=0.0,
    )
    forward = activations + max(
        [m * prof.output]
        + [
            m * leaf.output_elements * leaf.itemsize + leaf.params * leaf.itemsize
            for leaf in prof.layers
        ]
    )
    return int(max(forward, backward) + prof.param_bytes)


def lean_target(prof: Profile, m: int, task: str = "clip") -> int:
    """The lean target of a pass of ``m`` samples (bytes): :data:`LEAN_FACTOR` times
    :func:`non_private_peak`, plus, for per-sample gradients (``task="grads"``), their
    result (``m`` times the parameters' bytes), which no route choice changes."""
    result = m * prof.param_bytes if task == "grads" else 0
    return int(LEAN_FACTOR * non_private_peak(prof, m)) + result


def lean_layer_budget(prof: Profile, request: Request, m: int) -> int:
    """The per-layer budget of the default plan's pass of ``m`` samples: the pass's own
    (:func:`pass_layer_budget`) halved k times, k the fewest (0 to
    :data:`LEAN_HALVINGS`) whose predicted peak is within :func:`lean_target`, so that
    each layer takes the fastest route that keeps the step's peak at the non-private
    step's. Where no k is (what the call keeps, not a route's temporaries, passes the
    target), the fewest whose peak is within :data:`LEAN_TOLERANCE` of the least of
    them: more halvings would split layers into more pieces for little. Per-sample
    gradients (``task="grads"``) keep the pass's own: their result, which no route
    changes, dwarfs the routes' temporaries, and small budgets would split their layers
    at small batches.

    A halving that would leave a layer less than :data:`COMFORTABLE_LAYER_BUDGET` on the
    reference batch is not tried (small layers, whose memory matters little, stay whole).
    k is chosen on a pass of :data:`LEAN_REFERENCE_BATCH` samples (or ``m``, if more),
    where what grows with the batch decides: the same k at every batch size. On a
    smaller batch the budget is the reference's scaled to ``m`` samples (``budget·m /
    reference``, the floor :data:`MIN_LAYER_BUDGET` applied on the reference only), so
    that each layer, choosing its route and pieces on the reference batch
    (:attr:`Plan.reference_batch`), takes the same at every batch size: the call's
    number of operations does not grow with the batch."""
    if request.task == "grads":
        return pass_layer_budget(prof, m)
    ref = max(m, LEAN_REFERENCE_BATCH)
    at = replace(request, n=ref)
    own = pass_layer_budget(prof, ref)
    target = lean_target(prof, ref, request.task)
    peaks, chosen = [], None
    for k in range(LEAN_HALVINGS + 1):
        if k and own >> k < COMFORTABLE_LAYER_BUDGET:  # tiny pieces run slow: no further
            break
        peak = predict(prof, at, m=ref, layer_budget=max(own >> k, MIN_LAYER_BUDGET))[0]
        if peak <= target:
            chosen = k
            break
        peaks.append(peak)
    if chosen is None:  # none within the target: the first whose peak is the least
        least = min(peaks)
        chosen = next(k for k, peak in enumerate(peaks) if peak <= least * LEAN_TOLERANCE)
    budget = max(own >> chosen, MIN_LAYER_BUDGET)
    return budget if m >= ref else max(-(-budget * m // ref), 1)


@dataclass(frozen=True)
class LayerProfile:
    """One leaf layer's forward call, per sample.

    Attributes:
        name: its name in the model.
        module: the layer.
        input_elements: elements of its input for one sample.
        output_elements: elements of its output for one sample.
        input_shape: its input's shape for one sample (batch axis first, of size 1).
        itemsize: bytes per element of its output.
        saved: bytes of activations saved up to the end of its forward pass,
            ``(a₀, a₁)`` for ``a₀ + a₁·m``.
        params: elements of its own trainable parameters (0 for most leaves).
    """

    name: str
    module: nn.Module
    input_elements: int
    output_elements: int
    input_shape: tuple[int, ...]
    itemsize: int
    saved: tuple[float, float]
    params: int

    def grad_bytes(self, m: int) -> int:
        """Its output gradient and input gradient for ``m`` samples."""
        return m * (self.input_elements + self.output_elements) * self.itemsize


@dataclass(frozen=True)
class Profile:
    """Per-sample sizes of a model's forward pass (see the module docstring).

    Attributes:
        activations: ``(a₀, a₁)``: saved-tensor bytes are ``a₀ + a₁·m`` for m samples.
        output: bytes of the model's output per sample.
        layers: the leaf layers' calls, in forward order.
        params: trainable parameter elements (shared ones once).
        param_bytes: their bytes.
        owner_calls: the calls of the parametrised modules in the passes of one and
            of two samples (:func:`memconv.engine.probes.recording_calls`), from which
            :meth:`axes` reads their batch axes.
        recompute: ``(r₀, r₁)``: the largest reversible block's recomputation saves
            ``r₀ + r₁·m`` bytes (zeros without reversible blocks).
    """

    activations: tuple[float, float]
    output: int
    layers: list[LayerProfile]
    params: int
    param_bytes: int
    owner_calls: tuple = ((), ())
    recompute: tuple[float, float] = (0.0, 0.0)

    def axes(self) -> list:
        """The batch axes of the parametrised calls (:func:`memconv.engine.probes.call_axes`).

        Raises:
            RuntimeError: the two probes called different layers.
        """
        return call_axes(*self.owner_calls)

    def reached_by_ops(self) -> frozenset:
        """Ids of the trainable parameters that reach operations with a rule
        (:mod:`memconv.layers.operations`), directly or through parameter-only computations."""
        return frozenset().union(*(c.reached for c in self.owner_calls[0] if c.reached is not None))


def _fit(one: float, two: float) -> tuple[float, float]:
    return (max(2 * one - two, 0.0), max(two - one, 0.0))


def profile(model: nn.Module, example: Tensor) -> Profile:
    """Probe forward passes of one and two samples of ``example``.

    Args:
        model: the model.
        example: inputs ``[N ≥ 1, ...]`` (the first sample is used, repeated).

    Returns:
        The :class:`Profile`.
    """
    param_storages = {storage_ptr(p) for p in model.parameters()}
    leaves = [mod for mod in model.modules() if not list(mod.children()) or own_trainable(mod)]
    runs, owner_calls = [], []
    blocks = {m: None for m in model.modules() if isinstance(m, InvertibleModuleWrapper)}
    for m in (1, 2):
        x = example[:1].expand(m, *example.shape[1:]).clone()
        with (
            recording_calls(model) as calls,
            _block_inputs(blocks),
            _checked_inputs(model, tuple(example.shape)),
        ):
            runs.append(_probe(model, x, leaves, param_storages))
        owner_calls.append(calls)
    one, two = runs
    names = {mod: n for n, mod in model.named_modules()}
    layers = [
        LayerProfile(
            name=names.get(a.module, type(a.module).__name__),
            module=a.module,
            input_elements=a.input_elements,
            output_elements=a.output_elements,
            input_shape=a.input_shape,
            itemsize=a.itemsize,
            saved=_fit(a.saved, b.saved),
            params=sum(p.numel() for p in own_trainable(a.module).values()),
        )
        for a, b in zip(one.calls, two.calls)
    ]
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    return Profile(
        activations=_fit(one.saved, two.saved),
        output=one.output,
        layers=layers,
        params=sum(p.numel() for p in params.values()),
        param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        owner_calls=tuple(owner_calls),
        recompute=_recomputation(blocks, param_storages),
    )


@contextlib.contextmanager
def _checked_inputs(model: nn.Module, inputs: tuple):
    """Check, before each call of a layer whose rule fixes its input's axes
    (:meth:`memconv.layers.LayerRule.input_axes`), that its input has them: a batch
    ``inputs`` (its shape) without its channel axis raises here, naming the argument,
    not deep inside a later layer that takes the probe's one sample for an unbatched one.

    Raises:
        ValueError: :func:`memconv._checks.check_layer_input`.
    """
    handles = []
    for name, module in model.named_modules():
        rule = find_rule(module)
        axes = rule.input_axes(module) if rule is not None else None
        if axes is None:
            continue

        def pre_hook(mod, args, name=name, axes=axes):
            first = next((a for a in args if isinstance(a, Tensor)), None)
            if first is not None:
                layer = f"{name or '(model)'!r} ({type(mod).__name__})"
                check_layer_input(tuple(first.shape), axes, layer=layer, inputs=inputs)

        handles.append(module.register_forward_pre_hook(pre_hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _block_inputs(blocks: dict):
    """Record, into ``blocks`` ``{reversible block: None}``, the shape of one sample of
    each tensor argument of each block's first forward call in the block."""

    def pre_hook(module, args):
        if blocks[module] is None:
            blocks[module] = [(a.shape[1:], a.dtype, a.device) for a in args]

    handles = [b.register_forward_pre_hook(pre_hook) for b in blocks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _recomputation(blocks: dict, param_storages: set) -> tuple[float, float]:
    """``(r₀, r₁)`` of the block whose recomputation saves the most for m samples
    (``r₀ + r₁·m`` bytes): each block run with a graph on zeros of its inputs' shapes,
    for one and two samples, its buffers and the random generators left as they were."""
    best = (0.0, 0.0)
    for block, inputs in blocks.items():
        if not inputs or not all(isinstance(t, tuple) and len(t) == 3 for t in inputs):
            continue
        saved = []
        for m in (1, 2):
            xs = [
                torch.zeros((m, *shape), dtype=dtype, device=device, requires_grad=True)
                for shape, dtype, device in inputs
            ]
            seen: dict[int, int] = {}

            def pack(t, seen=seen):
                ptr = storage_ptr(t)
                if ptr not in param_storages:
                    seen[ptr] = t.untyped_storage().nbytes()
                return t.detach()

            with (
                torch.enable_grad(),
                keep_rng(),
                frozen_buffers(block),
                activate(None, False),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            ):
                block._fn(*xs)
            saved.append(sum(seen.values()))
        fit = _fit(*saved)
        if fit[0] + 2 * fit[1] > best[0] + 2 * best[1]:
            best = fit
    return best


class _LeafCall(NamedTuple):
    """One call of a leaf layer in a probe pass: elements of its input and output per
    sample, its input's shape (one sample), bytes per element, and the bytes autograd
    had saved when it returned."""

    module: nn.Module
    input_elements: int
    output_elements: int
    input_shape: tuple
    itemsize: int
    saved: int


class _ProbePass(NamedTuple):
    """One probe forward pass: bytes saved for the backward pass, output bytes per
    sample, and the leaf calls."""

    saved: int
    output: int
    calls: list


def _probe(model, x, leaves, param_storages) -> _ProbePass:
    """One forward pass: saved bytes, output bytes per sample, and the leaf calls."""
    m = len(x)
    seen: dict[int, int] = {}
    calls: list = []

    def pack(t):
        with paused():
            ptr = storage_ptr(t)
            if ptr not in param_storages and ptr not in seen:
                seen[ptr] = t.untyped_storage().nbytes()
            return t.detach()  # not t itself: an output saved by its own node would form a cycle

    def hook(module, args, kwargs, output):
        with paused():
            record(module, args, kwargs, output)

    def record(module, args, kwargs, output):
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)), None)
        out = next((t for t in tree_flatten(output)[0] if isinstance(t, Tensor)), None)
        if first is None or out is None or not first.dim() or not out.dim():
            return
        leaf = _LeafCall(
            module=module,
            input_elements=first[0].numel(),
            output_elements=out[0].numel(),
            input_shape=(1, *first.shape[1:]),
            itemsize=out.element_size(),
            saved=sum(seen.values()),
        )
        calls.append(leaf)

    handles = [leaf.register_forward_hook(hook, with_kwargs=True) for leaf in leaves]
    try:
        with (
            torch.enable_grad(),
            keep_rng(),
            activate(None, False),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = model(x)
    finally:
        for h in handles:
            h.remove()
    return _ProbePass(
        saved=sum(seen.values()), output=out.numel() * out.element_size() // m, calls=calls
    )


@dataclass(frozen=True)
class Plan:
    """How a whole call runs, and its predicted peak memory increase.

    Attributes:
        task: ``"grads"``, ``"norms"`` or ``"clip"``.
        batch: N.
        micro_batch: samples per forward/backward pass.
        layer_budget: bytes each layer's weight VJP or norm computation may use: the
            pass's own (:func:`pass_layer_budget`) unless the memory budget demands
            less (None: no limit, a plan made without a profile).
        predicted_peak: bytes, the whole call's peak memory increase.
        memory_budget: the budget the plan was made for (bytes), or None.
        breakdown: bytes of the peak's parts: ``"activations"``, ``"backward"``
            (gradients and temporaries at the peak layer), ``"result"``, ``"kept"``.
        clip_route: for ``"clip"``, the clipping route.
        smallest_budget: the smallest budget this call can run in (one sample, the
            leanest per-layer budget), bytes.
        generic_layers: names of the parametrised layers without a rule whose
            parameters do not all reach operations with a rule
            (:mod:`memconv.layers.operations`): they take the generic route (``torch.func``;
            :mod:`memconv.layers`), or the model route for a parameter used in a
            parent's ``forward``.
        lean_target: for a plan made against ``memory_budget="available"`` (the
            default) in one pass, the peak its per-layer budget keeps within
            (:func:`lean_target`: the non-private step's predicted peak times
            :data:`LEAN_FACTOR`), bytes; None for other plans.
        reference_batch: the batch on which each layer chooses its route and pieces
            (the per-layer budget scaled with it) and keeps them on this plan's
            smaller passes: :data:`LEAN_REFERENCE_BATCH` for the default plan of
            norms or clipping on fewer samples (:func:`lean_layer_budget`), so that its
            layers run in as many operations at every batch size; None: each layer
            chooses on its own pass.
    """

    task: str
    batch: int
    micro_batch: int
    layer_budget: int | None
    predicted_peak: int
    memory_budget: int | None = None
    breakdown: dict = field(default_factory=dict)
    clip_route: str | None = None
    smallest_budget: int | None = None
    generic_layers: tuple[str, ...] = ()
    lean_target: int | None = None
    reference_batch: int | None = None

    def walk_key(self) -> tuple:
        """The plan's choices a walk reads: the batch, the micro-batch, the per-layer
        budget, the clipping route, the reference batch and the generic layers. Two
        plans with the same key walk a batch alike (what else a plan holds, its
        prediction and the budget it was made for, is read by no walk), so a traced
        step is kept by this key (:meth:`memconv.engine.prepared.Prepared.step_key`)."""
        return (
            self.batch,
            self.micro_batch,
            self.layer_budget,
            self.clip_route,
            self.reference_batch,
            self.generic_layers,
        )

    @property
    def micro_batches(self) -> int:
        """Number of forward/backward passes."""
        return -(-self.batch // self.micro_batch) if self.batch else 0

    def __str__(self) -> str:
        mib = 2**20
        parts = ", ".join(f"{k} {v / mib:,.1f} MiB" for k, v in self.breakdown.items())
        budget = "none" if self.memory_budget is None else f"{self.memory_budget / mib:,.1f} MiB"
        layer = "none" if self.layer_budget is None else f"{self.layer_budget / mib:,.2f} MiB"
        route = f", {self.clip_route}" if self.clip_route else ""
        generic = (
            f"; generic route: {', '.join(self.generic_layers)}" if self.generic_layers else ""
        )
        return (
            f"{self.task}{route}: {self.micro_batches} micro-batch(es) of {self.micro_batch} "
            f"(N={self.batch}), layer budget {layer}; predicted peak "
            f"{self.predicted_peak / mib:,.1f} MiB ({parts}); memory_budget {budget}{generic}"
        )


def _layer_temporaries(
    layer: LayerProfile,
    request: Request,
    *,
    m: int,
    kind: str,
    budget,
    by_ops=frozenset(),
    reference: int | None = None,
):
    """Bytes of a parametrised layer's temporaries for m samples within ``budget``: its
    rule's memory model (``kind``: ``"grads"`` or ``"norms"``), or the generic route's
    (per-sample gradients, their squares, and a chunk's activations re-run by
    ``torch.func``). A layer without a rule whose parameters all reach operations with
    a rule (``by_ops``: :meth:`Profile.reached_by_ops`; a weight-standardised
    convolution) takes those operations' routes, which work within ``budget``."""
    rule = find_rule(layer.module)
    shape = (m, *layer.input_shape[1:])
    if rule is None:
        per_sample = m * layer.params * layer.itemsize
        generic = (
            2 * per_sample + 4 * m * (layer.input_elements + layer.output_elements) * layer.itemsize
        )
        covered = by_ops and all(id(p) in by_ops for p in own_trainable(layer.module).values())
        return min(generic, budget) if covered and budget is not None else generic
    settings = RuleSettings(request.settings, request.norm_route, budget, reference=reference)
    with using(settings):
        where = f"layer {layer.name!r}"
        return rule_memory(rule, layer.module, (shape,), layer.itemsize, kind, where=where)


def predict(
    prof: Profile,
    request: Request,
    *,
    m: int,
    layer_budget: int | None,
    reference: int | None = None,
):
    """Predicted peak bytes of ``request`` on its N samples in micro-batches of m, each
    layer's temporaries within ``layer_budget`` (its route and pieces chosen on a
    ``reference`` batch, :attr:`Plan.reference_batch`, if given).

    Returns:
        ``(peak, breakdown)``, see :class:`Plan`.
    """
    n, task, clip_route = request.n, request.task, request.clip_route
    a0, a1 = prof.activations
    activations = a0 + a1 * m
    if task == "grads":  # preallocated, filled micro-batch by micro-batch
        result = n * prof.param_bytes
    elif task == "norms":
        result = n * 4
    elif clip_route == "two-pass" and m < n:  # the running total and a pass's gradients
        result = 2 * prof.param_bytes
    else:  # the clipped sums, adopted as .grad
        result = prof.param_bytes
    two_pass = task == "clip" and clip_route == "two-pass"
    keeping = task == "clip" and clip_route == "book-keeping"
    backward, kept = 0.0, 0.0
    r0, r1 = prof.recompute
    recompute = r0 + r1 * m  # a reversible block's, at any layer: an upper bound
    by_ops = prof.reached_by_ops()
    for layer in reversed(prof.layers):
        c0, c1 = layer.saved
        alive = activations if two_pass else c0 + c1 * m  # freed as the pass goes back
        alive += recompute
        # the node: its gradients and the backend's copy of the weight (oneDNN reorders it)
        weight = layer.params * layer.itemsize
        backward = max(backward, alive + layer.grad_bytes(m) + kept + weight)
        if layer.params:  # the route, before the node (after it, if it keeps a result)
            kept_grads = keeping and m * layer.params < layer.input_elements + layer.output_elements
            # book-keeping instantiates these
            kind = "grads" if kept_grads or task == "grads" else "norms"
            temp = _layer_temporaries(
                layer,
                request,
                m=m,
                kind=kind,
                budget=layer_budget,
                by_ops=by_ops,
                reference=reference,
            )
            backward = max(backward, alive + layer.grad_bytes(m) + temp + kept)
            if keeping:
                io = m * (layer.input_elements + layer.output_elements) * layer.itemsize
                kept += min(m * layer.params * layer.itemsize, io)
    forward = activations + max(
        [m * prof.output]
        + [
            m * leaf.output_elements * leaf.itemsize + leaf.params * leaf.itemsize
            for leaf in prof.layers
        ]
    )
    peak = max(forward, backward) + result
    if keeping and m < n:  # adding a micro-batch's clipped sums to the running total
        largest = max((layer.params * layer.itemsize for layer in prof.layers), default=0)
        peak = max(peak, result + kept + 3 * largest)
    breakdown = {"activations": int(activations), "backward": int(backward), "result": int(result)}
    if kept:
        breakdown["kept"] = int(kept)
    if recompute:
        breakdown["recompute"] = int(recompute)
    return int(peak), breakdown


def make_plan(prof: Profile, request: Request, *, budget: int | None) -> Plan:
    """The plan of ``request`` on a profiled model within ``budget`` (bytes, resolved;
    None: one pass), see :func:`plan`.

    Raises:
        ValueError: if even one sample with the leanest per-layer budget does not fit
            ``budget`` (the message names the smallest feasible budget).
    """
    n, task = request.n, request.task
    route = request.clip_route or ("book-keeping" if task == "clip" else None)
    fixed = task != "clip" or request.clip_route
    candidates = (
        [request.routed(route)]
        if fixed
        else [
            request.routed("book-keeping"),
            request.routed("two-pass"),
        ]
    )
    # predictions grow with the micro-batch except for the two-pass running total
    smallest = min(
        predict(prof, r, m=m, layer_budget=MIN_LAYER_BUDGET)[0]
        for r in candidates
        for m in {1, max(n, 1)}
    )
    more = {"smallest_budget": smallest, "generic_layers": _generic_layers(prof)}
    if budget is None or n == 0:
        one_pass = request.routed(route)
        m = max(n, 1)
        lean = pass_layer_budget(prof, m)
        return _predicted_plan(prof, one_pass, m=m, layer_budget=lean, budget=budget, **more)
    if request.memory_budget == AVAILABLE:  # the default: lean, if one pass fits
        lean = _lean_plan(prof, request.routed(route), budget=budget, **more)
        if lean.predicted_peak <= budget:
            logger.info("memconv plan: %s", lean)
            return lean
    best = None
    for r in candidates:
        candidate = _best_for_route(prof, r, budget=budget)
        if candidate is not None and (best is None or candidate.micro_batch > best.micro_batch):
            best = candidate
    if best is None:
        _raise_too_small(prof, request, budget=budget, smallest=smallest)
    best = replace(best, **more)
    logger.info("memconv plan: %s", best)
    return best


def _lean_plan(prof: Profile, request: Request, *, budget: int, **more) -> Plan:
    """The default plan's one pass over the whole batch, each layer within
    :func:`lean_layer_budget`; for norms or clipping on fewer than
    :data:`LEAN_REFERENCE_BATCH` samples, each layer's route and pieces chosen on that
    batch (:attr:`Plan.reference_batch`) — unless a whole sample's pieces, where the
    reference's are fractions of the batch, take the peak past the lean target where
    choosing on the batch itself does not: then the latter."""
    n = request.n
    layer_budget = lean_layer_budget(prof, request, n)
    target = lean_target(prof, n, request.task)
    fields = dict(m=n, layer_budget=layer_budget, budget=budget, lean_target=target, **more)
    if request.task == "grads" or n >= LEAN_REFERENCE_BATCH:
        return _predicted_plan(prof, request, **fields)
    kept = _predicted_plan(prof, request, reference=LEAN_REFERENCE_BATCH, **fields)
    if kept.predicted_peak <= target:
        return kept
    own = _predicted_plan(prof, request, **fields)
    return own if own.predicted_peak < kept.predicted_peak else kept


def _generic_layers(prof: Profile) -> tuple[str, ...]:
    """Names of the parametrised layers without a rule whose parameters do not all reach
    operations with a rule (see :attr:`Plan.generic_layers`)."""
    by_ops = prof.reached_by_ops()
    return tuple(
        dict.fromkeys(
            layer.name or "(model)"
            for layer in prof.layers
            if layer.params
            and find_rule(layer.module) is None
            and not all(id(p) in by_ops for p in own_trainable(layer.module).values())
        )
    )


def _raise_too_small(prof: Profile, request: Request, *, budget: int, smallest: int):
    """The ``ValueError`` of a budget no plan fits, naming what would."""
    n, mib = request.n, 2**20
    if request.task == "grads" and prof.param_bytes:
        # the per-sample result alone grows with N: name the largest batch that fits
        rest = smallest - n * prof.param_bytes
        largest = max(int((budget - rest) // prof.param_bytes), 0)
        if 0 < largest < n:  # (not even one sample: the message below)
            raise ValueError(
                f"memory_budget={budget} bytes ({budget / mib:,.1f} MiB) cannot hold the "
                f"per-sample gradients of N={n} samples ({n * prof.param_bytes / mib:,.1f} "
                f"MiB of result besides the pass itself); the largest batch that fits is "
                f"{largest}. Split the batch, or use per_sample_norms/clip_and_accumulate, "
                "which do not keep per-sample gradients."
            )
    raise ValueError(
        f"memory_budget={budget} bytes ({budget / mib:,.1f} MiB) is below what this model "
        f"needs for one sample; the smallest feasible budget is about {smallest} bytes "
        f"({smallest / mib:,.1f} MiB). For images too large for one sample's activations, "
        "stream the convolutions with memconv.streaming.StreamingCNN."
    )


#: A micro-batch is halved rather than leave its layers less than this (bytes): tiny
#: per-layer budgets mean tiny chunks and tiles, which are slow.
COMFORTABLE_LAYER_BUDGET = 4 * 2**20


def _best_for_route(prof: Profile, request: Request, *, budget: int) -> Plan | None:
    """One pass with the pass's own per-layer budget (:func:`pass_layer_budget`) if that
    fits (the budget then changes nothing: the call runs as without one); else the
    largest micro-batch that fits with a comfortable per-layer budget (or, if none
    does, the largest that fits at all), with the largest per-layer budget up to its
    pass's own. None if not even one sample fits."""
    n = request.n

    def fits(m, layer_budget):
        return predict(prof, request, m=m, layer_budget=layer_budget)[0] <= budget

    lean = pass_layer_budget(prof, n)
    one_pass = _predicted_plan(prof, request, m=n, layer_budget=lean, budget=budget)
    if one_pass.predicted_peak <= budget:
        return one_pass

    def largest(layer_budget):  # predictions grow with m: a bisection
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid, layer_budget):
                lo = mid
            else:
                hi = mid - 1
        return lo

    if fits(n, COMFORTABLE_LAYER_BUDGET):
        m = n
    else:
        m = largest(COMFORTABLE_LAYER_BUDGET) or largest(MIN_LAYER_BUDGET)
        if m == 0 and fits(n, MIN_LAYER_BUDGET):
            m = n
    if m == 0:
        return None
    # the largest per-layer budget that still fits (halving from the pass's own)
    layer_budget = min(budget, pass_layer_budget(prof, m))
    while layer_budget > MIN_LAYER_BUDGET and not fits(m, layer_budget):
        layer_budget //= 2
    layer_budget = max(layer_budget, MIN_LAYER_BUDGET)
    return _predicted_plan(prof, request, m=m, layer_budget=layer_budget, budget=budget)


def _predicted_plan(
    prof: Profile,
    request: Request,
    *,
    m: int,
    layer_budget: int | None,
    budget,
    reference: int | None = None,
    **more,
) -> Plan:
    """The plan of micro-batches of ``m`` samples with ``layer_budget`` (each layer's
    route chosen on ``reference`` samples, if given), its peak and breakdown predicted
    (:func:`predict`); ``more``: the plan's other fields."""
    peak, parts = predict(prof, request, m=m, layer_budget=layer_budget, reference=reference)
    return Plan(
        task=request.task,
        batch=request.n,
        micro_batch=m,
        layer_budget=layer_budget,
        predicted_peak=peak,
        memory_budget=budget,
        breakdown=parts,
        clip_route=request.clip_route if request.task == "clip" else None,
        reference_batch=reference,
        **more,
    )


def plan(
    model: nn.Module,
    inputs: Tensor,
    *,
    task: str = "grads",
    memory_budget: int | str | None = AVAILABLE,
    strategy: str | bool | None = None,
    clip_route: str | None = None,
    norm_route: str | None = None,
) -> Plan:
    """How a whole call would run within ``memory_budget``, and its predicted peak.

    Args:
        model: the model.
        inputs: the batch ``[N, ...]`` the call will get (only the first sample is
            run, on one and two samples, to profile the forward pass).
        task: ``"grads"`` (:func:`memconv.per_sample_grads`), ``"norms"``
            (:func:`memconv.per_sample_norms`) or ``"clip"``
            (:func:`memconv.clip_and_accumulate`).
        memory_budget: bytes the whole call's peak memory increase may reach, result
            included; ``"available"`` (the default): lean — one pass whose per-layer
            budget keeps the predicted peak within :func:`lean_target` (the
            non-private step's times :data:`LEAN_FACTOR`; :func:`lean_layer_budget`),
            if that fits what the process can still use
            (:func:`memconv.engine.resources.default_budget`: free device memory, or the
            host's available memory within its container limit, less headroom), else
            micro-batches within it; None: no limit (one pass over the whole batch, each
            layer up to the pass's own budget, :func:`pass_layer_budget`: faster, more
            memory). A budget in bytes takes the pass's own per-layer budget where that
            fits, and trades memory for speed so.
        strategy: as in :func:`memconv.per_sample_grads`.
        clip_route: for ``"clip"``: ``"book-keeping"``, ``"two-pass"`` or None (the
            one that fits with the largest micro-batch).
        norm_route: as in :func:`memconv.per_sample_norms` (``"ghost"``,
            ``"instantiate"`` or None).

    Returns:
        The :class:`Plan`.

    Raises:
        TypeError, ValueError: a bad ``task``, ``memory_budget`` or ``inputs``; a budget
            below the smallest feasible one (named in the message).
    """
    check_task(task)
    check_budget(memory_budget)
    check_route(norm_route)
    check_clip_route(clip_route)
    check_tensor(inputs, "inputs")
    settings = use_block_settings(strategy)
    budget = resolve_budget(memory_budget, inputs.device)
    n = len(inputs)
    if n == 0:
        return Plan(
            task=task,
            batch=0,
            micro_batch=1,
            layer_budget=None,
            predicted_peak=0,
            memory_budget=budget,
            breakdown={},
        )
    routes = dict(norm_route=norm_route, clip_route=clip_route)
    request = Request(task, n, settings, memory_budget, caller="memconv.plan", **routes)
    return make_plan(profile(model, inputs), request, budget=budget)
