"""A run's disk known before it starts: the bytes each stage of the plan stores, from a real
prepared table, against the free space where the stage writes; a plan that cannot fit is
refused in one line, at workflow start, before any job runs."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import yaml
from conftest import REPO_ROOT, small_filesystem
from pipeline_run import isolate, run_snakemake

from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.data.toy_target import build_toy_target
from eaglepipe.extract.chunk_file import ROW_INDEX_BYTES, TOKEN_ID_BYTES, plan_chunks
from eaglepipe.ops import disk_plan
from eaglepipe.ops.disk_plan import DRAFTER_SIZE_CACHE, PreparedRows, planned_disk
from eaglepipe.prepare.table import run_prepare

BF16_BYTES = 2  # a bf16 value, counted here apart from the chunk format's own function

SAMPLE = REPO_ROOT / "data" / "sample" / "conversations.jsonl"
SHARDS = ["rows_0-16", "rows_16-32", "rows_32-40"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A working directory with a real tokenized table of 40 rows in 3 shards (a toy target
    with its tokenizer, prepared by the prepare stage), and its config."""
    workdir = tmp_path_factory.mktemp("disk-plan")
    toy = dict(load_config(REPO_ROOT / "config.yaml")["model"]["toy"])
    toy["train_steps"] = 0  # prepare needs the tokenizer only
    model = build_toy_target(workdir / "target", toy, SAMPLE, 1)
    dataset = workdir / "conversations.jsonl"
    dataset.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:40]))
    config = copy.deepcopy(load_config(REPO_ROOT / "config.yaml"))
    config["model"]["path"] = str(model)
    config["dataset"]["path"] = str(dataset)
    config["dataset"]["regenerate"]["enabled"] = False
    config["shards"]["rows_per_shard"] = 16
    config["shards"]["chunk_max_bytes"] = 1 << 18
    config = isolate(config, workdir)
    run_prepare(resolve(config), prepared_dir=workdir / "prepared", cache_dir=workdir / "cache")
    return workdir, config


def stage(plan, name):
    return next(s for s in plan.stages if s.stage == name)


def test_the_plan_states_each_stages_bytes_from_the_table(prepared):
    workdir, config = prepared
    run = resolve(config)
    plan = planned_disk(run, workdir)
    rows = PreparedRows.read(workdir / "prepared" / "tokenized.parquet")
    tokens, hidden = int(rows.num_tokens.sum()), run.model.hidden_size
    layers = len(run.aux_layer_ids) + 1

    hidden_states = stage(plan, "hidden_states")
    # Every token's aux and final states in bf16 and its id and mask; each row's offset and id;
    # each shard's leading offset (its chunk format's estimate, extract/chunk_file.py).
    per_token = layers * hidden * BF16_BYTES + TOKEN_ID_BYTES
    assert hidden_states.planned_bytes == (
        tokens * per_token + len(rows.row_ids) * ROW_INDEX_BYTES + 8 * len(SHARDS)
    )
    # The shard jobs' own estimate, chunk by chunk, differs by 8 bytes a chunk.
    chunks = 0
    for start, end in ((0, 16), (16, 32), (32, 40)):
        row_ids, num_tokens = rows.of_rows(start, end)
        chunks += len(
            plan_chunks(row_ids, num_tokens, hidden, max_chunk_bytes=run.shards.chunk_max_bytes)
        )
    assert chunks > len(SHARDS)  # the 256 KiB bound splits the shards
    assert 0 < 8 * chunks - 8 * len(SHARDS) < hidden_states.planned_bytes * 1e-3
    # Nothing is extracted yet: all of it is still to write, on the run directory's disk.
    assert hidden_states.to_write == hidden_states.planned_bytes
    assert hidden_states.directory == workdir / "hidden_states" and hidden_states.free > 0

    dump = stage(plan, "dump_root")
    assert dump.to_write == int(rows.num_tokens.max()) * layers * hidden * BF16_BYTES
    assert dump.directory == workdir / "dumps"

    drafter = stage(plan, "drafter")
    parameters = json.loads((workdir / DRAFTER_SIZE_CACHE).read_text())["parameters"]
    engines = len(run.export.engines)
    assert drafter.planned_bytes == parameters * (4 + 3 * 12 + engines * 2)
    assert drafter.to_write == drafter.planned_bytes
    assert [s.stage for s in plan.stages] == ["hidden_states", "dump_root", "drafter"]

    text = plan.text()
    assert text.startswith("disk plan: fits")
    assert f"hidden_states: {disk_plan.format_bytes(hidden_states.planned_bytes)} planned" in text
    assert f"3 of 3 shards to extract, {tokens:,} tokens" in text
    assert f"free on {workdir}" in text


def test_with_regeneration_the_shards_to_regenerate_are_planned(prepared):
    workdir, config = prepared
    config = copy.deepcopy(config)
    config["dataset"]["regenerate"]["enabled"] = True
    plan = planned_disk(resolve(config), workdir)
    assert [s.stage for s in plan.stages] == [
        "hidden_states",
        "dump_root",
        "regenerated",
        "drafter",
    ]
    regenerated = stage(plan, "regenerated")
    # None is regenerated yet: each shard at twice its share of the source file's bytes.
    per_row = (workdir / "conversations.jsonl").stat().st_size / 40 * 2
    assert regenerated.to_write == sum(int(per_row * n) for n in (16, 16, 8))
    assert regenerated.directory == workdir / "regenerated"
    assert "3 of 3 shards to regenerate" in plan.text()


def test_the_drafters_size_is_counted_from_its_real_parameters(prepared):
    from eaglepipe.drafter.model import Eagle3Drafter, drafter_config

    workdir, config = prepared
    run = resolve(config)
    model = Eagle3Drafter(drafter_config(run, run.train.draft_vocab_size))
    real = sum(t.numel() for t in model.trainable_state_dict().values())
    (workdir / DRAFTER_SIZE_CACHE).unlink(missing_ok=True)
    assert disk_plan._drafter_parameters(run, workdir) == real
    assert json.loads((workdir / DRAFTER_SIZE_CACHE).read_text())["parameters"] == real
    # Another draft vocabulary is another drafter: counted again, not read from the cache.
    config = copy.deepcopy(config)
    vocab = run.train.draft_vocab_size
    config["train"]["draft_vocab_size"] = vocab // 2
    smaller = disk_plan._drafter_parameters(resolve(config), workdir)
    # lm_head loses a row of hidden_size weights per draft token, d2t one offset.
    assert smaller == real - (vocab - vocab // 2) * (run.model.hidden_size + 1)


def test_work_already_on_disk_is_not_counted_again(prepared, tmp_path):
    workdir, config = prepared
    copy_dir = tmp_path / "run"
    shutil.copytree(workdir, copy_dir, ignore=shutil.ignore_patterns("target", "dumps"))
    config = copy.deepcopy(config)
    config["dataset"]["path"] = str(copy_dir / "conversations.jsonl")
    run = resolve(config)
    before = stage(planned_disk(run, copy_dir), "hidden_states")
    # A killed job left 1000 bytes of chunks in one shard: the shard ends at its planned size.
    shard_dir = copy_dir / "hidden_states" / SHARDS[1]
    shard_dir.mkdir(parents=True)
    (shard_dir / "chunk-00000.safetensors").write_bytes(b"\0" * 1000)
    after = stage(planned_disk(run, copy_dir), "hidden_states")
    assert after.planned_bytes == before.planned_bytes
    assert after.to_write == before.to_write - 1000


def test_status_states_the_plan_before_extraction(prepared):
    import io

    from eaglepipe.ops.status import print_status

    workdir, config = prepared
    out = io.StringIO()
    print_status(resolve(config), workdir=workdir, stream=out)
    text = out.getvalue()
    assert "disk plan: fits" in text
    assert "  hidden_states: " in text and "3 of 3 shards to extract" in text
    assert "  dump_root: " in text and "  drafter: " in text


def test_a_plan_that_cannot_fit_is_named_with_its_stage_directory_and_remedy(prepared, monkeypatch):
    workdir, config = prepared
    run = resolve(config)
    plan = planned_disk(run, workdir)
    needed = stage(plan, "hidden_states").to_write
    monkeypatch.setattr(disk_plan, "free_bytes", lambda directory: needed // 2)
    plan = planned_disk(run, workdir)
    assert plan.text().startswith("disk plan: DOES NOT FIT")
    with pytest.raises(PipelineError) as refused:
        plan.check(run)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the plan cannot fit: hidden_states (")
    assert f"on the file system of {workdir}, which has" in message
    assert "capture fewer aux layers (aux_layer_ids: 3 now)" in message
    assert "or run the workflow in a directory on a larger disk" in message
    assert "store the states in FP8 at about half the bytes" in message


def test_an_fp8_store_plans_about_half_the_hidden_state_bytes(prepared):
    """The plan counts the configured store's bytes (values and per-token scales), and an FP8
    plan no longer offers FP8 as the way to fit."""
    workdir, config = prepared
    bf16 = stage(planned_disk(resolve(config), workdir), "hidden_states")
    fp8_config = copy.deepcopy(config)
    fp8_config["extract"]["store"] = {"aux": "fp8_e4m3", "final": "fp8_e4m3"}
    fp8_run = resolve(fp8_config)
    fp8 = stage(planned_disk(fp8_run, workdir), "hidden_states")
    assert 0.45 * bf16.planned_bytes < fp8.planned_bytes < 0.55 * bf16.planned_bytes
    assert "FP8" not in disk_plan._remedy(fp8_run, [fp8])


def test_the_workflow_refuses_a_plan_that_cannot_fit_before_any_job(prepared, tmp_path):
    """A real run against a dump root on a tmpfs smaller than the longest row's dump: stopped
    at its start in one line naming the stage and the directory; no job ran."""
    workdir, config = prepared
    run_dir = tmp_path / "run"
    shutil.copytree(workdir, run_dir, ignore=shutil.ignore_patterns("dumps"))
    config = copy.deepcopy(config)
    config["model"]["path"] = str(run_dir / "target")
    config["dataset"]["path"] = str(run_dir / "conversations.jsonl")
    longest = stage(planned_disk(resolve(config), workdir), "dump_root").to_write
    size = max(4096, longest // 2 // 4096 * 4096)
    assert longest > size, "the toy's longest dump must exceed the small file system"
    dump_root = run_dir / "small-shm"
    config["server"]["dump_root"] = str(dump_root)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    with small_filesystem(dump_root, size):
        dump_root.chmod(0o700)  # a fresh tmpfs is world-writable, which the server refuses
        result = run_snakemake(run_dir, "--cores", "1", check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: the plan cannot fit: dump_root (")
    assert f"on the file system of {dump_root}" in errors[0]
    assert "point server.dump_root at a larger file system" in errors[0]
    assert "disk plan: DOES NOT FIT" in result.stderr
    # Refused before any job: no job's log, no run record.
    assert not (run_dir / "logs").exists()
    assert not (run_dir / ".eaglepipe" / "run.json").exists()

    # A target of its own needs less than the whole plan: warned, and it runs.
    with small_filesystem(dump_root, size):
        dump_root.chmod(0o700)
        result = run_snakemake(run_dir, "--cores", "1", "drafter/vocab.safetensors")
    assert "eaglepipe: warning: the plan cannot fit: dump_root (" in result.stderr
    assert "(running only the targets asked for)" in result.stderr
    assert (run_dir / "drafter" / "vocab.safetensors").exists()
