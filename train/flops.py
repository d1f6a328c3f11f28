"""Model FLOPs of a training step, and the device peak they are measured against (MFU).

Counted as matrix-multiply FLOPs (2 per multiply-add) of the work the step must do, not of what the
kernels happen to execute (masked-out attention blocks and recomputation do not count):

* the drafter's linears: per layer, the query and output projections and the MLP on the Q block
  tokens, the key and value projections on all T + Q keys; forward once, backward twice (input and
  weight gradients): x3. Less what the trainer need not compute: the first layer's query, key and
  value projections of the blocks run on their A + 1 distinct rows (each anchor, and the mask token
  that fills every other slot), and the last layer's output projection and MLP on the A * (B - 1)
  scored rows. The fused-context projection `fc` on the T context tokens: x2, as the target's
  features need no gradient.
* attention: QK^T and PV over the query/key pairs the mask admits (full layers: a block's B queries
  see its anchor's document prefix and the block's B keys; sliding layers: at most W keys each). x3.
* the frozen LM head on the scored rows (slots 1..B-1): the logits, and the gradient wrt the hidden
  states (no weight gradient): x2.

`bench/train.py` prints the breakdown for its configuration; the README explains the figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_cache.train.config import FULL_ATTENTION, DrafterConfig

# Dense bf16 tensor-core peak (no sparsity), FLOP/s, by a substring of the device name; the first
# match wins. Unknown devices get no MFU, only TFLOP/s.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
)


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None when it is not a GPU this table knows."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step by part (forward + backward)."""

    linears: float
    attention: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.linears + self.attention + self.lm_head


def linear_flops(cfg: DrafterConfig, *, context_tokens: int, num_blocks: int, first_rows: int,
                 last_rows: int) -> float:
    """The FLOPs of the drafter's linears in a step over `context_tokens` context tokens and
    `num_blocks` blocks: `fc` on the context, and each layer's projections and MLP on the block rows,
    the first layer's query, key and value projections on `first_rows` of them and the last layer's
    output projection and MLP on `last_rows` (`step_flops` says how many the trainer runs)."""
    h, d = cfg.hidden_size, cfg.head_dim
    t, q = context_tokens, num_blocks * cfg.block_size
    q_width, kv_width = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    last = cfg.num_layers - 1
    linears = 2 * (2 * t * cfg.num_target_layers * h * h)
    for i in range(cfg.num_layers):
        rows_in = first_rows if i == 0 else q  # rows through the blocks' q/k/v projections
        rows_out = last_rows if i == last else q  # rows through o and the MLP
        linears += 3 * (2 * rows_in * h * q_width + 2 * (t + rows_in) * h * kv_width * 2
                        + 2 * rows_out * h * q_width + 2 * rows_out * h * cfg.intermediate_size * 3)
    return float(linears)


def step_flops(cfg: DrafterConfig, *, context_tokens: int, num_blocks: int, prefix_keys: int) -> StepFlops:
    """The FLOPs of a step over `context_tokens` context tokens and `num_blocks` blocks whose anchors'
    positions sum to `prefix_keys` (see `Blocks.prefix_keys`)."""
    d, b = cfg.head_dim, cfg.block_size
    q = num_blocks * b
    linears = linear_flops(cfg, context_tokens=context_tokens, num_blocks=num_blocks, first_rows=num_blocks + 1,
                           last_rows=num_blocks * (b - 1))
    attention = 0.0
    for layer_type in cfg.layer_types:
        if layer_type == FULL_ATTENTION:
            pairs = b * prefix_keys + num_blocks * b * b
        else:  # sliding: each query sees at most the window, fewer near a document's start
            pairs = min(b * prefix_keys + num_blocks * b * b, q * (cfg.sliding_window or 0))
        attention += 3 * 2 * 2 * pairs * d * cfg.num_attention_heads
    lm_head = 2 * 2 * num_blocks * (b - 1) * cfg.hidden_size * cfg.vocab_size
    return StepFlops(linears=linears, attention=float(attention), lm_head=float(lm_head))


def anchors_within(cfg: DrafterConfig, *, context_tokens: int, flops: float) -> int:
    """The most anchors (blocks) a step over `context_tokens` context tokens can hold at a cost of at
    most `flops`, as `step_flops` counts it without the prefix's attention (at least one anchor)."""
    def cost(blocks: int) -> float:
        return step_flops(cfg, context_tokens=context_tokens, num_blocks=blocks, prefix_keys=0).total

    per_anchor = (cost(1001) - cost(1)) / 1000  # each anchor adds its block's rows: linear in the anchors
    return max(1, 1 + int((flops - cost(1)) // per_anchor))


__all__ = ["PEAK_BF16_FLOPS", "StepFlops", "anchors_within", "device_peak_flops", "linear_flops", "step_flops"]
