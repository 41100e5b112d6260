"""laplace-torch's diag and kron Laplace on a torchvision ResNet-18 and ConvNeXt.

What a laplace-torch user writes, plus memconv's two lines (``mb.extend(model)``,
``with mb.routed(): la.fit(loader)``), on torchvision's ResNet-18 (BasicBlocks with
in-place ReLU and ``out += identity``, BatchNorm2d in eval mode, AdaptiveAvgPool2d,
``torch.flatten``, Linear) and torchvision's ConvNeXt (depthwise 7×7 convolutions,
``LayerNorm2d``, Linear layers on the channels-last map, GELU, the layer scale
``[C, 1, 1]``, residuals), both narrow, in float64. Against references built by
``torch.func`` on an untouched copy of the model:

- ``la.H`` of the diag Laplace: ``Σₙ diag(Jₙᵀ Hₙ Jₙ)`` (``Jₙ`` the per-sample
  Jacobian of the logits, ``Hₙ`` the cross-entropy's Hessian in the logits);
- ``la.H_facs`` of the kron Laplace (laplace-torch's ``BackPackGGN`` runs KFLR), per
  parameter: a convolution's or Linear layer's weight ``[A, Ω]`` with ``A`` the GGN of
  a zero bias added to the layer's output (``Σₙ Σₜ,ₜ'`` of the output Jacobians,
  BackPACK's convention) and ``Ω = (1/N) Σₙₜ uₙₜ uₙₜᵀ`` of the unfolded input ``u``
  (``F.unfold``; for the depthwise convolutions of the input averaged over the groups,
  curvlinops' convention, which ``routed()`` takes by default; the input itself for a
  Linear layer, over every position of the channels-last map); a bias ``[A]``; every
  other parameter (BatchNorm's and LayerNorm's ``weight``/``bias``, the layer scale)
  one factor, its GGN block; summed over the loader's batches with Ω scaled by
  ``M/N`` as laplace-torch does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_backpack_laplace import BackPackGGN, Laplace  # skips as it does
from torch import nn
from torch.func import functional_call, jacrev, vmap

from memconv.bench.models import TVResNet
from memconv.bench.trunks import TVConvNeXt, randomise_norms
from memconv.integrations import backpack as mb

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:Extension saving to"),
]
N, CLASSES, BATCH = 6, 3, 3


def _resnet():
    """torchvision's ResNet-18 (2, 2, 2, 2 BasicBlocks), width 2, BatchNorm in eval
    mode with drawn statistics, on 3×32×32 inputs."""
    torch.manual_seed(0)
    model = randomise_norms(TVResNet((2, 2, 2, 2), num_classes=CLASSES, width=2))
    return model.double().eval(), (3, 32, 32)


def _convnext():
    """torchvision's ConvNeXt, one block per stage, dims 4 and 8, every parameter
    moved off its initial value (the layer scales start at 1e-6, the biases at 0), on
    3×16×16 inputs."""
    torch.manual_seed(0)
    model = TVConvNeXt((1, 1), (4, 8), num_classes=CLASSES).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model, (3, 16, 16)


MODELS = {"resnet18": _resnet, "convnext": _convnext}


def _data(shape):
    torch.manual_seed(1)
    x = torch.randn(N, *shape, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (N,))
    return x, y


def _fit(model, x, y, structure):
    """The user's code: memconv's ``extend`` and ``routed()`` around laplace-torch."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model = mb.extend(model)
    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure=structure,
        backend=BackPackGGN,
    )
    with mb.routed():
        la.fit(loader)
    return la


def _loss_hessian(model, x):
    """``Hₙ = diag(pₙ) − pₙ pₙᵀ`` of the summed cross-entropy, ``[N, V, V]``."""
    with torch.no_grad():
        p = model(x).softmax(-1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


def _jacobians(model, x, probes=None):
    """Per-sample Jacobians of the logits, ``{name: [N, V, *shape]}``: of the
    parameters, or (``probes``: ``{module: shape}``) of zero tensors added to those
    modules' outputs."""
    buffers = dict(model.named_buffers())
    params = {k: v.detach() for k, v in model.named_parameters()}

    def logits(wrt, xn):
        handles = []
        if probes is not None:
            for module, shape in probes.items():
                probe = wrt[id(module)].reshape(shape)
                handles.append(module.register_forward_hook(lambda m, i, o, b=probe: o + b))
        try:
            state = {**params, **buffers} if probes is not None else {**wrt, **buffers}
            return functional_call(model, state, (xn[None],))[0]
        finally:
            for handle in handles:
                handle.remove()

    if probes is None:
        wrt = params
    else:
        wrt = {id(m): x.new_zeros(shape).flatten() for m, shape in probes.items()}
    return vmap(jacrev(logits), in_dims=(None, 0))(wrt, x)


def _ggn(j, h, other=None):
    """``Σₙ Jₙᵀ Hₙ Jₙ`` of Jacobians ``[N, V, *]`` (the blocks of ``j`` and ``other``)."""
    j = j.flatten(2)
    other = j if other is None else other.flatten(2)
    return torch.einsum("nvp,nvw,nwq->pq", j, h, other)


def _input_factor(module, inp):
    """``Ω = (1/N) Σₙₜ uₙₜ uₙₜᵀ``, ``[C_in/G·K, C_in/G·K]``; a grouped convolution's
    input averaged over its groups first (``routed()``'s ``kron_groups="average"``)."""
    if isinstance(module, nn.Linear):
        rows = inp.reshape(-1, inp.shape[-1])
        return rows.T @ rows / inp.shape[0]
    inp = inp.unflatten(1, (module.groups, -1)).mean(1)
    u = nn.functional.unfold(
        inp, module.kernel_size, module.dilation, module.padding, module.stride
    )  # [N, C_in/G·K, T]
    return torch.einsum("nit,njt->ij", u, u) / inp.shape[0]


def _reference_kron(model, x, y):
    """laplace-torch's ``H_facs`` by the construction of the module docstring."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    inputs = {}
    hooks = [
        m.register_forward_hook(lambda m, i, o: inputs.__setitem__(m, (i[0].clone(), o.shape)))
        for m in layers
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    h = _loss_hessian(model, x)
    probes = {}
    for m in layers:
        out_shape = inputs[m][1]
        probes[m] = (out_shape[-1],) if isinstance(m, nn.Linear) else (1, out_shape[1], 1, 1)
    jp = _jacobians(model, x, probes)
    jw = _jacobians(model, x)
    factors = {}
    for m in layers:
        a = _ggn(jp[id(m)], h)
        factors[id(m.weight)] = [a, _input_factor(m, inputs[m][0])]
        if m.bias is not None:
            factors[id(m.bias)] = [_ggn(jp[id(m)], h)]
    for name, p in model.named_parameters():
        if id(p) not in factors:
            factors[id(p)] = [_ggn(jw[name], h)]
    return factors


def _close(got, want):
    scale = want.abs().max()
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-10 * scale, (got - want).abs().max() / scale


@pytest.mark.parametrize("name", MODELS)
def test_diag_laplace_is_the_ggn_diagonal(name):
    model, shape = MODELS[name]()
    reference = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    x, y = _data(shape)
    la = _fit(model, x, y, "diag")
    order = [names[id(p)] for p in la.model.parameters()]
    assert sorted(order) == sorted(names.values())  # every parameter, each once
    jacobians = _jacobians(reference, x)
    h = _loss_hessian(reference, x)
    diagonals = [
        torch.einsum("nvp,nvw,nwp->p", j, h, j) for j in (jacobians[n].flatten(2) for n in order)
    ]
    want = torch.cat(diagonals)
    _close(la.H, want)


@pytest.mark.parametrize("name", MODELS)
def test_kron_laplace_factors_against_autograd(name):
    model, shape = MODELS[name]()
    reference = copy.deepcopy(model)
    to_reference = dict(zip((id(p) for p in model.parameters()), reference.parameters()))
    x, y = _data(shape)
    la = _fit(model, x, y, "kron")
    params = list(la.model.parameters())
    assert len(la.H_facs.kfacs) == len(params) == len(to_reference)
    want = {}
    for start in range(0, N, BATCH):
        batch = _reference_kron(reference, x[start : start + BATCH], y[start : start + BATCH])
        for pid, factors in batch.items():
            if len(factors) == 2:  # laplace-torch's rescaling of the input factor
                factors = [factors[0], factors[1] * BATCH / N]
            old = want.get(pid)
            want[pid] = factors if old is None else [a + b for a, b in zip(old, factors)]
    for p, got in zip(params, la.H_facs.kfacs):
        expected = want[id(to_reference[id(p)])]
        assert len(got) == len(expected)
        for g, w in zip(got, expected):
            _close(g, w)
    # laplace-torch's own use of the factors: its eigendecomposition's log-determinant
    # (memconv's per-group 3-d factors fail here: torch.outer of 2-d eigenvalues), and
    # the GLM predictive (its Jacobians by BackPACK's BatchGrad: routed too)
    assert torch.isfinite(la.log_marginal_likelihood())
    with mb.routed():
        probs = la(x[:2], pred_type="glm", link_approx="probit")
    assert torch.allclose(probs.sum(-1), torch.ones(2, dtype=probs.dtype))


@pytest.mark.parametrize("name", MODELS)
def test_glm_predictive_jacobians_against_autograd(name):
    """laplace-torch's GLM predictive takes the Jacobians from BackPACK's BatchGrad,
    one output at a time: inside ``routed()`` they are memconv's, equal to torch.func's."""
    model, shape = MODELS[name]()
    reference = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    x, _ = _data(shape)
    extended = mb.extend(model)
    extended.output_size = CLASSES  # what laplace-torch's fit sets
    backend = BackPackGGN(extended, "classification")
    with mb.routed():
        got, _ = backend.jacobians(x[:2])
    want = _jacobians(reference, x[:2])
    order = [names[id(p)] for p in backend.model.parameters()]
    _close(got, torch.cat([want[n].flatten(2) for n in order], dim=2))
