"""``"auto"``: per layer, the fastest strategy whose predicted memory fits a budget.

Speed is predicted from memory traffic, which bounds these products on a CPU:
``"shift"`` reads the output gradient and the input once per kernel offset,
``"unfold"`` writes (counted twice: fresh pages) and reads the unfolded input and
reads the output gradient once; the one moving fewer elements is tried first (``"unfold"`` wins when C_in is
small beside C_out, as in a first layer), then the other, then ``"rochette"`` and
``"standard"`` (grouped convolutions with N·G groups, slower on CPUs in
``memconv bench``). The first whose cost model predicts extra memory within
``memory_budget`` bytes runs; when none fits, ``"streaming"`` runs with a tile
chosen to fit the budget. Without a budget the fastest runs.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from .._geometry import ConvGeometry
from . import get_strategy, numel, register_strategy

#: Non-tiling strategies tried after the two matrix-product ones.
FALLBACK_ORDER = ("rochette", "standard")


def traffic(name: str, geom: ConvGeometry, n: int, size) -> int:
    """Elements ``"shift"`` or ``"unfold"`` read and write (speed model of ``"auto"``)."""
    t = numel(geom.output_size(size))
    x_t = n * geom.in_channels * t  # input at the output positions
    g = n * geom.out_channels * t
    if name == "shift":
        return geom.kernel_numel * (x_t + g)
    # writing the unfolded input costs about twice reading it (fresh pages)
    return 3 * geom.kernel_numel * x_t + g


def speed_order(geom: ConvGeometry, n: int, size) -> tuple[str, ...]:
    """Non-tiling strategies, predicted fastest first."""
    fast = sorted(("shift", "unfold"), key=lambda s: traffic(s, geom, n, size))
    return (*fast, *FALLBACK_ORDER)


def choose_strategy(geom: ConvGeometry, n, size, itemsize, per_sample, budget) -> str:
    """Name of the strategy ``"auto"`` runs for this layer and batch.

    Arguments, shapes and return value: the strategy protocol of
    :mod:`memconv.strategies`.

    Args:
        n: batch size N.
        size: normal-form input spatial size.
        itemsize: bytes per element.
        budget: bytes, or None for no limit.

    Returns:
        A name from :func:`speed_order`, or ``"streaming"``.
    """
    for name in speed_order(geom, n, size):
        cost = get_strategy(name).extra_memory(geom, n, size, itemsize, per_sample, None)
        if budget is None or cost <= budget:
            return name
    return "streaming"


def _streaming_settings(settings):
    if settings is None:
        return None
    return replace(settings, strategy="streaming", tile_size=None)


def _extra_memory(geom: ConvGeometry, n, size, itemsize, per_sample, settings) -> int:
    budget = settings.memory_budget if settings is not None else None
    name = choose_strategy(geom, n, size, itemsize, per_sample, budget)
    if name == "streaming":
        settings = _streaming_settings(settings)
    return get_strategy(name).extra_memory(geom, n, size, itemsize, per_sample, settings)


@register_strategy("auto", extra_memory=_extra_memory)
def auto_vjp(
    x: Tensor,
    g: Tensor,
    geom: ConvGeometry,
    *,
    per_sample: bool,
    settings=None,
    out: Tensor | None = None,
) -> Tensor:
    """Weight VJP by the fastest strategy that fits ``settings.memory_budget``.

    Args:
        settings: :class:`memconv.context.Settings`; ``memory_budget`` (bytes) is read.
    """
    budget = settings.memory_budget if settings is not None else None
    n, size = x.shape[0], tuple(x.shape[2:])
    name = choose_strategy(geom, n, size, x.element_size(), per_sample, budget)
    if name == "streaming":
        settings = _streaming_settings(settings)
    return get_strategy(name).vjp(x, g, geom, per_sample=per_sample, settings=settings, out=out)
