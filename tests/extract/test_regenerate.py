"""`dflash-cache regenerate`: assistant turns replaced by the target's own greedy replies, turn by
turn, batched; the output is a chat dataset the other commands read; bad input and failures leave
no file behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.errors import UserError
from dflash_cache.extract import regenerate as regenerate_module
from dflash_cache.extract.chat import ChatSpec
from dflash_cache.extract.dataset import open_dataset
from dflash_cache.extract.regenerate import RegenerateConfig, regenerate
from dflash_cache.extract.tiny import build_tiny_target
from dflash_cache.train.speculative import greedy_generate
from tests.extract.test_chat import CHATS, write_jsonl

NEW_TOKENS = 10
EOT_ID = 0  # the tiny tokenizer's end of text, its template's end of an assistant turn


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> tuple[Path, list[list[dict]]]:
    """CHATS (one two-turn conversation, one single-turn) plus an unusable row, regenerated in one
    batch of 4 rows (left padding); returns (output file, its conversations)."""
    root = tmp_path_factory.mktemp("regen")
    data = write_jsonl(root / "chat.jsonl", [*CHATS, [], CHATS[0]])
    out = root / "out" / "regen.jsonl"
    cfg = RegenerateConfig(model="tiny", data=str(data), out=str(out), max_new_tokens=NEW_TOKENS, batch_size=4,
                           dtype="float32", progress=False)
    import torch

    report = regenerate(cfg, torch.device("cpu"))
    rows = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert (report.rows, report.dropped, len(rows)) == (len(CHATS) + 1, 1, len(CHATS) + 1)
    assert report.turns == sum(m["role"] == "assistant" for c in [*CHATS, CHATS[0]] for m in c)
    return out, rows


def test_each_assistant_turn_is_the_targets_greedy_reply_to_what_precedes_it(regenerated):
    """Checked one prompt at a time with the decoding eval uses (no padding, another code path): turn
    k is the target's greedy reply to the conversation up to it, earlier turns already regenerated;
    system and user turns are untouched."""
    _, rows = regenerated
    target = build_tiny_target().float()
    encoder = ChatSpec("tiny").load()
    originals = [*CHATS, CHATS[0]]
    for conv, original in zip(rows, originals, strict=True):
        assert [m["role"] for m in conv] == [m["role"] for m in original]
        for i, message in enumerate(conv):
            if message["role"] != "assistant":
                assert message == original[i]
                continue
            prompt = encoder.tokenizer(encoder.render(conv[:i], generation_prompt=True),
                                       add_special_tokens=False)["input_ids"]
            reply = np.asarray(greedy_generate(target, prompt, NEW_TOKENS))
            stop = np.flatnonzero(reply == EOT_ID)
            reply = reply[: stop[0]] if stop.size else reply
            assert message["content"] == encoder.tokenizer.decode(reply, skip_special_tokens=True)
    assert rows[0] == rows[-1], "the same conversation regenerates the same way in another batch row"


def test_the_output_is_a_chat_dataset(regenerated):
    """extract reads the file as chat rows: the loss mask covers the regenerated replies."""
    out, rows = regenerated
    dataset = open_dataset(str(out), chat=ChatSpec("tiny"))
    assert dataset.num_rows == len(rows)
    row = next(iter(dataset.read_rows(0, 1, max_len=None)))
    assert 0 < int(row.loss_mask.sum()) < len(row.input_ids)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, small_parquet):
    out = tmp_path / "regen.jsonl"
    r = CliRunner().invoke(cli, ["regenerate", "--model", "tiny", "--data", str(small_parquet), "--out", str(out)])
    assert r.exit_code == 2 and "has no 'messages' column" in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(cli, ["regenerate", "--model", "tiny", "--data", str(small_parquet), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "is a directory" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_a_stopped_run_resumes_from_its_finished_parts(tmp_path, monkeypatch):
    """A crash while generating the second part leaves no output file, only the finished first part;
    the same command again generates the other parts only, and writes what an uninterrupted run
    writes. Another setting is refused while those parts are there."""
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS * 2)
    import torch

    def cfg(out: Path, **kw) -> RegenerateConfig:
        base = dict(model="tiny", data=str(data), out=str(out), max_new_tokens=4, batch_size=1, part_rows=1,
                    dtype="float32", progress=False)
        return RegenerateConfig(**{**base, **kw})

    regenerate(cfg(tmp_path / "straight.jsonl"), torch.device("cpu"))
    calls = []
    real = regenerate_module.greedy_complete

    def counting(*args, **kwargs):
        calls.append(1)
        if fail and len(calls) > 2:  # the first row (2 assistant turns) is part 0
            raise RuntimeError("simulated failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate_module, "greedy_complete", counting)
    out = tmp_path / "out.jsonl"
    fail = True
    with pytest.raises(RuntimeError, match="simulated"):
        regenerate(cfg(out), torch.device("cpu"))
    assert not out.exists()
    assert sorted(p.name for p in (tmp_path / "out.jsonl.parts").iterdir()) == [
        "params.json", "part-000000000000-000000000001.jsonl"]
    with pytest.raises(UserError, match="holds the parts of a run with another max_new_tokens"):
        regenerate(cfg(out, max_new_tokens=5), torch.device("cpu"))
    fail, calls[:] = False, []
    report = regenerate(cfg(out), torch.device("cpu"))
    assert report.resumed_parts == 1 and report.rows == 6
    assert len(calls) == 1 + 1 + 2 + 1 + 1, "rows 1..5 only, one call per assistant turn (row 0 had 2)"
    assert out.read_text() == (tmp_path / "straight.jsonl").read_text()
    assert not (tmp_path / "out.jsonl.parts").exists()


def test_a_row_the_chat_template_refuses_is_dropped_not_a_crash(tmp_path):
    """A template that raises on one row (as templates do on roles out of order) drops that row, as
    extract does, and the others are regenerated."""
    import torch

    from dflash_cache.extract.tiny import TINY_DIR

    template = tmp_path / "strict.jinja"
    template.write_text("{% for m in messages %}{% if 'REFUSE' in m['content'] %}{{ raise_exception('refused') }}"
                        "{% endif %}{% endfor %}" + (TINY_DIR / "chat_template.jinja").read_text())
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
           {"role": "user", "content": "REFUSE this"}, {"role": "assistant", "content": "b"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [CHATS[0], bad])
    cfg = RegenerateConfig(model="tiny", data=str(data), out=str(tmp_path / "out.jsonl"), chat_template=str(template),
                           max_new_tokens=4, dtype="float32", progress=False)
    report = regenerate(cfg, torch.device("cpu"))
    assert (report.rows, report.dropped) == (1, 1)
    assert report.turns == sum(m["role"] == "assistant" for m in CHATS[0]) + 1  # the bad row's first turn ran
