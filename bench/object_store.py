"""A cache on object storage against one on the local disk, side by side: reading and writing.

A synthetic cache (Qwen3-8B-shaped features: 5 layers x 4096, random values, the given codec) is
written to --out, copied under an S3 prefix, then read whole through `CacheReader` from each place
by --threads threads, one segment per task (as phase 2's reader threads do): every array fetched,
decompressed and checksummed. Then the same segments are written again through the store's writer
(`commit_segment` by --threads threads, as extract's writer threads do, then `finish_cache`) into a
new cache in each place: compressed, written and fsynced locally; compressed, staged, uploaded
and committed by one PUT remotely. Reports MB/s of stored bytes and tokens/s, local first (page
cache dropped before reading when the OS allows), then remote.

Without --url the S3 server is moto's, started on this machine: that measures the client path
(s3fs, HTTP; a segment fetched whole by concurrent requests) with a Python server behind it, not a cloud bucket. With --url
s3://bucket/prefix (credentials and AWS_ENDPOINT_URL from the environment) it measures that bucket.

    python3 -m bench.object_store [--tokens 40000] [--codec fp8] [--threads 4] [--url s3://b/p]

With --url, the written copies go to the prefix's sibling `<prefix>-written` (replaced).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from bench.common import add_common_args, start_logging_and_device
from bench.train import drop_page_cache, write_cache
from dflash_cache.store.codecs import numpy_to_torch
from dflash_cache.store.plan import Plan, PlanConfig, PlannedBatch
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.writer import commit_segment, finish_cache, open_or_create

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer


def read_all(spec: str, threads: int) -> tuple[float, int, int]:
    """(seconds, stored bytes, tokens) to read every segment of the cache at `spec`."""
    reader = CacheReader(spec)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda rec: reader.read_segment(rec.name), reader.records))
    return time.perf_counter() - t0, reader.bytes_on_disk(), reader.num_tokens


def segments_of(reader: CacheReader) -> tuple[Plan, list[tuple]]:
    """The cache's plan (one planned batch per record) and each segment as the writer takes it:
    (planned batch, packed batch, encoded features as host tensors), read into memory."""
    batches, todo = [], []
    for rec in reader.records:
        packed, stored = reader.read_batch(rec.name)
        planned = PlannedBatch(unit=rec.unit, batch=rec.batch, bucket=rec.bucket,
                               rows=np.asarray(rec.sample_ids, np.int64), lengths=np.asarray(rec.lengths, np.int32))
        batches.append(planned)
        todo.append((planned, packed, {k: numpy_to_torch(k, v) for k, v in stored.items()}))
    p = reader.manifest.plan
    config = PlanConfig(token_budget=p.token_budget, max_rows=p.max_rows, unit_rows=p.unit_rows,
                        bucket_bounds=tuple(p.bucket_bounds))
    return Plan(config=config, num_rows=p.num_rows, batches=tuple(batches)), todo


def write_all(spec: str, source: CacheReader, plan: Plan, todo: list[tuple], threads: int) -> tuple[float, int, int]:
    """(seconds, stored bytes, tokens) to commit every segment of `todo` into a new cache at
    `spec` (made by `source`'s manifest) and finish it."""
    specs = source.codec.arrays(source.manifest.n_layers, source.manifest.hidden_size)
    open_or_create(spec, source.manifest, plan, overwrite=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda item: commit_segment(spec, *item, specs=specs, rank=0), todo))
    finish_cache(spec, lambda _: None, 0.0)
    sec = time.perf_counter() - t0
    written = CacheReader(spec)
    return sec, written.bytes_on_disk(), written.num_tokens


def report(name: str, sec: float, stored: int, tokens: int, **extra: object) -> dict:
    """Print one run's rates; returns them (and `extra`) for the JSON."""
    print(f"{name}: {stored / 1e6:,.0f} MB, {tokens:,} tokens in {sec:.2f}s: {stored / sec / 1e6:,.0f} MB/s, "
          f"{tokens / sec:,.0f} tok/s" + "".join(f" ({k}: {v})" for k, v in extra.items() if v is not None), flush=True)
    return {"seconds": sec, "MB_s": stored / sec / 1e6, "tok_s": tokens / sec, "stored_bytes": stored, **extra}


def start_moto() -> ThreadedMotoServer:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the server's line per request costs it time
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    os.environ["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
    return server


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=40_000, help="tokens in the synthetic cache")
    ap.add_argument("--codec", default="fp8")
    ap.add_argument("--threads", type=int, default=4, help="reader threads (train --read-threads) and writer threads (extract --writers)")
    ap.add_argument("--url", default=None, help="an S3 prefix to copy the cache under (default: a local moto server)")
    add_common_args(ap, "/tmp/dflash-bench-object-store")
    args = ap.parse_args()
    start_logging_and_device()
    hidden = 128 if args.small else 4096
    local = Path(args.out) / "cache"
    t0 = time.perf_counter()
    write_cache(local, args.codec, tokens=args.tokens, seq=1024, hidden=hidden, vocab=151936, device=torch.device("cpu"))
    print(f"wrote the cache in {time.perf_counter() - t0:.1f}s", flush=True)
    server = None if args.url else start_moto()
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    url = args.url or "s3://bench/cache"
    prefix = url.removeprefix("s3://").rstrip("/")
    if args.url is None:
        fs.mkdir(prefix.split("/")[0])
    t0 = time.perf_counter()
    fs.put(str(local) + "/", prefix + "/", recursive=True)
    upload = time.perf_counter() - t0
    results = {"codec": args.codec, "threads": args.threads, "server": "moto on this machine" if server else url,
               "upload_s": upload, "runs": {}, "write_runs": {}}
    for name, spec in (("local disk", str(local)), ("S3", url)):
        dropped = drop_page_cache() if name == "local disk" else None
        sec, stored, tokens = read_all(spec, args.threads)
        results["runs"][name] = report(f"read from {name}", sec, stored, tokens, page_cache_dropped=dropped)
    source = CacheReader(local)
    plan, todo = segments_of(source)
    for name, spec in (("local disk", str(Path(args.out) / "written")), ("S3", f"{url}-written")):
        results["write_runs"][name] = report(f"write to {name}", *write_all(spec, source, plan, todo, args.threads))
    ratio = {kind: results[kind]["S3"]["MB_s"] / results[kind]["local disk"]["MB_s"] for kind in ("runs", "write_runs")}
    print(f"upload {upload:.1f}s; S3 / local rate: read {ratio['runs']:.2f}, write {ratio['write_runs']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
