"""Export the drafter as a checkpoint SGLang and vLLM load as an EAGLE-3 draft model.

Per engine a directory with `config.json` and `model.safetensors` (no embedding: both engines
share the target's). The config names the draft class of the drafter's layer
(variants.ARCHITECTURES):

- layer `llama`: `LlamaForCausalLMEagle3` (model_type llama; head_dim, num_key_value_heads);
- layer `mla`: `Eagle3DeepseekV2ForCausalLM` (model_type deepseek_v3, transformers'
  DeepseekV3Config; q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
  v_head_dim, rope_interleave: true), what SGLang's models/kimi_k25_eagle3.py and vLLM's
  models/deepseek_eagle3.py serve;

both with target-shaped sizes, `draft_vocab_size`, the aux layer ids, the RoPE base and
scaling the drafter trained with (as `rope_theta` + `rope_scaling` and as `rope_parameters`)
and the four variant flags as top-level booleans (`fc_norm`, `norm_before_fc`, `norm_output`,
`norm_before_residual`: where both engines read them). The tensors keep our names:
`midlayer.*`, `fc.weight`, `fc_norm.{i}.weight`, `input_norm.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`; engine_load.py repeats what each engine makes of them. An
engine that would not load one of the drafter's options is refused (variants.py).

The aux layer ids are the subtle part. Ours are 0-based decoder-layer *outputs*
(eaglepipe/core/layers.py); both engines capture the residual stream *entering* a layer, so the
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
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..core.atomic import atomic_write_bytes, dumps_json
from ..core.config import text_config
from ..core.drafter_options import MLA_DIMS, NORM_FLAGS
from ..core.errors import PipelineError
from ..core.fingerprint import hash_bytes
from ..core.run import RunSpec
from ..core.sealed import CONFIG_SEAL_KEY, seal, seal_metadata
from .model import DrafterConfig, Eagle3Drafter, load_drafter
from .variants import ARCHITECTURES, check_export_support, check_mla_serving
from .vocab import load_vocab

ENGINES = ("sglang", "vllm")

# Target architectures whose SGLang model class is DeepseekV2ForCausalLM (or delegates to it).
DEEPSEEK_ARCHITECTURES = {
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
}
DEEPSEEK_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25"}

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
# Writing the export


def export_config(
    drafter: DrafterConfig, target_config: dict, engine: str, aux_ids: list[int]
) -> dict:
    family = target_family(target_config)
    written = engine_layer_ids(engine, family, aux_ids)
    text = text_config(target_config)
    config = {
        "architectures": [ARCHITECTURES[drafter.layer]],
        "model_type": "llama" if drafter.layer == "llama" else "deepseek_v3",
        "hidden_size": drafter.hidden_size,
        "target_hidden_size": drafter.hidden_size,
        "intermediate_size": drafter.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": drafter.num_attention_heads,
        "num_key_value_heads": drafter.num_key_value_heads,
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
        **{flag: getattr(drafter, flag) for flag in NORM_FLAGS},
        "eaglepipe": {
            "engine": engine,
            "layer": drafter.layer,
            "target_family": family,
            "aux_layer_ids": list(aux_ids),
            "layer_convention": "decoder-layer-output-0based",
        },
    }
    if drafter.layer == "llama":
        config["head_dim"] = drafter.head_dim
    else:
        config.update({key: getattr(drafter, key) for key in MLA_DIMS})
        # Both engines rotate MLA's RoPE channels in interleaved pairs (SGLang unless this is
        # false, vLLM always), as the drafter trained.
        config["rope_interleave"] = True
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
    engines = list(engines or run.export.engines)
    options = {"layer": model.config.layer, **{f: getattr(model.config, f) for f in NORM_FLAGS}}
    check_export_support(options, engines)
    check_mla_serving(engines, model.config)
    target_config = run.model.config
    tensors = export_tensors(model)
    written = []
    for engine in engines:
        directory = Path(out_dir) / engine
        engine_config = export_config(model.config, target_config, engine, aux_ids)
        # The config first: the weights, written last, record its checksum and their own
        # (core/sealed.py), so `eaglepipe verify` can check the pair.
        config_bytes = dumps_json(engine_config)
        atomic_write_bytes(directory / "config.json", config_bytes)
        metadata = seal_metadata({"format": "pt", CONFIG_SEAL_KEY: hash_bytes(config_bytes)})
        atomic_write_bytes(directory / "model.safetensors", seal(save(tensors, metadata=metadata)))
        ids = engine_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        print(f"exported {directory} (aux layer ids as {engine} reads them: {ids})", flush=True)
        written.append(directory)
    return written
