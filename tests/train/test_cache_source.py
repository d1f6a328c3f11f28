from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from dflash_cache.errors import UserError
from dflash_cache.extract.run import extract
from dflash_cache.store.reader import CacheReader
from dflash_cache.train.cache_source import CacheSource, check_manifest
from dflash_cache.train.epoch_plan import Position, SourceConfig, plan_epoch
from dflash_cache.train.place import Place
from dflash_cache.train.source import Source
from tests.conftest import extract_config


def _index(n=500, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 400, size=n)
    supervised = rng.integers(0, lengths + 1)
    buckets = np.searchsorted([0, 100, 250], lengths, side="right") - 1
    return lengths, supervised, buckets


@pytest.mark.parametrize("world", [1, 2, 3])
def test_epoch_plan_covers_kept_samples_once_and_splits_evenly(world):
    lengths, supervised, buckets = _index()
    kw = dict(seed=7, epoch=3, token_budget=1000, min_supervised=20)
    shares = [plan_epoch(lengths, supervised, buckets, rank=r, world=world, **kw) for r in range(world)]
    assert len({len(s) for s in shares}) == 1, "every rank gets the same number of batches"
    everything = plan_epoch(lengths, supervised, buckets, rank=0, world=1, **kw)
    rows = np.concatenate([b for s in shares for b in s])
    assert len(rows) == len(set(rows.tolist())), "no sample twice"
    all_rows = np.concatenate(everything)
    assert sorted(all_rows.tolist()) == np.flatnonzero(supervised >= 20).tolist()
    assert len(everything) - world * len(shares[0]) < world, "only the remainder is dropped"
    for b in everything:
        assert len(b) == 1 or lengths[b].sum() <= 1000
        assert len(set(buckets[b].tolist())) == 1


def test_epoch_plan_is_deterministic_per_seed_and_epoch():
    lengths, supervised, buckets = _index()
    kw = dict(token_budget=1000, min_supervised=0)
    a = plan_epoch(lengths, supervised, buckets, seed=1, epoch=0, **kw)
    b = plan_epoch(lengths, supervised, buckets, seed=1, epoch=0, **kw)
    c = plan_epoch(lengths, supervised, buckets, seed=1, epoch=1, **kw)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]


@pytest.fixture(scope="module")
def small_cache(small_parquet, tmp_path_factory):
    root = tmp_path_factory.mktemp("cache") / "c"
    extract(extract_config(small_parquet, root, codec="fp8"), "cpu", echo=lambda *_: None)
    return root


def test_batches_reproduce_the_cache(small_cache):
    reader = CacheReader(small_cache)
    source = CacheSource(reader, SourceConfig(token_budget=300, min_supervised=1, prefetch=2, read_threads=2),
                         Place(torch.device("cpu")))
    seen = []
    for _, batch in source.iterate(Position(0, 0), epochs=1):
        cu = batch.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == batch.num_tokens == batch.features.shape[0]
        assert batch.features.dtype == torch.bfloat16
        for i, sid in enumerate(batch.sample_ids.tolist()):
            s = reader.sample(sid)
            lo, hi = cu[i], cu[i + 1]
            assert batch.input_ids[lo:hi].tolist() == s.input_ids.tolist()
            assert batch.loss_mask[lo:hi].tolist() == s.loss_mask.astype(bool).tolist()
            assert torch.equal(batch.features[lo:hi], s.features)
            assert batch.position_ids[lo:hi].tolist() == list(range(hi - lo))
            seen.append(sid)
    index = reader.index
    kept = index.filter(index.column("supervised").to_numpy() >= 1).column("sample_id").to_pylist()
    assert sorted(seen) == sorted(kept), "one epoch yields every kept sample exactly once (world 1)"


def test_resume_from_a_position_continues_the_same_stream(small_cache):
    reader = CacheReader(small_cache)
    cfg = SourceConfig(token_budget=300, min_supervised=1, prefetch=3, read_threads=2)
    source = CacheSource(reader, cfg, Place(torch.device("cpu")))
    n = source.batches_per_epoch()
    full = [(p, b.sample_ids.tolist()) for p, b in itertools.islice(source.iterate(Position(0, 0)), n + 3)]
    k = n // 2
    resumed = [(p, b.sample_ids.tolist()) for p, b in itertools.islice(source.iterate(full[k - 1][0]), n + 3 - k)]
    assert resumed == full[k:]
    assert full[n - 1][0] == Position(0, n) and full[n][0] == Position(1, 1)


def test_the_source_owns_its_position_and_a_fresh_one_resumes_from_its_state(small_cache):
    """A `Source`: the position training has reached is the source's (`advance`), its state two
    integers; a fresh source loaded with them continues the stream where the first stood, and counts
    the batches left to the end of the epochs from there."""
    cfg = SourceConfig(token_budget=300, min_supervised=1, prefetch=2, read_threads=1)
    source = CacheSource(CacheReader(small_cache), cfg, Place(torch.device("cpu")))
    assert isinstance(source, Source) and source.state_dict() == {"epoch": 0, "batch": 0}
    n = source.batches_per_epoch()
    stream = [(p, b.sample_ids.tolist()) for p, b in itertools.islice(source.iterate(source.position), n + 2)]
    source.advance(stream[n][0])  # the first batch of epoch 1 trained
    assert source.state_dict() == {"epoch": 1, "batch": 1} and source.batches_left(epochs=3) == 2 * n - 1
    again = CacheSource(CacheReader(small_cache), cfg, Place(torch.device("cpu")))
    again.load_state_dict(source.state_dict())
    assert again.position == Position(1, 1)
    assert [(p, b.sample_ids.tolist()) for p, b in itertools.islice(again.iterate(again.position), 1)] == stream[n + 1:]


def test_manifest_mismatch_names_the_field(small_cache):
    m = CacheReader(small_cache).manifest
    ok = dict(layer_ids=m.layer_ids, hidden_size=m.hidden_size, target=m.target)
    check_manifest(m, **ok)
    for field, value in (("layer_ids", (1, 2)), ("hidden_size", 64)):
        with pytest.raises(UserError, match=field):
            check_manifest(m, **{**ok, field: value})
    for field, value in (("vocab_size", 10), ("config_hash", "other")):
        with pytest.raises(UserError, match=f"target.{field}"):
            check_manifest(m, **{**ok, "target": dataclasses.replace(m.target, **{field: value})})


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 10), ("model_type", "llama"),
                                          ("config_hash", "0123456789abcdef"), ("weights_fingerprint", "f" * 16)])
def test_a_cache_of_another_target_names_both_targets_and_the_field(small_cache, field, value):
    """The comparison `eval` makes of an export's target (`dflash_cache.target.identity`), weights included:
    a cache's features are the outputs of the weights it was extracted from."""
    m = CacheReader(small_cache).manifest
    other = dataclasses.replace(m.target, name="/models/other", **{field: value})
    with pytest.raises(UserError) as e:
        check_manifest(m, target=other, layer_ids=m.layer_ids, hidden_size=m.hidden_size)
    assert str(e.value) == (f"cache manifest field target.{field} is {getattr(m.target, field)!r} (extracted from "
                            f"target {m.target.name}), but --target /models/other has {value!r}; extract a cache for "
                            "this target and layers, or pass the matching --target")
    check_manifest(m, target=dataclasses.replace(m.target, name="/moved/tiny"), layer_ids=m.layer_ids,
                   hidden_size=m.hidden_size)  # another path to the same model


def test_a_cache_made_again_under_the_source_stops_it(small_cache, tmp_path):
    """The source checks each segment of a batch once, after its reads: commit records replaced
    since the first epoch (the cache made again at the same path) stop the second epoch."""
    import shutil

    from dflash_cache.errors import CacheCorruptError

    root = tmp_path / "cache"
    shutil.copytree(small_cache, root)
    source = CacheSource(CacheReader(root), SourceConfig(token_budget=300, min_supervised=1, prefetch=1,
                                                         read_threads=1), Place(torch.device("cpu")))
    n = source.batches_per_epoch()
    assert len(list(source.iterate(Position(0, 0), epochs=1))) == n
    for record in (root / "commits").glob("*.json"):
        text = record.read_text()
        record.unlink()
        record.write_text(text)
    with pytest.raises(CacheCorruptError, match="changed .*while it was being read"):
        list(source.iterate(Position(1, 0), epochs=2))
