"""Only the two target tensors the drafter needs: the token embedding and the lm_head.

A target checkpoint may be hundreds of GB, sharded over many files; these two tensors are read
straight from the safetensors file(s) that hold them (via `model.safetensors.index.json`),
never by loading the model. With `tie_word_embeddings` the lm_head is the embedding.
Decoder-internal copies (DeepSeek's MTP layer keeps `model.layers.61.embed_tokens`) are ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..core.config import text_config
from ..core.errors import PipelineError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class TargetHead:
    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]


def _tensor_locations(model_dir: Path) -> dict[str, Path]:
    index = model_dir / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / SINGLE_NAME
    if not single.exists():
        raise PipelineError(f"model directory {model_dir} has no {SINGLE_NAME} or {INDEX_NAME}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _find(names: list[str], suffix: str) -> str | None:
    candidates = [n for n in names if n.endswith(suffix) and ".layers." not in n]
    if len(candidates) > 1:
        raise PipelineError(f"several tensors end in {suffix}: {candidates}")
    return candidates[0] if candidates else None


def _read(location: Path, name: str) -> torch.Tensor:
    with safe_open(str(location), framework="pt") as f:
        return f.get_tensor(name)


def load_target_head(model_dir: str | os.PathLike) -> TargetHead:
    model_dir = Path(model_dir)
    try:
        config = text_config(json.loads((model_dir / "config.json").read_text()))
    except FileNotFoundError:
        raise PipelineError(f"model directory {model_dir} has no config.json") from None
    locations = _tensor_locations(model_dir)
    names = sorted(locations)
    embed_name = _find(names, "embed_tokens.weight")
    if embed_name is None:
        raise PipelineError(f"{model_dir}: no embed_tokens.weight tensor in the checkpoint")
    embed = _read(locations[embed_name], embed_name)
    head_name = _find(names, "lm_head.weight")
    if head_name is not None:
        head = _read(locations[head_name], head_name)
    elif config.get("tie_word_embeddings", False):
        head = embed
    else:
        raise PipelineError(
            f"{model_dir}: no lm_head.weight tensor and tie_word_embeddings is not set"
        )
    if embed.shape != head.shape or embed.shape[0] < int(config["vocab_size"]):
        raise PipelineError(
            f"{model_dir}: embed_tokens {tuple(embed.shape)} and lm_head {tuple(head.shape)} "
            f"do not fit vocab_size {config['vocab_size']}"
        )
    vocab = int(config["vocab_size"])
    return TargetHead(embed_tokens=embed[:vocab], lm_head=head[:vocab])
