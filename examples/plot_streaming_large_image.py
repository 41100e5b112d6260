"""
Streaming a CNN over a large real image
=======================================

:class:`memconv.streaming.StreamingCNN` runs the convolutional part of a network tile
by tile, in the manner of StreamingCNN and Lightstream, so that an image whose
activations do not fit in memory can still be trained on, with exactly the
gradients of the conventional pass.

Here StreamingCNN's own example network (six 3×3 convolutions with 16 channels and
three 2×2 max-pools), followed by a small head, learns to tell two real pictures
bundled with scikit-image apart — its retina photograph and its immunohistochemistry
micrograph — each tiled into a large mosaic. Then the conventional and the streamed
forward and backward pass are measured, each in a fresh process, and their gradients
compared.

This page trained on 512×512 mosaics and measured a 1024×1024 one, with 256-pixel
tiles; ``MEMCONV_FULL=1`` trains on
8192×8192 mosaics with 512-pixel tiles and measures sides from 1024 to 8192 (the
conventional pass up to 4096, beyond which it needs about 20 GiB).
"""

import os
import time

import torch
from torch import nn

from memconv.bench.data import load_mosaic
from memconv.bench.models import streaming_net
from memconv.bench.runner import measure_engines
from memconv.streaming import StreamingCNN

FULL = os.environ.get("MEMCONV_FULL", "") not in ("", "0")
TRAIN_SIDE, TILE, STEPS = (8192, 512, 3) if FULL else (512, 256, 2)
SIDES = (1024, 2048, 4096, 8192) if FULL else (1024,)
CONVENTIONAL_MAX = 4096

# %%
# The network and the images
# --------------------------
# The streamed part is every layer up to the global pooling: convolutions, ReLUs and
# max-pools are local, so each output tile needs only a tile of the input with a
# halo. StreamingCNN checks this before any work and names any layer that is not.

torch.manual_seed(0)
net = streaming_net()
features, head = net[:15], net[15:]
stream = StreamingCNN(features, tile_size=TILE)
print(stream.describe())
images = [load_mosaic("retina", TRAIN_SIDE), load_mosaic("immunohistochemistry", TRAIN_SIDE)]
labels = [torch.tensor([0]), torch.tensor([1])]
print(f"\ntwo {TRAIN_SIDE}×{TRAIN_SIDE} mosaics, {len(stream.tiles((TRAIN_SIDE,) * 2))} tiles each")

# %%
# Training, tile by tile
# ----------------------
# ``stream(x)`` returns the features without keeping any activation; the backward
# pass recomputes each tile and fills the layers' ``.grad`` exactly.

opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
for step in range(STEPS):
    t0 = time.perf_counter()
    opt.zero_grad()
    total = 0.0
    for x, y in zip(images, labels):
        loss = loss_fn(head(stream(x)), y)
        loss.backward()
        total += loss.item()
    opt.step()
    print(f"step {step + 1}: mean loss {total / 2:.4f} ({time.perf_counter() - t0:.1f} s)")

# %%
# Memory: conventional against streamed
# -------------------------------------
# One forward and backward pass of one image per row, each row in a fresh process
# (the runner of ``memconv compare``): ``autograd`` is the conventional pass, and
# ``memconv-streaming`` runs the same network with its leading local layers streamed.
# Peak memory is the increase of the process's resident set size
# (``memory_profiler``) and the PyTorch allocator's peak; the deviation is the largest
# relative difference between the two passes' gradients (float32).

rows = []
for side in SIDES:
    case = {"model": "streaming-net", "batch": 1, "side": side, "tile": TILE, "repeats": 1}
    engines = (
        ["memconv-streaming"] if side > CONVENTIONAL_MAX else ["autograd", "memconv-streaming"]
    )
    for row in measure_engines(case, engines, reference="autograd"):
        rows.append({"side": side, **row})

print(
    f"{'side':>6s} {'pass':>12s} {'peak RSS (MiB)':>15s} {'allocator (MiB)':>16s} {'time (s)':>9s} {'deviation':>10s}"
)
for r in rows:
    mode = "streamed" if r["engine"] == "memconv-streaming" else "conventional"
    if "peak_rss_mib" not in r:
        print(f"{r['side']:6d} {mode:>12s} failed: {r.get('error')}")
        continue
    dev = f"{r['deviation']:.1e}" if len([q for q in rows if q["side"] == r["side"]]) > 1 else ""
    print(
        f"{r['side']:6d} {mode:>12s} {r['peak_rss_mib']:15,.0f} {r['peak_alloc_mib']:16,.0f} "
        f"{r['time_s']:9.1f} {dev:>10s}"
    )

# %%
# The streamed pass's memory is bounded by a tile and its halo plus the streamed
# output and its gradient, while the conventional pass keeps every activation of the
# whole image. In float32 the two passes' gradients differ by round-off (the sums run
# in another order); in float64 they agree to about 1e-15 (see :doc:`/streaming`).

import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6, 3.5))
for mode, color in (("autograd", "tab:blue"), ("memconv-streaming", "tab:red")):
    pts = [
        (r["side"], r["peak_alloc_mib"])
        for r in rows
        if r["engine"] == mode and "peak_alloc_mib" in r
    ]
    if pts:
        ax.plot(
            *zip(*pts),
            "o-",
            color=color,
            label="conventional" if mode == "autograd" else "streamed",
        )
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
