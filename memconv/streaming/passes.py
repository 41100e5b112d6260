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
from .tileio import DIRECT, DirectIO, crop
from .tiling import TilePlan


def seed(y: Tensor, runner: TileRunner, v: int, tile, ins: list, io: DirectIO) -> Tensor:
    """``y`` (node ``v``'s box at ``tile``), whose gradient receives the gradients later
    tiles sent to the box (``io.sent``: on the thin slabs they cover, not a box of
    zeros) through a hook: no operation in the forward pass. An op that returned one
    of its inputs ``ins`` unchanged gets a view of it first, so that the hook adds to
    this node's gradient only."""
    if any(y is t for t in ins):
        y = y.view_as(y)

    def hook(g: Tensor) -> Tensor:
        g = g.clone()  # autograd may pass the same gradient to other nodes
        for index, piece in io.sent(runner, v, tile):
            g[index].add_(piece)
        return g

    y.register_hook(hook)
    return y


def sent_gradient(runner: TileRunner, v: int, tile, like: Tensor, io: DirectIO) -> Tensor:
    """The gradient later tiles sent to node ``v``'s box at ``tile``, as a tensor like
    the box's."""
    out = torch.zeros_like(like)
    for index, piece in io.sent(runner, v, tile):
        out[index].add_(piece)
    return out


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
        #: the backward pass's store of the gradients later tiles sent
        self.grads: HaloStore | None = None
        #: what a compiled pass's graphs of this runner's tiles depend on besides them
        self.key: tuple = ()

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
        seeds: frozenset = frozenset(),
        io: DirectIO = DIRECT,
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
            seeds: nodes whose boxes receive the gradients later tiles sent them,
                through :func:`seed` (the backward pass).
            io: the tile's reads and writes of the image and the stores
                (:mod:`memconv.streaming.tileio`).
        """
        nodes = self.bound.nodes
        values: dict[int, Tensor | None] = {}
        remaining = [len(n.consumers) for n in nodes]
        for v in range(1, len(nodes)):
            node = nodes[v]
            needs = self.plan.needs(v, tile)
            if needs is None:
                values[v] = None
                io.structure(v, None)
            else:
                own = self.plan.own(v, tile)
                io.structure(
                    v,
                    tuple((n.hi - n.lo, n.pad_lo, n.pad_hi, n.skip) for n in needs),
                    tuple(hi - lo for lo, hi in own),
                )
                ins = [
                    self._assemble(u, tile, needs, values, leaves, inputs, io) for u in node.slots
                ]
                if v in self.plan.in_place:  # eager's in-place form, where nothing else reads
                    y = node.op.run(env, ins, needs, own, True)
                else:
                    y = node.op.run(env, ins, needs, own)
                _check(node, y, own)
                self.dtypes[v] = y.dtype
                if v in seeds and y.requires_grad:
                    # an in-place op's result is its input's tensor, which nothing else reads
                    y = seed(y, self, v, tile, [] if v in self.plan.in_place else ins, io)
                values[v] = y
                if write:
                    io.write(self, v, tile, y)
            for u in dict.fromkeys(node.slots):  # free what no later node of this tile reads
                remaining[u] -= 1
                if remaining[u] == 0 and u not in hold:
                    values.pop(u, None)
        return values

    def _assemble(self, u, tile, needs, values, leaves, inputs, io) -> Tensor:
        """Node ``u``'s positions ``needs`` read: its box at this tile and, before it, the
        halo from the store."""
        box = tuple((n.lo, n.hi) for n in needs)
        if u == 0:
            piece = io.image(self, box)
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
        return self._block(u, tile, list(box), own, values.get(u), 0, leaves, io)

    def reads_box(self, v: int, tile) -> bool:
        """Whether a node reading ``v`` at ``tile`` reads part of ``v``'s own box (so that
        gradient flows back into it through this tile's graph)."""
        own = self.plan.own(v, tile)
        for c in self.bound.nodes[v].consumers:
            needs = self.plan.needs(c, tile)
            if needs is not None and all(n.hi > lo for n, (lo, _) in zip(needs, own)):
                return True
        return False

    def _block(self, u, tile, box, own, current, axis, leaves, io) -> Tensor:
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
            piece = io.halo(self, u, axis, tile, part, leaves is not None)
            if leaves is not None:  # a view of a slab that takes no gradient: a leaf
                piece.requires_grad_()
                leaves.append((u, axis, tuple(part), piece))
            parts.append(piece)
        if hi > start:
            rest = list(box)
            rest[axis] = (max(lo, start), hi)
            parts.append(self._block(u, tile, rest, own, current, axis + 1, leaves, io))
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


class EagerTiles:
    """Runs each tile's body as it is (the eager path); :class:`memconv.streaming.
    compiled.CompiledTiles` runs it as compiled graphs instead."""

    def run(self, runner: TileRunner, tile, body, grad: Tensor | None = None):
        """``body(io, fresh)``: the tile's tensors and what the pass keeps of it, run
        with the stores read directly and the pass's static values (``fresh``:
        compute them anew, inside a traced graph)."""
        return body(DIRECT, False)


EAGER = EagerTiles()


def forward_pass(runner: TileRunner, make_env, progress=None, tiles_by=EAGER) -> Tensor:
    """The output ``[N, C_out, *S_out]`` on the input's device, tile by tile (no
    autograd); the runner's halo store is filled for the backward pass.

    Args:
        runner: the pass's tiles, input and halo store.
        make_env: ``make_env()``: the static values (computed once; inside each
            traced tile's graph for compiled tiles).
        progress: ``progress(tiles, description)``: an iterable over the tiles.
        tiles_by: what runs each tile (:class:`EagerTiles`, or compiled graphs).
    """
    plan, bound = runner.plan, runner.bound
    out = None
    shared: list = []

    def env(fresh: bool):
        if fresh:
            return make_env()
        if not shared:
            shared.append(make_env())
        return shared[0]

    tiles = plan.tiles()
    for tile in progress(tiles, "forward") if progress else tiles:

        def body(io, fresh, tile=tile):
            y = runner.run(env(fresh), tile, write=True, io=io)[bound.output]
            return [y], dict(runner.dtypes)

        (y,), dtypes = tiles_by.run(runner, tile, body)
        runner.dtypes.update(dtypes)
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
    runner: TileRunner,
    make_env,
    grad: Tensor,
    params: list,
    want_input: bool,
    progress=None,
    tiles_by=EAGER,
):
    """``(input gradient or None, [gradient of each of params])``, tile by tile.

    Args:
        runner: the forward pass's runner (its halo store holds the forward values).
        make_env: ``make_env()``: the static values, computed under autograd.
        grad: the output gradient ``[N, C_out, *S_out]``.
        params: parameters to differentiate.
        want_input: compute the input gradient.
        progress: ``progress(tiles, description)``: an iterable over the tiles.
        tiles_by: what runs each tile (:class:`EagerTiles`, or compiled graphs).
    """
    plan = runner.plan
    runner.grads = HaloStore(plan, gradients=True)
    acc = [torch.zeros_like(p) for p in params]
    gx = torch.zeros_like(runner.x) if want_input else None
    tiles = plan.tiles()[::-1]
    for tile in progress(tiles, "backward") if progress else tiles:

        def body(io, fresh, tile=tile):
            return _tile_gradients(runner, make_env, grad, params, want_input, tile, io)

        got, (leaf_parts, boxes) = tiles_by.run(runner, tile, body, grad)
        summed = [(a, g) for a, g in zip(acc, got[: len(params)]) if g is not None]
        add_each([a for a, _ in summed], [g for _, g in summed])  # one operation for all
        grads = got[len(params) :]
        sent = [(*part, g) for part, g in zip(leaf_parts, grads) if g is not None]
        runner.grads.add(sent, tile)
        if want_input:
            for box, g in zip(boxes, grads[len(leaf_parts) :]):
                if g is not None:
                    crop(gx, box).add_(g.to(gx.device))
        del got, grads, sent  # the tile's gradients, before the next tile
        runner.grads.release(tile)
        runner.halo.release(tile)
        if _row_done(plan, tile, reverse=True):
            release_freed_memory(runner.device or runner.x.device)
    grads, runner.grads = runner.grads, None
    del grads
    return gx, acc


def _tile_gradients(runner: TileRunner, make_env, grad, params, want_input, tile, io):
    """One tile's backward pass: its boxes recomputed with autograd (the halo it reads
    as leaves), one ``torch.autograd.grad`` from its part of the output gradient and
    the gradients later tiles sent.

    Returns:
        ``(gradients, (halo parts, input boxes))``: the gradients of ``params``, of the
        halo leaves and of the input crops read (None where nothing flowed), and where
        those leaves and crops are.
    """
    plan, bound = runner.plan, runner.bound
    store = runner.grads
    leaves: list = []
    inputs: list | None = [] if want_input else None
    with torch.enable_grad():
        env = make_env()
        reached = [v for v in range(1, len(bound.nodes)) if store.reaches(v, tile)]
        # gradients later tiles sent join on the way back, or, where nothing of this
        # tile reads the box, as outputs of their own
        alone = frozenset(v for v in reached if not runner.reads_box(v, tile))
        io.structure("reached", tuple(reached), tuple(sorted(alone)))
        values = runner.run(
            env,
            tile,
            write=False,
            leaves=leaves,
            inputs=inputs,
            hold=alone,
            seeds=frozenset(reached) - alone,
            io=io,
        )
        outs, seeds = [], []
        y = values[bound.output]
        if y is not None and y.requires_grad:
            outs.append(y)
            seeds.append(io.grad(runner, grad, plan.output_range(tile)))
        for v in sorted(alone):
            value = values.get(v)
            if v == bound.output or value is None or not value.requires_grad:
                continue
            outs.append(value)
            seeds.append(sent_gradient(runner, v, tile, value, io))
        wrt = list(params) + [leaf[-1] for leaf in leaves] + [t for _, t in inputs or []]
        if outs and wrt:
            got = list(torch.autograd.grad(outs, wrt, seeds, allow_unused=True))
        else:
            got = [None] * len(wrt)
    return got, ([leaf[:3] for leaf in leaves], [box for box, _ in inputs or []])


__all__ = ["EAGER", "EagerTiles", "TileRunner", "backward_pass", "crop", "forward_pass"]
