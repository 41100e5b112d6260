"""Shared helpers of the test suite: references computed by torch itself."""

from __future__ import annotations

import torch
from torch import nn

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute deviation relative to the largest entry of ``b``."""
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


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


def make_conv(dims, c_in, c_out, k, *, seed=0, dtype=torch.float64, **kwargs):
    """A seeded convolution module of the given dimension."""
    torch.manual_seed(seed)
    return CONVS[dims](c_in, c_out, k, **kwargs).to(dtype)


def conv_case(dims, n, c_in, c_out, k, size, *, seed=0, dtype=torch.float64, **kwargs):
    """(module, input, output gradient) of a seeded random case."""
    m = make_conv(dims, c_in, c_out, k, seed=seed, dtype=dtype, **kwargs)
    sizes = size if isinstance(size, tuple) else (size,) * dims
    x = torch.randn(n, c_in, *sizes, dtype=dtype)
    with torch.no_grad():
        y = m(x)
    g = torch.randn_like(y)
    return m, x, g
