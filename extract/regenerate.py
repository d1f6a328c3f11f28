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
run, started again with the same command, skips the finished parts; other data, target or
settings are refused, naming what differs. When every part is there they are joined into OUT
(written beside it, then renamed: the file appears only when complete) and the parts removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_cache.errors import UserError
from dflash_cache.extract.chat import (
    MESSAGES,
    TEMPLATE_ERRORS,
    ChatEncoder,
    ChatSpec,
    Dropped,
    clean_messages,
)
from dflash_cache.extract.dataset import hash_source_files
from dflash_cache.extract.dataset_formats import open_source
from dflash_cache.extract.generation import cut_at_stop, greedy_complete
from dflash_cache.extract.target import DTYPES, TargetSpec, describe_target, load_target
from dflash_cache.files import TMP_SUFFIX, read_json, write_bytes_atomic, write_json_atomic
from dflash_cache.options import check_options, option

log = logging.getLogger(__name__)


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
    dtype: str = option("bfloat16", choices=tuple(DTYPES), help="Target compute dtype.")
    trust_remote_code: bool = option(False, help="Allow the model directory's own Python code.")
    progress: bool = option(True, help="Hide the progress bar.")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass
class RegenerateReport:
    rows: int = 0           # conversations written
    dropped: int = 0        # rows without a usable conversation (not written; this run's parts)
    turns: int = 0          # assistant turns regenerated
    cut: int = 0            # turns that reached --max-new-tokens without ending
    tokens: int = 0         # tokens generated
    seconds: float = 0.0
    resumed_parts: int = 0  # parts a previous run had finished


PARAMS_FILE = "params.json"


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def part_path(parts: Path, start: int, stop: int) -> Path:
    return parts / f"part-{start:012d}-{stop:012d}.jsonl"


def regenerate(cfg: RegenerateConfig, device: torch.device) -> RegenerateReport:
    out = Path(cfg.out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give the JSONL file to write")
    source = open_source(Path(cfg.data))
    if MESSAGES not in source.columns:
        raise UserError(f"--data {cfg.data} has no {MESSAGES!r} column, so there is no conversation to regenerate")
    encoder = ChatSpec(cfg.model, cfg.chat_template, cfg.trust_remote_code).load()
    desc = describe_target(TargetSpec(model=cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code))
    rows = source.num_rows if cfg.limit is None else min(cfg.limit, source.num_rows)
    parts = parts_dir(out)
    ranges = [(a, min(rows, a + cfg.part_rows)) for a in range(0, rows, cfg.part_rows)]
    todo = [(a, b) for a, b in ranges if not part_path(parts, a, b).is_file()] if _resume(parts, cfg, source,
                                                                                       encoder, desc) else ranges
    report, t0 = RegenerateReport(resumed_parts=len(ranges) - len(todo)), time.perf_counter()
    if todo:
        model = load_target(desc, device, keep=desc.identity.num_hidden_layers)
        stops = stop_ids(encoder, model)
        pad = encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else stops[0]
        bar = tqdm(total=sum(b - a for a, b in todo), unit="conv", dynamic_ncols=True, disable=not cfg.progress)
        try:
            for a, b in todo:
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
                        bar.update(len(part))
                        bar.set_postfix(tok_s=f"{report.tokens / max(time.perf_counter() - t0, 1e-9):,.0f}")
                write_bytes_atomic(part_path(parts, a, b), "".join(lines).encode())
        finally:
            bar.close()
    report.rows = _join(out, [part_path(parts, a, b) for a, b in ranges])
    shutil.rmtree(parts)
    report.seconds = time.perf_counter() - t0
    log.info("regenerated %d assistant turns (%d tokens, %.0f tok/s; %d parts were done before); %d rows dropped, "
             "%d turns cut at --max-new-tokens; wrote %d conversations to %s", report.turns, report.tokens,
             report.tokens / max(report.seconds, 1e-9), report.resumed_parts, report.dropped, report.cut,
             report.rows, out)
    return report


def _resume(parts: Path, cfg: RegenerateConfig, source, encoder: ChatEncoder, desc) -> bool:
    """Whether `parts` holds finished parts of this very job (else it is created with this job's
    params); refuses one made with other data, target or settings, naming the first difference."""
    h = hashlib.sha256()
    hash_source_files(h, source)
    params = {"data": h.hexdigest(), "chat template": encoder.identity, "target": asdict(desc.identity),
              **{k: v for k, v in asdict(cfg).items() if k in ("max_new_tokens", "limit", "dtype", "part_rows")}}
    params = json.loads(json.dumps(params))
    if (parts / PARAMS_FILE).is_file():
        try:
            old = read_json(parts / PARAMS_FILE)
        except (OSError, ValueError) as e:
            raise UserError(f"{parts / PARAMS_FILE} is unreadable ({e}); delete {parts} to start over") from None
        for key in params:
            if old.get(key) != params[key]:
                raise UserError(f"{parts} holds the parts of a run with another {key}; run that command again to "
                                f"finish it, or delete {parts} to start over")
        return True
    parts.mkdir(parents=True, exist_ok=True)
    write_json_atomic(parts / PARAMS_FILE, params)
    return False


def _join(out: Path, paths: list[Path]) -> int:
    """Concatenate the parts into `out` atomically; returns the number of conversations."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}{TMP_SUFFIX}")
    count = 0
    try:
        with open(tmp, "wb") as f:
            for path in paths:
                data = path.read_bytes()
                count += data.count(b"\n")
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return count


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
            if len(t) <= k or convs[r] is None:
                continue
            try:
                text = encoder.render(convs[r][:t[k]], generation_prompt=True)
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
