"""A user's layer rule is checked where memconv calls it, on every path.

A rule (:func:`memconv.layers.register`) is code a user writes. One that forgets a
parameter, or returns a wrong shape, would otherwise give zeros for that parameter,
norms that leave it out, and a clipped sum above its bound: for DP-SGD a privacy bug.
Each result is checked at dispatch (:mod:`memconv.layers.dispatch`): a ``ValueError``
names the rule, the layer and the parameter, before anything reaches ``.grad``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, func_reference, total_norms
from torch import nn

import memconv
from memconv.layers import LayerRule

pytest.importorskip("opacus")
from opacus import GradSampleModule  # noqa: E402

from memconv.integrations import opacus as mo  # noqa: E402


class ScaledLinear(nn.Linear):
    """An ``nn.Linear`` subclass with a forward of its own, as a user writes one."""

    def forward(self, x):
        return F.linear(2.0 * x, self.weight, self.bias)


def _weight(module, inputs, grad_output):
    return torch.einsum("no,ni->noi", grad_output, 2.0 * inputs[0])


class ForgetsBias(LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        return {"weight": _weight(module, inputs, grad_output)}


class WrongShape(LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        return {
            "weight": _weight(module, inputs, grad_output).transpose(1, 2),
            "bias": grad_output,
        }


class Correct(LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        return {"weight": _weight(module, inputs, grad_output), "bias": grad_output}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), ScaledLinear(4, 2)).double()


def data(n=6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(
        0, 2, (n,), generator=g
    )


LOSS = nn.CrossEntropyLoss(reduction="sum")


@pytest.fixture
def rule(request):
    memconv.layers.register(ScaledLinear)(request.param)
    yield request.param
    memconv.layers.unregister(ScaledLinear)


CALLS = {
    "grads": lambda m, x, y: memconv.per_sample_grads(m, LOSS, x, y),
    "norms": lambda m, x, y: memconv.per_sample_norms(m, LOSS, x, y),
    "norms-instantiate": lambda m, x, y: memconv.per_sample_norms(
        m, LOSS, x, y, norm_route="instantiate"
    ),
    "clip-book-keeping": lambda m, x, y: memconv.clip_and_accumulate(
        m, LOSS, x, y, max_norm=1e-3, clip_route="book-keeping"
    ),
    "clip-two-pass": lambda m, x, y: memconv.clip_and_accumulate(
        m, LOSS, x, y, max_norm=1e-3, clip_route="two-pass"
    ),
    "clip-per-layer": lambda m, x, y: memconv.clip_and_accumulate(
        m, LOSS, x, y, max_norm=1e-3, groups="layer"
    ),
    "step": lambda m, x, y: memconv.PrivateStep(m, LOSS).clip_and_accumulate(x, y, max_norm=1e-3),
    "step-grads": lambda m, x, y: memconv.PrivateStep(m, LOSS).per_sample_grads(x, y),
}


@pytest.mark.parametrize("rule", [ForgetsBias], indirect=True)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_rule_that_forgets_a_parameter_is_refused_on_every_path(rule, call):
    m = model()
    x, y = data()
    with pytest.raises(ValueError, match=r"ForgetsBias\.(grad_sample|sq_norms) .*'bias'") as info:
        CALLS[call](m, x, y)
    assert "'2'" in str(info.value) and "ScaledLinear" in str(info.value)  # the layer
    assert all(p.grad is None for p in m.parameters())  # nothing reached .grad


@pytest.mark.parametrize("rule", [WrongShape], indirect=True)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_rule_with_a_wrong_shape_is_refused_on_every_path(rule, call):
    m = model()
    x, y = data()
    with pytest.raises(
        ValueError, match=r"WrongShape\.grad_sample returned \[6, 4, 2\] for parameter 'weight'"
    ):
        CALLS[call](m, x, y)
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("rule", [Correct], indirect=True)
def test_a_correct_rule_serves_every_path_exactly(rule):
    m = model()
    x, y = data()
    ref = func_reference(m, LOSS, x, y)
    assert_close(memconv.per_sample_grads(m, LOSS, x, y), ref, 1e-10)
    norms = memconv.per_sample_norms(m, LOSS, x, y)
    assert torch.allclose(norms, total_norms(ref), rtol=1e-10)
    for route in ("book-keeping", "two-pass"):
        for p in m.parameters():
            p.grad = None
        memconv.clip_and_accumulate(m, LOSS, x, y, max_norm=0.5, clip_route=route)
        c = (0.5 / total_norms(ref)).clamp(max=1.0)
        want = {k: torch.einsum("n,n...->...", c, v) for k, v in ref.items()}
        assert_close({k: p.grad for k, p in m.named_parameters()}, want, 1e-10)


@pytest.mark.parametrize("rule", [ForgetsBias, WrongShape], indirect=True)
def test_the_opacus_bridge_refuses_it_too(rule):
    m = model()
    x, y = data()
    with mo.installed():
        gsm = GradSampleModule(m, loss_reduction="sum")
        with pytest.raises(ValueError, match=rf"{rule.__name__}\.grad_sample"):
            LOSS(gsm(x), y).backward()


class NotADict(LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        return [grad_output]


class ExtraKey(LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        out = Correct().grad_sample(module, inputs, grad_output)
        return {**out, "scale": grad_output}


class OtherDevice(LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        out = Correct().grad_sample(module, inputs, grad_output)
        return {k: v.to("meta") for k, v in out.items()}


class IntegerResult(LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        out = Correct().grad_sample(module, inputs, grad_output)
        return {k: v.long() for k, v in out.items()}


class NegativeMemory(Correct):
    def memory(self, module, input_shapes, itemsize, task):
        return -1


@pytest.mark.parametrize(
    "rule, message",
    [
        (NotADict, r"NotADict\.grad_sample returned list; a rule returns a dict"),
        (ExtraKey, r"returned 'scale', which is not a trainable parameter"),
        (OtherDevice, r"on meta for parameter '(weight|bias)'; expected .* on cpu"),
        (IntegerResult, r"torch\.int64 tensor .* expected a floating-point tensor"),
        (NegativeMemory, r"NegativeMemory\.memory returned -1"),
    ],
    indirect=["rule"],
)
def test_every_promise_is_checked(rule, message):
    m = model()
    x, y = data()
    with pytest.raises(ValueError, match=message):
        memconv.per_sample_grads(m, LOSS, x, y, memory_budget=2**30)


def test_a_frozen_parameter_need_not_be_returned():
    memconv.layers.register(ScaledLinear)(ForgetsBias)
    try:
        m = model()
        m[2].bias.requires_grad_(False)
        x, y = data()
        got = memconv.per_sample_grads(m, LOSS, x, y)
        assert_close(got, func_reference(m, LOSS, x, y), 1e-10)
    finally:
        memconv.layers.unregister(ScaledLinear)


def test_a_users_malformed_operation_call_gets_torchs_own_error():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))

        def forward(self, x):
            return F.linear(x, self.weight, bias="not a tensor")

    x, y = data()
    with pytest.raises(TypeError) as direct:
        Bad()(x)
    with pytest.raises(TypeError) as through:
        memconv.per_sample_grads(Bad(), LOSS, x, y)
    assert str(through.value) == str(direct.value)


def test_a_binder_that_fails_is_not_hidden(monkeypatch):
    from memconv.layers import operations

    def broken(args, kwargs):
        raise AttributeError("a mistake in a binder")

    monkeypatch.setitem(operations.OPS, F.linear, operations.OpEntry(broken))

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2, 3, dtype=torch.float64))

        def forward(self, x):
            return F.linear(x, self.weight)

    x, y = data()
    with pytest.raises(AttributeError, match="a mistake in a binder"):
        memconv.per_sample_grads(Functional(), LOSS, x, y)
