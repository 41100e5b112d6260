"""PrivateStep: what a call prepares is reused while nothing it depends on changes, made
again when anything does, and the numbers are always those of a fresh call."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from helpers import assert_grads_close, loop_reference, rel_err
from torch import nn

import memconv
from memconv.engine.losses import per_sample_losses

TOL = 1e-9


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    ).double()


def batch(n=5, shape=(6,), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def clipped_reference(model, loss_fn, x, y, max_norm):
    ref = loop_reference(model, loss_fn, x, y)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    c = torch.clamp(max_norm / norms, max=1.0)
    return {k: torch.einsum("n,n...->...", c, g) for k, g in ref.items()}, norms


def check_grads(step, model, loss_fn, x, y):
    assert_grads_close(step.per_sample_grads(x, y), loop_reference(model, loss_fn, x, y), TOL)


def forwards(model):
    """A counter of the model's forward passes (a hook on the top module)."""
    count = [0]
    model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


@pytest.mark.parametrize("budget", [None, "available", 2**30])
def test_steady_state_runs_one_forward_and_reuses_probe_and_plan(budget):
    model, loss_fn = mlp(), nn.CrossEntropyLoss()
    count = forwards(model)
    step = memconv.PrivateStep(model, loss_fn, memory_budget=budget)
    for seed in range(4):  # new data every step, same shapes (losses by vmap)
        x, y = batch(20, seed=seed)
        check_grads(step, model, loss_fn, x, y)
        assert_grads_close(
            step.per_sample_grads(x, y), memconv.per_sample_grads(model, loss_fn, x, y), TOL
        )
    assert step.probes == 1 and step.plans == 1
    count[0] = 0
    step.per_sample_grads(*batch(20, seed=9))
    assert count[0] == 1  # no probe: the walk's one forward pass


def test_reused_plan_clips_as_a_fresh_one():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss_fn, memory_budget=None)
    for seed in range(3):
        x, y = batch(4, (1, 7, 7), seed=seed)
        for p in model.parameters():
            p.grad = None
        norms = step.clip_and_accumulate(x, y, max_norm=0.05)
        got = {k: p.grad.clone() for k, p in model.named_parameters()}
        ref, ref_norms = clipped_reference(model, loss_fn, x, y, 0.05)
        assert_grads_close(got, ref, TOL)
        assert torch.allclose(norms.double(), ref_norms, rtol=1e-9)
        assert torch.allclose(step.per_sample_norms(x, y).double(), ref_norms, rtol=1e-9)
        with torch.no_grad():  # a training step: the values change, nothing else
            for p in model.parameters():
                p -= 0.1 * p.grad
    assert step.probes == 1


def _freeze(step, model):
    model[0].weight.requires_grad_(False)


def _replace_layer(step, model):
    model[2] = nn.Linear(8, 3).double()


def _new_parameter(step, model):
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())


def _mode(step, model):
    model.eval()


def _hook(step, model):
    model[0].register_forward_hook(lambda module, args, out: out * 2)


def _new_model(step, model):
    step.model = mlp(seed=3)


@pytest.mark.parametrize(
    "change", [_freeze, _replace_layer, _new_parameter, _mode, _hook, _new_model]
)
def test_a_model_change_makes_a_new_probe(change):
    model, loss_fn = mlp(), nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss_fn)
    x, y = batch()
    step.per_sample_grads(x, y)
    before = step.plan
    change(step, model)
    check_grads(step, step.model, loss_fn, x, y)
    assert step.probes == 2 and step.plan is not before


@pytest.mark.parametrize(
    "inputs",
    [
        batch(7),  # another N: a new plan on the same probe
        batch(5, (6,)),  # the same: nothing new
    ],
)
def test_batch_size_makes_a_new_plan_only(inputs):
    model, loss_fn = mlp(), nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss_fn)
    step.per_sample_grads(*batch())
    check_grads(step, model, loss_fn, *inputs)
    assert step.probes == 1
    assert step.plans == (2 if len(inputs[0]) != 5 else 1)


def test_sample_shape_and_dtype_make_a_new_probe():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss_fn)
    step.per_sample_grads(*batch(3, (1, 7, 7)))
    check_grads(step, model, loss_fn, *batch(3, (1, 9, 8)))
    assert step.probes == 2
    model.float()  # the parameters' dtype, and the inputs'
    x, y = batch(3, (1, 9, 8))
    got = step.per_sample_grads(x.float(), y)
    assert step.probes == 3
    assert all(g.dtype == torch.float32 for g in got.values())


def _loss(step):
    step.loss_fn = nn.MultiMarginLoss()


def _strategy(step):
    step.strategy = "rochette"


def _budget(step):
    step.memory_budget = 2**30


def _routes(step):
    step.norm_route = "instantiate"


@pytest.mark.parametrize("change", [_loss, _strategy, _budget, _routes])
def test_a_settings_change_makes_a_new_plan(change):
    model = cnn()
    step = memconv.PrivateStep(model, nn.CrossEntropyLoss())
    x, y = batch(4, (1, 7, 7))
    step.per_sample_norms(x, y)
    before = step.plans
    change(step)
    got = step.per_sample_norms(x, y)
    ref = loop_reference(model, step.loss_fn, x, y)
    ref_norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    assert torch.allclose(got.double(), ref_norms, rtol=1e-9)
    # the plan does not read the loss: another loss keeps it (and makes its evaluation anew)
    assert step.plans == before + (change is not _loss) and step.probes == 1


def test_an_open_block_makes_a_new_plan():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss_fn)
    x, y = batch(4, (1, 7, 7))
    step.per_sample_grads(x, y)
    with memconv.save_memory("rochette"):
        check_grads(step, model, loss_fn, x, y)
    assert step.plans == 2


def test_a_tight_budget_micro_batches_exactly():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss_fn, memory_budget=None)
    x, y = batch(16, (1, 9, 9))
    step.per_sample_grads(x, y)
    free = step.plan.predicted_peak
    step.memory_budget = int(free * 0.6)
    check_grads(step, model, loss_fn, x, y)
    assert step.plan.micro_batch < 16
    for p in model.parameters():
        p.grad = None
    step.clip_and_accumulate(x, y, max_norm=0.1)
    ref, _ = clipped_reference(model, loss_fn, x, y, 0.1)
    assert_grads_close({k: p.grad for k, p in model.named_parameters()}, ref, TOL)


def test_a_shape_change_without_a_state_change_is_caught():
    # the layer's output shape changes, nothing in the model's state does
    torch.manual_seed(0)

    class Repeat(nn.Module):
        def __init__(self):
            super().__init__()
            self.times = 1
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x.repeat(1, self.times, 1)).sum(1)

    model = nn.Sequential(Repeat(), nn.Linear(4, 2)).double()
    loss_fn = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss_fn)
    x = torch.randn(3, 1, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (3,))
    step.per_sample_grads(x, y)
    model[0].times = 3
    check_grads(step, model, loss_fn, x, y)
    assert step.probes == 2


def test_losses_in_one_vmap_evaluation_exactly():
    out = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 4, (20,))
    calls = [0]

    def loss_fn(o, t):
        calls[0] += 1
        return nn.functional.cross_entropy(o, t, label_smoothing=0.1)

    got = per_sample_losses(loss_fn, out, y)
    assert calls[0] == 1
    ref = per_sample_losses(loss_fn, out, y, vectorise=False)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    (g1,) = torch.autograd.grad(got.sum(), out)
    (g2,) = torch.autograd.grad(ref.sum(), out)
    assert torch.allclose(g1, g2, rtol=0, atol=1e-12)


def test_a_loss_vmap_cannot_take_falls_back_once_with_a_warning():
    model = mlp()
    calls = [0]

    def loss_fn(o, t):
        calls[0] += 1
        if o.sum().item() > 1e9:  # a value read: vmap cannot take it
            raise AssertionError
        return nn.functional.cross_entropy(o, t)

    step = memconv.PrivateStep(model, loss_fn)
    x, y = batch(20)
    with pytest.warns(UserWarning, match="cannot be vectorised"):
        check_grads(step, model, loss_fn, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calls[0] = 0
        step.per_sample_grads(x, y)  # not tried again: no warning, one call per sample
    assert calls[0] == len(x)


def test_bad_arguments_raise_before_any_work():
    model, loss_fn = mlp(), nn.CrossEntropyLoss()
    with pytest.raises(TypeError, match="model"):
        memconv.PrivateStep("model", loss_fn)
    with pytest.raises(TypeError, match="loss_fn"):
        memconv.PrivateStep(model, 3)
    with pytest.raises(ValueError, match="strategy"):
        memconv.PrivateStep(model, loss_fn, strategy="nope")
    with pytest.raises(ValueError, match="memory_budget"):
        memconv.PrivateStep(model, loss_fn, memory_budget=-1)
    with pytest.raises(ValueError, match="clip_route"):
        memconv.PrivateStep(model, loss_fn, clip_route="nope")
    with pytest.raises(ValueError, match="norm_route"):
        memconv.PrivateStep(model, loss_fn, norm_route="nope")
    step = memconv.PrivateStep(model, loss_fn)
    with pytest.raises(ValueError, match="max_norm"):
        step.clip_and_accumulate(*batch(), max_norm=-1.0)
    assert all(p.grad is None for p in model.parameters())


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


CLASS_LOSSES = [
    nn.CrossEntropyLoss(),
    nn.CrossEntropyLoss(reduction="sum"),
    nn.CrossEntropyLoss(weight=torch.rand(7, dtype=torch.float64), reduction="sum"),
    nn.CrossEntropyLoss(ignore_index=3),
    nn.functional.cross_entropy,
    nn.NLLLoss(),
    nn.NLLLoss(reduction="sum"),
    nn.functional.nll_loss,
]


def _name(loss_fn):
    return getattr(loss_fn, "__name__", None) or f"{type(loss_fn).__name__}-{loss_fn.reduction}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 8, 17, 64])
@pytest.mark.parametrize("loss_fn", CLASS_LOSSES, ids=_name)
def test_batched_class_losses_equal_the_per_sample_loop_exactly(loss_fn, n, dtype):
    g = torch.Generator().manual_seed(n)
    logits = (3 * torch.randn(n, 7, generator=g)).to(dtype).requires_grad_()
    y = torch.randint(0, 7, (n,), generator=g)
    y[::5] = getattr(loss_fn, "ignore_index", -100)  # ignored targets: NaN under "mean"
    if isinstance(loss_fn, nn.Module) and loss_fn.weight is not None:
        loss_fn = nn.CrossEntropyLoss(weight=loss_fn.weight.to(dtype), reduction="sum")
    out = logits.log_softmax(1) if "nll" in _name(loss_fn).lower() else logits
    got = memconv.engine.losses.batched(loss_fn, out, y)
    ref = per_sample_losses(loss_fn, out, y, vectorise=False)
    assert got is not None
    _same(got, ref)
    w = torch.rand(n, generator=g).to(dtype)
    for a, b in [(got, ref), (got * w, ref * w)]:
        _same(*(torch.autograd.grad(v.sum(), logits, retain_graph=True)[0] for v in (a, b)))


@pytest.mark.parametrize("shape", [(9,), (9, 1)])
@pytest.mark.parametrize(
    "loss_fn",
    [nn.MSELoss(), nn.MSELoss(reduction="sum"), nn.L1Loss(), nn.functional.mse_loss],
    ids=_name,
)
def test_batched_element_losses_equal_the_per_sample_loop_exactly(loss_fn, shape):
    g = torch.Generator().manual_seed(0)
    out = torch.randn(shape, generator=g, requires_grad=True)
    t = torch.randn(shape, generator=g)
    got = memconv.engine.losses.batched(loss_fn, out, t)
    ref = per_sample_losses(loss_fn, out, t, vectorise=False)
    assert got is not None
    _same(got, ref)
    _same(*(torch.autograd.grad(v.sum(), out, retain_graph=True)[0] for v in (got, ref)))


def test_losses_the_batched_call_does_not_take_go_the_general_way():
    out, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    batched = memconv.engine.losses.batched
    assert batched(nn.CrossEntropyLoss(label_smoothing=0.1), out, y) is None
    assert batched(nn.CrossEntropyLoss(weight=torch.rand(3)), out, y) is None  # mean: ÷ weight
    assert batched(nn.CrossEntropyLoss(reduction="none"), out, y) is None
    assert batched(nn.CrossEntropyLoss(), out, torch.rand(4, 3)) is None  # probabilities
    assert batched(nn.CrossEntropyLoss(), torch.randn(4, 3, 5), torch.zeros(4, 5).long()) is None
    assert batched(nn.MSELoss(), torch.randn(4, 2), torch.randn(4, 2)) is None  # 2 per sample
    assert batched(nn.MSELoss(), torch.randn(4, 1), torch.randn(4)) is None  # broadcasts
    assert batched(nn.BCEWithLogitsLoss(), torch.randn(4), torch.rand(4)) is None

    class Mine(nn.CrossEntropyLoss):  # a subclass may compute something else
        pass

    assert batched(Mine(), out, y) is None
    assert batched(lambda o, t: nn.functional.cross_entropy(o, t), out, y) is None
    hooked = nn.CrossEntropyLoss()
    handle = hooked.register_forward_hook(lambda *_: None)
    assert batched(hooked, out, y) is None
    handle.remove()
    assert batched(hooked, out, y) is not None


def test_the_batched_loss_is_one_call_and_the_same_gradients_as_the_loop(monkeypatch):
    calls = [0]
    cross_entropy = nn.functional.cross_entropy

    def counted(*args, **kwargs):
        calls[0] += 1
        return cross_entropy(*args, **kwargs)

    monkeypatch.setattr(nn.functional, "cross_entropy", counted)
    for make, shape in [(mlp, (6,)), (cnn, (1, 6, 6))]:
        model = make()
        x, y = batch(8, shape)
        loss_fn = nn.CrossEntropyLoss()
        step = memconv.PrivateStep(model, loss_fn)
        loop = memconv.PrivateStep(model, lambda o, t, f=loss_fn: f(o, t))  # the loop (N < 16)
        calls[0] = 0
        got = step.per_sample_grads(x, y)
        assert calls[0] == 1
        ref = loop.per_sample_grads(x, y)
        assert calls[0] == 1 + len(x)
        for k in ref:
            assert torch.equal(got[k], ref[k])
        model.zero_grad()
        norms = step.clip_and_accumulate(x, y, max_norm=0.1)
        sums = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad()
        assert torch.equal(norms, loop.clip_and_accumulate(x, y, max_norm=0.1))
        for k, p in model.named_parameters():
            assert torch.equal(sums[k], p.grad)


def test_a_changed_loss_is_seen_on_the_next_step():
    model, loss_fn = mlp(), nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss_fn)
    x, y = batch(8)
    check_grads(step, model, loss_fn, x, y)
    loss_fn.label_smoothing = 0.2  # no longer batched: the loop, with the smoothing
    check_grads(step, model, loss_fn, x, y)
    loss_fn.label_smoothing = 0.0
    loss_fn.weight = torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)
    loss_fn.reduction = "sum"  # a weighted sum: batched, weighted
    check_grads(step, model, loss_fn, x, y)
    loss_fn.reduction = "none"  # not a scalar per sample: the loop says so
    with pytest.raises(ValueError, match="scalar"):
        step.per_sample_grads(x, y)
    loss_fn.reduction = "mean"
    calls = [0]
    handle = loss_fn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    check_grads(step, model, loss_fn, x, y)  # hooked: called per sample, as the loop does
    assert calls[0] >= len(x)
    handle.remove()


class _PosTwice(nn.Module):
    """A position embedding added twice (its per-sample gradient is the sum of two
    output gradients, each of the batch's shape) and a weight tied across two layers."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 5, 4, dtype=torch.float64))
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 4).double()
        self.b.weight = self.a.weight
        self.head = nn.Linear(20, 3).double()

    def forward(self, x):
        h = torch.tanh(self.a(x + self.pos))
        h = self.b(h + self.pos)
        return self.head(h.flatten(1))


def test_results_taken_without_a_copy_are_exact_and_leave_autograd_alone():
    """The whole batch in one pass: a route's result becomes the returned tensor
    itself; parameters with several uses and results equal to an output gradient stay
    exact, and a later backward pass of the model is unaffected."""
    torch.manual_seed(0)
    model = _PosTwice()
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    want = loop_reference(model, loss, x, y)
    step = memconv.PrivateStep(model, loss, memory_budget=None)
    for _ in range(2):
        got = step.per_sample_grads(x, y)
        assert_grads_close(got, want, 1e-10)
    model.zero_grad()
    loss(model(x), y).backward()
    for name, p in model.named_parameters():
        assert rel_err(p.grad, want[name].sum(0)) < 1e-10


@pytest.mark.parametrize("reuse", [False, True])
def test_results_are_freed_when_dropped(reuse):
    """Nothing of a call keeps its result alive: no cycle through autograd (a hook on an
    output that a node below saved) nor through the walk, so dropping the result frees
    it at once, without Python's cycle collector (a training loop would otherwise hold
    one result per step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3))
    x, y = torch.randn(5, 1, 6, 6), torch.randint(0, 3, (5,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    step = memconv.PrivateStep(model, loss)
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            out = (
                step.per_sample_grads(x, y)
                if reuse
                else memconv.per_sample_grads(model, loss, x, y)
            )
            refs = [weakref.ref(v) for v in out.values()]
            del out
            assert all(r() is None for r in refs)
    finally:
        gc.enable()
