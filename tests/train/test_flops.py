"""The step's FLOP count against torch's own count of the matrix multiplies a CPU step runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash_cache.train.anchors import sample_anchors
from dflash_cache.train.epoch_plan import Position
from dflash_cache.train.flops import PEAK_BF16_FLOPS, device_peak_flops, step_flops
from dflash_cache.train.trainer import Trainer
from tests.train.conftest import demo_train_config

MATMULS = ("mm", "addmm", "bmm", "matmul", "linear")


@pytest.mark.parametrize("fewer_rows", [True, False], ids=["fewer rows", "every row"])
def test_linear_and_lm_head_flops_match_the_counted_matmuls(demo_cache, tmp_path, monkeypatch, fewer_rows):
    """One real training step (forward, chunked loss, backward) under FlopCounterMode: its matrix
    multiplies are exactly the linears and the LM head on slots 1..B-1 that step_flops counts, on
    fewer rows (the trainer's way) and on every row (bench.variants.use_every_row, what bench/train.py
    compares, counted by bench.variants.every_row_flops). Attention runs as SDPA per document on a
    CPU and is checked apart."""
    import dflash_cache.train.step as step_module
    from bench.variants import every_row_flops, use_every_row

    seen = []

    def recording(*args, **kwargs):
        seen.append(sample_anchors(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(step_module, "sample_anchors", recording)
    cfg = demo_train_config(demo_cache, tmp_path, max_steps=1)
    trainer = Trainer.build(cfg, device=torch.device("cpu"))
    use_every_row(trainer.runner, not fewer_rows)
    added = []
    monkeypatch.setattr(trainer.place.profiler, "add_flops", added.append)
    _, batch = next(trainer.source.iterate(Position(0, 0)))
    with FlopCounterMode(display=False) as counter:
        trainer.runner.train_step(batch)
    counted = counter.get_flop_counts()["Global"]
    matmul = sum(n for op, n in counted.items() if str(op).split(".")[1] in MATMULS)
    blocks = seen[0]
    assert blocks.num_anchors > 0 and blocks.prefix_keys == int(blocks.anchor_pos.sum())
    expected = (step_flops if fewer_rows else every_row_flops)(
        trainer.model.cfg, context_tokens=batch.num_tokens, num_blocks=blocks.num_anchors,
        prefix_keys=blocks.prefix_keys)
    assert matmul == expected.linears + expected.lm_head
    assert added == [expected.total]  # what the profiler's MFU divides


def test_attention_flops_count_visible_pairs():
    """Full layers: a block's B queries see the anchor's prefix and the block; sliding layers are
    capped by the window."""
    from dflash_cache.target.tiny import tiny_config
    from dflash_cache.train.config import DrafterConfig

    cfg = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), (1, 3), num_layers=2, block_size=4),
        layer_types=("full_attention", "full_attention"))
    f = step_flops(cfg, context_tokens=100, num_blocks=3, prefix_keys=10 + 20 + 30)
    pairs = 4 * 60 + 3 * 4 * 4
    assert f.attention == 2 * 3 * 4 * pairs * cfg.head_dim * cfg.num_attention_heads
    slid = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), (1, 3), num_layers=2, block_size=4, sliding_window=2),
        layer_types=("sliding_attention", "full_attention"))
    g = step_flops(slid, context_tokens=100, num_blocks=3, prefix_keys=60)
    assert g.attention == pytest.approx(f.attention / 2 + 3 * 4 * (3 * 4 * 2) * cfg.head_dim * cfg.num_attention_heads)
    assert g.total == g.linears + g.attention + g.lm_head


def test_peak_is_known_only_for_listed_gpus():
    """No MFU on a CPU; the more specific H100 PCIe entry is matched before the H100 SXM one."""
    assert device_peak_flops(torch.device("cpu")) is None
    names = [name for name, _ in PEAK_BF16_FLOPS]
    assert "H200" in names and names.index("H100 PCIe") < names.index("H100")
