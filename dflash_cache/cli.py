"""The `dflash-cache` command line.

`extract` and `train` take their options from their config dataclasses' fields (see
`dflash_cache.options`): a flag is declared once, on the field, and only the few options that are
not part of a config (where a job runs, and the whole of `eval` and `inspect`) are declared here.
Each command imports its phase lazily, so `--help` and `inspect` start without loading model
code. A `UserError` anywhere becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not sys.flags.safe_path:
    # `python -m dflash_cache.cli` puts the working directory first on sys.path, `python path/to/cli.py`
    # this package's folder: a user's inspect.py (or one of our modules) would shadow the standard
    # library that click imports. The package is installed, so neither entry is needed.
    del sys.path[0]

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import click  # noqa: E402

from dflash_cache import __version__  # noqa: E402
from dflash_cache.cpu_threads import ENV as CPU_THREADS_ENV  # noqa: E402
from dflash_cache.cpu_threads import use_free_cores  # noqa: E402
from dflash_cache.errors import UserError  # noqa: E402
from dflash_cache.logs import setup_logging  # noqa: E402
from dflash_cache.options import ConfigCommand  # noqa: E402

if TYPE_CHECKING:
    from dflash_cache.extract.config import ExtractConfig
    from dflash_cache.extract.regenerate_config import RegenerateConfig
    from dflash_cache.train.run_config import TrainConfig


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
@click.option("--cpu-threads", type=click.IntRange(min=1), default=None,
              help="torch threads for CPU work (sets OMP_NUM_THREADS) [default: the cores free now].")
def cli(verbose: bool, cpu_threads: int | None) -> None:
    """Offline-cached two-phase training of DFlash speculative-decoding drafters."""
    setup_logging(logging.DEBUG if verbose else logging.INFO)
    if cpu_threads is not None:  # the variable, so that the ranks a command launches get it too
        os.environ[CPU_THREADS_ENV] = str(cpu_threads)


@cli.command(cls=ConfigCommand, config="dflash_cache.extract.config:ExtractConfig")
@click.option("--gpus", default="all", show_default=True, help="'all', 'cpu', or GPU indices like 0,2,3.")
def extract(cfg: ExtractConfig, gpus: str) -> None:
    """Phase 1: run the target over a tokenized dataset and cache packed hidden states."""
    from dflash_cache.extract.run import extract as run_extract

    try:
        run_extract(cfg, gpus, echo=click.echo)
    except KeyboardInterrupt:
        click.echo("Interrupted: the committed segments are kept; run the same command again to finish the rest.",
                   err=True)
        sys.exit(130)


@cli.command(cls=ConfigCommand, config="dflash_cache.extract.regenerate_config:RegenerateConfig")
@click.option("--device", default="auto", show_default=True, help="Target device: 'auto', 'cpu' or 'cuda[:i]'.")
def regenerate(cfg: RegenerateConfig, device: str) -> None:
    """Replace a chat dataset's assistant turns with the target's own greedy replies (JSONL out)."""
    from dflash_cache.devices import resolve_device
    from dflash_cache.extract.regenerate import regenerate as run_regenerate

    dev = resolve_device(device)
    use_free_cores(dev)
    run_regenerate(cfg, dev, echo=click.echo)  # its result line: written, or already complete


@cli.command(cls=ConfigCommand, config="dflash_cache.train.run_config:TrainConfig")
@click.option("--device", default="auto", show_default=True,
              help="Drafter device of a single process: 'auto', 'cpu' or 'cuda[:i]'.")
@click.option("--gpus", default=None,
              help="One DDP rank per device instead: 'all', 'cpu', or GPU indices like 0,2,3 (as extract's --gpus).")
def train(cfg: TrainConfig, device: str, gpus: str | None) -> None:
    """Phase 2: train a DFlash drafter from a cache (or --live from the target); exports to OUT/export."""
    from dflash_cache.train.interrupt import TrainingInterrupted
    from dflash_cache.train.memory import prefer_expandable_segments
    from dflash_cache.train.ranks import run_training

    prefer_expandable_segments()
    try:
        run_training(cfg, device, gpus, echo=click.echo)
    except TrainingInterrupted as e:
        click.echo(f"Interrupted: checkpoint saved at step {e.step}; continue with --resume.", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("Stopped without saving the last steps; --resume continues from the last checkpoint.", err=True)
        sys.exit(130)


@cli.command(name="eval")
@click.option("--target", required=True, help="The target the drafter was trained for (local directory or 'tiny').")
@click.option("--drafter", required=True, type=click.Path(), help="A training run directory or its export/ directory.")
@click.option("--data", required=True, help="Dataset whose rows' prompts (tokens before the first supervised one) are used.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens generated per prompt.")
@click.option("--limit", type=click.IntRange(min=1), default=8, show_default=True, help="Number of prompts.")
@click.option("--block-size", type=click.IntRange(min=2), default=None,
              help="Draft block size (at most the trained one).")
@click.option("--dtype", default="float32", show_default=True, help="Target and drafter dtype.")
@click.option("--device", default="auto", show_default=True,
              help="Target and drafter device: 'auto', 'cpu' or 'cuda[:i]'.")
def eval_(target, drafter, data, max_new_tokens, limit, block_size, dtype, device) -> None:
    """Speculative decoding with an exported drafter: tau, its histogram, speed, and a lossless check."""
    import dataclasses

    from dflash_cache.data.chat import ChatSpec
    from dflash_cache.devices import resolve_device
    from dflash_cache.target.model import TargetDescription, identify_target, load_target, parse_dtype
    from dflash_cache.target.spec import TargetSpec
    from dflash_cache.train.drafter import FrozenTargetHead
    from dflash_cache.train.export import check_target, read_export
    from dflash_cache.train.serving import export_dir_of
    from dflash_cache.train.speculative import evaluate, load_prompts

    path = export_dir_of(Path(drafter))
    if not (path / "config.json").is_file():
        raise UserError(f"--drafter {drafter}: no exported drafter (config.json) there; pass a run or export directory")
    dev = resolve_device(device)
    use_free_cores(dev)
    export = read_export(path)
    cfg = export.cfg
    if block_size is not None:
        if not 2 <= block_size <= cfg.block_size:
            raise UserError(f"--block-size must be in 2..{cfg.block_size} (the trained block size)")
        cfg = dataclasses.replace(cfg, block_size=block_size)
    spec = TargetSpec(model=target, layers=tuple(cfg.target_layer_ids), dtype=dtype)
    config, identity = identify_target(spec)
    check_target(path, export.target, cfg, identity)  # before the layers are used: a mismatch is named first
    desc = TargetDescription(spec=spec, config=config, identity=identity, layer_ids=list(cfg.target_layer_ids))
    prompts = load_prompts(data, limit, chat=ChatSpec(model=target), vocab_size=identity.vocab_size)
    if not prompts:
        raise UserError(f"{data}: no row has a prompt (tokens before the first supervised one)")
    target_model = load_target(desc, dev, keep=identity.num_hidden_layers)
    head = FrozenTargetHead.from_target(target_model)
    model = export.drafter.to(device=dev, dtype=parse_dtype(dtype)).eval()
    r = evaluate(target_model, model, head, cfg, prompts, max_new_tokens)
    click.echo(f"prompts {len(prompts)}, {max_new_tokens} new tokens each, block size {cfg.block_size}")
    click.echo(f"tau (tokens per target forward): {r.tau:.3f}")
    click.echo("accepted per step: " + "  ".join(f"{k}:{v}" for k, v in r.histogram.items()))
    click.echo(f"target-only {r.target_tok_s:,.1f} tok/s, speculative {r.speculative_tok_s:,.1f} tok/s")
    click.echo("lossless: output equals the target's greedy output" if r.lossless else
               f"NOT LOSSLESS: prompts {r.mismatches} differ from greedy decoding")
    if not r.lossless:
        sys.exit(1)


@cli.command(name="serve-command")
@click.argument("export", type=click.Path())
@click.option("--engine", required=True, type=click.Choice(["sglang", "vllm", "speculators"]),
              help="Serve with SGLang or vLLM, or convert to the speculators format and serve that with vLLM.")
@click.option("--target", default=None, help="The target model to serve [default: the one the export records].")
@click.option("--converted", default=None, help="speculators: directory for the conversion [default: EXPORT-speculators].")
def serve_command(export: str, engine: str, target: str | None, converted: str | None) -> None:
    """Print the command line(s) that serve an exported drafter, its block size from its config.json
    (docs/serving.md)."""
    from dflash_cache.train.serving import format_command, serve_commands

    click.echo("\n\n".join(format_command(argv) for argv in serve_commands(engine, Path(export), target, converted)))


@cli.command()
@click.argument("cache", type=click.Path())
@click.option("--verify", "do_verify", is_flag=True,
              help="Decode every chunk and cross-check; exit 1 on damage or an incomplete cache.")
@click.option("--repair", is_flag=True,
              help="With --verify: un-commit damaged segments (and rewrite the index) so the next extract redoes them.")
@click.option("--sample", "sample_id", type=int, default=None, help="Show one sample by id.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(cache: str, do_verify: bool, repair: bool, sample_id: int | None, as_json: bool) -> None:
    """What is in a cache (a directory or a URL such as s3://bucket/prefix): summary, buckets,
    missing units, samples, verification."""
    import contextlib

    from dflash_cache.store.location import is_url
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
    if repair and is_url(cache):
        raise UserError(f"--repair changes the cache, and {cache} is read-only here; repair a local copy")
    if not is_url(cache) and is_half_made(Path(cache)):
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
