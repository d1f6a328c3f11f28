"""Pretrain the built-in `tiny` target on the Python standard library's own source code.

A drafter can only be judged against a target that predicts something: a random-weight target
makes chaotic text no drafter can learn, and hand-tuned random weights make text no real model
would. The standard library's `.py` files ship with every Python, so a small real language model
can be trained on them anywhere, with no download, and the result (weights, tokenizer, held-out
demo prompts) is committed as `dflash_cache/target/tiny_target/`.

    python -m tools.tiny_pretrain --out dflash_cache/target/tiny_target --tokenizer dflash_cache/target/tiny_target/tokenizer.json

Steps: collect the corpus and split it into train / held-out by a hash of each file's path
(stable across Python versions: a file keeps its side as long as it keeps its path); train a
byte-level BPE tokenizer of `tiny_config().vocab_size` ids (or reuse one); tokenize; train
`Qwen3ForCausalLM(tiny_config())` on random windows with AdamW and a warmup + cosine schedule;
save bf16 weights, the HF config, a report, and demo prompts cut from held-out files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash_cache.data.demo import REBUILD as REBUILD_DEMO
from dflash_cache.devices import resolve_device
from dflash_cache.files import write_bytes_atomic, write_json_atomic
from dflash_cache.logs import setup_logging
from dflash_cache.target.tiny import (
    TINY_CONFIG_FILE,
    TINY_DIR,
    TINY_EOT,
    TINY_MASK,
    TINY_PROMPTS_FILE,
    TINY_REPORT_FILE,
    TINY_TOKENIZER_FILE,
    TINY_WEIGHTS_FILE,
    load_tiny_tokenizer,
    tiny_config,
)
from dflash_cache.train.optim import adamw, clipped_step, warmup_cosine

log = logging.getLogger(__name__)

# Directories under the stdlib that are not the standard library (installed packages).
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass
class PretrainConfig:
    """Everything that decides the result. The defaults made the committed model: 1800 steps of
    256 x 512 tokens (236M tokens, ~23 passes over a 10M-token corpus) in 92 s of training on one
    NVIDIA H200 (2026-11-29); held-out loss had flattened by step 1000."""

    out: Path = TINY_DIR
    source: Path | None = None  # None: the running Python's stdlib
    tokenizer: Path | None = None  # an existing tokenizer.json to reuse instead of training one
    heldout_percent: float = 3.0
    seq_len: int = 512
    batch_size: int = 256
    steps: int = 1800
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    device: str = "auto"
    seed: int = 0
    log_every: int = 50
    eval_every: int = 500  # 0: only at the end
    eval_tokens: int = 1 << 19  # held-out tokens scored per evaluation (the held-out set is ~300k)
    num_prompts: int = 128
    prompt_tokens: tuple[int, int] = (16, 96)
    compile: str = "auto"  # auto: on CUDA only (about 2x fewer kernels); falls back to eager on failure


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the source root, '/'-separated: what the split hashes
    text: str


@dataclass
class Corpus:
    root: Path
    train: list[SourceFile] = field(default_factory=list)
    heldout: list[SourceFile] = field(default_factory=list)


# ----------------------------------------------------------------------------------------- corpus


def default_source() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str, percent: float) -> bool:
    """A file's side depends on its relative path alone, not on which other files exist."""
    bucket = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % 10_000
    return bucket < percent * 100


def read_sources(root: Path) -> list[SourceFile]:
    """Every UTF-8 `.py` file under `root` (sorted; installed packages and undecodable files skipped)."""
    files = []
    skipped = 0
    for path in sorted(root.rglob("*.py")):
        rel_parts = path.relative_to(root).parts
        if SKIP_DIRS.intersection(rel_parts) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")  # universal newlines: '\r\n' becomes '\n'
        except (UnicodeDecodeError, OSError):
            skipped += 1  # a few test files are deliberately latin-1 or broken
            continue
        if text.strip():
            files.append(SourceFile("/".join(rel_parts), text))
    log.info("read %d .py files under %s (%d undecodable skipped)", len(files), root, skipped)
    return files


def split_corpus(root: Path, files: list[SourceFile], heldout_percent: float) -> Corpus:
    """Hash split; a tiny corpus that lands on one side gives its lowest-hash file to the other."""
    if len(files) < 2:
        raise ValueError(f"{root}: need at least 2 non-empty .py files, found {len(files)}; "
                         "pass --source DIR with Python sources")
    corpus = Corpus(root)
    for f in files:
        (corpus.heldout if is_heldout(f.rel, heldout_percent) else corpus.train).append(f)
    if not corpus.heldout or not corpus.train:
        full = corpus.train or corpus.heldout
        moved = min(full, key=lambda f: hashlib.sha256(f.rel.encode()).digest())
        full.remove(moved)
        (corpus.heldout if not corpus.heldout else corpus.train).append(moved)
    log.info("corpus: %d train files (%.1f MB), %d held-out files (%.1f MB)",
             len(corpus.train), sum(len(f.text) for f in corpus.train) / 1e6,
             len(corpus.heldout), sum(len(f.text) for f in corpus.heldout) / 1e6)
    return corpus


# -------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE: id 0 is the end-of-text token, ids 1..256 the bytes, then merges up to
    vocab_size - 2, and vocab_size - 1 the `<|mask|>` token the drafter predicts from (added after
    training so it is never a merge, and never produced from text by `load_tiny_tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=[TINY_EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size - 1:
        raise ValueError(f"the corpus gave only {tok.get_vocab_size()} BPE ids, {vocab_size - 1} needed; "
                         "use a larger --source or pass --tokenizer")
    tok.add_special_tokens([TINY_MASK])
    log.info("trained a %d-id byte-level BPE tokenizer in %.1fs", tok.get_vocab_size(), time.perf_counter() - t0)
    return tok


def check_tokenizer(tok, vocab_size: int) -> None:
    """The ids the rest of the code relies on: 0 = end of text, vocab-1 = mask, vocab ids in all."""
    got = (tok.get_vocab_size(), tok.token_to_id(TINY_EOT), tok.token_to_id(TINY_MASK))
    want = (vocab_size, 0, vocab_size - 1)
    if got != want:
        raise ValueError(f"tokenizer has (size, {TINY_EOT} id, {TINY_MASK} id) = {got}, expected {want}")


def encode_corpus(tok, files: list[SourceFile]) -> np.ndarray:
    """One int32 stream: end-of-text, then each document followed by end-of-text."""
    eot = tok.token_to_id(TINY_EOT)
    t0 = time.perf_counter()
    parts = [np.array([eot], dtype=np.int32)]
    for enc in tok.encode_batch([f.text for f in files], add_special_tokens=False):
        parts.append(np.asarray(enc.ids + [eot], dtype=np.int32))
    stream = np.concatenate(parts)
    if int(stream.max()) >= tok.get_vocab_size() - 1:
        raise ValueError("the mask id appeared in encoded text; the tokenizer must split special tokens")
    log.info("encoded %d files into %d tokens (%.2f chars/token) in %.1fs", len(files), len(stream),
             sum(len(f.text) for f in files) / max(1, len(stream)), time.perf_counter() - t0)
    return stream


# ------------------------------------------------------------------------------------------ model


def build_model(seed: int) -> nn.Module:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = tiny_config()
    config.use_cache = False
    return Qwen3ForCausalLM(config)


def make_optimizer(model: nn.Module, cfg: PretrainConfig, device: torch.device) -> torch.optim.Optimizer:
    return adamw(model, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warmup, then cosine from lr down to lr * min_lr_ratio at the last step."""
    return cfg.lr * warmup_cosine(step, cfg.steps, cfg.warmup_steps, floor=cfg.min_lr_ratio)


def use_compile(mode: str, device: torch.device) -> bool:
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--compile {mode!r}: choose auto, on or off")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def autocast(device: torch.device):
    """bf16 on CUDA (the weights stay fp32 for the optimizer); plain fp32 on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def lm_loss(model: nn.Module, window: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over [B, L+1] windows (no padding: SDPA's causal path)."""
    logits = model(input_ids=window[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten().long())


def sample_windows(tokens: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] windows at random offsets, gathered on the tokens' device (no host sync)."""
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch, 1), device=tokens.device, generator=gen)
    return tokens[starts + torch.arange(seq_len + 1, device=tokens.device)]


@torch.no_grad()
def evaluate(model: nn.Module, tokens: torch.Tensor, cfg: PretrainConfig, device: torch.device) -> float:
    """Mean loss over consecutive non-overlapping windows of up to `eval_tokens` tokens: the same
    windows every time, so evaluations along a run and across runs compare."""
    seq = min(cfg.seq_len, tokens.numel() - 1)
    n_windows = max(1, min(cfg.eval_tokens, tokens.numel() - 1) // seq)
    windows = torch.stack([tokens[i * seq : i * seq + seq + 1] for i in range(n_windows)])
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, n_windows, cfg.batch_size):
        batch = windows[start : start + cfg.batch_size]
        with autocast(device):
            total += float(lm_loss(model, batch)) * batch.shape[0]
    model.train(was_training)
    return total / n_windows


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    train_loss: float  # mean of the last logging interval
    heldout_loss: float
    train_eval_loss: float  # the held-out procedure on the start of the train stream: overfitting shows
    wall_s: float
    compiled: bool


class Pretrainer:
    """The training loop; `step_model` is the compiled model when compilation works, else the model."""

    def __init__(self, cfg: PretrainConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray,
                 device: torch.device) -> None:
        if len(train_tokens) <= cfg.seq_len + 1:
            raise ValueError(f"only {len(train_tokens)} train tokens for --seq-len {cfg.seq_len}")
        self.cfg = cfg
        self.device = device
        self.model = build_model(cfg.seed).to(device).train()
        # (torch types compile's result as the callable it was given; for a module it is a module)
        self.step_model: nn.Module = cast(nn.Module, torch.compile(self.model)) if use_compile(cfg.compile, device) \
            else self.model
        self.opt = make_optimizer(self.model, cfg, device)
        self.train_tokens = torch.from_numpy(train_tokens).to(device)
        self.heldout_tokens = torch.from_numpy(heldout_tokens).to(device)
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(cfg.seed)

    def _step(self, window: torch.Tensor) -> torch.Tensor:
        with autocast(self.device):
            loss = lm_loss(self.step_model, window)
        loss.backward()
        return loss.detach()

    def step(self, step: int) -> torch.Tensor:
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, self.cfg)
        window = sample_windows(self.train_tokens, self.cfg.batch_size, self.cfg.seq_len, self.gen)
        try:
            loss = self._step(window)
        except Exception as e:  # torch.compile trouble shows at the first call: carry on eagerly
            if self.step_model is self.model or step > 0:
                raise
            log.warning("torch.compile failed (%s: %s); training eagerly", type(e).__name__, str(e)[:300])
            self.step_model = self.model
            self.opt.zero_grad(set_to_none=True)
            loss = self._step(window)
        clipped_step(self.opt, list(self.model.parameters()), self.cfg.grad_clip)
        self.opt.zero_grad(set_to_none=True)
        return loss

    def fit(self) -> TrainResult:
        cfg = self.cfg
        tokens_per_step = cfg.batch_size * cfg.seq_len
        log.info("training %.2fM parameters on %s: %d steps x %d tokens, lr %g",
                 sum(p.numel() for p in self.model.parameters()) / 1e6, self.device, cfg.steps,
                 tokens_per_step, cfg.lr)
        t0 = time.perf_counter()
        t_log, running, n_running, last_loss = t0, torch.zeros((), device=self.device), 0, float("nan")
        for step in range(cfg.steps):
            running += self.step(step)
            n_running += 1
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps:
                last_loss = float(running) / n_running  # the one host sync per interval
                now = time.perf_counter()
                rate = n_running * tokens_per_step / (now - t_log)
                eta = (now - t0) / done * (cfg.steps - done)
                log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  elapsed %.0fs  eta %.0fs", done, cfg.steps,
                         last_loss, lr_at(step, cfg), rate, now - t0, eta)
                t_log, running, n_running = now, torch.zeros((), device=self.device), 0
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                log.info("step %d: held-out loss %.4f", done, evaluate(self.model, self.heldout_tokens, cfg, self.device))
        wall = time.perf_counter() - t0
        heldout = evaluate(self.model, self.heldout_tokens, cfg, self.device)
        train_eval = evaluate(self.model, self.train_tokens, cfg, self.device)
        log.info("done in %.0fs: train loss %.4f, held-out loss %.4f (train windows %.4f; ln(vocab) = %.2f)",
                 wall, last_loss, heldout, train_eval, math.log(tiny_config().vocab_size))
        return TrainResult(steps=cfg.steps, tokens_seen=cfg.steps * tokens_per_step, train_loss=last_loss,
                           heldout_loss=heldout, train_eval_loss=train_eval, wall_s=wall,
                           compiled=self.step_model is not self.model)


# ---------------------------------------------------------------------------------- demo prompts


def line_starts(text: str) -> list[tuple[int, int]]:
    """(char offset, 1-based line number) of each line that is not blank."""
    starts, offset = [], 0
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            starts.append((offset, lineno))
        offset += len(line) + 1
    return starts


def cut_prompts(tok, files: list[SourceFile], count: int, lengths: tuple[int, int], seed: int) -> list[dict]:
    """`count` distinct prompts from held-out files: token ids of the text from a random non-blank
    line start, cut to a random length in `lengths` (inclusive). Text the target never trained on,
    so its completions are its own predictions, not recitation."""
    rng = random.Random(seed)
    candidates = [(i, off, lineno) for i, f in enumerate(files) for off, lineno in line_starts(f.text)]
    rng.shuffle(candidates)
    prompts: list[dict] = []
    seen: set[tuple[int, ...]] = set()
    lo, hi = lengths
    for i, off, lineno in candidates:
        if len(prompts) == count:
            break
        n = rng.randint(lo, hi)
        # 64 chars per token is far more than BPE ever packs, so the first n ids are unaffected
        # by where the slice ends.
        ids = tok.encode(files[i].text[off : off + 64 * hi], add_special_tokens=False).ids[:n]
        if len(ids) < n or tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        prompts.append({"file": files[i].rel, "line": lineno, "ids": ids})
    if len(prompts) < count:
        raise ValueError(f"the held-out files gave only {len(prompts)} of {count} prompts; lower --num-prompts")
    return prompts


# ------------------------------------------------------------------------------------------ saving


def save_weights(model: nn.Module, path: Path) -> None:
    """bf16 safetensors with HF's parameter names, so the directory also loads with from_pretrained."""
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    write_bytes_atomic(path, save(tensors, metadata={"format": "pt"}))


def save_config(path: Path) -> None:
    config = tiny_config()
    config.architectures = ["Qwen3ForCausalLM"]
    config.dtype = "bfloat16"
    config.eos_token_id = config.pad_token_id = 0
    config.bos_token_id = None
    write_bytes_atomic(path, config.to_json_string().encode())


def save_prompts(prompts: list[dict], path: Path, seed: int, lengths: tuple[int, int]) -> None:
    """One prompt per line: readable, and diffs of a regenerated file stay small."""
    head = json.dumps({"seed": seed, "lengths": list(lengths), "python": platform.python_version(),
                       "tokenizer": TINY_TOKENIZER_FILE})
    rows = ",\n".join("  " + json.dumps(p, separators=(",", ":")) for p in prompts)
    write_bytes_atomic(path, f'{head[:-1]}, "prompts": [\n{rows}\n]}}\n'.encode())


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install_tokenizer(cfg: PretrainConfig, corpus: Corpus, out: Path):
    """The tokenizer to use, saved as out/tokenizer.json (copied when reused from elsewhere)."""
    vocab = tiny_config().vocab_size
    dest = out / TINY_TOKENIZER_FILE
    if cfg.tokenizer is not None:
        shutil.copyfile(cfg.tokenizer, dest)
        log.info("reusing tokenizer %s", cfg.tokenizer)
    else:
        tok = train_tokenizer((f.text for f in corpus.train), vocab)
        write_bytes_atomic(dest, tok.to_str(pretty=True).encode())
    tok = load_tiny_tokenizer(dest)
    check_tokenizer(tok, vocab)
    return tok


OUTPUT_FILES = (TINY_TOKENIZER_FILE, TINY_WEIGHTS_FILE, TINY_CONFIG_FILE, TINY_PROMPTS_FILE, TINY_REPORT_FILE)


def pretrain(cfg: PretrainConfig) -> dict:
    """Run everything and write the five files into cfg.out; returns the report.

    The files are made in a staging directory inside cfg.out and moved into place only once all
    exist, so a failed or interrupted run never leaves a new tokenizer beside old weights."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".pretrain-", dir=out))
    try:
        report = _pretrain_into(cfg, stage)
        for name in OUTPUT_FILES:
            os.replace(stage / name, out / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info("wrote %s (weights %.1f MB); the shipped demo rows follow the weights: rebuild them with `%s`",
             out, (out / TINY_WEIGHTS_FILE).stat().st_size / 1e6, REBUILD_DEMO)
    return report


def _pretrain_into(cfg: PretrainConfig, stage: Path) -> dict:
    t0 = time.perf_counter()
    root = Path(cfg.source) if cfg.source is not None else default_source()
    corpus = split_corpus(root, read_sources(root), cfg.heldout_percent)
    tok = install_tokenizer(cfg, corpus, stage)
    train_tokens = encode_corpus(tok, corpus.train)
    heldout_tokens = encode_corpus(tok, corpus.heldout)
    prompts = cut_prompts(tok, corpus.heldout, cfg.num_prompts, cfg.prompt_tokens, cfg.seed)

    device = resolve_device(cfg.device)
    trainer = Pretrainer(cfg, train_tokens, heldout_tokens, device)
    result = trainer.fit()

    save_weights(trainer.model, stage / TINY_WEIGHTS_FILE)
    save_config(stage / TINY_CONFIG_FILE)
    save_prompts(prompts, stage / TINY_PROMPTS_FILE, cfg.seed, cfg.prompt_tokens)
    report = {
        "python": platform.python_version(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "source": str(root),
        "corpus": {"train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
                   "train_tokens": int(len(train_tokens)), "heldout_tokens": int(len(heldout_tokens))},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "result": asdict(result),
        "total_wall_s": time.perf_counter() - t0,
        "sha256": {name: sha256_file(stage / name) for name in (TINY_TOKENIZER_FILE, TINY_WEIGHTS_FILE)},
    }
    write_json_atomic(stage / TINY_REPORT_FILE, report)
    return report


def parse_args(argv: list[str] | None = None) -> PretrainConfig:
    d = PretrainConfig()
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=d.out, help="where the five files are written")
    ap.add_argument("--source", type=Path, default=None, help="directory of .py files (default: this Python's stdlib)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="reuse this tokenizer.json instead of training one")
    ap.add_argument("--heldout-percent", type=float, default=d.heldout_percent, help="files held out, by path hash")
    ap.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training window")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    ap.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup, then cosine")
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay, help="on matrices only")
    ap.add_argument("--device", default=d.device, help="auto: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=d.seed, help="init, windows and prompt choice")
    ap.add_argument("--log-every", type=int, default=d.log_every, help="steps between progress lines")
    ap.add_argument("--eval-every", type=int, default=d.eval_every, help="0: evaluate only at the end")
    ap.add_argument("--eval-tokens", type=int, default=d.eval_tokens, help="tokens scored per evaluation")
    ap.add_argument("--num-prompts", type=int, default=d.num_prompts, help="demo prompts cut from held-out files")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default=d.compile,
                    help="torch.compile the training forward (auto: on CUDA); falls back to eager if it fails")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    return PretrainConfig(
        out=a.out, source=a.source, tokenizer=a.tokenizer, heldout_percent=a.heldout_percent, seq_len=a.seq_len,
        batch_size=a.batch_size, steps=a.steps, lr=a.lr, warmup_steps=min(a.warmup_steps, a.steps),
        weight_decay=a.weight_decay, device=a.device, seed=a.seed, log_every=a.log_every, eval_every=a.eval_every,
        eval_tokens=a.eval_tokens, num_prompts=a.num_prompts, compile=a.compile,
    )


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    cfg = parse_args(argv)
    try:
        pretrain(cfg)
    except (ValueError, OSError) as e:  # a bad --source, --tokenizer or size: one line, exit 2
        print(f"error: {e}" if str(e) else f"error: {type(e).__name__}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
