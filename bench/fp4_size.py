"""FP4 size study: what lossless coding can take off the fp4 codec's bytes/token, and at what speed.

Why: `--codec fp4` stored 10,624 bytes/token on an H200 (5 x 4096, random-weight Qwen3-8B shape);
the goal is <= 10,240. The e2m1 codes are 10,240 raw bytes of it, so the goal needs them
compressed. This measures, for the codes of `FP4_LAYOUT` without sign XOR and in one array
(`PLAIN_LAYOUT`, what fp4 stored before this study; sign XOR is one of the re-encodings below)
and of groups of 64 (lossy, for comparison):

* bytes/token as stored: each array written with `dflash_cache.store.segments.write_array` (the
  store's sharding, Blosc, CRC32C) into a zarr LocalStore, shard files summed (zarr.json left out);
* compress and decompress speed of the codes' Blosc chain (MB/s of raw bytes, chunk-sized calls,
  best of --repeat), single-threaded as zarr runs it and with Blosc's own threads;
* each candidate's order-0 entropy of the codes (what no byte-wise coder beats);

over re-encodings of the codes (each checked to decode bit for bit) and Blosc settings, on
(a) `codec_study_fp4.synthetic_features`, (b) the tiny target's real features of the first demo
rows and (c) random-weight Qwen3-8B-shaped hidden states of layers 1, 9, 17, 25, 33 (std 0.02
weights as transformers initialises them; built one layer at a time, ~90 s per 1,024 tokens on 2
CPU cores; `--qwen3-tokens 0` skips it).

    python3 -m bench.fp4_size [--tokens 1024] [--rows 16] [--qwen3-tokens 1024] [--codec-only] [--json PATH]

First, for each feature set, what `--codec fp4` stores (each array of `FP4_LAYOUT` as extraction
writes it); `--codec-only` stops there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numcodecs.blosc
import numpy as np
import torch
from numcodecs import Blosc
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.storage import LocalStore

from bench.codec_study_fp4 import N_LAYERS, add_feature_args, errors, feature_sets
from dflash_cache.store.codecs import to_stored_numpy
from dflash_cache.store.codecs.fp4 import (
    FP4_LAYOUT,
    Fp4Config,
    dequantize_fp4,
    fp4_arrays,
    pack_nibbles,
    quantize_fp4,
    unpack_nibbles,
    unxor_layer_signs,
    xor_layer_signs,
)
from dflash_cache.store.segments import chunk_rows, write_array
from dflash_cache.target.model import select_layers

QWEN3_SEQ = 512
PLAIN_LAYOUT = dataclasses.replace(FP4_LAYOUT, sign_xor=False, per_layer=False)  # what every re-encoding starts from
SHUFFLE_IDS = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}


# ----------------------------------------------------------------------------------------------
# features


def qwen3_features(tokens: int, seed: int = 0) -> torch.Tensor:
    """[T, 5*4096] bf16 hidden states after the 5 default layers of a random-weight Qwen3-8B-shaped
    stack (bench/extract.py's config, as its H200 run used), one decoder layer built, run and
    dropped at a time so it fits a small CPU machine.
    Embeddings are drawn directly (N(0, 0.02) rows, as a lookup of distinct random ids gives)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    from bench.extract import qwen3_8b_config

    cfg = qwen3_8b_config(small=False)
    cfg._attn_implementation = "sdpa"
    capture = select_layers(cfg.num_hidden_layers, N_LAYERS)
    std = cfg.initializer_range
    torch.manual_seed(seed)
    n_seq = max(1, tokens // QWEN3_SEQ)
    x = (torch.randn(n_seq, QWEN3_SEQ, cfg.hidden_size) * std).to(torch.bfloat16)
    pos = torch.arange(QWEN3_SEQ)[None]
    rope = tuple(p.to(torch.bfloat16) for p in Qwen3RotaryEmbedding(cfg)(x.float(), pos))
    out = []
    prev = torch.get_default_dtype()
    for i in range(max(capture) + 1):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = Qwen3DecoderLayer(cfg, i).eval()
        finally:
            torch.set_default_dtype(prev)
        with torch.no_grad():
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.normal_(0.0, std)
            x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope)
            x = x[0] if isinstance(x, tuple) else x
        if i in capture:
            out.append(x.reshape(n_seq * QWEN3_SEQ, -1).clone())
    return torch.cat(out, dim=1)


# ----------------------------------------------------------------------------------------------
# lossless re-encodings of the packed codes [T, L*H/2] (each a bijection, checked on every run)


def _ordinal(codes: np.ndarray) -> np.ndarray:
    """e2m1 code (sign << 3 | magnitude) -> rank 0..15 of its value (-6 .. -0, +0 .. +6)."""
    mag = codes & 7
    return np.where(codes >> 3 == 1, 7 - mag, 8 + mag).astype(np.uint8)


_CODE_OF_ORDINAL = np.array([(8 | (7 - o)) if o < 8 else o - 8 for o in range(16)], dtype=np.uint8)


def _nibbles(packed: np.ndarray, n_layers: int) -> np.ndarray:
    """Packed codes [T, W/2] -> codes [T, L, H]."""
    return unpack_nibbles(torch.from_numpy(packed)).numpy().reshape(packed.shape[0], n_layers, -1)


def _pack(codes: np.ndarray) -> np.ndarray:
    return pack_nibbles(torch.from_numpy(np.ascontiguousarray(codes.reshape(codes.shape[0], -1)))).numpy()


def as_stored(packed: np.ndarray, n_layers: int) -> dict[str, np.ndarray]:
    return {"codes": packed}


def from_stored(arrays: dict[str, np.ndarray], n_layers: int) -> np.ndarray:
    return arrays["codes"]


def swap_nibbles(packed: np.ndarray, n_layers: int) -> dict[str, np.ndarray]:
    """Element 2i in the high nibble instead: the same byte values permuted, so no gain expected."""
    return {"codes": (packed >> 4) | (packed << 4)}


def unswap_nibbles(arrays: dict[str, np.ndarray], n_layers: int) -> np.ndarray:
    return swap_nibbles(arrays["codes"], n_layers)["codes"]


def split_signs(packed: np.ndarray, n_layers: int) -> dict[str, np.ndarray]:
    """Sign bits packed 8 per byte apart from the magnitudes (two per byte): the random signs no
    longer hide the magnitudes' skew from zstd's literal coder."""
    c = _nibbles(packed, n_layers).reshape(packed.shape[0], -1)
    return {"signs": np.packbits(c >> 3, axis=1, bitorder="little"), "mags": _pack(c & 7)}


def join_signs(arrays: dict[str, np.ndarray], n_layers: int) -> np.ndarray:
    mags = arrays["mags"]
    signs = np.unpackbits(arrays["signs"], axis=1, bitorder="little")
    c = _nibbles(mags, n_layers).reshape(mags.shape[0], -1) | (signs << 3)
    return _pack(c)


def layer_sign_xor(packed: np.ndarray, n_layers: int) -> dict[str, np.ndarray]:
    """`Fp4Config.sign_xor`: each layer's sign XOR the previous captured layer's, same channel."""
    return {"codes": _pack(xor_layer_signs(torch.from_numpy(_nibbles(packed, n_layers))).numpy())}


def layer_sign_unxor(arrays: dict[str, np.ndarray], n_layers: int) -> np.ndarray:
    return _pack(unxor_layer_signs(torch.from_numpy(_nibbles(arrays["codes"], n_layers))).numpy())


def sign_agreement(packed: np.ndarray, n_layers: int) -> list[float]:
    """Share of channels whose code sign equals the previous captured layer's, per layer 1..L-1."""
    s = _nibbles(packed, n_layers) >> 3
    return [float((s[:, i] == s[:, i - 1]).mean()) for i in range(1, n_layers)]


def layer_delta(packed: np.ndarray, n_layers: int) -> dict[str, np.ndarray]:
    """Each layer's value rank minus the previous layer's, mod 16 (layer 0: its rank): sign and
    magnitude both carry over, so small deltas dominate."""
    o = _ordinal(_nibbles(packed, n_layers))
    d = o.copy()
    d[:, 1:] = (o[:, 1:] - o[:, :-1]) & 15
    return {"codes": _pack(d)}


def layer_undelta(arrays: dict[str, np.ndarray], n_layers: int) -> np.ndarray:
    o = np.cumsum(_nibbles(arrays["codes"], n_layers), axis=1, dtype=np.uint8) & 15  # prefix sum mod 16
    return _pack(_CODE_OF_ORDINAL[o])


def _closest_first() -> np.ndarray:
    """[16, 16]: rank of value rank v given the previous layer's value rank k, nearest to k first
    (k, k - 1, k + 1, k - 2, ...): a residual stream changes little from one captured layer to the
    next, so most codes land near their predecessor's and the ranks are small."""
    table = np.zeros((16, 16), dtype=np.uint8)
    for k in range(16):
        order = [k] + [v for d in range(1, 16) for v in (k - d, k + d) if 0 <= v < 16]
        table[k, order] = np.arange(16)
    return table


def _frequency_first(o: np.ndarray) -> np.ndarray:
    """[L, 16, 16]: per layer, rank of v given k by how often v follows k in these codes (ties:
    nearest first). A table a format would have to store per segment: the bound of what one buys."""
    closest = _closest_first()
    tables = np.zeros((o.shape[1], 16, 16), dtype=np.uint8)
    tables[0] = closest
    for layer in range(1, o.shape[1]):
        counts = np.zeros((16, 16), dtype=np.int64)
        np.add.at(counts, (o[:, layer - 1].ravel(), o[:, layer].ravel()), 1)
        for k in range(16):
            order = np.lexsort((closest[k], -counts[k]))
            tables[layer, k, order] = np.arange(16)
    return tables


def _rank_encode(o: np.ndarray, tables: np.ndarray) -> np.ndarray:
    out = o.copy()
    for layer in range(1, o.shape[1]):
        out[:, layer] = tables[layer][o[:, layer - 1], o[:, layer]]
    return out


def _rank_decode(r: np.ndarray, tables: np.ndarray) -> np.ndarray:
    inverse = np.argsort(tables, axis=-1).astype(np.uint8)  # [L, 16 (k), 16 (rank)] -> v
    o = r.copy()
    for layer in range(1, r.shape[1]):
        o[:, layer] = inverse[layer][o[:, layer - 1], r[:, layer]]
    return o


def layer_rank_closest(packed: np.ndarray, n_layers: int) -> dict[str, np.ndarray]:
    """Each layer's value rank as its rank among the values nearest the previous layer's (a fixed
    table, `_closest_first`): sign and magnitude both carried over, with no stored state."""
    o = _ordinal(_nibbles(packed, n_layers))
    return {"codes": _pack(_rank_encode(o, np.broadcast_to(_closest_first(), (n_layers, 16, 16))))}


def layer_unrank_closest(arrays: dict[str, np.ndarray], n_layers: int) -> np.ndarray:
    r = _nibbles(arrays["codes"], n_layers)
    return _pack(_CODE_OF_ORDINAL[_rank_decode(r, np.broadcast_to(_closest_first(), (n_layers, 16, 16)))])


def layer_rank_frequency(packed: np.ndarray, n_layers: int) -> dict[str, np.ndarray]:
    """As `layer_rank_closest` with per-layer tables from these codes' own transition counts (the
    tables, 16 x 16 nibbles per layer, are kept as an array of one row and counted in)."""
    o = _ordinal(_nibbles(packed, n_layers))
    tables = _frequency_first(o)
    return {"codes": _pack(_rank_encode(o, tables)), "tables": tables.reshape(1, -1)}


def layer_unrank_frequency(arrays: dict[str, np.ndarray], n_layers: int) -> np.ndarray:
    tables = arrays["tables"].reshape(n_layers, 16, 16)
    return _pack(_CODE_OF_ORDINAL[_rank_decode(_nibbles(arrays["codes"], n_layers), tables)])


@dataclass(frozen=True)
class Recoding:
    name: str
    encode: Callable[[np.ndarray, int], dict[str, np.ndarray]]
    decode: Callable[[dict[str, np.ndarray], int], np.ndarray]


RECODINGS = [
    Recoding("as stored", as_stored, from_stored),
    Recoding("nibbles swapped", swap_nibbles, unswap_nibbles),
    Recoding("signs split", split_signs, join_signs),
    Recoding("sign XOR prev layer", layer_sign_xor, layer_sign_unxor),
    Recoding("rank delta prev layer", layer_delta, layer_undelta),
    Recoding("rank nearest prev layer first", layer_rank_closest, layer_unrank_closest),
    Recoding("rank by prev layer's counts (table stored)", layer_rank_frequency, layer_unrank_frequency),
]
CHAINS: dict[str, BloscCodec] = {
    "zstd-1": BloscCodec(cname="zstd", clevel=1, shuffle="noshuffle", typesize=1),
    "zstd-1 bitshuffle": BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle", typesize=1),
    "zstd-3": BloscCodec(cname="zstd", clevel=3, shuffle="noshuffle", typesize=1),
    "zstd-5": BloscCodec(cname="zstd", clevel=5, shuffle="noshuffle", typesize=1),
    "zstd-9": BloscCodec(cname="zstd", clevel=9, shuffle="noshuffle", typesize=1),
    "zstd-1 1MiB blocks": BloscCodec(cname="zstd", clevel=1, shuffle="noshuffle", typesize=1, blocksize=1 << 20),
    "lz4-5": BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle", typesize=1),
    "lz4-5 bitshuffle": BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=1),
    "zlib-1": BloscCodec(cname="zlib", clevel=1, shuffle="noshuffle", typesize=1),
}
TODAY = ("as stored", "zstd-1")
# What every recoding is tried with (the rest only with "as stored" and the best recodings).
CORE_CHAINS = ("zstd-1", "zstd-1 bitshuffle", "zstd-3", "lz4-5")


# ----------------------------------------------------------------------------------------------
# measuring


def stored_bytes(name: str, data: np.ndarray, compressors: tuple | list) -> int:
    """Bytes of `data`'s shard files as `write_array` stores it (zarr.json left out)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_array(LocalStore(tmp), name, data, compressors)
        return sum(p.stat().st_size for p in (Path(tmp) / name / "c").rglob("*") if p.is_file())


def entropy_bits(codes: dict[str, np.ndarray]) -> float:
    """Order-0 entropy of the stored nibbles (bits/token), signs counted as raw bits, rank tables not counted."""
    total = 0.0
    for key, a in codes.items():
        if key == "signs":
            total += a.shape[1] * 8
            continue
        if key == "tables":  # one row for all the tokens: left out
            continue
        nib = np.concatenate([a & 15, a >> 4], axis=1)
        p = np.bincount(nib.ravel(), minlength=16) / nib.size
        p = p[p > 0]
        total += -(p * np.log2(p)).sum() * nib.shape[1]
    return total


def _blosc(codec: BloscCodec) -> Blosc:
    """The numcodecs Blosc that zarr's BloscCodec runs, built from its stored configuration."""
    c = cast(dict[str, Any], codec.to_dict()["configuration"])  # zarr types it as any JSON value
    return Blosc(cname=c["cname"], clevel=c["clevel"], shuffle=SHUFFLE_IDS[c["shuffle"]],
                 blocksize=c["blocksize"], typesize=c["typesize"])


def speeds(arrays: dict[str, np.ndarray], codec: BloscCodec, repeat: int) -> dict[str, float]:
    """Compress / decompress MB/s over chunk-sized calls, 1 thread (as zarr) and Blosc's threads."""
    blosc = _blosc(codec)
    chunks = []
    for a in arrays.values():
        rows = min(chunk_rows(a.shape[1]), a.shape[0])
        chunks += [np.ascontiguousarray(a[i:i + rows]) for i in range(0, a.shape[0], rows)]
    raw = sum(c.nbytes for c in chunks) / 1e6
    out: dict[str, float] = {}
    saved = numcodecs.blosc.use_threads
    try:
        for label, threads in (("1t", False), (f"{numcodecs.blosc.get_nthreads()}t", True)):
            numcodecs.blosc.use_threads = threads
            enc = [blosc.encode(c) for c in chunks]
            out[f"compress_mb_s_{label}"] = raw / _best(lambda: [blosc.encode(c) for c in chunks], repeat)
            out[f"decompress_mb_s_{label}"] = raw / _best(lambda e=enc: [blosc.decode(b) for b in e], repeat)
    finally:
        numcodecs.blosc.use_threads = saved
    return out


def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def other_bytes(enc: dict[str, np.ndarray], specs: dict, tokens: int) -> dict[str, float]:
    """Bytes/token of the arrays besides the codes, each under its spec's chain."""
    return {k: stored_bytes(k, a, specs[k].compressors) / tokens for k, a in enc.items() if k != "codes"}


def study(label: str, x: torch.Tensor, cfg: Fp4Config, repeat: int, full: bool) -> list[dict]:
    """Rows for one feature set and layout: every (recoding, chain) tried, bytes, speeds, entropy."""
    t, width = x.shape
    enc_t = quantize_fp4(x, N_LAYERS, cfg)
    enc = {k: v.numpy().view(np.uint16) if v.dtype == torch.int16 else v.numpy() for k, v in enc_t.items()}
    specs = fp4_arrays(cfg, N_LAYERS, width // N_LAYERS)
    rest = other_bytes(enc, specs, t)
    err = {**errors(x, dequantize_fp4(enc_t, N_LAYERS, cfg)),
           "sign_agreement_prev_layer": sign_agreement(enc["codes"], N_LAYERS)}
    rows = []
    for rec in RECODINGS:
        codes = rec.encode(enc["codes"], N_LAYERS)
        if not np.array_equal(rec.decode(codes, N_LAYERS), enc["codes"]):
            raise AssertionError(f"{rec.name} does not decode to the codes")
        chains = CHAINS if full and rec.name in ("as stored", "rank delta prev layer") else CORE_CHAINS
        for chain in chains:
            blosc = CHAINS[chain]
            size = sum(stored_bytes(k, a, [blosc, Crc32cCodec()]) for k, a in codes.items()) / t
            row = {
                "features": label, "layout": f"g{cfg.group_size} e4m3 top-{cfg.outliers}", "recoding": rec.name,
                "codes_chain": chain, "codes_bytes_per_token": size,
                "codes_entropy_bytes_per_token": entropy_bits(codes) / 8,
                "other_bytes_per_token": rest, "bytes_per_token": size + sum(rest.values()),
                "bytes_per_value": (size + sum(rest.values())) / width, **err, **speeds(codes, blosc, repeat),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def codec_row(label: str, x: torch.Tensor) -> dict:
    """Bytes/token of every array `--codec fp4` stores (`FP4_LAYOUT`), each under its own spec, with
    one-per-layer arrays summed under their base name: the codec's size as extraction writes it."""
    t, width = x.shape
    arrays = to_stored_numpy(quantize_fp4(x, N_LAYERS, FP4_LAYOUT))
    specs = fp4_arrays(FP4_LAYOUT, N_LAYERS, width // N_LAYERS)
    base = {part: key for key in (FP4_LAYOUT.codes_key, "scales") for part in FP4_LAYOUT.split_keys(key, N_LAYERS)}
    per_array: dict[str, float] = {}
    for key, a in arrays.items():
        name = base.get(key, key)
        per_array[name] = per_array.get(name, 0.0) + stored_bytes(key, a, specs[key].compressors) / t
    row = {"features": label, "layout": FP4_LAYOUT.description, "arrays": per_array,
           "bytes_per_token": sum(per_array.values())}
    print(json.dumps(row), flush=True)
    return row


def print_table(rows: list[dict]) -> None:
    th = next(k for k in rows[0] if k.startswith("compress_mb_s_") and k != "compress_mb_s_1t")[len("compress_mb_s_"):]
    print(f"\n| features | layout | codes recoding | codes chain | codes B/token | codes entropy | other arrays "
          f"| total B/token | B/value | rel. L2 | comp. MB/s 1t / {th} | decomp. MB/s 1t / {th} |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['features']} | {r['layout']} | {r['recoding']} | {r['codes_chain']} | "
            f"{r['codes_bytes_per_token']:,.0f} | {r['codes_entropy_bytes_per_token']:,.0f} | "
            f"{sum(r['other_bytes_per_token'].values()):,.0f} | {r['bytes_per_token']:,.0f} | "
            f"{r['bytes_per_value']:.3f} | {r['rel_l2']:.4f} | {r['compress_mb_s_1t']:,.0f} / "
            f"{r[f'compress_mb_s_{th}']:,.0f} | {r['decompress_mb_s_1t']:,.0f} / {r[f'decompress_mb_s_{th}']:,.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_feature_args(ap, tokens=1024)
    ap.add_argument("--qwen3-tokens", type=int, default=1024,
                    help="random-weight Qwen3 tokens, in whole 512-token sequences (0: skip)")
    ap.add_argument("--repeat", type=int, default=3, help="timings: best of this many")
    ap.add_argument("--codec-only", action="store_true",
                    help="only the bytes of each array `--codec fp4` stores (skip the recoding study)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    features = feature_sets(args)
    if args.qwen3_tokens:
        features.append(("random Qwen3 5x4096", lambda: qwen3_features(args.qwen3_tokens)))
    rows, codec_rows = [], []
    for label, make in features:
        x = make()
        codec_rows.append(codec_row(label, x))
        if not args.codec_only:
            for cfg in (PLAIN_LAYOUT, Fp4Config(64, "e4m3", FP4_LAYOUT.outliers)):
                rows += study(label, x, cfg, args.repeat, full=cfg == PLAIN_LAYOUT)
    if rows:
        print_table(rows)
    print(f"\n`--codec fp4` ({FP4_LAYOUT.description}), bytes/token per array:\n")
    keys = list(codec_rows[0]["arrays"])
    print("| features | " + " | ".join(keys) + " | total |")
    print("|---|" + "---:|" * (len(keys) + 1))
    for r in codec_rows:
        print(f"| {r['features']} | " + " | ".join(f"{r['arrays'][k]:,.1f}" for k in keys)
              + f" | {r['bytes_per_token']:,.0f} |")
    if args.json:
        command = " ".join(["python3", "-m", __spec__.name, *sys.argv[1:]])  # as run: from the repository root
        meta = {"command": command, "blosc": numcodecs.blosc.VERSION_STRING,
                "blosc_threads": numcodecs.blosc.get_nthreads(), "codec": codec_rows, "rows": rows}
        Path(args.json).write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
