"""BackPACK 1.7.1's own second-order test suite, with every extension object routed
through memconv.

BackPACK's ``test/extensions/secondorder`` (DiagGGN, DiagHessian, SqrtGGN, KFAC, KFLR,
KFRA; fetched from its source distribution into ``.cache/backpack``, or skipped with
the reason where the registry cannot be reached; :mod:`backpack_suite`) runs in a
fresh pytest process inside :func:`memconv.integrations.backpack.routed`, which installs
every extension object of every ``with backpack(...)`` block with ``install()``'s
default arguments (the exact GGN extensions chunked to the lean budget). Every test
that passes with BackPACK alone must pass through memconv, except those of
:data:`BACKPACK_REFUSES` and :data:`LINEAR_ADDITIONAL` that assert BackPACK's own
refusal of a case memconv computes.

A run takes 93 s alone and 106 s routed on a quiet 2-core machine
(``OMP_NUM_THREADS=1``), 7 minutes routed at load average 7; one-row chunks take
longer (a replay of every module extension per row), so the tests are ``slow``
(``make test-slow``).
"""

from __future__ import annotations

import re
from collections import Counter

import backpack_suite
import pytest

pytest.importorskip("backpack")

#: Tests that assert BackPACK 1.7.1 raises ``NotImplementedError`` for a grouped
#: convolution (``groups > 1``) under ``KFAC``, ``KFLR`` and ``KFRA`` (its
#: ``GROUP_CONV_SETTINGS``, 6 per extension). Through memconv, with ``routed()``'s
#: default ``kron_groups="average"``, the grouped convolutions compute the factors of
#: the input averaged over the groups (checked against autograd by
#: ``tests/test_kronecker.py``): the refusal the tests expect does not happen. The
#: grouped transposed convolutions (:data:`TRANSPOSED`) are refused by memconv itself,
#: naming the layer and ``kron_groups="blocks"``: the tests pass.
BACKPACK_REFUSES = re.compile(r"test_kf(ac|lr|ra)_not_supported\[.*groups=\d")
TRANSPOSED = re.compile(r"ConvTranspose[123]d")
#: Tests that assert BackPACK 1.7.1 raises ``NotImplementedError`` for ``KFAC`` and
#: ``KFLR`` of a Linear layer on inputs with additional dimensions ``[N, *, C_in]``
#: (6 per extension): memconv computes them (the factors of the equal 1×1
#: convolution, checked by ``tests/test_kronecker.py``), so the tests fail. Its
#: ``KFRA`` is refused, as BackPACK's.
LINEAR_ADDITIONAL = re.compile(r"test_kf(ac|lr)_not_supported\[(one|two|three)-additional")
#: BackPACK 1.7.1's second-order tests on a CPU without the ``montecarlo`` ones: 1,196
#: collected, 1,178 pass with BackPACK alone, 18 skip (CUDA, and BCEWithLogitsLoss
#: with non-binary labels).
PASS_ALONE_ON_CPU = 1178


@pytest.fixture(scope="module")
def sdist():
    found, why = backpack_suite.fetch_sdist()
    if found is None:
        pytest.skip(why)
    return found


def _through_memconv(sdist, folder, memory_budget=None):
    outcomes, routed = backpack_suite.run(
        backpack_suite.build(sdist, folder), routed=True, memory_budget=memory_budget
    )
    assert routed > 1000, f"only {routed} extension objects went through memconv"
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("memory_budget", [None, 1], ids=["default", "one-row-chunks"])
def test_backpack_secondorder_suite_through_memconv(sdist, tmp_path, memory_budget):
    """With ``install()``'s defaults, and with the exact GGN extensions' backward pass
    over chunks of one row each (``memory_budget=1``)."""
    outcomes = _through_memconv(sdist, tmp_path, memory_budget)
    refused = sorted(k for k in outcomes if BACKPACK_REFUSES.search(k))
    assert len(refused) == 18, refused
    for k in refused:  # computed, but a grouped transposed convolution refused by memconv
        assert outcomes[k] == ("passed" if TRANSPOSED.search(k) else "failed"), k
    linear = sorted(k for k in outcomes if LINEAR_ADDITIONAL.search(k))
    assert len(linear) == 12 and all(outcomes[k] == "failed" for k in linear), linear
    computed = {k for k in [*refused, *linear] if outcomes[k] == "failed"}
    failed = sorted(
        k for k, v in outcomes.items() if v in ("failed", "error") and k not in computed
    )
    assert not failed, f"{len(failed)} of BackPACK's tests fail through memconv: {failed}"
    counts = Counter(v for k, v in outcomes.items() if k not in computed)
    assert counts["passed"] == PASS_ALONE_ON_CPU - len(computed), counts


@pytest.mark.slow
def test_backpack_itself_passes_no_more(sdist, tmp_path):
    """Every test BackPACK itself passes here passes through memconv, but those of
    :data:`BACKPACK_REFUSES` and :data:`LINEAR_ADDITIONAL` whose case memconv
    computes."""
    mine = _through_memconv(sdist, tmp_path / "memconv")
    theirs, _ = backpack_suite.run(backpack_suite.build(sdist, tmp_path / "backpack"), routed=False)
    passed = {k for k, v in theirs.items() if v == "passed"}
    assert len(passed) == PASS_ALONE_ON_CPU, Counter(theirs.values())
    worse = sorted(k for k in passed if mine.get(k) != "passed")
    computed = [k for k in worse if BACKPACK_REFUSES.search(k) or LINEAR_ADDITIONAL.search(k)]
    assert [k for k in worse if k not in computed] == []
    assert not [k for k in computed if TRANSPOSED.search(k)]  # refused by memconv too
