"""The private module: the model :func:`~memconv.integrations.opacus.make_private`
returns, whose backward pass adds memconv's clipped sum to ``.grad`` — the clipping
half of the DP step, without module hooks (noise, scaling and accounting stay with
Opacus' optimizer)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...tasks.clipping import clip_and_accumulate


def unwrap_parallel(module: nn.Module) -> nn.Module:
    """The module a ``DPDDP`` or ``DistributedDataParallel`` wraps (else itself)."""
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(module, DistributedDataParallel) or type(module).__name__ in (
        "DPDDP",
        "DifferentiallyPrivateDistributedDataParallel",
    ):
        module = module.module
    return module


def _linear_loss(output: Tensor, target: Tensor) -> Tensor:
    """``⟨output, target⟩``: with ``target`` sample n's output gradient, its gradient
    with respect to the parameters is sample n's loss gradient (exactly)."""
    return (output * target).sum()


class _ClipOnBackward(torch.autograd.Function):
    """Identity on the model's output; its backward hands the output gradient to
    :meth:`PrivateModule.clip`, which adds the clipped sum to ``.grad``."""

    @staticmethod
    def forward(ctx, wrapper, inputs, anchor, output):
        ctx.wrapper, ctx.inputs = wrapper, inputs
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.wrapper.clip(ctx.inputs, grad_output)
        return None, None, None, None


def _refuse_held_gradients(params: list[nn.Parameter]) -> None:
    """Raise if a parameter's ``.grad`` holds a previous backward pass's gradient.

    Raises:
        RuntimeError: naming the remedy (``optimizer.zero_grad()`` between steps).
    """
    held = [p.grad.ne(0).any() for p in params if p.grad is not None]
    if held and bool(torch.stack(held).any()):  # one device synchronisation
        raise RuntimeError(
            "memconv.integrations.opacus: .grad already holds a gradient before this "
            "backward pass; call optimizer.zero_grad() after each optimizer.step() "
            "(gradient accumulation over batches is not supported: each batch would "
            "be clipped on its own)"
        )


def _create_missing_grads(params: list[nn.Parameter]) -> None:
    """A zero ``.grad`` for every parameter the clipped sum did not reach, as Opacus'
    optimizer expects one on each of its parameters."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


class PrivateModule(nn.Module):
    """The model :func:`~memconv.integrations.opacus.make_private` returns: its forward
    runs the model, its backward adds the **clipped sum** Σₙ min(1, C/‖gₙ‖)·gₙ to every
    trainable parameter's ``.grad`` by :func:`memconv.clip_and_accumulate` (no module
    hook).

    In training mode with gradients enabled, ``forward(x)`` runs the model without
    keeping its graph and returns its output attached to a node whose backward
    receives ``∂L/∂output``; it then runs memconv's own pass on ``x`` with the
    per-sample loss ``⟨outputₙ, s·∂L/∂outputₙ⟩`` (``s`` = the batch size for
    ``loss_reduction="mean"``, 1 for ``"sum"``), whose parameter gradient is sample
    n's loss gradient exactly. Any criterion whose per-sample loss depends on that
    sample's output only works unchanged. In eval mode or without gradients the
    model runs as it is.

    Attributes not found on the wrapper are looked up on the wrapped model (as on
    Opacus' ``GradSampleModule``); ``_module`` is the wrapped model.

    Args:
        module: the model (or a ``DPDDP`` / ``DistributedDataParallel`` wrapping it).
        max_grad_norm: the threshold C, or ``{parameter name: threshold}`` with
            ``groups="parameter"``.
        loss_reduction: ``"mean"`` or ``"sum"``, the criterion's reduction.
        clip_options: ``strategy``, ``memory_budget``, ``norm_route``, ``clip_route``
            of :func:`memconv.clip_and_accumulate` (absent: its defaults).
        groups: ``groups`` of :func:`memconv.clip_and_accumulate`.
        adaptive: a :class:`memconv.AdaptiveClipping` state to clip with and count
            into, or None.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        max_grad_norm,
        loss_reduction: str,
        clip_options: dict,
        groups="all",
        adaptive=None,
    ):
        super().__init__()
        self._module = module
        self.max_grad_norm = (
            dict(max_grad_norm) if isinstance(max_grad_norm, dict) else float(max_grad_norm)
        )
        self.loss_reduction = loss_reduction
        self.batch_first = True
        self.clip_options = dict(clip_options)
        self.groups = groups
        #: the :class:`memconv.AdaptiveClipping` state shared with the optimizer, or None
        self.adaptive = adaptive
        self._anchor = torch.empty(0, requires_grad=True)
        #: per-sample norms before clipping of the last backward pass: ``[N]``, or
        #: ``{parameter name: [N]}`` with per-layer clipping
        self.last_norms: Tensor | dict | None = None

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_modules", {}).get("_module")
            if wrapped is None or name.startswith("__"):
                raise
            return getattr(wrapped, name)

    def forward(self, x, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self._module(x, *args, **kwargs)
        if args or kwargs or not isinstance(x, Tensor):
            raise TypeError(
                "memconv's private path runs the model on one input tensor [N, ...]: "
                f"got {1 + len(args)} positional and {len(kwargs)} keyword arguments"
            )
        with torch.no_grad():
            out = self._module(x)
        if not isinstance(out, Tensor):
            raise TypeError(
                "memconv's private path needs the model to return one tensor [N, ...], "
                f"got {type(out).__name__}"
            )
        return _ClipOnBackward.apply(self, x.detach(), self._anchor, out)

    def clip(self, inputs: Tensor, grad_output: Tensor) -> None:
        """Add the clipped sum of the samples of ``inputs`` to ``.grad``, the
        per-sample loss gradients given by the output gradient ``grad_output``.

        The step, as Opacus' ``DPOptimizer.pre_step`` reads: refuse a held gradient →
        the per-sample loss targets → the clipped sum (per-sample norms, clip factors,
        clipped sum by ``clip_route``, added to ``.grad``) → count the unclipped
        samples (adaptive clipping) → a zero ``.grad`` where none was made.

        Args:
            inputs: the model's input ``[N, ...]`` (detached).
            grad_output: ``∂L/∂output`` ``[N, ...]`` of the user's criterion.

        Raises:
            RuntimeError: if a trainable parameter's ``.grad`` holds a previous
                backward pass's gradient (accumulating batches would clip each batch
                on its own: call ``optimizer.zero_grad()`` between steps).
        """
        model = unwrap_parallel(self._module)
        params = [p for p in model.parameters() if p.requires_grad]
        _refuse_held_gradients(params)
        if len(inputs) == 0:  # an empty Poisson batch: a zero clipped sum
            self.last_norms = self._no_norms(inputs)
        else:
            targets = self._loss_targets(grad_output, len(inputs))
            self.last_norms = self._clipped_sum(model, inputs, targets)
            self._count_unclipped(self.last_norms)
        _create_missing_grads(params)

    def _loss_targets(self, grad_output: Tensor, n: int) -> Tensor:
        """Sample n's output gradient of its own loss: ``∂L/∂outputₙ`` times the batch
        size for ``loss_reduction="mean"`` (undoing the mean), as is for ``"sum"``."""
        scale = n if self.loss_reduction == "mean" else 1
        return grad_output.detach() * scale

    def _clipped_sum(self, model: nn.Module, inputs: Tensor, targets: Tensor):
        """Per-sample norms, clip factors and the clipped sum by route, added to
        ``.grad``: :func:`memconv.clip_and_accumulate` with the per-sample loss
        :func:`_linear_loss`, the threshold (the adaptive state's current one with
        adaptive clipping), the groups and the clip options.

        Returns:
            The per-sample norms before clipping: ``[N]``, or ``{group: [N]}``.
        """
        max_norm = self.adaptive.max_norm if self.adaptive is not None else self.max_grad_norm
        with torch.enable_grad():
            return clip_and_accumulate(
                model,
                _linear_loss,
                inputs,
                targets,
                max_norm=max_norm,
                groups=self.groups,
                **self.clip_options,
            )

    def _count_unclipped(self, norms) -> None:
        """Count the batch's unclipped samples into the adaptive state (if any)."""
        if self.adaptive is not None:
            self.adaptive.count(norms)

    def _no_norms(self, inputs: Tensor):
        """The norms of an empty batch: ``[0]``, or ``{parameter name: [0]}``."""
        empty = inputs.new_zeros(0)
        if isinstance(self.max_grad_norm, dict):
            return {k: empty for k in self.max_grad_norm}
        return empty

    # Opacus' GradSampleModule API used around a training loop
    def forbid_grad_accumulation(self):
        """Accumulation is always refused (see :meth:`clip`)."""

    def cleanup(self):
        """Nothing to remove: the path registers no hooks."""
