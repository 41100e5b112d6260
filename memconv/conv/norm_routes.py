"""Per-sample gradient norms of one layer, with or without its per-sample gradients.

For a convolution (or transposed convolution) with output gradient ``g`` and input
``x``, the per-sample weight gradient of group ``γ`` is ``G_n,γ = Σ_t b_t a_tᵀ``
(``a_t`` the ``C_in/G·K`` input values output position ``t`` reads, ``b_t`` its
``C_out/G`` output-gradient values), so

    ‖G_n‖² = Σ_γ Σ_{t,t'} (a_t·a_t') (b_t·b_t') = Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩

with T×T Gram matrices per sample and group — never across groups (Goodfellow 2015,
"Efficient per-example gradient computations", and Li et al. 2022 / Bu et al. 2022
for convolutions). Two routes, chosen per layer by their cost models or forced:

- ``"ghost"``: the Gram matrices, tiled so that their memory is bounded, without
  im2col (:mod:`memconv.conv.ghost`: ``A_γᵀA_γ`` as K strided windows of the input's
  Gram matrix over its positions, or as one product per kernel offset). Time ~
  N·G·(C_in/G·S² + C_out/G·T²), memory ~ one block;
- ``"instantiate"``: per-sample gradients of a chunk of samples by a memconv
  strategy, squared and summed. Time ~ the weight VJP's N·C_out·(C_in/G)·K·T, memory
  ~ one chunk's gradients; it wins when 2T² > C_out·C_in·K/G (early layers, large
  images).

Which layer uses which route is its rule's business (:mod:`memconv.layers`; the
convolution rule calls :func:`conv_weight_sq_norms`). Given a reference batch (the
default plan's), the route, tiling and number of chunks are chosen on it and kept at
the layer's batch (:func:`decide_route`), so that a layer issues as many operations
at every batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..strategies import Problem, get_strategy
from ..strategies.auto import AUTO, choose
from ..strategies.base import cost_model, fastest_that_fits, numel
from ..strategies.costs import operations_time, time_coefficients
from ..strategies.geometry import Operands, conv_spec
from . import ghost
from .contract import contract
from .grads import weight_grad
from .settings import DEFAULT_SETTINGS, Settings

#: Per-sample lengths up to which :func:`sq_norms` takes a sample's squared norm as one
#: dot product: the round-off of a dot product of positive terms grows with its length
#: (about ``length/8`` units in the last place at worst with 8 accumulators), which
#: stays below 1e-4 up to here in float32.
DOT_LENGTH = 4096


def sq_norms(t: Tensor) -> Tensor:
    """Squared L2 norm per sample ``[N]`` of ``t`` ``[N, ...]``: one or two tensor
    operations whatever N.

    Up to :data:`DOT_LENGTH` elements per sample, one batched dot product; longer, the
    squares summed by torch.sum, whose pairwise (cascade) summation keeps float32
    round-off near one unit in the last place where a long dot product or
    ``linalg.vector_norm``'s accumulation lose digits. Either way one temporary of
    ``t``'s size at most (the squares, or a contiguous copy), part of the routes'
    memory models. (While a compiled step is traced, the dot product is the squares'
    sum, one reduction kernel: :func:`memconv.conv.contract.contract`.)
    """
    if t.dim() == 1:
        return t.square()
    if math.prod(t.shape[1:]) <= DOT_LENGTH and t.dim() <= 8:
        axes = "abcdefg"[: t.dim() - 1]
        return contract(f"n{axes},n{axes}->n", t, t)
    return t.square().sum(tuple(range(1, t.dim())))


def float32_or_wider(dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or float32 for a half-precision one (``torch.promote_types(dtype,
    torch.float32)`` for floating dtypes, without a tensor operation)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32 or wider (half-precision squares would overflow; an operation
    only where a cast is needed)."""
    dtype = float32_or_wider(t.dtype)
    return t if t.dtype == dtype else t.to(dtype)


def rows_of(t: Tensor, rows: slice, n: int) -> Tensor:
    """``t[rows]``, or ``t`` itself when ``rows`` covers its ``n`` samples (no operation)."""
    return t if rows.start == 0 and rows.stop >= n else t[rows]


def chunked(n: int, chunk: int) -> list[slice]:
    """The rows of ``n`` samples in chunks of ``chunk`` (one slice when it covers them)."""
    return [slice(i, min(n, i + chunk)) for i in range(0, n, max(chunk, 1))] or [slice(0, 0)]


@dataclass(frozen=True)
class RouteCost:
    """A norm route's predicted cost for one layer.

    Attributes:
        route: ``"ghost"`` or ``"instantiate"``.
        memory: extra bytes.
        time: seconds (a model, comparable between routes).
    """

    route: str
    memory: int
    time: float


# ----------------------------------------------------------------- ghost (conv)
def ghost_cost(problem: Problem, budget: int) -> RouteCost:
    """Cost of the ghost route for a convolution (:func:`memconv.conv.ghost.choose_tiling`)."""
    chosen = ghost.choose_tiling(problem, budget)
    return RouteCost(route="ghost", memory=chosen.memory, time=chosen.time)


def ghost_sq_norms(ops: Operands, budget: int | None) -> Tensor:
    """Squared per-sample norms ``[N]`` of a convolution's weight gradient, by Gram
    matrices per group, tiled (:mod:`memconv.conv.ghost`).

    Args:
        ops: the layer's strategy operands.
        budget: bytes for the temporaries (chunk of samples × block of positions);
            None: the whole batch in one piece.
    """
    x = ops.x
    problem = Problem(
        ops.geometry, x.shape[0], tuple(x.shape[2:]), x.element_size(), True, device=x.device.type
    )
    return ghost.sq_norms(ops, ghost.choose_tiling(problem, budget))


# ----------------------------------------------------------------- instantiate (conv)
def _instantiate_settings(settings: Settings, chunk_bytes: int, budget: int | None) -> Settings:
    """The strategy settings the instantiating route runs: a strategy reading a
    ``memory_budget`` shares the budget with the chunk's gradients (None: no budget)."""
    strategy = get_strategy(settings.strategy)
    if budget is None:
        return settings
    if "memory_budget" in strategy.options and settings.options.memory_budget is None:
        left = max(budget - chunk_bytes, 1)
        return Settings(settings.strategy, replace(settings.options, memory_budget=left))
    return settings


def instantiate_chunk(n: int, per: int, budget: int | None) -> int:
    """Samples whose per-sample gradients (``per`` bytes each) and their squares fit
    ``budget`` (all ``n`` without one)."""
    if budget is None:
        return max(n, 1)
    return max(1, min(n, budget // 2 // max(per, 1)))


def _instantiate_run(problem: Problem, budget: int | None, settings: Settings):
    """``(a chunk's problem, bytes of its per-sample gradients, the settings its VJP
    runs)`` of the instantiating route."""
    per = numel(problem.geom.weight_shape) * problem.itemsize
    chunk = instantiate_chunk(problem.n, per, budget)
    sub = replace(problem, n=chunk, per_sample=True, into=False)
    return sub, per, _instantiate_settings(settings, chunk * per, budget)


def instantiate_strategy(
    problem: Problem, budget: int | None, settings: Settings = DEFAULT_SETTINGS
) -> str:
    """The name of the elementary strategy the instantiating route runs on a chunk of
    the batch within ``budget`` (``"auto"``'s choice, where ``settings`` ask for it:
    ``"loop"`` where the device's prices favour it)."""
    sub, _, run = _instantiate_run(problem, budget, settings)
    strategy = get_strategy(run.strategy)
    if strategy.name == AUTO.name:
        return choose(sub, run.options)[0].name
    return strategy.name


def instantiate_cost(problem: Problem, budget: int | None, settings: Settings = DEFAULT_SETTINGS):
    """Cost of instantiating a chunk of per-sample gradients at a time, by the strategy
    of ``settings`` (the one :func:`instantiate_sq_norms` runs)."""
    sub, per, run = _instantiate_run(problem, budget, settings)
    chunk = sub.n
    strategy = get_strategy(run.strategy)
    memory = chunk * per + max(strategy.memory(sub, run.options), chunk * per)  # + squares
    chunks = -(-problem.n // chunk)
    # the chunks' VJPs and squares (and, when split, each chunk's slices and the join)
    time = chunks * (strategy.time(sub, run.options) + squares_time(sub))
    if chunks > 1:
        time += operations_time(2 * chunks + 1, problem.device)
    return RouteCost(route="instantiate", memory=memory, time=time)


def squares_time(problem: Problem) -> float:
    """Seconds of :func:`sq_norms` on a problem's per-sample gradients: per element
    (``"instantiate"``'s ``per_square``) and per operation."""
    (per_square,) = time_coefficients("instantiate", problem.device)
    ops = 1 if numel(problem.geom.weight_shape) <= DOT_LENGTH else 2
    return per_square * problem.per_sample_elements() + operations_time(ops, problem.device)


def instantiate_sq_norms(ops: Operands, settings: Settings, budget: int | None) -> Tensor:
    """Squared per-sample norms ``[N]`` from per-sample gradients, a chunk at a time
    (the whole batch when it fits ``budget``, or without one).

    Args:
        ops: the layer's strategy operands.
        settings: the strategy that computes the per-sample gradients.
        budget: bytes for a chunk's gradients and the strategy's temporaries.
    """
    per = numel(ops.geometry.weight_shape) * ops.x.element_size()
    chunk = instantiate_chunk(ops.x.shape[0], per, budget)
    return _instantiated(ops, _instantiate_settings(settings, chunk * per, budget), chunk)


def _instantiated(ops: Operands, settings: Settings, chunk: int) -> Tensor:
    """Squared per-sample norms ``[N]`` from the per-sample gradients of ``chunk``
    samples at a time, by the strategy of ``settings``."""
    n = ops.x.shape[0]
    if chunk >= n:
        return sq_norms(weight_grad(ops, settings, per_sample=True))
    out = []
    for rows in chunked(n, chunk):
        part = Operands(ops.x[rows], ops.g[rows], ops.geometry)
        grads = weight_grad(part, settings, per_sample=True)
        out.append(sq_norms(grads))
        del grads
    return torch.cat(out)


def route_costs(
    problem: Problem, budget: int | None, settings: Settings = DEFAULT_SETTINGS
) -> tuple[RouteCost, RouteCost]:
    """Both routes' costs for a convolution (``budget``: bytes, or None: no limit)."""
    return _route_costs(problem, budget, settings)


@cost_model
def _route_costs(problem: Problem, budget: int, settings: Settings):
    return ghost_cost(problem, budget), instantiate_cost(problem, budget, settings)


def choose_route(
    problem: Problem,
    budget: int | None,
    settings: Settings = DEFAULT_SETTINGS,
    route: str | None = None,
) -> RouteCost:
    """The route that runs: ``route`` if forced, else the fastest within the budget
    (the leanest if neither fits; :func:`memconv.strategies.base.fastest_that_fits`)."""
    costs = route_costs(problem, budget, settings)
    if route is not None:
        return next(c for c in costs if c.route == route)
    return fastest_that_fits(costs, budget)[0]


def at_reference(problem: Problem, budget: int | None, reference: int | None):
    """``(problem, budget)`` on which a layer's route, method and pieces are chosen: with
    a ``reference`` batch larger than the problem's N, that batch and the budget scaled
    with it (``budget·reference/N``); else the problem and budget themselves.

    A plan whose per-layer budget grows in proportion to its batch (the default lean
    plan, :func:`memconv.engine.planning.lean_layer_budget`) chooses so on its reference
    batch and keeps the choice at every smaller batch (:func:`kept_chunk`): a route's
    memory grows with its chunk of samples, so what fits the reference's budget fits
    the batch's, and the layer runs in the same route and number of pieces (the same
    number of tensor operations) at every batch size, where choosing at N would let the
    per-operation prices of a small batch, and the rounding of its chunks to whole
    samples, pick other routes."""
    n = problem.n
    if reference is None or n >= reference or n < 1:
        return problem, budget
    scaled = None if budget is None else budget * reference // n
    return replace(problem, n=reference), scaled


def kept_chunk(chunk: int, reference: int, n: int) -> int:
    """Samples per chunk that split ``n`` samples into as many pieces as chunks of
    ``chunk`` split ``reference`` samples (at most ``n`` pieces: one sample each)."""
    pieces = -(-reference // max(chunk, 1))
    return max(1, -(-n // pieces))


@dataclass(frozen=True)
class RouteDecision:
    """How a convolution's per-sample norms run (:func:`decide_route`).

    Attributes:
        route: ``"ghost"`` or ``"instantiate"``.
        memory: predicted extra bytes at the layer's batch.
        tiling: for ``"ghost"``, the Gram matrices' method, chunk and tiling.
        chunk: for ``"instantiate"``, samples per chunk.
        settings: for ``"instantiate"``, the strategy run on each chunk.
    """

    route: str
    memory: int
    tiling: ghost.GhostTiling | None = None
    chunk: int = 0
    settings: Settings = DEFAULT_SETTINGS


def decide_route(
    problem: Problem,
    budget: int | None,
    settings: Settings = DEFAULT_SETTINGS,
    route: str | None = None,
    reference: int | None = None,
) -> RouteDecision:
    """The route, and its pieces, that run a convolution's norms: :func:`choose_route`'s
    on ``problem`` within ``budget`` bytes (None: no limit), or, with a ``reference``
    batch larger than N, on that batch and the budget scaled with it
    (:func:`at_reference`), kept at N: as many chunks (at most N), the same Gram tiling,
    and, for ``"instantiate"`` with ``"auto"``, the strategy ``"auto"`` picks for the
    reference's chunk (its budget scaled to N's chunk)."""
    at, room = at_reference(problem, budget, reference)
    n, ref = problem.n, at.n
    chosen = choose_route(at, room, settings, route)
    if chosen.route == "ghost":
        tiling = ghost.choose_tiling(at, room)
        if at is not problem:  # the reference's tiling, its chunk kept (memory ∝ chunk)
            chunk = kept_chunk(tiling.chunk, ref, n)
            memory = -(-tiling.memory * chunk // tiling.chunk)
            tiling = replace(tiling, chunk=chunk, memory=memory)
        return RouteDecision(route="ghost", memory=tiling.memory, tiling=tiling)
    per = numel(problem.geom.weight_shape) * problem.itemsize
    chunk = instantiate_chunk(ref, per, room)
    run = _instantiate_settings(settings, chunk * per, room)
    if at is problem:
        return RouteDecision(route=chosen.route, memory=chosen.memory, chunk=chunk, settings=run)
    kept = kept_chunk(chunk, ref, n)
    if run.strategy == AUTO.name:  # "auto"'s pick for the reference's chunk
        strategy, sub, _, _ = choose(replace(at, n=chunk, per_sample=True, into=False), run.options)
        run = Settings(strategy.name, sub)
    derived = settings.options.memory_budget is None  # (a budget given stays as it is)
    if derived and run.options.memory_budget is not None:  # scaled to N's chunk
        scaled = -(-run.options.memory_budget * kept // chunk)
        run = Settings(run.strategy, replace(run.options, memory_budget=scaled))
    sub = replace(problem, n=kept, per_sample=True, into=False)
    vjp = get_strategy(run.strategy).memory(sub, run.options)
    memory = kept * per + max(vjp, kept * per)
    return RouteDecision(route=chosen.route, memory=memory, chunk=kept, settings=run)


def conv_route_problem(module, x: Tensor, g: Tensor, itemsize: int) -> tuple[Problem, int]:
    """``(the routes' problem, bytes of the copy that brings the input to normal
    form)`` for a convolution's input and output gradient (meta tensors will do)."""
    ops = conv_spec(module).operands(x, g)
    problem = Problem(ops.geometry, x.shape[0], tuple(ops.x.shape[2:]), itemsize, True)
    return problem, ops.copied * itemsize


# ----------------------------------------------------------------- per layer
def conv_weight_sq_norms(
    module,
    x: Tensor,
    g: Tensor,
    settings: Settings,
    route: str | None,
    budget: int | None,
    reference: int | None = None,
) -> Tensor:
    """Squared per-sample norms ``[N]`` of a convolution's weight gradient.

    Args:
        module: ``Conv*d`` or ``ConvTranspose*d``.
        x: its input; cast to ``g``'s dtype when they differ (autocast).
        g: its output gradient.
        settings: the strategy of the instantiating route.
        route: ``"ghost"``, ``"instantiate"`` or None (the cost models choose).
        budget: bytes for the route's temporaries, the copy that brings the input to
            normal form (reflect padding, a transposed convolution) included (None: no
            limit, the whole batch in one piece).
        reference: the batch on which the route and its pieces are chosen, the budget
            scaled with it (:func:`decide_route`); None: on N.
    """
    if x.dtype != g.dtype:
        x = x.to(g.dtype)
    ops = conv_spec(module).operands(x, g)
    problem = Problem(
        ops.geometry,
        x.shape[0],
        tuple(ops.x.shape[2:]),
        x.element_size(),
        True,
        device=x.device.type,
    )
    # a budget covers the copy that brought the input to normal form; the route gets
    # what is left of it
    room = None if budget is None else max(budget - ops.copied * x.element_size(), 1)
    if reference is None:
        chosen = choose_route(problem, room, settings, route).route
        if chosen == "ghost":
            return ghost_sq_norms(ops, room)
        return instantiate_sq_norms(ops, settings, room)
    decision = decide_route(problem, room, settings, route, reference)
    if decision.route == "ghost":
        return ghost.sq_norms(ops, decision.tiling)
    return _instantiated(ops, decision.settings, decision.chunk)


# ----------------------------------------------------------------- per channel
def grad_channel_stats(grads: Tensor, w_hat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(‖g_c‖², ⟨g_c,1⟩, ⟨g_c,ŵ_c⟩)``, each ``[n, C]``, of per-sample gradients
    ``grads`` ``[n, C, ...]`` split along their first axis (``w_hat``: ``[C, K]``):
    what a weight standardised per output channel needs of its operation's weight
    gradients (:mod:`memconv.layers.standardise`)."""
    g = grads.reshape(grads.shape[0], w_hat.shape[0], -1)
    if g.dtype != w_hat.dtype:
        g = g.to(w_hat.dtype)
    return g.square().sum(-1), g.sum(-1), contract("nck,ck->nc", g, w_hat)


_CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def conv_channel_stats(
    module,
    x: Tensor,
    g: Tensor,
    w_hat: Tensor,
    settings: Settings,
    route: str | None,
    budget: int | None,
    reference: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`grad_channel_stats` of a convolution's per-sample weight gradients
    ``G_n``, per output channel ``c``, by the route :func:`choose_route` picks for
    its norms.

    ``"instantiate"``: ``G_n`` a chunk of samples at a time. ``"ghost"``, without
    ``G_n``: ``‖G_n,c‖²`` by the Gram blocks per channel (:func:`memconv.conv.ghost.sq_norms`
    with ``channels``), ``⟨G_n,c, ŵ_c⟩ = Σ_t b_c[t]·conv(x_n, ŵ)[c, t]`` (one forward
    convolution) and ``⟨G_n,c, 1⟩ = Σ_t b_c[t]·box_γ(x_n)[t]``, ``box_γ`` the input
    channels of ``c``'s group summed and filtered by a kernel of ones. Each runs the
    whole batch in a few operations, in chunks only where ``budget`` demands it.

    Args:
        module: a convolution (not transposed; zero padding).
        x: its input ``[N, C_in, *S]``.
        g: its output gradient ``[N, C_out, *T]``.
        w_hat: ``[C_out, C_in/G·k]``.
        settings, route, budget, reference: as :func:`conv_weight_sq_norms`.
    """
    if x.dtype != g.dtype:
        x = x.to(g.dtype)
    ops = conv_spec(module).operands(x, g)
    problem = Problem(
        geom=ops.geometry,
        n=x.shape[0],
        size=tuple(ops.x.shape[2:]),
        itemsize=x.element_size(),
        per_sample=True,
        device=x.device.type,
    )
    room = None if budget is None else max(budget - ops.copied * x.element_size(), 1)
    n = x.shape[0]
    decision = decide_route(problem, room, settings, route, reference)
    if decision.route != "ghost":
        chunk, run = decision.chunk, decision.settings
        parts = []
        for rows in chunked(n, chunk):
            part = Operands(rows_of(ops.x, rows, n), rows_of(ops.g, rows, n), ops.geometry)
            parts.append(grad_channel_stats(weight_grad(part, run, per_sample=True), w_hat))
        return _joined(parts)
    sq = ghost.sq_norms(ops, decision.tiling, channels=True)
    conv = _CONV_FUNCTIONS[x.dim() - 2]
    geom = ops.geometry
    kernel = w_hat.reshape(module.weight.shape)
    if kernel.dtype != x.dtype:
        kernel = kernel.to(x.dtype)
    box = x.new_ones(geom.groups, 1, *module.weight.shape[2:])
    geometry = {"stride": module.stride, "padding": module.padding, "dilation": module.dilation}
    per = 2 * math.prod(g.shape[1:]) * g.element_size()  # the convolution's output and a product
    at, scaled = at_reference(problem, room, reference)
    chunk = at.n if scaled is None else max(1, min(at.n, scaled // max(per, 1)))
    chunk = chunk if at is problem else kept_chunk(chunk, at.n, n)
    parts = []
    for rows in chunked(n, chunk):
        xs, gs = rows_of(x, rows, n), rows_of(g, rows, n)
        m = xs.shape[0]
        y = conv(xs, kernel, None, groups=geom.groups, **geometry)
        hats = contract("nc...,nc...->nc", y, gs)
        del y
        summed = xs.reshape(m, geom.groups, -1, *xs.shape[2:]).sum(2)
        filtered = conv(summed, box, None, groups=geom.groups, **geometry).flatten(2)
        grouped = gs.reshape(m, geom.groups, geom.out_per_group, -1)
        ones = contract("ngot,ngt->ngo", grouped, filtered).flatten(1)
        parts.append((ones, hats))
    ones, hats = _joined(parts)
    return tuple(v if v.dtype == w_hat.dtype else v.to(w_hat.dtype) for v in (sq, ones, hats))


def _joined(parts: list[tuple]) -> tuple:
    """Per-chunk tuples of tensors joined along the samples (the one chunk's as it is)."""
    if len(parts) == 1:
        return tuple(parts[0])
    return tuple(torch.cat(p) for p in zip(*parts))
