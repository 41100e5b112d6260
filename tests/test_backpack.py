"""Peer suite: BackPACK's first-order extensions on convolutions through memconv.

Every BackPACK convolution and transposed-convolution setting × every covered
extension × every strategy, on memconv's layers, against an independent autograd
reference (one ``torch.autograd.grad`` per sample), in float64 (1e-10 relative) and
float32 (1e-5); torch's own layers keep BackPACK's algorithm, with a warning.
"""

import contextlib
import sys
import warnings

import pytest
import torch
from backpack_settings import DERIVATIVES_CONV, DERIVATIVES_CONV_TRANSPOSE, FIRSTORDER_CONV
from helpers import CONV_TRANSPOSES, CONVS, rel_err
from torch import nn

import memconv

backpack = pytest.importorskip("backpack")
from backpack import extend, extensions  # noqa: E402

from memconv.integrations import backpack as mb  # noqa: E402

STRATEGIES = memconv.available_strategies()
EXTENSIONS = ("BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance")
SAVEFIELD = {
    "BatchGrad": "grad_batch",
    "BatchL2Grad": "batch_l2",
    "SumGradSquared": "sum_grad_squared",
    "Variance": "variance",
}
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


def _cases():
    cases = []
    for i, (shape, dims, params) in enumerate(FIRSTORDER_CONV):
        cases.append((f"firstorder-{i}-conv{dims}d", shape, dims, params, {}, False))
    for i, (shape, dims, kwargs) in enumerate(DERIVATIVES_CONV):
        cases.append((f"derivatives-{i}-conv{dims}d", shape, dims, (), kwargs, False))
    for i, (shape, dims, kwargs) in enumerate(DERIVATIVES_CONV_TRANSPOSE):
        cases.append((f"derivatives-{i}-convT{dims}d", shape, dims, (), kwargs, True))
    return cases


CASES = _cases()


def build(case, dtype, convert=True, seed=0):
    """BackPACK's ``Sequential(conv, ReLU, Flatten, Linear(out, 5))``, extended."""
    _, shape, dims, params, kwargs, transposed = case
    torch.manual_seed(seed)
    conv = (CONV_TRANSPOSES if transposed else CONVS)[dims](*params, **kwargs)
    x = torch.rand(shape)
    with torch.no_grad():
        out_dim = conv(x).flatten(1).shape[1]
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(out_dim, 5)).to(dtype)
    if convert:
        memconv.convert(model)
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


@pytest.mark.parametrize("kind", EXTENSIONS)
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"]
)
def test_extension_every_strategy(case, kind, dtype, tol, strategy_calls):
    model, x, y = build(case, dtype)
    ref = expected(model, x, y, kind)
    conv = model[0]
    params = [p for p in (conv.weight, conv.bias) if p is not None]
    for strategy in STRATEGIES:
        model.zero_grad()
        strategy_calls.clear()
        options = {"tile_size": 2} if strategy == "streaming" else {}
        with (
            mb.installed(getattr(extensions, kind)()) as ext,
            memconv.save_memory(strategy, **options),
            backpack.backpack(ext),
        ):
            nn.CrossEntropyLoss()(model(x), y).backward()
        if kind != "BatchL2Grad":  # norms may come from ghost norms, without a strategy
            assert strategy_calls and strategy_calls[0][0] == strategy
        for j, p in enumerate(params):
            got = getattr(p, SAVEFIELD[kind])
            assert rel_err(got, ref[j]) < tol, (strategy, j)
            if kind == "BatchGrad":
                assert rel_err(got.sum(0), p.grad) < tol


@pytest.mark.parametrize("kind", EXTENSIONS)
def test_torch_layers_get_memconvs_exact_jacobian(case, kind, strategy_calls):
    """extend(model) without convert: under install(), torch.nn convolutions get
    memconv's weight Jacobian, "standard" outside any block and the block open at
    backward time inside one."""
    model, x, y = build(case, torch.float64, convert=False)
    ref = expected(model, x, y, kind)
    with mb.installed(getattr(extensions, kind)()) as ext, backpack.backpack(ext):
        nn.CrossEntropyLoss()(model(x), y).backward()
    if kind != "BatchL2Grad":  # norms may come from ghost norms, without a strategy
        assert strategy_calls and {s for s, _ in strategy_calls} == {"standard"}
    assert rel_err(getattr(model[0].weight, SAVEFIELD[kind]), ref[0]) < 1e-10
    model.zero_grad()
    strategy_calls.clear()
    with mb.installed(getattr(extensions, kind)()) as ext, backpack.backpack(ext):
        loss = nn.CrossEntropyLoss()(model(x), y)
        with memconv.save_memory("shift"):
            loss.backward()
    if kind != "BatchL2Grad":
        assert strategy_calls and {s for s, _ in strategy_calls} == {"shift"}
    assert rel_err(getattr(model[0].weight, SAVEFIELD[kind]), ref[0]) < 1e-10


PLAIN_CASES = {
    "reflect": lambda: nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"),
    "circular": lambda: nn.Conv1d(2, 4, 3, padding=2, padding_mode="circular"),
    "same-even": lambda: nn.Conv2d(2, 4, 4, padding="same"),
    "transposed-groups-output-padding": lambda: nn.ConvTranspose2d(
        4, 6, 3, stride=2, groups=2, output_padding=1
    ),
}


@pytest.mark.parametrize("name", list(PLAIN_CASES))
def test_plain_layers_exact_where_backpack_alone_is_not(name):
    """BackPACK's own algorithm is wrong or raises on these torch.nn layers; under
    install() the same extend()ed model gives the per-sample autograd loop's numbers."""
    torch.manual_seed(0)
    conv = PLAIN_CASES[name]().double()
    dims = conv.weight.dim() - 2
    c_in = conv.in_channels
    x = torch.randn(3, c_in, *(7,) * dims, dtype=torch.float64)
    with torch.no_grad():
        features = conv(x)[0].numel()
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(features, 3)).double()
    y = torch.tensor([0, 1, 2])
    ref = expected(model, x, y, "BatchGrad")[0]

    def batch_grad(install):
        model.zero_grad()
        work = backpack.extend(model)
        ext = extensions.BatchGrad()
        with mb.installed(ext) if install else contextlib.nullcontext(), backpack.backpack(ext):
            nn.CrossEntropyLoss()(work(x), y).backward()
        return work[0].weight.grad_batch

    try:
        alone = batch_grad(install=False)
        assert rel_err(alone, ref) > 1e-3  # BackPACK alone is wrong here
    except (RuntimeError, ValueError, NotImplementedError):
        pass  # or raises
    assert rel_err(batch_grad(install=True), ref) < 1e-10


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_subsampling(dims):
    case = next(c for c in CASES if c[2] == dims and c[4].get("groups", 1) > 1 and not c[5])
    model, x, y = build(case, torch.float64)
    ref = expected(model, x, y, "BatchGrad")[0]
    sub = [0, 2]
    for strategy in STRATEGIES:
        with (
            mb.installed(extensions.BatchGrad(subsampling=sub)) as ext,
            memconv.save_memory(strategy),
            backpack.backpack(ext),
        ):
            nn.CrossEntropyLoss()(model(x), y).backward()
        assert rel_err(model[0].weight.grad_batch, ref[sub]) < 1e-10


def test_install_and_uninstall_restore_backpack_exactly():
    ext = extensions.BatchL2Grad()
    before = dict(mb._mapping(ext))
    assert mb.install(ext) is ext
    mb.install(ext)  # twice changes nothing
    during = dict(mb._mapping(ext))
    assert during[nn.Conv2d] is not before[nn.Conv2d]
    assert during[memconv.Linear] is before[nn.Linear]  # BackPACK's own for the base class
    mb.uninstall(ext)
    after = mb._mapping(ext)
    assert after == before and all(after[k] is before[k] for k in before)
    mb.uninstall(ext)  # not installed: nothing happens
    assert mb._mapping(ext) == before


def test_backpack_wrong_for_groups_memconv_right():
    case = next(c for c in CASES if c[2] == 2 and c[4].get("groups", 1) == 2 and not c[5])
    model, x, y = build(case, torch.float64)
    right = expected(model, x, y, "BatchL2Grad")[0]
    torch_model, _, _ = build(case, torch.float64, convert=False)
    with backpack.backpack(extensions.BatchL2Grad()):  # BackPACK alone
        nn.CrossEntropyLoss()(torch_model(x), y).backward()
    assert rel_err(torch_model[0].weight.batch_l2, right) > 1e-3  # BackPACK 1.7.1, groups
    with mb.installed(extensions.BatchL2Grad()) as ext, memconv.save_memory("rochette"):
        with backpack.backpack(ext):
            nn.CrossEntropyLoss()(model(x), y).backward()
    assert rel_err(model[0].weight.batch_l2, right) < 1e-10


def test_batch_l2_by_ghost_norms_where_cheaper(strategy_calls):
    """A late layer (few positions, many channels): ghost norms, no per-sample gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(128, 256, 3, groups=2), nn.Flatten(), nn.Linear(256 * 9, 3))
    model = extend(memconv.convert(model.double()))
    x, y = torch.randn(4, 128, 5, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    right = expected(model, x, y, "BatchL2Grad")[0]
    with mb.installed(extensions.BatchL2Grad()) as ext, backpack.backpack(ext):
        with memconv.save_memory("unfold"):
            loss = nn.CrossEntropyLoss()(model(x), y)
        loss.backward()
    # the layer's own backward computes .grad with the recorded strategy; no per-sample VJP
    assert strategy_calls == [("unfold", False)]
    assert rel_err(model[0].weight.batch_l2, right) < 1e-10


def test_uncovered_extension_warns_and_keeps_its_convolutions():
    ext = extensions.GGNMP()  # curvature-matrix products: not covered
    before = dict(mb._mapping(ext))
    with pytest.warns(UserWarning, match="does not cover the BackPACK extension GGNMP"):
        mb.install(ext)
    mapping = mb._mapping(ext)
    for cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d):
        assert mapping.get(cls) is before.get(cls)
    assert mapping[memconv.Conv2d] is before[nn.Conv2d]  # memconv's layers mapped too
    mb.uninstall(ext)
    assert mb._mapping(ext) == before


@pytest.mark.filterwarnings("ignore:memconv.save_memory. no memconv layer ran")
def test_forward_outside_the_block_warns():
    case = next(c for c in CASES if c[2] == 2 and not c[5])
    model, x, y = build(case, torch.float64)
    with mb.installed(extensions.BatchGrad()) as ext, backpack.backpack(ext):
        loss = nn.CrossEntropyLoss()(model(x), y)  # forward outside any block
        with pytest.warns(UserWarning, match="did not run in"):
            with memconv.save_memory("shift"):
                loss.backward()


@pytest.mark.parametrize("strategy", ["rochette", "streaming"])
def test_per_sample_grads_engine(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, groups=2),
        nn.ConvTranspose2d(4, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 8 * 8, 3),
    ).double()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    loss_fn = nn.CrossEntropyLoss()
    ours = memconv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    theirs = mb.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
    assert list(ours) == list(theirs)
    for name in ours:
        assert rel_err(theirs[name], ours[name]) < 1e-10, name
    assert not hasattr(model[0].weight, "grad_batch")  # the user's model is untouched
    assert type(model[0]) is nn.Conv2d
    with pytest.raises(ValueError, match="GroupNorm"):
        mb.per_sample_grads(nn.Sequential(nn.GroupNorm(1, 3)), loss_fn, x, y)


def test_missing_backpack_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "backpack", None)
    with pytest.raises(ImportError, match=r"memconv\[backpack\]"):
        mb.install(object())


def test_nothing_left_behind():
    torch.manual_seed(0)
    model = extend(
        memconv.convert(nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2)))
    )
    x, y = torch.randn(3, 2, 4, 4), torch.tensor([0, 1, 0])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*memconv")  # memconv has nothing to say
        for _ in range(3):
            with mb.installed(extensions.BatchGrad()) as ext, memconv.save_memory("shift"):
                with backpack.backpack(ext):
                    nn.CrossEntropyLoss()(model(x), y).backward()
    assert len(mb._previous) == 0
    assert not torch.nn.modules.module._global_forward_hooks
    assert not any(k.startswith("_memconv") for m in model.modules() for k in vars(m))


class _TiedConvs(nn.Module):
    """Two plain Conv2d sharing one weight (their biases their own)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 2, 3, padding=1)
        self.c2 = nn.Conv2d(2, 2, 3, padding=1)
        self.c2.weight = self.c1.weight
        self.act, self.flat, self.fc = nn.Tanh(), nn.Flatten(), nn.Linear(2 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(self.flat(self.c2(self.act(self.c1(x)))))


def _tied_case():
    from helpers import loop_reference

    torch.manual_seed(0)
    model = _TiedConvs().double()
    x, y = torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    ref = loop_reference(model, nn.CrossEntropyLoss(reduction="sum"), x, y)
    for m in (model.c1, model.c2, model.act, model.flat, model.fc):
        extend(m)
    return model, x, y, ref, extend(nn.CrossEntropyLoss(reduction="sum"))


def test_batch_grad_of_a_weight_tied_across_two_convolutions_sums_the_uses():
    model, x, y, ref, loss_fn = _tied_case()
    for _ in range(2):  # the second pass starts afresh
        model.zero_grad()
        with mb.installed(extensions.BatchGrad()) as ext, backpack.backpack(ext):
            loss_fn(model(x), y).backward()
        assert rel_err(model.c1.weight.grad_batch, ref["c1.weight"]) < 1e-10
        assert rel_err(model.c2.bias.grad_batch, ref["c2.bias"]) < 1e-10


@pytest.mark.parametrize("ext", [extensions.BatchL2Grad, extensions.SumGradSquared])
def test_other_extensions_of_a_tied_weight_raise(ext):
    model, x, y, _, loss_fn = _tied_case()
    with mb.installed(ext()) as e, backpack.backpack(e):
        with pytest.raises(
            ValueError, match=r"'weight' of Conv2d \(pass model=.* is used by several calls"
        ):
            loss_fn(model(x), y).backward()
