"""GPU paths of phase 2: compiled FlexAttention masks and kernels, and a short training run on CUDA.
Skipped where no CUDA device exists (CPU CI); run on the GPU machine."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_cache.extract.tiny import tiny_config
from dflash_cache.train.anchors import sample_anchors
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import init_drafter
from dflash_cache.train.masks import build_masks, context_doc_pos
from dflash_cache.train.trainer import Trainer
from tests.train.conftest import demo_train_config
from tests.train.test_masks import make_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TYPES = ("sliding_attention", "full_attention", "sliding_attention")


@needs_cuda
@pytest.mark.parametrize("lengths", [[300, 41, 520, 97], [1000], [64, 64, 64, 64, 64, 64]])
def test_compiled_flex_matches_dense_forward_and_grads(lengths):
    """Compiled block masks + compiled flex_attention give the dense-SDPA drafter's outputs and
    gradients on packed batches of several documents, with sliding-window and full layers."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    cfg = DrafterConfig.from_target(tiny_config(), (1, 3, 5), num_layers=3, block_size=8, sliding_window=48,
                                    layer_types=TYPES)
    batch = make_batch(lengths, seed=len(lengths), p_sup=0.9).to(dev)
    blocks = sample_anchors(batch, block_size=8, num_anchors=24, mask_token_id=cfg.mask_token_id,
                            generator=torch.Generator().manual_seed(0))
    doc, pos = context_doc_pos(batch)
    g = torch.Generator().manual_seed(1)
    features = torch.randn(batch.num_tokens, 3 * cfg.hidden_size, generator=g).to(dev)
    embeds = torch.randn(blocks.num_anchors * 8, cfg.hidden_size, generator=g).to(dev)
    outs, grads = [], []
    for backend in ("dense", "flex"):
        drafter = init_drafter(cfg, seed=0).to(dev)
        masks = build_masks(doc, pos, blocks, layer_types=TYPES, sliding_window=48, backend=backend,
                            compile=backend == "flex")
        out = drafter(features, pos, embeds, blocks.position_ids.reshape(-1), masks)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters()]))
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-5)


@needs_cuda
def test_training_on_cuda_learns(demo_cache, tmp_path):
    """The trainer's GPU path (flex masks, bf16 autocast, fused AdamW, side-stream H2D) learns the
    demo data: slot-1 accuracy rises well above chance and the loss falls."""
    cfg = demo_train_config(demo_cache, tmp_path / "run", max_steps=120, log_every=20)
    trainer = Trainer.build(cfg, device=torch.device("cuda"))
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert rows[-1]["slot_acc"][0] > 0.05
