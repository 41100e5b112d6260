"""BackPACK 1.7.1's own second-order test suite, run alone and with every extension
object routed through memconv.

Used by ``tests/test_backpack_suite.py``. BackPACK's tests are not in its wheel; its
source distribution (MIT licence, fetched once by ``pip download --no-binary`` into
``.cache/backpack``) holds them under ``test/``. :func:`build` unpacks that folder with
BackPACK's ``pytest.ini`` and its licence, and adds three small files, named here:

- ``conftest.py``: where the environment variable ``MEMCONV_BACKPACK_ROUTED`` is set,
  every test runs inside :func:`memconv.integrations.backpack.routed` (every
  ``with backpack(...)`` block BackPACK's test opens installs its extension objects into
  memconv with :func:`~memconv.integrations.backpack.install`'s default arguments, or
  the ``memory_budget`` in bytes that ``MEMCONV_BACKPACK_BUDGET`` gives), and the
  number of extension objects routed is written to that variable's file;
- ``pytorch_memlab.py``: ``test/__init__.py`` imports its ``MemReporter`` for a
  memory helper the second-order tests do not call; the stand-in raises if called;
- ``torchvision/models/resnet.py``: ``test/converter/resnet_cases.py`` (the ResNet
  settings of the DiagGGN and SqrtGGN tests) builds its blocks from torchvision's
  ``BasicBlock`` and ``conv1x1``: memconv's reproduction of the block
  (:class:`memconv.bench.models.TVBasicBlock`) under torchvision's signature (memconv
  never imports torchvision).

The suite runs as BackPACK's CI runs it, without the ``montecarlo`` tests (its
``optional_tests`` setting leaves them out unless asked).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from memcnn_suite import outcomes, pip_download

ROOT = Path(__file__).resolve().parent.parent
VERSION = "1.7.1"
SDIST = f"backpack_for_pytorch-{VERSION}.tar.gz"
#: Where the source distribution is looked for (the first that holds it), and fetched into.
SDIST_DIRS = (
    Path(os.environ.get("MEMCONV_BACKPACK_SDIST", ROOT / ".cache" / "backpack")),
    ROOT / "wheels",
)
#: BackPACK's test folder this suite runs.
SUITE = "test/extensions/secondorder"
ROUTED = "MEMCONV_BACKPACK_ROUTED"
BUDGET = "MEMCONV_BACKPACK_BUDGET"

CONFTEST = f'''"""Routes every BackPACK block through memconv where {ROUTED} names a file."""
import os

import pytest

ROUTED = os.environ.get("{ROUTED}")
BUDGET = os.environ.get("{BUDGET}")
blocks = []

if ROUTED:
    from memconv.integrations import backpack as mb

    _install = mb.install

    def _counting_install(*exts, **kwargs):
        blocks.append(len(exts))
        return _install(*exts, **kwargs)

    mb.install = _counting_install

    @pytest.fixture(autouse=True)
    def _routed_through_memconv():
        with mb.routed(**({{"memory_budget": int(BUDGET)}} if BUDGET else {{}})):
            yield

    def pytest_sessionfinish(session):
        with open(ROUTED, "w") as f:
            f.write(str(sum(blocks)))
'''

MEMLAB = '''"""Stand-in for pytorch_memlab (test/__init__.py imports it, the tests run do not)."""


class MemReporter:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("pytorch_memlab is not installed")
'''

# torchvision's ResNet ``conv1x1`` and ``BasicBlock`` (the signature of torchvision 0.8,
# which resnet_cases.py calls positionally), on memconv's reproduction of the block.
RESNET = '''"""torchvision's ResNet ``conv1x1`` and ``BasicBlock`` (memconv.bench.models)."""
import torch.nn as nn

from memconv.bench.models import TVBasicBlock


def conv1x1(in_planes, out_planes, stride=1):
    """1x1 convolution"""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(TVBasicBlock):
    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1,
                 base_width=64, dilation=1, norm_layer=None):
        if groups != 1 or base_width != 64:
            raise ValueError("BasicBlock only supports groups=1 and base_width=64")
        if dilation > 1:
            raise NotImplementedError("Dilation > 1 not supported in BasicBlock")
        super().__init__(inplanes, planes, stride, downsample, norm_layer or nn.BatchNorm2d)
'''

ADDED = {
    "conftest.py": CONFTEST,
    "pytorch_memlab.py": MEMLAB,
    "torchvision/__init__.py": "",
    "torchvision/models/__init__.py": "",
    "torchvision/models/resnet.py": RESNET,
}


def find_sdist() -> Path | None:
    """BackPACK's source distribution where it was fetched before, or None."""
    for folder in SDIST_DIRS:
        if (folder / SDIST).is_file():
            return folder / SDIST
    return None


def fetch_sdist(timeout: float = 120) -> tuple[Path | None, str]:
    """The source distribution, fetched into the first of :data:`SDIST_DIRS` by
    ``pip download`` unless it is there; ``(None, why)`` when it cannot be fetched."""
    if find_sdist() is None:
        requirement = f"backpack-for-pytorch=={VERSION}"
        why = pip_download(requirement, SDIST_DIRS[0], "--no-binary", ":all:", timeout=timeout)
        if find_sdist() is None:
            return None, f"{why} (source distribution)"
    return find_sdist(), ""


def build(sdist: Path, dest: Path) -> Path:
    """BackPACK's ``test/`` package, ``pytest.ini`` and licence unpacked into ``dest``
    with the files of :data:`ADDED`; returns ``dest``."""
    top = f"backpack_for_pytorch-{VERSION}/"
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = member.name[len(top) :] if member.name.startswith(top) else ""
            keep = name.startswith("test/") and name.endswith(".py")
            if not (member.isfile() and (keep or name in ("pytest.ini", "LICENSE.txt"))):
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.extractfile(member).read())
    for name, text in ADDED.items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return dest


def run(folder: Path, routed: bool, *args: str, memory_budget=None, timeout: float = 1800):
    """BackPACK's second-order tests in a fresh pytest process (memconv from this source
    tree), routed through memconv or not (``memory_budget``: bytes for ``routed``, None
    for its default). Returns each test's outcome (``passed``, ``failed``, ``error``,
    ``skipped``) by its id, and the number of extension objects routed (None when not
    routed)."""
    report = folder / ("routed.xml" if routed else "alone.xml")
    count = folder / "routed-count.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    env["OMP_NUM_THREADS"] = "1"  # tiny tensors: one thread
    env.pop(ROUTED, None)
    env.pop(BUDGET, None)
    if routed:
        env[ROUTED] = str(count)
    if memory_budget is not None:
        env[BUDGET] = str(memory_budget)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    command += ["--rootdir", str(folder), "-m", "not montecarlo", f"--junitxml={report}"]
    command += [*args, SUITE]
    subprocess.run(command, env=env, cwd=folder, timeout=timeout, capture_output=True)
    return outcomes(report), (int(count.read_text()) if routed else None)
