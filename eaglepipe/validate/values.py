"""values: everything finite, no all-zero or constant sample, and per-layer mean norms within
`validate.norm_drift_factor` of the first validated shard whose values are comparable
(`norm_comparable_on`: the same model, weights, layers, engine and dtype)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..core.hidden_store import HiddenStore, dequantize, scale_key
from ..extract.chunk_file import ChunkReader
from .checks import LAYER_NAMES, ValidationFailure
from .schema import ChunkLayout

# Hidden-state values are scanned in token blocks of about this many bytes, bounding memory.
_VALUE_BLOCK_BYTES = 64 << 20


@dataclass
class ValueStats:
    """Per-layer token-norm sums, accumulated chunk by chunk."""

    hidden_size: int
    num_aux_layers: int
    norm_sums: np.ndarray = field(default_factory=lambda: np.zeros(len(LAYER_NAMES)))
    norm_sq_sums: np.ndarray = field(default_factory=lambda: np.zeros(len(LAYER_NAMES)))
    norm_max: np.ndarray = field(default_factory=lambda: np.zeros(len(LAYER_NAMES)))
    tokens: int = 0

    def layer_means(self) -> dict[str, float]:
        return {
            name: float(self.norm_sums[i] / max(self.tokens, 1))
            for i, name in enumerate(LAYER_NAMES)
        }


def layer_label(index: int, aux_layer_ids: list[int]) -> str:
    if index < len(aux_layer_ids):
        return f"aux_{index} (decoder layer {aux_layer_ids[index]} output)"
    return "final (post-norm)"


def _bf16_bits(reader: ChunkReader, name: str, start: int, end: int, layers: int) -> np.ndarray:
    """Tokens start:end of hidden-state tensor `name` as raw bf16 bit patterns (int16),
    [tokens, layers, H]: a bf16 store's mapped bytes themselves (no copy: the map reads straight
    from the page cache, where a copy would fault in fresh pages), an e4m3 one dequantized."""
    values, scale = reader.stored(name, start, end)
    if scale is not None:
        values = dequantize(values, scale, torch.bfloat16)
    bits = values.view(torch.int16).numpy()
    return bits.reshape(end - start, layers, -1)


_BF16_EXPONENT = 0x7F80


def _bf16_value(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16).item()


def _token_reductions(reader: ChunkReader, layout: ChunkLayout, stats: ValueStats):
    """Per token and layer: min and max bit pattern, and the L2 norm, in bounded token blocks.

    Equal min and max bit patterns mean equal values, so integer reductions (several GB/s in
    numpy) decide constancy; the norm runs on bf16 directly (torch accumulates in fp32) since
    converting to fp32 first would cost more than everything else together. A NaN or inf
    makes the norm non-finite, so the norm also screens for non-finite values. An FP8 store is
    judged by its dequantized values, block by block.
    """
    hidden, aux_layers = stats.hidden_size, stats.num_aux_layers
    tokens = layout.num_tokens
    layers = aux_layers + 1
    block = max(1, _VALUE_BLOCK_BYTES // (layers * hidden * 2))
    token_min = np.empty((tokens, layers), np.int16)
    token_max = np.empty((tokens, layers), np.int16)
    token_norm = np.empty((tokens, layers), np.float32)
    for a in range(0, tokens, block):
        b = min(tokens, a + block)
        for name, count, cols in (
            ("aux_hidden_states", aux_layers, slice(0, aux_layers)),
            ("final_hidden_states", 1, slice(aux_layers, layers)),
        ):
            bits = _bf16_bits(reader, name, a, b, count)
            token_min[a:b, cols] = bits.min(-1)
            token_max[a:b, cols] = bits.max(-1)
            values = torch.from_numpy(bits).view(torch.bfloat16)
            token_norm[a:b, cols] = torch.linalg.vector_norm(values, dim=-1).float().numpy()
    return token_min, token_max, token_norm


def _layer_bits(reader: ChunkReader, token: int, layer: int, aux_layers: int) -> np.ndarray:
    """One token's layer as bf16 bit patterns."""
    if layer < aux_layers:
        return _bf16_bits(reader, "aux_hidden_states", token, token + 1, aux_layers)[0, layer]
    return _bf16_bits(reader, "final_hidden_states", token, token + 1, 1)[0, 0]


def check_chunk_values(
    reader: ChunkReader,
    shard: str,
    layout: ChunkLayout,
    stats: ValueStats,
    aux_layer_ids: list[int],
) -> None:
    """All finite; no row's slice of any layer all zero or constant; e4m3 scales positive;
    accumulate norms."""
    token_min, token_max, token_norm = _token_reductions(reader, layout, stats)
    row_start = dict(zip(layout.row_ids.tolist(), layout.offsets[:-1].tolist(), strict=True))
    aux_layers = len(aux_layer_ids)

    def fail(detail: str, token: int, layer: int) -> None:
        row = layout.row_of_token(token)
        raise ValidationFailure(
            shard,
            "values",
            f"{detail} in {layer_label(layer, aux_layer_ids)} at token {token - row_start[row]}",
            chunk=layout.file,
            row=row,
        )

    overflow = ~np.isfinite(token_norm)
    if overflow.any():
        token, layer = (int(i) for i in np.argwhere(overflow)[0])
        bits = _layer_bits(reader, token, layer, aux_layers)
        if ((bits & _BF16_EXPONENT) == _BF16_EXPONENT).any():
            fail("non-finite hidden state (NaN or inf)", token, layer)
        fail("hidden state too large (its L2 norm overflows fp32)", token, layer)
    for name in reader.store.scaled_keys:
        scales = reader.raw(scale_key(name)).data
        bad = ~(scales > 0) | ~np.isfinite(scales)
        if bad.any():
            token, column = (int(i) for i in np.argwhere(bad)[0])
            layer = column if name == "aux_hidden_states" else aux_layers
            fail(
                f"scale {float(scales[token, column])!r} of the e4m3 values (must be positive "
                "and finite)",
                token,
                layer,
            )

    starts = layout.offsets[:-1]
    row_min = np.minimum.reduceat(token_min, starts, axis=0)
    row_max = np.maximum.reduceat(token_max, starts, axis=0)
    row_norm = np.maximum.reduceat(token_norm, starts, axis=0)
    # All zero: every norm 0 (+0 and -0 have different bits); constant: one bit pattern.
    degenerate = (row_norm == 0) | (row_min == row_max)
    if degenerate.any():
        index, layer = (int(i) for i in np.argwhere(degenerate)[0])
        value = 0.0 if row_norm[index, layer] == 0 else _bf16_value(int(row_min[index, layer]))
        what = "all zero" if value == 0 else f"constant ({value:g})"
        raise ValidationFailure(
            shard,
            "values",
            f"hidden states of {layer_label(layer, aux_layer_ids)} are {what} "
            f"over the row's {int(np.diff(layout.offsets)[index])} tokens",
            chunk=layout.file,
            row=int(layout.row_ids[index]),
        )
    stats.norm_sums += token_norm.sum(axis=0, dtype=np.float64)
    stats.norm_sq_sums += np.square(token_norm, dtype=np.float64).sum(axis=0)
    stats.norm_max = np.maximum(stats.norm_max, token_norm.max(axis=0))
    stats.tokens += layout.num_tokens


# What makes two shards' hidden states comparable in scale: the same model, the same layers
# under the same conventions, the same engine, the same storage dtype and width. Not what differs
# from shard to shard by design: its inputs (`shard_inputs_hash`) and its workflow stamp
# (`workflow` hashes the shard's source rows), nor engine or project versions.
NORM_COMPARABLE_PROVENANCE = (
    "model_config_hash",
    "weights_fingerprint",
    "aux_layer_ids",
    "layer_convention",
    "final_convention",
    "engine",
)


def norm_comparable_on(manifest: dict) -> dict:
    """The key under which shards share a norm-drift reference (recorded in each report): the
    model and its weights, the layers, and the engine with the dtype it computed in (not its
    version: drift across an engine upgrade is what the check is for)."""
    provenance = manifest["provenance"]
    key = {name: provenance.get(name) for name in NORM_COMPARABLE_PROVENANCE}
    compute_dtype = (provenance.get("engine_identity") or {}).get("dtype")
    comparable = {
        **key,
        "compute_dtype": compute_dtype,
        "dtype": manifest["dtype"],
        "hidden_size": manifest["hidden_size"],
    }
    store = HiddenStore.from_manifest(manifest)
    if not store.is_default:
        # Only then: a bf16 shard keeps the references it had before stores could differ.
        comparable["store"] = store.as_dict()
    return comparable


def find_norm_reference(validated_dir: Path, shard: str, comparable_on: dict) -> dict | None:
    """The earliest existing report (by validation time) of another shard with the same
    `norm_comparable_on` key. Shards without tokens (every row skipped by prepare) have no norms
    to compare against."""
    candidates = []
    for path in sorted(Path(validated_dir).glob("rows_*.json")):
        if path.stem == shard:
            continue
        try:
            report = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        comparable = report.get("norm_comparable_on") == comparable_on
        if comparable and report.get("num_tokens") and "layer_norms" in report:
            candidates.append((report.get("validated_at", ""), path.stem, report))
    return min(candidates, key=lambda c: (c[0], c[1]))[2] if candidates else None


def check_norm_drift(
    shard: str,
    stats: ValueStats,
    reference: dict | None,
    factor: float,
    aux_layer_ids: list[int],
) -> dict:
    """Each layer's mean norm within `factor` of the reference shard's (either direction)."""
    means = stats.layer_means()
    result = {
        "ok": True,
        "tokens": stats.tokens,
        "norm_std": {
            name: float(
                np.sqrt(max(stats.norm_sq_sums[i] / max(stats.tokens, 1) - means[name] ** 2, 0.0))
            )
            for i, name in enumerate(LAYER_NAMES)
        },
        "norm_max": {name: float(stats.norm_max[i]) for i, name in enumerate(LAYER_NAMES)},
        "norm_drift_factor": factor,
    }
    if reference is None or stats.tokens == 0:
        result["norm_ratio_to_reference"] = None
        return result
    ratios = {}
    for index, name in enumerate(LAYER_NAMES):
        ref = float(reference["layer_norms"][name])
        ratio = means[name] / ref if ref > 0 else float("inf")
        ratios[name] = ratio
        if not 1.0 / factor <= ratio <= factor:
            raise ValidationFailure(
                shard,
                "values",
                f"mean L2 norm of {layer_label(index, aux_layer_ids)} is {means[name]:.4g}, "
                f"{ratio:.3g}x that of reference shard {reference['shard']} ({ref:.4g}); "
                f"validate.norm_drift_factor allows {factor:g}x",
            )
    result["norm_ratio_to_reference"] = ratios
    return result
