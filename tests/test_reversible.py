"""memconv.reversible: reversible blocks whose inputs are released and reconstructed.

Every gradient is compared, in float64 to 1e-10, with an independent reference: the
same blocks without the wrapper (``loss.backward()``), and per-sample autograd loops
for memconv's per-sample functions. The second training step is the one that counts
(the first backward pass of a wrapper checks its inverse against the real input and
uses that input). Memory is checked as the allocator sees it: which storages are still
alive (``StorageWeakRef``) and what autograd saves (``saved_tensors_hooks``), not RSS.
"""

import copy
import warnings
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import loop_reference, rel_err
from torch import nn

import memconv
from memconv._torch import graph_task_id, storage_weakref
from memconv.reversible import (
    AdditiveCoupling,
    AffineAdapterNaive,
    AffineAdapterSigmoid,
    AffineCoupling,
    InvertibleModuleWrapper,
    ReversibleBlock,
    check_reconstruction,
    create_coupling,
    is_invertible_module,
)

TOL = 1e-10
LOSS = nn.CrossEntropyLoss(reduction="sum")


def half(c=2, conv=nn.Conv2d):
    """One residual function on a half: conv, GroupNorm, tanh."""
    return nn.Sequential(conv(c, c, 3, padding=1), nn.GroupNorm(1, c), nn.Tanh())


def coupling(kind: str, c: int = 2):
    if kind == "additive":
        return AdditiveCoupling(half(c))
    if kind == "affine-naive":
        return AffineCoupling(
            nn.Sequential(half(c), nn.Conv2d(c, c, 1)), adapter=AffineAdapterNaive
        )
    if kind == "affine-sigmoid":
        return AffineCoupling(
            nn.Sequential(half(c), nn.Conv2d(c, 2 * c, 1)), adapter=AffineAdapterSigmoid
        )
    raise ValueError(kind)


COUPLINGS = ("additive", "affine-naive", "affine-sigmoid")


def network(kind="additive", depth=3, wrap=True, seed=0, **options):
    """A stem, ``depth`` coupling blocks (wrapped or not) and a head, float64."""
    torch.manual_seed(seed)
    blocks = [coupling(kind) for _ in range(depth)]
    if wrap:
        blocks = [InvertibleModuleWrapper(b, **options) for b in blocks]
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), *blocks, nn.Flatten(), nn.Linear(4 * 5 * 5, 3)
    ).double()


def data(n=4):
    torch.manual_seed(1)
    return torch.randn(n, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (n,))


def step(model, x, y):
    """One training step's gradients: the parameters' (by model name) and the input's."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    LOSS(model(x), y).backward()
    return {"input": x.grad, **{k: p.grad for k, p in model.named_parameters()}}


def assert_close(got: dict, ref: dict, tol=TOL):
    assert list(got) == list(ref)
    for k in ref:
        assert rel_err(got[k], ref[k]) < tol, k


def unwrapped_names(model):
    """The model's parameter names as the same network without wrappers names them."""
    return [k.replace("._fn.", ".") for k, _ in model.named_parameters()]


def renamed(grads: dict) -> dict:
    return {k.replace("._fn.", "."): v for k, v in grads.items()}


# plain training: loss.backward() and torch.autograd.grad


@pytest.mark.parametrize("keep_input", [False, True])
@pytest.mark.parametrize("kind", COUPLINGS)
def test_gradients_are_those_of_the_blocks_without_the_wrapper(kind, keep_input):
    plain, wrapped = network(kind, wrap=False), network(kind, keep_input=keep_input)
    x, y = data()
    ref = step(plain, x, y)
    for _ in range(2):  # the first pass checks the inverse, the second reconstructs
        got = renamed(step(wrapped, x, y))
        assert_close(got, ref)


def test_torch_autograd_grad_runs_through_the_wrapper():
    plain, wrapped = network(wrap=False), network()
    x, y = data()
    ref = step(plain, x, y)
    step(wrapped, x, y)
    xr = x.clone().requires_grad_()
    params = list(wrapped.parameters())
    grads = torch.autograd.grad(LOSS(wrapped(xr), y), [xr, *params])
    assert_close(dict(zip(["input", *unwrapped_names(wrapped)], grads)), ref)


def test_inverse_direction_releases_and_differentiates_too():
    torch.manual_seed(0)
    fn = coupling("affine-naive").double()
    wrapped = InvertibleModuleWrapper(copy.deepcopy(fn))
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    for _ in range(2):
        for m in (fn, wrapped):
            m.zero_grad(set_to_none=True)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        fn.inverse(a).square().sum().backward()
        wrapped.inverse(b).square().sum().backward()
        assert rel_err(b.grad, a.grad) < TOL
        for p, q in zip(fn.parameters(), wrapped.parameters()):
            assert rel_err(q.grad, p.grad) < TOL


class Pair(nn.Module):
    """An invertible module made of two wrapped couplings (nested wrappers)."""

    def __init__(self):
        super().__init__()
        self.a = InvertibleModuleWrapper(coupling("additive"))
        self.b = InvertibleModuleWrapper(coupling("affine-naive"))

    def forward(self, x):
        return self.b(self.a(x))

    def inverse(self, y):
        return self.a.inverse(self.b.inverse(y))


def nested(wrap=True):
    torch.manual_seed(0)
    blocks = [Pair(), Pair()]
    if wrap:
        blocks = [InvertibleModuleWrapper(b) for b in blocks]
    else:
        for b in blocks:
            for w in (b.a, b.b):
                w.disable = True
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), *blocks, nn.Flatten(), nn.Linear(100, 3))


def test_nested_wrappers():
    plain, wrapped = nested(wrap=False).double(), nested().double()
    x, y = data()
    ref = renamed(step(plain, x, y))  # (inner wrappers disabled)
    for _ in range(2):
        assert_close(renamed(step(wrapped, x, y)), ref)
    # per-sample gradients through both levels
    per = memconv.per_sample_grads(wrapped, LOSS, x, y)
    assert_close(renamed(per), renamed(loop_reference(plain, LOSS, x, y)))


def test_inference_calls_the_block_as_it_is():
    wrapped = network()
    x, _ = data()
    with torch.no_grad():
        out = wrapped[1](wrapped[0](x))
    assert out.grad_fn is None
    assert torch.equal(out, wrapped[1]._fn(wrapped[0](x)).detach())
    assert getattr(out, "_memconv_reversible_slot", None) is None  # nothing released


def test_several_backward_passes_need_num_bwd_passes():
    x, y = data()
    wrapped = network()
    step(wrapped, x, y)  # the check of the inverse
    loss = LOSS(wrapped(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"num_bwd_passes=1.*num_bwd_passes=2"):
        loss.backward()
    twice = network(num_bwd_passes=2)
    step(twice, x, y)
    ref = step(network(wrap=False), x, y)
    twice.zero_grad(set_to_none=True)
    loss = LOSS(twice(x), y)
    loss.backward(retain_graph=True)
    loss.backward()
    for k, p in zip(unwrapped_names(twice), twice.parameters()):
        assert rel_err(p.grad, 2 * ref[k]) < TOL, k


def test_rng_state_preserved_for_dropout():
    def model(wrap):
        torch.manual_seed(0)
        fm = nn.Sequential(half(), nn.Dropout(0.5))  # drawn first in forward and inverse
        block = AdditiveCoupling(fm, half())
        if wrap:
            block = InvertibleModuleWrapper(block, preserve_rng_state=True)
        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), block, nn.Flatten(), nn.Linear(100, 3))

    plain, wrapped = model(False).double(), model(True).double()
    x, y = data()
    for seed in (3, 4):
        torch.manual_seed(seed)
        ref = step(plain, x, y)
        torch.manual_seed(seed)
        assert_close(renamed(step(wrapped, x, y)), ref)


def test_batch_norm_statistics_are_updated_once_per_step():
    def model(wrap):
        torch.manual_seed(0)
        blocks = [AdditiveCoupling(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2)))]
        blocks.append(copy.deepcopy(blocks[0]))
        return nn.Sequential(*(InvertibleModuleWrapper(b) if wrap else b for b in blocks)).double()

    plain, wrapped = model(False), model(True)
    x, _ = data()
    x = torch.cat([x, x.flip(0)], 1)
    for _ in range(2):
        for m in (plain, wrapped):
            m(x).square().sum().backward()
        for a, b in zip(plain.buffers(), wrapped.buffers()):
            assert torch.equal(a, b)


def chain_step(blocks, x, inverse: bool) -> dict:
    """One step through ``blocks`` in a direction: the output, the input's gradient and
    the parameters' (by their names without wrappers), for ``(out ** 2).sum()``."""
    blocks.zero_grad(set_to_none=True)
    xr = out = x.clone().requires_grad_()
    for block in blocks if isinstance(blocks, nn.Sequential) else [blocks]:
        out = block.inverse(out) if inverse else block(out)
    out.square().sum().backward()
    params = renamed({k: p.grad for k, p in blocks.named_parameters()})
    return {"output": out.detach(), "input": xr.grad, **params}


def batch_norm_chain(wrap: bool, train: bool, **options):
    """Two additive couplings whose functions hold BatchNorm, float64, with running
    statistics away from their initial values."""
    torch.manual_seed(0)
    first = AdditiveCoupling(
        nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2), nn.Tanh())
    )
    blocks = [first, copy.deepcopy(first)]
    model = nn.Sequential(*(InvertibleModuleWrapper(b, **options) if wrap else b for b in blocks))
    model.double()
    with torch.no_grad():
        for b in model.buffers():
            b.add_(torch.rand(b.shape, dtype=torch.float64) if b.is_floating_point() else 3)
    return model.train(train)


@pytest.mark.parametrize(
    "keep_input, keep_input_inverse", [(False, False), (True, False), (False, True), (True, True)]
)
@pytest.mark.filterwarnings("error::UserWarning")  # every input released (blocks called in a loop)
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm_inside_blocks_every_direction_and_mode(
    train, inverse, keep_input, keep_input_inverse
):
    plain = batch_norm_chain(False, train)
    wrapped = batch_norm_chain(
        True, train, keep_input=keep_input, keep_input_inverse=keep_input_inverse
    )
    x, _ = data()
    x = torch.cat([x, x.flip(0)], 1)
    for _ in range(2):  # the first pass checks the inverse, the second reconstructs
        results = [chain_step(model, x, inverse) for model in (plain, wrapped)]
        assert_close(results[1], results[0])
        for (k, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers()):
            assert torch.equal(a, b), k  # updated once per call, as the conventional chain


def test_autocast_state_is_replayed():
    plain, wrapped = network(wrap=False).float(), network().float()
    x, _ = data()
    grads = []
    for m in (plain, wrapped, wrapped):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x.float())
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(grads[0], grads[2]):
        assert rel_err(b, a) < 0.1  # bfloat16's round-off, the inverse's included


# memory


def chain_storages(model, x):
    """Weak references to the storages of the blocks' outputs of one forward pass."""
    refs = []
    h = model[0](x)
    for block in model[1:-2]:
        h = block(h)
        refs.append(storage_weakref(h))
    return refs, model[-1](model[-2](h))


def test_forward_pass_releases_every_activation_but_the_last():
    x, y = data()
    wrapped = network(depth=4)
    step(wrapped, x, y)
    refs, out = chain_storages(wrapped, x.requires_grad_())
    assert [not r.expired() for r in refs] == [False, False, False, True]
    LOSS(out, y).backward()


def saved_bytes(model, x, y) -> int:
    """Bytes autograd saves for the backward pass of one forward pass (parameters
    excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        LOSS(model(x), y)
    return sum(seen.values())


def test_saved_memory_is_constant_in_depth():
    x, y = data()
    wrapped = {d: network(depth=d) for d in (2, 8)}
    plain = {d: network(depth=d, wrap=False) for d in (2, 8)}
    for m in wrapped.values():
        step(m, x, y)
    assert saved_bytes(wrapped[8], x, y) == saved_bytes(wrapped[2], x, y)
    assert saved_bytes(plain[8], x, y) > 3 * saved_bytes(plain[2], x, y)


def test_first_step_keeps_inputs_to_check_the_inverse():
    x, y = data()
    wrapped = network(depth=3)
    refs, out = chain_storages(wrapped, x)
    assert all(not r.expired() for r in refs)  # kept for the check
    LOSS(out, y).backward()
    assert all(w._verified for w in wrapped[1:-2])


def test_the_walk_holds_one_block_at_a_time():
    """During memconv's per-sample pass, when a block's layers are recomputed, at most
    the block's own input and output, and the chain's last output, are alive."""
    x, y = data()
    wrapped = network(depth=5)
    step(wrapped, x, y)
    outputs, alive = [], []

    def record(module, args, output):
        outputs.append(storage_weakref(output))

    def count(module, args):
        if graph_task_id() is not None:  # the recomputation, in the backward pass
            alive.append(sum(not r.expired() for r in outputs))

    hooks = [b.register_forward_hook(record) for b in wrapped[1:-2]]
    hooks += [b._fn.Fm.register_forward_pre_hook(count) for b in wrapped[1:-2]]
    try:
        memconv.clip_and_accumulate(wrapped, LOSS, x, y, max_norm=1.0, clip_route="two-pass")
    finally:
        for h in hooks:
            h.remove()
    assert len(alive) == 10 and max(alive) <= 3, alive  # the walk's pass, then the second


def test_check_mode_keeps_inputs_and_reports_every_block():
    x, y = data()
    wrapped = network(depth=4)
    step(wrapped, x, y)
    with check_reconstruction(wrapped) as report:
        got = renamed(step(wrapped, x, y))
    assert list(report.errors) == ["4", "3", "2", "1"]  # in backward order
    assert 0 < report.worst() < 1e-12
    assert_close(got, step(network(depth=4, wrap=False), x, y))
    assert "relative" in str(report)


def test_float32_error_grows_along_the_chain():
    torch.manual_seed(0)
    model = nn.Sequential(
        *[InvertibleModuleWrapper(coupling("affine-naive", 4)) for _ in range(12)]
    )
    x = torch.randn(4, 8, 6, 6, requires_grad=True)
    with check_reconstruction(model) as report:
        model(x).sum().backward()
    errors = report.errors
    assert errors["0"].relative > errors["11"].relative > 0


# memconv's per-sample functions


def per_sample_case(kind):
    plain, wrapped = network(kind, wrap=False), network(kind)
    x, y = data(5)
    step(wrapped, x, y)
    return plain, wrapped, x, y, loop_reference(plain, LOSS, x, y)


@pytest.mark.parametrize("kind", COUPLINGS)
def test_per_sample_grads_and_norms(kind):
    plain, wrapped, x, y, ref = per_sample_case(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer reported unseen, nothing left to zeros
        got = memconv.per_sample_grads(wrapped, LOSS, x, y)
    assert_close(renamed(got), ref)
    norms = memconv.per_sample_norms(wrapped, LOSS, x, y, per_parameter=True)
    for k, v in renamed(norms).items():
        assert rel_err(v, ref[k].flatten(1).norm(dim=1)) < TOL, k


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("wrap", [False, True], ids=["coupling", "wrapped"])
@pytest.mark.parametrize("implementation", [0, 1])
def test_per_sample_grads_through_memcnn_implementations(implementation, wrap):
    torch.manual_seed(0)
    f = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.Tanh())
    block = AdditiveCoupling(f, None, implementation, implementation)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        InvertibleModuleWrapper(block) if wrap else block,
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 3),
    ).double()
    x, y = data(5)
    step(model, x, y)  # the first step checks the inverses
    assert_close(memconv.per_sample_grads(model, LOSS, x, y), loop_reference(model, LOSS, x, y))


def clipped_sum(ref: dict, groups: dict, max_norm: float) -> dict:
    out = {}
    members = defaultdict(list)
    for k, g in groups.items():
        members[g].append(k)
    for names in members.values():
        norms = torch.stack([ref[k].flatten(1).pow(2).sum(1) for k in names]).sum(0).sqrt()
        c = (max_norm / norms).clamp(max=1.0)
        for k in names:
            out[k] = torch.einsum("n,n...->...", c, ref[k])
    return out


@pytest.mark.parametrize("groups", ["all", "layer"])
@pytest.mark.parametrize("route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("kind", ["additive", "affine-naive"])
def test_clip_and_accumulate(kind, route, groups):
    plain, wrapped, x, y, ref = per_sample_case(kind)
    names = list(ref)
    layer = {k: k.rsplit(".", 1)[0] for k in names}
    grouping = {k: "all" for k in names} if groups == "all" else layer
    norms = clipped_sum(ref, grouping, 1.0)
    wrapped.zero_grad(set_to_none=True)
    memconv.clip_and_accumulate(wrapped, LOSS, x, y, max_norm=1.0, clip_route=route, groups=groups)
    got = {k: p.grad for k, p in zip(unwrapped_names(wrapped), wrapped.parameters())}
    assert_close(got, norms)


def test_a_group_made_of_a_whole_block():
    """A group holding one block's parameters, whose layers clip in the pass no group of
    their own: the block's group takes the clipping route."""
    plain, wrapped, x, y, ref = per_sample_case("additive")
    names = list(ref)
    grouping = {k: "block" if k.startswith("2.") else "rest" for k in names}
    mapping = {k: grouping[u] for (k, _), u in zip(wrapped.named_parameters(), names)}
    wrapped.zero_grad(set_to_none=True)
    memconv.clip_and_accumulate(wrapped, LOSS, x, y, max_norm=1.0, groups=mapping)
    got = {k: p.grad for k, p in zip(names, wrapped.parameters())}
    expected = clipped_sum(ref, grouping, 1.0)
    assert_close(got, {k: expected[k] for k in names})


def test_private_step_over_several_steps():
    plain, wrapped, x, y, ref = per_sample_case("additive")
    private = memconv.PrivateStep(wrapped, LOSS)
    for _ in range(2):
        wrapped.zero_grad(set_to_none=True)
        private.clip_and_accumulate(x, y, max_norm=1.0)
        got = {k: p.grad for k, p in zip(unwrapped_names(wrapped), wrapped.parameters())}
        assert_close(got, clipped_sum(ref, {k: "all" for k in ref}, 1.0))
    assert private.probes == 1


class Scaled(nn.Module):
    """A parameter used in the parent's forward (the model route), around a block."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.body(x) * self.scale


class NoRule(nn.Module):
    """A layer without a rule (the generic route), inside a block."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2).view(2, 1, 1))

    def forward(self, x):
        return torch.tanh(x) * self.w


class OwnScale(nn.Module):
    """An invertible module with a parameter of its own used in its forward pass (the
    model route, from inside the block)."""

    def __init__(self):
        super().__init__()
        self.log_scale = nn.Parameter(torch.linspace(-0.2, 0.2, 4).view(1, 4, 1, 1))

    def forward(self, x):
        return x * self.log_scale.exp() + 0.1

    def inverse(self, y):
        return (y - 0.1) / self.log_scale.exp()


@pytest.mark.parametrize("wrap", [False, True])
def test_other_routes_around_and_inside_blocks(wrap):
    def model(wrap):
        torch.manual_seed(0)
        w = InvertibleModuleWrapper if wrap else (lambda fn: fn)
        return nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            Scaled(w(coupling("additive"))),
            w(AdditiveCoupling(NoRule())),
            w(OwnScale()),
            nn.Flatten(),
            nn.Linear(100, 3),
        ).double()

    plain, wrapped = model(False), model(wrap)
    x, y = data()
    step(wrapped, x, y)
    got = memconv.per_sample_grads(wrapped, LOSS, x, y)
    assert_close(renamed(got), loop_reference(plain, LOSS, x, y))


def test_save_memory_strategy_applies_inside_blocks():
    from memconv.strategies import get_strategy

    def model(wrap):
        torch.manual_seed(0)
        w = InvertibleModuleWrapper if wrap else (lambda fn: fn)
        fm = nn.Sequential(memconv.Conv2d(2, 2, 3, padding=1), nn.Tanh())
        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), w(AdditiveCoupling(fm)))

    x, _ = data()
    plain, wrapped = model(False).double(), model(True).double()
    shift = get_strategy("shift")
    real, calls = shift.vjp, []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    shift.vjp = spy
    try:
        grads = []
        for m in (plain, wrapped, wrapped):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the block is used: no warning on exit
                with memconv.save_memory("shift"):
                    out = m(x).square().sum()
            calls.clear()
            out.backward()  # outside the block: the recorded strategy applies
            assert len(calls) == 2  # Fm's and Gm's convolution
            grads.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad(set_to_none=True)
    finally:
        shift.vjp = real
    for a, b in zip(grads[0], grads[2]):
        assert rel_err(b, a) < TOL


def test_opacus_hooks_see_the_recomputed_layers():
    opacus = pytest.importorskip("opacus")
    x, y = data()
    got = []
    for wrap in (False, True):
        model = opacus.GradSampleModule(network(wrap=wrap), loss_reduction="sum")
        for _ in range(2 if wrap else 1):
            model.zero_grad(set_to_none=True)
            for p in model.parameters():
                p.grad_sample = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # hooks on a block without inputs
                LOSS(model(x), y).backward()
        got.append([p.grad_sample for p in model.parameters()])
    for a, b in zip(*got):
        assert rel_err(b, a) < TOL


def test_opacus_make_private_through_blocks():
    """memconv's private path (Opacus' engine, memconv's clipped sum) on a model with
    reversible blocks: the optimizer's gradient is the clipped sum over the expected
    batch size (no noise)."""
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from memconv.integrations import opacus as mo

    plain, wrapped, x, y, ref = per_sample_case("additive")
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Opacus: secure RNG off
        model, optimizer, loader = mo.make_private(
            PrivacyEngine(),
            module=wrapped,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
        for xb, yb in loader:
            optimizer.zero_grad()
            LOSS(model(xb), yb).backward()
            optimizer.step()
    expected = clipped_sum(ref, {k: "all" for k in ref}, 1.0)
    got = {k: p.grad * len(x) for k, p in zip(unwrapped_names(wrapped), wrapped.parameters())}
    assert_close(got, expected)


# what cannot be done: refused or warned, naming the block


def test_an_input_read_elsewhere_is_kept_with_a_warning():
    plain, wrapped = network(wrap=False), network()
    x, y = data()
    step(wrapped, x, y)

    def loss(model):
        h = model[1](model[0](x))
        out = model[-1](model[-2](model[3](model[2](h))))
        return LOSS(out, y) + h.square().sum()  # h: read by a layer after the chain

    ref = {
        k: v
        for k, v in zip(
            unwrapped_names(wrapped), torch.autograd.grad(loss(plain), list(plain.parameters()))
        )
    }
    with pytest.warns(
        UserWarning,
        match=r"input of block 2 was still held when the next block ran .*not released.*exact",
    ):
        grads = torch.autograd.grad(loss(wrapped), list(wrapped.parameters()))
    assert_close(dict(zip(unwrapped_names(wrapped), grads)), ref)


class Broken(nn.Module):
    """Claims an inverse that is not one."""

    def __init__(self):
        super().__init__()
        self.fm = half()

    def forward(self, x):
        return x + self.fm(x)

    def inverse(self, y):
        return y - self.fm(y)


def test_a_wrong_inverse_raises_at_the_first_backward_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), InvertibleModuleWrapper(Broken()))
    model = nn.Sequential(*model, nn.Flatten(), nn.Linear(50, 3)).double()
    x, y = data()
    with pytest.raises(ValueError, match=r"^1: fn's inverse .*Broken.inverse is not its inverse"):
        LOSS(model(x), y).backward()
    assert model[1]._fn.fm[0].weight.grad is None  # the block's parameters untouched
    keep = InvertibleModuleWrapper(Broken(), keep_input=True).double()  # no inverse: fine
    keep(x.requires_grad_()).sum().backward()


class TinyScale(nn.Module):
    """An affine half-step whose scale is 1e-2: its inverse is one, but divides the
    round-off of ``y - shift`` by 1e-2 (twice: one half's error enters the other's)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, h):
        return torch.full_like(h, 1e-2) * self.w, h + 1


def test_an_ill_conditioned_inverse_warns_at_the_first_backward_pass():
    torch.manual_seed(0)
    block = InvertibleModuleWrapper(AffineCoupling(TinyScale()))
    x = torch.randn(3, 4, 5, 5, requires_grad=True)
    with pytest.warns(UserWarning, match="amplifies round-off"):
        block(x).sum().backward()
    assert block._verified  # a warning, not a refusal


def test_random_numbers_without_preserve_rng_state_are_caught():
    torch.manual_seed(0)
    block = InvertibleModuleWrapper(AdditiveCoupling(nn.Sequential(half(), nn.Dropout(0.5))))
    x = torch.randn(3, 4, 5, 5, requires_grad=True)
    with pytest.raises(ValueError, match="preserve_rng_state=True"):
        block(x).sum().backward()


def test_a_module_without_inverse_is_refused_at_its_call():
    block = InvertibleModuleWrapper(half())  # MemCNN takes it; is_invertible_module says False
    assert not is_invertible_module(block, (2, 2, 5, 5))
    x = torch.randn(2, 2, 5, 5, requires_grad=True)
    for call in (block, block.inverse):
        with pytest.raises(TypeError, match="fn must be a torch.nn.Module with an inverse"):
            call(x)
    disabled = InvertibleModuleWrapper(half(), disable=True)  # calls fn as it is
    assert torch.equal(disabled(x), disabled._fn(x))


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: InvertibleModuleWrapper("fn"), TypeError, "fn must be a torch.nn.Module"),
        (
            lambda: InvertibleModuleWrapper(coupling("additive"), keep_input=1),
            TypeError,
            "keep_input",
        ),
        (lambda: InvertibleModuleWrapper(coupling("additive"), disable="no"), TypeError, "disable"),
        (
            lambda: InvertibleModuleWrapper(coupling("additive"), num_bwd_passes=0),
            ValueError,
            "num_bwd_passes",
        ),
        (
            lambda: InvertibleModuleWrapper(coupling("additive"), num_bwd_passes=1.5),
            TypeError,
            "num_bwd_passes",
        ),
        (
            lambda: InvertibleModuleWrapper(coupling("additive"), preserve_rng_state=None),
            TypeError,
            "preserve_rng_state",
        ),
        (lambda: AdditiveCoupling(half(), Gm="g"), TypeError, "Gm must be"),
        (lambda: AdditiveCoupling(lambda x: x), TypeError, "Fm must be"),
        (lambda: AdditiveCoupling(half(), split_dim=1.0), TypeError, "split_dim"),
        (lambda: AffineCoupling(half(), adapter=3), TypeError, "adapter must be callable"),
        (lambda: AffineAdapterNaive(None), TypeError, "module must be"),
        (
            lambda: is_invertible_module(coupling("additive"), (2, "a")),
            ValueError,
            "test_input_shape",
        ),
        (lambda: check_reconstruction("model").__enter__(), TypeError, "model must be"),
    ],
)
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_bad_inputs_leave_the_state_unchanged():
    block = InvertibleModuleWrapper(coupling("additive"))
    with pytest.raises(ValueError, match="split_dim=1 .* even size"):
        block(torch.randn(2, 3, 5, 5, requires_grad=True))
    with pytest.raises(TypeError, match="takes one or more tensors"):
        block(torch.randn(2, 4, 5, 5, requires_grad=True), 3)
    assert not block._verified and block._where is not None or block._where is None


def test_is_invertible_module():
    assert is_invertible_module(coupling("additive"), (2, 4, 5, 5))
    assert is_invertible_module(InvertibleModuleWrapper(coupling("affine-naive")), (2, 4, 5, 5))
    assert not is_invertible_module(Broken(), (2, 2, 5, 5))
    assert not is_invertible_module(half(), (2, 2, 5, 5))


def test_memcnn_names_and_arguments():
    import inspect

    def args(f):
        return list(inspect.signature(f).parameters)

    assert args(InvertibleModuleWrapper) == [
        "fn",
        "keep_input",
        "keep_input_inverse",
        "num_bwd_passes",
        "disable",
        "preserve_rng_state",
    ]
    implementations = ["implementation_fwd", "implementation_bwd"]
    assert args(AdditiveCoupling) == ["Fm", "Gm", *implementations, "split_dim"]
    assert args(AffineCoupling) == ["Fm", "Gm", "adapter", *implementations, "split_dim"]
    assert args(create_coupling) == ["Fm", "Gm", "coupling", *implementations, "adapter"]
    assert args(ReversibleBlock) == [
        "Fm",
        "Gm",
        "coupling",
        "keep_input",
        "keep_input_inverse",
        *implementations,
        "adapter",
    ]
    assert args(is_invertible_module) == [
        "module_in",
        "test_input_shape",
        "test_input_dtype",
        "atol",
        "random_seed",
    ]
    torch.manual_seed(0)
    fm = half()
    block = AdditiveCoupling(fm)
    assert block.Fm is fm and block.Gm is not fm  # Gm=None: a deep copy
    assert all(
        not torch.equal(a, b) or a is not b for a, b in zip(fm.parameters(), block.Gm.parameters())
    )


def test_positional_arguments_bind_as_memcnn_binds_them():
    torch.manual_seed(0)
    f, g = half(), half()
    x = torch.randn(2, 4, 5, 5)
    block = AdditiveCoupling(f, g, -1)  # MemCNN: implementation_fwd=-1, split_dim stays 1
    assert (block.implementation_fwd, block.implementation_bwd, block.split_dim) == (-1, -1, 1)
    assert torch.equal(block(x), AdditiveCoupling(f, g, split_dim=1)(x))
    affine = AffineCoupling(f, g, AffineAdapterNaive, -1, -1, 1)
    assert affine.split_dim == 1 and isinstance(affine.Fm, AffineAdapterNaive)
    with pytest.raises(NotImplementedError, match="implementation_fwd=2"):
        AdditiveCoupling(f, g, 2)
    with pytest.raises(NotImplementedError, match="implementation_bwd=-2"):
        AffineCoupling(f, g, None, 0, -2)
    with pytest.raises(TypeError, match="implementation_fwd must be -1, 0 or 1"):
        AdditiveCoupling(f, g, 1.0)
    with pytest.raises(NotImplementedError, match="unknown coupling method 'reversible'"):
        create_coupling(f, g, "reversible")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("implementation", [0, 1])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("kind", ["additive", "affine"])
def test_memcnn_implementations_give_the_gradients_of_autograd(kind, inverse, implementation):
    """MemCNN's implementations 0 (recompute from the kept input) and 1 (reconstruct
    from the output): the gradients of the coupling's own graph (-1)."""
    adapter = AffineAdapterNaive if kind == "affine" else None

    def make(implementation):
        torch.manual_seed(0)
        f = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.Tanh())
        return create_coupling(f, None, kind, implementation, implementation, adapter).double()

    plain = make(-1)
    with pytest.warns(DeprecationWarning, match="deprecated"):
        other = make(implementation)
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    for _ in range(2):  # the first pass checks the inverse, the second reconstructs
        grads = [chain_step(block, x, inverse) for block in (plain, other)]
        assert_close(grads[1], grads[0])
    assert "_memcnn_passes" not in dict(other.named_modules())  # not a submodule: same state_dict
    assert list(other.state_dict()) == list(plain.state_dict())


# DistributedDataParallel over two gloo processes


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_distributed_data_parallel(tmp_path):
    from ddp_worker import (
        CLIP_ROUTES,
        MAX_NORM,
        SPLITS,
        WORLD,
        batch,
        reversible_model,
        run_reversible,
    )

    mp.spawn(run_reversible, args=(str(tmp_path),), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    x, y = batch()
    model = reversible_model()
    for m in model.modules():
        if isinstance(m, InvertibleModuleWrapper):
            m.disable = True
    model.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()  # each rank's mean, averaged by DDP
    expected = {k: p.grad for k, p in model.named_parameters()}
    per = loop_reference(model, nn.CrossEntropyLoss(reduction="sum"), x, y)
    clipped = clipped_sum(per, {k: "all" for k in per}, MAX_NORM)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    for rank, got in enumerate(ranks):
        for grads in got["step"]:
            assert_close(grads, expected)
        for route in CLIP_ROUTES:
            grads, local = got["clip"][route]
            assert_close(grads, clipped)
            assert rel_err(local, norms[SPLITS["halves"][rank]]) < TOL


# the benchmark's commands (python -m memconv.bench.reversible), at toy sizes


def test_benchmark_measures_and_tabulates():
    from memconv.bench import reversible as bench

    memory = bench.measure_memory("memconv", 2, batch=2, size=8, channels=8)
    assert memory["peak_alloc_mib"] > 0 and memory["params"] > 0
    times = bench.measure_times(
        ["conventional", "memconv-clip"], 2, batch=2, size=8, channels=8, repeats=1
    )
    assert set(times["times_s"]) == {"conventional", "memconv-clip"}
    rows = [
        {"depth": d, "engine": e, "peak_rss_mib": 1.0, "peak_alloc_mib": float(d), "time_s": t}
        for d in (4, 8)
        for e, t in (("conventional", 1.0), ("memconv", 1.3))
    ]
    rows.append({"depth": 8, "engine": "memcnn", "skipped": "no --memcnn-python"})
    table = bench.steps_table(rows)
    assert "| 8 | memconv | 1 | 8 | 2.00 | 1.30 | 1.30 |" in table
    assert "| 8 | memcnn | no --memcnn-python |" in table
    page = "a\n<!-- reversible:steps -->\nold\n<!-- /reversible:steps -->\nb"
    assert bench.fill(page, "steps", "new") == page.replace("old", "new")
    with pytest.raises(ValueError, match="no <!-- reversible:errors -->"):
        bench.fill(page, "errors", "x")


def test_benchmark_reconstruction_errors():
    from memconv.bench import reversible as bench

    worst, last = bench.reconstruction_errors(2, "affine", torch.float64)
    assert 0 <= last <= worst < 1e-12
    rows = [{"coupling": "additive", "dtype": "float32", "depth": 2, "first_block": 1e-7}]
    assert "| additive | float32 | 1.0e-07 |" in bench.errors_table(rows)
