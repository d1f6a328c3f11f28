"""Static shapes for the compiled step: most batches run kernels built for one exact shape.

Kernels compiled for symbolic shapes are slower than ones built for a fixed shape: on an NVIDIA
H200 the drafter's FlexAttention backward took ~14 ms per layer with dynamic shapes against
~8 ms static. A step's shape is (context tokens T, anchors A).

* A: at training sizes the anchor cap binds on nearly every batch (dozens of documents x 512
  anchors against a cap of a few thousand), and data of equal-length sequences gives every batch
  the same count. So the static anchor count is the largest seen so far; it may grow a few times
  (each time the static graph compiles once more), then stays.
* T varies with packing, but never exceeds the token budget (or the longest sample): a static
  step's context is padded to that, rounded up to FlexAttention's block size.

A batch with the static anchor count runs the static graph; any other batch runs the dynamic-shape
graph as it is. Padding wastes only the context projections of the padded rows (a few percent),
and changes no result: padded rows belong to no document, so the mask hides them from every query
(tests check the outputs and gradients are those of the unpadded batch).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_cache.store.batch import PackedBatch, positions_from_cu_seqlens

ROW_QUANTUM = 128  # FlexAttention's block size: full blocks need no bounds checks
NO_DOCUMENT = -1   # a padded context row's document: real documents are >= 0
MAX_STATIC_SHAPES = 3  # static anchor counts per run; with the dynamic graph's, within dynamo's default
                       # of 8 graphs per function (2 per shape: first layer, and the others)


@dataclass
class StaticShape:
    """The shape the static graph is built for, and how it is chosen (module doc)."""

    context_rows: int          # T of every static step: the largest batch, rounded up to ROW_QUANTUM
    anchors: int | None = None  # A of every static step: the largest anchor count seen so far
    shapes: int = 0            # static anchor counts chosen so far (each compiles the graph once)

    @classmethod
    def for_run(cls, *, largest_batch: int) -> StaticShape:
        return cls(context_rows=-(-largest_batch // ROW_QUANTUM) * ROW_QUANTUM)

    def admit(self, context_tokens: int, anchors: int) -> bool:
        """Whether a batch of this many context tokens and anchors runs the static graph; the first
        batch, and one with more anchors than any before, set the static anchor count (at most
        MAX_STATIC_SHAPES times: then it stays)."""
        if context_tokens > self.context_rows or anchors == 0:
            return False
        if self.anchors is None or (anchors > self.anchors and self.shapes < MAX_STATIC_SHAPES):
            self.anchors, self.shapes = anchors, self.shapes + 1
        return anchors == self.anchors


@dataclass
class Context:
    """A batch's context as the drafter and its mask see it: features [T, N*H], document-local
    positions [T] and document ids [T]."""

    features: torch.Tensor
    positions: torch.Tensor
    docs: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.features.shape[0])

    def padded_to(self, rows: int) -> Context:
        """The same context with `rows - T` rows appended that no query can see (zero features,
        position 0, document NO_DOCUMENT)."""
        extra = rows - self.rows
        if extra < 0:
            raise ValueError(f"cannot pad a context of {self.rows} rows to {rows}")
        if extra == 0:
            return self
        return Context(features=F.pad(self.features, (0, 0, 0, extra)),
                       positions=F.pad(self.positions, (0, extra)),
                       docs=F.pad(self.docs, (0, extra), value=NO_DOCUMENT))


WARM_UP_ANCHORS = 1 << 20  # per document and per batch in the warm-up: every candidate is an anchor


def warm_up_batches(*, block_size: int, width: int, device: torch.device) -> list[PackedBatch]:
    """Two made-up batches for compiling the dynamic-shape graph (`Trainer.warm_up`): two fully
    supervised documents each, zero features. Sampled with WARM_UP_ANCHORS, their token counts
    (10B + 75 + 300k) and anchor counts (8B + 77 + 300k) are odd and differ between the two, and
    no two sizes of one batch coincide (tokens, queries, keys, and their counts of FlexAttention
    blocks): dynamo then makes every size symbolic and ties none to another (a size equal to
    another at the first compile is assumed always equal, and the first batch where it is not
    compiles again)."""
    batches = []
    for k in range(2):
        lengths = [5 * block_size + 37 + 150 * k, 5 * block_size + 38 + 150 * k]
        total = sum(lengths)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
        batch = PackedBatch(input_ids=torch.zeros(total, dtype=torch.int64),
                            loss_mask=torch.ones(total, dtype=torch.bool),
                            position_ids=positions_from_cu_seqlens(cu, total), cu_seqlens=cu,
                            sample_ids=torch.arange(len(lengths)),
                            features=torch.zeros(total, width, dtype=torch.bfloat16))
        batches.append(batch.to(device))
    return batches


__all__ = ["MAX_STATIC_SHAPES", "NO_DOCUMENT", "ROW_QUANTUM", "Context", "StaticShape", "WARM_UP_ANCHORS", "warm_up_batches"]
