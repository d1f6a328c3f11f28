"""A minimal reproducer of the crash that stopped `dflash-cache train` on mixed-length data (torch 2.11).

The drafter layers compiled for symbolic sizes (`torch.compile(dynamic=True)`) run forward and
backward on packed batches of 100-2,100-token documents, each batch another context length and
anchor count, under the trainer's bf16 autocast: a Qwen3-1.7B-shaped drafter of 3 layers (hidden
2,048, heads of 128). Each inductor setting runs in a fresh process, so they share no compiled code:

  * default: torch's inductor settings as they are;
  * no-mix-order: with `triton.mix_order_reduction` off, the fused kernel that computes the RMSNorm
    backward's per-row sums and its weight gradient's per-column sums in one pass, through a
    workspace of partial sums that is summed after (`workspace.view(nsplit, 128).sum(dim=0)`: the
    q/k norms' weights are 128 wide).

Prints, per setting, which batches ran and the first error. GPU only (the kernels are Triton's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = {"default": {}, "no-mix-order": {"triton.mix_order_reduction": False}}


def run_setting(name: str, batches: int) -> dict:
    import torch

    from dflash_cache.store.batch import PackedBatch, positions_from_cu_seqlens
    from dflash_cache.train import drafter as drafter_module
    from dflash_cache.train.anchors import sample_anchors
    from dflash_cache.train.config import DrafterConfig
    from dflash_cache.train.masks import build_masks, context_doc_pos

    dev = torch.device("cuda")
    cfg = DrafterConfig(hidden_size=2048, intermediate_size=6144, num_layers=3, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=40960, vocab_size=151936, block_size=16, mask_token_id=151935,
                        target_layer_ids=(1, 7, 13, 19, 25), layer_types=("full_attention",) * 3,
                        target_num_hidden_layers=28)
    model = drafter_module.init_drafter(cfg, seed=0).to(dev)
    model.compile_layers()
    # The dynamic graphs with exactly this setting (compile_layers' own turn mix-order reduction off).
    options = SETTINGS[name]
    model._dynamic_runners = tuple(torch.compile(drafter_module._own_copy(fn), dynamic=True, options=options)
                                   for fn in (drafter_module._run_layer, drafter_module._fuse_context,
                                              drafter_module._final_norm))
    g = torch.Generator().manual_seed(0)
    ran, error = [], None
    for i in range(batches):
        lengths = torch.randint(100, 2101, (int(torch.randint(4, 16, (1,), generator=g)),), generator=g).tolist()
        total, cu = sum(lengths), torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        batch = PackedBatch(input_ids=torch.randint(0, cfg.vocab_size, (total,), generator=g),
                            loss_mask=torch.rand(total, generator=g) < 0.9, position_ids=positions_from_cu_seqlens(cu, total),
                            cu_seqlens=cu, sample_ids=torch.arange(len(lengths)),
                            features=torch.zeros(total, 1, dtype=torch.bfloat16)).to(dev)
        blocks = sample_anchors(batch, block_size=16, num_anchors=512, mask_token_id=cfg.mask_token_id, generator=g)
        doc, pos = context_doc_pos(batch)
        masks = build_masks(doc, pos, blocks, layer_types=cfg.layer_types, sliding_window=None, backend="flex")
        features = torch.randn(batch.num_tokens, 5 * cfg.hidden_size, device=dev, dtype=torch.bfloat16)
        embeds = torch.randn(blocks.num_anchors + 1, cfg.hidden_size, device=dev)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(features, pos, embeds, blocks.position_ids.reshape(-1), masks, distinct_rows=True,
                            scored_only=True)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            ran.append((batch.num_tokens, blocks.num_anchors))
        except Exception as e:  # the finding this script exists to show
            error = f"batch {i} ({batch.num_tokens} tokens, {blocks.num_anchors} anchors): {type(e).__name__}: " \
                    f"{str(e).splitlines()[0][:300]}"
            break
    return {"setting": name, "torch": torch.__version__, "ran": ran, "error": error}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--setting", choices=sorted(SETTINGS), default=None, help="(internal) run one setting here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.setting:
        print("RESULT " + json.dumps(run_setting(args.setting, args.batches)), flush=True)
        return
    results = []
    for name in SETTINGS:  # the child inherits the working directory and PYTHONPATH that found `bench` here
        done = subprocess.run([sys.executable, "-m", "bench.repro_dynamic_shapes", "--setting", name, "--batches",
                               str(args.batches)], capture_output=True, text=True, env=os.environ.copy())
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][7:]) if lines else {"setting": name, "error": done.stderr[-2000:]}
        results.append(result)
        print(f"{name}: {len(result.get('ran', []))} batches ran; error: {result['error']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
