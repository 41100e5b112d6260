"""Adaptive clipping (Andrew et al., 2021) step for step against Opacus'
``AdaClipDPOptimizer``, and its argument checks."""

import math

import pytest
import torch
from helpers import loop_reference
from torch import nn

import memconv
from memconv.tasks.adaptive import AdaptiveClipping

KW = dict(
    noise_multiplier=1.0,
    target_unclipped_quantile=0.5,
    clipbound_learning_rate=0.2,
    max_clipbound=10.0,
    min_clipbound=0.01,
    unclipped_num_std=2.0,
)


def test_step_for_step_as_opacus():
    opacus = pytest.importorskip("opacus.optimizers")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    loss_fn = nn.CrossEntropyLoss()
    opt = opacus.AdaClipDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        max_grad_norm=1.0,
        expected_batch_size=8,
        loss_reduction="sum",
        generator=torch.Generator().manual_seed(5),
        **KW,
    )
    state = AdaptiveClipping(max_norm=1.0, **KW)
    gen = torch.Generator().manual_seed(5)
    params = list(model.parameters())
    for step in range(4):
        x, y = torch.randn(8, 4) * (step + 1), torch.randint(0, 2, (8,))
        per = loop_reference(model, loss_fn, x, y)
        for n, p in model.named_parameters():
            p.grad_sample, p.grad = per[n], torch.zeros_like(p)
        opt.step()
        expected = [p.grad.clone() for p in params]
        opt.zero_grad()
        model.zero_grad(set_to_none=True)
        norms = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=state.max_norm)
        state.count(norms)
        assert state.sample_size == 8
        std = state.gradient_noise_std()
        for p in params:  # the parameters' noise first, then the count's, as Opacus
            p.grad = p.grad + torch.normal(0, std, p.shape, generator=gen)
        state.add_count_noise(generator=gen)
        state.update()
        state.reset()
        assert state.max_norm == float(opt.max_grad_norm)
        for got, ref in zip(params, expected):  # Opacus' factor C/(‖g‖ + 1e-6): ~1e-6
            assert torch.allclose(got.grad, ref, rtol=0, atol=1e-5)
    assert state.max_norm != 1.0


def test_update_is_geometric_and_clamped():
    state = AdaptiveClipping(max_norm=1.0, **KW)
    state.count(torch.tensor([0.5, 2.0, 3.0, 0.1]))  # 2 of 4 unclipped
    assert (state.sample_size, state.unclipped_num) == (4, 2)
    state.unclipped_num = 4.0
    assert state.update() == pytest.approx(math.exp(-0.2 * (1.0 - 0.5)), rel=1e-6)
    state = AdaptiveClipping(max_norm=9.9, **{**KW, "clipbound_learning_rate": 50.0})
    state.count(torch.zeros(4))
    state.unclipped_num = 0.0
    assert state.update() == 10.0  # the upper bound
    assert (
        AdaptiveClipping(max_norm=1.0, **{**KW, "noise_multiplier": 0.0}).gradient_noise_std() == 0
    )
    sigma = AdaptiveClipping(max_norm=2.0, **KW).gradient_noise_multiplier()
    assert sigma == pytest.approx((1.0 - 1 / 16) ** -0.5)
    with pytest.raises(RuntimeError, match="no sample counted"):
        AdaptiveClipping(max_norm=1.0, **KW).update()


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(max_norm=0.0), ValueError, "max_norm"),
        (dict(max_norm=math.nan), ValueError, "max_norm"),
        (dict(min_clipbound=10.0), ValueError, "max_clipbound must be larger"),
        (dict(noise_multiplier=4.0), ValueError, "2 \\* unclipped_num_std"),
        (dict(noise_multiplier=-1.0), ValueError, "noise_multiplier"),
        (dict(target_unclipped_quantile=1.5), ValueError, "target_unclipped_quantile"),
        (dict(clipbound_learning_rate=-0.1), ValueError, "clipbound_learning_rate"),
        (dict(unclipped_num_std="2"), TypeError, "unclipped_num_std"),
        (dict(max_clipbound=math.inf), ValueError, "max_clipbound"),
    ],
)
def test_bad_arguments(change, exc, match):
    with pytest.raises(exc, match=match):
        AdaptiveClipping(**{"max_norm": 1.0, **KW, **change})
    with pytest.raises(TypeError, match="norms"):
        AdaptiveClipping(max_norm=1.0, **KW).count([1.0])
