"""StreamingCNN under torch.autocast against the conventional pass: the errors behind the
tolerances of tests/test_streaming_autocast.py and the "Mixed precision" section of
docs/streaming.md.

For each trunk (small widths, as the tests use them; BatchNorm and LayerNorm statistics
and affine parameters randomised, float32 parameters), one image, one output gradient:
the conventional pass under autocast (a), the conventional pass in float32 (f) and the
streamed pass under autocast, backward pass outside the block (s). With ``err(x, y) =
‖x − y‖ / ‖y‖`` and ``u`` the dtype's unit round-off (``eps / 2``), per trunk: the
output's err(s, a), then over the input and parameter gradients the median and largest
err(s, a) / u, the largest err(a, f) / u (the conventional autocast pass's own distance
from float32), the largest err(s, f) / (2 err(a, f) + 2 u) (≤ 1: streaming as
accurate as the conventional autocast pass) and the largest err(s, a) / (3 err(a, f) +
4 u) (≤ 1: streaming within a few units of rounding of the conventional autocast pass,
scaled by how far that dtype's rounding moves this gradient).

Usage (CPU; bfloat16, and float16 where torch has CPU float16 autocast):

    python tools/streaming-autocast.py
    python tools/streaming-autocast.py --dtype float16 --device cuda
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from memconv.bench import trunks
from memconv.bench.models import streaming_net
from memconv.streaming import StreamingCNN

#: name: (trunk builder, input shape, tile)
CASES = {
    "resnet18 trunk (width 4)": (
        lambda: trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1)),
        (1, 3, 160, 160),
        32,
    ),
    "StreamingCNN's network": (lambda: streaming_net()[:15], (1, 3, 112, 112), 40),
    "convnext trunk (8, 12)": (
        lambda: trunks.convnext_trunk((1, 2), (8, 12), layer_scale=0.5),
        (1, 3, 101, 94),
        36,
    ),
}


def randomised(build, seed: int = 0) -> nn.Module:
    """``build()`` seeded, in float32 and eval mode, norm statistics and affine parameters
    away from their initial values (as tests/test_streaming_autocast.py does)."""
    torch.manual_seed(seed)
    module = build().float().eval()
    trunks.randomise_norms(module)
    return module


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def measure(build, shape, tile, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    trunk = randomised(build, seed).to(device)
    params = list(trunk.parameters())
    torch.manual_seed(1)
    x = torch.randn(*shape, device=device)
    stream = StreamingCNN(trunk, tile)
    g = torch.randn(stream.bound(shape).output_shape(), device=device)

    def run(model, autocast):
        xs = x.clone().requires_grad_()
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            out = model(xs)
        return out.detach(), torch.autograd.grad(out, [xs, *params], g.to(out.dtype))

    (out_a, a), (_, f), (out_s, s) = run(trunk, dtype), run(trunk, None), run(stream, dtype)
    u = torch.finfo(dtype).eps / 2
    e_sa = [err(p, q) for p, q in zip(s, a)]
    d = [err(q, r) for q, r in zip(a, f)]
    return {
        "tiles": len(stream.tiles(shape[2:])),
        "output": err(out_s, out_a),
        "median": statistics.median(e_sa) / u,
        "largest": max(e_sa) / u,
        "autocast vs float32": max(d) / u,
        "accuracy": max(err(p, r) / (2 * di + 2 * u) for p, r, di in zip(s, f, d)),
        "conditioned": max(e / (3 * di + 4 * u) for e, di in zip(e_sa, d)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(
        f"{args.device} {args.dtype} (u = {torch.finfo(dtype).eps / 2:.3g}); err(x, y) = "
        "|x - y| / |y|; s: streamed, a: conventional autocast, f: float32"
    )
    print(
        "trunk | tiles | output err(s, a) | gradients err(s, a)/u: median, largest | "
        "largest err(a, f)/u | largest err(s, f)/(2 err(a, f) + 2u) | "
        "largest err(s, a)/(3 err(a, f) + 4u)"
    )
    for name, (build, shape, tile) in CASES.items():
        r = measure(build, shape, tile, args.device, dtype)
        print(
            f"{name} {shape[2:]} tile {tile} | {r['tiles']} | {r['output']:.2g} | "
            f"{r['median']:.2f}, {r['largest']:.2f} | {r['autocast vs float32']:.1f} | "
            f"{r['accuracy']:.2f} | {r['conditioned']:.2f}"
        )


if __name__ == "__main__":
    main()
