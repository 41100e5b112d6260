"""Checks of a traced graph: what a ``make_fx`` trace cannot keep is refused.

Shared by the compiled per-sample step (:mod:`memconv.engine.traced`) and the compiled
streamed tiles (:mod:`memconv.streaming.compiled`): both trace memconv's Python with
``torch.fx``'s ``make_fx`` into one graph of ATen operations and hand it to the
model's compiler. A trace records tensor operations only; what acts outside them (a
hook that stores an activation, a tensor captured from outside the model, random
numbers to be replayed) would be frozen or lost, so it is refused, never baked in.
"""

from __future__ import annotations

from torch import Tensor, nn

from ._torch import global_module_hooks, literal_copy, module_hook_items, random_op


class NotTraceable(RuntimeError):
    """A step that cannot run as one compiled graph (the reason in the message)."""


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def check_constants(graph: nn.Module, model: nn.Module) -> None:
    """Refuse a traced graph that reads a tensor from outside its inputs which is
    not one of ``model``'s parameters or buffers (its value at the trace would be
    frozen into every later step). Literals made inside the step (``torch.tensor(2.0)``,
    read through ``lift_fresh_copy``) are kept.

    Raises:
        NotTraceable: naming the operation that reads such a tensor.
    """
    own = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    for node in graph.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(graph, node.target)
        if not isinstance(value, Tensor) or id(value) in own:
            continue
        users = list(node.users)
        if users and all(literal_copy(u.target) for u in users):
            continue
        names = ", ".join(str(u.target) for u in users[:3])
        raise NotTraceable(
            f"the step reads a tensor {tuple(value.shape)} of dtype {value.dtype} that is "
            f"neither an input nor a parameter or buffer of the model (used by {names})"
        )


#: Hooks whose only effect is a computation the trace records (a pruned or
#: weight-normalised weight made from its parameters before each call).
_PURE_HOOKS = ("BasePruningMethod", "WeightNorm")


def check_hooks(model: nn.Module) -> None:
    """Refuse a model whose modules hold hooks that may act outside their tensors'
    computation (store an activation, log, count): a trace runs them once, and the
    compiled step would not run them again. Pruning's and weight normalisation's hooks,
    which only compute a weight, are kept.

    Raises:
        NotTraceable: naming the module and the hook.
    """
    if global_module_hooks(backward=True):
        raise NotTraceable("global module hooks are registered (they would run only at the trace)")
    for name, module in model.named_modules():
        for kind, hook in module_hook_items(module):
            if any(c.__name__ in _PURE_HOOKS for c in type(hook).__mro__):
                continue
            what = getattr(hook, "__qualname__", type(hook).__name__)
            raise NotTraceable(
                f"module {name or type(model).__name__!r} ({type(module).__name__}) has a "
                f"{kind} {what}, which would run at the trace only, not at each "
                "compiled step"
            )


def check_random(graph: nn.Module) -> None:
    """Refuse a traced step that draws random numbers (dropout in training mode): the
    eager walk replays the forward pass's random numbers where it recomputes, which the
    graph cannot promise.

    Raises:
        NotTraceable: naming the random operation.
    """
    for node in graph.graph.nodes:
        if node.op == "call_function" and random_op(node.target, node.args, node.kwargs):
            raise NotTraceable(
                f"the step draws random numbers ({node.target}: dropout in training "
                "mode?), whose replay the compiled graph cannot promise"
            )


__all__ = ["NotTraceable", "check_constants", "check_hooks", "check_random", "first_line"]
