from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from extract.target import tiny_config
from train.config import DrafterConfig
from train.drafter import init_drafter
from train.export import drafter_from_export, export_drafter, load_exported

LAYER_IDS = (1, 3, 5)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cfg = DrafterConfig.from_target(tiny_config(), LAYER_IDS, block_size=8)
    drafter = init_drafter(cfg, seed=3)
    out = tmp_path_factory.mktemp("export") / "drafter"
    export_drafter(drafter, cfg, out)
    return cfg, drafter, out


def test_config_json(exported):
    cfg, _, out = exported
    config = json.loads((out / "config.json").read_text())
    tc = tiny_config()
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 8
    assert config["num_target_layers"] == tc.num_hidden_layers
    assert config["dflash_config"] == {"target_layer_ids": list(LAYER_IDS), "mask_token_id": tc.vocab_size - 1}
    assert config["layer_types"] == ["full_attention"] * 5
    assert config["sliding_window"] is None
    assert config["head_dim"] == 32
    assert config["rope_theta"] == 10000.0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    expected = {
        "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 2048, "max_position_embeddings": 8192,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }
    assert {k: config[k] for k in expected} == expected
    assert not list(out.glob("*.tmp")) and sorted(p.name for p in out.iterdir()) == ["config.json",
                                                                                      "model.safetensors"]


def test_config_is_a_loadable_qwen3_config(exported):
    from transformers import Qwen3Config

    _, _, out = exported
    qc = Qwen3Config.from_pretrained(out)
    assert qc.num_hidden_layers == 5 and qc.block_size == 8 and qc.dflash_config["target_layer_ids"] == [1, 3, 5]


def test_safetensors_contents(exported):
    cfg, drafter, out = exported
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in names}
    sd = drafter.state_dict()
    assert len(names) == 58 and names == set(sd)
    assert not any("embed" in k or "lm_head" in k for k in names)
    for k, t in tensors.items():
        assert t.dtype == torch.bfloat16 and t.shape == sd[k].shape, k
    config, state = load_exported(out)
    assert config["num_hidden_layers"] == 5 and set(state) == names


def test_round_trip(exported):
    cfg, drafter, out = exported
    cfg2, drafter2 = drafter_from_export(out)
    assert cfg2 == cfg
    for k, v in drafter.state_dict().items():
        w = drafter2.state_dict()[k]
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, v.to(torch.bfloat16)), k


def test_sliding_round_trip(tmp_path):
    cfg = DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=2, block_size=4, sliding_window=64,
                                    mask_token_id=7, layer_types=("sliding_attention", "full_attention"))
    export_drafter(init_drafter(cfg, 0), cfg, tmp_path)
    config, _ = load_exported(tmp_path)
    assert config["sliding_window"] == 64 and config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["dflash_config"]["mask_token_id"] == 7
    assert drafter_from_export(tmp_path)[0] == cfg


def test_mismatched_drafter_rejected(tmp_path):
    cfg = DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=2)
    other = DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=3)
    with pytest.raises(ValueError):
        export_drafter(init_drafter(other, 0), cfg, tmp_path)
    assert not list(tmp_path.iterdir())
