"""
Releasing activation memory during a custom backward pass
=========================================================

A custom ``torch.autograd.Function`` that can recompute its input from its output
(an invertible layer) does not need to keep that input until the backward pass. But
``del x`` in Python frees nothing: the autograd graph still holds the tensor, through
the ``save_for_backward`` of this layer or of the layer that produced it. What does
release the memory is emptying the tensor's *storage* —
``x.untyped_storage().resize_(0)`` — and refilling it in the backward pass, which is
what memory-saving libraries for invertible networks (MemCNN, for one) do.

This example measures both, as the resident set size (RSS) of this process. The
tensors are large (64 MiB, 512 MiB with ``MEMCONV_FULL=1``), so the C library maps
them directly from the operating system and gives their pages back the moment they
are freed: RSS then follows the tensors exactly, to the page.

To train reversible networks this way, use :mod:`memconv.reversible`
(:doc:`/reversible`): its ``InvertibleModuleWrapper`` releases a block's input without
emptying any storage in place, checks the inverse, and runs with
``torch.autograd.grad``, ``DistributedDataParallel`` and memconv's per-sample functions.
"""

import gc
import os

import torch
from memory_profiler import memory_usage

FULL = os.environ.get("MEMCONV_FULL", "") not in ("", "0")
MIB = 512 if FULL else 64
SHAPE = (MIB * 2**20 // 4 // (16 * 256 * 256), 16, 256, 256)  # float32, MIB MiB


def rss_mib() -> float:
    """The resident set size of this process now, in MiB."""
    gc.collect()
    return memory_usage(-1, interval=0.01, timeout=0.02, max_usage=True)


# %%
# An invertible layer
# -------------------
# ``y = x · w`` with one positive scale per channel: its backward pass needs ``x`` for
# the gradient of ``w`` (``Σ g · x``), and ``x = y / w`` can be recomputed from the
# output. The first version keeps ``x`` the usual way.


class Scale(torch.autograd.Function):
    """``x · w[None, :, None, None]``, keeping ``x`` for the backward pass."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w[None, :, None, None]

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w[None, :, None, None], (g * x).sum((0, 2, 3))


# %%
# The second frees ``x``'s storage at the end of the forward pass and refills it from
# the output in the backward pass, before anything reads it. The tensor object, its
# shape and its place in the graph stay; only its memory goes and comes back.


class ScaleReleasing(torch.autograd.Function):
    """``x · w``, releasing ``x``'s memory until the backward pass recomputes it."""

    @staticmethod
    def forward(ctx, x, w):
        y = x * w[None, :, None, None]
        ctx.save_for_backward(w, y)
        ctx.x = x  # the tensor object only: its storage is emptied below
        ctx.nbytes = x.untyped_storage().nbytes()
        x.untyped_storage().resize_(0)
        return y

    @staticmethod
    def backward(ctx, g):
        w, y = ctx.saved_tensors
        x = ctx.x
        x.untyped_storage().resize_(ctx.nbytes)  # give the input its memory back ...
        with torch.no_grad():
            x.copy_(y / w[None, :, None, None])  # ... and its values
        del ctx.x
        return g * w[None, :, None, None], (g * x).sum((0, 2, 3))


# %%
# ``del`` frees nothing
# ---------------------
# ``x`` is an activation: the output of an earlier operation whose input requires a
# gradient. After the layer's forward pass, deleting the Python name ``x`` leaves the
# memory in use, because the graph (here, ``Scale``'s ``save_for_backward``) holds the
# tensor.


def run(layer, release_name: bool):
    torch.manual_seed(0)
    a = torch.randn(SHAPE, requires_grad=True)
    w = (torch.rand(SHAPE[1]) + 0.5).requires_grad_()
    base = rss_mib()
    x = a * 2.0  # an activation: MIB MiB
    after_x = rss_mib()
    y = layer.apply(x, w)
    after_forward = rss_mib()
    if release_name:
        del x
    after_del = rss_mib()
    y.pow(2).sum().backward()
    return {
        "x": after_x - base,
        "forward": after_forward - base,
        "del": after_del - base,
        "grads": (a.grad.clone(), w.grad.clone()),
    }


kept = run(Scale, release_name=True)
released = run(ScaleReleasing, release_name=False)

print(f"activation x: {MIB} MiB, float32 {tuple(SHAPE)}")
print(f"{'RSS increase over the step (MiB)':44s} {'keeps x':>9s} {'releases x':>11s}")
print(f"{'after x = a * 2':44s} {kept['x']:9.0f} {released['x']:11.0f}")
print(f"{'after y = layer(x)':44s} {kept['forward']:9.0f} {released['forward']:11.0f}")
print(
    f"{'after del x (keeps x) / nothing (releases x)':44s} {kept['del']:9.0f} {released['del']:11.0f}"
)

# %%
# With ``Scale``, ``del x`` changes nothing: ``x`` and ``y`` both stay
# (about 2 × MIB). With ``ScaleReleasing``, the forward pass ends holding ``y`` only
# — ``x``'s storage was emptied although the graph still references the tensor.
#
# Same gradients
# --------------

ga, gw = kept["grads"]
ra, rw = released["grads"]
print(
    f"largest relative difference, input gradient:  {((ga - ra).abs().max() / ga.abs().max()).item():.1e}"
)
print(
    f"largest relative difference, weight gradient: {((gw - rw).abs().max() / gw.abs().max()).item():.1e}"
)

# %%
# The recomputed ``x = y / w`` differs from the original by float32 round-off only.
# What to keep in mind when doing this:
#
# - every operation that saved ``x`` for its own backward pass must run its backward
#   *after* the storage is refilled (here ``a * 2.0`` saved nothing; an operation
#   such as ``relu`` saves its output and would read the refilled values, since the
#   later layer's backward pass runs first);
# - no other code may read ``x`` between the forward and the backward pass;
# - ``x._version`` does not change, so autograd cannot detect misuse: this is a tool
#   for layer authors, not a switch for users. memconv's own memory savings
#   (:doc:`/strategies/index`, :class:`memconv.streaming.StreamingCNN`,
#   :class:`memconv.reversible.InvertibleModuleWrapper`) need no such trick.
