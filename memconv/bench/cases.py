"""Benchmark cases: a model and a batch, built the same way in every worker.

A *model* (:data:`MODELS`) and its input shape make a configuration
(:func:`build_case`); the named *cases* (:data:`CASES`) are the configurations the
benchmarks run, with a small variant for ``--quick`` and, where one is documented, the
``memory_budget`` of the budget rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Trunks as torchvision writes them, with a global-pool + Linear head, streamed by the
#: engines of the table "Streaming the models people stream" (:mod:`memconv.bench.trunks`).
STREAM_MODELS = ("stream-resnet18", "stream-resnet50", "stream-convnext-tiny")
MODELS = (
    "seed",
    "resnet18",
    "resnet18-gn",
    "wrn16-4-gn",
    "conv1d",
    "conv3d",
    "streaming-net",
    "vit-tiny",
    "resnet18-tv-gn",
    "nf-resnet26",
    "convnext-atto",
    "opacus-mnist",
    "vit-tiny-dropout",
    *STREAM_MODELS,
)
#: Smallest side each model accepts (the seed CNN's four poolings need 27 pixels).
MIN_SIDE = {
    "seed": 27,
    "resnet18": 8,
    "resnet18-gn": 8,
    "wrn16-4-gn": 8,
    "conv1d": 8,
    "conv3d": 4,
    "streaming-net": 64,
    "vit-tiny": 8,
    "resnet18-tv-gn": 8,
    "nf-resnet26": 8,
    "convnext-atto": 32,
    "opacus-mnist": 28,
    "vit-tiny-dropout": 8,
    "stream-resnet18": 64,
    "stream-resnet50": 64,
    "stream-convnext-tiny": 64,
}
#: The real data each model gets unless told otherwise.
NATURAL_DATA = {
    "seed": "digits",
    "resnet18": "photos",
    "resnet18-gn": "photos",
    "wrn16-4-gn": "photos",
    "conv1d": "photos",
    "conv3d": "photos",
    "streaming-net": "photos",
    "vit-tiny": "photos",
    "resnet18-tv-gn": "photos",
    "nf-resnet26": "photos",
    "convnext-atto": "photos",
    "opacus-mnist": "digits",
    "vit-tiny-dropout": "photos",
    "stream-resnet18": "photos",
    "stream-resnet50": "photos",
    "stream-convnext-tiny": "photos",
}
#: The models people train, as their libraries write them: the cases of the table "DP
#: on the models people train" (``memconv bench --table models``).
ZOO_CASES = ("resnet18-tv-gn", "nf-resnet26", "convnext-atto", "vit-tiny")
MiB = 2**20


@dataclass(frozen=True)
class Case:
    """A named benchmark configuration.

    Attributes:
        name: its name on the command line.
        model: one of :data:`MODELS`.
        batch: N.
        side: image side (signal length for ``conv1d``, volume side for ``conv3d``).
        depth: volume depth (``conv3d`` only).
        quick: ``(batch, side, depth)`` for ``--quick``.
        budget_mib: ``{task: MiB}``: the ``memory_budget`` of the ``memconv:budget`` rows
            (of the streaming engines' tile choice, for the streamed trunks).
        summary: one line for the help and the docs.
        extra: more worker keys (``warm_side``: the warm-up's image side).
    """

    name: str
    model: str
    batch: int
    side: int
    depth: int | None = None
    quick: tuple = ()
    budget_mib: dict = field(default_factory=dict)
    summary: str = ""
    extra: dict = field(default_factory=dict)

    def config(self, *, quick: bool = False, batch=None, side=None) -> dict:
        """The worker configuration of this case (``batch``/``side`` override)."""
        n, s, d = self.quick if quick else (self.batch, self.side, self.depth)
        out = {"case": self.name, "model": self.model, "batch": batch or n, "side": side or s}
        if d is not None:
            out["depth"] = d
        out.update(self.extra)
        return out


#: Memory budget (MiB) of the streamed trunks' tile choice (``tile_size="auto"``), per
#: trunk and image side: within a quarter of the conventional step's allocator peak at
#: 4096² (ResNet-18: 7.9 GiB; ResNet-50 and ConvNeXt-tiny, scaled from 2048²: 28 and
#: 36 GiB), 3.5 GiB for ResNet-50 at 8192² (its target: 4 GiB), and about twice the
#: least peak the tile choice predicts elsewhere (larger tiles run faster).
STREAM_BUDGET_MIB = {
    ("resnet18", 2048): 768,
    ("resnet18", 4096): 1280,
    ("resnet18", 8192): 3072,
    ("resnet18", 16384): 6144,
    ("resnet50", 2048): 1536,
    ("resnet50", 4096): 3072,
    ("resnet50", 8192): 3584,
    ("convnext-tiny", 2048): 3072,
    ("convnext-tiny", 4096): 4096,
    ("convnext-tiny", 8192): 6144,
}


#: Tile sizes (input pixels) of the streamed trunks' tile-size sweep (beside ``"auto"``).
STREAM_SWEEP_TILES = (512, 768, 1024)


def _stream_cases() -> list[Case]:
    """The cases of the table "Streaming the models people stream": one training step on
    one mosaic of scikit-image's astronaut, float32."""
    sizes = {
        "resnet18": (2048, 4096, 8192, 16384),
        "resnet50": (2048, 4096, 8192),
        "convnext-tiny": (2048, 4096, 8192),
    }
    labels = {"resnet18": "ResNet-18", "resnet50": "ResNet-50", "convnext-tiny": "ConvNeXt-tiny"}
    return [
        Case(
            f"stream-{trunk}-{side}",
            f"stream-{trunk}",
            1,
            side,
            quick=(1, 256, None),
            budget_mib={"grads": STREAM_BUDGET_MIB[trunk, side]},
            extra={"warm_side": 256},
            summary=f"a {labels[trunk]} trunk as torchvision writes it and a global-pool + "
            f"Linear head, one training step on a {side}x{side} mosaic of the "
            "astronaut (conventional, memconv streaming, Lightstream)",
        )
        for trunk, sides in sizes.items()
        for side in sides
    ] + [
        Case(
            f"stream-{trunk}-{side}-t{tile}",
            f"stream-{trunk}",
            1,
            side,
            quick=(1, 256, None),
            extra={"warm_side": 256, "tile": tile},
            summary=f"the {labels[trunk]} trunk's step at {side}x{side}, streamed with "
            f"{tile}-pixel tiles (the tile-size sweep)",
        )
        for trunk in sizes
        for side in (2048, 4096)
        for tile in STREAM_SWEEP_TILES
    ]


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case(
            "seed-112",
            "seed",
            32,
            112,
            quick=(4, 56, None),
            budget_mib={"grads": 400, "clip": 400},
            summary="the CNN of BackPACK's save-memory example, on digits",
        ),
        Case(
            "seed-28",
            "seed",
            64,
            28,
            quick=(4, 28, None),
            budget_mib={"grads": 160},
            summary="the same CNN at 28x28, the main job's case",
        ),
        Case(
            "resnet18-gn",
            "resnet18-gn",
            64,
            32,
            quick=(2, 16, None),
            budget_mib={"clip": 300},
            summary="CIFAR ResNet-18 with GroupNorm, 11.2 M parameters, on photo crops",
        ),
        Case(
            "wrn16-4-gn",
            "wrn16-4-gn",
            64,
            32,
            quick=(2, 16, None),
            summary="WideResNet-16-4 with GroupNorm, 2.75 M parameters (De et al. 2022's DP "
            "benchmark), on photo crops",
        ),
        Case(
            "vit-tiny",
            "vit-tiny",
            64,
            32,
            quick=(2, 16, None),
            summary="ViT-Tiny as timm writes it (patch 4, class token, position embedding), "
            "5.4 M parameters, on photo crops",
        ),
        Case(
            "resnet18-tv-gn",
            "resnet18-tv-gn",
            64,
            64,
            quick=(2, 32, None),
            summary="torchvision's resnet18 with GroupNorm(32, C) as written there (in-place "
            "ReLU, out += identity), 11.2 M parameters, on photo crops",
        ),
        Case(
            "nf-resnet26",
            "nf-resnet26",
            64,
            64,
            quick=(2, 32, None),
            summary="timm's nf_resnet26 (scaled weight-standardised convolutions, skip-init "
            "gains), 14.0 M parameters, on photo crops",
        ),
        Case(
            "convnext-atto",
            "convnext-atto",
            64,
            64,
            quick=(2, 32, None),
            summary="timm's convnext_atto (LayerNorm2d, layer scale), 3.4 M parameters, on "
            "photo crops",
        ),
        Case(
            "resnet18-bn",
            "resnet18",
            8,
            64,
            quick=(2, 32, None),
            summary="ImageNet-layout ResNet-18 with BatchNorm in eval mode, on photo crops",
        ),
        Case(
            "conv1d",
            "conv1d",
            32,
            2048,
            quick=(4, 128, None),
            summary="a small 1-D CNN on rows of photos",
        ),
        Case(
            "conv3d",
            "conv3d",
            8,
            24,
            depth=16,
            quick=(2, 8, 4),
            summary="a small 3-D CNN on stacks of shifted photo crops",
        ),
        Case(
            "opacus-mnist",
            "opacus-mnist",
            64,
            28,
            quick=(4, 28, None),
            summary="the small CNN of Opacus' examples/mnist.py as the script writes it, on digits",
        ),
        Case(
            "vit-tiny-dropout",
            "vit-tiny-dropout",
            64,
            32,
            quick=(2, 16, None),
            summary="ViT-Tiny with timm's dropout 0.1 (after the position embedding and in "
            "the MLPs), on photo crops",
        ),
        Case(
            "streaming-4096",
            "streaming-net",
            1,
            4096,
            quick=(1, 128, None),
            summary="StreamingCNN's example network on one 4096x4096 mosaic of the retina "
            "photograph (the memconv-streaming engine against autograd)",
        ),
        *_stream_cases(),
    )
}


def build_model(name: str) -> torch.nn.Module:
    """A freshly initialised model called ``name`` (see :data:`MODELS`).

    Raises:
        ValueError: for an unknown model.
    """
    from . import models

    builders = {
        "resnet18": models.resnet18_shaped,
        "resnet18-gn": models.resnet18_gn,
        "wrn16-4-gn": models.wrn16_4_gn,
        "conv1d": models.conv1d_net,
        "conv3d": models.conv3d_net,
        "streaming-net": models.streaming_net,
        "vit-tiny": models.vit_tiny,
        "resnet18-tv-gn": models.tv_resnet18_gn,
        "nf-resnet26": models.nf_resnet26,
        "convnext-atto": models.convnext_atto,
    }
    if name in STREAM_MODELS:
        from .trunks import classifier

        return classifier(name[len("stream-") :])
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")
    return builders[name]()


def build_case(config: dict, device: torch.device):
    """``(model, inputs, labels)`` for ``config``.

    Keys read: ``model`` (one of :data:`MODELS`), ``batch``, ``side`` (image side;
    signal length for ``conv1d``; volume side for ``conv3d``), ``depth`` (for
    ``conv3d``), ``data`` (``"digits"``, ``"photos"``, ``"random"``, or None for the
    model's own real data), ``seed``. ``"streaming-net"`` is StreamingCNN's example
    network on mosaics of scikit-image's retina photograph, with ``tile`` (input pixels
    per tile of the ``memconv-streaming`` engine, default 512); the ``stream-*`` models
    are trunks as torchvision writes them with a global-pool + Linear head
    (:func:`memconv.bench.trunks.classifier`) on a mosaic of the astronaut, streamed with
    ``tile`` or, without it, the tile chosen for ``memory_budget``.

    Raises:
        ValueError: for an unknown model or data source, or a side the model cannot take.
    """
    from .data import load_batch, load_signals, load_volumes
    from .models import seed_cnn

    name = config.get("model", "seed")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")
    n, side = config["batch"], config["side"]
    if side < MIN_SIDE[name]:
        raise ValueError(f"side must be at least {MIN_SIDE[name]} for the {name} model, got {side}")
    data = config.get("data") or NATURAL_DATA[name]
    torch.manual_seed(config.get("seed", 0))
    if name == "seed":
        model = seed_cnn(side)
        x, y = load_batch(n, side, source=data)
    elif name == "conv1d":
        model = build_model(name)
        x, y = load_signals(n, side, source=data)
    elif name == "conv3d":
        model = build_model(name)
        x, y = load_volumes(n, config.get("depth", 16), side, source=data)
    elif name == "streaming-net":
        from .data import load_mosaic
        from .models import streaming_net

        model = streaming_net()
        model.stream_tile = config.get("tile", 512)
        if data == "random":
            x = torch.randn(n, 3, side, side)
        else:
            x = load_mosaic("retina", side).expand(n, 3, side, side).contiguous()
        y = torch.zeros(n, dtype=torch.long)
    elif name in STREAM_MODELS:
        from .data import load_mosaic
        from .trunks import classifier

        model = classifier(name[len("stream-") :])
        model.stream_budget = config.get("memory_budget")
        model.stream_tile = config.get("tile")
        if data == "random":
            x = torch.randn(n, 3, side, side)
        else:
            x = load_mosaic("astronaut", side).expand(n, 3, side, side).contiguous()
        y = torch.zeros(n, dtype=torch.long)
    elif name in ("vit-tiny", "vit-tiny-dropout"):  # position embedding: the image's side
        from .models import vit_tiny

        model = vit_tiny(img_size=side, drop_rate=0.1 if name == "vit-tiny-dropout" else 0.0)
        x, y = load_batch(n, side, channels=3, source=data)
    elif name == "opacus-mnist":
        from .models import OpacusMnistCNN

        model = OpacusMnistCNN()
        x, y = load_batch(n, side, source=data)
    else:
        model = build_model(name)
        x, y = load_batch(n, side, channels=3, source=data)
    return model.to(device), x.to(device), y.to(device)


LABELS = {
    "seed": "seed CNN",
    "resnet18": "ResNet-18 (BN eval)",
    "resnet18-gn": "ResNet-18-GN",
    "wrn16-4-gn": "WRN-16-4-GN",
    "conv1d": "Conv1d CNN",
    "conv3d": "Conv3d CNN",
    "streaming-net": "StreamingCNN's example network",
    "vit-tiny": "ViT-Tiny",
    "resnet18-tv-gn": "torchvision ResNet-18-GN",
    "nf-resnet26": "NF-ResNet-26",
    "convnext-atto": "ConvNeXt-atto",
    "opacus-mnist": "Opacus' MNIST CNN",
    "vit-tiny-dropout": "ViT-Tiny with dropout",
    "stream-resnet18": "ResNet-18 trunk",
    "stream-resnet50": "ResNet-50 trunk",
    "stream-convnext-tiny": "ConvNeXt-tiny trunk",
}


def shape_of(config: dict) -> str:
    """The per-sample input shape, e.g. ``1×112×112``."""
    name, side = config.get("model", "seed"), config["side"]
    if name in ("seed", "opacus-mnist"):
        return f"1×{side}×{side}"
    if name == "conv1d":
        return f"1×{side}"
    if name == "conv3d":
        return f"1×{config.get('depth', 16)}×{side}×{side}"
    return f"3×{side}×{side}"


def describe(config: dict) -> str:
    """One-line description of a case, e.g. ``seed CNN, batch 32 × 1×112×112``."""
    return f"{LABELS[config.get('model', 'seed')]}, batch {config['batch']} × {shape_of(config)}"
