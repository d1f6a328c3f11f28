"""Speculative decoding with the drafter: lossless, and training raises the real acceptance."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dflash_cache.cli import cli
from dflash_cache.errors import UserError
from dflash_cache.target.model import TargetSpec, describe_target
from dflash_cache.target.tiny import build_tiny_target
from dflash_cache.train import speculative
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import FrozenTargetHead, init_drafter
from dflash_cache.train.export import drafter_from_export, export_drafter
from dflash_cache.train.speculative import evaluate, greedy_generate, load_prompts, speculative_generate

from .test_export import load_with_automodel

MAX_NEW_TOKENS = 32  # the longest decoding any test here asks for


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


def _share_references(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    def reference(target: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
        assert target is tiny.target and max_new_tokens <= MAX_NEW_TOKENS, "no shared reference for this call"
        return tiny.references[tuple(prompt)][:max_new_tokens]

    monkeypatch.setattr(speculative, "greedy_generate", reference)


@pytest.fixture
def shared_references(tiny, monkeypatch) -> None:
    """`evaluate` checks speculative output against the module's greedy references instead of decoding
    each prompt greedily again on every call."""
    _share_references(tiny, monkeypatch)


class Untrained(NamedTuple):
    cfg: DrafterConfig
    result: speculative.EvalResult


@pytest.fixture(scope="module")
def untrained(tiny) -> Untrained:
    """An untrained drafter of the demo drafter's shape (2 layers, blocks of 8), evaluated once for the
    module on the six prompts, MAX_NEW_TOKENS each (against the shared references): the slowest
    decoding here (nearly every block rejected), which one test checks and another must beat."""
    cfg = DrafterConfig.from_target(describe_target(TargetSpec(model="tiny")).config, (1, 2, 3, 4, 5), num_layers=2,
                                    block_size=8)
    with pytest.MonkeyPatch.context() as m:
        _share_references(tiny, m)
        return Untrained(cfg, evaluate(tiny.target, init_drafter(cfg, seed=0).float(), tiny.head, cfg, tiny.prompts,
                                       max_new_tokens=MAX_NEW_TOKENS))


def test_greedy_reference_matches_hf_generate(tiny):
    """The shared reference itself (all MAX_NEW_TOKENS of it) is what HF's own greedy generate gives."""
    prompt = tiny.prompts[0]
    ids = torch.tensor([prompt])
    hf = tiny.target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                              min_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert tiny.references[tuple(prompt)] == hf[0, ids.shape[1]:].tolist()


def test_untrained_drafter_is_still_lossless(untrained):
    r = untrained.result
    assert r.lossless and 1.0 <= r.tau < 1.5
    assert sum(r.histogram.values()) > 0


@pytest.mark.usefixtures("shared_references")
def test_trained_drafter_accepts_more_than_an_untrained_one(tiny, demo_drafter, untrained):
    """The committed drafter against the module's untrained one of its own shape, on the same prompts and
    decoding length (trained tau is about 1.25 here, untrained 1.0: well clear of the 0.05 asked)."""
    cfg, trained = drafter_from_export(demo_drafter)
    assert cfg == untrained.cfg
    r_trained = evaluate(tiny.target, trained.float(), tiny.head, cfg, tiny.prompts, max_new_tokens=MAX_NEW_TOKENS)
    r_untrained = untrained.result
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


@pytest.fixture(scope="module", params=["qwen3_5", "gpt_oss", "llama3"])
def family_target(request, tmp_path_factory) -> nn.Module:
    """A tiny random target of a family as `eval` loads it: hybrid linear/full attention (Qwen3.5, from
    its multimodal checkpoint), sliding/full alternation (gpt-oss), plain full attention (Llama 3)."""
    from dflash_cache.target.model import load_target
    from tests.dflash_cache.target.test_architectures import FAMILIES, LAYERS

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param) / "model"
    FAMILIES[request.param]().float().eval().save_pretrained(path)
    desc = describe_target(TargetSpec(model=str(path), dtype="float32", layers=LAYERS))
    return load_target(desc, torch.device("cpu"), keep=desc.identity.num_hidden_layers)


@pytest.mark.parametrize("kept", [1, 3, 5])
def test_keeping_part_of_a_verified_block_is_as_if_only_that_part_was_seen(family_target, kept):
    """A verify forward of 5 tokens of which only the first `kept` are the greedy ones, then `keep`:
    decoding on from there gives the logits of one uncached forward over the kept sequence. On a
    hybrid target this restores the linear-attention layers' recurrent state, which cannot be cropped
    (random tiny weights barely move the argmax, so the logits are compared, not tokens)."""
    prompt = list(range(7, 27))
    reference = greedy_generate(family_target, prompt, 12)
    with torch.no_grad():
        full = family_target(input_ids=torch.tensor([prompt + reference])).logits[0, len(prompt) - 1:]
    session = speculative.TargetSession(family_target, hidden_states=False)
    session.forward(torch.tensor([prompt]))
    junk = [(t + 101) % 256 for t in reference[kept:5]]  # not the greedy tokens
    out = session.forward(torch.tensor([reference[:kept] + junk]))
    session.keep(kept)
    logits = [out.logits[0, kept - 1]]
    for token in reference[kept:-1]:
        out = session.forward(torch.tensor([[token]]))
        session.keep(1)
        logits.append(out.logits[0, -1])
    torch.testing.assert_close(torch.stack(logits), full[kept:len(reference)], rtol=1e-4, atol=1e-5)


def test_eval_is_lossless_on_a_hybrid_target(family_target):
    """Speculative decoding with a random drafter (mostly rejected blocks) reproduces greedy decoding."""
    from tests.dflash_cache.target.test_architectures import LAYERS

    cfg = DrafterConfig.from_target(family_target.config, LAYERS, num_layers=1, block_size=4)
    drafter = init_drafter(cfg, seed=0).eval()
    result = evaluate(family_target, drafter, FrozenTargetHead.from_target(family_target), cfg,
                      [list(range(5, 25)), list(range(30, 47))], 16)
    assert result.lossless and sum(result.histogram.values()) > 0


def test_a_prompt_token_outside_the_vocabulary_is_one_line_naming_the_row_and_id(tmp_path):
    """Without the check the target's embedding fails on the id with a traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7, 8], [9, 4096, 11, 12]], "loss_mask": [[0, 0, 1, 1]] * 2}), data)
    assert load_prompts(str(data), 1, vocab_size=2048) == [[5, 6]]  # the bad row is not among the first one
    with pytest.raises(UserError) as e:
        load_prompts(str(data), 2, vocab_size=2048)
    message = str(e.value)
    assert "row 1" in message and "token id 4096" in message and str(data) in message and "\n" not in message


@pytest.mark.usefixtures("shared_references")
def test_evaluate_logs_its_progress(tiny, caplog):
    cfg = DrafterConfig.from_target(describe_target(TargetSpec(model="tiny")).config, (1, 2, 3, 4, 5), num_layers=1,
                                    block_size=4)
    with caplog.at_level(logging.INFO, logger=speculative.__name__):
        evaluate(tiny.target, init_drafter(cfg, seed=0).float(), tiny.head, cfg, tiny.prompts[:3], max_new_tokens=8)
    progress = [r.getMessage() for r in caplog.records if "/3 prompts" in r.getMessage()]
    assert [m.split(" prompts")[0] for m in progress] == ["eval: 1/3", "eval: 2/3", "eval: 3/3"], caplog.text
    assert all("tau" in m and "tok/s" in m for m in progress), progress


def test_progress_lines_are_bounded_on_many_prompts(tiny, monkeypatch, caplog):
    """One line per prompt would flood a long evaluation: the first prompt's, then every few."""
    monkeypatch.setattr(speculative, "greedy_generate", lambda target, prompt, n: [0] * n)
    monkeypatch.setattr(speculative, "speculative_generate", lambda *a: ([0] * a[-1], [1] * a[-1]))
    with caplog.at_level(logging.INFO, logger=speculative.__name__):
        evaluate(tiny.target, None, tiny.head, DrafterConfig.from_target(describe_target(TargetSpec(model="tiny")).config,
                                                                         (1, 2), num_layers=1, block_size=4),
                 [[1]] * 100, max_new_tokens=2)
    done = [r.getMessage().split()[1] for r in caplog.records if "/100 prompts" in r.getMessage()]
    assert done[0] == "1/100" and done[-1] == "100/100" and len(done) == speculative.PROGRESS_LINES + 1, done
