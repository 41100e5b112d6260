"""The Gram route of the GGN diagonals of a convolution against the row VJPs and autograd.

Float64. ``memconv.conv.curvature.weight_diagonal`` with ``route="gram"`` (``S Sᵀ``
over position pairs against the patches' outer products) and ``route="rows"`` (one
weight VJP per row of ``S``); the reference is ``Σₙ Σᵥ (Jₙᵀ Sₙ eᵥ)²`` with each
per-sample, per-row weight VJP by autograd on the layer's own forward function.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memconv.conv.curvature import diagonal_costs, diagonal_route, weight_diagonal
from memconv.conv.settings import Settings
from memconv.strategies import NO_OPTIONS, Options

AUTO = Settings("auto", NO_OPTIONS)
RTOL = 1e-10

#: Held-out geometries: stride, dilation, groups, padding modes, 1d/3d, transposed.
GEOMETRIES = {
    "conv2d-stride-groups": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2),
        (3, 4, 7, 7),
    ),
    "conv2d-depthwise-circular": (
        lambda: nn.Conv2d(3, 3, 3, padding=1, groups=3, padding_mode="circular"),
        (2, 3, 5, 5),
    ),
    "conv2d-same-reflect-dilation": (
        lambda: nn.Conv2d(2, 4, 2, padding="same", padding_mode="reflect", dilation=2),
        (2, 2, 6, 6),
    ),
    "conv1d-replicate-stride": (
        lambda: nn.Conv1d(2, 3, 3, padding=2, stride=2, padding_mode="replicate"),
        (3, 2, 9),
    ),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2, stride=(1, 2, 1)), (2, 2, 4, 4, 3)),
    "convT2d-output-padding-groups": (
        lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1, groups=2),
        (2, 4, 3, 3),
    ),
    "convT1d-dilation": (lambda: nn.ConvTranspose1d(2, 3, 3, dilation=2), (2, 2, 4)),
}


def _case(name, v=5, seed=0):
    make, shape = GEOMETRIES[name]
    torch.manual_seed(seed)
    module = make().double()
    x = torch.randn(shape, dtype=torch.float64)
    s = torch.randn(v, *module(x).shape, dtype=torch.float64)
    return module, x, s


def _autograd_diagonal(module, x, s):
    """``[N, *weight.shape]``: ``Σᵥ (Jₙᵀ S[v, n])²`` by autograd, sample by sample."""
    out = []
    for n in range(x.shape[0]):
        y = module(x[n : n + 1])
        rows = [
            torch.autograd.grad(y, module.weight, s[v, n : n + 1], retain_graph=True)[0]
            for v in range(s.shape[0])
        ]
        out.append(torch.stack(rows).square().sum(0))
    return torch.stack(out)


def _close(a, b):
    scale = b.abs().max()
    assert (a - b).abs().max() <= RTOL * scale, ((a - b).abs().max() / scale).item()


@pytest.mark.parametrize("name", GEOMETRIES)
@pytest.mark.parametrize("per_sample", [False, True], ids=["summed", "per-sample"])
def test_gram_route_equals_rows_and_autograd(name, per_sample):
    module, x, s = _case(name)
    gram = weight_diagonal(module, x, s, AUTO, per_sample=per_sample, route="gram")
    rows = weight_diagonal(module, x, s, AUTO, per_sample=per_sample, route="rows")
    reference = _autograd_diagonal(module, x, s)
    reference = reference if per_sample else reference.sum(0)
    _close(gram, reference)
    _close(rows, reference)


def test_gram_route_over_chunks_of_samples_equals_one_chunk():
    module, x, s = _case("conv2d-stride-groups")
    one_sample = diagonal_costs(module, x, s).gram_sample_bytes
    chunked = Settings("auto", Options(memory_budget=one_sample))
    whole = weight_diagonal(module, x, s, AUTO, per_sample=True, route="gram")
    _close(weight_diagonal(module, x, s, chunked, per_sample=True, route="gram"), whole)


def test_route_follows_the_costs():
    """Gram where the output map is small against V and C_in·K (a 1×1 convolution of
    32 channels on 3×3 at V = 100), rows where it is large (V = 2 on 16×16), rows for a chosen strategy,
    and rows when one sample of the Gram route exceeds the budget."""
    conv = nn.Conv2d(32, 32, 1)
    small, s_small = torch.randn(2, 32, 3, 3), torch.randn(100, 2, 32, 3, 3)
    large, s_large = torch.randn(2, 32, 16, 16), torch.randn(2, 2, 32, 16, 16)
    assert diagonal_route(conv, small, s_small, AUTO) == "gram"
    assert diagonal_route(conv, large, s_large, AUTO) == "rows"
    assert diagonal_route(conv, small, s_small, Settings("standard", NO_OPTIONS)) == "rows"
    tight = Settings("auto", Options(memory_budget=64))
    assert diagonal_route(conv, small, s_small, tight) == "rows"


def test_unknown_route_raises():
    module, x, s = _case("conv1d-replicate-stride")
    with pytest.raises(ValueError, match="route 'unfold'; accepted: rows, gram"):
        weight_diagonal(module, x, s, AUTO, per_sample=False, route="unfold")
