"""BackPACK's second-order extensions through memconv, against BackPACK and autograd.

Float64. The references are independent of BackPACK: the GGN diagonal as
``Σₙ Σᵢⱼ Hₙ[i, j] Jₙ[i] ⊙ Jₙ[j]`` from per-output autograd Jacobians ``Jₙ`` and the
loss Hessian ``Hₙ`` (cross-entropy: ``diag(p) − p pᵀ``), which is ``Σₙ Σᵥ (Jₙᵀ Sₙ eᵥ)²``
for any factorisation ``Hₙ = Sₙ Sₙᵀ``; the Hessian diagonal by second derivatives of
the loss; SqrtGGN's rows by ``Σ rows ⊗ rows`` = the GGN block.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import memconv
import memconv.conv.curvature as curvature

pytest.importorskip("backpack")
from backpack import backpack, extend  # noqa: E402
from backpack import extensions as E  # noqa: E402

from memconv.integrations import backpack as mb  # noqa: E402

RTOL = 1e-10
DIAG = (E.DiagGGNExact, E.BatchDiagGGNExact)
HESSIAN = (E.DiagHessian, E.BatchDiagHessian)
SECOND_ORDER = (
    E.DiagGGNExact,
    E.DiagGGNMC,
    E.BatchDiagGGNExact,
    E.BatchDiagGGNMC,
    E.DiagHessian,
    E.BatchDiagHessian,
    E.SqrtGGNExact,
    E.SqrtGGNMC,
)

#: (layer factory, input shape): every conv type and held-out geometries.
GEOMETRIES = {
    "conv2d": (lambda: nn.Conv2d(2, 4, 3, stride=2, padding=1), (3, 2, 7, 7)),
    "conv2d-groups-dilation": (lambda: nn.Conv2d(4, 4, 3, dilation=2, groups=2), (2, 4, 7, 7)),
    "conv2d-depthwise": (lambda: nn.Conv2d(3, 3, 3, padding=1, groups=3), (2, 3, 5, 5)),
    "conv1d": (lambda: nn.Conv1d(2, 3, 3, padding=2, stride=2), (3, 2, 9)),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2, stride=(1, 2, 1), bias=False), (2, 2, 4, 4, 3)),
    "convT1d": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), (3, 2, 5)),
    "convT2d-groups": (lambda: nn.ConvTranspose2d(4, 2, 3, padding=1, groups=2), (2, 4, 4, 4)),
    "convT3d": (lambda: nn.ConvTranspose3d(2, 2, 2, dilation=2), (2, 2, 3, 3, 2)),
}
#: Geometries where BackPACK 1.7.1 alone is wrong (circular padding: its Jacobians
#: ignore the padding mode) or raises (``output_padding``): autograd only.
WRONG_IN_BACKPACK = {
    "conv1d-circular": (lambda: nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular"), (3, 2, 6)),
    "convT2d-output-padding": (
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
        (2, 2, 3, 3),
    ),
}


def _net(make, shape, seed=0, convert=False):
    """conv → sigmoid → Flatten → Linear(3), with its input and targets."""
    torch.manual_seed(seed)
    layers = [make(), nn.Sigmoid()]
    with torch.no_grad():
        out = nn.Sequential(*layers)(torch.zeros(shape)).flatten(1).shape[1]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(out, 3))
    x = torch.randn(shape)
    y = torch.randint(0, 3, (shape[0],))
    if convert:
        model = memconv.convert(model)
    return model.double(), x.double(), y


def _run(model, x, y, ext, install=True):
    model, lossfn = extend(model), extend(nn.CrossEntropyLoss())
    if install:
        mb.install(ext)
    torch.manual_seed(7)  # the MC extensions' samples
    with backpack(ext):
        lossfn(model(x), y).backward()
    return {
        name: getattr(p, ext.savefield).detach().clone()
        for name, p in model.named_parameters()
        if hasattr(p, ext.savefield)
    }


def _close(a, b, rtol=RTOL):
    scale = b.abs().max().clamp_min(1e-300)
    assert (a - b).abs().max() <= rtol * scale, ((a - b).abs().max() / scale).item()


def _conv(model):
    return next(m for m in model.modules() if isinstance(m, mb._SUPPORTED[1:7]))


def _ggn_reference(model, x, y, param, per_sample):
    """``Σₙ Σᵢⱼ Hₙ[i, j] Jₙ[i] ⊙ Jₙ[j]`` (mean cross-entropy: ``Hₙ`` carries 1/N)."""
    out = model(x)
    n, c = out.shape
    p = out.softmax(1).detach()
    diags = []
    for i in range(n):
        jac = torch.stack(
            [torch.autograd.grad(out[i, k], param, retain_graph=True)[0] for k in range(c)]
        )
        h = (torch.diag(p[i]) - torch.outer(p[i], p[i])) / n
        diags.append(torch.einsum("ij,i...,j...->...", h, jac, jac))
    diags = torch.stack(diags)
    return diags if per_sample else diags.sum(0)


def _hessian_reference(model, x, y, name, per_sample):
    """The diagonal of the loss's (per-sample: each sample's term's) second derivatives."""
    params = dict(model.named_parameters())
    p0 = params[name].detach()

    def loss_of(flat, rows):
        out = torch.func.functional_call(model, {**params, name: flat.reshape(p0.shape)}, (x,))
        return nn.functional.cross_entropy(out[rows], y[rows], reduction="sum") / x.shape[0]

    def diag(rows):
        h = torch.func.hessian(lambda f: loss_of(f, rows))(p0.flatten())
        return h.diagonal().reshape(p0.shape)

    if per_sample:
        return torch.stack([diag([i]) for i in range(x.shape[0])])
    return diag(list(range(x.shape[0])))


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("ext_cls", SECOND_ORDER, ids=lambda c: c.__name__)
def test_equal_to_backpack_alone(geometry, ext_cls):
    make, shape = GEOMETRIES[geometry]
    alone = _run(*_net(make, shape), ext_cls(), install=False)
    through = _run(*_net(make, shape), ext_cls())
    converted = _run(*_net(make, shape, convert=True), ext_cls())
    assert alone.keys() == through.keys() == converted.keys()
    for name in alone:
        _close(through[name], alone[name])
        _close(converted[name], alone[name])


@pytest.mark.parametrize("geometry", [*GEOMETRIES, *WRONG_IN_BACKPACK])
@pytest.mark.parametrize("ext_cls", DIAG, ids=lambda c: c.__name__)
def test_ggn_diagonal_against_autograd(geometry, ext_cls):
    make, shape = {**GEOMETRIES, **WRONG_IN_BACKPACK}[geometry]
    model, x, y = _net(make, shape)
    got = _run(model, x, y, ext_cls())
    per_sample = ext_cls is E.BatchDiagGGNExact
    for name, p in model.named_parameters():
        _close(got[name], _ggn_reference(model, x, y, p, per_sample))


@pytest.mark.parametrize("geometry", ["conv2d", "convT1d", *WRONG_IN_BACKPACK])
@pytest.mark.parametrize("ext_cls", HESSIAN, ids=lambda c: c.__name__)
def test_hessian_diagonal_against_second_derivatives(geometry, ext_cls):
    make, shape = {**GEOMETRIES, **WRONG_IN_BACKPACK}[geometry]
    model, x, y = _net(make, shape)
    names = ("0.weight", "0.bias")  # the convolution's (the Linear's are BackPACK's)
    per_sample = ext_cls is E.BatchDiagHessian
    refs = [_hessian_reference(model, x, y, name, per_sample) for name in names]  # not extended
    got = _run(model, x, y, ext_cls())
    for name, ref in zip(names, refs):
        _close(got[name], ref)


@pytest.mark.parametrize("geometry", ["conv2d-groups-dilation", *WRONG_IN_BACKPACK])
def test_sqrt_ggn_rows_give_the_ggn(geometry):
    make, shape = {**GEOMETRIES, **WRONG_IN_BACKPACK}[geometry]
    model, x, y = _net(make, shape)
    weight = _conv(model).weight
    rows = _run(model, x, y, E.SqrtGGNExact())["0.weight"]
    assert rows.shape == (3, shape[0], *weight.shape)
    flat = rows.reshape(-1, weight.numel())
    out = model(x)
    jac = torch.stack(
        [
            torch.autograd.grad(out[i, k], weight, retain_graph=True)[0].flatten()
            for i in range(out.shape[0])
            for k in range(3)
        ]
    ).reshape(out.shape[0], 3, -1)
    p = out.softmax(1).detach()
    h = (torch.diag_embed(p) - torch.einsum("ni,nj->nij", p, p)) / out.shape[0]
    ggn = torch.einsum("nip,nij,njq->pq", jac, h, jac)
    _close(flat.T @ flat, ggn)


def test_circular_padding_deeper_layer_gets_exact_factor():
    """A circular convolution between the loss and another layer: the factor it passes
    back is exact (BackPACK's transposed convolution ignores the padding mode)."""
    make, shape = WRONG_IN_BACKPACK["conv1d-circular"]

    def model_and_data():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular"),
            nn.Sigmoid(),
            nn.Conv1d(3, 2, 3, padding=1, padding_mode="circular"),
            nn.Sigmoid(),
            nn.Flatten(),
            nn.Linear(12, 3),
        ).double()
        return model, torch.randn(shape).double(), torch.randint(0, 3, (3,))

    model, x, y = model_and_data()
    got = _run(model, x, y, E.DiagGGNExact())
    _close(got["0.weight"], _ggn_reference(model, x, y, model[0].weight, False))
    model, x, y = model_and_data()
    alone = _run(model, x, y, E.DiagGGNExact(), install=False)
    assert (alone["0.weight"] - got["0.weight"]).abs().max() > 1e-3 * got["0.weight"].abs().max()


def test_chunked_rows_equal_one_chunk(monkeypatch):
    make, shape = GEOMETRIES["conv2d-groups-dilation"]
    one = _run(*_net(make, shape), E.BatchDiagGGNExact())
    chunks = []
    real = curvature.row_chunks

    def tiny(v, n, row_bytes, memory_budget):
        out = real(v, n, row_bytes, 1)  # one row per chunk
        chunks.append(len(out))
        return out

    monkeypatch.setattr(curvature, "row_chunks", tiny)
    ext = mb.install(E.BatchDiagGGNExact(), memory_budget=None)  # all V = 3 rows at once
    many = _run(*_net(make, shape), ext, install=False)
    assert chunks and chunks[0] == 3 * shape[0]
    for name in one:
        _close(many[name], one[name])


def test_row_chunks_cover_every_row_once():
    for v, n, rows in [(5, 3, 1), (5, 3, 2), (5, 3, 4), (5, 3, 7), (5, 3, 100)]:
        seen = torch.zeros(v, n, dtype=torch.long)
        for v0, v1, n0, n1 in curvature.row_chunks(v, n, 10, 10 * rows):
            assert (v1 - v0) * (n1 - n0) <= max(rows, 1)
            seen[v0:v1, n0:n1] += 1
        assert (seen == 1).all()


@pytest.mark.parametrize("ext_cls", [*SECOND_ORDER, E.KFAC, E.KFLR, E.KFRA, E.BatchGrad])
def test_every_memconv_class_is_mapped(ext_cls):
    ext = ext_cls()
    before = dict(mb._mapping(ext))
    with _no_warning():  # every second-order extension is covered (KFAC/KFLR/KFRA too)
        mb.install(ext)
    mapping = mb._mapping(ext)
    for torch_cls, memconv_cls in memconv.modules.CONVERSIONS.items():
        if torch_cls in before:
            assert memconv_cls in mapping, memconv_cls
    mb.uninstall(ext)
    assert mb._mapping(ext) == before


def test_kronecker_extensions_get_the_kronecker_hook(monkeypatch):
    import memconv.integrations.backpack.kronecker as kronecker

    mine = object()
    seen = []
    monkeypatch.setattr(
        kronecker, "module_extension", lambda ext, cls, **kw: seen.append(cls) or mine
    )
    for ext_cls in (E.KFAC, E.KFLR, E.KFRA):
        ext = mb.install(ext_cls())
        assert mb._mapping(ext)[nn.Conv2d] is mine
        assert mb._mapping(ext)[memconv.Conv2d] is mine
        mb.uninstall(ext)
    assert nn.ConvTranspose3d in seen


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


def test_converted_model_runs_kfac_and_diag_ggn_together():
    """A converted model crashed under every second-order extension (memconv.Linear
    had no module extension)."""
    make, shape = GEOMETRIES["conv2d"]
    model, x, y = _net(make, shape, convert=True)
    model, lossfn = extend(model), extend(nn.CrossEntropyLoss())
    exts = mb.install(E.DiagGGNExact(), E.KFAC())
    with backpack(*exts):
        lossfn(model(x), y).backward()
    assert model[-1].weight.diag_ggn_exact.shape == model[-1].weight.shape
    assert len(model[0].weight.kfac) == 2


def test_tied_weight_raises_naming_the_parameter():
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 2, 3, padding=1)
    model = extend(nn.Sequential(conv, nn.Sigmoid(), conv, nn.Flatten(), nn.Linear(32, 3)))
    lossfn = extend(nn.CrossEntropyLoss())
    ext = mb.install(E.DiagGGNExact())
    x = torch.randn(2, 2, 4, 4)
    with (
        backpack(ext),
        pytest.raises(ValueError, match="DiagGGNExact.*parameter '(bias|weight)'.*untie"),
    ):
        lossfn(model(x), torch.tensor([0, 1])).backward()


def test_routed_installs_per_block_and_restores(monkeypatch):
    import backpack as bp

    enter, exit_ = bp.backpack.__enter__, bp.backpack.__exit__
    calls = []
    monkeypatch.setattr(
        curvature, "weight_diagonal", _counting(curvature.weight_diagonal, calls), raising=True
    )
    import memconv.integrations.backpack.secondorder as so

    monkeypatch.setattr(so, "weight_diagonal", curvature.weight_diagonal)
    make, shape = GEOMETRIES["conv2d"]
    model, x, y = _net(make, shape)
    alone = _run(model, x, y, E.DiagGGNExact(), install=False)
    assert not calls
    ext = E.DiagGGNExact()
    before = dict(mb._mapping(ext))
    with mb.routed():
        assert bp.backpack.__enter__ is not enter
        with mb.routed():  # nested: one patch
            model, x, y = _net(make, shape)
            routed = _run(model, x, y, ext, install=False)
        assert bp.backpack.__enter__ is not enter
        seen = []
        thread = threading.Thread(target=lambda: seen.append(_routing_in_thread(ext)))
        thread.start()
        thread.join()
        assert seen == [False]  # another thread's blocks are not routed
    assert calls
    assert mb._mapping(ext) == before
    assert bp.backpack.__enter__ is enter and bp.backpack.__exit__ is exit_
    for name in alone:
        _close(routed[name], alone[name])


def _routing_in_thread(ext):
    with backpack(ext):
        return ext in mb._previous


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


@pytest.fixture
def float64_default():
    """BackPACK's AdaptiveAvgPool Jacobian builds its convolution in the default dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def test_tv_resnet_in_eval_through_the_converter(float64_default):
    """torchvision's ResNet layout (BatchNorm in eval, AdaptiveAvgPool2d, residual
    additions through BackPACK's converter), narrow and one block per stage."""
    from memconv.bench.models import TVResNet

    def model_and_data(convert):
        torch.manual_seed(0)
        model = TVResNet((1, 1, 1, 1), num_classes=3, width=2).double().eval()
        model = extend(model, use_converter=True)
        if convert:  # after BackPACK's converter, whose tracer enters memconv's layers
            model = extend(memconv.convert(model))
        return model, torch.randn(2, 3, 16, 16).double()

    y = torch.tensor([0, 2])
    results = []
    for install, convert in [(False, False), (True, False), (True, True)]:
        model, x = model_and_data(convert)
        results.append(_run(model, x, y, E.DiagGGNExact(), install=install))
    for name in results[0]:
        _close(results[1][name], results[0][name])
        _close(results[2][name], results[0][name])
    model, x = model_and_data(False)
    conv = dict(model.named_parameters())
    name = next(n for n in conv if "conv1" in n and n.endswith("weight"))
    _close(results[1][name], _ggn_reference(model, x, y, conv[name], False))


def _cnn(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(36, 10),
    ).double()
    return model, torch.randn(4, 2, 6, 6).double(), torch.randint(0, 10, (4,))


@pytest.mark.parametrize(
    "ext_cls",
    [E.DiagGGNExact, E.BatchDiagGGNExact, E.SqrtGGNExact, E.DiagGGNMC],
    ids=lambda c: c.__name__,
)
def test_backward_over_chunks_of_rows_equals_one_pass(ext_cls, caplog):
    one = _run(*_cnn(), ext_cls() if ext_cls is not E.DiagGGNMC else ext_cls(mc_samples=5))
    ext = ext_cls() if ext_cls is not E.DiagGGNMC else ext_cls(mc_samples=5)
    mb.install(ext, memory_budget=1)  # one row per chunk
    with caplog.at_level("INFO", logger="memconv"):
        chunked = _run(*_cnn(), ext, install=False)
    v = 5 if ext_cls is E.DiagGGNMC else 10
    assert f"the {v} rows of the factor in {v} chunk(s)" in caplog.text
    assert chunked.keys() == one.keys()
    for name in one:
        _close(chunked[name], one[name])


def test_backward_over_chunks_through_the_converter(float64_default):
    from memconv.bench.models import TVResNet

    def model_and_data():
        torch.manual_seed(0)
        model = TVResNet((1, 1, 1, 1), num_classes=5, width=2).double().eval()
        return extend(model, use_converter=True), torch.randn(2, 3, 16, 16).double()

    y = torch.tensor([0, 4])
    one = _run(*model_and_data(), y, E.BatchDiagGGNExact())
    ext = mb.install(E.BatchDiagGGNExact(), memory_budget=30_000)
    chunked = _run(*model_and_data(), y, ext, install=False)
    for name in one:
        _close(chunked[name], one[name])


def test_chunked_tied_weight_raises_before_any_work(monkeypatch):
    calls = []
    monkeypatch.setattr(curvature, "weight_diagonal", _counting(curvature.weight_diagonal, calls))
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 2, 3, padding=1)
    model = extend(nn.Sequential(conv, nn.Sigmoid(), conv, nn.Flatten(), nn.Linear(32, 3)))
    lossfn = extend(nn.CrossEntropyLoss())
    ext = mb.install(E.DiagGGNExact(), memory_budget=10**6)
    x = torch.randn(2, 2, 4, 4)
    with backpack(ext), pytest.raises(ValueError, match="DiagGGNExact.*tied.*untie"):
        lossfn(model(x), torch.tensor([0, 1])).backward()
    assert not calls


@pytest.mark.parametrize("budget,error", [(0, ValueError), (1.5, TypeError), ("1GiB", TypeError)])
def test_memory_budget_checked(budget, error):
    with pytest.raises(error, match="memory_budget"):
        mb.install(E.DiagGGNExact(), memory_budget=budget)
    with pytest.raises(error, match="memory_budget"), mb.routed(memory_budget=budget):
        pass
