"""Bad input: a clear error naming the argument and the accepted values, raised
before any work, leaving every setting and every gradient as it was."""

import pytest
import torch
from torch import nn

import memconv


def test_unknown_strategy_lists_accepted():
    with pytest.raises(ValueError, match="unknown strategy 'fast'.*standard.*rochette"):
        memconv.save_memory("fast")
    assert memconv.current_strategy() == "auto"


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(tile_size=0), ValueError, "tile_size"),
        (dict(tile_size=-3), ValueError, "tile_size"),
        (dict(tile_size=2.5), TypeError, "tile_size"),
        (dict(tile_size=True), TypeError, "tile_size"),
        (dict(tile_size=(2, 0)), ValueError, "tile_size"),
        (dict(tile_size=()), ValueError, "tile_size"),
        (dict(memory_budget=0), ValueError, "memory_budget"),
        (dict(memory_budget=1e6), TypeError, "memory_budget"),
        (dict(inner="streaming"), ValueError, "inner"),
        (dict(inner="nope"), ValueError, "inner"),
    ],
)
@pytest.mark.filterwarnings("ignore:memconv.save_memory. no memconv layer ran")
def test_bad_options(kwargs, exc, match):
    with memconv.save_memory("unfold"):
        with pytest.raises(exc, match=match):
            memconv.save_memory("streaming", **kwargs)
        assert memconv.current_strategy() == "unfold"


@pytest.mark.parametrize(
    "strategy, kwargs, match",
    [
        (
            "rochette",
            dict(tile_size=8),
            r"'rochette' does not use tile_size \(used by: streaming\)",
        ),
        ("standard", dict(memory_budget=2**20), "does not use memory_budget"),
        ("shift", dict(inner="unfold"), r"does not use inner \(used by: streaming\)"),
        ("auto", dict(tile_size=4), "'auto' does not use tile_size"),
    ],
)
def test_options_a_strategy_ignores_are_rejected(strategy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        memconv.save_memory(strategy, **kwargs)
    with pytest.raises(ValueError, match=match):
        memconv.predict_memory(torch.nn.Conv2d(1, 1, 3), (1, 1, 5, 5), strategy, **kwargs)


def test_bad_strategy_type():
    with pytest.raises(TypeError, match="strategy must be a bool or one of"):
        memconv.save_memory(3)


@pytest.mark.filterwarnings("ignore:memconv.save_memory. no memconv layer ran")
def test_bool_toggle_like_backpack():
    with memconv.save_memory(True):
        assert memconv.current_strategy() == "rochette"
        with memconv.save_memory(False):
            assert memconv.current_strategy() == "standard"
        assert memconv.current_strategy() == "rochette"
    assert memconv.current_strategy() == "auto"
    assert memconv.available_strategies()[:2] == ("standard", "rochette")


@pytest.mark.parametrize("module", [nn.Linear(2, 3), nn.LazyConv2d(3, 3), "conv"])
def test_weight_vjp_rejects_non_convolutions(module):
    with pytest.raises(TypeError, match=r"Conv1d/2d/3d or ConvTranspose1d/2d/3d"):
        memconv.weight_vjp(module, torch.randn(1, 2, 5, 5), torch.randn(1, 3, 3, 3))


def test_weight_vjp_rejects_mismatched_shapes():
    m = nn.Conv2d(2, 3, 3)
    with pytest.raises(ValueError, match=r"input must have shape \[N, C_in=2"):
        memconv.weight_vjp(m, torch.randn(1, 4, 5, 5), torch.randn(1, 3, 3, 3))
    with pytest.raises(ValueError, match=r"grad_output must have shape \(1, 3, 3, 3\)"):
        memconv.weight_vjp(m, torch.randn(1, 2, 5, 5), torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        memconv.weight_vjp(m, torch.randn(1, 2, 2, 2), torch.randn(1, 3, 1, 1))
    with pytest.raises(TypeError, match="floating point"):
        memconv.weight_vjp(m, torch.ones(1, 2, 5, 5, dtype=torch.long), torch.randn(1, 3, 3, 3))


def test_tile_tuple_of_wrong_length_rejected_before_work():
    m = memconv.Conv2d(2, 3, 3)
    x = torch.randn(2, 2, 6, 6)
    with memconv.save_memory("streaming", tile_size=(2, 2, 2)), memconv.per_sample():
        with pytest.raises(ValueError, match="one entry per spatial dimension"):
            m(x)
    assert m.weight.grad is None and not hasattr(m.weight, "grad_batch")


def test_module_forward_rejects_bad_input_without_side_effects():
    m = memconv.Conv2d(2, 3, 3)
    with pytest.raises(ValueError, match="C_in=2"):
        m(torch.randn(2, 5, 6, 6))
    assert m.weight.grad is None


def test_rejected_per_sample_grads_leaves_grads_alone():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten())
    model[0].weight.grad = torch.ones_like(model[0].weight)
    with pytest.raises(ValueError, match="BatchNorm2d"):
        memconv.per_sample_grads(model, nn.MSELoss(), torch.randn(2, 1, 5, 5), torch.randn(2, 18))
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    with pytest.raises(ValueError, match="unknown strategy"):
        memconv.per_sample_grads(
            model.eval(), nn.MSELoss(), torch.randn(2, 1, 5, 5), torch.randn(2, 18), strategy="x"
        )
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor for one sample"):
        memconv.per_sample_grads(
            model.eval(), nn.MSELoss(reduction="none"), torch.randn(2, 1, 5, 5), torch.randn(2, 18)
        )
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    with pytest.raises(ValueError, match="same length"):
        memconv.per_sample_grads(
            model.eval(), nn.MSELoss(), torch.randn(2, 1, 5, 5), torch.randn(3, 18)
        )


def test_predict_memory_validates():
    m = nn.Conv2d(2, 3, 3)
    with pytest.raises(ValueError, match="input_shape"):
        memconv.predict_memory(m, (1, 3, 5, 5), "unfold")
    with pytest.raises(ValueError, match="unknown strategy"):
        memconv.predict_memory(m, (1, 2, 5, 5), "x")
    assert memconv.predict_memory(m, (4, 2, 9, 9), "unfold") == 4 * 2 * 9 * 7 * 7 * 4


def test_n_zero_and_n_one():
    m = nn.Conv2d(2, 3, 3).double()
    for s in memconv.available_strategies():
        out = memconv.weight_vjp(
            m, torch.randn(0, 2, 5, 5).double(), torch.randn(0, 3, 3, 3).double(), strategy=s
        )
        assert out.shape == (0, 3, 2, 3, 3)
        summed = memconv.weight_vjp(
            m,
            torch.randn(0, 2, 5, 5).double(),
            torch.randn(0, 3, 3, 3).double(),
            strategy=s,
            per_sample=False,
        )
        assert torch.equal(summed, torch.zeros(3, 2, 3, 3, dtype=torch.float64))
