"""Small models, many steps: the time of one training step's per-sample work, engine
by engine, all in one process.

Each engine is set up once on its own copy of the model, as a training loop sets it up (Opacus'
``GradSampleModule`` wrapped once, :class:`memconv.PrivateStep` made once, the
``torch.func`` transform built once), then every engine runs one step on the same
batch in turn, ``repeats`` times after ``warmup`` rounds; the table gives the median
milliseconds per step. Run it as::

    python -m memconv.bench.steps --repeats 30 --markdown docs/benchmarks.md

which refills the block between ``<!-- steps:table -->`` and ``<!-- /steps:table -->``
of the page. With ``--compiled`` it times the compiled engines instead (a
``torch.compile``'d model's step, ``torch.compile`` of torch.func's ``vmap(grad)`` step
with and without the clipped sum, :class:`memconv.PrivateStep` of a ``torch.compile``'d
model) into the ``steps-compiled:table`` block; their warm-up rounds compile.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import memconv

from .report import fill_block

#: Engines, in table order: (column, setup(model, loss) -> step(x, y)).
ENGINES: list[tuple[str, Callable]] = []
#: The compiled engines (``--compiled``), in table order: each compiles with
#: ``torch.compile``'s defaults (inductor) what its eager counterpart runs.
COMPILED: list[tuple[str, Callable]] = []


def engine(column: str, compiled: bool = False):
    def register(setup):
        (COMPILED if compiled else ENGINES).append((column, setup))
        return setup

    return register


def _trainable(model):
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


@engine("autograd step")
def _autograd(model, loss):
    def step(x, y):
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()

    return step


@engine("torch.func vmap(grad)")
def _torch_func(model, loss):
    def single(params, xi, yi):
        return loss(torch.func.functional_call(model, params, (xi[None],)), yi[None])

    grads = torch.func.vmap(torch.func.grad(single), in_dims=(None, 0, 0))

    def step(x, y):
        return grads({k: p.detach() for k, p in _trainable(model).items()}, x, y)

    return step


def _clipped(grads: dict, max_norm: float) -> dict:
    """The clipped sum of per-sample gradients ``{name: [N, ...]}``, as a torch.func
    user writes DP-SGD's step (Opacus' clip factor ``min(1, C / (‖g‖ + 1e-6))``)."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("n,n...->...", factors, g) for k, g in grads.items()}


@engine("compiled autograd step", compiled=True)
def _autograd_compiled(model, loss):
    return _autograd(torch.compile(model), loss)


@engine("torch.compile(vmap(grad))", compiled=True)
def _torch_func_compiled(model, loss):
    return torch.compile(_torch_func(model, loss))


@engine("torch.compile(vmap(grad) + clipped sum)", compiled=True)
def _torch_func_clip_compiled(model, loss):
    grads = _torch_func(model, loss)
    clipped = torch.compile(lambda x, y: _clipped(grads(x, y), 1.0))
    params = _trainable(model)

    def step(x, y):  # the sums become .grad, for the optimizer, as memconv's do
        for name, s in clipped(x, y).items():
            params[name].grad = s

    return step


@engine("PrivateStep(compiled model).per_sample_grads", compiled=True)
def _step_grads_compiled(model, loss):
    return memconv.PrivateStep(torch.compile(model), loss).per_sample_grads


@engine("PrivateStep(compiled model).clip_and_accumulate", compiled=True)
def _step_clip_compiled(model, loss):
    private = memconv.PrivateStep(torch.compile(model), loss)

    def step(x, y):
        model.zero_grad(set_to_none=True)
        return private.clip_and_accumulate(x, y, max_norm=1.0)

    return step


@engine("Opacus hooks")
def _opacus(model, loss):
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, loss_reduction="sum")
    params = list(_trainable(model).values())

    def step(x, y):
        for p in params:
            p.grad = p.grad_sample = None
        with warnings.catch_warnings():  # torch's note on full backward hooks, per call
            warnings.simplefilter("ignore", UserWarning)
            loss(gsm(x), y).backward()
        return [p.grad_sample for p in params]

    step.close = gsm._close
    return step


@engine("PrivateStep.per_sample_grads")
def _step_grads(model, loss):
    private = memconv.PrivateStep(model, loss)
    return private.per_sample_grads


@engine("PrivateStep.clip_and_accumulate")
def _step_clip(model, loss):
    private = memconv.PrivateStep(model, loss)

    def step(x, y):
        model.zero_grad(set_to_none=True)
        return private.clip_and_accumulate(x, y, max_norm=1.0)

    return step


@engine("per_sample_grads")
def _grads(model, loss):
    return lambda x, y: memconv.per_sample_grads(model, loss, x, y)


@engine("clip_and_accumulate")
def _clip(model, loss):
    def step(x, y):
        model.zero_grad(set_to_none=True)
        return memconv.clip_and_accumulate(model, loss, x, y, max_norm=1.0)

    return step


# ----------------------------------------------------------------------------- models
def mlp():
    """64 → 128 → 10."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), (64,)


def small_cnn():
    """1×28×28: conv 16, pool, conv 32, global pool, linear."""
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return model, (1, 28, 28)


def tanh_cnn():
    """The tanh CNN of Papernot et al. 2021 (Tempered Sigmoid Activations) for CIFAR-10."""

    def block(c_in, c_out):
        return [
            nn.Conv2d(c_in, c_out, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(c_out, c_out, 3, padding=1),
            nn.Tanh(),
            nn.MaxPool2d(2),
        ]

    model = nn.Sequential(
        *block(3, 32),
        *block(32, 64),
        *block(64, 128),
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 128),
        nn.Tanh(),
        nn.Linear(128, 10),
    )
    return model, (3, 32, 32)


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` with a rank-r adapter, laid out as peft's ``lora.Linear``:
    ``base_layer(x) + lora_B(lora_A(lora_dropout(x))) · α/r``."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: int = 8):
        super().__init__()
        self.base_layer = base
        self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        nn.init.normal_(self.lora_B["default"].weight, std=0.02)  # peft: zeros; non-zero here
        self.scaling = alpha / r

    def forward(self, x):
        a, b = self.lora_A["default"], self.lora_B["default"]
        return self.base_layer(x) + b(a(self.lora_dropout["default"](x))) * self.scaling


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        n, length, dim = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(n, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * (dim // self.heads) ** -0.5).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(n, length, dim))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """ViT-tiny (dim 192, depth 12, 3 heads) on 32×32 images in 4×4 patches."""

    def __init__(self, dim=192, depth=12, heads=3, patch=4, side=32, num_classes=10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (side // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def vit_lora():
    """ViT-tiny, frozen, with rank-4 LoRA adapters on qkv, fc1 and fc2 (peft's own
    ``inject_adapter_in_model`` where peft is installed)."""
    model = ViT()
    model.requires_grad_(False)
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        for block in model.blocks:
            for name in ("qkv", "fc1", "fc2"):
                setattr(block, name, LoraLinear(getattr(block, name)))
    else:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "fc1", "fc2"])
        model = inject_adapter_in_model(config, model)
    return model, (3, 32, 32)


#: (row label, model builder, N).
ROWS = [
    ("MLP 64→128→10, N=8", mlp, 8),
    ("MLP 64→128→10, N=64", mlp, 64),
    ("CNN 1×28×28 (conv16, pool, conv32, global pool, linear), N=8", small_cnn, 8),
    ("same CNN, N=64", small_cnn, 64),
    ("tanh CNN (Papernot et al. 2021), 3×32×32, N=256", tanh_cnn, 256),
    ("ViT-tiny (img 32, patch 4), LoRA r=4 on qkv/fc1/fc2, frozen base, N=32", vit_lora, 32),
]


#: The clocks a step can be timed by: the wall clock, or the CPU time of the thread that
#: runs it (with one torch thread, the step's own work: steadier where other processes
#: share the machine, as they slow a step's wall clock without adding to its CPU time).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def measure(
    build,
    n: int,
    repeats: int,
    warmup: int,
    engines=None,
    clock: str = "wall",
    compiled: bool = False,
) -> dict[str, float | str]:
    """Median milliseconds per step of each engine on one model and batch size (by
    ``clock``, a key of :data:`CLOCKS`); an engine whose step raises gets ``"fails:
    <error>"`` and is not run again. ``compiled``: the engines of :data:`COMPILED`
    (their first calls, in the warm-up rounds, compile) instead of :data:`ENGINES`."""
    now = CLOCKS[clock]
    torch.manual_seed(0)
    model, shape = build()
    x = torch.randn(n, *shape)
    y = torch.randint(0, 10, (n,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    steps = {  # each its own copy: Opacus' hooks stay on its own
        column: setup(copy.deepcopy(model), loss)
        for column, setup in (COMPILED if compiled else ENGINES)
        if engines is None or column in engines
    }
    times: dict[str, list[float]] = {c: [] for c in steps}
    failed: dict[str, str] = {}
    try:
        for i in range(warmup + repeats):
            for column, step in steps.items():
                if column in failed:
                    continue
                start = now()
                try:
                    step(x, y)
                except Exception as err:  # reported in the table, not hidden
                    failed[column] = f"fails: {type(err).__name__}: {str(err).splitlines()[0][:90]}"
                    continue
                if i >= warmup:
                    times[column].append(now() - start)
    finally:
        for step in steps.values():
            getattr(step, "close", lambda: None)()
    return {c: failed.get(c) or 1e3 * statistics.median(t) for c, t in times.items()}


def table(results: list[tuple[str, dict]]) -> str:
    columns = list(results[0][1])
    lines = [
        "| model, batch | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for label, ms in results:
        cells = (ms[c] if isinstance(ms[c], str) else f"{ms[c]:,.2f}" for c in columns)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fill(page: str, text: str, block: str = "steps:table") -> str:
    """``page`` with the block ``<!-- steps:table -->…<!-- /steps:table -->`` (or
    ``block``'s) refilled."""
    return fill_block(page, block, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memconv.bench.steps", description=__doc__)
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--rows", help="comma-separated row numbers (1-based; default all)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="time each step by the wall clock (default) or the thread's CPU time",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="the compiled engines (torch.compile of each), into the steps-compiled:table "
        "block; the warm-up rounds compile (at least 3 for memconv's: probe, trace, compile)",
    )
    parser.add_argument("--json", help="write the medians to this file")
    parser.add_argument(
        "--markdown",
        help="refill the steps:table block (--compiled: steps-compiled:table) of this page",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--repeats and --threads must be positive, --warmup not negative")
    if args.compiled and args.warmup < 3:
        parser.error("--compiled needs --warmup 3 or more (memconv's third call compiles)")
    torch.set_num_threads(args.threads)
    rows = ROWS
    if args.rows:
        rows = [ROWS[int(i) - 1] for i in args.rows.split(",")]
    results = []
    for label, build, n in rows:
        ms = measure(build, n, args.repeats, args.warmup, clock=args.clock, compiled=args.compiled)
        results.append((label, ms))
        shown = (f"{c} {v}" if isinstance(v, str) else f"{c} {v:.2f} ms" for c, v in ms.items())
        print(f"{label}: " + ", ".join(shown), flush=True)
    text = table(results)
    note = (
        f"\n\nMedian ms per step ({'thread CPU time' if args.clock == 'cpu' else 'wall clock'}) "
        f"of {args.repeats} rounds after {args.warmup}, float32, "
        f"{args.threads} threads, {platform.processor() or platform.machine()}; "
        f"torch {torch.__version__}, memconv {memconv.__version__}."
    )
    print(text + note)
    if args.json:
        with open(args.json, "w") as f:
            record = {"rows": dict(results), "repeats": args.repeats, "compiled": args.compiled}
            json.dump(record, f, indent=1)
    if args.markdown:
        with open(args.markdown) as f:
            page = f.read()
        with open(args.markdown, "w") as f:
            block = "steps-compiled:table" if args.compiled else "steps:table"
            f.write(fill(page, text + note, block))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
