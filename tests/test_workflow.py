"""The Snakemake workflow itself: DAG, rerun policy, single-shard rebuilds and the training gate.

One small extraction run (a user-style model directory, 40 rows in 4 shards) is shared by the
tests of this module; each test that changes something works on its own copy of that run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT
from drafter_helpers import flip_low_bit
from pipeline_run import (
    copy_run,
    dry_run_jobs,
    run_on_toy_as_user_model,
    run_snakemake,
    small_config,
    write_config,
)

from eaglepipe.core.errors import PipelineError
from eaglepipe.core.fingerprint import hash_file, missing_weights

SHARDS = ["rows_0-10", "rows_10-20", "rows_20-30", "rows_30-40"]
VALIDATED = [f"validated/{s}.json" for s in SHARDS]


def manifest(workdir: Path, shard: str) -> Path:
    return workdir / "hidden_states" / shard / "manifest.json"


@pytest.fixture(scope="module")
def extracted(tmp_path_factory) -> Path:
    """Every shard extracted and validated, with the toy target used as a user model dir."""
    workdir = tmp_path_factory.mktemp("extracted")
    return run_on_toy_as_user_model(workdir, small_config(workdir), *VALIDATED)


@pytest.fixture
def run_copy(extracted, tmp_path) -> Path:
    """A private copy of the extracted run (Snakemake metadata included), on its own port."""
    # The model stays where it was: moving it would change nothing the provenance hashes.
    return copy_run(extracted, tmp_path / "run")


def test_schema_error_names_the_bad_key(tmp_path):
    config = small_config(tmp_path)
    config["shards"]["rows_per_shrd"] = 3
    write_config(tmp_path, config)
    result = run_snakemake(tmp_path, "-n", check=False)
    assert result.returncode != 0
    assert "config key shards.rows_per_shrd" in result.stdout + result.stderr


def refused_dry_run(workdir: Path, config: dict) -> tuple[str, str]:
    """`snakemake -n` with `config`, which must fail: (its one `error:` line, all it printed)."""
    write_config(workdir, config)
    result = run_snakemake(workdir, "-n", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    (line,) = [line for line in output.splitlines() if line.startswith("error:")]
    return line, output


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("shards", "rows_per_shard", 0, "config key shards.rows_per_shard"),
        ("model", "path", "/nonexistent/model", "/nonexistent/model"),
        ("server", "engine", "vllm", "config key server.engine"),
        ("dataset", "path", "/nonexistent.jsonl", "/nonexistent.jsonl"),
        # Empty strings were taken as "not set" (the toy target) or as the working directory.
        ("model", "path", "", "config key model.path"),
        ("dataset", "path", "", "config key dataset.path"),
        ("server", "host", "", "config key server.host"),
        # Checked by prepare only, that is after every shard's regeneration.
        (
            "dataset",
            "holdout",
            {"mode": "shards", "shards": ["rows_0-7"]},
            "config key dataset.holdout.shards: rows_0-7 is not a shard of the plan",
        ),
        # Found by evaluate, after extraction and training.
        (
            "dataset",
            "holdout",
            {"mode": "fraction", "fraction": 0.0},
            "config key dataset.holdout.fraction: 0.0 holds out none of the",
        ),
        # Every regenerate request failed on it, blamed on its row.
        (
            "dataset",
            "max_length",
            4096,
            "config key dataset.max_length: 4096 is more than the target's "
            "max_position_embeddings, 2048 (model.toy): lower it",
        ),
        # Refused by the train job, after extraction (the toy target is a Llama).
        (
            "train",
            "drafter",
            {"layer": "mla"},
            "train.drafter.layer is mla, but the target has no multi-latent attention",
        ),
        # A whole float passed the schema's `integer`, then the train job failed in a traceback.
        ("train", "epochs", 8.0, "config key train.epochs: 8.0 is not of type 'integer'"),
        (
            "extract",
            "chunk_writeback_mb",
            -1,
            "config key extract.chunk_writeback_mb: -1 is less than the minimum of 0",
        ),
        # Was an InputFunctionException of the live_acceptance rule.
        ("export", "engines", [], "export.engines is empty: live acceptance needs an exported"),
    ],
)
def test_a_config_error_is_one_line_without_a_traceback(tmp_path, section, key, value, expected):
    config = small_config(tmp_path)
    config[section][key] = value
    line, output = refused_dry_run(tmp_path, config)
    assert expected in line
    assert "Traceback" not in output and "PipelineError in file" not in output


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ('{"messages": [oops\n', "row 7 (line 8): invalid JSON: "),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}\n',
            "row 7 (line 8): unknown role 'tool': message 1 has role 'tool'",
        ),
        # A lone surrogate: the toy target's tokenizer training ended in a UnicodeEncodeError.
        (
            '{"messages": [{"role": "user", "content": "\\ud800 hi"}, '
            '{"role": "assistant", "content": "ok"}]}\n',
            "row 7 (line 8): content not encodable as UTF-8: message 0 'content' holds '\\ud800' "
            "at character 0 (surrogates not allowed)",
        ),
    ],
)
def test_a_bad_source_row_is_refused_before_any_job_unless_skipped(tmp_path, bad_line, expected):
    # Found by the first regenerate or prepare job to read it: hours into a real run.
    config = small_config(tmp_path)
    dataset = Path(config["dataset"]["path"])
    lines = dataset.read_text().splitlines(keepends=True)
    lines[7] = bad_line
    dataset.write_text("".join(lines))
    config["dataset"].update(bad_rows="error", turn_order="strict")
    line, output = refused_dry_run(tmp_path, config)
    assert line.startswith(f"error: {dataset} {expected}"), line
    assert line.endswith("(set dataset.bad_rows: skip to skip and count such rows)")
    assert "Traceback" not in output

    config["dataset"]["bad_rows"] = "skip"
    write_config(tmp_path, config)
    run_snakemake(tmp_path, "-n")


def test_bad_rows_that_leave_nothing_to_train_or_evaluate_are_refused_at_the_start(tmp_path):
    # Under skip they were dropped by prepare, which stopped ("no usable rows") after the toy
    # build and the regeneration, or evaluate found an empty held-out split after the training.
    config = small_config(tmp_path, rows=20)
    dataset = Path(config["dataset"]["path"])
    good = dataset.read_text().splitlines(keepends=True)
    config["dataset"]["bad_rows"] = "skip"
    config["dataset"]["unusable_limit"] = {"rows": 1.0, "assistant_tokens": 1.0}
    config["dataset"]["holdout"].update(mode="shards", shards=["rows_0-10"])
    dataset.write_text(
        "".join(['{"messages": [{"role": "user", "content": "hi"}]}\n'] * 10 + good[10:])
    )
    line, output = refused_dry_run(tmp_path, config)
    assert line.startswith("error: config key dataset.holdout.shards: every row of the held-out ")
    assert "(10 of 20): nothing is left for evaluation" in line and "Traceback" not in output

    dataset.write_text("[" + ", ".join(good).replace("\n", "") + "]\n")  # a JSON array, one line
    line, _ = refused_dry_run(tmp_path, config)
    assert line.startswith(f"error: dataset.path {dataset}: all 1 rows are bad rows")
    assert "row 0 (line 1): row is not an object: got list" in line
    config["dataset"]["bad_rows"] = "error"  # now the row itself, not the split, is named
    line, _ = refused_dry_run(tmp_path, config)
    assert line.startswith(f"error: {dataset} row 0 (line 1): row is not an object: got list")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "config.json is not valid JSON ("),
        ('{"hidden_size": 64}', "config.json has no 'num_hidden_layers' (for the language model)"),
        (None, "config.json does not exist"),  # model.path names a file
        # Accepted before: "8" by int(); 2048.5 turned the length checks off.
        (
            '{"hidden_size": 64, "num_hidden_layers": "8"}',
            "config.json: 'num_hidden_layers' is '8', not an integer",
        ),
    ],
)
def test_a_broken_model_directory_is_one_line_at_the_dry_run(tmp_path, content, expected):
    # Each was a Python traceback from rules/common.smk (and in eaglepipe status and verify).
    config = small_config(tmp_path)
    model = tmp_path / "model"
    if content is None:
        model.write_text("weights?")
    else:
        model.mkdir()
        (model / "config.json").write_text(content)
    config["model"]["path"] = str(model)
    line, output = refused_dry_run(tmp_path, config)
    assert line.startswith("error: model.path") and expected in line, line
    assert "Traceback" not in output and "Error in file" not in output


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda c: c["dataset"]["regenerate"].update(max_new_tokens=2048),
            "config key dataset.regenerate.max_new_tokens: 2048 leaves no room for a prompt "
            "within the target's max_position_embeddings, 2048 (",
        ),
        # Found by live acceptance, the last stage.
        (
            lambda c: c["evaluate"].update(live_new_tokens=4096),
            "config key evaluate.live_new_tokens: 4096 leaves no room for a prompt within the "
            "target's max_position_embeddings, 2048 (",
        ),
        # Was refused by the toy build, the first job.
        (
            lambda c: c["model"]["toy"].update(hidden_size=66),
            "config key model.toy.hidden_size must be divisible by num_heads",
        ),
    ],
)
def test_what_the_target_cannot_hold_is_refused_when_the_run_is_resolved(tmp_path, edit, expected):
    from eaglepipe.core.run import resolve_at_workflow_start

    config = small_config(tmp_path)
    config["dataset"]["regenerate"]["enabled"] = True
    edit(config)
    with pytest.raises(PipelineError) as raised:
        resolve_at_workflow_start(config)
    assert str(raised.value).startswith(expected)


def test_sglang_flags_the_launcher_sets_are_refused_by_the_dry_run(tmp_path):
    # The first job's server start refused them; the dry run said nothing.
    config = small_config(tmp_path)
    config["server"]["engine"] = "sglang"
    config["server"]["sglang"]["extra_args"] = ["--port", "1234"]
    line, output = refused_dry_run(tmp_path, config)
    assert line == (
        "error: server.sglang.extra_args: --port is set by the launcher from config key server.port"
    )


@pytest.mark.parametrize(
    "make_root, why",
    [
        (lambda root: root.write_text("x"), "exists but is not a directory"),
        (lambda root: root.mkdir(mode=0o777) or root.chmod(0o777), "has mode 777"),
    ],
)
def test_a_dump_root_the_server_would_refuse_is_refused_by_the_dry_run(tmp_path, make_root, why):
    # The server's start refused it: after the toy build, or after prepare on a real target.
    config = small_config(tmp_path)
    root = tmp_path / "dumps"
    make_root(root)
    config["server"]["dump_root"] = str(root)
    line, output = refused_dry_run(tmp_path, config)
    assert line.startswith(f"error: server.dump_root {root} {why}"), output[-2000:]
    assert "Traceback" not in output
    # A root that does not exist yet is the server's to create (on a cluster, perhaps only on
    # the compute nodes): the dry run leaves it alone and creates nothing.
    config["server"]["dump_root"] = str(tmp_path / "not-yet" / "dumps")
    write_config(tmp_path, config)
    dry = run_snakemake(tmp_path, "-n", check=False)
    assert dry.returncode == 0, (dry.stdout + dry.stderr)[-2000:]
    assert not (tmp_path / "not-yet").exists()


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_a_dataset_without_rows_is_refused_before_anything_runs(tmp_path, content):
    # It planned no shard and built the toy target from nothing before prepare stopped.
    config = small_config(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    config["dataset"]["path"] = str(empty)
    line, output = refused_dry_run(tmp_path, config)
    assert line == f"error: dataset.path {empty} has no rows: there is nothing to extract"
    assert "Traceback" not in output


def fake_model_dir(directory: Path) -> Path:
    """What a model directory copied without its weights holds: config and tokenizer files."""
    directory.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text("{}")
    return directory


def test_a_target_without_a_chat_template_is_refused_by_the_dry_run(tmp_path):
    # It was found by the first prepare or regenerate job, after the toy build or a server start.
    config = small_config(tmp_path)
    model = fake_model_dir(tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"\0" * 8)  # weights present: the check after them
    config["model"]["path"] = str(model)
    line, output = refused_dry_run(tmp_path, config)
    assert line == (
        f"error: model.path: the tokenizer of {model} has no chat template (none in "
        "tokenizer_config.json, no chat_template.jinja): prepare and regeneration render every "
        "conversation with it; use the model's chat (instruct) release or add its template as "
        "chat_template.jinja"
    )
    assert "Traceback" not in output


@pytest.mark.parametrize(("value", "refused"), [(2048.5, True), ("2048", True), (2048.0, False)])
def test_max_position_embeddings_must_be_a_whole_number(tmp_path, value, refused):
    # Anything but an int turned the length checks against it off without a word.
    config = small_config(tmp_path)
    model = fake_model_dir(tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"\0" * 8)
    settings = json.loads((model / "config.json").read_text())
    settings["max_position_embeddings"] = value
    (model / "config.json").write_text(json.dumps(settings))
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    config["model"]["path"] = str(model)
    config["dataset"]["max_length"] = 4096  # above 2048: refused once the limit is read
    line, output = refused_dry_run(tmp_path, config)
    assert "Traceback" not in output
    if refused:
        assert line == (
            f"error: model.path: {model / 'config.json'}: 'max_position_embeddings' is "
            f"{value!r}, not an integer"
        )
    else:
        assert line.startswith(
            "error: config key dataset.max_length: 4096 is more than the target's"
        )


def test_a_target_without_tokenizer_files_is_refused_by_the_dry_run(tmp_path):
    # It was reported as having no chat template; its only tokenizer file held no vocabulary.
    config = small_config(tmp_path)
    model = fake_model_dir(tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"\0" * 8)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    config["model"]["path"] = str(model)
    line, output = refused_dry_run(tmp_path, config)
    assert line.startswith(f"error: model.path: {model} holds no tokenizer vocabulary (")
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "give_template",
    [
        lambda m: (m / "chat_template.jinja").write_text("{{ messages }}"),
        lambda m: (m / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}'),
        lambda m: (
            (m / "additional_chat_templates").mkdir()
            or (m / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
        ),
        None,  # model.trust_remote_code: the tokenizer's code may bring one
    ],
)
def test_a_chat_template_is_found_where_transformers_looks(tmp_path, give_template):
    from eaglepipe.core.run import resolve_at_workflow_start
    from eaglepipe.data.tokenizer import check_chat_template_files

    config = small_config(tmp_path)
    model = fake_model_dir(tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"\0" * 8)
    config["model"]["path"] = str(model)
    if give_template is None:
        config["model"]["trust_remote_code"] = True
    else:
        give_template(model)
    check_chat_template_files(resolve_at_workflow_start(config))


def test_a_model_directory_without_weights_is_refused_by_the_dry_run(tmp_path):
    config = small_config(tmp_path)
    config["model"]["path"] = str(fake_model_dir(tmp_path / "model"))
    line, output = refused_dry_run(tmp_path, config)
    assert f"model.path {tmp_path / 'model'} holds no weights" in line
    assert "Traceback" not in output


def test_missing_weights_names_what_from_pretrained_would_miss(tmp_path):
    model = fake_model_dir(tmp_path / "model")
    assert "holds no weights" in missing_weights(model)
    (model / "model.pt").write_bytes(b"x")  # not a format from_pretrained loads
    assert "holds no weights" in missing_weights(model)
    (model / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert missing_weights(model) is None
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "lacks model-00002-of-00002.safetensors" in missing_weights(model)
    (model / "model.safetensors.index.json").unlink()
    # A clone without git-lfs, and a copy that stopped at once.
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:ab12\nsize 4976698672\n"
    (model / "model-00001-of-00002.safetensors").write_text(pointer)
    assert missing_weights(model) == (
        "has a Git LFS pointer in place of model-00001-of-00002.safetensors, not its weights "
        "(fetch them: `git lfs pull` in that directory)"
    )
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert missing_weights(model) == (
        "has an empty weight file model-00001-of-00002.safetensors (0 bytes: an interrupted copy?)"
    )


def test_a_target_written_after_configfile_is_named_with_what_to_type(tmp_path):
    # Snakemake takes the target for a second config file and merges its keys into the config.
    write_config(tmp_path, small_config(tmp_path))
    target = tmp_path / "hidden_states" / "rows_0-10" / "manifest.json"
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps({"shard": "rows_0-10", "chunks": []}))
    # run_snakemake's argv ends in `--configfile config.yaml`: the target comes right after it.
    result = run_snakemake(tmp_path, str(target), "-n", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    (line,) = [line for line in output.splitlines() if line.startswith("error:")]
    shown = "hidden_states/rows_0-10/manifest.json"  # relative to the run's directory
    assert f"--configfile {shown}: its keys chunks, shard are no config sections" in line
    assert f"`snakemake --configfile FILE -- {shown}`" in line
    assert "Traceback" not in output


def test_a_section_set_with_config_on_the_command_line_gets_its_types(tmp_path):
    # `--config server.port=N` is refused by Snakemake's own parser; a section as YAML works.
    write_config(tmp_path, small_config(tmp_path))
    run_snakemake(tmp_path, "-n", "--config", "server={port: 31001, idle_timeout_s: 60}")


def test_command_line_values_are_typed_and_config_files_checked(tmp_path):
    from eaglepipe.core.config_files import check_config_files, type_command_line_values

    given = {"server": {"port": "31001", "host": "::1"}, "aux_layer_ids": ["1", "3", "5"]}
    config = {
        "server": {"port": "31001", "host": "::1", "device": "cpu", "idle_timeout_s": "9"},
        "aux_layer_ids": ["1", "3", "5"],
    }
    type_command_line_values(config, given)
    assert config["server"] == {
        "port": 31001,
        "host": "::1",
        "device": "cpu",
        "idle_timeout_s": "9",
    }
    assert config["aux_layer_ids"] == [1, 3, 5]
    good = write_config(tmp_path, small_config(tmp_path))
    check_config_files([good])
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"shards": [], "rows": 3}))
    with pytest.raises(PipelineError, match=f"--configfile {summary}: its keys rows are no"):
        check_config_files([good, summary])
    # Beside known sections an unknown one is a typo, not a target read as a config file.
    typo = tmp_path / "typo.yaml"
    typo.write_text("shard:\n  rows_per_shard: 10\ntrain:\n  epochs: 2\n")
    with pytest.raises(PipelineError) as raised:
        check_config_files([typo])
    assert str(raised.value).startswith(
        f"--configfile {typo}: unknown config section shard (did you mean shards?) (known: "
    )


def test_null_set_with_config_on_the_command_line_is_null_where_the_key_takes_one():
    # Snakemake hands `--config 'server={dump_root: null}'` over as the text "null": the handoff
    # landed in a directory named `null` instead of the default.
    from eaglepipe.core.config_files import type_command_line_values

    given = {"server": {"dump_root": "null", "host": "~"}, "model": {"path": "~"}}
    given["dataset"] = {"path": "null"}
    config = json.loads(json.dumps(given))
    type_command_line_values(config, given)
    assert config["server"] == {"dump_root": None, "host": "~"}  # host takes no null
    assert config["model"] == {"path": None}  # the embedded toy target, as in a config file
    assert config["dataset"] == {"path": "null"}  # a file named null: the key takes no null


def test_a_key_given_twice_in_a_config_file_is_named_not_dropped(tmp_path):
    from eaglepipe.core.config_files import load_config

    write_config(tmp_path, small_config(tmp_path))
    extra = tmp_path / "my.yaml"
    extra.write_text("train:\n  lr: 0.01\nshards:\n  rows_per_shard: 10\ntrain:\n  epochs: 2\n")
    result = run_snakemake(tmp_path, "-n", "--configfile", str(extra), check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output
    (line,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert "my.yaml: key train appears twice in one mapping (lines 1 and 5)" in line
    # The run's own config.yaml too, and a nested key; `<<:` merges stay allowed.
    config = tmp_path / "config.yaml"
    text = config.read_text()
    config.write_text(text.replace("server:\n", "server:\n  port: 31002\n  port: 31003\n", 1))
    result = run_snakemake(tmp_path, "-n", check=False)
    assert "config.yaml: key port appears twice in one mapping" in result.stdout + result.stderr
    with pytest.raises(PipelineError, match="key port appears twice"):
        load_config(config)
    merged = tmp_path / "merged.yaml"
    config.write_text(text)
    merged.write_text("base: &base {lr: 0.01}\ntrain:\n  <<: *base\n  lr: 0.02\n")
    from eaglepipe.core.config_files import read_config_yaml

    assert read_config_yaml(merged)["train"] == {"lr": 0.02}


def test_a_number_yaml_reads_as_text_is_named_with_the_spelling_that_works(tmp_path):
    # PyYAML (YAML 1.1, Snakemake's loader too) reads `lr: 3e-4` as the string '3e-4'.
    config = small_config(tmp_path)
    config["train"]["lr"] = "3e-4"  # safe_dump quotes it: unquote it, as a user writes it
    path = write_config(tmp_path, config)
    path.write_text(path.read_text().replace("'3e-4'", "3e-4"))
    assert "  lr: 3e-4\n" in path.read_text()
    result = run_snakemake(tmp_path, "-n", check=False)
    assert result.returncode != 0
    assert (
        "config key train.lr: '3e-4' is not of type 'number' (YAML reads 3e-4 as text: write "
        "3.0e-4 or 0.0003)" in result.stdout + result.stderr
    )


@pytest.mark.parametrize("host", ["http://127.0.0.1", "localhost:30000", "node-3/"])
def test_a_server_host_given_as_a_url_is_refused_at_the_start(tmp_path, host):
    # It was accepted, then the server's start failed on it (after regeneration's wait).
    config = small_config(tmp_path)
    config["server"]["host"] = host
    write_config(tmp_path, config)
    result = run_snakemake(tmp_path, "-n", check=False)
    assert result.returncode != 0
    assert (
        f"config key server.host: '{host}' does not match" in result.stdout + result.stderr
        and "without scheme, path or port: the port is server.port" in result.stdout + result.stderr
    )


def test_wrong_type_names_the_key(tmp_path):
    config = small_config(tmp_path)
    config["server"]["port"] = "eighty"
    write_config(tmp_path, config)
    result = run_snakemake(tmp_path, "-n", check=False)
    assert result.returncode != 0
    assert "config key server.port" in result.stdout + result.stderr


def test_per_shard_input_functions_hand_snakemake_their_parameters(monkeypatch):
    """Snakemake inspects an input function's signature on every job; `known_parameters` gives
    it the same parameters up front (no inspect.signature per job), and the per-shard input
    functions of rules/common.smk use it."""
    import inspect

    from snakemake.common import get_function_params, get_input_function_aux_params

    from eaglepipe.ops.snakefile_hooks import known_parameters

    @known_parameters
    def shard_inputs(wildcards):
        return {}

    def no_inspecting(*args, **kwargs):
        raise AssertionError("inspect.signature called per job")

    monkeypatch.setattr(inspect, "signature", no_inspecting)
    assert list(get_function_params(shard_inputs)) == ["wildcards"]
    offered = {"wildcards": 1, "input": 2, "attempt": 3}
    assert get_input_function_aux_params(shard_inputs, offered) == {"wildcards": 1}
    common = (REPO_ROOT / "rules" / "common.smk").read_text()
    for name in ("regenerate_inputs", "extract_inputs", "validate_inputs"):
        assert f"@hooks.known_parameters\ndef {name}(wildcards):" in common


def tmpdirs_by_rule(dry_run_listing: str) -> dict[str, set[str]]:
    """Each rule's `tmpdir` resource in a `snakemake -n` listing."""
    found: dict[str, set[str]] = {}
    rule = None
    for line in dry_run_listing.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[1].rstrip(":")
        elif line.strip().startswith("resources:") and rule:
            for item in line.split(":", 1)[1].split(","):
                name, _, value = item.strip().partition("=")
                if name == "tmpdir":
                    found.setdefault(rule, set()).add(value)
    return found


def test_per_shard_jobs_get_the_temporary_directory_snakemake_would_give_them(tmp_path):
    """The per-shard rules declare `tmpdir` as a constant (Snakemake evaluates its default
    expression once per job otherwise): the same directory the default gives, the environment's
    TMPDIR included; a tmpdir of the user's own, as a default or for one rule, still wins."""
    write_config(tmp_path, small_config(tmp_path, rows=20, rows_per_shard=10))
    own = tmp_path / "tmp-of-this-run"
    own.mkdir()
    listing = run_snakemake(tmp_path, "-n", env={"TMPDIR": str(own)}).stdout
    tmpdirs = tmpdirs_by_rule(listing)
    assert {"extract", "validate", "prepare"} <= set(tmpdirs)
    assert set().union(*tmpdirs.values()) == {str(own)}

    user_default = run_snakemake(tmp_path, "-n", "--default-resources", "tmpdir='/scratch/mine'")
    tmpdirs = tmpdirs_by_rule(user_default.stdout)
    assert tmpdirs["extract"] == tmpdirs["validate"] == tmpdirs["prepare"] == {"/scratch/mine"}

    one_rule = run_snakemake(
        tmp_path,
        "-n",
        "--set-resources",
        "extract:tmpdir='/scratch/extract'",
        env={"TMPDIR": str(own)},
    )
    tmpdirs = tmpdirs_by_rule(one_rule.stdout)
    assert tmpdirs["extract"] == {"/scratch/extract"}
    assert tmpdirs["validate"] == {str(own)}


def test_a_cluster_jobs_own_snakemake_evaluates_the_temporary_directory_on_its_node():
    """Only the main Snakemake process declares the constant: a job's own Snakemake on a
    cluster node (exec mode remote) keeps the default expression, evaluated there."""
    from types import SimpleNamespace

    from snakemake.resources import Resources
    from snakemake_interface_executor_plugins.settings import ExecMode

    from eaglepipe.ops.snakefile_hooks import per_shard_job_resources

    def workflow(mode, defaults=None):
        return SimpleNamespace(
            exec_mode=mode, resource_settings=SimpleNamespace(default_resources=defaults)
        )

    assert per_shard_job_resources(workflow(ExecMode.DEFAULT)) == {"tmpdir": tempfile.gettempdir()}
    assert per_shard_job_resources(workflow(ExecMode.REMOTE)) == {}
    assert per_shard_job_resources(workflow(ExecMode.SUBPROCESS)) == {}
    # --default-resources without a tmpdir of its own keeps Snakemake's stock expression.
    stock = Resources.parse(["mem_mb=1000"], allow_expressions=True, defaults="full")
    assert per_shard_job_resources(workflow(ExecMode.DEFAULT, stock)) == {
        "tmpdir": tempfile.gettempdir()
    }
    own = Resources.parse(["tmpdir='/scratch'"], allow_expressions=True, defaults="full")
    assert per_shard_job_resources(workflow(ExecMode.DEFAULT, own)) == {}
    for rule in ("extract", "validate", "regenerate"):
        assert (
            "resources:\n        **PER_SHARD_RESOURCES,"
            in (REPO_ROOT / "rules" / f"{rule}.smk").read_text()
        )


def test_dry_run_lists_one_extract_per_shard(tmp_path):
    config = small_config(tmp_path, rows=35, rows_per_shard=10)
    write_config(tmp_path, config)
    jobs = dry_run_jobs(tmp_path, *[f"hidden_states/{s}/manifest.json" for s in SHARDS[:3]])
    assert jobs["extract"] == 3
    out = run_snakemake(tmp_path, "-n").stdout
    assert "hidden_states/rows_30-35/manifest.json" in out  # the last shard is short


def test_finished_run_leaves_nothing_to_do(extracted):
    assert dry_run_jobs(extracted, *VALIDATED) == {}
    for shard in SHARDS:
        report = json.loads((extracted / "validated" / f"{shard}.json").read_text())
        assert all(check["ok"] for check in report["checks"].values())


def test_rerunning_prepare_with_same_content_reextracts_nothing(run_copy):
    # Snakemake deletes a job's outputs before running it, so the table gets a new mtime; the
    # stages after it read it as ancient() and rerun only on changed content (params).
    table = run_copy / "prepared" / "tokenized.parquet"
    before = table.read_bytes()
    run_snakemake(run_copy, "--cores", "2", "--forcerun", "prepare", "--until", "prepare")
    assert table.read_bytes() == before
    assert dry_run_jobs(run_copy, *VALIDATED) == {}


def test_touching_the_dataset_reextracts_nothing(run_copy):
    (run_copy / "conversations.jsonl").touch()
    assert "extract" not in dry_run_jobs(run_copy, *VALIDATED)


def test_changed_layer_ids_make_every_shard_stale(run_copy):
    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config["aux_layer_ids"] = [0, 3, 6]
    write_config(run_copy, config)
    result = run_snakemake(run_copy, "-n", *VALIDATED)
    assert dry_run_jobs(run_copy, *VALIDATED)["extract"] == 4
    # The dry run says why: each shard's provenance stamp is an updated input.
    assert ".eaglepipe/provenance/rows_0-10.json" in result.stdout


def test_a_changed_store_makes_every_shard_stale(run_copy):
    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config.setdefault("extract", {})["store"] = {"aux": "fp8_e4m3", "final": "bf16"}
    write_config(run_copy, config)
    result = run_snakemake(run_copy, "-n", *VALIDATED)
    assert dry_run_jobs(run_copy, *VALIDATED)["extract"] == 4
    assert ".eaglepipe/provenance/rows_0-10.json" in result.stdout


def test_editing_one_row_makes_only_its_shard_stale(run_copy):
    dataset = run_copy / "conversations.jsonl"
    lines = dataset.read_text().splitlines(keepends=True)
    row = json.loads(lines[13])
    row["messages"][-1]["content"] += " (edited)"
    lines[13] = json.dumps(row, ensure_ascii=False) + "\n"
    dataset.write_text("".join(lines))
    result = run_snakemake(run_copy, "-n", *VALIDATED)
    assert dry_run_jobs(run_copy, *VALIDATED)["extract"] == 1
    assert "hidden_states/rows_10-20/manifest.json" in result.stdout


def test_single_shard_target_rebuilds_just_that_shard(run_copy):
    others = {s: manifest(run_copy, s).stat().st_mtime_ns for s in SHARDS if s != "rows_20-30"}
    manifest(run_copy, "rows_20-30").unlink()
    run_snakemake(run_copy, "--cores", "2", "hidden_states/rows_20-30/manifest.json")
    rebuilt = json.loads(manifest(run_copy, "rows_20-30").read_text())
    assert rebuilt["num_rows"] == 10
    assert {s: manifest(run_copy, s).stat().st_mtime_ns for s in others} == others


def test_a_reextracted_shard_reruns_its_validation_training_and_evaluation(run_copy):
    # train and evaluate list no manifests (5,000 more DAG edges each): a shard's new hidden
    # states reach them through its validation, which takes the manifest as input.
    downstream = [
        "drafter/vocab.safetensors",
        "drafter/model.safetensors",
        "drafter/train_log.jsonl",
        "drafter/eval.json",
        "drafter/eval.png",
    ]
    for name in downstream:  # stand-ins for a finished training, newer than every shard
        (run_copy / name).parent.mkdir(parents=True, exist_ok=True)
        (run_copy / name).write_text("done\n")
    assert dry_run_jobs(run_copy, "drafter/eval.json") == {}
    # New bytes (a mere touch is not enough: Snakemake compares checksums of small inputs).
    rewritten = manifest(run_copy, "rows_10-20")
    time.sleep(0.01)
    rewritten.write_text(rewritten.read_text() + "\n")
    result = run_snakemake(run_copy, "-n", "drafter/eval.json")
    assert dry_run_jobs(run_copy, "drafter/eval.json") == {
        "validate": 1,
        "train": 1,
        "evaluate": 1,
    }
    updated = [
        name.strip()
        for line in result.stdout.splitlines()
        if "reason: Updated input files:" in line
        for name in line.split("Updated input files:")[1].split(";")[0].split(",")
    ]
    assert "hidden_states/rows_10-20/manifest.json" in updated


def test_a_corrupt_shard_blocks_training(run_copy):
    chunk = run_copy / "hidden_states" / "rows_10-20" / "chunk-00000.safetensors"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    (run_copy / "validated" / "rows_10-20.json").unlink()
    result = run_snakemake(run_copy, "--cores", "2", "drafter/model.safetensors", check=False)
    assert result.returncode != 0
    log = (run_copy / "logs" / "validate" / "rows_10-20.log").read_text()
    assert "integrity" in log and "chunk-00000.safetensors" in log
    assert not (run_copy / "validated" / "rows_10-20.json").exists()
    assert not (run_copy / "drafter" / "model.safetensors").exists()
    assert "rule train" not in result.stdout + result.stderr


def test_a_same_size_edit_that_keeps_the_mtime_is_seen(run_copy):
    # `cp -p`, `rsync -a` or `tar x` of an edited dataset carry the old mtime over.
    dataset = run_copy / "conversations.jsonl"
    stat = dataset.stat()
    lines = dataset.read_text().splitlines(keepends=True)
    row = json.loads(lines[13])
    text = row["messages"][-1]["content"]
    row["messages"][-1]["content"] = text[:-1] + ("X" if text[-1] != "X" else "Y")
    lines[13] = json.dumps(row, ensure_ascii=False) + "\n"
    dataset.write_text("".join(lines))
    assert dataset.stat().st_size == stat.st_size
    os.utime(dataset, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    jobs = dry_run_jobs(run_copy, *VALIDATED)
    assert jobs["extract"] == 1


def test_an_appended_row_leaves_untouched_shards_valid(run_copy):
    # Prepare reruns (the dataset changed) and the untouched shards stay fresh for Snakemake:
    # revalidating one of them must pass, or no command could ever finish the run.
    dataset = run_copy / "conversations.jsonl"
    rows = dataset.read_text().splitlines(keepends=True)
    with dataset.open("a") as f:
        f.write(rows[3])
    untouched = manifest(run_copy, "rows_0-10").stat().st_mtime_ns
    (run_copy / "validated" / "rows_0-10.json").unlink()
    targets = [*VALIDATED, "validated/rows_40-41.json"]
    result = run_snakemake(run_copy, "--cores", "2", *targets, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert manifest(run_copy, "rows_0-10").stat().st_mtime_ns == untouched
    report = json.loads((run_copy / "validated" / "rows_0-10.json").read_text())
    assert all(check["ok"] for check in report["checks"].values())
    assert dry_run_jobs(run_copy, *targets) == {}


def test_a_chunk_damaged_after_validation_stops_training_and_the_named_repair_works(run_copy):
    shard_dir = run_copy / "hidden_states" / "rows_10-20"
    chunk = shard_dir / "chunk-00000.safetensors"
    flip_low_bit(chunk)  # after validation: the report still matches the manifest
    result = run_snakemake(run_copy, "--cores", "2", "drafter/model.safetensors", check=False)
    assert result.returncode != 0
    log = (run_copy / "logs" / "train.log").read_text().splitlines()
    error = next(line for line in log if line.startswith("error: "))
    assert error.startswith(
        "error: chunk hidden_states/rows_10-20/chunk-00000.safetensors of shard rows_10-20 "
        "does not match its manifest's xxh3-128 checksum"
    )
    assert not (run_copy / "drafter" / "model.safetensors").exists()

    # The repair the message names re-extracts that shard alone and training then succeeds.
    assert error.endswith(
        "repair: `eaglepipe verify` sets the damaged shards aside, then `snakemake --cores N` "
        "re-extracts their damaged chunks (intact chunks are kept)"
    )
    others = {s: manifest(run_copy, s).stat().st_mtime_ns for s in SHARDS if s != "rows_10-20"}
    verify = subprocess.run(
        [str(Path(sys.executable).parent / "eaglepipe"), "verify"],
        cwd=run_copy, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert verify.returncode == 1 and "rows_10-20: manifest set aside" in verify.stdout
    run_snakemake(run_copy, "--cores", "2", "drafter/model.safetensors")
    assert (run_copy / "drafter" / "model.safetensors").exists()
    assert {s: manifest(run_copy, s).stat().st_mtime_ns for s in others} == others
    entry = json.loads(manifest(run_copy, "rows_10-20").read_text())["chunks"][0]
    assert entry["file"] == chunk.name and hash_file(chunk) == entry["xxh3_128"]
