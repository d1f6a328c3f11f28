"""Where a cache is read from: a local directory, or a prefix on object storage.

`CacheReader` reads everything through one of these, so training and `inspect` read a cache in an
S3 bucket (or anything else fsspec opens: `s3://`, `gs://`, `az://`, ...) the way they read one on
disk, with the same checks of records, file lists and array metadata. Locally the files are
opened with the store's care (nothing outside the root, regular files only); an object store has
no links to follow, so a key under the prefix is all there is to check.

These are the reading side; `dflash_cache.store.destination` extends them with what extraction
writes (`extract --out s3://...`). Repair and the live tee's `--write-cache` need a local
directory. Credentials and endpoints come from the usual environment (for S3: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an S3-compatible server, AWS_MAX_ATTEMPTS for how
often botocore tries a request), as fsspec's filesystems read them. A request that fails (an
endpoint that does not answer, no credentials, a refusal) is one line naming the URL and what to
check, whichever method made it.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import pyarrow as pa
import pyarrow.parquet as pq
from zarr.storage import LocalStore

from dflash_cache.errors import CacheCorruptError, UserError, one_line
from dflash_cache.files import inside, open_regular, read_json
from dflash_cache.store.layout import (
    COMMITS_DIR,
    MANIFEST_FILE,
    check_segment_name,
    record_path,
    record_segment,
    segment_dir,
    segment_rel,
)
from dflash_cache.store.manifest import Manifest, read_manifest
from dflash_cache.store.segments import (
    MAX_ARRAY_META_BYTES,
    MAX_RECORD_BYTES,
    MAX_SEGMENT_FILES,
    Found,
    SegmentRecord,
    committed_names,
    committed_segments,
    read_records,
    records_from,
    segment_files,
)


def is_url(spec: str | Path) -> TypeGuard[str]:
    """A cache given as a URL (`scheme://...`) rather than a local path (a URL is always a str)."""
    return isinstance(spec, str) and "://" in spec


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a failed request to object storage raises: fsspec's OSErrors, and botocore's own that
    s3fs lets through (an endpoint that does not answer, missing credentials)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return (OSError,)
    return (OSError, BotoCoreError, ClientError)


def _no_credentials(exc: BaseException) -> bool:
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError
    except ImportError:
        return False
    return isinstance(exc, NoCredentialsError | PartialCredentialsError)


def storage_error(url: str, exc: BaseException, doing: str = "write") -> UserError:
    """One line for a request that failed while `doing` ("read", "write") the cache at `url`: the
    storage's reason and what to check."""
    if _no_credentials(exc):
        return UserError(f"cannot {doing} the cache at {url}: no credentials for the storage ({one_line(exc)}); "
                         "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE for a profile in "
                         "~/.aws/credentials), then run the same command again")
    return UserError(f"cannot {doing} the cache at {url}: {one_line(exc)}; check the URL (its bucket must exist), "
                     "the credentials (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and the endpoint "
                     "(AWS_ENDPOINT_URL), then run the same command again")


def _guarded(method: Callable) -> Callable:
    """A RemoteCache method whose failed requests are one line (`RemoteCache.guard`)."""
    @functools.wraps(method)
    def wrapper(self: RemoteCache, *args: Any, **kwargs: Any) -> Any:
        with self.guard():
            return method(self, *args, **kwargs)
    return wrapper


def open_location(spec: str | Path | Location) -> Location:
    """Where the cache `spec` (a directory, a URL, or a location already) is read from."""
    if isinstance(spec, LocalCache | RemoteCache):
        return spec
    return RemoteCache(spec) if is_url(spec) else LocalCache(Path(spec))


@dataclass
class LocalCache:
    """A cache directory on this machine."""

    root: Path

    def __str__(self) -> str:
        return str(self.root)

    def guard(self) -> AbstractContextManager[None]:
        """Local reads make no request: their errors keep their type (see `RemoteCache.guard`)."""
        return nullcontext()

    def exists(self) -> bool:
        """Whether the directory is there; UserError when something else is in its place (a file
        would otherwise read as 'does not exist', which sends the user looking for a typo)."""
        if self.root.exists() and not self.root.is_dir():
            what = "a file" if self.root.is_file() else "not a directory"
            raise UserError(f"{self.root} is {what}, not a cache directory; pass the directory extract made "
                            f"(the one holding {MANIFEST_FILE})")
        return self.root.is_dir()

    def manifest(self) -> Manifest:
        return read_manifest(self.root)

    def records(self) -> list[SegmentRecord]:
        return read_records(self.root)

    def committed_names(self) -> list[str]:
        return committed_names(self.root)

    def size(self, name: str) -> int | None:
        """Bytes of a file at the root, or None if there is none."""
        path = self.root / name
        return path.stat().st_size if path.is_file() else None

    def parquet(self, name: str, max_bytes: int, read: Callable[[Any], Any] = pq.read_table) -> Any:
        """A Parquet file at the root, as `read` decodes it (None if absent): inside the root, a
        regular file, at most `max_bytes`; raises CacheCorruptError (outside), OSError, ValueError
        or ArrowException."""
        path = self.root / name
        if not os.path.lexists(path):  # a link out of the root is refused below, not skipped
            return None
        inside(self.root, path)
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise ValueError(f"{size} bytes, more than the {max_bytes} expected")
            return read(f)

    def segment_files(self, name: str) -> tuple[Found, list[str]]:
        return segment_files(self.root, name)

    def segment_metas(self, name: str, sizes: dict[str, int | None]) -> Callable[[str], Any]:
        """A reader of the segment's JSON files `sizes` names (each read when asked: a local read
        costs no round trip)."""
        return lambda rel: read_json(segment_dir(self.root, name) / rel, max_bytes=MAX_ARRAY_META_BYTES)

    def zarr_store(self, name: str) -> LocalStore:
        return LocalStore(segment_dir(self.root, name), read_only=True)

    def segment_tails(self, name: str) -> Callable[[str, int, int], bytes]:
        """A reader of the last `nbytes` of a segment's file `rel` of `size` bytes (shard indexes)."""
        def tail(rel: str, nbytes: int, size: int) -> bytes:
            with open_regular(segment_dir(self.root, name) / rel) as f:
                f.seek(max(0, size - nbytes))
                return f.read(nbytes)
        return tail

    def commit_stamp(self, name: str) -> tuple[int, int, int] | None:
        """(inode, modification time, size) of a segment's commit record, None if it has none: what
        changes when the cache is made again under a reader."""
        try:
            st = os.stat(record_path(self.root, name))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size


class RemoteCache:
    """A cache under a URL prefix, read through fsspec (and zarr's fsspec store for the arrays).
    Its methods that make requests are `_guarded`: a failed one is a UserError naming the URL."""

    doing = "read"  # what a failed request was doing, for its one-line error

    def __init__(self, url: str) -> None:
        try:
            import fsspec

            self.fs, self.path = fsspec.url_to_fs(url)
        except ImportError as e:  # fsspec knows the scheme but its package (s3fs, gcsfs, ...) is missing
            raise UserError(f"cache {url}: {e}; install the package for that storage (for S3: "
                            "pip install 'dflash-cache[s3]')") from None
        except ValueError as e:
            raise UserError(f"cache {url}: {e}") from None
        self.url = url.rstrip("/")
        self.path = self.path.rstrip("/")
        self.errors = storage_errors()

    def __str__(self) -> str:
        return self.url

    @contextmanager
    def guard(self) -> Iterator[None]:
        """A failed request becomes one line naming the URL and what to check."""
        try:
            yield
        except self.errors as e:
            raise storage_error(self.url, e, self.doing) from None

    def _key(self, rel: str) -> str:
        return f"{self.path}/{rel}"

    def _key_in(self, folder: str, rel: str) -> str:
        return self._key(f"{folder}/{rel}")

    def _read(self, rel: str, max_bytes: int) -> bytes:
        size = self.fs.size(self._key(rel))
        if size is not None and size > max_bytes:
            raise ValueError(f"{rel} is {size} bytes, more than the {max_bytes} it may hold")
        return self.fs.cat_file(self._key(rel))

    def _json(self, rel: str, max_bytes: int) -> Any:
        try:
            return json.loads(self._read(rel, max_bytes))
        except RecursionError:
            raise ValueError(f"{rel} is nested too deeply to be a valid record") from None

    def _json_files(self, keys: dict[str, int | None], max_bytes: int) -> Callable[[str], Any]:
        """JSON objects fetched all at once by concurrent requests, those over `max_bytes` (as the
        listing's size says) left out; `keys` maps each key to its size. The loader returned parses
        one by key, raising ValueError (too big, not JSON) or OSError (the object is gone): damage
        its callers name. Its request failing otherwise is the storage's one line, as in `guard`
        (the loader runs outside it)."""
        wanted = [k for k, size in keys.items() if (size or 0) <= max_bytes]
        fetched = self.fs.cat(wanted, on_error="return") if wanted else {}

        def load(key: str) -> Any:
            if (keys[key] or 0) > max_bytes:
                raise ValueError(f"{keys[key]} bytes, more than the {max_bytes} it may hold")
            data = fetched.get(key)
            if data is None or isinstance(data, FileNotFoundError):
                raise OSError(str(data) if data is not None else "missing")
            if isinstance(data, BaseException):
                with self.guard():
                    raise data
            try:
                return json.loads(data)
            except RecursionError:
                raise ValueError("nested too deeply to be valid") from None

        return load

    @_guarded
    def exists(self) -> bool:
        return self.fs.exists(self._key(MANIFEST_FILE)) or self.fs.isdir(self.path)

    @_guarded
    def manifest(self) -> Manifest:
        if not self.fs.exists(self._key(MANIFEST_FILE)):
            raise CacheCorruptError(f"{self.url} is not a dflash-cache (no {MANIFEST_FILE}); check the URL")
        try:
            obj = self._json(MANIFEST_FILE, 1 << 20)
        except (ValueError, OSError) as e:
            raise CacheCorruptError(f"{self.url}/{MANIFEST_FILE} is unreadable ({e})") from None
        return Manifest.from_json(obj)

    @_guarded
    def records(self) -> list[SegmentRecord]:
        """One listing, then every record fetched by concurrent requests: a cache of tens of
        thousands of segments would otherwise take a round trip per record to open."""
        try:
            listing = self.fs.ls(self._key(COMMITS_DIR), detail=True)
        except FileNotFoundError:
            return []
        sizes = {entry["name"].rsplit("/", 1)[-1]: entry.get("size") for entry in listing}
        key = functools.partial(self._key_in, COMMITS_DIR)
        load = self._json_files({key(n): size for n, size in sizes.items() if record_segment(n)}, MAX_RECORD_BYTES)
        return records_from(sizes, lambda name: load(key(name)))

    @_guarded
    def committed_names(self) -> list[str]:
        """The committed segments' names, sorted, from one listing (no record is fetched)."""
        try:
            listing = self.fs.ls(self._key(COMMITS_DIR), detail=False)
        except FileNotFoundError:
            return []
        return committed_segments(str(entry).rsplit("/", 1)[-1] for entry in listing)

    @_guarded
    def size(self, name: str) -> int | None:
        try:
            return self.fs.size(self._key(name))
        except FileNotFoundError:
            return None

    def parquet(self, name: str, max_bytes: int, read: Callable[[Any], Any] = pq.read_table) -> Any:
        # Only the fetch is a request: a damaged file (pyarrow's OSError) is the caller's to name, not
        # a storage failure.
        data = self._fetch_if_there(name, max_bytes)
        return None if data is None else read(pa.BufferReader(data))

    @_guarded
    def _fetch_if_there(self, name: str, max_bytes: int) -> bytes | None:
        return self._read(name, max_bytes) if self.fs.exists(self._key(name)) else None

    @_guarded
    def segment_files(self, name: str) -> tuple[Found, list[str]]:
        """Every key under the segment's prefix with its size (an object store has no links)."""
        prefix = self._key(segment_rel(check_segment_name(name)))
        try:
            listing = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return {}, []
        found: Found = {k[len(prefix) + 1:]: int(v["size"]) for k, v in listing.items() if v.get("type") != "directory"}
        if len(found) > MAX_SEGMENT_FILES:
            return found, [f"more than {MAX_SEGMENT_FILES} files"]
        return found, []

    @_guarded
    def segment_metas(self, name: str, sizes: dict[str, int | None]) -> Callable[[str], Any]:
        """A reader of the segment's JSON files `sizes` names (rel -> size from its listing), all
        fetched at once by concurrent requests: one round trip per segment, not two per array."""
        key = functools.partial(self._key_in, segment_rel(name))
        load = self._json_files({key(rel): size for rel, size in sizes.items()}, MAX_ARRAY_META_BYTES)
        return lambda rel: load(key(rel))

    @_guarded
    def fetch_segment(self, name: str, files: dict[str, int]) -> dict[str, bytes]:
        """Every file a segment's record lists, fetched by concurrent requests (one round trip's
        latency for the whole segment, where zarr would ask for each shard's index, then its chunks);
        CacheCorruptError for a missing object or one of another size than the record says. A request
        that failed otherwise (a timeout, a refusal, a server error) says nothing about the cache: it
        is the storage's one line (`storage_error`), so that verify does not call a sound segment
        damaged and training does not read on without it."""
        prefix = self._key(segment_rel(check_segment_name(name)))
        keys = {f"{prefix}/{rel}": rel for rel in files}
        fetched = self.fs.cat(list(keys), on_error="return") if keys else {}
        blobs: dict[str, bytes] = {}
        for key, rel in keys.items():
            data = fetched.get(key)
            if data is None or isinstance(data, FileNotFoundError):
                raise CacheCorruptError(f"segment {name}: {rel} cannot be read ({data or 'missing'}); copy the cache "
                                        "again or re-run extract")
            if isinstance(data, BaseException):
                raise data  # a failed request: `guard` makes it the storage's one line (anything else is a bug)
            if len(data) != files[rel]:
                raise CacheCorruptError(f"segment {name}: {rel} is {len(data)} bytes, its record says {files[rel]}")
            blobs[rel] = data
        return blobs

    def zarr_store(self, name: str):
        return self._zarr(segment_rel(name), read_only=True)

    def segment_tails(self, name: str) -> None:
        """None: a remote segment's shard indexes are checked on the fetched objects
        (`CacheReader.read_segment`), not by a request per shard first."""
        return None

    def commit_stamp(self, name: str) -> None:
        """Not watched on object storage: a reader there sees the objects as they were fetched."""
        return None

    def _zarr(self, rel: str, *, read_only: bool):
        """zarr's store for the prefix `rel` ("" for the cache's own), on this filesystem's options."""
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(f"{self.url}/{rel}".rstrip("/"), read_only=read_only,
                                    storage_options=getattr(self.fs, "storage_options", None) or None)


Location = LocalCache | RemoteCache
