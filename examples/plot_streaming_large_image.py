"""
Streaming a ResNet trunk over a large real image
================================================

:class:`memconv.streaming.StreamingCNN` runs the convolutional trunk of a network tile
by tile, in the manner of StreamingCNN and Lightstream, so that an image whose
activations do not fit in memory can still be trained on, with exactly the
gradients of the conventional pass.

The trunk here is written as torchvision writes ResNet-18 — ``BasicBlock`` s with
``ReLU(inplace=True)`` and ``out += identity`` — and handed over as Lightstream's users
build it: ``nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, ...,
net.layer4)``. memconv reads its dataflow with torch.fx, whatever the blocks'
``forward`` does. A global-pool + Linear head learns to tell two of scikit-image's
photographs apart, each mirrored into a large mosaic; then the conventional and the
streamed training step are measured, each in a fresh process, and their gradients
compared.

This page trains on 320×320 mosaics with 160-pixel tiles and measures a 512×512 one;
``MEMCONV_FULL=1`` trains on 4096×4096 mosaics with the tile chosen for a 1.25 GiB
budget and measures sides 2048, 4096 and 8192 (the conventional step up to 4096,
beyond which it needs about 27 GiB).
"""

import os
import sys
import time

import torch
from torch import nn
from tqdm import tqdm

from memconv.bench.data import load_mosaic
from memconv.bench.runner import measure_engines
from memconv.bench.trunks import classifier
from memconv.streaming import StreamingCNN

FULL = os.environ.get("MEMCONV_FULL", "") not in ("", "0")
TRAIN_SIDE, TILE, STEPS = (4096, "auto", 3) if FULL else (320, 160, 2)
BUDGET = 1280 * 2**20 if FULL else None
SIDES = (2048, 4096, 8192) if FULL else (512,)
CONVENTIONAL_MAX = 4096

# %%
# The trunk and the images
# ------------------------
# Every operation of the trunk is local — convolutions, BatchNorm in eval mode (its
# affine parameters still train), in-place ReLUs, max-pooling, the residual adds — so
# each tile of the output needs only a tile of the input with a halo. StreamingCNN
# checks this before any work and names any operation that is not (a global pooling,
# batch statistics, attention, ``align_corners=True``...). ``describe()`` lists the
# receptive field along the way: 435 pixels at the end.

torch.manual_seed(0)
model = classifier("resnet18")  # torchvision's resnet18 trunk, global pool + Linear
trunk, head = model[0], model[1]
stream = StreamingCNN(trunk, tile_size=TILE, memory_budget=BUDGET)
print("\n".join(stream.describe().splitlines()[:4] + ["..."] + stream.describe().splitlines()[-2:]))
names = ("astronaut", "coffee")
images = [load_mosaic(name, TRAIN_SIDE) for name in names]
labels = [torch.tensor([0]), torch.tensor([1])]
plan = stream.plan(tuple(images[0].shape))
print(f"\ntwo {TRAIN_SIDE}×{TRAIN_SIDE} mosaics ({' and '.join(names)}), {plan.count} tiles each")

# %%
# Training, tile by tile
# ----------------------
# ``stream(x)`` returns the trunk's output without keeping any activation; the
# backward pass computes each tile again and fills the trunk's ``.grad`` exactly. A
# tile never recomputes the border it shares with its neighbours: the forward pass
# keeps those thin slabs once, in raster order.

opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
for step in tqdm(range(STEPS), desc="training", file=sys.stdout, ascii=True):
    t0 = time.perf_counter()
    opt.zero_grad()
    total = 0.0
    for x, y in zip(images, labels):
        loss = loss_fn(head(stream(x)), y)
        loss.backward()
        total += loss.item()
    opt.step()
    tqdm.write(f"step {step + 1}: mean loss {total / 2:.4f} ({time.perf_counter() - t0:.1f} s)")

# %%
# Memory and time: conventional against streamed
# ----------------------------------------------
# One training step on one mosaic of the astronaut per row, each row in a fresh
# process (the runner of ``memconv bench``): ``autograd`` is the conventional step,
# ``memconv-streaming`` the same model with its trunk streamed. Peak memory is the
# increase of the process's resident set size (``memory_profiler``) and the PyTorch
# allocator's peak; the deviation is the largest relative difference between the two
# steps' gradients (float32).

rows = []
for side in SIDES:
    case = {"model": "stream-resnet18", "batch": 1, "side": side, "repeats": 1}
    if FULL:
        case["memory_budget"] = BUDGET
    else:
        case["tile"] = 256
    engines = (
        ["memconv-streaming"] if side > CONVENTIONAL_MAX else ["autograd", "memconv-streaming"]
    )
    for row in measure_engines(case, engines, reference="autograd"):
        rows.append({"side": side, **row})

print(
    f"{'side':>6s} {'step':>12s} {'peak RSS (MiB)':>15s} {'allocator (MiB)':>16s} {'time (s)':>9s} {'deviation':>10s}"
)
for r in rows:
    mode = "streamed" if r["engine"] == "memconv-streaming" else "conventional"
    if "peak_rss_mib" not in r:
        print(f"{r['side']:6d} {mode:>12s} failed: {r.get('error')}")
        continue
    dev = f"{r['deviation']:.1e}" if r.get("deviation") is not None and mode == "streamed" else ""
    print(
        f"{r['side']:6d} {mode:>12s} {r['peak_rss_mib']:15,.0f} {r['peak_alloc_mib']:16,.0f} "
        f"{r['time_s']:9.1f} {dev:>10s}"
    )

# %%
# The streamed step's memory is bounded by one tile's graph, the kept halo slabs and
# the trunk's output and its gradient, while the conventional step keeps every
# activation of the whole image. In float32 the two steps' gradients differ by
# round-off (the sums over positions run in another order); in float64 they agree to
# about 1e-14 (see :doc:`/streaming`).

import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6, 3.5))
for mode, color in (("autograd", "tab:blue"), ("memconv-streaming", "tab:red")):
    pts = [
        (r["side"], r["peak_alloc_mib"])
        for r in rows
        if r["engine"] == mode and "peak_alloc_mib" in r
    ]
    if pts:
        label = "conventional" if mode == "autograd" else "streamed"
        ax.plot(*zip(*pts), "o-", color=color, label=label)
ax.set_xlabel("image side (pixels)")
ax.set_ylabel("allocator peak (MiB)")
ax.set_xscale("log", base=2)
ax.legend()
fig.tight_layout()

if "MEMCONV_GALLERY" not in os.environ:  # run as a script: keep the figure, show it if possible
    fig.savefig("plot_streaming_large_image.png", dpi=120)
    print("figure saved to plot_streaming_large_image.png")
    if plt.get_backend().lower() != "agg":
        plt.show()
