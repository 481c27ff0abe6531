"""The dump handoff: request ids, the 0700 handoff dir, DumpWriter's files, atomicity, errors."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

import eaglepipe.server.handoff.dump_writer as dump_module
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.hidden_store import BF16_STORE
from eaglepipe.server.handoff.dump_writer import DumpWriter, _HostBufferPool
from eaglepipe.server.handoff.dumps import (
    AUX_KEY,
    FINAL_KEY,
    DumpNotWritten,
    await_dump,
    concat_aux,
    dump_path,
    failed_dump_path,
    prepare_dump_dir,
    read_dump,
    take_dump_failure,
    temp_dump_path,
    wait_for_dump,
)
from eaglepipe.server.handoff.request_ids import is_pipeline_rid, make_rid, parse_rid

PYTHON = sys.executable
NONCE = "0123456789ab"
IDS = [1, 3, 4]
HIDDEN = 8


def rid(row: int, attempt: int = 0) -> str:
    return make_rid("eaglepipe", NONCE, row, attempt)


def packed_batch(counts: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(counts)
    return (
        torch.randn(total, 3 * HIDDEN, generator=gen),
        torch.randn(total, HIDDEN, generator=gen),
    )


# ----------------------------------------------------------------------------- request ids


def test_rid_round_trip():
    text = make_rid("eaglepipe", NONCE, 1234, 2)
    assert text == "eaglepipe-0123456789ab-1234-2"
    assert parse_rid(text) == ("eaglepipe", NONCE, 1234, 2)
    assert is_pipeline_rid(text, "eaglepipe")
    assert not is_pipeline_rid(text, "eagle")
    assert not is_pipeline_rid("health-abc", "eaglepipe")
    assert not is_pipeline_rid("eaglepipe", "eaglepipe")


@pytest.mark.parametrize(
    "bad",
    [
        "eaglepipe-0123456789ab-12",  # no attempt
        "eaglepipe-0123456789AB-1-0",  # upper-case nonce
        "eaglepipe-0123456789a-1-0",  # short nonce
        "eaglepipe-0123456789ab--1-0",  # negative row
        "eagle-pipe-0123456789ab-1-0",  # dash in prefix
        "eaglepipe-0123456789ab-1-0/../x",
        "",
    ],
)
def test_parse_rid_rejects_malformed(bad):
    with pytest.raises(PipelineError, match="request id"):
        parse_rid(bad)


def test_make_rid_rejects_bad_parts():
    with pytest.raises(PipelineError, match="nonce"):
        make_rid("eaglepipe", "xyz", 1, 0)
    with pytest.raises(PipelineError, match="prefix"):
        make_rid("eagle-pipe", NONCE, 1, 0)
    with pytest.raises(PipelineError, match="non-negative"):
        make_rid("eaglepipe", NONCE, -1, 0)


def test_dump_path_refuses_names_that_escape_the_dir(tmp_path):
    assert dump_path(tmp_path, rid(5)) == tmp_path / f"{rid(5)}.safetensors"
    for bad in ("eaglepipe-x/../../etc", ".hidden", "a/b"):
        with pytest.raises(PipelineError, match="cannot name a dump file"):
            dump_path(tmp_path, bad)


# ----------------------------------------------------------------------------- directory


def test_prepare_dump_dir_creates_0700_with_parents(tmp_path):
    target = tmp_path / "root" / "instance"
    assert prepare_dump_dir(target) == target
    for directory in (target, target.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_prepare_dump_dir_fixes_mode_of_own_dir(tmp_path):
    target = tmp_path / "open"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    prepare_dump_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_prepare_dump_dir_refuses_foreign_owner(tmp_path, monkeypatch):
    target = tmp_path / "theirs"
    target.mkdir()
    owner = target.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    with pytest.raises(PipelineError, match=rf"owned by .*\(uid {owner}\), not by this user"):
        prepare_dump_dir(target)


def test_prepare_dump_dir_refuses_symlink_and_file(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(PipelineError, match="symlink"):
        prepare_dump_dir(link)
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(PipelineError, match="not a directory"):
        prepare_dump_dir(plain)


# Another user, as the test (root) can make one: a uid no account has.
OTHER_UID = 54321


@pytest.fixture
def as_root():
    if os.getuid() != 0:
        pytest.skip("needs root to give files to another user")


def test_a_parent_symlink_to_another_users_directory_is_refused(tmp_path, as_root):
    # The case: dump_root /tmp/x/sub/root with sub -> a directory another user owns.
    victim = tmp_path / "victim"
    victim.mkdir()
    os.chown(victim, OTHER_UID, OTHER_UID)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "sub").symlink_to(victim)
    with pytest.raises(PipelineError) as info:
        prepare_dump_dir(tmp_path / "x" / "sub" / "root", what="server.dump_root")
    message = str(info.value)
    assert f"is reached through {victim}, a directory owned by uid {OTHER_UID}" in message
    assert "server.dump_root" in message
    assert not (victim / "root").exists()


def test_a_parent_symlink_another_user_owns_is_refused(tmp_path, as_root):
    # Our directory behind it, but the link is theirs: they decide where it leads.
    ours = tmp_path / "ours"
    ours.mkdir()
    (tmp_path / "sticky").mkdir(mode=0o1777)
    os.chmod(tmp_path / "sticky", 0o1777)
    link = tmp_path / "sticky" / "link"
    link.symlink_to(ours)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(PipelineError, match=rf"through {link}, a symlink owned by uid {OTHER_UID}"):
        prepare_dump_dir(link / "root")
    assert not (ours / "root").exists()


def test_a_parent_directory_another_user_owns_or_may_write_is_refused(tmp_path, as_root):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(PipelineError, match=rf"through {theirs}, a directory owned by uid"):
        prepare_dump_dir(theirs / "root")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)  # group members could rename what it holds
    with pytest.raises(PipelineError, match=rf"through {shared}, a directory others may write"):
        prepare_dump_dir(shared / "deeper" / "root")
    assert not (shared / "deeper").exists()


def test_sticky_parents_and_our_own_symlinks_are_followed_to_the_real_path(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp and /dev/shm
    real = sticky / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    root = prepare_dump_dir(tmp_path / "alias" / "sub" / "root")
    assert root == real / "sub" / "root" and root.is_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


# ----------------------------------------------------------------------------- reading


def test_read_dump_names_the_file_when_broken(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(PipelineError, match="nope.safetensors does not exist"):
        read_dump(missing)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 50)
    with pytest.raises(PipelineError, match="garbage.safetensors is unreadable"):
        read_dump(garbage)
    wrong = tmp_path / "wrong.safetensors"
    meta = {"rid": "r", "num_tokens": "3", "hidden_size": "4", "aux_layer_ids": "1,2,3"}
    save_file({AUX_KEY: torch.zeros(3, 12, dtype=torch.bfloat16)} | {
        FINAL_KEY: torch.zeros(3, 4, dtype=torch.bfloat16)}, str(wrong), metadata=meta)  # fmt: skip
    with pytest.raises(PipelineError, match="bad or missing metadata .*batch_requests"):
        read_dump(wrong)
    meta |= {"batch_requests": "1", "batch_tokens": "3"}
    tensors = {
        AUX_KEY: torch.zeros(3, 12, dtype=torch.bfloat16),
        FINAL_KEY: torch.zeros(2, 4, dtype=torch.bfloat16),
    }
    save_file(tensors, str(wrong), metadata=meta)
    with pytest.raises(PipelineError, match=r"final_hidden_states is torch.bfloat16 \[2, 4\]"):
        read_dump(wrong)


def test_the_torch_free_reader_maps_what_safetensors_wrote_and_refuses_torn_files(tmp_path):
    from eaglepipe.core.tensor_bytes import read_safetensors

    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int32),
        "c": torch.zeros(0, 4, dtype=torch.float32),
        "d": torch.tensor([1, 0, 1], dtype=torch.uint8),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    metadata, raw = read_safetensors(path)
    assert metadata == {"k": "v"} and sorted(raw) == ["a", "b", "c", "d"]
    assert raw["a"].dtype == "BF16" and raw["a"].shape == (3, 5)
    for name, tensor in tensors.items():
        assert torch.equal(raw[name].to_torch(), tensor)
    path.unlink()  # the tensors map the file: they outlive its name
    assert torch.equal(raw["a"].to_torch(), tensors["a"])
    save_file(tensors, str(path), metadata={"k": "v"})
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])  # torn: one byte short
    with pytest.raises(ValueError, match="the tensors end at byte"):
        read_safetensors(path)
    path.write_bytes(whole[:8] + b"}" + whole[9:])  # the header is no longer JSON
    with pytest.raises(ValueError, match="not JSON"):
        read_safetensors(path)


def test_concat_aux_packs_layers_side_by_side():
    layers = [torch.full((2, 3), float(i)) for i in range(3)]
    packed = concat_aux(layers)
    assert packed.shape == (2, 9)
    assert torch.equal(packed[:, 3:6], layers[1])
    assert concat_aux(packed) is packed


# ----------------------------------------------------------------------------- writer


def test_writer_splits_batch_per_request_and_filters_prefix(tmp_path):
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    counts = [3, 1, 5, 2]
    rids = [rid(10), "health-1234", rid(11), "other-0123456789ab-1-0"]
    aux, final = packed_batch(counts)
    done: list[tuple[str, BaseException | None]] = []
    with DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS) as writer:
        writer.submit(rids, counts, aux, final, on_done=lambda r, e: done.append((r, e)))
        writer.flush()
        assert writer.files_written == 2
    assert sorted(done, key=str) == sorted([(r, None) for r in rids], key=str)
    assert sorted(p.name for p in dump_dir.iterdir()) == sorted(
        [f"{rid(10)}.safetensors", f"{rid(11)}.safetensors"]
    )
    offsets = {rid(10): (0, 3), rid(11): (4, 9)}
    for name, (start, end) in offsets.items():
        got_aux, got_final, meta = read_dump(dump_dir / f"{name}.safetensors")
        assert meta == {
            "rid": name,
            "num_tokens": end - start,
            "hidden_size": HIDDEN,
            "aux_layer_ids": IDS,
            # the whole forward pass: every request in it, ours or not, and its real tokens
            "batch_requests": 4,
            "batch_tokens": 11,
            "store": BF16_STORE,  # what its dtypes make (the writer's default store)
        }
        assert torch.equal(got_aux, aux[start:end].to(torch.bfloat16))
        assert torch.equal(got_final, final[start:end].to(torch.bfloat16))


def test_writer_rejects_inconsistent_batch(tmp_path):
    aux, final = packed_batch([2, 2])
    with DumpWriter(tmp_path, "eaglepipe", aux_layer_ids=IDS) as writer:
        with pytest.raises(PipelineError, match="does not match"):
            writer.submit([rid(1), rid(2)], [2, 3], aux, final)
        with pytest.raises(PipelineError, match="does not match"):
            writer.submit([rid(1)], [4], aux[:, :HIDDEN], final)


def test_waiting_for_a_dump_returns_once_the_writer_has_renamed_it(tmp_path, monkeypatch):
    """The one wait the client and the spot check share: it returns when the writer's rename
    lands, which on SGLang comes after the HTTP answer; the file read then is complete."""
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    real_save = dump_module.save_file

    def slow_save(tensors, filename, metadata=None):
        time.sleep(0.3)  # a large target's dump takes a while to write
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(dump_module, "save_file", slow_save)
    aux, final = packed_batch([5])
    with DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS) as writer:
        writer.submit([rid(3)], [5], aux, final)  # returns before the file exists
        path = dump_path(dump_dir, rid(3))
        assert not path.exists()
        assert wait_for_dump(path, within_s=30) == path
        got_aux, _, meta = read_dump(path)
    assert meta["num_tokens"] == 5 and meta["batch_requests"] == 1 and meta["batch_tokens"] == 5
    assert torch.equal(got_aux, aux.to(torch.bfloat16))
    assert asyncio.run(await_dump(path, within_s=0)) == path


def test_a_dump_that_never_lands_names_the_request(tmp_path):
    path = dump_path(prepare_dump_dir(tmp_path / "dumps"), rid(4))
    with pytest.raises(
        DumpNotWritten,
        match=rf"answered request {rid(4)} but wrote no dump .*; the handoff .* has .* free",
    ):
        wait_for_dump(path, within_s=0.05)
    # A temp file of a write in progress is not a dump.
    temp_dump_path(path.parent, rid(4)).write_bytes(b"partial")
    with pytest.raises(DumpNotWritten):
        asyncio.run(await_dump(path, within_s=0.05))


# Runs in its own process (as the client does): in-process, the GIL would serialize it with
# the writer's save_file and it could never catch a write half-done.
READER_SCRIPT = """
import json, sys
from pathlib import Path
from eaglepipe.server.handoff.request_ids import parse_rid
from eaglepipe.server.handoff.dumps import read_dump
from eaglepipe.core.errors import PipelineError
dump_dir, stop_file, tokens = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
seen, errors, passes = set(), [], 0
print("ready", flush=True)
while True:
    finished = stop_file.exists()
    passes += 1
    for path in list(dump_dir.iterdir()):
        if path.name.startswith(".") or path.name in seen:
            continue  # temp names are dot-prefixed; a renamed file is checked once
        try:
            row = parse_rid(path.name.removesuffix(".safetensors"))[2]
            aux, final, meta = read_dump(path)
        except (PipelineError, FileNotFoundError) as exc:
            errors.append(f"{path.name}: {exc}")
            continue
        # Every value of row r is r: a torn or short file fails the shape or value check.
        if meta["num_tokens"] != tokens or not bool((aux == row).all() and (final == row).all()):
            errors.append(f"{path.name}: wrong content")
        seen.add(path.name)
    if finished:
        break
print(json.dumps({"seen": len(seen), "errors": errors[:5], "passes": passes}))
"""


def test_reader_never_sees_a_partial_dump(tmp_path):
    """A reader process polling the dir during many writes opens only complete files."""
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    stop_file = tmp_path / "stop"
    num_batches, per_batch, tokens, hidden = 20, 4, 128, 128
    reader = subprocess.Popen(
        [PYTHON, "-c", READER_SCRIPT, str(dump_dir), str(stop_file), str(tokens)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout.readline().strip() == "ready"
        with DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS) as writer:
            for b in range(num_batches):
                rows = list(range(b * per_batch, (b + 1) * per_batch))
                aux = torch.cat([torch.full((tokens, 3 * hidden), float(r)) for r in rows])
                final = torch.cat([torch.full((tokens, hidden), float(r)) for r in rows])
                writer.submit([rid(r) for r in rows], [tokens] * per_batch, aux, final)
        stop_file.touch()
        out, _ = reader.communicate(timeout=60)
    finally:
        reader.kill()
        reader.wait()
    result = json.loads(out)
    assert result["errors"] == []
    assert result["passes"] > 1
    assert result["seen"] == num_batches * per_batch
    assert not any(p.name.startswith(".") for p in dump_dir.iterdir())


def test_dump_is_invisible_until_complete(tmp_path, monkeypatch):
    """Each file is written under a dot-prefixed temp name; the final name appears only by
    rename, after the whole file is on disk."""
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    real_save = dump_module.save_file
    observed: list[tuple[str, bool, list[str]]] = []

    def spying_save(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        final_name = f"{metadata['rid']}.safetensors"
        visible = sorted(p.name for p in dump_dir.iterdir() if not p.name.startswith("."))
        observed.append((os.path.basename(filename), final_name in visible, visible))

    monkeypatch.setattr(dump_module, "save_file", spying_save)
    with DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS) as writer:
        writer.submit([rid(1), rid(2)], [3, 4], *packed_batch([3, 4]))
    # File threads write concurrently: the order of the two writes is not fixed.
    assert sorted(name for name, _, _ in observed) == [
        f".{rid(1)}.safetensors.tmp",
        f".{rid(2)}.safetensors.tmp",
    ]
    assert [present for _, present, _ in observed] == [False, False]
    assert sorted(p.name for p in dump_dir.iterdir()) == [
        f"{rid(1)}.safetensors",
        f"{rid(2)}.safetensors",
    ]


def test_failed_write_leaves_no_dump_and_tells_the_reader_why_at_once(tmp_path, monkeypatch):
    """A write that dies half-way (disk full) leaves neither a partial dump nor a temp file,
    but a note with the error: SGLang's hook writes after the answer (no on_done), so the
    reader learns why the dump is not coming instead of waiting DUMP_WAIT_S for it."""
    dump_dir = prepare_dump_dir(tmp_path / "dumps")

    def half_then_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dump_module, "save_file", half_then_full)
    errors: dict = {}
    writer = DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS)
    writer.submit([rid(3)], [2], *packed_batch([2]), on_done=lambda r, e: errors.update({r: e}))
    with pytest.raises(PipelineError, match=f"dump of request {rid(3)}.*No space left"):
        writer.close()
    assert "No space left" in str(errors[rid(3)])
    assert [p.name for p in dump_dir.iterdir()] == [f"{rid(3)}.failed"]
    # Had the note not been read, this wait would end in "wrote no dump ... within 600s".
    with pytest.raises(DumpNotWritten) as caught:
        wait_for_dump(dump_path(dump_dir, rid(3)), within_s=600)
    message = str(caught.value)
    assert f"could not write dump {dump_path(dump_dir, rid(3))}" in message
    assert "No space left on device" in message
    assert f"the handoff {dump_dir} has " in message and " free" in message
    assert list(dump_dir.iterdir()) == []  # the note is taken with the error


def test_an_empty_failed_write_note_falls_back_to_the_servers_answer(tmp_path):
    """On a full file system the note is created but its text may not fit: the reader then
    names the server's own answer, or says where the error is, never an empty reason."""
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    path = dump_path(dump_dir, rid(5))
    failed_dump_path(dump_dir, rid(5)).write_text("")
    message = take_dump_failure(path, "dump of request x failed: No space left on device")
    assert message.startswith(
        f"the server could not write dump {path}: dump of request x failed: No space left"
    )
    failed_dump_path(dump_dir, rid(5)).write_text("")
    assert "(its error did not fit there either; the server's log has it)" in take_dump_failure(
        path
    )
    assert take_dump_failure(path) is None  # the note was taken
    assert list(dump_dir.iterdir()) == []


def test_write_error_reaches_on_done_and_flush(tmp_path):
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    writer = DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS)
    shutil.rmtree(dump_dir)
    aux, final = packed_batch([2, 2])
    errors: dict[str, BaseException | None] = {}
    writer.submit([rid(7), "warmup-1"], [2, 2], aux, final, lambda r, e: errors.update({r: e}))
    with pytest.raises(PipelineError, match=f"dump of request {rid(7)}"):
        writer.flush()
    assert isinstance(errors[rid(7)], PipelineError) and rid(7) in str(errors[rid(7)])
    assert errors["warmup-1"] is None
    # The writer keeps going: once the dir is back, later batches are written.
    prepare_dump_dir(dump_dir)
    writer.submit([rid(8)], [4], *packed_batch([4]))
    writer.close()
    assert (dump_dir / f"{rid(8)}.safetensors").exists()
    assert not list(dump_dir.glob(".*"))


def test_writer_error_raised_on_close(tmp_path):
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    writer = DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS)
    dump_dir.rmdir()
    writer.submit([rid(1)], [2], *packed_batch([2]))
    with pytest.raises(PipelineError, match=f"dump of request {rid(1)}"):
        writer.close()


def test_submit_blocks_while_writer_is_behind(tmp_path):
    """Backpressure: with the byte budget full, submit waits until the writer catches up."""
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    one_batch = 4 * 4 * HIDDEN * 2  # 4 tokens x (3H + H) bf16
    release = threading.Event()
    writer = DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS, max_pinned_bytes=one_batch)
    # The callback runs on the writer thread, so holding it stalls the writer.
    writer.submit([rid(1)], [4], *packed_batch([4]), on_done=lambda r, e: release.wait())
    second = threading.Thread(target=writer.submit, args=([rid(2)], [4], *packed_batch([4])))
    second.start()
    second.join(timeout=1.0)
    blocked = second.is_alive()
    release.set()
    second.join()
    writer.close()
    assert blocked, "submit returned although the writer held a full budget"
    assert (dump_dir / f"{rid(2)}.safetensors").exists()


def test_host_pool_reuses_buffers_and_bounds_memory():
    pool = _HostBufferPool(4 << 20, pin=False)
    first = pool.acquire([1000, 3000])
    assert [b.numel() for b in first] == [1 << 20, 1 << 20]
    pool.release(first)
    again = pool.acquire([500, 2000])
    assert {b.data_ptr() for b in again} == {b.data_ptr() for b in first}
    assert pool.allocated_bytes == 2 << 20
    # 3 MiB more would exceed the 4 MiB bound while `again` is held: acquire must wait.
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire([3 << 20])))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not got
    pool.release(again)
    waiter.join()
    assert got[0][0].numel() >= 3 << 20
    assert pool.allocated_bytes <= 4 << 20
    pool.release(got[0])
    # Mixed sizes: the free list holds buffers of different capacities to pick among.
    mixed = pool.acquire([1 << 20, 2 << 20])
    pool.release(mixed)
    again = pool.acquire([2 << 20, 1 << 20])
    assert [b.numel() >= n for b, n in zip(again, [2 << 20, 1 << 20], strict=True)] == [True] * 2
    pool.release(again)
    # A single request over the whole bound is served alone rather than never.
    huge = pool.acquire([8 << 20])
    assert huge[0].numel() == 8 << 20
    pool.release(huge)
    pool.close()
    assert pool.allocated_bytes == 0
    assert pool.peak_bytes >= 8 << 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_writer_cuda_path_matches_host_copy(tmp_path):
    dump_dir = prepare_dump_dir(tmp_path / "dumps")
    counts = [7, 3, 11]
    aux, final = packed_batch(counts)
    with DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=IDS, max_pinned_bytes=1 << 20) as w:
        for attempt in range(4):  # more batches than the pool holds at once: buffers recycle
            rids = [rid(r, attempt) for r in range(3)]
            w.submit(rids, counts, aux.cuda(), final.cuda())
    for attempt in range(4):
        got_aux, got_final, _ = read_dump(dump_dir / f"{rid(2, attempt)}.safetensors")
        assert torch.equal(got_aux, aux[10:].to(torch.bfloat16))
        assert torch.equal(got_final, final[10:].to(torch.bfloat16))
