"""
Private training of a residual CNN, with Opacus and memconv
===========================================================

DP-SGD with Opacus' privacy engine and memconv's clipped sum:
:func:`memconv.integrations.opacus.make_private` returns what Opacus'
``PrivacyEngine.make_private`` returns — a model, a DP optimizer and a Poisson-sampling
data loader — and the training loop stays the usual one. Opacus keeps the accountant,
the noise, the sampling and the optimizer; each sample's gradient is clipped by
memconv's own pass (:func:`memconv.clip_and_accumulate`), not by module hooks, so the
model may be written as torchvision writes its blocks: ``ReLU(inplace=True)`` and
``out += identity`` (Opacus' hooks refuse both: "Output 0 of BackwardHookFunction is a
view and is being modified inplace").

The three lines::

    from memconv.integrations import opacus as mo
    model, optimizer, loader = mo.make_private_with_epsilon(
        PrivacyEngine(), module=model, optimizer=optimizer, data_loader=loader,
        target_epsilon=3.0, target_delta=1e-5, epochs=EPOCHS, max_grad_norm=1.0)
    ...  # the usual loop: criterion(model(x), y).backward(); optimizer.step()

Here: a small ResNet (GroupNorm) on scikit-learn's handwritten digits, resized to
16×16, trained to ε = 3 at δ = 1e-5, with ε from Opacus' accountant on the progress
bar. The gallery runs 4 epochs; ``MEMCONV_FULL=1`` runs 15.
"""

import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import memconv
from memconv.integrations import opacus as mo

EPOCHS = int(os.environ.get("MEMCONV_EPOCHS", 15 if os.environ.get("MEMCONV_FULL") else 4))
EPSILON, DELTA = 3.0, 1e-5
torch.manual_seed(0)
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")  # a demo, not production

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
images = F.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False)
labels = torch.tensor(digits.target)
train, test = train_test_split(
    np.arange(len(labels)), test_size=0.25, random_state=0, stratify=digits.target
)
mean, std = images[train].mean(), images[train].std()
images = (images - mean) / std
test_x, test_y = images[test], labels[test]

# %%
# A residual CNN as torchvision writes it
# ---------------------------------------
# torchvision's ``BasicBlock``, with GroupNorm for BatchNorm (samples stay independent):
# one ``ReLU(inplace=True)`` module used twice, and the shortcut added in place.


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.GroupNorm(4, c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.GroupNorm(4, c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.GroupNorm(4, c_out)
            )

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1, bias=False),
    nn.GroupNorm(4, 16),
    nn.ReLU(inplace=True),
    nn.MaxPool2d(2),
    BasicBlock(16, 16),
    BasicBlock(16, 32),
    nn.AdaptiveAvgPool2d(4),
    nn.Flatten(),
    nn.Linear(32 * 4 * 4, 10),
)
for block in (model[4], model[5]):  # torchvision's zero_init_residual=True
    nn.init.zeros_(block.bn2.weight)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
loader = DataLoader(TensorDataset(images[train], labels[train]), batch_size=64)

# %%
# The three lines, then the usual loop
# ------------------------------------

engine = PrivacyEngine()
model, optimizer, loader = mo.make_private_with_epsilon(
    engine,
    module=model,
    optimizer=optimizer,
    data_loader=loader,
    target_epsilon=EPSILON,
    target_delta=DELTA,
    epochs=EPOCHS,
    max_grad_norm=1.0,
    memory_budget=None,  # a small model: one pass, no memory planning per step
)
print(f"noise multiplier {optimizer.noise_multiplier:.2f} for ε = {EPSILON} in {EPOCHS} epochs")

criterion = nn.CrossEntropyLoss()
for epoch in range(EPOCHS):
    bar = tqdm(loader, desc=f"epoch {epoch + 1}", file=sys.stdout, ncols=80, mininterval=5)
    for x, y in bar:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()  # memconv: each sample's gradient clipped, summed into .grad
        optimizer.step()  # Opacus: noise, scaling, the step, the accountant
        bar.set_postfix(
            loss=f"{loss.item():.2f}", eps=f"{engine.get_epsilon(DELTA):.2f}", refresh=False
        )

# %%
# The result
# ----------
# Accuracy on the 450 held-out digits, and the privacy spent.

model.eval()
with torch.no_grad():
    accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
print(f"test accuracy {accuracy:.3f} after {EPOCHS} epochs, ε = {engine.get_epsilon(DELTA):.2f}")
print("memconv", memconv.__version__)
