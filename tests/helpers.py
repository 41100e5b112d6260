"""Shared helpers of the test suite: references computed by torch itself, never memconv."""

from __future__ import annotations

import torch
from torch import nn

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_TRANSPOSES = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """Largest absolute deviation relative to the largest entry of ``b`` (or ``scale``)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    if scale is None:
        scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0) if a.numel() else 0.0


def assert_grads_close(got: dict, ref: dict, tol: float) -> None:
    """Same keys (a missing or extra key fails), same shapes, every entry within ``tol``
    relative to the largest entry of any reference tensor (so that parameters whose
    true gradient is zero are compared in absolute terms)."""
    assert list(got) == list(ref), (list(got), list(ref))
    scale = max(t.abs().max().item() for t in ref.values() if t.numel())
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        assert rel_err(got[name].double(), ref[name].double(), scale) < tol, name


def reference_weight_grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Per-sample weight gradients by one ``torch.autograd.grad`` call per sample."""
    out = []
    for i in range(x.shape[0]):
        y = module(x[i : i + 1])
        (gw,) = torch.autograd.grad(y, module.weight, g[i : i + 1])
        out.append(gw)
    if not out:
        return module.weight.new_zeros(0, *module.weight.shape)
    return torch.stack(out)


def func_reference(model, loss_fn, x, y):
    """Per-sample gradients by ``torch.func.vmap(grad)`` (trainable parameters only)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss(p, xi, yi):
        out = torch.func.functional_call(model, p, (xi[None],), strict=False)
        return loss_fn(out, yi[None])

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)


def loop_reference(model, loss_fn, x, y):
    """Per-sample gradients by one ``torch.autograd.grad`` call per sample (handles
    parameters shared by several layers, under their first name)."""
    named = dict(model.named_parameters())
    names = [n for n, p in named.items() if p.requires_grad]
    per = [
        torch.autograd.grad(
            loss_fn(model(x[i : i + 1]), y[i : i + 1]), [named[n] for n in names], allow_unused=True
        )
        for i in range(len(x))
    ]
    return {
        n: torch.stack([g[j] if g[j] is not None else torch.zeros_like(named[n]) for g in per])
        for j, n in enumerate(names)
    }


def make_layer(dims, c_in, c_out, k, *, transposed=False, seed=0, dtype=torch.float64, **kwargs):
    """A seeded convolution (or transposed convolution) module."""
    torch.manual_seed(seed)
    cls = (CONV_TRANSPOSES if transposed else CONVS)[dims]
    return cls(c_in, c_out, k, **kwargs).to(dtype)


def conv_case(dims, n, c_in, c_out, k, size, *, seed=0, dtype=torch.float64, **kwargs):
    """(module, input, output gradient) of a seeded random case."""
    m = make_layer(dims, c_in, c_out, k, seed=seed, dtype=dtype, **kwargs)
    sizes = size if isinstance(size, tuple) else (size,) * dims
    x = torch.randn(n, c_in, *sizes, dtype=dtype)
    with torch.no_grad():
        y = m(x)
    g = torch.randn_like(y)
    return m, x, g


class Opaque(torch.autograd.Function):
    """Runs ``layer`` inside one autograd Function (StreamingCNN's pattern): the walk's
    hooks see no call of ``layer``, so its parameters take the model route."""

    @staticmethod
    def forward(ctx, x, layer, *params):
        ctx.save_for_backward(x)
        ctx.layer = layer
        return layer(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        params = list(ctx.layer.parameters())
        with torch.enable_grad():
            grads = torch.autograd.grad(ctx.layer(x), params, g)
        return (None, None, *grads)


class Hidden(torch.nn.Module):
    """A Conv1d run inside :class:`Opaque` (its parameters take the model route), then a
    Linear (a rule call). Input ``[N, 4, 11]``, output ``[N, 3]``."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Conv1d(4, 4, 3)
        self.head = torch.nn.Linear(4 * 9, 3)

    def forward(self, x):
        return self.head(Opaque.apply(x, self.inner, *self.inner.parameters()).flatten(1))


def small_data(n=5):
    """``(x [n, 2, 4, 4] float64, y [n] in 0..2)`` from a fixed generator."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 2, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def assert_close(got: dict, ref: dict, tol: float) -> None:
    """Same keys (any order), every entry within ``tol`` relative to the largest entry of
    any reference tensor."""
    assert set(got) == set(ref)
    scale = max(v.abs().max().item() for v in ref.values())
    for k in ref:
        assert (got[k] - ref[k]).abs().max().item() <= tol * scale, k


def total_norms(ref: dict) -> torch.Tensor:
    """The per-sample norms ``[N]`` over all the per-sample gradients ``{name: [N, ...]}``."""
    return torch.stack([v.reshape(len(v), -1).pow(2).sum(1) for v in ref.values()]).sum(0).sqrt()


def small_gn_resnet() -> nn.Module:
    """A narrow GroupNorm ResNet for 3×8×8 inputs: a stem, a block, a strided block with
    its projection shortcut, pooling and a Linear head."""
    from memconv.bench import models

    def norm(c):
        return models.group_norm(c, 4)

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        norm(8),
        nn.ReLU(),
        models.BasicBlock(8, 8, norm=norm),
        models.BasicBlock(8, 16, stride=2, norm=norm),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def small_vit() -> nn.Module:
    """A two-block ViT for 3×8×8 inputs (patch embedding, class token, position
    embedding, LayerNorms, attention)."""
    from memconv.bench import models

    return models.VisionTransformer(8, 4, 3, 10, embed_dim=16, depth=2, num_heads=2)


class CallCounter(nn.Module):
    """Counts its calls in a plain attribute (as a module logging its calls does): a
    compiled step's key, which holds the modules' plain attributes, changes at every
    call."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x
