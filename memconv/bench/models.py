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

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

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
    """

    def __init__(self, img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=192,
                 depth=12, num_heads=3):  # fmt: skip
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(
            torch.randn(1, self.patch_embed.num_patches + 1, embed_dim) * 0.02
        )
        self.blocks = nn.Sequential(*[ViTBlock(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit_tiny(in_channels: int = 3, num_classes: int = 10, img_size: int = 32) -> nn.Module:
    """ViT-Tiny (embed 192, depth 12, 3 heads; 5.4 M parameters) with 4×4 patches
    (on 32×32 images: 64 tokens and a class token)."""
    return VisionTransformer(img_size, 4, in_channels, num_classes, 192, 12, 3)
