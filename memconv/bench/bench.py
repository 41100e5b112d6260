"""``memconv bench``: engines on cases, each measurement in a fresh process.

Four modes:

- the matrix (default): every engine of a task on each case: peak memory increase
  two ways (process RSS by ``memory_profiler``; allocator level by the PyTorch
  profiler on the CPU or ``torch.cuda.max_memory_allocated``), median run time,
  size of the result, and the largest relative deviation from torch.func's result;
  for the ``grads`` task also the cost model against the measured extra memory of
  each strategy on each convolution layer (the project's own targets, as measured
  ratios, go to the benchmarks page through ``--report ... --markdown``);
- ``--sweep batch|side``: memory and time of each engine over a range of batch sizes
  or image sides;
- ``--largest-batch``: the largest batch each engine fits within a memory limit
  (:mod:`memconv.bench.largest`);
- ``--report FILE...``: tables rendered from the JSON Lines files of earlier runs
  (``--markdown PAGE`` refills a page's marked sections, :mod:`memconv.bench.report`).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from datetime import datetime, timezone

import torch

import memconv

from .cases import CASES, MIN_SIDE, describe
from .engines import BUDGET_ENGINE, DEFAULT_ENGINE, ENGINES, TASKS, available, get_engine
from .options import (
    add_common,
    check_dependencies,
    check_device,
    command_line,
    device_record,
    machine,
    parse_names,
    parse_range,
    positive_float,
    positive_int,
    prepare_outputs,
    strict_float32,
)

logger = logging.getLogger("memconv")
MiB = 2**20

DESCRIPTION = (
    "Measure engines (memconv's and its peers': torch.func, Opacus, BackPACK, torch's "
    "ExpandedWeights) on benchmark cases, each measurement in a fresh process: peak memory "
    "increase (process RSS and allocator level), median run time, and each result's "
    "largest relative deviation from torch.func's. Task grads: per-sample gradients. "
    "Task clip: DP-SGD's clipped sum of per-sample gradients. By default the matrix of "
    "cases and engines of the task; --sweep, --largest-batch and --report are the other "
    "modes. Run 'memconv list' for the engines and cases with a line on each."
)

#: Cases of the matrix, per task.
DEFAULT_CASES = {
    "grads": ("seed-112", "seed-28", "resnet18-gn", "conv1d", "conv3d"),
    "clip": ("resnet18-gn", "wrn16-4-gn", "seed-112", "conv1d", "conv3d"),
    "clip-layer": ("resnet18-gn", "wrn16-4-gn", "vit-tiny"),
}
#: Engines the matrix runs on cases other than the seed CNN's (task grads).
CORE_GRADS = (
    "autograd",
    "torch.func",
    "expanded-weights",
    "opacus-hooks",
    "backpack-save-memory",
    "memconv:shift",
    "memconv:rochette",
    "memconv:auto",
    BUDGET_ENGINE,
    "memconv-modules:auto",
    "memconv-backpack:auto",
)
SWEEP_ENGINES = {
    "grads": (
        "autograd",
        "torch.func",
        "opacus-hooks",
        "backpack-save-memory",
        "memconv:auto",
        "memconv-modules:auto",
    ),
    "clip": (
        "non-private",
        "torch.func",
        "opacus-hooks",
        "opacus-ghost",
        "memconv:auto",
        "memconv:two-pass",
    ),
    "clip-layer": (
        "non-private",
        "torch.func",
        "opacus-per-layer",
        "memconv:per-layer",
        "memconv:flat",
    ),
}
LARGEST_ENGINES = {
    "grads": (
        "autograd",
        "torch.func",
        "opacus-hooks",
        "backpack-save-memory",
        "memconv:auto",
        BUDGET_ENGINE,
        DEFAULT_ENGINE,
    ),
    "clip": (
        "non-private",
        "torch.func",
        "opacus-hooks",
        "opacus-ghost",
        "memconv:auto",
        "memconv:two-pass",
        BUDGET_ENGINE,
        DEFAULT_ENGINE,
    ),
    "clip-layer": ("non-private", "opacus-per-layer", "memconv:per-layer", "memconv:flat"),
}
LARGEST_CASES = {
    "grads": ("seed-112",),
    "clip": ("resnet18-gn", "seed-112"),
    "clip-layer": ("resnet18-gn",),
}
#: ``--quick``: one small case and a few engines per task (a smoke test of about a minute).
QUICK_CASES = {"grads": ("seed-28",), "clip": ("resnet18-gn",), "clip-layer": ("resnet18-gn",)}
QUICK_ENGINES = {
    "grads": ("autograd", "torch.func", "memconv:auto", BUDGET_ENGINE),
    "clip": ("non-private", "torch.func", "memconv:auto", "memconv:two-pass"),
    "clip-layer": ("non-private", "torch.func", "memconv:per-layer", "memconv:flat"),
}
SWEEPS = ("batch", "side")
#: Tables of the benchmarks page that take a run's records whole (``--table``).
TABLES = ("models", "streaming")
#: The engines of the table "Streaming the models people stream", compared with the
#: conventional pass ("autograd").
STREAM_ENGINES = ("autograd", "memconv-streaming", "lightstream")
DEFAULT_RANGE = {"batch": "8,16,32,64,128,256,512", "side": "28,56,112,168,224"}
#: A sweep stops an engine's run past this RSS increase, and runs it no further.
SWEEP_ABORT_MIB = 16 * 1024
#: Largest relative deviation from torch.func accepted (float32).
TOLERANCE = 1e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memconv bench``."""
    what = parser.add_argument_group("what to measure")
    what.add_argument(
        "--task",
        choices=TASKS,
        default="grads",
        help="grads: per-sample gradients; clip: DP-SGD clipped sums; clip-layer: "
        "per-layer clipping (a threshold per parameter) against flat (default: grads)",
    )
    what.add_argument(
        "--cases",
        metavar="NAMES",
        help="comma-separated case names, or all; accepted: "
        + ", ".join(CASES)
        + ". Default for the matrix: "
        + "; ".join(f"task {t}: {', '.join(c)}" for t, c in DEFAULT_CASES.items())
        + "; for a sweep: seed-28; for --largest-batch: "
        + "; ".join(f"task {t}: {', '.join(c)}" for t, c in LARGEST_CASES.items()),
    )
    what.add_argument(
        "--engines",
        metavar="NAMES",
        help="comma-separated engine names, or all (default: all engines of the task on "
        "the seed CNN's cases, a core set on the others). Accepted for task grads: "
        + ", ".join(ENGINES["grads"])
        + ". Accepted for task clip: "
        + ", ".join(ENGINES["clip"])
        + ". Accepted for task clip-layer: "
        + ", ".join(ENGINES["clip-layer"]),
    )
    what.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: small shapes and, unless --cases/--engines say otherwise, one "
        "case and a few engines (about a minute on 2 CPU cores; without it the default "
        "matrix of a task takes 15-30 minutes, a sweep 5-10, a largest-batch search 10-60)",
    )
    what.add_argument(
        "--batch-size", type=positive_int, metavar="N", help="batch size for every case"
    )
    what.add_argument(
        "--side",
        type=positive_int,
        metavar="S",
        help="image side (signal length, volume side) for every case",
    )
    what.add_argument(
        "--max-norm",
        type=positive_float,
        default=1.0,
        metavar="C",
        help="clipping threshold of task clip (default: 1.0)",
    )
    what.add_argument(
        "--budget-mib",
        type=positive_float,
        metavar="MIB",
        help=f"memory budget of the {BUDGET_ENGINE} rows, in MiB (default: the case's "
        "documented budget; rows of cases without one are skipped)",
    )
    add_common(parser, data_default=None)
    modes = parser.add_argument_group("other modes (one at a time)")
    exclusive = modes.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--sweep",
        choices=SWEEPS,
        help="measure each engine over a range of batch sizes or image sides on one case",
    )
    exclusive.add_argument(
        "--largest-batch",
        action="store_true",
        help="find the largest batch each engine fits within --limit-gib, by bisection in "
        "fresh processes",
    )
    exclusive.add_argument(
        "--report",
        nargs="+",
        metavar="FILE",
        help="render tables from JSON Lines files of earlier runs (with --markdown PAGE, "
        "also the project's targets, to refill the benchmarks page)",
    )
    modes.add_argument(
        "--range",
        metavar="LIST",
        help="with --sweep: comma-separated positive, strictly increasing values (default: "
        + "; ".join(f"{k}: {v}" for k, v in DEFAULT_RANGE.items())
        + ")",
    )
    modes.add_argument(
        "--limit-gib",
        type=positive_float,
        metavar="GIB",
        help="with --largest-batch: the memory limit in GiB, held at allocator level (default: 4)",
    )
    modes.add_argument(
        "--container",
        action="store_true",
        default=None,
        help="with --largest-batch: set the limit as a container does, each probe in a memory "
        "cgroup of --limit-gib (Linux, root); a batch fits when its call completes",
    )
    modes.add_argument(
        "--max-batch",
        type=positive_int,
        metavar="N",
        help="with --largest-batch: the largest batch tried (default: 1024)",
    )
    modes.add_argument(
        "--table",
        choices=TABLES,
        help="in the matrix mode: mark the records as the measurements of one table of the "
        "benchmarks page (models: 'DP on the models people train'; streaming: 'Streaming "
        "the models people stream', compared with the conventional pass, autograd); "
        "--report renders them in that table rather than in the per-case tables",
    )
    big = parser.add_argument_group("huge images (the streaming table)")
    big.add_argument(
        "--once",
        action="store_true",
        help="one measured call per engine: RSS, allocator peak and its time together (the "
        "profiler's cost included), for steps of many minutes",
    )
    big.add_argument(
        "--abort-gib",
        type=positive_float,
        metavar="GIB",
        help="stop a measurement whose RSS grows past GIB (its row says so), e.g. a "
        "conventional step that would not fit the machine",
    )
    big.add_argument(
        "--lightstream-python",
        metavar="PATH",
        help="the interpreter of an environment with Lightstream 1.0.7 (and without "
        "torchvision), which runs the lightstream engine",
    )
    modes.add_argument(
        "--markdown",
        metavar="PAGE",
        help="with --report: refill the marked sections of the Markdown file PAGE (or "
        "write a new page with every section)",
    )


# ---------------------------------------------------------------- checks
def _mode(args) -> str:
    if args.report:
        return "report"
    if args.sweep:
        return "sweep"
    return "largest" if args.largest_batch else "matrix"


def check_arguments(args) -> dict:
    """Validate every option before any work.

    Returns:
        ``{"mode", "cases", "engines" (per case, or None for the defaults), "range"}``.

    Raises:
        ValueError: an option that does not apply to the mode, an unknown name, a bad
            range or size (each message names the option and the accepted values).
        ImportError: a missing optional dependency.
    """
    mode = _mode(args)
    misplaced = {
        "--range": (args.range, "sweep"),
        "--limit-gib": (args.limit_gib, "largest"),
        "--max-batch": (args.max_batch, "largest"),
        "--container": (args.container, "largest"),
        "--markdown": (args.markdown, "report"),
    }
    for option, (value, needs) in misplaced.items():
        if value is not None and mode != needs:
            flag = {"sweep": "--sweep", "largest": "--largest-batch", "report": "--report"}[needs]
            raise ValueError(f"{option} applies only with {flag}")
    if getattr(args, "table", None) is not None and mode != "matrix":
        raise ValueError("--table applies only in the matrix mode")
    python = getattr(args, "lightstream_python", None)
    if python is not None and not os.access(python, os.X_OK):
        raise ValueError(f"--lightstream-python: {python!r} is not an executable")
    plan: dict = {"mode": mode}
    if mode == "report":
        for path in args.report:
            if not os.path.isfile(path):
                raise ValueError(f"--report: no such file {path!r}")
        check_dependencies(plot=bool(args.plot), measure=False)
        prepare_outputs(args.plot, getattr(args, "markdown", None))
        return plan
    check_device(args.device)
    prepare_outputs(args.plot, args.json)
    task = args.task
    if args.cases is not None:
        cases = parse_names(args.cases, CASES, "--cases")
    elif args.quick and mode == "matrix":
        cases = list(QUICK_CASES[task])
    elif mode == "sweep":
        cases = ["seed-28"]
    elif mode == "largest":
        cases = list(LARGEST_CASES[task])
    else:
        cases = list(DEFAULT_CASES[task])
    if mode == "sweep":
        if len(cases) != 1:
            raise ValueError(f"--sweep measures one case; got --cases {','.join(cases)}")
        plan["range"] = parse_range(args.range or DEFAULT_RANGE[args.sweep])
    engines = parse_names(args.engines, ENGINES[task], "--engines")
    if engines is None and args.quick and mode == "matrix":
        engines = list(QUICK_ENGINES[task])
    for name in cases:
        model = CASES[name].model
        sides = [args.side] if args.side else []
        if mode == "sweep" and args.sweep == "side":
            sides += plan["range"]
        for s in sides:
            if s < MIN_SIDE[model]:
                raise ValueError(
                    f"side {s} is too small for case {name}: at least {MIN_SIDE[model]}"
                )
    plan["cases"] = cases
    plan["engines"] = engines
    # engines asked for by name need their peers now; default ones are skipped with a reason
    elsewhere = {"lightstream"} if python is not None else set()  # its own environment
    check_dependencies(
        [get_engine(e, task) for e in engines or [] if e not in elsewhere],
        plot=bool(args.plot),
        data=args.data,
    )
    chosen = engines or [e for c in cases for e in default_engines(mode, task, c)]
    for e in dict.fromkeys(chosen):
        reason = available(get_engine(e, task), python if e in elsewhere else None)
        if reason:
            logger.warning("engine %s will be skipped: %s", e, reason)
    return plan


def default_engines(mode: str, task: str, case: str) -> list[str]:
    """The engines a mode runs on a case unless ``--engines`` says otherwise."""
    if mode == "sweep":
        return list(SWEEP_ENGINES[task])
    if mode == "largest":
        return list(LARGEST_ENGINES[task])
    if task != "grads" or CASES[case].model == "seed":
        return list(ENGINES[task])
    if CASES[case].model.startswith("stream-"):
        return list(STREAM_ENGINES)
    return list(CORE_GRADS)


def case_config(args, name: str) -> dict:
    """The worker configuration of case ``name`` under the options."""
    case = CASES[name]
    config = case.config(quick=args.quick, batch=args.batch_size, side=args.side)
    config.update(
        task=args.task,
        data=args.data,
        device=args.device,
        repeats=args.repeats,
        max_norm=args.max_norm,
    )
    budget = args.budget_mib or case.budget_mib.get(args.task)
    if budget:
        config["memory_budget"] = int(budget * MiB)
    if getattr(args, "once", False):
        config["once"] = True
    if getattr(args, "abort_gib", None):
        config["abort_rss_mib"] = args.abort_gib * 1024
    if getattr(args, "lightstream_python", None):
        config["interpreters"] = {"lightstream": args.lightstream_python}
    return config


def _public(config: dict) -> dict:
    """The case's description in the records (no worker plumbing)."""
    return {k: config[k] for k in ("model", "batch", "side", "depth", "data") if k in config}


def _header(args, mode: str) -> dict:
    return {
        "record": "run",
        "mode": mode,
        "task": args.task,
        "command": command_line(getattr(args, "argv", None)),
        "machine": machine(),
        "device": device_record(getattr(args, "device", "cpu")),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "plot": args.plot,
        "table": getattr(args, "table", None),
    }


# ---------------------------------------------------------------- the matrix
def cost_model_rows(config: dict) -> dict:
    """Predicted against measured extra memory of each strategy on each conv layer,
    ``{"rows": [...]}``.

    Measured at allocator level: the peak while :func:`memconv.weight_vjp` runs, minus
    the result's bytes. Per layer, the input and output gradient are random tensors of
    the layer's shapes. Meant to run in a fresh process (the ``"standard"`` strategy
    allocates gigabytes on the seed CNN at 112²).
    """
    from .._checks import CONV_TYPES
    from .cases import build_case
    from .measure import peak_allocated

    device = torch.device(config.get("device", "cpu"))
    model, x, _ = build_case({**config, "data": "random"}, device)
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
        for strategy in memconv.available_strategies():
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
    return {"rows": rows}


def run_matrix(args, plan: dict, out) -> list[tuple[str, dict, list[dict]]]:
    """Every (case, engine) of the plan; returns ``(task, config, rows)`` per case."""
    from .compare import _summary
    from .runner import measure_engines

    groups = []
    jobs = [
        (name, plan["engines"] or default_engines("matrix", args.task, name))
        for name in plan["cases"]
    ]
    total, done = sum(len(e) for _, e in jobs), [0]
    for name, engines in jobs:
        config = case_config(args, name)
        public = _public(config)
        logger.info("case %s: %s (task %s)", name, describe(config), args.task)

        def on_row(row, name=name, public=public):
            done[0] += 1
            logger.info("[%d/%d] %s %s: %s", done[0], total, name, row["engine"], _summary(row))
            out.write({"record": "row", "task": args.task, "case": name, "config": public, **row})

        reference = "autograd" if getattr(args, "table", None) == "streaming" else None
        rows = measure_engines(
            config,
            engines,
            task=args.task,
            on_row=on_row,
            reference=reference,
            deadline=getattr(args, "deadline", None),
        )
        order = {e: i for i, e in enumerate(ENGINES[args.task])}
        rows.sort(key=lambda r: order[r["engine"]])
        groups.append((args.task, public, rows))
    return groups


def matrix(args, plan: dict) -> int:
    """The matrix mode; prints the tables."""
    from .report import COST_MODEL_NOTE, format_case, format_cost_model, terminal
    from .runner import JsonLines, run_in_subprocess

    started = time.time()
    header = _header(args, "matrix")
    out = JsonLines(args.json, header)
    groups = run_matrix(args, plan, out)
    cost = []
    seed = [c for c in plan["cases"] if CASES[c].model == "seed"]
    if args.task == "grads" and seed:
        logger.info("cost model on %s", seed[0])
        result = run_in_subprocess(
            {
                "call": "memconv.bench.bench:cost_model_rows",
                "args": {"config": {**case_config(args, seed[0]), "device": args.device}},
            }
        )
        cost = result.get("rows", [])
        if "error" in result:
            logger.warning("cost model failed: %s", result["error"])
        for row in cost:
            out.write({"record": "cost", "case": seed[0], **row})
    out.write({"record": "done", "elapsed_s": time.time() - started})
    print(f"\nmachine: {machine()}\n")
    for task, config, rows in groups:
        print(terminal(format_case(task, config, rows)))
        print()
    if cost:
        print(f"cost model on {seed[0]} (per conv layer, allocator level)\n")
        print(terminal(format_cost_model(cost)))
        print(COST_MODEL_NOTE)
    if args.plot:
        from .plots import plot_cases

        plot_cases(groups, args.plot)
    bad = [
        r["engine"]
        for _, _, rows in groups
        for r in rows
        if r.get("deviation") is not None and r["deviation"] > TOLERANCE
    ]
    if bad:
        print(f"\nengines disagreeing with torch.func: {bad}")
    return 1 if bad else 0


# ---------------------------------------------------------------- sweeps
def sweep(args, plan: dict) -> int:
    """The sweep mode: memory and time of each engine over ``--range``."""
    from .compare import _summary
    from .report import _sweep_table, terminal
    from .runner import JsonLines, past, run_in_subprocess

    started = time.time()
    out = JsonLines(args.json, _header(args, "sweep"))
    name = plan["cases"][0]
    engines = plan["engines"] or default_engines("sweep", args.task, name)
    for e in engines:
        get_engine(e, args.task)
    dropped: dict[str, str] = {}
    rows = []
    for value in plan["range"]:
        config = case_config(args, name)
        config["batch" if args.sweep == "batch" else "side"] = value
        public = _public(config)
        for engine in engines:
            why = dropped.get(engine) or available(get_engine(engine, args.task))
            why = why or past(getattr(args, "deadline", None))
            if why:
                row = {"engine": engine, "skipped": why}
            elif get_engine(engine, args.task).budget and not config.get("memory_budget"):
                row = {"engine": engine, "skipped": "no memory budget for this case"}
            else:
                run = {**config, "engine": engine, "out": None, "abort_rss_mib": SWEEP_ABORT_MIB}
                row = {"engine": engine, **run_in_subprocess(run)}
                if "error" in row or row.get("aborted"):
                    dropped[engine] = f"failed or over {SWEEP_ABORT_MIB / 1024:.0f} GiB at {value}"
            record = {
                "record": "sweep",
                "task": args.task,
                "case": name,
                "sweep": args.sweep,
                "value": value,
                "config": public,
                **row,
            }
            logger.info("%s %s=%d %s: %s", name, args.sweep, value, engine, _summary(row))
            out.write(record)
            rows.append(record)
    out.write({"record": "done", "elapsed_s": time.time() - started})
    measured = [r for r in rows if "skipped" not in r]
    print(f"\n{name} ({args.task}), {args.sweep} swept\n\nallocator peak (MiB):\n")
    print(terminal(_sweep_table(measured, "peak_alloc_mib", ",.0f")))
    print("\npeak RSS increase (MiB):\n")
    print(terminal(_sweep_table(measured, "peak_rss_mib", ",.0f")))
    print("\ntime (s):\n")
    print(terminal(_sweep_table(measured, "time_s", ".3f")))
    if args.plot and measured:
        from .plots import plot_sweep

        plot_sweep(measured, args.plot)
    return 0


# ---------------------------------------------------------------- largest batch
def largest(args, plan: dict) -> int:
    """The largest-batch mode: a table of the largest batch within ``--limit-gib``."""
    from .largest import largest_batch
    from .report import format_largest, terminal
    from .runner import JsonLines, past, read_records

    started = time.time()
    out = JsonLines(args.json, _header(args, "largest"))
    limit_mib = (args.limit_gib or 4.0) * 1024
    cap = args.max_batch or 1024
    records = []
    for name in plan["cases"]:
        engines = plan["engines"] or default_engines("largest", args.task, name)
        for engine in engines:
            config = case_config(args, name)
            public = _public(config)
            config["engine"] = engine
            meta = {
                "task": args.task,
                "case": name,
                "config": public,
                "engine": engine,
                "limit_mib": limit_mib,
                "container": bool(args.container),
            }
            e = get_engine(engine, args.task)
            if e.budget:
                config["memory_budget"] = int(limit_mib * MiB)
                meta["memory_budget_mib"] = limit_mib
            logger.info("largest batch of %s on %s within %.0f MiB", engine, name, limit_mib)
            why = available(e) or past(getattr(args, "deadline", None))
            if why:
                result = {"skipped": why}
            else:
                result = largest_batch(
                    config,
                    limit_mib,
                    cap=cap,
                    on_probe=lambda p, meta=meta: out.write({"record": "probe", **meta, **p}),
                    container=bool(args.container),
                )
            record = {"record": "largest", **meta, **result}
            logger.info(
                "  -> %s", result.get("largest", result.get("error") or result.get("skipped"))
            )
            out.write(record)
            records.append({**record, "file": args.json or "-"})
    out.write({"record": "done", "elapsed_s": time.time() - started})
    print()
    print(terminal(format_largest(read_records([args.json]) if args.json else records)))
    return 0


# ---------------------------------------------------------------- report
def report(args) -> int:
    """The report mode: render tables from JSON Lines files (to stdout or a page)."""
    from .report import SECTIONS, default_page, fill, render, terminal
    from .runner import read_records

    records = read_records(args.report)
    page_dir = os.path.dirname(os.path.abspath(args.markdown)) if args.markdown else None
    sections = render(records, page_dir)
    if args.plot:
        from .plots import plot_cases, plot_sweep
        from .report import group_rows

        sweeps = [r for r in records if r.get("record") == "sweep" and "skipped" not in r]
        if sweeps:
            plot_sweep(sweeps, args.plot)
        else:
            plot_cases(
                [(t, rows[0]["config"], rows) for (_, t, _), rows in group_rows(records).items()],
                args.plot,
            )
    if not args.markdown:  # a user's report: the tables, not the project's own targets
        for name in SECTIONS:
            if name != "targets":
                print(f"{name}:\n\n{terminal(sections[name])}\n")
        return 0
    if os.path.exists(args.markdown):
        with open(args.markdown) as f:
            page = f.read()
        if "<!-- bench:" not in page:
            raise ValueError(f"--markdown: {args.markdown} has no <!-- bench:NAME --> sections")
        page = fill(page, sections)
    else:
        page = default_page(sections)
    with open(args.markdown, "w") as f:
        f.write(page)
    logger.info("wrote %s", args.markdown)
    return 0


def main(args) -> int:
    """Run the chosen mode; returns the exit status. On CUDA every measurement runs
    with TF32 off (:func:`memconv.bench.options.strict_float32`), in the workers and
    here, so that the run record's device says so."""
    plan = check_arguments(args)
    if plan["mode"] == "report":
        return report(args)
    strict_float32(args.device)
    if plan["mode"] == "sweep":
        return sweep(args, plan)
    if plan["mode"] == "largest":
        return largest(args, plan)
    return matrix(args, plan)
