"""Speculative decoding with an exported DFlash drafter, to measure real acceptance (tau).

Greedy, one sequence at a time, the target's cache rolled back on rejection (`TargetSession`):

    prefill the prompt -> anchor = the target's next token
    loop: the drafter proposes B-1 tokens after the anchor from the target's hidden states of every
          position before it (the same context, positions and masks as in training);
          the target verifies [anchor, drafts] in one forward; the longest matching prefix of drafts
          is accepted plus the target's own next token (the bonus), which becomes the next anchor.

Every emitted token is the target's own greedy choice, so the output must equal plain greedy
decoding; `evaluate` checks it. tau is the mean number of tokens emitted per verify forward.

A KV cache is rolled back by cropping its rejected tail. The recurrent state of a linear-attention
layer (Gated DeltaNet in Qwen3.5/3.6) cannot be cropped: it has already folded the rejected tokens
in. Those layers are snapshotted before each verify forward; on a rejection the snapshot is put back,
the attention layers drop the whole verified block, and the target runs once more over the accepted
tokens alone. That extra forward is counted in the speculative tokens/s, not in tau.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from dflash_cache.data.formats import IGNORE_INDEX
from dflash_cache.errors import UserError
from dflash_cache.train.anchors import Blocks
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter, FrozenTargetHead
from dflash_cache.train.masks import build_masks

if TYPE_CHECKING:
    from dflash_cache.data.chat import ChatSpec

log = logging.getLogger(__name__)

PROGRESS_LINES = 20  # progress lines per evaluation, about (the first and the last prompt's always)


def _cache_kw(model: nn.Module) -> str:
    """Newer transformers name the KV-cache argument `cache`, older ones `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _features(hidden_states: tuple[torch.Tensor, ...], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """[L, N*H] from HF hidden_states (layer k's output is hidden_states[k + 1]), batch row 0."""
    return torch.cat([hidden_states[k + 1][0] for k in layer_ids], dim=-1)


def new_cache(model: nn.Module):
    """An empty cache. Every layer keeps all its keys and values (so any tail can be cropped, sliding
    layers included), except that a target with linear-attention layers gets transformers' layout for
    them (conv and recurrent states)."""
    from transformers import DynamicCache

    from dflash_cache.target.model import has_linear_attention, text_config

    hybrid = has_linear_attention(text_config(model.config))
    # (an HF model's config: nn.Module types the attributes it does not declare as Tensor | Module)
    return DynamicCache(config=model.config) if hybrid else DynamicCache()  # pyright: ignore[reportArgumentType]


@torch.no_grad()
def greedy_generate(target: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with a cache: the reference speculative decoding must reproduce."""
    device = next(target.parameters()).device
    kw = {_cache_kw(target): new_cache(target), "use_cache": True}
    out = target(input_ids=torch.tensor([prompt], device=device), **kw)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens:
        out = target(input_ids=torch.tensor([[tokens[-1]]], device=device), **kw)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def _is_recurrent(layer) -> bool:
    """A cache layer holding linear-attention state (conv and recurrent states), maybe beside a KV cache."""
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


@dataclass(frozen=True)
class _RecurrentSnapshot:
    """One linear-attention cache layer as it was before a verify forward: its conv and recurrent
    states and, where transformers keeps one (5.25 does), its own token count, from which the
    model takes the next positions: with the states alone the positions would run k tokens ahead."""

    layer: Any
    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    length: torch.Tensor | None

    @classmethod
    def of(cls, layer) -> _RecurrentSnapshot:
        length = getattr(layer, "cumulative_length_linear", None)
        return cls(layer, {i: t.clone() for i, t in layer.conv_states.items() if t is not None},
                   {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None},
                   length.clone() if isinstance(length, torch.Tensor) else None)

    def restore(self) -> None:
        for i, t in self.conv.items():
            self.layer.conv_states[i].copy_(t)
        for i, t in self.recurrent.items():
            self.layer.recurrent_states[i].copy_(t)
        if self.length is not None:
            self.layer.cumulative_length_linear.copy_(self.length)


class TargetSession:
    """The target with its cache over one sequence: `forward` appends tokens, `keep(n)` after a
    forward of k tokens keeps only its first n of them (see the module doc for how)."""

    def __init__(self, target: nn.Module, *, hidden_states: bool = True) -> None:
        self.target = target
        self.device = next(target.parameters()).device
        self.cache = new_cache(target)
        self.kw = {_cache_kw(target): self.cache, "use_cache": True, "output_hidden_states": hidden_states}
        self._snapshot: list[_RecurrentSnapshot] | None = None
        self._last: torch.Tensor | None = None

    def _recurrent_layers(self) -> list:
        return [layer for layer in getattr(self.cache, "layers", ()) if _is_recurrent(layer)]

    def forward(self, ids: torch.Tensor):
        """Run the target on ids [1, k] after everything kept so far; remembers how to undo it."""
        self._snapshot = [_RecurrentSnapshot.of(layer) for layer in self._recurrent_layers()]
        self._last = ids
        return self.target(input_ids=ids, **self.kw)

    def keep(self, n: int) -> None:
        """Keep the first n tokens of the last forward, drop the rest."""
        last = self._last
        if last is None:
            raise RuntimeError("keep() before forward(): there is no forward to keep tokens of")
        k = int(last.shape[1])
        if n == k:
            return
        if not self._snapshot:
            self.cache.crop(-(k - n))  # a negative crop removes that many trailing tokens
            return
        self._drop_attention_tail(k)
        for snapshot in self._snapshot:
            snapshot.restore()
        self.target(input_ids=last[:, :n], **{**self.kw, "output_hidden_states": False})

    def _drop_attention_tail(self, k: int) -> None:
        """Remove the last k tokens from every layer's key/value cache (linear-attention layers have none)."""
        from transformers.cache_utils import DynamicLayer

        for layer in self.cache.layers:
            if isinstance(layer, DynamicLayer):
                DynamicLayer.crop(layer, -k)  # the KV part only, also of a hybrid layer
            elif not _is_recurrent(layer):  # an attention layer (transformers' layer base type has no crop)
                layer.crop(-k)  # pyright: ignore[reportAttributeAccessIssue]


def _one_block(anchor_pos: int, cfg: DrafterConfig, device: torch.device) -> Blocks:
    """The Blocks description of a single block at `anchor_pos` (labels/weights unused here)."""
    b = cfg.block_size
    zeros = torch.zeros(1, dtype=torch.int64, device=device)
    return Blocks(token_index=zeros, doc=zeros, anchor_pos=zeros + anchor_pos,
                  input_ids=torch.zeros(1, b, dtype=torch.int64, device=device),
                  position_ids=torch.arange(anchor_pos, anchor_pos + b, device=device)[None],
                  labels=torch.full((1, b), IGNORE_INDEX, device=device), weights=torch.zeros(1, b, device=device),
                  block_size=b)


@torch.no_grad()
def speculative_generate(target: nn.Module, drafter: DFlashDrafter, head: FrozenTargetHead, cfg: DrafterConfig,
                         prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(tokens, accepted per verify step). Block size and layer ids come from the drafter's config."""
    session = TargetSession(target)
    device = session.device
    layers, b = tuple(cfg.target_layer_ids), cfg.block_size
    out = session.forward(torch.tensor([prompt], device=device))
    context = _features(out.hidden_states, layers)
    anchor, pos = int(out.logits[0, -1].argmax()), len(prompt)
    tokens, accepted = [anchor], []
    while len(tokens) < max_new_tokens:
        block_ids = torch.tensor([anchor] + [cfg.mask_token_id] * (b - 1), device=device)
        blocks = _one_block(pos, cfg, device)
        masks = build_masks(torch.zeros(pos, dtype=torch.int64, device=device), torch.arange(pos, device=device),
                            blocks, layer_types=cfg.layer_types, sliding_window=cfg.sliding_window, backend="dense")
        hidden = drafter(context, torch.arange(pos, device=device), head.embed(block_ids),
                         blocks.position_ids[0], masks)
        drafts = (hidden[1:].to(head.lm_head_weight.dtype) @ head.lm_head_weight.T).argmax(-1)
        out = session.forward(torch.cat([block_ids[:1], drafts])[None])
        choice = out.logits[0].argmax(-1)  # choice[i]: the target's token after verify[i]
        m = 0
        while m < b - 1 and int(drafts[m]) == int(choice[m]):
            m += 1
        tokens += [int(t) for t in drafts[:m]] + [int(choice[m])]
        accepted.append(m + 1)
        context = torch.cat([context, _features(out.hidden_states, layers)[: m + 1]])
        session.keep(m + 1)
        anchor, pos = int(choice[m]), pos + m + 1
    return tokens[:max_new_tokens], accepted


@dataclass
class EvalResult:
    tau: float
    histogram: dict[int, int]
    target_tok_s: float
    speculative_tok_s: float
    lossless: bool
    mismatches: list[int] = field(default_factory=list)  # prompt indices whose output differed
    steps_per_prompt: list[int] = field(default_factory=list)  # verify forwards each prompt took


def _per_second(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds else 0.0


def evaluate(target: nn.Module, drafter: DFlashDrafter, head: FrozenTargetHead, cfg: DrafterConfig,
             prompts: list[list[int]], max_new_tokens: int) -> EvalResult:
    """Greedy and speculative decoding of every prompt. Progress is logged after the first prompt, then
    every few (about PROGRESS_LINES lines in all) and after the last: on a large target one prompt can
    take a minute."""
    accepted: list[int] = []
    mismatches, steps = [], []
    t_greedy = t_spec = 0.0
    every = max(1, -(-len(prompts) // PROGRESS_LINES))
    log.info("eval: decoding %d prompts, %d new tokens each, greedily and speculatively (block size %d)",
             len(prompts), max_new_tokens, cfg.block_size)
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        reference = greedy_generate(target, prompt, max_new_tokens)
        t1 = time.perf_counter()
        tokens, acc = speculative_generate(target, drafter, head, cfg, prompt, max_new_tokens)
        t2 = time.perf_counter()
        t_greedy, t_spec = t_greedy + t1 - t0, t_spec + t2 - t1
        accepted += acc
        steps.append(len(acc))
        if tokens != reference:
            mismatches.append(i)
            log.warning("prompt %d: speculative output differs from greedy at token %d", i,
                        next(j for j, (a, r) in enumerate(zip(tokens, reference, strict=True)) if a != r))
        done = i + 1
        if done == 1 or done % every == 0 or done == len(prompts):
            made = done * max_new_tokens
            log.info("eval: %d/%d prompts, tau %.3f, speculative %.1f tok/s, target-only %.1f tok/s", done,
                     len(prompts), float(np.mean(accepted)), _per_second(made, t_spec), _per_second(made, t_greedy))
    n = len(prompts) * max_new_tokens
    counts = np.bincount(accepted, minlength=cfg.block_size + 1)
    return EvalResult(
        tau=float(np.mean(accepted)) if accepted else 0.0,
        histogram={k: int(counts[k]) for k in range(1, cfg.block_size + 1)},
        target_tok_s=_per_second(n, t_greedy),
        speculative_tok_s=_per_second(n, t_spec),
        lossless=not mismatches,
        mismatches=mismatches,
        steps_per_prompt=steps,
    )


def load_prompts(data: str, limit: int, chat: ChatSpec | None = None,
                 vocab_size: int | None = None) -> list[list[int]]:
    """The first `limit` rows' prompts: each row's tokens before its first supervised one (for chat
    data, `chat` says whose template renders it: the conversation up to the first assistant turn).
    Given the target's `vocab_size`, a row holding a token id outside it is a UserError naming the
    row and the id (the target's embedding would fail on it with a traceback)."""
    from dflash_cache.data.inputs import open_data

    dataset = open_data(data, limit, chat=chat)
    if vocab_size is not None:
        try:
            dataset.scan(vocab_size=vocab_size, max_len=None)
        except UserError as e:
            raise UserError(f"--data {data}: {e}") from None
    prompts = []
    for row in dataset.read_rows(0, dataset.num_rows, max_len=None):
        first = int(np.argmax(row.loss_mask)) if row.loss_mask.any() else len(row.input_ids)
        if first > 0:
            prompts.append(row.input_ids[:first].astype(np.int64).tolist())
    return prompts
