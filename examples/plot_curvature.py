"""
KFAC-preconditioned training of a CNN with a depthwise convolution
===================================================================

BackPACK's ``KFAC`` extension gives each layer's weight a Kronecker-factored
approximation ``A ⊗ Ω`` of its Fisher (Martens & Grosse 2015; Grosse & Martens 2016 for
convolutions): ``A`` from the output gradients, ``Ω`` the second moment of the layer's
unfolded input. BackPACK 1.7.1 forms that unfolded input (K = 9 times the layer input
for a 3×3 kernel) and refuses grouped convolutions, such as the depthwise ones of
MobileNet and ConvNeXt. memconv's module extensions
(:mod:`memconv.integrations.backpack.kronecker`) compute the same factors without the
unfolded input, and grouped ones as block-diagonal factors per group.

Here a small CNN with a depthwise convolution is trained on scikit-learn's handwritten
digits (8×8 images) with natural-gradient steps preconditioned by KFAC,
``ΔW = −η (A + λI)⁻¹ ∇W (Ω + λI)⁻¹``, next to plain SGD with the same step count
(each with a learning rate that works for it; no tuning beyond that).
The gallery runs 3 epochs; ``MEMCONV_FULL=1`` runs 15.
"""

import os

import torch
from backpack import backpack, extend, extensions
from sklearn.datasets import load_digits
from torch import nn

from memconv.integrations.backpack.kronecker import module_extension

FULL = os.environ.get("MEMCONV_FULL", "") not in ("", "0")
EPOCHS = 15 if FULL else 3
torch.set_num_threads(1)  # small tensors: threads would only contend
torch.manual_seed(0)

# %%
# The data and the model
# ----------------------
# 1,797 digits, 1,500 for training; a 3×3 convolution, a depthwise 3×3 convolution
# (``groups=16``), a 1×1 convolution, an adaptive average pooling (which BackPACK's
# KFAC has no module extension for either) and a Linear layer.

digits = load_digits()
X = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target)
X_train, y_train, X_test, y_test = X[:1500], y[:1500], X[1500:], y[1500:]


def make_model():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16),  # depthwise
        nn.ReLU(),
        nn.Conv2d(16, 32, 1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 10),
    )


# %%
# BackPACK alone refuses the depthwise convolution
# ------------------------------------------------

model = extend(make_model())
lossfunc = extend(nn.CrossEntropyLoss())
try:
    with backpack(extensions.KFAC()):
        lossfunc(model(X_train[:32]), y_train[:32]).backward()
except NotImplementedError as err:
    print("BackPACK alone:", err)

# %%
# memconv's module extensions
# ---------------------------
# Given to the extension object with BackPACK's own ``set_module_extension``; the
# grouped layer's factors have one block per group: ``A [G, C_out/G, C_out/G]`` and
# ``Ω [G, C_in/G·9, C_in/G·9]``.


def kfac_extension():
    ext = extensions.KFAC()
    for cls in (nn.Conv2d, nn.AdaptiveAvgPool2d):
        ext.set_module_extension(cls, module_extension(ext, cls), overwrite=True)
    return ext


model = extend(make_model())
with backpack(kfac_extension()):
    lossfunc(model(X_train[:32]), y_train[:32]).backward()
for name, p in model.named_parameters():
    shapes = [tuple(f.shape) for f in p.kfac]
    print(f"{name:10s} {str(tuple(p.shape)):16s} KFAC factors {shapes}")

# %%
# The preconditioned step
# -----------------------
# For a weight with factors ``[A, Ω]`` the step solves with both damped factors
# (grouped: per group); a bias has one factor.


def precondition(p, damping):
    factors = p.kfac
    grad = p.grad
    if len(factors) == 1:
        (a,) = factors
        eye = torch.eye(a.shape[-1])
        return torch.linalg.solve(a + damping * eye, grad)
    a, omega = factors
    if a.dim() == 2:  # one block: [C_out, C_out] and [C_in·K, C_in·K]
        a, omega = a[None], omega[None]
    groups = a.shape[0]
    g = grad.reshape(groups, a.shape[1], omega.shape[1])
    eye_a, eye_o = torch.eye(a.shape[1]), torch.eye(omega.shape[1])
    left = torch.linalg.solve(a + damping * eye_a, g)
    step = torch.linalg.solve(omega + damping * eye_o, left.transpose(1, 2)).transpose(1, 2)
    return step.reshape(grad.shape)


def train(kfac: bool, lr: float, damping: float = 0.1, batch: int = 64):
    torch.manual_seed(2)
    model = extend(make_model())
    ext = kfac_extension()
    history = []
    for _ in range(EPOCHS):
        order = torch.randperm(len(X_train))
        for i in range(0, len(order), batch):
            idx = order[i : i + batch]
            model.zero_grad()
            loss = lossfunc(model(X_train[idx]), y_train[idx])
            if kfac:
                with backpack(ext):
                    loss.backward()
            else:
                loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * (precondition(p, damping) if kfac else p.grad)
        with torch.no_grad():
            accuracy = (model(X_test).argmax(1) == y_test).float().mean().item()
            history.append((loss.item(), accuracy))
    return history


sgd = train(kfac=False, lr=0.5)
kfac = train(kfac=True, lr=0.2)
print(f"{'epoch':>5s} {'SGD loss':>9s} {'SGD acc':>8s} {'KFAC loss':>10s} {'KFAC acc':>9s}")
for epoch, ((ls, acc_s), (lk, acc_k)) in enumerate(zip(sgd, kfac), 1):
    print(f"{epoch:5d} {ls:9.3f} {acc_s:8.3f} {lk:10.3f} {acc_k:9.3f}")

# %%
# The factors are BackPACK's wherever BackPACK computes them (float64, 1e-10
# relative, ``tests/test_kronecker.py``); the grouped and circular-padded cases are
# checked against the unfolded input and the exact GGN of torch.func. The memory of the
# factors on All-CNN-C, against BackPACK and curvlinops, is on the
# :doc:`Curvature page </curvature>`.
