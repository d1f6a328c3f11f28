"""`dflash-cache regenerate`: assistant turns replaced by the target's own greedy replies, turn by
turn, batched; the output is a chat dataset the other commands read; bad input and failures leave
no file behind; an existing output is replaced only with --overwrite, and a finished job is not redone."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.data.chat import ChatSpec
from dflash_cache.data.dataset import open_dataset
from dflash_cache.errors import UserError
from dflash_cache.extract import regenerate as regenerate_module
from dflash_cache.extract.regenerate import RegenerateConfig, regenerate
from dflash_cache.target.tiny import build_tiny_target
from dflash_cache.train.speculative import greedy_generate
from tests.dflash_cache.data.test_chat import CHATS, write_jsonl

NEW_TOKENS = 10
EOT_ID = 0  # the tiny tokenizer's end of text, its template's end of an assistant turn


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> tuple[Path, list[list[dict]], RegenerateConfig]:
    """CHATS (one two-turn conversation, one single-turn) plus an unusable row, regenerated in one
    batch of 4 rows (left padding); returns (output file, its conversations, the config)."""
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
    return out, rows, cfg


def test_each_assistant_turn_is_the_targets_greedy_reply_to_what_precedes_it(regenerated):
    """Checked one prompt at a time with the decoding eval uses (no padding, another code path): turn
    k is the target's greedy reply to the conversation up to it, earlier turns already regenerated;
    system and user turns are untouched."""
    _, rows, _ = regenerated
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
    out, rows, _ = regenerated
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

    from dflash_cache.target.tiny import TINY_DIR

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


def cli_args(cfg: RegenerateConfig) -> list[str]:
    """The command line of `cfg` (its non-default options, as a user would type them)."""
    args = ["regenerate", "--model", cfg.model, "--data", cfg.data, "--out", cfg.out, "--dtype", cfg.dtype,
            "--max-new-tokens", str(cfg.max_new_tokens), "--batch-size", str(cfg.batch_size), "--no-progress"]
    return args + (["--overwrite"] if cfg.overwrite else [])


def forbid_loading_the_target(m: pytest.MonkeyPatch) -> None:
    """Loading the target fails the test: what must be decided before that (slow) load is."""
    m.setattr(regenerate_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))


def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path, monkeypatch):
    """A file at --out that this job did not finish (the user's own, or one edited since) is refused
    in one line naming it and --overwrite, before the target loads, leaving every file as it was;
    with --overwrite it is replaced."""
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS[1:])
    out = tmp_path / "regen.jsonl"
    out.write_text("my own file\n")
    cfg = RegenerateConfig(model="tiny", data=str(data), out=str(out), max_new_tokens=3, dtype="float32")
    before = sorted(p.name for p in tmp_path.iterdir())
    with monkeypatch.context() as m:
        forbid_loading_the_target(m)
        r = CliRunner().invoke(cli, cli_args(cfg))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    line = r.output.strip()
    assert "\n" not in line and str(out) in line and "--overwrite" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before and out.read_text() == "my own file\n"
    r = CliRunner().invoke(cli, cli_args(replace(cfg, overwrite=True)))
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["messages"][0] for line in out.read_text().splitlines()] == [c[0] for c in CHATS[1:]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "regen.jsonl", "regen.jsonl.done"]
    with out.open("a") as f:  # edited after it was written: no longer what its record says
        f.write(json.dumps({"messages": CHATS[0]}) + "\n")
    r = CliRunner().invoke(cli, cli_args(cfg))
    assert r.exit_code == 2 and "changed" in r.output and "--overwrite" in r.output, r.output


def test_a_finished_job_is_not_redone(regenerated, monkeypatch):
    """The same command again says in one line that the output is complete and exits 0 without
    loading the target or touching a file; other settings are refused (not this job's output)."""
    out, _, cfg = regenerated
    forbid_loading_the_target(monkeypatch)
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.parent.iterdir()}
    r = CliRunner().invoke(cli, cli_args(cfg))
    assert r.exit_code == 0, r.output
    assert r.output.count("\n") == 1 and "already complete" in r.output and str(out) in r.output, r.output
    r = CliRunner().invoke(cli, cli_args(replace(cfg, overwrite=True)))
    assert r.exit_code == 0 and "already complete" in r.output, r.output
    r = CliRunner().invoke(cli, cli_args(replace(cfg, max_new_tokens=NEW_TOKENS + 1)))
    assert r.exit_code == 2 and "max_new_tokens" in r.output and "--overwrite" in r.output, r.output
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.parent.iterdir()} == files


def test_a_run_stopped_after_renaming_its_output_finishes_without_the_target(tmp_path, monkeypatch):
    """Stopped between OUT's rename and its completion record: OUT is there without a record, its
    parts still beside it. The same command (no --overwrite: this job's parts show it was allowed to
    write OUT) finishes from the parts, without the target, and a third run has nothing to do."""
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS[1:])
    out = tmp_path / "regen.jsonl"
    cfg = RegenerateConfig(model="tiny", data=str(data), out=str(out), max_new_tokens=3, dtype="float32",
                           progress=False)
    import torch

    real = regenerate_module.write_json_atomic

    def stop_at_the_record(path, obj):
        if path.name.endswith(".done"):
            raise KeyboardInterrupt
        real(path, obj)

    with monkeypatch.context() as m:
        m.setattr(regenerate_module, "write_json_atomic", stop_at_the_record)
        with pytest.raises(KeyboardInterrupt):
            regenerate(cfg, torch.device("cpu"))
    written = out.read_bytes()
    assert (tmp_path / "regen.jsonl.parts").is_dir() and not (tmp_path / "regen.jsonl.done").exists()
    forbid_loading_the_target(monkeypatch)
    report = regenerate(cfg, torch.device("cpu"))
    assert (report.complete, report.rows, report.resumed_parts) == (False, 2, 1)
    assert out.read_bytes() == written and not (tmp_path / "regen.jsonl.parts").exists()
    assert regenerate(cfg, torch.device("cpu")).complete


def test_progress_is_logged_during_the_first_batch(tmp_path, monkeypatch, caplog):
    """Every decode step may report: the first line (rows done/total, tokens/s, ETA) comes before the
    first batch has finished, so a long batch does not leave the log silent."""
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    monkeypatch.setattr(regenerate_module, "PROGRESS_FIRST_S", 0.0)
    monkeypatch.setattr(regenerate_module, "PROGRESS_EVERY_S", 0.0)
    cfg = RegenerateConfig(model="tiny", data=str(data), out=str(tmp_path / "out.jsonl"), max_new_tokens=4,
                           batch_size=len(CHATS), dtype="float32")
    import torch

    with caplog.at_level(logging.INFO, logger=regenerate_module.__name__):
        regenerate(cfg, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("regenerate: ")]
    assert lines and lines[0].startswith(f"regenerate: 0/{len(CHATS)} rows") and "tok/s" in lines[0], lines
    assert lines[-1].startswith(f"regenerate: {len(CHATS)}/{len(CHATS)} rows") and "<00:00" in lines[-1], lines
    cfg = replace(cfg, out=str(tmp_path / "quiet.jsonl"), progress=False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=regenerate_module.__name__):
        regenerate(cfg, torch.device("cpu"))
    assert not [r for r in caplog.records if r.getMessage().startswith("regenerate: ")]


def test_another_jobs_parts_are_deleted_only_with_overwrite(tmp_path):
    """Saved parts of other settings at OUT.parts are refused, naming the setting and --overwrite;
    with --overwrite they are deleted and none of them ends up in OUT."""
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS[1:])
    out = tmp_path / "regen.jsonl"
    cfg = RegenerateConfig(model="tiny", data=str(data), out=str(out), max_new_tokens=3, part_rows=1,
                           dtype="float32", progress=False)
    import torch

    parts = tmp_path / "regen.jsonl.parts"
    parts.mkdir()
    (parts / "params.json").write_text(json.dumps({"max_new_tokens": 99}))
    (parts / "part-000000000000-000000000001.jsonl").write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    with pytest.raises(UserError, match="another data.*--overwrite"):
        regenerate(cfg, torch.device("cpu"))
    report = regenerate(replace(cfg, overwrite=True), torch.device("cpu"))
    assert (report.rows, report.resumed_parts) == (2, 0) and not parts.exists()
    assert [json.loads(line)["messages"][0] for line in out.read_text().splitlines()] == [c[0] for c in CHATS[1:]]


def test_a_target_too_small_to_capture_five_layers_still_regenerates(tmp_path, monkeypatch):
    """Regeneration captures no layer, so a target of few layers is not refused for the layers
    extraction would capture (a 6-layer target cannot give 5 distinct ones): it gets to loading."""
    import shutil

    from dflash_cache.target.tiny import TINY_DIR

    model = tmp_path / "six-layers"
    shutil.copytree(TINY_DIR, model)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 6
    config.pop("layer_types", None)
    (model / "config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "chat.jsonl", CHATS[1:])
    cfg = RegenerateConfig(model=str(model), data=str(data), out=str(tmp_path / "out.jsonl"), max_new_tokens=3)
    monkeypatch.setattr(regenerate_module, "load_target", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("loads")))
    with pytest.raises(RuntimeError, match="loads"):
        regenerate(cfg, torch.device("cpu"))


def test_a_second_run_on_the_same_out_is_refused_while_the_first_runs(tmp_path, monkeypatch):
    """Two runs of one job at once would interleave their writes to OUT and its parts: while one is
    generating, the same command is refused in one line naming that run (its pid) and what to do,
    before the target loads and without touching a file; the first then finishes as if alone and
    leaves no lock file behind."""
    import os
    import threading

    data = write_jsonl(tmp_path / "chat.jsonl", CHATS[1:])
    out = tmp_path / "regen.jsonl"
    cfg = RegenerateConfig(model="tiny", data=str(data), out=str(out), max_new_tokens=3, dtype="float32",
                           progress=False)
    alone = tmp_path / "alone" / "regen.jsonl"
    regenerate(replace(cfg, out=str(alone)), torch.device("cpu"))
    generating, go_on = threading.Event(), threading.Event()
    real = regenerate_module.greedy_complete

    def paused(*args, **kwargs):  # the first run waits in its first generation; any other run goes on
        if threading.current_thread().name == "first run":
            generating.set()
            assert go_on.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(regenerate_module, "greedy_complete", paused)
    results: list = []
    first = threading.Thread(target=lambda: results.append(regenerate(cfg, torch.device("cpu"))), name="first run")
    first.start()
    try:
        assert generating.wait(60), "the first run never started generating"
        files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        with monkeypatch.context() as m:
            forbid_loading_the_target(m)
            r = CliRunner().invoke(cli, cli_args(cfg))
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files
    finally:
        go_on.set()
        first.join(60)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    line = r.output.strip()
    assert "\n" not in line and str(out) in line and f"pid {os.getpid()}" in line, line
    assert "wait for it to finish or choose another --out" in line, line
    assert len(results) == 1 and results[0].rows == 2
    assert out.read_text() == alone.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "chat.jsonl", "regen.jsonl", "regen.jsonl.done"]


def test_a_run_killed_in_its_final_join_is_finished_by_the_next(tmp_path, monkeypatch):
    """Killed (SIGKILL: no clean-up runs) after joining the parts and before renaming the result over
    OUT: its temporary copy of OUT and its lock file stay. The same command again is not blocked by
    the dead run's lock, needs no target, removes the dead run's temporaries before it joins (one
    may be as large as OUT) and writes what an uninterrupted run writes; nothing else is left."""
    import dataclasses
    import signal
    import subprocess
    import sys

    data = write_jsonl(tmp_path / "chat.jsonl", CHATS[1:])
    out = tmp_path / "regen.jsonl"
    cfg = RegenerateConfig(model="tiny", data=str(data), out=str(out), max_new_tokens=3, part_rows=1,
                           dtype="float32", progress=False)
    straight = tmp_path / "straight" / "regen.jsonl"
    regenerate(replace(cfg, out=str(straight)), torch.device("cpu"))
    killed_in_the_join = (
        "import json, os, signal, sys\n"
        "from pathlib import Path\n"
        "import torch\n"
        "from dflash_cache.extract.regenerate import RegenerateConfig, regenerate\n"
        "cfg = RegenerateConfig(**json.loads(sys.argv[1]))\n"
        "rename = os.replace\n"
        "def replace(src, dst):\n"
        "    if Path(dst) == Path(cfg.out):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    rename(src, dst)\n"
        "os.replace = replace\n"
        "regenerate(cfg, torch.device('cpu'))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", killed_in_the_join, json.dumps(dataclasses.asdict(cfg))],
                            stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stderr
    assert not out.exists() and len(list(tmp_path.rglob(f"*.{proc.pid}.tmp"))) == 1
    assert (tmp_path / "regen.jsonl.lock").read_text() == f"pid {proc.pid}", "the killed run held OUT's lock"
    forbid_loading_the_target(monkeypatch)
    join, at_join = regenerate_module._join, []
    monkeypatch.setattr(regenerate_module, "_join",
                        lambda *a: at_join.append(sorted(p.name for p in tmp_path.rglob("*.tmp"))) or join(*a))
    report = regenerate(cfg, torch.device("cpu"))
    assert at_join == [[]], "the dead run's temporaries were still there when the join began"
    assert (report.rows, report.resumed_parts) == (2, 2)
    assert out.read_text() == straight.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "regen.jsonl", "regen.jsonl.done", "straight"]
