"""The live source against the cache source: same batches, bit for bit; failures end the run."""

from __future__ import annotations

import contextlib
import itertools
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_cache.data.inputs import open_data
from dflash_cache.errors import UserError
from dflash_cache.extract.config import ExtractConfig
from dflash_cache.extract.run import extract
from dflash_cache.store.manifest import mismatches
from dflash_cache.store.plan import PlanConfig
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify
from dflash_cache.target.capture import HiddenStateCapture
from dflash_cache.target.model import TargetSpec, describe_target, load_target
from dflash_cache.train.cache_source import CacheSource
from dflash_cache.train.epoch_plan import Position, SourceConfig
from dflash_cache.train.live_source import LiveData, LiveSource, LiveTargets, live_sample_table
from dflash_cache.train.place import Place
from dflash_cache.train.run_config import LiveConfig, TrainConfig
from dflash_cache.train.source import Source
from dflash_cache.train.trainer import Trainer

SOURCE = SourceConfig(token_budget=2048, min_supervised=16, seed=3, prefetch=2, read_threads=1)
CPU = torch.device("cpu")


# One row per target forward, in extraction and live alike: identical forward shapes, hence
# identical features bit for bit. (Padded batches of other compositions differ in the last bit.)
EXACT = PlanConfig(token_budget=4096, max_rows=1, unit_rows=64)
# The first 64 demo rows, for the cache and the live source alike: 6 batches an epoch under SOURCE
# (more than the 4 the comparison needs) at half the forwards of all 128, which every test here
# would otherwise run again; a smaller share of the data changes nothing a test checks.
LIMIT = 64


@pytest.fixture(scope="module")
def demo_bf16_cache(tmp_path_factory) -> Path:
    """The first LIMIT demo rows extracted with the default buckets (the ones the live source plans with)."""
    root = tmp_path_factory.mktemp("live") / "cache"
    cfg = ExtractConfig(target=TargetSpec(model="tiny"), data="demo", out=str(root), codec="bf16",
                        plan=EXACT, writers=2, progress=False, limit=LIMIT)
    extract(cfg, "cpu", echo=lambda *_: None)
    return root


def live_source(capture_cls=HiddenStateCapture, **kw) -> LiveSource:
    target = describe_target(TargetSpec(model="tiny"))
    dataset = open_data("demo", limit=LIMIT)
    scan = dataset.scan(vocab_size=target.identity.vocab_size, max_len=None)
    capture = capture_cls(load_target(target, CPU), target.layer_ids)
    bounds = PlanConfig().bucket_bounds
    return LiveSource(LiveData(dataset, live_sample_table(scan, bounds), bounds), SOURCE,
                      LiveTargets([capture], [CPU], **kw), Place(CPU))


def test_first_batches_from_cache_and_live_are_bit_identical(demo_bf16_cache):
    cache = CacheSource(CacheReader(demo_bf16_cache), SOURCE, Place(CPU))
    live = live_source(queue_depth=4, forward_plan=EXACT)
    assert isinstance(live, Source) and isinstance(cache, Source)  # what the trainer takes batches from
    assert live.batches_per_epoch() == cache.batches_per_epoch() > 4
    k = live.batches_per_epoch() + 2  # into the second epoch
    with contextlib.closing(cache.iterate(Position(0, 0))) as c, contextlib.closing(live.iterate(Position(0, 0))) as lv:
        for (pc, bc), (pl, bl) in zip(itertools.islice(c, k), itertools.islice(lv, k), strict=True):
            assert pc == pl
            for field in ("sample_ids", "cu_seqlens", "input_ids", "loss_mask", "position_ids", "features"):
                a, b = getattr(bc, field), getattr(bl, field)
                assert a.dtype == b.dtype and torch.equal(a, b), (pc, field)


def test_the_tee_commits_what_extraction_committed(demo_bf16_cache, tmp_path):
    """Epoch 0 of the extracted cache handed to the tee makes a cache of the same samples, bit for
    bit, under the same manifest but for its plan: both commit through the store's one writer."""
    from dflash_cache.train.tee import CacheTee

    extracted = CacheReader(demo_bf16_cache)
    source = CacheSource(extracted, SOURCE, Place(CPU))
    tee = CacheTee(str(tmp_path / "tee"), "bf16", target=describe_target(TargetSpec(model="tiny")),
                   data=LiveData(open_data("demo", limit=LIMIT), source.table, PlanConfig().bucket_bounds),
                   source_config=SOURCE, place=Place(CPU))
    with contextlib.closing(source.iterate(Position(0, 0), epochs=1)) as batches:
        for g, (_, batch) in enumerate(batches):
            tee(g, batch, None)
    tee.close()
    teed = CacheReader(tmp_path / "tee")
    assert teed.complete and not verify(teed)
    assert {field.split(".")[0] for field, *_ in mismatches(extracted.manifest, teed.manifest)} == {"plan"}
    assert teed.num_samples == sum(len(b) for b in source.epoch_batches(0)) > 0
    for rec in teed.records:
        for sid in rec.sample_ids:
            a, b = teed.sample(sid), extracted.sample(sid)
            assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
            assert torch.equal(a.features.view(torch.int16), b.features.view(torch.int16)), sid


def test_default_forward_batching_changes_features_by_rounding_only(demo_bf16_cache):
    cache = CacheSource(CacheReader(demo_bf16_cache), SOURCE, Place(CPU))
    live = live_source(queue_depth=4)  # padded forward batches of up to 64 rows
    with contextlib.closing(cache.iterate(Position(0, 0))) as c, contextlib.closing(live.iterate(Position(0, 0))) as lv:
        for (_, bc), (_, bl) in itertools.islice(zip(c, lv, strict=False), 3):
            assert torch.equal(bc.input_ids, bl.input_ids) and torch.equal(bc.sample_ids, bl.sample_ids)
            x, y = bc.features.float(), bl.features.float()
            assert (x - y).norm() <= 1e-2 * x.norm(), "bf16 rounding differences, nothing more"


class _Exploding(HiddenStateCapture):
    calls = 0

    def __call__(self, *args):
        type(self).calls += 1
        if type(self).calls == 3:
            raise RuntimeError("simulated CUDA error")
        return super().__call__(*args)


def test_a_failing_target_worker_ends_the_run_with_its_error():
    source = live_source(_Exploding, queue_depth=2)
    result: dict = {}

    def consume():
        try:
            with contextlib.closing(source.iterate(Position(0, 0), epochs=1)) as batches:
                for _ in batches:
                    pass
        except UserError as e:
            result["error"] = str(e)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the consumer hung on a dead target worker"
    assert "target worker on cpu failed" in result["error"] and "simulated CUDA error" in result["error"]


def test_a_plan_of_no_batches_ends_even_an_endless_iteration():
    """No epoch plans a batch (every sample under --min-supervised): iterating without an epoch limit
    gives nothing, at once, as the cache source does; it used to spin through empty epochs forever."""
    source = live_source()
    source.config = SourceConfig(token_budget=2048, min_supervised=10**6, seed=3)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(batches=list(source.iterate(Position(0, 0)))), daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "an empty plan kept the live source looping"
    assert result["batches"] == []


def test_stopping_early_stops_and_joins_the_target_workers():
    """A consumer that stops mid-epoch leaves no worker running forwards: a later source sharing the
    target would otherwise race with it (on a GPU, out-of-bounds gathers in the capture hooks)."""
    source = live_source(queue_depth=8)
    batches = source.iterate(Position(0, 0))
    next(batches)
    assert any(t.name.startswith("dflash-target-") for t in threading.enumerate())
    batches.close()
    assert not any(t.name.startswith("dflash-target-") for t in threading.enumerate())


def test_live_run_trains_and_tees_a_valid_cache(tmp_path):
    cfg = TrainConfig(target="tiny", out=str(tmp_path / "run"), block_size=8, draft_layers=2, num_anchors=16,
                      token_budget=2048, lr=3e-3, max_steps=6, log_every=3, progress=False,
                      live=LiveConfig(data="demo", limit=LIMIT, queue_depth=4, write_cache=str(tmp_path / "tee")))
    last = Trainer.build(cfg, device=CPU).fit()  # 6 steps: one epoch of LIMIT rows, all the tee writes
    assert last["step"] == 6 and last["loss"] < 12.0
    reader = CacheReader(tmp_path / "tee")
    assert reader.complete and not verify(reader)
    # and training continues offline from what the live run wrote
    offline = TrainConfig(target="tiny", cache=str(tmp_path / "tee"), out=str(tmp_path / "offline"), block_size=8,
                          draft_layers=2, num_anchors=16, token_budget=2048, max_steps=2, progress=False)
    assert Trainer.build(offline, device=CPU).fit()["step"] == 2


def test_train_live_gpus_runs_a_target_per_rank_and_the_ranks_tee_one_cache(tmp_path, monkeypatch, preloaded_ranks):
    """`train --live --gpus`: one launched rank per device (two CPU ranks here, as `--gpus all` gives
    two GPUs), each running its own target on its share of every epoch; DDP joins the drafters, rank 0
    alone says the result, and the ranks' tee'd segments make one complete, valid cache. (torchrun's
    ranks run the same `train`: tests/train/test_trainer.py starts one run under torchrun.)"""
    import json

    from click.testing import CliRunner

    from dflash_cache.cli import cli
    from dflash_cache.train import ranks

    monkeypatch.setattr(ranks, "gpu_devices", lambda _spec: [CPU] * 2)
    out, tee = tmp_path / "run", tmp_path / "tee"
    r = CliRunner().invoke(cli, [
        "train", "--live", "--target", "tiny", "--data", "demo", "--out", str(out), "--gpus", "all", "--epochs", "1",
        "--block-size", "8", "--draft-layers", "1", "--num-anchors", "8", "--token-budget", "1024",
        "--queue-depth", "4", "--log-every", "2", "--write-cache", str(tee), "--no-progress",
        "--limit", "32"])  # the first 32 rows: an epoch of 6 batches, 3 for each rank
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["epoch"] in (0, 1)
    assert [line for line in r.output.splitlines() if line.startswith("done:")] == [
        f"done: step {rows[-1]['step']}, loss {rows[-1]['loss']:.4f}, tau_hat {rows[-1]['tau_hat']:.3f}; exported to "
        f"{out / 'export'}"], r.output
    reader = CacheReader(tee)
    assert reader.complete and not verify(reader)
    assert {r.rank for r in reader.records} == {0, 1}
