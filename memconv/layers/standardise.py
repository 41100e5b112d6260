"""Weight standardisation per output channel: a parameter reached through a known map.

timm's ``StdConv2d`` / ``ScaledStdConv2d`` (Brock et al. 2021, "Characterizing signal
propagation to close the performance gap in unnormalized ResNets", the NF-ResNets)
standardise their weight in the forward pass (Qiao et al. 2019, "Weight
Standardization") as

    w' = reshape(F.batch_norm(w.reshape(1, C, K), None, None, weight=γ, bias=None,
                              training=True, eps=eps), w.shape)

so that per output channel ``c`` (its ``K`` entries: ``C_in/G·k`` for a convolution)
``w'_c = γ_c·ŵ_c``, ``ŵ_c = (w_c − μ_c)/σ_c``, ``σ_c = sqrt(var_c + eps)`` (the biased
variance). The Jacobian of that map is

    J_cᵀ g = (γ_c/σ_c)·(g − (⟨g,1⟩/K)·1 − (⟨g,ŵ_c⟩/K)·ŵ_c),

so the per-sample gradient ``g_n`` of ``w'`` (the operation's weight slot) gives the
per-sample gradient of ``w`` elementwise, without autograd, and its squared norm per
channel from three numbers:

    ‖J_cᵀ g‖² = (γ_c/σ_c)²·(‖g‖² − ⟨g,1⟩²/K − ⟨g,ŵ⟩²·(2/K − ‖ŵ‖²/K²)
                             + 2⟨g,1⟩⟨g,ŵ⟩⟨1,ŵ⟩/K²)

(``‖ŵ‖² = K·var/(var + eps)``: eps kept; ``⟨1,ŵ⟩`` is zero up to round-off, kept too).
The gain's per-sample gradient is ``⟨g_c, ŵ_c⟩`` per channel, chained to whatever
``γ`` is computed from by its own (small) vjp.

:func:`trace` recognises the map, one operation at a time, as
:class:`memconv.engine.recorder.OpRecorder` follows parameter-only tensors; only the exact
pattern above is recognised (anything else keeps the generic chain through the
autograd graph, exact and slower), and a tensor modified in place since
(its version counter) is not trusted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._torch import version as _version
from ..conv.contract import contract
from .norm import BATCH_NORM_ARGS, BATCH_NORM_DEFAULTS
from .operations import bind_args


@dataclass(frozen=True)
class Flat:
    """A trainable parameter ``w`` seen as ``[1, C, K]`` (C = ``w.shape[0]``).

    Attributes:
        weight: the parameter.
        versions: ``((tensor, version counter), ...)`` of the tensors the recipe reads.
    """

    weight: Tensor
    versions: tuple


@dataclass(frozen=True)
class Standardised:
    """``w' = γ·ŵ`` per output channel (see the module docstring).

    Attributes:
        weight: the parameter ``w`` ``[C, ...]``.
        gain: ``γ`` ``[C]``, a parameter-only tensor (with its graph), or None.
        eps: the standardisation's epsilon.
        shaped: whether the tensor has ``w``'s shape (else ``[1, C, K]``).
        versions: ``((tensor, version counter), ...)`` of the tensors the recipe reads.
    """

    weight: Tensor
    gain: Tensor | None
    eps: float
    shaped: bool
    versions: tuple

    def intact(self) -> bool:
        """Whether no tensor the recipe reads was modified in place since."""
        return _intact(self.versions)

    def form(self) -> Form:
        """The :class:`Form` of the map at the parameter's current value (detached), by
        the forward pass's own kernel (``torch.native_batch_norm``: ``ŵ`` and ``1/σ``)."""
        with torch.no_grad():
            w = self.weight
            flat = w.reshape(1, w.shape[0], -1)
            w_hat, _, inv = torch.native_batch_norm(
                flat, None, None, None, None, True, 0.0, self.eps
            )
            w_hat = w_hat.view(w_hat.shape[1:])
            scale = inv
            if self.gain is not None:
                gain = self.gain if self.gain.dtype == w.dtype else self.gain.to(w.dtype)
                scale = gain * inv
            norm = (1 - self.eps * inv.square()) * w_hat.shape[1]  # K·var/(var + eps)
            return Form(w_hat, scale, norm, w_hat.sum(1))


class Form(NamedTuple):
    """What the closed form needs of ``w' = γ·ŵ``, per output channel.

    Attributes:
        w_hat: ``ŵ`` ``[C, K]``.
        scale: ``γ/σ`` ``[C]``.
        norm: ``‖ŵ_c‖²`` ``[C]`` (``K·var/(var + eps)``).
        total: ``⟨1, ŵ_c⟩`` ``[C]`` (zero up to round-off).
    """

    w_hat: Tensor
    scale: Tensor
    norm: Tensor
    total: Tensor


def _intact(versions: tuple) -> bool:
    return all(v is not None and _version(t) == v for t, v in versions)


#: The reshapes that keep the logical (row-major) order of the elements.
_RESHAPES = frozenset(
    {Tensor.reshape, Tensor.view, Tensor.reshape_as, Tensor.view_as, torch.reshape}
)


def trace(
    func, args: tuple, kwargs: dict, out, recipe: Callable, parameter: Callable, depends: Callable
):
    """The recipe (:class:`Flat` or :class:`Standardised`) of the output of one call on
    parameter-only tensors, or None if it is not a step of the recognised map.

    Args:
        func, args, kwargs: the call.
        out: its output.
        recipe: ``recipe(t)``: the recipe of a parameter-only tensor, or None.
        parameter: ``parameter(t)``: whether ``t`` is a trainable parameter itself.
        depends: ``depends(t)``: ids of the trainable parameters ``t`` depends on.
    """
    if not isinstance(out, Tensor):
        return None
    if func in _RESHAPES:
        if not args or not isinstance(args[0], Tensor) or out.dtype != args[0].dtype:
            return None
        source = args[0]
        if parameter(source):
            k = math.prod(source.shape[1:])
            if source.dim() >= 2 and k > 1 and tuple(out.shape) == (1, source.shape[0], k):
                return Flat(source, ((source, _version(source)),))
            return None
        r = recipe(source)
        if isinstance(r, Standardised) and not r.shaped and r.intact():
            if out.shape == r.weight.shape:
                versions = (*r.versions, (out, _version(out)))
                return Standardised(r.weight, r.gain, r.eps, True, versions)
        return None
    if func is F.batch_norm:
        return _trace_batch_norm(args, kwargs, out, recipe, depends)
    return None


def _trace_batch_norm(args, kwargs, out, recipe, depends):
    a = bind_args(BATCH_NORM_ARGS, args, kwargs, BATCH_NORM_DEFAULTS, tensors=())
    if a is None or a["running_mean"] is not None or a["running_var"] is not None:
        return None
    if a["training"] is not True or a["bias"] is not None:
        return None
    eps = a["eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        return None
    r = recipe(a["input"])
    if not isinstance(r, Flat) or not _intact(r.versions):
        return None
    w, gain = r.weight, a["weight"]
    if out.shape != a["input"].shape or out.dtype != w.dtype:
        return None
    versions = (*r.versions, (out, _version(out)))
    if gain is not None:
        if not isinstance(gain, Tensor) or tuple(gain.shape) != (w.shape[0],):
            return None
        if id(w) in depends(gain):  # the gain computed from the weight itself
            return None
        versions = (*versions, (gain, _version(gain)))
    return Standardised(w, gain, float(eps), False, versions)


# ----------------------------------------------------------------- the maths
def weight_sq_norms(stats: tuple[Tensor, Tensor, Tensor], form: Form) -> Tensor:
    """Squared per-sample norms ``[n]`` of the parameter's gradients ``J_fᵀ g_n``
    (summed over channels in float64, the terms cancelling).

    Args:
        stats: :func:`memconv.conv.norm_routes.grad_channel_stats` ``(‖g_c‖², ⟨g_c,1⟩, ⟨g_c,ŵ_c⟩)`` ``[n, C]``.
        form: the map's :class:`Form`.
    """
    sq, ones, hat = (t.double() for t in stats)
    k = form.w_hat.shape[1]
    norm, total = form.norm.double(), form.total.double()
    out = sq - ones.square() / k - hat.square() * (2 / k - norm / k**2)
    out = out + 2 * ones * hat * total / k**2
    return (out * form.scale.double().square()).sum(1).clamp_min(0).to(stats[0].dtype)


def weight_grads(grads: Tensor, form: Form) -> tuple[Tensor, Tensor]:
    """``(J_fᵀ g_n [n, *w.shape], ⟨g_n,c, ŵ_c⟩ [n, C])`` of per-sample gradients
    ``grads`` ``[n, *w.shape]`` of ``w'``."""
    n, c = grads.shape[0], form.w_hat.shape[0]
    g = grads.reshape(n, c, -1).to(form.w_hat.dtype)
    k = g.shape[-1]
    hat = contract("nck,ck->nc", g, form.w_hat)
    # one new [n, C, K] tensor, the rest in place (book-keeping keeps these results)
    out = g - g.sum(-1, keepdim=True) / k
    out.addcmul_((hat / k)[..., None], form.w_hat, value=-1)
    return out.mul_(form.scale[:, None]).reshape(grads.shape), hat
