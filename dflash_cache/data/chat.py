"""Chat datasets: rows of `messages` rendered with the target's chat template, assistant turns supervised.

Users hold conversations, not token ids. A dataset with a `messages` column and no `input_ids` is
read through `ChatSource`, which wraps the file's own lazy reader and turns each batch of
conversations into `input_ids` / `loss_mask` on the fly, so the tokenized-dataset validation, the
--max-len policy and every caller stay one code path.

The mask: the conversation is rendered once with the template and tokenized with character offsets.
Each assistant message's content is located in the rendering, searched from where the rendering of
the conversation before it (with the generation prompt) stops agreeing with the full one, so role
markers and user/system text are never matched; a special token immediately after the content (the
template's end-of-turn, e.g. `<|im_end|>`, `<|eot_id|>`, `</s>`) is supervised too, since the target
emits it to end its turn. Tokens overlapping those spans get loss_mask 1. This needs no `{% generation %}`
markers and tolerates templates that render the last turn differently (e.g. Qwen3's think block).

A row that cannot be used (no messages, a message without a string role/content, no assistant turn
with content, a template error) is dropped: it becomes an empty row that the dataset counts and skips.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from jinja2 import TemplateError

from dflash_cache.data.formats import Batch, Source
from dflash_cache.errors import UserError, one_line

log = logging.getLogger(__name__)

MESSAGES = "messages"
_VERSION = "chat-mask-v1"  # bump when the mask rule changes: it is part of the fingerprint
_ROW_TYPE = pa.list_(pa.int32())
_MASK_TYPE = pa.list_(pa.uint8())

TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError, KeyError)  # a row's (or the template's) fault


class Dropped(Exception):
    """A conversation that yields no training row; the message says why."""


@dataclass(frozen=True)
class ChatSpec:
    """Where a chat dataset's tokenizer and template come from; loaded only if the data is chat."""

    model: str  # the target: a model directory, or 'tiny'
    chat_template: str | None = None  # a Jinja file overriding the tokenizer's template
    trust_remote_code: bool = False

    def load(self) -> ChatEncoder:
        return ChatEncoder(self._tokenizer(), _read_template(self.chat_template))

    def _tokenizer(self) -> Any:
        from dflash_cache.target.tiny import TINY, tiny_tokenizer

        if self.model == TINY:
            return tiny_tokenizer()
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.model, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load the tokenizer of {self.model} for the chat dataset ({one_line(exc)}); "
                            "the model directory needs its tokenizer files") from exc


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read --chat-template {path} ({type(exc).__name__}); pass a UTF-8 Jinja file") from exc


class ChatEncoder:
    """Renders and tokenizes conversations; `identity` changes with the template and the tokenizer."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template if template is not None else tokenizer.chat_template
        if not self.template:
            raise UserError("the target's tokenizer has no chat template, so a messages dataset cannot be "
                            "rendered; pass --chat-template FILE (a Jinja template)")
        if not getattr(tokenizer, "is_fast", False):
            raise UserError("chat datasets need a fast (Rust) tokenizer for token offsets; give the model "
                            "directory a tokenizer.json")
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        specials = set(tokenizer.all_special_tokens) | {t.content for t in decoder.values() if t.special}
        self._specials = sorted(specials, key=len, reverse=True)  # longest first: no prefix wins
        h = hashlib.sha256(f"{_VERSION}\0{self.template}\0".encode())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            h.update(backend.to_str().encode())
        self.identity = h.hexdigest()

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """The conversation as the template renders it (with the assistant's generation prompt)."""
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, messages: object) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask uint8) of one conversation; raises `Dropped` with the reason."""
        msgs = clean_messages(messages)
        try:
            full = self.render(msgs)
            spans = [self._span(full, msgs, i) for i, m in enumerate(msgs) if m["role"] == "assistant"]
        except TEMPLATE_ERRORS as exc:
            raise Dropped(f"the chat template failed: {one_line(exc)}") from exc
        spans = [s for s in spans if s[1] > s[0]]
        if not spans:
            raise Dropped("no assistant turn with content")
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for lo, hi in spans:
            mask[(offsets[:, 0] < hi) & (offsets[:, 1] > lo)] = 1
        return ids, mask

    def _span(self, full: str, msgs: list[dict], i: int) -> tuple[int, int]:
        """Characters of assistant message i's content (plus an end-of-turn special token) in `full`."""
        content = msgs[i]["content"].strip()
        if not content:
            return 0, 0
        before = self.render(msgs[:i], generation_prompt=True) if i else ""
        start = _common_prefix(before, full)
        pos = full.find(content, start)
        if pos < 0:
            raise Dropped(f"message {i}'s content does not appear in the rendered conversation")
        end = pos + len(content)
        eot = next((s for s in self._specials if full.startswith(s, end)), "")
        return pos, end + len(eot)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.frombuffer(a[:n].encode("utf-32-le"), np.uint32)
                          != np.frombuffer(b[:n].encode("utf-32-le"), np.uint32))
    return int(diff[0])


def clean_messages(messages: object) -> list[dict]:
    """The messages as plain dicts (Arrow structs fill absent keys with None, which templates misread)."""
    if not isinstance(messages, list) or not messages:
        raise Dropped("messages is empty or not a list")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise Dropped(f"message {k} is not an object with string role and content")
        out.append({key: v for key, v in m.items() if v is not None})
    return out


class ChatSource(Source):
    """A source of `messages` rows seen as `input_ids` / `loss_mask` rows (dropped rows are empty)."""

    def __init__(self, inner: Source, encoder: ChatEncoder) -> None:
        self.inner, self.encoder = inner, encoder
        self.kind, self.root, self.files, self.num_rows = inner.kind, inner.root, inner.files, inner.num_rows
        self.columns = ["input_ids", "loss_mask"]
        self._warned = False

    def describe(self) -> str:
        return f"{self.inner.describe()}, chat template {self.encoder.identity[:12]}"

    def rel_name(self, path: Path) -> str:
        return self.inner.rel_name(path)

    def batches(self, start: int, stop: int, columns: list[str]) -> Iterator[Batch]:
        for first, batch, label in self.inner.batches(start, stop, [MESSAGES]):
            ids, masks = [], []
            for k, conv in enumerate(batch.column(0).to_pylist()):
                try:
                    i, m = self.encoder.encode(conv)
                except Dropped as why:
                    self._warn(first + k, label, str(why))
                    i, m = np.zeros(0, np.int32), np.zeros(0, np.uint8)
                ids.append(i)
                masks.append(m)
            arrays = {"input_ids": _lists(ids, _ROW_TYPE), "loss_mask": _lists(masks, _MASK_TYPE)}
            yield first, pa.RecordBatch.from_arrays([arrays[c] for c in columns], names=columns), label

    def _warn(self, row: int, label: str, why: str) -> None:
        if not self._warned:
            self._warned = True
            where = f" ({label})" if label else ""
            log.warning("chat row %d%s dropped: %s (further drops are counted, not logged)", row, where, why)


def _lists(parts: list[np.ndarray], type_: pa.ListType) -> pa.Array:
    lengths = np.array([len(p) for p in parts], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = np.concatenate(parts) if parts else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(type_.value_type.to_pandas_dtype())))


def as_chat(source: Source, chat: ChatSpec | None) -> Source:
    """`source` itself when it is tokenized; a `ChatSource` when it holds `messages` and no `input_ids`."""
    if "input_ids" in source.columns or MESSAGES not in source.columns:
        if chat is not None and chat.chat_template is not None:
            raise UserError(f"--chat-template {chat.chat_template} applies only to chat datasets (a messages column "
                            "without input_ids); drop it for this dataset")
        return source
    if chat is None:
        raise UserError("this is a chat dataset (messages column) but no target tokenizer is known here; "
                        "tokenize it first, or pass it where --model/--target names the target")
    return ChatSource(source, chat.load())
