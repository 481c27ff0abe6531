"""Per-shard extraction through the real reference server (started by the real lifecycle):
tensors equal a direct transformers forward, kill -9 + resume, truncated chunks, faulty dumps,
a second writer, too little free space, stale dumps of another nonce."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_port, shard_lock_held_elsewhere, small_filesystem

from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.manifest import read_manifest
from eaglepipe.core.run import resolve
from eaglepipe.extract.chunk_file import open_chunk
from eaglepipe.extract.shard import extract_shard
from eaglepipe.extract.shard_files import HIDDEN_STATES_MANIFEST, iter_rows
from eaglepipe.server.handoff.dump_writer import DumpWriter
from eaglepipe.server.handoff.dumps import mark_dump_failed
from eaglepipe.server.handoff.request_ids import make_rid
from eaglepipe.server.lifecycle.shared_server import server_status, stop_server

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARD = "rows_0-24"
SKIPPED_ROW = 7  # a row prepare dropped: the shard has a gap there
AUX_IDS = [1, 3, 4]  # the default for the 8-layer tiny Llama


def prepared_rows() -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for row_id in range(24):
        if row_id == SKIPPED_ROW:
            continue
        n = int(rng.integers(3, 40))
        rows.append(
            {
                "row_id": row_id,
                "split": "train",
                "num_tokens": n,
                "input_ids": rng.integers(0, 300, n).astype(np.int32).tolist(),
                "loss_mask": rng.integers(0, 2, n).astype(np.uint8).tolist(),
                "truncated": False,
            }
        )
    return rows


def make_workdir(root: Path, model_dir: Path) -> Path:
    """A run directory: config.json, prepared/ (table per CONTRACTS), its own server state."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models

    from eaglepipe.prepare.table import table_schema

    root.mkdir(parents=True, exist_ok=True)
    # The target as a run sees it: weights plus tokenizer files (fingerprinted for provenance).
    target = root / "target"
    shutil.copytree(model_dir, target)
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(
        str(target / "tokenizer.json")
    )
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(target)
    # The source the prepared table stands for: the manifest records the workflow's provenance
    # of the shard, computed from it. (The table below is synthetic; only the plan must match.)
    sample = (REPO_ROOT / "data" / "sample" / "conversations.jsonl").read_text().splitlines()
    (root / "conversations.jsonl").write_text("\n".join(sample[:24]) + "\n")
    config["dataset"]["path"] = str(root / "conversations.jsonl")
    config["shards"]["rows_per_shard"] = 24
    config["shards"]["chunk_max_bytes"] = 12000  # ~2 rows per chunk at H=32
    config["server"].update(
        port=free_port(),
        dump_root=str(root / "dumps"),
        device="cpu",
        dtype="float32",
        idle_timeout_s=120,
        health_timeout_s=300,
        max_batch_tokens=512,
    )
    config["extract"]["max_inflight_requests"] = 4
    (root / "config.json").write_text(json.dumps(config))
    rows = prepared_rows()
    prepared = root / "prepared"
    prepared.mkdir(exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=table_schema())
    pq.write_table(table, prepared / "tokenized.parquet")
    (prepared / "summary.json").write_text(
        json.dumps(
            {
                "rows": len(rows),
                "provenance": {
                    "dataset_hash": "d" * 32,
                    "tokenizer_fingerprint": "t" * 32,
                    "model_config_hash": "m" * 32,
                },
            }
        )
    )
    return root


def run_config(workdir: Path) -> dict:
    from eaglepipe.core.run import config_from_arg

    return config_from_arg(workdir / "config.json")


@pytest.fixture
def in_dir(monkeypatch):
    def enter(path: Path) -> Path:
        monkeypatch.chdir(path)
        return path

    return enter


def stop_workdir_server(workdir: Path) -> None:
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        stop_server()
    finally:
        os.chdir(cwd)


def kill_workdir_server(workdir: Path) -> None:
    """SIGKILL a (hung) server's process group, then let the lifecycle clean up its state."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        state = server_status()["state"]
        if state:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(state["pgid"], signal.SIGKILL)
        stop_server()
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def main_run(tiny_llama_dir, tmp_path_factory):
    """One uninterrupted extraction of the shard; its server stays up for the module."""
    workdir = make_workdir(tmp_path_factory.mktemp("main-run"), tiny_llama_dir)
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        lines: list[str] = []
        manifest = extract_shard(resolve(run_config(workdir)), SHARD, log=lines.append)
    finally:
        os.chdir(cwd)
    yield workdir, manifest, lines
    stop_workdir_server(workdir)


def direct_forward(model_dir: Path, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = _models.get(model_dir)
    if model is None:
        model = _models[model_dir] = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32
        ).eval()
    with torch.inference_mode():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    hidden = out.hidden_states
    aux = torch.cat([hidden[k + 1][0] for k in AUX_IDS], dim=-1)
    return aux, hidden[-1][0]


_models: dict = {}


def chunk_tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_chunk(path) as reader:
        return {
            name: reader.tensor(name)
            for name in (
                "row_ids",
                "offsets",
                "input_ids",
                "loss_mask",
                "aux_hidden_states",
                "final_hidden_states",
            )
        }


# A whole job in a fresh interpreter: what it imports, and when it sends its first request.
FRESH_JOB = """
import sys
from pathlib import Path
from eaglepipe.core.run import load_run
from eaglepipe.extract.shard import run_extract_job
run = load_run("config.json")
manifest = run_extract_job(run, sys.argv[1], hidden_states_dir=Path(sys.argv[2]))
heavy = sorted(m for m in ("torch", "transformers", "pandas") if m in sys.modules)
timing = manifest["timing"]
order = ("entered_s", "lease_asked_s", "leased_s", "first_request_s")
steps = ",".join(str(timing[k]) for k in order)
print(manifest["num_rows"], steps, ",".join(heavy) or "none", timing["lease_via"].replace(" ", "-"))
"""


def test_a_job_moves_hidden_states_without_importing_torch(main_run):
    """Reading dumps and writing chunks needs no torch, transformers or pandas (seconds of
    imports before a job's first request, issue 28); on server.device cpu the engine's identity
    needs none either. The manifest records when the job entered the library, asked for and
    held the lease and sent its first request, in that order, and how the lease was had."""
    workdir, reference, _ = main_run
    out = workdir / "hidden_states_fresh_interpreter"
    done = subprocess.run(
        [sys.executable, "-c", FRESH_JOB, SHARD, str(out)],
        cwd=workdir, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows, steps, heavy, lease_via = done.stdout.split()
    assert int(rows) == reference["num_rows"] and heavy == "none"
    entered_s, asked_s, leased_s, first_request_s = map(float, steps.split(","))
    assert 0 < entered_s <= asked_s <= leased_s <= first_request_s
    assert lease_via in ("started", "answered-note", "server_info")
    fresh = read_manifest(out / SHARD / "manifest.json", HIDDEN_STATES_MANIFEST)[0]
    assert [c["row_ids"] for c in fresh["chunks"]] == [c["row_ids"] for c in reference["chunks"]]
    assert fresh["provenance"] == reference["provenance"]


def test_every_row_equals_a_direct_forward(main_run, tiny_llama_dir):
    workdir, manifest, lines = main_run
    shard_dir = workdir / "hidden_states" / SHARD
    prepared = {r["row_id"]: r for r in prepared_rows()}
    assert manifest == read_manifest(shard_dir / "manifest.json", HIDDEN_STATES_MANIFEST)[0]
    assert manifest["num_rows"] == len(prepared) and len(manifest["chunks"]) > 3
    assert [r for c in manifest["chunks"] for r in c["row_ids"]] == sorted(prepared)
    assert manifest["hidden_size"] == 32 and manifest["aux_layer_ids"] == AUX_IDS
    assert manifest["provenance"]["engine"] == "reference"
    assert manifest["provenance"]["dataset_hash"] == "d" * 32
    assert manifest["provenance"]["workflow"]  # the rerun stamp eaglepipe.plan compares
    assert manifest["timing"]["requests_sent"] == len(prepared)
    seen = []
    for row_id, tensors in iter_rows(shard_dir):
        seen.append(row_id)
        row = prepared[row_id]
        assert tensors["input_ids"].tolist() == row["input_ids"]
        assert tensors["loss_mask"].tolist() == row["loss_mask"]
        aux, final = direct_forward(tiny_llama_dir, row["input_ids"])
        assert tensors["aux_hidden_states"].dtype == torch.bfloat16
        torch.testing.assert_close(tensors["aux_hidden_states"].float(), aux, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(
            tensors["final_hidden_states"].float(), final, rtol=2e-2, atol=2e-2
        )
    assert seen == sorted(prepared)
    assert any("rows, " in line and "tokens/s" in line and "ETA" in line for line in lines)


@pytest.mark.slow
def test_kill_minus_9_mid_shard_then_resume(main_run, tiny_llama_dir, tmp_path, in_dir):
    reference_dir, reference, _ = main_run
    workdir = make_workdir(tmp_path / "run", tiny_llama_dir)
    shard_dir = workdir / "hidden_states" / SHARD
    journal = shard_dir / "journal.jsonl"
    # The server this first job starts answers 6 requests and then hangs: the job has written
    # a few chunks and waits for the rest when it is killed.
    env = {**os.environ, "EAGLEPIPE_FAULT": "hang_after:6"}
    cmd = [
        sys.executable,
        "-u",
        str(REPO_ROOT / "scripts" / "extract.py"),
        "--config",
        "config.json",
        "--shard",
        SHARD,
    ]
    job_log = open(tmp_path / "first-job.log", "wb")
    job = subprocess.Popen(
        cmd, cwd=workdir, env=env, start_new_session=True, stdout=job_log, stderr=job_log
    )
    try:
        deadline = time.monotonic() + 120
        while not (journal.exists() and len(journal.read_text().splitlines()) >= 2):
            assert job.poll() is None, (tmp_path / "first-job.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "no chunk was journalled in time"
            time.sleep(0.2)
        time.sleep(1.0)  # let it settle against the hung server
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        job_log.close()
    kill_workdir_server(workdir)  # the hung server; the rerun starts a healthy one

    finished = {
        json.loads(line)["file"] for line in journal.read_text().splitlines() if line.strip()
    }
    assert 1 <= len(finished) < len(reference["chunks"])
    assert not (shard_dir / "manifest.json").exists()
    before = {
        name: ((shard_dir / name).read_bytes(), (shard_dir / name).stat().st_mtime_ns)
        for name in finished
    }

    lines: list[str] = []
    in_dir(workdir)
    try:
        manifest = extract_shard(resolve(run_config(workdir)), SHARD, log=lines.append)
    finally:
        stop_server()
    for name, (data, mtime) in before.items():
        assert (shard_dir / name).read_bytes() == data
        assert (shard_dir / name).stat().st_mtime_ns == mtime
    resumed_rows = sum(len(c["row_ids"]) for c in manifest["chunks"] if c["file"] in finished)
    assert manifest["timing"]["requests_sent"] == manifest["num_rows"] - resumed_rows
    assert manifest["timing"]["requests_sent"] < reference["timing"]["requests_sent"]
    layout = ("file", "row_ids", "num_tokens", "bytes")
    assert [{k: c[k] for k in layout} for c in manifest["chunks"]] == [
        {k: c[k] for k in layout} for c in reference["chunks"]
    ]
    for chunk in manifest["chunks"]:
        got = chunk_tensors(shard_dir / chunk["file"])
        want = chunk_tensors(reference_dir / "hidden_states" / SHARD / chunk["file"])
        for name in ("row_ids", "offsets", "input_ids", "loss_mask"):
            assert torch.equal(got[name], want[name])
        for name in ("aux_hidden_states", "final_hidden_states"):
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=2e-2, atol=2e-2)
    assert any("verified from an earlier run" in line for line in lines)


def test_truncated_chunk_is_redone(main_run, in_dir):
    source_dir, reference, _ = main_run
    workdir = in_dir(source_dir)
    shard_dir = workdir / "hidden_states" / SHARD
    chunk = reference["chunks"][1]
    victim = shard_dir / chunk["file"]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    others = {
        c["file"]: (shard_dir / c["file"]).stat().st_mtime_ns
        for c in reference["chunks"]
        if c["file"] != chunk["file"]
    }
    manifest = extract_shard(resolve(run_config(workdir)), SHARD, log=lambda line: None)
    assert manifest["timing"]["requests_sent"] == len(chunk["row_ids"])
    redone = manifest["chunks"][1]
    assert redone["bytes"] == len(data) and redone["row_ids"] == chunk["row_ids"]
    assert victim.stat().st_size == len(data)
    for name, mtime in others.items():
        assert (shard_dir / name).stat().st_mtime_ns == mtime


def test_chunk_writeback_mb_reaches_the_chunk_writer(main_run, in_dir, monkeypatch):
    """`extract.chunk_writeback_mb` is the step each chunk is handed to the disk at (0: never;
    what each step does: tests/test_shard_store.py); the chunk is the same either way."""
    from eaglepipe.core import atomic
    from eaglepipe.extract import chunk_file

    source_dir, reference, _ = main_run
    workdir = in_dir(source_dir)
    chunk = reference["chunks"][0]
    victim = workdir / "hidden_states" / SHARD / chunk["file"]
    steps = []

    class RecordingWriteback(atomic.Writeback):
        def __init__(self, fd, *, step=None):
            super().__init__(fd, step=step)
            steps.append(self.step)

    monkeypatch.setattr(chunk_file, "Writeback", RecordingWriteback)
    for mb in (0, 3):
        config = run_config(workdir)
        config["extract"]["chunk_writeback_mb"] = mb
        victim.write_bytes(b"")
        manifest = extract_shard(resolve(config), SHARD, log=lambda line: None)
        assert manifest["chunks"][0]["bytes"] == chunk["bytes"]
        assert manifest["timing"]["requests_sent"] == len(chunk["row_ids"])
    assert steps == [0, 3 << 20]


def test_stale_dump_of_another_nonce_is_swept_never_ingested(main_run, in_dir, tiny_llama_dir):
    workdir = in_dir(main_run[0])
    dump_dir = Path(server_status()["state"]["dump_dir"])
    row_in_shard, row_elsewhere = 3, 900
    stale_nonce = "0" * 12
    with DumpWriter(dump_dir, "eaglepipe", aux_layer_ids=AUX_IDS) as writer:
        for row_id in (row_in_shard, row_elsewhere):
            n = next(r["num_tokens"] for r in prepared_rows() if r["row_id"] == 3)
            writer.submit(
                [make_rid("eaglepipe", stale_nonce, row_id, 0)],
                [n],
                torch.full((n, 96), 1000.0),
                torch.full((n, 32), 1000.0),
            )
    # A note of a dump the stale run's server could not write (handoff.mark_dump_failed).
    for row_id in (row_in_shard, row_elsewhere):
        mark_dump_failed(dump_dir, make_rid("eaglepipe", stale_nonce, row_id, 1), "disk full")
    shard_dir = workdir / "hidden_states" / SHARD
    shutil.rmtree(shard_dir)
    lines: list[str] = []
    extract_shard(resolve(run_config(workdir)), SHARD, log=lines.append)
    stale = sorted(p.name for p in dump_dir.iterdir() if stale_nonce in p.name)
    elsewhere = make_rid("eaglepipe", stale_nonce, row_elsewhere, 0)
    elsewhere_note = make_rid("eaglepipe", stale_nonce, row_elsewhere, 1)
    assert stale == [f"{elsewhere}.safetensors", f"{elsewhere_note}.failed"]  # another shard's
    for name in stale:
        (dump_dir / name).unlink()
    assert any("swept 2 stale dump" in line for line in lines)
    row = dict(iter_rows(shard_dir))[row_in_shard]
    aux, _ = direct_forward(
        tiny_llama_dir, next(r for r in prepared_rows() if r["row_id"] == 3)["input_ids"]
    )
    torch.testing.assert_close(row["aux_hidden_states"].float(), aux, rtol=2e-2, atol=2e-2)


def test_wrong_token_count_fails_naming_the_row(tiny_llama_dir, tmp_path, in_dir, monkeypatch):
    workdir = in_dir(make_workdir(tmp_path / "run", tiny_llama_dir))
    monkeypatch.setenv("EAGLEPIPE_FAULT", "wrong_token_count")
    try:
        with pytest.raises(
            PipelineError, match=r"row \d+ .*dump holds \d+ tokens, the request had"
        ):
            extract_shard(resolve(run_config(workdir)), SHARD, log=lambda line: None)
    finally:
        stop_server()
    assert not (workdir / "hidden_states" / SHARD / "manifest.json").exists()


def test_second_writer_is_refused_naming_the_pid(main_run, tmp_path, tiny_llama_dir, in_dir):
    workdir = in_dir(make_workdir(tmp_path / "run", tiny_llama_dir))
    shard_dir = workdir / "hidden_states" / SHARD
    with shard_lock_held_elsewhere(shard_dir) as holder:
        with pytest.raises(PipelineError, match=rf"PID {holder.pid} on host"):
            extract_shard(resolve(run_config(workdir)), SHARD, log=lambda line: None)
    assert not list(shard_dir.glob("chunk-*"))


def test_too_little_free_space_writes_nothing(tmp_path, tiny_llama_dir, in_dir, monkeypatch):
    workdir = in_dir(make_workdir(tmp_path / "run", tiny_llama_dir))
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 50_000, 50_000))
    with pytest.raises(PipelineError, match=rf"shard {SHARD} needs .* but only 50\.0 KB is free"):
        extract_shard(resolve(run_config(workdir)), SHARD, log=lambda line: None)
    assert not (workdir / "hidden_states").exists()
    assert not (workdir / ".eaglepipe" / "server").exists()  # no server was started


@contextlib.contextmanager
def handoff_on_a_small_tmpfs(workdir: Path, size: int, leave_free: int | None = None):
    """The run's server.dump_root on a tmpfs of `size` bytes (with `leave_free`, a file stands
    for other jobs' dumps and leaves that much); the server is stopped before it is unmounted."""
    config = json.loads((workdir / "config.json").read_text())
    config["extract"]["max_inflight_bytes"] = 10**9  # the tmpfs, not the budget, is the limit
    (workdir / "config.json").write_text(json.dumps(config))
    dump_root = Path(config["server"]["dump_root"])
    with small_filesystem(dump_root, size):
        try:
            dump_root.chmod(0o700)  # a handoff root others may write is refused
            if leave_free is not None:
                (dump_root / "other-jobs-dumps").write_bytes(b"\0" * (size - leave_free))
            yield dump_root
        finally:
            stop_server()


LONGEST_ROW = max(prepared_rows(), key=lambda r: r["num_tokens"])
LONGEST_DUMP = LONGEST_ROW["num_tokens"] * 4 * 32 * 2  # 3 aux layers + final, H = 32, bf16


def test_a_full_handoff_fails_the_job_naming_the_row_the_error_and_the_free_space(
    tmp_path, tiny_llama_dir, in_dir
):
    """Other jobs' dumps leave the handoff's tmpfs room for the supervisor's owner file and 8
    KB more: the longest rows' dumps cannot be written. The job ends in one line naming the
    row, the writer's error and the handoff's free space, and leaves no dump or note behind."""
    workdir = in_dir(make_workdir(tmp_path / "run", tiny_llama_dir))
    assert LONGEST_DUMP > 8192
    with handoff_on_a_small_tmpfs(workdir, 64 << 10, leave_free=12 << 10):
        with pytest.raises(PipelineError) as caught:
            extract_shard(resolve(run_config(workdir)), SHARD, log=lambda line: None)
        dump_dir = Path(server_status()["state"]["dump_dir"])
        left = sorted(p.name for p in dump_dir.iterdir())
    message = str(caught.value)
    assert re.match(
        r"row \d+ failed after 4 attempt\(s\): the server could not write dump ", message
    )
    assert "No space left on device" in message
    assert re.search(rf"the handoff {re.escape(str(dump_dir))} has [\d.]+ [KMG]?B free", message)
    assert left == []
    assert not (workdir / "hidden_states" / SHARD / "manifest.json").exists()


def test_a_handoff_smaller_than_one_dump_is_refused_before_any_request(
    tmp_path, tiny_llama_dir, in_dir
):
    """A handoff file system smaller than the longest row's dump (a container's 64 MB
    /dev/shm against a large target) could never take it: refused at once, naming the row,
    the sizes and the fix, with no request sent."""
    workdir = in_dir(make_workdir(tmp_path / "run", tiny_llama_dir))
    with handoff_on_a_small_tmpfs(workdir, 8192):
        lines: list[str] = []
        with pytest.raises(PipelineError) as caught:
            extract_shard(resolve(run_config(workdir)), SHARD, log=lines.append)
        dump_dir = Path(server_status()["state"]["dump_dir"])
        left = sorted(p.name for p in dump_dir.iterdir())
    assert str(caught.value) == (
        f"row {LONGEST_ROW['row_id']}: its dump ({LONGEST_ROW['num_tokens']} tokens, "
        f"{LONGEST_DUMP / 1000:.1f} KB) cannot fit in the handoff {dump_dir}, whose file system "
        "holds 8.2 KB in all: give the server's dumps more room (server.dump_root on a larger "
        "file system, or a container's /dev/shm: docker run --shm-size)"
    )
    assert not any("requesting" in line for line in lines)
    assert left == []
    assert not list((workdir / "hidden_states" / SHARD).glob("chunk-*"))


def test_weights_fingerprint_tells_a_fine_tune_from_its_base(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from eaglepipe.core.fingerprint import weights_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    assert weights_fingerprint(copy) == weights_fingerprint(tiny_llama_dir)
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_llama_dir, tuned)
    weights = load_file(tuned / "model.safetensors")
    first = sorted(weights)[0]
    weights[first] = weights[first] + 1e-3
    save_file(weights, tuned / "model.safetensors", metadata={"format": "pt"})
    assert (tuned / "config.json").read_bytes() == (tiny_llama_dir / "config.json").read_bytes()
    assert weights_fingerprint(tuned) != weights_fingerprint(tiny_llama_dir)


def test_a_shard_outside_the_plan_is_refused_before_any_work(tmp_path, tiny_llama_dir, in_dir):
    workdir = in_dir(make_workdir(tmp_path / "run", tiny_llama_dir))
    with pytest.raises(PipelineError, match=r"shard rows_0-5 is not in the plan"):
        extract_shard(resolve(run_config(workdir)), "rows_0-5", log=lambda line: None)
    assert not (workdir / "hidden_states").exists()


def _assembler(shard_dir: Path, lookahead_bytes: int, writeback_bytes: int = 64 << 20):
    """Four chunks of two 4-token rows each, hidden size 8: each row is 256 bytes of dumps."""
    from eaglepipe.core.progress import Progress
    from eaglepipe.extract.shard import ChunkAssembler, ShardRows

    row_ids = list(range(8))
    rows = ShardRows(
        row_ids=row_ids,
        input_ids=[np.arange(4, dtype=np.int32) for _ in row_ids],
        loss_masks=[np.ones(4, dtype=np.uint8) for _ in row_ids],
    )
    chunks = [[0, 1], [2, 3], [4, 5], [6, 7]]
    progress = Progress("rows_0-8", 8, log=lambda line: None)
    shard_dir.mkdir(parents=True, exist_ok=True)
    return ChunkAssembler(
        shard_dir, chunks, [0, 1, 2, 3], rows, "digest", 8, {}, progress, lambda line: None,
        lookahead_bytes, writeback_bytes,
    )  # fmt: skip


def _extracted(row_id: int):
    from eaglepipe.extract.client import ExtractedRow

    return ExtractedRow(
        row_id=row_id,
        aux_hidden_states=torch.zeros(4, 24, dtype=torch.bfloat16),
        final_hidden_states=torch.zeros(4, 8, dtype=torch.bfloat16),
        dump_bytes=256,
    )


def test_lookahead_bytes_bound_the_rows_requested_ahead_of_the_written_chunks(tmp_path):
    """With room for three rows, the rows of chunk 2 wait until chunk 0 is written; the next
    two chunks are always allowed; with room for every row nothing waits at all."""
    import asyncio

    async def scenario() -> None:
        tight = _assembler(tmp_path / "tight", lookahead_bytes=3 * 256)
        for row in range(4):  # chunks 0 and 1: always allowed, whatever the bound
            await asyncio.wait_for(tight.may_send(row), 5)
        held = asyncio.create_task(tight.may_send(4))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not held.done(), "a row beyond the look-ahead was let through"
        await tight.on_row(_extracted(0))
        assert not held.done()
        await tight.on_row(_extracted(1))  # chunk 0 complete: written, room again
        await asyncio.wait_for(held, 5)
        assert (tmp_path / "tight" / "chunk-00000.safetensors").is_file()
        assert tight.outstanding_bytes == 3 * 256  # rows 2, 3 and 4

        roomy = _assembler(tmp_path / "roomy", lookahead_bytes=8 * 256)
        for row in range(8):
            await asyncio.wait_for(roomy.may_send(row), 5)
        assert roomy.lookahead_wait_s == 0.0
        for row in range(8):
            await roomy.on_row(_extracted(row))
        assert roomy.outstanding_bytes == 0 and len(roomy.records) == 4

    asyncio.run(scenario())


def test_chunks_of_another_engine_or_dtype_are_never_resumed(main_run, tmp_path, in_dir):
    # A shard cut short under fp32 and resumed under bf16 would mix both and credit every chunk
    # to the second: the reuse key holds the engine identity, so nothing is kept.
    workdir = in_dir(make_workdir(tmp_path / "dtype", main_run[0] / "target"))
    first = extract_shard(resolve(run_config(workdir)), SHARD, log=lambda line: None)
    assert first["provenance"]["engine_identity"]["dtype"] == "float32"
    stop_workdir_server(workdir)
    (workdir / "hidden_states" / SHARD / "manifest.json").unlink()  # as a killed job leaves it
    config = json.loads((workdir / "config.json").read_text())
    config["server"]["dtype"] = "bfloat16"
    (workdir / "config.json").write_text(json.dumps(config))
    lines: list[str] = []
    second = extract_shard(resolve(run_config(workdir)), SHARD, log=lines.append)
    stop_workdir_server(workdir)
    assert not any("verified from an earlier run" in line for line in lines)
    assert second["timing"]["requests_sent"] == second["num_rows"]
    assert second["provenance"]["engine_identity"]["dtype"] == "bfloat16"
    assert all(
        c["xxh3_128"] != f["xxh3_128"]
        for c, f in zip(second["chunks"], first["chunks"], strict=True)
    )
