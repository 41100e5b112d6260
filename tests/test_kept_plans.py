"""The plain functions keep their last call's checks, probe and plan per model, make
them again when anything they depend on changes (the numbers are a fresh call's, float64
against per-sample autograd loops), free them with the model and do not mix threads;
the default plan keeps the step's predicted peak at the lean target."""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref

import pytest
import torch
from helpers import assert_grads_close, loop_reference, small_gn_resnet
from torch import nn

import memconv
from memconv.engine.planning import (
    COMFORTABLE_LAYER_BUDGET,
    LEAN_HALVINGS,
    LEAN_REFERENCE_BATCH,
    LEAN_TOLERANCE,
    MIN_LAYER_BUDGET,
    pass_layer_budget,
    predict,
    profile,
)
from memconv.engine.prepared import KEPT_ATTRIBUTE
from memconv.engine.request import Request

TOL = 1e-9


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 3),
    ).double()


def data(n=5, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64).to(dtype)
    return x, torch.randint(0, 3, (n,), generator=g)


def kept(model):
    return model.__dict__[KEPT_ATTRIBUTE].prepared


def norms_of(ref):
    return torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)


def check_all(model, loss_fn, x, y):
    """per_sample_grads, per_sample_norms and clip_and_accumulate against the loop."""
    ref = loop_reference(model, loss_fn, x, y)
    assert_grads_close(memconv.per_sample_grads(model, loss_fn, x, y), ref, TOL)
    norms = norms_of(ref)
    got = memconv.per_sample_norms(model, loss_fn, x, y)
    assert torch.allclose(got.double(), norms, rtol=TOL, atol=0)
    c = torch.clamp(0.5 / norms, max=1.0)
    model.zero_grad(set_to_none=True)
    memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=0.5)
    for name, p in model.named_parameters():
        if p.requires_grad:
            want = torch.einsum("n,n...->...", c.to(ref[name].dtype), ref[name])
            assert torch.allclose(p.grad, want, rtol=TOL, atol=1e-12), name
    model.zero_grad(set_to_none=True)


def test_second_call_reuses_probe_and_plan():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()
    for _ in range(3):
        check_all(model, loss_fn, x, y)
    prepared = kept(model)
    assert prepared.probes == 1  # three tasks, three calls each: one probe
    assert prepared.plans == 3  # one plan per task


def test_a_block_opened_at_every_step_probes_once():
    """The clipping block, opened anew at each step as a training loop does, keeps its
    probe and plan from the first step on (its own hooks, registered anew by every
    block, are not a change of the model): one forward pass of the model a step after
    the first, none of the probe's; a user's hook added later is a change."""
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()
    calls = []
    model[0].register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[0]))
    for _ in range(3):
        with memconv.clipping(model, max_norm=1.0):
            loss_fn(model(x), y).backward()
    assert calls == [1, 2, len(x), len(x), len(x)]  # the probe's 1 and 2, once
    model[3].register_forward_hook(lambda mod, args, out: out)
    calls.clear()
    with memconv.clipping(model, max_norm=1.0):
        loss_fn(model(x), y).backward()
    assert calls == [1, 2, len(x)]


def _freeze(model):
    model[0].bias.requires_grad_(False)


def _replace(model):
    torch.manual_seed(5)
    model[5] = nn.Linear(16, 3).double()


def _hook(model):
    model[3].register_forward_hook(lambda mod, args, out: 2.0 * out)


def _eval(model):
    model.eval()


@pytest.mark.parametrize("change", [_freeze, _replace, _hook, _eval])
def test_a_changed_model_gives_a_fresh_calls_numbers(change):
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()
    check_all(model, loss_fn, x, y)
    probes = kept(model).probes
    change(model)
    check_all(model, loss_fn, x, y)
    assert kept(model).probes == probes + 1


def _group_sums(model, ref, groups: dict, max_norm: dict):
    """The clipped sums by group thresholds, from the loop's per-sample gradients."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    sq = {}
    for n in names:
        sq[groups[n]] = sq.get(groups[n], 0) + ref[n].flatten(1).pow(2).sum(1)
    c = {g: torch.clamp(max_norm[g] / v.sqrt(), max=1.0) for g, v in sq.items()}
    return {n: torch.einsum("n,n...->...", c[groups[n]], ref[n]) for n in names}


def test_the_kept_grouping_follows_the_model_groups_and_thresholds():
    """The grouping kept between calls is made again when the model, ``groups`` or
    ``max_norm`` change; a mapping changed in place by its owner is read again."""
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()

    def check(groups, max_norm):
        model.zero_grad(set_to_none=True)
        norms = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=max_norm, groups=groups)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        of = groups if isinstance(groups, dict) else {n: n.rpartition(".")[0] for n in names}
        group_names = sorted(set(of[n] for n in names))
        assert sorted(norms) == group_names  # no group of a frozen parameter
        limits = max_norm if isinstance(max_norm, dict) else {g: max_norm for g in group_names}
        want = _group_sums(model, loop_reference(model, loss_fn, x, y), of, limits)
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert torch.allclose(p.grad, want[n], rtol=TOL, atol=1e-12), n
            else:
                assert p.grad is None, n

    check("layer", 0.5)
    check("layer", 0.05)  # another threshold
    model[5].weight.requires_grad_(False)
    model[5].bias.requires_grad_(False)  # the last layer's group is gone
    check("layer", 0.05)
    model[5].weight.requires_grad_(True)
    model[5].bias.requires_grad_(True)
    mapping = {n: "a" for n, _ in model.named_parameters()}
    check(mapping, {"a": 0.5})
    mapping["5.weight"] = mapping["5.bias"] = "b"  # changed in place between calls
    check(mapping, {"a": 0.5, "b": 0.02})


def test_another_save_memory_block_and_dtype_give_fresh_numbers():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()
    check_all(model, loss_fn, x, y)
    plans = kept(model).plans
    with memconv.save_memory("unfold"):
        check_all(model, loss_fn, x, y)
    assert kept(model).plans > plans  # the block's settings enter the plan
    with memconv.save_memory("rochette"):
        check_all(model, loss_fn, x, y)
    # another dtype: the model and the batch in float32, against float32 loops
    model.float()
    x32 = x.float()
    grads = memconv.per_sample_grads(model, loss_fn, x32, y)
    ref = loop_reference(model, loss_fn, x32, y)
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert_grads_close(grads, ref, 1e-4)
    model.double()
    check_all(model, loss_fn, x, y)


def test_other_shapes_and_options_give_fresh_numbers():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()
    check_all(model, loss_fn, x, y)
    x2, y2 = data(n=3, seed=4)
    check_all(model, loss_fn, x2, y2)  # another batch size
    ref = loop_reference(model, loss_fn, x, y)
    got = memconv.per_sample_grads(model, loss_fn, x, y, memory_budget=None)
    assert_grads_close(got, ref, TOL)
    got = memconv.per_sample_grads(model, nn.CrossEntropyLoss(reduction="sum"), x, y)
    assert_grads_close(got, ref, TOL)


def test_a_deleted_model_frees_its_entry():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()
    memconv.per_sample_norms(model, loss_fn, x, y)
    entry = weakref.ref(model.__dict__[KEPT_ATTRIBUTE])
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and entry() is None


def test_copies_and_pickles_of_a_model_keep_no_entry():
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()
    memconv.per_sample_norms(model, loss_fn, x, y)
    twin = copy.deepcopy(model)
    assert twin.__dict__[KEPT_ATTRIBUTE] is not model.__dict__[KEPT_ATTRIBUTE]
    assert kept(twin).probes == 0
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded.__dict__[KEPT_ATTRIBUTE] == {}  # loads without memconv
    check_all(loaded, loss_fn, x, y)
    check_all(twin, loss_fn, x, y)


def test_two_threads_with_two_models_do_not_mix():
    loss_fn = nn.CrossEntropyLoss()
    models = [cnn(0), small_gn_resnet().double()]
    inputs = [data(), (torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (4,)))]
    refs = [loop_reference(m, loss_fn, x, y) for m, (x, y) in zip(models, inputs)]
    errors = []

    def work(i):
        try:
            for _ in range(4):
                x, y = inputs[i]
                got = memconv.per_sample_grads(models[i], loss_fn, x, y)
                assert_grads_close(got, refs[i], TOL)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_call_inside_a_call_on_the_same_model_works_with_a_fresh_entry():
    model = cnn()
    x, y = data()
    inner = []

    def loss_fn(out, target):  # a loss that calls memconv on the same model
        if not inner:
            inner.append(memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y))
        return nn.functional.cross_entropy(out, target)

    got = memconv.per_sample_grads(model, loss_fn, x, y)
    assert_grads_close(got, loop_reference(model, nn.CrossEntropyLoss(), x, y), TOL)
    assert inner


@pytest.mark.parametrize(
    "name,side", [("resnet18-gn", 16), ("resnet18-tv-gn", 32), ("convnext-atto", 32)]
)
def test_default_plan_keeps_the_lean_target(name, side):
    """The default plan's per-layer budget: the largest of the halvings whose predicted
    peak is within the lean target (on the reference batch), else the one whose peak is
    the least; a given budget keeps the pass's own per-layer budget."""
    from memconv.bench.cases import build_model

    model = build_model(name)
    x = torch.randn(16, 3, side, side)
    p = memconv.plan(model, x, task="clip")
    assert p.micro_batch == 16 and p.lean_target is not None
    prof = profile(model, x)
    request = Request("clip", 256, clip_route="book-keeping")
    own = pass_layer_budget(prof, 256)
    peaks = [
        predict(prof, request, m=256, layer_budget=max(own >> k, MIN_LAYER_BUDGET))[0]
        for k in range(LEAN_HALVINGS + 1)
        if k == 0 or own >> k >= COMFORTABLE_LAYER_BUDGET
    ]
    own16 = pass_layer_budget(prof, 16)
    k = next(
        k for k in range(LEAN_HALVINGS + 1) if max(own16 >> k, MIN_LAYER_BUDGET) == p.layer_budget
    )
    target = memconv.engine.planning.lean_target(prof, 256)
    if peaks[k] > target:
        assert min(peaks) > target and peaks[k] <= LEAN_TOLERANCE * min(peaks)
        assert all(peak > LEAN_TOLERANCE * min(peaks) for peak in peaks[:k])
    assert all(peak > target for peak in peaks[:k])
    given = memconv.plan(model, x, task="clip", memory_budget=2**40)
    assert given.layer_budget == pass_layer_budget(prof, 16) and given.lean_target is None


@pytest.mark.parametrize("pricing", ["cpu", "cuda"])
def test_default_plan_keeps_the_reference_routes_within_the_lean_target(pricing):
    """The benchmark's ResNet-18-GN (CIFAR, 32²) at N = 4, 64 and 256, routes priced by
    either calibration: below the reference batch, the default plan has each layer
    choose its route and pieces on it, with the reference's per-layer budget scaled to
    N; and the predicted peak stays within the lean target, or, where what the call
    keeps passes it (book-keeping at N = 64 and 256, whatever the routes), within
    LEAN_TOLERANCE of the leanest routes' (the smallest per-layer budget's)."""
    from memconv.bench.cases import build_model
    from memconv.strategies import costs

    model = build_model("resnet18-gn")
    calibration = costs.calibration(pricing)
    with costs.using("cpu", calibration):
        plans = {
            n: memconv.plan(model, torch.randn(n, 3, 32, 32), task="clip") for n in (4, 64, 256)
        }
        prof = profile(model, torch.randn(2, 3, 32, 32))
        for n, p in plans.items():
            assert p.micro_batch == n and p.lean_target is not None
            if n < LEAN_REFERENCE_BATCH:
                assert p.reference_batch == LEAN_REFERENCE_BATCH
                scaled = p.layer_budget * LEAN_REFERENCE_BATCH // n
                assert 0 <= scaled - plans[256].layer_budget < LEAN_REFERENCE_BATCH // n
            else:
                assert p.reference_batch is None
            request = Request("clip", n, clip_route="book-keeping")
            leanest = predict(prof, request, m=n, layer_budget=MIN_LAYER_BUDGET)[0]
            assert p.predicted_peak <= max(p.lean_target, LEAN_TOLERANCE * leanest), n
        assert plans[4].predicted_peak <= plans[4].lean_target


class _Sometimes(nn.Module):
    """A layer whose parent uses its weight a second time, outside it, when ``twice``
    is set: control flow the model's state does not show (as data-dependent flow)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = cnn()
        self.twice = False

    def forward(self, x):
        out = self.body(x)
        if self.twice:
            out = out + nn.functional.linear(out, self.body[5].weight[:, :3])
        return out


def test_a_model_of_layers_records_without_the_operation_recorder(monkeypatch):
    """Once a walk on the kept probe found every operation call inside a layer whose rule
    serves it, the next walks record without the recorder, with the fresh numbers; a
    later pass that uses a parameter outside its layer (flow the state does not show)
    takes the model route, exact as well; a changed model learns again."""
    model, loss_fn = _Sometimes(), nn.CrossEntropyLoss()
    x, y = data()
    check_all(model, loss_fn, x, y)
    walks = kept(model)._walks
    assert walks.layers_only  # learned by the first walk
    made, assigned = [], []
    real = memconv.engine.walk.OpRecorder
    monkeypatch.setattr(memconv.engine.walk, "OpRecorder", lambda *a: made.append(1) or real(*a))
    real_assign = memconv.engine.coverage.assign
    monkeypatch.setattr(
        memconv.engine.coverage, "assign", lambda *a: assigned.append(1) or real_assign(*a)
    )
    check_all(model, loss_fn, x, y)
    assert not made and kept(model).probes == 1
    assert not assigned  # the same calls and uses: the kept coverage
    model.twice = True
    check_all(model, loss_fn, x, y)  # against the loop on the model as it now runs
    assert not made and assigned  # another use of a weight: the coverage made again
    model.body[0].bias.requires_grad_(False)  # a new probe: recorded, learned again
    check_all(model, loss_fn, x, y)
    assert made and kept(model).probes == 2 and not kept(model)._walks.layers_only


def test_operation_calls_outside_layers_keep_the_recorder():
    """A parameter used by an operation in its parent's forward (an operation call the
    rules serve outside any layer): the walks keep recording operations."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = cnn()
            self.weight = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))

        def forward(self, x):
            return nn.functional.linear(self.body(x), self.weight)

    model, loss_fn = Scaled(), nn.CrossEntropyLoss()
    x, y = data()
    for _ in range(2):
        check_all(model, loss_fn, x, y)
    assert not kept(model)._walks.layers_only


def test_a_budget_reading_serves_the_next_calls_briefly(monkeypatch):
    """``"available"`` is read again after ``REREAD_SECONDS``, or on every call where the
    kept plan's peak is not far within the last reading; a reading below the plan's peak
    makes a new plan. The numbers are the fresh call's throughout."""
    from memconv.engine import prepared as prepared_module
    from memconv.engine import resources

    readings, now, free = [], [100.0], [2**34]

    def available(device=None):
        readings.append(free[0])
        return free[0]

    monkeypatch.setattr(resources, "available_memory", available)
    monkeypatch.setattr(prepared_module, "_clock", lambda: now[0])
    model, loss_fn = cnn(), nn.CrossEntropyLoss()
    x, y = data()
    ref = loop_reference(model, loss_fn, x, y)
    for _ in range(3):
        assert_grads_close(memconv.per_sample_grads(model, loss_fn, x, y), ref, TOL)
    assert len(readings) == 1  # the plan's peak is far within 16 GiB
    now[0] += 2 * prepared_module.REREAD_SECONDS
    assert_grads_close(memconv.per_sample_grads(model, loss_fn, x, y), ref, TOL)
    assert len(readings) == 2
    peak = kept(model).plan.predicted_peak
    free[0] = resources.MIN_HEADROOM + 2 * peak  # the budget: 2 × peak, not far within
    now[0] += 2 * prepared_module.REREAD_SECONDS
    plans = kept(model).plans
    for _ in range(2):
        assert_grads_close(memconv.per_sample_grads(model, loss_fn, x, y), ref, TOL)
    assert len(readings) == 4 and kept(model).plans == plans  # read each time, still fits
    free[0] = resources.MIN_HEADROOM + peak // 2  # below the plan's peak: a new plan
    assert_grads_close(memconv.per_sample_grads(model, loss_fn, x, y), ref, TOL)
    assert len(readings) == 5 and kept(model).plans == plans + 1


def test_kept_coverage_of_shared_parameters_gives_the_fresh_numbers():
    """A weight two layers share (its uses summed over two calls): the kept coverage gives
    the fresh call's numbers."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.a = nn.Linear(4, 4).double()
            self.b = nn.Linear(4, 4).double()
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    model, loss_fn = Tied(), nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 4, (5,))
    for _ in range(3):
        check_all(model, loss_fn, x, y)
    assert kept(model)._walks.assigned is not None


class _Scaled(nn.Module):
    """A convolution whose output a parameter of the module itself scales (a layer
    scale, as timm's ConvNeXt block's ``gamma``): an operation call inside the module
    computes that parameter; with ``extra``, an operation without a rule
    (``torch.addcmul``) uses it too, which the module's generic call then covers. It
    keeps a weak reference to each input it is called with."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.extra = False
        self.inputs = []

    def forward(self, x):
        self.inputs.append(weakref.ref(x))
        y = self.conv(x * 2).mul(self.gamma.view(1, -1, 1, 1))  # (nothing saves x)
        if self.extra:
            y = torch.addcmul(y, y, self.gamma.view(1, -1, 1, 1))
        return y


class _Watch(nn.Module):
    """Whether the last input of ``scaled`` is still alive when this module runs."""

    def __init__(self, scaled):
        super().__init__()
        self.scaled = [scaled]  # (not a submodule)
        self.alive = []

    def forward(self, x):
        self.alive.append(self.scaled[0].inputs[-1]() is not None)
        return x


def test_a_call_whose_parameters_calls_inside_it_compute_keeps_no_arguments():
    """From the second walk on a kept probe, the call of a module whose parameters the
    calls inside it compute keeps no arguments, so its input is freed during the forward
    pass, as without memconv (the first walk held it until the backward pass); a pass
    that gives that call a parameter to compute after all runs again, with the fresh
    numbers, and the walks on the probe keep every call's arguments from then on."""
    torch.manual_seed(5)
    scaled = _Scaled()
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), scaled, _Watch(scaled), nn.Flatten(), nn.Linear(144, 3)
    ).double()
    watch, loss_fn = model[2], nn.CrossEntropyLoss()
    x, y = data()
    check_all(model, loss_fn, x, y)
    assert scaled in kept(model)._walks.released[1].values()
    first = list(watch.alive)
    watch.alive.clear()
    check_all(model, loss_fn, x, y)
    assert first[-3] and not any(watch.alive[-3:]) and kept(model).probes == 1
    scaled.extra = True
    check_all(model, loss_fn, x, y)  # against the loop on the model as it now runs
    assert kept(model)._walks.keep_arguments and kept(model).probes == 1
    scaled.extra = False
    watch.alive.clear()
    for _ in range(2):
        check_all(model, loss_fn, x, y)
    assert all(watch.alive[-3:]) and kept(model).probes == 1  # (memconv's three calls)


def test_a_micro_batch_that_gives_a_released_call_a_parameter_runs_the_call_again():
    """The first call on a new probe, one sample per micro-batch: the second walk keeps
    no arguments for the call the first gave nothing to compute, and its coverage then
    gives that call a parameter (a use that depends on the sample): the call runs again,
    every call's arguments kept, with the fresh numbers."""

    class Gate(nn.Module):  # the use of gamma by addcmul: samples with a positive pixel
        def __init__(self, scaled):
            super().__init__()
            self.scaled = [scaled]

        def forward(self, x):
            self.scaled[0].extra = bool(x[0, 0, 0, 0] > 0)
            return x

    torch.manual_seed(5)
    scaled = _Scaled()
    model = nn.Sequential(
        Gate(scaled), nn.Conv2d(1, 4, 3), scaled, nn.Flatten(), nn.Linear(144, 3)
    ).double()
    loss_fn = nn.CrossEntropyLoss()
    x, y = data(n=3)
    x[:, 0, 0, 0] = torch.tensor([-1.0, 1.0, -1.0], dtype=x.dtype)
    budget = memconv.plan(model, x).smallest_budget
    assert memconv.plan(model, x, memory_budget=budget).micro_batch == 1
    got = memconv.per_sample_grads(model, loss_fn, x, y, memory_budget=budget)
    assert_grads_close(got, loop_reference(model, loss_fn, x, y), TOL)
    assert kept(model)._walks.keep_arguments and kept(model).probes == 1


def _states_differ(change) -> bool:
    """Whether the kept model's state record sees ``change(model)``."""
    from memconv.engine.prepared import _ModelState

    shared = nn.Linear(4, 4)
    inner = nn.Sequential(shared, nn.ReLU(), nn.Sequential(nn.Linear(4, 4), shared))
    model = nn.Sequential(inner, nn.Identity(), shared)
    model.register_module("gone", None)
    before = _ModelState(model)
    assert before == _ModelState(model)
    change(model)
    return before != _ModelState(model)


STATE_CHANGES = {
    "renamed child": lambda m: setattr(m, "_modules", {"x" + k: v for k, v in m._modules.items()}),
    "replaced child": lambda m: m.__setitem__(1, nn.Identity()),
    "None child set": lambda m: m.register_module("gone", nn.Tanh()),
    "requires_grad": lambda m: m[2].bias.requires_grad_(False),
    "parameter object": lambda m: setattr(m[2], "bias", nn.Parameter(m[2].bias.detach())),
    "parameter strides": lambda m: setattr(m[2].weight, "data", m[2].weight.data.t()),
    "parameter dtype": lambda m: m.double(),
    "training mode": lambda m: m[0].eval(),
    "forward hook": lambda m: m[0][1].register_forward_hook(lambda *a: None),
    "pre-hook": lambda m: m[0][2].register_forward_pre_hook(lambda *a: None),
}


@pytest.mark.parametrize("change", list(STATE_CHANGES))
def test_the_kept_models_state_record_sees_each_change(change):
    """The record a kept model's call compares at every call (one flat list of ids and
    attributes, :class:`memconv.engine.prepared._ModelState`) differs after any change
    the probe and the plan depend on."""
    assert _states_differ(STATE_CHANGES[change])


def test_the_state_record_sees_a_global_hook_and_lists_the_trainable_parameters():
    from memconv.engine.prepared import _ModelState

    net = cnn()
    net[0].bias.requires_grad_(False)
    state = _ModelState(net)
    assert state.trainable() == {n: p for n, p in net.named_parameters() if p.requires_grad}
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert state != _ModelState(net)
    finally:
        handle.remove()
    assert state == _ModelState(net)
