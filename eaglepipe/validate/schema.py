"""schema: tensor names, dtypes and shapes agree with the offsets, the manifest's row ids, hidden
size, layer count and store (every chunk of the store its manifest records: bf16, or e4m3 with
its scales), so a chunk of another store, or a manifest mislabelling its chunks, fails here."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import PipelineError
from ..core.hidden_store import SCALE_DTYPE, HiddenStore, scale_key
from ..extract.chunk_file import ChunkReader
from ..plan.shard_plan import parse_shard_name
from .checks import CHUNK_TENSORS, HIDDEN_DTYPES, LAYER_NAMES, ValidationFailure


@contextlib.contextmanager
def open_chunk(shard_dir: Path, shard: str, entry: dict):
    """The chunk mapped (`extract.chunk_file.ChunkReader`); a file that cannot be parsed as
    safetensors fails `schema`."""
    try:
        reader = ChunkReader(shard_dir / entry["file"])
    except PipelineError as exc:
        raise ValidationFailure.in_chunk(shard, "schema", str(exc), entry) from None
    with reader:
        yield reader


def manifest_store(shard: str, manifest: dict) -> HiddenStore:
    """The store the manifest records; one it cannot name fails `schema`."""
    try:
        return HiddenStore.from_manifest(manifest)
    except ValueError as exc:
        raise ValidationFailure(shard, "schema", f"manifest.json: {exc}") from None


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
    manifest_store(shard, manifest)
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

    store = manifest_store(shard, manifest)
    expected_dtypes = dict(CHUNK_TENSORS)
    for name in ("aux_hidden_states", "final_hidden_states"):
        expected_dtypes[name] = store.dtype(name)
    for name in store.scaled_keys:
        expected_dtypes[scale_key(name)] = SCALE_DTYPE
    names = reader.names()
    if names != set(expected_dtypes):
        fail(
            f"tensors {sorted(names)}; expected {sorted(expected_dtypes)} for a "
            f"{store.label()} store (missing {sorted(set(expected_dtypes) - names)}, "
            f"extra {sorted(names - set(expected_dtypes))})"
        )
    shapes = {}
    for name, dtype in expected_dtypes.items():
        tensor = reader.raw(name)
        if tensor.dtype != dtype:
            fail(
                f"tensor {name} has dtype {tensor.dtype}, expected {dtype} (the manifest records "
                f"a {store.label()} store)"
            )
        shapes[name] = list(tensor.shape)

    num_rows = len(entry["row_ids"])
    hidden = manifest["hidden_size"]
    aux_width = manifest["num_aux_layers"] * hidden
    if shapes["row_ids"] != [num_rows]:
        fail(f"row_ids has shape {shapes['row_ids']}, the manifest lists {num_rows} rows")
    if shapes["offsets"] != [num_rows + 1]:
        fail(f"offsets has shape {shapes['offsets']}, expected [{num_rows + 1}]")
    row_ids = reader.raw("row_ids").data
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
    offsets = reader.raw("offsets").data
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
    for name in store.scaled_keys:
        layers = manifest["num_aux_layers"] if name == "aux_hidden_states" else 1
        expected_shapes[scale_key(name)] = [tokens, layers]
    for name, shape in expected_shapes.items():
        if shapes[name] != shape:
            fail(
                f"tensor {name} has shape {shapes[name]}, expected {shape} "
                f"({tokens} tokens, hidden size {hidden}, {manifest['num_aux_layers']} aux layers)"
            )
    return ChunkLayout(chunk, row_ids, offsets)
