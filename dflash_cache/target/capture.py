"""Capturing the target's selected layers, packed over real tokens as each layer finishes.

Each selected layer's output is packed by a forward hook straight into its column block of the
[T, n_layers * H] result, so no padded [B, L, n_layers * H] tensor ever exists. `ForwardInputs`
lays rows out as the capture's arguments; extraction and the live source both build them here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from dflash_cache.target.model import decoder_of


def prebuilt_mask_ok(config) -> bool:
    """Whether we may hand SDPA our own 4-D mask: SDPA attention and every layer full attention.

    Sliding-window layers need Hugging Face's windowed masks and linear-attention (Gated DeltaNet)
    layers read the 2-D padding mask, so hybrid and alternating targets get the 2-D mask."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return impl == "sdpa" and all(t == "full_attention" for t in layer_types)


def causal_padding_mask(attention: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool, True where query t may see key s: s <= t and s is a real token.

    The same mask Hugging Face builds for right-padded SDPA batches, but made on the device
    without looking at the data: HF's own path calls `.all()` on the 2-D mask, a host sync per
    forward that leaves the GPU idle while the CPU catches up.
    """
    length = attention.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention.device).tril_()
    return causal[None, None] & attention.bool()[:, None, None, :]


def run_backbone(decoder: nn.Module, input_ids: torch.Tensor, attention: torch.Tensor) -> None:
    """The cut decoder stack on a right-padded batch (outputs are taken by hooks)."""
    mask = causal_padding_mask(attention) if prebuilt_mask_ok(decoder.config) else attention
    decoder(input_ids=input_ids, attention_mask=mask, use_cache=False)


@dataclass(frozen=True)
class ForwardInputs:
    """Rows laid out for the target's forward: right-padded ids, their attention mask, and the flat
    indices b * L + t of the real tokens (which the capture packs by). Host tensors, pinned on CUDA."""

    input_ids: torch.Tensor  # int64 [B, L], right-padded with 0
    attention: torch.Tensor  # int64 [B, L]
    gather: torch.Tensor     # int64 [T]

    @classmethod
    def of_rows(cls, input_ids: list[np.ndarray], pin: bool) -> ForwardInputs:
        lengths = [len(ids) for ids in input_ids]
        ids = np.zeros((len(input_ids), max(lengths)), dtype=np.int64)
        attention = np.zeros_like(ids)
        for i, (row, n) in enumerate(zip(input_ids, lengths, strict=True)):
            ids[i, :n] = row
            attention[i, :n] = 1
        tensors = [torch.from_numpy(a) for a in (ids, attention, np.flatnonzero(attention.reshape(-1)))]
        if pin:
            tensors = [t.pin_memory() for t in tensors]
        return cls(*tensors)

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention, gather) copied to `device` without waiting: the capture's arguments."""
        input_ids, attention, gather = (t.to(device, non_blocking=True)
                                        for t in (self.input_ids, self.attention, self.gather))
        return input_ids, attention, gather


class HiddenStateCapture:
    """Runs the cut target and returns the selected layers packed over real tokens.

    `__call__(input_ids [B, L], attention_mask [B, L], gather [T])` returns bf16 [T, n*H] where
    `gather` holds the flat indices b * L + t of the real tokens (built on the host, so packing
    needs no `nonzero()` and no host synchronisation).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:
        self.decoder = decoder_of(model)
        self.layer_ids = layer_ids
        # an HF model's config (nn.Module types the attributes it does not declare as Tensor | Module)
        config = model.config
        self.hidden_size = int(config.hidden_size)  # pyright: ignore[reportAttributeAccessIssue, reportArgumentType]
        if hasattr(self.decoder, "norm"):
            self.decoder.norm = nn.Identity()  # the post-norm output of the cut stack is unused
        self._out: torch.Tensor | None = None
        self._gather: torch.Tensor | None = None
        self._busy = threading.Lock()  # the hooks read per-call state: one call at a time
        layers = cast(nn.ModuleList, self.decoder.layers)  # as decoder_of checked (nn.Module types it loosely)
        self._hooks = [layers[layer_id].register_forward_hook(self._hook(col))
                       for col, layer_id in enumerate(layer_ids)]

    def remove(self) -> None:
        """Detach the hooks, leaving the model as it was (benchmarks reuse one model)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, col: int):
        h = self.hidden_size

        def pack(_module: nn.Module, _args: tuple, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            assert self._out is not None and self._gather is not None
            flat = hidden.reshape(-1, h).index_select(0, self._gather)
            self._out[:, col * h : (col + 1) * h].copy_(flat)

        return pack

    @torch.no_grad()  # not inference_mode: the live source hands these features to autograd
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
        n_tokens = gather.shape[0]
        width = len(self.layer_ids) * self.hidden_size
        with self._busy:
            self._out = torch.empty(n_tokens, width, dtype=torch.bfloat16, device=input_ids.device)
            self._gather = gather
            try:
                run_backbone(self.decoder, input_ids, attention_mask)
                return self._out
            finally:
                self._out, self._gather = None, None
