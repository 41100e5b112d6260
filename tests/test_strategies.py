"""Every strategy against torch's own per-sample gradients and against every other.

float64, 1e-10 relative, over a grid of Conv1d/2d/3d configurations (stride,
padding incl. "same"/"valid", dilation, groups incl. depthwise, bias, N = 1, odd
sizes, tiles that do not divide the output).
"""

import itertools

import pytest
import torch
from helpers import conv_case, reference_weight_grads, rel_err

import memconv

TOL = 1e-10
STRATEGIES = memconv.strategies()

# (dims, N, C_in, C_out, k, size, kwargs)
GRID = [
    (1, 3, 4, 6, 3, 11, {}),
    (1, 2, 4, 6, 4, 13, dict(stride=3, padding=2, dilation=2, groups=2)),
    (1, 1, 3, 5, 5, 9, dict(padding="same", bias=False)),
    (1, 2, 6, 6, 3, 7, dict(groups=6, padding="valid")),
    (2, 3, 2, 4, 3, 8, dict(padding=1)),
    (2, 2, 4, 6, (3, 2), (9, 7), dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)),
    (2, 1, 3, 3, 3, 10, dict(groups=3, padding="same", dilation=2)),
    (2, 2, 3, 4, 4, 9, dict(padding="same")),  # even kernel: asymmetric padding
    (2, 4, 5, 2, 1, 6, dict(stride=2, bias=False)),
    (2, 2, 4, 8, 3, (11, 6), dict(stride=(3, 2), padding=2)),
    (3, 2, 2, 4, 3, 6, dict(padding=1)),
    (3, 1, 4, 4, (2, 3, 2), (7, 6, 5), dict(stride=(2, 1, 2), dilation=(2, 1, 1), groups=4)),
    (3, 2, 3, 3, 3, 5, dict(padding="same", groups=3, bias=False)),
    (3, 3, 2, 2, 3, (5, 7, 6), dict(stride=2, padding=(0, 1, 2))),
]
IDS = [f"conv{c[0]}d-{i}" for i, c in enumerate(GRID)]


@pytest.fixture(scope="module", params=range(len(GRID)), ids=IDS)
def case(request):
    dims, n, c_in, c_out, k, size, kwargs = GRID[request.param]
    m, x, g = conv_case(dims, n, c_in, c_out, k, size, seed=request.param, **kwargs)
    return m, x, g, reference_weight_grads(m, x, g)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_sample_matches_autograd(case, strategy):
    m, x, g, ref = case
    got = memconv.weight_vjp(m, x, g, strategy=strategy)
    assert got.dtype == torch.float64
    assert rel_err(got, ref) < TOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_summed_matches_autograd(case, strategy):
    m, x, g, ref = case
    got = memconv.weight_vjp(m, x, g, per_sample=False, strategy=strategy)
    assert got.shape == m.weight.shape
    assert rel_err(got, ref.sum(0)) < TOL


def test_every_strategy_agrees_with_every_other(case):
    m, x, g, _ = case
    results = {s: memconv.weight_vjp(m, x, g, strategy=s) for s in STRATEGIES}
    for a, b in itertools.combinations(STRATEGIES, 2):
        assert rel_err(results[a], results[b]) < TOL, (a, b)


@pytest.mark.parametrize("tile", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("inner", ["standard", "rochette", "unfold", "shift"])
def test_streaming_tiles_and_inner(case, tile, inner):
    m, x, g, ref = case
    with memconv.save_memory("streaming", tile_size=tile, inner=inner):
        got = memconv.weight_vjp(m, x, g)
    assert rel_err(got, ref) < TOL


def test_streaming_per_axis_tile_tuple():
    m, x, g = conv_case(2, 2, 3, 4, 3, (13, 10), stride=2, padding=2, dilation=2)
    ref = reference_weight_grads(m, x, g)
    with memconv.save_memory("streaming", tile_size=(2, 3)):
        assert rel_err(memconv.weight_vjp(m, x, g), ref) < TOL


@pytest.mark.parametrize("budget", [1, 2**12, 2**16, 2**30])
def test_auto_and_streaming_under_budgets(budget):
    m, x, g = conv_case(2, 3, 4, 6, 3, 12, padding=1, groups=2)
    ref = reference_weight_grads(m, x, g)
    for strategy in ("auto", "streaming"):
        with memconv.save_memory(strategy, memory_budget=budget):
            assert rel_err(memconv.weight_vjp(m, x, g), ref) < TOL


def test_auto_falls_back_to_streaming_when_nothing_fits():
    from memconv._geometry import conv_spec
    from memconv.strategies.auto import choose_strategy

    m = torch.nn.Conv2d(8, 8, 3, padding=1)
    geom = conv_spec(m).geometry
    assert choose_strategy(geom, 4, (32, 32), 4, True, None) == "shift"
    assert choose_strategy(geom, 4, (32, 32), 4, True, 1) == "streaming"


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_padding_modes(mode, strategy):
    m, x, g = conv_case(2, 2, 4, 4, 3, (7, 8), padding=(2, 1), padding_mode=mode, groups=2)
    ref = reference_weight_grads(m, x, g)
    got = memconv.weight_vjp(m, x, g, strategy=strategy)
    assert rel_err(got, ref) < TOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float32_within_round_off(strategy):
    m, x, g = conv_case(2, 3, 8, 8, 3, 16, padding=1, dtype=torch.float32)
    ref = reference_weight_grads(m.double(), x.double(), g.double())
    got = memconv.weight_vjp(m.float(), x, g, strategy=strategy)
    assert got.dtype == torch.float32
    assert rel_err(got.double(), ref) < 1e-5


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_noncontiguous_and_channels_last(strategy):
    m, x, g = conv_case(2, 2, 4, 6, 3, 9, padding=1)
    ref = reference_weight_grads(m, x, g)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    g_t = g.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    assert rel_err(memconv.weight_vjp(m, x_cl, g_t, strategy=strategy), ref) < TOL
