"""StreamingCNN under ``torch.autocast`` equals the conventional pass under the same
autocast, within the dtype's rounding: output, input gradient, every parameter gradient.

bfloat16 on the CPU (float16 on CUDA runs the same code; float16 on the CPU where torch
supports it). Each tile's forward pass and each tile's recomputation run under the
autocast state of the streamed forward pass, also when the backward pass starts outside
the autocast block (``with autocast: loss = f(stream(x))``, then ``loss.backward()``).

**The tolerance.** Streaming does not compute the same floating-point sums as the
conventional pass: a parameter's gradient is a sum of one partial gradient per tile
(each rounded to the autocast dtype by its convolution's backward kernel, then added in
float32), a halo position's gradient a sum of the gradients the tiles reading it sent
(each rounded to the dtype, where the conventional pass rounds the whole sum once), and
torch's CPU kernels may round an element differently in a crop than in the whole image
(seen: one unit of rounding at one position of a BatchNorm's output, on the ResNet trunk
with other weights than these). In bfloat16 such a unit can then move a max-pool's
choice between near-equal values, and with it a whole gradient value to a neighbouring
position. So
streaming is another computation of the gradients in the autocast dtype, and the tests
require it to be as good as the conventional one, with ``u`` the dtype's unit round-off
(``eps / 2``: 2^-8 for bfloat16, 2^-11 for float16), ``err(x, y) = ‖x − y‖ / ‖y‖``, and
for each gradient ``d = err(conventional autocast, float32)``, how far the dtype's
rounding moves that gradient in the conventional pass itself:

- every gradient and the output is as accurate as the conventional autocast pass's:
  ``err(streamed, float32) ≤ 2 d + 2 u``;
- every gradient and the output is within ``3 d + 4 u`` of the conventional autocast
  pass: a few units of rounding where the gradient is well conditioned (``d`` about
  ``u``: the convolution weights of StreamingCNN's network), more where a sum cancels
  (a BatchNorm or LayerNorm bias sums gradients of both signs; with BatchNorm's
  statistics randomised, a ResNet's ``d`` reaches 100 u and more in bfloat16).

``tools/streaming-autocast.py`` prints the measured ratios (the docs' "Mixed
precision"). A recomputation in another precision than the forward pass's is caught
bit for bit: the gradients with the backward pass inside and outside the autocast block
are the same tensors.

The trunks are small (narrow, one block per stage) and the images cut into several
tiles along both axes (corners, edges and, at 3 × 3 tiles and more, interior tiles).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memconv
from memconv.bench import trunks
from memconv.bench.models import streaming_net
from memconv.streaming import NotStreamableError, StreamingCNN

BF16 = ("cpu", torch.bfloat16)


def cpu_float16() -> bool:
    """Whether this torch runs CPU autocast in float16."""
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            y = nn.functional.linear(torch.randn(2, 2), torch.randn(2, 2))
        return y.dtype == torch.float16
    except RuntimeError:
        return False


def randomised(build, seed: int = 0) -> nn.Module:
    """``build()`` seeded, in float32 and eval mode, norm statistics and affine parameters
    away from their initial values (so that an error in their gradients shows)."""
    torch.manual_seed(seed)
    module = build().float().eval()
    trunks.randomise_norms(module)
    return module


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float32 (``‖a − b‖`` where ``b`` is zero)."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def conventional(trunk, x, g, autocast):
    """Output and gradients of ``[x, *parameters]`` for the output gradient ``g``
    (rounded to the output's dtype, as autograd would), under ``autocast`` (None:
    float32)."""
    xs = x.clone().requires_grad_()
    device = x.device.type
    with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        out = trunk(xs)
    grads = torch.autograd.grad(out, [xs, *trunk.parameters()], g.to(out.dtype))
    return out.detach(), grads


def assert_as_conventional(trunk, out, grads, x, g, dtype):
    """The streamed ``out`` and ``grads`` (of ``[x, *parameters]``) against the
    conventional pass under autocast ``dtype`` and in float32: the tolerances of the
    module docstring."""
    ref_out, ref = conventional(trunk, x, g, dtype)
    ref32_out, ref32 = conventional(trunk, x, g, None)
    u = torch.finfo(dtype).eps / 2
    assert out.dtype == ref_out.dtype
    names = ["output", "input"] + [n for n, _ in trunk.named_parameters()]
    errors = {}
    for name, s, a, f in zip(
        names, [out, *grads], [ref_out, *ref], [ref32_out, *ref32], strict=True
    ):
        assert s.dtype == a.dtype, name  # float32 for the input and the parameters
        d = err(a, f)
        assert err(s, f) <= 2 * d + 2 * u, (name, err(s, f) / u, d / u)
        assert err(s, a) <= 3 * d + 4 * u, (name, err(s, a) / u, d / u)
        errors[name] = err(s, a) / u
    return errors


def stream_grads(stream, x, g, dtype, *, backward_inside: bool):
    """Streamed output and gradients of ``[x, *parameters]``, the forward pass under
    autocast ``dtype``, the backward pass inside or outside the block."""
    xs = x.clone().requires_grad_()
    params = list(stream.stream_layers.parameters())
    with torch.autocast(x.device.type, dtype=dtype):
        out = stream(xs)
        if backward_inside:
            return out, torch.autograd.grad(out, [xs, *params], g.to(out.dtype))
    return out, torch.autograd.grad(out, [xs, *params], g.to(out.dtype))


def check(trunk, shape, tile, dtype=torch.bfloat16, tiles=None):
    """Streamed under autocast, the backward pass outside the block (the usual
    pattern), against the conventional pass."""
    torch.manual_seed(1)
    x = torch.randn(*shape)
    stream = StreamingCNN(trunk, tile)
    with torch.no_grad():
        g = torch.randn(stream.bound(shape).output_shape())
    out, grads = stream_grads(stream, x, g, dtype, backward_inside=False)
    if tiles is not None:
        assert len(stream.tiles(shape[2:])) == tiles
    return assert_as_conventional(trunk, out, grads, x, g, dtype)


# ------------------------------------------------------------------ the trunks
def test_resnet18_trunk_bfloat16():
    """torchvision's layout (in-place ReLU, ``out += identity``, downsample shortcuts,
    BatchNorm in eval mode), 2 × 2 tiles (the halo read across both boundaries)."""
    trunk = randomised(lambda: trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1)))
    check(trunk, (1, 3, 64, 96), 32, tiles=4)


@pytest.mark.slow
def test_resnet18_trunk_bfloat16_three_by_three_tiles():
    """As above on 3 × 3 tiles: an interior tile reads halo on all four sides."""
    trunk = randomised(lambda: trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1)))
    check(trunk, (1, 3, 160, 160), 32, tiles=9)


def test_streamingcnn_example_net_bfloat16():
    """StreamingCNN's own network (six 3×3 convolutions, three max-pools), 3 × 3 tiles:
    an interior tile among them."""
    trunk = randomised(lambda: streaming_net()[:15])
    check(trunk, (1, 3, 112, 112), 40, tiles=9)


def test_convnext_trunk_bfloat16():
    """torchvision's CNBlock (Permute, LayerNorm over channels, Linear in bfloat16,
    layer scale, ``result += input``) and LayerNorm2d downsampling: the output is
    float32 here, as the conventional pass's."""
    trunk = randomised(lambda: trunks.convnext_trunk((1, 2), (8, 12), layer_scale=0.5))
    check(trunk, (1, 3, 101, 94), 36)


@pytest.mark.skipif(not cpu_float16(), reason="this torch has no float16 CPU autocast")
def test_resnet18_trunk_float16_on_the_cpu():
    """float16, the dtype of CUDA's autocast, on the CPU."""
    trunk = randomised(lambda: trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1)))
    check(trunk, (1, 3, 96, 96), 32, dtype=torch.float16, tiles=4)


# ------------------------------------------------------------------ the state replayed
def test_backward_inside_or_outside_the_block_computes_the_same():
    """The recomputation runs under the forward pass's autocast state wherever the
    backward pass starts: bit for bit the same gradients inside and outside the block
    (before, the backward pass outside raised a dtype mismatch in the first
    convolution)."""
    trunk = randomised(lambda: trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1)))
    stream = StreamingCNN(trunk, 32)
    torch.manual_seed(1)
    x, shape = torch.randn(1, 3, 96, 80), (1, 3, 96, 80)
    g = torch.randn(stream.bound(shape).output_shape())
    out_in, inside = stream_grads(stream, x, g, torch.bfloat16, backward_inside=True)
    out_out, outside = stream_grads(stream, x, g, torch.bfloat16, backward_inside=False)
    assert torch.equal(out_in, out_out) and out_in.dtype == torch.bfloat16
    for a, b in zip(inside, outside, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_forward_without_autocast_is_recomputed_without_it():
    """A forward pass outside autocast is recomputed in float32 even when the backward
    pass runs inside an autocast block (the state of the forward pass applies, as
    torch.autocast's own rule)."""
    trunk = randomised(lambda: streaming_net()[:10])
    stream = StreamingCNN(trunk, 24)
    x = torch.randn(1, 3, 64, 64, requires_grad=True)
    out = stream(x)
    assert out.dtype == torch.float32
    g = torch.randn_like(out)
    plain = torch.autograd.grad(out, [x, *trunk.parameters()], g)
    out = stream(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = torch.autograd.grad(out, [x, *trunk.parameters()], g)
    for a, b in zip(inside, plain, strict=True):
        assert torch.equal(a, b)


def test_lightstream_sequence_under_autocast():
    """Lightstream's training step under autocast: the trunk streamed without autograd,
    the head and the loss under autocast, ``loss.backward()`` and
    ``stream.backward(image, out.grad)`` outside the block; the manual backward reuses
    the forward's halo and its autocast state."""
    trunk = randomised(lambda: trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1)))
    torch.manual_seed(2)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 2))
    x, y = torch.randn(1, 3, 112, 100), torch.tensor([1])
    stream = StreamingCNN(trunk, tile_shape=(1, 3, 40, 40), copy_to_gpu=False)
    trunk.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            out = stream(x)
        out.requires_grad_()
        loss = F.cross_entropy(head(out), y)
    loss.backward()
    assert out.dtype == torch.bfloat16 and out.grad.dtype == torch.bfloat16
    gx = stream.backward(x, out.grad, input_grad=True)  # outside the block
    assert stream._kept is None  # the no-grad forward's halo was used
    grads = [gx, *(p.grad for p in trunk.parameters())]
    assert_as_conventional(trunk, out.detach(), grads, x, out.grad, torch.bfloat16)


def test_memconv_layers_in_a_save_memory_block_under_autocast():
    """A converted trunk: its convolutions run memconv's autograd function on every tile
    (the ``save_memory`` block of the forward pass), casting as autocast casts."""
    trunk = randomised(lambda: memconv.convert(streaming_net()[:10]))
    stream = StreamingCNN(trunk, 24)
    torch.manual_seed(1)
    x = torch.randn(1, 3, 72, 72)
    g = torch.randn(stream.bound(x.shape).output_shape())
    with memconv.save_memory("rochette"):
        out, grads = stream_grads(stream, x, g, torch.bfloat16, backward_inside=False)
    assert_as_conventional(trunk, out, grads, x, g, torch.bfloat16)


# ------------------------------------------------------------------ refusals
class CastsBack(nn.Module):
    """A block computing in float32 and casting back to its input's dtype: the dtype
    read is a value StreamingCNN takes once, at the analysed dtype."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return torch.tanh(self.conv(x).float()).to(x.dtype)


def test_reading_a_dtype_under_autocast_is_refused_before_any_work(monkeypatch):
    """``.to(x.dtype)`` of a tensor computed from the image: under autocast its dtype is
    not the one StreamingCNN analysed, so streaming refuses, naming the call, before a
    tile runs; without autocast it streams."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), CastsBack(), nn.Conv2d(4, 2, 3))
    stream = StreamingCNN(trunk, 24)
    x = torch.randn(1, 3, 64, 64)
    out = stream(x)
    assert (out - trunk(x)).abs().max() < 1e-5

    def no_tiles(*args, **kwargs):
        raise AssertionError("a tile ran")

    monkeypatch.setattr("memconv.streaming.cnn.forward_pass", no_tiles)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(NotStreamableError, match=r"stream_layers\.1.*dtype.*autocast"):
            stream(x)
        with pytest.raises(NotStreamableError, match="fixed dtype"), torch.no_grad():
            stream(x)
