"""Every strategy against torch's own per-sample gradients and against every other.

float64, 1e-10 relative, over a grid of Conv1d/2d/3d and ConvTranspose1d/2d/3d
configurations (stride, padding incl. "same"/"valid", dilation, groups incl.
depthwise, output_padding, bias, N = 1, odd sizes, tiles that do not divide the
output). The reference is one ``torch.autograd.grad`` call per sample.
"""

import itertools
import warnings

import pytest
import torch
from helpers import conv_case, reference_weight_grads, rel_err

import memconv
from memconv.strategies import Options, Problem, elementary, get_strategy
from memconv.strategies.auto import choose
from memconv.strategies.geometry import conv_spec

TOL = 1e-10
STRATEGIES = memconv.available_strategies()
ELEMENTARY = [s.name for s in elementary()]

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
# transposed convolutions: (dims, N, C_in, C_out, k, size, kwargs)
GRID_T = [
    (1, 3, 4, 6, 3, 7, {}),
    (1, 2, 4, 6, 4, 6, dict(stride=3, padding=2, dilation=2, groups=2, output_padding=1)),
    (2, 2, 6, 4, 3, 5, dict(stride=2, padding=1, output_padding=1)),
    (2, 3, 4, 4, (3, 2), (4, 5), dict(stride=(2, 1), padding=(1, 0), groups=4)),
    (2, 1, 3, 6, 3, 4, dict(stride=1, padding=1, dilation=2, output_padding=1, groups=3)),
    (2, 2, 2, 3, 2, 5, dict(stride=2, bias=False)),  # U-Net up-sampling
    (3, 2, 4, 2, 3, 4, dict(stride=2, padding=1, output_padding=(1, 0, 1), groups=2)),
    (3, 1, 2, 2, (2, 3, 2), (3, 4, 3), dict(stride=(2, 1, 2))),
]
CASES = [(c, False) for c in GRID] + [(c, True) for c in GRID_T]
IDS = [f"conv{c[0]}d-{i}" for i, c in enumerate(GRID)] + [
    f"convT{c[0]}d-{i}" for i, c in enumerate(GRID_T)
]


@pytest.fixture(scope="module", params=range(len(CASES)), ids=IDS)
def case(request):
    (dims, n, c_in, c_out, k, size, kwargs), transposed = CASES[request.param]
    m, x, g = conv_case(
        dims, n, c_in, c_out, k, size, seed=request.param, transposed=transposed, **kwargs
    )
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
@pytest.mark.parametrize("inner", ELEMENTARY)
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


@pytest.mark.parametrize("budget", [2**12, 2**16, 2**30])
def test_auto_shift_and_streaming_under_budgets(budget):
    m, x, g = conv_case(2, 3, 4, 6, 3, 12, padding=1, groups=2)
    ref = reference_weight_grads(m, x, g)
    for strategy in ("auto", "shift", "streaming"):
        with memconv.save_memory(strategy, memory_budget=budget):
            assert rel_err(memconv.weight_vjp(m, x, g), ref) < TOL


def test_auto_picks_the_fastest_that_fits_and_warns_when_none_does():
    m = torch.nn.Conv2d(8, 8, 3, padding=1)
    problem = Problem(conv_spec(m).geometry, 4, (32, 32), 4, True)
    strategy, _, memory, fits = choose(problem, Options())
    others = [get_strategy(s) for s in STRATEGIES if s != "auto"]
    fastest = min(others, key=lambda s: s.time(problem, Options()))
    assert fits and strategy is fastest
    budget = memory - 1
    strategy, _, memory, fits = choose(problem, Options(memory_budget=budget))
    assert fits and memory <= budget and strategy is not fastest
    _, _, memory, fits = choose(problem, Options(memory_budget=1))
    assert not fits and memory == min(s.memory(problem, Options(memory_budget=1)) for s in others)
    x, g = torch.randn(4, 8, 32, 32), torch.randn(4, 8, 32, 32)
    with pytest.warns(UserWarning, match="below the extra memory of every strategy"):
        with memconv.save_memory("auto", memory_budget=1):
            memconv.weight_vjp(m, x, g)


def test_auto_choice_is_logged(caplog):
    m, x, g = conv_case(2, 2, 3, 4, 3, 8, padding=1)
    with caplog.at_level("DEBUG", logger="memconv"):
        memconv.weight_vjp(m, x, g, strategy="auto")
    assert any("auto:" in r.getMessage() for r in caplog.records)


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


@pytest.mark.parametrize("per_sample", [True, False])
def test_shift_pads_a_channels_last_depthwise_input_once(per_sample):
    """ConvNeXt's blocks hand their 7x7 depthwise convolution a channels-last input and
    output gradient: ``"shift"`` is exact there, and pads each into one contiguous
    buffer (no second, channels-last padded copy beside it: 12 % of ConvNeXt-atto's
    DP step's allocator peak at batch 64)."""
    from memconv.bench.measure import peak_allocated

    m, x, g = conv_case(2, 8, 16, 16, 7, 24, padding=3, groups=16, seed=1)
    ref = reference_weight_grads(m, x, g)
    if not per_sample:
        ref = ref.sum(0)
    cl = torch.channels_last
    x_cl, g_cl = x.contiguous(memory_format=cl), g.contiguous(memory_format=cl)
    assert x_cl.stride(1) == 1 and g_cl.stride(1) == 1

    def vjp(a, b):
        return memconv.weight_vjp(m, a, b, strategy="shift", per_sample=per_sample)

    assert rel_err(vjp(x_cl, g_cl), ref) < TOL
    peaks = [
        peak_allocated(lambda a=a, b=b: vjp(a, b), torch.device("cpu"))[0]
        for a, b in ((x, g), (x_cl, g_cl))
    ]
    assert peaks[1] <= peaks[0] * 1.01, peaks


def test_registry_is_open(strategy_calls):
    """A new strategy is one registered object: auto and streaming consider it."""
    from memconv.strategies import base

    class Twice:
        name, options, composite = "test-twice", frozenset(), False

        def vjp(self, x, g, geom, *, per_sample, options, out=None):
            result = get_strategy("unfold").vjp(x, g, geom, per_sample=per_sample, options=options)
            return result if out is None else out.add_(result)

        def memory(self, problem, options):
            return 0

        def time(self, problem, options):
            return 0.0  # the fastest there is

    m, x, g = conv_case(2, 2, 3, 4, 3, 8, padding=1)
    ops = conv_spec(m).operands(x, g)
    problem = Problem(ops.geometry, 4, tuple(ops.x.shape[2:]), 8, True)
    before = choose(problem, Options())[0].name  # the choices are memoised ...
    base.register_strategy(Twice())
    try:
        # ... by the registered names too: the new strategy is seen at once
        assert before != "test-twice" and choose(problem, Options())[0].name == "test-twice"
        ref = reference_weight_grads(m, x, g)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert rel_err(memconv.weight_vjp(m, x, g, strategy="auto"), ref) < TOL
        assert ("auto", True) in strategy_calls and strategy_calls[-1][0] == "unfold"
        with memconv.save_memory("streaming", tile_size=3):
            assert rel_err(memconv.weight_vjp(m, x, g), ref) < TOL
    finally:
        del base._REGISTRY["test-twice"]
