"""The registry of layer rules: what memconv knows about a layer, in one place.

A *rule* tells memconv how to get a layer's per-sample gradients from the inputs of
one forward call and the gradient of its output (Opacus' grad samplers, BackPACK's
derivatives). Rules are found by the layer's **exact type**; a subclass uses the rule
of its nearest registered base class only if it does not override ``forward`` (a
weight-standardised convolution computes something else than ``nn.Conv2d``). Such a
layer's operations are served by the operation rules (:mod:`memconv.layers.operations`)
where they can be; what none covers takes the exact generic route
(:mod:`memconv.engine.generic`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..conv.norm_routes import grad_channel_stats, sq_norms
from ..conv.settings import DEFAULT_SETTINGS, Autocast, Settings
from .results import check_result

_RULES: dict[type, LayerRule] = {}
#: Bytes of per-sample gradients :meth:`LayerRule.channel_stats` holds at once by default.
_STATS_BYTES = 32 * 2**20


@dataclass(frozen=True)
class RuleSettings:
    """What a whole-model computation passes on to the rules it calls.

    Attributes:
        settings: the weight-VJP strategy and its options (convolutions).
        norm_route: ``"ghost"``, ``"instantiate"`` or None (chosen per layer).
        budget: bytes a layer's temporaries may use (None: the rule's default).
        autocast: the :class:`memconv.conv.settings.Autocast` state of the forward
            pass, for rules that recompute part of it (None: as it is now).
        contiguous: the per-sample gradients a rule returns are kept as they are
            (returned to the user, or stored as ``grad_sample``/``grad_batch``), in
            the parameter's layout: a rule that can make them in another layout
            counts the copy (the convolutions' ``"auto"``).
        reference: the batch on which a rule chooses its route and pieces when the
            layer's batch is smaller, ``budget`` scaled with it, and keeps them (the
            default plan's: :attr:`memconv.engine.planning.Plan.reference_batch`;
            :func:`memconv.conv.norm_routes.at_reference`); None: on the layer's batch.
    """

    settings: Settings = DEFAULT_SETTINGS
    norm_route: str | None = None
    budget: int | None = None
    autocast: Autocast | None = None
    contiguous: bool = False
    reference: int | None = None

    @contextlib.contextmanager
    def autocast_context(self):
        """A ``torch.autocast`` block restoring the forward pass's autocast state."""
        if self.autocast is None:
            yield
            return
        with self.autocast.context():
            yield


_CURRENT: contextvars.ContextVar[RuleSettings | None] = contextvars.ContextVar(
    "memconv_rule_settings", default=None
)
_DEFAULT = RuleSettings()


def rule_settings() -> RuleSettings:
    """The :class:`RuleSettings` of the computation calling a rule right now (the
    defaults outside any: ``"auto"``, routes chosen per layer, no budget)."""
    current = _CURRENT.get()
    return _DEFAULT if current is None else current


@contextlib.contextmanager
def using(settings: RuleSettings):
    """Make ``settings`` what :func:`rule_settings` returns inside the block."""
    token = _CURRENT.set(settings)
    try:
        yield settings
    finally:
        _CURRENT.reset(token)


class LayerRule:
    """How memconv computes the per-sample quantities of one kind of layer.

    A rule must implement :meth:`grad_sample`; every other method has a default
    derived from it, which a rule overrides where it knows a leaner or faster way.
    ``inputs`` is the tuple of the layer call's positional tensor arguments, each
    with the batch axis first (``[N, ...]``), and ``grad_output`` the gradient of
    its (single tensor) output, batch axis first. Rules run under ``torch.no_grad``;
    the strategy, norm route and budget of the calling computation are in
    :func:`rule_settings`.

    Attributes:
        movable_batch_axis: whether a call whose batch axis is not the first (a
            ``batch_first=False`` Transformer's Linear layers) may be given to the rule
            with the batch axis moved first. False (the default) sends such calls
            to the generic route.
    """

    movable_batch_axis: bool = False

    def grad_sample(
        self, module: nn.Module, inputs: tuple[Tensor, ...], grad_output: Tensor
    ) -> dict[str, Tensor]:
        """Per-sample gradients ``{local parameter name: [N, *param.shape]}`` of the
        layer's own trainable parameters (those with ``requires_grad``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement grad_sample")

    def sq_norms(
        self, module: nn.Module, inputs: tuple[Tensor, ...], grad_output: Tensor
    ) -> dict[str, Tensor]:
        """Squared norms ``{local name: [N]}`` of the per-sample gradients (default:
        from :meth:`grad_sample`)."""
        return {k: sq_norms(v) for k, v in self._checked_grads(module, inputs, grad_output).items()}

    def channel_stats(
        self,
        module: nn.Module,
        inputs: tuple[Tensor, ...],
        grad_output: Tensor,
        name: str,
        w_hat: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(‖g_c‖², ⟨g_c,1⟩, ⟨g_c,ŵ_c⟩)`` ``[N, C]`` of the per-sample gradients ``g``
        of parameter ``name``, split along its first axis (``w_hat`` ``[C, K]``): what
        a weight standardised per output channel needs (the closed form of
        :mod:`memconv.layers.standardise`). Default: from :meth:`grad_sample`, a chunk
        of samples at a time within ``rule_settings().budget``."""
        p = getattr(module, name)
        n = grad_output.shape[0]
        per = 2 * sum(q.numel() for q in module.parameters(recurse=False)) * p.element_size()
        step = max(1, (rule_settings().budget or _STATS_BYTES) // max(per, 1))
        parts = []
        for i in range(0, n, step):
            rows = slice(i, i + step)
            grads = self._checked_grads(module, tuple(a[rows] for a in inputs), grad_output[rows])
            parts.append(grad_channel_stats(grads[name], w_hat))
            del grads
        return tuple(torch.cat(p) for p in zip(*parts))

    def summed_grad(
        self, module: nn.Module, inputs: tuple[Tensor, ...], grad_output: Tensor
    ) -> dict[str, Tensor]:
        """The gradient summed over the batch ``{local name: param.shape}`` for this
        output gradient (DP-SGD's book-keeping calls it with each sample's output
        gradient scaled by its clip factor). Default: :meth:`grad_sample` summed."""
        return {k: v.sum(0) for k, v in self._checked_grads(module, inputs, grad_output).items()}

    def _checked_grads(self, module, inputs, grad_output) -> dict[str, Tensor]:
        """:meth:`grad_sample`, checked (:func:`memconv.layers.results.check_result`):
        the defaults derive their results from it."""
        out = self.grad_sample(module, inputs, grad_output)
        check_result(self, "grad_sample", module, out, grad_output.shape[0])
        return out

    def memory(
        self, module: nn.Module, input_shapes: tuple[tuple[int, ...], ...], itemsize: int, task: str
    ) -> int:
        """Predicted bytes of the rule's temporaries for one call (batch axis first in
        ``input_shapes``), within ``rule_settings().budget``; ``task`` is
        ``"grads"`` (:meth:`grad_sample`) or ``"norms"`` (:meth:`sq_norms`). Default:
        twice the per-sample gradients (the gradients and their squares)."""
        n = input_shapes[0][0] if input_shapes else 0
        params = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        return 2 * n * params * itemsize

    def describes(self, module: nn.Module, data: Tensor, output: Tensor) -> bool:
        """Whether the rule describes an operation call made through the shell
        ``module`` on ``data`` with this ``output`` (batch axes first); a call it does
        not describe takes the other routes. Default: True."""
        return True

    def check_settings(self, module: nn.Module, settings: Settings) -> None:
        """Raise ``ValueError`` if the strategy settings cannot run on this layer."""

    def input_axes(self, module: nn.Module) -> int | None:
        """The number of axes the layer's (first) input has with its batch axis, where
        the layer fixes it (a ``Conv2d``: 4, ``[N, C, H, W]``), else None (default).
        The probe checks a call against it (an input one axis short is one sample
        without its batch axis, or a batch without its channel axis)."""
        return None

    def check(self, module: nn.Module, name: str) -> None:
        """Raise ``ValueError`` (naming ``name`` and the remedy) if the layer mixes the
        samples of a batch, so that per-sample gradients are undefined."""


def trainable(module: nn.Module, name: str) -> bool:
    """Whether the module's attribute ``name`` is a parameter that requires grad (a
    layer rule computes the quantities of those only): an entry of its parameter
    dictionary (a shell's may be a plain tensor of the step,
    :func:`memconv.layers.operations.as_parameter`)."""
    p = module._parameters.get(name)
    return p is not None and p.requires_grad


def register(*types: type):
    """Class decorator registering a :class:`LayerRule` subclass for ``types``.

    Example::

        @memconv.layers.register(WSConv2d)
        class WSConv2dRule(memconv.layers.LayerRule):
            def grad_sample(self, module, inputs, grad_output):
                ...

    Args:
        *types: ``nn.Module`` subclasses the rule describes exactly (their
            ``forward``, hooks aside).

    Returns:
        The decorator (it returns the class unchanged).

    Raises:
        TypeError: if a type is not an ``nn.Module`` subclass, or the decorated class
            is not a :class:`LayerRule` subclass.
    """
    for t in types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"register() takes nn.Module subclasses, got {t!r}")
    if not types:
        raise TypeError("register() needs at least one nn.Module subclass")

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, LayerRule)):
            raise TypeError(f"register(...) decorates LayerRule subclasses, got {cls!r}")
        rule = cls()
        for t in types:
            _RULES[t] = rule
        return cls

    return decorate


def register_like(layer_type: type, like: type) -> None:
    """Give ``layer_type`` the rule registered for ``like``: a subclass that computes
    what ``like`` computes (memconv's own modules point at torch's types this way, so
    that rules never import them).

    Raises:
        TypeError: if ``layer_type`` is not a subclass of ``like``.
        KeyError: if no rule is registered for ``like``.
    """
    if not (
        isinstance(layer_type, type) and isinstance(like, type) and issubclass(layer_type, like)
    ):
        raise TypeError(f"register_like() takes a subclass of {like!r}, got {layer_type!r}")
    _RULES[layer_type] = _RULES[like]


def unregister(*types: type) -> None:
    """Remove the rules registered for ``types`` (a missing one is ignored)."""
    for t in types:
        _RULES.pop(t, None)


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule of ``module``'s exact type, else of its nearest registered base class
    whose ``forward`` it inherits unchanged; None if there is none (generic route)."""
    cls = type(module)
    rule = _RULES.get(cls)
    if rule is not None:
        return rule
    for base in cls.__mro__[1:]:
        if base in _RULES and getattr(cls, "forward", None) is getattr(base, "forward", None):
            return _RULES[base]
    return None


def check_layer(module: nn.Module, name: str) -> None:
    """Run the :meth:`LayerRule.check` of every rule registered for ``module``'s type or
    a base class of it (a subclass of BatchNorm mixes samples as BatchNorm does,
    whatever route computes its gradients).

    Raises:
        ValueError: from the rules' checks.
    """
    seen = set()
    for cls in type(module).__mro__:
        rule = _RULES.get(cls)
        if rule is not None and id(rule) not in seen:
            seen.add(id(rule))
            rule.check(module, name)


def registered() -> dict[type, LayerRule]:
    """A copy of the registry ``{layer type: rule}``."""
    return dict(_RULES)
