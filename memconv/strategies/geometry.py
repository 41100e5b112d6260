"""Geometry of convolutions: one normal form, and the window arithmetic of tiling.

Every strategy works on one normal form of a convolution: an input that already
carries any asymmetric or non-zero padding (applied with
:func:`torch.nn.functional.pad`, as :meth:`torch.nn.Conv2d._conv_forward` does for
``padding_mode != "zeros"``) and a symmetric zero padding that the strategy applies
itself. A transposed convolution is reduced to the same form: its weight gradient
is the weight gradient of the convolution whose input gradient it computes, with
the roles of input and output gradient exchanged (see :class:`ConvSpec`).

The per-axis window arithmetic at the end of this module (receptive field, the
input range an output range needs, the border padding that range misses) is shared
by the ``"streaming"`` strategy and :mod:`memconv.streaming`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import CONV_TRANSPOSE_TYPES, check_conv_module
from .._torch import tracing


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
        """Output spatial size T for a normal-form input spatial size (PyTorch's formula).

        Args:
            input_size: spatial size of the input, before the symmetric padding.
        """
        return tuple(
            (s + 2 * p - span(k, d)) // st + 1
            for s, p, d, k, st in zip(
                input_size, self.padding, self.dilation, self.kernel_size, self.stride
            )
        )

    def needed_input_size(self, output_size: tuple[int, ...]) -> tuple[int, ...]:
        """Smallest input spatial size (before padding) that gives ``output_size``."""
        return tuple(
            (t - 1) * st + span(k, d) - 2 * p
            for t, st, k, d, p in zip(
                output_size, self.stride, self.kernel_size, self.dilation, self.padding
            )
        )

    def with_padding(self, padding: tuple[int, ...]) -> ConvGeometry:
        """Copy of this geometry with another symmetric padding."""
        return replace(self, padding=tuple(padding))


@dataclass(frozen=True)
class Operands:
    """What a strategy runs on, for one layer's weight VJP.

    Attributes:
        x: normal-form input ``[N, C_in, *S]`` of the (equivalent) convolution.
        g: its output gradient ``[N, C_out, *T]``.
        geometry: the geometry to run the strategy with.
        copied: elements of ``x`` that bringing it to normal form copied (0 when it
            is the layer's tensor or a view of it).
    """

    x: Tensor
    g: Tensor
    geometry: ConvGeometry
    copied: int = 0


@dataclass(frozen=True)
class ConvSpec:
    """A convolution or transposed-convolution module reduced to what its weight
    VJP needs.

    For a convolution the strategy operands are the module's input ``x`` (brought
    to normal form by :meth:`normalize_input`) and its output gradient. For a
    transposed convolution ``y = conv_transpose(x, W)``, which computes the input
    gradient of ``conv(·, W)`` at ``x``, the operands are exchanged: the *output
    gradient* ``g_y`` plays the convolution's input (cropped to the positions that
    reach an input position; ``output_padding`` adds none) and the module's
    *input* plays the convolution's output gradient. ``W``'s layout
    ``[C_in, C_out/G, *k]`` is then exactly the convolution's ``[C_out, C_in/G, *k]``.

    Attributes:
        geometry: the normal-form geometry of the (equivalent) convolution.
        pre_pad: the ``pad`` argument of :func:`torch.nn.functional.pad` that brings
            the strategy's input operand to normal form, or ``None``.
        pad_mode: the ``mode`` of that padding ("constant", "reflect", ...).
        transposed: whether the module is a transposed convolution.
    """

    geometry: ConvGeometry
    pre_pad: tuple[int, ...] | None
    pad_mode: str
    transposed: bool = False

    def padded_size(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """Spatial size after the pre-padding."""
        if self.pre_pad is None:
            return tuple(size)
        pairs = pad_pairs(self.pre_pad)
        return tuple(s + lo + hi for s, (lo, hi) in zip(size, pairs))

    def normalize_input(self, x: Tensor) -> Tensor:
        """Apply the pre-padding (if any) to a convolution's input."""
        if self.pre_pad is None:
            return x
        return F.pad(x, self.pre_pad, mode=self.pad_mode)

    def operands(self, input: Tensor, grad_output: Tensor, normalized: bool = False) -> Operands:
        """The strategy operands for a layer's input and output gradient.

        Args:
            input: the layer's input.
            grad_output: the layer's output gradient.
            normalized: ``input`` already is in normal form (a convolution's saved
                input).

        Returns:
            The :class:`Operands`. For a transposed convolution ``x`` is the output
            gradient and ``g`` the input; positions that ``output_padding`` added are
            kept where the equivalent convolution reads them: along an axis with
            ``output_padding`` and padding ``p > 0`` the operand is padded by
            ``(p, p - output_padding)`` (a copy) and that axis's padding becomes 0;
            with ``p = 0`` the extra positions are never read and are cropped (a view).
        """
        geom = self.geometry
        if not self.transposed:
            if normalized or self.pre_pad is None:
                return Operands(input, grad_output, geom)
            x = self.normalize_input(input)
            return Operands(x, grad_output, geom, x.numel())
        needed = geom.needed_input_size(tuple(input.shape[2:]))
        extra = [s - n for s, n in zip(grad_output.shape[2:], needed)]
        if not any(extra):
            return Operands(grad_output, input, geom)
        pairs, padding = [], []
        for op, p in zip(extra, geom.padding):
            if op and p:
                pairs.append((p, p - op))
                padding.append(0)
            else:
                pairs.append((0, -op))
                padding.append(p)
        x = F.pad(grad_output, torch_pad_argument(pairs))
        copied = x.numel() if any(p for p, _ in pairs) else 0
        return Operands(x, input, geom.with_padding(padding), copied)


def conv_spec(module: nn.Module) -> ConvSpec:
    """Reduce a convolution or transposed-convolution module to a :class:`ConvSpec`.

    Args:
        module: a ``torch.nn.Conv1d/2d/3d`` or ``ConvTranspose1d/2d/3d``.

    Returns:
        The spec. ``padding="same"`` with an even effective kernel pads one more
        on the right, as PyTorch does.

    Raises:
        TypeError: if ``module`` is not a supported convolution.
    """
    check_conv_module(module)
    dims = len(module.kernel_size)
    transposed = isinstance(module, CONV_TRANSPOSE_TYPES)
    if transposed:  # the convolution whose input gradient it computes
        channels = (module.out_channels, module.in_channels)
        sym, pre_pad, mode = tuple(module.padding), None, "constant"
    else:
        channels = (module.in_channels, module.out_channels)
        sym, pre_pad, mode = _normal_padding(module, dims)
    geometry = ConvGeometry(
        dims=dims,
        in_channels=channels[0],
        out_channels=channels[1],
        kernel_size=tuple(module.kernel_size),
        stride=tuple(module.stride),
        padding=sym,
        dilation=tuple(module.dilation),
        groups=module.groups,
    )
    return ConvSpec(geometry, pre_pad, mode, transposed)


def spec_of(module: nn.Module, spec: ConvSpec | None = None) -> ConvSpec:
    """The spec a function works with: ``spec`` as its caller passed it, else
    :func:`conv_spec` of ``module``.

    A caller that runs several functions on one layer call reads the layer once
    (``spec = conv_spec(module)``) and passes the record down by keyword; nothing is
    kept between calls, so a module whose ``stride``, ``padding`` or weight changes
    between calls is read afresh on the next one.

    Args:
        module: the convolution or transposed convolution.
        spec: ``conv_spec(module)`` read by the caller in the same call, or None.

    Returns:
        The :class:`ConvSpec`.

    Raises:
        TypeError: if ``spec`` is neither None nor a :class:`ConvSpec`, or (when
            ``spec`` is None) ``module`` is not a supported convolution.
    """
    if spec is None:
        return conv_spec(module)
    if not isinstance(spec, ConvSpec):
        raise TypeError(
            f"spec must be a ConvSpec (memconv.strategies.geometry.conv_spec(module)) or "
            f"None, got {type(spec).__name__}"
        )
    return spec


def _normal_padding(module, dims: int):
    """``(symmetric zero padding, pre-padding or None, its mode)`` of a convolution."""
    pairs = []  # (left, right) per spatial dimension
    for i in range(dims):
        k, d = module.kernel_size[i], module.dilation[i]
        if module.padding == "valid":
            pairs.append((0, 0))
        elif module.padding == "same":
            total = span(k, d) - 1
            pairs.append((total // 2, total - total // 2))
        else:
            p = module.padding[i]
            pairs.append((p, p))
    if module.padding_mode == "zeros":
        extra = [right - left for left, right in pairs]
        pre_pad = torch_pad_argument([(0, e) for e in extra]) if any(extra) else None
        return tuple(left for left, _ in pairs), pre_pad, "constant"
    pre_pad = torch_pad_argument(pairs) if any(v for p in pairs for v in p) else None
    return (0,) * dims, pre_pad, module.padding_mode


def layer_output_size(spec: ConvSpec, module: nn.Module, size: tuple[int, ...]):
    """Spatial size of the layer's output for an input spatial size ``size``.

    For a transposed convolution: PyTorch's formula with the module's own
    ``output_padding``.
    """
    geom = spec.geometry
    if not spec.transposed:
        return geom.output_size(spec.padded_size(size))
    return tuple(
        (s - 1) * st - 2 * p + span(k, d) + op
        for s, st, p, k, d, op in zip(
            size, geom.stride, geom.padding, geom.kernel_size, geom.dilation, module.output_padding
        )
    )


def conv_function(dims: int):
    """``torch.nn.functional.conv{dims}d``."""
    return (F.conv1d, F.conv2d, F.conv3d)[dims - 1]


def conv_transpose_function(dims: int):
    """``torch.nn.functional.conv_transpose{dims}d``."""
    return (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]


def convolution_backward(
    x: Tensor,
    weight: Tensor,
    g: Tensor,
    geom: ConvGeometry,
    output_padding=None,
    *,
    input_grad: bool = False,
    weight_grad: bool = False,
    bias_grad: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """torch's own kernel for a convolution's VJPs (ATen's ``convolution_backward``),
    computing only the gradients asked for; the one place memconv calls it.

    Args:
        x: the layer's (normal-form) input ``[N, C, *S]`` (only its shape is read
            when only the input gradient is asked for).
        weight: the layer's weight (cast to ``x``'s dtype; only its shape is read
            when the input gradient is not asked for).
        g: the layer's output gradient.
        geom: geometry of the convolution (for a transposed convolution, the
            equivalent convolution's: same stride, padding, dilation and groups).
        output_padding: ``None`` for a convolution; a transposed convolution's
            ``output_padding``.
        input_grad: compute the input gradient ``[N, C, *S]``.
        weight_grad: compute the summed weight gradient (``weight.shape``).
        bias_grad: compute the summed bias gradient ``[C_out]`` (``g`` summed over
            everything but its channels; a convolution's bias gradient).

    Returns:
        ``(input gradient or None, weight gradient or None, bias gradient or None)``.
    """
    transposed = output_padding is not None
    if not input_grad and tracing():
        # only the weight's shape is read: a stand-in of one element, so that the
        # traced step does not keep a weight it computed (a standardised one) alive
        # until the clipped sum (eagerly the layer's call holds it anyway)
        weight = x.new_empty((1,) * weight.dim()).expand(weight.shape)
    elif weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return torch.ops.aten.convolution_backward(
        g,
        x,
        weight,
        # the bias' shape where its gradient is asked for (the compiler's shape
        # functions need it; the eager kernel reads the output gradient's)
        [g.shape[1]] if bias_grad else None,
        list(geom.stride),
        list(geom.padding),
        list(geom.dilation),
        transposed,
        list(output_padding) if transposed else [0] * geom.dims,
        geom.groups,
        [input_grad, weight_grad, bias_grad],
    )


def input_vjp(
    x: Tensor, weight: Tensor, g: Tensor, geom: ConvGeometry, output_padding=None
) -> Tensor:
    """Gradient of the layer with respect to its input, no weight gradient computed
    (:func:`convolution_backward` with only the input gradient).

    Returns:
        ``[N, C, *S]``, the input gradient.
    """
    return convolution_backward(x, weight, g, geom, output_padding, input_grad=True)[0]


# ------------------------------------------------------------- window arithmetic
def span(kernel: int, dilation: int) -> int:
    """Input positions one output position sees along an axis: ``d·(k-1)+1``."""
    return dilation * (kernel - 1) + 1


def torch_pad_argument(pairs) -> tuple[int, ...]:
    """The ``pad`` argument of :func:`torch.nn.functional.pad` for ``(left, right)``
    pairs given per spatial axis, first axis first (``F.pad`` lists the last first)."""
    return tuple(v for pair in reversed(list(pairs)) for v in pair)


def pad_pairs(pad: tuple[int, ...]) -> list[tuple[int, int]]:
    """Inverse of :func:`torch_pad_argument`: ``(left, right)`` per axis, first first."""
    pairs = [(pad[2 * j], pad[2 * j + 1]) for j in range(len(pad) // 2)]
    return pairs[::-1]


def input_range(
    out: tuple[int, int], stride: int, pad_left: int, window: int, size: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The input positions an output range reads along one axis, clipped to the input.

    Args:
        out: output positions ``[lo, hi)``.
        stride: the layer's stride.
        pad_left: the layer's padding before the first input position.
        window: :func:`span` of the layer's kernel.
        size: the input's size along the axis.

    Returns:
        ``((lo, hi), (pad_lo, pad_hi))``: the clipped input range, and how many of
        the positions it reads lie in the layer's padding before and after it.
    """
    a, b = out
    lo = a * stride - pad_left
    hi = (b - 1) * stride - pad_left + window
    c_lo, c_hi = max(lo, 0), min(hi, size)
    return (c_lo, c_hi), (c_lo - lo, hi - c_hi)


def compose_receptive_field(
    rf: tuple[int, ...], jump: tuple[int, ...], window: tuple[int, ...], stride: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Receptive field and output stride after one more layer (per axis).

    Args:
        rf: receptive field so far, in input positions.
        jump: output stride so far, in input positions.
        window: :func:`span` of the next layer's kernel.
        stride: the next layer's stride.

    Returns:
        ``(rf', jump')`` with ``rf' = rf + (window-1)·jump`` and ``jump' = jump·stride``.
    """
    return (
        tuple(r + (w - 1) * j for r, w, j in zip(rf, window, jump)),
        tuple(j * s for j, s in zip(jump, stride)),
    )
