"""The target families users point the tool at, each as a tiny random checkpoint built from its config:
extract on the CPU, verify the cache, train a few steps from it, evaluate the export losslessly, and
check the captured features against the plain Hugging Face forward (also with padding in the batch)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from click.testing import CliRunner

from dflash_cache.cli import cli
from dflash_cache.extract.run import extract
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify
from dflash_cache.target.capture import HiddenStateCapture
from dflash_cache.target.model import TargetSpec, describe_target, load_target, warn_if_slow_hybrid
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.trainer import Trainer
from tests.conftest import extract_config
from tools.make_demo_drafter import demo_train_config

VOCAB = 256
LAYERS = (1, 3, 4)  # of 6: both kinds of layer in every hybrid / alternating family
ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=6,
                 vocab_size=VOCAB, max_position_embeddings=512)


def _qwen3_5() -> transformers.PreTrainedModel:
    """Published as image-text: the language model's sizes under text_config, a vision tower beside it."""
    text = dict(ATTENTION, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    return transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                   vision_config=vision))


def _qwen3_moe() -> transformers.PreTrainedModel:
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **ATTENTION, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2))


def _llama3() -> transformers.PreTrainedModel:
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**ATTENTION, intermediate_size=96,
                                                                  rope_parameters=rope))


def _gpt_oss() -> transformers.PreTrainedModel:
    """Sliding (window 8, shorter than the rows) and full layers alternate; attention has sinks."""
    rope = dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0,
                truncate=False, original_max_position_embeddings=64)
    return transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **ATTENTION, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        rope_parameters=rope))


FAMILIES = {"qwen3_5": _qwen3_5, "qwen3_moe": _qwen3_moe, "llama3": _llama3, "gpt_oss": _gpt_oss}


def _language_model(model: transformers.PreTrainedModel) -> torch.nn.Module:
    """The decoder stack a plain forward's hidden_states come from (inside the wrapper for Qwen3.5)."""
    return getattr(model.model, "language_model", model.model)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, transformers.PreTrainedModel]:
    torch.manual_seed(0)
    model = FAMILIES[request.param]().float().eval()
    path = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(path)
    return request.param, path, model


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """20 rows of 20..63 tokens, each with at least 16 supervised (two blocks of 8, what training needs)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 64, size=20)
    table = pa.table({"input_ids": [rng.integers(0, VOCAB - 1, size=n).tolist() for n in lengths],
                      "loss_mask": [[0] * 4 + [1] * (n - 4) for n in lengths]})
    path = tmp_path_factory.mktemp("rows") / "rows.parquet"
    pq.write_table(table, path)
    return path


def _reference(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hs = _language_model(model)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[k + 1][0] for k in LAYERS], dim=1)


def test_extract_verify_train_and_eval(checkpoint, rows, tmp_path):
    """extract -> inspect --verify clean, features equal to the uncut model's forward -> train steps ->
    eval: speculative decoding with the exported drafter reproduces the target's greedy decoding."""
    _, path, model = checkpoint
    cache = tmp_path / "cache"
    spec = TargetSpec(model=str(path), dtype="float32", layers=LAYERS)
    extract(extract_config(rows, cache, target=spec, codec="none"), "cpu", echo=lambda *_: None)
    reader = CacheReader(cache)
    assert reader.complete and verify(reader) == []
    identity = reader.manifest.target
    assert (identity.num_hidden_layers, identity.hidden_size, identity.vocab_size) == (6, 64, VOCAB)
    table = pq.read_table(rows)
    for sid in (0, 7, 19):  # rows of different batches, padded beside longer ones
        ids = table.column("input_ids")[sid].as_py()
        torch.testing.assert_close(reader.sample(sid).features.float(),
                                   _reference(model, ids).to(torch.bfloat16).float(), rtol=0.02, atol=0.02)
    Trainer.build(demo_train_config(cache, tmp_path / "run", target=str(path), max_steps=2),
                  device=torch.device("cpu")).fit()
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()
    result = CliRunner().invoke(cli, ["eval", "--target", str(path), "--drafter", str(tmp_path / "run"),
                                      "--data", str(rows), "--limit", "2", "--max-new-tokens", "12",
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "lossless: output equals the target's greedy output" in result.output


def test_padding_leaves_a_row_unchanged(checkpoint):
    """A row's features alone equal its features right-padded in a batch beside a longer row."""
    _, path, _ = checkpoint
    desc = describe_target(TargetSpec(model=str(path), dtype="float32", layers=LAYERS))
    capture = HiddenStateCapture(load_target(desc, torch.device("cpu")), list(LAYERS))
    gen = torch.Generator().manual_seed(1)
    short, long = torch.randint(0, VOCAB, (13,), generator=gen), torch.randint(0, VOCAB, (40,), generator=gen)
    alone = capture(short[None], torch.ones(1, 13, dtype=torch.long), torch.arange(13))
    ids = torch.zeros(2, 40, dtype=torch.long)
    ids[0, :13], ids[1] = short, long
    attention = torch.zeros(2, 40, dtype=torch.long)
    attention[0, :13], attention[1] = 1, 1
    batched = capture(ids, attention, torch.cat([torch.arange(13), 40 + torch.arange(40)]))
    torch.testing.assert_close(batched[:13].float(), alone.float(), rtol=0.02, atol=0.02)


def test_drafter_sizes_come_from_the_text_config(checkpoint):
    family, path, _ = checkpoint
    config = transformers.AutoConfig.from_pretrained(path)  # the wrapper's, for Qwen3.5
    drafter = DrafterConfig.from_target(config, LAYERS, num_layers=2)
    assert (drafter.hidden_size, drafter.num_attention_heads, drafter.head_dim, drafter.vocab_size) == (64, 4, 16,
                                                                                                        VOCAB)
    assert drafter.target_num_hidden_layers == 6
    expected = {"qwen3_5": 10000.0, "qwen3_moe": 10000.0, "llama3": 500000.0, "gpt_oss": 150000.0}
    assert drafter.rope_theta == expected[family]


@pytest.mark.parametrize(("device", "layer_types", "installed", "warns"), [
    ("cuda", ["linear_attention", "full_attention"], False, True),
    ("cuda", ["linear_attention", "full_attention"], True, False),
    ("cpu", ["linear_attention", "full_attention"], False, False),
    ("cuda", ["sliding_attention", "full_attention"], False, False),
])
def test_hybrid_kernel_warning(monkeypatch, caplog, device, layer_types, installed, warns):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if installed else None)
    config = transformers.Qwen3_5TextConfig(layer_types=layer_types, num_hidden_layers=2)
    with caplog.at_level(logging.WARNING):
        assert warn_if_slow_hybrid(config, torch.device(device)) is warns
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == int(warns)
    assert not warns or "pip install 'dflash-cache[hybrid]'" in said[0]
