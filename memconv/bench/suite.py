"""``memconv suite``: every benchmark table that makes sense on a device, in one command.

The steps are the ``memconv bench`` commands behind docs/benchmarks.md (``make
benchmarks``) that measure something a GPU changes, run on ``--device`` against the
same peers (torch.func, Opacus' hooks and ghost clipping, BackPACK, ExpandedWeights,
non-private training):

- per-sample gradients on the seed CNN (28² and 112²) and on the ResNet-18-GN, Conv1d
  and Conv3d cases, with the cost model against the measured extra memory per layer;
- DP clipping on the ResNet-18-GN, the seed CNN, the WRN-16-4-GN, Conv1d and Conv3d;
- the largest batch within a memory limit (per-sample gradients; DP clipping);
- StreamingCNN against a conventional pass on a 4096² image;
- the batch and image-side sweeps;
- DP on the models people train (torchvision's ResNet-18-GN, timm's NF-ResNet-26 and
  ConvNeXt-atto, the ViT-tiny): one DP clipping step against the non-private step, and
  per-sample gradients against torch.func's.

Each step writes JSON Lines under ``--out`` (``<step>.jsonl``), a record as each
measurement completes, each measurement in a fresh process as ``memconv bench`` does:
on CUDA, peak memory is ``torch.cuda.max_memory_allocated``, times are
CUDA-synchronised (:mod:`memconv.bench.measure`) and TF32 is off
(:func:`memconv.bench.options.strict_float32`). After every step the page
``--markdown`` is refilled from the files so far (``memconv bench --report``; a new page
with every section when it does not exist), so that a run stopped midway leaves its
page. The cgroup-limited largest-batch runs of ``make benchmarks`` measure host memory
and are left out. A step that fails, or flags a deviation from torch.func, does not
stop the others; the exit status is 1 if any did.

On a GPU (``--device cuda``) the steps run by default are the ones with a GPU size
(:attr:`Step.gpu`): the cases and engines of the GPU tables at the batch sizes a GPU
trains with, about 25 fresh processes (some 10 s each on an H100 or H200) and eight
minutes in all there. ``--time-budget SECONDS`` bounds a run: a step whose estimate
(:func:`estimate`) does not fit what is left is skipped, and a step that runs past it
starts no more measurements; each skip is logged and recorded (``"skipped"``).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from .options import check_device, parse_names

logger = logging.getLogger("memconv")

DESCRIPTION = (
    "Measure, on one device (--device cuda on a GPU; cpu works too), every benchmark "
    "table of docs/benchmarks.md that a GPU changes: per-sample gradients on the seed CNN "
    "and the bench cases, DP clipping on ResNet-18-GN and WRN-16-4-GN, the largest batch "
    "within a memory limit, StreamingCNN at 4096², the sweeps; against the same peers. "
    "Writes one JSON Lines file per step under --out and refills the Markdown page "
    "--markdown from them."
)

#: The models people train (the table "DP on the models people train").
MODEL_CASES = "resnet18-tv-gn,nf-resnet26,convnext-atto,vit-tiny"
GRADS_ENGINES = (
    "autograd,torch.func,expanded-weights,opacus-hooks,backpack-save-memory,memconv:standard,"
    "memconv:rochette,memconv:unfold,memconv:shift,memconv:auto,memconv:budget,"
    "memconv:default,memconv-modules:auto,memconv-backpack:auto"
)


@dataclass(frozen=True)
class Step:
    """One ``memconv bench`` command of the suite.

    Attributes:
        name: the step's name and JSON Lines file's stem.
        args: its options (``--device``, ``--json`` and ``--plot`` are added).
        quick: its options with ``--quick`` (a smoke test of seconds per step).
        plot: write ``<name>.png`` beside the JSON Lines file (where matplotlib is).
        gpu: its options on a GPU (the GPU tables' cases and engines at a GPU's batch
            sizes, sized with the others for eight minutes on one H100 or H200); None:
            not run on a GPU unless ``--steps`` names it (then with :attr:`args`).
    """

    name: str
    args: tuple[str, ...]
    quick: tuple[str, ...]
    plot: bool = False
    gpu: tuple[str, ...] | None = None


def _argv(options: str) -> tuple[str, ...]:
    """A step's options, written as on the command line (no option holds a space)."""
    return tuple(options.split())


STEPS = (
    Step(
        "clip",
        _argv("--task clip --cases resnet18-gn,seed-112"),
        _argv("--task clip --quick --cases resnet18-gn --engines non-private,memconv:auto"),
        plot=True,
        gpu=_argv(
            "--task clip --cases resnet18-gn --batch-size 256 --engines "
            "non-private,torch.func,opacus-ghost,memconv:default,memconv:step"
        ),
    ),
    Step(
        "clip-more",
        _argv("--task clip --cases wrn16-4-gn,conv1d,conv3d"),
        _argv("--task clip --quick --cases wrn16-4-gn --engines non-private,memconv:auto"),
    ),
    Step(
        "grads",
        _argv(f"--task grads --cases seed-112,seed-28 --engines {GRADS_ENGINES}"),
        _argv("--task grads --quick --cases seed-28 --engines torch.func,memconv:auto"),
        plot=True,
        gpu=_argv(
            "--task grads --cases seed-112 --batch-size 256 --engines "
            "autograd,torch.func,opacus-hooks,memconv:step"
        ),
    ),
    Step(
        "grads-more",
        _argv("--task grads --cases resnet18-gn,conv1d,conv3d"),
        _argv("--task grads --quick --cases conv1d --engines torch.func,memconv:auto"),
    ),
    Step(
        "largest-grads",
        _argv(
            "--task grads --largest-batch --engines "
            "autograd,torch.func,opacus-hooks,memconv:auto,memconv:budget"
        ),
        _argv(
            "--task grads --largest-batch --quick --cases seed-28 --engines "
            "memconv:auto --limit-gib 0.05 --max-batch 8"
        ),
    ),
    Step(
        "largest-clip",
        _argv(
            "--task clip --largest-batch --cases resnet18-gn --engines "
            "non-private,opacus-ghost,memconv:auto,memconv:budget"
        ),
        _argv(
            "--task clip --largest-batch --quick --cases resnet18-gn --engines "
            "memconv:auto --limit-gib 0.05 --max-batch 8"
        ),
    ),
    Step(
        "streaming",
        _argv("--task grads --cases streaming-4096 --engines autograd,memconv-streaming"),
        _argv("--task grads --quick --cases streaming-4096 --engines autograd,memconv-streaming"),
        gpu=_argv("--task grads --cases streaming-4096 --engines autograd,memconv-streaming"),
    ),
    Step(
        "sweep-batch",
        _argv("--sweep batch --range 8,32,128,512"),
        _argv("--sweep batch --quick --range 2,4 --engines autograd,memconv:auto"),
        plot=True,
        gpu=_argv(
            "--sweep batch --task clip --cases resnet18-gn --range 64,1024 --engines "
            "non-private,memconv:step"
        ),
    ),
    Step(
        "sweep-side",
        _argv("--sweep side --range 28,56,112,224"),
        _argv("--sweep side --quick --range 28,56 --engines autograd,memconv:auto"),
        plot=True,
    ),
    Step(
        "models",
        _argv(
            f"--task clip --table models --cases {MODEL_CASES} --engines "
            "non-private,memconv:default,memconv:step,opacus-ghost,torch.func"
        ),
        _argv(
            "--task clip --table models --quick --cases convnext-atto --engines "
            "non-private,memconv:default"
        ),
        gpu=_argv(
            "--task clip --table models --cases nf-resnet26,vit-tiny --batch-size 256 "
            "--engines non-private,memconv:step,opacus-ghost,torch.func"
        ),
    ),
    Step(
        "models-grads",
        _argv(
            f"--task grads --table models --cases {MODEL_CASES} --engines "
            "torch.func,memconv:default,memconv:step"
        ),
        _argv(
            "--task grads --table models --quick --cases convnext-atto --engines "
            "torch.func,memconv:default"
        ),
    ),
)
STEP_NAMES = tuple(s.name for s in STEPS)
#: The order of the steps on a GPU: the tables the GPU work is judged by first, so that
#: a time budget that runs short drops the others.
GPU_ORDER = ("clip", "models", "grads", "streaming", "sweep-batch")
#: Seconds a fresh measuring process takes besides its measurement (start-up, imports,
#: the device's initialisation, the warm-up), per device type: the estimate's unit.
PROCESS_SECONDS = {"cuda": 12.0, "cpu": 6.0}
#: Seconds one measurement takes on top (its peak-memory calls and timed repeats), as
#: a multiple of a process's start.
MEASURE_FACTOR = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memconv suite``."""
    parser.add_argument(
        "--device", default="cuda", help="torch device to measure on (default: cuda)"
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="folder of the JSON Lines files and figures (default: docs/bench/<device type>)",
    )
    parser.add_argument(
        "--markdown",
        metavar="PAGE",
        help="the page refilled from the files (default: docs/benchmarks-<device type>.md)",
    )
    parser.add_argument(
        "--steps",
        metavar="NAMES",
        help="comma-separated steps to run, or all (default: all): " + ", ".join(STEP_NAMES),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small shapes and a few engines per step: a smoke test (minutes on 2 CPU cores)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        metavar="R",
        help="timed calls per measurement (default: memconv bench's)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="stop within this many seconds: a step whose estimate does not fit what is "
        "left is skipped, a step that runs past it starts no more measurements (each "
        "skip is logged and recorded); default: no limit",
    )


def check_arguments(args) -> list[Step]:
    """Validate the options before any work; returns the steps to run.

    Raises:
        ValueError: an unknown step, an unavailable device (``--device cuda`` without
            CUDA), a negative ``--repeats``.
    """
    check_device(args.device)
    names = parse_names(args.steps, STEP_NAMES, "--steps")
    if args.repeats is not None and args.repeats < 0:
        raise ValueError(f"--repeats must be >= 0, got {args.repeats}")
    budget = getattr(args, "time_budget", None)
    if budget is not None and not (0 < budget < math.inf):
        raise ValueError(f"--time-budget must be a positive number of seconds, got {budget}")
    steps = STEPS
    if _gpu(args):
        rank = {name: i for i, name in enumerate(GPU_ORDER)}
        steps = sorted(STEPS, key=lambda s: rank.get(s.name, len(rank)))
    if names is None:
        return [s for s in steps if not _gpu(args) or s.gpu is not None]
    return [s for s in steps if s.name in names]


def _gpu(args) -> bool:
    """Whether the steps take their GPU size (a CUDA device, not ``--quick``)."""
    import torch

    return torch.device(args.device).type == "cuda" and not args.quick


def bench_argv(step: Step, args, out: Path) -> list[str]:
    """The ``memconv bench`` options of one step."""
    if args.quick:
        options = step.quick
    elif _gpu(args) and step.gpu is not None:
        options = step.gpu
    else:
        options = step.args
    argv = [*options, "--device", args.device]
    argv += ["--json", str(out / f"{step.name}.jsonl")]
    if step.plot:
        if importlib.util.find_spec("matplotlib") is not None:
            argv += ["--plot", str(out / f"{step.name}.png")]
        else:
            logger.info("suite: no plot for step %s (matplotlib is not installed)", step.name)
    if args.repeats is not None and "--largest-batch" not in argv:
        argv += ["--repeats", str(args.repeats)]
    return argv


def estimate(sub, device_type: str) -> float:
    """Seconds a ``memconv bench`` run (its parsed options ``sub``) is expected to take:
    its fresh processes (the matrix: one per case and engine, and the cost model's; a sweep: one per value and engine; a largest-batch search:
    one per probe of its bisection) times :data:`PROCESS_SECONDS`, plus each one's
    measurement (:data:`MEASURE_FACTOR`)."""
    from . import bench

    plan = bench.check_arguments(sub)
    mode, task = plan["mode"], sub.task
    processes = 0
    for case in plan["cases"]:
        engines = plan["engines"] or bench.default_engines(mode, task, case)
        if mode == "matrix":
            processes += len(set(engines))
        elif mode == "sweep":
            processes += len(engines) * len(plan["range"])
        else:  # a bisection up to --max-batch
            processes += len(engines) * (math.ceil(math.log2(sub.max_batch or 1024)) + 2)
    if mode == "matrix" and task == "grads":
        processes += 1  # the cost model, on a seed case
    return processes * PROCESS_SECONDS.get(device_type, 6.0) * (1 + MEASURE_FACTOR)


def main(args) -> int:
    """``memconv suite``: run the steps, then refill the page; returns the exit status."""
    import torch

    from . import bench

    steps = check_arguments(args)
    kind = torch.device(args.device).type
    out = Path(args.out or f"docs/bench/{kind}")
    page = args.markdown or f"docs/benchmarks-{kind}.md"
    out.mkdir(parents=True, exist_ok=True)
    parser = argparse.ArgumentParser(prog="memconv bench")
    bench.add_arguments(parser)
    budget = getattr(args, "time_budget", None)
    deadline = None if budget is None else time.monotonic() + budget
    failed, skipped, files = [], [], []
    for i, step in enumerate(steps):
        argv = bench_argv(step, args, out)
        sub = parser.parse_args(argv)
        sub.argv = ["bench", *argv]
        sub.deadline = deadline
        if deadline is not None:
            left = deadline - time.monotonic()
            try:
                needed = estimate(sub, kind)
            except (ValueError, ImportError) as err:
                needed = 0.0  # the step's own run says what is wrong
                logger.debug("suite: no estimate for step %s: %s", step.name, err)
            if needed > left:
                logger.warning(
                    "suite [%d/%d] step %s skipped: about %.0f s needed, %.0f s left of "
                    "--time-budget %.0f",
                    i + 1,
                    len(steps),
                    step.name,
                    needed,
                    max(left, 0.0),
                    budget,
                )
                skipped.append(step.name)
                continue
        logger.info("suite [%d/%d] memconv bench %s", i + 1, len(steps), " ".join(argv))
        started = time.time()
        try:
            status = bench.main(sub)
        except (ValueError, ImportError, RuntimeError) as err:
            logger.error("suite: step %s failed: %s", step.name, err)
            status = 1
        logger.info("suite: step %s done in %.1f min", step.name, (time.time() - started) / 60)
        if status:
            failed.append(step.name)
        if Path(sub.json).is_file():
            files.append(sub.json)
            _refill(parser, bench, files, page)  # the page as it stands after each step
    if skipped:
        logger.warning("suite: steps skipped for --time-budget: %s", ", ".join(skipped))
    if failed:
        logger.warning("suite: steps that failed or flagged deviations: %s", ", ".join(failed))
        return 1
    return 0


def _refill(parser, bench, files: list, page: str) -> None:
    """Refill ``page`` from the JSON Lines ``files`` (``memconv bench --report``)."""
    report = parser.parse_args(["--report", *files, "--markdown", page])
    report.argv = ["bench", "--report", *files, "--markdown", page]
    bench.main(report)
