"""``memconv bench``: every engine on a matrix of cases, each run in a fresh process.

Per (case, engine): peak memory increase two ways (process RSS by
``memory_profiler``; allocator level by the PyTorch profiler on CPU or
``torch.cuda.max_memory_allocated``), median run time after a warm-up, size of the
per-sample result, and the largest relative deviation from the reference
(``torch.func``). Then the cost model (:func:`memconv.predict_memory`) against the
measured extra memory of each strategy on each convolution layer, and the targets
of issue 4 as measured ratios.
"""

from __future__ import annotations

import argparse
import json

import torch

import memconv

from .cases import describe
from .compare import machine
from .engines import ENGINES, available
from .runner import max_rel_deviation, run_in_subprocess

#: The engines every case runs; the seed cases run all of :data:`ENGINES`.
CORE_ENGINES = (
    "autograd",
    "torch.func",
    "expanded-weights",
    "opacus-hooks",
    "backpack-save-memory",
    "memconv:shift",
    "memconv:rochette",
    "memconv:auto",
    "memconv-modules:auto",
    "memconv-backpack:auto",
)

#: (case configuration, engine selection): the default matrix.
DEFAULT_CASES = (
    ({"model": "seed", "batch": 32, "side": 112}, "all"),
    ({"model": "seed", "batch": 64, "side": 28}, "all"),
    ({"model": "resnet18", "batch": 8, "side": 64}, "core"),
    ({"model": "conv1d", "batch": 32, "side": 2048}, "core"),
    ({"model": "conv3d", "batch": 8, "side": 24, "depth": 16}, "core"),
)
QUICK_CASES = (
    ({"model": "seed", "batch": 4, "side": 28}, "all"),
    ({"model": "resnet18", "batch": 2, "side": 32}, "core"),
    ({"model": "conv1d", "batch": 4, "side": 128}, "core"),
    ({"model": "conv3d", "batch": 2, "side": 8, "depth": 4}, "core"),
)
MiB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memconv bench``."""
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    parser.add_argument(
        "--engines",
        default=None,
        help="comma-separated engine names for every case (default: all engines on the "
        "seed CNN, a core set on the others); 'all' for every engine everywhere",
    )
    parser.add_argument("--data", choices=("real", "random"), default="real")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    parser.add_argument("--plot", metavar="PATH", help="save a figure (matplotlib) to PATH")


def _engines_for(selection: str, override: str | None) -> list[str]:
    if override:
        names = list(ENGINES) if override == "all" else [e.strip() for e in override.split(",")]
        for n in names:
            if n not in ENGINES:
                raise ValueError(f"unknown engine {n!r}; accepted: {', '.join(ENGINES)}")
    else:
        names = list(ENGINES) if selection == "all" else list(CORE_ENGINES)
    # the reference and the floor first: the budget run needs torch.func's peak
    first = [n for n in ("autograd", "torch.func") if n in names]
    return first + [n for n in names if n not in first]


def run_case(base: dict, engines: list[str], progress) -> list[dict]:
    """Measure the engines on one case; adds the ``"memconv:auto (budget)"`` row."""
    import os
    import tempfile

    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in progress(engines):
            reason = available(ENGINES[name])
            if reason:
                rows.append({"engine": name, "skipped": reason})
                continue
            path = os.path.join(tmp, f"{len(results)}.pt")
            row = {"engine": name, **run_in_subprocess({**base, "engine": name, "out": path})}
            if "error" not in row:
                results[name] = torch.load(path)
            rows.append(row)
        func = next((r for r in rows if r["engine"] == "torch.func" and "error" not in r), None)
        if func is not None and "memconv:auto" in engines:
            budget = int(func["peak_rss_mib"] * MiB / 2)
            path = os.path.join(tmp, "budget.pt")
            row = run_in_subprocess(
                {**base, "engine": "memconv:auto", "memory_budget": budget, "out": path}
            )
            row = {"engine": "memconv:auto (budget)", "memory_budget_mib": budget / MiB, **row}
            if "error" not in row:
                results[row["engine"]] = torch.load(path)
            rows.append(row)
    reference = results.get("torch.func") or next(iter(results.values()), None)
    for row in rows:
        mine = results.get(row["engine"])
        if mine is not None and reference is not None:
            row["deviation"] = max_rel_deviation(mine, reference)
    return rows


def cost_model_rows(base: dict) -> list[dict]:
    """Predicted against measured extra memory of each strategy on each conv layer.

    Measured in this process at allocator level: the peak while
    :func:`memconv.weight_vjp` runs, minus the result's bytes. Per layer, the
    input and output gradient are random tensors of the layer's shapes.
    """
    from .._geometry import CONV_TYPES
    from .cases import build_case
    from .measure import peak_allocated

    device = torch.device(base.get("device", "cpu"))
    model, x, _ = build_case({**base, "data": "random"}, device)
    shapes = []
    hooks = [
        m.register_forward_hook(lambda m, a, o: shapes.append((m, a[0].shape, o.shape)))
        for m in model.modules()
        if isinstance(m, CONV_TYPES)
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    rows = []
    for i, (module, in_shape, out_shape) in enumerate(shapes):
        xi = torch.randn(in_shape, device=device)
        gi = torch.randn(out_shape, device=device)
        for strategy in memconv.strategies():
            predicted = memconv.predict_memory(module, tuple(in_shape), strategy)
            peak, result = peak_allocated(
                lambda m=module, s=strategy, a=xi, b=gi: memconv.weight_vjp(m, a, b, strategy=s),
                device,
            )
            measured = peak * MiB - result.numel() * result.element_size()
            del result
            rows.append(
                {
                    "layer": i,
                    "module": repr(module),
                    "strategy": strategy,
                    "predicted_mib": predicted / MiB,
                    "measured_mib": max(measured, 0) / MiB,
                }
            )
    return rows


def format_case(base: dict, rows: list[dict]) -> str:
    """Markdown table of one case, with ratios to the floor and to torch.func."""
    by = {r["engine"]: r for r in rows if "peak_rss_mib" in r}
    floor = func = None
    result = max((r["result_mib"] for r in rows if "result_mib" in r), default=0.0)
    if "autograd" in by:
        floor = by["autograd"]["peak_rss_mib"] + result
    if "torch.func" in by:
        func = by["torch.func"]
    lines = [
        f"**{describe(base)}** (floor = autograd's peak + per-sample result = "
        + (f"{floor:,.0f} MiB" if floor else "n/a")
        + ")",
        "",
        "| engine | peak RSS increase (MiB) | allocator peak (MiB) | time (s) | result (MiB) | "
        "RSS / floor | time / torch.func | max rel. deviation |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or r.get("error")
            lines.append(
                f"| {r['engine']} | {'skipped' if 'skipped' in r else 'failed'}: {why} |||||||"
            )
            continue
        alloc = "-" if r.get("peak_alloc_mib") is None else f"{r['peak_alloc_mib']:,.0f}"
        ratio_m = f"{r['peak_rss_mib'] / floor:.2f}" if floor else ""
        ratio_t = f"{r['time_s'] / func['time_s']:.2f}" if func else ""
        lines.append(
            f"| {r['engine']} | {r['peak_rss_mib']:,.0f} | {alloc} | {r['time_s']:.3f} | "
            f"{r['result_mib']:,.1f} | {ratio_m} | {ratio_t} | {r.get('deviation', float('nan')):.1e} |"
        )
    return "\n".join(lines)


def format_cost_model(rows: list[dict]) -> str:
    """Markdown table: predicted against measured extra memory."""
    lines = [
        "| layer | strategy | predicted (MiB) | measured (MiB) | measured / predicted |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["measured_mib"] / r["predicted_mib"] if r["predicted_mib"] > 0 else float("nan")
        lines.append(
            f"| {r['layer']} | {r['strategy']} | {r['predicted_mib']:,.1f} | "
            f"{r['measured_mib']:,.1f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def targets(cases: list[dict]) -> list[str]:
    """The issue's targets as measured ratios (only for the seed-CNN cases)."""
    out = []
    for case in cases:
        base, rows = case["case"], case["rows"]
        if base.get("model") != "seed":
            continue
        by = {r["engine"]: r for r in rows if "peak_rss_mib" in r}
        if "autograd" not in by or "torch.func" not in by:
            continue
        ours = {n: r for n, r in by.items() if n.startswith("memconv") and "budget" not in n}
        if not ours:
            continue
        result = max(r["result_mib"] for r in rows if "result_mib" in r)
        floor = by["autograd"]["peak_rss_mib"] + result
        floor_alloc = (by["autograd"].get("peak_alloc_mib") or 0) + result
        lean = min(ours.values(), key=lambda r: r["peak_rss_mib"])
        lean_alloc = min(ours.values(), key=lambda r: r.get("peak_alloc_mib") or 1e18)
        fast = min(ours.values(), key=lambda r: r["time_s"])
        label = describe(base)
        out.append(
            f"- {label}: leanest memconv ({lean['engine']}) peak RSS {lean['peak_rss_mib']:,.0f} MiB = "
            f"{lean['peak_rss_mib'] / floor:.2f} × floor (target ≤ 1.10); allocator level "
            f"({lean_alloc['engine']}) {lean_alloc['peak_alloc_mib'] / floor_alloc:.2f} × floor"
        )
        out.append(
            f"- {label}: fastest memconv ({fast['engine']}) {fast['time_s']:.3f} s = "
            f"{fast['time_s'] / by['torch.func']['time_s']:.2f} × torch.func (target ≤ 1.0), "
            f"{fast['time_s'] / by['autograd']['time_s']:.2f} × plain autograd"
        )
        budget = next((r for r in rows if r["engine"] == "memconv:auto (budget)"), None)
        if budget and "peak_rss_mib" in budget:
            out.append(
                f"- {label}: auto with memory_budget = ½ torch.func's peak "
                f"({budget['memory_budget_mib']:,.0f} MiB): peak {budget['peak_rss_mib']:,.0f} MiB "
                f"({budget['peak_rss_mib'] / budget['memory_budget_mib']:.2f} × budget), time "
                f"{budget['time_s'] / by['torch.func']['time_s']:.2f} × torch.func (target ≤ 2)"
            )
    return out


def plot(cases: list[dict], path: str) -> None:
    """Peak memory against time per engine, log–log, one panel per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(cases))
    rows_n = -(-len(cases) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 5.5 * rows_n), squeeze=False)
    for ax in axes.flat[len(cases) :]:
        ax.set_visible(False)
    for ax, case in zip(axes.flat, cases):
        rows = [r for r in case["rows"] if "peak_rss_mib" in r]
        for r in rows:
            color = "tab:red" if r["engine"].startswith("memconv") else "tab:blue"
            ax.scatter(r["time_s"], max(r["peak_rss_mib"], 1), color=color)
            ax.annotate(r["engine"], (r["time_s"], max(r["peak_rss_mib"], 1)), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("peak RSS increase (MiB)")
        ax.set_title(describe(case["case"]), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    """Run the matrix and print the tables; returns the exit status."""
    from tqdm import tqdm

    if args.repeats < 1:
        raise ValueError("--repeats must be positive")
    torch.device(args.device)
    matrix = QUICK_CASES if args.quick else DEFAULT_CASES
    data = "random" if args.data == "random" else "digits"
    plan = [
        (
            {**cfg, "data": data, "device": args.device, "repeats": args.repeats},
            _engines_for(sel, args.engines),
        )
        for cfg, sel in matrix
    ]
    cases = []
    with tqdm(total=sum(len(e) for _, e in plan), desc="cases × engines", unit="run") as bar:

        def progress(names):
            for n in names:
                bar.set_postfix_str(n)
                yield n
                bar.update()

        for base, engines in plan:
            cases.append({"case": base, "rows": run_case(base, engines, progress)})
    cost = cost_model_rows(dict(matrix[0][0], device=args.device))
    print(f"\nmachine: {machine()}\n")
    for case in cases:
        print(format_case(case["case"], case["rows"]))
        print()
    print(f"cost model on {describe(matrix[0][0])} (per conv layer, allocator level)\n")
    print(format_cost_model(cost))
    print("\ntargets:")
    for line in targets(cases):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "cases": cases, "cost_model": cost}, f, indent=2)
    if args.plot:
        plot(cases, args.plot)
    bad = [
        r["engine"] for c in cases for r in c["rows"] if "deviation" in r and r["deviation"] > 1e-3
    ]
    if bad:
        print(f"\nengines disagreeing with the reference: {bad}")
    return 1 if bad else 0
