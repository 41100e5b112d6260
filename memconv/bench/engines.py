"""Per-sample-gradient engines compared by ``memconv compare`` and ``memconv bench``.

Every engine takes a plain torch model (freshly built by the worker), a batch and
its labels, and returns ``{parameter name: Tensor [N, *shape]}`` with the gradient
of each sample's own loss (cross-entropy, summed reduction), or, for the
``"autograd"`` floor, the summed gradient ``{name: Tensor [*shape]}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import memconv


@dataclass(frozen=True)
class Engine:
    """A way of computing per-sample gradients.

    Attributes:
        name: the engine's label in tables.
        run: ``run(model, inputs, labels) -> dict``.
        per_sample: False for engines that only compute the summed gradient.
        requires: importable module the engine needs (reported as skipped if absent).
    """

    name: str
    run: Callable
    per_sample: bool = True
    requires: str | None = None


def _loss():
    return nn.CrossEntropyLoss(reduction="sum")


def autograd_sum(model, x, y):
    """Plain ``loss.backward()``: the summed gradient only (the floor)."""
    model.zero_grad(set_to_none=True)
    _loss()(model(x), y).backward()
    out = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def torch_func(model, x, y):
    """``torch.func.vmap(grad(loss))`` over the batch."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss = _loss()

    def single(p, xi, yi):
        return loss(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    return torch.func.vmap(torch.func.grad(single), in_dims=(None, 0, 0))(params, x, y)


def memconv_hooks(strategy: str):
    """``memconv.per_sample_grads`` with one strategy."""

    def run(model, x, y):
        return memconv.per_sample_grads(model, _loss(), x, y, strategy=strategy)

    return run


def memconv_modules(strategy: str):
    """memconv's extended modules (:func:`memconv.convert`) inside ``per_sample()``.

    One backward pass; every parametrised layer leaves ``grad_batch``.
    """

    def run(model, x, y):
        memconv.convert(model)
        model.zero_grad(set_to_none=True)
        with memconv.save_memory(strategy), memconv.per_sample():
            loss = _loss()(model(x), y)
        loss.backward()
        out = {n: p.grad_batch for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = None
            del p.grad_batch
        return out

    return run


def _backpack_extended(model, convert: bool = False):
    """``backpack.extend(model)`` once per model object (the worker reuses it); memconv's
    engines convert the model first, so that its layers record their blocks."""
    from backpack import extend

    if not getattr(model, "_memconv_bench_extended", False):
        if convert:
            memconv.convert(model)
        extend(model)
        model._memconv_bench_extended = True
    return model


def _backpack_batch_grad(model, x, y, ext=None, block=None):
    import contextlib

    from backpack import backpack, extensions

    model.zero_grad(set_to_none=True)
    ext = ext if ext is not None else extensions.BatchGrad()
    with backpack(ext), block if block is not None else contextlib.nullcontext():
        _loss()(model(x), y).backward()
    out = {n: p.grad_batch for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
        del p.grad_batch
    return out


def backpack_default(model, x, y):
    """BackPACK's ``BatchGrad`` with its default (same-order) weight VJP."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _backpack_batch_grad(_backpack_extended(model), x, y)


def backpack_save_memory(model, x, y):
    """BackPACK's ``BatchGrad`` inside ``weight_jac_t_save_memory(True)``."""
    import warnings

    from backpack.core.derivatives.convnd import weight_jac_t_save_memory

    with warnings.catch_warnings(), weight_jac_t_save_memory(save_memory=True):
        warnings.simplefilter("ignore")
        return _backpack_batch_grad(_backpack_extended(model), x, y)


def memconv_backpack(strategy: str):
    """BackPACK's ``BatchGrad`` with memconv installed, the forward pass inside
    ``memconv.save_memory(strategy)``."""

    def run(model, x, y):
        import warnings

        from backpack import extensions

        from memconv.integrations import backpack as mb

        model = _backpack_extended(model, convert=True)
        with warnings.catch_warnings(), mb.installed(extensions.BatchGrad()) as ext:
            warnings.simplefilter("ignore")
            return _backpack_batch_grad(model, x, y, ext, memconv.save_memory(strategy))

    return run


def opacus(force_functorch: bool):
    """Opacus' ``GradSampleModule`` (hooks, or functorch for every layer)."""

    def run(model, x, y):
        from opacus import GradSampleModule

        gsm = GradSampleModule(model, loss_reduction="sum", force_functorch=force_functorch)
        try:
            _loss()(gsm(x), y).backward()
            out = {n: p.grad_sample for n, p in model.named_parameters()}
        finally:
            for p in model.parameters():
                p.grad = None
            gsm._close()
        return out

    return run


def expanded_weights(model, x, y):
    """torch's ExpandedWeights (``call_for_per_sample_grads``)."""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    _loss()(
        call_for_per_sample_grads(model, batch_size=len(x), loss_reduction="sum")(x), y
    ).backward()
    out = {n: p.grad_sample for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
        p.grad_sample = None
    return out


def _streamable_prefix(model: nn.Sequential) -> int:
    """Length of the longest leading run of ``model``'s layers StreamingCNN accepts."""
    from memconv.streaming import NotStreamableError, analyse

    for end in range(len(model), 0, -1):
        try:
            analyse(model[:end])
        except (NotStreamableError, ValueError, TypeError):
            continue
        return end
    raise ValueError("no leading layer of the model can be streamed")


def memconv_streaming(model, x, y):
    """:class:`memconv.streaming.StreamingCNN` over the model's leading local layers,
    the rest as usual: the summed gradient, as ``"autograd"`` (the tile is the
    model's ``stream_tile`` attribute, else 512 input pixels)."""
    from memconv.streaming import StreamingCNN

    if not isinstance(model, nn.Sequential):
        raise TypeError("the memconv-streaming engine needs an nn.Sequential model")
    if getattr(model, "_memconv_bench_stream", None) is None:
        end = _streamable_prefix(model)
        stream = StreamingCNN(model[:end], tile_size=getattr(model, "stream_tile", 512))
        object.__setattr__(model, "_memconv_bench_stream", (stream, model[end:]))
    stream, rest = model._memconv_bench_stream
    model.zero_grad(set_to_none=True)
    _loss()(rest(stream(x)), y).backward()
    out = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _registry() -> dict[str, Engine]:
    engines = [
        Engine("autograd", autograd_sum, per_sample=False),
        Engine("torch.func", torch_func),
        Engine("expanded-weights", expanded_weights),
        Engine("opacus-hooks", opacus(False), requires="opacus"),
        Engine("opacus-functorch", opacus(True), requires="opacus"),
        Engine("backpack", backpack_default, requires="backpack"),
        Engine("backpack-save-memory", backpack_save_memory, requires="backpack"),
        Engine("memconv-streaming", memconv_streaming, per_sample=False),
    ]
    engines += [Engine(f"memconv:{s}", memconv_hooks(s)) for s in memconv.strategies()]
    engines += [Engine(f"memconv-modules:{s}", memconv_modules(s)) for s in memconv.strategies()]
    engines += [
        Engine(f"memconv-backpack:{s}", memconv_backpack(s), requires="backpack")
        for s in memconv.strategies()
    ]
    return {e.name: e for e in engines}


ENGINES = _registry()


def available(engine: Engine) -> str | None:
    """None if the engine can run here, else why not (a missing optional peer)."""
    if engine.requires is None:
        return None
    import importlib.util

    if importlib.util.find_spec(engine.requires) is None:
        return f"{engine.requires} is not installed"
    return None


def get_engine(name: str) -> Engine:
    """The engine called ``name``.

    Raises:
        ValueError: for an unknown name (the message lists the accepted ones).
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; accepted: {', '.join(ENGINES)}")
    return ENGINES[name]
