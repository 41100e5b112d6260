"""The cost models' fitted coefficients, read per device type from packaged data files.

Every time model of memconv (the strategies', the ghost norms' methods, the
instantiating norm route's, ``"streaming"``'s tiles, ``"kfac-join"``: a compiled KFAC
step's join of an input factor's row blocks) is linear in a few coefficients
(seconds per multiply-add, per element moved, per kernel call, ...) plus one term all
of them share: seconds per tensor operation (``"operation"``: ``per_op``), times the
number of ATen operations the computation issues. That term is what a launch-bound
device pays for every operation whatever its size (a CUDA kernel launch and torch's
dispatch, some 5 to 40 µs), and what makes a route that loops in Python over samples,
kernel offsets or chunks cost what it does. Every memory
model (bytes, derived from the algorithm) is multiplied by a fitted scale. The
coefficients live in ``memconv/calibration/<device type>.json``, written by
:mod:`memconv.bench.calibrate` (``memconv calibrate``) from measurements on that kind
of device: a :class:`~memconv.strategies.base.Problem` whose ``device`` is ``"cuda"``
is priced with ``cuda.json``, a CPU one with ``cpu.json``. A device type without a
file is priced with the CPU file, and a warning on the ``memconv`` logger says so
once. Tensors on the ``"meta"`` device (shape-only predictions) use the CPU file
without a warning.

The file's layout: ``{"device": ..., "fitted": {...}, "time": {model: {coefficient:
seconds}}, "memory": {model: {"scale": factor}}, "cache_bytes": bytes}``;
:data:`TIME_MODELS` lists each time model's coefficients in the order the model
multiplies them. ``cache_bytes`` (optional) is the last-level cache of the machine the
file was fitted on (the CPU's L3, a GPU's L2): a model whose working set outgrows it
pays a second, "spilled" rate per element moved (``per_element_spilled``: ``"unfold"``'s
unfolded input, ``"shift"``'s operands re-read per kernel offset, from memory rather
than from the cache). Without it no working set spills.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from importlib import resources

from .base import clear_cost_memos

logger = logging.getLogger("memconv")

#: Each time model and its coefficients (seconds per unit of the named quantity).
TIME_MODELS: dict[str, tuple[str, ...]] = {
    "operation": ("per_op",),
    "standard": ("per_flop", "per_element", "per_call"),
    "rochette": ("per_flop", "per_element", "per_call"),
    "unfold": (
        "per_flop",
        "per_element",
        "per_call",
        "per_element_spilled",
        "per_flop_summed",
        "per_element_summed",
    ),
    "shift": ("per_flop", "per_element", "per_flop_depthwise", "per_element_spilled"),
    "loop": (
        "per_flop_native",
        "per_flop_native_3d",
        "per_flop_onednn",
        "per_operand",
        "per_result_native",
        "per_result_onednn",
        "per_call",
        "per_flop_depthwise",
        "per_call_depthwise",
    ),
    "ghost-positions": ("per_flop", "per_element", "per_gram", "per_window"),
    "ghost-offsets": ("per_flop", "per_element", "per_product"),
    "instantiate": ("per_square",),
    "streaming": ("per_tile", "per_copy"),
    "kfac-join": ("per_element", "per_element_spilled"),
    "vmap": (
        "per_flop",
        "per_flop_strided",
        "per_flop_im2col",
        "per_element",
        "per_result",
        "per_result_spilled",
        "per_group",
        "per_flop_depthwise_large",
    ),
}
#: The memory models that carry a fitted scale (the elementary strategies' and the
#: ghost norms' methods; the composite ones add up theirs).
MEMORY_MODELS: tuple[str, ...] = (
    "standard",
    "rochette",
    "unfold",
    "shift",
    "loop",
    "ghost-positions",
    "ghost-offsets",
    "vmap",
)
#: Models a calibration file may leave out (fitted after the file was, on a device not
#: at hand): a strategy priced by a missing time model is not priced on that device type
#: (:func:`priced`), and ``"auto"`` does not take it there; a missing memory scale is 1.
OPTIONAL_MODELS: frozenset[str] = frozenset({"vmap"})
#: The device type whose file prices every device type without one.
FALLBACK = "cpu"

_OVERRIDES: dict[str, dict] = {}
_WARNED: set[str] = set()


def check(data: dict, source: str) -> dict:
    """Raise unless ``data`` holds every coefficient and scale, each a finite number >= 0.

    Args:
        data: a calibration, as read from its JSON file.
        source: where it came from (for the message).

    Returns:
        ``data``.

    Raises:
        ValueError: naming the missing or bad entry and ``source``.
    """
    for model, names in TIME_MODELS.items():
        got = data.get("time", {}).get(model)
        if got is None and model in OPTIONAL_MODELS:
            continue
        if not isinstance(got, dict) or set(got) != set(names):
            raise ValueError(f"{source}: time model {model!r} needs coefficients {names}")
    for model in MEMORY_MODELS:
        got = data.get("memory", {}).get(model)
        if got is None and model in OPTIONAL_MODELS:
            continue
        if not isinstance(got, dict) or set(got) != {"scale"}:
            raise ValueError(f"{source}: memory model {model!r} needs a 'scale'")
    cache = data.get("cache_bytes")
    if cache is not None and (type(cache) is not int or cache < 0):
        raise ValueError(f"{source}: 'cache_bytes' is an int >= 0, got {cache!r}")
    values = [v for m in data["time"].values() for v in m.values()]
    values += [m["scale"] for m in data["memory"].values()]
    for v in values:
        if not isinstance(v, (int, float)) or not (0 <= v < float("inf")):
            raise ValueError(f"{source}: coefficients are finite numbers >= 0, got {v!r}")
    return data


@functools.cache
def _packaged(device_type: str) -> dict | None:
    path = resources.files("memconv") / "calibration" / f"{device_type}.json"
    if not path.is_file():
        return None
    return check(json.loads(path.read_text()), f"memconv/calibration/{device_type}.json")


def calibration(device_type: str = FALLBACK) -> dict:
    """The calibration that prices problems on ``device_type`` (``"cpu"``, ``"cuda"``, ...).

    Returns:
        The parsed data file of that device type, or the CPU one when there is none
        (logged once per device type as a warning).
    """
    if device_type in _OVERRIDES:
        return _OVERRIDES[device_type]
    data = _packaged(device_type)
    if data is not None:
        return data
    if device_type != "meta" and device_type not in _WARNED:
        _WARNED.add(device_type)
        logger.warning(
            "memconv: no cost-model calibration for device type %r; using the %s one "
            "(run 'memconv calibrate --device %s' to fit one)",
            device_type,
            FALLBACK,
            device_type,
        )
    return _packaged(FALLBACK)


def time_coefficients(model: str, device_type: str = FALLBACK) -> tuple[float, ...]:
    """A time model's coefficients (seconds per unit), in :data:`TIME_MODELS` order."""
    got = calibration(device_type)["time"][model]
    return tuple(got[name] for name in TIME_MODELS[model])


def cache_bytes(device_type: str = FALLBACK) -> int | None:
    """The last-level cache (bytes) of the machine ``device_type``'s calibration was
    fitted on; None where the file records none (no working set spills)."""
    return calibration(device_type).get("cache_bytes")


def spilled_time(model: str, working_bytes: float, traffic: float, device_type: str) -> float:
    """Seconds a time model adds when its working set (``working_bytes``) outgrows the
    calibration's last-level cache: ``traffic`` elements at the model's
    ``per_element_spilled`` rate; 0.0 where it fits or no cache is recorded."""
    cache = cache_bytes(device_type)
    if cache is None or working_bytes <= cache:
        return 0.0
    return calibration(device_type)["time"][model]["per_element_spilled"] * traffic


def fitted_device(device_type: str = FALLBACK) -> str:
    """The device type the calibration pricing ``device_type`` was fitted on (its
    ``"device"`` entry; ``device_type`` itself where it records none)."""
    return calibration(device_type).get("device", device_type)


def operations_time(operations: int, device_type: str = FALLBACK) -> float:
    """Seconds ``operations`` tensor operations cost on ``device_type`` besides their
    arithmetic (the shared ``"operation"`` model's ``per_op``)."""
    return calibration(device_type)["time"]["operation"]["per_op"] * operations


def priced(model: str, device_type: str = FALLBACK) -> bool:
    """Whether the calibration pricing ``device_type`` has the time model ``model`` (one of
    :data:`OPTIONAL_MODELS` may be missing)."""
    return model in calibration(device_type)["time"]


def time_rates(model: str, device_type: str = FALLBACK) -> dict[str, float]:
    """A time model's coefficients ``{name: seconds per unit}`` (:data:`TIME_MODELS`)."""
    return dict(zip(TIME_MODELS[model], time_coefficients(model, device_type)))


def scale_memory(model: str, device_type: str, nbytes: int) -> int:
    """``nbytes`` predicted by a memory model, times its fitted scale (an int)."""
    scale = calibration(device_type)["memory"].get(model, {"scale": 1})["scale"]
    return nbytes if scale == 1 else int(round(nbytes * scale))


@contextlib.contextmanager
def using(device_type: str, data: dict):
    """Price ``device_type`` with ``data`` inside the block (for fitting and tests);
    the memoised choices are forgotten on entry and exit."""
    check(data, "using()")
    previous = _OVERRIDES.get(device_type)
    _OVERRIDES[device_type] = data
    clear_cost_memos()
    try:
        yield data
    finally:
        if previous is None:
            _OVERRIDES.pop(device_type, None)
        else:
            _OVERRIDES[device_type] = previous
        clear_cost_memos()
