"""How much memory a training step needs, so defaults fit the machine and bad settings fail early.

A step's memory is the drafter's training state (16 bytes a parameter: fp32 weights, gradients and
two AdamW moments; on a GPU bf16 linear weights and gradients with fp32 masters, the same bytes),
the frozen embedding and LM head, and the activations kept for the backward pass. Activations grow
with the block tokens (anchors x block size: every drafter layer runs on them) and, much less, with
the context tokens of the packed batch (each layer projects them to keys and values). The byte
counts per token below follow eager layers' saved tensors, and for compiled layers the slope of
measured peaks; `bench/memory.py` measures both against the real peak on a GPU (README, "Memory").

Anchors per batch are not bounded by the data: a batch of many short samples holds up to
`num_anchors` per sample. So unless `--max-anchors` is given, the trainer caps them at what fits
(`fit_max_anchors`), and says so once if a batch offers more; an explicit setting that cannot fit is
refused before the first step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from dflash_cache.errors import UserError
from dflash_cache.train.config import DrafterConfig

log = logging.getLogger(__name__)

GIB = 1 << 30
FITS_MEMORY = "that fits this device's memory"  # why a run has the anchor cap fit_max_anchors gives it
USABLE_FRACTION = 0.85    # of the device's free memory at start-up: the allocator fragments, kernels need workspace
CPU_USABLE_FRACTION = 0.6  # of the host's available memory (reader buffers and the OS need the rest)
# Activation tensors kept per token per drafter layer, counted by width: the hidden size H, the MLP
# width I, the key/value width KV and the query width Q (heads x head_dim: H for Qwen3-8B, 6,144
# against H = 5,120 for Qwen3.5-27B's head_dim 256). "low" tensors are bf16 on a GPU (autocast) and
# fp32 on a CPU; "fp32" ones are fp32 everywhere (residual stream, norms). Counted from DFlashLayer's
# saved tensors.
QUERY_LOW = (4, 4, 0, 2)    # q/o/MLP inputs, q, attention out (the last two Q wide); gate, up, silu, product
QUERY_FP32 = (8, 0, 0, 2)   # residual, norms' inputs and outputs; q norm and rope (Q wide)
# Compiled layers (the GPU default) keep fewer: the compiler may recompute cheap element-wise outputs
# (norms, RoPE, the MLP's activation) in the backward rather than save them. What it saves is its
# choice, so these units are not counted tensor by tensor but fitted to the slope of bench/memory.py's
# peaks (NVIDIA H200, 2026-12-04): 763 KiB per block token for its Qwen3-8B-shaped drafter (these units
# give 784), 1,035 KiB for the Qwen3.5-27B-shaped one (1,080; 1,020, too few, when every query-side
# tensor was counted H wide). Which tensors are Q wide is a reading of what FlexAttention's backward
# needs (q and its output) that fits both slopes, not a count.
COMPILED_QUERY_LOW = (2, 2, 0, 2)
COMPILED_QUERY_FP32 = (2, 0, 0, 2)
CONTEXT_LOW = (1, 0, 4, 0)  # the context's k/v projection input, k, v, k rope
CONTEXT_FP32 = (1, 0, 6, 0)  # the fused context row, k norm and rope
LOSS_FP32_PER_QUERY = 4     # x H: final norm output and its gradient (the LM head's dtype: bf16 on a GPU, counted as fp32)
FEATURE_BYTES = 2           # bf16 features, N x H per context token
# Copies of a batch's features alive during a step: the batch's own and its copy padded to the static
# shape, and the same two of the next batch, prepared while the step's backward is queued
# (StepRunner.train_steps).
FEATURE_COPIES = 4


@dataclass(frozen=True, slots=True)
class StepMemory:
    """Bytes of a step as fixed + per_query * block tokens + per_context * context tokens."""

    fixed: int
    per_query: int
    per_context: int

    def bytes(self, anchors: int, block_size: int, context_tokens: int) -> int:
        return self.fixed + self.per_query * anchors * block_size + self.per_context * context_tokens

    def max_anchors(self, available: int, block_size: int, context_tokens: int) -> int:
        """The most anchors whose step fits `available` bytes (0 if not even the context fits)."""
        room = available - self.fixed - self.per_context * context_tokens
        return max(0, room // (self.per_query * block_size))


def step_memory(cfg: DrafterConfig, device: torch.device, *, compiled: bool = False) -> StepMemory:
    """The memory model of one training step of this drafter on this kind of device, with its layers
    compiled (`DFlashDrafter.compile_layers`) or eager."""
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    low = 2 if device.type == "cuda" else 4

    def per_token(low_units: tuple[int, ...], fp32_units: tuple[int, ...]) -> int:
        dims = (h, i, kv, q)
        return sum(u * d * low for u, d in zip(low_units, dims, strict=True)) + \
            sum(u * d * 4 for u, d in zip(fp32_units, dims, strict=True))

    params = cfg.num_target_layers * h * h + 2 * h + cfg.num_layers * (
        2 * h * q + 2 * h * kv + 3 * h * i + 2 * h + 2 * cfg.head_dim)
    head = 2 * cfg.vocab_size * h * low  # embedding and LM head, frozen
    query_units = (COMPILED_QUERY_LOW, COMPILED_QUERY_FP32) if compiled else (QUERY_LOW, QUERY_FP32)
    per_query = cfg.num_layers * per_token(*query_units) + LOSS_FP32_PER_QUERY * h * 4
    features = FEATURE_COPIES * cfg.num_target_layers * h * FEATURE_BYTES
    per_context = cfg.num_layers * per_token(CONTEXT_LOW, CONTEXT_FP32) + features + 3 * h * 4  # + fc, hidden_norm
    return StepMemory(fixed=16 * params + head, per_query=per_query, per_context=per_context)


def available_bytes(device: torch.device) -> int:
    """Memory a step may use: a fraction of what the device has free now."""
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:  # a process limited by set_per_process_memory_fraction gets less
            free = min(free, int(total * fraction(device)) - torch.cuda.memory_reserved(device))
        return int(free * USABLE_FRACTION)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        free = info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, ValueError, IndexError):
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(free * CPU_USABLE_FRACTION)


def fit_max_anchors(cfg: DrafterConfig, device: torch.device, *, context_tokens: int,
                    max_anchors: int | None, available: int | None = None, compiled: bool = False) -> int:
    """The anchors-per-batch cap to train with: `max_anchors` if given and it fits, else the most that fits.

    `context_tokens` is the largest packed batch the source can form (the token budget, or a longer
    single sample). A UserError names the number that would fit when the setting cannot.
    """
    model = step_memory(cfg, device, compiled=compiled)
    room = available_bytes(device) if available is None else available
    fits = model.max_anchors(room, cfg.block_size, context_tokens)
    where = f"{room / GIB:.1f} GiB usable on {device.type}"
    if fits < 1:
        most = max(0, (room - model.fixed - model.per_query * cfg.block_size) // model.per_context)
        raise UserError(f"a packed batch of {context_tokens} tokens does not fit ({where}; the drafter's state "
                        f"alone needs {model.fixed / GIB:.1f} GiB): lower --token-budget to at most {most}")
    if max_anchors is not None:
        if max_anchors > fits:
            need = model.bytes(max_anchors, cfg.block_size, context_tokens) / GIB
            raise UserError(f"--max-anchors {max_anchors} needs about {need:.1f} GiB per step ({where}); at most "
                            f"{fits} fits with --token-budget {context_tokens}")
        return max_anchors
    # No news unless a batch offers more: the trainer says so, once, when one does.
    log.debug("anchors per batch capped at %d to fit %s (a step of %d context tokens: ~%.1f GiB)", fits, where,
              context_tokens, model.bytes(fits, cfg.block_size, context_tokens) / GIB)
    return fits


ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch >= 2.9's name, and the older one
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def prefer_expandable_segments() -> bool:
    """Have the CUDA allocator grow segments in place rather than cache fixed blocks, unless the user
    configured it. Call before the first CUDA allocation; returns whether it set the variable.

    On the bench configuration (README, "Phase 2 speed") this kept 2.7 GiB less reserved beyond what
    the step allocates, at the same step time: memory the anchor cap and other processes can use.
    """
    if any(os.environ.get(v) for v in ALLOC_CONF_VARS):
        return False
    if torch.cuda.is_initialized():  # too late: the allocator has read its settings
        log.debug("CUDA is already initialised; the allocator keeps its settings")
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    if torch.cuda.is_available():
        log.info("CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=%s (set the variable to choose otherwise)",
                 EXPANDABLE_SEGMENTS)
    return True
