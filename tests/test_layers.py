"""The layer-rule registry and the generic routes, on models people train.

Every case is checked in float64 against a per-sample autograd loop (one
``torch.autograd.grad`` per sample: :func:`helpers.loop_reference`), in all four
whole-model functions: per-sample gradients, their norms, the clipped sum (both
clipping routes) and the plan.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import loop_reference
from torch import nn

import memconv
import memconv.layers

TOL = 1e-9


# ----------------------------------------------------------------- models
class WSConv2d(nn.Conv2d):
    """Weight-standardised convolution (Qiao et al. 2019; the DP ResNet recipe with
    GroupNorm, De et al. 2022): the forward pass normalises the weight first."""

    def forward(self, x):
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        std = w.std(dim=(1, 2, 3), keepdim=True) + 1e-5
        return self._conv_forward(x, (w - mean) / std, self.bias)


class ScaledLinear(nn.Linear):
    """A Linear layer whose forward scales its weight."""

    def forward(self, x):
        return F.linear(x, self.weight * 0.5, self.bias)


def ws_resnet_block():
    return nn.Sequential(
        WSConv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        ScaledLinear(4 * 5 * 5, 3),
    )


class TiedLM(nn.Module):
    """An embedding reused as the output projection (tied embeddings)."""

    def __init__(self, vocab=7, dim=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, idx):
        h = torch.tanh(self.mix(self.emb(idx))).mean(1)
        return F.linear(h, self.emb.weight)  # the embedding's weight, used again


class KeywordCall(nn.Module):
    """Layers called with keyword arguments."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.head = nn.Linear(3 * 6, 2)

    def forward(self, x):
        return self.head(input=self.conv(input=x).flatten(1))


class ParentParameter(nn.Module):
    """A bare parameter used in the parent's forward (a learned scale)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.scale = nn.Parameter(torch.randn(3, 1, 1))
        self.head = nn.Linear(3 * 3 * 3, 2)

    def forward(self, x):
        return self.head((self.conv(x) * self.scale).flatten(1))


class ConvAttention(nn.Module):
    """A hybrid classifier: a conv stem, tokens, multi-head self-attention, a head."""

    def __init__(self, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.stem = nn.Conv2d(2, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        tokens = self.norm(self.stem(x)).flatten(2).transpose(1, 2)  # [N, L, 8]
        if not self.batch_first:
            tokens = tokens.transpose(0, 1)  # [L, N, 8]
        out, _ = self.attn(tokens, tokens, tokens, need_weights=False)
        pooled = out.mean(1 if self.batch_first else 0)
        return self.head(pooled)


class ConvRNN(nn.Module):
    """A conv front end over time, then a recurrent layer (GRU or LSTM)."""

    def __init__(self, cell=nn.GRU):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3, padding=1)
        self.rnn = cell(4, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        seq = F.relu(self.conv(x)).transpose(1, 2)  # [N, T, 4]
        out, _ = self.rnn(seq)
        return self.head(out[:, -1])


class ConvTransformer(nn.Module):
    """A Transformer encoder layer on conv features, sequence-first (batch_first=False),
    with as many tokens as samples so that a batch axis cannot be guessed by size."""

    def __init__(self, batch_first=False):
        super().__init__()
        self.batch_first = batch_first
        self.stem = nn.Conv1d(2, 8, 3, padding=1)
        self.encoder = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=12, dropout=0.0, batch_first=batch_first
        )
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        if self.batch_first:
            return self.head(self.encoder(self.stem(x).transpose(1, 2)).mean(1))
        tokens = self.stem(x).permute(2, 0, 1)  # [L, N, 8]
        return self.head(self.encoder(tokens).mean(0))


def batch(model_name, n=4):
    torch.manual_seed(1)
    if model_name == "tied":
        return torch.randint(0, 7, (n, 5)), torch.randint(0, 7, (n,))
    if model_name in ("keyword", "gru", "lstm"):
        return torch.randn(n, 2, 8, dtype=torch.float64), torch.randint(0, 2, (n,))
    if model_name == "transformer":  # L = N = 4
        return torch.randn(n, 2, n, dtype=torch.float64), torch.randint(0, 2, (n,))
    if model_name in ("ws", "parent"):
        return torch.randn(n, 2, 5, 5, dtype=torch.float64), torch.randint(0, 2, (n,))
    return torch.randn(n, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (n,))


def build(model_name):
    torch.manual_seed(0)
    model = {
        "ws": ws_resnet_block,
        "tied": TiedLM,
        "keyword": KeywordCall,
        "parent": ParentParameter,
        "attention": ConvAttention,
        "attention-seq-first": lambda: ConvAttention(batch_first=False),
        "gru": lambda: ConvRNN(nn.GRU),
        "lstm": lambda: ConvRNN(nn.LSTM),
        "transformer": ConvTransformer,
        "transformer-batch-first": lambda: ConvTransformer(batch_first=True),
    }[model_name]()
    return model.double()


MODELS = [
    "ws",
    "tied",
    "keyword",
    "parent",
    "attention",
    "attention-seq-first",
    "gru",
    "lstm",
    "transformer",
    "transformer-batch-first",
]


def data_for(name):
    name = "transformer" if name.startswith("transformer") else name
    key = name if name in ("tied", "keyword", "gru", "lstm", "transformer", "ws", "parent") else ""
    return batch(key)


def norms_of(grads):
    return torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)


def assert_close(got, ref):
    scale = max(float(r.abs().max()) for r in ref.values())
    assert list(got) == list(ref)
    for k in ref:
        assert got[k].shape == ref[k].shape, k
        assert float((got[k] - ref[k]).abs().max()) <= TOL * scale, k


# ----------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", MODELS)
def test_per_sample_grads_and_norms_are_exact(name):
    model = build(name)
    x, y = data_for(name)
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    assert_close(memconv.per_sample_grads(model, loss_fn, x, y), ref)
    got = memconv.per_sample_norms(model, loss_fn, x, y)
    assert torch.allclose(got, norms_of(ref), rtol=TOL, atol=0)


@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
@pytest.mark.parametrize("name", MODELS)
def test_clipped_sum_is_exact(name, clip_route):
    model = build(name)
    x, y = data_for(name)
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    norms = norms_of(ref)
    max_norm = float(norms.median())
    c = torch.clamp(max_norm / norms, max=1.0)
    expected = {k: torch.einsum("n,n...->...", c, g) for k, g in ref.items()}
    got = memconv.clip_and_accumulate(
        model, loss_fn, x, y, max_norm=max_norm, clip_route=clip_route
    )
    assert torch.allclose(got, norms, rtol=TOL, atol=0)
    params = dict(model.named_parameters())
    assert_close({k: params[k].grad for k in expected}, expected)
    # one sample's share of the clipped sum never exceeds max_norm (the DP bound)
    shares = torch.stack([c[i] * norms[i] for i in range(len(x))])
    assert float(shares.max()) <= max_norm * (1 + 1e-12)


@pytest.mark.parametrize("name", MODELS)
def test_budgeted_calls_are_exact(name):
    """A budget small enough for micro-batches of one or two samples."""
    model = build(name)
    x, y = data_for(name)
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    budget = memconv.plan(model, x, task="grads").smallest_budget * 2
    assert_close(memconv.per_sample_grads(model, loss_fn, x, y, memory_budget=budget), ref)
    got = memconv.per_sample_norms(model, loss_fn, x, y, memory_budget=budget)
    assert torch.allclose(got, norms_of(ref), rtol=TOL, atol=0)


def test_plan_names_the_layers_on_the_generic_route():
    model = build("attention")
    x, _ = data_for("attention")
    chosen = memconv.plan(model, x, task="clip", memory_budget=2**30)
    assert chosen.generic_layers == ("attn",)
    assert "generic route: attn" in str(chosen)
    ws = memconv.plan(build("ws"), data_for("ws")[0])
    # the subclasses with their own forward call F.conv2d and F.linear on functions of
    # their weights: operation rules serve them
    assert ws.generic_layers == ()


def test_a_forward_hook_that_changes_the_output_is_covered():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 2 * 2, 3)).double()
    model[0].register_forward_hook(lambda m, a, out: out * 3.0 + 1.0)
    x, y = batch("")
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    assert_close(memconv.per_sample_grads(model, loss_fn, x, y), ref)


def test_pruned_and_compiled_models():
    import torch.nn.utils.prune as prune

    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 2 * 2, 3)).double()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    x, y = batch("")
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    assert "0.weight_orig" in ref
    assert_close(memconv.per_sample_grads(model, loss_fn, x, y), ref)
    compiled = torch.compile(model)  # runs eagerly in memconv: same parameters
    assert_close(memconv.per_sample_grads(compiled, loss_fn, x, y), ref)
    got = memconv.per_sample_norms(compiled, loss_fn, x, y)
    assert torch.allclose(got, norms_of(ref), rtol=TOL, atol=0)


def test_shared_module_called_twice_and_shared_attention():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            h = self.attn(x, x, x)[0]
            h = self.attn(h, h, h)[0]  # the same attention layer again
            return self.head(h.mean(1))

    torch.manual_seed(0)
    model = Twice().double()
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.randint(0, 2, (3,))
    loss_fn = nn.CrossEntropyLoss()
    ref = loop_reference(model, loss_fn, x, y)
    assert_close(memconv.per_sample_grads(model, loss_fn, x, y), ref)
    got = memconv.per_sample_norms(model, loss_fn, x, y)
    assert torch.allclose(got, norms_of(ref), rtol=TOL, atol=0)


# ----------------------------------------------------------------- never silent
@pytest.mark.parametrize("block", [torch.no_grad, torch.inference_mode])
def test_calls_under_no_grad_raise(block):
    model, (x, y) = build("ws"), data_for("ws")
    loss_fn = nn.CrossEntropyLoss()
    before = [p.grad for p in model.parameters()]
    with block():
        for call in (
            lambda: memconv.per_sample_grads(model, loss_fn, x, y),
            lambda: memconv.per_sample_norms(model, loss_fn, x, y),
            lambda: memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=1.0),
        ):
            with pytest.raises(RuntimeError, match="no_grad.*inference_mode"):
                call()
    assert [p.grad for p in model.parameters()] == before


def test_a_non_finite_norm_raises_and_leaves_grad_alone():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 2 * 2, 3)).double()
    x, y = batch("")
    x[2, 0, 1, 1] = float("nan")
    loss_fn = nn.CrossEntropyLoss()
    for route in ("book-keeping", "two-pass"):
        with pytest.raises(RuntimeError, match=r"sample\(s\) 2 is not finite"):
            memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=1.0, clip_route=route)
        assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="not finite"):
        memconv.per_sample_norms(model, loss_fn, x, y)


def test_batchnorm_without_running_statistics_is_rejected():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, track_running_stats=False))
    model = nn.Sequential(*model, nn.Flatten(), nn.Linear(12, 3)).double().eval()
    x, y = batch("")
    with pytest.raises(ValueError, match="'1'.*without running statistics"):
        memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y)


def test_random_forward_on_the_generic_route_is_an_error():
    torch.manual_seed(0)
    model = ConvAttention().double()
    model.attn.dropout = 0.5  # attention dropout, training mode
    x, y = batch("")
    with pytest.raises(ValueError, match="'attn'.*random numbers"):
        memconv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    model.eval()  # the same model in eval mode is fine
    ref = loop_reference(model, nn.CrossEntropyLoss(), x, y)
    assert_close(memconv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y), ref)


def test_dropout_outside_generic_layers_is_fine_in_training_mode():
    """Dropout between rule layers draws its mask once, in the one forward pass."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Dropout(0.5), nn.Flatten(), nn.Linear(12, 3)
    ).double()
    x, y = batch("")
    torch.manual_seed(5)
    grads = memconv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    torch.manual_seed(5)  # the same mask for the reference's batched forward pass
    out = model(x)
    losses = [nn.CrossEntropyLoss()(out[i : i + 1], y[i : i + 1]) for i in range(len(x))]
    w = model[0].weight
    ref = torch.stack([torch.autograd.grad(loss, w, retain_graph=True)[0] for loss in losses])
    assert float((grads["0.weight"] - ref).abs().max()) <= TOL * float(ref.abs().max())


# ----------------------------------------------------------------- a user's rule
def test_a_registered_rule_is_used_everywhere():
    calls = []

    @memconv.layers.register(WSConv2d)
    class WSConvRule(memconv.layers.LayerRule):
        def grad_sample(self, module, inputs, grad_output):
            (x,) = inputs
            calls.append(len(x))
            w = module.weight.detach().requires_grad_()

            def standardised(w):
                mean = w.mean(dim=(1, 2, 3), keepdim=True)
                return (w - mean) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)

            out = {}
            with torch.enable_grad():
                ws = standardised(w)
                per = []
                for i in range(len(x)):
                    y = F.conv2d(x[i : i + 1], ws, None, module.stride, module.padding)
                    per.append(
                        torch.autograd.grad(y, w, grad_output[i : i + 1], retain_graph=True)[0]
                    )
            out["weight"] = torch.stack(per)
            out["bias"] = grad_output.sum((2, 3))
            return out

    try:
        assert memconv.layers.find_rule(WSConv2d(1, 1, 1)) is not None
        model, (x, y) = build("ws"), data_for("ws")
        loss_fn = nn.CrossEntropyLoss()
        ref = loop_reference(model, loss_fn, x, y)
        assert_close(memconv.per_sample_grads(model, loss_fn, x, y), ref)
        assert calls == [len(x)]
        got = memconv.per_sample_norms(model, loss_fn, x, y)
        assert torch.allclose(got, norms_of(ref), rtol=TOL, atol=0)
        memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=1.0)
        assert len(calls) == 3
        assert memconv.plan(model, x).generic_layers == ()  # ScaledLinear: F.linear
    finally:
        memconv.layers.unregister(WSConv2d)
    assert memconv.layers.find_rule(WSConv2d(1, 1, 1)) is None


def test_register_rejects_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        memconv.layers.register(int)
    with pytest.raises(TypeError, match="at least one"):
        memconv.layers.register()
    with pytest.raises(TypeError, match="LayerRule subclasses"):
        memconv.layers.register(WSConv2d)(object)


def test_rule_lookup_is_by_exact_type():
    find = memconv.layers.find_rule
    assert find(nn.Conv2d(1, 1, 1)) is find(memconv.Conv2d(1, 1, 1)) is not None
    assert find(WSConv2d(1, 1, 1)) is None  # overrides forward: the generic route

    class Plain(nn.Conv2d):  # inherits forward: the base class's rule
        pass

    assert find(Plain(1, 1, 1)) is find(nn.Conv2d(1, 1, 1))
    assert find(nn.MultiheadAttention(4, 2)) is None


# ----------------------------------------------------------------- Opacus
@pytest.mark.parametrize("name", ["attention", "gru", "lstm", "transformer-batch-first"])
def test_opacus_bridge_on_hybrid_models(name):
    """Opacus' way: ModuleValidator.fix swaps attention and recurrent layers for its DP
    layers (made of Linear layers), whose per-sample gradients then come from memconv's
    Linear rule through the bridge, as the convolutions' from memconv's conv rule.
    (Opacus takes one batch axis for the whole model: sequence-first layers beside
    batch-first convolutions are beyond it, not beyond memconv's own functions.)"""
    pytest.importorskip("opacus")
    from opacus.grad_sample import GradSampleModule
    from opacus.validators import ModuleValidator

    from memconv.integrations import opacus as mo

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ModuleValidator.fix(build(name)).double()
    x, y = data_for(name)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    ref = loop_reference(model, loss_fn, x, y)
    with warnings.catch_warnings(), mo.installed():
        warnings.simplefilter("ignore")  # Opacus' notes on its functorch fallback
        gsm = GradSampleModule(model, loss_reduction="sum")
        loss_fn(gsm(x), y).backward()
        got = {n: p.grad_sample for n, p in model.named_parameters()}
        gsm.to_standard_module()
    assert_close(got, ref)
