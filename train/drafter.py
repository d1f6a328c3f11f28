"""The DFlash drafter: a few Qwen3-style layers whose keys and values also cover the fused target context.

Unbatched and varlen: the context is the packed [T, N*H] target features of a batch, the block
tokens are all A anchor blocks of B tokens flattened to [Q, H]; which query may see which key is
entirely the caller's mask (a `DocumentMasks`, attended document by document; a dense bool
[1, 1, Q, T+Q]; or a FlexAttention BlockMask over the same [Q, T+Q] grid), one per layer type.
The target's embedding and LM head are not part of the drafter: `FrozenTargetHead` holds them as
buffers.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_cache.train.attention_kernels import static_flex_attention
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.masks import DocumentMasks, document_keys
from dflash_cache.train.remote_code.dflash import (
    DFlashRMSNorm as RMSNorm,  # one norm: the exported model code's
)

INIT_STD = 0.02


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def default_flex_attention(q, k, v, **kwargs):
    """flex_attention compiled (once per process) for accelerator tensors, eager on CPU: eager
    FlexAttention materialises the full score matrix, and on CPU it has no backward at all."""
    if q.device.type == "cpu":
        return flex_attention(q, k, v, **kwargs)
    return _compiled_flex_attention()(q, k, v, **kwargs)


class RotaryEmbedding(nn.Module):
    """Default RoPE; cos/sin [L, head_dim] for arbitrary (document-local) positions.

    The frequencies are derived from (head_dim, theta) on every call, in float32 as transformers'
    Qwen3 does, and never held as a tensor: a buffer is rounded by `.to(torch.bfloat16)` (the export
    dtype) and stays rounded after a cast back, which turns the angle by radians at long positions.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """theta ** (-2i / head_dim) for i < head_dim / 2, float32 on `device`."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta ** exponent)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, heads, L, d], cos/sin [L, d]."""
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d
        self.block_size = cfg.block_size
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask, flex_fn, *, distinct_rows: bool = False, scored_only: bool = False) -> torch.Tensor:
        """h [Q, H] (normed block states), context [T, H]; rope covers the T + Q key positions.

        `distinct_rows`: h holds a block input's A + 1 distinct rows (`expand_blocks`); the
        projections run on those and are expanded after. `scored_only`: only the rows of slots
        1..B-1 go through the output projection, [A * (B - 1), H] is returned.
        """
        d, ctx_len = self.head_dim, context.shape[0]
        cos, sin = rope
        kv_len = cos.shape[0]
        q_len = kv_len - ctx_len

        def blocks(x: torch.Tensor) -> torch.Tensor:
            return expand_blocks(x, self.block_size) if distinct_rows else x

        q = self.q_norm(self.q_proj(h).view(h.shape[0], self.num_heads, d))
        q = blocks(q.flatten(1)).view(q_len, self.num_heads, d).transpose(0, 1)[None]
        # One product per weight over [context; block rows]: its weight gradient is one product too,
        # where two would each round to bf16 before their sum.
        rows = torch.cat((context, h))
        k, v = self.k_proj(rows), self.v_proj(rows)
        if distinct_rows:
            k, v = (torch.cat((x[:ctx_len], blocks(x[ctx_len:]))) for x in (k, v))
        k, v = k.view(kv_len, self.num_kv_heads, d), v.view(kv_len, self.num_kv_heads, d)
        k, v = self.k_norm(k).transpose(0, 1)[None], v.transpose(0, 1)[None]
        q = apply_rope(q, cos[ctx_len:], sin[ctx_len:])
        k = apply_rope(k, cos, sin)
        if isinstance(mask, BlockMask):
            out = flex_fn(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        elif isinstance(mask, DocumentMasks):
            out = self._per_document(q, k, v, mask)
        else:
            if mask.dtype != torch.bool or mask.shape[-2:] != (q_len, kv_len):
                raise ValueError(f"dense mask must be bool [1, 1, {q_len}, {kv_len}], got "
                                 f"{mask.dtype} {tuple(mask.shape)}")
            out = self._sdpa(q, k, v, mask)
        out = out[0].transpose(0, 1).reshape(q_len, self.num_heads * d)
        return self.o_proj(scored_rows(out, self.block_size) if scored_only else out)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def _per_document(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: DocumentMasks) -> torch.Tensor:
        """SDPA span by span (a run of one document's blocks over that document's context and those
        blocks): memory follows the documents, where one mask over the packed batch grows with its square."""
        q_len, ctx_len = q.shape[2], k.shape[2] - q.shape[2]
        if (masks.num_queries, masks.num_context) != (q_len, ctx_len):
            raise ValueError(f"document masks are for {masks.num_queries} queries over {masks.num_context} "
                             f"context tokens, got {q_len} over {ctx_len}")
        if not masks.queries:
            return torch.zeros_like(q)
        outs = []
        for ctx, rows, m in zip(masks.context, masks.queries, masks.masks, strict=True):
            k_d, v_d = (document_keys(x, ctx, rows, num_context=ctx_len, dim=2) for x in (k, v))
            outs.append(self._sdpa(q[:, :, rows], k_d, v_d, m))
        return torch.cat(outs, dim=2)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, context: torch.Tensor, rope, mask, flex_fn, distinct_rows: bool = False,
                scored_only: bool = False) -> torch.Tensor:
        """x [Q, H] -> [Q, H]; with `distinct_rows` x is [A + 1, H] (`expand_blocks`), with
        `scored_only` the result is [A * (B - 1), H] (`scored_rows`)."""
        B = self.self_attn.block_size
        attn = self.self_attn(self.input_layernorm(x), context, rope, mask, flex_fn, distinct_rows=distinct_rows,
                              scored_only=scored_only)
        if distinct_rows:
            x = expand_blocks(x, B)
        if scored_only:
            x = scored_rows(x, B)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def expand_blocks(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A + 1, C] -> [A * B, C]: block a's slot 0 is row a, its slots 1..B-1 the last row. A DFlash
    block input is its anchor token then B - 1 mask tokens, so until the first attention mixes them
    the block rows hold only A + 1 distinct states: the first layer normalises and projects those
    and expands after (its backward sums the mask rows' gradients by a reduction)."""
    anchors, mask = rows[:-1], rows[-1:]
    a = anchors.shape[0]
    return torch.cat((anchors[:, None], mask[None].expand(a, block_size - 1, -1)), dim=1).reshape(
        a * block_size, rows.shape[-1])  # explicit sizes: a may be 0


def scored_rows(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A * B, C] -> [A * (B - 1), C]: the rows of slots 1..B-1, the ones the loss scores (slot 0 is
    the given anchor token). The last layer needs slot 0 only as a key and value."""
    a = x.shape[0] // block_size
    return x.view(a, block_size, x.shape[-1])[:, 1:].reshape(a * (block_size - 1), x.shape[-1])


def _run_layer(layer: DFlashLayer, x, context, rope, mask, flex_fn, distinct_rows: bool,
               scored_only: bool) -> torch.Tensor:
    """One layer's call, the function `compile_layers` compiles (a copy of it per graph: `_own_copy`)."""
    return layer(x, context, rope, mask, flex_fn, distinct_rows, scored_only)


def dynamic_shape_options() -> dict:
    """Inductor settings for the dynamic-shape graphs: torch 2.11's mix-order reduction (the
    RMSNorm backward's row and column sums in one kernel) sizes its workspace inconsistently under
    symbolic sizes, and the drafter's backward failed with `shape '[N, 128]' is invalid` on mixed
    lengths (bench/repro_dynamic_shapes.py). Static-shape graphs keep it."""
    import torch._inductor.config as inductor_config

    return {"triton.mix_order_reduction": False} if hasattr(inductor_config.triton, "mix_order_reduction") else {}


def _own_copy(fn: Callable) -> Callable:
    """`fn` with a code object of its own. torch.compile keeps its graphs, and counts recompiles
    against `recompile_limit` (8), per code object: every drafter compiled in one process (several
    trainers, tests, a notebook) would share one count, and past it dynamo runs the layers eagerly,
    FlexAttention then materialising the full score matrix (an 80 GiB allocation at the bench
    configuration). With its own copy a drafter's graphs are its own, and go when it goes."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _fuse_context(fc: nn.Linear, norm: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """The target features fused into the drafter's context: fc, then hidden_norm."""
    return norm(fc(features.to(fc.weight.dtype)))


def _final_norm(norm: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The final norm, its output rounded to `dtype` (None: the residual's) in the same kernel."""
    out = norm(x)
    return out if dtype is None else out.to(dtype)


class DFlashDrafter(nn.Module):
    """fc + hidden_norm fuse the target features into the context; `layers` denoise the blocks.

    `flex_attention_fn` is what BlockMask layers call: `default_flex_attention` (compiled on GPU,
    eager on CPU, where FlexAttention is forward-only); assign another callable to override it.
    Once `compile_layers` ran, the dynamic-shape graph calls `flex_attention_fn` and the static-shape
    graphs `static_flex_attention_fn` (`dflash_cache.train.attention_kernels`).
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_target_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.flex_attention_fn = default_flex_attention
        self.static_flex_attention_fn = default_flex_attention
        # compile_layers' graphs: (layer, fuse-context, final-norm) for any shape, and per static shape.
        self._dynamic_runners: tuple | None = None
        self._static_runners: dict[tuple[int, int], tuple] = {}

    @property
    def residual_dtype(self) -> torch.dtype:
        """The residual stream's and RoPE's dtype: the norm gains' (float32 when training, also with
        bf16 linear weights: dflash_cache.train.precision)."""
        return self.norm.weight.dtype

    def compile_layers(self, attention_kernels: str = "triton") -> None:
        """Run the layers through torch.compile: norms, RoPE, the MLP's gate and the residual adds fuse
        into a few kernels in forward and backward, and FlexAttention is traced inside the layer.
        A graph per static shape (`forward(static=True)`, see `dflash_cache.train.static_shapes`),
        each built on the first call of that shape (its own code objects: `_own_copy`), and one
        dynamic-shape graph for any shape (`static=False`). Weights and state-dict keys are unchanged.
        `attention_kernels`: 'triton' or 'flash', what FlexAttention lowers to in the static-shape
        graphs (`dflash_cache.train.attention_kernels`; the dynamic one always runs Triton's)."""
        self._dynamic_runners = tuple(self._graph(fn, dynamic=True) for fn in (_run_layer, _fuse_context, _final_norm))
        self._static_runners = {}
        self.flex_attention_fn = flex_attention
        self.static_flex_attention_fn = static_flex_attention(attention_kernels)

    @property
    def compiled(self) -> bool:
        return self._dynamic_runners is not None

    def _graph(self, fn: Callable, *, dynamic: bool) -> Callable:
        """`fn` (a copy of its own: `_own_copy`) under torch.compile: a graph for any shape
        (`dynamic`, with `dynamic_shape_options`) or for the shape it is first called with."""
        return torch.compile(_own_copy(fn), dynamic=dynamic, options=dynamic_shape_options() if dynamic else {})

    def _runners(self, static: bool, eager: bool, shape: tuple[int, int]) -> tuple[tuple, Callable]:
        """(layer, fuse-context and final-norm functions, FlexAttention) for a call: plain ones
        when eager or never compiled, else the dynamic graph's or the static shape's own."""
        dynamic = self._dynamic_runners
        if dynamic is None:  # never compiled
            return (_run_layer, _fuse_context, _final_norm), self.flex_attention_fn
        if eager:
            return (_run_layer, _fuse_context, _final_norm), default_flex_attention
        if not static:
            return dynamic, self.flex_attention_fn
        runners = self._static_runners.get(shape)
        if runners is None:
            runners = self._static_runners[shape] = tuple(
                self._graph(fn, dynamic=False) for fn in (_run_layer, _fuse_context, _final_norm))
        return runners, self.static_flex_attention_fn

    def forward(self, features: torch.Tensor, ctx_positions: torch.Tensor, block_embeds: torch.Tensor,
                block_positions: torch.Tensor, masks: dict, static: bool = False, *, eager: bool = False,
                distinct_rows: bool = False, scored_only: bool = False,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """features [T, N*H], ctx_positions [T], block_embeds [Q, H], block_positions [Q],
        masks {layer type: DocumentMasks, dense bool [1, 1, Q, T+Q] or BlockMask} -> [Q, H] after the
        final norm. With compiled layers: `static` runs the graphs built for exactly these sizes,
        otherwise the dynamic-shape graph; `eager` runs the layers uncompiled (a static shape whose
        compiled step failed: dflash_cache.train.static_shapes.ShapeRecord).

        What training asks for, the same computation on fewer rows: `distinct_rows`, block_embeds
        is [A + 1, H], each block's anchor embedding then the mask token's (`expand_blocks`);
        `scored_only`, only slots 1..B-1 come out, [A * (B - 1), H] (`scored_rows`).
        `out_dtype`: the dtype the states come out in (the LM head's, in training), rounded by the
        final norm's kernel rather than by a pass of its own; the gradient comes back in it too.
        """
        dtype = self.residual_dtype
        (run, fuse_context, final_norm), flex_fn = self._runners(
            static, eager, (int(features.shape[0]), int(block_positions.shape[0])))
        context = fuse_context(self.fc, self.hidden_norm, features)
        x = block_embeds.to(dtype)
        rope = self.rotary(torch.cat((ctx_positions, block_positions)), dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            try:
                mask = masks[layer.layer_type]
            except KeyError:
                raise KeyError(f"no mask for layer type {layer.layer_type!r}; got {sorted(masks)}") from None
            x = run(layer, x, context, rope, mask, flex_fn, distinct_rows and i == 0,
                    scored_only and i == last)
        return final_norm(self.norm, x, out_dtype)


def init_drafter(cfg: DrafterConfig, seed: int) -> DFlashDrafter:
    """A drafter with deterministic weights: N(0, 0.02) linears, ones norms; global RNG untouched."""
    model = DFlashDrafter(cfg)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
    return model


class FrozenTargetHead(nn.Module):
    """The target's embedding and LM head weights [V, H] as non-persistent buffers: never trained,
    never saved with the drafter. A tied target shares one tensor for both."""

    embed_weight: torch.Tensor  # the buffers, declared for type checkers (nn.Module's are Tensor | Module)
    lm_weight: torch.Tensor

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        if embed_weight.shape != lm_head_weight.shape:
            raise ValueError(f"embedding {tuple(embed_weight.shape)} and LM head {tuple(lm_head_weight.shape)} "
                             "shapes differ")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_weight", lm_head_weight.detach(), persistent=False)

    @classmethod
    def from_target(cls, model: nn.Module) -> FrozenTargetHead:
        # an HF model's methods (nn.Module types the attributes it does not declare as Tensor | Module)
        embed = model.get_input_embeddings().weight  # pyright: ignore[reportCallIssue]
        out = None
        if hasattr(model, "get_output_embeddings"):
            out = model.get_output_embeddings()  # pyright: ignore[reportCallIssue]
        if out is None:
            if not getattr(model.config, "tie_word_embeddings", False):
                raise ValueError(f"{type(model).__name__} has no LM head and does not tie its embeddings")
            lm = embed
        else:
            lm = out.weight
            if getattr(out, "bias", None) is not None:
                raise ValueError("an LM head with a bias is not supported")
        return cls(embed, lm)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits; for small inputs only (training uses dflash_cache.train.loss.chunked_weighted_ce)."""
        return hidden.to(self.lm_weight.dtype) @ self.lm_weight.T
