"""The two routes of a convolution's GGN weight diagonal side by side, per layer.

    python tools/bench-diagonal-routes.py            # All-CNN-C, batch 8, V = 10 and 100

For each convolution of All-CNN-C on 16×16 maps or smaller (the two on 32×32, where the
Gram route costs 11–140 times the rows', are left out; CIFAR-100 shapes, float32, one
torch thread) and a
random factor ``S [V, N, C_out, *T]``: the time of
``memconv.conv.curvature.weight_diagonal`` by the row VJPs and by the Gram route (the
median of two calls after a warm-up, the two routes alternating), their ratio, the
ratio of their multiply-adds (``diagonal_costs``) and the route ``diagonal_route``
chooses. Each V in a fresh process; the load average is printed with each.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time


def one(v: int, n: int = 8) -> None:
    import torch
    from torch import nn

    from memconv.bench.second_order import all_cnn_c
    from memconv.conv.curvature import diagonal_costs, diagonal_route, weight_diagonal
    from memconv.conv.settings import Settings
    from memconv.strategies import NO_OPTIONS

    torch.set_num_threads(1)
    torch.manual_seed(0)
    auto = Settings("auto", NO_OPTIONS)
    model = all_cnn_c(100)
    h = torch.randn(n, 3, 32, 32)
    print(f"V = {v}, N = {n}, load average {os.getloadavg()[0]:.1f}")
    print("| weight | T | rows (s) | gram (s) | gram / rows: time, multiply-adds | chosen |")
    print("|---|---|---|---|---|---|")
    for layer in model:
        with torch.no_grad():
            out = layer(h)
        if isinstance(layer, nn.Conv2d) and out.shape[-1] <= 16:
            s = torch.randn(v, *out.shape)
            times = {"rows": [], "gram": []}
            for repeat in range(3):
                for route in times:
                    start = time.perf_counter()
                    weight_diagonal(layer, h, s, auto, per_sample=False, route=route)
                    if repeat:  # the first call of each route is the warm-up
                        times[route].append(time.perf_counter() - start)
            rows, gram = (statistics.median(times[r]) for r in ("rows", "gram"))
            costs = diagonal_costs(layer, h, s)
            print(
                f"| {tuple(layer.weight.shape)} | {'×'.join(map(str, out.shape[2:]))} | "
                f"{rows:.3f} | {gram:.3f} | {gram / rows:.2f}, {costs.gram / costs.rows:.2f} | "
                f"{diagonal_route(layer, h, s, auto)} |"
            )
        h = out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(int(sys.argv[2]))
        return
    for v in (10, 100):
        subprocess.run([sys.executable, __file__, "--one", str(v)], check=True)


if __name__ == "__main__":
    main()
