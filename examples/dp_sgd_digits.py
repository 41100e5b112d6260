"""DP-SGD on scikit-learn's handwritten digits, with Opacus alone and with memconv.

A small CNN (Conv2d–GroupNorm–ReLU–MaxPool–Conv2d–GroupNorm–ReLU–AdaptiveAvgPool–
Linear, float32) on the 1,797 8×8 digits upsampled to 16×16 (75 % train, 25 % test,
split fixed by the seed) is trained twice with the same seeds, noise multiplier σ,
clipping threshold C, sampling rate q and learning rate:

(a) **Opacus**: ``PrivacyEngine.make_private(..., grad_sample_mode="hooks",
    poisson_sampling=True)``: per-sample gradients by Opacus' grad samplers, clipping,
    noise and the division by the expected batch size in its ``DPOptimizer``, ε by
    its RDP accountant;
(b) **memconv**: ``memconv.clip_and_accumulate`` for the clipped sum Σₙ min(1, C/‖gₙ‖)·gₙ
    (no per-sample gradient of more than one layer at a time), Gaussian noise of
    standard deviation σ·C, division by the expected batch size, a plain SGD step, and
    ε by Opacus' ``RDPAccountant`` stepped with (σ, q) every step.

Both draw their batches by Poisson sampling (each training sample independently with
probability q = 1/⌈N_train/B⌉, as Opacus' ``DPDataLoader`` does, from the same seeded
generator: the same batches) and their noise from a generator seeded alike, drawn per
parameter as Opacus draws it; the expected batch size is ``int(N_train·q)``. The two
differ only in how the clipped sum is computed (and Opacus' C/(‖g‖+1e-6) stabiliser).

Reported per path: test accuracy, ε at δ = 1e-5, the allocator-level peak memory
increase of one training step (``memconv.bench.measure.peak_allocated``: the PyTorch
profiler's allocation events on the CPU) and the median time per step (forward,
backward, clipping, noise, update).

Usage::

    python examples/dp_sgd_digits.py [--epochs 15] [--batch-size 64]
        [--noise-multiplier 1.5] [--max-grad-norm 1.0] [--lr 1.0] [--seed 0]
        [--max-steps N]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import memconv
from memconv.bench.measure import peak_allocated

DELTA = 1e-5
CPU = torch.device("cpu")


def load_digits_split(seed: int):
    """``(x_train, y_train, x_test, y_test)``: 16×16 float32 images, standardised."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False)
    y = torch.tensor(digits.target, dtype=torch.long)
    train, test = train_test_split(
        np.arange(len(y)), test_size=0.25, random_state=seed, stratify=digits.target
    )
    train, test = torch.as_tensor(train), torch.as_tensor(test)
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def make_model(seed: int) -> nn.Module:
    """The CNN, initialised from ``seed`` (the same weights for both paths)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.GroupNorm(4, 32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def poisson_loader(x, y, batch_size: int, seed: int):
    """Opacus' Poisson-sampling loader over the training set (q = 1/⌈N/B⌉)."""
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(
        TensorDataset(x, y), batch_size=batch_size, generator=torch.Generator().manual_seed(seed)
    )
    return loader, DPDataLoader.from_data_loader(loader)


@torch.no_grad()
def accuracy(model: nn.Module, x, y) -> float:
    model.eval()
    correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


def _train(step, loader, epochs: int, max_steps: int | None):
    """Run ``step(x, y)`` over the loader's batches; the first step is measured with the
    allocator profiler (and left out of the times). Returns (peak MiB, step times)."""
    times, peak, done = [], None, 0
    for _ in range(epochs):
        for xb, yb in loader:
            if max_steps is not None and done >= max_steps:
                return peak, times
            if peak is None:
                peak, _ = peak_allocated(lambda xb=xb, yb=yb: step(xb, yb), CPU)
            else:
                t0 = time.perf_counter()
                step(xb, yb)
                times.append(time.perf_counter() - t0)
            done += 1
    return peak, times


def run_opacus(args, data) -> dict:
    """(a) Opacus alone: PrivacyEngine, grad_sample_mode="hooks", Poisson sampling."""
    from opacus import PrivacyEngine

    x_train, y_train, x_test, y_test = data
    model = make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader, _ = poisson_loader(x_train, y_train, args.batch_size, args.seed)
    engine = PrivacyEngine(accountant="rdp")
    module, dp_optimizer, dp_loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=args.noise_multiplier,
        max_grad_norm=args.max_grad_norm,
        poisson_sampling=True,
        grad_sample_mode="hooks",
        loss_reduction="mean",
        noise_generator=torch.Generator().manual_seed(args.seed + 1),
    )
    criterion = nn.CrossEntropyLoss()

    def step(xb, yb):
        dp_optimizer.zero_grad()
        criterion(module(xb), yb).backward()
        dp_optimizer.step()

    peak, times = _train(step, dp_loader, args.epochs, args.max_steps)
    return {
        "accuracy": accuracy(module, x_test, y_test),
        "epsilon": engine.get_epsilon(DELTA),
        "peak_mib": peak,
        "step_s": statistics.median(times) if times else math.nan,
        "steps": len(times) + 1,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def run_memconv(args, data) -> dict:
    """(b) memconv.clip_and_accumulate + Gaussian noise + SGD, Opacus' RDP accountant."""
    from opacus.accountants import RDPAccountant

    x_train, y_train, x_test, y_test = data
    model = make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader, dp_loader = poisson_loader(x_train, y_train, args.batch_size, args.seed)
    sample_rate = 1 / len(loader)
    expected_batch_size = int(len(x_train) * sample_rate)  # as Opacus divides
    sigma, clip = args.noise_multiplier, args.max_grad_norm
    noise_generator = torch.Generator().manual_seed(args.seed + 1)
    accountant = RDPAccountant()
    loss_fn = nn.CrossEntropyLoss()  # called on one sample at a time

    def step(xb, yb):
        optimizer.zero_grad(set_to_none=True)
        memconv.clip_and_accumulate(model, loss_fn, xb, yb, max_norm=clip)
        for p in model.parameters():  # noise σ·C on the clipped sum, drawn as Opacus draws it
            noise = torch.normal(
                0.0, sigma * clip, size=p.shape, generator=noise_generator, dtype=p.dtype
            )
            p.grad = noise if p.grad is None else p.grad.add_(noise)
            p.grad.div_(expected_batch_size)
        optimizer.step()
        accountant.step(noise_multiplier=sigma, sample_rate=sample_rate)

    peak, times = _train(step, dp_loader, args.epochs, args.max_steps)
    return {
        "accuracy": accuracy(model, x_test, y_test),
        "epsilon": accountant.get_epsilon(DELTA),
        "peak_mib": peak,
        "step_s": statistics.median(times) if times else math.nan,
        "steps": len(times) + 1,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="B; q = 1/ceil(N_train/B)")
    parser.add_argument("--noise-multiplier", type=float, default=1.5, help="sigma")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping threshold C")
    parser.add_argument("--lr", type=float, default=1.0, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop each path after this many steps"
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.max_steps is not None and args.max_steps < 2:
        parser.error("--max-steps must be at least 2 (one measured step and one timed step)")
    if args.noise_multiplier < 0:
        parser.error("--noise-multiplier must be non-negative")
    if not args.max_grad_norm > 0 or not args.lr > 0:
        parser.error("--max-grad-norm and --lr must be positive")
    return args


def main(argv=None) -> dict:
    """Train both ways and print the table; returns ``{path: results}``."""
    args = parse_args(argv)
    data = load_digits_split(args.seed)
    n_train = len(data[0])
    q = 1 / math.ceil(n_train / args.batch_size)
    print(
        f"digits 16×16: {n_train} train / {len(data[2])} test; sigma {args.noise_multiplier}, "
        f"C {args.max_grad_norm}, q {q:.4f} (expected batch {int(n_train * q)}), "
        f"lr {args.lr}, {args.epochs} epochs, seed {args.seed}; cpu, float32, "
        f"{torch.get_num_threads()} threads\n"
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        results = {"Opacus (hooks)": run_opacus(args, data)}
        results["memconv clip_and_accumulate"] = run_memconv(args, data)
    print("| path | test accuracy | ε (δ=1e-5) | peak memory, one step (MiB) | time/step (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {100 * r['accuracy']:.1f} % | {r['epsilon']:.2f} | "
            f"{r['peak_mib']:.2f} | {1000 * r['step_s']:.1f} |"
        )
    return results


if __name__ == "__main__":
    main()
