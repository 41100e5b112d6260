"""BackPACK's extensions on a ``torch.compile``'d model: ``memconv.integrations.backpack.step``.

The reference of every compiled step is the same step run eagerly on the uncompiled
model (``with backpack(ext): lossfunc(model(x), y).backward()``), in float64 to 1e-10
relative; the eager extensions are themselves tested against BackPACK and autograd
elsewhere, and the GGN diagonal is checked here against an autograd GGN too. Most
cases compile with ``backend="aot_eager"`` (the graph memconv hands a backend is what
is tested; seconds, not minutes); one small model goes through inductor.
"""

import warnings

import pytest
import torch
from helpers import CallCounter, rel_err
from torch import nn
from torch._dynamo.utils import counters

from memconv.bench import models

backpack = pytest.importorskip("backpack")
from backpack import extend, extensions  # noqa: E402

from memconv.integrations import backpack as mb  # noqa: E402
from memconv.integrations.backpack.compiled import traces  # noqa: E402
from memconv.integrations.backpack.kronecker import AvgPoolDerivatives  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")
TOL = 1e-10


@pytest.fixture(autouse=True)
def _setup():
    torch.set_num_threads(1)  # tiny tensors (conftest restores the count)
    counters.clear()


def _pooled_cnn():
    """Average pooling, a grouped convolution, BatchNorm in eval mode."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, groups=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


def _tv_resnet():  # in-place ReLU, ``out += identity``, BatchNorm in eval mode
    return models.TVResNet((1, 1, 1, 1), num_classes=5, width=4)


def _wide_cnn():
    """32- and 128-channel 3×3 layers, whose input factors the CPU's prices take in row
    blocks: joined in a traced step where Ω is small (288²), accumulated in place where
    it is large (1152²)."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 128, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(128, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


def _setup_model(build, side=8, seed=0):
    torch.manual_seed(seed)
    net = build().double().eval()
    model = mb.extend(net)
    x = torch.randn(4, 3, side, side, dtype=torch.float64)
    y = torch.randint(0, 5, (4,))
    return model, extend(nn.CrossEntropyLoss()), x, y


def _results(model, field):
    return [(p.grad.clone(), getattr(p, field)) for p in model.parameters()]


def _clear(model, field):
    for p in model.parameters():
        p.grad = None
        if hasattr(p, field):
            delattr(p, field)


def _flat(results):
    out = []
    for grad, value in results:
        out.append(grad)
        out.extend(value if isinstance(value, list) else [value])
    return out


def _assert_equal(got, want, tol=TOL):
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert rel_err(a, b) < tol


def _eager(model, lossfunc, x, y, ext, seed=0):
    _clear(model, ext.savefield)
    torch.manual_seed(seed)
    with backpack.backpack(ext):
        lossfunc(model(x), y).backward()
    return _results(model, ext.savefield)


def _compiled_steps(compiled, model, lossfunc, x, y, ext, steps=3, seed=0):
    out = []
    for _ in range(steps):
        _clear(model, ext.savefield)
        torch.manual_seed(seed)
        mb.step(compiled, lossfunc, x, y, ext)
        out.append(_results(model, ext.savefield))
    return out


CASES = [
    *((_pooled_cnn, name) for name in ("KFLR", "KFAC", "DiagGGNExact", "DiagGGNMC", "BatchGrad")),
    *((_tv_resnet, name) for name in ("KFLR", "KFAC")),  # the rest: seconds more each
]


@pytest.mark.parametrize(
    "build, name", CASES, ids=[f"{b.__name__.strip('_')}-{n}" for b, n in CASES]
)
def test_a_compiled_models_backpack_step_is_the_eager_one(build, name):
    model, lossfunc, x, y = _setup_model(build)
    with mb.installed(getattr(extensions, name)()) as ext:
        want = _eager(model, lossfunc, x, y, ext)
        compiled = torch.compile(model, backend="aot_eager")
        for got in _compiled_steps(compiled, model, lossfunc, x, y, ext):
            # the Monte-Carlo ones too: aot_eager draws from torch's generator
            _assert_equal(got, want)
    assert traces(compiled) == 1
    assert counters["aot_autograd"]["total"] == 1  # one graph, compiled once
    assert not counters["graph_break"] and not counters["recompiles"]


def test_the_compiled_ggn_diagonal_is_autograds():
    """DiagGGNExact of the compiled step against ``Jᵀ H J`` by autograd, per sample."""
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    params = dict(model.named_parameters())
    with mb.installed(extensions.DiagGGNExact()) as ext:
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            _clear(model, ext.savefield)
            mb.step(compiled, lossfunc, x, y, ext)
    want = {name: torch.zeros_like(p) for name, p in params.items()}
    for n in range(len(x)):

        def logits(*values, n=n):
            named = dict(zip(params, values))
            return torch.func.functional_call(model, named, (x[n : n + 1],))[0]

        jac = torch.autograd.functional.jacobian(logits, tuple(params.values()))
        prob = logits(*params.values()).softmax(0).detach()
        hessian = (torch.diag(prob) - torch.outer(prob, prob)) / len(x)  # the mean loss
        for name, j in zip(params, jac):
            flat = j.reshape(len(prob), -1)
            want[name] += ((hessian @ flat) * flat).sum(0).reshape(want[name].shape)
    for name, p in params.items():
        assert rel_err(p.diag_ggn_exact, want[name]) < TOL


def test_inductor_compiles_the_backpack_step():
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    with mb.installed(extensions.KFLR()) as ext:
        want = _eager(model, lossfunc, x, y, ext)
        compiled = torch.compile(model)
        got = _compiled_steps(compiled, model, lossfunc, x, y, ext, steps=2)
    for g in got:
        _assert_equal(g, want, tol=1e-9)  # inductor reorders float64 sums
    assert traces(compiled) == 1 and not counters["graph_break"]


def test_inductors_monte_carlo_kfac_draws_its_own_samples():
    """KFAC's input factors are deterministic and equal; the output factors are other
    Monte-Carlo samples of the same quantity, symmetric positive semi-definite."""
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    with mb.installed(extensions.KFAC()) as ext:
        want = _eager(model, lossfunc, x, y, ext)
        compiled = torch.compile(model)
        got = _compiled_steps(compiled, model, lossfunc, x, y, ext, steps=2)[-1]
    for (grad, factors), (grad_want, factors_want) in zip(got, want):
        assert rel_err(grad, grad_want) < 1e-9
        for a, b in zip(factors[1:], factors_want[1:]):
            assert rel_err(a, b) < 1e-9
        out = factors[0]
        assert out.shape == factors_want[0].shape
        assert rel_err(out, out.mT) < 1e-12 and torch.linalg.eigvalsh(out).min() > -1e-10


def test_gradients_accumulate_as_backward_does():
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    with mb.installed(extensions.KFLR()) as ext:
        want = _eager(model, lossfunc, x, y, ext)
        compiled = torch.compile(model, backend="aot_eager")
        _clear(model, ext.savefield)
        loss = None
        for _ in range(3):
            loss = mb.step(compiled, lossfunc, x, y, ext)
    for p, (grad, factors) in zip(model.parameters(), want):
        assert rel_err(p.grad, 3 * grad) < TOL
        _assert_equal([(p.grad / 3, p.kflr)], [(grad, factors)])
    assert loss.ndim == 0 and not loss.requires_grad
    assert rel_err(loss, lossfunc(model(x), y).detach()) < TOL


def test_a_new_shape_or_extension_traces_again():
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    compiled = torch.compile(model, backend="aot_eager")
    with mb.installed(extensions.KFLR(), extensions.DiagGGNExact()) as (kflr, diag):
        for inputs, targets in ((x, y), (x[:2], y[:2]), (x, y)):
            mb.step(compiled, lossfunc, inputs, targets, kflr)
        assert traces(compiled) == 2
        want = _eager(model, lossfunc, x[:2], y[:2], diag)
        _clear(model, diag.savefield)
        mb.step(compiled, lossfunc, x[:2], y[:2], diag)
        assert traces(compiled) == 3
        _assert_equal(_results(model, diag.savefield), want)


def test_another_loss_function_traces_its_own_step():
    """The loss function's operations are in the traced graph: a step with another
    loss (here the sum instead of the mean) gets its own graph, and the first loss'
    graph serves it again when it comes back."""
    model, mean, x, y = _setup_model(_pooled_cnn)
    total = extend(nn.CrossEntropyLoss(reduction="sum"))
    compiled = torch.compile(model, backend="aot_eager")
    with mb.installed(extensions.DiagGGNExact()) as diag:
        for lossfunc in (mean, total, mean):
            got = _compiled_steps(compiled, model, lossfunc, x, y, diag)[-1]
            _assert_equal(got, _eager(model, lossfunc, x, y, diag))
        assert traces(compiled) == 2


def test_a_module_attribute_changed_between_steps_traces_again():
    """BatchNorm's ``eps`` (a plain attribute, a constant of the traced graph) changed
    between steps: the next step traces its own graph and gives the eager numbers; the
    first graph serves the first value again."""
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    compiled = torch.compile(model, backend="aot_eager")
    norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    with mb.installed(extensions.DiagGGNExact()) as diag:
        for eps in (1e-5, 0.5, 1e-5):
            norm.eps = eps
            got = _compiled_steps(compiled, model, lossfunc, x, y, diag)[-1]
            _assert_equal(got, _eager(model, lossfunc, x, y, diag))
        assert traces(compiled) == 2


def test_a_new_step_at_every_call_stops_tracing_at_the_limit(monkeypatch):
    """A model whose step key changes at every call (a counter attribute) traces a
    graph per call up to ``MAX_GRAPHS`` (here 3), then runs eagerly with one warning
    instead of tracing and keeping a graph at every call; the numbers are the eager
    path's throughout."""
    from memconv.engine import traced

    monkeypatch.setattr(traced, "MAX_GRAPHS", 3)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), CallCounter(), nn.ReLU(), nn.Flatten(), nn.Linear(36 * 4, 5)
    )
    model = mb.extend(net.double(), use_converter=False)
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 4])
    compiled = torch.compile(model, backend="aot_eager")
    with mb.installed(extensions.BatchGrad()) as ext:
        want = _eager(model, lossfunc, x, y, ext)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _compiled_steps(compiled, model, lossfunc, x, y, ext, steps=6)
    full = [w for w in caught if "holds 3 graphs already" in str(w.message)]
    assert len(full) == 1 and full[0].filename == __file__  # (the user's line)
    assert traces(compiled) == 3
    for g in got:
        _assert_equal(g, want)


def test_an_uncompiled_model_runs_backpacks_own_step():
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    with mb.installed(extensions.KFLR()) as ext:
        want = _eager(model, lossfunc, x, y, ext)
        _clear(model, ext.savefield)
        mb.step(model, lossfunc, x, y, ext)
        _assert_equal(_results(model, ext.savefield), want, tol=1e-300)
    assert traces(model) == 0


class _HostRead(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum().item() > -1e9 else x


def test_a_step_that_cannot_be_traced_warns_and_runs_eagerly():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), _HostRead(), nn.Flatten(), nn.Linear(4 * 36, 5))
    model = mb.extend(net.double(), use_converter=False)  # fx cannot trace .item()
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 4])
    with mb.installed(extensions.BatchGrad()) as ext:
        want = _eager(model, lossfunc, x, y, ext)
        compiled = torch.compile(model, backend="aot_eager")
        with pytest.warns(RuntimeWarning, match="BackPACK step .* runs eagerly.*host read"):
            got = _compiled_steps(compiled, model, lossfunc, x, y, ext, steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # once per model and reason
            got += _compiled_steps(compiled, model, lossfunc, x, y, ext, steps=1)
    for g in got:
        _assert_equal(g, want)


def test_a_model_that_is_not_extended_raises_naming_the_parameter():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 36, 5)).double()
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 4])
    compiled = torch.compile(net, backend="aot_eager")
    with mb.installed(extensions.KFLR()) as ext:
        with pytest.raises(RuntimeError, match="no 'kflr' for parameter '0.weight'.*extend"):
            mb.step(compiled, lossfunc, x, y, ext)


def test_bad_arguments_raise_before_any_work():
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        mb.step(lambda t: t, lossfunc, x, y)
    with pytest.raises(TypeError, match="inputs must be a Tensor"):
        mb.step(model, lossfunc, x.tolist(), y)
    with pytest.raises(TypeError, match="extensions must be BackPACK extension objects"):
        mb.step(model, lossfunc, x, y, "KFAC")
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "dims, kernel, stride, padding, side",
    [
        (1, 3, 2, 1, 9),
        (2, 2, None, 0, 8),
        (2, 3, 2, 1, 8),
        (2, (3, 2), (1, 2), (1, 0), 7),
        (3, 2, 1, 0, 4),
    ],
)
def test_average_poolings_transposed_jacobian_is_autograds(dims, kernel, stride, padding, side):
    """memconv's average-pooling derivatives in float64 (BackPACK's run a float32
    module, which fails there) against ``torch.func.vjp`` of the pooling."""
    pool = getattr(nn, f"AvgPool{dims}d")(kernel, stride=stride, padding=padding)
    x = torch.randn(2, 3, *(side,) * dims, dtype=torch.float64)
    pool.input0, pool.output = x, pool(x)
    mat = torch.randn(4, *pool.output.shape, dtype=torch.float64)  # V = 4
    got = AvgPoolDerivatives(N=dims).jac_t_mat_prod(pool, None, None, mat)
    _, vjp = torch.func.vjp(pool, x)
    want = torch.stack([vjp(m)[0] for m in mat])
    assert rel_err(got, want) < TOL
    jmp = AvgPoolDerivatives(N=dims).jac_mat_prod(
        pool, None, None, torch.randn(4, *x.shape).double()
    )
    assert jmp.shape == (4, *pool.output.shape)


def _conv_pool():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(36, 5))


def test_float64_average_pooling_under_kflr():
    """BackPACK alone fails on a float64 AvgPool2d (a float32 transposed convolution);
    routed through memconv, its factors are float64 and the float32 ones' to rounding."""
    model, lossfunc, x, y = _setup_model(_conv_pool)
    with pytest.raises(RuntimeError, match="Double|Float"):
        _eager(model, lossfunc, x, y, extensions.KFLR())
    with mb.installed(extensions.KFLR()) as ext:
        got = _eager(model, lossfunc, x, y, ext)
        model32 = model.float()
        want = _eager(model32, lossfunc, x.float(), y, ext)
    for (_, a), (_, b) in zip(got, want):
        for fa, fb in zip(a, b):
            assert fa.dtype == torch.float64 and rel_err(fa.float(), fb) < 1e-5


@pytest.mark.parametrize("pricing", ["cpu", "cuda"])
def test_the_input_factor_enters_the_traced_graph_in_the_priced_form(pricing, monkeypatch):
    """A convolution's KFAC input factor enters the traced graph in the form its plan
    priced: one product per slab, or row blocks joined by one gather (launches a
    compiler fuses; what the CUDA calibration, whose launches cost and whose join is
    free, takes), or row blocks accumulated in place by one custom operator (what the
    CPU's prices take on a wide layer, whose join would cost more than its
    operations). No write into blocks of one buffer is left for a compiler to
    functionalise. The compiled step equals the eager one either way."""
    from memconv.conv import kronecker
    from memconv.integrations.backpack.compiled import _steps
    from memconv.strategies import costs

    model, lossfunc, x, y = _setup_model(_wide_cnn, side=16)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    inputs = []
    hooks = [c.register_forward_hook(lambda m, a, out: inputs.append(a[0])) for c in convs]
    model(x)
    for h in hooks:
        h.remove()
    with costs.using("cpu", costs.calibration(pricing)):
        with monkeypatch.context() as traced:  # the plans a traced step prices
            traced.setattr(kronecker, "tracing", lambda: True)
            plans = [kronecker.expand_plan(c, a) for c, a in zip(convs, inputs)]
        with mb.installed(extensions.KFAC()) as ext:
            compiled = torch.compile(model, backend="aot_eager")
            eager = [_eager(model, lossfunc, x, y, ext)]
            got = _compiled_steps(compiled, model, lossfunc, x, y, ext, steps=2)
    for g in got:
        _assert_equal(g, eager[0])
    (entry,) = _steps[model].graphs.values()
    targets = [node.target for node in entry.graph.graph.nodes if node.op == "call_function"]
    aten = torch.ops.aten
    in_place = [p for p in plans if p.chunks > 1 and not p.joined]
    joined = [p for p in plans if p.joined]
    if pricing == "cpu":
        assert in_place == [plans[3]] and plans[1] in joined
    else:
        assert not in_place and joined
    assert targets.count(torch.ops.memconv.expand_input_factor.default) == len(in_place)
    for written in (aten.copy_.default, aten.slice_scatter.default, aten.copy.default):
        assert written not in targets
    products = sum(targets.count(op.default) for op in (aten.bmm, aten.baddbmm, aten.baddbmm_))
    assert products >= sum(p.products for p in plans if p not in in_place)
    # each layer's zero-padded input is one padding, and a gather joins the row blocks
    assert targets.count(aten.constant_pad_nd.default) == len(convs)
    assert targets.count(aten.index.Tensor) == len(joined)


def test_a_step_after_a_stopped_backward_pass_starts_without_its_quantities():
    """A backward pass that stops midway (BackPACK's error at a layer it has no rule
    for) leaves quantities in the extension object, keyed by tensor addresses; the next
    step starts without them, so a reused address cannot add a stale quantity to a
    new one, and the same error comes again, not one of chance."""
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    ext = extensions.KFLR()
    with pytest.raises(NotImplementedError, match="AdaptiveAvgPool2d"):
        mb.step(model, lossfunc, x, y, ext)
    assert ext.saved_quantities._saved_quantities  # left by the stopped pass
    seen = []
    hook = next(model.children()).register_forward_pre_hook(
        lambda m, args: seen.append(len(ext.saved_quantities._saved_quantities))
    )
    try:
        for _ in range(3):
            with pytest.raises(NotImplementedError, match="AdaptiveAvgPool2d"):
                mb.step(model, lossfunc, x, y, ext)
    finally:
        hook.remove()
    assert seen == [0, 0, 0]


def test_a_routed_block_traces_its_own_graph_and_routes_it():
    """Inside ``routed()`` the extension objects are installed when the step's block
    opens (laplace-torch's way): the trace records memconv's module extensions, and
    the same object outside the block traces another graph, BackPACK's own."""
    model, lossfunc, x, y = _setup_model(_pooled_cnn)
    compiled = torch.compile(model, backend="aot_eager")
    ext = extensions.KFLR()
    with mb.routed(kron_groups="blocks"):
        want = _eager(model, lossfunc, x, y, ext)
        got = _compiled_steps(compiled, model, lossfunc, x, y, ext, steps=2)
    for g in got:
        _assert_equal(g, want)
    assert traces(compiled) == 1
    # outside the block: another key, BackPACK's own mapping, which lacks adaptive
    # pooling; the trace stops (warned) and the eager step raises BackPACK's error
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        with pytest.raises(NotImplementedError, match="AdaptiveAvgPool2d"):
            mb.step(compiled, lossfunc, x, y, ext)
    assert traces(compiled) == 1
