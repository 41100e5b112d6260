"""Streaming a CNN over real multi-megapixel images: training and peak memory.

Two real images shipped with scikit-image, scikit-image's retina photograph
(``skimage.data.retina()``, 1411×1411) and its immunohistochemistry micrograph
(``immunohistochemistry()``, 512×512), are tiled into mosaics of a chosen side (8192
by default). StreamingCNN's own example network (six 3×3 Conv2d with 16 channels and
three 2×2 max-pools) runs streamed, followed by a small classifier head (global
average pooling and a Linear layer); a few SGD steps teach it to tell the two
mosaics apart.

Then each configuration (conventional and streamed forward+backward, per image
side) runs in a fresh subprocess, and the script prints peak memory increase
(process RSS via memory_profiler, and the allocator-level peak from the PyTorch
profiler), run time, and the largest deviation of the streamed gradients from the
conventional ones where both fit.

Usage::

    python examples/streaming_large_image.py                    # all of it
    python examples/streaming_large_image.py --skip-train --sides 1024 2048
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch
from torch import nn

from memconv.streaming import StreamingCNN


def stream_net() -> nn.Sequential:
    """StreamingCNN's example network (padding 0), 3 input channels."""
    torch.manual_seed(0)
    layers, c = [], 3
    for _ in range(3):
        layers += [nn.Conv2d(c, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU(), nn.MaxPool2d(2)]
        c = 16
    return nn.Sequential(*layers)


def head() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2))


def mosaic(name: str, side: int) -> torch.Tensor:
    """A real scikit-image picture tiled (mirrored) into ``[1, 3, side, side]``, float32."""
    import skimage.data

    img = np.asarray(getattr(skimage.data, name)(), dtype=np.float32)[..., :3] / 255.0
    h, w = img.shape[:2]
    reps = (-(-side // h), -(-side // w))
    tiles = [[img[:, ::-1] if j % 2 else img for j in range(reps[1])] for _ in range(reps[0])]
    rows = [np.concatenate(r, axis=1) for r in tiles]
    rows = [r[::-1] if i % 2 else r for i, r in enumerate(rows)]
    full = np.ascontiguousarray(np.concatenate(rows, axis=0)[:side, :side])
    t = torch.from_numpy(full).permute(2, 0, 1).unsqueeze(0).contiguous()
    return (t - t.mean()) / t.std()


# ------------------------------------------------------------------ training
def train(side: int, tile: int, steps: int) -> None:
    layers, clf = stream_net(), head()
    stream = StreamingCNN(layers, tile_size=tile)
    images = [mosaic("retina", side), mosaic("immunohistochemistry", side)]
    labels = [torch.tensor([0]), torch.tensor([1])]
    opt = torch.optim.SGD([*layers.parameters(), *clf.parameters()], lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    print(
        f"training on two {side}×{side} mosaics, tile {tile}, {len(stream.tiles((side, side)))} tiles"
    )
    for step in range(steps):
        t0 = time.perf_counter()
        total = 0.0
        opt.zero_grad()
        for x, y in zip(images, labels):
            loss = loss_fn(clf(stream(x)), y)
            loss.backward()  # streams tile by tile through StreamingCNN's autograd function
            total += loss.item()
        opt.step()
        print(f"step {step + 1}: mean loss {total / 2:.4f} ({time.perf_counter() - t0:.1f} s)")


# ------------------------------------------------------------------ measurement
def work(mode: str, side: int, tile: int, out_path: str | None):
    """One forward+backward (conventional or streamed) on a real mosaic."""
    from memconv.bench.measure import peak_allocated, peak_rss_increase

    layers, clf = stream_net(), head()
    x = mosaic("retina", side)
    y = torch.tensor([0])
    loss_fn = nn.CrossEntropyLoss()
    runner = StreamingCNN(layers, tile_size=tile) if mode == "streaming" else layers

    def step():
        layers.zero_grad(set_to_none=True)
        clf.zero_grad(set_to_none=True)
        loss_fn(clf(runner(x)), y).backward()
        return {n: p.grad for n, p in layers.named_parameters()}

    t0 = time.perf_counter()
    rss, grads = peak_rss_increase(step)
    seconds = time.perf_counter() - t0
    if out_path:
        torch.save(grads, out_path)
    del grads
    alloc, _ = peak_allocated(step, torch.device("cpu"))
    return {
        "mode": mode,
        "side": side,
        "peak_rss_mib": rss,
        "peak_alloc_mib": alloc,
        "time_s": seconds,
    }


def measure(sides, tile, conventional_max):
    from memconv.bench.runner import run_in_subprocess

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for side in sides:
            paths = {}
            for mode in ("conventional", "streaming"):
                if mode == "conventional" and side > conventional_max:
                    continue
                path = os.path.join(tmp, f"{mode}-{side}.pt")
                # a fresh process per configuration, by memconv's benchmark runner
                row = run_in_subprocess(
                    {
                        "call": f"{os.path.abspath(__file__)}:work",
                        "args": {"mode": mode, "side": side, "tile": tile, "out_path": path},
                    }
                )
                if "error" in row:
                    raise SystemExit(f"{mode} at {side} failed: {row['error']}")
                paths[mode] = path
                rows.append(row)
                print(
                    f"{mode:12s} {side:5d}²: peak RSS +{row['peak_rss_mib']:,.0f} MiB, "
                    f"allocator peak {row['peak_alloc_mib']:,.0f} MiB, {row['time_s']:.1f} s",
                    flush=True,
                )
            if len(paths) == 2:
                a, b = torch.load(paths["streaming"]), torch.load(paths["conventional"])
                dev = max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)
                rows[-1]["deviation"] = dev
                print(f"             {side:5d}²: largest relative gradient deviation {dev:.1e}")
    return rows


def table(rows) -> str:
    conv = {r["side"]: r for r in rows if r["mode"] == "conventional"}
    lines = [
        "| side | mode | peak RSS increase (MiB) | allocator peak (MiB) | time (s) | ratio to conventional (RSS / time) | max rel. grad deviation |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = ""
        c = conv.get(r["side"])
        if r["mode"] == "streaming" and c:
            ratio = f"{r['peak_rss_mib'] / c['peak_rss_mib']:.3f} / {r['time_s'] / c['time_s']:.2f}"
        dev = f"{r['deviation']:.1e}" if "deviation" in r else ""
        lines.append(
            f"| {r['side']} | {r['mode']} | {r['peak_rss_mib']:,.0f} | {r['peak_alloc_mib']:,.0f} | "
            f"{r['time_s']:.1f} | {ratio} | {dev} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-side", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tile", type=int, default=512, help="tile side in input pixels")
    parser.add_argument("--sides", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument(
        "--conventional-max", type=int, default=4096, help="largest side run conventionally"
    )
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if not args.skip_train:
        train(args.train_side, args.tile, args.steps)
    print(
        f"\npeak memory, forward+backward of one image, tile {args.tile}, float32, CPU "
        f"({torch.get_num_threads()} threads)"
    )
    rows = measure(args.sides, args.tile, args.conventional_max)
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
