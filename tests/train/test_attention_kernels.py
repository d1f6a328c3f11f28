"""Choosing FlexAttention's kernels for the static-shape graph (`--attention-kernels`): what `auto`
resolves to, the one-line refusal of an explicit `flash` that cannot run, and that the drafter's
static-shape graph (and only it) calls the chosen flex_attention. The kernels themselves run in
tests/train/test_cuda.py."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from click.testing import CliRunner
from torch.nn.attention.flex_attention import flex_attention

from dflash_cache.cli import cli
from dflash_cache.errors import UserError
from dflash_cache.target.tiny import tiny_config
from dflash_cache.train import attention_kernels as ak
from dflash_cache.train.config import DrafterConfig
from dflash_cache.train.drafter import init_drafter

CUDA = torch.device("cuda")


def importing(monkeypatch, flash_attn_cute) -> None:
    """importlib.import_module("flash_attn.cute") returns `flash_attn_cute`, or raises it."""
    real = importlib.import_module

    def import_module(name, *a):
        if name != "flash_attn.cute":
            return real(name, *a)
        if isinstance(flash_attn_cute, BaseException):
            raise flash_attn_cute
        return flash_attn_cute

    monkeypatch.setattr(importlib, "import_module", import_module)


@pytest.fixture
def hopper_with_flash(monkeypatch):
    """A CUDA device of compute capability 9.0 with flash_attn.cute importable, as far as the
    checks can tell (no GPU is touched)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    importing(monkeypatch, types.ModuleType("flash_attn.cute"))


def _choose(requested, device=CUDA, compiled=True, low_precision=True, head_dim=128):
    """The resolved kernels; the reason that comes with them is checked against flash_unavailable's."""
    kernels, reason = ak.choose_attention_kernels(requested, device, compiled=compiled,
                                                  low_precision=low_precision, head_dim=head_dim)
    if requested != "triton":
        assert reason == ak.flash_unavailable(device, compiled=compiled, low_precision=low_precision,
                                              head_dim=head_dim)
    return kernels


def test_auto_takes_flash_where_it_runs(hopper_with_flash):
    assert _choose("auto") == "flash"
    assert _choose("flash") == "flash"
    assert _choose("triton") == "triton"


@pytest.mark.parametrize("case, reason", [
    (dict(device=torch.device("cpu")), "NVIDIA GPU"),
    (dict(compiled=False), "--no-compile"),
    (dict(low_precision=False), "bf16"),
    # Qwen3.5-27B's drafter: the Hopper forward's 80-key tiles do not divide the masks' 128-key blocks
    (dict(head_dim=256), "heads of 128 here, not 256"),
    (dict(head_dim=32), "not 32"),  # the tiny target's
])
def test_auto_falls_back_to_triton_and_an_explicit_flash_says_why(hopper_with_flash, case, reason):
    assert _choose("auto", **case) == "triton"
    with pytest.raises(UserError, match=reason) as e:
        _choose("flash", **case)
    assert "use --attention-kernels triton" in str(e.value) and "\n" not in str(e.value)


def test_other_gpus_and_a_missing_or_broken_package_are_named(monkeypatch, hopper_with_flash):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 8.0" in ak.flash_unavailable(CUDA, compiled=True, low_precision=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert ak.flash_unavailable(CUDA, compiled=True, low_precision=True) is None

    importing(monkeypatch, ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn"))
    reason = ak.flash_unavailable(CUDA, compiled=True, low_precision=True)
    assert "flash-attn-4" in reason and "dflash-cache[flash]" in reason
    assert _choose("auto") == "triton"
    # installed without what it imports (what a wheel-by-wheel install once gave): named, and no traceback
    importing(monkeypatch, ModuleNotFoundError("No module named 'cutlass.cute'", name="cutlass.cute"))
    reason = ak.flash_unavailable(CUDA, compiled=True, low_precision=True)
    assert reason == "flash_attn.cute does not import (ModuleNotFoundError: No module named 'cutlass.cute')"
    assert _choose("auto") == "triton"
    importing(monkeypatch, OSError("libcute_dsl_runtime.so: cannot open shared object file"))
    with pytest.raises(UserError, match="does not import \\(OSError: libcute_dsl_runtime.so"):
        _choose("flash")


def test_unknown_kernels_are_refused():
    with pytest.raises(ValueError, match="auto"):
        _choose("fast")


def test_only_the_compiled_static_graph_calls_the_chosen_flex_attention():
    """The runners are replaced by recorders: which flex_attention each graph would be handed."""
    cfg = DrafterConfig.from_target(tiny_config(), (1, 3), num_layers=2, block_size=4)
    drafter = init_drafter(cfg, seed=0)
    drafter.compile_layers(attention_kernels="flash")
    assert drafter.static_flex_attention_fn is ak.flash_flex_attention
    assert drafter.flex_attention_fn is flex_attention
    seen: dict[str, list] = {"dynamic": [], "static": []}

    def recorder(kind):
        def run(layer, x, context, rope, mask, flex_fn, distinct_rows, scored_only):
            seen[kind].append(flex_fn)
            return x
        return run

    t, q = 6, 8
    edges = (lambda fc, norm, f: norm(fc(f)), lambda norm, x, dtype: x)
    drafter._dynamic_runners = (recorder("dynamic"), *edges)
    drafter._static_runners[(t, q)] = (recorder("static"), *edges)  # the graphs of the shape (t, q)
    args = (torch.randn(t, 2 * cfg.hidden_size), torch.arange(t), torch.randn(q, cfg.hidden_size),
            torch.arange(q), {"full_attention": None})
    drafter(*args, static=False)
    drafter(*args, static=True)
    assert seen == {"dynamic": [flex_attention] * 2, "static": [ak.flash_flex_attention] * 2}
    drafter.compile_layers()  # the default: Triton's in both graphs
    assert drafter.static_flex_attention_fn is flex_attention


def test_flash_on_a_cpu_is_one_line_and_exit_2(demo_cache, tmp_path):
    r = CliRunner().invoke(cli, ["train", "--cache", str(demo_cache), "--target", "tiny", "--out",
                                 str(tmp_path / "r"), "--max-steps", "1", "--device", "cpu", "--no-progress",
                                 "--attention-kernels", "flash"])
    assert r.exit_code == 2, r.output
    assert "--attention-kernels flash cannot run here" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "r" / "checkpoints").exists()
