"""`dflash-cache regenerate`: a chat dataset whose assistant turns are the target's own greedy replies.

A drafter learns to predict what the target will say; trained on the target's own outputs it
accepts more than on human or other-model replies, which is why DFlash recipes regenerate the data
first. Each conversation's assistant turns are replaced in order: turn k is generated from the
conversation up to it as the chat template renders it with the generation prompt, the earlier
assistant turns already regenerated. System and user turns stay as they are. Rows are batched (left
padding), one assistant turn of each row per round.

It is a separate step, not a flag of `extract`, because generation needs the whole target while
extraction runs it cut after the last captured layer; and its output is an ordinary chat dataset
(JSONL of `messages` rows) that `extract`, `train --live` and `eval` read like any other.

Work is kept in parts: every `--part-rows` input rows become one file in `OUT.parts/`, written
atomically, beside `params.json` (the data's, the target's and the settings' identities). A stopped
run, started again with the same command, skips the finished parts; parts of other data, target or
settings are refused, naming what differs (`--overwrite` deletes them). When every part is there
they are joined into OUT (written in `OUT.parts/`, then renamed: the file appears only when
complete), then `OUT.done` records what OUT is (those identities and its size) and the parts are
removed. That record is how a rerun tells a finished job (nothing to do) from an OUT it must not
replace (another job's, or one it did not write): that is refused unless `--overwrite`, before the
target loads and before anything is written.

A run holds `OUT.lock` (an flock, as extract holds a cache's) from start to end, so two runs never
write one OUT or its parts at once; the second is refused naming the first. Every temporary file is
made in `OUT.parts/`, which only the lock's holder writes: a run killed mid-write leaves its
temporaries there, and the next run removes them before it joins (a full-size OUT among them).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflash_cache.data.chat import (
    MESSAGES,
    TEMPLATE_ERRORS,
    ChatEncoder,
    ChatSpec,
    Dropped,
    clean_messages,
)
from dflash_cache.data.dataset import hash_source_files
from dflash_cache.data.formats import open_source
from dflash_cache.errors import UserError
from dflash_cache.extract.regenerate_config import RegenerateConfig
from dflash_cache.files import (
    fsync_path,
    read_json,
    remove_tmp_files,
    tmp_path_for,
    write_bytes_atomic,
    write_json_atomic,
)
from dflash_cache.store.layout import LOCK_FILE
from dflash_cache.store.lock import CacheLock
from dflash_cache.target.generation import cut_at_stop, greedy_complete
from dflash_cache.target.model import TargetDescription, identify_target, load_target
from dflash_cache.target.spec import TargetSpec

log = logging.getLogger(__name__)


@dataclass
class RegenerateReport:
    rows: int = 0           # conversations written
    dropped: int = 0        # rows without a usable conversation (not written; this run's parts)
    turns: int = 0          # assistant turns regenerated
    cut: int = 0            # turns that reached --max-new-tokens without ending
    tokens: int = 0         # tokens generated
    seconds: float = 0.0
    resumed_parts: int = 0  # parts a previous run had finished
    complete: bool = False  # --out already was this job's finished output: nothing was done


PARAMS_FILE = "params.json"
PROGRESS_FIRST_S, PROGRESS_EVERY_S = 5.0, 30.0  # the first progress line, then one every so often
_PARTS_ONLY = ("part_rows",)  # settings that change how the work is cut into parts, not the output


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def record_path(out: Path) -> Path:
    """OUT's completion record (not `.json`: a directory of JSONL data may hold it and be read as data)."""
    return out.with_name(out.name + ".done")


def part_path(parts: Path, start: int, stop: int) -> Path:
    return parts / f"part-{start:012d}-{stop:012d}.jsonl"


def out_lock(out: Path) -> CacheLock:
    """The lock a run holds on OUT and its parts: `OUT.lock`, gone when the run ends."""
    return CacheLock(out.parent, name=out.name + LOCK_FILE, what="--out", guards=out, keep=False)


def regenerate(cfg: RegenerateConfig, device: torch.device,
               echo: Callable[[str], None] = log.info) -> RegenerateReport:
    """The whole job, under OUT's lock; `echo` shows its result line (logged by default; the CLI
    passes click.echo)."""
    out = Path(cfg.out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give the JSONL file to write")
    with out_lock(out):
        return _regenerate(cfg, out, device, echo)


def _regenerate(cfg: RegenerateConfig, out: Path, device: torch.device,
                echo: Callable[[str], None]) -> RegenerateReport:
    source = open_source(Path(cfg.data))
    if MESSAGES not in source.columns:
        raise UserError(f"--data {cfg.data} has no {MESSAGES!r} column, so there is no conversation to regenerate")
    encoder = ChatSpec(cfg.model, cfg.chat_template, cfg.trust_remote_code).load()
    spec = TargetSpec(model=cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    config, identity = identify_target(spec)  # generation captures no layer: none is chosen (a small target passes)
    desc = TargetDescription(spec=spec, config=config, identity=identity, layer_ids=[])
    params = _params(cfg, source, encoder, desc)
    parts = parts_dir(out)
    finished = _finished(out, params, cfg.overwrite)
    if finished is not None:
        if parts.is_dir() and _parts_problem(parts, params) is None:
            shutil.rmtree(parts)  # this job's, left by a run stopped right after recording OUT
        echo(f"{out} is already complete ({finished['rows']} conversations of this data, target and settings); "
             "nothing to do")
        return RegenerateReport(rows=finished["rows"], complete=True)
    rows = source.num_rows if cfg.limit is None else min(cfg.limit, source.num_rows)
    ranges = [(a, min(rows, a + cfg.part_rows)) for a in range(0, rows, cfg.part_rows)]
    resuming = _open_parts(parts, params, cfg.overwrite)  # the first write of the job
    if leftovers := remove_tmp_files(parts):  # the lock is ours: no live run is writing them
        log.info("removed %d temporary file(s) of a stopped run from %s", len(leftovers), parts)
    todo = [(a, b) for a, b in ranges if not (resuming and part_path(parts, a, b).is_file())]
    report, t0 = RegenerateReport(resumed_parts=len(ranges) - len(todo)), time.perf_counter()
    rate = ""
    if todo:
        log.info("regenerating %d of %d rows (%d of %d parts done by an earlier run); loading the target %s",
                 sum(b - a for a, b in todo), rows, report.resumed_parts, len(ranges), cfg.model)
        model = load_target(desc, device, keep=desc.identity.num_hidden_layers)
        log.info("target loaded in %.0fs", time.perf_counter() - t0)
        stops = stop_ids(encoder, model)
        pad = encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else stops[0]
        progress = Progress(rows, done=rows - sum(b - a for a, b in todo), enabled=cfg.progress)
        with progress, progress.counting_steps(model, pad):
            for a, b in todo:
                write_bytes_atomic(part_path(parts, a, b),
                                   _generate_part(model, encoder, source, a, b, cfg, pad, stops, report, progress))
        rate = f"{report.tokens / max(time.perf_counter() - progress.t0, 1e-9):,.0f} tok/s, "
    report.rows = _join(out, [part_path(parts, a, b) for a, b in ranges])
    record = parts / record_path(out).name  # written among the parts, then renamed beside OUT
    write_json_atomic(record, {"params": _output_params(params), "rows": report.rows, "bytes": out.stat().st_size})
    os.replace(record, record_path(out))
    fsync_path(out.parent)
    shutil.rmtree(parts)
    report.seconds = time.perf_counter() - t0
    echo(f"wrote {out}: {report.rows} conversations; this run regenerated {report.turns} assistant turns "
         f"({report.tokens} tokens, {rate}{report.cut} cut at "
         f"--max-new-tokens) and dropped {report.dropped} rows; {report.resumed_parts} of {len(ranges)} parts "
         "were done by an earlier run")
    return report


def _generate_part(model: torch.nn.Module, encoder: ChatEncoder, source, a: int, b: int, cfg: RegenerateConfig,
                   pad: int, stops: list[int], report: RegenerateReport, progress: Progress) -> bytes:
    """Input rows [a, b) regenerated, as the JSONL lines of their usable conversations."""
    lines = []
    for _, batch, _ in source.batches(a, b, [MESSAGES]):
        conversations = batch.column(0).to_pylist()
        for k in range(0, len(conversations), cfg.batch_size):
            part = conversations[k:k + cfg.batch_size]
            for conv in regenerate_batch(model, encoder, part, cfg.max_new_tokens, pad, stops, report):
                if conv is None:
                    report.dropped += 1
                else:
                    lines.append(json.dumps({MESSAGES: conv}, ensure_ascii=False) + "\n")
            progress.tick(rows=len(part))
    return "".join(lines).encode()


def _params(cfg: RegenerateConfig, source, encoder: ChatEncoder, desc) -> dict[str, Any]:
    """What makes the output what it is (the data's, the template's and the target's identities and
    the settings that change it), plus how the work is cut into parts; as JSON reads it back."""
    h = hashlib.sha256()
    hash_source_files(h, source)
    params = {"data": h.hexdigest(), "chat template": encoder.identity, "target": asdict(desc.identity),
              **{k: v for k, v in asdict(cfg).items() if k in ("max_new_tokens", "limit", "dtype", "part_rows")}}
    return json.loads(json.dumps(params))


def _output_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k not in _PARTS_ONLY}


def _difference(old: Any, new: dict[str, Any]) -> str | None:
    """The first of `new`'s keys whose value `old` (a record read back) does not hold; None if none."""
    if not isinstance(old, dict):
        return next(iter(new))
    return next((key for key in new if old.get(key) != new[key]), None)


def _finished(out: Path, params: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """OUT's completion record if OUT is this job's finished output; None if there is no OUT or it
    may be replaced: with `--overwrite`, or when this job's own parts are beside it (an earlier run
    of this job, allowed to write OUT, stopped before recording it). Any other OUT is refused."""
    if not out.exists():
        return None
    path = record_path(out)
    try:
        record = read_json(path)
    except FileNotFoundError:
        record, why = None, "and no completion record says which job wrote it"
    except (OSError, ValueError) as e:
        record, why = None, f"and its completion record {path} is unreadable ({e})"
    if isinstance(record, dict):
        key = _difference(record.get("params"), _output_params(params))
        if key is None and record.get("bytes") == out.stat().st_size and isinstance(record.get("rows"), int):
            return record
        why = (f"and was regenerated with another {key}" if key is not None else
               f"and was changed after it was written (its size is not the one {path} records)")
    elif record is not None:
        why = f"and its completion record {path} is not one"
    if not overwrite and _parts_problem(parts_dir(out), params) is not None:
        raise UserError(f"--out {out} already exists {why}; pass --overwrite to replace it")
    return None


def _parts_problem(parts: Path, params: dict[str, Any]) -> str | None:
    """Why `parts` does not hold this job's saved work; None if it does."""
    path = parts / PARAMS_FILE
    if not path.is_file():
        return f"{parts} holds no saved work"
    try:
        key = _difference(read_json(path), params)
    except (OSError, ValueError) as e:
        return f"{path} is unreadable ({e})"
    return None if key is None else f"{parts} holds the parts of a run with another {key}"


def _open_parts(parts: Path, params: dict[str, Any], overwrite: bool) -> bool:
    """Whether `parts` holds finished parts of this very job (else it is made anew with this job's
    params); another job's are refused, naming the first difference, or deleted with `--overwrite`."""
    problem = _parts_problem(parts, params)
    if problem is None:
        return True
    if (parts / PARAMS_FILE).is_file():
        if not overwrite:
            raise UserError(f"{problem}; finish that run with its own command, or pass --overwrite to delete "
                            f"{parts} and start this one")
        log.warning("--overwrite: deleting %s (%s)", parts, problem)
        shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    write_json_atomic(parts / PARAMS_FILE, params)
    return False


def _join(out: Path, paths: list[Path]) -> int:
    """Concatenate the parts into `out` atomically (written among them, then renamed); returns the
    number of conversations. Its old completion record goes first, so that no moment has a record
    that does not describe OUT."""
    tmp = tmp_path_for(parts_dir(out) / out.name)
    count = 0
    try:
        with open(tmp, "wb") as f:
            for path in paths:
                data = path.read_bytes()
                count += data.count(b"\n")
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        record_path(out).unlink(missing_ok=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(out.parent)
    return count


class _LogLines(io.TextIOBase):
    """A file for tqdm that logs each line it draws: the progress goes wherever the log goes (a
    terminal, or the file a long job's output is kept in) instead of redrawing one line."""

    def write(self, s: str) -> int:
        if text := s.strip():
            log.info("%s", text)
        return len(s)


class Progress:
    """tqdm's meter of rows (done/total, elapsed<ETA, rows/s) plus tokens/s, logged PROGRESS_FIRST_S
    after generation starts and every PROGRESS_EVERY_S after. Ticked at every decode step, so one
    long batch (many turns of up to --max-new-tokens) still reports within seconds."""

    def __init__(self, total: int, *, done: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = tqdm(total=total, initial=done, unit="row", smoothing=0, mininterval=math.inf,
                        delay=math.inf, leave=False, file=_LogLines(), disable=not enabled,
                        bar_format="regenerate: {n_fmt}/{total_fmt} rows ({percentage:.0f}%) "
                                   "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
        self.tokens, self.t0 = 0, time.perf_counter()
        self.next = self.t0 + PROGRESS_FIRST_S

    def tick(self, *, rows: int = 0, tokens: int = 0) -> None:
        self.bar.update(rows)
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and now >= self.next:
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.t0, 1e-9):,.0f} tok/s", refresh=False)
            self.bar.refresh()
            self.next = now + PROGRESS_EVERY_S

    @contextmanager
    def counting_steps(self, model: torch.nn.Module, pad_id: int) -> Iterator[None]:
        """Tick at every decode step of `model`, with the tokens it feeds back (those of the rows still
        generating: a finished row is fed `pad_id`; about the tokens generated, for the rate)."""
        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1:
                self.tick(tokens=int((ids != pad_id).sum()))

        handle = model.register_forward_pre_hook(hook, with_kwargs=True) if self.enabled else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def stop_ids(encoder: ChatEncoder, model: torch.nn.Module) -> list[int]:
    """Tokens that end an assistant turn: the tokenizer's end of text and the model's generation
    config's end tokens (a chat model lists its end-of-turn token there, e.g. <|im_end|>)."""
    ids = {encoder.tokenizer.eos_token_id}
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, list) else {eos}
    ids.discard(None)
    if not ids:
        raise UserError("the target's tokenizer and generation config name no end-of-text token, so a regenerated "
                        "turn could not end; give the tokenizer an eos_token")
    return sorted(ids)


def regenerate_batch(model: torch.nn.Module, encoder: ChatEncoder, conversations: list, max_new_tokens: int,
                     pad_id: int, stops: list[int], report: RegenerateReport) -> list[list[dict] | None]:
    """The conversations with their assistant turns regenerated (None for an unusable row)."""
    convs: list[list[dict] | None] = []
    for raw in conversations:
        try:
            convs.append(clean_messages(raw))
        except Dropped:
            convs.append(None)
    turns = [[i for i, m in enumerate(c) if m["role"] == "assistant"] if c else [] for c in convs]
    for k in range(max((len(t) for t in turns), default=0)):
        todo, prompts = [], []
        for r, t in enumerate(turns):
            conv = convs[r]
            if len(t) <= k or conv is None:
                continue
            try:
                text = encoder.render(conv[:t[k]], generation_prompt=True)
            except TEMPLATE_ERRORS as exc:  # the row is dropped, as extract drops it
                log.debug("row dropped: the chat template failed: %s", exc)
                convs[r] = None
                continue
            todo.append((r, t[k]))
            prompts.append(encoder.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not todo:
            continue
        completions = greedy_complete(model, prompts, max_new_tokens, pad_id=pad_id, stop_ids=stops)
        for (r, i), completion in zip(todo, completions, strict=True):
            reply = cut_at_stop(completion, stops, keep_stop=False)
            report.turns += 1
            report.tokens += len(reply)
            report.cut += len(reply) == len(completion) == max_new_tokens
            convs[r][i] = {**convs[r][i], "content": encoder.tokenizer.decode(reply, skip_special_tokens=True)}
    return convs
