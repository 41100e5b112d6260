"""Extended modules and per-sample extraction against torch.func and autograd loops."""

import warnings

import pytest
import torch
from helpers import assert_grads_close, func_reference, loop_reference, rel_err
from torch import nn

import memconv

TOL = 1e-10
STRATEGIES = memconv.available_strategies()


def small_cnn(dtype=torch.float64):
    """Convolutions, a transposed convolution, normalisation (one followed by an
    in-place activation, as MONAI's blocks are), Linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.InstanceNorm2d(6, affine=True),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, stride=2, groups=2, bias=False),
        nn.GroupNorm(2, 8),
        nn.Tanh(),
        nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
        nn.LayerNorm([4, 6, 6]),
        nn.Conv2d(4, 4, 2, padding="same", padding_mode="reflect"),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(36, 5),
    ).to(dtype)


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(1)
    x = torch.randn(5, 3, 14, 14, dtype=torch.float64)
    y = torch.randint(0, 5, (5,))
    return x, y


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_sample_block_fills_every_layer(problem, strategy):
    """Inside per_sample(), every parametrised layer of a converted model gets
    grad_batch (BackPACK's convention: mean reduction scales by 1/N), summing to .grad,
    and .grad equals torch's."""
    x, y = problem
    plain = small_cnn()
    ref = func_reference(plain, nn.CrossEntropyLoss(), x, y)
    nn.CrossEntropyLoss()(plain(x), y).backward()
    model = memconv.convert(small_cnn())
    options = {"tile_size": 2} if strategy == "streaming" else {}
    with memconv.save_memory(strategy, **options), memconv.per_sample():
        nn.CrossEntropyLoss()(model(x), y).backward()
    batch = {n: p.grad_batch * len(x) for n, p in model.named_parameters()}
    assert_grads_close(batch, ref, TOL)
    assert_grads_close(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in plain.named_parameters()},
        TOL,
    )
    for name, p in model.named_parameters():
        assert rel_err(p.grad_batch.sum(0), p.grad) < TOL, name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_summed_and_input_grad_as_torch(problem, strategy):
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
        assert rel_err(p.grad, q.grad, q.grad.abs().max().item() + 1e-12) < TOL, name
        assert not hasattr(p, "grad_batch")


def test_outside_any_block_torch_kernels_and_no_grad_batch(strategy_calls):
    model = memconv.convert(small_cnn())
    model(torch.randn(2, 3, 14, 14, dtype=torch.float64)).sum().backward()
    assert strategy_calls == []
    assert all(not hasattr(p, "grad_batch") for p in model.parameters())


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Conv3d(2, 4, 3, stride=2, padding=1, groups=2), (2, 2, 5, 5, 5)),
        (nn.ConvTranspose1d(2, 4, 3, stride=2), (2, 2, 5)),
        (nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2), (2, 4, 3, 3, 3)),
        (nn.Linear(4, 3), (2, 4)),
        (nn.GroupNorm(2, 4), (2, 4, 5)),
        (nn.PReLU(4), (2, 4, 5)),
        (nn.BatchNorm2d(4).eval(), (2, 4, 3, 3)),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_drop_in_classes(layer, shape):
    import copy

    ref = layer.double()
    ours = memconv.convert(copy.deepcopy(ref))
    assert isinstance(ours, type(ref)) and type(ours).__module__ == "memconv.modules"
    assert list(ours.state_dict()) == list(ref.state_dict())
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x))


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Conv1d(2, 4, 3, stride=2, padding=1, groups=2), (3, 2, 9)),
        (lambda: nn.Conv3d(2, 4, 3, stride=2, padding=1, groups=2), (3, 2, 7, 6, 5)),
        (lambda: nn.ConvTranspose1d(2, 4, 3, stride=2, output_padding=1), (3, 2, 6)),
        (lambda: nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2), (3, 4, 3, 2, 3)),
        (lambda: nn.Linear(4, 3), (3, 5, 4)),  # a sequence axis
        (lambda: nn.Embedding(10, 3), None),
        (lambda: nn.PReLU(2), (3, 2, 5)),
        (lambda: nn.BatchNorm1d(2).eval(), (3, 2, 5)),
        (lambda: nn.InstanceNorm3d(2, affine=True), (3, 2, 4, 3, 3)),
    ],
    ids=[
        "Conv1d",
        "Conv3d",
        "ConvTranspose1d",
        "ConvTranspose3d",
        "Linear-seq",
        "Embedding",
        "PReLU",
        "BatchNorm1d-eval",
        "InstanceNorm3d",
    ],
)
def test_single_layers_per_sample(make, shape):
    torch.manual_seed(0)
    plain = make().double()
    x = torch.randint(0, 10, (3, 4)) if shape is None else torch.randn(shape, dtype=torch.float64)
    y = torch.randn_like(plain(x))
    loss_fn = nn.MSELoss(reduction="sum")
    ref = func_reference(plain, loss_fn, x, y)
    model = memconv.convert(plain)
    convolution = isinstance(model, memconv.modules.MEMCONV_CONV_TYPES)
    for strategy in ("unfold", "shift", "rochette") if convolution else (None,):
        model.zero_grad()
        with memconv.per_sample():
            if strategy is None:
                loss_fn(model(x), y).backward()
            else:
                with memconv.save_memory(strategy):
                    loss_fn(model(x), y).backward()
        assert_grads_close({n: p.grad_batch for n, p in model.named_parameters()}, ref, TOL)


def test_one_weight_vjp_per_layer_in_per_sample_mode(strategy_calls):
    m = memconv.Conv2d(2, 3, 3)
    with memconv.save_memory("unfold"), memconv.per_sample():
        m(torch.randn(4, 2, 6, 6)).sum().backward()
    assert strategy_calls == [("unfold", True)]
    strategy_calls.clear()
    with memconv.save_memory("rochette"):
        m(torch.randn(4, 2, 6, 6)).sum().backward()
    assert strategy_calls == [("rochette", False)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_sample_grads_matches_func(problem, strategy):
    x, y = problem
    model = small_cnn()
    loss_fn = nn.CrossEntropyLoss()
    ref = func_reference(model, loss_fn, x, y)
    options = {"tile_size": 3} if strategy == "streaming" else {}
    with memconv.save_memory(strategy, **options):
        got = memconv.per_sample_grads(model, loss_fn, x, y)
    assert_grads_close(got, ref, TOL)
    assert all(p.grad is None for p in model.parameters())


def test_per_sample_grads_default_is_auto(problem, strategy_calls):
    x, y = problem
    memconv.per_sample_grads(small_cnn(), nn.CrossEntropyLoss(), x, y)
    assert {name for name, _ in strategy_calls} >= {"auto"}
    assert all(name != "standard" or per_sample for name, per_sample in strategy_calls)
    assert strategy_calls[0] == ("auto", True)


def test_per_sample_grads_batchnorm_eval_and_frozen_layers():
    torch.manual_seed(0)
    model = (
        nn.Sequential(
            nn.Conv2d(2, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 3, 3),
            nn.LayerNorm([3, 4, 4]),
            nn.Flatten(),
            nn.Dropout(0.5),
            nn.Linear(48, 2),
        )
        .double()
        .eval()
    )
    model[0].weight.requires_grad_(False)
    x = torch.randn(4, 2, 8, 8, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    ref = func_reference(model, loss_fn, x, y)
    got = memconv.per_sample_grads(model, loss_fn, x, y, strategy="rochette")
    assert "0.weight" not in got
    assert_grads_close(got, ref, TOL)


def test_per_sample_grads_rejects_batchnorm_in_training():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten())
    with pytest.raises(ValueError, match="BatchNorm2d in training mode"):
        memconv.per_sample_grads(model, nn.MSELoss(), torch.randn(2, 1, 5, 5), torch.randn(2, 18))


def test_per_sample_block_rejects_batchnorm_in_training():
    model = memconv.convert(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    with memconv.per_sample(), pytest.raises(ValueError, match="BatchNorm2d"):
        model(torch.randn(2, 1, 5, 5))


def test_module_used_twice_accumulates():
    torch.manual_seed(0)
    conv = nn.Conv1d(2, 2, 3, padding=1).double()
    model = nn.Sequential(conv, nn.Tanh(), conv)
    x = torch.randn(3, 2, 9, dtype=torch.float64)
    y = torch.randn(3, 2, 9, dtype=torch.float64)
    loss_fn = nn.MSELoss()
    got = memconv.per_sample_grads(model, loss_fn, x, y, strategy="shift")
    # torch.func.functional_call does not restore the parameters of a module that
    # appears twice (torch 2.13): the reference is an autograd loop
    assert_grads_close(got, loop_reference(model, loss_fn, x, y), TOL)
    memconv.convert(model)
    with memconv.per_sample():
        loss_fn(model(x), y).backward()
    ref = loop_reference(model, loss_fn, x, y)
    assert rel_err(conv.weight.grad_batch * 3, ref["0.weight"]) < TOL


def test_tied_weights_under_the_first_name():
    """One Parameter in two layers: the summed per-sample gradient, as .grad, under the
    name named_parameters() lists."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 3, padding=1))
    model = model.double()
    model[2].weight = model[0].weight
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    y = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    got = memconv.per_sample_grads(model, loss_fn, x, y)
    assert list(got) == ["0.weight", "0.bias", "2.bias"]
    assert_grads_close(got, loop_reference(model, loss_fn, x, y), TOL)
    memconv.convert(model)
    with memconv.per_sample():
        loss_fn(model(x), y).backward()
    assert rel_err(model[0].weight.grad_batch.sum(0), model[0].weight.grad) < TOL
    assert rel_err(model[0].weight.grad_batch, got["0.weight"]) < TOL


def test_parameter_of_a_container_used_before_its_children():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor([1.5, -0.5, 2.0]))
            self.conv = nn.Conv2d(3, 2, 3)

        def forward(self, x):
            return self.conv(x * self.scale[:, None, None])

    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), nn.Flatten()).double()
    x, y = torch.randn(3, 3, 5, 5, dtype=torch.float64), torch.randn(3, 18, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    got = memconv.per_sample_grads(model, loss_fn, x, y)
    assert_grads_close(got, func_reference(model, loss_fn, x, y), TOL)


def test_unused_parameter_gets_zeros_and_missing_gradient_raises(monkeypatch):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.used, self.unused = (
                nn.Conv2d(2, 3, 3),
                nn.Linear(27, 2),
                nn.Linear(27, 2),
            )

        def forward(self, x):
            h = self.body(x).flatten(1)
            self.unused(h)  # computed, but not part of the loss
            return self.used(h)

    torch.manual_seed(0)
    model = TwoHeads().double()
    x, y = torch.randn(3, 2, 5, 5, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    got = memconv.per_sample_grads(model, nn.MSELoss(), x, y)
    assert torch.equal(got["unused.weight"], torch.zeros(3, 2, 27, dtype=torch.float64))
    assert got["used.weight"].abs().sum() > 0
    # a gradient that should arrive but does not is an error, never zeros
    import memconv.engine.walk as walk

    monkeypatch.setattr(walk._Visits, "hook", lambda self, call, j: lambda grad: None)
    with pytest.raises(RuntimeError, match="'body'.*never arrived.*body.weight"):
        memconv.per_sample_grads(model, nn.MSELoss(), x, y)


def test_instance_norm_with_inplace_activation():
    """MONAI's BasicUNet blocks: affine InstanceNorm followed by ReLU(inplace=True)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.InstanceNorm2d(4, affine=True),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 2, 3, padding=1),
        nn.InstanceNorm2d(2, affine=True),
        nn.LeakyReLU(inplace=True),
    ).double()
    x, y = (
        torch.randn(3, 2, 6, 6, dtype=torch.float64),
        torch.randn(3, 2, 6, 6, dtype=torch.float64),
    )
    loss_fn = nn.MSELoss(reduction="sum")
    ref = func_reference(model, loss_fn, x, y)
    got = memconv.per_sample_grads(model, loss_fn, x, y)
    assert_grads_close(got, ref, TOL)
    assert got["1.weight"].abs().max() > 0.1


def test_empty_batch_on_every_path():
    model = small_cnn()
    x, y = torch.randn(0, 3, 14, 14, dtype=torch.float64), torch.randint(0, 5, (0,))
    got = memconv.per_sample_grads(model, nn.CrossEntropyLoss(reduction="sum"), x, y)
    assert {n: tuple(g.shape) for n, g in got.items()} == {
        n: (0, *p.shape) for n, p in model.named_parameters()
    }
    # through the modules (a model torch itself runs on N = 0)
    torch.manual_seed(0)
    model = memconv.convert(
        nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.ConvTranspose2d(4, 2, 2, stride=2),
            nn.Flatten(),
            nn.Linear(2 * 24 * 24, 5),
        ).double()
    )
    for strategy in STRATEGIES:
        model.zero_grad()
        with memconv.save_memory(strategy), memconv.per_sample():
            nn.CrossEntropyLoss(reduction="sum")(model(x), y).backward()
        for p in model.parameters():
            assert p.grad_batch.shape == (0, *p.shape)
            assert torch.equal(p.grad, torch.zeros_like(p))


def test_grad_batch_accumulates_like_grad():
    """A second backward pass adds to .grad and appends its samples to grad_batch (as
    Opacus' grad_sample); set_to_none, zero_() or a new .grad start afresh."""
    torch.manual_seed(0)
    m = memconv.Conv2d(2, 3, 3).double()
    x = torch.randn(4, 2, 6, 6, dtype=torch.float64)
    with memconv.save_memory("rochette"), memconv.per_sample():
        y = m(x).pow(2).sum()
    y.backward(retain_graph=True)
    first = m.weight.grad_batch.clone()
    y.backward()
    assert m.weight.grad_batch.shape == (8, 3, 2, 3, 3)
    assert rel_err(m.weight.grad_batch, torch.cat([first, first])) < TOL
    assert rel_err(m.weight.grad_batch.sum(0), m.weight.grad) < TOL
    for reset in ("none", "zero", "replace"):
        if reset == "none":
            m.zero_grad(set_to_none=True)
        elif reset == "zero":
            m.weight.grad.zero_()
        else:
            m.weight.grad = torch.zeros_like(m.weight)
        with memconv.per_sample():
            m(x).pow(2).sum().backward()
        assert rel_err(m.weight.grad_batch, first) < TOL, reset
        assert rel_err(m.weight.grad_batch.sum(0), m.weight.grad) < TOL, reset


def test_per_sample_grads_with_inputs_requiring_grad(problem):
    x, y = problem
    model = small_cnn()
    loss_fn = nn.CrossEntropyLoss()
    ref = func_reference(model, loss_fn, x, y)
    got = memconv.per_sample_grads(model, loss_fn, x.clone().requires_grad_(), y)
    assert_grads_close(got, ref, TOL)


def test_convert_names_the_layers_it_cannot_cover():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x * self.gain

    model = nn.Sequential(nn.Conv1d(2, 2, 3), Scale(), nn.LSTM(2, 2))
    with pytest.warns(UserWarning, match=r"'1' \(Scale\), '2' \(LSTM\)"):
        memconv.convert(model)
    assert isinstance(model[0], memconv.Conv1d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memconv.convert(nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU(), nn.Linear(2, 2)))
