"""coverage: the row ids are the planned range minus the rows prepare skipped, in order and
without duplicates; input ids and loss masks equal the prepared table's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import PipelineError, set_aside_repair
from ..core.jsonio import read_json_object
from .checks import ValidationFailure
from .schema import ChunkLayout


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
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise PipelineError(
            f"prepared table {table_path} cannot be read ({exc}): "
            + set_aside_repair("prepares it again")
        ) from None
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
        record = read_json_object(skipped_path, what="prepare's skipped rows")
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
        stored = reader.raw(name).data
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
