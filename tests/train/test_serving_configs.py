"""An export read the way SGLang's and vLLM's DFlash loaders and the speculators converter read it, and
the command lines docs/serving.md shows, rendered by dflash_cache.train.serving.

No engine runs here (they need a GPU). What each one reads was taken from its source; the names and
rules below are data, each with the repository and file it came from (versions in docs/serving.md):

  SGLang      sgl-project/sglang  python/sglang/srt/models/dflash.py (DFlashDraftModel, load_weights),
              python/sglang/srt/speculative/dflash_utils.py (parse_dflash_draft_config),
              python/sglang/srt/arg_groups/speculative_hook.py (_handle_dflash)
  vLLM        vllm-project/vllm   vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3ForCausalLM),
              vllm/config/speculative.py, vllm/v1/spec_decode/dflash.py, llm_base_proposer.py
  speculators vllm-project/speculators  speculators/convert/dflash/converter.py (DFlashConverter),
              speculators/models/dflash/core.py (DFlashDraftModel)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_cache.cli import cli
from dflash_cache.errors import UserError
from dflash_cache.target.tiny import tiny_config
from dflash_cache.train.config import SLIDING_ATTENTION, DrafterConfig
from dflash_cache.train.drafter import init_drafter
from dflash_cache.train.export import export_drafter
from dflash_cache.train.serving import (
    ENGINES,
    format_command,
    read_served_drafter,
    render,
    served_drafter,
)
from tests.train.test_export import LAYER_IDS

BLOCK = 16
DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
# The placeholders docs/serving.md renders its commands for.
DOC_EXPORT, DOC_TARGET = "runs/my-run/export", "/path/to/target"

# Fused parameters both engines build from separate checkpoint tensors: checkpoint projection -> (fused
# parameter, shard position). From sgl-project/sglang python/sglang/srt/models/dflash.py
# (DFlashDraftModel.load_weights, stacked_params_mapping) and vllm-project/vllm
# vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3Model.hf_to_vllm_mapper, orig_to_new_stacked).
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

# Each loader's parameters, per draft layer and for the whole drafter, with shapes in symbols resolved
# from config.json (`dims`). SGLang, sgl-project/sglang python/sglang/srt/models/dflash.py:
# DFlashDecoderLayer / DFlashAttention / DFlashMLP (qkv_proj and gate_up_proj fused), fc / hidden_norm /
# norm at the top, no embedding or LM head. vLLM, vllm-project/vllm
# vllm/model_executor/models/qwen3_dflash.py: the same modules under "model." (DFlashQwen3ForCausalLM
# builds DFlashQwen3Model with prefix "model"; its load_weights prefixes every name but lm_head with
# "model."). speculators, vllm-project/speculators speculators/models/dflash/core.py and
# model_definitions.py: Qwen3DFlashDecoderLayer's unfused projections, names as stored (the converter,
# speculators/convert/dflash/converter.py, loads them with load_state_dict(strict=False) and refuses
# unexpected names).
FUSED_LAYER = {"input_layernorm.weight": ("H",), "post_attention_layernorm.weight": ("H",),
               "self_attn.qkv_proj.weight": ("Q+2KV", "H"), "self_attn.o_proj.weight": ("H", "Q"),
               "self_attn.q_norm.weight": ("D",), "self_attn.k_norm.weight": ("D",),
               "mlp.gate_up_proj.weight": ("2I", "H"), "mlp.down_proj.weight": ("H", "I")}
UNFUSED_LAYER = {**{k: v for k, v in FUSED_LAYER.items() if "qkv" not in k and "gate_up" not in k},
                 "self_attn.q_proj.weight": ("Q", "H"), "self_attn.k_proj.weight": ("KV", "H"),
                 "self_attn.v_proj.weight": ("KV", "H"), "mlp.gate_proj.weight": ("I", "H"),
                 "mlp.up_proj.weight": ("I", "H")}
# fc's input width: SGLang (models/dflash.py) takes len(target_layer_ids) features (num_context_features);
# vLLM (qwen3_dflash.py _get_dflash_fc_input_size) hidden_size times the aux layers, which are
# dflash_config.target_layer_ids + 1 (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py); the
# speculators converter aux_hidden_state_layer_ids, target_layer_ids + 1 less the target's last layer.
TOP = {"fc.weight": ("H", "CTX"), "hidden_norm.weight": ("H",), "norm.weight": ("H",)}
# An unknown tensor name: SGLang's load_weights skips it silently ("Ignore unexpected weights"), leaving
# its parameter unset; vLLM's AutoWeightsLoader refuses it ("There is no module or parameter named");
# the speculators converter refuses it ("Unexpected keys in checkpoint").
ENGINE_LOADERS = {  # engine: (prefix of every parameter, per-layer parameters)
    "sglang": ("", FUSED_LAYER),
    "vllm": ("model.", FUSED_LAYER),
    "speculators": ("", UNFUSED_LAYER),
}
# What the speculators converter fills from the target instead (converter.py _VERIFIER_FILLED_KEYS): an
# export ships none.
VERIFIER_FILLED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                   "t2d", "d2t"}
# config.json keys the speculators converter keeps out of the Qwen3 config it builds (converter.py
# _NON_TRANSFORMER_KEYS).
SPECULATORS_NON_TRANSFORMER_KEYS = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A tiny two-layer drafter of block size 16, exported into a run directory's export/."""
    cfg = DrafterConfig.from_target(tiny_config(), LAYER_IDS, num_layers=2, block_size=BLOCK)
    out = tmp_path_factory.mktemp("run") / "export"
    export_drafter(init_drafter(cfg, seed=0), cfg, out)
    return out


def read_config(export: Path) -> dict:
    return json.loads((export / "config.json").read_text())


def stored_shapes(export: Path) -> dict[str, tuple[int, ...]]:
    """model.safetensors' tensor names and shapes, read as the loaders iterate it."""
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def dims(config: dict) -> dict[str, int]:
    h, d = config["hidden_size"], config["head_dim"]
    q, kv, i = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, config["intermediate_size"]
    ctx = len(config["dflash_config"]["target_layer_ids"]) * h
    return {"H": h, "D": d, "Q": q, "KV": kv, "Q+2KV": q + 2 * kv, "I": i, "2I": 2 * i, "CTX": ctx}


def expected_params(engine: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters `engine` builds from config.json alone, with their shapes."""
    prefix, layer = ENGINE_LOADERS[engine]
    sizes = dims(config)
    names = {f"layers.{n}.{k}": v for n in range(config["num_hidden_layers"]) for k, v in layer.items()}
    return {prefix + name: tuple(sizes[s] for s in shape) for name, shape in {**names, **TOP}.items()}


def load_as(engine: str, shapes: dict[str, tuple[int, ...]], config: dict
            ) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """(parameter -> shape it receives, tensors the loader ignores or refuses), mapping checkpoint names
    the way `engine`'s loader does; fused parameters receive their shards concatenated on dim 0."""
    params = expected_params(engine, config)
    fuses = ENGINE_LOADERS[engine][1] is FUSED_LAYER
    shards: dict[str, dict[int, tuple[int, ...]]] = {}
    loaded, rejected = {}, []
    for name, shape in shapes.items():
        if engine == "vllm" and "lm_head" not in name:
            name = "model." + name  # DFlashQwen3ForCausalLM.load_weights
        proj = next((w for w in STACKED if f".{w}." in name), None) if fuses else None
        if proj is not None:
            fused, position = STACKED[proj]
            name = name.replace(f".{proj}.", f".{fused}.")
        resolved = _resolve(engine, name, params)
        if resolved is None:
            rejected.append(name)
        elif proj is not None:
            shards.setdefault(resolved, {})[position] = shape
        else:
            loaded[resolved] = shape
    for fused, parts in shards.items():
        if sorted(parts) != list(range(len(parts))) or len({s[1:] for s in parts.values()}) != 1:
            rejected.append(f"{fused} (shards {sorted(parts)})")
            continue
        loaded[fused] = (sum(s[0] for s in parts.values()), *next(iter(parts.values()))[1:])
    return loaded, rejected


def _resolve(engine: str, name: str, params: dict) -> str | None:
    if name in params:
        return name
    if engine == "sglang":  # resolve_param_name: the name as stored, without "model.", or with it
        other = name.removeprefix("model.") if name.startswith("model.") else f"model.{name}"
        return other if other in params else None
    return None


def engine_view(engine: str, export: Path) -> tuple[dict, dict, list[str]]:
    config = read_config(export)
    loaded, rejected = load_as(engine, stored_shapes(export), config)
    return expected_params(engine, config), loaded, rejected


@pytest.mark.parametrize("engine", ENGINE_LOADERS)
def test_every_tensor_lands_on_a_parameter_of_its_shape(exported, engine):
    expected, loaded, rejected = engine_view(engine, exported)
    assert rejected == []  # SGLang would drop these silently, leaving parameters unset; vLLM would refuse
    assert loaded == expected
    assert not VERIFIER_FILLED & set(stored_shapes(exported))  # the target supplies them at serving time


def _rename(export: Path, out: Path, rename) -> Path:
    shutil.copytree(export, out)
    state = load_file(str(export / "model.safetensors"))
    save_file({rename(k): v for k, v in state.items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("case, accepted_by", [
    ("model_prefix", {"sglang"}),  # SGLang strips a "model." prefix; vLLM adds one, so it would double
    ("renamed_norm", set()),
    ("fewer_target_layers", set()),  # fc is wider than the features config.json names
])
def test_the_mapping_refuses_what_a_loader_refuses(exported, tmp_path, case, accepted_by):
    if case == "model_prefix":
        export = _rename(exported, tmp_path / case, lambda k: "model." + k)
    elif case == "renamed_norm":
        export = _rename(exported, tmp_path / case, lambda k: k.replace("hidden_norm", "context_norm"))
    else:
        export = _rename(exported, tmp_path / case, lambda k: k)
        config = read_config(export)
        config["dflash_config"]["target_layer_ids"] = config["dflash_config"]["target_layer_ids"][:-1]
        (export / "config.json").write_text(json.dumps(config))
    for engine in ENGINE_LOADERS:
        expected, loaded, rejected = engine_view(engine, export)
        assert (loaded == expected and not rejected) == (engine in accepted_by), engine


def test_config_holds_what_each_loader_reads(exported):
    """The keys each engine reads, read through transformers' AutoConfig as both engines do (model_type
    qwen3: no remote code is needed to read it)."""
    from transformers import AutoConfig

    raw = read_config(exported)
    hf = AutoConfig.from_pretrained(exported)
    dflash = hf.dflash_config
    assert hf.architectures == ["DFlashDraftModel"]  # both registries: DFlashDraftModel -> their DFlash class
    # SGLang parse_dflash_draft_config: dflash_config.block_size before block_size; the speculators converter
    # block_size before dflash_config.block_size; vLLM drafts num_speculative_tokens + 1 slots.
    assert dflash["block_size"] == hf.block_size == BLOCK
    # mask token: vLLM's parallel-drafting token is dflash_config.mask_token_id; SGLang requires it below the
    # target's vocab_size (DFlashWorker._resolve_mask_token_id).
    assert isinstance(dflash["mask_token_id"], int) and 0 <= dflash["mask_token_id"] < hf.vocab_size
    # SGLang resolve_target_layer_ids: each id below num_target_layers; vLLM captures layer id + 1, which
    # must be a layer of the target.
    ids = dflash["target_layer_ids"]
    assert ids == list(LAYER_IDS) and max(ids) + 1 < hf.num_target_layers == tiny_config().num_hidden_layers
    # SGLang: one layer_types entry per draft layer, sliding layers need sliding_window; vLLM the same,
    # and its Qwen3 MLP and RoPE read hidden_act and rope_parameters.
    assert len(hf.layer_types) == hf.num_hidden_layers and set(hf.layer_types) == {"full_attention"}
    assert hf.hidden_act == "silu" and hf.rope_parameters["rope_theta"] == raw["rope_theta"]
    assert served_drafter(raw).num_speculative_tokens == BLOCK - 1


def test_the_speculators_converter_builds_its_config(exported):
    """DFlashConverter._build_config on this config.json: a Qwen3 config from the other keys, the block
    size, aux layers target_layer_ids + 1 less the target's last layer, block size - 1 draft tokens."""
    from transformers import Qwen3Config

    config = read_config(exported)
    layer_config = Qwen3Config(**{k: v for k, v in config.items() if k not in SPECULATORS_NON_TRANSFORMER_KEYS})
    assert (layer_config.hidden_size, layer_config.num_hidden_layers) == (config["hidden_size"], 2)
    block = config.get("block_size") or config["dflash_config"].get("block_size")
    aux = [i + 1 for i in config["dflash_config"]["target_layer_ids"] if i + 1 != config["num_target_layers"]]
    assert block == BLOCK and len(aux) == len(LAYER_IDS)  # every fc input column has its feature
    assert served_drafter(config).num_speculative_tokens == block - 1


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures"),
    (lambda c: (c.pop("block_size"), c["dflash_config"].pop("block_size")), "lacks block_size"),
    (lambda c: c["dflash_config"].update(block_size=8), "dflash_config.block_size"),
    (lambda c: (c.update(block_size=1), c["dflash_config"].update(block_size=1)), "at least 2"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id"),
    (lambda c: c["dflash_config"].update(mask_token_id=True), "dflash_config.mask_token_id"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[]), "dflash_config.target_layer_ids"),
])
def test_a_config_an_engine_would_misread_is_refused(exported, tmp_path, edit, says):
    config = read_config(exported)
    edit(config)
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        served_drafter(config)
    shutil.copytree(exported, tmp_path / "export")
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as e:
        read_served_drafter(tmp_path / "export")
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_each_engine_drafts_the_trained_block(exported):
    drafter = read_served_drafter(exported)
    (sglang,), (vllm,) = render("sglang", drafter, "E", "T"), render("vllm", drafter, "E", "T")
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == str(BLOCK)  # SGLang counts the block
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == "E"
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "E", "num_speculative_tokens": BLOCK - 1}  # vLLM, mask slots
    convert, serve = render("speculators", drafter, "E/", "T")
    assert convert[:3] == ["speculators", "convert", "E/"] and serve == ["vllm", "serve", "E-speculators"]


def test_vllm_mixed_sliding_and_full_layers_get_the_v2_runner(exported):
    """qwen3_dflash._resolve_layer_attention refuses mixed layer types without VLLM_USE_V2_MODEL_RUNNER=1."""
    config = read_config(exported)
    config["layer_types"] = ["full_attention", SLIDING_ATTENTION]
    config["sliding_window"] = 64
    (argv,) = render("vllm", served_drafter(config), "E", "T")
    assert argv[:3] == ["VLLM_USE_V2_MODEL_RUNNER=1", "vllm", "serve"]
    assert format_command(argv).startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve T \\\n")


def test_the_doc_shows_the_rendered_commands(exported):
    """docs/serving.md's commands are this module's output for a block-16 export."""
    doc = DOC.read_text()
    drafter = read_served_drafter(exported)
    for engine in ENGINES:
        for argv in render(engine, drafter, DOC_EXPORT, DOC_TARGET):
            assert format_command(argv) in doc, f"{engine}: {format_command(argv)}"
    assert "dflash-cache serve-command" in doc


def test_serve_command_prints_them_for_a_run_directory(exported):
    run = exported.parent
    r = CliRunner().invoke(cli, ["serve-command", str(run), "--engine", "vllm", "--target", "/t"])
    assert r.exit_code == 0, r.output
    assert r.output == format_command(render("vllm", read_served_drafter(exported), str(exported), "/t")[0]) + "\n"
    r = CliRunner().invoke(cli, ["serve-command", str(exported), "--engine", "speculators", "--target", "/t",
                                 "--converted", "/c"])
    assert r.exit_code == 0 and r.output.endswith("\n\nvllm serve /c\n")


def test_serve_command_defaults_to_the_recorded_target(demo_drafter):
    r = CliRunner().invoke(cli, ["serve-command", str(demo_drafter), "--engine", "sglang"])
    assert r.exit_code == 0 and "--model-path tiny" in r.output


def test_serve_command_refusals_are_one_line(exported, tmp_path):
    r = CliRunner().invoke(cli, ["serve-command", str(exported), "--engine", "vllm"])  # it records no target
    assert r.exit_code == 2 and "pass --target" in r.output and r.output.count("\n") == 1
    r = CliRunner().invoke(cli, ["serve-command", str(tmp_path), "--engine", "sglang", "--target", "/t"])
    assert r.exit_code == 2 and "no exported drafter" in r.output
    choices = next(p for p in cli.commands["serve-command"].params if p.name == "engine").type.choices
    assert tuple(choices) == ENGINES
