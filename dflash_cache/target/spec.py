"""What the user asks of a target, as options: which model, in which dtype, capturing which layers.

Kept apart from `dflash_cache.target.model` (which loads the model) so that the commands' options and
their `--help` load no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_cache.options import check_options, option

# --dtype's names, each with the torch dtype it means (by its name in torch).
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "float32": "float32", "fp32": "float32"}


@dataclass(frozen=True)
class TargetSpec:
    """What the user asked for: which model, in which dtype, capturing which layers (also `extract`'s options)."""

    model: str = option(help="Local Hugging Face model directory, or 'tiny' (built-in, no download).")
    dtype: str = option("bfloat16", choices=tuple(DTYPE_NAMES), help="Target compute dtype.")
    num_layers: int = option(5, min=1, help="Layers spread evenly over 1..L-3.")
    layers: tuple[int, ...] | None = option(None, help="Explicit decoder layer ids, e.g. 1,9,17,25,33 (overrides "
                                                       "--num-layers).")
    trust_remote_code: bool = option(False, help="Allow the model directory's own Python code.")

    def __post_init__(self) -> None:
        check_options(self)
