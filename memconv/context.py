"""The active weight-VJP strategy and the per-sample switch.

Both live in :class:`contextvars.ContextVar` objects, so two threads or two asyncio
tasks never see each other's setting. The context managers nest, restore the
previous value on exit and on exception, and also work as decorators.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from dataclasses import dataclass

from .strategies import strategy_names

DEFAULT_STRATEGY = "standard"


@dataclass(frozen=True)
class Settings:
    """What :func:`save_memory` sets.

    Attributes:
        strategy: registered strategy name.
        tile_size: output positions per spatial dimension of one tile for
            ``"streaming"`` (int, or one int per spatial dimension); ``None`` lets
            the strategy choose.
        memory_budget: bytes of extra memory ``"auto"`` (and ``"streaming"`` without a
            ``tile_size``) may use per layer; ``None`` means no limit.
        inner: strategy used inside each tile by ``"streaming"``; ``None`` picks one.
    """

    strategy: str = DEFAULT_STRATEGY
    tile_size: int | tuple[int, ...] | None = None
    memory_budget: int | None = None
    inner: str | None = None


_SETTINGS: contextvars.ContextVar[Settings] = contextvars.ContextVar(
    "memconv_settings",
    default=Settings(),  # noqa: B039 (frozen dataclass)
)
_DEFAULT_SETTINGS = _SETTINGS.get()
_PER_SAMPLE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "memconv_per_sample", default=False
)


#: Integrations (e.g. BackPACK's) that follow the blocks; see :func:`add_listener`.
_LISTENERS: list = []


def add_listener(listener) -> None:
    """Let an integration follow :class:`save_memory` blocks and convolution backwards.

    The core never imports its integrations; they register here instead. The
    listener may define ``block_entered(settings)``, ``block_exited()``,
    ``conv_backward()`` (called at the start of an extended module's backward),
    and, to share one layer's per-sample gradients with that backward,
    ``batch_consumers(module)``, ``share_batch(module, grad_output, batch,
    consumers)`` and ``shared_batch(module, name, grad_output)``.
    """
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def notify(event: str, *args) -> None:
    """Call ``event`` on every listener that defines it."""
    for listener in _LISTENERS:
        method = getattr(listener, event, None)
        if method is not None:
            method(*args)


def batch_consumers(module) -> int:
    """How many integrations' quantities will use this layer's per-sample gradients.

    Asked by an extended convolution's backward pass: when positive, it computes
    the per-sample gradients once (their sum is the layer's ``.grad``) and offers
    them with :func:`share_batch` instead of the integration running a second VJP.
    """
    total = 0
    for listener in _LISTENERS:
        method = getattr(listener, "batch_consumers", None)
        if method is not None:
            total += method(module)
    return total


def share_batch(module, grad_output, batch: dict, consumers: int) -> None:
    """Offer per-sample gradients ``{"weight": ..., "bias": ...}`` to the listeners."""
    notify("share_batch", module, grad_output, batch, consumers)


def shared_batch(module, name: str, grad_output):
    """Per-sample gradients a listener already computed for this layer, or None."""
    for listener in _LISTENERS:
        method = getattr(listener, "shared_batch", None)
        found = method(module, name, grad_output) if method is not None else None
        if found is not None:
            return found
    return None


def explicit_block() -> bool:
    """Whether a :class:`save_memory` block is active in this thread/task."""
    return _SETTINGS.get() is not _DEFAULT_SETTINGS


def strategies() -> tuple[str, ...]:
    """Names of the registered weight-VJP strategies."""
    return strategy_names()


def current_settings() -> Settings:
    """The :class:`Settings` active in this thread/task."""
    return _SETTINGS.get()


def current_strategy() -> str:
    """The name of the active strategy (``"standard"`` outside any block)."""
    return _SETTINGS.get().strategy


def per_sample_enabled() -> bool:
    """Whether extended modules store ``grad_batch`` in this thread/task."""
    return _PER_SAMPLE.get()


def _check_positive_int(value, argument: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{argument} must be a positive int or None, got {type(value).__name__} {value!r}"
        )
    if value <= 0:
        raise ValueError(f"{argument} must be a positive int or None, got {value}")


def check_tile_size(tile_size, argument: str = "tile_size") -> None:
    """Raise unless ``tile_size`` is None, a positive int or a tuple of them.

    Raises:
        TypeError: on a non-integer value.
        ValueError: on a non-positive value or an empty tuple.
    """
    if tile_size is None:
        return
    if isinstance(tile_size, (tuple, list)):
        if not tile_size:
            raise ValueError(f"{argument} must not be empty")
        for v in tile_size:
            _check_positive_int(v, argument)
        return
    _check_positive_int(tile_size, argument)


def resolve_strategy_name(strategy, argument: str = "strategy") -> str:
    """Map ``True``/``False`` to ``"rochette"``/``"standard"`` and check the name.

    Raises:
        TypeError: if ``strategy`` is neither a bool nor a str.
        ValueError: if the name is not registered.
    """
    if strategy is True:
        return "rochette"
    if strategy is False:
        return "standard"
    if not isinstance(strategy, str):
        raise TypeError(
            f"{argument} must be a bool or one of {strategy_names()}, got {type(strategy).__name__}"
        )
    if strategy not in strategy_names():
        raise ValueError(
            f"unknown {argument} {strategy!r}; accepted: {', '.join(strategy_names())}"
        )
    return strategy


def make_settings(strategy="rochette", *, tile_size=None, memory_budget=None, inner=None):
    """Validate arguments and build :class:`Settings` (no state is touched).

    Raises:
        TypeError, ValueError: as :class:`save_memory` documents.
    """
    name = resolve_strategy_name(strategy)
    check_tile_size(tile_size)
    if memory_budget is not None:
        _check_positive_int(memory_budget, "memory_budget")
    if inner is not None:
        inner = resolve_strategy_name(inner, "inner")
        if inner in ("streaming", "auto"):
            raise ValueError(
                f"inner must be a non-tiling strategy, got {inner!r}; accepted: "
                + ", ".join(n for n in strategy_names() if n not in ("streaming", "auto"))
            )
    if isinstance(tile_size, list):
        tile_size = tuple(tile_size)
    return Settings(name, tile_size, memory_budget, inner)


class save_memory(contextlib.ContextDecorator):
    """Choose the weight-VJP strategy for convolutions inside a ``with`` block.

    ``save_memory(True)`` means ``"rochette"`` and ``save_memory(False)`` means
    ``"standard"``, so that code written for BackPACK's
    ``weight_jac_t_save_memory(save_memory=...)`` reads the same.

    Args:
        strategy: a name from :func:`memconv.strategies`, or a bool.
        tile_size: for ``"streaming"``, output positions per spatial dimension of a
            tile (int or tuple of ints, > 0).
        memory_budget: bytes of extra memory a layer's weight VJP may use, for
            ``"auto"`` and for ``"streaming"`` without a ``tile_size`` (int, > 0).
        inner: for ``"streaming"``, the strategy run on each tile.

    Raises:
        ValueError: unknown strategy name, non-positive ``tile_size`` or
            ``memory_budget``. Raised when the object is built, before any state
            changes.
        TypeError: wrongly typed arguments.

    Example:
        >>> with memconv.save_memory("streaming", tile_size=32):
        ...     loss.backward()
    """

    def __init__(self, strategy="rochette", *, tile_size=None, memory_budget=None, inner=None):
        self._settings = make_settings(
            strategy, tile_size=tile_size, memory_budget=memory_budget, inner=inner
        )
        self._tokens: list[contextvars.Token] = []

    @property
    def settings(self) -> Settings:
        """The settings this block activates."""
        return self._settings

    @classmethod
    def from_settings(cls, settings: Settings) -> save_memory:
        """A block that activates already validated :class:`Settings`."""
        block = object.__new__(cls)
        block._settings = settings
        block._tokens = []
        return block

    def _recreate_cm(self):
        # A fresh object per decorated call: tokens never cross threads or tasks.
        return self.from_settings(self._settings)

    def __enter__(self):
        self._tokens.append(_SETTINGS.set(self._settings))
        notify("block_entered", self._settings)
        return self

    def __exit__(self, *exc):
        _SETTINGS.reset(self._tokens.pop())
        notify("block_exited")
        return False


class per_sample(contextlib.ContextDecorator):
    """Make memconv's extended convolutions store per-sample gradients.

    Inside the block, the backward pass of :class:`memconv.Conv1d`/``2d``/``3d``
    leaves ``param.grad_batch`` ``[N, *param.shape]`` on weight and bias, summing to
    the gradient that pass added to ``param.grad`` (BackPACK's ``BatchGrad``
    convention, loss reduction factors included).

    Args:
        enabled: turn the switch on (default) or off.

    Raises:
        TypeError: if ``enabled`` is not a bool.
    """

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self._enabled = enabled
        self._tokens: list[contextvars.Token] = []

    def _recreate_cm(self):
        return per_sample(self._enabled)

    def __enter__(self):
        self._tokens.append(_PER_SAMPLE.set(self._enabled))
        return self

    def __exit__(self, *exc):
        _PER_SAMPLE.reset(self._tokens.pop())
        return False
