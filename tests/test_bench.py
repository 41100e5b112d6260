"""The benchmark machinery: every engine agrees with torch.func (small shapes, float64,
in process), for per-sample gradients and for clipped sums; the bisection of the
largest batch; the JSON Lines records and the report; a slow end-to-end smoke test."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memconv
from memconv.bench.cases import build_case
from memconv.bench.engines import ENGINES, NORMS, available, clip_sum, clip_sum_per_parameter
from memconv.bench.largest import search
from memconv.bench.runner import max_rel_deviation, read_records

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
MiB = 2**20

# layers the peers do not support are expected to fail there, loudly
UNSUPPORTED = {
    ("resnet18", "expanded-weights"),
    ("resnet18", "opacus-hooks"),
    ("resnet18", "opacus-functorch"),
    ("resnet18", "opacus-ghost"),
    ("vit-tiny", "expanded-weights"),  # the class token's expand
    ("vit-tiny", "memconv-streaming"),  # not an nn.Sequential
    # the class token and position embedding belong to no layer: no grad_batch
    *(("vit-tiny", e) for e in ENGINES["grads"] if e.startswith("memconv-modules")),
    *(
        (m, e)
        for m in ("resnet18-gn", "wrn16-4-gn", "vit-tiny")
        for e in ENGINES["grads"]
        if "backpack" in e
    ),
}
CASES = [
    {"model": "seed", "batch": 2, "side": 28},
    {"model": "resnet18-gn", "batch": 2, "side": 8},
    {"model": "wrn16-4-gn", "batch": 2, "side": 8},
    {"model": "conv1d", "batch": 3, "side": 64},
    {"model": "conv3d", "batch": 3, "side": 8, "depth": 4},
    {"model": "vit-tiny", "batch": 2, "side": 8},
]
IDS = [c["model"] for c in CASES]
#: For per-sample gradients, the GroupNorm ResNets (11.2 M and 2.75 M parameters) run
#: one strategy ("auto") per memconv family, to keep the test fast: the strategies are
#: per-convolution algorithms, each checked on every convolution kind of these models
#: (strided, 1×1, grouped, dilated, 1-D, 3-D) by the other cases and by test_strategies.
ONE_STRATEGY = {"resnet18-gn", "wrn16-4-gn", "vit-tiny"}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: at these tiny shapes, threads only add overhead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(case, task, name, **options):
    model, x, y = build_case({**case, "data": "random"}, CPU)
    model, x = model.double(), x.double()
    engine = ENGINES[task][name]
    if engine.budget:  # halfway between the smallest feasible budget and the free peak
        plan = memconv.plan(model, x, task=task)
        options["memory_budget"] = (plan.smallest_budget + plan.predicted_peak) // 2
    return engine.run(model, x, y, **options)


def _engines(case, task):
    for name, engine in ENGINES[task].items():
        if available(engine) or (case["model"], name) in UNSUPPORTED:
            continue
        one = case["model"] in ONE_STRATEGY and task == "grads"
        if one and ":" in name and not name.endswith((":auto", ":budget")):
            continue
        yield name, engine


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_engine_agrees_with_torch_func(case):
    reference = _run(case, "grads", "torch.func")
    for name, engine in _engines(case, "grads"):
        result = _run(case, "grads", name)
        assert max_rel_deviation(result, reference) < 1e-10, name
        if engine.per_sample and not name.startswith("memconv-modules"):
            assert set(result) == set(reference), name


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_clipping_engine_agrees_with_torch_func_clipping(case):
    grads = _run(case, "grads", "torch.func")
    norms = clip_sum(grads, 1.0)[NORMS]
    max_norm = norms.sort().values[:2].mean().item()  # some samples clipped, some not
    assert (norms > max_norm).any() and (norms <= max_norm).any()
    reference = clip_sum(grads, max_norm)
    assert max_rel_deviation(_run(case, "clip", "torch.func", max_norm=max_norm), reference) == 0
    for name, engine in _engines(case, "clip"):
        result = _run(case, "clip", name, max_norm=max_norm)
        if not engine.per_sample:  # the non-private floor: the plain summed gradient
            assert NORMS not in result
            continue
        assert set(result) == set(reference), name
        assert max_rel_deviation(result, reference) < 1e-10, name


def test_unsupported_peers_fail_loudly():
    model, x, y = build_case({"model": "resnet18", "batch": 2, "side": 16}, CPU)
    with pytest.raises(Exception, match="batch_norm"):
        ENGINES["grads"]["expanded-weights"].run(model, x, y)
    model, x, y = build_case({"model": "resnet18-gn", "batch": 2, "side": 8}, CPU)
    if not available(ENGINES["grads"]["backpack"]):
        with pytest.raises(NotImplementedError, match="does not support GroupNorm"):
            ENGINES["grads"]["backpack"].run(model, x, y)


def test_models_have_the_documented_sizes():
    sizes = {"resnet18-gn": 11_173_962, "wrn16-4-gn": 2_748_890}
    for name, size in sizes.items():
        model, _, _ = build_case({"model": name, "batch": 1, "side": 8, "data": "random"}, CPU)
        assert sum(p.numel() for p in model.parameters()) == size
        assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize("intercept, slope", [(100, 5.3), (50, 40.0), (3000, 0.01), (5000, 1.0)])
def test_largest_batch_search_brackets_the_limit(intercept, slope):
    limit = 4096.0
    probes = []

    def probe(n):
        probes.append(n)
        peak = intercept + slope * n
        return {"aborted": True} if peak > 1.5 * limit else {"peak_alloc_mib": peak}

    result = search(probe, limit, start=64, cap=4096)
    true = max(0, min(4096, int((limit - intercept) // slope)))
    assert result["largest"] <= true
    if result["capped"]:
        assert true == 4096 and result["largest"] == 4096
    else:
        assert result["smallest_failing"] > true
        assert result["smallest_failing"] - result["largest"] <= max(1, 0.03 * result["largest"])
    assert len(probes) == len(set(probes)) <= 8


def test_largest_batch_search_reports_a_non_memory_failure():
    result = search(lambda n: {"error": "RuntimeError: unsupported"}, 4096.0, 64, 1024)
    assert result == {"error": "RuntimeError: unsupported", "probes": 2}


def test_report_renders_tables_and_targets_from_records(tmp_path):
    from memconv.bench.report import fill, render

    path = tmp_path / "clip.jsonl"
    config = {"model": "resnet18-gn", "batch": 64, "side": 32}
    lines = [
        {
            "record": "run",
            "mode": "matrix",
            "task": "clip",
            "command": "memconv bench --task clip",
            "machine": {"cpu": "x", "threads": 2, "torch": "t", "memconv": "m", "python": "p"},
            "started": "2025-01-01T00:00:00+00:00",
            "plot": None,
        },
        {
            "record": "row",
            "task": "clip",
            "case": "resnet18-gn",
            "config": config,
            "engine": "non-private",
            "peak_rss_mib": 400.0,
            "peak_alloc_mib": 380.0,
            "time_s": 2.0,
            "result_mib": 42.6,
        },
        {
            "record": "row",
            "task": "clip",
            "case": "resnet18-gn",
            "config": config,
            "engine": "torch.func",
            "peak_rss_mib": 9000.0,
            "peak_alloc_mib": 8800.0,
            "time_s": 9.0,
            "result_mib": 42.6,
            "deviation": 0.0,
        },
        {
            "record": "row",
            "task": "clip",
            "case": "resnet18-gn",
            "config": config,
            "engine": "memconv:auto",
            "peak_rss_mib": 440.0,
            "peak_alloc_mib": 420.0,
            "time_s": 4.0,
            "result_mib": 42.6,
            "deviation": 1e-7,
        },
        {"record": "done", "elapsed_s": 120.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    sections = render(read_records([str(path)]))
    assert (
        "| memconv:auto | 440 | 420 | 4.000 | 1.10 | 1.11 | 2.00 | 0.44 | 1.0e-07 |"
        in (sections["clip"])
    )
    assert "allocator 1.11 × (**missed**), RSS 1.10 × (met)" in sections["targets"]
    assert "time ≤ 1.25 × non-private: 2.00 × (**missed**)" in sections["targets"]
    assert "memconv bench --task clip    # 2025-01-01, 2.0 min" in sections["commands"]
    page = "intro\n<!-- bench:targets -->\nold\n<!-- /bench:targets -->\nend\n"
    filled = fill(page, sections)
    assert (
        filled.startswith("intro\n<!-- bench:targets -->\n- ResNet-18-GN") and "old" not in filled
    )
    with pytest.raises(ValueError, match="unknown section"):
        fill("<!-- bench:nope -->\n<!-- /bench:nope -->", sections)


def _memconv(*args, timeout=1800):
    return subprocess.run(
        [sys.executable, "-m", "memconv", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_bench_quick_smoke(tmp_path):
    """``memconv bench --quick`` (both tasks) and a quick sweep, end to end: every engine
    runs in a fresh process and agrees; the records are complete; the report renders."""
    files = []
    for task in ("grads", "clip"):
        out = tmp_path / f"{task}.jsonl"
        proc = _memconv("bench", "--quick", "--task", task, "--repeats", "1", "--json", str(out))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        records = read_records([str(out)])
        assert records[0]["record"] == "run" and records[-1]["record"] == "done"
        for row in (r for r in records if r["record"] == "row"):
            if "deviation" in row:
                assert row["deviation"] < 1e-4, row
            else:
                assert (
                    "skipped" in row
                    or not ENGINES[task][row["engine"]].per_sample
                    or (row["config"]["model"], row["engine"]) in UNSUPPORTED
                ), row
        files.append(str(out))
    out, plot = tmp_path / "sweep.jsonl", tmp_path / "sweep.png"
    proc = _memconv(
        "bench",
        "--sweep",
        "batch",
        "--range",
        "2,4",
        "--cases",
        "seed-28",
        "--engines",
        "autograd,torch.func,memconv:auto",
        "--repeats",
        "1",
        "--json",
        str(out),
        "--plot",
        str(plot),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep = [r for r in read_records([str(out)]) if r["record"] == "sweep"]
    assert {(r["value"], r["engine"]) for r in sweep} == {
        (v, e) for v in (2, 4) for e in ("autograd", "torch.func", "memconv:auto")
    }
    assert plot.stat().st_size > 10_000
    page = tmp_path / "page.md"
    proc = _memconv("bench", "--report", *files, str(out), "--markdown", str(page))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = page.read_text()
    assert "<!-- bench:clip -->" in text and "memconv:two-pass" in text and "Time (s)" in text


def test_streaming_engine_agrees_with_autograd_over_several_tiles():
    config = {"model": "streaming-net", "batch": 1, "side": 96, "tile": 48, "data": "random"}
    model, x, y = build_case(config, CPU)
    model, x = model.double(), x.double()
    reference = ENGINES["grads"]["autograd"].run(model, x, y)
    result = ENGINES["grads"]["memconv-streaming"].run(model, x, y)
    assert len(model._memconv_bench_stream[0].tiles((96, 96))) > 1
    assert set(result) == set(reference)
    assert max_rel_deviation(result, reference) < 1e-10


def test_a_probe_stopped_over_the_limit_returns_at_once():
    """A worker that stops itself (os._exit) while memory_profiler's forked child still
    holds its outputs: the runner returns when the worker is done, not at the timeout."""
    import time

    from memconv.bench.largest import probe_config
    from memconv.bench.runner import run_in_subprocess

    base = {
        "case": "seed-28",
        "model": "seed",
        "batch": 8,
        "side": 28,
        "data": "random",
        "task": "grads",
        "engine": "torch.func",
        "device": "cpu",
        "max_norm": 1.0,
    }
    config = probe_config(base, 512, limit_mib=20.0)  # stops at 30 MiB, after the warm-up
    start = time.perf_counter()
    result = run_in_subprocess(config, timeout=100)
    assert result.get("aborted") is True, result
    assert time.perf_counter() - start < 60


def test_largest_batch_search_survives_a_flat_memory_curve():
    """A budgeted engine's memory stops growing with N (it micro-batches): the line
    through two probes is flat, and the search must go on to the cap, not fail."""
    result = search(lambda n: {"peak_alloc_mib": 100.0 + (n < 8)}, 4096.0, 4, 512)
    assert result["largest"] == 512 and result["capped"]


def test_steps_table_runs_at_tiny_repeats(tmp_path):
    """`python -m memconv.bench.steps` end to end on one row, one round (no timing
    asserted): every engine runs and the page's block is refilled."""
    pytest.importorskip("opacus")
    from memconv.bench import steps

    page = tmp_path / "page.md"
    page.write_text("before\n<!-- steps:table -->\nold\n<!-- /steps:table -->\nafter\n")
    assert (
        steps.main(["--repeats", "1", "--warmup", "0", "--rows", "1", "--markdown", str(page)]) == 0
    )
    text = page.read_text()
    assert "old" not in text and "PrivateStep.clip_and_accumulate" in text
    assert text.startswith("before") and text.endswith("after\n")
    assert "wall clock" in text
    args = ["--repeats", "1", "--warmup", "0", "--rows", "1", "--clock", "cpu"]
    assert steps.main([*args, "--markdown", str(page)]) == 0
    assert "thread CPU time" in page.read_text()
    with pytest.raises(ValueError, match="steps:table"):
        steps.fill("no block", "x")


def test_compiled_steps_table_runs_every_engine_compiled(tmp_path):
    """`python -m memconv.bench.steps --compiled` on the MLP row, one timed round after
    the compiling ones: every compiled engine runs (none "fails") into its own block."""
    from memconv.bench import steps

    page = tmp_path / "page.md"
    page.write_text("<!-- steps-compiled:table -->\nold\n<!-- /steps-compiled:table -->\n")
    args = ["--compiled", "--repeats", "1", "--warmup", "3", "--rows", "1"]
    assert steps.main([*args, "--markdown", str(page)]) == 0
    text = page.read_text()
    assert "old" not in text and "fails" not in text
    assert all(column in text for column, _ in steps.COMPILED)
    with pytest.raises(SystemExit):  # memconv's third call compiles: warm-up below it
        steps.main(["--compiled", "--warmup", "2"])


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", CASES[1:3], ids=IDS[1:3])
def test_every_per_layer_engine_agrees_with_torch_func_per_layer_clipping(case):
    grads = _run(case, "grads", "torch.func")
    norms = clip_sum_per_parameter(grads, 1.0)[NORMS]
    max_norm = norms.median().item()  # some parameters' samples clipped, some not
    reference = clip_sum_per_parameter(grads, max_norm)
    assert (
        max_rel_deviation(_run(case, "clip-layer", "torch.func", max_norm=max_norm), reference) == 0
    )
    for name, engine in ENGINES["clip-layer"].items():
        if available(engine):
            continue
        result = _run(case, "clip-layer", name, max_norm=max_norm)
        if engine.compared:
            assert set(result) == set(reference), name
            assert max_rel_deviation(result, reference) < 1e-10, name
        else:  # the floor, and flat clipping: another sum
            result.pop(NORMS, None)
            assert max_rel_deviation(result, reference) > 1e-6, name


#: The models people train, as torchvision and timm write them, at tiny sizes.
ZOO = [
    {"model": "resnet18-tv-gn", "batch": 2, "side": 16},
    {"model": "nf-resnet26", "batch": 2, "side": 16},
    {"model": "convnext-atto", "batch": 2, "side": 32},
    {"model": "vit-tiny", "batch": 2, "side": 8},
]


def _zoo_model(case):
    """The case's model in float64, with its zero or tiny initial gains (NF skip-init,
    ConvNeXt layer scale) drawn away from zero so that every branch has a gradient."""
    model, x, y = build_case({**case, "data": "random"}, CPU)
    model, x = model.double(), x.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("skipinit_gain", "gamma")):
                p.uniform_(0.5, 1.5)
    return model, x, y


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", ZOO, ids=[c["model"] for c in ZOO])
def test_zoo_models_per_sample_grads_and_clipping_equal_torch_func(case):
    """per_sample_grads and clip_and_accumulate (default arguments, the table's
    engines) against torch.func on the zoo's models, float64."""
    model, x, y = _zoo_model(case)
    reference = ENGINES["grads"]["torch.func"].run(model, x, y)
    result = ENGINES["grads"]["memconv:default"].run(model, x, y)
    assert set(result) == set(reference)
    assert max_rel_deviation(result, reference) < 1e-10
    norms = clip_sum(reference, 1.0)[NORMS]
    max_norm = norms.min().item() * 1.01  # one sample unclipped, one clipped
    clipped = ENGINES["clip"]["memconv:default"].run(model, x, y, max_norm=max_norm)
    assert max_rel_deviation(clipped, clip_sum(reference, max_norm)) < 1e-10
    assert (
        max_rel_deviation(
            ENGINES["clip"]["torch.func"].run(model, x, y, max_norm=max_norm),
            clip_sum(reference, max_norm),
        )
        == 0
    )


def test_zoo_models_are_written_as_their_libraries_write_them():
    """Parameter counts of torchvision's resnet18 (GroupNorm) and timm's nf_resnet26 and
    convnext_atto with 10 classes (1000 classes: timm's 16.0 M and 3.7 M), and the
    layers that make them hard: in-place ReLU, scaled weight-standardised convolutions,
    LayerNorm2d, a block-owned layer scale."""
    from memconv.bench import models

    sizes = {"resnet18-tv-gn": 11_181_642, "nf-resnet26": 13_966_674, "convnext-atto": 3_377_730}
    built = {}
    for name, size in sizes.items():
        model, _, _ = build_case({"model": name, "batch": 1, "side": 32, "data": "random"}, CPU)
        assert sum(p.numel() for p in model.parameters()) == size, name
        built[name] = model
    assert any(
        isinstance(m, torch.nn.ReLU) and m.inplace for m in built["resnet18-tv-gn"].modules()
    )
    nf = built["nf-resnet26"]
    assert sum(isinstance(m, models.ScaledStdConv2d) for m in nf.modules()) == 29
    assert all(b.skipinit_gain.dim() == 0 for b in nf.modules() if hasattr(b, "skipinit_gain"))
    cn = built["convnext-atto"]
    assert sum(isinstance(m, models.ConvNeXtBlock) for m in cn.modules()) == 12
    assert any(isinstance(m, models.LayerNorm2d) for m in cn.modules())


def test_report_renders_the_models_table_apart(tmp_path):
    """Records of a ``--table models`` run fill the models section with targets and stay
    out of the per-case tables."""
    from memconv.bench.report import render

    config = {"model": "nf-resnet26", "batch": 64, "side": 64}
    head = {
        "record": "run",
        "mode": "matrix",
        "command": "memconv bench --table models",
        "machine": {"cpu": "x", "threads": 2, "torch": "t", "memconv": "m", "python": "p"},
        "started": "2025-01-01T00:00:00+00:00",
        "plot": None,
        "table": "models",
    }

    def row(task, engine, rss, alloc, time, **more):
        return {
            "record": "row",
            "task": task,
            "case": "nf-resnet26",
            "config": config,
            "engine": engine,
            "peak_rss_mib": rss,
            "peak_alloc_mib": alloc,
            "time_s": time,
            "result_mib": 53.3,
            "params": 13_966_674,
            **more,
        }

    clip = [
        {**head, "task": "clip"},
        row("clip", "torch.func", 9000.0, 8000.0, 10.0, deviation=0.0),
        row("clip", "non-private", 400.0, 300.0, 2.0),
        row("clip", "memconv:default", 440.0, 330.0, 2.5, deviation=1e-7),
        {
            "record": "row",
            "task": "clip",
            "case": "nf-resnet26",
            "config": config,
            "engine": "opacus-ghost",
            "error": "RuntimeError: in-place",
        },
    ]
    grads = [
        {**head, "task": "grads"},
        row("grads", "torch.func", 9000.0, 8000.0, 10.0),
        row("grads", "memconv:default", 900.0, 800.0, 5.0, deviation=1e-7),
    ]
    for name, lines in (("m.jsonl", clip), ("g.jsonl", grads)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    sections = render(read_records([str(tmp_path / "m.jsonl"), str(tmp_path / "g.jsonl")]))
    models = sections["models"]
    assert "| NF-ResNet-26 (3×64×64, 14.0 M parameters) | non-private step | 400 |" in models
    assert "| clip_and_accumulate (defaults) | 440 | 330 | 2.500 | 1.10 | 1.10 | 1.25 |" in models
    assert "| Opacus ghost clipping | fails: RuntimeError: in-place |" in models
    assert "peak ≤ 1.15 × non-private: allocator 1.10 × (met), RSS 1.10 × (met)" in models
    assert "time ≤ 1.30 × non-private: 1.25 × (met)" in models
    assert "faster than torch.func: 5.000 s vs 10.000 s = 0.50 × (met)" in models
    assert "faster than torch.func" in sections["targets"]
    assert "no measurements" in sections["clip"] and "no measurements" in sections["grads"]


def test_table_applies_to_the_matrix_only():
    import argparse

    from memconv.bench import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--table", "models", "--sweep", "batch", "--cases", "seed-28"])
    with pytest.raises(ValueError, match="--table applies only in the matrix mode"):
        bench.check_arguments(args)
    args = parser.parse_args(["--task", "clip", "--table", "models", "--cases", "convnext-atto"])
    assert bench.check_arguments(args)["cases"] == ["convnext-atto"]


def test_inprocess_writes_each_row_with_its_ratio_and_skips_what_will_not_fit(
    tmp_path, monkeypatch
):
    """python -m memconv.bench.inprocess: a run record naming the device, then a record
    per engine as it completes (the floor's ratio 1), and a row the budget cannot hold
    recorded as skipped, not measured."""
    from memconv.bench import inprocess

    rows = (("grads", "seed-28", 2, ("autograd", "memconv:step")),) * 2
    monkeypatch.setattr(inprocess, "QUICK_ROWS", rows)
    # start, the first row's check, its start and its engines' at 0 s; its end and
    # what follows at 5 s: one second left of six, for a row that took five
    clock = [0.0] * 5 + [5.0]
    monkeypatch.setattr(inprocess, "_now", lambda: clock.pop(0) if len(clock) > 1 else clock[0])
    out = tmp_path / "ip.jsonl"
    argv = ["--device", "cpu", "--quick", "--repeats", "1", "--time-budget", "6"]
    assert inprocess.main([*argv, "--json", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["record"] == "run" and records[0]["device"] == {"type": "cpu"}
    measured = [r for r in records if r["record"] == "row"]
    assert [r["engine"] for r in measured] == ["autograd", "memconv:step"]
    assert measured[0]["time_x"] == 1.0 and measured[1]["time_s"] > 0
    assert records[-1]["record"] == "skipped" and records[-1]["case"] == "seed-28"


def test_a_peer_that_does_not_import_is_reported_not_run(monkeypatch):
    """A peer found but failing to import (Opacus without scipy) is a reason to skip."""
    import importlib

    from memconv.bench import engines

    engine = engines.Engine("x", "grads", None, "x", requires="json")
    real = importlib.import_module
    engines._import_error.cache_clear()
    monkeypatch.setattr(
        importlib,
        "import_module",
        lambda name: (
            (_ for _ in ()).throw(ImportError("no scipy")) if name == "json" else real(name)
        ),
    )
    try:
        assert "json does not import here (no scipy)" == engines.available(engine)
    finally:
        engines._import_error.cache_clear()


def test_streaming_engine_on_a_torchvision_trunk_case():
    """The stream-* cases: a trunk as torchvision writes it and a head; the tile chosen
    for the case's budget, several tiles; the same summed gradient as autograd's."""
    from memconv.streaming import StreamingCNN

    config = {"model": "stream-resnet18", "batch": 1, "side": 256, "data": "random"}
    model, x, y = build_case(config, CPU)
    model, x = model.double(), x.double()
    peaks = [StreamingCNN(model[0], t).predicted_peak(tuple(x.shape)) for t in (64, 256)]
    model.stream_budget = sum(peaks) // 2
    reference = ENGINES["grads"]["autograd"].run(model, x, y)
    result = ENGINES["grads"]["memconv-streaming"].run(model, x, y)
    stream = model._memconv_bench_stream[0]
    assert stream.tile_size == "auto" and stream.last_plan.count > 1
    assert max_rel_deviation(result, reference) < 1e-10
    from memconv.bench.engines import available

    reason = available(ENGINES["grads"]["lightstream"])
    if reason is not None:  # Lightstream lives in its own environment
        assert "--lightstream-python" in reason


def test_report_renders_the_streaming_table_with_scaled_conventional_steps(tmp_path):
    """Where the conventional step does not fit, its figures are scaled by the area from
    a smaller side, marked as such; the targets are read from the rows."""
    from memconv.bench.report import render

    head = {
        "record": "run",
        "mode": "matrix",
        "command": "memconv bench --table streaming",
        "machine": {"cpu": "x", "threads": 2, "torch": "t", "memconv": "m", "python": "p"},
        "started": "2025-01-01T00:00:00+00:00",
        "plot": None,
        "table": "streaming",
        "task": "grads",
    }

    def row(model, side, engine, rss, alloc, time, **more):
        return {
            "record": "row",
            "task": "grads",
            "case": f"{model}-{side}",
            "config": {"model": model, "batch": 1, "side": side},
            "engine": engine,
            "peak_rss_mib": rss,
            "peak_alloc_mib": alloc,
            "time_s": time,
            **more,
        }

    lines = [
        head,
        row("stream-resnet50", 2048, "autograd", 9000.0, 8800.0, 50.0),
        row(
            "stream-resnet50",
            2048,
            "memconv-streaming",
            1000.0,
            900.0,
            60.0,
            deviation=1e-6,
            stream={"tile": 1024, "tiles": 9},
        ),
        {
            "record": "row",
            "task": "grads",
            "case": "stream-resnet50-4096",
            "engine": "autograd",
            "config": {"model": "stream-resnet50", "batch": 1, "side": 4096},
            "aborted": True,
            "rss_at_abort_mib": 20480.0,
        },
        row(
            "stream-resnet50",
            4096,
            "memconv-streaming",
            2000.0,
            1500.0,
            250.0,
            stream={"tile": 1400, "tiles": 16},
        ),
        row("stream-resnet50", 4096, "lightstream", 3000.0, 2500.0, 400.0, deviation=0.5),
        row("stream-resnet50", 8192, "memconv-streaming", 3500.0, 3000.0, 900.0),
    ]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    sections = render(read_records([str(tmp_path / "s.jsonl")]))
    table = sections["streaming"]
    assert "| ResNet-50 trunk | 2048² | conventional | 9,000 | 8,800 | 50.0 | 1.00 |" in table
    assert "conventional (stopped past 20.0 GiB; scaled from 2048²) | ~36,000 | ~35,200 |" in table
    assert "| memconv streaming | 2,000 | 1,500 | 250.0 | ~0.06 | ~0.04 | ~1.25 |" in table
    assert "1400 (16)" in table
    assert "RSS 0.06 × (met)" in table and "time ≤ 1.5 ×: 1.25 × (met)" in table
    assert "against Lightstream: RSS 0.67 ×, time 0.62 × (met" in table
    assert "ResNet-50 trunk, 8192²: streamed step within 4 GiB: peak RSS increase 3.42 GiB" in table
    assert "no measurements" in sections["grads"]


def test_kfac_summary_divides_each_engine_by_the_references_of_its_own_round():
    from memconv.bench.kfac import summary

    case = {"record": "time", "classes": 10, "batch": 8, "warm_up_s": [0.5, 70.0]}
    machine = {"floor_macs": 1e9, "gemm_macs_per_s": 4e10}

    def row(model, engine, repeat, best):
        times = {"time_s": best, "best_s": best, "floor_s": best}
        return {**case, **machine, **times, "model": model, "engine": engine, "repeat": repeat}

    bests = {"plain": (1.0, 2.0), "kfac-compiled": (3.0, 4.0), "curvlinops": (6.0, 8.0)}
    rows = [row("allcnnc", e, r, b[r]) for r in (0, 1) for e, b in bests.items()]
    rows.append(row("resnet18", "plain", 0, 1.0))
    out = summary(rows)
    line = next(x for x in out.splitlines() if x.startswith("| kfac-compiled"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "2.50× (2.00–3.00)"  # / plain, per round
    assert cells[4] == "0.50× (0.50–0.50)"  # / curvlinops
    assert cells[-1] == "0.5 s + 70.0 s, 0.5 s + 70.0 s"
    assert "allcnnc (V = 10, N = 8):" in out and "resnet18 (V = 10, N = 8):" in out
    assert "| model | pricing |" not in out  # no operation counts given


def test_benchmark_backend_is_cudagraphs_only_on_cuda_without_triton(monkeypatch):
    import importlib.util

    from memconv.bench.options import benchmark_backend

    assert benchmark_backend("cpu") == "inductor"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert benchmark_backend("cpu") == "inductor"
    assert benchmark_backend("cuda") == "cudagraphs"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert benchmark_backend("cuda:0") == "inductor"
