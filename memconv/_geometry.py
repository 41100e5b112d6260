"""Geometry of a convolution: kernel, stride, padding, dilation, groups.

Every strategy works on one normal form: an input that already carries any
asymmetric or non-zero padding (applied here with :func:`torch.nn.functional.pad`,
as :meth:`torch.nn.Conv2d._conv_forward` does for ``padding_mode != "zeros"``) and
a symmetric zero padding that the strategy applies itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


@dataclass(frozen=True)
class ConvGeometry:
    """Hyper-parameters of an N-d convolution in normal form.

    Attributes:
        dims: number of spatial dimensions (1, 2 or 3).
        in_channels: C_in.
        out_channels: C_out.
        kernel_size: k per spatial dimension.
        stride: stride per spatial dimension.
        padding: symmetric zero padding per spatial dimension.
        dilation: dilation per spatial dimension.
        groups: G.
    """

    dims: int
    in_channels: int
    out_channels: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    @property
    def in_per_group(self) -> int:
        """C_in / G."""
        return self.in_channels // self.groups

    @property
    def out_per_group(self) -> int:
        """C_out / G."""
        return self.out_channels // self.groups

    @property
    def kernel_numel(self) -> int:
        """Number of kernel offsets K = prod(k)."""
        return math.prod(self.kernel_size)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """Shape of the weight, ``[C_out, C_in/G, *k]``."""
        return (self.out_channels, self.in_per_group, *self.kernel_size)

    def output_size(self, input_size: tuple[int, ...]) -> tuple[int, ...]:
        """Output spatial size for a (normal-form) input spatial size.

        Args:
            input_size: spatial size of the input, before the symmetric padding.

        Returns:
            The spatial size T of the output (PyTorch's formula).
        """
        return tuple(
            (s + 2 * p - d * (k - 1) - 1) // st + 1
            for s, p, d, k, st in zip(
                input_size, self.padding, self.dilation, self.kernel_size, self.stride
            )
        )

    def with_padding(self, padding: tuple[int, ...]) -> ConvGeometry:
        """Copy of this geometry with another symmetric padding."""
        return ConvGeometry(
            self.dims,
            self.in_channels,
            self.out_channels,
            self.kernel_size,
            self.stride,
            tuple(padding),
            self.dilation,
            self.groups,
        )


@dataclass(frozen=True)
class ConvSpec:
    """A convolution module reduced to what the backward pass needs.

    Attributes:
        geometry: the normal-form geometry.
        pre_pad: the ``pad`` argument of :func:`torch.nn.functional.pad` that brings
            the module's input to normal form, or ``None`` when nothing is needed.
        pad_mode: the ``mode`` of that padding ("constant", "reflect", ...).
    """

    geometry: ConvGeometry
    pre_pad: tuple[int, ...] | None
    pad_mode: str

    def normalize_input(self, x: Tensor) -> Tensor:
        """Apply the pre-padding (if any) to the module's input."""
        if self.pre_pad is None:
            return x
        return F.pad(x, self.pre_pad, mode=self.pad_mode)


def check_conv_module(module, argument: str = "module") -> None:
    """Raise unless ``module`` is a ``torch.nn.Conv1d``, ``Conv2d`` or ``Conv3d``.

    Raises:
        TypeError: for any other object, transposed and lazy convolutions included.
        ValueError: for an unknown ``padding_mode``.
    """
    if not isinstance(module, CONV_TYPES) or isinstance(module, nn.modules.lazy.LazyModuleMixin):
        raise TypeError(
            f"{argument} must be a torch.nn.Conv1d, Conv2d or Conv3d (or a memconv "
            f"subclass of one), got {type(module).__name__}"
        )
    if module.padding_mode not in PADDING_MODES:
        raise ValueError(
            f"{argument}.padding_mode must be one of {PADDING_MODES}, got {module.padding_mode!r}"
        )


def conv_spec(module: nn.Module) -> ConvSpec:
    """Reduce a convolution module to a :class:`ConvSpec`.

    Args:
        module: a ``torch.nn.Conv1d``, ``Conv2d`` or ``Conv3d``.

    Returns:
        The spec. ``padding="same"`` with an even effective kernel pads one more
        on the right, as PyTorch does.

    Raises:
        TypeError: if ``module`` is not a supported convolution.
    """
    check_conv_module(module)
    dims = len(module.kernel_size)
    pairs = []  # (left, right) per spatial dimension
    for i in range(dims):
        k, d = module.kernel_size[i], module.dilation[i]
        if module.padding == "valid":
            pairs.append((0, 0))
        elif module.padding == "same":
            total = d * (k - 1)
            pairs.append((total // 2, total - total // 2))
        else:
            p = module.padding[i]
            pairs.append((p, p))
    if module.padding_mode == "zeros":
        sym = tuple(left for left, _ in pairs)
        extra = [right - left for left, right in pairs]
        pre_pad = None
        if any(extra):
            pre_pad = tuple(v for e in reversed(extra) for v in (0, e))
        mode = "constant"
    else:
        sym = (0,) * dims
        pre_pad = tuple(v for pair in reversed(pairs) for v in pair)
        if not any(pre_pad):
            pre_pad = None
        mode = module.padding_mode
    geometry = ConvGeometry(
        dims=dims,
        in_channels=module.in_channels,
        out_channels=module.out_channels,
        kernel_size=tuple(module.kernel_size),
        stride=tuple(module.stride),
        padding=sym,
        dilation=tuple(module.dilation),
        groups=module.groups,
    )
    return ConvSpec(geometry, pre_pad, mode)


def check_input(spec: ConvSpec, x, argument: str = "input") -> None:
    """Raise unless ``x`` is a floating tensor ``[N, C_in, *S]`` for this convolution.

    Raises:
        TypeError: if ``x`` is not a floating-point tensor.
        ValueError: on a wrong number of dimensions or channels, or a spatial size
            too small for the kernel.
    """
    geom = spec.geometry
    if not isinstance(x, Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{argument} must be floating point, got dtype {x.dtype}")
    if x.dim() != geom.dims + 2 or x.shape[1] != geom.in_channels:
        raise ValueError(
            f"{argument} must have shape [N, C_in={geom.in_channels}, "
            f"{geom.dims} spatial dims], got {tuple(x.shape)}"
        )
    size = padded_spatial(spec, tuple(x.shape[2:]))
    if any(t < 1 for t in geom.output_size(size)):
        raise ValueError(
            f"{argument} spatial size {tuple(x.shape[2:])} is smaller than the "
            f"dilated kernel {geom.kernel_size} (dilation {geom.dilation})"
        )


def padded_spatial(spec: ConvSpec, size: tuple[int, ...]) -> tuple[int, ...]:
    """Spatial size after the pre-padding of ``spec``."""
    if spec.pre_pad is None:
        return tuple(size)
    dims = len(size)
    out = list(size)
    for i in range(dims):
        j = dims - 1 - i  # F.pad lists the last dimension first
        out[i] += spec.pre_pad[2 * j] + spec.pre_pad[2 * j + 1]
    return tuple(out)


def check_grad_output(spec: ConvSpec, x_shape, g, argument: str = "grad_output") -> None:
    """Raise unless ``g`` has the shape of the convolution's output for input ``x_shape``.

    Raises:
        TypeError: if ``g`` is not a tensor.
        ValueError: if its shape is not ``[N, C_out, *T]``.
    """
    geom = spec.geometry
    if not isinstance(g, Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(g).__name__}")
    expected = (
        x_shape[0],
        geom.out_channels,
        *geom.output_size(padded_spatial(spec, tuple(x_shape[2:]))),
    )
    if tuple(g.shape) != expected:
        raise ValueError(
            f"{argument} must have shape {expected} (the output of the convolution "
            f"for input {tuple(x_shape)}), got {tuple(g.shape)}"
        )


def conv_function(dims: int):
    """``torch.nn.functional.conv{dims}d``."""
    return (F.conv1d, F.conv2d, F.conv3d)[dims - 1]


def input_vjp(x: Tensor, weight: Tensor, g: Tensor, geom: ConvGeometry) -> Tensor:
    """Gradient of the convolution with respect to its (normal-form) input.

    The transposed convolution, through ATen's ``convolution_backward`` with only the
    input mask set, so no weight gradient is computed.

    Args:
        x: normal-form input ``[N, C_in, *S]`` (only its shape is used by ATen).
        weight: ``[C_out, C_in/G, *k]``.
        g: output gradient ``[N, C_out, *T]``.
        geom: the geometry.

    Returns:
        ``[N, C_in, *S]``.
    """
    grad_input, _, _ = torch.ops.aten.convolution_backward(
        g,
        x,
        weight,
        None,
        list(geom.stride),
        list(geom.padding),
        list(geom.dilation),
        False,
        [0] * geom.dims,
        geom.groups,
        [True, False, False],
    )
    return grad_input
