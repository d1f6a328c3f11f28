"""The packed batch: the one contract of the store, from the extraction pipeline to the trainer.

A varlen batch with no padding: documents (samples) packed one after another, `cu_seqlens` giving
their boundaries. It exists in two forms, and the types keep them apart:

* `HostBatch`: on the host, numpy, in the dtypes a segment stores, and without features (they
  do not exist yet when extraction lays out a batch, and they travel separately, encoded by a
  codec). Extraction and the live source pack dataset rows into one, the writer commits one next
  to the encoded features, and the cache source reads one back.
* `PackedBatch`: torch, on the training device, with bf16 features: what the trainer consumes,
  made from a `HostBatch` by `PackedBatch.from_host`. `position_ids` restart at 0 in each document.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from dflash_cache.store.codecs import TOKEN_ARRAYS

# Allocates an array for `concatenate` and `HostBatch.pack` to fill: (name, shape, dtype) -> array.
# The cache source passes one that allocates in pinned memory, so a batch is written once.
Allocate = Callable[[str, tuple[int, ...], np.dtype], np.ndarray]


def new_array(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The default `Allocate`: ordinary numpy memory."""
    return np.empty(shape, dtype)


def concatenate(name: str, parts: Sequence[np.ndarray], dtype: np.dtype | None = None,
                allocate: Allocate = new_array) -> np.ndarray:
    """The (non-empty list of) parts end to end in one array from `allocate`, cast to `dtype` as
    `astype` would (default: the parts' dtype)."""
    dtype = np.dtype(dtype or parts[0].dtype)
    out = allocate(name, (sum(len(p) for p in parts), *parts[0].shape[1:]), dtype)
    np.concatenate(parts, out=out, casting="unsafe")
    return out


def cu_seqlens_of(lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """int64 [N + 1] document bounds of documents of these lengths: 0, then the running sum."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return cu


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [T] positions restarting at 0 in each document."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


# HostBatch field -> the segment array holding it (document bounds are stored as `offsets`).
_STORED_NAMES = {"input_ids": "input_ids", "loss_mask": "loss_mask", "cu_seqlens": "offsets",
                 "sample_ids": "sample_ids"}


@dataclass(frozen=True)
class HostBatch:
    """A packed batch on the host, without features: numpy arrays in the dtypes a segment stores
    (other integer or bool arrays given to the constructor are cast)."""

    input_ids: np.ndarray   # int32 [T]
    loss_mask: np.ndarray   # uint8 [T], 1 = supervised
    cu_seqlens: np.ndarray  # int64 [N + 1], cu_seqlens[0] = 0, cu_seqlens[-1] = T
    sample_ids: np.ndarray  # int64 [N], dataset row indices

    def __post_init__(self) -> None:
        for f in fields(self):
            dtype = TOKEN_ARRAYS[_STORED_NAMES[f.name]]
            object.__setattr__(self, f.name, np.asarray(getattr(self, f.name), dtype=dtype))
        n, t = len(self.sample_ids), len(self.input_ids)
        cu = self.cu_seqlens
        if len(self.loss_mask) != t or len(cu) != n + 1 or cu[0] != 0 or cu[-1] != t:
            raise ValueError(f"inconsistent packed batch: {t} ids, {len(self.loss_mask)} mask values, "
                             f"{n} samples, document bounds {cu[:1].tolist()}..{cu[-1:].tolist()}")

    @classmethod
    def pack(cls, input_ids: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray], sample_ids: np.ndarray,
             allocate: Allocate = new_array) -> HostBatch:
        """Rows (one id and one mask array per sample, at least one) packed end to end."""
        lengths = np.fromiter((len(a) for a in input_ids), np.int64, len(input_ids))
        cu = allocate("cu_seqlens", (len(lengths) + 1,), TOKEN_ARRAYS["offsets"])
        cu[:] = cu_seqlens_of(lengths)
        ids = allocate("sample_ids", (len(lengths),), TOKEN_ARRAYS["sample_ids"])
        ids[:] = sample_ids
        return cls(input_ids=concatenate("input_ids", input_ids, TOKEN_ARRAYS["input_ids"], allocate),
                   loss_mask=concatenate("loss_mask", loss_masks, TOKEN_ARRAYS["loss_mask"], allocate),
                   cu_seqlens=cu, sample_ids=ids)

    @classmethod
    def from_packed(cls, batch: PackedBatch) -> HostBatch:
        """The host form of a device batch (copies its token tensors to the host)."""
        return cls(**{name: getattr(batch, name).cpu().numpy() for name in _STORED_NAMES})

    @classmethod
    def from_stored(cls, arrays: Mapping[str, np.ndarray]) -> HostBatch:
        """The batch a segment's token arrays hold (keys as `stored` gives them)."""
        return cls(**{name: arrays[key] for name, key in _STORED_NAMES.items()})

    def stored(self) -> dict[str, np.ndarray]:
        """The segment's token arrays, by stored name, in the order the writer writes them."""
        by_key = {key: getattr(self, name) for name, key in _STORED_NAMES.items()}
        return {key: by_key[key] for key in TOKEN_ARRAYS}

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def num_docs(self) -> int:
        return len(self.sample_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.cu_seqlens)

    def supervised(self) -> np.ndarray:
        """int64 [N] supervised tokens of each document (every document holds at least one token)."""
        if not self.num_docs:
            return np.zeros(0, np.int64)
        return np.add.reduceat(self.loss_mask.astype(np.int64), self.cu_seqlens[:-1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The arrays as CPU tensors sharing their memory, by field name."""
        return {name: torch.from_numpy(getattr(self, name)) for name in _STORED_NAMES}

    def layout(self) -> HostLayout:
        t = self.tensors()
        return HostLayout(input_ids=t["input_ids"], loss_mask=t["loss_mask"], cu_seqlens=t["cu_seqlens"])


@dataclass(frozen=True)
class HostLayout:
    """A batch's token ids, loss mask and document bounds kept on the host (CPU tensors).

    Anchors are sampled from these: sampling needs the number of candidate tokens, and reading
    that from a device tensor would make every training step wait for the GPU to drain.
    """

    input_ids: torch.Tensor   # integer [T]
    loss_mask: torch.Tensor   # bool or 0/1 integer [T]
    cu_seqlens: torch.Tensor  # int64 [N + 1]


@dataclass
class PackedBatch:
    input_ids: torch.Tensor     # int64 [T]
    loss_mask: torch.Tensor     # bool [T]
    position_ids: torch.Tensor  # int64 [T], 0.. within each document
    cu_seqlens: torch.Tensor    # int64 [N + 1], cu_seqlens[0] = 0, cu_seqlens[-1] = T
    sample_ids: torch.Tensor    # int64 [N], cache sample ids (dataset row indices)
    features: torch.Tensor      # bf16 [T, n_layers * H]
    host: HostLayout | None = field(default=None, repr=False)  # set by the sources; None in hand-made batches

    @classmethod
    def from_host(cls, host: HostBatch, features: torch.Tensor,
                  tokens: Mapping[str, torch.Tensor] | None = None) -> PackedBatch:
        """The batch of `host` with its features. `tokens` are the host batch's arrays already
        copied where the batch is to be (by field name); without them the token tensors stay on
        the CPU, and `.to(device)` moves them."""
        t = host.tensors() if tokens is None else tokens
        cu = t["cu_seqlens"]
        return cls(input_ids=t["input_ids"].long(), loss_mask=t["loss_mask"].bool(),
                   position_ids=positions_from_cu_seqlens(cu, host.num_tokens), cu_seqlens=cu,
                   sample_ids=t["sample_ids"], features=features, host=host.layout())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.sample_ids.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The device tensors moved; the host layout stays on the host."""
        return PackedBatch(**{name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _DEVICE_FIELDS},
                           host=self.host)

    def doc_ids(self) -> torch.Tensor:
        """int64 [T]: the document index of every token, from cu_seqlens in one repeat_interleave."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths,
                                       output_size=self.num_tokens)


_DEVICE_FIELDS = ("input_ids", "loss_mask", "position_ids", "cu_seqlens", "sample_ids", "features")
