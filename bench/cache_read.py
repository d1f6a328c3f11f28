"""Phase 2's cache reading on the host, with and without the reader keeping decoded one-chunk arrays.

zarr decodes a whole chunk for any rows of it. A segment's token arrays (and, for narrow rows, every
array of a segment) are one chunk, so each sample read from such a segment decoded all of it again;
`CacheReader` now decodes a one-chunk array once and keeps it (`decoded_bytes`). This benchmark reads
the same batches through `CacheSource` (the trainer's reader threads and prefetch) from a cache of the
seeds' length mix, with the reader keeping them (the default) and keeping none, alternated, and reports
tokens/s and CPU time per 1,000 tokens (every thread of the process). It times the reader threads' work
(decoding the stored arrays, packing the batch in host memory), `--read-threads` batches at once, not
the features' dequantisation, which a GPU does on the device. The cache sits in the page cache after it
is written, so this is decompression and bookkeeping, not disk.

    python3 -m bench.cache_read                    # fp8, the 8B target's width (hidden 4096, 5 layers)
    python3 -m bench.cache_read --hidden 128       # the tiny target's width: whole segments are one chunk
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.train import write_cache
from dflash_cache.store.reader import DECODED_BYTES, CacheReader
from dflash_cache.train.cache_source import CacheSource
from dflash_cache.train.epoch_plan import Position, SourceConfig
from dflash_cache.train.place import Place

SETTINGS = {"kept": DECODED_BYTES, "none kept": 1}


def read_batches(root: Path, decoded_bytes: int, batches: int, config: SourceConfig) -> dict:
    """Wall and process CPU seconds for a fresh reader's threads to read the first `batches` batches
    of the epoch as `CacheSource` reads them, and their tokens."""
    source = CacheSource(CacheReader(root, decoded_bytes=decoded_bytes), config, Place(torch.device("cpu")))
    planned = [rows for _, rows in itertools.islice(source.planned(Position(0, 0), 1), batches)]
    wall, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(config.read_threads) as pool:
        reads = list(pool.map(source._read_host, planned))
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
            "tokens": sum(len(read.packed.input_ids) for read in reads)}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codec", default="fp8")
    ap.add_argument("--hidden", type=int, default=4096, help="the target's hidden size (5 layers are stored)")
    ap.add_argument("--tokens", type=int, default=200_000, help="tokens in the cache (seeds' length mix)")
    ap.add_argument("--batches", type=int, default=12, help="batches read per timed pass")
    ap.add_argument("--rounds", type=int, default=2, help="passes per setting, alternated")
    ap.add_argument("--read-threads", type=int, default=SourceConfig.read_threads, help="batches read at once")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    config = SourceConfig(read_threads=args.read_threads)
    with tempfile.TemporaryDirectory(prefix="cache-read-") as tmp:
        root = Path(tmp) / "cache"
        write_cache(root, args.codec, tokens=args.tokens, seq=8192, hidden=args.hidden, vocab=151936,
                    device=torch.device("cpu"), lengths="seeds")
        read_batches(root, DECODED_BYTES, 2, config)  # warm-up: imports, page cache
        runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
        for _ in range(args.rounds):
            for name, decoded_bytes in SETTINGS.items():
                runs[name].append(read_batches(root, decoded_bytes, args.batches, config))
    rows = {}
    for name, passes in runs.items():
        tokens = sum(p["tokens"] for p in passes)
        rows[name] = {"tok_per_s": tokens / sum(p["wall_s"] for p in passes),
                      "cpu_ms_per_1k_tokens": 1e6 * sum(p["cpu_s"] for p in passes) / tokens, "passes": passes}
        print(f"{name:>10}: {rows[name]['tok_per_s']:12,.0f} tok/s  {rows[name]['cpu_ms_per_1k_tokens']:8.2f} "
              f"CPU-ms per 1k tokens  ({tokens:,} tokens in {len(passes)} passes)")
    kept, none = rows["kept"], rows["none kept"]
    print(f"kept / none kept: {kept['tok_per_s'] / none['tok_per_s']:.2f}x tok/s, "
          f"{kept['cpu_ms_per_1k_tokens'] / none['cpu_ms_per_1k_tokens']:.2f}x CPU per token")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
