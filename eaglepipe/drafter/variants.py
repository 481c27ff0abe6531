"""Drafter variants: the `train.drafter` options and which engine loads which of them.

The draft layer (`layer`) is `llama` (the original EAGLE-3 layout) or `mla` (the same layout
with DeepSeek-V2 multi-latent attention, for targets with MLA attention: DeepSeek-V3,
Kimi-K2.5). Four flags change where the layer normalises (EAGLE-3.1 and speculators):

    fc_norm               an RMSNorm per aux layer before `fc`    (weights fc_norm.{0,1,2})
    norm_before_fc        one RMSNorm over the concatenated aux states before `fc` (input_norm)
    norm_output           the next draft step receives the post-norm hidden state, not pre-norm
    norm_before_residual  the layer's residual is the hidden state after `hidden_norm`

`fc_norm` and `norm_before_fc` exclude each other (speculators refuses both at once; the
engines that read both would apply both).

`ENGINE_OPTIONS` says which options each engine's draft class loads, for each layer. An export
for an engine that would not load an option (it would drop the weights or ignore the flag
without a word) is refused, naming engine and option; the workflow checks it when it parses
the config, so no training runs for an export that cannot be served. Sources:

- SGLang, both ends of the supported range (patch/sglang.toml, 0.5.14 and 0.5.23):
  `LlamaForCausalLMEagle3` (models/llama_eagle3.py) reads `fc_norm` (or the legacy
  `use_aux_norm`) and `norm_output`; only 0.5.23 reads `norm_before_fc`, so the range does not
  load it. `Eagle3DeepseekV2ForCausalLM` (models/kimi_k25_eagle3.py) reads `fc_norm` and
  `norm_output`. Neither reads `norm_before_residual`. tests/test_drafter_variants.py checks
  this table against both ends' source.
- vLLM 0.33.0 (its wheel, models/llama_eagle3.py and models/deepseek_eagle3.py):
  `Eagle3LlamaForCausalLM` reads all four; `Eagle3DeepseekV2ForCausalLM` all but
  `norm_before_fc`.

An MLA draft layer must also fit SGLang's Triton MLA decode kernel (the attention backend the
pipeline's SGLang servers use, `--attention-backend triton`): with more than one head
it reads the latent cache in a block of next_power_of_2(kv_lora_rank + qk_rope_head_dim) lanes
(split 512 + 64 for a sum of 576, 256 + 32 for 288) and the values in one of
next_power_of_2(kv_lora_rank), and the two must agree (`_decode_grouped_att_m_fwd`, 0.5.14's
srt/layers/attention/triton_ops/decode_attention.py, 0.5.23's kernels/ops/attention/). On the
H200, kv_lora_rank 32 + rope 8 and 64 + 16 crashed the server at start; 48 + 16 and 256 + 32
started, and 512 + 64 (DeepSeek-V3's) served batches and a live MLA draft (BENCHMARKS.md).
`check_mla_serving` refuses such a shape before training.

This module stays free of torch: the Snakefile calls `check_export_support` at parse time.
"""

from __future__ import annotations

from ..core.drafter_options import NORM_FLAGS
from ..core.errors import PipelineError

# The exported `architectures` entry per layer (both engines register these names).
ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}

ENGINE_OPTIONS = {
    ("sglang", "llama"): {"fc_norm", "norm_output"},
    ("sglang", "mla"): {"fc_norm", "norm_output"},
    ("vllm", "llama"): {"fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"},
    ("vllm", "mla"): {"fc_norm", "norm_output", "norm_before_residual"},
}

# Why an engine does not load an option, for the error message.
_NOT_LOADED = {
    ("sglang", "norm_before_fc"): (
        "SGLang 0.5.14, the oldest release of the supported range, has no input_norm and drops "
        "its weight (0.5.23 loads it; the MLA draft class loads it in neither)"
    ),
    ("sglang", "norm_before_residual"): (
        "SGLang's draft layer always takes the residual before hidden_norm (0.5.14 to 0.5.23)"
    ),
    ("vllm", "norm_before_fc"): "vLLM's Eagle3DeepseekV2ForCausalLM has no input_norm (0.33.0)",
}


# Sums of kv_lora_rank + qk_rope_head_dim the kernel splits into a latent and a rope block.
_SPLIT_LATENT_BLOCK = {576: 512, 288: 256}


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def triton_mla_decode_fits(kv_lora_rank: int, qk_rope_head_dim: int) -> bool:
    """Whether SGLang's Triton MLA decode kernel (more than one head) serves these sizes."""
    total = kv_lora_rank + qk_rope_head_dim
    latent_block = _SPLIT_LATENT_BLOCK.get(total, _next_power_of_2(total))
    return latent_block == _next_power_of_2(kv_lora_rank)


def fitting_kv_lora_rank(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """The least multiple of 8 at or above `kv_lora_rank` the kernel serves with that rope."""
    rank = -(-kv_lora_rank // 8) * 8
    while not triton_mla_decode_fits(rank, qk_rope_head_dim):
        rank += 8
    return rank


def check_mla_serving(engines: list[str], config) -> None:
    """Refuse, in one line, an MLA draft layer SGLang's Triton decode kernel cannot serve.

    `config` is the resolved DrafterConfig (its MLA sizes the target's unless
    train.drafter.mla sets them)."""
    if "sglang" not in engines or config.layer != "mla" or config.num_attention_heads < 2:
        return
    kv, rope = config.kv_lora_rank, config.qk_rope_head_dim
    if triton_mla_decode_fits(kv, rope):
        return
    raise PipelineError(
        f"export.engines has sglang, which cannot serve this MLA draft layer: SGLang's Triton "
        f"MLA decode kernel (0.5.14 to 0.5.23) needs next_power_of_2(kv_lora_rank + "
        f"qk_rope_head_dim) to equal next_power_of_2(kv_lora_rank) (or the sum to be 288 or "
        f"576), and the layer has kv_lora_rank {kv} + qk_rope_head_dim {rope} = {kv + rope}; "
        f"set train.drafter.mla.kv_lora_rank (e.g. {fitting_kv_lora_rank(kv, rope)}) or drop "
        f"sglang from export.engines"
    )


def unsupported_options(engine: str, options: dict) -> list[str]:
    """The options set in `options` that `engine` does not load for that layer."""
    loaded = ENGINE_OPTIONS[(engine, options["layer"])]
    return [flag for flag in NORM_FLAGS if options[flag] and flag not in loaded]


def check_draft_layer(layer: str, target_text_config: dict) -> None:
    """An MLA draft layer needs a multi-latent-attention target (the DeepSeek family's
    `kv_lora_rank`). Called at parse time (with the toy target's config, a Llama, before it is
    built) and when the drafter is built."""
    if layer == "mla" and target_text_config.get("kv_lora_rank") is None:
        raise PipelineError(
            "train.drafter.layer is mla, but the target has no multi-latent attention "
            "(no kv_lora_rank in its config): use layer llama"
        )


def check_export_support(options: dict, engines: list[str]) -> None:
    """Refuse, in one line naming engine and option, an export an engine cannot load."""
    for engine in engines:
        for flag in unsupported_options(engine, options):
            reason = _NOT_LOADED.get((engine, flag), f"{engine} does not read it")
            raise PipelineError(
                f"export.engines has {engine}, which cannot load a drafter with "
                f"train.drafter.{flag} (layer {options['layer']}): {reason}; drop {engine} from "
                f"export.engines or unset train.drafter.{flag}"
            )
