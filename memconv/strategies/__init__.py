"""Registry of weight-VJP strategies for N-d convolutions.

A strategy maps the (normal-form) layer input ``x`` ``[N, C_in, *S]`` and the output
gradient ``g`` ``[N, C_out, *T]`` to the weight gradient, per sample
``[N, C_out, C_in/G, *k]`` or summed over the batch ``[C_out, C_in/G, *k]``.
Each one lives in its own module and registers itself with
:func:`register_strategy`, in the manner of Opacus' ``@register_grad_sampler``; it
also registers a cost model (:class:`MemoryModel`) that predicts its extra memory.

Every strategy takes the same arguments::

    vjp(x, g, geom, *, per_sample, settings, out=None) -> Tensor

where ``out`` (optional, of the result's shape) is accumulated into and returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from .._geometry import ConvGeometry

#: Extra bytes of a strategy (beyond the input, the output gradient and the result)
#: as a function of ``(geom, N, S, itemsize, per_sample, settings)``.
MemoryModel = Callable[..., int]


@dataclass(frozen=True)
class Strategy:
    """A registered weight-VJP strategy.

    Attributes:
        name: the name users pass to :func:`memconv.save_memory`.
        vjp: the function computing the weight gradient.
        extra_memory: its cost model, in bytes.
        tiles: whether the strategy tiles the output (and so takes an inner one).
    """

    name: str
    vjp: Callable[..., Tensor]
    extra_memory: MemoryModel
    tiles: bool = False


_REGISTRY: dict[str, Strategy] = {}


def register_strategy(name: str, *, extra_memory: MemoryModel, tiles: bool = False):
    """Decorator that registers a weight-VJP function under ``name``.

    Raises:
        ValueError: if ``name`` is already taken.
    """

    def decorator(fn):
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")
        _REGISTRY[name] = Strategy(name, fn, extra_memory, tiles)
        return fn

    return decorator


def get_strategy(name: str) -> Strategy:
    """The registered :class:`Strategy` called ``name``.

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


# ----------------------------------------------------------------- shared helpers
def finish(result: Tensor, per_sample: bool, out: Tensor | None) -> Tensor:
    """Sum a per-sample result over N unless ``per_sample``; add into ``out``."""
    if not per_sample:
        result = result.sum(0)
    if out is None:
        return result
    return out.add_(result)


def pad_input(x: Tensor, padding: tuple[int, ...], extra_end: int = 0) -> Tensor:
    """Zero-pad the spatial dimensions of ``x`` symmetrically by ``padding``.

    Args:
        x: ``[N, C, *S]``.
        padding: per spatial dimension.
        extra_end: further zeros after the end of the first spatial dimension.

    Returns:
        ``x`` itself when there is nothing to pad, otherwise a padded copy.
    """
    if not any(padding) and not extra_end:
        return x
    pads = []
    for i, p in enumerate(reversed(padding)):
        last = i == len(padding) - 1
        pads += [p, p + (extra_end if last else 0)]
    return F.pad(x, pads)


def crop_kernel(t: Tensor, kernel_size: tuple[int, ...], first_axis: int) -> Tensor:
    """Narrow the trailing kernel axes of ``t`` (from ``first_axis``) to ``kernel_size``.

    Convolutions that compute a weight gradient with stride and dilation swapped may
    return a few more positions than the kernel has (BackPACK does the same crop).
    """
    for i, k in enumerate(kernel_size):
        t = t.narrow(first_axis + i, 0, k)
    return t


def padded_size(geom: ConvGeometry, size: tuple[int, ...]) -> tuple[int, ...]:
    """Spatial size after the symmetric padding."""
    return tuple(s + 2 * p for s, p in zip(size, geom.padding))


def numel(shape) -> int:
    """Product of a shape's entries."""
    return math.prod(int(s) for s in shape)


# Registration happens on import; this order is the order users see.
# isort: off
from . import standard  # noqa: E402,F401
from . import rochette  # noqa: E402,F401
from . import unfold  # noqa: E402,F401
from . import shift  # noqa: E402,F401
from . import streaming  # noqa: E402,F401
from . import auto  # noqa: E402,F401

# isort: on
