"""``sample_mask``: a Poisson batch padded to a fixed size, its padding adding nothing
(masked DP-SGD, Beltran et al. 2024).

Float64, to 1e-10 relative: the padded batch with its mask gives the clipped sum of the
real samples alone, computed by memconv without a mask and by an autograd loop (one
``torch.autograd.grad`` per sample, clipped, summed); for both clipping routes, one
group and a group per layer, a conv + GroupNorm + Linear model and a residual block
with in-place ReLU and ``out += identity``. Padded samples hold NaN, inf and
out-of-range targets, at positions between the real ones. An all-False mask gives
zero sums; bad masks raise before ``.grad`` changes; the Opacus path
(``make_private``, ``PrivateModule(x, sample_mask=...)``, ``FixedSizePoissonLoader``)
gives the unpadded batch's step.
"""

import copy

import pytest
import torch
from helpers import loop_reference
from torch import nn

import memconv
from memconv.bench.models import TVBasicBlock
from memconv.bench.ops import count

TOL = 1e-10
C = 0.3
#: Real samples (True) and padding (False), the padding between the real samples.
MASK = torch.tensor([True, False, True, True, False, True, False, True])


def gn_net():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )


def resnet():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False),
        nn.GroupNorm(2, 4),
        nn.ReLU(inplace=True),
        TVBasicBlock(4, 4, norm_layer=lambda c: nn.GroupNorm(2, c)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


MODELS = {"gn": gn_net, "resnet": resnet}


def model_of(name):
    torch.manual_seed(0)
    return MODELS[name]().double()


def padded_batch(mask=MASK):
    """``(x, y)``: real samples where ``mask``; padding holding NaN, inf and a target out
    of range elsewhere."""
    torch.manual_seed(1)
    n = len(mask)
    x = torch.randn(n, 1, 6, 6, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (n,))
    padded = (~mask).nonzero().flatten().tolist()
    for k, i in enumerate(padded):
        x[i] = (float("nan"), float("inf"), -float("inf"))[k % 3]
        y[i] = 99  # no class: a padded target never reaches the loss
    return x, y


def group_of(name, groups):
    return "all" if groups == "all" else name.rpartition(".")[0]


def loop_clipped_sum(model, x, y, groups):
    """Σₙ min(1, C/‖gₙ,g‖)·gₙ,g per parameter, by an autograd loop; and the norms
    ``{group: [n]}``."""
    per = loop_reference(model, nn.CrossEntropyLoss(), x, y)
    sq: dict = {}
    for name, g in per.items():
        k = group_of(name, groups)
        sq[k] = sq.get(k, 0) + g.flatten(1).pow(2).sum(1)
    norms = {k: v.sqrt() for k, v in sq.items()}
    factors = {k: (C / v).clamp(max=1.0) for k, v in norms.items()}
    sums = {
        name: torch.einsum("n,n...->...", factors[group_of(name, groups)], g)
        for name, g in per.items()
    }
    return sums, norms


def clipped(model, x, y, **kwargs):
    """(.grad per parameter, norms) of one clip_and_accumulate from zero gradients."""
    model.zero_grad(set_to_none=True)
    norms = memconv.clip_and_accumulate(model, nn.CrossEntropyLoss(), x, y, max_norm=C, **kwargs)
    return {k: p.grad.clone() for k, p in model.named_parameters()}, norms


def assert_close(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        scale = want[k].abs().max().item()
        assert (got[k] - want[k]).abs().max().item() <= TOL * max(scale, 1e-300), k


def by_group(norms, groups):
    return {"all": norms} if groups == "all" else norms


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("groups", ["all", "layer"])
def test_padded_batch_gives_the_real_samples_clipped_sum(name, clip_route, groups):
    model = model_of(name)
    x, y = padded_batch()
    real_x, real_y = x[MASK], y[MASK]
    options = dict(clip_route=clip_route, groups=groups)
    got, norms = clipped(model, x, y, sample_mask=MASK, **options)
    unpadded, unpadded_norms = clipped(model, real_x, real_y, **options)
    loop, loop_norms = loop_clipped_sum(model, real_x, real_y, groups)
    assert_close(got, unpadded)
    assert_close(got, loop)
    norms, unpadded_norms = by_group(norms, groups), by_group(unpadded_norms, groups)
    assert norms.keys() == loop_norms.keys()
    for g, v in norms.items():
        assert v.shape == (len(MASK),) and torch.equal(v[~MASK], torch.zeros(3, dtype=v.dtype))
        assert torch.allclose(v[MASK], loop_norms[g], rtol=TOL, atol=0)
        assert torch.allclose(v[MASK], unpadded_norms[g], rtol=TOL, atol=0)
    all_norms = loop_norms.get("all", next(iter(loop_norms.values())))
    assert (all_norms > C).any()  # clipping acts


@pytest.mark.parametrize("groups", ["all", "layer"])
def test_micro_batches_split_the_mask_with_the_batch(groups):
    model = model_of("resnet")
    x, y = padded_batch()
    plan = memconv.plan(model, x, task="clip", memory_budget=None)
    budget = (plan.smallest_budget + plan.predicted_peak) // 2
    assert memconv.plan(model, x, task="clip", memory_budget=budget).micro_batches > 1
    got, _ = clipped(model, x, y, sample_mask=MASK, groups=groups, memory_budget=budget)
    loop, _ = loop_clipped_sum(model, x[MASK], y[MASK], groups)
    assert_close(got, loop)


@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
def test_the_mask_adds_no_host_synchronisation(clip_route):
    model = model_of("gn")
    x, y = padded_batch()
    step = memconv.PrivateStep(model, nn.CrossEntropyLoss(), clip_route=clip_route)
    step.clip_and_accumulate(x, y, max_norm=C, sample_mask=MASK)  # plan made

    def call():
        model.zero_grad(set_to_none=True)
        step.clip_and_accumulate(x, y, max_norm=C, sample_mask=MASK)

    assert count(call)["host_syncs"] == 1


def test_per_sample_norms_with_a_mask():
    model = model_of("resnet")
    x, y = padded_batch()
    loss = nn.CrossEntropyLoss()
    real = memconv.per_sample_norms(model, loss, x[MASK], y[MASK])
    got = memconv.per_sample_norms(model, loss, x, y, sample_mask=MASK)
    assert torch.allclose(got[MASK], real, rtol=TOL, atol=0) and (got[~MASK] == 0).all()
    for kwargs in ({"groups": "layer"}, {"per_parameter": True}):
        real = memconv.per_sample_norms(model, loss, x[MASK], y[MASK], **kwargs)
        got = memconv.per_sample_norms(model, loss, x, y, sample_mask=MASK, **kwargs)
        assert got.keys() == real.keys()
        for k in real:
            assert torch.allclose(got[k][MASK], real[k], rtol=TOL, atol=0), k
            assert (got[k][~MASK] == 0).all(), k


def test_private_step_takes_the_mask():
    model = model_of("gn")
    x, y = padded_batch()
    step = memconv.PrivateStep(model, nn.CrossEntropyLoss())
    norms = step.per_sample_norms(x, y, sample_mask=MASK)
    assert (norms[~MASK] == 0).all() and norms[MASK].isfinite().all()
    for groups in ("all", "layer"):
        model.zero_grad(set_to_none=True)
        step.clip_and_accumulate(x, y, max_norm=C, groups=groups, sample_mask=MASK)
        got = {k: p.grad.clone() for k, p in model.named_parameters()}
        loop, _ = loop_clipped_sum(model, x[MASK], y[MASK], groups)
        assert_close(got, loop)


@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("groups", ["all", "layer"])
def test_an_all_false_mask_adds_zero(clip_route, groups):
    model = model_of("resnet")
    mask = torch.zeros(len(MASK), dtype=torch.bool)
    x, y = padded_batch(mask)
    got, norms = clipped(model, x, y, sample_mask=mask, clip_route=clip_route, groups=groups)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in got.values())
    assert all((v == 0).all() for v in by_group(norms, groups).values())


def test_an_all_true_mask_is_no_mask():
    model = model_of("gn")
    torch.manual_seed(2)
    x, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    got, norms = clipped(model, x, y, sample_mask=torch.ones(4, dtype=torch.bool))
    want, want_norms = clipped(model, x, y)
    assert_close(got, want)
    assert torch.allclose(norms, want_norms, rtol=TOL, atol=0)


def test_a_real_samples_nan_still_raises():
    model = model_of("gn")
    x, y = padded_batch()
    x[2] = float("nan")  # a real sample
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"sample\(s\) 2 is not finite"):
        memconv.clip_and_accumulate(
            model, nn.CrossEntropyLoss(), x, y, max_norm=C, sample_mask=MASK
        )
    assert all(p.grad is None for p in model.parameters())


class NormalisedInput(nn.Module):
    """Not finite at a zero input (its input divided by its norm)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x / x.norm(dim=1, keepdim=True))


def test_a_model_not_finite_at_a_padded_zero_input_raises():
    torch.manual_seed(0)
    model = NormalisedInput().double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    mask = torch.tensor([True, False, True, True])
    for route in ("book-keeping", "two-pass"):
        model.zero_grad(set_to_none=True)
        with pytest.raises(RuntimeError, match="padded sample"):
            memconv.clip_and_accumulate(
                model, nn.CrossEntropyLoss(), x, y, max_norm=C, sample_mask=mask, clip_route=route
            )
        assert all(p.grad is None for p in model.parameters())


BAD_MASKS = [
    (lambda n: MASK.tolist(), TypeError, "bool tensor"),
    (lambda n: MASK.double(), TypeError, "dtype torch.float64"),
    (lambda n: MASK.long(), TypeError, "dtype torch.int64"),
    (lambda n: torch.ones(n + 1, dtype=torch.bool), ValueError, r"shape \[9\]"),
    (lambda n: torch.ones(n, 1, dtype=torch.bool), ValueError, r"shape \[8, 1\]"),
    (lambda n: torch.ones(n, dtype=torch.bool, device="meta"), ValueError, "device"),
]


@pytest.mark.parametrize("bad", range(len(BAD_MASKS)))
def test_bad_masks_raise_before_any_work(bad):
    make, error, message = BAD_MASKS[bad]
    model = model_of("gn")
    x, y = padded_batch()
    mask = make(len(x))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    loss = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss)
    calls = [
        lambda: memconv.clip_and_accumulate(model, loss, x, y, max_norm=C, sample_mask=mask),
        lambda: memconv.per_sample_norms(model, loss, x, y, sample_mask=mask),
        lambda: step.clip_and_accumulate(x, y, max_norm=C, sample_mask=mask),
        lambda: step.per_sample_norms(x, y, sample_mask=mask),
    ]
    for call in calls:
        with pytest.raises(error, match=f"sample_mask.*{message}"):
            call()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    assert step.plan is None  # nothing planned, nothing run


# ---------------------------------------------------------------- the Opacus path
def _opacus():
    return pytest.importorskip("opacus")


SIGMA, LR, SEED = 0.7, 0.5, 11
pytestmark = [
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha"),
]


def private_step(model, x, y, mask=None, *, clipping="flat", clip_route=None):
    """One step of ``mo.make_private`` (SGD, a seeded noise generator) on ``(x, y)``,
    with ``sample_mask=mask`` where given. Returns the private module."""
    _opacus()
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from memconv.integrations import opacus as mo

    data = TensorDataset(torch.randn(16, 1, 6, 6, dtype=torch.float64), torch.zeros(16).long())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    extra = {}
    if clipping == "adaptive":
        extra = dict(
            target_unclipped_quantile=0.5,
            clipbound_learning_rate=0.2,
            max_clipbound=10.0,
            min_clipbound=0.01,
            unclipped_num_std=2.0,
        )
    m, opt, _ = mo.make_private(
        PrivacyEngine(),
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(SEED),
        clipping=clipping,
        clip_route=clip_route,
        **extra,
    )
    opt.zero_grad()
    out = m(x) if mask is None else m(x, sample_mask=mask)
    nn.CrossEntropyLoss()(out, y).backward()
    opt.step()
    return m, opt


@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("clipping", ["flat", "adaptive"])
def test_make_private_with_a_mask_steps_as_the_unpadded_batch(clip_route, clipping):
    model = model_of("resnet")
    ref = copy.deepcopy(model)
    x, y = padded_batch()
    y = torch.where(MASK, y, torch.zeros_like(y))  # the user's criterion sees every row
    m, opt = private_step(model, x, y, MASK, clipping=clipping, clip_route=clip_route)
    pm, popt = private_step(ref, x[MASK], y[MASK], clipping=clipping, clip_route=clip_route)
    assert torch.equal(m.last_norms[~MASK], torch.zeros(3, dtype=torch.float64))
    assert torch.allclose(m.last_norms[MASK], pm.last_norms, rtol=TOL, atol=0)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= TOL * q.abs().max().item(), k
    if clipping == "adaptive":
        assert opt.clipping.max_norm == pytest.approx(popt.clipping.max_norm, rel=1e-12)


def test_private_module_refuses_a_bad_mask_before_any_work():
    model = model_of("gn")
    x, y = padded_batch()
    with pytest.raises(TypeError, match="sample_mask"):
        private_step(model, x, y, MASK.float())
    with pytest.raises(ValueError, match="sample_mask"):
        private_step(model, x, y, MASK[:4])


def test_fixed_size_poisson_loader_pads_opacus_batches():
    _opacus()
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import DataLoader, TensorDataset

    from memconv.integrations import opacus as mo

    n = 40
    data = TensorDataset(torch.randn(n, 3), torch.arange(n))
    poisson = DPDataLoader.from_data_loader(DataLoader(data, batch_size=8))
    fixed = mo.FixedSizePoissonLoader(poisson, batch_size=12)
    assert len(fixed) == len(poisson) and fixed.sample_rate == poisson.sample_rate
    assert fixed.dataset is data
    for epoch in range(3):
        torch.manual_seed(epoch)
        plain = list(poisson)
        torch.manual_seed(epoch)
        padded = list(fixed)
        assert len(plain) == len(padded)
        for (x, y), (px, py, mask) in zip(plain, padded):
            size = 12 * max(1, -(-len(x) // 12))
            assert px.shape == (size, 3) and py.shape == (size,) and mask.shape == (size,)
            assert mask.dtype == torch.bool and int(mask.sum()) == len(x)
            assert torch.equal(px[mask], x) and torch.equal(py[mask], y)
            assert (px[~mask] == 0).all() and (py[~mask] == 0).all()
    tiny = mo.FixedSizePoissonLoader(poisson, batch_size=1)
    torch.manual_seed(0)
    assert all(len(b[0]) >= 1 for b in tiny) and tiny.oversized > 0
    with pytest.raises(TypeError, match="DPDataLoader"):
        mo.FixedSizePoissonLoader(DataLoader(data, batch_size=8), batch_size=12)
    with pytest.raises(ValueError, match="batch_size"):
        mo.FixedSizePoissonLoader(poisson, batch_size=0)
    with pytest.raises(TypeError, match="batch_size"):
        mo.FixedSizePoissonLoader(poisson, batch_size=2.5)
