"""What a whole-model call asks of the engine, as two frozen records passed by keyword.

A :class:`Request` is the call's task and settings (what to compute, with which
strategy, routes and memory budget); a :class:`Batch` is what it computes it on (the
model, the loss and the samples). The planner (:mod:`memconv.engine.planning`), the
prepared plans (:mod:`memconv.engine.prepared`) and the micro-batch passes
(:mod:`memconv.engine.passes`) take these instead of threading their fields one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor, nn

from .._checks import ClipRoute, NormRoute, Task
from ..conv.settings import DEFAULT_SETTINGS, Settings


@dataclass(frozen=True)
class Request:
    """What one whole-model call computes, and under which settings.

    Attributes:
        task: ``"grads"`` (per-sample gradients), ``"norms"`` (their norms) or
            ``"clip"`` (the clipped sum).
        n: N, the samples of the batch.
        settings: the weight-VJP strategy and its options.
        memory_budget: as the caller gave it: bytes, ``"available"`` or None.
        norm_route: ``"ghost"``, ``"instantiate"`` or None (chosen per layer).
        clip_route: for ``"clip"``: ``"book-keeping"``, ``"two-pass"`` or None
            (chosen by the plan).
        caller: the public function's name, for messages.
    """

    task: Task
    n: int
    settings: Settings = DEFAULT_SETTINGS
    memory_budget: int | str | None = None
    norm_route: NormRoute | None = None
    clip_route: ClipRoute | None = None
    caller: str = "memconv"

    def key(self) -> tuple:
        """The fields a plan depends on (all but :attr:`caller`), as a tuple."""
        r = self
        return (r.task, r.n, r.settings, r.memory_budget, r.norm_route, r.clip_route)

    def routed(self, clip_route: ClipRoute | None) -> Request:
        """The same request with ``clip_route``."""
        return replace(self, clip_route=clip_route)


@dataclass(frozen=True)
class Batch:
    """The model, the loss and the samples of one call (or of one micro-batch).

    Attributes:
        model: the module the passes run (unwrapped: no DDP, no ``torch.compile``).
        loss_fn: the loss, as the caller gave it (called on one sample's output and
            target, or on the batch's where it is a known per-sample loss).
        inputs: ``[N, ...]``.
        targets: ``[N, ...]``.
    """

    model: nn.Module
    loss_fn: Callable
    inputs: Tensor
    targets: object

    @property
    def n(self) -> int:
        """N."""
        return len(self.inputs)

    def rows(self, rows: slice) -> Batch:
        """The micro-batch of ``rows`` (the batch itself where they are all of it)."""
        if rows == slice(0, len(self.inputs)):
            return self
        return replace(self, inputs=self.inputs[rows], targets=self.targets[rows])
