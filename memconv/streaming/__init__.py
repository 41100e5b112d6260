"""Streaming whole convolution stacks over images too large for memory.

See :class:`StreamingCNN`. Depends on the core (its convolutions run through
memconv's autograd function); the core never imports it.
"""

from .cnn import StreamingCNN, receptive_field
from .plan import NotStreamableError, Residual, analyse

__all__ = ["NotStreamableError", "Residual", "StreamingCNN", "analyse", "receptive_field"]
