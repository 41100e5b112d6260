"""Benchmark cases: a model and a batch, built the same way in every worker."""

from __future__ import annotations

import torch

from .data import load_batch, load_mosaic, load_signals, load_volumes
from .models import conv1d_net, conv3d_net, resnet18_shaped, seed_cnn, streaming_net

#: The models of ``memconv bench``'s matrix.
MODELS = ("seed", "resnet18", "conv1d", "conv3d")
#: Also accepted by :func:`build_case`: StreamingCNN's example network on one mosaic.
STREAMING_MODEL = "streaming-net"


def build_case(config: dict, device: torch.device):
    """``(model, inputs, labels)`` for ``config``.

    Keys read: ``model`` (one of :data:`MODELS`), ``batch``, ``side`` (image side;
    signal length for ``conv1d``; volume side for ``conv3d``), ``depth`` (for
    ``conv3d``), ``data`` (``"digits"``/``"photos"`` real, ``"random"``), ``seed``.
    For ``model="streaming-net"`` (:data:`STREAMING_MODEL`): a batch of mosaics of
    scikit-image's retina photograph (``"photos"``) or noise, and ``tile`` (input
    pixels per tile of the ``memconv-streaming`` engine, default 512).

    Raises:
        ValueError: for an unknown model.
    """
    name = config.get("model", "seed")
    n, side = config["batch"], config["side"]
    data = config.get("data", "digits")
    torch.manual_seed(config.get("seed", 0))
    if name == "seed":
        model = seed_cnn(side)
        x, y = load_batch(n, side, source=data)
    elif name == "resnet18":
        model = resnet18_shaped()
        x, y = load_batch(n, side, channels=3, source="random" if data == "random" else "photos")
    elif name == "conv1d":
        model = conv1d_net()
        x, y = load_signals(n, side, source="random" if data == "random" else "photos")
    elif name == "conv3d":
        model = conv3d_net()
        x, y = load_volumes(
            n, config.get("depth", 16), side, source="random" if data == "random" else "photos"
        )
    elif name == STREAMING_MODEL:
        model = streaming_net()
        model.stream_tile = config.get("tile", 512)
        if data == "random":
            x = torch.randn(n, 3, side, side)
        else:
            x = load_mosaic("retina", side).expand(n, 3, side, side).contiguous()
        y = torch.zeros(n, dtype=torch.long)
    else:
        accepted = ", ".join((*MODELS, STREAMING_MODEL))
        raise ValueError(f"unknown model {name!r}; accepted: {accepted}")
    return model.to(device), x.to(device), y.to(device)


def describe(config: dict) -> str:
    """One-line description of a case, e.g. ``seed CNN, batch 32 × 1×112×112``."""
    name, n, side = config.get("model", "seed"), config["batch"], config["side"]
    shape = {
        "seed": f"1×{side}×{side}",
        "resnet18": f"3×{side}×{side}",
        "conv1d": f"1×{side}",
        "conv3d": f"1×{config.get('depth', 16)}×{side}×{side}",
        STREAMING_MODEL: f"3×{side}×{side}",
    }[name]
    label = {
        "seed": "seed CNN",
        "resnet18": "ResNet-18-shaped (BN eval)",
        STREAMING_MODEL: "StreamingCNN's example network",
    }.get(name, f"{name} CNN")
    return f"{label}, batch {n} × {shape}"
