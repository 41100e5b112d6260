"""Every argument check of memconv's public functions, in one place (as jax_privacy's
``_validate.py``), with the names of the values they accept.

A check raises before any work, with the argument's name and what is accepted:
``TypeError`` for a value of the wrong kind, ``ValueError`` for a value of the right
kind out of range. Checks of what memconv computes (a rule's results, a non-finite
norm, a probe that no longer fits) live where the computation is, not here.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Literal, get_args

import torch
from torch import Tensor, nn

#: What a whole-model call computes: per-sample gradients, their norms, clipped sums.
Task = Literal["grads", "norms", "clip"]
TASKS: tuple[str, ...] = get_args(Task)
#: How a convolution's or Linear layer's per-sample norms are taken.
NormRoute = Literal["ghost", "instantiate"]
NORM_ROUTES: tuple[str, ...] = get_args(NormRoute)
#: How :func:`memconv.clip_and_accumulate` makes the clipped sum.
ClipRoute = Literal["book-keeping", "two-pass"]
CLIP_ROUTES: tuple[str, ...] = get_args(ClipRoute)
#: The named parameter groupings of clipping (or a mapping).
GroupKind = Literal["all", "layer", "parameter"]
GROUPINGS: tuple[str, ...] = get_args(GroupKind)
#: The input factor of a convolution's KFAC: over all patches, or their average.
KfacApprox = Literal["expand", "reduce"]
KFAC_APPROXIMATIONS: tuple[str, ...] = get_args(KfacApprox)
#: The Kronecker factors of a grouped convolution's weight through BackPACK: one
#: product per group, or one product with the input averaged over the groups.
KronGroups = Literal["blocks", "average"]
KRON_GROUPS: tuple[str, ...] = get_args(KronGroups)
#: ``memory_budget="available"``: what the process can still use.
AVAILABLE = "available"
#: The ``memory_budget`` of a budget derived from the model and batch (BackPACK's
#: second-order extensions through memconv: :mod:`memconv.integrations.backpack`).
LEAN = "lean"
#: The padding modes of torch's convolutions.
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
#: The convolutions and transposed convolutions memconv's strategies run on.
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSE_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_choice(value, accepted: tuple, argument: str, *, none: bool = True) -> None:
    """Raise unless ``value`` is one of ``accepted`` (or None, with ``none``).

    Raises:
        ValueError: naming the accepted values.
    """
    if (value is None and none) or value in accepted:
        return
    listed = ", ".join(accepted) + (" or None" if none else "")
    raise ValueError(f"unknown {argument} {value!r}; accepted: {listed}")


def check_task(task) -> None:
    """Raise unless ``task`` is one of :data:`TASKS`."""
    check_choice(task, TASKS, "task", none=False)


def check_route(route, argument: str = "norm_route") -> None:
    """Raise unless ``route`` is None or one of :data:`NORM_ROUTES`.

    Raises:
        ValueError: naming the accepted routes.
    """
    check_choice(route, NORM_ROUTES, argument)


def check_clip_route(clip_route) -> None:
    """Raise unless ``clip_route`` is None or one of :data:`CLIP_ROUTES`.

    Raises:
        ValueError: naming the accepted routes.
    """
    check_choice(clip_route, CLIP_ROUTES, "clip_route")


def check_module(value, argument: str = "model") -> None:
    """Raise ``TypeError`` unless ``value`` is an ``nn.Module``."""
    if not isinstance(value, nn.Module):
        raise TypeError(f"{argument} must be a torch.nn.Module, got {type(value).__name__}")


def check_callable(value, argument: str) -> None:
    """Raise ``TypeError`` unless ``value`` is callable."""
    if not callable(value):
        raise TypeError(f"{argument} must be callable, got {type(value).__name__}")


def check_tensor(value, argument: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(value).__name__}")


def check_positive_int(value, argument: str, *, none: bool = True) -> None:
    """Raise unless ``value`` is a positive int (a bool is not); ``none``: the argument
    also accepts None (checked by the caller), as the message says.

    Raises:
        TypeError: not an int.
        ValueError: not positive.
    """
    accepted = "a positive int or None" if none else "a positive int"
    if not _is_int(value):
        raise TypeError(f"{argument} must be {accepted}, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{argument} must be {accepted}, got {value}")


class BudgetError(ValueError, TypeError):
    """A ``memory_budget`` none of whose accepted forms it is: one exception wherever a
    budget is taken, a ``ValueError`` and a ``TypeError`` both (as numpy's ``AxisError``
    is a ``ValueError`` and an ``IndexError``), so that code catching either keeps
    working."""


def check_budget(
    memory_budget,
    argument: str = "memory_budget",
    *,
    available: bool = True,
    none: bool = True,
    lean: bool = False,
    where: str = "",
) -> None:
    """Raise unless ``memory_budget`` is one of the forms a function accepts: a positive
    int (bytes), ``"available"`` (with ``available``), ``"lean"`` (with ``lean``) or
    None (with ``none``). Every
    function that takes a budget checks it here, so that a bad one gets the same
    exception and a message showing the accepted forms.

    Args:
        memory_budget: the value given.
        argument: its name, for the message.
        available: whether ``"available"`` is accepted.
        none: whether None is accepted.
        lean: whether ``"lean"`` is accepted.
        where: what takes it (``"save_memory"``, ...), for the message.

    Raises:
        BudgetError: (a ``ValueError`` and a ``TypeError``) naming the argument, the
            value and the accepted forms, e.g. ``2 * 2**30`` for 2 GiB.
    """
    if memory_budget is None and none:
        return
    if available and isinstance(memory_budget, str) and memory_budget == AVAILABLE:
        return
    if lean and isinstance(memory_budget, str) and memory_budget == LEAN:
        return
    if _is_int(memory_budget) and memory_budget > 0:
        return
    forms = ["a positive int of bytes (2 * 2**30 for 2 GiB)"]
    if available:
        forms.append("'available' (what the process can still use)")
    if lean:
        forms.append("'lean' (a budget derived from the model and batch)")
    if none:
        forms.append("None (no limit)")
    accepted = ", ".join(forms[:-1]) + " or " + forms[-1] if len(forms) > 1 else forms[0]
    prefix = f"{where}: " if where else ""
    raise BudgetError(f"{prefix}{argument} must be {accepted}; got {memory_budget!r}")


def check_chunks(chunks, most: int, argument: str = "chunks") -> None:
    """Raise unless ``chunks`` is None or an int from 1 to ``most`` (the most row
    blocks a layer's input factor is cut in,
    :func:`memconv.conv.kronecker.most_chunks`).

    Raises:
        TypeError: not an int (a bool included).
        ValueError: outside 1..most.
    """
    if chunks is None:
        return
    if not _is_int(chunks):
        raise TypeError(f"{argument} must be None or an int, got {chunks!r}")
    if not 1 <= chunks <= most:
        raise ValueError(f"{argument} must be from 1 to {most} for this layer, got {chunks}")


def check_threshold(value, what: str) -> float:
    """``value`` as a float if it is a positive finite number.

    Raises:
        TypeError: not a real number (a bool included).
        ValueError: not positive and finite.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a positive finite number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def check_max_norm(max_norm) -> None:
    """Raise unless ``max_norm`` is a positive finite number or a mapping (whose
    thresholds :func:`memconv.tasks.groups.resolve_groups` checks against the groups).

    Raises:
        TypeError: not a real number or a mapping.
        ValueError: not positive and finite.
    """
    if not isinstance(max_norm, Mapping):
        check_threshold(max_norm, "max_norm")


def check_finite_number(value, what: str) -> float:
    """``value`` as a float if it is a finite int or float (a bool is not).

    Raises:
        TypeError: otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def check_groups(groups, names: list) -> None:
    """Raise unless ``groups`` is one of :data:`GROUPINGS` or a mapping ``{parameter name:
    group name}`` covering exactly the trainable parameters ``names``.

    Raises:
        TypeError: neither a known name nor a mapping of strings.
        ValueError: an unknown grouping; a mapping naming no trainable parameter or
            leaving one out.
    """
    if isinstance(groups, str):
        if groups not in GROUPINGS:
            raise ValueError(
                f"unknown groups {groups!r}; accepted: {', '.join(GROUPINGS)} or a mapping "
                "from parameter name to group name"
            )
        return
    if not isinstance(groups, Mapping):
        raise TypeError(
            f"groups must be one of {', '.join(GROUPINGS)} or a mapping from parameter name "
            f"to group name, got {type(groups).__name__}"
        )
    bad = [k for k, v in groups.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise TypeError(f"groups must map parameter names to group names (strings), got {bad[0]!r}")
    unknown = [k for k in groups if k not in names]
    if unknown:
        raise ValueError(f"groups names {unknown[0]!r}, which is no trainable parameter")
    missing = [n for n in names if n not in groups]
    if missing:
        raise ValueError(
            f"groups leaves the trainable parameter(s) {missing[:5]} out; every trainable "
            "parameter needs a group"
        )


def check_thresholds(max_norm, groups) -> dict[str, float]:
    """``{group: threshold}`` from ``max_norm``: one threshold for every group, or a
    mapping ``{group name: threshold}`` with exactly the names ``groups``.

    Raises:
        TypeError: ``max_norm`` neither a number nor a mapping; a threshold not a number.
        ValueError: a threshold ≤ 0 or not finite; a group without a threshold or a
            threshold for no group.
    """
    if not isinstance(max_norm, Mapping):
        c = check_threshold(max_norm, "max_norm")
        return {g: c for g in groups}
    thresholds = {g: check_threshold(c, f"max_norm[{g!r}]") for g, c in max_norm.items()}
    missing = [g for g in groups if g not in thresholds]
    if missing:
        raise ValueError(f"max_norm has no threshold for the group(s) {missing[:5]}")
    extra = [g for g in thresholds if g not in groups]
    if extra:
        raise ValueError(f"max_norm names {extra[0]!r}, which is no group")
    return thresholds


def check_tile_size(tile_size, argument: str = "tile_size") -> None:
    """Raise unless ``tile_size`` is None, a positive int or a tuple of them.

    Raises:
        TypeError: on a non-integer value.
        ValueError: on a non-positive value or an empty tuple.
    """
    if tile_size is None:
        return
    if isinstance(tile_size, (tuple, list)):
        if not tile_size:
            raise ValueError(f"{argument} must not be empty")
        for v in tile_size:
            check_positive_int(v, argument)
        return
    check_positive_int(tile_size, argument)


def check_tile(tile_size, dims: int) -> tuple[int, ...]:
    """A streamed tile's size ``(t_1, ..., t_dims)``: a positive int for every spatial
    axis, or one for all.

    Raises:
        TypeError: a value that is not an int.
        ValueError: a non-positive value, or a tuple of another length.
    """
    values = tile_size if isinstance(tile_size, (tuple, list)) else (tile_size,) * dims
    for v in values:
        if not _is_int(v):
            raise TypeError(
                f"tile_size must be a positive int or a tuple of them, got {tile_size!r}"
            )
        if v <= 0:
            raise ValueError(f"tile_size must be positive, got {tile_size!r}")
    if len(values) != dims:
        raise ValueError(f"tile_size {tile_size!r} must have {dims} entries (one per spatial axis)")
    return tuple(int(v) for v in values)


def check_tile_argument(tile_size, tile_shape):
    """The spatial tile size from ``tile_size`` or Lightstream's ``tile_shape``.

    Raises:
        ValueError: both or neither given, or a ``tile_shape`` without spatial sizes.
    """
    if (tile_size is None) == (tile_shape is None):
        raise ValueError(
            "give exactly one of tile_size (input pixels per spatial axis) and tile_shape "
            "((N, C, *spatial) of one input tile, Lightstream's spelling)"
        )
    if tile_size is not None:
        return tile_size
    if not isinstance(tile_shape, (tuple, list, torch.Size)) or len(tile_shape) < 3:
        raise ValueError(
            f"tile_shape must be (N, C, *spatial) with at least one spatial size, got {tile_shape!r}"
        )
    return tuple(tile_shape[2:])


def check_stream_tile(tile_size, tile_shape, memory_budget):
    """``(tile, channels)`` of a streamed trunk: the spatial tile from ``tile_size`` (an
    int, a tuple of ints or ``"auto"``) or Lightstream's ``tile_shape`` ``(N, C,
    *spatial)``, and the channels ``tile_shape`` gives (else None).

    Raises:
        ValueError: both or neither of ``tile_size`` and ``tile_shape``; ``"auto"``
            without a ``memory_budget`` (a positive int, bytes), or a budget with a
            fixed tile; a ``tile_shape`` without spatial sizes.
        BudgetError: a ``memory_budget`` that is not a positive int
            (:func:`check_budget`).
    """
    if tile_size == "auto":
        if memory_budget is None:
            raise ValueError(
                "tile_size='auto' needs memory_budget (bytes a training step may use "
                "beyond the image and the parameters: 2 * 2**30 for 2 GiB)"
            )
        check_budget(memory_budget, available=False, none=False, where="StreamingCNN")
        return "auto", None
    if memory_budget is not None:
        raise ValueError(
            "memory_budget chooses the tile: give it with tile_size='auto', not with a fixed "
            "tile size"
        )
    tile = check_tile_argument(tile_size, tile_shape)
    channels = None
    if tile_shape is not None:
        check_positive_int(tile_shape[1], "tile_shape's channels")
        channels = int(tile_shape[1])
    return tile, channels


def check_strategy_name(strategy, names: tuple, argument: str = "strategy") -> str:
    """The strategy's name: ``True``/``False`` are ``"rochette"``/``"standard"``
    (BackPACK's ``save_memory(True/False)``), a string must be one of ``names``.

    Raises:
        TypeError: if ``strategy`` is neither a bool nor a str.
        ValueError: if the name is not registered.
    """
    if strategy is True:
        return "rochette"
    if strategy is False:
        return "standard"
    if not isinstance(strategy, str):
        raise TypeError(
            f"{argument} must be a bool or one of {names}, got {type(strategy).__name__}"
        )
    check_choice(strategy, names, argument, none=False)
    return strategy


def check_grad_mode() -> None:
    """Raise under ``torch.no_grad()`` or ``torch.inference_mode()``.

    Raises:
        RuntimeError: there.
    """
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        raise RuntimeError(
            "memconv runs its own forward and backward passes, which need gradients: it "
            "cannot run under torch.no_grad() or torch.inference_mode(); call it outside them"
        )


def check_batch(inputs, targets) -> int:
    """Raise unless ``inputs`` is a tensor and ``targets`` has its length; returns N.

    Raises:
        TypeError: if ``inputs`` is not a tensor.
        ValueError: if the lengths differ.
    """
    check_tensor(inputs, "inputs")
    if len(inputs) != len(targets):
        raise ValueError(
            f"inputs and targets must have the same length N, got {len(inputs)} and {len(targets)}"
        )
    return len(inputs)


def check_sample_mask(sample_mask, n: int, device, argument: str = "sample_mask") -> None:
    """Raise unless ``sample_mask`` is None or a bool tensor ``[n]`` on ``device`` (the
    inputs'): which samples of a batch padded to a fixed size are real (masked DP-SGD,
    Beltran et al. 2024). A float mask (a per-sample weight) is not one: it is refused.
    Only the mask's metadata is read (no host synchronisation).

    Raises:
        TypeError: not a tensor, or not of dtype ``torch.bool``.
        ValueError: a shape other than ``[n]``, or a device other than ``device``.
    """
    if sample_mask is None:
        return
    accepted = f"None or a bool tensor of shape [{n}] (True: a real sample, False: padding)"
    if not isinstance(sample_mask, Tensor):
        raise TypeError(f"{argument} must be {accepted}, got {type(sample_mask).__name__}")
    if sample_mask.dtype != torch.bool:
        raise TypeError(
            f"{argument} must be {accepted}, got dtype {sample_mask.dtype}; turn a 0/1 mask "
            "into one with mask.bool() (a per-sample weight is not accepted)"
        )
    if tuple(sample_mask.shape) != (n,):
        raise ValueError(
            f"{argument} must be {accepted} (one entry per sample of inputs), got shape "
            f"{list(sample_mask.shape)}"
        )
    if sample_mask.device != torch.device(device):
        raise ValueError(
            f"{argument} must be on the inputs' device {torch.device(device)}, got "
            f"{sample_mask.device}"
        )


def check_layer_input(shape: tuple, axes: int, *, layer: str, inputs: tuple) -> None:
    """Raise unless a layer that takes inputs of ``axes`` axes (batch axis included) got
    ``shape`` in the probe of one sample of the batch ``inputs`` (its shape).

    Raises:
        ValueError: naming the ``inputs`` argument, the layer and the remedy: an input
            one axis short is the batch of samples without their channel axis (``[N, 28,
            28]`` for a one-channel ``Conv2d``), which torch would take for a single
            unbatched sample.
    """
    if len(shape) >= axes:
        return
    got = "[" + ", ".join(map(str, inputs)) + "]"
    hint = (
        " add the channel axis (inputs.unsqueeze(1) for one channel)"
        if len(shape) == axes - 1
        else " give it a batch of samples with the axes the layer takes"
    )
    raise ValueError(
        f"inputs of shape {got} do not fit the layer {layer}, which takes inputs of {axes} "
        f"axes with the batch axis first, but got {len(shape)} ({list(shape)} for one "
        f"sample): the batch seems to lack its channel axis;{hint}"
    )


def check_conv_module(module, argument: str = "module") -> None:
    """Raise unless ``module`` is a supported convolution or transposed convolution.

    Raises:
        TypeError: for any other object, lazy modules included.
        ValueError: for an unknown ``padding_mode``.
    """
    if not isinstance(module, CONV_TYPES + CONV_TRANSPOSE_TYPES) or isinstance(
        module, nn.modules.lazy.LazyModuleMixin
    ):
        raise TypeError(
            f"{argument} must be a torch.nn.Conv1d/2d/3d or ConvTranspose1d/2d/3d (or a "
            f"memconv subclass of one), got {type(module).__name__}"
        )
    if module.padding_mode not in PADDING_MODES:
        raise ValueError(
            f"{argument}.padding_mode must be one of {PADDING_MODES}, got {module.padding_mode!r}"
        )


def check_conv_input(spec, x, argument: str = "input") -> None:
    """Raise unless ``x`` is a floating tensor ``[N, C_in, *S]`` for the layer of
    ``spec`` (a :class:`memconv.strategies.geometry.ConvSpec`).

    For a transposed convolution ``C_in`` is the module's ``in_channels`` (the
    equivalent convolution's ``C_out``).

    Raises:
        TypeError: if ``x`` is not a floating-point tensor.
        ValueError: on a wrong number of dimensions or channels, or a spatial size
            too small for the kernel.
    """
    geom = spec.geometry
    channels = geom.out_channels if spec.transposed else geom.in_channels
    check_tensor(x, argument)
    if not x.is_floating_point():
        raise TypeError(f"{argument} must be floating point, got dtype {x.dtype}")
    if x.dim() != geom.dims + 2 or x.shape[1] != channels:
        raise ValueError(
            f"{argument} must have shape [N, C_in={channels}, "
            f"{geom.dims} spatial dims], got {tuple(x.shape)}"
        )
    if spec.transposed:
        return
    size = spec.padded_size(tuple(x.shape[2:]))
    if any(t < 1 for t in geom.output_size(size)):
        raise ValueError(
            f"{argument} spatial size {tuple(x.shape[2:])} is smaller than the "
            f"dilated kernel {geom.kernel_size} (dilation {geom.dilation})"
        )


def check_conv_grad_output(spec, x_shape, g, argument: str = "grad_output") -> None:
    """Raise unless ``g`` has the shape of the convolution's output for input ``x_shape``.

    For a transposed convolution any ``output_padding`` (0 ≤ it < max(stride,
    dilation), as PyTorch allows) is accepted.

    Raises:
        TypeError: if ``g`` is not a tensor.
        ValueError: if its shape is not ``[N, C_out, *T]``.
    """
    geom = spec.geometry
    check_tensor(g, argument)
    if spec.transposed:
        low = geom.needed_input_size(tuple(x_shape[2:]))
        slack = [max(s, d) for s, d in zip(geom.stride, geom.dilation)]
        ok = (
            g.dim() == len(x_shape)
            and tuple(g.shape[:2]) == (x_shape[0], geom.in_channels)
            and all(lo <= t < lo + sl for t, lo, sl in zip(g.shape[2:], low, slack))
        )
        if not ok:
            raise ValueError(
                f"{argument} must have shape ({x_shape[0]}, {geom.in_channels}, *T) with T "
                f"from {low} (+ output_padding) for input {tuple(x_shape)}, got {tuple(g.shape)}"
            )
        return
    expected = (
        x_shape[0],
        geom.out_channels,
        *geom.output_size(spec.padded_size(tuple(x_shape[2:]))),
    )
    if tuple(g.shape) != expected:
        raise ValueError(
            f"{argument} must have shape {expected} (the output of the convolution "
            f"for input {tuple(x_shape)}), got {tuple(g.shape)}"
        )


def check_flag(value, argument: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {type(value).__name__} {value!r}")


def check_invertible_module(fn, argument: str = "fn") -> None:
    """Raise ``TypeError`` unless ``fn`` is an ``nn.Module`` with a callable ``inverse``
    (``fn.inverse(fn(x))`` gives ``x`` back, MemCNN's convention)."""
    check_module(fn, argument)
    if not callable(getattr(fn, "inverse", None)):
        raise TypeError(
            f"{argument} must be a torch.nn.Module with an inverse method "
            f"(fn.inverse(fn(x)) == x); {type(fn).__name__} has none: write its inverse, or "
            "build it from memconv.reversible.AdditiveCoupling or AffineCoupling"
        )


def check_block_inputs(inputs: tuple, where: str) -> None:
    """Raise ``TypeError`` unless a reversible block gets one or more tensors, all
    positional (``where``: the block, for the message)."""
    if not inputs or not all(isinstance(t, Tensor) for t in inputs):
        kinds = ", ".join(type(t).__name__ for t in inputs) or "nothing"
        raise TypeError(f"{where} takes one or more tensors as positional arguments, got {kinds}")


def check_split(x: Tensor, split_dim: int, where: str) -> None:
    """Raise ``ValueError`` unless ``x`` splits into two halves of one size along
    ``split_dim`` (a coupling's two parts)."""
    if not -x.dim() <= split_dim < x.dim() or x.shape[split_dim] % 2:
        size = x.shape[split_dim] if -x.dim() <= split_dim < x.dim() else "no such axis"
        raise ValueError(
            f"{where}: split_dim={split_dim} of an input of shape {tuple(x.shape)} ({size}): "
            "a coupling splits its input into two halves of one size, so that axis must "
            "exist and have an even size"
        )


def check_split_dim(split_dim, argument: str = "split_dim") -> None:
    """Raise ``TypeError`` unless ``split_dim`` is an int (an axis, negative counts from
    the end)."""
    if not _is_int(split_dim):
        raise TypeError(f"{argument} must be an int (an axis), got {type(split_dim).__name__}")


def check_implementation(value, argument: str) -> None:
    """Raise unless ``value`` is one of MemCNN's coupling implementations: -1 (autograd
    through the coupling), 0 (the coupling's graph recomputed from its kept input in
    the backward pass) or 1 (its input reconstructed from its output, Gomez et al.'s
    algorithm 1). ``NotImplementedError`` for another int, as MemCNN raises."""
    if not _is_int(value):
        raise TypeError(f"{argument} must be -1, 0 or 1 (an int), got {type(value).__name__}")
    if value not in (-1, 0, 1):
        raise NotImplementedError(
            f"{argument}={value} is not an implementation of a coupling's pass: -1 (autograd, "
            "MemCNN's default), 0 (recompute from the kept input) or 1 (reconstruct from the "
            "output) are; to save the input's memory, wrap the coupling in "
            "memconv.reversible.InvertibleModuleWrapper"
        )


def check_optional_module(value, argument: str) -> None:
    """Raise ``TypeError`` unless ``value`` is None or an ``nn.Module``."""
    if value is not None:
        check_module(value, argument)


def check_test_input_shape(shape) -> tuple:
    """A shape or several shapes as a tuple of shapes (MemCNN's ``is_invertible_module``
    convention).

    Raises:
        ValueError: neither a tuple of ints nor a tuple of tuples of ints.
    """
    ints = isinstance(shape, (tuple, list)) and shape and all(_is_int(e) for e in shape)
    if ints:
        return (tuple(shape),)
    nested = (
        isinstance(shape, (tuple, list))
        and shape
        and all(isinstance(e, (tuple, list)) and all(_is_int(v) for v in e) for e in shape)
    )
    if not nested:
        raise ValueError(
            f"test_input_shape must be a tuple of ints or a tuple of tuples of ints, got {shape!r}"
        )
    return tuple(tuple(e) for e in shape)


_OWN_FILES = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line: the first
    caller outside memconv and torch (a call of memconv's function, a compiled model's
    call, ``loss.backward()``), however deep the call that warns."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
