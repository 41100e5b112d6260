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

Each step writes JSON Lines under ``--out`` (``<step>.jsonl``), each measurement in a
fresh process as ``memconv bench`` does: on CUDA, peak memory is
``torch.cuda.max_memory_allocated`` and times are CUDA-synchronised
(:mod:`memconv.bench.measure`). Then the page ``--markdown`` is refilled from them
(``memconv bench --report``; a new page with every section when it does not exist).
The cgroup-limited largest-batch runs of ``make benchmarks`` measure host memory and
are left out. A step that fails, or flags a deviation from torch.func, does not stop
the others; the exit status is 1 if any did.
"""

from __future__ import annotations

import argparse
import logging
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
        plot: write ``<name>.png`` beside the JSON Lines file.
    """

    name: str
    args: tuple[str, ...]
    quick: tuple[str, ...]
    plot: bool = False


STEPS = (
    Step("clip", ("--task", "clip", "--cases", "resnet18-gn,seed-112"),
         ("--task", "clip", "--quick", "--cases", "resnet18-gn",
          "--engines", "non-private,memconv:auto"), plot=True),
    Step("clip-more", ("--task", "clip", "--cases", "wrn16-4-gn,conv1d,conv3d"),
         ("--task", "clip", "--quick", "--cases", "wrn16-4-gn",
          "--engines", "non-private,memconv:auto")),
    Step("grads", ("--task", "grads", "--cases", "seed-112,seed-28", "--engines", GRADS_ENGINES),
         ("--task", "grads", "--quick", "--cases", "seed-28",
          "--engines", "torch.func,memconv:auto"), plot=True),
    Step("grads-more", ("--task", "grads", "--cases", "resnet18-gn,conv1d,conv3d"),
         ("--task", "grads", "--quick", "--cases", "conv1d",
          "--engines", "torch.func,memconv:auto")),
    Step("largest-grads",
         ("--task", "grads", "--largest-batch",
          "--engines", "autograd,torch.func,opacus-hooks,memconv:auto,memconv:budget"),
         ("--task", "grads", "--largest-batch", "--quick", "--cases", "seed-28",
          "--engines", "memconv:auto", "--limit-gib", "0.05", "--max-batch", "8")),
    Step("largest-clip",
         ("--task", "clip", "--largest-batch", "--cases", "resnet18-gn",
          "--engines", "non-private,opacus-ghost,memconv:auto,memconv:budget"),
         ("--task", "clip", "--largest-batch", "--quick", "--cases", "resnet18-gn",
          "--engines", "memconv:auto", "--limit-gib", "0.05", "--max-batch", "8")),
    Step("streaming", ("--task", "grads", "--cases", "streaming-4096",
                       "--engines", "autograd,memconv-streaming"),
         ("--task", "grads", "--quick", "--cases", "streaming-4096",
          "--engines", "autograd,memconv-streaming")),
    Step("sweep-batch", ("--sweep", "batch", "--range", "8,32,128,512"),
         ("--sweep", "batch", "--quick", "--range", "2,4",
          "--engines", "autograd,memconv:auto"), plot=True),
    Step("sweep-side", ("--sweep", "side", "--range", "28,56,112,224"),
         ("--sweep", "side", "--quick", "--range", "28,56",
          "--engines", "autograd,memconv:auto"), plot=True),
    Step("models", ("--task", "clip", "--table", "models", "--cases", MODEL_CASES,
                    "--engines", "non-private,memconv:default,memconv:step,opacus-ghost,torch.func"),
         ("--task", "clip", "--table", "models", "--quick", "--cases", "convnext-atto",
          "--engines", "non-private,memconv:default")),
    Step("models-grads", ("--task", "grads", "--table", "models", "--cases", MODEL_CASES,
                          "--engines", "torch.func,memconv:default,memconv:step"),
         ("--task", "grads", "--table", "models", "--quick", "--cases", "convnext-atto",
          "--engines", "torch.func,memconv:default")),
)  # fmt: skip
STEP_NAMES = tuple(s.name for s in STEPS)


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


def check_arguments(args) -> list[Step]:
    """Validate the options before any work; returns the steps to run.

    Raises:
        ValueError: an unknown step, an unavailable device (``--device cuda`` without
            CUDA), a negative ``--repeats``.
    """
    check_device(args.device)
    names = parse_names(args.steps, STEP_NAMES, "--steps") or list(STEP_NAMES)
    if args.repeats is not None and args.repeats < 0:
        raise ValueError(f"--repeats must be >= 0, got {args.repeats}")
    return [s for s in STEPS if s.name in names]


def bench_argv(step: Step, args, out: Path) -> list[str]:
    """The ``memconv bench`` options of one step."""
    argv = [*(step.quick if args.quick else step.args), "--device", args.device]
    argv += ["--json", str(out / f"{step.name}.jsonl")]
    if step.plot:
        argv += ["--plot", str(out / f"{step.name}.png")]
    if args.repeats is not None and "--largest-batch" not in argv:
        argv += ["--repeats", str(args.repeats)]
    return argv


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
    failed, files = [], []
    for i, step in enumerate(steps):
        argv = bench_argv(step, args, out)
        logger.info("suite [%d/%d] memconv bench %s", i + 1, len(steps), " ".join(argv))
        sub = parser.parse_args(argv)
        sub.argv = ["bench", *argv]
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
    if files:
        report = parser.parse_args(["--report", *files, "--markdown", page])
        report.argv = ["bench", "--report", *files, "--markdown", page]
        bench.main(report)
    if failed:
        logger.warning("suite: steps that failed or flagged deviations: %s", ", ".join(failed))
        return 1
    return 0
