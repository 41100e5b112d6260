"""``memconv bench``: every engine on a matrix of cases, each run in a fresh process.

Per (case, engine): peak memory increase two ways (process RSS by
``memory_profiler``; allocator level by the PyTorch profiler on CPU or
``torch.cuda.max_memory_allocated``), median run time after a warm-up, size of the
per-sample result, and the largest relative deviation from the other rows. Then the
cost model (:func:`memconv.predict_memory`) against the measured extra memory of
each strategy on each convolution layer, and the design targets as measured ratios.
"""

from __future__ import annotations

import argparse
import logging

import torch

import memconv

from .cases import MODELS, describe
from .engines import ENGINES
from .options import add_common_arguments, data_needs, engine_needs, listed
from .report import JsonRecord, machine, plot, require
from .report import missing as missing_modules
from .runner import Job, run_engines

logger = logging.getLogger("memconv")

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
#: Largest relative deviation between two rows that still counts as agreement.
TOLERANCE = 1e-3
#: The label of ``"auto"`` run with half of torch.func's peak as its memory budget.
BUDGET_ROW = "memconv:auto (budget)"

DESCRIPTION = """\
Measure every per-sample gradient engine (plain autograd, torch.func, torch's
ExpandedWeights, Opacus, BackPACK, and memconv's strategies three ways: as
per_sample_grads, as extended modules, and under BackPACK) on a matrix of cases:
the seed CNN at two sizes, a ResNet-18-shaped CNN, a 1-D and a 3-D CNN. Each
(case, engine) runs in a fresh Python process. Reports peak memory, median run
time and the largest relative deviation between engines per case, then memconv's
memory cost model against the measured extra memory of each convolution layer, and
the design targets as measured ratios. About 16 minutes on 2 CPU cores; --quick
runs small shapes in a few minutes. Engines whose optional peer (BackPACK, Opacus)
is not installed are skipped unless named with --engines.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memconv bench``."""
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        default=list(MODELS),
        metavar="MODEL",
        help=f"cases to run, by model (default: all): {listed(MODELS)}",
    )
    add_common_arguments(
        parser,
        engines_help="engines to run on every case ('all': every engine; default: every "
        "engine on the seed CNN cases, a core set on the others)",
        data_help="; the ResNet-18, 1-D and 3-D cases use photo crops unless random",
    )


def _engines_for(selection: str, override, strategies) -> list[str]:
    if override:
        names = list(ENGINES) if "all" in override else list(dict.fromkeys(override))
    else:
        names = (
            [e for e in ENGINES if e != "memconv-streaming"]
            if selection == "all"
            else list(CORE_ENGINES)
        )
    # memconv's per-strategy engines only for the chosen strategies
    names = [n for n in names if ":" not in n or n.split(":", 1)[1] in strategies]
    # the reference and the floor first: the budget row needs torch.func's peak
    first = [n for n in ("autograd", "torch.func") if n in names]
    return first + [n for n in names if n not in first]


def plan_cases(args) -> list[tuple[dict, list[str]]]:
    """``[(case configuration, engine names)]`` of a ``bench`` run.

    Raises:
        ValueError: on an unusable device.
    """
    torch.device(args.device)
    matrix = QUICK_CASES if args.quick else DEFAULT_CASES
    matrix = [(cfg, sel) for cfg, sel in matrix if cfg["model"] in args.models]
    return [
        (
            {**cfg, "data": args.data, "device": args.device, "repeats": args.repeats},
            _engines_for(sel, args.engines, args.strategies),
        )
        for cfg, sel in matrix
    ]


def budget_job(rows: list[dict]) -> list[Job]:
    """``"auto"`` with ``memory_budget`` = half of torch.func's measured peak."""
    func = next((r for r in rows if r["engine"] == "torch.func" and "peak_rss_mib" in r), None)
    if func is None or not any(r["engine"] == "memconv:auto" for r in rows):
        return []
    budget = int(func["peak_rss_mib"] * MiB / 2)
    return [Job(BUDGET_ROW, "memconv:auto", {"memory_budget": budget})]


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
    """The design targets as measured ratios (only for the seed-CNN cases)."""
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
        budget = next((r for r in rows if r["engine"] == BUDGET_ROW), None)
        if budget and "peak_rss_mib" in budget:
            budget_mib = budget["memory_budget"] / MiB
            out.append(
                f"- {label}: auto with memory_budget = ½ torch.func's peak "
                f"({budget_mib:,.0f} MiB): peak {budget['peak_rss_mib']:,.0f} MiB "
                f"({budget['peak_rss_mib'] / budget_mib:.2f} × budget), time "
                f"{budget['time_s'] / by['torch.func']['time_s']:.2f} × torch.func (target ≤ 2)"
            )
    return out


def main(args) -> int:
    """Run the matrix and print the tables; returns the exit status."""
    plan = plan_cases(args)
    if not plan:
        raise ValueError("no case to run")
    named = set(ENGINES) if args.engines and "all" in args.engines else set(args.engines or ())
    every = [e for _, engines in plan for e in engines]
    needs = {"memory_profiler": "memory measurement"}
    needs.update({m: e for m, e in engine_needs(every).items() if e in named})
    for base, _ in plan:
        data = base["data"] if base["model"] == "seed" or base["data"] == "random" else "photos"
        needs.update(data_needs(data))
    if args.plot:
        needs["matplotlib"] = "--plot"
    require(needs)
    for module, engine in engine_needs(every).items():
        if engine not in named and module in missing_modules(engine_needs(every)):
            logger.info("%s is not installed: the engines that need it are skipped", module)
    from tqdm import tqdm

    record = JsonRecord(args.json, {"machine": machine(), "cases": []})
    cases = record.document["cases"]
    budget_rows = sum(
        1 for _, engines in plan if "memconv:auto" in engines and "torch.func" in engines
    )
    total = sum(len(engines) for _, engines in plan) + budget_rows
    with tqdm(total=total, desc="cases × engines", unit="run") as bar:

        def on_row(row):
            cases[-1]["rows"].append(row)
            record.write()
            bar.update()

        for base, engines in plan:
            cases.append({"case": base, "rows": []})
            run_engines(
                base,
                engines,
                then=budget_job,
                on_start=bar.set_postfix_str,
                on_row=on_row,
                timeout=args.timeout,
            )
            record.write()  # earlier rows' deviations grew as later rows arrived
    first = plan[0][0]
    cost = cost_model_rows(first)
    print(f"\nmachine: {machine()}\n")
    for case in cases:
        print(format_case(case["case"], case["rows"]))
        print()
    print(f"cost model on {describe(first)} (per conv layer, allocator level)\n")
    print(format_cost_model(cost))
    print("\ntargets:")
    for line in targets(cases):
        print(line)
    record.finish(cost_model=cost)
    if args.plot:
        plot(cases, args.plot, describe)
    bad = [
        r["engine"]
        for c in cases
        for r in c["rows"]
        if "deviation" in r and r["deviation"] > TOLERANCE
    ]
    if bad:
        logger.error("engines disagreeing with the others: %s", ", ".join(bad))
    return 1 if bad else 0
