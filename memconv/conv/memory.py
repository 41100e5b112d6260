"""Cost model: extra memory of a strategy's weight VJP, in bytes."""

from __future__ import annotations

import torch
from torch import nn

from ..strategies import Problem, get_strategy
from ..strategies.geometry import conv_spec, layer_output_size
from .grads import spend
from .settings import current_settings, make_settings
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
        module: ``torch.nn.Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d``.
        input_shape: the layer input's shape ``(N, C_in, *S)``.
        strategy: a name from :func:`memconv.available_strategies` (or a bool); ``None`` uses
            the open block's strategy and options.
        per_sample: per-sample (True) or summed (False) gradient.
        dtype: floating dtype of input and gradient.
        tile_size: as in :class:`memconv.save_memory`.
        memory_budget: bytes, as in :class:`memconv.save_memory`.
        inner: as in :class:`memconv.save_memory`.

    Returns:
        Bytes.

    Raises:
        TypeError: if ``module`` is not a supported convolution.
        ValueError: unknown strategy, an option the strategy does not use, wrong
            ``input_shape``, bad ``tile_size`` or ``memory_budget``.
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
    channels = geom.out_channels if spec.transposed else geom.in_channels
    if len(shape) != geom.dims + 2 or shape[1] != channels:
        raise ValueError(
            f"input_shape must be (N, C_in={channels}, {geom.dims} spatial "
            f"sizes), got {tuple(input_shape)}"
        )
    check_settings(settings, geom)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # the strategy's operands, as shapes only (meta tensors): padded or cropped as
    # the layer's own backward pass makes them
    x = torch.empty(shape, dtype=dtype, device="meta")
    out_channels = geom.in_channels if spec.transposed else geom.out_channels
    g = torch.empty(
        (shape[0], out_channels, *layer_output_size(spec, module, shape[2:])),
        dtype=dtype,
        device="meta",
    )
    ops = spec.operands(x, g)
    problem = Problem(ops.geometry, shape[0], tuple(ops.x.shape[2:]), itemsize, per_sample)
    copied = ops.copied * itemsize  # a padded copy of the operand, made before the strategy
    options = spend(settings.options, copied)
    return int(copied + get_strategy(settings.strategy).memory(problem, options))
