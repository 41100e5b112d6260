"""The curvature path reads a convolution's geometry once per layer call.

BackPACK's second-order extensions through memconv call one module extension per
layer per backward pass; its weight rule reads the layer's normal form
(:func:`memconv.strategies.geometry.conv_spec`) once and passes it down as ``spec=``
(the route's choice, the chunk sizes, every chunk's row VJPs, the patches of the Gram
route and of KFAC's input factor, every signed factor of ``DiagHessian``). Counted
here with every name ``conv_spec`` is imported under wrapped, in float64, with the
quantities checked against BackPACK alone (same seed for the MC extensions) and,
for the exact GGN and Hessian diagonals, against autograd references
(``test_backpack_secondorder``'s, independent of BackPACK and of memconv).
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch import nn

import memconv
import memconv.conv.curvature as curvature
import memconv.strategies.geometry as geometry
from memconv.conv.kronecker import input_factor, patches
from memconv.conv.settings import Settings
from memconv.strategies import NO_OPTIONS

pytest.importorskip("backpack")
from backpack import backpack, extend  # noqa: E402
from backpack import extensions as E  # noqa: E402
from test_backpack_secondorder import _close, _ggn_reference, _hessian_reference  # noqa: E402

import memconv.integrations.backpack.kronecker  # noqa: E402, F401  (imports conv_spec)
import memconv.integrations.backpack.secondorder  # noqa: E402, F401  (imports conv_spec)
from memconv.integrations import backpack as mb  # noqa: E402

#: BackPACK's extensions whose convolution quantities memconv computes (second order).
ROUTED = (
    E.DiagGGNExact,
    E.DiagGGNMC,
    E.BatchDiagGGNExact,
    E.BatchDiagGGNMC,
    E.DiagHessian,
    E.BatchDiagHessian,
    E.SqrtGGNExact,
    E.SqrtGGNMC,
    E.KFAC,
    E.KFLR,
    E.KFRA,
)
AUTO = Settings("auto", NO_OPTIONS)
CLASSES = 6


def _model(convert=False):
    """conv (3×3 output map) → sigmoid → transposed conv → sigmoid → conv (1×1 map) →
    Linear(6): both diagonal routes (the rows on the wider maps, the Gram route where
    T = 1 < V = 6), a transposed convolution, and sigmoids whose residual terms give
    ``DiagHessian`` several signed factors per layer."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.Sigmoid(),
        nn.ConvTranspose2d(3, 2, 2),
        nn.Sigmoid(),
        nn.Conv2d(2, 4, 3, stride=2),
        nn.Flatten(),
        nn.Linear(4, CLASSES),
    )
    if convert:
        model = memconv.convert(model)
    x = torch.randn(3, 2, 6, 6)
    y = torch.randint(0, CLASSES, (3,))
    return model.double(), x.double(), y


def _convs(model):
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]


@pytest.fixture
def spec_counts(monkeypatch):
    """``{id(module): conv_spec calls}`` while counting is on (``counts.on``): every
    memconv module's name for ``conv_spec`` is wrapped (the function's own module's
    too, which :func:`memconv.strategies.geometry.spec_of` calls)."""
    original = geometry.conv_spec
    counts = collections.Counter()
    counts.on = False

    def counting(module):
        if counts.on:
            counts[id(module)] += 1
        return original(module)

    for name, module in list(sys.modules.items()):
        if name.startswith("memconv") and getattr(module, "conv_spec", None) is original:
            monkeypatch.setattr(module, "conv_spec", counting)
    assert curvature.spec_of.__module__ == geometry.__name__
    return counts


def _run(ext, counts=None, install=True, memory_budget=None, convert=False):
    model, x, y = _model(convert)
    model, lossfn = extend(model), extend(nn.CrossEntropyLoss())
    if install:
        mb.install(ext, memory_budget=memory_budget)
    torch.manual_seed(7)  # the MC extensions' samples
    try:
        with backpack(ext):
            loss = lossfn(model(x), y)
            if counts is not None:
                counts.on = True
            loss.backward()
    finally:
        if counts is not None:
            counts.on = False
        mb.uninstall(ext)
    quantities = {}
    for name, p in model.named_parameters():
        q = getattr(p, ext.savefield, None)
        if q is not None:
            quantities[name] = [t.detach().clone() for t in q] if isinstance(q, list) else q
    return model, quantities


def _equal(got, ref):
    assert list(got) == list(ref)
    for name in ref:
        parts = got[name] if isinstance(got[name], list) else [got[name]]
        refs = ref[name] if isinstance(ref[name], list) else [ref[name]]
        assert len(parts) == len(refs), name
        for a, b in zip(parts, refs):
            assert a.shape == b.shape, name
            _close(a, b)


def test_the_model_takes_both_diagonal_routes(monkeypatch):
    """The counts below cover the row route and the Gram route."""
    routes = []
    choose = curvature.diagonal_route

    def recording(*args, **kwargs):
        routes.append(choose(*args, **kwargs))
        return routes[-1]

    monkeypatch.setattr(curvature, "diagonal_route", recording)
    _run(E.DiagGGNExact())
    assert set(routes) == {"rows", "gram"}, routes


@pytest.mark.parametrize("convert", [False, True], ids=["torch", "converted"])
@pytest.mark.parametrize("ext_cls", ROUTED, ids=lambda c: c.__name__)
def test_one_reading_per_layer_call(spec_counts, ext_cls, convert):
    """Exactly one ``conv_spec`` per convolution per backward pass (one pass, no
    chunks: one call of the module extension per layer), and the quantities are
    BackPACK's own."""
    model, got = _run(ext_cls(), spec_counts, convert=convert)
    assert [spec_counts[id(m)] for m in _convs(model)] == [1, 1, 1]
    assert sum(spec_counts.values()) == 3
    _, alone = _run(ext_cls(), install=False)
    _equal(got, alone)


@pytest.mark.parametrize("ext_cls", [E.DiagGGNExact, E.BatchDiagGGNExact, E.SqrtGGNExact])
def test_one_reading_per_replayed_call(spec_counts, ext_cls):
    """Over chunks of the factor's rows (``memory_budget`` of one row: V = 6 chunks)
    the module extension is called once per chunk after the backward pass, and each
    call reads the geometry once: 6 per layer, and the diagonals' replay plan once more
    per layer (whether its diagonal over all rows takes the Gram route). This is the
    minimum without a cache: BackPACK's module-extension call passes nothing but the
    module, and keeping the spec between the replayed calls would be state keyed on the
    module, which could go stale if the module changed between calls."""
    model, got = _run(ext_cls(), spec_counts, memory_budget=1)
    plan = 0 if ext_cls is E.SqrtGGNExact else 1
    assert [spec_counts[id(m)] for m in _convs(model)] == [CLASSES + plan] * 3
    _, one_pass = _run(ext_cls())
    _equal(got, one_pass)


@pytest.mark.parametrize("per_sample", [False, True])
def test_ggn_diagonal_against_autograd(per_sample):
    ext = E.BatchDiagGGNExact() if per_sample else E.DiagGGNExact()
    model, got = _run(ext)
    for name, p in model.named_parameters():
        _close(got[name], _ggn_reference(model, *_model()[1:], p, per_sample))


@pytest.mark.parametrize("per_sample", [False, True])
def test_hessian_diagonal_against_autograd(per_sample):
    model, x, y = _model()  # not extended: torch.func's Hessian
    names = [name for name, _ in model.named_parameters()]
    refs = {name: _hessian_reference(model, x, y, name, per_sample) for name in names}
    _, got = _run(E.BatchDiagHessian() if per_sample else E.DiagHessian())
    for name, ref in refs.items():
        _close(got[name], ref)


def _layer_and_factor(transposed=False, padding_mode="circular"):
    torch.manual_seed(1)
    if transposed:
        layer = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
        x = torch.randn(2, 3, 3, 3, dtype=torch.float64)
    else:
        layer = nn.Conv2d(3, 4, 3, stride=2, padding=1, padding_mode=padding_mode)
        x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    layer = layer.double()
    out = layer(x)
    s = torch.randn(5, *out.shape, dtype=torch.float64)
    return layer, x, s


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
def test_public_functions_read_once_and_take_spec(spec_counts, transposed):
    """Without ``spec=`` each public function reads the layer once; with it, never;
    the results are the same."""
    layer, x, s = _layer_and_factor(transposed)
    spec = geometry.conv_spec(layer)
    calls = [
        lambda **k: curvature.weight_diagonal(layer, x, s, AUTO, per_sample=False, **k),
        lambda **k: curvature.weight_diagonal(
            layer, x, s, AUTO, per_sample=True, route="gram", **k
        ),
        lambda **k: curvature.weight_diagonal(
            layer, x, s, AUTO, per_sample=True, route="rows", **k
        ),
        lambda **k: curvature.weight_rows(layer, x, s, AUTO, **k),
        lambda **k: curvature.diagonal_route(layer, x, s, AUTO, **k),
        lambda **k: curvature.diagonal_costs(layer, x, s, **k),
        lambda **k: input_factor(layer, x, **k),
        lambda **k: input_factor(layer, x, kfac_approx="reduce", memory_budget=1, **k),
        lambda **k: patches(layer, x, **k).source,
    ]
    for call in calls:
        spec_counts.clear()
        spec_counts.on = True
        read = call()
        assert spec_counts[id(layer)] == 1
        spec_counts.clear()
        given = call(spec=spec)
        assert spec_counts[id(layer)] == 0
        spec_counts.on = False
        if isinstance(read, torch.Tensor):
            _close(given, read)
        else:
            assert given == read


def test_nothing_kept_between_calls():
    """A layer whose stride and padding change between calls is read afresh: the
    diagonal and the input factor follow the module (no memo keyed on it)."""
    layer, x, s = _layer_and_factor(padding_mode="zeros")
    first = curvature.weight_diagonal(layer, x, s, AUTO, per_sample=False)
    input_factor(layer, x)
    layer.stride, layer.padding = (1, 1), (0, 0)
    s = torch.randn(5, *layer(x).shape, dtype=torch.float64)
    fresh = nn.Conv2d(3, 4, 3).double()
    fresh.load_state_dict(layer.state_dict())
    for route in ("rows", "gram"):
        got = curvature.weight_diagonal(layer, x, s, AUTO, per_sample=False, route=route)
        ref = curvature.weight_diagonal(fresh, x, s, AUTO, per_sample=False, route=route)
        _close(got, ref)
    _close(input_factor(layer, x), input_factor(fresh, x))
    assert first.shape == layer.weight.shape


def test_spec_must_be_a_conv_spec():
    layer, x, s = _layer_and_factor()
    with pytest.raises(TypeError, match="ConvSpec"):
        curvature.weight_diagonal(
            layer, x, s, AUTO, per_sample=False, spec=geometry.conv_spec(layer).geometry
        )
    with pytest.raises(TypeError, match="ConvSpec"):
        input_factor(layer, x, spec="conv")
