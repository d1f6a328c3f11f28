"""The one device resolver (dflash_cache.devices): --gpus, --target-gpus and --device, each mistake one
line naming the flag and the fix, the same words whichever command took the flag."""

from __future__ import annotations

import pytest
import torch

from dflash_cache import devices
from dflash_cache.errors import UserError


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize(("has_gpu", "level"), [(False, "INFO"), (True, "WARNING")])
def test_gpus_all_without_cuda_warns_only_where_the_machine_has_a_gpu(monkeypatch, caplog, has_gpu, level):
    """On a plain CPU machine, running `--gpus all` (the default) on the CPU is news, not a warning."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(devices, "_machine_has_gpu", lambda: has_gpu)
    with caplog.at_level("INFO", logger="dflash_cache.devices"):
        assert devices.parse_gpus("all") is None
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (level, "--gpus all: no CUDA device visible, running on the CPU")]


def test_gpus_name_devices(two_gpus):
    assert devices.gpu_devices("cpu") == [torch.device("cpu")]
    assert devices.gpu_devices(" ALL ") == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert devices.gpu_devices("1,0") == [torch.device("cuda", 1), torch.device("cuda", 0)]


@pytest.mark.parametrize(("spec", "message"), [
    ("banana", "--gpus 'banana': expected 'all', 'cpu' or comma-separated GPU indices like 0,2,3"),
    ("0,2", "--gpus '0,2': 2 CUDA device(s) visible, so valid indices are 0..1"),
    (",", "--gpus ',': 2 CUDA device(s) visible, so valid indices are 0..1"),
])
def test_bad_gpus_are_one_line(two_gpus, spec, message):
    with pytest.raises(UserError) as e:
        devices.gpu_devices(spec)
    assert str(e.value) == message


def test_gpu_indices_without_cuda_name_the_flag_that_took_them(no_gpu):
    for flag in ("--gpus", "--target-gpus"):
        with pytest.raises(UserError) as e:
            devices.parse_gpus("0", flag)
        assert str(e.value) == f"{flag} '0': no CUDA device is visible; use {flag} cpu"


def test_device_names_one_device(two_gpus):
    assert devices.resolve_device("auto") == torch.device("cuda", 0)
    assert devices.resolve_device("auto", local_rank=1) == devices.resolve_device("cuda", 1) == torch.device("cuda", 1)
    assert devices.resolve_device("cuda:1", local_rank=0) == torch.device("cuda", 1)
    assert devices.resolve_device("cpu") == torch.device("cpu")


def test_device_auto_without_cuda_is_the_cpu(no_gpu):
    assert devices.resolve_device("auto", local_rank=1) == torch.device("cpu")


@pytest.mark.parametrize(("spec", "gpus", "message"), [
    ("banana", 2, "--device 'banana' is not a device; use auto, cpu, cuda or cuda:N"),
    ("meta", 2, "--device 'meta': only cpu and cuda devices are supported"),
    ("cuda:2", 2, "--device cuda:2: 2 CUDA device(s) visible, so valid indices are 0..1"),
    ("cuda", 0, "--device cuda: no CUDA device is visible; use --device cpu"),
])
def test_bad_device_is_one_line(monkeypatch, spec, gpus, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    with pytest.raises(UserError) as e:
        devices.resolve_device(spec)
    assert str(e.value) == message


def test_torchrun_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    assert devices.torchrun_env() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert devices.torchrun_env() is None, "no rendezvous address: not started as one of several"
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert devices.torchrun_env() == (1, 2)
