"""Static shapes for the compiled step: every step runs kernels built for one of a few exact shapes.

Kernels compiled for one fixed shape are faster than ones compiled for symbolic sizes (on an NVIDIA
H200 the drafter's FlexAttention backward took ~8 ms per layer static against ~14 ms dynamic), and
torch 2.11's dynamic-shape graph of the drafter layers crashed in its backward on data of mixed
lengths (bench/repro_dynamic_shapes.py). So no training step runs a dynamic-shape graph: a step's
shape is (context rows T, anchors A), and each batch is padded up to one of a few shapes fixed at
start-up:

* T: the largest batch the source can form (the token budget, or a longer single sample), rounded up
  to FlexAttention's block size. Packing fills batches close to the budget, so padding the context
  costs a few percent of the context's projections, a small part of a step.
* A: the anchors decide most of a step's work (every drafter layer and the LM head run on A x B
  block tokens), so they get several buckets. The epoch plans are pure functions of the sample
  table and the seed, so at start the trainer knows every batch the run will take and the most
  anchors each can draw (`dflash_cache.train.anchors.anchors_at_most`); `ShapeBuckets.from_plan`
  picks up to `max_shapes` anchor counts that minimise the padded anchors over those batches (an
  exact dynamic program), the largest count of all among them.

Padding changes no result. Padded context rows belong to no document and padded blocks see only
themselves: no query sees the former, the latter weigh 0 in the loss and give no gradient (tests
check outputs and gradients against the unpadded batch's). Padded rows use PAD_DOCUMENT, above every
real document id, so a padded batch keeps the context and the blocks sorted by document.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from dflash_cache.errors import UserError, compile_failure
from dflash_cache.store.batch import PackedBatch, positions_from_cu_seqlens
from dflash_cache.train.anchors import anchors_at_most
from dflash_cache.train.epoch_plan import SampleTable, SourceConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

ROW_QUANTUM = 128  # FlexAttention's block size: full blocks need no bounds checks
PAD_DOCUMENT = 2**31 - 1  # the document of padded context rows and padded blocks: above every real one
MAX_DISTINCT_COUNTS = 2048  # anchor counts the bucket choice tells apart (coarser steps beyond)


@dataclass(frozen=True, order=True)
class Shape:
    """One static shape: context rows and anchors of every step that runs it."""

    context_rows: int
    anchors: int

    def __str__(self) -> str:
        return f"{self.anchors} anchors x {self.context_rows} context rows"


def round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def anchor_quantum(block_size: int) -> int:
    """Anchors in steps of this many fill whole FlexAttention blocks of queries (A x B rows)."""
    return ROW_QUANTUM // math.gcd(block_size, ROW_QUANTUM)


def choose_buckets(values: np.ndarray, max_buckets: int) -> list[int]:
    """Up to `max_buckets` bounds taken from `values` minimising sum(bound(v) - v), where bound(v)
    is the smallest bound >= v; the largest value is always a bound. Exact: a dynamic program over
    the distinct values (best[j]: the least padding of the values up to the j-th with k bounds, the
    j-th one of them; one more bound never pads more)."""
    vals, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    n = len(vals)
    if n == 0:
        return []
    c = np.concatenate(([0], np.cumsum(counts)))
    s = np.concatenate(([0], np.cumsum(counts * vals)))
    # pad[i, j]: the values after the i-th up to the j-th padded to vals[j]; only i < j is a choice.
    pad = ((c[None, 1:] - c[1:, None]) * vals[None, :] - (s[None, 1:] - s[1:, None])).astype(np.float64)
    pad[np.tril_indices(n)] = np.inf
    best = (c[1:] * vals - s[1:]).astype(np.float64)  # one bound: every value up to j padded to vals[j]
    previous: list[np.ndarray] = []  # per added bound: the bound before the j-th
    for _ in range(1, min(max_buckets, n)):
        total = best[:, None] + pad
        previous.append(np.argmin(total, axis=0))
        best = total.min(axis=0)
    bounds, j = [int(vals[-1])], n - 1
    for before in reversed(previous):
        j = int(before[j])
        bounds.append(int(vals[j]))
    return sorted(bounds)


@dataclass(frozen=True)
class ShapeBuckets:
    """The static shapes of a run: one context size, a few anchor counts (module doc)."""

    context_rows: int
    anchors: tuple[int, ...]  # ascending

    @classmethod
    def from_plan(cls, *, batch_tokens: np.ndarray, batch_anchors: np.ndarray, largest_batch: int,
                  block_size: int, max_shapes: int) -> ShapeBuckets:
        """Buckets for batches of these token counts that draw at most these many anchors each
        (`batch_anchors`, after the run's anchor cap)."""
        context_rows = round_up(max(largest_batch, int(np.max(batch_tokens, initial=1))), ROW_QUANTUM)
        counts = np.asarray(batch_anchors, dtype=np.int64)
        counts = counts[counts > 0]
        if len(counts) == 0:
            return cls(context_rows, (anchor_quantum(block_size),))
        top = int(counts.max())
        quantum = anchor_quantum(block_size)
        quantum *= max(1, -(-top // (quantum * MAX_DISTINCT_COUNTS)))
        rounded = np.minimum(-(-counts // quantum) * quantum, top)
        return cls(context_rows, tuple(choose_buckets(rounded, max_shapes)))

    @property
    def shapes(self) -> list[Shape]:
        return [Shape(self.context_rows, a) for a in self.anchors]

    def shape_for(self, context_tokens: int, anchors: int) -> Shape | None:
        """The smallest shape that holds a batch of this many context tokens and anchors; None if
        none does (more anchors than any planned batch can draw: see `StepRunner.prepare_step`)."""
        i = bisect.bisect_left(self.anchors, max(anchors, 1))
        if context_tokens > self.context_rows or i == len(self.anchors):
            return None
        return Shape(self.context_rows, self.anchors[i])

    def widened(self, anchors: int, block_size: int) -> ShapeBuckets:
        """These buckets and one that holds `anchors` (a batch of an epoch past the planned ones)."""
        return ShapeBuckets(self.context_rows,
                            tuple(sorted({*self.anchors, round_up(anchors, anchor_quantum(block_size))})))

    def describe(self) -> str:
        return f"anchors {'/'.join(map(str, self.anchors))} x {self.context_rows} context rows"


def planned_batches(table: SampleTable, config: SourceConfig, *, epochs: int, block_size: int, num_anchors: int,
                    max_anchors: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, the most anchors it can draw) of every batch of the first `epochs` epochs, all ranks'."""
    most = anchors_at_most(table.lengths, table.supervised, block_size=block_size, num_anchors=num_anchors)
    tokens, anchors = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for epoch in range(epochs):
        batches = table.epoch(config, epoch, 0, 1)
        if not batches:
            break
        rows = np.concatenate(batches)
        starts = np.cumsum([0] + [len(b) for b in batches[:-1]])
        tokens.append(np.add.reduceat(table.lengths[rows], starts))
        anchors.append(np.minimum(np.add.reduceat(most[rows], starts), max_anchors))
    return np.concatenate(tokens), np.concatenate(anchors)


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
        position 0, document PAD_DOCUMENT)."""
        extra = rows - self.rows
        if extra < 0:
            raise ValueError(f"cannot pad a context of {self.rows} rows to {rows}")
        if extra == 0:
            return self
        return Context(features=F.pad(self.features, (0, 0, 0, extra)),
                       positions=F.pad(self.positions, (0, extra)),
                       docs=F.pad(self.docs, (0, extra), value=PAD_DOCUMENT))


@dataclass
class ShapeRecord:
    """What a run did with its static shapes: steps per way of running, padding since the last
    metrics row, and the shapes whose compiled step failed (they run eagerly from then on)."""

    compiled_steps: int = 0  # steps that ran a static shape's compiled graphs
    eager_steps: int = 0     # steps of a static shape whose compiled step had failed
    failed: dict[Shape, str] = field(default_factory=dict)  # shape -> why its compiled step failed
    _anchors: list[int] = field(default_factory=lambda: [0, 0])  # since the last row: [real, padded]
    _rows: list[int] = field(default_factory=lambda: [0, 0])     # context rows: [real, padded]

    def try_compiled(self, shape: Shape, step: Callable[[], T], undo: Callable[[], None]) -> T | None:
        """`step()` (a compiled step of `shape`), or None if it failed: the compiler, or a generated
        kernel at run time. The failure is logged once with the shape and the torch version, and
        `undo()` drops what the attempt left (gradients) so the caller can run the step eagerly.
        Out-of-memory errors, interrupts and user errors are no compile failures and propagate."""
        try:
            return step()
        except (torch.OutOfMemoryError, UserError):
            raise
        except Exception as e:
            why = compile_failure(e)
            self.failed[shape] = why
            log.warning("the compiled step for %s failed under torch %s (%s); steps of this shape run eagerly "
                        "from now on", shape, torch.__version__, why)
            undo()
            return None

    def count(self, *, eager: bool, anchors: int, anchor_padding: int, rows: int, row_padding: int) -> None:
        """One static-shape step: how it ran and what it padded."""
        if eager:
            self.eager_steps += 1
        else:
            self.compiled_steps += 1
        self._anchors[0] += anchors
        self._anchors[1] += anchor_padding
        self._rows[0] += rows
        self._rows[1] += row_padding

    def window_fields(self) -> dict[str, float | int]:
        """A metrics row's static-shape fields, and a fresh count for the next row: the share of the
        blocks and of the context rows the steps computed that were padding, and the eager steps so far."""
        (anchors, padded_anchors), (rows, padded_rows) = self._anchors, self._rows
        self._anchors, self._rows = [0, 0], [0, 0]
        if anchors + padded_anchors == 0:
            return {}
        return {"anchor_padding": round(padded_anchors / (anchors + padded_anchors), 4),
                "context_padding": round(padded_rows / max(1, rows + padded_rows), 4),
                "eager_steps": self.eager_steps}


def warm_up_batch(shape: Shape, *, block_size: int, width: int, device: torch.device) -> PackedBatch:
    """A made-up batch for compiling `shape` before the first step: fully supervised documents of
    zero features that offer at least `shape.anchors` anchors in at most `shape.context_rows` tokens
    (the trainer pads what the draw leaves short)."""
    per_doc = max(4 * block_size, min(shape.context_rows, 8 * block_size))
    docs = max(1, min(shape.context_rows // per_doc, -(-shape.anchors // (per_doc - block_size + 1))))
    lengths = [per_doc] * docs
    total = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    batch = PackedBatch(input_ids=torch.zeros(total, dtype=torch.int64), loss_mask=torch.ones(total, dtype=torch.bool),
                        position_ids=positions_from_cu_seqlens(cu, total), cu_seqlens=cu,
                        sample_ids=torch.arange(docs), features=torch.zeros(total, width, dtype=torch.bfloat16))
    return batch.to(device)


__all__ = ["PAD_DOCUMENT", "ROW_QUANTUM", "Context", "Shape", "ShapeBuckets", "ShapeRecord",
           "anchor_quantum", "choose_buckets", "planned_batches", "warm_up_batch"]
