"""Opacus' own example scripts, changed only on the ``make_private`` line.

The models of Opacus' ``examples/mnist.py`` (``SampleConvNet``) and ``examples/cifar10.py``
(its ``convnet``) are in the benchmark's zoo (:mod:`memconv.bench.models`), written as
those scripts write them; their training loops (the plain one; ``optimizer.step()``
then ``zero_grad()``, optionally inside Opacus' ``BatchMemoryManager``) are here, with tensors of the datasets' shapes made locally. Each runs
a few steps through Opacus' own ``PrivacyEngine.make_private`` (hooks, or ghost
clipping where Opacus runs it) and through memconv's ``mo.make_private`` with the
same seed and no noise; the parameters must agree, in float64. Opacus clips by
C/(‖g‖ + 10⁻⁶), memconv by C/‖g‖ exactly, hence the tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

opacus = pytest.importorskip("opacus")
from opacus import PrivacyEngine  # noqa: E402
from opacus.utils.batch_memory_manager import BatchMemoryManager  # noqa: E402

from memconv.bench.models import OpacusMnistCNN as SampleConvNet  # noqa: E402
from memconv.bench.models import opacus_cifar10_convnet as convnet  # noqa: E402
from memconv.integrations import opacus as mo  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),  # seeded on purpose
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:Optimal order is"),
]

#: Opacus' stabiliser in C/(‖g‖ + 1e-6) moves a clipped sample's share by ~1e-6/‖g‖.
TOL = 1e-6


def mnist_train(model, device, train_loader, optimizer, criterion):
    """examples/mnist.py's ``train``: zero_grad, forward, criterion, backward, step (the
    criterion: the script's ``nn.CrossEntropyLoss()``, or the one ghost clipping returns)."""
    model.train()
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()


def cifar10_train(model, train_loader, optimizer, device, criterion):
    """examples/cifar10.py's ``train``: forward, criterion, backward, then step and
    zero_grad (the script's order)."""
    model.train()
    for images, target in train_loader:
        images = images.to(device)
        target = target.to(device)
        output = model(images)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _data(shape: tuple, n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=g))


def _run(
    make_private, example: str, *, mode: str, dropout: float = 0.0, physical=None, compiled=False
):
    """A few steps of the example, its ``make_private`` line calling ``make_private``
    (on ``torch.compile(model)`` with ``compiled``)."""
    torch.manual_seed(0)
    if example == "mnist":
        model, data, lr = SampleConvNet(dropout).double(), _data((1, 28, 28)), 0.1
    else:
        model, data, lr = convnet(10).double(), _data((3, 32, 32)), 0.05
    base = model
    optimizer = optim.SGD(model.parameters(), lr=lr)
    train_loader = DataLoader(data, batch_size=32)
    privacy_engine = PrivacyEngine()
    out = make_private(
        privacy_engine,
        module=torch.compile(model, backend="aot_eager") if compiled else model,
        optimizer=optimizer,
        data_loader=train_loader,
        noise_multiplier=0.0,
        max_grad_norm=0.05,
        grad_sample_mode=mode,
    )
    model, optimizer, train_loader = out[0], out[1], out[-1]
    # ghost clipping returns four values, the criterion third (the scripts' own otherwise)
    criterion = out[2] if len(out) == 4 else nn.CrossEntropyLoss()
    torch.manual_seed(1)  # the Poisson batches and the dropout masks
    if physical is not None:
        with BatchMemoryManager(
            data_loader=train_loader, max_physical_batch_size=physical, optimizer=optimizer
        ) as memory_safe_data_loader:
            cifar10_train(model, memory_safe_data_loader, optimizer, "cpu", criterion)
    elif example == "mnist":
        mnist_train(model, "cpu", train_loader, optimizer, criterion)
    else:
        cifar10_train(model, train_loader, optimizer, "cpu", criterion)
    if compiled:  # the private module ran the compiled halves
        traced = model._clipping._prepared.traced
        assert sum(s.calls for s in traced.splits.values()) > 0
    return {k: v.detach().clone() for k, v in base.named_parameters()}, privacy_engine


def _opacus(privacy_engine, **kwargs):
    return privacy_engine.make_private(criterion=nn.CrossEntropyLoss(), **kwargs)


@pytest.mark.parametrize(
    "example, mode, dropout, physical, compiled",
    [
        ("mnist", "hooks", 0.0, None, False),
        ("mnist", "hooks", 0.3, None, False),  # dropout: the mask of the one forward pass
        ("mnist", "ghost", 0.0, None, False),
        ("cifar10", "hooks", 0.0, None, False),
        ("cifar10", "hooks", 0.0, 8, False),  # BatchMemoryManager: physical batches of 8
        # the script's model compiled: its physical batches of 8 run the compiled halves
        ("cifar10", "hooks", 0.0, 8, True),
    ],
)
def test_the_example_gives_opacus_parameters(example, mode, dropout, physical, compiled):
    kwargs = dict(mode=mode, dropout=dropout, physical=physical)
    want, engine = _run(_opacus, example, **kwargs)
    got, ours = _run(mo.make_private, example, compiled=compiled, **kwargs)
    for k in want:
        scale = want[k].abs().max()
        assert (got[k] - want[k]).abs().max() <= TOL * scale, k
    # the same steps for the accountant
    assert ours.accountant.history == engine.accountant.history
