"""The command lines that serve an exported drafter with SGLang or vLLM, or convert it to the
speculators format first, rendered from the export's own config.json.

An engine drafts as many tokens per step as it is told, not as many as the drafter was trained for:
SGLang's `--speculative-num-draft-tokens` counts the whole block (anchor included), vLLM's
`num_speculative_tokens` only the mask slots (block size - 1). A hand-typed number that disagrees
with the trained block serves silently with lower acceptance, so the commands are rendered from the
block size the export records. docs/serving.md shows their output, which export fields each engine
reads, and from which engine versions those facts were taken.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from dflash_cache.errors import UserError
from dflash_cache.train.export import (
    CONFIG_NAME,
    REEXPORT,
    TARGET_KEY,
    config_from_export,
    read_export_config,
)
from dflash_cache.train.run_directory import EXPORT_DIR

ENGINES = ("sglang", "vllm", "speculators")
ARCHITECTURE = "DFlashDraftModel"  # the name both engines' model registries map to their DFlash drafter
CONVERTED_SUFFIX = "-speculators"  # default directory of a speculators conversion: beside the export


@dataclass(frozen=True)
class ServedDrafter:
    """What the serving engines take from an export's config.json."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]

    @property
    def num_speculative_tokens(self) -> int:
        """vLLM's count: the block's mask slots (its slot 0 is the anchor, a token already verified)."""
        return self.block_size - 1

    @property
    def mixed_attention(self) -> bool:
        """Sliding and full layers together, which vLLM serves only on its V2 model runner."""
        return len(set(self.layer_types)) > 1


def export_dir_of(path: Path) -> Path:
    """A training run's export/ directory when given the run directory, else `path` itself."""
    path = Path(path)
    return path / EXPORT_DIR if (path / EXPORT_DIR / CONFIG_NAME).is_file() else path


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def served_drafter(config: dict) -> ServedDrafter:
    """The serving fields of a config.json dict; ValueError naming the key an engine would trip on.

    SGLang reads `dflash_config.block_size` before the top-level `block_size`, the speculators
    converter the other way round: both are checked so that every engine drafts the same block."""
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise ValueError(f"architectures is {config.get('architectures')!r}, not [{ARCHITECTURE!r}]: "
                         "SGLang and vLLM pick their DFlash drafter by it")
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError("has no dflash_config object (vLLM reads the mask token id from it)")
    sizes = {key: value for key, value in (("dflash_config.block_size", dflash.get("block_size")),
                                           ("block_size", config.get("block_size"))) if value is not None}
    if not sizes:
        raise ValueError("lacks block_size and dflash_config.block_size: the engines cannot tell the trained block")
    if len(set(sizes.values())) > 1 or not all(_int(v) and v >= 2 for v in sizes.values()):
        raise ValueError(f"has block sizes {sizes}: they must be one integer of at least 2 (SGLang reads "
                         "dflash_config.block_size first, the speculators converter block_size first)")
    mask = dflash.get("mask_token_id")
    if not (_int(mask) and mask >= 0):
        raise ValueError(f"has dflash_config.mask_token_id {mask!r}, not a token id (vLLM requires it there)")
    layer_ids = dflash.get("target_layer_ids")
    if not (isinstance(layer_ids, list) and layer_ids and all(_int(i) and i >= 0 for i in layer_ids)):
        raise ValueError(f"has dflash_config.target_layer_ids {layer_ids!r}, not a list of layer ids")
    num_layers = config.get("num_hidden_layers")
    layer_types = tuple(config.get("layer_types") or ("full_attention",) * (num_layers or 0))
    return ServedDrafter(block_size=next(iter(sizes.values())), mask_token_id=mask,
                         target_layer_ids=tuple(layer_ids), layer_types=layer_types)


def read_served_drafter(export_dir: Path) -> ServedDrafter:
    """The serving fields of the export in `export_dir`, after the checks `eval` makes of its config;
    a config no engine could serve is a one-line UserError naming the file."""
    config = read_export_config(export_dir)
    path = Path(export_dir) / CONFIG_NAME
    try:
        config_from_export(config)
        return served_drafter(config)
    except ValueError as e:
        raise UserError(f"{path} {e}; {REEXPORT}") from None


def sglang_command(drafter: ServedDrafter, export: str, target: str) -> list[str]:
    """SGLang's server with the drafter: its draft-token count is the whole block (anchor included)."""
    return ["python", "-m", "sglang.launch_server", "--model-path", target,
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", export,
            "--speculative-num-draft-tokens", str(drafter.block_size)]


def vllm_command(drafter: ServedDrafter, export: str, target: str) -> list[str]:
    """vLLM's server with the drafter. "method" must be given: vLLM guesses DFlash only from a model
    path containing "dflash"; "num_speculative_tokens" counts the mask slots, block size - 1."""
    spec = {"method": "dflash", "model": export, "num_speculative_tokens": drafter.num_speculative_tokens}
    env = ["VLLM_USE_V2_MODEL_RUNNER=1"] if drafter.mixed_attention else []
    return [*env, "vllm", "serve", target, "--speculative-config", json.dumps(spec)]


def speculators_commands(export: str, target: str, converted: str) -> list[list[str]]:
    """The speculators conversion (it reads the block size from config.json and writes a
    speculators_config naming the target and block size - 1 draft tokens, with the target's embedding
    and LM head), then vLLM serving the converted directory."""
    return [["speculators", "convert", export, "--algorithm", "dflash", "--verifier", target,
             "--output-path", converted],
            ["vllm", "serve", converted]]


def render(engine: str, drafter: ServedDrafter, export: str, target: str, converted: str | None = None
           ) -> list[list[str]]:
    """The command lines (argv lists, in order) that serve `drafter`, stored at `export`, with `engine`."""
    if engine == "sglang":
        return [sglang_command(drafter, export, target)]
    if engine == "vllm":
        return [vllm_command(drafter, export, target)]
    if engine == "speculators":
        return speculators_commands(export, target, converted or export.rstrip("/") + CONVERTED_SUFFIX)
    raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")


def recorded_target(export_dir: Path) -> str | None:
    """The name of the target the export records it was trained for (None: it records none)."""
    record = read_export_config(export_dir).get(TARGET_KEY)
    return record.get("name") if isinstance(record, dict) else None


def serve_commands(engine: str, path: Path, target: str | None = None, converted: str | None = None
                   ) -> list[list[str]]:
    """The command lines for the export at `path` (a run or export directory) with `engine`; `target`
    defaults to the target the export records."""
    export_dir = export_dir_of(path)
    if not (export_dir / CONFIG_NAME).is_file():
        raise UserError(f"{path}: no exported drafter (config.json) there; pass a run or export directory")
    drafter = read_served_drafter(export_dir)
    target = target or recorded_target(export_dir)
    if not target:
        raise UserError(f"{export_dir} records no target; pass --target, the model it was trained for")
    return render(engine, drafter, str(export_dir), target, converted)


def format_command(argv: Sequence[str]) -> str:
    """A shell command line, quoted, one option (with its value) per continued line."""
    groups: list[list[str]] = [[]]
    for word in argv:
        if word.startswith("--") and groups[-1]:
            groups.append([])
        groups[-1].append(word)
    return " \\\n    ".join(shlex.join(group) for group in groups)
