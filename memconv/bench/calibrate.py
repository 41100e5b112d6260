"""``memconv calibrate``: fit the cost models' coefficients on the current device.

Every time model memconv chooses with (:data:`memconv.strategies.costs.TIME_MODELS`:
the strategies', the ghost norms' two methods, the instantiating norm route's squares,
``"streaming"``'s tiles, ``"kfac-join"``'s gather of a KFAC input factor's row blocks
into Ω, traced and compiled as a compiled step runs it) is linear in its
coefficients, ``time = offset + Σ_j c_j f_j`` (seconds per multiply-add, per element
moved, per kernel call, ...), and every one of
them has the shared per-operation term (``"operation"``: seconds per tensor
operation, times the operations the computation issues). The command

1. builds a grid of convolution layers (the benchmark models' shapes, N = 8, 16 and 64;
   ``--quick``: three small ones) and, for each model on each layer, times the
   computation (median of ``--repeats`` calls, CUDA-synchronised on a GPU; the
   fastest of ``--rounds`` rounds over the layer's computations in turn) and
   measures its allocator-level peak (``torch.cuda.max_memory_allocated`` on CUDA,
   the PyTorch profiler's allocation events on the CPU);
2. reads each feature ``f_j`` off the model itself, by pricing the layer with the
   coefficients set to the unit vectors (the models stay the one definition);
3. fits the coefficients of all models at once by non-negative least squares on
   relative error, ``min Σ_i ((offset_i + Σ_j c_j f_ij − t_i) / t_i)²``, ``c ≥ 0``
   (the per-operation coefficient is shared by every row); a coefficient that no
   layer of the grid exercises keeps its current value;
4. fits each memory model's scale ``s`` the same way, ``min Σ_i ((s·p_i − m_i) / m_i)²``
   over the layers whose measured temporaries reach 64 KiB;
5. writes the calibration (``--out``, e.g. ``memconv/calibration/cuda.json``), which
   memconv reads for problems on that device type, with the fit's relative errors.

``--check`` fits nothing: it compares each memory model, as the calibration in use
for the device prices it (or ``--calibration FILE``), against the allocator on that
device, prints the ratios, and exits 1 when one is off by more than ``--tolerance``.

``--refit FILE`` measures nothing: it fits the current models to the measurements a
``--json`` file of an earlier run recorded (on another machine: its device type is
the run's), so that a calibration takes a new form of the models without the device
(the coefficients then describe the computations that run measured).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from .._torch import compile_graph, make_fx_real
from ..conv import ghost, kronecker
from ..conv import norm_routes as norms
from ..strategies import NO_OPTIONS, Options, Problem, costs, get_strategy
from ..strategies.geometry import ConvGeometry, Operands
from .measure import MiB, median_time, peak_allocated
from .options import (
    benchmark_backend,
    check_device,
    command_line,
    last_level_cache,
    machine,
    non_negative_int,
    positive_float,
    positive_int,
)
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
STRATEGIES = ("standard", "rochette", "unfold", "shift", "loop", "vmap")
#: Temporaries below this many bytes are too small for a ratio to mean anything.
MIN_MEASURED = 64 * 1024
#: The budget the grid's ghost norms run within (bytes): some layers' Gram matrices
#: are tiled, so that the tiles' costs are measured too.
GHOST_BUDGET = 32 * 2**20


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
    # the small 28x28 CNN of the step benchmarks (and Opacus' MNIST example's sizes)
    ("small-first", _geom(2, 1, 16, 3, p=1), (28, 28)),
    ("small-3x3", _geom(2, 16, 32, 3, p=1), (14, 14)),
    # Opacus' MNIST example (SampleConvNet): an 8x8 kernel at stride 2, then a 4x4
    ("mnist-8x8-s2", _geom(2, 1, 16, 8, s=2, p=3), (28, 28)),
    ("mnist-4x4-s2", _geom(2, 16, 32, 4, s=2), (13, 13)),
    ("seed-first", _geom(2, 1, 32, 3, p=1), (56, 56)),
    ("seed-3x3", _geom(2, 32, 64, 3, p=1), (28, 28)),
    ("resnet-stem", _geom(2, 3, 64, 3, p=1), (32, 32)),
    ("resnet-3x3-64", _geom(2, 64, 64, 3, p=1), (16, 16)),
    # CIFAR ResNet-18's first stage, and 32 channels on 64x64 maps (the tanh CNN's first
    # block at N = 256 moves as much): operands past the last-level cache at N = 64
    ("resnet-3x3-64-32", _geom(2, 64, 64, 3, p=1), (32, 32)),
    ("3x3-32-64px", _geom(2, 32, 32, 3, p=1), (64, 64)),
    ("resnet-3x3-128", _geom(2, 128, 128, 3, p=1), (16, 16)),
    ("resnet-3x3-s2", _geom(2, 128, 256, 3, s=2, p=1), (16, 16)),
    ("resnet-1x1-s2", _geom(2, 256, 512, 1, s=2), (8, 8)),
    ("resnet-3x3-512", _geom(2, 512, 512, 3, p=1), (4, 4)),
    ("wrn-3x3-256", _geom(2, 256, 256, 3, p=1), (8, 8)),
    ("depthwise", _geom(2, 64, 64, 3, p=1, g=64), (28, 28)),
    ("depthwise-7x7", _geom(2, 40, 40, 7, p=3, g=40), (16, 16)),
    # ConvNeXt-atto's third stage at 64x64 images: many small products per sample
    ("depthwise-7x7-4x4", _geom(2, 160, 160, 7, p=3, g=160), (4, 4)),
    ("dilated-grouped", _geom(2, 32, 64, 3, p=2, d=2, g=4), (24, 24)),
    ("conv1d", _geom(1, 32, 64, 5, p=2), (512,)),
    ("conv1d-strided", _geom(1, 32, 64, 5, s=2, p=2), (512,)),
    ("conv3d", _geom(3, 16, 32, 3, p=1), (8, 12, 12)),
)
#: The default grid: layers of the benchmark models and odd kinds, N = 8, 16 and 64.
GRID = tuple(Layer(f"{name}/N={n}", g, size, n) for n in (8, 16, 64) for name, g, size in _SHAPES)
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
        run: the computation, timed and measured (None where nothing runs: a refit).
        predict_time: its time model (seconds) under the calibration in use.
        predict_memory: its memory model (bytes), or None (no model of its own).
        result_bytes: bytes of the result, not part of the temporaries.
        reads: the other time models its prediction reads (``"streaming"``: its inner
            strategy's).
        variant: which way of the model's computation runs, where it has several
            (``"windows=reduction"`` or ``"windows=accumulated"`` for
            ``"ghost-positions"``; ``"summed"`` for a strategy's VJP summed over the
            batch, the conventional gradient), else ``""`` (a strategy's per-sample
            VJP).
    """

    model: str
    layer: Layer
    run: object
    predict_time: object
    predict_memory: object
    result_bytes: int
    reads: tuple = ()
    variant: str = ""


class _Operands:
    """A layer's random operands on a device, made when first read (a refit makes none)."""

    def __init__(self, layer: Layer, device: torch.device):
        self.layer, self.device = layer, device
        self._made = None

    def get(self):
        """``(x [N, C_in, *S], g [N, C_out, *T], per-sample gradients [N, *W])``."""
        if self._made is None:
            layer, geom = self.layer, self.layer.geom
            gen = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn((layer.n, geom.in_channels, *layer.size), generator=gen)
            t = geom.output_size(layer.size)
            g = torch.randn((layer.n, geom.out_channels, *t), generator=gen)
            grads = torch.randn((layer.n, *geom.weight_shape), generator=gen)
            self._made = tuple(v.to(self.device) for v in (x, g, grads))
        return self._made


def jobs(layer: Layer, device, models=None, *, run: bool = True) -> list[Job]:
    """The jobs of ``layer`` (of ``models``, or of every time model) on ``device`` (a
    device, or a device type for a refit); ``run=False``: predictions only."""
    device = torch.device(device)
    operands = _Operands(layer, device)
    if run:  # made now: their allocations are no job's temporaries
        operands.get()
    geom, problem = layer.geom, layer.problem(device)
    per_sample = layer.n * math.prod(geom.weight_shape) * 4
    out = []

    def runner(fn):
        return fn if run else None

    summed = replace(problem, per_sample=False)
    for name in STRATEGIES:
        strategy = get_strategy(name)
        # the per-sample VJP first: a record without a variant is one of it
        for p, variant, nbytes in (
            (problem, "", per_sample),
            (summed, "summed", per_sample // layer.n),
        ):

            def vjp(s=strategy, p=p):
                x, g, _ = operands.get()
                return s.vjp(x, g, geom, per_sample=p.per_sample, options=NO_OPTIONS)

            out.append(
                Job(
                    name,
                    layer,
                    runner(vjp),
                    lambda s=strategy, p=p: s.time(p, NO_OPTIONS),
                    lambda s=strategy, p=p: s.memory(p, NO_OPTIONS),
                    nbytes,
                    variant=variant,
                )
            )
    # the positions method with each way of summing its windows, so that the fit sees
    # what the strided reduction costs beyond the accumulated windows
    ways = [("positions", w) for w in ghost.WINDOWS] + [("offsets", None)]
    for method, windows in ways:

        def plan(method=method, windows=windows):
            return ghost.method_tilings(problem, GHOST_BUDGET, windows)[method]

        def gram(plan=plan):
            x, g, _ = operands.get()
            return ghost.sq_norms(Operands(x, g, geom), plan())

        out.append(
            Job(
                f"ghost-{method}",
                layer,
                runner(gram),
                lambda plan=plan: plan().time,
                lambda plan=plan: plan().memory,
                layer.n * 4,
                variant="" if windows is None else f"windows={windows}",
            )
        )
    out.append(
        Job(
            "instantiate",
            layer,
            runner(lambda: norms.sq_norms(operands.get()[2])),
            lambda: norms.squares_time(problem),
            None,
            layer.n * 4,
        )
    )
    # tiles of half the output per axis, run by "shift" (every geometry, no per-call cost)
    tile = tuple(max(1, math.ceil(t / 2)) for t in problem.output_size)
    options = Options(tile_size=tile, inner="shift")
    streaming = get_strategy("streaming")

    def tiled():
        x, g, _ = operands.get()
        return streaming.vjp(x, g, geom, per_sample=True, options=options)

    out.append(
        Job(
            "streaming",
            layer,
            runner(tiled),
            lambda: streaming.time(problem, options),
            None,
            per_sample,
            reads=("shift",),
        )
    )
    # KFAC's input factor in a compiled step: its row blocks joined into Ω by a gather
    offsets = math.prod(geom.kernel_size)
    side = geom.in_channels // geom.groups * offsets
    chunks = kronecker.most_chunks(geom.in_channels // geom.groups, offsets)
    if chunks > 1:
        out.append(
            Job(
                "kfac-join",
                layer,
                runner(_Join(side, geom.groups, chunks, device)),
                lambda: kronecker.join_time(side, geom.groups, chunks, 4, device.type),
                None,
                geom.groups * side * side * 4,
            )
        )
    return [j for j in out if models is None or j.model in models]


class _Join:
    """The join of random row blocks into Ω ``[G, side, side]``, traced and compiled
    (:func:`memconv.bench.options.benchmark_backend`) at its first call, as a compiled
    KFAC step runs it (:func:`memconv.conv.kronecker.join_time` prices it)."""

    def __init__(self, side: int, groups: int, chunks: int, device: torch.device):
        self.side, self.groups, self.chunks, self.device = side, groups, chunks, device
        self.blocks, self.compiled = None, None

    def __call__(self):
        if self.compiled is None:
            bounds = kronecker.row_bounds(self.side, self.chunks)
            gen = torch.Generator(device="cpu").manual_seed(0)
            self.blocks = [
                torch.randn((self.groups, b - a, self.side - a), generator=gen).to(self.device)
                for a, b in zip(bounds, bounds[1:])
            ]
            graph = make_fx_real(kronecker.join_row_blocks, (self.blocks,))
            backend = benchmark_backend(str(self.device))
            self.compiled = compile_graph(graph, list(self.blocks), backend)
        return self.compiled(*self.blocks)


def measure(job: Job, device: torch.device, repeats: int, seconds: float | None = None) -> dict:
    """Median seconds and temporaries' bytes of one job, with its predictions
    (``seconds``: timed already, see :func:`layer_times`)."""
    if seconds is None and repeats:
        seconds = median_time(job.run, repeats, device)
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
    if job.variant:
        record["variant"] = job.variant
    if job.predict_memory is not None:
        record["predicted_bytes"] = int(job.predict_memory())
    return record


def layer_times(job_list: list[Job], device: torch.device, repeats: int, rounds: int):
    """Each job's median seconds of ``repeats`` calls, in ``rounds`` rounds over the
    layer's jobs in turn, the fastest round kept (a list, in ``job_list``'s order).

    A layer's first calls run slower than its later ones (fresh pages of its
    operands' and results' allocations, other jobs' interference): on this CPU one
    layer's unfold took 2.8 ms in its first round and 0.8–1.0 ms after. As ``timeit``
    keeps its fastest repeat, the fit takes the fastest round."""
    best = [math.inf] * len(job_list)
    for _ in range(rounds):
        for i, job in enumerate(job_list):
            best[i] = min(best[i], median_time(job.run, repeats, device))
    return best


# ----------------------------------------------------------------- the fit
def _copy(data: dict) -> dict:
    return json.loads(json.dumps(data))


def fitted_coefficients(fitted=None) -> list[tuple[str, str]]:
    """``[(model, coefficient)]`` that ``fitted`` names (``"model"``: all of its
    coefficients; ``"model.coefficient"``: that one), in :data:`TIME_MODELS` order;
    every coefficient for None."""
    names = None if fitted is None else set(fitted)
    return [
        (m, c)
        for m, coefficients in costs.TIME_MODELS.items()
        for c in coefficients
        if names is None or m in names or f"{m}.{c}" in names
    ]


def _coefficients(job: Job, fitted=None) -> list[tuple[str, str]]:
    """``[(model, coefficient)]`` a job's time model reads: its own model's, the shared
    per-operation one, and those of the models it reads (:attr:`Job.reads`); of those
    ``fitted`` names only, where given (:func:`fitted_coefficients`)."""
    models = dict.fromkeys((job.model, "operation", *job.reads))
    chosen = set(fitted_coefficients(fitted))
    return [(m, c) for m in models for c in costs.TIME_MODELS[m] if (m, c) in chosen]


def _with_values(data: dict, values: dict) -> dict:
    """``data`` with the time coefficients ``{(model, coefficient): value}`` set."""
    out = _copy(data)
    for (model, name), v in values.items():
        out["time"][model][name] = v
    return out


def features(job: Job, device_type: str, base: dict, fitted=None) -> tuple[float, dict]:
    """``(offset, {(model, coefficient): f_j})`` of a job's time model: its prediction
    with the coefficients it reads (of the models ``fitted``, where given) at zero, and
    what each one multiplies (read off the model by setting them to the unit vectors;
    every other coefficient's from ``base``, part of the offset)."""
    names = _coefficients(job, fitted)
    zero = {k: 0.0 for k in names}
    with costs.using(device_type, _with_values(base, zero)):
        offset = job.predict_time()
    out = {}
    for k in names:
        with costs.using(device_type, _with_values(base, {**zero, k: 1.0})):
            out[k] = job.predict_time() - offset
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


def fit(
    records: list[dict], job_list: list[Job], device_type: str, base: dict, fitted=None
) -> dict:
    """A new calibration from the measurements (``records[i]`` of ``job_list[i]``): every
    time model's coefficients fitted at once (they share the per-operation one), then
    each memory model's scale. ``fitted``: the time models (``"model"``) or single
    coefficients (``"model.coefficient"``) fitted, the others, the per-operation one
    included, held at ``base``'s; None: all.

    Where ``fitted`` leaves a layer some rows that read none of the fitted
    coefficients (the positions method's accumulated windows, for
    ``"ghost-positions.per_window"``), those rows, priced by the held coefficients,
    measure this run's conditions (threads, load) against the calibration's: the
    layer's other rows are divided by their median measured/predicted ratio before
    the fit, so that the fitted coefficients are in the held ones' units."""
    data = _copy(base)
    data["device"] = device_type
    report = {}
    unscaled = _copy(base)
    for model in costs.MEMORY_MODELS:
        unscaled["memory"][model]["scale"] = 1.0
    rows = [(r, j) for r, j in zip(records, job_list) if r.get("seconds")]
    if rows:
        columns = fitted_coefficients(fitted)
        got = [features(j, device_type, data, fitted) for _, j in rows]
        feats = [[f.get(k, 0.0) for k in columns] for _, f in got]
        current = [data["time"][m][c] for m, c in columns]
        times = [r["seconds"] for r, _ in rows]
        if fitted is not None:
            times = _in_held_units(rows, feats, times, device_type, data)
        coefficients, errors = fit_linear([o for o, _ in got], feats, times, current)
        data = _with_values(data, dict(zip(columns, coefficients)))
        for model in costs.TIME_MODELS:
            mine = [e for e, (_, j) in zip(errors, rows) if j.model == model]
            if mine:
                report[f"time/{model}"] = _summary(mine)
        report["time/all"] = _summary(errors)
    for model in costs.MEMORY_MODELS:
        pairs = [(r, j) for r, j in zip(records, job_list) if j.model == model]
        measured = [r["measured_bytes"] for r, _ in pairs]
        with costs.using(device_type, unscaled):
            predicted = [j.predict_memory() for _, j in pairs]
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


def _in_held_units(rows, feats, times, device_type: str, data: dict) -> list[float]:
    """``times`` of the rows reading fitted coefficients divided by the median
    measured/predicted ratio of their layer's rows reading none (:func:`fit`)."""
    ratios: dict[str, list[float]] = {}
    for (_, job), row, t in zip(rows, feats, times):
        if not any(row):
            with costs.using(device_type, data):
                ratios.setdefault(job.layer.name, []).append(t / job.predict_time())
    return [
        t / statistics.median(ratios[job.layer.name])
        if any(row) and ratios.get(job.layer.name)
        else t
        for (_, job), row, t in zip(rows, feats, times)
    ]


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
        "--models",
        metavar="M,M",
        help="measure and fit only these time models or coefficients (comma-separated, "
        "e.g. ghost-positions or ghost-positions.per_window); every other coefficient, "
        "the per-operation one included, and the memory scales keep the calibration's "
        "current values, and a layer's rows that read none of the fitted coefficients "
        "scale its other rows to the held ones' units (default: all)",
    )
    parser.add_argument(
        "--reference",
        metavar="M,M",
        help="with --models: measure these time models too, held, as the reference "
        "for the run's conditions on each layer (e.g. shift,unfold)",
    )
    parser.add_argument(
        "--layers",
        metavar="TEXT,TEXT",
        help="only the grid's layers whose name contains one of these (e.g. N=16)",
    )
    parser.add_argument(
        "--repeats",
        type=non_negative_int,
        default=5,
        metavar="R",
        help="timed calls per measurement, the median is fitted (default: 5)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        metavar="K",
        help="rounds of --repeats calls over each layer's computations in turn; the "
        "fastest round's median is fitted (default: 2)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write every measurement to PATH as JSON Lines"
    )
    parser.add_argument(
        "--refit",
        metavar="FILE",
        help="measure nothing: fit the current models to the measurements FILE (the "
        "--json of an earlier run, on any machine) recorded; --device names the device "
        "type they were measured on (default: the run's)",
    )


def check_arguments(args) -> None:
    """Validate the options before any work.

    Raises:
        ValueError: a missing ``--out``, an option that does not apply, an unknown or
            unavailable device, an unreadable ``--calibration``, an unknown model in
            ``--models``.
    """
    models = getattr(args, "models", None)
    reference = getattr(args, "reference", None)
    if reference and (not models or any(m not in costs.TIME_MODELS for m in reference.split(","))):
        raise ValueError(
            f"--reference: time models of {sorted(costs.TIME_MODELS)}, with --models; "
            f"got {reference!r}"
        )
    if models:
        known = {*costs.TIME_MODELS, *(f"{m}.{c}" for m, c in fitted_coefficients())}
        unknown = [m for m in models.split(",") if m not in known]
        if unknown or args.check:
            raise ValueError(
                "--models: a fit's comma-separated time models or model.coefficient, of "
                f"{sorted(costs.TIME_MODELS)} (not with --check); got {models!r}"
            )
    if getattr(args, "refit", None):
        if args.check:
            raise ValueError("--refit and --check exclude each other")
        if not Path(args.refit).is_file():
            raise ValueError(f"--refit: no such file {args.refit!r}")
        if not args.out:
            raise ValueError("--out PATH is needed: where to write the calibration")
        return
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
    if getattr(args, "refit", None):
        return _refit(args)
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
    base = _with_cache(costs.calibration(device.type), last_level_cache(device))
    base = _with_optional(base)
    fitted = _fitted_models(args)
    records, job_list = [], []
    wanted = args.layers.split(",") if getattr(args, "layers", None) else None
    layers = [layer for layer in grid if wanted is None or any(w in layer.name for w in wanted)]
    for i, layer in enumerate(layers):
        logger.info("[%d/%d] %s", i + 1, len(layers), layer.name)
        layer_jobs = jobs(layer, device, models=_measured_models(fitted, args))
        times = layer_times(layer_jobs, device, args.repeats, getattr(args, "rounds", 2))
        for job, seconds in zip(layer_jobs, times):
            record = measure(job, device, args.repeats, seconds)
            out.write(record)
            records.append(record)
            job_list.append(job)
    data = fit(records, job_list, device.type, base, fitted)
    if fitted is not None:
        grid = f"{len(layers)} layers"
        return _write_partial(args.out, data, base, fitted, header, machine(), grid)
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
    _log_residuals(data)
    logger.info("wrote %s", args.out)
    return 0


def read_measurements(path) -> tuple[dict, list[dict]]:
    """``(run record, measurement records)`` of a ``memconv calibrate --json`` file.

    Raises:
        ValueError: a file without a calibration run record.
    """
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    runs = [r for r in lines if r.get("record") == "run" and r.get("mode") == "calibrate"]
    if not runs:
        raise ValueError(f"{path}: no 'memconv calibrate' run record")
    return runs[0], [r for r in lines if r.get("record") == "measurement"]


def _refit(args) -> int:
    """``memconv calibrate --refit FILE``: the current models fitted to recorded
    measurements, written to ``--out``."""
    run, records = read_measurements(args.refit)
    device_type = torch.device(run.get("device", args.device)).type
    fitted = _fitted_models(args)
    layers = {layer.name: layer for layer in (*GRID, *QUICK_GRID)}
    known, job_list = [], []
    for record in records:
        layer = layers.get(record["layer"])
        if layer is None or record["model"] not in costs.TIME_MODELS:
            continue
        if fitted is not None and record["model"] not in _measured_models(fitted, args):
            continue
        candidates = jobs(layer, device_type, models=(record["model"],), run=False)
        # a record without a variant: the model's first way (its only one, or the
        # positions method's one strided reduction)
        variant = record.get("variant", candidates[0].variant)
        job = next((j for j in candidates if j.variant == variant), None)
        if job is None:
            continue
        known.append(record)
        job_list.append(job)
    machine_of_run = run.get("machine", {})
    cache = machine_of_run.get("cache_bytes") if device_type == "cpu" else None
    base = _with_cache(costs.calibration(device_type), cache)
    base = _with_optional(base)
    data = fit(known, job_list, device_type, base, fitted)
    if fitted is not None:
        grid = f"{len(job_list)} measurements of {len({j.layer.name for j in job_list})} layers"
        refit = {**run, "command": command_line(getattr(args, "argv", None))}
        refit["command"] = f"{refit['command']} (measured by: {run.get('command')})"
        return _write_partial(args.out, data, base, fitted, refit, machine_of_run, grid)
    data["fitted"].update(
        machine=machine_of_run,
        device=machine_of_run.get("gpu") or machine_of_run.get("cpu") or device_type,
        command=command_line(getattr(args, "argv", None)),
        date=run.get("started"),
        measured_by=run.get("command"),
        method="refit (--refit): the current models fitted to the measurements of "
        f"{Path(args.refit).name}, made on {run.get('started')} by memconv "
        f"{machine_of_run.get('memconv', '?')}; non-negative least squares on relative "
        "error of median times (time), least squares on relative error of a scale "
        "(memory)",
        grid=f"{len(job_list)} measurements of {len({j.layer.name for j in job_list})} layers",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    _log_residuals(data)
    logger.info("wrote %s", args.out)
    return 0


def _with_optional(base: dict) -> dict:
    """``base`` with each model it leaves out (:data:`memconv.strategies.costs.OPTIONAL_MODELS`)
    at zero coefficients and a memory scale of 1, for a fit to fill in."""
    missing = [m for m in costs.OPTIONAL_MODELS if m not in base["time"]]
    if not missing:
        return base
    out = _copy(base)
    for m in missing:
        out["time"][m] = dict.fromkeys(costs.TIME_MODELS[m], 0.0)
        if m in costs.MEMORY_MODELS:
            out["memory"].setdefault(m, {"scale": 1.0})
    return out


def _with_cache(base: dict, cache: int | None) -> dict:
    """``base`` with the fitting machine's last-level cache (bytes) where it is known:
    the spilled-traffic features (``"unfold"``'s ``per_element_spilled``) are read off
    the models with it, and the written calibration records it."""
    return base if cache is None else {**_copy(base), "cache_bytes": int(cache)}


def _fitted_models(args) -> list[str] | None:
    """The time models and coefficients ``--models`` names, or None (all)."""
    return args.models.split(",") if getattr(args, "models", None) else None


def _measured_models(fitted, args) -> set[str] | None:
    """The time models whose jobs a fit of ``fitted`` measures, ``--reference``'s
    included (None: all)."""
    if fitted is None:
        return None
    reference = args.reference.split(",") if getattr(args, "reference", None) else []
    return {name.split(".")[0] for name in fitted} | set(reference)


def _write_partial(out, data: dict, base: dict, fitted, run: dict, machine_of_run, grid) -> int:
    """Write a fit of the time models ``fitted`` only: the memory scales, the other
    models' residuals and their provenance kept as ``base`` has them, this fit's
    appended to ``fitted["refitted"]`` (the partial fits since the whole one)."""
    data["memory"] = base["memory"]
    earlier = base.get("fitted", {}).get("refitted", [])
    data["fitted"] = {
        **{k: v for k, v in base.get("fitted", {}).items() if k != "refitted"},
        "refitted": [
            *earlier,
            {
                "models": fitted,
                "residuals": data["fitted"]["residuals"],
                "command": run.get("command"),
                "date": run.get("started"),
                "machine": machine_of_run,
                "grid": grid,
            },
        ],
    }
    data = costs.check(data, "the fit")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=2) + "\n")
    _log_residuals({"fitted": data["fitted"]["refitted"][-1]})
    logger.info("wrote %s", out)
    return 0


def _log_residuals(data: dict) -> None:
    for key, summary in data["fitted"]["residuals"].items():
        logger.info(
            "%-24s %3d rows, relative error median %.2f, max %.2f",
            key,
            summary["rows"],
            summary["median_relative_error"],
            summary["max_relative_error"],
        )


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
