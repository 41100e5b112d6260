"""Cost model: extra memory of a strategy's weight VJP, in bytes."""

from __future__ import annotations

import math

import torch
from torch import nn

from ._geometry import conv_spec, padded_spatial
from .context import current_settings, make_settings
from .strategies import get_strategy
from .vjp import check_settings


def predict_memory(
    module: nn.Module,
    input_shape,
    strategy: str | bool | None = None,
    *,
    per_sample: bool = True,
    dtype: torch.dtype = torch.float32,
    tile_size=None,
    memory_budget: int | None = None,
    inner: str | None = None,
) -> int:
    """Predicted extra memory of one weight VJP beyond input, output and result.

    "Extra" counts the temporaries the strategy allocates: padded or unfolded copies
    of the input, a repeated or re-laid-out output gradient, a convolution's
    uncropped output, a per-sample result that is then summed. It does not count
    the layer input ``[N, C_in, *S]``, the output gradient ``[N, C_out, *T]``, or the
    returned gradient itself, nor a library's internal workspace.

    Args:
        module: ``torch.nn.Conv1d``, ``Conv2d`` or ``Conv3d``.
        input_shape: ``(N, C_in, *S)``.
        strategy: a name from :func:`memconv.strategies` (or a bool); ``None`` uses
            the active one (and its ``tile_size``/``memory_budget``).
        per_sample: per-sample (True) or summed (False) gradient.
        dtype: floating dtype of input and gradient.
        tile_size: as in :class:`memconv.save_memory`.
        memory_budget: bytes, as in :class:`memconv.save_memory`.
        inner: as in :class:`memconv.save_memory`.

    Returns:
        Bytes.

    Raises:
        TypeError: if ``module`` is not a supported convolution.
        ValueError: unknown strategy, wrong ``input_shape``, bad ``tile_size`` or
            ``memory_budget``.
    """
    spec = conv_spec(module)
    if strategy is None and tile_size is None and memory_budget is None and inner is None:
        settings = current_settings()
    else:
        name = current_settings().strategy if strategy is None else strategy
        settings = make_settings(
            name, tile_size=tile_size, memory_budget=memory_budget, inner=inner
        )
    geom = spec.geometry
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != geom.dims + 2 or shape[1] != geom.in_channels:
        raise ValueError(
            f"input_shape must be (N, C_in={geom.in_channels}, {geom.dims} spatial "
            f"sizes), got {tuple(input_shape)}"
        )
    check_settings(settings, geom)
    size = padded_spatial(spec, shape[2:])
    itemsize = torch.empty((), dtype=dtype).element_size()
    extra = get_strategy(settings.strategy).extra_memory(
        geom, shape[0], size, itemsize, per_sample, settings
    )
    if spec.pre_pad is not None:
        extra += shape[0] * geom.in_channels * math.prod(size) * itemsize
    return int(extra)
