"""Export a trained drafter as the public DFlash inference code, SGLang and vLLM load it:
`config.json` (a Qwen3 config with the DFlash fields), a bf16 `model.safetensors` holding only
the drafter's own tensors (the target supplies embedding and LM head at inference), and the model
code `dflash.py` that config.json's `auto_map` names, so that
`AutoModel.from_pretrained(dir, trust_remote_code=True)` builds the drafter (published DFlash
checkpoints ship the same pair; without it that call silently returns a plain Qwen3 model)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from dflash_cache.files import write_bytes_atomic, write_json_atomic
from dflash_cache.train.config import FULL_ATTENTION, SLIDING_ATTENTION, DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_CODE_NAME = "dflash.py"  # the module name published checkpoints' auto_map uses
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
EXPORT_DTYPE = torch.bfloat16


def export_config(cfg: DrafterConfig) -> dict:
    """The config.json dict.

    `num_target_layers` is the TARGET's total decoder layer count, as in the published DFlash
    configs (the inference code only uses it to rebuild layer ids when `target_layer_ids` is
    absent); when unknown it falls back to max(target_layer_ids) + 2, the smallest valid target.
    """
    target_layers = cfg.target_num_hidden_layers or max(cfg.target_layer_ids) + 2
    sliding = SLIDING_ATTENTION in cfg.layer_types
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": dict(AUTO_MAP),
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": target_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id},
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": sliding,
        "max_window_layers": cfg.num_layers,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def model_code() -> bytes:
    """The self-contained transformers module written next to config.json (train/remote_code)."""
    return resources.files("dflash_cache.train.remote_code").joinpath(MODEL_CODE_NAME).read_bytes()


def export_drafter(drafter: DFlashDrafter, cfg: DrafterConfig, out_dir: Path) -> None:
    """Write out_dir/config.json, out_dir/model.safetensors (bf16, the drafter's tensors unprefixed)
    and out_dir/dflash.py (the code config.json's auto_map names); config.json last, so that a new
    export directory holding a config.json holds everything it names."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to(device="cpu", dtype=EXPORT_DTYPE).contiguous()
             for name, t in drafter.state_dict().items()}
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        raise ValueError(f"drafter tensors do not match its config: missing {sorted(set(expected) - set(got))}, "
                         f"unexpected {sorted(set(got) - set(expected))}, shapes differ for "
                         f"{sorted(k for k in set(got) & set(expected) if got[k] != expected[k])}")
    config = export_config(cfg)
    write_bytes_atomic(out_dir / WEIGHTS_NAME, save(state, metadata={"format": "pt"}))
    write_bytes_atomic(out_dir / MODEL_CODE_NAME, model_code())
    write_json_atomic(out_dir / CONFIG_NAME, config)


def load_exported(out_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, state dict as stored)."""
    out_dir = Path(out_dir)
    config = json.loads((out_dir / CONFIG_NAME).read_text())
    return config, load_file(str(out_dir / WEIGHTS_NAME))


def config_from_export(config: dict) -> DrafterConfig:
    dflash = config["dflash_config"]
    rope = config.get("rope_parameters") or {}
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta"))),
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        block_size=config["block_size"],
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        layer_types=tuple(config.get("layer_types") or (FULL_ATTENTION,) * config["num_hidden_layers"]),
        sliding_window=config.get("sliding_window"),
        target_num_hidden_layers=config.get("num_target_layers", 0),
    )


def drafter_from_export(out_dir: Path) -> tuple[DrafterConfig, DFlashDrafter]:
    """Rebuild the config and a bf16 drafter holding the exported weights (strict load)."""
    config, state = load_exported(out_dir)
    cfg = config_from_export(config)
    drafter = DFlashDrafter(cfg).to(EXPORT_DTYPE)
    drafter.load_state_dict(state, strict=True)
    return cfg, drafter
