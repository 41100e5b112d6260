"""Operation counts and tile shapes of a streamed training step (counts, not times).

The profiler's top-level ATen operations (:func:`memconv.bench.ops.count`) of one step
of a small torchvision-style ResNet trunk streamed along one axis, then both: every tile
added costs the same operations whatever the tile size (the halo slabs are written in one
operation per node and the gradients sent to them added in one per tile, nothing per
tile grows with the tiles), and no tile synchronises with the host. ``tile_size="auto"`` takes the tile
predicted fastest within the budget. The tiles away from the image's edges compute
results of one shape (ResNet, ConvNeXt and U-Net trunks at odd sizes, exact).
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from test_streaming_graphs import randomise

from memconv.bench import trunks
from memconv.bench.ops import count
from memconv.streaming import StreamingCNN
from memconv.streaming.budget import predict_peak, predict_time
from memconv.streaming.tiling import tile_plan


def _step(trunk, x, tile=None) -> tuple[dict, int]:
    """Counts of one training step (the trunk's output summed) and the tiles."""
    stream = trunk if tile is None else StreamingCNN(trunk, tile)

    def call():
        stream(x).sum().backward()
        trunk.zero_grad(set_to_none=True)

    counts = count(call, warmup=1)
    return counts, 1 if tile is None else stream.last_plan.count


def test_operations_per_tile_do_not_grow_with_the_tiles():
    torch.manual_seed(0)
    trunk = trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1))
    conventional, _ = _step(trunk, torch.randn(1, 3, 128, 32))
    added = {}
    for tile, rows in ((32, (256, 384)), (64, (512, 768))):
        (few, n_few), (many, n_many) = (_step(trunk, torch.randn(1, 3, r, 32), tile) for r in rows)
        assert n_many > n_few > 2
        assert few["host_syncs"] == many["host_syncs"] == 0
        added[tile] = (many["top_level"] - few["top_level"]) / (n_many - n_few)
    # each tile costs the same whatever the number of tiles, and about the same whatever
    # the tile size (a halo one position deeper or shallower at some boundary)
    assert abs(added[32] - added[64]) <= 0.02 * added[64]
    # and about 2.5 times what the conventional step on that tile costs (two forward
    # passes and one backward pass, a halo read and write per window's input; 3.0 when
    # each slab piece took its own copy and add, and its own slice)
    assert added[32] <= 2.5 * conventional["top_level"]


def test_operations_grow_by_the_same_count_per_row_of_tiles():
    """Tiled along both axes: each row of tiles added to the image adds the same
    operations (the rows in the middle are alike, and no tile's work grows with the
    number of tiles)."""
    torch.manual_seed(0)
    trunk = trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1))
    plan = StreamingCNN(trunk, 32).plan
    rows = {}
    for side in range(96, 320, 8):
        rows.setdefault(plan((1, 3, side, 96), torch.float32).axes[0].count, side)
    steps = [_step(trunk, torch.randn(1, 3, rows[n], 96), 32) for n in (4, 5, 6)]
    assert [n for _, n in steps] == [8, 10, 12]  # two tiles per row
    ops = [counts["top_level"] for counts, _ in steps]
    assert ops[2] - ops[1] == ops[1] - ops[0] > 0
    # a tile with halo along both axes: about 3.1 times the conventional step (3.7 when
    # each slab piece took its own copy, add and slice)
    conventional, _ = _step(trunk, torch.randn(1, 3, 128, 96))
    assert ops[2] - ops[1] <= 2 * 3.2 * conventional["top_level"]


def test_auto_takes_the_fastest_predicted_tile_within_the_budget():
    """Of the tiles whose predicted peak fits, ``"auto"`` takes the one predicted fastest
    (of those giving as many tiles, the one of least peak), never one past the budget."""
    trunk = trunks.resnet_trunk(18, width=8, layers=(1, 1, 1, 1))
    shape = (1, 3, 256, 256)
    bound = StreamingCNN(trunk, 64).bound(shape)
    peaks, times, counts = {}, {}, {}
    for t in (32, 48, 64, 96, 128, 192, 256):
        plan = tile_plan(bound, (t, t))
        peaks[t], times[t], counts[t] = predict_peak(plan, 4), predict_time(plan), plan.count
    assert times[256] < times[32]  # fewer, larger tiles: fewer operations and halo crops
    budget = (peaks[64] + peaks[256]) // 2
    stream = StreamingCNN(trunk, "auto", memory_budget=budget)
    plan = stream.plan(shape, torch.float32)
    picked = predict_time(plan)
    assert stream.predicted_peak(shape) <= budget
    fitting = [t for t in peaks if peaks[t] <= budget]
    # no tile that fits is predicted faster, but one giving as many tiles (and more peak)
    assert fitting and all(picked <= times[t] or counts[t] == plan.count for t in fitting)


def _edge_class(k: int, count: int):
    """A tile's place along one axis: the first two (the receptive field's look-ahead
    still shrinking), the last (the image's edge, no look-ahead), or the middle."""
    return k if k < 2 else ("last" if k == count - 1 else "middle")


def _recorded_step(monkeypatch, trunk, x, tile):
    """One streamed training step of ``trunk`` on ``x`` (float64) against the
    conventional step, and the shapes of every result each tile computed, per pass:
    ``[(pass, tile, [(node, shape), ...]), ...]``."""
    from memconv.streaming import passes

    shapes: list = []
    check, run = passes._check, passes.TileRunner.run

    def recording_check(node, y, own):
        shapes[-1][2].append((node.label, tuple(y.shape)))
        return check(node, y, own)

    def recording_run(self, env, tile, *, write, **kwargs):
        shapes.append(("forward" if write else "backward", tuple(tile), []))
        return run(self, env, tile, write=write, **kwargs)

    monkeypatch.setattr(passes, "_check", recording_check)
    monkeypatch.setattr(passes.TileRunner, "run", recording_run)
    xs = x.clone().requires_grad_()
    ref_out = trunk(xs)
    g = torch.randn_like(ref_out)
    params = list(trunk.parameters())
    ref = torch.autograd.grad(ref_out, [xs, *params], g)
    stream = StreamingCNN(trunk, tile)
    xs = x.clone().requires_grad_()
    out = stream(xs)
    got = torch.autograd.grad(out, [xs, *params], g)
    assert rel_err(out, ref_out.detach()) < 1e-10
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-10
    return stream.last_plan, shapes


@pytest.mark.parametrize(
    "make, tile, side",
    [
        (lambda: trunks.resnet_trunk(18, width=4, layers=(1, 2, 1, 1)), 40, (301, 299)),
        (lambda: trunks.convnext_trunk((1, 2), (8, 12), layer_scale=0.5), 16, (203, 190)),
        (lambda: trunks.UNet(3, 2, False, 4), 16, (203, 190)),
    ],
    ids=["resnet-basicblock", "convnext", "unet"],
)
def test_tiles_away_from_the_edges_share_one_shape(monkeypatch, make, tile, side):
    """Every tile a streamed step runs (forward and backward) computes results of the
    shape its place along each axis gives: the tiles in the middle all alike, whatever
    the number of tiles, and exact on odd image sizes (the edge tiles' shapes differ by
    design: the first reads the receptive field's look-ahead and no halo, the last
    meets the image's edge; shifting the last inward would not change its shape)."""
    torch.manual_seed(0)
    trunk = randomise(make())
    for size in ((37, 53), (61, 45), side):
        x = torch.randn(1, 3, *size, dtype=torch.float64)
        plan, shapes = _recorded_step(monkeypatch, trunk, x, tile)
        monkeypatch.undo()
        counts = [a.count for a in plan.axes]
        assert len(shapes) == 2 * plan.count  # each tile once per pass
        by_class: dict = {}
        for _, t, record in shapes:
            place = tuple(_edge_class(k, n) for k, n in zip(t, counts))
            assert by_class.setdefault(place, record) == record, (size, t)
    # the last image: at least two tiles in the middle along each axis, so that the
    # shapes above are compared across tiles; at most 4 shapes per axis in all
    assert all(sum(_edge_class(k, n) == "middle" for k in range(n)) >= 2 for n in counts)
    assert len(by_class) <= 4 ** len(counts) < plan.count
