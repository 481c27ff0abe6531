"""SpecForge's inputs made from an eaglepipe run (benchmarks.studies.specforge.data, issue 27), on
CPU:
nothing of SpecForge runs here.

- The conversion keeps held-out rows, and rows prepare skipped, out of SpecForge's JSONL.
- The toy target's template JSON, under SpecForge's masking rule, gives the input_ids and loss
  mask chat_mask.py gives, on every sample row. What is tested is the rule as written here from
  SpecForge 0.2.0's source (specforge/data/parse.py, GeneralParser): SpecForge itself is not
  installed in the suite. That this rule equals SpecForge's own parser on these rows was checked
  once, outside the suite (docs/specforge.md); on the H200, benchmarks.studies.specforge.compare
  checks SpecForge's
  stored features against the prepared table as well (`compare_with_table`, tested below).
- The target view and draft config SpecForge's loaders need.
- The 8B-shape comparison's plumbing (benchmarks.studies.specforge.scale_steps): the rows and
  chat template
  both generators read; the comparison of SpecForge's feature files with the project's shards
  (equal, one layer off, bf16 noise, a pre-norm scale, a torn file); `kill -9` half-way through
  a stand-in generator and the accounting of what a "file exists" rerun and the pipeline's
  journal rerun keep; the rates from file times and training logs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from conftest import REPO_ROOT, build_tiny_llama

from benchmarks.studies.specforge import scale_compare, scale_kill
from benchmarks.studies.specforge import scale_steps as scale
from benchmarks.studies.specforge.data import (
    chat_template_spec,
    compare_with_table,
    draft_config,
    specforge_messages,
    specforge_tokenize,
    target_view,
    template_agreement,
    train_conversations,
    write_specforge_jsonl,
)
from benchmarks.studies.specforge.steps import Command, Context
from eaglepipe.core.errors import PipelineError  # noqa: E402
from eaglepipe.core.run import resolve  # noqa: E402
from eaglepipe.data.chat_mask import tokenize_conversation  # noqa: E402
from eaglepipe.data.dataset import RowProblem, read_conversations  # noqa: E402
from eaglepipe.data.toy_target import corpus_texts, train_tokenizer  # noqa: E402
from eaglepipe.extract.chunk_file import RowTensors, write_chunk  # noqa: E402
from eaglepipe.extract.shard_files import (  # noqa: E402
    append_journal,
    build_manifest,
    verified_chunks,
    write_manifest,
)
from eaglepipe.prepare.table import is_eval_row, table_schema  # noqa: E402

SAMPLE = REPO_ROOT / "data" / "sample" / "conversations.jsonl"
TOY_TEMPLATE = {
    "name": "eaglepipe-toy",
    "assistant_header": "<|assistant|>\n",
    "user_header": "<|user|>\n",
    "end_of_turn_token": "<|end|>",
    "system_prompt": None,
}


@pytest.fixture(scope="module")
def sample():
    conversations, _ = read_conversations(SAMPLE, bad_rows="skip")
    return conversations


@pytest.fixture(scope="module")
def toy_tokenizer(sample):
    """The embedded toy target's tokenizer, trained as build_toy_target trains it."""
    return train_tokenizer(corpus_texts(sample), 512, model_max_length=2048)


def write_table(path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=table_schema()), path)


def table_rows(conversations, tokenizer, fraction: float) -> list[dict]:
    """Prepared-table rows as prepare writes them: tokens, mask, and the seeded split."""
    rows = []
    for c in conversations:
        tokenized = tokenize_conversation(tokenizer, c.messages, 1024)
        rows.append(
            {
                "row_id": c.row_id,
                "split": "eval" if is_eval_row(c.row_id, fraction, 0) else "train",
                "num_tokens": tokenized.num_tokens,
                "input_ids": tokenized.input_ids,
                "loss_mask": tokenized.loss_mask,
                "truncated": tokenized.truncated,
            }
        )
    return rows


@pytest.fixture
def run_with_table(tmp_path, sample, toy_tokenizer):
    """A run reading 30 sample rows (no regeneration) and its prepared table, where one train
    row is missing as if prepare had skipped it as a bad row."""
    dataset = tmp_path / "conversations.jsonl"
    dataset.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:30]))
    config = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())
    config["dataset"]["path"] = str(dataset)
    config["dataset"]["regenerate"]["enabled"] = False
    rows = table_rows(sample[:30], toy_tokenizer, fraction=0.3)
    skipped = next(r["row_id"] for r in rows if r["split"] == "train")
    rows = [r for r in rows if r["row_id"] != skipped]
    table = tmp_path / "prepared" / "tokenized.parquet"
    write_table(table, rows)
    return resolve(config), table, rows, skipped


def test_the_conversion_keeps_held_out_rows_and_skipped_rows_out(run_with_table, sample, tmp_path):
    run, table, rows, skipped = run_with_table
    train_ids = [r["row_id"] for r in rows if r["split"] == "train"]
    eval_ids = [r["row_id"] for r in rows if r["split"] == "eval"]
    assert eval_ids and train_ids  # the seeded split holds both here

    converted = train_conversations(run, table)
    assert [row_id for row_id, _ in converted] == train_ids
    assert not {row_id for row_id, _ in converted} & (set(eval_ids) | {skipped})
    by_id = {c.row_id: c.messages for c in sample}
    assert all(messages == by_id[row_id] for row_id, messages in converted)

    out = tmp_path / "specforge" / "train.jsonl"
    assert write_specforge_jsonl(converted, out) == len(train_ids)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [str(i) for i in train_ids]
    assert lines[0]["conversations"] == by_id[train_ids[0]]
    assert set(lines[0]) == {"id", "conversations"}


def test_a_table_that_is_not_the_runs_is_refused(run_with_table, tmp_path):
    run, _, rows, _ = run_with_table
    foreign = tmp_path / "other.parquet"
    write_table(foreign, [*rows, {**rows[0], "row_id": 999, "split": "train"}])
    with pytest.raises(PipelineError, match=r"train rows the run's conversations do not hold "
                       r"\(first: row 999, 1 in all\)"):  # fmt: skip
        train_conversations(run, foreign)
    held_out_only = tmp_path / "eval-only.parquet"
    write_table(held_out_only, [{**r, "split": "eval"} for r in rows])
    with pytest.raises(PipelineError, match="has no train rows"):
        train_conversations(run, held_out_only)


# ---------------------------------------------------------------- the toy's template


def test_the_toy_template_json_is_the_toy_chat_templates_markers(toy_tokenizer):
    assert chat_template_spec(toy_tokenizer, "eaglepipe-toy") == TOY_TEMPLATE


@pytest.mark.parametrize("max_length", [1024, 64])
def test_the_toy_template_masks_what_chat_mask_masks_on_every_sample_row(
    toy_tokenizer, sample, max_length
):
    """SpecForge's rule with the toy template JSON against chat_mask.py, row by row: the same
    input_ids and the same loss mask (the reply and its <|end|>), untruncated and truncated."""
    compared = 0
    for conversation in sample:
        try:
            ours = tokenize_conversation(toy_tokenizer, conversation.messages, max_length)
        except RowProblem:  # prepare would skip the row: no SpecForge row either
            continue
        theirs = specforge_tokenize(toy_tokenizer, conversation.messages, TOY_TEMPLATE, max_length)
        assert theirs == (ours.input_ids, ours.loss_mask), f"row {conversation.row_id}"
        compared += 1
    assert compared >= (len(sample) if max_length == 1024 else 100)


def test_a_wrong_template_json_is_caught_by_the_row_check(toy_tokenizer, sample):
    """The check can fail: a header without its newline puts the newline in SpecForge's mask."""
    rows = [(c.row_id, c.messages) for c in sample[:20]]
    table = pd.DataFrame(table_rows(sample[:20], toy_tokenizer, fraction=0.0))
    good = template_agreement(toy_tokenizer, rows, TOY_TEMPLATE, table, 1024)
    assert good == {"rows": 20, "equal": 20, "differing_rows": []}
    wrong = {**TOY_TEMPLATE, "assistant_header": "<|assistant|>"}
    bad = template_agreement(toy_tokenizer, rows, wrong, table, 1024)
    assert bad["equal"] == 0 and bad["differing_rows"] == [c.row_id for c in sample[:20]]


def test_specforge_keeps_a_conversation_the_way_its_parser_does():
    turns = [
        {"role": "assistant", "content": "dropped: before the first user turn"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "assistant", "content": "cut here: an assistant after an assistant"},
        {"role": "user", "content": "never reached"},
    ]
    assert specforge_messages(turns) == turns[1:3]
    system = [{"role": "system", "content": "s"}, {"from": "human", "value": "a"}]
    assert specforge_messages(system, "default") == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
    ]
    assert specforge_messages(system[1:], "default")[0] == {"role": "system", "content": "default"}


# ---------------------------------------------------------------- SpecForge's feature files


def test_feature_files_are_checked_against_the_prepared_table(tmp_path, sample, toy_tokenizer):
    rows = table_rows(sample[:6], toy_tokenizer, fraction=0.0)
    table = pd.DataFrame(rows)
    folder = tmp_path / "features" / "rows_0-2000"
    folder.mkdir(parents=True)
    for i, row in enumerate(rows[:4]):
        mask = list(row["loss_mask"])
        if i == 1:
            mask[mask.index(1)] = 0  # a file whose mask differs from the table's
        ids = row["input_ids"] if i != 2 else [*row["input_ids"], 7]  # tokens of no row
        record = {
            "input_ids": torch.tensor(ids),
            "loss_mask": torch.tensor(mask),
            "aux_hidden_state": torch.zeros(1, len(ids), 6),
            "hidden_state": torch.zeros(1, len(ids), 2),
        }
        torch.save(record, folder / f"data_{i}.ckpt")
    check = compare_with_table(tmp_path / "features", table)
    assert check["files"] == 4 and check["rows_found"] == 3 and check["distinct_rows"] == 3
    assert check["loss_mask_equal"] == 2 and check["unmatched_files"] == ["data_2.ckpt"]
    assert check["train_rows"] == 6 and check["bytes"] > 0


# ---------------------------------------------------------------- the target as SpecForge reads it


def test_the_target_view_adds_the_index_and_leaves_the_target_alone(tmp_path):
    target = build_tiny_llama(tmp_path / "target")
    before = sorted(p.name for p in target.iterdir())
    view = target_view(target, tmp_path / "view")
    assert sorted(p.name for p in target.iterdir()) == before
    index = json.loads((tmp_path / "view" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert "lm_head.weight" in index["weight_map"] and view["lm_head_key"] == "lm_head.weight"
    assert (tmp_path / "view" / "config.json").resolve() == (target / "config.json").resolve()
    assert view == target_view(target, tmp_path / "view")  # a second call finds the index


def test_the_target_view_can_name_the_dtype_spec_forge_loads_the_target_in(tmp_path):
    # SpecForge's in-process SGLang loads the target in its config's dtype; sgl_kernel's
    # norms refuse the float32 a CPU-built toy is saved in (seen on the H200, 2026-12-03).
    target = build_tiny_llama(tmp_path / "target")
    original = (target / "config.json").read_text()
    target_view(target, tmp_path / "view", dtype="bfloat16")
    config = json.loads((tmp_path / "view" / "config.json").read_text())
    assert not (tmp_path / "view" / "config.json").is_symlink()
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert (target / "config.json").read_text() == original
    # the other files stay links to the target's own
    assert (tmp_path / "view" / "model.safetensors").resolve() == target / "model.safetensors"
    target_view(target, tmp_path / "view", dtype="bfloat16")  # a second call rewrites it
    assert json.loads((tmp_path / "view" / "config.json").read_text()) == config


def test_the_draft_config_has_the_runs_layers_and_vocabulary(tmp_path):
    target = build_tiny_llama(tmp_path / "target")
    config = draft_config(target, [1, 3, 4], 128)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 128
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    target_config = json.loads((target / "config.json").read_text())
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads"):
        assert config[key] == target_config[key], key
    assert config["head_dim"] == 32 // 4 and config["rope_theta"] > 0
    assert "rope_scaling" not in config  # the default rope is not a scaling
    with pytest.raises(PipelineError, match=r"aux layers \[1, 1, 4\]: SpecForge needs three"):
        draft_config(target, [1, 1, 4], 128)
    with pytest.raises(PipelineError, match="draft vocabulary 301 for a target vocabulary of 300"):
        draft_config(target, [1, 3, 4], 301)


# ---------------------------------------------------------------- the 8B-shape rows (issue 27)
#
# benchmarks.studies.specforge.scale_steps, run on the H200 by benchmarks.studies.specforge.scale:
# the rows both
# generators read, the kill -9 accounting, the comparison of the two feature sets, and the
# training figures, each on small synthetic files here.

HIDDEN = 8


def test_the_scale_rows_render_and_tokenize_to_their_own_ids_and_mask(tmp_path):
    """The chat template saved with the word tokenizer, rendered by transformers and masked by
    SpecForge's rule, gives each row's ids and mask: what the prepared table holds."""
    from transformers import AutoTokenizer

    from benchmarks.toy_targets.word_tokenizer import save_word_tokenizer

    save_word_tokenizer(tmp_path, 512, scale.CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    rows = scale.scale_rows(6, 40, 512, seed=3)
    assert [len(r.input_ids) for r in rows] == [40] * 6
    for row in rows:  # the markers never occur inside a turn
        header = row.input_ids.index(scale.ASSISTANT)
        content = row.input_ids[1:header] + row.input_ids[header + 1 : -1]
        assert min(content) >= scale.FIRST_CONTENT_ID
    for row in rows:
        assert row.input_ids[0] == scale.USER and row.input_ids[-1] == scale.END_OF_TURN
        theirs = specforge_tokenize(tokenizer, row.messages(), scale.TEMPLATE_SPEC, 10**6)
        assert theirs == (row.input_ids, row.loss_mask), f"row {row.row_id}"
        header = row.input_ids.index(scale.ASSISTANT)
        assert row.loss_mask == [0] * (header + 1) + [1] * (40 - header - 1)
    # A header the tokenizer splits otherwise would not match: the check can fail.
    wrong = {**scale.TEMPLATE_SPEC, "assistant_header": "t4"}
    assert specforge_tokenize(tokenizer, rows[0].messages(), wrong, 10**6)[1] != rows[0].loss_mask


def layer_states(tokens: int, layers: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(layers)]


def write_scale_shard(root, rows: dict[int, tuple[list[int], list[int], list, torch.Tensor]]):
    """A finished shard in the project's format (write_chunk, journal, manifest): one chunk a
    row; aux = the row's first three layer states, final = its final state."""
    shard = f"rows_0-{len(rows)}"
    shard_dir = root / "hidden_states" / shard
    shard_dir.mkdir(parents=True)
    records = []
    for index, (row_id, (ids, mask, layers, final)) in enumerate(sorted(rows.items())):
        row = RowTensors(
            row_id=row_id,
            input_ids=torch.tensor(ids, dtype=torch.int32),
            loss_mask=torch.tensor(mask, dtype=torch.uint8),
            aux_hidden_states=torch.cat(layers[:3], dim=1),
            final_hidden_states=final,
        )
        record = write_chunk(shard_dir, index, [row], hidden_size=HIDDEN)
        append_journal(shard_dir, record, "digest")
        records.append(record)
    manifest = build_manifest(
        shard=shard, row_start=0, row_end=len(rows), hidden_size=HIDDEN,
        aux_layer_ids=[1, 2, 3], records=records, provenance={"engine": "synthetic"}, timing={},
    )  # fmt: skip
    write_manifest(shard_dir, manifest)
    return shard_dir


def write_specforge_file(features, index: int, ids, mask, aux: torch.Tensor, final) -> Path:
    """One sample as SpecForge 0.2's prepare_hidden_states.py saves it (torch.save of
    input_ids [T], loss_mask [T], aux_hidden_state [1, T, 3H], hidden_state [1, T, H])."""
    folder = features / "rows_0-2000"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"data_{index}.ckpt"
    record = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "loss_mask": torch.tensor(mask, dtype=torch.long),
        "aux_hidden_state": aux.unsqueeze(0).clone(),
        "hidden_state": final.unsqueeze(0).clone(),
    }
    torch.save(record, path)
    return path


@pytest.fixture
def feature_rows():
    """Three rows of different lengths: ids, mask, four layer states and the final state."""
    rows = {}
    for row_id, tokens in ((0, 5), (1, 7), (2, 6)):
        ids = [100 + row_id * 10 + t for t in range(tokens)]
        mask = [0, 0] + [1] * (tokens - 2)
        states = layer_states(tokens, 5, seed=row_id)
        rows[row_id] = (ids, mask, states[:4], states[4])
    return rows


def compare(features, shard_dir, specforge_ids=(1, 2, 3)):
    return scale_compare.compare_features(
        features, [shard_dir], specforge_aux_ids=list(specforge_ids), shard_aux_ids=[1, 2, 3]
    )


def test_equal_features_in_both_formats_compare_identical(tmp_path, feature_rows):
    shard_dir = write_scale_shard(tmp_path, feature_rows)
    features = tmp_path / "features"
    # SpecForge numbers its files in its own (shuffled) order: rows are matched by their ids.
    for index, (ids, mask, layers, final) in zip((2, 0, 1), feature_rows.values(), strict=True):
        write_specforge_file(features, index, ids, mask, torch.cat(layers[:3], dim=1), final)
    result = compare(features, shard_dir)
    assert result["rows_compared"] == 3 and result["loss_mask_equal"] == 3
    assert result["verdict"] == "identical on 3 rows"
    for stats in result["blocks"].values():
        assert stats["max_abs_diff"] == 0.0 and stats["min_cos"] >= 0.99999
        assert stats["tokens"] == 18 and stats["rms_ours"] == stats["rms_specforge"]
    assert list(result["blocks"]) == [
        "aux0 (layer 1)", "aux1 (layer 2)", "aux2 (layer 3)", "final (post-norm)"
    ]  # fmt: skip
    # The control: a block against the next layer's is far from equal (the check can tell).
    assert all(s["min_cos"] < 0.9 for s in result["shifted"].values())


def test_a_feature_set_one_layer_off_is_caught(tmp_path, feature_rows):
    """SpecForge's capture one layer later (its aux = layers 2, 3, 4 where ours are 1, 2, 3):
    every aux block differs, the final state still agrees."""
    shard_dir = write_scale_shard(tmp_path, feature_rows)
    features = tmp_path / "features"
    for index, (ids, mask, layers, final) in enumerate(feature_rows.values()):
        write_specforge_file(features, index, ids, mask, torch.cat(layers[1:4], dim=1), final)
    result = compare(features, shard_dir)
    assert result["verdict"].startswith("differ: below cosine 0.999 in aux0 (layer 1), aux1")
    aux = [s for name, s in result["blocks"].items() if name.startswith("aux")]
    assert all(s["max_abs_diff"] > 0.5 and s["min_cos"] < 0.9 for s in aux)
    assert result["blocks"]["final (post-norm)"]["max_abs_diff"] == 0.0
    # Stated layer ids that differ are reported as such before any value.
    assert compare(features, shard_dir, (2, 3, 4))["verdict"].startswith("different layers")


def test_bf16_noise_a_pre_norm_state_and_a_torn_file_are_told_apart(tmp_path, feature_rows):
    shard_dir = write_scale_shard(tmp_path, feature_rows)
    features = tmp_path / "features"
    for index, (ids, mask, layers, final) in enumerate(feature_rows.values()):
        noisy = torch.cat(layers[:3], dim=1).float()
        noisy = (noisy * (1 + 2**-8 * torch.randn(noisy.shape))).to(torch.bfloat16)
        # the final state before a unit-weight RMSNorm: the same direction, another scale
        unnormed = (final.float() * 3.0).to(torch.bfloat16)
        path = write_specforge_file(features, index, ids, mask, noisy, unnormed)
    result = compare(features, shard_dir)
    assert result["verdict"] == "equal within bf16 rounding on 3 rows"
    final = result["blocks"]["final (post-norm)"]
    assert final["min_cos"] >= 0.999 and final["max_abs_diff"] > 1.0
    assert final["rms_specforge"] == pytest.approx(3 * final["rms_ours"], rel=0.01)
    # A file cut short (as a kill mid-write leaves it) cannot be compared, and is named.
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    result = compare(features, shard_dir)
    assert result["rows_compared"] == 2 and result["specforge_unreadable"] == [
        "rows_0-2000/data_2.ckpt"
    ]
    # A file of another shape (two aux layers where the shard has three) is not compared.
    ids, mask, layers, final = feature_rows[0]
    write_specforge_file(features, 0, ids, mask, torch.cat(layers[:2], dim=1), final)
    result = compare(features, shard_dir)
    assert result["rows_compared"] == 1 and result["shape_mismatch"] == ["rows_0-2000/data_0.ckpt"]
    assert result["verdict"] == "differ: other shapes in 1+ rows"


# ---------------------------------------------------------------- kill -9 and the rerun


FAKE_GENERATOR = """
import os, subprocess, sys, time, zipfile
out, rows, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if len(sys.argv) == 4:  # the launcher: like torchrun, the worker in a session of its own
    worker = subprocess.run([sys.executable, *sys.argv, "worker"], start_new_session=True)
    sys.exit(worker.returncode)
os.makedirs(os.path.join(out, "rows_0-2000"), exist_ok=True)
for i in range(rows):
    path = os.path.join(out, "rows_0-2000", f"data_{i}.ckpt")
    if os.path.exists(path):  # SpecForge's resume rule: the file exists, the row is done
        continue
    with zipfile.ZipFile(path, "w") as archive, archive.open("data/0", "w") as member:
        member.write(b"x" * 4096)
        time.sleep(pause)  # mid-file
        member.write(b"y" * 4096)
"""


def test_a_kill_mid_write_leaves_a_torn_file_that_a_file_exists_rerun_takes_as_done(tmp_path):
    """run_and_kill against a stand-in of SpecForge's generator (its worker in its own session,
    as torchrun starts it; files written by the "file exists" rule): the kill lands inside a
    write at half the rows, stops the worker too, and the rerun keeps the torn file."""
    script = tmp_path / "fake_generator.py"
    script.write_text(FAKE_GENERATOR)
    features = tmp_path / "features"
    ctx = Context(Namespace(dry_run=False), None, time.monotonic() + 120)
    command = Command("fake-kill", [sys.executable, str(script), str(features), "8", "0.4"],
                      tmp_path / "kill.log")  # fmt: skip
    run = scale_kill.run_and_kill(
        ctx, [command], scale_kill.SpecforgeWatch(features), 8, scale_kill.KillPlan(fraction=0.5)
    )
    assert run["rows_stored_at_kill"] == 4 and run["write_in_flight_at_kill"]
    at_kill = scale_kill.specforge_snapshot(features)
    time.sleep(1.0)  # the worker is gone: nothing more is written
    assert scale_kill.specforge_snapshot(features) == at_kill
    assert [n for n, f in at_kill.items() if not f["complete"]] == ["rows_0-2000/data_3.ckpt"]

    rerun = subprocess.run([sys.executable, str(script), str(features), "8", "0"], timeout=60)
    assert rerun.returncode == 0
    report = scale_kill.specforge_resume_report(at_kill, scale_kill.specforge_snapshot(features), 8)
    assert report["torn_at_kill"] == 1 and report["torn_taken_as_done"] == 1
    assert (report["kept"], report["new"], report["rewritten"]) == (4, 4, 0)
    assert report["files_after"] == 8 and report["incomplete_files"] == ["rows_0-2000/data_3.ckpt"]
    assert report["complete"] is False


def test_a_rerun_that_rewrites_the_torn_file_is_reported_complete(tmp_path):
    features = tmp_path / "features"
    paths = [write_specforge_file(features, i, [i], [1], torch.zeros(1, 3), torch.zeros(1, 1))
             for i in range(3)]  # fmt: skip
    paths[2].write_bytes(paths[2].read_bytes()[:100])
    at_kill = scale_kill.specforge_snapshot(features)
    time.sleep(0.01)
    write_specforge_file(features, 2, [2], [1], torch.zeros(1, 3), torch.zeros(1, 1))
    write_specforge_file(features, 3, [3], [1], torch.zeros(1, 3), torch.zeros(1, 1))
    report = scale_kill.specforge_resume_report(at_kill, scale_kill.specforge_snapshot(features), 4)
    assert (report["kept"], report["rewritten"], report["new"]) == (2, 1, 1)
    assert report["torn_taken_as_done"] == 0 and report["complete"] is True
    short = scale_kill.specforge_resume_report(at_kill, scale_kill.specforge_snapshot(features), 5)
    assert short["complete"] is False  # a row short


def shard_rows(row_ids: list[int], tokens: int = 4) -> list[RowTensors]:
    return [
        RowTensors(
            row_id=r,
            input_ids=torch.full((tokens,), r, dtype=torch.int32),
            loss_mask=torch.ones(tokens, dtype=torch.uint8),
            aux_hidden_states=torch.full((tokens, 3 * HIDDEN), float(r)).to(torch.bfloat16),
            final_hidden_states=torch.full((tokens, HIDDEN), float(r)).to(torch.bfloat16),
        )
        for r in row_ids
    ]


def test_the_pipelines_rerun_keeps_journalled_chunks_and_redoes_the_rest(tmp_path):
    """A shard as a kill can leave it (two journalled chunks, one renamed but not journalled,
    one temporary file), then the rerun by the real resume rule (verified_chunks) and the rest
    written: the accounting, the rates' inputs and the final check."""
    shard_dir = tmp_path / "hidden_states" / "rows_0-8"
    shard_dir.mkdir(parents=True)
    chunks = [[0, 1], [2, 3], [4, 5], [6, 7]]
    for index in (0, 1, 2):
        record = write_chunk(shard_dir, index, shard_rows(chunks[index]), hidden_size=HIDDEN)
        if index < 2:
            append_journal(shard_dir, record, "digest")
    (shard_dir / ".chunk-00003.safetensors.tmp").write_bytes(b"half a chunk")
    at_kill = {"rows_0-8": scale_kill.shard_snapshot(shard_dir)}
    assert scale_kill.PipelineWatch([shard_dir])() == (4, True)

    time.sleep(0.01)
    kept = verified_chunks(shard_dir, chunks, "digest")
    assert sorted(kept) == [0, 1]
    records = [kept[0], kept[1]]
    for index in (2, 3):
        record = write_chunk(shard_dir, index, shard_rows(chunks[index]), hidden_size=HIDDEN)
        append_journal(shard_dir, record, "digest")
        records.append(record)
    manifest = build_manifest(
        shard="rows_0-8", row_start=0, row_end=8, hidden_size=HIDDEN, aux_layer_ids=[1, 2, 3],
        records=records, provenance={"engine": "synthetic"}, timing={"requests_sent": 4},
    )  # fmt: skip
    write_manifest(shard_dir, manifest)
    after = {"rows_0-8": scale_kill.shard_snapshot(shard_dir)}
    report = scale_kill.pipeline_resume_report(at_kill, after, {"rows_0-8": manifest})
    assert (report["chunks_kept"], report["chunks_written"]) == (2, 2)
    assert (report["rows_kept"], report["rows_redone"], report["requests_sent"]) == (4, 4, 4)
    assert (report["tmp_at_kill"], report["unjournalled_at_kill"], report["tmp_after"]) == (1, 1, 0)
    killed, resumed = scale_kill.pipeline_completions(at_kill, after, {"rows_0-8": manifest})
    assert sorted(t for _, t in killed) == [8, 8] and sorted(t for _, t in resumed) == [8, 8]

    tokens = {r: 4 for r in range(8)}
    check = scale_kill.verify_shards([shard_dir], tokens)
    assert check["ok"] and check["rows"] == 8 and check["tokens"] == 32
    assert not scale_kill.verify_shards([shard_dir], {**tokens, 8: 4})["ok"]  # a row missing
    chunk = shard_dir / "chunk-00002.safetensors"
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    damaged = scale_kill.verify_shards([shard_dir], tokens)
    assert not damaged["ok"] and "corrupt chunk" in damaged["errors"][0]


def test_the_kill_waits_for_half_the_rows_then_for_a_write_in_flight():
    plan = scale_kill.KillPlan(fraction=0.5, wait_for_write_s=5.0)
    assert scale_kill.kill_due(3, 8, True, None, 10.0, plan) == (False, None)
    assert scale_kill.kill_due(4, 8, False, None, 10.0, plan) == (False, 10.0)
    assert scale_kill.kill_due(5, 8, False, 10.0, 14.0, plan) == (False, 10.0)
    assert scale_kill.kill_due(5, 8, True, 10.0, 11.0, plan) == (True, 10.0)
    assert scale_kill.kill_due(6, 8, False, 10.0, 15.0, plan) == (True, 10.0)  # no write came


def test_rates_from_file_times_and_training_logs(tmp_path):
    rate = scale_kill.steady_rate([(12.0, 100), (10.0, 100), (11.0, 100)])
    assert rate == {"files": 3, "tokens": 200, "seconds": 2.0, "tokens_per_s": 100.0}
    assert scale_kill.steady_rate([(10.0, 100)])["tokens_per_s"] is None
    other = scale_kill.steady_rate([(0.0, 50), (1.0, 50), (2.0, 50)])
    assert scale_kill.combined_rate([rate, other, {}]) == round(300 / 4.0, 1)

    log_text = "\n".join(
        [
            "warming up",
            "step 1: {'loss': 9.5, 'perf/optimizer_step_time_s': 2.0}",
            "step 2: {'loss': 9.1, 'perf/optimizer_step_time_s': 0.5, 'acc': [0.1]}",
            "step 3: {'loss': 8.7, 'perf/optimizer_step_time_s': 0.25}",
            "step 4: not a dict",
        ]
    )
    (tmp_path / "train.log").write_text(log_text + "\n")
    steps = scale_compare.specforge_step_times(tmp_path / "train.log")
    assert steps == [(1, 2.0), (2, 0.5), (3, 0.25)]
    figures = scale_compare.training_rate([s for _, s in steps], [100, 100, 100], warmup=1)
    assert figures == {"timed_steps": 2, "timed_tokens": 200, "tokens_per_s": 266.7,
                       "median_step_s": 0.375}  # fmt: skip
    assert scale_compare.training_rate([1.0], [100], warmup=1)["tokens_per_s"] is None


def canned_results(tmp_path, feature_rows) -> dict:
    """What each step of the comparison returns, made by the module's own functions on small
    synthetic inputs (the figures themselves are made up)."""
    shard_dir = write_scale_shard(tmp_path / "canned", feature_rows)
    features = tmp_path / "canned" / "features"
    for index, (ids, mask, layers, final) in enumerate(feature_rows.values()):
        write_specforge_file(features, index, ids, mask, torch.cat(layers[:3], dim=1), final)
    at_kill = scale_kill.specforge_snapshot(features)
    after = {**at_kill, "rows_0-2000/data_9.ckpt": {"bytes": 9, "mtime_ns": 9, "complete": True}}
    rate = scale_kill.steady_rate([(0.0, 2048), (1.0, 2048), (2.0, 2048)])
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    snapshot = scale_kill.shard_snapshot(shard_dir)
    return {
        "model": {"seconds": 40.0, "bytes": 16 << 30},
        "inputs": {"rows": 4, "row_tokens": 2048, "aux_layer_ids": [1, 15, 28]},
        "specforge-kill": {
            "started_at": 0.0, "killed_after_s": 70.0, "rows_stored_at_kill": 2, "rows": 4,
            "write_in_flight_at_kill": True, "fraction_reached_s": 69.0, "snapshot": at_kill,
            "rate": rate, "first_file_s": 60.0, "complete_at_kill": 1,
        },
        "specforge-resume": {
            "wall_s": 65.0, "rate": rate, "first_file_s": 60.0,
            "accounting": scale_kill.specforge_resume_report(at_kill, after, 4),
            "feature_bytes": 4 * 2048 * 32784, "dir_bytes": 4 * 2048 * 32790,
            "snapshot_after": after,
        },
        "pipeline": {
            "server_start_s": 70.0, "engine_version": "0.5.14", "shards": [shard_dir.name],
            "kill": {"killed_after_s": 9.0, "rows_stored_at_kill": 2, "rate": rate,
                     "write_in_flight_at_kill": True, "journal_at_kill": {shard_dir.name: 1},
                     "tmp_at_kill": {shard_dir.name: []}},
            "resume": {"wall_s": 8.0, "rate": rate, "first_chunk_s": 4.0},
            "accounting": scale_kill.pipeline_resume_report(
                {shard_dir.name: snapshot}, {shard_dir.name: snapshot}, {shard_dir.name: manifest}
            ),
            "verify": scale_kill.verify_shards([shard_dir], {0: 5, 1: 7, 2: 6}),
            "handoff_files_left": 0,
        },
        "fidelity": compare(features, shard_dir),
        "train-specforge": {"wall_s": 80.0, "steps": 64, "tokens_per_step": 2048,
                            "batch_rows": 1, "set_aside": ["data_1.ckpt"],
                            **scale_compare.training_rate([0.2] * 64, [2048] * 64, 4)},
        "train-eaglepipe": {"wall_s": 40.0, "batch_tokens": 16384, "tokens_per_s": 19800.0,
                            "timed_steps": 12, "timed_tokens": 196608, "median_step_s": 0.83,
                            "steps": 16, "peak_gpu_memory_gib": 86.8,
                            "data_wait_fraction": 0.0001},
    }  # fmt: skip


def test_the_driver_records_each_step_summarises_and_a_later_call_goes_on(
    tmp_path, feature_rows, monkeypatch
):
    """run_plan with canned steps: the state after each, the results and markdown of a whole
    comparison, a failed step retried by the next call (the done ones not run again), the
    target and features removed at the end, other settings refused, a step left for later."""
    from benchmarks.studies.specforge import scale as driver
    from benchmarks.studies.specforge.steps import StepFailed

    canned, calls = canned_results(tmp_path, feature_rows), []

    def runner(name):
        def run(ctx, step):
            calls.append(name)
            if calls.count(name) == 1 and name == "specforge-kill":
                raise RuntimeError("boom")  # a bug, not a failed command: recorded all the same
            if calls.count(name) == 1 and name == "train-eaglepipe":
                raise StepFailed("train-eaglepipe: exit 1")
            return canned[name]

        return run

    monkeypatch.setattr(scale, "RUNNERS", {name: runner(name) for name in scale.RUNNERS})
    work, out = tmp_path / "work", tmp_path / "out" / "scale.json"
    argv = ["--work-root", str(work), "--out", str(out), "--rows", "4"]
    (work / "model").mkdir(parents=True)
    assert driver.main(argv) == 1
    state = json.loads((work / "state.json").read_text())
    assert state["steps"]["specforge-kill"] == {
        **state["steps"]["specforge-kill"], "status": "failed", "error": "RuntimeError: boom"
    }  # fmt: skip
    assert state["steps"]["train-eaglepipe"]["status"] == "failed"
    assert state["steps"]["pipeline"]["status"] == "done" and (work / "model").is_dir()
    assert "specforge-resume" not in state["steps"]  # it needs the kill run
    results = json.loads(out.read_text())
    assert results["remaining"] == [
        "specforge-kill", "specforge-resume", "fidelity", "train-specforge", "train-eaglepipe"
    ]  # fmt: skip
    assert results["generation"]["specforge"] == {} and results["generation"]["eaglepipe"]
    assert "| rerun wall s | n/a | 8.000 |" in out.with_suffix(".md").read_text()

    assert driver.main(argv) == 0
    assert calls.count("train-eaglepipe") == 2 and calls.count("pipeline") == 1
    results = json.loads(out.read_text())
    specforge, eaglepipe = results["generation"]["specforge"], results["generation"]["eaglepipe"]
    assert specforge["tokens_per_s"] == eaglepipe["tokens_per_s"] == 2048.0
    assert specforge["end_to_end_tokens_per_s"] == round(4 * 2048 / 135.0, 1)
    assert eaglepipe["end_to_end_tokens_per_s"] == round(4 * 2048 / 87.0, 1)
    assert specforge["after_kill_and_rerun"]["new"] == 1 and eaglepipe["verify"]["ok"]
    assert results["fidelity"]["verdict"] == "identical on 3 rows"
    assert results["remaining"] == [] and results["training"]["eaglepipe_over_specforge"] == round(
        19800.0 / 10240.0, 3
    )
    table = out.with_suffix(".md").read_text()
    assert "| tokens/s (steady: file mtimes, both runs) | 2,048 | 2,048 |" in table
    assert (
        "**Verdict: identical on 3 rows**" in table and "| specforge | 1 row (2048 tokens)" in table
    )
    assert not (work / "model").exists() and (work / "state.json").is_file()

    assert driver.main([*argv[:-1], "8"]) == 2  # another comparison's state: refused
    fresh = ["--work-root", str(tmp_path / "other"), "--out", str(out), "--deadline-s", "10"]
    assert driver.main(fresh) == scale.EXIT_LEFT_FOR_LATER  # no step fits in 10 s
