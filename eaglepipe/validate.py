"""The validation gate: prove a shard sound before any training may read it.

`validate_shard` runs six checks over one extracted shard and writes
`validated/rows_{start}-{end}.json` only when all of them pass:

- provenance: the manifest's model and tokenizer hashes, layer ids and conventions equal the
  current configuration's (its rows are checked by coverage);
- integrity: every listed chunk exists, has its listed size and re-hashes to its listed
  xxh3-128; no unlisted chunk file is present;
- schema: tensor names, dtypes and shapes agree with the offsets, the manifest's row ids,
  hidden size and layer count;
- coverage: the row ids are exactly the planned range minus the rows prepare skipped, without
  duplicates, in order; input ids and loss masks equal the prepared table's;
- values: everything finite, no sample whose hidden states are all zero or constant, per-layer
  mean norms within `validate.norm_drift_factor` of the first validated shard of the same model,
  layers, engine and dtype (`norm_comparable_on`);
- spot_check: a few seeded random rows recomputed, where the target fits in memory, by
  independent transformers forwards on CPU (fp32, and bf16 for the noise floor), and re-extracted
  one at a time through the server (held exclusively; each dump says how many requests its
  forward pass held, so a batched re-extraction is retried). Each stored layer, over all spot
  tokens at once, must lie within `validate.noise_margin` x the bf16 noise floor of its
  recomputation and within `validate.neighbour_fraction` x the distance to the nearest
  neighbouring layer (`spot_check_verdict`; docs/SPOT_CHECK.md). Stored tensors come from
  *batched* requests, so a batching or layer-offset bug shows up here.

The chunk-reading checks run chunk by chunk (hash, then schema, tokens and values while the
chunk is still in the page cache), so a shard larger than memory is read from disk once.
A failure raises `ValidationFailure` (a `PipelineError`) naming the shard, check, chunk and row.

`verify_all` re-runs only integrity and schema over every shard, for data copied between
machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import struct
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import psutil
import torch
from safetensors import safe_open
from tqdm import tqdm

from . import config as cfg
from . import shard_store
from .atomic import atomic_write_json
from .dump import dump_path, make_rid, read_dump, wait_for_dump
from .errors import PipelineError
from .fingerprint import hash_file
from .layers import CONVENTION, FINAL_CONVENTION, hf_hidden_state_index
from .run import RunSpec, TargetModel
from .shard_plan import parse_shard_name
from .workflow import validation_settings

CHECKS = ("integrity", "schema", "coverage", "values", "provenance", "spot_check")
LAYER_NAMES = ("aux_0", "aux_1", "aux_2", "final")
CHUNK_GLOB = "chunk-*.safetensors"
CHUNK_TENSORS = {
    "row_ids": "I64",
    "offsets": "I64",
    "input_ids": "I32",
    "loss_mask": "U8",
    "aux_hidden_states": "BF16",
    "final_hidden_states": "BF16",
}
HIDDEN_DTYPES = {"bfloat16": "BF16"}
# The dataset file's hash is not among them: a shard depends on its own rows only (the coverage
# check compares them with the prepared table), as the rerun policy decides per shard; an
# appended row must not fail the untouched shards that no command would re-extract.
PROVENANCE_FIELDS = (
    "model_config_hash",
    "tokenizer_fingerprint",
    "aux_layer_ids",
    "layer_convention",
    "final_convention",
)
# Hidden-state values are scanned in token blocks of about this many bytes, bounding memory.
_VALUE_BLOCK_BYTES = 64 << 20


class ValidationFailure(PipelineError):
    """A failed check: the message names the shard, the check, and where known chunk and row."""

    def __init__(
        self,
        shard: str,
        check: str,
        detail: str,
        chunk: str | None = None,
        row: int | None = None,
    ):
        where = f"shard {shard}"
        if chunk is not None:
            where += f", chunk {chunk}"
        if row is not None:
            where += f", row {row}"
        super().__init__(f"validation check {check} failed ({where}): {detail}")
        self.shard = shard
        self.check = check
        self.chunk = chunk
        self.row = row
        self.detail = detail

    @classmethod
    def in_chunk(cls, shard: str, check: str, detail: str, entry: dict) -> ValidationFailure:
        """A failure located at a manifest chunk entry (its file and first row)."""
        row = entry["row_ids"][0] if entry["row_ids"] else None
        return cls(shard, check, detail, chunk=entry["file"], row=row)


# --- manifest -----------------------------------------------------------------------------


def read_manifest(shard_dir: Path, shard: str) -> dict:
    """The shard's manifest (shape checked by the shard store); a bad one fails `schema`."""
    return read_manifest_and_hash(shard_dir, shard)[0]


def read_manifest_and_hash(shard_dir: Path, shard: str) -> tuple[dict, str]:
    """`read_manifest` and the hash of the bytes it parsed."""
    try:
        manifest, digest = shard_store.read_manifest_and_hash(shard_dir / shard_store.MANIFEST_NAME)
    except PipelineError as exc:
        raise ValidationFailure(shard, "schema", str(exc)) from None
    if manifest["shard"] != shard:
        raise ValidationFailure(
            shard, "schema", f"{shard_dir}/manifest.json describes shard {manifest['shard']!r}"
        )
    return manifest, digest


def _row_span(entry: dict) -> str:
    rows = entry["row_ids"]
    return f"rows {rows[0]}..{rows[-1]}" if rows else "no rows"


# --- integrity ----------------------------------------------------------------------------


def check_chunk_file(shard_dir: Path, shard: str, entry: dict) -> Path:
    """The listed chunk exists with its listed byte size."""
    path = shard_dir / entry["file"]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ValidationFailure.in_chunk(
            shard,
            "integrity",
            f"{path} is listed in the manifest ({_row_span(entry)}) but missing",
            entry,
        ) from None
    if size != entry["bytes"]:
        raise ValidationFailure.in_chunk(
            shard,
            "integrity",
            f"{path} has {size} bytes, the manifest lists {entry['bytes']} ({_row_span(entry)})",
            entry,
        )
    return path


def check_chunk_checksum(shard_dir: Path, shard: str, entry: dict) -> None:
    """The chunk re-hashes (xxh3-128, streamed) to the manifest's checksum."""
    path = shard_dir / entry["file"]
    digest = hash_file(path)
    if digest != entry["xxh3_128"]:
        raise ValidationFailure.in_chunk(
            shard,
            "integrity",
            f"{path} re-hashes to xxh3-128 {digest}, the manifest lists {entry['xxh3_128']} "
            f"(corrupt chunk holding {_row_span(entry)})",
            entry,
        )


def check_no_stray_chunks(shard_dir: Path, shard: str, manifest: dict) -> None:
    """No chunk file on disk that the manifest does not list (a leftover or a copy mistake)."""
    listed = {entry["file"] for entry in manifest["chunks"]}
    stray = sorted(p.name for p in shard_dir.glob(CHUNK_GLOB) if p.name not in listed)
    if stray:
        raise ValidationFailure(
            shard,
            "integrity",
            f"{shard_dir / stray[0]} is not listed in the manifest "
            f"({len(stray)} unlisted chunk file(s): {', '.join(stray[:5])})",
            chunk=stray[0],
        )


# --- schema -------------------------------------------------------------------------------


@contextlib.contextmanager
def open_chunk(shard_dir: Path, shard: str, entry: dict):
    """The chunk opened memory-mapped; a file safetensors cannot parse fails `schema`."""
    try:
        reader = safe_open(shard_dir / entry["file"], framework="pt")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ValidationFailure.in_chunk(
            shard,
            "schema",
            f"{shard_dir / entry['file']} is not a readable safetensors file: {exc}",
            entry,
        ) from None
    with reader:
        yield reader


@dataclass
class ChunkLayout:
    """What the schema check established about one chunk."""

    file: str
    row_ids: np.ndarray
    offsets: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def row_of_token(self, token: int) -> int:
        return int(self.row_ids[np.searchsorted(self.offsets, token, side="right") - 1])


def check_manifest_schema(shard: str, manifest: dict) -> None:
    """Totals and layer count in the manifest agree with its chunk list."""

    def fail(detail: str) -> None:
        raise ValidationFailure(shard, "schema", f"manifest.json: {detail}")

    planned = parse_shard_name(shard)
    if (manifest["row_start"], manifest["row_end"]) != (planned.start, planned.end):
        fail(
            f"row range [{manifest['row_start']}, {manifest['row_end']}) is not the shard's "
            f"planned [{planned.start}, {planned.end})"
        )
    chunks = manifest["chunks"]
    names = [entry["file"] for entry in chunks]
    expected_names = [f"chunk-{i:05d}.safetensors" for i in range(len(chunks))]
    if names != expected_names:
        fail(f"chunk files {names[:5]} are not numbered chunk-00000.safetensors onwards")
    if manifest["num_aux_layers"] != len(manifest["aux_layer_ids"]):
        fail(
            f"num_aux_layers {manifest['num_aux_layers']} != "
            f"{len(manifest['aux_layer_ids'])} aux_layer_ids"
        )
    if manifest["num_aux_layers"] != len(LAYER_NAMES) - 1:
        fail(f"num_aux_layers is {manifest['num_aux_layers']}, EAGLE-3 uses 3")
    if manifest["dtype"] not in HIDDEN_DTYPES:
        fail(f"dtype {manifest['dtype']!r} is not one of {sorted(HIDDEN_DTYPES)}")
    totals = {
        "num_rows": sum(len(entry["row_ids"]) for entry in chunks),
        "num_tokens": sum(entry["num_tokens"] for entry in chunks),
        "num_bytes": sum(entry["bytes"] for entry in chunks),
    }
    for key, total in totals.items():
        if manifest[key] != total:
            fail(f"{key} is {manifest[key]}, its chunks add up to {total}")


def check_chunk_schema(reader, shard: str, entry: dict, manifest: dict) -> ChunkLayout:
    """Tensor names, dtypes and shapes of an open chunk agree with its offsets and manifest."""
    chunk = entry["file"]
    first_row = entry["row_ids"][0] if entry["row_ids"] else None

    def fail(detail: str, row: int | None = first_row) -> None:
        raise ValidationFailure(shard, "schema", detail, chunk=chunk, row=row)

    names = set(reader.keys())
    if names != set(CHUNK_TENSORS):
        fail(
            f"tensors {sorted(names)}; expected {sorted(CHUNK_TENSORS)} "
            f"(missing {sorted(set(CHUNK_TENSORS) - names)}, "
            f"extra {sorted(names - set(CHUNK_TENSORS))})"
        )
    expected_dtypes = dict(CHUNK_TENSORS)
    hidden_dtype = HIDDEN_DTYPES[manifest["dtype"]]
    expected_dtypes["aux_hidden_states"] = expected_dtypes["final_hidden_states"] = hidden_dtype
    shapes = {}
    for name, dtype in expected_dtypes.items():
        tensor_slice = reader.get_slice(name)
        if tensor_slice.get_dtype() != dtype:
            fail(f"tensor {name} has dtype {tensor_slice.get_dtype()}, expected {dtype}")
        shapes[name] = list(tensor_slice.get_shape())

    num_rows = len(entry["row_ids"])
    hidden = manifest["hidden_size"]
    aux_width = manifest["num_aux_layers"] * hidden
    if shapes["row_ids"] != [num_rows]:
        fail(f"row_ids has shape {shapes['row_ids']}, the manifest lists {num_rows} rows")
    if shapes["offsets"] != [num_rows + 1]:
        fail(f"offsets has shape {shapes['offsets']}, expected [{num_rows + 1}]")
    row_ids = reader.get_tensor("row_ids").numpy()
    if row_ids.tolist() != list(entry["row_ids"]):
        position = next(
            (
                i
                for i, (a, b) in enumerate(zip(row_ids.tolist(), entry["row_ids"], strict=True))
                if a != b
            ),
            0,
        )
        fail(
            f"row_ids tensor holds row {int(row_ids[position])} at position {position}, "
            f"the manifest lists row {entry['row_ids'][position]}",
            row=int(entry["row_ids"][position]),
        )
    offsets = reader.get_tensor("offsets").numpy()
    if offsets[0] != 0:
        fail(f"offsets start at {int(offsets[0])}, not 0")
    lengths = np.diff(offsets)
    if (lengths <= 0).any():
        position = int(np.argmax(lengths <= 0))
        fail(
            f"offsets give row {int(row_ids[position])} {int(lengths[position])} tokens",
            row=int(row_ids[position]),
        )
    tokens = int(offsets[-1])
    if tokens != entry["num_tokens"]:
        fail(f"offsets end at {tokens} tokens, the manifest lists {entry['num_tokens']}")
    expected_shapes = {
        "input_ids": [tokens],
        "loss_mask": [tokens],
        "aux_hidden_states": [tokens, aux_width],
        "final_hidden_states": [tokens, hidden],
    }
    for name, shape in expected_shapes.items():
        if shapes[name] != shape:
            fail(
                f"tensor {name} has shape {shapes[name]}, expected {shape} "
                f"({tokens} tokens, hidden size {hidden}, {manifest['num_aux_layers']} aux layers)"
            )
    return ChunkLayout(chunk, row_ids, offsets)


# --- coverage -----------------------------------------------------------------------------


@dataclass
class PreparedRows:
    """The prepared table's rows of one shard, and what prepare skipped in its range."""

    token_ids: dict[int, np.ndarray]
    loss_masks: dict[int, np.ndarray]
    skipped: dict[int, str]


def load_prepared_rows(table_path: Path, skipped_path: Path, start: int, end: int) -> PreparedRows:
    """Rows `start <= row_id < end` of the prepared table, plus prepare's skip record."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(
            table_path,
            columns=["row_id", "input_ids", "loss_mask"],
            filters=[("row_id", ">=", start), ("row_id", "<", end)],
        )
    except FileNotFoundError:
        raise PipelineError(f"prepared table {table_path} does not exist: run prepare") from None
    row_ids = table.column("row_id").to_numpy()
    token_ids, loss_masks = {}, {}
    for name, into, dtype in (
        ("input_ids", token_ids, np.int32),
        ("loss_mask", loss_masks, np.uint8),
    ):
        column = table.column(name).combine_chunks()
        flat = column.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        bounds = column.offsets.to_numpy()
        for i, row in enumerate(row_ids.tolist()):
            into[row] = flat[bounds[i] : bounds[i + 1]]
    skipped = {}
    if skipped_path.exists():
        record = json.loads(skipped_path.read_text())
        for item in record.get("rows", []):
            if start <= item["row_id"] < end:
                skipped[int(item["row_id"])] = str(item.get("reason", "skipped"))
    return PreparedRows(token_ids, loss_masks, skipped)


def check_coverage_rows(shard: str, manifest: dict, prepared: PreparedRows) -> dict:
    """Row ids: the planned range minus prepare's skipped and absent rows, once each, in order."""
    start, end = manifest["row_start"], manifest["row_end"]
    seen: dict[int, str] = {}
    previous = None
    for entry in manifest["chunks"]:
        for row in entry["row_ids"]:
            if row in seen:
                raise ValidationFailure(
                    shard,
                    "coverage",
                    f"row {row} appears twice ({seen[row]} and {entry['file']})",
                    chunk=entry["file"],
                    row=row,
                )
            seen[row] = entry["file"]
            if not start <= row < end:
                raise ValidationFailure(
                    shard,
                    "coverage",
                    f"row {row} lies outside the planned range [{start}, {end})",
                    chunk=entry["file"],
                    row=row,
                )
            if row in prepared.skipped:
                raise ValidationFailure(
                    shard,
                    "coverage",
                    f"row {row} was skipped by prepare ({prepared.skipped[row]}) but is stored",
                    chunk=entry["file"],
                    row=row,
                )
            if row not in prepared.token_ids:
                raise ValidationFailure(
                    shard,
                    "coverage",
                    f"row {row} is stored but absent from the prepared table",
                    chunk=entry["file"],
                    row=row,
                )
            if previous is not None and row < previous:
                raise ValidationFailure(
                    shard,
                    "coverage",
                    f"rows out of row-id order: row {row} after row {previous}",
                    chunk=entry["file"],
                    row=row,
                )
            previous = row
    expected = sorted(set(prepared.token_ids) - set(prepared.skipped))
    missing = [row for row in expected if row not in seen]
    if missing:
        raise ValidationFailure(
            shard,
            "coverage",
            f"row {missing[0]} of the prepared table is not stored "
            f"({len(missing)} missing row(s): {missing[:10]})",
            row=missing[0],
        )
    planned = end - start
    return {
        "ok": True,
        "planned_range": [start, end],
        "rows": len(seen),
        "skipped_rows": len(prepared.skipped),
        "absent_rows": planned - len(seen) - len(prepared.skipped),
    }


def check_chunk_tokens(reader, shard: str, layout: ChunkLayout, prepared: PreparedRows) -> None:
    """The chunk's input ids and loss masks equal the prepared table's, row by row."""
    for name, table in (("input_ids", prepared.token_ids), ("loss_mask", prepared.loss_masks)):
        stored = reader.get_tensor(name).numpy()
        expected_parts = [table[int(row)] for row in layout.row_ids]
        lengths = np.array([len(part) for part in expected_parts])
        stored_lengths = np.diff(layout.offsets)
        if not np.array_equal(lengths, stored_lengths):
            i = int(np.argmax(lengths != stored_lengths))
            raise ValidationFailure(
                shard,
                "coverage",
                f"row {int(layout.row_ids[i])} has {int(stored_lengths[i])} tokens stored, "
                f"the prepared table has {int(lengths[i])}",
                chunk=layout.file,
                row=int(layout.row_ids[i]),
            )
        expected = np.concatenate(expected_parts) if expected_parts else stored[:0]
        differ = stored != expected
        if differ.any():
            token = int(np.argmax(differ))
            row = layout.row_of_token(token)
            position = token - int(layout.offsets[list(layout.row_ids).index(row)])
            raise ValidationFailure(
                shard,
                "coverage",
                f"{name} of row {row} differs from the prepared table at token {position} "
                f"(stored {int(stored[token])}, prepared {int(expected[token])})",
                chunk=layout.file,
                row=row,
            )


# --- values -------------------------------------------------------------------------------


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


def _layer_label(index: int, aux_layer_ids: list[int]) -> str:
    if index < len(aux_layer_ids):
        return f"aux_{index} (decoder layer {aux_layer_ids[index]} output)"
    return "final (post-norm)"


def map_hidden_states(path: Path) -> dict[str, np.ndarray]:
    """Zero-copy views of a chunk's hidden states as raw bf16 bit patterns (int16), mmapped.

    `safe_open(...).get_slice` copies into freshly allocated memory, and faulting in fresh pages
    costs more than the reductions themselves; a copy-on-write map reads straight from the page
    cache. The header layout is the safetensors format's (little-endian u64 length, JSON);
    `check_chunk_schema` has already checked names, dtypes and shapes through safetensors.
    """
    with open(path, "rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    views = {}
    for name in ("aux_hidden_states", "final_hidden_states"):
        begin, end = header[name]["data_offsets"]
        shape = tuple(header[name]["shape"])
        if end == begin:
            views[name] = np.empty(shape, np.int16)
            continue
        views[name] = np.memmap(path, np.int16, mode="c", offset=data_start + begin, shape=shape)
    return views


_BF16_EXPONENT = 0x7F80


def _bf16_value(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16).item()


def _token_reductions(path: Path, layout: ChunkLayout, stats: ValueStats):
    """Per token and layer: min and max bit pattern, and the L2 norm, in bounded token blocks.

    Equal min and max bit patterns mean equal values, so integer reductions (several GB/s in
    numpy) decide constancy; the norm runs on bf16 directly (torch accumulates in fp32) since
    converting to fp32 first would cost more than everything else together. A NaN or inf
    makes the norm non-finite, so the norm also screens for non-finite values.
    """
    hidden, aux_layers = stats.hidden_size, stats.num_aux_layers
    tokens = layout.num_tokens
    layers = aux_layers + 1
    block = max(1, _VALUE_BLOCK_BYTES // (layers * hidden * 2))
    token_min = np.empty((tokens, layers), np.int16)
    token_max = np.empty((tokens, layers), np.int16)
    token_norm = np.empty((tokens, layers), np.float32)
    mapped = map_hidden_states(path)
    aux_all = mapped["aux_hidden_states"].reshape(tokens, aux_layers, hidden)
    final_all = mapped["final_hidden_states"].reshape(tokens, 1, hidden)
    for a in range(0, tokens, block):
        b = min(tokens, a + block)
        for bits, cols in (
            (aux_all[a:b], slice(0, aux_layers)),
            (final_all[a:b], slice(aux_layers, layers)),
        ):
            token_min[a:b, cols] = bits.min(-1)
            token_max[a:b, cols] = bits.max(-1)
            values = torch.from_numpy(bits).view(torch.bfloat16)
            token_norm[a:b, cols] = torch.linalg.vector_norm(values, dim=-1).float().numpy()
    return token_min, token_max, token_norm, aux_all, final_all


def check_chunk_values(
    path: Path, shard: str, layout: ChunkLayout, stats: ValueStats, aux_layer_ids: list[int]
) -> None:
    """All finite; no row's slice of any layer all zero or constant; accumulate norms."""
    token_min, token_max, token_norm, aux_bits, final_bits = _token_reductions(path, layout, stats)
    row_start = dict(zip(layout.row_ids.tolist(), layout.offsets[:-1].tolist(), strict=True))

    def fail(detail: str, token: int, layer: int) -> None:
        row = layout.row_of_token(token)
        raise ValidationFailure(
            shard,
            "values",
            f"{detail} in {_layer_label(layer, aux_layer_ids)} at token {token - row_start[row]}",
            chunk=layout.file,
            row=row,
        )

    overflow = ~np.isfinite(token_norm)
    if overflow.any():
        token, layer = (int(i) for i in np.argwhere(overflow)[0])
        bits = aux_bits[token, layer] if layer < len(aux_layer_ids) else final_bits[token, 0]
        if ((bits & _BF16_EXPONENT) == _BF16_EXPONENT).any():
            fail("non-finite hidden state (NaN or inf)", token, layer)
        fail("hidden state too large (its L2 norm overflows fp32)", token, layer)

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
            f"hidden states of {_layer_label(layer, aux_layer_ids)} are {what} "
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
    return {
        **key,
        "compute_dtype": compute_dtype,
        "dtype": manifest["dtype"],
        "hidden_size": manifest["hidden_size"],
    }


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
                f"mean L2 norm of {_layer_label(index, aux_layer_ids)} is {means[name]:.4g}, "
                f"{ratio:.3g}x that of reference shard {reference['shard']} ({ref:.4g}); "
                f"validate.norm_drift_factor allows {factor:g}x",
            )
    result["norm_ratio_to_reference"] = ratios
    return result


# --- provenance ---------------------------------------------------------------------------


def expected_provenance(run: RunSpec, summary_path: Path = cfg.PREPARED_SUMMARY) -> dict:
    """The provenance the current configuration would give a freshly extracted shard."""
    try:
        summary = json.loads(Path(summary_path).read_text())
    except FileNotFoundError:
        raise PipelineError(
            f"prepared summary {summary_path} does not exist: run prepare"
        ) from None
    summary_provenance = summary.get("provenance", summary)
    model = run.model
    if model.has_tokenizer:
        tokenizer = model.tokenizer_fingerprint
    else:
        tokenizer = summary_provenance.get("tokenizer_fingerprint")
    return {
        "model_config_hash": model.config_hash,
        "tokenizer_fingerprint": tokenizer,
        "aux_layer_ids": run.aux_layer_ids,
        "layer_convention": CONVENTION,
        "final_convention": FINAL_CONVENTION,
    }


def check_provenance(shard: str, manifest: dict, expected: dict) -> dict:
    """Every provenance field equals the current configuration's, naming the first that differs."""
    recorded = dict(manifest["provenance"])
    stored_ids = manifest["aux_layer_ids"]
    if stored_ids != recorded.get("aux_layer_ids"):
        raise ValidationFailure(
            shard,
            "provenance",
            f"manifest aux_layer_ids {stored_ids} disagree with its provenance.aux_layer_ids "
            f"{recorded.get('aux_layer_ids')}",
        )
    for name in PROVENANCE_FIELDS:
        if recorded.get(name) != expected[name]:
            raise ValidationFailure(
                shard,
                "provenance",
                f"field {name} is {recorded.get(name)!r} in the manifest but {expected[name]!r} "
                "for the current configuration (the shard was made from another "
                f"{'layer set' if name == 'aux_layer_ids' else 'model or tokenizer'}; "
                "re-extract it)",
            )
    return {"ok": True, "fields": list(PROVENANCE_FIELDS)}


# --- spot check ---------------------------------------------------------------------------
#
# The rule (docs/SPOT_CHECK.md). Per captured layer, pooled over every spot-check token, the
# relative L2 error of the stored tensor against a recomputation of the same tokens must be
#   noise:      at most `validate.noise_margin` times the bf16 noise floor of those tokens (how
#               far transformers' own bf16 forward lands from its fp32 forward), and
#   neighbour:  at most `validate.neighbour_fraction` times the distance from the recomputed
#               layer to its nearest neighbouring layer (a wrong layer is at least that far off).
# Whole tensors, not per-token percentiles: bf16 noise flips some tokens' MoE expert choice, so
# correct data has per-token tails of 0.2-0.3 on MoE targets, while a layer shifted by one is off
# by the neighbour distance (0.3-1.0 on the H200 runs) over the whole tensor.

DEFAULT_NOISE_MARGIN = 3.0
DEFAULT_NEIGHBOUR_FRACTION = 0.5
# Re-extractions of one row when the server batched it with a foreign request (e.g. SGLang's own
# /health probe, which runs a one-token generate) before the batched guard fails the check.
REEXTRACT_ATTEMPTS = 3


def rel_l2(values: torch.Tensor, reference: torch.Tensor) -> float:
    """Whole-tensor relative L2 distance ||values - reference|| / ||reference|| (float64, on
    the reference's device)."""
    values, reference = values.to(reference.device).double(), reference.double()
    norm = torch.linalg.vector_norm(reference).item()
    return torch.linalg.vector_norm(values - reference).item() / max(norm, 1e-300)


def token_rel_l2(values: torch.Tensor, reference: torch.Tensor) -> np.ndarray:
    """Per-token (last dimension) relative L2 distance: the MoE routing-flip tails show here."""
    values, reference = values.to(reference.device).double(), reference.double()
    diff = torch.linalg.vector_norm(values - reference, dim=-1)
    return (diff / torch.linalg.vector_norm(reference, dim=-1).clamp_min(1e-300)).cpu().numpy()


@dataclass(frozen=True)
class SpotVerdict:
    """One captured layer judged against a recomputation of the same tokens (see module notes)."""

    rel_l2: float
    noise_floor: float | None
    noise_bound: float | None
    neighbour_rel_l2: float | None
    neighbour_bound: float | None
    tokens: int
    token_rel_l2_p99: float
    token_rel_l2_max: float
    worst_token: int

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """Each bound the layer breaks, as a phrase naming the bound and its parts."""
        broken = []
        if self.noise_bound is not None and self.rel_l2 > self.noise_bound:
            broken.append(
                f"above the noise bound {self.noise_bound:.4g} "
                f"(noise margin x bf16 floor {self.noise_floor:.4g})"
            )
        if self.neighbour_bound is not None and self.rel_l2 > self.neighbour_bound:
            broken.append(
                f"above the neighbour bound {self.neighbour_bound:.4g} "
                f"(neighbour fraction x distance {self.neighbour_rel_l2:.4g} to the nearest "
                "neighbouring layer)"
            )
        return broken

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "rel_l2": self.rel_l2,
            "noise_floor": self.noise_floor,
            "noise_bound": self.noise_bound,
            "neighbour_rel_l2": self.neighbour_rel_l2,
            "neighbour_bound": self.neighbour_bound,
            "tokens": self.tokens,
            "rel_l2_p99": self.token_rel_l2_p99,
            "rel_l2_max": self.token_rel_l2_max,
            "worst_token": self.worst_token,
        }


def spot_check_verdict(
    stored: torch.Tensor,
    reference: torch.Tensor,
    neighbours: Sequence[torch.Tensor] = (),
    floor: float | None = None,
    *,
    noise_margin: float = DEFAULT_NOISE_MARGIN,
    neighbour_fraction: float = DEFAULT_NEIGHBOUR_FRACTION,
) -> SpotVerdict:
    """Judge `stored` ([T, H], the dumped layer) against `reference` (the same tokens recomputed).

    `neighbours`: the recomputation's adjacent layers of the same tokens; `floor`: the bf16 noise
    floor of these tokens, e.g. `rel_l2(bf16_forward_layer, fp32_forward_layer)`. Each given one
    adds its bound; at least one is needed. For GPU fidelity scripts as much as for validation:
    tensors may live on any device (the distances are taken on the reference's).
    """
    if floor is None and not neighbours:
        raise ValueError("spot_check_verdict needs a noise floor, neighbouring layers, or both")
    if stored.shape != reference.shape:
        raise ValueError(f"stored {list(stored.shape)} and reference {list(reference.shape)}")
    per_token = token_rel_l2(stored, reference)
    distances = [rel_l2(n, reference) for n in neighbours]
    nearest = min(distances) if distances else None
    return SpotVerdict(
        rel_l2=rel_l2(stored, reference),
        noise_floor=floor,
        noise_bound=None if floor is None else noise_margin * floor,
        neighbour_rel_l2=nearest,
        neighbour_bound=None if nearest is None else neighbour_fraction * nearest,
        tokens=len(per_token),
        token_rel_l2_p99=float(np.percentile(per_token, 99)) if len(per_token) else 0.0,
        token_rel_l2_max=float(per_token.max()) if len(per_token) else 0.0,
        worst_token=int(per_token.argmax()) if len(per_token) else 0,
    )


@dataclass
class LayerReference:
    """A recomputation of one captured layer over the spot-check tokens, and its yardsticks."""

    values: torch.Tensor  # [T, H]
    neighbours: list[torch.Tensor]  # the same computation's adjacent layers, [T, H] each
    floor: float | None  # bf16 noise floor of these tokens
    floor_source: str


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """[T, H] from [T, H] or an unpadded [B, T, H] (tokens of all rows in order), float32."""
    return tensor.reshape(-1, tensor.shape[-1]).float()


def hf_layer_references(
    fp32_states, bf16_states, aux_layer_ids: list[int], num_layers: int | None = None
) -> dict[str, LayerReference]:
    """References for the four captured slots from transformers' `output_hidden_states`.

    `fp32_states` / `bf16_states`: the same tokens through an fp32 and a bf16 forward, indexed
    like `hidden_states` (0 = embeddings, k + 1 = output of decoder layer k, `num_layers` =
    post-norm final); a tuple or a dict holding at least the indices used. Aux id k is judged
    against index k + 1 with neighbours k and k + 2 (pre-norm states only); the final state
    against index L with neighbour L - 1 (the previous layer's output). The floor of each slot is
    its bf16-vs-fp32 distance.
    """
    last = len(fp32_states) - 1 if num_layers is None else num_layers
    slots = [(hf_hidden_state_index(k), [k, k + 2]) for k in aux_layer_ids] + [(last, [last - 1])]
    references = {}
    for name, (index, around) in zip(LAYER_NAMES, slots, strict=True):
        values = _flat(fp32_states[index])
        neighbours = [_flat(fp32_states[j]) for j in around if 0 <= j < last]
        references[name] = LayerReference(
            values,
            neighbours,
            rel_l2(_flat(bf16_states[index]), values),
            "measured: transformers bf16 forward vs fp32 on the same tokens",
        )
    return references


@dataclass
class StoredRow:
    row_id: int
    chunk: str
    input_ids: list[int]
    aux: torch.Tensor  # [T, 3H] float32
    final: torch.Tensor  # [T, H] float32


def pick_spot_rows(row_ids: list[int], count: int, seed: int, shard: str) -> list[int]:
    """`count` rows chosen by a generator seeded with the config seed and the shard name."""
    rng = random.Random(f"{seed}:{shard}")
    return sorted(rng.sample(sorted(row_ids), min(count, len(row_ids))))


def read_stored_rows(shard_dir: Path, manifest: dict, rows: list[int]) -> list[StoredRow]:
    wanted = set(rows)
    found = []
    for entry in manifest["chunks"]:
        hits = [i for i, row in enumerate(entry["row_ids"]) if row in wanted]
        if not hits:
            continue
        with safe_open(shard_dir / entry["file"], framework="pt") as reader:
            offsets = reader.get_tensor("offsets").tolist()
            ids = reader.get_slice("input_ids")
            aux = reader.get_slice("aux_hidden_states")
            final = reader.get_slice("final_hidden_states")
            for i in hits:
                a, b = offsets[i], offsets[i + 1]
                found.append(
                    StoredRow(
                        entry["row_ids"][i],
                        entry["file"],
                        ids[a:b].tolist(),
                        aux[a:b].float(),
                        final[a:b].float(),
                    )
                )
    return found


def split_layers(aux: torch.Tensor, final: torch.Tensor, hidden: int) -> list[torch.Tensor]:
    """[aux_0, aux_1, aux_2, final], each [T, H], from packed aux [T, 3H] and final [T, H]."""
    return [*aux.view(aux.shape[0], -1, hidden).unbind(1), final]


def _stored_slot(rows: list[StoredRow], index: int, hidden: int) -> torch.Tensor:
    return torch.cat([split_layers(r.aux, r.final, hidden)[index] for r in rows])


def judge_layers(
    shard: str,
    source: str,
    stored_rows: list[StoredRow],
    references: dict[str, LayerReference],
    hidden: int,
    aux_layer_ids: list[int],
    settings: dict,
) -> dict:
    """Every slot's verdict over the spot-check rows; the first failing slot fails the check,
    naming the row that disagrees most."""
    per_layer: dict[str, dict] = {}
    for index, name in enumerate(LAYER_NAMES):
        reference = references[name]
        stored = _stored_slot(stored_rows, index, hidden)
        verdict = spot_check_verdict(
            stored,
            reference.values,
            reference.neighbours,
            reference.floor,
            noise_margin=settings.noise_margin,
            neighbour_fraction=settings.neighbour_fraction,
        )
        per_layer[name] = {**verdict.as_dict(), "floor_source": reference.floor_source}
        if verdict.ok:
            continue
        bounds = np.cumsum([0] + [len(r.input_ids) for r in stored_rows])
        by_row = [
            rel_l2(stored[a:b], reference.values[a:b])
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        worst = stored_rows[int(np.argmax(by_row))]
        raise ValidationFailure(
            shard,
            "spot_check",
            f"stored {_layer_label(index, aux_layer_ids)} disagrees with {source}: relative L2 "
            f"{verdict.rel_l2:.4g} over {verdict.tokens} tokens, "
            f"{' and '.join(verdict.failures())}; worst row {worst.row_id} "
            f"(relative L2 {max(by_row):.4g}). A batching or layer-offset bug in extraction "
            "gives exactly this",
            chunk=worst.chunk,
            row=worst.row_id,
        )
    return per_layer


def new_nonce() -> str:
    return os.urandom(6).hex()


# Requests go straight to the local server, never through an http_proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _post_json(url: str, payload: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with _DIRECT.open(request, timeout=timeout) as response:
        return json.loads(response.read())


def _reextract_alone(handle, shard: str, row: StoredRow, prefix: str, nonce: str, timeout: float):
    """Row `row` through the server until a pass computed it alone: (aux, final, attempts).

    Whether it was alone is read from the dump itself (`batch_requests`, written by the dump
    writer of either engine), not from the HTTP answer, which SGLang does not annotate.
    """
    batched = []
    for attempt in range(REEXTRACT_ATTEMPTS):
        rid = make_rid(prefix, nonce, row.row_id, attempt)
        payload = {"input_ids": row.input_ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
        dump = dump_path(handle.dump_dir, rid)
        try:
            _post_json(f"{handle.url}/generate", payload, timeout)
            wait_for_dump(dump)
            aux, final, meta = read_dump(dump)
        except (urllib.error.URLError, OSError, TimeoutError, ValueError) as exc:
            raise ValidationFailure(
                shard,
                "spot_check",
                f"re-extraction request {rid} to {handle.url} failed: {exc}",
                chunk=row.chunk,
                row=row.row_id,
            ) from None
        except PipelineError as exc:
            raise ValidationFailure(
                shard, "spot_check", f"re-extraction {rid}: {exc}", chunk=row.chunk, row=row.row_id
            ) from None
        finally:
            dump.unlink(missing_ok=True)
        if meta["batch_requests"] == 1:
            return aux.float(), final.float(), attempt + 1
        batched.append(f"{meta['batch_requests']} requests / {meta['batch_tokens']} tokens")
    # The comparison is only meaningful for a request computed alone.
    raise ValidationFailure(
        shard,
        "spot_check",
        f"each of {REEXTRACT_ATTEMPTS} re-extractions of row {row.row_id} shared its forward pass "
        f"with other requests ({'; '.join(batched)}) despite the exclusive lease: the server at "
        f"{handle.url} has traffic from outside the pipeline",
        chunk=row.chunk,
        row=row.row_id,
    )


def reextract_through(
    handle,
    shard: str,
    stored_rows: list[StoredRow],
    *,
    prefix: str,
    timeout: float,
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """Each row sent alone through the server behind `handle` (url, dump_dir, info); its
    complete dump read back. The caller holds the server exclusively."""
    fresh = {}
    attempts = []
    nonce = new_nonce()
    for row in stored_rows:
        aux, final, tries = _reextract_alone(handle, shard, row, prefix, nonce, timeout)
        if aux.shape != row.aux.shape or final.shape != row.final.shape:
            raise ValidationFailure(
                shard,
                "spot_check",
                f"re-extraction of row {row.row_id} returned aux {list(aux.shape)} / final "
                f"{list(final.shape)}, stored aux {list(row.aux.shape)} / final "
                f"{list(row.final.shape)}",
                chunk=row.chunk,
                row=row.row_id,
            )
        fresh[row.row_id] = (aux, final)
        attempts.append(tries)
    info = {
        "url": handle.url,
        "engine": handle.info.get("engine"),
        "engine_version": handle.info.get("engine_version"),
        "nonce": nonce,
        # Requests in the forward pass of each accepted re-extraction (from its dump): all 1.
        "batch_sizes": [1] * len(stored_rows),
        "attempts": attempts,
    }
    return fresh, info


def reextract_rows(
    run: RunSpec, shard: str, stored_rows: list[StoredRow], hidden: int, aux_layer_ids: list[int]
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """The rows re-extracted one at a time under an exclusive lease of the pipeline's server."""
    from .server.lifecycle import server_lease

    with server_lease(run, exclusive=True) as handle:
        served = (handle.info.get("aux_layer_ids"), handle.info.get("hidden_size"))
        if served != (aux_layer_ids, hidden):
            raise ValidationFailure(
                shard,
                "spot_check",
                f"the server at {handle.url} captures layers {served[0]} at hidden size "
                f"{served[1]}, the shard holds layers {aux_layer_ids} at {hidden}",
            )
        return reextract_through(
            handle,
            shard,
            stored_rows,
            prefix=run.extract.request_prefix,
            timeout=run.extract.request_timeout_s,
        )


def model_fp32_bytes(model: TargetModel) -> int:
    """Parameter bytes of the model loaded in fp32, estimated from its weight files."""
    model_dir = model.directory
    model_config = model.text_config
    stored_dtype = str(model_config.get("torch_dtype") or model_config.get("dtype") or "float32")
    width = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}.get(stored_dtype, 2)
    weights = sum(
        p.stat().st_size
        for pattern in ("*.safetensors", "*.bin", "*.pt")
        for p in model_dir.glob(pattern)
    )
    return weights * 4 // width


def independent_forward_fits(model: TargetModel) -> tuple[bool, str]:
    """Whether an fp32 CPU forward leaves ample memory: weights at most a quarter of free RAM."""
    need = model_fp32_bytes(model)
    available = psutil.virtual_memory().available
    reason = (
        f"model needs ~{shard_store.format_bytes(need)} in fp32, "
        f"{shard_store.format_bytes(available)} available"
    )
    return need * 4 <= available, reason


def _hidden_states_at(model, stored_rows: list[StoredRow], indices: set[int]) -> dict:
    """{hidden-state index: the rows' states there, concatenated over tokens}."""
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in indices}
    with torch.inference_mode():
        for row in stored_rows:
            states = model(torch.tensor([row.input_ids]), output_hidden_states=True).hidden_states
            for i in indices:
                parts[i].append(states[i][0].float())
    return {i: torch.cat(tensors) for i, tensors in parts.items()}


def independent_forward(
    run: RunSpec, stored_rows: list[StoredRow], aux_layer_ids: list[int]
) -> dict[str, LayerReference]:
    """The rows through plain transformers forwards on CPU, fp32 then bf16 (the noise floor).

    Only the hidden states the four slots and their neighbours need are kept.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        run.model.directory,
        dtype=torch.float32,
        trust_remote_code=run.model.trust_remote_code,
    )
    model.eval()
    last = run.model.num_layers
    indices = {last - 1, last}
    for k in aux_layer_ids:
        indices |= {j for j in (k, k + 1, k + 2) if j <= last}
    fp32 = _hidden_states_at(model, stored_rows, indices)
    model.to(torch.bfloat16)
    bf16 = _hidden_states_at(model, stored_rows, indices)
    return hf_layer_references(fp32, bf16, aux_layer_ids, num_layers=last)


def _server_references(
    stored_rows: list[StoredRow],
    fresh: dict[int, tuple[torch.Tensor, torch.Tensor]],
    hidden: int,
    independent: dict[str, LayerReference] | None,
    assumed_floor: float,
) -> dict[str, LayerReference]:
    """The re-extracted rows as references. The yardsticks come from the independent forward
    of the same tokens when it ran; otherwise the floor is `validate.server_noise_floor` and
    there is no neighbour test (the server captures only the configured layers)."""
    references = {}
    for index, name in enumerate(LAYER_NAMES):
        values = torch.cat([split_layers(*fresh[r.row_id], hidden)[index] for r in stored_rows])
        if independent is not None:
            measured = independent[name]
            references[name] = LayerReference(
                values, measured.neighbours, measured.floor, measured.floor_source
            )
        else:
            references[name] = LayerReference(
                values, [], assumed_floor, "assumed: validate.server_noise_floor"
            )
    return references


def _run_independent_forward(run, stored_rows, aux_ids, log) -> tuple[dict | None, dict]:
    """The independent references and what the report says about them (ran, or why not)."""
    if not run.validate.independent_forward:
        return None, {"ran": False, "reason": "validate.independent_forward is false"}
    fits, reason = independent_forward_fits(run.model)
    if not fits:
        return None, {"ran": False, "reason": reason}
    log(f"spot check: independent transformers forwards (fp32, bf16) on CPU ({reason})")
    try:
        return independent_forward(run, stored_rows, aux_ids), {"ran": True}
    except (OSError, ValueError, ImportError, KeyError, RuntimeError) as exc:
        # The server runs the model; transformers may not (e.g. an engine-only architecture).
        # That weakens the check, so it is said out loud and recorded, never silently skipped.
        reason = f"transformers could not run the model: {type(exc).__name__}: {exc}"
        print(f"warning: independent forward skipped: {reason}", file=sys.stderr)
        return None, {"ran": False, "reason": reason}


def check_spot(run: RunSpec, shard: str, shard_dir: Path, manifest: dict, log) -> dict:
    """Seeded random rows recomputed independently where the target fits, and re-extracted
    alone through the server; each stored layer judged against both (see the rule above)."""
    settings = run.validate
    all_rows = [row for entry in manifest["chunks"] for row in entry["row_ids"]]
    rows = pick_spot_rows(all_rows, settings.spot_check_rows, settings.seed, shard)
    if not rows:
        return {"ok": True, "rows": [], "note": "validate.spot_check_rows is 0: nothing checked"}
    hidden, aux_ids = manifest["hidden_size"], manifest["aux_layer_ids"]
    stored_rows = read_stored_rows(shard_dir, manifest, rows)
    # Before the exclusive lease: the CPU forwards need no server and must not hold it up.
    independent, independent_report = _run_independent_forward(run, stored_rows, aux_ids, log)
    if independent is not None:
        independent_report["layers"] = judge_layers(
            shard,
            "independent transformers fp32 forwards on CPU",
            stored_rows,
            independent,
            hidden,
            aux_ids,
            settings,
        )
    log(f"spot check: re-extracting rows {rows} one at a time through the server")
    fresh, server = reextract_rows(run, shard, stored_rows, hidden, aux_ids)
    references = _server_references(
        stored_rows, fresh, hidden, independent, settings.server_noise_floor
    )
    return {
        "ok": True,
        "rows": rows,
        "tokens": sum(len(r.input_ids) for r in stored_rows),
        "server": server,
        "reextract": judge_layers(
            shard,
            "re-extraction of the row alone through the server",
            stored_rows,
            references,
            hidden,
            aux_ids,
            settings,
        ),
        "independent_forward": independent_report,
    }


# --- the gate -----------------------------------------------------------------------------


@dataclass
class ShardPaths:
    hidden_states_dir: Path = cfg.HIDDEN_STATES_DIR
    validated_dir: Path = cfg.VALIDATED_DIR
    prepared_table: Path = cfg.PREPARED_TABLE
    prepared_skipped: Path = cfg.PREPARED_SKIPPED
    prepared_summary: Path = cfg.PREPARED_SUMMARY


def _printer(progress: bool) -> Callable[[str], None]:
    def log(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    return log


def validate_shard(
    run: RunSpec, shard: str, paths: ShardPaths | None = None, progress: bool = True
) -> dict:
    """Run every check on `shard`; write its report atomically only if all pass, and return it."""
    paths = paths or ShardPaths()
    parse_shard_name(shard)
    shard_dir = Path(paths.hidden_states_dir) / shard
    report_path = Path(paths.validated_dir) / f"{shard}.json"
    # A stale pass must not outlive a validation that is now running (and may fail).
    report_path.unlink(missing_ok=True)
    log = _printer(progress)
    began = time.monotonic()

    # The report records the hash of the very bytes checked: no window in which the manifest
    # could be replaced between hashing and reading.
    manifest, manifest_hash = read_manifest_and_hash(shard_dir, shard)
    checks: dict[str, dict] = {}
    checks["provenance"] = check_provenance(
        shard, manifest, expected_provenance(run, paths.prepared_summary)
    )
    check_manifest_schema(shard, manifest)
    prepared = load_prepared_rows(
        paths.prepared_table, paths.prepared_skipped, manifest["row_start"], manifest["row_end"]
    )
    checks["coverage"] = check_coverage_rows(shard, manifest, prepared)
    for entry in manifest["chunks"]:
        check_chunk_file(shard_dir, shard, entry)
    check_no_stray_chunks(shard_dir, shard, manifest)

    stats = ValueStats(manifest["hidden_size"], manifest["num_aux_layers"])
    hashed_seconds = 0.0
    total = manifest["num_bytes"]
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"validate {shard}",
        disable=not progress,
        file=sys.stderr,
        mininterval=1.0,
    ) as bar:
        for entry in manifest["chunks"]:
            t0 = time.monotonic()
            check_chunk_checksum(shard_dir, shard, entry)
            hashed_seconds += time.monotonic() - t0
            with open_chunk(shard_dir, shard, entry) as reader:
                layout = check_chunk_schema(reader, shard, entry, manifest)
                check_chunk_tokens(reader, shard, layout, prepared)
            check_chunk_values(
                shard_dir / entry["file"], shard, layout, stats, manifest["aux_layer_ids"]
            )
            bar.update(entry["bytes"])
    checks["integrity"] = {
        "ok": True,
        "chunks": len(manifest["chunks"]),
        "bytes": total,
        "hash_gb_per_s": total / 1e9 / max(hashed_seconds, 1e-9),
    }
    checks["schema"] = {
        "ok": True,
        "hidden_size": manifest["hidden_size"],
        "num_aux_layers": manifest["num_aux_layers"],
        "num_tokens": manifest["num_tokens"],
    }
    provenance = manifest["provenance"]
    comparable_on = norm_comparable_on(manifest)
    reference = find_norm_reference(paths.validated_dir, shard, comparable_on)
    checks["values"] = check_norm_drift(
        shard, stats, reference, run.validate.norm_drift_factor, manifest["aux_layer_ids"]
    )
    checks["spot_check"] = check_spot(run, shard, shard_dir, manifest, log)

    seconds = time.monotonic() - began
    report = {
        "shard": shard,
        "manifest_xxh3_128": manifest_hash,
        # What makes this report stale besides its manifest (eaglepipe.workflow).
        "validation_settings": validation_settings(run),
        "provenance": provenance,
        "checks": {name: checks[name] for name in CHECKS},
        "layer_norms": stats.layer_means(),
        "norm_comparable_on": comparable_on,
        "layer_norm_reference": reference["shard"] if reference and stats.tokens else shard,
        "num_rows": manifest["num_rows"],
        "num_tokens": manifest["num_tokens"],
        "num_bytes": total,
        "seconds": seconds,
        "gb_per_s": total / 1e9 / max(seconds, 1e-9),
        "validated_at": datetime.now(UTC).isoformat(timespec="microseconds"),
    }
    atomic_write_json(report_path, report)
    log(
        f"validated {shard}: {manifest['num_rows']} rows, {manifest['num_tokens']} tokens, "
        f"{total / 1e9:.3f} GB in {seconds:.1f} s ({report['gb_per_s']:.2f} GB/s); "
        f"all checks passed -> {report_path}"
    )
    return report


# --- verify -------------------------------------------------------------------------------


def _shard_dirs(hidden_states_dir: Path) -> list[Path]:
    dirs = []
    for path in Path(hidden_states_dir).glob("rows_*"):
        if path.is_dir():
            try:
                dirs.append((parse_shard_name(path.name), path))
            except PipelineError:
                continue
    return [path for _, path in sorted(dirs)]


@dataclass
class VerifyReport:
    """What `verify_shards` found: problems by shard, and shards outside the plan."""

    checked: int = 0
    bytes: int = 0
    # Shards with a manifest whose data fails integrity or schema: {shard: [problems]}.
    damaged: dict[str, list[str]] = field(default_factory=dict)
    # Planned shards that have no manifest yet (or an unreadable one): {shard: problem}.
    unfinished: dict[str, str] = field(default_factory=dict)
    # Shard directories the current plan does not contain (an earlier plan's).
    unplanned: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        found = [p for problems in self.damaged.values() for p in problems]
        return found + list(self.unfinished.values())


def verify_shards(
    hidden_states_dir: str | os.PathLike = cfg.HIDDEN_STATES_DIR,
    planned: list[str] | None = None,
    progress: bool = True,
) -> VerifyReport:
    """Integrity and schema of every shard under `hidden_states_dir`.

    Keeps going past a bad chunk or shard, so one run lists every problem. With `planned`,
    shard directories outside the plan are listed apart (training never reads them) and not
    checked, and planned shards without a directory count as unfinished.
    """
    report = VerifyReport()
    # Each shard: its manifest, or None when it has no readable one (then `unfinished` says why).
    shards: list[tuple[Path, dict | None]] = []
    found = _shard_dirs(Path(hidden_states_dir))
    if planned is not None:
        plan = set(planned)
        report.unplanned = [d.name for d in found if d.name not in plan]
        found = [d for d in found if d.name in plan]
        present = {d.name for d in found}
        for shard in planned:
            if shard not in present:
                report.unfinished[shard] = f"shard {shard}: not extracted yet"
    for shard_dir in found:
        if not (shard_dir / shard_store.MANIFEST_NAME).exists():
            problem = f"shard {shard_dir.name}: no manifest.json (extraction not finished)"
            report.unfinished[shard_dir.name] = problem
            shards.append((shard_dir, None))
            continue
        try:
            manifest = read_manifest(shard_dir, shard_dir.name)
            check_manifest_schema(shard_dir.name, manifest)
        except ValidationFailure as exc:
            report.damaged[shard_dir.name] = [str(exc)]
            continue
        shards.append((shard_dir, manifest))
    report.bytes = sum(manifest["num_bytes"] for _, manifest in shards if manifest)
    report.checked = len(shards)
    began = time.monotonic()
    with tqdm(
        total=report.bytes,
        unit="B",
        unit_scale=True,
        desc="verify",
        disable=not progress,
        file=sys.stderr,
        mininterval=1.0,
    ) as bar:
        for shard_dir, manifest in shards:
            if manifest is None:
                continue
            shard = shard_dir.name
            problems: list[str] = []
            try:
                check_no_stray_chunks(shard_dir, shard, manifest)
            except ValidationFailure as exc:
                problems.append(str(exc))
            for entry in manifest["chunks"]:
                try:
                    check_chunk_file(shard_dir, shard, entry)
                    check_chunk_checksum(shard_dir, shard, entry)
                    with open_chunk(shard_dir, shard, entry) as reader:
                        check_chunk_schema(reader, shard, entry, manifest)
                except ValidationFailure as exc:
                    problems.append(str(exc))
                bar.update(entry["bytes"])
            if problems:
                report.damaged[shard] = problems
    if progress:
        seconds = time.monotonic() - began
        print(
            f"verified {report.checked} shard(s), {report.bytes / 1e9:.3f} GB in {seconds:.1f} s "
            f"({report.bytes / 1e9 / max(seconds, 1e-9):.2f} GB/s): "
            f"{len(report.problems)} problem(s)",
            file=sys.stderr,
            flush=True,
        )
    return report


def verify_all(
    hidden_states_dir: str | os.PathLike = cfg.HIDDEN_STATES_DIR, progress: bool = True
) -> list[str]:
    """The problems `verify_shards` finds under `hidden_states_dir` (no plan: every shard)."""
    return verify_shards(hidden_states_dir, progress=progress).problems


def invalidate_damaged(
    report: VerifyReport, hidden_states_dir: str | os.PathLike = cfg.HIDDEN_STATES_DIR
) -> list[str]:
    """Set aside the manifest of every damaged shard that still has one (see
    `shard_store.invalidate_shard`); returns the shards invalidated."""
    invalidated = []
    for shard, problems in report.damaged.items():
        shard_dir = Path(hidden_states_dir) / shard
        if (shard_dir / shard_store.MANIFEST_NAME).exists():
            shard_store.invalidate_shard(shard_dir, problems[0])
            invalidated.append(shard)
    return invalidated
