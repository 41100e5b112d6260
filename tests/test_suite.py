"""``memconv suite``: its steps are valid ``memconv bench`` commands on the device
asked for and cover the tables a GPU changes; it refuses CUDA where there is none,
before any work; it runs on the CPU and fills its own page from its JSON Lines."""

import argparse
import json

import pytest
import torch

from memconv.bench import bench, suite
from memconv.bench.cli import main


def _args(**kw):
    base = {"device": "cpu", "out": None, "markdown": None, "steps": None, "quick": False}
    return argparse.Namespace(**{**base, "repeats": None, **kw})


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_every_step_is_a_valid_bench_command_on_the_device(quick, tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for step in suite.check_arguments(_args(quick=quick)):
        argv = suite.bench_argv(step, _args(quick=quick, repeats=1), tmp_path)
        args = parser.parse_args(argv)
        assert args.device == "cpu" and args.json == str(tmp_path / f"{step.name}.jsonl")
        bench.check_arguments(args)  # names, sizes and modes, before any work


def test_the_steps_cover_the_tables_a_gpu_changes():
    full = {s.name: " ".join(s.args) for s in suite.STEPS}
    assert "resnet18-gn" in full["clip"] and "wrn16-4-gn" in full["clip-more"]
    assert "seed-112,seed-28" in full["grads"]
    assert "--largest-batch" in full["largest-grads"] and "--largest-batch" in full["largest-clip"]
    assert "streaming-4096" in full["streaming"] and "memconv-streaming" in full["streaming"]
    peers = " ".join(full.values())
    for peer in ("torch.func", "opacus-hooks", "opacus-ghost", "backpack-save-memory"):
        assert peer in peers or peer == "opacus-ghost" and "--task clip" in full["clip"]


def test_the_gpu_steps_are_valid_commands_sized_for_eight_minutes(tmp_path, monkeypatch):
    """On CUDA the default steps are the ones with a GPU size, the GPU tables first;
    their estimate (fresh processes of ~12 s on an H100 or H200) fits eight minutes."""
    monkeypatch.setattr(suite, "_gpu", lambda args: True)
    steps = suite.check_arguments(_args())
    assert [s.name for s in steps] == list(suite.GPU_ORDER)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    total = 0.0
    for step in steps:
        argv = suite.bench_argv(step, _args(), tmp_path)  # (--device cpu: parsed here)
        assert argv[: len(step.gpu)] == list(step.gpu)
        total += suite.estimate(parser.parse_args(argv), "cuda")
    assert total <= 8 * 60, total


def test_a_time_budget_skips_what_will_not_fit_and_says_so(tmp_path, caplog):
    page = tmp_path / "page.md"
    argv = ["suite", "--device", "cpu", "--quick", "--repeats", "1", "--steps", "streaming"]
    with caplog.at_level("WARNING", logger="memconv"):
        status = main(
            [*argv, "--time-budget", "1", "--out", str(tmp_path), "--markdown", str(page)]
        )
    assert status == 0 and not (tmp_path / "streaming.jsonl").exists()
    assert "step streaming skipped" in caplog.text and "--time-budget" in caplog.text


def test_a_measurement_past_the_deadline_does_not_start():
    from memconv.bench.runner import OUT_OF_TIME, measure_engines

    base = {"case": "seed-28", "model": "seed", "batch": 2, "side": 28, "data": "random"}
    rows = measure_engines(base, ["autograd", "memconv:auto"], deadline=0.0)
    assert [r.get("skipped") for r in rows] == [OUT_OF_TIME, OUT_OF_TIME]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_suite_on_cuda_without_cuda_says_so_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["suite", "--device", "cuda", "--out", str(tmp_path / "cuda")])
    assert "no CUDA device is available" in capsys.readouterr().err
    assert not (tmp_path / "cuda").exists()


def test_suite_rejects_an_unknown_step(capsys):
    with pytest.raises(SystemExit):
        main(["suite", "--device", "cpu", "--steps", "grads,nope"])
    assert "--steps" in capsys.readouterr().err


def _run(tmp_path, steps):
    page = tmp_path / "page.md"
    argv = ["-q", "suite", "--device", "cpu", "--quick", "--repeats", "1", "--steps", steps]
    status = main([*argv, "--out", str(tmp_path / "cpu"), "--markdown", str(page)])
    return status, page.read_text()


def test_suite_measures_on_the_cpu_and_fills_its_page(tmp_path):
    status, page = _run(tmp_path, "streaming")
    assert status == 0
    lines = (tmp_path / "cpu" / "streaming.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0]["record"] == "run" and "--device cpu" in records[0]["command"]
    rows = {r["engine"]: r for r in records if r.get("record") == "row"}
    assert set(rows) == {"autograd", "memconv-streaming"}
    assert all(r["peak_alloc_mib"] > 0 and r["time_s"] > 0 for r in rows.values())
    assert "<!-- bench:grads -->" in page and "StreamingCNN" in page


@pytest.mark.slow
def test_every_step_of_the_suite_runs_on_the_cpu(tmp_path):
    status, page = _run(tmp_path, "all")
    assert status == 0
    assert {p.name for p in (tmp_path / "cpu").glob("*.jsonl")} == {
        f"{s.name}.jsonl" for s in suite.STEPS
    }
    assert "not measured yet" not in page
