"""Operation counts, not times: what a GPU pays per launch is the same on every device.

A DP step and per-sample gradients issue a number of ATen operations that does not grow
with the batch and stays within a few times the non-private step's (autograd's, for
per-sample gradients), with at most one host synchronisation per call (the check of
the norms); and the cost models count the operations their computations issue, which
their per-operation term prices. Counted by the PyTorch profiler on the CPU
(:func:`memconv.bench.ops.count`), on small sizes so that each runs in seconds.
"""

import copy
import math

import pytest
import torch
from helpers import small_gn_resnet, small_vit
from torch import nn

import memconv
from memconv.bench import calibrate, models
from memconv.bench.cases import CASES, build_case
from memconv.bench.ops import count
from memconv.strategies import costs

#: A call's top-level operations at most, in multiples of the floor's.
RATIO = 4.0
#: How much they may grow from the smaller batch to the larger one.
GROWTH = 0.10


MODELS = {
    "gn-resnet": (small_gn_resnet, (3, 8, 8)),
    "vit": (small_vit, (3, 8, 8)),
    "seed": (lambda: models.seed_cnn(28), (1, 28, 28)),
}


def _case(name: str, batch: int):
    torch.manual_seed(0)
    build, shape = MODELS[name]
    return build(), torch.randn(batch, *shape), torch.randint(0, 10, (batch,))


def _non_private(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.CrossEntropyLoss(reduction="sum")(model(x), y).backward()


def _autograd(model, x, y):
    params = [p for p in model.parameters() if p.requires_grad]
    torch.autograd.grad(nn.CrossEntropyLoss(reduction="sum")(model(x), y), params)


def _clip_counts(name: str, batch: int, strategy: str | None = None):
    model, x, y = _case(name, batch)
    step = memconv.PrivateStep(model, nn.CrossEntropyLoss(), strategy=strategy)

    def private():
        model.zero_grad(set_to_none=True)
        step.clip_and_accumulate(x, y, max_norm=1.0)

    return count(lambda: _non_private(model, x, y)), count(private)


@pytest.mark.parametrize("name", ["gn-resnet", "vit"])
def test_dp_step_operations_do_not_grow_with_the_batch(name):
    """PrivateStep.clip_and_accumulate at N = 2, 8 and 64, its routes priced as on the
    GPU (the shipped CUDA calibration), whose launches the count stands for: within
    RATIO times the non-private step's top-level operations, one host sync, growing by
    at most GROWTH from 8 to 64, and no more at 2 than at 64.

    (The CPU's own prices move this small model's convolutions, at N = 64, from
    ``"rochette"`` to ``"shift"``, faster on the CPU and one matrix product per kernel
    offset: more operations, as many at any batch, which
    :func:`test_each_route_issues_as_many_operations_at_any_batch` checks. Below N = 8
    these small models' per-layer budget is the plan's floor, ``MIN_LAYER_BUDGET``,
    which holds a layer's whole batch in one piece: a tiny batch may issue fewer
    operations, never more.)"""
    with costs.using("cpu", costs.calibration("cuda")):
        counts = {n: _clip_counts(name, n) for n in (2, 8, 64)}
    for n, (floor, private) in counts.items():
        assert private["top_level"] <= RATIO * floor["top_level"], (n, floor, private)
        assert private["host_syncs"] <= 1, (n, private)
    tiny, small, large = (counts[n][1]["top_level"] for n in (2, 8, 64))
    assert large <= (1 + GROWTH) * small, (small, large)
    assert tiny <= large, (tiny, large)


@pytest.mark.slow  # (some 25 s of CPU: three calls of an 11 M-parameter step at N = 64)
def test_benchmark_resnet_dp_step_operations_do_not_grow_with_the_batch():
    """The benchmark's ResNet-18-GN (CIFAR, 32², ``python -m memconv.bench.ops --pricing
    cuda``'s row): PrivateStep.clip_and_accumulate at N = 64 issues at most GROWTH more
    top-level operations than at N = 4, its routes priced as on the GPU. Each layer
    chooses its route and pieces on the lean plan's reference batch
    (:data:`memconv.engine.planning.LEAN_REFERENCE_BATCH`) and keeps them; choosing at
    each batch, N = 64 issued 26 % more (661 → 836) than N = 4."""
    got = {}
    with costs.using("cpu", costs.calibration("cuda")):
        for n in (4, 64):
            model, x, y = build_case(CASES["resnet18-gn"].config(batch=n), torch.device("cpu"))
            step = memconv.PrivateStep(model, nn.CrossEntropyLoss())

            def private(model=model, step=step, x=x, y=y):
                model.zero_grad(set_to_none=True)
                step.clip_and_accumulate(x, y, max_norm=1.0)

            got[n] = count(private)
            assert got[n]["host_syncs"] <= 1, (n, got[n])
    small, large = got[4]["top_level"], got[64]["top_level"]
    assert small <= large <= (1 + GROWTH) * small, (small, large)


@pytest.mark.parametrize("strategy", ["standard", "rochette", "unfold", "shift"])
def test_each_route_issues_as_many_operations_at_any_batch(strategy):
    """With the weight-VJP strategy pinned, the DP step on the GroupNorm ResNet issues as many top-level
    operations at N = 64 as at N = 256 (within GROWTH) and at most RATIO times the
    non-private step's: no route loops over the samples or splits the batch while
    memory does not demand it."""
    (floor, small), (_, large) = (_clip_counts("gn-resnet", n, strategy) for n in (64, 256))
    assert large["top_level"] <= (1 + GROWTH) * small["top_level"], (small, large)
    assert large["top_level"] <= RATIO * floor["top_level"], (floor, large)


def test_per_sample_grads_operations_do_not_grow_with_the_batch():
    """PrivateStep.per_sample_grads on the seed CNN at N = 2 and 16, routes priced as on
    the GPU (as in :func:`test_dp_step_operations_do_not_grow_with_the_batch`): within
    RATIO times autograd's, growing by at most GROWTH, no host sync.

    (The CPU's own prices send this 28×28 model's 7×7 layer, at N = 16, to
    ``"streaming"``, whose tiles repeat their operations: the per-layer budget that
    keeps the call's peak near autograd's holds no whole-layer route there.)"""
    got = {}
    for n in (2, 16):
        model, x, y = _case("seed", n)
        step = memconv.PrivateStep(model, nn.CrossEntropyLoss())
        floor = count(lambda model=model, x=x, y=y: _autograd(model, x, y))
        with costs.using("cpu", costs.calibration("cuda")):
            grads = count(lambda step=step, x=x, y=y: step.per_sample_grads(x, y))
        assert grads["top_level"] <= RATIO * floor["top_level"], (n, floor, grads)
        assert grads["host_syncs"] == 0, (n, grads)
        got[n] = grads["top_level"]
    assert got[16] <= (1 + GROWTH) * got[2], got


def test_one_host_sync_whatever_the_groups_and_micro_batches():
    """Per-layer groups (clipped during the backward pass) and a budget that splits the
    batch in micro-batches still synchronise once: every norm is checked at the end."""
    model, x, y = _case("gn-resnet", 8)
    loss = nn.CrossEntropyLoss()
    plan = memconv.plan(model, x, task="clip", memory_budget=None)
    budget = (plan.smallest_budget + plan.predicted_peak) // 2
    for kwargs in ({"groups": "layer"}, {"memory_budget": budget}):
        options = {k: v for k, v in kwargs.items() if k == "memory_budget"}
        step = memconv.PrivateStep(model, loss, **options)
        groups = kwargs.get("groups", "all")

        def call(step=step, groups=groups):
            model.zero_grad(set_to_none=True)
            step.clip_and_accumulate(x, y, max_norm=1.0, groups=groups)

        assert count(call)["host_syncs"] == 1, kwargs
    assert memconv.plan(model, x, task="clip", memory_budget=budget).micro_batches > 1


def test_non_finite_norms_still_raise_naming_the_samples():
    """The one check finds a NaN as the per-sample checks did, before .grad is touched."""
    model, x, y = _case("gn-resnet", 4)
    x[2] = float("nan")
    step = memconv.PrivateStep(model, nn.CrossEntropyLoss())
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"sample\(s\) 2 is not finite"):
        step.clip_and_accumulate(x, y, max_norm=1.0)
    assert all(p.grad is None for p in model.parameters())


#: Layers of the calibration grid: dense, strided, a kernel of one, grouped and dilated,
#: 1-d strided, and one whose Gram matrices are tiled in bands at the grid's budget.
LAYERS = [
    layer
    for layer in calibrate.GRID
    if layer.name
    in {
        "resnet-3x3-64/N=16",
        "resnet-3x3-s2/N=16",
        "resnet-1x1-s2/N=16",
        "dilated-grouped/N=16",
        "conv1d-strided/N=16",
        "resnet-stem/N=16",
    }
]


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: layer.name)
def test_time_models_count_the_operations_they_issue(layer):
    """Each time model's per-operation term counts exactly the top-level operations the
    computation issues (strategies, both ghost methods, the squares, tiles)."""
    data = costs.calibration("cpu")
    only_ops = {
        "time": {m: {c: 0.0 for c in names} for m, names in costs.TIME_MODELS.items()},
        "memory": data["memory"],
    }
    only_ops["time"]["operation"]["per_op"] = 1.0
    for job in calibrate.jobs(layer, torch.device("cpu")):
        if job.model == "streaming" and any(s > 1 for s in layer.geom.stride):
            continue  # (strided tiles: a border tile's padding is counted on every tile)
        if job.variant == "summed":
            continue  # (the summed VJPs' counts: not modelled per operation)
        with costs.using("cpu", only_ops):
            predicted = job.predict_time()
        measured = count(job.run, warmup=1)["top_level"]
        assert round(predicted) == measured, (job.model, predicted, measured)


def _small_all_cnn_c():
    """All-CNN-C's structure (3×3 layers, one strided, a valid one, 1×1 layers, global
    average pooling), narrow, for 8×8 inputs."""

    def conv(c_in, c_out, k, stride=1, padding=1):
        return [nn.Conv2d(c_in, c_out, k, stride=stride, padding=padding), nn.ReLU()]

    return nn.Sequential(
        *conv(3, 8, 3),
        *conv(8, 8, 3, stride=2),
        *conv(8, 8, 3, padding=0),
        *conv(8, 8, 1, padding=0),
        *conv(8, 10, 1, padding=0),
        nn.AvgPool2d(2),
        nn.Flatten(),
    )


@pytest.mark.parametrize("pricing", ["cpu", "cuda"])
def test_kfac_step_issues_a_few_products_per_layer(pricing):
    """BackPACK's KFAC through memconv on an All-CNN-C-like model: each convolution's
    input factor is c products per slab of patches (its
    :func:`~memconv.conv.kronecker.expand_plan`; at most K, against the K(K+1)/2 of one
    product per pair of kernel offsets), and the step issues at most BackPACK's own
    step's top-level operations plus the plans' predicted operations, the padding and
    the select of a one-group factor (which replace BackPACK's unfolding and its
    products). One product per pair of kernel offsets (and per chunk of samples)
    issued 115 products and 3,000 top-level operations here (BackPACK's step 180; with
    the plans 6 products and 225 operations)."""
    backpack = pytest.importorskip("backpack")
    from memconv.conv.kronecker import expand_plan
    from memconv.integrations import backpack as mb

    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    inputs = {}
    net = _small_all_cnn_c()
    hooks = [
        m.register_forward_hook(lambda m, a, o: inputs.__setitem__(m, a[0]))
        for m in net.modules()
        if isinstance(m, nn.Conv2d)
    ]
    net(x)
    for h in hooks:
        h.remove()

    def step(model, ext):
        loss_fn = backpack.extend(nn.CrossEntropyLoss())

        def call():
            model.zero_grad(set_to_none=True)
            with backpack.backpack(ext):
                loss_fn(model(x), y).backward()

        return call

    with costs.using("cpu", costs.calibration(pricing)):
        plans = [expand_plan(m, inp) for m, inp in inputs.items()]
        theirs = count(step(backpack.extend(copy.deepcopy(net)), backpack.extensions.KFAC()))
        ours = count(step(mb.extend(net), mb.install(backpack.extensions.KFAC())), by_name=True)
    kinds = ("aten::bmm", "aten::baddbmm", "aten::baddbmm_")
    products = sum(ours["names"].get(kind, 0) for kind in kinds)
    assert products == sum(p.products for p in plans), (products, plans)
    assert all(p.chunks <= max(math.prod(m.kernel_size), 4) for p, m in zip(plans, inputs)), plans
    assert sum(p.slabs for p in plans) <= 2 * len(plans), plans  # the default budget
    # each layer's: its plan's, the padding and the select of a one-group factor
    bound = theirs["top_level"] + sum(p.operations + 2 for p in plans)
    assert ours["top_level"] <= bound, (ours["top_level"], theirs["top_level"], plans)
