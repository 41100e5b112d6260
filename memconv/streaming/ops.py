"""The local operations a streamed graph is made of, and their window arithmetic.

Every node of the traced trunk that reads the image's data is one of four kinds:

- :class:`Window`: a convolution, a max or average pooling, or a padding (``F.pad``,
  ``nn.ZeroPad2d``...): kernel span, stride and (left, right) padding per spatial axis,
  and what the padding stands for (zeros, -inf for max pooling, reflect or replicate);
- :class:`Transposed`: a transposed convolution;
- :class:`Upsample`: nearest or (bi/tri)linear upsampling by an integer scale with
  ``align_corners=False``;
- :class:`Local`: an operation acting on each position alone (activations,
  BatchNorm and Dropout in eval mode, LayerNorm/RMSNorm and ``Linear`` over the channel
  axis, broadcast arithmetic with parameters or constants, ``torch.cat`` along the
  channels, permutes, identity).

For the output positions ``[lo, hi)`` along one axis, :meth:`Op.need` gives the input
positions they read, clipped to the input, with the op's padding that falls outside
the input (applied only there: at the image border, so every value equals the
conventional one) and the output positions to drop when the crop had to be widened
(reflect padding needs the positions it mirrors). :meth:`Op.run` computes those output
positions from that crop. Everything is derived from the op's arguments: nothing is
probed with test images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import CONV_TRANSPOSE_TYPES, CONV_TYPES
from ..conv.settings import record
from ..modules import apply_conv
from ..strategies.geometry import (
    ConvSpec,
    conv_function,
    conv_spec,
    torch_pad_argument,
)
from .errors import NotStreamableError


@dataclass(frozen=True)
class Need:
    """The input positions an output range reads along one axis.

    Attributes:
        lo, hi: the crop ``[lo, hi)`` of the input (inside it).
        pad_lo, pad_hi: positions of the op's padding before and after the crop (at the
            input's border, or zeros a transposed convolution adds).
        skip: output positions the op computes from the crop before the first one asked
            for (when the crop was widened on the low side).
    """

    lo: int
    hi: int
    pad_lo: int = 0
    pad_hi: int = 0
    skip: int = 0


def clip(lo: int, hi: int, size: int, skip: int = 0) -> Need:
    """The virtual range ``[lo, hi)`` (possibly reaching past the input) as a crop of an
    input of ``size`` positions and the padding outside it."""
    c_lo = min(max(lo, 0), size)
    c_hi = max(min(hi, size), c_lo)
    if c_hi == c_lo:  # nothing of the input: all padding, on one side
        return Need(c_lo, c_lo, hi - lo, 0, skip) if lo < 0 else Need(c_lo, c_lo, 0, hi - lo, skip)
    return Need(c_lo, c_hi, c_lo - lo, hi - c_hi, skip)


class Op:
    """A local operation (see the module docstring).

    Attributes:
        name: how messages name it (module path and type, or the function).
        slots: how many data inputs it reads (all with the same ranges).
    """

    def out_size(self, axis: int, size: int) -> int:
        """Output positions along ``axis`` for an input of ``size`` positions."""
        return size

    def need(self, axis: int, lo: int, hi: int, size: int) -> Need:
        """The input crop (and padding) that output positions ``[lo, hi)`` read."""
        return Need(lo, hi)

    def run(self, env, inputs: list[Tensor], needs: tuple[Need, ...], out) -> Tensor:
        """The output positions ``out`` (``(lo, hi)`` per spatial axis) from the input
        crops ``inputs`` (one per slot, each covering ``needs``, one :class:`Need` per
        spatial axis)."""
        raise NotImplementedError

    def window(self, axis: int) -> tuple[int, int] | None:
        """``(kernel span, stride)`` along ``axis`` for reports; None for position-wise
        operations."""
        return None


# ------------------------------------------------------------------ windows
@dataclass
class Window(Op):
    """A convolution, pooling or padding: kernel span, stride and (left, right) padding
    per spatial axis.

    Attributes:
        apply: ``apply(env, x, padding)`` runs the operation with a symmetric padding
            per axis (zeros, or -inf for max pooling: the operation's own) on a crop that
            carries the rest of it.
        mode: "constant", "reflect" or "replicate"; ``value`` for "constant".
        native: whether ``apply``'s own padding stands for ``value`` (convolutions,
            pooling); a crop at the border then needs no padded copy.
    """

    name: str
    span: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    apply: Any
    mode: str = "constant"
    value: float = 0.0
    native: bool = False

    def out_size(self, axis, size):
        (pl, ph), w, s = self.padding[axis], self.span[axis], self.stride[axis]
        return (size + pl + ph - w) // s + 1

    def need(self, axis, lo, hi, size):
        w, s, pl = self.span[axis], self.stride[axis], self.padding[axis][0]
        need = clip(lo * s - pl, (hi - 1) * s - pl + w, size)
        if self.mode == "constant" or not (need.pad_lo or need.pad_hi):
            return need
        # reflect/replicate read the positions next to the border: the crop must hold them
        lend = max(need.pad_lo, need.pad_hi) + 1 if self.mode == "reflect" else 1
        if need.hi - need.lo >= lend or size < lend:
            return need
        if s != 1:
            raise _narrow_tile(self.name, self.mode, lend)
        c_lo, c_hi = need.lo, need.hi
        if need.pad_lo:
            c_hi = min(max(c_hi, c_lo + lend), size)
        if need.pad_hi:
            c_lo = max(min(c_lo, c_hi - lend), 0)
        return Need(c_lo, c_hi, need.pad_lo, need.pad_hi, need.lo - c_lo)

    def run(self, env, inputs, needs, out):
        x = inputs[0]
        explicit, native, skip = [], [], []
        for axis, n in enumerate(needs):
            pad, extra = self._native(axis, n.pad_lo, n.pad_hi)
            native.append(pad)
            skip.append(n.skip + extra)
            explicit.append((n.pad_lo, n.pad_hi) if pad is None else (0, 0))
        native = [p or 0 for p in native]
        if any(p for pair in explicit for p in pair):
            if self.mode == "constant":
                x = F.pad(x, torch_pad_argument(explicit), value=self.value)
            else:  # one axis at a time: the modes are separable
                for axis, pair in enumerate(explicit):
                    if any(pair):
                        one = [(0, 0)] * len(explicit)
                        one[axis] = pair
                        x = F.pad(x, torch_pad_argument(one), mode=self.mode)
        return cut(self.apply(env, x, tuple(native)), skip, out)

    def _native(self, axis: int, lo: int, hi: int) -> tuple[int | None, int]:
        """``(symmetric padding the op applies itself, outputs it adds before the asked-for
        ones)`` for a crop missing ``lo`` and ``hi`` positions of padding, or ``(None, 0)``
        when the padding must be applied to the crop (a copy)."""
        if not self.native or not (lo or hi):
            return (0, 0) if not (lo or hi) else (None, 0)
        pad = max(lo, hi)
        if 2 * pad > self.span[axis] - 1 + (self.span[axis] == 1):
            return None, 0  # more than torch lets the op pad itself
        if lo == hi or hi == 0:  # zeros past the far side only add outputs at the end
            return pad, 0
        if lo == 0 and hi % self.stride[axis] == 0:  # zeros before: whole outputs before
            return pad, hi // self.stride[axis]
        return None, 0

    def window(self, axis):
        return self.span[axis], self.stride[axis]


def _narrow_tile(name: str, mode: str, positions: int) -> NotStreamableError:
    return NotStreamableError(
        f"{name}: {mode} padding at the border reads {positions} positions of the input, "
        "more than a tile gives this strided layer; use a larger tile_size"
    )


@dataclass
class Transposed(Op):
    """A transposed convolution (kernel span, stride, padding per axis).

    Output position ``o`` receives input positions ``i`` with ``o = i·s - p + j·d``.
    The crop is widened with zeros (which add nothing) so that the convolution of the
    crop covers the asked-for outputs; they are then cut out of its result.
    """

    name: str
    span: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    output_padding: tuple[int, ...]
    apply: Any

    def out_size(self, axis, size):
        s, p, w, op = (
            self.stride[axis],
            self.padding[axis],
            self.span[axis],
            self.output_padding[axis],
        )
        return (size - 1) * s - 2 * p + w + op

    def need(self, axis, lo, hi, size):
        s, p, w = self.stride[axis], self.padding[axis], self.span[axis]
        first = min(-((w - 1 - lo - p) // s), (lo + p) // s)  # ceil((lo+p-w+1)/s), floor
        last = max((hi - 1 + p) // s + 1, -((w - hi - p) // s) + 1)
        return clip(first, last, size, lo - (first * s - p))

    def run(self, env, inputs, needs, out):
        x = F.pad(inputs[0], torch_pad_argument([(n.pad_lo, n.pad_hi) for n in needs]))
        return cut(self.apply(env, x), [n.skip for n in needs], out)

    def window(self, axis):
        return self.span[axis], self.stride[axis]


@dataclass
class Upsample(Op):
    """Nearest or (bi/tri)linear upsampling by an integer scale per axis,
    ``align_corners=False``: output ``o`` reads input ``floor(o/s)`` (nearest) or the two
    inputs around ``(o + 0.5)/s - 0.5`` (linear, clamped at the border)."""

    name: str
    scale: tuple[int, ...]
    mode: str
    scale_factor: Any  # as the call gave it, so that torch computes the same source indices

    def out_size(self, axis, size):
        return size * self.scale[axis]

    def need(self, axis, lo, hi, size):
        s = self.scale[axis]
        if self.mode == "nearest":
            first, last = lo // s, (hi - 1) // s + 1
        else:  # floor((2o + 1 - s) / 2s), widened by one: float round-off never leaves it
            first = max((2 * lo + 1 - s) // (2 * s) - 1, 0)
            last = min(max((2 * hi - 1 - s) // (2 * s), 0) + 3, size)
        return Need(first, last, 0, 0, lo - first * s)

    def run(self, env, inputs, needs, out):
        kwargs = {} if self.mode == "nearest" else {"align_corners": False}
        y = F.interpolate(inputs[0], scale_factor=self.scale_factor, mode=self.mode, **kwargs)
        return cut(y, [n.skip for n in needs], out)

    def window(self, axis):
        return 1, 1


# ------------------------------------------------------------------ position-wise
@dataclass
class Local(Op):
    """An operation acting on each position alone; ``call(env, *inputs)`` runs it on
    crops (all inputs cover the same positions).

    Attributes:
        inplace: the in-place form the trunk's ``forward`` wrote (``nn.ReLU(inplace=True)``,
            ``out += identity``), run instead where nothing else reads the input (as in
            eager mode, so a tile keeps no more tensors than the conventional pass); None
            for an out-of-place call.
        fresh: whether the call returns a new tensor (not its input or a view of it).
    """

    name: str
    call: Any
    slots: int = 1
    inplace: Any = None
    fresh: bool = True

    def run(self, env, inputs, needs, out, in_place: bool = False):
        return (self.inplace if in_place else self.call)(env, *inputs)


# ------------------------------------------------------------------ applies
@dataclass
class ConvApply:
    """A convolution (padding given per call; the crop carries the rest) or a transposed
    convolution (padding 0 on a zero-widened crop, whose result is cut to the asked-for
    positions by :meth:`Transposed.need`'s ``skip``): memconv's autograd function for
    modules inside a ``save_memory``/``per_sample`` block (so they apply to the tiles),
    torch's own functions otherwise and for a weight computed in a ``forward``."""

    module: Any
    weight: Any
    bias: Any
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transposed: bool = False

    def __call__(self, env, x: Tensor, padding: tuple[int, ...] | None = None) -> Tensor:
        weight, bias = env.value(self.weight), env.value(self.bias)
        dims = x.dim() - 2
        padding = padding or (0,) * dims
        m = self.module
        recorded = _block_open(x, weight)
        if recorded is not None and isinstance(m, CONV_TRANSPOSE_TYPES + CONV_TYPES):
            geom = conv_spec(m).geometry.with_padding(padding)
            spec = ConvSpec(geom, None, "constant", self.transposed)
            output_padding = (0,) * dims if self.transposed else None
            return apply_conv(m, x, weight, bias, spec, recorded, output_padding)
        if self.transposed:
            fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
            return fn(x, weight, bias, self.stride, 0, 0, self.groups, self.dilation)
        fn = conv_function(dims)
        return fn(x, weight, bias, self.stride, padding, self.dilation, self.groups)


def _block_open(x: Tensor, weight: Tensor):
    """What a ``save_memory``/``per_sample`` block records for a module's convolution
    whose graph is built, or None (no block open, or no graph: torch's own kernels)."""
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return None
    recorded = record()
    return recorded if recorded.settings is not None or recorded.per_sample else None


def pool_apply(kind: str, kernel, stride, dilation, divisor_override):
    """``apply(env, x, padding)`` of a max or average pooling (``count_include_pad``:
    padded zeros count, as the explicit padding does)."""
    dims = len(kernel)

    def apply(env, x, padding):
        if kind == "max":
            fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dims - 1]
            return fn(x, kernel, stride, padding, dilation)
        fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[dims - 1]
        extra = {"divisor_override": divisor_override} if dims > 1 else {}
        return fn(x, kernel, stride, padding, False, True, **extra)

    return apply


def identity_apply(env, x, padding):
    """A padding's operation once its padding is applied: nothing."""
    return x


def cut(y: Tensor, skip, out) -> Tensor:
    """The asked-for positions ``out`` (``(lo, hi)`` per axis) of an op's ``[N, C, *S]``
    result, whose first ``skip`` positions per axis come before them."""
    index = [slice(None), slice(None)]
    trimmed = False
    for k, (lo, hi), size in zip(skip, out, y.shape[2:]):
        trimmed = trimmed or k or size != hi - lo
        index.append(slice(k, k + hi - lo))
    return y[tuple(index)] if trimmed else y


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -((-a) // b)


__all__ = [
    "ConvApply",
    "Local",
    "Need",
    "Op",
    "Transposed",
    "Upsample",
    "Window",
    "ceil_div",
    "clip",
    "cut",
    "identity_apply",
    "pool_apply",
]
