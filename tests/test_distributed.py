"""memconv under ``DistributedDataParallel``: 2 gloo processes on this machine.

One spawn for the module (:mod:`ddp_worker` runs every scenario on both ranks and
saves what it got); each test compares against a single-process reference on the
whole batch, float64 to 1e-10:

- ``memconv.clip_and_accumulate`` gives every rank the clipped **sum** over the
  global batch (both clipping routes; halves, an uneven split, an empty rank; and in
  micro-batches within a ``memory_budget``), and leaves DDP's own step working;
- ``DistributedDataParallel(memconv.convert(model))`` inside ``save_memory("shift")``
  and ``per_sample()``: DDP's averaged ``.grad`` on every rank, ``grad_batch`` of the
  local samples;
- ``DistributedDataParallel`` around a ``StreamingCNN``: DDP's averaged gradient;
- one step of memconv's private path (``memconv.integrations.opacus.make_private``)
  on Opacus' ``DPDDP``: every rank's parameters after the step equal a step built by
  hand (global clipped sum, rank 0's seeded noise, divided by the expected batch size).
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_worker import (
    CLIP_ROUTES,
    MAX_NORM,
    PRIVATE,
    SPLITS,
    WORLD,
    batch,
    clip_model,
    run,
    stream_head,
    stream_layers,
    torchvision_trunk,
)
from helpers import loop_reference, rel_err
from torch import nn

TOL = 1e-10

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the 2 ranks got, ``[rank 0's, rank 1's]``."""
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(run, args=(str(out),), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def per_sample_reference(model, loss_fn):
    x, y = batch()
    per = loop_reference(model, loss_fn, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    return per, norms


def assert_close(got: dict, expected: dict):
    assert list(got) == list(expected)
    for name in expected:
        assert rel_err(got[name], expected[name]) < TOL, name


@pytest.mark.parametrize("route", CLIP_ROUTES)
@pytest.mark.parametrize("split", list(SPLITS))
def test_clip_and_accumulate_gives_every_rank_the_global_clipped_sum(ranks, split, route):
    per, norms = per_sample_reference(clip_model(), nn.CrossEntropyLoss(reduction="sum"))
    assert (norms > MAX_NORM).any() and (norms < MAX_NORM).any()  # some clipped, some not
    c = torch.clamp(MAX_NORM / norms, max=1.0)
    clipped_sum = {k: torch.einsum("n,n...->...", c, g) for k, g in per.items()}
    for rank, got in enumerate(ranks):
        grads, local_norms = got["clip"][split, route]
        assert_close(grads, clipped_sum)  # summed over the ranks, not averaged
        rows = SPLITS[split][rank]
        assert rel_err(local_norms, norms[rows]) < TOL  # the norms stay local


@pytest.mark.parametrize("route", CLIP_ROUTES)
def test_clip_and_accumulate_in_micro_batches_under_ddp(ranks, route):
    """A memory_budget of the smallest feasible size: micro-batches of one sample, so the
    ranks run different numbers of passes (5 and 3) before the one all-reduce."""
    per, norms = per_sample_reference(clip_model(), nn.CrossEntropyLoss(reduction="sum"))
    c = torch.clamp(MAX_NORM / norms, max=1.0)
    clipped_sum = {k: torch.einsum("n,n...->...", c, g) for k, g in per.items()}
    for rank, got in enumerate(ranks):
        grads, local_norms, passes = got["budget"][route]
        rows = SPLITS["uneven"][rank]
        assert passes == [1] * (rows.stop - rows.start)
        assert_close(grads, clipped_sum)
        assert rel_err(local_norms, norms[rows]) < TOL


@pytest.mark.parametrize("route", CLIP_ROUTES)
def test_ddp_own_step_still_works_after_clip_and_accumulate(ranks, route):
    model = clip_model()
    x, y = batch()
    halves = []
    for rows in SPLITS["halves"]:
        model.zero_grad()
        nn.CrossEntropyLoss()(model(x[rows]), y[rows]).backward()
        halves.append({n: p.grad.clone() for n, p in model.named_parameters()})
    averaged = {n: (halves[0][n] + halves[1][n]) / 2 for n in halves[0]}
    for got in ranks:
        assert_close(got["after"][route], averaged)


def test_extended_modules_under_ddp_in_save_memory_and_per_sample(ranks):
    model = clip_model()
    x, y = batch()
    model.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()  # halves of equal size: DDP's mean
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    per, _ = per_sample_reference(clip_model(), nn.CrossEntropyLoss())
    with torch.no_grad():
        stepped = {n: p - 0.1 * whole[n] for n, p in clip_model().named_parameters()}
    for rank, got in enumerate(ranks):
        ext = got["extended"]
        assert_close(ext["grad"], whole)
        assert_close(ext["params"], stepped)  # one SGD step, the same on every rank
        rows = SPLITS["halves"][rank]
        n_local = rows.stop - rows.start
        # grad_batch: the local samples' gradients of the local (mean) loss
        assert_close(ext["grad_batch"], {k: g[rows] / n_local for k, g in per.items()})
        # both convolutions' weights by "shift", per sample
        assert ext["shift_calls"] == [True, True]


def test_streaming_cnn_under_ddp(ranks):
    layers, head = stream_layers(), stream_head()
    model = nn.Sequential(layers, head)
    x, y = batch(16)
    nn.CrossEntropyLoss()(model(x), y).backward()  # halves of equal size: DDP's mean
    expected = [p.grad for p in model.parameters()]
    for got in ranks:
        grads = list(got["streaming"].values())
        assert len(grads) == len(expected)
        for a, b in zip(grads, expected):
            assert rel_err(a, b) < TOL


def test_streamed_torchvision_trunk_under_ddp(ranks):
    """A ResNet trunk as torchvision writes it, streamed on every rank over its own
    images: DDP's step equals the single-process one (BatchNorm's affine parameters
    included)."""
    trunk, head = torchvision_trunk()
    model = nn.Sequential(trunk, head)
    x, y = batch(70)
    nn.CrossEntropyLoss()(model(x), y).backward()
    expected = {
        (f"0.stream_layers.{n[2:]}" if n.startswith("0.") else n): p.grad
        for n, p in model.named_parameters()
    }
    for got in ranks:
        assert got["streaming_torchvision"].keys() == expected.keys()
        for name, g in got["streaming_torchvision"].items():
            assert rel_err(g, expected[name]) < TOL, name


def test_private_path_step_under_dpddp(ranks):
    if ranks[0]["private"] is None:
        pytest.skip("needs opacus")
    per, norms = per_sample_reference(clip_model(), nn.CrossEntropyLoss())
    assert (norms > MAX_NORM).any() and (norms < MAX_NORM).any()
    c = torch.clamp(MAX_NORM / norms, max=1.0)
    gen = torch.Generator().manual_seed(PRIVATE["seed"])
    expected = {}
    for name, p in clip_model().named_parameters():
        s = torch.einsum("n,n...->...", c, per[name])
        noise = torch.normal(0, PRIVATE["sigma"] * MAX_NORM, s.shape, generator=gen, dtype=s.dtype)
        expected[name] = p.detach() - PRIVATE["lr"] * (s + noise) / 4  # expected batch: 4
    for got in ranks:
        assert got["private"]["optimizer"] == "DistributedDPOptimizerFastGradientClipping"
        assert_close(got["private"]["params"], expected)
