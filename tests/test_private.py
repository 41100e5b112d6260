"""memconv's private-training path on Opacus (:func:`memconv.integrations.opacus.make_private`).

One step of the path against a step built by hand, float64 to 1e-10: per-sample
gradients by an autograd loop, clipped by C/‖gₙ‖, summed, the same Gaussian noise
from a generator seeded alike, divided by Opacus' expected batch size, SGD. On layers
written as torchvision and timm write them: ``ReLU(inplace=True)`` after a norm and
``out += identity``, a BatchNorm subclass with a fused activation (converted by
``fix``), a weight-standardised convolution, a ViT's class token, position embedding
and attention. The accountant's ε equals Opacus' own; unsupported requests raise.
(The DDP case is in :mod:`test_distributed`.)
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import loop_reference
from torch import nn

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from memconv.bench.models import ScaledStdConv2d, VisionTransformer  # noqa: E402
from memconv.integrations import opacus as mo  # noqa: E402

TOL = 1e-10
pytestmark = [
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),  # Opacus' own model
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha"),
]


class BasicBlock(nn.Module):
    """torchvision's BasicBlock (GroupNorm): in-place ReLU, ``out += identity``."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(2, c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.GroupNorm(2, c)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d: a BatchNorm2d subclass whose own forward applies the
    norm, a dropout and an activation."""

    def __init__(self, c):
        super().__init__(c)
        self.drop = nn.Identity()
        self.act = nn.ReLU(inplace=True)

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
        return self.act(self.drop(x))


def resnet():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False),
        nn.GroupNorm(2, 4),
        nn.ReLU(inplace=True),
        BasicBlock(4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def bn_act():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        BatchNormAct2d(4),
        nn.Conv2d(4, 4, 3),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )


def nf_net():
    return nn.Sequential(
        ScaledStdConv2d(1, 4, 3, padding=1),
        nn.ReLU(inplace=True),
        ScaledStdConv2d(4, 4, 3, padding=0),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )


def vit():
    return VisionTransformer(
        img_size=6, patch_size=2, in_chans=1, num_classes=3, embed_dim=8, depth=2, num_heads=2
    )


MODELS = {"resnet": resnet, "nf": nf_net, "vit": vit}
N, C, SIGMA, LR, SEED = 8, 0.05, 0.7, 0.5, 11


def data(n=2 * N):
    torch.manual_seed(1)
    return torch.randn(n, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (n,))


def reference_step(model, loss_fn, x, y, *, max_norm, sigma, lr, batch_size, seed):
    """One DP-SGD step built by hand (SGD): per-sample gradients by an autograd loop,
    clipped, summed, Opacus' Gaussian noise from ``torch.Generator().manual_seed(seed)``
    in parameter order, divided by the expected batch size. Returns the norms."""
    per = loop_reference(model, loss_fn, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    c = torch.clamp(max_norm / norms, max=1.0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            s = torch.einsum("n,n...->...", c, per[name])
            noise = torch.normal(0, sigma * max_norm, s.shape, generator=gen, dtype=s.dtype)
            p -= lr * (s + noise) / batch_size
    return norms


def private_step(model, x, y, *, clip_route=None, loss_reduction="mean"):
    x_all, y_all = data()
    loader = DataLoader(TensorDataset(x_all, y_all), batch_size=N)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine = PrivacyEngine()
    m, opt, _ = mo.make_private(
        engine,
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        poisson_sampling=False,
        clip_route=clip_route,
        noise_generator=torch.Generator().manual_seed(SEED),
        loss_reduction=loss_reduction,
    )
    opt.zero_grad()
    loss = nn.CrossEntropyLoss(reduction=loss_reduction)(m(x), y)
    loss.backward()
    opt.step()
    return m, opt, engine


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
def test_one_step_equals_the_hand_built_step(name, clip_route):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    ref = copy.deepcopy(model)
    x, y = data(N)
    m, opt, _ = private_step(model, x, y, clip_route=clip_route)
    norms = reference_step(
        ref, nn.CrossEntropyLoss(), x, y, max_norm=C, sigma=SIGMA, lr=LR, batch_size=N, seed=SEED
    )
    assert (norms > C).any() and (norms < C).any() or (norms > C).all()  # clipping acts
    assert torch.allclose(m.last_norms, norms, rtol=TOL, atol=0)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        scale = q.abs().max().item()
        assert (p - q).abs().max().item() <= TOL * scale, k
    assert type(opt).__name__ == "DPOptimizerFastGradientClipping"


def test_sum_reduction_and_a_fixed_norm_act_layer():
    torch.manual_seed(0)
    model = mo.fix(bn_act()).double()
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert isinstance(model[1], nn.Sequential) and isinstance(model[1][0], nn.GroupNorm)
    assert isinstance(model[1][-1], nn.ReLU) and model[1][-1].inplace
    ref = copy.deepcopy(model)
    x, y = data(N)
    private_step(model, x, y, loss_reduction="sum")
    reference_step(
        ref,
        nn.CrossEntropyLoss(reduction="sum"),
        x,
        y,
        max_norm=C,
        sigma=SIGMA,
        lr=LR,
        batch_size=1,
        seed=SEED,
    )
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= TOL * q.abs().max().item()


def test_norm_act_layer_is_refused_in_training_mode_and_named():
    model = bn_act().double()
    with pytest.raises(ValueError, match=r"BatchNormAct2d|BatchNorm"):
        mo.make_private(
            PrivacyEngine(),
            module=model,
            data_loader=DataLoader(TensorDataset(*data())),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_epsilon_after_k_steps_equals_opacus_own():
    k = 3
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    ours, theirs = PrivacyEngine(), PrivacyEngine()
    torch.manual_seed(0)
    model = resnet().double()
    m, opt, dl = mo.make_private(
        ours,
        module=model,
        data_loader=loader,
        noise_multiplier=1.1,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        max_grad_norm=1.0,
    )
    plain = nn.Linear(36, 3).double()
    pm, popt, pdl = theirs.make_private(
        module=plain,
        data_loader=loader,
        noise_multiplier=1.1,
        optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
        max_grad_norm=1.0,
    )
    assert type(dl).__name__ == type(pdl).__name__ == "DPDataLoader"
    for _ in range(k):
        xb, yb = next(iter(dl))
        opt.zero_grad()
        nn.CrossEntropyLoss()(m(xb), yb).backward()
        opt.step()
        xb, yb = next(iter(pdl))
        popt.zero_grad()
        nn.CrossEntropyLoss()(pm(xb.flatten(1)), yb).backward()
        popt.step()
    assert ours.accountant.history == theirs.accountant.history == [(1.1, 4 / 16, k)]
    assert ours.get_epsilon(1e-5) == theirs.get_epsilon(1e-5) > 0


def test_make_private_with_epsilon_picks_opacus_noise():
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model = resnet().double()
    _, opt, _ = mo.make_private_with_epsilon(
        PrivacyEngine(),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
    )
    plain = nn.Linear(36, 3)
    _, popt, _ = PrivacyEngine().make_private_with_epsilon(
        module=plain,
        optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
        data_loader=loader,
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
    )
    assert opt.noise_multiplier == popt.noise_multiplier > 0


def test_empty_poisson_batch_gives_a_noise_only_step():
    torch.manual_seed(0)
    model = resnet().double()
    m, opt, _ = mo.make_private(
        PrivacyEngine(),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(*data()), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(0),
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(0)
    opt.zero_grad()
    nn.CrossEntropyLoss(reduction="sum")(m(x), y).backward()
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(math.isfinite(p.sum().item()) for p in model.parameters())


def test_accumulating_two_batches_raises():
    torch.manual_seed(0)
    model = resnet().double()
    m, opt, _ = mo.make_private(
        PrivacyEngine(),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(*data()), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    x, y = data(4)
    nn.CrossEntropyLoss()(m(x), y).backward()
    with pytest.raises(RuntimeError, match="zero_grad"):
        nn.CrossEntropyLoss()(m(x), y).backward()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(clipping="group"), ValueError, "clipping='group'"),
        (dict(clipping="per_layer"), TypeError, "list of thresholds"),
        (dict(clipping="adaptive"), ValueError, "clipping='adaptive' needs"),
        (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
        (dict(loss_reduction="none"), ValueError, "loss_reduction"),
        (dict(clip_route="three-pass"), ValueError, "clip_route"),
        (dict(module="model"), TypeError, "module"),
        (dict(grad_sample_mode="fast"), ValueError, "grad_sample_mode"),
        (dict(wrap_model=False), ValueError, "wrap_model"),
    ],
)
def test_bad_arguments_raise_before_any_work(kwargs, error, match):
    model = resnet()
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(*data())),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        mo.make_private(PrivacyEngine(), **args)


def test_dropout_trains_with_the_mask_of_the_users_forward_pass():
    """A model with dropout trains (its forward pass runs once: the mask is the one
    the user's forward pass drew), equal to the clipped sum of the per-sample loss
    gradients of that forward pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    model = model.double()
    x, y = data(6)
    params = dict(model.named_parameters())
    torch.manual_seed(3)
    losses = nn.CrossEntropyLoss(reduction="none")(model(x), y)
    rows = [
        torch.autograd.grad(losses[n], list(params.values()), retain_graph=True) for n in range(6)
    ]
    ref = {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(params)}
    norms = torch.stack([v.reshape(6, -1).pow(2).sum(1) for v in ref.values()]).sum(0).sqrt()
    c = (float(norms.median()) / norms).clamp(max=1.0)
    m, _, _ = mo.make_private(
        PrivacyEngine(),
        module=model,
        data_loader=DataLoader(TensorDataset(*data())),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=float(norms.median()),
    )
    torch.manual_seed(3)
    nn.CrossEntropyLoss()(m(x), y).backward()
    for k, p in params.items():
        want = torch.einsum("n,n...->...", c, ref[k])
        assert (p.grad - want).abs().max() <= TOL * want.abs().max(), k
    assert torch.allclose(m.last_norms, norms, rtol=TOL, atol=0)


def test_eval_mode_runs_the_model_as_it_is():
    torch.manual_seed(0)
    model = resnet().double()
    m, _, _ = mo.make_private(
        PrivacyEngine(),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(*data())),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    x, _ = data(4)
    m.eval()
    assert torch.equal(m(x), model(x))
    assert getattr(m, "0") is model[0]  # attributes of the wrapped model


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost"])
def test_opacus_grad_sample_modes_are_accepted_and_ghost_returns_the_criterion(mode):
    model = resnet().double()
    criterion = nn.CrossEntropyLoss()
    out = mo.make_private(
        PrivacyEngine(),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(*data())),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        criterion=criterion,
        grad_sample_mode=mode,
    )
    if mode == "ghost":  # Opacus' four values: model, optimizer, criterion, loader
        assert len(out) == 4 and out[2] is criterion
    else:
        assert len(out) == 3
    x, y = data(4)
    out[0].train()
    criterion(out[0](x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_batch_norm_refusal_names_fix():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 3))
    with pytest.raises(ValueError, match=r"BatchNorm2d in training mode.*opacus\.fix\(module\)"):
        mo.make_private(
            PrivacyEngine(),
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(*data())),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
