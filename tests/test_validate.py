"""The validation gate: each kind of damage is caught by its named check, and no report is left.

Shards are written with the real shard store writer (`shard_store.write_chunk`), then damaged
the way a disk, a copy or a buggy extractor would damage them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from aiohttp import web
from conftest import PYTHON, REPO_ROOT, build_tiny_deepseek_v3, free_port

from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.fingerprint import hash_bytes
from eaglepipe.core.hidden_store import BF16_STORE, FP8_REL_L2, HiddenStore, quantize
from eaglepipe.core.run import resolve
from eaglepipe.extract.chunk_file import RowTensors, token_bytes, write_chunk
from eaglepipe.extract.shard import extract_shard
from eaglepipe.extract.shard_files import build_manifest, write_manifest
from eaglepipe.server.lifecycle.shared_server import stop_server
from eaglepipe.validate import (
    ShardPaths,
    StoredRow,
    ValidationFailure,
    expected_provenance,
    independent_forward,
    judge_layers,
    read_stored_rows,
    reextract_rows,
    rel_l2,
    validate_shard,
    verify_all,
)

HIDDEN = 32  # tiny Llama of conftest
SHARD = "rows_0-16"
SKIPPED_ROW = 5
CHUNKS = [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]


@dataclass
class Workspace:
    root: Path
    config: dict
    input_ids: dict[int, np.ndarray]
    loss_masks: dict[int, np.ndarray]

    @property
    def paths(self) -> ShardPaths:
        return ShardPaths()

    def shard_dir(self, shard: str = SHARD) -> Path:
        return self.root / "hidden_states" / shard

    def report(self, shard: str = SHARD) -> Path:
        return self.root / "validated" / f"{shard}.json"


def write_prepared(root: Path, config: dict, num_rows: int, skipped: set[int]) -> tuple[dict, dict]:
    """A prepared table, skipped.json and summary.json as the prepare step writes them."""
    rng = np.random.default_rng(0)
    input_ids, loss_masks = {}, {}
    for row in range(num_rows):
        if row in skipped:
            continue
        length = int(rng.integers(3, 12))
        input_ids[row] = rng.integers(0, 300, length).astype(np.int32)
        loss_masks[row] = (rng.random(length) < 0.6).astype(np.uint8)
    rows = sorted(input_ids)
    table = pa.table(
        {
            "row_id": pa.array(rows, pa.int64()),
            "split": pa.array(["train"] * len(rows)),
            "num_tokens": pa.array([len(input_ids[r]) for r in rows], pa.int32()),
            "input_ids": pa.array([input_ids[r].tolist() for r in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([loss_masks[r].tolist() for r in rows], pa.list_(pa.uint8())),
            "truncated": pa.array([False] * len(rows)),
        }
    )
    (root / "prepared").mkdir()
    pq.write_table(table, root / "prepared" / "tokenized.parquet")
    (root / "prepared" / "skipped.json").write_text(
        json.dumps(
            {
                "count": len(skipped),
                "reasons": {"no assistant tokens": len(skipped)},
                "rows": [{"row_id": r, "reason": "no assistant tokens"} for r in sorted(skipped)],
            }
        )
    )
    (root / "prepared" / "summary.json").write_text(
        json.dumps(
            {
                "rows": len(rows),
                "dataset_hash": "d" * 32,
                "tokenizer_fingerprint": "t" * 32,
                "model_config_hash": "unused",
                "max_length": 1024,
            }
        )
    )
    return input_ids, loss_masks


@pytest.fixture
def workspace(tmp_path, monkeypatch, tiny_llama_dir) -> Workspace:
    monkeypatch.chdir(tmp_path)
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(tiny_llama_dir)
    config["validate"]["spot_check_rows"] = 0  # synthetic tensors: no server to agree with
    # The plan (read only when a manifest is missing) holds SHARD and the shards after it.
    config["dataset"]["path"] = str(REPO_ROOT / config["dataset"]["path"])
    config["shards"]["rows_per_shard"] = 16
    input_ids, loss_masks = write_prepared(tmp_path, config, 32, {SKIPPED_ROW})
    return Workspace(tmp_path, config, input_ids, loss_masks)


PROVENANCE_EXTRA = {
    "shard_inputs_hash": "0" * 32,
    "engine": "reference",
    "engine_version": "test",
    "project_version": "0.1.0",
    "workflow": "workflow-stamp",
}


def synthetic_row(ws: Workspace, row: int, scale: float = 1.0) -> RowTensors:
    generator = torch.Generator().manual_seed(row)
    tokens = len(ws.input_ids[row])
    return RowTensors(
        row_id=row,
        input_ids=torch.from_numpy(ws.input_ids[row]),
        loss_mask=torch.from_numpy(ws.loss_masks[row]),
        aux_hidden_states=(torch.randn(tokens, 3 * HIDDEN, generator=generator) * scale).to(
            torch.bfloat16
        ),
        final_hidden_states=(torch.randn(tokens, HIDDEN, generator=generator) * scale).to(
            torch.bfloat16
        ),
    )


def stored_as(row: RowTensors, store: HiddenStore) -> RowTensors:
    """The row as an FP8 `store` keeps it (what the server's dump writer hands over)."""
    for name in store.scaled_keys:
        values = getattr(row, name)
        q, scale = quantize(values.float(), values.shape[1] // HIDDEN)
        setattr(row, name, q)
        row.scales[f"{name}_scale"] = scale
    return row


def write_shard(
    ws: Workspace,
    shard: str = SHARD,
    chunks: list[list[int]] = CHUNKS,
    tweak=None,
    scale: float = 1.0,
    provenance: dict | None = None,
    store: HiddenStore = BF16_STORE,
    chunk_stores: dict[int, HiddenStore] | None = None,
    tweak_stored=None,
) -> Path:
    """A shard written with the real chunk writer; `tweak(row_tensors)` damages rows first.
    Its chunks hold `store` (chunk i: `chunk_stores[i]` where given), its manifest says `store`;
    `tweak_stored` damages the rows as stored (e4m3 and scales)."""
    start, end = (int(x) for x in shard.removeprefix("rows_").split("-"))
    shard_dir = ws.shard_dir(shard)
    shard_dir.mkdir(parents=True)
    records = []
    for index, rows in enumerate(chunks):
        tensors = [synthetic_row(ws, row, scale) for row in rows]
        if tweak:
            for row_tensors in tensors:
                tweak(row_tensors)
        chunk_store = (chunk_stores or {}).get(index, store)
        tensors = [stored_as(row_tensors, chunk_store) for row_tensors in tensors]
        for row_tensors in tensors if tweak_stored else ():
            tweak_stored(row_tensors)
        records.append(
            write_chunk(shard_dir, index, tensors, hidden_size=HIDDEN, store=chunk_store)
        )
    provenance = provenance or {
        **expected_provenance(resolve(ws.config)),
        **PROVENANCE_EXTRA,
        "shard_inputs_hash": shard.ljust(32, "0"),
        # Per shard, as extraction records it: the hash of the shard's own source rows.
        "workflow": f"workflow-stamp-of-{shard}",
    }
    manifest = build_manifest(
        shard=shard,
        row_start=start,
        row_end=end,
        hidden_size=HIDDEN,
        aux_layer_ids=provenance["aux_layer_ids"],
        records=records,
        provenance=provenance,
        timing={"seconds": 1.0},
        store=store,
    )
    write_manifest(shard_dir, manifest)
    return shard_dir


def expect_failure(ws: Workspace, check: str, shard: str = SHARD) -> ValidationFailure:
    with pytest.raises(ValidationFailure) as info:
        validate_shard(resolve(ws.config), shard, progress=False)
    failure = info.value
    assert failure.check == check, str(failure)
    assert failure.shard == shard
    message = str(failure)
    assert f"check {check} failed" in message and f"shard {shard}" in message
    assert not ws.report(shard).exists()
    return failure


def update_manifest(shard_dir: Path, change) -> None:
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    change(manifest)
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))


# --- the clean path -----------------------------------------------------------------------


def test_clean_shard_passes_and_writes_the_report(workspace):
    write_shard(workspace)
    report = validate_shard(resolve(workspace.config), SHARD, progress=False)
    on_disk = json.loads(workspace.report().read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert on_disk["shard"] == SHARD
    assert set(on_disk["checks"]) == {
        "integrity",
        "schema",
        "coverage",
        "values",
        "provenance",
        "spot_check",
    }
    assert all(check["ok"] for check in on_disk["checks"].values())
    assert on_disk["checks"]["coverage"]["rows"] == 15
    assert on_disk["checks"]["coverage"]["skipped_rows"] == 1
    assert set(on_disk["layer_norms"]) == {"aux_0", "aux_1", "aux_2", "final"}
    # randn rows of width H have norm ~sqrt(H)
    assert all(4.0 < v < 7.5 for v in on_disk["layer_norms"].values())
    assert on_disk["layer_norm_reference"] == SHARD
    assert on_disk["manifest_xxh3_128"]
    assert on_disk["provenance"]["aux_layer_ids"] == [1, 3, 4]


def test_the_report_hashes_the_manifest_it_checked_even_if_it_is_replaced_meanwhile(
    workspace, monkeypatch
):
    """The manifest is replaced (another extraction's) right after validation first reads it:
    the report must describe one manifest, never the first one's hash with the second's checks."""
    import builtins
    import io

    write_shard(workspace)
    manifest = workspace.root / "hidden_states" / SHARD / "manifest.json"
    first_bytes = manifest.read_bytes()
    second = json.loads(first_bytes)
    second["provenance"]["project_version"] = "replaced"
    second_bytes = json.dumps(second).encode()
    real_open, replaced = io.open, []

    def open_then_replace(file, *args, **kwargs):
        handle = real_open(file, *args, **kwargs)
        is_path = isinstance(file, str | os.PathLike)
        if not replaced and is_path and Path(file).resolve() == manifest:
            replaced.append(True)
            close = handle.close

            def close_and_replace():
                close()
                manifest.write_bytes(second_bytes)

            handle.close = close_and_replace
        return handle

    monkeypatch.setattr(io, "open", open_then_replace)
    monkeypatch.setattr(builtins, "open", open_then_replace)
    report = validate_shard(resolve(workspace.config), SHARD, progress=False)
    monkeypatch.undo()
    assert replaced  # the manifest was replaced during the validation
    was_second = report["provenance"]["project_version"] == "replaced"
    assert report["manifest_xxh3_128"] == hash_bytes(second_bytes if was_second else first_bytes)


def test_later_shard_is_checked_against_the_first_validated_one(workspace):
    """Shards of one run differ in their inputs and workflow stamps, yet share a reference."""
    write_shard(workspace)
    validate_shard(resolve(workspace.config), SHARD, progress=False)
    write_shard(workspace, "rows_16-32", [list(range(16, 24)), list(range(24, 32))])
    report = validate_shard(resolve(workspace.config), "rows_16-32", progress=False)
    assert report["layer_norm_reference"] == SHARD
    ratios = report["checks"]["values"]["norm_ratio_to_reference"]
    assert ratios is not None and all(0.8 < r < 1.25 for r in ratios.values())
    assert report["norm_comparable_on"]["engine"] == "reference"
    assert report["norm_comparable_on"]["dtype"] == "bfloat16"


def test_shards_of_another_engine_are_not_compared(workspace):
    write_shard(workspace)
    validate_shard(resolve(workspace.config), SHARD, progress=False)
    provenance = {
        **expected_provenance(resolve(workspace.config)),
        "shard_inputs_hash": "x" * 32,
        "engine": "sglang",
        "engine_version": "0.5.14",
        "project_version": "0.1.0",
        "workflow": "another",
    }
    write_shard(workspace, "rows_16-32", [list(range(16, 32))], scale=10.0, provenance=provenance)
    report = validate_shard(resolve(workspace.config), "rows_16-32", progress=False)
    assert report["layer_norm_reference"] == "rows_16-32"
    assert report["checks"]["values"]["norm_ratio_to_reference"] is None


def test_norm_drift_beyond_the_factor_fails_naming_the_layer(workspace):
    write_shard(workspace)
    validate_shard(resolve(workspace.config), SHARD, progress=False)
    write_shard(workspace, "rows_16-32", [list(range(16, 32))], scale=10.0)
    failure = expect_failure(workspace, "values", "rows_16-32")
    assert "aux_0" in str(failure) and "reference shard rows_0-16" in str(failure)


def test_a_rerun_that_fails_removes_the_earlier_report(workspace):
    shard_dir = write_shard(workspace)
    validate_shard(resolve(workspace.config), SHARD, progress=False)
    assert workspace.report().exists()
    (shard_dir / "chunk-00002.safetensors").unlink()
    expect_failure(workspace, "integrity")


def test_shard_whose_rows_prepare_all_skipped_passes_empty(workspace):
    skipped = {"count": 16, "reasons": {"no assistant tokens": 16}}
    skipped["rows"] = [{"row_id": r, "reason": "no assistant tokens"} for r in range(32, 48)]
    (workspace.root / "prepared" / "skipped.json").write_text(json.dumps(skipped))
    write_shard(workspace)
    validate_shard(resolve(workspace.config), SHARD, progress=False)
    write_shard(workspace, "rows_32-48", [])
    report = validate_shard(resolve(workspace.config), "rows_32-48", progress=False)
    assert report["num_rows"] == 0 and report["checks"]["coverage"]["skipped_rows"] == 16
    assert report["checks"]["values"]["norm_ratio_to_reference"] is None
    # an empty shard is never the norm reference of a later one
    write_shard(workspace, "rows_16-32", [list(range(16, 32))])
    later = validate_shard(resolve(workspace.config), "rows_16-32", progress=False)
    assert later["layer_norm_reference"] == SHARD


# --- integrity ----------------------------------------------------------------------------


def test_flipped_byte_fails_integrity_naming_the_chunk(workspace):
    shard_dir = write_shard(workspace)
    path = shard_dir / "chunk-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    failure = expect_failure(workspace, "integrity")
    assert failure.chunk == "chunk-00001.safetensors" and failure.row == 6
    assert "chunk-00001.safetensors" in str(failure) and "rows 6..10" in str(failure)
    assert "re-hashes" in str(failure)


def test_truncated_chunk_fails_integrity(workspace):
    shard_dir = write_shard(workspace)
    path = shard_dir / "chunk-00002.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    failure = expect_failure(workspace, "integrity")
    assert failure.chunk == "chunk-00002.safetensors" and failure.row == 11
    assert "bytes" in str(failure) and "row 11" in str(failure)


def test_deleted_chunk_fails_integrity(workspace):
    shard_dir = write_shard(workspace)
    (shard_dir / "chunk-00000.safetensors").unlink()
    failure = expect_failure(workspace, "integrity")
    assert failure.chunk == "chunk-00000.safetensors" and "missing" in str(failure)
    assert "row 0" in str(failure)


def test_stray_chunk_fails_integrity(workspace):
    shard_dir = write_shard(workspace)
    stray = shard_dir / "chunk-00003.safetensors"
    stray.write_bytes((shard_dir / "chunk-00000.safetensors").read_bytes())
    failure = expect_failure(workspace, "integrity")
    assert failure.chunk == "chunk-00003.safetensors" and "not listed" in str(failure)


# --- schema -------------------------------------------------------------------------------


def test_manifest_hidden_size_disagreeing_with_tensors_fails_schema(workspace):
    shard_dir = write_shard(workspace)
    update_manifest(shard_dir, lambda m: m.update(hidden_size=HIDDEN * 2))
    failure = expect_failure(workspace, "schema")
    assert failure.chunk == "chunk-00000.safetensors" and "aux_hidden_states" in str(failure)


def test_manifest_row_ids_disagreeing_with_the_chunk_tensor_fails_schema(workspace):
    shard_dir = write_shard(workspace)

    def move_row(manifest):
        # Still every row once and in order (coverage is content), but not what chunk 0 holds.
        manifest["chunks"][0]["row_ids"] = [0, 1, 2, 3]
        manifest["chunks"][1]["row_ids"] = [4, 6, 7, 8, 9, 10]

    update_manifest(shard_dir, move_row)
    failure = expect_failure(workspace, "schema")
    assert failure.chunk == "chunk-00000.safetensors" and failure.row == 0
    assert "row_ids has shape [5], the manifest lists 4 rows" in str(failure)


# --- coverage -----------------------------------------------------------------------------


def test_duplicate_row_fails_coverage_naming_row_and_chunks(workspace):
    write_shard(workspace, chunks=[[0, 1, 2, 3, 4], [4, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]])
    failure = expect_failure(workspace, "coverage")
    assert failure.row == 4 and failure.chunk == "chunk-00001.safetensors"
    assert "row 4 appears twice" in str(failure) and "chunk-00000.safetensors" in str(failure)


def test_missing_row_fails_coverage(workspace):
    write_shard(workspace, chunks=[[0, 1, 2, 3, 4], [6, 8, 9, 10], [11, 12, 13, 14, 15]])
    failure = expect_failure(workspace, "coverage")
    assert failure.row == 7 and "not stored" in str(failure)


def test_row_that_prepare_skipped_must_not_be_stored(workspace):
    workspace.input_ids[SKIPPED_ROW] = np.array([1, 2, 3], np.int32)
    workspace.loss_masks[SKIPPED_ROW] = np.array([0, 1, 1], np.uint8)
    write_shard(workspace, chunks=[[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]])
    failure = expect_failure(workspace, "coverage")
    assert failure.row == SKIPPED_ROW and "skipped by prepare" in str(failure)


def test_input_ids_differing_from_the_prepared_table_fail_coverage(workspace):
    def corrupt(row: RowTensors) -> None:
        if row.row_id == 9:
            row.input_ids = row.input_ids.clone()
            row.input_ids[2] += 1

    write_shard(workspace, tweak=corrupt)
    failure = expect_failure(workspace, "coverage")
    assert failure.row == 9 and failure.chunk == "chunk-00001.safetensors"
    assert "input_ids of row 9 differs from the prepared table at token 2" in str(failure)


def test_loss_mask_differing_from_the_prepared_table_fails_coverage(workspace):
    def corrupt(row: RowTensors) -> None:
        if row.row_id == 12:
            row.loss_mask = 1 - row.loss_mask

    write_shard(workspace, tweak=corrupt)
    failure = expect_failure(workspace, "coverage")
    assert failure.row == 12 and "loss_mask" in str(failure)


# --- values -------------------------------------------------------------------------------


def test_zeroed_sample_fails_values_naming_row_and_layer(workspace):
    def zero(row: RowTensors) -> None:
        if row.row_id == 8:
            row.final_hidden_states = torch.zeros_like(row.final_hidden_states)

    write_shard(workspace, tweak=zero)
    failure = expect_failure(workspace, "values")
    assert failure.row == 8 and failure.chunk == "chunk-00001.safetensors"
    assert "final (post-norm) are all zero" in str(failure)


def test_constant_aux_layer_fails_values(workspace):
    def flatten(row: RowTensors) -> None:
        if row.row_id == 13:
            row.aux_hidden_states = row.aux_hidden_states.clone()
            row.aux_hidden_states[:, HIDDEN : 2 * HIDDEN] = 0.5

    write_shard(workspace, tweak=flatten)
    failure = expect_failure(workspace, "values")
    assert failure.row == 13 and "aux_1 (decoder layer 3 output) are constant (0.5)" in str(failure)


def test_non_finite_value_fails_values(workspace):
    def poison(row: RowTensors) -> None:
        if row.row_id == 2:
            row.aux_hidden_states = row.aux_hidden_states.clone()
            row.aux_hidden_states[1, 5] = float("nan")

    write_shard(workspace, tweak=poison)
    failure = expect_failure(workspace, "values")
    assert failure.row == 2 and "non-finite" in str(failure) and "token 1" in str(failure)


# --- provenance ---------------------------------------------------------------------------


def test_changed_layer_ids_fail_provenance_naming_the_field(workspace):
    shard_dir = write_shard(workspace)

    def other_layers(manifest):
        manifest["aux_layer_ids"] = [1, 3, 5]
        manifest["provenance"]["aux_layer_ids"] = [1, 3, 5]

    update_manifest(shard_dir, other_layers)
    failure = expect_failure(workspace, "provenance")
    assert "field aux_layer_ids" in str(failure) and "[1, 3, 5]" in str(failure)


def test_shard_of_another_model_fails_provenance(workspace):
    shard_dir = write_shard(workspace)
    update_manifest(shard_dir, lambda m: m["provenance"].update(model_config_hash="0" * 32))
    failure = expect_failure(workspace, "provenance")
    assert "field model_config_hash" in str(failure)


# --- an FP8 store --------------------------------------------------------------------------

FP8 = HiddenStore("fp8_e4m3", "fp8_e4m3")
FP8_AUX = HiddenStore("fp8_e4m3", "bf16")


def configure_store(ws: Workspace, store: HiddenStore) -> None:
    ws.config["extract"]["store"] = store.as_dict()


@pytest.mark.parametrize("store", [FP8, FP8_AUX], ids=["fp8", "fp8_aux_only"])
def test_an_fp8_shard_of_the_configured_store_passes(workspace, store):
    configure_store(workspace, store)
    write_shard(workspace, store=store)
    report = validate_shard(resolve(workspace.config), SHARD, progress=False)
    assert "stored_dtypes" in report["checks"]["provenance"]["fields"]
    assert report["provenance"]["stored_dtypes"] == store.manifest_dtypes()
    # Dequantized randn rows: norms as in bf16 (~sqrt(H)); compared only with this store.
    assert all(4.0 < v < 7.5 for v in report["layer_norms"].values())
    assert report["norm_comparable_on"]["store"] == store.as_dict()


def test_a_shard_of_another_store_than_the_configured_one_fails_provenance(workspace):
    configure_store(workspace, FP8)
    provenance = expected_provenance(resolve(workspace.config))
    configure_store(workspace, BF16_STORE)
    write_shard(workspace, store=FP8, provenance={**provenance, **PROVENANCE_EXTRA})
    failure = expect_failure(workspace, "provenance")
    assert "never mixes stores" in str(failure) and "float8_e4m3fn" in str(failure)
    assert "extract.store" in str(failure)


def test_a_manifest_that_mislabels_its_chunks_fails_schema(workspace):
    """FP8 chunks under a manifest (and provenance) that say bf16: the chunks' own dtypes tell."""
    write_shard(workspace, store=BF16_STORE, chunk_stores={0: FP8, 1: FP8, 2: FP8})
    failure = expect_failure(workspace, "schema")
    assert failure.chunk == "chunk-00000.safetensors"
    assert "aux_hidden_states_scale" in str(failure) and "bf16 store" in str(failure)


def test_a_shard_mixing_stores_fails_schema_naming_the_chunk(workspace):
    configure_store(workspace, FP8_AUX)
    write_shard(workspace, store=FP8_AUX, chunk_stores={1: BF16_STORE})
    failure = expect_failure(workspace, "schema")
    assert failure.chunk == "chunk-00001.safetensors" and failure.row == 6
    assert "aux_hidden_states_scale" in str(failure)


def test_a_manifest_whose_store_disagrees_with_its_provenance_fails(workspace):
    configure_store(workspace, FP8)
    shard_dir = write_shard(workspace, store=FP8)
    update_manifest(shard_dir, lambda m: m["provenance"].update(stored_dtypes=None))
    failure = expect_failure(workspace, "provenance")
    assert "disagree with its provenance.stored_dtypes" in str(failure)


def test_non_finite_values_and_bad_scales_of_an_fp8_shard_fail_values(workspace):
    configure_store(workspace, FP8)

    def poison(row: RowTensors) -> None:
        if row.row_id == 2:
            row.aux_hidden_states = row.aux_hidden_states.clone()
            row.aux_hidden_states[1, 5] = float("nan")

    write_shard(workspace, store=FP8, tweak=poison)
    failure = expect_failure(workspace, "values")
    assert failure.row == 2 and "non-finite" in str(failure) and "token 1" in str(failure)
    shutil.rmtree(workspace.shard_dir())

    def negative(row: RowTensors) -> None:
        if row.row_id == 9:
            row.scales["final_hidden_states_scale"][2] = -1.0

    write_shard(workspace, store=FP8, tweak_stored=negative)
    failure = expect_failure(workspace, "values")
    assert failure.row == 9 and "scale -1.0" in str(failure) and "final (post-norm)" in str(failure)


# --- verify -------------------------------------------------------------------------------


def test_verify_all_lists_every_problem_and_nothing_on_clean_data(workspace, capsys):
    write_shard(workspace)
    second = write_shard(workspace, "rows_16-32", [list(range(16, 24)), list(range(24, 32))])
    assert verify_all(workspace.root / "hidden_states", progress=True) == []
    assert "verified 2 shard(s)" in capsys.readouterr().err

    data = bytearray((second / "chunk-00001.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (second / "chunk-00001.safetensors").write_bytes(bytes(data))
    (workspace.shard_dir() / "chunk-00000.safetensors").unlink()
    (workspace.root / "hidden_states" / "rows_32-48").mkdir()
    problems = verify_all(workspace.root / "hidden_states", progress=False)
    assert len(problems) == 3, problems
    assert "shard rows_0-16, chunk chunk-00000.safetensors" in problems[0]
    assert "shard rows_16-32, chunk chunk-00001.safetensors" in problems[1]
    assert "rows_32-48: no manifest.json" in problems[2]


# --- the script ---------------------------------------------------------------------------


def test_a_shard_outside_the_plan_is_refused_naming_the_plan(workspace):
    # It said the shard's manifest did not exist, as if extracting it would help.
    with pytest.raises(PipelineError) as raised:
        validate_shard(resolve(workspace.config), "rows_0-17", progress=False)
    assert str(raised.value).startswith("shard rows_0-17 is not in the plan of ")
    message = str(raised.value)
    assert "shards.rows_per_shard=16: its rows are in rows_0-16, rows_16-32 (the plan" in message
    assert not (workspace.root / "validated").exists()


def test_script_prints_one_error_line_and_exits_1_on_failure(workspace):
    shard_dir = write_shard(workspace)
    (shard_dir / "chunk-00001.safetensors").unlink()
    config_path = workspace.root / "config.json"
    config_path.write_text(json.dumps(workspace.config))
    result = subprocess.run(
        [
            PYTHON,
            "-u",
            str(REPO_ROOT / "scripts" / "validate.py"),
            "--config",
            str(config_path),
            "--shard",
            SHARD,
        ],
        cwd=workspace.root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: validation check integrity failed (shard rows_0-16, chunk")
    assert not workspace.report().exists()


# --- spot check against the real reference server -----------------------------------------


@pytest.fixture
def served(workspace):
    """The workspace set up for the real lifecycle and reference server; server stopped after."""
    config = workspace.config
    # Extraction records the workflow's provenance of the shard: the target needs its
    # tokenizer files and the prepared table a source whose plan holds the shard.
    from tokenizers import Tokenizer, models

    from eaglepipe.core.fingerprint import tokenizer_fingerprint

    target = workspace.root / "target"
    shutil.copytree(config["model"]["path"], target)
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(
        str(target / "tokenizer.json")
    )
    config["model"]["path"] = str(target)
    summary_path = workspace.root / "prepared" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["tokenizer_fingerprint"] = tokenizer_fingerprint(target)
    summary_path.write_text(json.dumps(summary))
    sample = (REPO_ROOT / "data" / "sample" / "conversations.jsonl").read_text().splitlines()
    (workspace.root / "source.jsonl").write_text("\n".join(sample[:32]) + "\n")
    config["dataset"]["path"] = str(workspace.root / "source.jsonl")
    config["shards"]["rows_per_shard"] = 16
    config["server"].update(
        port=free_port(),
        dump_root=str(workspace.root / "dumps"),
        device="cpu",
        dtype="float32",
        idle_timeout_s=60,
        max_batch_tokens=512,
    )
    config["shards"]["chunk_max_bytes"] = 12000  # several chunks at H=32
    config["extract"]["max_inflight_requests"] = 8
    config["validate"]["spot_check_rows"] = 4
    try:
        yield workspace
    finally:
        stop_server()


def test_spot_check_passes_for_a_shard_extracted_through_the_reference_server(served):
    manifest = extract_shard(resolve(served.config), SHARD, log=lambda line: None)
    assert len(manifest["chunks"]) > 1
    report = validate_shard(resolve(served.config), SHARD, progress=False)
    spot = report["checks"]["spot_check"]
    assert len(spot["rows"]) == 4 and set(spot["rows"]) <= set(range(16)) - {SKIPPED_ROW}
    # each re-extraction ran alone on the server, as its dump says
    assert spot["server"]["batch_sizes"] == [1, 1, 1, 1]
    assert spot["independent_forward"]["ran"] is True
    for layers in (spot["reextract"], spot["independent_forward"]["layers"]):
        assert set(layers) == {"aux_0", "aux_1", "aux_2", "final"}
        for verdict in layers.values():
            # bf16 storage rounding only, judged with the measured floor and neighbours
            assert verdict["ok"] and verdict["rel_l2"] < 0.01, verdict
            assert verdict["floor_source"].startswith("measured")
            assert 0 < verdict["noise_floor"] < 0.05
            assert verdict["neighbour_rel_l2"] > 10 * verdict["rel_l2"]
    assert served.report().exists()
    # the same seed and shard pick the same rows
    again = validate_shard(resolve(served.config), SHARD, progress=False)
    assert again["checks"]["spot_check"]["rows"] == spot["rows"]


def test_layer_shift_in_batched_requests_is_caught_by_the_server_comparison(served, monkeypatch):
    monkeypatch.setenv("EAGLEPIPE_FAULT", "shift_layer_batched")
    # The server comparison alone must catch it. Without the independent forward the floor is
    # assumed; an fp32 CPU server differs from its bf16 dumps by storage rounding only.
    served.config["validate"]["independent_forward"] = False
    served.config["validate"]["server_noise_floor"] = 0.01
    extract_shard(resolve(served.config), SHARD, log=lambda line: None)
    failure = expect_failure(served, "spot_check")
    message = str(failure)
    assert "re-extraction of the row alone through the server" in message
    assert failure.chunk and failure.chunk.startswith("chunk-") and failure.row in range(16)
    assert f"chunk {failure.chunk}, row {failure.row}" in message
    assert "aux_0 (decoder layer 1 output)" in message and "noise bound" in message


def test_layer_shift_in_batched_requests_fails_with_the_default_bounds(served, monkeypatch):
    monkeypatch.setenv("EAGLEPIPE_FAULT", "shift_layer_batched")
    extract_shard(resolve(served.config), SHARD, log=lambda line: None)
    failure = expect_failure(served, "spot_check")
    assert "independent transformers fp32 forwards on CPU" in str(failure)
    assert "neighbour bound" in str(failure) and "aux_0" in str(failure)


def loaded_states(shard_dir: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every row of the shard through the training data loader, dequantized on `device`."""
    from eaglepipe.drafter.chunks import list_chunks
    from eaglepipe.drafter.data import ChunkCache, index_rows, load_batch
    from eaglepipe.drafter.train import to_device

    chunks, _ = list_chunks([shard_dir / "manifest.json"])
    refs = sorted(index_rows(chunks), key=lambda r: r.row_id)
    batch = load_batch(refs, 4096, ChunkCache())
    return {**to_device(batch, torch.device(device), torch.float32), "raw": batch}


def test_an_fp8_store_round_trips_through_the_server_the_gate_and_the_loader(served, tmp_path):
    """Extracted through the reference server as e4m3 (the server quantizes), validated with
    its spot check, read by the training loader (dequantized on the device): within e4m3's
    error of the same shard stored in bf16."""
    served.config["extract"]["store"] = FP8.as_dict()
    manifest = extract_shard(resolve(served.config), SHARD, log=lambda line: None)
    assert manifest["stored_dtypes"] == FP8.manifest_dtypes()
    assert manifest["provenance"]["stored_dtypes"] == FP8.manifest_dtypes()
    report = validate_shard(resolve(served.config), SHARD, progress=False)
    spot = report["checks"]["spot_check"]
    for layers, roundings in ((spot["independent_forward"]["layers"], 1), (spot["reextract"], 2)):
        for verdict in layers.values():
            assert verdict["ok"] and verdict["fp8_roundings"] == roundings, verdict
            assert verdict["noise_floor"] > verdict["floor_before_fp8"]
    for verdict in spot["independent_forward"]["layers"].values():
        assert 0.5 * FP8_REL_L2 < verdict["rel_l2"] < 2 * FP8_REL_L2, verdict
    fp8 = loaded_states(served.shard_dir())
    assert fp8["raw"]["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert fp8["raw"]["final_hidden_states_scale"].dtype == torch.float32
    assert fp8["aux_hidden_states"].dtype == torch.float32
    assert "aux_hidden_states_scale" not in fp8

    served.config["extract"]["store"] = BF16_STORE.as_dict()
    bf16_dir = tmp_path / "bf16"
    bf16_manifest = extract_shard(
        resolve(served.config), SHARD, hidden_states_dir=bf16_dir, log=lambda line: None
    )
    assert bf16_manifest["stored_dtypes"] == BF16_STORE.manifest_dtypes()
    # What the chunks' byte function says (states, scales, ids), plus each chunk's header.
    for store, written in ((FP8, manifest), (BF16_STORE, bf16_manifest)):
        expected = written["num_tokens"] * token_bytes(HIDDEN, 3, store)
        assert expected < written["num_bytes"] < expected + 1500 * len(written["chunks"])
    bf16 = loaded_states(bf16_dir / SHARD)
    mask = bf16["loss_mask"] >= 0  # every real token; padding is zero in both
    for name in ("aux_hidden_states", "final_hidden_states"):
        error = rel_l2(fp8[name][mask], bf16[name][mask])
        assert 0.3 * FP8_REL_L2 < error < 1.5 * FP8_REL_L2, (name, error)


def test_a_layer_shift_is_caught_on_fp8_data(served, monkeypatch):
    """The FP8 floor leaves a shifted layer failing: by the server comparison alone, and with
    the default bounds."""
    monkeypatch.setenv("EAGLEPIPE_FAULT", "shift_layer_batched")
    served.config["extract"]["store"] = FP8.as_dict()
    served.config["validate"]["independent_forward"] = False
    served.config["validate"]["server_noise_floor"] = 0.01
    extract_shard(resolve(served.config), SHARD, log=lambda line: None)
    failure = expect_failure(served, "spot_check")
    assert "re-extraction of the row alone through the server" in str(failure)
    assert "aux_0 (decoder layer 1 output)" in str(failure) and "noise bound" in str(failure)
    served.config["validate"]["independent_forward"] = True
    served.config["validate"]["server_noise_floor"] = 0.05
    failure = expect_failure(served, "spot_check")
    assert "independent transformers fp32 forwards on CPU" in str(failure)
    assert "neighbour bound" in str(failure)


def split_rows(rows: list[StoredRow], slots: dict[str, torch.Tensor]) -> None:
    """Fill each row's aux/final from per-slot tensors concatenated over the rows' tokens."""
    start = 0
    for row in rows:
        end = start + len(row.input_ids)
        parts = [slots[name][start:end] for name in ("aux_0", "aux_1", "aux_2", "final")]
        row.aux, row.final = torch.cat(parts[:3], dim=-1), parts[3]
        start = end


def test_independent_forward_tells_a_layer_offset_from_bf16_rounding(workspace):
    """Stored tensors one layer off (a layer-offset bug applied to every request, which a
    re-extraction through the same server would reproduce) fail against the independent
    forward; the same layers rounded to bf16 pass."""
    rows = [
        StoredRow(row, "chunk-00000.safetensors", workspace.input_ids[row].tolist(), None, None)
        for row in (0, 1, 2)
    ]
    run = resolve(workspace.config)
    settings = run.validate
    references = independent_forward(run, rows, [1, 3, 4])
    split_rows(rows, {n: r.values.to(torch.bfloat16).float() for n, r in references.items()})
    layers = judge_layers(
        SHARD, "an independent forward", rows, references, HIDDEN, [1, 3, 4], settings
    )
    assert all(v["ok"] and v["rel_l2"] < 0.01 for v in layers.values())
    off_by_one = independent_forward(run, rows, [2, 4, 5])
    split_rows(rows, {n: r.values for n, r in off_by_one.items()})
    with pytest.raises(ValidationFailure) as info:
        judge_layers(SHARD, "an independent forward", rows, references, HIDDEN, [1, 3, 4], settings)
    assert info.value.check == "spot_check" and info.value.row in (0, 1, 2)
    message = str(info.value)
    assert "aux_0 (decoder layer 1 output) disagrees with an independent forward" in message
    assert "neighbour bound" in message and "noise bound" in message


# --- the spot check against a server that answers like SGLang ------------------------------


class SGLangLikeServer:
    """Answers /generate as SGLang does, for the spot check's prefill-only requests: JSON with
    `meta_info` that says nothing about batching, sent when the forward is done, while the dump
    is written afterwards by the project's DumpWriter (as the SGLang hook's writer thread does,
    `delay_s` later; None: written before the answer, as the reference server does).
    `batched_with` puts that many foreign requests (SGLang's own /health probes) into the
    dumped forward pass of each of the first `batched_times` requests."""

    def __init__(self, dump_dir: Path, values: dict, *, delay_s: float, batched_with=0,
                 batched_times=0):  # fmt: skip
        from eaglepipe.server.handoff.dump_writer import DumpWriter
        from eaglepipe.server.handoff.dumps import prepare_dump_dir

        self.dump_dir = prepare_dump_dir(dump_dir)
        self.values = values  # tuple(input_ids) -> (aux bf16 [T, 3H], final bf16 [T, H])
        self.delay_s = delay_s
        self.batched_with = batched_with
        self.batched_times = batched_times
        self.requests = 0
        self.writer = DumpWriter(self.dump_dir, "eaglepipe", aux_layer_ids=[1, 3, 4])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.info = {"aux_layer_ids": [1, 3, 4], "hidden_size": HIDDEN, "engine": "sglang"}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _dump(self, rid: str, aux: torch.Tensor, final: torch.Tensor) -> None:
        time.sleep(self.delay_s or 0)
        self.requests += 1
        foreign = self.batched_with if self.requests <= self.batched_times else 0
        rids = [f"HEALTH_CHECK_{i}" for i in range(foreign)] + [rid]
        counts = [1] * foreign + [len(final)]
        pad = (torch.zeros(foreign, aux.shape[1]), torch.zeros(foreign, final.shape[1]))
        self.writer.submit(
            rids, counts, torch.cat([pad[0], aux.float()]), torch.cat([pad[1], final.float()])
        )

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        aux, final = self.values[tuple(body["input_ids"])]
        if self.delay_s is None:
            self._dump(body["rid"], aux, final)
            self.writer.flush()
        else:
            threading.Thread(target=self._dump, args=(body["rid"], aux, final)).start()
        meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": 0,
                "cached_tokens": 0}  # fmt: skip
        return web.json_response({"text": "", "output_ids": [], "meta_info": meta})

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> SGLangLikeServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.writer.close()


def row_values(ws: Workspace, rows, forward) -> dict:
    """tuple(input_ids) -> (aux, final) bf16 as `forward(input_ids)` computes them."""
    return {tuple(ws.input_ids[r].tolist()): forward(ws.input_ids[r]) for r in rows}


def synthetic_values(ws: Workspace, rows) -> dict:
    """The values `write_shard` stores for these rows, keyed as `row_values`."""
    return {
        tuple(ws.input_ids[r].tolist()): (
            synthetic_row(ws, r).aux_hidden_states,
            synthetic_row(ws, r).final_hidden_states,
        )
        for r in rows
    }


@pytest.fixture
def sglang_like(workspace, monkeypatch):
    """Start an SGLangLikeServer and make it the server the spot check leases."""

    @contextlib.contextmanager
    def start(values: dict, **kwargs):
        with SGLangLikeServer(workspace.root / "dumps", values, **kwargs) as server:

            @contextlib.contextmanager
            def lease(config, exclusive=False, **_):
                assert exclusive, "the spot check must hold the server exclusively"
                yield server

            monkeypatch.setattr("eaglepipe.server.lifecycle.shared_server.server_lease", lease)
            yield server

    return start


def stored_row_tensors(ws: Workspace, rows) -> list[StoredRow]:
    shard_dir = ws.shard_dir()
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    return read_stored_rows(shard_dir, manifest, rows)


def test_spot_check_waits_for_a_dump_written_after_the_answer(workspace, sglang_like):
    """Regression: the spot check read the dump right after the HTTP answer; the SGLang hook's
    writer renames it later, so validation failed on correct data."""
    write_shard(workspace)
    rows = [0, 7, 12]
    values = synthetic_values(workspace, rows)
    with sglang_like(values, delay_s=0.5) as server:
        fresh, info = reextract_rows(
            resolve(workspace.config), SHARD, stored_row_tensors(workspace, rows), HIDDEN, [1, 3, 4]
        )
        assert server.requests == 3
    assert info["batch_sizes"] == [1, 1, 1]
    for row in stored_row_tensors(workspace, rows):
        assert torch.equal(fresh[row.row_id][0], row.aux)
        assert torch.equal(fresh[row.row_id][1], row.final)
    assert not list((workspace.root / "dumps").glob("*.safetensors"))


def test_spot_check_retries_a_re_extraction_that_shared_its_forward_pass(workspace, sglang_like):
    write_shard(workspace)
    rows = [3, 9]
    values = synthetic_values(workspace, rows)
    with sglang_like(values, delay_s=None, batched_with=1, batched_times=1) as server:
        _, info = reextract_rows(
            resolve(workspace.config), SHARD, stored_row_tensors(workspace, rows), HIDDEN, [1, 3, 4]
        )
        assert server.requests == 3
    assert info["attempts"] == [2, 1] and info["batch_sizes"] == [1, 1]


def test_spot_check_fails_when_the_server_always_batches_the_request(workspace, sglang_like):
    """Regression: the batched guard read `meta_info.batch_size`, which SGLang's answer lacks,
    so a re-extraction batched with other traffic passed as if computed alone."""
    write_shard(workspace)
    rows = [4]
    values = synthetic_values(workspace, rows)
    with sglang_like(values, delay_s=None, batched_with=2, batched_times=99):
        with pytest.raises(ValidationFailure) as info:
            reextract_rows(
                resolve(workspace.config),
                SHARD,
                stored_row_tensors(workspace, rows),
                HIDDEN,
                [1, 3, 4],
            )
    assert info.value.check == "spot_check" and info.value.row == 4
    assert "3 requests" in str(info.value) and "traffic from outside the pipeline" in str(
        info.value
    )


@pytest.fixture(scope="module")
def flippy_moe_dir(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 whose routers are near ties and whose routed experts weigh a lot, so
    bf16 noise flips expert choices the way it does on the H200 runs' DeepSeek-V3 shape
    (transformers' bf16 vs fp32 per-token p99 0.2-0.3, whole tensor 0.04-0.08)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("flippy-moe")
    build_tiny_deepseek_v3(out / "base")
    model = AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.mul_(0.001)
            if name.endswith("mlp.experts.down_proj"):
                parameter.mul_(4.0)
    model.save_pretrained(out / "model")
    return out / "model"


def engine_batches(ws: Workspace, model_dir: Path, aux_ids=(1, 3, 4)) -> dict:
    """Every row's dumps as an engine computes them: in bf16, all rows in one right-padded batch
    (other kernel shapes than a forward of the row alone, so other rounding and other expert
    flips), keyed as `row_values`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    rows = sorted(ws.input_ids)
    longest = max(len(ws.input_ids[r]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(ws.input_ids[r])] = torch.from_numpy(ws.input_ids[r])
        mask[i, : len(ws.input_ids[r])] = 1
    with torch.inference_mode():
        states = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    values = {}
    for i, r in enumerate(rows):
        n = len(ws.input_ids[r])
        aux = torch.cat([states[k + 1][i, :n] for k in aux_ids], dim=-1)
        values[tuple(ws.input_ids[r].tolist())] = (aux.to(torch.bfloat16), states[-1][i, :n])
    return values


def write_computed_shard(ws: Workspace, values: dict) -> None:
    def computed(row_tensors):
        aux, final = values[tuple(row_tensors.input_ids.tolist())]
        row_tensors.aux_hidden_states, row_tensors.final_hidden_states = aux, final

    write_shard(ws, tweak=computed)


def test_correct_bf16_dumps_of_an_moe_target_pass(workspace, flippy_moe_dir, sglang_like):
    """Regression: a fixed per-token p99 bound of 0.05 failed correct bf16 data of MoE targets,
    where bf16 noise flips some tokens' expert choice (transformers' own bf16 forward has the
    same tails). Dumps computed in bf16, as an engine computes them, must pass."""
    workspace.config["model"]["path"] = str(flippy_moe_dir)
    workspace.config["validate"]["spot_check_rows"] = 15
    values = engine_batches(workspace, flippy_moe_dir)
    write_computed_shard(workspace, values)
    with sglang_like(values, delay_s=None):
        report = validate_shard(resolve(workspace.config), SHARD, progress=False)
    independent = report["checks"]["spot_check"]["independent_forward"]
    assert independent["ran"] is True
    tails = [v["rel_l2_p99"] for v in independent["layers"].values()]
    assert max(tails) > 0.15, tails  # MoE routing flips: the old per-token bound failed these
    for verdict in independent["layers"].values():
        assert verdict["ok"] and verdict["rel_l2"] <= verdict["noise_bound"], verdict


def test_an_moe_target_dumped_one_layer_off_fails(workspace, flippy_moe_dir, sglang_like):
    workspace.config["model"]["path"] = str(flippy_moe_dir)
    workspace.config["validate"]["spot_check_rows"] = 4
    values = engine_batches(workspace, flippy_moe_dir, aux_ids=(2, 4, 5))
    write_computed_shard(workspace, values)
    with sglang_like(values, delay_s=None):
        failure = expect_failure(workspace, "spot_check")
    assert "independent transformers fp32 forwards on CPU" in str(failure)
    assert "aux_0 (decoder layer 1 output)" in str(failure)


def test_a_truncated_table_or_a_torn_skip_record_is_one_line(tmp_path):
    """Each ended the validate job in a pyarrow or json traceback."""
    from eaglepipe.validate.coverage import load_prepared_rows

    table = tmp_path / "tokenized.parquet"
    table.write_bytes(b"PAR1 and then nothing")
    with pytest.raises(PipelineError, match=r"^prepared table .* cannot be read \(.*\): repair"):
        load_prepared_rows(table, tmp_path / "skipped.json", 0, 4)
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"row_id": [0], "input_ids": [[1, 2]], "loss_mask": [[0, 1]]}
    pq.write_table(pa.table(columns), table)
    (tmp_path / "skipped.json").write_text('{"count": 0, "rea')
    with pytest.raises(PipelineError, match=r"^prepare's skipped rows .* is not valid JSON"):
        load_prepared_rows(table, tmp_path / "skipped.json", 0, 4)
