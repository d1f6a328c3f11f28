"""The built-in `tiny` target: a small Qwen3 pretrained on the Python standard library, with its
tokenizer, shipped as package data so tests and the demo run with no download."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_cache.errors import UserError

TINY = "tiny"
# The built-in target's assets, made by `python -m tools.tiny_pretrain` and shipped as package data.
TINY_DIR = Path(__file__).resolve().parent / "tiny_target"
TINY_WEIGHTS_FILE = "model.safetensors"
TINY_CONFIG_FILE = "config.json"
TINY_TOKENIZER_FILE = "tokenizer.json"
TINY_PROMPTS_FILE = "demo_prompts.json"
TINY_REPORT_FILE = "train_report.json"
TINY_CHAT_TEMPLATE_FILE = "chat_template.jinja"
TINY_EOT = "<|endoftext|>"  # id 0: end of text, also the padding id
TINY_MASK = "<|mask|>"  # id vocab-1: the drafter's mask token, never produced from text

def tiny_config():
    """A small Qwen3-architecture target for tests and the demo: 8 layers, hidden 128, vocab 2048."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
        tie_word_embeddings=False, initializer_range=0.02, rms_norm_eps=1e-6,
    )


def tiny_weights_path() -> Path:
    path = TINY_DIR / TINY_WEIGHTS_FILE
    if not path.is_file():
        raise UserError(f"the tiny target's weights are missing ({path}); "
                        "run `python -m tools.tiny_pretrain --out dflash_cache/target/tiny_target`")
    return path


def build_tiny_target(num_layers: int | None = None) -> nn.Module:
    """The tiny target: a Qwen3 pretrained on the Python stdlib (see tools/tiny_pretrain.py),
    fp32 in memory, eval mode, cut to its first `num_layers` layers; global RNG state is untouched
    (the constructor's random init, immediately overwritten, runs in a forked RNG)."""
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    state = load_file(tiny_weights_path())
    with torch.random.fork_rng(devices=[]):
        model = Qwen3ForCausalLM(tiny_config())
    model.load_state_dict(state, strict=True)
    model = model.float()
    if num_layers is not None:
        model.model.layers = model.model.layers[:num_layers]
    return model.eval()


def load_tiny_tokenizer(path: Path | str | None = None):
    """The tiny target's `tokenizers.Tokenizer`, set to encode special-token text as plain text, so
    `<|mask|>` (id vocab-1) and `<|endoftext|>` (id 0) are never produced from input strings."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path if path is not None else TINY_DIR / TINY_TOKENIZER_FILE))
    tok.encode_special_tokens = True
    return tok


def tiny_tokenizer():
    """The tiny target's tokenizer as a transformers fast tokenizer (eos = pad = id 0, mask = vocab-1),
    with the shipped chat template so chat datasets run with no download."""
    from transformers import PreTrainedTokenizerFast

    template = (TINY_DIR / TINY_CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return PreTrainedTokenizerFast(tokenizer_file=str(TINY_DIR / TINY_TOKENIZER_FILE), eos_token=TINY_EOT,
                                   pad_token=TINY_EOT, mask_token=TINY_MASK, split_special_tokens=True,
                                   chat_template=template)

