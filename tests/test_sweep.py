"""Every per-sample rule of the registry swept over the shapes users feed it.

For each rule class in :func:`memconv.layers.registered` (so a rule registered later
joins by registering; one without an entry in ``SHAPES`` fails), and for a layer
with no rule (the generic route), hypothesis draws: one of the layer types the rule
is registered for, its options (bias, affine, padding_idx, groups, ...), a batch of
0–4 samples, the extra dimensions the layer accepts, each of size 0–4, a Linear
after it or not, float64. The whole-model functions (``per_sample_grads``,
``per_sample_norms`` with each norm route, ``clip_and_accumulate`` by book-keeping
and two passes, each without a budget, with the process's and with the smallest
feasible one) and the Opacus bridge (``batch_first`` both ways, ``loss_reduction``
``"mean"`` and ``"sum"``, grad samplers and ghost clipping's norm samplers) must
match a per-sample autograd loop to 1e-9 relative. Where torch's own forward pass
refuses the shape (a convolution over a length smaller than its kernel), every
function raises torch's error.

Derandomised where the ``CI`` environment variable is set (tests/conftest.py).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import memconv
from memconv.layers import registered
from memconv.layers.conv import ConvRule
from memconv.layers.embedding import EmbeddingRule
from memconv.layers.linear import LinearRule
from memconv.layers.norm import (
    BatchNormRule,
    GroupNormRule,
    InstanceNormRule,
    LayerNormRule,
    RMSNormRule,
)
from memconv.layers.prelu import PReLURule

TOL = 1e-9
DTYPE = torch.float64
SIZES = st.integers(0, 4)  # an extra dimension's size

pytestmark = [
    pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op"),
    pytest.mark.filterwarnings(
        "ignore:Full backward hook is firing when gradients are computed with respect to module"
    ),
    pytest.mark.filterwarnings("ignore:Using a non-full backward hook"),
]


@dataclass
class Case:
    """A layer and a batch for it (batch axis first).

    Attributes:
        layer: the layer, float64, parameters drawn.
        x: its input ``[N, ...]``.
        time_first: whether the layer computes the same per sample on ``x`` with
            axes 0 and 1 swapped (Opacus' ``batch_first=False``).
        opacus: whether Opacus can run the layer at all.
    """

    layer: nn.Module
    x: torch.Tensor
    time_first: bool = False
    opacus: bool = True


def _dims(cls) -> int:
    """1, 2 or 3 from a class name ending in ``1d``/``2d``/``3d``."""
    return int(re.search(r"(\d)d$", cls.__name__).group(1))


def _seeded(draw):
    torch.manual_seed(draw(st.integers(0, 2**16)))


def _perturb(layer: nn.Module) -> nn.Module:
    """Float64, every parameter drawn at random (norm layers start at ones and zeros)."""
    layer = layer.to(DTYPE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


# ------------------------------------------------------------------ shapes per rule
@st.composite
def conv_shapes(draw, cls, n):
    dims = _dims(cls)
    transposed = "Transpose" in cls.__name__
    groups = draw(st.sampled_from([1, 2]))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    k = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    options = dict(stride=stride, dilation=dilation, groups=groups, bias=draw(st.booleans()))
    if transposed:
        options["padding"] = tuple(draw(st.integers(0, 1)) for _ in range(dims))
        options["output_padding"] = tuple(
            draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation)
        )
    else:
        options["padding"] = draw(
            st.one_of(st.just("valid"), st.tuples(*[st.integers(0, 2)] * dims))
        )
        options["padding_mode"] = draw(
            st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"])
        )
    _seeded(draw)
    layer = _perturb(cls(c_in, c_out, k, **options))
    # sizes 0–4, or at least the kernel's span (which torch refuses less often)
    spans = [d * (kk - 1) + 1 for d, kk in zip(dilation, k)]
    sizes = [draw(SIZES | st.integers(span, span + 2)) for span in spans]
    x = torch.randn(n, c_in, *sizes, dtype=DTYPE)
    return Case(layer, x)


@st.composite
def linear_shapes(draw, cls, n):
    _seeded(draw)
    layer = _perturb(cls(draw(SIZES), draw(SIZES), bias=draw(st.booleans())))
    extra = draw(st.lists(SIZES, max_size=2))
    x = torch.randn(n, *extra, layer.in_features, dtype=DTYPE)
    return Case(layer, x, time_first=bool(extra))


@st.composite
def embedding_shapes(draw, cls, n):
    vocab = draw(st.integers(1, 5))
    padding_idx = draw(st.one_of(st.none(), st.integers(-vocab, vocab - 1)))
    _seeded(draw)
    layer = _perturb(cls(vocab, draw(SIZES), padding_idx=padding_idx))
    extra = draw(st.lists(SIZES, max_size=2))
    x = torch.randint(0, vocab, (n, *extra))
    return Case(layer, x, time_first=bool(extra))


def _affine(draw, name="affine"):
    return {name: draw(st.booleans())}


@st.composite
def group_norm_shapes(draw, cls, n):
    groups = draw(st.integers(1, 2))
    channels = groups * draw(st.integers(1, 2))
    _seeded(draw)
    layer = _perturb(cls(groups, channels, **_affine(draw)))
    x = torch.randn(n, channels, *draw(st.lists(SIZES, max_size=2)), dtype=DTYPE)
    return Case(layer, x)


@st.composite
def layer_norm_shapes(draw, cls, n):
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    options = _affine(draw, "elementwise_affine")
    if cls.__name__ == "LayerNorm":
        options["bias"] = draw(st.booleans())
    else:  # RMSNorm
        options["eps"] = draw(st.sampled_from([None, 1e-3]))
    _seeded(draw)
    layer = _perturb(cls(shape, **options))
    extra = draw(st.lists(SIZES, max_size=2))
    x = torch.randn(n, *extra, *shape, dtype=DTYPE)
    return Case(layer, x, time_first=bool(extra))


@st.composite
def instance_norm_shapes(draw, cls, n):
    channels = draw(st.integers(1, 3))
    _seeded(draw)
    layer = _perturb(cls(channels, **_affine(draw)))
    x = torch.randn(n, channels, *(draw(SIZES) for _ in range(_dims(cls))), dtype=DTYPE)
    return Case(layer, x)


@st.composite
def batch_norm_shapes(draw, cls, n):
    channels = draw(st.integers(1, 3))
    _seeded(draw)
    layer = _perturb(cls(channels, **_affine(draw))).eval()  # training mode mixes samples
    with torch.no_grad():
        layer.running_mean.normal_()
        layer.running_var.uniform_(0.5, 2.0)
    dims = _dims(cls)
    spatial = draw(st.integers(0, 1)) if dims == 1 else dims  # [N, C] or [N, C, L]
    x = torch.randn(n, channels, *(draw(SIZES) for _ in range(spatial)), dtype=DTYPE)
    # Opacus records a layer's inputs in training mode only, and BatchNorm mixes the
    # samples there: Opacus cannot run BatchNorm with or without memconv
    return Case(layer, x, opacus=False)


@st.composite
def prelu_shapes(draw, cls, n):
    channels = draw(st.integers(1, 3))
    shared = draw(st.booleans())
    _seeded(draw)
    layer = _perturb(cls(1 if shared else channels))
    extra = draw(st.lists(SIZES, max_size=2))
    x = torch.randn(n, channels, *extra, dtype=DTYPE)
    return Case(layer, x, time_first=shared and bool(extra))


class NoRule(nn.Module):
    """A layer memconv has no rule for: ``tanh(x·scale + shift) · gain`` over the last
    axis (the generic route, ``torch.func``)."""

    def __init__(self, features: int, bias: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))
        self.shift = nn.Parameter(torch.randn(features)) if bias else None
        self.gain = nn.Parameter(torch.randn(()))

    def forward(self, x):
        y = x * self.scale
        if self.shift is not None:
            y = y + self.shift
        return torch.tanh(y) * self.gain


class SelfAttention(nn.Module):
    """``MultiheadAttention`` (no rule) over ``[N, L, E]``, batch first."""

    def __init__(self, embed_dim: int, heads: int, bias: bool):
        super().__init__()
        self.attention = nn.MultiheadAttention(embed_dim, heads, bias=bias, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


@st.composite
def generic_shapes(draw, cls, n):
    _seeded(draw)
    if cls is SelfAttention:
        heads = draw(st.integers(1, 2))
        layer = _perturb(cls(heads * draw(st.integers(1, 2)), heads, draw(st.booleans())))
        x = torch.randn(n, draw(SIZES), layer.attention.embed_dim, dtype=DTYPE)
        return Case(layer, x)
    layer = cls(draw(SIZES), draw(st.booleans())).to(DTYPE)
    extra = draw(st.lists(SIZES, max_size=2))
    return Case(layer, torch.randn(n, *extra, layer.scale.shape[0], dtype=DTYPE))


#: How to draw layers and batches for each rule class; the generic route under None.
SHAPES = {
    ConvRule: conv_shapes,
    LinearRule: linear_shapes,
    EmbeddingRule: embedding_shapes,
    GroupNormRule: group_norm_shapes,
    LayerNormRule: layer_norm_shapes,
    RMSNormRule: layer_norm_shapes,
    InstanceNormRule: instance_norm_shapes,
    BatchNormRule: batch_norm_shapes,
    PReLURule: prelu_shapes,
    None: generic_shapes,
}


def _rule_classes() -> list:
    return sorted({type(rule) for rule in registered().values()}, key=lambda c: c.__name__)


def _layer_types(rule_class) -> list[type]:
    if rule_class is None:
        return [NoRule, SelfAttention]
    return sorted(
        (t for t, r in registered().items() if type(r) is rule_class),
        key=lambda t: (t.__module__, t.__name__),
    )


def test_every_registered_rule_has_shapes():
    missing = [c.__name__ for c in _rule_classes() if c not in SHAPES]
    assert not missing, f"no shape strategy in tests/test_sweep.py SHAPES for {missing}"
    assert memconv.layers.find_rule(NoRule(1, True)) is None
    assert memconv.layers.find_rule(nn.MultiheadAttention(2, 1)) is None


def test_a_rule_without_shapes_fails_the_sweep():
    class Odd(nn.Module):
        pass

    @memconv.layers.register(Odd)
    class OddRule(memconv.layers.LayerRule):
        pass

    try:
        with pytest.raises(AssertionError, match="OddRule"):
            test_every_registered_rule_has_shapes()
    finally:
        memconv.layers.unregister(Odd)
    assert Odd not in registered()


# ------------------------------------------------------------------ references
def loss_fn(out, target):
    """A per-sample loss (summed over the sample's entries)."""
    return 0.5 * (out - target).pow(2).sum()


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _record_empty(empty: set, module, out) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    if all(isinstance(o, torch.Tensor) and o.numel() == 0 for o in outs if o is not None):
        empty.add(module)


def loop_grads(model, x, t, axis=0) -> dict[str, torch.Tensor]:
    """Per-sample gradients by one autograd call per sample (batch on ``axis``).

    A layer whose output is empty is constant: its parameters' gradients are zero
    (torch's GroupNorm backward over zero positions gives NaN for the weight)."""
    params = trainable(model)
    empty = set()
    hooks = [
        m.register_forward_hook(lambda m, i, o: _record_empty(empty, m, o)) for m in model.modules()
    ]
    per = []
    try:
        for i in range(x.shape[axis]):
            empty.clear()
            loss = loss_fn(model(x.narrow(axis, i, 1)), t.narrow(axis, i, 1))
            constant = {id(p) for m in empty for p in m.parameters()}
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            per.append(
                [
                    torch.zeros_like(p) if g is None or id(p) in constant else g
                    for g, p in zip(grads, params.values())
                ]
            )
    finally:
        for h in hooks:
            h.remove()
    return {
        name: torch.stack([g[j] for g in per]) if per else p.new_zeros(0, *p.shape)
        for j, (name, p) in enumerate(params.items())
    }


def sq_norms(g: torch.Tensor) -> torch.Tensor:
    return g.pow(2).reshape(len(g), math.prod(g.shape[1:])).sum(1)


def torch_backward_is_finite(model, x, t) -> bool:
    """Whether torch's own backward pass of the batch's loss is finite."""
    params = list(trainable(model).values())
    grads = torch.autograd.grad(loss_fn(model(x), t), params, allow_unused=True)
    return all(g is None or bool(torch.isfinite(g).all()) for g in grads)


def norms_of(grads: dict, n: int) -> torch.Tensor:
    sq = [sq_norms(g) for g in grads.values()]
    return torch.stack(sq).sum(0).sqrt() if sq else torch.zeros(n, dtype=DTYPE)


def assert_close(got: dict, ref: dict, what: str) -> None:
    """Same keys and shapes; entries within TOL of the largest reference entry, or of 1
    (inputs, parameters and targets are standard normal: a gradient that is zero in
    exact arithmetic, LayerNorm's weight over one feature, is round-off in both)."""
    assert list(got) == list(ref), (what, list(got), list(ref))
    scale = max([t.abs().max().item() for t in ref.values() if t.numel()], default=0.0)
    scale = max(scale, 1.0)
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape, (what, name, g.shape, r.shape)
        if r.numel():
            err = (g.double() - r.double()).abs().max().item() / scale
            assert err <= TOL, (what, name, err)


# ------------------------------------------------------------------ the sweep
def _model(case: Case, tail: bool) -> nn.Sequential:
    with torch.no_grad():
        out = case.layer(case.x)
    layers = [case.layer]
    if tail:  # a Linear over the layer's last axis, after it
        layers.append(_perturb(nn.Linear(out.shape[-1], 2)))
    return nn.Sequential(*layers)


def _budgets(model, x, task, **options):
    """No budget, the process's, and the smallest feasible one (micro-batches of one)."""
    smallest = memconv.plan(model, x, task=task, memory_budget=2**40, **options).smallest_budget
    return [None, "available"] + ([smallest] if smallest else [])


def check_whole_model_functions(model, x, t, data):
    n = len(x)
    ref = loop_grads(model, x, t)
    ref_norms = norms_of(ref, n)
    strategy = data.draw(st.sampled_from([None, *memconv.available_strategies()]), "strategy")
    budget = data.draw(st.sampled_from(_budgets(model, x, "grads", strategy=strategy)), "budget")
    got = memconv.per_sample_grads(model, loss_fn, x, t, strategy=strategy, memory_budget=budget)
    assert_close(got, ref, "per_sample_grads")

    route = data.draw(st.sampled_from([None, "ghost", "instantiate"]), "norm_route")
    budget = data.draw(st.sampled_from(_budgets(model, x, "norms", norm_route=route)), "budget")
    got = memconv.per_sample_norms(
        model, loss_fn, x, t, per_parameter=True, norm_route=route, memory_budget=budget
    )
    assert_close(got, {k: sq_norms(g).sqrt() for k, g in ref.items()}, "norms")
    total = memconv.per_sample_norms(model, loss_fn, x, t, norm_route=route, memory_budget=budget)
    assert_close({"": total}, {"": ref_norms}, "norms, total")

    positive = ref_norms[ref_norms > 0]
    max_norm = positive.median().item() if positive.numel() else 1.0  # some clipped, some not
    c = torch.where(ref_norms > max_norm, max_norm / ref_norms, torch.ones_like(ref_norms))
    clipped = {k: torch.einsum("n,n...->...", c, g) for k, g in ref.items()}
    for clip_route in ["book-keeping", "two-pass"]:
        budget = data.draw(
            st.sampled_from(_budgets(model, x, "clip", clip_route=clip_route)), "budget"
        )
        model.zero_grad(set_to_none=True)
        if clip_route == "two-pass" and n and not torch_backward_is_finite(model, x, t):
            with pytest.raises(RuntimeError, match='clip_route="book-keeping"'):
                memconv.clip_and_accumulate(
                    model, loss_fn, x, t, max_norm=max_norm, clip_route=clip_route
                )
            assert all(p.grad is None for p in model.parameters())
            continue
        norms = memconv.clip_and_accumulate(
            model, loss_fn, x, t, max_norm=max_norm, clip_route=clip_route, memory_budget=budget
        )
        assert_close({"": norms}, {"": ref_norms}, f"clip {clip_route}, norms")
        sums = {
            k: torch.zeros_like(p) if p.grad is None else p.grad
            for k, p in trainable(model).items()
        }
        assert_close(sums, clipped, f"clip {clip_route}")
    model.zero_grad(set_to_none=True)


def check_extended_layer(model, x, t):
    """memconv's own layer classes: ``grad_batch`` in the ordinary backward pass."""
    layer = model[0]
    if type(layer) not in vars(memconv.modules).values() or not trainable(layer):
        return
    ref = loop_grads(model, x, t)
    model.zero_grad(set_to_none=True)
    with memconv.per_sample():
        loss_fn(model(x), t).backward()
    got = {f"0.{k}": p.grad_batch for k, p in layer.named_parameters() if p.requires_grad}
    assert_close(got, {k: ref[k] for k in got}, "grad_batch")
    model.zero_grad(set_to_none=True)


def check_opacus_bridge(model, x, t, time_first, data):
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    from memconv.integrations import opacus as mo

    batch_first = not (time_first and data.draw(st.booleans(), "time first"))
    reduction = data.draw(st.sampled_from(["sum", "mean"]), "loss_reduction")
    ghost = data.draw(st.booleans(), "ghost clipping")
    axis = 0 if batch_first else 1
    if not batch_first:
        x, t = x.transpose(0, 1), t.transpose(0, 1)
    n = x.shape[axis]
    ref = loop_grads(model, x, t, axis)
    options = dict(batch_first=batch_first, loss_reduction=reduction)
    with mo.installed():
        if ghost:
            gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, **options)
        else:
            gsm = GradSampleModule(model, **options)
        try:
            loss = loss_fn(gsm(x), t) / (max(n, 1) if reduction == "mean" else 1)
            loss.backward()
            if ghost:
                got = {"": gsm.get_norm_sample()}
                ref = {"": norms_of(ref, n)}
            else:
                got = {k: p.grad_sample for k, p in trainable(model).items()}
        finally:
            gsm.to_standard_module()
    what = f"opacus {'ghost' if ghost else 'hooks'} batch_first={batch_first} {reduction}"
    event(what)
    assert_close(got, ref, what)


@pytest.mark.parametrize(
    "rule_class", [*_rule_classes(), None], ids=lambda c: "generic" if c is None else c.__name__
)
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_sweep(rule_class, data):
    if rule_class not in SHAPES:
        pytest.fail(f"no shape strategy in tests/test_sweep.py SHAPES for {rule_class.__name__}")
    cls = data.draw(st.sampled_from(_layer_types(rule_class)), "layer type")
    n = data.draw(st.integers(0, 4), "batch size")
    case = data.draw(SHAPES[rule_class](cls, n), "case")
    try:  # the batch, and one sample: the per-sample losses' definition
        with torch.no_grad():
            case.layer(case.x)
            case.layer(case.x[:1])
    except Exception as err:  # torch refuses the shape (RuntimeError, ValueError, IndexError)
        if n:  # its error, from every function
            event("torch refuses the shape")
            check_torch_error(case, err)
            return
        # no samples: the loop computes nothing, and memconv runs nothing either
        event("no samples, a shape torch refuses")
        t = torch.zeros(0, dtype=DTYPE)
        check_whole_model_functions(nn.Sequential(case.layer), case.x, t, data)
        return
    tail = data.draw(st.booleans(), "Linear after") or not trainable(case.layer)
    model = _model(case, tail)
    with torch.no_grad():
        t = torch.randn_like(model(case.x))
    event("zero-size" if 0 in case.x.shape else "no zero-size")
    check_whole_model_functions(model, case.x, t, data)
    check_extended_layer(model, case.x, t)
    if rule_class is not None and case.opacus:  # Opacus has no memconv bridge without a rule
        check_opacus_bridge(model, case.x, t, case.time_first, data)


def check_torch_error(case: Case, err: Exception) -> None:
    t = torch.zeros(len(case.x), dtype=DTYPE)
    message = re.escape(str(err).split("\n")[0][:40])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call in [
            lambda: memconv.per_sample_grads(case.layer, loss_fn, case.x, t),
            lambda: memconv.per_sample_norms(case.layer, loss_fn, case.x, t),
            lambda: memconv.clip_and_accumulate(case.layer, loss_fn, case.x, t, max_norm=1.0),
        ]:
            with pytest.raises(type(err), match=message):
                call()


def test_embedding_with_zero_positions_alone_and_before_a_linear():
    """Indices ``[N, 0]``: zero per-sample gradients ``[N, V, D]`` for the table and the
    loop's for the layers after it, in the three functions and through Opacus."""
    torch.manual_seed(0)
    emb = _perturb(nn.Embedding(5, 3))
    x = torch.zeros(3, 0, dtype=torch.long)
    for model in [nn.Sequential(emb), nn.Sequential(emb, nn.Flatten(), nn.Linear(0, 2))]:
        model = model.to(DTYPE)
        t = torch.randn_like(model(x).detach())
        got = memconv.per_sample_grads(model, loss_fn, x, t)
        assert torch.equal(got["0.weight"], torch.zeros(3, 5, 3, dtype=DTYPE))
        assert_close(got, loop_grads(model, x, t), "per_sample_grads")
        ref_norms = norms_of(loop_grads(model, x, t), 3)
        got_norms = memconv.per_sample_norms(model, loss_fn, x, t)
        assert_close({"": got_norms}, {"": ref_norms}, "norms")
        model.zero_grad(set_to_none=True)
        memconv.clip_and_accumulate(model, loss_fn, x, t, max_norm=1e9)
        assert torch.equal(emb.weight.grad, torch.zeros(5, 3, dtype=DTYPE))

    from opacus import GradSampleModule

    from memconv.integrations import opacus as mo

    with mo.installed():
        gsm = GradSampleModule(model, loss_reduction="sum")
        loss_fn(gsm(x), t).backward()
        assert torch.equal(emb.weight.grad_sample, torch.zeros(3, 5, 3, dtype=DTYPE))
        assert_close(
            {k: p.grad_sample for k, p in model.named_parameters()},
            loop_grads(model, x, t),
            "opacus",
        )
        gsm.to_standard_module()
