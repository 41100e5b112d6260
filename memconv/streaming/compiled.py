"""A ``torch.compile``'d trunk streamed compiled: one graph per kind of tile.

``StreamingCNN(torch.compile(trunk), tile_size=T)`` reads the trunk's dataflow from
the module the compiled one wraps, and runs each tile's work as a compiled graph:

1. The first pass of an input shape runs every tile eagerly and records, per tile,
   what it reads and writes outside itself (the image's crop, the halo earlier tiles
   kept, the output gradient, the gradients later tiles sent) and its structure
   (each node's crop, padding and box size): :mod:`memconv.streaming.tileio`.
2. Tiles whose records agree relative to the tile (same structure, same shapes of
   every read and write) compute alike: the next time a tile of such a kind runs,
   its work is traced with ``torch.fx``'s ``make_fx`` into one graph of ATen
   operations (inputs: its reads; outputs: its results and the pieces it writes),
   the forward pass's tile and the backward pass's (the recomputation, autograd's
   backward and memconv's weight VJPs) each. The graph is compiled with the trunk's
   own backend, mode and options, with inductor's reordering for locality off unless
   those options set it (:data:`memconv._torch.STEP_INDUCTOR_OPTIONS`, as for a traced
   per-sample step: a backward tile's graph holds a forward and a backward pass).
3. Later tiles of that kind gather their reads, call the compiled graph and store
   what it returns: none of the tile's operations run from Python.

A 2-D plan has at most 9 kinds of tile per pass (interior, 4 edges, 4 corners); the
backward pass splits a kind where the gradients later tiles sent differ (the last row
and column receive none). The graphs are kept per input shape, dtype, autocast state
and ``save_memory`` settings.

Exactness: a graph records the very operations the eager tile runs; float64 results
equal the eager ones to rounding. What a trace cannot keep is refused with a warning
naming it, and those tiles run eagerly (:mod:`memconv._torch`'s trace checks): hooks on the trunk's
modules, a tensor read from outside the trunk, random operations, a compiler error.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._torch import (
    NotTraceable,
    check_constants,
    check_hooks,
    check_random,
    compile_graph,
    first_line,
    make_fx_real,
    step_backend,
)
from .passes import TileRunner
from .tileio import DIRECT, RecordIO, ReplayIO, TileRecord

logger = logging.getLogger("memconv")


@dataclass
class TileGraph:
    """One kind of tile's traced work and its compiled form.

    Attributes:
        graph: the traced ``torch.fx.GraphModule`` (inputs: the tile's reads; outputs:
            its results that are not None, then the pieces it writes).
        compiled: ``graph`` compiled by the trunk's backend.
        present: which of the results are tensors (the others are None).
        trace_seconds: seconds the trace took.
        compile_seconds: seconds the first compiled call took (compilation included;
            None until it ran).
        calls: compiled calls so far.
    """

    graph: nn.Module
    compiled: object
    present: list[bool]
    trace_seconds: float
    compile_seconds: float | None = None
    calls: int = 0

    def __call__(self, reads: list[Tensor]) -> tuple[list, list[Tensor]]:
        start = time.perf_counter()
        with torch.no_grad():  # the backward graph holds autograd's work as operations
            outputs = list(self.compiled(*reads))
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - start
        self.calls += 1
        return _split(outputs, self.present)


def _split(outputs: list, present: list[bool]) -> tuple[list, list[Tensor]]:
    it = iter(outputs)
    results = [next(it) if p else None for p in present]
    return results, list(it)


class CompiledTiles:
    """Runs each tile's body as compiled graphs, one per kind of tile (see the module
    docstring); a drop-in for :class:`memconv.streaming.passes.EagerTiles`.

    Args:
        module: the trunk the compiled module wraps (the graphs read its parameters and
            buffers in place).
        backend: the compiler backend the trunk was compiled with
            (:func:`memconv._torch.compile_backend`); the tiles compile with it, and
            with inductor's :data:`memconv._torch.STEP_INDUCTOR_OPTIONS` and each
            graph's :func:`memconv._torch.graph_inductor_options` beneath its own
            options (:func:`memconv._torch.step_backend`).

    Attributes:
        records: ``{(pass key, tile): TileRecord}``.
        graphs: ``{(pass key, tile kind): TileGraph}``.
        refused: ``{(pass key, tile kind): reason}`` of kinds that run eagerly.
        traces: how many graphs were traced.
    """

    def __init__(self, module: nn.Module, backend):
        self.module = module
        # a tile's graph holds a forward and a backward pass, as a traced step's does;
        # the options that depend on the graph are added as each is traced
        self.backend = step_backend(backend)
        self.records: dict = {}
        self.graphs: dict = {}
        self.refused: dict = {}
        self.traces = 0
        self.pass_key: tuple = ()
        self._warned: set = set()

    def forget(self) -> None:
        """Drop every record and graph (a new plan makes new ones)."""
        self.records.clear()
        self.graphs.clear()
        self.refused.clear()

    def begin(self, key: tuple) -> CompiledTiles:
        """Set what the next pass's graphs depend on besides the tiles (the plan, the
        pass, its autocast state and settings); returns self."""
        self.pass_key = key
        return self

    def kinds(self, phase: str | None = None) -> int:
        """How many graphs are kept (of the passes whose key starts with ``phase``)."""
        return sum(1 for key in self.graphs if phase is None or key[0][0] == phase)

    def run(self, runner: TileRunner, tile, body, grad: Tensor | None = None):
        """``body(io, fresh) -> (tensors, meta)`` for ``tile``: recorded eagerly the first
        time, traced the first time a tile of its kind runs again, compiled after."""
        at = (self.pass_key, tuple(tile))
        record: TileRecord | None = self.records.get(at)
        reads = None
        if record is not None and (self.pass_key, record.key()) not in self.refused:
            reads = record.gather(runner, grad)
            if not record.matches(reads):  # laid out otherwise (an output gradient's strides)
                record = reads = None
        if record is None:
            io = RecordIO()
            tensors, meta = body(io, False)
            io.record.meta = meta
            self.records[at] = io.record
            return tensors, meta
        kind = (self.pass_key, record.key())
        if reads is None:  # refused
            return body(DIRECT, False)
        entry = self.graphs.get(kind)
        if entry is None:
            try:
                entry, results, pieces = self._trace(record, body, reads)
            except NotTraceable as error:
                self._refuse(kind, str(error))
                return body(DIRECT, False)
            self.graphs[kind] = entry
        else:
            try:
                results, pieces = entry(reads)
            except Exception as error:  # a compiler error at the first call
                if entry.calls:
                    raise
                self._refuse(kind, f"the compiler failed: {first_line(error)}")
                return body(DIRECT, False)
        record.put(runner, pieces)
        return results, record.meta

    def _trace(self, record: TileRecord, body, reads: list[Tensor]):
        held: dict = {}

        def tile_fn(*tensors):
            io = ReplayIO(record, tensors)
            results, _ = body(io, True)
            held.update(results=results, pieces=io.pieces)
            return [t for t in results if t is not None] + io.pieces

        check_hooks(self.module)
        start = time.perf_counter()
        try:
            graph = make_fx_real(tile_fn, tuple(reads))
        except Exception as error:
            raise NotTraceable(f"the trace stopped: {first_line(error)}") from error
        seconds = time.perf_counter() - start
        self.traces += 1
        check_constants(graph, self.module)
        check_random(graph)
        compiled = compile_graph(graph, list(reads), step_backend(self.backend, graph))
        present = [t is not None for t in held["results"]]
        logger.info(
            "memconv: traced a %s tile of %s (%d nodes, %.2f s)",
            self.pass_key[0],
            type(self.module).__name__,
            len(graph.graph.nodes),
            seconds,
        )
        return TileGraph(graph, compiled, present, seconds), held["results"], held["pieces"]

    def _refuse(self, kind, reason: str) -> None:
        self.refused[kind] = reason
        if reason in self._warned:
            return
        self._warned.add(reason)
        warnings.warn(
            f"memconv: tiles of the torch.compile'd {type(self.module).__name__} run "
            f"eagerly, not compiled: {reason}. The numbers are the eager path's. Remove "
            "what the message names from the trunk, or pass the uncompiled trunk to "
            "silence this warning.",
            RuntimeWarning,
            stacklevel=5,
        )


__all__ = ["CompiledTiles", "TileGraph"]
