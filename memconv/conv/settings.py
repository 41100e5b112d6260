"""When memconv's settings apply: the ``save_memory`` and ``per_sample`` blocks.

**The rule.** A block applies to the layers whose *forward pass* runs inside it.
When a memconv layer (``memconv.Conv*d``, ``memconv.ConvTranspose*d``,
``memconv.Linear``, the normalisation layers of :func:`memconv.convert`) runs its
forward pass with gradients enabled, it records the active strategy, its options
and the per-sample switch in the autograd graph; its backward pass uses what was
recorded, whenever and on whichever thread it runs (CUDA's autograd device threads
do not see the calling thread's context variables). This is how ``torch.autocast``
treats the backward pass. :func:`memconv.per_sample_grads` and the other whole-model
functions run their own forward and backward passes under the block open when
they are called (or their ``strategy`` argument). BackPACK's extensions, installed
with :func:`memconv.integrations.backpack.install`, read what the forward pass of a
memconv layer recorded.

Blocks live in :class:`contextvars.ContextVar` objects, so two threads or two
asyncio tasks never see each other's; they nest, restore the previous value on
exit and on exception, and also work as decorators.

Never silent: a block inside which no memconv layer ran its forward pass (a model
that was not converted) warns when it closes, and a backward pass inside a block
that the layer's forward pass did not see warns, naming the layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .._checks import check_budget, check_strategy_name, check_tile_size
from ..strategies import NO_OPTIONS, Options, get_strategy, strategy_names

#: The strategy per-sample computations use outside any ``save_memory`` block.
DEFAULT_STRATEGY = "auto"


@dataclass(frozen=True)
class Settings:
    """What a :class:`save_memory` block sets.

    Attributes:
        strategy: registered strategy name.
        options: the strategy's options (only those it reads are set).
    """

    strategy: str = DEFAULT_STRATEGY
    options: Options = NO_OPTIONS


DEFAULT_SETTINGS = Settings()


@dataclass(eq=False)
class _Block:
    """An open block: what it set, and whether a memconv computation used it."""

    value: object
    parent: _Block | None
    used: bool = field(default=False)

    def mark_used(self) -> None:
        block = self
        while block is not None:
            block.used = True
            block = block.parent


_SETTINGS: contextvars.ContextVar[_Block | None] = contextvars.ContextVar(
    "memconv_settings", default=None
)
_PER_SAMPLE: contextvars.ContextVar[_Block | None] = contextvars.ContextVar(
    "memconv_per_sample", default=None
)


@dataclass(frozen=True)
class Recorded:
    """What a memconv layer's forward pass records for its backward pass.

    Attributes:
        settings: the :class:`save_memory` block's settings, or ``None`` when no
            block was open (summed gradients then come from torch's own kernels,
            per-sample ones from :data:`DEFAULT_STRATEGY`).
        per_sample: whether a :class:`per_sample` block was on.
    """

    settings: Settings | None
    per_sample: bool

    @property
    def strategy_settings(self) -> Settings:
        """The settings a strategy runs with (the default outside any block)."""
        return self.settings if self.settings is not None else DEFAULT_SETTINGS


def record(per_sample_only: bool = False) -> Recorded:
    """The settings a forward pass running now records; marks the blocks used.

    Args:
        per_sample_only: for layers that read only the per-sample switch (their
            gradients need no strategy): the ``save_memory`` block is not marked.
    """
    settings, switch = _SETTINGS.get(), _PER_SAMPLE.get()
    for block in (switch,) if per_sample_only else (settings, switch):
        if block is not None:
            block.mark_used()
    return Recorded(
        settings.value if settings is not None else None,
        bool(switch is not None and switch.value),
    )


def use_block_settings(strategy=None) -> Settings:
    """Settings for a computation that runs now (``weight_vjp``, ``per_sample_grads``).

    Args:
        strategy: a name or bool to override the block's strategy (with no options),
            or ``None`` for the open block's settings (the default outside blocks).

    Raises:
        TypeError, ValueError: for an unknown or wrongly typed strategy.
    """
    if strategy is not None:
        return Settings(resolve_strategy_name(strategy), NO_OPTIONS)
    block = _SETTINGS.get()
    if block is not None:
        block.mark_used()
    return current_settings()


@contextlib.contextmanager
def activate(settings: Settings | None, per_sample: bool = False):
    """Open the blocks a recorded forward pass saw, for a computation memconv runs
    itself (a recomputation, an engine); no warning on exit.

    Args:
        settings: the ``save_memory`` block's settings, or ``None`` for no block.
        per_sample: whether a ``per_sample`` block is on.
    """
    tokens = (
        _SETTINGS.set(_Block(settings, None) if settings is not None else None),
        _PER_SAMPLE.set(_Block(True, None) if per_sample else None),
    )
    try:
        yield
    finally:
        _PER_SAMPLE.reset(tokens[1])
        _SETTINGS.reset(tokens[0])


def budgeted(settings: Settings, budget: int | None) -> Settings:
    """``settings`` whose strategy gets ``budget`` bytes per weight VJP, if it reads a
    ``memory_budget`` and none is set (None: unchanged)."""
    if budget is None or settings.options.memory_budget is not None:
        return settings
    if "memory_budget" not in get_strategy(settings.strategy).options:
        return settings
    return Settings(settings.strategy, replace(settings.options, memory_budget=int(budget)))


def available_strategies() -> tuple[str, ...]:
    """Names of the registered weight-VJP strategies, in registration order (the
    registry itself is :mod:`memconv.strategies`)."""
    return strategy_names()


def block_settings() -> Settings | None:
    """The settings of the open :class:`save_memory` block, or None outside any: the one
    place the block's settings are read (:func:`current_settings`,
    :func:`use_block_settings` and :func:`record` go through it or its variable)."""
    block = _SETTINGS.get()
    return block.value if block is not None else None


def current_settings() -> Settings:
    """The :class:`Settings` of the block open in this thread/task (default outside)."""
    settings = block_settings()
    return settings if settings is not None else DEFAULT_SETTINGS


def current_strategy() -> str:
    """The name of the active strategy (``"auto"`` outside any block)."""
    return current_settings().strategy


def per_sample_enabled() -> bool:
    """Whether a :class:`per_sample` block is on in this thread/task."""
    block = _PER_SAMPLE.get()
    return bool(block is not None and block.value)


def warn_if_block_missed(recorded: Recorded, layer) -> None:
    """Warn when a backward pass runs inside a block its layer's forward did not see.

    Called by memconv layers at the start of their backward pass. On another
    thread (CUDA's autograd threads) no block is visible and nothing is said.
    """
    current = block_settings()
    missed = []
    if current is not None and current != recorded.settings:
        missed.append("save_memory")
    if per_sample_enabled() and not recorded.per_sample:
        missed.append("per_sample")
    if missed:
        warnings.warn(
            f"memconv: the backward pass of {layer} runs inside a "
            f"{' and a '.join(missed)} block that its forward pass did not run in; memconv "
            "applies the blocks open around a layer's forward pass (as torch.autocast), so "
            "this block does not apply to it. Run the forward pass inside the block.",
            stacklevel=3,
        )


def resolve_strategy_name(strategy, argument: str = "strategy") -> str:
    """The registered name of ``strategy`` (``True``/``False``: ``"rochette"``/``"standard"``).

    Raises:
        TypeError: if ``strategy`` is neither a bool nor a str.
        ValueError: if the name is not registered.
    """
    return check_strategy_name(strategy, strategy_names(), argument)


def make_settings(strategy=DEFAULT_STRATEGY, *, tile_size=None, memory_budget=None, inner=None):
    """Validate arguments and build :class:`Settings` (no state is touched).

    Raises:
        TypeError, ValueError: as :class:`save_memory` documents.
    """
    name = resolve_strategy_name(strategy)
    check_tile_size(tile_size)
    check_budget(memory_budget, available=False, where="save_memory")
    if inner is not None:
        inner = resolve_strategy_name(inner, "inner")
        if get_strategy(inner).composite:
            raise ValueError(
                f"inner must be a strategy that runs no other, got {inner!r}; accepted: "
                + ", ".join(n for n in strategy_names() if not get_strategy(n).composite)
            )
    if isinstance(tile_size, list):
        tile_size = tuple(tile_size)
    options = Options(memory_budget=memory_budget, tile_size=tile_size, inner=inner)
    unused = [o for o in options.given() if o not in get_strategy(name).options]
    if unused:
        readers = {o: [n for n in strategy_names() if o in get_strategy(n).options] for o in unused}
        raise ValueError(
            f"save_memory({name!r}): the strategy {name!r} does not use "
            + "; ".join(f"{o} (used by: {', '.join(readers[o])})" for o in unused)
        )
    return Settings(name, options)


class _Switch(contextlib.ContextDecorator):
    """A block held in a context variable; warns on exit if nothing used it."""

    _var: contextvars.ContextVar
    _unused_message: str

    def __init__(self, value):
        self._value = value
        self._entered: list[tuple[contextvars.Token, _Block]] = []

    def _recreate_cm(self):
        # a fresh object per decorated call: tokens never cross threads or tasks
        clone = object.__new__(type(self))
        clone._value, clone._entered = self._value, []
        return clone

    def __enter__(self):
        block = _Block(self._value, self._var.get())
        self._entered.append((self._var.set(block), block))
        return self

    def __exit__(self, *exc):
        token, block = self._entered.pop()
        self._var.reset(token)
        if exc[0] is None and not block.used and self._should_warn():
            warnings.warn(self._unused_message, stacklevel=2)
        return False

    def _should_warn(self) -> bool:
        return True


class save_memory(_Switch):
    """Choose the weight-VJP strategy for the layers whose forward pass runs inside.

    **When it applies**: to the memconv layers (see :func:`memconv.convert`) whose
    forward pass runs inside the block; their backward pass uses the recorded
    settings wherever and whenever it runs, as ``torch.autocast`` does. Functions
    that run a forward and backward pass themselves (:func:`memconv.per_sample_grads`,
    :func:`memconv.weight_vjp`) use the block open when they are called. A block in
    which no memconv layer ran warns when it closes; a backward pass inside a block
    that its forward pass did not see warns, naming the layer.

    ``save_memory()`` with no argument means ``"auto"``, memconv's default;
    ``save_memory(True)`` means ``"rochette"`` and ``save_memory(False)`` means
    ``"standard"``, so that code written for BackPACK's
    ``weight_jac_t_save_memory(save_memory=...)`` reads the same.

    Args:
        strategy: a name from :func:`memconv.available_strategies` (default
            ``"auto"``), or a bool.
        tile_size: for ``"streaming"``, output positions per spatial dimension of a
            tile (int or tuple of ints, > 0).
        memory_budget: bytes of extra memory one layer's weight VJP may use, for
            ``"auto"``, ``"shift"`` and ``"streaming"`` (int, > 0).
        inner: for ``"streaming"``, the strategy run on each tile.

    Raises:
        ValueError: unknown strategy name, non-positive ``tile_size`` or
            ``memory_budget``, an option the strategy does not use (the message
            names the strategies that use it). Raised when the object is built,
            before any state changes.
        TypeError: wrongly typed arguments.

    Example:
        >>> with memconv.save_memory("streaming", tile_size=32):
        ...     loss = loss_fn(model(x), y)   # the forward pass records the block
        >>> loss.backward()                   # runs with "streaming"
    """

    _var = _SETTINGS
    _unused_message = (
        "memconv.save_memory: no memconv layer ran its forward pass inside this block, so "
        "it changed nothing. Convert the model with memconv.convert(model) and run the "
        "forward pass inside the block."
    )

    def __init__(
        self, strategy=DEFAULT_STRATEGY, *, tile_size=None, memory_budget=None, inner=None
    ):
        super().__init__(
            make_settings(strategy, tile_size=tile_size, memory_budget=memory_budget, inner=inner)
        )

    @property
    def settings(self) -> Settings:
        """The settings this block activates."""
        return self._value

    @classmethod
    def from_settings(cls, settings: Settings) -> save_memory:
        """A block that activates already validated :class:`Settings`."""
        block = object.__new__(cls)
        block._value, block._entered = settings, []
        return block


class per_sample(_Switch):
    """Make memconv's layers store per-sample gradients ``param.grad_batch``.

    For the memconv layers whose forward pass runs inside the block (the rule of
    :class:`save_memory`), the backward pass leaves ``param.grad_batch``
    ``[N, *param.shape]`` on every trainable parameter, summing to the gradient
    that pass adds to ``param.grad`` (BackPACK's ``BatchGrad`` convention, loss
    reduction factors included). ``grad_batch`` accumulates exactly when ``.grad``
    does: after ``.grad`` is set to None, zeroed or replaced it starts afresh.
    Convolution weights use the strategy of the :class:`save_memory` block open
    around the forward pass (``"auto"`` outside any).

    Args:
        enabled: turn the switch on (default) or off.

    Raises:
        TypeError: if ``enabled`` is not a bool.
    """

    _var = _PER_SAMPLE
    _unused_message = (
        "memconv.per_sample: no memconv layer ran its forward pass inside this block, so no "
        "grad_batch was computed. Convert the model with memconv.convert(model) (or use "
        "memconv.per_sample_grads) and run the forward pass inside the block."
    )

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        super().__init__(enabled)

    def _should_warn(self) -> bool:
        return self._value


@dataclass(frozen=True)
class Autocast:
    """The autocast state a layer's forward pass ran under (to re-run it alike).

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ...
        dtype: the autocast dtype, or ``None`` when autocast was off.
    """

    device_type: str
    dtype: torch.dtype | None

    @classmethod
    def current(cls, device_type: str) -> Autocast:
        """The state of ``torch.autocast`` for ``device_type`` right now."""
        if torch.is_autocast_enabled(device_type):
            return cls(device_type, torch.get_autocast_dtype(device_type))
        return cls(device_type, None)

    @classmethod
    def of(cls, leaves) -> Autocast:
        """The state right now for the device of the first tensor among ``leaves``
        (``"cpu"`` if there is none)."""
        device = next((t.device.type for t in leaves if isinstance(t, Tensor)), "cpu")
        return cls.current(device)

    def context(self):
        """A ``torch.autocast`` block restoring this state."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)
