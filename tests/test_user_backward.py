"""The user's own forward and backward pass as the DP step, in each form.

``memconv.clipping`` (a block around ``criterion(model(x), y).backward()``),
``memconv.recording`` and the private module of ``mo.make_private``, in float64
against a per-sample autograd loop on the **same forward pass** (the same dropout
masks): the loop differentiates each sample's loss of the batch's own graph. Models as
their libraries write them: dropout, torchvision's BasicBlock (in-place ReLU,
``out += identity``), timm's ScaledStdConv2d, a ViT with a class token, LoRA adapters;
memconv's reversible blocks (their inputs released); book-keeping and two-pass;
per-layer and adaptive clipping.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memconv
from memconv.bench import models

TOL = 1e-10
LOSS = nn.CrossEntropyLoss()


class Dropped(nn.Module):
    """A small CNN with dropout after a convolution and before the head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Dropout2d(0.2),
            nn.Conv2d(6, 8, 3, stride=2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(8 * 3 * 3, 4))

    def forward(self, x):
        return self.head(self.features(x))


def basic_block():
    down = nn.Sequential(nn.Conv2d(3, 8, 1, stride=2, bias=False), nn.GroupNorm(4, 8))
    block = models.TVBasicBlock(
        3, 8, stride=2, downsample=down, norm_layer=lambda c: nn.GroupNorm(4, c)
    )
    return nn.Sequential(
        block, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(8, 4)
    )


def scaled_std():
    conv = models.ScaledStdConv2d(3, 6, 3, gamma=models.NF_RELU_GAMMA)
    return nn.Sequential(conv, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4))


def vit():
    return models.VisionTransformer(8, 4, 3, 4, embed_dim=12, depth=2, num_heads=2, drop_rate=0.2)


def lora():
    model = models.VisionTransformer(8, 4, 3, 4, embed_dim=12, depth=1, num_heads=2)
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoraLinear(block.attn.qkv)
    model.head.requires_grad_(True)
    return model


class LoraLinear(nn.Module):
    """A frozen Linear with a rank-2 adapter, laid out as peft's ``lora.Linear``."""

    def __init__(self, base: nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(0.1)})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        self.scaling = 2.0

    def forward(self, x):
        a, b = self.lora_A["default"], self.lora_B["default"]
        return self.base_layer(x) + b(a(self.lora_dropout["default"](x))) * self.scaling


def reversible():
    """Two additive couplings (RevNet's) that release their inputs, between a stem and a
    head with dropout; the loop's one backward pass per sample needs num_bwd_passes."""
    from memconv.reversible import AdditiveCoupling, InvertibleModuleWrapper

    def block():
        fm = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())
        return InvertibleModuleWrapper(AdditiveCoupling(fm), num_bwd_passes=8)

    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        block(),
        block(),
        nn.Flatten(),
        nn.Dropout(0.3),
        nn.Linear(4 * 8 * 8, 4),
    )


MODELS = {
    "dropout": Dropped,
    "reversible": reversible,
    "basic-block": basic_block,
    "scaled-std": scaled_std,
    "vit": vit,
    "lora": lora,
}


def build(name):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    return model.train()


def data(n=5):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(
        0, 4, (n,), generator=g
    )


def loop(model, x, y, seed):
    """Each sample's loss gradient, differentiated on the batch's own forward pass."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(seed)
    losses = nn.CrossEntropyLoss(reduction="none")(model(x), y)
    rows = [
        torch.autograd.grad(losses[n], list(params.values()), retain_graph=True)
        for n in range(len(x))
    ]
    return {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(params)}


def norms_of(grads: dict, names=None) -> torch.Tensor:
    names = grads if names is None else names
    return torch.stack([grads[k].flatten(1).pow(2).sum(1) for k in names]).sum(0).sqrt()


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= TOL * max(want.abs().max().item(), 1e-300))


def clipped(ref: dict, c: torch.Tensor) -> dict:
    return {k: torch.einsum("n,n...->...", c, v) for k, v in ref.items()}


@pytest.mark.parametrize("route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_clipping_block_equals_the_loop(name, route):
    model = build(name)
    x, y = data()
    ref = loop(model, x, y, seed=3)
    norms = norms_of(ref)
    c = (float(norms.median()) / norms).clamp(max=1.0)
    want = clipped(ref, c)
    with memconv.clipping(model, max_norm=float(norms.median()), clip_route=route) as clip:
        torch.manual_seed(3)
        LOSS(model(x), y).backward()
    assert close(clip.norms, norms)
    for k, p in model.named_parameters():
        if p.requires_grad:
            assert close(p.grad, want[k]), k


@pytest.mark.parametrize("name", sorted(MODELS))
def test_recording_block_equals_the_loop(name):
    model = build(name)
    x, y = data()
    ref = loop(model, x, y, seed=4)
    with memconv.recording(model) as rec:
        torch.manual_seed(4)
        LOSS(model(x), y).backward()
    for k, v in ref.items():
        assert close(rec.grads[k], v), k
        assert close(dict(model.named_parameters())[k].grad, v.mean(0)), k
    assert close(rec.norms, norms_of(ref))


def test_per_layer_groups_in_the_block():
    model = build("basic-block")
    x, y = data()
    ref = loop(model, x, y, seed=5)
    with memconv.clipping(model, max_norm=0.05, groups="layer", loss_reduction="mean") as clip:
        torch.manual_seed(5)
        LOSS(model(x), y).backward()
    layers = {k.rpartition(".")[0] for k in ref}
    for layer in layers:
        names = [k for k in ref if k.rpartition(".")[0] == layer]
        norms = norms_of(ref, names)
        assert close(clip.norms[layer], norms)
        c = (0.05 / norms).clamp(max=1.0)
        for k in names:
            assert close(dict(model.named_parameters())[k].grad, clipped({k: ref[k]}, c)[k]), k


def test_sum_reduction_and_several_steps_in_one_block():
    model = build("dropout")
    x, y = data()
    refs = {seed: loop(model, x, y, seed=seed) for seed in (6, 7)}  # outside the block
    with memconv.clipping(model, max_norm=0.1, loss_reduction="sum") as clip:
        for seed, ref in refs.items():
            model.zero_grad()
            torch.manual_seed(seed)
            nn.CrossEntropyLoss(reduction="sum")(model(x), y).backward()
            norms = norms_of(ref)
            assert close(clip.norms, norms)
            want = clipped(ref, (0.1 / norms).clamp(max=1.0))
            for k, p in model.named_parameters():
                assert close(p.grad, want[k]), k


def test_adaptive_clipping_through_make_private():
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from memconv.integrations import opacus as mo

    model = build("dropout")
    x, y = data(8)
    ref = loop(model, x, y, seed=8)
    norms = norms_of(ref)
    m, optimizer, _ = mo.make_private(
        PrivacyEngine(),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=float(norms.median()),
        clipping="adaptive",
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=1e-3,
        unclipped_num_std=1.0,
        poisson_sampling=False,
    )
    torch.manual_seed(8)
    LOSS(m(x), y).backward()
    assert close(m.last_norms, norms)
    want = clipped(ref, (float(norms.median()) / norms).clamp(max=1.0))
    for k, p in model.named_parameters():
        assert close(p.grad, want[k]), k


def test_what_mixes_samples_is_refused_before_grad_is_touched():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 4))
    x, y = data()
    with memconv.clipping(model.double(), max_norm=1.0):
        with pytest.raises(ValueError, match=r"'1'.*BatchNorm2d.*mixes the samples"):
            model(x)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda m, x: m(x, x), TypeError, "one input tensor"),
        (lambda m, x: m(x.requires_grad_()), TypeError, "requires grad"),
    ],
)
def test_calls_the_pass_cannot_take_are_refused(call, error, match):
    model = build("dropout")
    x, _ = data()
    with memconv.clipping(model, max_norm=1.0):
        with pytest.raises(error, match=match):
            call(model, x)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(max_norm=-1.0), ValueError, "max_norm"),
        (dict(max_norm=1.0, loss_reduction="none"), ValueError, "loss_reduction"),
        (dict(max_norm=1.0, clip_route="three"), ValueError, "clip_route"),
        (dict(max_norm=1.0, memory_budget="available"), ValueError, "memory_budget"),
        (dict(max_norm=1.0, groups="block"), ValueError, "groups"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        memconv.clipping(build("dropout"), **kwargs)


def test_a_forward_without_backward_warns_and_frees_at_the_end():
    model = build("dropout")
    x, _ = data()
    with pytest.warns(UserWarning, match="had no backward pass inside the block"):
        with memconv.clipping(model, max_norm=1.0):
            model(x)


def test_eval_mode_and_no_grad_run_the_model_as_it_is():
    model = build("dropout")
    x, y = data()
    with memconv.clipping(model, max_norm=1.0):
        with torch.no_grad():
            model(x)
        model.eval()
        out = model(x)
        assert out.grad_fn is not None and "Handoff" not in type(out.grad_fn).__name__
    model.train()


def test_the_hooks_are_removed_when_the_block_closes():
    model = build("dropout")
    before = (len(model._forward_hooks), len(model._forward_pre_hooks))
    with memconv.clipping(model, max_norm=1.0):
        pass
    assert (len(model._forward_hooks), len(model._forward_pre_hooks)) == before


def test_a_warning_shown_once_stays_shown_once():
    """Python shows a warning once per place; memconv's generic route (torch.func) must
    not reset that record on every step (entering ``warnings.catch_warnings`` does)."""

    class Odd(nn.Module):  # no rule: the generic route
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return x @ torch.diag(self.w)

    def user():
        warnings.warn("a warning of the user's", UserWarning, stacklevel=1)

    model = nn.Sequential(Odd(), nn.Linear(3, 2))
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    memconv.per_sample_grads(model, LOSS, x, y)  # torch's own lazy imports, once
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        for _ in range(3):
            user()
            memconv.per_sample_grads(model, LOSS, x, y)
    assert sum("a warning of the user's" in str(w.message) for w in shown) == 1
