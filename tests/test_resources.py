"""The memory a process can use (meminfo, cgroup v1/v2 files), the default budget, and
the planner's answer when a batch's per-sample result cannot fit."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

import memconv
from memconv.engine import resources


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_mem_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    write(meminfo, "MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:  500 kB\n")
    assert resources.mem_available(str(meminfo)) == 500 * 1024
    assert resources.mem_available(str(tmp_path / "missing")) is None


def test_cgroup_v2_limit_minus_usage(tmp_path):
    write(tmp_path / "self", "0::/box\n")
    write(tmp_path / "fs" / "box" / "memory.max", "2147483648\n")
    write(tmp_path / "fs" / "box" / "memory.current", "1073741824\n")
    assert resources.cgroup_room(str(tmp_path / "self"), str(tmp_path / "fs")) == 2**30
    write(tmp_path / "fs" / "box" / "memory.max", "max\n")  # no limit
    assert resources.cgroup_room(str(tmp_path / "self"), str(tmp_path / "fs")) is None


def test_cgroup_v1_limit_minus_usage_and_unlimited(tmp_path):
    write(tmp_path / "self", "5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n")
    base = tmp_path / "fs" / "memory" / "docker" / "abc"
    write(base / "memory.limit_in_bytes", str(3 * 2**30))
    write(base / "memory.usage_in_bytes", str(2**30))
    assert resources.cgroup_room(str(tmp_path / "self"), str(tmp_path / "fs")) == 2 * 2**30
    write(base / "memory.limit_in_bytes", str(2**63 - 4096))  # v1's "unlimited"
    assert resources.cgroup_room(str(tmp_path / "self"), str(tmp_path / "fs")) is None


def test_default_budget_keeps_headroom(monkeypatch):
    monkeypatch.setattr(resources, "mem_available", lambda: 10 * 2**30)
    monkeypatch.setattr(resources, "cgroup_room", lambda: 4 * 2**30)  # a container limit
    assert resources.available_memory() == 4 * 2**30
    assert resources.default_budget() == 4 * 2**30 - int(0.15 * 4 * 2**30)
    monkeypatch.setattr(resources, "cgroup_room", lambda: 100 * 2**20)
    assert resources.default_budget() == 1  # less than the headroom: nothing to plan with
    monkeypatch.setattr(resources, "mem_available", lambda: None)
    monkeypatch.setattr(resources, "cgroup_room", lambda: None)
    with pytest.raises(RuntimeError, match="give memory_budget"):
        resources.available_memory()


def small():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).double()
    return model, torch.randn(16, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (16,))


def test_the_default_budget_is_the_available_memory_and_is_logged(monkeypatch, caplog):
    model, x, y = small()
    monkeypatch.setattr(resources, "available_memory", lambda device=None: 2**30)
    with caplog.at_level(logging.INFO, logger="memconv"):
        plan = memconv.plan(model, x)
    assert plan.memory_budget == resources.default_budget()
    assert "memory_budget='available'" in caplog.text
    ref = memconv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, memory_budget=None)
    got = memconv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-12, atol=0)


def test_a_result_that_cannot_fit_raises_naming_the_largest_batch(monkeypatch):
    model, x, y = small()
    per_sample = sum(p.numel() * p.element_size() for p in model.parameters())
    smallest = memconv.plan(model, x, memory_budget=None).smallest_budget
    budget = smallest - 8 * per_sample  # room for about 8 of the 16 samples' gradients
    with pytest.raises(ValueError, match=r"the largest batch that fits is [5-8]\b"):
        memconv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, memory_budget=budget)


def test_bad_budgets_name_the_accepted_values():
    model, x, y = small()
    with pytest.raises(ValueError, match=r"2 \* 2\*\*30 for 2 GiB\), 'available' .* or None"):
        memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x, y, memory_budget="all")
    with pytest.raises(TypeError, match="'available' .* or None"):
        memconv.plan(model, x, memory_budget=1.5)


@pytest.mark.parametrize("budget", ["2GB", 1.5, 0, -1, True])
def test_one_budget_check_everywhere(budget):
    """Every function taking a budget raises the same exception (a ValueError and a
    TypeError both) with the accepted forms, "2GB" included."""
    from memconv._checks import BudgetError
    from memconv.streaming import StreamingCNN

    model, x, y = small()
    loss = nn.CrossEntropyLoss()
    calls = [
        lambda: memconv.clip_and_accumulate(model, loss, x, y, max_norm=1.0, memory_budget=budget),
        lambda: memconv.per_sample_grads(model, loss, x, y, memory_budget=budget),
        lambda: memconv.per_sample_norms(model, loss, x, y, memory_budget=budget),
        lambda: memconv.plan(model, x, memory_budget=budget),
        lambda: memconv.PrivateStep(model, loss, memory_budget=budget),
        lambda: memconv.save_memory("auto", memory_budget=budget),
        lambda: StreamingCNN(nn.Sequential(nn.Conv2d(1, 2, 3)), "auto", memory_budget=budget),
    ]
    for call in calls:
        with pytest.raises(
            BudgetError, match=r"memory_budget must be a positive int of bytes \(2 \* 2\*\*30"
        ):
            call()
    assert issubclass(BudgetError, ValueError) and issubclass(BudgetError, TypeError)


def test_a_batch_without_its_channel_axis_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.GroupNorm(2, 8), nn.Flatten(), nn.Linear(8 * 26 * 26, 3)
    )
    x, y = torch.randn(4, 28, 28), torch.randint(0, 3, (4,))
    for call in (memconv.per_sample_grads, memconv.per_sample_norms):
        with pytest.raises(
            ValueError, match=r"inputs of shape \[4, 28, 28\].*'0' \(Conv2d\).*channel axis"
        ):
            call(model, nn.CrossEntropyLoss(), x, y)
    memconv.per_sample_norms(model, nn.CrossEntropyLoss(), x.unsqueeze(1), y)


def test_process_budget_nests_and_trims():
    with resources.process_budget():
        with resources.process_budget():
            assert resources._depth == 2
    assert resources._depth == 0


def test_the_process_guard_applies_to_explicit_or_tight_budgets():
    def plan(m, peak):
        return memconv.Plan("clip", 64, m, 2**20, peak, memory_budget=1000)

    assert resources.guards(300 * 2**20, plan(64, 10))  # explicit: always
    assert not resources.guards("available", plan(64, 100))  # the default, loose
    assert resources.guards("available", plan(16, 100))  # the default, splitting the batch
    assert resources.guards("available", plan(64, 600))  # the default, tight
    assert not resources.guards(None, None)


def test_kept_files_read_what_opening_them_again_reads(tmp_path):
    kept = resources.KeptFiles()
    try:
        path = tmp_path / "memory.current"
        write(path, "1073741824\n")
        assert resources._read_int(str(path), kept) == 2**30
        path.write_text("2147483648\n")  # rewritten in place: the kept file reads it
        assert resources._read_int(str(path), kept) == 2**31
        write(path, "5" * 70000)  # longer than one read
        assert kept.read(str(path)) == b"5" * 70000
        assert resources._read_int(str(tmp_path / "missing"), kept) is None
    finally:
        kept.close()


def test_the_system_files_read_as_a_fresh_open_reads_them():
    if not os.path.exists(resources.MEMINFO):
        pytest.skip("no /proc/meminfo")
    fresh = resources.mem_available("/proc//meminfo")  # another name: opened afresh
    kept = resources.mem_available()
    assert kept is not None and abs(kept - fresh) < 2**30
    assert resources.cgroup_room() == resources.cgroup_room("/proc/self//cgroup")
    assert resources.available_memory() > 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_reads_its_own_files():
    resources.mem_available()
    resources.cgroup_room()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its /proc/self is itself
        ok = resources.mem_available() is not None and (
            resources.cgroup_room() == resources.cgroup_room("/proc/self//cgroup")
        )
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.close(w)
