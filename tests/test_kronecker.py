"""Kronecker factors of convolutions (KFAC, KFLR, KFRA) without unfold.

The input factor against an unfold reference written here (``torch.nn.functional.unfold``
for 2-d convolutions; a convolution or transposed convolution with one-hot kernels
for every dimension), in float64 to 1e-10 relative; BackPACK's KFAC/KFLR/KFRA with
memconv's module extensions against BackPACK alone on its own convolution settings;
where BackPACK refuses or is wrong (groups, circular padding) against a reference
from torch.func (the exact GGN of the bias) and the unfolded input.
"""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from backpack_settings import DERIVATIVES_CONV, DERIVATIVES_CONV_TRANSPOSE, FIRSTORDER_CONV
from helpers import CONV_TRANSPOSES, CONVS, rel_err
from torch import nn

import memconv
from memconv.conv.kronecker import expand_plan, input_factor, most_chunks, patches
from memconv.strategies import costs

backpack = pytest.importorskip("backpack")
from backpack import extend, extensions  # noqa: E402

from memconv.integrations.backpack.kronecker import module_extension  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook", "ignore:The Kronecker factors stored"
)
TOL = 1e-10


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one torch thread (conftest restores the count after each test)."""
    torch.set_num_threads(1)


KRONECKER = {"KFAC": extensions.KFAC, "KFLR": extensions.KFLR, "KFRA": extensions.KFRA}


# ---------------------------------------------------------------- references


def unfold_reference(module, x):
    """``⟦x⟧ [N, C_in·K, T]`` by a grouped convolution with one-hot kernels."""
    dims = len(module.kernel_size)
    k = math.prod(module.kernel_size)
    c = x.shape[1]
    eye = torch.eye(k, dtype=x.dtype).reshape(k, 1, *module.kernel_size).repeat(c, 1, *[1] * dims)
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        # one-hot transposed kernels: output channel (c, k) gets input channel c at offset k
        weight = (
            torch.eye(k, dtype=x.dtype).reshape(1, k, *module.kernel_size).repeat(c, 1, *[1] * dims)
        )
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
        out = fn(
            x,
            weight,
            stride=module.stride,
            padding=module.padding,
            output_padding=module.output_padding,
            dilation=module.dilation,
            groups=c,
        )
        return out.flatten(2)
    if module.padding_mode != "zeros":
        pairs = [(p, p) for p in module.padding]
        x = F.pad(x, tuple(v for pair in reversed(pairs) for v in pair), mode=module.padding_mode)
        padding = 0
    else:
        padding = module.padding
    fn = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    out = fn(x, eye, stride=module.stride, padding=padding, dilation=module.dilation, groups=c)
    return out.flatten(2)


def omega_reference(module, x, kfac_approx="expand"):
    """Ω from the unfolded input: ``[C·K, C·K]``, or ``[G, ...]`` per group."""
    u = unfold_reference(module, x)
    n, g = x.shape[0], module.groups
    u = u.reshape(n, g, u.shape[1] // g, u.shape[2])
    if kfac_approx == "reduce":
        u = u.mean(3, keepdim=True)
    out = torch.einsum("ngit,ngjt->gij", u, u) / n
    return out[0] if g == 1 else out


def bias_ggn(model, conv, loss_fn, x, y):
    """The exact GGN of ``conv.bias`` by torch.func: Σₙ Jₙᵀ ∇²ℓₙ Jₙ, ``[C_out, C_out]``."""
    params = dict(model.named_parameters())
    name = next(k for k, p in params.items() if p is conv.bias)

    def out(b, xi):
        return torch.func.functional_call(model, {**params, name: b}, (xi[None],))[0]

    total = 0
    for xi, yi in zip(x, y):
        jac = torch.func.jacrev(out)(conv.bias.detach(), xi)  # [D, C_out]
        z = out(conv.bias.detach(), xi).detach()
        hess = torch.func.hessian(lambda z, yi=yi: loss_fn(z[None], yi[None]))(z)
        total = total + jac.T @ hess @ jac
    return total / len(x)  # mean loss: BackPACK's S carries 1/√N


def _block_diag(a, groups):
    if groups == 1:
        return a
    c = a.shape[0] // groups
    return torch.stack([a[i * c : (i + 1) * c, i * c : (i + 1) * c] for i in range(groups)])


# ---------------------------------------------------------------- geometries


def _geometries():
    """(name, layer class, kwargs, input shape): BackPACK's settings and held-out ones."""
    out = []
    for i, (shape, dims, params) in enumerate(FIRSTORDER_CONV):
        names = ("in_channels", "out_channels", "kernel_size", "stride", "padding")
        names += ("dilation", "groups", "bias")
        out.append((f"bp-first-{i}", CONVS[dims], dict(zip(names, params)), shape))
    for i, (shape, dims, kwargs) in enumerate(DERIVATIVES_CONV):
        out.append((f"bp-conv-{i}", CONVS[dims], kwargs, shape))
    for i, (shape, dims, kwargs) in enumerate(DERIVATIVES_CONV_TRANSPOSE):
        out.append((f"bp-convT-{i}", CONV_TRANSPOSES[dims], kwargs, shape))
    held_out = [
        (
            "circular-1d",
            nn.Conv1d,
            dict(
                in_channels=3,
                out_channels=4,
                kernel_size=3,
                padding=2,
                padding_mode="circular",
                dilation=2,
            ),
            (2, 3, 9),
        ),
        (
            "reflect-2d",
            nn.Conv2d,
            dict(
                in_channels=2,
                out_channels=3,
                kernel_size=3,
                padding=1,
                padding_mode="reflect",
                stride=2,
            ),
            (2, 2, 7, 6),
        ),
        (
            "replicate-3d",
            nn.Conv3d,
            dict(in_channels=2, out_channels=2, kernel_size=2, padding=1, padding_mode="replicate"),
            (2, 2, 3, 4, 3),
        ),
        (
            "same-even-2d",
            nn.Conv2d,
            dict(
                in_channels=3, out_channels=2, kernel_size=(2, 4), padding="same", dilation=(1, 2)
            ),
            (2, 3, 6, 7),
        ),
        (
            "depthwise-2d",
            nn.Conv2d,
            dict(in_channels=4, out_channels=8, kernel_size=3, padding=1, groups=4),
            (3, 4, 6, 6),
        ),
        (
            "groups-3d",
            nn.Conv3d,
            dict(in_channels=4, out_channels=6, kernel_size=(1, 2, 2), stride=(1, 2, 1), groups=2),
            (2, 4, 2, 5, 4),
        ),
        (
            "convT-outpad-2d",
            nn.ConvTranspose2d,
            dict(
                in_channels=3, out_channels=2, kernel_size=3, stride=2, padding=1, output_padding=1
            ),
            (2, 3, 4, 5),
        ),
        (
            "convT-groups-1d",
            nn.ConvTranspose1d,
            dict(
                in_channels=4,
                out_channels=6,
                kernel_size=3,
                stride=3,
                dilation=2,
                padding=2,
                groups=2,
            ),
            (2, 4, 5),
        ),
        (
            "convT-3d",
            nn.ConvTranspose3d,
            dict(
                in_channels=2,
                out_channels=3,
                kernel_size=2,
                stride=(2, 1, 2),
                output_padding=(1, 0, 0),
            ),
            (2, 2, 2, 3, 2),
        ),
    ]
    return out + held_out


GEOMETRIES = _geometries()
IDS = [g[0] for g in GEOMETRIES]


def _layer(cls, kwargs, seed=0):
    torch.manual_seed(seed)
    return cls(**kwargs).double()


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
@pytest.mark.parametrize("case", GEOMETRIES, ids=IDS)
def test_input_factor_equals_unfold(case, kfac_approx):
    _, cls, kwargs, shape = case
    layer = _layer(cls, kwargs)
    x = torch.randn(shape, dtype=torch.float64)
    ref = omega_reference(layer, x, kfac_approx)
    assert rel_err(input_factor(layer, x, kfac_approx=kfac_approx), ref) < TOL
    if kfac_approx == "expand":  # one output row of one sample per slab, and one slab
        with pytest.warns(UserWarning, match="below every kernel offset's patches of one"):
            assert rel_err(input_factor(layer, x, memory_budget=1), ref) < TOL
        assert rel_err(input_factor(layer, x, memory_budget=2**40), ref) < TOL


def _budgets(layer, x):
    """Budgets giving slabs of one output row, of one sample, of all but one sample
    (so two slabs, the second short) and of the whole batch, with their plans."""
    plan = expand_plan(layer, x, memory_budget=2**40)
    per_sample = plan.slab_bytes // x.shape[0]
    per_row = per_sample // plan.rows
    several = [per_sample * (x.shape[0] - 1)] if x.shape[0] > 2 else []
    budgets = [per_row, per_sample, *several, 2**40]
    return [(b, expand_plan(layer, x, memory_budget=b)) for b in budgets]


@pytest.mark.parametrize("case", GEOMETRIES, ids=IDS)
def test_every_chunking_gives_the_same_factor(case):
    """Every number of products per slab (c from 1 to its most, K or at least 4 where
    the rows allow) and slabs of one output row,
    one sample, several samples and the whole batch: Ω equals the unfold reference,
    on every geometry (grouped, strided, dilated, transposed, every padding mode)."""
    _, cls, kwargs, shape = case
    layer = _layer(cls, kwargs)
    x = torch.randn(shape, dtype=torch.float64)
    ref = omega_reference(layer, x)
    k = most_chunks(x.shape[1] // layer.groups, math.prod(layer.kernel_size))
    budgets = _budgets(layer, x)
    n, t1 = shape[0], budgets[-1][1].rows
    assert [plan.slabs for _, plan in budgets][1:] == [n, *([2] if n > 2 else []), 1]
    assert budgets[0][1].rows == 1 and budgets[0][1].slabs == n * t1
    for chunks in range(1, k + 1):
        for budget, plan in budgets:
            if chunks not in (1, 2, k) and plan.slabs > 1:
                continue  # (every c on one slab; a few on every slab size)
            got = input_factor(layer, x, memory_budget=budget, chunks=chunks)
            assert rel_err(got, ref) < TOL, (chunks, budget, plan)


#: Geometries whose operations are counted: dense, strided, 1-d, 3-d, grouped, transposed.
COUNTED = (
    "bp-first-3",
    "bp-conv-1",
    "replicate-3d",
    "depthwise-2d",
    "convT-outpad-2d",
    "bp-convT-3",
)


def _writes(graph) -> int:
    """The in-place copies of a traced graph."""
    return sum(node.target is torch.ops.aten.copy_.default for node in graph.graph.nodes)


@pytest.mark.parametrize("case", [g for g in GEOMETRIES if g[0] in COUNTED], ids=COUNTED)
def test_a_traced_factor_in_row_blocks_gives_the_same_factor(case):
    """In a traced step the row blocks may be tensors of their own, joined by a gather
    (no block of one buffer written): the traced graph, run again, gives the unfold
    reference for c = 2 and the most, on slabs of one row, one sample, several samples
    and the whole batch, on a dense, strided, 1-d, 3-d, grouped and transposed layer
    (flipped after the join)."""
    from memconv._torch import make_fx_real

    _, cls, kwargs, shape = case
    layer = _layer(cls, kwargs)
    x = torch.randn(shape, dtype=torch.float64)
    ref = omega_reference(layer, x)
    k = most_chunks(x.shape[1] // layer.groups, math.prod(layer.kernel_size))
    written = _writes(make_fx_real(lambda x: patches(layer, x).source, (x,)))
    free = copy.deepcopy(costs.calibration("cpu"))  # a free join: every c > 1 is joined
    free["time"]["kfac-join"] = {"per_element": 0.0, "per_element_spilled": 0.0}
    for chunks in sorted({2, k} - {1}):
        for budget, plan in _budgets(layer, x):

            def factor(x):
                return input_factor(layer, x, memory_budget=budget, chunks=chunks)  # noqa: B023

            with costs.using("cpu", free):
                graph = make_fx_real(factor, (x,))
            targets = {node.target for node in graph.graph.nodes}
            assert torch.ops.memconv.expand_input_factor.default not in targets
            assert _writes(graph) == written, (chunks, budget, plan)  # the padded input's
            assert rel_err(graph(x), ref) < TOL, (chunks, budget, plan)


@pytest.mark.parametrize("case", [g for g in GEOMETRIES if g[0] in COUNTED], ids=COUNTED)
def test_plan_counts_the_operations_and_products_it_issues(case):
    """The plan's predicted top-level operations are those the factor issues after the
    padded input (and the select of a one-group factor), and its products the
    ``bmm``/``baddbmm``/``baddbmm_`` calls: c per slab, for every c and slab size."""
    from memconv.bench.ops import count

    _, cls, kwargs, shape = case
    layer = _layer(cls, kwargs)
    x = torch.randn(shape, dtype=torch.float64)
    k = most_chunks(x.shape[1] // layer.groups, math.prod(layer.kernel_size))
    before = count(lambda: patches(layer, x))["top_level"] + (layer.groups == 1)
    for chunks in sorted({1, 2, k}):
        for budget, _ in _budgets(layer, x):
            plan = expand_plan(layer, x, memory_budget=budget, chunks=chunks)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = count(
                    lambda b=budget, c=chunks: input_factor(layer, x, memory_budget=b, chunks=c),
                    warmup=0,
                    by_name=True,
                )
            names = got["names"]
            assert got["top_level"] == before + plan.operations, (chunks, budget, plan, names)
            kinds = ("aten::bmm", "aten::baddbmm", "aten::baddbmm_")
            products = sum(names.get(kind, 0) for kind in kinds)
            assert products == plan.products == plan.slabs * chunks, (chunks, budget, names)


def test_uninitialised_accumulator_is_never_read(monkeypatch):
    """The accumulator is allocated empty (no zero fill): the first slab's products
    (``beta=0``) and the mirroring copies write every entry. With the empty tensors
    filled with NaN, every plan still gives the reference."""
    layer = _layer(nn.Conv2d, dict(in_channels=3, out_channels=2, kernel_size=3, padding=1))
    x = torch.randn(3, 3, 5, 4, dtype=torch.float64)
    ref = omega_reference(layer, x)
    empty = torch.Tensor.new_empty

    def nan_empty(self, *size, **kwargs):
        return empty(self, *size, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", nan_empty)
    for budget, plan in _budgets(layer, x):
        for chunks in (1, 2, 9):
            got = input_factor(layer, x, memory_budget=budget, chunks=chunks)
            assert rel_err(got, ref) < TOL, (budget, chunks, plan)


def test_plan_products_and_multiply_adds():
    """c products per slab, and the block upper triangle's multiply-adds: (c+1)/c
    times the symmetric half's when c divides K, the half's (+ the diagonal blocks'
    other half) at c = K, the whole square at c = 1."""
    layer = nn.Conv2d(4, 2, 3, padding=1)
    x = torch.randn(2, 4, 5, 5)
    square = 2 * 25 * (4 * 9) ** 2  # N·T·(C·K)²
    for chunks, fraction in ((1, 1.0), (3, 4 / 6), (9, 10 / 18)):
        plan = expand_plan(layer, x, memory_budget=2**40, chunks=chunks)
        assert plan.products == chunks and plan.slabs == 1
        assert plan.multiply_adds == square * fraction
    with pytest.raises(ValueError, match="from 1 to 9 for this layer"):
        expand_plan(layer, x, chunks=10)
    with pytest.raises(TypeError, match="chunks must be None or an int"):
        input_factor(layer, x, chunks=2.0)
    with pytest.raises(ValueError, match="expand"):
        input_factor(layer, x, kfac_approx="reduce", chunks=2)


def test_chunks_chosen_by_the_device_prices():
    """The c of least predicted time: up to K where arithmetic is dear against an
    operation (the CPU's prices), a few where operations are (the CUDA calibration's,
    on a small batch, a near tie to the fewer operations), one where only operations
    cost."""
    from memconv.strategies import costs

    layer = nn.Conv2d(96, 96, 3, padding=1)
    x = torch.randn(8, 96, 32, 32)
    with costs.using("cpu", costs.calibration("cpu")):
        assert expand_plan(layer, x).chunks == 9
    with costs.using("cpu", costs.calibration("cuda")):
        assert 2 <= expand_plan(layer, x).chunks <= 5
    only_ops = copy.deepcopy(costs.calibration("cpu"))
    only_ops["time"]["ghost-offsets"]["per_flop"] = 0.0
    with costs.using("cpu", only_ops):
        assert expand_plan(layer, x).chunks == 1


def test_a_near_tie_goes_to_the_form_of_fewer_operations(monkeypatch):
    """Priced by a launch-bound device's calibration (the CUDA one's), among the forms
    within ``NEAR_TIE`` of the least predicted time (the eager form's price,
    multiply-adds and operations, recomputed here) the plan takes the fewest
    operations; with no margin, the least time. A CPU's prices are taken as they are:
    the least time, c = K on this layer."""
    from memconv.conv import kronecker
    from memconv.strategies import costs

    layer = nn.Conv2d(96, 96, 3, padding=1)
    x = torch.randn(8, 96, 32, 32)
    with costs.using("cpu", costs.calibration("cuda")):
        assert costs.fitted_device("cpu") == "cuda"
        per_mac = costs.time_coefficients("ghost-offsets", "cpu")[0]
        plans = {c: expand_plan(layer, x, chunks=c) for c in range(1, 10)}
        price = {
            c: per_mac * p.multiply_adds + costs.operations_time(p.operations, "cpu")
            for c, p in plans.items()
        }
        least = min(price.values())
        near = [c for c in price if price[c] <= least * (1 + kronecker.NEAR_TIE)]
        chosen = expand_plan(layer, x)
        assert chosen.chunks in near and len(near) > 1, (price, chosen)
        assert chosen.operations == min(plans[c].operations for c in near)
        assert chosen.operations < plans[min(price, key=price.get)].operations
        monkeypatch.setattr(kronecker, "NEAR_TIE", 0.0)
        assert expand_plan(layer, x).chunks == min(price, key=price.get)
    monkeypatch.setattr(kronecker, "NEAR_TIE", 0.5)
    with costs.using("cpu", costs.calibration("cpu")):
        assert costs.fitted_device("cpu") == "cpu"
        assert expand_plan(layer, x).chunks == 9


def test_input_factor_equals_torch_unfold():
    layer = _layer(
        nn.Conv2d,
        dict(
            in_channels=3,
            out_channels=2,
            kernel_size=(3, 2),
            stride=(2, 1),
            padding=(1, 2),
            dilation=(2, 1),
        ),
    )
    x = torch.randn(3, 3, 8, 7, dtype=torch.float64)
    u = F.unfold(x, (3, 2), dilation=(2, 1), padding=(1, 2), stride=(2, 1))
    assert rel_err(input_factor(layer, x), torch.einsum("nit,njt->ij", u, u) / 3) < TOL


def test_input_factor_of_memconv_layer_and_float32():
    layer = memconv.modules.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 5, 5)
    ref = omega_reference(layer, x.double())
    got = input_factor(layer, x)
    assert got.dtype == torch.float32
    assert rel_err(got.double(), ref) < 1e-5


def test_input_factor_refusals():
    layer = nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 5, 5)
    with pytest.raises(ValueError, match="kfac_approx"):
        input_factor(layer, x, kfac_approx="average")
    with pytest.raises(ValueError, match="memory_budget"):
        input_factor(layer, x, memory_budget=0)
    with pytest.raises(TypeError, match="module"):
        input_factor(nn.Linear(3, 4), x)
    with pytest.raises(ValueError, match="C_in=3"):
        input_factor(layer, torch.randn(2, 4, 5, 5))


# ---------------------------------------------------------------- through BackPACK


def _model(cls, kwargs, shape, seed=0):
    """BackPACK's ``Sequential(conv, ReLU, Flatten, Linear(out, 5))``, float64."""
    layer = _layer(cls, kwargs, seed)
    with torch.no_grad():
        out = layer(torch.zeros(shape, dtype=torch.float64)).flatten(1).shape[1]
    torch.manual_seed(seed + 1)
    return nn.Sequential(layer, nn.ReLU(), nn.Flatten(), nn.Linear(out, 5)).double()


def _run(model, x, y, name, *, memconv_exts, **options):
    model = extend(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    ext = KRONECKER[name]()
    if memconv_exts:
        for module in model.modules():
            module_ext = module_extension(ext, type(module), **options)
            if module_ext is not None:
                ext.set_module_extension(type(module), module_ext, overwrite=True)
    torch.manual_seed(3)  # KFAC's Monte-Carlo sample
    with backpack.backpack(ext), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_fn(model(x), y).backward()
    return {n: getattr(p, ext.savefield) for n, p in model.named_parameters() if p.requires_grad}


#: KFAC and KFRA differ from KFLR only in the output factor: a few geometries each.
FEW = ("bp-first-3", "bp-conv-1", "bp-convT-3", "circular-1d", "depthwise-2d", "convT-outpad-2d")
BACKPACK_CASES = [pytest.param(c, "KFLR", id=f"{c[0]}-KFLR") for c in GEOMETRIES] + [
    pytest.param(c, name, id=f"{c[0]}-{name}")
    for c in GEOMETRIES
    for name in ("KFAC", "KFRA")
    if c[0] in FEW
]


@pytest.mark.parametrize(("case", "name"), BACKPACK_CASES)
def test_backpack_kronecker(case, name):
    """Equal to BackPACK alone where it computes the factors; otherwise the
    definition: ``A`` the (block-diagonal) exact bias GGN for KFLR, Ω by unfold."""
    _, cls, kwargs, shape = case
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 5, (shape[0],))
    got = _run(_model(cls, kwargs, shape), x, y, name, memconv_exts=True)
    conv = _model(cls, kwargs, shape)[0]
    groups = conv.groups
    backpack_right = groups == 1 and getattr(conv, "padding_mode", "zeros") == "zeros"
    backpack_right = backpack_right and not isinstance(conv.padding, str)
    # BackPACK's transposed unfold drops the positions output_padding adds
    backpack_right = backpack_right and not any(getattr(conv, "output_padding", (0,)))
    if backpack_right:
        ref = _run(_model(cls, kwargs, shape), x, y, name, memconv_exts=False)
        assert list(got) == list(ref)
        for key in ref:
            assert len(got[key]) == len(ref[key])
            for a, b in zip(got[key], ref[key]):
                assert rel_err(a, b) < TOL, key
        return
    a, omega = got["0.weight"]
    assert rel_err(omega, omega_reference(conv, x)) < TOL
    if name == "KFLR" and conv.bias is not None:
        model = _model(cls, kwargs, shape)
        full = bias_ggn(model, model[0], nn.CrossEntropyLoss(), x, y)
        assert rel_err(a, _block_diag(full, groups)) < TOL
        assert rel_err(got["0.bias"][0], full) < TOL
    c_out = conv.weight.shape[1] if isinstance(conv, nn.modules.conv._ConvTransposeNd) else None
    c_out = c_out * groups if c_out is not None else conv.out_channels
    expected = (c_out, c_out) if groups == 1 else (groups, c_out // groups, c_out // groups)
    assert a.shape == expected


def test_kfac_reduce_through_backpack():
    model = _model(
        nn.Conv2d,
        dict(in_channels=2, out_channels=3, kernel_size=3, padding=1, groups=1),
        (3, 2, 5, 5),
    )
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 5, (3,))
    got = _run(model, x, y, "KFLR", memconv_exts=True, kfac_approx="reduce")
    assert rel_err(got["0.weight"][1], omega_reference(model[0], x, "reduce")) < TOL


def test_memconv_modules_and_adaptive_pool():
    """memconv's Conv2d and an AdaptiveAvgPool2d (BackPACK's Kronecker extensions
    refuse it) equal torch's Conv2d and the equivalent frozen averaging convolution
    under BackPACK alone (BackPACK's AvgPool2d fails in float64)."""
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 5, (4,))

    def net(conv_cls, pool):
        torch.manual_seed(0)
        return nn.Sequential(
            conv_cls(3, 4, 3, padding=1), nn.ReLU(), pool, nn.Flatten(), nn.Linear(4 * 4, 5)
        ).double()

    for name in KRONECKER:
        got = _run(
            net(memconv.modules.Conv2d, nn.AdaptiveAvgPool2d(2)), x, y, name, memconv_exts=True
        )
        average = nn.Conv2d(4, 4, 3, stride=3, groups=4, bias=False).double()
        average.weight.data.fill_(1 / 9)
        average.weight.requires_grad_(False)
        ref = _run(net(nn.Conv2d, average), x, y, name, memconv_exts=False)
        for key in ref:
            for a, b in zip(got[key], ref[key]):
                assert rel_err(a, b) < TOL, (name, key)


def test_module_extension_covers_only_kronecker_layers():
    assert module_extension(extensions.DiagGGNExact(), nn.Conv2d) is None
    assert module_extension(extensions.KFAC(), nn.ReLU) is None
    assert module_extension(extensions.KFRA(), nn.Linear) is None  # BackPACK's own
    assert module_extension(extensions.KFAC(), memconv.modules.ConvTranspose3d) is not None
    with pytest.raises(ValueError, match="kfac_approx"):
        module_extension(extensions.KFAC(), nn.Conv2d, kfac_approx="mean")


def test_tied_weight_refused():
    conv = nn.Conv2d(2, 2, 3, padding=1).double()
    model = nn.Sequential(conv, nn.ReLU(), conv, nn.Flatten(), nn.Linear(2 * 16, 5)).double()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="several calls"):
        _run(model, x, torch.tensor([0, 1]), "KFLR", memconv_exts=True)


# ---------------------------------------------------------------- the benchmark, tiny


def test_benchmark_measures_and_tabulates():
    from memconv.bench import second_order as bench

    got = bench.measure("memconv", "KFAC", "allcnnc", classes=10, batch=2)
    assert got["peak_alloc_mib"] > got["result_mib"] > 0 and got["time_s"] > 0
    case = {"model": "allcnnc", "classes": 10, "batch": 8}
    figures = {"peak_rss_mib": 10.0, "peak_alloc_mib": 20.0, "result_mib": 5.0, "time_s": 1.0}
    rows = [
        {**case, "extension": "plain", "engine": "plain", **figures},
        {**case, "extension": "KFAC", "engine": "backpack", **figures, "time_s": 3.0},
        {**case, "extension": "KFAC", "engine": "memconv", **figures, "peak_alloc_mib": 10.0},
        {**case, "extension": "KFAC", "engine": "curvlinops", "error": "ImportError: x"},
    ]
    table = bench.table(rows)
    assert "| allcnnc | 10 | 8 | KFAC | +10 / +20 MiB, 1.00 s |" in table
    assert "+10 / +10 MiB, 1.00 s (1.0×, 0.5×, 1.0×) | 1.00, 0.50, 0.33, 0.33 | fails |" in table
    assert "curvlinops: `ImportError: x`" in bench.errors(rows)


def _param_ggn(model, param, loss_fn, x, y):
    """The exact GGN block of one parameter by torch.func (mean loss), ``[P, P]``."""
    params = dict(model.named_parameters())
    name = next(k for k, p in params.items() if p is param)

    def out(w, xi):
        return torch.func.functional_call(model, {**params, name: w}, (xi[None],))[0]

    total = 0
    for xi, yi in zip(x, y):
        jac = torch.func.jacrev(out)(param.detach(), xi).flatten(1)
        z = out(param.detach(), xi).detach()
        hess = torch.func.hessian(lambda z, yi=yi: loss_fn(z[None], yi[None]))(z)
        total = total + jac.T @ hess @ jac
    return total / len(x)


def test_batch_norm_in_eval():
    """KFLR through BatchNorm2d in eval mode (BackPACK's Kronecker extensions have
    none): γ's and β's factors are their exact GGN blocks; the convolution's below it
    see the exact backpropagated square root."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 16, 5),
    ).double()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
        model[1].weight.uniform_(0.5, 2)
    model.eval()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    y = torch.tensor([0, 3, 4])
    loss_fn = nn.CrossEntropyLoss()
    ref = copy.deepcopy(model)  # torch.func runs on a model without BackPACK's hooks
    params = dict(ref.named_parameters())
    got = _run(model, x, y, "KFLR", memconv_exts=True)
    for name in ("1.weight", "1.bias"):
        (factor,) = got[name]
        assert rel_err(factor, _param_ggn(ref, params[name], loss_fn, x, y)) < TOL, name
    a, omega = got["0.weight"]
    assert rel_err(a, _param_ggn(ref, params["0.bias"], loss_fn, x, y)) < TOL
    assert module_extension(extensions.KFRA(), nn.BatchNorm2d) is None
    model.train()
    with pytest.raises(NotImplementedError, match="training mode"):
        _run(model, x, y, "KFAC", memconv_exts=True)


@pytest.mark.parametrize("groups", [1, 2])
def test_kronecker_layout_is_exact_for_one_position(groups):
    """One sample and one output position: the weight's exact GGN block (of each group)
    is ``A ⊗ Ω`` exactly, which pins down the factors' order and the grouped layout."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, (2, 3), groups=groups)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(6, 5)).double()
    x = torch.randn(1, 4, 2, 3, dtype=torch.float64)
    y = torch.tensor([2])
    ref = copy.deepcopy(model)
    full = _param_ggn(ref, ref[0].weight, nn.CrossEntropyLoss(), x, y)
    a, omega = _run(model, x, y, "KFLR", memconv_exts=True)["0.weight"]
    if groups == 1:
        a, omega = a[None], omega[None]
    size = full.shape[0] // groups
    for g in range(groups):
        block = full[g * size : (g + 1) * size, g * size : (g + 1) * size]
        assert rel_err(torch.kron(a[g], omega[g]), block) < TOL


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_kron_groups_average_on_a_grouped_convolution(kfac_approx):
    """``kron_groups="average"``: one product, ``A`` the full exact bias GGN (KFLR) and
    Ω that of the input averaged over the groups (curvlinops' convention)."""
    conv_kwargs = dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, groups=2)
    shape = (3, 4, 5, 5)
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 5, (shape[0],))
    options = dict(kron_groups="average", kfac_approx=kfac_approx)
    got = _run(_model(nn.Conv2d, conv_kwargs, shape), x, y, "KFLR", memconv_exts=True, **options)
    model = _model(nn.Conv2d, conv_kwargs, shape)
    conv = model[0]
    averaged = nn.Conv2d(2, 6, 3, padding=1).double()
    a, omega = got["0.weight"]
    want = omega_reference(averaged, x.unflatten(1, (2, 2)).mean(1), kfac_approx)
    assert rel_err(omega, want) < TOL
    assert rel_err(a, bias_ggn(model, conv, nn.CrossEntropyLoss(), x, y)) < TOL


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_linear_on_channels_last_is_its_one_by_one_convolution(kfac_approx):
    """A Linear layer on ``[N, H, W, C]`` (torchvision's ConvNeXt; BackPACK's KFAC/KFLR
    raise for inputs that are not 2-d) gets the factors of the equal 1×1 convolution."""
    from backpack.custom_module.permute import Permute

    torch.manual_seed(0)
    linear = nn.Linear(3, 4).double()
    conv = nn.Conv2d(3, 4, 1).double()
    with torch.no_grad():
        conv.weight.copy_(linear.weight[:, :, None, None])
        conv.bias.copy_(linear.bias)
    head = nn.Linear(4 * 5 * 5, 5).double()
    last = nn.Sequential(Permute(0, 2, 3, 1), linear, Permute(0, 3, 1, 2))
    x = torch.randn(3, 3, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 5, (3,))
    runs = []
    for layer in (last, conv):
        model = nn.Sequential(layer, nn.ReLU(), nn.Flatten(), copy.deepcopy(head))
        runs.append(
            list(_run(model, x, y, "KFLR", memconv_exts=True, kfac_approx=kfac_approx).values())
        )
    for got, want in zip(*runs):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert rel_err(a, b) < TOL


def test_kron_groups_refused_before_any_work():
    from memconv.integrations import backpack as mb

    with pytest.raises(ValueError, match="kron_groups"):
        module_extension(extensions.KFAC(), nn.Conv2d, kron_groups="mean")
    with pytest.raises(ValueError, match="kron_groups"):
        mb.install(extensions.KFAC(), kron_groups="mean")
    with pytest.raises(ValueError, match="kron_groups"), mb.routed(kron_groups=None):
        pass
    transposed = nn.ConvTranspose2d(4, 4, 3, groups=2).double()
    ext = extensions.KFAC()
    model = extend(nn.Sequential(transposed, nn.Flatten(), nn.Linear(4 * 7 * 7, 2).double()))
    loss_fn = extend(nn.CrossEntropyLoss())
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    with (
        mb.installed(ext, kron_groups="average"),
        backpack.backpack(ext),
        pytest.raises(NotImplementedError, match="grouped transposed"),
    ):
        loss_fn(model(x), torch.tensor([0, 1])).backward()


def test_kfac_floor_counts_each_term():
    """The floor of :mod:`memconv.bench.kfac` on two layers, counted by hand: a 3×3
    first layer (no input gradient, no square root backpropagated through it) and a
    strided 1×1 one."""
    from memconv.bench.kfac import conv_layers, floor

    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 1, stride=2))
    x = torch.randn(3, 2, 4, 4)
    layers = conv_layers(net, x)
    assert [(la["t"], la["k"], la["first"]) for la in layers] == [(16, 9, True), (4, 1, False)]
    got = floor(layers)
    fwd = (3 * 16 * 4 * 2 * 9, 3 * 4 * 6 * 4)
    assert got["forward"] == sum(fwd)
    assert got["backward"] == fwd[0] + 2 * fwd[1]
    assert got["sqrt"] == fwd[1]
    assert got["input_factor"] == 3 * 16 * 18 * 19 // 2 + 3 * 4 * 4 * 5 // 2
    assert got["output_factor"] == 3 * 4 * 5 // 2 + 3 * 6 * 7 // 2
    assert got["total"] == 16485 and got["plain"] == 7776


def test_a_traced_plan_counts_its_launches():
    """While a compiled step is traced, an input factor enters the graph as its copies
    (fused), its products and, for c > 1, the join of its row blocks (fused): its plan
    counts a copy and c products a slab and one join, where the eager plan counts every
    view, copy, row block and mirroring copy."""
    from memconv._torch import make_fx_real

    conv = nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(4, 8, 8, 8)
    budget = 3 * 8 * 9 * 64 * 4  # three samples' patches: two slabs
    eager = {c: expand_plan(conv, x, memory_budget=budget, chunks=c) for c in (1, 3)}
    traced = {}

    def trace(x):
        for c in (1, 3):
            traced[c] = expand_plan(conv, x, memory_budget=budget, chunks=c)
        return x.sum()

    make_fx_real(trace, (x,))
    assert eager[1].slabs == traced[1].slabs == 2
    assert traced[1].operations == 2 * traced[1].slabs < eager[1].operations
    assert traced[3].operations == 4 * traced[3].slabs + 1 < eager[3].operations
    assert traced[3].multiply_adds == eager[3].multiply_adds


def test_a_traced_plan_joins_its_row_blocks_where_the_join_costs_less(monkeypatch):
    """In a traced step, c > 1 row blocks are joined by a gather (its few launches) or
    accumulated in place by one custom operator (its operations run as they are),
    whichever the calibration prices faster: on the CPU a small Ω is joined and a
    large one, whose join reads past the cache, accumulated in place; where the join
    is free (the CUDA calibration's, not measured) every c > 1 is joined; where it is
    dear, none is. Eagerly no plan is joined."""
    from memconv.conv import kronecker
    from memconv.strategies import costs

    small = nn.Conv2d(8, 8, 3, padding=1)
    large = nn.Conv2d(256, 8, 3, padding=1)
    xs, xl = torch.randn(4, 8, 16, 16), torch.randn(4, 256, 8, 8)
    assert not expand_plan(small, xs, chunks=4).joined
    monkeypatch.setattr(kronecker, "tracing", lambda: True)
    cpu = costs.calibration("cpu")
    with costs.using("cpu", cpu):
        assert expand_plan(small, xs, chunks=4).joined
        assert not expand_plan(large, xl, chunks=4).joined
    with costs.using("cpu", costs.calibration("cuda")):
        assert expand_plan(small, xs, chunks=4).joined and expand_plan(large, xl, chunks=4).joined
    dear = copy.deepcopy(cpu)
    dear["time"]["kfac-join"]["per_element"] = 1.0
    with costs.using("cpu", dear):
        assert not expand_plan(small, xs, chunks=4).joined
    # the price: per entry of Ω, more where the blocks and Ω outgrow the cache
    rates = cpu["time"]["kfac-join"]
    side = 256 * 9
    with costs.using("cpu", cpu):
        seconds = kronecker.join_time(side, 1, 4, 4, "cpu")
    assert seconds == pytest.approx(side**2 * (rates["per_element"] + rates["per_element_spilled"]))
