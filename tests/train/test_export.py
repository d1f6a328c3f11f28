from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from dflash_cache.errors import UserError
from dflash_cache.store.manifest import TargetIdentity
from dflash_cache.target.model import TargetSpec, describe_target
from dflash_cache.target.tiny import build_tiny_target, tiny_config
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter, init_drafter
from dflash_cache.train.export import (
    check_target,
    drafter_from_export,
    export_drafter,
    load_exported,
    read_export,
)
from dflash_cache.train.speculative import greedy_generate, load_prompts

LAYER_IDS = (1, 3, 5)
CONTEXT, OFFSET = 20, 5000  # context tokens in the forward checks, and their first position


def load_with_automodel(export_dir: Path, modules_dir: Path):
    """(model, loading info) from the documented DFlash loader, its module cache kept under modules_dir."""
    import transformers.dynamic_module_utils as dynamic
    from transformers import AutoModel

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dynamic, "HF_MODULES_CACHE", str(modules_dir))
        return AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype=torch.float32,
                                         output_loading_info=True)


def forward_inputs(cfg: DrafterConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target features [T, N*H], block embeddings [B, H], positions [T + B]) for one block."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(CONTEXT, cfg.num_target_layers * cfg.hidden_size, generator=gen)
    embeds = torch.randn(cfg.block_size, cfg.hidden_size, generator=gen)
    return features, embeds, torch.arange(OFFSET, OFFSET + CONTEXT + cfg.block_size)


def ours(drafter: DFlashDrafter, cfg: DrafterConfig, visible: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our drafter's [B, H] output on forward_inputs with a given bool [B, T + B] mask per layer type."""
    features, embeds, positions = forward_inputs(cfg)
    masks = {kind: mask[None, None] for kind, mask in visible.items()}
    with torch.no_grad():
        return drafter(features, positions[:CONTEXT], embeds, positions[CONTEXT:], masks)


def shipped(model, cfg: DrafterConfig) -> torch.Tensor:
    """The shipped model's [B, H] output on forward_inputs, called as the public DFlash loop calls it."""
    features, embeds, positions = forward_inputs(cfg)
    with torch.no_grad():
        return model(position_ids=positions[None], noise_embedding=embeds[None], target_hidden=features[None])[0]


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
    assert config["dflash_config"] == {"target_layer_ids": list(LAYER_IDS), "mask_token_id": tc.vocab_size - 1,
                                       "block_size": 8}
    assert config["mask_token_id"] == tc.vocab_size - 1 and config["max_window_layers"] == 5
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
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert not list(out.glob("*.tmp"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]


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
    cfg = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=2, block_size=4, sliding_window=64,
                                  mask_token_id=7),
        layer_types=("sliding_attention", "full_attention"))
    export_drafter(init_drafter(cfg, 0), cfg, tmp_path)
    config, _ = load_exported(tmp_path)
    assert config["sliding_window"] == 64 and config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["dflash_config"]["mask_token_id"] == 7
    assert drafter_from_export(tmp_path)[0] == cfg


@pytest.mark.parametrize(("types", "full_first"), [(("sliding_attention",) * 3, 0),
                                                   (("full_attention", "sliding_attention", "sliding_attention"), 1)])
def test_max_window_layers_agrees_with_layer_types(tmp_path, types, full_first):
    """Loaders that derive layer_types from max_window_layers (Qwen3's convention: the first ones attend
    fully) must get the very layer types the drafter was trained with."""
    from transformers import Qwen3Config

    cfg = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=3, block_size=4, sliding_window=64),
        layer_types=types)
    export_drafter(init_drafter(cfg, 0), cfg, tmp_path)
    config, _ = load_exported(tmp_path)
    assert config["max_window_layers"] == full_first
    rebuilt = Qwen3Config(**{k: v for k, v in config.items() if k != "layer_types"})
    assert list(rebuilt.layer_types) == list(types)


def test_mismatched_drafter_rejected(tmp_path):
    cfg = DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=2)
    other = DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=3)
    with pytest.raises(ValueError):
        export_drafter(init_drafter(other, 0), cfg, tmp_path)
    assert not list(tmp_path.iterdir())


def test_old_export_without_model_code_still_loads(exported, tmp_path):
    cfg, drafter, out = exported
    old = tmp_path / "old"
    old.mkdir()
    config = json.loads((out / "config.json").read_text())
    del config["auto_map"]
    (old / "config.json").write_text(json.dumps(config))
    (old / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    cfg2, drafter2 = drafter_from_export(old)
    assert cfg2 == cfg
    assert all(torch.equal(v, drafter.state_dict()[k].bfloat16()) for k, v in drafter2.state_dict().items())


@pytest.fixture(scope="module")
def remote(exported, tmp_path_factory):
    """The export loaded by `AutoModel.from_pretrained(..., trust_remote_code=True)`, float32."""
    _, _, out = exported
    return load_with_automodel(out, tmp_path_factory.mktemp("hf_modules"))


def test_automodel_builds_the_drafter(exported, remote):
    from transformers import PreTrainedModel

    cfg, _, out = exported
    model, info = remote
    assert type(model).__name__ == "DFlashDraftModel" and isinstance(model, PreTrainedModel)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors
    _, stored = load_exported(out)
    loaded = model.state_dict()
    assert set(loaded) == set(stored)
    for k, v in stored.items():
        assert torch.equal(loaded[k], v.float()), k  # every tensor read from the file, none initialised
    assert model.target_layer_ids == list(LAYER_IDS) and model.block_size == 8
    assert model.mask_token_id == cfg.mask_token_id


def test_automodel_forward_matches_ours(exported, remote):
    cfg, _, out = exported
    model, _ = remote
    drafter = drafter_from_export(out)[1].float()
    everything = torch.ones(cfg.block_size, CONTEXT + cfg.block_size, dtype=torch.bool)
    torch.testing.assert_close(shipped(model, cfg), ours(drafter, cfg, {"full_attention": everything}),
                               rtol=1e-5, atol=1e-5)


def test_automodel_sliding_window_counts_back_from_each_query(tmp_path):
    """Sliding layers: key visible iff 0 <= query pos - key pos < W (the serving engines' rule)."""
    window = 6
    cfg = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=2, block_size=8, sliding_window=window),
        layer_types=("sliding_attention", "full_attention"))
    export_drafter(init_drafter(cfg, 5), cfg, tmp_path / "drafter")
    model, _ = load_with_automodel(tmp_path / "drafter", tmp_path / "modules")
    _, _, positions = forward_inputs(cfg)
    delta = positions[CONTEXT:, None] - positions[None, :]
    visible = {"sliding_attention": (delta >= 0) & (delta < window),
               "full_attention": torch.ones_like(delta, dtype=torch.bool)}
    drafter = drafter_from_export(tmp_path / "drafter")[1].float()
    torch.testing.assert_close(shipped(model, cfg), ours(drafter, cfg, visible), rtol=1e-5, atol=1e-5)


def test_automodel_cached_context_matches_one_call(exported, remote):
    """The public loop's KV cache: context fed in two calls (block keys cropped between) = one call."""
    from transformers import DynamicCache

    cfg, _, _ = exported
    model, _ = remote
    features, embeds, positions = forward_inputs(cfg)
    split, b = 12, cfg.block_size
    cache = DynamicCache()
    first = torch.cat((positions[:split], positions[CONTEXT:]))  # block positions unused: cropped below
    with torch.no_grad():
        model(position_ids=first[None], noise_embedding=embeds[None], target_hidden=features[None, :split],
              past_key_values=cache, use_cache=True)
        cache.crop(-b)
        both = model(position_ids=positions[None, split:], noise_embedding=embeds[None],
                     target_hidden=features[None, split:], past_key_values=cache, use_cache=True)[0]
    torch.testing.assert_close(both, shipped(model, cfg), rtol=1e-5, atol=1e-5)


def test_spec_generate_is_lossless(remote):
    """The README's `draft.spec_generate(...)` call: greedy output equals the target's, stop tokens stop."""
    model, _ = remote
    target = build_tiny_target()
    prompt = load_prompts("demo", 1)[0][-16:]
    reference = greedy_generate(target, prompt, 8)
    ids, accepted = model.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=8,
                                        stop_token_ids=None, temperature=0.0, return_acceptance=True)
    assert ids[0].tolist() == prompt + reference
    assert sum(accepted) >= 7 and all(1 <= a <= 8 for a in accepted)
    stop = reference[2]
    stopped = model.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=8,
                                  stop_token_ids=[stop])
    assert stopped[0].tolist() == prompt + reference[: reference.index(stop) + 1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        sampled = model.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=3,
                                      temperature=1.0)
    assert sampled.shape == (1, len(prompt) + 3) and sampled[0, : len(prompt)].tolist() == prompt


def tiny_identity(**changes) -> TargetIdentity:
    """The tiny target's identity as training records it (the layers the drafters here read), with `changes`."""
    identity = describe_target(TargetSpec(model="tiny", layers=LAYER_IDS)).identity
    return dataclasses.replace(identity, **changes)


def test_export_records_the_target_it_was_trained_for(exported, tmp_path):
    cfg, drafter, _ = exported
    export_drafter(drafter, cfg, tmp_path, target=tiny_identity())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["target"] == {"name": "tiny", "model_type": "qwen3", "config_hash": tiny_identity().config_hash,
                                "dtype": "bfloat16", "num_hidden_layers": 8, "hidden_size": 128, "vocab_size": 2048,
                                "weights_fingerprint": tiny_identity().weights_fingerprint}
    assert config["dflash_config"]["target_layer_ids"] == list(LAYER_IDS)  # the layers it reads, recorded once
    export = read_export(tmp_path)
    assert export.target == tiny_identity() and export.cfg == cfg
    assert read_export(exported[2]).target is None  # written without one, as exports before it was recorded


def test_the_committed_demo_drafter_records_the_tiny_target(demo_drafter):
    cfg, _, target = read_export(demo_drafter)
    assert target == describe_target(TargetSpec(model="tiny", layers=cfg.target_layer_ids)).identity


def _broken_exports() -> dict[str, tuple[Callable[[dict], Any], tuple[str, ...]]]:
    """How a config.json can be broken (an edit of its dict, or text to write instead) and what the
    one-line error must name besides the file."""
    def drop(*keys: str) -> Callable[[dict], dict]:
        def edit(config: dict) -> dict:
            for key in keys:
                parent, _, leaf = key.rpartition(".")
                del (config[parent] if parent else config)[leaf]
            return config
        return edit

    return {
        "not json": (lambda _: '{"hidden_size": 128,', ("not a readable JSON file",)),
        "a list": (lambda _: "[1, 2]", ("JSON list",)),
        "no hidden_size": (drop("hidden_size"), ("lacks hidden_size",)),
        "no layer ids": (drop("dflash_config.target_layer_ids"), ("dflash_config.target_layer_ids",)),
        "no rope": (drop("rope_theta", "rope_parameters"), ("rope_theta",)),
        "bad value": (lambda c: {**c, "num_attention_heads": "four"}, ("bad value",)),
        "bad target": (lambda c: {**c, "target": {"name": "tiny"}}, ("target", "model_type")),
    }


@pytest.mark.parametrize("case", list(_broken_exports()))
def test_a_broken_or_incomplete_config_is_one_line_naming_the_file(exported, tmp_path, case):
    _, _, out = exported
    edit, needles = _broken_exports()[case]
    broken = tmp_path / "export"
    shutil.copytree(out, broken)
    edited = edit(json.loads((out / "config.json").read_text()))
    (broken / "config.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(UserError) as e:
        read_export(broken)
    message = str(e.value)
    assert str(broken / "config.json") in message and "\n" not in message, message
    assert all(n in message for n in needles), message


@pytest.mark.parametrize("where", ["rope_parameters", "top level"])
def test_rope_theta_is_read_where_it_is_given_when_the_other_place_holds_null(exported, where):
    """Hand-edited or converted configs hold RoPE's base in one place and null in the other: the
    value given is read (a null there was float(None), "a bad value")."""
    from dflash_cache.train.export import config_from_export

    cfg, _, out = exported
    config = json.loads((out / "config.json").read_text())
    if where == "rope_parameters":
        config["rope_theta"] = None
    else:
        config["rope_parameters"]["rope_theta"] = None
    assert config_from_export(config) == cfg


def test_weights_that_do_not_fit_the_config_are_one_line(exported, tmp_path):
    _, _, out = exported
    broken = tmp_path / "export"
    shutil.copytree(out, broken)
    config = json.loads((out / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4,
                                                    "layer_types": ["full_attention"] * 4}))
    with pytest.raises(UserError, match=r"model\.safetensors does not hold .*unexpected \['layers\.4\."):
        read_export(broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="model.safetensors cannot be read"):
        read_export(broken)


@pytest.mark.parametrize(("change", "field"), [
    (dict(num_hidden_layers=10), "num_hidden_layers"), (dict(hidden_size=256), "hidden_size"),
    (dict(vocab_size=4096), "vocab_size"), (dict(model_type="llama"), "model_type"),
    (dict(config_hash="0123456789abcdef"), "config_hash"),
])
def test_another_target_is_refused_naming_both_and_the_field(exported, change, field):
    cfg, _, out = exported
    given = tiny_identity(name="/models/other", **change)
    with pytest.raises(UserError) as e:
        check_target(out, tiny_identity(), cfg, given)
    message = str(e.value)
    assert f"--drafter {out}: config.json field target.{field} is {getattr(tiny_identity(), field)!r} (trained " \
           "for target tiny)" in message, message
    assert f"--target /models/other has {change[field]!r}" in message, message


def test_the_same_target_passes_and_other_weights_only_warn(exported, caplog):
    cfg, _, out = exported
    with caplog.at_level(logging.WARNING):
        check_target(out, tiny_identity(), cfg, tiny_identity(name="/moved/tiny"))  # another path, same model
        assert not caplog.records
        check_target(out, tiny_identity(), cfg, tiny_identity(name="/models/finetune", weights_fingerprint="f" * 16))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "/models/finetune" in caplog.text and "other weights" in caplog.text


def test_an_export_without_a_target_warns_once_and_checks_what_its_tensors_need(exported, caplog):
    cfg, _, out = exported
    with caplog.at_level(logging.WARNING):
        check_target(out, None, cfg, tiny_identity(name="/models/other", num_hidden_layers=10))
    assert len(caplog.records) == 1 and "cannot check" in caplog.text and "/models/other" in caplog.text
    with pytest.raises(UserError, match=r"needs a target with hidden_size 128, but --target /models/wide has 256"):
        check_target(out, None, cfg, tiny_identity(name="/models/wide", hidden_size=256))
    with pytest.raises(UserError, match=r"reads target layers \[1, 3, 5\], but --target /models/short has 6 layers"):
        check_target(out, None, cfg, tiny_identity(name="/models/short", num_hidden_layers=6))
