"""Regeneration (dataset.regenerate) through the real workflow: real jobs, a real reference
server, real signals.

One small run (the toy target as a user model directory, 20 rows in 2 shards, every shard
regenerated, prepared and extracted) is shared by the module; each test that changes
something works on its own copy of it (its own dataset file and port).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import plain_greedy, small_filesystem
from pipeline_run import (
    copy_run,
    dry_run_jobs,
    kill_group,
    run_on_toy_as_user_model,
    run_snakemake,
    small_config,
    snakemake_argv,
    write_config,
)

from eaglepipe.core.config_files import load_config
from eaglepipe.core.run import resolve

SHARDS = ["rows_0-10", "rows_10-20"]
EXTRACTED = [f"hidden_states/{s}/manifest.json" for s in SHARDS]
MAX_NEW_TOKENS = 24
EAGLEPIPE = str(Path(sys.executable).parent / "eaglepipe")
WAIT_S = 600


def regen_dir(workdir: Path, shard: str) -> Path:
    return workdir / "regenerated" / shard


def rows_of(workdir: Path, shard: str) -> list[dict]:
    text = (regen_dir(workdir, shard) / "rows.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def manifest_of(workdir: Path, shard: str) -> dict:
    return json.loads((regen_dir(workdir, shard) / "manifest.json").read_text())


def source_rows(workdir: Path) -> list[dict]:
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    lines = Path(config["dataset"]["path"]).read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines]


def edit_config(workdir: Path, edit) -> None:
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    edit(config)
    write_config(workdir, config)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    """Both shards regenerated, prepared and extracted, with the toy target as a user model."""
    workdir = tmp_path_factory.mktemp("regenerated")
    config = small_config(workdir, rows=20, rows_per_shard=10)
    config["dataset"]["regenerate"].update(enabled=True, max_new_tokens=MAX_NEW_TOKENS)
    return run_on_toy_as_user_model(workdir, config, *EXTRACTED)


@pytest.fixture
def run_copy(regenerated, tmp_path) -> Path:
    """A private copy of the run (Snakemake metadata included), its own dataset file and port."""
    return copy_run(regenerated, tmp_path / "run")


# ------------------------------------------------------------------ what regeneration writes


def greedy_reply(model_dir: Path, prompt: list[int], budget: int, stops: set[int]) -> list[int]:
    """The target's greedy reply the plain way, up to a stop token (left out) or `budget`."""
    out = plain_greedy(model_dir, prompt, budget, stops)
    return out[:-1] if out and out[-1] in stops else out


def test_each_turn_is_the_targets_greedy_reply_to_its_own_earlier_replies(regenerated):
    from transformers import AutoTokenizer

    target = regenerated / "target"
    tokenizer = AutoTokenizer.from_pretrained(target)
    stops = {tokenizer.eos_token_id}
    max_length = yaml.safe_load((regenerated / "config.yaml").read_text())["dataset"]["max_length"]
    source = source_rows(regenerated)
    manifest = manifest_of(regenerated, "rows_0-10")
    assert manifest["provenance"]["stop_token_ids"] == sorted(stops)
    multi_turn = changed = 0
    for record in rows_of(regenerated, "rows_0-10"):
        original = source[record["row_id"]]
        messages = record["messages"]
        assert len(messages) == len(original)  # nothing cut at 24 new tokens per reply
        assistant = [i for i, m in enumerate(original) if m["role"] == "assistant"]
        assert record["regenerated_turns"] == assistant
        multi_turn += len(assistant) >= 3
        for i, (new, old) in enumerate(zip(messages, original, strict=True)):
            assert new["role"] == old["role"]
            if old["role"] != "assistant":
                assert new == old  # system and user turns are kept as they are
                continue
            # The prompt holds the target's own earlier replies, not the dataset's.
            text = tokenizer.apply_chat_template(
                messages[:i], tokenize=False, add_generation_prompt=True
            )
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            budget = min(MAX_NEW_TOKENS, max_length - len(prompt))
            expected = greedy_reply(target, prompt, budget, stops)
            assert new["content"] == tokenizer.decode(
                expected, skip_special_tokens=False, clean_up_tokenization_spaces=False
            ), f"row {record['row_id']} message {i}"
            changed += new["content"] != old["content"]
    assert multi_turn >= 3 and changed > 0
    assert [r["row_id"] for r in rows_of(regenerated, "rows_10-20")] == list(range(10, 20))
    provenance = manifest["provenance"]
    for key in ("model_fingerprint", "weights_fingerprint", "settings", "seed", "workflow"):
        assert provenance[key] is not None, key
    assert provenance["settings"]["sampling"] == {"greedy": True, "max_new_tokens": MAX_NEW_TOKENS}


def test_the_summary_prepare_reads_totals_every_regenerated_shard(regenerated):
    summary = json.loads((regenerated / "regenerated" / "summary.json").read_text())
    manifests = [manifest_of(regenerated, shard) for shard in SHARDS]
    assert summary["shards"] == 2 and sorted(summary["per_shard"]) == SHARDS
    assert summary["num_rows"] == 20
    for key in ("output_tokens", "bad_rows", "length_limited_replies"):
        assert summary[key] == sum(manifest[key] for manifest in manifests)
    assert summary["output_tokens"] > 0
    for shard, manifest in zip(SHARDS, manifests, strict=True):
        assert summary["per_shard"][shard]["xxh3_128"] == manifest["xxh3_128"]
    log = (regenerated / "logs" / "regeneration_summary.log").read_text()
    assert "regeneration: 2 shard(s), 20 rows" in log


def test_prepare_tokenizes_the_regenerated_conversations(regenerated):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(regenerated / "target")
    table = pq.read_table(regenerated / "prepared" / "tokenized.parquet").to_pylist()
    assert [row["row_id"] for row in table] == list(range(20))
    record = rows_of(regenerated, "rows_10-20")[3]
    text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    assert table[13]["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    summary = json.loads((regenerated / "prepared" / "summary.json").read_text())
    assert summary["provenance"]["regenerate"]["sampling"]["greedy"] is True


def test_greedy_regeneration_is_reproducible_byte_for_byte(run_copy):
    """Regenerated again from nothing, one row at a time (other batches on the server), the
    shard is the same bytes."""
    before = (regen_dir(run_copy, "rows_0-10") / "rows.jsonl").read_bytes()
    workflow = manifest_of(run_copy, "rows_0-10")["provenance"]["workflow"]
    shutil.rmtree(regen_dir(run_copy, "rows_0-10"))
    edit_config(run_copy, lambda c: c["extract"].update(max_inflight_requests=1))
    run_snakemake(run_copy, "--cores", "1", "regenerated/rows_0-10/manifest.json")
    assert (regen_dir(run_copy, "rows_0-10") / "rows.jsonl").read_bytes() == before
    manifest = manifest_of(run_copy, "rows_0-10")
    assert manifest["provenance"]["workflow"] == workflow
    assert manifest["timing"]["rows_kept"] == 0


# ------------------------------------------------------------------------------ resume


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_kill9_mid_shard_keeps_finished_rows_and_regenerates_only_the_rest(run_copy):
    """Snakemake and its job killed with SIGKILL while a shard is half regenerated: the rerun
    keeps the journalled rows, asks the server only for the others, and ends with the bytes of
    the uninterrupted run."""
    shard = "rows_10-20"
    uninterrupted = (regen_dir(run_copy, shard) / "rows.jsonl").read_bytes()
    shutil.rmtree(regen_dir(run_copy, shard))
    edit_config(run_copy, lambda c: c["extract"].update(max_inflight_requests=1))
    # Rows go one at a time; the server answers row 10's turns, then stalls on row 11.
    turns_of_first = sum(m["role"] == "assistant" for m in source_rows(run_copy)[10])
    env = dict(os.environ, EAGLEPIPE_FAULT=f"hang_after:{turns_of_first}", PYTHONUNBUFFERED="1")
    env.pop("EAGLEPIPE_RUN_TOKEN", None)
    target = f"regenerated/{shard}/manifest.json"
    with open(run_copy / "killed.log", "w") as log:
        proc = subprocess.Popen(
            snakemake_argv(run_copy, "--cores", "1", target),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    journal = regen_dir(run_copy, shard) / "journal.jsonl"
    try:
        wait_for(
            lambda: journal.exists() and journal.read_text().count("\n") >= 1,
            WAIT_S,
            "the first journalled row",
        )
        time.sleep(1.0)  # the job waits on the stalled request: nothing more gets journalled
    finally:
        kill_group(proc, signal.SIGKILL)
        proc.wait(timeout=60)
    kept = [json.loads(line)["row"] for line in journal.read_text().splitlines()]
    assert [row["row_id"] for row in kept] == [10]
    assert not (regen_dir(run_copy, shard) / "manifest.json").exists()
    # The user's recovery: stop the stalled orphan server, unlock, run the same command again.
    stopped = subprocess.run(
        [EAGLEPIPE, "server", "stop", "--config", "config.yaml"],
        cwd=run_copy,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    run_snakemake(run_copy, "--unlock")
    run_snakemake(run_copy, "--cores", "1", "--rerun-incomplete", target)
    log = (run_copy / "logs" / "regenerate" / f"{shard}.log").read_text()
    assert f"{shard}: 1/10 rows kept from an earlier run, 9 to regenerate" in log
    rows = rows_of(run_copy, shard)
    assert rows[0] == kept[0]
    manifest = manifest_of(run_copy, shard)
    assert manifest["timing"]["rows_kept"] == 1
    assert manifest["timing"]["requests_sent"] == sum(len(r["regenerated_turns"]) for r in rows[1:])
    assert (regen_dir(run_copy, shard) / "rows.jsonl").read_bytes() == uninterrupted


# ----------------------------------------------------------------------- rerun policy


def test_dry_runs_list_exactly_the_regeneration_shards_a_change_makes_stale(run_copy):
    assert dry_run_jobs(run_copy, *EXTRACTED) == {}
    everything = {"regenerate": 2, "regeneration_summary": 1, "prepare": 1, "extract": 2}

    def after(edit) -> dict:
        original = (run_copy / "config.yaml").read_text()
        edit_config(run_copy, edit)
        try:
            return dry_run_jobs(run_copy, *EXTRACTED)
        finally:
            (run_copy / "config.yaml").write_text(original)

    regen = "dataset", "regenerate"
    # Greedy decoding ignores the seed and top_p: nothing to do.
    assert after(lambda c: c[regen[0]][regen[1]].update(seed=9, top_p=0.5)) == {}
    assert after(lambda c: c[regen[0]][regen[1]].update(temperature=0.7)) == everything
    assert after(lambda c: c[regen[0]][regen[1]].update(max_new_tokens=25)) == everything
    assert after(lambda c: c[regen[0]][regen[1]].update(turns="last")) == everything
    assert after(lambda c: c[regen[0]][regen[1]].update(on_length_limit="bad_row")) == everything
    # Other settings of the server or client regenerate nothing.
    assert after(lambda c: c["extract"].update(max_inflight_requests=3)) == {}

    # The model: a copy of the same files is the same target; one changed weight byte is not.
    shutil.copytree(Path(yaml.safe_load((run_copy / "config.yaml").read_text())["model"]["path"]),
                    run_copy / "target-copy")  # fmt: skip
    edit_config(run_copy, lambda c: c["model"].update(path=str(run_copy / "target-copy")))
    assert dry_run_jobs(run_copy, *EXTRACTED) == {}
    weights = run_copy / "target-copy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    result = run_snakemake(run_copy, "-n", *EXTRACTED)
    assert dry_run_jobs(run_copy, *EXTRACTED) == everything
    assert ".eaglepipe/provenance/regenerate/rows_0-10.json" in result.stdout


def test_editing_one_row_regenerates_only_its_shard(run_copy):
    dataset = run_copy / "conversations.jsonl"
    lines = dataset.read_text().splitlines(keepends=True)
    row = json.loads(lines[13])
    row["messages"][1]["content"] += " Please answer briefly."
    lines[13] = json.dumps(row) + "\n"
    dataset.write_text("".join(lines))
    result = run_snakemake(run_copy, "-n", *EXTRACTED)
    assert dry_run_jobs(run_copy, *EXTRACTED) == {
        "regenerate": 1,
        "regeneration_summary": 1,
        "prepare": 1,
        "extract": 1,
    }
    assert "output: regenerated/rows_10-20/manifest.json" in result.stdout
    assert "output: regenerated/rows_0-10/manifest.json" not in result.stdout


def test_a_deleted_regenerated_shard_is_noticed_and_its_journalled_rows_come_back(run_copy):
    shard = "rows_0-10"
    rows_before = (regen_dir(run_copy, shard) / "rows.jsonl").read_bytes()
    (regen_dir(run_copy, shard) / "manifest.json").unlink()
    # With no target (`all`): the missing shard is listed, with prepare and its own extraction.
    result = run_snakemake(run_copy, "-n")
    jobs = dry_run_jobs(run_copy)
    assert jobs["regenerate"] == 1 and jobs["prepare"] == 1 and jobs["extract"] == 1
    assert f"regenerated/{shard}/manifest.json" in result.stdout
    run_snakemake(run_copy, "--cores", "2", *EXTRACTED)
    manifest = manifest_of(run_copy, shard)
    assert manifest["timing"]["rows_kept"] == 10 and manifest["timing"]["requests_sent"] == 0
    assert (regen_dir(run_copy, shard) / "rows.jsonl").read_bytes() == rows_before
    # Its hidden states follow its rows: the same rows, so every chunk is kept.
    log = (run_copy / "logs" / "extract" / f"{shard}.log").read_text()
    assert "chunk(s) verified from an earlier run" in log.split("extraction job started")[-1]
    assert dry_run_jobs(run_copy, *EXTRACTED) == {}


def eaglepipe(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [EAGLEPIPE, *args, "--config", "config.yaml"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_damaged_regenerated_rows_are_named_by_verify_and_restored_from_the_journal(run_copy):
    rows = regen_dir(run_copy, "rows_0-10") / "rows.jsonl"
    intact = rows.read_bytes()
    rows.write_bytes(intact[:-200])  # truncate -s -200
    assert dry_run_jobs(run_copy, *EXTRACTED) == {}  # nothing a parse could see
    result = eaglepipe(run_copy, "verify")
    assert result.returncode == 1, result.stdout + result.stderr
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert "regenerated/rows_0-10/rows.jsonl is" in error and "its manifest lists" in error
    assert "repair: regenerated/rows_0-10/rows.jsonl: restored from its journal" in result.stdout
    assert rows.read_bytes() == intact
    assert eaglepipe(run_copy, "verify").returncode == 0
    assert dry_run_jobs(run_copy, *EXTRACTED) == {}


def test_a_deleted_summary_is_written_again_without_preparing_again(run_copy):
    summary = run_copy / "regenerated" / "summary.json"
    before = json.loads(summary.read_text())
    summary.unlink()
    targets = ["regenerated/summary.json", *EXTRACTED]
    assert dry_run_jobs(run_copy, *targets) == {"regeneration_summary": 1}
    run_snakemake(run_copy, "--cores", "1", *targets)
    assert json.loads(summary.read_text()) == before
    assert dry_run_jobs(run_copy, *targets) == {}


def test_damaged_regenerated_rows_stop_the_summary_in_one_line_naming_the_file(run_copy):
    rows = regen_dir(run_copy, "rows_10-20") / "rows.jsonl"
    rows.write_bytes(rows.read_bytes()[:-100])
    summary = run_copy / "regenerated" / "summary.json"
    summary.unlink()
    result = run_snakemake(run_copy, "--cores", "1", "regenerated/summary.json", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors and "regenerated/rows_10-20/rows.jsonl is" in errors[0], output[-3000:]
    assert "its manifest lists" in errors[0] and "eaglepipe verify" in errors[0]
    assert "Traceback" not in output
    assert not summary.exists()


def test_status_verify_and_a_dry_run_agree_after_a_regeneration_setting_changes(run_copy):
    edit_config(run_copy, lambda c: c["dataset"]["regenerate"].update(max_new_tokens=25))
    assert dry_run_jobs(run_copy, *EXTRACTED) == {
        "regenerate": 2,
        "regeneration_summary": 1,
        "prepare": 1,
        "extract": 2,
    }
    status = eaglepipe(run_copy, "status")
    assert "regenerated: 2 planned, 0 done, 2 stale, 0 running" in status.stdout, status.stdout
    assert "shards: 2 planned, 0 done, 2 stale, 0 running" in status.stdout
    verify = eaglepipe(run_copy, "verify", "--check-only")
    assert verify.returncode == 1
    for shard in SHARDS:
        assert f"stale: regenerated/{shard} was made under other settings" in verify.stdout
        assert f"stale: hidden_states/{shard} was extracted from other rows" in verify.stdout
    assert "stale: prepared/ was made from other rows or settings" in verify.stdout


def test_a_full_disk_mid_shard_fails_in_one_line_and_the_next_run_finishes(run_copy):
    shard = "rows_0-10"
    directory = regen_dir(run_copy, shard)
    before = (directory / "rows.jsonl").read_bytes()
    journal_bytes = (directory / "journal.jsonl").stat().st_size
    shutil.rmtree(directory)
    target = f"regenerated/{shard}/manifest.json"
    # A page for the writer lock and pages for about half the journal: some rows are
    # journalled, then an append runs out of space.
    room = 4096 + -(-journal_bytes // 2 // 4096) * 4096
    with small_filesystem(directory, room) as resize:
        full = run_snakemake(run_copy, "--cores", "2", target, check=False)
        output = full.stdout + full.stderr
        assert full.returncode != 0, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert any(
            line.startswith(f"error: no space left on the filesystem of regenerated/{shard} ")
            for line in errors
        ), output[-6000:]
        assert "Traceback" not in output
        left = sorted(p.name for p in directory.iterdir())
        assert "manifest.json" not in left and "rows.jsonl" not in left
        assert not [name for name in left if name.startswith(".")], left  # no temp file
        journalled = 0
        for line in (directory / "journal.jsonl").read_text().splitlines():
            try:
                json.loads(line)
                journalled += 1
            except ValueError:
                pass  # the append the full disk cut short
        assert 0 < journalled < 10

        resize(64 << 20)
        run_snakemake(run_copy, "--cores", "2", target)
        manifest = manifest_of(run_copy, shard)
        assert manifest["timing"]["rows_kept"] == journalled
        assert (directory / "rows.jsonl").read_bytes() == before


def test_prepare_refuses_a_stale_regenerated_shard(run_copy):
    edit_config(run_copy, lambda c: c["dataset"]["regenerate"].update(max_new_tokens=30))
    result = subprocess.run(
        [sys.executable, str(Path(__file__).parent.parent / "scripts" / "prepare.py"),
         "--config", "config.yaml"],
        cwd=run_copy, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "regenerated/rows_0-10/manifest.json is missing or was made under other settings" in line


def test_a_dry_run_lists_every_shard_still_to_regenerate(tmp_path):
    config = small_config(tmp_path, rows=25, rows_per_shard=10)
    config["dataset"]["regenerate"]["enabled"] = True
    write_config(tmp_path, config)
    result = run_snakemake(tmp_path, "-n")
    assert dry_run_jobs(tmp_path)["regenerate"] == 3
    for shard in ("rows_0-10", "rows_10-20", "rows_20-25"):
        assert f"regenerated/{shard}/manifest.json" in result.stdout


def test_the_seed_matters_only_when_sampling(tmp_path, monkeypatch):
    from eaglepipe.plan.provenance import regeneration_provenance

    monkeypatch.chdir(tmp_path)
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    config = load_config(Path(__file__).parent.parent / "config.yaml")
    config["dataset"]["path"] = str(dataset)

    def provenance(**settings) -> str:
        changed = json.loads(json.dumps(config))
        changed["dataset"]["regenerate"].update(settings)
        return regeneration_provenance(resolve(changed), "rows_0-1")

    assert provenance(seed=1) == provenance(seed=2)
    assert provenance(temperature=0.8, seed=1) != provenance(temperature=0.8, seed=2)
    assert provenance(temperature=0.8, top_p=0.9) != provenance(temperature=0.8, top_p=0.5)


# ------------------------------------------------------------------------------ bad rows


def test_rows_the_target_cannot_answer_follow_dataset_bad_rows(run_copy):
    """Row 15 is not JSON: under `error` the workflow refuses it at its start, before any job.
    Row 3's replies come back empty (the server's empty_reply fault), which only its shard's job
    can find: under `error` that shard stops naming the row. Under `skip` both are counted, and
    prepare reports them."""
    dataset = run_copy / "conversations.jsonl"
    intact = dataset.read_text()
    lines = intact.splitlines(keepends=True)
    lines[15] = lines[15][:20] + "\n"
    dataset.write_text("".join(lines))
    for shard in SHARDS:
        shutil.rmtree(regen_dir(run_copy, shard))
    env_fault = {"EAGLEPIPE_FAULT": "empty_reply:3"}
    targets = [f"regenerated/{s}/manifest.json" for s in SHARDS]
    edit_config(run_copy, lambda c: c["dataset"].update(bad_rows="error"))  # not the default
    refused = run_fault(run_copy, env_fault, "--cores", "2", "--keep-going", *targets)
    assert refused.returncode != 0
    output = refused.stdout + refused.stderr
    (error,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {dataset} row 15 (line 16): invalid JSON: ")
    assert error.endswith("(set dataset.bad_rows: skip to skip and count such rows)")
    assert not any(regen_dir(run_copy, shard).exists() for shard in SHARDS)

    dataset.write_text(intact)
    failed = run_fault(run_copy, env_fault, "--cores", "2", "--keep-going", *targets)
    assert failed.returncode != 0
    log = (run_copy / "logs" / "regenerate" / "rows_0-10.log").read_text()
    (error,) = [line for line in log.splitlines() if line.startswith("error:")]
    expected = (
        "row 3 (line 4): empty regenerated reply: message 1: the target's reply is empty (set "
        "dataset.bad_rows: skip to skip and count such rows)"
    )
    assert expected in error
    assert not (regen_dir(run_copy, "rows_0-10") / "manifest.json").exists()
    recorded = json.loads((regen_dir(run_copy, "rows_0-10") / "failed.json").read_text())
    assert expected in recorded["error"]
    assert (regen_dir(run_copy, "rows_10-20") / "manifest.json").exists()

    dataset.write_text("".join(lines))
    edit_config(run_copy, lambda c: c["dataset"].update(bad_rows="skip"))
    result = run_fault(run_copy, env_fault, "--cores", "2", *EXTRACTED)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first, second = manifest_of(run_copy, "rows_0-10"), manifest_of(run_copy, "rows_10-20")
    assert first["bad_reasons"] == {"empty regenerated reply": 1} and first["bad_rows"] == 1
    assert second["bad_reasons"] == {"invalid JSON": 1} and second["regenerated_rows"] == 9
    skipped = json.loads((run_copy / "prepared" / "skipped.json").read_text())
    assert skipped["reasons"] == {"empty regenerated reply": 1, "invalid JSON": 1}
    assert [row["row_id"] for row in skipped["rows"]] == [3, 15]
    hidden = json.loads((run_copy / "hidden_states" / "rows_0-10" / "manifest.json").read_text())
    assert 3 not in [r for chunk in hidden["chunks"] for r in chunk["row_ids"]]


def run_fault(workdir: Path, extra_env: dict, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra_env)
    env.pop("EAGLEPIPE_RUN_TOKEN", None)
    return subprocess.run(
        snakemake_argv(workdir, *args), capture_output=True, text=True, timeout=1200, env=env
    )
