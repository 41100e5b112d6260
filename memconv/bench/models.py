"""Models of the benchmarks, the main job (``memconv compare``) and the examples."""

from __future__ import annotations

import torch
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


def group_norm(channels: int, groups: int = 32) -> nn.GroupNorm:
    """``GroupNorm(min(groups, C), C)``."""
    return nn.GroupNorm(min(groups, channels), channels)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3×3 convolutions with normalisation and a shortcut.

    Args:
        c_in: input channels.
        c_out: output channels.
        stride: stride of the first convolution (and of the shortcut's).
        norm: ``norm(channels)`` builds a normalisation layer (default BatchNorm2d).
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1, norm=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(c_out)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = norm(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), norm(c_out)
            )

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


def resnet18_shaped(in_channels: int = 3, num_classes: int = 10) -> nn.Module:
    """A ResNet-18-shaped CNN (He et al. 2016; torchvision's layout, not imported),
    with its BatchNorm layers in eval mode so that samples stay independent."""
    layers = [
        nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    c = 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(c, width, stride), BasicBlock(width, width)]
        c = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers).eval()


def resnet18_gn(in_channels: int = 3, num_classes: int = 10) -> nn.Module:
    """CIFAR ResNet-18 with GroupNorm (11.2 M parameters for 3 channels and 10 classes).

    The CIFAR layout of He et al. (2016): a 3×3 stem convolution with stride 1 and no
    max-pool, four stages of two BasicBlocks (64, 128, 256, 512 channels), global
    average pooling and a Linear layer; every normalisation is
    ``GroupNorm(min(32, C), C)``, so that samples stay independent in training mode.
    """
    layers = [nn.Conv2d(in_channels, 64, 3, padding=1, bias=False), group_norm(64), nn.ReLU()]
    c = 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [
            BasicBlock(c, width, stride, group_norm),
            BasicBlock(width, width, 1, group_norm),
        ]
        c = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


class WideBlock(nn.Module):
    """Pre-activation wide-ResNet block: (GroupNorm, ReLU, 3×3 conv) twice, and a shortcut
    (a 1×1 convolution where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int = 16):
        super().__init__()
        self.norm1 = nn.GroupNorm(min(groups, c_in), c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(min(groups, c_out), c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.relu = nn.ReLU()
        self.shortcut = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)

    def forward(self, x):
        out = self.relu(self.norm1(x))
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv2(self.relu(self.norm2(self.conv1(out))))
        return out + shortcut


def wrn16_4_gn(in_channels: int = 3, num_classes: int = 10, groups: int = 16) -> nn.Module:
    """WideResNet-16-4 with GroupNorm (2.75 M parameters), the CIFAR-10 model of De et al.
    (2022), "Unlocking high-accuracy differentially private image classification
    through scale".

    Zagoruyko & Komodakis' layout: a 3×3 stem convolution to 16 channels, three
    groups of two pre-activation blocks (64, 128, 256 channels; strides 1, 2, 2), a
    final GroupNorm and ReLU, global average pooling and a Linear layer. Every
    normalisation is ``GroupNorm(16, C)`` as in De et al. (their weight
    standardisation and augmentation multiplicity are left out: they change neither
    the layer shapes nor the per-sample gradient computation).
    """
    layers = [nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)]
    c = 16
    for width, stride in ((64, 1), (128, 2), (256, 2)):
        layers += [WideBlock(c, width, stride, groups), WideBlock(width, width, 1, groups)]
        c = width
    layers += [
        nn.GroupNorm(min(groups, c), c),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, num_classes),
    ]
    return nn.Sequential(*layers)


def conv1d_net(in_channels: int = 1, num_classes: int = 10) -> nn.Module:
    """A small 1-D CNN for signals ``[N, C, L]``."""
    return nn.Sequential(
        nn.Conv1d(in_channels, 32, 7, padding=3),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(64, 64, 3, padding=2, dilation=2, groups=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


def conv3d_net(in_channels: int = 1, num_classes: int = 10) -> nn.Module:
    """A small 3-D CNN for volumes ``[N, C, D, H, W]``."""
    return nn.Sequential(
        nn.Conv3d(in_channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool3d(2),
        nn.Conv3d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool3d(2),
        nn.Conv3d(32, 32, 3, padding=1, groups=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def streaming_net(in_channels: int = 3, num_classes: int = 2) -> nn.Sequential:
    """StreamingCNN's example network and a small head, as one flat ``nn.Sequential``.

    Six 3×3 Conv2d with 16 channels (padding 0) and three 2×2 max-pools (the part
    that can be streamed), then global average pooling and a Linear layer.
    """
    layers, c = [], in_channels
    for _ in range(3):
        layers += [nn.Conv2d(c, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU(), nn.MaxPool2d(2)]
        c = 16
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


class PatchEmbed(nn.Module):
    """timm's patch embedding: a strided convolution, flattened to tokens ``[N, P, D]``."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """timm's multi-head self-attention: one ``qkv`` Linear, scaled dot-product
    attention, an output projection."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, t, c))


class ViTBlock(nn.Module):
    """timm's pre-norm transformer block: ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, drop: float = 0.0):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        # timm's Mlp: fc1, act, drop, fc2, drop (its proj_drop_rate)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden),
            nn.GELU(),
            nn.Dropout(drop),
            nn.Linear(hidden, dim),
            nn.Dropout(drop),
        )

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """A ViT written as timm writes it (not imported): patch embedding, a class
    token and a learned position embedding (``nn.Parameter`` s of the model itself),
    pre-norm blocks, a final LayerNorm and a Linear head on the class token.

    Args:
        img_size: image side (pixels).
        patch_size: patch side (pixels).
        in_chans: input channels.
        num_classes: outputs.
        embed_dim, depth, num_heads: width, blocks and attention heads.
        drop_rate: dropout after the position embedding and in the blocks' MLPs
            (timm's ``drop_rate`` and ``proj_drop_rate``).
    """

    def __init__(
        self,
        img_size=32,
        patch_size=4,
        in_chans=3,
        num_classes=10,
        embed_dim=192,
        depth=12,
        num_heads=3,
        drop_rate=0.0,
    ):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(
            torch.randn(1, self.patch_embed.num_patches + 1, embed_dim) * 0.02
        )
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.Sequential(
            *[ViTBlock(embed_dim, num_heads, drop=drop_rate) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(self.pos_drop(x)))
        return self.head(x[:, 0])


def vit_tiny(
    in_channels: int = 3, num_classes: int = 10, img_size: int = 32, drop_rate: float = 0.0
) -> nn.Module:
    """ViT-Tiny (embed 192, depth 12, 3 heads; 5.4 M parameters) with 4×4 patches
    (on 32×32 images: 64 tokens and a class token); ``drop_rate``: timm's dropout."""
    return VisionTransformer(img_size, 4, in_channels, num_classes, 192, 12, 3, drop_rate)


class OpacusMnistCNN(nn.Module):
    """Opacus' ``examples/mnist.py`` model (``SampleConvNet``), as the script writes it,
    on ``[N, 1, 28, 28]``; ``dropout`` adds one between the two Linear layers (0: the
    script's)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = nn.functional.relu(self.conv1(x))  # -> [B, 16, 14, 14]
        x = nn.functional.max_pool2d(x, 2, 1)  # -> [B, 16, 13, 13]
        x = nn.functional.relu(self.conv2(x))  # -> [B, 32, 5, 5]
        x = nn.functional.max_pool2d(x, 2, 1)  # -> [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # -> [B, 512]
        x = self.dropout(nn.functional.relu(self.fc1(x)))  # -> [B, 32]
        return self.fc2(x)  # -> [B, 10]


def opacus_cifar10_convnet(num_classes: int = 10) -> nn.Sequential:
    """Opacus' ``examples/cifar10.py`` model (``convnet``), as the script writes it."""
    return nn.Sequential(
        nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(32, 64, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(64, 64, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(64, 128, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(start_dim=1, end_dim=-1),
        nn.Linear(128, num_classes, bias=True),
    )


# ---------------------------------------------------------------- the model zoo
# Models as their libraries write them (torchvision, timm), reproduced here because
# neither library is imported: the same modules, the same forward code (in-place
# activations, in-place adds, functional calls on derived weights) and the same
# initialisation, with 10 classes.


def _tv_conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


class TVBasicBlock(nn.Module):
    """torchvision's ``BasicBlock`` (``torchvision.models.resnet``), as written there:
    ``ReLU(inplace=True)`` and ``out += identity``.

    Args:
        inplanes: input channels.
        planes: output channels.
        stride: stride of the first convolution.
        downsample: the shortcut's module (None: identity).
        norm_layer: ``norm_layer(channels)`` builds a normalisation layer.
    """

    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = _tv_conv3x3(inplanes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _tv_conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class TVBottleneck(nn.Module):
    """torchvision's ``Bottleneck`` (ResNet-50 and deeper), as written there: 1×1, 3×3
    (the stride) and 1×1 convolutions with ``expansion = 4``, ``ReLU(inplace=True)`` and
    ``out += identity``.

    Args:
        inplanes: input channels.
        planes: the bottleneck's width (output channels ``planes * 4``).
        stride: stride of the 3×3 convolution.
        downsample: the shortcut's module (None: identity).
        norm_layer: ``norm_layer(channels)`` builds a normalisation layer.
    """

    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = norm_layer(planes)
        self.conv2 = _tv_conv3x3(planes, planes, stride)
        self.bn2 = norm_layer(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class TVResNet(nn.Module):
    """torchvision's ``ResNet`` with :class:`TVBasicBlock` s (or :class:`TVBottleneck` s):
    a 7×7 stride-2 stem, a 3×3 stride-2 max-pool, four stages, global average pooling
    and a Linear layer; torchvision's initialisation (Kaiming normal, fan-out, for the
    convolutions).

    Args:
        layers: blocks per stage.
        num_classes: outputs.
        norm_layer: ``norm_layer(channels)`` builds every normalisation layer.
        in_channels: input channels.
        block: :class:`TVBasicBlock` (ResNet-18/34) or :class:`TVBottleneck` (ResNet-50).
        width: channels of the stem and the first stage (torchvision: 64; the stages
            double it).
    """

    def __init__(
        self,
        layers=(2, 2, 2, 2),
        num_classes=10,
        norm_layer=nn.BatchNorm2d,
        in_channels=3,
        block=None,
        width=64,
    ):
        super().__init__()
        self._norm_layer = norm_layer
        self._block = block or TVBasicBlock
        self.inplanes = width
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * self._block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride=1):
        norm_layer, downsample, block = self._norm_layer, None, self._block
        width = planes * block.expansion
        if stride != 1 or self.inplanes != width:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, width, 1, stride=stride, bias=False), norm_layer(width)
            )
        layers = [block(self.inplanes, planes, stride, downsample, norm_layer)]
        self.inplanes = width
        layers += [block(width, planes, norm_layer=norm_layer) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def tv_resnet18_gn(in_channels: int = 3, num_classes: int = 10) -> nn.Module:
    """torchvision's ``resnet18(norm_layer=lambda c: nn.GroupNorm(32, c))`` (11.2 M
    parameters for 10 classes), the ImageNet layout, as a DP user builds it."""
    return TVResNet((2, 2, 2, 2), num_classes, lambda c: nn.GroupNorm(32, c), in_channels)


def _get_padding(kernel_size: int, stride: int = 1, dilation: int = 1) -> int:
    return ((stride - 1) + dilation * (kernel_size - 1)) // 2


class ScaledStdConv2d(nn.Conv2d):
    """timm's ``ScaledStdConv2d`` (``timm.layers.std_conv``): a convolution whose weight
    is standardised per output channel in the forward pass (``F.batch_norm`` over the
    weight's fan-in), scaled by ``gamma / sqrt(fan_in)`` and a learned ``gain``.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias:
            as ``nn.Conv2d`` (``padding=None``: timm's symmetric padding).
        gamma: the activation's gain (the NF-ResNets' ReLU: 1.7139588594436646).
        eps: the standardisation's epsilon.
        gain_init: the gain's initial value.
    """

    def __init__(
        self,
        in_channels,
        out_channels,
        kernel_size,
        stride=1,
        padding=None,
        dilation=1,
        groups=1,
        bias=True,
        gamma=1.0,
        eps=1e-6,
        gain_init=1.0,
    ):
        if padding is None:
            padding = _get_padding(kernel_size, stride, dilation)
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            bias=bias,
        )
        self.gain = nn.Parameter(torch.full((self.out_channels, 1, 1, 1), gain_init))
        self.scale = gamma * self.weight[0].numel() ** -0.5  # gamma * 1 / sqrt(fan-in)
        self.eps = eps

    def forward(self, x):
        weight = nn.functional.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            weight=(self.gain * self.scale).view(-1),
            training=True,
            momentum=0.0,
            eps=self.eps,
        ).reshape_as(self.weight)
        return nn.functional.conv2d(
            x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


#: timm's ``_nonlin_gamma["relu"]``: the gain that keeps ReLU's output variance at 1.
NF_RELU_GAMMA = 1.7139588594436646


class DownsampleAvg(nn.Module):
    """timm's NF shortcut: 2×2 average pooling (ceil mode) and a 1×1 scaled
    weight-standardised convolution."""

    def __init__(self, in_chs, out_chs, stride=1, conv_layer=ScaledStdConv2d):
        super().__init__()
        if stride > 1:
            self.pool = nn.AvgPool2d(2, stride, ceil_mode=True, count_include_pad=False)
        else:
            self.pool = nn.Identity()
        self.conv = conv_layer(in_chs, out_chs, 1, stride=1)

    def forward(self, x):
        return self.conv(self.pool(x))


class NormFreeBlock(nn.Module):
    """timm's ``NormFreeBlock`` (``timm.models.nfnet``), the ResNet bottleneck variant:
    pre-activation scaled by ``beta``, three scaled weight-standardised convolutions,
    the residual branch scaled by ``alpha`` (and by the learned scalar
    ``skipinit_gain``, in place, with ``skipinit``) and added to the shortcut.

    Args:
        in_chs, out_chs: channels.
        stride: stride of the 3×3 convolution (and of the shortcut's pooling).
        alpha: the residual branch's scale.
        beta: the input's scale, 1 / the expected standard deviation.
        bottle_ratio: bottleneck width over ``out_chs``.
        skipinit: add the learned ``skipinit_gain`` (initialised to 0).
        conv_layer: ``conv_layer(c_in, c_out, k, ...)`` (a :class:`ScaledStdConv2d`).
    """

    def __init__(
        self,
        in_chs,
        out_chs,
        stride=1,
        alpha=0.2,
        beta=1.0,
        bottle_ratio=0.25,
        skipinit=False,
        conv_layer=ScaledStdConv2d,
    ):
        super().__init__()
        mid_chs = _make_divisible(out_chs * bottle_ratio, 8)
        self.alpha, self.beta = alpha, beta
        if in_chs != out_chs or stride != 1:
            self.downsample = DownsampleAvg(in_chs, out_chs, stride, conv_layer)
        else:
            self.downsample = None
        self.act1 = nn.ReLU()
        self.conv1 = conv_layer(in_chs, mid_chs, 1)
        self.act2 = nn.ReLU(inplace=True)
        self.conv2 = conv_layer(mid_chs, mid_chs, 3, stride=stride)
        self.act3 = nn.ReLU()
        self.conv3 = conv_layer(mid_chs, out_chs, 1, gain_init=1.0 if skipinit else 0.0)
        self.skipinit_gain = nn.Parameter(torch.tensor(0.0)) if skipinit else None

    def forward(self, x):
        out = self.act1(x) * self.beta
        shortcut = x
        if self.downsample is not None:
            shortcut = self.downsample(out)
        x = self.conv1(out)
        x = self.conv2(self.act2(x))
        x = self.conv3(self.act3(x))
        if self.skipinit_gain is not None:
            x.mul_(self.skipinit_gain)
        x = x * self.alpha + shortcut
        return x


def _make_divisible(v, divisor=8, min_value=None, round_limit=0.9) -> int:
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < round_limit * v:
        new_v += divisor
    return new_v


class NormFreeNet(nn.Module):
    """timm's ``NormFreeNet`` in its NF-ResNet configuration (``_nfres_cfg``): a 7×7
    stride-2 scaled weight-standardised stem convolution and a max-pool, four stages
    of :class:`NormFreeBlock` s (256, 512, 1024, 2048 channels, bottleneck 1/4) with
    the expected-variance bookkeeping of ``beta``, a final ReLU, global average
    pooling and a Linear head; timm's initialisation.

    Args:
        depths: blocks per stage.
        num_classes: outputs.
        in_chans: input channels.
        alpha: the residual branches' scale.
        skipinit: blocks with a learned scalar gain on the residual branch.
    """

    def __init__(self, depths=(2, 2, 2, 2), num_classes=10, in_chans=3, alpha=0.2, skipinit=False):
        super().__init__()
        from functools import partial

        conv_layer = partial(ScaledStdConv2d, gamma=NF_RELU_GAMMA, eps=1e-8)
        self.stem = nn.Sequential()
        self.stem.add_module("conv", conv_layer(in_chans, 64, kernel_size=7, stride=2))
        self.stem.add_module("pool", nn.MaxPool2d(3, stride=2, padding=1))
        prev_chs, expected_var, stages = 64, 1.0, []
        for stage_idx, (depth, width) in enumerate(zip(depths, (256, 512, 1024, 2048))):
            stride = 1 if stage_idx == 0 else 2
            blocks = []
            for block_idx in range(depth):
                blocks.append(
                    NormFreeBlock(
                        prev_chs,
                        width,
                        stride if block_idx == 0 else 1,
                        alpha,
                        1.0 / expected_var**0.5,
                        0.25,
                        skipinit,
                        conv_layer,
                    )
                )
                if block_idx == 0:
                    expected_var = 1.0  # reset after the first block of each stage
                expected_var += alpha**2
                prev_chs = width
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.final_conv = nn.Identity()
        self.final_act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev_chs, num_classes)
        for n, m in self.named_modules():
            if "fc" in n and isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="linear")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.final_act(self.final_conv(self.stages(self.stem(x))))
        return self.fc(self.pool(x).flatten(1))


def nf_resnet26(in_channels: int = 3, num_classes: int = 10, skipinit: bool = True) -> nn.Module:
    """timm's ``nf_resnet26`` (blocks 2, 2, 2, 2; 14.0 M parameters for 10 classes) with
    the skip-init gains of DeepMind's NFNets (``skipinit=True``, as timm's ``dm_nfnet_*``),
    the normaliser-free family of DP's best image classifiers."""
    return NormFreeNet((2, 2, 2, 2), num_classes, in_channels, skipinit=skipinit)


class LayerNorm2d(nn.LayerNorm):
    """timm's ``LayerNorm2d``: LayerNorm over the channels of ``[N, C, H, W]``, written
    as a permute to channels-last, ``F.layer_norm`` and a permute back."""

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True):
        super().__init__(num_channels, eps=eps, elementwise_affine=affine)

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Mlp(nn.Module):
    """timm's ``Mlp`` with ``use_conv=True`` (1×1 convolutions): fc1, GELU, fc2."""

    def __init__(self, in_features: int, hidden_features: int, use_conv: bool = True):
        super().__init__()
        linear = (lambda i, o: nn.Conv2d(i, o, kernel_size=1)) if use_conv else nn.Linear
        self.fc1 = linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x):
        x = self.drop1(self.act(self.fc1(x)))
        return self.drop2(self.fc2(self.norm(x)))


class ConvNeXtBlock(nn.Module):
    """timm's ``ConvNeXtBlock`` with ``conv_mlp=True``: a 7×7 depthwise convolution,
    :class:`LayerNorm2d`, an :class:`Mlp` of 1×1 convolutions, the layer scale
    ``gamma`` (a parameter of the block itself, multiplied in its ``forward``) and the
    residual add.

    Args:
        dim: channels.
        ls_init_value: the layer scale's initial value.
    """

    def __init__(self, dim: int, ls_init_value: float = 1e-6):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim, bias=True)
        self.norm = LayerNorm2d(dim)
        self.mlp = Mlp(dim, 4 * dim, use_conv=True)
        self.gamma = nn.Parameter(ls_init_value * torch.ones(dim))
        self.shortcut = nn.Identity()
        self.drop_path = nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.mlp(self.norm(self.conv_dw(x)))
        x = x.mul(self.gamma.reshape(1, -1, 1, 1))
        return self.drop_path(x) + self.shortcut(shortcut)


class ConvNeXtStage(nn.Module):
    """timm's ``ConvNeXtStage``: a downsampling (:class:`LayerNorm2d`, 2×2 stride-2
    convolution) where the shape changes, then blocks."""

    def __init__(self, in_chs: int, out_chs: int, stride: int, depth: int):
        super().__init__()
        if in_chs != out_chs or stride > 1:
            self.downsample = nn.Sequential(
                LayerNorm2d(in_chs), nn.Conv2d(in_chs, out_chs, kernel_size=2, stride=stride)
            )
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.Sequential(*[ConvNeXtBlock(out_chs) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    """timm's ``ConvNeXt`` with ``conv_mlp=True``: a 4×4 patch stem and
    :class:`LayerNorm2d`, four stages, then timm's ``NormMlpClassifierHead`` (global
    average pooling, :class:`LayerNorm2d`, flatten, Linear); timm's initialisation
    (truncated normal, std 0.02).

    Args:
        depths: blocks per stage.
        dims: channels per stage.
        num_classes: outputs.
        in_chans: input channels.
    """

    def __init__(self, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), num_classes=10, in_chans=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_chans, dims[0], 4, stride=4), LayerNorm2d(dims[0]))
        prev, stages = dims[0], []
        for i, (depth, dim) in enumerate(zip(depths, dims)):
            stages.append(ConvNeXtStage(prev, dim, 1 if i == 0 else 2, depth))
            prev = dim
        self.stages = nn.Sequential(*stages)
        self.norm_pre = nn.Identity()
        self.head = nn.Sequential()
        self.head.add_module("global_pool", nn.AdaptiveAvgPool2d(1))
        self.head.add_module("norm", LayerNorm2d(prev))
        self.head.add_module("flatten", nn.Flatten(1))
        self.head.add_module("pre_logits", nn.Identity())
        self.head.add_module("drop", nn.Dropout(0.0))
        self.head.add_module("fc", nn.Linear(prev, num_classes))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.head(self.norm_pre(self.stages(self.stem(x))))


def convnext_atto(in_channels: int = 3, num_classes: int = 10) -> nn.Module:
    """timm's ``convnext_atto`` (depths 2, 2, 6, 2; dims 40, 80, 160, 320;
    ``conv_mlp=True``; 3.4 M parameters for 10 classes)."""
    return ConvNeXt((2, 2, 6, 2), (40, 80, 160, 320), num_classes, in_channels)


def all_cnn_c(in_channels: int = 3, num_classes: int = 100) -> nn.Sequential:
    """DeepOBS's ``cifar100_allcnnc`` (Springenberg et al. 2015's All-CNN-C), the network
    of BackPACK's second-order benchmarks, with its dropout layers removed: nine
    convolutions (three 3×3 of 96 channels, the third of stride 2; three of 192, the
    third of stride 2; a 3×3 without padding, two 1×1), ReLUs, and a 6×6 average pool
    over 32×32 inputs (1.39 M parameters for 100 classes)."""

    def conv(c_in, c_out, k, stride=1, padding=1):
        return [nn.Conv2d(c_in, c_out, k, stride=stride, padding=padding), nn.ReLU()]

    return nn.Sequential(
        *conv(in_channels, 96, 3),
        *conv(96, 96, 3),
        *conv(96, 96, 3, stride=2),
        *conv(96, 192, 3),
        *conv(192, 192, 3),
        *conv(192, 192, 3, stride=2),
        *conv(192, 192, 3, padding=0),
        *conv(192, 192, 1, padding=0),
        *conv(192, num_classes, 1, padding=0),
        nn.AvgPool2d(6),
        nn.Flatten(),
    )
