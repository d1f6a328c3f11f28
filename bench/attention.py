"""FlexAttention on the DFlash training mask: forward and forward+backward time per kernel setting.

The bench configuration's attention (32 query / 8 key-value heads of 128, 4 documents of 3,072
tokens with 10% prompt, 512 anchors per document, block 16: 32,768 queries over 45,056 keys), the
mask built by the trainer's own code. Each setting compiles its own flex_attention; the table gives
milliseconds per call and TFLOP/s over the pairs the mask admits (what `train.flops` counts).
"general mask_mod" runs the same blocks with the general rule (`_mask_mod`, eight int64 lookups
per pair, what the trainer evaluated before) in place of the trainer's `key_range_mask_mod`.
"ranges ..." run `bench/range_attention.py`'s kernels instead. Every setting but the default first
prints how far its output and gradients are from the default kernels' on the same inputs.
`--small` runs a shrunken case on a CPU (eager, forward only) to check the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from bench.common import start_logging_and_device, timed
from bench.gpu_clocks import ClockSampler, describe
from bench.range_attention import KernelConfig, plan_ranges, range_attention
from dflash_cache.store.batch import PackedBatch, positions_from_cu_seqlens
from dflash_cache.train.anchors import sample_anchors
from dflash_cache.train.masks import _KeyRanges, _mask_mod, build_masks, context_doc_pos

SETTINGS: dict[str, dict] = {
    "default": {},
    "rows safe": {"ROWS_GUARANTEED_SAFE": True},
    "fwd 128x128": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd 128x64 w8 s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "bwd 64/128": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                   "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd 32/128": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                   "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 64/128 s4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                      "bwd_num_warps": 8, "bwd_num_stages": 4},
    "bwd 64/64 w4 s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd 64/64 w8 s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 8, "bwd_num_stages": 3},
    "bwd 32/64 w4 s4": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                        "bwd_num_warps": 4, "bwd_num_stages": 4},
    "bwd 64/128 tma": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                       "bwd_num_warps": 8, "bwd_num_stages": 3, "USE_TMA": True},
    "tma": {"USE_TMA": True},
    "prescale": {"PRESCALE_QK": True},  # q scaled once as it is loaded, not every score
    "flash": {"BACKEND": "FLASH"},  # flash-attn-4's CuTe kernels; needs the flash-attn-4 package
}
# bench/range_attention.py's Triton kernels (two key ranges per block; dQ by atomic adds: five products
# per backward pair)
RANGES: dict[str, KernelConfig] = {
    "ranges": KernelConfig(),
    "ranges fwd 64/64 w4": KernelConfig(fwd_m=64, fwd_n=64, fwd_warps=4),
    "ranges fwd 128/128": KernelConfig(fwd_n=128, fwd_stages=2),
    "ranges bwd 64/64 w4": KernelConfig(bwd_n=64, bwd_m=64, bwd_warps=4, bwd_stages=2),
    "ranges bwd 64/64 w8": KernelConfig(bwd_n=64, bwd_m=64, bwd_warps=8, bwd_stages=2),
    "ranges bwd 128/32": KernelConfig(bwd_n=128, bwd_m=32, bwd_warps=8, bwd_stages=2),
    "ranges bwd 128/64 s3": KernelConfig(bwd_stages=3),
    "ranges bwd 128/64 w4": KernelConfig(bwd_warps=4),
    # dQ by programs of its own, no atomic adds (seven products a pair, as FlexAttention's)
    "ranges split": KernelConfig(fwd_m=64, fwd_n=64, fwd_warps=4, split_dq=True),
    "ranges split dq 64/64 w4": KernelConfig(fwd_m=64, fwd_n=64, fwd_warps=4, split_dq=True, dq_m=64, dq_n=64,
                                             dq_warps=4),
    "ranges split dq s3": KernelConfig(fwd_m=64, fwd_n=64, fwd_warps=4, split_dq=True, dq_stages=3),
    "ranges split dq 128/32": KernelConfig(fwd_m=64, fwd_n=64, fwd_warps=4, split_dq=True, dq_n=32),
    "ranges split bwd s3": KernelConfig(fwd_m=64, fwd_n=64, fwd_warps=4, split_dq=True, bwd_stages=3),
    "ranges split bwd 64/64 w4": KernelConfig(fwd_m=64, fwd_n=64, fwd_warps=4, split_dq=True, bwd_n=64,
                                              bwd_m=64, bwd_warps=4),
}
# The same blocks with the general rule as their mask_mod (eight int64 lookups per pair, where the
# trainer's key ranges make three int32 lookups per query block): default options.
GENERAL_MASK = "general mask_mod"
# As the trainer calls it: q/k/v views of [tokens, heads * 128] projections, rotated (RoPE) in the same
# compiled graph, which inductor may fuse into the attention kernel's loads (prologue fusion); and the
# same with that fusion off. The difference to "default" includes the rotation's own kernels.
# "contiguous": the rotated q/k and v laid out [heads, tokens, 128] before the kernel reads them.
TRAINER_LAYOUT = {"trainer layout": ({}, False), "trainer layout (no prologue fusion)": ({"prologue_fusion": False}, False),
                  "trainer layout (contiguous)": ({}, True)}


def trainer_layout_attention(q2, k2, v2, cos, sin, block_mask, heads: int, kv_heads: int, contiguous: bool):
    """FlexAttention on the drafter's layout: q2 [Q, heads * d], k2/v2 [T + Q, kv_heads * d] rows."""
    from dflash_cache.train.drafter import apply_rope

    d = q2.shape[1] // heads
    q = apply_rope(q2.view(-1, heads, d).transpose(0, 1)[None], cos[-q2.shape[0]:], sin[-q2.shape[0]:])
    k = apply_rope(k2.view(-1, kv_heads, d).transpose(0, 1)[None], cos, sin)
    v = v2.view(-1, kv_heads, d).transpose(0, 1)[None]
    if contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def case(device: torch.device, small: bool):
    docs, seq, anchors, block, heads, kv, d = (2, 256, 32, 8, 4, 2, 32) if small else (4, 3072, 512, 16, 32, 8, 128)
    lengths = [seq] * docs
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    t = seq * docs
    pos = positions_from_cu_seqlens(cu, t)
    batch = PackedBatch(input_ids=torch.randint(0, 1000, (t,)), loss_mask=pos >= seq // 10, position_ids=pos,
                        cu_seqlens=cu, sample_ids=torch.arange(docs), features=torch.zeros(t, 1))
    # sampled on the host, as the trainer's sources do (which also counts the prefix keys)
    blocks = sample_anchors(batch, block_size=block, num_anchors=anchors, mask_token_id=0,
                            generator=torch.Generator().manual_seed(0))
    batch, blocks = batch.to(device), blocks.to(device)
    doc, ctx_pos = context_doc_pos(batch)
    mask = build_masks(doc, ctx_pos, blocks, layer_types=("full_attention",), sliding_window=None,
                       backend="flex", compile=device.type == "cuda")["full_attention"]
    if not isinstance(mask, BlockMask):  # not reached: the flex backend builds BlockMasks
        raise TypeError(f"build_masks(backend='flex') made a {type(mask).__name__}")
    general = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                       mask.full_kv_indices, BLOCK_SIZE=mask.BLOCK_SIZE,
                                       mask_mod=_mask_mod(doc, ctx_pos, blocks, None), seq_lengths=mask.seq_lengths)
    q_len, kv_len = blocks.num_anchors * block, t + blocks.num_anchors * block
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(device, dtype)
               for h, n in ((heads, q_len), (kv, kv_len), (kv, kv_len)))
    if blocks.prefix_keys is None:  # not reached: anchors sampled on the host count them
        raise RuntimeError("anchors sampled on the host without their prefix keys")
    pairs = block * blocks.prefix_keys + blocks.num_anchors * block * block
    return {"": mask, GENERAL_MASK: general}, q, k, v, 4 * pairs * d * heads, _KeyRanges.of(blocks, t), block


def check_against_flex(name: str, forward, inputs, grad_out, q, k, v, mask, device) -> None:
    """Largest difference of the output and the gradients to FlexAttention's on the same inputs,
    relative to the largest FlexAttention value."""
    out = forward()
    out.backward(grad_out)
    mine = [out.detach(), *(x.grad for x in inputs)]
    for x in inputs:
        x.grad = None
    cuda = device.type == "cuda"  # eager FlexAttention (CPU) has no backward: the output only there
    ref_in = [x.detach().requires_grad_(cuda) for x in (q, k, v)]
    fn = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention
    ref = fn(*ref_in, block_mask=mask, enable_gqa=True)
    theirs = [ref[0].detach()]
    if cuda:
        ref.backward(grad_out.reshape(ref.shape))
        theirs += [x.grad[0] for x in ref_in]
    diffs = [f"{n} {((a.float().reshape(b.shape) - b.float()).abs().max() / b.float().abs().max()).item():.2e}"
             for n, a, b in zip(("out", "dq", "dk", "dv"), mine, theirs, strict=False)]
    print(f"{name}: max |difference| / max |FlexAttention|: {', '.join(diffs)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a shrunken case on the CPU (forward only)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names from: "
                    + ", ".join([*SETTINGS, *TRAINER_LAYOUT, *RANGES]) + f", autotune, {GENERAL_MASK}")
    args = ap.parse_args()
    device = start_logging_and_device()
    masks, q, k, v, fwd_flops, ranges, block = case(device, args.small)
    print(f"{q.shape[2]:,} queries x {k.shape[2]:,} keys; mask sparsity {masks[''].sparsity():.1f}%; "
          f"{fwd_flops / 1e12:.2f} TFLOP forward over the admitted pairs", flush=True)
    print("| setting | forward ms | TFLOP/s | fwd+bwd ms | TFLOP/s |\n|---|---:|---:|---:|---:|")
    clocks: list[str] = []  # printed after the table
    for name in args.settings.split(","):
        options = SETTINGS.get(name, {})
        if device.type == "cpu":
            fn = flex_attention
        else:
            fn = torch.compile(flex_attention, dynamic=False,
                               mode="max-autotune-no-cudagraphs" if name == "autotune" else None)
        if name in RANGES:
            cfg = RANGES[name] if not args.small else dataclasses.replace(  # the setting's variant, small tiles
                RANGES[name], fwd_m=16, fwd_n=16, bwd_n=16, bwd_m=16, dq_m=16, dq_n=16, fwd_warps=4, bwd_warps=4,
                dq_warps=4)
            plan = plan_ranges(ranges.ctx_lo, ranges.ctx_hi, block_size=block, num_context=k.shape[2] - q.shape[2],
                               config=cfg)
            qg, kg, vg = (x[0].detach().requires_grad_(True) for x in (q, k, v))
            forward = functools.partial(range_attention, qg, kg, vg, plan)
            grad_out = torch.randn_like(qg)
            check_against_flex(name, forward, (qg, kg, vg), grad_out, q, k, v, masks[""], device)
        elif name in TRAINER_LAYOUT:
            rows = [x[0].transpose(0, 1).reshape(x.shape[2], -1).detach().requires_grad_(device.type == "cuda")
                    for x in (q, k, v)]
            cos, sin = torch.randn(2, k.shape[2], q.shape[-1], device=device, dtype=q.dtype)
            inductor_options, contiguous = TRAINER_LAYOUT[name]
            fn = trainer_layout_attention if device.type == "cpu" else \
                torch.compile(trainer_layout_attention, dynamic=False, options=inductor_options)
            forward = functools.partial(fn, *rows, cos, sin, masks[""], q.shape[1], k.shape[1], contiguous)
            # the output's gradient as the trainer's output projection hands it back: [Q, heads * d] rows
            grad_out = torch.randn(q.shape[2], q.shape[1] * q.shape[3], device=device, dtype=q.dtype)
            grad_out = grad_out.view(q.shape[2], q.shape[1], q.shape[3]).transpose(0, 1)[None]
        else:
            qg, kg, vg = (x.detach().requires_grad_(device.type == "cuda") for x in (q, k, v))
            # (torch's FlexKernelOptions leaves out the fwd_/bwd_-prefixed options it documents)
            forward = functools.partial(fn, qg, kg, vg, block_mask=masks.get(name, masks[""]), enable_gqa=True,  # pyright: ignore[reportCallIssue]
                                        kernel_options=options or None)
            grad_out = torch.randn_like(q)  # random, not the ones of .sum(): the kernel reads it like any gradient
            if options and device.type == "cuda":  # other kernels, other roundings: how far from the default's
                try:
                    check_against_flex(name, forward, (qg, kg, vg), grad_out, q, k, v, masks[""], device)
                except Exception as e:  # reported with the timing below
                    print(f"{name}: check failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        try:
            f_clocks, fb_clocks = ClockSampler(device), ClockSampler(device)
            f = timed(forward, device, args.reps, during=f_clocks)
            fb = timed(lambda call=forward, g=grad_out: call().backward(g), device, args.reps, during=fb_clocks) \
                if device.type == "cuda" or name in RANGES else float("nan")
        except Exception as e:  # a setting the kernel cannot run (e.g. shared memory): report, go on
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |", flush=True)
            continue
        print(f"| {name} | {1e3 * f:.2f} | {fwd_flops / f / 1e12:.0f} | {1e3 * fb:.2f} | "
              f"{3 * fwd_flops / fb / 1e12:.0f} |", flush=True)
        clocks.append(f"{name}: forward {describe(f_clocks.summary())}; forward+backward "
                      f"{describe(fb_clocks.summary())}")
    print("\n".join(clocks))


if __name__ == "__main__":
    main()
