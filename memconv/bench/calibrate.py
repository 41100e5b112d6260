"""``memconv calibrate``: fit the cost models' coefficients on the current device.

Every time model memconv chooses with (:data:`memconv.strategies.costs.TIME_MODELS`:
the strategies', the ghost norms' two methods, the instantiating norm route's squares,
``"streaming"``'s tiles) is linear in its coefficients, ``time = offset + Σ_j c_j f_j``
(seconds per multiply-add, per element moved, per kernel call, ...). The command

1. builds a grid of convolution layers (the benchmark models' shapes, N = 16 and 64;
   ``--quick``: three small ones) and, for each model on each layer, times the
   computation (median of ``--repeats`` calls, CUDA-synchronised on a GPU) and
   measures its allocator-level peak (``torch.cuda.max_memory_allocated`` on CUDA,
   the PyTorch profiler's allocation events on the CPU);
2. reads each feature ``f_j`` off the model itself, by pricing the layer with the
   coefficients set to the unit vectors (the models stay the one definition);
3. fits the coefficients by non-negative least squares on relative error,
   ``min Σ_i ((offset_i + Σ_j c_j f_ij − t_i) / t_i)²``, ``c ≥ 0`` (the method the
   CPU constants were fitted with); a coefficient that no layer of the grid exercises
   keeps its current value;
4. fits each memory model's scale ``s`` the same way, ``min Σ_i ((s·p_i − m_i) / m_i)²``
   over the layers whose measured temporaries reach 64 KiB;
5. writes the calibration (``--out``, e.g. ``memconv/calibration/cuda.json``), which
   memconv reads for problems on that device type, with the fit's relative errors.

``--check`` fits nothing: it compares each memory model, as the calibration in use
for the device prices it (or ``--calibration FILE``), against the allocator on that
device, prints the ratios, and exits 1 when one is off by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..conv import ghost
from ..conv import norm_routes as norms
from ..strategies import NO_OPTIONS, Options, Problem, costs, get_strategy
from ..strategies.geometry import ConvGeometry, Operands
from .measure import MiB, median_time, peak_allocated
from .options import check_device, command_line, machine, non_negative_int, positive_float
from .runner import JsonLines

logger = logging.getLogger("memconv")

DESCRIPTION = (
    "Fit the cost models memconv chooses strategies, norm routes and plans with, on the "
    "current device: time and measure a grid of convolution layers per strategy and norm "
    "route, fit the time models' coefficients and the memory models' scales (non-negative "
    "least squares on relative error) and write them to a calibration file that memconv "
    "reads for tensors on that device type. With --check: compare the memory models "
    "against the allocator instead, and exit 1 past --tolerance."
)

#: Strategies timed and measured as themselves (the elementary ones).
STRATEGIES = ("standard", "rochette", "unfold", "shift", "loop")
#: Temporaries below this many bytes are too small for a ratio to mean anything.
MIN_MEASURED = 64 * 1024


def _geom(dims, cin, cout, k, s=1, p=0, d=1, g=1) -> ConvGeometry:
    return ConvGeometry(dims, cin, cout, (k,) * dims, (s,) * dims, (p,) * dims, (d,) * dims, g)


@dataclass(frozen=True)
class Layer:
    """One layer of the grid: a normal-form geometry, its input size and N."""

    name: str
    geom: ConvGeometry
    size: tuple[int, ...]
    n: int

    def problem(self, device: torch.device) -> Problem:
        """Its per-sample float32 problem on ``device``."""
        return Problem(self.geom, self.n, self.size, 4, True, device=device.type)


_SHAPES = (
    ("seed-first", _geom(2, 1, 32, 3, p=1), (56, 56)),
    ("seed-3x3", _geom(2, 32, 64, 3, p=1), (28, 28)),
    ("resnet-stem", _geom(2, 3, 64, 3, p=1), (32, 32)),
    ("resnet-3x3-64", _geom(2, 64, 64, 3, p=1), (16, 16)),
    ("resnet-3x3-s2", _geom(2, 128, 256, 3, s=2, p=1), (16, 16)),
    ("resnet-1x1-s2", _geom(2, 256, 512, 1, s=2), (8, 8)),
    ("resnet-3x3-512", _geom(2, 512, 512, 3, p=1), (4, 4)),
    ("wrn-3x3-256", _geom(2, 256, 256, 3, p=1), (8, 8)),
    ("depthwise", _geom(2, 64, 64, 3, p=1, g=64), (28, 28)),
    ("depthwise-7x7", _geom(2, 40, 40, 7, p=3, g=40), (16, 16)),
    ("dilated-grouped", _geom(2, 32, 64, 3, p=2, d=2, g=4), (24, 24)),
    ("conv1d", _geom(1, 32, 64, 5, p=2), (512,)),
    ("conv1d-strided", _geom(1, 32, 64, 5, s=2, p=2), (512,)),
    ("conv3d", _geom(3, 16, 32, 3, p=1), (8, 12, 12)),
)
#: The default grid: layers of the benchmark models and odd kinds, N = 16 and 64.
GRID = tuple(Layer(f"{name}/N={n}", g, size, n) for n in (16, 64) for name, g, size in _SHAPES)
#: ``--quick``: three small layers (a smoke test of seconds).
QUICK_GRID = (
    Layer("3x3/N=4", _geom(2, 8, 16, 3, p=1), (12, 12), 4),
    Layer("strided/N=4", _geom(2, 8, 16, 3, s=2, p=1), (12, 12), 4),
    Layer("conv1d/N=4", _geom(1, 8, 16, 5, p=2), (64,), 4),
)


# ----------------------------------------------------------------- what is run
@dataclass
class Job:
    """One model on one layer: what runs, how the model prices it, what it returns.

    Attributes:
        model: the cost model (a key of ``TIME_MODELS``).
        layer: the grid's layer.
        run: the computation, timed and measured.
        predict_time: its time model (seconds) under the calibration in use.
        predict_memory: its memory model (bytes), or None (no model of its own).
        result_bytes: bytes of the result, not part of the temporaries.
    """

    model: str
    layer: Layer
    run: object
    predict_time: object
    predict_memory: object
    result_bytes: int


def _operands(layer: Layer, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn((layer.n, layer.geom.in_channels, *layer.size), generator=g)
    t = layer.geom.output_size(layer.size)
    grad = torch.randn((layer.n, layer.geom.out_channels, *t), generator=g)
    return x.to(device), grad.to(device)


def jobs(layer: Layer, device: torch.device, models=None) -> list[Job]:
    """The jobs of ``layer`` (of ``models``, or of every time model)."""
    x, g = _operands(layer, device)
    geom, problem = layer.geom, layer.problem(device)
    per_sample = layer.n * math.prod(geom.weight_shape) * 4
    out = []
    for name in STRATEGIES:
        strategy = get_strategy(name)
        out.append(
            Job(
                name,
                layer,
                lambda s=strategy: s.vjp(x, g, geom, per_sample=True, options=NO_OPTIONS),
                lambda s=strategy: s.time(problem, NO_OPTIONS),
                lambda s=strategy: s.memory(problem, NO_OPTIONS),
                per_sample,
            )
        )
    ops = Operands(x, g, geom)
    budget = norms.DEFAULT_NORM_BUDGET
    for method in ("positions", "offsets"):

        def plan(method=method):
            return ghost.method_tilings(problem, budget)[method]

        out.append(
            Job(
                f"ghost-{method}",
                layer,
                lambda plan=plan: ghost.sq_norms(ops, plan()),
                lambda plan=plan: plan().time,
                lambda plan=plan: plan().memory,
                layer.n * 4,
            )
        )
    grads = torch.randn((layer.n, *geom.weight_shape), device=device)
    out.append(
        Job(
            "instantiate",
            layer,
            lambda: norms.sq_norms(grads),
            lambda: (
                costs.time_coefficients("instantiate", device.type)[0]
                * problem.per_sample_elements()
            ),
            None,
            layer.n * 4,
        )
    )
    # tiles of half the output per axis, run by "shift" (every geometry, no per-call cost)
    tile = tuple(max(1, math.ceil(t / 2)) for t in problem.output_size)
    options = Options(tile_size=tile, inner="shift")
    streaming = get_strategy("streaming")
    out.append(
        Job(
            "streaming",
            layer,
            lambda: streaming.vjp(x, g, geom, per_sample=True, options=options),
            lambda: streaming.time(problem, options),
            None,
            per_sample,
        )
    )
    return [j for j in out if models is None or j.model in models]


def measure(job: Job, device: torch.device, repeats: int) -> dict:
    """Median seconds and temporaries' bytes of one job, with its predictions."""
    seconds = median_time(job.run, repeats, device) if repeats else None
    peak, result = peak_allocated(job.run, device)  # the profiler's overhead after the timing
    del result
    record = {
        "record": "measurement",
        "model": job.model,
        "layer": job.layer.name,
        "seconds": seconds,
        "predicted_seconds": job.predict_time(),
        "measured_bytes": max(int(peak * MiB) - job.result_bytes, 0),
    }
    if job.predict_memory is not None:
        record["predicted_bytes"] = int(job.predict_memory())
    return record


# ----------------------------------------------------------------- the fit
def _copy(data: dict) -> dict:
    return json.loads(json.dumps(data))


def _with_coefficients(data: dict, model: str, values) -> dict:
    out = _copy(data)
    out["time"][model] = dict(zip(costs.TIME_MODELS[model], values))
    return out


def features(job: Job, device_type: str, base: dict) -> tuple[float, list[float]]:
    """``(offset, [f_j])`` of a job's time model: its prediction with the model's own
    coefficients at zero, and what each coefficient multiplies (read off the model by
    setting the coefficients to the unit vectors; the other models' from ``base``)."""
    names = costs.TIME_MODELS[job.model]
    with costs.using(device_type, _with_coefficients(base, job.model, [0.0] * len(names))):
        offset = job.predict_time()
    out = []
    for j in range(len(names)):
        unit = [1.0 if i == j else 0.0 for i in range(len(names))]
        with costs.using(device_type, _with_coefficients(base, job.model, unit)):
            out.append(job.predict_time() - offset)
    return offset, out


def fit_linear(offsets, feats, times, current) -> tuple[list[float], list[float]]:
    """Non-negative least squares on relative error.

    Args:
        offsets: ``[rows]`` seconds each row's model adds besides the coefficients.
        feats: ``[rows][coefficients]`` what each coefficient multiplies.
        times: ``[rows]`` measured seconds (> 0).
        current: the coefficients' current values, kept for those no row exercises.

    Returns:
        ``(coefficients, relative errors per row)``.

    Raises:
        ImportError: without scipy (installed with scikit-learn, ``pip install
            memconv[bench]``).
    """
    import numpy as np
    from scipy.optimize import nnls

    t = np.asarray(times, dtype=float)
    a = np.asarray(feats, dtype=float) / t[:, None]
    b = 1.0 - np.asarray(offsets, dtype=float) / t
    scale = np.linalg.norm(a, axis=0)
    used = scale > 0
    coefficients = np.asarray(current, dtype=float).copy()
    if used.any():
        solved, _ = nnls(a[:, used] / scale[used], b)
        coefficients[used] = solved / scale[used]
    errors = (np.asarray(offsets) + np.asarray(feats, dtype=float) @ coefficients - t) / t
    return [float(f"{c:.3g}") for c in coefficients], [float(e) for e in errors]


def fit_scale(predicted, measured) -> float | None:
    """The scale ``s`` minimising ``Σ ((s·p − m) / m)²`` over rows whose measured
    temporaries reach :data:`MIN_MEASURED` bytes; None when none does."""
    rows = [(p / m) for p, m in zip(predicted, measured) if m >= MIN_MEASURED and p > 0]
    if not rows:
        return None
    return float(f"{sum(rows) / sum(r * r for r in rows):.3g}")


def _summary(errors) -> dict:
    magnitudes = [abs(e) for e in errors]
    return {
        "rows": len(errors),
        "median_relative_error": round(statistics.median(magnitudes), 3),
        "max_relative_error": round(max(magnitudes), 3),
    }


def fit(records: list[dict], job_list: list[Job], device_type: str, base: dict) -> dict:
    """A new calibration from the measurements (``records[i]`` of ``job_list[i]``).

    ``"streaming"`` is fitted last: its offset is its inner strategy's time, priced
    with that strategy's new coefficients.
    """
    data = _copy(base)
    data["device"] = device_type
    report = {}
    unscaled = _copy(base)
    for model in costs.MEMORY_MODELS:
        unscaled["memory"][model]["scale"] = 1.0
    for model in (*[m for m in costs.TIME_MODELS if m != "streaming"], "streaming"):
        rows = [(r, j) for r, j in zip(records, job_list) if j.model == model and r["seconds"]]
        if not rows:
            continue
        got = [features(j, device_type, data) for _, j in rows]
        current = [data["time"][model][c] for c in costs.TIME_MODELS[model]]
        coefficients, errors = fit_linear(
            [o for o, _ in got], [f for _, f in got], [r["seconds"] for r, _ in rows], current
        )
        data["time"][model] = dict(zip(costs.TIME_MODELS[model], coefficients))
        report[f"time/{model}"] = _summary(errors)
    for model in costs.MEMORY_MODELS:
        rows = [j for j in job_list if j.model == model]
        measured = [r["measured_bytes"] for r, j in zip(records, job_list) if j.model == model]
        with costs.using(device_type, unscaled):
            predicted = [j.predict_memory() for j in rows]
        scale = fit_scale(predicted, measured)
        if scale is not None:
            data["memory"][model]["scale"] = scale
            errors = [
                (scale * p - m) / m
                for p, m in zip(predicted, measured)
                if m >= MIN_MEASURED and p > 0
            ]
            report[f"memory/{model}"] = _summary(errors)
    data["fitted"] = {"residuals": report}
    return costs.check(data, "the fit")


# ----------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memconv calibrate``."""
    parser.add_argument(
        "--device", default="cpu", help="torch device to fit on, e.g. cpu or cuda (default: cpu)"
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="write the calibration to PATH (JSON; memconv reads "
        "memconv/calibration/<device type>.json); needed unless --check",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="fit nothing: compare the memory models with the allocator on the device",
    )
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="with --check: the calibration to check (default: the one memconv uses for "
        "the device type)",
    )
    parser.add_argument(
        "--tolerance",
        type=positive_float,
        default=0.25,
        metavar="FRACTION",
        help="with --check: the largest accepted relative error of a memory model "
        "(default: 0.25; temporaries under 64 KiB are held to 64 KiB instead)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="three small layers instead of the full grid"
    )
    parser.add_argument(
        "--repeats",
        type=non_negative_int,
        default=5,
        metavar="R",
        help="timed calls per measurement, the median is fitted (default: 5)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write every measurement to PATH as JSON Lines"
    )


def check_arguments(args) -> None:
    """Validate the options before any work.

    Raises:
        ValueError: a missing ``--out``, an option that does not apply, an unknown or
            unavailable device, an unreadable ``--calibration``.
    """
    check_device(args.device)
    if args.check:
        if args.out:
            raise ValueError("--out applies only without --check (a fit)")
        if args.calibration and not Path(args.calibration).is_file():
            raise ValueError(f"--calibration: no such file {args.calibration!r}")
    else:
        if not args.out:
            raise ValueError("--out PATH is needed: where to write the calibration")
        if args.calibration:
            raise ValueError("--calibration applies only with --check")
        if args.repeats == 0:
            raise ValueError("--repeats must be at least 1 for a fit")


def _table(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = [
        (
            r["model"],
            r["layer"],
            r["predicted_bytes"] / MiB,
            r["measured_bytes"] / MiB,
            r["predicted_bytes"] / r["measured_bytes"] if r["measured_bytes"] else float("nan"),
            "ok" if r["ok"] else "OFF",
        )
        for r in rows
    ]
    return tabulate(
        body,
        headers=["model", "layer", "predicted MiB", "measured MiB", "pred/meas", ""],
        floatfmt=".2f",
        tablefmt="github",
    )


def main(args) -> int:
    """``memconv calibrate``: fit and write, or ``--check``; returns the exit status."""
    check_arguments(args)
    device = torch.device(args.device)
    grid = QUICK_GRID if args.quick else GRID
    header = {
        "record": "run",
        "mode": "calibrate-check" if args.check else "calibrate",
        "command": command_line(getattr(args, "argv", None)),
        "machine": machine(),
        "device": str(device),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    out = JsonLines(args.json, header)
    if args.check:
        data = costs.calibration(device.type)
        if args.calibration:
            data = costs.check(json.loads(Path(args.calibration).read_text()), args.calibration)
        return _check(grid, device, data, args.tolerance, out)
    base = costs.calibration(device.type)
    records, job_list = [], []
    layers = list(grid)
    for i, layer in enumerate(layers):
        logger.info("[%d/%d] %s", i + 1, len(layers), layer.name)
        for job in jobs(layer, device):
            record = measure(job, device, args.repeats)
            out.write(record)
            records.append(record)
            job_list.append(job)
    data = fit(records, job_list, device.type, base)
    data["fitted"].update(
        machine=machine(),
        device=_device_name(device),
        command=header["command"],
        date=header["started"],
        method="non-negative least squares on relative error of median times (time); "
        "least squares on relative error of a scale (memory)",
        grid=f"{len(layers)} layers: " + ", ".join(layer.name for layer in layers),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    for key, summary in data["fitted"]["residuals"].items():
        logger.info(
            "%-24s %3d rows, relative error median %.2f, max %.2f",
            key,
            summary["rows"],
            summary["median_relative_error"],
            summary["max_relative_error"],
        )
    logger.info("wrote %s", args.out)
    return 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return machine()["cpu"]


def _check(grid, device: torch.device, data: dict, tolerance: float, out) -> int:
    rows = []
    with costs.using(device.type, data):
        for layer in grid:
            for job in jobs(layer, device, models=costs.MEMORY_MODELS):
                record = measure(job, device, repeats=0)
                predicted, measured = record["predicted_bytes"], record["measured_bytes"]
                record["ok"] = abs(predicted - measured) <= max(tolerance * measured, MIN_MEASURED)
                out.write(record)
                rows.append(record)
    print(_table(rows))
    off = [r for r in rows if not r["ok"]]
    print(
        f"\n{len(rows) - len(off)} of {len(rows)} memory models within {tolerance:.0%} of the "
        f"allocator on {_device_name(device)} ({device.type})"
    )
    return 1 if off else 0
