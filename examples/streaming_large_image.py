"""StreamingCNN's example network, its head and real mosaics, for scripts that load
this file; run as a script, the gallery's streaming example at its full sizes.

The example itself is ``plot_streaming_large_image.py`` beside this file (training on
two 8192×8192 mosaics of scikit-image's pictures, then conventional against streamed
peak memory from 1024² to 8192², each pass in a fresh process)::

    python examples/streaming_large_image.py    # = MEMCONV_FULL=1 python examples/plot_streaming_large_image.py
"""

from __future__ import annotations

import os
import runpy

import torch
from torch import nn

from memconv.bench.data import load_mosaic as mosaic
from memconv.bench.models import streaming_net

__all__ = ["head", "mosaic", "stream_net"]


def stream_net() -> nn.Sequential:
    """StreamingCNN's example network (six 3×3 Conv2d with 16 channels, three 2×2
    max-pools, padding 0), 3 input channels, seeded."""
    torch.manual_seed(0)
    return streaming_net()[:15]


def head() -> nn.Sequential:
    """Global average pooling and a Linear layer to two classes, seeded."""
    torch.manual_seed(1)
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2))


if __name__ == "__main__":
    os.environ["MEMCONV_FULL"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    runpy.run_path(os.path.join(here, "plot_streaming_large_image.py"), run_name="__main__")
