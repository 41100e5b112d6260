"""InvertibleModuleWrapper: a block whose input's memory is released once its output
exists, and restored from the output by the block's inverse in the backward pass
(Gomez et al., "The Reversible Residual Network", NeurIPS 2017, section 4; the API of
MemCNN, van de Leemput et al., JOSS 2019).

How the memory goes: an activation between two reversible blocks is kept by nobody.
The block that makes it keeps a detached alias in a :class:`_Slot` until the next
block's forward pass takes the slot over (and drops the alias); once the model's own
code moves on, no reference is left and the allocator frees the tensor, as it frees
any temporary. In the backward pass the later block reconstructs its input from its
own output with ``fn.inverse`` and puts it in the slot, where the earlier block finds
its output to reconstruct its own input in turn. A chain of blocks thus holds, at any
time, the activations of the block being differentiated only.

Nothing is emptied in place (MemCNN empties the input's storage with
``storage().resize_(0)`` and refills it): a tensor that other code also reads stays
alive and correct, only its memory is not saved (the backward pass warns), and the
wrapper's backward pass returns the parameters' gradients through autograd like any
Function, so ``torch.autograd.grad``, ``DistributedDataParallel``'s hooks and
memconv's per-sample passes see an ordinary graph.
"""

from __future__ import annotations

import inspect
import warnings
import weakref

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .._checks import (
    check_block_inputs,
    check_flag,
    check_invertible_module,
    check_module,
    check_positive_int,
    check_test_input_shape,
)
from .._torch import functorch_active, storage_ptr, storage_weakref
from ..modules import MEMCONV_CONV_TYPES
from .checks import current_report, errors, largest_relative, relative_tolerance
from .recompute import ForwardState, current_observer, frozen_buffers, observing, vjp

#: The attribute through which a block's output tells the next block its slot.
_SLOT = "_memconv_reversible_slot"


class _Slot:
    """An activation between two reversible blocks.

    Attributes:
        tensor: a detached alias of the activation while someone must keep it: the
            block that made it until a later block takes the slot over; then the later
            block's reconstruction, from its backward pass until the earlier block's
            backward pass has read it; else None.
        taken: whether a later block's forward pass took the slot over (and will
            reconstruct the activation in its backward passes).
        owner: a weak reference to the call of the block that made it.
    """

    __slots__ = ("owner", "taken", "tensor")

    def __init__(self, tensor: Tensor, owner: _BlockCall):
        self.tensor = tensor
        self.taken = False
        self.owner = weakref.ref(owner)


def _tuple(result, where: str) -> tuple:
    out = result if isinstance(result, tuple) else (result,)
    if not out or not all(isinstance(t, Tensor) for t in out):
        kinds = ", ".join(type(t).__name__ for t in out) or "nothing"
        raise TypeError(f"{where} must return a tensor or a tuple of tensors, got {kinds}")
    return out


class _BlockCall:
    """One call of a wrapper in one direction: what its backward pass needs, and what
    it holds (its output's slots, the slots it took over, the real inputs where kept).

    Attributes:
        run: the block in this direction (``fn`` or ``fn.inverse``).
        undo: its inverse.
        keep: keep the real inputs instead of reconstructing them.
        verify: first use of the wrapper: keep the real inputs, and check the first
            backward pass's reconstruction against them (each block on its own).
        report: the open :func:`memconv.reversible.check_reconstruction`'s report.
        token: what an observer (memconv's walk) gave the call, or None.
        state: the forward pass's :class:`memconv.reversible.recompute.ForwardState`.
    """

    def __init__(self, wrapper: InvertibleModuleWrapper, forward: bool, inputs: tuple, token):
        fn = wrapper._fn
        self.wrapper = wrapper
        self.direction = "" if forward else ".inverse"
        self.run_fn = fn if forward else fn.inverse
        self.undo_fn = fn.inverse if forward else fn
        self.keep = wrapper.keep_input if forward else wrapper.keep_input_inverse
        self.passes_allowed = wrapper.num_bwd_passes
        self.report = current_report()
        self.verify = not wrapper._verified and not self.keep and self.report is None
        self.token = token
        self.n = len(inputs)
        self.shapes = [(x.shape, x.dtype) for x in inputs]
        memconv_layers = any(isinstance(m, MEMCONV_CONV_TYPES) for m in fn.modules())
        self.state = ForwardState.capture(inputs, wrapper.preserve_rng_state, memconv_layers)
        self.params: tuple = ()
        self.kept: tuple | None = None
        self.taken: list = []
        self.alive: list = []
        self.out_slots: list[_Slot] = []
        self.passes = 0
        self.exhausted = False

    @property
    def name(self) -> str:
        fallback = f"{self.wrapper.where()}{self.direction}"
        return self.report.name(self.wrapper, fallback) if self.report else fallback

    # forward pass

    def forward(self, inputs: tuple, params: tuple) -> tuple:
        """The block's outputs; its inputs released."""
        self.params = params
        with torch.no_grad():
            outs = _tuple(self.run_fn(*[x.detach() for x in inputs]), f"{self.name}: fn")
        mine = {storage_ptr(x) for x in inputs}
        if not self.keep and any(storage_ptr(y) in mine for y in outs):
            raise ValueError(
                f"{self.name}: fn returns its input (or a view of it) as an output, so there is "
                "nothing to release; call that module without InvertibleModuleWrapper"
            )
        if self.keep or self.verify or self.report is not None:
            self.kept = tuple(x.detach() for x in inputs)
        for x in inputs:
            slot = getattr(x, _SLOT, None)
            if self.keep or slot is None or slot.taken or slot.tensor is None:
                self.taken.append(None)
                self.alive.append(None)
                continue
            slot.taken, slot.tensor = True, None  # this block reconstructs it from now on
            self.taken.append(slot)
            self.alive.append(storage_weakref(x))
            earlier = slot.owner()
            if earlier is not None:  # the model's code has moved on from its input by now
                earlier.warn_if_alive("when the next block ran")
        self.out_slots = [_Slot(y.detach(), self) for y in outs]
        return outs

    # backward pass

    def backward(self, grad_outputs: tuple, needs: tuple) -> tuple:
        """The gradients of the inputs and parameters (None for the parameters while
        an observer differentiates the block's layers itself)."""
        observed = self.token is not None and self.token.active
        if self.exhausted:
            raise RuntimeError(
                f"{self.name}: backward pass {self.passes + 1} through this reversible block, "
                f"which keeps its output for num_bwd_passes={self.passes_allowed} backward "
                f"passes (MemCNN's convention); pass num_bwd_passes={self.passes + 1} or more"
            )
        ys = tuple(slot.tensor for slot in self.out_slots)
        if any(y is None for y in ys):
            raise RuntimeError(
                f"{self.name}: its output was released when a later reversible block took it "
                "over, and that block's backward pass did not run before this one (a backward "
                "pass starting between the two blocks, from an output read elsewhere); pass "
                "keep_input=True to the later block"
            )
        needs_x, needs_p = needs[: self.n], needs[self.n :]
        try:
            if self.fused():
                return self.inverse_vjp(ys, grad_outputs, needs_x, needs_p, observed)
            xs = self.kept if self.keep else self.reconstructed(self.inverse(ys))
            if observed:
                xd = tuple(x.detach().requires_grad_(bool(n)) for x, n in zip(xs, needs_x))
                grads_x = self.token.recompute(lambda i: (self.run(i), ()), xd, grad_outputs, 0)
                return (*grads_x, *(None for _ in needs_p))
            return self.differentiate(xs, grad_outputs, needs_x, needs_p)
        finally:
            self.after(observed)

    def fused(self) -> bool:
        """Whether the block reconstructs and differentiates itself in one pass (a
        coupling, in the forward direction, with the input not kept)."""
        fn = self.wrapper._fn
        return not self.keep and self.run_fn is fn and callable(getattr(fn, "inverse_vjp", None))

    def run(self, inputs: tuple) -> tuple:
        """The block on ``inputs`` under the forward pass's state (random numbers,
        memconv blocks, autocast), its buffers left as they are; gradients as the
        caller's grad mode says."""
        with self.state.restored(self.wrapper._fn):
            return _tuple(self.run_fn(*inputs), f"{self.name}: fn")

    def inverse(self, ys: tuple) -> tuple:
        """``undo(*ys)``, without gradients, under the forward pass's state."""
        self.warn_if_alive()
        with torch.no_grad(), self.state.restored(self.wrapper._fn):
            return _tuple(self.undo_fn(*ys), f"{self.name}: fn's inverse")

    def inverse_vjp(self, ys: tuple, grad_outputs: tuple, needs_x, needs_p, observed) -> tuple:
        """The gradients by the block's own one-pass reconstruction and backward pass
        (:meth:`memconv.reversible.couplings._Coupling.inverse_vjp`), each part's
        differentiation the observer's when it observes the pass."""
        self.warn_if_alive()
        wanted = tuple(p for p, need in zip(self.params, needs_p) if need)
        differentiate = self.token.differentiate if observed else None
        with self.state.restored(self.wrapper._fn):
            fn = self.wrapper._fn
            x, grad_x, found = fn.inverse_vjp(ys[0], grad_outputs[0], wanted, differentiate)
        self.reconstructed((x,))
        found = iter(found)
        return (grad_x if needs_x[0] else None, *(next(found) if n else None for n in needs_p))

    def reconstructed(self, xs: tuple) -> tuple:
        """The reconstructed inputs checked (and reported), put into the slots taken
        over for the earlier blocks' backward passes; returns the inputs to use."""
        got = [(x.shape, x.dtype) for x in xs]
        if got != self.shapes:
            raise RuntimeError(
                f"{self.name}: fn's inverse returned {[(tuple(s), d) for s, d in got]} for "
                f"inputs {[(tuple(s), d) for s, d in self.shapes]}: it is not fn's inverse"
            )
        if self.report is not None:
            self.report.add(self.name, errors(xs, self.kept))
        if self.verify:
            self.check_inverse(xs)
            xs = self.kept  # the first pass judges each block on its own
        for slot, x in zip(self.taken, xs):
            if slot is not None:
                slot.tensor = x.detach()
        return xs

    def check_inverse(self, xs: tuple) -> None:
        """Raise if the first reconstruction is not the input (a wrong inverse, or
        random numbers the inverse does not draw alike); warn if it is the input up to
        more than round-off (an ill-conditioned inverse)."""
        rel, dtype = largest_relative(xs, self.kept)
        tol, wrong = relative_tolerance(dtype), relative_tolerance(dtype, wrong=True)
        if tol < rel <= wrong:
            warnings.warn(
                f"memconv.reversible: {self.name}: fn's inverse gives back its input up to "
                f"{rel:.1e} (relative; round-off is below {tol:.1e} in {dtype}), so the "
                "gradients through its reconstructed input are off by about as much: the "
                f"inverse amplifies round-off (an affine coupling's scale near zero?). "
                "Compute in float64, or pass keep_input=True to this block",
                stacklevel=2,
            )
        elif not rel <= wrong:
            raise ValueError(
                f"{self.name}: fn's inverse gives back its input up to {rel:.1e} (relative; "
                f"{wrong:.1e} accepted in {dtype}), so gradients through the reconstructed input "
                f"would be wrong: {type(self.wrapper._fn).__name__}.inverse is not its inverse. "
                "Fix the inverse; pass preserve_rng_state=True if the block draws random "
                "numbers; or keep_input=True (no memory saved) or disable=True"
            )
        self.wrapper._verified = True

    def warn_if_alive(self, when: str = "at its backward pass") -> None:
        """Warn, once per wrapper, when an input this block took over is still held by
        other code (checked when the next block runs, and at the backward pass): its
        memory was not released (the result is exact)."""
        if self.kept is not None or self.wrapper._warned:
            return
        if any(weak is not None and not weak.expired() for weak in self.alive):
            self.wrapper._warned = True
            warnings.warn(
                f"memconv.reversible: the input of block {self.name} was still held {when} "
                "(another layer read it and keeps it for its own backward pass, or a Python "
                "reference holds it), so its memory was not released; the gradients are "
                "exact. Let only this block read its input, or pass keep_input=True to keep "
                "it deliberately",
                stacklevel=3,
            )

    def differentiate(self, xs, grad_outputs, needs_x, needs_p) -> tuple:
        """The gradients of the inputs and parameters by autograd, on a recomputation."""
        xd = tuple(x.detach().requires_grad_(bool(need)) for x, need in zip(xs, needs_x))
        with torch.enable_grad(), observing(None):
            ys = self.run(xd)
        params = tuple(p if need else None for p, need in zip(self.params, needs_p))
        return vjp(ys, grad_outputs, xd + params)

    def after(self, observed: bool) -> None:
        """Release what the pass no longer needs: outputs taken over by a later block
        (it reconstructs them again), and after the last of ``num_bwd_passes`` passes
        (a walk's pass not counted) everything."""
        for slot in self.out_slots:
            if slot.taken:
                slot.tensor = None
        if observed:
            return
        self.passes += 1
        if self.passes >= self.passes_allowed:
            for slot in self.out_slots:
                slot.tensor = None
            self.kept = None
            self.exhausted = True


class _InvertibleFunction(torch.autograd.Function):
    """The autograd node of one :class:`_BlockCall`: its inputs are the block's inputs
    and its trainable parameters, so the parameters' gradients flow as any layer's."""

    @staticmethod
    def forward(ctx, call: _BlockCall, *inputs_and_params):
        ctx.call = call
        return call.forward(inputs_and_params[: call.n], inputs_and_params[call.n :])

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs):
        return (None, *ctx.call.backward(grad_outputs, ctx.needs_input_grad[1:]))


class InvertibleModuleWrapper(nn.Module):
    """Train an invertible module without keeping its input: the input's memory is
    released once the output exists, and the backward pass reconstructs it from the
    output by ``fn.inverse``, runs ``fn`` again and differentiates it. A chain of
    wrapped blocks holds the activations of one block at a time, whatever its depth
    (Gomez et al. 2017, section 4). MemCNN's class, arguments and semantics (version
    1.5.2), without its limits: ``torch.autograd.grad``, ``DistributedDataParallel``
    and memconv's per-sample passes (:func:`memconv.per_sample_grads`,
    :func:`memconv.per_sample_norms`, :func:`memconv.clip_and_accumulate`,
    :class:`memconv.PrivateStep`) run through it.

    Without gradients (``torch.no_grad``, inference), inside ``torch.func`` transforms,
    or with ``disable=True``, the wrapper calls ``fn`` and nothing else. The first
    backward pass of each wrapper checks the reconstruction against the real input
    (kept in that first step only) and raises ``ValueError`` if ``fn.inverse`` is not
    ``fn``'s inverse.

    Args:
        fn: a module with ``forward`` and ``inverse`` (``fn.inverse(fn(x)) == x``),
            positional tensors in, a tensor or a tuple of tensors out:
            :class:`memconv.reversible.AdditiveCoupling`,
            :class:`memconv.reversible.AffineCoupling`, or any such module.
        keep_input: keep the input in the forward direction (no memory saved, no
            inverse run).
        keep_input_inverse: the same for :meth:`inverse`.
        num_bwd_passes: backward passes the wrapper serves (``retain_graph=True``),
            after which it releases its output; a walk's own pass in memconv's
            per-sample functions does not count.
        disable: call ``fn`` as it is (no memory saved).
        preserve_rng_state: run the inverse and the recomputation with the random
            numbers of the forward pass (a block with dropout).

    Raises:
        TypeError: ``fn`` not a module; flags not bools; ``num_bwd_passes`` not an
            int; (each call unless ``disable``, before any work) ``fn`` without an
            ``inverse`` (MemCNN takes such a module too, and
            :func:`is_invertible_module` says False for it); (forward) arguments other
            than tensors, or ``fn`` returning something else.
        ValueError: ``num_bwd_passes`` not positive; (forward, input not kept) ``fn``
            returning its input; (first backward pass) ``fn.inverse`` not ``fn``'s
            inverse (one that only amplifies round-off warns).
        RuntimeError: (backward) more backward passes than ``num_bwd_passes``; a
            higher-order gradient through the block.

    Example:
        >>> from memconv.reversible import AdditiveCoupling, InvertibleModuleWrapper
        >>> block = InvertibleModuleWrapper(AdditiveCoupling(Fm=nn.Sequential(
        ...     nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU())))
        >>> y = block(x)              # x [N, 32, H, W]: x's memory can go
    """

    def __init__(
        self,
        fn: nn.Module,
        keep_input: bool = False,
        keep_input_inverse: bool = False,
        num_bwd_passes: int = 1,
        disable: bool = False,
        preserve_rng_state: bool = False,
    ):
        super().__init__()
        check_module(fn, "fn")  # its inverse is checked at each call (MemCNN takes any module)
        check_positive_int(num_bwd_passes, "num_bwd_passes", none=False)
        self._fn = fn
        self.num_bwd_passes = num_bwd_passes
        flags = {
            "keep_input": keep_input,
            "keep_input_inverse": keep_input_inverse,
            "disable": disable,
            "preserve_rng_state": preserve_rng_state,
        }
        for argument, value in flags.items():
            check_flag(value, argument)
            setattr(self, argument, value)
        self._verified = False
        self._warned = False
        self._where: str | None = None  # the block's path, once looked for

    def forward(self, *xin: Tensor):
        """``fn(*xin)``, its inputs released (see the class). Returns a tensor for one
        output, else the tuple."""
        return self._call(xin, forward=True)

    def inverse(self, *yin: Tensor):
        """``fn.inverse(*yin)``, its inputs released (``keep_input_inverse``)."""
        return self._call(yin, forward=False)

    def where(self) -> str:
        """The block's path in the outermost module whose forward pass first called it
        (for messages), or its type."""
        return self._where or f"InvertibleModuleWrapper({type(self._fn).__name__})"

    def _call(self, xin: tuple, forward: bool):
        fn = self._fn
        if not self.disable:
            check_invertible_module(fn, "fn")
        params = tuple(p for p in fn.parameters() if p.requires_grad)
        wanted = any(x.requires_grad for x in xin if isinstance(x, Tensor)) or params
        if self.disable or not torch.is_grad_enabled() or functorch_active() or not wanted:
            out = fn(*xin) if forward else fn.inverse(*xin)
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out
        check_block_inputs(xin, f"InvertibleModuleWrapper({type(fn).__name__})")
        if self._where is None:  # looked for once ("": not found, the type names it)
            self._where = _locate(self) or ""
        observer = current_observer()
        token = observer.enter(self, fn) if observer is not None else None
        call = _BlockCall(self, forward, xin, token)
        outs = _InvertibleFunction.apply(call, *xin, *params)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for y, slot in zip(outs, call.out_slots):
            setattr(y, _SLOT, slot)
            y.retain_grad()  # MemCNN's outputs get their .grad, kept while the caller holds them
        if token is not None:
            observer.leave(token, outs)
        return outs[0] if len(outs) == 1 else outs


def _locate(block: nn.Module, frames: int = 64) -> str | None:
    """``block``'s path in the outermost module whose ``forward`` is on the call stack
    and holds it (read once per wrapper, for messages).

    The walk starts at the caller's frame: reading this function's own frame's locals
    would make a cycle (the frame, its locals, the frame) that keeps the callers'
    locals — the blocks' inputs — alive until the garbage collector runs."""
    owners = []
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None
    del here
    while frame is not None and len(owners) < frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and owner is not block:
            owners.append(owner)
        frame = frame.f_back
    del frame
    for owner in reversed(owners):
        for name, m in owner.named_modules():
            if m is block:
                return name or type(owner).__name__
    return None


def is_invertible_module(
    module_in: nn.Module,
    test_input_shape,
    test_input_dtype: torch.dtype = torch.float32,
    atol: float = 1e-6,
    random_seed: int = 42,
) -> bool:
    """Whether ``module_in.inverse`` inverts ``module_in`` on random inputs (MemCNN's
    ``is_invertible_module``, same arguments, same answers and warnings):
    ``inverse(forward(x)) ≈ x`` and ``forward(inverse(y)) ≈ y`` by
    ``torch.allclose(..., atol=atol)``, for ``x`` uniform in [0, 1).

    It warns (``UserWarning``, as MemCNN) when an input or output is all zeros, when
    outputs are the same tensor, or when an output is an input (an identity: nothing
    for :class:`InvertibleModuleWrapper` to release). The module's buffers are left as
    they were (BatchNorm's running statistics); the global random generator is not
    touched (a generator of its own is seeded with ``random_seed``, which draws the
    inputs MemCNN's seeded global generator draws).

    Args:
        module_in: a module, or an :class:`InvertibleModuleWrapper` (its ``fn`` is
            tested).
        test_input_shape: the shape of the input, or a tuple of shapes for several.
        test_input_dtype: the inputs' dtype.
        atol: the absolute tolerance (``torch.allclose``'s relative one too).
        random_seed: the seed of the inputs.

    Returns:
        False for a module without ``inverse`` or one that does not invert.

    Raises:
        ValueError: ``test_input_shape`` neither a tuple of ints nor of such tuples.
    """
    if isinstance(module_in, InvertibleModuleWrapper):
        module_in = module_in._fn
    if not callable(getattr(module_in, "inverse", None)):
        return False
    shapes = check_test_input_shape(test_input_shape)
    generator = torch.Generator().manual_seed(random_seed)
    xs = tuple(torch.rand(s, generator=generator, dtype=test_input_dtype) for s in shapes)

    def close(a: tuple, b: tuple) -> bool:
        return all(torch.allclose(u, v, atol=atol) for u, v in zip(a, b))

    def warn_if_zero(tensors: tuple, what: str) -> None:
        if any(not t.any() for t in tensors):
            warnings.warn(
                f"is_invertible_module: some {what} are all zeros; pass another random_seed",
                stacklevel=3,
            )

    with torch.no_grad(), frozen_buffers(module_in):
        warn_if_zero(xs, "inputs")
        if not close(_tuple(module_in.inverse(*_tuple(module_in(*xs), "module_in")), ""), xs):
            return False
        ys = _tuple(module_in(*xs), "module_in")
        warn_if_zero(ys, "outputs")
        if not close(_tuple(module_in(*_tuple(module_in.inverse(*ys), "inverse")), ""), ys):
            return False
        reconstructed = _tuple(module_in.inverse(*ys), "module_in.inverse")
    _warn_if_shared(xs, ys, "forward")
    _warn_if_shared(reconstructed, ys, "inverse")
    return True


def _warn_if_shared(xs: tuple, ys: tuple, direction: str) -> None:
    """MemCNN's warnings on tensors shared among a module's inputs and outputs."""
    ids_x, ids_y = {id(t) for t in xs}, {id(t) for t in ys}
    if len(ids_x) != len(xs):
        warnings.warn(
            f"is_invertible_module: some inputs (*x) are the same tensor ({direction})",
            stacklevel=3,
        )
    if len(ids_y) != len(ys):
        warnings.warn(
            f"is_invertible_module: some outputs (*y) are the same tensor ({direction})",
            stacklevel=3,
        )
    if ids_x & ids_y:
        warnings.warn(
            f"is_invertible_module: an output (*y) is an input (*x) ({direction}), an identity: "
            "InvertibleModuleWrapper has nothing to release for it and refuses it unless "
            "keep_input=True",
            stacklevel=3,
        )
