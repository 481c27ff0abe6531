"""The validation gate: each kind of damage is caught by its named check, and no report is left.

Shards are written with the real shard store writer (`shard_store.write_chunk`), then damaged
the way a disk, a copy or a buggy extractor would damage them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import PYTHON, REPO_ROOT

from eaglepipe import shard_store
from eaglepipe.config import load_config
from eaglepipe.extract import extract_shard
from eaglepipe.server.lifecycle import stop_server
from eaglepipe.validate import (
    ShardPaths,
    StoredRow,
    ValidationFailure,
    compare_rows,
    expected_provenance,
    independent_forward,
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
    input_ids, loss_masks = write_prepared(tmp_path, config, 32, {SKIPPED_ROW})
    return Workspace(tmp_path, config, input_ids, loss_masks)


def synthetic_row(ws: Workspace, row: int, scale: float = 1.0) -> shard_store.RowTensors:
    generator = torch.Generator().manual_seed(row)
    tokens = len(ws.input_ids[row])
    return shard_store.RowTensors(
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


def write_shard(
    ws: Workspace,
    shard: str = SHARD,
    chunks: list[list[int]] = CHUNKS,
    tweak=None,
    scale: float = 1.0,
    provenance: dict | None = None,
) -> Path:
    """A shard written with the real chunk writer; `tweak(row_tensors)` damages rows first."""
    start, end = (int(x) for x in shard.removeprefix("rows_").split("-"))
    shard_dir = ws.shard_dir(shard)
    shard_dir.mkdir(parents=True)
    records = []
    for index, rows in enumerate(chunks):
        tensors = [synthetic_row(ws, row, scale) for row in rows]
        if tweak:
            for row_tensors in tensors:
                tweak(row_tensors)
        records.append(shard_store.write_chunk(shard_dir, index, tensors, hidden_size=HIDDEN))
    provenance = provenance or {
        **expected_provenance(ws.config),
        "shard_inputs_hash": shard.ljust(32, "0"),
        "engine": "reference",
        "engine_version": "test",
        "project_version": "0.1.0",
    }
    manifest = shard_store.build_manifest(
        shard=shard,
        row_start=start,
        row_end=end,
        hidden_size=HIDDEN,
        aux_layer_ids=provenance["aux_layer_ids"],
        records=records,
        provenance=provenance,
        timing={"seconds": 1.0},
    )
    shard_store.write_manifest(shard_dir, manifest)
    return shard_dir


def expect_failure(ws: Workspace, check: str, shard: str = SHARD) -> ValidationFailure:
    with pytest.raises(ValidationFailure) as info:
        validate_shard(ws.config, shard, progress=False)
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
    report = validate_shard(workspace.config, SHARD, progress=False)
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


def test_later_shard_is_checked_against_the_first_validated_one(workspace):
    write_shard(workspace)
    validate_shard(workspace.config, SHARD, progress=False)
    write_shard(workspace, "rows_16-32", [list(range(16, 24)), list(range(24, 32))])
    report = validate_shard(workspace.config, "rows_16-32", progress=False)
    assert report["layer_norm_reference"] == SHARD
    ratios = report["checks"]["values"]["norm_ratio_to_reference"]
    assert all(0.8 < r < 1.25 for r in ratios.values())


def test_norm_drift_beyond_the_factor_fails_naming_the_layer(workspace):
    write_shard(workspace)
    validate_shard(workspace.config, SHARD, progress=False)
    write_shard(workspace, "rows_16-32", [list(range(16, 32))], scale=10.0)
    failure = expect_failure(workspace, "values", "rows_16-32")
    assert "aux_0" in str(failure) and "reference shard rows_0-16" in str(failure)


def test_a_rerun_that_fails_removes_the_earlier_report(workspace):
    shard_dir = write_shard(workspace)
    validate_shard(workspace.config, SHARD, progress=False)
    assert workspace.report().exists()
    (shard_dir / "chunk-00002.safetensors").unlink()
    expect_failure(workspace, "integrity")


def test_shard_whose_rows_prepare_all_skipped_passes_empty(workspace):
    skipped = {"count": 16, "reasons": {"no assistant tokens": 16}}
    skipped["rows"] = [{"row_id": r, "reason": "no assistant tokens"} for r in range(32, 48)]
    (workspace.root / "prepared" / "skipped.json").write_text(json.dumps(skipped))
    write_shard(workspace)
    validate_shard(workspace.config, SHARD, progress=False)
    write_shard(workspace, "rows_32-48", [])
    report = validate_shard(workspace.config, "rows_32-48", progress=False)
    assert report["num_rows"] == 0 and report["checks"]["coverage"]["skipped_rows"] == 16
    assert report["checks"]["values"]["norm_ratio_to_reference"] is None
    # an empty shard is never the norm reference of a later one
    write_shard(workspace, "rows_16-32", [list(range(16, 32))])
    later = validate_shard(workspace.config, "rows_16-32", progress=False)
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
    def corrupt(row: shard_store.RowTensors) -> None:
        if row.row_id == 9:
            row.input_ids = row.input_ids.clone()
            row.input_ids[2] += 1

    write_shard(workspace, tweak=corrupt)
    failure = expect_failure(workspace, "coverage")
    assert failure.row == 9 and failure.chunk == "chunk-00001.safetensors"
    assert "input_ids of row 9 differs from the prepared table at token 2" in str(failure)


def test_loss_mask_differing_from_the_prepared_table_fails_coverage(workspace):
    def corrupt(row: shard_store.RowTensors) -> None:
        if row.row_id == 12:
            row.loss_mask = 1 - row.loss_mask

    write_shard(workspace, tweak=corrupt)
    failure = expect_failure(workspace, "coverage")
    assert failure.row == 12 and "loss_mask" in str(failure)


# --- values -------------------------------------------------------------------------------


def test_zeroed_sample_fails_values_naming_row_and_layer(workspace):
    def zero(row: shard_store.RowTensors) -> None:
        if row.row_id == 8:
            row.final_hidden_states = torch.zeros_like(row.final_hidden_states)

    write_shard(workspace, tweak=zero)
    failure = expect_failure(workspace, "values")
    assert failure.row == 8 and failure.chunk == "chunk-00001.safetensors"
    assert "final (post-norm) are all zero" in str(failure)


def test_constant_aux_layer_fails_values(workspace):
    def flatten(row: shard_store.RowTensors) -> None:
        if row.row_id == 13:
            row.aux_hidden_states = row.aux_hidden_states.clone()
            row.aux_hidden_states[:, HIDDEN : 2 * HIDDEN] = 0.5

    write_shard(workspace, tweak=flatten)
    failure = expect_failure(workspace, "values")
    assert failure.row == 13 and "aux_1 (decoder layer 3 output) are constant (0.5)" in str(failure)


def test_non_finite_value_fails_values(workspace):
    def poison(row: shard_store.RowTensors) -> None:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(workspace):
    """The workspace set up for the real lifecycle and reference server; server stopped after."""
    config = workspace.config
    # Extraction records the workflow's provenance of the shard: the target needs its
    # tokenizer files and the prepared table a source whose plan holds the shard.
    from tokenizers import Tokenizer, models

    from eaglepipe.fingerprint import tokenizer_fingerprint

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
    manifest = extract_shard(served.config, SHARD, log=lambda line: None)
    assert len(manifest["chunks"]) > 1
    report = validate_shard(served.config, SHARD, progress=False)
    spot = report["checks"]["spot_check"]
    assert len(spot["rows"]) == 4 and set(spot["rows"]) <= set(range(16)) - {SKIPPED_ROW}
    # each re-extraction ran alone on the server: the exclusive lease kept everything else out
    assert spot["server"]["batch_sizes"] == [1, 1, 1, 1]
    for layers in (spot["reextract"], spot["independent_forward"]["layers"]):
        assert set(layers) == {"aux_0", "aux_1", "aux_2", "final"}
        # bf16 storage rounding only
        assert all(v["rel_l2_p99"] < 0.01 and v["cosine_p1"] > 0.9999 for v in layers.values())
    assert spot["independent_forward"]["ran"] is True
    assert served.report().exists()
    # the same seed and shard pick the same rows
    again = validate_shard(served.config, SHARD, progress=False)
    assert again["checks"]["spot_check"]["rows"] == spot["rows"]


def test_layer_shift_in_batched_requests_is_caught_by_the_spot_check(served, monkeypatch):
    monkeypatch.setenv("EAGLEPIPE_FAULT", "shift_layer_batched")
    # The server comparison alone must catch it (the independent forward would too).
    served.config["validate"]["independent_forward"] = False
    extract_shard(served.config, SHARD, log=lambda line: None)
    failure = expect_failure(served, "spot_check")
    message = str(failure)
    assert "re-extraction of the row alone through the server" in message
    assert failure.chunk and failure.chunk.startswith("chunk-") and failure.row in range(16)
    assert f"chunk {failure.chunk}, row {failure.row}" in message
    assert "aux_0 (decoder layer 1 output)" in message


def test_independent_forward_tells_a_layer_offset_from_bf16_rounding(workspace):
    """Stored tensors one layer off (a layer-offset bug applied to every request, which a
    re-extraction through the same server would reproduce) disagree with the independent
    forward; the same tensors rounded to bf16 agree."""
    rows = [
        StoredRow(row, "chunk-00000.safetensors", workspace.input_ids[row].tolist(), None, None)
        for row in (0, 1, 2)
    ]
    right = independent_forward(workspace.config, rows, [1, 3, 4])
    off_by_one = independent_forward(workspace.config, rows, [2, 4, 5])
    for row in rows:
        row.aux, row.final = (t.to(torch.bfloat16).float() for t in right[row.row_id])
    args = ("an independent forward", rows)
    layers = compare_rows(SHARD, *args, right, HIDDEN, [1, 3, 4], 0.05, 0.995)
    assert all(v["rel_l2_p99"] < 0.01 for v in layers.values())
    with pytest.raises(ValidationFailure) as info:
        compare_rows(SHARD, *args, off_by_one, HIDDEN, [1, 3, 4], 0.05, 0.995)
    assert info.value.check == "spot_check" and info.value.row in (0, 1, 2)
    assert "aux_0 (decoder layer 1 output) disagrees with an independent forward" in str(info.value)
