"""The packed batch: its host form, the layout helpers, and a commit read back through CacheReader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_cache.store.batch import (
    HostBatch,
    PackedBatch,
    concatenate,
    cu_seqlens_of,
    positions_from_cu_seqlens,
)
from dflash_cache.store.codecs import TOKEN_ARRAYS, get_codec
from dflash_cache.store.layout import COMMITS_DIR
from dflash_cache.store.manifest import write_manifest
from dflash_cache.store.plan import PlannedBatch
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.writer import commit_segment
from tests.dflash_cache.store._util import bf16_features, make_manifest


def rows(lengths=(3, 1, 4), seed=0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 1000, n).astype(np.int64) for n in lengths]
    masks = [rng.random(n) < 0.5 for n in lengths]
    return ids, masks


def assert_same(a: HostBatch, b: HostBatch) -> None:
    for name in ("input_ids", "loss_mask", "cu_seqlens", "sample_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_cu_seqlens_and_positions_from_lengths():
    cu = cu_seqlens_of([3, 1, 4])
    assert cu.dtype == np.int64 and cu.tolist() == [0, 3, 4, 8]
    assert cu_seqlens_of([]).tolist() == [0]
    assert positions_from_cu_seqlens(torch.from_numpy(cu), 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_pack_lays_rows_end_to_end_in_the_stored_dtypes():
    ids, masks = rows()
    packed = HostBatch.pack(ids, masks, np.array([7, 2, 9]))
    assert packed.input_ids.tolist() == np.concatenate(ids).tolist()
    assert packed.loss_mask.tolist() == np.concatenate(masks).astype(int).tolist()
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8] and packed.lengths.tolist() == [3, 1, 4]
    assert packed.sample_ids.tolist() == [7, 2, 9] and (packed.num_tokens, packed.num_docs) == (8, 3)
    assert packed.supervised().tolist() == [int(m.sum()) for m in masks]
    stored = packed.stored()
    assert list(stored) == list(TOKEN_ARRAYS)
    assert all(stored[k].dtype == dtype for k, dtype in TOKEN_ARRAYS.items())
    assert_same(HostBatch.from_stored(stored), packed)


def test_pack_allocates_through_the_given_allocator():
    """The cache source allocates in pinned memory: every array must be written where it allocated."""
    made: dict[str, np.ndarray] = {}

    def allocate(name, shape, dtype):
        made[name] = np.full(shape, 99, dtype)
        return made[name]

    ids, masks = rows()
    packed = HostBatch.pack(ids, masks, np.array([7, 2, 9]), allocate=allocate)
    assert set(made) == {"input_ids", "loss_mask", "cu_seqlens", "sample_ids"}
    assert all(np.shares_memory(getattr(packed, k), made[k]) for k in made)
    feats = concatenate("features", [np.ones((2, 4), np.uint16), np.zeros((1, 4), np.uint16)], allocate=allocate)
    assert feats is made["features"] and feats.shape == (3, 4) and feats[:2].all() and not feats[2].any()


def test_inconsistent_batches_are_refused():
    ids, masks = rows()
    good = HostBatch.pack(ids, masks, np.array([7, 2, 9]))
    for bad in (dict(loss_mask=good.loss_mask[:-1]), dict(sample_ids=good.sample_ids[:2]),
                dict(cu_seqlens=np.array([0, 3, 4, 9]))):
        fields = dict(input_ids=good.input_ids, loss_mask=good.loss_mask, cu_seqlens=good.cu_seqlens,
                      sample_ids=good.sample_ids) | bad
        with pytest.raises(ValueError, match="inconsistent packed batch"):
            HostBatch(**fields)


def test_device_batch_from_the_host_batch_and_back():
    ids, masks = rows()
    packed = HostBatch.pack(ids, masks, np.array([7, 2, 9]))
    features = bf16_features(8, 6)
    batch = PackedBatch.from_host(packed, features)
    assert batch.input_ids.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3] and batch.features is features
    assert batch.host is not None and np.shares_memory(batch.host.input_ids.numpy(), packed.input_ids)
    assert batch.doc_ids().tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert_same(HostBatch.from_packed(batch.to("cpu")), packed)


@pytest.mark.parametrize("codec", ["none", "bf16", "fp8"])
def test_a_committed_packed_batch_reads_back_identically(tmp_path, codec):
    m = make_manifest(codec, num_samples=3, num_tokens=8)
    write_manifest(tmp_path, m)
    (tmp_path / COMMITS_DIR).mkdir()
    ids, masks = rows()
    packed = HostBatch.pack(ids, masks, np.array([7, 2, 9]))
    features = bf16_features(8, m.feature_width)
    encoded = get_codec(codec).encode(features, m.n_layers)
    planned = PlannedBatch(unit=2, batch=5, bucket=1, rows=packed.sample_ids, lengths=packed.lengths.astype(np.int32))
    rec = commit_segment(tmp_path, planned, packed, encoded, specs=get_codec(codec).arrays(m.n_layers, m.hidden_size),
                         rank=3)
    reader = CacheReader(tmp_path)
    back, stored = reader.read_batch(rec.name)
    assert_same(back, packed)
    assert stored.keys() == encoded.keys()
    for key, arr in stored.items():
        assert np.array_equal(arr.view(np.int16) if arr.dtype == np.uint16 else arr, encoded[key].numpy()), key
    decoded = reader.decode_features(stored)
    assert torch.equal(decoded, get_codec(codec).decode(encoded, m.n_layers))
    if get_codec(codec).lossless:
        assert torch.equal(decoded.view(torch.int16), features.view(torch.int16))
