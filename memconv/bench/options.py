"""Command-line options shared by ``memconv compare`` and ``memconv bench``, their
checks (before any work), and the check of optional dependencies."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys

from .data import SOURCES


def _int_at_least(minimum: int, words: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}")
        return value

    return parse


#: argparse type: a positive integer.
positive_int = _int_at_least(1, "a positive integer")
#: argparse type: an integer ≥ 0.
non_negative_int = _int_at_least(0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a positive finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def add_common(parser: argparse.ArgumentParser, *, data_default: str | None) -> None:
    """``--data``, ``--device``, ``--repeats``, ``--json``, ``--plot``."""
    natural = (
        f"default: {data_default}"
        if data_default
        else "default: each case's own real data, digits for the seed CNN and photo crops "
        "for the others"
    )
    parser.add_argument(
        "--data",
        choices=SOURCES,
        default=data_default,
        help="input data: scikit-learn's handwritten digits, crops of scikit-image's "
        f"photographs, or random noise ({natural})",
    )
    parser.add_argument(
        "--device", default="cpu", help="torch device to run on, e.g. cpu or cuda (default: cpu)"
    )
    parser.add_argument(
        "--repeats",
        type=non_negative_int,
        default=3,
        metavar="R",
        help="timed calls per measurement; the median is reported (default: 3; 0: no timing)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write every measurement to PATH as JSON Lines, one line as each "
        "measurement completes (the first line records the command and the machine)",
    )
    parser.add_argument(
        "--plot", metavar="PATH", help="save a figure of the results to PATH (needs matplotlib)"
    )


def parse_names(text: str | None, accepted, option: str) -> list[str] | None:
    """A comma-separated list of names, each one of ``accepted`` (``"all"``: all of them).

    Raises:
        ValueError: an empty list or an unknown name (naming the option and the
            accepted names).
    """
    if text is None:
        return None
    accepted = list(accepted)
    if text.strip() == "all":
        return accepted
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"{option} needs at least one name; accepted: {', '.join(accepted)}")
    for n in names:
        if n not in accepted:
            raise ValueError(f"{option}: unknown name {n!r}; accepted: {', '.join(accepted)}")
    return list(dict.fromkeys(names))


def parse_range(text: str, option: str = "--range") -> list[int]:
    """``"8,16,32"``: positive integers, strictly increasing, at least one.

    Raises:
        ValueError: naming the option and what is wrong.
    """
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(
            f"{option} must be a comma-separated list of positive integers, e.g. 8,16,32; "
            f"got {text!r}"
        )
    values = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise ValueError(f"{option}: {p!r} is not an integer (got {text!r})") from None
        if v < 1:
            raise ValueError(f"{option}: values must be positive, got {v} in {text!r}")
        values.append(v)
    for a, b in zip(values, values[1:]):
        if b <= a:
            raise ValueError(f"{option}: values must be strictly increasing, got {a} then {b}")
    return values


def check_device(device: str) -> None:
    """Raise unless ``device`` names a torch device that is available.

    Raises:
        ValueError: naming the option.
    """
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device: {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")


#: The package each data source reads (``--data``).
DATA_PACKAGES = {"digits": "sklearn", "photos": "skimage"}


def check_dependencies(
    engines=(),
    *,
    plot: bool = False,
    measure: bool = True,
    table: bool = True,
    data: str | None = None,
) -> None:
    """Raise before a long run if a needed optional package is missing.

    Args:
        engines: the :class:`~memconv.bench.engines.Engine` objects asked for by name.
        plot: matplotlib is needed.
        measure: memory_profiler is needed.
        table: tabulate is needed (the tables printed at the end).
        data: the ``--data`` source (scikit-learn for digits, scikit-image for photos).

    Raises:
        ImportError: naming each missing package and how to install it.
    """
    needs = {}
    if measure:
        needs["memory_profiler"] = "pip install 'memconv[bench]'"
    if table:
        needs["tabulate"] = "pip install 'memconv[bench]'"
    if data in DATA_PACKAGES:
        needs[DATA_PACKAGES[data]] = "pip install 'memconv[bench]' (or --data random)"
    if plot:
        needs["matplotlib"] = "pip install 'memconv[bench]' (or drop --plot)"
    for engine in engines:
        if engine.requires:
            needs[engine.requires] = (
                f"pip install 'memconv[{engine.requires}]' (or leave out the engine {engine.name})"
            )
    missing = [f"{m}: {how}" for m, how in needs.items() if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError("missing optional dependencies: " + "; ".join(missing))


def command_line(argv=None) -> str:
    """The command as typed, ``memconv ...``."""
    argv = sys.argv[1:] if argv is None else argv
    return "memconv " + shlex.join(argv)


def prepare_outputs(*paths) -> None:
    """Create the folders of the output files given (None: no file) before any work,
    so that a run does not fail at its end on a missing folder."""
    from pathlib import Path

    for path in paths:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)


def strict_float32(device: str) -> None:
    """On a CUDA device, turn TF32 off for matrix products and for cuDNN's convolutions
    (torch keeps it on for convolutions by default): a float32 result then carries
    float32's round-off, and its deviation from the reference (1e-3 accepted) measures
    the engine, not TF32's 10-bit mantissa (which puts every engine, torch.func's own
    repeated runs included, 1e-2 apart on the GroupNorm ResNets). Nothing on another
    device. The run record says which it was (:func:`device_record`)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def benchmark_backend(device: str) -> str:
    """``torch.compile``'s backend for a benchmark's compiled rows on ``device``:
    inductor, except on a CUDA device whose Python lacks triton (inductor's GPU code
    generator), where it is ``"cudagraphs"`` (the step captured as CUDA graphs)."""
    import torch

    if torch.device(device).type != "cuda" or importlib.util.find_spec("triton"):
        return "inductor"
    return "cudagraphs"


def device_record(device: str) -> dict:
    """The device a run measures on: its type, its name (the card's, for CUDA) and, on
    CUDA, whether TF32 is on for matrix products and convolutions (it changes float32
    results at the 1e-3 level)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return {"type": dev.type}
    return {
        "type": "cuda",
        "name": torch.cuda.get_device_name(dev),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }


def last_level_cache(device) -> int | None:
    """The last-level cache of ``device`` in bytes (a CPU's highest cache level as
    Linux's sysfs lists it for the first core; a CUDA device's L2), or None where it
    is not known."""
    from pathlib import Path

    import torch

    device = torch.device(device)
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or None
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    levels = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if size[-1:] in units and size[:-1].isdigit():
            levels[level] = int(size[:-1]) * units[size[-1]]
        elif size.isdigit():
            levels[level] = int(size)
    return levels[max(levels)] if levels else None


def machine() -> dict:
    """CPU model, threads and versions, for the JSON records."""
    import platform

    import torch

    import memconv

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    cache = last_level_cache(torch.device("cpu"))
    return {
        **gpu,
        "cpu": cpu,
        **({"cache_bytes": cache} if cache else {}),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "memconv": memconv.__version__,
        "python": platform.python_version(),
    }
