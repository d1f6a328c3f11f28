"""The step-memory model: defaults fit the machine, settings that cannot fit are refused with what fits."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from bench.common import bench_drafter_config
from dflash_cache.errors import UserError
from dflash_cache.train.memory import (
    ALLOC_CONF_VARS,
    GIB,
    fit_max_anchors,
    prefer_expandable_segments,
    step_memory,
)

QWEN3_8B = bench_drafter_config(hidden=4096, inter=12288, heads=32, kv=8, head_dim=128, vocab=151936, layers=5,
                                block=16, layer_ids=(1, 9, 17, 25, 33))
# Qwen3.5-27B's width, heads and vocabulary: its queries (24 x 256) are wider than its hidden size.
QWEN3_5_27B = bench_drafter_config(hidden=5120, inter=17408, heads=24, kv=4, head_dim=256, vocab=248320, layers=5,
                                   block=16, layer_ids=(1, 9, 17, 25, 33))
CUDA = torch.device("cuda")


def test_the_model_grows_with_block_and_context_tokens():
    m = step_memory(QWEN3_8B, CUDA)
    assert 16 * 1.0e9 < m.fixed < 22e9, "fp32 weights, grads and two moments of ~1.05B parameters, plus the head"
    assert m.bytes(2048, 16, 12288) > m.bytes(1024, 16, 12288) > m.bytes(1024, 16, 4096)
    assert step_memory(QWEN3_8B, torch.device("cpu")).per_query > m.per_query, "fp32 activations on a CPU"
    compiled = step_memory(QWEN3_8B, CUDA, compiled=True)
    assert compiled.per_query < m.per_query, "compiled layers recompute what eager ones save"
    assert 763 * 1024 < compiled.per_query, "at least the slope bench/memory.py measured (2026-12-04)"


def test_query_side_tensors_are_counted_at_the_query_width():
    """bench/memory.py measured 1,035 KiB per block token for the Qwen3.5-27B-shaped drafter's compiled
    layers (NVIDIA H200, 2026-12-04); counting its q and attention outputs at the hidden size gave 1,020."""
    compiled = step_memory(QWEN3_5_27B, CUDA, compiled=True)
    assert 1035 * 1024 < compiled.per_query
    for c in (True, False):
        narrow = dataclasses.replace(QWEN3_5_27B, num_attention_heads=20)  # 20 x 256 = the hidden size
        assert step_memory(narrow, CUDA, compiled=c).per_query < step_memory(QWEN3_5_27B, CUDA, compiled=c).per_query


def test_default_cap_fits_an_80_gb_gpu_and_an_explicit_excess_is_refused_with_what_fits():
    room = int(79 * GIB * 0.85)
    cap = fit_max_anchors(QWEN3_8B, CUDA, context_tokens=32768, max_anchors=None, available=room)
    m = step_memory(QWEN3_8B, CUDA)
    assert 256 < cap and m.bytes(cap, 16, 32768) <= room < m.bytes(cap + 1, 16, 32768)
    assert fit_max_anchors(QWEN3_8B, CUDA, context_tokens=32768, max_anchors=cap, available=room) == cap
    with pytest.raises(UserError, match=f"at most {cap} fits"):
        fit_max_anchors(QWEN3_8B, CUDA, context_tokens=32768, max_anchors=cap + 1, available=room)


def test_finding_the_cap_says_nothing_the_trainer_says_it_if_it_binds(caplog):
    """A cap that no batch reaches is no news: the trainer logs it once, when a batch had more anchors."""
    with caplog.at_level("INFO", logger="dflash_cache.train.memory"):
        fit_max_anchors(QWEN3_8B, CUDA, context_tokens=32768, max_anchors=None, available=int(79 * GIB * 0.85))
    assert not caplog.messages


def test_a_token_budget_beyond_the_device_is_refused_naming_the_largest_that_fits():
    with pytest.raises(UserError, match="lower --token-budget to at most"):
        fit_max_anchors(QWEN3_8B, CUDA, context_tokens=10**6, max_anchors=None, available=24 * GIB)


@pytest.mark.parametrize("user_var", [None, *ALLOC_CONF_VARS])
def test_expandable_segments_are_preferred_unless_the_user_chose(monkeypatch, user_var):
    for var in ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    if user_var is not None:
        monkeypatch.setenv(user_var, "max_split_size_mb:256")
    assert prefer_expandable_segments() is (user_var is None)
    if user_var is None:
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    else:
        assert os.environ[user_var] == "max_split_size_mb:256"
        assert all(v == user_var or v not in os.environ for v in ALLOC_CONF_VARS)


def test_the_train_command_prefers_expandable_segments(monkeypatch, tmp_path):
    """`dflash-cache train` sets the allocator up before anything touches CUDA."""
    from click.testing import CliRunner

    from dflash_cache import cli
    from dflash_cache.train import trainer

    for var in ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    seen = {}
    monkeypatch.setattr(trainer, "train", lambda cfg, device, **_: seen.setdefault("conf", os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF")))
    res = CliRunner().invoke(cli.cli, ["train", "--target", "tiny", "--cache", str(tmp_path / "c"),
                                        "--out", str(tmp_path / "o")])
    assert seen == {"conf": "expandable_segments:True"}, res.output
