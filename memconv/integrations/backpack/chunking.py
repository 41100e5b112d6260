"""The backward pass of a second-order extension over chunks of the ``V`` rows of its factor.

BackPACK's exact GGN extensions pass a factor ``S`` with ``V`` rows per sample (``V``
= the model's outputs) from the loss to every layer, so their memory grows with the
number of classes. The diagonals are sums over the rows and SqrtGGN's rows are
independent, so the extension's work can run over chunks of rows: each module
extension's call is recorded during the backward pass (its module's input and output,
which BackPACK would release, kept), and once autograd has finished the pass, the
recorded calls run again in the same order once per chunk of rows, the loss's factor
sliced; the parameters' quantities are summed over the chunks (SqrtGGN's
concatenated). The peak is then that of a ``V`` of the chunk's size.

The budget of a chunk's factors is a number of bytes, or ``"lean"`` (the default of
:func:`memconv.integrations.backpack.install`): :data:`LEAN_FACTOR` times the bytes of
the layer inputs and outputs the forward pass stored for the extension (the
activations a plain backward pass keeps), at least :data:`LEAN_MIN_BYTES`, so that the
factors take no more than the activations, whatever ``V``: the peak stays near the MC
variant's (one row), and grows with the model and batch as a plain backward pass's
does. A factor of one row per sample (the MC extensions' default ``mc_samples=1``, a
model with one output) has nothing to chunk: under ``"lean"`` its backward pass runs
in one pass, as BackPACK's, without keeping the layers' inputs and outputs for a replay.

Covered: ``DiagGGN{Exact,MC}``, ``BatchDiagGGN{Exact,MC}``, ``SqrtGGN{Exact,MC}``.
``{Batch}DiagHessian`` is not chunked: besides the loss's ``V`` rows, each activation
with a non-zero second derivative adds a residual factor whose rows are its features
(not ``V``), which a replay per chunk would add once per chunk; those residual factors,
not ``V``, dominate its memory on a network with curved activations, and on a
piecewise-linear one (ReLU) it equals ``DiagGGNExact``, which is chunked.

Imports BackPACK; loaded by :mod:`memconv.integrations.backpack` on demand.
"""

from __future__ import annotations

import logging
import weakref

import torch
from backpack.context import CTX
from backpack.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)
from backpack.extensions.saved_quantities import SavedQuantities
from backpack.utils.hooks import no_op
from backpack.utils.module_classification import is_loss

from ..._checks import LEAN
from ..._torch import graph_task_id, queue_backward_callback
from .naming import describe

logger = logging.getLogger("memconv")

#: The extensions whose backward pass runs over chunks of rows under a budget.
CHUNKED = (DiagGGNExact, DiagGGNMC, BatchDiagGGNExact, BatchDiagGGNMC, SqrtGGNExact, SqrtGGNMC)
#: Those whose factor has ``V`` rows too but whose backward pass runs in one pass.
UNCHUNKED = (DiagHessian, BatchDiagHessian, KFLR)
#: Those whose quantities are the rows themselves (concatenated over chunks).
ROWS = (SqrtGGNExact, SqrtGGNMC)
#: The lean budget of a chunk's factors, as a multiple of the bytes of the layer inputs
#: and outputs the forward pass stored for the extension.
LEAN_FACTOR = 1.0
#: The least lean budget (bytes): below it, chunks would save less than the
#: interpreter's own footprint and cost one replay of every module extension each.
LEAN_MIN_BYTES = 16 * 2**20
#: Bytes one row of the factor costs per number of a layer's input and output
#: (the factor at the output, its product at the input, one temporary).
_COPIES = 3

_tapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Call:
    """One module extension's call: what it needs to run again."""

    __slots__ = ("inner", "module", "g_inp", "g_out", "io")

    def __init__(self, inner, module, g_inp, g_out):
        self.inner, self.module, self.g_inp, self.g_out = inner, module, g_inp, g_out
        self.io = {
            name: getattr(module, name)
            for name in ("output", *(f"input{i}" for i in range(_inputs(module))))
        }


def _inputs(module) -> int:
    i = 0
    while hasattr(module, f"input{i}"):
        i += 1
    return i


class _Tape:
    def __init__(self, task, budget):
        self.task, self.budget, self.calls, self.params = task, budget, [], {}
        self.inline = False  # one pass, as BackPACK: nothing recorded


def _rows(extension, loss) -> int:
    """The rows per sample of the factor the loss module starts (without computing
    it: an MC factor's samples would take random numbers): the MC samples, else the
    loss input's numbers per sample (the model's outputs)."""
    if hasattr(extension, "get_num_mc_samples"):
        return extension.get_num_mc_samples()
    return loss.input0[0].numel()


class Deferred:
    """A module extension whose calls are recorded and run over chunks of rows once the
    backward pass has finished.

    Args:
        inner: BackPACK's (or memconv's) module extension it stands for.
        memory_budget: bytes the chunk's factors may take, or ``"lean"``
            (:data:`LEAN_FACTOR` times the stored activations).
    """

    def __init__(self, inner, memory_budget):
        self.inner, self.memory_budget = inner, memory_budget

    def __call__(self, extension, module, g_inp, g_out):
        if CTX.get_extension_hook() is not no_op:
            if self.memory_budget == LEAN:  # the default: one pass, as BackPACK
                return self.inner(extension, module, g_inp, g_out)
            raise ValueError(
                f"BackPACK's {type(extension).__name__} with memconv's memory_budget (at "
                f"{describe(module)}): the block's extension_hook would run before the "
                "quantities exist (they are computed over chunks of rows after the "
                "backward pass); install the extension without memory_budget to use an "
                "extension_hook"
            )
        task = graph_task_id()
        tape = _tapes.get(extension)
        if tape is None or tape.task != task:
            tape = _tapes[extension] = _Tape(task, self.memory_budget)
            if self.memory_budget == LEAN and is_loss(module) and _rows(extension, module) == 1:
                tape.inline = True  # one row per sample: nothing to chunk
            else:
                queue_backward_callback(lambda: _replay(extension, tape))
        if tape.inline:
            return self.inner(extension, module, g_inp, g_out)
        if not tape.calls and not is_loss(module):
            raise ValueError(
                f"BackPACK's {type(extension).__name__} with memconv's memory_budget: the "
                f"backward pass reached {describe(module)} before an extended loss "
                "module; extend the loss function (backpack.extend(lossfunc))"
            )
        for name, p in module.named_parameters(recurse=False):
            if id(p) in tape.params:
                raise ValueError(
                    f"BackPACK's {type(extension).__name__} with memconv: the parameter "
                    f"{name!r} of {describe(module)} is used by several calls in one "
                    "forward pass (tied, or a layer called twice), and its curvature of "
                    "the sum of the uses is not the sum of theirs: untie it"
                )
            tape.params[id(p)] = module
        tape.calls.append(_Call(self.inner, module, g_inp, g_out))


def _row_bytes(calls) -> int:
    """What one row of the factor costs at the layer where it is largest."""
    most = 0
    for call in calls:
        numbers = sum(t.numel() for t in call.io.values() if isinstance(t, torch.Tensor))
        most = max(most, numbers * call.io["output"].element_size())
    return _COPIES * most


def _stored_bytes(calls) -> int:
    """Bytes of the distinct layer inputs and outputs the recorded calls hold."""
    seen = {}
    for call in calls:
        for t in call.io.values():
            if isinstance(t, torch.Tensor):
                seen[(t.data_ptr(), t.shape)] = t.numel() * t.element_size()
    return sum(seen.values())


def lean_budget(calls) -> int:
    """The ``"lean"`` budget of a backward pass's recorded calls (bytes)."""
    return max(LEAN_MIN_BYTES, int(LEAN_FACTOR * _stored_bytes(calls)))


def _replay(extension, tape) -> None:
    _tapes.pop(extension, None)
    loss, calls = tape.calls[0], tape.calls[1:]
    with _restored(loss):
        factor = loss.inner.backpropagate(extension, loss.module, loss.g_inp, loss.g_out, None)
        key = loss.module.input0.data_ptr()
    v = factor.shape[0]
    budget = lean_budget(tape.calls) if tape.budget == LEAN else tape.budget
    step = max(1, min(v, budget // max(_row_bytes(tape.calls), 1)))
    chunks = [(v0, min(v, v0 + step)) for v0 in range(0, v, step)]
    logger.info(
        "BackPACK %s through memconv: the %d rows of the factor in %d chunk(s) of at most "
        "%d (memory_budget %s: %d bytes)",
        type(extension).__name__,
        v,
        len(chunks),
        step,
        tape.budget if tape.budget == LEAN else "given",
        budget,
    )
    rows = isinstance(extension, ROWS)
    field = extension.savefield
    totals: dict = {}
    for v0, v1 in chunks:
        extension.saved_quantities = SavedQuantities()
        extension.saved_quantities.save_quantity(
            key, factor[v0:v1], extension.accumulate_backpropagated_quantities
        )
        for call in calls:
            for p in call.module.parameters(recurse=False):
                if hasattr(p, field):
                    delattr(p, field)
                if hasattr(p, "_memconv_backpack_use"):
                    del p._memconv_backpack_use
            with _restored(call):
                call.inner(extension, call.module, call.g_inp, call.g_out)
            for p in call.module.parameters(recurse=False):
                if hasattr(p, field):
                    totals.setdefault(id(p), (p, []))[1].append(getattr(p, field))
                    delattr(p, field)
        if not rows:  # sum as the chunks come, keeping one tensor per parameter
            for _, parts in totals.values():
                parts[:] = [sum(parts[1:], parts[0])]
    extension.saved_quantities = SavedQuantities()
    for p, parts in totals.values():
        setattr(p, field, torch.cat(parts) if rows else parts[0])


class _restored:
    """A recorded call's module input and output put back on the module (BackPACK
    removes them after each module's hook), and removed again after."""

    def __init__(self, call):
        self.call = call

    def __enter__(self):
        self.added = [n for n in self.call.io if not hasattr(self.call.module, n)]
        for name in self.added:
            setattr(self.call.module, name, self.call.io[name])

    def __exit__(self, *exc):
        for name in self.added:
            delattr(self.call.module, name)
