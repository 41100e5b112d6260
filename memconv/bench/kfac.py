"""KFAC's step against its arithmetic floor and its operation count, on the CPU.

::

    python -m memconv.bench.kfac --json docs/bench/kfac-floor.jsonl --repeats 3
    python -m memconv.bench.kfac --layers    # the floor and the plans per layer
    python -m memconv.bench.kfac --counts --json docs/bench/kfac-counts.jsonl  # counts only

The **floor** of one KFAC step (forward, backward and BackPACK's ``KFAC`` extension)
counts the multiply-adds no implementation can skip, per convolution (N samples, T
output positions, ``C_in·K/G`` inputs per output, :func:`floor`):

- forward ``N·T·C_out·C_in/G·K``; backward twice that (the weight gradient and the
  input gradient; the first layer has no input gradient);
- the Monte-Carlo square root ``S [V, N, C_out, *T]`` (V = 1 sample for ``KFAC``)
  backpropagated through the layer's input Jacobian, ``V`` times the forward's (not
  for the first layer);
- the input factor's symmetric half, ``N·T·G·(C_in/G·K)(C_in/G·K + 1)/2``;
- the output factor's, ``V·N·C_out(C_out + 1)/2``.

Its time is the multiply-adds priced at the GEMM rate measured in the same process
(one ``torch.mm`` of two ``4096 × 4096`` float32 matrices, the best of three before
and three after the steps). Each
configuration runs in a fresh process (:func:`memconv.bench.runner.run_in_subprocess`),
float32, one thread (``OMP_NUM_THREADS=1``), CIFAR-100 shapes (All-CNN-C, V = 100
classes, batch 8): a warm-up step, then ``--steps`` timed steps (their median, and their best, which
the ratios use: on a shared machine the least disturbed). Engines:
``plain`` (``loss.backward()``), ``kfac`` (BackPACK's ``KFAC`` through memconv's module
extensions, :func:`memconv.integrations.backpack.install`), ``kfac-reduce`` (the same
with ``kfac_approx="reduce"``) and ``backpack`` (BackPACK 1.7.1's ``KFAC`` alone); with
``--engines``, also ``plain-compiled`` (the plain step of ``torch.compile(model)``),
``kfac-compiled`` (:func:`memconv.integrations.backpack.step` on the compiled extended
model), ``kfac-reduce-compiled`` (the same with ``kfac_approx="reduce"``) and
``curvlinops`` (curvlinops' ``KFACLinearOperator``, one Monte-Carlo sample, its
factors of the convolution and Linear weights). Each process records its two
warm-up steps' times (a compiled engine's trace and first compilation); ``--model
resnet18`` times the CIFAR ResNet-18 in eval mode instead of All-CNN-C::

    python -m memconv.bench.kfac --engines plain,plain-compiled,kfac,kfac-compiled,curvlinops \
        --no-op-counts --repeats 2 [--model resnet18]

``--launches`` counts the host launches of one step of each engine instead, each in a
fresh process (top-level ATen operations plus inductor's compiled kernels, kernel
profiling on: a compiled step's launches)::

    python -m memconv.bench.kfac --launches --no-op-counts \
        --engines plain,kfac,kfac-reduce,plain-compiled,kfac-compiled,kfac-reduce-compiled

The **operation counts** (:func:`memconv.bench.ops.count`: top-level ATen operations
of one step, a plain step's and a KFAC step's, on All-CNN-C and the CIFAR ResNet-18 in
eval mode of :mod:`memconv.bench.second_order`) are taken with the CPU's prices and
with the shipped CUDA calibration's (the products per slab that a GPU's prices choose,
:func:`memconv.conv.kronecker.expand_plan`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch
from torch import Tensor, nn

from ..strategies import costs
from .runner import JsonLines, run_in_subprocess
from .second_order import MODELS, RESIDUAL

#: The engines of the floor's table (the default run).
FLOOR_ENGINES = ("plain", "kfac", "kfac-reduce", "backpack")
#: Every engine: the floor's, and the compiled steps against curvlinops' KFAC.
ENGINES = (
    *FLOOR_ENGINES,
    "plain-compiled",
    "kfac-compiled",
    "kfac-reduce-compiled",
    "curvlinops",
)
#: Each model's classes V.
CLASSES = {"allcnnc": 100, "resnet18": 10}
#: The side of the square matrices whose product measures the GEMM rate.
GEMM_SIDE = 4096


def conv_layers(model: nn.Module, x: Tensor) -> list[dict]:
    """Each convolution's call on ``x``: ``{"n", "c_in", "c_out", "k", "t", "groups",
    "first"}`` (``first``: its input is the model's input, no input gradient)."""
    found = []

    def hook(module, args, output):
        found.append(
            {
                "n": args[0].shape[0],
                "c_in": module.in_channels,
                "c_out": module.out_channels,
                "k": math.prod(module.kernel_size),
                "t": math.prod(output.shape[2:]),
                "groups": module.groups,
                "first": args[0] is x,
            }
        )

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return found


def layer_floor(layer: dict, samples: int = 1) -> dict:
    """One convolution's multiply-adds of the floor, per term (module docstring);
    ``samples``: V, the rows of the backpropagated square root."""
    fwd = layer["n"] * layer["t"] * layer["c_out"] * layer["c_in"] // layer["groups"] * layer["k"]
    d = layer["c_in"] // layer["groups"] * layer["k"]
    return {
        "forward": fwd,
        "backward": fwd if layer["first"] else 2 * fwd,
        "sqrt": 0 if layer["first"] else samples * fwd,
        "input_factor": layer["n"] * layer["t"] * layer["groups"] * d * (d + 1) // 2,
        "output_factor": samples * layer["n"] * layer["c_out"] * (layer["c_out"] + 1) // 2,
    }


def floor(layers: list[dict], samples: int = 1) -> dict:
    """The multiply-adds of one KFAC step's floor, per term summed over the layers,
    ``"total"`` and ``"plain"`` (forward and backward)."""
    out = {"forward": 0, "backward": 0, "sqrt": 0, "input_factor": 0, "output_factor": 0}
    for layer in layers:
        for term, macs in layer_floor(layer, samples).items():
            out[term] += macs
    out["total"] = sum(out.values())
    out["plain"] = out["forward"] + out["backward"]
    return out


def layer_table(model: str = "allcnnc", classes: int = 100, batch: int = 8) -> str:
    """Markdown: each convolution's floor (M multiply-adds per term) and the plan of
    its input factor (:func:`memconv.conv.kronecker.expand_plan`, default budget):
    slabs and products per slab priced by the CPU's and by the CUDA calibration, in an
    eager step and in a compiled step's trace (its launches and its join priced; for
    c > 1 whether its row blocks are joined by a gather or accumulated in place by one
    custom operator)."""
    from .._torch import make_fx_real
    from ..conv.kronecker import expand_plan

    def traced_chunks(module, inp) -> str:  # c, and for c > 1 the form it takes
        chosen = []

        def trace(x):
            chosen.append(expand_plan(module, x))
            return x.sum()

        make_fx_real(trace, (inp,))
        (plan,) = chosen
        if plan.chunks == 1:
            return "1"
        return f"{plan.chunks}, {'joined' if plan.joined else 'in place'}"

    net, x, _ = _inputs(model, classes, batch)
    inputs = []
    hooks = [
        m.register_forward_hook(lambda m, a, o: inputs.append((m, a[0])))
        for m in net.modules()
        if isinstance(m, nn.Conv2d)
    ]
    with torch.no_grad():
        net(x)
    for h in hooks:
        h.remove()
    lines = [
        "| layer | T | forward | backward | √GGN | input factor | output factor "
        "| slabs | c (CPU) | c (CUDA) | c (CPU, compiled) | c (CUDA, compiled) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (module, inp), layer in zip(inputs, conv_layers(net, x)):
        macs = layer_floor(layer)
        chunks = {}
        for pricing in ("cpu", "cuda"):
            with costs.using("cpu", costs.calibration(pricing)):
                plan = expand_plan(module, inp)
                chunks[pricing + " compiled"] = traced_chunks(module, inp)
            chunks[pricing] = plan.chunks
        shape = "×".join(str(v) for v in module.weight.shape)
        cells = " | ".join(f"{macs[t] / 1e6:,.1f}" for t in macs)
        lines.append(
            f"| {shape} | {layer['t']} | {cells} | {plan.slabs} | {chunks['cpu']} "
            f"| {chunks['cuda']} | {chunks['cpu compiled']} | {chunks['cuda compiled']} |"
        )
    total = floor(conv_layers(net, x))
    cells = " | ".join(f"{total[t] / 1e6:,.1f}" for t in list(total)[:5])
    lines.append(f"| all | | {cells} | | | | | |")
    return "\n".join(lines)


def gemm_rate(side: int = GEMM_SIDE, repeats: int = 3) -> float:
    """Multiply-adds per second of one float32 ``torch.mm`` of two square matrices
    (the best of ``repeats`` after a warm-up)."""
    a, b = torch.randn(side, side), torch.randn(side, side)
    a @ b
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return side**3 / best


def _step(engine: str, model_name: str, net: nn.Module, backend: str | None = None):
    """``step(x, y)``: one forward and backward pass of the engine (the compiled ones
    with ``torch.compile``'s ``backend``, inductor where ``None``)."""
    from backpack import backpack, extend, extensions

    loss_fn = nn.CrossEntropyLoss()
    options = {"backend": backend} if backend else {}
    if engine in ("plain", "plain-compiled"):
        run = torch.compile(net, **options) if engine == "plain-compiled" else net

        def plain(x, y):
            net.zero_grad(set_to_none=True)
            loss_fn(run(x), y).backward()

        return plain
    if engine == "curvlinops":
        return _curvlinops_step(net)
    from memconv.integrations import backpack as mb
    from memconv.integrations.backpack.kronecker import module_extension

    ext = extensions.KFAC()
    if engine == "backpack":
        model = extend(net, use_converter=model_name in RESIDUAL)
    else:
        model = mb.extend(net, use_converter=model_name in RESIDUAL)
        ext = mb.install(ext)
        if engine.startswith("kfac-reduce"):
            for cls in {type(m) for m in model.modules()}:
                module_ext = module_extension(ext, cls, kfac_approx="reduce")
                if module_ext is not None:
                    ext.set_module_extension(cls, module_ext, overwrite=True)
    loss_fn = extend(loss_fn)
    compiled = torch.compile(model, **options) if engine.endswith("-compiled") else None

    def kfac(x, y):
        model.zero_grad(set_to_none=True)
        if compiled is not None:
            mb.step(compiled, loss_fn, x, y, ext)
        else:
            with backpack(ext):
                loss_fn(model(x), y).backward()
        for p in model.parameters():
            if hasattr(p, "kfac"):
                delattr(p, "kfac")

    return kfac


def _curvlinops_step(net: nn.Module):
    """curvlinops' ``KFACLinearOperator`` (its factors computed, one Monte-Carlo sample,
    ``kfac_approx="expand"``) on the convolution and Linear weights, the layers it
    covers (biases stay out of it)."""
    from curvlinops import KFACLinearOperator

    params = [m.weight for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]

    def curvlinops_kfac(x, y):
        options = {"fisher_type": "mc", "kfac_approx": "expand"}
        data = [(x, y)]
        op = KFACLinearOperator(
            net, nn.CrossEntropyLoss(), params, data, check_deterministic=False, **options
        )
        op.compute_kronecker_factors()

    return curvlinops_kfac


def _inputs(model_name: str, classes: int, batch: int):
    torch.manual_seed(0)
    net = MODELS[model_name](num_classes=classes)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, classes, (batch,))
    return net, x, y


def measure(engine: str, model: str, classes: int, batch: int, steps: int = 5) -> dict:
    """One engine in this (fresh) process, one thread: a warm-up step, ``steps`` timed
    steps (their median ``time_s`` and best ``best_s``), and the GEMM rate measured
    before and after them (the better of the two: on a shared machine the best times
    are the least disturbed, and the floor is priced at the best rate)."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rate = gemm_rate()
    net, x, y = _inputs(model, classes, batch)
    macs = floor(conv_layers(net, x))
    step = _step(engine, model, net)
    warm_up = []
    for _ in range(2):  # a compiled engine: its trace, then its compilation
        start = time.perf_counter()
        step(x, y)
        warm_up.append(time.perf_counter() - start)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    rate = max(rate, gemm_rate())
    return {
        "time_s": statistics.median(times),
        "best_s": min(times),
        "warm_up_s": warm_up,
        "gemm_macs_per_s": rate,
        "floor_macs": macs["total"],
        "plain_floor_macs": macs["plain"],
        "floor_s": macs["total"] / rate,
        "plain_floor_s": macs["plain"] / rate,
        "load": os.getloadavg()[0],
    }


def launches(engine: str, model: str, classes: int, batch: int, pricing: str = "cpu") -> dict:
    """The host launches of one step of ``engine`` in this (fresh) process
    (:func:`memconv.bench.ops.count`'s ``launches``: top-level ATen operations plus
    inductor's compiled kernels, kernel profiling on), after three warm-up steps (a
    compiled engine's trace and first compilation among them), one thread; memconv's
    products priced by ``pricing``'s calibration (``"cuda"``: the products per slab a
    GPU's prices choose, counted on the CPU)."""
    if pricing != "cpu":
        with costs.using("cpu", costs.calibration(pricing)):
            return launches(engine, model, classes, batch)
    import torch._inductor.config as inductor_config

    from .ops import count

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    inductor_config.cpp.enable_kernel_profile = True  # the kernels, named, for the count
    net, x, y = _inputs(model, classes, batch)
    step = _step(engine, model, net)
    counted = count(lambda: step(x, y), warmup=3)
    return {k: counted[k] for k in ("top_level", "compiled_kernels", "launches")}


def operation_counts(model: str, classes: int, batch: int, pricing: str = "cpu") -> dict:
    """Top-level ATen operations of one plain step, one memconv KFAC step and one of
    BackPACK's ``KFAC`` alone (:func:`memconv.bench.ops.count`; ``None`` where it
    fails), memconv's products priced by ``pricing``'s calibration."""
    from .ops import count

    warnings.simplefilter("ignore")
    out = {}
    for engine in ("plain", "kfac", "backpack"):
        net, x, y = _inputs(model, classes, batch)
        step = _step(engine, model, net)
        with costs.using("cpu", costs.calibration(pricing)):
            try:
                out[engine] = count(lambda step=step, x=x, y=y: step(x, y))["top_level"]
            except Exception:  # BackPACK alone fails on the ResNet's pooling
                out[engine] = None
    return out


def run(args) -> list[dict]:
    header = {"command": "kfac", "repeats": args.repeats}
    log = JsonLines(args.json, header) if args.json else None
    rows = []

    def emit(row):
        rows.append(row)
        if log:
            log.write(row)
        print(json.dumps(row), flush=True)

    for model, classes in CLASSES.items():
        for pricing in ("cpu", "cuda") if args.op_counts else ():
            counts = operation_counts(model, classes, args.batch, pricing)
            case = {"model": model, "classes": classes, "batch": args.batch}
            emit({"record": "ops", **case, "pricing": pricing, **counts})
    classes = CLASSES[args.model]
    case = {"model": args.model, "classes": classes, "batch": args.batch}
    if args.launches:
        for engine in args.engines:
            call = {"engine": engine, **case, "pricing": args.pricing}
            config = {"call": "memconv.bench.kfac:launches", "args": call}
            counted = run_in_subprocess(config, timeout=900)
            emit(
                {"record": "launches", "engine": engine, **case, "pricing": args.pricing, **counted}
            )
        return rows
    for repeat in range(0 if args.counts else args.repeats):
        for engine in args.engines:
            call = {"engine": engine, **case, "steps": args.steps}
            config = {"call": "memconv.bench.kfac:measure", "args": call}
            result = run_in_subprocess(config, timeout=900)
            emit({"record": "time", "engine": engine, "repeat": repeat, **case, **result})
    return rows


def summary(rows: list[dict]) -> str:
    """Markdown: the operation counts, and each engine's median step time, multiple of
    the plain step's (per repeat, then the median) and of the KFAC floor's time."""
    ops = [r for r in rows if r.get("record") == "ops"]
    lines = [
        "| model | pricing | plain step | KFAC step | KFAC / plain | BackPACK's KFAC |",
        "|---|---|---|---|---|---|",
    ]
    lines = lines if ops else []
    for r in ops:
        if r.get("record") == "ops":
            ratio = r["kfac"] / r["plain"]
            theirs = "fails" if r.get("backpack") is None else r["backpack"]
            lines.append(
                f"| {r['model']} | {r['pricing']} | {r['plain']} | {r['kfac']} | {ratio:.1f}× "
                f"| {theirs} |"
            )
    counted = [r for r in rows if r.get("record") == "launches" and "error" not in r]
    if counted:
        lines += [_launch_table(counted), ""]
    times = [r for r in rows if r.get("record") == "time" and "error" not in r]
    for model in dict.fromkeys(r["model"] for r in times):
        lines += [_time_table([r for r in times if r["model"] == model]), ""]
    return "\n".join(lines)


#: The engines each time is divided by (per repeat: the same process round).
REFERENCES = ("plain", "plain-compiled", "curvlinops")


def _time_table(times: list[dict]) -> str:
    """One model's engines: median and best step, the best step's multiple of each
    reference engine's and of the KFAC floor's time, and the two warm-up steps."""
    refs = [e for e in REFERENCES if any(r["engine"] == e for r in times)]
    head = ["engine", "median step", "best step", *(f"/ {e}" for e in refs), "/ KFAC floor"]
    lines = [
        f"{times[0]['model']} (V = {times[0]['classes']}, N = {times[0]['batch']}):",
        "",
        "| " + " | ".join([*head, "warm-up steps"]) + " |",
        "|" + "---|" * (len(head) + 1),
    ]
    by_repeat = {(r["engine"], r["repeat"]): r for r in times}
    for engine in ENGINES:
        mine = [r for r in times if r["engine"] == engine]
        if not mine:
            continue
        cells = [
            engine,
            f"{statistics.median(r['time_s'] for r in mine):.3f} s",
            f"{min(r['best_s'] for r in mine):.3f} s",
        ]
        for ref in refs:
            ratios = [
                r["best_s"] / by_repeat[ref, r["repeat"]]["best_s"]
                for r in mine
                if (ref, r["repeat"]) in by_repeat
            ]
            cells.append(_span(ratios))
        cells.append(_span([r["best_s"] / r["floor_s"] for r in mine]))
        warm = [r.get("warm_up_s") for r in mine if r.get("warm_up_s")]
        cells.append(", ".join(f"{a:.1f} s + {b:.1f} s" for a, b in warm) or "–")
        lines.append("| " + " | ".join(cells) + " |")
    macs = times[0]["floor_macs"] / 1e9
    best = min(r["floor_s"] for r in times)
    rate = max(r["gemm_macs_per_s"] for r in times) / 1e9
    lines.append(
        f"\nKFAC floor: {macs:.2f} G multiply-adds ({best:.3f} s at the best GEMM rate, "
        f"{rate:.1f} GMAC/s)."
    )
    return "\n".join(lines)


def _launch_table(counted: list[dict]) -> str:
    """One model's engines: host launches of one step, and their multiple of the plain
    step's (an eager engine) or of the compiled plain step's (a compiled one)."""
    by_engine = {r["engine"]: r for r in counted}
    lines = [
        f"{counted[0]['model']} (V = {counted[0]['classes']}, N = {counted[0]['batch']}, "
        f"{counted[0].get('pricing', 'cpu')} prices):",
        "",
        "| engine | top-level operations | compiled kernels | launches | / plain step |",
        "|---|---|---|---|---|",
    ]
    for r in counted:
        ref = by_engine.get("plain-compiled" if r["engine"].endswith("compiled") else "plain")
        ratio = f"{r['launches'] / ref['launches']:.2f}×" if ref else "–"
        lines.append(
            f"| {r['engine']} | {r['top_level']} | {r['compiled_kernels']} | "
            f"{r['launches']} | {ratio} |"
        )
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    """The median of the per-repeat ratios and their range."""
    if not values:
        return "–"
    return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this JSON Lines file (overwritten)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per engine")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--engines",
        type=lambda s: s.split(","),
        default=list(FLOOR_ENGINES),
        help=f"comma-separated, of {','.join(ENGINES)} (default: {','.join(FLOOR_ENGINES)})",
    )
    parser.add_argument("--model", choices=list(CLASSES), default="allcnnc", help="timed model")
    parser.add_argument(
        "--no-op-counts",
        dest="op_counts",
        action="store_false",
        help="skip the operation counts (times only)",
    )
    parser.add_argument(
        "--layers", action="store_true", help="print the per-layer floor and plans only"
    )
    parser.add_argument("--counts", action="store_true", help="the operation counts only")
    parser.add_argument(
        "--launches",
        action="store_true",
        help="the host launches of one step of each engine (compiled kernels included), "
        "each in a fresh process, instead of the times",
    )
    parser.add_argument(
        "--pricing",
        choices=["cpu", "cuda"],
        default="cpu",
        help="--launches: memconv's products priced by this device's calibration",
    )
    args = parser.parse_args(argv)
    if args.layers:
        print(layer_table(args.model, CLASSES[args.model], args.batch))
        return 0
    print(summary(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
