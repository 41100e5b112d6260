"""BackPACK's extensions on a ``torch.compile``'d model: one compiled graph per step.

:func:`memconv.integrations.backpack.step` is BackPACK's ::

    with backpack(*extensions):
        loss = lossfunc(model(inputs), targets)
        loss.backward()

as one call. For a ``torch.compile``'d model, the whole step — the forward pass with
BackPACK's hooks, the backward pass with every extension's backpropagated quantities
and module extensions (memconv's where :func:`memconv.integrations.backpack.install`
put them) — is traced once per shapes and settings into one graph of ATen operations
(``make_fx``, as for the compiled per-sample step: :mod:`memconv.engine.traced`) and
compiled by the model's own backend, mode and options. Later steps run the compiled
graph and none of BackPACK's Python; its outputs become ``.grad`` (accumulated, as
``backward()`` does) and the extensions' savefields (``param.kfac``,
``param.diag_ggn_exact``, ...). curvlinops computes its compiled KFAC the same way (the
per-batch computation traced with ``make_fx`` and compiled).

While tracing, three host reads of BackPACK's whose outcome the step itself fixes are
skipped (:func:`_fixed_host_reads`): the loss module's check that ``backward()`` starts
at its output (the step starts it there), ``torch.distributions``' validation of the
softmax probabilities the Monte-Carlo extensions sample from, and the range check of
the one-hot encoding of the sampled classes.

Random numbers: the Monte-Carlo extensions (``KFAC``, ``DiagGGNMC``, ``SqrtGGNMC``)
draw their samples inside the graph. The forward pass runs once in it, so the draws
are consistent within a step. A backend that runs ATen's operations as they are
(``"eager"``, ``"aot_eager"``) draws from torch's generator as eager BackPACK does, the
same numbers under the same seed; inductor draws from its own generator: the same
distribution, other numbers.

What the trace cannot keep is refused and that step runs eagerly, with a warning naming
it (once per model and reason): a host read in the model's forward, a tensor read from
outside the model and the inputs, hooks of other code on the model's modules, a
compiler error.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor, nn

from ..._torch import compile_backend, compiled_inner, tracing
from ...conv import settings as context
from ...engine.request import Batch
from ...engine.traced import Identity, ModuleAttributes, TracedSteps, loss_key, tensor_key

#: Each compiled model's traced steps, by its eager module.
_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run(model: nn.Module, lossfunc, inputs, targets, extensions: tuple, *, state: tuple):
    """:func:`memconv.integrations.backpack.step` (its docstring gives the arguments,
    returns, errors and warnings); ``state``: what else a traced step depends on, of
    the integration's state (the extensions' installed module extensions, the open
    ``routed()`` block), part of the graph's key."""
    check(model, inputs, targets, extensions)
    inner = compiled_inner(model)
    module = model if inner is None else inner  # a Sequential of no layers is falsy
    params = [p for p in module.parameters() if p.requires_grad]
    fields = [e.savefield for e in extensions]
    if inner is None:
        loss = _eager(model, lossfunc, inputs, targets, extensions)
    else:
        steps = _steps.get(inner)
        if steps is None:
            steps = _steps[inner] = _traced_steps()
        batch = Batch(model=inner, loss_fn=lossfunc, inputs=inputs, targets=targets)
        result = steps.run(
            (state, *_key(inner, lossfunc, inputs, targets)),
            _walk(extensions, params, fields),
            batch,
            (),
            compile_backend(model),
            inner,
        )
        loss = _apply(params, fields, result)
    _check_fields(module, params, fields)
    return loss


def traces(model: nn.Module) -> int:
    """How many graphs :func:`memconv.integrations.backpack.step` has traced for the
    ``torch.compile``'d ``model``."""
    inner = compiled_inner(model)
    steps = _steps.get(model if inner is None else inner)
    return 0 if steps is None else steps.traces


def check(model, inputs, targets, extensions) -> None:
    """The arguments of :func:`run`, before any work (its docstring's TypeErrors)."""
    from backpack.extensions.backprop_extension import BackpropExtension

    if not isinstance(model, nn.Module):
        raise TypeError(f"step's model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, Tensor):
            raise TypeError(f"step's {name} must be a Tensor, got {type(value).__name__}")
    for ext in extensions:
        if not isinstance(ext, BackpropExtension):
            raise TypeError(
                "step's extensions must be BackPACK extension objects (KFAC(), "
                f"DiagGGNExact(), ...), got {type(ext).__name__}"
            )


def _eager(model, lossfunc, inputs, targets, extensions) -> Tensor:
    from backpack import backpack
    from backpack.extensions.saved_quantities import SavedQuantities

    for ext in extensions:
        # a step is a fresh backward pass: BackPACK keys the quantities it passes back
        # by the reference tensor's address (data_ptr), so one left by a backward pass
        # that stopped midway (a refused trace, an error) would meet a new tensor at a
        # reused address, and be accumulated into it, as chance has it
        ext.saved_quantities = SavedQuantities()
    with backpack(*extensions):
        loss = lossfunc(model(inputs), targets)
        loss.backward()
    return loss.detach()


def _traced_steps() -> TracedSteps:
    import backpack

    hooks = (backpack.hook_store_io, backpack.hook_run_extensions)
    return TracedSteps(what="BackPACK step", hooks=hooks, random=True)


def _key(inner: nn.Module, lossfunc, inputs: Tensor, targets: Tensor) -> tuple:
    """What the traced graph depends on of the model, the loss function (what it
    computes, :func:`memconv.engine.traced.loss_key`: its operations are in the
    graph), the settings and the tensors besides their values: each parameter (the
    object, held by the key so that its id stays its own) with its ``requires_grad``
    and layout, and the modules' plain attributes
    (:class:`memconv.engine.traced.ModuleAttributes`: constants of the graph)."""
    return (
        context.block_settings(),
        loss_key(lossfunc),
        tuple(m.training for m in inner.modules()),
        ModuleAttributes(inner).values(),
        tuple(
            (Identity(p), p.requires_grad, p.shape, p.stride(), p.dtype, p.device)
            for p in inner.parameters()
        ),
        tensor_key(inputs),
        tensor_key(targets),
    )


def _walk(extensions: tuple, params: list, fields: list):
    """The step as a function of the batch, returning what it computes: the loss, the
    parameters' gradients and savefields (None where not computed). It leaves the
    parameters as it found them: :func:`_apply` writes the results."""

    def walk(batch: Batch) -> dict:
        before = [(p.grad, [getattr(p, f, None) for f in fields]) for p in params]
        for p in params:
            p.grad = None  # the trace must not read an earlier step's gradient
            _drop(p, fields)
        try:
            reads = _fixed_host_reads() if tracing() else contextlib.nullcontext()
            with reads:
                loss = _eager(batch.model, batch.loss_fn, batch.inputs, batch.targets, extensions)
            grads = [p.grad for p in params]
            got = [[getattr(p, f, None) for f in fields] for p in params]
        finally:
            for p, (grad, values) in zip(params, before):
                p.grad = grad
                _drop(p, fields)
                for f, v in zip(fields, values):
                    if v is not None:
                        setattr(p, f, v)
        return {"loss": loss, "grads": grads, "fields": got}

    return walk


def _drop(p: Tensor, fields: list) -> None:
    for f in fields:
        if hasattr(p, f):
            delattr(p, f)


def _apply(params: list, fields: list, result: dict) -> Tensor:
    """Write a step's results on the parameters as ``backward()`` and BackPACK do:
    ``.grad`` accumulated, each savefield set."""
    with torch.no_grad():
        for p, grad, values in zip(params, result["grads"], result["fields"]):
            if grad is not None:
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad += grad
            for f, v in zip(fields, values):
                if v is not None:
                    setattr(p, f, v)
    return result["loss"]


def _check_fields(model: nn.Module, params: list, fields: list) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    for p in params:
        if p.grad is None:
            continue
        missing = [f for f in fields if not hasattr(p, f)]
        if missing:
            raise RuntimeError(
                f"BackPACK computed no {missing[0]!r} for parameter "
                f"{names.get(id(p), '?')!r}, which got a gradient: is the model extended "
                "(memconv.integrations.backpack.extend, or BackPACK's extend)?"
            )


@contextlib.contextmanager
def _fixed_host_reads():
    """BackPACK's host reads of traced values whose outcome :func:`run` fixes, off for
    the time of a trace (a trace stops at a host read):

    - ``BaseLossDerivatives._check_loss_has_not_been_modified`` reads whether the loss
      module's output gradient is 1 (it warns otherwise): the step calls ``backward()``
      on that output itself;
    - ``torch.distributions``' argument validation (``Categorical(probs)`` in the
      Monte-Carlo extensions): the probabilities are a softmax's;
    - ``F.one_hot``'s range check of the classes the cross-entropy loss's Monte-Carlo
      square root samples: they are drawn from ``num_classes`` categories.
    """
    from backpack.core.derivatives import crossentropyloss
    from backpack.core.derivatives.basederivatives import BaseLossDerivatives
    from torch.distributions import Distribution

    check = BaseLossDerivatives.__dict__["_check_loss_has_not_been_modified"]
    validate = Distribution._validate_args
    one_hot = crossentropyloss.one_hot
    BaseLossDerivatives._check_loss_has_not_been_modified = classmethod(_unmodified)
    Distribution.set_default_validate_args(False)
    crossentropyloss.one_hot = _one_hot
    try:
        yield
    finally:
        BaseLossDerivatives._check_loss_has_not_been_modified = check
        Distribution.set_default_validate_args(validate)
        crossentropyloss.one_hot = one_hot


def _unmodified(cls, module, g_out) -> None:
    """The loss's output gradient is 1: :func:`run` starts ``backward()`` there."""


def _one_hot(classes: Tensor, num_classes: int) -> Tensor:
    """``F.one_hot(classes, num_classes)`` for classes in ``[0, num_classes)``, without
    its range check (a host read)."""
    return (classes.unsqueeze(-1) == torch.arange(num_classes, device=classes.device)).long()
