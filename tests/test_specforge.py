"""SpecForge's inputs made from an eaglepipe run (benchmarks/specforge_data.py, issue 27), on CPU:
nothing of SpecForge runs here.

- The conversion keeps held-out rows, and rows prepare skipped, out of SpecForge's JSONL.
- The toy target's template JSON, under SpecForge's masking rule, gives the input_ids and loss
  mask chat_mask.py gives, on every sample row. What is tested is the rule as written here from
  SpecForge 0.2.0's source (specforge/data/parse.py, GeneralParser): SpecForge itself is not
  installed in the suite. That this rule equals SpecForge's own parser on these rows was checked
  once, outside the suite (docs/specforge.md); on the H200, bench_specforge.py checks SpecForge's
  stored features against the prepared table as well (`compare_with_table`, tested below).
- The target view and draft config SpecForge's loaders need.
"""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest
import torch
import yaml
from conftest import REPO_ROOT, build_tiny_llama

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from specforge_data import (  # noqa: E402
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

from eaglepipe.core.errors import PipelineError  # noqa: E402
from eaglepipe.core.run import resolve  # noqa: E402
from eaglepipe.data.chat_mask import tokenize_conversation  # noqa: E402
from eaglepipe.data.dataset import RowProblem, read_conversations  # noqa: E402
from eaglepipe.data.toy_target import corpus_texts, train_tokenizer  # noqa: E402
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
