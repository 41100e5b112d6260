"""tools/cpu-dp-step.py: its ``--env`` argument and its table of records per
environment (the tool's processes themselves are run by hand, not here)."""

import argparse
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "cpu-dp-step.py"


@pytest.fixture(scope="module")
def tool():
    return SimpleNamespace(**runpy.run_path(str(TOOL)))  # its functions, main() not run


def test_an_env_argument_is_name_value_words(tool):
    assert tool.environment("") == {}
    assert tool.environment("A=1 B='x y' C=") == {"A": "1", "B": "x y", "C": ""}
    for bad in ("A", "=1", "A=1 B"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
            tool.environment(bad)


def _record(case, engine, env, time_s, rss):
    return dict(case=case, engine=engine, env=env, time_s=time_s, peak_rss_MiB=rss)


def test_the_table_gives_each_environment_its_ratios(tool):
    fast = {"MALLOC_TRIM_THRESHOLD_": "1"}
    records = [
        _record("m", "non-private", {}, 1.0, 100.0),
        _record("m", "grads", {}, 3.0, 300.0),
        _record("m", "grads", {}, 5.0, 500.0),  # two rounds: the median, 4.0
        _record("m", "non-private", fast, 0.5, 110.0),
        _record("m", "grads", fast, 1.0, 320.0),
    ]
    lines = tool.table(records).splitlines()
    assert lines[0].count("E1:") == 1 and lines[0].count("E2:") == 1
    rows = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in lines[2:4]}
    # E1: time, × non-private, RSS; E2: time, × its non-private, × E1, RSS
    assert rows["grads"][2:] == ["4.000", "4.00", "400", "1.000", "2.00", "0.25", "320"]
    assert rows["non-private"][2:] == ["1.000", "1.00", "100", "0.500", "1.00", "0.50", "110"]
    assert lines[-2:] == ["E1: the environment as it is.", "E2: MALLOC_TRIM_THRESHOLD_=1."]


def test_the_table_keeps_trees_apart_and_reads_records_without_an_environment(tool):
    old = dict(tree="/before", time_s=2.0, peak_rss_MiB=10.0)  # records of before --env
    records = [
        dict(case="m", engine="non-private", **{**old, "time_s": 1.0}),
        dict(case="m", engine="grads", **old),
        dict(case="m", engine="non-private", tree="/after", env={}, time_s=1.0),
        dict(case="m", engine="grads", tree="/after", env={}, time_s=3.0),
    ]
    lines = tool.table(records).splitlines()
    assert lines[0].startswith("| model | engine | tree | E1: step (s) |")
    rows = {tuple(line.split(" | ")[1:3]): line.strip("| ").split(" | ") for line in lines[2:6]}
    assert rows[("grads", "/before")][3:] == ["2.000", "2.00", "10"]
    assert rows[("grads", "/after")][3:] == ["3.000", "3.00", "–"]  # no RSS recorded
    assert lines[-1] == "E1: the environment as it is."
