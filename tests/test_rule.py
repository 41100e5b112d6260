"""One rule on every path: a block applies to the layers whose forward pass runs in it.

Checked for the extended modules, per_sample_grads, the BackPACK integration and
backward passes run on another thread (where this thread's context variables are
not visible, as on CUDA's autograd device threads); and nothing is silent.
"""

import threading
import warnings

import pytest
import torch
from helpers import assert_grads_close, func_reference, rel_err
from torch import nn

import memconv


def model():
    torch.manual_seed(0)
    return memconv.convert(
        nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(4, 2, 2, stride=2),
            nn.Flatten(),
            nn.Linear(2 * 12 * 12, 3),
        ).double()
    )


@pytest.fixture
def batch():
    torch.manual_seed(1)
    return torch.randn(4, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))


def reference(m, x, y):
    return func_reference(m, nn.CrossEntropyLoss(reduction="sum"), x, y)


def test_forward_inside_backward_outside(batch, strategy_calls):
    x, y = batch
    m = model()
    with memconv.save_memory("rochette"), memconv.per_sample():
        loss = nn.CrossEntropyLoss(reduction="sum")(m(x), y)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*memconv")
        loss.backward()
    assert strategy_calls == [("rochette", True), ("rochette", True)]
    assert_grads_close(
        {n: p.grad_batch for n, p in m.named_parameters()}, reference(m, x, y), 1e-10
    )


@pytest.mark.filterwarnings("ignore:memconv.(save_memory|per_sample). no memconv layer ran")
def test_forward_outside_backward_inside_warns_and_does_not_apply(batch, strategy_calls):
    x, y = batch
    m = model()
    loss = nn.CrossEntropyLoss(reduction="sum")(m(x), y)
    with pytest.warns(UserWarning, match="runs inside a save_memory and a per_sample block"):
        with memconv.save_memory("rochette"), memconv.per_sample():
            loss.backward()
    assert strategy_calls == []  # torch's own kernels, as recorded at the forward pass
    assert all(not hasattr(p, "grad_batch") for p in m.parameters())


def test_backward_on_another_thread_uses_what_the_forward_recorded(batch, strategy_calls):
    x, y = batch
    m = model()
    with memconv.save_memory("shift"), memconv.per_sample():
        loss = nn.CrossEntropyLoss(reduction="sum")(m(x), y)
    seen = {}

    def backward():
        seen["strategy"] = memconv.current_strategy()  # this thread sees no block
        loss.backward()

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    assert seen["strategy"] == "auto"
    assert [name for name, _ in strategy_calls] == ["shift", "shift"]
    assert_grads_close(
        {n: p.grad_batch for n, p in m.named_parameters()}, reference(m, x, y), 1e-10
    )


def test_per_sample_grads_uses_the_block_open_when_called(batch, strategy_calls):
    x, y = batch
    m = model()
    with memconv.save_memory("unfold"):
        got = memconv.per_sample_grads(m, nn.CrossEntropyLoss(reduction="sum"), x, y)
    assert {name for name, _ in strategy_calls} == {"unfold"}
    strategy_calls.clear()
    memconv.per_sample_grads(m, nn.CrossEntropyLoss(reduction="sum"), x, y, strategy="rochette")
    assert {name for name, _ in strategy_calls} == {"rochette"}
    assert_grads_close(got, reference(m, x, y), 1e-10)


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_backpack_reads_what_the_forward_recorded(batch, strategy_calls):
    backpack = pytest.importorskip("backpack")
    from memconv.integrations import backpack as mb

    x, y = batch
    m = backpack.extend(model())
    with mb.installed(backpack.extensions.BatchGrad()) as ext, backpack.backpack(ext):
        with memconv.save_memory("rochette"):
            loss = nn.CrossEntropyLoss(reduction="sum")(m(x), y)
        thread = threading.Thread(target=loss.backward)  # BackPACK's hooks run there
        thread.start()
        thread.join()
    assert {name for name, _ in strategy_calls} == {"rochette"}
    ref = reference(model(), x, y)  # a twin without BackPACK's hooks
    assert rel_err(m[0].weight.grad_batch, ref["0.weight"]) < 1e-10
    assert rel_err(m[2].weight.grad_batch, ref["2.weight"]) < 1e-10


@pytest.mark.parametrize("block", ["per_sample", "save_memory"])
def test_a_block_no_memconv_layer_used_warns(batch, block):
    x, y = batch
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(48, 3)).double()
    opened = memconv.per_sample() if block == "per_sample" else memconv.save_memory("shift")
    with pytest.warns(UserWarning, match=rf"memconv.{block}: no memconv layer ran.*convert"):
        with opened:
            nn.CrossEntropyLoss()(plain(x), y).backward()
    assert not hasattr(plain[0].weight, "grad_batch")


def test_blocks_used_by_a_converted_model_say_nothing(batch):
    x, y = batch
    m = model()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*memconv")
        with memconv.save_memory("shift"), memconv.per_sample():
            nn.CrossEntropyLoss()(m(x), y).backward()
        with memconv.per_sample(False):  # switched off: nothing expected
            nn.CrossEntropyLoss()(m(x), y).backward()
