"""What a training run is told: `TrainConfig` (and `LiveConfig` for `train --live`).

Each field is also the `dflash-cache train` option of the same name (see `dflash_cache.options`);
the fields with `cli=False` are the recipe's constants and values derived from the target, set in
code only. The drafter's own shape is `DrafterConfig` (train/config.py), derived from the target.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_cache.data.dataset import OVERLONG_POLICIES
from dflash_cache.errors import UserError
from dflash_cache.options import check_options, option
from dflash_cache.profiler import INTERVAL_HELP
from dflash_cache.store.manifest import CODEC_NAMES
from dflash_cache.store.plan import DEFAULT_MAX_ROWS, DEFAULT_TOKEN_BUDGET
from dflash_cache.target.spec import DTYPE_NAMES
from dflash_cache.train.trackers import parse_report_to

# torch takes 64-bit seeds, and the trainer derives its anchors' from --seed * 1000003 * 1009 (plus
# step and rank); 32 bits keep that inside them (and are numpy's legacy range, which users know).
MAX_SEED = 2**32 - 1
# What --attention-kernels names (dflash_cache.train.attention_kernels resolves "auto"); declared
# here, with the options, so that `train --help` loads no torch.
ATTENTION_KERNELS = ("auto", "triton", "flash")


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """`train --live`: the target runs beside the drafter instead of a cache feeding it."""

    data: str = option(help="the tokenized dataset (as for extract), or 'demo'.")
    chat_template: str | None = option(None, path="any", help="Jinja chat template for a chat dataset, "
                                                              "overriding the target tokenizer's.")
    limit: int | None = option(None, min=1, help="only the first N rows.")
    max_len: int | None = option(None, min=1, help="longest row kept (longer rows are truncated).")
    overlong: str = option("truncate", choices=OVERLONG_POLICIES, cli=False)
    target_gpus: str = option("same", help="'same' (the drafter's device), 'cpu', or GPU indices like 0,1 "
                                           "(one worker each).")
    num_target_layers: int = option(5, min=1, help="target layers to capture.")
    layers: tuple[int, ...] | None = option(None, help="explicit target layer ids, e.g. 1,9,17,25,33.")
    dtype: str = option("bfloat16", choices=tuple(DTYPE_NAMES), cli=False)
    queue_depth: int = option(60, min=1, help="batches buffered between target and drafter.")
    forward_token_budget: int = option(DEFAULT_TOKEN_BUDGET, min=1, flag="--target-token-budget",
                                       help="padded tokens per target forward (planned as extract plans its "
                                            "batches).")
    forward_max_rows: int = option(DEFAULT_MAX_ROWS, min=1, flag="--target-max-rows",
                                   help="rows per target forward at most.")
    write_cache: str | None = option(None, path="dir", help="also commit epoch 0's features to this cache (train "
                                                            "offline from it later).")
    write_codec: str = option("bf16", choices=CODEC_NAMES, help="the codec of --write-cache.")

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run; give exactly one of `cache` and `live`."""

    cache: str | None = option(None, path="any", help="A cache made by `dflash-cache extract`: its directory, or "
                                                      "a URL such as s3://bucket/prefix.")
    target: str = option(help="The target (local directory or 'tiny'); with --cache, the one it was made with.")
    out: str = option(path="dir", help="Run directory: checkpoints, metrics, export.")
    trust_remote_code: bool = option(False, help="Allow the target directory's own Python code.")
    block_size: int = option(16, min=2, help="Tokens per draft block: the anchor plus block-size - 1 predicted "
                                             "tokens.")
    draft_layers: int = option(5, min=1, help="Decoder layers of the drafter.")
    num_anchors: int = option(512, min=1, help="Anchors sampled per sequence at most.")
    max_anchors: int | None = option(None, min=1, help="Anchors per packed batch at most (default: no cap). "
                                                       "Drafter memory grows with anchors x block size, and a batch "
                                                       "of many short samples can hold far more anchors than one "
                                                       "of long ones.")
    epochs: int = option(6, min=1, help="Passes over the data.")
    max_steps: int | None = option(None, min=1, help="Stop after this many optimiser steps.")
    lr: float = option(6e-4, min=0, min_open=True, help="Peak learning rate (AdamW; linear warm-up, then "
                                                        "cosine decay to 0).")
    token_budget: int = option(32768, min=1, help="Real tokens per packed batch.")
    sliding_window: int | None = option(None, min=1, help="Make every drafter layer sliding-window attention "
                                                          "with this many tokens.")
    seed: int = option(0, min=0, max=MAX_SEED, help="Seeds the drafter's initial weights, the epoch order and the "
                                                    "anchors.")
    save_every: int = option(500, min=1, help="Checkpoint every N steps (and at exit).")
    nonfinite_limit: int = option(20, min=1, help="A step whose gradients are not finite (NaN or Inf) is skipped "
                                                  "(no update) and counted; stop with an error after this many "
                                                  "in a row.")
    keep_checkpoints: int = option(2, min=1, help="Newest checkpoints kept; older ones are deleted once a newer "
                                                  "one is complete.")
    log_every: int = option(10, min=1, help="Log loss, tau_hat and tokens/s at every N-th step, a resumed "
                                            "run too (to the log and OUT/metrics.jsonl).")
    resume: bool = option(False, help="Continue from the latest checkpoint in --out.")
    allow_incomplete: bool = option(False, help="Train on a cache whose extraction has not finished (only the "
                                                "committed segments).")
    prefetch: int = option(4, min=1, help="Batches read ahead of training.")
    read_threads: int = option(4, min=1, help="Threads reading the cache.")
    live: LiveConfig | None = option(None, help="No cache: run the target beside the drafter (needs --data).")
    profile_interval: float | None = option(None, min=0, min_open=True, help=INTERVAL_HELP)
    progress: bool = option(True, help="Hide the progress bar.")
    compile: bool = option(True, help="On GPUs, run the drafter layers and the loss eagerly instead of compiled "
                                      "(torch.compile: a minute more at start, faster steps).")
    static_shapes: int = option(4, min=1, help="On GPUs, the anchor counts the compiled step is built for, chosen "
                                               "from the run's batches at start-up; each batch is padded up to the "
                                               "nearest (more: less padding, a longer start-up).")
    attention_kernels: str = option("auto", choices=ATTENTION_KERNELS,
                                    help="What FlexAttention runs on in the compiled static-shape graph: flash "
                                         "(flash-attention 4's kernels, pip install 'dflash-cache[flash]'; Hopper "
                                         "and Blackwell GPUs, heads of 128; faster, not bitwise reproducible), "
                                         "triton (inductor's; deterministic), auto (flash where it can run).")
    eval_data: str | None = option(None, path="any", help="Held-out data evaluated during training: a cache made by "
                                                          "`dflash-cache extract` for the same target and layers "
                                                          "(directory or URL), or with --live also a dataset.")
    eval_every: int | None = option(None, min=1, help="Evaluate on --eval-data every N steps (default: "
                                                      "--save-every) and at the end.")
    eval_batches: int = option(16, min=1, help="Held-out batches per evaluation (the same ones each time).")
    report_to: str | None = option(None, help="Also report the metrics (and the profiler's reports) to trackers: "
                                              "tensorboard, wandb, or both comma-separated (optional extras of the "
                                              "same names; W&B reads its WANDB_* environment).")
    # The DFlash recipe's constants, and what defaults from the target (the mask token: an unused row).
    warmup_ratio: float = option(0.04, min=0, max=1, cli=False)
    weight_decay: float = option(0.0, min=0, cli=False)
    grad_clip: float = option(1.0, cli=False)
    loss_chunk: int = option(4096, min=1, cli=False)  # most rows per LM-head loss chunk (memory); chunks are equal
    mask_token_id: int | None = option(None, min=0, cli=False)

    def __post_init__(self) -> None:
        check_options(self)
        if (self.cache is None) == (self.live is None):
            raise UserError("give either --cache DIR or --live with --data")
        parse_report_to(self.report_to)  # a tracker named wrong stops the run before anything loads
        if self.eval_every is not None and self.eval_data is None:
            raise UserError("--eval-every applies to an evaluation; add --eval-data with held-out data, or drop it")
