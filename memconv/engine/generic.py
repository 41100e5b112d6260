"""The exact generic route, for every layer call no rule covers.

A layer without a rule (``MultiheadAttention``, ``GRU``/``LSTM``, a subclass that
overrides ``forward``, a user's module, a layer with hooks or called with keyword
arguments) gets its per-sample gradients from ``torch.func``: the VJP of
``torch.func.functional_call`` with the call's real positional and keyword
arguments, vectorised over the samples with ``torch.func.vmap`` (Opacus'
functorch grad sampler does the same for layers it has no sampler for), in chunks
of samples. Where ``vmap`` cannot run the layer (torch's RNN kernels write their
hidden state in place), a loop over the samples by autograd gives the same numbers.
The batch axis of every argument and output comes from the caller (found by a probe
of one and two samples), not from a guess.

A parameter used outside the layers that own it (an embedding matrix reused as the
output projection, a bare ``nn.Parameter`` used in a parent's ``forward``) gets its
per-sample gradients from the whole model's per-sample loss in the same way
(:func:`model_grad_sample`).

A forward pass that draws random numbers (dropout in training mode) cannot be
replayed sample by sample with the same numbers: that raises a ``ValueError``
naming the layer, never a gradient of other random numbers.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .._torch import tree_flatten, tree_unflatten

logger = logging.getLogger("memconv")


class RandomForwardError(ValueError):
    """A forward pass replayed per sample draws random numbers."""


def _random_error(what: str) -> RandomForwardError:
    return RandomForwardError(
        f"{what} draws random numbers in its forward pass (dropout in training mode, say), "
        "so memconv cannot replay it sample by sample with the numbers the batch used; "
        "call .eval() on its random layers (or set their dropout to 0) for per-sample "
        "quantities"
    )


def _rng_states():
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += list(torch.cuda.get_rng_state_all())
    return states


def _same_states(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


#: The start of torch's note that vmap loops over an operator without a batching rule.
_FALLBACK_NOTE = "There is a performance drop because we have"


@contextlib.contextmanager
def quiet_fallbacks():
    """Silence torch's note that an operator has no batching rule (vmap then loops over
    it internally: the numbers are the same, only slower).

    The note is dropped where warnings are shown (``warnings.showwarning``), not by a
    filter: entering ``warnings.catch_warnings()`` resets Python's record of the
    warnings already shown once, so the user's own warnings would reappear after
    every call."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not str(message).startswith(_FALLBACK_NOTE):
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def chunk_size(n: int, per_sample_bytes: int, budget: int | None) -> int | None:
    """Samples per ``vmap`` chunk within ``budget`` bytes (None: all at once)."""
    if budget is None:
        return None
    return max(1, min(n, budget // max(per_sample_bytes, 1)))


def _split_params(module: nn.Module, names) -> tuple[dict, dict]:
    """``(the parameters to differentiate, every other parameter)`` of ``module``, by
    name, detached: the others enter as constants, so that no result depends on them
    through a graph (a clip factor must not carry one into a second backward pass)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    params = {k: named[k].detach() for k in names}
    ids = {id(named[k]) for k in names}
    fixed = {k: p.detach() for k, p in named.items() if id(p) not in ids}
    return params, fixed


def _narrow(t: Tensor, axis: int, i: int) -> Tensor:
    return t.narrow(axis, i, 1)


def call_grad_sample(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    in_axes: Sequence[int | None],
    grad_outputs: Sequence[Tensor | None],
    out_axes: Sequence[int | None],
    names: Sequence[str],
    *,
    what: str,
    chunk: int | None = None,
) -> dict[str, Tensor]:
    """Per-sample gradients of one layer call by ``torch.func``.

    Args:
        module: the layer.
        args: its positional arguments in the call (tensors detached).
        kwargs: its keyword arguments in the call.
        in_axes: the batch axis of each leaf of ``(args, kwargs)`` (flattened by
            ``torch.utils._pytree``), or None for a leaf shared by all samples.
        grad_outputs: the gradient of each leaf of the call's output, or None where
            it does not reach the loss.
        out_axes: the batch axis of each output leaf (None: not split by sample).
        names: the parameters to differentiate, by their names in ``module``.
        what: the layer's description, for messages.
        chunk: samples per ``vmap`` chunk (None: all).

    Returns:
        ``{name: [N, *param.shape]}``.

    Raises:
        ValueError: the forward pass draws random numbers; an output that reaches the
            loss has no batch axis.
    """
    leaves, spec = tree_flatten((args, kwargs))
    batched = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and in_axes[i] is not None
    ]
    used = [j for j, g in enumerate(grad_outputs) if g is not None]
    for j in used:
        if out_axes[j] is None:
            raise ValueError(
                f"{what}: an output that reaches the loss has no batch axis, so its "
                "gradient cannot be split by sample"
            )
    if batched:
        n = leaves[batched[0]].shape[in_axes[batched[0]]]
    else:
        n = grad_outputs[used[0]].shape[out_axes[used[0]]]
    params, fixed = _split_params(module, names)
    if n == 0 or not used:
        return {k: p.new_zeros(n, *p.shape) for k, p in params.items()}

    def rebuild(batch_leaves, unsqueeze: bool):
        full = list(leaves)
        for i, leaf in zip(batched, batch_leaves):
            full[i] = leaf.unsqueeze(in_axes[i]) if unsqueeze else leaf
        return tree_unflatten(full, spec)

    def outputs(p, call_args, call_kwargs, squeeze: bool):
        out = torch.func.functional_call(module, {**fixed, **p}, call_args, call_kwargs)
        out_leaves = tree_flatten(out)[0]
        return tuple(out_leaves[j].squeeze(out_axes[j]) if squeeze else out_leaves[j] for j in used)

    def single(batch_leaves, gouts):
        call_args, call_kwargs = rebuild(batch_leaves, True)
        _, pullback = torch.func.vjp(lambda p: outputs(p, call_args, call_kwargs, True), params)
        return pullback(tuple(gouts))[0]

    xs = [leaves[i] for i in batched]
    gs = [grad_outputs[j] for j in used]
    try:
        with quiet_fallbacks():
            return torch.func.vmap(
                single,
                in_dims=([in_axes[i] for i in batched], [out_axes[j] for j in used]),
                randomness="error",
                chunk_size=chunk,
            )(xs, gs)
    except RuntimeError as err:
        if "random" in str(err).lower():
            raise _random_error(what) from err
        logger.debug("memconv: %s runs sample by sample (vmap: %s)", what, err)

    # a loop over the samples by autograd (same numbers; torch's RNN kernels need it)
    per_sample = []
    with torch.enable_grad():
        for i in range(n):
            parts = [_narrow(x, in_axes[b], i) for b, x in zip(batched, xs)]
            call_args, call_kwargs = rebuild(parts, False)
            p = {k: v.clone().requires_grad_() for k, v in params.items()}
            before = _rng_states() if i == 0 else None
            outs = outputs(p, call_args, call_kwargs, False)
            if before is not None and not _same_states(before, _rng_states()):
                raise _random_error(what)
            cot = [_narrow(g, out_axes[j], i) for j, g in zip(used, gs)]
            pairs = [(o, c) for o, c in zip(outs, cot) if o.requires_grad]
            grads = [None] * len(p)
            if pairs:
                outs, cots = [o for o, _ in pairs], [c for _, c in pairs]
                grads = torch.autograd.grad(outs, list(p.values()), cots, allow_unused=True)
            per_sample.append(
                [g if g is not None else torch.zeros_like(v) for g, v in zip(grads, p.values())]
            )
    return {k: torch.stack([s[j] for s in per_sample]) for j, k in enumerate(params)}


def model_grad_sample(
    model: nn.Module,
    loss_fn,
    inputs: Tensor,
    targets,
    names: Sequence[str],
    *,
    chunk: int | None = None,
) -> dict[str, Tensor]:
    """Per-sample gradients of the per-sample loss ``loss_fn(model(x[n:n+1]),
    targets[n:n+1])`` with respect to the parameters ``names`` (names in ``model``),
    by ``torch.func`` over the whole model (a loop by autograd where ``vmap``
    cannot run it).

    Returns:
        ``{name: [N, *param.shape]}``.

    Raises:
        ValueError: the model's forward pass draws random numbers.
    """
    params, fixed = _split_params(model, names)
    n = len(inputs)
    if n == 0 or not params:
        return {k: p.new_zeros(n, *p.shape) for k, p in params.items()}

    def loss(p, x, t):
        out = torch.func.functional_call(model, {**fixed, **p}, (x.unsqueeze(0),))
        return loss_fn(out, t.unsqueeze(0))

    try:
        with quiet_fallbacks():
            return torch.func.vmap(
                torch.func.grad(loss), in_dims=(None, 0, 0), randomness="error", chunk_size=chunk
            )(params, inputs.detach(), targets)
    except RuntimeError as err:
        if "random" in str(err).lower():
            raise _random_error("the model") from err
        logger.debug("memconv: the model runs sample by sample (vmap: %s)", err)
    per_sample = []
    with torch.enable_grad():
        for i in range(n):
            p = {k: v.clone().requires_grad_() for k, v in params.items()}
            before = _rng_states() if i == 0 else None
            value = loss(p, inputs[i].detach(), targets[i])
            if before is not None and not _same_states(before, _rng_states()):
                raise _random_error("the model")
            grads = torch.autograd.grad(value, list(p.values()), allow_unused=True)
            per_sample.append(
                [g if g is not None else torch.zeros_like(v) for g, v in zip(grads, p.values())]
            )
    return {k: torch.stack([s[j] for s in per_sample]) for j, k in enumerate(params)}
