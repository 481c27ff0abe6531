"""Shard store: chunk planning, streamed checksummed chunks, journal-verified resume, the
per-shard writer lock, the free-space preflight and the manifest reader (synthetic rows)."""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import os
import shutil
import sys
from collections import namedtuple

import pytest
import torch
from conftest import shard_lock_held_elsewhere
from safetensors import safe_open

from eaglepipe.core import atomic
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.fingerprint import hash_bytes, hash_file
from eaglepipe.core.manifest import read_manifest
from eaglepipe.core.shard_job import ShardLock
from eaglepipe.core.space import check_free_space
from eaglepipe.extract.chunk_file import (
    RowTensors,
    open_chunk,
    plan_chunks,
    plan_digest,
    write_chunk,
)
from eaglepipe.extract.shard_files import (
    HIDDEN_STATES_MANIFEST,
    append_journal,
    build_manifest,
    iter_rows,
    verified_chunks,
    write_manifest,
)

H = 8


def make_row(row_id: int, num_tokens: int) -> RowTensors:
    g = torch.Generator().manual_seed(row_id)
    return RowTensors(
        row_id=row_id,
        input_ids=torch.randint(0, 300, (num_tokens,), generator=g, dtype=torch.int32),
        loss_mask=torch.randint(0, 2, (num_tokens,), generator=g, dtype=torch.uint8),
        aux_hidden_states=torch.randn(num_tokens, 3 * H, generator=g).to(torch.bfloat16),
        final_hidden_states=torch.randn(num_tokens, H, generator=g).to(torch.bfloat16),
    )


def test_rows_without_torch_write_the_same_chunk_bytes(tmp_path):
    """What the extraction job hands the writer (numpy ids and masks, the dump's bf16 bytes as
    RawTensors) makes the very file torch tensors make; a uint16 array never passes for bf16."""
    from eaglepipe.core.tensor_bytes import RawTensor

    rows = [make_row(i, t) for i, t in [(2, 5), (4, 1), (9, 7)]]
    raw_rows = [
        RowTensors(
            row_id=r.row_id,
            input_ids=r.input_ids.numpy(),
            loss_mask=r.loss_mask.numpy(),
            aux_hidden_states=RawTensor(r.aux_hidden_states.view(torch.uint16).numpy(), "BF16"),
            final_hidden_states=RawTensor(r.final_hidden_states.view(torch.uint16).numpy(), "BF16"),
        )
        for r in rows
    ]
    (tmp_path / "torch").mkdir()
    (tmp_path / "raw").mkdir()
    with_torch = write_chunk(tmp_path / "torch", 0, rows, hidden_size=H)
    without = write_chunk(tmp_path / "raw", 0, raw_rows, hidden_size=H)
    assert with_torch == without
    name = with_torch.file
    assert (tmp_path / "torch" / name).read_bytes() == (tmp_path / "raw" / name).read_bytes()
    plain = raw_rows[0]
    plain.final_hidden_states = plain.final_hidden_states.data  # bf16 bits, dtype unknown
    with pytest.raises(PipelineError, match="final_hidden_states is uint16 .*expected torch.bf"):
        write_chunk(tmp_path / "raw", 1, [plain], hidden_size=H)


def test_plan_is_greedy_in_row_order_and_isolates_big_rows():
    per_token = 4 * H * 2 + 5
    bound = 10 * per_token + 100
    row_ids = [7, 3, 5, 9, 11]
    tokens = [4, 4, 4, 30, 2]  # given out of order: the plan sorts by row id
    chunks = plan_chunks(row_ids, tokens, H, max_chunk_bytes=bound)
    assert chunks == [[3, 5], [7], [9], [11]]
    assert plan_chunks(row_ids, tokens, H, max_chunk_bytes=bound) == chunks
    assert plan_chunks(row_ids, tokens, H, max_chunk_bytes=10**9) == [[3, 5, 7, 9, 11]]


def test_chunk_loads_with_safetensors_and_hash_matches(tmp_path):
    rows = [make_row(i, t) for i, t in [(2, 5), (4, 1), (9, 7)]]
    record = write_chunk(tmp_path, 0, rows, hidden_size=H)
    path = tmp_path / "chunk-00000.safetensors"
    assert record.file == path.name
    assert record.bytes == path.stat().st_size
    assert record.xxh3_128 == hash_file(path)
    assert record.row_ids == [2, 4, 9] and record.num_tokens == 13
    assert not list(tmp_path.glob("*.tmp"))
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("row_ids").tolist() == [2, 4, 9]
        assert f.get_tensor("offsets").tolist() == [0, 5, 6, 13]
        aux = f.get_tensor("aux_hidden_states")
        assert aux.dtype == torch.bfloat16 and aux.shape == (13, 3 * H)
        assert torch.equal(aux[6:13], rows[2].aux_hidden_states)
        assert torch.equal(f.get_tensor("input_ids")[0:5], rows[0].input_ids)
    with open_chunk(path) as reader:
        for i, row in enumerate(rows):
            got = reader.row(i)
            assert torch.equal(got["final_hidden_states"], row.final_hidden_states)
            assert torch.equal(got["loss_mask"], row.loss_mask)


def test_chunk_refuses_rows_of_the_wrong_shape(tmp_path):
    row = make_row(0, 4)
    row.aux_hidden_states = row.aux_hidden_states[:, :H]
    with pytest.raises(PipelineError, match="row 0: aux_hidden_states"):
        write_chunk(tmp_path, 0, [row], hidden_size=H)
    assert not list(tmp_path.iterdir())


def _write_shard(shard_dir, chunks, digest, tokens=3):
    records = {}
    for index, ids in enumerate(chunks):
        record = write_chunk(shard_dir, index, [make_row(i, tokens) for i in ids], hidden_size=H)
        append_journal(shard_dir, record, digest)
        records[index] = record
    return records


def test_a_full_disk_while_journalling_a_chunk_names_the_journal(tmp_path):
    """Both shard stores append their journal lines the same way (core/journal.py): a disk
    that fills ends in one line naming the journal, and the torn line is dropped on resume."""
    from conftest import small_filesystem

    shard_dir = tmp_path / "shard"
    with small_filesystem(shard_dir, 64 * 1024):
        record = write_chunk(shard_dir, 0, [make_row(0, 3)], hidden_size=H)
        append_journal(shard_dir, record, "digest")
        filler = shard_dir / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError):  # the file system is full
                for _ in range(64):
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        with pytest.raises(PipelineError, match="no space left .* while writing journal.jsonl"):
            for _ in range(64):
                append_journal(shard_dir, record, "digest", extra={"pad": "x" * 1000})
        filler.unlink()
        assert verified_chunks(shard_dir, [[0]], "digest").keys() == {0}


def test_resume_keeps_verified_chunks_and_clears_the_rest(tmp_path):
    chunks = [[0, 1], [2, 3], [4, 5], [6]]
    digest = plan_digest(chunks, {"model": "a"})
    _write_shard(tmp_path, chunks, digest)
    kept = tmp_path / "chunk-00000.safetensors"
    mtime = kept.stat().st_mtime_ns
    # chunk 1 truncated, chunk 2 renamed but never journalled (killed in between), chunk 3 fine.
    truncated = tmp_path / "chunk-00001.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-10])
    journal = (tmp_path / "journal.jsonl").read_text().splitlines()
    (tmp_path / "journal.jsonl").write_text(
        "\n".join([journal[0], journal[1], journal[3]]) + "\n" + '{"file": "chunk-0'
    )
    (tmp_path / ".chunk-00004.safetensors.tmp").write_bytes(b"partial")
    (tmp_path / "chunk-00009.safetensors").write_bytes(b"from an older plan")

    done = verified_chunks(tmp_path, chunks, digest)

    assert sorted(done) == [0, 3]
    assert done[0].row_ids == [0, 1]
    assert kept.stat().st_mtime_ns == mtime
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["chunk-00000.safetensors", "chunk-00003.safetensors", "journal.jsonl"]
    entries = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert [e["file"] for e in entries] == ["chunk-00000.safetensors", "chunk-00003.safetensors"]


def test_resume_trusts_nothing_from_another_plan_or_content(tmp_path):
    chunks = [[0, 1], [2]]
    _write_shard(tmp_path, chunks, plan_digest(chunks, {"model": "a"}))
    assert verified_chunks(tmp_path, chunks, plan_digest(chunks, {"model": "b"})) == {}
    assert not list(tmp_path.glob("chunk-*"))

    _write_shard(tmp_path, chunks, plan_digest(chunks, {"model": "a"}))
    other = [[0], [1, 2]]
    assert verified_chunks(tmp_path, other, plan_digest(chunks, {"model": "a"})) == {}


def test_bit_flip_is_caught_by_the_rehash(tmp_path):
    chunks = [[0, 1]]
    digest = plan_digest(chunks, {})
    _write_shard(tmp_path, chunks, digest)
    path = tmp_path / "chunk-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert verified_chunks(tmp_path, chunks, digest) == {}
    assert not path.exists()


def test_manifest_roundtrip_and_iter_rows(tmp_path):
    chunks = [[0, 1], [5]]
    records = _write_shard(tmp_path, chunks, "d", tokens=4)
    manifest = build_manifest(
        shard="rows_0-8",
        row_start=0,
        row_end=8,
        hidden_size=H,
        aux_layer_ids=[1, 3, 4],
        records=[records[0], records[1]],
        provenance={"engine": "test"},
        timing={"requests_sent": 3},
    )
    path = write_manifest(tmp_path, manifest)
    loaded, digest = read_manifest(path, HIDDEN_STATES_MANIFEST)
    assert loaded == manifest
    assert loaded["num_rows"] == 3 and loaded["num_tokens"] == 12
    assert loaded["num_bytes"] == sum(r.bytes for r in records.values())
    assert read_manifest(tmp_path, HIDDEN_STATES_MANIFEST) == (manifest, digest)
    assert digest == hash_bytes(path.read_bytes())
    got = list(iter_rows(tmp_path))
    assert [r for r, _ in got] == [0, 1, 5]
    assert torch.equal(got[2][1]["aux_hidden_states"], make_row(5, 4).aux_hidden_states)


def test_read_manifest_errors_name_the_file(tmp_path):
    with pytest.raises(PipelineError, match="manifest.json does not exist"):
        read_manifest(tmp_path / "manifest.json", HIDDEN_STATES_MANIFEST)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(PipelineError, match="manifest.json is not valid JSON"):
        read_manifest(tmp_path / "manifest.json", HIDDEN_STATES_MANIFEST)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(PipelineError, match="lacks key"):
        read_manifest(tmp_path / "manifest.json", HIDDEN_STATES_MANIFEST)


def test_one_manifest_reader_checks_each_stages_shape_and_the_shard(tmp_path):
    """Hidden-state and regenerated shards are read by the same function, each in its shape."""
    from eaglepipe.regenerate.store import REGENERATED_MANIFEST

    path = tmp_path / "manifest.json"
    keys = dict.fromkeys(HIDDEN_STATES_MANIFEST.keys, 0)
    path.write_text(json.dumps({**keys, "format_version": 99, "chunks": []}))
    with pytest.raises(PipelineError, match="has format_version 99, this eaglepipe reads"):
        read_manifest(path, HIDDEN_STATES_MANIFEST)
    version = HIDDEN_STATES_MANIFEST.format_version
    path.write_text(json.dumps({**keys, "format_version": version, "chunks": [{"file": "c"}]}))
    with pytest.raises(PipelineError, match=r"chunks\[0\] lacks key\(s\) bytes, xxh3_128"):
        read_manifest(path, HIDDEN_STATES_MANIFEST)
    path.write_text(json.dumps({**keys, "format_version": version, "chunks": {}}))
    with pytest.raises(PipelineError, match="chunks must be a list"):
        read_manifest(path, HIDDEN_STATES_MANIFEST)
    path.write_text(json.dumps({**keys, "format_version": version, "chunks": [], "shard": "a"}))
    with pytest.raises(PipelineError, match="describes shard 'a', not rows_0-8"):
        read_manifest(tmp_path, HIDDEN_STATES_MANIFEST, shard="rows_0-8")
    # The regenerated shape: its own keys and message, no format version or entry list.
    with pytest.raises(PipelineError, match="regenerated shard manifest .* lacks key.*rows_file"):
        read_manifest(path, REGENERATED_MANIFEST)
    regenerated = dict.fromkeys(REGENERATED_MANIFEST.keys, 1)
    path.write_text(json.dumps(regenerated))
    assert read_manifest(path, REGENERATED_MANIFEST) == (regenerated, hash_bytes(path.read_bytes()))
    path.unlink()
    with pytest.raises(PipelineError, match="manifest.json does not exist: run snakemake"):
        read_manifest(path, REGENERATED_MANIFEST)


def test_second_writer_is_refused_naming_the_pid(tmp_path):
    with shard_lock_held_elsewhere(tmp_path) as holder:
        with pytest.raises(PipelineError, match=rf"PID {holder.pid} on host"):
            ShardLock(tmp_path).acquire()
    # The kernel dropped the dead holder's flock: the next writer gets in.
    with ShardLock(tmp_path):
        pass


def test_free_space_preflight(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    target = tmp_path / "hidden_states" / "rows_0-8"
    with pytest.raises(PipelineError, match=r"needs 2\.0 KB but only 1\.0 KB is free"):
        check_free_space(2000, target, "shard rows_0-8")
    check_free_space(999, target, "shard rows_0-8")
    assert not (tmp_path / "hidden_states").exists()


def test_disk_full_mid_chunk_is_a_clear_error_and_leaves_nothing(tmp_path):
    # The temp name points at /dev/full, which fails every write with ENOSPC.
    (tmp_path / ".chunk-00000.safetensors.tmp").symlink_to("/dev/full")
    with pytest.raises(PipelineError, match=r"no space left .* writing chunk-00000.*rows 0\.\.1"):
        write_chunk(tmp_path, 0, [make_row(0, 3), make_row(1, 2)], hidden_size=H)
    assert not list(tmp_path.iterdir())


def test_chunk_pages_go_to_the_disk_while_the_chunk_is_written(tmp_path, monkeypatch):
    """Every WRITEBACK_STEP bytes the range just written is handed to the disk (the disk works
    while a GiB-sized chunk fills instead of idling until its fsync): the ranges are contiguous
    from byte 0, each at least a step, together nearly the whole file; the bytes and checksum
    are those of a chunk written without it."""
    real = atomic._sync_file_range
    calls = []

    def recorder(fd, offset, length, flags):
        calls.append((offset, length, flags))
        return real(fd, offset, length, flags) if real is not None else 0

    rows = [make_row(i, 40) for i in range(6)]
    monkeypatch.setattr(atomic, "_sync_file_range", None)
    (tmp_path / "plain").mkdir()
    (tmp_path / "paced").mkdir()
    plain = write_chunk(tmp_path / "plain", 0, rows, hidden_size=H)
    monkeypatch.setattr(atomic, "_sync_file_range", recorder)
    monkeypatch.setattr(atomic, "WRITEBACK_STEP", 1024)
    paced = write_chunk(tmp_path / "paced", 0, rows, hidden_size=H)

    assert (paced.bytes, paced.xxh3_128) == (plain.bytes, plain.xxh3_128)
    assert len(calls) >= 5
    assert [offset for offset, _, _ in calls] == [0] + list(
        itertools.accumulate(length for _, length, _ in calls[:-1])
    )
    assert all(length >= 1024 and flags == 2 for _, length, flags in calls)
    covered = calls[-1][0] + calls[-1][1]
    assert paced.bytes - 40 * 3 * H * 2 <= covered <= paced.bytes  # within one row's section


def test_a_writeback_step_of_zero_leaves_the_chunk_to_the_kernel(tmp_path, monkeypatch):
    """`writeback_bytes=0` (extract.chunk_writeback_mb: 0) never calls sync_file_range, where
    1 KiB hands a 30 KB chunk over in steps; the two files are the same."""
    calls = []
    monkeypatch.setattr(atomic, "_sync_file_range", lambda *args: calls.append(args) or 0)
    rows = [make_row(i, 40) for i in range(6)]
    records = {}
    for step in (0, 1024):
        (tmp_path / str(step)).mkdir()
        records[step] = write_chunk(tmp_path / str(step), 0, rows, hidden_size=H,
                                    writeback_bytes=step)  # fmt: skip
        if step == 0:
            assert calls == []
    assert len(calls) >= 5
    assert (records[0].bytes, records[0].xxh3_128) == (records[1024].bytes, records[1024].xxh3_128)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_writeback_binding_reaches_the_kernel(tmp_path):
    """The ctypes binding is the real call: 0 for a file's range, EBADF for a closed fd."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    with open(path, "r+b") as f:
        assert atomic._sync_file_range(f.fileno(), 0, 8192, 2) == 0
        fd = f.fileno()
    assert atomic._sync_file_range(fd, 0, 8192, 2) == -1
    assert ctypes.get_errno() == errno.EBADF
