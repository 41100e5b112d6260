"""The trunks people stream, written as their libraries write them (not imported).

torchvision's ResNet (:class:`~memconv.bench.models.TVResNet`), ConvNeXt, DenseNet,
MobileNetV2 and EfficientNet's MBConv, and milesial's U-Net ("Pytorch-UNet"): the
same modules, the same ``forward`` bodies (in-place activations, ``out += identity``,
permutes around ``LayerNorm``, ``torch.cat`` of features, padding of skip
connections), so that :class:`memconv.streaming.StreamingCNN` is tested and measured
on what users hand it. :func:`classifier` puts a trunk before a global-pool + Linear
head, the models of the benchmark "Streaming the models people stream".
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .models import LayerNorm2d, TVBottleneck, TVResNet


# ------------------------------------------------------------------ torchvision.ops.misc
class ConvNormActivation(nn.Sequential):
    """torchvision's ``Conv2dNormActivation``: convolution, normalisation, activation,
    an ``nn.Sequential`` (``padding=None``: ``(kernel_size - 1) // 2 * dilation``)."""

    def __init__(
        self,
        in_channels,
        out_channels,
        kernel_size=3,
        stride=1,
        padding=None,
        groups=1,
        norm_layer=nn.BatchNorm2d,
        activation_layer=nn.ReLU,
        dilation=1,
        inplace=True,
        bias=None,
    ):
        if padding is None:
            padding = (kernel_size - 1) // 2 * dilation
        if bias is None:
            bias = norm_layer is None
        layers = [
            nn.Conv2d(
                in_channels,
                out_channels,
                kernel_size,
                stride,
                padding,
                dilation=dilation,
                groups=groups,
                bias=bias,
            )
        ]
        if norm_layer is not None:
            layers.append(norm_layer(out_channels))
        if activation_layer is not None:
            layers.append(
                activation_layer(inplace=inplace) if inplace is not None else activation_layer()
            )
        super().__init__(*layers)


class Permute(nn.Module):
    """torchvision's ``Permute``: ``torch.permute(x, dims)``."""

    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


def stochastic_depth(input, p: float, mode: str, training: bool = True):
    """torchvision's ``stochastic_depth``: the identity in eval mode."""
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


class StochasticDepth(nn.Module):
    """torchvision's ``StochasticDepth``."""

    def __init__(self, p: float, mode: str):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, input):
        return stochastic_depth(input, self.p, self.mode, self.training)


class SqueezeExcitation(nn.Module):
    """torchvision's ``SqueezeExcitation``: adaptive average pooling to 1×1, two 1×1
    convolutions, and the input scaled by their sigmoid (a global operation)."""

    def __init__(
        self, input_channels, squeeze_channels, activation=nn.ReLU, scale_activation=nn.Sigmoid
    ):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def forward(self, input):
        scale = self.avgpool(input)
        scale = self.fc2(self.activation(self.fc1(scale)))
        return self.scale_activation(scale) * input


# ------------------------------------------------------------------ ResNet
def resnet_trunk(
    depth: int = 18, norm_layer=nn.BatchNorm2d, in_channels: int = 3, width: int = 64, layers=None
) -> nn.Sequential:
    """``nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, ...,
    net.layer4)`` of torchvision's ``resnet18`` or ``resnet50`` (BatchNorm in eval mode),
    as Lightstream's users build it; ``width`` and ``layers`` (blocks per stage) make
    smaller ones for tests."""
    if depth == 18:
        net = TVResNet(layers or (2, 2, 2, 2), 10, norm_layer, in_channels, width=width)
    elif depth == 50:
        net = TVResNet(layers or (3, 4, 6, 3), 10, norm_layer, in_channels, TVBottleneck, width)
    else:
        raise ValueError(f"depth must be 18 or 50, got {depth}")
    trunk = nn.Sequential(
        net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3, net.layer4
    )
    return trunk.eval()


# ------------------------------------------------------------------ ConvNeXt
class CNBlock(nn.Module):
    """torchvision's ``CNBlock``: a 7×7 depthwise convolution, a permute to channels-last,
    ``LayerNorm``, ``Linear`` (4×), GELU, ``Linear``, a permute back, the layer scale (a
    parameter ``[C, 1, 1]``), stochastic depth and ``result += input``."""

    def __init__(self, dim, layer_scale: float = 1e-6, stochastic_depth_prob: float = 0.0):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim, bias=True),
            nn.GELU(),
            nn.Linear(4 * dim, dim, bias=True),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")

    def forward(self, input):
        result = self.layer_scale * self.block(input)
        result = self.stochastic_depth(result)
        result += input
        return result


def convnext_trunk(
    depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), in_channels: int = 3, layer_scale: float = 1e-6
) -> nn.Sequential:
    """torchvision's ``convnext_tiny(...).features`` (the defaults; other depths and
    widths for small tests): a 4×4 stride-4 patch stem with a ``LayerNorm2d`` (written
    as torchvision and timm write it, :class:`memconv.bench.models.LayerNorm2d`), then
    stages of :class:`CNBlock` s separated by ``LayerNorm2d`` + 2×2 stride-2
    convolutions; torchvision's initialisation (truncated normal, std 0.02)."""
    norm_layer = partial(LayerNorm2d, eps=1e-6)
    layers: list[nn.Module] = [
        ConvNormActivation(
            in_channels,
            dims[0],
            kernel_size=4,
            stride=4,
            padding=0,
            norm_layer=norm_layer,
            activation_layer=None,
            bias=True,
        )
    ]
    for i, (depth, dim) in enumerate(zip(depths, dims)):
        layers.append(nn.Sequential(*[CNBlock(dim, layer_scale) for _ in range(depth)]))
        if i + 1 < len(dims):
            layers.append(nn.Sequential(norm_layer(dim), nn.Conv2d(dim, dims[i + 1], 2, 2)))
    features = nn.Sequential(*layers)
    for m in features.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return features


class TVConvNeXt(nn.Module):
    """torchvision's ``ConvNeXt`` (``convnext_tiny`` with the defaults): the features of
    :func:`convnext_trunk`, ``AdaptiveAvgPool2d(1)`` and the classifier
    ``nn.Sequential(LayerNorm2d, nn.Flatten(1), nn.Linear)``, as torchvision writes them.

    Args:
        depths: blocks per stage.
        dims: channels per stage.
        num_classes: outputs.
        in_channels: input channels.
        layer_scale: the layer scales' initial value (torchvision: 1e-6).
    """

    def __init__(
        self,
        depths=(3, 3, 9, 3),
        dims=(96, 192, 384, 768),
        num_classes=10,
        in_channels=3,
        layer_scale=1e-6,
    ):
        super().__init__()
        self.features = convnext_trunk(depths, dims, in_channels, layer_scale)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            LayerNorm2d(dims[-1], eps=1e-6), nn.Flatten(1), nn.Linear(dims[-1], num_classes)
        )
        nn.init.trunc_normal_(self.classifier[2].weight, std=0.02)
        nn.init.zeros_(self.classifier[2].bias)

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        return self.classifier(x)


# ------------------------------------------------------------------ DenseNet
class _DenseLayer(nn.Module):
    """torchvision's ``_DenseLayer``: BN–ReLU–1×1 conv on the concatenated features, then
    BN–ReLU–3×3 conv."""

    def __init__(self, num_input_features, growth_rate, bn_size, drop_rate: float = 0.0):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)
        self.drop_rate = float(drop_rate)
        self.memory_efficient = False

    def bn_function(self, inputs):
        concated_features = torch.cat(inputs, 1)
        return self.conv1(self.relu1(self.norm1(concated_features)))

    def forward(self, input):
        prev_features = [input] if isinstance(input, torch.Tensor) else input
        bottleneck_output = self.bn_function(prev_features)
        new_features = self.conv2(self.relu2(self.norm2(bottleneck_output)))
        if self.drop_rate > 0:
            new_features = F.dropout(new_features, p=self.drop_rate, training=self.training)
        return new_features


class _DenseBlock(nn.ModuleDict):
    """torchvision's ``_DenseBlock``: each layer reads all features so far; the block
    returns their concatenation."""

    def __init__(self, num_layers, num_input_features, bn_size, growth_rate):
        super().__init__()
        for i in range(num_layers):
            layer = _DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size)
            self.add_module(f"denselayer{i + 1}", layer)

    def forward(self, init_features):
        features = [init_features]
        for _, layer in self.items():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    """torchvision's ``_Transition``: BN, ReLU, 1×1 convolution, 2×2 average pooling."""

    def __init__(self, num_input_features, num_output_features):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, 1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


def densenet_trunk(
    growth_rate=32,
    block_config=(6, 12, 24, 16),
    num_init_features=64,
    bn_size=4,
    in_channels: int = 3,
) -> nn.Sequential:
    """torchvision's ``densenet121(...).features`` (the defaults; smaller for tests),
    BatchNorm in eval mode."""
    features = nn.Sequential()
    features.add_module("conv0", nn.Conv2d(in_channels, num_init_features, 7, 2, 3, bias=False))
    features.add_module("norm0", nn.BatchNorm2d(num_init_features))
    features.add_module("relu0", nn.ReLU(inplace=True))
    features.add_module("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
    num_features = num_init_features
    for i, num_layers in enumerate(block_config):
        block = _DenseBlock(num_layers, num_features, bn_size, growth_rate)
        features.add_module(f"denseblock{i + 1}", block)
        num_features = num_features + num_layers * growth_rate
        if i != len(block_config) - 1:
            features.add_module(f"transition{i + 1}", _Transition(num_features, num_features // 2))
            num_features = num_features // 2
    features.add_module("norm5", nn.BatchNorm2d(num_features))
    return features.eval()


# ------------------------------------------------------------------ MobileNetV2
class InvertedResidual(nn.Module):
    """torchvision's MobileNetV2 ``InvertedResidual``: 1×1 expansion (ReLU6), 3×3
    depthwise (ReLU6), 1×1 projection; ``x + self.conv(x)`` where shapes allow."""

    def __init__(self, inp, oup, stride, expand_ratio, norm_layer=nn.BatchNorm2d):
        super().__init__()
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(
                ConvNormActivation(
                    inp, hidden_dim, kernel_size=1, norm_layer=norm_layer, activation_layer=nn.ReLU6
                )
            )
        layers.extend(
            [
                ConvNormActivation(
                    hidden_dim,
                    hidden_dim,
                    stride=stride,
                    groups=hidden_dim,
                    norm_layer=norm_layer,
                    activation_layer=nn.ReLU6,
                ),
                nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
                norm_layer(oup),
            ]
        )
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


def mobilenet_v2_trunk(
    setting=None, width: int = 32, last: int = 1280, in_channels: int = 3
) -> nn.Sequential:
    """torchvision's ``mobilenet_v2().features`` (the default ``setting``; smaller for
    tests): ``(t, c, n, s)`` rows of inverted residuals, BatchNorm in eval mode."""
    setting = setting or [
        [1, 16, 1, 1],
        [6, 24, 2, 2],
        [6, 32, 3, 2],
        [6, 64, 4, 2],
        [6, 96, 3, 1],
        [6, 160, 3, 2],
        [6, 320, 1, 1],
    ]
    features: list[nn.Module] = [
        ConvNormActivation(in_channels, width, stride=2, activation_layer=nn.ReLU6)
    ]
    c_in = width
    for t, c, n, s in setting:
        for i in range(n):
            features.append(InvertedResidual(c_in, c, s if i == 0 else 1, expand_ratio=t))
            c_in = c
    features.append(ConvNormActivation(c_in, last, kernel_size=1, activation_layer=nn.ReLU6))
    return nn.Sequential(*features).eval()


# ------------------------------------------------------------------ EfficientNet
class MBConv(nn.Module):
    """torchvision's EfficientNet ``MBConv``: expansion, depthwise convolution,
    :class:`SqueezeExcitation` (global), projection, stochastic depth and the residual."""

    def __init__(self, input_channels, out_channels, expand_ratio=4, kernel=3, stride=1):
        super().__init__()
        self.use_res_connect = stride == 1 and input_channels == out_channels
        expanded = input_channels * expand_ratio
        self.block = nn.Sequential(
            ConvNormActivation(input_channels, expanded, 1, activation_layer=nn.SiLU),
            ConvNormActivation(
                expanded, expanded, kernel, stride, groups=expanded, activation_layer=nn.SiLU
            ),
            SqueezeExcitation(
                expanded, max(1, input_channels // 4), activation=partial(nn.SiLU, inplace=True)
            ),
            ConvNormActivation(expanded, out_channels, 1, activation_layer=None),
        )
        self.stochastic_depth = StochasticDepth(0.0, "row")

    def forward(self, input):
        result = self.block(input)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += input
        return result


# ------------------------------------------------------------------ U-Net
class DoubleConv(nn.Sequential):
    """milesial's ``DoubleConv``: (3×3 convolution, BatchNorm, ReLU) twice."""

    def __init__(self, in_channels, out_channels, mid_channels=None):
        mid = mid_channels or out_channels
        super().__init__(
            nn.Conv2d(in_channels, mid, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


class Down(nn.Module):
    """milesial's ``Down``: 2×2 max-pooling, then :class:`DoubleConv`."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))

    def forward(self, x):
        return self.maxpool_conv(x)


class Up(nn.Module):
    """milesial's ``Up``: upsampling (bilinear with ``align_corners=True``, or a 2×2
    stride-2 transposed convolution), the skip padded to the upsampled size
    (``F.pad`` by the size difference), concatenation and :class:`DoubleConv`."""

    def __init__(self, in_channels, out_channels, bilinear=False):
        super().__init__()
        if bilinear:
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1, x2):
        x1 = self.up(x1)
        diffY = x2.size()[2] - x1.size()[2]
        diffX = x2.size()[3] - x1.size()[3]
        x1 = F.pad(x1, [diffX // 2, diffX - diffX // 2, diffY // 2, diffY - diffY // 2])
        x = torch.cat([x2, x1], dim=1)
        return self.conv(x)


class UNet(nn.Module):
    """milesial's ``UNet`` (Pytorch-UNet): four :class:`Down` and four :class:`Up`
    stages with skip connections and a 1×1 output convolution; ``width`` 64 as there
    (smaller for tests). BatchNorm in eval mode for streaming."""

    def __init__(self, n_channels=3, n_classes=2, bilinear=False, width=64):
        super().__init__()
        w = width
        factor = 2 if bilinear else 1
        self.inc = DoubleConv(n_channels, w)
        self.down1 = Down(w, 2 * w)
        self.down2 = Down(2 * w, 4 * w)
        self.down3 = Down(4 * w, 8 * w)
        self.down4 = Down(8 * w, 16 * w // factor)
        self.up1 = Up(16 * w, 8 * w // factor, bilinear)
        self.up2 = Up(8 * w, 4 * w // factor, bilinear)
        self.up3 = Up(4 * w, 2 * w // factor, bilinear)
        self.up4 = Up(2 * w, w, bilinear)
        self.outc = nn.Conv2d(w, n_classes, kernel_size=1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x5 = self.down4(x4)
        x = self.up1(x5, x4)
        x = self.up2(x, x3)
        x = self.up3(x, x2)
        x = self.up4(x, x1)
        return self.outc(x)


# ------------------------------------------------------------------ benchmark models
#: The trunks of the benchmark "Streaming the models people stream".
TRUNKS = {
    "resnet18": lambda: resnet_trunk(18),
    "resnet50": lambda: resnet_trunk(50),
    "convnext-tiny": convnext_trunk,
}
#: Channels of each trunk's output.
TRUNK_CHANNELS = {"resnet18": 512, "resnet50": 2048, "convnext-tiny": 768}


def classifier(trunk_name: str, num_classes: int = 2) -> nn.Sequential:
    """``nn.Sequential(trunk, head)``: a trunk of :data:`TRUNKS` and a head of global
    average pooling and a Linear layer (the trunk in eval mode: BatchNorm uses its
    running statistics, its affine parameters are trained).

    Raises:
        ValueError: for an unknown trunk.
    """
    if trunk_name not in TRUNKS:
        raise ValueError(f"unknown trunk {trunk_name!r}; accepted: {', '.join(TRUNKS)}")
    head = nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(TRUNK_CHANNELS[trunk_name], num_classes)
    )
    return nn.Sequential(TRUNKS[trunk_name]().eval(), head)


__all__ = [
    "CNBlock",
    "ConvNormActivation",
    "InvertedResidual",
    "MBConv",
    "Permute",
    "SqueezeExcitation",
    "TRUNKS",
    "TVConvNeXt",
    "UNet",
    "classifier",
    "convnext_trunk",
    "densenet_trunk",
    "mobilenet_v2_trunk",
    "resnet_trunk",
]


def randomise_norms(module: nn.Module) -> nn.Module:
    """``module`` with its normalisation layers' running statistics and affine
    parameters drawn away from their initial values (from the global generator), so
    that an error in their gradients shows in a comparison; returns it."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
        if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    return module
