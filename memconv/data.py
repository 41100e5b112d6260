"""Real image batches from installed packages (nothing is downloaded).

- ``"digits"``: scikit-learn's handwritten digits (1,797 8×8 images, labels 0–9),
  resized to the requested side with bilinear interpolation;
- ``"photos"``: crops of scikit-image's bundled photographs and micrographs,
  labelled by the picture they come from;
- ``"random"``: standard normal noise with random labels, only when asked for.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

SOURCES = ("digits", "photos", "random")
PHOTOS = (
    "astronaut", "camera", "coffee", "chelsea", "moon",
    "brick", "grass", "gravel", "cell", "coins",
)  # fmt: skip


def _check(n, side, channels, source):
    for value, argument in ((n, "n"), (side, "side"), (channels, "channels")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{argument} must be a positive int, got {value!r}")
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; accepted: {', '.join(SOURCES)}")


def load_batch(
    n: int, side: int, *, channels: int = 1, source: str = "digits", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``n`` images ``[N, channels, side, side]`` (float32) and labels ``[N]``.

    Args:
        n: batch size N.
        side: image side in pixels.
        channels: 1 (grey) or 3 (RGB, grey images repeated).
        source: ``"digits"``, ``"photos"`` or ``"random"``.
        seed: seed of the crop positions / random data.

    Returns:
        ``(inputs, labels)``, inputs standardised to zero mean and unit variance.

    Raises:
        ValueError: on a non-positive size or an unknown source.
    """
    _check(n, side, channels, source)
    gen = torch.Generator().manual_seed(seed)
    if source == "random":
        x = torch.randn(n, channels, side, side, generator=gen)
        return x, torch.randint(0, 10, (n,), generator=gen)
    if source == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        idx = np.arange(n) % len(digits.images)
        x = torch.as_tensor(digits.images[idx], dtype=torch.float32).unsqueeze(1)
        x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
        y = torch.as_tensor(digits.target[idx], dtype=torch.long)
    else:
        x, y = _photo_crops(n, side, gen)
    x = x.expand(n, channels, side, side).contiguous()
    return (x - x.mean()) / x.std(), y


def _photo_crops(n, side, gen):
    import skimage.data

    crops, labels = [], []
    for i in range(n):
        label = i % len(PHOTOS)
        img = np.asarray(getattr(skimage.data, PHOTOS[label])(), dtype=np.float32)
        if img.ndim == 3:
            img = img[..., :3].mean(-1)
        t = torch.as_tensor(img)[None, None]
        short = min(t.shape[-2:])
        if short < side:
            t = F.interpolate(t, scale_factor=side / short + 1e-6, mode="bilinear")
        h, w = t.shape[-2:]
        r = int(torch.randint(0, h - side + 1, (1,), generator=gen))
        c = int(torch.randint(0, w - side + 1, (1,), generator=gen))
        crops.append(t[0, :, r : r + side, c : c + side])
        labels.append(label)
    return torch.stack(crops), torch.tensor(labels)


def load_signals(n: int, length: int, *, source: str = "photos", seed: int = 0):
    """Real 1-D signals ``[N, 1, length]``: rows of scikit-image's photographs.

    Labels are the picture a row comes from; ``source="random"`` gives noise.

    Raises:
        ValueError: on a non-positive size or an unknown source.
    """
    _check(n, length, 1, source if source != "photos" else "digits")
    side = max(length, 64)
    if source == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, 1, length, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    x, y = load_batch(n, side, source="photos", seed=seed)
    return x[:, :, side // 2, :length].contiguous(), y


def load_volumes(n: int, depth: int, side: int, *, source: str = "photos", seed: int = 0):
    """Real volumes ``[N, 1, depth, side, side]``: stacks of shifted photo crops.

    Each volume stacks ``depth`` crops of one scikit-image picture, each shifted by
    one pixel, like slices of a scan; labels are the picture.

    Raises:
        ValueError: on a non-positive size or an unknown source.
    """
    _check(n, side, depth, source if source != "photos" else "digits")
    if source == "random":
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 1, depth, side, side, generator=gen)
        return x, torch.randint(0, 10, (n,), generator=gen)
    big, y = load_batch(n, side + depth, source="photos", seed=seed)
    x = torch.stack([big[:, 0, d : d + side, d : d + side] for d in range(depth)], dim=1)
    return x.unsqueeze(1).contiguous(), y
