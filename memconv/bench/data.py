"""Real image batches from installed packages (nothing is downloaded).

- ``"digits"``: scikit-learn's handwritten digits (1,797 8×8 images, labels 0–9),
  resized to the requested side with bilinear interpolation;
- ``"photos"``: crops of scikit-image's bundled photographs and micrographs,
  labelled by the picture they come from;
- ``"random"``: standard normal noise with random labels, only when asked for.

scikit-learn, scikit-image and numpy are imported only when real data are asked for.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SOURCES = ("digits", "photos", "random")
#: One line on each source, for ``memconv list``.
SOURCE_SUMMARIES = {
    "digits": "scikit-learn's handwritten digits (8x8), resized",
    "photos": "scikit-image's bundled photographs (astronaut, camera, ...), cropped and resized",
    "random": "standard normal noise (no real image)",
}
PHOTOS = (
    "astronaut",
    "camera",
    "coffee",
    "chelsea",
    "moon",
    "brick",
    "grass",
    "gravel",
    "cell",
    "coins",
)


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
        channels: 1 (grey) or more (grey images repeated).
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
        images, targets = _digits()
        idx = torch.arange(n) % len(images)
        x = F.interpolate(
            images[idx].unsqueeze(1), size=(side, side), mode="bilinear", align_corners=False
        )
        y = targets[idx]
    else:
        x, y = _photo_crops(n, side, gen)
    x = x.expand(n, channels, side, side).contiguous()
    return (x - x.mean()) / x.std(), y


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (
        torch.as_tensor(digits.images, dtype=torch.float32),
        torch.as_tensor(digits.target, dtype=torch.long),
    )


@functools.lru_cache(maxsize=len(PHOTOS))
def _photo(name: str) -> torch.Tensor:
    """One scikit-image picture, grey, ``[H, W]`` float32."""
    import numpy as np
    import skimage.data

    img = np.asarray(getattr(skimage.data, name)(), dtype=np.float32)
    if img.ndim == 3:
        img = img[..., :3].mean(-1)
    return torch.as_tensor(img)


def _photo_crops(n, side, gen):
    crops, labels = [], []
    for i in range(n):
        label = i % len(PHOTOS)
        t = _photo(PHOTOS[label])[None, None]
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
    """1-D signals ``[N, 1, length]``: the middle rows of :func:`load_batch` images.

    Labels are the image's; ``source="random"`` gives noise.

    Raises:
        ValueError: on a non-positive size or an unknown source.
    """
    _check(n, length, 1, source)
    if source == "random":
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, 1, length, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    side = max(length, 64)
    x, y = load_batch(n, side, source=source, seed=seed)
    return x[:, :, side // 2, :length].contiguous(), y


def load_volumes(n: int, depth: int, side: int, *, source: str = "photos", seed: int = 0):
    """Volumes ``[N, 1, depth, side, side]``: stacks of shifted image crops.

    Each volume stacks ``depth`` crops of one :func:`load_batch` image, each shifted
    by one pixel, like slices of a scan; labels are the image's.

    Raises:
        ValueError: on a non-positive size or an unknown source.
    """
    _check(n, side, depth, source)
    if source == "random":
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 1, depth, side, side, generator=gen)
        return x, torch.randint(0, 10, (n,), generator=gen)
    big, y = load_batch(n, side + depth, source=source, seed=seed)
    x = torch.stack([big[:, 0, d : d + side, d : d + side] for d in range(depth)], dim=1)
    return x.unsqueeze(1).contiguous(), y


def load_mosaic(name: str, side: int) -> torch.Tensor:
    """A real scikit-image picture tiled (mirrored) into ``[1, 3, side, side]`` (float32).

    Args:
        name: a colour picture of ``skimage.data``, e.g. ``"retina"`` (1411×1411),
            ``"immunohistochemistry"`` (512×512), ``"astronaut"``, ``"hubble_deep_field"``.
        side: the mosaic's side in pixels.

    Returns:
        The mosaic, standardised to zero mean and unit variance.

    Raises:
        ValueError: on a non-positive side or a name that is not such a picture.
    """
    import numpy as np
    import skimage.data

    if isinstance(side, bool) or not isinstance(side, int) or side < 1:
        raise ValueError(f"side must be a positive int, got {side!r}")
    loader = getattr(skimage.data, name, None)
    if loader is None or not callable(loader):
        raise ValueError(f"skimage.data has no picture {name!r}")
    img = np.asarray(loader(), dtype=np.float32)
    if img.ndim != 3:
        raise ValueError(f"skimage.data.{name} is not a colour picture")
    img = img[..., :3] / 255.0
    h, w = img.shape[:2]
    reps = (-(-side // h), -(-side // w))
    tiles = [[img[:, ::-1] if j % 2 else img for j in range(reps[1])] for _ in range(reps[0])]
    rows = [np.concatenate(r, axis=1) for r in tiles]
    rows = [r[::-1] if i % 2 else r for i, r in enumerate(rows)]
    full = np.ascontiguousarray(np.concatenate(rows, axis=0)[:side, :side])
    t = torch.from_numpy(full).permute(2, 0, 1).unsqueeze(0).contiguous()
    return (t - t.mean()) / t.std()
