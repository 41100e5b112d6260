"""BackPACK's second-order extensions on a ConvNeXt-style net through memconv.

Float64, against the autograd reference of ``test_backpack_secondorder``
(``Σₙ Σᵥ (Jₙᵀ Sₙ eᵥ)²`` for the GGN diagonals, by per-output Jacobians) and the
Hessian diagonal by second derivatives. The net is timm's ConvNeXt as the benchmark
zoo writes it (``LayerNorm2d`` as permute + ``F.layer_norm`` + permute, depthwise 7×7
convolutions, GELU, the layer scale ``gamma`` multiplied in the block's ``forward``,
residual additions), narrow and one block per stage.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("backpack")
from backpack import backpack  # noqa: E402
from backpack import extend as backpack_extend  # noqa: E402
from backpack import extensions as E  # noqa: E402
from test_backpack_secondorder import _close, _hessian_reference  # noqa: E402

from memconv.bench.models import ConvNeXt  # noqa: E402
from memconv.integrations import backpack as mb  # noqa: E402
from memconv.integrations.backpack.layers import LayerNorm2d, LayerScale2d  # noqa: E402

Y = torch.tensor([0, 2])


def _convnext():
    """A small ConvNeXt (dims 4, 8; 3 classes) with every parameter moved off its
    initial value (the layer scale starts at 1e-6, the biases at 0), and its input."""
    torch.manual_seed(0)
    model = ConvNeXt((1, 1), (4, 8), num_classes=3, in_chans=3).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model, torch.randn(2, 3, 16, 16, dtype=torch.float64)


def _run(model, x, ext):
    lossfn = backpack_extend(nn.CrossEntropyLoss())
    with mb.installed(ext), backpack(ext):
        lossfn(model(x), Y).backward()
    return {n: getattr(p, ext.savefield) for n, p in model.named_parameters()}


def test_converter_makes_every_layer_a_module_and_keeps_the_function():
    model, x = _convnext()
    converted = mb.extend(model)
    ops = {node.op for node in converted.graph.nodes}
    assert ops == {"placeholder", "call_module", "output"}
    kinds = [type(m) for m in converted.modules()]
    assert kinds.count(LayerNorm2d) == 5 and kinds.count(LayerScale2d) == 2
    assert {id(p) for p in converted.parameters()} == {id(p) for p in model.parameters()}
    _close(converted(x), model(x))


def _ggn_blocks(model, x, params, per_sample, diagonal=True):
    """``_ggn_reference`` for several parameters from one forward pass."""
    out = model(x)
    n, c = out.shape
    prob = out.softmax(1).detach()
    h = (torch.diag_embed(prob) - prob[:, :, None] * prob[:, None, :]) / n  # mean loss
    jacs = [
        [torch.autograd.grad(out[i, k], params, retain_graph=True) for k in range(c)]
        for i in range(n)
    ]
    result = []
    for j, p in enumerate(params):
        jac = torch.stack([torch.stack([jacs[i][k][j] for k in range(c)]) for i in range(n)])
        jac = jac.flatten(2)
        if diagonal:
            d = torch.einsum("nij,nia,nja->na", h, jac, jac).reshape(n, *p.shape)
            result.append(d if per_sample else d.sum(0))
        else:
            result.append(torch.einsum("nij,nia,njb->ab", h, jac, jac))
    return result


@pytest.mark.parametrize("ext_cls", [E.DiagGGNExact, E.BatchDiagGGNExact])
def test_ggn_diagonal_of_every_parameter_against_autograd(ext_cls):
    model, x = _convnext()
    per_sample = ext_cls is E.BatchDiagGGNExact
    converted = mb.extend(model)
    result = _run(converted, x, ext_cls())
    names, params = zip(*converted.named_parameters())
    assert len(result) == len(params) == len(list(model.parameters()))
    for name, reference in zip(names, _ggn_blocks(model, x, params, per_sample)):
        _close(result[name], reference)


def test_sqrt_ggn_rows_give_the_ggn_diagonal():
    model, x = _convnext()
    converted = mb.extend(model)
    rows = _run(converted, x, E.SqrtGGNExact())
    diag = _run(mb.extend(model), x, E.DiagGGNExact())
    for name in diag:
        _close(rows[name].square().sum((0, 1)), diag[name])


def test_mc_diagonals_summed_over_samples_agree():
    model, x = _convnext()
    torch.manual_seed(3)
    total = _run(mb.extend(model), x, E.DiagGGNMC())
    torch.manual_seed(3)
    per_sample = _run(mb.extend(model), x, E.BatchDiagGGNMC())
    for name in total:
        _close(per_sample[name].sum(0), total[name])


def test_kflr_factor_of_layer_norm_and_layer_scale_is_their_ggn():
    """The convention: one factor per parameter of these layers, its exact GGN block
    for KFLR (``[C, C]``), whose diagonal is DiagGGNExact's; KFLR runs through the
    residual additions (BackPACK's KFLR alone has no rule for them)."""
    model, x = _convnext()
    factors = _run(mb.extend(model), x, E.KFLR())
    diag = _run(mb.extend(model), x, E.DiagGGNExact())
    names = (
        "stages.0.blocks.0.norm.weight",
        "head.norm.bias",
        "stages.1.blocks.0.layer_scale.gamma",
    )
    params = [dict(mb.extend(model).named_parameters())[name] for name in names]
    blocks = _ggn_blocks(model, x, params, False, diagonal=False)
    for name, block in zip(names, blocks):
        (factor,) = factors[name]
        _close(factor.diagonal(), diag[name])
        _close(factor, block)


def test_kfac_runs_on_every_parameter():
    model, x = _convnext()
    factors = _run(mb.extend(model), x, E.KFAC())
    assert len(factors) == len(list(model.parameters()))
    assert len(factors["stages.0.blocks.0.conv_dw.weight"]) == 2  # depthwise: per group


def test_hessian_diagonal_raises_naming_the_layer_norm():
    model, x = _convnext()
    with pytest.raises(NotImplementedError, match=r"DiagHessian on layer 'head\.norm' .*use "):
        _run(mb.extend(model), x, E.DiagHessian())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_hessian_diagonal_against_second_derivatives(approximate):
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.GELU(approximate=approximate), nn.Flatten(), nn.Linear(12, 3)
    ).double()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    for ext_cls in (E.DiagHessian, E.BatchDiagHessian):
        result = _run(backpack_extend(copy.deepcopy(model)), x, ext_cls())
        per_sample = ext_cls is E.BatchDiagHessian
        for name in ("0.weight", "3.weight"):
            _close(result[name], _hessian_reference(model, x, Y, name, per_sample))


def test_parameter_used_by_a_function_warns_naming_it():
    class Shift(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)
            self.shift = nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return self.conv(x) + self.shift

    with pytest.warns(UserWarning, match="'shift'.*write those operations as modules"):
        mb.extend(Shift())


class _InlineNorm(nn.Module):
    """A layer norm over channels written inline (timm's channels-last path), without
    affine parameters, and a layer scale by ``view`` with the channel count spelled out."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.gamma = nn.Parameter(torch.linspace(0.5, 2.0, 4))
        self.fc = nn.Linear(4 * 14 * 14, 3)

    def forward(self, x):
        x = self.conv(x)
        x = nn.functional.layer_norm(x.permute(0, 2, 3, 1), (4,), None, None, 1e-5)
        x = x.permute(0, 3, 1, 2)
        x = torch.mul(x, self.gamma.view(1, 4, 1, 1))
        return self.fc(x.flatten(1))


def test_inline_layer_norm_without_affine_and_view_scale_against_autograd():
    torch.manual_seed(2)
    model = _InlineNorm().double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    converted = mb.extend(model)
    kinds = [type(m) for m in converted.modules()]
    assert kinds.count(LayerNorm2d) == 1 and kinds.count(LayerScale2d) == 1
    result = _run(converted, x, E.BatchDiagGGNExact())
    names, params = zip(*converted.named_parameters())
    for name, reference in zip(names, _ggn_blocks(model, x, params, True)):
        _close(result[name], reference)


def test_backward_over_chunks_of_rows_equals_one_pass():
    """``install(..., memory_budget=...)``: the factor's rows one at a time."""
    model, x = _convnext()
    results = []
    for budget in (None, 1):
        converted, ext = mb.extend(model), E.DiagGGNExact()
        lossfn = backpack_extend(nn.CrossEntropyLoss())
        with mb.installed(ext, memory_budget=budget), backpack(ext):
            lossfn(converted(x), Y).backward()
        results.append({n: p.diag_ggn_exact for n, p in converted.named_parameters()})
    for name in results[0]:
        _close(results[1][name], results[0][name])


def test_layer_scale_of_shape_c11_refuses_an_input_of_another_rank():
    """torchvision's layer scale ``[C, 1, 1]`` is per channel only on ``[N, C, H, W]``."""
    scale = LayerScale2d(nn.Parameter(torch.ones(4, 1, 1)))
    assert scale(torch.ones(2, 4, 3, 3)).shape == (2, 4, 3, 3)
    with pytest.raises(ValueError, match="per-channel"):
        scale(torch.ones(2, 4, 5))
