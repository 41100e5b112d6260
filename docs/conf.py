"""Sphinx configuration of memconv's documentation site (``make docs``).

The gallery's examples (``examples/plot_*.py``) run at build time at small sizes;
``MEMCONV_FULL=1 make docs`` runs them at their full sizes. Nothing is fetched from
the network.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

from memconv._version import __version__  # noqa: E402

project = "memconv"
author = "The memconv authors"
copyright = "2026, The memconv authors"
version = release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_gallery.gen_gallery",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/*.txt", "auto_examples/*.ipynb", "**/*.json"]
templates_path: list[str] = []

# ---------------------------------------------------------------- markdown
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# ---------------------------------------------------------------- API reference
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# ---------------------------------------------------------------- gallery (MEMCONV_FULL=1: full sizes)
# the examples save their figures when run as scripts, not while the gallery captures them
os.environ["MEMCONV_GALLERY"] = "1"
sphinx_gallery_conf = {
    "examples_dirs": str(ROOT / "examples"),
    "gallery_dirs": "auto_examples",
    # only examples/plot_*.py form the gallery (and run); other scripts in examples/
    # (command-line tools) stay out of it
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"^(?!plot_)",
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "abort_on_example_error": True,
    "remove_config_comments": True,
    "reset_modules": ("matplotlib",),
    "matplotlib_animations": False,
    "min_reported_time": 0,
    # no computation-time pages: sphinx-gallery writes them with scripts loaded from
    # the internet (jQuery, DataTables), and the site loads nothing from the network
    "write_computation_times": False,
    "show_signature": False,
    "line_numbers": False,
    "capture_repr": (),
}

# ---------------------------------------------------------------- HTML
html_theme = "furo"
html_title = f"memconv {__version__}"
html_static_path: list[str] = []
html_extra_path: list[str] = []
html_show_sourcelink = False

# no intersphinx: the build must not need the network
nitpicky = False


def _public_bases(app, name, obj, options, bases) -> None:
    """Show only public base classes (memconv's private mixins are an implementation
    detail of the extended layers)."""
    bases[:] = [b for b in bases if not getattr(b, "__name__", "").startswith("_")]


# ---------------------------------------------------------------- CLI help, generated
def _write_cli_help() -> None:
    """Write the help of every ``memconv`` command to ``_generated/`` (included by
    ``cli.md``), so that the site always shows what the installed CLI prints."""
    os.environ["COLUMNS"] = "88"
    from memconv.bench.cli import build_parser

    out = DOCS / "_generated"
    out.mkdir(exist_ok=True)
    for name, argv in {
        "memconv": ["--help"],
        "compare": ["compare", "--help"],
        "bench": ["bench", "--help"],
        "suite": ["suite", "--help"],
        "calibrate": ["calibrate", "--help"],
        "list": ["list", "--help"],
    }.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            build_parser().parse_args(argv)
        text = buf.getvalue()
        path = out / f"cli-{name}.txt"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


_write_cli_help()


def setup(app) -> None:
    app.connect("autodoc-process-bases", _public_bases)
