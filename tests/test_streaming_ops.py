"""Operation counts of a streamed training step (counts, not times).

The profiler's top-level ATen operations (:func:`memconv.bench.ops.count`) of one step
of a small torchvision-style ResNet trunk streamed along one axis: every tile added
costs the same operations whatever the tile size (the halo slabs are read and written
in one operation per node and tile boundary, nothing per tile grows with the tiles),
and no tile synchronises with the host.
"""

from __future__ import annotations

import torch

from memconv.bench import trunks
from memconv.bench.ops import count
from memconv.streaming import StreamingCNN


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
    # and a few times what the conventional step on that tile costs (two forward passes
    # and one backward pass, a halo read and write per window's input)
    assert added[32] <= 4 * conventional["top_level"]
