"""The draft vocabulary: the target ids the drafter's lm_head can emit.

Chosen as the `draft_vocab_size` most frequent loss-masked tokens of the training rows, ties
broken by the smaller token id so the choice is deterministic. Stored as the engines expect:
`d2t` (int64 [Vd], target id = draft id + d2t[draft id], chosen ids ascending) and `t2d`
(bool [V], True where a target id is in the draft vocabulary).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors import safe_open
from safetensors.torch import save

from ..core.atomic import atomic_write_bytes
from ..core.errors import PipelineError
from ..core.sealed import require_intact, seal, seal_metadata


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [Vd]
    t2d: torch.Tensor  # bool [V]

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft id."""
        return torch.arange(self.d2t.shape[0]) + self.d2t

    @property
    def size(self) -> int:
        return int(self.d2t.shape[0])


def masked_token_counts(table: pd.DataFrame, target_vocab_size: int) -> np.ndarray:
    """Frequency of each target id over the loss-masked tokens of the table's train rows."""
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    train = table[table["split"] == "train"]
    if train.empty:
        raise PipelineError("prepared table has no rows with split == 'train'")
    for row_id, ids, mask in zip(
        train["row_id"], train["input_ids"], train["loss_mask"], strict=True
    ):
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=bool)
        if ids.shape != mask.shape:
            raise PipelineError(f"row {row_id}: input_ids and loss_mask differ in length")
        if ids.size and (ids.min() < 0 or ids.max() >= target_vocab_size):
            raise PipelineError(
                f"row {row_id}: token id {int(ids.max())} outside the target vocabulary "
                f"of {target_vocab_size}"
            )
        counts += np.bincount(ids[mask], minlength=target_vocab_size)
    return counts


def choose_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """Top `draft_vocab_size` ids by count (ties: smaller id first), capped at the vocab size."""
    size = min(int(draft_vocab_size), counts.shape[0])
    ids = np.arange(counts.shape[0])
    order = np.lexsort((ids, -counts))  # primary: count descending; secondary: id ascending
    chosen = np.sort(order[:size])
    d2t = torch.from_numpy(chosen - np.arange(size)).to(torch.int64)
    t2d = torch.zeros(counts.shape[0], dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    return DraftVocab(d2t=d2t, t2d=t2d)


def build_draft_vocab(
    table: pd.DataFrame, target_vocab_size: int, draft_vocab_size: int
) -> tuple[DraftVocab, dict]:
    counts = masked_token_counts(table, target_vocab_size)
    vocab = choose_draft_vocab(counts, draft_vocab_size)
    total = int(counts.sum())
    covered = int(counts[vocab.t2d.numpy()].sum())
    stats = {
        "target_vocab_size": int(target_vocab_size),
        "draft_vocab_size": vocab.size,
        "masked_tokens": total,
        "distinct_masked_tokens": int((counts > 0).sum()),
        "coverage": covered / total if total else 0.0,
    }
    return vocab, stats


def save_vocab(vocab: DraftVocab, path: str | os.PathLike, stats: dict | None = None) -> None:
    metadata = seal_metadata({k: str(v) for k, v in (stats or {}).items()})
    atomic_write_bytes(path, seal(save({"d2t": vocab.d2t, "t2d": vocab.t2d}, metadata=metadata)))


def load_vocab(path: str | os.PathLike) -> DraftVocab:
    path = Path(path)
    if not path.exists():
        raise PipelineError(f"draft vocabulary {path} does not exist")
    require_intact(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if not {"d2t", "t2d"} <= keys:
                raise PipelineError(f"{path} lacks d2t/t2d (has {sorted(keys)})")
            vocab = DraftVocab(d2t=f.get_tensor("d2t"), t2d=f.get_tensor("t2d"))
    except FileNotFoundError:
        raise PipelineError(f"draft vocabulary {path} does not exist") from None
    if vocab.d2t.dtype != torch.int64 or vocab.t2d.dtype != torch.bool:
        raise PipelineError(f"{path}: d2t must be int64 and t2d bool")
    ids = vocab.draft_ids
    if int(vocab.t2d.sum()) != vocab.size or not bool(vocab.t2d[ids].all()):
        raise PipelineError(f"{path}: d2t and t2d disagree about the draft vocabulary")
    return vocab
