"""Operation rules: the functional calls a parameter reaches, whatever module makes them.

A module rule is found by the layer's type; an **operation rule** by the function a
forward pass calls (``F.conv2d``, ``F.linear``, ``F.layer_norm``, ...). Each layer
family registers, beside its module rule, a *binder* for the operations it describes
(:func:`register_op`): the binder sorts a call's arguments into the *data* argument
(the one carrying the batch) and the *parameter slots* (weight, bias), and builds a
**shell**: a layer of the type whose module rule computes exactly what the call
computes, holding the slots' tensors as its parameters. The module rule then serves
the call (every convolution strategy, ghost norms, book-keeping), so an operation and
its module share one implementation. Where no layer of torch's computes the call
(``x + w``, a class token concatenated), the family registers a shell type with its
own rule (:func:`register_shell`).

A binder returns None for a call its rule does not describe; it decides that by
looking at the arguments, never by catching an exception, so a call a user wrote
wrong reaches torch, which raises its own error, and a mistake in a binder is seen.

The tensors in the slots may be parameters or functions of parameters alone (a
standardised weight, ``weight_norm``); :mod:`memconv.engine.coverage` proves that on
the autograd graph, and :class:`memconv.engine.calls.OpCall` chains the per-sample
gradients through that function.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor, nn

from .base import LayerRule, find_rule


@dataclass(frozen=True)
class BoundOp:
    """One call of an operation with a rule, its arguments sorted.

    Attributes:
        data: the argument carrying the batch.
        slots: ``{shell parameter name: tensor or None}`` of the parameter arguments.
        shell: builds the shell layer from ``{name: parameter or None}`` (the slots'
            tensors wrapped as parameters, trainable where they depend on trainable
            parameters).
        via: ``{slot: tensor}`` where the call receives not the slot's tensor but a
            tensor computed from it (a class token expanded to the batch).
        before: for an in-place call, ``before(out)``: the data argument's value
            before the call (None if it cannot be told); the rule needs that value.
    """

    data: Tensor
    slots: dict
    shell: Callable[[dict], nn.Module]
    via: dict | None = None
    before: Callable[[Tensor], Tensor | None] | None = None


class OpEntry(NamedTuple):
    """A registered operation.

    Attributes:
        binder: ``binder(args, kwargs)`` (``binder(args, kwargs, expanded)`` with
            ``expansion``) → :class:`BoundOp` or None.
        symmetric: the parameter may be either of two positional arguments (``x + w``
            and ``w + x``): the recorder hands the binder the data argument first.
        expansion: the binder needs ``expanded(t)``: the parameter-only tensor ``t``
            was expanded from along its first axis, or None (a class token).
    """

    binder: Callable
    symmetric: bool = False
    expansion: bool = False


#: ``{function: OpEntry}`` of the operations with a rule (filled by the families).
OPS: dict = {}
#: ``{shell type: rule}`` of the shells that are no layer of torch's (kept out of the
#: registry of layer types, :func:`memconv.layers.registered`).
_SHELL_RULES: dict = {}


def register_op(*funcs, symmetric: bool = False, expansion: bool = False):
    """Decorator registering a binder for the functions ``funcs`` (see :class:`OpEntry`)."""

    def decorate(binder):
        for func in funcs:
            OPS[func] = OpEntry(binder, symmetric, expansion)
        return binder

    return decorate


def register_shell(shell_type: type):
    """Class decorator giving the shell type ``shell_type`` the decorated rule."""

    def decorate(cls):
        _SHELL_RULES[shell_type] = cls()
        return cls

    return decorate


def bind_args(
    names: tuple, args: tuple, kwargs: dict, defaults: dict, tensors: tuple = ("input",)
) -> dict | None:
    """``{name: argument}`` of a call by the operation's signature ``names`` (its
    positional order) and ``defaults``; None if the call does not fit it or an
    argument named in ``tensors`` is not a tensor."""
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    out = dict(defaults)
    out.update(zip(names, args))
    out.update(kwargs)
    if not all(n in out for n in names):
        return None
    if not all(isinstance(out[n], Tensor) for n in tensors):
        return None
    return out


def with_params(shell: nn.Module, params: dict) -> nn.Module:
    """``shell`` with ``params`` ``{name: parameter, tensor or None}`` as its parameters
    (a tensor that is not an ``nn.Parameter``, :func:`as_parameter`'s, is put in the
    shell's parameter dictionary as it is)."""
    for k, p in params.items():
        if p is None or isinstance(p, nn.Parameter):
            setattr(shell, k, p)
        else:
            shell.__dict__.pop(k, None)  # (a shell's plain attribute of that name)
            shell._parameters[k] = p
    return shell


#: ``{(layer type, arguments): layer}``: the prototypes :func:`new_layer` copies.
_PROTOTYPES: dict = {}
#: Prototypes kept at most (a model calls a few dozen distinct operations).
_MAX_PROTOTYPES = 1024


def new_layer(layer_type: type, *args, **kwargs) -> nn.Module:
    """``layer_type(*args, **kwargs, device="meta")`` for a shell, without a tensor
    operation: a copy of a prototype made once per type and arguments (its own
    parameter, buffer and submodule dictionaries; the meta parameters are the
    prototype's until :func:`with_params` replaces them). Constructing the layer
    afresh initialises its parameters, a handful of operations per call on the meta
    device, at every operation call of every step."""
    try:
        key = (layer_type, args, tuple(sorted(kwargs.items())))
        hash(key)
    except TypeError:  # an unhashable argument (a list): made afresh
        return layer_type(*args, **kwargs, device="meta")
    proto = _PROTOTYPES.get(key)
    if proto is None:
        if len(_PROTOTYPES) >= _MAX_PROTOTYPES:
            _PROTOTYPES.clear()
        proto = _PROTOTYPES[key] = layer_type(*args, **kwargs, device="meta")
    layer = copy.copy(proto)
    layer._parameters = dict(proto._parameters)
    layer._buffers = dict(proto._buffers)
    layer._modules = dict(proto._modules)
    return layer


def as_parameter(t: Tensor, trainable: bool) -> Tensor:
    """``t`` as a shell's parameter: the model's parameter itself where ``t`` is one
    (of the same ``requires_grad``), else a leaf sharing ``t``'s memory without its
    graph (``detach``: an operation a trace records, so that a traced step reads the
    step's own tensor, never one frozen at the trace). :func:`with_params` sets it."""
    if t.is_leaf and isinstance(t, nn.Parameter) and t.requires_grad == trainable:
        return t
    return t.detach().requires_grad_(trainable)


def shell_rule(shell: nn.Module) -> LayerRule | None:
    """The rule serving an operation call through its shell layer."""
    return _SHELL_RULES.get(type(shell)) or find_rule(shell)


def symmetric(func) -> bool:
    """Whether ``func``'s parameter may be either of its two positional arguments."""
    entry = OPS.get(func)
    return entry is not None and entry.symmetric


def bind_op(func, args: tuple, kwargs: dict, expanded: Callable) -> BoundOp | None:
    """The :class:`BoundOp` of a call of ``func``, or None if no rule describes it
    (``expanded``: see :class:`OpEntry`). A binder's own error propagates."""
    entry = OPS.get(func)
    if entry is None:
        return None
    if entry.expansion:
        return entry.binder(args, kwargs or {}, expanded)
    return entry.binder(args, kwargs or {})
