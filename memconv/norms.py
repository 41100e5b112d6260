"""Per-sample gradient norms of one layer, with or without its per-sample gradients.

For a convolution (or transposed convolution) with output gradient ``g`` and input
``x``, the per-sample weight gradient of group ``γ`` is ``G_n,γ = Σ_t b_t a_tᵀ``
(``a_t`` the ``C_in/G·K`` input values output position ``t`` reads, ``b_t`` its
``C_out/G`` output-gradient values), so

    ‖G_n‖² = Σ_γ Σ_{t,t'} (a_t·a_t') (b_t·b_t') = Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩

with T×T Gram matrices per sample and group — never across groups (Goodfellow 2015,
"Efficient per-example gradient computations", and Li et al. 2022 / Bu et al. 2022
for convolutions). Two routes, chosen per layer by their cost models or forced:

- ``"ghost"``: the Gram matrices, tiled over blocks of positions so that their
  memory is bounded (``A_γᵀA_γ = Σ_κ X_κᵀX_κ``, one product per kernel offset on the
  shifted input of :func:`memconv.strategies.shift.offset_operands`: no im2col).
  Time ~ N·G·T²·(C_in/G·K + C_out/G), memory ~ one block;
- ``"instantiate"``: per-sample gradients of a chunk of samples by a memconv
  strategy, squared and summed. Time ~ the weight VJP's N·C_out·(C_in/G)·K·T, memory
  ~ one chunk's gradients; it wins when 2T² > C_out·C_in·K/G (early layers, large
  images).

Which layer uses which route is its rule's business (:mod:`memconv.layers`; the
convolution rule calls :func:`conv_weight_sq_norms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ._geometry import Operands, conv_spec
from .context import DEFAULT_SETTINGS, Settings
from .grad_sample import weight_grad
from .strategies import Problem, get_strategy
from .strategies.base import cost_model, fastest_that_fits, linear_time, numel, padded_size
from .strategies.shift import flat_ok, flat_rows, offset_operands

ROUTES = ("ghost", "instantiate")
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


def check_route(route, argument: str = "norm_route") -> None:
    """Raise unless ``route`` is None or one of :data:`ROUTES`.

    Raises:
        ValueError: naming the accepted routes.
    """
    if route is not None and route not in ROUTES:
        raise ValueError(f"unknown {argument} {route!r}; accepted: {', '.join(ROUTES)} or None")


# ----------------------------------------------------------------- ghost (conv)
def _ghost_length(problem: Problem) -> int:
    """Positions per sample the Gram matrices span (the padded grid's rows at stride 1)."""
    if flat_ok(problem.geom):
        p = padded_size(problem.geom, problem.size)
        return problem.output_size[0] * numel(p[1:])
    return problem.positions


def _ghost_halo(problem: Problem) -> int:
    """At stride 1: how far past a block of positions the input Gram matrix reaches
    (the largest kernel offset's shift in the flat padded plane); else 0."""
    geom = problem.geom
    if not flat_ok(geom):
        return 0
    p = padded_size(geom, problem.size)
    return sum(
        (k - 1) * d * numel(p[i + 1 :])
        for i, (k, d) in enumerate(zip(geom.kernel_size, geom.dilation))
    )


def _ghost_operands(problem: Problem) -> int:
    """Elements one sample's operands take: at stride 1 the flat padded input and the
    output gradient on its grid; else the padded input and one offset's copied view."""
    geom = problem.geom
    padded = geom.in_channels * numel(padded_size(geom, problem.size))
    if flat_ok(geom):
        return padded + geom.out_channels * _ghost_length(problem)
    return (padded if any(geom.padding) else 0) + geom.in_channels * problem.positions


def _ghost_block(problem: Problem, block: int) -> int:
    """Elements of one sample's temporaries for a pair of blocks: the output-gradient
    Gram block and the input one (at stride 1: the input Gram over the block and its
    halo, and the sum of its shifted windows; else the sum over offsets and one
    offset's part)."""
    halo = _ghost_halo(problem)
    if flat_ok(problem.geom):
        return problem.geom.groups * ((block + halo) ** 2 + 2 * block * block)
    return problem.geom.groups * 3 * block * block


def _ghost_plan(problem: Problem, budget: int) -> tuple[int, int]:
    """``(samples per chunk, positions per block)`` within ``budget`` bytes: whole Gram
    matrices for as many samples as fit, else one sample at a time in blocks."""
    itemsize = problem.itemsize
    length = _ghost_length(problem)
    operands = _ghost_operands(problem)
    whole = (operands + _ghost_block(problem, length)) * itemsize
    if whole <= budget:
        return max(1, min(problem.n, budget // whole)), length
    left = budget // itemsize - operands
    block = length
    while block > 1 and _ghost_block(problem, block) > left:
        block = (block + 1) // 2
    return 1, block


def ghost_cost(problem: Problem, budget: int) -> RouteCost:
    """Cost of the ghost route for a convolution."""
    geom, n = problem.geom, problem.n
    chunk, block = _ghost_plan(problem, budget)
    length = _ghost_length(problem)
    halo = _ghost_halo(problem)
    blocks = math.ceil(length / block)
    pairs = blocks * (blocks + 1) // 2  # the Gram matrices are symmetric
    memory = chunk * (_ghost_operands(problem) + _ghost_block(problem, block))
    chunks = math.ceil(n / chunk)
    if flat_ok(geom):  # one input Gram block per pair, then K shifted windows summed
        side = block + halo
        flops = n * geom.groups * pairs * (geom.in_per_group * side * side)
        flops += n * geom.groups * pairs * geom.out_per_group * block * block
        traffic = n * geom.groups * pairs * (side * side + (geom.kernel_numel + 3) * block**2)
        calls = chunks * pairs * (geom.kernel_numel + 6)
    else:  # per pair, each offset's view copied and its Gram block added
        flops = n * geom.groups * pairs * block * block * geom.in_per_group * geom.kernel_numel
        flops += n * geom.groups * pairs * block * block * geom.out_per_group
        traffic = n * pairs * geom.kernel_numel * geom.in_channels * block * 2
        traffic += n * geom.groups * pairs * (2 * geom.kernel_numel + 3) * block**2
        calls = chunks * pairs * (3 * geom.kernel_numel + 6)
    time = linear_time(GHOST_TIME, flops, traffic, calls)
    return RouteCost("ghost", memory * problem.itemsize, time)


#: Seconds per multiply-add, per element moved and per tensor operation of the ghost
#: route (fitted as :data:`memconv.strategies.loop.TIME` is, to 50 layer shapes).
GHOST_TIME = (1.12e-11, 5.2e-11, 1.0e-5)


def ghost_sq_norms(ops: Operands, budget: int) -> Tensor:
    """Squared per-sample norms ``[N]`` of a convolution's weight gradient, by Gram
    matrices per group, tiled (see the module docstring).

    At stride 1 the input's Gram matrix over positions is formed once per block,
    ``M = PᵀP`` on the flat padded plane P, and ``A_γᵀA_γ`` is the sum of its K
    windows shifted along the diagonal by each kernel offset: K times fewer
    multiply-adds than one product per offset (an output position of a window
    always lies inside the plane, so the windows are cut at its end).

    Args:
        ops: the layer's strategy operands.
        budget: bytes for the temporaries (chunk of samples × block of positions).
    """
    x, g, geom = ops.x, ops.g, ops.geometry
    n = x.shape[0]
    problem = Problem(geom, n, tuple(x.shape[2:]), x.element_size(), True)
    chunk, block = _ghost_plan(problem, budget)
    gram = _flat_gram if flat_ok(geom) else _offsets_gram
    out = x.new_zeros(n)
    for n0 in range(0, n, chunk):
        rows = slice(n0, n0 + chunk)
        out[rows] = gram(x[rows], g[rows], geom, block)
    return out


def _flat_gram(x: Tensor, g: Tensor, geom, block: int) -> Tensor:
    """Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩ per sample at stride 1, by shifted windows of PᵀP."""
    flat = flat_rows(x, g, geom)
    gm, planes = flat.gm, flat.planes  # [n, G, C_out/G, L], [n, G, C_in/G, P]
    length, plane = gm.shape[-1], planes.shape[-1]
    halo = max(flat.bases)
    out = x.new_zeros(x.shape[0])
    for i0 in range(0, length, block):
        i1 = min(length, i0 + block)
        for j0 in range(i0, length, block):
            j1 = min(length, j0 + block)
            gb = gm[..., i0:i1].transpose(-1, -2) @ gm[..., j0:j1]  # [n, G, bi, bj]
            r1, c1 = min(plane, i1 + halo), min(plane, j1 + halo)
            m = planes[..., i0:r1].transpose(-1, -2) @ planes[..., j0:c1]
            ga = torch.zeros_like(gb)
            for base in flat.bases:
                rows, cols = min(i1 - i0, r1 - i0 - base), min(j1 - j0, c1 - j0 - base)
                if rows > 0 and cols > 0:
                    ga[..., :rows, :cols] += m[..., base : base + rows, base : base + cols]
            del m
            weight = 1.0 if i0 == j0 else 2.0  # the block below the diagonal
            out += weight * ga.mul_(gb).sum((1, 2, 3))
            del ga, gb
    return out


def _offsets_gram(x: Tensor, g: Tensor, geom, block: int) -> Tensor:
    """Σ_γ ⟨A_γᵀA_γ, B_γᵀB_γ⟩ per sample, one product per kernel offset (any stride)."""
    gm, views = offset_operands(x, g, geom)
    length = gm.shape[-1]  # gm [n, G, C_out/G, L]
    out = x.new_zeros(x.shape[0])
    for i0 in range(0, length, block):
        rows = slice(i0, i0 + block)
        for j0 in range(i0, length, block):
            cols = slice(j0, j0 + block)
            gb = gm[..., rows].transpose(-1, -2) @ gm[..., cols]  # [n, G, bi, bj]
            ga = None
            for view in views():  # view [n, G, C_in/G, L]
                part = view[..., rows].transpose(-1, -2) @ view[..., cols]
                ga = part if ga is None else ga.add_(part)
                del part
            weight = 1.0 if i0 == j0 else 2.0  # the block below the diagonal
            out += weight * ga.mul_(gb).sum((1, 2, 3))
            del ga, gb
    return out


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
    sub = Problem(problem.geom, chunk, problem.size, problem.itemsize, True)
    run = _instantiate_settings(settings, chunk * per, budget)
    strategy = get_strategy(run.strategy)
    squares = min(chunk * per, max(SQUARES_BYTES, per))  # sq_norms' slice of squares
    memory = chunk * per + max(strategy.memory(sub, run.options), squares)
    time = strategy.time(problem, run.options) + 2e-10 * problem.per_sample_elements()
    return RouteCost("instantiate", memory, time)


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
    problem = Problem(ops.geometry, x.shape[0], tuple(ops.x.shape[2:]), x.element_size(), True)
    # a budget covers the copy that brought the input to normal form; the route gets
    # what is left of it
    room = None if budget is None else max(budget - ops.copied * x.element_size(), 1)
    chosen = choose_route(problem, room, settings, route).route
    if chosen == "ghost":
        return ghost_sq_norms(ops, room or DEFAULT_NORM_BUDGET)
    return instantiate_sq_norms(ops, settings, room or DEFAULT_NORM_BUDGET)
