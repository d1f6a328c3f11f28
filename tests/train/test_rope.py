"""RoPE stays exact whatever casts or loads the drafter went through (issue 10 item 6)."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_cache.target.tiny import tiny_config
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter, RotaryEmbedding, init_drafter
from dflash_cache.train.export import drafter_from_export, export_drafter

POSITIONS = torch.tensor([0, 1, 1000, 7999, 8000])
TOLERANCE = 1e-3


def _float64_rope(head_dim: int, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [L, head_dim] in float64, the ground truth."""
    inv_freq = torch.tensor([theta ** (-i / head_dim) for i in range(0, head_dim, 2)], dtype=torch.float64)
    angles = positions.double()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _assert_exact(drafter: DFlashDrafter, cfg: DrafterConfig) -> None:
    cos, sin = drafter.rotary(POSITIONS, torch.float32)
    ref_cos, ref_sin = _float64_rope(cfg.head_dim, cfg.rope_theta, POSITIONS)
    assert cos.dtype == torch.float32
    assert (cos.double() - ref_cos).abs().max() < TOLERANCE
    assert (sin.double() - ref_sin).abs().max() < TOLERANCE


@pytest.fixture(scope="module")
def cfg() -> DrafterConfig:
    return DrafterConfig.from_target(tiny_config(), (1, 3), num_layers=1, block_size=4)


def test_exact_after_bf16_round_trip(cfg):
    _assert_exact(init_drafter(cfg, 0).to(torch.bfloat16).float(), cfg)


def test_exact_after_export_and_float(cfg, tmp_path):
    export_drafter(init_drafter(cfg, 0), cfg, tmp_path)
    _, drafter = drafter_from_export(tmp_path)
    _assert_exact(drafter.float(), cfg)


def test_exact_in_bf16(cfg):
    """Computed in float32 even in a bf16 drafter; only the returned cos/sin are rounded."""
    drafter = init_drafter(cfg, 0).to(torch.bfloat16)
    cos, _ = drafter.rotary(POSITIONS, torch.bfloat16)
    ref_cos, _ = _float64_rope(cfg.head_dim, cfg.rope_theta, POSITIONS)
    assert cos.dtype == torch.bfloat16 and (cos.double() - ref_cos).abs().max() < 2 ** -8


def test_nothing_for_to_to_round():
    """No tensor state: a cast or a load has nothing to touch, and the state dict stays empty."""
    rope = RotaryEmbedding(head_dim=8, theta=10_000.0)
    assert list(rope.buffers()) == [] and rope.state_dict() == {}


def test_matches_qwen3_frequencies():
    """The same frequencies as transformers' Qwen3 (the target and the public DFlash code)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=32, rope_theta=1e6)
    positions = torch.arange(0, 9000, 997)
    hf_cos, hf_sin = Qwen3RotaryEmbedding(config)(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    cos, sin = RotaryEmbedding(32, 1e6)(positions, torch.float32)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)
    assert math.isclose(float(cos[0, 0]), 1.0)
