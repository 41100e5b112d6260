"""The strategy protocol, its options, the registry and shared helpers.

A weight-VJP strategy maps the normal-form layer input ``x`` ``[N, C_in, *S]`` and
the output gradient ``g`` ``[N, C_out, *T]`` of a convolution (see
:mod:`memconv.strategies.geometry`) to the weight gradient, per sample
``[N, C_out, C_in/G, *k]`` or summed over the batch ``[C_out, C_in/G, *k]``, and
comes with two cost models: the extra memory its VJP allocates (bytes) and its run
time (relative units, comparable between strategies). Strategies register an
instance with :func:`register_strategy`, in the manner of Opacus'
``register_grad_sampler``; ``"auto"`` and ``"streaming"`` iterate the registry, so a
new strategy is one new module.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import ClassVar, Protocol, runtime_checkable

import torch.nn.functional as F
from torch import Tensor

from .._torch import tracing
from .geometry import ConvGeometry, torch_pad_argument


@dataclass(frozen=True)
class Options:
    """Options a strategy may read; each strategy declares which (``Strategy.options``).

    Attributes:
        memory_budget: bytes of extra memory one weight VJP may use (``"auto"``
            chooses a strategy within it, ``"shift"`` chunks the batch, ``"streaming"``
            chooses its tile); ``None``: the strategy's default.
        tile_size: for ``"streaming"``: output positions per spatial axis of a tile
            (an int or one int per axis); ``None``: chosen from the budget.
        inner: for ``"streaming"``: the strategy run on each tile; ``None``: the
            fastest that fits.
    """

    memory_budget: int | None = None
    tile_size: int | tuple[int, ...] | None = None
    inner: str | None = None

    def given(self) -> tuple[str, ...]:
        """Names of the options that are set (not ``None``)."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)


NO_OPTIONS = Options()


@dataclass(frozen=True)
class Problem:
    """The sizes a cost model needs: one weight VJP of one layer.

    Attributes:
        geom: normal-form geometry.
        n: batch size N.
        size: normal-form input spatial size S (before the symmetric padding).
        itemsize: bytes per element.
        per_sample: per-sample (True) or summed (False) result.
        into: the VJP adds into a given ``out`` (as ``"streaming"`` runs its inner
            strategy); a strategy that first computes its whole result then holds
            it as extra memory.
        device: the device type of the tensors (``"cpu"``, ``"cuda"``, ...): which
            calibration prices the problem (:mod:`memconv.strategies.costs`).
        contiguous: the caller keeps the per-sample result in the weight's layout
            (``[N, C_out, C_in/G, *k]``, contiguous, as a per-sample gradient returned
            to the user is): a strategy that returns it laid out otherwise costs a
            copy of it (:meth:`relayout`).
    """

    geom: ConvGeometry
    n: int
    size: tuple[int, ...]
    itemsize: int
    per_sample: bool
    into: bool = False
    device: str = "cpu"
    contiguous: bool = False

    @property
    def output_size(self) -> tuple[int, ...]:
        """T per spatial axis."""
        return self.geom.output_size(self.size)

    @property
    def positions(self) -> int:
        """Output positions per sample, prod(T)."""
        return numel(self.output_size)

    @property
    def result_elements(self) -> int:
        """Elements of the returned gradient."""
        return numel(self.geom.weight_shape) * (self.n if self.per_sample else 1)

    def held(self) -> int:
        """Bytes of a whole result held before it is added into ``out`` (0 unless
        :attr:`into`)."""
        return self.result_elements * self.itemsize if self.into else 0

    def flops(self) -> int:
        """Multiply-adds of any exact weight VJP: N·C_out·(C_in/G)·K·T."""
        g = self.geom
        return self.n * g.out_channels * g.in_per_group * g.kernel_numel * self.positions

    def input_elements(self) -> int:
        """Elements of the input ``x``."""
        return self.n * self.geom.in_channels * numel(self.size)

    def grad_elements(self) -> int:
        """Elements of the output gradient ``g``."""
        return self.n * self.geom.out_channels * self.positions

    def per_sample_elements(self) -> int:
        """Elements of the per-sample gradients, N·C_out·(C_in/G)·K."""
        return self.n * numel(self.geom.weight_shape)

    def relayout(self, dense: bool) -> int:
        """Elements the caller copies to keep a result that is ``dense`` (contiguous,
        filling its own storage) or not in the weight's layout: the per-sample
        gradients when :attr:`contiguous` asks for that layout and the strategy
        returns another, else 0."""
        kept = self.contiguous and self.per_sample and not self.into
        return self.per_sample_elements() if kept and not dense else 0


@runtime_checkable
class Strategy(Protocol):
    """A weight-VJP strategy.

    Attributes:
        name: what users pass to :class:`memconv.save_memory`.
        options: names of the :class:`Options` fields the strategy reads; any other
            option given with it is an error.
        composite: True when the strategy runs other registered strategies
            (``"auto"``, ``"streaming"``); those are not candidates of each other.

    A strategy may also set ``batched = False`` (a class attribute; True when absent):
    its number of tensor operations grows with N (a loop over samples). ``"auto"``
    still chooses it by price: its time model includes the device's per-operation cost
    times that N-proportional number of operations
    (:func:`memconv.strategies.costs.operations_time`), so it wins where its
    arithmetic is that much cheaper (on a CPU, some 5 µs an operation) and loses where
    each operation is a kernel launch and the arithmetic is fast (a GPU; see
    :func:`ranked_time`). ``"streaming"`` does not run it on its tiles
    (:func:`candidates`).
    """

    name: ClassVar[str]
    options: ClassVar[frozenset[str]]
    composite: ClassVar[bool]

    def vjp(
        self,
        x: Tensor,
        g: Tensor,
        geom: ConvGeometry,
        *,
        per_sample: bool,
        options: Options,
        out: Tensor | None = None,
    ) -> Tensor:
        """The weight gradient.

        Args:
            x: normal-form input ``[N, C_in, *S]``.
            g: output gradient ``[N, C_out, *T]``, same dtype as ``x``.
            geom: the geometry.
            per_sample: ``[N, C_out, C_in/G, *k]`` if True, else ``[C_out, C_in/G, *k]``.
            options: the strategy's options.
            out: optional tensor of the result's shape to add into (and return).
        """
        ...

    def memory(self, problem: Problem, options: Options) -> int:
        """Extra bytes the VJP allocates beyond ``x``, ``g`` and the result."""
        ...

    def time(self, problem: Problem, options: Options) -> float:
        """Predicted run time in seconds (a model: comparable between strategies)."""
        ...


_REGISTRY: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
    """Register a strategy instance under ``strategy.name``; returns it.

    Raises:
        TypeError: if it does not implement :class:`Strategy`.
        ValueError: if the name is already taken.
    """
    if not isinstance(strategy, Strategy):
        raise TypeError(f"{strategy!r} does not implement the memconv Strategy protocol")
    if strategy.name in _REGISTRY:
        raise ValueError(f"strategy {strategy.name!r} is already registered")
    _REGISTRY[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    """The registered strategy called ``name``.

    Raises:
        ValueError: for an unknown name (the message lists the accepted ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}; accepted: {', '.join(strategy_names())}"
        ) from None


def strategy_names() -> tuple[str, ...]:
    """Names of all registered strategies, in registration order."""
    return tuple(_REGISTRY)


def cost_model(fn):
    """Memoise a cost-model function of frozen values (:class:`Problem`,
    :class:`Options`, budgets in bytes, settings).

    The cost models are pure functions of their arguments, of the registered
    strategies and of whether a compiled step is being traced (:func:`unrolled`), the
    last two part of the key; without the memo, the choices made for every layer of
    every call (``"auto"``, ``"streaming"``'s tiles, the norm routes, the whole-call
    planner's predictions) cost about as much Python time as a small layer's backward
    pass.
    """
    cached = functools.lru_cache(maxsize=4096)(lambda names, *args: fn(*args))
    _MEMOS.append(cached)

    @functools.wraps(fn)
    def wrapper(*args):
        try:
            hash(args)
        except TypeError:  # an unhashable argument (a list where a tuple goes)
            return fn(*args)
        return cached((strategy_names(), unrolled()), *args)

    wrapper.cache_clear = cached.cache_clear
    return wrapper


#: The memos of every :func:`cost_model` function.
_MEMOS: list = []


def clear_cost_memos() -> None:
    """Forget every memoised cost-model result (the calibration changed)."""
    for memo in _MEMOS:
        memo.cache_clear()


def elementary() -> tuple[Strategy, ...]:
    """The registered strategies that run no other strategy."""
    return tuple(s for s in _REGISTRY.values() if not s.composite)


def batched(strategy: Strategy) -> bool:
    """Whether ``strategy`` runs a batch in a number of tensor operations that does not
    depend on N (its ``batched`` attribute; True when it has none)."""
    return getattr(strategy, "batched", True)


def unrolled() -> bool:
    """Whether the tensor operations running now are recorded into one graph (a
    compiled step's trace, :func:`memconv._torch.tracing`): a loop over the samples
    is then unrolled, N copies of its operations in the graph, which the compiler
    reads, compiles and launches each; the choices made now keep to :func:`batched`
    strategies where one fits (``"auto"``)."""
    return tracing()


#: A strategy that is not :func:`batched` is ranked by its predicted time times this
#: factor: it is taken only where it is priced faster than the fastest batched choice
#: by more than the time models' typical error, both erring in opposite directions
#: (``(1 + e) / (1 - e)`` with ``e`` = 0.21, the median relative error of the CUDA
#: fit's loop model), so a near tie goes to the route whose number of operations does
#: not grow with N.
UNBATCHED_MARGIN = 1.5


def ranked_time(strategy: Strategy, seconds: float) -> float:
    """The time a choice among strategies ranks ``strategy`` by: its predicted
    ``seconds``, times :data:`UNBATCHED_MARGIN` when it is not :func:`batched`."""
    return seconds if batched(strategy) else seconds * UNBATCHED_MARGIN


def pieces(strategy: Strategy, problem: Problem, options: Options) -> int:
    """Pieces ``strategy`` splits this VJP into to fit ``options.memory_budget`` (chunks
    of the batch, tiles of the positions; its ``pieces`` method, 1 when it has none):
    each piece repeats the strategy's operations, so with more than one their number
    grows with the batch."""
    count = getattr(strategy, "pieces", None)
    return 1 if count is None else count(problem, options)


def candidates() -> tuple[Strategy, ...]:
    """The elementary strategies ``"streaming"`` runs on its tiles: the batched ones
    (:func:`batched`), so that ``"streaming"`` is batched itself (its operations grow
    with its tiles, not with N). ``"auto"`` prices every registered strategy, those
    that loop over the samples included (:func:`ranked_time`)."""
    return tuple(s for s in elementary() if batched(s))


# ----------------------------------------------------------------- shared helpers
def fastest_that_fits(candidates, budget, *, memory=lambda c: c.memory, time=lambda c: c.time):
    """The policy every memconv choice follows: the fastest candidate whose predicted
    memory fits ``budget`` (any, when ``budget`` is None), else the leanest.

    Args:
        candidates: a non-empty sequence of choices.
        budget: bytes, or None.
        memory: a choice's predicted bytes.
        time: a choice's predicted time (seconds, or units comparable between choices).

    Returns:
        ``(choice, fits)``; ``fits`` is False when none fits (the leanest is returned).
    """
    fitting = [c for c in candidates if budget is None or memory(c) <= budget]
    if fitting:
        return min(fitting, key=time), True
    return min(candidates, key=memory), False


def linear_time(coefficients: tuple[float, float, float], flops, traffic, calls) -> float:
    """A time model: seconds per multiply-add, per element moved, per kernel call.

    The coefficients are fitted per device type (non-negative least squares on
    relative error of measured times, :mod:`memconv.bench.calibrate`) and read from
    :mod:`memconv.strategies.costs`; only their ratios matter to ``"auto"``.
    """
    per_flop, per_element, per_call = coefficients
    return per_flop * flops + per_element * traffic + per_call * calls


def finish(result: Tensor, per_sample: bool, out: Tensor | None) -> Tensor:
    """Sum a per-sample result over N unless ``per_sample``; add into ``out``."""
    if not per_sample:
        result = result.sum(0)
    if out is None:
        return result
    return out.add_(result)


def pad_input(x: Tensor, padding: tuple[int, ...]) -> Tensor:
    """Zero-pad the spatial axes of ``x`` ``[N, C, *S]`` symmetrically by ``padding``.

    Returns:
        ``x`` itself when there is nothing to pad, otherwise a padded copy.
    """
    if not any(padding):
        return x
    return F.pad(x, torch_pad_argument((p, p) for p in padding))


def crop_kernel(t: Tensor, kernel_size: tuple[int, ...], first_axis: int) -> Tensor:
    """Narrow the trailing kernel axes of ``t`` (from ``first_axis``) to ``kernel_size``.

    Convolutions that compute a weight gradient with stride and dilation swapped may
    return a few more positions than the kernel has (BackPACK does the same crop).
    """
    for i, k in enumerate(kernel_size):
        if t.shape[first_axis + i] != k:
            t = t.narrow(first_axis + i, 0, k)
    return t


def padded_size(geom: ConvGeometry, size: tuple[int, ...]) -> tuple[int, ...]:
    """Spatial size after the symmetric padding."""
    return tuple(s + 2 * p for s, p in zip(size, geom.padding))


def numel(shape) -> int:
    """Product of a shape's entries."""
    return math.prod(int(s) for s in shape)
