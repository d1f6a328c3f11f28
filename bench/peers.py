"""A peer trainer's DFlash step on this project's bench configuration, for a ratio measured on one GPU.

Issue figures compare `bench/train.py` against the public trainers' steps measured on another day.
An H200 runs at its power cap in these steps, and chips of one kind differ by a few percent there
(README, "fourth session"), so a ratio is only as good as its two runs being on one machine. This
script times vllm-project/speculators' DFlash step (its own model, loss and optimizer code from the
installed `speculators` package; its trainer's step reproduced line for line: autocast to bf16 over
float32 weights, the compiled forward with its fused loss, `clip_grad_norm_(1.0)`, `torch.optim.AdamW`;
no log step inside the timed steps, as it logs every 100) on the same shapes: a Qwen3-8B-shaped
drafter of 5 layers, block 16, four 3,072-token documents (10% prompt) packed in one row with
2,048 anchors, random features and weights. Run it and `bench/train.py` in one session, alternating,
and compare tok/s.

speculators' package imports its data-generation client (openai, datasets, hs_connectors) on
import; the model code uses none of them, so the script lets such a module import as an empty
stand-in when it is not installed: `pip install --no-deps speculators==0.9.0 pydantic psutil` is
enough. `--small` checks the script on a CPU (forward only: FlexAttention has no backward there).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

from bench.common import start_logging_and_device
from bench.gpu_clocks import ClockSampler, describe

UNUSED_IMPORTS = ("openai", "datasets", "hs_connectors")  # imported by speculators' data pipeline only


class _EmptyModule(types.ModuleType):
    """Any attribute is a new empty class: enough for `from x import Y` and for subclassing Y."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _EmptyModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _EmptyModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def import_speculators():
    """speculators' DFlash model and the pieces its trainer builds, with missing unused modules stubbed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # it looks the made-up verifier up on the Hub: no network
    missing = tuple(n for n in UNUSED_IMPORTS if importlib.util.find_spec(n) is None)
    if missing:
        print(f"empty stand-ins for {', '.join(missing)} (not installed; speculators' model code does not use them)")
        sys.meta_path.insert(0, _EmptyModules(missing))
    from importlib.metadata import version as installed_version

    # (speculators: installed for this bench only)
    from speculators.config import SpeculatorsConfig, VerifierConfig  # pyright: ignore[reportMissingImports]
    from speculators.losses import fused  # pyright: ignore[reportMissingImports]
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig  # pyright: ignore[reportMissingImports]
    from speculators.proposals.greedy import GreedyTokenProposalConfig  # pyright: ignore[reportMissingImports]

    # Its two loss kernels share one autotune config list, and torch 2.11's dynamo refuses to trace
    # the second (the same list tracked twice): each kernel gets its own copy of the same configs.
    for kernel in (getattr(fused, "loss_forward_kernel", None), getattr(fused, "loss_backward_kernel", None)):
        if kernel is not None and isinstance(getattr(kernel, "configs", None), list):
            kernel.configs = list(kernel.configs)

    return installed_version("speculators"), SpeculatorsConfig, VerifierConfig, DFlashDraftModel, DFlashSpeculatorConfig, GreedyTokenProposalConfig


def shapes(small: bool) -> dict:
    if small:
        return dict(hidden=64, inter=192, heads=4, kv=2, head_dim=16, vocab=1000, layers=2, block=4, docs=2,
                    seq=128, anchors_per_doc=8)
    return dict(hidden=4096, inter=12288, heads=32, kv=8, head_dim=128, vocab=151936, layers=5, block=16, docs=4,
                seq=3072, anchors_per_doc=512)


def build_model(s: dict, device: torch.device):
    version, SpeculatorsConfig, VerifierConfig, DFlashDraftModel, DFlashSpeculatorConfig, Greedy = import_speculators()
    from transformers import Qwen3Config

    def qwen3(layers: int) -> Qwen3Config:
        return Qwen3Config(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
                           num_key_value_heads=s["kv"], head_dim=s["head_dim"], vocab_size=s["vocab"],
                           # rope_theta: transformers 5 takes 4.x's keyword (into rope_parameters), unlisted
                           num_hidden_layers=layers, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,  # pyright: ignore[reportCallIssue]
                           architectures=["Qwen3ForCausalLM"])

    layers = qwen3(s["layers"])
    layers._attn_implementation = "simple_flex_attention"  # what its from_training_args sets
    verifier = qwen3(36)
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layers, draft_vocab_size=s["vocab"], block_size=s["block"],
        aux_hidden_state_layer_ids=[1, 9, 17, 25, 33], mask_token_id=s["vocab"] - 1, sliding_window_non_causal=False,
        sample_from_anchor=False,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[Greedy(speculative_tokens=s["block"] - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_config(verifier, name_or_path="synthetic")))
    model = DFlashDraftModel(config)
    # The verifier's embedding and heads load from its checkpoint (NaN until then): random here.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (model.embed_tokens, model.lm_head, model.verifier_lm_head):
            module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 0.02)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return version, model.to(device), trainable  # float32 master weights, as its trainer keeps them


def make_batch(s: dict, device: torch.device, step: int) -> dict:
    """One packed row of `docs` documents: the tensors its data loader hands the model."""
    g = torch.Generator().manual_seed(1000 + step)
    t = s["docs"] * s["seq"]
    pos = torch.arange(s["seq"]).repeat(s["docs"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = {
        "hidden_states": torch.randn(1, t, 5 * s["hidden"], generator=g).to(dtype),
        "input_ids": torch.randint(0, s["vocab"] - 1, (1, t), generator=g),
        "loss_mask": (pos >= s["seq"] // 10).long()[None],
        "verifier_last_hidden_states": torch.randn(1, t, s["hidden"], generator=g).to(dtype),
        "document_ids": torch.arange(s["docs"]).repeat_interleave(s["seq"])[None],
        "position_ids": pos[None],
    }
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python3 -m {__spec__.name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="small shapes on the CPU (checks the script)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = start_logging_and_device()
    s = shapes(args.small)
    version, model, trainable = build_model(s, device)
    from speculators.models.dflash import DFlashDraftModel  # pyright: ignore[reportMissingImports]

    # its defaults for dflash (CE, D-PACE position weights); its fused Triton loss needs a GPU
    call_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn="ce", loss_implementation="fused" if device.type == "cuda" else "eager",
        per_position_loss_weight="dpace", max_anchors=s["docs"] * s["anchors_per_doc"])
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-4, weight_decay=0.01)
    batches = [make_batch(s, device, i) for i in range(args.steps + 1)]
    tokens = batches[0]["input_ids"].numel()
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.train()

    def step(batch: dict) -> torch.Tensor:
        if device.type == "cpu":  # FlexAttention has no backward on a CPU: --small checks the forward
            with torch.no_grad():
                return model(**batch, **call_kwargs)[1]
        with torch.autocast(device.type, dtype=autocast_dtype):
            _, loss, _ = model(**batch, **call_kwargs)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        loss = step(batches[0])
    print(f"speculators {version}: {trainable / 1e6:,.1f}M trained parameters; {args.warmup} warm-up steps "
          f"{time.perf_counter() - t0:.1f}s, loss {loss.item():.3f}", flush=True)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    step(batches[0])  # lead-in: the timed steps start with the device already busy, as bench/train.py's
    clocks = ClockSampler(device)
    with clocks:
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        t1 = time.perf_counter()
        for batch in batches[1:]:
            loss = step(batch)
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if end is not None:
            end.record()
            torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3 if start is not None and end is not None else time.perf_counter() - t1
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    result = {"trainer": f"speculators {version}", "s_per_step": seconds / args.steps,
              "tok_s": tokens * args.steps / seconds, "peak_gib": peak, "tokens_per_step": tokens,
              "loss": loss.item(), "clocks": clocks.summary(),
              "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    print(f"| trainer | s/step | tok/s | peak GiB |\n|---|---:|---:|---:|\n| {result['trainer']} | "
          f"{result['s_per_step']:.3f} | {result['tok_s']:,.0f} | {peak:.1f} |\n{describe(result['clocks'])}",
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
