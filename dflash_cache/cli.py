"""The `dflash-cache` command line.

Each command imports its phase lazily, so `--help` and `inspect` start without loading model
code. A `UserError` anywhere becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from dflash_cache import __version__
from dflash_cache.errors import UserError


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _int_list(value: str | None, option: str = "--layers") -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{option} {value!r}: expected comma-separated integers like 1,9,17") from None


class _UserFacingError(click.ClickException):
    """How a UserError leaves the CLI: 'Error: <one line>' on stderr and exit status 2."""

    exit_code = 2


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as e:
            raise _UserFacingError(str(e)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dflash-cache")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def cli(verbose: bool) -> None:
    """Offline-cached two-phase training of DFlash speculative-decoding drafters."""
    _setup_logging(verbose)


@cli.command()
@click.option("--model", required=True, help="Local Hugging Face model directory, or 'tiny' (built-in, no download).")
@click.option("--data", required=True, help="HF datasets dir, Parquet file/dir, JSONL file/dir, or 'demo'.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Cache directory to create or resume.")
@click.option("--gpus", default="all", show_default=True, help="'all', 'cpu', or GPU indices like 0,2,3.")
@click.option("--codec", type=click.Choice(["none", "bf16", "fp8"]), default="bf16", show_default=True,
              help="none: raw bf16; bf16: lossless zstd; fp8: e4m3 + per-token scales (~2.4x smaller).")
@click.option("--dtype", default="bfloat16", show_default=True, help="Target compute dtype.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the model directory's own Python code.")
@click.option("--num-layers", default=5, show_default=True, help="Layers spread evenly over 1..L-3.")
@click.option("--layers", default=None, help="Explicit decoder layer ids, e.g. 1,9,17,25,33 (overrides --num-layers).")
@click.option("--limit", type=int, default=None, help="Use only the first N rows.")
@click.option("--max-len", type=int, default=None, help="Longest row kept; see --overlong.")
@click.option("--overlong", type=click.Choice(["truncate", "skip"]), default="truncate", show_default=True,
              help="What --max-len does to longer rows (both are counted and reported).")
@click.option("--token-budget", default=49152, show_default=True, help="Padded tokens per forward batch.")
@click.option("--max-rows", default=64, show_default=True, help="Rows per forward batch at most.")
@click.option("--buckets", default="0,770,1216,1728,2432,3296", show_default=True,
              help="Length-bucket lower bounds; rows batch only with rows of their bucket.")
@click.option("--unit-rows", default=4096, show_default=True, help="Dataset rows per work unit (sort window).")
@click.option("--writers", default=4, show_default=True, help="Threads compressing and writing segments.")
@click.option("--prefetch", default=2, show_default=True, help="Batches read ahead of the forward.")
@click.option("--overwrite", is_flag=True, help="Delete an existing cache at --out and start over.")
@click.option("--profile-interval", type=float, default=None,
              help="Seconds between stage-timing reports (or DFLASH_PROFILE_INTERVAL).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def extract(model, data, out, gpus, codec, dtype, trust_remote_code, num_layers, layers, limit, max_len,
            overlong, token_budget, max_rows, buckets, unit_rows, writers, prefetch, overwrite, profile_interval,
            no_progress) -> None:
    """Phase 1: run the target over a tokenized dataset and cache packed hidden states."""
    from dflash_cache.extract.config import ExtractConfig
    from dflash_cache.extract.run import extract as run_extract
    from dflash_cache.extract.target import TargetSpec
    from dflash_cache.store.plan import PlanConfig

    cfg = ExtractConfig(
        target=TargetSpec(model=model, dtype=dtype, num_layers=num_layers, layers=_int_list(layers),
                          trust_remote_code=trust_remote_code),
        data=data, out=out, codec=codec, limit=limit, max_len=max_len, overlong=overlong,
        plan=PlanConfig(token_budget=token_budget, max_rows=max_rows, unit_rows=unit_rows,
                        bucket_bounds=_int_list(buckets, "--buckets")),
        overwrite=overwrite, writers=writers, prefetch=prefetch, profile_interval=profile_interval,
        progress=not no_progress,
    )
    run_extract(cfg, gpus, echo=click.echo)


_POSITIVE = click.IntRange(min=1)


@cli.command()
@click.option("--cache", type=click.Path(), default=None, help="A cache made by `dflash-cache extract`.")
@click.option("--live", is_flag=True, help="No cache: run the target beside the drafter (needs --data).")
@click.option("--target", required=True, help="The target (local directory or 'tiny'); with --cache, the one it was made with.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory: checkpoints, metrics, export.")
@click.option("--block-size", type=click.IntRange(min=2), default=16, show_default=True,
              help="Tokens per draft block: the anchor plus block-size - 1 predicted tokens.")
@click.option("--draft-layers", type=_POSITIVE, default=5, show_default=True, help="Decoder layers of the drafter.")
@click.option("--num-anchors", type=_POSITIVE, default=512, show_default=True, help="Anchors sampled per sequence at most.")
@click.option("--max-anchors", type=_POSITIVE, default=None,
              help="Anchors per packed batch at most (default: no cap). Drafter memory grows with anchors x "
                   "block size, and a batch of many short samples can hold far more anchors than one of long ones.")
@click.option("--epochs", type=_POSITIVE, default=6, show_default=True, help="Passes over the data.")
@click.option("--max-steps", type=_POSITIVE, default=None, help="Stop after this many optimiser steps.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=6e-4, show_default=True,
              help="Peak learning rate (AdamW; linear warm-up, then cosine decay to 0).")
@click.option("--token-budget", type=_POSITIVE, default=32768, show_default=True, help="Real tokens per packed batch.")
@click.option("--sliding-window", type=_POSITIVE, default=None,
              help="Make every drafter layer sliding-window attention with this many tokens.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seeds the drafter's initial weights, the epoch order and the anchors.")
@click.option("--save-every", type=_POSITIVE, default=500, show_default=True, help="Checkpoint every N steps (and at exit).")
@click.option("--keep-checkpoints", type=_POSITIVE, default=2, show_default=True,
              help="Newest checkpoints kept; older ones are deleted once a newer one is complete.")
@click.option("--log-every", type=_POSITIVE, default=10, show_default=True,
              help="Log loss, tau_hat and tokens/s every N steps (to the log and OUT/metrics.jsonl).")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --out.")
@click.option("--device", default="auto", show_default=True, help="Drafter device: 'auto', 'cpu' or 'cuda[:i]'.")
@click.option("--allow-incomplete", is_flag=True,
              help="Train on a cache whose extraction has not finished (only the committed segments).")
@click.option("--prefetch", type=_POSITIVE, default=4, show_default=True, help="Batches read ahead of training.")
@click.option("--read-threads", type=_POSITIVE, default=4, show_default=True, help="Threads reading the cache.")
@click.option("--data", default=None, help="--live: the tokenized dataset (as for extract), or 'demo'.")
@click.option("--limit", type=_POSITIVE, default=None, help="--live: only the first N rows.")
@click.option("--max-len", type=_POSITIVE, default=None, help="--live: longest row kept (longer rows are truncated).")
@click.option("--num-target-layers", type=_POSITIVE, default=5, show_default=True, help="--live: target layers to capture.")
@click.option("--layers", default=None, help="--live: explicit target layer ids, e.g. 1,9,17,25,33.")
@click.option("--target-gpus", default="same", show_default=True,
              help="--live: 'same' (the drafter's device), 'cpu', or GPU indices like 0,1 (one worker each).")
@click.option("--queue-depth", type=_POSITIVE, default=60, show_default=True,
              help="--live: batches buffered between target and drafter.")
@click.option("--target-token-budget", type=_POSITIVE, default=49152, show_default=True,
              help="--live: padded tokens per target forward (planned as extract plans its batches).")
@click.option("--target-max-rows", type=_POSITIVE, default=64, show_default=True,
              help="--live: rows per target forward at most.")
@click.option("--write-cache", type=click.Path(file_okay=False), default=None,
              help="--live: also commit epoch 0's features to this cache (train offline from it later).")
@click.option("--write-codec", type=click.Choice(["none", "bf16", "fp8"]), default="bf16", show_default=True,
              help="--live: the codec of --write-cache.")
@click.option("--profile-interval", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds between stage-timing reports (or DFLASH_PROFILE_INTERVAL).")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def train(cache, live, target, out, block_size, draft_layers, num_anchors, max_anchors, epochs, max_steps, lr,
          token_budget, sliding_window, seed, save_every, keep_checkpoints, log_every, resume, device,
          allow_incomplete, prefetch, read_threads, data, limit, max_len, num_target_layers, layers, target_gpus,
          queue_depth, target_token_budget, target_max_rows, write_cache, write_codec, profile_interval,
          no_progress) -> None:
    """Phase 2: train a DFlash drafter from a cache (or --live from the target); exports to OUT/export."""
    from dflash_cache.train.interrupt import TrainingInterrupted
    from dflash_cache.train.trainer import LiveConfig, TrainConfig
    from dflash_cache.train.trainer import train as run_train

    if live and (cache or not data):
        raise UserError("--live takes --data (and no --cache); without --live, give --cache")
    live_cfg = None
    if live:
        live_cfg = LiveConfig(data=data, limit=limit, max_len=max_len, target_gpus=target_gpus,
                              num_target_layers=num_target_layers, layers=_int_list(layers), queue_depth=queue_depth,
                              forward_token_budget=target_token_budget, forward_max_rows=target_max_rows,
                              write_cache=write_cache, write_codec=write_codec)
    cfg = TrainConfig(cache=cache, live=live_cfg, target=target, out=out, block_size=block_size,
                      draft_layers=draft_layers, num_anchors=num_anchors, max_anchors=max_anchors, epochs=epochs,
                      max_steps=max_steps, lr=lr, token_budget=token_budget, sliding_window=sliding_window,
                      seed=seed, save_every=save_every, keep_checkpoints=keep_checkpoints, log_every=log_every,
                      resume=resume, allow_incomplete=allow_incomplete, prefetch=prefetch,
                      read_threads=read_threads, profile_interval=profile_interval, progress=not no_progress)
    try:
        last = run_train(cfg, device)
    except TrainingInterrupted as e:
        click.echo(f"Interrupted: checkpoint saved at step {e.step}; continue with --resume.", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("Stopped without saving the last steps; --resume continues from the last checkpoint.", err=True)
        sys.exit(130)
    if last:
        click.echo(f"done: step {last['step']}, loss {last['loss']:.4f}, tau_hat {last['tau_hat']:.3f}; "
                   f"exported to {Path(out) / 'export'}")
    else:
        click.echo(f"nothing to train: {out} is already at its last step; exported to {Path(out) / 'export'}")


@cli.command(name="eval")
@click.option("--target", required=True, help="The target the drafter was trained for (local directory or 'tiny').")
@click.option("--drafter", required=True, type=click.Path(), help="A training run directory or its export/ directory.")
@click.option("--data", required=True, help="Dataset whose rows' prompts (tokens before the first supervised one) are used.")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--limit", default=8, show_default=True, help="Number of prompts.")
@click.option("--block-size", type=int, default=None, help="Draft block size (at most the trained one).")
@click.option("--dtype", default="float32", show_default=True, help="Target and drafter dtype.")
@click.option("--device", default="auto", show_default=True)
def eval_(target, drafter, data, max_new_tokens, limit, block_size, dtype, device) -> None:
    """Speculative decoding with an exported drafter: tau, its histogram, speed, and a lossless check."""
    import dataclasses

    import torch

    from dflash_cache.extract.target import TargetSpec, describe_target, load_target, parse_dtype
    from dflash_cache.train.drafter import FrozenTargetHead
    from dflash_cache.train.export import drafter_from_export
    from dflash_cache.train.speculative import evaluate, load_prompts

    path = Path(drafter)
    path = path / "export" if (path / "export" / "config.json").is_file() else path
    if not (path / "config.json").is_file():
        raise UserError(f"--drafter {drafter}: no exported drafter (config.json) there; pass a run or export directory")
    cfg, model = drafter_from_export(path)
    if block_size is not None:
        if not 2 <= block_size <= cfg.block_size:
            raise UserError(f"--block-size must be in 2..{cfg.block_size} (the trained block size)")
        cfg = dataclasses.replace(cfg, block_size=block_size)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)
    desc = describe_target(TargetSpec(model=target, layers=tuple(cfg.target_layer_ids), dtype=dtype))
    if desc.identity.vocab_size != cfg.vocab_size or desc.hidden_size != cfg.hidden_size:
        raise UserError(f"the drafter was trained for a target with vocab {cfg.vocab_size} and hidden size "
                        f"{cfg.hidden_size}; {target} has {desc.identity.vocab_size} and {desc.hidden_size}")
    target_model = load_target(desc, dev, keep=desc.identity.num_hidden_layers)
    head = FrozenTargetHead.from_target(target_model)
    model = model.to(device=dev, dtype=parse_dtype(dtype)).eval()
    prompts = load_prompts(data, limit)
    if not prompts:
        raise UserError(f"{data}: no row has a prompt (tokens before the first supervised one)")
    r = evaluate(target_model, model, head, cfg, prompts, max_new_tokens)
    click.echo(f"prompts {len(prompts)}, {max_new_tokens} new tokens each, block size {cfg.block_size}")
    click.echo(f"tau (tokens per target forward): {r.tau:.3f}")
    click.echo("accepted per step: " + "  ".join(f"{k}:{v}" for k, v in r.histogram.items()))
    click.echo(f"target-only {r.target_tok_s:,.1f} tok/s, speculative {r.speculative_tok_s:,.1f} tok/s")
    click.echo("lossless: output equals the target's greedy output" if r.lossless else
               f"NOT LOSSLESS: prompts {r.mismatches} differ from greedy decoding")
    if not r.lossless:
        sys.exit(1)


@cli.command()
@click.argument("cache", type=click.Path())
@click.option("--verify", "do_verify", is_flag=True,
              help="Decode every chunk and cross-check; exit 1 on damage or an incomplete cache.")
@click.option("--repair", is_flag=True,
              help="With --verify: un-commit damaged segments (and rewrite the index) so the next extract redoes them.")
@click.option("--sample", "sample_id", type=int, default=None, help="Show one sample by id.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(cache: str, do_verify: bool, repair: bool, sample_id: int | None, as_json: bool) -> None:
    """What is in a cache: summary, buckets, missing units, samples, verification."""
    import contextlib

    from dflash_cache.store.lock import CacheLock
    from dflash_cache.store.reader import CacheReader
    from dflash_cache.store.repair import is_half_made
    from dflash_cache.store.report import (
        describe_sample,
        format_sample,
        format_summary,
        format_verification,
        summarize,
        verification,
    )

    if repair and not do_verify:
        raise UserError("--repair works on what verification finds: pass --verify --repair")
    if is_half_made(Path(cache)):
        raise UserError(f"cache {cache} was interrupted while being created; run the extract command again to make it")
    reader = CacheReader(cache)  # checks the path before a repair's lock could create anything there
    with CacheLock(Path(cache), flag=None) if repair else contextlib.nullcontext():
        if repair:  # read again under the lock: no writer can change the cache while it is repaired
            reader = CacheReader(cache)
        out = summarize(reader)
        if sample_id is not None:
            out["sample"] = describe_sample(reader, sample_id)
        if do_verify:
            out["verify"] = verification(reader, repair=repair)
    if as_json:
        click.echo(json.dumps(out, indent=1))
    else:
        click.echo(format_summary(out))
        if sample_id is not None:
            click.echo(format_sample(out["sample"]))
        if do_verify:
            click.echo(format_verification(out["verify"]))
    if do_verify and not out["verify"]["ok"]:
        sys.exit(1)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
