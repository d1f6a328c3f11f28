from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from dflash_cache.target.tiny import build_tiny_target, tiny_config
from dflash_cache.train.anchors import sample_anchors
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import DFlashDrafter, FrozenTargetHead, init_drafter
from dflash_cache.train.masks import document_masks
from tests.train.test_masks import make_batch

LAYER_IDS = (1, 3, 5)
T, A, B = 14, 3, 4
Q = A * B


@pytest.fixture(scope="module")
def cfg() -> DrafterConfig:
    return DrafterConfig.from_target(tiny_config(), LAYER_IDS, block_size=B)


@pytest.fixture(scope="module")
def drafter(cfg) -> DFlashDrafter:
    return init_drafter(cfg, seed=0).eval()


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"fc.weight": (h, cfg.num_target_layers * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h), p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h), p + "self_attn.o_proj.weight": (h, nq),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def anchors():
    """Context positions 0..T-1; block a starts at anchor a (position 3a+2) and sees context < its anchor
    plus its own block bidirectionally."""
    ctx_pos = torch.arange(T)
    anchor = torch.tensor([2, 5, 9])
    block_pos = (anchor[:, None] + torch.arange(B)[None]).reshape(-1)
    return ctx_pos, anchor, block_pos


def mask_mod_for(anchor: torch.Tensor, see_context: bool = True):
    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // B
        in_ctx = (kv_idx < T) & (kv_idx < anchor[blk]) & see_context
        kv_blk = (kv_idx - T) // B
        in_block = (kv_idx >= T) & (kv_blk == blk)
        return in_ctx | in_block

    return mask_mod


def dense_mask(mask_mod) -> torch.Tensor:
    q = torch.arange(Q)[:, None]
    kv = torch.arange(T + Q)[None, :]
    return mask_mod(0, 0, q, kv)[None, None]


def inputs(cfg, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(T, cfg.num_target_layers * cfg.hidden_size, generator=g).to(dtype)
    embeds = torch.randn(Q, cfg.hidden_size, generator=g).to(dtype)
    return features, embeds


def test_state_dict_names_and_shapes(cfg, drafter):
    sd = drafter.state_dict()
    assert cfg.num_layers == 5 and cfg.hidden_size == 128
    assert len(sd) == 58
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected_shapes(cfg)
    assert {n for n, _ in drafter.named_parameters()} == set(sd)
    assert not any("embed" in k or "lm_head" in k for k in sd)
    assert all(p.requires_grad for p in drafter.parameters())


def test_config_from_tiny_target(cfg):
    tc = tiny_config()
    assert cfg.rope_theta == 10000.0
    assert cfg.num_key_value_heads == 2 and cfg.num_attention_heads == 4 and cfg.head_dim == 32
    assert cfg.mask_token_id == tc.vocab_size - 1
    assert cfg.num_target_layers == 3 and cfg.target_num_hidden_layers == 8
    assert cfg.layer_types == ("full_attention",) * 5
    with pytest.raises(ValueError):
        dataclasses.replace(
            DrafterConfig.from_target(tc, LAYER_IDS),
            layer_types=("sliding_attention",) * 5)
    with pytest.raises(ValueError):
        dataclasses.replace(
            DrafterConfig.from_target(tc, LAYER_IDS),
            layer_types=("full_attention",) * 4)
    with pytest.raises(ValueError):
        DrafterConfig.from_target(tc, LAYER_IDS, block_size=1)
    with pytest.raises(ValueError):
        DrafterConfig.from_target(tc, LAYER_IDS, mask_token_id=tc.vocab_size)
    # transformers 4.x style: top-level rope_theta; Qwen3's vocabulary gets its unused row 151669.
    old = SimpleNamespace(**{k: getattr(tc, k) for k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "max_position_embeddings", "num_hidden_layers")}, vocab_size=151936, rope_theta=1e6)
    c4 = DrafterConfig.from_target(old, LAYER_IDS)
    assert c4.rope_theta == 1e6 and c4.mask_token_id == 151669


def test_init_is_deterministic(cfg):
    a, b, c = init_drafter(cfg, 7), init_drafter(cfg, 7), init_drafter(cfg, 8)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.fc.weight, c.fc.weight)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert abs(a.fc.weight.std().item() - 0.02) < 0.002


def test_output_shape_and_context_injection(cfg, drafter):
    ctx_pos, anchor, block_pos = anchors()
    features, embeds = inputs(cfg)
    masks = {"full_attention": dense_mask(mask_mod_for(anchor))}
    with torch.no_grad():
        out = drafter(features, ctx_pos, embeds, block_pos, masks)
        assert out.shape == (Q, cfg.hidden_size) and torch.isfinite(out).all()
        out2 = drafter(features + 1.0, ctx_pos, embeds, block_pos, masks)
        assert (out - out2).abs().max() > 1e-3
        hidden_ctx = {"full_attention": dense_mask(mask_mod_for(anchor, see_context=False))}
        a = drafter(features, ctx_pos, embeds, block_pos, hidden_ctx)
        b = drafter(torch.randn_like(features), ctx_pos, embeds, block_pos, hidden_ctx)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_out_dtype_rounds_the_final_states_and_takes_their_gradient_back(cfg):
    """Training asks for the LM head's dtype: the final norm's output rounded, and a gradient in that
    dtype reaches every parameter as the float32 output's would (here: the rounded gradient)."""
    ctx_pos, anchor, block_pos = anchors()
    features, embeds = inputs(cfg)
    masks = {"full_attention": dense_mask(mask_mod_for(anchor))}
    g = torch.Generator().manual_seed(3)
    upstream = torch.randn(Q, cfg.hidden_size, generator=g).bfloat16()
    runs = []
    for out_dtype in (None, torch.bfloat16):
        drafter = init_drafter(cfg, seed=0)
        out = drafter(features, ctx_pos, embeds, block_pos, masks, out_dtype=out_dtype)
        out.backward(upstream.to(out.dtype))
        runs.append((out.detach(), {n: p.grad for n, p in drafter.named_parameters()}))
    (ref, ref_grads), (got, got_grads) = runs
    assert ref.dtype == torch.float32 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref.bfloat16(), rtol=0, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=0, msg=name)


def test_hidden_keys_are_invisible(cfg, drafter):
    ctx_pos, anchor, block_pos = anchors()
    features, embeds = inputs(cfg)
    masks = {"full_attention": dense_mask(mask_mod_for(anchor))}
    with torch.no_grad():
        out = drafter(features, ctx_pos, embeds, block_pos, masks)
        # Context tokens at or past anchor 2 (position 2) are hidden from block 0 only.
        f2 = features.clone()
        f2[anchor[0]:] += torch.randn_like(f2[anchor[0]:])
        out2 = drafter(f2, ctx_pos, embeds, block_pos, masks)
        torch.testing.assert_close(out2[:B], out[:B], rtol=0, atol=0)
        assert (out2[B:] - out[B:]).abs().max() > 1e-3
        # Block 2's tokens are hidden from blocks 0 and 1.
        e2 = embeds.clone()
        e2[2 * B:] += 1.0
        out3 = drafter(features, ctx_pos, e2, block_pos, masks)
        torch.testing.assert_close(out3[:2 * B], out[:2 * B], rtol=0, atol=0)
        assert (out3[2 * B:] - out[2 * B:]).abs().max() > 1e-3


def test_positions_matter(cfg, drafter):
    ctx_pos, anchor, block_pos = anchors()
    features, embeds = inputs(cfg)
    masks = {"full_attention": dense_mask(mask_mod_for(anchor))}
    with torch.no_grad():
        a = drafter(features, ctx_pos, embeds, block_pos, masks)
        b = drafter(features, ctx_pos + 5, embeds, block_pos + 5, masks)  # RoPE is relative
        c = drafter(features, ctx_pos, embeds, block_pos + 3, masks)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (a - c).abs().max() > 1e-3


def test_dense_and_flex_agree(cfg, drafter):
    ctx_pos, anchor, block_pos = anchors()
    features, embeds = inputs(cfg)
    mask_mod = mask_mod_for(anchor)
    block_mask = create_block_mask(mask_mod, None, None, Q, T + Q, device="cpu", BLOCK_SIZE=8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager flex_attention warns it is unfused
        dense = drafter(features, ctx_pos, embeds, block_pos, {"full_attention": dense_mask(mask_mod)})
        flex = drafter(features, ctx_pos, embeds, block_pos, {"full_attention": block_mask})
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)


def test_layer_types_pick_their_mask():
    cfg = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=2, block_size=B, sliding_window=4),
        layer_types=("sliding_attention", "full_attention"))
    drafter = init_drafter(cfg, 1).eval()
    ctx_pos, anchor, block_pos = anchors()
    features, embeds = inputs(cfg)
    full = dense_mask(mask_mod_for(anchor))
    none = dense_mask(mask_mod_for(anchor, see_context=False))
    with torch.no_grad():
        a = drafter(features, ctx_pos, embeds, block_pos, {"full_attention": full, "sliding_attention": none})
        b = drafter(features, ctx_pos, embeds, block_pos, {"full_attention": full, "sliding_attention": full})
        assert (a - b).abs().max() > 1e-3
        with pytest.raises(KeyError):
            drafter(features, ctx_pos, embeds, block_pos, {"full_attention": full})


def test_bf16_forward_backward(cfg):
    drafter = init_drafter(cfg, 0).to(torch.bfloat16)
    ctx_pos, anchor, block_pos = anchors()
    features, embeds = inputs(cfg, dtype=torch.bfloat16)
    out = drafter(features, ctx_pos, embeds, block_pos, {"full_attention": dense_mask(mask_mod_for(anchor))})
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    assert drafter.fc.weight.grad is not None and torch.isfinite(drafter.fc.weight.grad).all()
    assert list(drafter.rotary.buffers()) == []  # RoPE holds no tensor a cast could round


def test_frozen_target_head():
    target = build_tiny_target(num_layers=2)
    head = FrozenTargetHead.from_target(target)
    assert list(head.parameters()) == []
    assert head.state_dict() == {}
    v, h = tiny_config().vocab_size, tiny_config().hidden_size
    assert head.embed_weight.shape == (v, h) and head.lm_head_weight.shape == (v, h)
    assert not head.embed_weight.requires_grad and not head.lm_head_weight.requires_grad
    ids = torch.tensor([0, 5, v - 1])
    torch.testing.assert_close(head.embed(ids), target.get_input_embeddings()(ids))
    torch.testing.assert_close(head.lm_head_weight, target.lm_head.weight)


def _hf_reference(drafter: DFlashDrafter, cfg: DrafterConfig, features, ctx_pos, embeds, block_pos, dense):
    """The public DFlash forward (z-lab's Qwen3DFlashAttention layout) from transformers' Qwen3 parts."""

    from transformers.models.qwen3 import modeling_qwen3 as hf

    tc = tiny_config()
    rotary = hf.Qwen3RotaryEmbedding(tc)

    def rms(x, weight):
        norm = hf.Qwen3RMSNorm(weight.shape[0], eps=cfg.rms_norm_eps)
        norm.weight.data.copy_(weight)
        return norm(x)

    additive = torch.zeros(dense.shape).masked_fill(~dense, float("-inf"))
    target_hidden = rms(features[None] @ drafter.fc.weight.T, drafter.hidden_norm.weight)
    x = embeds[None]
    cos, sin = rotary(x, torch.cat((ctx_pos, block_pos))[None])
    d = cfg.head_dim
    for layer in drafter.layers:
        at = layer.self_attn
        h = rms(x, layer.input_layernorm.weight)
        q = rms((h @ at.q_proj.weight.T).view(1, Q, -1, d), at.q_norm.weight).transpose(1, 2)
        k = torch.cat([target_hidden @ at.k_proj.weight.T, h @ at.k_proj.weight.T], 1).view(1, T + Q, -1, d)
        v = torch.cat([target_hidden @ at.v_proj.weight.T, h @ at.v_proj.weight.T], 1).view(1, T + Q, -1, d)
        k = rms(k, at.k_norm.weight).transpose(1, 2)
        v = v.transpose(1, 2)
        q_emb, _ = hf.apply_rotary_pos_emb(q, q, cos[:, -Q:], sin[:, -Q:])
        _, k_emb = hf.apply_rotary_pos_emb(k, k, cos, sin)
        module = SimpleNamespace(num_key_value_groups=cfg.num_query_groups, training=False)
        out, _ = hf.eager_attention_forward(module, q_emb, k_emb, v, additive, scaling=d ** -0.5)
        x = x + out.reshape(1, Q, -1) @ at.o_proj.weight.T
        m = layer.mlp
        h = rms(x, layer.post_attention_layernorm.weight)
        x = x + (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return rms(x, drafter.norm.weight)[0]


def test_matches_transformers_reference(cfg, drafter):
    ctx_pos, anchor, block_pos = anchors()
    ctx_pos, block_pos = ctx_pos + 100, block_pos + 100
    features, embeds = inputs(cfg)
    dense = dense_mask(mask_mod_for(anchor))
    with torch.no_grad():
        ours = drafter(features, ctx_pos, embeds, block_pos, {"full_attention": dense})
        ref = _hf_reference(drafter, cfg, features, ctx_pos, embeds, block_pos, dense)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer_types", [("full_attention",), ("sliding_attention", "full_attention", "sliding_attention")],
                         ids=["one layer", "three layers, sliding first and last"])
def test_distinct_rows_and_scored_only_compute_the_full_forwards_rows(layer_types):
    """Training's forward (the first layer on the block input's A + 1 distinct rows, the last layer's
    output projection and MLP on slots 1..B-1 only) gives the full forward's scored rows, and the same
    gradient for every parameter from a loss on them; one layer does both at once."""
    cfg = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=len(layer_types), block_size=B,
                                  sliding_window=4),
        layer_types=layer_types)
    ctx_pos, anchor, block_pos = anchors()
    features, _ = inputs(cfg)
    g = torch.Generator().manual_seed(7)
    distinct = torch.randn(A + 1, cfg.hidden_size, generator=g)  # each block's anchor row, then the mask row
    full_embeds = torch.cat((distinct[:A, None], distinct[A:].expand(A, B - 1, -1)), dim=1).reshape(Q, -1)
    masks = {"full_attention": dense_mask(mask_mod_for(anchor)),
             "sliding_attention": dense_mask(mask_mod_for(anchor, see_context=False))}
    target = torch.randn(A * (B - 1), cfg.hidden_size, generator=g)
    runs = []
    for training_rows in (False, True):
        drafter = init_drafter(cfg, seed=5)
        if training_rows:
            out = drafter(features, ctx_pos, distinct, block_pos, masks, distinct_rows=True, scored_only=True)
        else:
            out = drafter(features, ctx_pos, full_embeds, block_pos, masks).view(A, B, -1)[:, 1:].reshape(A * (B - 1), -1)
        (out * target).sum().backward()
        runs.append((out.detach(), {n: p.grad for n, p in drafter.named_parameters()}))
    (ref, ref_grads), (got, got_grads) = runs
    assert got.shape == (A * (B - 1), cfg.hidden_size)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_training_rows_with_no_anchors(cfg):
    """A batch without anchors (only the mask row is distinct) gives no scored rows, and backward runs."""
    drafter = init_drafter(cfg, seed=1)
    batch = make_batch([5, 6])
    blocks = sample_anchors(batch, block_size=B, num_anchors=8, mask_token_id=0,
                            generator=torch.Generator().manual_seed(0))
    assert blocks.num_anchors == 0
    doc, pos = batch.doc_ids(), batch.position_ids
    masks = {"full_attention": document_masks(doc, pos, blocks, sliding_window=None)}
    features = torch.randn(batch.num_tokens, cfg.num_target_layers * cfg.hidden_size)
    out = drafter(features, pos, torch.randn(1, cfg.hidden_size), blocks.position_ids.reshape(-1), masks,
                  distinct_rows=True, scored_only=True)
    assert out.shape == (0, cfg.hidden_size)
    out.sum().backward()


def test_each_compiled_drafter_keeps_its_own_graphs(cfg, monkeypatch):
    """torch.compile counts recompiles per code object, 8 at most; past that it runs the layers
    eagerly (FlexAttention with a dense score matrix). Three drafters of three layers, each on a
    static shape of its own, compile 3 x 3 layer graphs: one shared count would pass the limit."""
    import functools

    import torch._dynamo

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))  # no inductor on CPU
    three = DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=3, block_size=B)
    ctx_pos, anchor, block_pos = anchors()
    masks = {"full_attention": dense_mask(mask_mod_for(anchor))}
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for extra in range(3):  # a context longer by `extra` rows that no query sees: another static shape
                drafter = init_drafter(three, seed=extra)
                drafter.compile_layers()
                features = torch.randn(T + extra, three.num_target_layers * three.hidden_size)
                keys = torch.nn.functional.pad(masks["full_attention"], (extra, 0))  # the new rows come first
                positions = torch.cat((torch.zeros(extra, dtype=torch.long), ctx_pos))
                out = drafter(features, positions, torch.randn(A + 1, three.hidden_size), block_pos,
                              {"full_attention": keys}, static=True, distinct_rows=True, scored_only=True)
                assert out.shape == (A * (B - 1), three.hidden_size)
    finally:
        torch._dynamo.reset()  # this worker's later tests start with no graphs of these drafters
