"""What memconv refuses under BackPACK's second-order extensions: each refusal names the
module path (where the model is given), the extension and the remedy, and those that
can be known before the forward pass are raised there; the lean default chunking."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

pytest.importorskip("backpack")
from backpack import backpack, extend  # noqa: E402
from backpack import extensions as E  # noqa: E402
from backpack.extensions.secondorder.hbp.hbp_options import (  # noqa: E402
    ExpectationApproximation,
)

from memconv.integrations import backpack as mb  # noqa: E402


class Scale(nn.Module):
    """A layer with a parameter BackPACK has no module extension for."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.gain


def _data(n=2):
    torch.manual_seed(0)
    return torch.randn(n, 2, 4, 4), torch.arange(n) % 3


def _tied_model():
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 2, 3, padding=1)
    return nn.Sequential(conv, nn.Sigmoid(), conv, nn.Flatten(), nn.Linear(32, 3))


def test_tied_parameters_refused_at_install_naming_the_layers():
    model = _tied_model()
    ext = E.DiagGGNExact()
    with pytest.raises(ValueError, match=r"DiagGGNExact.*layers '0', '2' \(tied\).*untie it"):
        mb.install(ext, model=model)
    assert ext not in mb._previous  # nothing installed
    mb.uninstall(mb.install(E.BatchGrad(), model=model))  # BatchGrad sums over the uses


def test_layer_without_module_extension_refused_at_install():
    model = nn.Sequential(nn.Conv2d(2, 2, 3), Scale(), nn.Flatten(), nn.Linear(8, 3))
    exts = (E.BatchGrad(), E.KFAC())
    with pytest.raises(
        NotImplementedError,
        match=r"KFAC has no module extension for the layer '1' \(Scale\).*extension\(Scale",
    ):
        mb.install(*exts, model=model)
    assert not any(ext in mb._previous for ext in exts)  # the first one given back too


def test_routed_checks_each_block_before_the_forward_pass():
    model = extend(_tied_model())
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    with mb.routed(model=model), pytest.raises(ValueError, match=r"SqrtGGNExact.*'0', '2'"):
        with backpack(E.SqrtGGNExact()):
            model(_data()[0])
    assert not forwards


@pytest.mark.parametrize("budget", ["lean", None], ids=["chunked", "one-pass"])
def test_tied_layer_without_the_model_refused_in_the_backward_pass(budget):
    """Without ``model=`` the tie is found in the backward pass, before the layer's
    quantity; the message says how to have the path named."""
    model = extend(_tied_model())
    ext = mb.install(E.DiagGGNExact(), memory_budget=budget)
    x, y = _data()
    with (
        backpack(ext),
        pytest.raises(
            ValueError,
            match=r"Conv2d \(pass model= to install\(\) or routed\(\).*several calls.*untie",
        ),
    ):
        extend(nn.CrossEntropyLoss())(model(x), y).backward()
    mb.uninstall(ext)


def test_extension_hook_with_a_byte_budget_names_the_module():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Conv2d(2, 2, 3), nn.Flatten(), nn.Linear(8, 3)))
    ext = mb.install(E.DiagGGNExact(), memory_budget=2**20, model=model)
    x, y = _data()
    with (
        backpack(ext, extension_hook=lambda m: None),
        pytest.raises(
            ValueError,
            match=r"DiagGGNExact with memconv's memory_budget \(at .*extension_hook.*without",
        ),
    ):
        extend(nn.CrossEntropyLoss())(model(x), y).backward()
    mb.uninstall(ext)


def test_extension_hook_under_the_lean_default_runs_in_one_pass():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Conv2d(2, 2, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(8, 3)))
    lossfn = extend(nn.CrossEntropyLoss())
    x, y = _data()
    seen = []
    with mb.installed(E.DiagGGNExact()) as ext, backpack(ext, extension_hook=seen.append):
        lossfn(model(x), y).backward()
    hooked = model[0].weight.diag_ggn_exact.clone()
    assert seen
    with mb.installed(E.DiagGGNExact(), memory_budget=None) as ext, backpack(ext):
        lossfn(model(x), y).backward()
    torch.testing.assert_close(hooked, model[0].weight.diag_ggn_exact, rtol=1e-6, atol=0)


def test_loss_not_extended_names_the_module():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Conv2d(2, 2, 3), nn.Flatten(), nn.Linear(8, 3)))
    ext = mb.install(E.DiagGGNExact(), model=model)
    x, y = _data()
    with backpack(ext), pytest.raises(ValueError, match=r"reached '2' \(Linear\).*extend the loss"):
        nn.functional.cross_entropy(model(x), y).backward()
    mb.uninstall(ext)


def test_averaged_parameter_jacobian_refused_naming_the_layer():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Conv2d(2, 3, 4), nn.Flatten()))
    ext = E.KFLR()
    ext.ea_strategy = ExpectationApproximation.CHEN
    mb.install(ext, model=model)
    x, y = _data()
    with (
        backpack(ext),
        pytest.raises(NotImplementedError, match=r"KFLR on '0' \(Conv2d\).*BOTEV_MARTENS"),
    ):
        extend(nn.CrossEntropyLoss())(model(x), y).backward()
    mb.uninstall(ext)


@pytest.mark.parametrize("ext_cls", [E.DiagHessian, E.BatchDiagHessian, E.KFLR])
def test_a_byte_budget_an_extension_cannot_honour_warns(ext_cls):
    with pytest.warns(UserWarning, match=rf"cannot honour memory_budget=1000 .*{ext_cls.__name__}"):
        mb.uninstall(mb.install(ext_cls(), memory_budget=1000))


def test_lean_default_chunks_the_rows_and_equals_one_pass(caplog, monkeypatch):
    """The lean budget is the stored activations' bytes (its 16 MiB floor lowered here,
    so that this small model is chunked)."""
    from memconv.integrations.backpack import chunking

    monkeypatch.setattr(chunking, "LEAN_MIN_BYTES", 1)
    torch.manual_seed(0)
    model = extend(
        nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Sigmoid(), nn.Flatten(), nn.Linear(48, 40))
    ).double()
    lossfn = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(3, 2, 4, 4).double(), torch.tensor([0, 17, 39])
    with mb.installed(E.DiagGGNExact(), memory_budget=None) as ext, backpack(ext):
        lossfn(model(x), y).backward()
    one = {n: p.diag_ggn_exact.clone() for n, p in model.named_parameters()}
    with (
        caplog.at_level(logging.INFO, logger="memconv"),
        mb.installed(E.DiagGGNExact()) as ext,
        backpack(ext),
    ):
        lossfn(model(x), y).backward()
    assert "the 40 rows of the factor in" in caplog.text and "memory_budget lean" in caplog.text
    chunks = int(caplog.text.split("the 40 rows of the factor in ")[1].split(" ")[0])
    assert chunks > 1
    for name, p in model.named_parameters():
        scale = one[name].abs().max()
        assert (p.diag_ggn_exact - one[name]).abs().max() <= 1e-10 * scale


def test_lean_default_runs_a_small_model_in_one_chunk(caplog):
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 40)))
    with (
        caplog.at_level(logging.INFO, logger="memconv"),
        mb.installed(E.SqrtGGNExact()) as ext,
        backpack(ext),
    ):
        extend(nn.CrossEntropyLoss())(
            model(torch.randn(2, 2, 4, 4)), torch.tensor([1, 2])
        ).backward()
    assert (
        "the 40 rows of the factor in 1 chunk(s) of at most 40 (memory_budget lean" in caplog.text
    )
    assert model[0].weight.sqrt_ggn_exact.shape == (40, 2, 3, 2, 3, 3)


@pytest.mark.parametrize("ext_cls", [E.DiagGGNMC, E.DiagGGNExact])
def test_lean_default_runs_one_row_in_one_pass(ext_cls, monkeypatch):
    """One row per sample (MC with one sample, a model with one output): nothing is
    recorded for a replay, and the result is the one pass's."""
    from memconv.integrations.backpack import chunking

    replays = []
    monkeypatch.setattr(chunking, "_replay", lambda *a: replays.append(a))
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 1))).double()
    lossfn = extend(nn.MSELoss())
    x, y = torch.randn(3, 2, 4, 4).double(), torch.randn(3, 1).double()
    results = []
    for budget in ("lean", None):
        torch.manual_seed(7)
        with mb.installed(ext_cls(), memory_budget=budget) as ext, backpack(ext):
            lossfn(model(x), y).backward()
        results.append(getattr(model[0].weight, ext.savefield).clone())
    assert not replays
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=0)


def test_a_compiled_model_is_extended_through_its_module_with_a_warning():
    """``mb.extend(torch.compile(model))``: BackPACK's hooks would not run inside a
    compiled graph, so the module it wraps is extended and returned, with a warning;
    its quantities are the uncompiled model's (before: BackPACK's "missing the required
    forward function")."""

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3))
        return net.double()

    x, y = _data()
    x = x.double()
    results = []
    for compiled in (False, True):
        net = build()
        given = torch.compile(net, backend="eager") if compiled else net
        if compiled:
            with pytest.warns(RuntimeWarning, match="extended through the module it wraps"):
                model = mb.extend(given)
        else:
            model = mb.extend(given)
        loss_fn = extend(nn.CrossEntropyLoss())
        with mb.installed(E.DiagGGNExact()) as ext, backpack(ext):
            loss_fn(model(x), y).backward()
        results.append([p.diag_ggn_exact for p in net.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0)
