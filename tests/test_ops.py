"""Operation rules: layers written as timm and torchvision write them (reproduced, never
imported), whose parameters reach ``F.conv2d``, ``F.layer_norm``, ``F.batch_norm``,
``F.linear`` or a broadcast ``add``/``mul`` from their own ``forward`` or a parent's,
directly or through a function of the parameters alone.

Each model is checked in float64 against a per-sample autograd loop, in
``per_sample_grads``, ``per_sample_norms`` and ``clip_and_accumulate`` (both clipping
routes, groups), with and without a memory budget, and is checked to run on its
operations' lean rules: neither the generic nor the model route is called.
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
import memconv.engine.calls
import memconv.engine.passes
import memconv.engine.walk
from memconv.bench.models import ScaledStdConv2d  # timm's, as timm writes it

TOL = 1e-9


class LayerNorm2d(nn.LayerNorm):
    """timm's channels-last LayerNorm over the channels of an NCHW map."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class LayerNorm(nn.LayerNorm):
    """timm's LayerNorm subclass, calling ``F.layer_norm`` itself."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's norm + activation: ``F.batch_norm`` then the activation in its forward."""

    def forward(self, x):
        x = F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )
        return F.relu(x)


class ConvNeXtBlock(nn.Module):
    """timm's ConvNeXt block: depthwise conv, LayerNorm2d, MLP as 1×1 convs, layer scale."""

    def __init__(self, dim=4):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm = LayerNorm2d(dim, eps=1e-6)
        self.fc1 = nn.Conv2d(dim, 2 * dim, 1)
        self.fc2 = nn.Conv2d(2 * dim, dim, 1)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        shortcut = x
        x = self.fc2(F.gelu(self.fc1(self.norm(self.conv_dw(x)))))
        x = x.mul(self.gamma.reshape(1, -1, 1, 1))
        return x + shortcut


class ViT(nn.Module):
    """A tiny ViT with class token and position embedding used in its own forward."""

    def __init__(self, dim=6, patch=2, img=4, classes=3):
        super().__init__()
        self.patch_embed = nn.Conv2d(2, dim, patch, stride=patch)
        tokens = (img // patch) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.1)
        self.norm1 = LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.norm = LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed
        x = x + self.fc(F.gelu(self.norm1(x)))
        return self.head(self.norm(x)[:, 0])


class RMSNorm(nn.RMSNorm):
    """An RMSNorm subclass calling ``F.rms_norm`` itself."""

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class InstanceNorm2d(nn.InstanceNorm2d):
    """An InstanceNorm subclass calling ``F.instance_norm`` itself."""

    def forward(self, x):
        return F.instance_norm(x, None, None, self.weight, self.bias, True, 0.1, self.eps)


def _head(cin, size, classes=3):
    return [nn.Flatten(), nn.Linear(cin * size * size, classes)]


def build(name):
    torch.manual_seed(0)
    if name == "scaled_std_conv":
        model = nn.Sequential(ScaledStdConv2d(2, 4, 3, padding=1), nn.ReLU(), *_head(4, 4))
    elif name == "layernorm2d":
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), LayerNorm2d(4), *_head(4, 4))
    elif name == "layernorm_subclass":
        model = nn.Sequential(nn.Flatten(), nn.Linear(32, 6), LayerNorm(6), nn.Linear(6, 3))
    elif name == "batchnorm_act":
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), BatchNormAct2d(4), *_head(4, 4))
        bn = model[1]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        model.eval()
    elif name == "convnext":
        model = nn.Sequential(nn.Conv2d(2, 4, 1), ConvNeXtBlock(4), *_head(4, 4))
    elif name == "rms_instance":
        model = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            InstanceNorm2d(4, affine=True),
            nn.Flatten(),
            nn.Linear(64, 6),
            RMSNorm(6, eps=1e-6),
            nn.Linear(6, 3),
        )
        with torch.no_grad():
            model[1].weight.uniform_(0.5, 1.5)
            model[4].weight.uniform_(0.5, 1.5)
    elif name == "vit":
        model = ViT()
    elif name == "weight_norm":
        conv = torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(2, 4, 3, padding=1))
        lin = torch.nn.utils.parametrizations.weight_norm(nn.Linear(64, 3))
        model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), lin)
    elif name == "spectral_norm":
        conv = torch.nn.utils.parametrizations.spectral_norm(nn.Conv2d(2, 4, 3, padding=1))
        lin = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(64, 3))
        model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), lin)
        model.eval()  # the power iteration's vectors fixed: a function of the weight alone
    else:
        raise KeyError(name)
    return model.double()


MODELS = [
    "scaled_std_conv",
    "layernorm2d",
    "layernorm_subclass",
    "batchnorm_act",
    "convnext",
    "rms_instance",
    "vit",
    "weight_norm",
    "spectral_norm",
]

#: What still takes another route, by model (none: all lean).
NOT_LEAN: dict = {}


_close = functools.partial(assert_close, tol=TOL)


@pytest.fixture
def lean(monkeypatch):
    """Record which parameters the generic and model routes are asked for."""
    seen: list = []
    generic, model_route = (
        memconv.engine.calls.call_grad_sample,
        memconv.engine.passes.model_grad_sample,
    )

    def spy_generic(module, *args, **kwargs):
        seen.append(("generic", type(module).__name__))
        return generic(module, *args, **kwargs)

    def spy_model(*args, **kwargs):
        seen.append(("model", None))
        return model_route(*args, **kwargs)

    monkeypatch.setattr(memconv.engine.calls, "call_grad_sample", spy_generic)
    monkeypatch.setattr(memconv.engine.passes, "model_grad_sample", spy_model)
    return seen


def _walk_routes(model, x, y):
    """``(parameters left to the model route, calls on the generic route)``."""
    loss_fn = nn.CrossEntropyLoss()
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    axes = memconv.engine.planning.profile(model, x).axes()
    walk = memconv.engine.walk.backward_walk(
        model, loss_fn, x, y, names, axes, lambda call: None, caller="test"
    )
    generic = [c.name for c in walk.calls if c.params and c.rule is None]
    ops = {
        full
        for c in walk.calls
        if isinstance(c, memconv.engine.calls.OpCall)
        for full in c.params.values()
    }
    return set(walk.model_params), generic, ops


@pytest.mark.parametrize("name", MODELS)
def test_operations_run_on_lean_rules(name):
    model = build(name)
    x, y = data()
    model_params, generic, ops = _walk_routes(model, x, y)
    assert generic == []
    assert model_params == NOT_LEAN.get(name, set())
    assert ops  # some parameter is served by an operation rule
    assert memconv.plan(model, x).generic_layers == ()


@pytest.mark.parametrize("budget", [None, "small"])
@pytest.mark.parametrize("name", MODELS)
def test_per_sample_grads_and_norms(name, budget, lean):
    model = build(name)
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    kw = {}
    if budget:
        kw["memory_budget"] = memconv.plan(model, x, task="grads").smallest_budget * 2
    _close(memconv.per_sample_grads(model, loss_fn, x, y, **kw), ref)
    norms = memconv.per_sample_norms(model, loss_fn, x, y, **kw)
    assert torch.allclose(norms, _norms(ref), rtol=TOL, atol=0)
    assert lean == []  # neither the generic nor the model route ran


@pytest.mark.parametrize("route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("name", MODELS)
def test_clip_and_accumulate(name, route):
    model = build(name)
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    norms = _norms(ref)
    max_norm = float(norms.median())
    c = (max_norm / norms).clamp(max=1.0)
    want = {k: (v * c.reshape(-1, *[1] * (v.dim() - 1))).sum(0) for k, v in ref.items()}
    model.zero_grad(set_to_none=True)
    memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=max_norm, clip_route=route)
    got = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    _close(got, want)


@pytest.mark.parametrize("name", ["scaled_std_conv", "convnext", "weight_norm"])
def test_clip_per_layer_groups(name):
    model = build(name)
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    want = {}
    for k, v in ref.items():  # each parameter its own group
        nrm = v.flatten(1).norm(dim=1)
        c = (0.5 * nrm.median() / nrm).clamp(max=1.0)
        want[k] = (v * c.reshape(-1, *[1] * (v.dim() - 1))).sum(0)
    thresholds = {k: 0.5 * float(v.flatten(1).norm(dim=1).median()) for k, v in ref.items()}
    model.zero_grad(set_to_none=True)
    memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=thresholds, groups="parameter")
    got = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    _close(got, want)


class DataScaled(nn.Module):
    """A weight scaled by a tensor the model neither owns as parameter nor as buffer:
    memconv cannot tell it from data."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 32) * 0.1)
        self.factor = torch.tensor(0.7, dtype=torch.float64)

    def forward(self, x):
        x = x.flatten(1)
        return F.linear(x, self.weight * self.factor)


class SharedDerived(nn.Module):
    """A derived weight used by an operation and, besides, outside any operation."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 32) * 0.1)

    def forward(self, x):
        x = x.flatten(1)
        w = self.weight * 2.0
        return F.linear(x, w) + (x[:, :3] @ w[:, :3]).tanh()  # matmul: no operation rule


def _pre_hooked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(32, 4), nn.ReLU(), nn.Linear(4, 3)).double()
    model[1].register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    return model


@pytest.mark.parametrize("make", [DataScaled, SharedDerived, _pre_hooked])
def test_what_operations_cannot_prove_stays_exact(make):
    torch.manual_seed(0)
    model = make().double()
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    _close(memconv.per_sample_grads(model, loss_fn, x, y), ref)
    norms = memconv.per_sample_norms(model, loss_fn, x, y)
    assert torch.allclose(norms, _norms(ref), rtol=TOL, atol=0)
    model_params, generic, ops = _walk_routes(model, x, y)
    if make is _pre_hooked:  # the operation sees the input the pre-hook made
        assert generic == [] and not model_params and "1.weight" in ops
    else:  # the weight is not a function of parameters alone as the loss sees it
        assert "weight" not in ops
