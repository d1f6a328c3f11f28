"""The packed batch: the one contract between the sources (cache, live) and the trainer.

A varlen batch with no padding. `features` is bf16 on the training device once a source has
delivered it; everything else is int64 (loss_mask: bool). Documents are the samples packed one
after another; `cu_seqlens` gives their boundaries and `position_ids` restart at 0 in each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [T] positions restarting at 0 in each document."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts
