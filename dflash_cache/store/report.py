"""What is in a cache: a summary, one sample, and a full verification pass.

All of this reads JSON, Parquet and zarr chunks only. `summarize` touches no feature data;
`verify` decodes every chunk (checksums included) and cross-checks the records, the stored token
arrays and the index, returning a list of problems that each name their segment. `verification`
is `inspect --verify`: damage and incompleteness both fail it, and with `--repair` the damaged
segments are un-committed (`dflash_cache.store.repair`) so that the next extract redoes exactly those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_cache.errors import CacheCorruptError
from dflash_cache.store.layout import INDEX_FILE, MANIFEST_FILE, PLAN_FILE, segment_name
from dflash_cache.store.plan import bucket_table, plan_limits, segments_of_plan
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.repair import leftovers, uncommit
from dflash_cache.store.segments import SegmentRecord

BF16_BYTES = 2


def missing_units(reader: CacheReader) -> list[int]:
    """Work units with at least one planned segment not committed."""
    committed = {r.name for r in reader.records}
    planned = segments_of_plan(reader.read_parquet(PLAN_FILE, plan_limits(reader.manifest)))
    return sorted({u for u, b in planned if segment_name(u, b) not in committed})


def summarize(reader: CacheReader) -> dict[str, Any]:
    m = reader.manifest
    tokens = reader.num_tokens
    meta = sum(reader.location.size(f) or 0 for f in (MANIFEST_FILE, PLAN_FILE, INDEX_FILE))
    on_disk = reader.bytes_on_disk() + meta
    raw = tokens * m.feature_width * BF16_BYTES
    buckets = np.bincount([r.bucket for r in reader.records], minlength=len(m.plan.bucket_bounds))
    return {
        "cache": str(reader.location),
        "target": m.target.name,
        "target_model_type": m.target.model_type,
        "target_config_hash": m.target.config_hash,
        "target_dtype": m.target.dtype,
        "layer_ids": list(m.layer_ids),
        "hidden_size": m.hidden_size,
        "codec": m.codec,
        "codec_layout": m.codec_layout,
        "samples": reader.num_samples,
        "tokens": tokens,
        "supervised_tokens": reader.num_supervised,
        "segments": len(reader.records),
        "segments_planned": m.plan.num_segments,
        "bytes_on_disk": on_disk,
        "bytes_per_token": on_disk / tokens if tokens else 0.0,
        "raw_bf16_bytes_per_token": m.feature_width * BF16_BYTES,
        "compression_vs_raw_bf16": raw / on_disk if on_disk else 0.0,
        "bucket_bounds": list(m.plan.bucket_bounds),
        "bucket_segments": buckets.tolist(),
        "missing_units": missing_units(reader),
        "complete": reader.complete,
        "dataset": m.dataset_description,
        "tool_version": m.tool_version,
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"cache            {s['cache']}  ({'complete' if s['complete'] else 'INCOMPLETE'})",
        f"target           {s['target']}  ({s['target_model_type']}, config {s['target_config_hash']}, {s['target_dtype']})",
        f"layer ids        {s['layer_ids']}  (output of decoder layer k)",
        f"hidden size      {s['hidden_size']}  x {len(s['layer_ids'])} layers",
        f"codec            {s['codec']}" + (f"  ({s['codec_layout']})" if s["codec_layout"] else ""),
        f"samples          {s['samples']:,}",
        f"tokens           {s['tokens']:,}  ({s['supervised_tokens']:,} supervised)",
        f"segments         {s['segments']:,} of {s['segments_planned']:,} planned",
        f"bytes on disk    {s['bytes_on_disk']:,}  ({s['bytes_per_token']:,.1f} B/token; raw bf16 "
        f"{s['raw_bf16_bytes_per_token']:,} B/token, {s['compression_vs_raw_bf16']:.2f}x smaller)",
        "buckets:",
    ]
    lines += bucket_table(s["bucket_bounds"], s["bucket_segments"], "segments")
    missing = s["missing_units"]
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        lines.append(f"missing units    {len(missing)}: {shown}  (run extract again to resume)")
    else:
        lines.append("missing units    none")
    return "\n".join(lines)


def describe_sample(reader: CacheReader, sample_id: int) -> dict[str, Any]:
    s = reader.sample(sample_id)
    m = reader.manifest
    feats = s.features.float().view(len(s.input_ids), m.n_layers, m.hidden_size)
    norms = feats.norm(dim=-1).mean(dim=0).tolist()
    return {
        "sample_id": sample_id,
        "segment": s.segment,
        "length": int(len(s.input_ids)),
        "supervised": int(s.loss_mask.sum()),
        "mask_coverage": float(s.loss_mask.mean()),
        "layer_norms": {str(layer): float(n) for layer, n in zip(m.layer_ids, norms, strict=True)},
        "first_ids": s.input_ids[:16].tolist(),
    }


def format_sample(d: dict[str, Any]) -> str:
    lines = [
        f"sample {d['sample_id']} in segment {d['segment']}",
        f"  length         {d['length']}",
        f"  supervised     {d['supervised']} ({100 * d['mask_coverage']:.1f}% of tokens)",
        f"  first ids      {d['first_ids']}",
        "  mean per-token feature norm by layer:",
    ]
    lines += [f"    layer {k:>3}: {v:.4f}" for k, v in d["layer_norms"].items()]
    return "\n".join(lines)


@dataclass
class Verification:
    """What `check` found: damaged segments (each with its problems) and problems of the whole cache."""

    damaged: dict[str, list[str]] = field(default_factory=dict)
    index_problem: str | None = None  # index.parquet cannot be trusted (a rerun of extract rewrites it)

    @property
    def problems(self) -> list[str]:
        out = [p for msgs in self.damaged.values() for p in msgs]
        if self.index_problem:
            out.append(f"{self.index_problem}; rerun extract (or --repair) to rewrite it")
        return out


def _segment_problems(reader: CacheReader, rec: SegmentRecord, seen: dict[int, str]) -> list[str]:
    """Everything wrong with one committed segment, each problem naming it."""
    m = reader.manifest
    try:
        reader.check_segment(rec, check_files=True)  # one listing: the read below finds it checked
        arrays = reader.read_segment(rec.name)
    except CacheCorruptError as e:
        return [str(e) if rec.name in str(e) else f"segment {rec.name}: {e}"]
    offsets = np.concatenate([[0], np.cumsum(rec.lengths)])
    checks = [
        (np.array_equal(arrays["offsets"], offsets), "offsets disagree with the commit record"),
        (np.array_equal(arrays["sample_ids"], np.array(rec.sample_ids)), "sample ids disagree with the record"),
        (np.array_equal(np.add.reduceat(arrays["loss_mask"].astype(np.int64), offsets[:-1]),
                        np.array(rec.supervised)), "loss mask disagrees with the recorded supervised counts"),
        (bool(np.isin(arrays["loss_mask"], (0, 1)).all()), "loss mask holds values other than 0/1"),
        (bool(((arrays["input_ids"] >= 0) & (arrays["input_ids"] < m.target.vocab_size)).all()),
         "token ids outside the target's vocabulary"),
    ]
    feats = reader.decode_features(arrays)
    checks.append((bool(feats.isfinite().all()), "features hold NaN or infinity"))
    problems = [f"segment {rec.name}: {msg}" for ok, msg in checks if not ok]
    for sid in rec.sample_ids:
        if sid in seen:
            problems.append(f"segment {rec.name}: sample {sid} also in segment {seen[sid]}")
        seen[sid] = rec.name
    return problems


def check(reader: CacheReader, progress: Callable[[int], None] | None = None) -> Verification:
    """Decode everything committed and cross-check it (completeness is `incomplete`'s business)."""
    result = Verification()
    seen: dict[int, str] = {}
    for rec in reader.records:
        problems = _segment_problems(reader, rec, seen)
        if problems:
            result.damaged[rec.name] = problems
        if progress:
            progress(rec.num_tokens)
    result.index_problem = reader.index_problem
    return result


def verify(reader: CacheReader, progress: Callable[[int], None] | None = None) -> list[str]:
    """Decode everything and cross-check; returns problems, each naming its segment."""
    return check(reader, progress).problems


def incomplete(reader: CacheReader) -> str | None:
    """One line saying what is missing from an incomplete cache and what to do; None if complete."""
    if reader.complete:
        return None
    units = missing_units(reader)
    shown = ", ".join(map(str, units[:10])) + (" ..." if len(units) > 10 else "")
    return (f"incomplete: {len(reader.records)} of {reader.manifest.plan.num_segments} planned segments are "
            f"committed (missing units: {shown or 'none'}); run the extract command that made it again to finish it")


def repair_hint(root: Path | str) -> str:
    return (f"to repair: `dflash-cache inspect {root} --verify --repair` un-commits the damaged segments; "
            "then run the extract command that made this cache again to redo exactly those"
            + ("" if isinstance(root, Path) else " (on a local copy: repair needs a cache directory)"))


def verification(reader: CacheReader, *, repair: bool = False) -> dict[str, Any]:
    """`inspect --verify [--repair]`: damage and incompleteness, and the repair done (hold the
    cache lock to repair) or the hint that says how. `ok` only for an intact, complete cache."""
    found = check(reader)
    missing = incomplete(reader)
    problems = found.problems + ([missing] if missing else [])
    out: dict[str, Any] = {"ok": not problems, "problems": problems, "damaged_segments": sorted(found.damaged)}
    root = reader.root  # None: a cache on object storage
    found_leftovers = leftovers(root) if root is not None else []
    if found_leftovers:  # not problems: nothing reads them
        out["leftovers"] = found_leftovers
    if found.damaged or found.index_problem:
        if repair:
            if root is None:  # the CLI refuses --repair for a URL before it reads anything
                raise ValueError(f"verification: repair needs a cache directory, not {reader.location}")
            out["repaired"] = uncommit(root, found.damaged)
        else:
            out["hint"] = repair_hint(root if root is not None else str(reader.location))
    return out


def format_verification(v: dict[str, Any]) -> str:
    n = len(v["problems"])
    lines = [f"verify: {'OK' if v['ok'] else f'{n} problem(s)'}"]
    lines += [f"  {p}" for p in v["problems"]]
    if "repaired" in v:
        names = ", ".join(v["repaired"]) or "none"
        lines.append(f"repaired: un-committed {len(v['repaired'])} segment(s) ({names}) and rewrote {INDEX_FILE}; "
                     "run the extract command that made this cache again to redo them")
    if "hint" in v:
        lines.append(v["hint"])
    if v.get("leftovers"):
        shown = ", ".join(v["leftovers"][:5]) + (" ..." if len(v["leftovers"]) > 5 else "")
        lines.append(f"leftovers: {len(v['leftovers'])} file(s) of interrupted runs, not read ({shown}); the next "
                     "extract into this cache removes them")
    return "\n".join(lines)
