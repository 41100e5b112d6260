"""Where a rule is called, and its results checked before anything uses them.

Every call of a rule's ``grad_sample``, ``sq_norms``, ``summed_grad``,
``channel_stats`` and ``memory`` goes through this module (the engine's layer and
operation calls, the extended modules, the Opacus bridge and the planner). A rule is
code a user may write (:func:`memconv.layers.register`), and a per-sample result that
is silently missing or of the wrong shape is a wrong norm, a clipped sum above its
bound — for DP-SGD a privacy bug. So each result is checked where it is dispatched
(:mod:`memconv.layers.results`), as BackPACK checks its derivatives' shapes
(``@shape_check``): the keys are the trainable parameters the call needs, each value
has the shape the method promises (``[N, *p.shape]``, ``[N]``, ``p.shape``), a
floating dtype and the parameter's device; otherwise a ``ValueError`` names the rule,
the layer and the parameter, before any result reaches ``.grad``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .base import LayerRule
from .results import SHAPES, calling, check_channel_stats, check_memory, check_result, own_trainable


def run_rule(
    rule: LayerRule,
    method: str,
    module: nn.Module,
    inputs: tuple,
    grad_output: Tensor,
    *,
    expected: Iterable[str] | None = None,
    where: str | None = None,
) -> dict[str, Tensor]:
    """Call a rule's ``grad_sample``, ``sq_norms`` or ``summed_grad`` under
    ``torch.no_grad`` and check what it returns; an empty batch (N = 0) gets empty
    results without calling it.

    Args:
        rule: the rule.
        method: ``"grad_sample"``, ``"sq_norms"`` or ``"summed_grad"``.
        module: the layer (or an operation's shell layer).
        inputs: the call's positional tensors, batch axis first.
        grad_output: the output gradient ``[N, ...]``.
        expected: the local names of the parameters the caller needs (default:
            the layer's own trainable parameters).
        where: the layer or operation for messages (default: its type).

    Returns:
        ``{local name: tensor}``: for each of the layer's trainable parameters
        ``[N, *p.shape]`` (``grad_sample``), ``[N]`` (``sq_norms``) or ``p.shape``
        (``summed_grad``).

    Raises:
        ValueError: the result is not a dict of tensors, misses a parameter in
            ``expected``, names one that is not a trainable parameter of the layer,
            or has a value of another shape, a non-floating dtype or another device
            than the parameter (naming the rule, the layer, the parameter and what
            was expected).
    """
    own = own_trainable(module)
    n = grad_output.shape[0]
    if n == 0:
        shape = SHAPES[method]
        return {k: p.new_zeros(shape(p, 0)) for k, p in own.items()}
    with torch.no_grad(), calling(where):
        out = getattr(rule, method)(module, inputs, grad_output)
    check_result(rule, method, module, out, n, expected=expected, where=where, own=own)
    return out


def rule_channel_stats(
    rule: LayerRule,
    module: nn.Module,
    inputs: tuple,
    grad_output: Tensor,
    name: str,
    w_hat: Tensor,
    *,
    where: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A rule's :meth:`~memconv.layers.LayerRule.channel_stats` under ``torch.no_grad``,
    checked: three tensors ``[N, C]`` (C = ``w_hat.shape[0]``).

    Raises:
        ValueError: naming the rule, the layer and the parameter.
    """
    with torch.no_grad(), calling(where):
        out = rule.channel_stats(module, inputs, grad_output, name, w_hat)
    n = grad_output.shape[0]
    check_channel_stats(rule, module, out, n, name, w_hat.shape[0], where=where)
    return out


def rule_memory(
    rule: LayerRule,
    module: nn.Module,
    input_shapes: tuple,
    itemsize: int,
    task: str,
    *,
    where: str | None = None,
) -> int:
    """A rule's :meth:`~memconv.layers.LayerRule.memory` (bytes), checked: a number >= 0.

    Raises:
        ValueError: naming the rule and the layer.
    """
    return check_memory(
        rule, module, rule.memory(module, input_shapes, itemsize, task), where=where
    )
