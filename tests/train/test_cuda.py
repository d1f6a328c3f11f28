"""GPU paths of phase 2: compiled FlexAttention masks and kernels, and a short training run on CUDA.
Skipped where no CUDA device exists (CPU CI); run on the GPU machine."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from dflash_cache.target.tiny import tiny_config
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
    cfg = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), (1, 3, 5), num_layers=3, block_size=8, sliding_window=48),
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


@needs_cuda
@pytest.mark.parametrize("kernel", ["inductor", "triton"])
@pytest.mark.parametrize("vocab", [5003, 151936])
def test_gpu_loss_kernels_match_torch(kernel, vocab):
    """The compiled (bench/variants.py's, which the trainer's was chosen over) and the Triton chunk
    kernels give the torch loss, accuracy and gradient (bf16 head, float32 softmax), including rows with
    weight 0 and label -100, a short last chunk, and a vocabulary of Qwen3's size."""
    from bench.variants import register_loss_kernels
    from dflash_cache.train.loss import chunked_weighted_ce

    register_loss_kernels()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    m, h = 3000, 256
    hidden = torch.randn(m, h, generator=g).to(dev)
    head = (torch.randn(vocab, h, generator=g) * 0.05).to(dev, torch.bfloat16)
    labels = torch.randint(0, vocab, (m,), generator=g).to(dev)
    weights = torch.rand(m, generator=g).to(dev)
    weights[::7], labels[::7] = 0.0, -100
    results = []
    for k in ("torch", kernel):
        x = hidden.clone().requires_grad_(True)
        loss, correct = chunked_weighted_ce(x, head, labels, weights, chunk_size=1024, kernel=k)
        loss.backward()
        results.append((loss.detach(), correct, x.grad))
    (l0, c0, g0), (l1, c1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert torch.equal(c1, c0)
    # The logits' gradient is rounded to bf16 once; a float32 ulp of difference in the log-sum-exp
    # flips a few of those roundings (on the H200: 1-4 of 768,000 hidden-gradient entries off by
    # <= 2.4e-7, i.e. up to 0.7% of an entry near zero), so the bound is relative to the largest entry.
    torch.testing.assert_close(g1, g0, rtol=1e-3, atol=1e-2 * float(g0.abs().max()))


def _drafter_case(dev: torch.device, lengths: list[int], seed: int):
    """A drafter config, one packed batch's features, positions, block embeddings and flex masks."""
    cfg = dataclasses.replace(
        DrafterConfig.from_target(tiny_config(), (1, 3, 5), num_layers=3, block_size=8, sliding_window=48),
        layer_types=TYPES)
    batch = make_batch(lengths, seed=seed, p_sup=0.9).to(dev)
    blocks = sample_anchors(batch, block_size=8, num_anchors=24, mask_token_id=cfg.mask_token_id,
                            generator=torch.Generator().manual_seed(seed))
    doc, pos = context_doc_pos(batch)
    g = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(batch.num_tokens, 3 * cfg.hidden_size, generator=g).to(dev)
    embeds = torch.randn(blocks.num_anchors * 8, cfg.hidden_size, generator=g).to(dev)
    masks = build_masks(doc, pos, blocks, layer_types=TYPES, sliding_window=48, backend="flex", compile=True)
    return cfg, (features, pos, embeds, blocks.position_ids.reshape(-1), masks)


@needs_cuda
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_layers_match_eager(autocast, static):
    """compile_layers() changes kernels, not the computation: outputs and every gradient match the
    eager drafter's, in float32 and under the trainer's bf16 autocast, through the dynamic-shape
    graph and the static-shape one."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    cfg, args = _drafter_case(dev, [300, 41, 520, 97], seed=3)
    outs, grads = [], []
    for compiled in (False, True):
        drafter = init_drafter(cfg, seed=0).to(dev)
        if compiled:
            drafter.compile_layers()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = drafter(*args, static=static and compiled)
        out.float().square().mean().backward()
        outs.append(out.detach().float())
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters()]))
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    torch.testing.assert_close(grads[1], grads[0], **(dict(rtol=5e-2, atol=1e-3) if autocast else
                                                       dict(rtol=1e-3, atol=1e-5)))


def _flash_reason() -> str | None:
    """Why flash-attention 4's kernels cannot run on this machine (None: they can)."""
    from dflash_cache.train.attention_kernels import flash_unavailable

    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return flash_unavailable(torch.device("cuda"), compiled=True, low_precision=True)


FLASH_REASON = _flash_reason()  # once, at collection


@pytest.mark.skipif(FLASH_REASON is not None, reason=f"flash kernels: {FLASH_REASON}")
def test_flash_attention_kernels_follow_triton_in_the_static_graph():
    """--attention-kernels flash changes the static graph's attention kernels, not the computation:
    output and every gradient match the Triton template's under bf16 autocast, at the heads of the
    bench drafters (128) with a sliding-window layer; and the graph does call flash-attention 4."""
    from torch._inductor.utils import run_and_get_code
    from transformers import Qwen3Config

    dev = torch.device("cuda")
    target = Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=8192)
    cfg = dataclasses.replace(
        DrafterConfig.from_target(target, (1, 3, 5), num_layers=3, block_size=16, sliding_window=256),
        layer_types=TYPES)
    batch = make_batch([900, 300, 1200], seed=5, p_sup=0.9).to(dev)
    blocks = sample_anchors(batch, block_size=16, num_anchors=48, mask_token_id=cfg.mask_token_id,
                            generator=torch.Generator().manual_seed(5))
    doc, pos = context_doc_pos(batch)
    g = torch.Generator().manual_seed(6)
    args = (torch.randn(batch.num_tokens, 3 * cfg.hidden_size, generator=g).to(dev), pos,
            torch.randn(blocks.num_anchors * 16, cfg.hidden_size, generator=g).to(dev),
            blocks.position_ids.reshape(-1),
            build_masks(doc, pos, blocks, layer_types=TYPES, sliding_window=256, backend="flex", compile=True))
    outs, grads, code = [], [], {}
    for kernels in ("triton", "flash"):
        drafter = init_drafter(cfg, seed=0).to(dev)
        drafter.compile_layers(attention_kernels=kernels)

        def step(drafter=drafter):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = drafter(*args, static=True)
            out.float().square().mean().backward()
            return out

        out, code[kernels] = run_and_get_code(step)
        outs.append(out.detach().float())
        grads.append(torch.cat([p.grad.flatten() for p in drafter.parameters()]))
    assert any("flash_attn" in c for c in code["flash"]) and not any("flash_attn" in c for c in code["triton"])
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[1], grads[0], rtol=5e-2, atol=1e-3)


@needs_cuda
def test_compiled_layers_compile_once_for_changing_shapes():
    """Batches differ in context length and anchor count: after the first two shapes (the second
    makes the sizes symbolic) no new shape compiles again."""
    from torch._dynamo.utils import counters

    dev = torch.device("cuda")
    cases = [_drafter_case(dev, lengths, seed) for seed, lengths in
             enumerate([[300, 41, 520], [700, 90], [1000], [64, 64, 64, 200], [450, 333, 120, 77]])]
    drafter = init_drafter(cases[0][0], seed=0).to(dev)
    drafter.compile_layers()
    graphs = []
    for _, args in cases:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            drafter(*args).float().mean().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2:] == [graphs[1]] * 3, graphs


@needs_cuda
def test_compiled_training_follows_eager_training(demo_cache, tmp_path):
    """The trainer's default (compiled layers and loss) and --no-compile take the same steps: the
    per-step losses of 12 steps agree to bf16 precision."""
    losses, static_steps = [], []
    for compiled in (True, False):
        out = tmp_path / f"run-{compiled}"
        # Every compiled step runs a static shape; --no-compile runs none.
        cfg = demo_train_config(demo_cache, out, max_steps=12, log_every=1, compile=compiled, max_anchors=16)
        trainer = Trainer.build(cfg, device=torch.device("cuda"))
        trainer.fit()
        static_steps.append(trainer.runner.shape_record.compiled_steps)
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert len(losses[0]) == 12
    assert static_steps[1] == 0 and static_steps[0] >= 6, static_steps
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=2e-2, atol=0.0)


@needs_cuda
def test_after_the_warm_up_no_step_compiles(demo_cache, tmp_path):
    """`fit` compiles every static shape first: after that no step compiles (no rank stops mid-run
    to compile while the others wait for it), and every step, whatever its anchor count, runs one of
    the static shapes' compiled graphs."""
    from torch._dynamo.utils import counters

    # A cap that some of the first 40 demo batches reach (the others hold 64-144 anchors).
    cfg = demo_train_config(demo_cache, tmp_path / "run", max_steps=40, max_anchors=160)
    trainer = Trainer.build(cfg, device=torch.device("cuda"))
    runner = trainer.runner
    assert len(runner.shapes.anchors) >= 2, runner.shapes
    runner.warm_up()
    compiled, anchors = counters["stats"]["unique_graphs"], set()
    for _, batch in itertools.islice(trainer.source.iterate(trainer.source.position, epochs=None), 40):
        inputs = runner.prepare_step(batch)
        anchors.add(inputs.blocks.real_anchors)
        runner.train_step(batch, inputs)
    trainer.source.close()
    assert counters["stats"]["unique_graphs"] == compiled
    assert runner.shape_record.compiled_steps == 40 and runner.shape_record.eager_steps == 0 and len(anchors) > 2, \
        anchors


@needs_cuda
def test_a_failing_compiled_shape_trains_on_eagerly(demo_cache, tmp_path):
    """A static shape whose compiled graphs fail runs eagerly on the GPU (the layers uncompiled,
    FlexAttention still compiled on its own): the run reaches its checkpoint and export, with finite
    losses, and its metrics count the eager steps."""
    cfg = demo_train_config(demo_cache, tmp_path / "run", max_steps=6, log_every=3)
    trainer = Trainer.build(cfg, device=torch.device("cuda"))
    runners = trainer.model._runners

    def broken(static, eager, shape):
        chosen, flex_fn = runners(static, eager, shape)
        if static and not eager:
            def fail(*args, **kwargs):
                raise RuntimeError("a generated kernel failed")
            return (fail, *chosen[1:]), flex_fn
        return chosen, flex_fn

    trainer.model._runners = broken
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eager_steps"] for r in rows] == [3, 6] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert trainer.runner.shape_record.failed.keys() == set(trainer.runner.shapes.shapes)
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()


@needs_cuda
def test_master_weights_adamw_follows_fused_adamw_on_cuda():
    """TritonAdamW's masters follow torch's fused AdamW over float32 weights, and each bf16 weight
    is its master rounded to nearest even: the GPU's cast, checked bit for bit (the CPU runs the
    same check under the interpreter). The two kernels order their float32 arithmetic differently."""
    from tests.train.master_weight_checks import masters_against_fused_adamw

    got = masters_against_fused_adamw("cuda")
    assert got["masters rounded"] and got["moments float32"]
    assert got["masters rel"] < 1e-5, got["masters rel"]


@needs_cuda
def test_gpu_trainer_trains_bf16_weights_as_autocast_trains_float32_ones(demo_cache, tmp_path):
    """The GPU default (bf16 linear weights, float32 masters in TritonAdamW) against autocast over
    float32 weights with torch's fused AdamW, compiled: the same first loss (to float32 rounding),
    and 8 steps' losses within bf16 noise. The export holds the masters' rounding."""
    from safetensors.torch import load_file

    from dflash_cache.train.adamw_kernel import TritonAdamW
    from dflash_cache.train.precision import Precision

    losses = []
    for precision in (None, Precision(autocast=True, master_weights=False)):
        out = tmp_path / f"run-{precision is None}"
        cfg = demo_train_config(demo_cache, out, max_steps=8, log_every=1)
        trainer = Trainer.build(cfg, device=torch.device("cuda"), precision=precision)
        if precision is None:
            assert isinstance(trainer.drafter.optimizer, TritonAdamW)
            assert {p.dtype for p in trainer.drafter.optimizer.master_weights()} == {torch.bfloat16}
        trainer.fit()
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
        if precision is None:
            exported = load_file(out / "export" / "model.safetensors")
            named = dict(trainer.model.named_parameters())
            for p, master in trainer.drafter.optimizer.master_weights().items():
                name = next(n for n, q in named.items() if q is p)
                assert torch.equal(exported[name].cuda(), master.to(torch.bfloat16))
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-5)  # the graphs fuse their reductions differently
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-2, atol=0.0)


@needs_cuda
def test_metrics_are_queued_without_waiting_for_the_device(tmp_path):
    """Queued behind ~1 s of device work, MetricsLog.queue returns at once (a stop flag made by
    torch.tensor from a list waited the whole second here); the row's rate covers that work."""
    import time

    from dflash_cache.train.metrics_log import MetricsLog

    dev, path = torch.device("cuda"), tmp_path / "metrics.jsonl"
    log = MetricsLog(path, dev, slots=3)
    log.start()
    window = [{"loss": torch.tensor(1.0, device=dev), "acc": torch.ones(3, device=dev)}]
    fields = {"epoch": 0, "lr": 1e-3, "tokens_seen": 0}
    # A first row loads the kernels: with CUDA's lazy loading a kernel's first launch may wait for the
    # device, once per process.
    log.queue(window, tokens=1000, stop_requested=False, row={"step": 1, **fields})
    log.write()
    torch.cuda._sleep(2_000_000_000)  # clock cycles: ~1 s at an H200's 1.98 GHz
    t0 = time.perf_counter()
    log.queue(window, tokens=1000, stop_requested=False, row={"step": 2, **fields})
    queued = time.perf_counter() - t0
    assert queued < 0.2, f"queue() waited {queued:.2f} s for the device"
    assert len(path.read_text().splitlines()) == 1, "the second row is not written yet"
    log.write()
    row = json.loads(path.read_text().splitlines()[1])
    assert row["loss"] == 1.0 and row["tokens_per_s"] < 1000 / 0.5, row
