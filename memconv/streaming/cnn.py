"""Streaming a stack of local layers over an image too large for memory.

In the manner of StreamingCNN (Pinckaers, van Ginneken & Litjens, "Streaming
convolutional neural networks for end-to-end learning with multi-megapixel
images", TPAMI 2020) and Lightstream: the forward pass runs tile by tile without
keeping activations and stitches the output; the backward pass runs tile by tile
again, recomputing each tile from the input crop its receptive field covers.

memconv's variant is exact for any image size by construction: the output is cut
into disjoint tiles; for each one, the exact input range (with the layers' own
padding applied only where the range meets the image border) is derived from
kernel, stride, padding and dilation (:mod:`memconv.streaming.plan`); in the
backward pass the tile's recomputed graph is differentiated with the tile's part
of the output gradient only. Since every output position belongs to exactly one
tile, the parameter and input gradients summed over tiles are those of the
conventional pass: nothing needs cropping, and sides that are not multiples of
the output stride need no special case. Convolutions in the recomputed tiles run
through memconv's autograd function, so their weight gradients use the strategy
of the active :class:`memconv.save_memory` block.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import Tensor, nn

from .._checks import check_tile, check_tile_argument
from ..conv.settings import activate, record
from .plan import Node, NotStreamableError, analyse, crop, starts

logger = logging.getLogger("memconv")


def receptive_field(node: Node, dims: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(receptive field, output stride)`` of a plan node, in input pixels per axis.

    Raises:
        NotStreamableError: if the two branches of a residual block have different
            output strides.
    """
    _, rf, jump = node.walk((1,) * dims, (1,) * dims)
    return rf, jump


class StreamingCNN(nn.Module):
    """Run the streamable part of a network tile by tile, exactly.

    Args:
        stream_layers: an ``nn.Sequential`` (or a single layer) of local layers:
            Conv1d/2d/3d (memconv's or torch's), max/average pooling with finite
            kernels, element-wise activations, Dropout and BatchNorm in eval mode,
            nested ``nn.Sequential`` and :class:`memconv.streaming.Residual` blocks.
        tile_size: **input pixels** per tile and spatial axis, halo not included (an
            int, or one int per axis). Rounded down to a multiple of the output
            stride; at least the receptive field. (``memconv.save_memory``'s
            ``tile_size`` counts *output positions* of one layer instead.)
        tile_shape: Lightstream's spelling of the same: the shape of one input tile
            ``(N, C, *tile_size)``; only its spatial part is used. Give ``tile_size``
            or ``tile_shape``, not both.
        tile_device: run each tile on this device (e.g. the layers' ``"cuda"``)
            while the image, the streamed output and the input gradient stay where
            they are (host memory), as Lightstream's ``copy_to_gpu``; ``None`` runs
            the tiles where the image is.
        verbose: log receptive field, overlap and tile counts on the ``memconv``
            logger (INFO) and show progress bars over tiles.

    The :class:`memconv.save_memory` block open around the streamed forward pass
    applies to the convolutions of its recomputed tiles in the backward pass (the
    rule of :class:`memconv.save_memory`).

    Raises:
        ValueError: a layer that is not local or cannot be streamed exactly (named),
            a tile that is not a positive int (tuple), has the wrong length, or is
            smaller than the receptive field, both or neither of ``tile_size`` and
            ``tile_shape``. Raised here, before any work.
        TypeError: a tile size that is not an int or tuple of ints.

    Example:
        >>> stream = StreamingCNN(layers, tile_size=256)
        >>> out = stream(image)              # [N, C, *S_out], no activations kept
        >>> loss_fn(head(out), y).backward() # fills layers' .grad tile by tile
    """

    def __init__(
        self,
        stream_layers: nn.Module,
        tile_size=None,
        *,
        tile_shape=None,
        tile_device=None,
        verbose: bool = False,
    ):
        super().__init__()
        if not isinstance(stream_layers, nn.Module):
            raise TypeError(
                f"stream_layers must be an nn.Module, got {type(stream_layers).__name__}"
            )
        tile_size = check_tile_argument(tile_size, tile_shape)
        plan = analyse(stream_layers)
        windows = plan.windows()
        dims_found = {len(w.kernel) for w in windows}
        if len(dims_found) > 1:
            raise NotStreamableError(f"stream_layers mix spatial dimensions {dims_found}")
        dims = dims_found.pop() if dims_found else _tile_dims(tile_size)
        self.stream_layers = stream_layers
        self.plan = plan
        self.dims = dims
        self.tile_size = check_tile(tile_size, dims)
        self.tile_device = torch.device(tile_device) if tile_device is not None else None
        self.receptive_field, self.output_stride = receptive_field(plan, dims)
        minimum = tuple(max(r, j) for r, j in zip(self.receptive_field, self.output_stride))
        if any(t < m for t, m in zip(self.tile_size, minimum)):
            raise ValueError(
                f"tile_size {self.tile_size} is smaller than the receptive field "
                f"{self.receptive_field} (output stride {self.output_stride}); use at "
                f"least {minimum}"
            )
        self.verbose = verbose
        if verbose:
            logger.info("%s", self.describe())

    # ------------------------------------------------------------------ reports
    def describe(self) -> str:
        """Receptive field, output stride and overlap after each window layer.

        Along each path through the network (the branches of a residual block start
        from the receptive field before the block).
        """
        lines = ["layer | kernel | stride | receptive field | output stride | overlap"]
        rows, _, _ = self.plan.walk((1,) * self.dims, (1,) * self.dims)
        for w, rf, jump in rows:
            overlap = tuple(max(r - j, 0) for r, j in zip(rf, jump))
            lines.append(f"{w.name} | {w.kernel} | {w.stride} | {rf} | {jump} | {overlap}")
        lines.append(
            f"total: receptive field {self.receptive_field}, output stride "
            f"{self.output_stride}, tile {self.tile_size} (+ halo)"
        )
        return "\n".join(lines)

    def output_size(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """Spatial output size for an input spatial size.

        Raises:
            ValueError: if the input is too small for the layers.
        """
        out = self.plan.out_size(tuple(size))
        if any(s < 1 for s in out):
            raise ValueError(f"input of spatial size {tuple(size)} is too small for the layers")
        return out

    def tiles(self, size: tuple[int, ...]) -> list:
        """Output ranges ``((lo, hi) per axis)`` of the tiles for an input size."""
        out = self.output_size(size)
        step = tuple(max(t // j, 1) for t, j in zip(self.tile_size, self.output_stride))
        axes = [[(a, min(a + s, o)) for a in range(0, o, s)] for o, s in zip(out, step)]
        return [tuple(r) for r in itertools.product(*axes)]

    def _progress(self, tiles, desc):
        if not self.verbose:
            return tiles
        from tqdm import tqdm

        return tqdm(tiles, desc=desc, unit="tile")

    def _check_input(self, x):
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError("input must be a floating-point torch.Tensor")
        if x.dim() != self.dims + 2:
            raise ValueError(
                f"input must have shape [N, C, {self.dims} spatial dims], got {tuple(x.shape)}"
            )
        self.output_size(tuple(x.shape[2:]))

    def _to_tile(self, t: Tensor) -> Tensor:
        return t if self.tile_device is None else t.to(self.tile_device)

    # ------------------------------------------------------------------ passes
    def forward(self, x: Tensor) -> Tensor:
        """Streamed forward pass; differentiable (the backward pass streams too).

        Args:
            x: ``[N, C, *S]``.

        Returns:
            ``[N, C_out, *S_out]``, equal to ``stream_layers(x)``, on ``x``'s device.
        """
        self._check_input(x)
        params = list(self.stream_layers.parameters())
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _StreamFunction.apply(self, x, *params)
        with torch.no_grad():
            return self.stream_forward(x)

    def stream_forward(self, x: Tensor) -> Tensor:
        """Forward pass tile by tile, without autograd (activations freed per tile)."""
        size = tuple(x.shape[2:])
        tiles = self.tiles(size)
        if self.verbose:
            logger.info("forward: %d tiles for input %s", len(tiles), size)
        out = None
        for rng in self._progress(tiles, "forward"):
            in_rng, plan = self.plan.required(rng, size)
            y = self.plan.run(self._to_tile(crop(x, in_rng)), starts(in_rng), plan)
            if out is None:
                out = x.new_empty(x.shape[0], y.shape[1], *self.output_size(size), dtype=y.dtype)
            crop(out, rng).copy_(y)
            del y
        return out

    def backward(self, x: Tensor, grad: Tensor, *, input_grad: bool | None = None):
        """Backward pass by hand, as StreamingCNN's ``backward(image, grad)``.

        Accumulates the parameter gradients into ``.grad``; the convolutions use the
        :class:`memconv.save_memory` block open around this call.

        Args:
            x: the input the forward pass saw, ``[N, C, *S]``.
            grad: gradient of the loss w.r.t. the streamed output ``[N, C_out, *S_out]``.
            input_grad: return the input gradient (default: ``x.requires_grad``).

        Returns:
            The input gradient ``[N, C, *S]``, or None.

        Raises:
            ValueError: if ``grad`` does not have the output's shape.
        """
        self._check_input(x)
        want_x = x.requires_grad if input_grad is None else bool(input_grad)
        params = [p for p in self.stream_layers.parameters() if p.requires_grad]
        gx, grads = self.stream_backward(x.detach(), grad, want_x, params)
        for p, g in zip(params, grads):
            p.grad = g if p.grad is None else p.grad + g
        return gx

    def stream_backward(self, x, grad, want_x: bool, params):
        """Input gradient (or None) and gradients of ``params``, tile by tile."""
        size = tuple(x.shape[2:])
        expected = (x.shape[0], None, *self.output_size(size))
        if (
            grad.dim() != len(expected)
            or grad.shape[0] != x.shape[0]
            or tuple(grad.shape[2:]) != tuple(expected[2:])
        ):
            raise ValueError(
                f"grad must have the streamed output's shape [N, C_out, "
                f"{', '.join(map(str, expected[2:]))}], got {tuple(grad.shape)}"
            )
        acc = [torch.zeros_like(p) for p in params]
        gx = torch.zeros_like(x) if want_x else None
        tiles = self.tiles(size)
        if self.verbose:
            logger.info("backward: %d tiles for input %s", len(tiles), size)
        for rng in self._progress(tiles, "backward"):
            in_rng, plan = self.plan.required(rng, size)
            with torch.enable_grad():
                piece = self._to_tile(crop(x, in_rng)).detach().requires_grad_(want_x)
                y = self.plan.run(piece, starts(in_rng), plan)
                inputs = ([piece] if want_x else []) + list(params)
                if not inputs:
                    break
                grads = torch.autograd.grad(
                    y, inputs, self._to_tile(crop(grad, rng)), allow_unused=True
                )
            if want_x:
                crop(gx, in_rng).add_(grads[0].to(gx.device))
                grads = grads[1:]
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g)
            del y, grads, piece
        return gx, acc


class _StreamFunction(torch.autograd.Function):
    """Autograd function around the streamed part: forward and backward stream."""

    @staticmethod
    def forward(ctx, stream: StreamingCNN, x, *params):
        ctx.stream = stream
        # the block around this forward pass applies to the tiles' recomputation
        ctx.recorded = record()
        ctx.save_for_backward(x)
        return stream.stream_forward(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        params = list(ctx.stream.stream_layers.parameters())
        needed = [p for p, n in zip(params, ctx.needs_input_grad[2:]) if n]
        with activate(ctx.recorded.settings, ctx.recorded.per_sample):
            gx, grads = ctx.stream.stream_backward(x, grad, ctx.needs_input_grad[1], needed)
        by_id = {id(p): g for p, g in zip(needed, grads)}
        return (None, gx, *(by_id.get(id(p)) for p in params))


def _tile_dims(tile_size) -> int:
    if isinstance(tile_size, (tuple, list)):
        return len(tile_size)
    raise ValueError(
        "stream_layers has no convolution or pooling layer, so the number of spatial "
        "axes is unknown: give tile_size as a tuple"
    )


__all__ = ["StreamingCNN", "receptive_field"]
