"""Cost-model calibration: the packaged CPU file reproduces the choices made with the
constants it replaced (``"auto"``, the norm routes, ``"streaming"``, the planner, on a
fixed set of layer shapes and models); a problem's device type picks its file, a
device type without one falls back to the CPU file with a warning; the fit recovers
known coefficients; the calibration command runs on the CPU."""

import json
import logging
from dataclasses import replace

import pytest
import torch

import memconv
from memconv.bench import models
from memconv.bench.cases import build_case
from memconv.conv import ghost
from memconv.conv import norm_routes as norms
from memconv.engine import planning
from memconv.engine.request import Request
from memconv.strategies import NO_OPTIONS, Options, Problem, auto, costs, get_strategy
from memconv.strategies import tiling as streaming
from memconv.strategies.base import batched, pieces
from memconv.strategies.geometry import ConvGeometry

MiB = 2**20
BUDGETS = (None, MiB, 16 * MiB, 256 * MiB)


def _geom(dims, cin, cout, k, s=1, p=0, d=1, g=1):
    return ConvGeometry(dims, cin, cout, (k,) * dims, (s,) * dims, (p,) * dims, (d,) * dims, g)


#: (geometry, N, input size) of layers of the benchmark models and a few odd ones.
SHAPES = {
    "seed-conv1": (_geom(2, 1, 32, 3, p=1), 32, (112, 112)),
    "seed-conv2": (_geom(2, 32, 64, 3, p=1), 32, (56, 56)),
    "seed-28-conv2": (_geom(2, 32, 64, 3, p=1), 64, (14, 14)),
    "rn-stem": (_geom(2, 3, 64, 3, p=1), 64, (32, 32)),
    "rn-3x3-64": (_geom(2, 64, 64, 3, p=1), 64, (32, 32)),
    "rn-3x3-s2": (_geom(2, 128, 256, 3, s=2, p=1), 64, (16, 16)),
    "rn-1x1-s2": (_geom(2, 256, 512, 1, s=2), 64, (8, 8)),
    "rn-3x3-512": (_geom(2, 512, 512, 3, p=1), 64, (4, 4)),
    "wrn-3x3-256": (_geom(2, 256, 256, 3, p=1), 64, (8, 8)),
    "depthwise": (_geom(2, 64, 64, 3, p=1, g=64), 16, (28, 28)),
    "grouped-dilated": (_geom(2, 32, 64, 3, p=2, d=2, g=4), 8, (20, 20)),
    "conv1d": (_geom(1, 16, 32, 7, p=3), 32, (2048,)),
    "conv1d-strided": (_geom(1, 32, 64, 5, s=2, p=2), 32, (512,)),
    "conv3d": (_geom(3, 8, 16, 3, p=1), 8, (16, 24, 24)),
    "small-n1": (_geom(2, 16, 16, 3, p=1), 1, (8, 8)),
    "large-image": (_geom(2, 3, 16, 3, p=1), 2, (512, 512)),
}

# The expected choices below were recorded with the packaged CPU file as last refitted
# ("standard", "rochette", "unfold", "shift" from `memconv calibrate --models
# standard,rochette,unfold,shift`: the grid at N = 8, 16 and 64, per-sample and summed
# VJPs, "unfold"'s unfolded input and "shift"'s operands priced at a spilled rate past
# the L3 cache). Timed against the choices of the file before that refit (median of
# five calls, the faster of two rounds, two threads; no budget): the summed rn-1x1-s2
# 0.12x the time and rn-3x3-512 0.13x, conv1d 0.81x (per-sample) and 0.89x (summed);
# seed-conv1 (one input channel, 112x112) 1.79x (per-sample) and 1.18x (summed), the
# summed conv1d-strided 1.69x and rn-3x3-s2 1.35x; the others within 0.97-1.09x.
# Without a budget a route runs the whole batch in one piece; "auto" splits a layer
# (shift's chunks, streaming's tiles) only where no whole-layer strategy fits the
# budget. "loop" (one sample at a time, its operations growing with N) is a candidate
# of "auto", priced with the CPU's per-operation cost: it is taken where it is priced
# below the best batched strategy by more than UNBATCHED_MARGIN — on the CPU, large
# maps and few channels. "vmap" (torch's own kernel once, the samples as its groups;
# `memconv calibrate --models vmap --reference unfold,shift`, measurements in
# docs/bench/calibration-cpu-vmap.jsonl) is taken where it is priced fastest; on these
# layers it measured 0.25-0.65x the faster of "unfold" and "shift" (the 32 -> 64 layer at 28x28
# 0.44-0.48x, the 64-channel layers of CIFAR ResNets 0.42-0.53x, the depthwise 3x3
# 0.30-0.37x, conv1d 0.51-0.62x, conv3d 0.25-0.32x), and it ties with "loop" on the
# 64-channel 32x32 layers at N = 64 (15-25 ms against 16 ms), where its operations do
# not grow with N.
#: ``"auto"``'s choice per shape (per-sample, summed) under each of BUDGETS.
AUTO = {
    "seed-conv1": ("unfold", "standard", "unfold", "unfold"),
    "seed-conv2": ("vmap", "streaming", "loop", "vmap"),
    "seed-28-conv2": ("vmap", "shift", "vmap", "vmap"),
    "rn-stem": ("unfold", "rochette", "unfold", "unfold"),
    "rn-3x3-64": ("vmap", "loop", "loop", "vmap"),
    "rn-3x3-s2": ("unfold", "shift", "shift", "unfold"),
    "rn-1x1-s2": ("unfold", "unfold", "unfold", "unfold"),
    "rn-3x3-512": ("unfold", "shift", "shift", "unfold"),
    "wrn-3x3-256": ("shift", "shift", "shift", "shift"),
    "depthwise": ("vmap", "shift", "vmap", "vmap"),
    "grouped-dilated": ("rochette", "rochette", "rochette", "rochette"),
    "conv1d": ("vmap", "loop", "vmap", "vmap"),
    "conv1d-strided": ("vmap", "shift", "vmap", "vmap"),
    "conv3d": ("vmap", "streaming", "vmap", "vmap"),
    "small-n1": ("rochette", "rochette", "rochette", "rochette"),
    "large-image": ("loop", "rochette", "rochette", "loop"),
}
#: Where the summed VJP's choice differs from the per-sample one.
AUTO_SUMMED = {
    "seed-conv1": ("standard", "standard", "standard", "standard"),
    "seed-28-conv2": ("vmap", "shift", "vmap", "vmap"),
    "rn-stem": ("rochette", "rochette", "rochette", "rochette"),
    "grouped-dilated": ("rochette", "rochette", "rochette", "rochette"),
    "rn-3x3-s2": ("shift", "shift", "streaming", "shift"),
    "rn-1x1-s2": ("unfold", "streaming", "unfold", "unfold"),
    "rn-3x3-512": ("unfold", "shift", "streaming", "unfold"),
    "conv1d": ("vmap", "loop", "vmap", "vmap"),
    "conv1d-strided": ("vmap", "shift", "vmap", "vmap"),
}
#: The norm route and the ghost norms' method per shape under each of BUDGETS.
ROUTES = {
    "seed-conv1": (
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
    ),
    "seed-conv2": (
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/positions",
    ),
    # its per-sample gradients instantiated by "unfold" are priced below its Gram
    # matrices at every budget
    "seed-28-conv2": (
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/positions",
    ),
    "rn-stem": (
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
    ),
    "rn-3x3-64": (
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/positions",
    ),
    "rn-3x3-s2": ("ghost/offsets", "ghost/offsets", "ghost/offsets", "ghost/offsets"),
    # the offsets method's products priced per product too ("ghost-offsets":
    # per_product, measured on the CPU): the positions method, about as cheap
    # otherwise, wins
    "rn-1x1-s2": ("ghost/positions", "ghost/positions", "ghost/positions", "ghost/positions"),
    "rn-3x3-512": ("ghost/positions", "ghost/positions", "ghost/positions", "ghost/positions"),
    "wrn-3x3-256": ("ghost/positions", "ghost/positions", "ghost/positions", "ghost/positions"),
    "depthwise": (
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
    ),
    "grouped-dilated": (
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
    ),
    "conv1d": (
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/positions",
    ),
    "conv1d-strided": (
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
    ),
    "conv3d": (
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
    ),
    "small-n1": (
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
        "instantiate/offsets",
    ),
    "large-image": (
        "instantiate/offsets",
        "instantiate/positions",
        "instantiate/positions",
        "instantiate/offsets",
    ),
}
#: ``"streaming"``'s inner strategy and tile per shape (default options).
STREAMING = {
    "seed-conv1": ("unfold", (112, 112)),
    "seed-conv2": ("vmap", (28, 56)),
    "seed-28-conv2": ("vmap", (14, 14)),
    "rn-stem": ("unfold", (32, 32)),
    "rn-3x3-64": ("vmap", (4, 32)),
    "rn-3x3-s2": ("shift", (8, 8)),
    "rn-1x1-s2": ("shift", (1, 1)),
    "rn-3x3-512": ("shift", (1, 1)),
    "wrn-3x3-256": ("shift", (4, 8)),
    "depthwise": ("vmap", (28, 28)),
    "grouped-dilated": ("rochette", (20, 20)),
    "conv1d": ("vmap", (2048,)),
    "conv1d-strided": ("vmap", (256,)),
    "conv3d": ("vmap", (16, 24, 24)),
    "small-n1": ("rochette", (8, 8)),
    "large-image": ("unfold", (256, 512)),
}
#: The planner per model and task: (clip route, peak) without a budget; (micro-batch,
#: layer budget, clip route, peak) within a budget halfway to the smallest.
PLANS = {
    # the seed CNN's 32 -> 64 layer on 56x56 maps runs "loop" (leaner than "shift")
    ("seed", "grads"): (None, 148040320, 10, 16181760, None, 90749568),
    ("seed", "norms"): (None, 99471424, 9, 14563584, None, 51990336),
    ("seed", "clip"): ("book-keeping", 105570344, 8, 25890816, "book-keeping", 53712616),
    ("resnet18-gn", "grads"): (None, 946094720, 8, 8388608, None, 830614144),
    ("resnet18-gn", "norms"): (None, 85246016, 8, 8388608, None, 47341632),
    # its 64-channel 32x32 layers instantiate their per-sample gradients by "loop"
    ("resnet18-gn", "clip"): ("book-keeping", 140415912, 11, 5767168, "book-keeping", 106781408),
}


def _problem(name, per_sample=True, device="cpu"):
    geom, n, size = SHAPES[name]
    return Problem(geom, n, size, 4, per_sample, device=device)


@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample", "summed"])
@pytest.mark.parametrize("name", list(AUTO))
def test_auto_chooses_as_before(name, per_sample):
    problem = _problem(name, per_sample)
    got = tuple(auto.choose(problem, Options(memory_budget=b))[0].name for b in BUDGETS)
    assert got == (AUTO[name] if per_sample else AUTO_SUMMED.get(name, AUTO[name]))


@pytest.mark.parametrize("name", list(ROUTES))
def test_norm_routes_and_ghost_methods_as_before(name):
    problem = _problem(name)
    got = tuple(
        f"{norms.choose_route(problem, b).route}/{ghost.choose_tiling(problem, b).method}"
        for b in BUDGETS
    )
    assert got == ROUTES[name]


@pytest.mark.parametrize("name", list(STREAMING))
def test_streaming_inner_and_tile_as_before(name):
    inner, tile = streaming.plan(_problem(name), Options())
    assert (inner.name, tuple(tile)) == STREAMING[name]


@pytest.mark.parametrize("model", ["seed", "resnet18-gn"])
def test_planner_as_before(model):
    torch.manual_seed(0)
    side = 56 if model == "seed" else 32
    net, x, _ = build_case({"model": model, "batch": 16, "side": side, "data": "random"}, "cpu")
    for task in ("grads", "norms", "clip"):
        route, free_peak, micro, layer, route_b, peak = PLANS[(model, task)]
        free = memconv.plan(net, x, task=task, memory_budget=None)
        assert (free.clip_route, free.predicted_peak) == (route, free_peak)
        budget = (free.smallest_budget + free.predicted_peak) // 2
        plan = memconv.plan(net, x, task=task, memory_budget=budget)
        got = (plan.micro_batch, plan.layer_budget, plan.clip_route, plan.predicted_peak)
        assert got == (micro, layer, route_b, peak)


def _clip_route_choice(prof, conv, n):
    """``(norm route, the strategy its instantiating route runs)`` of ``conv`` (a 64 ->
    64 3x3 convolution on 32x32 maps) in the default (lean) DP clip step of a profiled
    model at batch ``n``, within the per-layer budget that plan gives it."""
    request = Request("clip", n, clip_route="book-keeping")
    budget = planning.lean_layer_budget(prof, request, n)
    meta = torch.empty(n, 64, 32, 32, device="meta")
    problem, copied = norms.conv_route_problem(conv, meta, meta, 4)
    room = max(budget - copied, 1)
    return norms.choose_route(problem, room).route, norms.instantiate_strategy(problem, room)


def test_cpu_prices_loop_over_samples_cuda_prices_keep_a_batched_route():
    """The CIFAR ResNet-18-GN's first-stage convolutions (64 -> 64, 3x3, 32x32 maps) in
    the default DP clip step: the CPU's prices take ``"loop"`` at batch 64 (torch's own
    kernel one sample at a time, measured 0.4 to 0.5 times the batched routes' time
    there), its per-operation cost for each of its 5N operations included; the CUDA
    calibration's (11 µs an operation, fast arithmetic) keep a batched route at every
    batch, so a GPU step's number of operations stays flat in the batch."""
    torch.manual_seed(0)
    model = models.resnet18_gn()
    conv = next(
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Conv2d) and (m.in_channels, m.out_channels) == (64, 64)
    )
    prof = planning.profile(model, torch.randn(1, 3, 32, 32))
    assert _clip_route_choice(prof, conv, 64) == ("instantiate", "loop")
    with costs.using("cpu", costs.calibration("cuda")):
        for n in (4, 64, 256):
            route, strategy = _clip_route_choice(prof, conv, n)
            assert route == "ghost" or batched(get_strategy(strategy)), (n, route, strategy)


def test_cpu_prices_accumulate_the_windows_cuda_prices_keep_one_reduction():
    """torchvision ResNet-18's layer1 convolution (64 -> 64, 3x3, 16x16 maps of 64x64
    images) at batch 64 within the 16 MiB per-layer budget the default (lean) plan gives
    it: the CPU's calibration, which prices the strided reduction of the Gram matrix's
    windows as measured there (``per_window``), sums them one kernel offset after
    another; the CUDA calibration keeps one reduction (no operation per kernel offset)
    and the route it chose before."""
    problem = Problem(_geom(2, 64, 64, 3, p=1), 64, (16, 16), 4, True)
    budget = 16 * MiB
    choices = {}
    for device in ("cpu", "cuda"):
        at = replace(problem, device=device)
        tiling = ghost.choose_tiling(at, budget)
        choices[device] = (norms.choose_route(at, budget).route, tiling.method, tiling.windows)
    assert choices == {
        "cpu": ("ghost", "positions", "accumulated"),
        "cuda": ("instantiate", "positions", "reduction"),
    }


def _scaled(data, model, coefficient, factor):
    out = json.loads(json.dumps(data))
    out["time"][model][coefficient] *= factor
    return out


def test_device_type_picks_its_calibration():
    cpu = costs.calibration("cpu")
    # tensor operations a thousand times dearer: "vmap" (six operations) loses to
    # "rochette" (four: one grouped convolution)
    slow_ops = _scaled(cpu, "operation", "per_op", 1000.0)
    with costs.using("calibration-test", slow_ops):
        there = auto.choose(_problem("seed-28-conv2", device="calibration-test"), Options())[0]
        here = auto.choose(_problem("seed-28-conv2"), Options())[0]
    assert here.name == "vmap" and there.name == "rochette"
    assert auto.choose(_problem("seed-28-conv2", device="calibration-test"), Options())[0] is here


def test_memory_scale_applies_per_device():
    problem = _problem("rn-3x3-s2")
    shift = memconv.strategies.get_strategy("shift")
    data = json.loads(json.dumps(costs.calibration("cpu")))
    data["memory"]["shift"]["scale"] = 1.5
    with costs.using("calibration-test", data):
        scaled = shift.memory(_problem("rn-3x3-s2", device="calibration-test"), Options())
    assert scaled == round(1.5 * shift.memory(problem, Options()))


def test_device_without_a_file_falls_back_to_cpu_with_a_warning(caplog):
    costs._WARNED.discard("calibration-missing")
    with caplog.at_level(logging.WARNING, logger="memconv"):
        got = auto.choose(_problem("seed-conv2", device="calibration-missing"), Options())[0]
        auto.choose(_problem("seed-28-conv2", device="calibration-missing"), Options())
    assert got.name == AUTO["seed-conv2"][0]
    warnings = [r for r in caplog.records if "calibration-missing" in r.getMessage()]
    assert len(warnings) == 1 and "cpu" in warnings[0].getMessage()


def test_a_calibration_missing_a_coefficient_is_rejected():
    data = json.loads(json.dumps(costs.calibration("cpu")))
    del data["time"]["shift"]["per_flop"]
    with pytest.raises(ValueError, match="shift"):
        with costs.using("calibration-test", data):
            pass
    data = json.loads(json.dumps(costs.calibration("cpu")))
    data["memory"]["loop"]["scale"] = -1.0
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        costs.check(data, "test")


# ----------------------------------------------------------------- memconv calibrate
def test_features_are_read_off_the_model():
    from memconv.bench import calibrate

    layer = calibrate.QUICK_GRID[0]
    per_sample, summed = calibrate.jobs(layer, torch.device("cpu"), models=("shift",))
    assert (per_sample.variant, summed.variant) == ("", "summed")
    coefficients = costs.calibration("cpu")["time"]
    for job in (per_sample, summed):
        offset, feats = calibrate.features(job, "cpu", costs.calibration("cpu"))
        flops = layer.problem(torch.device("cpu")).flops()
        assert offset == 0.0 and feats["shift", "per_flop"] == flops
        predicted = sum(coefficients[m][c] * f for (m, c), f in feats.items())
        assert job.predict_time() == pytest.approx(predicted)


def test_fit_recovers_known_coefficients_and_scale():
    from memconv.bench import calibrate

    truth = [3e-11, 2e-10, 4e-6]
    gen = torch.Generator().manual_seed(0)
    feats = torch.rand(12, 3, generator=gen, dtype=torch.float64) * torch.tensor([1e9, 1e7, 1e2])
    offsets = [1e-4] * 12
    times = [o + sum(c * f for c, f in zip(truth, row)) for o, row in zip(offsets, feats.tolist())]
    got, errors = calibrate.fit_linear(offsets, feats.tolist(), times, [1.0, 1.0, 1.0])
    assert got == pytest.approx(truth, rel=1e-2) and max(map(abs, errors)) < 1e-2
    # a coefficient no row exercises keeps its current value
    feats[:, 2] = 0
    times = [o + sum(c * f for c, f in zip(truth, row)) for o, row in zip(offsets, feats.tolist())]
    got, _ = calibrate.fit_linear(offsets, feats.tolist(), times, [1.0, 1.0, 7e-6])
    assert got[2] == 7e-6
    measured = [MiB, 4 * MiB, 9 * MiB, 100]
    assert calibrate.fit_scale([m / 1.25 for m in measured], measured) == 1.25


def test_calibrate_command_fits_and_checks_on_the_cpu(tmp_path, monkeypatch, capsys):
    from memconv.bench import calibrate
    from memconv.bench.cli import main

    monkeypatch.setattr(calibrate, "QUICK_GRID", calibrate.QUICK_GRID[:1])
    out = tmp_path / "cpu.json"
    args = ["-q", "calibrate", "--device", "cpu", "--quick", "--repeats", "1"]
    assert main([*args, "--out", str(out), "--json", str(tmp_path / "m.jsonl")]) == 0
    data = costs.check(json.loads(out.read_text()), str(out))
    assert data["device"] == "cpu" and set(data["fitted"]["residuals"]) >= {"time/shift"}
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    # every model measured but the shared per-operation one, fitted with them all
    assert {r["model"] for r in records[1:]} == set(costs.TIME_MODELS) - {"operation"}
    with costs.using("cpu", data):  # the file prices problems
        auto.choose(_problem("rn-3x3-64"), Options())
    # the memory models against the CPU allocator, the fitted file's scales included
    check = ["-q", "calibrate", "--device", "cpu", "--quick", "--check"]
    assert main([*check, "--calibration", str(out)]) == 0
    assert "within 25%" in capsys.readouterr().out


def test_calibrate_models_fits_those_alone(tmp_path, monkeypatch):
    """``--models ghost-positions`` measures the positions method both ways of summing
    its windows and fits its coefficients alone: every other coefficient (the shared
    per-operation one included) and every memory scale stay the calibration's; a
    ``--refit`` of the measurements with ``--models`` fits the same."""
    from memconv.bench import calibrate
    from memconv.bench.cli import main

    monkeypatch.setattr(calibrate, "QUICK_GRID", calibrate.QUICK_GRID[:1])
    out, measured = tmp_path / "cpu.json", tmp_path / "m.jsonl"
    args = ["-q", "calibrate", "--device", "cpu", "--quick", "--repeats", "1"]
    models = ["--models", "ghost-positions"]
    assert main([*args, *models, "--out", str(out), "--json", str(measured)]) == 0
    records = [json.loads(line) for line in measured.read_text().splitlines()[1:]]
    assert [(r["model"], r["variant"]) for r in records] == [
        ("ghost-positions", "windows=reduction"),
        ("ghost-positions", "windows=accumulated"),
    ]
    base, data = costs.calibration("cpu"), costs.check(json.loads(out.read_text()), str(out))
    assert data["memory"] == base["memory"]
    assert {m: c for m, c in data["time"].items() if m != "ghost-positions"} == {
        m: c for m, c in base["time"].items() if m != "ghost-positions"
    }
    assert data["fitted"]["refitted"][-1]["models"] == ["ghost-positions"]
    again = tmp_path / "again.json"
    refit = ["-q", "calibrate", "--refit", str(measured), *models, "--out", str(again)]
    assert main(refit) == 0
    assert json.loads(again.read_text())["time"] == data["time"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cpu", "--models", "nonsense", "--out", "x.json"], "--models"),
        (["--device", "cpu"], "--out"),
        (["--device", "cpu", "--check", "--out", "x.json"], "--out applies only"),
        (["--device", "cpu", "--check", "--calibration", "missing.json"], "--calibration"),
        (["--device", "nonsense", "--out", "x.json"], "--device"),
    ],
)
def test_calibrate_rejects_bad_options_before_any_work(argv, message, capsys):
    from memconv.bench.cli import main

    with pytest.raises(SystemExit):
        main(["calibrate", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_calibrate_on_cuda_without_cuda_says_so(capsys):
    from memconv.bench.cli import main

    with pytest.raises(SystemExit):
        main(["calibrate", "--device", "cuda", "--out", "cuda.json"])
    assert "no CUDA device is available" in capsys.readouterr().err


def test_auto_prices_the_vjp_it_runs_on_its_device(monkeypatch):
    """``"auto"`` prices the VJP it runs (not one adding into a result) with the
    calibration of the tensors' device type, and a result kept in the weight's layout
    as such."""
    seen = []
    choose = auto.choose

    def spy(problem, options):
        seen.append(problem)
        return choose(problem, options)

    monkeypatch.setattr(auto, "choose", spy)
    geom, n, size = SHAPES["rn-3x3-64"]
    x, g = torch.randn(2, 64, 8, 8), torch.randn(2, 64, 8, 8)
    auto.AUTO.vjp(x, g, geom, per_sample=True, options=Options())
    auto.AUTO.vjp(x, g, geom, per_sample=True, options=Options(), contiguous=True)
    assert [(p.device, p.into, p.contiguous) for p in seen] == [
        ("cpu", False, False),
        ("cpu", False, True),
    ]


def test_a_kept_per_sample_result_prices_its_relayout():
    """``"shift"`` returns per-sample gradients offset-major: kept in the weight's layout
    they are copied once more, which its time and memory models add (and only then)."""
    strategy = get_strategy("shift")
    problem = _problem("rn-3x3-64")
    kept = replace(problem, contiguous=True)
    assert strategy.time(kept, NO_OPTIONS) > strategy.time(problem, NO_OPTIONS)
    extra = problem.per_sample_elements() * problem.itemsize
    assert strategy.memory(kept, NO_OPTIONS) == strategy.memory(problem, NO_OPTIONS) + extra
    summed = _problem("rn-3x3-64", per_sample=False)
    assert strategy.time(replace(summed, contiguous=True), NO_OPTIONS) == strategy.time(
        summed, NO_OPTIONS
    )
    x, g = torch.randn(2, 64, 8, 8), torch.randn(2, 64, 8, 8)
    out = strategy.vjp(x, g, problem.geom, per_sample=True, options=NO_OPTIONS)
    assert not out.is_contiguous()  # (else the copy this prices would not happen)


def test_auto_splits_a_layer_only_where_no_whole_strategy_fits():
    """At a budget where ``"shift"`` would run in chunks, ``"auto"`` runs a strategy
    that fits in one piece; with a budget none does, it splits."""
    problem = _problem("seed-conv2")
    options = Options(memory_budget=16 * MiB)
    shift = get_strategy("shift")
    assert pieces(shift, problem, options) > 1
    chosen, sub, _, fits = auto.choose(problem, options)
    assert fits and pieces(chosen, problem, sub) == 1
    tight = Options(memory_budget=MiB)
    chosen, sub, _, fits = auto.choose(problem, tight)
    assert fits and pieces(chosen, problem, sub) > 1


# ----------------------------------------------------------------- spilled traffic
@pytest.mark.parametrize("name", ["unfold", "shift"])
def test_a_working_set_past_the_cache_pays_the_spilled_rate(name):
    """``"unfold"``'s unfolded input (151 MB) and ``"shift"``'s operands (36 MB) of a 64
    -> 64 layer at 32x32, N = 64, are larger than a recorded 32 MiB cache: the time
    model adds ``per_element_spilled`` per element moved; a small layer's do not, and
    without a recorded cache nothing spills."""
    strategy = get_strategy(name)
    big, small = _problem("rn-3x3-64"), _problem("small-n1")
    data = json.loads(json.dumps(costs.calibration("cpu")))
    data["time"][name]["per_element_spilled"] = 1e-9
    data["cache_bytes"] = 32 * MiB
    without = json.loads(json.dumps(data))
    del without["cache_bytes"]
    with costs.using("calibration-test", data):
        spilled = [
            strategy.time(replace(p, device="calibration-test"), NO_OPTIONS) for p in (big, small)
        ]
    with costs.using("calibration-test", without):
        kept = [
            strategy.time(replace(p, device="calibration-test"), NO_OPTIONS) for p in (big, small)
        ]
    assert spilled[0] > kept[0] and spilled[1] == kept[1]
    if name == "unfold":  # every element it moves, at the spilled rate
        geom = big.geom
        cols = big.n * geom.in_channels * geom.kernel_numel * big.positions
        traffic = 3 * cols + big.grad_elements() + big.per_sample_elements()
        assert spilled[0] - kept[0] == pytest.approx(1e-9 * traffic)
    data["cache_bytes"] = -1
    with pytest.raises(ValueError, match="cache_bytes"):
        costs.check(data, "test")


def test_the_summed_unfold_is_priced_at_its_own_rates():
    """The summed VJP's einsum (one product over N·T per group) reads
    ``per_flop_summed`` and ``per_element_summed``; the per-sample VJP does not."""
    unfold = get_strategy("unfold")
    data = json.loads(json.dumps(costs.calibration("cpu")))
    base = [unfold.time(_problem("rn-stem", s), NO_OPTIONS) for s in (True, False)]
    data["time"]["unfold"]["per_flop_summed"] *= 2
    with costs.using("cpu", data):
        got = [unfold.time(_problem("rn-stem", s), NO_OPTIONS) for s in (True, False)]
    assert got[0] == base[0] and got[1] > base[1]


def test_a_layer_keeps_its_fastest_round():
    """``memconv calibrate`` times each layer's jobs in rounds and keeps the fastest."""
    from memconv.bench import calibrate

    calls = {"n": 0}

    def slow_then_fast():
        calls["n"] += 1
        if calls["n"] <= 4:  # the first round (a warm-up and three timed calls)
            import time

            time.sleep(0.02)

    job = replace(
        calibrate.jobs(calibrate.QUICK_GRID[0], "cpu", ("shift",), run=False)[0],
        run=slow_then_fast,
    )
    (one,) = calibrate.layer_times([job], torch.device("cpu"), repeats=3, rounds=1)
    calls["n"] = 0
    (two,) = calibrate.layer_times([job], torch.device("cpu"), repeats=3, rounds=2)
    assert one >= 0.02 > two


def test_a_calibration_without_the_vmap_model_does_not_price_it():
    """``"vmap"`` is an optional model (fitted after the CUDA file was): a calibration
    without it passes the check, and ``"auto"`` never takes the strategy there, nor in
    float64; it still runs when named."""
    data = json.loads(json.dumps(costs.calibration("cpu")))
    del data["time"]["vmap"], data["memory"]["vmap"]
    vmap = get_strategy("vmap")
    with costs.using("calibration-test", data):
        assert not costs.priced("vmap", "calibration-test")
        for name in SHAPES:
            problem = _problem(name, device="calibration-test")
            assert vmap.time(problem, NO_OPTIONS) == float("inf")
            for b in BUDGETS:
                assert auto.choose(problem, Options(memory_budget=b))[0].name != "vmap", name
            assert vmap.memory(problem, NO_OPTIONS) == vmap.memory(_problem(name), NO_OPTIONS)
    assert costs.priced("vmap", "cpu") and not costs.priced("vmap", "cuda")
    # float64 runs ATen's native kernel group by group: not priced either
    for name in SHAPES:
        problem = replace(_problem(name), itemsize=8)
        assert vmap.time(problem, NO_OPTIONS) == float("inf")
        assert auto.choose(problem, Options())[0].name != "vmap", name
    # a partial fit starts it at zero coefficients and a memory scale of 1
    from memconv.bench.calibrate import _with_optional

    filled = _with_optional(data)
    assert filled["time"]["vmap"] == dict.fromkeys(costs.TIME_MODELS["vmap"], 0.0)
    assert filled["memory"]["vmap"] == {"scale": 1.0} and "vmap" not in data["time"]
    costs.check(filled, "test")
