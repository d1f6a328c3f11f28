"""The cache manifest: what a cache holds and how it was made.

The manifest is written once, atomically, when a cache is created; segments are only committed
into a cache whose manifest matches the run. `mismatches` names the fields that differ so the CLI
(and the trainer) can refuse a cache with an error that says which field and how to fix it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_cache import __version__
from dflash_cache.errors import CacheCorruptError
from dflash_cache.files import inside, read_json, write_json_atomic
from dflash_cache.store.layout import MANIFEST_FILE
from dflash_cache.typed_json import INT64_MAX, load_dataclass

# The feature codecs a manifest may name: dflash_cache.store.codecs holds each one's code under these
# names (a test keeps the two the same); listed here, without torch, for the options that choose one.
CODEC_NAMES = ("none", "bf16", "fp8", "fp4")

FORMAT_NAME = "dflash-cache"
FORMAT_VERSION = 1
LAYER_ID_CONVENTION = "k = output of decoder layer k = Hugging Face hidden_states[k + 1]"
# Sizes a received manifest may claim: far above any real target, far below what a lie could
# make a reader allocate (features are [tokens, layers * hidden]).
MAX_HIDDEN_SIZE = 65536
MAX_LAYERS = 256
MAX_FEATURE_WIDTH = 1 << 20
MAX_TARGET_LAYERS = 4096
# Integer ranges of manifest fields, by field name (default: [0, 2**63)).
_BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, MAX_TARGET_LAYERS),
    "hidden_size": (1, MAX_HIDDEN_SIZE),
    "vocab_size": (1, (1 << 31) - 1),  # token ids are stored as int32
    "layer_ids": (0, MAX_TARGET_LAYERS - 1),
    "unit_rows": (1, INT64_MAX),
    "token_budget": (1, INT64_MAX),
    "max_rows": (1, INT64_MAX),
    "max_len": (1, INT64_MAX),
    "bucket_bounds": (0, (1 << 31) - 1),
    "format_version": (FORMAT_VERSION, FORMAT_VERSION),
}


@dataclass(frozen=True, slots=True)
class TargetIdentity:
    """Which target produced the features. `config_hash` covers the architecture and sizes."""

    name: str
    model_type: str
    config_hash: str
    dtype: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    weights_fingerprint: str = ""  # cheap hash of the weight files (names, sizes, head and tail bytes)


@dataclass(frozen=True, slots=True)
class PlanParams:
    """Everything that decides the deterministic batch plan (and so the segment names)."""

    unit_rows: int
    token_budget: int
    max_rows: int
    bucket_bounds: tuple[int, ...]
    max_len: int | None
    overlong: str
    num_rows: int
    num_units: int
    num_segments: int
    num_samples: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Manifest:
    target: TargetIdentity
    layer_ids: tuple[int, ...]
    hidden_size: int
    codec: str
    dataset_fingerprint: str
    dataset_description: str
    plan: PlanParams
    # `FeatureCodec.layout` of the writer: which stored arrays the codec's name stood for. Absent
    # (empty) in caches made before it was recorded, when no layout of a codec had changed.
    codec_layout: str = ""
    features: str = "pre-norm decoder layer outputs, packed over real tokens, layers concatenated"
    logical_dtype: str = "bfloat16"
    layer_id_convention: str = LAYER_ID_CONVENTION
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    tool_version: str = __version__
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def feature_width(self) -> int:
        return self.n_layers * self.hidden_size

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """Parse and check a manifest: every field's type and range, before anything is sized by it."""
        if not isinstance(obj, dict):
            raise CacheCorruptError(f"not a dflash-cache manifest (a JSON {type(obj).__name__}, not an object)")
        if obj.get("format") != FORMAT_NAME:
            raise CacheCorruptError(f"not a dflash-cache manifest (format={obj.get('format')!r})")
        if obj.get("format_version") != FORMAT_VERSION or type(obj.get("format_version")) is not int:
            raise CacheCorruptError(
                f"cache format version {obj.get('format_version')} is not supported by this tool "
                f"(reads version {FORMAT_VERSION}); use the dflash-cache release that wrote it"
            )
        try:
            manifest = load_dataclass(cls, obj, "manifest", _BOUNDS)
            manifest.check()
        except ValueError as e:
            raise CacheCorruptError(f"manifest is malformed ({e}); the cache cannot be read") from None
        return manifest

    def check(self) -> None:
        """Relations between fields that their types cannot express; ValueError names the first."""
        if not 1 <= self.n_layers <= MAX_LAYERS:
            raise ValueError(f"layer_ids must name 1 to {MAX_LAYERS} layers, not {self.n_layers}")
        if self.feature_width > MAX_FEATURE_WIDTH:
            raise ValueError(f"{self.n_layers} layers x hidden_size {self.hidden_size} exceed {MAX_FEATURE_WIDTH} "
                             "feature columns")
        bounds = self.plan.bucket_bounds
        if not bounds or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"plan.bucket_bounds must be a non-empty increasing list, not {list(bounds)[:8]}")


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists become tuples so they compare by value."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): tuple(obj) if isinstance(obj, list | tuple) else obj}


# Fields that may differ between the run that created a cache and one that resumes it.
_VOLATILE = ("tool_version", "extra", "dataset_description", "features", "layer_id_convention")


def mismatches(existing: Manifest, wanted: Manifest) -> list[tuple[str, Any, Any]]:
    """(field, existing value, wanted value) for every field that differs, volatile ones aside."""
    a, b = flatten(existing.to_json()), flatten(wanted.to_json())
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(_VOLATILE))
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


def write_manifest(root: Path, manifest: Manifest) -> None:
    write_json_atomic(root / MANIFEST_FILE, manifest.to_json())


def read_manifest(root: Path) -> Manifest:
    """The cache's manifest: a regular file inside `root`, well-formed, or CacheCorruptError."""
    path = root / MANIFEST_FILE
    if not os.path.lexists(path):
        raise CacheCorruptError(f"{root} is not a dflash-cache (no {MANIFEST_FILE}); check the path")
    inside(root, path)
    try:
        obj = read_json(path, max_bytes=1 << 20)
    except (ValueError, OSError) as e:
        raise CacheCorruptError(f"{path} is unreadable ({e}); copy the cache again or re-run extract") from None
    return Manifest.from_json(obj)
