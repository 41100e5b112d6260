"""On a CUDA device: a step's results equal the CPU's in float64, and a DP step
synchronises the host at most once. Skipped where torch has no CUDA device."""

import warnings

import pytest
import torch
from helpers import small_gn_resnet, small_vit
from torch import nn

import memconv
from memconv.bench.options import device_record, strict_float32

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")
TOL = 1e-10


MODELS = {"gn-resnet": (small_gn_resnet, (3, 8, 8)), "vit": (small_vit, (3, 8, 8))}


def _pair(name: str, n: int):
    """The same float64 model and batch on the CPU and on CUDA."""
    torch.manual_seed(0)
    build, shape = MODELS[name]
    cpu = build().double()
    gpu = build().double().to(CUDA)
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(n, *shape, dtype=torch.float64)
    y = torch.randint(0, 10, (n,))
    return (cpu, x, y), (gpu, x.to(CUDA), y.to(CUDA))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() or 1.0
    return (a.cpu() - b).abs().max().item() / scale


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("clip_route", ["book-keeping", "two-pass"])
def test_clip_and_accumulate_on_cuda_equals_the_cpu(name, clip_route):
    (cpu, x, y), (gpu, xg, yg) = _pair(name, 6)
    loss = nn.CrossEntropyLoss()
    norms = {}
    for model, a, b in ((cpu, x, y), (gpu, xg, yg)):
        step = memconv.PrivateStep(model, loss, clip_route=clip_route)
        model.zero_grad(set_to_none=True)
        norms[model] = step.clip_and_accumulate(a, b, max_norm=0.5)
        step.clip_and_accumulate(a, b, max_norm=0.5)  # the step's second call: reused plan
    assert _rel(norms[gpu], norms[cpu]) < TOL
    for (k, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert _rel(q.grad, p.grad) < TOL, k


@pytest.mark.parametrize("route", ["ghost", "instantiate"])
def test_per_sample_norms_and_grads_on_cuda_equal_the_cpu(route):
    (cpu, x, y), (gpu, xg, yg) = _pair("gn-resnet", 5)
    loss = nn.CrossEntropyLoss()
    got = memconv.per_sample_norms(gpu, loss, xg, yg, norm_route=route, per_parameter=True)
    ref = memconv.per_sample_norms(cpu, loss, x, y, norm_route=route, per_parameter=True)
    for k in ref:
        assert _rel(got[k], ref[k]) < TOL, k
    got = memconv.PrivateStep(gpu, loss).per_sample_grads(xg, yg)
    ref = memconv.per_sample_grads(cpu, loss, x, y)
    for k in ref:
        assert _rel(got[k], ref[k]) < TOL, k


def test_a_dp_step_synchronises_the_host_once():
    """CUDA's sync debug mode warns at each synchronising operation: one, the norms'
    check, in a steady-state step."""
    (_, _, _), (gpu, xg, yg) = _pair("gn-resnet", 8)
    step = memconv.PrivateStep(gpu, nn.CrossEntropyLoss())
    step.clip_and_accumulate(xg, yg, max_norm=1.0)  # the probe and the plan
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step.clip_and_accumulate(xg, yg, max_norm=1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]


def test_bench_runs_cuda_without_tf32_and_records_it():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        strict_float32("cuda")
        record = device_record("cuda")
        assert record["tf32_matmul"] is False and record["tf32_cudnn"] is False
        assert record["name"] == torch.cuda.get_device_name()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
