"""The folder is the level: each part of memconv imports only the parts listed before it.

The order (docs/design.md, "Layout"):

0. ``_version``, ``_checks``, ``_torch``: nothing of memconv;
1. ``strategies/``: one convolution's weight-VJP algorithms and their normal form;
2. ``conv/``: one convolution under ``save_memory``/``per_sample``;
3. ``layers/``: one layer (its rule), one operation (its binder);
4. ``modules.py``: the extended layers;
5. ``streaming/``: whole trunks over huge images;
6. ``reversible/``: reversible blocks (their inputs released, reconstructed);
7. ``engine/``: one model (recorder, probes, calls, coverage, walk, plans, passes);
8. ``tasks/``: the whole-model calls (per-sample gradients, norms, clipping);
9. ``integrations/``: BackPACK and Opacus;
10. ``bench/`` (the measurements and the command line), ``__main__`` and the package itself.

The imports are read from the source (every ``import`` and ``from ... import``, those
inside functions included), so a deferred import cannot hide a step back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "memconv"

#: The parts of memconv in their order; a part imports only itself and earlier parts.
LEVELS = (
    ("_version", "_checks", "_torch"),
    ("strategies",),
    ("conv",),
    ("layers",),
    ("modules",),
    ("streaming",),
    ("reversible",),
    ("engine",),
    ("tasks",),
    ("integrations",),
    ("bench", "__main__", "__init__"),
)
LEVEL = {part: i for i, parts in enumerate(LEVELS) for part in parts}


def _module(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _part(module: str) -> str:
    """The part of memconv a module belongs to (``memconv`` itself: ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """The memconv modules (or packages) a file imports."""
    module, is_package = _module(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "memconv" or target.startswith("memconv."):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names if target == "memconv")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "memconv")
    out.discard(module)
    return out


FILES = sorted(PACKAGE.rglob("*.py"))


def test_every_part_has_a_level():
    parts = {_part(_module(f)[0]) for f in FILES}
    assert parts <= set(LEVEL), sorted(parts - set(LEVEL))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_part_imports_only_itself_and_the_parts_before_it(path):
    module, _ = _module(path)
    own = _part(module)
    if LEVEL[own] == len(LEVELS) - 1:  # the top: the public names, the command line
        return
    later = []
    for target in _imports(path):
        part = _part(target)
        if part != own and LEVEL[part] >= LEVEL[own]:
            later.append(target)
    assert not later, f"{module} ({own}) imports {sorted(later)}"


def test_no_import_circles():
    graph = {_module(f)[0]: _imports(f) for f in FILES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n not in graph or n == "memconv":
                continue
            if state.get(n) == 1:
                raise AssertionError(" -> ".join(stack[stack.index(n) :] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state and m != "memconv":
            visit(m)


def test_at_most_six_modules_directly_in_the_package():
    direct = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(direct) <= 6, direct


def test_no_formatter_escapes():
    """No comment that turns the formatter off (its skip or off mark) in the package,
    its tests, examples or tools: the formatter lays out every line (a line too long is
    shortened instead)."""
    root = PACKAGE.parent
    files = [p for d in ("memconv", "tests", "examples", "tools") for p in (root / d).rglob("*.py")]
    marks = ("fmt: " + "skip", "fmt: " + "off")  # (not written whole: this file would match)
    escaped = [
        f"{p.relative_to(root)}:{i}"
        for p in sorted(files)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if any(m in line for m in marks)
    ]
    assert not escaped, escaped
