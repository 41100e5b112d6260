"""Making a model trainable privately: :func:`fix` turns every BatchNorm layer into
GroupNorm, BatchNorm subclasses with their own forward included (Opacus'
``ModuleValidator.fix`` leaves those in place)."""

from __future__ import annotations

import copy
import math

from torch import nn


def fix(module: nn.Module, *, num_groups: int = 32) -> nn.Module:
    """A copy of ``module`` with every BatchNorm layer replaced by GroupNorm —
    including BatchNorm subclasses with their own forward (a norm + activation layer
    such as timm's ``BatchNormAct2d``), whose child modules (activation, dropout)
    follow the GroupNorm in their registration order.

    Opacus' ``ModuleValidator.fix`` finds fixers by exact type, so it leaves such
    subclasses in place (and ``make_private`` then refuses the model).

    Args:
        module: the model (not changed).
        num_groups: the GroupNorm's groups: ``gcd(num_groups, channels)`` (as Opacus).

    Returns:
        The converted copy; a layer with ``affine=False`` gets a GroupNorm without
        affine parameters.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``.
        ValueError: if ``num_groups`` is not a positive integer.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise ValueError(f"num_groups must be a positive integer, got {num_groups!r}")
    copied = copy.deepcopy(module)
    if isinstance(copied, nn.modules.batchnorm._BatchNorm):
        return _group_norm(copied, num_groups)
    _replace_batch_norms(copied, num_groups)
    return copied


def _group_norm(bn: nn.modules.batchnorm._BatchNorm, num_groups: int) -> nn.Module:
    """The GroupNorm taking ``bn``'s place (``gcd(num_groups, channels)`` groups, its
    ``eps``, affine parameters if ``bn`` has them, on their device and in their dtype),
    followed by ``bn``'s child modules if it has any."""
    c = bn.num_features
    gn = nn.GroupNorm(math.gcd(num_groups, c), c, eps=bn.eps, affine=bn.affine)
    if bn.affine:
        gn = gn.to(device=bn.weight.device, dtype=bn.weight.dtype)
    rest = list(bn.children())
    return nn.Sequential(gn, *rest) if rest else gn


def _replace_batch_norms(parent: nn.Module, num_groups: int) -> None:
    """Replace every BatchNorm layer below ``parent`` in place (a BatchNorm's own
    children go with it)."""
    for name, child in parent.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(parent, name, _group_norm(child, num_groups))
        else:
            _replace_batch_norms(child, num_groups)
