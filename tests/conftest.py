import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run where the CI environment variable
# is set (.ci/run sets it), whatever hypothesis' own detection of CI does.
settings.register_profile("memconv-ci", derandomize=True, database=None, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("memconv-ci")

# the helpers module sits beside the tests
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with the process's torch thread count: code that sets it (the
    benchmarks' cases, run at toy sizes by tests) must not change the reduction order,
    hence the float32 round-off, of the tests after it."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def strategy_calls(monkeypatch):
    """Every strategy VJP memconv runs, as ``(strategy name, per_sample)`` in call order
    (a composite strategy's own call comes before those of the strategy it runs)."""
    import memconv
    from memconv.strategies import get_strategy

    calls = []
    for name in memconv.available_strategies():
        strategy = get_strategy(name)

        def spy(*args, _real=strategy.vjp, _name=name, **kwargs):
            calls.append((_name, kwargs["per_sample"]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(strategy, "vjp", spy)
    return calls
