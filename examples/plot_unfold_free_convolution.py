"""
A convolution without unfolding: one matrix product per kernel offset
=====================================================================

The textbook way to turn a convolution into a matrix product is im2col
(``torch.nn.functional.unfold``): copy every input patch into a column, K = kh·kw
times the input, then multiply by the weight matrix. The copy is avoidable. For each
kernel offset (i, j), the input positions that offset meets form a *view* of the
padded input, and the output is the sum over the K offsets of ``w[:, :, i, j] @
view``. With stride 1, each view is even a contiguous window of the padded input laid
out as one flat row per channel: a matrix that BLAS reads as it is, with no copy.

memconv's ``"shift"`` strategy computes the weight gradient of a convolution this way;
this example shows the idea on the forward pass, on a real photograph, checks it
against ``F.conv2d`` and times it against it and against im2col.
"""

import os
import time

import numpy as np
import skimage.data
import torch
import torch.nn.functional as F

from memconv.bench.measure import peak_allocated

FULL = os.environ.get("MEMCONV_FULL", "") not in ("", "0")
torch.manual_seed(0)

# %%
# One matrix product per kernel offset
# ------------------------------------
# The padded input is written once into a flat buffer ``[N·C_in·Hp·Wp + spill]``. The
# output is computed on the padded grid's rows, ``[N, C_out, Ho·Wp]`` (the ``Wp − Wo``
# extra columns of each row are dropped at the end), and for offset (i, j) the matching
# input is the window that starts ``i·Wp + j`` elements into each channel's row: a
# strided view, ``[N, C_in, Ho·Wp]`` with unit stride along the row.


def conv2d_shift(x: torch.Tensor, w: torch.Tensor, padding: int) -> torch.Tensor:
    """``F.conv2d(x, w, padding=padding)`` (stride 1, no groups) by K batched products."""
    n, c_in, h, wd = x.shape
    c_out, _, kh, kw = w.shape
    hp, wp = h + 2 * padding, wd + 2 * padding
    ho, wo = hp - kh + 1, wp - kw + 1
    plane, length = hp * wp, ho * wp
    buffer = x.new_zeros(n * c_in * plane + kw - 1)  # spill: the last window runs past the end
    buffer[: n * c_in * plane].view(n, c_in, hp, wp)[
        :, :, padding : padding + h, padding : padding + wd
    ] = x
    out = x.new_zeros(n, c_out, length)
    for i in range(kh):
        for j in range(kw):
            window = buffer.as_strided((n, c_in, length), (c_in * plane, plane, 1), i * wp + j)
            out.baddbmm_(w[:, :, i, j].expand(n, c_out, c_in), window)  # out += w_ij @ window
    return out.view(n, c_out, ho, wp)[..., :wo]


def conv2d_im2col(x: torch.Tensor, w: torch.Tensor, padding: int) -> torch.Tensor:
    """The same through the unfolded input ``[N, C_in·K, Ho·Wo]``."""
    n, _, h, wd = x.shape
    c_out, _, kh, kw = w.shape
    cols = F.unfold(x, (kh, kw), padding=padding)
    out = w.reshape(c_out, -1) @ cols
    return out.view(n, c_out, h + 2 * padding - kh + 1, wd + 2 * padding - kw + 1)


# %%
# On a real photograph
# --------------------
# Crops of scikit-image's astronaut photograph, through a 5×5 convolution with 32
# output channels, then a 3×3 one from 32 to 64 channels on the first one's output —
# the shapes of a first and a hidden layer.

N, SIDE = (8, 512) if FULL else (2, 160)
img = torch.from_numpy(skimage.data.astronaut().astype(np.float32) / 255.0).permute(2, 0, 1)
x = torch.stack([img[:, 20 * i : 20 * i + SIDE, 30 * i : 30 * i + SIDE] for i in range(N)])
x = (x - x.mean()) / x.std()
layers = {
    "5×5, 3 → 32": (x, torch.randn(32, 3, 5, 5) / 75**0.5, 2),
}
hidden = F.relu(F.conv2d(x, layers["5×5, 3 → 32"][1], padding=2))
layers["3×3, 32 → 64"] = (hidden, torch.randn(64, 32, 3, 3) / 288**0.5, 1)

# %%
# Same numbers, time and memory
# -----------------------------
# Deviation: the largest absolute difference from ``F.conv2d`` over its largest
# entry. Time: median of three runs after a warm-up. Memory: the PyTorch allocator's
# peak while one call runs (the profiler's allocation events), the output included.


def median_time(fn, repeats=3):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


results = []
print(f"input batch {N} × {SIDE}×{SIDE}, float32, {torch.get_num_threads()} threads\n")
print(f"{'layer':14s} {'method':22s} {'deviation':>9s} {'time (ms)':>10s} {'peak (MiB)':>11s}")
for name, (inp, w, p) in layers.items():
    reference = F.conv2d(inp, w, padding=p)
    for method, fn in (
        ("F.conv2d", F.conv2d),
        ("im2col + matmul", conv2d_im2col),
        ("matmul per offset", conv2d_shift),
    ):
        if method == "F.conv2d":
            call = lambda fn=fn, inp=inp, w=w, p=p: fn(inp, w, padding=p)  # noqa: E731
        else:
            call = lambda fn=fn, inp=inp, w=w, p=p: fn(inp, w, p)  # noqa: E731
        out = call()
        dev = ((out - reference).abs().max() / reference.abs().max()).item()
        seconds = median_time(call)
        peak, _ = peak_allocated(call, torch.device("cpu"))
        results.append((name, method, seconds, peak))
        print(f"{name:14s} {method:22s} {dev:9.1e} {1e3 * seconds:10.1f} {peak:11.1f}")
    out_mib = reference.numel() * 4 / 2**20
    cols_mib = inp.numel() * w.shape[2] * w.shape[3] * 4 / 2**20
    print(f"{'':14s} (output {out_mib:.1f} MiB; the unfolded input alone {cols_mib:.1f} MiB)\n")

# %%
# The products per offset need no unfolded input: their memory is the output plus
# one padded copy of the input, while im2col's grows with K. Whether they are also
# faster than ``F.conv2d`` depends on the layer and on the backend's own algorithm
# (oneDNN on CPUs); the weight-gradient version of the same idea is memconv's
# ``"shift"`` strategy (:doc:`/strategies/shift`).

import matplotlib.pyplot as plt  # noqa: E402

fig, axes = plt.subplots(1, 2, figsize=(10, 3))
for ax, (value, label) in zip(axes, ((2, "time (ms)"), (3, "allocator peak (MiB)"))):
    names = list(layers)
    methods = ["F.conv2d", "im2col + matmul", "matmul per offset"]
    for k, method in enumerate(methods):
        vals = [next(r for r in results if r[0] == n and r[1] == method)[value] for n in names]
        vals = [1e3 * v for v in vals] if value == 2 else vals
        ax.bar(np.arange(len(names)) + 0.27 * (k - 1), vals, width=0.27, label=method)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(label)
axes[0].legend(fontsize=8)
fig.tight_layout()

if "MEMCONV_GALLERY" not in os.environ:  # run as a script: keep the figure, show it if possible
    fig.savefig("plot_unfold_free_convolution.png", dpi=120)
    print("figure saved to plot_unfold_free_convolution.png")
    if plt.get_backend().lower() != "agg":
        plt.show()
