"""The private module: the model :func:`~memconv.integrations.opacus.make_private`
returns, whose backward pass adds memconv's clipped sum to ``.grad`` — the clipping
half of the DP step, without module hooks (noise, scaling and accounting stay with
Opacus' optimizer)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..._checks import check_sample_mask
from ...tasks.recorded import Clipping, Handoff


def unwrap_parallel(module: nn.Module) -> nn.Module:
    """The module a ``DPDDP`` or ``DistributedDataParallel`` wraps (else itself)."""
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(module, DistributedDataParallel) or type(module).__name__ in (
        "DPDDP",
        "DifferentiallyPrivateDistributedDataParallel",
    ):
        module = module.module
    return module


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


class _PrivateClipping(Clipping):
    """The clipping step of the private module: as :class:`memconv.tasks.recorded.Clipping`
    (norms → clip factors → clipped sum by route → ``.grad``), between a refusal of a
    ``.grad`` held from a previous step and, after it, the adaptive state's count of
    unclipped samples and a zero ``.grad`` where the sum reached none (Opacus' optimizer
    expects one on each parameter)."""

    def __init__(self, model, *, adaptive, **options):
        super().__init__(model, **options)
        self.adaptive = adaptive

    def _deliver(self, total, norms, sample_mask):
        params = list(self._prepared.trainable().values())
        _refuse_held_gradients(params)
        super()._deliver(total, norms, sample_mask)
        if self.adaptive is not None:
            self.adaptive.count(self.norms, self.sample_mask)
        _create_missing_grads(params)


class PrivateModule(nn.Module):
    """The model :func:`~memconv.integrations.opacus.make_private` returns: its forward
    is the model's, recorded; its backward adds the **clipped sum**
    Σₙ min(1, C/‖gₙ‖)·gₙ to every trainable parameter's ``.grad`` (no module hook).

    In training mode with gradients enabled, ``forward(x)`` runs the model on ``x`` with
    its calls recorded (:class:`memconv.tasks.recorded.Clipping`, the block of
    :func:`memconv.clipping` in its wrapper form) and returns the output attached to a
    node whose backward receives ``∂L/∂output``; from there memconv drives the model's
    own backward pass, each sample's loss being ``⟨outputₙ, s·∂L/∂outputₙ⟩`` (``s`` = the
    batch size for ``loss_reduction="mean"``, 1 for ``"sum"``), whose parameter gradient
    is sample n's loss gradient exactly. One forward and one backward pass; dropout
    and any other random layer keep what the forward pass drew. Any criterion whose
    per-sample loss depends on that sample's output only works unchanged. In eval mode
    or without gradients the model runs as it is.

    **Fixed shapes** (masked DP-SGD: Beltran et al. 2024, "Towards Efficient and Scalable
    Training of Differentially Private Deep Learning"): ``forward(x, sample_mask=mask)``
    with a ``torch.bool`` tensor ``[N]`` takes ``x`` as a Poisson batch padded to a fixed
    size N, ``mask`` True for its real samples (as
    :class:`~memconv.integrations.opacus.FixedSizePoissonLoader` yields them). The mask
    is a keyword of the call because it belongs to the batch, as the batch's targets
    do: no state to set and reset between steps, and a forward without it is an ordinary
    one. Opacus has no mask of its own (its batches have the Poisson size); the name is
    memconv's ``sample_mask``, the same in :func:`memconv.clip_and_accumulate`. The model
    runs on ``x`` with the padded rows replaced by zeros (``torch.where``: a NaN or inf
    there reaches nothing), the padded samples' output gradients are dropped, and their
    clip factors and norms (:attr:`last_norms`) are 0: ``.grad`` gets exactly the
    clipped sum of the real samples, as without padding. The criterion reduces all N
    rows as usual (``loss_reduction="mean"`` over the padded size too: memconv takes
    each row's own loss gradient back from it); the optimizer's noise and its division
    by the expected batch size, and the accountant's sampling rate, do not change.
    Adaptive clipping counts the real samples only. In eval mode or without gradients
    the mask is checked and the model runs on ``x`` as it is.

    The module interface is the wrapped model's, as on Opacus' ``GradSampleModule``:
    attributes not found on the wrapper are looked up on it, and ``state_dict`` and
    ``load_state_dict`` use its keys; ``_module`` is the wrapped model.

    Args:
        module: the model (or a ``DPDDP`` / ``DistributedDataParallel`` wrapping it: the
            recorded pass runs the module it wraps, the ranks' sums are Opacus'
            distributed optimizer's).
        max_grad_norm: the threshold C, or ``{parameter name: threshold}`` with
            ``groups="parameter"``.
        loss_reduction: ``"mean"`` or ``"sum"``, the criterion's reduction.
        clip_options: ``strategy``, ``memory_budget``, ``norm_route``, ``clip_route``
            (absent: the defaults; ``memory_budget`` bounds each layer's temporaries,
            an ``"available"`` budget the rules' defaults).
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
        options = dict(clip_options)
        if not isinstance(options.get("memory_budget"), int):
            options["memory_budget"] = None  # "available": the rules' defaults
        self._clipping = _PrivateClipping(
            unwrap_parallel(module),
            adaptive=adaptive,
            max_norm=self._threshold(),
            groups=groups,
            caller="memconv.integrations.opacus",
            loss_reduction=loss_reduction,
            **options,
        )
        self._anchor = torch.empty(0, requires_grad=True)

    @property
    def last_norms(self) -> Tensor | dict | None:
        """The per-sample norms before clipping of the last backward pass: ``[N]``, or
        ``{parameter name: [N]}`` with per-layer clipping (None before the first)."""
        return self._clipping.norms

    def _threshold(self):
        return self.adaptive.max_norm if self.adaptive is not None else self.max_grad_norm

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_modules", {}).get("_module")
            if wrapped is None or name.startswith("__"):
                raise
            return getattr(wrapped, name)

    def state_dict(self, *args, **kwargs):
        """The wrapped model's ``state_dict`` (its own keys)."""
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        """Load into the wrapped model (its own keys)."""
        return self._module.load_state_dict(state_dict, *args, **kwargs)

    def forward(self, x, *args, sample_mask: Tensor | None = None, **kwargs):
        """The model's output on ``x``; in training mode with gradients enabled, attached
        to the node whose backward adds the clipped sum to ``.grad``.

        Args:
            x: the batch ``[N, ...]``.
            sample_mask: None, or a ``torch.bool`` tensor ``[N]`` on ``x``'s device:
                False for the padding of a Poisson batch padded to a fixed size, which
                adds nothing to ``.grad`` and has norm 0 (masked DP-SGD, Beltran et al.
                2024; see the class docstring).

        Raises:
            TypeError: in training mode, other arguments than one tensor; a
                ``sample_mask`` not a tensor of dtype ``torch.bool``.
            ValueError: a ``sample_mask`` not ``[N]`` on ``x``'s device. Both before
                any work.
        """
        if sample_mask is not None:
            if not isinstance(x, Tensor):
                raise TypeError(
                    f"sample_mask needs the batch as one tensor [N, ...], got {type(x).__name__}"
                )
            check_sample_mask(sample_mask, len(x), x.device)
        if not (self.training and torch.is_grad_enabled()):
            return self._module(x, *args, **kwargs)
        if args or kwargs or not isinstance(x, Tensor):
            raise TypeError(
                "memconv's private path runs the model on one input tensor [N, ...]: "
                f"got {1 + len(args)} positional and {len(kwargs)} keyword arguments"
            )
        self._clipping.max_norm = self._threshold()
        if len(x) == 0:  # an empty Poisson batch: a zero clipped sum
            with torch.no_grad():
                out = unwrap_parallel(self._module)(x)
            return Handoff.apply(self._empty_step, self._anchor, out)
        return self._clipping.forward(x.detach(), sample_mask)

    def _empty_step(self, grad_output=None) -> None:
        params = [p for p in unwrap_parallel(self._module).parameters() if p.requires_grad]
        _refuse_held_gradients(params)
        empty = self._anchor.new_zeros(0)
        if isinstance(self.max_grad_norm, dict):
            self._clipping.norms = {k: empty for k in self.max_grad_norm}
        else:
            self._clipping.norms = empty
        _create_missing_grads(params)

    # Opacus' GradSampleModule API used around a training loop
    def forbid_grad_accumulation(self):
        """Accumulation is always refused (a ``.grad`` held from the last step)."""

    def cleanup(self):
        """Nothing to remove: the path registers no hooks."""
