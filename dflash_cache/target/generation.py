"""Batched greedy generation with a causal LM: the demo rows and `dflash-cache regenerate` both make
their completions here, so a completion means the same thing in both."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn


@torch.inference_mode()
def greedy_complete(model: nn.Module, prompts: list[list[int]], new_tokens: int, *, pad_id: int,
                    stop_ids: Iterable[int] = ()) -> np.ndarray:
    """Greedy completions of prompts batched together, left-padded with `pad_id`: [len(prompts), n].

    With no `stop_ids`, every completion is exactly `new_tokens` long. With them, generation ends once
    every row has produced one (n <= new_tokens; a finished row is padded with `pad_id`): cut each
    row with `cut_at_stop`.
    """
    p_len = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.full((len(prompts), p_len), pad_id, dtype=torch.int64)
    attention = torch.zeros((len(prompts), p_len), dtype=torch.int64)
    for r, p in enumerate(prompts):  # left padding: the prompt at the right end
        ids[r, p_len - len(p):] = torch.as_tensor(p, dtype=torch.int64)
        attention[r, p_len - len(p):] = 1
    stops = sorted(set(stop_ids))
    kwargs = {"eos_token_id": stops} if stops else {"min_new_tokens": new_tokens}
    # an HF model's method (nn.Module types the attributes it does not declare as Tensor | Module)
    out = model.generate(  # pyright: ignore[reportCallIssue]
        input_ids=ids.to(device), attention_mask=attention.to(device), max_new_tokens=new_tokens,
        do_sample=False, pad_token_id=pad_id, **kwargs)
    return out[:, p_len:].cpu().numpy()


def cut_at_stop(completion: np.ndarray, stop_ids: Iterable[int], *, keep_stop: bool = True) -> np.ndarray:
    """The completion up to its first stop token (included when `keep_stop`); all of it if none."""
    hits = np.flatnonzero(np.isin(completion, list(stop_ids)))
    if not hits.size:
        return completion
    return completion[: hits[0] + (1 if keep_stop else 0)]
