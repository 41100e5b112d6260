"""The chunked replay's plan (its chunks of rows, the layers that keep their Gram factor
over them) follows its predicted time within the budget, and the kept Gram factors give
BackPACK's diagonals.

Float64; the references are BackPACK alone and per-output autograd Jacobians
(:func:`tests.test_backpack_secondorder._ggn_reference`).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

pytest.importorskip("backpack")
from backpack import extensions as E  # noqa: E402
from test_backpack_secondorder import _close, _ggn_reference, _run  # noqa: E402

from memconv.integrations import backpack as mb  # noqa: E402
from memconv.integrations.backpack import chunking, secondorder  # noqa: E402
from memconv.strategies import costs  # noqa: E402


def _candidate(nbytes, rows=1000, per_row=10, fixed=2000):
    return secondorder.GramCandidate(object(), nbytes, rows, per_row, fixed)


def _prices(per_op, per_flop):
    data = copy.deepcopy(costs.calibration("cpu"))
    data["time"]["operation"]["per_op"] = per_op
    data["time"]["standard"]["per_flop"] = per_flop
    return costs.using("cpu", data)


def test_a_budget_that_holds_every_row_gives_one_chunk():
    """In one chunk the Gram route runs once anyway: keeping its factor saves nothing."""
    gram = [_candidate(500), _candidate(300)]
    for budget in (40 * 100, 40 * 100 + 800, 10**9):
        plan = chunking.plan_chunks(40, 100, budget, gram, calls=5)
        assert plan.chunks == [(0, 40)] and plan.accumulate == ()
        assert plan.nbytes == 40 * 100


def test_without_gram_layers_the_fewest_chunks_that_fit_of_even_sizes():
    for budget, count in [(300, 4), (100, 10), (99, 10), (950, 2), (1000, 1), (10**9, 1)]:
        plan = chunking.plan_chunks(10, 100, budget, calls=5)
        sizes = [v1 - v0 for v0, v1 in plan.chunks]
        assert len(sizes) == count and sum(sizes) == 10, (budget, sizes)
        assert max(sizes) - min(sizes) <= 1
        assert plan.chunks[0][0] == 0 and all(
            a[1] == b[0] for a, b in zip(plan.chunks, plan.chunks[1:])
        )
        if budget >= 100:
            assert plan.nbytes == max(sizes) * 100 <= budget


def test_the_plan_never_takes_more_than_the_budget():
    gram = [_candidate(250), _candidate(120, rows=50), _candidate(900, fixed=10)]
    for budget in range(100, 40 * 100 + 1500, 37):
        plan = chunking.plan_chunks(40, 100, budget, gram, calls=3)
        assert plan.nbytes <= budget, budget
        held = sum(c.nbytes for c in plan.accumulate)
        assert held + max(v1 - v0 for v0, v1 in plan.chunks) * 100 == plan.nbytes


def test_keeping_a_gram_factor_follows_the_calibrations_prices():
    """A Gram factor of 300 bytes leaves room for 7 rows instead of 10: 18 chunks
    against 12 (priced per operation), for the Gram route's fixed part once in all
    instead of once per chunk (priced per multiply-add)."""
    gram = [_candidate(300, rows=10**6, per_row=10, fixed=10**5)]
    budget = 1000
    with _prices(per_op=1e-3, per_flop=1e-12):  # operations dear: fewer chunks
        plan = chunking.plan_chunks(120, 100, budget, gram, calls=4)
    assert plan.accumulate == () and len(plan.chunks) == 12
    with _prices(per_op=1e-9, per_flop=1e-9):  # multiply-adds dear: keep the factor
        plan = chunking.plan_chunks(120, 100, budget, gram, calls=4)
    assert plan.accumulate == tuple(gram) and len(plan.chunks) == 18
    # and the predicted seconds are what the prices give
    flops = 10 * 120 + 10**5
    assert plan.seconds == pytest.approx(18 * chunking.OPS_PER_CALL * 4 * 1e-9 + flops * 1e-9)


def test_a_gram_factor_that_leaves_no_room_for_a_row_is_not_kept():
    plan = chunking.plan_chunks(10, 100, 150, [_candidate(100)], calls=2)
    assert plan.accumulate == () and len(plan.chunks) == 10


def _small_map_net(seed=0):
    """A convolution to a 2×2 map before 30 outputs: its diagonal over all 30 rows
    takes the Gram route (T = 4 < V)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 30)).double()
    return model, torch.randn(3, 8, 4, 4).double(), torch.randint(0, 30, (3,))


@pytest.mark.parametrize("ext_cls", [E.DiagGGNExact, E.BatchDiagGGNExact], ids=lambda c: c.__name__)
def test_gram_factors_kept_over_chunks_give_backpacks_diagonal(ext_cls, caplog):
    alone = _run(*_small_map_net(), ext_cls(), install=False)
    # a row costs 3 copies of the convolution's input and output (192 numbers per
    # sample, 3 samples, 8 bytes); the Gram factor 3·16·4² numbers: room for 5 rows
    row, kept = 3 * 192 * 3 * 8, 3 * 16 * 16 * 8
    ext = mb.install(ext_cls(), memory_budget=kept + 5 * row)
    with caplog.at_level(logging.INFO, logger="memconv"):
        got = _run(*_small_map_net(), ext, install=False)
    assert "the 30 rows of the factor in 6 chunk(s) of at most 5" in caplog.text
    assert "1 layer(s) on the Gram route over all chunks" in caplog.text
    assert got.keys() == alone.keys()
    for name in alone:
        _close(got[name], alone[name])
    model, x, y = _small_map_net()
    reference = _ggn_reference(model, x, y, model[0].weight, ext_cls is E.BatchDiagGGNExact)
    _close(got["0.weight"], reference)


def test_the_pending_quantity_is_no_tensor():
    with pytest.raises(TypeError):
        torch.zeros(2) + secondorder.PENDING
