"""Markdown tables and the targets, rendered from the JSON Lines records of runs.

``memconv bench --report FILE... --markdown PAGE`` fills the sections of PAGE
delimited by ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` with the tables
rendered from the records (every other line of PAGE is kept), so a page's figures
always come from the files, never from hand copies. Section names:
:data:`SECTIONS`.
"""

from __future__ import annotations

import math
import os
import re
import textwrap
from collections import defaultdict

from .cases import CASES, LABELS, describe, shape_of
from .engines import BUDGET_ENGINE, DEFAULT_ENGINE, FLOOR, REFERENCE, STEP_ENGINE

SECTIONS = (
    "commands",
    "machine",
    "grads",
    "cost-model",
    "clip",
    "clip-layer",
    "budget",
    "targets",
    "largest",
    "sweeps",
    "models",
    "streaming",
)
#: Per-layer clipping in one backward pass against the non-private step: the cases
#: (the ViT-tiny's once :mod:`memconv.bench.cases` has it), and the largest ratios of
#: peak memory and time.
PER_LAYER_CASES = ("resnet18-gn", "wrn16-4-gn", "vit-tiny")
PER_LAYER_TARGETS = (1.05, 1.15)
#: "DP on the models people train" (runs with ``--table models``): ``clip_and_accumulate``
#: with default arguments against the non-private step, largest ratios of peak memory and
#: time; and its engines, in the table's order, with their labels.
MODEL_TARGETS = (1.15, 1.30)
MODEL_CLIP_ENGINES = {
    "non-private": "non-private step",
    DEFAULT_ENGINE: "clip_and_accumulate (defaults)",
    STEP_ENGINE: "PrivateStep.clip_and_accumulate (made once)",
    "opacus-ghost": "Opacus ghost clipping",
    "torch.func": "torch.func per-sample gradients, clipped",
}
#: The documented targets of the budget rows: (task, case) → (budget MiB, max peak /
#: budget, max time / the unbudgeted call or None).
BUDGET_TARGETS = {
    ("grads", "seed-112"): (400, 1.05, 2.0),
    ("clip", "resnet18-gn"): (300, 1.05, None),
}


#: Terminal tables: characters per header line, and shorter words for long headers, so
#: that a table fits 100 columns.
HEADER_WIDTH = 7
SHORT_HEADERS = {
    "peak RSS increase (MiB)": "RSS (MiB)",
    "allocator peak (MiB)": "alloc. (MiB)",
    "allocator / floor": "alloc. / floor",
    "allocator / non-private": "alloc. / non-priv.",
    "RSS / non-private": "RSS / non-priv.",
    "time / non-private": "time / non-priv.",
    "time / torch.func": "time / func",
    "time / autograd": "time / auto- grad",
    "result (MiB)": "result (MiB)",
    "max rel. deviation from torch.func": "rel. dev.",
    "measured / predicted": "measured / predicted",
}


def _wrap(header: str) -> str:
    """A header broken at spaces into lines of at most :data:`HEADER_WIDTH` characters
    (a longer word stays whole)."""
    lines: list[str] = []
    for word in SHORT_HEADERS.get(header, header).split():
        if lines and len(lines[-1]) + 1 + len(word) <= HEADER_WIDTH:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines)


def terminal(text: str) -> str:
    """``text`` with its Markdown tables drawn as plain-text tables (``tabulate``,
    headers wrapped) and its ``**bold**`` marks removed, for a terminal; Markdown stays
    for files (``--report``, ``--markdown``)."""
    import tabulate as tabulate_module
    from tabulate import tabulate

    tabulate_module.MIN_PADDING = 0  # columns apart by the format's two spaces alone

    out: list[str] = []
    block: list[str] = []

    def flush():
        if not block:
            return
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block]
        header, body = rows[0], rows[2:]
        aligns = ["right" if c.endswith(":") else "left" for c in rows[1]] if len(rows) > 1 else []
        out.append(
            tabulate(
                body,
                headers=[_wrap(h) for h in header],
                tablefmt="simple",
                colalign=aligns or None,
                disable_numparse=True,
            )
        )
        block.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            block.append(line)
            continue
        flush()
        out.append(line.replace("**", ""))
    flush()
    return "\n".join(
        textwrap.fill(line, 100) if len(line) > 100 and "  " not in line else line for line in out
    )


def _fmt(value, spec: str = ",.0f", missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def _ratio(a, b, spec: str = ".2f") -> str:
    if a is None or not b:
        return "-"
    return format(a / b, spec)


def label(row: dict) -> str:
    """An engine's label, with its budget for budget rows."""
    if row["engine"] == BUDGET_ENGINE and row.get("memory_budget_mib"):
        return f"{row['engine']} ({row['memory_budget_mib']:,.0f} MiB)"
    return row["engine"]


def _failed(row: dict, columns: int) -> str | None:
    if "skipped" in row:
        return f"| {label(row)} | skipped: {row['skipped']} |" + " |" * (columns - 2)
    if "error" in row:
        return f"| {label(row)} | failed: {row['error']} |" + " |" * (columns - 2)
    return None


def group_rows(records: list[dict], kind: str = "row") -> dict:
    """``{(file, task, case): [records]}`` in file order (ratios are read within one run)."""
    groups: dict = defaultdict(list)
    for r in records:
        if r.get("record") == kind:
            groups[(r["file"], r["task"], r["case"])].append(r)
    return groups


def format_case(task: str, config: dict, rows: list[dict]) -> str:
    """Markdown table of one case, with ratios to the floor and to the reference."""
    by = {r["engine"]: r for r in rows if r.get("peak_rss_mib") is not None}
    floor, ref = by.get(FLOOR[task]), by.get(REFERENCE[task])
    if task == "grads":
        result = max((r["result_mib"] for r in by.values()), default=0.0)
        floor_rss = floor["peak_rss_mib"] + result if floor else None
        floor_alloc = (
            floor["peak_alloc_mib"] + result if floor and floor["peak_alloc_mib"] else None
        )
        head = (
            f"**{describe(config)}** (grads; floor = autograd's peak + the per-sample result "
            f"= {_fmt(floor_rss)} MiB RSS, {_fmt(floor_alloc)} MiB allocator)"
        )
        columns = [
            "engine",
            "peak RSS increase (MiB)",
            "allocator peak (MiB)",
            "time (s)",
            "result (MiB)",
            "RSS / floor",
            "allocator / floor",
            "time / torch.func",
            "time / autograd",
            "max rel. deviation from torch.func",
        ]
    else:
        floor_rss = floor["peak_rss_mib"] if floor else None
        floor_alloc = floor["peak_alloc_mib"] if floor else None
        head = f"**{describe(config)}** (clip; ratios to the non-private step)"
        columns = [
            "engine",
            "peak RSS increase (MiB)",
            "allocator peak (MiB)",
            "time (s)",
            "RSS / non-private",
            "allocator / non-private",
            "time / non-private",
            "time / torch.func",
            "max rel. deviation from torch.func",
        ]
    lines = [
        head,
        "",
        "| " + " | ".join(columns) + " |",
        "|---" + "|---:" * (len(columns) - 1) + "|",
    ]
    t_ref = ref["time_s"] if ref else None
    t_floor = floor["time_s"] if floor else None
    for r in rows:
        bad = _failed(r, len(columns))
        if bad:
            lines.append(bad)
            continue
        dev = _fmt(r.get("deviation"), ".1e", "n/a")
        cells = [
            label(r),
            _fmt(r["peak_rss_mib"]),
            _fmt(r["peak_alloc_mib"]),
            _fmt(r["time_s"], ".3f"),
        ]
        if task == "grads":
            cells += [
                _fmt(r["result_mib"], ",.1f"),
                _ratio(r["peak_rss_mib"], floor_rss),
                _ratio(r["peak_alloc_mib"], floor_alloc),
                _ratio(r["time_s"], t_ref),
                _ratio(r["time_s"], t_floor),
                dev,
            ]
        else:
            cells += [
                _ratio(r["peak_rss_mib"], floor_rss),
                _ratio(r["peak_alloc_mib"], floor_alloc),
                _ratio(r["time_s"], t_floor),
                _ratio(r["time_s"], t_ref),
                dev,
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: What the cost-model table's last column means (printed under it).
COST_MODEL_NOTE = (
    "measured / predicted: the allocator's peak increase while the layer's weight VJP ran, "
    "over the strategy's memory model; a large ratio on a tiny prediction (well under "
    "1 MiB) is the convolution backend's own workspace, which the models do not price."
)


def format_cost_model(rows: list[dict]) -> str:
    """Markdown table: predicted against measured extra memory of each conv layer."""
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


def _unbudgeted(rows):
    return next((r for r in rows if r["engine"] == "memconv:auto" and r.get("time_s")), None)


def format_budget(records: list[dict]) -> str:
    """Markdown table of the ``memconv:budget`` rows against their budgets."""
    lines = [
        "| case | task | memory_budget (MiB) | micro-batches (size) | predicted peak (MiB) | "
        "allocator peak (MiB) | allocator / budget | RSS peak (MiB) | RSS / budget | "
        "time / unbudgeted call |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (_, task, _case), rows in group_rows(records).items():
        for r in rows:
            if r["engine"] != BUDGET_ENGINE or r.get("peak_rss_mib") is None:
                continue
            budget, plan = r["memory_budget_mib"], r.get("plan", {})
            free = _unbudgeted(rows)
            lines.append(
                f"| {describe(r['config'])} | {task} | {budget:,.0f} | "
                f"{plan.get('micro_batches', '-')} ({plan.get('micro_batch', '-')}) | "
                f"{_fmt(plan.get('predicted_peak_mib'))} | {_fmt(r['peak_alloc_mib'])} | "
                f"{_ratio(r['peak_alloc_mib'], budget)} | {_fmt(r['peak_rss_mib'])} | "
                f"{_ratio(r['peak_rss_mib'], budget)} | "
                f"{_ratio(r['time_s'], free['time_s'] if free else None)} |"
            )
    return "\n".join(lines) if len(lines) > 2 else "(no budget rows in these runs)"


def largest_rows(records: list[dict]) -> list[dict]:
    """The ``largest`` records."""
    return [r for r in records if r.get("record") == "largest"]


def format_largest(records: list[dict]) -> str:
    """Markdown table of the largest batch within the memory limit."""
    rows = largest_rows(records)
    if not rows:
        return "(no largest-batch runs in these files)"
    floors = {
        (r["file"], r["task"], r["case"]): r["largest"]
        for r in rows
        if r["engine"] == FLOOR[r["task"]] and r.get("largest")
    }
    lines = [
        "| case | task | engine | limit (MiB) | largest batch that fits | smallest that does not | "
        "× the floor's | allocator peak at largest (MiB) | RSS peak at largest (MiB) | probes |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        limit = f"{r['limit_mib']:,.0f}" + (" (cgroup)" if r.get("container") else "")
        if "error" in r or "skipped" in r:
            why = r.get("error") or r.get("skipped")
            lines.append(f"| {r['case']} | {r['task']} | {label(r)} | {limit} | {why} |||||")
            continue
        largest = f"≥ {r['largest']:,} (cap)" if r.get("capped") else f"{r['largest']:,}"
        failing = _fmt(r.get("smallest_failing"), ",")
        floor = floors.get((r["file"], r["task"], r["case"]))
        lines.append(
            f"| {r['case']} | {r['task']} | {label(r)} | {limit} | {largest} | "
            f"{failing} | {_ratio(r['largest'], floor)} | {_fmt(r.get('peak_alloc_mib'))} | "
            f"{_fmt(r.get('peak_rss_mib'))} | {r['probes']} |"
        )
    return "\n".join(lines)


def _sweep_table(rows: list[dict], key: str, spec: str) -> str:
    values = sorted({r["value"] for r in rows})
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    cell = {(r["engine"], r["value"]): r for r in rows}
    lines = [
        "| engine | " + " | ".join(str(v) for v in values) + " | growth exponent (last two) |",
        "|---" + "|---:" * (len(values) + 1) + "|",
    ]
    for e in engines:
        cells, points = [], []
        for v in values:
            r = cell.get((e, v))
            x = r.get(key) if r else None
            if r and ("error" in r or r.get("aborted")):
                cells.append("over" if r.get("aborted") else "failed")
            else:
                cells.append(_fmt(x, spec))
            if x:
                points.append((v, x))
        slope = "-"
        if len(points) >= 2:
            (v0, y0), (v1, y1) = points[-2:]
            slope = f"{math.log(y1 / y0) / math.log(v1 / v0):.2f}" if y0 > 0 and y1 > 0 else "-"
        lines.append(f"| {e} | " + " | ".join(cells) + f" | {slope} |")
    return "\n".join(lines)


def format_sweeps(records: list[dict], page_dir: str | None = None) -> str:
    """Per sweep: the figure (if one was saved) and tables of memory and time."""
    groups: dict = defaultdict(list)
    headers = {r["file"]: r for r in records if r.get("record") == "run"}
    for r in records:
        if r.get("record") == "sweep":
            groups[(r["file"], r["task"], r["case"], r["sweep"])].append(r)
    if not groups:
        return "(no sweeps in these files)"
    out = []
    for (file, task, case, sweep), rows in groups.items():
        config = rows[0]["config"]
        fixed = f"side {config['side']}" if sweep == "batch" else f"batch {config['batch']}"
        variable = "batch size N" if sweep == "batch" else "image side"
        out.append(f"**{case}, task {task}: {variable} swept, {fixed}**")
        out.append("")
        plot = headers.get(file, {}).get("plot")
        if plot:
            path = os.path.relpath(plot, page_dir) if page_dir else plot
            out += [f"![{case} {sweep} sweep]({path})", ""]
        out += ["Allocator peak (MiB):", "", _sweep_table(rows, "peak_alloc_mib", ",.0f"), ""]
        out += ["Peak RSS increase (MiB):", "", _sweep_table(rows, "peak_rss_mib", ",.0f"), ""]
        out += ["Time (s):", "", _sweep_table(rows, "time_s", ".3f"), ""]
    return "\n".join(out).rstrip()


# ---------------------------------------------------------------- targets
def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _full_size(record) -> bool:
    """Whether a record is of its case's documented size (targets are for those only)."""
    case = CASES.get(record.get("case"))
    config = record.get("config", {})
    return (
        case is not None
        and config.get("side") == case.side
        and (record.get("record") == "largest" or config.get("batch") == case.batch)
    )


def _find(records, task, case, engine, kind="row"):
    for r in records:
        if (
            r.get("record") == kind
            and r.get("task") == task
            and r.get("case") == case
            and r.get("engine") == engine
            and "error" not in r
            and "skipped" not in r
            and _full_size(r)
        ):
            return r
    return None


def _per_layer_targets(records: list[dict]) -> list[str]:
    """Per-layer clipping's peak memory and time against the non-private step's."""
    out = []
    peak, time = PER_LAYER_TARGETS
    for case in PER_LAYER_CASES:
        floor = _find(records, "clip-layer", case, "non-private")
        ours = _find(records, "clip-layer", case, "memconv:per-layer")
        if not (floor and ours and floor.get("peak_alloc_mib") and case in CASES):
            continue
        a = ours["peak_alloc_mib"] / floor["peak_alloc_mib"]
        r = ours["peak_rss_mib"] / floor["peak_rss_mib"]
        line = (
            f"- {LABELS[CASES[case].model]}, batch {ours['config']['batch']}, per-layer "
            f"clipping in one pass, peak ≤ {peak:.2f} × non-private: allocator {a:.2f} × "
            f"({_verdict(a <= peak)}), RSS {r:.2f} × ({_verdict(r <= peak)})"
        )
        if ours.get("time_s") and floor.get("time_s"):
            t = ours["time_s"] / floor["time_s"]
            line += f"; time ≤ {time:.2f} × non-private: {t:.2f} × ({_verdict(t <= time)})"
        out.append(line)
    return out


#: The private path's engines (the Opacus wrapper and the block) and the targets of
#: their step: ≤ 1.05 × clip_and_accumulate's time and allocator peak (one run), and
#: ≤ 1.30 × the non-private step's time on ResNet-18-GN.
PRIVATE_ENGINES = ("memconv-private", "memconv:clipping")
PRIVATE_TARGETS = (1.05, 1.30)


def _private_targets(records: list[dict]) -> list[str]:
    """The private path's step against ``clip_and_accumulate``, the non-private step and
    Opacus' hooks step, each ratio within the run that measured both."""
    out = []
    to_clip, to_floor = PRIVATE_TARGETS
    runs = {r.get("file") for r in records if r.get("engine") in PRIVATE_ENGINES}
    for run in sorted(x for x in runs if x):
        rows = [r for r in records if r.get("file") == run]
        for case in dict.fromkeys(r.get("case") for r in rows if r.get("case") in CASES):
            name = LABELS[CASES[case].model]
            base = _find(rows, "clip", case, DEFAULT_ENGINE)
            floor = _find(rows, "clip", case, "non-private")
            hooks = _find(rows, "clip", case, "opacus-hooks")
            for engine in PRIVATE_ENGINES:
                ours = _find(rows, "clip", case, engine)
                if not (ours and ours.get("time_s")):
                    continue
                parts = []
                if base and base.get("time_s") and base.get("peak_alloc_mib"):
                    t = ours["time_s"] / base["time_s"]
                    a = ours["peak_alloc_mib"] / base["peak_alloc_mib"]
                    parts.append(
                        f"≤ {to_clip:.2f} × clip_and_accumulate: time {t:.2f} × "
                        f"({_verdict(t <= to_clip)}), allocator {a:.2f} × "
                        f"({_verdict(a <= to_clip)})"
                    )
                if case == "resnet18-gn" and floor and floor.get("time_s"):
                    t = ours["time_s"] / floor["time_s"]
                    parts.append(
                        f"time ≤ {to_floor:.2f} × non-private: {t:.2f} × "
                        f"({_verdict(t <= to_floor)})"
                    )
                if case == "opacus-mnist" and hooks and hooks.get("time_s"):
                    t = ours["time_s"] / hooks["time_s"]
                    parts.append(f"time ≤ Opacus' hooks step: {t:.2f} × ({_verdict(t <= 1)})")
                if parts:
                    batch = ours["config"]["batch"]
                    out.append(f"- {name}, batch {batch}, {engine}: " + "; ".join(parts))
    return out


def targets(records: list[dict]) -> list[str]:
    """The targets as measured ratios (each line says met or missed); targets whose
    measurements are not in ``records`` are left out."""
    out = _private_targets(records)
    # DP-SGD's clipped sum against the non-private step: (case, peak, time or None)
    for case, peak, time in (("resnet18-gn", 1.10, 1.25), ("wrn16-4-gn", 1.15, None)):
        floor = _find(records, "clip", case, "non-private")
        name = LABELS[CASES[case].model]
        for engine in ("memconv:auto", DEFAULT_ENGINE):
            ours = _find(records, "clip", case, engine)
            if not (floor and ours and floor.get("peak_alloc_mib")):
                continue
            a = ours["peak_alloc_mib"] / floor["peak_alloc_mib"]
            r = ours["peak_rss_mib"] / floor["peak_rss_mib"]
            line = (
                f"- {name}, batch 64, {engine} peak ≤ {peak:.2f} × non-private: allocator "
                f"{a:.2f} × ({_verdict(a <= peak)}), RSS {r:.2f} × ({_verdict(r <= peak)})"
            )
            if time is not None and ours.get("time_s") and floor.get("time_s"):
                t = ours["time_s"] / floor["time_s"]
                line += f"; time ≤ {time:.2f} × non-private: {t:.2f} × ({_verdict(t <= time)})"
            out.append(line)
    out += _per_layer_targets(records)
    floor = _find(records, "clip", "resnet18-gn", "non-private")
    if floor and floor.get("time_s"):
        variants = [
            r
            for r in records
            if r.get("record") == "row"
            and _full_size(r)
            and r.get("task") == "clip"
            and r.get("case") == "resnet18-gn"
            and r["engine"].startswith("memconv:")
            and r.get("time_s")
            and r["engine"] != BUDGET_ENGINE
        ]
        if variants:
            fast = min(variants, key=lambda r: r["time_s"])
            lean = min(variants, key=lambda r: r["peak_alloc_mib"] or math.inf)
            out.append(
                f"  (ResNet-18-GN: fastest memconv variant: {fast['engine']}, "
                f"{fast['time_s'] / floor['time_s']:.2f} × non-private's time; leanest: "
                f"{lean['engine']}, {lean['peak_alloc_mib'] / floor['peak_alloc_mib']:.2f} × its "
                "allocator peak)"
            )
    # searches compare within one kind of limit: the allocator level, or a container's
    largest = {
        (r["task"], r["case"], r["engine"], bool(r.get("container"))): r
        for r in largest_rows(records)
        if "largest" in r and _full_size(r)
    }

    def size(key, container=False):
        r = largest.get((*key, container))
        return None if r is None else (r["largest"], r.get("capped", False))

    def count(found):
        n, capped = found
        return f"≥ {n:,} (the search's cap)" if capped else f"{n:,}"

    floor = size(("clip", "resnet18-gn", "non-private"))
    for engine in ("memconv:auto", BUDGET_ENGINE):
        ours = size(("clip", "resnet18-gn", engine))
        if ours and floor:
            q = ours[0] / floor[0]
            out.append(
                f"- ResNet-18-GN, largest batch in the limit ≥ 0.8 × non-private's: {engine} "
                f"{count(ours)} vs {count(floor)} = {q:.3f} × ({_verdict(q >= 0.8)})"
            )
    for task in ("clip", "grads"):
        for engine in ("memconv:auto", BUDGET_ENGINE):
            ours = size((task, "seed-112", engine))
            for peer in ("torch.func", "opacus-hooks"):
                theirs = size((task, "seed-112", peer))
                if ours and theirs:
                    q = ours[0] / theirs[0]
                    out.append(
                        f"- seed CNN 1×112², task {task}, largest batch in the limit ≥ 4 × "
                        f"{peer}'s: {engine} {count(ours)} vs {count(theirs)} = {q:.2f} × "
                        f"({_verdict(q >= 4)})"
                    )
    # in a container, with default arguments
    for task, case, title, peer, factor in (
        ("grads", "seed-112", "seed CNN 1×112²", "torch.func", 4),
        ("clip", "resnet18-gn", "ResNet-18-GN", "non-private", 1),
    ):
        ours = size((task, case, DEFAULT_ENGINE), True)
        theirs = size((task, case, peer), True)
        if ours and theirs:
            q = ours[0] / theirs[0]
            wanted = f"≥ {factor} × {peer}'s" if factor != 1 else f"≥ {peer}'s"
            out.append(
                f"- {title}, task {task}, in a container: largest batch with default "
                f"arguments {wanted}: {count(ours)} vs {count(theirs)} = {q:.2f} × "
                f"({_verdict(q >= factor)})"
            )
    for (task, case), (budget, peak_max, time_max) in BUDGET_TARGETS.items():
        row = _find(records, task, case, BUDGET_ENGINE)
        if row is None or row.get("peak_alloc_mib") is None or row["memory_budget_mib"] != budget:
            continue
        b = row["memory_budget_mib"]
        a, r = row["peak_alloc_mib"] / b, row["peak_rss_mib"] / b
        line = (
            f"- {describe(row['config'])}, task {task}, memory_budget {b:,.0f} MiB: peak ≤ "
            f"{peak_max} × budget: allocator {a:.2f} × ({_verdict(a <= peak_max)}), RSS {r:.2f} × "
            f"({_verdict(r <= peak_max)})"
        )
        free = _find(records, task, case, "memconv:auto")
        if time_max and free and free.get("time_s") and row.get("time_s"):
            t = row["time_s"] / free["time_s"]
            line += (
                f"; time ≤ {time_max} × the unbudgeted call: {t:.2f} × ({_verdict(t <= time_max)})"
            )
        out.append(line)
    return out


# ---------------------------------------------------------------- the models people train
def table_files(records: list[dict], name: str) -> set[str]:
    """The files whose run was made for the page's table ``name`` (``--table``)."""
    return {r["file"] for r in records if r.get("record") == "run" and r.get("table") == name}


def _model_rows(records: list[dict]) -> dict:
    """``{(task, case, engine): row}`` of the ``--table models`` runs: each (task, case)
    from the last run that measured it (ratios are read within one run)."""
    files = table_files(records, "models")
    rows = [r for r in records if r.get("record") == "row" and r.get("file") in files]
    last = {(r["task"], r["case"]): r["file"] for r in rows}
    return {
        (r["task"], r["case"], r["engine"]): r
        for r in rows
        if r["file"] == last[(r["task"], r["case"])]
    }


def _model_cell(row: dict) -> str:
    config = row["config"]
    params = f", {row['params'] / 1e6:.1f} M parameters" if row.get("params") else ""
    return f"{LABELS.get(config['model'], config['model'])} ({shape_of(config)}{params})"


def _why(row: dict) -> str:
    return f"fails: {row['error']}" if "error" in row else f"skipped: {row['skipped']}"


def format_models(records: list[dict]) -> str:
    """The table "DP on the models people train": per model, one DP clipping step of each
    engine against the non-private step, then per-sample gradients against torch.func's,
    then the targets."""
    by = _model_rows(records)
    if not by:
        return "(no runs of `memconv bench --table models` in these files)"
    cases = list(dict.fromkeys(case for _, case, _ in by))
    lines = []
    clip_cases = [c for c in cases if ("clip", c, "non-private") in by]
    if clip_cases:
        n = by[("clip", clip_cases[0], "non-private")]["config"]["batch"]
        lines += [
            f"One DP clipping step, batch {n} (ratios to the non-private step):",
            "",
            "| model | step | peak RSS increase (MiB) | allocator peak (MiB) | time (s) | "
            "RSS / non-private | allocator / non-private | time / non-private | "
            "max rel. deviation from torch.func |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for case in clip_cases:
        floor = by[("clip", case, "non-private")]
        first = True
        for engine, name in MODEL_CLIP_ENGINES.items():
            r = by.get(("clip", case, engine))
            if r is None:
                continue
            model = _model_cell(r if "params" in r else floor) if first else ""
            first = False
            if "error" in r or "skipped" in r:
                lines.append(f"| {model} | {name} | {_why(r)} |" + " |" * 6)
                continue
            ok = floor.get("peak_rss_mib") is not None
            lines.append(
                f"| {model} | {name} | {_fmt(r['peak_rss_mib'])} | {_fmt(r['peak_alloc_mib'])} | "
                f"{_fmt(r['time_s'], '.3f')} | "
                f"{_ratio(r['peak_rss_mib'], floor['peak_rss_mib'] if ok else None)} | "
                f"{_ratio(r['peak_alloc_mib'], floor.get('peak_alloc_mib'))} | "
                f"{_ratio(r['time_s'], floor.get('time_s'))} | "
                f"{_fmt(r.get('deviation'), '.1e', 'n/a')} |"
            )
    grads_cases = [c for c in cases if ("grads", c, "torch.func") in by]
    if grads_cases:
        n = by[("grads", grads_cases[0], "torch.func")]["config"]["batch"]
        lines += [
            "",
            f"Per-sample gradients, batch {n}: `memconv.per_sample_grads` with default "
            "arguments against torch.func's `vmap(grad)`:",
            "",
            "| model | torch.func RSS (MiB) | torch.func allocator (MiB) | torch.func time (s) | "
            "memconv RSS (MiB) | memconv allocator (MiB) | memconv time (s) | "
            "time / torch.func | max rel. deviation from torch.func | "
            "PrivateStep time (s) | PrivateStep / torch.func |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for case in grads_cases:
        ref, ours = by[("grads", case, "torch.func")], by.get(("grads", case, DEFAULT_ENGINE))
        cells = [_model_cell(ours if ours and "params" in ours else ref)]
        for r in (ref, ours):
            if r is None or "error" in r or "skipped" in r:
                cells += [_why(r) if r else "-", "", ""]
            else:
                cells += [
                    _fmt(r["peak_rss_mib"]),
                    _fmt(r["peak_alloc_mib"]),
                    _fmt(r["time_s"], ".3f"),
                ]
        good = ours is not None and ours.get("time_s") and ref.get("time_s")
        cells.append(_ratio(ours["time_s"], ref["time_s"]) if good else "-")
        cells.append(_fmt(ours.get("deviation"), ".1e", "n/a") if ours else "-")
        step = by.get(("grads", case, STEP_ENGINE))
        if step is None or "error" in step or "skipped" in step:
            cells += [_why(step) if step else "-", "-"]
        else:
            cells += [_fmt(step["time_s"], ".3f"), _ratio(step["time_s"], ref.get("time_s"))]
        lines.append("| " + " | ".join(cells) + " |")
    return _with_targets(lines, model_targets(records), "Targets (at the cases' documented sizes):")


def _with_targets(lines: list[str], found: list[str], title: str) -> str:
    """A table's lines, then its targets (if any) under ``title``."""
    if found:
        lines = [*lines, "", title, "", *found]
    return "\n".join(lines)


def model_targets(records: list[dict]) -> list[str]:
    """The targets of the models people train as measured ratios: ``clip_and_accumulate``
    within :data:`MODEL_TARGETS` of the non-private step's peak memory and time, and
    per-sample gradients faster than torch.func's (cases at their documented size)."""
    by = {k: r for k, r in _model_rows(records).items() if _full_size(r)}
    peak, time = MODEL_TARGETS
    out = []
    for case in dict.fromkeys(case for _, case, _ in by):
        name = LABELS.get(CASES[case].model, case)
        floor = by.get(("clip", case, "non-private"))
        for engine, what in (
            (DEFAULT_ENGINE, "clip_and_accumulate (defaults)"),
            (STEP_ENGINE, "PrivateStep.clip_and_accumulate"),
        ):
            ours = by.get(("clip", case, engine))
            good = [r for r in (floor, ours) if r and "error" not in r and "skipped" not in r]
            if len(good) == 2 and floor.get("peak_alloc_mib"):
                n = ours["config"]["batch"]
                a = ours["peak_alloc_mib"] / floor["peak_alloc_mib"]
                r = ours["peak_rss_mib"] / floor["peak_rss_mib"]
                line = (
                    f"- {name}, batch {n}, {what} peak ≤ {peak:.2f} × "
                    f"non-private: allocator {a:.2f} × ({_verdict(a <= peak)}), RSS {r:.2f} × "
                    f"({_verdict(r <= peak)})"
                )
                if ours.get("time_s") and floor.get("time_s"):
                    t = ours["time_s"] / floor["time_s"]
                    line += f"; time ≤ {time:.2f} × non-private: {t:.2f} × ({_verdict(t <= time)})"
                out.append(line)
        ref = by.get(("grads", case, "torch.func"))
        for engine, what in (
            (DEFAULT_ENGINE, "per-sample gradients"),
            (STEP_ENGINE, "PrivateStep.per_sample_grads"),
        ):
            ours = by.get(("grads", case, engine))
            if ref and ours and ref.get("time_s") and ours.get("time_s"):
                q = ours["time_s"] / ref["time_s"]
                out.append(
                    f"- {name}, batch {ours['config']['batch']}, {what} faster than "
                    f"torch.func: {ours['time_s']:.3f} s vs {ref['time_s']:.3f} s = {q:.2f} × "
                    f"({_verdict(q < 1)})"
                )
            elif ref and ours and "error" in ours:
                out.append(
                    f"- {name}, {what} faster than torch.func: **missed** "
                    f"(memconv fails: {ours['error']})"
                )
    return out


# ---------------------------------------------------------------- the models people stream
#: "Streaming the models people stream" (runs with ``--table streaming``): at 4096² the
#: streamed step's peak memory and time against the conventional step's; at 8192² the
#: ResNet-50 trunk's streamed step's peak RSS (GiB).
STREAM_TARGETS = {"memory": 0.25, "time": 1.5, "resnet50-8192-gib": 4.0}
STREAM_ENGINES = {
    "autograd": "conventional",
    "memconv-streaming": "memconv streaming",
    "lightstream": "Lightstream 1.0.7",
}


def _stream_rows(records: list[dict]) -> dict:
    """``{(model, side, engine): row}`` of the ``--table streaming`` runs (the last run
    that measured each)."""
    files = table_files(records, "streaming")
    rows = [r for r in records if r.get("record") == "row" and r.get("file") in files]
    return {(r["config"]["model"], r["config"]["side"], _stream_engine(r)): r for r in rows}


def _stream_engine(row) -> str:
    """The engine of a streaming row; a given tile (the tile-size sweep) is its own
    (``"memconv-streaming@512"``)."""
    case = CASES.get(row.get("case", ""))
    tile = row["config"].get("tile") or (case.extra.get("tile") if case else None)
    return f"{row['engine']}@{tile}" if tile else row["engine"]


def _stream_engines(by: dict, model: str, side: int) -> dict:
    """``{engine: label}`` of the rows at ``model`` and ``side``: the table's engines, then
    the sweep's tiles, smallest first."""
    swept = sorted(
        (e for m, s, e in by if m == model and s == side and "@" in e),
        key=lambda e: int(e.partition("@")[2]),
    )
    names = {
        e: f"{STREAM_ENGINES.get(e.partition('@')[0])}, tile {e.partition('@')[2]}" for e in swept
    }
    return {**STREAM_ENGINES, **names}


def _measured(row) -> bool:
    return (
        row is not None and "error" not in row and "skipped" not in row and not row.get("aborted")
    )


def conventional_estimate(by: dict, model: str, side: int):
    """The conventional step's ``(RSS MiB, allocator MiB, time s, from side)`` at ``side``:
    measured, or scaled by the area from the largest side measured below it (its
    activations, memory and work grow with the image's area); None without either."""
    row = by.get((model, side, "autograd"))
    if _measured(row):
        return row["peak_rss_mib"], row["peak_alloc_mib"], row["time_s"], side
    below = [
        s
        for (m, s, e), r in by.items()
        if m == model and e == "autograd" and s < side and _measured(r)
    ]
    if not below:
        return None
    base = by[(model, max(below), "autograd")]
    area = (side / max(below)) ** 2
    return (
        base["peak_rss_mib"] * area,
        base["peak_alloc_mib"] * area,
        base["time_s"] * area,
        max(below),
    )


def _stream_note(row) -> str:
    if row.get("aborted"):
        return f"stopped past {row.get('rss_at_abort_mib', 0) / 1024:,.1f} GiB"
    return _why(row)


def format_streaming(records: list[dict]) -> str:
    """The table "Streaming the models people stream": per trunk and image side, one
    training step of each engine, ratios to the conventional step (measured, or scaled
    from a smaller side where it does not fit), then the targets."""
    by = _stream_rows(records)
    if not by:
        return "(no runs of `memconv bench --table streaming` in these files)"
    lines = [
        "| trunk | side | step | peak RSS increase (MiB) | allocator peak (MiB) | time (s) | "
        "RSS / conventional | allocator / conventional | time / conventional | "
        "max rel. deviation from conventional | tile (tiles) | CPU time (s) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    keys = sorted({(m, s) for m, s, _ in by}, key=lambda k: (list(LABELS).index(k[0]), k[1]))
    for model, side in keys:
        ref = conventional_estimate(by, model, side)
        first = True
        for engine, name in _stream_engines(by, model, side).items():
            row = by.get((model, side, engine))
            if row is None:
                continue
            cells = [LABELS.get(model, model) if first else "", f"{side}²" if first else "", name]
            first = False
            if engine == "autograd" and not _measured(row) and ref is not None:
                cells[2] = f"conventional ({_stream_note(row)}; scaled from {ref[3]}²)"
                cells += [f"~{_fmt(ref[0])}", f"~{_fmt(ref[1])}", f"~{_fmt(ref[2], '.0f')}"]
                cells += ["", "", "", "", "", ""]
            elif not _measured(row):
                cells += [_stream_note(row)] + [""] * 8
            else:
                scaled = ref is not None and ref[3] != side
                mark = "~" if scaled else ""
                ratios = [
                    mark + _ratio(row["peak_rss_mib"], ref[0]) if ref else "-",
                    mark + _ratio(row["peak_alloc_mib"], ref[1]) if ref else "-",
                    mark + _ratio(row["time_s"], ref[2]) if ref and row.get("time_s") else "-",
                ]
                tile = row.get("stream") or {}
                if engine == "lightstream":
                    tile = {"tile": row.get("tile", "1024")}
                tiles = (
                    f"{tile['tile']} ({tile['tiles']})" if "tiles" in tile else tile.get("tile", "")
                )
                cells += [
                    _fmt(row["peak_rss_mib"]),
                    _fmt(row["peak_alloc_mib"]),
                    _fmt(row.get("time_s"), ".1f"),
                    *ratios,
                    _fmt(row.get("deviation"), ".1e", "n/a"),
                    str(tiles),
                    _fmt(row.get("cpu_s"), ".0f"),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return _with_targets(lines, streaming_targets(records), "Targets:")


def streaming_targets(records: list[dict]) -> list[str]:
    """The targets of the streaming table as measured ratios (:data:`STREAM_TARGETS`)."""
    by = _stream_rows(records)
    out = []
    mem, time = STREAM_TARGETS["memory"], STREAM_TARGETS["time"]
    for model in dict.fromkeys(m for m, s, _ in by if s == 4096):
        ours = by.get((model, 4096, "memconv-streaming"))
        ref = conventional_estimate(by, model, 4096)
        name = LABELS.get(model, model)
        if not _measured(ours) or ref is None:
            continue
        how = "measured" if ref[3] == 4096 else f"scaled from {ref[3]}²"
        r, t = ours["peak_rss_mib"] / ref[0], ours["time_s"] / ref[2]
        a = ours["peak_alloc_mib"] / ref[1]
        line = (
            f"- {name}, 4096²: memory ≤ {mem} × conventional ({how}): RSS {r:.2f} × "
            f"({_verdict(r <= mem)}), allocator {a:.2f} × ({_verdict(a <= mem)}); time ≤ "
            f"{time} ×: {t:.2f} × ({_verdict(t <= time)})"
        )
        ls = by.get((model, 4096, "lightstream"))
        if _measured(ls):
            both = ours["peak_rss_mib"] <= ls["peak_rss_mib"] and ours["time_s"] <= ls["time_s"]
            line += (
                f"; against Lightstream: RSS {ours['peak_rss_mib'] / ls['peak_rss_mib']:.2f} ×, "
                f"time {ours['time_s'] / ls['time_s']:.2f} × ({_verdict(both)}; its gradients "
                f"deviate by {ls.get('deviation', float('nan')):.1e})"
            )
        elif ls is not None:
            line += f"; Lightstream: {_stream_note(ls)}"
        out.append(line)
    r50 = by.get(("stream-resnet50", 8192, "memconv-streaming"))
    if _measured(r50):
        gib = r50["peak_rss_mib"] / 1024
        limit = STREAM_TARGETS["resnet50-8192-gib"]
        ref = conventional_estimate(by, "stream-resnet50", 8192)
        need = f"; the conventional step would need ~{ref[0] / 1024:,.0f} GiB" if ref else ""
        out.append(
            f"- ResNet-50 trunk, 8192²: streamed step within {limit:.0f} GiB: peak RSS increase "
            f"{gib:.2f} GiB, allocator {r50['peak_alloc_mib'] / 1024:.2f} GiB "
            f"({_verdict(gib <= limit)}){need}"
        )
    big = by.get(("stream-resnet18", 16384, "memconv-streaming"))
    if big is not None:
        done = _measured(big)
        what = (
            f"{big['time_s'] / 60:.1f} min, peak RSS increase {big['peak_rss_mib'] / 1024:.1f} GiB"
            if done
            else _stream_note(big)
        )
        out.append(
            f"- ResNet-18 trunk, one 16384² image, training step on this machine: {what} "
            f"({_verdict(done)})"
        )
    return out


# ---------------------------------------------------------------- the page
def format_commands(records: list[dict]) -> str:
    """The commands that produced the records, with their wall time."""
    done = {r["file"]: r for r in records if r.get("record") == "done"}
    lines = []
    for r in records:
        if r.get("record") != "run":
            continue
        d = done.get(r["file"])
        took = f"{d['elapsed_s'] / 60:.1f} min" if d else "did not finish"
        lines.append(f"    {r['command']}    # {r['started'][:10]}, {took}")
    return "\n".join(lines)


def format_machine(records: list[dict]) -> str:
    """The machines the records were measured on (one line per distinct machine as the
    line describes it: records that differ only in fields it leaves out, such as the
    cache size later runs record, share a line)."""
    lines = []
    for r in records:
        if r.get("record") != "run":
            continue
        m = r["machine"]
        line = (
            ("- " + (f"{m['gpu']} (GPU); " if m.get("gpu") else ""))
            + f"{m['cpu']}, {m['threads']} threads; torch {m['torch']}, memconv {m['memconv']}, "
            f"Python {m['python']}"
        )
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def render(records: list[dict], page_dir: str | None = None) -> dict[str, str]:
    """Every section of :data:`SECTIONS`, rendered from ``records`` (the records of a
    run made for a table, ``--table``, go to that table alone)."""
    tabled = {f for name in ("models", "streaming") for f in table_files(records, name)}
    own = [r for r in records if r.get("file") not in tabled]
    cases = {
        task: "\n\n".join(
            format_case(task, rows[0]["config"], rows)
            for (_, t, _), rows in group_rows(own).items()
            if t == task
        )
        or "(no measurements of this task in these files)"
        for task in ("grads", "clip", "clip-layer")
    }
    cost = [r for r in records if r.get("record") == "cost"]
    return {
        "commands": format_commands(records),
        "machine": format_machine(records),
        "grads": cases["grads"],
        "cost-model": format_cost_model(cost) if cost else "(no cost-model rows in these files)",
        "clip": cases["clip"],
        "clip-layer": cases["clip-layer"],
        "budget": format_budget(own),
        "targets": "\n".join(targets(own) + model_targets(records))
        or "(no target measurements in these files)",
        "largest": format_largest(records),
        "sweeps": format_sweeps(records, page_dir),
        "models": format_models(records),
        "streaming": format_streaming(records),
    }


def fill(page: str, sections: dict[str, str]) -> str:
    """``page`` with each ``<!-- bench:NAME -->...<!-- /bench:NAME -->`` block refilled.

    Raises:
        ValueError: an unknown section name in the page.
    """

    def replace(match):
        name = match.group(1)
        if name not in sections:
            raise ValueError(
                f"unknown section <!-- bench:{name} -->; accepted: {', '.join(SECTIONS)}"
            )
        return f"<!-- bench:{name} -->\n{sections[name]}\n<!-- /bench:{name} -->"

    pattern = re.compile(r"<!-- bench:([\w-]+) -->.*?<!-- /bench:\1 -->", re.S)
    return pattern.sub(replace, page)


def fill_block(page: str, name: str, text: str) -> str:
    """``page`` with the block ``<!-- NAME -->…<!-- /NAME -->`` refilled with ``text``
    (the pages' blocks that one command fills on its own: ``steps:table``, ``ops:table``).

    Raises:
        ValueError: the page has no such block.
    """
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    if not pattern.search(page):
        raise ValueError(f"the page has no <!-- {name} --> block")
    return pattern.sub(lambda _: f"<!-- {name} -->\n{text}\n<!-- /{name} -->", page)


def default_page(sections: dict[str, str]) -> str:
    """A page holding every section, for a file that has none yet."""
    parts = ["# Benchmarks", ""]
    for name in SECTIONS:
        parts += [
            f"## {name}",
            "",
            f"<!-- bench:{name} -->",
            sections[name],
            f"<!-- /bench:{name} -->",
            "",
        ]
    return "\n".join(parts)
