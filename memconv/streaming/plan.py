"""Exact receptive-field bookkeeping for streaming a stack of local layers.

A streamed network is analysed into nodes:

- :class:`Window`: a convolution or a pooling layer, described by kernel, stride,
  (left, right) padding and dilation per spatial axis, and the value its padding
  stands for (zero, or -inf for max pooling);
- :class:`Pointwise`: a layer acting on each position alone (activations,
  Dropout and normalisation in eval mode);
- :class:`Chain`: layers in sequence (``nn.Sequential``);
- :class:`Residual`: ``branch(x) + shortcut(x)`` with both branches local.

For a range of output positions, :meth:`Node.required` returns the input range it
needs (clipped to the input) and a plan recording, per window, how much of the
layer's own padding falls inside the range at the border; :meth:`Node.run` then
computes exactly those output positions from a crop of the input. Everything is
derived from kernel, stride, padding and dilation: nothing is probed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import CONV_TYPES
from ..conv.settings import record
from ..modules import apply_conv
from ..strategies.geometry import (
    ConvSpec,
    compose_receptive_field,
    conv_spec,
    input_range,
    pad_pairs,
    span,
    torch_pad_argument,
)

Range = tuple[tuple[int, int], ...]  # per spatial axis: [lo, hi)

#: Layers acting on each position alone (whatever their mode, unless listed below).
POINTWISE = (
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softplus,
    nn.Softsign,
    nn.Tanhshrink,
    nn.LogSigmoid,
)
#: Pointwise only in eval mode (in training they are random or couple positions).
POINTWISE_EVAL = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
BATCHNORMS = (nn.modules.batchnorm._BatchNorm,)
MAXPOOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
AVGPOOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


class NotStreamableError(ValueError):
    """A layer or configuration that cannot be streamed exactly."""


class Node:
    """A streamable piece of network (subclasses carry a ``name`` for messages)."""

    def out_size(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """Output spatial size for an input spatial size."""
        raise NotImplementedError

    def required(self, out: Range, size: tuple[int, ...]):
        """``(input range, plan)`` to compute the output positions ``out``."""
        raise NotImplementedError

    def run(self, x: Tensor, x_lo: tuple[int, ...], plan) -> Tensor:
        """Output positions of ``plan`` from ``x``, a crop starting at ``x_lo``."""
        raise NotImplementedError

    def windows(self):
        """All :class:`Window` nodes, in order."""
        return []

    def walk(self, rf: tuple[int, ...], jump: tuple[int, ...]):
        """``(rows, rf, jump)``: receptive field and output stride after this node, given
        those before it, and one row ``(window, rf, jump)`` per window inside."""
        return [], rf, jump


def crop(x: Tensor, rng: Range, origin=None) -> Tensor:
    """View of the positions ``rng`` of ``x``, a crop whose first position is ``origin``
    (default: position 0 on every axis)."""
    origin = origin or (0,) * len(rng)
    index = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(rng, origin))
    return x[(slice(None), slice(None), *index)]


@dataclass
class Window(Node):
    """A convolution or pooling layer (kernel, stride, padding, dilation per axis)."""

    module: nn.Module
    name: str
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    pad_mode: str  # "constant", "reflect" or "replicate"
    pad_value: float

    def span(self, axis: int) -> int:
        """Input positions one output position sees along ``axis``."""
        return span(self.kernel[axis], self.dilation[axis])

    def out_size(self, size):
        return tuple(
            (s + pl + pr - self.span(i)) // self.stride[i] + 1
            for i, (s, (pl, pr)) in enumerate(zip(size, self.padding))
        )

    def required(self, out, size):
        rng, pads = [], []
        for i, (o, s) in enumerate(zip(out, size)):
            r, p = input_range(o, self.stride[i], self.padding[i][0], self.span(i), s)
            rng.append(r)
            pads.append(p)
        return tuple(rng), (tuple(rng), tuple(pads))

    def run(self, x, x_lo, plan):
        rng, pads = plan
        x = crop(x, rng, x_lo)
        if any(p for pair in pads for p in pair):
            if self.pad_mode == "constant":
                x = F.pad(x, torch_pad_argument(pads), value=self.pad_value)
            else:  # one axis at a time: the modes are separable
                for axis, pair in enumerate(pads):
                    if any(pair):
                        one = [(0, 0)] * len(pads)
                        one[axis] = pair
                        x = F.pad(x, torch_pad_argument(one), mode=self.pad_mode)
        return self.apply(x)

    def walk(self, rf, jump):
        window = tuple(self.span(i) for i in range(len(self.kernel)))
        rf, jump = compose_receptive_field(rf, jump, window, self.stride)
        return [(self, rf, jump)], rf, jump

    def apply(self, x: Tensor) -> Tensor:
        """The layer on an input that already carries its padding."""
        m = self.module
        if isinstance(m, CONV_TYPES):
            geom = conv_spec(m).geometry.with_padding((0,) * len(self.kernel))
            if torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad):
                return apply_conv(
                    m, x, m.weight, m.bias, ConvSpec(geom, None, "constant"), record()
                )
            fn = (F.conv1d, F.conv2d, F.conv3d)[len(self.kernel) - 1]
            return fn(x, m.weight, m.bias, geom.stride, 0, geom.dilation, geom.groups)
        if isinstance(m, MAXPOOLS):
            fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[len(self.kernel) - 1]
            return fn(x, self.kernel, self.stride, 0, self.dilation)
        fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[len(self.kernel) - 1]
        kwargs = {}
        if len(self.kernel) > 1:
            kwargs["divisor_override"] = m.divisor_override
        return fn(x, self.kernel, self.stride, 0, **kwargs)

    def windows(self):
        return [self]


@dataclass
class Pointwise(Node):
    """A layer acting on each spatial position alone."""

    module: nn.Module
    name: str

    def out_size(self, size):
        return size

    def required(self, out, size):
        return out, out

    def run(self, x, x_lo, plan):
        return self.module(crop(x, plan, x_lo))


@dataclass
class Chain(Node):
    """Nodes in sequence."""

    nodes: list
    name: str = ""

    def out_size(self, size):
        for node in self.nodes:
            size = node.out_size(size)
        return size

    def sizes(self, size):
        out = [size]
        for node in self.nodes:
            out.append(node.out_size(out[-1]))
        return out

    def required(self, out, size):
        sizes = self.sizes(size)
        plans = []
        rng = out
        for node, s in zip(reversed(self.nodes), reversed(sizes[:-1])):
            new, plan = node.required(rng, s)
            plans.append((new, plan))
            rng = new
        plans.reverse()
        return rng, plans

    def run(self, x, x_lo, plan):
        for i, (node, (_, sub)) in enumerate(zip(self.nodes, plan)):
            x = node.run(x, x_lo, sub)
            if i + 1 < len(plan):  # x now holds exactly the next node's input range
                x_lo = starts(plan[i + 1][0])
        return x

    def windows(self):
        return [w for n in self.nodes for w in n.windows()]

    def walk(self, rf, jump):
        rows = []
        for node in self.nodes:
            more, rf, jump = node.walk(rf, jump)
            rows += more
        return rows, rf, jump


class Residual(nn.Module):
    """``branch(x) + shortcut(x)``: a residual block whose branches are both local.

    Args:
        branch: the main branch (e.g. conv–BN–ReLU–conv–BN).
        shortcut: the skip branch; ``None`` means the identity.

    Raises:
        ValueError (when streamed): if the branches' outputs do not line up.
    """

    def __init__(self, branch: nn.Module, shortcut: nn.Module | None = None):
        super().__init__()
        self.branch = branch
        self.shortcut = shortcut if shortcut is not None else nn.Identity()

    def forward(self, x):
        return self.branch(x) + self.shortcut(x)


@dataclass
class ResidualNode(Node):
    """Plan node of :class:`Residual`."""

    branch: Node
    shortcut: Node
    name: str = ""

    def out_size(self, size):
        a, b = self.branch.out_size(size), self.shortcut.out_size(size)
        if a != b:
            raise NotStreamableError(
                f"{self.name}: branch output {a} and shortcut output {b} differ for input {size}"
            )
        return a

    def required(self, out, size):
        ra, pa = self.branch.required(out, size)
        rb, pb = self.shortcut.required(out, size)
        hull = tuple((min(a[0], b[0]), max(a[1], b[1])) for a, b in zip(ra, rb))
        return hull, (hull, ra, pa, rb, pb)

    def run(self, x, x_lo, plan):
        hull, ra, pa, rb, pb = plan
        x = crop(x, hull, x_lo)
        lo = tuple(h[0] for h in hull)
        return self.branch.run(crop(x, ra, lo), starts(ra), pa) + self.shortcut.run(
            crop(x, rb, lo), starts(rb), pb
        )

    def windows(self):
        return self.branch.windows() + self.shortcut.windows()

    def walk(self, rf, jump):
        rows_a, rf_a, jump_a = self.branch.walk(rf, jump)
        rows_b, rf_b, jump_b = self.shortcut.walk(rf, jump)
        if jump_a != jump_b:
            raise NotStreamableError(
                f"{self.name}: branch stride {jump_a} and shortcut stride {jump_b} differ"
            )
        return rows_a + rows_b, tuple(max(a, b) for a, b in zip(rf_a, rf_b)), jump_a


def starts(rng: Range) -> tuple[int, ...]:
    """First position of a range on every axis."""
    return tuple(lo for lo, _ in rng)


def _pairs(values, dims):
    if isinstance(values, int):
        return (values,) * dims
    return tuple(values)


def analyse(module: nn.Module, name: str = "stream_layers") -> Node:
    """Turn a module into a plan :class:`Node`, or raise naming the first bad layer.

    Raises:
        NotStreamableError: for a layer that is not local (global or adaptive
            pooling, BatchNorm in training mode, normalisation over space,
            attention, Linear, Flatten, ...) or a configuration that cannot be
            streamed exactly (``ceil_mode``, circular padding, ``return_indices``,
            average pooling with ``count_include_pad=False`` and padding).
    """
    if isinstance(module, nn.Sequential):
        return Chain([analyse(m, f"{name}.{k}") for k, m in module.named_children()], name)
    if isinstance(module, Residual):
        return ResidualNode(
            analyse(module.branch, f"{name}.branch"),
            analyse(module.shortcut, f"{name}.shortcut"),
            name,
        )
    if isinstance(module, POINTWISE):
        return Pointwise(module, name)
    if isinstance(module, POINTWISE_EVAL + BATCHNORMS):
        if module.training:
            raise NotStreamableError(
                f"{name} ({type(module).__name__}) in training mode is not local "
                "(batch statistics / random masks); call .eval() on it"
            )
        return Pointwise(module, name)
    if isinstance(module, CONV_TYPES):
        if module.padding_mode == "circular":
            raise NotStreamableError(
                f"{name}: padding_mode='circular' wraps around the image, which is not "
                "local; use 'zeros', 'reflect' or 'replicate'"
            )
        d = len(module.kernel_size)
        spec = conv_spec(module)
        pairs = [(p, p) for p in spec.geometry.padding]
        if spec.pre_pad is not None:
            pairs = [(a + c, b + e) for (a, b), (c, e) in zip(pairs, pad_pairs(spec.pre_pad))]
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        return Window(
            module=module,
            name=name,
            kernel=tuple(module.kernel_size),
            stride=tuple(module.stride),
            padding=tuple(pairs),
            dilation=tuple(module.dilation),
            pad_mode=mode,
            pad_value=0.0,
        )
    if isinstance(module, MAXPOOLS + AVGPOOLS):
        d = int(type(module).__name__[-2])
        if module.ceil_mode:
            raise NotStreamableError(f"{name}: ceil_mode=True cannot be streamed exactly")
        if getattr(module, "return_indices", False):
            raise NotStreamableError(f"{name}: return_indices=True cannot be streamed")
        pad = _pairs(module.padding, d)
        if isinstance(module, AVGPOOLS) and not module.count_include_pad and any(pad):
            raise NotStreamableError(
                f"{name}: count_include_pad=False with padding cannot be streamed exactly"
            )
        kernel = _pairs(module.kernel_size, d)
        stride = _pairs(module.stride if module.stride is not None else module.kernel_size, d)
        dilation = _pairs(getattr(module, "dilation", 1), d)
        value = -math.inf if isinstance(module, MAXPOOLS) else 0.0
        return Window(
            module, name, kernel, stride, tuple((p, p) for p in pad), dilation, "constant", value
        )
    raise NotStreamableError(
        f"{name} ({type(module).__name__}) is not a local layer memconv can stream; "
        "supported: Conv1d/2d/3d, Max/AvgPool with finite kernels, element-wise "
        "activations, Dropout and BatchNorm in eval mode, nn.Sequential and "
        "memconv.streaming.Residual"
    )
