"""The operations a forward pass calls on parameters, seen through ``__torch_function__``.

:class:`OpRecorder` is a ``TorchFunctionMode`` active only during the forward passes of
a probe and of the walk (as torch's ExpandedWeights finds ``F.conv2d`` whatever module
calls it). It follows which tensors are **functions of the parameters alone**: a
parameter or buffer of the model, or the output of an operation whose tensor arguments
are all such (the batch never enters them: the inputs come from outside). A call of an
operation with a rule (:mod:`memconv.layers.operations`) whose data argument carries the batch
and whose parameter slots hold such tensors, one of them depending on a trainable
parameter, is handed to ``on_call``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._torch import no_torch_function, tree_flatten
from ..layers.operations import BoundOp, bind_op, symmetric
from ..layers.standardise import Standardised, trace


def _tensors(args: tuple, kwargs: dict) -> list:
    """The tensors among ``args`` and ``kwargs`` (``tree_flatten`` only for nested
    containers: this runs on every operation of the forward pass)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, Tensor):
                    out.append(b)
                elif isinstance(b, (list, tuple, dict)):
                    out.extend(t for t in tree_flatten(b)[0] if isinstance(t, Tensor))
        elif isinstance(a, dict):
            out.extend(t for t in tree_flatten(a)[0] if isinstance(t, Tensor))
    return out


def _in_place(name: str) -> bool:
    if name.startswith("__"):
        return name.startswith("__i") or name == "__setitem__"
    return name.endswith("_")


def paused():
    """A block in which no operation is recorded, for memconv's own work during a
    recorded pass (its hooks): their tensor operations then cost what they cost
    outside the mode."""
    return no_torch_function()


class OpRecorder(TorchFunctionMode):
    """Records the calls of operations with a rule on parameter-only tensors.

    Args:
        model: the model (its parameters and buffers are where purity starts).
        on_call: ``on_call(func, bound, run)`` for each such call; ``run()`` runs the
            call and returns its output, which ``on_call`` returns (or a replacement).
    """

    def __init__(self, model: nn.Module, on_call: Callable):
        super().__init__()
        self.on_call = on_call
        # {id(tensor): (tensor, ids of the trainable parameters it depends on, its
        # recipe or None)}: the tensor is kept alive so that its id is not reused
        # during the pass
        self.pure: dict = {}
        # {id(tensor): tensor it was expanded from} of parameter-only tensors expanded
        # along their first axis (a class token expanded to the batch)
        self.expanded: dict = {}
        for b in model.buffers():
            self.pure[id(b)] = (b, frozenset(), None)
        for p in model.parameters():
            self.pure[id(p)] = (p, frozenset({id(p)}) if p.requires_grad else frozenset(), None)

    def alias(self, new: Tensor, old: Tensor) -> None:
        """Record ``new`` (a copy of ``old`` made during :func:`paused`) as ``old`` is
        (without a recipe: a copy is not the step a recipe describes)."""
        entry = self.pure.get(id(old))
        if entry is not None and entry[0] is old:
            self.pure[id(new)] = (new, entry[1], None)

    def trainable(self, t) -> bool:
        """Whether ``t`` is a function of the parameters alone depending on a trainable one."""
        return bool(self.depends(t))

    def depends(self, t) -> frozenset:
        """The ids of the trainable parameters a parameter-only tensor depends on."""
        entry = self.pure.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else frozenset()

    def is_pure(self, t) -> bool:
        entry = self.pure.get(id(t))
        return entry is not None and entry[0] is t

    def recipe(self, t):
        """The recipe of a parameter-only tensor made by a known map's step, or None."""
        entry = self.pure.get(id(t))
        return entry[2] if entry is not None and entry[0] is t else None

    def standardised(self, t) -> Standardised | None:
        """The :class:`memconv.layers.standardise.Standardised` recipe of ``t`` if ``t``
        is a whole standardised weight, untouched since it was made; else None."""
        r = self.recipe(t)
        return r if isinstance(r, Standardised) and r.shaped and r.intact() else None

    def _parameter(self, t) -> bool:
        return self.depends(t) == {id(t)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        pure = all(self.is_pure(t) for t in tensors)
        bound = None if pure else self._bind(func, args, kwargs)
        if bound is not None:
            out = self.on_call(func, bound, lambda: func(*args, **kwargs))
        else:
            out = func(*args, **kwargs)
        outs = [out] if isinstance(out, Tensor) else _tensors((out,), {})
        if pure and tensors:
            trainable = frozenset().union(*(self.pure[id(t)][1] for t in tensors))
            recipe = None
            if trainable:
                recipe = trace(func, args, kwargs, out, self.recipe, self._parameter, self.depends)
            for t in outs:
                self.pure[id(t)] = (t, trainable, recipe if t is out else None)
            if func is Tensor.expand and trainable and len(outs) == 1:
                source = tensors[0]
                if source.dim() == outs[0].dim() and source.shape[0] == 1:
                    self.expanded[id(outs[0])] = source
        elif pure:  # a factory function: a constant
            for t in outs:
                self.pure[id(t)] = (t, frozenset(), None)
        else:  # the batch (or something unknown) entered: in-place results too
            for t in outs:
                self.pure.pop(id(t), None)
            if _in_place(getattr(func, "__name__", "")) and tensors:
                self.pure.pop(id(tensors[0]), None)
            out_arg = kwargs.get("out")
            if isinstance(out_arg, Tensor):
                self.pure.pop(id(out_arg), None)
        return out

    def _expanded(self, t) -> Tensor | None:
        entry = self.pure.get(id(t))
        return self.expanded.get(id(t)) if entry is not None and entry[0] is t else None

    def _bind(self, func, args, kwargs) -> BoundOp | None:
        if len(args) == 2 and symmetric(func) and self.is_pure(args[0]):
            args = (args[1], args[0])
        bound = bind_op(func, args, kwargs, self._expanded)
        if bound is None or self.is_pure(bound.data):
            return None
        slots = [t for t in bound.slots.values() if t is not None]
        if not all(isinstance(t, Tensor) and self.is_pure(t) for t in slots):
            return None
        if not any(self.trainable(t) for t in slots):
            return None
        return bound
