"""Building sources (dflash_cache.train.assemble): how --target-gpus maps onto devices and torchrun ranks."""

from __future__ import annotations

import pytest
import torch

from dflash_cache.errors import UserError
from dflash_cache.target.model import TargetSpec, describe_target
from dflash_cache.train.assemble import _drafter_and_head, target_devices
from dflash_cache.train.run_config import TrainConfig


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_same_and_cpu():
    drafter = torch.device("cpu")
    assert target_devices("same", drafter) == [drafter]
    assert target_devices("cpu", drafter, rank=1, world=2) == [torch.device("cpu")]


def test_gpu_indices_are_shared_out_over_ranks(four_gpus):
    cuda = [torch.device("cuda", i) for i in range(4)]
    assert target_devices("0,1,2,3", torch.device("cpu")) == cuda
    assert target_devices("0,1,2,3", torch.device("cpu"), rank=0, world=2) == [cuda[0], cuda[2]]
    assert target_devices("0,1,2,3", torch.device("cpu"), rank=1, world=2) == [cuda[1], cuda[3]]
    assert target_devices("2,3", torch.device("cpu"), rank=1, world=2) == [cuda[3]]


def test_fewer_target_gpus_than_ranks_is_refused(four_gpus):
    with pytest.raises(UserError, match="at least one per process"):
        target_devices("0", torch.device("cpu"), rank=1, world=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_indices_without_cuda_name_the_flag_and_the_fix():
    with pytest.raises(UserError, match=r"--target-gpus '0': no CUDA device is visible; use --target-gpus cpu"):
        target_devices("0", torch.device("cpu"))


def drafter_config(**kw):
    cfg = TrainConfig(cache="unused", target="tiny", out="unused", draft_layers=3, **kw)
    return _drafter_and_head(cfg, describe_target(TargetSpec(model="tiny")), torch.device("cpu"))[0]


def test_sliding_window_makes_every_drafter_layer_sliding():
    """--sliding-window W: every layer trains (and exports) as sliding_attention with window W."""
    cfg = drafter_config(sliding_window=64)
    assert cfg.layer_types == ("sliding_attention",) * 3 and cfg.sliding_window == 64
    assert drafter_config().layer_types == ("full_attention",) * 3
