"""The streamed forward and backward passes, tile by tile.

Forward (:func:`forward_pass`, without autograd): tiles in raster order; each computes
its box of every node (:class:`~memconv.streaming.tiling.TilePlan`) from its inputs'
boxes and the halo earlier tiles kept (:class:`~memconv.streaming.halo.HaloStore`),
keeps what later tiles will read, writes its part of the output and frees the rest.

Backward (:func:`backward_pass`): tiles in reverse raster order; each recomputes its
boxes with autograd (its halo read from the forward pass's store as leaves) and runs
one ``torch.autograd.grad`` from its part of the output gradient; the gradients later
tiles sent to its boxes join on the way (:func:`seed`, on the thin slabs they cover).
The gradients of its halo leaves go to the gradient store, those of the parameters and
of the input are summed. Every position of every node is computed twice in all (once
per pass), as with checkpointing, and never recomputed as another tile's halo.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._torch import add_each
from ..conv.settings import Autocast
from .halo import HaloStore
from .tiling import TilePlan


def crop(x: Tensor, box, dims: list[int] | None = None) -> Tensor:
    """View of the positions ``box`` (``(lo, hi)`` per spatial axis) of ``x``, whose
    spatial axes are ``dims`` (default: ``2, 3, ...``); ``x`` itself when the box is
    all of it (no view: its gradient needs no zero-padded copy)."""
    dims = dims or list(range(2, 2 + len(box)))
    if all(lo == 0 and hi == x.shape[d] for d, (lo, hi) in zip(dims, box)):
        return x
    index = [slice(None)] * x.dim()
    for d, (lo, hi) in zip(dims, box):
        index[d] = slice(lo, hi)
    return x[tuple(index)]


def seed(y: Tensor, grads: HaloStore, v: int, tile, ins: list) -> Tensor:
    """``y`` (node ``v``'s box at ``tile``), whose gradient receives the gradients later
    tiles sent to the box (``grads.seed_into``, on the thin slabs they cover, not a box
    of zeros) through a hook: no operation in the forward pass. An op that returned one
    of its inputs ``ins`` unchanged gets a view of it first, so that the hook adds to
    this node's gradient only."""
    if any(y is t for t in ins):
        y = y.view_as(y)

    def hook(g: Tensor) -> Tensor:
        g = g.clone()  # autograd may pass the same gradient to other nodes
        grads.seed_into(v, tile, g)
        return g

    y.register_hook(hook)
    return y


class TileRunner:
    """One pass's tiles: the plan, the input, the halo store, where tiles run and the
    autocast state they run under.

    Args:
        plan: the tiles.
        x: the input image (anywhere; crops go to ``device``).
        halo: the forward values' store.
        device: where tiles run (None: where ``x`` is).
        autocast: the ``torch.autocast`` state of the forward pass, for the tiles'
            device: each tile's forward pass and its recomputation run under it
            (:meth:`context`), wherever and whenever the backward pass runs. None:
            autocast off.

    Attributes:
        dtypes: ``{node: dtype}`` of the boxes computed so far (under autocast a node's
            dtype is the one its operation gives, not the input's), for the crops made
            of padding alone.
    """

    def __init__(
        self,
        plan: TilePlan,
        x: Tensor,
        halo: HaloStore,
        device=None,
        autocast: Autocast | None = None,
    ):
        self.plan = plan
        self.bound = plan.bound
        self.x = x
        self.halo = halo
        self.device = device
        device_type = torch.device(device).type if device is not None else x.device.type
        self.autocast = autocast if autocast is not None else Autocast(device_type, None)
        self.dtypes: dict[int, torch.dtype] = {}

    def context(self):
        """A ``torch.autocast`` block restoring the forward pass's autocast state (off
        when it was off, even inside a user's autocast block)."""
        return self.autocast.context()

    def to_tile(self, t: Tensor) -> Tensor:
        """``t`` on the tiles' device."""
        return t if self.device is None else t.to(self.device)

    def run(
        self,
        env,
        tile,
        *,
        write: bool,
        leaves: list | None = None,
        inputs: list | None = None,
        hold: frozenset = frozenset(),
        seeds: dict | None = None,
    ):
        """The boxes of this tile: ``{node: tensor}`` for the output and the nodes in
        ``hold`` (the others are dropped once the nodes that read them ran, as autograd
        keeps what it needs).

        Args:
            env: the static values.
            tile: the tile's index per axis.
            write: keep the halo positions in the store (the forward pass).
            leaves: where the backward pass collects the halo leaves it reads,
                ``(node, axis, box, tensor)``; None in the forward pass.
            inputs: where the backward pass collects the input crops it reads (as
                leaves), ``(box, tensor)``; None when no input gradient is wanted.
            hold: nodes whose boxes are returned.
            seeds: ``{node: gradient store}``: nodes whose boxes receive the gradients
                later tiles sent them, through :func:`seed` (the backward pass).
        """
        nodes = self.bound.nodes
        values: dict[int, Tensor | None] = {}
        remaining = [len(n.consumers) for n in nodes]
        for v in range(1, len(nodes)):
            node = nodes[v]
            needs = self.plan.needs(v, tile)
            if needs is None:
                values[v] = None
            else:
                ins = [self._assemble(u, tile, needs, values, leaves, inputs) for u in node.slots]
                own = self.plan.own(v, tile)
                if v in self.plan.in_place:  # eager's in-place form, where nothing else reads
                    y = node.op.run(env, ins, needs, own, True)
                else:
                    y = node.op.run(env, ins, needs, own)
                _check(node, y, own)
                self.dtypes[v] = y.dtype
                if seeds is not None and v in seeds and y.requires_grad:
                    # an in-place op's result is its input's tensor, which nothing else reads
                    y = seed(y, seeds[v], v, tile, [] if v in self.plan.in_place else ins)
                values[v] = y
                if write:
                    self.halo.write(v, tile, y)
            for u in dict.fromkeys(node.slots):  # free what no later node of this tile reads
                remaining[u] -= 1
                if remaining[u] == 0 and u not in hold:
                    values.pop(u, None)
        return values

    def _assemble(self, u, tile, needs, values, leaves, inputs) -> Tensor:
        """Node ``u``'s positions ``needs`` read: its box at this tile and, before it, the
        halo from the store."""
        box = tuple((n.lo, n.hi) for n in needs)
        if u == 0:
            piece = self.to_tile(crop(self.x, box))
            if inputs is not None:
                piece = piece.detach().requires_grad_()
                inputs.append((box, piece))
            return piece
        if any(lo == hi for lo, hi in box):  # all padding along an axis: none of it read
            node = self.bound.nodes[u]
            shape = list(node.shape)
            for a, (lo, hi) in enumerate(box):
                shape[node.dim(a)] = hi - lo
            dtype = self.dtypes.get(u, self.x.dtype)
            return self.to_tile(self.x.new_empty(shape, dtype=dtype))
        own = self.plan.own(u, tile)
        return self._block(u, tile, list(box), own, values.get(u), 0, leaves)

    def reads_box(self, v: int, tile) -> bool:
        """Whether a node reading ``v`` at ``tile`` reads part of ``v``'s own box (so that
        gradient flows back into it through this tile's graph)."""
        own = self.plan.own(v, tile)
        for c in self.bound.nodes[v].consumers:
            needs = self.plan.needs(c, tile)
            if needs is not None and all(n.hi > lo for n, (lo, _) in zip(needs, own)):
                return True
        return False

    def _block(self, u, tile, box, own, current, axis, leaves) -> Tensor:
        node = self.bound.nodes[u]
        if axis == len(box):
            return crop(
                current,
                [(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, own)],
                [node.dim(a) for a in range(len(box))],
            )
        lo, hi = box[axis]
        start = own[axis][0]
        parts = []
        if lo < start:  # the halo along this axis, kept by earlier tiles
            part = list(box)
            part[axis] = (lo, min(hi, start))
            piece = self.halo.read(u, axis, tile, part, view=leaves is not None)
            if leaves is not None:  # a view of a slab that takes no gradient: a leaf
                piece.requires_grad_()
                leaves.append((u, axis, tuple(part), piece))
            parts.append(piece)
        if hi > start:
            rest = list(box)
            rest[axis] = (max(lo, start), hi)
            parts.append(self._block(u, tile, rest, own, current, axis + 1, leaves))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=node.dim(axis))


def _libc_trim():
    """glibc's ``malloc_trim``, or None where there is none."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def release_freed_memory(device) -> None:
    """Give the memory finished tiles freed back to the system (glibc keeps freed blocks
    of the heap mapped, so the process's resident memory would grow with the tiles'
    varying sizes; ``malloc_trim`` returns them). A no-op off the CPU or off glibc."""
    if _TRIM is not None and (device is None or torch.device(device).type == "cpu"):
        _TRIM(0)


def _check(node, y: Tensor, own) -> None:
    """A tile's result has the box's extent (a modelling error raises, never streams
    wrong values)."""
    expected = list(node.shape)
    for a, (lo, hi) in enumerate(own):
        expected[node.dim(a)] = hi - lo
    if list(y.shape) != expected:
        raise RuntimeError(
            f"memconv.streaming: {node.label} computed a tile of shape {tuple(y.shape)}, "
            f"expected {tuple(expected)}; please report this trunk"
        )


def forward_pass(runner: TileRunner, env, progress=None) -> Tensor:
    """The output ``[N, C_out, *S_out]`` on the input's device, tile by tile (no
    autograd); the runner's halo store is filled for the backward pass."""
    plan, bound = runner.plan, runner.bound
    out = None
    tiles = plan.tiles()
    for tile in progress(tiles, "forward") if progress else tiles:
        y = runner.run(env, tile, write=True)[bound.output]
        if out is None:
            out = runner.x.new_empty(bound.output_shape(), dtype=y.dtype)
        crop(out, plan.output_range(tile)).copy_(y)
        del y
        if _row_done(plan, tile, reverse=False):
            release_freed_memory(runner.device or runner.x.device)
    return out


def _row_done(plan: TilePlan, tile, *, reverse: bool) -> bool:
    """Whether ``tile`` is the last of its row of tiles (along the first axis) in raster
    order, or in reverse raster order: the tiles of a row share their shapes, so the
    freed memory is given back once a row, not after every tile (``malloc_trim`` walks
    the whole heap)."""
    return all(k == (0 if reverse else a.count - 1) for a, k in zip(plan.axes[1:], tile[1:]))


def backward_pass(
    runner: TileRunner, make_env, grad: Tensor, params: list, want_input: bool, progress=None
):
    """``(input gradient or None, [gradient of each of params])``, tile by tile.

    Args:
        runner: the forward pass's runner (its halo store holds the forward values).
        make_env: ``make_env()``: the static values, computed under autograd.
        grad: the output gradient ``[N, C_out, *S_out]``.
        params: parameters to differentiate.
        want_input: compute the input gradient.
    """
    plan, bound = runner.plan, runner.bound
    grads_halo = HaloStore(plan, gradients=True)
    acc = [torch.zeros_like(p) for p in params]
    gx = torch.zeros_like(runner.x) if want_input else None
    tiles = plan.tiles()[::-1]
    for tile in progress(tiles, "backward") if progress else tiles:
        leaves: list = []
        inputs: list | None = [] if want_input else None
        with torch.enable_grad():
            env = make_env()
            reached = [v for v in range(1, len(bound.nodes)) if grads_halo.reaches(v, tile)]
            # gradients later tiles sent join on the way back, or, where nothing of this
            # tile reads the box, as outputs of their own
            alone = frozenset(v for v in reached if not runner.reads_box(v, tile))
            seeds = {v: grads_halo for v in reached if v not in alone}
            values = runner.run(
                env, tile, write=False, leaves=leaves, inputs=inputs, hold=alone, seeds=seeds
            )
            outs, seeds = [], []
            y = values[bound.output]
            if y is not None and y.requires_grad:
                outs.append(y)
                seeds.append(runner.to_tile(crop(grad, plan.output_range(tile))))
            for v in sorted(alone):
                value = values.get(v)
                if v == bound.output or value is None or not value.requires_grad:
                    continue
                outs.append(value)
                seeds.append(grads_halo.seed(v, tile, value))
            wrt = list(params) + [leaf[-1] for leaf in leaves] + [t for _, t in inputs or []]
            got = torch.autograd.grad(outs, wrt, seeds, allow_unused=True) if outs and wrt else ()
        del values, outs, seeds
        summed = [(a, g) for a, g in zip(acc, got[: len(params)]) if g is not None]
        add_each([a for a, _ in summed], [g for _, g in summed])  # one operation for all
        sent = [(*leaf[:3], g) for leaf, g in zip(leaves, got[len(params) :]) if g is not None]
        grads_halo.add(sent, tile)
        if want_input:
            for (box, _), g in zip(inputs, got[len(params) + len(leaves) :]):
                if g is not None:
                    crop(gx, box).add_(g.to(gx.device))
        del got, leaves, inputs, sent  # the tile's gradients, before the next tile
        grads_halo.release(tile)
        runner.halo.release(tile)
        if _row_done(plan, tile, reverse=True):
            release_freed_memory(runner.device or runner.x.device)
    return gx, acc


__all__ = ["TileRunner", "backward_pass", "crop", "forward_pass"]
