"""A ``torch.compile``'d trunk streams compiled: one graph per kind of tile, exact.

``StreamingCNN(torch.compile(trunk), tile)``: the first step runs the tiles eagerly
and records them, the second traces one tile of each kind, later steps run every
tile as its kind's compiled graph. Each step's output, parameter and input gradients
equal the conventional pass's in float64 (to 1e-10), a 2-D plan has at most 9 kinds
of tile per pass, and once warm a step compiles nothing and runs no tile eagerly.
Most tests use the ``eager`` backend (the traced graph run as recorded: the trace, the
records and the replay, without a compiler's time); one takes ``aot_eager``'s (AOT
Autograd's functionalisation, parameters lifted to inputs) through optimiser steps, and
a slow one inductor's code.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import rel_err
from test_streaming import mixed_net
from torch import nn

from memconv.bench import trunks
from memconv.streaming import StreamingCNN

BACKEND = "eager"


def _randomised(trunk: nn.Module) -> nn.Module:
    return trunks.randomise_norms(trunk).double()


TRUNKS = {
    "mixed": (lambda: mixed_net(), (1, 3, 96, 96), 32),
    "resnet18": (
        lambda: _randomised(trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1))),
        (1, 3, 160, 160),
        48,
    ),
    "convnext": (
        lambda: _randomised(trunks.convnext_trunk((1, 1), (8, 12), layer_scale=0.5)),
        (1, 3, 96, 96),
        32,
    ),
}


def _conventional(trunk: nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.detach().requires_grad_()
    out = trunk(x)
    return out.detach(), torch.autograd.grad(out, [x, *trunk.parameters()], g)


def _step(stream: StreamingCNN, trunk: nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.detach().requires_grad_()
    out = stream(x)
    return out.detach(), torch.autograd.grad(out, [x, *trunk.parameters()], g)


def _calls(stream: StreamingCNN) -> int:
    return sum(graph.calls for graph in stream.tiles_by.graphs.values())


@pytest.mark.parametrize(
    "name",
    [
        "resnet18",
        pytest.param("mixed", marks=pytest.mark.slow),
        pytest.param("convnext", marks=pytest.mark.slow),
    ],
)
def test_compiled_trunk_streams_exactly(name):
    """Steps 1 (eager, recorded), 2 (traced) and 3 (compiled) equal the conventional
    pass; at most 9 kinds of tile per pass in 2-D; step 4 runs every tile compiled."""
    build, shape, tile = TRUNKS[name]
    torch.manual_seed(0)
    trunk = build()
    x = torch.randn(shape, dtype=torch.float64)
    with torch.no_grad():
        g = torch.randn_like(trunk(x))
    ref_out, ref_grads = _conventional(trunk, x, g)
    stream = StreamingCNN(torch.compile(trunk, backend=BACKEND), tile)
    tiles = len(stream.tiles(shape[2:]))
    assert tiles >= 9  # an interior tile
    for _ in range(3):
        out, grads = _step(stream, trunk, x, g)
        assert rel_err(out, ref_out) < 1e-10
        for got, ref in zip(grads, ref_grads):
            assert rel_err(got, ref) < 1e-10
    compiled = stream.tiles_by
    assert not compiled.refused
    assert 1 <= compiled.kinds("forward") <= 9
    assert 1 <= compiled.kinds("backward") <= 9
    before, traces = _calls(stream), compiled.traces
    _step(stream, trunk, x, g)
    assert compiled.traces == traces  # nothing traced or compiled anew
    assert _calls(stream) - before == 2 * tiles  # every tile, both passes


def test_no_dynamo_frame_and_optimiser_steps_followed():
    """The graphs go to the backend as they are (``aot_eager`` here), without Dynamo:
    no frame is compiled, so none breaks or recompiles; parameters changed in place by
    an optimiser between steps are read anew (the graphs hold no copy of them)."""
    from torch._dynamo.utils import counters

    trunk = TRUNKS["mixed"][0]()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)  # 2 × 2 tiles
    g = torch.randn(trunk(x).shape, dtype=torch.float64)
    stream = StreamingCNN(torch.compile(trunk, backend="aot_eager"), 32)
    optimiser = torch.optim.SGD(trunk.parameters(), lr=0.1, momentum=0.9)
    counters.clear()
    for _ in range(4):
        ref_out, ref_grads = _conventional(trunk, x, g)
        out, grads = _step(stream, trunk, x, g)
        assert rel_err(out, ref_out) < 1e-10
        for got, ref in zip(grads, ref_grads):
            assert rel_err(got, ref) < 1e-10
        for p, grad in zip(trunk.parameters(), grads[1:]):
            p.grad = grad
        optimiser.step()
    assert stream.tiles_by.graphs and not stream.tiles_by.refused
    assert all(graph.calls for graph in stream.tiles_by.graphs.values())
    assert not counters["stats"]["unique_graphs"]
    assert not counters["graph_break"]


def test_lightstream_call_sequence():
    """Lightstream's ``out = sCNN.forward(image)`` without autograd, then
    ``sCNN.backward(image, grad)``, on a compiled trunk: ``.grad`` as the conventional
    pass's, step after step."""
    build, shape, tile = TRUNKS["mixed"]
    trunk = build()
    x = torch.randn(shape, dtype=torch.float64)
    with torch.no_grad():
        g = torch.randn_like(trunk(x))
    _, ref = _conventional(trunk, x, g)
    stream = StreamingCNN(torch.compile(trunk, backend=BACKEND), tile_shape=(1, 3, tile, tile))
    for _ in range(3):
        trunk.zero_grad(set_to_none=True)
        with torch.no_grad():
            stream.forward(x)
        assert stream.backward(x, g) is None
        for p, r in zip(trunk.parameters(), ref[1:]):
            assert rel_err(p.grad, r) < 1e-10
    assert stream.tiles_by.graphs and not stream.tiles_by.refused


def test_hook_is_refused_with_a_warning_and_runs_eagerly():
    """A forward hook on a layer would run only at the trace: refused, named, and the
    tiles run eagerly, exactly."""
    build, shape, tile = TRUNKS["mixed"]
    trunk = build()
    seen = []
    trunk[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x = torch.randn(shape, dtype=torch.float64)
    g = torch.randn(trunk(x).shape, dtype=torch.float64)
    ref_out, ref_grads = _conventional(trunk, x, g)
    stream = StreamingCNN(torch.compile(trunk, backend=BACKEND), tile)
    _step(stream, trunk, x, g)
    with pytest.warns(RuntimeWarning, match="run eagerly.*forward hook"):
        out, grads = _step(stream, trunk, x, g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, grads = _step(stream, trunk, x, g)  # warned once
    assert rel_err(out, ref_out) < 1e-10
    for got, ref in zip(grads, ref_grads):
        assert rel_err(got, ref) < 1e-10
    assert not stream.tiles_by.graphs


@pytest.mark.slow
def test_inductor_float32():
    """inductor's code, float32: as the eager streamed step's within float32's
    round-off."""
    torch.manual_seed(0)
    trunk = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.MaxPool2d(2),
    )
    x = torch.randn(1, 3, 32, 48)  # 1 × 3 tiles
    g = torch.randn(trunk(x).shape)
    _, ref = _step(StreamingCNN(trunk, 16), trunk, x, g)
    stream = StreamingCNN(torch.compile(trunk), 16)
    for _ in range(3):
        _, grads = _step(stream, trunk, x, g)
        for got, r in zip(grads, ref):
            assert rel_err(got, r) < 1e-5
    assert stream.tiles_by.graphs and not stream.tiles_by.refused


def test_tiles_compile_with_the_trunks_inductor_options_first():
    """The step options lie beneath the trunk's own: ``reorder_for_locality`` off
    unless the trunk's options set it; another backend as it is."""
    trunk = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
    tiles = StreamingCNN(torch.compile(trunk), 16).tiles_by
    assert tiles.backend.config["reorder_for_locality"] is False
    own = torch.compile(trunk, options={"reorder_for_locality": True})
    assert StreamingCNN(own, 16).tiles_by.backend.config["reorder_for_locality"] is True
    other = StreamingCNN(torch.compile(trunk, backend="aot_eager"), 16).tiles_by.backend
    assert other.compiler_name == "aot_eager" and not hasattr(other, "config")


def test_compiled_model_around_the_stream_breaks_once():
    """``torch.compile`` around a model holding a StreamingCNN: one graph break at the
    streamed trunk (which runs as its trunk was given), the head compiled, ``.grad``
    as the conventional pass's."""
    from torch._dynamo.utils import counters

    trunk = TRUNKS["mixed"][0]()
    model = nn.Sequential(StreamingCNN(trunk, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    x = torch.randn(1, 3, 96, 96, dtype=torch.float64)
    counters.clear()
    got = torch.autograd.grad(torch.compile(model, backend=BACKEND)(x).sum(), trunk.parameters())
    reference = nn.Sequential(trunk, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    ref = torch.autograd.grad(reference(x).sum(), trunk.parameters())
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-10
    assert sum(counters["graph_break"].values()) == 1


def test_other_strides_are_recorded_anew():
    """An output gradient or an image laid out otherwise (channels last) after the
    graphs were compiled: those tiles are recorded anew, not fed to code specialised to
    other strides; exact throughout."""
    trunk = TRUNKS["mixed"][0]()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    g = torch.randn(trunk(x).shape, dtype=torch.float64)
    ref_out, ref_grads = _conventional(trunk, x, g)
    stream = StreamingCNN(torch.compile(trunk, backend=BACKEND), 32)
    last = torch.channels_last
    steps = [(x, g)] * 3 + [(x, g.contiguous(memory_format=last))]
    for image, grad in [*steps, (x.contiguous(memory_format=last), g)]:
        xs = image.detach().requires_grad_()
        out = stream(xs)
        grads = torch.autograd.grad(out, [xs, *trunk.parameters()], grad)
        assert rel_err(out, ref_out) < 1e-10
        for a, b in zip(grads, ref_grads):
            assert rel_err(a, b) < 1e-10
    assert not stream.tiles_by.refused
