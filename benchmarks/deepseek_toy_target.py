#!/usr/bin/env python3
"""A DeepSeek-V3-shaped toy target (MLA attention, MoE layers) for the drafter-variants benchmark.

The embedded default's toy target is a Llama; an MLA draft layer needs a target with MLA
attention. This builds one the same way (same tokenizer, same short seeded pre-training on the
same conversations, `eaglepipe.data.toy_target.pretrain`) so a pipeline run with `model.path` set to
it gives `bench_drafter_variants.py --variants plain,mla` a learnable target:

    python -u benchmarks/deepseek_toy_target.py --tokenizer-from <run>/models/toy-target \
        --corpus data/sample/conversations.jsonl --out /tmp/deepseek-toy

The shape mirrors the embedded toy's (hidden 64, 8 layers, 4 heads, vocab of the tokenizer)
with DeepSeek-V3's MLA (q_lora_rank 32, kv_lora_rank 32, qk_nope 16, qk_rope 8, v 16). Its
layers are dense unless `--moe` (DeepSeek-V3's MoE after the first layer): transformers' MoE
trains about 10x slower on a CPU, and the draft layer's own MLP is dense either way.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from eaglepipe.data.dataset import read_conversations
from eaglepipe.data.toy_target import pretrain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer-from", required=True, help="a built toy-target directory")
    parser.add_argument("--corpus", required=True, help="conversations (JSONL) to pre-train on")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true", help="MoE layers after the first")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the toy's matrices are tiny; see toy_target.build_toy_target
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_from)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
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
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = DeepseekV3ForCausalLM(config)
    conversations, _ = read_conversations(args.corpus, bad_rows="skip")
    ids: list[int] = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation.messages, tokenize=False)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    toy = {"train_steps": args.steps, "train_seq_len": 128, "train_batch_size": 16}
    pretrain(model, torch.tensor(ids), {**toy, "seed": args.seed})
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"deepseek toy target: saved to {out}", flush=True)


if __name__ == "__main__":
    main()
