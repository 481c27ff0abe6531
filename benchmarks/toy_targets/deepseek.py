#!/usr/bin/env python3
"""A DeepSeek-V3-shaped toy target (MLA attention, MoE layers) for the drafter-variants benchmark.

The embedded default's toy target is a Llama; an MLA draft layer needs a target with MLA
attention. This builds one the same way (the toy's byte-level BPE tokenizer, the same short
seeded pre-training on the same conversations, `eaglepipe.data.toy_target.pretrain`) so a
pipeline run with `model.path` set to it gives the drafter-variants study
(`benchmarks.studies.drafter_variants --variants plain,mla`) a learnable target:

    python -u -m benchmarks.toy_targets.deepseek --corpus data/sample/conversations.jsonl \
        --out /tmp/deepseek-toy [--tokenizer-from <run>/models/toy-target] [--device cuda]

Without --tokenizer-from the toy's tokenizer is trained here on the corpus, as the embedded
default's build does (512 tokens). The shape mirrors the embedded toy's (hidden 64, 8 layers, 4
heads, vocab of the tokenizer) with DeepSeek-V3's MLA (q_lora_rank 64, kv_lora_rank 512, qk_nope
128, qk_rope 64, v 128; `--shape` sets hidden and the five MLA sizes). Its layers are dense unless
`--moe` (DeepSeek-V3's MoE after the first layer): transformers' MoE trains about 10x slower on
a CPU, and the draft layer's own MLP is dense either way. config.json also gets the keys SGLang
0.5.14 reads without a default (`SGLANG_DEEPSEEK_KEYS`), so SGLang serves the directory
as it is (`tools/h200.sh pipeline-mla`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from eaglepipe.core.atomic import atomic_write_json
from eaglepipe.data.dataset import read_conversations
from eaglepipe.data.toy_target import (
    corpus_texts,
    portable_tokenizer_class,
    pretrain,
    train_tokenizer,
)

TOKENIZER_VOCAB = 512  # the embedded default's model.toy.vocab_size

# Keys real DeepSeek-V3 config.json files carry that transformers' DeepseekV3Config does not
# save; SGLang 0.5.14 (and 0.5.18) reads moe_layer_freq and topk_method without a default.
SGLANG_DEEPSEEK_KEYS = {
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "ep_size": 1,
}


def add_sglang_deepseek_keys(model_dir: Path) -> dict:
    """Write SGLANG_DEEPSEEK_KEYS into a saved DeepSeek-V3 checkpoint's config.json (those it
    lacks); returns the config as saved."""
    config_path = Path(model_dir) / "config.json"
    saved = json.loads(config_path.read_text())
    saved.update({k: v for k, v in SGLANG_DEEPSEEK_KEYS.items() if k not in saved})
    atomic_write_json(config_path, saved)
    return saved


# DeepSeek-V3's own MLA sizes at the toy's width: the shape SGLang 0.5.14 served through the
# whole pipeline on the H200 (2026-12-04). Smaller ones failed there: 32 + 8 and 64 + 16 in the
# Triton MLA decode kernel at start (eaglepipe.drafter.variants.triton_mla_decode_fits), 48 + 16
# with v_head_dim 32 on the first batched prefill (BENCHMARKS.md).
DEFAULT_SHAPE = dict(
    hidden_size=64, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128,
)  # fmt: skip


def parse_shape(text: str) -> dict:
    values = [int(v) for v in text.split(",")]
    if len(values) != len(DEFAULT_SHAPE):
        raise argparse.ArgumentTypeError(f"--shape needs {len(DEFAULT_SHAPE)} integers: {text}")
    return dict(zip(DEFAULT_SHAPE, values, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer-from", help="a built toy-target directory (default: train the toy's here)"
    )
    parser.add_argument("--corpus", required=True, help="conversations (JSONL) to pre-train on")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true", help="MoE layers after the first")
    parser.add_argument("--device", default="cpu", help="where to pre-train (cpu, cuda)")
    parser.add_argument(
        "--shape", type=parse_shape, default=DEFAULT_SHAPE,
        help="hidden,q_lora_rank,kv_lora_rank,qk_nope_head_dim,qk_rope_head_dim,v_head_dim "
        f"(default {','.join(map(str, DEFAULT_SHAPE.values()))})",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # the toy's matrices are tiny; see toy_target.build_toy_target
    conversations, _ = read_conversations(args.corpus, bad_rows="skip")
    if args.tokenizer_from:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_from)
    else:
        tokenizer = train_tokenizer(
            corpus_texts(conversations), TOKENIZER_VOCAB, model_max_length=2048
        )
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        intermediate_size=176,
        moe_intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1 if args.moe else 8,
        **args.shape,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = DeepseekV3ForCausalLM(config).to(args.device)
    ids: list[int] = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation.messages, tokenize=False)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    toy = {"train_steps": args.steps, "train_seq_len": 128, "train_batch_size": 16}
    pretrain(model, torch.tensor(ids, device=args.device), {**toy, "seed": args.seed})
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    portable_tokenizer_class(out / "tokenizer_config.json")
    add_sglang_deepseek_keys(out)
    print(f"deepseek toy target: saved to {out}", flush=True)


if __name__ == "__main__":
    main()
