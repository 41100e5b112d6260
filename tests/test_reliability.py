"""Reliability: configurations, dtypes, autograd contracts, concurrency, no state left.

The soak test (200 iterations, allocator-level flatness) is marked slow:
``make test-slow``.
"""

import asyncio
import gc
import threading
import warnings
import weakref

import pytest
import torch
from helpers import conv_case, func_reference, reference_weight_grads, rel_err
from torch import nn

import memconv

STRATEGIES = memconv.available_strategies()
TOL = 1e-10


def pair(dims=2, dtype=torch.float64, **kwargs):
    """A torch convolution and a memconv copy of it with the same parameters."""
    torch.manual_seed(0)
    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    ref = cls(4, 6, 3, **kwargs).to(dtype)
    ours = {1: memconv.Conv1d, 2: memconv.Conv2d, 3: memconv.Conv3d}[dims](4, 6, 3, **kwargs).to(
        dtype
    )
    ours.load_state_dict(ref.state_dict())
    return ref, ours


# ---------------------------------------------------------------- configurations
@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_padding_modes_in_extended_modules(mode, strategy):
    ref, ours = pair(padding=2, padding_mode=mode, groups=2)
    x = torch.randn(3, 4, 9, 8, dtype=torch.float64)
    with torch.no_grad():
        ones = torch.ones_like(ref(x))
    per = reference_weight_grads(ref, x, ones)
    with memconv.save_memory(strategy), memconv.per_sample():
        ours(x).sum().backward()
    ref(x).sum().backward()
    assert rel_err(ours.weight.grad, ref.weight.grad) < TOL
    assert rel_err(ours.weight.grad_batch, per) < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_half_precision_within_round_off(dtype, strategy):
    m, x, g = conv_case(2, 3, 4, 8, 3, 10, padding=1, groups=2, dtype=torch.float32)
    ref = reference_weight_grads(m, x, g)  # torch, float32
    got = memconv.weight_vjp(m.to(dtype), x.to(dtype), g.to(dtype), strategy=strategy)
    assert got.dtype == dtype
    eps = torch.finfo(dtype).eps
    # sums of 4·9·100 products: a few hundred units in the last place at most
    assert rel_err(got.float(), ref) < 300 * eps


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_channels_last_and_non_contiguous_modules(strategy):
    ref, ours = pair(padding=1)
    x = torch.randn(2, 4, 7, 9, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    xt = torch.randn(2, 4, 9, 7, dtype=torch.float64).transpose(2, 3)  # non-contiguous
    for inp in (x, xt):
        ours.zero_grad()
        ref.zero_grad()
        with memconv.save_memory(strategy), memconv.per_sample():
            ours(inp).pow(2).sum().backward()
        ref(inp).pow(2).sum().backward()
        assert rel_err(ours.weight.grad, ref.weight.grad) < TOL
        assert rel_err(ours.weight.grad_batch.sum(0), ref.weight.grad) < TOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_n_zero_and_n_one_through_modules(strategy):
    ref, ours = pair()
    for n in (0, 1):
        x = torch.randn(n, 4, 6, 6, dtype=torch.float64, requires_grad=True)
        with memconv.save_memory(strategy), memconv.per_sample():
            y = ours(x)
            y.sum().backward()
        assert ours.weight.grad_batch.shape == (n, 6, 4, 3, 3)
        assert x.grad.shape == x.shape
        ours.zero_grad()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_requires_grad_false_on_weight_or_bias(strategy):
    for frozen in ("weight", "bias"):
        ref, ours = pair()
        getattr(ours, frozen).requires_grad_(False)
        getattr(ref, frozen).requires_grad_(False)
        x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
        with memconv.save_memory(strategy), memconv.per_sample():
            ours(x).sum().backward()
        ref(x).sum().backward()
        assert getattr(ours, frozen).grad is None
        assert not hasattr(getattr(ours, frozen), "grad_batch")
        live = "bias" if frozen == "weight" else "weight"
        assert rel_err(getattr(ours, live).grad, getattr(ref, live).grad) < TOL


def test_frozen_layer_in_the_middle():
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)
    ).double()
    ours = memconv.convert(nn.Sequential(*[m for m in plain]))
    ours_copy = memconv.convert(
        nn.Sequential(
            nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)
        ).double()
    )
    ours_copy.load_state_dict(plain.state_dict())
    for m in (plain, ours_copy):
        m[2].requires_grad_(False)
    x = torch.randn(3, 2, 10, 10, dtype=torch.float64)
    plain(x).sum().backward()
    with memconv.save_memory("shift"), memconv.per_sample():
        ours_copy(x).sum().backward()
    assert ours_copy[2].weight.grad is None
    for i in (0, 4):
        assert rel_err(ours_copy[i].weight.grad, plain[i].weight.grad) < TOL
    del ours


# ---------------------------------------------------------------- autograd contracts
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_retain_graph_accumulates_like_torch(strategy):
    ref, ours = pair(stride=2)
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64)
    with memconv.save_memory(strategy):
        y = ours(x).pow(2).sum()
        y.backward(retain_graph=True)
        y.backward()
    z = ref(x).pow(2).sum()
    z.backward(retain_graph=True)
    z.backward()
    assert rel_err(ours.weight.grad, ref.weight.grad) < TOL
    assert rel_err(ours.bias.grad, ref.bias.grad) < TOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_create_graph_double_backward(strategy):
    """Gradient-norm penalty (double backward) through the strategies equals torch's."""
    ref, ours = pair(padding=1, groups=2)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)

    def penalty(module):
        (gw,) = torch.autograd.grad(module(x).pow(2).sum(), module.weight, create_graph=True)
        return gw.pow(2).sum()

    with memconv.save_memory(strategy):
        (h_ours,) = torch.autograd.grad(penalty(ours), ours.weight)
    (h_ref,) = torch.autograd.grad(penalty(ref), ref.weight)
    assert rel_err(h_ours, h_ref) < 1e-9


def test_no_grad_forward_keeps_nothing():
    _, ours = pair()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        y = ours(x)
    assert y.grad_fn is None
    x_ref = weakref.ref(x)
    del x, y
    gc.collect()
    assert x_ref() is None  # nothing holds the input


def test_graph_released_after_backward():
    _, ours = pair()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    with memconv.save_memory("rochette"), memconv.per_sample():
        y = ours(x)
        fn = weakref.ref(y.grad_fn)
        y.sum().backward()
    x_ref = weakref.ref(x)
    del x, y
    gc.collect()
    assert fn() is None and x_ref() is None


def test_other_libraries_hooks_keep_working():
    ref, ours = pair(padding=1)
    seen = {}

    def recorder(key, fn):
        def hook(*args):
            seen[key] = fn(*args)  # returns None: the output is left alone

        return hook

    for name, m in (("ref", ref), ("ours", ours)):
        m.register_forward_hook(recorder(name + "-fwd", lambda mod, a, o: o.detach().clone()))
        m.register_full_backward_hook(
            recorder(name + "-bwd", lambda mod, gi, go: (gi[0].clone(), go[0].clone()))
        )
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    ref(x).pow(2).sum().backward()
    with memconv.save_memory("unfold"), memconv.per_sample():
        ours(x).pow(2).sum().backward()
    assert torch.equal(seen["ref-fwd"], seen["ours-fwd"])
    for a, b in zip(seen["ref-bwd"], seen["ours-bwd"]):
        assert rel_err(a, b) < TOL


def test_opacus_hooks_on_memconv_modules():
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(0)
    model = memconv.convert(nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 16, 2)))
    x, y = torch.randn(4, 2, 6, 6), torch.tensor([0, 1, 1, 0])
    ref = func_reference(model, nn.CrossEntropyLoss(reduction="sum"), x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = opacus.GradSampleModule(model, loss_reduction="sum")
        with memconv.save_memory("shift"):
            nn.CrossEntropyLoss(reduction="sum")(gsm(x), y).backward()
    assert rel_err(model[0].weight.grad_sample, ref["0.weight"]) < 1e-5
    gsm._close()


# ---------------------------------------------------------------- concurrency
@pytest.mark.filterwarnings("ignore:memconv.save_memory. no memconv layer ran")
def test_threads_do_not_see_each_others_setting():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name, strategy):
        with memconv.save_memory(strategy):
            barrier.wait()
            seen[name] = memconv.current_strategy()
            barrier.wait()
        seen[name + "-after"] = memconv.current_strategy()

    threads = [
        threading.Thread(target=worker, args=(n, s)) for n, s in (("a", "unfold"), ("b", "shift"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "unfold", "b": "shift", "a-after": "auto", "b-after": "auto"}
    assert memconv.current_strategy() == "auto"


@pytest.mark.filterwarnings("ignore:memconv.save_memory. no memconv layer ran")
def test_asyncio_tasks_do_not_see_each_others_setting():
    async def task(strategy, delay):
        with memconv.save_memory(strategy):
            await asyncio.sleep(delay)
            return memconv.current_strategy()

    async def main():
        return await asyncio.gather(task("rochette", 0.02), task("streaming", 0.01))

    assert asyncio.run(main()) == ["rochette", "streaming"]
    assert memconv.current_strategy() == "auto"


@pytest.mark.filterwarnings("ignore:memconv.save_memory. no memconv layer ran")
def test_exception_restores_and_nesting_restores_in_order():
    with pytest.raises(RuntimeError):
        with memconv.save_memory("unfold"):
            raise RuntimeError("boom")
    assert memconv.current_strategy() == "auto"
    order = []
    with memconv.save_memory("rochette"):
        with memconv.save_memory("streaming", tile_size=3):
            order.append(memconv.current_strategy())
        order.append(memconv.current_strategy())
    order.append(memconv.current_strategy())
    assert order == ["streaming", "rochette", "auto"]

    @memconv.save_memory("unfold")
    def decorated(depth):
        if depth:
            return decorated(depth - 1)
        return memconv.current_strategy()

    assert decorated(3) == "unfold" and memconv.current_strategy() == "auto"


# ---------------------------------------------------------------- soak (slow)
def _live_bytes_per_iteration(step, iterations):
    """Allocator-level live bytes at the end of each iteration (PyTorch profiler)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(iterations):
            step()
            with record_function("memconv-iteration-end"):
                pass
    events = prof.profiler.kineto_results.events()
    marks = sorted(e.start_ns() for e in events if e.name() == "memconv-iteration-end")
    allocs = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live, out, i = 0, [], 0
    for mark in marks:
        while i < len(allocs) and allocs[i][0] <= mark:
            live += allocs[i][1]
            i += 1
        out.append(live)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES + ("streaming-cnn",))
def test_soak_200_iterations_flat(strategy):
    torch.manual_seed(0)
    model = memconv.convert(
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3),
            nn.Flatten(),
        )
    )
    x = torch.randn(8, 3, 32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if strategy == "streaming-cnn":
        from memconv.streaming import StreamingCNN

        stream = StreamingCNN(model[:4], tile_size=16)

        def step():
            opt.zero_grad()
            stream(x).pow(2).mean().backward()
            opt.step()

    else:

        def step():
            opt.zero_grad()
            with memconv.save_memory(strategy), memconv.per_sample():
                model(x).pow(2).mean().backward()
            opt.step()

    live = _live_bytes_per_iteration(step, 200)
    settled = live[20:]
    assert max(settled) - min(settled) <= 64 * 1024, (min(settled), max(settled))
