#!/usr/bin/env python3
"""Does speculators' Eagle3Converter convert our vLLM exports with every weight intact?

speculators is not a project dependency: run this where it is importable (BENCHMARKS.md says
how it ran with 0.9.0). For each export directory (a `drafter/export/vllm` of any variant) it
runs `Eagle3Converter().convert(...)` with the target model's directory, the aux layer ids
vLLM reads from the export, and `norm_before_residual` (the one flag the converter takes only
as an argument; it reads the others from the export's config.json). Then it checks the result:
the keys the converter logged as missing or unexpected, whether every tensor of ours arrived
unchanged (`midlayer.` becomes `layers.0.`), and whether each flag reached the converted
config. Verdict: `intact`, `lossy` (converted, but weights or flags lost), or `failed`.

    python -u -m benchmarks.checks.speculators_convert --target models/toy-target --out /tmp/conv \\
        variants/*/export/vllm
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

FLAGS = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")


def logged_keys(messages: list[str], prefix: str) -> list[str]:
    for message in messages:
        if message.startswith(prefix):
            return ast.literal_eval(message[len(prefix) :].strip())
    return []


def convert(export_dir: Path, target: Path, out_dir: Path) -> dict:
    from loguru import logger
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    ours = json.loads((export_dir / "config.json").read_text())
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(m.record["message"]), level="DEBUG")
    result = {
        "export": str(export_dir),
        "layer": ours.get("eaglepipe", {}).get("layer", "llama"),
        "flags": [f for f in FLAGS if ours.get(f)],
    }
    try:
        Eagle3Converter().convert(
            export_dir,
            out_dir,
            str(target),
            validate=True,
            norm_before_residual=bool(ours.get("norm_before_residual")),
            eagle_aux_hidden_state_layer_ids=ours["eagle_aux_hidden_state_layer_ids"],
        )
    except Exception as exc:  # the converter's own refusal is a result here
        result.update(verdict="failed", error=f"{type(exc).__name__}: {exc}"[:300])
        return result
    finally:
        logger.remove(sink)
    result["missing"] = logged_keys(messages, "Missing keys in checkpoint:")
    result["unexpected"] = logged_keys(messages, "Unexpected keys in checkpoint:")
    converted = load_file(str(out_dir / "model.safetensors"))
    exported = load_file(str(export_dir / "model.safetensors"))
    lost = [
        key
        for key, tensor in exported.items()
        if not torch.equal(
            converted.get(key.replace("midlayer.", "layers.0."), torch.empty(0)), tensor
        )
    ]
    config = json.loads((out_dir / "config.json").read_text())
    dropped_flags = [f for f in FLAGS if bool(config.get(f)) != bool(ours.get(f))]
    result.update(
        lost_tensors=lost,
        flags_not_carried=dropped_flags,
        aux_layer_ids=config.get("eagle_aux_hidden_state_layer_ids"),
        verdict="intact" if not (lost or dropped_flags or result["missing"]) else "lossy",
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", type=Path, help="drafter/export/vllm directories")
    parser.add_argument("--target", required=True, type=Path, help="the target model directory")
    parser.add_argument("--out", required=True, type=Path, help="where the conversions go")
    args = parser.parse_args()
    from importlib.metadata import version

    results = []
    for i, export_dir in enumerate(args.exports):
        results.append(
            convert(export_dir, args.target, args.out / f"{i}-{export_dir.parent.parent.name}")
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"\nspeculators {version('speculators')}\n")
    print("| export | layer | flags | verdict | missing | unexpected | tensors lost | flags lost |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        flags_lost = ", ".join(r.get("flags_not_carried", [])) or "-"
        print(
            f"| {r['export']} | {r['layer']} | {', '.join(r['flags']) or 'none'} | {r['verdict']} "
            f"| {len(r.get('missing', []))} | {len(r.get('unexpected', []))} "
            f"| {len(r.get('lost_tensors', []))} | {flags_lost} |"
        )


if __name__ == "__main__":
    main()
