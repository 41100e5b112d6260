"""Models used by the main job, the benchmarks and the examples."""

from __future__ import annotations

from torch import nn


def _pooled(side: int, kernel: int, stride: int, padding: int = 0) -> int:
    return (side + 2 * padding - kernel) // stride + 1


def seed_cnn(side: int = 28, in_channels: int = 1, num_classes: int = 10, conv=nn.Conv2d):
    """The CNN of BackPACK's "Saving memory in convolutions" example.

    Conv2d(C,128,3,p1)–ReLU–MaxPool(3,s2)–Conv2d(128,256,3,p1)–ReLU–MaxPool(3,p1,s2)–
    Conv2d(256,64,3,p1)–ReLU–MaxPool(3,s2)–Conv2d(64,32,3,p1)–ReLU–MaxPool(3,s2)–
    Flatten–Linear, with the Linear sized for ``side``.

    Args:
        side: input image side (at least 27).
        in_channels: C.
        num_classes: outputs of the Linear layer.
        conv: convolution class (``torch.nn.Conv2d`` or ``memconv.Conv2d``).

    Raises:
        ValueError: if ``side`` is too small for the four poolings.
    """
    s = _pooled(_pooled(_pooled(_pooled(side, 3, 2), 3, 2, 1), 3, 2), 3, 2)
    if s < 1:
        raise ValueError(f"side must be at least 27 for the seed CNN, got {side}")
    return nn.Sequential(
        conv(in_channels, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        conv(128, 256, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, padding=1, stride=2),
        conv(256, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        conv(64, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Flatten(),
        nn.Linear(32 * s * s, num_classes),
    )
