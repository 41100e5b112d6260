"""The benchmark machinery: every engine agrees with torch.func (small shapes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memconv.bench.cases import build_case
from memconv.bench.engines import ENGINES, available
from memconv.bench.runner import max_rel_deviation

# layers the peers do not support (BatchNorm) are expected to fail there
UNSUPPORTED = {
    ("resnet18", "expanded-weights"),
    ("resnet18", "opacus-hooks"),
    ("resnet18", "opacus-functorch"),
}
CASES = [
    {"model": "seed", "batch": 3, "side": 28},
    {"model": "resnet18", "batch": 2, "side": 32},
    {"model": "conv1d", "batch": 3, "side": 64},
    {"model": "conv3d", "batch": 2, "side": 8, "depth": 4},
]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", CASES, ids=[c["model"] for c in CASES])
def test_every_engine_agrees_with_torch_func(case):
    def run(name):
        model, x, y = build_case(case, torch.device("cpu"))
        return ENGINES[name].run(model.double(), x.double(), y)

    reference = run("torch.func")
    for name, engine in ENGINES.items():
        if available(engine) or (case["model"], name) in UNSUPPORTED:
            continue
        result = run(name)
        assert max_rel_deviation(result, reference) < 1e-10, name
        if engine.per_sample and not name.startswith("memconv-modules"):
            assert set(result) == set(reference), name


def test_unsupported_peers_fail_loudly():
    model, x, y = build_case(CASES[1], torch.device("cpu"))
    with pytest.raises(Exception, match="batch_norm"):
        ENGINES["expanded-weights"].run(model, x, y)


@pytest.mark.slow
def test_bench_quick_smoke(tmp_path):
    """``memconv bench --quick``: every engine runs in a fresh process and agrees."""
    out = tmp_path / "bench.json"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "memconv", "bench", "--quick", "--repeats", "1", "--json", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for case in data["cases"]:
        for row in case["rows"]:
            if "deviation" in row:
                assert row["deviation"] < 1e-4, row
            else:
                assert "skipped" in row or (case["case"]["model"], row["engine"]) in UNSUPPORTED, (
                    row
                )
