"""Streaming a convolutional trunk over an image too large for memory.

In the manner of StreamingCNN (Pinckaers, van Ginneken & Litjens, "Streaming
convolutional neural networks for end-to-end learning with multi-megapixel
images", TPAMI 2020) and Lightstream, whose names and arguments this module keeps
(``StreamingCNN``, ``tile_shape``, ``copy_to_gpu``, ``backward(image, grad)``): the
forward pass runs tile by tile without keeping activations and stitches the output;
the backward pass runs tile by tile again.

memconv's variant reads the trunk's dataflow whatever its modules' ``forward`` does
(torch.fx, :mod:`memconv.streaming.graph`), so a torchvision ResNet's
``nn.Sequential(net.conv1, ..., net.layer4)`` streams as written, and it is exact for
any image size by construction: every position of every node is computed by one tile
from exactly the inputs it reads, the layers' padding applied only at the image
border (:mod:`memconv.streaming.tiling`). A tile never recomputes its halo: the
positions it shares with earlier tiles are kept once (:mod:`memconv.streaming.halo`),
so a step computes the trunk's forward pass twice (as checkpointing does) whatever the
receptive field, and holds one tile's graph plus thin halo slabs.
"""

from __future__ import annotations

import logging
import time
from fractions import Fraction

import torch
from torch import Tensor, nn

from .._checks import check_stream_tile
from .._torch import compile_backend, compiled_inner, not_traced, version
from ..conv.settings import Autocast, activate, record
from .budget import choose_tile, predict_peak, predict_time
from .compiled import CompiledTiles
from .errors import REMEDY, NotStreamableError
from .graph import Bound, analyse, infer_channels, receptive_fields
from .halo import HaloStore
from .ops import Transposed, Upsample, Window
from .passes import EAGER, TileRunner, backward_pass, forward_pass
from .tiling import TilePlan, tile_plan

logger = logging.getLogger("memconv")


def receptive_field(stream: StreamingCNN) -> tuple[tuple[int, ...], tuple]:
    """``(receptive field, output stride)`` of a streamed trunk, in input pixels per axis
    (the stride as a whole number, or a fraction after upsampling)."""
    return stream.receptive_field, stream.output_stride


class StreamingCNN(nn.Module):
    """Run a convolutional trunk tile by tile, exactly, whatever its ``forward`` does.

    Args:
        stream_layers: the trunk, written as its library writes it: e.g. a torchvision
            ResNet's ``nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool,
            net.layer1, ..., net.layer4)``, ConvNeXt's or DenseNet's ``features``, a
            U-Net. Its dataflow is traced with torch.fx; every operation on the image must
            be local (:mod:`memconv.streaming.catalogue`). A ``torch.compile``'d trunk
            streams compiled: each kind of tile's forward and backward work runs as one
            graph compiled with the trunk's backend (:mod:`memconv.streaming.compiled`).
        tile_size: **input pixels** each tile computes anew per spatial axis (an int, one
            int per axis, or ``"auto"``: of the tiles whose predicted peak fits
            ``memory_budget``, the one predicted fastest with the device's calibration,
            chosen per input size). At least the output stride.
        tile_shape: Lightstream's spelling: the shape of one input tile ``(N, C,
            *tile_size)`` (its channels also tell the input's). Give ``tile_size`` or
            ``tile_shape``, not both.
        memory_budget: bytes a training step may use beyond the image and the
            parameters, for ``tile_size="auto"``.
        tile_device: run each tile on this device (e.g. the layers' ``"cuda"``) while the
            image, the output and the input gradient stay where they are.
        copy_to_gpu: Lightstream's argument: True moves the image to the layers' device
            as a whole before streaming (the output stays there); False keeps it where it
            is and moves each tile (``tile_device`` = the layers' device). None: tiles run
            where the image is.
        verbose: log the receptive field, the overlap, the chosen tile, the tile
            counts, the predicted peak and time per tile, and each pass's measured time
            per tile (logger ``memconv``, INFO); show tqdm progress bars over tiles.

    The :class:`memconv.save_memory` block open around the streamed forward pass applies
    to the trunk's convolution modules in the backward pass; BatchNorm's (eval mode)
    and LayerNorm's affine parameters receive their exact gradients.

    Raises:
        NotStreamableError: an operation that is not local (global or adaptive pooling,
            batch statistics, normalisation over space, attention, random operations,
            ``align_corners=True``, reshapes), a ``forward`` with control flow on traced
            values: named with the module path, before any work.
        ValueError: a tile smaller than the receptive field, both or neither of
            ``tile_size`` and ``tile_shape``, ``"auto"`` without ``memory_budget``,
            ``copy_to_gpu`` with ``tile_device``.
        TypeError: a tile size that is not an int, a tuple of ints or ``"auto"``.

    Example:
        >>> trunk = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool,
        ...                       net.layer1, net.layer2, net.layer3, net.layer4)
        >>> stream = StreamingCNN(trunk, tile_shape=(1, 3, 1024, 1024))
        >>> loss_fn(head(stream(image)), y).backward()   # fills trunk's .grad, exactly
    """

    def __init__(
        self,
        stream_layers: nn.Module,
        tile_size=None,
        *,
        tile_shape=None,
        memory_budget: int | None = None,
        tile_device=None,
        copy_to_gpu: bool | None = None,
        verbose: bool = False,
    ):
        super().__init__()
        if not isinstance(stream_layers, nn.Module):
            raise TypeError(
                f"stream_layers must be an nn.Module, got {type(stream_layers).__name__}"
            )
        tile, channels = check_stream_tile(tile_size, tile_shape, memory_budget)
        if copy_to_gpu is not None and tile_device is not None:
            raise ValueError("give copy_to_gpu (Lightstream's) or tile_device, not both")
        self.stream_layers = stream_layers
        inner = compiled_inner(stream_layers)
        self.graph = analyse(inner if inner is not None else stream_layers)
        #: what runs each tile: eagerly, or as compiled graphs for a compiled trunk
        self.tiles_by = (
            CompiledTiles(inner, compile_backend(stream_layers)) if inner is not None else EAGER
        )
        dims = self.graph.dims or (len(tile) if isinstance(tile, tuple) else None)
        if dims is None:
            raise ValueError(
                "stream_layers has no convolution or pooling layer, so the number of spatial "
                "axes is unknown: give tile_size as a tuple"
            )
        self.dims = dims
        self.tile_size = "auto" if tile == "auto" else _per_axis(tile, dims)
        self.memory_budget = memory_budget
        self.channels = channels or infer_channels(self.graph)
        if self.channels is None:
            raise ValueError(
                "cannot tell the input's channels from stream_layers; give "
                "tile_shape=(1, C, *tile_size)"
            )
        self.copy_to_gpu = copy_to_gpu
        self.tile_device = torch.device(tile_device) if tile_device is not None else None
        self.verbose = verbose
        self._plans: dict = {}
        self._kept = None
        self._virtual = self._virtual_bound()
        out = self._virtual.output
        ((self.receptive_field, jump),) = receptive_fields(self._virtual, [out])
        self.output_stride = tuple(int(j) if j.denominator == 1 else j for j in jump)
        # a tile computes at least one output position; it never recomputes its halo, so
        # it may be smaller than the receptive field
        self.minimum_tile = tuple(max(1, int(-(-j // 1))) for j in jump)
        if self.tile_size != "auto" and any(
            t < m for t, m in zip(self.tile_size, self.minimum_tile)
        ):
            raise ValueError(
                f"tile_size {self.tile_size} is smaller than the output stride "
                f"{self.output_stride} (input pixels per output position); use at least "
                f"{self.minimum_tile}"
            )
        if verbose:
            logger.info("%s", self.describe())

    # ------------------------------------------------------------------ analysis
    def _dtype(self) -> torch.dtype:
        for p in self.stream_layers.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.get_default_dtype()

    def _virtual_bound(self) -> Bound:
        """The graph at an image large enough for the receptive field to fit inside."""
        side = max(512, *(self.tile_size if self.tile_size != "auto" else (0,)))
        while True:
            bound = self.graph.bind((1, self.channels, *(side,) * self.dims), self._dtype())
            ((rf, _),) = receptive_fields(bound, [bound.output])
            if max(rf) * 2 < side or side >= 2**16:
                return bound
            side *= 2

    def bound(self, shape: tuple, dtype: torch.dtype | None = None) -> Bound:
        """The graph at input ``shape`` ``[N, C, *S]`` (see
        :meth:`memconv.streaming.graph.StreamGraph.bind`)."""
        return self.graph.bind(tuple(shape), dtype or self._dtype())

    def plan(
        self, shape: tuple, dtype: torch.dtype | None = None, *, input_grad: bool = False
    ) -> TilePlan:
        """The tiles for an input of ``shape`` ``[N, C, *S]`` (the tile chosen for the
        budget when ``tile_size="auto"``); kept for the last shape.

        Raises:
            ValueError: an input too small for the layers; a budget below the smallest
                tile's predicted peak.
        """
        dtype = dtype or self._dtype()
        key = (tuple(shape), dtype, input_grad)
        if key not in self._plans:
            bound = self.bound(shape, dtype)
            element = torch.empty((), dtype=dtype).element_size()
            if self.tile_size == "auto":
                tile, peak = choose_tile(
                    bound,
                    self.memory_budget,
                    element,
                    max(self.minimum_tile),
                    input_grad,
                    self._param_bytes(),
                    self._device_type(),
                )
                tiles = (tile,) * self.dims
            else:
                tiles = self.tile_size
            plan = tile_plan(bound, tiles)
            if self.verbose:
                peak = predict_peak(plan, element, input_grad, self._param_bytes())
                logger.info(
                    "input %s: tile %s input pixels (%s), %s tiles, receptive field %s, overlap %s, "
                    "predicted peak %.0f MiB (allocator), predicted %.0f ms per tile (%s)",
                    tuple(shape[2:]),
                    tiles,
                    "auto" if self.tile_size == "auto" else "given",
                    "×".join(str(a.count) for a in plan.axes),
                    self.receptive_field,
                    self.overlap,
                    peak / 2**20,
                    1e3 * predict_time(plan, self._device_type()) / plan.count,
                    self._device_type(),
                )
            self._plans = {key: plan}
        return self._plans[key]

    @property
    def last_plan(self) -> TilePlan | None:
        """The tiles of the last input streamed (its ``tile`` is the tile used, the one
        chosen for the budget with ``tile_size="auto"``), or None."""
        return next(iter(self._plans.values()), None)

    @property
    def overlap(self) -> tuple:
        """Input pixels two neighbouring output positions' receptive fields share per
        axis (receptive field − output stride)."""
        return tuple(max(r - j, 0) for r, j in zip(self.receptive_field, self.output_stride))

    def predicted_peak(self, shape: tuple, *, input_grad: bool = False) -> int:
        """Predicted peak bytes of one streamed training step on an input of ``shape``
        beyond the image and the parameters (:func:`memconv.streaming.budget.predict_peak`)."""
        plan = self.plan(shape, input_grad=input_grad)
        element = torch.empty((), dtype=self._dtype()).element_size()
        return predict_peak(plan, element, input_grad, self._param_bytes())

    def _param_bytes(self) -> int:
        return sum(
            p.numel() * p.element_size() for p in self.stream_layers.parameters() if p.requires_grad
        )

    def describe(self) -> str:
        """Receptive field, output stride and overlap after each window op (convolutions,
        pooling, padding, upsampling), along every path into it."""
        bound = self._virtual
        rows = [
            i for i, n in enumerate(bound.nodes) if isinstance(n.op, (Window, Transposed, Upsample))
        ]
        lines = ["layer | kernel | stride | receptive field | output stride | overlap"]
        for i, (rf, jump) in zip(rows, receptive_fields(bound, rows)):
            op = bound.nodes[i].op
            jump = tuple(int(j) if j.denominator == 1 else j for j in jump)
            windows = [op.window(a) for a in range(self.dims)]
            overlap = tuple(max(r - j, 0) for r, j in zip(rf, jump))
            lines.append(
                f"{bound.nodes[i].label} | {tuple(w for w, _ in windows)} | "
                f"{tuple(s for _, s in windows)} | {rf} | {_show(jump)} | {_show(overlap)}"
            )
        tile = "auto (per input size)" if self.tile_size == "auto" else f"{self.tile_size}"
        lines.append(
            f"total: receptive field {self.receptive_field}, output stride "
            f"{_show(self.output_stride)}, tile {tile} (halo kept, not recomputed)"
        )
        return "\n".join(lines)

    def output_size(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """Spatial output size for an input spatial size.

        Raises:
            ValueError: if the input is too small for the layers.
        """
        bound = self.bound((1, self.channels, *size))
        return bound.sizes(bound.output)

    def tiles(self, size: tuple[int, ...]) -> list:
        """Output ranges ``((lo, hi) per axis)`` of the tiles for an input spatial size."""
        plan = self.plan((1, self.channels, *size))
        return [plan.output_range(t) for t in plan.tiles()]

    def _check_input(self, x) -> None:
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError("input must be a floating-point torch.Tensor")
        if x.dim() != self.dims + 2:
            raise ValueError(
                f"input must have shape [N, C, {self.dims} spatial dims], got {tuple(x.shape)}"
            )
        if x.shape[1] != self.channels:
            raise ValueError(f"input has {x.shape[1]} channels; stream_layers take {self.channels}")

    def _device(self) -> torch.device | None:
        if self.tile_device is not None:
            return self.tile_device
        if self.copy_to_gpu is False:
            return next(self.stream_layers.parameters()).device
        return None

    def _device_type(self) -> str:
        """The device type the tiles run on, whose calibration prices them."""
        device = self._device()
        if device is None:
            device = next((p.device for p in self.stream_layers.parameters()), None)
        return device.type if device is not None and device.type != "meta" else "cpu"

    def _report(self, plan: TilePlan, what: str, seconds: float) -> None:
        """Log a pass's measured time per tile beside the prediction (``verbose``)."""
        logger.info(
            "%s: %d tiles in %.2f s, %.0f ms per tile measured (the step predicted %.0f ms "
            "per tile)",
            what,
            plan.count,
            seconds,
            1e3 * seconds / plan.count,
            1e3 * predict_time(plan, self._device_type()) / plan.count,
        )

    def _progress(self, tiles, desc):
        if not self.verbose:
            return tiles
        from tqdm import tqdm

        return tqdm(tiles, desc=desc, unit="tile")

    # ------------------------------------------------------------------ passes
    @not_traced
    def forward(self, x: Tensor) -> Tensor:
        """Streamed forward pass; differentiable (the backward pass streams too).

        Inside a ``torch.compile``'d model this call is one graph break: the model's
        graphs end before it and start after it, and the trunk's tiles run as the trunk
        was given (as compiled graphs when it was ``torch.compile``'d).

        Args:
            x: ``[N, C, *S]``.

        Returns:
            ``[N, C_out, *S_out]``, equal to ``stream_layers(x)``: on ``x``'s device,
            or on the layers' with ``copy_to_gpu=True``.
        """
        self._check_input(x)
        if self.copy_to_gpu:
            x = x.to(next(self.stream_layers.parameters()).device)
        params = list(self.stream_layers.parameters())
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _StreamFunction.apply(self, x, *params)
        runner, out = self._forward(x)
        self._kept = (_key(x), runner)  # for backward(image, grad), Lightstream's call
        return out

    def _forward(self, x: Tensor, *, input_grad: bool = False):
        plan = self.plan(tuple(x.shape), x.dtype, input_grad=input_grad)
        device = self._device() or x.device
        # the autocast state of this call, for the tiles' device: every tile's forward
        # pass and its recomputation run under it (the backward pass may run outside the
        # block, or on another thread)
        autocast = Autocast.current(torch.device(device).type)
        check_autocast(plan.bound, autocast)
        if self.verbose:
            logger.info("forward: %d tiles for input %s", plan.count, tuple(x.shape[2:]))
        runner = TileRunner(plan, x.detach(), HaloStore(plan), self._device(), autocast)
        runner.key = (tuple(x.shape), x.stride(), x.dtype, x.device, input_grad, autocast)
        tiles_by = self._tiles_by("forward", runner)
        start = time.perf_counter()
        with torch.no_grad(), runner.context():
            out = forward_pass(runner, lambda: plan.bound.env(device), self._progress, tiles_by)
        if self.verbose:
            _synchronise(out.device)
            self._report(plan, "forward", time.perf_counter() - start)
        return runner, out

    @not_traced
    def stream_forward(self, x: Tensor) -> Tensor:
        """Forward pass tile by tile, without autograd."""
        self._check_input(x)
        return self._forward(x)[1]

    @not_traced
    def backward(self, image: Tensor, grad: Tensor, *, input_grad: bool | None = None):
        """Backward pass by hand, as Lightstream's ``sCNN.backward(image, grad)``.

        Accumulates the parameter gradients into ``.grad``; the convolutions use the
        :class:`memconv.save_memory` block open around this call. Reuses the halo of the
        last forward pass on ``image`` made without autograd, else streams a forward
        pass first.

        Args:
            image: the input the forward pass saw, ``[N, C, *S]``.
            grad: gradient of the loss w.r.t. the streamed output ``[N, C_out, *S_out]``.
            input_grad: return the input gradient (default: ``image.requires_grad``).

        Returns:
            The input gradient ``[N, C, *S]``, or None.

        Raises:
            ValueError: if ``grad`` does not have the output's shape.
        """
        self._check_input(image)
        if self.copy_to_gpu:
            image = image.to(next(self.stream_layers.parameters()).device)
        want_x = image.requires_grad if input_grad is None else bool(input_grad)
        params = [p for p in self.stream_layers.parameters() if p.requires_grad]
        kept, self._kept = self._kept, None
        runner = kept[1] if kept is not None and kept[0] == _key(image) else self._forward(image)[0]
        gx, grads = self.stream_backward(runner, grad, want_x, params)
        for p, g in zip(params, grads):
            p.grad = g if p.grad is None else p.grad + g
        return gx

    def _tiles_by(self, phase: str, runner: TileRunner, *more):
        """What runs the tiles of a pass: eagerly, or the compiled graphs of the pass's
        key (the phase, the input's shape and dtype, autocast, the settings)."""
        if self.tiles_by is EAGER:
            return EAGER
        return self.tiles_by.begin((phase, runner.key, record(), *more))

    def stream_backward(self, runner: TileRunner, grad: Tensor, want_x: bool, params):
        """Input gradient (or None) and gradients of ``params``, tile by tile."""
        bound = runner.plan.bound
        expected = bound.output_shape()
        if tuple(grad.shape) != tuple(expected):
            raise ValueError(
                f"grad must have the streamed output's shape {list(expected)}, got "
                f"{list(grad.shape)}"
            )
        device = self._device() or runner.x.device
        start = time.perf_counter()
        tiles_by = self._tiles_by("backward", runner, want_x, tuple(map(id, params)))
        with runner.context():  # the forward pass's autocast state, also outside its block
            out = backward_pass(
                runner, lambda: bound.env(device), grad, params, want_x, self._progress, tiles_by
            )
        if self.verbose:
            _synchronise(device)
            self._report(runner.plan, "backward", time.perf_counter() - start)
        return out


def check_autocast(bound: Bound, autocast: Autocast) -> None:
    """Refuse, before any work, what cannot be streamed exactly under ``torch.autocast``.

    A call that reads the dtype of a tensor computed from the image (``x.dtype``,
    ``x.element_size()``; e.g. ``y.to(x.dtype)`` to cast back after a float32 part) is
    read once, when the trunk is analysed at the input's dtype; under autocast that
    tensor has the dtype autocast gives it (bfloat16, float16), so the tiles would run
    with another dtype than the conventional pass.

    Raises:
        NotStreamableError: autocast is on and the trunk reads such a dtype, naming the
            call and the remedies.
    """
    if autocast.dtype is None or not bound.dtype_reads:
        return
    raise NotStreamableError(
        f"{', '.join(bound.dtype_reads)}: reads the dtype of a tensor computed from the image, "
        f"which StreamingCNN takes once at the input's dtype; under torch.autocast "
        f"({autocast.device_type}, {autocast.dtype}) that tensor has another dtype, so the "
        "tiles would not compute what the conventional pass computes. Use a fixed dtype in "
        "that forward (e.g. x.float(), .to(torch.bfloat16)), stream without torch.autocast, "
        f"or {REMEDY}"
    )


def _synchronise(device) -> None:
    """Wait for a GPU's queued work (once per pass, for ``verbose``'s measured times)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _key(x: Tensor) -> tuple:
    return (id(x), version(x), tuple(x.shape), x.dtype, x.device)


def _per_axis(tile, dims: int) -> tuple[int, ...]:
    from .._checks import check_tile

    return check_tile(tile, dims)


def _show(values) -> str:
    return "(" + ", ".join(str(v) for v in values) + (",)" if len(values) == 1 else ")")


class _StreamFunction(torch.autograd.Function):
    """Autograd function around the streamed trunk: forward and backward stream."""

    @staticmethod
    def forward(ctx, stream: StreamingCNN, x, *params):
        ctx.stream = stream
        # the block around this forward pass applies to the tiles' recomputation
        ctx.recorded = record()
        ctx.runner, out = stream._forward(x, input_grad=ctx.needs_input_grad[1])
        return out

    @staticmethod
    def backward(ctx, grad):
        stream, runner = ctx.stream, ctx.runner
        ctx.runner = None  # the halo is freed once the backward pass is done
        params = list(stream.stream_layers.parameters())
        needed = [p for p, n in zip(params, ctx.needs_input_grad[2:]) if n]
        with activate(ctx.recorded.settings, ctx.recorded.per_sample):
            gx, grads = stream.stream_backward(runner, grad, ctx.needs_input_grad[1], needed)
        by_id = {id(p): g for p, g in zip(needed, grads)}
        return (None, gx, *(by_id.get(id(p)) for p in params))


__all__ = ["Fraction", "NotStreamableError", "StreamingCNN", "receptive_field"]
