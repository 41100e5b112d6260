"""The engines ``memconv compare`` and ``memconv bench`` measure, for two tasks.

``"grads"``: per-sample gradients. Every engine takes a plain torch model (freshly
built by the worker), a batch and its labels, and returns ``{parameter name: Tensor
[N, *shape]}`` with the gradient of each sample's own loss (cross-entropy, summed
reduction), or, for the ``"autograd"`` floor, the summed gradient ``{name: Tensor
[*shape]}``.

``"clip"``: the clipped sum of DP-SGD, Σₙ min(1, C/‖gₙ‖)·gₙ. Every engine returns
``{parameter name: Tensor [*shape]}`` with the clipped sum and, under
:data:`NORMS`, the per-sample norms ``[N]`` before clipping; the ``"non-private"``
floor returns the plain summed gradient. Every engine uses the same clip factor
(:func:`memconv.tasks.groups.clip_factors`), so that results agree to round-off (Opacus'
own factor, ``C/(‖gₙ‖ + 1e-6)``, differs by about 1e-6 relative and costs the same).

``"clip-layer"``: per-layer clipping, Σ_p Σₙ min(1, C/‖gₙ,p‖)·gₙ,p with the threshold C
for each parameter p on its own (Opacus' ``clipping="per_layer"``,
``DPPerLayerOptimizer``; memconv's ``groups="parameter"``); under :data:`NORMS`, the
per-parameter norms ``[N, P]``. Its table holds flat clipping too (not compared: its
result is another sum) and the non-private floor.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import memconv
from memconv.tasks.groups import clip_factors

TASKS = ("grads", "clip", "clip-layer")
#: Key of the per-sample norms in a clipping engine's result.
NORMS = "<norms>"
#: The reference every result is compared with, per task.
REFERENCE = {"grads": "torch.func", "clip": "torch.func", "clip-layer": "torch.func"}
#: The floor (no per-sample work), per task.
FLOOR = {"grads": "autograd", "clip": "non-private", "clip-layer": "non-private"}
#: Engines that take a ``memory_budget`` from the case (or ``--budget-mib``).
BUDGET_ENGINE = "memconv:budget"
#: memconv's whole-call functions with default arguments.
DEFAULT_ENGINE = "memconv:default"

#: pip extra naming each optional peer.
EXTRAS = {"opacus": "memconv[opacus]", "backpack": "memconv[backpack]"}


@dataclass(frozen=True)
class Engine:
    """A way of computing per-sample gradients or clipped sums.

    Attributes:
        name: the engine's label in tables and on the command line.
        task: one of :data:`TASKS`.
        run: ``run(model, inputs, labels, **options) -> dict`` (options:
            ``max_norm`` for clipping engines, ``memory_budget`` for budget engines).
        summary: what it runs, in plain words (command-line help, docs).
        per_sample: False for the floors (plain autograd: summed gradient only).
        requires: importable module the engine needs (reported as skipped if absent).
        budget: True when the engine takes ``memory_budget``.
        compared: False when its result is not the reference's computation (the
            clipping floors; flat clipping in the per-layer table).
    """

    name: str
    task: str
    run: Callable
    summary: str
    per_sample: bool = True
    requires: str | None = None
    budget: bool = False
    compared: bool = True


def _loss():
    return nn.CrossEntropyLoss(reduction="sum")


# ---------------------------------------------------------------- per-sample gradients
def autograd_sum(model, x, y, **_):
    """Plain ``loss.backward()``: the summed gradient only (the floor)."""
    model.zero_grad(set_to_none=True)
    _loss()(model(x), y).backward()
    out = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def torch_func(model, x, y, **_):
    """``torch.func.vmap(grad(loss))`` over the batch."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss = _loss()

    def single(p, xi, yi):
        return loss(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    return torch.func.vmap(torch.func.grad(single), in_dims=(None, 0, 0))(params, x, y)


def memconv_hooks(strategy: str):
    """``memconv.per_sample_grads`` with one strategy (and the budget, if given)."""

    def run(model, x, y, memory_budget=None, **_):
        return memconv.per_sample_grads(
            model, _loss(), x, y, strategy=strategy, memory_budget=memory_budget
        )

    return run


def memconv_modules(strategy: str):
    """memconv's extended modules (``memconv.convert``) inside ``per_sample()``.

    One backward pass; every parametrised layer leaves ``grad_batch``.
    """

    def run(model, x, y, **_):
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
    from backpack import backpack, extensions

    model.zero_grad(set_to_none=True)
    ext = ext if ext is not None else extensions.BatchGrad()
    with backpack(ext), block if block is not None else contextlib.nullcontext():
        _loss()(model(x), y).backward()
    for module in model.modules():
        for n, p in module.named_parameters(recurse=False):
            if p.requires_grad and not hasattr(p, "grad_batch"):
                raise NotImplementedError(
                    f"BackPACK's BatchGrad does not support {type(module).__name__} layers "
                    f"(no grad_batch for its {n})"
                )
    out = {n: p.grad_batch for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
        del p.grad_batch
    return out


def backpack_default(model, x, y, **_):
    """BackPACK's ``BatchGrad`` with its default (same-order) weight VJP."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _backpack_batch_grad(_backpack_extended(model), x, y)


def backpack_save_memory(model, x, y, **_):
    """BackPACK's ``BatchGrad`` inside ``weight_jac_t_save_memory(True)``."""
    from backpack.core.derivatives.convnd import weight_jac_t_save_memory

    with warnings.catch_warnings(), weight_jac_t_save_memory(save_memory=True):
        warnings.simplefilter("ignore")
        return _backpack_batch_grad(_backpack_extended(model), x, y)


def memconv_backpack(strategy: str):
    """BackPACK's ``BatchGrad`` with memconv installed, the forward pass inside
    ``memconv.save_memory(strategy)``."""

    def run(model, x, y, **_):
        from backpack import extensions

        from memconv.integrations import backpack as mb

        model = _backpack_extended(model, convert=True)
        with warnings.catch_warnings(), mb.installed(extensions.BatchGrad()) as ext:
            warnings.simplefilter("ignore")
            return _backpack_batch_grad(model, x, y, ext, memconv.save_memory(strategy))

    return run


def _opacus_grad_samples(model, x, y, force_functorch: bool):
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, loss_reduction="sum", force_functorch=force_functorch)
    try:
        _loss()(gsm(x), y).backward()
        return {n: p.grad_sample for n, p in model.named_parameters()}
    finally:
        for p in model.parameters():
            p.grad = None
            p.grad_sample = None
        gsm._close()


def opacus(force_functorch: bool):
    """Opacus' ``GradSampleModule`` (hooks, or functorch for every layer)."""

    def run(model, x, y, **_):
        return _opacus_grad_samples(model, x, y, force_functorch)

    return run


def expanded_weights(model, x, y, **_):
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


# ---------------------------------------------------------------- clipped sums
def clip_sum(grads: dict, max_norm: float) -> dict:
    """Norms of per-sample gradients ``{name: [N, ...]}`` and their clipped sums."""
    sq = sum(g.reshape(len(g), -1).pow(2).sum(1) for g in grads.values())
    norms = sq.sqrt()
    c = clip_factors(norms, float(max_norm))
    out = {k: torch.einsum("n,n...->...", c.to(g.dtype), g) for k, g in grads.items()}
    out[NORMS] = norms
    return out


def non_private(model, x, y, **_):
    """Plain ``loss.backward()`` (no per-sample work: the floor of DP-SGD)."""
    return autograd_sum(model, x, y)


def torch_func_clip(model, x, y, max_norm, **_):
    """``vmap(grad)`` per-sample gradients, then their norms, clip factors and sum."""
    grads = torch_func(model, x, y)
    return clip_sum(grads, max_norm)


def opacus_hooks_clip(model, x, y, max_norm, **_):
    """Opacus' ``GradSampleModule`` per-sample gradients (hooks), then clip and sum
    (what Opacus' ``DPOptimizer`` does)."""
    grads = _opacus_grad_samples(model, x, y, force_functorch=False)
    return clip_sum(grads, max_norm)


def opacus_ghost_clip(model, x, y, max_norm, **_):
    """Opacus' ghost clipping (``GradSampleModuleFastGradientClipping``, as
    ``PrivacyEngine(grad_sample_mode="ghost")``): a first backward pass computes the
    per-sample norms (ghost norms for Linear layers, per-layer instantiated
    per-sample gradients elsewhere), a second backward pass of Σₙ cₙ·ℓₙ the clipped
    sum (as Opacus' ``DPTensorFastGradientClipping.backward``)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(
        model, loss_reduction="sum", max_grad_norm=max_norm, use_ghost_clipping=True
    )
    try:
        losses = nn.CrossEntropyLoss(reduction="none")(gsm(x), y)
        losses.sum().backward(retain_graph=True)
        norms = gsm.get_norm_sample()
        for p in model.parameters():
            p.grad = None
        c = clip_factors(norms, float(max_norm))
        gsm.disable_hooks()
        (losses * c.to(losses.dtype)).sum().backward()
        gsm.enable_hooks()
        out = {n: p.grad for n, p in model.named_parameters()}
        out[NORMS] = norms.detach()
    finally:
        for p in model.parameters():
            p.grad = None
            p.grad_sample = None
            if hasattr(p, "_norm_sample"):
                del p._norm_sample
        gsm._close()
    return out


# ---------------------------------------------------------------- per-layer clipping
def clip_sum_per_parameter(grads: dict, max_norm: float) -> dict:
    """Each parameter's per-sample gradients clipped to ``max_norm`` on their own and
    summed (Opacus' ``DPPerLayerOptimizer.clip_and_accumulate``, memconv's factor)."""
    out, norms = {}, []
    for k, g in grads.items():
        norm = g.reshape(len(g), -1).pow(2).sum(1).sqrt()
        c = clip_factors(norm, float(max_norm))
        out[k] = torch.einsum("n,n...->...", c.to(g.dtype), g)
        norms.append(norm)
    out[NORMS] = torch.stack(norms, 1)
    return out


def torch_func_clip_layer(model, x, y, max_norm, **_):
    """``vmap(grad)`` per-sample gradients, then per-parameter norms, factors, sums."""
    return clip_sum_per_parameter(torch_func(model, x, y), max_norm)


def opacus_per_layer_clip(model, x, y, max_norm, **_):
    """Opacus' ``GradSampleModule`` per-sample gradients (hooks), then each parameter
    clipped on its own and summed (what Opacus' ``clipping="per_layer"`` does)."""
    return clip_sum_per_parameter(_opacus_grad_samples(model, x, y, False), max_norm)


def memconv_clip_layer(**kwargs):
    """``memconv.clip_and_accumulate(groups="parameter")``: per-layer clipping in one
    backward pass."""

    def run(model, x, y, max_norm, memory_budget=None, **_):
        model.zero_grad(set_to_none=True)
        norms = memconv.clip_and_accumulate(
            model,
            _loss(),
            x,
            y,
            max_norm=max_norm,
            groups="parameter",
            memory_budget=memory_budget,
            **kwargs,
        )
        out = {n: p.grad for n, p in model.named_parameters()}
        out[NORMS] = torch.stack([norms[n] for n in out], 1)
        model.zero_grad(set_to_none=True)
        return out

    return run


def memconv_default_grads(model, x, y, **_):
    """``memconv.per_sample_grads`` with default arguments (the budget: the memory the
    process can use)."""
    return memconv.per_sample_grads(model, _loss(), x, y)


def memconv_default_clip(model, x, y, max_norm, **_):
    """``memconv.clip_and_accumulate`` with default arguments but ``max_norm``."""
    model.zero_grad(set_to_none=True)
    norms = memconv.clip_and_accumulate(model, _loss(), x, y, max_norm=max_norm)
    out = {n: p.grad for n, p in model.named_parameters()}
    out[NORMS] = norms
    model.zero_grad(set_to_none=True)
    return out


def memconv_clip(**kwargs):
    """``memconv.clip_and_accumulate`` with fixed options (and the budget, if given)."""

    def run(model, x, y, max_norm, memory_budget=None, **_):
        model.zero_grad(set_to_none=True)
        norms = memconv.clip_and_accumulate(
            model, _loss(), x, y, max_norm=max_norm, memory_budget=memory_budget, **kwargs
        )
        out = {n: p.grad for n, p in model.named_parameters()}
        out[NORMS] = norms
        model.zero_grad(set_to_none=True)
        return out

    return run


STEP_ENGINE = "memconv:step"


def _private_step(state: dict, model: nn.Module) -> memconv.PrivateStep:
    """The :class:`memconv.PrivateStep` of ``model``, made on its first call (``state``
    holds it: an engine's run function is called again and again on the same model)."""
    if state.get("model") is not model:
        state.clear()
        state["model"], state["step"] = model, memconv.PrivateStep(model, _loss())
    return state["step"]


def memconv_step_grads():
    """``memconv.PrivateStep(model, loss).per_sample_grads`` with default arguments, the
    step made once: every call after the first reuses its checks, probe and plan."""
    state: dict = {}

    def run(model, x, y, **_):
        return _private_step(state, model).per_sample_grads(x, y)

    return run


def memconv_step_clip():
    """``memconv.PrivateStep(model, loss).clip_and_accumulate`` with default arguments
    but ``max_norm``, the step made once (see :func:`memconv_step_grads`)."""
    state: dict = {}

    def run(model, x, y, max_norm, **_):
        model.zero_grad(set_to_none=True)
        norms = _private_step(state, model).clip_and_accumulate(x, y, max_norm=max_norm)
        out = {n: p.grad for n, p in model.named_parameters()}
        out[NORMS] = norms
        model.zero_grad(set_to_none=True)
        return out

    return run


def memconv_private_clip():
    """memconv's private-training path (``memconv.integrations.opacus.make_private``'s
    model) as a training loop runs it, noise and step left out: the private module made
    once, then ``criterion(model(x), y).backward()`` each step (the forward pass
    recorded, its backward pass driven by memconv from the output gradient)."""
    from memconv.integrations.opacus import PrivateModule

    state: dict = {}

    def run(model, x, y, max_norm, **_):
        if state.get("model") is not model:
            state["model"] = model
            state["private"] = PrivateModule(
                model, max_grad_norm=max_norm, loss_reduction="sum", clip_options={}
            )
        model.zero_grad(set_to_none=True)
        private = state["private"]
        _loss()(private(x), y).backward()
        return _taken_grads(model, private.last_norms)

    return run


def memconv_clipping_block():
    """``with memconv.clipping(model, max_norm=C) as clip: criterion(model(x),
    y).backward()``: the block form of the private path, made once."""
    state: dict = {}

    def run(model, x, y, max_norm, **_):
        if state.get("model") is not model:
            state["model"] = model
            state["block"] = memconv.clipping(model, max_norm=max_norm, loss_reduction="sum")
        model.zero_grad(set_to_none=True)
        with state["block"] as clip:
            _loss()(model(x), y).backward()
        return _taken_grads(model, clip.norms)

    return run


def _taken_grads(model: nn.Module, norms) -> dict:
    """The clipped sums left in ``.grad`` and the per-sample ``norms``, taken out of the
    model (its ``.grad`` cleared for the next call)."""
    out = {n: p.grad for n, p in model.named_parameters()}
    out[NORMS] = norms
    model.zero_grad(set_to_none=True)
    return out


def _streamable_prefix(model: nn.Sequential, tile) -> int:
    """Length of the longest leading run of ``model``'s layers StreamingCNN accepts."""
    from memconv.streaming import NotStreamableError, StreamingCNN

    for end in range(len(model), 0, -1):
        try:
            StreamingCNN(model[:end], tile)
        except (NotStreamableError, ValueError, TypeError):
            continue
        return end
    raise ValueError("no leading layer of the model can be streamed")


def _streamed(model):
    """``(StreamingCNN, the rest)`` of a model, made once: a trunk classifier
    (:func:`memconv.bench.trunks.classifier`) streams its trunk with its ``stream_tile``,
    or the tile chosen for its ``stream_budget``; another ``nn.Sequential`` its leading
    local layers (its ``stream_tile``, else 512 input pixels)."""
    from memconv.streaming import StreamingCNN

    if not isinstance(model, nn.Sequential):
        raise TypeError("the memconv-streaming engine needs an nn.Sequential model")
    if getattr(model, "_memconv_bench_stream", None) is None:
        if hasattr(model, "stream_budget"):  # a trunk and a head
            tile = model.stream_tile or "auto"
            budget = model.stream_budget if tile == "auto" else None
            stream, rest = StreamingCNN(model[0], tile, memory_budget=budget), model[1]
        else:
            tile = getattr(model, "stream_tile", None) or 512
            end = _streamable_prefix(model, tile)
            stream, rest = StreamingCNN(model[:end], tile_size=tile), model[end:]
        object.__setattr__(model, "_memconv_bench_stream", (stream, rest))
    return model._memconv_bench_stream


def memconv_streaming(model, x, y, **_):
    """:class:`memconv.streaming.StreamingCNN` over the model's trunk (or leading local
    layers), the rest as usual: the summed gradient, as ``"autograd"``."""
    stream, rest = _streamed(model)
    model.zero_grad(set_to_none=True)
    _loss()(rest(stream(x)), y).backward()
    out = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


#: Lightstream's tile for the trunk classifiers: the tile memconv's engine chooses for
#: the same budget would do, but Lightstream needs its tile to exceed the receptive field
#: and fixes it at construction; 1024 pixels.
LIGHTSTREAM_TILE = 1024


def lightstream(model, x, y, **_):
    """Lightstream 1.0.7's ``StreamingCNN`` over the trunk (Lightstream's own call
    sequence: a forward pass without autograd, the head's backward pass, then
    ``sCNN.backward(image, grad)``): the summed gradient. Runs in Lightstream's own
    environment (``memconv bench --lightstream-python``)."""
    from lightstream.core.scnn.scnn import StreamingCNN

    made = getattr(model, "_lightstream", None)
    if made is None:
        made = {}
        object.__setattr__(model, "_lightstream", made)
    tile = min(model.stream_tile or LIGHTSTREAM_TILE, x.shape[-1])
    if tile not in made:  # the warm-up's small image gets its own
        made[tile] = StreamingCNN(
            model[0], tile_shape=(1, x.shape[1], tile, tile), copy_to_gpu=False
        )
    scnn = made[tile]
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        out = scnn.forward(x)
    out = out.detach().requires_grad_()
    _loss()(model[1](out), y).backward()
    scnn.backward(x, out.grad)
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


# ---------------------------------------------------------------- registry
def _grads_registry() -> list[Engine]:
    engines = [
        Engine(
            "autograd",
            "grads",
            autograd_sum,
            "plain loss.backward(): summed gradient only (the floor)",
            per_sample=False,
        ),
        Engine("torch.func", "grads", torch_func, "torch.func.vmap(grad(loss)) (the reference)"),
        Engine(
            "expanded-weights",
            "grads",
            expanded_weights,
            "torch's ExpandedWeights (call_for_per_sample_grads)",
        ),
        Engine(
            "opacus-hooks",
            "grads",
            opacus(False),
            "Opacus GradSampleModule (hooks)",
            requires="opacus",
        ),
        Engine(
            "opacus-functorch",
            "grads",
            opacus(True),
            "Opacus GradSampleModule with functorch for every layer",
            requires="opacus",
        ),
        Engine(
            "backpack",
            "grads",
            backpack_default,
            "BackPACK BatchGrad (default weight VJP)",
            requires="backpack",
        ),
        Engine(
            "backpack-save-memory",
            "grads",
            backpack_save_memory,
            "BackPACK BatchGrad inside weight_jac_t_save_memory(True)",
            requires="backpack",
        ),
        Engine(
            "memconv-streaming",
            "grads",
            memconv_streaming,
            "memconv.streaming.StreamingCNN over the trunk (or the leading local layers): "
            "summed gradient only, tile by tile",
            per_sample=False,
        ),
        Engine(
            "lightstream",
            "grads",
            lightstream,
            "Lightstream 1.0.7's StreamingCNN over the trunk, backward(image, grad): summed "
            "gradient only (its own environment: --lightstream-python)",
            per_sample=False,
            requires="lightstream",
        ),
    ]
    for s in memconv.available_strategies():
        engines.append(
            Engine(
                f"memconv:{s}",
                "grads",
                memconv_hooks(s),
                f"memconv.per_sample_grads(strategy={s!r})",
            )
        )
    engines.append(
        Engine(
            DEFAULT_ENGINE,
            "grads",
            memconv_default_grads,
            "memconv.per_sample_grads with default arguments (budget: the memory available)",
        )
    )
    engines.append(
        Engine(
            STEP_ENGINE,
            "grads",
            memconv_step_grads(),
            "memconv.PrivateStep(model, loss).per_sample_grads, made once (a training "
            "loop's steady state: checks, probe and plan reused)",
        )
    )
    engines.append(
        Engine(
            BUDGET_ENGINE,
            "grads",
            memconv_hooks("auto"),
            "memconv.per_sample_grads(strategy='auto', memory_budget=the case's budget)",
            budget=True,
        )
    )
    for s in memconv.available_strategies():
        engines.append(
            Engine(
                f"memconv-modules:{s}",
                "grads",
                memconv_modules(s),
                f"memconv's extended modules inside per_sample(), strategy {s!r}",
            )
        )
    for s in memconv.available_strategies():
        engines.append(
            Engine(
                f"memconv-backpack:{s}",
                "grads",
                memconv_backpack(s),
                f"BackPACK BatchGrad through memconv, strategy {s!r}",
                requires="backpack",
            )
        )
    return engines


def _clip_registry() -> list[Engine]:
    return [
        Engine(
            "non-private",
            "clip",
            non_private,
            "plain loss.backward(), no clipping (the floor)",
            per_sample=False,
        ),
        Engine(
            "torch.func",
            "clip",
            torch_func_clip,
            "torch.func vmap(grad) per-sample gradients, then clip and sum (the reference)",
        ),
        Engine(
            "opacus-hooks",
            "clip",
            opacus_hooks_clip,
            "Opacus GradSampleModule per-sample gradients, then clip and sum",
            requires="opacus",
        ),
        Engine(
            "opacus-ghost",
            "clip",
            opacus_ghost_clip,
            "Opacus ghost clipping (GradSampleModuleFastGradientClipping): norms, then a "
            "second backward pass",
            requires="opacus",
        ),
        Engine(
            "memconv:auto",
            "clip",
            memconv_clip(),
            "memconv.clip_and_accumulate, routes chosen per layer",
        ),
        Engine(
            "memconv:ghost",
            "clip",
            memconv_clip(norm_route="ghost"),
            "memconv.clip_and_accumulate(norm_route='ghost')",
        ),
        Engine(
            "memconv:instantiate",
            "clip",
            memconv_clip(norm_route="instantiate"),
            "memconv.clip_and_accumulate(norm_route='instantiate')",
        ),
        Engine(
            "memconv:book-keeping",
            "clip",
            memconv_clip(clip_route="book-keeping"),
            "memconv.clip_and_accumulate(clip_route='book-keeping')",
        ),
        Engine(
            "memconv:two-pass",
            "clip",
            memconv_clip(clip_route="two-pass"),
            "memconv.clip_and_accumulate(clip_route='two-pass')",
        ),
        Engine(
            BUDGET_ENGINE,
            "clip",
            memconv_clip(),
            "memconv.clip_and_accumulate(memory_budget=the case's budget)",
            budget=True,
        ),
        Engine(
            DEFAULT_ENGINE,
            "clip",
            memconv_default_clip,
            "memconv.clip_and_accumulate with default arguments (budget: the memory available)",
        ),
        Engine(
            STEP_ENGINE,
            "clip",
            memconv_step_clip(),
            "memconv.PrivateStep(model, loss).clip_and_accumulate, made once (a training "
            "loop's steady state: checks, probe and plan reused)",
        ),
        Engine(
            "memconv-private",
            "clip",
            memconv_private_clip(),
            "memconv's private-training path on Opacus (make_private's model, made "
            "once): the forward pass recorded, its backward driven from the output "
            "gradient",
        ),
        Engine(
            "memconv:clipping",
            "clip",
            memconv_clipping_block(),
            "with memconv.clipping(model, max_norm): criterion(model(x), y).backward() "
            "(the block made once)",
        ),
    ]


def _clip_layer_registry() -> list[Engine]:
    return [
        Engine(
            "non-private",
            "clip-layer",
            non_private,
            "plain loss.backward(), no clipping (the floor)",
            per_sample=False,
            compared=False,
        ),
        Engine(
            "torch.func",
            "clip-layer",
            torch_func_clip_layer,
            "torch.func vmap(grad) per-sample gradients, then each parameter clipped "
            "and summed (the reference)",
        ),
        Engine(
            "opacus-per-layer",
            "clip-layer",
            opacus_per_layer_clip,
            "Opacus GradSampleModule per-sample gradients, each parameter clipped and "
            "summed (clipping='per_layer')",
            requires="opacus",
        ),
        Engine(
            "memconv:per-layer",
            "clip-layer",
            memconv_clip_layer(),
            "memconv.clip_and_accumulate(groups='parameter'): one backward pass",
        ),
        Engine(
            "memconv:flat",
            "clip-layer",
            memconv_clip(),
            "memconv.clip_and_accumulate, flat clipping (not compared)",
            compared=False,
        ),
    ]


ENGINES: dict[str, dict[str, Engine]] = {
    "grads": {e.name: e for e in _grads_registry()},
    "clip": {e.name: e for e in _clip_registry()},
    "clip-layer": {e.name: e for e in _clip_layer_registry()},
}


def check_task(task: str) -> str:
    """Raise unless ``task`` is a known task; returns it.

    Raises:
        ValueError: naming the accepted tasks.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; accepted: {', '.join(TASKS)}")
    return task


def get_engine(name: str, task: str = "grads") -> Engine:
    """The engine called ``name`` for ``task``.

    Raises:
        ValueError: for an unknown task or name (the message lists the accepted ones).
    """
    engines = ENGINES[check_task(task)]
    if name not in engines:
        raise ValueError(f"unknown {task} engine {name!r}; accepted: {', '.join(engines)}")
    return engines[name]


def available(engine: Engine, python: str | None = None) -> str | None:
    """None if the engine can run here (or in the interpreter ``python``), else why not: a
    missing optional peer, or one that does not import (Opacus without scipy, on a GPU
    machine's own Python)."""
    if engine.requires is None:
        return None
    if python is not None:
        import subprocess

        check = subprocess.run([python, "-c", f"import {engine.requires}"], capture_output=True)
        return None if check.returncode == 0 else f"{python} cannot import {engine.requires}"
    if importlib.util.find_spec(engine.requires) is not None:
        return _import_error(engine.requires)
    if engine.requires not in EXTRAS:  # a peer that lives in its own environment
        return (
            f"{engine.requires} is not installed here; give its environment's interpreter "
            f"(memconv bench --{engine.requires}-python PATH)"
        )
    return f"{engine.requires} is not installed (pip install '{EXTRAS[engine.requires]}')"


@functools.cache
def _import_error(module: str) -> str | None:
    """None if ``module`` imports, else why not."""
    try:
        importlib.import_module(module)
    except ImportError as err:
        return f"{module} does not import here ({err})"
    return None
