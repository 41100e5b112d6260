"""Per-sample gradient clipping where one sample is an image too large for memory.

``memconv.clip_and_accumulate`` on a model that streams its convolutions
(:class:`memconv.streaming.StreamingCNN`, StreamingCNN's example network, then global
average pooling and a Linear head) runs one sample at a time: each image's gradient is
gathered tile by tile, its norm taken, and its clipped share added to ``.grad``. The
batch is two real mosaics of scikit-image's pictures (the retina photograph and the
immunohistochemistry micrograph). Each image side runs in a fresh subprocess; the
peak memory increase (process RSS by memory_profiler, allocator level by the PyTorch
profiler) stays flat as the side grows, while the conventional per-sample pass would
need the whole activations of an image.

Usage::

    python examples/dp_streaming_large_image.py                   # sides 512 1024 2048
    python examples/dp_streaming_large_image.py --sides 1024 4096 --tile 512
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import torch
from torch import nn

import memconv
from memconv.streaming import StreamingCNN

HERE = os.path.dirname(os.path.abspath(__file__))


def _streaming_example():
    """The network and the mosaics of ``streaming_large_image.py`` beside this file."""
    spec = importlib.util.spec_from_file_location(
        "streaming_large_image", os.path.join(HERE, "streaming_large_image.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def work(side: int, tile: int, max_norm: float) -> dict:
    """Clip and sum the gradients of the two mosaics at ``side`` (in this process)."""
    from memconv.bench.measure import peak_allocated, peak_rss_increase

    example = _streaming_example()
    model = nn.Sequential(StreamingCNN(example.stream_net(), tile_size=tile), example.head())
    images = torch.cat(
        [example.mosaic("retina", side), example.mosaic("immunohistochemistry", side)]
    )
    labels = torch.tensor([0, 1])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def step(x=images):
        model.zero_grad(set_to_none=True)
        return memconv.clip_and_accumulate(model, loss_fn, x, labels, max_norm=max_norm)

    step(images[..., : 2 * tile, : 2 * tile])  # warm-up on a crop: kernels, thread pools
    t0 = time.perf_counter()
    rss, norms = peak_rss_increase(step)
    seconds = time.perf_counter() - t0
    alloc, _ = peak_allocated(step, torch.device("cpu"))
    return {
        "side": side,
        "peak_rss_mib": rss,
        "peak_alloc_mib": alloc,
        "time_s": seconds,
        "norms": [round(v, 5) for v in norms.tolist()],
        "grad_norm": float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--tile", type=int, default=256, help="input pixels per tile side")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clipping threshold C")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(work(args.worker, args.tile, args.max_norm)))
        return
    print(f"clip_and_accumulate, batch of 2 real mosaics, tile {args.tile}, C = {args.max_norm}\n")
    print("| side | peak RSS increase (MiB) | allocator peak (MiB) | time (s) | per-sample norms |")
    print("|---:|---:|---:|---:|---|")
    for side in args.sides:
        command = [sys.executable, __file__, "--worker", str(side), "--tile", str(args.tile)]
        command += ["--max-norm", str(args.max_norm)]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode:
            print(f"| {side} | failed: {proc.stderr.strip().splitlines()[-1]} ||||")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"| {side} | {r['peak_rss_mib']:,.0f} | {r['peak_alloc_mib']:,.0f} | "
            f"{r['time_s']:.1f} | {', '.join(f'{v:.4f}' for v in r['norms'])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
