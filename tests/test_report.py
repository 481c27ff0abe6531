"""Report figures and tables from fixture files written in the documented stage formats."""

from __future__ import annotations

import csv
import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import matplotlib.image
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import PYTHON, REPO_ROOT

from eaglepipe.core.errors import PipelineError
from eaglepipe.ops import report

T0 = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)


def assert_png(path: Path, min_width: int = 400) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[1] >= min_width
    # Not a blank canvas: something was drawn.
    assert image[..., :3].std() > 0.05
    return image


def write_prepared(workdir: Path) -> tuple[Path, Path, Path]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 1024, size=60)
    table = pa.table(
        {
            "row_id": pa.array(range(60), pa.int64()),
            "split": ["eval" if i % 10 == 0 else "train" for i in range(60)],
            "num_tokens": pa.array(lengths, pa.int32()),
            "input_ids": [[1] * int(n) for n in lengths],
            "loss_mask": [[1] * int(n) for n in lengths],
            "truncated": [bool(n == 1023) for n in lengths],
        }
    )
    prepared = workdir / "prepared"
    prepared.mkdir()
    pq.write_table(table, prepared / "tokenized.parquet")
    (prepared / "summary.json").write_text(json.dumps({"num_rows": 60, "max_length": 1024}))
    (prepared / "skipped.json").write_text(
        json.dumps(
            {
                "count": 4,
                "reasons": {"no assistant turn": 3, "malformed JSON": 1},
                "rows": [{"row_id": 60 + i, "reason": "no assistant turn"} for i in range(3)],
            }
        )
    )
    return prepared / "tokenized.parquet", prepared / "summary.json", prepared / "skipped.json"


def write_manifests(workdir: Path, count: int) -> list[Path]:
    paths = []
    for i in range(count):
        name = f"rows_{i * 64}-{(i + 1) * 64}"
        start = T0 + timedelta(minutes=3 * i)
        end = start + timedelta(minutes=5, seconds=7 * i)
        seconds = (end - start).total_seconds()
        manifest = {
            "format_version": 1,
            "shard": name,
            "row_start": i * 64,
            "row_end": (i + 1) * 64,
            "num_rows": 64,
            "num_tokens": 30_000 + 100 * i,
            "num_bytes": 30_000 * 512,
            "chunks": [{"file": "chunk-00000.safetensors"}, {"file": "chunk-00001.safetensors"}],
            "provenance": {"engine": "reference"},
            "timing": {
                "started_at": start.isoformat(),
                "finished_at": end.isoformat(),
                "seconds": seconds,
                "tokens_per_s": (30_000 + 100 * i) / seconds,
                "mb_per_s": 30_000 * 512 / 1e6 / seconds,
                "requests_sent": 64,
            },
        }
        path = workdir / "hidden_states" / name / "manifest.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(manifest))
        paths.append(path)
    return paths


def write_validations(workdir: Path, count: int) -> list[Path]:
    paths = []
    layers = {"aux_0": 2.0, "aux_1": 8.0, "aux_2": 20.0, "final": 60.0}
    for i in range(count):
        name = f"rows_{i * 64}-{(i + 1) * 64}"
        errors = {
            n: {"rel_l2_p99": 0.001 * (k + 1), "cosine_p1": 0.9999} for k, n in enumerate(layers)
        }
        validation = {
            "shard": name,
            "manifest_xxh3_128": "0" * 32,
            "provenance": {},
            "checks": {
                "integrity": {"ok": True},
                "schema": {"ok": True},
                "coverage": {"ok": True},
                "values": {
                    "ok": True,
                    "norm_std": {n: v / 10 for n, v in layers.items()},
                    "norm_ratio_to_reference": {n: 1.0 + 0.01 * i for n in layers},
                    "norm_drift_factor": 3.0,
                },
                "provenance": {"ok": True},
                "spot_check": {"ok": True, "rows": [3, 9], "reextract": errors},
            },
            "layer_norms": {n: v * (1 + 0.01 * i) for n, v in layers.items()},
            "layer_norm_reference": "rows_0-64",
            "num_rows": 64,
            "num_tokens": 30_000,
            "gb_per_s": 1.5,
        }
        path = workdir / "validated" / f"{name}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(validation))
        paths.append(path)
    return paths


def write_train_log(workdir: Path, steps: int = 120, positions: int = 7) -> Path:
    path = workdir / "drafter" / "train_log.jsonl"
    path.parent.mkdir(exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        acc = [min(1.0, 0.1 + step / steps * 0.7 * 0.9**p) for p in range(positions)]
        if step % 7 == 0:
            acc[-1] = None  # no token reached the last position in this batch
        lines.append(
            json.dumps({"step": step, "epoch": step // 40, "loss": 8.0 / step, "acc": acc})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def write_eval(workdir: Path) -> tuple[Path, Path]:
    """drafter/eval.json and drafter/live.json as eaglepipe.drafter.evaluate / live write them."""
    drafter = workdir / "drafter"
    drafter.mkdir(exist_ok=True)
    evaluation = {
        "rows": 6,
        "positions": 900,
        "ttt_length": 7,
        "accuracy": [0.8, 0.7, 0.6, 0.5, 0.45, 0.4, None],
        "conditional_accuracy": [0.8, 0.75, 0.7, 0.6, 0.5, 0.5, None],
        "counted": [900, 880, 860, 840, 820, 800, 0],
        "acceptance_length": 3.1,
    }
    (drafter / "eval.json").write_text(json.dumps(evaluation))
    live = {"prompts": 8, "acceptance_length": 2.8, "offline_acceptance_length": 3.1}
    (drafter / "live.json").write_text(json.dumps(live))
    return drafter / "eval.json", drafter / "live.json"


def test_dataset_figure(tmp_path):
    table, summary, skipped = write_prepared(tmp_path)
    out = report.dataset_figure(table, summary, skipped, tmp_path / "report" / "dataset.png")
    assert_png(out)


def test_dataset_figure_names_a_missing_key(tmp_path):
    table, summary, skipped = write_prepared(tmp_path)
    skipped.write_text(json.dumps({"count": 0}))
    with pytest.raises(PipelineError, match="skipped.json: missing key 'reasons'"):
        report.dataset_figure(table, summary, skipped, tmp_path / "dataset.png")
    assert not (tmp_path / "dataset.png").exists()


@pytest.mark.parametrize("count", [6, report.MAX_BARS + 30])
def test_extraction_figure_and_table(tmp_path, count):
    manifests = write_manifests(tmp_path, count)
    # Given out of order: the table and figure follow row order, not argument order.
    out = report.extraction_figure(
        manifests[::-1], tmp_path / "extraction.png", tmp_path / "extraction.csv"
    )
    assert_png(out)
    with open(tmp_path / "extraction.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["shard"] for r in rows] == [m.parent.name for m in manifests]
    assert rows[1]["tokens"] == "30100"
    assert float(rows[0]["tokens_per_s"]) == pytest.approx(30_000 / 300, rel=1e-5)
    assert rows[0]["chunks"] == "2"


def test_validation_figure_and_table(tmp_path):
    reports = write_validations(tmp_path, 8)
    out = report.validation_figure(
        reports, tmp_path / "validation.png", tmp_path / "validation.csv"
    )
    assert_png(out)
    with open(tmp_path / "validation.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8
    assert float(rows[2]["norm_final"]) == pytest.approx(60.0 * 1.02)
    assert float(rows[0]["spot_rel_l2_p99_final"]) == pytest.approx(0.004)
    assert rows[0]["checks_passed"] == "integrity, schema, coverage, values, provenance, spot_check"


def test_training_figure(tmp_path):
    out = report.training_figure(write_train_log(tmp_path), tmp_path / "training.png")
    assert_png(out)


def test_training_log_with_a_bad_line_is_named_and_a_torn_last_line_dropped(tmp_path):
    log = write_train_log(tmp_path, steps=3)
    intact = log.read_text()
    log.write_text(intact + '{"step": 4, "lo')  # torn: every rerun of the report stopped on it
    assert_png(report.training_figure(log, tmp_path / "training.png"))
    assert len(report.read_jsonl(log)) == 3
    lines = intact.splitlines(keepends=True)
    log.write_text(lines[0] + "{not json\n" + "".join(lines[1:]))
    with pytest.raises(PipelineError, match="train_log.jsonl line 2 is not valid JSON"):
        report.training_figure(log, tmp_path / "training.png")


def test_acceptance_figure_and_table(tmp_path):
    eval_json, live_json = write_eval(tmp_path)
    out = report.acceptance_figure(
        eval_json, tmp_path / "acceptance.png", live_json, tmp_path / "acceptance.csv"
    )
    assert_png(out)
    with open(tmp_path / "acceptance.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 7
    assert float(rows[1]["accepted_through"]) == pytest.approx(0.8 * 0.75)
    # A position no chain reached is written as 0, not dropped.
    assert rows[6]["conditional_accuracy"] == "0"


def test_acceptance_figure_rejects_mismatched_positions(tmp_path):
    eval_json, _ = write_eval(tmp_path)
    evaluation = json.loads(eval_json.read_text())
    evaluation["conditional_accuracy"] = evaluation["conditional_accuracy"][:3]
    eval_json.write_text(json.dumps(evaluation))
    with pytest.raises(PipelineError, match="differ in length"):
        report.acceptance_figure(eval_json, tmp_path / "acceptance.png")


def test_figures_are_deterministic(tmp_path):
    reports = write_validations(tmp_path, 3)
    first = report.validation_figure(reports, tmp_path / "a.png").read_bytes()
    second = report.validation_figure(reports, tmp_path / "b.png").read_bytes()
    assert first == second


def test_empty_inputs_still_draw(tmp_path):
    assert_png(report.extraction_figure([], tmp_path / "e.png"))
    assert_png(report.validation_figure([], tmp_path / "v.png"))


def test_script_reads_every_planned_shard_and_fails_in_one_line(tmp_path):
    write_manifests(tmp_path, 4)
    dataset = tmp_path / "conversations.jsonl"
    dataset.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(4 * 64)))
    config = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())
    config["dataset"]["path"] = "conversations.jsonl"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    script = REPO_ROOT / "scripts" / "report_figures.py"
    done = subprocess.run(
        [PYTHON, "-u", script, "extraction", "--config", "run.yaml"]
        + ["--out", "x.png", "--table", "x.csv"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "x.csv").read_text().splitlines()) == 5
    assert_png(tmp_path / "x.png")

    failed = subprocess.run(
        [PYTHON, "-u", script, "acceptance", "--eval", tmp_path / "missing.json"]
        + ["--out", tmp_path / "a.png"],
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines() == [
        f"error: report input {tmp_path / 'missing.json'} does not exist"
    ]
    assert not (tmp_path / "a.png").exists()


def test_dataset_figure_shows_losses_per_reason_and_a_cut_source(tmp_path):
    table, summary, skipped = write_prepared(tmp_path)
    doc = json.loads(skipped.read_text())
    doc["lost"] = {
        "leading non-user turns": {"rows": 0, "turns": 9, "assistant_turns": 9,
                                   "assistant_tokens": 4000},
        "empty conversation": {"rows": 2, "turns": 0, "assistant_turns": 0,
                               "assistant_tokens": 0},
    }  # fmt: skip
    doc["source_cut"] = {"message": "cut", "offset": 10, "whole_records": 40, "why": "cut off"}
    skipped.write_text(json.dumps(doc))
    out = report.dataset_figure(table, summary, skipped, tmp_path / "report" / "dataset.png")
    assert_png(out)
