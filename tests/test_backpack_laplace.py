"""laplace-torch's BackPACK backends through ``memconv.integrations.backpack.routed()``.

laplace-torch builds its own extension objects inside its own ``with backpack(...)``
blocks; under ``routed()`` they run through memconv. Float64, equal to laplace-torch
without routing (and on a model converted by ``memconv.convert``). laplace-torch 0.3's
``BackPackEF`` has no ``"kron"`` structure (it raises "Unavailable through Backpack"
alone), so the settings are GGN diag and kron, EF diag.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from torch import nn

import memconv

pytest.importorskip("backpack")
if importlib.util.find_spec("laplace") is None:
    pytest.skip(
        "laplace-torch is not installed (make test installs it: laplace-torch, torchmetrics, "
        "lightning-utilities, curvlinops-for-pytorch, einconv, linear-operator, jaxtyping, "
        "wadler-lindig, all with --no-deps)",
        allow_module_level=True,
    )


def _stub_asdl():
    """laplace-torch 0.3 imports its ASDL backend unconditionally (``baselaplace.py``),
    and ASDL is not on the package index (the index's ``asdl`` is an unrelated
    parser): placeholders stand in for it, which these tests never call."""
    if importlib.util.find_spec("asdl") is not None:
        return
    for name in ("asdl", "asdl.fisher", "asdl.grad_maker", "asdl.gradient", "asdl.hessian"):
        module = types.ModuleType(name)
        module.__getattr__ = lambda attr: None
        sys.modules.setdefault(name, module)
    sys.modules.setdefault("asdl.matrices", sys.modules["asdl.hessian"])


_stub_asdl()
try:
    from laplace import Laplace
    from laplace.curvature import BackPackEF, BackPackGGN
except (ImportError, RuntimeError) as err:  # torchvision's registry wheel beside CPU torch
    pytest.skip(
        f"laplace-torch does not import here ({type(err).__name__}: {err}); torchmetrics "
        "imports torchvision whenever it is installed",
        allow_module_level=True,
    )

from memconv.integrations import backpack as mb  # noqa: E402

SETTINGS = [(BackPackGGN, "diag"), (BackPackGGN, "kron"), (BackPackEF, "diag")]


def _model():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 2, 3, stride=2),
        nn.Flatten(),
        nn.Linear(8, 3),
    ).double()


def _fit(model, backend, structure, routed):
    torch.manual_seed(0)
    x = torch.randn(12, 2, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    data = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure=structure,
        backend=backend,
    )
    if routed:
        with mb.routed():
            la.fit(loader)
    else:
        la.fit(loader)
    if structure == "diag":
        return la.H
    return torch.cat([f.flatten() for factors in la.H_facs.kfacs for f in factors])


@pytest.mark.filterwarnings("ignore:memconv does not cover the BackPACK extension")
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("backend,structure", SETTINGS, ids=lambda s: getattr(s, "__name__", s))
def test_laplace_through_routed_equals_alone(backend, structure, monkeypatch):
    import memconv.integrations.backpack.derivatives as derivatives

    calls = []
    real = derivatives.settings_for
    monkeypatch.setattr(derivatives, "settings_for", lambda m: calls.append(m) or real(m))
    import memconv.integrations.backpack.secondorder as secondorder

    monkeypatch.setattr(secondorder, "settings_for", derivatives.settings_for)
    alone = _fit(_model(), backend, structure, routed=False)
    assert not calls
    routed = _fit(_model(), backend, structure, routed=True)
    converted = _fit(memconv.convert(_model()), backend, structure, routed=True)
    if structure == "diag":  # memconv computed the convolutions' quantities
        assert calls
    scale = alone.abs().max()
    assert (routed - alone).abs().max() <= 1e-10 * scale
    assert (converted - alone).abs().max() <= 1e-10 * scale
