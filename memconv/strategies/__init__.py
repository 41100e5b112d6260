"""Registry of weight-VJP strategies for N-d convolutions.

The protocol, the options and the registry live in :mod:`memconv.strategies.base`;
each strategy is one module that registers an instance on import. The import order
below is the order users see in :func:`memconv.available_strategies`.
"""

# isort: off
from .base import (
    NO_OPTIONS,
    Options,
    Problem,
    Strategy,
    elementary,
    get_strategy,
    register_strategy,
    strategy_names,
)
from . import standard  # noqa: F401
from . import rochette  # noqa: F401
from . import unfold  # noqa: F401
from . import shift  # noqa: F401
from . import loop  # noqa: F401
from . import vmap  # noqa: F401
from . import tiling  # noqa: F401
from . import auto  # noqa: F401

# isort: on

__all__ = [
    "NO_OPTIONS",
    "Options",
    "Problem",
    "Strategy",
    "elementary",
    "get_strategy",
    "register_strategy",
    "strategy_names",
]
