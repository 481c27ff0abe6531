"""Export contracts: key names and shapes SGLang/vLLM load, and layer ids each engine reads.

The SGLang side is checked against the source of both ends of the supported range
(patch/sglang.toml; parsed with ast, never imported): the name tables of
LlamaForCausalLMEagle3.load_weights, the module attributes that make up its parameter names,
and the targets' set_eagle3_layers_to_capture functions, which are executed on a stand-in
object to see which layers they would capture.
"""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path
from typing import Optional  # noqa: UP035 - names the SGLang functions refer to

import pytest
import torch
from conftest import REPO_ROOT, small_filesystem
from safetensors import safe_open
from safetensors.torch import save
from sglang_source import range_ends, sglang_source_root
from transformers import DeepseekV3Config, LlamaConfig

from eaglepipe.core.atomic import atomic_write_bytes
from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import RunSpec, resolve
from eaglepipe.core.sealed import seal_problem
from eaglepipe.drafter import engine_load as el
from eaglepipe.drafter import export as ex
from eaglepipe.drafter.model import DrafterConfig, Eagle3Drafter
from eaglepipe.drafter.vocab import choose_draft_vocab, save_vocab

EXPECTED_KEYS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}


@pytest.fixture(scope="module", params=range_ends())
def sglang_root(request) -> Path:
    """Each end of the supported SGLang range (patch/sglang.toml)."""
    return sglang_source_root(request.param)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def find_function(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found")


def assigned_literal(func: ast.FunctionDef, variable: str):
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == variable for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{variable} not assigned in {func.name}")


def self_attributes(tree: ast.Module) -> set[str]:
    """Every `self.<name> = ...` in a module: the attribute names parameters can have."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    names.add(target.attr)
    return names


def export_run(model_dir: Path, engines: list[str]) -> RunSpec:
    """The embedded default's run description, for a target in `model_dir`."""
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["export"]["engines"] = engines
    return resolve(config)


def tiny_drafter(tmp_path: Path, target_config: dict, aux_ids: list[int]) -> RunSpec:
    """A random drafter (`model.safetensors`, `vocab.safetensors` in `tmp_path`) for a target
    of the given config; the run description of that target."""
    model_dir = tmp_path / "target"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(target_config))
    drafter_config = DrafterConfig.from_target(target_config, 24)
    torch.manual_seed(0)
    model = Eagle3Drafter(drafter_config)
    counts = torch.arange(drafter_config.vocab_size).flip(0).numpy()
    vocab = choose_draft_vocab(counts, 24)
    model.d2t.copy_(vocab.d2t)
    model.t2d.copy_(vocab.t2d)
    save_vocab(vocab, tmp_path / "vocab.safetensors")
    tensors = {k: v.contiguous() for k, v in model.trainable_state_dict().items()}
    meta = {"drafter_config": drafter_config.to_json(), "aux_layer_ids": json.dumps(aux_ids)}
    atomic_write_bytes(tmp_path / "model.safetensors", save(tensors, metadata=meta))
    return export_run(model_dir, ["sglang", "vllm"])


def export_tiny_drafter(run: RunSpec, tmp_path: Path, out_dir: Path) -> None:
    ex.export(
        run,
        model_path=str(tmp_path / "model.safetensors"),
        vocab_path=str(tmp_path / "vocab.safetensors"),
        out_dir=str(out_dir),
    )


def tiny_export(tmp_path: Path, target_config: dict, aux_ids: list[int]) -> Path:
    """A random drafter written through export.export for a target of the given config."""
    run = tiny_drafter(tmp_path, target_config, aux_ids)
    export_tiny_drafter(run, tmp_path, tmp_path / "export")
    return tmp_path / "export"


def llama_config(num_layers=8) -> dict:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    return config


def deepseek_config(num_layers=8) -> dict:
    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        q_lora_rank=16,
        kv_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ).to_dict()
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    return config


# ---------------------------------------------------------------------------------------------
# Key names and shapes


def test_name_tables_match_the_sglang_source(sglang_root):
    tree = parse(sglang_root / "srt" / "models" / "llama_eagle3.py")
    load = find_function(tree, "LlamaForCausalLMEagle3", "load_weights")
    assert assigned_literal(load, "stacked_params_mapping") == el.SGLANG_STACKED_PARAMS
    assert assigned_literal(load, "legacy_name_map") == el.SGLANG_LEGACY_NAMES
    # d2t becomes hot_token_id (d2t + arange) and t2d is skipped: both are name tests there.
    strings = {n.value for n in ast.walk(load) if isinstance(n, ast.Constant)}
    assert {"d2t", "t2d"} <= strings
    assert "hot_token_id" in ast.unparse(load)


def test_exported_keys_and_shapes_load_into_sglang_parameters(tmp_path, sglang_root):
    export_dir = tiny_export(tmp_path, llama_config(), [1, 3, 4])
    config = json.loads((export_dir / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 24 and config["vocab_size"] == 64
    assert config["tie_word_embeddings"] is False

    # Every segment of every parameter name is an attribute SGLang's modules define.
    attributes = self_attributes(parse(sglang_root / "srt" / "models" / "llama_eagle3.py"))
    attributes |= self_attributes(parse(sglang_root / "srt" / "models" / "llama.py"))
    shapes = el.engine_param_shapes("sglang", config)
    for name in shapes:
        for segment in name.split(".")[:-1]:
            assert segment.isdigit() or segment in attributes, (name, segment)

    with safe_open(str(export_dir / "sglang" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == EXPECTED_KEYS
        assert not any("embed" in k for k in keys)
        loaded: dict[str, list] = {}
        for key in keys:
            param, shard = el.engine_param_name("sglang", "llama", key, set(shapes))
            if key in ("d2t", "t2d"):
                assert param in (el.D2T, el.SKIP)
                continue
            assert param in shapes, f"{key} is dropped by SGLang's loader"
            loaded.setdefault(param, []).append(f.get_tensor(key))
    # All parameters but the shared embedding are filled, with SGLang's shapes once stacked.
    assert set(loaded) == set(shapes) - {"model.embed_tokens.weight"}
    for param, parts in loaded.items():
        assert tuple(torch.cat(parts, dim=0).shape) == shapes[param], param


def test_exported_keys_match_what_vllm_loads(tmp_path):
    export_dir = tiny_export(tmp_path, llama_config(), [1, 3, 4])
    config = json.loads((export_dir / "vllm" / "config.json").read_text())
    params = set(el.engine_param_shapes("vllm", config)) - {"model.embed_tokens.weight"}
    with safe_open(str(export_dir / "vllm" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    mapped = {el.engine_param_name("vllm", "llama", k, params)[0] for k in keys}
    assert mapped - {el.D2T, el.SKIP} == params


def test_sglang_mapping_round_trip_reproduces_the_drafter(tmp_path):
    export_dir = tiny_export(tmp_path, llama_config(), [1, 3, 4])
    config, params = el.load_like_engine(export_dir / "sglang")
    rebuilt = el.drafter_from_engine_params(config, params)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            original = f.get_tensor(key)
            if original.is_floating_point():
                original = original.to(torch.bfloat16).float()
            assert torch.equal(rebuilt.state_dict()[key], original), key


# ---------------------------------------------------------------------------------------------
# Layer ids


def sglang_capture(sglang_root: Path, family: str, written: list[int], num_layers: int):
    """Run that SGLang's set_eagle3_layers_to_capture for the family on a stand-in."""
    module, cls = {
        "llama": ("llama.py", "LlamaForCausalLM"),
        "deepseek": ("deepseek_v2.py", "DeepseekV2ForCausalLM"),
    }[family]
    func = find_function(
        parse(sglang_root / "srt" / "models" / module), cls, "set_eagle3_layers_to_capture"
    )
    namespace = {"Optional": Optional, "List": list}
    exec(compile(ast.Module(body=[func], type_ignores=[]), module, "exec"), namespace)
    stand_in = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True),
        config=types.SimpleNamespace(num_hidden_layers=num_layers),
        model=types.SimpleNamespace(),
    )
    namespace["set_eagle3_layers_to_capture"](stand_in, written)
    return stand_in.model.layers_to_capture


def sglang_reads_ids_from_eagle_config(sglang_root: Path) -> bool:
    """SGLang takes the ids from the draft config's `eagle_config[...]` (a dict lookup), in
    the model runner's spec component (0.5.16 on) or the model runner itself (earlier)."""
    executor = sglang_root / "srt" / "model_executor"
    path = executor / "model_runner_components" / "spec_aux_hidden_state.py"
    tree = parse(path if path.is_file() else executor / "model_runner.py")
    return any(
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "eagle_config"
        and isinstance(node.slice, ast.Constant)
        and node.slice.value == "eagle_aux_hidden_state_layer_ids"
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize(
    ("family_config", "aux_ids"),
    [
        (llama_config(8), [1, 3, 4]),
        (llama_config(32), [1, 15, 28]),
        (llama_config(32), [0, 10, 20]),
        (deepseek_config(8), [1, 3, 4]),
        (deepseek_config(61), [1, 29, 57]),
        (deepseek_config(61), [2, 30, 58]),
    ],
)
def test_exported_layer_ids_map_back_to_the_extracted_layers(
    tmp_path, sglang_root, family_config, aux_ids
):
    assert sglang_reads_ids_from_eagle_config(sglang_root)
    export_dir = tiny_export(tmp_path, family_config, aux_ids)
    family = ex.target_family(family_config)
    num_layers = family_config["num_hidden_layers"]

    sglang = json.loads((export_dir / "sglang" / "config.json").read_text())
    written = sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    capture = sglang_capture(sglang_root, family, written, num_layers)
    # SGLang captures the stream entering layer c, i.e. the output of our layer c - 1.
    assert [c - 1 for c in capture] == aux_ids
    assert ex.engine_captured_layers("sglang", family, written) == aux_ids

    vllm = json.loads((export_dir / "vllm" / "config.json").read_text())
    # vLLM reads the top-level ids and captures the stream entering each listed layer.
    assert [c - 1 for c in vllm["eagle_aux_hidden_state_layer_ids"]] == aux_ids
    assert ex.engine_captured_layers("vllm", family, vllm["eagle_aux_hidden_state_layer_ids"]) == (
        aux_ids
    )


def test_target_family_detection():
    assert ex.target_family(llama_config()) == "llama"
    assert ex.target_family(deepseek_config()) == "deepseek"
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": llama_config()}
    assert ex.target_family(kimi) == "deepseek"


def test_deepseek_first_layer_output_cannot_be_expressed_for_sglang():
    with pytest.raises(PipelineError, match="SGLang cannot capture layer 0"):
        ex.engine_layer_ids("sglang", "deepseek", [0, 29, 57])
    assert ex.engine_layer_ids("sglang", "llama", [0, 29, 57]) == [0, 29, 57]
    assert ex.engine_layer_ids("vllm", "deepseek", [0, 29, 57]) == [1, 30, 58]


def test_export_refuses_a_model_trained_with_another_vocabulary(tmp_path):
    export_dir = tiny_export(tmp_path, llama_config(), [1, 3, 4])
    assert export_dir.exists()
    other = choose_draft_vocab(torch.arange(64).numpy(), 24)
    save_vocab(other, tmp_path / "other.safetensors")
    with pytest.raises(PipelineError, match="another vocabulary"):
        ex.export(
            export_run(tmp_path / "target", ["sglang"]),
            model_path=str(tmp_path / "model.safetensors"),
            vocab_path=str(tmp_path / "other.safetensors"),
            out_dir=str(tmp_path / "export2"),
        )


# ---------------------------------------------------------------------------------------------
# RoPE: the target's base and scaling reach the drafter and its export, in either layout

LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama31_config(layout: str) -> dict:
    """A Llama-3.1-shaped target config as transformers 4.x or 5.x writes it."""
    config = llama_config()
    config.pop("rope_parameters", None)
    config["max_position_embeddings"] = 131072
    if layout == "transformers-4":
        config.update(rope_theta=500000.0, rope_scaling=LLAMA31_SCALING)
    else:
        config["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA31_SCALING}
    return config


def deepseek_yarn_config() -> dict:
    """DeepSeek-V3's own RoPE settings (legacy `type` key, mscale pair)."""
    config = deepseek_config()
    config.pop("rope_parameters", None)
    config["rope_theta"] = 10000.0
    config["rope_scaling"] = {
        "type": "yarn",
        "factor": 40.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    }
    return config


def engine_cos_sin(export_config: dict, positions: torch.Tensor):
    """cos/sin of the rotary embedding transformers builds from an exported config.json."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    llama = LlamaConfig.from_dict(export_config)
    rotary = LlamaRotaryEmbedding(llama)
    x = torch.zeros(1, positions.shape[1], export_config["head_dim"])
    return rotary(x, positions)


@pytest.mark.parametrize(
    ("target_config", "theta", "rope_type"),
    [
        (llama31_config("transformers-4"), 500000.0, "llama3"),
        (llama31_config("transformers-5"), 500000.0, "llama3"),
        (deepseek_yarn_config(), 10000.0, "yarn"),
    ],
    ids=["llama3.1-transformers-4", "llama3.1-transformers-5", "deepseek-yarn"],
)
def test_rope_base_and_scaling_reach_the_drafter_and_its_export(
    tmp_path, target_config, theta, rope_type
):
    drafter = DrafterConfig.from_target(target_config, 24)
    assert drafter.rope_theta == theta and drafter.rope_scaling["rope_type"] == rope_type
    export_dir = tiny_export(tmp_path, target_config, [1, 3, 4])
    positions = torch.arange(0, 60000, 7)[None]
    for engine in ex.ENGINES:
        config = json.loads((export_dir / engine / "config.json").read_text())
        # Both layouts, agreeing: 4.x readers take rope_theta + rope_scaling, 5.x (and SGLang)
        # rope_parameters.
        assert config["rope_theta"] == theta
        assert config["rope_scaling"] == drafter.rope_scaling
        assert config["rope_parameters"] == {"rope_theta": theta, **drafter.rope_scaling}
        # What serving computes from the export is what the drafter trained with.
        want_cos, want_sin = engine_cos_sin(config, positions)
        rebuilt = el.load_exported_drafter(export_dir / "sglang")
        trained = Eagle3Drafter(drafter)
        for model in (trained, rebuilt):
            cos, sin = model.midlayer.self_attn.rotary.cos_sin(positions)
            torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-5)
            torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-5)


def test_a_plain_target_exports_plain_rope(tmp_path):
    export_dir = tiny_export(tmp_path, llama_config(), [1, 3, 4])
    config = json.loads((export_dir / "sglang" / "config.json").read_text())
    assert config["rope_scaling"] is None
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    want_cos, _ = engine_cos_sin(config, torch.arange(500)[None])
    rebuilt = el.load_exported_drafter(export_dir / "sglang")
    cos, _ = rebuilt.midlayer.self_attn.rotary.cos_sin(torch.arange(500)[None])
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-5)


def test_rope_types_the_engines_disagree_on_are_refused():
    config = llama_config()
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(PipelineError, match="RoPE type 'dynamic' is not supported"):
        DrafterConfig.from_target(config, 24)


def test_sglang_reads_rope_from_the_keys_the_export_writes(sglang_root):
    """The pinned SGLang's Llama layer (the draft layer's base) takes rope_parameters, else
    rope_theta + rope_scaling, from the draft config."""
    init = find_function(
        parse(sglang_root / "srt" / "models" / "llama.py"), "LlamaDecoderLayer", "__init__"
    )
    read = {
        node.args[1].value
        for node in ast.walk(init)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == "getattr"
        and isinstance(node.args[1], ast.Constant)
    }
    assert {"rope_parameters", "rope_theta", "rope_scaling"} <= read


def test_a_full_disk_stops_the_export_in_one_line_and_the_next_one_finishes(tmp_path):
    run = tiny_drafter(tmp_path, llama_config(), [1, 3, 4])
    reference = tmp_path / "reference"
    export_tiny_drafter(run, tmp_path, reference)
    out = tmp_path / "export"
    # One page: the first engine's config.json fits, its weights do not.
    with small_filesystem(out, 4096) as resize:
        with pytest.raises(PipelineError) as info:
            export_tiny_drafter(run, tmp_path, out)
        assert str(info.value).startswith(
            f"no space left on the filesystem of {out / 'sglang'} while writing model.safetensors"
        )
        # Nothing half-written: no temp file, no weights (the config alone is no export, and
        # the workflow removes a failed job's outputs).
        assert sorted(p.name for p in (out / "sglang").iterdir()) == ["config.json"]
        resize(1 << 20)
        export_tiny_drafter(run, tmp_path, out)
        for engine in ("sglang", "vllm"):
            for name in ("config.json", "model.safetensors"):
                written = (out / engine / name).read_bytes()
                assert written == (reference / engine / name).read_bytes()
            assert seal_problem(out / engine / "model.safetensors") is None
