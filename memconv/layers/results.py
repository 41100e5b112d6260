"""What a rule promises, and the checks that it kept its promise.

:mod:`memconv.layers.dispatch` checks every result where it calls a rule, and the
defaults of :class:`memconv.layers.LayerRule` check the ``grad_sample`` results they
derive norms, summed gradients and channel statistics from, so that a wrong result
never becomes a plausible number. See :mod:`memconv.layers.dispatch`.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from collections.abc import Iterable

from torch import Tensor, nn

from .._torch import own_parameters

#: The per-sample methods of a rule, and the shape each promises for a parameter ``p``
#: and N samples.
SHAPES = {
    "grad_sample": lambda p, n: (n, *p.shape),
    "sq_norms": lambda p, n: (n,),
    "summed_grad": lambda p, n: tuple(p.shape),
}


def own_trainable(module: nn.Module) -> dict[str, Tensor]:
    """``{local name: parameter}`` of the module's own parameters that require grad."""
    return {k: p for k, p in own_parameters(module) if p.requires_grad}


#: The layer or operation whose rule is being called (set by the dispatch), for the
#: messages of checks made inside the rule's own defaults.
_CALLING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "memconv_rule_caller", default=None
)


@contextlib.contextmanager
def calling(where: str | None):
    """Name ``where`` (a layer or operation) in the checks made inside the block."""
    token = _CALLING.set(where)
    try:
        yield
    finally:
        _CALLING.reset(token)


def _where(module: nn.Module, where: str | None) -> str:
    return where or _CALLING.get() or f"layer {type(module).__name__}"


def check_result(
    rule,
    method: str,
    module: nn.Module,
    out,
    n: int,
    *,
    expected: Iterable[str] | None = None,
    where: str | None = None,
    own: dict | None = None,
) -> None:
    """Raise ``ValueError`` unless ``out`` is what ``rule.method`` promises for ``n``
    samples (see :func:`run_rule`; ``own``: :func:`own_trainable` of ``module``, if
    the caller has it)."""
    if own is None:
        own = own_trainable(module)
    name = f"{type(rule).__name__}.{method}"
    at = _where(module, where)
    if not isinstance(out, dict):
        raise ValueError(
            f"{at}: rule {name} returned {type(out).__name__}; a rule returns a dict "
            "{parameter name: tensor} (memconv.layers.LayerRule)"
        )
    shape = SHAPES[method]
    needed = set(own if expected is None else expected)
    missing = sorted(needed - set(out))
    if missing:
        promised = ", ".join(
            f"{k!r}: [{', '.join(map(str, shape(own[k], 'N')))}]" for k in missing if k in own
        )
        raise ValueError(
            f"{at}: rule {name} returned no result for the trainable parameter(s) "
            f"{', '.join(map(repr, missing))} (expected {{{promised}}}); a rule returns every "
            "trainable parameter of its layer (those with requires_grad), or the layer's "
            "per-sample quantities would be incomplete. Fix the rule, or freeze the parameter."
        )
    for k, v in out.items():
        p = own.get(k)
        if p is None:
            raise ValueError(
                f"{at}: rule {name} returned {k!r}, which is not a trainable parameter of "
                f"the layer (its trainable parameters: {sorted(own)})"
            )
        want = shape(p, n)
        if not isinstance(v, Tensor) or tuple(v.shape) != want:
            got = list(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(
                f"{at}: rule {name} returned {got} for parameter {k!r}; expected a tensor of "
                f"shape {list(want)} ({_PROMISE[method]}, N={n})"
            )
        if not v.is_floating_point() or v.device != p.device:
            raise ValueError(
                f"{at}: rule {name} returned a {v.dtype} tensor on {v.device} for parameter "
                f"{k!r}; expected a floating-point tensor on {p.device}, the parameter's device"
            )


_PROMISE = {
    "grad_sample": "[N, *parameter.shape]",
    "sq_norms": "[N]",
    "summed_grad": "parameter.shape",
}


def _describe(out) -> str:
    if isinstance(out, tuple):
        return "(" + ", ".join(_describe(t) for t in out) + ")"
    return str(list(out.shape)) if isinstance(out, Tensor) else type(out).__name__


def check_channel_stats(
    rule, module: nn.Module, out, n: int, name: str, channels: int, *, where=None
):
    """Raise ``ValueError`` unless ``out`` is three tensors ``[n, channels]`` (what
    :meth:`memconv.layers.LayerRule.channel_stats` promises)."""
    want = (n, channels)
    ok = isinstance(out, tuple) and len(out) == 3
    if not (ok and all(isinstance(t, Tensor) and tuple(t.shape) == want for t in out)):
        raise ValueError(
            f"{_where(module, where)}: rule {type(rule).__name__}.channel_stats returned "
            f"{_describe(out)} for parameter {name!r}; expected three tensors of shape "
            f"{list(want)} ([N, C]: ‖g_c‖², ⟨g_c,1⟩, ⟨g_c,ŵ_c⟩)"
        )


def check_memory(rule, module: nn.Module, out, *, where=None) -> int:
    """``out`` as bytes, or ``ValueError`` unless it is a number >= 0 (what
    :meth:`memconv.layers.LayerRule.memory` promises)."""
    if isinstance(out, bool) or not isinstance(out, numbers.Real) or not out >= 0:
        raise ValueError(
            f"{_where(module, where)}: rule {type(rule).__name__}.memory returned {out!r}; "
            "expected the bytes of the rule's temporaries, a number >= 0"
        )
    return int(out)
