"""Weight-standardised convolutions (timm's ``StdConv2d``, ``ScaledStdConv2d``; Qiao et
al. 2019, Brock et al. 2021): the closed form of the standardisation's Jacobian
(:mod:`memconv.layers.standardise`) against a per-sample autograd loop, in float64.

Each model is checked in ``per_sample_norms``, ``per_sample_grads`` and
``clip_and_accumulate`` (both clipping routes), with and without a memory budget;
the closed form is shown to be the route taken where the standardisation is
recognised, and the maps it must not recognise are shown to stay exact (the
generic chain through the autograd graph).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, loop_reference
from helpers import small_data as data
from helpers import total_norms as _norms
from torch import nn

import memconv
import memconv.conv.ghost
import memconv.engine.calls
import memconv.engine.walk
from memconv.bench import models
from memconv.conv.norm_routes import grad_channel_stats
from memconv.layers import standardise

TOL = 1e-9


class ScaledStdConv2d(models.ScaledStdConv2d):
    """timm's ``ScaledStdConv2d`` (:mod:`memconv.bench.models`' copy) with its gains
    spread over [0.5, 1.5], so that a gain applied to the wrong channel shows."""

    def __init__(self, cin, cout, k, stride=1, padding=0, groups=1, gamma=1.0, eps=1e-6):
        super().__init__(
            cin, cout, k, stride=stride, padding=padding, groups=groups, gamma=gamma, eps=eps
        )
        with torch.no_grad():
            self.gain.copy_(torch.linspace(0.5, 1.5, cout).reshape(cout, 1, 1, 1))


class StdConv2d(nn.Conv2d):
    """timm's ``StdConv2d``: standardised per output channel, no gain."""

    def __init__(self, cin, cout, k, padding=0, groups=1, eps=1e-6):
        super().__init__(cin, cout, k, padding=padding, groups=groups, bias=False)
        self.eps = eps

    def forward(self, x):
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            training=True,
            momentum=0.0,
            eps=self.eps,
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class StdLinear(nn.Linear):
    """A Linear layer whose weight is standardised per output feature, with a gain: the
    rule's default per-channel numbers (from instantiated per-sample gradients)."""

    def __init__(self, cin, cout):
        super().__init__(cin, cout)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, cout))

    def forward(self, x):
        weight = F.batch_norm(
            self.weight.view(1, self.out_features, -1),
            None,
            None,
            self.gain,
            None,
            True,
            0.0,
            1e-4,
        ).view_as(self.weight)
        return F.linear(x, weight, self.bias)


def _dilated(self):
    self.dilation = (2, 2)
    return self


StdConv2d.dilated = _dilated


class OtherAxis(nn.Conv2d):
    """Standardised over the input channels (``[1, C_in, C_out·k²]``): not the map."""

    def forward(self, x):
        w = self.weight.transpose(0, 1)
        weight = (
            F.batch_norm(w.reshape(1, self.in_channels, -1), None, None, training=True, eps=1e-5)
            .reshape_as(w)
            .transpose(0, 1)
        )
        return F.conv2d(x, weight, self.bias, padding=self.padding)


class Doubled(nn.Conv2d):
    """``2·w`` standardised with running statistics (eval-mode batch norm): not the map."""

    def __init__(self, cin, cout, k, padding=0):
        super().__init__(cin, cout, k, padding=padding)
        self.register_buffer("mean", torch.zeros(cout))
        self.register_buffer("var", torch.ones(cout))

    def forward(self, x):
        w = (self.weight * 2).reshape(1, self.out_channels, -1)
        weight = F.batch_norm(w, self.mean, self.var, training=False, eps=1e-5)
        return F.conv2d(x, weight.reshape_as(self.weight), self.bias, padding=self.padding)


class Biased(StdConv2d):
    """A standardisation with a bias in ``F.batch_norm``: not the map (generic chain)."""

    def __init__(self, cin, cout, k, padding=0):
        super().__init__(cin, cout, k, padding=padding)
        self.shift = nn.Parameter(torch.linspace(-0.1, 0.1, cout))

    def forward(self, x):
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            bias=self.shift,
            training=True,
            eps=1e-5,
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, None, padding=self.padding)


def _head(cin, side=4, classes=3):
    return [nn.ReLU(), nn.Flatten(), nn.Linear(cin * side * side, classes)]


BUILDERS = {
    "scaled": lambda: nn.Sequential(ScaledStdConv2d(2, 4, 3, padding=1, gamma=1.7), *_head(4)),
    "std_no_gain": lambda: nn.Sequential(StdConv2d(2, 4, 3, padding=1), *_head(4)),
    "grouped": lambda: nn.Sequential(
        ScaledStdConv2d(2, 6, 3, padding=1, groups=2),
        nn.ReLU(),
        StdConv2d(6, 4, 3, padding=1, groups=2),
        *_head(4),
    ),
    "large_eps": lambda: nn.Sequential(
        ScaledStdConv2d(2, 4, 3, padding=1, eps=1e-1),
        nn.ReLU(),
        StdConv2d(4, 4, 1, eps=1e-1),
        *_head(4),
    ),
    "linear": lambda: nn.Sequential(nn.Flatten(), StdLinear(32, 6), nn.Tanh(), nn.Linear(6, 3)),
    "strided": lambda: nn.Sequential(ScaledStdConv2d(2, 4, 3, stride=2, padding=1), *_head(4, 2)),
    "dilated": lambda: nn.Sequential(
        nn.Conv2d(2, 4, 1), StdConv2d(4, 4, 3, padding=2, groups=2).dilated(), *_head(4)
    ),
}
UNMATCHED = {
    "other_axis": lambda: nn.Sequential(OtherAxis(2, 4, 3, padding=1), *_head(4)),
    "doubled_running": lambda: nn.Sequential(Doubled(2, 4, 3, padding=1), *_head(4)),
    "bn_bias": lambda: nn.Sequential(Biased(2, 4, 3, padding=1), *_head(4)),
}
ALL = {**BUILDERS, **UNMATCHED}


def build(name):
    torch.manual_seed(0)
    model = ALL[name]().double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_(torch.linspace(0.5, 2.0, m.weight.numel()).view_as(m.weight))
    return model


_close = functools.partial(assert_close, tol=TOL)


@pytest.fixture
def batched(monkeypatch):
    """Count the batched ``torch.autograd.grad`` calls of the generic chain (the
    closed form makes none for the weight; the gain's small vjp is one per chunk)."""
    calls: list = []
    grad = torch.autograd.grad

    def spy(outputs, inputs, *args, **kwargs):
        if kwargs.get("is_grads_batched"):
            calls.append(tuple(getattr(t, "shape", None) for t in inputs))
        return grad(outputs, inputs, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    return calls


@pytest.mark.parametrize("budget", [None, "small"])
@pytest.mark.parametrize("name", list(ALL))
def test_per_sample_grads_and_norms(name, budget):
    model = build(name)
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    kw = {}
    if budget:
        kw["memory_budget"] = memconv.plan(model, x, task="grads").smallest_budget * 2
    _close(memconv.per_sample_grads(model, loss_fn, x, y, **kw), ref)
    for route in (None, "ghost", "instantiate"):  # the per-channel numbers both ways
        norms = memconv.per_sample_norms(model, loss_fn, x, y, norm_route=route, **kw)
        assert torch.allclose(norms, _norms(ref), rtol=TOL, atol=0), route


@pytest.mark.parametrize("budget", [None, "small"])
@pytest.mark.parametrize("route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("name", list(ALL))
def test_clip_and_accumulate(name, route, budget):
    model = build(name)
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    norms = _norms(ref)
    max_norm = float(norms.median())
    c = (max_norm / norms).clamp(max=1.0)
    want = {k: (v * c.reshape(-1, *[1] * (v.dim() - 1))).sum(0) for k, v in ref.items()}
    kw = {}
    if budget:
        kw["memory_budget"] = memconv.plan(model, x, task="clip").smallest_budget * 2
    model.zero_grad(set_to_none=True)
    memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=max_norm, clip_route=route, **kw)
    got = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    _close(got, want)


def _recipes(model, x, y):
    """``{call name: slots with a recognised standardisation}`` of the walk's calls."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    axes = memconv.engine.planning.profile(model, x).axes()
    seen = {}

    def visit(call):
        if isinstance(call, memconv.engine.calls.OpCall):
            seen[call.name] = sorted(call._closed(True))

    memconv.engine.walk.backward_walk(
        model, nn.CrossEntropyLoss(), x, y, names, axes, visit, caller="t"
    )
    return seen


@pytest.mark.parametrize("name", list(ALL))
def test_closed_form_where_recognised(name):
    model = build(name)
    x, y = data()
    seen = _recipes(model, x, y)
    convs = {k: v for k, v in seen.items() if "conv2d" in k or "linear" in k}
    assert convs
    want = ["weight"] if name in BUILDERS else []
    assert all(v == want for v in convs.values()), convs


def test_norms_take_no_batched_vjp_of_the_weight(batched):
    model = build("scaled")
    x, y = data()
    memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y)
    weight = tuple(model[0].weight.shape)
    assert all(weight not in shapes for shapes in batched), batched
    batched.clear()
    memconv.clip_and_accumulate(model, nn.CrossEntropyLoss(), x, y, max_norm=1.0)
    assert all(weight not in shapes for shapes in batched), batched
    batched.clear()
    model = build("std_no_gain")
    memconv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    assert batched == []


def test_unmatched_takes_the_chain(batched):
    model = build("other_axis")
    x, y = data()
    memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y)
    assert any(tuple(model[0].weight.shape) in shapes for shapes in batched)


def test_modified_in_place_is_not_trusted():
    """A standardised weight changed in place after it was made is not the recipe's."""

    class Touched(StdConv2d):
        def forward(self, x):
            weight = F.batch_norm(
                self.weight.reshape(1, self.out_channels, -1),
                None,
                None,
                training=True,
                eps=1e-5,
            )
            weight.mul_(1.5)
            return F.conv2d(x, weight.reshape_as(self.weight), None, padding=self.padding)

    torch.manual_seed(0)
    model = nn.Sequential(Touched(2, 4, 3, padding=1), *_head(4)).double()
    x, y = data()
    seen = _recipes(model, x, y)
    assert all(v == [] for v in seen.values())
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, y)
    norms = memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y)
    assert torch.allclose(norms, _norms(ref), rtol=TOL, atol=0)


@pytest.mark.parametrize("eps", [1e-8, 1e-1, 10.0])
def test_closed_form_algebra(eps):
    """``J_fᵀ g``, its squared norm from three numbers per channel and the gain's
    gradient ``⟨g, ŵ⟩`` against autograd on ``F.batch_norm`` itself."""
    torch.manual_seed(0)
    c, k, n = 5, 7, 3
    w = torch.randn(c, k, dtype=torch.float64, requires_grad=True)
    gain = torch.randn(c, dtype=torch.float64, requires_grad=True)
    out = F.batch_norm(w.reshape(1, c, k), None, None, weight=gain, training=True, eps=eps)
    g = torch.randn(n, c, k, dtype=torch.float64)
    ref = [torch.autograd.grad(out.reshape(c, k), (w, gain), gi, retain_graph=True) for gi in g]
    recipe = standardise.Standardised(w, gain, eps, True, ())
    form = recipe.form()
    gw, hat = standardise.weight_grads(g, form)
    sq = standardise.weight_sq_norms(grad_channel_stats(g, form.w_hat), form)
    for i, (rw, rg) in enumerate(ref):
        assert torch.allclose(gw[i], rw, rtol=0, atol=TOL * rw.abs().max())
        assert torch.allclose(hat[i], rg, rtol=0, atol=TOL * rg.abs().max())
        assert torch.allclose(sq[i], rw.square().sum(), rtol=TOL, atol=0)


@pytest.mark.parametrize("method", ["positions", "offsets"])
@pytest.mark.parametrize("name", ["scaled", "grouped", "strided", "dilated"])
def test_ghost_per_channel_methods(name, method, monkeypatch):
    """The per-channel Gram contraction by both ghost methods, forced."""
    seen = []

    def choose_tiling(problem, budget):
        seen.append(method)
        return memconv.conv.ghost.method_tilings(problem, budget)[method]

    monkeypatch.setattr(memconv.conv.ghost, "choose_tiling", choose_tiling)
    model = build(name)
    x, y = data()
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, y)
    norms = memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y, norm_route="ghost")
    assert seen
    assert torch.allclose(norms, _norms(ref), rtol=TOL, atol=0)


class SkipInit(nn.Module):
    """timm's NF block's end: a standardised convolution, then ``x.mul_(skipinit_gain)``
    in place (a scalar parameter of the block itself) and a residual sum."""

    def __init__(self, gain: float):
        super().__init__()
        self.conv = ScaledStdConv2d(2, 2, 3, padding=1)
        self.skipinit_gain = nn.Parameter(torch.tensor(gain))

    def forward(self, x):
        out = self.conv(torch.relu(x))
        out.mul_(self.skipinit_gain)
        return out * 0.2 + x


@pytest.mark.parametrize("route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("gain", [0.0, 0.7])
def test_in_place_gain_runs_on_its_rule(gain, route, monkeypatch):
    """``x.mul_(gain)`` served by the broadcast rule (the value of ``x`` before the call
    from autograd's saved copy), even at timm's initial gain of zero; no generic route."""
    generic = memconv.engine.calls.call_grad_sample
    seen = []

    def spy(module, *args, **kwargs):
        seen.append(type(module).__name__)
        return generic(module, *args, **kwargs)

    monkeypatch.setattr(memconv.engine.calls, "call_grad_sample", spy)
    torch.manual_seed(0)
    model = nn.Sequential(SkipInit(gain), *_head(2)).double()
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    _close(memconv.per_sample_grads(model, loss_fn, x, y), ref)
    norms = memconv.per_sample_norms(model, loss_fn, x, y)
    assert torch.allclose(norms, _norms(ref), rtol=TOL, atol=0)
    c = (float(norms.median()) / norms).clamp(max=1.0)
    want = {k: (v * c.reshape(-1, *[1] * (v.dim() - 1))).sum(0) for k, v in ref.items()}
    model.zero_grad(set_to_none=True)
    memconv.clip_and_accumulate(
        model, loss_fn, x, y, max_norm=float(norms.median()), clip_route=route
    )
    _close({k: p.grad for k, p in model.named_parameters()}, want)
    assert seen == []
