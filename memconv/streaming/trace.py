"""The trunk's dataflow, read with torch.fx, whatever its modules' ``forward`` does.

:func:`trace` runs :mod:`torch.fx`'s symbolic tracer (as torchvision's feature
extraction does) over the trunk: every call a module's ``forward`` makes becomes a
node of one graph, down to torch's own layers (``nn.Conv2d``, ``nn.BatchNorm2d``,
...) and memconv's, which stay whole. A ``forward`` that branches on a traced value
(data-dependent control flow) cannot be traced and is refused, naming the module.

In-place operations (``nn.ReLU(inplace=True)``, ``x.relu_()``, ``F.relu(x,
inplace=True)``) are made functional: the streamed pass runs them out of place, so a
tile's tensors are never changed under autograd, and a later reader of the changed
tensor reads the operation's result instead (:func:`functionalize`). ``out +=
identity`` is traced by torch.fx as ``out = out + identity`` already.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from .errors import REMEDY, NotStreamableError

#: ``operator`` in-place functions and their out-of-place forms.
INPLACE_OPERATORS = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}
#: Methods ending in ``_`` that do not change their tensor's values.
NOT_INPLACE_METHODS = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})
#: Position of the ``inplace`` argument of torch's functional activations and dropouts.
INPLACE_POSITION = {
    "relu": 1,
    "relu6": 1,
    "selu": 1,
    "silu": 1,
    "mish": 1,
    "hardswish": 1,
    "hardsigmoid": 1,
    "elu": 2,
    "celu": 2,
    "leaky_relu": 2,
    "hardtanh": 3,
    "threshold": 3,
    "rrelu": 4,
    "dropout": 3,
    "alpha_dropout": 3,
    "feature_alpha_dropout": 3,
    "dropout1d": 3,
    "dropout2d": 3,
    "dropout3d": 3,
}
#: Operations that return a view of their (first) argument.
VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "permute",
        "transpose",
        "t",
        "expand",
        "expand_as",
        "narrow",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "reshape",
        "select",
        "as_strided",
        "movedim",
        "swapaxes",
        "diagonal",
        "unfold",
        "split",
        "chunk",
        "unbind",
        "__getitem__",
    }
)


class _Tracer(fx.Tracer):
    """torch.fx's tracer with memconv's layers kept whole and the module being traced
    named in the error a failed trace raises."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # memconv's extended layers run inside their own autograd Function: whole
        return type(m).__module__ == "memconv.modules" or super().is_leaf_module(
            m, module_qualified_name
        )

    def call_module(self, m, forward, args, kwargs):
        try:
            return super().call_module(m, forward, args, kwargs)
        except NotStreamableError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of the trace is named
            path = self.path_of_module(m)
            raise NotStreamableError(_trace_message(self.name, path, m, err)) from err


def _trace_message(name: str, path: str, module: nn.Module, err: Exception) -> str:
    where = f"{name}.{path}" if path else name
    if isinstance(err, fx.proxy.TraceError):
        why = (
            "its forward branches on a traced value (control flow on the data or on its "
            f"shape: {err})"
        )
    else:
        why = f"its forward cannot be read as operations ({type(err).__name__}: {err})"
    return f"{where} ({type(module).__name__}): {why}; {REMEDY}"


def trace(module: nn.Module, name: str = "stream_layers") -> fx.Graph:
    """The graph of operations ``module``'s forward pass runs, in-place operations made
    functional (:func:`functionalize`).

    Args:
        module: the trunk.
        name: how messages name it.

    Raises:
        NotStreamableError: where a ``forward`` cannot be traced (control flow on traced
            values), naming the module.
    """
    tracer = _Tracer(name)
    try:
        graph = tracer.trace(module)
    except NotStreamableError:
        raise
    except Exception as err:  # noqa: BLE001 - the root's own forward
        raise NotStreamableError(_trace_message(name, "", module, err)) from err
    functionalize(graph, module, name)
    return graph


def module_of(root: nn.Module, node: fx.Node) -> tuple[str, str]:
    """``(path, type name)`` of the module whose ``forward`` calls ``node`` (the module
    itself for a module call; ``("", root type)`` at the top)."""
    if node.op == "call_module":
        return node.target, type(root.get_submodule(node.target)).__name__
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, kind = list(stack.values())[-1]
        return path, getattr(kind, "__name__", str(kind))
    return "", type(root).__name__


def op_name(node: fx.Node) -> str:
    """The operation a node calls, as a user writes it (``adaptive_avg_pool2d``,
    ``Tensor.relu_``, ``operator.add``)."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        target = node.target
        module = getattr(target, "__module__", "") or ""
        short = getattr(target, "__name__", str(target))
        return f"operator.{short}" if module == "_operator" else short
    return str(node.target)


def inplace_kind(node: fx.Node, root: nn.Module) -> bool:
    """Whether ``node`` changes its first argument in place."""
    if node.op == "call_module":
        return bool(getattr(root.get_submodule(node.target), "inplace", False))
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.endswith("__") and name not in NOT_INPLACE_METHODS
    if node.op == "call_function":
        if node.target in INPLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        if node.kwargs.get("inplace") is True:
            return True
        position = INPLACE_POSITION.get(name)
        if position is not None and len(node.args) > position and node.args[position] is True:
            return True
        return _underscore_function(node.target) is not None
    return False


def _underscore_function(target):
    """The out-of-place form of an in-place torch function (``torch.relu_`` →
    ``torch.relu``, ``F.elu_`` → ``F.elu``), or None."""
    name = getattr(target, "__name__", "")
    if not name.endswith("_") or name.endswith("__"):
        return None
    for namespace in (torch.nn.functional, torch):
        if getattr(namespace, name, None) is target and hasattr(namespace, name[:-1]):
            return getattr(namespace, name[:-1])
    return None


def functionalize(graph: fx.Graph, root: nn.Module, name: str) -> None:
    """Make in-place operations functional: every reader of a tensor that an in-place
    operation changed, placed after that operation, reads its result instead.

    Raises:
        NotStreamableError: for an in-place change of a parameter or buffer, or of a
            view of another tensor (its base would change too), naming the module.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op not in ("call_module", "call_method", "call_function") or not node.args:
            continue
        target = node.args[0]
        if not isinstance(target, fx.Node) or not inplace_kind(node, root):
            continue
        path, kind = module_of(root, node)
        where = f"{name}.{path}" if path else name
        if target.op == "get_attr":
            raise NotStreamableError(
                f"{where} ({kind}) calls {op_name(node)} in place on the parameter or buffer "
                f"{target.target}: it changes at every call; write it out of place"
            )
        if _is_view(target) and any(
            order[u] > order[node] for u in _view_base(target).users if u is not target
        ):
            raise NotStreamableError(
                f"{where} ({kind}) calls {op_name(node)} in place on a view of another "
                "tensor, which changes that tensor too; write it out of place"
            )
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in VIEW_METHODS
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return node.target is operator.getitem or name in VIEW_METHODS
    return False


def _view_base(node: fx.Node) -> fx.Node:
    while _is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def out_of_place(node: fx.Node):
    """``(kind, target, kwargs)`` of the out-of-place form of a node's call (its own when
    it is not in place): ``Tensor.relu_`` → ``Tensor.relu``, ``operator.iadd`` →
    ``operator.add``, ``F.relu(x, inplace=True)`` → ``F.relu(x, inplace=False)``."""
    kwargs = dict(node.kwargs)
    if node.op == "call_method":
        name = node.target
        if name.endswith("_") and not name.endswith("__") and name not in NOT_INPLACE_METHODS:
            if hasattr(torch.Tensor, name[:-1]):
                return "call_method", name[:-1], kwargs
        return node.op, node.target, kwargs
    if node.op == "call_function":
        if node.target in INPLACE_OPERATORS:
            return "call_function", INPLACE_OPERATORS[node.target], kwargs
        plain = _underscore_function(node.target)
        if plain is not None:
            return "call_function", plain, kwargs
        if "inplace" in kwargs:
            kwargs["inplace"] = False
    return node.op, node.target, kwargs


def inplace_position(node: fx.Node) -> int | None:
    """The positional index of a functional call's ``inplace`` argument, or None."""
    if node.op != "call_function":
        return None
    return INPLACE_POSITION.get(getattr(node.target, "__name__", ""))


__all__ = ["inplace_position", "module_of", "op_name", "out_of_place", "trace"]
