"""Per-sample gradients of a whole model in one backward pass.

The forward pass records, for every module that owns trainable parameters, its
input; a hook on its output receives the output gradient during the one backward
pass, and the per-sample parameter gradients are computed right there (the
convolution weight with the active memconv strategy, Linear as an outer product,
any other per-sample layer through ``torch.func``), after which the output gradient
is dropped. The backward pass asks autograd only for the gradients of the
outputs of the first parametrised layers, so autograd itself computes no weight
gradient: nothing is computed twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ._geometry import CONV_TYPES, conv_spec
from .vjp import bias_grad, check_settings, settings_for, weight_grad

#: Modules that couple the samples of a batch in training mode.
_COUPLING = (nn.modules.batchnorm._BatchNorm,)


def check_per_sample_model(model: nn.Module, argument: str = "model") -> None:
    """Raise if a layer of ``model`` mixes samples (BatchNorm in training mode).

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.
        ValueError: naming the first coupling layer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{argument} must be a torch.nn.Module, got {type(model).__name__}")
    for name, module in model.named_modules():
        if isinstance(module, _COUPLING) and module.training:
            raise ValueError(
                f"{argument}: layer {name or type(module).__name__!r} "
                f"({type(module).__name__} in training mode) mixes the samples of a "
                "batch, so per-sample gradients are undefined; call .eval() on it "
                "or replace it by GroupNorm/LayerNorm"
            )


def _own_params(module: nn.Module) -> dict[str, Tensor]:
    return {k: p for k, p in module.named_parameters(recurse=False) if p.requires_grad}


def _linear_grads(module: nn.Linear, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    n = x.shape[0]
    x2 = x.reshape(n, -1, x.shape[-1])
    g2 = g.reshape(n, -1, g.shape[-1])
    out = {"weight": torch.matmul(g2.transpose(1, 2), x2)}
    if module.bias is not None:
        out["bias"] = g2.sum(1)
    return out


def _generic_grads(module: nn.Module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
    params = {k: p.detach() for k, p in _own_params(module).items()}

    def single(xi, gi):
        def f(p):
            return torch.func.functional_call(module, p, (xi.unsqueeze(0),)).squeeze(0)

        _, pullback = torch.func.vjp(f, params)
        return pullback(gi)[0]

    return torch.func.vmap(single)(x, g)


def _conv_grads(module, x, g, settings) -> dict[str, Tensor]:
    spec = conv_spec(module)
    out = {}
    if module.weight.requires_grad:
        out["weight"] = weight_grad(
            spec.normalize_input(x), g, spec.geometry, per_sample=True, settings=settings
        )
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = bias_grad(g, per_sample=True)
    return out


def per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    *,
    strategy: str | bool | None = None,
    engine: str = "memconv",
) -> dict[str, Tensor]:
    """Per-sample gradients of every trainable parameter, in one backward pass.

    ``out[name][n]`` is the gradient of ``loss_fn(model(inputs[n:n+1]),
    targets[n:n+1])`` with respect to the parameter ``name`` (as
    ``model.named_parameters()`` names it), whatever the reduction of ``loss_fn``.

    Args:
        model: built from standard torch layers (convolutions, Linear, activations,
            pooling, Flatten, Dropout in eval, normalisation in eval, ...).
        loss_fn: called as ``loss_fn(output[n:n+1], targets[n:n+1])``, returning a
            scalar.
        inputs: ``[N, ...]``.
        targets: ``[N, ...]``.
        strategy: convolution weight-VJP strategy; ``None`` uses the active one.
        engine: ``"memconv"`` (hooks, this module) or ``"backpack"`` (BackPACK's
            ``BatchGrad`` with memconv's strategies; needs ``backpack-for-pytorch``).

    Returns:
        ``{name: Tensor [N, *param.shape]}`` for every parameter with
        ``requires_grad``, in ``named_parameters`` order.

    Raises:
        TypeError: if ``model`` is not a module or ``inputs`` not a tensor.
        ValueError: unknown strategy or engine, a layer that mixes samples
            (BatchNorm in training mode), ``inputs`` and ``targets`` of different
            lengths. All raised before any work.
    """
    settings = settings_for(strategy)
    check_per_sample_model(model)
    if engine not in ("memconv", "backpack"):
        raise ValueError(f"unknown engine {engine!r}; accepted: 'memconv', 'backpack'")
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
    if len(inputs) != len(targets):
        raise ValueError(
            f"inputs and targets must have the same length N, got {len(inputs)} and {len(targets)}"
        )
    for module in model.modules():
        if isinstance(module, CONV_TYPES):
            check_settings(settings, conv_spec(module).geometry)
    if engine == "backpack":
        from .integrations.backpack import per_sample_grads_backpack

        return per_sample_grads_backpack(model, loss_fn, inputs, targets, settings)
    return _per_sample_grads_hooks(model, loss_fn, inputs, targets, settings)


def _edge(t: Tensor):
    get_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    return t if get_edge is None else get_edge(t)


def _per_sample_grads_hooks(model, loss_fn, inputs, targets, settings):
    owners = {}  # module -> {local name: full name}
    for name, module in model.named_modules():
        local = _own_params(module)
        if local:
            prefix = f"{name}." if name else ""
            owners[module] = {k: prefix + k for k in local}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads: dict[str, Tensor | None] = dict.fromkeys(names)
    roots: list[Tensor] = []
    active = [True]

    def accumulate(module, local):
        for k, v in local.items():
            full = owners[module][k]
            grads[full] = v if grads[full] is None else grads[full] + v

    def forward_hook(module, args, output):
        if not active[0] or not isinstance(output, Tensor) or not output.requires_grad:
            return None
        x = args[0].detach()

        def on_grad(g):
            active[0] = False
            try:
                with torch.no_grad():
                    if isinstance(module, CONV_TYPES):
                        local = _conv_grads(module, x, g, settings)
                    elif isinstance(module, nn.Linear):
                        local = _linear_grads(module, x, g)
                    else:
                        local = _generic_grads(module, x, g)
                accumulate(module, local)
            finally:
                active[0] = True

        output.register_hook(on_grad)
        if not args[0].requires_grad:
            # the gradient edge, not the tensor: the output may be freed after use
            roots.append(_edge(output))
        return None

    handles = [m.register_forward_hook(forward_hook) for m in owners]
    try:
        # detached: the graph then starts at the first parametrised layers' outputs
        # (the roots), whatever the caller's inputs require
        output = model(inputs.detach())
        loss = sum(loss_fn(output[i : i + 1], targets[i : i + 1]) for i in range(len(inputs)))
    finally:
        for h in handles:
            h.remove()
    if roots:
        torch.autograd.grad(loss, roots, allow_unused=True)
    params = dict(model.named_parameters())
    return {
        name: (g if g is not None else params[name].new_zeros(len(inputs), *params[name].shape))
        for name, g in grads.items()
    }
