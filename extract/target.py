"""The target model: loading it, choosing DFlash layers, and capturing their packed outputs.

Only the decoder layers up to the last selected one are built and loaded (the config is cut
before `from_pretrained`), the final norm is replaced by identity and the LM head is never run:
extraction pays for exactly the layers it keeps. Each selected layer's output is packed over real
tokens by a forward hook as soon as the layer finishes, straight into its column block of the
[T, n_layers * H] result, so no padded [B, L, n_layers * H] tensor ever exists.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dflash_cache.errors import UserError
from dflash_cache.manifest import TargetIdentity

log = logging.getLogger(__name__)

TINY = "tiny"
# The built-in target's assets, made by `python -m extract.tiny_pretrain` and shipped as package data.
TINY_DIR = Path(__file__).resolve().parent / "tiny_target"
TINY_WEIGHTS_FILE = "model.safetensors"
TINY_CONFIG_FILE = "config.json"
TINY_TOKENIZER_FILE = "tokenizer.json"
TINY_PROMPTS_FILE = "demo_prompts.json"
TINY_REPORT_FILE = "train_report.json"
TINY_EOT = "<|endoftext|>"  # id 0: end of text, also the padding id
TINY_MASK = "<|mask|>"  # id vocab-1: the drafter's mask token, never produced from text
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
# Config keys that say nothing about the computation the target performs.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
                         "_attn_implementation", "_attn_implementation_autoset", "architectures",
                         "_commit_hash", "output_hidden_states", "return_dict"}


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
                        "run `python -m extract.tiny_pretrain --out extract/tiny_target`")
    return path


def build_tiny_target(num_layers: int | None = None) -> nn.Module:
    """The tiny target: a Qwen3 pretrained on the Python stdlib (see extract/tiny_pretrain.py),
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
    """The tiny target's tokenizer as a transformers fast tokenizer (eos = pad = id 0, mask = vocab-1)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(TINY_DIR / TINY_TOKENIZER_FILE), eos_token=TINY_EOT,
                                   pad_token=TINY_EOT, mask_token=TINY_MASK, split_special_tokens=True)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UserError(f"unknown --dtype {name!r}; choose one of: {', '.join(DTYPES)}") from None


def select_layers(num_hidden_layers: int, count: int) -> list[int]:
    """DFlash's default: `count` layers spread evenly from 1 to L-3, rounded (36 -> 1,9,17,25,33)."""
    if count < 1:
        raise UserError(f"--num-layers must be at least 1, got {count}")
    hi = num_hidden_layers - 3
    if hi < 1 or count > hi:
        raise UserError(
            f"a {num_hidden_layers}-layer target cannot give {count} distinct layers in 1..{hi}; "
            "lower --num-layers or pass --layers"
        )
    # count <= hi makes the step >= 1, so rounding keeps the ids distinct.
    return [int(np.floor(x + 0.5)) for x in np.linspace(1, hi, count)]


def check_layers(layer_ids: list[int], num_hidden_layers: int) -> list[int]:
    if not layer_ids:
        raise UserError("--layers is empty; give comma-separated decoder layer indices like 1,9,17")
    if sorted(set(layer_ids)) != list(layer_ids):
        raise UserError(f"--layers {layer_ids} must be strictly increasing with no repeats")
    if layer_ids[0] < 0 or layer_ids[-1] > num_hidden_layers - 2:
        raise UserError(
            f"--layers {layer_ids} must lie in 0..{num_hidden_layers - 2} for a {num_hidden_layers}-layer "
            "target (the last layer's output is post-norm in Hugging Face and is never used)"
        )
    return list(layer_ids)


def weights_fingerprint(name: str) -> str:
    """Tells checkpoints of one architecture apart without reading them whole: sha256 over each
    weight file's name, size and first and last MiB (for `tiny`, all of its one small file)."""
    h = hashlib.sha256()
    if name == TINY:
        h.update(b"tiny:" + tiny_weights_path().read_bytes())
        return h.hexdigest()[:16]
    files = sorted(p for p in Path(name).iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def config_hash(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TargetSpec:
    """What the user asked for: which model, in which dtype, capturing which layers."""

    model: str
    dtype: str = "bfloat16"
    num_layers: int = 5
    layers: tuple[int, ...] | None = None
    trust_remote_code: bool = False


@dataclass
class TargetDescription:
    """A target resolved from its config alone (no weights): identity and layer ids."""

    spec: TargetSpec
    config: object
    identity: TargetIdentity
    layer_ids: list[int]

    @property
    def hidden_size(self) -> int:
        return self.identity.hidden_size

    @property
    def max_context(self) -> int | None:
        """Longest sequence the target is built for (its config's max_position_embeddings), if given."""
        n = getattr(self.config, "max_position_embeddings", None)
        return n if isinstance(n, int) and n > 0 else None


def _load_config(name: str, trust_remote_code: bool):
    if name == TINY:
        return tiny_config()
    path = Path(name)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(
            f"--model {name}: not a local model directory with a config.json "
            "(models are never downloaded; pass a local path or 'tiny')"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise UserError(f"--model {name}: cannot read its config ({type(e).__name__}: {e})") from None


def describe_target(spec: TargetSpec) -> TargetDescription:
    """Resolve layer ids and the target's identity from its config; cheap, loads no weights."""
    dtype = parse_dtype(spec.dtype)
    config = _load_config(spec.model, spec.trust_remote_code)
    total = int(config.num_hidden_layers)
    layer_ids = check_layers(list(spec.layers), total) if spec.layers else select_layers(total, spec.num_layers)
    identity = TargetIdentity(
        name=spec.model if spec.model == TINY else str(Path(spec.model).resolve()),
        model_type=str(getattr(config, "model_type", "unknown")),
        config_hash=config_hash(config),
        dtype=str(dtype).removeprefix("torch."),
        num_hidden_layers=total,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        weights_fingerprint=weights_fingerprint(spec.model),
    )
    return TargetDescription(spec=spec, config=config, identity=identity, layer_ids=layer_ids)


def load_target(desc: TargetDescription, device: torch.device, keep: int | None = None) -> nn.Module:
    """The target's weights cut after its last selected layer (or after `keep` layers; 0 loads only
    the embedding and LM head, which is what the drafter needs), in eval mode, on `device`."""
    keep = desc.layer_ids[-1] + 1 if keep is None else keep
    dtype = parse_dtype(desc.spec.dtype)
    if desc.spec.model == TINY:
        model = build_tiny_target(keep)
    else:
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(desc.config)
        config.num_hidden_layers = keep
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:keep]
        try:
            model = AutoModelForCausalLM.from_pretrained(
                desc.spec.model, config=config, dtype=dtype,
                trust_remote_code=desc.spec.trust_remote_code, low_cpu_mem_usage=True,
            )
        except Exception as e:
            raise UserError(f"--model {desc.spec.model}: cannot load weights ({type(e).__name__}: {e})") from None
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    if keep == 0:  # the trainer needs only the embedding and the LM head
        log.info("target %s: embedding and LM head loaded (no decoder layer needed)", desc.identity.name)
    else:
        log.info("target %s: %d of %d layers kept, capturing %s", desc.identity.name, keep,
                 desc.identity.num_hidden_layers, desc.layer_ids)
    return model


def decoder_of(model: nn.Module) -> nn.Module:
    """The bare decoder stack (embeddings + layers) of a causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise UserError(f"{type(model).__name__} has no decoder layer list; this architecture is not supported")
    return base


def prebuilt_mask_ok(config) -> bool:
    """Whether we may hand SDPA our own 4-D mask: SDPA attention and no sliding-window layers."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return impl == "sdpa" and all(t == "full_attention" for t in layer_types)


def causal_padding_mask(attention: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool, True where query t may see key s: s <= t and s is a real token.

    The same mask Hugging Face builds for right-padded SDPA batches, but made on the device
    without looking at the data: HF's own path calls `.all()` on the 2-D mask, a host sync per
    forward that leaves the GPU idle while the CPU catches up.
    """
    length = attention.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention.device).tril_()
    return causal[None, None] & attention.bool()[:, None, None, :]


def run_backbone(decoder: nn.Module, input_ids: torch.Tensor, attention: torch.Tensor) -> None:
    """The cut decoder stack on a right-padded batch (outputs are taken by hooks)."""
    mask = causal_padding_mask(attention) if prebuilt_mask_ok(decoder.config) else attention
    decoder(input_ids=input_ids, attention_mask=mask, use_cache=False)


class HiddenStateCapture:
    """Runs the cut target and returns the selected layers packed over real tokens.

    `__call__(input_ids [B, L], attention_mask [B, L], gather [T])` returns bf16 [T, n*H] where
    `gather` holds the flat indices b * L + t of the real tokens (built on the host, so packing
    needs no `nonzero()` and no host synchronisation).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:
        self.decoder = decoder_of(model)
        self.layer_ids = layer_ids
        self.hidden_size = int(model.config.hidden_size)
        if hasattr(self.decoder, "norm"):
            self.decoder.norm = nn.Identity()  # the post-norm output of the cut stack is unused
        self._out: torch.Tensor | None = None
        self._gather: torch.Tensor | None = None
        self._busy = threading.Lock()  # the hooks read per-call state: one call at a time
        self._hooks = [self.decoder.layers[layer_id].register_forward_hook(self._hook(col))
                       for col, layer_id in enumerate(layer_ids)]

    def remove(self) -> None:
        """Detach the hooks, leaving the model as it was (benchmarks reuse one model)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, col: int):
        h = self.hidden_size

        def pack(_module: nn.Module, _args: tuple, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            assert self._out is not None and self._gather is not None
            flat = hidden.reshape(-1, h).index_select(0, self._gather)
            self._out[:, col * h : (col + 1) * h].copy_(flat)

        return pack

    @torch.no_grad()  # not inference_mode: the live source hands these features to autograd
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gather: torch.Tensor) -> torch.Tensor:
        n_tokens = gather.shape[0]
        width = len(self.layer_ids) * self.hidden_size
        with self._busy:
            self._out = torch.empty(n_tokens, width, dtype=torch.bfloat16, device=input_ids.device)
            self._gather = gather
            try:
                run_backbone(self.decoder, input_ids, attention_mask)
                return self._out
            finally:
                self._out, self._gather = None, None
