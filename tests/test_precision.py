"""Mixed and half precision on every path, against torch's own results.

Under ``torch.autocast`` (CPU bfloat16 here; CUDA float16 where a GPU is present)
and with half-precision parameters: the extended modules, ``per_sample_grads`` and
the BackPACK integration run, and match torch's per-sample results (one
``torch.autograd.grad`` per sample under the same autocast) within the dtype's
round-off.
"""

import warnings

import pytest
import torch
from helpers import rel_err
from torch import nn

import memconv

STRATEGIES = memconv.available_strategies()
DEVICES = [("cpu", torch.bfloat16)] + (
    [("cuda", torch.float16)] if torch.cuda.is_available() else []
)


def make(device, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.ConvTranspose2d(8, 4, 2, stride=2),
        nn.Flatten(),
        nn.Linear(4 * 16 * 16, 5),
    ).to(device=device, dtype=dtype)


def batch(device, dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(4, 3, 8, 8, device=device, dtype=dtype), torch.randint(
        0, 5, (4,), device=device
    )


LOSS = nn.CrossEntropyLoss(reduction="sum")


def loop_reference(model, x, y, autocast_dtype=None):
    """torch's per-sample gradients, one backward pass per sample."""
    device = x.device.type
    per = []
    for i in range(len(x)):
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = LOSS(model(x[i : i + 1]).float(), y[i : i + 1])
        per.append(torch.autograd.grad(loss, list(model.parameters())))
    return {
        n: torch.stack([g[j] for g in per]) for j, (n, _) in enumerate(model.named_parameters())
    }


def assert_close(got: dict, ref: dict, dtype):
    assert list(got) == list(ref)
    eps = torch.finfo(dtype).eps
    for name in ref:
        assert got[name].dtype == ref[name].dtype, name
        assert rel_err(got[name].float(), ref[name].float()) < 8 * eps, name


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_autocast_training_step_as_torch(device, dtype):
    """A converted model under autocast, no block: the same .grad as torch.nn's."""
    x, y = batch(device)
    plain, ours = make(device), memconv.convert(make(device))
    for model in (plain, ours):
        with torch.autocast(device, dtype=dtype):
            loss = LOSS(model(x).float(), y)
        loss.backward()
    assert_close(
        {n: p.grad for n, p in ours.named_parameters()},
        {n: p.grad for n, p in plain.named_parameters()},
        dtype,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("device, dtype", DEVICES)
def test_autocast_per_sample_every_route(device, dtype, strategy):
    x, y = batch(device)
    ref = loop_reference(make(device), x, y, dtype)
    with torch.autocast(device, dtype=dtype):
        got = memconv.per_sample_grads(
            make(device), lambda o, t: LOSS(o.float(), t), x, y, strategy=strategy
        )
    assert_close(got, ref, dtype)
    model = memconv.convert(make(device))
    with torch.autocast(device, dtype=dtype), memconv.save_memory(strategy), memconv.per_sample():
        loss = LOSS(model(x).float(), y)
    loss.backward()
    assert_close({n: p.grad_batch for n, p in model.named_parameters()}, ref, dtype)


@pytest.mark.parametrize("device, dtype", DEVICES)
def test_autocast_backpack(device, dtype):
    backpack = pytest.importorskip("backpack")
    from memconv.integrations import backpack as mb

    x, y = batch(device)
    ref = loop_reference(make(device), x, y, dtype)
    model = backpack.extend(memconv.convert(make(device)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BackPACK's full backward hooks
        with mb.installed(backpack.extensions.BatchGrad()) as ext, backpack.backpack(ext):
            with torch.autocast(device, dtype=dtype), memconv.save_memory("shift"):
                loss = LOSS(model(x).float(), y)
            loss.backward()
    for name in ("0.weight", "3.weight"):
        got = dict(model.named_parameters())[name].grad_batch
        assert rel_err(got.float(), ref[name]) < 8 * torch.finfo(dtype).eps, name


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_half_precision_parameters(param_dtype, strategy):
    x, y = batch("cpu", param_dtype)
    ref = loop_reference(make("cpu", param_dtype), x, y)
    got = memconv.per_sample_grads(make("cpu", param_dtype), LOSS, x, y, strategy=strategy)
    # half-precision sums of ~500 products: within a few dozen units in the last place
    eps = torch.finfo(param_dtype).eps
    for name in ref:
        assert got[name].dtype == param_dtype
        assert rel_err(got[name].float(), ref[name].float()) < 64 * eps, name
    model = memconv.convert(make("cpu", param_dtype))
    with memconv.save_memory(strategy), memconv.per_sample():
        loss = LOSS(model(x), y)
    loss.backward()
    for name, p in model.named_parameters():
        assert rel_err(p.grad_batch.float(), ref[name].float()) < 64 * eps, name
