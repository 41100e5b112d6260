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
factors take a small multiple of the activations, whatever ``V``: the peak grows with
the model and batch as a plain backward pass's does, not with ``V``. A factor of one
row per sample (the MC extensions' default ``mc_samples=1``, a model with one output)
has nothing to chunk: under ``"lean"`` its backward pass runs in one pass, as
BackPACK's, without keeping the layers' inputs and outputs for a replay.

Within the budget the replay's plan is the one predicted fastest (:func:`plan_chunks`,
priced with the device's calibration): the fewest chunks of even sizes that fit, and,
for the convolutions whose weight diagonal over all ``V`` rows takes the Gram route
(small output maps), whether to keep their ``A = Σ_v S Sᵀ`` summed over the chunks
(:func:`memconv.conv.curvature.gram_factor`; its bytes held from the first chunk to
the last, leaving fewer rows per chunk) so that the route runs once on all the rows,
instead of per chunk, where a chunk of few rows would take the row route or pay the
Gram route's products with the patches once per chunk.

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
from ...conv.curvature import even_chunks
from ...strategies.costs import operations_time, time_rates
from . import secondorder
from .naming import describe

logger = logging.getLogger("memconv")

#: The extensions whose backward pass runs over chunks of rows under a budget.
CHUNKED = (DiagGGNExact, DiagGGNMC, BatchDiagGGNExact, BatchDiagGGNMC, SqrtGGNExact, SqrtGGNMC)
#: Those whose factor has ``V`` rows too but whose backward pass runs in one pass.
UNCHUNKED = (DiagHessian, BatchDiagHessian, KFLR)
#: Those whose quantities are the rows themselves (concatenated over chunks).
ROWS = (SqrtGGNExact, SqrtGGNMC)
#: The lean budget of a chunk's factors (and the Gram factors kept over the chunks), as
#: a multiple of the bytes of the layer inputs and outputs the forward pass stored for
#: the extension. At 1, All-CNN-C's V = 100 factor (batch 8) ran in 100 chunks of one
#: row, each a replay of every layer with weight VJPs of one row per sample: 1.2-1.5×
#: BackPACK's time. At 4, 34 chunks of 3 rows, two Gram layers kept: below BackPACK's
#: time at 0.14× its peak RSS increase (measured in docs/backpack.md).
LEAN_FACTOR = 4.0
#: The least lean budget (bytes): below it, chunks would save less than the
#: interpreter's own footprint and cost one replay of every module extension each.
LEAN_MIN_BYTES = 16 * 2**20
#: Bytes one row of the factor costs per number of a layer's input and output
#: (the factor at the output, its product at the input, one temporary).
_COPIES = 3
#: ATen operations one module extension's call issues per chunk of rows replayed (the
#: factor's product with the layer's Jacobian, the parameters' quantities and their
#: sums; counted by ``torch.profiler`` on All-CNN-C's replay), priced ``per_op`` by
#: :func:`memconv.strategies.costs.operations_time`.
OPS_PER_CALL = 35

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


class Plan:
    """How a chunked replay runs: its chunks of rows and the layers that keep their
    Gram factor over them.

    Attributes:
        chunks: ``[(v0, v1), ...]``, the rows of each chunk.
        accumulate: the :class:`~.secondorder.GramCandidate` layers whose weight
            diagonal sums its Gram factor over the chunks and is computed once.
        seconds: the predicted time of the terms that differ between plans.
        nbytes: the chunk's factors (rows times ``row_bytes``) and the kept factors.
    """

    def __init__(self, chunks, accumulate, seconds, nbytes):
        self.chunks, self.accumulate = chunks, tuple(accumulate)
        self.seconds, self.nbytes = seconds, nbytes


def plan_chunks(v, row_bytes, budget, candidates=(), calls=1, device="cpu") -> Plan:
    """The chunks of a replay's ``v`` rows and the Gram layers that keep their factor
    over them: of the plans whose bytes fit ``budget``, the one predicted fastest.

    A plan keeps the Gram factors ``A`` of some candidates (their bytes held from the
    first chunk to the last) and splits the rows into the fewest chunks whose factors
    fit what is left of the budget (:func:`memconv.conv.curvature.even_chunks`); its
    predicted time is what differs between plans, priced with the device's
    calibration (:mod:`memconv.strategies.costs`):

    - per chunk, :data:`OPS_PER_CALL` operations per recorded call (``per_op``);
    - per candidate, its multiply-adds (the ``"standard"`` model's ``per_flop``): kept,
      the Gram route once over all the rows; not kept, per chunk the cheaper of its
      routes on the chunk's rows (the Gram route's fixed part paid per chunk).

    Candidates are kept in the order of the time they save per byte; every prefix of
    that order is a plan. Without candidates the fastest plan is the fewest chunks that
    fit: one chunk under a budget that holds every row.

    Args:
        v: the rows per sample of the factor.
        row_bytes: what one row costs at the layer where it is largest.
        budget: bytes of the chunk's factors and the kept Gram factors.
        candidates: :class:`~.secondorder.GramCandidate` s.
        calls: the module extensions' calls replayed per chunk.
        device: the device type whose calibration prices the plan.

    Returns:
        The :class:`Plan` (of one row per chunk and nothing kept when not even one row
        fits: the leanest there is).
    """
    per_flop = time_rates("standard", device)["per_flop"]
    per_chunk = operations_time(OPS_PER_CALL * calls, device)

    def saving(c):  # seconds saved per byte by keeping c at one row per chunk
        per_chunk_route = min(c.rows_per_row, c.gram_per_row + c.gram_fixed) * v
        kept = c.gram_per_row * v + c.gram_fixed
        return (per_chunk_route - kept) * per_flop / max(c.nbytes, 1)

    order = sorted(candidates, key=saving, reverse=True)
    best = None
    for kept in range(len(order) + 1):
        held = sum(c.nbytes for c in order[:kept])
        most = (budget - held) // max(row_bytes, 1)
        if most < 1 and kept:
            break
        chunks = even_chunks(v, max(1, min(v, most)))
        flops = sum(c.gram_per_row * v + c.gram_fixed for c in order[:kept])
        for c in order[kept:]:
            for v0, v1 in chunks:
                rows = v1 - v0
                flops += min(c.rows_per_row * rows, c.gram_per_row * rows + c.gram_fixed)
        seconds = len(chunks) * per_chunk + flops * per_flop
        nbytes = held + max(v1 - v0 for v0, v1 in chunks) * row_bytes
        if best is None or seconds < best.seconds:
            best = Plan(chunks, order[:kept], seconds, nbytes)
    return best


def _replay(extension, tape) -> None:
    _tapes.pop(extension, None)
    loss, calls = tape.calls[0], tape.calls[1:]
    with _restored(loss):
        factor = loss.inner.backpropagate(extension, loss.module, loss.g_inp, loss.g_out, None)
        key = loss.module.input0.data_ptr()
    v = factor.shape[0]
    budget = lean_budget(tape.calls) if tape.budget == LEAN else tape.budget
    candidates = []
    for call in calls:
        with _restored(call):
            candidate = secondorder.gram_candidate(call.inner, call.module, v)
        if candidate is not None:
            candidates.append(candidate)
    plan = plan_chunks(
        v, _row_bytes(tape.calls), budget, candidates, len(tape.calls), factor.device.type
    )
    chunks = plan.chunks
    logger.info(
        "BackPACK %s through memconv: the %d rows of the factor in %d chunk(s) of at most "
        "%d (memory_budget %s: %d bytes), %d layer(s) on the Gram route over all chunks",
        type(extension).__name__,
        v,
        len(chunks),
        max(v1 - v0 for v0, v1 in chunks),
        tape.budget if tape.budget == LEAN else "given",
        budget,
        len(plan.accumulate),
    )
    rows = isinstance(extension, ROWS)
    field = extension.savefield
    totals: dict = {}
    with secondorder.accumulating([c.module for c in plan.accumulate]) as sums:
        _run_chunks(extension, calls, factor, key, chunks, totals, rows)
    for call in calls:
        if sums.get(call.module) is not None:
            diagonal = secondorder.finish_gram(
                call.inner, call.module, call.io["input0"], sums.pop(call.module)
            )
            totals[id(call.module.weight)] = (call.module.weight, [diagonal])
    extension.saved_quantities = SavedQuantities()
    for p, parts in totals.values():
        setattr(p, field, torch.cat(parts) if rows else parts[0])


def _run_chunks(extension, calls, factor, key, chunks, totals, rows) -> None:
    """Replay the recorded calls once per chunk of the factor's rows, each parameter's
    quantities gathered in ``totals`` (summed as they come unless ``rows``)."""
    field = extension.savefield
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
                    value = getattr(p, field)
                    delattr(p, field)
                    if value is not secondorder.PENDING:  # its Gram factor is summed
                        totals.setdefault(id(p), (p, []))[1].append(value)
        if not rows:  # sum as the chunks come, keeping one tensor per parameter
            for _, parts in totals.values():
                parts[:] = [sum(parts[1:], parts[0])]


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
