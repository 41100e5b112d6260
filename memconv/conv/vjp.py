"""Functional entry points: the weight VJP of a convolution or transposed convolution."""

from __future__ import annotations

from torch import Tensor, nn

from .._checks import check_conv_grad_output as check_grad_output
from .._checks import check_conv_input as check_input
from ..strategies.geometry import ConvGeometry, conv_spec
from .grads import conv_weight_grad
from .settings import Settings, use_block_settings


def check_settings(settings: Settings, geom: ConvGeometry) -> None:
    """Raise if the settings cannot apply to this convolution (before any work).

    Raises:
        ValueError: if a ``tile_size`` tuple does not have one entry per spatial axis.
    """
    ts = settings.options.tile_size
    if isinstance(ts, tuple) and len(ts) != geom.dims:
        raise ValueError(
            f"tile_size {ts} must have one entry per spatial dimension "
            f"({geom.dims} for a {geom.dims}-d convolution) or be an int"
        )


def weight_vjp(
    module: nn.Module,
    input: Tensor,
    grad_output: Tensor,
    *,
    per_sample: bool = True,
    strategy: str | bool | None = None,
) -> Tensor:
    """Weight gradient of a convolution from its input and output gradient.

    Args:
        module: ``torch.nn.Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d`` (or memconv's).
        input: the module's input ``[N, C_in, *S]`` (before any padding).
        grad_output: gradient of the loss w.r.t. the module's output ``[N, C_out, *T]``.
            When its dtype differs from the input's (autocast), the input is cast to
            it, the dtype the forward pass computed in.
        per_sample: return ``[N, *weight.shape]`` if True, else the sum over N.
        strategy: a name from :func:`memconv.available_strategies` (or a bool, as in
            :class:`memconv.save_memory`), run with its default options; ``None``
            uses the open :class:`memconv.save_memory` block (``"auto"`` outside any).

    Returns:
        The weight gradient, in the output gradient's dtype.

    Raises:
        TypeError: if ``module`` is not a supported convolution or the tensors are
            not floating point.
        ValueError: unknown strategy, shapes that do not match the module, a
            ``tile_size`` tuple of the wrong length. All before any work.
    """
    settings = use_block_settings(strategy)
    spec = conv_spec(module)
    check_input(spec, input)
    check_grad_output(spec, input.shape, grad_output)
    check_settings(settings, spec.geometry)
    return conv_weight_grad(module, input, grad_output, settings, per_sample)
