"""Per-sample norms, clip factors and clipped sums against a per-sample autograd loop.

float64 to 1e-10 relative, every norm route and clipping route, over the convolution
grid (dims 1–3, groups incl. depthwise, padding modes, stride, dilation,
"same"/"valid", transposed), Linear with and without a sequence axis,
GroupNorm/LayerNorm, ghost blocks that do not divide T, and hypothesis cases.
"""

import functools
import math

import pytest
import torch
from helpers import CONV_TRANSPOSES, CONVS, Hidden, loop_reference, rel_err
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import memconv
from memconv.conv.norm_routes import ghost_sq_norms
from memconv.strategies.geometry import conv_spec

TOL = 1e-10
NORM_ROUTES = [None, "ghost", "instantiate"]
CLIP_ROUTES = ["book-keeping", "two-pass"]

# (dims, C_in, C_out, k, size, kwargs, transposed)
LAYERS = [
    (1, 4, 6, 3, 11, dict(stride=2, padding=1), False),
    (1, 4, 4, 3, 9, dict(groups=4, dilation=2, padding="same", padding_mode="circular"), False),
    (2, 3, 6, 3, 9, dict(padding=1, padding_mode="reflect"), False),
    (
        2,
        4,
        6,
        (3, 2),
        (9, 8),
        dict(stride=(2, 1), dilation=(1, 2), groups=2, padding="valid"),
        False,
    ),
    (2, 6, 6, 3, 8, dict(groups=6, padding=1), False),  # depthwise
    (2, 4, 4, 4, 8, dict(padding="same", padding_mode="replicate"), False),
    (3, 2, 4, 3, 5, dict(padding=1, groups=2), False),
    (3, 4, 2, 2, 4, dict(stride=2), False),
    (2, 4, 3, 3, 5, dict(stride=2, padding=1, output_padding=1), True),
    (1, 4, 4, 3, 6, dict(groups=2, dilation=2), True),
]


def layer_model(case):
    dims, c_in, c_out, k, size, kwargs, transposed = case
    torch.manual_seed(0)
    conv = (CONV_TRANSPOSES if transposed else CONVS)[dims](c_in, c_out, k, **kwargs)
    sizes = size if isinstance(size, tuple) else (size,) * dims
    x = torch.randn(5, c_in, *sizes)
    with torch.no_grad():
        out = conv(x).flatten(1).shape[1]
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(out, 3)).double()
    return model, x.double(), torch.randint(0, 3, (5,))


def reference(model, loss_fn, x, y):
    per = loop_reference(model, loss_fn, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    return per, norms


def clipped(per, norms, max_norm):
    c = torch.clamp(max_norm / norms, max=1.0)
    return {k: torch.einsum("n,n...->...", c, g) for k, g in per.items()}


@pytest.mark.parametrize("route", NORM_ROUTES)
@pytest.mark.parametrize("case", LAYERS, ids=lambda c: f"conv{'T' if c[6] else ''}{c[0]}d")
def test_norms_every_route(case, route):
    model, x, y = layer_model(case)
    loss_fn = nn.CrossEntropyLoss()
    per, norms = reference(model, loss_fn, x, y)
    got = memconv.per_sample_norms(model, loss_fn, x, y, norm_route=route)
    assert rel_err(got, norms) < TOL
    each = memconv.per_sample_norms(model, loss_fn, x, y, norm_route=route, per_parameter=True)
    assert list(each) == list(per)
    for name, g in per.items():
        assert rel_err(each[name], g.flatten(1).norm(dim=1)) < TOL, name


@pytest.mark.parametrize("clip_route", CLIP_ROUTES)
@pytest.mark.parametrize("route", NORM_ROUTES)
@pytest.mark.parametrize("case", LAYERS, ids=lambda c: f"conv{'T' if c[6] else ''}{c[0]}d")
def test_clipped_sum_every_route(case, route, clip_route):
    model, x, y = layer_model(case)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, norms = reference(model, loss_fn, x, y)
    max_norm = norms.median().item()  # some samples clipped, some not
    expected = clipped(per, norms, max_norm)
    got = memconv.clip_and_accumulate(
        model, loss_fn, x, y, max_norm=max_norm, norm_route=route, clip_route=clip_route
    )
    assert rel_err(got, norms) < TOL
    for name, p in model.named_parameters():
        assert rel_err(p.grad, expected[name]) < TOL, name


def test_adds_to_existing_grad_like_backward():
    model, x, y = layer_model(LAYERS[2])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, norms = reference(model, loss_fn, x, y)
    expected = clipped(per, norms, 0.5)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=0.5)
    for name, p in model.named_parameters():
        assert rel_err(p.grad, expected[name] + 1) < TOL, name


@pytest.mark.parametrize("route", NORM_ROUTES)
def test_linear_with_and_without_sequence_axis_and_normalisation(route):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8),
        nn.LayerNorm(8),
        nn.GELU(),
        nn.Linear(8, 4),  # [N, L, 6] → [N, L, 4]
        nn.Flatten(),
        nn.Linear(4 * 5, 6),
        nn.Unflatten(1, (2, 3)),
        nn.GroupNorm(2, 2),
        nn.Flatten(),
        nn.Linear(6, 3),
    ).double()
    x, y = torch.randn(4, 5, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss_fn = nn.CrossEntropyLoss()
    per, norms = reference(model, loss_fn, x, y)
    assert rel_err(memconv.per_sample_norms(model, loss_fn, x, y, norm_route=route), norms) < TOL
    for clip_route in CLIP_ROUTES:
        model.zero_grad()
        memconv.clip_and_accumulate(
            model,
            loss_fn,
            x,
            y,
            max_norm=norms.min().item(),
            norm_route=route,
            clip_route=clip_route,
        )
        expected = clipped(per, norms, norms.min().item())
        for name, p in model.named_parameters():
            assert rel_err(p.grad, expected[name]) < TOL, (clip_route, name)


@pytest.mark.parametrize("budget", [512, 3000, 40_000])
def test_ghost_blocks_that_do_not_divide_t(budget):
    """Tiny budgets force chunks of one sample and blocks of a few positions."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1, groups=1).double()
    x = torch.randn(3, 3, 7, 5, dtype=torch.float64)
    g = torch.randn(3, 4, 7, 5, dtype=torch.float64)
    ref = torch.stack(
        [torch.autograd.grad(conv(x[i : i + 1]), conv.weight, g[i : i + 1])[0] for i in range(3)]
    )
    got = ghost_sq_norms(conv_spec(conv).operands(x, g), budget)
    assert rel_err(got, ref.flatten(1).pow(2).sum(1)) < TOL


GHOST_LAYERS = LAYERS + [
    (2, 4, 6, 1, 9, dict(stride=2), False),  # a kernel of one skips positions
    (2, 4, 6, 1, 8, dict(stride=3, padding=1), False),  # ... and reads padding
    (1, 3, 5, (1,), 10, dict(stride=2, padding=2, groups=1), False),
    (2, 3, 4, 2, 8, dict(stride=2), False),  # a patch embedding: stride = kernel
    (3, 2, 4, (1, 3, 1), (4, 6, 5), dict(stride=(2, 1, 3), padding=(0, 1, 0)), False),
]


@pytest.mark.parametrize("tiled", [False, True], ids=["whole", "tiled"])
@pytest.mark.parametrize("method", ["positions", "positions-accumulated", "offsets"])
@pytest.mark.parametrize("case", GHOST_LAYERS, ids=lambda c: str(c[:5]))
def test_both_ghost_methods_against_autograd(case, method, tiled):
    """Each way of forming the Gram matrices (memconv.conv.ghost), whole and in bands or
    blocks, against per-sample weight gradients from autograd (the positions method
    with its windows summed by one reduction and accumulated one by one)."""
    from memconv.conv import ghost
    from memconv.strategies import Problem

    dims, c_in, c_out, k, size, kwargs, transposed = case
    torch.manual_seed(0)
    conv = (CONV_TRANSPOSES if transposed else CONVS)[dims](c_in, c_out, k, **kwargs).double()
    sizes = size if isinstance(size, tuple) else (size,) * dims
    x = torch.randn(3, c_in, *sizes, dtype=torch.float64)
    with torch.no_grad():
        g = torch.randn_like(conv(x))
    ref = torch.stack(
        [torch.autograd.grad(conv(x[i : i + 1]), conv.weight, g[i : i + 1])[0] for i in range(3)]
    )
    ops = conv_spec(conv).operands(x, g)
    problem = Problem(ops.geometry, 3, tuple(ops.x.shape[2:]), 8, True)
    make = {
        "positions": functools.partial(ghost._positions_tiling, windows="reduction"),
        "positions-accumulated": functools.partial(ghost._positions_tiling, windows="accumulated"),
        "offsets": ghost._offsets_tiling,
    }[method]
    chosen = make(problem, 2**30)
    if tiled:  # a third of what one sample's whole Gram matrices need: bands or blocks
        chosen = make(problem, chosen.memory // chosen.chunk // 3)
        positions = method.startswith("positions")
        whole = problem.output_size[0] if positions else ghost._offsets_length(problem)
        assert chosen.chunk == 1 and chosen.block < whole
    got = ghost.sq_norms(ops, chosen)
    assert rel_err(got, ref.flatten(1).pow(2).sum(1)) < TOL


def test_shared_parameters_and_a_layer_called_twice():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 3, 3, padding=1)
    model = nn.Sequential(conv, nn.Tanh(), conv, nn.Conv2d(3, 3, 1), nn.Flatten()).double()
    model[3].bias = model[0].bias  # a tied parameter as well
    x, y = torch.randn(4, 3, 5, 5, dtype=torch.float64), torch.randn(4, 75, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    per, norms = reference(model, loss_fn, x, y)
    assert rel_err(memconv.per_sample_norms(model, loss_fn, x, y), norms) < TOL
    for clip_route in CLIP_ROUTES:
        model.zero_grad()
        memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=1.0, clip_route=clip_route)
        expected = clipped(per, norms, 1.0)
        for name, p in model.named_parameters():
            assert rel_err(p.grad, expected[name]) < TOL, (clip_route, name)


def test_converted_model_inside_blocks_is_left_alone():
    model, x, y = layer_model(LAYERS[2])
    loss_fn = nn.CrossEntropyLoss()
    per, norms = reference(model, loss_fn, x, y)
    memconv.convert(model)
    # the function runs its own passes: the per_sample block changes nothing, and says so
    with pytest.warns(UserWarning, match="per_sample: no memconv layer ran"):
        with memconv.save_memory("rochette"), memconv.per_sample():
            got = memconv.per_sample_norms(model, loss_fn, x, y)
    assert rel_err(got, norms) < TOL
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


def test_empty_batch():
    model, x, y = layer_model(LAYERS[0])
    assert memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x[:0], y[:0]).shape == (0,)
    memconv.clip_and_accumulate(model, nn.CrossEntropyLoss(), x[:0], y[:0], max_norm=1.0)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(max_norm=0.0), ValueError, "max_norm must be a positive finite number"),
        (dict(max_norm=-1), ValueError, "max_norm"),
        (dict(max_norm=math.inf), ValueError, "max_norm"),
        (dict(max_norm=math.nan), ValueError, "max_norm"),
        (dict(max_norm="1"), TypeError, "max_norm"),
        (dict(max_norm=1.0, clip_route="ghost"), ValueError, "unknown clip_route 'ghost'"),
        (dict(max_norm=1.0, norm_route="fast"), ValueError, "unknown norm_route 'fast'"),
        (dict(max_norm=1.0, memory_budget=0), ValueError, "memory_budget"),
        (dict(max_norm=1.0, memory_budget=1.5), TypeError, "memory_budget"),
        (dict(max_norm=1.0, strategy="x"), ValueError, "unknown strategy"),
    ],
)
def test_bad_input_leaves_grad_unchanged(kwargs, exc, match):
    model, x, y = layer_model(LAYERS[0])
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    with pytest.raises(exc, match=match):
        memconv.clip_and_accumulate(model, nn.CrossEntropyLoss(), x, y, **kwargs)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())


def test_bad_models_and_batches():
    model, x, y = layer_model(LAYERS[0])
    loss_fn = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="same length"):
        memconv.clip_and_accumulate(model, loss_fn, x, y[:2], max_norm=1.0)
    with pytest.raises(ValueError, match="scalar tensor for one sample"):
        memconv.per_sample_norms(model, nn.CrossEntropyLoss(reduction="none"), x, y)
    bn = nn.Sequential(nn.Conv1d(4, 4, 3), nn.BatchNorm1d(4), nn.Flatten(), nn.Linear(36, 3))
    with pytest.raises(ValueError, match="BatchNorm1d in training mode"):
        memconv.clip_and_accumulate(bn.double(), loss_fn, x, y, max_norm=1.0)
    assert all(p.grad is None for p in bn.parameters())


@st.composite
def conv_configs(draw):
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    k = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(dims))
    span = [d * (kk - 1) + 1 for d, kk in zip(dilation, k)]
    size = tuple(s + draw(st.integers(0, 3)) for s in span)
    return (
        dims,
        groups * draw(st.integers(1, 2)),
        groups * draw(st.integers(1, 2)),
        k,
        size,
        dict(stride=stride, padding=padding, dilation=dilation, groups=groups),
        False,
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conv_configs(), st.sampled_from(NORM_ROUTES), st.sampled_from(CLIP_ROUTES))
def test_hypothesis_norms_and_clipped_sums(case, route, clip_route):
    model, x, y = layer_model(case)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, norms = reference(model, loss_fn, x, y)
    got = memconv.clip_and_accumulate(
        model,
        loss_fn,
        x,
        y,
        max_norm=norms.median().item(),
        norm_route=route,
        clip_route=clip_route,
    )
    assert rel_err(got, norms) < TOL
    expected = clipped(per, norms, norms.median().item())
    for name, p in model.named_parameters():
        assert rel_err(p.grad, expected[name]) < TOL, name


def streamed_model(dtype=torch.float64):
    from memconv.streaming import StreamingCNN

    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, groups=2)
    ).to(dtype)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).to(dtype)
    return nn.Sequential(StreamingCNN(layers, tile_size=16), head), nn.Sequential(layers, head)


def test_per_sample_quantities_through_streaming():
    """A model that streams runs one sample at a time, its gradient gathered tile by tile."""
    streamed, plain = streamed_model()
    x, y = torch.randn(3, 3, 40, 36, dtype=torch.float64), torch.tensor([0, 2, 1])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, norms = reference(plain, loss_fn, x, y)
    grads = memconv.per_sample_grads(streamed, loss_fn, x, y)
    for name in per:
        assert rel_err(grads[name.replace("0.", "0.stream_layers.", 1)], per[name]) < TOL, name
    assert rel_err(memconv.per_sample_norms(streamed, loss_fn, x, y), norms) < TOL
    got = memconv.clip_and_accumulate(streamed, loss_fn, x, y, max_norm=norms.median().item())
    assert rel_err(got, norms) < TOL
    expected = clipped(per, norms, norms.median().item())
    for name, p in streamed.named_parameters():
        assert rel_err(p.grad, expected[name.replace("0.stream_layers.", "0.", 1)]) < TOL, name


def test_a_layer_hidden_from_the_hooks_takes_the_model_route():
    """A layer run inside another autograd Function (StreamingCNN's pattern): no layer
    call covers its parameters' uses, so the model route computes them, exactly."""

    model = Hidden().double()
    x, y = torch.randn(3, 4, 11, dtype=torch.float64), torch.tensor([0, 1, 2])
    # its parameters' uses lie in no layer call: the model route (torch.func, or a loop
    # by autograd where vmap cannot run the Function) gives them exactly
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    got = memconv.per_sample_norms(model, loss_fn, x, y)
    expected = torch.cat([v.flatten(1) for v in ref.values()], 1).norm(dim=1)
    assert torch.allclose(got, expected, rtol=1e-10, atol=0)


def test_reentrant_checkpointing_warns():
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Conv1d(4, 4, 3)
            self.head = nn.Linear(4 * 9, 3)

        def forward(self, x):
            x = x.requires_grad_()
            return self.head(checkpoint(self.inner, x, use_reentrant=True).flatten(1))

    model = Checkpointed().double()
    x, y = torch.randn(3, 4, 11, dtype=torch.float64), torch.tensor([0, 1, 2])
    with pytest.warns(UserWarning, match=r"\['inner'\] ran their forward pass with gradients"):
        memconv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)


def _pre_hooked_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 4),
        nn.Tanh(),
        nn.Linear(4, 3),
    ).double()
    model[5].register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))  # scales the input
    model[0].register_forward_pre_hook(lambda m, args, kw: ((args[0] + 1,), kw), with_kwargs=True)
    model[0].register_forward_hook(lambda m, args, out: out * 2)  # and the output
    return model


def test_forward_pre_hooks_that_change_inputs_are_replayed_once():
    """A pre-hook's change of a layer's input enters the per-sample gradients once (not
    once by the forward pass and again by the route's replay of the call)."""
    model = _pre_hooked_model()
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(6, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    ref = loop_reference(model, loss_fn, x, y)
    got = memconv.per_sample_grads(model, loss_fn, x, y)
    for name in ref:
        assert rel_err(got[name], ref[name]) < TOL, name
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in ref.values()]).sum(0).sqrt()
    max_norm = norms.median().item()
    c = torch.clamp(max_norm / norms, max=1.0)
    for route in ("book-keeping", "two-pass"):
        model.zero_grad()
        got_norms = memconv.clip_and_accumulate(
            model, loss_fn, x, y, max_norm=max_norm, clip_route=route
        )
        assert rel_err(got_norms, norms) < TOL
        for name, p in model.named_parameters():
            assert rel_err(p.grad, torch.einsum("n,n...->...", c, ref[name])) < TOL, (route, name)
