"""Trying to break a finished run, as a demanding user would: every damage or change afterwards
is noticed by `snakemake` (or named by `eaglepipe verify` with the one command that repairs it),
and every state reached is one `snakemake --cores N` finishes.

One small run of the whole pipeline (the embedded toy target, 40 rows in 4 shards, through
training, export and live acceptance) is shared by this module; each test works on a copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pipeline_run import dry_run_jobs, isolate, run_snakemake, small_config, write_config

SHARDS = ["rows_0-10", "rows_10-20", "rows_20-30", "rows_30-40"]
EAGLEPIPE = str(Path(sys.executable).parent / "eaglepipe")
# What follows training: every job a retrain reruns.
AFTER_TRAIN = {"evaluate", "export", "live_acceptance", "report_training", "report_acceptance"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("finished")
    write_config(workdir, small_config(workdir))
    run_snakemake(workdir, "--cores", "2", timeout=1800)
    return workdir


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A private copy of the finished run (Snakemake metadata included), on its own port.

    It reads the dataset file of the original run: the toy target is identified by that path.
    """
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir, ignore=shutil.ignore_patterns("dumps", "server"))
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    write_config(workdir, isolate(config, workdir))
    return workdir


def edit_config(workdir: Path, edit) -> None:
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    edit(config)
    write_config(workdir, config)


def eaglepipe(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [EAGLEPIPE, *args, "--config", "config.yaml"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )


def shard_file(workdir: Path, shard: str, name: str) -> Path:
    return workdir / "hidden_states" / shard / name


def test_the_finished_run_leaves_nothing_to_do(finished):
    assert dry_run_jobs(finished) == {}


def test_a_deleted_manifest_plans_its_shard_and_what_follows(run):
    # The README's recovery for one shard: delete its manifest, run snakemake. The run itself
    # is the same as after verify sets a damaged shard aside (the `flip` repair below runs it).
    shard_file(run, "rows_10-20", "manifest.json").unlink()
    jobs = dry_run_jobs(run)
    assert jobs["extract"] == 1 and jobs["validate"] == 1 and jobs["train"] == 1
    assert AFTER_TRAIN <= set(jobs)


def test_a_deleted_validation_report_revalidates_and_retrains(run):
    (run / "validated" / "rows_20-30.json").unlink()
    jobs = dry_run_jobs(run)
    assert jobs["validate"] == 1 and jobs["train"] == 1 and "extract" not in jobs


def test_a_validation_report_recording_a_failed_check_is_revalidated(run):
    # The validate job writes none: an edited one was trusted, and training read its shard.
    report = run / "validated" / "rows_20-30.json"
    data = json.loads(report.read_text())
    data["checks"]["integrity"]["ok"] = False
    report.write_text(json.dumps(data))
    jobs = dry_run_jobs(run)
    assert jobs["validate"] == 1 and jobs["train"] == 1 and "extract" not in jobs


def test_a_manifest_changed_under_an_old_mtime_is_revalidated(run):
    # cp -p / rsync -a of an edited manifest keeps the old mtime: Snakemake's own check misses it.
    manifest = shard_file(run, "rows_30-40", "manifest.json")
    stat = manifest.stat()
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(data, indent=1))
    os.utime(manifest, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    jobs = dry_run_jobs(run)
    assert jobs["validate"] == 1 and jobs["train"] == 1 and "extract" not in jobs


def test_a_failed_training_is_rerun_with_everything_after_it(run):
    # What a failed train job leaves: Snakemake deletes its outputs; the old eval, exports and
    # live check are still there and must not pass for the new drafter's.
    (run / "drafter" / "model.safetensors").unlink()
    (run / "drafter" / "train_log.jsonl").unlink()
    jobs = dry_run_jobs(run)
    assert jobs["train"] == 1 and AFTER_TRAIN <= set(jobs)
    assert "extract" not in jobs and "validate" not in jobs


@pytest.mark.parametrize(
    ("key", "value", "rerun", "not_rerun"),
    [
        ("validate.seed", 7, {"validate": 4, "train": 1}, {"extract", "vocab"}),
        ("train.draft_vocab_size", 200, {"vocab": 1, "train": 1}, {"extract", "validate"}),
        ("train.lr", 0.002, {"train": 1}, {"extract", "validate", "vocab"}),
        ("train.drafter", {"norm_output": True}, {"train": 1}, {"extract", "validate", "vocab"}),
        ("evaluate.max_rows", 3, {"evaluate": 1, "live_acceptance": 1}, {"train", "export"}),
        ("export.engines", ["sglang"], {"export": 1, "live_acceptance": 1}, {"train", "evaluate"}),
        ("evaluate.live_new_tokens", 6, {"live_acceptance": 1}, {"train", "evaluate", "export"}),
    ],
)
def test_a_settings_change_reruns_exactly_its_stage_and_what_follows(
    run, key, value, rerun, not_rerun
):
    section, name = key.split(".")
    edit_config(run, lambda config: config[section].__setitem__(name, value))
    jobs = dry_run_jobs(run)
    for rule, count in rerun.items():
        assert jobs.get(rule) == count, (key, jobs)
    for rule in not_rerun | {"prepare", "build_toy_target"}:
        assert rule not in jobs, (key, rule, jobs)


# What `eaglepipe status` calls stale, by the workflow's rule that remakes it.
STATUS_STAGES = {
    "vocab": "vocab",
    "training": "train",
    "evaluation": "evaluate",
    "export": "export",
    "live": "live_acceptance",
}


def planned_by_status(text: str) -> dict[str, int]:
    """Jobs per rule that `eaglepipe status` says the next run makes, in `dry_run_jobs` form."""
    planned: dict[str, int] = {}
    for line in text.splitlines():
        label, _, rest = line.partition(": ")
        if label == "shards":  # "4 planned, 1 done, 3 stale, ...": all but the done ones
            counts = dict(reversed(part.split()) for part in rest.split(", "))
            planned["extract"] = int(counts["planned"]) - int(counts["done"])
        elif label == "validated":
            counts = dict(reversed(part.split()) for part in rest.split(", "))
            planned["validate"] = int(counts.get("stale", 0)) + int(counts["remaining"])
        elif label in STATUS_STAGES and rest.startswith("stale ("):
            planned[STATUS_STAGES[label]] = 1
        elif line.startswith("stale: prepared/"):
            planned["prepare"] = 1
    return {rule: count for rule, count in planned.items() if count}


# One key of each stage's settings: what a dry run makes again is what status calls stale.
SETTINGS_OF_EACH_STAGE = [
    ("dataset.max_length", 384),
    ("shards.chunk_max_bytes", 1 << 19),
    ("extract.retries", 5),
    ("validate.seed", 7),
    ("train.lr", 0.002),
    ("evaluate.max_rows", 3),
    ("export.engines", ["sglang"]),
]


@pytest.mark.parametrize(("key", "value"), SETTINGS_OF_EACH_STAGE)
def test_status_and_a_dry_run_agree_on_what_a_settings_change_makes_again(run, key, value):
    section, name = key.split(".")
    edit_config(run, lambda config: config[section].__setitem__(name, value))
    # Before the dry run (which rewrites the stamps) and after it: the same judgement.
    before = eaglepipe(run, "status")
    jobs = dry_run_jobs(run)
    after = eaglepipe(run, "status")
    planned = {rule: n for rule, n in jobs.items() if not rule.startswith("report_")}
    planned.pop("all", None)
    assert planned_by_status(before.stdout) == planned, (key, before.stdout, jobs)
    assert planned_by_status(after.stdout) == planned, (key, after.stdout, jobs)
    if key == "extract.retries":
        assert planned == {}  # no provenance holds it: nothing is made again


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_verify_sets_damaged_data_aside_and_snakemake_repairs_it(run, damage):
    chunk = shard_file(run, "rows_20-30", "chunk-00000.safetensors")
    intact = {p.name: p.stat().st_mtime_ns for p in (run / "hidden_states" / "rows_0-10").iterdir()}
    if damage == "flip":
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
    elif damage == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:-100])
    else:
        chunk.unlink()
    # Snakemake cannot see damage inside a finished shard without reading it ...
    assert dry_run_jobs(run) == {}
    # ... verify does, and names the one command that repairs it.
    result = eaglepipe(run, "verify")
    assert result.returncode == 1
    assert "rows_20-30" in result.stdout and "chunk-00000.safetensors" in result.stdout
    assert "repair: `snakemake --cores N`" in result.stdout
    assert not shard_file(run, "rows_20-30", "manifest.json").exists()
    status = eaglepipe(run, "status")
    assert "rows_20-30" in status.stdout and "damaged" in status.stdout
    jobs = dry_run_jobs(run)
    assert jobs["extract"] == 1 and jobs["train"] == 1
    if damage != "flip":
        return  # the repair run is the same for every kind of damage: run it once
    run_snakemake(run, "--cores", "2", timeout=1200)
    assert eaglepipe(run, "verify").returncode == 0
    assert dry_run_jobs(run) == {}
    # The intact shards were not touched.
    assert {
        p.name: p.stat().st_mtime_ns for p in (run / "hidden_states" / "rows_0-10").iterdir()
    } == intact


def test_verify_sets_a_torn_shard_manifest_aside_as_damaged_not_stale(run):
    """Regression: a torn manifest was reported, then verify stopped on setting it aside (it
    read the manifest again) and named the shard stale as well, with another repair."""
    manifest = shard_file(run, "rows_20-30", "manifest.json")
    torn = manifest.read_bytes()[:100]
    manifest.write_bytes(torn)
    result = eaglepipe(run, "verify")
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "rows_20-30/manifest.json is not valid JSON" in errors[0], errors
    assert "rows_20-30: manifest set aside" in result.stdout, result.stdout
    assert "repair: `snakemake --cores N` rebuilds rows_20-30 from the journalled chunks" in (
        result.stdout
    )
    assert "re-extracts the damaged chunks" not in result.stdout  # none is damaged
    assert "stale:" not in result.stdout, result.stdout
    assert "Traceback" not in result.stderr and "error:" not in result.stderr, result.stderr
    assert not manifest.exists()
    record = json.loads(shard_file(run, "rows_20-30", "manifest.invalid.json").read_text())
    assert record["manifest_text"] == torn.decode() and "not valid JSON" in record["reason"]
    assert "rows_20-30" in eaglepipe(run, "status").stdout
    jobs = dry_run_jobs(run)
    assert jobs["extract"] == 1 and jobs["train"] == 1


def test_verify_checks_every_stage_and_a_rebuilt_table_leaves_the_shards_fresh(run):
    """The prepared table, the trained drafter and an export, damaged where snakemake cannot
    see it: verify names each and sets it aside; the next run makes exactly those again (and
    what follows them), never the hidden states or their validation."""

    def damage(path: Path, change) -> None:
        # As a disk or a copy damages a file: its bytes change, its mtime does not.
        stat = path.stat()
        path.write_bytes(change(path.read_bytes()))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    table = run / "prepared" / "tokenized.parquet"
    intact_table = table.read_bytes()
    middle = len(intact_table) // 2
    damage(table, lambda b: b[:middle] + bytes([b[middle] ^ 0xFF]) + b[middle + 1 :])
    model = run / "drafter" / "model.safetensors"
    damage(model, lambda b: b[:-64])
    config = run / "drafter" / "export" / "vllm" / "config.json"
    damage(config, lambda b: b.replace(b'"num_hidden_layers": 1', b'"num_hidden_layers": 2'))
    assert dry_run_jobs(run) == {}

    result = eaglepipe(run, "verify")
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3, result.stdout
    for damaged in (table, model, config):
        assert any(str(damaged.relative_to(run)) in line for line in errors), damaged
    assert (
        "repair: prepared/tokenized.parquet: set aside as prepared/tokenized.invalid.parquet; "
        "`snakemake --cores N` prepares the table again" in result.stdout
    )
    assert (run / "prepared" / "tokenized.invalid.parquet").exists() and not table.exists()
    assert not model.exists() and not config.exists()
    jobs = dry_run_jobs(run)
    assert jobs["prepare"] == 1 and jobs["train"] == 1 and jobs["export"] == 1
    assert "extract" not in jobs and "validate" not in jobs
    run_snakemake(run, "--cores", "2", timeout=1200)
    assert table.read_bytes() == intact_table
    assert eaglepipe(run, "verify").returncode == 0
    assert dry_run_jobs(run) == {}


def test_verify_names_a_damaged_evaluation_or_live_report_and_only_they_are_redone(run):
    """The drafter's reports are JSON: cut short, or another file in their place, verify names
    each with its repair and sets it aside; the plan then evaluates and checks live again,
    never training or exporting again."""
    evaluation, live = run / "drafter" / "eval.json", run / "drafter" / "live.json"
    stat = evaluation.stat()
    evaluation.write_bytes(evaluation.read_bytes()[:40])
    os.utime(evaluation, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    live.write_text("[]")
    result = eaglepipe(run, "verify", "--check-only")
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: drafter/eval.json cannot be read as JSON ({json_error(evaluation)})",
        "error: drafter/live.json is JSON but has no acceptance_length (not a live report)",
    ], result.stdout
    assert evaluation.exists() and live.exists()  # --check-only changes nothing

    result = eaglepipe(run, "verify")
    assert "repair: drafter/eval.json: set aside as drafter/eval.invalid.json; `snakemake " \
        "--cores N` evaluates the drafter again" in result.stdout, result.stdout  # fmt: skip
    assert not evaluation.exists() and (run / "drafter" / "live.invalid.json").exists()
    jobs = dry_run_jobs(run)
    assert {"evaluate", "live_acceptance", "report_acceptance"} <= set(jobs), jobs
    assert not set(jobs) & {"train", "export", "extract", "validate", "prepare"}, jobs


def json_error(path: Path) -> str:
    try:
        json.loads(path.read_text())
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"{path} parses")


def test_a_failed_prepare_leaves_fresh_shards_fresh(run):
    # What a failed prepare leaves: Snakemake removed its outputs. The shards' own rows did not
    # change, so the table made again must not rerun their extraction or validation.
    for name in ("tokenized.parquet", "summary.json", "skipped.json"):
        (run / "prepared" / name).unlink()
    jobs = dry_run_jobs(run)
    assert jobs["prepare"] == 1 and jobs["train"] == 1
    assert "extract" not in jobs and "validate" not in jobs


def test_status_verify_and_a_dry_run_judge_a_changed_setting_alike(run):
    """For the config they are given, by the workflow's rule; and a dry run with another config
    never changes the config and facts the finished run recorded."""
    recorded = {
        name: (run / ".eaglepipe" / name).read_bytes() for name in ("config.json", "run.json")
    }
    edit_config(run, lambda config: config["dataset"].__setitem__("max_length", 384))
    jobs = dry_run_jobs(run)
    assert jobs["prepare"] == 1 and jobs["extract"] == 4 and jobs["validate"] == 4
    for name, content in recorded.items():
        assert (run / ".eaglepipe" / name).read_bytes() == content, name
    status = eaglepipe(run, "status")
    assert "shards: 4 planned, 0 done, 4 stale" in status.stdout, status.stdout
    assert "stale: prepared/ was made from other rows or settings" in status.stdout
    verify = eaglepipe(run, "verify", "--check-only")
    assert verify.returncode == 1
    stale = [line for line in verify.stdout.splitlines() if line.startswith("stale: ")]
    assert stale == ["stale: prepared/ was made from other rows or settings than this config: "
                     "`snakemake --cores N` prepares it again"] + [
        f"stale: hidden_states/{shard} was extracted from other rows or settings than this "
        "config: `snakemake --cores N` extracts it again (keeping the chunks whose rows are "
        "unchanged)"
        for shard in SHARDS
    ]  # fmt: skip
    # The recorded config (status's default) still describes the finished run: nothing stale.
    default = subprocess.run(
        [EAGLEPIPE, "status"], cwd=run, capture_output=True, text=True, timeout=300
    )
    assert "shards: 4 planned, 4 done, 0 running" in default.stdout, default.stdout


def test_shards_of_an_earlier_plan_are_named_and_never_trained_on(run):
    edit_config(run, lambda config: config["shards"].__setitem__("rows_per_shard", 20))
    verify = eaglepipe(run, "verify", "--check-only")
    for old in SHARDS:
        assert f"hidden_states/{old} is not in the current shard plan" in verify.stdout
        assert f"rm -r hidden_states/{old}" in verify.stdout
    status = eaglepipe(run, "status")
    assert "not in the plan: 4 shard dir(s)" in status.stdout
    jobs = dry_run_jobs(run)
    assert jobs["extract"] == 2  # rows_0-20 and rows_20-40, the new plan's


def test_another_dataset_file_rebuilds_the_toy_target(run):
    # The toy's tokenizer is trained on the dataset file.
    other = run / "other.jsonl"
    shutil.copy(run / "conversations.jsonl", other)  # same rows, another file
    edit_config(run, lambda config: config["dataset"].__setitem__("path", str(other)))
    assert dry_run_jobs(run)["build_toy_target"] == 1


def test_status_output_into_a_closed_pipe_is_not_an_error(finished):
    # `true` exits at once: eaglepipe's output meets a closed pipe, as `| head` after its lines.
    result = subprocess.run(
        f"{EAGLEPIPE} status --all --config config.yaml | true; echo done",
        shell=True,
        cwd=finished,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout == "done\n"
    assert "BrokenPipeError" not in result.stderr and "Traceback" not in result.stderr


def test_the_drafter_variants_benchmark_retrains_on_the_runs_own_shards(run, tmp_path):
    """Same shards, vocabulary, seed and steps per variant: the plain variant is the run's own
    drafter again, and each variant is evaluated, exported and checked live."""
    out = tmp_path / "variants"
    argv = [
        sys.executable, "-u", "-m", "benchmarks.studies.drafter_variants",
        "--run-dir", str(run), "--out", str(out),
        "--variants", "plain,fc_norm+norm_output",
    ]  # fmt: skip
    proc = subprocess.run(
        argv, cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plain, both = json.loads((out / "summary.json").read_text())["results"]
    own = json.loads((run / "drafter" / "eval.json").read_text())
    assert plain["offline_acceptance_length"] == pytest.approx(own["acceptance_length"], abs=1e-9)
    assert plain["steps"] == both["steps"] > 0
    assert both["drafter"]["fc_norm"] is True and both["drafter"]["norm_output"] is True
    exported = json.loads((out / "fc_norm+norm_output/export/sglang/config.json").read_text())
    assert exported["fc_norm"] is True and exported["norm_output"] is True
    for result in (plain, both):
        assert result["live_prompts"] == result["outputs_match_greedy"] == 2
        assert result["live_acceptance_length"] >= 1.0
    assert "| fc_norm+norm_output |" in proc.stdout
    # A second call reads the finished variants back instead of training them again.
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "training drafter" not in again.stdout
