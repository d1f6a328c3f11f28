"""Chat datasets (`messages` rows): rendering, the assistant-only loss mask, readers, drops, end to end.

The mask covers each assistant message's content plus the special token that the template puts right
after it (the tiny template's end of turn, `<|endoftext|>`): the target emits it to end its turn, so
the drafter should predict it. Role headers, the newline after the end of turn and user/system turns
are never supervised. Unusable rows (empty, no assistant content, a message without string role and
content) are dropped and counted; a `messages` value of the wrong JSON type in a JSONL file is a
one-line error, as for any column.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.data.chat import ChatEncoder, ChatSpec
from dflash_cache.data.dataset import open_dataset
from dflash_cache.errors import UserError
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify
from dflash_cache.target.tiny import tiny_tokenizer

EOT = "<|endoftext|>"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi"},
    {"role": "assistant", "content": "hi there"},
    {"role": "user", "content": "Again: hi"},
    {"role": "assistant", "content": "def f(): return 1"},
]
CHATS = [
    CONVERSATION,
    [{"role": "user", "content": "Write a loop."}, {"role": "assistant", "content": "for i in range(3):\n    print(i)"}],
    [{"role": "user", "content": "Name?"}, {"role": "assistant", "content": "import os"}],
]
SPEC = ChatSpec("tiny")
SMALL = ["--model", "tiny", "--gpus", "cpu", "--token-budget", "1024", "--max-rows", "8", "--unit-rows", "16",
         "--buckets", "0,32,64", "--no-progress", "--writers", "2"]
CHATML = ("{%- for m in messages -%}{{- '<' + m['role'] + '>' + m['content'] + eos_token + '\\n' -}}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<assistant>' -}}{%- endif -%}")


def supervised_runs(ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded text of each maximal run of supervised tokens."""
    tok, runs, cur = tiny_tokenizer(), [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = [*runs, tok.decode(cur)], []
    return runs + ([tok.decode(cur)] if cur else [])


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps({"messages": r, "id": k}) + "\n" for k, r in enumerate(rows)))
    return path


def test_mask_is_exactly_the_assistant_turns():
    ids, mask = ChatEncoder(tiny_tokenizer()).encode(CONVERSATION)
    text = tiny_tokenizer().decode(ids)
    assert text == ("# system:\nBe brief.\n# user:\nSay hi\n# assistant:\nhi there<|endoftext|>\n"
                    "# user:\nAgain: hi\n# assistant:\ndef f(): return 1<|endoftext|>\n")
    assert supervised_runs(ids, mask) == [f"hi there{EOT}", f"def f(): return 1{EOT}"]
    assert (ids == 0).sum() == 2 and mask[ids == 0].all()  # the end of turn is the eos id, supervised
    assert mask[-1] == 0  # the newline after the last end of turn is the template's, not the target's


def test_a_template_that_renders_the_last_turn_differently():
    """Qwen3-style: only the final assistant turn gets a think block, so prefixes of the rendering are
    not renderings of prefixes; the content search still finds each turn, and the block stays unsupervised."""
    template = ("{%- for m in messages -%}{{- '# ' + m['role'] + ':\\n' -}}"
                "{%- if m['role'] == 'assistant' and loop.last -%}{{- '<think></think>' -}}{%- endif -%}"
                "{{- m['content'] -}}{%- if m['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
                "{{- '\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '# assistant:\\n' -}}{%- endif -%}")
    ids, mask = ChatEncoder(tiny_tokenizer(), template).encode(CONVERSATION)
    assert "<think></think>def f()" in tiny_tokenizer().decode(ids)
    assert supervised_runs(ids, mask) == [f"hi there{EOT}", f"def f(): return 1{EOT}"]


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    jsonl = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    pq.write_table(pa.table({"messages": [r for r in CHATS]}), tmp_path / "chat.parquet", row_group_size=2)
    encoder = ChatEncoder(tiny_tokenizer())
    for path in (jsonl, tmp_path / "chat.parquet"):
        ds = open_dataset(path, chat=SPEC)
        scan = ds.scan(vocab_size=2048, max_len=None)
        rows = ds.read_rows(0, ds.num_rows, max_len=None)
        assert scan.dropped == 0 and len(rows) == 3
        for row, conv in zip(rows, CHATS, strict=True):
            ids, mask = encoder.encode(conv)
            assert np.array_equal(row.input_ids, ids) and np.array_equal(row.loss_mask, mask)
            assert scan.supervised[row.index] == mask.sum()
    truncated = open_dataset(jsonl, chat=SPEC).scan(vocab_size=2048, max_len=20)
    assert truncated.truncated == 2 and truncated.lengths.max() == 20


def test_unusable_rows_are_dropped_and_counted(tmp_path):
    bad = [[], [{"role": "user", "content": "no answer"}], [{"role": "user"}, {"role": "assistant", "content": "x"}],
           [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]]
    ds = open_dataset(write_jsonl(tmp_path / "chat.jsonl", [CHATS[1], *bad, CHATS[2]]), chat=SPEC)
    scan = ds.scan(vocab_size=2048, max_len=None)
    assert scan.dropped == 4 and scan.keep.tolist() == [True, False, False, False, False, True]
    assert [r.index for r in ds.read_rows(0, 6, max_len=None)] == [0, 5]
    with pytest.raises(UserError, match="all 4 chat rows were dropped"):
        open_dataset(write_jsonl(tmp_path / "bad.jsonl", bad), chat=SPEC).scan(vocab_size=2048, max_len=None)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [CHATS[1], "hello"])
    with pytest.raises(UserError, match=r"messages has mixed .* expected a list of \{role, content\}"):
        open_dataset(mixed, chat=SPEC).scan(vocab_size=2048, max_len=None)


def test_chat_needs_a_target_and_the_template_needs_chat(tmp_path, small_parquet):
    jsonl = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(UserError, match="chat dataset"):
        open_dataset(jsonl)
    (tmp_path / "t.jinja").write_text(CHATML)
    with pytest.raises(UserError, match="applies only to chat datasets"):
        open_dataset(small_parquet, chat=ChatSpec("tiny", str(tmp_path / "t.jinja")))


def test_extract_chat_end_to_end_and_the_template_is_part_of_the_fingerprint(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS * 4)
    out = tmp_path / "cache"
    r = CliRunner().invoke(cli, ["extract", "--data", str(data), "--out", str(out), *SMALL], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    reader = CacheReader(out)
    assert reader.complete and verify(reader) == []
    ids, mask = ChatEncoder(tiny_tokenizer()).encode(CHATS[1])
    sample = reader.sample(1)
    assert np.array_equal(sample.input_ids, ids) and np.array_equal(sample.loss_mask, mask)

    other = tmp_path / "chatml.jinja"
    other.write_text(CHATML)
    assert open_dataset(data, chat=ChatSpec("tiny", str(other))).fingerprint != open_dataset(data, chat=SPEC).fingerprint
    r = CliRunner().invoke(cli, ["extract", "--data", str(data), "--out", str(out), "--chat-template", str(other),
                                 *SMALL])
    assert r.exit_code != 0 and "dataset_fingerprint" in r.output, r.output


def test_train_live_reads_chat_data_through_the_same_readers(tmp_path):
    import torch

    from dflash_cache.train.run_config import LiveConfig, TrainConfig
    from dflash_cache.train.trainer import Trainer

    long = [[{"role": "user", "content": f"Write function {k}."},
             {"role": "assistant", "content": f"def f{k}(x):\n    return [x * {k} for _ in range(10)]"}]
            for k in range(12)]
    data = write_jsonl(tmp_path / "chat.jsonl", long)
    cfg = TrainConfig(target="tiny", out=str(tmp_path / "run"), block_size=4, draft_layers=1, num_anchors=8,
                      token_budget=512, max_steps=2, progress=False,
                      live=LiveConfig(data=str(data), queue_depth=2, write_cache=str(tmp_path / "tee")))
    assert Trainer.build(cfg, device=torch.device("cpu")).fit()["step"] == 2
    manifest = CacheReader(tmp_path / "tee").manifest
    assert manifest.dataset_fingerprint == open_dataset(data, chat=SPEC).fingerprint


def test_eval_prompts_of_chat_data_end_where_the_first_assistant_turn_starts(tmp_path):
    from dflash_cache.train.speculative import load_prompts

    prompts = load_prompts(str(write_jsonl(tmp_path / "chat.jsonl", CHATS)), 3, chat=SPEC)
    texts = [tiny_tokenizer().decode(p) for p in prompts]
    assert texts == ["# system:\nBe brief.\n# user:\nSay hi\n# assistant:\n",
                     "# user:\nWrite a loop.\n# assistant:\n", "# user:\nName?\n# assistant:\n"]
