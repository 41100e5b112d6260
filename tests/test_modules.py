"""Extended modules and per-sample extraction against torch.func and autograd loops."""

import pytest
import torch
from helpers import rel_err
from torch import nn

import memconv

TOL = 1e-10
STRATEGIES = memconv.strategies()


def small_cnn(conv2d=nn.Conv2d, dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(
        conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        conv2d(6, 8, 3, stride=2, groups=2, bias=False),
        nn.GroupNorm(2, 8),
        nn.Tanh(),
        conv2d(8, 4, 2, padding="same", padding_mode="reflect"),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4, 5),
    ).to(dtype)


def func_reference(model, loss_fn, x, y):
    """Per-sample gradients with torch.func.vmap(grad) (independent reference)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return loss_fn(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(1)
    x = torch.randn(5, 3, 14, 14, dtype=torch.float64)
    y = torch.randint(0, 5, (5,))
    return x, y


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_extended_modules_grad_batch(problem, strategy):
    x, y = problem
    model = memconv.convert(small_cnn())
    ref = func_reference(model, nn.CrossEntropyLoss(), x, y)
    plain = small_cnn()
    nn.CrossEntropyLoss()(plain(x), y).backward()
    with memconv.save_memory(strategy, tile_size=2), memconv.per_sample():
        nn.CrossEntropyLoss()(model(x), y).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert rel_err(p.grad, q.grad) < TOL, name
        if isinstance(model[int(name.split(".")[0])], nn.Conv2d):
            # mean reduction: grad_batch = per-sample gradient / N, as in BackPACK
            assert rel_err(p.grad_batch * len(x), ref[name]) < TOL, name
            assert rel_err(p.grad_batch.sum(0), p.grad) < TOL, name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_extended_modules_summed_and_input_grad(problem, strategy):
    x, _ = problem
    model, plain = memconv.convert(small_cnn()), small_cnn()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(3)
    w = torch.randn(5, 5, dtype=torch.float64)
    with memconv.save_memory(strategy):
        (model(xa) * w).sum().backward()
    (plain(xb) * w).sum().backward()
    assert rel_err(xa.grad, xb.grad) < TOL
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert rel_err(p.grad, q.grad) < TOL, name
        assert not hasattr(p, "grad_batch")


def test_extended_modules_are_drop_in():
    torch.manual_seed(0)
    ref = nn.Conv3d(2, 4, 3, stride=2, padding=1, groups=2)
    ext = memconv.Conv3d(2, 4, 3, stride=2, padding=1, groups=2)
    ext.load_state_dict(ref.state_dict())
    assert list(ext.state_dict()) == list(ref.state_dict())
    assert isinstance(ext, nn.Conv3d)
    x = torch.randn(2, 2, 7, 6, 5)
    torch.testing.assert_close(ext(x), ref(x))


@pytest.mark.parametrize("dims", [1, 3])
def test_extended_conv1d_conv3d_per_sample(dims):
    torch.manual_seed(0)
    cls = {1: memconv.Conv1d, 3: memconv.Conv3d}[dims]
    m = cls(2, 4, 3, stride=2, padding=1, dilation=1, groups=2).double()
    x = torch.randn(3, 2, *(7,) * dims, dtype=torch.float64)
    params = {k: v.detach() for k, v in m.named_parameters()}

    def f(p, xi):
        return torch.func.functional_call(m, p, (xi[None],)).pow(2).sum()

    ref = torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(params, x)
    for strategy in STRATEGIES:
        m.zero_grad()
        with memconv.save_memory(strategy), memconv.per_sample():
            m(x).pow(2).sum().backward()
        assert rel_err(m.weight.grad_batch, ref["weight"]) < TOL, strategy
        assert rel_err(m.bias.grad_batch, ref["bias"]) < TOL, strategy


def test_weight_computed_once_in_per_sample_mode(monkeypatch):
    import memconv.modules as mod

    calls = []
    real = mod.weight_grad

    def counting(*args, **kwargs):
        calls.append(kwargs["per_sample"])
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "weight_grad", counting)
    m = memconv.Conv2d(2, 3, 3)
    with memconv.save_memory("unfold"), memconv.per_sample():
        m(torch.randn(4, 2, 6, 6)).sum().backward()
    assert calls == [True]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_sample_grads_matches_func(problem, strategy):
    x, y = problem
    model = small_cnn().eval()
    loss_fn = nn.CrossEntropyLoss()
    ref = func_reference(model, loss_fn, x, y)
    with memconv.save_memory(strategy, tile_size=3):
        got = memconv.per_sample_grads(model, loss_fn, x, y)
    assert list(got) == [n for n, _ in model.named_parameters()]
    for name in ref:
        assert rel_err(got[name], ref[name]) < TOL, name
    assert all(p.grad is None for p in model.parameters())


def test_per_sample_grads_batchnorm_eval_and_frozen_layers():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 3, 3),
        nn.LayerNorm([3, 4, 4]), nn.Flatten(), nn.Dropout(0.5), nn.Linear(48, 2),
    ).double().eval()  # fmt: skip
    model[0].weight.requires_grad_(False)
    x = torch.randn(4, 2, 8, 8, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def f(p, xi, yi):
        return loss_fn(torch.func.functional_call(model, p, (xi[None],), strict=False), yi[None])

    ref = torch.func.vmap(torch.func.grad(f), in_dims=(None, 0, 0))(params, x, y)
    got = memconv.per_sample_grads(model, loss_fn, x, y, strategy="rochette")
    assert "0.weight" not in got and set(got) == set(ref)
    for name in ref:
        assert rel_err(got[name], ref[name]) < TOL, name


def test_per_sample_grads_rejects_batchnorm_in_training():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten())
    with pytest.raises(ValueError, match="BatchNorm2d in training mode"):
        memconv.per_sample_grads(model, nn.MSELoss(), torch.randn(2, 1, 5, 5), torch.randn(2, 18))


def test_weight_shared_module_accumulates():
    # reference by an autograd loop: torch.func.functional_call does not restore
    # the parameters of a module that appears twice (torch 2.13)
    torch.manual_seed(0)
    conv = nn.Conv1d(2, 2, 3, padding=1).double()
    model = nn.Sequential(conv, nn.Tanh(), conv)
    x = torch.randn(3, 2, 9, dtype=torch.float64)
    y = torch.randn(3, 2, 9, dtype=torch.float64)
    loss_fn = nn.MSELoss()
    got = memconv.per_sample_grads(model, loss_fn, x, y, strategy="shift")
    for i in range(3):
        ref = torch.autograd.grad(
            loss_fn(model(x[i : i + 1]), y[i : i + 1]), [conv.weight, conv.bias]
        )
        assert rel_err(got["0.weight"][i], ref[0]) < TOL
        assert rel_err(got["0.bias"][i], ref[1]) < TOL


def test_grad_batch_accumulates_like_grad():
    torch.manual_seed(0)
    m = memconv.Conv2d(2, 3, 3).double()
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    with memconv.save_memory("rochette"), memconv.per_sample():
        y = m(x).pow(2).sum()
        y.backward(retain_graph=True)
        first = m.weight.grad_batch.clone()
        y.backward()
        assert rel_err(m.weight.grad_batch, 2 * first) < TOL
        assert rel_err(m.weight.grad_batch.sum(0), m.weight.grad) < TOL
        m.zero_grad()
        m(x).pow(2).sum().backward()
        assert rel_err(m.weight.grad_batch, first) < TOL


def test_per_sample_grads_with_inputs_requiring_grad(problem):
    x, y = problem
    model = small_cnn().eval()
    loss_fn = nn.CrossEntropyLoss()
    ref = func_reference(model, loss_fn, x, y)
    got = memconv.per_sample_grads(model, loss_fn, x.clone().requires_grad_(), y)
    for name in ref:
        assert rel_err(got[name], ref[name]) < TOL, name
