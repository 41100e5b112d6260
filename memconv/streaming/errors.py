"""The error streaming raises, and the remedy its messages give."""

from __future__ import annotations

#: What a user can do about a part of the trunk that cannot be streamed.
REMEDY = (
    "stream the layers before it (StreamingCNN(those layers)) and run it and the rest "
    "conventionally on the streamed output"
)


class NotStreamableError(ValueError):
    """A layer, operation or configuration that cannot be streamed exactly; the message
    names the operation, the module path that calls it and the remedy."""


__all__ = ["REMEDY", "NotStreamableError"]
