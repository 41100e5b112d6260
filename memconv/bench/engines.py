"""Per-sample-gradient engines compared by ``memconv compare`` and ``memconv bench``.

Every engine takes a plain torch model (freshly built by the worker), a batch and
its labels, and returns ``{parameter name: Tensor [N, *shape]}`` with the gradient
of each sample's own loss (cross-entropy, summed reduction), or, for the
``"autograd"`` floor, the summed gradient ``{name: Tensor [*shape]}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import memconv


@dataclass(frozen=True)
class Engine:
    """A way of computing per-sample gradients.

    Attributes:
        name: the engine's label in tables.
        run: ``run(model, inputs, labels) -> dict``.
        per_sample: False for engines that only compute the summed gradient.
        requires: importable module the engine needs (reported as skipped if absent).
    """

    name: str
    run: Callable
    per_sample: bool = True
    requires: str | None = None


def _loss():
    return nn.CrossEntropyLoss(reduction="sum")


def autograd_sum(model, x, y):
    """Plain ``loss.backward()``: the summed gradient only (the floor)."""
    model.zero_grad(set_to_none=True)
    _loss()(model(x), y).backward()
    out = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def torch_func(model, x, y):
    """``torch.func.vmap(grad(loss))`` over the batch."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss = _loss()

    def single(p, xi, yi):
        return loss(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    return torch.func.vmap(torch.func.grad(single), in_dims=(None, 0, 0))(params, x, y)


def memconv_hooks(strategy: str):
    """``memconv.per_sample_grads`` with one strategy."""

    def run(model, x, y):
        return memconv.per_sample_grads(model, _loss(), x, y, strategy=strategy)

    return run


def _registry() -> dict[str, Engine]:
    engines = [Engine("autograd", autograd_sum, per_sample=False), Engine("torch.func", torch_func)]
    engines += [Engine(f"memconv:{s}", memconv_hooks(s)) for s in memconv.strategies()]
    return {e.name: e for e in engines}


ENGINES = _registry()


def get_engine(name: str) -> Engine:
    """The engine called ``name``.

    Raises:
        ValueError: for an unknown name (the message lists the accepted ones).
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; accepted: {', '.join(ENGINES)}")
    return ENGINES[name]
