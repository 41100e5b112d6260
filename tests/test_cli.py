"""The command line explains itself, and the package installs as declared."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import memconv
from memconv.bench import cli
from memconv.bench.cases import CASES
from memconv.bench.data import SOURCES
from memconv.bench.engines import ENGINES, TASKS
from memconv.bench.options import check_dependencies
from memconv.bench.runner import JsonLines, read_records

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
REST_MARKUP = re.compile(r"``|:(func|class|mod|meth|data|attr):`")
COMMANDS = {"memconv": (), "compare": ("compare",), "bench": ("bench",), "list": ("list",)}


def help_of(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "memconv", *argv, "--help"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    return {name: help_of(*argv) for name, argv in COMMANDS.items()}


def test_help_is_plain_words(helps):
    for name, text in helps.items():
        assert not REST_MARKUP.search(text), name
        assert not re.search(r"\bissues?\b|tracker", text, re.IGNORECASE), name


def test_top_level_help_lists_the_commands(helps):
    for command in ("compare", "bench", "list"):
        assert command in helps["memconv"]
    assert "--version" in helps["memconv"]


@pytest.mark.parametrize("command", ["compare", "bench"])
def test_every_accepted_name_is_in_the_help(helps, command):
    # argparse wraps long help lines at hyphens: compare the text without line breaks
    text = re.sub(
        r"-?\n\s*", lambda m: m.group(0)[0] if m.group(0)[0] == "-" else " ", helps[command]
    )
    names = (*memconv.available_strategies(), *SOURCES)
    if command == "bench":
        names += (*TASKS, *CASES, *(e for task in ENGINES.values() for e in task))
    for name in names:
        assert name in text, (command, name)


def test_compare_and_bench_share_option_names():
    def options(command):
        parser = cli.build_parser()
        sub = parser._subparsers._group_actions[0].choices[command]
        return {s for a in sub._actions for s in a.option_strings}

    shared = {"--batch-size", "--side", "--data", "--device", "--repeats", "--json", "--plot"}
    assert shared <= options("compare")
    assert shared <= options("bench")


def test_version_has_one_source():
    proc = subprocess.run(
        [sys.executable, "-m", "memconv", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"memconv {memconv.__version__}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert (ROOT / "memconv" / "_version.py").read_text().count(memconv.__version__) == 1


def test_unknown_names_are_rejected_listing_the_accepted_ones(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--strategies", "fastest"])
    err = capsys.readouterr().err
    assert "fastest" in err and "shift" in err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--data", "real"])
    assert "digits" in capsys.readouterr().err


def test_list_prints_a_line_on_each_name(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    engines = (e for task in ENGINES.values() for e in task)
    lines = out.splitlines()
    for name in (*memconv.available_strategies(), *TASKS, *engines, *CASES, *SOURCES):
        line = next(x for x in lines if x.split() and x.split()[0] == name)
        assert len(line.split()) >= 2, line  # the name and a description


def test_terminal_tables_fit_100_columns_without_markdown():
    from memconv.bench.report import format_case, terminal

    config = {"model": "seed", "batch": 64, "side": 28, "data": "digits"}
    rows = [
        {
            "engine": e,
            "peak_rss_mib": 1234.0,
            "peak_alloc_mib": 1200.0,
            "time_s": 0.123,
            "result_mib": 113.0,
            "deviation": 1e-7,
        }
        for e in ("autograd", "torch.func", "memconv:standard", "memconv:auto")
    ] + [
        {
            "engine": "memconv:budget",
            "memory_budget_mib": 160.0,
            "peak_rss_mib": 150.0,
            "peak_alloc_mib": 140.0,
            "time_s": 0.3,
            "result_mib": 113.0,
            "deviation": 1e-7,
        }
    ]
    markdown = format_case("grads", config, rows)
    assert "**" in markdown and "|---" in markdown  # files keep Markdown
    text = terminal(markdown)
    assert "**" not in text and "|" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "memconv:budget (160 MiB)" in text


def test_quick_is_a_small_smoke_test():
    from memconv.bench.bench import QUICK_CASES, QUICK_ENGINES, check_arguments

    for task in ("grads", "clip"):
        args = cli.build_parser().parse_args(["bench", "--quick", "--task", task])
        plan = check_arguments(args)
        assert plan["cases"] == list(QUICK_CASES[task])
        assert plan["engines"] == list(QUICK_ENGINES[task])
        assert len(plan["cases"]) * len(plan["engines"]) <= 4  # processes, each seconds


def test_a_users_report_shows_no_project_targets(tmp_path, capsys):
    path = tmp_path / "clip.jsonl"
    config = {"model": "resnet18-gn", "batch": 64, "side": 32}
    rows = [
        {
            "record": "row",
            "task": "clip",
            "case": "resnet18-gn",
            "config": config,
            "engine": e,
            "peak_rss_mib": m,
            "peak_alloc_mib": m,
            "time_s": t,
            "result_mib": 42.6,
            "deviation": 0.0,
        }
        for e, m, t in (("non-private", 400.0, 2.0), ("memconv:auto", 440.0, 4.0))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["bench", "--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "memconv:auto" in out and "missed" not in out and "targets" not in out


def test_missing_dependency_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "matplotlib" else find_spec(name)
    )
    with pytest.raises(ImportError, match=r"matplotlib: pip install 'memconv\[bench\]'"):
        check_dependencies(plot=True, measure=False)
    check_dependencies(plot=False, measure=False)
    opacus = ENGINES["grads"]["opacus-hooks"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'memconv\[opacus\]'"):
        check_dependencies([opacus], measure=False)


def test_json_is_written_line_by_line(tmp_path):
    path = tmp_path / "out.jsonl"
    record = JsonLines(str(path), {"command": "memconv bench"})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"command": "memconv bench"}
    ]
    record.write({"engine": "a"})
    assert read_records([path])[-1] == {"engine": "a", "file": str(path)}


def test_core_imports_no_optional_dependency():
    code = (
        "import sys, memconv, memconv.streaming, memconv.integrations.backpack\n"
        "heavy = {'sklearn', 'skimage', 'matplotlib', 'memory_profiler', 'backpack', 'opacus'}\n"
        "print(sorted(heavy & set(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_package_files():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert (ROOT / "memconv" / "py.typed").exists()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["dependencies"] == ["torch>=2.2", "tqdm", "numpy"]
    data = pyproject["tool"]["setuptools"]["package-data"]["memconv"]
    assert data == ["py.typed", "calibration/*.json"]
    assert (ROOT / "memconv" / "calibration" / "cpu.json").exists()  # read per device type


@pytest.mark.parametrize("missing", ["tabulate", "sklearn"])
def test_bench_without_a_needed_package_stops_before_measuring(monkeypatch, capsys, missing):
    """The printed tables need tabulate, --data digits scikit-learn: both are checked
    with the arguments, and the message names the install command."""
    import importlib.util

    import memconv.bench.bench as bench_mod

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == missing else find_spec(name)
    )
    measured = []
    monkeypatch.setattr(bench_mod, "matrix", lambda *a: measured.append(a) or 0)
    with pytest.raises(SystemExit):
        cli.main(
            [
                "bench",
                "--task",
                "grads",
                "--cases",
                "seed-28",
                "--engines",
                "autograd",
                "--data",
                "digits",
            ]
        )
    assert f"{missing}: pip install 'memconv[bench]'" in capsys.readouterr().err
    assert not measured


def test_plot_and_json_folders_are_made_before_the_run(tmp_path):
    from memconv.bench import bench, compare

    plot, json_path = tmp_path / "a" / "plot.png", tmp_path / "b" / "out.jsonl"
    args = cli.build_parser().parse_args(
        ["bench", "--quick", "--plot", str(plot), "--json", str(json_path)]
    )
    bench.check_arguments(args)
    assert plot.parent.is_dir() and json_path.parent.is_dir()
    plot = tmp_path / "c" / "compare.png"
    args = cli.build_parser().parse_args(["compare", "--plot", str(plot)])
    compare.check_arguments(args)
    assert plot.parent.is_dir()


def test_the_run_record_names_the_device():
    from memconv.bench import bench

    args = cli.build_parser().parse_args(["bench", "--quick", "--device", "cpu"])
    assert bench._header(args, "matrix")["device"] == {"type": "cpu"}
