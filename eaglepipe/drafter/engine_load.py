"""Reading an exported drafter the way each engine's draft class loads it.

Per engine and draft layer (variants.ARCHITECTURES) this module repeats what the engine's
`load_weights` does with the names in `model.safetensors` (renames, stacking of q/k/v,
gate/up and MLA's q_a/kv_a projections into one parameter, d2t into hot token ids, t2d
skipped), the parameter shapes its modules have at tensor-parallel size 1, and which config
keys it reads the variant's flags from. `load_exported_drafter` then splits the engine's
parameters back into our module: the round trip (export, load with the engine's names, same
logits) that tests/test_drafter_variants.py runs for every variant, and the drafter the
transformers live harness serves.

Sources (read, never imported):
- SGLang 0.5.14 and 0.5.23: models/llama_eagle3.py (`LlamaForCausalLMEagle3.load_weights`),
  models/kimi_k25_eagle3.py (`Eagle3DeepseekV2ForCausalLM.load_weights`, which maps
  `layers.0.` to `midlayer.` and fuses q_a_proj + kv_a_proj_with_mqa into
  `fused_qkv_a_proj_with_mqa`); tests/test_drafter_export.py and test_drafter_variants.py check
  the tables below against both ends' source.
- vLLM 0.33.0: models/llama_eagle3.py and models/deepseek_eagle3.py. Both `load_weights` skip
  t2d, rename d2t to `draft_id_to_target_id`, prefix every other name without "lm_head" with
  `model.`, then map `midlayer.` to `layers.0.` and stack q/k/v, gate/up (and for MLA q_a_proj
  + kv_a_proj_with_mqa into `fused_qkv_a_proj`). A name left that is not a parameter raises
  there, so every exported key must land in a parameter.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..core.drafter_options import MLA_DIMS, NORM_FLAGS
from ..core.errors import PipelineError
from ..core.sealed import require_intact
from .model import DrafterConfig, Eagle3Drafter, target_rope
from .variants import ARCHITECTURES, ENGINE_OPTIONS

# SGLang 0.5.14 and 0.5.23, LlamaForCausalLMEagle3.load_weights.
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
# SGLang 0.5.14 and 0.5.23, Eagle3DeepseekV2ForCausalLM.load_weights: gate/up are stacked by
# this table; q_a_proj and kv_a_proj_with_mqa are concatenated (in that order) by hand.
SGLANG_MLA_STACKED_PARAMS = [
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
SGLANG_MLA_FUSED = "fused_qkv_a_proj_with_mqa"
# vLLM 0.33.0: the stacking of each draft class's weights mapper (MLA adds the fused a-proj).
VLLM_STACKED_PARAMS = {
    "llama": SGLANG_STACKED_PARAMS,
    "mla": [
        *SGLANG_MLA_STACKED_PARAMS,
        (".fused_qkv_a_proj", ".q_a_proj", 0),
        (".fused_qkv_a_proj", ".kv_a_proj_with_mqa", 1),
    ],
}
SHARD_ORDER = {"q": 0, "k": 1, "v": 2}

D2T, SKIP, DROPPED = "d2t", "skip", "dropped"


def export_layer(config: dict) -> str:
    """The draft layer an exported config.json describes, from its architecture."""
    arch = (config.get("architectures") or [None])[0]
    for layer, name in ARCHITECTURES.items():
        if name == arch:
            return layer
    raise PipelineError(f"exported config: unknown draft architecture {arch!r}")


def export_engine(config: dict) -> str:
    engine = (config.get("eaglepipe") or {}).get("engine")
    if engine not in ("sglang", "vllm"):
        raise PipelineError(f"exported config names no engine (eaglepipe.engine: {engine!r})")
    return engine


# ---------------------------------------------------------------------------------------------
# Names: a file key -> (engine parameter, shard)


def engine_param_name(engine: str, layer: str, name: str, params: set[str]) -> tuple[str, object]:
    """(engine parameter, shard id) the engine loads the checkpoint tensor `name` into.

    The parameter is D2T for d2t (turned into hot token ids), SKIP for t2d and DROPPED for a
    name the engine would not load (SGLang drops it silently, vLLM raises).
    """
    if engine == "sglang":
        return _sglang_llama(name, params) if layer == "llama" else _sglang_mla(name, params)
    if "t2d" in name:
        return SKIP, None
    if "d2t" in name:
        return D2T, None
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for param, weight, shard in VLLM_STACKED_PARAMS[layer]:
        if weight in name:
            name = name.replace(weight, param)
            return (name, shard) if name in params else (DROPPED, None)
    return (name, None) if name in params else (DROPPED, None)


def _sglang_llama(name: str, params: set[str]) -> tuple[str, object]:
    for legacy, new in SGLANG_LEGACY_NAMES.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name:
        return D2T, None
    if "t2d" in name:
        return SKIP, None
    for param, weight, shard in SGLANG_STACKED_PARAMS:
        if weight in name:
            name = name.replace(weight, param)
            full = name if name in params else f"model.{name}"
            return (full, shard) if full in params else (DROPPED, None)
    full = name if name in params else f"model.{name}"
    return (full, None) if full in params else (DROPPED, None)


def _sglang_mla(name: str, params: set[str]) -> tuple[str, object]:
    if name == "d2t" or name.endswith(".d2t"):
        return D2T, None
    if name == "t2d" or name.endswith(".t2d"):
        return SKIP, None
    mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
    if not mapped.startswith("lm_head."):
        mapped = f"model.{mapped}"
    for param, weight, shard in SGLANG_MLA_STACKED_PARAMS:
        if weight in mapped and mapped.replace(weight, param) in params:
            return mapped.replace(weight, param), shard
    for shard, part in enumerate(("q_a_proj", "kv_a_proj_with_mqa")):
        if part in mapped:
            fused = mapped.replace(part, SGLANG_MLA_FUSED)
            return (fused, shard) if fused in params else (DROPPED, None)
    return (mapped, None) if mapped in params else (DROPPED, None)


# ---------------------------------------------------------------------------------------------
# Parameter shapes at tensor-parallel size 1


def engine_param_shapes(engine: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The engine's draft parameters (embed_tokens: shared with the target) and their shapes
    for an exported config (as `config_as_read` reads it)."""
    c = config_as_read(config)
    h, aux = c.hidden_size, c.num_aux_hidden_states
    layer = "model.layers.0." if engine == "vllm" or c.layer == "llama" else "model.midlayer."
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.fc.weight": (h, aux * h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
        layer + "input_layernorm.weight": (h,),
        layer + "hidden_norm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "mlp.gate_up_proj.weight": (2 * c.intermediate_size, h),
        layer + "mlp.down_proj.weight": (h, c.intermediate_size),
    }
    if c.fc_norm:
        shapes.update({f"model.fc_norm.{i}.weight": (h,) for i in range(aux)})
    if c.norm_before_fc:
        shapes["model.input_norm.weight"] = (aux * h,)
    attn = layer + "self_attn."
    heads = c.num_attention_heads
    if c.layer == "llama":
        kv = c.num_key_value_heads
        shapes[attn + "qkv_proj.weight"] = ((heads + 2 * kv) * c.head_dim, 2 * h)
        shapes[attn + "o_proj.weight"] = (h, heads * c.head_dim)
        return shapes
    fused = SGLANG_MLA_FUSED if engine == "sglang" else "fused_qkv_a_proj"
    rope = c.qk_rope_head_dim
    shapes.update(
        {
            attn + fused + ".weight": (c.q_lora_rank + c.kv_lora_rank + rope, 2 * h),
            attn + "q_a_layernorm.weight": (c.q_lora_rank,),
            attn + "q_b_proj.weight": (heads * (c.qk_nope_head_dim + rope), c.q_lora_rank),
            attn + "kv_a_layernorm.weight": (c.kv_lora_rank,),
            attn + "kv_b_proj.weight": (
                heads * (c.qk_nope_head_dim + c.v_head_dim),
                c.kv_lora_rank,
            ),
            attn + "o_proj.weight": (h, heads * c.v_head_dim),
        }
    )
    return shapes


# ---------------------------------------------------------------------------------------------
# The config as the engine reads it


def _flag(engine: str, config: dict, flag: str) -> bool:
    """A variant flag's value where the engine reads it (SGLang also takes `use_aux_norm`;
    norm_before_fc may sit in eagle_config)."""
    if flag == "fc_norm":
        legacy = config.get("use_aux_norm") if engine == "sglang" else False
        return bool(config.get("fc_norm") or legacy)
    if flag == "norm_before_fc":
        eagle = config.get("eagle_config") or {}
        return bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False)))
    return bool(config.get(flag, False))


def config_as_read(config: dict) -> DrafterConfig:
    """The drafter an exported config.json makes in its engine: sizes, RoPE, layer, and the
    flags that engine reads (one it does not read counts as unset, as it would serve it)."""
    engine, layer = export_engine(config), export_layer(config)
    rope_theta, rope_scaling = target_rope(config)
    heads = config["num_attention_heads"]
    layer_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    drafter = DrafterConfig(
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config["max_position_embeddings"],
        num_aux_hidden_states=len(layer_ids) if layer_ids else 3,
        layer=layer,
        **{
            flag: flag in ENGINE_OPTIONS[(engine, layer)] and _flag(engine, config, flag)
            for flag in NORM_FLAGS
        },
    )
    if layer == "mla":
        for key in MLA_DIMS:
            setattr(drafter, key, int(config[key]))
        drafter.num_key_value_heads = heads
        drafter.head_dim = drafter.qk_nope_head_dim + drafter.qk_rope_head_dim
    return drafter


# ---------------------------------------------------------------------------------------------
# Loading


def load_like_engine(
    export_dir: str | os.PathLike, engine: str | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read an exported dir the way its engine does: (config, engine parameter -> tensor).
    `engine` names the engine of a draft directory another tool wrote (its config.json has no
    `eaglepipe` block).

    Stacked parameters are assembled from their shards in the engine's order; `hot_token_id`
    is d2t + arange, as SGLang computes it (vLLM keeps d2t: the same information). A key the
    engine would not load, or an engine parameter left unfilled, is an error here.
    """
    export_dir = Path(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    if engine is not None and "eaglepipe" not in config:
        config = {**config, "eaglepipe": {"engine": engine}}
    engine, layer = export_engine(config), export_layer(config)
    shapes = engine_param_shapes(engine, config)
    shards: dict[str, dict] = {}
    params: dict[str, torch.Tensor] = {}
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            target, shard = engine_param_name(engine, layer, key, set(shapes))
            tensor = f.get_tensor(key)
            if target == D2T:
                params["hot_token_id"] = tensor + torch.arange(tensor.shape[0])
            elif target == DROPPED:
                raise PipelineError(f"{export_dir}: {engine} loads {key} into no parameter")
            elif target != SKIP:
                shards.setdefault(target, {})[shard] = tensor
    for target, parts in shards.items():
        if None in parts:
            params[target] = parts[None]
            continue
        order = sorted(parts, key=lambda s: SHARD_ORDER.get(s, s))
        params[target] = torch.cat([parts[s] for s in order], dim=0)
    unfilled = set(shapes) - set(params) - {"model.embed_tokens.weight"}
    if unfilled:
        raise PipelineError(f"{export_dir}: {engine} parameters left unfilled: {sorted(unfilled)}")
    for target, tensor in params.items():
        if target in shapes and tuple(tensor.shape) != shapes[target]:
            raise PipelineError(
                f"{export_dir}: {target} has shape {tuple(tensor.shape)}, {engine} builds "
                f"{shapes[target]}"
            )
    return config, params


def drafter_from_engine_params(config: dict, params: dict[str, torch.Tensor]) -> Eagle3Drafter:
    """Our module filled from an engine's parameters: each of ours is the slice of the engine
    parameter the engine's loader put it in (embed_tokens is left for the caller)."""
    engine, layer = export_engine(config), export_layer(config)
    model = Eagle3Drafter(config_as_read(config))
    ours = {k: v for k, v in model.trainable_state_dict().items() if k not in ("d2t", "t2d")}
    names = set(engine_param_shapes(engine, config))
    pieces: dict[str, list[tuple[object, str]]] = {}
    for name in ours:
        target, shard = engine_param_name(engine, layer, name, names)
        if target not in params:
            raise PipelineError(f"{engine} parameters hold nothing for our {name}")
        pieces.setdefault(target, []).append((shard, name))
    state = {}
    for target, parts in pieces.items():
        parts.sort(key=lambda p: SHARD_ORDER.get(p[0], p[0] or 0))
        sizes = [ours[name].shape[0] for _, name in parts]
        for (_, name), tensor in zip(parts, params[target].split(sizes), strict=True):
            state[name] = tensor.float()
    hot = params["hot_token_id"]
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    state["d2t"], state["t2d"] = hot - torch.arange(hot.shape[0]), t2d
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens")]
    if missing or unexpected:
        raise PipelineError(f"{engine}-mapped weights: missing {missing}, unexpected {unexpected}")
    return model


def load_exported_drafter(export) -> Eagle3Drafter:
    """The drafter as its export's engine would load it (embed_tokens left for the caller);
    `export` is a live.ExportInfo or an export directory."""
    directory = getattr(export, "directory", export)
    require_intact(Path(directory) / "model.safetensors")
    engine = getattr(export, "engine", None)
    return drafter_from_engine_params(*load_like_engine(directory, engine))
