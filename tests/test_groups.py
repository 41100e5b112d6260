"""Group-wise clipping (``groups=``) against a per-sample autograd loop, float64.

Every grouping ("all", "layer", "parameter", a mapping) on the rules' layers, the
generic route (a layer without a rule), a model with shared parameters and a layer
hidden from the hooks (model route), both clipping routes, with and without a memory
budget; the one-pass route taken where every group lies within a layer call; bad
groups and thresholds refused before any work.
"""

import math

import pytest
import torch
from helpers import Hidden, loop_reference, rel_err
from torch import nn

import memconv
from memconv.engine.prepared import Prepared
from memconv.tasks import clipping, norms
from memconv.tasks.groups import resolve_groups

TOL = 1e-10


class Scale(nn.Module):
    """A layer with no rule: the generic route."""

    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, c).reshape(c, 1, 1))
        self.shift = nn.Parameter(torch.zeros(c, 1, 1) + 0.1)

    def forward(self, x):
        return torch.sin(x * self.weight + self.shift)


def rule_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.Flatten(),
        nn.LayerNorm(16),
        nn.Linear(16, 3),
    ).double()
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (6,)), nn.CrossEntropyLoss()


def generic_model():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), Scale(4), nn.Flatten(), nn.Linear(4 * 25, 3)
    ).double()
    x = torch.randn(5, 3, 5, 5, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (5,)), nn.CrossEntropyLoss()


def shared_model():
    torch.manual_seed(2)
    conv = nn.Conv2d(3, 3, 3, padding=1)
    model = nn.Sequential(conv, nn.Tanh(), conv, nn.Conv2d(3, 3, 1), nn.Flatten()).double()
    model[3].bias = model[0].bias  # a tied parameter as well
    x, y = torch.randn(4, 3, 5, 5, dtype=torch.float64), torch.randn(4, 75, dtype=torch.float64)
    return model, x, y, nn.MSELoss(reduction="sum")


MODELS = {"rules": rule_model, "generic": generic_model, "shared": shared_model}


def groupings(model):
    names = [n for n, _ in model.named_parameters()]
    half = len(names) // 2  # groups that span layers
    mapping = {n: ("front" if i < half else "back") for i, n in enumerate(names)}
    return ["all", "layer", "parameter", mapping]


def reference(model, loss_fn, x, y, of, max_norm=None):
    """``(norms by group, clipped sums by parameter)`` from the loop's gradients;
    ``max_norm`` None: each group's median norm (some samples clipped, some not)."""
    per = loop_reference(model, loss_fn, x, y)
    sq: dict = {}
    for name, g in per.items():
        sq[of[name]] = sq.get(of[name], 0) + g.flatten(1).pow(2).sum(1)
    norms = {g: v.sqrt() for g, v in sq.items()}
    if max_norm is None:
        max_norm = {g: float(v.median()) for g, v in norms.items()}
    c = {g: torch.clamp(max_norm[g] / norms[g], max=1.0) for g in norms}
    sums = {n: torch.einsum("n,n...->...", c[of[n]], g) for n, g in per.items()}
    return norms, sums, max_norm


@pytest.mark.parametrize("budget", [None, 3 * 2**20])
@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("which", list(MODELS))
def test_every_grouping_against_the_loop(which, clip_route, budget):
    model, x, y, loss_fn = MODELS[which]()
    for groups in groupings(model):
        grouping = resolve_groups(model, groups)
        norms, sums, max_norm = reference(model, loss_fn, x, y, grouping.of)
        got_norms = memconv.per_sample_norms(
            model, loss_fn, x, y, groups=groups, memory_budget=budget
        )
        model.zero_grad(set_to_none=True)
        got = memconv.clip_and_accumulate(
            model,
            loss_fn,
            x,
            y,
            max_norm=max_norm,
            groups=groups,
            clip_route=clip_route,
            memory_budget=budget,
        )
        if groups == "all":
            got, got_norms = {"all": got}, {"all": got_norms}
        assert set(got) == set(norms) == set(got_norms)
        for g in norms:
            assert rel_err(got[g], norms[g]) < TOL, (groups, g)
            assert rel_err(got_norms[g], norms[g]) < TOL, (groups, g)
        for name, p in model.named_parameters():
            assert rel_err(p.grad, sums[name]) < TOL, (groups, name)


def test_one_threshold_for_every_group_and_per_parameter_norms():
    model, x, y, loss_fn = rule_model()
    grouping = resolve_groups(model, "parameter")
    norms, sums, _ = reference(model, loss_fn, x, y, grouping.of, {n: 0.3 for n in grouping.of})
    got = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=0.3, groups="parameter")
    per_parameter = memconv.per_sample_norms(model, loss_fn, x, y, per_parameter=True)
    for name, p in model.named_parameters():
        assert rel_err(p.grad, sums[name]) < TOL
        assert rel_err(got[name], norms[name]) < TOL
        assert rel_err(per_parameter[name], norms[name]) < TOL


@pytest.mark.parametrize("groups", ["layer", "parameter"])
def test_groups_within_layers_take_one_pass(groups, monkeypatch):
    """No second backward pass and nothing kept for after the walk: every call's
    clipped sum is added during the backward pass."""
    model, x, y, loss_fn = rule_model()
    grouping = resolve_groups(model, groups)
    _, sums, max_norm = reference(model, loss_fn, x, y, grouping.of)
    kept = []
    original = norms.NormGatherer.add_clipped_sums

    def spy(self, c, total):
        kept.append((dict(c), list(self.io), dict(self.grads)))
        return original(self, c, total)

    def no_second_pass(*args, **kwargs):
        raise AssertionError("a second backward pass ran")

    monkeypatch.setattr(norms.NormGatherer, "add_clipped_sums", spy)
    monkeypatch.setattr(clipping, "_second_pass", no_second_pass)
    for clip_route in ("book-keeping", "two-pass"):
        model.zero_grad(set_to_none=True)
        memconv.clip_and_accumulate(
            model,
            loss_fn,
            x,
            y,
            max_norm=max_norm,
            groups=groups,
            clip_route=clip_route,
            memory_budget=None,
        )
        for name, p in model.named_parameters():
            assert rel_err(p.grad, sums[name]) < TOL, (clip_route, name)
    assert kept == [({}, [], {})]  # book-keeping's call: nothing deferred


def test_groups_spanning_layers_with_a_hidden_layer():
    """A layer hidden from the hooks (model route) in a group with a rule layer."""

    torch.manual_seed(3)
    model = Hidden().double()
    x, y = torch.randn(4, 4, 11, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    loss_fn = nn.CrossEntropyLoss()
    groups = {"inner.weight": "a", "inner.bias": "b", "head.weight": "a", "head.bias": "b"}
    for spec in ("layer", groups):
        grouping = resolve_groups(model, spec)
        norms, sums, max_norm = reference(model, loss_fn, x, y, grouping.of)
        for clip_route in ("book-keeping", "two-pass"):
            model.zero_grad(set_to_none=True)
            got = memconv.clip_and_accumulate(
                model, loss_fn, x, y, max_norm=max_norm, groups=spec, clip_route=clip_route
            )
            for g in norms:
                assert rel_err(got[g], norms[g]) < TOL
            for name, p in model.named_parameters():
                assert rel_err(p.grad, sums[name]) < TOL, (spec, clip_route, name)


def test_streaming_model_by_group():
    """A model that streams: each sample's gradient, its norms per group, clipped."""
    from test_clipping import streamed_model

    streamed, plain = streamed_model()
    x, y = torch.randn(3, 3, 40, 36, dtype=torch.float64), torch.tensor([0, 2, 1])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per = loop_reference(plain, loss_fn, x, y)
    rename = {n.replace("0.", "0.stream_layers.", 1) if n.startswith("0.") else n: n for n in per}
    grouping = resolve_groups(streamed, "layer")
    of = {rename[n]: g for n, g in grouping.of.items()}
    norms, sums, max_norm = reference(plain, loss_fn, x, y, of)
    got = memconv.clip_and_accumulate(streamed, loss_fn, x, y, max_norm=max_norm, groups="layer")
    got_norms = memconv.per_sample_norms(streamed, loss_fn, x, y, groups="layer")
    for g in norms:
        assert rel_err(got[g], norms[g]) < TOL and rel_err(got_norms[g], norms[g]) < TOL
    for name, p in streamed.named_parameters():
        assert rel_err(p.grad, sums[rename[name]]) < TOL, name


def test_frozen_parameters():
    model, x, y, loss_fn = rule_model()
    model[1].weight.requires_grad_(False)
    grouping = resolve_groups(model, "layer")
    assert "1.weight" not in grouping.of and grouping.members["1"] == ("1.bias",)
    norms, sums, max_norm = reference(model, loss_fn, x, y, grouping.of)
    got = memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=max_norm, groups="layer")
    for g in norms:
        assert rel_err(got[g], norms[g]) < TOL
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert rel_err(p.grad, sums[name]) < TOL


def test_sensitivity_is_the_l2_norm_of_the_thresholds():
    model, *_ = rule_model()
    thresholds = {g: 0.5 + i for i, g in enumerate(resolve_groups(model, "layer").members)}
    grouping = resolve_groups(model, "layer", thresholds)
    assert grouping.sensitivity() == pytest.approx(
        math.sqrt(sum(c * c for c in thresholds.values()))
    )
    assert resolve_groups(model, "all", 2.0).sensitivity() == 2.0


def test_empty_batch_by_group():
    model, x, y, loss_fn = rule_model()
    got = memconv.clip_and_accumulate(model, loss_fn, x[:0], y[:0], max_norm=1.0, groups="layer")
    assert set(got) == set(resolve_groups(model, "layer").members)
    assert all(v.shape == (0,) for v in got.values())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(groups="block"), ValueError, "unknown groups 'block'"),
        (dict(groups=3), TypeError, "groups must be one of"),
        (dict(groups={"0.weight": 1}), TypeError, "group names"),
        (dict(groups={"nope": "a"}), ValueError, "'nope', which is no trainable parameter"),
        (dict(groups={"0.weight": "a"}), ValueError, "leaves the trainable parameter"),
        (dict(groups="layer", max_norm={"0": 1.0}), ValueError, "no threshold for the group"),
        (dict(groups="layer", max_norm={"x": 1.0}), ValueError, "no threshold for the group"),
        (dict(groups="layer", max_norm={"x": 1.0, "y": 1.0}), ValueError, "'x', which is no group"),
        (dict(groups="parameter", max_norm=0.0), ValueError, "max_norm must be a positive"),
        (dict(groups="layer", max_norm={"0": -1.0}), ValueError, r"max_norm\['0'\]"),
        (dict(groups="layer", max_norm={"0": math.nan}), ValueError, "positive finite"),
        (dict(groups="layer", max_norm={"0": math.inf}), ValueError, "positive finite"),
        (dict(groups="layer", max_norm={"0": "1"}), TypeError, "positive finite"),
        (dict(groups="layer", max_norm=[1.0]), TypeError, "max_norm"),
    ],
)
def test_bad_groups_leave_grad_unchanged(kwargs, exc, match, monkeypatch):
    model, x, y, loss_fn = rule_model()
    model[1].weight.requires_grad_(False)  # frozen: no group takes it
    kwargs = {"max_norm": 1.0, **kwargs}
    if isinstance(kwargs["max_norm"], dict) and set(kwargs["max_norm"]) not in (
        {"0"},
        {"x"},
    ):  # every other group has its threshold
        full = dict.fromkeys(resolve_groups(model, kwargs["groups"]).members, 1.0)
        kwargs["max_norm"] = {**full, **kwargs["max_norm"]}
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)

    def no_work(*args, **kwargs):
        raise AssertionError("work began")

    monkeypatch.setattr(Prepared, "call_plan", no_work)
    with pytest.raises(exc, match=match):
        memconv.clip_and_accumulate(model, loss_fn, x, y, **kwargs)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())


@pytest.mark.parametrize(
    "groups, exc, match",
    [
        ("block", ValueError, "unknown groups"),
        (None, TypeError, "groups must be one of"),
        ({"nope": "a"}, ValueError, "no trainable parameter"),
        ({"0.weight": "a"}, ValueError, "leaves the trainable parameter"),
    ],
)
def test_bad_groups_for_norms(groups, exc, match, monkeypatch):
    model, x, y, loss_fn = rule_model()
    monkeypatch.setattr(Prepared, "call_plan", lambda *a, **k: pytest.fail("work began"))
    with pytest.raises(exc, match=match):
        memconv.per_sample_norms(model, loss_fn, x, y, groups=groups)


def test_frozen_parameter_in_a_mapping_is_refused():
    model, x, y, loss_fn = rule_model()
    model[1].weight.requires_grad_(False)
    groups = {n: "g" for n, _ in model.named_parameters()}
    with pytest.raises(ValueError, match="'1.weight', which is no trainable parameter"):
        memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=1.0, groups=groups)
    with pytest.raises(ValueError, match="per_parameter=True is groups='parameter'"):
        memconv.per_sample_norms(model, loss_fn, x, y, per_parameter=True, groups="layer")


def test_non_finite_norm_raises_in_the_pass():
    model, x, y, loss_fn = rule_model()
    x = x.clone()
    x[2] = math.nan
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    with pytest.raises(RuntimeError, match=r"sample\(s\) 2 is not finite"):
        memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=1.0, groups="layer")
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())


def test_per_parameter_thresholds_step_as_opacus_per_layer():
    """``groups="parameter"`` with a threshold per parameter and noise of std
    σ·√(Σ C_g²) is Opacus' ``DPPerLayerOptimizer`` step (same generator)."""
    opacus = pytest.importorskip("opacus.optimizers")
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    loss_fn = nn.CrossEntropyLoss()
    names = [n for n, _ in model.named_parameters()]
    thresholds = dict(zip(names, [0.3, 0.1, 0.5, 0.2]))
    opt = opacus.DPPerLayerOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.7,
        max_grad_norm=list(thresholds.values()),
        expected_batch_size=6,
        loss_reduction="sum",
        generator=torch.Generator().manual_seed(9),
    )
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    per = loop_reference(model, loss_fn, x, y)
    for n, p in model.named_parameters():
        p.grad_sample, p.grad = per[n], torch.zeros_like(p)
    opt.step()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=thresholds, groups="parameter")
    std = 0.7 * resolve_groups(model, "parameter", thresholds).sensitivity()
    gen = torch.Generator().manual_seed(9)
    for n, p in model.named_parameters():
        p.grad = p.grad + torch.normal(0, std, p.shape, generator=gen)
        assert torch.allclose(p.grad, expected[n], rtol=0, atol=1e-5), n
