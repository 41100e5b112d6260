"""Property-based tests (hypothesis) over the convolution configuration space."""

import torch
from helpers import conv_case, reference_weight_grads, rel_err
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import memconv


def check_every_strategy(m, x, g, tile):
    """Every strategy, per sample (tiles for "streaming") and summed, against torch."""
    ref = reference_weight_grads(m, x, g)
    for strategy in memconv.available_strategies():
        options = {"tile_size": tile} if strategy == "streaming" else {}
        with memconv.save_memory(strategy, **options):
            got = memconv.weight_vjp(m, x, g)
        assert rel_err(got, ref) < 1e-10, strategy
        summed = memconv.weight_vjp(m, x, g, per_sample=False, strategy=strategy)
        assert rel_err(summed, ref.sum(0)) < 1e-10, strategy


@st.composite
def conv_configs(draw):
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    k = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    padding = draw(
        st.one_of(
            st.just("valid"),
            st.just("same"),
            st.tuples(*[st.integers(0, 2) for _ in range(dims)]),
        )
    )
    if padding == "same":
        stride = (1,) * dims
    span = [d * (kk - 1) + 1 for d, kk in zip(dilation, k)]
    size = tuple(s + draw(st.integers(0, 4 if dims < 3 else 2)) for s in span)
    return dict(
        dims=dims,
        n=draw(st.integers(1, 3)),
        c_in=c_in,
        c_out=c_out,
        k=k,
        size=size,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
        tile=tuple(draw(st.integers(1, 3)) for _ in range(dims)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_configs())
def test_every_strategy_equals_reference(cfg):
    tile = cfg.pop("tile")
    dims, n, c_in, c_out, k, size = (
        cfg.pop(key) for key in ("dims", "n", "c_in", "c_out", "k", "size")
    )
    m, x, g = conv_case(dims, n, c_in, c_out, k, size, **cfg)
    check_every_strategy(m, x, g, tile)
    torch.testing.assert_close(
        memconv.bias_grad(g, per_sample=False), g.sum((0, *range(2, g.dim())))
    )


@st.composite
def conv_transpose_configs(draw):
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    output_padding = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    return dict(
        dims=dims,
        n=draw(st.integers(1, 3)),
        c_in=groups * draw(st.integers(1, 2)),
        c_out=groups * draw(st.integers(1, 2)),
        k=tuple(draw(st.integers(1, 3)) for _ in range(dims)),
        size=tuple(draw(st.integers(1, 4 if dims < 3 else 3)) for _ in range(dims)),
        stride=stride,
        padding=tuple(draw(st.integers(0, 2)) for _ in range(dims)),
        output_padding=output_padding,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
        tile=tuple(draw(st.integers(1, 3)) for _ in range(dims)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_transpose_configs())
def test_every_strategy_equals_reference_transposed(cfg):
    tile = cfg.pop("tile")
    dims, n, c_in, c_out, k, size = (
        cfg.pop(key) for key in ("dims", "n", "c_in", "c_out", "k", "size")
    )
    out = [
        (s - 1) * st - 2 * p + d * (kk - 1) + 1 + op
        for s, st, p, d, kk, op in zip(
            size, cfg["stride"], cfg["padding"], cfg["dilation"], k, cfg["output_padding"]
        )
    ]
    assume(min(out) >= 1)  # torch rejects an empty output
    m, x, g = conv_case(dims, n, c_in, c_out, k, size, transposed=True, **cfg)
    check_every_strategy(m, x, g, tile)
