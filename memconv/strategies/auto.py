"""``"auto"``: per layer, the fastest registered strategy whose memory fits a budget.

Every other registered strategy whose number of tensor operations does not grow
with N is a candidate (a strategy that loops over samples, ``"loop"``, is not:
:func:`memconv.strategies.base.batched`): each predicts its extra memory (bytes) and
its run time (seconds, a per-operation term included) from the layer's sizes, and
``"auto"`` runs the one predicted fastest among those within ``memory_budget`` (any,
without a budget) that do the layer in one piece; only when none of those fits, the
fastest of those that split it (``"shift"``'s chunks of the batch, ``"streaming"``'s
tiles: :func:`memconv.strategies.base.pieces`), whose operations repeat per piece. ``"streaming"`` chooses its tile to fit the budget, so it is what runs
when no whole-layer strategy fits; when not even its smallest tile fits, a
warning says so and the leanest candidate runs. The choice is logged on the
``memconv`` logger at DEBUG level.
"""

from __future__ import annotations

import logging
import warnings
from typing import ClassVar

from torch import Tensor

from .base import (
    NO_OPTIONS,
    Options,
    Problem,
    batched,
    cost_model,
    fastest_that_fits,
    get_strategy,
    pieces,
    register_strategy,
    strategy_names,
)

logger = logging.getLogger("memconv")


def _candidate_options(strategy, options: Options) -> Options:
    if "memory_budget" in strategy.options and options.memory_budget is not None:
        return Options(memory_budget=options.memory_budget)
    return NO_OPTIONS


@cost_model
def choose(problem: Problem, options: Options):
    """The strategy ``"auto"`` runs for this VJP.

    Args:
        problem: the layer's sizes.
        options: ``memory_budget`` (bytes or None) is read.

    Returns:
        ``(strategy, its options, its predicted extra bytes, fits)``; ``fits`` is
        False when no candidate fits the budget (the leanest is returned then).
    """
    budget = options.memory_budget
    candidates = []  # (strategy, options, bytes, time, pieces)
    for name in strategy_names():
        strategy = get_strategy(name)
        if name != Auto.name and batched(strategy):
            sub = _candidate_options(strategy, options)
            memory, time = strategy.memory(problem, sub), strategy.time(problem, sub)
            candidates.append((strategy, sub, memory, time, pieces(strategy, problem, sub)))
    # split only where memory demands it: the candidates that do the layer in one
    # piece first (a piece repeats its operations, whose number then grows with N)
    whole = [c for c in candidates if c[4] == 1]
    for pool in (whole, candidates) if whole else (candidates,):
        (strategy, sub, memory, *_), fits = fastest_that_fits(
            pool, budget, memory=lambda c: c[2], time=lambda c: c[3]
        )
        if fits:  # (else, after the last pool, the leanest of all)
            break
    return strategy, sub, memory, fits


class Auto:
    """Weight VJP by the fastest strategy whose predicted memory fits the budget."""

    name: ClassVar[str] = "auto"
    options: ClassVar[frozenset[str]] = frozenset({"memory_budget"})
    composite: ClassVar[bool] = True

    def vjp(self, x, g, geom, *, per_sample, options, out=None, contiguous=False) -> Tensor:
        """The weight VJP by the strategy :func:`choose` picks; ``contiguous``: the
        caller keeps the per-sample result in the weight's layout
        (:attr:`Problem.contiguous`), so a strategy returning another layout is
        priced with the copy that makes it."""
        problem = Problem(
            geom,
            x.shape[0],
            tuple(x.shape[2:]),
            x.element_size(),
            per_sample,
            device=x.device.type,
            contiguous=contiguous and out is None,
        )
        strategy, sub, memory, fits = choose(problem, options)
        if not fits:
            warnings.warn(
                f"memconv auto: memory_budget={options.memory_budget} bytes is below the "
                f"extra memory of every strategy for a layer {geom} with N={problem.n} and "
                f"input size {problem.size}; running the leanest, {strategy.name!r} "
                f"({memory} bytes). Raise memory_budget or reduce the batch.",
                stacklevel=2,
            )
        logger.debug(
            "auto: %r for N=%d, input size %s, %s (predicted %d bytes extra)",
            strategy.name,
            problem.n,
            problem.size,
            geom,
            memory,
        )
        return strategy.vjp(x, g, geom, per_sample=per_sample, options=sub, out=out)

    def memory(self, problem: Problem, options: Options) -> int:
        return choose(problem, options)[2]

    def time(self, problem: Problem, options: Options) -> float:
        strategy, sub, _, _ = choose(problem, options)
        return strategy.time(problem, sub)


AUTO = register_strategy(Auto())
