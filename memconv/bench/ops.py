"""Operation counts: how many ATen operations and host synchronisations one call of
each engine issues, by batch size — the device-independent half of a GPU's speed.

On a GPU every tensor operation is at least one kernel launch and its dispatch (some
5 to 40 µs of host time), so a step whose operations are many and small is bound by
their number, not by its arithmetic; a count that grows with the batch (a Python loop
over samples or over fixed-size chunks) makes the step slower the larger the batch.
The count is the same on every device, so it is measured here on the CPU: the
PyTorch profiler records one call after two warm-up calls, and the table gives the
**top-level** ATen operations (those no other ATen operation called: what Python
asked for, each a dispatch and, on a GPU, at least one launch), all ATen operations,
and the host synchronisations (``aten::_local_scalar_dense``: ``.item()``,
``.tolist()``, ``bool(tensor)``; on a GPU each waits for the device to drain).

Run it as::

    python -m memconv.bench.ops --json docs/bench/ops.jsonl --markdown docs/benchmarks.md

which measures every row of :data:`ROWS` at batch sizes 4, 16 and 64 (a few minutes
on 2 CPU cores) and refills the block between ``<!-- ops:table -->`` and
``<!-- /ops:table -->`` of the page. The count depends on the routes memconv's cost
models choose, which depend on the device's calibration: ``--pricing cuda`` counts the
routes the shipped CUDA calibration picks (a GPU's), still on the CPU.

``--streaming`` counts one training step of the streamed trunks instead
(:data:`STREAM_ROWS`: conventional, then :class:`memconv.streaming.StreamingCNN` at each
tile), per tile, and refills the block ``<!-- ops:streaming -->``::

    python -m memconv.bench.ops --streaming --json docs/bench/ops-streaming.jsonl \
        --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import warnings
from datetime import datetime, timezone

import torch
from torch.profiler import ProfilerActivity, profile

from ..strategies import costs
from .cases import CASES, build_case
from .engines import FLOOR, available, get_engine
from .options import command_line, device_record, machine
from .report import fill_block

#: ``(case, task, engines)`` of the table; the task's floor (the non-private step, or
#: autograd's summed gradient) comes first.
ROWS = (
    ("resnet18-gn", "clip", ("non-private", "memconv:step", "opacus-ghost")),
    ("nf-resnet26", "clip", ("non-private", "memconv:step", "opacus-ghost")),
    ("vit-tiny", "clip", ("non-private", "memconv:step", "opacus-ghost")),
    ("seed-112", "grads", ("autograd", "memconv:step")),
)
#: Batch sizes of the table.
BATCHES = (4, 16, 64)
#: The engine labels of the table.
LABELS = {
    "non-private": "non-private step (autograd)",
    "autograd": "autograd (summed gradient)",
    "memconv:step": "memconv `PrivateStep`",
    "opacus-ghost": "Opacus ghost clipping",
}
#: The name of the page's block this module refills.
BLOCK = "ops:table"


#: Top-level ATen operations that run no kernel: views and allocations (on a GPU a
#: dispatch on the host, no launch).
NO_KERNEL = frozenset(
    "aten::" + name
    for name in (
        "slice narrow view view_as as_strided detach t expand reshape _reshape_alias "
        "flatten permute transpose unsqueeze squeeze select alias unbind split chunk "
        "empty empty_like new_empty empty_strided lift_fresh"
    ).split()
)


def count(fn, warmup: int = 2, *, by_name: bool = False) -> dict:
    """Operations of one call of ``fn()`` after ``warmup`` calls (:mod:`torch.profiler`
    on the CPU).

    Args:
        fn: the call.
        warmup: calls before the one counted.
        by_name: also return the top-level operations by name.

    Returns:
        ``{"top_level": ATen operations no other ATen operation called, "kernels": those
        of them that run a kernel (not in :data:`NO_KERNEL`), "all": every ATen
        operation, "host_syncs": aten::_local_scalar_dense events, "compiled_kernels":
        inductor's generated kernels called (seen where inductor's
        ``cpp.enable_kernel_profile`` was on when they compiled; 0 otherwise),
        "launches": top-level operations plus compiled kernels}`` (and ``"names":
        {name: top-level count}``).
    """
    for _ in range(warmup):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    syncs = sum(e.name == "aten::_local_scalar_dense" for e in events)
    compiled = sum("cpp_fused" in e.name or e.name.startswith("triton_") for e in prof.events())
    out = {
        "top_level": len(top),
        "kernels": sum(e.name not in NO_KERNEL for e in top),
        "all": len(events),
        "host_syncs": syncs,
        "compiled_kernels": compiled,
        "launches": len(top) + compiled,
    }
    if by_name:
        names: dict[str, int] = {}
        for e in top:
            names[e.name] = names.get(e.name, 0) + 1
        out["names"] = dict(sorted(names.items(), key=lambda kv: -kv[1]))
    return out


def measure(case: str, task: str, engine: str, batch: int, pricing: str = "cpu") -> dict:
    """The operation counts of one engine's call on ``case`` at ``batch`` samples (a
    fresh model; the engine's per-model state, a :class:`memconv.PrivateStep`, made by
    the warm-up calls), memconv's routes priced by the calibration of the device type
    ``pricing`` (``"cuda"``: the routes a GPU would take, counted on the CPU)."""
    if pricing != "cpu":
        with costs.using("cpu", costs.calibration(pricing)):
            return {**measure(case, task, engine, batch), "pricing": pricing}
    config = {**CASES[case].config(batch=batch), "data": "random"}
    model, x, y = build_case(config, torch.device("cpu"))
    run = get_engine(engine, task).run
    options = {"max_norm": 1.0} if task != "grads" else {}

    def call():
        run(model, x, y, **options)
        model.zero_grad(set_to_none=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peers' warnings, once per call
        counts = count(call)
    return {"record": "ops", "case": case, "task": task, "engine": engine, "batch": batch, **counts}


#: ``(trunk, side, tiles)`` of the streaming table: one training step of a trunk of
#: :data:`memconv.bench.trunks.TRUNKS` with its global-pool + Linear head on one image,
#: conventional and streamed at each tile (input pixels per tile and axis).
STREAM_ROWS = (
    ("resnet18", 2048, (512, 768, 1024)),
    ("convnext-tiny", 2048, (512, 768, 1024)),
)
#: The name of the page's block the streaming counts refill.
STREAM_BLOCK = "ops:streaming"


def measure_streaming(trunk: str, side: int, tile: int | None, warmup: int = 1) -> dict:
    """The operation counts of one training step of ``trunk`` (a name of
    :data:`memconv.bench.trunks.TRUNKS`, with its global-pool + Linear head) on one
    float32 image of ``side``² random pixels: the conventional step (``tile=None``) or
    :class:`memconv.streaming.StreamingCNN` over the trunk with ``tile`` input pixels
    per tile and axis (after ``warmup`` steps, which make its plan).

    Returns:
        :func:`count`'s figures and the names, with ``tiles`` (1 for the conventional
        step) and ``per_tile`` (top-level operations over the tiles).
    """
    from memconv.streaming import StreamingCNN

    from .trunks import classifier

    torch.manual_seed(0)
    model = classifier(trunk)
    body, head = model[0], model[1]
    stream = body if tile is None else StreamingCNN(body, tile)
    x, y = torch.randn(1, 3, side, side), torch.tensor([1])

    def call():
        torch.nn.functional.cross_entropy(head(stream(x)), y).backward()
        model.zero_grad(set_to_none=True)

    counts = count(call, warmup, by_name=True)
    tiles = 1 if tile is None else stream.last_plan.count
    return {
        "record": "ops-streaming",
        "trunk": trunk,
        "side": side,
        "tile": tile,
        "tiles": tiles,
        "per_tile": counts["top_level"] / tiles,
        **counts,
    }


def streaming_table(records: list[dict]) -> str:
    """The Markdown table of ``ops-streaming`` records: per trunk, side and step, the
    tiles, the top-level operations and those running a kernel (in all and per tile),
    the count per tile over the conventional step's, and host synchronisations."""
    rows = [r for r in records if r.get("record") == "ops-streaming"]
    conventional = {(r["trunk"], r["side"]): r for r in rows if r["tile"] is None}
    lines = [
        "| trunk | side | step | tiles | top-level | per tile | kernels | kernels per tile "
        "| per tile / conventional | host syncs |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = conventional.get((r["trunk"], r["side"]))
        step = "conventional" if r["tile"] is None else f"streamed, tile {r['tile']}"
        ratio = f"{r['per_tile'] / base['top_level']:.2f}" if base else "—"
        lines.append(
            f"| {r['trunk']} | {r['side']}² | {step} | {r['tiles']} | {r['top_level']:,} | "
            f"{r['per_tile']:,.0f} | {r['kernels']:,} | {r['kernels'] / r['tiles']:,.0f} | "
            f"{ratio} | {r['host_syncs']} |"
        )
    return "\n".join(lines)


def table(records: list[dict]) -> str:
    """The Markdown table of ``ops`` records: per case and engine, top-level operations
    at each batch size, the ratio to the task's floor at the smallest and the largest,
    the growth from the smallest batch to the largest, and host synchronisations."""
    rows = [r for r in records if r.get("record") == "ops"]
    batches = sorted({r["batch"] for r in rows})
    # rows priced for another device are their engine's own rows ("engine@cuda")
    rows = [
        {**r, "engine": f"{r['engine']}@{r['pricing']}"} if r.get("pricing", "cpu") != "cpu" else r
        for r in rows
    ]
    got = {(r["case"], r["engine"], r["batch"]): r for r in rows}
    lines = [
        "| case | engine | "
        + " | ".join(f"N={b}" for b in batches)
        + " | × floor | growth | host syncs |",
        "|---|---|" + "---:|" * (len(batches) + 3),
    ]
    seen = list(dict.fromkeys((r["case"], r["task"], r["engine"]) for r in rows))
    for case, task, engine in seen:
        counts = [got.get((case, engine, b)) for b in batches]
        cells = [f"{c['top_level']:,}" if c else "—" for c in counts]
        floor = [got.get((case, FLOOR[task], b)) for b in batches]
        ratio, growth = "—", "—"
        if counts[0] and counts[-1] and floor[0] and floor[-1]:
            first = counts[0]["top_level"] / floor[0]["top_level"]
            last = counts[-1]["top_level"] / floor[-1]["top_level"]
            ratio = f"{first:.2f} → {last:.2f}" if len(batches) > 1 else f"{first:.2f}"
            growth = f"{counts[-1]['top_level'] / counts[0]['top_level'] - 1:+.0%}"
        syncs = sorted({c["host_syncs"] for c in counts if c})
        base, _, pricing = engine.partition("@")
        label = LABELS.get(base, base) + (f", routes priced for {pricing}" if pricing else "")
        lines.append(
            f"| {case} ({task}) | {label} | "
            + " | ".join(cells)
            + f" | {ratio} | {growth} | {', '.join(map(str, syncs))} |"
        )
    return "\n".join(lines)


def note(run: dict, *more: dict) -> str:
    """The line under the table: how it was made (by ``run`` and the ``more`` runs whose
    records it also shows, on the same machine)."""
    m = run.get("machine", {})
    commands = "; ".join(f"`{r.get('command', '')}`" for r in (run, *more))
    return (
        f"\n\nTop-level ATen operations per call (torch.profiler, one call after two "
        f"warm-ups, float32, random data), {commands} on "
        f"{m.get('cpu', 'a CPU')}, torch {m.get('torch', '?')}, memconv "
        f"{m.get('memconv', '?')}. × floor: against the task's floor (the non-private "
        "step for clipping, autograd's summed gradient for per-sample gradients) at the "
        "smallest and the largest batch; growth: from the smallest batch to the largest."
    )


def _refill(page: str, text: str, block: str = BLOCK) -> None:
    with open(page) as f:
        content = f.read()
    with open(page, "w") as f:
        f.write(fill_block(content, block, text))


def stream_note(run: dict) -> str:
    """The line under the streaming table: how it was made."""
    m = run.get("machine", {})
    return (
        f"\n\nTop-level ATen operations of one training step (torch.profiler, one step "
        f"after one warm-up, float32, random data), `{run.get('command', '')}` on "
        f"{m.get('cpu', 'a CPU')}, torch {m.get('torch', '?')}, memconv "
        f"{m.get('memconv', '?')}. Kernels: the top-level operations that run a kernel "
        "(views and allocations left out; on a GPU each is at least one launch). Per tile "
        "/ conventional: the streamed step's operations per tile over the conventional "
        "step's on the whole image."
    )


def report(files: list[str], markdown: str | None) -> int:
    """Print (and refill ``markdown``'s blocks with) the tables of the ``ops`` and
    ``ops-streaming`` records of ``files``, under the note of each file's run."""
    records, runs, streamed, stream_runs = [], [], [], []
    for path in files:
        with open(path) as f:
            got = [json.loads(line) for line in f if line.strip()]
        mine = [r for r in got if r.get("record") == "run"]
        if any(r.get("record") == "ops-streaming" for r in got):
            stream_runs += mine
            streamed += [r for r in got if r.get("record") == "ops-streaming"]
        else:
            runs += mine
        records += [r for r in got if r.get("record") == "ops"]
    if records:
        text = table(records) + (note(*runs) if runs else "")
        print(text)
        if markdown:
            _refill(markdown, text)
    if streamed:
        text = streaming_table(streamed) + (stream_note(stream_runs[0]) if stream_runs else "")
        print(text)
        if markdown:
            _refill(markdown, text, STREAM_BLOCK)
    return 0


def _publish(text: str, markdown: str | None, block: str = BLOCK) -> int:
    """Print ``text`` and refill ``markdown``'s ``block`` with it (0, the exit status)."""
    print(text)
    if markdown:
        _refill(markdown, text, block)
    return 0


def _keep(record: dict, records: list, out) -> dict:
    """``record``, appended to ``records`` and written to ``out`` (a file, or None) as
    it comes."""
    records.append(record)
    if out:
        out.write(json.dumps(record) + "\n")
        out.flush()
    return record


def streaming(args, run: dict) -> int:
    """Measure :data:`STREAM_ROWS` (or ``args.trunks``/``args.sides``/``args.tiles``),
    print the table and refill the page's streaming block."""
    rows = STREAM_ROWS
    if args.trunks or args.sides or args.tiles:
        trunks = args.trunks.split(",") if args.trunks else list(dict.fromkeys(r[0] for r in rows))
        sides = [int(v) for v in args.sides.split(",")] if args.sides else [2048]
        tiles = tuple(int(v) for v in args.tiles.split(",")) if args.tiles else (512, 768, 1024)
        rows = tuple((t, s, tiles) for t in trunks for s in sides)
    records = [run]
    out = open(args.json, "w") if args.json else None  # noqa: SIM115 (written as it goes)
    try:
        if out:
            out.write(json.dumps(run) + "\n")
        for trunk, side, tiles in rows:
            for tile in (None, *tiles):
                record = _keep(measure_streaming(trunk, side, tile), records, out)
                got = {k: record[k] for k in ("tiles", "top_level", "kernels", "host_syncs")}
                print(f"{trunk} {side}² tile {tile}: {got}", flush=True)
    finally:
        if out:
            out.close()
    return _publish(streaming_table(records) + stream_note(run), args.markdown, STREAM_BLOCK)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memconv.bench.ops", description=__doc__)
    parser.add_argument(
        "--cases",
        help=f"comma-separated cases of the table (default: {','.join(r[0] for r in ROWS)})",
    )
    parser.add_argument(
        "--batches",
        default=",".join(map(str, BATCHES)),
        help="comma-separated batch sizes (default: 4,16,64)",
    )
    parser.add_argument(
        "--pricing",
        choices=("cpu", "cuda"),
        default="cpu",
        help="the calibration that prices memconv's routes: this CPU's (default), or "
        "the shipped CUDA one (the routes a GPU takes; memconv's engines only)",
    )
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="count one training step of the streamed trunks instead (conventional and "
        f"streamed at each tile; the {STREAM_BLOCK} block)",
    )
    parser.add_argument("--trunks", help="with --streaming: comma-separated trunks")
    parser.add_argument("--sides", help="with --streaming: comma-separated image sides")
    parser.add_argument("--tiles", help="with --streaming: comma-separated tile sizes")
    parser.add_argument("--json", help="write the run and every count to this file (JSON Lines)")
    parser.add_argument("--markdown", help=f"refill the {BLOCK} block of this page")
    parser.add_argument(
        "--report",
        nargs="+",
        metavar="FILE",
        help="measure nothing: the table of these --json files' counts (their runs named)",
    )
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report, args.markdown)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error("--batches takes comma-separated integers")
    if not batches or min(batches) < 1:
        parser.error("--batches takes positive integers")
    rows = ROWS
    if args.cases:
        names = args.cases.split(",")
        unknown = [c for c in names if c not in {r[0] for r in ROWS}]
        if unknown:
            parser.error(f"unknown case(s) {unknown}; accepted: {', '.join(r[0] for r in ROWS)}")
        rows = [r for r in ROWS if r[0] in names]
    torch.set_num_threads(1)
    run = {
        "record": "run",
        "mode": "ops-streaming" if args.streaming else "ops",
        "command": "python -m memconv.bench.ops " + command_line(argv).removeprefix("memconv "),
        "machine": machine(),
        "device": device_record("cpu"),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if args.streaming:
        return streaming(args, run)
    records = [run]
    out = open(args.json, "w") if args.json else None  # noqa: SIM115 (written as it goes)
    try:
        if out:
            out.write(json.dumps(run) + "\n")
        for case, task, engines in rows:
            for engine in engines:
                if args.pricing != "cpu" and not engine.startswith("memconv"):
                    continue  # (a peer's operations do not depend on memconv's prices)
                why = available(get_engine(engine, task))
                if why:
                    print(f"{case} {engine}: skipped, {why}", flush=True)
                    continue
                for b in batches:
                    record = _keep(measure(case, task, engine, b, args.pricing), records, out)
                    print(
                        f"{case} {task} {engine} N={b}: {record['top_level']} top-level, "
                        f"{record['all']} in all, {record['host_syncs']} host syncs",
                        flush=True,
                    )
    finally:
        if out:
            out.close()
    return _publish(table(records) + note(run), args.markdown)


if __name__ == "__main__":
    raise SystemExit(main())
