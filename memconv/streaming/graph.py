"""The streamed graph: the traced trunk's data nodes, their ops and full-image shapes.

:func:`analyse` traces the trunk (:mod:`memconv.streaming.trace`) into a
:class:`StreamGraph`. :meth:`StreamGraph.bind` reads it for one input shape: every
node is evaluated on the meta device (shapes only, no memory), which

- sorts the nodes into *data* nodes (they carry the image: each gets its local op
  from :func:`memconv.streaming.catalogue.classify`, or is refused, before any
  work), *static* nodes (parameters and what a ``forward`` computes from them
  alone: a layer scale reshaped, a standardised weight) and *values* (Python values
  such as ``x.size(2)``, taken at the full image's size, as the conventional pass
  sees them: U-Net's padding of its skip connections);
- checks what only shapes tell: a broadcast with a tensor that varies over space, an
  operation that changes the spatial size where it should not.

The result, a :class:`Bound` graph, holds per data node its op, its producers (one
per slot), its consumers, its layout and its full shape. Nodes that do not reach the
output are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.fx as fx
from torch import Tensor, nn

from .catalogue import RANDOM, Classified, Context, NodeCall, classify, refuse, where
from .errors import NotStreamableError
from .ops import Local, Op, Transposed, Upsample, Window
from .trace import module_of, op_name, trace

#: Tensor methods and attributes whose result is a Python value (read at full size).
VALUE_METHODS = frozenset({"size", "dim", "numel", "nelement", "element_size", "ndimension"})
VALUE_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout"})


class Env:
    """The values of a pass's non-data nodes: parameters, buffers and what is computed
    from them (real tensors, or meta tensors for shapes) and Python values.

    Args:
        values: ``{node: value}``.
        meta: whether tensors are on the meta device (modules then run with meta
            parameters).
        device: the device ``x.device`` stands for in a real pass.
    """

    def __init__(self, values: dict, meta: bool = False, device=None):
        self.values = values
        self.meta = meta
        self.device = device

    def value(self, x):
        """A node's value (anything else as it is)."""
        if isinstance(x, fx.Node):
            v = self.values[x]
            if not self.meta and isinstance(v, torch.device) and v.type == "meta":
                return self.device
            return v
        return x

    def call_module(self, module: nn.Module, args, kwargs):
        """``module(*args, **kwargs)``, with meta parameters and buffers in a meta pass."""
        if not self.meta:
            return module(*args, **kwargs)
        state = {k: v.to("meta") for k, v in module.state_dict(keep_vars=True).items()}
        return torch.func.functional_call(module, state, args, kwargs)


@dataclass
class DataNode:
    """A node carrying the image's data.

    Attributes:
        op: its local op (None for the input).
        label: module path (and function) for reports.
        slots: producer indices, one per data input of the op.
        consumers: indices of the nodes that read it.
        layout: the role of each tensor axis ("N", "C" or a spatial axis index).
        shape: its full shape.
    """

    op: Op | None
    label: str
    slots: list[int]
    layout: tuple
    shape: tuple
    consumers: list[int] = field(default_factory=list)

    def size(self, axis: int) -> int:
        """Positions along spatial ``axis``."""
        return self.shape[self.layout.index(axis)]

    def dim(self, axis: int) -> int:
        """The tensor axis of spatial ``axis``."""
        return self.layout.index(axis)


@dataclass
class Bound:
    """The streamed graph at one input shape (see the module docstring).

    Attributes:
        nodes: data nodes in topological order; 0 is the input, ``output`` the result.
        statics: the static nodes' calls, in order (``(fx node, call or None)``; None
            reads a parameter or buffer).
        values: Python values and the static nodes' meta tensors.
        root: the trunk.
        dims: spatial axes.
        dtype_reads: labels of the calls that read the dtype (``x.dtype``,
            ``x.element_size()``) of a node computed from the image: a value taken
            once, at the dtype of the bound input, which ``torch.autocast`` would change
            (see :func:`memconv.streaming.cnn.check_autocast`).
    """

    nodes: list[DataNode]
    output: int
    statics: list
    values: dict
    root: nn.Module
    dims: int
    dtype_reads: tuple[str, ...] = ()

    def env(self, device) -> Env:
        """The real values of the static nodes (computed now: inside autograd when
        gradients are enabled, so parameters receive theirs) and the Python values."""
        values = {k: v for k, v in self.values.items() if not isinstance(v, Tensor)}
        env = Env(values, meta=False, device=device)
        for node, call in self.statics:
            values[node] = _attribute(self.root, node.target) if call is None else call(env)
        return env

    def sizes(self, index: int) -> tuple[int, ...]:
        """Spatial size of node ``index``."""
        node = self.nodes[index]
        return tuple(node.size(a) for a in range(self.dims))

    def output_shape(self) -> tuple:
        """The full output's shape ``[N, C_out, *S_out]``."""
        return tuple(self.nodes[self.output].shape)


def _attribute(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class StreamGraph:
    """The traced trunk (see the module docstring).

    Args:
        module: the trunk.
        name: how messages name it.

    Raises:
        NotStreamableError: where a ``forward`` cannot be traced, or the trunk does not
            take one tensor and return one.
    """

    def __init__(self, module: nn.Module, name: str = "stream_layers"):
        self.module = module
        self.name = name
        self.graph = trace(module, name)
        inputs = [n for n in self.graph.nodes if n.op == "placeholder"]
        if len(inputs) != 1:
            raise NotStreamableError(
                f"{name} ({type(module).__name__}) takes {len(inputs)} inputs; a streamed "
                "trunk takes one image [N, C, *spatial]"
            )
        self.dims = infer_dims(self.graph, module)

    def bind(self, shape: tuple, dtype: torch.dtype = torch.float32) -> Bound:
        """The graph at input ``shape`` (``[N, C, *spatial]``; meta evaluation only).

        Raises:
            NotStreamableError: an operation that is not local, named (see
                :func:`memconv.streaming.catalogue.classify`).
            ValueError: an input too small for the layers.
        """
        dims = len(shape) - 2
        if self.dims is not None and dims != self.dims:
            raise ValueError(
                f"input must have shape [N, C, {self.dims} spatial dims], got {tuple(shape)}"
            )
        meta: dict = {}
        index: dict = {}
        nodes: list[DataNode] = []
        statics = []
        dtype_reads: list[str] = []
        output = None
        ctx = Context(
            self.module,
            self.name,
            lambda n: isinstance(n, fx.Node) and n in index,
            lambda n: nodes[index[n]].layout,
            lambda a: (
                fx.node.map_arg(a, lambda n: meta[n])
                if isinstance(a, (fx.Node, list, tuple, dict))
                else a
            ),
            dims,
        )
        env = Env(meta, meta=True)
        for node in self.graph.nodes:
            if node.op == "placeholder":
                meta[node] = torch.empty(shape, dtype=dtype, device="meta")
                index[node] = 0
                nodes.append(DataNode(None, "input", [], ("N", "C", *range(dims)), tuple(shape)))
            elif node.op == "get_attr":
                value = _attribute(self.module, node.target)
                meta[node] = value.to("meta") if isinstance(value, Tensor) else value
                statics.append((node, None))
            elif node.op == "output":
                result = node.args[0]
                if not (isinstance(result, fx.Node) and result in index):
                    raise NotStreamableError(
                        f"{self.name} ({type(self.module).__name__}) returns "
                        f"{type(result).__name__}; a streamed trunk returns one tensor "
                        "[N, C, *spatial] computed from the image"
                    )
                output = index[result]
            else:
                self._bind_call(node, ctx, env, meta, index, nodes, statics, dtype_reads)
        out = nodes[output]
        if output == 0:
            raise NotStreamableError(
                f"{self.name} ({type(self.module).__name__}) returns its input unchanged: "
                "there is nothing to stream"
            )
        if out.layout != ("N", "C", *range(dims)):
            raise NotStreamableError(
                f"{self.name}: its output has axes {out.layout}; a streamed trunk returns "
                "[N, C, *spatial]"
            )
        bound = _prune(nodes, output, statics, meta, self.module, dims)
        bound.dtype_reads = tuple(dtype_reads)
        return bound

    def _bind_call(self, node, ctx, env, meta, index, nodes, statics, dtype_reads) -> None:
        slots = [n for n in _inputs(node) if n in index]
        if not slots:  # static or a value: evaluated (meta) now
            name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
            if name.rstrip("_") in RANDOM:
                raise refuse(node, ctx, "draws random numbers, which tiles cannot reproduce;")
            call = NodeCall(node.op, _target(node, self.module), node.args, dict(node.kwargs))
            meta[node] = _evaluate(node, ctx, call, env)
            if isinstance(meta[node], Tensor):
                statics.append((node, call))
            return
        if _is_value(node):
            if _reads_dtype(node) and any(index[s] != 0 for s in slots):
                dtype_reads.append(_label(node, ctx))
            call = NodeCall(node.op, node.target, node.args, dict(node.kwargs))
            meta[node] = _evaluate(node, ctx, call, env)
            return
        found = classify(node, ctx)
        out = self._shape(node, ctx, found, env, meta, slots)
        meta[node] = out
        index[node] = len(nodes)
        nodes.append(
            DataNode(
                found.op,
                _label(node, ctx),
                [index[s] for s in slots],
                found.layout,
                tuple(out.shape),
            )
        )

    def _shape(self, node, ctx, found: Classified, env, meta, slots) -> Tensor:
        inputs = [meta[s] for s in slots]
        op = found.op
        if isinstance(op, Local):
            _check_broadcasts(node, ctx, found, meta)
            out = _evaluate(node, ctx, found.call, env, inputs)
            _check_local(node, ctx, found, out, inputs, meta)
            return out
        x = inputs[0]
        sizes = tuple(op.out_size(a, n) for a, n in enumerate(x.shape[2:]))
        if any(s < 1 for s in sizes):
            raise ValueError(
                f"input of spatial size {tuple(meta_input_size(meta))} is too small for the "
                f"layers: {op.name} would give {sizes}"
            )
        channels = found.out_channels if found.out_channels is not None else x.shape[1]
        return torch.empty((x.shape[0], channels, *sizes), dtype=x.dtype, device="meta")


def meta_input_size(meta: dict) -> tuple:
    """The input's spatial size in a meta environment."""
    for v in meta.values():
        if isinstance(v, Tensor):
            return tuple(v.shape[2:])
    return ()


def _inputs(node: fx.Node) -> list:
    found: list = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return found


def _target(node: fx.Node, root: nn.Module):
    return root.get_submodule(node.target) if node.op == "call_module" else node.target


def _is_value(node: fx.Node) -> bool:
    """Whether a call on a data node returns a Python value (``x.size(2)``, ``x.shape``)."""
    if node.op == "call_method":
        return node.target in VALUE_METHODS
    return (
        node.op == "call_function" and node.target is getattr and node.args[1] in VALUE_ATTRIBUTES
    )


def _reads_dtype(node: fx.Node) -> bool:
    """Whether a value call reads its tensor's dtype (``x.dtype``, ``x.element_size()``)."""
    if node.op == "call_method":
        return node.target == "element_size"
    return node.args[1] == "dtype"


def _evaluate(node, ctx, call: NodeCall, env, inputs=()):
    try:
        if inputs:
            return call(env, *inputs)
        return call(env)
    except NotStreamableError:
        raise
    except Exception as err:  # noqa: BLE001 - named, with the cause
        raise NotStreamableError(
            f"{where(node, ctx)}: cannot be read at the image's shape ({type(err).__name__}: {err})"
        ) from err


def _check_broadcasts(node, ctx, found: Classified, meta) -> None:
    """A position-wise op combines the image only with tensors without spatial extent
    (a layer scale ``[C, 1, 1]``, a bias), not with one that varies over space."""
    spatial = [i for i, r in enumerate(found.layout) if isinstance(r, int)]
    ndim = len(found.layout)
    for arg in _inputs(node):
        value = meta.get(arg)
        if arg in found.call.slots or not isinstance(value, Tensor) or value.dim() == 0:
            continue
        shape = (1,) * (ndim - value.dim()) + tuple(value.shape)
        if len(shape) > ndim or any(shape[i] != 1 for i in spatial):
            raise refuse(
                node,
                ctx,
                f"combines the image with a tensor of shape {tuple(value.shape)} that varies "
                "over the spatial axes (e.g. a position embedding), which is not local",
            )


def _check_local(node, ctx, found: Classified, out, inputs, meta) -> None:
    """A position-wise op keeps the spatial shape of its data inputs."""
    if not isinstance(out, Tensor) or out.dim() != len(found.layout):
        raise refuse(node, ctx, "changes the number of axes; " + _reshape())
    spatial = [i for i, r in enumerate(found.layout) if isinstance(r, int)]
    for x in inputs:
        if [x.shape[i] for i in spatial] != [out.shape[i] for i in spatial] and not _permutes(node):
            raise refuse(node, ctx, "broadcasts along the spatial axes, which is not local")


def _permutes(node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in ("permute", "transpose", "swapaxes", "swapdims")


def _reshape() -> str:
    from .catalogue import RESHAPE_WHY

    return RESHAPE_WHY


def _label(node, ctx) -> str:
    path, _ = module_of(ctx.root, node)
    full = f"{ctx.name}.{path}" if path else ctx.name
    return full if node.op == "call_module" else f"{full}: {op_name(node)}"


def _prune(nodes, output, statics, meta, root, dims) -> Bound:
    """Keep the data nodes the output depends on, renumbered; fill consumers."""
    keep = {output}
    for i in range(output, -1, -1):
        if i in keep:
            keep.update(nodes[i].slots)
    keep.add(0)
    order = sorted(keep)
    new = {old: i for i, old in enumerate(order)}
    kept = []
    for old in order:
        n = nodes[old]
        kept.append(DataNode(n.op, n.label, [new[s] for s in n.slots], n.layout, n.shape))
    for i, n in enumerate(kept):
        for s in dict.fromkeys(n.slots):
            kept[s].consumers.append(i)
    return Bound(kept, new[output], statics, meta, root, dims)


def infer_dims(graph: fx.Graph, root: nn.Module) -> int | None:
    """The number of spatial axes the trunk's first convolution or pooling takes (None
    when it has none)."""
    from .catalogue import AVGPOOL_FUNCTIONS, CONV_FUNCTIONS, CONV_T_FUNCTIONS, MAXPOOL_FUNCTIONS

    tables = (CONV_FUNCTIONS, CONV_T_FUNCTIONS, MAXPOOL_FUNCTIONS, AVGPOOL_FUNCTIONS)
    for node in graph.nodes:
        if node.op == "call_module":
            m = root.get_submodule(node.target)
            kernel = getattr(m, "kernel_size", None)
            if isinstance(kernel, tuple):
                return len(kernel)
            if kernel is not None and type(m).__name__[-2:-1].isdigit():
                return int(type(m).__name__[-2])
        elif node.op == "call_function":
            for table in tables:
                if node.target in table:
                    return table[node.target]
    return None


def infer_channels(graph: StreamGraph) -> int | None:
    """The input channels the trunk's first channel-reading layer expects (None when no
    layer tells)."""
    root = graph.module
    frontier = [n for n in graph.graph.nodes if n.op == "placeholder"]
    seen = set()
    while frontier:
        node = frontier.pop(0)
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_module":
                m = root.get_submodule(user.target)
                for attr in ("in_channels", "num_features"):
                    if isinstance(getattr(m, attr, None), int):
                        return getattr(m, attr)
            frontier.append(user)
    return None


def receptive_fields(bound: Bound, which: list[int]) -> list[tuple[tuple[int, ...], tuple]]:
    """For the data nodes ``which``, ``(receptive field, output stride)`` in input pixels
    per axis: the input range one of a node's positions reads (the hull over every path
    into it, padding counted), and how many input pixels it moves per position (a
    :class:`~fractions.Fraction` after upsampling).

    Raises:
        NotStreamableError: if two inputs of an op move at different strides.
    """
    dims = bound.dims
    jumps: list = []
    for node in bound.nodes:
        if node.op is None:
            jumps.append((Fraction(1),) * dims)
            continue
        first = jumps[node.slots[0]]
        for s in node.slots[1:]:
            if jumps[s] != first:
                raise NotStreamableError(
                    f"{node.label}: its inputs move at strides {first} and {jumps[s]} input "
                    "pixels per position; they must be aligned"
                )
        jumps.append(tuple(_jump(node.op, a, first[a]) for a in range(dims)))
    out = []
    for i in which:
        rf = []
        for a in range(dims):
            size = bound.sizes(i)[a]
            mid = size // 2
            rf.append(max(_hull(bound, i, a, p, p + 1) for p in range(mid, min(mid + 4, size))))
        out.append((tuple(rf), jumps[i]))
    return out


def _jump(op: Op, axis: int, jump: Fraction) -> Fraction:
    if isinstance(op, Window):
        return jump * op.stride[axis]
    if isinstance(op, Transposed):
        return jump / op.stride[axis]
    if isinstance(op, Upsample):
        return jump / op.scale[axis]
    return jump


def _hull(bound: Bound, index: int, axis: int, lo: int, hi: int) -> int:
    """Input positions the positions ``[lo, hi)`` of node ``index`` read along ``axis``."""
    ranges = {index: (lo, hi)}
    for i in range(index, 0, -1):
        if i not in ranges:
            continue
        node = bound.nodes[i]
        a, b = ranges[i]
        for s in node.slots:
            need = node.op.need(axis, a, b, bound.sizes(s)[axis])
            r = (need.lo - need.pad_lo, need.hi + need.pad_hi)
            old = ranges.get(s)
            ranges[s] = r if old is None else (min(old[0], r[0]), max(old[1], r[1]))
    a, b = ranges.get(0, (0, 0))
    return b - a


def analyse(module: nn.Module, name: str = "stream_layers") -> StreamGraph:
    """Trace a trunk into a :class:`StreamGraph` (see the module docstring).

    Args:
        module: the trunk, written as its library writes it (any ``forward``).
        name: how messages name it.

    Returns:
        The graph; :meth:`StreamGraph.bind` reads it for an input shape.

    Raises:
        NotStreamableError: a ``forward`` that cannot be traced (control flow on traced
            values), or a trunk that does not take one tensor.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"stream_layers must be an nn.Module, got {type(module).__name__}")
    return StreamGraph(module, name)


__all__ = [
    "Bound",
    "DataNode",
    "Env",
    "StreamGraph",
    "analyse",
    "infer_channels",
    "receptive_fields",
]
