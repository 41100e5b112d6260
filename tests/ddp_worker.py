"""What each rank of :mod:`test_distributed` runs (2 gloo processes on this machine).

Models, data and the split of the batch over the ranks are defined here once, for
the ranks and for the single-process references the tests compute; each rank saves
what it got to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memconv
from memconv.engine import passes
from memconv.streaming import StreamingCNN

WORLD = 2
MAX_NORM = 3.9  # between the smallest and the largest per-sample norm
CLIP_ROUTES = ("book-keeping", "two-pass")
#: rows of the global batch of 8 each rank gets: halves, an uneven split, and a rank
#: with no sample at all (the ranks' clipped sums are summed whatever their sizes)
SPLITS = {
    "halves": (slice(0, 4), slice(4, 8)),
    "uneven": (slice(0, 5), slice(5, 8)),
    "empty": (slice(0, 8), slice(8, 8)),
}


def batch(size=6):
    torch.manual_seed(1)
    return torch.randn(8, 2, size, size, dtype=torch.float64), torch.randint(0, 3, (8,))


def clip_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect"),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, groups=2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    ).double()


def stream_layers():
    torch.manual_seed(2)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.MaxPool2d(2)
    ).double()


def stream_head():
    torch.manual_seed(3)
    return nn.Sequential(nn.Flatten(), nn.Linear(4 * 7 * 7, 3)).double()


def torchvision_trunk():
    """A narrow torchvision ResNet-18 trunk, as written there (BatchNorm in eval mode,
    its statistics and affine parameters away from their initial values), and a head."""
    from memconv.bench.trunks import resnet_trunk

    torch.manual_seed(4)
    trunk = resnet_trunk(18, in_channels=2, width=4, layers=(1, 1, 1, 1)).double()
    for m in trunk.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3)).double()
    return trunk, head


#: noise multiplier, learning rate and noise seed of the private step
PRIVATE = dict(sigma=0.7, lr=0.5, seed=3)


def _private_step(rank, x, y):
    """One step of memconv's private path on a ``DPDDP`` model (rank r: half the
    batch); the parameters after it, or None without Opacus."""
    try:
        from opacus import PrivacyEngine
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    except ImportError:
        return None
    from torch.utils.data import DataLoader, TensorDataset

    from memconv.integrations import opacus as mo

    model = DPDDP(clip_model())
    loader = DataLoader(TensorDataset(x, y), batch_size=4)  # sample rate 1/2: 4 per step
    m, opt, _ = mo.make_private(
        PrivacyEngine(),
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=PRIVATE["lr"]),
        data_loader=loader,
        noise_multiplier=PRIVATE["sigma"],
        max_grad_norm=MAX_NORM,
        poisson_sampling=False,
        noise_generator=torch.Generator().manual_seed(PRIVATE["seed"]),
    )
    r = SPLITS["halves"][rank]
    opt.zero_grad()
    nn.CrossEntropyLoss()(m(x[r]), y[r]).backward()
    opt.step()
    return {
        "optimizer": type(opt).__name__,
        "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
    }


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _use_loopback():
    """Gloo's pairs connect over the loopback interface, whatever the host's name says."""
    names = {name for _, name in socket.if_nameindex()}
    if "GLOO_SOCKET_IFNAME" not in os.environ and "lo" in names:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def run(rank: int, out: str) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: every scenario, then save."""
    torch.set_num_threads(1)
    _use_loopback()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out}/store",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        result = {"clip": {}, "after": {}}
        x, y = batch()
        loss_sum = nn.CrossEntropyLoss(reduction="sum")
        # memconv.clip_and_accumulate on a DDP model: the global clipped sum on every rank
        for split, rows in SPLITS.items():
            for route in CLIP_ROUTES:
                model = DDP(clip_model())
                r = rows[rank]
                norms = memconv.clip_and_accumulate(
                    model, loss_sum, x[r], y[r], max_norm=MAX_NORM, clip_route=route
                )
                result["clip"][split, route] = (_grads(model.module), norms)
                if split == "halves":  # DDP's own step still works afterwards
                    model.zero_grad()
                    nn.CrossEntropyLoss()(model(x[r]), y[r]).backward()
                    result["after"][route] = _grads(model.module)

        # within a memory_budget that forces micro-batches of one sample: each rank runs
        # its own number of passes (5 and 3) before the one all-reduce
        walk = passes.backward_walk
        counted = []

        def counting_walk(*args, **kwargs):
            counted.append(len(args[2]))
            return walk(*args, **kwargs)

        passes.backward_walk = counting_walk
        try:
            result["budget"] = {}
            r = SPLITS["uneven"][rank]
            for route in CLIP_ROUTES:
                model = DDP(clip_model())
                plan = memconv.plan(model.module, x[r], task="clip", clip_route=route)
                counted.clear()
                norms = memconv.clip_and_accumulate(
                    model,
                    loss_sum,
                    x[r],
                    y[r],
                    max_norm=MAX_NORM,
                    clip_route=route,
                    memory_budget=plan.smallest_budget,
                )
                result["budget"][route] = (_grads(model.module), norms, list(counted))
        finally:
            passes.backward_walk = walk

        # extended modules under DDP, inside save_memory("shift") and per_sample()
        from memconv.strategies import get_strategy

        shift = get_strategy("shift")
        calls = []
        real = shift.vjp

        def spy(*args, **kwargs):
            calls.append(kwargs["per_sample"])
            return real(*args, **kwargs)

        shift.vjp = spy
        try:
            model = DDP(memconv.convert(clip_model()))
            r = SPLITS["halves"][rank]
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with memconv.save_memory("shift"), memconv.per_sample():
                nn.CrossEntropyLoss()(model(x[r]), y[r]).backward()
            result["extended"] = {
                "grad": _grads(model.module),
                "grad_batch": {n: p.grad_batch.clone() for n, p in model.module.named_parameters()},
                "shift_calls": list(calls),
            }
            optimizer.step()
            result["extended"]["params"] = {
                n: p.detach().clone() for n, p in model.module.named_parameters()
            }
        finally:
            shift.vjp = real

        # StreamingCNN under DDP
        xs, ys = batch(16)
        model = DDP(nn.Sequential(StreamingCNN(stream_layers(), 8), *stream_head()))
        nn.CrossEntropyLoss()(model(xs[r]), ys[r]).backward()
        result["streaming"] = _grads(model.module)
        # a torchvision-style trunk, several tiles per image, each rank its own images
        xs, ys = batch(70)
        trunk, head = torchvision_trunk()
        model = DDP(nn.Sequential(StreamingCNN(trunk, 32), head))
        nn.CrossEntropyLoss()(model(xs[r]), ys[r]).backward()
        result["streaming_torchvision"] = _grads(model.module)
        result["private"] = _private_step(rank, x, y)
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def reversible_model():
    """A stem, two reversible additive-coupling blocks (memconv.reversible) and a head."""
    from memconv.reversible import AdditiveCoupling, InvertibleModuleWrapper

    torch.manual_seed(4)

    def half():
        return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.Tanh())

    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        InvertibleModuleWrapper(AdditiveCoupling(half())),
        InvertibleModuleWrapper(AdditiveCoupling(half())),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    ).double()


def run_reversible(rank: int, out: str) -> None:
    """Entry point of ``torch.multiprocessing.spawn`` for :mod:`test_reversible`: DDP's
    own training step through reversible blocks (twice: the first backward pass checks
    the inverse), and ``memconv.clip_and_accumulate`` on both routes."""
    torch.set_num_threads(1)
    _use_loopback()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out}/store",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        x, y = batch()
        r = SPLITS["halves"][rank]
        result = {"step": [], "clip": {}}
        model = DDP(reversible_model())
        for _ in range(2):
            model.zero_grad()
            nn.CrossEntropyLoss()(model(x[r]), y[r]).backward()
            result["step"].append(_grads(model.module))
        for route in CLIP_ROUTES:
            model = DDP(reversible_model())
            norms = memconv.clip_and_accumulate(
                model,
                nn.CrossEntropyLoss(reduction="sum"),
                x[r],
                y[r],
                max_norm=MAX_NORM,
                clip_route=route,
            )
            result["clip"][route] = (_grads(model.module), norms)
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
