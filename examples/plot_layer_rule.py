"""
A layer rule for your own layer
===============================

memconv computes per-sample gradients layer by layer. What it knows about a layer
lives in a *rule* (:mod:`memconv.layers`), looked up by the layer's exact type;
a layer without a rule takes the exact generic route (``torch.func`` on the layer's
real arguments). This example takes a weight-standardised convolution — the
convolution of DP ResNets with GroupNorm — first through the generic route, then
registers a rule for it in a few lines, and checks both against a per-sample
autograd loop.
"""

# %%
# A weight-standardised convolution overrides ``forward``, so it is **not** treated
# as ``nn.Conv2d`` (that would be silently wrong): with no rule it takes the generic
# route, which ``memconv.plan`` names.
import time

import torch
from torch import nn

import memconv


class WSConv2d(nn.Conv2d):
    def forward(self, x):
        return self._conv_forward(x, standardise(self.weight), self.bias)


def standardise(w):
    mean = w.mean(dim=(1, 2, 3), keepdim=True)
    return (w - mean) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)


torch.manual_seed(0)
model = nn.Sequential(
    WSConv2d(3, 16, 3, padding=1),
    nn.GroupNorm(4, 16),
    nn.ReLU(),
    WSConv2d(16, 16, 3, padding=1),
    nn.GroupNorm(4, 16),
    nn.ReLU(),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(16, 10),
).double()
x, y = torch.randn(32, 3, 16, 16, dtype=torch.float64), torch.randint(0, 10, (32,))
loss_fn = nn.CrossEntropyLoss()
print("generic route:", memconv.plan(model, x).generic_layers)


def loop_reference():
    """Per-sample gradients by one autograd call per sample (the independent check)."""
    params = list(model.parameters())
    per = [
        torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), params)
        for i in range(len(x))
    ]
    return [torch.stack(g) for g in zip(*per)]


reference = loop_reference()


def check(label):
    memconv.per_sample_grads(model, loss_fn, x, y)  # a warm-up call (torch.func's first)
    start = time.perf_counter()
    grads = memconv.per_sample_grads(model, loss_fn, x, y)
    seconds = time.perf_counter() - start
    error = max(
        float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads.values(), reference)
    )
    print(f"{label:>14}: {seconds:.3f} s, largest relative deviation {error:.1e}")


check("generic route")

# %%
# The rule: the convolution's per-sample gradient with respect to the weight it
# actually used (the standardised one) comes from a memconv strategy
# (``memconv.weight_vjp`` needs only the layer's geometry); the chain rule through
# the standardisation, one sample at a time, gives the weight's. ``grad_sample`` is the
# one method a rule must have: norms, clipped sums and memory come from it.


@memconv.layers.register(WSConv2d)
class WSConv2dRule(memconv.layers.LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        (x,) = inputs
        per_ws = memconv.weight_vjp(module, x, grad_output, per_sample=True)
        _, pullback = torch.func.vjp(standardise, module.weight.detach())
        per_w = torch.func.vmap(lambda g: pullback(g)[0])(per_ws)
        return {"weight": per_w, "bias": grad_output.sum((2, 3))}


print("generic route:", memconv.plan(model, x).generic_layers)
check("registered rule")

# %%
# The same rule now serves every whole-model function: norms, DP-SGD's clipped sum,
# the planner and, once installed, the Opacus bridge.
norms = memconv.per_sample_norms(model, loss_fn, x, y)
print("per-sample gradient norms of the first samples:", norms[:4].tolist())

# %%
# What a rule returns is checked wherever memconv calls it (the keys, the shapes
# ``[N, *parameter.shape]``, the dtype and the device): a rule that forgot the bias
# would give norms without it and, for DP-SGD, a clipped sum above its bound. It is an
# error naming the rule, the layer and the parameter, before anything reaches ``.grad``.


@memconv.layers.register(WSConv2d)
class ForgetfulRule(memconv.layers.LayerRule):
    def grad_sample(self, module, inputs, grad_output):
        return {"weight": WSConv2dRule().grad_sample(module, inputs, grad_output)["weight"]}


try:
    memconv.clip_and_accumulate(model, loss_fn, x, y, max_norm=1.0)
except ValueError as err:
    print("refused:", err)
memconv.layers.unregister(WSConv2d)
