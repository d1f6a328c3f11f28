"""The packed batch: the one contract between the sources (cache, live) and the trainer.

A varlen batch with no padding. `features` is bf16 on the training device once a source has
delivered it; everything else is int64 (loss_mask: bool). Documents are the samples packed one
after another; `cu_seqlens` gives their boundaries and `position_ids` restart at 0 in each.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor     # int64 [T]
    loss_mask: torch.Tensor     # bool [T]
    position_ids: torch.Tensor  # int64 [T], 0.. within each document
    cu_seqlens: torch.Tensor    # int64 [N + 1], cu_seqlens[0] = 0, cu_seqlens[-1] = T
    sample_ids: torch.Tensor    # int64 [N], cache sample ids (dataset row indices)
    features: torch.Tensor      # bf16 [T, n_layers * H]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.sample_ids.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def doc_ids(self) -> torch.Tensor:
        """int64 [T]: the document index of every token, from cu_seqlens in one repeat_interleave."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths,
                                       output_size=self.num_tokens)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [T] positions restarting at 0 in each document."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts
