"""Which traced operation is which local op, and the refusal of every other one.

:func:`classify` reads one node of the traced trunk that takes the image's data and
returns its :class:`~memconv.streaming.ops.Op` and the layout of its result, or raises
:class:`NotStreamableError` naming the operation, the module path that calls it and
the remedy: global or adaptive pooling (a squeeze-and-excitation block), batch
statistics, normalisation over space, attention, random operations, ``align_corners=
True``, reshapes and slices of the spatial axes.

A *layout* is the role of each axis of a tensor: ``"N"`` (the batch), ``"C"`` (the
channels) or a spatial axis index. The image is ``("N", "C", 0, 1)``; ConvNeXt's
permute to channels-last gives ``("N", 0, 1, "C")``, where ``LayerNorm`` and ``Linear``
act over the channels of each position.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .._checks import CONV_TRANSPOSE_TYPES, CONV_TYPES
from ..layers.conv import CONV_ARGS, CONV_DEFAULTS, CONV_T_ARGS, CONV_T_DEFAULTS
from ..strategies.geometry import conv_spec, pad_pairs, span
from .errors import REMEDY, NotStreamableError
from .ops import (
    ConvApply,
    Local,
    Transposed,
    Upsample,
    Window,
    identity_apply,
    pool_apply,
)
from .trace import inplace_kind, module_of, op_name, out_of_place

#: Modules acting on each position alone, whatever their mode.
POINTWISE_MODULES = (
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
    nn.Threshold,
    nn.Hardshrink,
    nn.Softshrink,
    nn.LocalResponseNorm,
)
#: Random in training mode (unless their probability is 0), the identity in eval mode.
DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
MAXPOOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
AVGPOOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
PADS = {
    nn.ZeroPad1d: "constant",
    nn.ZeroPad2d: "constant",
    nn.ZeroPad3d: "constant",
    nn.ConstantPad1d: "constant",
    nn.ConstantPad2d: "constant",
    nn.ConstantPad3d: "constant",
    nn.ReflectionPad1d: "reflect",
    nn.ReflectionPad2d: "reflect",
    nn.ReflectionPad3d: "reflect",
    nn.ReplicationPad1d: "replicate",
    nn.ReplicationPad2d: "replicate",
    nn.ReplicationPad3d: "replicate",
    nn.CircularPad1d: "circular",
    nn.CircularPad2d: "circular",
    nn.CircularPad3d: "circular",
}
SOFTMAXES = (nn.Softmax, nn.LogSoftmax, nn.Softmin)
CHANNEL_NORMS = (nn.LayerNorm, nn.RMSNorm)

_f = F
#: Functions acting on each position alone (their tensor arguments broadcast).
POINTWISE_FUNCTIONS = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.neg,
    operator.pos,
    operator.pow,
    operator.abs,
    torch.add,
    torch.sub,
    torch.subtract,
    torch.mul,
    torch.multiply,
    torch.div,
    torch.divide,
    torch.true_divide,
    torch.neg,
    torch.negative,
    torch.abs,
    torch.exp,
    torch.expm1,
    torch.log,
    torch.log1p,
    torch.sqrt,
    torch.rsqrt,
    torch.square,
    torch.pow,
    torch.clamp,
    torch.clip,
    torch.clamp_min,
    torch.clamp_max,
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    torch.sin,
    torch.cos,
    torch.erf,
    torch.maximum,
    torch.minimum,
    torch.where,
    torch.sign,
    torch.reciprocal,
    torch.addcmul,
    torch.lerp,
    torch.selu,
    torch.celu,
    torch.nan_to_num,
    _f.relu,
    _f.relu6,
    _f.elu,
    _f.selu,
    _f.celu,
    _f.gelu,
    _f.silu,
    _f.mish,
    _f.hardswish,
    _f.hardsigmoid,
    _f.hardtanh,
    _f.leaky_relu,
    _f.prelu,
    _f.softplus,
    _f.softsign,
    _f.tanhshrink,
    _f.logsigmoid,
    _f.sigmoid,
    _f.tanh,
    _f.threshold,
    _f.hardshrink,
    _f.softshrink,
    _f.local_response_norm,
}
POINTWISE_METHODS = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "true_divide",
        "neg",
        "abs",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "square",
        "pow",
        "clamp",
        "clip",
        "clamp_min",
        "clamp_max",
        "relu",
        "sigmoid",
        "tanh",
        "sin",
        "cos",
        "erf",
        "sign",
        "reciprocal",
        "maximum",
        "minimum",
        "contiguous",
        "clone",
        "float",
        "double",
        "half",
        "bfloat16",
        "to",
        "type",
        "type_as",
        "detach",
        "__add__",
        "__radd__",
        "__sub__",
        "__rsub__",
        "__mul__",
        "__rmul__",
        "__truediv__",
        "__neg__",
    }
)
DROPOUT_FUNCTIONS = {
    _f.dropout: 2,
    _f.alpha_dropout: 2,
    _f.feature_alpha_dropout: 2,
    _f.dropout1d: 2,
    _f.dropout2d: 2,
    _f.dropout3d: 2,
}
CONV_FUNCTIONS = {_f.conv1d: 1, _f.conv2d: 2, _f.conv3d: 3}
CONV_T_FUNCTIONS = {_f.conv_transpose1d: 1, _f.conv_transpose2d: 2, _f.conv_transpose3d: 3}
MAXPOOL_FUNCTIONS = {_f.max_pool1d: 1, _f.max_pool2d: 2, _f.max_pool3d: 3}
AVGPOOL_FUNCTIONS = {_f.avg_pool1d: 1, _f.avg_pool2d: 2, _f.avg_pool3d: 3}
INTERPOLATES = {_f.interpolate, _f.upsample, _f.upsample_nearest, _f.upsample_bilinear}
CATS = {torch.cat, torch.concat, torch.concatenate}
SOFTMAX_FUNCTIONS = {_f.softmax, _f.log_softmax, _f.softmin, torch.softmax, torch.log_softmax}
REDUCTIONS = frozenset(
    {"mean", "sum", "amax", "amin", "max", "min", "std", "var", "norm", "logsumexp", "prod"}
)
RESHAPES = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "narrow",
        "split",
        "chunk",
        "unbind",
        "stack",
        "roll",
        "flip",
        "rot90",
        "getitem",
        "__getitem__",
        "repeat",
        "tile",
        "select",
        "index_select",
        "gather",
        "pixel_shuffle",
        "pixel_unshuffle",
        "unfold",
        "fold",
    }
)
ATTENTION = frozenset(
    {
        "scaled_dot_product_attention",
        "multi_head_attention_forward",
        "matmul",
        "bmm",
        "einsum",
        "baddbmm",
        "mm",
        "__matmul__",
    }
)
RANDOM = frozenset(
    {
        "rand",
        "randn",
        "rand_like",
        "randn_like",
        "bernoulli",
        "bernoulli_",
        "normal",
        "normal_",
        "uniform_",
        "randint",
        "multinomial",
        "rrelu",
        "fractional_max_pool2d",
    }
)

#: Why each family of operations cannot be streamed.
GLOBAL = (
    "global/adaptive pooling (or a reduction over the spatial axes) reads every position "
    "of its input, as a squeeze-and-excitation block does, so no tile can compute it alone"
)
SPACE_NORM = "normalises over the spatial axes, so every position depends on the whole image"
BATCH_STATS = (
    "uses batch statistics (training mode), which depend on the whole image; call .eval() "
    "on it (its affine weight and bias are still trained, exactly), or"
)
ATTENTION_WHY = "mixes every position with every other (attention or a matrix product)"
RANDOM_WHY = (
    "draws random numbers (e.g. Dropout or stochastic depth in training mode), which tiles "
    "cannot reproduce; call .eval() on it, or"
)
RESHAPE_WHY = "slices, reshapes or moves the spatial positions, which is not local"
#: Module types refused, and why.
REFUSED_MODULES = (
    (
        (
            nn.AdaptiveAvgPool1d,
            nn.AdaptiveAvgPool2d,
            nn.AdaptiveAvgPool3d,
            nn.AdaptiveMaxPool1d,
            nn.AdaptiveMaxPool2d,
            nn.AdaptiveMaxPool3d,
        ),
        GLOBAL,
    ),
    ((nn.GroupNorm, nn.modules.instancenorm._InstanceNorm), SPACE_NORM),
    (
        (
            nn.MultiheadAttention,
            nn.Transformer,
            nn.TransformerEncoderLayer,
            nn.TransformerDecoderLayer,
            nn.TransformerEncoder,
            nn.TransformerDecoder,
        ),
        ATTENTION_WHY,
    ),
    (
        (
            nn.Flatten,
            nn.Unflatten,
            nn.PixelShuffle,
            nn.PixelUnshuffle,
            nn.Unfold,
            nn.Fold,
            nn.ChannelShuffle,
        ),
        RESHAPE_WHY,
    ),
    (
        (nn.FractionalMaxPool2d, nn.FractionalMaxPool3d),
        RANDOM_WHY.replace("; call .eval() on it, or", ";"),
    ),
)


@dataclass
class NodeCall:
    """A traced call, run on tensors: its data arguments replaced by crops, the others
    read from the environment (parameters, constants, values from the full image's
    shapes), in-place forms run out of place."""

    kind: str
    target: Any
    args: tuple
    kwargs: dict
    slots: list = field(default_factory=list)

    def __call__(self, env, *inputs):
        data = dict(zip(self.slots, inputs))

        def sub(n):
            return data[n] if n in data else env.value(n)

        args, kwargs = fx.node.map_arg(self.args, sub), fx.node.map_arg(self.kwargs, sub)
        if self.kind == "call_module":
            return env.call_module(self.target, args, kwargs)
        if self.kind == "call_function":
            return self.target(*args, **kwargs)
        return getattr(args[0], self.target)(*args[1:], **kwargs)


@dataclass
class Context:
    """What :func:`classify` reads about a node's surroundings.

    Attributes:
        root: the trunk.
        name: how messages name it.
        is_data: ``is_data(node)``: whether a node carries the image's data.
        layout: ``layout(node)``: a data node's layout.
        meta: ``meta(x)``: an argument's value with tensors on the meta device (data
            nodes at the full image's shape), python values computed.
        dims: spatial axes.
    """

    root: nn.Module
    name: str
    is_data: Any
    layout: Any
    meta: Any
    dims: int


@dataclass
class Classified:
    """A node's op, the layout of its result and the call that computes it (for the
    shapes; window ops compute theirs from their geometry)."""

    op: Any
    layout: tuple
    call: NodeCall | None = None
    out_channels: int | None = None


def where(node: fx.Node, ctx: Context) -> str:
    """``stream_layers.layer1.0 (BasicBlock) calls operator.add``-style name of a node."""
    path, kind = module_of(ctx.root, node)
    full = f"{ctx.name}.{path}" if path else ctx.name
    if node.op == "call_module":
        return f"{full} ({kind})"
    return f"{full} ({kind}) calls {op_name(node)}"


def refuse(node: fx.Node, ctx: Context, why: str) -> NotStreamableError:
    """The error naming the operation, the module path that calls it and the remedy."""
    return NotStreamableError(f"{where(node, ctx)}: {why}; {REMEDY}")


def _bind(names: tuple, defaults: dict, node: fx.Node) -> dict:
    out = dict(defaults)
    out.update(zip(names, node.args))
    out.update(node.kwargs)
    return out


def _tuple(value, dims: int) -> tuple:
    if isinstance(value, (int, float)):
        return (value,) * dims
    value = tuple(value)
    return value * dims if len(value) == 1 else value


def _data_slots(node: fx.Node, ctx: Context) -> list:
    slots: list = []

    def collect(n):
        if ctx.is_data(n) and n not in slots:
            slots.append(n)
        return n

    fx.node.map_arg((node.args, node.kwargs), collect)
    return slots


def _call(node: fx.Node, ctx: Context, module=None) -> NodeCall:
    kind, target, kwargs = out_of_place(node)
    if kind == "call_module":
        target = module if module is not None else ctx.root.get_submodule(node.target)
    args = node.args
    position = _inplace_position(node)
    if position is not None and len(args) > position and args[position] is True:
        args = (*args[:position], False, *args[position + 1 :])
    return NodeCall(kind, target, args, kwargs, _data_slots(node, ctx))


def _inplace_position(node):
    from .trace import inplace_position

    return inplace_position(node)


def _without_inplace(module: nn.Module) -> nn.Module:
    """``module``, or a shallow copy of it run out of place (parameters shared)."""
    if not getattr(module, "inplace", False):
        return module
    copy = nn.Module.__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy.inplace = False
    return copy


# ------------------------------------------------------------------ the entry point
def classify(node: fx.Node, ctx: Context) -> Classified:
    """The local op a data node is, or the refusal naming it.

    Raises:
        NotStreamableError: for an operation that is not local (see the module
            docstring), naming the operation, the module path and the remedy.
    """
    slots = _data_slots(node, ctx)
    if node.op == "call_module":
        return _module(node, ctx, ctx.root.get_submodule(node.target), slots)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    name = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    if node.op == "call_function":
        return _function(node, ctx, name, slots)
    return _method(node, ctx, name, slots)


def _first_is_data(node, ctx, slots, what: str):
    if len(slots) != 1 or not node.args or node.args[0] is not slots[0]:
        raise refuse(node, ctx, f"{what} computed from the image (a dynamic {what}) is not local")


def _module(node, ctx, m, slots) -> Classified:
    kind = type(m).__name__
    layout = ctx.layout(slots[0])
    if isinstance(m, CONV_TYPES):
        _first_is_data(node, ctx, slots, "input")
        return _conv_module(node, ctx, m)
    if isinstance(m, CONV_TRANSPOSE_TYPES):
        _first_is_data(node, ctx, slots, "input")
        return _conv_t(
            node,
            ctx,
            m.weight,
            m.bias,
            m.stride,
            m.padding,
            m.dilation,
            m.groups,
            m.output_padding,
            _output_size_arg(node, ctx),
            m.out_channels,
            m,
        )
    if isinstance(m, MAXPOOLS + AVGPOOLS):
        _standard(node, ctx, layout)
        d = int(kind[-2])
        return _pool(
            node,
            ctx,
            "max" if isinstance(m, MAXPOOLS) else "avg",
            d,
            {
                "kernel_size": m.kernel_size,
                "stride": m.stride,
                "padding": m.padding,
                "dilation": getattr(m, "dilation", 1),
                "ceil_mode": m.ceil_mode,
                "return_indices": getattr(m, "return_indices", False),
                "count_include_pad": getattr(m, "count_include_pad", True),
                "divisor_override": getattr(m, "divisor_override", None),
            },
        )
    if type(m) in PADS:
        _standard(node, ctx, layout)
        return _pad(node, ctx, m.padding, PADS[type(m)], getattr(m, "value", 0.0))
    if isinstance(m, nn.Upsample):
        _standard(node, ctx, layout)
        return _upsample(node, ctx, m.size, m.scale_factor, m.mode, m.align_corners)
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        if m.training or m.running_mean is None:
            raise refuse(node, ctx, BATCH_STATS)
        _channel_at(node, ctx, layout, 1)
        return _local(node, ctx, layout, _without_inplace(m))
    if isinstance(m, DROPOUTS):
        if m.training and m.p > 0:
            raise refuse(node, ctx, RANDOM_WHY)
        return _local(node, ctx, layout, m)
    if isinstance(m, nn.RReLU):
        if m.training:
            raise refuse(node, ctx, RANDOM_WHY)
        return _local(node, ctx, layout, _without_inplace(m))
    if isinstance(m, POINTWISE_MODULES):
        if isinstance(m, nn.LocalResponseNorm):
            _channel_at(node, ctx, layout, 1)
        return _local(node, ctx, layout, _without_inplace(m))
    if isinstance(m, CHANNEL_NORMS):
        _over_channels(node, ctx, layout, tuple(m.normalized_shape))
        return _local(node, ctx, layout, m)
    if isinstance(m, nn.Linear):
        _channel_at(node, ctx, layout, -1)
        return _local(node, ctx, layout, m)
    if isinstance(m, nn.Softmax2d):
        _channel_at(node, ctx, layout, -3)
        return _local(node, ctx, layout, m)
    if isinstance(m, SOFTMAXES):
        _channel_at(node, ctx, layout, m.dim if m.dim is not None else 1)
        return _local(node, ctx, layout, m)
    for types, why in REFUSED_MODULES:
        if isinstance(m, types):
            raise refuse(node, ctx, why)
    raise refuse(node, ctx, _unsupported())


def _unsupported() -> str:
    return (
        "is not an operation memconv can stream (supported: convolutions and transposed "
        "convolutions, max/average pooling, padding, element-wise activations, BatchNorm "
        "and Dropout in eval mode, LayerNorm/RMSNorm/Linear over the channels, broadcast "
        "arithmetic with parameters, torch.cat along the channels, nearest or linear "
        "upsampling by an integer scale)"
    )


def _function(node, ctx, name, slots) -> Classified:
    target = node.target
    layout = ctx.layout(slots[0])
    if target in CONV_FUNCTIONS:
        _first_is_data(node, ctx, slots, "input")
        a = _bind(CONV_ARGS, CONV_DEFAULTS, node)
        return _conv_functional(node, ctx, a, CONV_FUNCTIONS[target])
    if target in CONV_T_FUNCTIONS:
        _first_is_data(node, ctx, slots, "input")
        a = _bind(CONV_T_ARGS, CONV_T_DEFAULTS, node)
        weight = ctx.meta(a["weight"])
        d = CONV_T_FUNCTIONS[target]
        return _conv_t(
            node,
            ctx,
            a["weight"],
            a["bias"],
            _tuple(a["stride"], d),
            _tuple(a["padding"], d),
            _tuple(a["dilation"], d),
            a["groups"],
            _tuple(ctx.meta(a["output_padding"]), d),
            None,
            weight.shape[1] * a["groups"],
            None,
        )
    if target in MAXPOOL_FUNCTIONS or target in AVGPOOL_FUNCTIONS:
        _first_is_data(node, ctx, slots, "input")
        _standard(node, ctx, layout)
        is_max = target in MAXPOOL_FUNCTIONS
        d = (MAXPOOL_FUNCTIONS if is_max else AVGPOOL_FUNCTIONS)[target]
        names = ("input", "kernel_size", "stride", "padding")
        names += (
            ("dilation", "ceil_mode", "return_indices")
            if is_max
            else ("ceil_mode", "count_include_pad", "divisor_override")
        )
        a = _bind(
            names,
            {
                "stride": None,
                "padding": 0,
                "dilation": 1,
                "ceil_mode": False,
                "return_indices": False,
                "count_include_pad": True,
                "divisor_override": None,
            },
            node,
        )
        return _pool(
            node, ctx, "max" if is_max else "avg", d, {k: ctx.meta(v) for k, v in a.items()}
        )
    if target is F.pad:
        _first_is_data(node, ctx, slots, "input")
        _standard(node, ctx, layout)
        a = _bind(("input", "pad", "mode", "value"), {"mode": "constant", "value": None}, node)
        value = ctx.meta(a["value"])
        return _pad(node, ctx, tuple(ctx.meta(a["pad"])), ctx.meta(a["mode"]), value or 0.0)
    if target in INTERPOLATES:
        _first_is_data(node, ctx, slots, "input")
        _standard(node, ctx, layout)
        a = _bind(
            ("input", "size", "scale_factor", "mode", "align_corners"),
            {"size": None, "scale_factor": None, "mode": "nearest", "align_corners": None},
            node,
        )
        if target is F.upsample_bilinear:
            a["mode"], a["align_corners"] = "bilinear", True
        return _upsample(
            node,
            ctx,
            ctx.meta(a["size"]),
            ctx.meta(a["scale_factor"]),
            ctx.meta(a["mode"]),
            ctx.meta(a["align_corners"]),
        )
    if target is F.batch_norm:
        a = _bind(
            ("input", "running_mean", "running_var", "weight", "bias", "training"),
            {"training": False},
            node,
        )
        if ctx.meta(a["training"]) or a["running_mean"] is None:
            raise refuse(node, ctx, BATCH_STATS)
        _channel_at(node, ctx, layout, 1)
        return _local(node, ctx, layout)
    if target in (F.layer_norm, getattr(F, "rms_norm", None)):
        shape = ctx.meta(node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"])
        _over_channels(node, ctx, layout, tuple(shape) if not isinstance(shape, int) else (shape,))
        return _local(node, ctx, layout)
    if target is F.linear:
        _channel_at(node, ctx, layout, -1)
        return _local(node, ctx, layout)
    if target in (F.group_norm, F.instance_norm):
        raise refuse(node, ctx, SPACE_NORM)
    if target in DROPOUT_FUNCTIONS:
        a = _bind(("input", "p", "training"), {"p": 0.5, "training": True}, node)
        if ctx.meta(a["training"]) and ctx.meta(a["p"]) > 0:
            raise refuse(node, ctx, RANDOM_WHY)
        return _local(node, ctx, layout)
    if target in CATS:
        dim = ctx.meta(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
        _channel_at(node, ctx, layout, dim, what="concatenates along")
        return _local(node, ctx, layout)
    if target in SOFTMAX_FUNCTIONS:
        dim = ctx.meta(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"))
        _channel_at(node, ctx, layout, dim)
        return _local(node, ctx, layout)
    if target is F.normalize:
        dim = ctx.meta(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 1))
        _channel_at(node, ctx, layout, dim)
        return _local(node, ctx, layout)
    if target is torch.permute or name == "permute":
        dims = ctx.meta(node.args[1] if len(node.args) > 1 else node.kwargs["dims"])
        return _local(node, ctx, tuple(layout[d] for d in dims))
    if target in (torch.transpose, torch.swapaxes, torch.swapdims):
        return _local(node, ctx, _swap(layout, ctx.meta(node.args[1]), ctx.meta(node.args[2])))
    if target in POINTWISE_FUNCTIONS:
        return _local(node, ctx, layout)
    return _other(node, ctx, name, slots)


def _method(node, ctx, name, slots) -> Classified:
    layout = ctx.layout(slots[0])
    if name == "permute":
        dims = [ctx.meta(a) for a in node.args[1:]]
        dims = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else tuple(dims)
        return _local(node, ctx, tuple(layout[d] for d in dims))
    if name in ("transpose", "swapaxes", "swapdims"):
        return _local(node, ctx, _swap(layout, ctx.meta(node.args[1]), ctx.meta(node.args[2])))
    if name in ("softmax", "log_softmax"):
        dim = ctx.meta(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"))
        _channel_at(node, ctx, layout, dim)
        return _local(node, ctx, layout)
    if name in POINTWISE_METHODS:
        return _local(node, ctx, layout)
    return _other(node, ctx, name, slots)


def _other(node, ctx, name, slots) -> Classified:
    """Reductions over the channels only; everything else refused, by family."""
    if name in REDUCTIONS:
        a = _bind(("input", "dim", "keepdim"), {"dim": None, "keepdim": False}, node)
        dim = ctx.meta(a["dim"])
        layout = ctx.layout(slots[0])
        dims = () if dim is None else (dim,) if isinstance(dim, int) else tuple(dim)
        if dims and ctx.meta(a["keepdim"]) and all(layout[d] == "C" for d in dims):
            return _local(node, ctx, layout)
        raise refuse(node, ctx, GLOBAL)
    if name.startswith(("adaptive_", "lp_pool")) or name in ("avg_pool", "max_pool"):
        raise refuse(node, ctx, GLOBAL if name.startswith("adaptive_") else _unsupported())
    if name in ATTENTION:
        raise refuse(node, ctx, ATTENTION_WHY)
    if name in RANDOM or "dropout" in name:
        raise refuse(node, ctx, RANDOM_WHY)
    if node.target is operator.getitem and _channel_slice(node, ctx, ctx.layout(slots[0])):
        return _local(node, ctx, ctx.layout(slots[0]))
    if name in RESHAPES or node.target is operator.getitem:
        raise refuse(node, ctx, RESHAPE_WHY)
    if name.endswith("_with_indices"):
        raise refuse(node, ctx, "returns pooling indices, which cannot be streamed")
    raise refuse(node, ctx, _unsupported())


def _channel_slice(node, ctx, layout) -> bool:
    """Whether ``x[...]`` slices the channels only (``x[:, :c]``, ``x[..., 1:]`` of a
    channels-last tensor): full slices on every other axis, no ``None`` or integer."""
    index = ctx.meta(node.args[1])
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(layout) - len(index) + 1) + index[at + 1 :]
    if len(index) > len(layout) or not all(isinstance(i, slice) for i in index):
        return False
    full = slice(None)
    return all(i == full or layout[d] == "C" for d, i in enumerate(index))


# ------------------------------------------------------------------ checks
def _standard(node, ctx, layout) -> None:
    if layout != ("N", "C", *range(ctx.dims)):
        raise refuse(node, ctx, f"expects [N, C, *spatial] but gets axes {layout}; {RESHAPE_WHY}")


def _channel_at(node, ctx, layout, dim, what: str = "acts along") -> None:
    if dim is None or not -len(layout) <= dim < len(layout) or layout[dim] != "C":
        role = "an unknown axis" if dim is None else f"axis {dim} ({layout[dim]!r})"
        raise refuse(node, ctx, f"{what} {role}, not the channels only; {SPACE_NORM}")


def _over_channels(node, ctx, layout, shape: tuple) -> None:
    if len(shape) != 1 or layout[-1] != "C":
        raise refuse(
            node,
            ctx,
            f"normalises over the last {len(shape)} axes {layout[-len(shape) :]} (normalized_shape "
            f"{shape}), not the channels only: it {SPACE_NORM[:-1]}; a LayerNorm over the "
            "channels permutes them last first, as ConvNeXt's LayerNorm2d does",
        )


def _swap(layout, a: int, b: int) -> tuple:
    out = list(layout)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


#: Position-wise calls whose result may be their input itself or a view of it (an
#: in-place operation on it would change another tensor).
ALIASING_METHODS = frozenset(
    {
        "permute",
        "transpose",
        "t",
        "swapaxes",
        "swapdims",
        "contiguous",
        "to",
        "float",
        "double",
        "half",
        "bfloat16",
        "type",
        "type_as",
        "detach",
        "view",
        "view_as",
    }
)


def _fresh(node: fx.Node, module) -> bool:
    """Whether a position-wise call returns a new tensor (not its input or a view)."""
    if node.op == "call_module":
        return not isinstance(module, (nn.Identity, *DROPOUTS))
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (
        name not in ALIASING_METHODS
        and node.target not in DROPOUT_FUNCTIONS
        and (node.target is not operator.pos)
    )


def _local(node, ctx, layout, module=None) -> Classified:
    call = _call(node, ctx, module)
    inplace = None
    if inplace_kind(node, ctx.root):  # eager's own form, run where nothing else reads
        original = ctx.root.get_submodule(node.target) if node.op == "call_module" else node.target
        inplace = NodeCall(node.op, original, node.args, dict(node.kwargs), call.slots)
    op = Local(where(node, ctx), call, len(call.slots), inplace, _fresh(node, module))
    return Classified(op, layout, call)


# ------------------------------------------------------------------ window ops
def _conv_module(node, ctx, m) -> Classified:
    if m.padding_mode == "circular":
        raise refuse(
            node,
            ctx,
            "padding_mode='circular' wraps around the image, which is "
            "not local; use 'zeros', 'reflect' or 'replicate'",
        )
    spec = conv_spec(m)
    pairs = [(p, p) for p in spec.geometry.padding]
    if spec.pre_pad is not None:
        pairs = [(a + c, b + e) for (a, b), (c, e) in zip(pairs, pad_pairs(spec.pre_pad))]
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    apply = ConvApply(m, m.weight, m.bias, tuple(m.stride), tuple(m.dilation), m.groups)
    spans = tuple(span(k, d) for k, d in zip(m.kernel_size, m.dilation))
    op = Window(
        where(node, ctx), spans, tuple(m.stride), tuple(pairs), apply, mode, 0.0, mode == "constant"
    )
    return Classified(op, ("N", "C", *range(ctx.dims)), out_channels=m.out_channels)


def _conv_functional(node, ctx, a, d) -> Classified:
    _standard(node, ctx, ctx.layout(node.args[0]))
    weight = ctx.meta(a["weight"])
    if ctx.is_data(a["weight"]) or (isinstance(a["bias"], fx.Node) and ctx.is_data(a["bias"])):
        raise refuse(node, ctx, "its weight is computed from the image (a dynamic convolution)")
    kernel = tuple(weight.shape[2:])
    stride, dilation = _tuple(ctx.meta(a["stride"]), d), _tuple(ctx.meta(a["dilation"]), d)
    padding = ctx.meta(a["padding"])
    spans = tuple(span(k, dl) for k, dl in zip(kernel, dilation))
    if padding == "valid":
        pairs = [(0, 0)] * d
    elif padding == "same":
        pairs = [((w - 1) // 2, w - 1 - (w - 1) // 2) for w in spans]
    else:
        pairs = [(p, p) for p in _tuple(padding, d)]
    apply = ConvApply(None, a["weight"], a["bias"], stride, dilation, a["groups"])
    op = Window(where(node, ctx), spans, stride, tuple(pairs), apply, native=True)
    return Classified(op, ("N", "C", *range(d)), out_channels=weight.shape[0])


def _output_size_arg(node, ctx):
    value = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
    return None if value is None else ctx.meta(value)


def _conv_t(
    node,
    ctx,
    weight,
    bias,
    stride,
    padding,
    dilation,
    groups,
    output_padding,
    output_size,
    out_channels,
    module,
) -> Classified:
    layout = ctx.layout(node.args[0])
    _standard(node, ctx, layout)
    w = ctx.meta(weight)
    d = ctx.dims
    stride, padding, dilation = _tuple(stride, d), _tuple(padding, d), _tuple(dilation, d)
    spans = tuple(span(k, dl) for k, dl in zip(w.shape[2:], dilation))
    if output_size is not None:  # nn.ConvTranspose's forward(x, output_size)
        sizes = ctx.meta(node.args[0]).shape[2:]
        wanted = tuple(output_size)[-d:]
        output_padding = tuple(
            o - ((n - 1) * s - 2 * p + sp)
            for o, n, s, p, sp in zip(wanted, sizes, stride, padding, spans)
        )
    apply = ConvApply(module, weight, bias, stride, dilation, groups, transposed=True)
    op = Transposed(where(node, ctx), spans, stride, padding, _tuple(output_padding, d), apply)
    return Classified(op, layout, out_channels=out_channels)


def _pool(node, ctx, kind: str, d: int, a: dict) -> Classified:
    if a["ceil_mode"]:
        raise refuse(node, ctx, "ceil_mode=True cannot be streamed exactly; use ceil_mode=False")
    if a.get("return_indices"):
        raise refuse(node, ctx, "return_indices=True cannot be streamed")
    kernel = _tuple(a["kernel_size"], d)
    stride = _tuple(a["stride"] if a["stride"] not in (None, []) else kernel, d)
    pad = _tuple(a["padding"], d)
    if kind == "avg" and not a.get("count_include_pad", True) and any(pad):
        raise refuse(
            node,
            ctx,
            "count_include_pad=False with padding cannot be streamed "
            "exactly; use count_include_pad=True or no padding",
        )
    dilation = _tuple(a.get("dilation", 1), d)
    apply = pool_apply(kind, kernel, stride, dilation, a.get("divisor_override"))
    spans = tuple(span(k, dl) for k, dl in zip(kernel, dilation))
    value = -math.inf if kind == "max" else 0.0
    pairs = tuple((p, p) for p in pad)
    op = Window(where(node, ctx), spans, stride, pairs, apply, "constant", value, True)
    return Classified(op, ctx.layout(node.args[0]))


def _pad(node, ctx, pad: tuple, mode: str, value) -> Classified:
    if mode == "circular":
        raise refuse(
            node,
            ctx,
            "circular padding wraps around the image, which is not "
            "local; use 'constant', 'reflect' or 'replicate'",
        )
    if mode not in ("constant", "reflect", "replicate"):
        raise refuse(node, ctx, f"padding mode {mode!r} {_unsupported()}")
    pairs = pad_pairs(tuple(pad))
    pairs = [(0, 0)] * (ctx.dims - len(pairs)) + list(pairs)
    if len(pairs) != ctx.dims:
        raise refuse(node, ctx, "pads the batch or channel axis; " + RESHAPE_WHY)
    op = Window(
        where(node, ctx),
        (1,) * ctx.dims,
        (1,) * ctx.dims,
        tuple(pairs),
        identity_apply,
        mode,
        float(value),
    )
    return Classified(op, ctx.layout(node.args[0]))


def _upsample(node, ctx, size, scale_factor, mode, align_corners) -> Classified:
    d = ctx.dims
    if mode not in ("nearest", "linear", "bilinear", "trilinear"):
        raise refuse(node, ctx, f"mode={mode!r} {_unsupported()}")
    if align_corners:
        raise refuse(
            node,
            ctx,
            "align_corners=True maps the image's corners onto each "
            "other, so a position's source depends on the image size, which is "
            "not local; use align_corners=False",
        )
    sizes = ctx.meta(node.args[0]).shape[2:]
    if scale_factor is not None:
        factors = _tuple(scale_factor, d)
    else:
        factors = tuple(o / n for o, n in zip(_tuple(size, d), sizes))
    if any(float(f) != int(f) or f < 1 for f in factors):
        raise refuse(
            node,
            ctx,
            f"a scale {tuple(factors)} that is not a whole number is not "
            "local; use an integer scale_factor",
        )
    scale = tuple(int(f) for f in factors)
    op = Upsample(
        where(node, ctx), scale, mode, scale_factor if scale_factor is not None else scale
    )
    return Classified(op, ctx.layout(node.args[0]))


__all__ = ["Classified", "Context", "NodeCall", "classify", "refuse", "where"]
