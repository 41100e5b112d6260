"""The Makefile names the interpreter by its real file: run inside the activated venv
(whose ``python3`` is a link to the interpreter that made it), make sees the same
interpreter and keeps the venv, where it would otherwise delete it and rebuild it with
the link into the deleted folder."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python_id(python: str) -> str:
    done = subprocess.run(
        [
            "make",
            "-s",
            "--eval",
            "print-python-id: ; @echo $(PYTHON_ID)",
            "print-python-id",
            f"PYTHON={python}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_a_link_to_the_interpreter_is_the_same_interpreter(tmp_path):
    link = tmp_path / "python3"
    link.symlink_to(os.path.realpath(sys.executable))  # as a venv's bin/python3 is
    real = _python_id(os.path.realpath(sys.executable))
    assert real.split()[0] == os.path.realpath(sys.executable)
    assert _python_id(str(link)) == real
