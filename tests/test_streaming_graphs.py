"""StreamingCNN on trunks written as their libraries write them (traced with torch.fx):
output, every parameter gradient (BatchNorm's and LayerNorm's affine ones included) and
the input gradient equal the conventional pass's, float64, 1e-10 relative; every
operation that is not local refused by name before any work.

The trunks are small (narrow, two or three stages) so that the file runs in well under
a minute; the tiles are much smaller than the receptive field, so every image is cut
into several tiles along both axes and the kept halo is read across tile boundaries.
"""

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err
from torch import nn

from memconv.bench import trunks
from memconv.bench.models import ConvNeXtBlock
from memconv.streaming import NotStreamableError, StreamingCNN

TOL = 1e-10


def randomise(module: nn.Module, seed: int = 0) -> nn.Module:
    """Float64, eval mode, and norm statistics and affine parameters away from their
    initial values (so that an error in their gradients shows)."""
    torch.manual_seed(seed)
    module = module.double().eval()
    trunks.randomise_norms(module)
    for name, p in module.named_parameters():
        if "layer_scale" in name or name.endswith("gamma"):
            p.data.uniform_(0.5, 1.5)
    return module


def check(trunk, shape, tile, **kwargs):
    """Streamed output, parameter and input gradients equal the conventional ones."""
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64)
    xs = x.clone().requires_grad_()
    ref_out = trunk(xs)
    g = torch.randn_like(ref_out)
    params = [p for p in trunk.parameters() if p.requires_grad]
    ref = torch.autograd.grad(ref_out, [xs, *params], g)
    stream = StreamingCNN(trunk, tile, **kwargs)
    xs = x.clone().requires_grad_()
    out = stream(xs)
    assert rel_err(out, ref_out.detach()) < TOL
    got = torch.autograd.grad(out, [xs, *params], g)
    names = ["input"] + [n for n, p in trunk.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, got, ref):
        assert rel_err(a, b) < TOL, name
    assert len(stream.tiles(shape[2:])) > 1
    return stream


# ------------------------------------------------------------------ the trunks
@pytest.mark.parametrize("shape", [(1, 3, 131, 117), (2, 3, 96, 103)])
def test_resnet18_trunk_as_torchvision_writes_it(shape):
    """BasicBlock: ReLU(inplace=True), ``out += identity``, a downsample shortcut;
    ``nn.Sequential(net.conv1, ..., net.layer4)`` as Lightstream's users build it."""
    trunk = randomise(trunks.resnet_trunk(18, width=4, layers=(1, 2, 1, 1)))
    check(trunk, shape, 40)


def test_resnet18_trunk_without_norms():
    """``norm_layer=nn.Identity`` (torchvision's ResNet accepts it)."""
    trunk = randomise(trunks.resnet_trunk(18, nn.Identity, width=4, layers=(1, 1, 1, 1)))
    check(trunk, (1, 3, 97, 120), 48)


def test_resnet50_trunk_bottleneck():
    """Bottleneck blocks with downsample shortcuts; BatchNorm's affine parameters get
    their exact gradients (Lightstream freezes them)."""
    trunk = randomise(trunks.resnet_trunk(50, width=2, layers=(1, 1, 1, 1)))
    stream = check(trunk, (1, 3, 113, 99), 40)
    assert stream.receptive_field[0] > 40  # the tiles are smaller than it


def test_convnext_stages_as_torchvision_and_timm_write_them():
    """torchvision's CNBlock (Permute, LayerNorm over channels, Linear, layer scale,
    ``result += input``) and LayerNorm2d downsampling; timm's block (LayerNorm2d,
    1×1-conv MLP, ``x.mul(gamma.reshape(1, -1, 1, 1))``)."""
    trunk = randomise(trunks.convnext_trunk((1, 2), (8, 12), layer_scale=0.5))
    check(trunk, (1, 3, 101, 94), 36)
    timm = randomise(nn.Sequential(nn.Conv2d(3, 8, 4, 4), ConvNeXtBlock(8, 0.5)))
    check(timm, (1, 3, 87, 70), 36)


def test_densenet_blocks_and_transition():
    """torch.cat of the features so far, BN–ReLU–conv layers, the average-pooling
    transition."""
    check(randomise(trunks.densenet_trunk(4, (2, 2), 8, 2)), (1, 3, 85, 99), 32)


def test_mobilenet_v2_inverted_residuals():
    """ReLU6 (in place), depthwise 3×3 convolutions, ``x + self.conv(x)``."""
    trunk = trunks.mobilenet_v2_trunk([[1, 8, 1, 1], [4, 8, 2, 2], [4, 12, 1, 2]], 8, 16)
    check(randomise(trunk), (2, 3, 71, 66), 24)


@pytest.mark.parametrize("shape", [(1, 3, 67, 83), (1, 3, 64, 64)])
def test_unet_transposed_convolutions_and_skips(shape):
    """milesial's U-Net: ConvTranspose2d, the skip padded by the size difference (taken
    at the full image's size), concatenation; odd sizes pad unevenly."""
    check(randomise(trunks.UNet(3, 2, False, 4)), shape, 24)


class Block1d(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv1d(c, c, 5, padding=2, bias=False)
        self.bn1 = nn.BatchNorm1d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv1d(c, c, 3, padding=1, padding_mode="reflect")

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.conv2(out)
        out += x
        return F.max_pool1d(self.relu(out), 3, 2, 1)


def test_1d_trunk():
    trunk = randomise(nn.Sequential(nn.Conv1d(2, 6, 7, stride=2), Block1d(6), Block1d(6)))
    check(trunk, (2, 2, 403), 40)


class Block3d(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv3d(c, c, 3, padding=1)
        self.norm = nn.BatchNorm3d(c)
        self.up = nn.ConvTranspose3d(c, c, 2, stride=2)

    def forward(self, x):
        y = F.relu(self.norm(self.conv(x)), inplace=True) + x
        return torch.cat([F.avg_pool3d(self.up(y), 2), y], 1)


def test_3d_trunk():
    trunk = randomise(nn.Sequential(nn.Conv3d(1, 3, 3, stride=2), Block3d(3)))
    check(trunk, (1, 1, 27, 23, 21), 8)


# ------------------------------------------------------------------ operations
class Ops(nn.Module):
    """Every local operation the catalogue knows, written in a forward."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.std = nn.Parameter(torch.randn(4, 4, 3, 3))
        self.gain = nn.Parameter(torch.rand(4) + 0.5)
        self.scale = nn.Parameter(torch.rand(4, 1, 1) + 0.5)
        self.norm = nn.RMSNorm(4)
        self.linear = nn.Linear(4, 5)
        self.t = nn.ConvTranspose2d(5, 3, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x):
        x = self.conv(x).relu_()
        # a weight standardised in the forward pass (a function of parameters alone)
        w = F.batch_norm(self.std.reshape(1, 4, -1), None, None, training=True, eps=1e-5)
        x = F.conv2d(x, w.reshape_as(self.std) * self.gain.view(-1, 1, 1, 1), None, 1, "same")
        y = F.hardswish(x) * self.scale - 0.5
        y = F.pad(y, [2, 1, 0, 3], mode="reflect")
        y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
        y = F.max_pool2d(y, 3, 2, 1) + F.avg_pool2d(y, 3, 2, 1, count_include_pad=True)
        y = F.interpolate(y, size=(y.shape[2] * 3, y.shape[3] * 3), mode="nearest")
        y = self.norm(y.permute(0, 2, 3, 1))
        y = self.linear(y).transpose(1, 3).transpose(2, 3)
        y = torch.cat([y, y.softmax(1), y.mean(1, keepdim=True)], 1)
        return self.t(F.pad(y[:, :5], [1, 1, 1, 1], mode="replicate"))


def test_every_local_operation():
    check(randomise(Ops()), (1, 3, 41, 37), 12)


class Mutates(nn.Module):
    """In-place changes read later, as eager mode runs them (made functional)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3)

    def forward(self, x):
        x = self.conv(x) * 1.0
        y = x.relu_()  # y is x
        z = x * 3.0  # reads x after the change: 3·relu
        w = z * z
        w += y  # in place on w
        return F.relu(w, inplace=True) + y


def test_in_place_operations_follow_eager_semantics():
    check(randomise(Mutates()), (1, 2, 50, 45), 16)


def test_legacy_residual_still_streams():
    from memconv.streaming import Residual

    trunk = nn.Sequential(
        nn.Conv2d(3, 4, 3), Residual(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()))
    )
    check(randomise(trunk), (1, 3, 40, 33), 12)


# ------------------------------------------------------------------ refusals
class SE(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        x = self.conv(x)
        return x * torch.sigmoid(F.adaptive_avg_pool2d(x, 1))


class Branchy(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


class SpaceNorm(nn.Module):
    def forward(self, x):
        return F.layer_norm(x, x.shape[2:])


class PositionEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(1, 3, 64, 64))

    def forward(self, x):
        return x + self.pos


class RandomDrop(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.1, training=True)


@pytest.mark.parametrize(
    "layer, match",
    [
        (nn.BatchNorm2d(3), r"1 \(BatchNorm2d\): uses batch statistics"),
        (
            trunks.MBConv(3, 3),
            r"1\.block\.2\.avgpool \(AdaptiveAvgPool2d\): global/adaptive "
            r"pooling .* squeeze-and-excitation",
        ),
        (SE(), r"1 \(SE\) calls adaptive_avg_pool2d: global"),
        (nn.GroupNorm(1, 3), r"1 \(GroupNorm\): normalises over the spatial axes"),
        (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), "align_corners=True"),
        (trunks.UNet(3, 2, True, 4), r"up1\.up \(Upsample\): align_corners=True"),
        (Branchy(), r"1 \(Branchy\): its forward branches on a traced value"),
        (SpaceNorm(), r"calls layer_norm: normalises over the last 2 axes"),
        (PositionEmbedding(), r"calls operator.add: combines the image with a tensor of shape"),
        (RandomDrop(), r"calls dropout: draws random numbers"),
        (nn.Upsample(scale_factor=1.5), "not a whole number"),
        (nn.MultiheadAttention(3, 1), "MultiheadAttention"),
    ],
)
def test_refused_by_operation_before_any_work(layer, match):
    trunk = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), layer.eval())
    if isinstance(layer, nn.BatchNorm2d):
        layer.train()
    with pytest.raises(NotStreamableError, match=match) as info:
        StreamingCNN(trunk, 32)
    assert "stream_layers." in str(info.value)
    assert "conventionally on the streamed output" in str(info.value)  # the remedy


def test_stochastic_depth_in_training_is_refused_and_in_eval_streams():
    trunk = randomise(trunks.convnext_trunk((1,), (8,)))
    trunk[1][0].stochastic_depth.p = 0.2
    trunk.train()
    with pytest.raises(NotStreamableError, match=r"stochastic_depth \(StochasticDepth\).*random"):
        StreamingCNN(trunk, 32)
    check(trunk.eval(), (1, 3, 70, 61), 24)


# ------------------------------------------------------------------ the tile for the user
def test_auto_tile_fits_the_budget_and_is_reported(caplog):
    trunk = randomise(trunks.resnet_trunk(18, width=8, layers=(1, 1, 1, 1)))
    shape = (1, 3, 160, 150)
    whole = StreamingCNN(trunk, 160).predicted_peak(shape)
    budget = (StreamingCNN(trunk, 64).predicted_peak(shape) + whole) // 2
    small = StreamingCNN(trunk, "auto", memory_budget=budget, verbose=True)
    with caplog.at_level(logging.INFO, logger="memconv"):
        plan = small.plan(shape, torch.float64)
    text = caplog.text
    assert f"receptive field {small.receptive_field}" in text and "(auto)" in text
    assert "overlap" in text and "predicted peak" in text
    assert plan.count > 1 and small.predicted_peak(shape) <= budget
    large = StreamingCNN(trunk, "auto", memory_budget=2 * whole)
    assert large.plan(shape, torch.float64).count == 1
    with pytest.raises(ValueError, match="below the least predicted peak"):
        StreamingCNN(trunk, "auto", memory_budget=2**12).plan(shape, torch.float64)
    with pytest.raises(ValueError, match="needs memory_budget"):
        StreamingCNN(trunk, "auto")
    with pytest.raises(ValueError, match="with tile_size='auto'"):
        StreamingCNN(trunk, 64, memory_budget=2**20)


def test_lightstream_calls_copy_to_gpu_and_backward_reusing_the_halo():
    """``tile_shape``, ``copy_to_gpu`` and ``backward(image, grad)`` as Lightstream's
    users write them; the manual backward reuses the no-grad forward's halo."""
    trunk = randomise(trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1)))
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 2)).double()
    x = torch.randn(1, 3, 140, 131, dtype=torch.float64)
    loss = F.cross_entropy(head(trunk(x)), torch.tensor([1]))
    ref = torch.autograd.grad(loss, list(trunk.parameters()))
    for copy in (True, False):
        trunk.zero_grad()
        stream = StreamingCNN(trunk, tile_shape=(1, 3, 48, 48), copy_to_gpu=copy)
        with torch.no_grad():
            out = stream(x)
        out.requires_grad_()
        F.cross_entropy(head(out), torch.tensor([1])).backward()
        assert stream.backward(x, out.grad) is None
        for p, r in zip(trunk.parameters(), ref):
            assert rel_err(p.grad, r) < TOL
    with pytest.raises(ValueError, match="not both"):
        StreamingCNN(trunk, 48, copy_to_gpu=True, tile_device="cpu")


def test_per_sample_gradients_and_clipping_of_a_streamed_torchvision_trunk():
    """memconv.per_sample_grads and clip_and_accumulate on a model holding a streamed
    torchvision trunk (run sample by sample): BatchNorm's affine parameters included."""
    from helpers import loop_reference

    import memconv

    trunk = randomise(trunks.resnet_trunk(18, width=4, layers=(1, 1, 1, 1)))
    torch.manual_seed(2)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3)).double()
    streamed = nn.Sequential(StreamingCNN(trunk, 40), head)
    x, y = torch.randn(3, 3, 90, 77, dtype=torch.float64), torch.tensor([0, 2, 1])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per = loop_reference(nn.Sequential(trunk, head), loss_fn, x, y)
    per = {(f"0.stream_layers.{n[2:]}" if n.startswith("0.") else n): g for n, g in per.items()}
    grads = memconv.per_sample_grads(streamed, loss_fn, x, y)
    for name, g in per.items():
        assert rel_err(grads[name], g) < TOL, name
    norms = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    got = memconv.clip_and_accumulate(streamed, loss_fn, x, y, max_norm=max_norm)
    assert rel_err(got, norms) < TOL
    factors = (max_norm / norms).clamp(max=1.0)
    for name, p in streamed.named_parameters():
        expected = torch.einsum("n,n...->...", factors, per[name])
        assert rel_err(p.grad, expected) < TOL, name
