"""
Saving memory in convolutions, with memconv's strategies
=========================================================

BackPACK's example "Saving memory in convolutions" switches the algorithm that
computes the weight gradient of ``torch.nn.Conv2d`` inside its ``BatchGrad``
extension, from the default one to the memory-saving one of Rochette et al. (2019),
and compares peak memory, run time and the individual gradients of both.

Here the same CNN and the same measurements run for BackPACK's two algorithms and
for BackPACK's ``BatchGrad`` with memconv's strategies, by changing one context
manager::

    with memconv.save_memory("shift"), backpack(extensions.BatchGrad()):
        loss = lossfunc(model(X), y)
    loss.backward()

The data are real handwritten digits (scikit-learn's, resized to 28×28) instead of
MNIST, which would need a download. Every configuration runs in a fresh Python
process (the runner of ``memconv compare``), so that one configuration's memory
never shows in another's peak.

This page ran a small batch; ``MEMCONV_FULL=1`` runs BackPACK's sizes (a batch of 64,
every strategy, three timed runs).
"""

import os

import memconv
from memconv.bench.cases import describe
from memconv.bench.runner import measure_engines

FULL = os.environ.get("MEMCONV_FULL", "") not in ("", "0")

# %%
# The setup
# ---------
# The CNN of BackPACK's example (four 3×3 convolutions with 128, 256, 64 and 32
# channels, max-pooling, a Linear layer) on a batch of real digits. Each row below is
# one engine of ``memconv.bench``: BackPACK's ``BatchGrad`` with its default
# algorithm, with ``weight_jac_t_save_memory(save_memory=True)``, and with memconv's
# strategies installed through ``memconv.integrations.backpack``.

case = {
    "model": "seed",
    "batch": 64 if FULL else 16,
    "side": 28,
    "data": "digits",
    "repeats": 3 if FULL else 1,
    "alloc": FULL,  # the allocator-level peak too (slower: the profiler records every allocation)
}
strategies = memconv.available_strategies() if FULL else ("shift", "auto")
labels = {
    "backpack": "BackPACK save_memory=False",
    "backpack-save-memory": "BackPACK save_memory=True",
}
labels.update({f"memconv-backpack:{s}": f"memconv.save_memory({s!r})" for s in strategies})
print(describe(case), "(digits), BatchGrad, cpu, float32")

# %%
# Peak memory and run time
# ------------------------
# Peak memory is the increase of the resident set size of each fresh process while
# the individual gradients are computed (``memory_profiler``, as BackPACK's example
# measures it); run time is the median of the timed runs after a warm-up. This page
# made one timed run per configuration at a small batch, so its run times are rough;
# ``MEMCONV_FULL=1`` makes three at BackPACK's batch of 64.

# torch.func's per-sample gradients run first: every row is compared with them
rows = [
    {**row, "engine": labels[row["engine"]]}
    for row in measure_engines(case, ["torch.func", *labels])
    if row["engine"] in labels
]
print(f"{'configuration':34s} {'peak memory (MiB)':>18s} {'run time (s)':>13s}")
for row in rows:
    if "peak_rss_mib" not in row:
        print(f"{row['engine']:34s} {row.get('error') or row.get('skipped')}")
        continue
    print(f"{row['engine']:34s} {row['peak_rss_mib']:18,.1f} {row['time_s']:13.3f}")

# %%
# The same individual gradients?
# -------------------------------
# Every configuration must give the same individual gradients, as BackPACK's example
# checks for its two algorithms. Each row's deviation is the largest
# ``max|g - g_ref| / max|g_ref|`` over the parameters, against torch.func's
# ``vmap(grad(loss))`` (float32, so round-off of about 1e-6 is expected).

for row in rows:
    if "deviation" in row:
        print(f"{row['engine']:34s} {row['deviation']:.1e}")

# %%
# The comparison, drawn
# ---------------------

import matplotlib.pyplot as plt  # noqa: E402

measured = [r for r in rows if "peak_rss_mib" in r]
fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 0.45 * len(measured) + 1.5))
labels = [r["engine"] for r in measured]
colors = ["tab:blue" if r["engine"].startswith("BackPACK") else "tab:red" for r in measured]
ax_mem.barh(labels, [r["peak_rss_mib"] for r in measured], color=colors)
ax_mem.set_xlabel("peak memory increase (MiB)")
ax_mem.invert_yaxis()
ax_time.barh(labels, [r["time_s"] for r in measured], color=colors)
ax_time.set_xlabel("run time (s)")
ax_time.invert_yaxis()
ax_time.set_yticklabels([])
fig.suptitle(f"BatchGrad on {describe(case)}")
fig.tight_layout()

if "MEMCONV_GALLERY" not in os.environ:  # run as a script: keep the figure, show it if possible
    fig.savefig("plot_backpack_save_memory.png", dpi=120)
    print("figure saved to plot_backpack_save_memory.png")
    if plt.get_backend().lower() != "agg":
        plt.show()

# %%
# Reading it: BackPACK's default algorithm repeats the output gradient C_in/G times
# (the ``"standard"`` strategy computes the same); ``"rochette"`` is BackPACK's
# ``save_memory=True``; ``"shift"`` needs no repeat and no im2col matrix, and
# ``"auto"`` picks per layer. The strategies are described in
# :doc:`/strategies/index`.
