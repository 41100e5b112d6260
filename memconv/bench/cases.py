"""Benchmark cases: a model and a batch, built the same way in every worker."""

from __future__ import annotations

import torch

from ..data import load_batch
from ..models import seed_cnn

MODELS = ("seed",)


def build_case(config: dict, device: torch.device):
    """``(model, inputs, labels)`` for ``config``.

    Keys read: ``model`` (one of :data:`MODELS`), ``batch``, ``side``, ``data``
    (``"digits"``, ``"photos"``, ``"random"``), ``seed``.

    Raises:
        ValueError: for an unknown model.
    """
    name = config.get("model", "seed")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")
    torch.manual_seed(config.get("seed", 0))
    model = seed_cnn(config["side"]).to(device)
    x, y = load_batch(config["batch"], config["side"], source=config.get("data", "digits"))
    return model, x.to(device), y.to(device)
