"""Figures of the measurements (matplotlib, imported only here, with the Agg backend)."""

from __future__ import annotations

from .cases import describe
from .engines import FLOOR


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colour(engine: str, task: str) -> str:
    if engine == FLOOR[task]:
        return "0.55"
    return "tab:red" if engine.startswith("memconv") else "tab:blue"


def _bars(ax, rows, task, key, xlabel, rss=False):
    """Horizontal bars on a linear axis from zero (bar lengths compare as the figures
    do), each labelled with its value; the RSS as a tick mark, explained below the
    axes so that no legend hides a bar."""
    names = [r["engine"] for r in rows]
    values = [r[key] or 0.0 for r in rows]
    ys = range(len(rows))
    ax.barh(ys, values, color=[_colour(n, task) for n in names], height=0.7)
    top = max(values + ([r["peak_rss_mib"] for r in rows] if rss else []), default=1.0)
    spec = ",.0f" if key != "time_s" else ".3f"
    for y, v in zip(ys, values):
        ax.text(v + 0.01 * top, y, format(v, spec), va="center", fontsize=6)
    if rss:
        ax.plot([r["peak_rss_mib"] for r in rows], ys, "k|", markersize=9)
        ax.text(0.0, -0.18, "| peak RSS increase", transform=ax.transAxes, fontsize=7)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * top)
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)


def plot_cases(groups: list[tuple[str, dict, list[dict]]], path: str) -> None:
    """One row of panels per case: allocator peak (bars; RSS as ticks) and time per
    engine, linear axes from zero; memconv in red, peers in blue, the floor in grey.

    Args:
        groups: ``(task, case configuration, rows)`` per case.
        path: the image file.
    """
    plt = _pyplot()
    groups = [
        (t, c, [r for r in rows if r.get("peak_rss_mib") is not None]) for t, c, rows in groups
    ]
    groups = [g for g in groups if g[2]]
    if not groups:
        return
    heights = [0.9 + 0.22 * len(rows) for _, _, rows in groups]
    fig, axes = plt.subplots(
        len(groups),
        2,
        figsize=(11, sum(heights) + 0.4),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for (task, config, rows), (ax_m, ax_t) in zip(groups, axes):
        _bars(ax_m, rows, task, "peak_alloc_mib", "allocator peak (MiB)", rss=True)
        timed = [r for r in rows if r.get("time_s")]
        if timed:
            _bars(ax_t, timed, task, "time_s", "time (s)")
        ax_m.set_title(f"{describe(config)} ({task}): memory", fontsize=9)
        ax_t.set_title(f"{describe(config)} ({task}): time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: str) -> None:
    """Allocator peak, peak RSS increase and time against the swept variable, one line
    per engine, log–log, with a legend.

    Args:
        rows: ``sweep`` records of one sweep (``value``, ``engine`` and the figures).
        path: the image file.
    """
    plt = _pyplot()
    first = rows[0]
    variable = "batch size N" if first["sweep"] == "batch" else "image side (pixels)"
    task = first["task"]
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    values = sorted({r["value"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    panels = (
        ("peak_alloc_mib", "allocator peak (MiB)"),
        ("peak_rss_mib", "peak RSS increase (MiB)"),
        ("time_s", "time (s)"),
    )
    markers = "osD^v<>ph*"
    cmap = plt.get_cmap("tab10")
    for ax, (key, ylabel) in zip(axes, panels):
        for i, engine in enumerate(engines):
            points = sorted(
                (r["value"], r[key]) for r in rows if r["engine"] == engine and r.get(key)
            )
            if not points:
                continue
            xs, ys = zip(*points)
            style = "--" if engine == FLOOR[task] else "-"
            ax.plot(
                xs,
                ys,
                style,
                marker=markers[i % len(markers)],
                color=cmap(i % 10),
                label=engine,
                linewidth=1.6,
                markersize=5,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(values)
        ax.set_xticklabels([str(v) for v in values], fontsize=8, rotation=45, ha="right")
        ax.minorticks_off()
        ax.set_xlabel(variable)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    fixed = (
        f"side {first['config']['side']}"
        if first["sweep"] == "batch"
        else (f"batch {first['config']['batch']}")
    )
    fig.suptitle(f"{first['case']} ({task}), {fixed}", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False
    )
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
