"""CPU work takes the cores free now: affinity less the busy ones, or what OMP_NUM_THREADS says; every
command that runs torch on the CPU sets it."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from click.testing import CliRunner

from dflash_cache import cpu_threads
from dflash_cache.cli import cli
from dflash_cache.cpu_threads import ENV, choose_cpu_threads, use_free_cores
from dflash_cache.errors import UserError
from tools.make_demo_drafter import ASSET_DIR


@pytest.fixture(autouse=True)
def nothing_said_yet(monkeypatch):
    """Each test starts as a fresh process does: no thread count said yet, and not a host's later rank."""
    monkeypatch.setattr(cpu_threads, "_said", None, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


@pytest.fixture
def machine(monkeypatch):
    """A machine of `cores` cores, `allowed` of them this process's, with the given 1-minute load."""

    def make(*, allowed: int, cores: int, load: float) -> None:
        monkeypatch.delenv(ENV, raising=False)
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(allowed)))
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))

    return make


@pytest.mark.parametrize(("allowed", "cores", "load", "threads"), [
    (2, 2, 0.0, 2),    # an idle machine: every core
    (2, 2, 0.4, 2),    # a little background work takes no core
    (2, 2, 1.2, 1),    # another job on one core
    (2, 2, 7.0, 1),    # overloaded: still one
    (16, 16, 3.6, 12),
    (4, 64, 32.0, 2),  # 4 of 64 cores, the machine half busy: half of ours
])
def test_the_free_cores(machine, allowed, cores, load, threads):
    machine(allowed=allowed, cores=cores, load=load)
    choice = choose_cpu_threads()
    assert choice.threads == threads, choice
    assert f"of {allowed} cores free" in choice.why and f"{load:.2f}" in choice.why


def test_ranks_on_one_cpu_split_its_free_cores(machine):
    machine(allowed=16, cores=16, load=4.0)
    assert choose_cpu_threads(share=4).threads == 3
    assert choose_cpu_threads(share=32).threads == 1


def test_a_busy_machine_says_no_core_is_free_and_takes_one(machine):
    machine(allowed=2, cores=2, load=3.8)
    choice = choose_cpu_threads()
    assert choice.threads == 1 and choice.why.startswith("0 of 2 cores free") and choice.why.endswith("at least one")


def test_no_load_average_counts_the_cores_as_free(machine, monkeypatch):
    machine(allowed=4, cores=4, load=0.0)

    def unavailable():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert choose_cpu_threads().threads == 4


@pytest.mark.parametrize(("given", "threads"), [("3", 3), (" 1 ", 1), ("4,2", 4)])
def test_omp_num_threads_chooses(machine, monkeypatch, given, threads):
    machine(allowed=2, cores=2, load=9.0)
    monkeypatch.setenv(ENV, given)
    choice = choose_cpu_threads(share=2)
    assert choice.threads == threads and ENV in choice.why


@pytest.mark.parametrize("given", ["0", "two", "-1"])
def test_a_bad_omp_num_threads_is_one_line_naming_it(machine, monkeypatch, given):
    machine(allowed=2, cores=2, load=0.0)
    monkeypatch.setenv(ENV, given)
    with pytest.raises(UserError, match=f"{ENV}='{given}' is not a thread count; set it to a whole number"):
        choose_cpu_threads()


def test_cpu_work_is_set_and_said_once_other_devices_are_left_alone(machine, caplog):
    machine(allowed=2, cores=2, load=1.0)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="dflash_cache.cpu_threads"):
            assert use_free_cores(torch.device("cuda", 0)) is None
            assert not caplog.messages
            assert use_free_cores(torch.device("cpu")) == 1
        assert torch.get_num_threads() == 1
        (line,) = caplog.messages
        assert line.startswith("CPU work on 1 torch thread (1 of 2 cores free") and f"{ENV}=N" in line
        assert "--cpu-threads N" in line
    finally:
        torch.set_num_threads(before)


def test_the_line_is_said_once_per_process_and_once_per_host(machine, monkeypatch, caplog):
    """A process that sets its threads twice (extract, then train) says the count once, and again only
    when it changes; of a host's ranks, the first says it for all (the others log it at debug level)."""
    cpu = torch.device("cpu")
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.DEBUG, logger="dflash_cache.cpu_threads"):
            machine(allowed=2, cores=2, load=1.0)
            use_free_cores(cpu)
            use_free_cores(cpu)
            machine(allowed=2, cores=2, load=0.0)
            use_free_cores(cpu)
            monkeypatch.setenv("LOCAL_RANK", "0")
            machine(allowed=6, cores=6, load=0.0)
            use_free_cores(cpu, share=2)
            monkeypatch.setenv("LOCAL_RANK", "1")
            use_free_cores(cpu, share=2)
    finally:
        torch.set_num_threads(before)
    said = [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records]
    assert said == [("INFO", "CPU work on 1 torch thread"), ("DEBUG", "CPU work on 1 torch thread"),
                    ("INFO", "CPU work on 2 torch threads"), ("INFO", "CPU work on 3 torch threads per process"),
                    ("DEBUG", "CPU work on 3 torch threads per process")], said


def test_the_cpu_threads_flag_sets_the_variable(monkeypatch):
    """`dflash-cache --cpu-threads N <command>`: OMP_NUM_THREADS, which launched ranks inherit too."""
    monkeypatch.setenv(ENV, "1")  # restored after the test
    r = CliRunner().invoke(cli, ["--cpu-threads", "3", "inspect", "--help"])
    assert r.exit_code == 0, r.output
    assert os.environ[ENV] == "3"
    r = CliRunner().invoke(cli, ["--cpu-threads", "0", "inspect", "--help"])
    assert r.exit_code == 2 and "--cpu-threads" in r.output


class Reached(UserError):
    pass


@pytest.mark.parametrize("command", [
    ["train", "--cache", "{tmp}/cache", "--target", "tiny", "--out", "{tmp}/run", "--device", "cpu"],
    ["extract", "--model", "tiny", "--data", "demo", "--out", "{tmp}/cache", "--gpus", "cpu"],
    ["extract", "--model", "tiny", "--data", "demo", "--out", "{tmp}/cache", "--gpus", "cpu", "--dry-run"],
    ["eval", "--target", "tiny", "--drafter", str(ASSET_DIR), "--data", "demo", "--device", "cpu"],
    ["regenerate", "--model", "tiny", "--data", "{tmp}/chat.jsonl", "--out", "{tmp}/out.jsonl", "--device", "cpu"],
])
def test_every_command_on_the_cpu_chooses_its_threads_before_its_work(tmp_path, monkeypatch, command):
    """Each stops where it would choose (before loading a model or reading data): it got there."""
    seen = []

    def reached(share: int = 1):
        seen.append(share)
        raise Reached("reached the thread choice")

    monkeypatch.setattr(cpu_threads, "choose_cpu_threads", reached)
    r = CliRunner().invoke(cli, [a.format(tmp=tmp_path) for a in command])
    assert r.exit_code == 2 and "reached the thread choice" in r.output, r.output
    assert seen == [1]


@pytest.mark.parametrize(("text", "quota"), [("400000 100000\n", 4), ("150000 100000", 2), ("max 100000", None),
                                             ("", None)])
def test_a_container_quota_caps_the_cores(tmp_path, monkeypatch, text, quota):
    """A container limited to N CPUs sees every host core in its affinity; threads past N are throttled."""
    import dflash_cache.cpu_threads as cpu_threads

    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    assert cpu_threads._cgroup_quota(cpu_max) == quota
    monkeypatch.setattr(cpu_threads, "CGROUP_CPU_MAX", cpu_max)
    monkeypatch.setattr(cpu_threads, "CGROUP_V1_CPU", tmp_path / "no-v1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(96)))
    assert cpu_threads._allowed_cores() == (quota or 96)


def test_a_cgroup_v1_quota_caps_the_cores_too(tmp_path):
    import dflash_cache.cpu_threads as cpu_threads

    (tmp_path / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads._cgroup_quota(tmp_path / "none", tmp_path) == 3
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_threads._cgroup_quota(tmp_path / "none", tmp_path) is None
