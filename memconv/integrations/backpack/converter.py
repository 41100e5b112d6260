"""BackPACK's converter for networks written as timm writes ConvNeXt.

``backpack.extend(model, use_converter=True)`` traces the model with ``torch.fx`` and
turns its function calls into modules BackPACK's extensions see (additions,
permutations, multiplications by a float). timm's and torchvision's ConvNeXt leave two that
it does not convert:

- ``LayerNorm2d`` (``permute → F.layer_norm → permute``): the tracer enters it
  (it is not a ``torch.nn`` class), and the repeated ``F.layer_norm`` calls crash
  BackPACK 1.7.1's duplicate removal, which takes every repeated node target for a
  module name (``AttributeError: 'function' object has no attribute 'split'``);
  even without the crash no extension would see the layer;
- the layer scale, timm's ``x.mul(self.gamma.reshape(1, -1, 1, 1))`` or torchvision's
  ``self.layer_scale * x`` (a parameter ``[C, 1, 1]``): a parameter used by a function
  call, which no extension sees either (BackPACK's converter raises on torchvision's:
  ``RuntimeError: Expecting types [float, Node]``).

:func:`extend` rewrites both into the modules of :mod:`.layers` (sharing the model's
parameters: the quantities land on the model's own ``Parameter`` objects), then runs
BackPACK's converter with those modules as leaves. :func:`memconv.integrations.backpack.install`
maps them (and ``nn.GELU``) to memconv's module extensions.

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import operator
import threading
import warnings

import torch
from backpack import extend as backpack_extend
from backpack.custom_module import graph_utils
from torch import fx, nn

from .layers import LAYERS, LayerNorm2d, LayerScale2d

_lock = threading.Lock()
#: Classes BackPACK's tracer keeps as modules (subclasses too), besides ``torch.nn``'s
#: own: not every ``nn.LayerNorm`` subclass, whose ``forward`` may differ (timm's
#: ``LayerNorm2d`` permutes), which the tracer enters and :func:`_layer_norms` rewrites.
_LEAVES = tuple(cls for cls in LAYERS if cls is not nn.LayerNorm)
_LN_ARGS = ("input", "normalized_shape", "weight", "bias", "eps")
_MUL = {operator.mul, torch.mul, "mul", "multiply"}


def _argument(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _dims(node) -> tuple | None:
    """The permutation of a ``permute`` call, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "permute"):
        return None
    dims = node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = dims[0]
    return tuple(dims)


def _to_last(rank: int) -> tuple:
    return (0, *range(2, rank), 1)


def _to_first(rank: int) -> tuple:
    return (0, rank - 1, *range(1, rank - 1))


def _taken(gm: nn.Module, name: str) -> bool:
    """Whether ``name`` is a submodule, parameter, buffer or other attribute of ``gm``."""
    owner, _, attr = name.rpartition(".")
    try:
        module = gm.get_submodule(owner) if owner else gm
    except AttributeError:
        return False
    return hasattr(module, attr)


def _free(gm: nn.Module, name: str) -> str:
    candidate, i = name, 0
    while _taken(gm, candidate):
        i += 1
        candidate = f"{name}{i}"
    return candidate


def _replace(gm: fx.GraphModule, first: fx.Node, last: fx.Node, path: str, module, inp):
    """``first … last`` (a chain) by a call of ``module`` at ``path`` on ``inp``."""
    gm.add_submodule(path, module)
    with gm.graph.inserting_before(first):
        call = gm.graph.call_module(path, (inp,))
    last.replace_all_uses_with(call)


def _layer_norms(gm: fx.GraphModule) -> int:
    """``permute(channels last) → F.layer_norm(C) → permute(back)`` → :class:`LayerNorm2d`."""
    count = 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is nn.functional.layer_norm):
            continue
        args = {k: _argument(node, i, k) for i, k in enumerate(_LN_ARGS)}
        before, users = args["input"], list(node.users)
        shape = args["normalized_shape"]
        if len(users) != 1 or not isinstance(shape, (tuple, list)) or len(shape) != 1:
            continue
        dims, after = _dims(before), users[0]
        if dims is None or len(before.users) != 1 or len(dims) < 3:
            continue
        rank = len(dims)
        if dims != _to_last(rank) or _dims(after) != _to_first(rank):
            continue
        weight, bias = args["weight"], args["bias"]
        if (weight is None) != (bias is None) or any(
            p is not None and p.op != "get_attr" for p in (weight, bias)
        ):
            continue
        eps = args["eps"] if args["eps"] is not None else 1e-5
        module = LayerNorm2d(int(shape[0]), eps=eps, affine=weight is not None)
        path = f"layer_norm{count}"
        if weight is not None:
            module.weight = gm.get_parameter(weight.target)
            module.bias = gm.get_parameter(bias.target)
            owner = weight.target.rpartition(".")[0]
            path = owner if owner and owner == bias.target.rpartition(".")[0] else path
        _replace(gm, before, after, _free_or_own(gm, path), module, before.args[0])
        count += 1
    return count


def _free_or_own(gm, path: str) -> str:
    """``path`` when nothing but parameters is there (a layer the tracer entered),
    else a free name beside it."""
    try:
        there = gm.get_submodule(path)
    except AttributeError:
        return path
    if type(there) is nn.Module or isinstance(there, nn.LayerNorm):
        return path
    return _free(gm, path + "_layer_norm")


def _direct_scale(gm: fx.GraphModule, scale) -> nn.Parameter | None:
    """The parameter of ``scale`` when it is a parameter ``[C, 1, …, 1]`` used as it is
    (torchvision's ``CNBlock``: ``self.layer_scale * self.block(input)``), else None."""
    if not (isinstance(scale, fx.Node) and scale.op == "get_attr"):
        return None
    try:
        gamma = gm.get_parameter(scale.target)
    except AttributeError:  # a buffer or a constant
        return None
    if gamma.dim() < 2 or any(s != 1 for s in gamma.shape[1:]):
        return None
    return gamma


def _layer_scales(gm: fx.GraphModule) -> int:
    """``x * gamma.reshape(1, -1, 1, 1)`` (a parameter ``[C]``, timm's) and
    ``gamma * x`` (a parameter ``[C, 1, 1]``, torchvision's) → :class:`LayerScale2d`."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op not in ("call_method", "call_function") or node.target not in _MUL:
            continue
        if len(node.args) != 2 or node.kwargs:
            continue
        for x, scale in (node.args, node.args[::-1]):
            gamma = _direct_scale(gm, scale)
            if gamma is not None and isinstance(x, fx.Node):
                owner = scale.target.rpartition(".")[0]
                path = _free(gm, f"{owner}.layer_scale" if owner else "layer_scale")
                _replace(gm, node, node, path, LayerScale2d(gamma), x)
                count += 1
                break
            if not (
                isinstance(scale, fx.Node)
                and scale.op == "call_method"
                and scale.target in ("reshape", "view")
                and len(scale.users) == 1
            ):
                continue
            param, *shape = scale.args
            if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
                shape = list(shape[0])
            if not (isinstance(param, fx.Node) and param.op == "get_attr"):
                continue
            gamma = gm.get_parameter(param.target)
            if (
                gamma.dim() != 1
                or len(shape) < 3
                or shape[0] != 1
                or shape[1] not in (-1, gamma.numel())
            ):
                continue
            if any(s != 1 for s in shape[2:]):
                continue
            owner = param.target.rpartition(".")[0]
            path = _free(gm, f"{owner}.layer_scale" if owner else "layer_scale")
            _replace(gm, scale, node, path, LayerScale2d(gamma), x)
            count += 1
            break
    return count


def _unseen_parameters(gm: fx.GraphModule) -> list[str]:
    """Parameters a function call uses directly (no module extension sees them)."""
    names = {name for name, _ in gm.named_parameters()}
    return [
        n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in names and n.users
    ]


def extend(module: nn.Module, debug: bool = False, use_converter: bool = True) -> nn.Module:
    """``backpack.extend(module, use_converter=True)`` for networks written as timm
    writes ConvNeXt: its ``LayerNorm2d`` and layer scale become modules BackPACK's
    extensions see, the rest is BackPACK's converter.

    For the time of the call (under a lock) BackPACK's tracer class treats the modules
    of :mod:`.layers` as leaves; its own method is given back before the call returns.

    Args:
        module: the model.
        debug: BackPACK's debug messages.
        use_converter: False: ``backpack.extend(module)`` unchanged (nothing to rewrite).

    Returns:
        The converted, extended model (a ``torch.fx.GraphModule``, as BackPACK's
        converter returns; the parameters are the model's own objects, a layer scale's
        ``gamma`` under the new path ``<block>.layer_scale.gamma``).

    Warns:
        UserWarning: naming each parameter that a function call still uses directly
            after the rewrite: no extension computes its quantity (the remedy: write
            that operation as a module).
    """
    if not use_converter:
        return backpack_extend(module, debug=debug)
    gm = fx.GraphModule(module, graph_utils.BackpackTracer().trace(module))
    rewritten = _layer_norms(gm) + _layer_scales(gm)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    if debug:
        print(f"memconv: {rewritten} layer norms and layer scales made modules")
    unseen = _unseen_parameters(gm)
    if unseen:
        warnings.warn(
            f"memconv.integrations.backpack.extend: the parameters {unseen} are used by "
            "function calls, which no BackPACK extension sees: their quantities will be "
            "missing; write those operations as modules",
            stacklevel=2,
        )
    tracer = graph_utils.BackpackTracer
    with _lock:
        original = tracer.is_leaf_module

        def is_leaf_module(self, m, qualified_name):
            return isinstance(m, _LEAVES) or original(self, m, qualified_name)

        tracer.is_leaf_module = is_leaf_module
        try:
            return backpack_extend(gm, debug=debug, use_converter=True)
        finally:
            tracer.is_leaf_module = original
