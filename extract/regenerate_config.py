"""`dflash-cache regenerate`'s options, apart from the code that runs it, so that its `--help` loads
no torch (as `extract.config` is to `extract.run`)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_cache.options import check_options, option
from dflash_cache.target.spec import DTYPE_NAMES


@dataclass(frozen=True, kw_only=True)
class RegenerateConfig:
    model: str = option(help="The target: a local Hugging Face model directory, or 'tiny'.")
    data: str = option(path="any", help="Chat dataset (messages rows): JSONL, Parquet or a HF datasets directory.")
    out: str = option(path="any", help="JSONL file to write (it appears only when complete).")
    chat_template: str | None = option(None, path="any", help="Jinja chat template overriding the tokenizer's.")
    max_new_tokens: int = option(1024, min=1, help="Longest regenerated turn, in tokens (a longer reply is cut "
                                                   "there and counted).")
    batch_size: int = option(16, min=1, help="Conversations generated together.")
    part_rows: int = option(1024, min=1, help="Input rows per saved part: a stopped run resumes from the last "
                                              "finished part.")
    limit: int | None = option(None, min=1, help="Use only the first N rows.")
    dtype: str = option("bfloat16", choices=tuple(DTYPE_NAMES), help="Target compute dtype.")
    trust_remote_code: bool = option(False, help="Allow the model directory's own Python code.")
    overwrite: bool = option(False, help="Replace an existing --out that is not this job's finished output, and "
                                         "delete the saved parts of another job at OUT.parts.")
    progress: bool = option(True, help="Log no progress lines (rows done, tokens/s, ETA).")

    def __post_init__(self) -> None:
        check_options(self)
