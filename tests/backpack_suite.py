"""BackPACK 1.7.1's own second-order test suite, run alone and with every extension
object routed through memconv.

Used by ``tests/test_backpack_suite.py``. BackPACK's tests are not in its wheel; its
source distribution (MIT licence, fetched once by ``pip download --no-binary`` into
``.cache/backpack``) holds them under ``test/``. :func:`build` unpacks that folder with
BackPACK's ``pytest.ini`` and its licence, and adds three small files, named here:

- ``conftest.py``: where the environment variable ``MEMCONV_BACKPACK_ROUTED`` is set,
  every test runs inside :func:`memconv.integrations.backpack.routed` (every
  ``with backpack(...)`` block BackPACK's test opens installs its extension objects into
  memconv with :func:`~memconv.integrations.backpack.install`'s default arguments), and
  the number of blocks routed is written to that variable's file;
- ``pytorch_memlab.py``: ``test/__init__.py`` imports its ``MemReporter`` for a
  memory helper the second-order tests do not call; the stand-in raises if called;
- ``torchvision/models/resnet.py``: ``test/converter/resnet_cases.py`` (the ResNet
  settings of the DiagGGN and SqrtGGN tests) builds its blocks from torchvision's
  ``BasicBlock`` and ``conv1x1``, reproduced here as torchvision 0.8 writes them
  (memconv never imports torchvision).

The suite runs as BackPACK's CI runs it, without the ``montecarlo`` tests (its
``optional_tests`` setting leaves them out unless asked).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from memcnn_suite import outcomes

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

CONFTEST = f'''"""Routes every BackPACK block through memconv where {ROUTED} names a file."""
import os

import pytest

ROUTED = os.environ.get("{ROUTED}")
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
        with mb.routed():
            yield

    def pytest_sessionfinish(session):
        with open(ROUTED, "w") as f:
            f.write(str(sum(blocks)))
'''

MEMLAB = '''"""Stand-in for pytorch_memlab (test/__init__.py imports it; the second-order tests do not use it)."""


class MemReporter:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("pytorch_memlab is not installed")
'''

# torchvision 0.8's torchvision/models/resnet.py: conv3x3, conv1x1 and BasicBlock.
RESNET = '''"""torchvision 0.8's ResNet ``conv3x3``, ``conv1x1`` and ``BasicBlock``, as written there."""
import torch.nn as nn


def conv3x3(in_planes, out_planes, stride=1, groups=1, dilation=1):
    """3x3 convolution with padding"""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride,
                     padding=dilation, groups=groups, bias=False, dilation=dilation)


def conv1x1(in_planes, out_planes, stride=1):
    """1x1 convolution"""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1,
                 base_width=64, dilation=1, norm_layer=None):
        super(BasicBlock, self).__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        if groups != 1 or base_width != 64:
            raise ValueError('BasicBlock only supports groups=1 and base_width=64')
        if dilation > 1:
            raise NotImplementedError("Dilation > 1 not supported in BasicBlock")
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x

        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)

        out = self.conv2(out)
        out = self.bn2(out)

        if self.downsample is not None:
            identity = self.downsample(x)

        out += identity
        out = self.relu(out)

        return out
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
    found = find_sdist()
    if found is not None:
        return found, ""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary"]
    command += [":all:", "--retries", "1", "--timeout", "15"]
    command += [f"backpack-for-pytorch=={VERSION}", "-d", str(SDIST_DIRS[0])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"pip download backpack-for-pytorch=={VERSION} (sdist) failed: {e}"
    found = find_sdist()
    if found is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        why = f"pip download backpack-for-pytorch=={VERSION} (sdist) failed: {tail[0]}"
        return None, why
    return found, ""


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


def run(folder: Path, routed: bool, *args: str, timeout: float = 1800):
    """BackPACK's second-order tests in a fresh pytest process (memconv from this source
    tree), routed through memconv or not. Returns each test's outcome (``passed``,
    ``failed``, ``error``, ``skipped``) by its id, and the number of extension objects
    routed (None when not routed)."""
    report = folder / ("routed.xml" if routed else "alone.xml")
    count = folder / "routed-count.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    env["OMP_NUM_THREADS"] = "1"  # tiny tensors: one thread
    env.pop(ROUTED, None)
    if routed:
        env[ROUTED] = str(count)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    command += ["--rootdir", str(folder), "-m", "not montecarlo", f"--junitxml={report}"]
    command += [*args, SUITE]
    subprocess.run(command, env=env, cwd=folder, timeout=timeout, capture_output=True)
    return outcomes(report), (int(count.read_text()) if routed else None)
