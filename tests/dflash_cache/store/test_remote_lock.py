"""`RemoteLock` races on a real S3-compatible server (moto's, over HTTP through s3fs): of two runs
that take over one expired lock at the same moment exactly one wins, a renewal never clobbers a
run that took the lock over, and a store without conditional writes falls back with a warning.
The races are interleaved deterministically by holding one run at its write while the other runs."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import threading
import time

import pytest

from dflash_cache.errors import UserError
from dflash_cache.store import remote_lock
from dflash_cache.store.layout import LOCK_FILE
from dflash_cache.store.remote_lock import RemoteLock

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = "locks"


@pytest.fixture(scope="module")
def bucket(s3_server):
    s3_server.mkdir(BUCKET)
    return s3_server


def expired_lock(fs, url: str) -> str:
    """Leave a lock at `url` as a killed run would: expired, its holder gone. Returns its key."""
    key = f"{url.removeprefix('s3://')}/{LOCK_FILE}"
    fs.pipe_file(key, json.dumps({"owner": "gone 1 abc", "expires": time.time() - 1}).encode())
    return key


def owner_of(fs, key: str) -> str:
    return json.loads(fs.cat_file(key))["owner"]


def around_writes_of(monkeypatch, lock: RemoteLock, before, after=lambda n: None) -> None:
    """Call before(n) and after(n) around the n-th write of `lock`'s object (0: the take): the write
    waits for `before` to return. The filesystem is shared by every lock on the bucket, so other
    runs' writes pass straight through."""
    fs, writes = lock.dest.fs, iter(range(1 << 30))
    pipe_file = fs.pipe_file

    def hooked(path: str, data: bytes, **kwargs):
        if path != lock.key or json.loads(data)["owner"] != lock.owner:
            return pipe_file(path, data, **kwargs)
        n = next(writes)
        before(n)
        try:
            return pipe_file(path, data, **kwargs)
        finally:
            after(n)

    monkeypatch.setattr(fs, "pipe_file", hooked)


def test_of_two_runs_taking_over_one_expired_lock_only_one_wins(bucket, monkeypatch):
    """A and B both read the expired lock; B takes it over before A writes. A's write names the
    version it read as expired, which is gone, so A is refused with the usual message naming B
    (before the writes were conditional, A overwrote B's lock, read back its own, and both wrote)."""
    url = f"s3://{BUCKET}/race"
    key = expired_lock(bucket, url)
    a, b = RemoteLock(url), RemoteLock(url)
    with contextlib.ExitStack() as b_holds:

        def b_takes_it_first(n: int) -> None:
            if n == 0:
                b_holds.enter_context(b)

        around_writes_of(monkeypatch, a, b_takes_it_first)
        with pytest.raises(UserError, match=rf"^cache {url} is being written by {b.owner} \(lock expires at "):
            with a:
                pass
        assert owner_of(bucket, key) == b.owner  # A's refusal left B's lock alone
    assert not bucket.exists(key)


def test_a_renewal_never_clobbers_a_run_that_took_over_the_expired_lock(bucket, monkeypatch, caplog):
    """A's heartbeat stalls at its first renewal until A's lock has expired; B takes it over; then
    A's renewal goes ahead. It names A's last write, which is gone, so B keeps the lock; A logs that
    it lost the lock, leaves B's alone, and its block fails when it ends (before, A's renewal
    overwrote B's lock and A's exit deleted it)."""
    url = f"s3://{BUCKET}/renew"
    key = f"{BUCKET}/renew/{LOCK_FILE}"
    a, b = RemoteLock(url, ttl=0.3), RemoteLock(url)
    renewing, taken, renewed = threading.Event(), threading.Event(), threading.Event()

    def stall(n: int) -> None:  # in A's heartbeat thread
        if n == 1:
            renewing.set()
            taken.wait(5)

    around_writes_of(monkeypatch, a, stall, lambda n: n == 1 and renewed.set())
    with caplog.at_level(logging.ERROR, logger=remote_lock.__name__), contextlib.ExitStack() as b_holds:
        with pytest.raises(UserError, match=rf"^the lock on {url} was taken over or deleted while this run wrote, "
                                            r".* `dflash-cache inspect --verify "), a:
            assert renewing.wait(5)
            time.sleep(max(0.0, json.loads(bucket.cat_file(key))["expires"] - time.time()) + 0.02)
            b_holds.enter_context(b)
            taken.set()
            assert renewed.wait(5)
            assert owner_of(bucket, key) == b.owner
            assert a.lost.wait(5)
        assert owner_of(bucket, key) == b.owner  # A's exit left B's lock alone
    assert not bucket.exists(key)
    assert [r.message for r in caplog.records if r.levelno == logging.ERROR] == [
        f"lost the lock on {url}: {b.owner} took it over after ours expired; another run may be writing this "
        "cache at the same time"]


def test_a_deleted_lock_is_noticed_as_lost(bucket, caplog):
    """Someone deletes the held lock: the next renewal notices and logs it, and the block fails."""
    url = f"s3://{BUCKET}/deleted"
    with caplog.at_level(logging.ERROR, logger=remote_lock.__name__):
        with pytest.raises(UserError, match="was taken over or deleted"), RemoteLock(url, ttl=0.15) as lock:
            bucket.rm_file(lock.key)
            assert lock.lost.wait(5)
    assert "its object was deleted" in caplog.text
    assert not bucket.exists(lock.key)


def test_a_store_that_refuses_conditional_writes_gets_the_best_effort_lock_and_one_warning(
        bucket, monkeypatch, caplog):
    """An S3-compatible store answering NotImplemented to If-Match: the expired lock is still taken
    over (overwritten and read back), renewed and released, with one warning."""
    url = f"s3://{BUCKET}/refusing"
    fs = RemoteLock(url).dest.fs
    pipe_file = fs.pipe_file

    def refusing(path: str, data: bytes, **kwargs):
        if "IfMatch" in kwargs:
            raise OSError(errno.ENOSYS, "NotImplemented")
        return pipe_file(path, data, **kwargs)

    monkeypatch.setattr(fs, "pipe_file", refusing)
    with caplog.at_level(logging.WARNING, logger=remote_lock.__name__):
        key = expired_lock(bucket, url)
        with RemoteLock(url, ttl=0.15) as lock:
            first = json.loads(bucket.cat_file(key))
            assert first["owner"] == lock.owner
            deadline = time.time() + 5  # the heartbeat renews it every ttl / 3
            while time.time() < deadline and json.loads(bucket.cat_file(key)) == first:
                time.sleep(0.01)
            assert json.loads(bucket.cat_file(key))["expires"] > first["expires"]
        assert not bucket.exists(key)
    warnings = [r.message for r in caplog.records if "best effort" in r.message]
    assert len(warnings) == 1 and "NotImplemented" in warnings[0], caplog.text


def test_a_store_without_conditional_writes_gets_the_best_effort_lock_and_one_warning(caplog):
    """fsspec's memory store (standing in for any store s3fs does not serve) takes an expired lock
    over by overwriting it and reading it back, and says once that this is best effort."""
    fsspec = pytest.importorskip("fsspec")
    url = "memory://dflash-cache-locks/plain"
    fs, path = fsspec.url_to_fs(url)
    with caplog.at_level(logging.WARNING, logger=remote_lock.__name__):
        fs.pipe_file(f"{path}/{LOCK_FILE}", json.dumps({"owner": "gone 1 abc", "expires": 0}).encode())
        with RemoteLock(url) as lock:
            assert json.loads(fs.cat_file(lock.key))["owner"] == lock.owner
            with pytest.raises(UserError, match=f"is being written by {lock.owner}"), RemoteLock(url):
                pass
        assert not fs.exists(lock.key)
    warnings = [r.message for r in caplog.records if "best effort" in r.message]
    assert warnings == ["locks on memory://dflash-cache-locks/plain are best effort (the store has no conditional writes): two runs that "
                        "take over an expired lock at the same moment could both write the cache"]
