"""Writing a cache: creating or reopening it, committing segments, finishing it.

The one writer of the store, for `dflash-cache extract` and the live tee alike. It takes
store-level inputs only: a Manifest and a Plan to make a cache by, a planned batch's packed host
form and its encoded features to commit. The caller holds the cache lock. The cache is a local
directory or a URL prefix on object storage: this module says what is written in which order, its
destination (`dflash_cache.store.destination`) how a file becomes visible there.

An existing cache is reopened only if its manifest matches field by field; otherwise it is
refused unless `overwrite`. A new cache's manifest is written last: until then a local cache
carries its `.creating` marker (`dflash_cache.store.repair`), and a remote one holds our entries
without a manifest; either way a creation killed or refused a disk is recognised and made again by
the next run, and a failed creation removes what it wrote. Crash leftovers (segments without a
commit) are removed when a cache is opened.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import zarr
from zarr.storage import LocalStore

from dflash_cache.errors import UserError
from dflash_cache.files import check_regular, list_files
from dflash_cache.store.batch import HostBatch
from dflash_cache.store.codecs import ArraySpec, to_stored_numpy, token_spec
from dflash_cache.store.destination import Destination, disk_error, open_destination
from dflash_cache.store.layout import (
    COMMITS_DIR,
    INDEX_FILE,
    MANIFEST_FILE,
    SEGMENTS_DIR,
    SEGMENTS_GROUP_META,
    ZARR_JSON,
    segment_name,
)
from dflash_cache.store.location import LocalCache
from dflash_cache.store.manifest import Manifest, mismatches, write_manifest
from dflash_cache.store.plan import Plan, PlannedBatch, write_plan_table
from dflash_cache.store.reader import index_table
from dflash_cache.store.segments import SegmentRecord, write_array

__all__ = ["Out", "check_matches", "commit_segment", "disk_error", "finish_cache", "list_files", "open_or_create",
           "write_segment"]
log = logging.getLogger(__name__)
Out = Path | str | Destination  # a cache directory, a URL, or where either is written


# --- creating or reopening --------------------------------------------------------------------

def open_or_create(root: Out, manifest: Manifest, plan: Plan, *, overwrite: bool = False,
                   owned: Callable[[str], bool] | None = None, created_by: str | None = None) -> set[str]:
    """Create the cache, or reopen a matching one; returns the committed segment names.

    A half-made cache (killed or refused a disk while being created) holds no committed segment,
    so it is made again from the start, with or without `overwrite`. When several runs share one
    cache (`extract --copy`): `owned` says which segments' leftovers this run may remove (the
    others may be being written), and with `created_by` (who creates it, for the message) this
    run only reopens: the cache must exist."""
    dest = open_destination(root)
    with dest.guard():
        is_cache = dest.has(MANIFEST_FILE)
        if created_by is not None and not is_cache:
            raise UserError(f"--out {dest} holds no cache yet: {created_by} creates it; start that one first, "
                            "then this one")
        if is_cache and not overwrite:
            check_matches(dest, manifest)
            _reopen(dest)
        elif is_cache or dest.is_half_made() or not dest.foreign_entries():
            if dest.is_half_made():
                log.info("%s: its creation was interrupted; making it again", dest)
            _create(dest, plan, manifest)
        else:
            raise UserError(f"--out {dest} exists and is not a dflash-cache; choose an empty or new {dest.kind}")
        committed = {r.name for r in dest.records()}
        removed = dest.remove_uncommitted(committed, owned)
    if removed:
        log.info("removed %d uncommitted segment(s) left by an interrupted run", removed)
    return committed


def check_matches(root: Out, wanted: Manifest) -> None:
    """UserError unless the cache at `root` was made as `wanted` says (read-only: a dry run asks too)."""
    dest = open_destination(root)
    diff = mismatches(dest.manifest(), wanted)
    if diff:
        shown = "; ".join(f"{field}: cache has {old!r}, this run has {new!r}" for field, old, new in diff[:3])
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise UserError(
            f"cache {dest} was made differently: {shown}{more}; pass --overwrite to start over "
            "or choose another --out"
        )


def _create(dest: Destination, plan: Plan, manifest: Manifest) -> None:
    """Make a new cache: its files are written into the directory the destination gives, the
    manifest last (a remote destination uploads them when the block ends, the manifest last too)."""
    with dest.creating() as root:
        group = zarr.create_group(store=LocalStore(root), attributes={"dflash_cache": f"see {MANIFEST_FILE}"})
        _segments_group(group)
        (root / COMMITS_DIR).mkdir()
        write_plan_table(root, plan)
        write_manifest(root, manifest)  # its presence marks a usable cache


def _segments_group(root_group: zarr.Group) -> None:
    """`segments/` as a zarr group, so zarr tools walking the hierarchy reach every segment."""
    root_group.create_group(SEGMENTS_DIR, attributes={"dflash_cache": "one group per segment; only those with a "
                                                      f"record in {COMMITS_DIR}/ are committed"})


def _reopen(dest: Destination) -> None:
    """Tidy a matching cache: a marker left by a kill just after the manifest was written, and the
    segments group that caches made before it existed lack. The groups' zarr.json files are zarr's
    to open, so a local one that is not a regular file (a FIFO: zarr would wait on it forever) is
    refused first."""
    if isinstance(dest, LocalCache):
        for rel in (ZARR_JSON, SEGMENTS_GROUP_META):
            check_regular(dest.root, rel)
    dest.reopen()
    if not dest.has(SEGMENTS_GROUP_META):
        _segments_group(zarr.open_group(store=dest.zarr_root(), mode="r+"))


# --- committing a segment ---------------------------------------------------------------------

def commit_segment(root: Out, planned: PlannedBatch, packed: HostBatch, features: Mapping[str, torch.Tensor],
                   *, specs: Mapping[str, ArraySpec], rank: int) -> SegmentRecord:
    """Write planned batch `planned` as its segment: the packed batch's token arrays and the
    codec's encoded `features` (host tensors, as `FeatureCodec.encode` makes them), durable (or
    uploaded) before its record, which is written atomically."""
    dest = open_destination(root)
    name = segment_name(planned.unit, planned.batch)
    with dest.guard():
        files = dest.put_segment(name, functools.partial(write_segment, packed=packed, features=features, specs=specs))
        record = SegmentRecord(
            name=name, unit=planned.unit, batch=planned.batch, bucket=planned.bucket, rank=rank,
            num_tokens=packed.num_tokens, sample_ids=tuple(int(i) for i in packed.sample_ids),
            lengths=tuple(int(n) for n in packed.lengths), supervised=tuple(int(s) for s in packed.supervised()),
            files=files,
        )
        record.check(name)
        dest.put_record(record)
    return record


def write_segment(directory: Path, *, packed: HostBatch, features: Mapping[str, torch.Tensor],
                  specs: Mapping[str, ArraySpec]) -> dict[str, int]:
    """A segment's zarr group in `directory` (new or empty): the token arrays and the encoded
    features, one shard file per SHARD_BYTES; returns every file written with its size."""
    store = LocalStore(directory)
    zarr.create_group(store=store)
    for key, arr in packed.stored().items():
        write_array(store, key, arr, token_spec(key).compressors)
    for key, arr in to_stored_numpy(dict(features)).items():
        write_array(store, key, arr, specs[key].compressors)
    return list_files(directory)


# --- finishing ----------------------------------------------------------------------------------

MAX_INDEX_WRITES = 8


def finish_cache(root: Out, echo: Callable[[str], None], seconds: float) -> None:
    """Rewrite the index from the commits and report how complete the cache is.

    Other runs (`--copy`) may commit while this one writes the index. So the commits are listed
    again after each write (names only: one listing, no record read), until a write covers what
    the listing after it finds: whichever run writes last then wrote every commit made before its
    last listing, and each run's own commits were all made before its first."""
    dest = open_destination(root)
    with dest.guard():
        records = dest.records()
        for attempt in range(MAX_INDEX_WRITES):  # bounded: the run committing last writes an index too
            try:
                dest.put_parquet(INDEX_FILE, index_table(records))
            except OSError as e:  # a full disk: the old index (or none) stays, and the commits are whole
                raise disk_error(str(dest), e) from None
            if attempt + 1 == MAX_INDEX_WRITES or dest.committed_names() == [r.name for r in records]:
                break
            records = dest.records()
        manifest = dest.manifest()
    tokens = sum(r.num_tokens for r in records)
    done = len(records) == manifest.plan.num_segments
    echo(f"{'complete' if done else 'INCOMPLETE'}: {len(records)}/{manifest.plan.num_segments} segments, "
         f"{tokens:,} tokens committed; this run took {seconds:.1f}s")
