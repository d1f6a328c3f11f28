"""What both phases make of `--data` before any feature exists: the dataset opened (a path, or the
built-in demo rows), its rows checked against the target's context, and the manifest of a cache of
its features. Extraction and `train --live` (with its `--write-cache` tee) call the same functions,
so a cache made by either records the same thing for the same data and target.
"""

from __future__ import annotations

import numpy as np

from dflash_cache.data.chat import ChatSpec
from dflash_cache.data.dataset import TokenizedDataset, from_table, open_dataset
from dflash_cache.errors import UserError
from dflash_cache.store.codecs import get_codec
from dflash_cache.store.manifest import Manifest
from dflash_cache.store.plan import Plan
from dflash_cache.target.model import TargetDescription


def open_data(data: str, limit: int | None = None, chat: ChatSpec | None = None) -> TokenizedDataset:
    """`--data`: a dataset path, or 'demo' for the built-in demo set; `chat` (the target's tokenizer,
    loaded only for a `messages` dataset, and --chat-template) renders chat rows."""
    if data == "demo":
        if chat is not None and chat.chat_template is not None:  # its rows are tokenized already
            raise UserError("--chat-template applies only to chat datasets, not --data demo; drop it")
        from dflash_cache.data.demo import demo_table

        table = demo_table()
        if limit is not None:
            if limit <= 0:
                raise UserError(f"--limit must be positive, got {limit}")
            table = table.slice(0, limit)
        return from_table(table, name="demo")
    return open_dataset(data, limit=limit, chat=chat)


def build_manifest(target: TargetDescription, dataset: TokenizedDataset, plan: Plan, *, codec: str,
                   max_len: int | None, overlong: str) -> Manifest:
    """The manifest of a cache of `dataset`'s features from `target`, made by `plan` from lengths
    taken under the --max-len policy (`max_len`, `overlong`)."""
    feature_codec = get_codec(codec)
    feature_codec.check(target.hidden_size)
    return Manifest(
        target=target.identity,
        layer_ids=tuple(target.layer_ids),
        hidden_size=target.hidden_size,
        codec=feature_codec.name,
        codec_layout=feature_codec.layout,
        dataset_fingerprint=dataset.fingerprint,
        dataset_description=dataset.description,
        plan=plan.params(max_len=max_len, overlong=overlong),
    )


def check_context(lengths: np.ndarray, context: int | None, dataset: TokenizedDataset) -> None:
    """Refuse rows longer than the target's context (after --max-len): their features past the
    context are out of distribution, which a drafter would learn silently. Lengths are at hand."""
    if context is None:
        return
    over = np.flatnonzero(lengths > context)
    if over.size:
        row = int(over[0])
        others = f" (and {over.size - 1} more rows)" if over.size > 1 else ""
        raise UserError(
            f"row {row} of {dataset.description} has {int(lengths[row]):,} tokens, more than the target's context "
            f"of {context:,} (max_position_embeddings){others}; pass --max-len {context} with --overlong "
            "truncate or skip"
        )
