#!/usr/bin/env python3
"""SpecForge 0.2 offline features from a transformers forward of the target (issue 27).

The fallback when SpecForge's own generator (scripts/prepare_hidden_states.py, the target in
SGLang's model runner in-process) does not run. Everything but the forward is SpecForge's:
its capture plan (`specforge.application.resolve_offline_capture`: the layers and the record
layout `specforge train` reads), its tokenisation and loss mask
(`specforge.data.preprocessing.build_eagle3_dataset` with the registered chat template), its
vocabulary mapping (`generate_vocab_mapping_file`) and its file layout:
OUT/rows_<k>-<k+2000>/data_<i>.ckpt (one `torch.save`d record per sample) and
OUT/vocab_mapping/vocab_mapping.pt.

What is captured is what SGLang captures for a Llama: for each aux layer id, that decoder
layer's output (the residual stream after it, which SGLang reads at the next layer's input),
concatenated; and the final normed hidden state (what the target's lm_head reads).

    python -m benchmarks.studies.specforge.hf_features --target T --draft-config D.json \\
        --data train.jsonl --template-json toy.json --out FEATURES --max-length 1024 \\
        --cache-dir CACHE [--device cuda] [--batch-size 8]

Needs SpecForge on the path (benchmarks/studies/specforge/compare.py runs it so).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

FILE_GROUP = 2000  # SpecForge's --file-group-size default


def register_template(path) -> str:
    """Register a SpecForge ChatTemplate from the JSON compare.py writes; its name."""
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate

    spec = json.loads(Path(path).read_text())
    name = spec.pop("name")
    TEMPLATE_REGISTRY.register(name, ChatTemplate(**spec), override=True)
    return name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft-config", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--template-json", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    template = register_template(args.template_json)
    from datasets import Dataset
    from specforge.application import resolve_offline_capture
    from specforge.config import Config
    from specforge.data.preprocessing import build_eagle3_dataset, generate_vocab_mapping_file
    from specforge.utils import load_tokenizer, safe_conversations_generator
    from transformers import AutoConfig, AutoModelForCausalLM

    target_config = AutoConfig.from_pretrained(args.target)
    plan = resolve_offline_capture(
        Config(
            model={"target_model_path": args.target, "draft_model_config": args.draft_config},
            data={"hidden_states_path": args.out, "max_length": args.max_length},
            training={"strategy": "eagle3"},
        ),
        target_config=target_config,
    )
    layers = list(plan.capture_layers)
    print(f"capture layers {layers}, record {plan.layout.output_names}", flush=True)
    draft_vocab = int(json.loads(Path(args.draft_config).read_text())["draft_vocab_size"])
    target_vocab = int(getattr(target_config, "text_config", target_config).vocab_size)

    rows = Dataset.from_generator(
        safe_conversations_generator,
        gen_kwargs={"file_path": args.data},
        cache_dir=os.path.join(args.cache_dir, "hf_dataset"),
    )
    tokenizer = load_tokenizer(args.target)
    dataset = build_eagle3_dataset(
        dataset=rows,
        tokenizer=tokenizer,
        chat_template=template,
        max_length=args.max_length,
        cache_dir=os.path.join(args.cache_dir, "processed_dataset"),
        cache_key="eaglepipe-hf-features",
        num_proc=1,
        loss_mask_filter=plan.loss_mask_filter,
    )
    dataset.set_format("torch")
    mapping_dir = Path(args.out) / "vocab_mapping"
    written = generate_vocab_mapping_file(
        dataset,
        target_vocab_size=target_vocab,
        draft_vocab_size=draft_vocab,
        cache_dir=str(mapping_dir),
        cache_key=".partial-vocab-mapping",
    )
    os.replace(written, mapping_dir / "vocab_mapping.pt")

    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype))
    decoder = model.to(args.device).eval().model
    captured: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(_module, _inputs, output):
            captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    for index in sorted(set(layers)):
        decoder.layers[index].register_forward_hook(keep(index))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    started, count = time.monotonic(), 0
    with torch.no_grad():
        for first in range(0, len(dataset), args.batch_size):
            batch = [dataset[i] for i in range(first, min(first + args.batch_size, len(dataset)))]
            lengths = [int(r["input_ids"].numel()) for r in batch]
            ids = torch.full((len(batch), max(lengths)), pad, dtype=torch.long)
            attention = torch.zeros_like(ids)
            for j, row in enumerate(batch):
                ids[j, : lengths[j]] = row["input_ids"].view(-1)
                attention[j, : lengths[j]] = 1
            captured.clear()
            final = decoder(
                input_ids=ids.to(args.device), attention_mask=attention.to(args.device)
            ).last_hidden_state
            aux = torch.cat([captured[i] for i in layers], dim=-1)
            for j, row in enumerate(batch):
                index, n = first + j, lengths[j]
                group = index // FILE_GROUP * FILE_GROUP
                folder = Path(args.out) / f"rows_{group}-{group + FILE_GROUP}"
                folder.mkdir(parents=True, exist_ok=True)
                record = plan.layout.materialize(
                    {
                        "input_ids": row["input_ids"].view(-1).clone(),
                        "loss_mask": row["loss_mask"].view(-1).clone(),
                        "aux_hidden_states": aux[j, :n].unsqueeze(0).cpu().clone(),
                        "last_hidden_states": final[j, :n].unsqueeze(0).cpu().clone(),
                    }
                )
                partial = folder / f"data_{index}.ckpt.partial"
                torch.save(record, partial)
                os.replace(partial, folder / f"data_{index}.ckpt")
                count += 1
    print(f"{count} feature files in {time.monotonic() - started:.1f}s into {args.out}", flush=True)


if __name__ == "__main__":
    main()
