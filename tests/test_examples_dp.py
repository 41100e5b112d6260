"""Smoke test of ``examples/dp_sgd_digits.py`` with tiny settings (a few steps per path)."""

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("opacus")
pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dp_sgd_digits.py"


def load_example():
    spec = importlib.util.spec_from_file_location("dp_sgd_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_paths_run_and_take_the_same_steps(capsys):
    example = load_example()
    results = example.main(["--epochs", "1", "--max-steps", "3", "--seed", "1"])
    table = capsys.readouterr().out
    assert set(results) == {"Opacus (hooks)", "memconv clip_and_accumulate"}
    for name, r in results.items():
        assert 0.0 <= r["accuracy"] <= 1.0, name
        assert math.isfinite(r["epsilon"]) and r["epsilon"] > 0, name
        assert math.isfinite(r["peak_mib"]) and r["peak_mib"] > 0, name
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0, name
        assert r["steps"] == 3, name
        assert f"| {name} |" in table
    opacus, mc = results.values()
    # the same accountant over the same (σ, q) steps
    assert opacus["epsilon"] == pytest.approx(mc["epsilon"], rel=1e-12)
    # the same batches and the same noise: the models differ only by rounding and Opacus'
    # 1e-6 stabiliser of the clip factors
    for key, value in opacus["state"].items():
        other = mc["state"][key]
        scale = value.abs().max().item()
        assert (value - other).abs().max().item() <= 1e-5 * scale, key


def test_bad_arguments_are_rejected():
    example = load_example()
    for argv in (["--epochs", "0"], ["--max-steps", "1"], ["--lr", "-1"], ["--batch-size", "0"]):
        with pytest.raises(SystemExit):
            example.parse_args(argv)


def test_gallery_dp_example_trains_through_make_private():
    """The gallery's first DP path, one epoch: memconv's make_private on a residual CNN
    with in-place ReLUs and ``out += identity``, ε from Opacus' accountant."""
    import os
    import subprocess
    import sys

    script = EXAMPLE.parent / "plot_dp_sgd_opacus.py"
    env = {**os.environ, "MEMCONV_GALLERY": "1", "MEMCONV_EPOCHS": "1"}
    env["PYTHONPATH"] = str(EXAMPLE.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "eps=" in out  # the accountant's ε on the progress bar
    assert "for ε = 3.0 in 1 epochs" in out
    import re

    spent = float(re.search(r"epochs, ε = ([0-9.]+)", out).group(1))
    assert 2.5 < spent <= 3.01  # the target, reached and not exceeded
