"""Export a trained drafter as the public DFlash inference code, SGLang and vLLM load it:
`config.json` (a Qwen3 config with the DFlash fields), a bf16 `model.safetensors` holding only
the drafter's own tensors (the target supplies embedding and LM head at inference), and the model
code `dflash.py` that config.json's `auto_map` names, so that
`AutoModel.from_pretrained(dir, trust_remote_code=True)` builds the drafter (published DFlash
checkpoints ship the same pair; without it that call silently returns a plain Qwen3 model).

config.json also records under "target" the identity of the target the drafter was trained for (its
name, config hash, sizes and weights fingerprint, as a cache manifest records them), so that `eval`
can refuse another target; the serving engines ignore the key. Exports written before it was
recorded still load (`exported_target` is then None)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from dflash_cache.errors import UserError, one_line
from dflash_cache.files import read_json, write_bytes_atomic, write_json_atomic
from dflash_cache.store.manifest import TargetIdentity
from dflash_cache.target.identity import RECORD_KEY, TargetRecord
from dflash_cache.train.config import FULL_ATTENTION, SLIDING_ATTENTION, DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter
from dflash_cache.typed_json import load_dataclass

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_CODE_NAME = "dflash.py"  # the module name published checkpoints' auto_map uses
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
EXPORT_DTYPE = torch.bfloat16
TARGET_KEY = RECORD_KEY  # config.json's record of the target the drafter was trained for
# config.json keys `config_from_export` reads (RoPE's base: `rope_parameters` or `rope_theta`).
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                 "block_size", "dflash_config")
REQUIRED_DFLASH_KEYS = ("target_layer_ids", "mask_token_id")
REEXPORT = "pass the export/ directory of a finished training run (or train again to write one)"


def export_config(cfg: DrafterConfig, target: TargetIdentity | None = None) -> dict:
    """The config.json dict, recording `target` (the target trained for) when known.

    `num_target_layers` is the TARGET's total decoder layer count, as in the published DFlash
    configs (the inference code only uses it to rebuild layer ids when `target_layer_ids` is
    absent); when unknown it falls back to max(target_layer_ids) + 2, the smallest valid target.
    """
    target_layers = cfg.target_num_hidden_layers or max(cfg.target_layer_ids) + 2
    sliding = SLIDING_ATTENTION in cfg.layer_types
    # Qwen3's convention: the first max_window_layers layers attend fully, the rest slide; loaders
    # that rebuild layer_types from it must get the very layer_types written (0 when all slide).
    leading_full = next((i for i, t in enumerate(cfg.layer_types) if t != FULL_ATTENTION), cfg.num_layers)
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": dict(AUTO_MAP),
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": target_layers,
        # block_size and mask_token_id both at the top and in dflash_config: serving loaders read one or the other.
        "mask_token_id": cfg.mask_token_id,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                          "block_size": cfg.block_size},
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
        "max_window_layers": leading_full,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    if target is not None:
        config[TARGET_KEY] = asdict(target)
    return config


def model_code() -> bytes:
    """The self-contained transformers module written next to config.json (train/remote_code)."""
    return resources.files("dflash_cache.train.remote_code").joinpath(MODEL_CODE_NAME).read_bytes()


def tensor_mismatch(state: dict[str, torch.Tensor], cfg: DrafterConfig) -> str | None:
    """How a state dict differs from the tensors a drafter of `cfg` has (None: names and shapes match)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got == expected:
        return None
    return (f"missing {sorted(set(expected) - set(got))}, unexpected {sorted(set(got) - set(expected))}, shapes "
            f"differ for {sorted(k for k in set(got) & set(expected) if got[k] != expected[k])}")


def export_drafter(drafter: DFlashDrafter, cfg: DrafterConfig, out_dir: Path,
                   target: TargetIdentity | None = None) -> None:
    """Write out_dir/config.json (recording `target`, the target trained for), out_dir/model.safetensors
    (bf16, the drafter's tensors unprefixed) and out_dir/dflash.py (the code config.json's auto_map
    names); config.json last, so that a new export directory holding a config.json holds everything
    it names."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to(device="cpu", dtype=EXPORT_DTYPE).contiguous()
             for name, t in drafter.state_dict().items()}
    mismatch = tensor_mismatch(state, cfg)
    if mismatch is not None:
        raise ValueError(f"drafter tensors do not match its config: {mismatch}")
    config = export_config(cfg, target)
    write_bytes_atomic(out_dir / WEIGHTS_NAME, save(state, metadata={"format": "pt"}))
    write_bytes_atomic(out_dir / MODEL_CODE_NAME, model_code())
    write_json_atomic(out_dir / CONFIG_NAME, config)


def read_export_config(out_dir: Path) -> dict:
    """out_dir/config.json as a dict; a file that is not a JSON object is a UserError naming it."""
    path = Path(out_dir) / CONFIG_NAME
    try:
        config = read_json(path, max_bytes=1 << 20)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable JSON file ({one_line(e)}); {REEXPORT}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a JSON {type(config).__name__}, not a drafter config object; {REEXPORT}")
    return config


def load_exported(out_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, state dict as stored); an unreadable file is a UserError naming it."""
    out_dir = Path(out_dir)
    config = read_export_config(out_dir)
    path = out_dir / WEIGHTS_NAME
    try:
        return config, load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise UserError(f"{path} cannot be read ({one_line(e)}); {REEXPORT}") from None


def exported_target(config: dict) -> TargetIdentity | None:
    """The target an export's config.json records (None: exported before targets were recorded);
    ValueError naming the field if the record is malformed."""
    record = config.get(TARGET_KEY)
    return None if record is None else load_dataclass(TargetIdentity, record, TARGET_KEY)


def _missing_keys(config: dict) -> list[str]:
    missing = [k for k in REQUIRED_KEYS if k not in config]
    dflash = config.get("dflash_config")
    if isinstance(dflash, dict):
        missing += [f"dflash_config.{k}" for k in REQUIRED_DFLASH_KEYS if k not in dflash]
    rope = config.get("rope_parameters")
    if config.get("rope_theta") is None and not (isinstance(rope, dict) and rope.get("rope_theta") is not None):
        missing.append("rope_theta")
    return missing


def config_from_export(config: dict) -> DrafterConfig:
    """The DrafterConfig of a config.json dict; ValueError naming the missing keys or the bad value."""
    missing = _missing_keys(config)
    if missing:
        raise ValueError(f"lacks {', '.join(missing)}: not a complete DFlash drafter config")
    try:
        return _drafter_config(config)
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"has a bad value ({one_line(e)})") from None


def _drafter_config(config: dict) -> DrafterConfig:
    dflash = config["dflash_config"]
    rope = config.get("rope_parameters") or {}
    # RoPE's base where it is given: rope_parameters first, the top-level key if that holds null
    rope_theta = rope.get("rope_theta") if rope.get("rope_theta") is not None else config.get("rope_theta")
    return DrafterConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=float(rope_theta),  # pyright: ignore[reportArgumentType] (not null: _missing_keys checked)
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        block_size=config["block_size"],
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        layer_types=tuple(config.get("layer_types") or (FULL_ATTENTION,) * config["num_hidden_layers"]),
        sliding_window=config.get("sliding_window"),
        target_num_hidden_layers=config.get("num_target_layers", 0),
    )


class Export(NamedTuple):
    """An exported drafter as read back: its config, its bf16 weights, and the target it was trained for
    (None for an export written before targets were recorded)."""

    cfg: DrafterConfig
    drafter: DFlashDrafter
    target: TargetIdentity | None


def read_export(out_dir: Path) -> Export:
    """The export in out_dir, the weights loaded strictly. A broken or incomplete export is a one-line
    UserError naming its file and what is wrong."""
    out_dir = Path(out_dir)
    config, state = load_exported(out_dir)
    path = out_dir / CONFIG_NAME
    try:
        cfg = config_from_export(config)
    except ValueError as e:
        raise UserError(f"{path} {e}; {REEXPORT}") from None
    try:
        target = exported_target(config)
    except ValueError as e:
        raise UserError(f"{path}: its record of the target is malformed ({e}); {REEXPORT}") from None
    mismatch = tensor_mismatch(state, cfg)
    if mismatch is not None:
        raise UserError(f"{out_dir / WEIGHTS_NAME} does not hold the drafter its config.json describes "
                        f"({mismatch}); {REEXPORT}")
    drafter = DFlashDrafter(cfg).to(EXPORT_DTYPE)
    drafter.load_state_dict(state, strict=True)
    return Export(cfg, drafter, target)


def drafter_from_export(out_dir: Path) -> tuple[DrafterConfig, DFlashDrafter]:
    """Rebuild the config and a bf16 drafter holding the exported weights (strict load)."""
    export = read_export(out_dir)
    return export.cfg, export.drafter


def check_target(export_dir: Path, trained: TargetIdentity | None, cfg: DrafterConfig, given: TargetIdentity) -> None:
    """Refuse to run the drafter of `export_dir` with a target other than the one it was trained for,
    naming both targets and the first field that differs. An export that records no target (written
    before they were recorded) is checked only for what its tensors and layer ids need, with a warning
    that the rest cannot be; a checkpoint of the same architecture with other weights (a fine-tune) runs,
    with a warning: eval then measures how well the drafter carries over to it."""
    if trained is None:
        log.warning("--drafter %s records no target (exported before dflash-cache recorded one): cannot check that "
                    "it was trained for --target %s; a new export records it", export_dir, given.name)
    else:
        TargetRecord(trained, f"--drafter {export_dir}: {CONFIG_NAME}", "trained for",
                     "pass the target it was trained for, or train a drafter for this one").check(given)
        if trained.weights_fingerprint and trained.weights_fingerprint != given.weights_fingerprint:
            log.warning("--target %s has the architecture of %s, which the drafter was trained for, but other weights "
                        "(fingerprint %s, not %s): tau measures the drafter on these", given.name, trained.name,
                        given.weights_fingerprint, trained.weights_fingerprint)
    sizes = (("vocab_size", cfg.vocab_size, given.vocab_size), ("hidden_size", cfg.hidden_size, given.hidden_size))
    for name, have, want in sizes:
        if have != want:
            raise UserError(f"--drafter {export_dir} needs a target with {name} {have}, but --target {given.name} "
                            f"has {want}; pass the target it was trained for")
    if max(cfg.target_layer_ids) > given.num_hidden_layers - 2:
        raise UserError(f"--drafter {export_dir} reads target layers {list(cfg.target_layer_ids)}, but --target "
                        f"{given.name} has {given.num_hidden_layers} layers (the last usable is "
                        f"{given.num_hidden_layers - 2}); pass the target it was trained for")
