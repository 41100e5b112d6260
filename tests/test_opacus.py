"""The Opacus bridge (:mod:`memconv.integrations.opacus`) against per-sample autograd loops.

float64 to 1e-10 relative: ``GradSampleModule``'s ``p.grad_sample`` and ghost clipping's
per-sample norms over the convolution grid (dims 1–3, groups incl. depthwise, stride,
dilation, padding modes, "same", transposed; torch's and memconv's classes); Opacus'
whole DP step (clipping and seeded noise, "hooks" and "ghost") against
``memconv.clip_and_accumulate`` plus the same noise and against the loop; the
registries given back exactly; the missing-Opacus message.
"""

import subprocess
import sys

import pytest
import torch
from helpers import CONV_TRANSPOSES, CONVS, loop_reference, rel_err
from torch import nn

import memconv
import memconv.conv.norm_routes
import memconv.layers.conv as conv_rules

opacus = pytest.importorskip("opacus")
from opacus import GradSampleModule, PrivacyEngine  # noqa: E402
from opacus.grad_sample import (  # noqa: E402
    GradSampleHooks,
    GradSampleHooksFastGradientClipping,
    GradSampleModuleFastGradientClipping,
)
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from memconv.integrations import opacus as mo  # noqa: E402

TOL = 1e-10
#: Opacus clips by C / (‖g‖ + 1e-6) (DPOptimizer.clip_and_accumulate and
#: get_clipping_coef); memconv by C / ‖g‖ exactly.
OPACUS_STABILISER = 1e-6

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:Full backward hook is firing when gradients are computed with respect to module"
    ),
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),  # seeded on purpose
]

# (dims, C_in, C_out, k, size, kwargs, transposed)
LAYERS = [
    (1, 4, 6, 3, 11, dict(stride=2, padding=1), False),
    (1, 4, 4, 3, 9, dict(groups=4, dilation=2, padding="same", padding_mode="circular"), False),
    (2, 3, 6, 3, 8, dict(padding=1, padding_mode="reflect"), False),
    (
        2,
        4,
        6,
        (3, 2),
        (9, 8),
        dict(stride=(2, 1), dilation=(1, 2), groups=2, padding="valid"),
        False,
    ),
    (2, 6, 6, 3, 8, dict(groups=6, padding=1), False),  # depthwise
    (2, 4, 4, 4, 8, dict(padding="same", padding_mode="replicate"), False),
    (3, 2, 4, 3, 5, dict(padding=1, groups=2, padding_mode="circular"), False),
    (3, 4, 2, 2, 4, dict(stride=2), False),
    (2, 4, 3, 3, 5, dict(stride=2, padding=1, output_padding=1), True),
    (1, 4, 4, 3, 6, dict(groups=2, dilation=2), True),
    (3, 2, 2, 2, 3, dict(stride=2, groups=2), True),
]


def case_id(case):
    dims, *_, kwargs, transposed = case
    mode = kwargs.get("padding_mode", "")
    return f"conv{'T' if transposed else ''}{dims}d{'-' + mode if mode else ''}"


def layer_model(case, n=5):
    dims, c_in, c_out, k, size, kwargs, transposed = case
    torch.manual_seed(0)
    conv = (CONV_TRANSPOSES if transposed else CONVS)[dims](c_in, c_out, k, **kwargs)
    sizes = size if isinstance(size, tuple) else (size,) * dims
    x = torch.randn(n, c_in, *sizes)
    with torch.no_grad():
        out = conv(x).flatten(1).shape[1]
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(out, 3)).double()
    return model, x.double(), torch.randint(0, 3, (n,))


def reference(model, loss_fn, x, y):
    per = loop_reference(model, loss_fn, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    return per, norms


def opacus_grad_samples(model, loss_fn, x, y, reduction="sum"):
    gsm = GradSampleModule(model, loss_reduction=reduction)
    loss_fn(gsm(x), y).backward()
    out = {name: p.grad_sample for name, p in model.named_parameters()}
    gsm.to_standard_module()
    return out


def opacus_norms(model, loss_fn, x, y):
    gsm = GradSampleModuleFastGradientClipping(model, loss_reduction="sum", max_grad_norm=1.0)
    loss_fn(gsm(x), y).backward()
    total = gsm.get_norm_sample()
    each = {name: p._norm_sample for name, p in model.named_parameters()}
    gsm.to_standard_module()
    return total, each


@pytest.fixture
def bridge():
    mo.install()
    yield mo
    mo.uninstall()


@pytest.fixture
def sq_norm_calls(monkeypatch):
    """Layers whose weight norms memconv's norm sampler computed (a spy on the
    convolution rule's conv_weight_sq_norms)."""
    calls = []
    real = conv_rules.conv_weight_sq_norms

    def spy(module, *args, **kwargs):
        calls.append(type(module))
        return real(module, *args, **kwargs)

    monkeypatch.setattr(conv_rules, "conv_weight_sq_norms", spy)
    return calls


# ----------------------------------------------------------------- grad samplers
@pytest.mark.parametrize("case", LAYERS, ids=case_id)
def test_grad_samplers_match_the_loop(case, bridge, strategy_calls):
    model, x, y = layer_model(case)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, _ = reference(model, loss_fn, x, y)
    got = opacus_grad_samples(model, loss_fn, x, y)
    for name, g in per.items():
        assert rel_err(got[name], g) < TOL, name
    assert ("auto", True) in strategy_calls  # memconv's sampler ran, outside any block


@pytest.mark.parametrize("case", [LAYERS[2], LAYERS[6], LAYERS[8]], ids=case_id)
def test_memconv_classes_and_the_block_around_backward(case, bridge, strategy_calls):
    model, x, y = layer_model(case)
    loss_fn = nn.CrossEntropyLoss()  # mean: Opacus rescales the backprops by N
    per, _ = reference(model, loss_fn, x, y)
    memconv.convert(model)
    assert type(model[0]) in mo.classes() and type(model[0]).__module__ == "memconv.modules"
    gsm = GradSampleModule(model, loss_reduction="mean")
    with memconv.save_memory("shift"):
        loss_fn(gsm(x), y).backward()
    for name, p in model.named_parameters():
        assert rel_err(p.grad_sample, per[name]) < TOL, name
    gsm.to_standard_module()
    assert ("shift", True) in strategy_calls
    assert ("auto", True) not in strategy_calls


@pytest.mark.parametrize("case", LAYERS, ids=case_id)
def test_opacus_alone_is_wrong_for_padding_modes_other_than_zeros(case):
    """Without the bridge, Opacus 1.6's convolution sampler unfolds the input with zero
    padding whatever the padding_mode: the weight's per-sample gradients, and ghost
    clipping's norms made from them, are silently wrong for "reflect", "replicate" and
    "circular" (the bias's, which do not read the input, are right). With zero padding
    (any stride, dilation, groups, "same") and for transposed convolutions (torch.func)
    Opacus alone is right."""
    assert not mo.is_installed()
    model, x, y = layer_model(case)
    wrong = model[0].padding_mode != "zeros"
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, norms = reference(model, loss_fn, x, y)
    got = opacus_grad_samples(model, loss_fn, x, y)
    model.zero_grad()
    total, _ = opacus_norms(model, loss_fn, x, y)  # ghost mode: the same sampler
    assert rel_err(got["0.bias"], per["0.bias"]) < TOL
    if wrong:
        assert rel_err(got["0.weight"], per["0.weight"]) > 0.1
        assert rel_err(total, norms) > 1e-3
    else:
        assert rel_err(got["0.weight"], per["0.weight"]) < TOL
        assert rel_err(total, norms) < TOL


# ----------------------------------------------------------------- norm samplers
@pytest.mark.parametrize("route", [None, "ghost"], ids=["chosen", "ghost"])
@pytest.mark.parametrize("case", LAYERS, ids=case_id)
def test_norm_samplers_match_the_loop(case, route, bridge, sq_norm_calls, monkeypatch):
    """The route the cost models choose (mostly "instantiate" on these small layers), and
    the ghost route forced: Gram matrices per group, any padding mode, transposed."""
    ghost_calls = []
    real_ghost = memconv.conv.norm_routes.ghost_sq_norms
    monkeypatch.setattr(
        memconv.conv.norm_routes,
        "ghost_sq_norms",
        lambda *a: ghost_calls.append(1) or real_ghost(*a),
    )
    if route is not None:
        spy = conv_rules.conv_weight_sq_norms
        monkeypatch.setattr(
            conv_rules,
            "conv_weight_sq_norms",
            lambda m, x, g, settings, _, budget, reference=None: spy(
                m, x, g, settings, route, budget, reference
            ),
        )
    model, x, y = layer_model(case)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, norms = reference(model, loss_fn, x, y)
    total, each = opacus_norms(model, loss_fn, x, y)
    assert rel_err(total, norms) < TOL
    for name, g in per.items():
        assert rel_err(each[name], g.flatten(1).norm(dim=1)) < TOL, name
    assert sq_norm_calls == [type(model[0])]  # the convolution's norms by memconv's sampler
    if route == "ghost":
        assert ghost_calls == [1]


def test_norm_sampler_of_memconv_classes_within_the_block_budget(bridge, sq_norm_calls):
    model, x, y = layer_model(LAYERS[3])  # groups=2
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    _, norms = reference(model, loss_fn, x, y)
    memconv.convert(model)
    gsm = GradSampleModuleFastGradientClipping(model, loss_reduction="sum", max_grad_norm=1.0)
    with memconv.save_memory("shift", memory_budget=4096):  # ghost blocks of a few positions
        loss_fn(gsm(x), y).backward()
    assert rel_err(gsm.get_norm_sample(), norms) < TOL
    assert sq_norm_calls == [memconv.Conv2d]


# ----------------------------------------------------------------- the DP step
def small_cnn():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect"),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, groups=2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    ).double()


def dp_batch():
    torch.manual_seed(4)
    return torch.randn(8, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (8,))


def opacus_dp_step(mode, sigma, max_norm, seed):
    """One step of Opacus' DP-SGD (lr 0: the parameters stay); returns each parameter's
    noisy clipped sum ``p.grad``."""
    model = small_cnn()
    x, y = dp_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(TensorDataset(x, y), 8),
        noise_multiplier=sigma,
        max_grad_norm=max_norm,
        loss_reduction="sum",
        poisson_sampling=False,
        grad_sample_mode=mode,
        noise_generator=torch.Generator().manual_seed(seed),
        criterion=nn.CrossEntropyLoss(reduction="sum"),
    )
    if mode == "ghost":
        module, dp_optimizer, criterion, _ = out
    else:
        (module, dp_optimizer, _), criterion = out, nn.CrossEntropyLoss(reduction="sum")
    criterion(module(x), y).backward()
    dp_optimizer.step()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    module.to_standard_module()
    return grads


def opacus_noise(sigma, max_norm, seed):
    """The noise Opacus' optimizer draws: one ``torch.normal(0, σ·C)`` per parameter, in
    the optimizer's parameter order, from the seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.normal(0.0, sigma * max_norm, size=p.shape, generator=generator, dtype=p.dtype)
        for name, p in small_cnn().named_parameters()
    }


def test_layers_that_are_not_convolutions_get_memconv_rules(bridge):
    """A converted model: memconv.GroupNorm and memconv.Linear (and torch's classes) get
    memconv's samplers from their layer rules (no torch.func fallback), in both modes;
    GroupNorm gets a norm sampler, which Opacus has none of."""
    model, x, y = small_cnn(), *dp_batch()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, norms = reference(model, loss_fn, x, y)
    memconv.convert(model)
    grads, _, norm_samplers = registries()
    for memconv_cls, torch_cls in [(memconv.GroupNorm, nn.GroupNorm), (memconv.Linear, nn.Linear)]:
        assert memconv_cls in map(type, model)
        assert grads[memconv_cls] is grads[torch_cls] is mo.grad_sampler
    assert norm_samplers[memconv.Linear] is norm_samplers[nn.Linear] is mo.norm_sampler
    assert norm_samplers[memconv.GroupNorm] is mo.norm_sampler
    gsm = GradSampleModule(model, loss_reduction="sum")
    loss_fn(gsm(x), y).backward()
    assert not any(hasattr(m, "ft_compute_sample_grad") for m in model.modules())
    for name, p in model.named_parameters():
        assert rel_err(p.grad_sample, per[name]) < TOL, name
    gsm.to_standard_module()
    model.zero_grad()
    total, _ = opacus_norms(model, loss_fn, x, y)
    assert rel_err(total, norms) < TOL


def test_samplers_on_an_empty_batch_and_on_a_wrong_layer():
    conv = nn.Conv2d(2, 4, 3, groups=2).double()
    x, g = (
        torch.zeros(0, 2, 5, 5, dtype=torch.float64),
        torch.zeros(0, 4, 3, 3, dtype=torch.float64),
    )
    got = mo.grad_sampler(conv, [x], g)
    assert got[conv.weight].shape == (0, 4, 1, 3, 3) and got[conv.bias].shape == (0, 4)
    norms = mo.norm_sampler(conv, [x], g)
    assert norms[conv.weight].shape == (0,) and norms[conv.bias].shape == (0,)
    attention = nn.MultiheadAttention(4, 2)
    with pytest.raises(TypeError, match="no layer rule for MultiheadAttention"):
        mo.grad_sampler(attention, [torch.zeros(1, 3, 4)], torch.zeros(1, 3, 4))
    with pytest.raises(TypeError, match="input tensors as activations"):
        mo.norm_sampler(conv, [None], g)


@pytest.mark.parametrize("sigma", [0.0, 1.3])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_dp_step_opacus_with_the_bridge_equals_clip_and_accumulate_and_the_loop(
    mode, sigma, bridge, strategy_calls, sq_norm_calls
):
    x, y = dp_batch()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per, norms = reference(small_cnn(), loss_fn, x, y)
    max_norm = norms.median().item()  # some samples clipped, some not
    assert (norms > max_norm).any() and (norms < max_norm).any()

    def clipped(stabiliser):
        c = torch.clamp(max_norm / (norms + stabiliser), max=1.0)
        return {k: torch.einsum("n,n...->...", c, g) for k, g in per.items()}

    exact, stabilised = clipped(0.0), clipped(OPACUS_STABILISER)
    noise = opacus_noise(sigma, max_norm, seed=11)

    got = opacus_dp_step(mode, sigma, max_norm, seed=11)
    if mode == "ghost":  # both convolutions' norms by memconv's norm sampler
        assert sq_norm_calls == [nn.Conv2d, nn.Conv2d]
    else:  # both convolutions' per-sample gradients by memconv's grad sampler
        assert strategy_calls.count(("auto", True)) == 2
    for name in per:
        assert rel_err(got[name], stabilised[name] + noise[name]) < TOL, name
        if sigma:  # exactly the noise Opacus' seeded generator draws, on the clipped sum
            assert rel_err(got[name] - stabilised[name], noise[name]) < TOL, name

    for clip_route in ["book-keeping", "two-pass"]:
        model = small_cnn()
        memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=max_norm, clip_route=clip_route)
        generator = torch.Generator().manual_seed(11)
        for name, p in model.named_parameters():  # DP-SGD's noise, drawn as Opacus draws it
            if sigma:
                p.grad += torch.normal(
                    0.0, sigma * max_norm, size=p.shape, generator=generator, dtype=p.dtype
                )
            assert rel_err(p.grad, exact[name] + noise[name]) < TOL, (clip_route, name)
            # Opacus and memconv differ only by Opacus' stabiliser: ≤ 1e-6/‖g‖ relative
            assert rel_err(p.grad, got[name]) < 10 * OPACUS_STABILISER / norms.min().item()


# ----------------------------------------------------------------- install / uninstall
def registries():
    return (
        GradSampleHooks.GRAD_SAMPLERS,
        GradSampleHooksFastGradientClipping.GRAD_SAMPLERS,
        GradSampleHooksFastGradientClipping.NORM_SAMPLERS,
    )


def test_install_uninstall_restore_the_registries_exactly():
    def custom(layer, activations, backprops):  # a user's own entry for a memconv class
        return {}

    grads, _, norms = registries()
    grads[memconv.Conv2d] = custom
    try:
        before = [dict(r) for r in registries()]
        assert not mo.is_installed()
        mo.install()
        assert mo.is_installed()
        for cls in mo.classes():  # every type with a memconv layer rule
            assert grads[cls] is mo.grad_sampler and norms[cls] is mo.norm_sampler
        assert memconv.Linear in norms and memconv.GroupNorm in grads
        after_one = [dict(r) for r in registries()]
        mo.install()  # twice: nothing changes
        assert [dict(r) for r in registries()] == after_one
        mo.uninstall()
        assert not mo.is_installed()
        for r, b in zip(registries(), before):
            assert r.keys() == b.keys() and all(r[k] is b[k] for k in b)
        assert grads[nn.Conv2d].__module__ == "opacus.grad_sample.conv"
        assert nn.ConvTranspose2d not in grads and nn.Conv2d not in norms
        assert memconv.Linear not in grads and memconv.Linear not in norms
        assert grads[memconv.Conv2d] is custom
        mo.uninstall()  # not installed: nothing changes
        assert [dict(r) for r in registries()] == before
    finally:
        del grads[memconv.Conv2d]


def test_an_entry_replaced_after_install_stays_and_the_context_manager_nests():
    def other(layer, activations, backprops):
        return {}

    grads = GradSampleHooks.GRAD_SAMPLERS
    mo.install()
    with mo.installed():  # already installed: leaves it installed
        pass
    assert mo.is_installed()
    grads[nn.Conv3d] = other
    mo.uninstall()
    try:
        assert grads[nn.Conv3d] is other
        assert grads[nn.Conv2d].__module__ == "opacus.grad_sample.conv"
    finally:
        del grads[nn.Conv3d]
        from opacus.grad_sample.conv import compute_conv_grad_sample

        grads[nn.Conv3d] = compute_conv_grad_sample
    with mo.installed():
        assert grads[nn.Conv1d] is mo.grad_sampler
    assert not mo.is_installed()


def test_missing_opacus_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)
    with pytest.raises(ImportError, match=r"pip install 'memconv\[opacus\]'"):
        mo.install()
    assert not mo.is_installed()


def test_importing_memconv_and_the_bridge_does_not_import_opacus():
    code = (
        "import sys, memconv; from memconv.integrations import opacus; "
        "assert 'opacus' not in sys.modules, 'opacus imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_opacus_dpddp_is_rejected_before_any_work():
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    model = nn.Sequential(nn.Linear(3, 2)).double()
    wrapped = DPDDP.__new__(DPDDP)  # no process group is needed to be recognised
    nn.Module.__init__(wrapped)
    wrapped.module = model
    x, y = torch.randn(2, 3, dtype=torch.float64), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="DPDDP.*DistributedDataParallel"):
        memconv.clip_and_accumulate(wrapped, nn.CrossEntropyLoss(), x, y, max_norm=1.0)
    assert model[0].weight.grad is None
