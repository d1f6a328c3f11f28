"""GPU paths of extraction: run where CUDA exists (the H200 benchmark machine), skipped on CPU CI."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from dflash_cache.extract.run import extract
from dflash_cache.store.codecs.fp8 import fp8_error_bound
from dflash_cache.store.reader import CacheReader
from dflash_cache.store.report import verify
from dflash_cache.target.model import TargetSpec
from dflash_cache.target.tiny import build_tiny_target
from tests.conftest import extract_config

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_gpu_features_equal_plain_hf_forward(small_parquet, tmp_path):
    layers = (1, 3, 5)
    cfg = extract_config(small_parquet, tmp_path / "c", codec="none",
                         target=TargetSpec(model="tiny", dtype="float32", layers=layers))
    extract(cfg, "0", echo=lambda *_: None)
    reader = CacheReader(tmp_path / "c")
    full = build_tiny_target().float()
    table = pq.read_table(small_parquet)
    for sid in range(0, 48, 5):
        ids = table.column("input_ids")[sid].as_py()
        with torch.no_grad():
            hs = full(torch.tensor([ids]), output_hidden_states=True).hidden_states
        ref = torch.cat([hs[k + 1][0] for k in layers], dim=1).to(torch.bfloat16).float()
        diff = (reader.sample(sid).features.float() - ref).abs()
        assert torch.all(diff <= 2**-7 * ref.abs() + 1e-4), f"sample {sid}: max diff {diff.max()}"


@needs_cuda
@pytest.mark.parametrize("gpus", ["0", "0,0"])  # "0,0": two launched ranks sharing one GPU
def test_gpu_fp8_cache_matches_lossless_cache(small_parquet, tmp_path, gpus):
    ref_cfg = extract_config(small_parquet, tmp_path / "ref", codec="none")
    extract(ref_cfg, "0", echo=lambda *_: None)
    cfg = extract_config(small_parquet, tmp_path / "fp8", codec="fp8")
    extract(cfg, gpus, echo=lambda *_: None)
    ref, got = CacheReader(tmp_path / "ref"), CacheReader(tmp_path / "fp8")
    assert got.complete and not verify(got)
    if gpus == "0,0":
        assert {r.rank for r in got.records} == {0, 1}
    for sid in range(48):
        x = ref.sample(sid).features
        err = (got.sample(sid).features.float() - x.float()).abs()
        assert torch.all(err <= fp8_error_bound(x, 5)), f"sample {sid}"
