"""
Per-sample gradients on real images
===================================

Per-sample gradients — the gradient of each sample's own loss — are what
differentially private training clips, what gradient-variance and data-attribution
methods read, and what ``torch.func.vmap(grad(...))`` computes. memconv computes them
in one ordinary forward and backward pass.

Here a small CNN sees crops of four real pictures bundled with scikit-image (an
astronaut, a retina, a stained tissue section, the Hubble deep field). We compute the
per-sample gradients with memconv and with torch.func, check that they agree, compare
their memory, and look at which samples have large gradients.
"""

import os
import time

import numpy as np
import skimage.data
import torch
from torch import nn

import memconv
from memconv.bench.measure import peak_allocated

FULL = os.environ.get("MEMCONV_FULL", "") not in ("", "0")
torch.manual_seed(0)

# %%
# Real images
# -----------
# Random RGB crops of four pictures; the label is the picture a crop comes from.

PICTURES = ("astronaut", "retina", "immunohistochemistry", "hubble_deep_field")
PER_PICTURE, SIDE = (32, 96) if FULL else (6, 48)
gen = np.random.default_rng(0)
crops, labels = [], []
for label, name in enumerate(PICTURES):
    img = getattr(skimage.data, name)()[..., :3].astype(np.float32) / 255.0
    for _ in range(PER_PICTURE):
        r = gen.integers(0, img.shape[0] - SIDE)
        c = gen.integers(0, img.shape[1] - SIDE)
        crops.append(img[r : r + SIDE, c : c + SIDE])
        labels.append(label)
x = torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).contiguous()
x = (x - x.mean()) / x.std()
y = torch.tensor(labels)
print(f"batch: {tuple(x.shape)}, labels: {torch.bincount(y).tolist()} per picture")

# %%
# A small CNN, and the per-sample gradients
# -----------------------------------------
# ``memconv.per_sample_grads`` returns ``{parameter name: [N, *shape]}``. The strategy
# for the convolutions' weight gradients is ``"auto"`` unless given.

model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Conv2d(32, 64, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Conv2d(64, 64, 3, padding=1),
    nn.ReLU(),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(64, len(PICTURES)),
)
loss_fn = nn.CrossEntropyLoss()

grads = memconv.per_sample_grads(model, loss_fn, x, y)
print(f"{'parameter':10s} per-sample gradient shape [N, *parameter.shape]")
for name, g in grads.items():
    print(f"{name:10s} {tuple(g.shape)}")

# %%
# The same numbers as torch.func
# ------------------------------


def torch_func_grads(model, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of_one(p, xi, yi):
        return loss_fn(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    return torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)


reference = torch_func_grads(model, x, y)
worst = max(((grads[k] - v).abs().max() / v.abs().max()).item() for k, v in reference.items())
print(f"largest relative deviation from torch.func: {worst:.1e}")

# %%
# Memory and time
# ---------------
# The allocator-level peak while each call runs (the PyTorch profiler's allocation
# events, on the CPU), the result included, and the median time of three runs. At
# this page's small batch the times are a few tenths of a second and vary from run
# to run on a shared machine; the memory figures do not.


def measure(fn):
    peak, _ = peak_allocated(fn, torch.device("cpu"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return peak, sorted(times)[1]


result_mib = sum(g.numel() * g.element_size() for g in grads.values()) / 2**20
print(f"per-sample result: {result_mib:.1f} MiB")
print(f"{'method':34s} {'allocator peak (MiB)':>21s} {'time (s)':>9s}")
for label, fn in {
    "torch.func vmap(grad)": lambda: torch_func_grads(model, x, y),
    "memconv.per_sample_grads (auto)": lambda: memconv.per_sample_grads(model, loss_fn, x, y),
    "memconv.per_sample_grads (rochette)": lambda: memconv.per_sample_grads(
        model, loss_fn, x, y, strategy="rochette"
    ),
}.items():
    peak, seconds = measure(fn)
    print(f"{label:34s} {peak:21.1f} {seconds:9.3f}")

# %%
# Norms without per-sample gradients
# ----------------------------------
# ``memconv.per_sample_norms`` gives each sample's gradient norm without holding the
# per-sample gradients of more than one layer; it agrees with the norms of the
# gradients above.

norms = memconv.per_sample_norms(model, loss_fn, x, y)
from_grads = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
print(
    f"largest relative difference of the norms: {((norms - from_grads).abs().max() / from_grads.max()).item():.1e}"
)

# %%
# Which samples pull hardest?
# ---------------------------
# The crops with the largest gradient norm, and the norms per picture. An untrained
# network finds some pictures easier to tell apart than others.

import matplotlib.pyplot as plt  # noqa: E402

order = torch.argsort(norms, descending=True)
fig = plt.figure(figsize=(10, 4.2))
grid = fig.add_gridspec(2, 6)
for i, n in enumerate(order[:6].tolist()):
    ax = fig.add_subplot(grid[0, i])
    ax.imshow(np.clip(crops[n], 0, 1))
    ax.set_title(f"{PICTURES[labels[n]][:12]}\n‖g‖ = {norms[n]:.2f}", fontsize=8)
    ax.axis("off")
ax = fig.add_subplot(grid[1, :])
colors = plt.cm.tab10(y.numpy())
ax.bar(
    range(len(norms)),
    norms[torch.argsort(y, stable=True)].numpy(),
    color=colors[np.argsort(y.numpy(), kind="stable")],
)
ax.set_xlabel("sample (grouped by picture: " + ", ".join(PICTURES) + ")", fontsize=8)
ax.set_ylabel("per-sample gradient norm")
fig.tight_layout()

if "MEMCONV_GALLERY" not in os.environ:  # run as a script: keep the figure, show it if possible
    fig.savefig("plot_per_sample_real_images.png", dpi=120)
    print("figure saved to plot_per_sample_real_images.png")
    if plt.get_backend().lower() != "agg":
        plt.show()
