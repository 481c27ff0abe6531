"""Export the drafter as a checkpoint SGLang and vLLM load as an EAGLE-3 draft model.

Per engine a directory with `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`,
target-shaped sizes, `draft_vocab_size`, the aux layer ids, and the RoPE base and scaling the
drafter trained with, written both as `rope_theta` + `rope_scaling` and as `rope_parameters`)
and `model.safetensors` holding `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`,
`d2t`, `t2d` (no embedding: both engines share the target's).

The aux layer ids are the subtle part. Ours are 0-based decoder-layer *outputs*
(eaglepipe/layers.py); both engines capture the residual stream *entering* a layer, so the
physical layer k is captured as engine layer k+1. What each engine does with the ids it reads:

- SGLang (0.5.14 to 0.5.23) reads `eagle_config.eagle_aux_hidden_state_layer_ids` of the draft
  config (model_runner.py, or model_runner_components/spec_aux_hidden_state.py from 0.5.16) and
  hands them to the target's `set_eagle3_layers_to_capture`: Llama (and Qwen, GLM) add 1 to
  every id (models/llama.py); the DeepSeek family (DeepseekV2/V3, and Kimi-K2.5 which
  delegates to it) adds 1 only when the first id is 1 and otherwise uses the ids as capture ids
  (models/deepseek_v2.py).
- vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` of the draft config
  (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, get_eagle3_aux_layers_from_config) and
  uses them as capture ids directly: `if idx in self.aux_hidden_state_layers` appends the
  stream entering layer idx, in llama.py and deepseek_v2.py alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..atomic import atomic_write_bytes, atomic_write_json
from ..config import text_config
from ..errors import PipelineError
from ..run import RunSpec
from .model import DrafterConfig, Eagle3Drafter, load_drafter, target_rope
from .vocab import load_vocab

ARCHITECTURE = "LlamaForCausalLMEagle3"
ENGINES = ("sglang", "vllm")

# Target architectures whose SGLang model class is DeepseekV2ForCausalLM (or delegates to it).
DEEPSEEK_ARCHITECTURES = {
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
}
DEEPSEEK_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25"}

# SGLang 0.5.14 and 0.5.23, python/sglang/srt/models/llama_eagle3.py,
# LlamaForCausalLMEagle3.load_weights.
# tests/test_drafter_export.py checks these against both ends of the supported SGLang range.
SGLANG_STACKED_PARAMS = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
SGLANG_LEGACY_NAMES = {
    "midlayer": "layers.0",
    "aux_norm_low": "fc_norm.0",
    "aux_norm_mid": "fc_norm.1",
    "aux_norm_high": "fc_norm.2",
}

# vLLM (vllm-project/vllm main as stored, vllm/model_executor/models/llama_eagle3.py):
# Eagle3LlamaForCausalLM.load_weights skips names containing "t2d", renames "d2t" to
# "draft_id_to_target_id", prefixes every other name lacking "lm_head" with "model.";
# LlamaModel.load_weights replaces "midlayer." with "layers.0." and stacks q/k/v into
# qkv_proj and gate/up into gate_up_proj (the same table as SGLang's). Any name left that is
# not a parameter raises KeyError there, so every exported key must land in this set.
VLLM_PARAM_NAMES = {
    "draft_id_to_target_id",
    "lm_head.weight",
    "model.fc.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.hidden_norm.weight",
    "model.layers.0.post_attention_layernorm.weight",
}


# ---------------------------------------------------------------------------------------------
# Layer ids per engine


def target_family(model_config: dict) -> str:
    """`deepseek` for targets SGLang serves with its DeepSeek-V2 class, else `llama`."""
    archs = set(model_config.get("architectures") or [])
    model_type = model_config.get("model_type") or text_config(model_config).get("model_type")
    if archs & DEEPSEEK_ARCHITECTURES or model_type in DEEPSEEK_MODEL_TYPES:
        return "deepseek"
    return "llama"


def engine_layer_ids(engine: str, family: str, aux_ids: list[int]) -> list[int]:
    """The ids to write for `engine` so it captures the outputs of our layers `aux_ids`."""
    aux_ids = [int(i) for i in aux_ids]
    if engine == "vllm":
        return [i + 1 for i in aux_ids]
    if engine != "sglang":
        raise PipelineError(f"export.engines: unknown engine {engine}")
    if family == "llama":
        return aux_ids
    if aux_ids[0] == 1:
        return aux_ids
    if aux_ids[0] == 0:
        raise PipelineError(
            f"aux_layer_ids {aux_ids}: SGLang cannot capture layer 0's output of a DeepSeek-family "
            "target (it would read [1, ...] as our ids and add 1); choose a first id >= 1"
        )
    return [i + 1 for i in aux_ids]


def engine_captured_layers(engine: str, family: str, written: list[int]) -> list[int]:
    """Our (physical, output-0-based) layer ids that `engine` captures given `written` ids."""
    if engine == "vllm":
        capture = list(written)
    elif family == "llama" or written[0] == 1:
        capture = [i + 1 for i in written]
    else:
        capture = list(written)
    return [c - 1 for c in capture]


# ---------------------------------------------------------------------------------------------
# Name mapping as the engines apply it


def sglang_param_name(name: str, params: set[str]) -> tuple[str | None, object]:
    """(SGLang parameter, shard id) that LlamaForCausalLMEagle3.load_weights loads `name` into.

    Returns (None, "d2t") for d2t (SGLang turns it into hot_token_id), (None, "skip") for t2d
    and (None, None) for a name it silently drops.
    """
    for legacy, new in SGLANG_LEGACY_NAMES.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name:
        return None, "d2t"
    if "t2d" in name:
        return None, "skip"
    for param, weight, shard in SGLANG_STACKED_PARAMS:
        if weight in name:
            name = name.replace(weight, param)
            full = name if name in params else f"model.{name}"
            return (full, shard) if full in params else (None, None)
    full = name if name in params else f"model.{name}"
    return (full, None) if full in params else (None, None)


def vllm_param_name(name: str) -> tuple[str | None, object]:
    if "t2d" in name:
        return None, "skip"
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), None
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for param, weight, shard in SGLANG_STACKED_PARAMS:
        if weight in name:
            return name.replace(weight, param), shard
    return name, None


def sglang_param_shapes(exported: dict) -> dict[str, tuple[int, ...]]:
    """Shapes of LlamaForCausalLMEagle3's parameters for an exported config (TP 1)."""
    h, hd = exported["hidden_size"], exported["head_dim"]
    nh, nkv = exported["num_attention_heads"], exported["num_key_value_heads"]
    inter = exported["intermediate_size"]
    layer = "model.layers.0."
    return {
        "model.embed_tokens.weight": (exported["vocab_size"], h),
        "model.fc.weight": (h, 3 * exported["target_hidden_size"]),
        layer + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, 2 * h),
        layer + "self_attn.o_proj.weight": (h, nh * hd),
        layer + "mlp.gate_up_proj.weight": (2 * inter, h),
        layer + "mlp.down_proj.weight": (h, inter),
        layer + "input_layernorm.weight": (h,),
        layer + "hidden_norm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (exported["draft_vocab_size"], h),
    }


def load_like_sglang(export_dir: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read an exported dir the way SGLang does: (config, SGLang parameter -> tensor).

    Stacked parameters are assembled from their shards in SGLang's shard order (q, k, v;
    gate, up); `hot_token_id` is d2t + arange, as SGLang computes it.
    """
    export_dir = Path(export_dir)
    exported = json.loads((export_dir / "config.json").read_text())
    shapes = sglang_param_shapes(exported)
    shards: dict[str, dict] = {}
    params: dict[str, torch.Tensor] = {}
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
            target, shard = sglang_param_name(key, set(shapes))
            if shard == "d2t":
                params["hot_token_id"] = tensor + torch.arange(tensor.shape[0])
            elif target is None:
                continue
            elif shard is None:
                params[target] = tensor
            else:
                shards.setdefault(target, {})[shard] = tensor
    for target, parts in shards.items():
        order = ["q", "k", "v"] if "qkv_proj" in target else [0, 1]
        missing = [s for s in order if s not in parts]
        if missing:
            raise PipelineError(f"{export_dir}: {target} lacks shard(s) {missing}")
        params[target] = torch.cat([parts[s] for s in order], dim=0)
    return exported, params


def drafter_from_sglang_params(exported: dict, params: dict[str, torch.Tensor]) -> Eagle3Drafter:
    """Our module filled from SGLang-named parameters (embed_tokens left for the caller)."""
    rope_theta, rope_scaling = target_rope(exported)
    drafter_config = DrafterConfig(
        hidden_size=exported["hidden_size"],
        num_attention_heads=exported["num_attention_heads"],
        num_key_value_heads=exported["num_key_value_heads"],
        head_dim=exported["head_dim"],
        intermediate_size=exported["intermediate_size"],
        vocab_size=exported["vocab_size"],
        draft_vocab_size=exported["draft_vocab_size"],
        rms_norm_eps=exported["rms_norm_eps"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=exported["max_position_embeddings"],
    )
    model = Eagle3Drafter(drafter_config)
    c = drafter_config
    layer = "model.layers.0."
    q, k, v = params[layer + "self_attn.qkv_proj.weight"].split(
        [
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        ]
    )
    gate, up = params[layer + "mlp.gate_up_proj.weight"].split(c.intermediate_size)
    hot = params["hot_token_id"]
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    state = {
        "fc.weight": params["model.fc.weight"],
        "norm.weight": params["model.norm.weight"],
        "lm_head.weight": params["lm_head.weight"],
        "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": params[layer + "self_attn.o_proj.weight"],
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": params[layer + "mlp.down_proj.weight"],
        "midlayer.input_layernorm.weight": params[layer + "input_layernorm.weight"],
        "midlayer.hidden_norm.weight": params[layer + "hidden_norm.weight"],
        "midlayer.post_attention_layernorm.weight": params[
            layer + "post_attention_layernorm.weight"
        ],
        "d2t": hot - torch.arange(hot.shape[0]),
        "t2d": t2d,
    }
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens")]
    if missing or unexpected:
        raise PipelineError(f"SGLang-mapped weights: missing {missing}, unexpected {unexpected}")
    return model


# ---------------------------------------------------------------------------------------------
# Writing the export


def export_config(
    drafter: DrafterConfig, target_config: dict, engine: str, aux_ids: list[int]
) -> dict:
    family = target_family(target_config)
    written = engine_layer_ids(engine, family, aux_ids)
    text = text_config(target_config)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": drafter.hidden_size,
        "target_hidden_size": drafter.hidden_size,
        "intermediate_size": drafter.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": drafter.num_attention_heads,
        "num_key_value_heads": drafter.num_key_value_heads,
        "head_dim": drafter.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": drafter.rms_norm_eps,
        # RoPE in both layouts: transformers 4.x configs read rope_theta + rope_scaling, 5.x
        # configs (and SGLang, which prefers it) read rope_parameters; the two agree.
        "rope_theta": drafter.rope_theta,
        "rope_scaling": drafter.rope_scaling,
        "rope_parameters": {
            "rope_theta": drafter.rope_theta,
            **(drafter.rope_scaling or {"rope_type": "default"}),
        },
        "max_position_embeddings": drafter.max_position_embeddings,
        "vocab_size": drafter.vocab_size,
        "draft_vocab_size": drafter.draft_vocab_size,
        # SGLang ties lm_head to the (full-vocab) embedding when this is true.
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": written,
            "use_aux_hidden_state": True,
        },
        "eaglepipe": {
            "engine": engine,
            "target_family": family,
            "aux_layer_ids": list(aux_ids),
            "layer_convention": "decoder-layer-output-0based",
        },
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if text.get(key) is not None:
            config[key] = text[key]
    if engine == "vllm":
        config["eagle_aux_hidden_state_layer_ids"] = written
    return config


def export_tensors(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, value in model.trainable_state_dict().items():
        if name in ("d2t", "t2d"):
            tensors[name] = value.cpu().contiguous()
        else:
            tensors[name] = value.detach().to(torch.bfloat16).cpu().contiguous()
    return tensors


def export(
    run: RunSpec,
    *,
    model_path: str,
    vocab_path: str,
    out_dir: str,
    engines: list[str] | None = None,
) -> list[Path]:
    model = load_drafter(model_path)
    vocab = load_vocab(vocab_path)
    if not (torch.equal(model.d2t, vocab.d2t) and torch.equal(model.t2d, vocab.t2d)):
        raise PipelineError(f"{model_path} was trained with another vocabulary than {vocab_path}")
    with safe_open(str(model_path), framework="pt") as f:
        aux_ids = json.loads((f.metadata() or {}).get("aux_layer_ids", "null"))
    if not aux_ids:
        raise PipelineError(f"{model_path} does not record the aux layer ids it was trained on")
    target_config = run.model.config
    tensors = export_tensors(model)
    written = []
    for engine in engines or run.export.engines:
        directory = Path(out_dir) / engine
        engine_config = export_config(model.config, target_config, engine, aux_ids)
        atomic_write_bytes(
            directory / "model.safetensors", save(tensors, metadata={"format": "pt"})
        )
        atomic_write_json(directory / "config.json", engine_config)
        ids = engine_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        print(f"exported {directory} (aux layer ids as {engine} reads them: {ids})", flush=True)
        written.append(directory)
    return written
