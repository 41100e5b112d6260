"""Streaming whole convolutional trunks over images too large for memory.

See :class:`StreamingCNN`. Depends on the core (its convolutions run through
memconv's autograd function); the core never imports it.
"""

from .cnn import StreamingCNN, receptive_field
from .errors import NotStreamableError
from .graph import StreamGraph, analyse
from .residual import Residual

__all__ = [
    "NotStreamableError",
    "Residual",
    "StreamGraph",
    "StreamingCNN",
    "analyse",
    "receptive_field",
]
