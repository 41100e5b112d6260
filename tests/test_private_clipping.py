"""Per-layer and adaptive clipping on memconv's private path
(:func:`memconv.integrations.opacus.make_private` with ``clipping="per_layer"`` and
``"adaptive"``).

Against Opacus' own ``DPPerLayerOptimizer`` and ``AdaClipDPOptimizer`` (hooks) step for
step with the same seeded generator, on a model Opacus runs: the noise is drawn alike,
so the parameters differ only by Opacus' clip factor C/(‖g‖ + 1e-6) against memconv's
C/‖g‖ (≤ 1e-6/‖g‖ relative on a clipped sample's contribution; 1e-5 absolute here).
Against a step built by hand in float64 (autograd loop per sample, the same noise) to
1e-10 on models Opacus cannot run (``ReLU(inplace=True)``, ``out += identity``; a
ViT). Bad arguments raise before any work.
"""

import copy
import math

import pytest
import torch
from helpers import loop_reference
from torch import nn

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from test_private import data, resnet, vit  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from memconv.integrations import opacus as mo  # noqa: E402

TOL = 1e-10
#: Opacus' clip factor C/(‖g‖ + 1e-6) against memconv's C/‖g‖, on parameters
OPACUS_ATOL = 1e-5
N, SIGMA, LR, SEED = 8, 0.7, 0.5, 11
ADAPTIVE = dict(
    target_unclipped_quantile=0.5,
    clipbound_learning_rate=0.2,
    max_clipbound=10.0,
    min_clipbound=0.001,
    unclipped_num_std=2.0,
)
pytestmark = [
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha"),
]


def small():
    """A model Opacus' hooks run (no in-place operation)."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(144, 3),
    )


def loader():
    return DataLoader(TensorDataset(*data()), batch_size=N)


def sgd(model, reverse=False):
    params = list(model.parameters())
    return torch.optim.SGD(params[::-1] if reverse else params, lr=LR)


def ours(model, clipping, max_grad_norm, reverse=False, **kwargs):
    return mo.make_private(
        PrivacyEngine(),
        module=model,
        optimizer=sgd(model, reverse),
        data_loader=loader(),
        noise_multiplier=SIGMA,
        max_grad_norm=max_grad_norm,
        poisson_sampling=False,
        clipping=clipping,
        noise_generator=torch.Generator().manual_seed(SEED),
        **kwargs,
    )


def theirs(model, clipping, max_grad_norm, reverse=False, **kwargs):
    return PrivacyEngine().make_private(
        module=model,
        optimizer=sgd(model, reverse),
        data_loader=loader(),
        noise_multiplier=SIGMA,
        max_grad_norm=max_grad_norm,
        poisson_sampling=False,
        clipping=clipping,
        grad_sample_mode="hooks",
        noise_generator=torch.Generator().manual_seed(SEED),
        **kwargs,
    )


def batch(step):
    x, y = data(N)
    return x * (1 + step), y


def train_step(m, opt, x, y):
    opt.zero_grad()
    nn.CrossEntropyLoss()(m(x), y).backward()
    opt.step()


def per_layer_thresholds(model, scale=0.3):
    """Thresholds that clip some samples and leave others, parameter by parameter."""
    return [scale * (1 + i % 3) / 3 for i, _ in enumerate(model.parameters())]


@pytest.mark.parametrize("reverse", [False, True], ids=["model-order", "reversed-optimizer"])
def test_per_layer_equals_opacus_per_layer_optimizer(reverse):
    torch.manual_seed(0)
    a = small().double()
    b = copy.deepcopy(a)
    thresholds = per_layer_thresholds(a)  # paired with the optimizer's order, as Opacus
    ma, oa, _ = ours(a, "per_layer", thresholds, reverse=reverse)
    mb, ob, _ = theirs(b, "per_layer", thresholds, reverse=reverse)
    assert type(ob).__name__ == "DPPerLayerOptimizer"
    assert oa.max_grad_norm == ob.max_grad_norm  # ‖thresholds‖₂ as Opacus computes it
    assert oa.max_grad_norms == ob.max_grad_norms == thresholds
    clipped = unclipped = False
    for step in range(3):
        x, y = batch(step)
        train_step(ma, oa, x, y)
        train_step(mb, ob, x, y)
        assert list(ma.last_norms) == [n for n, _ in a.named_parameters()]
        names = [n for n, _ in a.named_parameters()]
        for c, name in zip(thresholds, names[::-1] if reverse else names):
            v = ma.last_norms[name]
            clipped |= bool((v > c).any())
            unclipped |= bool((v < c).any())
        for (k, p), q in zip(a.named_parameters(), b.parameters()):
            assert (p - q).abs().max().item() <= OPACUS_ATOL, k
            assert (p.grad - q.grad).abs().max().item() <= OPACUS_ATOL / LR, k
    assert clipped and unclipped  # clipping acted on some samples and not on others


def per_layer_reference(model, x, y, thresholds, seed, batch_size):
    per = loop_reference(model, nn.CrossEntropyLoss(), x, y)
    std = SIGMA * torch.norm(torch.Tensor(thresholds), p=2).item()
    gen = torch.Generator().manual_seed(seed)
    norms = {}
    with torch.no_grad():
        for (name, p), c in zip(model.named_parameters(), thresholds):
            g = per[name]
            norms[name] = g.flatten(1).norm(dim=1)
            s = torch.einsum("n,n...->...", torch.clamp(c / norms[name], max=1.0), g)
            noise = torch.normal(0, std, s.shape, generator=gen, dtype=s.dtype)
            p -= LR * (s + noise) / batch_size
    return norms


@pytest.mark.parametrize("name", ["resnet", "vit"])
@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
def test_per_layer_equals_the_hand_built_step_where_opacus_cannot_run(name, clip_route):
    torch.manual_seed(0)
    model = {"resnet": resnet, "vit": vit}[name]().double()
    ref = copy.deepcopy(model)
    thresholds = per_layer_thresholds(model, 0.05)
    m, opt, _ = ours(model, "per_layer", thresholds, clip_route=clip_route)
    x, y = batch(0)
    train_step(m, opt, x, y)
    norms = per_layer_reference(ref, x, y, thresholds, SEED, N)
    assert any((v > c).any() for v, c in zip(norms.values(), thresholds))
    for k, v in norms.items():
        assert torch.allclose(m.last_norms[k], v, rtol=TOL, atol=0), k
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= TOL * q.abs().max().item(), k


def test_adaptive_equals_opacus_adaclip_optimizer_step_for_step():
    torch.manual_seed(0)
    a = small().double()
    b = copy.deepcopy(a)
    ma, oa, _ = ours(a, "adaptive", 5.0, **ADAPTIVE)
    mb, ob, _ = theirs(b, "adaptive", 5.0, **ADAPTIVE)
    assert type(ob).__name__ == "AdaClipDPOptimizer"
    assert type(oa).__name__ == "AdaClipDPOptimizerFastGradientClipping"
    thresholds = []
    for step in range(4):
        x, y = batch(step % 2)
        train_step(ma, oa, x, y)
        train_step(mb, ob, x, y)
        if step == 0:
            assert (ma.last_norms > 5.0).any() and (ma.last_norms < 5.0).any()
        assert oa.sample_size == ob.sample_size == N
        assert oa.unclipped_num == pytest.approx(float(ob.unclipped_num), rel=1e-6)
        assert oa.max_grad_norm == float(ob.max_grad_norm)  # float32 update, as Opacus
        thresholds.append(oa.max_grad_norm)
        for (k, p), q in zip(a.named_parameters(), b.parameters()):
            assert (p - q).abs().max().item() <= OPACUS_ATOL, k
    assert len(set(thresholds)) == 4  # the threshold moves every step
    assert oa.noise_multiplier == ob.noise_multiplier == SIGMA  # the accountant's σ


def test_adaptive_equals_the_hand_built_steps_where_opacus_cannot_run():
    torch.manual_seed(0)
    model = resnet().double()
    ref = copy.deepcopy(model)
    c0 = 0.05
    m, opt, _ = ours(model, "adaptive", c0, **ADAPTIVE)
    gen = torch.Generator().manual_seed(SEED)
    c = c0
    sigma_b = ADAPTIVE["unclipped_num_std"]
    sigma_eff = (SIGMA**-2 - (2 * sigma_b) ** -2) ** -0.5
    for step in range(3):
        x, y = batch(step)
        train_step(m, opt, x, y)
        per = loop_reference(ref, nn.CrossEntropyLoss(), x, y)
        norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
        assert torch.allclose(m.last_norms, norms, rtol=TOL, atol=0)
        factors = torch.clamp(c / norms, max=1.0)
        with torch.no_grad():
            for name, p in ref.named_parameters():
                s = torch.einsum("n,n...->...", factors, per[name])
                noise = torch.normal(0, sigma_eff * c, s.shape, generator=gen, dtype=s.dtype)
                p -= LR * (s + noise) / N
        count = (norms <= c).sum().float() + torch.normal(0, sigma_b, (), generator=gen)
        frac = count / N
        rate = ADAPTIVE["clipbound_learning_rate"]
        c = float(c * torch.exp(-rate * (frac - ADAPTIVE["target_unclipped_quantile"])))
        c = min(max(c, ADAPTIVE["min_clipbound"]), ADAPTIVE["max_clipbound"])
        assert opt.max_grad_norm == c
        for (k, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p - q).abs().max().item() <= TOL * q.abs().max().item(), (step, k)
    assert c != c0


def test_adaptive_on_an_empty_poisson_batch_keeps_the_threshold():
    torch.manual_seed(0)
    model = resnet().double()
    m, opt, _ = ours(model, "adaptive", 0.5, **ADAPTIVE)
    x, y = data(0)
    opt.zero_grad()
    nn.CrossEntropyLoss(reduction="sum")(m(x), y).backward()
    opt.step()
    assert opt.max_grad_norm == 0.5
    assert all(math.isfinite(p.sum().item()) for p in model.parameters())


def test_per_layer_accounting_is_opacus_own():
    torch.manual_seed(0)
    a = small().double()
    b = copy.deepcopy(a)
    engine_a, engine_b = PrivacyEngine(), PrivacyEngine()
    thresholds = per_layer_thresholds(a)
    common = dict(
        noise_multiplier=1.1,
        max_grad_norm=thresholds,
        clipping="per_layer",
        data_loader=DataLoader(TensorDataset(*data()), batch_size=4),
    )
    ma, oa, la = mo.make_private(
        engine_a, module=a, optimizer=torch.optim.SGD(a.parameters(), lr=0.1), **common
    )
    mb, ob, lb = engine_b.make_private(
        module=b, optimizer=torch.optim.SGD(b.parameters(), lr=0.1), **common
    )
    for m, o, dl in ((ma, oa, la), (mb, ob, lb)):
        for _ in range(2):
            train_step(m, o, *next(iter(dl)))
    assert engine_a.accountant.history == engine_b.accountant.history == [(1.1, 0.25, 2)]


def test_make_private_with_epsilon_takes_per_layer_thresholds():
    model = resnet().double()
    thresholds = per_layer_thresholds(model)
    common = dict(
        data_loader=DataLoader(TensorDataset(*data()), batch_size=4),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=thresholds,
        clipping="per_layer",
    )
    _, opt, _ = mo.make_private_with_epsilon(
        PrivacyEngine(),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        **common,
    )
    plain = small().double()
    plain_thresholds = thresholds[: len(list(plain.parameters()))]
    _, popt, _ = PrivacyEngine().make_private_with_epsilon(
        module=plain,
        optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
        **{**common, "max_grad_norm": plain_thresholds},
    )
    assert opt.noise_multiplier == popt.noise_multiplier > 0
    assert opt.max_grad_norms == thresholds


BAD = [
    (dict(clipping="per_layer", max_grad_norm=1.0), TypeError, "list of thresholds"),
    (dict(clipping="per_layer", max_grad_norm=[1.0] * 3), ValueError, "3 thresholds"),
    (
        dict(clipping="per_layer", max_grad_norm=[1.0, 1.0, 0.0] + [1.0] * 8),
        ValueError,
        r"max_grad_norm\[2\]",
    ),
    (
        dict(clipping="per_layer", max_grad_norm=[1.0, math.nan] + [1.0] * 9),
        ValueError,
        r"max_grad_norm\[1\]",
    ),
    (dict(clipping="per_layer", max_grad_norm=["1"] * 11), TypeError, r"max_grad_norm\[0\]"),
    (dict(clipping="adaptive", target_unclipped_quantile=0.5), ValueError, "unclipped_num_std"),
    (
        dict(clipping="adaptive", **{**ADAPTIVE, "unclipped_num_std": 0.2}),
        ValueError,
        r"2 \* unclipped_num_std",
    ),
    (dict(clipping="adaptive", **{**ADAPTIVE, "min_clipbound": 20.0}), ValueError, "max_clipbound"),
    (dict(clipping="adaptive", max_grad_norm=[1.0], **ADAPTIVE), ValueError, "max_grad_norm"),
    (dict(clipping="flat", target_unclipped_quantile=0.5), ValueError, "target_unclipped_quantile"),
    (dict(clipping="group"), ValueError, "clipping='group'"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD)
def test_bad_arguments_raise_before_any_work(kwargs, error, match):
    model = resnet()
    assert len(list(model.parameters())) == 11
    engine = PrivacyEngine()
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(*data())),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        mo.make_private(engine, **args)
    assert engine.dataset is None  # no data loader prepared


def test_per_layer_needs_every_trainable_parameter_in_the_optimizer():
    model = resnet()
    head = list(model.parameters())[-2:]
    with pytest.raises(ValueError, match=r"'0.weight'.*not in optimizer"):
        mo.make_private(
            PrivacyEngine(),
            module=model,
            optimizer=torch.optim.SGD(head, lr=0.1),
            data_loader=DataLoader(TensorDataset(*data())),
            noise_multiplier=1.0,
            max_grad_norm=[1.0, 1.0],
            clipping="per_layer",
        )
