"""The target model: loading it (cut after the last layer DFlash uses), choosing those layers, and
fingerprinting what a cache was made from.

Only the decoder layers up to the last selected one are built and loaded (the config is cut
before `from_pretrained`), the final norm is replaced by identity and the LM head is never run:
extraction pays for exactly the layers it keeps.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import inspect
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from dflash_cache.errors import UserError
from dflash_cache.files import hash_ends
from dflash_cache.logs import run_level
from dflash_cache.store.manifest import TargetIdentity
from dflash_cache.target.spec import DTYPE_NAMES, TargetSpec
from dflash_cache.target.tiny import TINY, TINY_DIR, build_tiny_target, tiny_config, tiny_weights_path

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}
# Config keys that say nothing about the computation the target performs.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
                         "_attn_implementation", "_attn_implementation_autoset", "architectures",
                         "_commit_hash", "output_hidden_states", "return_dict"}


LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet layers of hybrid decoders (Qwen3-Next, Qwen3.5)
HYBRID_KERNELS = ("fla", "causal_conv1d")  # without them transformers runs those layers in plain torch
HYBRID_INSTALL = "pip install 'dflash-cache[hybrid]'"


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


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weight_files(path: Path) -> list[Path]:
    """The checkpoint files of a model directory (sharded ones included), sorted by name."""
    return sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)


def weights_fingerprint(name: str) -> str:
    """Tells checkpoints of one architecture apart without reading them whole: sha256 over each
    weight file's name, size and first and last MiB (for `tiny`, all of its one small file)."""
    h = hashlib.sha256()
    if name == TINY:
        h.update(b"tiny:" + tiny_weights_path().read_bytes())
        return h.hexdigest()[:16]
    for path in weight_files(Path(name)):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        hash_ends(h, path, size)
    return h.hexdigest()[:16]


def config_hash(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class TargetDescription:
    """A target resolved from its config alone (no weights): identity and layer ids. `config` is the
    decoder's (a multimodal checkpoint's text config), the one every size is read from."""

    spec: TargetSpec
    config: Any  # a transformers config, whose fields depend on the architecture
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


def text_config(config: Any) -> Any:
    """The decoder's config: a multimodal wrapper's `text_config` (Qwen3.5 publishes its text models
    as image-text checkpoints), else the config itself. Only the language model is ever built."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def has_linear_attention(config) -> bool:
    return LINEAR_ATTENTION in (getattr(config, "layer_types", None) or ())


def warn_if_slow_hybrid(config, device: torch.device) -> bool:
    """Warn once per load when a hybrid target will run its linear-attention layers in plain torch on
    a GPU (correct but many times slower); returns whether it warned."""
    if device.type != "cuda" or not has_linear_attention(config):
        return False
    missing = [name for name in HYBRID_KERNELS if importlib.util.find_spec(name) is None]
    if not missing:
        return False
    log.warning("the target's linear-attention layers will run without fast kernels (%s not installed); "
                "install them with: %s", ", ".join(missing), HYBRID_INSTALL)
    return True


def _load_config(name: str, trust_remote_code: bool):
    if name == TINY:
        return tiny_config()
    path = Path(name)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(
            f"--model {name}: not a local model directory with a config.json "
            "(models are never downloaded; pass a local path or 'tiny')"
        )
    if not weight_files(path):  # checked before a cache is made for it: one made now would name no weights
        kinds = ", ".join(f"*{suffix}" for suffix in WEIGHT_SUFFIXES)
        raise UserError(f"--model {name}: no weight files ({kinds}) beside its config.json; pass the directory "
                        "that holds the checkpoint's weights (copy them there)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise UserError(f"--model {name}: cannot read its config ({type(e).__name__}: {e})") from None


def identify_target(spec: TargetSpec) -> tuple[Any, TargetIdentity]:
    """The target's decoder config and identity, its layer choice left unchecked (`eval` compares
    the identity with a drafter's before the layers that drafter reads); loads no weights."""
    dtype = parse_dtype(spec.dtype)
    config = text_config(_load_config(spec.model, spec.trust_remote_code))
    return config, TargetIdentity(
        name=spec.model if spec.model == TINY else str(Path(spec.model).resolve()),
        model_type=str(getattr(config, "model_type", "unknown")),
        config_hash=config_hash(config),
        dtype=str(dtype).removeprefix("torch."),
        num_hidden_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        weights_fingerprint=weights_fingerprint(spec.model),
    )


def describe_target(spec: TargetSpec) -> TargetDescription:
    """Resolve layer ids and the target's identity from its config; cheap, loads no weights."""
    config, identity = identify_target(spec)
    total = identity.num_hidden_layers
    layer_ids = check_layers(list(spec.layers), total) if spec.layers is not None else \
        select_layers(total, spec.num_layers)
    return TargetDescription(spec=spec, config=config, identity=identity, layer_ids=layer_ids)


def load_target(desc: TargetDescription, device: torch.device, keep: int | None = None,
                tp_mesh: DeviceMesh | None = None) -> nn.Module:
    """The target's weights cut after its last selected layer (or after `keep` layers; 0 loads only
    the embedding and LM head, which is what the drafter needs), in eval mode, on `device`. With
    `tp_mesh` (a 1-D device mesh over every rank), each rank holds its tensor-parallel share of
    the weights (transformers' tp_plan) and all of them run each forward together."""
    keep = desc.layer_ids[-1] + 1 if keep is None else keep
    dtype = parse_dtype(desc.spec.dtype)
    if desc.spec.model == TINY and tp_mesh is None:
        model = build_tiny_target(keep)
    else:
        model = _load_language_model(desc, keep, dtype, tp_mesh)
    warn_if_slow_hybrid(desc.config, device)
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    if keep == 0:  # the trainer needs only the embedding and the LM head
        log.log(run_level(logging.INFO), "target %s: embedding and LM head loaded (no decoder layer needed)",
                desc.identity.name)
    else:
        log.info("target %s: %d of %d layers kept%s", desc.identity.name, keep, desc.identity.num_hidden_layers,
                 f", capturing {desc.layer_ids}" if desc.layer_ids else "")
    return model


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Transformers' warnings off for the block (missing weights are checked by the caller instead)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def _tensor_parallel(mesh: DeviceMesh | None) -> dict[str, Any]:
    """from_pretrained's arguments for tensor parallelism over `mesh` (none without one): newer
    transformers take the plan in a DistributedConfig, older ones as `tp_plan`."""
    if mesh is None:
        return {}
    import transformers

    config_class = getattr(transformers, "DistributedConfig", None)
    if config_class is not None and "tp_plan" in inspect.signature(config_class).parameters:
        return {"distributed_config": config_class(tp_plan="auto"), "device_mesh": mesh}
    return {"tp_plan": "auto", "device_mesh": mesh}


def _load_language_model(desc: TargetDescription, keep: int, dtype: torch.dtype,
                         tp_mesh: DeviceMesh | None = None) -> nn.Module:
    """The causal LM of the (text) config cut to `keep` layers. For a multimodal checkpoint that is the
    text-only class (e.g. Qwen3_5ForCausalLM), whose transformers conversion maps the wrapper's
    weight names and skips the vision tower; a weight left unloaded is refused, never left random."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(desc.config)
    config.num_hidden_layers = keep
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:keep]
    try:
        with _quiet_transformers():  # its report lists every weight of the layers cut away as unexpected
            # (with output_loading_info it returns (model, info), which its annotation leaves out)
            model, info = AutoModelForCausalLM.from_pretrained(  # pyright: ignore[reportGeneralTypeIssues]
                str(TINY_DIR) if desc.spec.model == TINY else desc.spec.model, config=config, dtype=dtype,
                output_loading_info=True, trust_remote_code=desc.spec.trust_remote_code, low_cpu_mem_usage=True,
                **_tensor_parallel(tp_mesh),
            )
    except Exception as e:
        raise UserError(f"--model {desc.spec.model}: cannot load weights ({type(e).__name__}: {e})") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise UserError(f"--model {desc.spec.model}: {len(missing)} weights of {type(model).__name__} are not in "
                        f"the checkpoint (first: {missing[0]}); this checkpoint layout is not supported")
    return model


def decoder_of(model: nn.Module) -> nn.Module:
    """The bare decoder stack (embeddings + layers) of a causal LM."""
    if hasattr(model, "get_decoder"):  # an HF model's method (nn.Module types it as Tensor | Module)
        base = model.get_decoder()  # pyright: ignore[reportCallIssue]
    else:
        base = getattr(model, "model", model)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise UserError(f"{type(model).__name__} has no decoder layer list; this architecture is not supported")
    return base

