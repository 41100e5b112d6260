"""
Private training in three lines, with Opacus
============================================

The shortest path to DP-SGD with memconv is Opacus' own: install memconv's samplers
into Opacus, let ``PrivacyEngine.make_private`` wrap the model, optimizer and data
loader, and train as usual. Opacus clips, adds noise and keeps the privacy account;
memconv computes each layer's per-sample gradients (convolutions by its strategies,
exact for every padding mode; every layer with a rule in :mod:`memconv.layers`).

The three lines::

    memconv.integrations.opacus.install()
    model, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0)
    ...  # the usual training loop

Here: a small GroupNorm CNN on scikit-learn's handwritten digits, with a progress bar
that shows ε (at δ = 1e-5) from Opacus' accountant as training goes. The gallery runs
four epochs; ``MEMCONV_FULL=1`` runs fifteen. The hand-written loop with
:func:`memconv.clip_and_accumulate` (no Opacus wrapper, memory bounded by
``memory_budget``) is the second path, in :doc:`/dp_sgd`.
"""

import os
import sys
import warnings

import torch
from opacus import PrivacyEngine
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import memconv
from memconv.integrations import opacus as mo

EPOCHS = 15 if os.environ.get("MEMCONV_FULL") else 4
DELTA = 1e-5
torch.manual_seed(0)
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")  # a demo, not production
warnings.filterwarnings("ignore", message=".*(torch.jit|script_method).*")
warnings.filterwarnings("ignore", message="Full backward hook is firing")

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # [N, 1, 8, 8]
images = (images - images.mean()) / images.std()  # standardised
labels = torch.tensor(digits.target)
train = TensorDataset(images[:1400], labels[:1400])
test_x, test_y = images[1400:], labels[1400:]

model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1, padding_mode="replicate"),  # Opacus alone gets this wrong
    nn.GroupNorm(4, 16),
    nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1),
    nn.GroupNorm(4, 32),
    nn.ReLU(),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(32, 10),
)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
loader = DataLoader(train, batch_size=64)

# %%
# The three lines
# ---------------

mo.install()  # memconv's grad and norm samplers in Opacus' registries
engine = PrivacyEngine()
model, optimizer, loader = engine.make_private(
    module=model, optimizer=optimizer, data_loader=loader,
    noise_multiplier=1.0, max_grad_norm=1.0,
)  # fmt: skip

loss_fn = nn.CrossEntropyLoss()
for epoch in range(EPOCHS):
    bar = tqdm(loader, desc=f"epoch {epoch + 1}", file=sys.stdout, ncols=80, mininterval=5)
    for x, y in bar:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # per-sample gradients by memconv's rules
        optimizer.step()  # Opacus clips, adds noise, steps
        bar.set_postfix(
            loss=f"{loss.item():.2f}", eps=f"{engine.get_epsilon(DELTA):.2f}", refresh=False
        )

# %%
# The result
# ----------
# Accuracy on the 397 held-out digits, and the privacy spent.

with torch.no_grad():
    accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
print(f"test accuracy {accuracy:.3f} after {EPOCHS} epochs, ε = {engine.get_epsilon(DELTA):.2f}")
used = [type(m).__name__ for m in model.modules() if type(m) in mo.classes()]
print("layers whose per-sample gradients came from memconv's rules:", ", ".join(used))
mo.uninstall()  # Opacus' own registries, exactly as before
print("memconv", memconv.__version__)
