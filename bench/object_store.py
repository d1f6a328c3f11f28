"""Reading a cache from object storage against reading it from the local disk, side by side.

A synthetic cache (Qwen3-8B-shaped features: 5 layers x 4096, random values, the given codec) is
written to --out, copied under an S3 prefix, then read whole through `CacheReader` from each place
by --threads threads, one segment per task (as phase 2's reader threads do): every array fetched,
decompressed and checksummed. Reports MB/s of stored bytes and tokens/s, local first (page cache
dropped when the OS allows), then remote.

Without --url the S3 server is moto's, started on this machine: that measures the client path
(s3fs, HTTP, zarr's fsspec store) with a Python server behind it, not a cloud bucket. With --url
s3://bucket/prefix (credentials and AWS_ENDPOINT_URL from the environment) it measures that bucket.

    python bench/object_store.py [--tokens 40000] [--codec fp8] [--threads 4] [--url s3://b/p]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_common_args, start_logging_and_device  # noqa: E402
from bench.train import drop_page_cache, write_cache  # noqa: E402
from dflash_cache.store.reader import CacheReader  # noqa: E402


def read_all(spec: str, threads: int) -> tuple[float, int, int]:
    """(seconds, stored bytes, tokens) to read every segment of the cache at `spec`."""
    reader = CacheReader(spec)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda rec: reader.read_segment(rec.name), reader.records))
    return time.perf_counter() - t0, reader.bytes_on_disk(), reader.num_tokens


def start_moto() -> object:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    os.environ["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=40_000, help="tokens in the synthetic cache")
    ap.add_argument("--codec", default="fp8")
    ap.add_argument("--threads", type=int, default=4, help="reader threads (train --read-threads)")
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
               "upload_s": upload, "runs": {}}
    for name, spec in (("local disk", str(local)), ("S3", url)):
        dropped = drop_page_cache() if name == "local disk" else None
        sec, stored, tokens = read_all(spec, args.threads)
        results["runs"][name] = {"seconds": sec, "MB_s": stored / sec / 1e6, "tok_s": tokens / sec,
                                 "stored_bytes": stored, "page_cache_dropped": dropped}
        print(f"{name}: {stored / 1e6:,.0f} MB, {tokens:,} tokens in {sec:.2f}s: {stored / sec / 1e6:,.0f} MB/s, "
              f"{tokens / sec:,.0f} tok/s" + ("" if dropped is None else f" (page cache dropped: {dropped})"),
              flush=True)
    print(f"upload {upload:.1f}s; S3 / local read rate: "
          f"{results['runs']['S3']['MB_s'] / results['runs']['local disk']['MB_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
