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
convolution rule calls :func:`conv_weight_sq_norms`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..strategies import Problem, get_strategy
from ..strategies.base import cost_model, fastest_that_fits, numel
from ..strategies.costs import time_coefficients
from ..strategies.geometry import Operands, conv_spec
from . import ghost
from .grads import weight_grad
from .settings import DEFAULT_SETTINGS, Settings

#: Bytes a route may use for its temporaries when no budget is given.
DEFAULT_NORM_BUDGET = 32 * 2**20


#: Bytes of squares :func:`sq_norms` holds at once (or one sample's, if larger).
SQUARES_BYTES = 2**20


def sq_norms(t: Tensor) -> Tensor:
    """Squared L2 norm per sample ``[N]`` of ``t`` ``[N, ...]``.

    The squares are summed a slice of samples at a time (torch.sum's pairwise
    summation: float32 round-off, where ``linalg.vector_norm``'s accumulation loses
    two more digits), so they never take more than :data:`SQUARES_BYTES` or one
    sample's bytes: a copy of ``t`` is not part of the routes' memory.
    """
    if t.dim() == 1:
        return t.square()
    dims = tuple(range(1, t.dim()))
    n = t.shape[0]
    step = max(1, SQUARES_BYTES // max(t[:1].numel() * t.element_size(), 1))
    if step >= n:
        return t.square().sum(dims)
    return torch.cat([t[i : i + step].square().sum(dims) for i in range(0, n, step)])


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


def ghost_sq_norms(ops: Operands, budget: int) -> Tensor:
    """Squared per-sample norms ``[N]`` of a convolution's weight gradient, by Gram
    matrices per group, tiled (:mod:`memconv.conv.ghost`).

    Args:
        ops: the layer's strategy operands.
        budget: bytes for the temporaries (chunk of samples × block of positions).
    """
    x = ops.x
    problem = Problem(
        ops.geometry, x.shape[0], tuple(x.shape[2:]), x.element_size(), True, device=x.device.type
    )
    return ghost.sq_norms(ops, ghost.choose_tiling(problem, budget))


# ----------------------------------------------------------------- instantiate (conv)
def _instantiate_settings(settings: Settings, chunk_bytes: int, budget: int) -> Settings:
    """The strategy settings the instantiating route runs: a strategy reading a
    ``memory_budget`` shares the budget with the chunk's gradients."""
    strategy = get_strategy(settings.strategy)
    if "memory_budget" in strategy.options and settings.options.memory_budget is None:
        left = max(budget - chunk_bytes, 1)
        return Settings(settings.strategy, replace(settings.options, memory_budget=left))
    return settings


def instantiate_cost(problem: Problem, budget: int, settings: Settings = DEFAULT_SETTINGS):
    """Cost of instantiating a chunk of per-sample gradients at a time, by the strategy
    of ``settings`` (the one :func:`instantiate_sq_norms` runs)."""
    per = numel(problem.geom.weight_shape) * problem.itemsize
    chunk = max(1, min(problem.n, budget // 2 // max(per, 1)))
    sub = replace(problem, n=chunk, per_sample=True, into=False)
    run = _instantiate_settings(settings, chunk * per, budget)
    strategy = get_strategy(run.strategy)
    squares = min(chunk * per, max(SQUARES_BYTES, per))  # sq_norms' slice of squares
    memory = chunk * per + max(strategy.memory(sub, run.options), squares)
    # the squares of the per-sample gradients: seconds per element
    (per_square,) = time_coefficients("instantiate", problem.device)
    time = strategy.time(problem, run.options) + per_square * problem.per_sample_elements()
    return RouteCost(route="instantiate", memory=memory, time=time)


def instantiate_sq_norms(ops: Operands, settings: Settings, budget: int) -> Tensor:
    """Squared per-sample norms ``[N]`` from per-sample gradients, a chunk at a time.

    Args:
        ops: the layer's strategy operands.
        settings: the strategy that computes the per-sample gradients.
        budget: bytes for a chunk's gradients and the strategy's temporaries.
    """
    per = numel(ops.geometry.weight_shape) * ops.x.element_size()
    n = ops.x.shape[0]
    chunk = max(1, min(n, budget // 2 // max(per, 1)))
    settings = _instantiate_settings(settings, chunk * per, budget)
    out = []
    for n0 in range(0, n, chunk):
        part = Operands(ops.x[n0 : n0 + chunk], ops.g[n0 : n0 + chunk], ops.geometry)
        grads = weight_grad(part, settings, per_sample=True)
        out.append(sq_norms(grads))
        del grads
    return torch.cat(out)


def route_costs(
    problem: Problem, budget: int | None, settings: Settings = DEFAULT_SETTINGS
) -> tuple[RouteCost, RouteCost]:
    """Both routes' costs for a convolution (``budget``: bytes, or the default)."""
    return _route_costs(problem, budget or DEFAULT_NORM_BUDGET, settings)


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


def conv_route_problem(module, x: Tensor, g: Tensor, itemsize: int) -> tuple[Problem, int]:
    """``(the routes' problem, bytes of the copy that brings the input to normal
    form)`` for a convolution's input and output gradient (meta tensors will do)."""
    ops = conv_spec(module).operands(x, g)
    problem = Problem(ops.geometry, x.shape[0], tuple(ops.x.shape[2:]), itemsize, True)
    return problem, ops.copied * itemsize


# ----------------------------------------------------------------- per layer
def conv_weight_sq_norms(
    module, x: Tensor, g: Tensor, settings: Settings, route: str | None, budget: int | None
) -> Tensor:
    """Squared per-sample norms ``[N]`` of a convolution's weight gradient.

    Args:
        module: ``Conv*d`` or ``ConvTranspose*d``.
        x: its input; cast to ``g``'s dtype when they differ (autocast).
        g: its output gradient.
        settings: the strategy of the instantiating route.
        route: ``"ghost"``, ``"instantiate"`` or None (the cost models choose).
        budget: bytes for the route's temporaries, the copy that brings the input to
            normal form (reflect padding, a transposed convolution) included (None:
            :data:`DEFAULT_NORM_BUDGET` for the route, the copy besides).
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
    chosen = choose_route(problem, room, settings, route).route
    if chosen == "ghost":
        return ghost_sq_norms(ops, room or DEFAULT_NORM_BUDGET)
    return instantiate_sq_norms(ops, settings, room or DEFAULT_NORM_BUDGET)


# ----------------------------------------------------------------- per channel
def grad_channel_stats(grads: Tensor, w_hat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(‖g_c‖², ⟨g_c,1⟩, ⟨g_c,ŵ_c⟩)``, each ``[n, C]``, of per-sample gradients
    ``grads`` ``[n, C, ...]`` split along their first axis (``w_hat``: ``[C, K]``):
    what a weight standardised per output channel needs of its operation's weight
    gradients (:mod:`memconv.layers.standardise`)."""
    g = grads.reshape(grads.shape[0], w_hat.shape[0], -1).to(w_hat.dtype)
    return g.square().sum(-1), g.sum(-1), torch.einsum("nck,ck->nc", g, w_hat)


_CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def conv_channel_stats(
    module,
    x: Tensor,
    g: Tensor,
    w_hat: Tensor,
    settings: Settings,
    route: str | None,
    budget: int | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`grad_channel_stats` of a convolution's per-sample weight gradients
    ``G_n``, per output channel ``c``, by the route :func:`choose_route` picks for
    its norms.

    ``"instantiate"``: ``G_n`` a chunk of samples at a time. ``"ghost"``, without
    ``G_n``: ``‖G_n,c‖²`` by the Gram blocks per channel (:func:`memconv.conv.ghost.sq_norms`
    with ``channels``), ``⟨G_n,c, ŵ_c⟩ = Σ_t b_c[t]·conv(x_n, ŵ)[c, t]`` (one forward
    convolution) and ``⟨G_n,c, 1⟩ = Σ_t b_c[t]·box_γ(x_n)[t]``, ``box_γ`` the input
    channels of ``c``'s group summed and filtered by a kernel of ones.

    Args:
        module: a convolution (not transposed; zero padding).
        x: its input ``[N, C_in, *S]``.
        g: its output gradient ``[N, C_out, *T]``.
        w_hat: ``[C_out, C_in/G·k]``.
        settings, route, budget: as :func:`conv_weight_sq_norms`.
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
    room_or_default = room or DEFAULT_NORM_BUDGET
    if choose_route(problem, room, settings, route).route != "ghost":
        per = numel(ops.geometry.weight_shape) * x.element_size()
        n = x.shape[0]
        chunk = max(1, min(n, room_or_default // 2 // max(per, 1)))
        run = _instantiate_settings(settings, chunk * per, room_or_default)
        parts = []
        for n0 in range(0, n, chunk):
            part = Operands(ops.x[n0 : n0 + chunk], ops.g[n0 : n0 + chunk], ops.geometry)
            parts.append(grad_channel_stats(weight_grad(part, run, per_sample=True), w_hat))
        return tuple(torch.cat(p) for p in zip(*parts))
    sq = ghost.sq_norms(ops, ghost.choose_tiling(problem, room_or_default), channels=True)
    conv = _CONV_FUNCTIONS[x.dim() - 2]
    geom = ops.geometry
    kernel = w_hat.to(x.dtype).reshape(module.weight.shape)
    box = x.new_ones(geom.groups, 1, *module.weight.shape[2:])
    geometry = {"stride": module.stride, "padding": module.padding, "dilation": module.dilation}
    n = x.shape[0]
    per = 2 * g[:1].numel() * g.element_size()  # the convolution's output and a product
    chunk = max(1, min(n, room_or_default // max(per, 1)))
    ones, hats = [], []
    for n0 in range(0, n, chunk):
        xs, gs = x[n0 : n0 + chunk], g[n0 : n0 + chunk]
        m = xs.shape[0]
        y = conv(xs, kernel, None, groups=geom.groups, **geometry)
        hats.append((y.mul_(gs)).flatten(2).sum(-1))
        del y
        summed = xs.reshape(m, geom.groups, -1, *xs.shape[2:]).sum(2)
        filtered = conv(summed, box, None, groups=geom.groups, **geometry).flatten(2)
        grouped = gs.reshape(m, geom.groups, geom.out_per_group, -1)
        ones.append((grouped * filtered[:, :, None]).sum(-1).flatten(1))
    return sq.to(w_hat.dtype), torch.cat(ones).to(w_hat.dtype), torch.cat(hats).to(w_hat.dtype)
