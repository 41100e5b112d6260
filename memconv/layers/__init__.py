"""Layer rules: what memconv knows about each kind of layer, one file per family.

Every whole-model computation (:func:`memconv.per_sample_grads`,
:func:`memconv.per_sample_norms`, :func:`memconv.clip_and_accumulate`,
:func:`memconv.plan`), the extended modules and the integrations ask this registry
how to treat a layer. A rule is a :class:`LayerRule` subclass registered for layer
types with :func:`register`; it must implement ``grad_sample(module, inputs,
grad_output)`` and may add leaner squared norms, the summed gradient for DP-SGD's
book-keeping and a memory model. Rules are found by exact type
(:func:`find_rule`); every other parametrised layer takes the exact generic route
(:mod:`memconv.engine.generic`: ``torch.func``).

Operations (``F.conv2d``, ``F.linear``, ``F.layer_norm``, ... whatever module calls
them, on parameters or functions of parameters alone) are served by the same rules
through :mod:`~memconv.layers.operations`.

Families: :mod:`~memconv.layers.conv` (convolutions, transposed convolutions),
:mod:`~memconv.layers.linear`, :mod:`~memconv.layers.norm` (GroupNorm, LayerNorm,
RMSNorm, InstanceNorm, BatchNorm in eval mode), :mod:`~memconv.layers.embedding`,
:mod:`~memconv.layers.prelu`, :mod:`~memconv.layers.elementwise` (a parameter added to
or multiplying the batch, a class token); :mod:`~memconv.layers.standardise` (a weight
standardised per output channel, in closed form).
"""

# the families register their rules and binders on import
from . import conv, elementwise, embedding, linear, norm, prelu  # noqa: F401
from .base import (
    LayerRule,
    RuleSettings,
    check_layer,
    find_rule,
    register,
    register_like,
    registered,
    rule_settings,
    unregister,
    using,
)
from .dispatch import run_rule
from .results import own_trainable

__all__ = [
    "LayerRule",
    "RuleSettings",
    "check_layer",
    "find_rule",
    "own_trainable",
    "register",
    "register_like",
    "registered",
    "rule_settings",
    "run_rule",
    "unregister",
    "using",
]
