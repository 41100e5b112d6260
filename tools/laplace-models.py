"""laplace-torch's diag and kron Laplace on torchvision's ResNet-18 and ConvNeXt: memory.

laplace-torch 0.3's ``Laplace(model, "classification", subset_of_weights="all",
hessian_structure=..., backend=BackPackGGN).fit(loader)`` (``"diag"``: BackPACK's
``DiagGGNExact``; ``"kron"``: ``KFLR``), float32, one torch thread, one batch of
random inputs, each configuration in a fresh process (``--one``). Engines:

- ``backpack``: BackPACK alone, the model extended by ``backpack.extend(model,
  use_converter=True)`` first (laplace-torch's own ``extend`` has no converter, and
  fails on both models: the in-place ReLU / residual additions);
- ``memconv``: ``model = mb.extend(model)``, then ``with mb.routed(): la.fit(loader)``.

In each process: a warm-up fit on two samples, then the peak RSS increase (sampled
every 2 ms by ``memory_profiler``) and the wall time of one fit, then the allocator
peak of another (the PyTorch profiler's allocation events;
:mod:`memconv.bench.measure`). Models: torchvision's ``resnet18`` layout
(:class:`memconv.bench.models.TVResNet`, BatchNorm in eval mode) and torchvision's
ConvNeXt (:class:`memconv.bench.trunks.TVConvNeXt`) with ``convnext_atto``'s depths
and widths (2, 2, 6, 2; 40, 80, 160, 320), both on 3×64×64 inputs, 10 classes. Prints
one JSON line per run (appended to ``--json``) and a Markdown table of the medians
over ``--repeats`` runs::

    PYTHONPATH=<laplace-torch's site> python tools/laplace-models.py --repeats 2 \\
        --json docs/bench/laplace-models.jsonl --markdown docs/curvature.md
    PYTHONPATH=... python tools/laplace-models.py --models resnet18 --structures diag \\
        --batch 32 --repeats 2 --json docs/bench/laplace-models.jsonl --markdown docs/curvature.md
    python tools/laplace-models.py --from-json docs/bench/laplace-models.jsonl \\
        --markdown docs/curvature.md           # the table again, from the runs
    python tools/laplace-models.py --quick     # batch 2, 32×32, one run each

laplace-torch and its no-dependency installs are those of the Makefile's
``LAPLACE_PINS``; ASDL, which laplace-torch 0.3 imports but these backends never call,
is stubbed as in ``tests/test_backpack_laplace.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's memconv

MODELS = ("resnet18", "convnext")
STRUCTURES = ("diag", "kron")
ENGINES = ("backpack", "memconv")


def _stub_asdl() -> None:
    for name in ("asdl", "asdl.fisher", "asdl.grad_maker", "asdl.gradient", "asdl.hessian"):
        module = types.ModuleType(name)
        module.__getattr__ = lambda attr: None
        sys.modules.setdefault(name, module)
    sys.modules.setdefault("asdl.matrices", sys.modules["asdl.hessian"])


def _model(name: str, classes: int):
    from memconv.bench.models import TVResNet
    from memconv.bench.trunks import TVConvNeXt

    if name == "resnet18":
        return TVResNet((2, 2, 2, 2), num_classes=classes).eval()
    return TVConvNeXt((2, 2, 6, 2), (40, 80, 160, 320), num_classes=classes).eval()


def one(model_name: str, structure: str, engine: str, batch: int, side: int, classes: int):
    """One configuration in this process; returns its figures (or ``error``)."""
    import torch

    from memconv.bench.measure import peak_allocated, peak_rss_increase

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    _stub_asdl()
    from laplace import Laplace
    from laplace.curvature import BackPackGGN

    torch.manual_seed(0)
    model = _model(model_name, classes)
    x = torch.randn(batch, 3, side, side)
    y = torch.randint(0, classes, (batch,))
    try:
        if engine == "memconv":
            from memconv.integrations import backpack as mb

            model = mb.extend(model)
        else:
            from backpack import extend

            model = extend(model, use_converter=True)
        la = Laplace(
            model,
            "classification",
            subset_of_weights="all",
            hessian_structure=structure,
            backend=BackPackGGN,
        )

        def fit(n):
            data = torch.utils.data.TensorDataset(x[:n], y[:n])
            loader = torch.utils.data.DataLoader(data, batch_size=n)
            if engine == "memconv":
                with mb.routed():
                    la.fit(loader)
            else:
                la.fit(loader)

        fit(2)
        box = {}

        def timed():
            start = time.perf_counter()
            fit(batch)
            box["time_s"] = time.perf_counter() - start

        rss, _ = peak_rss_increase(timed)
        alloc, _ = peak_allocated(lambda: fit(batch), torch.device("cpu"))
    except Exception as err:  # BackPACK alone fails on these models: recorded
        message = f"{type(err).__name__}: {err}".splitlines()[0]
        return {"error": message[:200]}
    return {"peak_rss_mib": rss, "peak_alloc_mib": alloc, "time_s": box["time_s"]}


def _run(config: dict, timeout: float) -> dict:
    command = [sys.executable, __file__, "--one", json.dumps(config)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return {"error": tail[0][:200]}
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    """Markdown: per model, batch and structure, each engine's median figures and
    memconv's as multiples of BackPACK's."""
    out = [
        "| model | batch | Laplace | BackPACK alone: +RSS / +alloc, time "
        "| memconv: +RSS / +alloc, time | memconv / BackPACK: RSS, alloc, time |",
        "|---|---|---|---|---|---|",
    ]
    batches = sorted({r["batch"] for r in rows})
    for model, batch, structure in itertools.product(MODELS, batches, STRUCTURES):
        cells, medians = [], {}
        for engine in ENGINES:
            key = (model, batch, structure, engine)
            runs = [r for r in rows if (r["model"], r["batch"], r["structure"], r["engine"]) == key]
            good = [r for r in runs if "error" not in r]
            if not runs:
                cells.append("–")
            elif not good:
                cells.append(f"fails: `{runs[0]['error']}`")
            else:
                m = {k: statistics.median(r[k] for r in good) for k in KEYS}
                medians[engine] = m
                cells.append(
                    f"+{m['peak_rss_mib']:,.0f} / +{m['peak_alloc_mib']:,.0f} MiB, "
                    f"{m['time_s']:.2f} s"
                )
        if all(cell == "–" for cell in cells):
            continue
        ratio = "–"
        if len(medians) == 2:
            b, m = medians["backpack"], medians["memconv"]
            ratio = ", ".join(f"{m[k] / b[k]:.2f}" for k in KEYS)
        out.append(f"| {model} | {batch} | {structure} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(out)


KEYS = ("peak_rss_mib", "peak_alloc_mib", "time_s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--structures", nargs="+", choices=STRUCTURES, default=list(STRUCTURES))
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--side", type=int, default=64, help="input height and width")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per row")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--json", help="append every run as a JSON line to this file")
    parser.add_argument("--quick", action="store_true", help="batch 2, 32×32, one run")
    parser.add_argument("--from-json", help="tabulate this file's runs, run nothing")
    parser.add_argument("--markdown", help="refill the page's laplace-models:table block")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(**json.loads(args.one))), flush=True)
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        _report(rows, args.markdown)
        return 0
    if args.quick:
        args.batch, args.side, args.repeats = 2, 32, 1
    rows = []
    for _ in range(args.repeats):
        for model in args.models:
            for structure in args.structures:
                for engine in args.engines:
                    config = {
                        "model_name": model,
                        "structure": structure,
                        "engine": engine,
                        "batch": args.batch,
                        "side": args.side,
                        "classes": args.classes,
                    }
                    row = {
                        "model": model,
                        "structure": structure,
                        "engine": engine,
                        "batch": args.batch,
                        "side": args.side,
                        "classes": args.classes,
                        **_run(config, args.timeout),
                        "load": os.getloadavg()[0],
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(row) + "\n")
    _report(rows, args.markdown)
    return 0


def _report(rows: list[dict], page: str | None) -> None:
    text = table(rows)
    print(text)
    if page:
        from memconv.bench.report import fill_block

        path = Path(page)
        path.write_text(fill_block(path.read_text(), "laplace-models:table", text))


if __name__ == "__main__":
    sys.exit(main())
