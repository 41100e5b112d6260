"""Curvature: BackPACK's second-order extensions with and without memconv, and curvlinops.

::

    python -m memconv.bench.second_order --json docs/bench/second-order.jsonl \\
        --markdown docs/curvature.md --plot docs/bench/second-order.png
    python -m memconv.bench.second_order --quick      # a smoke run, about a minute

One step (forward and backward pass) per configuration, each in a fresh process
(:func:`memconv.bench.runner.run_in_subprocess`): a warm-up step on two samples,
then the peak RSS increase and the time of one step, then the allocator peak of
another (:mod:`memconv.bench.measure`); the size of the curvature each step returns
(held at the peak by every engine) is recorded as ``result_mib``. Engines:

- ``plain``: ``loss.backward()``, the reference of every ratio;
- ``backpack``: BackPACK 1.7.1's extension alone (``extend(model, use_converter=True)``
  for the residual models);
- ``memconv``: the same extension object passed through
  :func:`memconv.integrations.backpack.installed` (and memconv's Kronecker module
  extensions, :mod:`memconv.integrations.backpack.kronecker`, for KFAC/KFLR/KFRA),
  the residual models extended by :func:`memconv.integrations.backpack.extend`
  (BackPACK's converter plus ConvNeXt's ``LayerNorm2d`` and layer scale as modules);
- ``curvlinops``: curvlinops' ``KFACLinearOperator`` (``fisher_type="mc"`` for KFAC,
  ``"type-2"`` for KFLR, ``kfac_approx="expand"``) on the convolution and Linear
  weights; curvlinops 3.0.1 has no exact GGN diagonal (only Hutchinson estimates),
  so it is measured for the Kronecker factors only.

Models (CIFAR shapes, 3×32×32, V classes = the exact extensions' V): All-CNN-C
(Springenberg et al. 2015, as in BackPACK's benchmarks, dropout removed), a CIFAR
ResNet-18 with BatchNorm in eval mode, and a ConvNeXt-style net
(:func:`memconv.bench.models.convnext_atto`). KFRA backpropagates a dense
``[C·H·W]²`` matrix (96·32·32 = 98,304 rows on All-CNN-C's first layer, 36 GiB in
float32): it is not run on these models. float32, ``--threads`` torch threads (1 by
default, so that engines compare on equal terms on a shared machine); the load
average is recorded with every row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import memconv

from .measure import median_time, peak_allocated, peak_rss_increase
from .models import convnext_atto
from .report import fill_block
from .runner import JsonLines, read_records, run_in_subprocess

CPU = torch.device("cpu")
ENGINES = ("plain", "backpack", "memconv", "curvlinops")
#: BackPACK's second-order extensions, by class name.
EXTENSIONS = (
    "KFAC",
    "KFLR",
    "DiagGGNMC",
    "DiagGGNExact",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "DiagHessian",
    "BatchDiagHessian",
    "SqrtGGNExact",
    "SqrtGGNMC",
)
SAVEFIELDS = {
    "KFAC": "kfac",
    "KFLR": "kflr",
    "DiagGGNMC": "diag_ggn_mc",
    "DiagGGNExact": "diag_ggn_exact",
    "BatchDiagGGNExact": "diag_ggn_exact_batch",
    "BatchDiagGGNMC": "diag_ggn_mc_batch",
    "DiagHessian": "diag_h",
    "BatchDiagHessian": "diag_h_batch",
    "SqrtGGNExact": "sqrt_ggn_exact",
    "SqrtGGNMC": "sqrt_ggn_mc",
}
CURVLINOPS_FISHER = {"KFAC": "mc", "KFLR": "type-2"}


# ------------------------------------------------------------------------- models


def all_cnn_c(num_classes: int = 100) -> nn.Sequential:
    """All-CNN-C (Springenberg et al. 2015) for 3×32×32 inputs as DeepOBS and BackPACK's
    benchmarks build it, without its dropout layers (1.4 M parameters at 100 classes)."""

    def conv(c_in, c_out, k, stride=1, padding=1):
        return [nn.Conv2d(c_in, c_out, k, stride=stride, padding=padding), nn.ReLU()]

    return nn.Sequential(
        *conv(3, 96, 3),
        *conv(96, 96, 3),
        *conv(96, 96, 3, stride=2),
        *conv(96, 192, 3),
        *conv(192, 192, 3),
        *conv(192, 192, 3, stride=2),
        *conv(192, 192, 3, padding=0),
        *conv(192, 192, 1, padding=0),
        *conv(192, num_classes, 1, padding=0),
        nn.AvgPool2d(6),
        nn.Flatten(),
    )


class _Block(nn.Module):
    """CIFAR ResNet's basic block with BatchNorm (He et al. 2016)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu2 = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(out + self.shortcut(x))


def cifar_resnet18_eval(num_classes: int = 10) -> nn.Module:
    """CIFAR ResNet-18 (3×3 stem, no max-pool; 11.2 M parameters) with BatchNorm in
    eval mode, as curvature is computed on a trained network."""
    layers = [nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    c = 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(c, width, stride), _Block(width, width)]
        c = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers).eval()


MODELS = {
    "allcnnc": all_cnn_c,
    "resnet18": cifar_resnet18_eval,
    "convnext": lambda num_classes: convnext_atto(3, num_classes),
}
RESIDUAL = ("resnet18", "convnext")


# ------------------------------------------------------------------- one measurement


def _extension(name: str):
    from backpack import extensions

    return getattr(extensions, name)()


def _memconv_extension(ext):
    """``ext`` installed into memconv (its Kronecker module extensions on every
    convolution, adaptive pooling and BatchNorm class included, for KFAC/KFLR/KFRA)."""
    from memconv.integrations import backpack as mb

    return mb.install(ext)


def _stepper(engine: str, extension: str, model_name: str, model: nn.Module):
    """``step(x, y)``: one forward and backward pass of the engine."""
    loss_fn = nn.CrossEntropyLoss()
    if engine == "plain":

        def plain(x, y):
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            return 0.0

        return plain
    if engine == "curvlinops":
        if extension not in CURVLINOPS_FISHER:
            raise ValueError(f"curvlinops computes no exact {extension}")
        try:
            from curvlinops import KFACLinearOperator
        except ImportError as err:
            raise ImportError(
                "curvlinops-for-pytorch is not installed (make benchmarks-second-order installs it)"
            ) from err

        params = [
            m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))
        ]  # curvlinops' KFAC covers these layers (weights; biases stay out of it)

        def curvlinops_kfac(x, y):
            op = KFACLinearOperator(
                model,
                loss_fn,
                params,
                [(x, y)],
                check_deterministic=False,
                fisher_type=CURVLINOPS_FISHER[extension],
                kfac_approx="expand",
            )
            op.compute_kronecker_factors()
            factors = [*op._input_covariances.values(), *op._gradient_covariances.values()]
            return sum(_mib(f) for f in factors)

        return curvlinops_kfac
    from backpack import backpack, extend

    if engine == "memconv":  # memconv's converter: ConvNeXt's LayerNorm2d and layer scale
        from memconv.integrations import backpack as mb

        model = mb.extend(model, use_converter=model_name in RESIDUAL)
    else:
        model = extend(model, use_converter=model_name in RESIDUAL)
    loss_fn = extend(loss_fn)
    ext = _extension(extension)
    if engine == "memconv":
        ext = _memconv_extension(ext)

    def backpack_step(x, y):
        model.zero_grad(set_to_none=True)
        with backpack(ext):
            loss_fn(model(x), y).backward()
        size = 0.0
        for p in model.parameters():  # the results are freed before the next step
            if hasattr(p, ext.savefield):
                size += _mib(getattr(p, ext.savefield))
                delattr(p, ext.savefield)
        return size

    return backpack_step


def _mib(value) -> float:
    """MiB of a tensor or a list of them."""
    if isinstance(value, (list, tuple)):
        return sum(_mib(v) for v in value)
    return value.numel() * value.element_size() / 2**20


def measure(
    engine: str,
    extension: str,
    model: str,
    classes: int,
    batch: int,
    repeats: int = 1,
    threads: int = 1,
) -> dict:
    """One engine's step in this (fresh) process: warm-up on two samples, then the
    peak RSS increase (MiB) of one step and its time (s), then the allocator peak (MiB)
    of another; ``result_mib``: the size of what the step returns (the curvature, held
    at the peak by every engine). ``repeats > 1``: further timed steps, the median."""
    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    net = MODELS[model](num_classes=classes)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, classes, (batch,))
    step = _stepper(engine, extension, model, net)
    step(x[:2], y[:2])
    box = {}

    def timed():
        start = time.perf_counter()
        box["result_mib"] = step(x, y)
        box["time_s"] = time.perf_counter() - start

    rss, _ = peak_rss_increase(timed)
    seconds = box["time_s"]
    alloc, _ = peak_allocated(lambda: step(x, y), CPU)
    if repeats > 1:
        more = median_time(lambda: step(x, y), repeats - 1, CPU, warm_up=False)
        seconds = statistics.median([seconds, more])
    return {
        "peak_rss_mib": rss,
        "peak_alloc_mib": alloc,
        "result_mib": box["result_mib"],
        "time_s": seconds,
        "load": os.getloadavg()[0],
    }


# ------------------------------------------------------------------------- the run


#: The default command's configurations: (model, extensions, classes, batches).
DEFAULT_PLAN = (
    ("allcnnc", ("KFAC", "DiagGGNMC"), (100,), (8, 32)),
    ("allcnnc", ("KFLR", "DiagGGNExact"), (10, 100), (8,)),
    ("resnet18", ("KFAC", "DiagGGNExact"), (10,), (8,)),
    ("convnext", ("KFAC", "DiagGGNExact"), (10,), (8,)),
)
QUICK_PLAN = (("allcnnc", ("KFAC",), (10,), (4,)),)


def run(args) -> list[dict]:
    """Every configuration of the plan, each engine in a fresh process; rows as
    they come (an extension's engines after one ``plain`` row per model, V, batch)."""
    log = JsonLines(args.json, {"command": "second-order", **_setup(args)})
    rows = []
    plan = QUICK_PLAN if args.quick else DEFAULT_PLAN
    for model, exts, classes, batches in plan:
        if args.models and model not in args.models:
            continue
        exts = tuple(e for e in exts if not args.extensions or e in args.extensions)
        if not exts:
            continue
        for v in classes:
            for batch in batches:
                case = {"model": model, "classes": v, "batch": batch}
                for extension in ("plain", *exts):
                    engines = ("plain",) if extension == "plain" else args.engines
                    if extension == "plain" and any(
                        r.get("extension") == "plain" and all(r[k] == case[k] for k in case)
                        for r in rows
                    ):
                        continue
                    for engine in engines:
                        if engine == "plain" and extension != "plain":
                            continue
                        row = {**case, "extension": extension, "engine": engine}
                        if engine == "curvlinops" and extension not in CURVLINOPS_FISHER:
                            continue
                        config = {
                            "call": "memconv.bench.second_order:measure",
                            "args": {
                                "engine": engine,
                                "extension": extension,
                                **case,
                                "repeats": args.repeats,
                                "threads": args.threads,
                            },
                        }
                        row.update(run_in_subprocess(config, timeout=args.timeout))
                        rows.append(row)
                        log.write(row)
                        print(json.dumps(row), flush=True)
    return rows


def _setup(args) -> dict:
    return {
        "threads": args.threads,
        "repeats": args.repeats,
        "quick": bool(args.quick),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "memconv": memconv.__version__,
        "load": os.getloadavg()[0],
    }


def _times(row: dict, plain: dict | None) -> str:
    """``+RSS / +allocator MiB, time``, with multiples of the plain backward's."""
    if "error" in row:
        return "fails"
    text = f"+{row['peak_rss_mib']:,.0f} / +{row['peak_alloc_mib']:,.0f} MiB, {row['time_s']:.2f} s"
    if plain and "error" not in plain and plain is not row:
        rss = row["peak_rss_mib"] / max(plain["peak_rss_mib"], 1)
        alloc = row["peak_alloc_mib"] / max(plain["peak_alloc_mib"], 1)
        text += f" ({rss:.1f}×, {alloc:.1f}×, {row['time_s'] / plain['time_s']:.1f}×)"
    return text


def table(rows: list[dict]) -> str:
    """Markdown: per model, V, batch and extension, each engine's peak RSS increase,
    allocator peak and time, with their multiples of the plain backward's; memconv's
    against BackPACK's (the allocator peak also without the curvature itself)."""
    lines = [
        "| model | V | N | extension | plain backward | BackPACK | memconv | memconv / BackPACK: RSS, alloc, alloc − result, time | curvlinops |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = []
    for r in rows:
        key = (r["model"], r["classes"], r["batch"], r["extension"])
        if r["extension"] != "plain" and key not in keys:
            keys.append(key)
    for model, v, n, ext in keys:
        case = [r for r in rows if (r["model"], r["classes"], r["batch"]) == (model, v, n)]
        plain = next((r for r in case if r["extension"] == "plain"), None)
        by = {r["engine"]: r for r in case if r["extension"] == ext}
        cells = [_times(by[e], plain) if e in by else "–" for e in ("backpack", "memconv")]
        ratio = "–"
        b, m = by.get("backpack"), by.get("memconv")
        if b and m and "error" not in b and "error" not in m:
            transient = (m["peak_alloc_mib"] - m["result_mib"]) / max(
                b["peak_alloc_mib"] - b["result_mib"], 1
            )
            ratio = (
                f"{m['peak_rss_mib'] / max(b['peak_rss_mib'], 1):.2f}, "
                f"{m['peak_alloc_mib'] / max(b['peak_alloc_mib'], 1):.2f}, "
                f"{transient:.2f}, {m['time_s'] / b['time_s']:.2f}"
            )
        c = _times(by["curvlinops"], plain) if "curvlinops" in by else "–"
        p = _times(plain, None) if plain else "–"
        lines.append(
            f"| {model} | {v} | {n} | {ext} | {p} | {cells[0]} | {cells[1]} | {ratio} | {c} |"
        )
    return "\n".join(lines)


def errors(rows: list[dict]) -> str:
    """The failures, one line each (what the table shows as "fails")."""
    seen = []
    for r in rows:
        if "error" in r:
            line = f"- {r['model']}, {r['extension']}, {r['engine']}: `{r['error']}`"
            if line not in seen:
                seen.append(line)
    return "\n".join(seen) or "- none"


def plot(rows: list[dict], path: str) -> None:
    """Peak RSS increase against V per extension and engine (All-CNN-C, batch 8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    chosen = [r for r in rows if r["model"] == "allcnnc" and r["batch"] == 8 and "error" not in r]
    for ext in dict.fromkeys(r["extension"] for r in chosen):
        for engine in ENGINES:
            pts = sorted(
                (r["classes"], r["peak_rss_mib"])
                for r in chosen
                if r["extension"] == ext and r["engine"] == engine
            )
            if len(pts) > 1 or (ext == "plain" and pts):
                ax.plot(*zip(*pts), marker="o", label=f"{ext} ({engine})")
    ax.set_xscale("log")
    ax.set_xlabel("V (classes)")
    ax.set_ylabel("peak RSS increase (MiB)")
    ax.set_title("All-CNN-C, batch 8, one step, CPU float32")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


OPTIONS = {
    "--engines": {"default": ",".join(ENGINES[1:]), "help": "backpack,memconv,curvlinops"},
    "--models": {"default": "", "help": "only these models (allcnnc,resnet18,convnext)"},
    "--extensions": {"default": "", "help": "only these extensions of the plan (e.g. KFAC)"},
    "--repeats": {"type": int, "default": 1, "help": "timed steps (the median)"},
    "--threads": {"type": int, "default": 1, "help": "torch threads (default 1)"},
    "--timeout": {"type": float, "default": 600, "help": "seconds per measurement"},
    "--json": {"help": "write the rows to this JSON Lines file"},
    "--from-json": {"help": "refill the page from this file, measure nothing"},
    "--markdown": {"help": "refill the page's curvature:table and curvature:errors blocks"},
    "--plot": {"help": "write the plot of memory against V here"},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m memconv.bench.second_order", description=__doc__
    )
    for flag, options in OPTIONS.items():
        parser.add_argument(flag, **options)
    parser.add_argument("--quick", action="store_true", help="one small configuration")
    args = parser.parse_args(argv)
    args.engines = tuple(e for e in args.engines.split(",") if e)
    args.models = tuple(m for m in args.models.split(",") if m)
    args.extensions = tuple(e for e in args.extensions.split(",") if e)
    unknown = sorted(set(args.engines) - set(ENGINES[1:])) + sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown engines or models {unknown}")
    if args.from_json:
        rows = [r for r in read_records([args.from_json]) if "command" not in r]
    else:
        rows = run(args)
    text = table(rows)
    print(text)
    if args.markdown:
        page = Path(args.markdown)
        filled = fill_block(page.read_text(), "curvature:table", text)
        page.write_text(fill_block(filled, "curvature:errors", errors(rows)))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
