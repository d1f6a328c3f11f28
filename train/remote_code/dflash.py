"""DFlash draft model for transformers: `AutoModel.from_pretrained(export_dir, trust_remote_code=True)`.

dflash-cache's export writes this file next to config.json, whose `auto_map` points here, so that
loaders which expect the published DFlash checkpoint layout get the real drafter instead of a
plain Qwen3 model. Self-contained on purpose: torch and transformers are all it needs.

The drafter: `fc` fuses the concatenated target features of `dflash_config["target_layer_ids"]`
(layer k's output, transformers' `hidden_states[k + 1]`) and `hidden_norm` normalises them into the
context. Every one of `layers` takes keys and values from [context ; block] and queries from the
block only (Qwen3 per-head q/k RMSNorm, SwiGLU MLP, pre-norm); `norm` closes. There is no embedding
and no LM head: the target's embed the block (the anchor token, then mask tokens) and turn the
output into draft logits.

Masks (those dflash-cache trains with, and SGLang and vLLM serve with): in a full-attention layer
every block token sees every key. A sliding-attention layer counts its window back from each query:
a key is visible iff 0 <= query position - key position < sliding_window, which also makes the block
causal. The window is measured in key indices: the keys must be consecutive positions ending with
the block (a cache may drop only its oldest entries). An explicit `attention_mask` (bool with
True = visible, or additive float; broadcastable to [batch, heads, queries, keys]) replaces both rules.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache


def config_head_dim(config: Qwen3Config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_rope_theta(config: Qwen3Config) -> float:
    """transformers 5 keeps theta in `rope_parameters`, 4.x in `rope_theta`; only default RoPE exists here."""
    params = getattr(config, "rope_parameters", None)
    params = params if isinstance(params, dict) else {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported by the DFlash drafter (only 'default')")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [batch, L, head_dim], computed from the config in float32 on every call: a stored
    frequency tensor would be rounded by any cast of the model (bf16 moves the angle by radians at
    long positions)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float() / head_dim
    angles = position_ids.float()[..., None] * (1.0 / theta ** exponent)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, L, d]; cos/sin [batch, L, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def window_mask(q_len: int, k_len: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [1, 1, q_len, k_len]: the queries are the last q_len of k_len consecutive positions."""
    delta = torch.arange(k_len - q_len, k_len, device=device)[:, None] - torch.arange(k_len, device=device)[None, :]
    return ((delta >= 0) & (delta < window))[None, None]


class DFlashRMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from [context ; block], appended to the cache if any."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config_head_dim(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if kv_heads is None:  # not reached: Qwen3Config sets it (to num_attention_heads when not given)
            raise ValueError("the config has no num_key_value_heads")
        bias = bool(getattr(config, "attention_bias", False))
        self.layer_idx, self.head_dim, self.scaling = layer_idx, d, d ** -0.5
        self.q_proj = nn.Linear(h, heads * d, bias=bias)
        self.k_proj = nn.Linear(h, kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(heads * d, h, bias=bias)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.sliding_window = config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, L, heads * d] -> [batch, L, heads, d]."""
        return x.view(*x.shape[:2], -1, self.head_dim)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        q_len = hidden.shape[1]
        kv_in = torch.cat((context, hidden), dim=1)
        cos, sin = rope
        q = apply_rope(self.q_norm(self._heads(self.q_proj(hidden))).transpose(1, 2), cos[:, -q_len:], sin[:, -q_len:])
        k = apply_rope(self.k_norm(self._heads(self.k_proj(kv_in))).transpose(1, 2), cos, sin)
        v = self._heads(self.v_proj(kv_in)).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask = attention_mask
        if mask is None and self.sliding_window is not None:
            mask = window_mask(q_len, k.shape[-2], self.sliding_window, q.device)
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                             attn_mask=mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope, attention_mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter over a Qwen3Config carrying `block_size` and
    `dflash_config = {target_layer_ids, mask_token_id}`; tensors named as in published checkpoints."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        if not dflash.get("target_layer_ids"):
            raise ValueError("config.dflash_config has no target_layer_ids: not a DFlash drafter config")
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.mask_token_id = dflash.get("mask_token_id")
        self.block_size = int(getattr(config, "block_size", None) or dflash.get("block_size", 16))
        self.head_dim, self.rope_theta = config_head_dim(config), config_rope_theta(config)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Only for tensors a checkpoint lacks: N(0, initializer_range) linears, ones norms."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=getattr(self.config, "initializer_range", 0.02))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def forward(self, position_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        """noise_embedding [b, Q, H]: the block's embeddings; target_hidden [b, C, N*H]: target features
        of the C context tokens not yet in `past_key_values`; position_ids [b, C + Q]: those tokens'
        positions, then the block's. -> [b, Q, H], the final norm's output (the LM head's input).

        With a cache, each layer appends the keys/values of [context ; block]; crop the block's off
        before the next call, as the public DFlash generation loop does."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel.forward needs noise_embedding and target_hidden")
        cache = past_key_values if past_key_values is not None else kwargs.get("cache")
        dtype = self.fc.weight.dtype
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        hidden = noise_embedding.to(dtype)
        positions = position_ids if position_ids.dim() == 2 else position_ids[None]
        rope = rope_cos_sin(positions, self.head_dim, self.rope_theta, dtype)
        for layer in self.layers:
            hidden = layer(hidden, context, rope, attention_mask, cache)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """Draft logits through the target's LM head."""
        # a linear layer's weight (nn.Module types the attributes it does not declare as Tensor | Module)
        return output_head(hidden.to(output_head.weight.dtype))  # pyright: ignore[reportCallIssue, reportArgumentType]

    def features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """[b, L, N*H] from the target's `hidden_states` (layer k's output is hidden_states[k + 1])."""
        return torch.cat([hidden_states[k + 1] for k in self.target_layer_ids], dim=-1)

    def _propose(self, target: nn.Module, context: torch.Tensor, anchor: int, start: int, cache: Cache,
                 mask_token_id: int) -> list[int]:
        """block_size - 1 greedy drafts after `anchor` (at position `start`); the cache keeps the context."""
        device = context.device
        block = torch.full((1, self.block_size), int(mask_token_id), dtype=torch.long, device=device)
        block[0, 0] = anchor
        positions = torch.arange(start - context.shape[1], start + self.block_size, device=device)[None]
        # the target's embeddings (an HF model's methods, which nn.Module types as Tensor | Module)
        embedded = target.get_input_embeddings()(block)  # pyright: ignore[reportCallIssue]
        hidden = self(position_ids=positions, noise_embedding=embedded, target_hidden=context, past_key_values=cache,
                      use_cache=True)
        truncate_cache(cache, start)
        head = target.get_output_embeddings()  # pyright: ignore[reportCallIssue]
        return self.compute_logits(hidden[0, 1:], head).argmax(-1).tolist()

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      return_acceptance: bool = False):
        """Speculative decoding of one sequence with the target this drafter was trained for.

        Each step drafts block_size - 1 tokens, verifies them with one target forward, and keeps the
        drafts that equal the target's own choices plus the target's next token. Every emitted token
        is thus the target's choice (greedy at temperature 0, sampled otherwise) given the tokens
        before it. -> LongTensor [1, prompt + up to max_new_tokens], stopping after the first stop
        token; with `return_acceptance`, also the tokens emitted per verify step.
        """
        if self.mask_token_id is None:
            raise ValueError("config.dflash_config has no mask_token_id")
        mask_token_id = self.mask_token_id
        self.eval()
        prompt = input_ids[0].tolist()
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        out = run_target(target, input_ids, 0, target_cache)
        tokens = prompt + pick_tokens(out.logits[0, -1:], temperature).tolist()
        context, accepted = self.features(out.hidden_states), []
        while len(tokens) - len(prompt) < max_new_tokens and not stop_index(tokens[len(prompt):], stop_token_ids):
            start = len(tokens) - 1
            drafts = self._propose(target, context, tokens[-1], start, draft_cache, mask_token_id)
            verify = torch.tensor([[tokens[-1], *drafts]], device=input_ids.device)
            out = run_target(target, verify, start, target_cache)
            choice = pick_tokens(out.logits[0], temperature).tolist()
            m = next((i for i, (d, c) in enumerate(zip(drafts, choice, strict=False)) if d != c), len(drafts))
            tokens += drafts[:m] + [choice[m]]
            accepted.append(m + 1)
            truncate_cache(target_cache, start + m + 1)
            context = self.features(out.hidden_states)[:, : m + 1]
        new = tokens[len(prompt):len(prompt) + max_new_tokens]
        new = new[: stop_index(new, stop_token_ids) or len(new)]
        ids = torch.tensor([prompt + new], dtype=torch.long, device=input_ids.device)
        return (ids, accepted) if return_acceptance else ids


def pick_tokens(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, V] -> [n]: argmax at temperature <= 0, else a sample of softmax(logits / temperature)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1)[:, 0]


def stop_index(tokens: list[int], stop_token_ids: list[int] | None) -> int:
    """1 + the index of the first stop token in `tokens`, 0 if none."""
    stops = set(stop_token_ids or ())
    return next((i + 1 for i, t in enumerate(tokens) if t in stops), 0)


def truncate_cache(cache: Cache, length: int) -> None:
    """Keep the first `length` positions (a negative crop removes from the end in every transformers version)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def run_target(target: nn.Module, ids: torch.Tensor, start: int, cache: Cache):
    """The target's forward on `ids` at positions start.., with hidden states; the KV-cache argument is
    `cache` in newer transformers, `past_key_values` in older ones."""
    kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return target(input_ids=ids, position_ids=positions, use_cache=True, output_hidden_states=True, **{kw: cache})
