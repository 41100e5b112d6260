"""Peer suite: BackPACK's first-order extensions on convolutions through memconv.

Every BackPACK convolution setting × every extension × every strategy, against an
independent autograd reference (one ``torch.autograd.grad`` per sample), in
float64 (1e-10 relative) and float32 (1e-5).
"""

import warnings

import pytest
import torch
from backpack_settings import DERIVATIVES_CONV, FIRSTORDER_CONV
from helpers import CONVS, rel_err
from torch import nn

import memconv

backpack = pytest.importorskip("backpack")
from backpack import extend, extensions  # noqa: E402

STRATEGIES = memconv.strategies()
EXTENSIONS = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")
SAVEFIELD = {
    "BatchGrad": "grad_batch",
    "BatchL2Grad": "batch_l2",
    "SumGradSquared": "sum_grad_squared",
    "Variance": "variance",
}
MEMCONV_CONVS = {1: memconv.Conv1d, 2: memconv.Conv2d, 3: memconv.Conv3d}


def _cases():
    cases = []
    for i, (shape, dims, params) in enumerate(FIRSTORDER_CONV):
        cases.append((f"firstorder-{i}-conv{dims}d", shape, dims, params, {}))
    for i, (shape, dims, kwargs) in enumerate(DERIVATIVES_CONV):
        cases.append((f"derivatives-{i}-conv{dims}d", shape, dims, (), kwargs))
    return cases


CASES = _cases()


def build(case, dtype, memconv_class=False, seed=0):
    _, shape, dims, params, kwargs = case
    torch.manual_seed(seed)
    cls = (MEMCONV_CONVS if memconv_class else CONVS)[dims]
    conv = cls(*params, **kwargs)
    x = torch.rand(shape)
    with torch.no_grad():
        out_dim = conv(x).flatten(1).shape[1]
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(out_dim, 5)).to(dtype)
    y = torch.randint(0, 5, (shape[0],))
    return extend(model), x.to(dtype), y


def expected(model, x, y, kind):
    """BackPACK's quantity for the conv parameters, from autograd per-sample grads."""
    n = len(x)
    loss_fn = nn.CrossEntropyLoss()  # mean: BackPACK's per-sample grads carry 1/N
    conv = model[0]
    params = [p for p in (conv.weight, conv.bias) if p is not None]
    per = [
        torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]) / n, params)
        for i in range(n)
    ]
    out = {}
    for j in range(len(params)):
        batch = torch.stack([g[j] for g in per])
        if kind == "BatchGrad":
            out[j] = batch
        elif kind == "BatchL2Grad":
            out[j] = batch.pow(2).flatten(1).sum(1)
        elif kind == "SumGradSquared":
            out[j] = batch.pow(2).sum(0)
        else:
            out[j] = batch.pow(2).sum(0) / n - (batch.sum(0) / n) ** 2
    return out


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request):
    return request.param


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("kind", EXTENSIONS)
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"]
)
@pytest.mark.parametrize("classes", ["torch", "memconv"])
def test_extension_every_strategy(case, kind, dtype, tol, classes):
    model, x, y = build(case, dtype, memconv_class=classes == "memconv")
    ref = expected(model, x, y, kind)
    conv = model[0]
    params = [p for p in (conv.weight, conv.bias) if p is not None]
    for strategy in STRATEGIES:
        model.zero_grad()
        with (
            memconv.save_memory(strategy, tile_size=2),
            backpack.backpack(getattr(extensions, kind)()),
        ):
            nn.CrossEntropyLoss()(model(x), y).backward()
        for j, p in enumerate(params):
            got = getattr(p, SAVEFIELD[kind])
            assert rel_err(got, ref[j]) < tol, (strategy, j)
            if kind == "BatchGrad":
                assert rel_err(got.sum(0), p.grad) < tol


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_memconv_modules_and_subsampling(dims):
    case = next(c for c in CASES if c[2] == dims and c[4].get("groups", 1) > 1)
    model, x, y = build(case, torch.float64, memconv_class=True)
    ref = expected(model, x, y, "BatchGrad")[0]
    sub = [0, 2]
    for strategy in STRATEGIES:
        with (
            memconv.save_memory(strategy),
            backpack.backpack(extensions.BatchGrad(subsampling=sub)),
        ):
            nn.CrossEntropyLoss()(model(x), y).backward()
        assert rel_err(model[0].weight.grad_batch, ref[sub]) < 1e-10


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_strategy_is_used_and_backpack_restored(monkeypatch):
    import memconv.integrations.backpack.extensions as bp_ext

    case = next(c for c in CASES if c[2] == 2 and c[4].get("groups", 1) == 2)
    model, x, y = build(case, torch.float64)

    def run_l2():
        model.zero_grad()
        with backpack.backpack(extensions.BatchL2Grad()):
            nn.CrossEntropyLoss()(model(x), y).backward()
        return model[0].weight.batch_l2.clone()

    before = run_l2()  # BackPACK's own (wrong for groups > 1, as reported upstream)
    calls = []
    real = bp_ext.weight_grad

    def spy(*args, **kwargs):
        calls.append(kwargs["settings"].strategy)
        return real(*args, **kwargs)

    monkeypatch.setattr(bp_ext, "weight_grad", spy)
    with memconv.save_memory("rochette"), backpack.backpack(extensions.BatchL2Grad()):
        nn.CrossEntropyLoss()(model(x), y).backward()
    assert calls == ["rochette"]
    right = expected(model, x, y, "BatchL2Grad")[0]
    assert rel_err(model[0].weight.batch_l2, right) < 1e-10
    assert rel_err(before, right) > 1e-3  # BackPACK 1.7.1's BatchL2Grad with groups
    after = run_l2()
    assert torch.equal(after, before)  # BackPACK behaves exactly as before
    assert calls == ["rochette"]
    assert not torch.nn.modules.module._global_forward_hooks


def test_uncovered_extension_warns_once_and_keeps_numbers():
    import memconv.integrations.backpack as mb

    mb._warned.discard("DiagGGNExact")
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2)).double())
    loss_fn = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 0])

    def diag():
        with backpack.backpack(extensions.DiagGGNExact()):
            loss_fn(model(x), y).backward()
        return model[0].weight.diag_ggn_exact.clone()

    ref = diag()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memconv.save_memory("unfold"):
            got = diag()
            diag()
    named = [w for w in caught if "DiagGGNExact" in str(w.message)]
    assert len(named) == 1
    assert torch.equal(got, ref)


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("strategy", ["rochette", "streaming"])
def test_per_sample_grads_backpack_engine(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, groups=1), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 3),
    ).double()  # fmt: skip
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    loss_fn = nn.CrossEntropyLoss()
    ours = memconv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    theirs = memconv.per_sample_grads(model, loss_fn, x, y, strategy=strategy, engine="backpack")
    assert list(ours) == list(theirs)
    for name in ours:
        assert rel_err(theirs[name], ours[name]) < 1e-10, name
    assert not hasattr(model[0].weight, "grad_batch")  # the user's model is untouched
    with pytest.raises(ValueError, match="GroupNorm"):
        memconv.per_sample_grads(
            nn.Sequential(nn.GroupNorm(1, 3)), loss_fn, x, y, engine="backpack"
        )


@pytest.fixture
def vjp_calls(monkeypatch):
    """The ``per_sample`` flag of every weight VJP memconv's modules and its BackPACK
    extensions run."""
    import memconv.integrations.backpack.extensions as bp_ext
    import memconv.modules as mod

    calls = []

    def spy(real):
        def wrapped(*args, **kwargs):
            calls.append(kwargs["per_sample"])
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(mod, "weight_grad", spy(mod.weight_grad))
    monkeypatch.setattr(bp_ext, "weight_grad", spy(bp_ext.weight_grad))
    return calls


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_memconv_modules_compute_one_vjp_for_all_extensions(vjp_calls):
    """memconv.Conv*d under BackPACK: one weight VJP per layer feeds .grad and every
    covered extension (Variance needs no second VJP), and nothing is left behind."""
    case = next(c for c in CASES if c[2] == 2 and c[4].get("groups", 1) == 2)
    model, x, y = build(case, torch.float64, memconv_class=True)
    ref = expected(model, x, y, "Variance")[0]
    exts = [
        extensions.BatchGrad(),
        extensions.Variance(),
        extensions.SumGradSquared(),
        extensions.BatchL2Grad(),
    ]
    with memconv.save_memory("rochette"), backpack.backpack(*exts):
        nn.CrossEntropyLoss()(model(x), y).backward()
    assert vjp_calls == [True]  # one per-sample VJP, shared
    assert rel_err(model[0].weight.variance, ref) < 1e-10
    assert rel_err(model[0].weight.grad_batch.sum(0), model[0].weight.grad) < 1e-10
    assert not hasattr(model[0], "_memconv_shared")


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_two_memconv_layers_one_vjp_each(vjp_calls):
    torch.manual_seed(0)
    model = nn.Sequential(
        memconv.Conv2d(2, 4, 3, padding=1), nn.ReLU(), memconv.Conv2d(4, 4, 3, groups=2),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 3),
    ).double()  # fmt: skip
    model = extend(model)
    x, y = torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    per = [
        torch.autograd.grad(
            nn.CrossEntropyLoss()(model(x[i : i + 1]), y[i : i + 1]) / 4, model[2].weight
        )[0]
        for i in range(4)
    ]
    with (
        memconv.save_memory("shift"),
        memconv.per_sample(),
        backpack.backpack(extensions.Variance(), extensions.BatchGrad()),
    ):
        nn.CrossEntropyLoss()(model(x), y).backward()
    assert vjp_calls == [True, True]  # one per layer
    assert rel_err(model[2].weight.grad_batch, torch.stack(per)) < 1e-10
    assert not any(hasattr(m, "_memconv_shared") for m in model)
