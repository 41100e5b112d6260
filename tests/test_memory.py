"""Memory claims checked against the allocator.

The peak of the CPU allocator while one weight VJP runs (PyTorch profiler
allocation events, replayed in time order), minus the result, against
:func:`memconv.predict_memory`: within 25 % (or 64 KiB, for temporaries too small for
a ratio to mean anything). And ``"auto"`` stays within ``memory_budget``.
"""

import pytest
import torch
from torch import nn

import memconv
from memconv.bench.measure import peak_allocated
from memconv.strategies.geometry import conv_spec

MiB = 2**20
CPU = torch.device("cpu")

# layers of the benchmark models, at sizes whose temporaries are ~1 MiB or more
LAYERS = {
    "first-layer": (nn.Conv2d(1, 64, 3, padding=1), (32, 1, 28, 28)),
    "3x3": (nn.Conv2d(64, 96, 3, padding=1), (8, 64, 13, 13)),
    "late-layer": (nn.Conv2d(128, 128, 3, padding=1), (16, 128, 4, 4)),
    "strided": (nn.Conv2d(32, 64, 3, stride=2, padding=1), (8, 32, 32, 32)),
    "dilated-grouped": (nn.Conv2d(32, 64, 3, padding=2, dilation=2, groups=4), (8, 32, 24, 24)),
    "depthwise": (nn.Conv2d(64, 64, 3, padding=1, groups=64), (8, 64, 32, 32)),
    "conv1d": (nn.Conv1d(32, 64, 5, padding=2), (16, 32, 512)),
    "conv3d": (nn.Conv3d(16, 32, 3, padding=1), (4, 16, 8, 12, 12)),
    "transposed": (
        nn.ConvTranspose2d(64, 32, 3, stride=2, padding=1, output_padding=1),
        (8, 64, 16, 16),
    ),
    "reflect": (nn.Conv2d(16, 32, 3, padding=1, padding_mode="reflect"), (16, 16, 32, 32)),
}


def measured_extra(module, x, g, **kwargs) -> float:
    """Allocator peak while the VJP runs, minus the result's bytes."""
    peak, result = peak_allocated(lambda: memconv.weight_vjp(module, x, g, **kwargs), CPU)
    return peak * MiB - result.numel() * result.element_size()


@pytest.fixture(scope="module", params=list(LAYERS), ids=list(LAYERS))
def layer(request):
    torch.manual_seed(0)
    module, shape = LAYERS[request.param]
    x = torch.randn(shape)
    with torch.no_grad():
        g = torch.randn_like(module(x))
    return module, x, g


@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample", "summed"])
@pytest.mark.parametrize("strategy", memconv.available_strategies())
def test_cost_model_within_25_percent(layer, strategy, per_sample):
    module, x, g = layer
    predicted = memconv.predict_memory(module, tuple(x.shape), strategy, per_sample=per_sample)
    measured = measured_extra(module, x, g, strategy=strategy, per_sample=per_sample)
    assert abs(measured - predicted) <= max(0.25 * predicted, 64 * 1024), (
        predicted / MiB,
        measured / MiB,
    )


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.2])
def test_auto_stays_within_the_budget(layer, fraction):
    module, x, g = layer
    # the copy that brings the input to normal form (reflect padding, a transposed
    # convolution's output_padding) is part of the VJP's memory, and of the budget
    copied = conv_spec(module).operands(x, g).copied * x.element_size()
    unbounded = memconv.predict_memory(module, tuple(x.shape), "auto")
    budget = copied + max(int(fraction * (unbounded - copied)), 256 * 1024)
    assert memconv.predict_memory(module, tuple(x.shape), "auto", memory_budget=budget) <= budget
    with memconv.save_memory("auto", memory_budget=budget):
        measured = measured_extra(module, x, g)
    # within the budget, up to the cost model's tolerance
    assert measured <= 1.25 * budget + 64 * 1024, (budget / MiB, measured / MiB)


def test_auto_warns_when_no_strategy_fits():
    torch.manual_seed(0)
    module = nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect")
    x = torch.randn(2, 4, 12, 12)
    g = torch.randn(2, 8, 12, 12)
    copied = conv_spec(module).operands(x, g).copied * x.element_size()
    with pytest.warns(UserWarning, match="below the extra memory of every strategy"):
        with memconv.save_memory("auto", memory_budget=copied // 2):
            memconv.weight_vjp(module, x, g)


@pytest.mark.parametrize("route", ["ghost", "instantiate"])
def test_norm_route_cost_model_within_25_percent(layer, route):
    """A norm route's temporaries (per-sample squared norms of the weight gradient,
    memconv.conv.norm_routes) against its cost model, at a budget that holds a whole chunk."""
    from memconv.conv.norm_routes import conv_weight_sq_norms, route_costs
    from memconv.conv.settings import Settings
    from memconv.strategies import Options, Problem

    module, x, g = layer
    ops = conv_spec(module).operands(x, g)
    problem = Problem(ops.geometry, x.shape[0], tuple(ops.x.shape[2:]), x.element_size(), True)
    budget = 64 * MiB
    copied = ops.copied * x.element_size()  # the input in normal form, within the budget
    predicted = copied + {c.route: c.memory for c in route_costs(problem, budget - copied)}[route]
    settings = Settings("auto", Options())
    peak, result = peak_allocated(
        lambda: conv_weight_sq_norms(module, x, g, settings, route, budget), CPU
    )
    measured = peak * MiB - result.numel() * result.element_size()
    assert abs(measured - predicted) <= max(0.25 * predicted, 64 * 1024), (
        predicted / MiB,
        measured / MiB,
    )


# the kernel paths of "vmap"'s memory model (oneDNN's blocked kernel or its im2col one
# with one or two column buffers): layers off the grid above
VMAP_LAYERS = {
    "first-layer-5x5": (nn.Conv2d(1, 16, 5, padding=2), (8, 1, 28, 28)),
    "first-layer-8x8-s2": (nn.Conv2d(1, 16, 8, stride=2, padding=3), (8, 1, 28, 28)),
    "depthwise-7x7": (nn.Conv2d(40, 40, 7, padding=3, groups=40), (8, 40, 16, 16)),
    "conv3d-shallow": (nn.Conv3d(32, 32, 3, padding=1, groups=2), (4, 32, 2, 4, 4)),
    "conv1d-few-channels": (nn.Conv1d(2, 16, 3, padding=1), (8, 2, 64)),
    "transposed-depthwise": (nn.ConvTranspose2d(32, 32, 4, 2, 1, groups=32), (8, 32, 8, 8)),
}


@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample", "summed"])
@pytest.mark.parametrize("name", list(VMAP_LAYERS))
def test_vmap_memory_model_on_each_kernel_path(name, per_sample):
    torch.manual_seed(0)
    module, shape = VMAP_LAYERS[name]
    x = torch.randn(shape)
    with torch.no_grad():
        g = torch.randn_like(module(x))
    predicted = memconv.predict_memory(module, shape, "vmap", per_sample=per_sample)
    measured = measured_extra(module, x, g, strategy="vmap", per_sample=per_sample)
    assert abs(measured - predicted) <= max(0.25 * predicted, 16 * 1024), (
        predicted / MiB,
        measured / MiB,
    )
