"""How good are "auto"'s strategy choices? Time the four batched strategies on layers and
score the strategy each calibration file would pick.

For every layer of ``memconv calibrate``'s grid (N = 8, 16, 64) plus a few shapes that
are not in it, the per-sample and the summed weight VJP of ``"standard"``,
``"rochette"``, ``"unfold"`` and ``"shift"`` are timed: the median of ``--repeats``
calls, the fastest of two rounds over the layer's strategies in turn, in this process
(its measurements are independent of the calibration run's). For each calibration file
the strategy its time models price lowest is the pick; the pick's measured time over the
fastest strategy's is its regret (1.0: the best one). The report gives the geometric
mean and the largest regret per file and VJP kind, and every pick at more than 1.15x.

Usage::

    OMP_NUM_THREADS=2 python tools/strategy-choices.py \\
        --calibration old-cpu.json --calibration memconv/calibration/cpu.json \\
        [--json choices.jsonl]

A calibration file written by an older memconv lacks coefficients the current models
read; they are filled in as the CPU file's defaults say (``"unfold"``: no spilled
traffic, the summed product at the per-sample rates; ``"shift"``: no spilled traffic).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from memconv.bench import calibrate
from memconv.bench.calibrate import _geom
from memconv.bench.measure import median_time
from memconv.strategies import NO_OPTIONS, Problem, costs, get_strategy

STRATEGIES = ("standard", "rochette", "unfold", "shift")
CPU = torch.device("cpu")
#: Shapes beyond the grid's: held out of the fit.
EXTRA = (
    ("seed-conv1-112", _geom(2, 1, 32, 3, p=1), (112, 112)),
    ("tanh-cnn-3x3-32", _geom(2, 32, 32, 3, p=1), (32, 32)),
    ("conv1d-7", _geom(1, 16, 32, 7, p=3), (2048,)),
)


def measure(repeats: int, batches) -> list[dict]:
    rows = []
    for n in batches:
        for name, geom, size in (*calibrate._SHAPES, *EXTRA):
            conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[geom.dims]
            x = torch.randn(n, geom.in_channels, *size)
            w = torch.randn(geom.out_channels, geom.in_per_group, *geom.kernel_size)
            g = torch.randn_like(
                conv(x, w, None, geom.stride, geom.padding, geom.dilation, geom.groups)
            )
            for per_sample in (True, False):
                best = dict.fromkeys(STRATEGIES, math.inf)
                for _ in range(2):
                    for s in STRATEGIES:
                        st = get_strategy(s)

                        def run(st=st, x=x, g=g, geom=geom, per_sample=per_sample):
                            return st.vjp(x, g, geom, per_sample=per_sample, options=NO_OPTIONS)

                        best[s] = min(best[s], median_time(run, repeats, CPU))
                rows.append(
                    {
                        "layer": f"{name}/N={n}",
                        "per_sample": per_sample,
                        "geom": geom,
                        "size": size,
                        "n": n,
                        "seconds": best,
                    }
                )
                print(
                    rows[-1]["layer"],
                    "per-sample" if per_sample else "summed",
                    {k: round(v * 1e3, 2) for k, v in best.items()},
                    flush=True,
                )
    return rows


def _complete(data: dict) -> dict:
    unfold = data["time"]["unfold"]
    unfold.setdefault("per_element_spilled", 0.0)
    unfold.setdefault("per_flop_summed", unfold["per_flop"])
    unfold.setdefault("per_element_summed", unfold["per_element"])
    data["time"]["shift"].setdefault("per_element_spilled", 0.0)
    return data


def score(rows: list[dict], path: str) -> list[str]:
    data = _complete(json.loads(open(path).read()))
    lines = []
    with costs.using("cpu", data):
        for per_sample in (True, False):
            logs, bad = [], []
            for row in (r for r in rows if r["per_sample"] == per_sample):
                problem = Problem(row["geom"], row["n"], row["size"], 4, per_sample, device="cpu")
                predicted = {s: get_strategy(s).time(problem, NO_OPTIONS) for s in STRATEGIES}
                pick = min(predicted, key=predicted.get)
                measured = row["seconds"]
                regret = measured[pick] / min(measured.values())
                logs.append(math.log(regret))
                if regret > 1.15:
                    best = min(measured, key=measured.get)
                    bad.append(f"{row['layer']} {pick} (best {best}) {regret:.2f}x")
            kind = "per-sample" if per_sample else "summed"
            lines.append(
                f"{path} {kind}: {len(logs)} layers, regret geometric mean "
                f"{math.exp(sum(logs) / len(logs)):.3f}, largest {math.exp(max(logs)):.2f}"
            )
            lines += [f"    {b}" for b in bad]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", action="append", required=True, metavar="FILE")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", default="8,16,64", help="comma-separated N")
    parser.add_argument("--json", metavar="PATH", help="write the measurements as JSON Lines")
    args = parser.parse_args()
    rows = measure(args.repeats, [int(n) for n in args.batches.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "geom": repr(r["geom"]), "size": list(r["size"])}) + "\n")
    for path in args.calibration:
        print("\n".join(score(rows, path)))


if __name__ == "__main__":
    main()
