"""``"auto"``: per layer, the fastest registered strategy whose memory fits a budget.

Every other registered strategy is a candidate: each predicts its extra memory
(bytes) and its run time (seconds) from the layer's sizes and the device's
calibration (:mod:`memconv.strategies.costs`), and ``"auto"`` runs the one predicted
fastest among those within ``memory_budget`` (any, without a budget) that do the
layer in one piece; only when none of those fits, the fastest of those that split it
(``"shift"``'s chunks of the batch, ``"streaming"``'s tiles:
:func:`memconv.strategies.base.pieces`), whose operations repeat per piece.
``"streaming"`` chooses its tile to fit the budget, so it is what runs when no
whole-layer strategy fits; when not even its smallest tile fits, a warning says so
and the leanest candidate runs. The choice is logged on the ``memconv`` logger at
DEBUG level.

A strategy whose number of operations grows with N (``"loop"``, one sample at a
time: :func:`memconv.strategies.base.batched` is False) is a candidate too, priced
with the device's per-operation cost times that number and ranked against the others
by :func:`memconv.strategies.base.ranked_time` (a near tie goes to the batched
route; while a compiled step is traced, :func:`memconv.strategies.base.unrolled`, it
is not a candidate where a batched strategy does the layer in one piece within the
budget: the trace would unroll its loop into N copies of its operations): on a CPU
(some 5 µs an operation) it is taken where its arithmetic is cheaper by more than
that — large maps and few channels, where torch's own kernel beats every batched
route — and on a GPU, whose calibration prices an operation at a kernel launch (11 µs
on an H200) and the arithmetic far lower, the batched routes win, which keeps a GPU
step's number of operations flat in the batch. The device is priced, not named.
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
    ranked_time,
    register_strategy,
    strategy_names,
    unrolled,
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
    for name in strategy_names():  # every other one, "loop" included: it is priced
        if name != Auto.name:
            strategy = get_strategy(name)
            sub = _candidate_options(strategy, options)
            memory, time = strategy.memory(problem, sub), strategy.time(problem, sub)
            candidates.append((strategy, sub, memory, time, pieces(strategy, problem, sub)))
    # split only where memory demands it: where a batched candidate does the layer in
    # one piece within the budget, the split ones are not considered (a piece repeats
    # its operations, so their number would grow with N); a candidate that loops over
    # the samples competes by its price (ranked_time) with either pool, except in a
    # traced step (unrolled()), whose graph would hold N copies of its operations
    whole = [c for c in candidates if c[4] == 1 and batched(c[0])]
    if any(budget is None or c[2] <= budget for c in whole):
        pool = whole + ([] if unrolled() else [c for c in candidates if not batched(c[0])])
    else:
        pool = candidates
    (strategy, sub, memory, *_), fits = fastest_that_fits(
        pool, budget, memory=lambda c: c[2], time=lambda c: ranked_time(c[0], c[3])
    )
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
