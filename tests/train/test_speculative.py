"""Speculative decoding with the drafter: lossless, and training raises the real acceptance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dflash_cache.cli import cli
from dflash_cache.extract.target import TargetSpec, describe_target
from dflash_cache.extract.tiny import build_tiny_target
from dflash_cache.train import speculative
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import FrozenTargetHead, init_drafter
from dflash_cache.train.export import drafter_from_export, export_drafter
from dflash_cache.train.speculative import evaluate, greedy_generate, load_prompts, speculative_generate

from .conftest import one_torch_thread
from .test_export import load_with_automodel

MAX_NEW_TOKENS = 48  # the longest decoding any test here asks for


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Token-by-token decoding is a long chain of tiny ops: see one_torch_thread."""
    with one_torch_thread():
        yield


class Tiny(NamedTuple):
    target: nn.Module
    head: FrozenTargetHead
    prompts: list[list[int]]
    references: dict[tuple[int, ...], list[int]]  # prompt -> its greedy continuation, MAX_NEW_TOKENS long


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    """The tiny target in float32, its head, six demo prompts and their greedy continuations, decoded once
    for the module. Greedy decoding is prefix-stable, so a shorter reference is a prefix of these."""
    target = build_tiny_target().float()
    prompts = load_prompts("demo", 6)
    references = {tuple(p): greedy_generate(target, p, MAX_NEW_TOKENS) for p in prompts}
    return Tiny(target, FrozenTargetHead.from_target(target), prompts, references)


@pytest.fixture
def shared_references(tiny, monkeypatch) -> None:
    """`evaluate` checks speculative output against the module's greedy references instead of decoding
    each prompt greedily again on every call."""

    def reference(target: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        assert target is tiny.target and max_new_tokens <= MAX_NEW_TOKENS, "no shared reference for this call"
        return tiny.references[tuple(prompt)][:max_new_tokens]

    monkeypatch.setattr(speculative, "greedy_generate", reference)


def test_greedy_reference_matches_hf_generate(tiny):
    """The shared reference itself (all MAX_NEW_TOKENS of it) is what HF's own greedy generate gives."""
    prompt = tiny.prompts[0]
    ids = torch.tensor([prompt])
    hf = tiny.target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                              min_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert tiny.references[tuple(prompt)] == hf[0, ids.shape[1]:].tolist()


@pytest.mark.usefixtures("shared_references")
def test_untrained_drafter_is_still_lossless(tiny):
    cfg = DrafterConfig.from_target(describe_target(TargetSpec(model="tiny")).config, (1, 2, 3, 4, 5), num_layers=2,
                                    block_size=8)
    r = evaluate(tiny.target, init_drafter(cfg, seed=0).float(), tiny.head, cfg, tiny.prompts, max_new_tokens=32)
    assert r.lossless and 1.0 <= r.tau < 1.5
    assert sum(r.histogram.values()) > 0


@pytest.mark.usefixtures("shared_references")
def test_trained_drafter_accepts_more_than_an_untrained_one(tiny, demo_drafter):
    cfg, trained = drafter_from_export(demo_drafter)
    untrained = init_drafter(cfg, seed=1)
    r_trained = evaluate(tiny.target, trained.float(), tiny.head, cfg, tiny.prompts, max_new_tokens=MAX_NEW_TOKENS)
    r_untrained = evaluate(tiny.target, untrained.float(), tiny.head, cfg, tiny.prompts,
                           max_new_tokens=MAX_NEW_TOKENS)
    assert r_trained.lossless and r_untrained.lossless
    assert r_trained.tau > r_untrained.tau + 0.05, (r_trained.tau, r_untrained.tau)


def test_eval_cli(demo_drafter):
    r = CliRunner().invoke(cli, ["eval", "--target", "tiny", "--drafter", str(demo_drafter), "--data", "demo",
                                 "--limit", "2", "--max-new-tokens", "24", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "tau (tokens per target forward):" in r.output and "lossless" in r.output


def test_shipped_model_code_drafts_as_eval_does(tiny, demo_drafter, tmp_path: Path):
    """The export's dflash.py (KV-cached context, as the public DFlash loop runs it) accepts exactly the
    drafts our `eval` accepts with the same trained drafter. The committed drafter is exported afresh, so
    that the model code under test is today's, not the copy committed beside its weights."""
    cfg, drafter = drafter_from_export(demo_drafter)
    export_drafter(drafter, cfg, tmp_path / "export")
    model, _ = load_with_automodel(tmp_path / "export", tmp_path / "modules")
    prompt = tiny.prompts[0]
    tokens, accepted = speculative_generate(tiny.target, drafter.float(), tiny.head, cfg, prompt, 32)
    ids, shipped = model.spec_generate(target=tiny.target, input_ids=torch.tensor([prompt]), max_new_tokens=32,
                                       return_acceptance=True)
    assert tokens == tiny.references[tuple(prompt)][:32]
    assert ids[0, len(prompt):].tolist() == tokens
    assert shipped == accepted and max(accepted) > 1
