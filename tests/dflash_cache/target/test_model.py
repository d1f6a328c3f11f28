from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_cache.errors import UserError
from dflash_cache.extract.run import extract
from dflash_cache.store.reader import CacheReader
from dflash_cache.target.model import TargetSpec, check_layers, describe_target, load_target, select_layers
from dflash_cache.target.tiny import build_tiny_target
from tests.conftest import extract_config


@pytest.mark.parametrize("layers,count,expected", [
    (36, 5, [1, 9, 17, 25, 33]),   # Qwen3-8B
    (64, 5, [1, 16, 31, 46, 61]),  # a 64-layer target
    (8, 5, [1, 2, 3, 4, 5]),       # the tiny target
    (36, 1, [1]),
])
def test_default_layer_choice(layers, count, expected):
    assert select_layers(layers, count) == expected


@pytest.mark.parametrize("ids", [[], [3, 1], [1, 1], [-1, 2], [1, 7]])
def test_bad_layer_ids(ids):
    with pytest.raises(UserError):
        check_layers(ids, 8)


def test_too_many_layers_for_target():
    with pytest.raises(UserError, match="--num-layers"):
        select_layers(8, 6)


def test_cut_target_runs_only_needed_layers():
    desc = describe_target(TargetSpec(model="tiny", layers=(1, 3)))
    model = load_target(desc, torch.device("cpu"))
    assert len(model.model.layers) == 4
    assert desc.identity.num_hidden_layers == 8


def test_cached_features_equal_plain_hf_forward(small_parquet, tmp_path):
    """The cache holds HF hidden_states[k + 1] of every sample, packed, for the chosen layers."""
    layers = (0, 2, 5)
    cfg = extract_config(small_parquet, tmp_path / "c", codec="none",
                         target=TargetSpec(model="tiny", dtype="float32", layers=layers))
    extract(cfg, "cpu", echo=lambda *_: None)
    reader = CacheReader(tmp_path / "c")
    assert reader.complete and reader.num_samples == 48
    full = build_tiny_target().float()
    table = __import__("pyarrow.parquet", fromlist=["x"]).read_table(small_parquet)
    worst = 0.0
    for sid in (0, 7, 19, 33, 47):
        ids = table.column("input_ids")[sid].as_py()
        with torch.no_grad():
            hs = full(torch.tensor([ids]), output_hidden_states=True).hidden_states
        ref = torch.cat([hs[k + 1][0] for k in layers], dim=1).to(torch.bfloat16).float()
        got = reader.sample(sid)
        assert got.input_ids.tolist() == ids
        diff = (got.features.float() - ref).abs()
        # Padded batch vs single sequence: equal up to one bf16 rounding step.
        assert torch.all(diff <= 2**-7 * ref.abs() + 1e-5), f"sample {sid}: max diff {diff.max()}"
        worst = max(worst, float(diff.max()))
    assert np.isfinite(worst)


def test_prebuilt_mask_is_causal_and_hides_padding():
    from dflash_cache.target.capture import causal_padding_mask

    m = causal_padding_mask(torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert m.shape == (2, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert m[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]


def test_sliding_window_targets_keep_hugging_face_masks():
    from dflash_cache.target.capture import prebuilt_mask_ok
    from dflash_cache.target.tiny import tiny_config

    config = tiny_config()
    assert prebuilt_mask_ok(config)
    config.layer_types = ["sliding_attention"] + config.layer_types[1:]
    assert not prebuilt_mask_ok(config)


def test_hybrid_targets_keep_hugging_face_masks():
    """Linear-attention layers read the 2-D padding mask; a 4-D one is for all-full-attention SDPA only."""
    from transformers import Qwen3_5TextConfig

    from dflash_cache.target.capture import prebuilt_mask_ok

    assert not prebuilt_mask_ok(Qwen3_5TextConfig(num_hidden_layers=4))


def test_checkpoint_missing_weights_is_a_user_error(tmp_path):
    """A weight the checkpoint lacks would be left random: refused, naming it."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3ForCausalLM

    from dflash_cache.target.tiny import tiny_config

    Qwen3ForCausalLM(tiny_config()).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    desc = describe_target(TargetSpec(model=str(tmp_path), layers=(1,)))
    with pytest.raises(UserError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_target(desc, torch.device("cpu"))


def test_weights_fingerprint_tells_checkpoints_of_one_architecture_apart(tmp_path):
    from transformers import Qwen3ForCausalLM

    from dflash_cache.target.model import weights_fingerprint
    from dflash_cache.target.tiny import tiny_config

    for seed, name in ((0, "a"), (0, "a_again"), (1, "b")):
        torch.manual_seed(seed)
        Qwen3ForCausalLM(tiny_config()).save_pretrained(tmp_path / name)
    a, a_again, b = (weights_fingerprint(str(tmp_path / n)) for n in ("a", "a_again", "b"))
    assert a == a_again != b
    ids = [describe_target(TargetSpec(model=str(tmp_path / n))).identity for n in ("a", "b")]
    assert ids[0].config_hash == ids[1].config_hash and ids[0].weights_fingerprint != ids[1].weights_fingerprint


def test_loading_only_the_head_does_not_read_as_an_error(caplog):
    import logging

    desc = describe_target(TargetSpec(model="tiny"))
    with caplog.at_level(logging.INFO, logger="dflash_cache.target.model"):
        load_target(desc, torch.device("cpu"), keep=0)
    assert not any("0 of" in m for m in caplog.messages), caplog.messages
    assert any("embedding and LM head" in m for m in caplog.messages)
