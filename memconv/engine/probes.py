"""Probes of a model's layer calls: which axis of each argument and output is the batch
axis, told from forward passes of one and of two samples.

:func:`recording_calls` records every call of a module owning trainable parameters
(and of an operation with a rule on parameters, :class:`memconv.engine.recorder.OpRecorder`)
with the shapes of its leaves; :func:`call_axes` compares the records of the two
passes (an axis that grew from 1 to 2 is the batch axis); a walk checks each call of
its own pass against them (:func:`check_call_axes`, :class:`ProbeMismatch`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._torch import tree_flatten, tree_unflatten
from ..layers import own_trainable
from ..layers.operations import BoundOp
from .recorder import OpRecorder, paused

#: Marks a tensor whose batch axis cannot be told (it grew other than 1 → 2).
UNSPLIT = -1


def keep_rng():
    """A block after which the random number generators are as before it (a probe
    forward pass must not change the dropout masks of the pass that follows)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


def _axis(s1, s2) -> int | None:
    if s1 == s2:
        return None
    if len(s1) != len(s2):
        return UNSPLIT
    diff = [a for a, (u, v) in enumerate(zip(s1, s2)) if u != v]
    if len(diff) == 1 and s1[diff[0]] == 1 and s2[diff[0]] == 2:
        return diff[0]
    return UNSPLIT


def _shapes(tree) -> list:
    return leaf_shapes(flatten_call(tree)[0])


def flatten_call(tree) -> tuple[list, object]:
    """``tree_flatten``, without its cost for the common calls: a tensor, or positional
    tensors and no keyword arguments (``(leaves, None)`` then)."""
    if isinstance(tree, Tensor):
        return [tree], None
    if (
        type(tree) is tuple
        and len(tree) == 2
        and type(tree[0]) is tuple
        and tree[1] == {}
        and all(isinstance(a, Tensor) for a in tree[0])
    ):
        return list(tree[0]), None
    return tree_flatten(tree)


def unflatten_call(leaves: list, spec, tensor: bool):
    """The inverse of :func:`flatten_call` (``tensor``: the tree was a tensor)."""
    if spec is not None:
        return tree_unflatten(leaves, spec)
    return leaves[0] if tensor else (tuple(leaves), {})


def leaf_shapes(leaves) -> list:
    return [tuple(t.shape) if isinstance(t, Tensor) else None for t in leaves]


def owner_names(model: nn.Module) -> dict:
    """``{module: name}`` of the modules owning trainable parameters, in ``modules()``
    order (the model itself under its type's name)."""
    return {m: name or type(m).__name__ for name, m in model.named_modules() if own_trainable(m)}


@dataclass(frozen=True)
class CallAxes:
    """The batch axes of one layer call, found by :func:`call_axes`.

    Attributes:
        module: the layer.
        inputs: the batch axis of each leaf of ``(args, kwargs)`` (None: shared by
            all samples; :data:`UNSPLIT`: cannot be told).
        outputs: the same for each leaf of the output.
        shapes: the shapes of the leaves of ``(args, kwargs)`` and of the output in
            the probe of one sample (None for a leaf that is not a tensor).
    """

    module: nn.Module
    inputs: tuple
    outputs: tuple
    shapes: tuple = ((), ())

    def expected(self, m: int) -> tuple[list, list]:
        """The shapes of the call's leaves for ``m`` samples (None: not predicted)."""
        return [_grown(s, ax, m) for s, ax in zip(self.shapes[0], self.inputs)], [
            _grown(s, ax, m) for s, ax in zip(self.shapes[1], self.outputs)
        ]


def _grown(shape, ax, m: int):
    if shape is None or ax is None:
        return shape
    if ax == UNSPLIT:
        return None
    return (*shape[:ax], m, *shape[ax + 1 :])


class ProbedCall(NamedTuple):
    """One call seen by :func:`recording_calls`.

    Attributes:
        caller: the module (a layer owning trainable parameters) or the operation's
            function.
        inputs: the shapes of the leaves of ``(args, kwargs)`` (None for a leaf that is
            not a tensor); for an operation, ``[data argument's shape]``.
        outputs: the shapes of the output's leaves.
        reached: for an operation, the ids of the trainable parameters reaching its
            parameter slots; None for a module.
    """

    caller: object
    inputs: list
    outputs: list
    reached: frozenset | None = None


class ProbeMismatch(RuntimeError):
    """A layer call differs from the probe's (data-dependent control flow, or a model
    changed since a probe was made)."""


class ArgumentsDropped(ProbeMismatch):
    """A walk's coverage gave parameters to a layer call whose arguments it did not keep
    (:attr:`memconv.engine.prepared.KeptWalk.released`): the walks on the probe keep
    every call's arguments from then on, and the call runs again."""


@contextlib.contextmanager
def recording_calls(model: nn.Module):
    """Record a :class:`ProbedCall` of every call of a module owning trainable
    parameters during the forward passes run inside the block (the arguments as the
    caller gave them, before the module's forward pre-hooks), and of every call of an
    operation with a rule on parameters (:class:`memconv.engine.recorder.OpRecorder`).

    Yields:
        The list the calls are appended to, in forward order.
    """
    calls: list = []
    given: dict = {}  # module -> the arguments of its open calls, before any pre-hook

    def pre_hook(module, args, kwargs):
        with paused():
            given.setdefault(module, []).append(_shapes((args, kwargs)))

    def hook(module, args, kwargs, output):
        with paused():
            calls.append(ProbedCall(module, given[module].pop(), _shapes(output)))

    def on_op(func, bound: BoundOp, run):
        out = run()
        reached = frozenset().union(*(recorder.depends(t) for t in bound.slots.values()))
        calls.append(ProbedCall(func, [tuple(bound.data.shape)], _shapes(out), reached))
        return out

    handles = []
    for o in model.modules():
        if own_trainable(o):
            handles.append(o.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
            handles.append(o.register_forward_hook(hook, with_kwargs=True))
    try:
        recorder = OpRecorder(model, on_op)
        with recorder:
            yield calls
    finally:
        for h in handles:
            h.remove()


def call_axes(one: list, two: list) -> list[CallAxes]:
    """The batch axes of every recorded call, from :func:`recording_calls` of forward
    passes of one and of two samples.

    Raises:
        RuntimeError: if the two passes call different layers (data-dependent
            control flow).
    """
    if len(one) != len(two) or any(a.caller is not b.caller for a, b in zip(one, two)):
        raise RuntimeError(
            "the model calls its layers differently for one sample than for two (data-"
            "dependent control flow), so memconv cannot tell their batch axes"
        )
    return [
        CallAxes(
            module=a.caller,
            inputs=tuple(
                _axis(u, v) if u is not None else None for u, v in zip(a.inputs, b.inputs)
            ),
            outputs=tuple(
                _axis(u, v) if u is not None else None for u, v in zip(a.outputs, b.outputs)
            ),
            shapes=(tuple(a.inputs), tuple(a.outputs)),
        )
        for a, b in zip(one, two)
    ]


def check_call_axes(call_axes: CallAxes, module, args_shapes, out_shapes, m: int, name):
    """Raise unless the call is the probe's: the same module, its leaves of the shapes
    the probe predicts for ``m`` samples (``name``: the call's name, or a function
    making it, for the message)."""
    ok = call_axes.module is module
    if ok:
        want_in, want_out = call_axes.expected(m)
        for got, want in ((args_shapes, want_in), (out_shapes, want_out)):
            ok = ok and len(got) == len(want)
            ok = ok and all(w is None or g == w for g, w in zip(got, want))
    if not ok:
        name = name() if callable(name) else name
        raise ProbeMismatch(
            f"layer {name!r} ({type(module).__name__}) was called differently in the probe of "
            "one and two samples than for the batch (data-dependent control flow); memconv "
            "cannot tell its batch axes"
        )
