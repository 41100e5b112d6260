"""Functional entry points: the convolution weight and bias VJPs."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor, nn

from ._geometry import (
    ConvGeometry,
    ConvSpec,
    check_grad_output,
    check_input,
    conv_spec,
)
from .context import Settings, current_settings, resolve_strategy_name
from .strategies import get_strategy


def settings_for(strategy=None) -> Settings:
    """The active settings, with the strategy replaced when one is named.

    Raises:
        ValueError, TypeError: for an unknown or wrongly typed strategy.
    """
    settings = current_settings()
    if strategy is None:
        return settings
    return replace(settings, strategy=resolve_strategy_name(strategy))


def check_settings(settings: Settings, geom: ConvGeometry) -> None:
    """Raise if the settings cannot apply to this convolution (before any work).

    Raises:
        ValueError: if a ``tile_size`` tuple does not have one entry per spatial axis.
    """
    ts = settings.tile_size
    if isinstance(ts, tuple) and len(ts) != geom.dims:
        raise ValueError(
            f"tile_size {ts} must have one entry per spatial dimension "
            f"({geom.dims} for a Conv{geom.dims}d) or be an int"
        )


def weight_grad(
    x: Tensor, g: Tensor, geom: ConvGeometry, *, per_sample: bool, settings: Settings
) -> Tensor:
    """Run the strategy named in ``settings`` on a normal-form input (no checks).

    Args:
        x: normal-form input ``[N, C_in, *S]``.
        g: output gradient ``[N, C_out, *T]``.
        geom: the geometry.
        per_sample: ``[N, C_out, C_in/G, *k]`` if True, else ``[C_out, C_in/G, *k]``.
        settings: the strategy and its options.

    Returns:
        The weight gradient.
    """
    if x.shape[0] == 0:  # an empty batch has a zero gradient
        shape = (0, *geom.weight_shape) if per_sample else geom.weight_shape
        return x.new_zeros(shape)
    return get_strategy(settings.strategy).vjp(x, g, geom, per_sample=per_sample, settings=settings)


def bias_grad(g: Tensor, *, per_sample: bool) -> Tensor:
    """Bias gradient: the output gradient summed over the spatial axes (and N).

    Args:
        g: output gradient ``[N, C_out, *T]``.
        per_sample: ``[N, C_out]`` if True, else ``[C_out]``.
    """
    dims = tuple(range(2, g.dim()))
    out = g.sum(dims) if dims else g
    return out if per_sample else out.sum(0)


def prepare(module: nn.Module, input: Tensor, grad_output: Tensor) -> ConvSpec:
    """Validate a (module, input, output gradient) triple and return the spec.

    Raises:
        TypeError: if ``module`` is not a supported convolution, or the tensors are
            not floating-point tensors.
        ValueError: if the shapes do not match the module.
    """
    spec = conv_spec(module)
    check_input(spec, input)
    check_grad_output(spec, input.shape, grad_output)
    return spec


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
        module: ``torch.nn.Conv1d``, ``Conv2d`` or ``Conv3d`` (or memconv's).
        input: the module's input ``[N, C_in, *S]`` (before any padding).
        grad_output: gradient of the loss w.r.t. the module's output ``[N, C_out, *T]``.
        per_sample: return ``[N, C_out, C_in/G, *k]`` if True, else the sum over N.
        strategy: a name from :func:`memconv.strategies` (or a bool, as in
            :class:`memconv.save_memory`); ``None`` uses the active one. The
            ``tile_size``/``memory_budget`` of the active block still apply.

    Returns:
        The weight gradient (per sample or summed), in the input's dtype.

    Raises:
        TypeError: if ``module`` is not a supported convolution.
        ValueError: unknown strategy, shapes that do not match the module, a
            ``tile_size`` tuple of the wrong length.
    """
    settings = settings_for(strategy)
    spec = prepare(module, input, grad_output)
    check_settings(settings, spec.geometry)
    x = spec.normalize_input(input)
    return weight_grad(x, grad_output, spec.geometry, per_sample=per_sample, settings=settings)
