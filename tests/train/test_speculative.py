"""Speculative decoding with the drafter: lossless, and training raises the real acceptance."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.extract.target import TargetSpec, describe_target
from dflash_cache.extract.tiny import build_tiny_target
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import FrozenTargetHead, init_drafter
from dflash_cache.train.export import drafter_from_export
from dflash_cache.train.speculative import evaluate, greedy_generate, load_prompts, speculative_generate

from .test_export import load_with_automodel

CPU = torch.device("cpu")


def _setup():
    target = build_tiny_target().float()
    return target, FrozenTargetHead.from_target(target), load_prompts("demo", 6)


def test_untrained_drafter_is_still_lossless():
    target, head, prompts = _setup()
    cfg = DrafterConfig.from_target(describe_target(TargetSpec(model="tiny")).config, (1, 2, 3, 4, 5), num_layers=2,
                                    block_size=8)
    r = evaluate(target, init_drafter(cfg, seed=0).float(), head, cfg, prompts, max_new_tokens=32)
    assert r.lossless and 1.0 <= r.tau < 1.5
    assert sum(r.histogram.values()) > 0


def test_trained_drafter_accepts_more_than_an_untrained_one(trained_demo_run):
    target, head, prompts = _setup()
    cfg, trained = drafter_from_export(trained_demo_run / "export")
    untrained = init_drafter(cfg, seed=1)
    r_trained = evaluate(target, trained.float(), head, cfg, prompts, max_new_tokens=48)
    r_untrained = evaluate(target, untrained.float(), head, cfg, prompts, max_new_tokens=48)
    assert r_trained.lossless and r_untrained.lossless
    assert r_trained.tau > r_untrained.tau + 0.05, (r_trained.tau, r_untrained.tau)


def test_greedy_reference_matches_hf_generate():
    target, _, prompts = _setup()
    ids = torch.tensor([prompts[0]])
    hf = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                         do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert greedy_generate(target, prompts[0], 20) == hf


def test_eval_cli(trained_demo_run):
    r = CliRunner().invoke(cli, ["eval", "--target", "tiny", "--drafter", str(trained_demo_run), "--data", "demo",
                                 "--limit", "2", "--max-new-tokens", "24", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "tau (tokens per target forward):" in r.output and "lossless" in r.output


def test_shipped_model_code_drafts_as_eval_does(trained_demo_run, tmp_path):
    """The export's dflash.py (KV-cached context, as the public DFlash loop runs it) accepts exactly the
    drafts our `eval` accepts with the same trained drafter."""
    target, head, prompts = _setup()
    cfg, drafter = drafter_from_export(trained_demo_run / "export")
    model, _ = load_with_automodel(trained_demo_run / "export", tmp_path)
    tokens, accepted = speculative_generate(target, drafter.float(), head, cfg, prompts[0], 32)
    ids, shipped = model.spec_generate(target=target, input_ids=torch.tensor([prompts[0]]), max_new_tokens=32,
                                       return_acceptance=True)
    assert ids[0, len(prompts[0]):].tolist() == tokens
    assert shipped == accepted and max(accepted) > 1
