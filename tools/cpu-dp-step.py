"""The DP step on the CPU against the non-private step, one engine per fresh process.

Run as ``python tools/cpu-dp-step.py [--tree DIR ...] [--rounds R]``: for each model
(CIFAR ResNet-18-GN 32², torchvision ResNet-18-GN 64², ConvNeXt-atto 64², batch 64,
float32, one thread) and each tree (a checkout of memconv; this one by default), the
non-private step, ``clip_and_accumulate`` with default arguments and
``PrivateStep.clip_and_accumulate`` each run in a fresh process (``--engines per-layer``:
per-layer clipping, ``clip_and_accumulate(..., groups="parameter")``; ``grads``: the
plain ``per_sample_grads``): two warm-up calls,
the median of three timed calls (wall time, and the process's CPU time, which other
jobs on a shared machine disturb far less), then the allocator-level peak of one call
(the profiler's memory events), and the process's peak RSS (``ru_maxrss``, the
import of torch included). The engines and trees alternate within each round.

``--env "NAME=VALUE ..."``, given more than once, runs every engine under each of those
environments in turn (``--env ""``: the environment as it is), alternating within each
round, each record naming its own: the C library's allocator settings, for one, move a
step's time (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, torch's
``THP_MEM_ALLOC_ENABLE``). ``--json FILE`` appends the records to FILE; at the end a Markdown table gives each
engine's median time over the rounds against the same environment's non-private step
and against its own time in the first environment, and its median peak RSS
(``--table FILE`` prints that table of FILE's records and runs nothing).
"""

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

CASES = {"cifar-resnet18-gn": 32, "tv-resnet18-gn": 64, "convnext-atto": 64}
ENGINES = ("non-private", "plain", "PrivateStep")
#: Engines run only where asked for (``--engines``).
OPTIONAL_ENGINES = ("per-layer", "grads")


def worker(tree, case, engine):
    sys.path.insert(0, tree)
    import torch
    from torch import nn

    import memconv
    from memconv.bench import models
    from memconv.bench.measure import peak_allocated

    torch.set_num_threads(1)
    torch.manual_seed(0)
    build = {
        "cifar-resnet18-gn": models.resnet18_gn,
        "tv-resnet18-gn": models.tv_resnet18_gn,
        "convnext-atto": models.convnext_atto,
    }[case]
    model = build()
    side = CASES[case]
    x, y = torch.randn(64, 3, side, side), torch.randint(0, 10, (64,))
    loss = nn.CrossEntropyLoss()
    step = memconv.PrivateStep(model, loss) if engine == "PrivateStep" else None

    def call():
        model.zero_grad(set_to_none=True)
        if engine == "non-private":
            loss(model(x), y).backward()
        elif engine == "plain":
            memconv.clip_and_accumulate(model, loss, x, y, max_norm=1.0)
        elif engine == "per-layer":
            memconv.clip_and_accumulate(model, loss, x, y, max_norm=1.0, groups="parameter")
        elif engine == "grads":
            memconv.per_sample_grads(model, loss, x, y)
        else:
            step.clip_and_accumulate(x, y, max_norm=1.0)

    for _ in range(2):
        call()
    times, cpu = [], []
    for _ in range(3):
        start, start_cpu = time.perf_counter(), time.process_time()
        call()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak, _ = peak_allocated(call, torch.device("cpu"))
    record = {"time_s": statistics.median(times), "cpu_s": statistics.median(cpu)}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({**record, "peak_MiB": peak, "peak_rss_MiB": rss}))


def environment(spec: str) -> dict[str, str]:
    """``{name: value}`` of an ``--env`` argument: ``NAME=VALUE`` words.

    Raises:
        argparse.ArgumentTypeError: a word without ``=``.
    """
    pairs = {}
    for word in shlex.split(spec):
        name, sep, value = word.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"--env takes NAME=VALUE words, got {word!r}")
        pairs[name] = value
    return pairs


def table(records) -> str:
    """A Markdown table of the records, one row per model and engine (and tree, where
    the records are of more than one): under each environment (in the order first met),
    the median time over the rounds, its ratio to the same environment's (and tree's)
    non-private step and (after the first) to the first environment's time, and the
    median peak RSS; the environments listed below it. Records without an environment
    ran in the one as it was."""

    def label(env):
        return " ".join(f"{k}={v}" for k, v in env.items()) or "the environment as it is"

    trees = len({r.get("tree") for r in records}) > 1
    envs: list[str] = []
    groups: dict = {}
    for r in records:
        env = label(r.get("env", {}))
        if env not in envs:
            envs.append(env)
        key = (r["case"], r["engine"], r.get("tree") if trees else None)
        groups.setdefault(key, {}).setdefault(env, []).append(r)
    head = ["model", "engine"] + (["tree"] if trees else [])
    for i in range(len(envs)):
        head += [f"E{i + 1}: step (s)", "× non-private"]
        head += ["× E1"] if i else []
        head += ["peak RSS (MiB)"]
    named = 3 if trees else 2
    lines = ["| " + " | ".join(head) + " |", "|---" * named + "|" + "---:|" * (len(head) - named)]

    def median(case, engine, tree, env, key="time_s"):
        rows = [r for r in groups.get((case, engine, tree), {}).get(env, []) if key in r]
        return statistics.median(r[key] for r in rows) if rows else None

    for case, engine, tree in groups:
        cells = [case, engine] + ([tree] if trees else [])
        for i, env in enumerate(envs):
            t = median(case, engine, tree, env)
            base = median(case, "non-private", tree, env)
            first = median(case, engine, tree, envs[0])
            rss = median(case, engine, tree, env, "peak_rss_MiB")
            cells += [f"{t:.3f}" if t else "–", f"{t / base:.2f}" if t and base else "–"]
            cells += [f"{t / first:.2f}" if t and first else "–"] if i else []
            cells += [f"{rss:,.0f}" if rss else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"E{i + 1}: {env}." for i, env in enumerate(envs)]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", help="memconv checkouts (default: this)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--env",
        action="append",
        type=environment,
        help='"NAME=VALUE ..." set for the engines\' processes; more than one alternates',
    )
    parser.add_argument("--json", help="append the records to this JSON Lines file")
    parser.add_argument(
        "--table", metavar="FILE", help="print the Markdown table of FILE's records, run nothing"
    )
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return None
    unknown = set(args.engines.split(",")) - set(ENGINES + OPTIONAL_ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; accepted: {ENGINES + OPTIONAL_ENGINES}")
    trees = args.tree or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    envs = args.env or [{}]
    records = []
    for r in range(args.rounds):
        for case in args.cases.split(","):
            for engine in args.engines.split(","):
                for env in envs:
                    for tree in trees:
                        out = (
                            subprocess.run(
                                [sys.executable, __file__, "--worker", tree, case, engine],
                                capture_output=True,
                                text=True,
                                check=True,
                                env={**os.environ, **env},
                            )
                            .stdout.strip()
                            .splitlines()[-1]
                        )
                        record = {"round": r, "case": case, "engine": engine, "tree": tree}
                        record.update(env=env, **json.loads(out))
                        print(json.dumps(record), flush=True)
                        records.append(record)
                        if args.json:
                            with open(args.json, "a") as f:
                                f.write(json.dumps(record) + "\n")

    print(table(records))


if __name__ == "__main__":
    main()
